//! 2-D convolution over NCHW tensors, as im2col + one matrix multiply per sample.

use crate::backend::{Backend, GemmShape};
use crate::error::ModelError;
use crate::layers::check_len;
use crate::meter::{self, Use};
use crate::spec::ParamSpec;
use crate::tensor::Tensor;

/// `Conv2d` with square kernels, stride and zero padding; weight `[out, in, k, k]`
/// (PyTorch layout), optional bias `[out]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Conv2d {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
    /// Whether the layer has a bias (convolutions followed by BatchNorm usually do not).
    pub bias: bool,
}

/// What [`Conv2d::backward`] needs: the input (the columns are recomputed, which costs less
/// memory than keeping them).
#[derive(Clone, Debug)]
pub struct ConvSaved {
    input: Tensor,
}

impl ConvSaved {
    /// What the forward of `input` saves (the convolution ops' backward builds it).
    pub(crate) fn of(input: Tensor) -> Self {
        ConvSaved { input }
    }
}

struct Geom {
    n: usize,
    h: usize,
    w: usize,
    ho: usize,
    wo: usize,
}

impl Conv2d {
    /// Output spatial size for an input size.
    pub fn out_size(&self, h: usize) -> usize {
        let span = h + 2 * self.padding;
        if span < self.kernel {
            0
        } else {
            (span - self.kernel) / self.stride + 1
        }
    }

