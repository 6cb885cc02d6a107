//! LayerNorm and RMSNorm over the last dimension of a `[rows, dim]` buffer, with PyTorch's
//! definitions, so that a model trained here and one trained with `torch.nn` compute the
//! same function from the same weights.
//!
//! Forward returns the per-row statistics backward needs (LayerNorm: mean and `rstd`;
//! RMSNorm: `rstd`), `rows` values each, not a copy of the normalised input: backward
//! recomputes `xhat` from the input (one multiply per element), so a layer keeps the input
//! and two small vectors instead of a second `[rows, dim]` buffer.
//!
//! Invariants:
//! - `NORM-1`: LayerNorm is `torch.nn.functional.layer_norm` over the last dimension:
//!   `y = (x - mean) * rstd * weight + bias`, `rstd = 1 / sqrt(var + eps)` with the BIASED
//!   variance (divided by `dim`) and `eps` inside the square root.
//! - `NORM-2`: RMSNorm is `torch.nn.functional.rms_norm` over the last dimension:
//!   `y = x * rstd * weight`, `rstd = 1 / sqrt(mean(x^2) + eps)`; [`RmsNorm::new`] takes
//!   torch's default `eps`, the machine epsilon of the float type.
//! - `NORM-3`: the saved statistics are torch's: LayerNorm's mean and `rstd` are the second
//!   and third outputs of `torch.native_layer_norm`.
//! - `NORM-4`: with `eps > 0` a constant row (zero variance; for RMSNorm a zero row) gives a
//!   finite output (LayerNorm: the bias; RMSNorm: zero) and finite gradients, never NaN.

use num_traits::Float;

use super::{lit, rows, same_len};
use crate::error::ModelError;
use crate::layers::check_len;
use crate::spec::ParamSpec;

/// LayerNorm over the last dimension; parameters `weight [dim]` (the gain), then
/// `bias [dim]` when `bias`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNorm<T> {
    /// Size of the normalised (last) dimension.
    pub dim: usize,
    /// Added to the variance inside the square root (torch's default `1e-5`).
    pub eps: T,
    /// Whether the layer has a bias (torch's `bias=True` by default).
    pub bias: bool,
}

/// What [`LayerNorm::backward`] needs from the forward: per row, the mean and
/// `rstd = 1 / sqrt(var + eps)` (NORM-3).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormSaved<T> {
    /// Mean of each row.
    pub mean: Vec<T>,
    /// Reciprocal standard deviation of each row.
    pub rstd: Vec<T>,
}

impl<T: Float> LayerNorm<T> {
    /// torch's defaults: `eps = 1e-5`, with a bias.
    pub fn new(dim: usize) -> Self {
        LayerNorm { dim, eps: lit(1e-5), bias: true }
    }

