//! Layers as pure functions.
//!
//! A layer owns no parameter memory: `forward(params, input) -> (output, saved)` and
//! `backward(params, saved, grad_output, grads_out) -> grad_input`, where `params` is a view
//! into a flat buffer owned by the caller, laid out as the layer's [`ParamSpec`]s in order.
//!
//! Invariants:
//! - `LAYER-1`: `backward` ADDS its parameter gradients into `grads_out` (same layout as
//!   `params`); callers zero the buffer once per step. This is what lets a unit hand one flat
//!   gradient buffer to all its layers. A model run with `Ctx::overwrite_grads` writes
//!   instead (the linear layer through [`Linear::backward_into`], the others into a region
//!   zeroed first), for a buffer that is fresh every step.
//! - `LAYER-2`: every layer's `backward` is the exact derivative of its `forward` (checked by
//!   a finite-difference test per layer).
//! - `LAYER-3`: inputs are consumed by value: a layer that needs its input in backward keeps
//!   it in `saved` without copying.

use crate::backend::{Backend, GemmShape};
use crate::error::ModelError;
use crate::spec::ParamSpec;
use crate::tensor::Tensor;

pub(crate) fn check_len(what: &str, got: usize, want: usize) -> Result<(), ModelError> {
    if got != want {
        return Err(ModelError::shape(what, want, got));
    }
    Ok(())
}

/// Fully connected layer: `y = x W^T + b`, `W` of shape `[out, in]` (PyTorch layout).
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
}

/// What [`Linear::backward`] needs: the input.
#[derive(Clone, Debug)]
pub struct LinearSaved {
    input: Tensor,
}

impl Linear {
    /// A linear layer with bias.
    pub fn new(in_features: usize, out_features: usize) -> Self {
        Linear { in_features, out_features, bias: true }
    }

