use std::sync::Arc;

use shardline_collectives::device::{CpuDevice, Device, DeviceError, SimDevice, SimOptions};

use super::*;
use crate::batchnorm::BatchNorm;
use crate::tensor::Tensor;

fn randv(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn bits(ids: &[u32]) -> Vec<f32> {
    ids.iter().map(|&i| f32::from_bits(i)).collect()
}

/// Every op with buffer lengths that fit it, as (op, read lengths, write lengths).
fn fitting() -> Vec<(Op, Vec<usize>, Vec<usize>)> {
    let lin = Linear::new(3, 2, true);
    let ln = LayerNorm::<f32>::new(4);
    let emb = Embedding::new(5, 3);
    let shape = GemmShape { m: 2, n: 3, k: 4, trans_a: false, trans_b: true };
    let sgd = SgdStep {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
        step: 1,
    };
    let adamw =
        AdamWStep { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step: 1 };
    // Attention: 2 x 3 x 5 rows of 4: 120 values per q, k, v, out; 30 logsumexps.
    let attn = AttnShape { batch: 2, heads: 3, seq: 5, head_dim: 4 };
    let (n, c, s) = (2, 3, 4);
    vec![
        (Op::Fill { value: 1.0 }, vec![], vec![7]),
        (Op::Axpy { alpha: 2.0 }, vec![7], vec![7]),
        (Op::Gemm { shape, accumulate: false }, vec![8, 12], vec![6]),
        (Op::LinearForward(lin), vec![8, 12], vec![8]),
        (Op::LinearBackward { linear: lin, input_grad: true }, vec![8, 12, 8], vec![8, 12]),
        (Op::LinearBackward { linear: lin, input_grad: false }, vec![8, 12, 8], vec![8]),
        (Op::Relu, vec![6], vec![6]),
        (Op::ReluBackward, vec![6, 6], vec![6]),
        (Op::Activation(Activation::Gelu), vec![6], vec![6]),
        (Op::ActivationBackward(Activation::Silu), vec![6, 6], vec![6]),
        (Op::LayerNormForward(ln), vec![8, 12], vec![12, 3, 3]),
        (Op::LayerNormBackward(ln), vec![8, 12, 3, 3, 12], vec![12, 8]),
        (Op::CrossEntropy { vocab: 4, dloss: 1.0 }, vec![12, 3], vec![1, 12]),
        (Op::EmbeddingForward(emb), vec![15, 4], vec![12]),
        (Op::EmbeddingBackward(emb), vec![4, 12], vec![15]),
        (Op::SumSquares, vec![9], vec![2]),
        (Op::ClipScale { max_norm: 1.0 }, vec![3], vec![7]),
        (Op::NormSums { units: 2, stop: 0.0 }, vec![1, 4], vec![3]),
        (Op::Sgd(sgd), vec![5], vec![5, 5]),
        (Op::AdamW(adamw), vec![5], vec![5, 10]),
        (Op::BatchNormStats { n, c, s }, vec![24], vec![3, 3]),
        (Op::BatchNormForward { n, c, s, count: 8, eps: 1e-5 }, vec![24, 6, 3, 3], vec![24, 24, 3]),
        (Op::BatchNormBackwardReduce { n, c, s }, vec![24, 24], vec![6, 6]),
        (Op::BatchNormBackwardDx { n, c, s, count: 16 }, vec![6, 24, 3, 6, 24], vec![24]),
        (Op::AttentionForward(attn), vec![120; 3], vec![120, 30]),
        (Op::AttentionBackward(attn), vec![120, 120, 120, 120, 30, 120], vec![120; 3]),
    ]
}

#[test]
fn every_op_accepts_its_lengths_and_refuses_one_element_off_ops_1() {
    for (op, r, w) in fitting() {
        assert_eq!(op.check_lens(&r, &w), Ok(()), "{op:?}");
        // One element more in any buffer is refused (Fill takes any length).
        for i in 0..r.len() + w.len() {
            let (mut r2, mut w2) = (r.clone(), w.clone());
            if i < r.len() {
                r2[i] += 1;
            } else {
                w2[i - r.len()] += 1;
            }
            if matches!(op, Op::Fill { .. }) {
                continue;
            }
            // Free lengths: an embedding's id count (its output must follow it), the
            // vector a sum of squares reads.
            let free = matches!(
                (&op, i),
                (Op::EmbeddingForward(_), 1)
                    | (Op::EmbeddingBackward(_), 0)
                    | (Op::SumSquares, 0)
                    | (Op::ClipScale { .. }, 1)
            );
            if !free {
                assert!(op.check_lens(&r2, &w2).is_err(), "{op:?} took {r2:?} {w2:?}");
            }
        }
        // A buffer fewer is refused.
        let mut w3 = w.clone();
        w3.pop();
        assert!(op.check_lens(&r, &w3).is_err(), "{op:?} took a missing write");
    }
}

/// Runs `op` on `dev` over uploaded `reads` and `writes`, returns the writes.
fn run(dev: &dyn Device, op: &Op, reads: &[Vec<f32>], writes: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let s = dev.stream("compute");
    let up = |v: &Vec<f32>, l: &str| {
        let b = dev.alloc(v.len(), l).unwrap();
        dev.upload(s, v, &b).unwrap();
        b
    };
    let rb: Vec<_> = reads.iter().map(|v| up(v, "read")).collect();
    let wb: Vec<_> = writes.iter().map(|v| up(v, "write")).collect();
    let rr: Vec<_> = rb.iter().collect();
    let ww: Vec<_> = wb.iter().collect();
    dev.launch_op(s, op.clone().arc(), &rr, &ww).unwrap();
    wb.iter().map(|b| dev.download(s, b).unwrap().wait(dev).unwrap()).collect()
}

fn close(a: &[f32], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let err = (f64::from(x) - y).abs() / y.abs().max(1.0);
        assert!(err < tol, "{what}[{i}]: {x} against {y}");
    }
}

