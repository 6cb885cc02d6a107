//! The BatchNorm (training mode) and causal attention ops on the CUDA device: the kernels
//! `bn_*` and `attn_*` of `ops.cu`, with 64-bit sizes; the op's check (CUDADEV-2) made the
//! buffers' lengths those sizes. The attention ops on the head layout
//! (`Op::AttentionForward`, `Op::AttentionBackward`) and on nanoGPT's token layout
//! (`Op::AttentionForwardTokens`, `Op::AttentionBackwardTokens`: q, k, v read in place from
//! the fused `[batch, seq, 3 embd]` buffer, the output `[batch, seq, embd]`, the gradient
//! `dqkv` written like `qkv`) share the kernels, told where the rows lie by an
//! [`AttnLayout`].
//!
//! Launch shapes: the per-channel reductions (`bn_stats_f32`, `bn_bwd_reduce_f32`) take one
//! block of 256 threads per channel, the elementwise ones a grid-stride grid; the attention
//! kernels one block of 256 threads per query row (forward, `dq`) or key row (`dk`, `dv`),
//! block-stride over the `batch * heads * seq` rows, with the row's vectors, its
//! accumulators and a tile of 256 probabilities in dynamic shared memory. The backward's
//! `dk`, `dv` are sums over queries made by the key row's own block: no atomics, so they
//! are as deterministic as the forward.

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use shardline_collectives::device::{DeviceError, Result};

use super::{elems, per_row, CudaDevice, BLOCK, MAX_BLOCKS};
use crate::cuda::device::u64_of;
use crate::nn::attention::AttnShape;
use crate::ops::Op;

/// Bytes of dynamic shared memory a block may take without opting in (48 KiB), less what
/// the attention kernels' reductions take statically (at most 3 KiB) and a margin.
const SHARED_BYTES: usize = 48 * 1024 - 4 * 1024;

/// One block of `BLOCK` threads per row, `floats` f32 values of dynamic shared memory;
/// `Invalid` where they do not fit (a `head_dim` in the thousands).
fn attn_rows(name: &str, rows: u64, floats: usize, head_dim: usize) -> Result<LaunchConfig> {
    let bytes = floats * std::mem::size_of::<f32>();
    if bytes > SHARED_BYTES {
        return Err(DeviceError::Invalid(format!(
            "{name}: head_dim {head_dim} needs {bytes} bytes of shared memory, past {SHARED_BYTES}"
        )));
    }
    Ok(LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: bytes as u32,
    })
}

/// The scale of an attention call's scores as the host's f32 kernel computes it
/// (`1 / sqrt(head_dim)` in f32).
fn attn_scale(a: &AttnShape) -> f32 {
    1.0f32 / (a.head_dim as f32).sqrt()
}

/// Where the rows of each (batch, head) of an attention call's buffers lie: `ops.cu`'s
/// `AttnLayout`, the same twelve `u64` fields in the same order (which the kernels take by
/// value; `ops.cu` asserts the size). Row `i` of (batch `b`, head `h`) of q at
/// `b * in_bs + h * in_hs + i * in_ld`, of k and v `k_off` and `v_off` further (their
/// gradients at the same places), of the output and its gradient at
/// `b * out_bs + h * out_hs + i * out_ld`; the logsumexp is `[batch, heads, seq]` in both
/// layouts.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AttnLayout {
    rows: u64,
    heads: u64,
    seq: u64,
    d: u64,
    in_ld: u64,
    in_hs: u64,
    in_bs: u64,
    k_off: u64,
    v_off: u64,
    out_ld: u64,
    out_hs: u64,
    out_bs: u64,
}

// SAFETY: twelve `u64` fields in C layout, no padding, no pointers: the bytes of `ops.cu`'s
// `struct AttnLayout` (the same fields in the same order, 96 bytes, asserted there), which
// the attention kernels take by value.
unsafe impl DeviceRepr for AttnLayout {}

/// Bytes of an [`AttnLayout`] kernel parameter: `ops.cu` asserts the same size, and the NVRTC
/// test finds it in the attention kernels' PTX.
pub(in crate::cuda) const ATTN_LAYOUT_BYTES: usize = 96;
const _: () = assert!(std::mem::size_of::<AttnLayout>() == ATTN_LAYOUT_BYTES);

