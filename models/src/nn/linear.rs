//! Fully connected kernel, `y = x W^T + b` over a `[rows, in]` buffer, with PyTorch's layout
//! (`weight [out, in]`, then `bias [out]`), generic over the float type.
//!
//! [`crate::layers::Linear`] is the `f32` layer of the model zoo, running on a
//! [`crate::Backend`]; this kernel is the float-generic form the transformer kernels are
//! built from, so that a whole decoder can be checked in `f64`. Its three products
//! (`x W^T`, `dy W`, `dy^T x`) are one [`Gemm::gemm`] each, in `f32` and `f64` alike.
//!
//! Invariants:
//! - `LIN-1`: forward is `torch.nn.functional.linear(x, weight, bias)`: `y[r, o] = b[o] +
//!   sum_i x[r, i] * weight[o, i]`, without a bias when the kernel has none.
//! - `LIN-2`: backward writes `dx = dy W` (when asked for) and ADDS `dW += dy^T x` and
//!   `db += sum_rows dy` into the caller's gradient buffer, laid out as the parameters
//!   (NN-3).

use super::gemm::Gemm;
use super::{rows, same_len};
use crate::backend::GemmShape;
use crate::error::ModelError;
use crate::layers::check_len;
use crate::spec::ParamSpec;

/// A fully connected kernel; parameters `weight [out_dim, in_dim]`, then `bias [out_dim]`
/// when `bias`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear {
    /// Input features (the row width of `x`).
    pub in_dim: usize,
    /// Output features (the row width of `y`).
    pub out_dim: usize,
    /// Whether the kernel adds a bias.
    pub bias: bool,
}

impl Linear {
    /// A `[out_dim, in_dim]` kernel, with a bias when `bias`.
    pub fn new(in_dim: usize, out_dim: usize, bias: bool) -> Self {
        Linear { in_dim, out_dim, bias }
    }

