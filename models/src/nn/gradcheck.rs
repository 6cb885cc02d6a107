//! Finite-difference gradient checks in `f64` for the kernels (NN-1), shared by their tests.
//!
//! A kernel under test is seen as `y = f(args)`, where `args` are the inputs being
//! differentiated (input, gain, bias, table...), each a flat `f64` vector. The checked scalar
//! is `L = sum(y * r)` for a fixed random `r`, whose gradient with respect to `args` is what
//! the kernel's backward returns when handed `dy = r`.
//!
//! The numerical gradient is a central difference refined by one Richardson step,
//! `(4 D(h/2) - D(h)) / 3` with `D(h) = (L(a + h) - L(a - h)) / 2h`: its truncation error is
//! `O(h^4)`, so with `h = 1e-3` both truncation and rounding stay near `1e-11` on the small
//! shapes used, far below the tolerance; a wrong element shows up alone.

use crate::rng::SplitMix64;

/// Tolerance of [`compare`] (absolute, and relative to the analytic value): NN-1.
pub(crate) const TOL: f64 = 1e-8;

/// Tolerance of an `f32` result against the `f64` result of the same kernel (NN-2),
/// relative to `max(1, |value|)`: sixteen `f32` epsilons.
pub(crate) const F32_TOL: f64 = 16.0 * f32::EPSILON as f64;

/// `n` standard normal values from `seed`.
pub(crate) fn randn(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.normal() as f64).collect()
}

/// The function under test: `args -> y`.
pub(crate) type Forward<'f> = dyn Fn(&[Vec<f64>]) -> Vec<f64> + 'f;

fn loss(f: &Forward<'_>, args: &[Vec<f64>], r: &[f64]) -> f64 {
    let y = f(args);
    assert_eq!(y.len(), r.len(), "the output length changed between calls");
    y.iter().zip(r).map(|(a, b)| a * b).sum()
}

/// Numerical gradient of `L = sum(f(args) * r)` with respect to every element of every arg.
pub(crate) fn numeric_grads(args: &[Vec<f64>], r: &[f64], f: &Forward<'_>) -> Vec<Vec<f64>> {
    let h = 1e-3;
    let mut work = args.to_vec();
    let mut out = Vec::with_capacity(args.len());
    for a in 0..args.len() {
        let mut g = Vec::with_capacity(args[a].len());
        for i in 0..args[a].len() {
            let x0 = args[a][i];
            let mut at = |dx: f64| {
                work[a][i] = x0 + dx;
                let l = loss(f, &work, r);
                work[a][i] = x0;
                l
            };
            let d = |l_up: f64, l_down: f64, step: f64| (l_up - l_down) / (2.0 * step);
            let d_h = d(at(h), at(-h), h);
            let d_half = d(at(h / 2.0), at(-h / 2.0), h / 2.0);
            g.push((4.0 * d_half - d_h) / 3.0);
        }
        out.push(g);
    }
    out
}

/// Compares analytic gradients with numerical ones, element by element: every
/// `|numeric - analytic| <= TOL * (1 + |analytic|)`. The error names the argument and the
/// element of the worst mismatch.
pub(crate) fn compare(
    names: &[&str],
    numeric: &[Vec<f64>],
    analytic: &[Vec<f64>],
) -> Result<(), String> {
    assert_eq!(names.len(), numeric.len(), "one name per argument");
    assert_eq!(numeric.len(), analytic.len(), "one analytic gradient per argument");
    let mut worst: Option<(f64, String)> = None;
    for ((name, num), ana) in names.iter().zip(numeric).zip(analytic) {
        if num.len() != ana.len() {
            return Err(format!(
                "{name}: {} analytic values for {} elements",
                ana.len(),
                num.len()
            ));
        }
        for (i, (n, a)) in num.iter().zip(ana).enumerate() {
            let excess = (n - a).abs() / (TOL * (1.0 + a.abs()));
            // A NaN on either side is the worst mismatch there is.
            let excess = if excess.is_nan() { f64::INFINITY } else { excess };
            if excess > 1.0 && worst.as_ref().is_none_or(|(w, _)| excess > *w) {
                worst = Some((excess, format!("{name}[{i}]: numeric {n:e}, analytic {a:e}")));
            }
        }
    }
    match worst {
        None => Ok(()),
        Some((_, what)) => Err(what),
    }
}

