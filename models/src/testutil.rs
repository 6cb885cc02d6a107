//! Test helpers: random tensors and finite-difference gradient checks.

use crate::error::ModelError;
use crate::rng::SplitMix64;
use crate::tensor::Tensor;

/// A tensor of standard normal values.
pub fn rand_tensor(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = SplitMix64::new(seed);
    let n = shape.iter().product();
    Tensor::new(shape.to_vec(), (0..n).map(|_| rng.normal()).collect()).unwrap()
}

/// Forward (and, given `grad_output`, backward) of the function under test:
/// `(params, input, grad_output, grads_out) -> (output, grad_input)`.
pub type FwdBwd<'f> = dyn Fn(&[f32], Tensor, Option<&Tensor>, &mut [f32]) -> Result<(Tensor, Option<Tensor>), ModelError>
    + 'f;

/// Checks analytical parameter and input gradients against central finite differences of
/// `L = sum(y * R)` for a fixed random `R`, with the loss accumulated in f64.
pub fn check_grads(num_params: usize, input_shape: &[usize], seed: u64, f: &FwdBwd<'_>) {
    let params: Vec<f32> = rand_tensor(&[num_params], seed ^ 0x55)
        .as_f32()
        .unwrap()
        .iter()
        .map(|v| 0.5 * v + 0.1)
        .collect();
    let x = rand_tensor(input_shape, seed);
    let mut scratch = vec![0.0f32; num_params];
    let (y, _) = f(&params, x.clone(), None, &mut scratch).expect("forward");
    let r = rand_tensor(y.shape(), seed ^ 0xAA);
    let loss = |p: &[f32], x: Tensor| -> f64 {
        let mut s = vec![0.0f32; num_params];
        let (y, _) = f(p, x, None, &mut s).expect("forward");
        y.as_f32()
            .unwrap()
            .iter()
            .zip(r.as_f32().unwrap())
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum()
    };
    let mut gp = vec![0.0f32; num_params];
    let (_, gx) = f(&params, x.clone(), Some(&r), &mut gp).expect("backward");
    let gx = gx.expect("grad input");
    assert_eq!(gx.shape(), x.shape(), "grad_input shape");
    let eps = 1e-3f32;
    let close = |num: f64, ana: f32, what: &str| {
        let tol = 5e-3 + 1e-2 * (ana as f64).abs();
        assert!(
            (num - ana as f64).abs() <= tol,
            "{what}: finite difference {num} vs analytical {ana}"
        );
    };
    for i in 0..num_params {
        let mut p = params.clone();
        p[i] += eps;
        let up = loss(&p, x.clone());
        p[i] -= 2.0 * eps;
        let down = loss(&p, x.clone());
        close((up - down) / (2.0 * eps as f64), gp[i], &format!("param {i}"));
    }
    for i in 0..x.numel() {
        let mut xp = x.clone();
        xp.as_f32_mut().unwrap()[i] += eps;
        let up = loss(&params, xp.clone());
        xp.as_f32_mut().unwrap()[i] -= 2.0 * eps;
        let down = loss(&params, xp);
        close((up - down) / (2.0 * eps as f64), gx.as_f32().unwrap()[i], &format!("input {i}"));
    }
}