#[test]
fn ops_match_naive_references_and_accumulate_where_documented_ops_2_ops_3() {
    let dev = CpuDevice::new();
    // Linear, rows 2, in 3, out 2: y = x W^T + b; backward adds onto grads holding 1.0.
    let lin = Linear::new(3, 2, true);
    let (p, x, dy) = (randv(8, 1), randv(6, 2), randv(4, 3));
    let y = run(&dev, &Op::LinearForward(lin), &[p.clone(), x.clone()], &[vec![0.0; 4]]);
    let naive_y: Vec<f64> = (0..4)
        .map(|i| {
            let (r, o) = (i / 2, i % 2);
            let dot: f64 = (0..3).map(|k| f64::from(x[r * 3 + k] * p[o * 3 + k])).sum();
            dot + f64::from(p[6 + o])
        })
        .collect();
    close(&y[0], &naive_y, 1e-6, "linear y");
    let op = Op::LinearBackward { linear: lin, input_grad: true };
    let out = run(&dev, &op, &[p.clone(), x.clone(), dy.clone()], &[vec![1.0; 8], vec![9.0; 6]]);
    let mut naive_g = vec![1.0f64; 8];
    let mut naive_dx = vec![0.0f64; 6];
    for r in 0..2 {
        for o in 0..2 {
            let d = f64::from(dy[r * 2 + o]);
            for k in 0..3 {
                naive_g[o * 3 + k] += d * f64::from(x[r * 3 + k]);
                naive_dx[r * 3 + k] += d * f64::from(p[o * 3 + k]);
            }
            naive_g[6 + o] += d;
        }
    }
    close(&out[0], &naive_g, 1e-6, "OPS-3: linear grads added");
    close(&out[1], &naive_dx, 1e-6, "OPS-3: linear dx overwritten");

    // LayerNorm against its definition (biased variance, eps inside).
    let ln = LayerNorm::<f32>::new(4);
    let (lp, lx) = (randv(8, 4), randv(12, 5));
    let o = run(
        &dev,
        &Op::LayerNormForward(ln),
        &[lp.clone(), lx.clone()],
        &[vec![0.0; 12], vec![0.0; 3], vec![0.0; 3]],
    );
    for r in 0..3 {
        let row: Vec<f64> = lx[r * 4..r * 4 + 4].iter().map(|&v| f64::from(v)).collect();
        let mean = row.iter().sum::<f64>() / 4.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 4.0;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        let want: Vec<f64> = (0..4)
            .map(|j| (row[j] - mean) * rstd * f64::from(lp[j]) + f64::from(lp[4 + j]))
            .collect();
        close(&o[0][r * 4..r * 4 + 4], &want, 1e-5, "layer norm y");
        close(&o[1][r..r + 1], &[mean], 1e-6, "layer norm mean");
        close(&o[2][r..r + 1], &[rstd], 1e-5, "layer norm rstd");
    }

    // Cross-entropy: the mean of -log softmax at the target, times dloss.
    let (logits, t) = (randv(12, 6), [3u32, 0, 2]);
    let o = run(
        &dev,
        &Op::CrossEntropy { vocab: 4, dloss: 0.5 },
        &[logits.clone(), bits(&t)],
        &[vec![0.0], vec![0.0; 12]],
    );
    let mut loss = 0.0;
    let mut dl = vec![0.0f64; 12];
    for r in 0..3 {
        let row: Vec<f64> = logits[r * 4..r * 4 + 4].iter().map(|&v| f64::from(v)).collect();
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        loss += z.ln() - row[t[r] as usize];
        for j in 0..4 {
            let onehot = if j == t[r] as usize { 1.0 } else { 0.0 };
            dl[r * 4 + j] = 0.5 * (row[j].exp() / z - onehot) / 3.0;
        }
    }
    close(&o[0], &[0.5 * loss / 3.0], 1e-6, "cross entropy loss");
    close(&o[1], &dl, 1e-6, "cross entropy dlogits");

    // Embedding: rows gathered; backward adds each dy row onto its id's row.
    let emb = Embedding::new(5, 3);
    let (table, ids) = (randv(15, 7), [4u32, 1, 4, 0]);
    let o = run(&dev, &Op::EmbeddingForward(emb), &[table.clone(), bits(&ids)], &[vec![0.0; 12]]);
    let want: Vec<f64> = ids
        .iter()
        .flat_map(|&i| table[i as usize * 3..i as usize * 3 + 3].to_vec())
        .map(f64::from)
        .collect();
    close(&o[0], &want, 0.0 + f64::EPSILON, "embedding rows");
    let edy = randv(12, 8);
    let o = run(&dev, &Op::EmbeddingBackward(emb), &[bits(&ids), edy.clone()], &[vec![1.0; 15]]);
    let mut want = vec![1.0f64; 15];
    for (n, &i) in ids.iter().enumerate() {
        for j in 0..3 {
            want[i as usize * 3 + j] += f64::from(edy[n * 3 + j]);
        }
    }
    close(&o[0], &want, 1e-6, "OPS-3: embedding grads added");

    // Sum of squares in f64, carried as bits.
    let v = randv(100, 9);
    let o = run(&dev, &Op::SumSquares, std::slice::from_ref(&v), &[vec![0.0; 2]]);
    let want: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    assert_eq!(load_f64(&o[0]), want);
}

