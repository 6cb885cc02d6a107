//! The ops a lowered module tree adds (`Op::Copy`, `Op::Add`, `Op::Mul`,
//! `Op::ActivationSavingDerivative`, the token-layout attention ops and
//! `Op::SoftmaxCrossEntropy`) on the CUDA device against the host device, on whole buffers
//! and on views (DEVOP-2), with the helpers of `device_tests.rs`. Each test opens GPU 0
//! first and prints `skipped: <reason>` when there is none.

use shardline_collectives::device::{CpuDevice, Device};

use super::device_tests::{
    assert_close, check, check_views, gpu, ids, randn, run_on, ELEMENTWISE, REDUCTION,
};
use crate::nn::activation::Activation;
use crate::nn::attention::AttnShape;
use crate::ops::Op;
use crate::rng::SplitMix64;

#[test]
fn copy_add_mul_and_the_saving_activation_match_the_host_device() {
    let test = "copy_add_mul_and_the_saving_activation_match_the_host_device";
    let Some(d) = gpu(test, None) else { return };
    let mut rng = SplitMix64::new(31);
    // 0: empty buffers; 1: a single element; 257 and 1000: not multiples of the block.
    for n in [0usize, 1, 257, 1000] {
        let (a, b, c) = (randn(&mut rng, n), randn(&mut rng, n), randn(&mut rng, n));
        // One IEEE operation per element (or none): the same bits as the host.
        check(&d, Op::Copy, std::slice::from_ref(&a), std::slice::from_ref(&c), 0.0);
        check(&d, Op::Add, &[a.clone(), b.clone()], std::slice::from_ref(&c), 0.0);
        check(&d, Op::Mul, &[a.clone(), b.clone()], std::slice::from_ref(&c), 0.0);
        // Wide inputs: the tails of erf, tanh and exp.
        let wide: Vec<f32> = a.iter().map(|v| v * 6.0).collect();
        for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
            let writes = [randn(&mut rng, n), randn(&mut rng, n)];
            let op = Op::ActivationSavingDerivative(act);
            check(&d, op, std::slice::from_ref(&wide), &writes, ELEMENTWISE);
        }
    }
    // Special values: the copy moves every bit (NaN payloads and -0 included).
    let special = vec![0.0, -0.0, f32::NAN, f32::from_bits(0x7fc0_1234), 1e-40, -1e-30, 1e30];
    let got = run_on(&d, &Op::Copy, std::slice::from_ref(&special), &[vec![3.0; 7]]);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got[0]), bits(&special), "copy");
    // Special values: tails and signed zeros within the tolerance; then huge inputs, whose
    // scale leaves a check that every value stays finite (ACTIV-4).
    let tails = vec![0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 3.5, -0.75, 9.0];
    let huge = vec![1e30, -1e30, f32::MAX, -f32::MAX, 1e19, -1e19, 1e13, -1e13, 0.5];
    for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
        for x in [&tails, &huge] {
            let writes = [vec![7.0; 9], vec![7.0; 9]];
            let op = Op::ActivationSavingDerivative(act);
            check(&d, op, std::slice::from_ref(x), &writes, ELEMENTWISE);
        }
    }
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

/// The fused `[batch, seq, 3 embd]` q, k, v as three `[batch, heads, seq, head_dim]`
/// buffers.
fn heads_of_tokens(s: &AttnShape, qkv: &[f32]) -> Vec<Vec<f32>> {
    let (e, d) = (s.embd(), s.head_dim);
    (0..3)
        .map(|part| {
            let mut out = Vec::with_capacity(s.numel());
            for b in 0..s.batch {
                for h in 0..s.heads {
                    for i in 0..s.seq {
                        let at = (b * s.seq + i) * 3 * e + part * e + h * d;
                        out.extend_from_slice(&qkv[at..at + d]);
                    }
                }
            }
            out
        })
        .collect()
}

/// A `[batch, heads, seq, head_dim]` buffer as `[batch, seq, heads * head_dim]`.
fn tokens_of_heads(s: &AttnShape, x: &[f32]) -> Vec<f32> {
    let d = s.head_dim;
    let mut out = Vec::with_capacity(s.numel());
    for b in 0..s.batch {
        for i in 0..s.seq {
            for h in 0..s.heads {
                let at = ((b * s.heads + h) * s.seq + i) * d;
                out.extend_from_slice(&x[at..at + d]);
            }
        }
    }
    out
}

