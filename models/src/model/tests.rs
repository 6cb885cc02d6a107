//! Tests of the model: gradients against finite differences, the split backward (MODEL-4),
//! stable names (MODEL-1), initialisation, SyncBN on uneven ranks, and learning the digits.
#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read best here

use super::*;
use crate::testing::{run_ranks, thread_reducers, CountingReducer};
use crate::testutil::rand_tensor;
use crate::zoo::{ConvNetBn, MlpBn, WideMlp};
use crate::Cpu;
use std::time::Duration;

fn ctx<'a>(
    be: &'a Cpu,
    training: bool,
    reducer: Option<&'a dyn StatsReducer>,
    gb: usize,
) -> Ctx<'a> {
    Ctx { sync_bn: false, reducer, ..Ctx::new(be, training, gb) }
}

fn init(m: &Model, seed: u64) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let p = (0..m.num_units()).map(|u| m.init_params(u, seed).unwrap()).collect();
    let b = (0..m.num_units()).map(|u| m.init_buffers(u).unwrap()).collect();
    (p, b)
}

/// Full model forward + backward (training mode, batch statistics, cross-entropy)
/// against central finite differences of every parameter and input value.
fn model_gradcheck(m: &Model, batch: usize, seed: u64) {
    let be = Cpu::new();
    let (params, buffers) = init(m, seed);
    let mut shape = vec![batch];
    shape.extend_from_slice(&m.input_shape);
    let x = rand_tensor(&shape, seed + 1);
    let labels: Vec<u32> = (0..batch).map(|i| (i % m.classes) as u32).collect();
    let c = ctx(&be, true, None, batch);
    let loss = |p: &[Vec<f32>], x: Tensor| -> f64 {
        let mut b = buffers.clone();
        let (logits, _) = m.forward(p, &mut b, x, &c).unwrap();
        let k = m.classes;
        // f64 cross-entropy so that the difference quotient is not drowned in rounding
        (0..batch)
            .map(|i| {
                let row: Vec<f64> = logits.as_f32().unwrap()[i * k..(i + 1) * k]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = row.iter().map(|v| (v - mx).exp()).sum();
                z.ln() + mx - row[labels[i] as usize]
            })
            .sum::<f64>()
            / batch as f64
    };
    let (_, grads) =
        m.loss_and_grads(&params, &mut buffers.clone(), x.clone(), &labels, &c).unwrap();
    let (logits, saved) = m.forward(&params, &mut buffers.clone(), x.clone(), &c).unwrap();
    let (_, gl) = softmax_cross_entropy(&logits, &labels, batch).unwrap();
    // input gradient through a second backward that keeps the input gradient
    let mut g = gl;
    let mut scratch: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    for u in (0..m.num_units()).rev() {
        g = m.backward_unit(u, &params[u], &saved[u], g, &mut scratch[u], &c).unwrap();
    }
    assert_eq!(scratch, grads, "backward is deterministic");
    // Ctx::overwrite_grads: written over whatever the buffer held (NaN here), the same.
    let cw = ctx(&be, true, None, batch).with_overwrite_grads(true);
    let mut g = softmax_cross_entropy(&logits, &labels, batch).unwrap().1;
    let mut stale: Vec<Vec<f32>> = params.iter().map(|p| vec![f32::NAN; p.len()]).collect();
    for u in (0..m.num_units()).rev() {
        g = m.backward_unit(u, &params[u], &saved[u], g, &mut stale[u], &cw).unwrap();
    }
    assert_eq!(stale, grads, "overwriting backward differs from adding into zeros");
    let eps = 1e-3f32;
    let close = |num: f64, ana: f32, what: String| {
        assert!(
            (num - ana as f64).abs() <= 3e-3 + 2e-2 * (ana as f64).abs(),
            "{what}: numeric {num} vs analytical {ana}"
        );
    };
    for u in 0..params.len() {
        for i in 0..params[u].len() {
            let mut p = params.clone();
            p[u][i] += eps;
            let up = loss(&p, x.clone());
            p[u][i] -= 2.0 * eps;
            let down = loss(&p, x.clone());
            close(
                (up - down) / (2.0 * eps as f64),
                grads[u][i],
                format!("{} unit {u} param {i}", m.name),
            );
        }
    }
    for i in 0..x.numel() {
        let mut xp = x.clone();
        xp.as_f32_mut().unwrap()[i] += eps;
        let up = loss(&params, xp.clone());
        xp.as_f32_mut().unwrap()[i] -= 2.0 * eps;
        let down = loss(&params, xp);
        close(
            (up - down) / (2.0 * eps as f64),
            g.as_f32().unwrap()[i],
            format!("{} input {i}", m.name),
        );
    }
}

