//! Causal multi-head self-attention with a blocked (online) softmax, as a pure kernel.
//!
//! `q`, `k`, `v` and the output are `[batch, heads, seq, head_dim]`, row-major. For every
//! (batch, head), `scores = q k^T / sqrt(head_dim)`, key `j` is masked for query `i` when
//! `j > i`, each row goes through a softmax over the keys and the output is `softmax(scores)
//! v`: nanoGPT's attention (and `torch.nn.functional.scaled_dot_product_attention` with
//! `is_causal=True`). The kernel is generic over the float type ([`Gemm`]):
//! f64 for gradient checks, f32 for training. [`split_qkv`] and [`merge_heads`] (with their
//! backwards) convert from and to nanoGPT's layout: the fused `c_attn` output `[batch, seq,
//! 3 * embd]` (q, k, v in that order, head `h` in columns `h * head_dim..(h + 1) * head_dim` of
//! each) and the merged output `[batch, seq, embd]`.
//!
//! ## Forward
//! The queries go in blocks of `block` rows; for each, the key blocks up to the diagonal are
//! visited in order, as flash attention does. For a query block `Q_i` and a key block `K_j`
//! the block of scores `S = Q_i K_j^T * scale` (masked) updates each row's running maximum `m`
//! and running sum `l` of `exp(S - m)`: with the new maximum `m'`, the output accumulator and
//! `l` are rescaled by `exp(m - m')`, then `l += rowsum(P)` and `O_i += P V_j`, where `P =
//! exp(S - m')`. At the end of the row `O_i /= l` and `lse = m + ln(l)` is kept. The whole `seq
//! x seq` score matrix never exists; the scratch is one `block x block` score block. With
//! dropout ([`AttnDropout`], nanoGPT's `attn_dropout`), `l` still sums the undropped `P` and
//! `O_i += (P * Z) V_j`, the mask `Z` drawn from the key of each (sample, head, query, key).
//!
//! ## Backward
//! With `D = rowsum(dO * O)` per query row, for every key block `j` and every query block `i`
//! at or below the diagonal the scores are recomputed and `P = exp(S - lse)` (masked entries
//! 0); then `dV_j += P^T dO_i`, `dP = dO_i V_j^T`, `dS = P * (dP - D)`, `dQ_i += scale * dS
//! K_j` and `dK_j += scale * dS^T Q_i`. With dropout the mask is redrawn from the saved key:
//! `dV_j += (P * Z)^T dO_i` and `dS = (P * Z) * dP - P * D` (derived in
//! [`super::attn_dropout`]).
//!
//! Every block product is one [`Gemm::gemm_view`] call over row blocks of q, k, v, the
//! output and the gradients where they lie, in `f32` and `f64` alike. [`attention_forward`]
//! takes q, k, v with heads apart (`[batch, heads, seq, head_dim]`);
//! [`attention_forward_tokens`] reads them in place from nanoGPT's fused `c_attn` output and
//! writes the output with its heads merged, and its backward writes the gradient of the
//! fused buffer: no split, merge or their backwards move values on that route.
//!
//! Invariants:
//! - `ATTN-1`: what the forward saves for the backward is `q`, `k`, `v` (the caller's fused
//!   buffer itself on the token route), the output (on the token route the caller's merged
//!   output, which `c_proj` keeps as its input anyway) and one logsumexp per (batch, head,
//!   query row): `4 * batch * heads * seq * head_dim + batch * heads * seq` values in all
//!   ([`AttnSaved::saved_values`]); no scores, whole or per block, are kept, and with
//!   dropout no mask either, only its key.
//! - `ATTN-2`: the blocked forward (output and logsumexp) and backward equal attention
//!   computed from the materialised score matrix, to rounding (1e-12 in f64), for every block
//!   size, including sizes that do not divide `seq`, sizes above `seq`, and `seq = 1`.
//! - `ATTN-3`: [`attention_backward`] is the exact derivative of [`attention_forward`]: every
//!   element of `dq`, `dk`, `dv` agrees with central finite differences in f64.
//! - `ATTN-4`: [`split_qkv`] and [`merge_heads`] only move values (each input value lands in
//!   exactly one output place), and [`split_qkv_backward`] and [`merge_heads_backward`] are the
//!   inverse moves, which for a permutation is the exact derivative.
//! - `ATTN-5`: the token route ([`attention_forward_tokens`], [`attention_backward_tokens`])
//!   computes what split, [`attention_forward`], merge and their backwards compute, to
//!   rounding (1e-12 in f64), with and without dropout.