    /// `weight [out, in]`, then `bias [out]`.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let mut v = vec![ParamSpec {
            name: "weight".into(),
            shape: vec![self.out_features, self.in_features],
        }];
        if self.bias {
            v.push(ParamSpec { name: "bias".into(), shape: vec![self.out_features] });
        }
        v
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.out_features * self.in_features + if self.bias { self.out_features } else { 0 }
    }

    /// `input [N, in]` -> `[N, out]`.
    pub fn forward(
        &self,
        be: &dyn Backend,
        params: &[f32],
        input: Tensor,
    ) -> Result<(Tensor, LinearSaved), ModelError> {
        check_len("linear params", params.len(), self.num_params())?;
        if input.shape().len() != 2 || input.shape()[1] != self.in_features {
            return Err(ModelError::shape(
                "linear input",
                format!("[N, {}]", self.in_features),
                format!("{:?}", input.shape()),
            ));
        }
        let n = input.shape()[0];
        let (o, i) = (self.out_features, self.in_features);
        let w = &params[..o * i];
        // With a bias the output starts as its rows, appended: no zero fill first.
        let mut out = if self.bias {
            let b = &params[o * i..];
            let mut out = Vec::with_capacity(n * o);
            for _ in 0..n {
                out.extend_from_slice(b);
            }
            out
        } else {
            vec![0.0f32; n * o]
        };
        be.gemm(
            GemmShape { m: n, n: o, k: i, trans_a: false, trans_b: true },
            input.as_f32()?,
            w,
            &mut out,
            self.bias,
        )?;
        Ok((Tensor::new(vec![n, o], out)?, LinearSaved { input }))
    }

    /// Gradient of the input; adds `dW = dY^T X` and `db = sum dY` into `grads_out` (LAYER-1).
    pub fn backward(
        &self,
        be: &dyn Backend,
        params: &[f32],
        saved: &LinearSaved,
        grad_output: &Tensor,
        grads_out: &mut [f32],
    ) -> Result<Tensor, ModelError> {
        self.backward_into(be, params, saved, grad_output, grads_out, true)
    }

    /// [`Linear::backward`], adding the parameter gradients into `grads_out` when
    /// `accumulate`, else writing them (whatever `grads_out` held before).
    pub fn backward_into(
        &self,
        be: &dyn Backend,
        params: &[f32],
        saved: &LinearSaved,
        grad_output: &Tensor,
        grads_out: &mut [f32],
        accumulate: bool,
    ) -> Result<Tensor, ModelError> {
        self.backward_params(be, saved, grad_output, grads_out, accumulate)?;
        self.input_grad(be, params, grad_output)
    }

    /// The parameter half of [`Linear::backward_into`]: `dW = dY^T X` and `db = sum dY`,
    /// added into `grads_out` when `accumulate`, else written.
    pub fn backward_params(
        &self,
        be: &dyn Backend,
        saved: &LinearSaved,
        grad_output: &Tensor,
        grads_out: &mut [f32],
        accumulate: bool,
    ) -> Result<(), ModelError> {
        check_len("linear grads", grads_out.len(), self.num_params())?;
        let n = saved.input.shape()[0];
        let (o, i) = (self.out_features, self.in_features);
        check_len("linear grad_output", grad_output.numel(), n * o)?;
        let (gw, gb) = grads_out.split_at_mut(o * i);
        be.gemm(
            GemmShape { m: o, n: i, k: n, trans_a: true, trans_b: false },
            grad_output.as_f32()?,
            saved.input.as_f32()?,
            gw,
            accumulate,
        )?;
        if !accumulate {
            gb.fill(0.0);
        }
        if self.bias {
            for row in grad_output.as_f32()?.chunks_exact(o) {
                for (g, d) in gb.iter_mut().zip(row) {
                    *g += d;
                }
            }
        }
        Ok(())
    }

    /// The input half of [`Linear::backward_into`]: `dX = dY W` (`grad_output [N, out]`).
    pub fn input_grad(
        &self,
        be: &dyn Backend,
        params: &[f32],
        grad_output: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let n = self.check_input_grad(params, grad_output)?;
        let mut gx = vec![0.0f32; n * self.in_features];
        self.input_grad_into(be, params, grad_output, &mut gx)?;
        Tensor::new(vec![n, self.in_features], gx)
    }

    /// [`Linear::backward`] taking what forward saved: the same gradients, with the input
    /// gradient written over the saved input's values (its shape) unless a clone shares
    /// them, so that no buffer is made and zero-filled for it.
    pub fn backward_taking(
        &self,
        be: &dyn Backend,
        params: &[f32],
        saved: LinearSaved,
        grad_output: &Tensor,
        grads_out: &mut [f32],
    ) -> Result<Tensor, ModelError> {
        let n = self.check_input_grad(params, grad_output)?;
        self.backward_params(be, &saved, grad_output, grads_out, true)?;
        let mut x = saved.input;
        if x.is_shared() || x.numel() != n * self.in_features {
            return self.input_grad(be, params, grad_output);
        }
        self.input_grad_into(be, params, grad_output, x.as_f32_mut()?)?;
        x.reshape(vec![n, self.in_features])
    }

    /// Rows of `grad_output`, once it and `params` fit the layer.
    fn check_input_grad(&self, params: &[f32], grad_output: &Tensor) -> Result<usize, ModelError> {
        check_len("linear params", params.len(), self.num_params())?;
        let o = self.out_features;
        if grad_output.shape().len() != 2 || grad_output.shape()[1] != o {
            return Err(ModelError::shape(
                "linear grad_output",
                format!("[N, {o}]"),
                format!("{:?}", grad_output.shape()),
            ));
        }
        Ok(grad_output.shape()[0])
    }

    /// `dX = dY W` written over `gx` (`[N, in]`, checked by the caller).
    fn input_grad_into(
        &self,
        be: &dyn Backend,
        params: &[f32],
        grad_output: &Tensor,
        gx: &mut [f32],
    ) -> Result<(), ModelError> {
        let (o, i) = (self.out_features, self.in_features);
        be.gemm(
            GemmShape { m: grad_output.shape()[0], n: i, k: o, trans_a: false, trans_b: false },
            grad_output.as_f32()?,
            &params[..o * i],
            gx,
            false,
        )
    }
}

