//! The built-in layers as [`Module`]s: the zoo's layers (linear, convolution, BatchNorm,
//! ReLU, pooling, flatten) and the transformer layers over the kernels of [`crate::nn`]
//! (embedding, LayerNorm, RMSNorm, GELU/SiLU, dropout, causal self-attention).
//!
//! Token streams are `[batch, seq, dim]` (or any leading shape): row-wise layers work on the
//! rows, whatever the leading dimensions.

use super::{unsave, Buffers, Grads, Init, Module, Param, Params, Saved};
use crate::batchnorm::{BatchNorm, BnSaved};
use crate::conv::{Conv2d, ConvSaved};
use crate::error::ModelError;
use crate::layers::{self, LinearSaved, MaxPool2d, MaxPoolSaved, ReluSaved, ShapeSaved};
use crate::lower::{Buf, Lowering, Val};
use crate::model::Ctx;
use crate::nn::attention::{
    attention_backward_tokens, attention_forward_tokens, AttnSaved, AttnShape,
};
use crate::nn::attn_dropout::AttnDropout;
use crate::nn::dropout::DropoutKey;
use crate::nn::{self, LayerNormSaved, RmsNormSaved};
use crate::ops::Op;
use crate::tensor::Tensor;

pub use crate::nn::Activation;

/// Query and key block of the attention kernel's online softmax.
const ATTN_BLOCK: usize = 64;

/// `[.., last]` as `[rows, last]`.
fn rows_of(shape: &[usize], last: usize, what: &str) -> Result<usize, ModelError> {
    match shape.last() {
        Some(&l) if l == last => Ok(shape[..shape.len() - 1].iter().product()),
        _ => Err(ModelError::shape(what, format!("[.., {last}]"), format!("{shape:?}"))),
    }
}

fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    if let Some(l) = s.last_mut() {
        *l = last;
    }
    s
}

/// A fully connected layer over the last dimension, with torch's layout (`weight [out, in]`,
/// `bias [out]`) and a chosen initialisation (torch's default: uniform `1/sqrt(in)`).
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    /// Sizes and bias.
    pub layer: layers::Linear,
    /// How `weight` starts.
    pub weight_init: Init,
    /// How `bias` starts.
    pub bias_init: Init,
}

impl Linear {
    /// `in -> out`, with a bias when `bias`, torch's default initialisation.
    pub fn new(in_features: usize, out_features: usize, bias: bool) -> Self {
        let b = 1.0 / (in_features.max(1) as f32).sqrt();
        Linear {
            layer: layers::Linear { in_features, out_features, bias },
            weight_init: Init::Uniform(b),
            bias_init: Init::Uniform(b),
        }
    }

    /// The same layer started from `weight` and `bias`.
    pub fn with_init(mut self, weight: Init, bias: Init) -> Self {
        self.weight_init = weight;
        self.bias_init = bias;
        self
    }
}

impl Module for Linear {
    fn params(&self) -> Vec<Param> {
        let l = &self.layer;
        let mut v =
            vec![Param::new("weight", vec![l.out_features, l.in_features], self.weight_init)];
        if l.bias {
            v.push(Param::new("bias", vec![l.out_features], self.bias_init));
        }
        v
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let l = &self.layer;
        let shape = x.shape().to_vec();
        let n = rows_of(&shape, l.in_features, "linear input")?;
        let x = x.reshape(vec![n, l.in_features])?;
        let (y, s) = l.forward(ctx.backend, p.f32()?, x)?;
        Ok((y.reshape(with_last(&shape, l.out_features))?, Box::new((s, shape))))
    }

    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let l = &self.layer;
        let (s, shape): (LinearSaved, Vec<usize>) = unsave(saved, "Linear")?;
        let n = rows_of(dy.shape(), l.out_features, "linear grad_output")?;
        let dy = dy.reshape(vec![n, l.out_features])?;
        let dx = l.backward_taking(ctx.backend, p.f32()?, s, &dy, g.f32_mut()?)?;
        dx.reshape(shape)
    }

    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        let lay = &self.layer;
        rows_of(&x.shape, lay.in_features, "linear input")?;
        let linear = nn::linear::Linear::new(lay.in_features, lay.out_features, lay.bias);
        let params = Buf::Params { at, len: linear.num_params() };
        let y = l.value(&with_last(&x.shape, lay.out_features));
        l.op(Op::LinearForward(linear), &[params, x.buf], &[y.buf]);
        l.on_backward(move |l, dy| {
            let dx = l.value(&x.shape);
            let grads = Buf::Grads { at, len: linear.num_params() };
            let op = Op::LinearBackward { linear, input_grad: true };
            l.op(op, &[params, x.buf, dy.buf], &[grads, dx.buf]);
            Ok(Some(dx))
        });
        Ok(y)
    }
}