use num_traits::Float;

use super::attn_dropout::AttnDropout;
use super::exp::RowExp;
use super::gemm::{Gemm, View};
use crate::error::ModelError;
use crate::meter::Metered;

/// The shape of one attention call: q, k, v and the output are `[batch, heads, seq,
/// head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Sequences in the batch.
    pub batch: usize,
    /// Attention heads.
    pub heads: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Width of one head (`embd / heads` in nanoGPT).
    pub head_dim: usize,
}

impl AttnShape {
    /// Values in one of q, k, v or the output.
    pub fn numel(&self) -> usize {
        self.batch * self.heads * self.seq * self.head_dim
    }

    /// Query rows over all (batch, head): the number of logsumexp values saved.
    pub fn rows(&self) -> usize {
        self.batch * self.heads * self.seq
    }

    /// Width of the merged output, `heads * head_dim` (nanoGPT's `n_embd`).
    pub fn embd(&self) -> usize {
        self.heads * self.head_dim
    }

    fn check(&self, what: &str, len: usize, want: usize) -> Result<(), ModelError> {
        if len != want {
            return Err(ModelError::shape(what, format!("{want} values for {self:?}"), len));
        }
        Ok(())
    }
}

/// Where the rows of one (sample, head) of q, k, v, the output and their gradients lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// Heads apart: `[parts, batch, heads, seq, head_dim]` (q, k, v one after the other;
    /// the output one part).
    Heads,
    /// Token rows, nanoGPT's layout: `[batch, seq, parts * embd]`, head `h` of part `part`
    /// at columns `part * embd + h * head_dim` (the fused `c_attn` output has 3 parts, the
    /// merged output 1).
    Tokens { parts: usize },
}

impl Layout {
    /// The view of head `h` of sample `b` of `part`, as `seq` rows of `head_dim` values.
    fn head(self, s: &AttnShape, part: usize, b: usize, h: usize) -> View {
        match self {
            Layout::Heads => {
                View::rows((((part * s.batch + b) * s.heads + h) * s.seq) * s.head_dim, s.head_dim)
            }
            Layout::Tokens { parts } => View::rows(
                b * s.seq * parts * s.embd() + part * s.embd() + h * s.head_dim,
                parts * s.embd(),
            ),
        }
    }

    /// The layout of the output (and its gradient) that goes with this layout of q, k, v.
    fn output(self) -> Layout {
        match self {
            Layout::Heads => Layout::Heads,
            Layout::Tokens { .. } => Layout::Tokens { parts: 1 },
        }
    }
}

/// `view` moved down `rows` rows.
fn down(view: View, rows: usize) -> View {
    View { off: view.off + rows * view.rs, ..view }
}

/// What the forward keeps for the backward (ATTN-1), and, from [`attention_forward`], the
/// output.
#[derive(Clone, Debug)]
pub struct AttnSaved<F> {
    shape: AttnShape,
    block: usize,
    layout: Layout,
    /// q, k and v: `[3, batch, heads, seq, head_dim]` from [`attention_forward`], the
    /// caller's fused `[batch, seq, 3 * embd]` from [`attention_forward_tokens`].
    src: Metered<F>,
    /// The output in head layout; empty from [`attention_forward_tokens`], whose caller
    /// holds the merged output.
    o: Metered<F>,
    lse: Metered<F>,
    /// The dropout of the probabilities, if any: the key its backward redraws the mask
    /// from (ADROP-1), not the mask.
    dropout: Option<AttnDropout>,
}

impl<F> AttnSaved<F> {
    /// The shape of the call.
    pub fn shape(&self) -> AttnShape {
        self.shape
    }

    /// The block size the call ran with (backward uses the same).
    pub fn block(&self) -> usize {
        self.block
    }

    /// The attention output of [`attention_forward`], `[batch, heads, seq, head_dim]`; empty
    /// after [`attention_forward_tokens`], which hands its output to the caller.
    pub fn output(&self) -> &[F] {
        &self.o
    }

    /// `ln(sum_j exp(score_ij))` of every query row, `[batch, heads, seq]`.
    pub fn logsumexp(&self) -> &[F] {
        &self.lse
    }

    /// The dropout of the attention probabilities the call ran with.
    pub fn dropout(&self) -> Option<AttnDropout> {
        self.dropout
    }