    /// `weight [out, in, k, k]`, then `bias [out]` when present.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let mut v = vec![ParamSpec {
            name: "weight".into(),
            shape: vec![self.out_channels, self.in_channels, self.kernel, self.kernel],
        }];
        if self.bias {
            v.push(ParamSpec { name: "bias".into(), shape: vec![self.out_channels] });
        }
        v
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.weight_len() + if self.bias { self.out_channels } else { 0 }
    }

    fn weight_len(&self) -> usize {
        self.out_channels * self.in_channels * self.kernel * self.kernel
    }

    fn geom(&self, input: &Tensor) -> Result<Geom, ModelError> {
        if input.shape().len() != 4 || input.shape()[1] != self.in_channels {
            return Err(ModelError::shape(
                "conv2d input",
                format!("[N, {}, H, W]", self.in_channels),
                format!("{:?}", input.shape()),
            ));
        }
        if self.stride == 0 || self.kernel == 0 {
            return Err(ModelError::Config("conv2d kernel and stride must be positive".into()));
        }
        let (h, w) = (input.shape()[2], input.shape()[3]);
        Ok(Geom { n: input.shape()[0], h, w, ho: self.out_size(h), wo: self.out_size(w) })
    }

    /// Fills `col [in*k*k, ho*wo]` from one sample `x [in, h, w]`.
    fn im2col(&self, g: &Geom, x: &[f32], col: &mut [f32]) {
        let k = self.kernel;
        let p = g.ho * g.wo;
        for c in 0..self.in_channels {
            for ky in 0..k {
                for kx in 0..k {
                    let row = &mut col[((c * k + ky) * k + kx) * p..][..p];
                    for oy in 0..g.ho {
                        let iy = (oy * self.stride + ky) as isize - self.padding as isize;
                        let dst = &mut row[oy * g.wo..(oy + 1) * g.wo];
                        if iy < 0 || iy as usize >= g.h {
                            dst.fill(0.0);
                            continue;
                        }
                        let src = &x[(c * g.h + iy as usize) * g.w..][..g.w];
                        for (ox, d) in dst.iter_mut().enumerate() {
                            let ix = (ox * self.stride + kx) as isize - self.padding as isize;
                            *d = if ix < 0 || ix as usize >= g.w { 0.0 } else { src[ix as usize] };
                        }
                    }
                }
            }
        }
    }

    /// Adds columns back onto one sample's input gradient.
    fn col2im(&self, g: &Geom, col: &[f32], gx: &mut [f32]) {
        let k = self.kernel;
        let p = g.ho * g.wo;
        for c in 0..self.in_channels {
            for ky in 0..k {
                for kx in 0..k {
                    let row = &col[((c * k + ky) * k + kx) * p..][..p];
                    for oy in 0..g.ho {
                        let iy = (oy * self.stride + ky) as isize - self.padding as isize;
                        if iy < 0 || iy as usize >= g.h {
                            continue;
                        }
                        let dst = &mut gx[(c * g.h + iy as usize) * g.w..][..g.w];
                        for ox in 0..g.wo {
                            let ix = (ox * self.stride + kx) as isize - self.padding as isize;
                            if ix >= 0 && (ix as usize) < g.w {
                                dst[ix as usize] += row[oy * g.wo + ox];
                            }
                        }
                    }
                }
            }
        }
    }

    /// `[N, in, H, W]` -> `[N, out, Ho, Wo]`.
    pub fn forward(
        &self,
        be: &dyn Backend,
        params: &[f32],
        input: Tensor,
    ) -> Result<(Tensor, ConvSaved), ModelError> {
        check_len("conv2d params", params.len(), self.num_params())?;
        let g = self.geom(&input)?;
        let kk = self.in_channels * self.kernel * self.kernel;
        let p = g.ho * g.wo;
        let (w, b) = params.split_at(self.weight_len());
        let mut out = vec![0.0f32; g.n * self.out_channels * p];
        let mut col = vec![0.0f32; kk * p];
        let _col_charge = meter::charge(col.len() * 4, Use::Scratch);
        let in_len = self.in_channels * g.h * g.w;
        for (s, o) in out.chunks_exact_mut((self.out_channels * p).max(1)).take(g.n).enumerate() {
            self.im2col(&g, &input.as_f32()?[s * in_len..(s + 1) * in_len], &mut col);
            if self.bias {
                for (plane, bv) in o.chunks_exact_mut(p.max(1)).zip(b) {
                    plane.fill(*bv);
                }
            }
            be.gemm(
                GemmShape { m: self.out_channels, n: p, k: kk, trans_a: false, trans_b: false },
                w,
                &col,
                o,
                self.bias,
            )?;
        }
        Ok((Tensor::new(vec![g.n, self.out_channels, g.ho, g.wo], out)?, ConvSaved { input }))
    }

    /// Gradient of the input; adds weight and bias gradients into `grads_out`.
    pub fn backward(
        &self,
        be: &dyn Backend,
        params: &[f32],
        saved: &ConvSaved,
        grad_output: &Tensor,
        grads_out: &mut [f32],
    ) -> Result<Tensor, ModelError> {
        check_len("conv2d grads", grads_out.len(), self.num_params())?;
        let g = self.geom(&saved.input)?;
        let kk = self.in_channels * self.kernel * self.kernel;
        let p = g.ho * g.wo;
        let out_len = self.out_channels * p;
        check_len("conv2d grad_output", grad_output.numel(), g.n * out_len)?;
        let w = &params[..self.weight_len()];
        let (gw, gb) = grads_out.split_at_mut(self.weight_len());
        let in_len = self.in_channels * g.h * g.w;
        let mut gx = Tensor::zeros(saved.input.shape());
        let mut col = vec![0.0f32; kk * p];
        let mut dcol = vec![0.0f32; kk * p];
        let _cols_charge = meter::charge(2 * col.len() * 4, Use::Scratch);
        for s in 0..g.n {
            let dy = &grad_output.as_f32()?[s * out_len..(s + 1) * out_len];
            self.im2col(&g, &saved.input.as_f32()?[s * in_len..(s + 1) * in_len], &mut col);
            // dW += dY_s [out, p] * col^T [p, kk]
            be.gemm(
                GemmShape { m: self.out_channels, n: kk, k: p, trans_a: false, trans_b: true },
                dy,
                &col,
                gw,
                true,
            )?;
            if self.bias {
                for (gbv, plane) in gb.iter_mut().zip(dy.chunks_exact(p.max(1))) {
                    *gbv += plane.iter().sum::<f32>();
                }
            }
            // dcol = W^T [kk, out] * dY_s [out, p]
            be.gemm(
                GemmShape { m: kk, n: p, k: self.out_channels, trans_a: true, trans_b: false },
                w,
                dy,
                &mut dcol,
                false,
            )?;
            self.col2im(&g, &dcol, &mut gx.as_f32_mut()?[s * in_len..(s + 1) * in_len]);
        }
        Ok(gx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_tensor};
    use crate::Cpu;

    /// Direct 7-loop convolution, the independent reference.
    fn naive_conv(c: &Conv2d, p: &[f32], x: &Tensor) -> Tensor {
        let (n, h, w) = (x.shape()[0], x.shape()[2], x.shape()[3]);
        let (ho, wo, k) = (c.out_size(h), c.out_size(w), c.kernel);
        let mut out = Tensor::zeros(&[n, c.out_channels, ho, wo]);
        for s in 0..n {
            for o in 0..c.out_channels {
                for oy in 0..ho {
                    for ox in 0..wo {
                        let mut acc = if c.bias { p[c.weight_len() + o] as f64 } else { 0.0 };
                        for i in 0..c.in_channels {
                            for ky in 0..k {
                                for kx in 0..k {
                                    let iy = (oy * c.stride + ky) as isize - c.padding as isize;
                                    let ix = (ox * c.stride + kx) as isize - c.padding as isize;
                                    if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w
                                    {
                                        let xv = x.as_f32().unwrap()[((s * c.in_channels + i) * h
                                            + iy as usize)
                                            * w
                                            + ix as usize];
                                        acc += xv as f64
                                            * p[((o * c.in_channels + i) * k + ky) * k + kx] as f64;
                                    }
                                }
                            }
                        }
                        out.as_f32_mut().unwrap()[((s * c.out_channels + o) * ho + oy) * wo + ox] =
                            acc as f32;
                    }
                }
            }
        }
        out
    }

    fn configs() -> Vec<Conv2d> {
        vec![
            Conv2d {
                in_channels: 2,
                out_channels: 3,
                kernel: 3,
                stride: 1,
                padding: 1,
                bias: true,
            },
            Conv2d {
                in_channels: 2,
                out_channels: 2,
                kernel: 3,
                stride: 2,
                padding: 1,
                bias: false,
            },
            Conv2d {
                in_channels: 3,
                out_channels: 2,
                kernel: 1,
                stride: 2,
                padding: 0,
                bias: false,
            },
            Conv2d {
                in_channels: 1,
                out_channels: 2,
                kernel: 2,
                stride: 1,
                padding: 0,
                bias: true,
            },
        ]
    }

    #[test]
    fn conv_matches_direct_convolution() {
        let be = Cpu::new();
        for (i, c) in configs().into_iter().enumerate() {
            let p = rand_tensor(&[c.num_params()], 40 + i as u64).into_f32().unwrap();
            let x = rand_tensor(&[2, c.in_channels, 5, 6], 50 + i as u64);
            let (y, _) = c.forward(&be, &p, x.clone()).unwrap();
            let want = naive_conv(&c, &p, &x);
            assert_eq!(y.shape(), want.shape());
            assert!(y.max_abs_diff(&want) < 1e-5, "config {i}");
        }
    }

    #[test]
    fn conv_gradients_match_finite_differences() {
        // LAYER-1, LAYER-2
        let be = Cpu::new();
        for (i, c) in configs().into_iter().enumerate() {
            check_grads(
                c.num_params(),
                &[2, c.in_channels, 4, 5],
                60 + i as u64,
                &|p, x, gy, gp| {
                    let (y, s) = c.forward(&be, p, x)?;
                    Ok((
                        y,
                        match gy {
                            Some(gy) => Some(c.backward(&be, p, &s, gy, gp)?),
                            None => None,
                        },
                    ))
                },
            );
        }
    }
}
