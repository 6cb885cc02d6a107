//! Model kernels as device ops: each [`Op`] describes one kernel by value (a GEMM's shape,
//! a layer's dimensions, an update's hyper-parameters), so that a device runs it with code
//! of its own (the CUDA device: cuBLAS and the kernels of `cuda/kernels.cu`), and every
//! other device runs its host reference, which is the layer's own code in [`crate::nn`] or
//! [`crate::batchnorm`] (OPS-2). The engine on a device then enqueues ops, not host
//! functions, and a GPU can run them with no copy through the host.
//!
//! Buffers are `f32` elements; ids and class targets travel as their `u32` bits, as device
//! activations carry them. Each variant documents its reads and writes, in order.
//!
//! Invariants (cited by the tests):
//! - OPS-1: [`Op::check`] accepts exactly the buffer lengths the op's code reads and
//!   writes inside, so a device's own code, launched only after it, stays in its buffers.
//! - OPS-2: the host reference is the layer code of [`crate::nn`] or [`crate::batchnorm`]
//!   (the same function, not a copy): a model run as ops on the cpu or simulated device
//!   computes what it computes on the host; the SGD and AdamW updates follow the CUDA
//!   kernels' arithmetic element for element.
//! - OPS-3: an op that accumulates (`+=`) adds to what its written buffer held; one that does
//!   not overwrites every element it owns.

use std::sync::Arc;

use shardline_collectives::device::{DeviceError, DeviceOp};

use crate::backend::GemmShape;
use crate::nn::activation::Activation;
use crate::nn::attention::AttnShape;
use crate::nn::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use crate::nn::embedding::Embedding;
use crate::nn::gemm::Gemm;
use crate::nn::linear::Linear;
use crate::nn::norm::{LayerNorm, LayerNormSaved};

mod cnn;
mod elementwise;
mod norm_attn;
#[cfg(test)]
pub(crate) mod tests;

/// One `torch.optim.SGD` step: its hyper-parameters and its number.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f32,
    /// Momentum (0: no momentum buffer).
    pub momentum: f32,
    /// Dampening of the momentum.
    pub dampening: f32,
    /// L2 weight decay, added to the gradient.
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// The step, 1-based.
    pub step: u64,
}

/// One `torch.optim.AdamW` step: its hyper-parameters and its number.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f32,
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to the second moment's square root.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// The step, 1-based.
    pub step: u64,
}

impl AdamWStep {
    /// `(step_size, sqrt(1 - beta2^t), 1 - lr * weight_decay)`: the bias corrections in f64,
    /// as PyTorch computes them on the host, which the kernel and the host reference share.
    pub fn scalars(&self) -> (f32, f32, f32) {
        let t = self.step.min(i32::MAX as u64) as i32;
        let bc1 = 1.0 - f64::from(self.beta1).powi(t);
        let bc2_sqrt = (1.0 - f64::from(self.beta2).powi(t)).sqrt() as f32;
        ((f64::from(self.lr) / bc1) as f32, bc2_sqrt, 1.0 - self.lr * self.weight_decay)
    }
}