#[test]
fn updates_follow_torch_formulas_ops_2() {
    let dev = CpuDevice::new();
    let (p, g) = (randv(6, 10), randv(6, 11));
    // AdamW step 3 from a state: torch's formula in f64.
    let a = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step: 3 };
    let st: Vec<f32> = randv(12, 12).iter().map(|x| x.abs() * 0.1).collect();
    let o = run(&dev, &Op::AdamW(a), std::slice::from_ref(&g), &[p.clone(), st.clone()]);
    let (b1, b2) = (0.9f64, 0.95f64);
    for i in 0..6 {
        let (pi, gi) = (f64::from(p[i]), f64::from(g[i]));
        let m = b1 * f64::from(st[2 * i]) + (1.0 - b1) * gi;
        let v = b2 * f64::from(st[2 * i + 1]) + (1.0 - b2) * gi * gi;
        let pd = pi * (1.0 - 0.01 * 0.1);
        let want = pd - 0.01 / (1.0 - b1.powi(3)) * m / ((v / (1.0 - b2.powi(3))).sqrt() + 1e-8);
        close(&o[0][i..i + 1], &[want], 1e-5, "adamw params");
        close(&o[1][2 * i..2 * i + 2], &[m, v], 1e-6, "adamw state");
    }
    // SGD with momentum, past the first step: buf = mu buf + g; p -= lr buf.
    let s = SgdStep {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.01,
        nesterov: false,
        step: 2,
    };
    let buf = randv(6, 13);
    let o = run(&dev, &Op::Sgd(s), std::slice::from_ref(&g), &[p.clone(), buf.clone()]);
    for i in 0..6 {
        let d = f64::from(g[i]) + 0.01 * f64::from(p[i]);
        let b = 0.9 * f64::from(buf[i]) + d;
        close(&o[1][i..i + 1], &[b], 1e-6, "sgd momentum");
        close(&o[0][i..i + 1], &[f64::from(p[i]) - 0.1 * b], 1e-6, "sgd params");
    }
}

