//! A nanoGPT decoder (Karpathy's `model.py`) built from the kernels of this module, as a pure
//! forward and backward over one flat parameter buffer, generic over the float type.
//!
//! The model: `x = wte[tokens] + wpe[0..seq]`; per block `x = x + attn(ln_1(x))`, then
//! `x = x + mlp(ln_2(x))` with `mlp = c_proj(gelu(c_fc(x)))` (exact, erf GELU) and `attn` the
//! causal self-attention of [`super::attention`] over `c_attn`'s fused q, k, v and followed by
//! `c_proj`; then `logits = ln_f(x) wte^T`: the output projection is the token embedding
//! (nanoGPT's `lm_head.weight = transformer.wte.weight`), so `lm_head` has no parameter of its
//! own. No dropout (nanoGPT's `dropout = 0.0`).
//!
//! Parameters are one flat buffer in nanoGPT's `named_parameters()` order, each tensor
//! row-major with torch's shape ([`GptConfig::param_specs`]); [`GptConfig::flatten`] builds
//! it from tensors looked up by name and [`GptConfig::named`] splits a buffer (parameters or
//! gradients) back into named views. [`GptConfig::forward`] returns the logits and what
//! [`GptConfig::backward`] needs; backward takes the same parameters and the gradient of the
//! logits and returns the gradient of every parameter, in the same layout.
//! [`GptConfig::loss_and_grads`] adds the token-level cross-entropy of
//! [`super::cross_entropy`].
//!
//! The matrix products are the [`super::linear`] and attention kernels' [`Gemm`] calls, so
//! `T` is a float type with [`Erf`] and [`Gemm`]: `f32` and `f64`.
//!
//! Invariants:
//! - `GPT-1`: the parameters are nanoGPT's, by name, shape and order:
//!   `transformer.wte.weight [vocab, embd]`, `transformer.wpe.weight [block, embd]`, per
//!   block `i` `transformer.h.{i}.` `ln_1.weight`, `ln_1.bias`, `attn.c_attn.weight
//!   [3 embd, embd]`, `attn.c_attn.bias`, `attn.c_proj.weight [embd, embd]`,
//!   `attn.c_proj.bias`, `ln_2.weight`, `ln_2.bias`, `mlp.c_fc.weight [4 embd, embd]`,
//!   `mlp.c_fc.bias`, `mlp.c_proj.weight [embd, 4 embd]`, `mlp.c_proj.bias`, then
//!   `transformer.ln_f.weight`, `transformer.ln_f.bias`; with `bias = false` every `.bias`
//!   is absent. There is no `lm_head.weight` (tied).
//! - `GPT-2`: the gradient of `transformer.wte.weight` sums both of its uses: the
//!   embedding's scatter-add of the input gradient and the output projection's
//!   `dlogits^T ln_f(x)`.
//! - `GPT-3`: [`GptConfig::backward`] is the exact derivative of [`GptConfig::forward`]:
//!   every parameter's gradient agrees with `f64` central finite differences (NN-1), with
//!   and without biases, for sequences shorter than `block_size`.
//! - `GPT-4`: forward, backward and AdamW steps agree with PyTorch's float64 computation of
//!   the same model from the same float32 weights (the reference vectors, read by
//!   `models/tests/gpt_vectors.rs`): in `f64` to `1e-9`, in `f32` within ten times the
//!   error of torch's own float32 run.
//! - `GPT-5`: every token row has the same length `seq`, `1 <= seq <= block_size`, and
//!   position `t` of a row uses `wpe` row `t`: the rows of `wpe` at and above `seq` get a
//!   zero gradient. A ragged batch or a sequence longer than `block_size` is a
//!   [`ModelError::Shape`]; a token id `>= vocab_size` is [`ModelError::OutOfRange`] (EMB-3).
//! - `GPT-6`: a configuration nanoGPT's model would not compute the same way is refused
//!   with a [`ModelError::Config`] naming the field: `gelu` other than `"erf"`,
//!   `tied_lm_head` false, a zero size, `n_embd` not a multiple of `n_head`, a
//!   `layernorm_eps` that is not positive, a `dropout` outside `[0, 1)`. This decoder
//!   computes no dropout: its [`GptConfig::forward`] refuses a `dropout` other than 0 (the
//!   module model, [`crate::module::gpt`], applies it).

use std::ops::Range;

use num_traits::Float;
use serde::{Deserialize, Serialize};

use super::activation::{Activation, Erf};
use super::attention::{attention_backward_tokens, attention_forward_tokens, AttnSaved, AttnShape};
use super::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use super::embedding::Embedding;
use super::exp::RowExp;
use super::gemm::Gemm;
use super::linear::Linear;
use super::lit;
use super::norm::{LayerNorm, LayerNormSaved};
use crate::error::ModelError;
use crate::layers::check_len;
use crate::spec::ParamSpec;