/// Checks `analytic` (the kernel's gradients of `sum(f(args) * r)`) against central
/// differences (NN-1), then shows that the check would catch one wrong element: for each
/// argument, one element moved by `10 * TOL * (1 + |g|)` must fail it.
pub(crate) fn assert_grads(
    names: &[&str],
    args: &[Vec<f64>],
    r: &[f64],
    f: &Forward<'_>,
    analytic: &[Vec<f64>],
) {
    let numeric = numeric_grads(args, r, f);
    if let Err(e) = compare(names, &numeric, analytic) {
        panic!("gradient check failed: {e}");
    }
    for (a, g) in analytic.iter().enumerate() {
        if g.is_empty() {
            continue;
        }
        let mut wrong = analytic.to_vec();
        let i = g.len() / 2;
        wrong[a][i] += 10.0 * TOL * (1.0 + g[i].abs());
        assert!(
            compare(names, &numeric, &wrong).is_err(),
            "the check missed a wrong element {}[{i}]",
            names[a]
        );
    }
}

/// Asserts that an `f32` result equals the `f64` result of the same computation to `f32`
/// rounding (NN-2).
pub(crate) fn assert_f32_close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = F32_TOL * w.abs().max(1.0);
        assert!((*g as f64 - w).abs() <= tol, "{what}[{i}]: f32 {g:e} vs f64 {w:e}");
    }
}

/// Asserts that `got` equals a reference computed in `f64` (by PyTorch) to `tol`, relative
/// to `max(1, |value|)`.
pub(crate) fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}[{i}]: got {g:e}, want {w:e}");
    }
}

/// The `f32` copy of an `f64` vector (the inputs of an NN-2 comparison are the `f32` values,
/// widened exactly for the `f64` run).
pub(crate) fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// The exact `f64` widening of an `f32` vector.
pub(crate) fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `y_i = x_i^3 * w_i`: gradients `3 x_i^2 w_i r_i` and `x_i^3 r_i`.
    fn cube(args: &[Vec<f64>]) -> Vec<f64> {
        args[0].iter().zip(&args[1]).map(|(x, w)| x * x * x * w).collect()
    }

    #[test]
    fn exact_gradients_pass_and_one_wrong_element_fails_nn_1() {
        let (x, w, r) = (randn(6, 1), randn(6, 2), randn(6, 3));
        let gx: Vec<f64> = (0..6).map(|i| 3.0 * x[i] * x[i] * w[i] * r[i]).collect();
        let gw: Vec<f64> = (0..6).map(|i| x[i] * x[i] * x[i] * r[i]).collect();
        let args = [x, w];
        assert_grads(&["x", "w"], &args, &r, &cube, &[gx.clone(), gw.clone()]);

        // A gradient off in one element by a small relative amount is named.
        let numeric = numeric_grads(&args, &r, &cube);
        let mut bad = gw.clone();
        bad[4] *= 1.0 + 1e-6;
        let err = compare(&["x", "w"], &numeric, &[gx.clone(), bad]).unwrap_err();
        assert!(err.starts_with("w[4]:"), "{err}");
        // A forgotten factor (2 instead of 3) fails everywhere; NaN fails too.
        let half: Vec<f64> = gx.iter().map(|g| g * 2.0 / 3.0).collect();
        assert!(compare(&["x", "w"], &numeric, &[half, gw.clone()]).is_err());
        let mut nan = gx;
        nan[0] = f64::NAN;
        assert!(compare(&["x", "w"], &numeric, &[nan, gw]).is_err());
    }
}