/// A model kernel described by value. Reads and writes are listed in launch order.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Op {
    /// Writes: `x` = `value` everywhere.
    Fill {
        /// The value.
        value: f32,
    },
    /// Reads: `x`. Writes: `y += alpha * x`.
    Axpy {
        /// The factor.
        alpha: f32,
    },
    /// Reads: `a`, `b`. Writes: `c = op(a) op(b)` (`+=` when `accumulate`), row-major.
    Gemm {
        /// The product's shape and transposes.
        shape: GemmShape,
        /// Add to `c` instead of overwriting it.
        accumulate: bool,
    },
    /// Reads: `params` (`weight`, then `bias`), `x [rows, in]`. Writes: `y [rows, out]`
    /// (`y = x W^T + b`, LIN-1).
    LinearForward(Linear),
    /// Reads: `params`, `x`, `dy`. Writes: `grads` (ADDS `dW`, `db`), then `dx` when
    /// `input_grad` (LIN-2).
    LinearBackward {
        /// The layer.
        linear: Linear,
        /// Whether `dx` is written.
        input_grad: bool,
    },
    /// Reads: `x`. Writes: `y = max(x, 0)`.
    Relu,
    /// Reads: `y` (the forward's output), `dy`. Writes: `dx = dy * (y > 0)`.
    ReluBackward,
    /// Reads: `x`. Writes: `y = f(x)` (ACTIV-1..3).
    Activation(Activation),
    /// Reads: `x`, `dy`. Writes: `dx = dy * f'(x)`.
    ActivationBackward(Activation),
    /// Reads: `params` (`weight`, then `bias`), `x [rows, dim]`. Writes: `y`, `mean [rows]`,
    /// `rstd [rows]` (NORM-1, NORM-3).
    LayerNormForward(LayerNorm<f32>),
    /// Reads: `params`, `x`, `mean`, `rstd`, `dy`. Writes: `dx`, `grads` (ADDS `dweight`,
    /// `dbias`).
    LayerNormBackward(LayerNorm<f32>),
    /// Reads: `logits [rows, vocab]`, `targets [rows]` (u32 bits). Writes: `loss [1]` (the
    /// mean over rows, times `dloss`), `dlogits = dloss * (softmax - onehot) / rows`
    /// (XENT-1).
    CrossEntropy {
        /// Classes per row.
        vocab: usize,
        /// The loss's weight (the gradient flowing into it).
        dloss: f32,
    },
    /// Reads: `table [vocab, dim]`, `ids [n]` (u32 bits). Writes: `out [n, dim]` (EMB-1).
    EmbeddingForward(Embedding),
    /// Reads: `ids`, `dy [n, dim]`. Writes: `grads [vocab, dim]` (ADDS, EMB-2).
    EmbeddingBackward(Embedding),
    /// Reads: `x`. Writes: `out [2]`: the `f64` sum of squares ([`sq_norm`]'s order on the
    /// host), its bits split high, low.
    SumSquares,
    /// Reads: `sums [3]` (loss, squared norm, stop: what [`Op::NormSums`] wrote, summed over
    /// the ranks). Writes: `grads *= clip_coef(sums[1], max_norm)`, untouched when that is 1.
    ClipScale {
        /// The largest norm let through.
        max_norm: f64,
    },
    /// Reads: `loss [1]`, `sq [2 units]` (each unit's squared norm as [`store_f64`] bits).
    /// Writes: `sums [3]`: the loss, the units' squared norms summed in unit order, `stop`.
    NormSums {
        /// Units.
        units: usize,
        /// What the rank's third element carries (a wish to stop, 1 or 0).
        stop: f32,
    },
    /// Reads: `grad`. Writes: `params`, `momentum` (as long as `params`; unused without
    /// momentum).
    Sgd(SgdStep),
    /// Reads: `grad`. Writes: `params`, `state` (`(m, v)` interleaved, twice as long).
    AdamW(AdamWStep),
    /// BatchNorm's statistics in training mode, over `[n, c, s]` (`s = 1` for `[N, C]`):
    /// two passes in f64, as the layer's `local_stats`. Reads: `x [n * c * s]`. Writes:
    /// `mean [c]`, `m2 [c]` (the sum of squared deviations from the mean), which
    /// SyncBatchNorm merges across ranks (with each rank's count `n * s`) before the forward.
    BatchNormStats {
        /// Samples in the slice.
        n: usize,
        /// Channels.
        c: usize,
        /// Values per channel and sample (`L`, `H * W`; 1 for `[N, C]`).
        s: usize,
    },
    /// BatchNorm's forward in training mode, with the statistics of the (global) batch.
    /// Reads: `x [n * c * s]`, `params` (`weight [c]`, then `bias [c]`), `mean [c]`, `m2 [c]`.
    /// Writes: `y [n * c * s]`, `xhat [n * c * s]` (`(x - mean) * invstd`), `invstd [c]`
    /// (`1 / sqrt(m2 / count + eps)`), what the backward reads. The running statistics are
    /// the caller's.
    BatchNormForward {
        /// Samples in the slice.
        n: usize,
        /// Channels.
        c: usize,
        /// Values per channel and sample.
        s: usize,
        /// Values per channel in the global batch (`n * s` without SyncBatchNorm): at least
        /// 2 (BN-4) and at least `n * s`.
        count: usize,
        /// Added to the variance.
        eps: f32,
    },
    /// BatchNorm's backward reduce. Reads: `dy [n * c * s]`, `xhat [n * c * s]`. Writes:
    /// `sums [2 c]` (per channel `sum dy`, then `sum dy * xhat`: what SyncBatchNorm
    /// all-reduces), `grads [2 c]` (ADDS this slice's `dweight = sum dy * xhat`, then `dbias
    /// = sum dy`, BN-3).
    BatchNormBackwardReduce {
        /// Samples in the slice.
        n: usize,
        /// Channels.
        c: usize,
        /// Values per channel and sample.
        s: usize,
    },
    /// BatchNorm's input gradient in training mode. Reads: `params [2 c]`, `xhat`, `invstd
    /// [c]`, `sums [2 c]` (of the global batch), `dy`. Writes: `dx = weight * invstd * (dy -
    /// sum dy / count - xhat * sum dy xhat / count)`.
    BatchNormBackwardDx {
        /// Samples in the slice.
        n: usize,
        /// Channels.
        c: usize,
        /// Values per channel and sample.
        s: usize,
        /// Values per channel in the global batch: at least 2 and at least `n * s`.
        count: usize,
    },
    /// Causal self-attention without dropout (ATTN-1). Reads: `q`, `k`, `v`, each `[batch,
    /// heads, seq, head_dim]`. Writes: `out` (the same layout), `lse [batch, heads, seq]`
    /// (each query row's logsumexp of its scaled scores).
    AttentionForward(AttnShape),
    /// Its backward. Reads: `q`, `k`, `v`, `out`, `lse`, `dout`. Writes: `dq`, `dk`, `dv`
    /// (overwritten).
    AttentionBackward(AttnShape),
    /// Reads: `x`. Writes: `y = x`, bit for bit.
    Copy,
    /// Reads: `a`, `b`. Writes: `c = a + b` (a residual connection and its gradient).
    Add,
    /// Reads: `a`, `b`. Writes: `c = a * b` (an activation's input gradient from the
    /// derivative its forward saved).
    Mul,
    /// The activation module's forward, which saves the derivative instead of the input
    /// (ACTIV-5). Reads: `x`. Writes: `y = f(x)`, `d = f'(x)`.
    ActivationSavingDerivative(Activation),
    /// Causal self-attention without dropout on nanoGPT's token layout (ATTN-5). Reads:
    /// `qkv [batch, seq, 3 embd]` (`c_attn`'s output). Writes: `y [batch, seq, embd]` (the
    /// heads merged), `lse [batch, heads, seq]`.
    AttentionForwardTokens(AttnShape),
    /// Its backward. Reads: `qkv`, `y`, `lse`, `dy`. Writes: `dqkv` (overwritten).
    AttentionBackwardTokens(AttnShape),
    /// The engine's classification loss: this rank's share of the mean softmax
    /// cross-entropy over `global` rows (LOSS-1). Reads: `logits [rows, classes]`, `targets
    /// [rows]` (u32 bits). Writes: `loss [1]`, `dlogits`.
    SoftmaxCrossEntropy {
        /// Classes per row.
        classes: usize,
        /// Rows of the global batch the mean is over (at least the rows read).
        global: usize,
    },
    /// 2-d convolution as the layer computes it (im2col and one product per sample). Reads:
    /// `params` (`weight`, then `bias`), `x [n, in, h, w]`. Writes: `y [n, out, ho, wo]`.
    Conv2dForward(ConvDims),
    /// Its backward. Reads: `params`, `x`, `dy`. Writes: `grads` (ADDS), `dx` (overwritten).
    Conv2dBackward(ConvDims),
    /// Max pooling. Reads: `x [n, c, h, w]`. Writes: `y [n, c, ho, wo]`, `argmax` (each
    /// output's input index, `u32` bits).
    MaxPoolForward(PoolDims),
    /// Its backward. Reads: `argmax`, `dy`. Writes: `dx` (overwritten).
    MaxPoolBackward(PoolDims),
    /// Global average pooling over `[n, c, s]`. Reads: `x`. Writes: `y [n, c]`.
    GlobalAvgPool(BnDims),
    /// Its backward. Reads: `dy [n, c]`. Writes: `dx [n, c, s]`.
    GlobalAvgPoolBackward(BnDims),
    /// BatchNorm's statistics of this rank's slice, exact: per channel count, mean and M2,
    /// each an `f64` as two elements ([`store_f64`]). Reads: `x [n, c, s]`. Writes: `stats
    /// [6 c]`.
    BatchNormLocalStats(BnDims),
    /// The statistics as SyncBatchNorm's message records (each `f64` as an f32 pair, hi then
    /// lo, BN-5). Reads: `stats [6 c]`. Writes: `records [6 c]`.
    BatchNormEncode {
        /// Channels.
        c: usize,
    },
    /// Every rank's records merged in rank order (Chan's merge, as the reducer combines
    /// them), back to exact statistics. Reads: `records [world * 6 c]`. Writes: `stats [6 c]`.
    BatchNormMerge {
        /// Channels.
        c: usize,
        /// Ranks.
        world: usize,
    },
    /// BatchNorm's training forward with the batch's statistics. Reads: `x`, `params [2 c]`,
    /// `stats [6 c]`. Writes: `y`, `xhat`, `invstd [c]`, `count [2]` (the batch's count, an
    /// `f64`), `buffers [2 c + 1]` (the running statistics, updated).
    BatchNormTrain {
        /// The layout.
        dims: BnDims,
        /// Added to the variance.
        eps: f32,
        /// Of the running statistics.
        momentum: f32,
    },
    /// BatchNorm in evaluation mode. Reads: `x`, `params [2 c]`, `buffers [2 c + 1]`.
    /// Writes: `y`.
    BatchNormEval {
        /// The layout.
        dims: BnDims,
        /// Added to the variance.
        eps: f32,
    },
    /// BatchNorm's backward reduce, exact. Reads: `dy`, `xhat`. Writes: `sums [4 c]` (`sum
    /// dy`, then `sum dy * xhat`, `f64`s as pairs), `grads [2 c]` (ADDS).
    BatchNormGradSums(BnDims),
    /// BatchNorm's input gradient in training mode. Reads: `params [2 c]`, `xhat`, `invstd`,
    /// `sums [4 c]`, `count [2]`, `dy`. Writes: `dx`.
    BatchNormGradDx(BnDims),
    /// `f64`s stored as pairs ([`store_f64`]) rounded to f32. Reads: `[2 n]`. Writes: `[n]`.
    F64ToF32,
    /// f32 values widened to `f64` pairs. Reads: `[n]`. Writes: `[2 n]`.
    F32ToF64,
}