#[test]
fn a_bad_launch_is_refused_before_anything_runs_devop_1() {
    let dev = SimDevice::new(SimOptions::default());
    let s = dev.stream("compute");
    let a = dev.alloc(5, "a").unwrap();
    let b = dev.alloc(6, "b").unwrap();
    let e = dev.launch_op(s, Op::Axpy { alpha: 1.0 }.arc(), &[&a], &[&b]).unwrap_err();
    assert!(matches!(&e, DeviceError::Invalid(m) if m.contains("axpy y has 6 elements")), "{e}");
    assert!(dev.failure().is_none(), "a refused launch does not fail the device");
    // An id past the table fails the device when the op runs, naming the op.
    let emb = Embedding::new(2, 3);
    let table = dev.alloc(6, "table").unwrap();
    let ids = dev.alloc(1, "ids").unwrap();
    dev.upload(s, &bits(&[7]), &ids).unwrap();
    let out = dev.alloc(3, "out").unwrap();
    dev.launch_op(s, Op::EmbeddingForward(emb).arc(), &[&table, &ids], &[&out]).unwrap();
    let e = dev.download(s, &out).unwrap().wait(&dev).unwrap_err();
    assert!(e.to_string().contains("embedding forward"), "{e}");
}

/// One SGD step of a two-layer perceptron with a cross-entropy loss, every kernel an op:
/// the loss and both layers' parameters after it (the CUDA device's tests run it too).
pub(crate) fn mlp_step_as_ops(dev: Arc<dyn Device>) -> (f32, Vec<f32>, Vec<f32>) {
    let s = dev.stream("compute");
    let (l1, l2) = (Linear::new(4, 8, true), Linear::new(8, 3, true));
    let up = |v: &[f32], l: &str| {
        let b = dev.alloc(v.len(), l).unwrap();
        dev.upload(s, v, &b).unwrap();
        b
    };
    let (p1, p2) = (up(&randv(l1.num_params(), 20), "p1"), up(&randv(l2.num_params(), 21), "p2"));
    let x = up(&randv(5 * 4, 22), "x");
    let t = up(&bits(&[0, 2, 1, 1, 0]), "targets");
    let z = |n: usize, l: &str| dev.alloc(n, l).unwrap();
    let (h, a, y) = (z(40, "h"), z(40, "a"), z(15, "y"));
    let (loss, dy, da, dh) = (z(1, "loss"), z(15, "dy"), z(40, "da"), z(40, "dh"));
    let (g1, g2, m1, m2) =
        (z(l1.num_params(), "g1"), z(l2.num_params(), "g2"), z(0, "m1"), z(0, "m2"));
    let run = |op: Op, r: &[&_], w: &[&_]| dev.launch_op(s, op.arc(), r, w).unwrap();
    run(Op::LinearForward(l1), &[&p1, &x], &[&h]);
    run(Op::Relu, &[&h], &[&a]);
    run(Op::LinearForward(l2), &[&p2, &a], &[&y]);
    run(Op::CrossEntropy { vocab: 3, dloss: 1.0 }, &[&y, &t], &[&loss, &dy]);
    run(Op::Fill { value: 0.0 }, &[], &[&g2]);
    run(Op::Fill { value: 0.0 }, &[], &[&g1]);
    run(Op::LinearBackward { linear: l2, input_grad: true }, &[&p2, &a, &dy], &[&g2, &da]);
    run(Op::ReluBackward, &[&a, &da], &[&dh]);
    run(Op::LinearBackward { linear: l1, input_grad: false }, &[&p1, &x, &dh], &[&g1]);
    let sgd = SgdStep {
        lr: 0.5,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
        step: 1,
    };
    run(Op::Sgd(sgd), &[&g1], &[&p1, &m1]);
    run(Op::Sgd(sgd), &[&g2], &[&p2, &m2]);
    let get = |b| dev.download(s, b).unwrap().wait(&*dev).unwrap();
    (get(&loss)[0], get(&p1), get(&p2))
}