    /// The same saved state with another dropout for the backward: a backward keyed
    /// differently from its forward (ADROP-3's negative control).
    #[cfg(test)]
    pub(crate) fn with_dropout(mut self, dropout: Option<AttnDropout>) -> Self {
        self.dropout = dropout;
        self
    }

    /// What [`attention_forward`] without dropout saves, from parts a caller kept: q, k, v,
    /// the output and the logsumexp, all in head layout (the attention ops of
    /// [`crate::ops`], whose buffers hold them).
    pub(crate) fn from_parts(
        shape: AttnShape,
        block: usize,
        qkv: Qkv<F>,
        o: Vec<F>,
        lse: Vec<F>,
    ) -> Result<Self, ModelError>
    where
        F: Copy,
    {
        check_block(block, &shape)?;
        let Qkv { q, k, v } = qkv;
        for (what, len) in [("q", q.len()), ("k", k.len()), ("v", v.len()), ("output", o.len())] {
            shape.check(&format!("attention {what}"), len, shape.numel())?;
        }
        shape.check("attention logsumexp", lse.len(), shape.rows())?;
        let mut src = q;
        src.extend_from_slice(&k);
        src.extend_from_slice(&v);
        let (src, o, lse) = (Metered::new(src), Metered::new(o), Metered::new(lse));
        Ok(AttnSaved { shape, block, layout: Layout::Heads, src, o, lse, dropout: None })
    }

    /// What [`attention_forward_tokens`] without dropout saves, from parts a caller kept: the
    /// fused `[batch, seq, 3 * embd]` q, k, v and the logsumexp (the token attention ops of
    /// [`crate::ops`]).
    pub(crate) fn from_tokens(
        shape: AttnShape,
        block: usize,
        qkv: Vec<F>,
        lse: Vec<F>,
    ) -> Result<Self, ModelError> {
        check_block(block, &shape)?;
        shape.check("attention qkv", qkv.len(), 3 * shape.numel())?;
        shape.check("attention logsumexp", lse.len(), shape.rows())?;
        let (src, o, lse) = (Metered::new(qkv), Metered::new(Vec::new()), Metered::new(lse));
        let layout = Layout::Tokens { parts: 3 };
        Ok(AttnSaved { shape, block, layout, src, o, lse, dropout: None })
    }

    /// Number of values kept: q, k, v, the output when the struct holds it, and the
    /// logsumexp; `4 * numel + rows` from [`attention_forward`], `3 * numel + rows` from
    /// [`attention_forward_tokens`] (ATTN-1).
    pub fn saved_values(&self) -> usize {
        self.src.len() + self.o.len() + self.lse.len()
    }
}

/// q, k and v of one attention call, each `[batch, heads, seq, head_dim]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Qkv<F> {
    /// Queries.
    pub q: Vec<F>,
    /// Keys.
    pub k: Vec<F>,
    /// Values.
    pub v: Vec<F>,
}

/// Gradients of q, k and v, each `[batch, heads, seq, head_dim]`.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnGrads<F> {
    /// Gradient of the queries.
    pub dq: Vec<F>,
    /// Gradient of the keys.
    pub dk: Vec<F>,
    /// Gradient of the values.
    pub dv: Vec<F>,
}

fn constant<F: Float>(x: f64) -> F {
    F::from(x).expect("a float type represents every f64 value approximately")
}

fn check_block(block: usize, shape: &AttnShape) -> Result<(), ModelError> {
    if block == 0 {
        return Err(ModelError::Config("attention block size must be positive".into()));
    }
    if shape.head_dim == 0 {
        return Err(ModelError::Config("attention head_dim must be positive".into()));
    }
    Ok(())
}

/// Causal attention over `qkv` (each `[batch, heads, seq, head_dim]`), with the softmax
/// computed online over key blocks of `block` keys (queries go in blocks of the same size).
/// With `dropout`, the probabilities are dropped after the softmax and before the product
/// with `v` (nanoGPT's `attn_dropout`, ADROP-n). The output is [`AttnSaved::output`].
pub fn attention_forward<F: Gemm + RowExp>(
    shape: AttnShape,
    block: usize,
    dropout: Option<AttnDropout>,
    qkv: Qkv<F>,
) -> Result<AttnSaved<F>, ModelError> {
    check_block(block, &shape)?;
    let Qkv { q, k, v } = qkv;
    let n = shape.numel();
    shape.check("attention q", q.len(), n)?;
    shape.check("attention k", k.len(), n)?;
    shape.check("attention v", v.len(), n)?;
    let mut src = q;
    src.extend_from_slice(&k);
    src.extend_from_slice(&v);
    let mut o = vec![F::zero(); n];
    let mut lse = vec![F::zero(); shape.rows()];
    forward_core(shape, block, dropout, (&src, Layout::Heads), &mut o, &mut lse);
    let (src, o, lse) = (Metered::new(src), Metered::new(o), Metered::new(lse));
    Ok(AttnSaved { shape, block, layout: Layout::Heads, src, o, lse, dropout })
}