/// A BatchNorm's (or a pooling's) layout `[n, c, s]`: samples, channels, values per channel
/// and sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BnDims {
    /// Samples.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Values per channel and sample.
    pub s: usize,
}

/// A convolution over `[n, in, h, w]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvDims {
    /// The layer.
    pub conv: crate::conv::Conv2d,
    /// Samples.
    pub n: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
}

/// A max pooling over `[n, c, h, w]`.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolDims {
    /// The layer.
    pub pool: crate::layers::MaxPool2d,
    /// Samples.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
}

fn want(what: &str, got: &[usize], n: usize) -> Result<(), String> {
    if got.len() == n {
        Ok(())
    } else {
        Err(format!("{what}: {n} buffers expected, {} given", got.len()))
    }
}

fn len_is(what: &str, got: usize, expected: usize) -> Result<(), String> {
    if got == expected {
        Ok(())
    } else {
        Err(format!("{what} has {got} elements, {expected} expected"))
    }
}

fn rows_of(what: &str, len: usize, width: usize) -> Result<usize, String> {
    if width == 0 {
        return if len == 0 { Ok(0) } else { Err(format!("{what}: width 0")) };
    }
    if len.is_multiple_of(width) {
        Ok(len / width)
    } else {
        Err(format!("{what} has {len} elements, not a multiple of {width}"))
    }
}