impl Module for Conv2d {
    fn params(&self) -> Vec<Param> {
        let b = 1.0 / ((self.in_channels * self.kernel * self.kernel).max(1) as f32).sqrt();
        self.param_specs().into_iter().map(|s| Param { spec: s, init: Init::Uniform(b) }).collect()
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (y, s) = Conv2d::forward(self, ctx.backend, p.f32()?, x)?;
        Ok((y, Box::new(s)))
    }

    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let s: ConvSaved = unsave(saved, "Conv2d")?;
        Conv2d::backward(self, ctx.backend, p.f32()?, &s, &dy, g.f32_mut()?)
    }

    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        crate::lower::layers::conv2d(l, self, at, x)
    }
}

/// BatchNorm; SyncBatchNorm when the layer is `sync` or the context asks for it and a
/// reducer is present.
impl Module for BatchNorm {
    fn params(&self) -> Vec<Param> {
        let c = self.num_features;
        vec![Param::new("weight", vec![c], Init::Ones), Param::new("bias", vec![c], Init::Zeros)]
    }

    fn buffers(&self) -> Vec<Param> {
        let c = self.num_features;
        vec![
            Param::new("running_mean", vec![c], Init::Zeros),
            Param::new("running_var", vec![c], Init::Ones),
            Param::new("num_batches_tracked", vec![], Init::Zeros),
        ]
    }

    fn forward(
        &self,
        p: Params<'_>,
        mut b: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        // The kernel reduces only a layer marked `sync`: `ctx.sync_bn` marks this call's.
        let layer = BatchNorm { sync: self.sync || ctx.sync_bn, ..self.clone() };
        let reducer = if layer.sync { ctx.reducer } else { None };
        let (y, s) = layer.forward(p.f32()?, b.f32_mut()?, x, ctx.training, reducer)?;
        Ok((y, Box::new(s)))
    }

    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let layer = BatchNorm { sync: self.sync || ctx.sync_bn, ..self.clone() };
        let reducer = if layer.sync { ctx.reducer } else { None };
        let s: BnSaved = unsave(saved, "BatchNorm")?;
        layer.backward(p.f32()?, &s, &dy, g.f32_mut()?, reducer)
    }

    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        let buffers = l.buffers_at();
        crate::lower::layers::batchnorm(l, self, (at, buffers), x)
    }
}

/// `max(x, 0)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Relu;

impl Module for Relu {
    fn params(&self) -> Vec<Param> {
        Vec::new()
    }
    fn forward(
        &self,
        _: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (y, s) = layers::relu_forward(ctx.backend, x)?;
        Ok((y, Box::new(s)))
    }
    fn backward(
        &self,
        _: Params<'_>,
        saved: Saved,
        dy: Tensor,
        _: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let s: ReluSaved = unsave(saved, "Relu")?;
        layers::relu_backward(ctx.backend, &s, dy)
    }

    fn lower(&self, l: &mut Lowering, _: usize, x: Val) -> Result<Val, ModelError> {
        let y = l.value(&x.shape);
        l.op(Op::Relu, &[x.buf], &[y.buf]);
        let y2 = y.clone();
        l.on_backward(move |l, dy| {
            let dx = l.value(&dy.shape);
            l.op(Op::ReluBackward, &[y2.buf, dy.buf], &[dx.buf]);
            Ok(Some(dx))
        });
        Ok(y)
    }
}

impl Module for MaxPool2d {
    fn params(&self) -> Vec<Param> {
        Vec::new()
    }
    fn forward(
        &self,
        _: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        _: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (y, s) = MaxPool2d::forward(self, x)?;
        Ok((y, Box::new(s)))
    }
    fn backward(
        &self,
        _: Params<'_>,
        saved: Saved,
        dy: Tensor,
        _: Grads<'_>,
        _: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let s: MaxPoolSaved = unsave(saved, "MaxPool2d")?;
        MaxPool2d::backward(self, &s, &dy)
    }