#[test]
fn token_layout_attention_matches_the_host_device() {
    let Some(d) = gpu("token_layout_attention_matches_the_host_device", None) else { return };
    let cpu = CpuDevice::new();
    let mut rng = SplitMix64::new(37);
    // seq 5 and 1; 70: past the host's block of 64; 300: past the kernels' tile of 256.
    // head_dim 4, 3, 16 and 64; one and several heads.
    for &(batch, heads, seq, head_dim) in
        &[(2, 2, 5, 4), (2, 3, 70, 16), (1, 2, 300, 64), (2, 2, 1, 4), (3, 1, 70, 3)]
    {
        let shape = AttnShape { batch, heads, seq, head_dim };
        let (n, rows) = (shape.numel(), shape.rows());
        let qkv = randn(&mut rng, 3 * n);
        let fwd = Op::AttentionForwardTokens(shape);
        let writes = [randn(&mut rng, n), randn(&mut rng, rows)];
        check(&d, fwd.clone(), std::slice::from_ref(&qkv), &writes, REDUCTION);
        // The host's output and logsumexp as inputs to both devices' backward.
        let saved = run_on(&cpu, &fwd, std::slice::from_ref(&qkv), &writes);
        let dy = randn(&mut rng, n);
        let reads = [qkv.clone(), saved[0].clone(), saved[1].clone(), dy.clone()];
        let bwd = Op::AttentionBackwardTokens(shape);
        let dqkv = [randn(&mut rng, 3 * n)];
        check(&d, bwd.clone(), &reads, &dqkv, REDUCTION);
        // No atomics: dqkv is the same bits on a second run.
        let once = run_on(&d, &bwd, &reads, &dqkv);
        assert_eq!(once, run_on(&d, &bwd, &reads, &dqkv), "{shape:?}");

        // The two layouts share the kernels' bodies: the head-layout ops on the same values
        // rearranged give the same bits.
        let qkv_heads = heads_of_tokens(&shape, &qkv);
        let tok = run_on(&d, &fwd, std::slice::from_ref(&qkv), &writes);
        let head_fwd = Op::AttentionForward(shape);
        let hd = run_on(&d, &head_fwd, &qkv_heads, &[vec![0.0; n], vec![0.0; rows]]);
        assert_eq!(tok[0], tokens_of_heads(&shape, &hd[0]), "{shape:?}: output");
        assert_eq!(tok[1], hd[1], "{shape:?}: logsumexp");
        let mut head_reads = qkv_heads;
        head_reads.extend([hd[0].clone(), hd[1].clone(), heads_of_merged(&shape, &dy)]);
        let grads = run_on(&d, &Op::AttentionBackward(shape), &head_reads, &vec![vec![0.0; n]; 3]);
        let tok_reads = [qkv.clone(), tok[0].clone(), tok[1].clone(), dy.clone()];
        let tok_grads = heads_of_tokens(&shape, &run_on(&d, &bwd, &tok_reads, &dqkv)[0]);
        // (The second pass is two entry points around one body: the same arithmetic, here
        // allowed to differ in the last bits.)
        for (part, (t, h)) in ["dq", "dk", "dv"].iter().zip(tok_grads.iter().zip(&grads)) {
            assert_close(&format!("{shape:?}: {part} of the two layouts"), t, h, 1e-6);
        }
    }
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

/// A `[batch, seq, heads * head_dim]` buffer as `[batch, heads, seq, head_dim]`.
fn heads_of_merged(s: &AttnShape, y: &[f32]) -> Vec<f32> {
    let (e, d) = (s.embd(), s.head_dim);
    let mut out = Vec::with_capacity(s.numel());
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..s.seq {
                let at = (b * s.seq + i) * e + h * d;
                out.extend_from_slice(&y[at..at + d]);
            }
        }
    }
    out
}