/// ReLU; what backward needs is the output.
#[derive(Clone, Debug)]
pub struct ReluSaved {
    output: Tensor,
}

/// `max(x, 0)`, in place on the consumed input.
pub fn relu_forward(
    be: &dyn Backend,
    mut input: Tensor,
) -> Result<(Tensor, ReluSaved), ModelError> {
    be.relu(input.as_f32_mut()?)?;
    let saved = ReluSaved { output: input.clone() };
    Ok((input, saved))
}

/// Gradient of ReLU (0 where the output was 0; PyTorch's convention at 0).
pub fn relu_backward(
    be: &dyn Backend,
    saved: &ReluSaved,
    mut grad_output: Tensor,
) -> Result<Tensor, ModelError> {
    check_len("relu grad_output", grad_output.numel(), saved.output.numel())?;
    be.relu_backward(saved.output.as_f32()?, grad_output.as_f32_mut()?)?;
    Ok(grad_output)
}

/// 2-D max pooling over NCHW input (no padding; windows that would run past the edge are
/// dropped, as PyTorch's default `ceil_mode=False`).
#[derive(Clone, Debug, PartialEq)]
pub struct MaxPool2d {
    /// Window size (square).
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
}

/// What [`MaxPool2d::backward`] needs: input shape and the flat index of each maximum.
#[derive(Clone, Debug)]
pub struct MaxPoolSaved {
    input_shape: Vec<usize>,
    argmax: Vec<u32>,
}

impl MaxPoolSaved {
    /// The saved state from its parts: the input's shape and each output's argmax (an
    /// index into the whole input).
    pub(crate) fn of(input_shape: Vec<usize>, argmax: Vec<u32>) -> Self {
        MaxPoolSaved { input_shape, argmax }
    }

    /// Each output's argmax.
    pub(crate) fn argmax(&self) -> &[u32] {
        &self.argmax
    }
}

impl ShapeSaved {
    /// The saved state of an input of `input_shape`.
    pub(crate) fn of(input_shape: Vec<usize>) -> Self {
        ShapeSaved { input_shape }
    }
}

fn nchw(what: &str, t: &Tensor) -> Result<(usize, usize, usize, usize), ModelError> {
    if t.shape().len() != 4 {
        return Err(ModelError::shape(what, "[N, C, H, W]", format!("{:?}", t.shape())));
    }
    Ok((t.shape()[0], t.shape()[1], t.shape()[2], t.shape()[3]))
}

impl MaxPool2d {
    /// Output spatial size for an input size.
    pub fn out_size(&self, h: usize) -> usize {
        if h < self.kernel {
            0
        } else {
            (h - self.kernel) / self.stride + 1
        }
    }

    /// `[N, C, H, W]` -> `[N, C, Ho, Wo]`.
    pub fn forward(&self, input: Tensor) -> Result<(Tensor, MaxPoolSaved), ModelError> {
        let (n, c, h, w) = nchw("maxpool input", &input)?;
        if self.kernel == 0 || self.stride == 0 {
            return Err(ModelError::Config("maxpool kernel and stride must be positive".into()));
        }
        let (ho, wo) = (self.out_size(h), self.out_size(w));
        let mut out = vec![0.0f32; n * c * ho * wo];
        let mut argmax = vec![0u32; out.len()];
        for plane in 0..n * c {
            let src = &input.as_f32()?[plane * h * w..(plane + 1) * h * w];
            for oy in 0..ho {
                for ox in 0..wo {
                    let mut best = f32::NEG_INFINITY;
                    let mut at = 0usize;
                    for ky in 0..self.kernel {
                        for kx in 0..self.kernel {
                            let idx = (oy * self.stride + ky) * w + ox * self.stride + kx;
                            if src[idx] > best || (ky == 0 && kx == 0) {
                                best = src[idx];
                                at = idx;
                            }
                        }
                    }
                    let o = plane * ho * wo + oy * wo + ox;
                    out[o] = best;
                    argmax[o] = (plane * h * w + at) as u32;
                }
            }
        }
        Ok((
            Tensor::new(vec![n, c, ho, wo], out)?,
            MaxPoolSaved { input_shape: input.shape().to_vec(), argmax },
        ))
    }