#[test]
fn a_training_step_runs_as_ops_on_a_device_that_refuses_host_code_sim_4_devop_1() {
    let cpu = mlp_step_as_ops(Arc::new(CpuDevice::new()));
    for seed in 0..4 {
        let sim = SimDevice::new(SimOptions { seed, ops_only: true, ..SimOptions::default() });
        let sim: Arc<dyn Device> = Arc::new(sim);
        // SIM-4: a host kernel is refused by name.
        let b = sim.alloc(1, "b").unwrap();
        let e = sim.launch(0, "host relu", &[], &[&b], Box::new(|_, _| {})).unwrap_err();
        assert!(e.to_string().contains("'host relu' is host code"), "{e}");
        let got = mlp_step_as_ops(sim);
        assert_eq!(got, cpu, "seed {seed}: the same step, bitwise (DEVOP-1)");
    }
    assert!(cpu.0 > 0.5 && cpu.0 < 3.0, "a cross-entropy over 3 classes: {}", cpu.0);
}

#[test]
fn batch_norm_and_attention_refuse_what_their_layers_refuse_ops_1() {
    let (n, c, s) = (2, 3, 4);
    let fwd = |count| Op::BatchNormForward { n, c, s, count, eps: 1e-5 };
    let (fr, fw) = (vec![24, 6, 3, 3], vec![24, 24, 3]);
    assert_eq!(fwd(8).check_lens(&fr, &fw), Ok(()));
    // SyncBatchNorm: a global batch larger than the slice.
    assert_eq!(fwd(1000).check_lens(&fr, &fw), Ok(()));
    // BN-4: one value per channel; a global count below the slice's.
    for count in [0, 1, 7] {
        assert!(fwd(count).check_lens(&fr, &fw).is_err(), "count {count}");
        let dx = Op::BatchNormBackwardDx { n, c, s, count };
        assert!(dx.check_lens(&[6, 24, 3, 6, 24], &[24]).is_err(), "count {count}");
    }
    // An empty slice of a SyncBatchNorm batch.
    let empty = Op::BatchNormForward { n: 0, c, s, count: 8, eps: 1e-5 };
    assert_eq!(empty.check_lens(&[0, 6, 3, 3], &[0, 0, 3]), Ok(()));
    // head_dim 0, which the layer refuses; sizes that overflow.
    let zero = AttnShape { batch: 1, heads: 1, seq: 3, head_dim: 0 };
    assert!(Op::AttentionForward(zero).check_lens(&[0; 3], &[0, 3]).is_err());
    let huge = AttnShape { batch: usize::MAX, heads: 2, seq: 1, head_dim: 1 };
    assert!(Op::AttentionForward(huge).check_lens(&[0; 3], &[0, 0]).is_err());
    let huge = Op::BatchNormStats { n: usize::MAX, c: 2, s: 1 };
    assert!(huge.check_lens(&[0], &[2, 2]).is_err());
}

