//! The gated MLP's backward is the derivative of its forward: its parameter and input
//! gradients match central finite differences of `L = sum(y * r)`, in f32 with a tolerance
//! loose enough for f32 rounding yet far below what a wrong term moves them by (the
//! negative control swaps the gate's and the value's gradients, both `[hidden, dim]`).

use custom_model::GatedMlp;
use shardline_models::module::{init_values, Buffers, Grads, Module, Params};
use shardline_models::{Cpu, Ctx, Tensor};

const DIM: usize = 4;
const HIDDEN: usize = 6;
const SHAPE: [usize; 3] = [2, 3, DIM];
/// Finite-difference step: f32 rounding of the loss (about 1e-6) over it stays near 1e-4,
/// as does its truncation error (step squared).
const STEP: f32 = 1e-2;
/// Largest error allowed, relative to the largest gradient of the tensor (a correct backward
/// stays near 1e-5).
const TOL: f32 = 1e-3;

/// Deterministic values in `[-scale, scale]`.
fn values(n: usize, phase: f32, scale: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.731 + phase).sin() * scale).collect()
}

/// `sum(forward(p, x) * r)`, accumulated in f64.
fn loss(m: &GatedMlp, p: &[f32], x: &[f32], r: &[f32]) -> f32 {
    let be = Cpu::new();
    let ctx = Ctx::new(&be, true, SHAPE[0]);
    let x = Tensor::new(SHAPE.to_vec(), x.to_vec()).unwrap();
    let (y, _) = m.forward(Params::new(p), Buffers::none(), x, &ctx).unwrap();
    y.as_f32().unwrap().iter().zip(r).map(|(a, b)| f64::from(a * b)).sum::<f64>() as f32
}

/// Backward of `L` with gradients added into `g`: returns the input gradient.
fn backward(m: &GatedMlp, p: &[f32], x: &[f32], r: &[f32], g: &mut [f32]) -> Vec<f32> {
    let be = Cpu::new();
    let ctx = Ctx::new(&be, true, SHAPE[0]);
    let x = Tensor::new(SHAPE.to_vec(), x.to_vec()).unwrap();
    let (y, saved) = m.forward(Params::new(p), Buffers::none(), x, &ctx).unwrap();
    let dy = Tensor::new(y.shape().to_vec(), r.to_vec()).unwrap();
    let dx = m.backward(Params::new(p), saved, dy, Grads::new(g), &ctx).unwrap();
    assert_eq!(dx.shape(), &SHAPE[..]);
    dx.into_f32().unwrap()
}

/// Central differences of `f` at `at`, one coordinate at a time.
fn numeric(at: &[f32], f: impl Fn(&[f32]) -> f32) -> Vec<f32> {
    (0..at.len())
        .map(|i| {
            let (mut hi, mut lo) = (at.to_vec(), at.to_vec());
            hi[i] += STEP;
            lo[i] -= STEP;
            (f(&hi) - f(&lo)) / (2.0 * STEP)
        })
        .collect()
}

/// The largest difference relative to the largest numeric gradient.
fn rel_err(analytic: &[f32], numeric: &[f32]) -> f32 {
    let scale = numeric.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = analytic.iter().zip(numeric).fold(0.0f32, |m, (a, n)| m.max((a - n).abs()));
    err / scale
}

struct Case {
    m: GatedMlp,
    p: Vec<f32>,
    x: Vec<f32>,
    r: Vec<f32>,
}

fn case() -> Case {
    let m = GatedMlp::new(DIM, HIDDEN);
    // torch's init (uniform, 1/sqrt(dim) = 0.5): pre-activations of order one, where SiLU
    // is far from linear.
    let p = init_values(&m.params(), 11);
    let n: usize = SHAPE.iter().product();
    Case { x: values(n, 0.3, 1.5), r: values(n, 1.7, 1.0), p, m }
}

#[test]
fn gated_mlp_gradients_match_finite_differences() {
    let Case { m, p, x, r } = case();
    let mut g = vec![0.0; p.len()];
    let dx = backward(&m, &p, &x, &r, &mut g);
    let gp = numeric(&p, |q| loss(&m, q, &x, &r));
    let gx = numeric(&x, |y| loss(&m, &p, y, &r));
    let split = DIM * HIDDEN;
    for (name, range) in [("w1", 0..split), ("w2", split..2 * split), ("w3", 2 * split..3 * split)]
    {
        let e = rel_err(&g[range.clone()], &gp[range]);
        assert!(e < TOL, "{name}: relative error {e:e}");
    }
    let e = rel_err(&dx, &gx);
    assert!(e < TOL, "input: relative error {e:e}");
    // Backward adds into the gradients (a tied parameter sums its uses): a second pass
    // doubles them.
    let once = g.clone();
    backward(&m, &p, &x, &r, &mut g);
    assert!(g.iter().zip(&once).all(|(a, b)| (a - 2.0 * b).abs() <= 1e-6 * b.abs().max(1.0)));
}

#[test]
fn the_check_catches_swapped_gate_and_value_gradients() {
    let Case { m, p, x, r } = case();
    let mut g = vec![0.0; p.len()];
    backward(&m, &p, &x, &r, &mut g);
    let gp = numeric(&p, |q| loss(&m, q, &x, &r));
    let split = DIM * HIDDEN;
    // w1 and w3 have the same shape: a backward that mixed them up would still run.
    let (w1, rest) = g.split_at_mut(split);
    w1.swap_with_slice(&mut rest[split..2 * split]);
    let e = rel_err(&g[..split], &gp[..split]);
    assert!(e > 10.0 * TOL, "swapped w1 gradient passes: relative error {e:e}");
}