#[test]
fn mlp_bn_gradients_match_finite_differences() {
    model_gradcheck(&MlpBn { input_dim: 3, hidden: 4, depth: 2, classes: 3 }.build(), 5, 1);
}

#[test]
fn convnet_bn_gradients_match_finite_differences() {
    let m = ConvNetBn { input: [1, 4, 4], widths: vec![2, 3], classes: 3 }.build().unwrap();
    model_gradcheck(&m, 3, 2);
}

/// MODEL-4: the split backward gives bitwise the gradients and input gradients of
/// `backward_unit`, defers exactly where a unit starts with a linear layer, and skipping
/// the input gradient changes no parameter gradient.
#[test]
fn split_backward_matches_backward_unit() {
    let be = Cpu::new();
    let models = [
        (MlpBn { input_dim: 5, hidden: 6, depth: 3, classes: 4 }.build(), true),
        (
            MlpBn { input_dim: 5, hidden: 6, depth: 3, classes: 4 }
                .build()
                .wrap(WrapPolicy::ByParams(60)),
            true,
        ),
        (ConvNetBn { input: [1, 4, 4], widths: vec![2, 3], classes: 3 }.build().unwrap(), false),
    ];
    for (m, linear_first) in &models {
        assert!(m.num_units() >= 2, "{}: one unit tests nothing", m.name);
        let (params, buffers) = init(m, 7);
        let batch = 6;
        let mut shape = vec![batch];
        shape.extend_from_slice(&m.input_shape);
        let x = rand_tensor(&shape, 8);
        let labels: Vec<u32> = (0..batch).map(|i| (i % m.classes) as u32).collect();
        for overwrite in [false, true] {
            let c = ctx(&be, true, None, batch).with_overwrite_grads(overwrite);
            let (logits, saved) = m.forward(&params, &mut buffers.clone(), x.clone(), &c).unwrap();
            let gl = softmax_cross_entropy(&logits, &labels, batch).unwrap().1;
            let fresh = || -> Vec<Vec<f32>> {
                params
                    .iter()
                    .map(|p| vec![if overwrite { f32::NAN } else { 0.0 }; p.len()])
                    .collect()
            };
            let (mut want, mut got, mut skipped) = (fresh(), fresh(), fresh());
            let (mut gw, mut gg, mut gs) = (gl.clone(), gl.clone(), gl);
            for u in (0..m.num_units()).rev() {
                let p = &params[u];
                gw = m.backward_unit(u, p, &saved[u], gw, &mut want[u], &c).unwrap();
                let call = |grad_output, grads_out, input_grad| UnitBackward {
                    unit: u,
                    params: p,
                    saved: &saved[u],
                    grad_output,
                    grads_out,
                    input_grad,
                };
                let split = m.backward_unit_split(call(gg, &mut got[u], true), &c).unwrap();
                // Every MLP unit starts with a linear layer; the conv net's units start
                // with a convolution (its head with pooling).
                assert_eq!(split.is_deferred(), *linear_first, "{} unit {u}", m.name);
                gg = split.finish(&be, p).unwrap().expect("asked for");
                assert_eq!(gg, gw, "{} unit {u}: input gradient", m.name);
                let skip = m.backward_unit_split(call(gs, &mut skipped[u], u > 0), &c).unwrap();
                if u == 0 {
                    assert!(matches!(skip, InputGrad::Skipped), "{}", m.name);
                    gs = Tensor::default();
                } else {
                    gs = skip.finish(&be, p).unwrap().expect("asked for");
                }
            }
            assert_eq!(got, want, "{} overwrite {overwrite}: split gradients", m.name);
            assert_eq!(skipped, want, "{} overwrite {overwrite}: skipped input", m.name);
            assert!(want.iter().flatten().all(|v| v.is_finite()));
        }
    }
}