/// `x [n, c, s]` with a mean and a spread of its own per channel, as activations have.
fn bn_input(n: usize, c: usize, s: usize, seed: u64) -> Vec<f32> {
    let raw = randv(n * c * s, seed);
    (0..raw.len())
        .map(|i| raw[i] * (1.0 + ((i / s) % c) as f32) + 2.0 - (i / s % c) as f32)
        .collect()
}

#[test]
fn batch_norm_ops_match_the_formulas_ops_2() {
    let dev = CpuDevice::new();
    for (n, c, s) in [(3, 2, 5), (6, 3, 1), (1, 2, 9)] {
        let len = n * c * s;
        let at = |i: usize, ch: usize, j: usize| (i * c + ch) * s + j;
        let x = bn_input(n, c, s, 30 + len as u64);
        let o = run(
            &dev,
            &Op::BatchNormStats { n, c, s },
            std::slice::from_ref(&x),
            &vec![vec![9.0; c]; 2],
        );
        for ch in 0..c {
            let vals: Vec<f64> = (0..n)
                .flat_map(|i| (0..s).map(move |j| (i, j)))
                .map(|(i, j)| f64::from(x[at(i, ch, j)]))
                .collect();
            let mean = vals.iter().sum::<f64>() / vals.len() as f64;
            let m2 = vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>();
            close(&o[0][ch..ch + 1], &[mean], 1e-6, "batch norm mean");
            close(&o[1][ch..ch + 1], &[m2], 1e-6, "batch norm m2");
        }
        // The forward of a SyncBatchNorm slice: statistics of a global batch of 4 n s.
        let count = 4 * n * s;
        let (p, mean, m2) = (randv(2 * c, 31), randv(c, 32), randv(c, 33));
        let m2: Vec<f32> = m2.iter().map(|v| (v.abs() + 0.1) * count as f32).collect();
        let op = Op::BatchNormForward { n, c, s, count, eps: 1e-3 };
        let reads = [x.clone(), p.clone(), mean.clone(), m2.clone()];
        let o = run(&dev, &op, &reads, &[vec![9.0; len], vec![9.0; len], vec![9.0; c]]);
        let (mut y, mut xhat) = (vec![0.0; len], vec![0.0; len]);
        for ch in 0..c {
            let invstd = 1.0 / (f64::from(m2[ch]) / count as f64 + 1e-3).sqrt();
            close(&o[2][ch..ch + 1], &[invstd], 1e-6, "batch norm invstd");
            for k in (0..len).filter(|k| (k / s) % c == ch) {
                xhat[k] = (f64::from(x[k]) - f64::from(mean[ch])) * invstd;
                y[k] = xhat[k] * f64::from(p[ch]) + f64::from(p[c + ch]);
            }
        }
        close(&o[0], &y, 1e-5, "batch norm y");
        close(&o[1], &xhat, 1e-5, "batch norm xhat");
        // Backward: the per-channel sums, the parameter gradients added onto 1.0.
        let (dy, xh) = (randv(len, 34), o[1].clone());
        let op = Op::BatchNormBackwardReduce { n, c, s };
        let o = run(&dev, &op, &[dy.clone(), xh.clone()], &[vec![9.0; 2 * c], vec![1.0; 2 * c]]);
        let (mut sums, mut grads) = (vec![0.0f64; 2 * c], vec![1.0f64; 2 * c]);
        for k in 0..len {
            let ch = (k / s) % c;
            sums[ch] += f64::from(dy[k]);
            sums[c + ch] += f64::from(dy[k]) * f64::from(xh[k]);
            grads[ch] += f64::from(dy[k]) * f64::from(xh[k]);
            grads[c + ch] += f64::from(dy[k]);
        }
        close(&o[0], &sums, 1e-5, "batch norm sums");
        close(&o[1], &grads, 1e-5, "OPS-3: batch norm grads added");
        // dx with global sums (three times this slice's, for a global count of 4 n s).
        let (invstd, global) = (randv(c, 35), randv(2 * c, 36));
        let invstd: Vec<f32> = invstd.iter().map(|v| v.abs() + 0.5).collect();
        let op = Op::BatchNormBackwardDx { n, c, s, count };
        let reads = [p.clone(), xh.clone(), invstd.clone(), global.clone(), dy.clone()];
        let o = run(&dev, &op, &reads, &[vec![9.0; len]]);
        let want: Vec<f64> = (0..len)
            .map(|k| {
                let ch = (k / s) % c;
                let (md, mdx) =
                    (global[ch] as f64 / count as f64, global[c + ch] as f64 / count as f64);
                let g = f64::from(dy[k]) - md - f64::from(xh[k]) * mdx;
                f64::from(p[ch]) * f64::from(invstd[ch]) * g
            })
            .collect();
        close(&o[0], &want, 1e-5, "batch norm dx");
    }
}