/// The `u32` a device element carries (ids, targets travel as their bits).
fn ids_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Sum of squares of a (local) gradient slice, in f64 so that the sum over ranks and units
/// is insensitive to order at f32 precision.
pub fn sq_norm(grads: &[f32]) -> f64 {
    // Eight partial sums in a fixed order (so still deterministic): one running sum is a
    // serial chain of f64 adds, which does not vectorise.
    let mut acc = [0.0f64; 8];
    let mut chunks = grads.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f64::from(x) * f64::from(x);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    acc.iter().sum::<f64>() + tail
}

/// The clipping coefficient for a total squared norm: `min(1, max_norm / (norm + 1e-6))`,
/// as `torch.nn.utils.clip_grad_norm_`.
pub fn clip_coef(total_sq_norm: f64, max_norm: f64) -> f32 {
    let norm = total_sq_norm.max(0.0).sqrt();
    let coef = max_norm / (norm + 1e-6);
    coef.min(1.0) as f32
}

/// An `f64` as its bits in two elements, high then low (as the engine's norm sums).
pub fn store_f64(v: f64, two: &mut [f32]) {
    let b = v.to_bits();
    two[0] = f32::from_bits((b >> 32) as u32);
    two[1] = f32::from_bits(b as u32);
}

/// The `f64` whose bits two elements carry (see [`store_f64`]).
pub fn load_f64(two: &[f32]) -> f64 {
    f64::from_bits(u64::from(two[0].to_bits()) << 32 | u64::from(two[1].to_bits()))
}

impl Op {
    /// The op as the device interface takes it.
    pub fn arc(self) -> Arc<dyn DeviceOp> {
        Arc::new(self)
    }