/// [`attention_forward`] on nanoGPT's layout, without moving a value: q, k and v are read in
/// place from the fused `c_attn` output `qkv` (`[batch, seq, 3 * embd]`, consumed and kept
/// for the backward), and the output is written merged, `[batch, seq, embd]` (nanoGPT's `y`
/// after its heads are put back side by side), into `out`, which the caller keeps and hands
/// to [`attention_backward_tokens`] (ATTN-5).
pub fn attention_forward_tokens<F: Gemm + RowExp>(
    shape: AttnShape,
    block: usize,
    dropout: Option<AttnDropout>,
    qkv: Vec<F>,
    out: &mut [F],
) -> Result<AttnSaved<F>, ModelError> {
    check_block(block, &shape)?;
    shape.check("attention qkv", qkv.len(), 3 * shape.numel())?;
    shape.check("attention output", out.len(), shape.numel())?;
    let mut lse = vec![F::zero(); shape.rows()];
    let layout = Layout::Tokens { parts: 3 };
    forward_core(shape, block, dropout, (&qkv, layout), out, &mut lse);
    // What backward needs is charged to the thread's meter while it is held (METER-1).
    let (src, o, lse) = (Metered::new(qkv), Metered::new(Vec::new()), Metered::new(lse));
    Ok(AttnSaved { shape, block, layout, src, o, lse, dropout })
}

/// The blocked forward over q, k, v at `layout`, the output at the matching output layout
/// (overwritten: the first key block writes it, the next ones rescale and add).
fn forward_core<F: Gemm + RowExp>(
    shape: AttnShape,
    block: usize,
    dropout: Option<AttnDropout>,
    (src, layout): (&[F], Layout),
    o: &mut [F],
    lse: &mut [F],
) {
    let (seq, d) = (shape.seq, shape.head_dim);
    let scale = F::one() / constant::<F>(d as f64).sqrt();
    let keep_scale = dropout.map(|dr| constant::<F>(dr.scale()));
    let olay = layout.output();
    // Scratch: one block of scores (then probabilities), and each row's running max and sum.
    let mut s = vec![F::zero(); block * block];
    let mut m = vec![F::neg_infinity(); block];
    let mut l = vec![F::zero(); block];
    for bh in 0..shape.batch * shape.heads {
        let (b, h) = (bh / shape.heads, bh % shape.heads);
        let (qh, kh, vh) = (
            layout.head(&shape, 0, b, h),
            layout.head(&shape, 1, b, h),
            layout.head(&shape, 2, b, h),
        );
        let oh = olay.head(&shape, 0, b, h);
        for i0 in (0..seq).step_by(block) {
            let br = block.min(seq - i0);
            let (qi, oi) = (down(qh, i0), down(oh, i0));
            m[..br].fill(F::neg_infinity());
            l[..br].fill(F::zero());
            // Key blocks up to the diagonal. The first (j0 = 0) holds key 0, which no row
            // masks, so every row's maximum is finite from then on.
            for j0 in (0..i0 + br).step_by(block) {
                let bc = block.min(seq - j0);
                let (kj, vj) = (down(kh, j0), down(vh, j0));
                let sij = &mut s[..br * bc];
                // S = Q_i K_j^T
                let sv = View::rows(0, bc);
                F::gemm_view((br, bc, d), (src, qi), (src, kj.t()), (&mut *sij, sv), false);
                for r in 0..br {
                    // Keys past the query (`j0 + c > i0 + r`) are masked: they end the row.
                    // `j0 <= i0`, since both step by `block` from 0.
                    let valid = (i0 + r + 1 - j0).min(bc);
                    let (live, masked) = sij[r * bc..(r + 1) * bc].split_at_mut(valid);
                    // The scale is positive and rounding is monotonic: the maximum of the
                    // scaled scores is the scaled maximum.
                    let raw = live.iter().fold(F::neg_infinity(), |a, &b| a.max(b));
                    let mx = m[r].max(raw * scale);
                    let alpha = (m[r] - mx).exp();
                    let sum = F::exp_shifted(live, scale, mx);
                    masked.fill(F::zero());
                    // The normaliser `l` sums the undropped probabilities; only the product
                    // with V sees the dropped ones.
                    if let (Some(dr), Some(ks)) = (dropout, keep_scale) {
                        let mask = dr.row(b, h, i0 + r);
                        for (c, x) in live.iter_mut().enumerate() {
                            *x = if mask.keep(j0 + c) { *x * ks } else { F::zero() };
                        }
                    }
                    l[r] = l[r] * alpha + sum;
                    m[r] = mx;
                    if j0 > 0 {
                        let at = oi.off + r * oi.rs;
                        for x in &mut o[at..at + d] {
                            *x = *x * alpha;
                        }
                    }
                }
                // O_i = P V_j for the first key block, then O_i += P V_j
                F::gemm_view((br, d, bc), (&*sij, sv), (src, vj), (&mut *o, oi), j0 > 0);
            }
            for r in 0..br {
                let inv = F::one() / l[r];
                let at = oi.off + r * oi.rs;
                for x in &mut o[at..at + d] {
                    *x = *x * inv;
                }
                lse[bh * seq + i0 + r] = m[r] + l[r].ln();
            }
        }
    }
}