    fn lower(&self, l: &mut Lowering, _: usize, x: Val) -> Result<Val, ModelError> {
        crate::lower::layers::max_pool(l, self, x)
    }
}

/// `[N, C, H, W] -> [N, C]`, the mean of each plane.
#[derive(Clone, Copy, Debug, Default)]
pub struct GlobalAvgPool;

impl Module for GlobalAvgPool {
    fn params(&self) -> Vec<Param> {
        Vec::new()
    }
    fn forward(
        &self,
        _: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        _: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (y, s) = layers::global_avg_pool_forward(x)?;
        Ok((y, Box::new(s)))
    }
    fn backward(
        &self,
        _: Params<'_>,
        saved: Saved,
        dy: Tensor,
        _: Grads<'_>,
        _: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let s: ShapeSaved = unsave(saved, "GlobalAvgPool")?;
        layers::global_avg_pool_backward(&s, &dy)
    }

    fn lower(&self, l: &mut Lowering, _: usize, x: Val) -> Result<Val, ModelError> {
        crate::lower::layers::global_avg_pool(l, x)
    }
}

/// `[N, ...] -> [N, prod]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Flatten;

impl Module for Flatten {
    fn params(&self) -> Vec<Param> {
        Vec::new()
    }
    fn forward(
        &self,
        _: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        _: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (y, s) = layers::flatten_forward(x)?;
        Ok((y, Box::new(s)))
    }
    fn backward(
        &self,
        _: Params<'_>,
        saved: Saved,
        dy: Tensor,
        _: Grads<'_>,
        _: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let s: ShapeSaved = unsave(saved, "Flatten")?;
        layers::flatten_backward(&s, dy)
    }

    fn lower(&self, l: &mut Lowering, _: usize, x: Val) -> Result<Val, ModelError> {
        Ok(crate::lower::layers::flatten(l, x))
    }
}

impl Module for Activation {
    fn params(&self) -> Vec<Param> {
        Vec::new()
    }
    /// Saves `f'(x)`, written over the input's buffer: backward is then one multiply, with no
    /// second `erf` (the exact GELU) and no new buffer.
    fn forward(
        &self,
        _: Params<'_>,
        _: Buffers<'_>,
        mut x: Tensor,
        _: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let y = self.forward_saving_derivative_new(x.as_f32_mut()?)?;
        Ok((Tensor::new(x.shape().to_vec(), y)?, Box::new(x)))
    }
    fn backward(
        &self,
        _: Params<'_>,
        saved: Saved,
        mut dy: Tensor,
        _: Grads<'_>,
        _: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let d: Tensor = unsave(saved, "Activation")?;
        if d.shape() != dy.shape() {
            return Err(ModelError::shape(
                "activation grad_output",
                format!("{:?}", d.shape()),
                format!("{:?}", dy.shape()),
            ));
        }
        for (g, v) in dy.as_f32_mut()?.iter_mut().zip(d.as_f32()?) {
            *g *= v;
        }
        Ok(dy)
    }

    /// As the host forward: the derivative is saved, the backward one multiply.
    fn lower(&self, l: &mut Lowering, _: usize, x: Val) -> Result<Val, ModelError> {
        let (y, d) = (l.value(&x.shape), l.value(&x.shape));
        l.op(Op::ActivationSavingDerivative(*self), &[x.buf], &[y.buf, d.buf]);
        l.on_backward(move |l, dy| {
            let dx = l.value(&dy.shape);
            l.op(Op::Mul, &[dy.buf, d.buf], &[dx.buf]);
            Ok(Some(dx))
        });
        Ok(y)
    }
}

/// A token embedding: `u32` ids `[..]` to rows `[.., dim]` of `weight [vocab, dim]`;
/// the gradient is a scatter-add (EMB-2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Embedding {
    /// The table.
    pub table: nn::Embedding,
    /// How the table starts (torch's default: normal, std 1; nanoGPT's: std 0.02).
    pub init: Init,
}

impl Embedding {
    /// A `vocab x dim` table started from a normal of std `std`.
    pub fn new(vocab: usize, dim: usize, std: f32) -> Self {
        Embedding { table: nn::Embedding::new(vocab, dim), init: Init::Normal(std) }
    }
}

