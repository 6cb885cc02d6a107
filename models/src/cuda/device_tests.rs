//! The CUDA device against the host device (`CpuDevice`, which runs each op's host
//! reference) on the same inputs, on whole buffers and on views (DEVOP-2), and its stream,
//! event and memory rules (CUDADEV-1..5, CUDANCCL-1..3). Each test opens GPU 0 first and
//! prints `skipped: <reason>` when there is none. The ops a lowered module tree adds are
//! tested in `device_tests_model.rs`, with this file's helpers.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use shardline_collectives::device::{
    CpuDevice, Device, DeviceBuffer, DeviceComm, DeviceError, DeviceOp,
};
use shardline_collectives::store::MemStore;

use super::device::CudaDevice;
use super::nccl::NcclComm;
use crate::backend::GemmShape;
use crate::nn::activation::Activation;
use crate::nn::attention::AttnShape;
use crate::nn::embedding::Embedding;
use crate::nn::linear::Linear;
use crate::nn::norm::LayerNorm;
use crate::ops::{load_f64, AdamWStep, Op, SgdStep};
use crate::rng::SplitMix64;

/// GPU 0, or `None` after printing why the test is skipped.
pub(super) fn gpu(test: &str, capacity: Option<u64>) -> Option<CudaDevice> {
    match CudaDevice::open(0, capacity) {
        Ok(d) => Some(d),
        Err(DeviceError::Unavailable(why)) => {
            println!("skipped: {test}: {why}");
            None
        }
        Err(e) => panic!("{test}: a GPU that does not open: {e}"),
    }
}

pub(super) fn randn(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

/// Ids (or targets) below `below`, as the `u32` bits device elements carry.
pub(super) fn ids(rng: &mut SplitMix64, n: usize, below: u32) -> Vec<f32> {
    (0..n).map(|_| f32::from_bits((rng.normal().abs() * 1e4) as u32 % below)).collect()
}

/// Elementwise within `rel` of the larger of 1 and the largest `want` (NaN where NaN).
pub(super) fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().filter(|v| v.is_finite()).fold(1.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: {g} vs NaN");
        } else {
            assert!((g - w).abs() <= rel * scale, "{what}[{i}]: {g} vs {w} (scale {scale})");
        }
    }
}

/// Runs `op` on `d` over buffers holding `reads` and `writes`; returns the written ones.
pub(super) fn run_on(
    d: &dyn Device,
    op: &Op,
    reads: &[Vec<f32>],
    writes: &[Vec<f32>],
) -> Vec<Vec<f32>> {
    let s = d.stream("compute");
    let put = |v: &Vec<f32>, label: String| {
        let b = d.alloc(v.len(), &label).unwrap();
        d.upload(s, v, &b).unwrap();
        b
    };
    let rb: Vec<DeviceBuffer> =
        reads.iter().enumerate().map(|(i, v)| put(v, format!("read {i}"))).collect();
    let wb: Vec<DeviceBuffer> =
        writes.iter().enumerate().map(|(i, v)| put(v, format!("write {i}"))).collect();
    d.launch_op(
        s,
        op.clone().arc(),
        &rb.iter().collect::<Vec<_>>(),
        &wb.iter().collect::<Vec<_>>(),
    )
    .unwrap_or_else(|e| panic!("{op:?}: {e}"));
    let out = wb.iter().map(|b| d.download(s, b).unwrap().wait(d).unwrap()).collect();
    for b in rb.into_iter().chain(wb) {
        d.free(s, b).unwrap();
    }
    out
}

/// `op` on the GPU against the host device, within `rel` (CUDA-1's tolerances).
pub(super) fn check(gpu: &CudaDevice, op: Op, reads: &[Vec<f32>], writes: &[Vec<f32>], rel: f32) {
    let cpu = CpuDevice::new();
    let want = run_on(&cpu, &op, reads, writes);
    let got = run_on(gpu, &op, reads, writes);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(&format!("{op:?} write {i}"), g, w, rel);
    }
}

pub(super) const ELEMENTWISE: f32 = 1e-5;
pub(super) const REDUCTION: f32 = 1e-4;

