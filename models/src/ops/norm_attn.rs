//! The BatchNorm and attention ops' length rules and host references (OPS-1, OPS-2): the
//! host references call the layer code of [`crate::batchnorm`] and
//! [`crate::nn::attention`], the same functions the layers run.

use crate::batchnorm::{backward_dx, backward_reduce, channel_stats, invstd_of, normalize};
use crate::error::ModelError;
use crate::nn::attention::{
    attention_backward, attention_backward_tokens, attention_forward, attention_forward_tokens,
    AttnSaved, AttnShape, Qkv,
};

/// Query and key block of the host attention's online softmax (the GPT model's).
const ATTN_BLOCK: usize = 64;

fn err(e: ModelError) -> String {
    e.to_string()
}

/// `n * c * s`, refused where it overflows.
pub(super) fn bn_len(n: usize, c: usize, s: usize) -> Result<usize, String> {
    n.checked_mul(c)
        .and_then(|v| v.checked_mul(s))
        .ok_or_else(|| format!("batch norm: [{n}, {c}, {s}] overflows"))
}

/// A training batch's count per channel: at least 2 (BN-4), and at least this slice's.
pub(super) fn bn_count(n: usize, s: usize, count: usize) -> Result<(), String> {
    if count < 2 {
        return Err(format!("batch norm: {count} values per channel; training needs 2 (BN-4)"));
    }
    match n.checked_mul(s) {
        Some(local) if local <= count => Ok(()),
        _ => Err(format!("batch norm: count {count} below the slice's {n} x {s} values")),
    }
}

/// `(numel, rows)` of an attention shape without dropout, refused where it overflows or
/// `head_dim` is 0 (which the layer refuses).
pub(super) fn attn_lens(shape: &AttnShape) -> Result<(usize, usize), String> {
    if shape.head_dim == 0 {
        return Err("attention: head_dim must be positive".into());
    }
    let rows = shape.batch.checked_mul(shape.heads).and_then(|v| v.checked_mul(shape.seq));
    rows.and_then(|r| Some((r.checked_mul(shape.head_dim)?, r)))
        .ok_or_else(|| format!("attention: {shape:?} overflows"))
}

/// [`channel_stats`]: the layer's statistics, mean and M2 rounded to f32.
pub(super) fn bn_stats_host(dims: (usize, usize, usize), r: &[&[f32]], w: &mut [&mut [f32]]) {
    let (n, c, s) = dims;
    let [mean, m2] = w else { unreachable!("checked: two writes") };
    for (ch, st) in channel_stats(n, c, s, r[0]).iter().enumerate() {
        mean[ch] = st.mean as f32;
        m2[ch] = st.m2 as f32;
    }
}

/// The layer's `finish_train` normalisation: [`invstd_of`] the biased variance, then
/// [`normalize`] (which writes xhat in place and returns y).
pub(super) fn bn_forward_host(
    dims: (usize, usize, usize),
    count: usize,
    eps: f32,
    r: &[&[f32]],
    w: &mut [&mut [f32]],
) {
    let (n, c, s) = dims;
    let (x, params, mean, m2) = (r[0], r[1], r[2], r[3]);
    let [y, xhat, invstd] = w else { unreachable!("checked: three writes") };
    for (is, &q) in invstd.iter_mut().zip(m2) {
        *is = invstd_of(f64::from(q) / count as f64, eps);
    }
    xhat.copy_from_slice(x);
    y.copy_from_slice(&normalize(n, c, s, xhat, mean, invstd, params));
}

/// [`backward_reduce`]: the sums rounded to f32 (as SyncBatchNorm sends them), the
/// parameter gradients added.
pub(super) fn bn_reduce_host(dims: (usize, usize, usize), r: &[&[f32]], w: &mut [&mut [f32]]) {
    let [sums, grads] = w else { unreachable!("checked: two writes") };
    let got = backward_reduce(dims, r[0], r[1], grads);
    sums.iter_mut().zip(&got).for_each(|(o, &v)| *o = v as f32);
}

/// [`backward_dx`] in training mode with the sums read and the op's count.
pub(super) fn bn_dx_host(
    dims: (usize, usize, usize),
    count: usize,
    r: &[&[f32]],
    w: &mut [&mut [f32]],
) {
    let c = dims.1;
    let (params, xhat, invstd, sums, dy) = (r[0], r[1], r[2], r[3], r[4]);
    let sums: Vec<f64> = sums.iter().map(|&v| f64::from(v)).collect();
    w[0].copy_from_slice(dy);
    backward_dx(dims, &params[..c], invstd, Some((&sums, count as f64)), xhat, w[0]);
}

fn qkv(r: &[&[f32]]) -> Qkv<f32> {
    Qkv { q: r[0].to_vec(), k: r[1].to_vec(), v: r[2].to_vec() }
}

fn block(shape: AttnShape) -> usize {
    ATTN_BLOCK.min(shape.seq).max(1)
}

/// [`attention_forward`] without dropout.
pub(super) fn attn_forward_host(
    shape: AttnShape,
    r: &[&[f32]],
    w: &mut [&mut [f32]],
) -> Result<(), String> {
    let saved = attention_forward(shape, block(shape), None, qkv(r)).map_err(err)?;
    w[0].copy_from_slice(saved.output());
    w[1].copy_from_slice(saved.logsumexp());
    Ok(())
}

/// [`attention_backward`] from the saved state the reads hold.
pub(super) fn attn_backward_host(
    shape: AttnShape,
    r: &[&[f32]],
    w: &mut [&mut [f32]],
) -> Result<(), String> {
    let (o, lse) = (r[3].to_vec(), r[4].to_vec());
    let saved = AttnSaved::from_parts(shape, block(shape), qkv(r), o, lse).map_err(err)?;
    let g = attention_backward(&saved, r[5]).map_err(err)?;
    for (out, grad) in w.iter_mut().zip([&g.dq, &g.dk, &g.dv]) {
        out.copy_from_slice(grad);
    }
    Ok(())
}

/// [`attention_forward_tokens`] without dropout: the module's route (ATTN-5).
pub(super) fn attn_tokens_forward_host(
    shape: AttnShape,
    r: &[&[f32]],
    w: &mut [&mut [f32]],
) -> Result<(), String> {
    let [y, lse] = w else { unreachable!("checked: two writes") };
    let saved =
        attention_forward_tokens(shape, block(shape), None, r[0].to_vec(), y).map_err(err)?;
    lse.copy_from_slice(saved.logsumexp());
    Ok(())
}

/// [`attention_backward_tokens`] from the fused q, k, v and the logsumexp the reads hold.
pub(super) fn attn_tokens_backward_host(
    shape: AttnShape,
    r: &[&[f32]],
    w: &mut [&mut [f32]],
) -> Result<(), String> {
    let saved =
        AttnSaved::from_tokens(shape, block(shape), r[0].to_vec(), r[2].to_vec()).map_err(err)?;
    w[0].copy_from_slice(&attention_backward_tokens(&saved, r[1], r[3]).map_err(err)?);
    Ok(())
}
