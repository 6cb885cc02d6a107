//! The `resnet-bn` model as a module tree: torchvision's ResNet-18 laid out for small images
//! (CIFAR-style: the stem is a 3x3 stride-1 convolution and there is no max-pool), with
//! torchvision's parameter and buffer names, so that its weights load into
//! `bench/resnet_bn.py` (and torchvision's `resnet18` so modified) with no renaming.
//!
//! `conv1`-`bn1`-ReLU; `layer1`..`layer4` of two `BasicBlock`s each (`conv1`-`bn1`-ReLU-`conv2`-
//! `bn2`, plus the shortcut, then ReLU; the first block of layers 2-4 halves H and W and
//! doubles the channels, its shortcut a `downsample` of a 1x1 stride-2 convolution
//! (`downsample.0`) and a BatchNorm (`downsample.1`)); global average pool; `fc`. Widths are
//! `width x (1, 2, 4, 8)`, torchvision's at width 64; a narrow width (4, 8, 16) keeps tests
//! and studies small. Every BatchNorm is a SyncBatchNorm when the context asks for one
//! (`Ctx::sync_bn`, the runtime's `--sync-bn`).
//!
//! Units, as FSDP wraps a ResNet per block: `stem` (`conv1`, `bn1`), one per `BasicBlock`
//! (`layer1.0` .. `layer4.1`), and `head` (`fc`); a wrap policy regroups them (NET-2).
//!
//! Invariants:
//! - `MRES-1`: the parameters and buffers are torchvision's `resnet18` state_dict at
//!   `conv1 = Conv2d(C, width, 3, 1, 1, bias=False)`, `maxpool = Identity`, `fc` to the
//!   classes, widths scaled by `width / 64`: the same names, in the same order, of the same
//!   shapes (the export adds only the dtypes, CKPT-7), and initialised as torchvision does
//!   (convolutions Kaiming normal, fan-out; BatchNorm weight 1, bias 0; `fc` torch's Linear
//!   default).
//! - `MRES-2`: a `BasicBlock`'s backward, the `downsample` shortcut included, is the exact
//!   derivative of its forward (MODULE-2): checked element by element against f64 finite
//!   differences of an independent f64 forward.

use super::layers::{Flatten, GlobalAvgPool, Linear, Relu};
use super::{Buffers, Grads, Init, Module, Param, Params, Residual, Saved, Sequential};
use crate::batchnorm::BatchNorm;
use crate::conv::Conv2d;
use crate::error::ModelError;
use crate::lower::{Lowering, Val};
use crate::model::Ctx;
use crate::module::ClassCrossEntropy;
use crate::network::ModuleNet;
use crate::tensor::Tensor;

/// The shape of a `resnet-bn`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResNetConfig {
    /// Input channels (the data set's C of `[C, H, W]`).
    pub in_channels: usize,
    /// Output classes.
    pub classes: usize,
    /// Channels of `conv1` and `layer1`; layers 2-4 have 2, 4 and 8 times as many
    /// (torchvision's: 64).
    pub width: usize,
    /// `BasicBlock`s in each of the four layers (ResNet-18: 2, 2, 2, 2).
    pub blocks: [usize; 4],
}

impl ResNetConfig {
    /// ResNet-18 at `width` over `in_channels` into `classes`.
    pub fn resnet18(in_channels: usize, classes: usize, width: usize) -> Self {
        ResNetConfig { in_channels, classes, width, blocks: [2, 2, 2, 2] }
    }
}

/// A bias-free convolution started as torchvision's ResNet starts one: Kaiming normal,
/// fan-out mode, for ReLU (std `sqrt(2 / (out k k))`).
#[derive(Clone, Debug, PartialEq)]
struct KaimingConv(Conv2d);

fn conv(c_in: usize, c_out: usize, kernel: usize, stride: usize) -> KaimingConv {
    KaimingConv(Conv2d {
        in_channels: c_in,
        out_channels: c_out,
        kernel,
        stride,
        padding: kernel / 2,
        bias: false,
    })
}

impl Module for KaimingConv {
    fn params(&self) -> Vec<Param> {
        let c = &self.0;
        let std = (2.0 / (c.out_channels * c.kernel * c.kernel).max(1) as f32).sqrt();
        c.param_specs().into_iter().map(|spec| Param { spec, init: Init::Normal(std) }).collect()
    }
    fn forward(
        &self,
        p: Params<'_>,
        b: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        Module::forward(&self.0, p, b, x, ctx)
    }
    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        Module::backward(&self.0, p, saved, dy, g, ctx)
    }
    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        Module::lower(&self.0, l, at, x)
    }
}