#[test]
fn batch_norm_ops_in_a_chain_compute_the_layer_ops_2() {
    // Stats, forward, reduce, dx: BatchNorm1d's training forward and backward.
    let dev = CpuDevice::new();
    let (n, c, s) = (4, 3, 6);
    let (len, count) = (n * c * s, n * s);
    let x = bn_input(n, c, s, 40);
    let (p, dy) = (randv(2 * c, 41), randv(len, 42));
    let layer = BatchNorm::d1(c);
    let xt = Tensor::new(vec![n, c, s], x.clone()).unwrap();
    let (want_y, saved) = layer.forward(&p, &mut layer.init_buffers(), xt, true, None).unwrap();
    let mut want_g = vec![0.5; 2 * c];
    let gy = Tensor::new(vec![n, c, s], dy.clone()).unwrap();
    let want_dx = layer.backward(&p, &saved, &gy, &mut want_g, None).unwrap();

    let st = run(
        &dev,
        &Op::BatchNormStats { n, c, s },
        std::slice::from_ref(&x),
        &vec![vec![0.0; c]; 2],
    );
    let op = Op::BatchNormForward { n, c, s, count, eps: layer.eps };
    let reads = [x, p.clone(), st[0].clone(), st[1].clone()];
    let f = run(&dev, &op, &reads, &[vec![0.0; len], vec![0.0; len], vec![0.0; c]]);
    let op = Op::BatchNormBackwardReduce { n, c, s };
    let red = run(&dev, &op, &[dy.clone(), f[1].clone()], &[vec![0.0; 2 * c], vec![0.5; 2 * c]]);
    let op = Op::BatchNormBackwardDx { n, c, s, count };
    let reads = [p, f[1].clone(), f[2].clone(), red[0].clone(), dy];
    let dx = run(&dev, &op, &reads, &[vec![0.0; len]]);
    let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    close(&f[0], &f64s(want_y.as_f32().unwrap()), 1e-6, "y");
    close(&f[2], &f64s(saved.invstd()), 1e-6, "invstd");
    close(&red[1], &f64s(&want_g), 1e-6, "parameter gradients");
    close(&dx[0], &f64s(want_dx.as_f32().unwrap()), 1e-6, "dx");
}