impl Module for Embedding {
    fn params(&self) -> Vec<Param> {
        vec![Param::new("weight", vec![self.table.vocab, self.table.dim], self.init)]
    }
    fn forward(
        &self,
        p: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        _: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let ids = x.as_u32()?;
        let mut y = vec![0.0f32; ids.len() * self.table.dim];
        self.table.forward(p.f32()?, ids, &mut y)?;
        let mut shape = x.shape().to_vec();
        shape.push(self.table.dim);
        Ok((Tensor::new(shape, y)?, Box::new(x)))
    }
    /// The ids get no gradient: an empty tensor.
    fn backward(
        &self,
        _: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        _: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let x: Tensor = unsave(saved, "Embedding")?;
        self.table.backward(x.as_u32()?, dy.as_f32()?, g.f32_mut()?)?;
        Ok(Tensor::default())
    }

    /// The ids get no gradient: nothing flows back past this module.
    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        let t = self.table;
        let mut shape = x.shape.clone();
        shape.push(t.dim);
        let y = l.value(&shape);
        l.op(Op::EmbeddingForward(t), &[Buf::Params { at, len: t.num_params() }, x.buf], &[y.buf]);
        l.on_backward(move |l, dy| {
            let grads = Buf::Grads { at, len: t.num_params() };
            l.op(Op::EmbeddingBackward(t), &[x.buf, dy.buf], &[grads]);
            Ok(None)
        });
        Ok(y)
    }
}

/// LayerNorm over the last dimension (with or without bias).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNorm(pub nn::LayerNorm<f32>);

impl LayerNorm {
    /// torch's `nn.LayerNorm(dim, bias=bias)` (eps `1e-5`).
    pub fn new(dim: usize, bias: bool) -> Self {
        LayerNorm(nn::LayerNorm { dim, eps: 1e-5, bias })
    }
}

impl Module for LayerNorm {
    fn params(&self) -> Vec<Param> {
        let d = self.0.dim;
        let mut v = vec![Param::new("weight", vec![d], Init::Ones)];
        if self.0.bias {
            v.push(Param::new("bias", vec![d], Init::Zeros));
        }
        v
    }
    fn forward(
        &self,
        p: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        _: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (y, s) = self.0.forward_new(p.f32()?, x.as_f32()?)?;
        Ok((Tensor::new(x.shape().to_vec(), y)?, Box::new((x, s))))
    }
    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        _: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let (x, s): (Tensor, LayerNormSaved<f32>) = unsave(saved, "LayerNorm")?;
        // The input gradient over `dy`'s values (copied first only if a clone shares them).
        let mut dx = dy;
        self.0.backward_in_place(p.f32()?, x.as_f32()?, &s, dx.as_f32_mut()?, g.f32_mut()?)?;
        dx.reshape(x.shape().to_vec())
    }

    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        let ln = self.0;
        let rows = rows_of(&x.shape, ln.dim, "layer norm input")?;
        let params = Buf::Params { at, len: ln.num_params() };
        let (y, mean, rstd) = (l.value(&x.shape), l.value(&[rows]), l.value(&[rows]));
        l.op(Op::LayerNormForward(ln), &[params, x.buf], &[y.buf, mean.buf, rstd.buf]);
        l.on_backward(move |l, dy| {
            let dx = l.value(&x.shape);
            let grads = Buf::Grads { at, len: ln.num_params() };
            let reads = [params, x.buf, mean.buf, rstd.buf, dy.buf];
            l.op(Op::LayerNormBackward(ln), &reads, &[dx.buf, grads]);
            Ok(Some(dx))
        });
        Ok(y)
    }
}

/// RMSNorm over the last dimension (a gain, no bias).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNorm(pub nn::RmsNorm<f32>);

impl RmsNorm {
    /// torch's `nn.RMSNorm(dim, eps)`.
    pub fn new(dim: usize, eps: f32) -> Self {
        let mut n = nn::RmsNorm::new(dim);
        n.eps = eps;
        RmsNorm(n)
    }
}

impl Module for RmsNorm {
    fn params(&self) -> Vec<Param> {
        vec![Param::new("weight", vec![self.0.dim], Init::Ones)]
    }
    fn forward(
        &self,
        p: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        _: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let mut y = vec![0.0f32; x.numel()];
        let s = self.0.forward(p.f32()?, x.as_f32()?, &mut y)?;
        Ok((Tensor::new(x.shape().to_vec(), y)?, Box::new((x, s))))
    }
    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        _: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let (x, s): (Tensor, RmsNormSaved<f32>) = unsave(saved, "RmsNorm")?;
        let mut dx = vec![0.0f32; x.numel()];
        self.0.backward(p.f32()?, x.as_f32()?, &s, dy.as_f32()?, &mut dx, g.f32_mut()?)?;
        Tensor::new(x.shape().to_vec(), dx)
    }
}

