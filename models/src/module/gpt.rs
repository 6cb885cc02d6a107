//! The `gpt` model as a module tree: nanoGPT's decoder with nanoGPT's parameter names,
//! wrapped as FSDP2 wraps it (torchtitan, `torch_gpt_train.py`): one unit per block, and a
//! root unit (`transformer.wte`, `transformer.wpe`, `transformer.ln_f`) used first (token and
//! position embeddings) and last (`ln_f` and the output head tied to `wte`).
//!
//! The same model as [`crate::nn::gpt`]'s flat decoder, which the PyTorch vectors check:
//! `module_gpt_equals_the_checked_decoder` compares both on the same weights.
//!
//! Invariants:
//! - `MGPT-1`: the parameters are nanoGPT's by name and shape (GPT-1), initialised as
//!   nanoGPT initialises them: normal(0, 0.02) for embeddings and Linear weights, the two
//!   residual projections (`attn.c_proj`, `mlp.c_proj`) normal(0, 0.02 / sqrt(2 n_layer)),
//!   zero biases, unit LayerNorm gains.
//! - `MGPT-2`: `transformer.wte.weight`'s gradient sums the output head's use and the
//!   embedding's (GPT-2), both in the root unit before it is reduced.
//! - `MGPT-3`: with `dropout > 0`, training drops where nanoGPT's four dropout layers do:
//!   `transformer.drop` (the embeddings' sum, dropout layer 0), and in block `i`
//!   `attn.attn_dropout` (the attention probabilities after the softmax, layer `1 + 3 i`,
//!   keyed as ADROP-1 says), `attn.resid_dropout` and `mlp.dropout` (the two residual
//!   branches' outputs, layers `2 + 3 i` and `3 + 3 i`, keyed as DROP-1 says), so any world
//!   size, a resumed run and a recomputed forward draw the same masks. `dropout = 0` builds
//!   no dropout at all.

use super::layers::{Activation, CausalSelfAttention, Dropout, LayerNorm, Linear};
use super::{unsave, Grads, Init, Param, Params, Residual, RootModule, Saved, Sequential};
use crate::error::ModelError;
use crate::layers::{self, LinearSaved};
use crate::lower::{Buf, Lowering, Val};
use crate::model::Ctx;
use crate::module::{Module, TokenCrossEntropy};
use crate::network::ModuleNet;
use crate::nn::dropout::DropoutKey;
use crate::nn::{self, GptConfig, LayerNormSaved};
use crate::ops::Op;
use crate::tensor::Tensor;

/// nanoGPT's init std.
const STD: f32 = 0.02;

/// The root of the `gpt` model: token and position embeddings in, `ln_f` and the tied
/// head out.
#[derive(Clone, Debug, PartialEq)]
pub struct GptRoot {
    vocab: usize,
    block: usize,
    embd: usize,
    ln_f: LayerNorm,
    /// `transformer.drop`'s probability (MGPT-3).
    dropout: f64,
}

impl GptRoot {
    fn ranges(&self) -> (std::ops::Range<usize>, std::ops::Range<usize>, std::ops::Range<usize>) {
        let (v, b, e) = (self.vocab * self.embd, self.block * self.embd, self.embd);
        let ln = if self.ln_f.0.bias { 2 * e } else { e };
        (0..v, v..v + b, v + b..v + b + ln)
    }

    fn head(&self) -> layers::Linear {
        layers::Linear { in_features: self.embd, out_features: self.vocab, bias: false }
    }

    /// `transformer.drop` over `[batch, t, embd]` while training (MGPT-3: dropout layer 0),
    /// or `None` where it is the identity.
    fn drop(
        &self,
        t: usize,
        ctx: &Ctx,
    ) -> Result<Option<(nn::dropout::Dropout, DropoutKey)>, ModelError> {
        if !ctx.training || self.dropout == 0.0 {
            return Ok(None);
        }
        let key = DropoutKey { seed: ctx.seed, step: ctx.step, layer: 0 };
        Ok(Some((nn::dropout::Dropout::new(self.dropout, t * self.embd)?, key)))
    }
}

struct OutSaved {
    x: Tensor,
    ln: LayerNormSaved<f32>,
    head: LinearSaved,
    shape: Vec<usize>,
}

impl RootModule for GptRoot {
    fn params(&self) -> Vec<Param> {
        let mut v = vec![
            Param::new("wte.weight", vec![self.vocab, self.embd], Init::Normal(STD)),
            Param::new("wpe.weight", vec![self.block, self.embd], Init::Normal(STD)),
        ];
        v.extend(self.ln_f.params().into_iter().map(|p| p.prefixed("ln_f")));
        v
    }