#[test]
fn names_are_stable_and_independent_of_wrapping() {
    // MODEL-1
    let m = ConvNetBn::digits().build().unwrap();
    let spec = m.spec();
    let names: Vec<String> =
        spec.units.iter().flat_map(|u| u.params.iter().map(|p| p.name.clone())).collect();
    assert_eq!(names[0], "stem.conv.weight");
    assert!(names.contains(&"blocks.1.downsample.bn.weight".to_string()));
    assert!(names.contains(&"head.fc.bias".to_string()));
    let bufs: Vec<String> =
        spec.units.iter().flat_map(|u| u.buffers.iter().map(|p| p.name.clone())).collect();
    assert!(bufs.contains(&"blocks.0.bn1.running_mean".to_string()));
    assert!(bufs.contains(&"stem.bn.num_batches_tracked".to_string()));
    let mlp = MlpBn::digits().build();
    let s = mlp.spec();
    assert_eq!(s.units[0].name, "blocks.0");
    assert_eq!(
        s.units[0].params.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
        [
            "blocks.0.linear.weight",
            "blocks.0.linear.bias",
            "blocks.0.bn.weight",
            "blocks.0.bn.bias"
        ]
    );
    assert_eq!(s.units[0].buffers[0].name, "blocks.0.bn.running_mean");
    // the same names and values under another wrap policy
    let merged = m.clone().wrap(WrapPolicy::ByParams(6000));
    assert!(merged.num_units() < m.num_units());
    let mn: Vec<String> =
        merged.spec().units.iter().flat_map(|u| u.params.iter().map(|p| p.name.clone())).collect();
    assert_eq!(mn, names);
    let a: Vec<f32> = (0..m.num_units()).flat_map(|u| m.init_params(u, 7).unwrap()).collect();
    let b: Vec<f32> =
        (0..merged.num_units()).flat_map(|u| merged.init_params(u, 7).unwrap()).collect();
    assert_eq!(a, b);
    assert_eq!(m.spec().numel(), m.num_params());
    assert_ne!(
        a,
        (0..m.num_units()).flat_map(|u| m.init_params(u, 8).unwrap()).collect::<Vec<_>>()
    );
}

#[test]
fn init_follows_pytorch_bounds() {
    let m = MlpBn { input_dim: 100, hidden: 50, depth: 1, classes: 10 }.build();
    let p = m.init_params(0, 3).unwrap();
    let bound = 0.1f32;
    assert!(p[..5050].iter().all(|v| v.abs() <= bound));
    assert!(p[..5000].iter().any(|v| v.abs() > 0.09));
    assert!(p[5050..5100].iter().all(|&v| v == 1.0) && p[5100..].iter().all(|&v| v == 0.0));
}

#[test]
fn wide_mlp_is_sized_by_parameter_count() {
    // MODEL-3: a 50M-parameter spec without parameter memory
    let w = WideMlp::with_params(50_000_000);
    let m = w.build();
    assert_eq!(m.spec().numel(), w.num_params());
    assert!((w.num_params() as f64 - 5e7).abs() / 5e7 < 0.01);
    assert_eq!(m.spec().units[0].params[0].name, "blocks.0.linear.weight");
    let small = WideMlp::with_params(100_000);
    assert!((small.num_params() as f64 - 1e5).abs() / 1e5 < 0.2);
}

fn slice_rows(x: &Tensor, a: usize, b: usize) -> Tensor {
    let per: usize = x.shape()[1..].iter().product();
    let mut shape = x.shape().to_vec();
    shape[0] = b - a;
    Tensor::new(shape, x.as_f32().unwrap()[a * per..b * per].to_vec()).unwrap()
}