/// Query and key block of the attention kernel's online softmax.
const ATTN_BLOCK: usize = 64;

/// nanoGPT's `GPTConfig`, as the reference vectors' `config.json` `"model"` object holds it.
///
/// Deserializing checks the fields that describe how the model computes but that this
/// decoder has no choice about (`gelu`, `tied_lm_head`; absent means nanoGPT's default) and
/// the sizes, and refuses what it cannot compute (GPT-6).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawGptConfig")]
pub struct GptConfig {
    /// Tokens in the vocabulary (rows of `wte`).
    pub vocab_size: usize,
    /// Longest sequence (rows of `wpe`).
    pub block_size: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Embedding width.
    pub n_embd: usize,
    /// Whether the Linear and LayerNorm kernels have biases.
    pub bias: bool,
    /// LayerNorm's `eps` (torch's default `1e-5`).
    pub layernorm_eps: f64,
    /// nanoGPT's `dropout`: the drop probability of the embeddings' and each block's two
    /// residual-branch outputs while training (0: none). Absent in older configurations,
    /// meaning 0.
    #[serde(default)]
    pub dropout: f64,
}

fn default_bias() -> bool {
    true
}

fn default_eps() -> f64 {
    1e-5
}

/// The `"model"` object as written, before [`GptConfig`]'s checks.
#[derive(Deserialize)]
struct RawGptConfig {
    vocab_size: usize,
    block_size: usize,
    n_layer: usize,
    n_head: usize,
    n_embd: usize,
    #[serde(default = "default_bias")]
    bias: bool,
    #[serde(default = "default_eps")]
    layernorm_eps: f64,
    #[serde(default)]
    gelu: Option<String>,
    #[serde(default)]
    dropout: Option<f64>,
    #[serde(default)]
    tied_lm_head: Option<bool>,
}

impl TryFrom<RawGptConfig> for GptConfig {
    type Error = ModelError;