    /// `weight [dim]`, then `bias [dim]` (torch's names and order).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let mut v = vec![ParamSpec { name: "weight".into(), shape: vec![self.dim] }];
        if self.bias {
            v.push(ParamSpec { name: "bias".into(), shape: vec![self.dim] });
        }
        v
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        if self.bias {
            2 * self.dim
        } else {
            self.dim
        }
    }

    /// Normalises each row of `x [rows, dim]` into `y` (NORM-1) and returns the rows'
    /// statistics for backward. `params` is `weight`, then `bias`.
    pub fn forward(
        &self,
        params: &[T],
        x: &[T],
        y: &mut [T],
    ) -> Result<LayerNormSaved<T>, ModelError> {
        let n = self.check_forward(params, x)?;
        check_len("layer_norm output", y.len(), x.len())?;
        let mut saved = LayerNormSaved { mean: Vec::with_capacity(n), rstd: Vec::with_capacity(n) };
        for (xr, yr) in x.chunks_exact(self.dim).zip(y.chunks_exact_mut(self.dim)) {
            yr.copy_from_slice(xr);
            self.normalize_row(params, yr, &mut saved);
        }
        Ok(saved)
    }

    /// [`LayerNorm::forward`] into a new buffer, the same values; the buffer grows row by
    /// row, so it is written once (no zero fill first).
    pub fn forward_new(
        &self,
        params: &[T],
        x: &[T],
    ) -> Result<(Vec<T>, LayerNormSaved<T>), ModelError> {
        let n = self.check_forward(params, x)?;
        let mut saved = LayerNormSaved { mean: Vec::with_capacity(n), rstd: Vec::with_capacity(n) };
        let mut y = Vec::with_capacity(x.len());
        for xr in x.chunks_exact(self.dim) {
            let at = y.len();
            y.extend_from_slice(xr);
            self.normalize_row(params, &mut y[at..], &mut saved);
        }
        Ok((y, saved))
    }

    /// Rows of `x`, once `x` and `params` fit the layer.
    fn check_forward(&self, params: &[T], x: &[T]) -> Result<usize, ModelError> {
        let n = rows("layer_norm input", x.len(), self.dim)?;
        check_len("layer_norm params", params.len(), self.num_params())?;
        Ok(n)
    }

    /// Normalises one row in place, pushing its statistics.
    #[inline(always)]
    fn normalize_row(&self, params: &[T], row: &mut [T], saved: &mut LayerNormSaved<T>) {
        let (gain, bias) = params.split_at(self.dim);
        let inv_d = T::one() / lit(self.dim as f64);
        // Two passes: the variance of the deviations, not E[x^2] - E[x]^2, which cancels
        // catastrophically in f32 when the mean is large against the spread.
        let mean = lane_sum(row, |v| v) * inv_d;
        let var = lane_sum(row, |v| (v - mean) * (v - mean)) * inv_d;
        let rstd = (var + self.eps).sqrt().recip();
        for (o, &g) in row.iter_mut().zip(gain) {
            *o = (*o - mean) * rstd * g;
        }
        if self.bias {
            for (o, &b) in row.iter_mut().zip(bias) {
                *o = *o + b;
            }
        }
        saved.mean.push(mean);
        saved.rstd.push(rstd);
    }

    /// Writes the input gradient into `dx` and ADDS `dweight = sum_rows dy * xhat` and
    /// `dbias = sum_rows dy` into `grads` (NN-3, laid out as `params`):
    /// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))` with `g = dy * weight`.
    pub fn backward(
        &self,
        params: &[T],
        x: &[T],
        saved: &LayerNormSaved<T>,
        dy: &[T],
        dx: &mut [T],
        grads: &mut [T],
    ) -> Result<(), ModelError> {
        self.check_backward(params, x, saved, grads)?;
        same_len(&[("layer_norm dy", dy.len()), ("layer_norm dx", dx.len())], x.len())?;
        let d = self.dim;
        for (r, ((xr, dyr), dxr)) in
            x.chunks_exact(d).zip(dy.chunks_exact(d)).zip(dx.chunks_exact_mut(d)).enumerate()
        {
            dxr.copy_from_slice(dyr);
            self.backward_row(params, xr, (saved.mean[r], saved.rstd[r]), dxr, grads);
        }
        Ok(())
    }

    /// [`LayerNorm::backward`] with the input gradient written over `dy_then_dx`, the same
    /// values.
    pub fn backward_in_place(
        &self,
        params: &[T],
        x: &[T],
        saved: &LayerNormSaved<T>,
        dy_then_dx: &mut [T],
        grads: &mut [T],
    ) -> Result<(), ModelError> {
        self.check_backward(params, x, saved, grads)?;
        check_len("layer_norm dy", dy_then_dx.len(), x.len())?;
        let d = self.dim;
        for (r, (xr, row)) in x.chunks_exact(d).zip(dy_then_dx.chunks_exact_mut(d)).enumerate() {
            self.backward_row(params, xr, (saved.mean[r], saved.rstd[r]), row, grads);
        }
        Ok(())
    }

    /// The lengths of a backward's inputs other than `dy` and `dx` (NN-4).
    fn check_backward(
        &self,
        params: &[T],
        x: &[T],
        saved: &LayerNormSaved<T>,
        grads: &[T],
    ) -> Result<(), ModelError> {
        let n = rows("layer_norm input", x.len(), self.dim)?;
        check_len("layer_norm params", params.len(), self.num_params())?;
        check_len("layer_norm grads", grads.len(), self.num_params())?;
        same_len(
            &[
                ("layer_norm saved mean", saved.mean.len()),
                ("layer_norm saved rstd", saved.rstd.len()),
            ],
            n,
        )
    }

    /// One row of the backward: `row` holds `dy` and is overwritten with `dx`.
    #[inline(always)]
    fn backward_row(
        &self,
        params: &[T],
        xr: &[T],
        (mean, rstd): (T, T),
        row: &mut [T],
        grads: &mut [T],
    ) {
        let d = self.dim;
        let gain = &params[..d];
        let (dgain, dbias) = grads.split_at_mut(d);
        let inv_d = T::one() / lit(d as f64);
        let (sum_g, sum_gx) = lane_sum2(xr, row, gain, |v, dy, g| {
            let xhat = (v - mean) * rstd;
            let g = dy * g;
            (g, g * xhat)
        });
        for ((dg, &v), &dy) in dgain.iter_mut().zip(xr).zip(row.iter()) {
            *dg = *dg + dy * ((v - mean) * rstd);
        }
        if self.bias {
            for (db, &dy) in dbias.iter_mut().zip(row.iter()) {
                *db = *db + dy;
            }
        }
        let (mean_g, mean_gx) = (sum_g * inv_d, sum_gx * inv_d);
        for ((o, &v), &g) in row.iter_mut().zip(xr).zip(gain) {
            let xhat = (v - mean) * rstd;
            *o = rstd * (*o * g - mean_g - xhat * mean_gx);
        }
    }
}