/// torchvision's `BasicBlock(c_in, c_out, stride)`: `relu(bn2(conv2(relu(bn1(conv1 x)))) +
/// shortcut x)`, the shortcut `downsample` (1x1 convolution of `stride`, BatchNorm) where the
/// shape changes, else the identity.
pub fn basic_block(c_in: usize, c_out: usize, stride: usize) -> Sequential {
    let main = Sequential::new()
        .push("conv1", conv(c_in, c_out, 3, stride))
        .push("bn1", BatchNorm::d2(c_out))
        .push("", Relu)
        .push("conv2", conv(c_out, c_out, 3, 1))
        .push("bn2", BatchNorm::d2(c_out));
    let res = if stride != 1 || c_in != c_out {
        let down = Sequential::new()
            .push("0", conv(c_in, c_out, 1, stride))
            .push("1", BatchNorm::d2(c_out));
        Residual::with_shortcut(main, "downsample", down)
    } else {
        Residual::new(main)
    };
    Sequential::new().push("", res).push("", Relu)
}

/// The `resnet-bn` model of `cfg`: units `stem`, one per `BasicBlock`, `head` (MRES-1).
pub fn resnet_bn(cfg: &ResNetConfig) -> Result<ModuleNet, ModelError> {
    let w = cfg.width;
    if w == 0 || cfg.in_channels == 0 || cfg.classes == 0 {
        return Err(ModelError::Config(format!(
            "resnet-bn: width {w}, input channels {} and classes {} must all be at least 1",
            cfg.in_channels, cfg.classes
        )));
    }
    let stem = Sequential::new()
        .push("conv1", conv(cfg.in_channels, w, 3, 1))
        .push("bn1", BatchNorm::d2(w))
        .push("", Relu);
    let mut net =
        ModuleNet::new("resnet-bn", ClassCrossEntropy).push_unit("stem", "", Box::new(stem));
    let mut c_in = w;
    for (layer, (&n, mult)) in cfg.blocks.iter().zip([1, 2, 4, 8]).enumerate() {
        let c_out = w * mult;
        for i in 0..n {
            let stride = if layer > 0 && i == 0 { 2 } else { 1 };
            net = net.push(&format!("layer{}.{i}", layer + 1), basic_block(c_in, c_out, stride));
            c_in = c_out;
        }
    }
    let head = Sequential::new()
        .push("avgpool", GlobalAvgPool)
        .push("", Flatten)
        .push("fc", Linear::new(c_in, cfg.classes, true));
    Ok(net.push_unit("head", "", Box::new(head)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::network::Network;
    use crate::nn::gradcheck::{numeric_grads, randn};

    #[test]
    fn mres_1_names_shapes_and_units_are_torchvisions() {
        let net = resnet_bn(&ResNetConfig::resnet18(3, 10, 64)).unwrap();
        let spec = net.spec();
        let units: Vec<&str> = spec.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(units.len(), 10);
        assert_eq!(
            (units[0], units[1], units[8], units[9]),
            ("stem", "layer1.0", "layer4.1", "head")
        );
        let names: Vec<String> = spec
            .units
            .iter()
            .flat_map(|u| u.params.iter().chain(&u.buffers).map(|p| p.name.clone()))
            .collect();
        for n in [
            "conv1.weight",
            "bn1.num_batches_tracked",
            "layer1.0.conv1.weight",
            "layer1.0.bn2.running_var",
            "layer2.0.downsample.0.weight",
            "layer2.0.downsample.1.running_mean",
            "layer4.1.bn2.bias",
            "fc.weight",
            "fc.bias",
        ] {
            assert!(names.iter().any(|m| m == n), "{n} missing from {names:?}");
        }
        assert!(
            !names.iter().any(|n| n.starts_with("layer1.0.downsample")),
            "layer1 keeps its shape"
        );
        // torchvision's resnet18 has 11,689,512 parameters at 1000 classes; with a 3x3 stem
        // (1,728 instead of 9,408 weights) and 10 classes: 11,173,962.
        assert_eq!(spec.numel(), 11_173_962);
        let shape = |n: &str| {
            spec.units.iter().flat_map(|u| &u.params).find(|p| p.name == n).unwrap().shape.clone()
        };
        assert_eq!(shape("conv1.weight"), vec![64, 3, 3, 3]);
        assert_eq!(shape("layer3.0.downsample.0.weight"), vec![256, 128, 1, 1]);
        assert_eq!(shape("fc.weight"), vec![10, 512]);
        // Kaiming normal, fan-out: std sqrt(2 / (256 * 9)) for layer3's 3x3 convolutions.
        let u = spec.units.iter().position(|u| u.name == "layer3.1").unwrap();
        let p = net.init_params(u, 1).unwrap();
        let n = 256 * 256 * 9;
        let sd = (p[..n].iter().map(|v| v * v).sum::<f32>() / n as f32).sqrt();
        assert!((sd - (2.0f32 / 2304.0).sqrt()).abs() < 1e-3, "std {sd}");
    }

    /// BN-1 through the modules: with `Ctx::sync_bn` (the runtime's `--sync-bn on`, the
    /// layers themselves not marked `sync`) a block on two ranks, each with half the batch,
    /// gives each rank its part of the one-process output and the same running statistics,
    /// one statistics message per BatchNorm each way.
    #[test]
    fn sync_bn_from_the_context_equals_one_process_over_the_whole_batch() {
        use crate::testing::{run_ranks, thread_reducers, CountingReducer};
        let block = basic_block(2, 3, 2);
        let params = super::super::init_values(&block.params(), 5);
        let init_bufs = super::super::init_values(&block.buffers(), 0);
        let (n, per) = (4usize, 2 * 4 * 4);
        let x = crate::testutil::rand_tensor(&[n, 2, 4, 4], 3);
        let be = Cpu::new();
        let mut bufs = init_bufs.clone();
        let ctx = Ctx::new(&be, true, n);
        let (want, _) =
            block.forward(Params::new(&params), Buffers::new(&mut bufs), x.clone(), &ctx).unwrap();
        let reducers = thread_reducers(2, std::time::Duration::from_secs(20));
        let outs = run_ranks(2, |r| {
            let counted = CountingReducer::new(&reducers[r]);
            let ctx = Ctx::new(&be, true, n).with_reducer(&counted).with_sync_bn(true);
            let half = x.as_f32().unwrap()[r * 2 * per..(r + 1) * 2 * per].to_vec();
            let xr = Tensor::new(vec![2, 2, 4, 4], half).unwrap();
            let mut b = init_bufs.clone();
            let (y, s) =
                block.forward(Params::new(&params), Buffers::new(&mut b), xr, &ctx).unwrap();
            let forward = counted.messages();
            let mut g = vec![0.0f32; params.len()];
            let dy = Tensor::new(y.shape().to_vec(), vec![1.0; y.numel()]).unwrap();
            block.backward(Params::new(&params), s, dy, Grads::new(&mut g), &ctx).unwrap();
            (y, b, forward, counted.messages() - forward)
        });
        let got: Vec<f32> = outs.iter().flat_map(|o| o.0.as_f32().unwrap().to_vec()).collect();
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| (p - q).abs() <= 1e-5);
        assert!(close(&got, want.as_f32().unwrap()), "outputs differ from one process");
        for (y, b, fwd, bwd) in &outs {
            assert_eq!(y.shape(), &[2, 3, 2, 2]);
            assert!(close(b, &bufs), "running statistics differ from one process");
            assert_eq!((*fwd, *bwd), (3, 3), "three BatchNorms, one message each way");
        }
    }

    /// An f64 forward of `basic_block(ci, co, 2)` over its parameters in module order,
    /// written independently of the f32 kernels: direct convolution, training-mode
    /// BatchNorm (biased variance, eps 1e-5), ReLU.
    fn block_ref(ci: usize, co: usize, p: &[f64], x: &[f64], n: usize, h: usize) -> Vec<f64> {
        let conv = |x: &[f64], w: &[f64], c_in: usize, k: usize, s: usize, hi: usize| {
            let pad = (k / 2) as isize;
            let ho = (hi + 2 * (k / 2) - k) / s + 1;
            let mut y = vec![0.0; n * co * ho * ho];
            for b in 0..n {
                for o in 0..co {
                    for oy in 0..ho {
                        for ox in 0..ho {
                            let mut acc = 0.0;
                            for c in 0..c_in {
                                for ky in 0..k {
                                    for kx in 0..k {
                                        let iy = (oy * s + ky) as isize - pad;
                                        let ix = (ox * s + kx) as isize - pad;
                                        if iy < 0
                                            || ix < 0
                                            || iy >= hi as isize
                                            || ix >= hi as isize
                                        {
                                            continue;
                                        }
                                        let xv = x[((b * c_in + c) * hi + iy as usize) * hi
                                            + ix as usize];
                                        acc += xv * w[((o * c_in + c) * k + ky) * k + kx];
                                    }
                                }
                            }
                            y[((b * co + o) * ho + oy) * ho + ox] = acc;
                        }
                    }
                }
            }
            (y, ho)
        };
        let bn = |y: &mut [f64], g: &[f64], s: usize| {
            for c in 0..co {
                let idx = |b: usize, i: usize| (b * co + c) * s + i;
                let m = (0..n)
                    .flat_map(|b| (0..s).map(move |i| (b, i)))
                    .map(|(b, i)| y[idx(b, i)])
                    .sum::<f64>()
                    / (n * s) as f64;
                let v = (0..n)
                    .flat_map(|b| (0..s).map(move |i| (b, i)))
                    .map(|(b, i)| (y[idx(b, i)] - m).powi(2))
                    .sum::<f64>()
                    / (n * s) as f64;
                for b in 0..n {
                    for i in 0..s {
                        y[idx(b, i)] = (y[idx(b, i)] - m) / (v + 1e-5).sqrt() * g[c] + g[co + c];
                    }
                }
            }
        };
        let relu = |y: &mut [f64]| y.iter_mut().for_each(|v| *v = v.max(0.0));
        let (w1, rest) = p.split_at(co * ci * 9);
        let (bn1, rest) = rest.split_at(2 * co);
        let (w2, rest) = rest.split_at(co * co * 9);
        let (bn2, rest) = rest.split_at(2 * co);
        let (wd, bnd) = rest.split_at(co * ci);
        let (mut y, ho) = conv(x, w1, ci, 3, 2, h);
        let s = ho * ho;
        bn(&mut y, bn1, s);
        relu(&mut y);
        let (mut y, _) = conv(&y, w2, co, 3, 1, ho);
        bn(&mut y, bn2, s);
        let (mut d, _) = conv(x, wd, ci, 1, 2, h);
        bn(&mut d, bnd, s);
        y.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        relu(&mut y);
        y
    }

    /// MRES-2: the analytic gradients of a block with a `downsample` (f32) against central
    /// differences of the f64 forward, every parameter and input element; and one element
    /// moved by ten times the tolerance fails the same check.
    #[test]
    fn mres_2_basic_block_with_downsample_matches_finite_differences() {
        let (ci, co, n, h) = (2usize, 3usize, 3usize, 4usize);
        let block = basic_block(ci, co, 2);
        let np = super::super::numel(&block.params());
        assert_eq!(np, co * ci * 9 + 2 * co + co * co * 9 + 2 * co + co * ci + 2 * co);
        // f32-representable values, so that both forwards see the same numbers.
        let round = |v: Vec<f64>| v.into_iter().map(|a| a as f32 as f64).collect::<Vec<f64>>();
        let mut params = round(randn(np, 11).into_iter().map(|v| 0.5 * v).collect());
        // BatchNorm gains near 1 (positions of each BN's weight in module order).
        for off in [co * ci * 9, co * ci * 9 + 2 * co + co * co * 9, np - 2 * co] {
            for c in 0..co {
                params[off + c] = (1.0 + 0.2 * params[off + c]) as f32 as f64;
            }
        }
        let x = round(randn(n * ci * h * h, 12));
        let out = n * co * (h / 2) * (h / 2);
        let r = randn(out, 13);
        let be = Cpu::new();
        let ctx = Ctx::new(&be, true, n);
        let f32s = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
        let mut bufs = vec![0.0f32; super::super::numel(&block.buffers())];
        let xt = Tensor::new(vec![n, ci, h, h], f32s(&x)).unwrap();
        let pf = f32s(&params);
        let (y, saved) =
            block.forward(Params::new(&pf), Buffers::new(&mut bufs), xt, &ctx).unwrap();
        let want = block_ref(ci, co, &params, &x, n, h);
        for (a, b) in y.as_f32().unwrap().iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()), "forward {a} vs {b}");
        }
        let mut gp = vec![0.0f32; np];
        let dy = Tensor::new(y.shape().to_vec(), f32s(&r)).unwrap();
        let dx = block.backward(Params::new(&pf), saved, dy, Grads::new(&mut gp), &ctx).unwrap();
        let analytic: Vec<Vec<f64>> = vec![
            gp.iter().map(|&v| v as f64).collect(),
            dx.as_f32().unwrap().iter().map(|&v| v as f64).collect(),
        ];
        let numeric = numeric_grads(&[params.clone(), x.clone()], &r, &|a: &[Vec<f64>]| {
            block_ref(ci, co, &a[0], &a[1], n, h)
        });
        // f32 analytic gradients against f64 differences: a few f32 epsilons of the
        // largest terms summed, relative to max(1, |g|).
        const TOL: f64 = 4e-6;
        let worst = |ana: &[Vec<f64>]| -> f64 {
            ana.iter()
                .zip(&numeric)
                .flat_map(|(a, n)| a.iter().zip(n).map(|(a, n)| (a - n).abs() / (1.0 + a.abs())))
                .fold(0.0, f64::max)
        };
        let w = worst(&analytic);
        eprintln!("basic block gradient check: worst relative error {w:e} (tolerance {TOL:e})");
        assert!(w <= TOL, "gradients differ from finite differences by {w:e}");
        for (arg, g) in analytic.iter().enumerate() {
            for i in [0, g.len() / 2, g.len() - 1] {
                let mut wrong = analytic.clone();
                wrong[arg][i] += 10.0 * TOL * (1.0 + g[i].abs());
                assert!(worst(&wrong) > TOL, "a wrong element [{arg}][{i}] passed the check");
            }
        }
    }
}