    /// Routes each output gradient to the input position that held the maximum.
    pub fn backward(
        &self,
        saved: &MaxPoolSaved,
        grad_output: &Tensor,
    ) -> Result<Tensor, ModelError> {
        check_len("maxpool grad_output", grad_output.numel(), saved.argmax.len())?;
        let mut gx = Tensor::zeros(&saved.input_shape);
        for (g, &a) in grad_output.as_f32()?.iter().zip(&saved.argmax) {
            gx.as_f32_mut()?[a as usize] += g;
        }
        Ok(gx)
    }
}

/// Shape of the input, kept by shape-only layers for their backward.
#[derive(Clone, Debug)]
pub struct ShapeSaved {
    input_shape: Vec<usize>,
}

/// Global average pooling: `[N, C, H, W]` -> `[N, C]`.
pub fn global_avg_pool_forward(input: Tensor) -> Result<(Tensor, ShapeSaved), ModelError> {
    let (n, c, h, w) = nchw("global avg pool input", &input)?;
    let hw = h * w;
    let inv = if hw == 0 { 0.0 } else { 1.0 / hw as f64 };
    let data = input
        .as_f32()?
        .chunks_exact(hw.max(1))
        .take(n * c)
        .map(|p| (p.iter().map(|&v| v as f64).sum::<f64>() * inv) as f32)
        .collect();
    Ok((Tensor::new(vec![n, c], data)?, ShapeSaved { input_shape: input.shape().to_vec() }))
}

/// Gradient of global average pooling: each position gets `g / (H W)`.
pub fn global_avg_pool_backward(
    saved: &ShapeSaved,
    grad_output: &Tensor,
) -> Result<Tensor, ModelError> {
    let s = &saved.input_shape;
    check_len("global avg pool grad_output", grad_output.numel(), s[0] * s[1])?;
    let hw = s[2] * s[3];
    let mut gx = Tensor::zeros(s);
    if hw > 0 {
        let inv = 1.0 / hw as f32;
        for (plane, g) in gx.as_f32_mut()?.chunks_exact_mut(hw).zip(grad_output.as_f32()?) {
            plane.fill(g * inv);
        }
    }
    Ok(gx)
}

/// Flatten: `[N, ...]` -> `[N, prod(...)]` (no copy).
pub fn flatten_forward(input: Tensor) -> Result<(Tensor, ShapeSaved), ModelError> {
    let n = input.batch();
    let rest: usize = input.shape().iter().skip(1).product();
    let input_shape = input.shape().to_vec();
    Ok((input.reshape(vec![n, rest])?, ShapeSaved { input_shape }))
}

/// Gradient of flatten: the same values in the input's shape.
pub fn flatten_backward(saved: &ShapeSaved, grad_output: Tensor) -> Result<Tensor, ModelError> {
    grad_output.reshape(saved.input_shape.clone())
}

/// Residual add: `a + b` (same shapes), consuming `a`.
pub fn add_forward(be: &dyn Backend, mut a: Tensor, b: &Tensor) -> Result<Tensor, ModelError> {
    if a.shape() != b.shape() {
        return Err(ModelError::shape(
            "add",
            format!("{:?}", a.shape()),
            format!("{:?}", b.shape()),
        ));
    }
    be.axpy(1.0, b.as_f32()?, a.as_f32_mut()?)?;
    Ok(a)
}