    fn try_from(raw: RawGptConfig) -> Result<Self, ModelError> {
        if let Some(g) = raw.gelu.as_deref().filter(|g| *g != "erf") {
            return Err(ModelError::Config(format!(
                "gpt: gelu \"{g}\" is not supported; the decoder computes the exact (\"erf\") GELU"
            )));
        }
        if raw.tied_lm_head == Some(false) {
            return Err(ModelError::Config(
                "gpt: tied_lm_head false is not supported; the output projection is transformer.wte.weight"
                    .into(),
            ));
        }
        let cfg = GptConfig {
            vocab_size: raw.vocab_size,
            block_size: raw.block_size,
            n_layer: raw.n_layer,
            n_head: raw.n_head,
            n_embd: raw.n_embd,
            bias: raw.bias,
            layernorm_eps: raw.layernorm_eps,
            dropout: raw.dropout.unwrap_or(0.0),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Where one block's kernels' parameters lie in the flat buffer.
#[derive(Clone, Debug)]
struct BlockRanges {
    ln_1: Range<usize>,
    c_attn: Range<usize>,
    attn_proj: Range<usize>,
    ln_2: Range<usize>,
    c_fc: Range<usize>,
    mlp_proj: Range<usize>,
}

/// Where every kernel's parameters lie in the flat buffer (GPT-1 order).
#[derive(Clone, Debug)]
struct Ranges {
    wte: Range<usize>,
    wpe: Range<usize>,
    blocks: Vec<BlockRanges>,
    ln_f: Range<usize>,
    total: usize,
}

/// The kernels of the model, with their sizes.
struct Kernels<T> {
    ln: LayerNorm<T>,
    c_attn: Linear,
    attn_proj: Linear,
    c_fc: Linear,
    mlp_proj: Linear,
    head: Linear,
    wte: Embedding,
}

/// What one block's backward needs from its forward.
#[derive(Clone, Debug)]
struct BlockSaved<T> {
    /// The block's input (the residual stream).
    x: Vec<T>,
    ln_1: LayerNormSaved<T>,
    /// `ln_1(x)`, the input of `c_attn`.
    h1: Vec<T>,
    attn: AttnSaved<T>,
    /// The heads merged, the input of `attn.c_proj`.
    y: Vec<T>,
    /// `x + attn(ln_1(x))`.
    x_mid: Vec<T>,
    ln_2: LayerNormSaved<T>,
    /// `ln_2(x_mid)`, the input of `c_fc`.
    h2: Vec<T>,
    /// `c_fc(h2)`, the input of the GELU.
    u: Vec<T>,
    /// `gelu(u)`, the input of `mlp.c_proj`.
    a: Vec<T>,
}

/// What [`GptConfig::backward`] needs from [`GptConfig::forward`]: the tokens and, per block,
/// the inputs of its kernels and their saved statistics.
#[derive(Clone, Debug)]
pub struct GptSaved<T> {
    batch: usize,
    seq: usize,
    tokens: Vec<u32>,
    blocks: Vec<BlockSaved<T>>,
    /// The input of `ln_f`.
    x_final: Vec<T>,
    ln_f: LayerNormSaved<T>,
    /// `ln_f(x_final)`, the input of the output projection.
    h_final: Vec<T>,
}

impl<T> GptSaved<T> {
    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per sequence.
    pub fn seq(&self) -> usize {
        self.seq
    }
}

fn add_into<T: Float>(acc: &mut [T], x: &[T]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a = *a + b;
    }
}

fn sum<T: Float>(a: &[T], b: &[T]) -> Vec<T> {
    a.iter().zip(b).map(|(&x, &y)| x + y).collect()
}

impl GptConfig {
    /// Checks the sizes (GPT-6).
    pub fn validate(&self) -> Result<(), ModelError> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("block_size", self.block_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
        ] {
            if v == 0 {
                return Err(ModelError::Config(format!("gpt: {name} must be positive")));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(ModelError::Config(format!(
                "gpt: n_embd {} is not a multiple of n_head {}",
                self.n_embd, self.n_head
            )));
        }
        if !(self.layernorm_eps > 0.0 && self.layernorm_eps.is_finite()) {
            return Err(ModelError::Config(format!(
                "gpt: layernorm_eps {} must be positive",
                self.layernorm_eps
            )));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ModelError::Config(format!(
                "gpt: dropout {} must be in [0, 1)",
                self.dropout
            )));
        }
        Ok(())
    }

    fn kernels<T: Float>(&self) -> Kernels<T> {
        let (e, b) = (self.n_embd, self.bias);
        Kernels {
            ln: LayerNorm { dim: e, eps: lit(self.layernorm_eps), bias: b },
            c_attn: Linear::new(e, 3 * e, b),
            attn_proj: Linear::new(e, e, b),
            c_fc: Linear::new(e, 4 * e, b),
            mlp_proj: Linear::new(4 * e, e, b),
            head: Linear::new(e, self.vocab_size, false),
            wte: Embedding::new(self.vocab_size, e),
        }
    }

    fn ranges(&self) -> Ranges {
        let k = self.kernels::<f64>();
        let mut at = 0;
        let mut take = |n: usize| {
            at += n;
            at - n..at
        };
        let wte = take(self.vocab_size * self.n_embd);
        let wpe = take(self.block_size * self.n_embd);
        let blocks = (0..self.n_layer)
            .map(|_| BlockRanges {
                ln_1: take(k.ln.num_params()),
                c_attn: take(k.c_attn.num_params()),
                attn_proj: take(k.attn_proj.num_params()),
                ln_2: take(k.ln.num_params()),
                c_fc: take(k.c_fc.num_params()),
                mlp_proj: take(k.mlp_proj.num_params()),
            })
            .collect();
        let ln_f = take(k.ln.num_params());
        Ranges { wte, wpe, blocks, ln_f, total: at }
    }

    /// Every parameter with nanoGPT's name and shape, in nanoGPT's order (GPT-1).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let k = self.kernels::<f64>();
        let prefixed = |prefix: &str, specs: Vec<ParamSpec>| -> Vec<ParamSpec> {
            specs
                .into_iter()
                .map(|p| ParamSpec { name: format!("{prefix}.{}", p.name), shape: p.shape })
                .collect()
        };
        let mut v = Vec::new();
        v.extend(prefixed("transformer.wte", k.wte.param_specs()));
        v.extend(prefixed(
            "transformer.wpe",
            Embedding::new(self.block_size, self.n_embd).param_specs(),
        ));
        for i in 0..self.n_layer {
            let p = format!("transformer.h.{i}");
            v.extend(prefixed(&format!("{p}.ln_1"), k.ln.param_specs()));
            v.extend(prefixed(&format!("{p}.attn.c_attn"), k.c_attn.param_specs()));
            v.extend(prefixed(&format!("{p}.attn.c_proj"), k.attn_proj.param_specs()));
            v.extend(prefixed(&format!("{p}.ln_2"), k.ln.param_specs()));
            v.extend(prefixed(&format!("{p}.mlp.c_fc"), k.c_fc.param_specs()));
            v.extend(prefixed(&format!("{p}.mlp.c_proj"), k.mlp_proj.param_specs()));
        }
        v.extend(prefixed("transformer.ln_f", k.ln.param_specs()));
        v
    }

    /// Values in the flat parameter buffer.
    pub fn num_params(&self) -> usize {
        self.ranges().total
    }