/// Gradients of q, k and v from the gradient of the output (`[batch, heads, seq, head_dim]`)
/// of [`attention_forward`], recomputing the probabilities block by block from the saved
/// logsumexp.
pub fn attention_backward<F: Gemm + RowExp>(
    saved: &AttnSaved<F>,
    grad_output: &[F],
) -> Result<AttnGrads<F>, ModelError> {
    if saved.layout != Layout::Heads {
        return Err(ModelError::Config(
            "attention_backward: the forward ran on tokens; use attention_backward_tokens".into(),
        ));
    }
    let n = saved.shape.numel();
    saved.shape.check("attention grad_output", grad_output.len(), n)?;
    let mut dq = vec![F::zero(); 3 * n];
    backward_core(saved, &saved.o, grad_output, &mut dq);
    let dv = dq.split_off(2 * n);
    let dk = dq.split_off(n);
    Ok(AttnGrads { dq, dk, dv })
}

/// The gradient of the fused `c_attn` output (`[batch, seq, 3 * embd]`) from the merged
/// output `out` of [`attention_forward_tokens`] and its gradient `grad_output` (both
/// `[batch, seq, embd]`), written in place as the forward read (ATTN-5).
pub fn attention_backward_tokens<F: Gemm + RowExp>(
    saved: &AttnSaved<F>,
    out: &[F],
    grad_output: &[F],
) -> Result<Vec<F>, ModelError> {
    if saved.layout == Layout::Heads {
        return Err(ModelError::Config(
            "attention_backward_tokens: the forward ran on heads; use attention_backward".into(),
        ));
    }
    let n = saved.shape.numel();
    saved.shape.check("attention output", out.len(), n)?;
    saved.shape.check("attention grad_output", grad_output.len(), n)?;
    let mut dqkv = vec![F::zero(); 3 * n];
    backward_core(saved, out, grad_output, &mut dqkv);
    Ok(dqkv)
}