#[test]
fn sync_convnet_on_uneven_ranks_equals_single_process() {
    // BN-1 at model level, LOSS-1, MODEL-2 (fused messages counted)
    let mut m = ConvNetBn { input: [1, 6, 6], widths: vec![3, 4], classes: 4 }.build().unwrap();
    let sizes = [3usize, 0, 4, 1];
    let total: usize = sizes.iter().sum();
    let x = rand_tensor(&[total, 1, 6, 6], 5);
    let labels: Vec<u32> = (0..total).map(|i| (i % 4) as u32).collect();
    let be = Cpu::new();
    let (params, buffers) = init(&m, 4);
    let mut want_buf = buffers.clone();
    let (want_loss, want_grads) = m
        .loss_and_grads(&params, &mut want_buf, x.clone(), &labels, &ctx(&be, true, None, total))
        .unwrap();
    assert!(m.has_local_batchnorm());
    let converted = convert_sync_batchnorm(&mut m);
    assert_eq!(converted, 6);
    assert!(!m.has_local_batchnorm());
    let reducers = thread_reducers(sizes.len(), Duration::from_secs(30));
    let starts: Vec<usize> = sizes
        .iter()
        .scan(0, |s, &n| {
            *s += n;
            Some(*s - n)
        })
        .collect();
    let res = run_ranks(sizes.len(), |r| {
        let counter = CountingReducer::new(&reducers[r]);
        let mut b = buffers.clone();
        let xr = slice_rows(&x, starts[r], starts[r] + sizes[r]);
        let c = ctx(&be, true, Some(&counter), total);
        let out = m
            .loss_and_grads(&params, &mut b, xr, &labels[starts[r]..starts[r] + sizes[r]], &c)
            .unwrap();
        (out, b, counter.messages())
    });
    let loss: f32 = res.iter().map(|r| r.0 .0).sum();
    assert!((loss - want_loss).abs() < 1e-5);
    for u in 0..params.len() {
        for i in 0..params[u].len() {
            let g: f32 = res.iter().map(|r| r.0 .1[u][i]).sum();
            assert!(
                (g - want_grads[u][i]).abs() < 1e-4 + 1e-3 * want_grads[u][i].abs(),
                "unit {u} param {i}: {g} vs {}",
                want_grads[u][i]
            );
        }
    }
    for r in &res {
        for (a, b) in r.1.iter().flatten().zip(want_buf.iter().flatten()) {
            assert!((a - b).abs() < 1e-5);
        }
        // stem 1 + block0 2 (bn1, bn2 with identity shortcut) + block1 2 (bn1, fused bn2+downsample.bn), each way
        assert_eq!(r.2, 10, "stats messages per step");
    }
    // ctx.sync_bn converts on the fly: an unconverted model gives the same messages
    let plain = ConvNetBn { input: [1, 6, 6], widths: vec![3, 4], classes: 4 }.build().unwrap();
    let res2 = run_ranks(sizes.len(), |r| {
        let counter = CountingReducer::new(&reducers[r]);
        let mut b = buffers.clone();
        let xr = slice_rows(&x, starts[r], starts[r] + sizes[r]);
        let c = Ctx { sync_bn: true, ..ctx(&be, true, Some(&counter), total) };
        let out = plain
            .loss_and_grads(&params, &mut b, xr, &labels[starts[r]..starts[r] + sizes[r]], &c)
            .unwrap();
        (out.0, counter.messages())
    });
    assert!((res2.iter().map(|r| r.0).sum::<f32>() - want_loss).abs() < 1e-5);
    assert!(res2.iter().all(|r| r.1 == 10));
}

#[test]
fn eval_mode_sends_no_messages() {
    let mut m = MlpBn { input_dim: 4, hidden: 5, depth: 2, classes: 3 }.build();
    convert_sync_batchnorm(&mut m);
    let (params, mut buffers) = init(&m, 1);
    let be = Cpu::new();
    let reducers = thread_reducers(1, Duration::from_secs(5));
    let counter = CountingReducer::new(&reducers[0]);
    let (y, _) = m
        .forward(
            &params,
            &mut buffers,
            rand_tensor(&[1, 4], 2),
            &ctx(&be, false, Some(&counter), 1),
        )
        .unwrap();
    assert_eq!(y.shape(), vec![1, 3]);
    assert_eq!(counter.messages(), 0);
}

/// SGD with momentum over the digits train split; returns the test accuracy.
fn train_digits(m: &Model, image: bool, epochs: u64, batch: usize, lr: f32) -> f64 {
    let data = crate::data::Dataset::digits(image).unwrap();
    let (train, test) = data.split(0.2, 0);
    let (mut params, mut buffers) = init(m, 0);
    let be = Cpu::new();
    let sampler = crate::data::DistributedSampler::new(train.len(), 1, batch, 0, true).unwrap();
    let mut mom: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    for epoch in 0..epochs {
        for (gb, idx) in sampler.rank_batches(epoch, 0) {
            if gb < 2 {
                continue;
            }
            let (x, y) = train.batch(&idx);
            let (_, grads) =
                m.loss_and_grads(&params, &mut buffers, x, &y, &ctx(&be, true, None, gb)).unwrap();
            for u in 0..params.len() {
                for i in 0..params[u].len() {
                    mom[u][i] = 0.9 * mom[u][i] + grads[u][i];
                    params[u][i] -= lr * mom[u][i];
                }
            }
        }
    }
    let idx: Vec<usize> = (0..test.len()).collect();
    let (x, y) = test.batch(&idx);
    let (logits, _) =
        m.forward(&params, &mut buffers, x, &ctx(&be, false, None, test.len())).unwrap();
    crate::loss::correct_count(&logits, &y).unwrap() as f64 / test.len() as f64
}

#[test]
fn convnet_bn_learns_digits() {
    let acc = train_digits(&ConvNetBn::digits().build().unwrap(), true, 4, 32, 0.05);
    assert!(acc >= 0.9, "test accuracy {acc}");
}

#[test]
fn mlp_bn_learns_digits() {
    // the default digits configuration reaches >= 95% test accuracy
    let acc = train_digits(&MlpBn::digits().build(), false, 15, 32, 0.05);
    assert!(acc >= 0.95, "test accuracy {acc}");
}