/// Inverted dropout whose mask is keyed by (seed, step, layer, global sample index, element)
/// (DROP-1), so that any world size and a resumed run draw the same masks. The input's
/// leading dimension is the sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// Drop probability.
    pub p: f64,
    /// The layer's index among the model's dropout layers (its own mask stream).
    pub layer: u64,
}

impl Dropout {
    fn kernel(&self, x: &Tensor) -> Result<nn::dropout::Dropout, ModelError> {
        let per_sample = x.shape().iter().skip(1).product();
        nn::dropout::Dropout::new(self.p, per_sample)
    }
    fn key(&self, ctx: &Ctx) -> DropoutKey {
        DropoutKey { seed: ctx.seed, step: ctx.step, layer: self.layer }
    }
}

impl Module for Dropout {
    fn params(&self) -> Vec<Param> {
        Vec::new()
    }
    fn forward(
        &self,
        _: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        if !ctx.training || self.p == 0.0 {
            return Ok((x, Box::new(())));
        }
        let mut y = vec![0.0f32; x.numel()];
        self.kernel(&x)?.forward(self.key(ctx), ctx.first_sample as u64, x.as_f32()?, &mut y)?;
        Ok((Tensor::new(x.shape().to_vec(), y)?, Box::new(())))
    }
    fn backward(
        &self,
        _: Params<'_>,
        _: Saved,
        dy: Tensor,
        _: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        if !ctx.training || self.p == 0.0 {
            return Ok(dy);
        }
        let mut dx = vec![0.0f32; dy.numel()];
        self.kernel(&dy)?.backward(
            self.key(ctx),
            ctx.first_sample as u64,
            dy.as_f32()?,
            &mut dx,
        )?;
        Tensor::new(dy.shape().to_vec(), dx)
    }

    /// The identity where the host forward is one (evaluation, `p = 0`); a dropping
    /// dropout is not lowered (LOWER-3).
    fn lower(&self, l: &mut Lowering, _: usize, x: Val) -> Result<Val, ModelError> {
        if l.training() && self.p != 0.0 {
            return Err(Lowering::unlowered("dropout while training"));
        }
        Ok(x)
    }
}

/// nanoGPT's `CausalSelfAttention` over `[batch, seq, n_embd]`: `c_attn` (fused q, k, v),
/// causal attention with a blocked online softmax that saves q, k, v, the output and one
/// logsumexp per row, never the `seq x seq` scores (ATTN-n), then `c_proj`. With
/// `attn_dropout`, the attention probabilities are dropped while training (nanoGPT's
/// `attn_dropout`), the mask keyed by the layer, the step and each probability's place
/// (ADROP-1).
#[derive(Clone, Debug, PartialEq)]
pub struct CausalSelfAttention {
    /// Heads.
    pub n_head: usize,
    /// `c_attn`: `n_embd -> 3 n_embd`.
    pub c_attn: Linear,
    /// `c_proj`: `n_embd -> n_embd`.
    pub c_proj: Linear,
    /// Dropout of the attention probabilities (`None`: none).
    pub attn_dropout: Option<Dropout>,
}

impl CausalSelfAttention {
    /// `n_head` heads over `n_embd` (a multiple of `n_head`), biases when `bias`, torch's
    /// default initialisation.
    pub fn new(n_embd: usize, n_head: usize, bias: bool) -> Result<Self, ModelError> {
        if n_head == 0 || !n_embd.is_multiple_of(n_head) {
            return Err(ModelError::Config(format!(
                "attention: n_embd {n_embd} is not a multiple of n_head {n_head}"
            )));
        }
        Ok(CausalSelfAttention {
            n_head,
            c_attn: Linear::new(n_embd, 3 * n_embd, bias),
            c_proj: Linear::new(n_embd, n_embd, bias),
            attn_dropout: None,
        })
    }

    /// The same layer dropping its attention probabilities with `dropout` while training.
    pub fn with_attn_dropout(mut self, dropout: Dropout) -> Self {
        self.attn_dropout = Some(dropout);
        self
    }