    fn forward_in(
        &self,
        p: Params<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (wte, wpe, _) = self.ranges();
        let (b, t) = match x.shape() {
            &[b, t] if (1..=self.block).contains(&t) => (b, t),
            s => {
                return Err(ModelError::shape(
                    "gpt tokens",
                    format!("[B, T] with 1 <= T <= block_size {}", self.block),
                    format!("{s:?}"),
                ))
            }
        };
        let e = self.embd;
        let mut y = vec![0.0f32; b * t * e];
        nn::Embedding::new(self.vocab, e).forward(p.slice(wte)?.f32()?, x.as_u32()?, &mut y)?;
        let pos = p.slice(wpe)?.f32()?;
        for (i, row) in y.chunks_exact_mut(e).enumerate() {
            let at = (i % t) * e;
            row.iter_mut().zip(&pos[at..at + e]).for_each(|(a, w)| *a += w);
        }
        if let Some((d, key)) = self.drop(t, ctx)? {
            let mut dropped = vec![0.0f32; y.len()];
            d.forward(key, ctx.first_sample as u64, &y, &mut dropped)?;
            y = dropped;
        }
        Ok((Tensor::new(vec![b, t, e], y)?, Box::new(x)))
    }

    fn backward_in(
        &self,
        _: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<(), ModelError> {
        let x: Tensor = unsave(saved, "gpt root (in)")?;
        let (wte, wpe, _) = self.ranges();
        let (e, t) = (self.embd, x.shape()[1]);
        let dy = match self.drop(t, ctx)? {
            Some((d, key)) => {
                let mut dx = vec![0.0f32; dy.numel()];
                d.backward(key, ctx.first_sample as u64, dy.as_f32()?, &mut dx)?;
                Tensor::new(dy.shape().to_vec(), dx)?
            }
            None => dy,
        };
        let d = dy.as_f32()?;
        nn::Embedding::new(self.vocab, e).backward(x.as_u32()?, d, g.slice(wte)?.f32_mut()?)?;
        let mut gp = g.slice(wpe)?;
        let gp = gp.f32_mut()?;
        for (i, row) in d.chunks_exact(e).enumerate() {
            let at = (i % t) * e;
            gp[at..at + e].iter_mut().zip(row).for_each(|(a, v)| *a += v);
        }
        Ok(())
    }

    fn forward_out(
        &self,
        p: Params<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (wte, _, ln) = self.ranges();
        let shape = x.shape().to_vec();
        let rows = shape.iter().take(shape.len().saturating_sub(1)).product();
        let mut h = vec![0.0f32; x.numel()];
        let lns = self.ln_f.0.forward(p.slice(ln)?.f32()?, x.as_f32()?, &mut h)?;
        let h = Tensor::new(vec![rows, self.embd], h)?;
        let (logits, head) = self.head().forward(ctx.backend, p.slice(wte)?.f32()?, h)?;
        let mut out = shape.clone();
        if let Some(l) = out.last_mut() {
            *l = self.vocab;
        }
        Ok((logits.reshape(out)?, Box::new(OutSaved { x, ln: lns, head, shape })))
    }

    fn backward_out(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let s: OutSaved = unsave(saved, "gpt root (out)")?;
        let (wte, _, ln) = self.ranges();
        let rows = dy.numel() / self.vocab.max(1);
        let dy = dy.reshape(vec![rows, self.vocab])?;
        let dh = self.head().backward(
            ctx.backend,
            p.slice(wte.clone())?.f32()?,
            &s.head,
            &dy,
            g.slice(wte)?.f32_mut()?,
        )?;
        let mut dx = vec![0.0f32; s.x.numel()];
        self.ln_f.0.backward(
            p.slice(ln.clone())?.f32()?,
            s.x.as_f32()?,
            &s.ln,
            dh.as_f32()?,
            &mut dx,
            g.slice(ln)?.f32_mut()?,
        )?;
        Tensor::new(s.shape, dx)
    }

    /// The token embedding plus the position embedding, the latter as a lookup of position
    /// ids (a constant), which adds the same rows in the same order as the host.
    fn lower_in(&self, l: &mut Lowering, x: Val) -> Result<Val, ModelError> {
        if l.training() && self.dropout != 0.0 {
            return Err(Lowering::unlowered("gpt's transformer.drop while training"));
        }
        let (b, t) = match x.shape[..] {
            [b, t] if (1..=self.block).contains(&t) => (b, t),
            _ => {
                let want = format!("[B, T] with 1 <= T <= block_size {}", self.block);
                return Err(ModelError::shape("gpt tokens", want, format!("{:?}", x.shape)));
            }
        };
        let (wte, wpe, _) = self.ranges();
        let tok = nn::Embedding::new(self.vocab, self.embd);
        let pos_table = nn::Embedding::new(self.block, self.embd);
        let span = |r: std::ops::Range<usize>| (r.start, r.len());
        let ((te, tl), (pe, pl)) = (span(wte), span(wpe));
        let ids = (0..b * t).map(|i| f32::from_bits((i % t) as u32)).collect();
        let pos = l.constant(ids, &[b, t]);
        let shape = [b, t, self.embd];
        let (a, p, y) = (l.value(&shape), l.value(&shape), l.value(&shape));
        l.op(Op::EmbeddingForward(tok), &[Buf::Params { at: te, len: tl }, x.buf], &[a.buf]);
        l.op(
            Op::EmbeddingForward(pos_table),
            &[Buf::Params { at: pe, len: pl }, pos.buf],
            &[p.buf],
        );
        l.op(Op::Add, &[a.buf, p.buf], &[y.buf]);
        l.on_backward(move |l, dy| {
            l.op(Op::EmbeddingBackward(tok), &[x.buf, dy.buf], &[Buf::Grads { at: te, len: tl }]);
            let grads = Buf::Grads { at: pe, len: pl };
            l.op(Op::EmbeddingBackward(pos_table), &[pos.buf, dy.buf], &[grads]);
            Ok(None)
        });
        Ok(y)
    }

    /// `ln_f`, then the head over `wte` (no bias).
    fn lower_out(&self, l: &mut Lowering, x: Val) -> Result<Val, ModelError> {
        let (wte, _, ln) = self.ranges();
        let h = self.ln_f.lower(l, ln.start, x)?;
        let rows = h.numel() / self.embd.max(1);
        let head = nn::linear::Linear::new(self.embd, self.vocab, false);
        let mut out = h.shape.clone();
        if let Some(last) = out.last_mut() {
            *last = self.vocab;
        }
        let logits = l.value(&out);
        let w = Buf::Params { at: wte.start, len: wte.len() };
        l.op(Op::LinearForward(head), &[w, h.buf], &[logits.buf]);
        debug_assert_eq!(rows * self.vocab, logits.numel());
        l.on_backward(move |l, dy| {
            let dh = l.value(&h.shape);
            let grads = Buf::Grads { at: wte.start, len: wte.len() };
            let op = Op::LinearBackward { linear: head, input_grad: true };
            l.op(op, &[w, h.buf, dy.buf], &[grads, dh.buf]);
            Ok(Some(dh))
        });
        Ok(logits)
    }
}

/// Block `layer` of a `gpt`: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))` (nanoGPT's
/// `Block`, with its names); when `cfg.dropout > 0` the attention drops its probabilities
/// and each branch ends in its dropout (MGPT-3).
pub fn block(cfg: &GptConfig, layer: usize) -> Result<Sequential, ModelError> {
    let (e, bias) = (cfg.n_embd, cfg.bias);
    let ln = || LayerNorm(nn::LayerNorm { dim: e, eps: cfg.layernorm_eps as f32, bias });
    let proj = Init::Normal(STD / ((2 * cfg.n_layer) as f32).sqrt());
    let (w, z) = (Init::Normal(STD), Init::Zeros);
    let mut attn = CausalSelfAttention::new(e, cfg.n_head, bias)?;
    attn.c_attn = attn.c_attn.with_init(w, z);
    attn.c_proj = attn.c_proj.with_init(proj, z);
    let mut mlp = Sequential::new()
        .push("c_fc", Linear::new(e, 4 * e, bias).with_init(w, z))
        .push("", Activation::Gelu)
        .push("c_proj", Linear::new(4 * e, e, bias).with_init(proj, z));
    let drop = |k: usize| Dropout { p: cfg.dropout, layer: (1 + 3 * layer + k) as u64 };
    if cfg.dropout > 0.0 {
        attn = attn.with_attn_dropout(drop(0));
    }
    let mut attn_branch = Sequential::new().push("ln_1", ln()).push("attn", attn);
    if cfg.dropout > 0.0 {
        attn_branch = attn_branch.push("", drop(1));
        mlp = mlp.push("", drop(2));
    }
    Ok(Sequential::new()
        .push("", Residual::new(attn_branch))
        .push("", Residual::new(Sequential::new().push("ln_2", ln()).push("mlp", mlp))))
}

/// The `gpt` model of `cfg` (checked first, GPT-6): a root unit and one unit per block.
pub fn gpt(cfg: &GptConfig) -> Result<ModuleNet, ModelError> {
    cfg.validate()?;
    let root = GptRoot {
        vocab: cfg.vocab_size,
        block: cfg.block_size,
        embd: cfg.n_embd,
        ln_f: LayerNorm(nn::LayerNorm {
            dim: cfg.n_embd,
            eps: cfg.layernorm_eps as f32,
            bias: cfg.bias,
        }),
        dropout: cfg.dropout,
    };
    let mut net = ModuleNet::new("gpt", TokenCrossEntropy).root("transformer", root);
    for i in 0..cfg.n_layer {
        net = net.push(&format!("transformer.h.{i}"), block(cfg, i)?);
    }
    Ok(net)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::network::{CallBackward, Network};

    fn cfg(bias: bool) -> GptConfig {
        GptConfig {
            vocab_size: 11,
            block_size: 6,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            bias,
            layernorm_eps: 1e-5,
            dropout: 0.0,
        }
    }

    /// Forward, token loss and backward of a [`Network`] on one rank: (loss, per-unit grads).
    pub(crate) fn run(
        net: &dyn Network,
        params: &[Vec<f32>],
        x: Tensor,
        y: &Tensor,
    ) -> (f32, Vec<Vec<f32>>) {
        let be = Cpu::new();
        let ctx = Ctx::new(&be, true, x.batch());
        let spec = net.spec();
        let mut bufs: Vec<Vec<f32>> =
            (0..spec.units.len()).map(|u| net.init_buffers(u).unwrap()).collect();
        let calls = net.calls();
        let (mut x, mut saved) = (x, Vec::new());
        for (c, &u) in calls.iter().enumerate() {
            let (o, s) = net.forward_call(c, &params[u], &mut bufs[u], x, &ctx).unwrap();
            saved.push(s);
            x = o;
        }
        let (loss, mut g) = net.loss().forward_backward(&x, y, ctx.global_batch).unwrap();
        let mut grads: Vec<Vec<f32>> = spec.units.iter().map(|u| vec![0.0; u.numel()]).collect();
        for (c, &u) in calls.iter().enumerate().rev() {
            let b = CallBackward {
                params: &params[u],
                saved: saved.pop().unwrap(),
                grad_output: g,
                grads_out: &mut grads[u],
                input_grad: c > 0,
            };
            g = net
                .backward_call(c, b, &ctx)
                .unwrap()
                .finish(&be, &params[u])
                .unwrap()
                .unwrap_or_default();
        }
        (loss, grads)
    }

    #[test]
    fn module_gpt_equals_the_checked_decoder() {
        // MODULE-2: the modules' backward (tied wte summing both uses) is the checked one.
        for bias in [true, false] {
            let c = cfg(bias);
            let net = gpt(&c).unwrap();
            let spec = net.spec();
            let params: Vec<Vec<f32>> =
                (0..spec.units.len()).map(|u| net.init_params(u, 7).unwrap()).collect();
            // MGPT-1: nanoGPT's names (GPT-1), every one of them.
            let mut by_name = std::collections::HashMap::new();
            for (u, us) in spec.units.iter().enumerate() {
                let mut at = 0;
                for p in &us.params {
                    by_name.insert(p.name.clone(), (u, at, p.numel()));
                    at += p.numel();
                }
            }
            let want = c.param_specs();
            assert_eq!(by_name.len(), want.len());
            let flat: Vec<f32> = want
                .iter()
                .flat_map(|s| {
                    let (u, at, n) = by_name[&s.name];
                    params[u][at..at + n].to_vec()
                })
                .collect();
            let tokens: Vec<Vec<u32>> = vec![vec![1, 4, 9, 2, 0], vec![10, 3, 3, 7, 5]];
            let targets: Vec<Vec<u32>> = vec![vec![4, 9, 2, 0, 6], vec![3, 3, 7, 5, 1]];
            let (want_loss, want_grads) =
                c.loss_and_grads::<f32, _>(&flat, &tokens, &targets).unwrap();
            let x = Tensor::from_u32(vec![2, 5], tokens.concat()).unwrap();
            let y = Tensor::from_u32(vec![2, 5], targets.concat()).unwrap();
            let (loss, grads) = run(&net, &params, x, &y);
            assert!((loss - want_loss).abs() < 1e-5, "loss {loss} vs {want_loss}");
            let mut at = 0;
            for s in &want {
                let (u, o, n) = by_name[&s.name];
                let (g, w) = (&grads[u][o..o + n], &want_grads[at..at + n]);
                let err = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(err < 2e-5, "{}: max error {err}", s.name);
                at += n;
            }
        }
    }

    /// MGPT-3: the attention drops its probabilities while training (ADROP-n) and not in
    /// evaluation; the drop moves the output and the gradient, and the layer's mask is its
    /// own (another layer index draws another).
    #[test]
    fn attention_drops_its_probabilities_while_training_mgpt_3() {
        use crate::module::{Buffers, Grads};
        let be = Cpu::new();
        let (e, heads, b, t) = (8, 2, 3, 6);
        let plain = CausalSelfAttention::new(e, heads, true).unwrap();
        let dropping = |layer| plain.clone().with_attn_dropout(Dropout { p: 0.4, layer });
        let n = super::super::numel(&plain.params());
        let params: Vec<f32> = (0..n).map(|i| (0.7 * i as f32).sin() * 0.5).collect();
        let x: Vec<f32> = (0..b * t * e).map(|i| (0.31 * i as f32).cos()).collect();
        let run = |m: &CausalSelfAttention, training: bool| {
            let mut ctx = Ctx::new(&be, training, b);
            (ctx.seed, ctx.step, ctx.first_sample) = (5, 2, 7);
            let xt = Tensor::new(vec![b, t, e], x.clone()).unwrap();
            let (y, s) = m.forward(Params::new(&params), Buffers::none(), xt, &ctx).unwrap();
            let dy = Tensor::new(vec![b, t, e], vec![1.0; b * t * e]).unwrap();
            let mut g = vec![0.0f32; n];
            let dx = m.backward(Params::new(&params), s, dy, Grads::new(&mut g), &ctx).unwrap();
            (y.as_f32().unwrap().to_vec(), dx.as_f32().unwrap().to_vec(), g)
        };
        let none = run(&plain, true);
        let dropped = run(&dropping(1), true);
        assert_ne!(dropped.0, none.0, "output");
        assert_ne!(dropped.1, none.1, "input gradient");
        assert_ne!(dropped.2, none.2, "parameter gradients");
        assert_eq!(run(&dropping(1), true), dropped, "the same key draws the same mask");
        assert_ne!(run(&dropping(4), true).0, dropped.0, "another layer draws another mask");
        assert_eq!(run(&dropping(1), false), run(&plain, false), "no dropout in evaluation");
    }

    #[test]
    fn mgpt_1_init_follows_nanogpt_and_not_the_wrap() {
        // MODULE-1 (init by name, not by wrap), MODULE-3 (prefixed names).
        let c = cfg(true);
        let net = gpt(&c).unwrap();
        let spec = net.spec();
        assert_eq!(spec.units[0].name, "transformer");
        assert_eq!(spec.units[1].params[0].name, "transformer.h.0.ln_1.weight");
        assert_eq!(net.calls(), vec![0, 1, 2, 0]);
        let p0 = net.init_params(1, 3).unwrap();
        let wrapped = gpt(&c).unwrap().wrap(crate::WrapPolicy::ByParams(usize::MAX));
        assert_eq!(wrapped.spec().units.len(), 2, "root + both blocks in one unit");
        assert_eq!(&wrapped.init_params(1, 3).unwrap()[..p0.len()], &p0[..], "NET-2");
        // c_proj's std is 0.02 / sqrt(2 n_layer) = 0.01; c_fc's 0.02.
        let names: Vec<_> =
            spec.units[1].params.iter().map(|p| (p.name.clone(), p.numel())).collect();
        let mut at = 0;
        for (n, k) in names {
            let v = &p0[at..at + k];
            let sd = (v.iter().map(|x| x * x).sum::<f32>() / k as f32).sqrt();
            if n.ends_with("mlp.c_proj.weight") {
                assert!((sd - 0.01).abs() < 0.002, "{n}: {sd}");
            } else if n.ends_with("c_fc.weight") {
                assert!((sd - 0.02).abs() < 0.003, "{n}: {sd}");
            } else if n.ends_with("bias") {
                assert!(v.iter().all(|&x| x == 0.0), "{n}");
            }
            at += k;
        }
    }
}