/// The blocked backward: `dsrc` (zeros on entry, q, k and v's layout) receives the
/// gradients; `o` and `go` are the output and its gradient in the output layout.
fn backward_core<F: Gemm + RowExp>(saved: &AttnSaved<F>, o: &[F], go: &[F], dsrc: &mut [F]) {
    let AttnSaved { shape, block, layout, src, lse, dropout, .. } = saved;
    let (shape, block, layout, dropout) = (*shape, *block, *layout, *dropout);
    let (src, lse): (&[F], &[F]) = (src, lse);
    let (seq, d) = (shape.seq, shape.head_dim);
    let scale = F::one() / constant::<F>(d as f64).sqrt();
    let keep_scale = dropout.map(|dr| constant::<F>(dr.scale()));
    let olay = layout.output();
    // D = rowsum(dO * O), one per query row; with dropout too (ADROP-n: the row sum of the
    // softmax Jacobian is dO . O whether or not the probabilities were dropped).
    let mut dsum = vec![F::zero(); shape.rows()];
    for bh in 0..shape.batch * shape.heads {
        let oh = olay.head(&shape, 0, bh / shape.heads, bh % shape.heads);
        for t in 0..seq {
            let at = oh.off + t * oh.rs;
            dsum[bh * seq + t] = go[at..at + d]
                .iter()
                .zip(&o[at..at + d])
                .fold(F::zero(), |acc, (&g, &o)| acc + g * o);
        }
    }
    // Scratch: probabilities and their gradient for one block pair.
    let mut p = vec![F::zero(); block * block];
    let mut dp = vec![F::zero(); block * block];
    // The dropped probabilities `P * Z` of the block pair (dropout only).
    let mut pd = vec![F::zero(); if dropout.is_some() { block * block } else { 0 }];
    for bh in 0..shape.batch * shape.heads {
        let (b, h) = (bh / shape.heads, bh % shape.heads);
        let (qh, kh, vh) = (
            layout.head(&shape, 0, b, h),
            layout.head(&shape, 1, b, h),
            layout.head(&shape, 2, b, h),
        );
        let doh = olay.head(&shape, 0, b, h);
        let (lse_h, dsum_h) = (&lse[bh * seq..(bh + 1) * seq], &dsum[bh * seq..(bh + 1) * seq]);
        for j0 in (0..seq).step_by(block) {
            let bc = block.min(seq - j0);
            let (kj, vj) = (down(kh, j0), down(vh, j0));
            // Query blocks at or below the diagonal (the blocks of both kinds line up).
            for i0 in (j0..seq).step_by(block) {
                let br = block.min(seq - i0);
                let (qi, doi) = (down(qh, i0), down(doh, i0));
                let pij = &mut p[..br * bc];
                let dpij = &mut dp[..br * bc];
                let block_view = View::rows(0, bc);
                // S = Q_i K_j^T, then P = exp(S * scale - lse), masked entries 0.
                F::gemm_view((br, bc, d), (src, qi), (src, kj.t()), (&mut *pij, block_view), false);
                for r in 0..br {
                    let query = i0 + r;
                    // Masked keys end the row (`j0 <= i0`, as in the forward).
                    let valid = (query + 1 - j0).min(bc);
                    let (live, masked) = pij[r * bc..(r + 1) * bc].split_at_mut(valid);
                    F::exp_shifted(live, scale, lse_h[query]);
                    masked.fill(F::zero());
                }
                // The probabilities that reached V: the forward's mask, redrawn.
                let pv: &[F] = match (dropout, keep_scale) {
                    (Some(dr), Some(ks)) => {
                        let pdij = &mut pd[..br * bc];
                        for r in 0..br {
                            let mask = dr.row(b, h, i0 + r);
                            let at = r * bc..(r + 1) * bc;
                            for (c, (x, &pu)) in
                                pdij[at.clone()].iter_mut().zip(&pij[at]).enumerate()
                            {
                                *x = if mask.keep(j0 + c) { pu * ks } else { F::zero() };
                            }
                        }
                        pdij
                    }
                    _ => pij,
                };
                // dV_j += (P * Z)^T dO_i
                let dvj = down(layout.head(&shape, 2, b, h), j0);
                F::gemm_view((bc, d, br), (pv, block_view.t()), (go, doi), (&mut *dsrc, dvj), true);
                // dP = dO_i V_j^T
                F::gemm_view(
                    (br, bc, d),
                    (go, doi),
                    (src, vj.t()),
                    (&mut *dpij, block_view),
                    false,
                );
                // dS = P * (dP - D), with the score scale folded in. With dropout, dP~ is the
                // gradient of the dropped probabilities and dS = P~ * dP~ - P * D (ADROP-n).
                for r in 0..br {
                    let dr = dsum_h[i0 + r];
                    let at = r * bc..(r + 1) * bc;
                    let prow = &pij[at.clone()];
                    if dropout.is_some() {
                        let pdrow = &pv[at.clone()];
                        for ((x, &pu), &pdv) in dpij[at].iter_mut().zip(prow).zip(pdrow) {
                            *x = (pdv * *x - pu * dr) * scale;
                        }
                    } else {
                        for (x, &pu) in dpij[at].iter_mut().zip(prow) {
                            *x = pu * (*x - dr) * scale;
                        }
                    }
                }
                // dQ_i += dS K_j
                let dqi = down(layout.head(&shape, 0, b, h), i0);
                F::gemm_view((br, d, bc), (&*dpij, block_view), (src, kj), (&mut *dsrc, dqi), true);
                // dK_j += dS^T Q_i
                let dkj = down(layout.head(&shape, 1, b, h), j0);
                F::gemm_view(
                    (bc, d, br),
                    (&*dpij, block_view.t()),
                    (src, qi),
                    (&mut *dsrc, dkj),
                    true,
                );
            }
        }
    }
}