    /// The kernel's dropout in this call: none outside training or at `p = 0`.
    fn kernel_dropout(&self, ctx: &Ctx) -> Result<Option<AttnDropout>, ModelError> {
        match self.attn_dropout {
            Some(d) if ctx.training => AttnDropout::new(d.p, d.key(ctx), ctx.first_sample as u64),
            _ => Ok(None),
        }
    }

    fn embd(&self) -> usize {
        self.c_proj.layer.out_features
    }

    fn split(&self) -> usize {
        super::numel(&self.c_attn.params())
    }
}

struct AttnModSaved {
    c_attn: Saved,
    attn: AttnSaved<f32>,
    /// The merged attention output: the values `c_proj` saved as its input (shared, not
    /// copied), which the attention backward reads (ATTN-1).
    y: Tensor,
    c_proj: Saved,
    shape: AttnShape,
}

impl Module for CausalSelfAttention {
    fn params(&self) -> Vec<Param> {
        let mut v: Vec<Param> =
            self.c_attn.params().into_iter().map(|p| p.prefixed("c_attn")).collect();
        v.extend(self.c_proj.params().into_iter().map(|p| p.prefixed("c_proj")));
        v
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let e = self.embd();
        let (batch, seq) = match x.shape() {
            &[b, t, c] if c == e => (b, t),
            s => {
                return Err(ModelError::shape(
                    "attention input",
                    format!("[B, T, {e}]"),
                    format!("{s:?}"),
                ))
            }
        };
        let shape = AttnShape { batch, heads: self.n_head, seq, head_dim: e / self.n_head };
        let k = self.split();
        let (qkv, c_attn) = self.c_attn.forward(p.slice(0..k)?, Buffers::none(), x, ctx)?;
        // q, k, v are read in place from c_attn's output and the heads are written merged
        // (ATTN-5): no split or merge copies.
        let mut y = vec![0.0f32; shape.numel()];
        let attn = attention_forward_tokens(
            shape,
            ATTN_BLOCK.min(seq.max(1)),
            self.kernel_dropout(ctx)?,
            qkv.into_f32()?,
            &mut y,
        )?;
        let y = Tensor::new(vec![batch, seq, e], y)?;
        let (out, c_proj) =
            self.c_proj.forward(p.slice(k..p.len())?, Buffers::none(), y.clone(), ctx)?;
        Ok((out, Box::new(AttnModSaved { c_attn, attn, y, c_proj, shape })))
    }

    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let s: AttnModSaved = unsave(saved, "CausalSelfAttention")?;
        let (k, n) = (self.split(), p.len());
        let dyh = self.c_proj.backward(p.slice(k..n)?, s.c_proj, dy, g.slice(k..n)?, ctx)?;
        let dqkv = attention_backward_tokens(&s.attn, s.y.as_f32()?, dyh.as_f32()?)?;
        let e = self.embd();
        let dqkv = Tensor::new(vec![s.shape.batch, s.shape.seq, 3 * e], dqkv)?;
        self.c_attn.backward(p.slice(0..k)?, s.c_attn, dqkv, g.slice(0..k)?, ctx)
    }

    /// The host route: `c_attn`, the attention on the token layout, `c_proj`.
    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        if l.training() && self.attn_dropout.is_some_and(|d| d.p != 0.0) {
            return Err(Lowering::unlowered("attention dropout while training"));
        }
        let e = self.embd();
        let (batch, seq) = match x.shape[..] {
            [b, t, c] if c == e => (b, t),
            _ => {
                let got = format!("{:?}", x.shape);
                return Err(ModelError::shape("attention input", format!("[B, T, {e}]"), got));
            }
        };
        let shape = AttnShape { batch, heads: self.n_head, seq, head_dim: e / self.n_head };
        let qkv = self.c_attn.lower(l, at, x)?;
        let (y, lse) = (l.value(&[batch, seq, e]), l.value(&[shape.rows()]));
        l.op(Op::AttentionForwardTokens(shape), &[qkv.buf], &[y.buf, lse.buf]);
        let y2 = y.clone();
        l.on_backward(move |l, dy| {
            let dqkv = l.value(&qkv.shape);
            let reads = [qkv.buf, y2.buf, lse.buf, dy.buf];
            l.op(Op::AttentionBackwardTokens(shape), &reads, &[dqkv.buf]);
            Ok(Some(dqkv))
        });
        self.c_proj.lower(l, at + self.split(), y)
    }
}
