//! The BatchNorm (training mode) and causal attention ops on the CUDA device: the kernels
//! `bn_*` and `attn_*` of `ops.cu`, with 64-bit sizes; the op's check (CUDADEV-2) made the
//! buffers' lengths those sizes.
//!
//! Launch shapes: the per-channel reductions (`bn_stats_f32`, `bn_bwd_reduce_f32`) take one
//! block of 256 threads per channel, the elementwise ones a grid-stride grid; the attention
//! kernels one block of 256 threads per query row (forward, `dq`) or key row (`dk`, `dv`),
//! block-stride over the `batch * heads * seq` rows, with the row's vectors, its
//! accumulators and a tile of 256 probabilities in dynamic shared memory. The backward's
//! `dk`, `dv` are sums over queries made by the key row's own block: no atomics, so they
//! are as deterministic as the forward.

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
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

/// `(rows, seq, head_dim, scale)` of an attention call, the scale as the host's f32 kernel
/// computes it (`1 / sqrt(head_dim)` in f32).
fn attn_dims(a: &AttnShape) -> (u64, u64, u64, f32) {
    let scale = 1.0f32 / (a.head_dim as f32).sqrt();
    (u64_of(a.rows()), u64_of(a.seq), u64_of(a.head_dim), scale)
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
            Op::AttentionForward(a) => {
                let (rows, seq, d, scale) = attn_dims(a);
                let [out, lse] = w else { return Err(writes(2)) };
                if rows * d == 0 {
                    return Ok(());
                }
                // q, acc [d]; p [256].
                let cfg = attn_rows(name, rows, 2 * a.head_dim + BLOCK as usize, a.head_dim)?;
                kernel!(
                    self,
                    what("kernel"),
                    cs,
                    &k.attn_fwd,
                    cfg,
                    &r[0],
                    &r[1],
                    &r[2],
                    &mut *out,
                    &mut *lse,
                    &rows,
                    &seq,
                    &d,
                    &scale,
                )?;
            }
            Op::AttentionBackward(a) => {
                let (rows, seq, d, scale) = attn_dims(a);
                let [dq, dk, dv] = w else { return Err(writes(3)) };
                if rows * d == 0 {
                    return Ok(());
                }
                let (q, kk, v, out, lse, dout) = (&r[0], &r[1], &r[2], &r[3], &r[4], &r[5]);
                // q, dout, acc [d]; ds [256]. Then k, v, two accumulators [d]; p, ds [256].
                let dq_cfg = attn_rows(name, rows, 3 * a.head_dim + BLOCK as usize, a.head_dim)?;
                let dkv_cfg =
                    attn_rows(name, rows, 4 * a.head_dim + 2 * BLOCK as usize, a.head_dim)?;
                // D_i = dout_i . out_i per query row, from the first pass to the second.
                let (mut dsum, _counted) =
                    self.scratch::<f32>(cs, a.rows(), "attention backward row sums")?;
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
                    &rows,
                    &seq,
                    &d,
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
                    &rows,
                    &seq,
                    &d,
                    &scale,
                )?;
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