impl AttnLayout {
    /// The head layout (`[batch, heads, seq, head_dim]`, q, k, v each its own buffer), or
    /// with `tokens` nanoGPT's: q, k, v the parts of the fused `[batch, seq, 3 embd]`
    /// buffer, the output `[batch, seq, embd]` (ATTN-5).
    fn of(a: &AttnShape, tokens: bool) -> AttnLayout {
        let (seq, d, heads) = (u64_of(a.seq), u64_of(a.head_dim), u64_of(a.heads));
        let rows = u64_of(a.rows());
        if tokens {
            let embd = heads * d;
            AttnLayout {
                rows,
                heads,
                seq,
                d,
                in_ld: 3 * embd,
                in_hs: d,
                in_bs: seq * 3 * embd,
                k_off: embd,
                v_off: 2 * embd,
                out_ld: embd,
                out_hs: d,
                out_bs: seq * embd,
            }
        } else {
            let (hs, bs) = (seq * d, heads * seq * d);
            AttnLayout {
                rows,
                heads,
                seq,
                d,
                in_ld: d,
                in_hs: hs,
                in_bs: bs,
                k_off: 0,
                v_off: 0,
                out_ld: d,
                out_hs: hs,
                out_bs: bs,
            }
        }
    }
}

impl CudaDevice {
    /// Enqueues a BatchNorm or attention op on `cs` over its (checked) views.
    pub(super) fn run_norm_attn(
        &self,
        op: &Op,
        cs: &Arc<CudaStream>,
        r: &[CudaView<'_, f32>],
        w: &mut [CudaViewMut<'_, f32>],
    ) -> Result<()> {
        let name = op.label();
        let what = |step: &str| format!("{name}: {step}");
        let k = &self.k;
        let writes = |n: usize| DeviceError::Invalid(format!("{name}: {n} writes expected"));
        match op {
            Op::BatchNormStats { n, c, s } => {
                let (n, c, s) = (u64_of(*n), u64_of(*c), u64_of(*s));
                let [mean, m2] = w else { return Err(writes(2)) };
                if c > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.bn_stats,
                        per_row(c),
                        &r[0],
                        &mut *mean,
                        &mut *m2,
                        &n,
                        &c,
                        &s,
                    )?;
                }
            }
            Op::BatchNormForward { n, c, s, count, eps } => {
                let (n, c, s, count) = (u64_of(*n), u64_of(*c), u64_of(*s), *count as f64);
                let [y, xhat, invstd] = w else { return Err(writes(3)) };
                let (x, params, mean, m2) = (&r[0], &r[1], &r[2], &r[3]);
                if c > 0 {
                    let cfg = elems(c);
                    kernel!(
                        self,
                        what("invstd"),
                        cs,
                        &k.bn_invstd,
                        cfg,
                        m2,
                        &mut *invstd,
                        &c,
                        &count,
                        eps
                    )?;
                }
                if n * c * s > 0 {
                    // Written above, read here: a read view of the written one (its
                    // tracking is the allocation's, so the launch waits for the write).
                    let invstd = invstd.as_view();
                    kernel!(
                        self,
                        what("normalize"),
                        cs,
                        &k.bn_fwd,
                        elems(n * c * s),
                        params,
                        x,
                        mean,
                        &invstd,
                        &mut *y,
                        &mut *xhat,
                        &n,
                        &c,
                        &s,
                    )?;
                }
            }
            Op::BatchNormBackwardReduce { n, c, s } => {
                let (n, c, s) = (u64_of(*n), u64_of(*c), u64_of(*s));
                let [sums, grads] = w else { return Err(writes(2)) };
                if c > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.bn_bwd_reduce,
                        per_row(c),
                        &r[0],
                        &r[1],
                        &mut *sums,
                        &mut *grads,
                        &n,
                        &c,
                        &s,
                    )?;
                }
            }
            Op::BatchNormBackwardDx { n, c, s, count } => {
                let (n, c, s, count) = (u64_of(*n), u64_of(*c), u64_of(*s), *count as f64);
                let (params, xhat, invstd, sums, dy) = (&r[0], &r[1], &r[2], &r[3], &r[4]);
                let [dx] = w else { return Err(writes(1)) };
                if n * c * s > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.bn_bwd_dx,
                        elems(n * c * s),
                        params,
                        xhat,
                        invstd,
                        sums,
                        dy,
                        &mut *dx,
                        &n,
                        &c,
                        &s,
                        &count,
                    )?;
                }
            }
            Op::AttentionForward(a) | Op::AttentionForwardTokens(a) => {
                let tokens = matches!(op, Op::AttentionForwardTokens(_));
                let (layout, scale) = (AttnLayout::of(a, tokens), attn_scale(a));
                let [out, lse] = w else { return Err(writes(2)) };
                if layout.rows * layout.d == 0 {
                    return Ok(());
                }
                // q, acc [d]; p [256].
                let cfg =
                    attn_rows(name, layout.rows, 2 * a.head_dim + BLOCK as usize, a.head_dim)?;
                // The token layout's q, k and v are the one qkv buffer (three reads of it).
                let (q, kk, v) = if tokens { (&r[0], &r[0], &r[0]) } else { (&r[0], &r[1], &r[2]) };
                kernel!(
                    self,
                    what("kernel"),
                    cs,
                    &k.attn_fwd,
                    cfg,
                    q,
                    kk,
                    v,
                    &mut *out,
                    &mut *lse,
                    &layout,
                    &scale,
                )?;
            }
            Op::AttentionBackward(a) | Op::AttentionBackwardTokens(a) => {
                let tokens = matches!(op, Op::AttentionBackwardTokens(_));
                let (layout, scale) = (AttnLayout::of(a, tokens), attn_scale(a));
                if layout.rows * layout.d == 0 {
                    return Ok(());
                }
                // Heads: q, k, v, out, lse, dout; tokens: qkv, y, lse, dy.
                let ((q, kk, v), (out, lse, dout)) = if tokens {
                    ((&r[0], &r[0], &r[0]), (&r[1], &r[2], &r[3]))
                } else {
                    ((&r[0], &r[1], &r[2]), (&r[3], &r[4], &r[5]))
                };
                // q, dout, acc [d]; ds [256]. Then k, v, two accumulators [d]; p, ds [256].
                let dq_cfg =
                    attn_rows(name, layout.rows, 3 * a.head_dim + BLOCK as usize, a.head_dim)?;
                let dkv_cfg =
                    attn_rows(name, layout.rows, 4 * a.head_dim + 2 * BLOCK as usize, a.head_dim)?;
                // D_i = dout_i . out_i per query row, from the first pass to the second.
                let (mut dsum, _counted) =
                    self.scratch::<f32>(cs, a.rows(), "attention backward row sums")?;
                if tokens {
                    // dq, dk and dv are the q, k and v columns of the one dqkv buffer.
                    let [dqkv] = w else { return Err(writes(1)) };
                    kernel!(
                        self,
                        what("dq"),
                        cs,
                        &k.attn_bwd_dq,
                        dq_cfg,
                        q,
                        kk,
                        v,
                        out,
                        lse,
                        dout,
                        &mut *dqkv,
                        &mut dsum,
                        &layout,
                        &scale,
                    )?;
                    kernel!(
                        self,
                        what("dk, dv"),
                        cs,
                        &k.attn_bwd_dkdv_tokens,
                        dkv_cfg,
                        q,
                        lse,
                        dout,
                        &dsum,
                        &mut *dqkv,
                        &layout,
                        &scale,
                    )?;
                } else {
                    let [dq, dk, dv] = w else { return Err(writes(3)) };
                    kernel!(
                        self,
                        what("dq"),
                        cs,
                        &k.attn_bwd_dq,
                        dq_cfg,
                        q,
                        kk,
                        v,
                        out,
                        lse,
                        dout,
                        &mut *dq,
                        &mut dsum,
                        &layout,
                        &scale,
                    )?;
                    kernel!(
                        self,
                        what("dk, dv"),
                        cs,
                        &k.attn_bwd_dkdv,
                        dkv_cfg,
                        q,
                        kk,
                        v,
                        lse,
                        dout,
                        &dsum,
                        &mut *dk,
                        &mut *dv,
                        &layout,
                        &scale,
                    )?;
                }
            }
            _ => {
                return Err(DeviceError::Invalid(format!(
                    "{name}: not a BatchNorm or attention op"
                )))
            }
        }
        Ok(())
    }
}