    /// A short name (errors and timelines).
    pub fn label(&self) -> &'static str {
        match self {
            Op::Fill { .. } => "fill",
            Op::Axpy { .. } => "axpy",
            Op::Gemm { .. } => "gemm",
            Op::LinearForward(_) => "linear forward",
            Op::LinearBackward { .. } => "linear backward",
            Op::Relu => "relu",
            Op::ReluBackward => "relu backward",
            Op::Activation(_) => "activation",
            Op::ActivationBackward(_) => "activation backward",
            Op::LayerNormForward(_) => "layer norm forward",
            Op::LayerNormBackward(_) => "layer norm backward",
            Op::CrossEntropy { .. } => "cross entropy",
            Op::EmbeddingForward(_) => "embedding forward",
            Op::EmbeddingBackward(_) => "embedding backward",
            Op::SumSquares => "sum of squares",
            Op::ClipScale { .. } => "clip scale",
            Op::NormSums { .. } => "loss and norm sums",
            Op::Sgd(_) => "sgd",
            Op::AdamW(_) => "adamw",
            Op::BatchNormStats { .. } => "batch norm statistics",
            Op::BatchNormForward { .. } => "batch norm forward",
            Op::BatchNormBackwardReduce { .. } => "batch norm backward reduce",
            Op::BatchNormBackwardDx { .. } => "batch norm backward dx",
            Op::AttentionForward(_) => "attention forward",
            Op::AttentionBackward(_) => "attention backward",
            Op::Copy => "copy",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::ActivationSavingDerivative(_) => "activation saving derivative",
            Op::AttentionForwardTokens(_) => "attention forward (tokens)",
            Op::AttentionBackwardTokens(_) => "attention backward (tokens)",
            Op::SoftmaxCrossEntropy { .. } => "softmax cross entropy",
            Op::Conv2dForward(_) => "conv2d forward",
            Op::Conv2dBackward(_) => "conv2d backward",
            Op::MaxPoolForward(_) => "max pool forward",
            Op::MaxPoolBackward(_) => "max pool backward",
            Op::GlobalAvgPool(_) => "global average pool",
            Op::GlobalAvgPoolBackward(_) => "global average pool backward",
            Op::BatchNormLocalStats(_) => "batch norm local statistics",
            Op::BatchNormEncode { .. } => "batch norm encode",
            Op::BatchNormMerge { .. } => "batch norm merge",
            Op::BatchNormTrain { .. } => "batch norm train",
            Op::BatchNormEval { .. } => "batch norm eval",
            Op::BatchNormGradSums(_) => "batch norm gradient sums",
            Op::BatchNormGradDx(_) => "batch norm gradient dx",
            Op::F64ToF32 => "f64 to f32",
            Op::F32ToF64 => "f32 to f64",
        }
    }

    /// OPS-1: whether buffers of these lengths fit the op.
    pub fn check_lens(&self, r: &[usize], w: &[usize]) -> Result<(), String> {
        let name = self.label();
        match self {
            Op::Fill { .. } => {
                want(&format!("{name} reads"), r, 0)?;
                want(&format!("{name} writes"), w, 1)
            }
            Op::Axpy { .. } => {
                want(&format!("{name} reads"), r, 1)?;
                want(&format!("{name} writes"), w, 1)?;
                len_is("axpy y", w[0], r[0])
            }
            Op::Gemm { shape, .. } => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 1)?;
                let GemmShape { m, n, k, .. } = *shape;
                len_is("gemm a", r[0], m * k)?;
                len_is("gemm b", r[1], k * n)?;
                len_is("gemm c", w[0], m * n)
            }
            Op::LinearForward(l) => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 1)?;
                len_is("linear params", r[0], l.num_params())?;
                let n = rows_of("linear x", r[1], l.in_dim)?;
                len_is("linear y", w[0], n * l.out_dim)
            }
            Op::LinearBackward { linear: l, input_grad } => {
                want(&format!("{name} reads"), r, 3)?;
                want(&format!("{name} writes"), w, if *input_grad { 2 } else { 1 })?;
                len_is("linear params", r[0], l.num_params())?;
                let n = rows_of("linear x", r[1], l.in_dim)?;
                len_is("linear dy", r[2], n * l.out_dim)?;
                len_is("linear grads", w[0], l.num_params())?;
                if *input_grad {
                    len_is("linear dx", w[1], r[1])?;
                }
                Ok(())
            }
            Op::Relu | Op::Activation(_) => {
                want(&format!("{name} reads"), r, 1)?;
                want(&format!("{name} writes"), w, 1)?;
                len_is(&format!("{name} y"), w[0], r[0])
            }
            Op::ReluBackward | Op::ActivationBackward(_) => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 1)?;
                len_is(&format!("{name} dy"), r[1], r[0])?;
                len_is(&format!("{name} dx"), w[0], r[0])
            }
            Op::LayerNormForward(ln) => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 3)?;
                len_is("layer norm params", r[0], ln.num_params())?;
                let n = rows_of("layer norm x", r[1], ln.dim)?;
                len_is("layer norm y", w[0], r[1])?;
                len_is("layer norm mean", w[1], n)?;
                len_is("layer norm rstd", w[2], n)
            }
            Op::LayerNormBackward(ln) => {
                want(&format!("{name} reads"), r, 5)?;
                want(&format!("{name} writes"), w, 2)?;
                len_is("layer norm params", r[0], ln.num_params())?;
                let n = rows_of("layer norm x", r[1], ln.dim)?;
                len_is("layer norm mean", r[2], n)?;
                len_is("layer norm rstd", r[3], n)?;
                len_is("layer norm dy", r[4], r[1])?;
                len_is("layer norm dx", w[0], r[1])?;
                len_is("layer norm grads", w[1], ln.num_params())
            }
            Op::CrossEntropy { vocab, .. } => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 2)?;
                let n = rows_of("cross entropy logits", r[0], *vocab)?;
                len_is("cross entropy targets", r[1], n)?;
                len_is("cross entropy loss", w[0], 1)?;
                len_is("cross entropy dlogits", w[1], r[0])
            }
            Op::EmbeddingForward(e) => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 1)?;
                len_is("embedding table", r[0], e.num_params())?;
                len_is("embedding out", w[0], r[1] * e.dim)
            }
            Op::EmbeddingBackward(e) => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 1)?;
                len_is("embedding dy", r[1], r[0] * e.dim)?;
                len_is("embedding grads", w[0], e.num_params())
            }
            Op::SumSquares => {
                want(&format!("{name} reads"), r, 1)?;
                want(&format!("{name} writes"), w, 1)?;
                len_is("sum of squares out", w[0], 2)
            }
            Op::ClipScale { .. } => {
                want(&format!("{name} reads"), r, 1)?;
                want(&format!("{name} writes"), w, 1)?;
                len_is("clip scale sums", r[0], 3)
            }
            Op::NormSums { units, .. } => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 1)?;
                len_is("norm sums loss", r[0], 1)?;
                len_is("norm sums squares", r[1], 2 * units)?;
                len_is("norm sums out", w[0], 3)
            }
            Op::Sgd(s) => {
                want(&format!("{name} reads"), r, 1)?;
                want(&format!("{name} writes"), w, 2)?;
                len_is("sgd grad", r[0], w[0])?;
                if s.momentum != 0.0 {
                    len_is("sgd momentum", w[1], w[0])?;
                }
                Ok(())
            }
            Op::AdamW(a) => {
                want(&format!("{name} reads"), r, 1)?;
                want(&format!("{name} writes"), w, 2)?;
                if a.step == 0 {
                    return Err("adamw: steps count from 1".into());
                }
                len_is("adamw grad", r[0], w[0])?;
                len_is("adamw state", w[1], 2 * w[0])
            }
            Op::BatchNormStats { n, c, s } => {
                want(&format!("{name} reads"), r, 1)?;
                want(&format!("{name} writes"), w, 2)?;
                len_is("batch norm x", r[0], norm_attn::bn_len(*n, *c, *s)?)?;
                len_is("batch norm mean", w[0], *c)?;
                len_is("batch norm m2", w[1], *c)
            }
            Op::BatchNormForward { n, c, s, count, .. } => {
                want(&format!("{name} reads"), r, 4)?;
                want(&format!("{name} writes"), w, 3)?;
                let len = norm_attn::bn_len(*n, *c, *s)?;
                norm_attn::bn_count(*n, *s, *count)?;
                len_is("batch norm x", r[0], len)?;
                len_is("batch norm params", r[1], 2 * c)?;
                len_is("batch norm mean", r[2], *c)?;
                len_is("batch norm m2", r[3], *c)?;
                len_is("batch norm y", w[0], len)?;
                len_is("batch norm xhat", w[1], len)?;
                len_is("batch norm invstd", w[2], *c)
            }
            Op::BatchNormBackwardReduce { n, c, s } => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 2)?;
                let len = norm_attn::bn_len(*n, *c, *s)?;
                len_is("batch norm dy", r[0], len)?;
                len_is("batch norm xhat", r[1], len)?;
                len_is("batch norm sums", w[0], 2 * c)?;
                len_is("batch norm grads", w[1], 2 * c)
            }
            Op::BatchNormBackwardDx { n, c, s, count } => {
                want(&format!("{name} reads"), r, 5)?;
                want(&format!("{name} writes"), w, 1)?;
                let len = norm_attn::bn_len(*n, *c, *s)?;
                norm_attn::bn_count(*n, *s, *count)?;
                len_is("batch norm params", r[0], 2 * c)?;
                len_is("batch norm xhat", r[1], len)?;
                len_is("batch norm invstd", r[2], *c)?;
                len_is("batch norm sums", r[3], 2 * c)?;
                len_is("batch norm dy", r[4], len)?;
                len_is("batch norm dx", w[0], len)
            }
            Op::AttentionForward(shape) => {
                want(&format!("{name} reads"), r, 3)?;
                want(&format!("{name} writes"), w, 2)?;
                let (numel, rows) = norm_attn::attn_lens(shape)?;
                for (what, len) in [("q", r[0]), ("k", r[1]), ("v", r[2]), ("out", w[0])] {
                    len_is(&format!("attention {what}"), len, numel)?;
                }
                len_is("attention lse", w[1], rows)
            }
            Op::AttentionBackward(shape) => {
                want(&format!("{name} reads"), r, 6)?;
                want(&format!("{name} writes"), w, 3)?;
                let (numel, rows) = norm_attn::attn_lens(shape)?;
                for (what, len) in [("q", r[0]), ("k", r[1]), ("v", r[2]), ("out", r[3])] {
                    len_is(&format!("attention {what}"), len, numel)?;
                }
                len_is("attention lse", r[4], rows)?;
                for (what, len) in [("dout", r[5]), ("dq", w[0]), ("dk", w[1]), ("dv", w[2])] {
                    len_is(&format!("attention {what}"), len, numel)?;
                }
                Ok(())
            }
            Op::Copy | Op::Add | Op::Mul | Op::ActivationSavingDerivative(_) => {
                elementwise::check(self, r, w)
            }
            Op::AttentionForwardTokens(shape) => {
                want(&format!("{name} reads"), r, 1)?;
                want(&format!("{name} writes"), w, 2)?;
                let (numel, rows) = norm_attn::attn_lens(shape)?;
                len_is("attention qkv", r[0], 3 * numel)?;
                len_is("attention y", w[0], numel)?;
                len_is("attention lse", w[1], rows)
            }
            Op::AttentionBackwardTokens(shape) => {
                want(&format!("{name} reads"), r, 4)?;
                want(&format!("{name} writes"), w, 1)?;
                let (numel, rows) = norm_attn::attn_lens(shape)?;
                len_is("attention qkv", r[0], 3 * numel)?;
                len_is("attention y", r[1], numel)?;
                len_is("attention lse", r[2], rows)?;
                len_is("attention dy", r[3], numel)?;
                len_is("attention dqkv", w[0], 3 * numel)
            }
            Op::SoftmaxCrossEntropy { classes, global } => {
                want(&format!("{name} reads"), r, 2)?;
                want(&format!("{name} writes"), w, 2)?;
                let n = rows_of("softmax cross entropy logits", r[0], *classes)?;
                len_is("softmax cross entropy targets", r[1], n)?;
                if *global < n {
                    return Err(format!("softmax cross entropy: global rows {global} below {n}"));
                }
                len_is("softmax cross entropy loss", w[0], 1)?;
                len_is("softmax cross entropy dlogits", w[1], r[0])
            }
            _ => cnn::check(self, r, w),
        }
    }

    /// The host reference (OPS-2), after [`Op::check_lens`] passed.
    pub fn host(&self, r: &[&[f32]], w: &mut [&mut [f32]]) -> Result<(), String> {
        let e = |e: crate::error::ModelError| e.to_string();
        match self {
            Op::Fill { value } => w[0].fill(*value),
            Op::Axpy { alpha } => {
                w[0].iter_mut().zip(r[0]).for_each(|(y, &x)| *y += alpha * x);
            }
            Op::Gemm { shape, accumulate } => f32::gemm(*shape, r[0], r[1], w[0], *accumulate),
            Op::LinearForward(l) => l.forward(r[0], r[1], w[0]).map_err(e)?,
            Op::LinearBackward { linear, input_grad } => {
                let (grads, rest) = w.split_first_mut().expect("checked: grads");
                let dx = if *input_grad { Some(&mut *rest[0]) } else { None };
                linear.backward(r[0], r[1], r[2], dx, grads).map_err(e)?;
            }
            Op::Relu => w[0].iter_mut().zip(r[0]).for_each(|(y, &x)| *y = x.max(0.0)),
            Op::ReluBackward => {
                for ((dx, &y), &dy) in w[0].iter_mut().zip(r[0]).zip(r[1]) {
                    *dx = if y > 0.0 { dy } else { 0.0 };
                }
            }
            Op::Activation(a) => a.forward(r[0], w[0]).map_err(e)?,
            Op::ActivationBackward(a) => a.backward(r[0], r[1], w[0]).map_err(e)?,
            Op::LayerNormForward(ln) => {
                let saved = ln.forward(r[0], r[1], w[0]).map_err(e)?;
                w[1].copy_from_slice(&saved.mean);
                w[2].copy_from_slice(&saved.rstd);
            }
            Op::LayerNormBackward(ln) => {
                let saved = LayerNormSaved { mean: r[2].to_vec(), rstd: r[3].to_vec() };
                let [dx, grads] = w else { unreachable!("checked: two writes") };
                ln.backward(r[0], r[1], &saved, r[4], dx, grads).map_err(e)?;
            }
            Op::CrossEntropy { vocab, dloss } => {
                let t = ids_of(r[1]);
                let saved = cross_entropy_forward(r[0], *vocab, &t).map_err(e)?;
                w[0][0] = saved.loss * dloss;
                cross_entropy_backward(r[0], *vocab, &t, &saved, *dloss, w[1]).map_err(e)?;
            }
            Op::EmbeddingForward(emb) => emb.forward(r[0], &ids_of(r[1]), w[0]).map_err(e)?,
            Op::EmbeddingBackward(emb) => emb.backward(&ids_of(r[0]), r[1], w[0]).map_err(e)?,
            Op::SumSquares => store_f64(sq_norm(r[0]), w[0]),
            Op::ClipScale { max_norm } => {
                let coef = clip_coef(f64::from(r[0][1]), *max_norm);
                if coef != 1.0 {
                    w[0].iter_mut().for_each(|g| *g *= coef);
                }
            }
            Op::NormSums { units, stop } => {
                // ENG-1: the norms summed in unit order.
                let sq: f64 = (0..*units).map(|u| load_f64(&r[1][2 * u..2 * u + 2])).sum();
                w[0].copy_from_slice(&[r[0][0], sq as f32, *stop]);
            }
            Op::Sgd(s) => sgd_host(s, r[0], w),
            Op::AdamW(a) => adamw_host(a, r[0], w),
            Op::BatchNormStats { n, c, s } => norm_attn::bn_stats_host((*n, *c, *s), r, w),
            Op::BatchNormForward { n, c, s, count, eps } => {
                norm_attn::bn_forward_host((*n, *c, *s), *count, *eps, r, w)
            }
            Op::BatchNormBackwardReduce { n, c, s } => {
                norm_attn::bn_reduce_host((*n, *c, *s), r, w)
            }
            Op::BatchNormBackwardDx { n, c, s, count } => {
                norm_attn::bn_dx_host((*n, *c, *s), *count, r, w)
            }
            Op::AttentionForward(shape) => norm_attn::attn_forward_host(*shape, r, w)?,
            Op::AttentionBackward(shape) => norm_attn::attn_backward_host(*shape, r, w)?,
            Op::Copy | Op::Add | Op::Mul | Op::ActivationSavingDerivative(_) => {
                elementwise::host(self, r, w)?
            }
            Op::AttentionForwardTokens(shape) => norm_attn::attn_tokens_forward_host(*shape, r, w)?,
            Op::AttentionBackwardTokens(shape) => {
                norm_attn::attn_tokens_backward_host(*shape, r, w)?
            }
            Op::SoftmaxCrossEntropy { classes, global } => {
                elementwise::softmax_xent_host(*classes, *global, r, w)?
            }
            _ => cnn::host(self, r, w)?,
        }
        Ok(())
    }
}