    /// `weight [out, in]`, then `bias [out]` (torch's names and order).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let mut v =
            vec![ParamSpec { name: "weight".into(), shape: vec![self.out_dim, self.in_dim] }];
        if self.bias {
            v.push(ParamSpec { name: "bias".into(), shape: vec![self.out_dim] });
        }
        v
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.out_dim * self.in_dim + if self.bias { self.out_dim } else { 0 }
    }

    /// Writes `y = x W^T + b` into `y [rows, out_dim]` (LIN-1).
    pub fn forward<T: Gemm>(&self, params: &[T], x: &[T], y: &mut [T]) -> Result<(), ModelError> {
        let (ni, no) = (self.in_dim, self.out_dim);
        let n = rows("linear input", x.len(), ni)?;
        check_len("linear params", params.len(), self.num_params())?;
        check_len("linear output", y.len(), n * no)?;
        let (w, b) = params.split_at(no * ni);
        // With a bias, every row starts as `b` and the product is added onto it.
        if self.bias {
            y.chunks_exact_mut(no.max(1)).for_each(|yr| yr.copy_from_slice(b));
        }
        let shape = GemmShape { m: n, n: no, k: ni, trans_a: false, trans_b: true };
        T::gemm(shape, x, w, y, self.bias);
        Ok(())
    }

    /// Writes `dx = dy W` into `dx` when given and ADDS `dW += dy^T x`, `db += sum_rows dy`
    /// into `grads` (LIN-2).
    pub fn backward<T: Gemm>(
        &self,
        params: &[T],
        x: &[T],
        dy: &[T],
        dx: Option<&mut [T]>,
        grads: &mut [T],
    ) -> Result<(), ModelError> {
        let (ni, no) = (self.in_dim, self.out_dim);
        let n = rows("linear input", x.len(), ni)?;
        check_len("linear params", params.len(), self.num_params())?;
        check_len("linear grads", grads.len(), self.num_params())?;
        check_len("linear dy", dy.len(), n * no)?;
        if let Some(dx) = &dx {
            same_len(&[("linear dx", dx.len())], x.len())?;
        }
        let w = &params[..no * ni];
        if let Some(dx) = dx {
            let shape = GemmShape { m: n, n: ni, k: no, trans_a: false, trans_b: false };
            T::gemm(shape, dy, w, dx, false);
        }
        let (dw, db) = grads.split_at_mut(no * ni);
        T::gemm(GemmShape { m: no, n: ni, k: n, trans_a: true, trans_b: false }, dy, x, dw, true);
        if self.bias {
            for dyr in dy.chunks_exact(no.max(1)).take(n) {
                db.iter_mut().zip(dyr).for_each(|(d, &g)| *d = *d + g);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::{
        assert_close, assert_f32_close, assert_grads, randn, to_f32, to_f64,
    };

    // PyTorch 2.15, float64:
    // X = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
    // W = torch.tensor([[0.1, 0.2, -0.3], [0.4, -0.5, 0.6]]); B = torch.tensor([0.05, -0.1])
    // y = F.linear(X, W, B)
    const X: [f64; 6] = [0.5, -1.0, 2.0, 1.5, 0.25, -0.75];
    const P: [f64; 8] = [0.1, 0.2, -0.3, 0.4, -0.5, 0.6, 0.05, -0.1];
    const Y: [f64; 4] = [-0.7, 1.8, 0.475, -0.075];

    /// LIN-1: torch's values, with and without the bias.
    #[test]
    fn forward_is_torch_linear() {
        let lin = Linear::new(3, 2, true);
        let mut y = vec![f64::NAN; 4];
        lin.forward(&P, &X, &mut y).unwrap();
        assert_close("y", &y, &Y, 1e-15);
        let nob = Linear::new(3, 2, false);
        nob.forward(&P[..6], &X, &mut y).unwrap();
        let want: Vec<f64> = Y.iter().zip([0.05, -0.1, 0.05, -0.1]).map(|(y, b)| y - b).collect();
        assert_close("y without bias", &y, &want, 1e-15);
    }

    fn check(bias: bool, seed: u64) {
        let lin = Linear::new(5, 3, bias);
        let (x, p, r) =
            (randn(4 * 5, seed), randn(lin.num_params(), seed + 1), randn(12, seed + 2));
        let mut dx = vec![f64::NAN; 20];
        let mut g = vec![0.0; lin.num_params()];
        lin.backward(&p, &x, &r, Some(&mut dx), &mut g).unwrap();
        let f = |a: &[Vec<f64>]| {
            let mut y = vec![0.0; 12];
            lin.forward(&a[1], &a[0], &mut y).unwrap();
            y
        };
        assert_grads(&["x", "params"], &[x, p], &r, &f, &[dx, g]);
    }

    #[test]
    fn gradients_match_finite_differences_nn_1_lin_2() {
        check(true, 70);
        check(false, 80);
    }

    /// LIN-2: parameter gradients add up over calls; `dx` is written.
    #[test]
    fn parameter_gradients_are_added_lin_2() {
        let lin = Linear::new(3, 2, true);
        let dy = [1.0, -2.0, 0.5, 0.25];
        let mut once = vec![0.0; 8];
        lin.backward(&P, &X, &dy, None, &mut once).unwrap();
        let mut twice = vec![1.0; 8];
        let mut dx = vec![f64::NAN; 6];
        lin.backward(&P, &X, &dy, Some(&mut dx), &mut twice).unwrap();
        lin.backward(&P, &X, &dy, Some(&mut dx), &mut twice).unwrap();
        let want: Vec<f64> = once.iter().map(|g| 1.0 + 2.0 * g).collect();
        assert_close("twice", &twice, &want, 1e-15);
        assert!(dx.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn f32_matches_f64_nn_2() {
        let lin = Linear::new(6, 4, true);
        let x = to_f32(&randn(18, 90));
        let p = to_f32(&randn(lin.num_params(), 91));
        let mut y32 = vec![0.0f32; 12];
        let mut y64 = vec![0.0f64; 12];
        lin.forward(&p, &x, &mut y32).unwrap();
        lin.forward(&to_f64(&p), &to_f64(&x), &mut y64).unwrap();
        assert_f32_close("y", &y32, &y64);
    }

    #[test]
    fn wrong_lengths_are_shape_errors_nn_4() {
        let lin = Linear::new(3, 2, true);
        let mut y = vec![0.0; 4];
        assert!(matches!(lin.forward(&P[..7], &X, &mut y), Err(ModelError::Shape { .. })));
        assert!(matches!(lin.forward(&P, &X[..5], &mut y), Err(ModelError::Shape { .. })));
        let mut g = vec![0.0; 7];
        assert!(matches!(lin.backward(&P, &X, &Y, None, &mut g), Err(ModelError::Shape { .. })));
    }
}