/// Partial sums of a row reduction: one running sum is a serial chain of adds that does not
/// vectorise; `LANES` independent ones do, and are combined in a fixed order, so a result
/// depends only on the row.
const LANES: usize = 16;

/// The lanes' partial sums combined pairwise, in a fixed order.
#[inline(always)]
fn combine<T: Float>(mut acc: [T; LANES]) -> T {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            acc[i] = acc[i] + acc[i + w];
        }
    }
    acc[0]
}

/// `sum_j f(row[j])` over `LANES` partial sums.
#[inline(always)]
fn lane_sum<T: Float>(row: &[T], f: impl Fn(T) -> T) -> T {
    let mut acc = [T::zero(); LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = *a + f(v);
        }
    }
    let tail = chunks.remainder().iter().fold(T::zero(), |s, &v| s + f(v));
    combine(acc) + tail
}

/// The two sums `sum_j f(a[j], b[j], c[j])` over `LANES` partial sums each.
#[inline(always)]
fn lane_sum2<T: Float>(a: &[T], b: &[T], c: &[T], f: impl Fn(T, T, T) -> (T, T)) -> (T, T) {
    let (mut acc0, mut acc1) = ([T::zero(); LANES], [T::zero(); LANES]);
    let (mut ca, mut cb, mut cc) =
        (a.chunks_exact(LANES), b.chunks_exact(LANES), c.chunks_exact(LANES));
    for ((ka, kb), kc) in (&mut ca).zip(&mut cb).zip(&mut cc) {
        for i in 0..LANES {
            let (u, v) = f(ka[i], kb[i], kc[i]);
            acc0[i] = acc0[i] + u;
            acc1[i] = acc1[i] + v;
        }
    }
    let (mut t0, mut t1) = (T::zero(), T::zero());
    for ((&x, &y), &z) in ca.remainder().iter().zip(cb.remainder()).zip(cc.remainder()) {
        let (u, v) = f(x, y, z);
        t0 = t0 + u;
        t1 = t1 + v;
    }
    (combine(acc0) + t0, combine(acc1) + t1)
}

/// RMSNorm over the last dimension; one parameter, `weight [dim]` (the gain).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNorm<T> {
    /// Size of the normalised (last) dimension.
    pub dim: usize,
    /// Added to the mean square inside the square root.
    pub eps: T,
}

/// What [`RmsNorm::backward`] needs from the forward: per row,
/// `rstd = 1 / sqrt(mean(x^2) + eps)`.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormSaved<T> {
    /// Reciprocal root mean square of each row.
    pub rstd: Vec<T>,
}