/// `torch.optim.SGD`, element by element as `sgd_f32` of the CUDA kernels.
fn sgd_host(s: &SgdStep, g: &[f32], w: &mut [&mut [f32]]) {
    let [p, buf] = w else { unreachable!("checked: two writes") };
    let first = s.step <= 1;
    for i in 0..p.len() {
        let mut d = g[i];
        if s.weight_decay != 0.0 {
            d += s.weight_decay * p[i];
        }
        if s.momentum != 0.0 {
            let b = if first { d } else { s.momentum * buf[i] + (1.0 - s.dampening) * d };
            buf[i] = b;
            d = if s.nesterov { d + s.momentum * b } else { b };
        }
        p[i] -= s.lr * d;
    }
}

/// `torch.optim.AdamW`, element by element as `adamw_f32` of the CUDA kernels.
fn adamw_host(a: &AdamWStep, g: &[f32], w: &mut [&mut [f32]]) {
    let [p, st] = w else { unreachable!("checked: two writes") };
    let (step_size, bc2_sqrt, decay) = a.scalars();
    for i in 0..p.len() {
        let gi = g[i];
        p[i] *= decay;
        let mut m = st[2 * i];
        m += (gi - m) * (1.0 - a.beta1);
        st[2 * i] = m;
        let v = st[2 * i + 1] * a.beta2 + (1.0 - a.beta2) * gi * gi;
        st[2 * i + 1] = v;
        let denom = v.sqrt() / bc2_sqrt + a.eps;
        p[i] -= step_size * (m / denom);
    }
}

impl DeviceOp for Op {
    fn name(&self) -> String {
        self.label().to_string()
    }

    fn check(&self, reads: &[usize], writes: &[usize]) -> Result<(), String> {
        self.check_lens(reads, writes)
    }

    fn run_host(&self, r: &[&[f32]], w: &mut [&mut [f32]]) -> Result<(), DeviceError> {
        self.host(r, w).map_err(|e| DeviceError::Invalid(format!("{}: {e}", self.label())))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