/// Causal attention from the materialised scores, in f64: `(out, lse, dq, dk, dv)`.
#[allow(clippy::type_complexity)]
fn naive_attention(
    sh: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (t, d) = (sh.seq, sh.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let n = sh.batch * sh.heads * t * d;
    let (mut out, mut lse) = (vec![0.0; n], vec![0.0; sh.batch * sh.heads * t]);
    let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let g = |x: &[f32], i: usize| f64::from(x[i]);
    for bh in 0..sh.batch * sh.heads {
        let row = |i: usize| (bh * t + i) * d;
        for i in 0..t {
            // Scores and probabilities over keys 0..=i.
            let sc: Vec<f64> = (0..=i)
                .map(|j| (0..d).map(|c| g(q, row(i) + c) * g(k, row(j) + c)).sum::<f64>() * scale)
                .collect();
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = sc.iter().map(|s| (s - mx).exp()).sum();
            lse[bh * t + i] = mx + z.ln();
            let p: Vec<f64> = sc.iter().map(|s| (s - mx).exp() / z).collect();
            let dp: Vec<f64> = (0..=i)
                .map(|j| (0..d).map(|c| g(dout, row(i) + c) * g(v, row(j) + c)).sum())
                .collect();
            // The softmax's Jacobian: dS = P (dP - sum_k P dP).
            let pdp: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
            for j in 0..=i {
                let ds = p[j] * (dp[j] - pdp) * scale;
                for c in 0..d {
                    out[row(i) + c] += p[j] * g(v, row(j) + c);
                    dv[row(j) + c] += p[j] * g(dout, row(i) + c);
                    dq[row(i) + c] += ds * g(k, row(j) + c);
                    dk[row(j) + c] += ds * g(q, row(i) + c);
                }
            }
        }
    }
    (out, lse, dq, dk, dv)
}

#[test]
fn attention_ops_match_materialised_scores_ops_2() {
    let dev = CpuDevice::new();
    // seq 70: past the host's key block of 64; seq 1: one key.
    for (i, sh) in [(2, 3, 5, 4), (1, 2, 70, 3), (2, 1, 1, 8)].into_iter().enumerate() {
        let sh = AttnShape { batch: sh.0, heads: sh.1, seq: sh.2, head_dim: sh.3 };
        let (n, rows) = (sh.numel(), sh.rows());
        let seed = 50 + 10 * i as u64;
        let big = |v: Vec<f32>| v.iter().map(|x| 2.0 * x).collect::<Vec<_>>();
        let (q, k, v, dout) =
            (big(randv(n, seed)), big(randv(n, seed + 1)), randv(n, seed + 2), randv(n, seed + 3));
        let (out, lse, dq, dk, dv) = naive_attention(sh, &q, &k, &v, &dout);
        let reads = [q.clone(), k.clone(), v.clone()];
        let f = run(&dev, &Op::AttentionForward(sh), &reads, &[vec![9.0; n], vec![9.0; rows]]);
        close(&f[0], &out, 1e-5, "attention out");
        close(&f[1], &lse, 1e-5, "attention lse");
        let reads = [q, k, v, f[0].clone(), f[1].clone(), dout];
        let b = run(&dev, &Op::AttentionBackward(sh), &reads, &vec![vec![9.0; n]; 3]);
        close(&b[0], &dq, 1e-5, "attention dq");
        close(&b[1], &dk, 1e-5, "attention dk");
        close(&b[2], &dv, 1e-5, "attention dv");
    }
}

#[test]
fn clipping_and_the_norm_sums_follow_their_definitions_ops_2() {
    let dev = CpuDevice::new();
    let g = randv(10, 30);
    // Squared norm 16: a max norm of 2 scales by 2 / (4 + 1e-6); 10 leaves the bits as they are.
    let sums = vec![0.7, 16.0, 0.0];
    let o = run(
        &dev,
        &Op::ClipScale { max_norm: 2.0 },
        std::slice::from_ref(&sums),
        std::slice::from_ref(&g),
    );
    let coef = 2.0 / (4.0 + 1e-6);
    let want: Vec<f64> = g.iter().map(|&x| f64::from(x) * coef).collect();
    close(&o[0], &want, 1e-7, "clipped");
    let o = run(&dev, &Op::ClipScale { max_norm: 10.0 }, &[sums], std::slice::from_ref(&g));
    assert_eq!(o[0], g, "a coefficient of 1 changes nothing");
    // The units' squared norms summed in unit order, the loss and the wish carried.
    let mut sq = vec![0.0f32; 6];
    for (u, v) in [1.5f64, 2.25, 1e-3].iter().enumerate() {
        store_f64(*v, &mut sq[2 * u..2 * u + 2]);
    }
    let o = run(&dev, &Op::NormSums { units: 3, stop: 1.0 }, &[vec![0.25], sq], &[vec![0.0; 3]]);
    assert_eq!(o[0], vec![0.25, (1.5 + 2.25 + 1e-3) as f32, 1.0]);
}