/// Gradient of the residual add: the same gradient flows to both inputs.
pub fn add_backward(grad_output: &Tensor) -> (Tensor, Tensor) {
    (grad_output.clone(), grad_output.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_tensor};
    use crate::Cpu;

    /// LAYER-3: the linear layer keeps the very input buffer it was given, not a copy.
    #[test]
    fn linear_keeps_its_input_without_copying() {
        let be = Cpu::new();
        let l = Linear::new(5, 3);
        let params = vec![0.5f32; l.num_params()];
        let x = Tensor::new(vec![4, 5], (0..20).map(|i| i as f32).collect()).unwrap();
        let ptr = x.as_f32().unwrap().as_ptr();
        let (_, saved) = l.forward(&be, &params, x).expect("forward");
        assert_eq!(
            saved.input.as_f32().unwrap().as_ptr(),
            ptr,
            "the saved input is the caller's buffer"
        );
    }

    /// LAYER-3: `backward_taking` gives `backward`'s gradients, the input gradient over the
    /// saved input's buffer when nothing else holds it, in a new buffer when a clone does.
    #[test]
    fn linear_backward_taking_matches_backward_and_reuses_the_input_layer_3() {
        let be = Cpu::new();
        let l = Linear::new(5, 3);
        let params: Vec<f32> = (0..l.num_params()).map(|i| 0.1 * i as f32 - 0.7).collect();
        let x = Tensor::new(vec![4, 5], (0..20).map(|i| 0.3 * i as f32 - 2.0).collect()).unwrap();
        let dy = Tensor::new(vec![4, 3], (0..12).map(|i| 0.2 * i as f32 - 1.0).collect()).unwrap();
        for shared in [false, true] {
            let (_, saved) = l.forward(&be, &params, x.clone()).unwrap();
            let mut want_grads = vec![0.5f32; l.num_params()];
            let want = l.backward(&be, &params, &saved, &dy, &mut want_grads).unwrap();
            let (_, saved) = l
                .forward(
                    &be,
                    &params,
                    Tensor::new(vec![4, 5], x.as_f32().unwrap().to_vec()).unwrap(),
                )
                .unwrap();
            let held = shared.then(|| saved.input.clone());
            let ptr = saved.input.as_f32().unwrap().as_ptr();
            let mut grads = vec![0.5f32; l.num_params()];
            let got = l.backward_taking(&be, &params, saved, &dy, &mut grads).unwrap();
            assert_eq!(
                (got.shape(), got.as_f32().unwrap()),
                (want.shape(), want.as_f32().unwrap())
            );
            assert_eq!(grads, want_grads, "parameter gradients added");
            assert_eq!(got.as_f32().unwrap().as_ptr() == ptr, !shared, "shared {shared}");
            if let Some(h) = held {
                assert_eq!(h.as_f32().unwrap(), x.as_f32().unwrap(), "the clone is unchanged");
            }
        }
    }

    #[test]
    fn linear_gradients_match_finite_differences() {
        // LAYER-1, LAYER-2
        let be = Cpu::new();
        let l = Linear::new(5, 3);
        check_grads(l.num_params(), &[4, 5], 11, &|p, x, gy, gp| {
            let (y, s) = l.forward(&be, p, x)?;
            Ok((
                y,
                match gy {
                    Some(gy) => Some(l.backward(&be, p, &s, gy, gp)?),
                    None => None,
                },
            ))
        });
        let nb = Linear { bias: false, ..Linear::new(3, 2) };
        check_grads(nb.num_params(), &[2, 3], 12, &|p, x, gy, gp| {
            let (y, s) = nb.forward(&be, p, x)?;
            Ok((
                y,
                match gy {
                    Some(gy) => Some(nb.backward(&be, p, &s, gy, gp)?),
                    None => None,
                },
            ))
        });
    }

    #[test]
    fn linear_matches_naive_formula() {
        let be = Cpu::new();
        let l = Linear::new(3, 2);
        let p: Vec<f32> = (0..l.num_params()).map(|i| i as f32 * 0.1 - 0.3).collect();
        let x = rand_tensor(&[2, 3], 3);
        let (y, _) = l.forward(&be, &p, x.clone()).unwrap();
        for n in 0..2 {
            for o in 0..2 {
                let want: f32 =
                    (0..3).map(|i| x.as_f32().unwrap()[n * 3 + i] * p[o * 3 + i]).sum::<f32>()
                        + p[6 + o];
                assert!((y.as_f32().unwrap()[n * 2 + o] - want).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn relu_maxpool_pool_flatten_add_gradients() {
        let be = Cpu::new();
        check_grads(0, &[3, 7], 1, &|_p, x, gy, _gp| {
            let (y, s) = relu_forward(&be, x).unwrap();
            Ok((
                y,
                match gy {
                    Some(gy) => Some(relu_backward(&be, &s, gy.clone())?),
                    None => None,
                },
            ))
        });
        let mp = MaxPool2d { kernel: 2, stride: 2 };
        check_grads(0, &[2, 3, 5, 4], 2, &|_p, x, gy, _gp| {
            let (y, s) = mp.forward(x)?;
            Ok((
                y,
                match gy {
                    Some(gy) => Some(mp.backward(&s, gy)?),
                    None => None,
                },
            ))
        });
        let mp3 = MaxPool2d { kernel: 3, stride: 1 };
        check_grads(0, &[1, 2, 4, 5], 3, &|_p, x, gy, _gp| {
            let (y, s) = mp3.forward(x)?;
            Ok((
                y,
                match gy {
                    Some(gy) => Some(mp3.backward(&s, gy)?),
                    None => None,
                },
            ))
        });
        check_grads(0, &[2, 3, 2, 3], 4, &|_p, x, gy, _gp| {
            let (y, s) = global_avg_pool_forward(x)?;
            Ok((
                y,
                match gy {
                    Some(gy) => Some(global_avg_pool_backward(&s, gy)?),
                    None => None,
                },
            ))
        });
        check_grads(0, &[2, 3, 2, 2], 5, &|_p, x, gy, _gp| {
            let (y, s) = flatten_forward(x)?;
            assert_eq!(y.shape(), vec![2, 12]);
            Ok((
                y,
                match gy {
                    Some(gy) => Some(flatten_backward(&s, gy.clone())?),
                    None => None,
                },
            ))
        });
        // add: y = x + 2x (as a residual of the input with itself scaled), d/dx = 3
        check_grads(0, &[2, 4], 6, &|_p, x, gy, _gp| {
            let twice = Tensor::new(
                x.shape().to_vec(),
                x.as_f32().unwrap().iter().map(|v| 2.0 * v).collect(),
            )?;
            let y = add_forward(&be, x, &twice)?;
            let gx = gy.map(|gy| {
                let (a, b) = add_backward(gy);
                Tensor::new(
                    a.shape().to_vec(),
                    a.as_f32()
                        .unwrap()
                        .iter()
                        .zip(b.as_f32().unwrap())
                        .map(|(p, q)| p + 2.0 * q)
                        .collect(),
                )
                .unwrap()
            });
            Ok((y, gx))
        });
    }

    #[test]
    fn maxpool_picks_window_maxima() {
        let x = Tensor::new(vec![1, 1, 2, 4], vec![1., 5., 2., 0., 3., 4., 8., -1.]).unwrap();
        let (y, _) = MaxPool2d { kernel: 2, stride: 2 }.forward(x).unwrap();
        assert_eq!(y.as_f32().unwrap(), &[5., 8.]);
    }
}