impl<T: Float> RmsNorm<T> {
    /// torch's default: `eps` is the machine epsilon of `T` (`torch.finfo(dtype).eps`,
    /// what `eps=None` means), NORM-2.
    pub fn new(dim: usize) -> Self {
        RmsNorm { dim, eps: T::epsilon() }
    }

    /// `weight [dim]`.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        vec![ParamSpec { name: "weight".into(), shape: vec![self.dim] }]
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.dim
    }

    /// Normalises each row of `x [rows, dim]` into `y` (NORM-2) and returns the rows'
    /// `rstd` for backward.
    pub fn forward(
        &self,
        params: &[T],
        x: &[T],
        y: &mut [T],
    ) -> Result<RmsNormSaved<T>, ModelError> {
        let d = self.dim;
        let n = rows("rms_norm input", x.len(), d)?;
        check_len("rms_norm params", params.len(), d)?;
        check_len("rms_norm output", y.len(), x.len())?;
        let inv_d = T::one() / lit(d as f64);
        let mut saved = RmsNormSaved { rstd: Vec::with_capacity(n) };
        for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            let ms = xr.iter().fold(T::zero(), |s, &v| s + v * v) * inv_d;
            let rstd = (ms + self.eps).sqrt().recip();
            for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(params) {
                *o = v * rstd * g;
            }
            saved.rstd.push(rstd);
        }
        Ok(saved)
    }

    /// Writes the input gradient into `dx` and ADDS `dweight = sum_rows dy * xhat` into
    /// `grads` (NN-3): `dx = rstd * (g - xhat * mean(g * xhat))` with `g = dy * weight`,
    /// `xhat = x * rstd`.
    pub fn backward(
        &self,
        params: &[T],
        x: &[T],
        saved: &RmsNormSaved<T>,
        dy: &[T],
        dx: &mut [T],
        grads: &mut [T],
    ) -> Result<(), ModelError> {
        let d = self.dim;
        let n = rows("rms_norm input", x.len(), d)?;
        check_len("rms_norm params", params.len(), d)?;
        check_len("rms_norm grads", grads.len(), d)?;
        same_len(&[("rms_norm dy", dy.len()), ("rms_norm dx", dx.len())], x.len())?;
        check_len("rms_norm saved rstd", saved.rstd.len(), n)?;
        let inv_d = T::one() / lit(d as f64);
        for (r, ((xr, dyr), dxr)) in
            x.chunks_exact(d).zip(dy.chunks_exact(d)).zip(dx.chunks_exact_mut(d)).enumerate()
        {
            let rstd = saved.rstd[r];
            let mut sum_gx = T::zero();
            for j in 0..d {
                let xhat = xr[j] * rstd;
                sum_gx = sum_gx + dyr[j] * params[j] * xhat;
                grads[j] = grads[j] + dyr[j] * xhat;
            }
            let mean_gx = sum_gx * inv_d;
            for j in 0..d {
                dxr[j] = rstd * (dyr[j] * params[j] - xr[j] * rstd * mean_gx);
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

    // The inputs of the references from PyTorch 2.15 below, all float64:
    // X = torch.tensor([[0.5, -1.25, 2.0, 0.75, -0.3], [1.5, 1.4, -2.2, 0.1, 3.3]])
    // W = torch.tensor([1.1, -0.7, 0.9, 1.3, 0.6]); B = torch.tensor([0.05, -0.2, 0.3, 0.0, 0.15])
    // DY = torch.tensor([[0.3, -0.6, 1.2, 0.4, -0.9], [-1.1, 0.25, 0.7, -0.35, 0.8]])
    const X: [f64; 10] = [0.5, -1.25, 2.0, 0.75, -0.3, 1.5, 1.4, -2.2, 0.1, 3.3];
    const W: [f64; 5] = [1.1, -0.7, 0.9, 1.3, 0.6];
    const B: [f64; 5] = [0.05, -0.2, 0.3, 0.0, 0.15];
    const DY: [f64; 10] = [0.3, -0.6, 1.2, 0.4, -0.9, -1.1, 0.25, 0.7, -0.35, 0.8];

    // y = F.layer_norm(X, (5,), W, B, eps=1e-5)
    const LN_Y: [f64; 10] = [
        0.21219923732501897,
        0.8257258587656029,
        1.6768503441112403,
        0.49120564485360857,
        -0.20388924507276865,
        0.46066617405701876,
        -0.4229016934052802,
        -1.1922335041269743,
        -0.5138817365205474,
        0.9669401965198445,
    ];
    // _, mean, rstd = torch.ops.aten.native_layer_norm(X, [5], W, B, 1e-5)
    const LN_MEAN: [f64; 2] = [0.34, 0.8199999999999998];
    const LN_RSTD: [f64; 2] = [0.921586575710335, 0.5490189492740891];
    // torch.autograd.grad(y, (X, W, B), DY)
    const LN_DX: [f64; 10] = [
        -0.07298765928567072,
        0.48570235446666543,
        0.21041893940701809,
        0.034149901250949216,
        -0.6572835358389622,
        -0.5546978824927065,
        0.009204630074369294,
        0.2952092867021762,
        -0.20083797483326046,
        0.4511219405494216,
    ];
    const LN_DW: [f64; 5] = [
        -0.3664300184229227,
        0.9588013408724023,
        0.6751744000495625,
        0.2894929736335654,
        1.6200874629689457,
    ];
    const LN_DB: [f64; 5] = [-0.8, -0.35, 1.9, 0.050000000000000044, -0.09999999999999998];

    // y = F.rms_norm(X, (5,), W, eps=1e-6)
    const RMS_Y: [f64; 10] = [
        0.48368571258622045,
        0.7694999972962596,
        1.5829714230094485,
        0.857442854130118,
        -0.15829714230094485,
        0.8260330841179909,
        -0.4906135893549279,
        -0.9912397009415892,
        0.06508139450626595,
        0.991239700941589,
    ];
    // torch.autograd.grad(y, (X, W), DY)
    const RMS_DX: [f64; 10] = [
        0.13024125020984723,
        0.7692854420569172,
        0.30990214443812913,
        0.2173475895232354,
        -0.3789093204977036,
        -0.5339572891163109,
        -0.020595950684353173,
        0.21008733497439108,
        -0.2229981937116942,
        0.39826120654940544,
    ];
    const RMS_DW: [f64; 5] = [
        -0.6941187988672035,
        0.8347905653092682,
        1.33966435216914,
        0.24630665659604162,
        1.5590986480402025,
    ];

    /// Agreement with torch's float64 results: a few ulps of accumulated rounding.
    const TORCH_TOL: f64 = 1e-14;

    fn ln_params(bias: bool) -> Vec<f64> {
        let mut p = W.to_vec();
        if bias {
            p.extend_from_slice(&B);
        }
        p
    }

    fn ln_run<T: Float>(ln: &LayerNorm<T>, p: &[T], x: &[T], dy: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let mut y = vec![T::zero(); x.len()];
        let saved = ln.forward(p, x, &mut y).expect("forward");
        let (mut dx, mut grads) = (vec![T::zero(); x.len()], vec![T::zero(); p.len()]);
        ln.backward(p, x, &saved, dy, &mut dx, &mut grads).expect("backward");
        (y, dx, grads)
    }

    fn rms_run<T: Float>(rms: &RmsNorm<T>, p: &[T], x: &[T], dy: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let mut y = vec![T::zero(); x.len()];
        let saved = rms.forward(p, x, &mut y).expect("forward");
        let (mut dx, mut grads) = (vec![T::zero(); x.len()], vec![T::zero(); p.len()]);
        rms.backward(p, x, &saved, dy, &mut dx, &mut grads).expect("backward");
        (y, dx, grads)
    }

    /// NORM-1 (forward and gradients equal torch's), NORM-3 (the saved mean and rstd too).
    #[test]
    fn layer_norm_matches_torch() {
        let ln = LayerNorm { dim: 5, eps: 1e-5, bias: true };
        let p = ln_params(true);
        let mut y = vec![0.0; 10];
        let saved = ln.forward(&p, &X, &mut y).unwrap();
        assert_close("y", &y, &LN_Y, TORCH_TOL);
        assert_close("mean", &saved.mean, &LN_MEAN, TORCH_TOL);
        assert_close("rstd", &saved.rstd, &LN_RSTD, TORCH_TOL);
        let (_, dx, grads) = ln_run(&ln, &p, &X, &DY);
        assert_close("dx", &dx, &LN_DX, TORCH_TOL);
        assert_close("dweight", &grads[..5], &LN_DW, TORCH_TOL);
        assert_close("dbias", &grads[5..], &LN_DB, TORCH_TOL);

        // The f32 instance against torch's float64 values, to f32 precision (NN-2).
        let ln32 = LayerNorm { dim: 5, eps: 1e-5f32, bias: true };
        let (y32, dx32, g32) = ln_run(&ln32, &to_f32(&p), &to_f32(&X), &to_f32(&DY));
        assert_f32_close("y f32", &y32, &LN_Y);
        assert_f32_close("dx f32", &dx32, &LN_DX);
        assert_f32_close("dweight f32", &g32[..5], &LN_DW);

        // Without bias: the same output less the bias, the same input gradient.
        let nb = LayerNorm { bias: false, ..ln };
        let (y, dx, grads) = ln_run(&nb, &W, &X, &DY);
        let unbiased: Vec<f64> = LN_Y.iter().enumerate().map(|(i, v)| v - B[i % 5]).collect();
        assert_close("y without bias", &y, &unbiased, TORCH_TOL);
        assert_close("dx without bias", &dx, &LN_DX, TORCH_TOL);
        assert_close("dweight without bias", &grads, &LN_DW, TORCH_TOL);
    }

    /// NORM-2: forward and gradients equal torch's; the default eps is torch's.
    #[test]
    fn rms_norm_matches_torch() {
        let rms = RmsNorm { dim: 5, eps: 1e-6 };
        let (y, dx, grads) = rms_run(&rms, &W, &X, &DY);
        assert_close("y", &y, &RMS_Y, TORCH_TOL);
        assert_close("dx", &dx, &RMS_DX, TORCH_TOL);
        assert_close("dweight", &grads, &RMS_DW, TORCH_TOL);
        let rms32 = RmsNorm { dim: 5, eps: 1e-6f32 };
        let (y32, dx32, g32) = rms_run(&rms32, &to_f32(&W), &to_f32(&X), &to_f32(&DY));
        assert_f32_close("y f32", &y32, &RMS_Y);
        assert_f32_close("dx f32", &dx32, &RMS_DX);
        assert_f32_close("dweight f32", &g32, &RMS_DW);
        // torch's eps=None is finfo(dtype).eps.
        assert_eq!(RmsNorm::<f32>::new(4).eps, f32::EPSILON);
        assert_eq!(RmsNorm::<f64>::new(4).eps, f64::EPSILON);
        assert_eq!(LayerNorm::<f32>::new(4).eps, 1e-5);
    }

    #[test]
    fn layer_norm_gradients_match_finite_differences_nn_1() {
        // Past `LANES` too (full lanes and a remainder): the sums' vectorised route.
        for (dim, bias) in [(5, true), (6, false), (7, true), (8, true), (37, true), (32, false)] {
            let ln = LayerNorm { dim, eps: 1e-5, bias };
            let seed = dim as u64;
            let x = randn(3 * dim, seed);
            let p: Vec<f64> =
                randn(ln.num_params(), seed + 100).iter().map(|v| 1.0 + 0.5 * v).collect();
            let r = randn(3 * dim, seed + 200);
            let (_, dx, grads) = ln_run(&ln, &p, &x, &r);
            let f = |a: &[Vec<f64>]| {
                let p: Vec<f64> = a[1..].concat();
                let mut y = vec![0.0; a[0].len()];
                ln.forward(&p, &a[0], &mut y).unwrap();
                y
            };
            let (gain, rest) = p.split_at(dim);
            let (dgain, dbias) = grads.split_at(dim);
            if bias {
                let args = [x, gain.to_vec(), rest.to_vec()];
                assert_grads(
                    &["x", "weight", "bias"],
                    &args,
                    &r,
                    &f,
                    &[dx, dgain.to_vec(), dbias.to_vec()],
                );
            } else {
                assert_grads(&["x", "weight"], &[x, gain.to_vec()], &r, &f, &[dx, dgain.to_vec()]);
            }
        }
    }

    #[test]
    fn rms_norm_gradients_match_finite_differences_nn_1() {
        for dim in 5..=8 {
            let rms = RmsNorm { dim, eps: 1e-6 };
            let seed = 10 + dim as u64;
            let x = randn(3 * dim, seed);
            let p: Vec<f64> = randn(dim, seed + 100).iter().map(|v| 1.0 + 0.5 * v).collect();
            let r = randn(3 * dim, seed + 200);
            let (_, dx, grads) = rms_run(&rms, &p, &x, &r);
            let f = |a: &[Vec<f64>]| {
                let mut y = vec![0.0; a[0].len()];
                rms.forward(&a[1], &a[0], &mut y).unwrap();
                y
            };
            assert_grads(&["x", "weight"], &[x, p], &r, &f, &[dx, grads]);
        }
    }

    #[test]
    fn f32_and_f64_agree_to_f32_rounding_nn_2() {
        for dim in [5, 8, 64] {
            // Rows off centre (mean about 1): the mean matters, not only the spread.
            let x: Vec<f32> = to_f32(&randn(3 * dim, dim as u64)).iter().map(|v| v + 1.0).collect();
            let p = to_f32(&randn(2 * dim, 7));
            let dy = to_f32(&randn(3 * dim, 8));
            let ln32 = LayerNorm { dim, eps: 1e-5f32, bias: true };
            let ln64 = LayerNorm { dim, eps: 1e-5f32 as f64, bias: true };
            let (y32, dx32, g32) = ln_run(&ln32, &p, &x, &dy);
            let (y64, dx64, g64) = ln_run(&ln64, &to_f64(&p), &to_f64(&x), &to_f64(&dy));
            assert_f32_close("layer_norm y", &y32, &y64);
            assert_f32_close("layer_norm dx", &dx32, &dx64);
            assert_f32_close("layer_norm grads", &g32, &g64);

            let rms32 = RmsNorm { dim, eps: 1e-6f32 };
            let rms64 = RmsNorm { dim, eps: 1e-6f32 as f64 };
            let x = to_f32(&randn(3 * dim, 9));
            let (y32, dx32, g32) = rms_run(&rms32, &p[..dim], &x, &dy);
            let (y64, dx64, g64) = rms_run(&rms64, &to_f64(&p[..dim]), &to_f64(&x), &to_f64(&dy));
            assert_f32_close("rms_norm y", &y32, &y64);
            assert_f32_close("rms_norm dx", &dx32, &dx64);
            assert_f32_close("rms_norm grads", &g32, &g64);
        }
    }

    #[test]
    fn parameter_gradients_add_and_outputs_overwrite_nn_3() {
        let ln = LayerNorm { dim: 5, eps: 1e-5, bias: true };
        let p = ln_params(true);
        let mut y = vec![f64::NAN; 10];
        let saved = ln.forward(&p, &X, &mut y).unwrap();
        let (mut dx, mut grads) = (vec![f64::NAN; 10], vec![1.0; 10]);
        ln.backward(&p, &X, &saved, &DY, &mut dx, &mut grads).unwrap();
        assert_close("y over NaN", &y, &LN_Y, TORCH_TOL);
        assert_close("dx over NaN", &dx, &LN_DX, TORCH_TOL);
        let want: Vec<f64> = LN_DW.iter().chain(&LN_DB).map(|g| 1.0 + g).collect();
        assert_close("grads added to 1", &grads, &want, TORCH_TOL);

        let rms = RmsNorm { dim: 5, eps: 1e-6 };
        let saved = rms.forward(&W, &X, &mut y).unwrap();
        let mut grads = vec![1.0; 5];
        rms.backward(&W, &X, &saved, &DY, &mut dx, &mut grads).unwrap();
        rms.backward(&W, &X, &saved, &DY, &mut dx, &mut grads).unwrap();
        let want: Vec<f64> = RMS_DW.iter().map(|g| 1.0 + 2.0 * g).collect();
        assert_close("grads added twice", &grads, &want, TORCH_TOL);
        assert_close("dx written, not added", &dx, &RMS_DX, TORCH_TOL);
    }

    /// NN-3: `forward_new` and `backward_in_place` give the slice forms' values (bit for
    /// bit), the parameter gradients added the same way.
    #[test]
    fn new_buffer_and_in_place_forms_match_the_slice_forms_nn_3() {
        for (dim, bias) in [(5, true), (37, false), (256, true)] {
            let ln = LayerNorm { dim, eps: 1e-5f32, bias };
            let x = to_f32(&randn(4 * dim, 80 + dim as u64));
            let dy = to_f32(&randn(4 * dim, 90 + dim as u64));
            let p = to_f32(&randn(ln.num_params(), 7));
            let (y, dx, grads) = ln_run(&ln, &p, &x, &dy);
            let (y_new, saved) = ln.forward_new(&p, &x).unwrap();
            let (mut dx_in_place, mut grads_in_place) = (dy.clone(), vec![0.0f32; p.len()]);
            ln.backward_in_place(&p, &x, &saved, &mut dx_in_place, &mut grads_in_place).unwrap();
            assert_eq!((y_new, dx_in_place, grads_in_place), (y, dx, grads), "dim {dim}");
        }
    }

    #[test]
    fn a_constant_row_stays_finite_norm_4() {
        let ln = LayerNorm { dim: 5, eps: 1e-5f32, bias: true };
        let p = to_f32(&ln_params(true));
        let x = [3.25f32; 10];
        let dy = to_f32(&DY);
        let (y, dx, grads) = ln_run(&ln, &p, &x, &dy);
        assert_eq!(&y[..5], &to_f32(&B)[..], "a constant row normalises to the bias");
        assert!(dx.iter().chain(&grads).all(|v| v.is_finite()), "{dx:?} {grads:?}");

        let rms = RmsNorm::<f32>::new(5);
        let (y, dx, grads) = rms_run(&rms, &p[..5], &[0.0; 10], &dy);
        assert!(y.iter().all(|&v| v == 0.0));
        assert!(dx.iter().chain(&grads).all(|v| v.is_finite()), "{dx:?} {grads:?}");
    }

    #[test]
    fn wrong_lengths_are_shape_errors_before_any_write_nn_4() {
        let ln = LayerNorm::<f64>::new(5);
        let p = ln_params(true);
        let mut y = vec![7.0; 10];
        let bad_input = ln.forward(&p, &X[..9], &mut y[..9]);
        let bad_params = ln.forward(&p[..9], &X, &mut y);
        let bad_output = ln.forward(&p, &X, &mut y[..5]);
        let zero_dim = LayerNorm::<f64> { dim: 0, ..ln }.forward(&[], &[], &mut []);
        for r in [
            bad_input.map(|_| ()),
            bad_params.map(|_| ()),
            bad_output.map(|_| ()),
            zero_dim.map(|_| ()),
        ] {
            assert!(matches!(r, Err(ModelError::Shape { .. })), "{r:?}");
        }
        assert!(y.iter().all(|&v| v == 7.0), "nothing written");

        let saved = ln.forward(&p, &X, &mut y).unwrap();
        let (mut dx, mut grads) = (vec![7.0; 10], vec![7.0; 10]);
        let short = LayerNormSaved { mean: saved.mean[..1].to_vec(), rstd: saved.rstd.clone() };
        let r1 = ln.backward(&p, &X, &short, &DY, &mut dx, &mut grads);
        let r2 = ln.backward(&p, &X, &saved, &DY[..5], &mut dx, &mut grads);
        let r3 = ln.backward(&p, &X, &saved, &DY, &mut dx, &mut grads[..5]);
        let rms = RmsNorm::<f64>::new(5);
        let rsaved = RmsNormSaved { rstd: vec![1.0] };
        let r4 = rms.backward(&W, &X, &rsaved, &DY, &mut dx, &mut grads[..5]);
        for r in [r1, r2, r3, r4] {
            assert!(matches!(r, Err(ModelError::Shape { .. })), "{r:?}");
        }
        assert!(dx.iter().chain(&grads).all(|&v| v == 7.0), "nothing written");
    }
}