/// Index in `[batch, heads, seq, head_dim]` of (b, h, t, c).
fn head_index(shape: &AttnShape, b: usize, h: usize, t: usize, c: usize) -> usize {
    ((b * shape.heads + h) * shape.seq + t) * shape.head_dim + c
}

/// nanoGPT's fused `c_attn` output `[batch, seq, 3 * embd]` (q, k, v in that order, each
/// `embd = heads * head_dim` wide, head `h` in columns `h * head_dim..(h + 1) * head_dim`)
/// into q, k, v `[batch, heads, seq, head_dim]` (ATTN-4).
pub fn split_qkv<F: Copy + Default>(shape: AttnShape, qkv: &[F]) -> Result<Qkv<F>, ModelError> {
    let (embd, d) = (shape.embd(), shape.head_dim);
    shape.check("split_qkv input", qkv.len(), shape.batch * shape.seq * 3 * embd)?;
    let n = shape.numel();
    // Each output is filled in its own order by appends: no zero fill of buffers that are
    // overwritten whole.
    let mut out = [Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n)];
    for (part, dst) in out.iter_mut().enumerate() {
        for b in 0..shape.batch {
            for h in 0..shape.heads {
                for t in 0..shape.seq {
                    let at = (b * shape.seq + t) * 3 * embd + part * embd + h * d;
                    dst.extend_from_slice(&qkv[at..at + d]);
                }
            }
        }
    }
    let [q, k, v] = out;
    Ok(Qkv { q, k, v })
}

/// Gradient of [`split_qkv`]: `dq`, `dk`, `dv` back into one `[batch, seq, 3 * embd]` (ATTN-4).
pub fn split_qkv_backward<F: Copy + Default>(
    shape: AttnShape,
    grads: &AttnGrads<F>,
) -> Result<Vec<F>, ModelError> {
    let (embd, d, n) = (shape.embd(), shape.head_dim, shape.numel());
    shape.check("split_qkv_backward dq", grads.dq.len(), n)?;
    shape.check("split_qkv_backward dk", grads.dk.len(), n)?;
    shape.check("split_qkv_backward dv", grads.dv.len(), n)?;
    let mut out = Vec::with_capacity(shape.batch * shape.seq * 3 * embd);
    for b in 0..shape.batch {
        for t in 0..shape.seq {
            for src in [&grads.dq, &grads.dk, &grads.dv] {
                for h in 0..shape.heads {
                    let at = head_index(&shape, b, h, t, 0);
                    out.extend_from_slice(&src[at..at + d]);
                }
            }
        }
    }
    Ok(out)
}

/// `[batch, heads, seq, head_dim]` -> `[batch, seq, heads * head_dim]` (nanoGPT's
/// `y.transpose(1, 2).contiguous().view(B, T, C)`; ATTN-4).
pub fn merge_heads<F: Copy + Default>(shape: AttnShape, x: &[F]) -> Result<Vec<F>, ModelError> {
    shape.check("merge_heads input", x.len(), shape.numel())?;
    let d = shape.head_dim;
    let mut out = Vec::with_capacity(shape.numel());
    for b in 0..shape.batch {
        for t in 0..shape.seq {
            for h in 0..shape.heads {
                let at = head_index(&shape, b, h, t, 0);
                out.extend_from_slice(&x[at..at + d]);
            }
        }
    }
    Ok(out)
}

/// Gradient of [`merge_heads`]: `[batch, seq, heads * head_dim]` -> `[batch, heads, seq,
/// head_dim]` (ATTN-4).
pub fn merge_heads_backward<F: Copy + Default>(
    shape: AttnShape,
    grad: &[F],
) -> Result<Vec<F>, ModelError> {
    shape.check("merge_heads_backward grad", grad.len(), shape.numel())?;
    let (embd, d) = (shape.embd(), shape.head_dim);
    let mut out = Vec::with_capacity(shape.numel());
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            for t in 0..shape.seq {
                let from = (b * shape.seq + t) * embd + h * d;
                out.extend_from_slice(&grad[from..from + d]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