#[test]
fn open_without_a_gpu_is_unavailable_cudadev_4() {
    match CudaDevice::open(0, None) {
        Ok(d) => println!("GPU present ({}): nothing to check", d.name()),
        Err(DeviceError::Unavailable(what)) => {
            assert!(what.contains("not found") || what.contains("no CUDA device"), "{what}")
        }
        Err(e) => panic!("expected Unavailable, got {e}"),
    }
    // An ordinal past the last device is refused the same way.
    match CudaDevice::open(1 << 20, None) {
        Err(DeviceError::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn elementwise_ops_match_the_host_device() {
    let Some(d) = gpu("elementwise_ops_match_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(11);
    // 257 and 1000: not multiples of the block; 1: a single element.
    for n in [1usize, 257, 1000] {
        let x = randn(&mut rng, n);
        let y = randn(&mut rng, n);
        let dy = randn(&mut rng, n);
        check(&d, Op::Fill { value: -1.25 }, &[], std::slice::from_ref(&y), 0.0);
        check(
            &d,
            Op::Axpy { alpha: 0.75 },
            std::slice::from_ref(&x),
            std::slice::from_ref(&y),
            ELEMENTWISE,
        );
        check(&d, Op::Relu, std::slice::from_ref(&x), std::slice::from_ref(&y), 0.0);
        check(&d, Op::ReluBackward, &[x.clone(), dy.clone()], std::slice::from_ref(&y), 0.0);
        // Wide inputs: the tails of erf, tanh and exp.
        let wide: Vec<f32> = x.iter().map(|v| v * 6.0).collect();
        for a in [Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
            check(
                &d,
                Op::Activation(a),
                std::slice::from_ref(&wide),
                std::slice::from_ref(&y),
                ELEMENTWISE,
            );
            check(
                &d,
                Op::ActivationBackward(a),
                &[wide.clone(), dy.clone()],
                std::slice::from_ref(&y),
                ELEMENTWISE,
            );
        }
    }
    // Special values.
    let special = vec![0.0, -0.0, f32::NAN, 1e-30, -1e-30, 50.0, -50.0, 1e30, -1e30];
    check(&d, Op::Relu, std::slice::from_ref(&special), &[vec![3.0; special.len()]], 0.0);
    check(&d, Op::ReluBackward, &[special.clone(), vec![2.0; 9]], &[vec![3.0; 9]], 0.0);
}

#[test]
fn gemm_matches_the_host_device_for_every_transpose() {
    let Some(d) = gpu("gemm_matches_the_host_device_for_every_transpose", None) else { return };
    let mut rng = SplitMix64::new(3);
    for &(m, n, k) in
        &[(1, 1, 1), (3, 5, 7), (17, 9, 33), (64, 40, 1), (0, 3, 2), (2, 3, 0), (128, 96, 200)]
    {
        let a = randn(&mut rng, m * k);
        let b = randn(&mut rng, k * n);
        let c = randn(&mut rng, m * n);
        for trans_a in [false, true] {
            for trans_b in [false, true] {
                for accumulate in [false, true] {
                    let shape = GemmShape { m, n, k, trans_a, trans_b };
                    check(
                        &d,
                        Op::Gemm { shape, accumulate },
                        &[a.clone(), b.clone()],
                        std::slice::from_ref(&c),
                        REDUCTION,
                    );
                }
            }
        }
    }
}

#[test]
fn linear_layers_match_the_host_device() {
    let Some(d) = gpu("linear_layers_match_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(5);
    for &(rows, i, o) in &[(4, 5, 3), (9, 33, 17), (0, 4, 2), (300, 7, 260)] {
        for bias in [true, false] {
            let l = Linear::new(i, o, bias);
            let params = randn(&mut rng, l.num_params());
            let x = randn(&mut rng, rows * i);
            let y = randn(&mut rng, rows * o);
            let dy = randn(&mut rng, rows * o);
            check(&d, Op::LinearForward(l), &[params.clone(), x.clone()], &[y], REDUCTION);
            let grads = randn(&mut rng, l.num_params());
            let dx = randn(&mut rng, rows * i);
            for input_grad in [true, false] {
                let writes =
                    if input_grad { vec![grads.clone(), dx.clone()] } else { vec![grads.clone()] };
                check(
                    &d,
                    Op::LinearBackward { linear: l, input_grad },
                    &[params.clone(), x.clone(), dy.clone()],
                    &writes,
                    REDUCTION,
                );
            }
        }
    }
}

#[test]
fn layer_norm_matches_the_host_device() {
    let Some(d) = gpu("layer_norm_matches_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(7);
    // 300: wider than a block and not a multiple of it; 1: a zero-variance row.
    for &(rows, dim) in &[(4, 5), (7, 300), (3, 1), (0, 8)] {
        for bias in [true, false] {
            let ln = LayerNorm { dim, eps: 1e-5f32, bias };
            let params = randn(&mut rng, ln.num_params());
            // An offset mean, as activations have.
            let x: Vec<f32> = randn(&mut rng, rows * dim).iter().map(|v| v + 3.0).collect();
            let fwd_writes = vec![randn(&mut rng, rows * dim), vec![0.0; rows], vec![0.0; rows]];
            check(
                &d,
                Op::LayerNormForward(ln),
                &[params.clone(), x.clone()],
                &fwd_writes,
                REDUCTION,
            );
            // The saved statistics from the host, as inputs to both devices' backward.
            let saved = run_on(
                &CpuDevice::new(),
                &Op::LayerNormForward(ln),
                &[params.clone(), x.clone()],
                &fwd_writes,
            );
            let dy = randn(&mut rng, rows * dim);
            let writes = vec![randn(&mut rng, rows * dim), randn(&mut rng, ln.num_params())];
            check(
                &d,
                Op::LayerNormBackward(ln),
                &[params, x, saved[1].clone(), saved[2].clone(), dy],
                &writes,
                REDUCTION,
            );
        }
    }
}

#[test]
fn cross_entropy_matches_the_host_device() {
    let Some(d) = gpu("cross_entropy_matches_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(9);
    for &(rows, vocab) in &[(5, 7), (3, 1000), (1, 1), (0, 4), (600, 33)] {
        let logits: Vec<f32> = randn(&mut rng, rows * vocab).iter().map(|v| v * 4.0).collect();
        let targets = ids(&mut rng, rows, vocab as u32);
        let writes = vec![vec![5.0], randn(&mut rng, rows * vocab)];
        check(&d, Op::CrossEntropy { vocab, dloss: 1.7 }, &[logits, targets], &writes, REDUCTION);
    }
}

#[test]
fn embedding_matches_the_host_device() {
    let Some(d) = gpu("embedding_matches_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(13);
    for &(vocab, dim, n) in &[(10, 7, 30), (5, 300, 9), (3, 1, 1)] {
        let e = Embedding::new(vocab, dim);
        let table = randn(&mut rng, e.num_params());
        // Repeated ids: the backward's rows add up.
        let id = ids(&mut rng, n, vocab as u32);
        check(&d, Op::EmbeddingForward(e), &[table, id.clone()], &[randn(&mut rng, n * dim)], 0.0);
        let dy = randn(&mut rng, n * dim);
        check(
            &d,
            Op::EmbeddingBackward(e),
            &[id, dy],
            &[randn(&mut rng, e.num_params())],
            REDUCTION,
        );
    }
}

#[test]
fn sum_of_squares_matches_the_host_device() {
    let Some(d) = gpu("sum_of_squares_matches_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(17);
    // 300_000: more than the first pass's 1024 blocks of 256 cover in one sweep.
    for n in [0usize, 1, 257, 300_000] {
        let x = randn(&mut rng, n);
        let want =
            run_on(&CpuDevice::new(), &Op::SumSquares, std::slice::from_ref(&x), &[vec![0.0; 2]]);
        let got = run_on(&d, &Op::SumSquares, std::slice::from_ref(&x), &[vec![0.0; 2]]);
        let (g, w) = (load_f64(&got[0]), load_f64(&want[0]));
        assert!((g - w).abs() <= 1e-12 * w.abs().max(1.0), "n {n}: {g} vs {w}");
    }
}

#[test]
fn clipping_and_norm_sums_match_the_host_device() {
    let Some(d) = gpu("clipping_and_norm_sums_match_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(19);
    let g = randn(&mut rng, 1000);
    for max_norm in [0.5, 1e9] {
        let sums = vec![0.3, 9.0, 0.0];
        check(&d, Op::ClipScale { max_norm }, &[sums], std::slice::from_ref(&g), ELEMENTWISE);
    }
    let mut sq = vec![0.0f32; 8];
    for u in 0..4 {
        crate::ops::store_f64(0.1 + u as f64, &mut sq[2 * u..2 * u + 2]);
    }
    let op = Op::NormSums { units: 4, stop: 1.0 };
    check(&d, op, &[vec![2.5], sq], &[vec![0.0; 3]], 0.0);
}

#[test]
fn batch_norm_ops_match_the_host_device() {
    let Some(d) = gpu("batch_norm_ops_match_the_host_device", None) else { return };
    let cpu = CpuDevice::new();
    let mut rng = SplitMix64::new(23);
    // s = 1 ([N, C]) with a batch past a block; planes of 257 and 300 values (past a block,
    // not multiples of it); 70 channels; an empty slice of a SyncBatchNorm batch.
    for &(n, c, s) in &[(8, 5, 1), (300, 3, 1), (4, 3, 257), (2, 70, 9), (1, 2, 300), (0, 4, 3)] {
        let len = n * c * s;
        let x: Vec<f32> = randn(&mut rng, len).iter().map(|v| 2.0 * v + 3.0).collect();
        let stats = Op::BatchNormStats { n, c, s };
        let junk = |rng: &mut SplitMix64, lens: &[usize]| -> Vec<Vec<f32>> {
            lens.iter().map(|&l| randn(rng, l)).collect()
        };
        check(&d, stats.clone(), std::slice::from_ref(&x), &junk(&mut rng, &[c, c]), REDUCTION);
        let st = run_on(&cpu, &stats, std::slice::from_ref(&x), &[vec![0.0; c], vec![0.0; c]]);
        // This slice's own count, and a larger global batch (SyncBatchNorm).
        for count in [n * s, 3 * n * s + 2].into_iter().filter(|&k| k >= 2) {
            let params = randn(&mut rng, 2 * c);
            let fwd = Op::BatchNormForward { n, c, s, count, eps: 1e-5 };
            let reads = [x.clone(), params.clone(), st[0].clone(), st[1].clone()];
            check(&d, fwd.clone(), &reads, &junk(&mut rng, &[len, len, c]), ELEMENTWISE);
            let f = run_on(&cpu, &fwd, &reads, &[vec![0.0; len], vec![0.0; len], vec![0.0; c]]);
            let dy = randn(&mut rng, len);
            let red = Op::BatchNormBackwardReduce { n, c, s };
            let reads = [dy.clone(), f[1].clone()];
            check(&d, red.clone(), &reads, &junk(&mut rng, &[2 * c, 2 * c]), REDUCTION);
            let sums = run_on(&cpu, &red, &reads, &[vec![0.0; 2 * c], vec![0.0; 2 * c]]);
            let dx = Op::BatchNormBackwardDx { n, c, s, count };
            let reads = [params, f[1].clone(), f[2].clone(), sums[0].clone(), dy];
            check(&d, dx, &reads, &junk(&mut rng, &[len]), ELEMENTWISE);
        }
    }
}

#[test]
fn attention_ops_match_the_host_device() {
    let Some(d) = gpu("attention_ops_match_the_host_device", None) else { return };
    let cpu = CpuDevice::new();
    let mut rng = SplitMix64::new(29);
    // head_dim 16 and 64 (and 3); seq 1, and 37, 300, 513: not multiples of the kernels' tile
    // of 256 or the host's block of 64, and past one and two tiles.
    for &(batch, heads, seq, head_dim) in
        &[(2, 3, 37, 16), (1, 2, 300, 64), (2, 2, 1, 16), (1, 1, 513, 16), (3, 1, 70, 3)]
    {
        let shape = AttnShape { batch, heads, seq, head_dim };
        let (n, rows) = (shape.numel(), shape.rows());
        let qkv: Vec<Vec<f32>> = (0..3).map(|_| randn(&mut rng, n)).collect();
        let fwd = Op::AttentionForward(shape);
        check(&d, fwd.clone(), &qkv, &[randn(&mut rng, n), randn(&mut rng, rows)], REDUCTION);
        // The host's output and logsumexp as inputs to both devices' backward.
        let saved = run_on(&cpu, &fwd, &qkv, &[vec![0.0; n], vec![0.0; rows]]);
        let mut reads = qkv.clone();
        reads.extend([saved[0].clone(), saved[1].clone(), randn(&mut rng, n)]);
        let writes: Vec<Vec<f32>> = (0..3).map(|_| randn(&mut rng, n)).collect();
        check(&d, Op::AttentionBackward(shape), &reads, &writes, REDUCTION);
        // No atomics: dq, dk and dv are the same bits on a second run.
        let once = run_on(&d, &Op::AttentionBackward(shape), &reads, &writes);
        assert_eq!(once, run_on(&d, &Op::AttentionBackward(shape), &reads, &writes), "{shape:?}");
    }
    // A head too wide for the kernels' shared memory is refused; the device stays usable.
    let wide = AttnShape { batch: 1, heads: 1, seq: 2, head_dim: 20_000 };
    let s = d.stream("s");
    let bufs: Vec<DeviceBuffer> =
        [wide.numel(), wide.numel(), wide.numel(), wide.numel(), wide.rows()]
            .iter()
            .map(|&l| d.alloc(l, "attention").unwrap())
            .collect();
    let (r, w) = (&[&bufs[0], &bufs[1], &bufs[2]], &[&bufs[3], &bufs[4]]);
    let e = d.launch_op(s, Op::AttentionForward(wide).arc(), r, w).expect_err("too wide");
    assert!(matches!(&e, DeviceError::Invalid(m) if m.contains("shared memory")), "{e}");
    assert!(d.failure().is_none());
    for b in bufs {
        d.free(s, b).unwrap();
    }
}

#[test]
fn optimizer_updates_match_the_host_device() {
    let Some(d) = gpu("optimizer_updates_match_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(19);
    for n in [1usize, 257, 1000] {
        let g = randn(&mut rng, n);
        let p = randn(&mut rng, n);
        let buf = randn(&mut rng, n);
        for (momentum, nesterov) in [(0.0, false), (0.9, false), (0.9, true)] {
            for step in [1, 2] {
                let s = SgdStep {
                    lr: 0.1,
                    momentum,
                    dampening: 0.1,
                    weight_decay: 0.01,
                    nesterov,
                    step,
                };
                // Without momentum the momentum buffer may be empty.
                let b = if momentum == 0.0 { Vec::new() } else { buf.clone() };
                check(&d, Op::Sgd(s), std::slice::from_ref(&g), &[p.clone(), b], ELEMENTWISE);
            }
        }
        let st: Vec<f32> = randn(&mut rng, 2 * n).iter().map(|v| v.abs()).collect();
        for step in [1, 3] {
            let a = AdamWStep {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
                step,
            };
            check(
                &d,
                Op::AdamW(a),
                std::slice::from_ref(&g),
                &[p.clone(), st.clone()],
                ELEMENTWISE,
            );
        }
    }
}

#[test]
fn host_closures_and_foreign_ops_are_refused_cudadev_1() {
    let Some(d) = gpu("host_closures_and_foreign_ops_are_refused_cudadev_1", None) else { return };
    let s = d.stream("s");
    let a = d.alloc(4, "a").unwrap();
    let e = d.launch(s, "axpy", &[], &[&a], Box::new(|_, _| {})).expect_err("host code");
    assert!(
        matches!(&e, DeviceError::Invalid(m) if m.contains("kernel 'axpy' is host code")),
        "{e}"
    );
    #[derive(Debug)]
    struct Foreign;
    impl DeviceOp for Foreign {
        fn name(&self) -> String {
            "foreign".into()
        }
        fn check(&self, _: &[usize], _: &[usize]) -> Result<(), String> {
            Ok(())
        }
        fn run_host(&self, _: &[&[f32]], _: &mut [&mut [f32]]) -> Result<(), DeviceError> {
            Ok(())
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }
    let e = d.launch_op(s, Arc::new(Foreign), &[], &[&a]).expect_err("no CUDA code");
    assert!(matches!(&e, DeviceError::Invalid(m) if m.contains("'foreign'")), "{e}");
    // Refusals do not fail the device.
    assert!(d.failure().is_none());
    d.free(s, a).unwrap();
}

#[test]
fn a_length_mismatch_is_refused_before_launch_cudadev_2() {
    let Some(d) = gpu("a_length_mismatch_is_refused_before_launch_cudadev_2", None) else { return };
    let s = d.stream("s");
    let x = d.alloc(8, "x").unwrap();
    let y = d.alloc(7, "y").unwrap();
    d.upload(s, &[1.0; 7], &y).unwrap();
    let e = d.launch_op(s, Op::Axpy { alpha: 2.0 }.arc(), &[&x], &[&y]).expect_err("8 vs 7");
    assert!(matches!(&e, DeviceError::Invalid(m) if m.contains("axpy")), "{e}");
    // A buffer both read and written.
    let e = d.launch_op(s, Op::Relu.arc(), &[&y], &[&y]).expect_err("aliased");
    assert!(matches!(e, DeviceError::Invalid(_)), "{e}");
    assert_eq!(d.download(s, &y).unwrap().wait(&d).unwrap(), vec![1.0; 7], "nothing ran");
    // A freed buffer.
    d.free(s, x).unwrap();
    let x2 = DeviceBuffer::new(1, d.id(), 8, "x");
    let e = d.launch_op(s, Op::Fill { value: 0.0 }.arc(), &[], &[&x2]).expect_err("freed");
    assert!(matches!(&e, DeviceError::Invalid(m) if m.contains("freed")), "{e}");
    assert!(d.failure().is_none());
    d.free(s, y).unwrap();
}

#[test]
fn allocations_past_the_capacity_are_refused_cudadev_5() {
    let Some(d) = gpu("allocations_past_the_capacity_are_refused_cudadev_5", Some(1000)) else {
        return;
    };
    let s = d.stream("s");
    let a = d.alloc(200, "a").unwrap();
    assert_eq!(d.in_use(), 800);
    match d.alloc(100, "b") {
        Err(DeviceError::OutOfMemory { label, bytes, in_use, capacity }) => {
            assert_eq!((label.as_str(), bytes, in_use, capacity), ("b", 400, 800, 1000))
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(d.in_use(), 800, "a refusal changes nothing");
    let r = d.reserve(150, "kernel").unwrap();
    assert!(d.reserve(100, "more").is_err());
    drop(r);
    d.free(s, a).unwrap();
    assert_eq!((d.in_use(), d.peak()), (0, 950));
    // Zeroed allocations.
    let z = d.alloc(250, "z").unwrap();
    assert_eq!(d.download(s, &z).unwrap().wait(&d).unwrap(), vec![0.0; 250]);
    d.free(s, z).unwrap();
}

#[test]
fn events_order_two_streams() {
    let Some(d) = gpu("events_order_two_streams", None) else { return };
    let (w, r) = (d.stream("writer"), d.stream("reader"));
    // Enough work on the writer that a reader not waiting for it would see it unfinished.
    let n = 1 << 24;
    let x = d.alloc(n, "x").unwrap();
    let y = d.alloc(n, "y").unwrap();
    d.launch_op(w, Op::Fill { value: 1.0 }.arc(), &[], &[&x]).unwrap();
    let ones = d.alloc(n, "ones").unwrap();
    d.launch_op(w, Op::Fill { value: 1.0 }.arc(), &[], &[&ones]).unwrap();
    for _ in 0..20 {
        d.launch_op(w, Op::Axpy { alpha: 1.0 }.arc(), &[&ones], &[&x]).unwrap();
    }
    let e = d.record(w);
    d.wait(r, &e);
    // Work of the reader's own (on a buffer the writer never touched): done only after the
    // writer's, since the reader waited for it.
    let z = d.alloc(4, "z").unwrap();
    d.launch_op(r, Op::Fill { value: 2.0 }.arc(), &[], &[&z]).unwrap();
    let after = d.record(r);
    d.synchronize(&after).unwrap();
    assert!(d.query(&e), "the reader's work ran before the writer's event fired");
    d.copy(r, &x, &y).unwrap();
    let got = d.download(r, &y).unwrap().wait(&d).unwrap();
    assert!(got.iter().all(|&v| v == 21.0), "the reader saw the writer's work unfinished");
    for b in [x, y, ones, z] {
        d.free(r, b).unwrap();
    }
    assert!(d.failure().is_none());
}

#[test]
fn free_is_stream_ordered_cudadev_5() {
    let Some(d) = gpu("free_is_stream_ordered_cudadev_5", None) else { return };
    let (s, t) = (d.stream("s"), d.stream("t"));
    let n = 1 << 24;
    let a = d.alloc(n, "a").unwrap();
    let b = d.alloc(n, "b").unwrap();
    d.launch_op(s, Op::Fill { value: 3.0 }.arc(), &[], &[&a]).unwrap();
    d.copy(s, &a, &b).unwrap();
    // Freed while the copy may still be running: its bytes count as free at once ...
    d.free(s, a).unwrap();
    assert_eq!(d.in_use(), 4 * n as u64);
    // ... and a new allocation, which may reuse them, is written on another stream.
    let c = d.alloc(n, "c").unwrap();
    d.launch_op(t, Op::Fill { value: 7.0 }.arc(), &[], &[&c]).unwrap();
    let got_b = d.download(s, &b).unwrap().wait(&d).unwrap();
    assert!(got_b.iter().all(|&v| v == 3.0), "the copy read memory already reused");
    let got_c = d.download(t, &c).unwrap().wait(&d).unwrap();
    assert!(got_c.iter().all(|&v| v == 7.0));
    d.free(s, b).unwrap();
    d.free(t, c).unwrap();
    assert!(d.failure().is_none());
}

#[test]
fn a_failed_device_stays_failed_cudadev_3() {
    let Some(d) = gpu("a_failed_device_stays_failed_cudadev_3", None) else { return };
    let s = d.stream("s");
    // An event of another device cannot be waited for: the device fails ...
    let cpu = CpuDevice::new();
    d.wait(s, &cpu.record(0));
    let first = d.failure().expect("failed");
    assert!(first.contains("cuda:0"), "{first}");
    // ... and every later call reports that first failure.
    match d.alloc(4, "a") {
        Err(DeviceError::Failed(m)) => assert_eq!(m, first),
        other => panic!("expected Failed, got {other:?}"),
    }
    assert!(matches!(d.synchronize(&d.record(s)), Err(DeviceError::Failed(_))));
}

#[test]
fn nccl_at_world_1_moves_buffers() {
    let Some(d) = gpu("nccl_at_world_1_moves_buffers", None) else { return };
    let d = Arc::new(d);
    let store = Arc::new(MemStore::new());
    let mut comm = match NcclComm::new(Arc::clone(&d), 0, 1, store, "test", Duration::from_secs(30))
    {
        Ok(c) => c,
        Err(DeviceError::Unavailable(why)) => {
            println!("skipped: nccl_at_world_1_moves_buffers: {why}");
            return;
        }
        Err(e) => panic!("NCCL at world 1: {e}"),
    };
    let s = d.stream("s");
    let v: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let put = |label: &str| {
        let b = d.alloc(v.len(), label).unwrap();
        d.upload(s, &v, &b).unwrap();
        b
    };
    let get = |b: &DeviceBuffer| d.download(s, b).unwrap().wait(&*d).unwrap();
    let a = put("a");
    comm.all_reduce(s, &a).unwrap();
    assert_eq!(get(&a), v, "all_reduce of one rank is the input");
    let recv = d.alloc(v.len(), "recv").unwrap();
    comm.all_gather(s, &a, &recv).unwrap();
    assert_eq!(get(&recv), v, "all_gather of one rank copies");
    let recv2 = d.alloc(v.len(), "recv2").unwrap();
    comm.reduce_scatter(s, &a, &recv2).unwrap();
    assert_eq!(get(&recv2), v);
    comm.all_gather_in_place(s, &a).unwrap();
    comm.reduce_scatter_in_place(s, &a).unwrap();
    comm.broadcast(s, &a, 0).unwrap();
    assert_eq!(get(&a), v);
    // CUDANCCL-2: refused before anything is enqueued.
    let short = d.alloc(999, "short").unwrap();
    assert!(matches!(comm.all_gather(s, &a, &short), Err(DeviceError::Invalid(_))));
    assert!(matches!(comm.broadcast(s, &a, 1), Err(DeviceError::Invalid(_))));
    // DEVOP-2: collectives take whole allocations.
    let e = comm.all_reduce(s, &a.view(0..10).unwrap()).expect_err("a view");
    assert!(matches!(&e, DeviceError::Invalid(m) if m.contains("view")), "{e}");
    // CUDANCCL-3
    comm.abort();
    assert!(matches!(comm.all_reduce(s, &a), Err(DeviceError::Failed(_))));
    assert!(d.failure().is_none(), "{:?}", d.failure());
    for b in [a, recv, recv2, short] {
        d.free(s, b).unwrap();
    }
}

#[test]
fn a_rendezvous_without_rank_0_fails_in_time_naming_the_key_cudanccl_4() {
    let test = "a_rendezvous_without_rank_0_fails_in_time_naming_the_key_cudanccl_4";
    let Some(d) = gpu(test, None) else { return };
    // Rank 1 of 2: rank 0 never publishes the id.
    let t = std::time::Instant::now();
    let store = Arc::new(MemStore::new());
    let m = match NcclComm::new(Arc::new(d), 1, 2, store, "lonely", Duration::from_secs(2)) {
        Err(DeviceError::Unavailable(why)) => {
            println!("skipped: {test}: {why}");
            return;
        }
        Err(e) => e.to_string(),
        Ok(_) => panic!("no rank 0, and a communicator"),
    };
    assert!(m.contains("lonely/nccl/id") && m.contains("rank 1"), "{m}");
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
}

#[test]
fn a_training_step_as_ops_matches_the_host_device() {
    // The MLP step of the ops tests (linear, ReLU, cross-entropy, backward, SGD), every
    // kernel an op, on the GPU against the host device.
    let Some(d) = gpu("a_training_step_as_ops_matches_the_host_device", None) else { return };
    let want = crate::ops::tests::mlp_step_as_ops(Arc::new(CpuDevice::new()));
    let got = crate::ops::tests::mlp_step_as_ops(Arc::new(d));
    assert_close("loss", &[got.0], &[want.0], REDUCTION);
    assert_close("first layer after the step", &got.1, &want.1, REDUCTION);
    assert_close("second layer after the step", &got.2, &want.2, REDUCTION);
}

/// Runs `op` on `d` with its buffers views of allocations holding `bufs`: each read and
/// write an (allocation, range) pair; returns every allocation whole afterwards.
fn run_on_views(
    d: &dyn Device,
    op: &Op,
    bufs: &[Vec<f32>],
    reads: &[(usize, Range<usize>)],
    writes: &[(usize, Range<usize>)],
) -> Vec<Vec<f32>> {
    let s = d.stream("compute");
    let whole: Vec<DeviceBuffer> = bufs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let b = d.alloc(v.len(), &format!("buffer {i}")).unwrap();
            d.upload(s, v, &b).unwrap();
            b
        })
        .collect();
    let views = |u: &[(usize, Range<usize>)]| -> Vec<DeviceBuffer> {
        u.iter().map(|(i, r)| whole[*i].view(r.clone()).unwrap()).collect()
    };
    let (rv, wv) = (views(reads), views(writes));
    d.launch_op(
        s,
        op.clone().arc(),
        &rv.iter().collect::<Vec<_>>(),
        &wv.iter().collect::<Vec<_>>(),
    )
    .unwrap_or_else(|e| panic!("{op:?} on views: {e}"));
    let out = whole.iter().map(|b| d.download(s, b).unwrap().wait(d).unwrap()).collect();
    for b in whole {
        d.free(s, b).unwrap();
    }
    out
}

/// DEVOP-2: every element of `got` outside the written ranges is `bufs`' own.
fn assert_outside_unchanged(
    what: &str,
    bufs: &[Vec<f32>],
    writes: &[(usize, Range<usize>)],
    got: &[Vec<f32>],
) {
    for (i, (g, v)) in got.iter().zip(bufs).enumerate() {
        for (j, (a, b)) in g.iter().zip(v).enumerate() {
            if !writes.iter().any(|(w, r)| *w == i && r.contains(&j)) {
                assert_eq!(a.to_bits(), b.to_bits(), "{what}: buffer {i}[{j}] outside the views");
            }
        }
    }
}

/// `op` over views on the GPU against the host device (which honours DEVOP-2), whole
/// allocations compared, within `rel`; nothing outside the written views changes.
pub(super) fn check_views(
    gpu: &dyn Device,
    op: Op,
    bufs: &[Vec<f32>],
    reads: &[(usize, Range<usize>)],
    writes: &[(usize, Range<usize>)],
    rel: f32,
) {
    let want = run_on_views(&CpuDevice::new(), &op, bufs, reads, writes);
    let got = run_on_views(gpu, &op, bufs, reads, writes);
    assert_outside_unchanged(&format!("{op:?}"), bufs, writes, &got);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(&format!("{op:?} on views: buffer {i}"), g, w, rel);
    }
}

#[test]
fn ops_on_views_reach_only_the_views_devop_2() {
    let Some(d) = gpu("ops_on_views_reach_only_the_views_devop_2", None) else { return };
    ops_on_views(&d);
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

/// The cases of [`ops_on_views_reach_only_the_views_devop_2`] on `d`.
fn ops_on_views(d: &dyn Device) {
    let mut rng = SplitMix64::new(29);
    // AdamW over p[3..10], g[3..10], st[6..20] of larger buffers.
    let (p, g) = (randn(&mut rng, 16), randn(&mut rng, 12));
    let st: Vec<f32> = randn(&mut rng, 24).iter().map(|v| v.abs()).collect();
    for step in [1, 3] {
        let a =
            AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step };
        let bufs = [p.clone(), g.clone(), st.clone()];
        check_views(d, Op::AdamW(a), &bufs, &[(1, 3..10)], &[(0, 3..10), (2, 6..20)], ELEMENTWISE);
    }
    // SGD with momentum, axpy, fill, relu on views at odd offsets.
    let s = SgdStep {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 0.01,
        nesterov: true,
        step: 2,
    };
    let bufs = [randn(&mut rng, 11), randn(&mut rng, 9), randn(&mut rng, 13)];
    check_views(d, Op::Sgd(s), &bufs, &[(1, 1..6)], &[(0, 5..10), (2, 7..12)], ELEMENTWISE);
    let bufs = [randn(&mut rng, 300), randn(&mut rng, 301)];
    check_views(d, Op::Axpy { alpha: 0.5 }, &bufs, &[(0, 17..274)], &[(1, 1..258)], ELEMENTWISE);
    check_views(d, Op::Relu, &bufs, &[(0, 0..257)], &[(1, 44..301)], 0.0);
    check_views(d, Op::Fill { value: 2.5 }, &bufs, &[], &[(1, 3..3)], 0.0);
    check_views(d, Op::Fill { value: 2.5 }, &bufs, &[], &[(0, 299..300)], 0.0);
    // SumSquares of x[5..15] into out[2..4] of 6 elements.
    let bufs = [randn(&mut rng, 20), randn(&mut rng, 6)];
    let (reads, writes) = ([(0, 5..15)], [(1, 2..4)]);
    let want = run_on_views(&CpuDevice::new(), &Op::SumSquares, &bufs, &reads, &writes);
    let got = run_on_views(d, &Op::SumSquares, &bufs, &reads, &writes);
    assert_outside_unchanged("sum of squares", &bufs, &writes, &got);
    let (gs, ws) = (load_f64(&got[1][2..4]), load_f64(&want[1][2..4]));
    assert!((gs - ws).abs() <= 1e-12 * ws.abs().max(1.0), "{gs} vs {ws}");
    // GEMMs whose a and b are two views of one allocation, into c[3..18] of 21.
    let (m, n, k) = (3, 5, 4);
    let bufs = [randn(&mut rng, 40), randn(&mut rng, 21)];
    for trans_a in [false, true] {
        for trans_b in [false, true] {
            for accumulate in [false, true] {
                let shape = GemmShape { m, n, k, trans_a, trans_b };
                let (reads, writes) = ([(0, 2..14), (0, 15..35)], [(1, 3..18)]);
                check_views(d, Op::Gemm { shape, accumulate }, &bufs, &reads, &writes, REDUCTION);
            }
        }
    }
    // BatchNorm forward: x, params, mean and m2 views of one allocation (its invstd is
    // written, then read through a view of the written view).
    let (nn, c, sp) = (2, 3, 5);
    let len = nn * c * sp;
    let mut inputs = randn(&mut rng, len + 4 * c + 3);
    for v in &mut inputs[len + 3 * c + 3..] {
        *v = v.abs() + 0.5;
    }
    let bufs = [inputs, randn(&mut rng, len + 2), randn(&mut rng, len + 1), randn(&mut rng, c + 7)];
    let reads = [
        (0, 0..len),
        (0, len + 1..len + 1 + 2 * c),
        (0, len + 2 * c + 2..len + 3 * c + 2),
        (0, len + 3 * c + 3..len + 4 * c + 3),
    ];
    let writes = [(1, 2..len + 2), (2, 0..len), (3, 4..4 + c)];
    let fwd = Op::BatchNormForward { n: nn, c, s: sp, count: nn * sp, eps: 1e-5 };
    check_views(d, fwd, &bufs, &reads, &writes, ELEMENTWISE);
}

#[test]
fn copies_frees_and_aliased_views_are_refused_devop_2() {
    let test = "copies_frees_and_aliased_views_are_refused_devop_2";
    let Some(d) = gpu(test, None) else { return };
    let s = d.stream("s");
    let a = d.alloc(10, "a").unwrap();
    let b = d.alloc(10, "b").unwrap();
    let v: Vec<f32> = (0..10).map(|i| i as f32).collect();
    d.upload(s, &v, &a).unwrap();
    let (va, va2, vb) = (a.view(2..6).unwrap(), a.view(6..10).unwrap(), b.view(0..4).unwrap());
    let refused = |what: &str, r: Result<(), DeviceError>| match r {
        Err(DeviceError::Invalid(m)) => assert!(m.contains("view") || m.contains(what), "{m}"),
        other => panic!("{what} of a view: expected Invalid, got {other:?}"),
    };
    refused("upload", d.upload(s, &[1.0; 4], &va));
    refused("download", d.download(s, &va).map(|_| ()));
    refused("copy", d.copy(s, &va, &b.view(0..4).unwrap()));
    refused("copy", d.copy(s, &va, &vb));
    refused("copy", d.copy(s, &a, &b.view(0..10).unwrap()));
    refused("free", d.free(s, a.view(0..10).unwrap()));
    // By allocation: two written views of one, or one read and one written, are refused.
    refused(
        "written twice",
        d.launch_op(s, Op::Fill { value: 0.0 }.arc(), &[], &[&va, &va2]).map(|_| ()),
    );
    let e = d.launch_op(s, Op::Relu.arc(), &[&va], &[&va2]).expect_err("one allocation");
    assert!(matches!(&e, DeviceError::Invalid(m) if m.contains("both read and written")), "{e}");
    // Nothing ran, nothing failed.
    assert_eq!(d.download(s, &a).unwrap().wait(&d).unwrap(), v);
    assert!(d.failure().is_none(), "{:?}", d.failure());
    d.free(s, a).unwrap();
    d.free(s, b).unwrap();
}