    /// The flat parameter buffer from tensors looked up by nanoGPT's names (`get` returns a
    /// row-major tensor, or `None` when there is none of that name).
    pub fn flatten<'a, T: Copy + 'a>(
        &self,
        mut get: impl FnMut(&str) -> Option<&'a [T]>,
    ) -> Result<Vec<T>, ModelError> {
        let mut flat = Vec::with_capacity(self.num_params());
        for spec in self.param_specs() {
            let t = get(&spec.name)
                .ok_or_else(|| ModelError::Config(format!("gpt: no tensor {}", spec.name)))?;
            check_len(&spec.name, t.len(), spec.numel())?;
            flat.extend_from_slice(t);
        }
        Ok(flat)
    }

    /// A flat buffer (parameters or gradients) split into named views, in GPT-1 order.
    pub fn named<'a, T>(&self, flat: &'a [T]) -> Result<Vec<(ParamSpec, &'a [T])>, ModelError> {
        check_len("gpt params", flat.len(), self.num_params())?;
        let mut rest = flat;
        let mut out = Vec::new();
        for spec in self.param_specs() {
            let (head, tail) = rest.split_at(spec.numel());
            out.push((spec, head));
            rest = tail;
        }
        Ok(out)
    }

    /// The token rows as one `[batch * seq]` list, checked (GPT-5).
    fn tokens<S: AsRef<[u32]>>(
        &self,
        tokens: &[S],
    ) -> Result<(usize, usize, Vec<u32>), ModelError> {
        let batch = tokens.len();
        let seq = tokens.first().map_or(0, |r| r.as_ref().len());
        if batch == 0 || seq == 0 || seq > self.block_size {
            return Err(ModelError::shape(
                "gpt tokens",
                format!("[batch >= 1][1..={}]", self.block_size),
                format!("[{batch}][{seq}]"),
            ));
        }
        if let Some(r) = tokens.iter().position(|r| r.as_ref().len() != seq) {
            return Err(ModelError::shape(
                "gpt tokens",
                format!("every row of {seq} tokens"),
                format!("row {r} of {}", tokens[r].as_ref().len()),
            ));
        }
        let flat = tokens.iter().flat_map(|r| r.as_ref().iter().copied()).collect();
        Ok((batch, seq, flat))
    }

    fn attn_shape(&self, batch: usize, seq: usize) -> AttnShape {
        AttnShape { batch, heads: self.n_head, seq, head_dim: self.n_embd / self.n_head }
    }

    /// The logits `[batch, seq, vocab]` of `tokens [batch][seq]` under `params` (the flat
    /// buffer, GPT-1), and what [`GptConfig::backward`] needs.
    pub fn forward<T: Erf + Gemm + RowExp + Default, S: AsRef<[u32]>>(
        &self,
        params: &[T],
        tokens: &[S],
    ) -> Result<(Vec<T>, GptSaved<T>), ModelError> {
        self.validate()?;
        if self.dropout != 0.0 {
            return Err(ModelError::Config(format!(
                "gpt: dropout {}: this decoder computes none (GPT-6); train the module model",
                self.dropout
            )));
        }
        let r = self.ranges();
        check_len("gpt params", params.len(), r.total)?;
        let (batch, seq, ids) = self.tokens(tokens)?;
        let k = self.kernels::<T>();
        let (e, rows) = (self.n_embd, batch * seq);
        let shape = self.attn_shape(batch, seq);

        let mut x = vec![T::zero(); rows * e];
        k.wte.forward(&params[r.wte.clone()], &ids, &mut x)?;
        let wpe = &params[r.wpe.clone()];
        for (i, row) in x.chunks_exact_mut(e).enumerate() {
            let t = i % seq;
            add_into(row, &wpe[t * e..(t + 1) * e]);
        }

        let mut blocks = Vec::with_capacity(self.n_layer);
        for br in &r.blocks {
            let mut h1 = vec![T::zero(); rows * e];
            let ln_1 = k.ln.forward(&params[br.ln_1.clone()], &x, &mut h1)?;
            let mut qkv = vec![T::zero(); rows * 3 * e];
            k.c_attn.forward(&params[br.c_attn.clone()], &h1, &mut qkv)?;
            // The route the `gpt` module trains with: q, k, v in place, heads merged (ATTN-5).
            let mut y = vec![T::zero(); rows * e];
            let attn = attention_forward_tokens(shape, ATTN_BLOCK.min(seq), None, qkv, &mut y)?;
            let mut ao = vec![T::zero(); rows * e];
            k.attn_proj.forward(&params[br.attn_proj.clone()], &y, &mut ao)?;
            let x_mid = sum(&x, &ao);

            let mut h2 = vec![T::zero(); rows * e];
            let ln_2 = k.ln.forward(&params[br.ln_2.clone()], &x_mid, &mut h2)?;
            let mut u = vec![T::zero(); rows * 4 * e];
            k.c_fc.forward(&params[br.c_fc.clone()], &h2, &mut u)?;
            let mut a = vec![T::zero(); rows * 4 * e];
            Activation::Gelu.forward(&u, &mut a)?;
            let mut m = vec![T::zero(); rows * e];
            k.mlp_proj.forward(&params[br.mlp_proj.clone()], &a, &mut m)?;
            let x_out = sum(&x_mid, &m);
            blocks.push(BlockSaved { x, ln_1, h1, attn, y, x_mid, ln_2, h2, u, a });
            x = x_out;
        }

        let mut h_final = vec![T::zero(); rows * e];
        let ln_f = k.ln.forward(&params[r.ln_f.clone()], &x, &mut h_final)?;
        let mut logits = vec![T::zero(); rows * self.vocab_size];
        // The tied output projection: lm_head.weight is wte.
        k.head.forward(&params[r.wte.clone()], &h_final, &mut logits)?;
        let saved = GptSaved { batch, seq, tokens: ids, blocks, x_final: x, ln_f, h_final };
        Ok((logits, saved))
    }

    /// The gradient of every parameter (the flat layout of `params`, GPT-1) from the
    /// gradient of the logits `[batch, seq, vocab]`; `params` are those `saved` came from.
    pub fn backward<T: Erf + Gemm + RowExp + Default>(
        &self,
        params: &[T],
        saved: &GptSaved<T>,
        dlogits: &[T],
    ) -> Result<Vec<T>, ModelError> {
        let r = self.ranges();
        check_len("gpt params", params.len(), r.total)?;
        check_len("gpt saved blocks", saved.blocks.len(), self.n_layer)?;
        let k = self.kernels::<T>();
        let (e, seq) = (self.n_embd, saved.seq);
        let rows = saved.batch * seq;
        check_len("gpt dlogits", dlogits.len(), rows * self.vocab_size)?;
        let mut grads = vec![T::zero(); r.total];

        // The output projection's share of wte's gradient (GPT-2).
        let mut dh = vec![T::zero(); rows * e];
        k.head.backward(
            &params[r.wte.clone()],
            &saved.h_final,
            dlogits,
            Some(&mut dh),
            &mut grads[r.wte.clone()],
        )?;
        let mut dx = vec![T::zero(); rows * e];
        k.ln.backward(
            &params[r.ln_f.clone()],
            &saved.x_final,
            &saved.ln_f,
            &dh,
            &mut dx,
            &mut grads[r.ln_f.clone()],
        )?;

        for (br, s) in r.blocks.iter().zip(&saved.blocks).rev() {
            // x_out = x_mid + mlp_proj(gelu(c_fc(ln_2(x_mid))))
            let mut da = vec![T::zero(); rows * 4 * e];
            let p = br.mlp_proj.clone();
            k.mlp_proj.backward(&params[p.clone()], &s.a, &dx, Some(&mut da), &mut grads[p])?;
            let mut du = vec![T::zero(); rows * 4 * e];
            Activation::Gelu.backward(&s.u, &da, &mut du)?;
            let mut dh2 = vec![T::zero(); rows * e];
            let p = br.c_fc.clone();
            k.c_fc.backward(&params[p.clone()], &s.h2, &du, Some(&mut dh2), &mut grads[p])?;
            let mut dx_ln = vec![T::zero(); rows * e];
            let p = br.ln_2.clone();
            k.ln.backward(&params[p.clone()], &s.x_mid, &s.ln_2, &dh2, &mut dx_ln, &mut grads[p])?;
            add_into(&mut dx, &dx_ln);

            // x_mid = x + attn_proj(attention(c_attn(ln_1(x)))), heads merged
            let mut dy = vec![T::zero(); rows * e];
            let p = br.attn_proj.clone();
            k.attn_proj.backward(&params[p.clone()], &s.y, &dx, Some(&mut dy), &mut grads[p])?;
            let dqkv = attention_backward_tokens(&s.attn, &s.y, &dy)?;
            let mut dh1 = vec![T::zero(); rows * e];
            let p = br.c_attn.clone();
            k.c_attn.backward(&params[p.clone()], &s.h1, &dqkv, Some(&mut dh1), &mut grads[p])?;
            let p = br.ln_1.clone();
            k.ln.backward(&params[p.clone()], &s.x, &s.ln_1, &dh1, &mut dx_ln, &mut grads[p])?;
            add_into(&mut dx, &dx_ln);
        }

        // The embedding's share of wte's gradient (GPT-2), and wpe's rows 0..seq (GPT-5).
        k.wte.backward(&saved.tokens, &dx, &mut grads[r.wte.clone()])?;
        let dwpe = &mut grads[r.wpe.clone()];
        for (i, row) in dx.chunks_exact(e).enumerate() {
            let t = i % seq;
            add_into(&mut dwpe[t * e..(t + 1) * e], row);
        }
        Ok(grads)
    }

    /// The mean token cross-entropy of the logits of `tokens` against `targets` (both
    /// `[batch][seq]`) and the gradient of every parameter.
    pub fn loss_and_grads<T: Erf + Gemm + RowExp + Default, S: AsRef<[u32]>>(
        &self,
        params: &[T],
        tokens: &[S],
        targets: &[S],
    ) -> Result<(T, Vec<T>), ModelError> {
        let (logits, saved) = self.forward(params, tokens)?;
        let (tb, ts, targets) = self.tokens(targets)?;
        if (tb, ts) != (saved.batch, saved.seq) {
            return Err(ModelError::shape(
                "gpt targets",
                format!("[{}][{}]", saved.batch, saved.seq),
                format!("[{tb}][{ts}]"),
            ));
        }
        let v = self.vocab_size;
        let ce = cross_entropy_forward(&logits, v, &targets)?;
        let mut dlogits = vec![T::zero(); logits.len()];
        cross_entropy_backward(&logits, v, &targets, &ce, T::one(), &mut dlogits)?;
        let grads = self.backward(params, &saved, &dlogits)?;
        Ok((ce.loss, grads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::{
        assert_f32_close, assert_grads, compare, numeric_grads, randn, to_f32, to_f64,
    };

    fn config(bias: bool, n_layer: usize) -> GptConfig {
        GptConfig {
            vocab_size: 5,
            block_size: 4,
            n_layer,
            n_head: 2,
            n_embd: 4,
            bias,
            layernorm_eps: 1e-5,
            dropout: 0.0,
        }
    }

    /// Parameters of the scale the reference vectors use: matrices N(0, 0.4), biases
    /// N(0, 0.1), LayerNorm gains 1 + N(0, 0.1).
    fn params(cfg: &GptConfig, seed: u64) -> Vec<f64> {
        let mut out = Vec::new();
        for (i, spec) in cfg.param_specs().into_iter().enumerate() {
            let z = randn(spec.numel(), seed + i as u64);
            let ln = spec.name.contains(".ln_");
            out.extend(z.iter().map(|v| match (ln, spec.shape.len()) {
                (true, _) if spec.name.ends_with("weight") => 1.0 + 0.1 * v,
                (_, 1) => 0.1 * v,
                _ => 0.4 * v,
            }));
        }
        out
    }

    const TOKENS: [[u32; 3]; 2] = [[4, 1, 4], [0, 2, 1]];

    #[test]
    fn names_shapes_and_order_are_nanogpts_gpt_1() {
        let cfg = config(true, 2);
        let specs = cfg.param_specs();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        let mut want = vec!["transformer.wte.weight", "transformer.wpe.weight"];
        let block = [
            "ln_1.weight",
            "ln_1.bias",
            "attn.c_attn.weight",
            "attn.c_attn.bias",
            "attn.c_proj.weight",
            "attn.c_proj.bias",
            "ln_2.weight",
            "ln_2.bias",
            "mlp.c_fc.weight",
            "mlp.c_fc.bias",
            "mlp.c_proj.weight",
            "mlp.c_proj.bias",
        ];
        let per_block: Vec<String> = (0..2)
            .flat_map(|i| block.iter().map(move |b| format!("transformer.h.{i}.{b}")))
            .collect();
        want.extend(per_block.iter().map(String::as_str));
        want.extend(["transformer.ln_f.weight", "transformer.ln_f.bias"]);
        assert_eq!(names, want);
        let shape = |n: &str| specs.iter().find(|s| s.name == n).unwrap().shape.clone();
        assert_eq!(shape("transformer.wte.weight"), [5, 4]);
        assert_eq!(shape("transformer.wpe.weight"), [4, 4]);
        assert_eq!(shape("transformer.h.1.attn.c_attn.weight"), [12, 4]);
        assert_eq!(shape("transformer.h.1.attn.c_attn.bias"), [12]);
        assert_eq!(shape("transformer.h.0.attn.c_proj.weight"), [4, 4]);
        assert_eq!(shape("transformer.h.0.mlp.c_fc.weight"), [16, 4]);
        assert_eq!(shape("transformer.h.0.mlp.c_proj.weight"), [4, 16]);
        assert_eq!(shape("transformer.ln_f.bias"), [4]);
        assert_eq!(cfg.num_params(), specs.iter().map(ParamSpec::numel).sum::<usize>());

        // Without biases: the same list less every `.bias`.
        let nob = config(false, 2);
        let nob_names: Vec<String> = nob.param_specs().into_iter().map(|s| s.name).collect();
        let kept: Vec<&str> = want.iter().copied().filter(|n| !n.ends_with(".bias")).collect();
        assert_eq!(nob_names, kept);

        // flatten and named are inverse, by name.
        let flat = params(&cfg, 1);
        let named = cfg.named(&flat).unwrap();
        let again =
            cfg.flatten(|n| named.iter().find(|(s, _)| s.name == n).map(|(_, v)| *v)).unwrap();
        assert_eq!(again, flat);
        let missing = cfg.flatten(|n| {
            (n != "transformer.h.1.ln_2.bias")
                .then(|| named.iter().find(|(s, _)| s.name == n).map(|(_, v)| *v))
                .flatten()
        });
        assert!(
            matches!(&missing, Err(ModelError::Config(m)) if m.contains("transformer.h.1.ln_2.bias")),
            "{missing:?}"
        );
    }

    fn check_gradients(cfg: &GptConfig, tokens: &[&[u32]], seed: u64) {
        let p = params(cfg, seed);
        let (logits, saved) = cfg.forward(&p, tokens).unwrap();
        let r = randn(logits.len(), seed + 1000);
        let grads = cfg.backward(&p, &saved, &r).unwrap();
        let f = |a: &[Vec<f64>]| cfg.forward(&a[0], tokens).unwrap().0;
        assert_grads(&["params"], &[p], &r, &f, &[grads]);
    }

    /// GPT-3 (and NN-1): every parameter, with biases and without, two blocks, a sequence
    /// shorter than the block.
    #[test]
    fn backward_matches_finite_differences_gpt_3() {
        let short: Vec<&[u32]> = TOKENS.iter().map(|r| &r[..]).collect();
        check_gradients(&config(true, 2), &short, 10);
        let full: [&[u32]; 1] = [&[3, 3, 0, 1]];
        check_gradients(&config(false, 1), &full, 20);
    }

    /// GPT-2: wte's gradient is the head's share plus the embedding's; either alone fails
    /// the finite-difference check.
    #[test]
    fn tied_head_gradient_sums_both_uses_gpt_2() {
        let cfg = config(true, 1);
        let tokens: Vec<&[u32]> = TOKENS.iter().map(|r| &r[..]).collect();
        let p = params(&cfg, 30);
        let (logits, saved) = cfg.forward(&p, &tokens).unwrap();
        let dlogits = randn(logits.len(), 31);
        let grads = cfg.backward(&p, &saved, &dlogits).unwrap();
        let wte = cfg.ranges().wte;
        let mut head = vec![0.0; wte.len()];
        let lin = Linear::new(cfg.n_embd, cfg.vocab_size, false);
        lin.backward(&p[wte.clone()], &saved.h_final, &dlogits, None, &mut head).unwrap();
        let emb: Vec<f64> = grads[wte.clone()].iter().zip(&head).map(|(g, h)| g - h).collect();
        // Token 3 is not in the batch: its row is the head's share alone.
        let e = cfg.n_embd;
        assert_eq!(&emb[3 * e..4 * e], &[0.0; 4], "no embedding share for an absent token");
        assert!(emb[4 * e..5 * e].iter().all(|v| v.abs() > 1e-6), "token 4 is embedded");
        assert!(head.iter().all(|v| v.abs() > 1e-9), "every row is projected onto");

        let f = |a: &[Vec<f64>]| {
            let mut q = p.clone();
            q[wte.clone()].copy_from_slice(&a[0]);
            cfg.forward(&q, &tokens).unwrap().0
        };
        let numeric = numeric_grads(&[p[wte.clone()].to_vec()], &dlogits, &f);
        compare(&["wte"], &numeric, &[grads[wte.clone()].to_vec()]).expect("both shares");
        assert!(compare(&["wte"], &numeric, &[head]).is_err(), "the head's share alone");
        assert!(compare(&["wte"], &numeric, &[emb]).is_err(), "the embedding's share alone");
    }

    /// GPT-5: positions are 0..seq; wpe rows at and above seq get nothing; bad batches are
    /// refused.
    #[test]
    fn short_sequences_use_the_first_positions_gpt_5() {
        let cfg = config(true, 1);
        let p = params(&cfg, 40);
        let (logits, saved) = cfg.forward(&p, &TOKENS).unwrap();
        assert_eq!((saved.batch(), saved.seq(), logits.len()), (2, 3, 2 * 3 * 5));
        let grads = cfg.backward(&p, &saved, &randn(logits.len(), 41)).unwrap();
        let wpe = &grads[cfg.ranges().wpe];
        assert!(wpe[..3 * 4].iter().all(|v| *v != 0.0));
        assert_eq!(&wpe[3 * 4..], &[0.0; 4]);
        // A causal model: the logits of a prefix do not depend on what follows it.
        let prefix: Vec<&[u32]> = TOKENS.iter().map(|r| &r[..2]).collect();
        let (short, _) = cfg.forward(&p, &prefix).unwrap();
        for b in 0..2 {
            let a = &logits[b * 15..b * 15 + 10];
            let s = &short[b * 10..(b + 1) * 10];
            assert!(a.iter().zip(s).all(|(x, y)| (x - y).abs() < 1e-12), "row {b}");
        }

        let ragged: [&[u32]; 2] = [&[1, 2, 3], &[1, 2]];
        let too_long: [&[u32]; 1] = [&[0, 1, 2, 3, 4]];
        let empty: [&[u32]; 1] = [&[]];
        for bad in [&ragged[..], &too_long[..], &empty[..], &[][..]] {
            let e = cfg.forward(&p, bad);
            assert!(matches!(e, Err(ModelError::Shape { .. })), "{bad:?}: {:?}", e.err());
        }
        let e = cfg.forward(&p, &[[1u32, 5]]);
        assert!(matches!(e, Err(ModelError::OutOfRange { index: 5, .. })), "{:?}", e.err());
    }

    /// GPT-6: the vectors' "model" object is read; what the decoder cannot compute is refused.
    #[test]
    fn config_reads_the_model_object_and_refuses_other_models_gpt_6() {
        let json = r#"{"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4,
            "n_embd": 32, "bias": true, "tied_lm_head": true, "gelu": "erf",
            "layernorm_eps": 1e-05, "dropout": 0.0}"#;
        let cfg: GptConfig = serde_json::from_str(json).unwrap();
        assert_eq!(
            cfg,
            GptConfig {
                vocab_size: 64,
                block_size: 16,
                n_layer: 2,
                n_head: 4,
                n_embd: 32,
                bias: true,
                layernorm_eps: 1e-5,
                dropout: 0.0,
            }
        );
        // A dropout is read (the module model applies it); this decoder refuses to compute it.
        let with_dropout = json.replace(r#""dropout": 0.0"#, r#""dropout": 0.1"#);
        let cfg: GptConfig = serde_json::from_str(&with_dropout).unwrap();
        assert_eq!(cfg.dropout, 0.1);
        let p = vec![0.0f64; cfg.num_params()];
        let err = cfg.forward(&p, &[[1u32, 2]]).unwrap_err().to_string();
        assert!(err.contains("dropout"), "{err}");
        for (from, to, field) in [
            (r#""gelu": "erf""#, r#""gelu": "tanh""#, "gelu"),
            (r#""dropout": 0.0"#, r#""dropout": 1.0"#, "dropout"),
            (r#""tied_lm_head": true"#, r#""tied_lm_head": false"#, "tied_lm_head"),
            (r#""n_head": 4"#, r#""n_head": 5"#, "n_head"),
            (r#""n_layer": 2"#, r#""n_layer": 0"#, "n_layer"),
            (r#""layernorm_eps": 1e-05"#, r#""layernorm_eps": 0.0"#, "layernorm_eps"),
        ] {
            let bad = json.replace(from, to);
            assert_ne!(bad, json);
            let err = serde_json::from_str::<GptConfig>(&bad).unwrap_err().to_string();
            assert!(err.contains(field) && err.contains("gpt"), "{field}: {err}");
        }
    }

    /// NN-2: the f32 instance computes what the f64 instance computes, to f32 rounding.
    #[test]
    fn gpt_f32_matches_f64_nn_2() {
        let cfg = config(true, 2);
        let p64 = to_f64(&to_f32(&params(&cfg, 50)));
        let (l64, s64) = cfg.forward(&p64, &TOKENS).unwrap();
        let (l32, s32) = cfg.forward(&to_f32(&p64), &TOKENS).unwrap();
        assert_f32_close("logits", &l32, &l64);
        let r = to_f64(&to_f32(&randn(l64.len(), 51)));
        let g64 = cfg.backward(&p64, &s64, &r).unwrap();
        let g32 = cfg.backward(&to_f32(&p64), &s32, &to_f32(&r)).unwrap();
        assert_f32_close("grads", &g32, &g64);
    }

    /// The loss is the cross-entropy of the logits (XENT-1), and its gradients are those of
    /// backward from dlogits.
    #[test]
    fn loss_and_grads_is_cross_entropy_of_forward() {
        let cfg = config(true, 1);
        let p = params(&cfg, 60);
        let targets = [[1u32, 0, 3], [2, 2, 4]];
        let (loss, grads) = cfg.loss_and_grads(&p, &TOKENS, &targets).unwrap();
        let f = |a: &[Vec<f64>]| {
            let (logits, _) = cfg.forward(&a[0], &TOKENS).unwrap();
            let t: Vec<u32> = targets.iter().flatten().copied().collect();
            vec![cross_entropy_forward(&logits, 5, &t).unwrap().loss]
        };
        assert_eq!(f(std::slice::from_ref(&p)), vec![loss]);
        assert_grads(&["params"], &[p], &[1.0], &f, &[grads]);
    }
}