#[test]
fn softmax_cross_entropy_matches_the_host_device() {
    let Some(d) = gpu("softmax_cross_entropy_matches_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(41);
    // A global batch equal to the rows and larger (a rank's share, LOSS-1); no row, with a
    // global batch of 0 and of 6; a row of one class; rows and classes past a block.
    for &(rows, classes, global) in &[
        (5, 7, 5),
        (3, 1000, 8),
        (1, 1, 1),
        (0, 4, 0),
        (0, 4, 6),
        (600, 33, 1000),
        (300, 300, 300),
    ] {
        let logits: Vec<f32> = randn(&mut rng, rows * classes).iter().map(|v| v * 4.0).collect();
        let targets = ids(&mut rng, rows, classes as u32);
        let writes = [vec![5.0], randn(&mut rng, rows * classes)];
        let op = Op::SoftmaxCrossEntropy { classes, global };
        check(&d, op, &[logits, targets], &writes, REDUCTION);
    }
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

#[test]
fn the_model_ops_on_views_reach_only_the_views_devop_2() {
    let test = "the_model_ops_on_views_reach_only_the_views_devop_2";
    let Some(d) = gpu(test, None) else { return };
    let d: &dyn Device = &d;
    let mut rng = SplitMix64::new(43);
    // Copy, add, multiply and the saving activation at odd offsets; the add's and the
    // multiply's two reads views of one allocation.
    let bufs = [randn(&mut rng, 300), randn(&mut rng, 301), randn(&mut rng, 260)];
    check_views(d, Op::Copy, &bufs, &[(0, 17..274)], &[(1, 1..258)], 0.0);
    check_views(d, Op::Add, &bufs, &[(0, 0..257), (0, 40..297)], &[(1, 44..301)], 0.0);
    check_views(d, Op::Mul, &bufs, &[(0, 3..260), (0, 1..258)], &[(2, 2..259)], 0.0);
    let act = Op::ActivationSavingDerivative(Activation::Gelu);
    check_views(d, act, &bufs, &[(0, 5..105)], &[(1, 7..107), (2, 150..250)], ELEMENTWISE);
    // The token-layout attention forward and backward over views.
    let shape = AttnShape { batch: 2, heads: 2, seq: 5, head_dim: 4 };
    let (n, rows) = (shape.numel(), shape.rows());
    let bufs = [randn(&mut rng, 3 * n + 9), randn(&mut rng, n + 11), randn(&mut rng, rows + 6)];
    let (reads, writes) = ([(0, 4..4 + 3 * n)], [(1, 3..3 + n), (2, 5..5 + rows)]);
    let fwd = Op::AttentionForwardTokens(shape);
    check_views(d, fwd.clone(), &bufs, &reads, &writes, REDUCTION);
    let saved = run_on(
        &CpuDevice::new(),
        &fwd,
        &[bufs[0][4..4 + 3 * n].to_vec()],
        &[vec![0.0; n], vec![0.0; rows]],
    );
    let mut inputs = bufs[0][4..4 + 3 * n].to_vec();
    inputs.extend(&saved[0]);
    inputs.extend(&saved[1]);
    inputs.extend(randn(&mut rng, n));
    let (q, y, l) = (3 * n, 4 * n, 4 * n + rows);
    let bufs = [inputs, randn(&mut rng, 3 * n + 5)];
    let reads = [(0, 0..q), (0, q..y), (0, y..l), (0, l..l + n)];
    let bwd = Op::AttentionBackwardTokens(shape);
    check_views(d, bwd, &bufs, &reads, &[(1, 2..2 + 3 * n)], REDUCTION);
    // The classification loss over views.
    let (rows, classes) = (7, 9);
    let mut inputs = randn(&mut rng, rows * classes + 3);
    inputs.extend(ids(&mut rng, rows, classes as u32));
    let bufs = [inputs, randn(&mut rng, 4), randn(&mut rng, rows * classes + 6)];
    let (t, e) = (rows * classes + 3, rows * classes + 3 + rows);
    let op = Op::SoftmaxCrossEntropy { classes, global: 20 };
    let writes = [(1, 1..2), (2, 3..3 + rows * classes)];
    check_views(d, op, &bufs, &[(0, 3..t), (0, t..e)], &writes, REDUCTION);
}
