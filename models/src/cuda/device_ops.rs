//! The model ops on the CUDA device: each [`Op`] as the cuBLAS products and the kernels of
//! `ops.cu` and `kernels.cu` that compute it, enqueued on the op's stream by the device's
//! `launch_op` once the op is checked and its buffers found (CUDADEV-2, in
//! [`super::device`]). Each mapping gets cudarc views (`CudaView`, `CudaViewMut`) of its
//! buffers, each the handle's `range()` of its allocation (a whole allocation or a
//! [`DeviceBuffer::view`](shardline_collectives::device::DeviceBuffer::view)), and passes
//! the views' lengths as the kernels' sizes, so a launch stays within the views (DEVOP-2).
//!
//! Where the ops differ from their host reference: a kernel cannot refuse its input, so an
//! id or target `>= vocab` (which the host refuses before writing, EMB-3, XENT-2) reads
//! nothing out of the table: the embedding forward writes a zero row for it, its backward
//! adds nothing, and the cross-entropy losses give that row a NaN loss (so the loss shows
//! it) and a zero gradient row. The updates and axpy reuse the 32-bit-indexed kernels of
//! `kernels.cu` (over the views' lengths), so buffers past their range (2^32 - 1 elements; AdamW 2^31 - 1) are
//! `Invalid`. The BatchNorm and attention ops (head and token layouts) are in
//! `device_ops/norm_attn.rs`; an attention head too wide for their kernels' shared memory
//! (`head_dim` past about 2,700) is `Invalid`. The copy, add, multiply, saving activation
//! and the two cross-entropy losses are in `device_ops/elementwise.rs`; the convolution,
//! pooling and exact-route BatchNorm ops (and the f64 conversions) in `device_ops/cnn.rs`,
//! with the kernels of `cnn.cu`.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm as _};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use shardline_collectives::device::{DeviceError, Result};

use super::device::{u64_of, CudaDevice};
use super::{gemm_config, grid, BLOCK};
use crate::backend::GemmShape;
use crate::nn::activation::Activation;
use crate::ops::Op;

/// The kernels of the device's ops, compiled by NVRTC at open.
pub const OPS_CU: &str = include_str!("ops.cu");
/// The kernels of the convolutional models' ops (`device_ops/cnn.rs`), compiled by NVRTC at
/// open as their own module, with [`compile_cnn`]'s options.
pub const CNN_CU: &str = include_str!("cnn.cu");

/// [`CNN_CU`] through NVRTC with `--fmad=false`: no multiply and add contracted into one,
/// so its kernels do the host references' IEEE operations in their order.
pub(in crate::cuda) fn compile_cnn(
) -> std::result::Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError> {
    let opts = cudarc::nvrtc::CompileOptions { fmad: Some(false), ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(CNN_CU, opts)
}

/// Most blocks of a grid-stride launch: enough to fill any GPU, well inside CUDA's limit.
const MAX_BLOCKS: u64 = 1 << 20;
/// Columns per block of the column kernels (`COL_X`, `COL_Y` of ops.cu).
const COL_X: u32 = 32;
const COL_Y: u32 = 8;
/// Blocks of the sum of squares' first pass (fixed by `n`, so the sum's order is).
const SUMSQ_PARTS: u64 = 1024;

/// A grid-stride launch over `n` elements.
fn elems(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row (block-stride over the rows).
fn per_row(rows: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per `COL_X` columns.
fn per_col(cols: u64) -> Result<LaunchConfig> {
    let blocks = cols.div_ceil(u64::from(COL_X)).max(1);
    let blocks = u32::try_from(blocks)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| DeviceError::Invalid(format!("{cols} columns: too many for one grid")))?;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (COL_X, COL_Y, 1), shared_mem_bytes: 0 })
}

/// One block.
fn one_block() -> LaunchConfig {
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// Rows of `width` in `len` elements (the op's check made it exact; 0 for width 0, whose
/// buffers are empty).
fn rows_of(len: usize, width: usize) -> usize {
    len.checked_div(width).unwrap_or(0)
}

/// `n` elements as the 32-bit count of a kernel of kernels.cu; `Invalid` past its range.
fn u32_elems(name: &str, n: usize) -> Result<u32> {
    u32::try_from(n)
        .map_err(|_| DeviceError::Invalid(format!("{name}: {n} elements past 2^32 - 1")))
}

/// Enqueues kernel `$f` on stream `$s` with the given arguments (each a reference to a
/// binding that outlives the launch), mapping a failure to the device's (CUDADEV-3).
macro_rules! kernel {
    ($dev:expr, $what:expr, $s:expr, $f:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let mut b = $s.launch_builder($f);
        $( b.arg($arg); )+
        // SAFETY: the op was checked against its buffers' lengths before the launch
        // (CUDADEV-2), and every kernel bounds its indices by the sizes passed to it, which
        // are those lengths: the lengths of the views it gets (DEVOP-2).
        unsafe { b.launch($cfg) }.map(|_| ()).map_err(|e| $dev.fail(&$what, e))
    }};
}

/// The convolution, pooling and exact BatchNorm ops (after `kernel!`).
mod cnn;
/// The copy, add, multiply, saving activation and cross-entropy ops (after `kernel!`).
mod elementwise;
/// The BatchNorm and attention ops (after `kernel!`, which they use).
mod norm_attn;
#[cfg(test)]
pub(super) use norm_attn::ATTN_LAYOUT_BYTES;

/// The functions of the two NVRTC modules, compiled at [`CudaDevice::open`].
pub(super) struct Kernels {
    fill: CudaFunction,
    relu: CudaFunction,
    relu_bwd: CudaFunction,
    act_fwd: CudaFunction,
    act_bwd: CudaFunction,
    act_fwd_deriv: CudaFunction,
    add: CudaFunction,
    mul: CudaFunction,
    bias_rows: CudaFunction,
    col_sums_add: CudaFunction,
    ln_fwd: CudaFunction,
    ln_bwd_dx: CudaFunction,
    ln_bwd_params: CudaFunction,
    xent_rows: CudaFunction,
    xent_loss: CudaFunction,
    emb_fwd: CudaFunction,
    emb_bwd: CudaFunction,
    sumsq_partial: CudaFunction,
    sumsq_final: CudaFunction,
    clip_scale: CudaFunction,
    norm_sums: CudaFunction,
    bn_stats: CudaFunction,
    bn_invstd: CudaFunction,
    bn_fwd: CudaFunction,
    bn_bwd_reduce: CudaFunction,
    bn_bwd_dx: CudaFunction,
    attn_fwd: CudaFunction,
    attn_bwd_dq: CudaFunction,
    attn_bwd_dkdv: CudaFunction,
    attn_bwd_dkdv_tokens: CudaFunction,
    /// cnn.cu
    conv_im2col: CudaFunction,
    conv_col2im: CudaFunction,
    conv_bias_fill: CudaFunction,
    conv_bias_grad: CudaFunction,
    maxpool_fwd: CudaFunction,
    maxpool_bwd: CudaFunction,
    gap_fwd: CudaFunction,
    gap_bwd: CudaFunction,
    bn_local_stats_rows: CudaFunction,
    bn_local_stats_planes: CudaFunction,
    bn_encode: CudaFunction,
    bn_merge: CudaFunction,
    bn_train_stats: CudaFunction,
    bn_train_fwd: CudaFunction,
    bn_eval: CudaFunction,
    bn_grad_sums_rows: CudaFunction,
    bn_grad_sums_planes: CudaFunction,
    bn_grad_dx: CudaFunction,
    f64_to_f32: CudaFunction,
    f32_to_f64: CudaFunction,
    /// kernels.cu
    axpy: CudaFunction,
    sgd: CudaFunction,
    adamw: CudaFunction,
}

impl Kernels {
    pub(super) fn load(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<Kernels> {
        let failed = |what: &str, e: &dyn std::fmt::Debug| {
            DeviceError::Failed(format!("{what} on cuda:{ordinal}: {e:?}"))
        };
        let module = |name: &str, ptx: std::result::Result<_, cudarc::nvrtc::CompileError>| {
            let ptx = ptx.map_err(|e| failed(&format!("nvrtc compile of {name}"), &e))?;
            ctx.load_module(ptx).map_err(|e| failed(&format!("loading {name}"), &e))
        };
        let ops = module("ops.cu", cudarc::nvrtc::compile_ptx(OPS_CU))?;
        let cnn = module("cnn.cu", compile_cnn())?;
        let base = module("kernels.cu", cudarc::nvrtc::compile_ptx(super::KERNELS_CU))?;
        let f = |m: &Arc<cudarc::driver::CudaModule>, name: &str| {
            m.load_function(name).map_err(|e| failed(&format!("kernel {name}"), &e))
        };
        Ok(Kernels {
            fill: f(&ops, "fill_f32")?,
            relu: f(&ops, "relu_out_f32")?,
            relu_bwd: f(&ops, "relu_bwd_f32")?,
            act_fwd: f(&ops, "act_fwd_f32")?,
            act_bwd: f(&ops, "act_bwd_f32")?,
            act_fwd_deriv: f(&ops, "act_fwd_deriv_f32")?,
            add: f(&ops, "add_f32")?,
            mul: f(&ops, "mul_f32")?,
            bias_rows: f(&ops, "bias_rows_f32")?,
            col_sums_add: f(&ops, "col_sums_add_f32")?,
            ln_fwd: f(&ops, "ln_fwd_f32")?,
            ln_bwd_dx: f(&ops, "ln_bwd_dx_f32")?,
            ln_bwd_params: f(&ops, "ln_bwd_params_f32")?,
            xent_rows: f(&ops, "xent_rows_f32")?,
            xent_loss: f(&ops, "xent_loss_f32")?,
            emb_fwd: f(&ops, "emb_fwd_f32")?,
            emb_bwd: f(&ops, "emb_bwd_f32")?,
            sumsq_partial: f(&ops, "sumsq_partial_f32")?,
            sumsq_final: f(&ops, "sumsq_final_f32")?,
            clip_scale: f(&ops, "clip_scale_f32")?,
            norm_sums: f(&ops, "norm_sums_f32")?,
            bn_stats: f(&ops, "bn_chan_stats_f32")?,
            bn_invstd: f(&ops, "bn_invstd_f32")?,
            bn_fwd: f(&ops, "bn_fwd_f32")?,
            bn_bwd_reduce: f(&ops, "bn_bwd_reduce_f32")?,
            bn_bwd_dx: f(&ops, "bn_bwd_dx_f32")?,
            attn_fwd: f(&ops, "attn_fwd_f32")?,
            attn_bwd_dq: f(&ops, "attn_bwd_dq_f32")?,
            attn_bwd_dkdv: f(&ops, "attn_bwd_dkdv_f32")?,
            attn_bwd_dkdv_tokens: f(&ops, "attn_bwd_dkdv_tokens_f32")?,
            conv_im2col: f(&cnn, "conv_im2col_f32")?,
            conv_col2im: f(&cnn, "conv_col2im_f32")?,
            conv_bias_fill: f(&cnn, "conv_bias_fill_f32")?,
            conv_bias_grad: f(&cnn, "conv_bias_grad_f32")?,
            maxpool_fwd: f(&cnn, "maxpool_fwd_f32")?,
            maxpool_bwd: f(&cnn, "maxpool_bwd_f32")?,
            gap_fwd: f(&cnn, "gap_fwd_f32")?,
            gap_bwd: f(&cnn, "gap_bwd_f32")?,
            bn_local_stats_rows: f(&cnn, "bn_local_stats_rows_f32")?,
            bn_local_stats_planes: f(&cnn, "bn_local_stats_planes_f32")?,
            bn_encode: f(&cnn, "bn_encode_f32")?,
            bn_merge: f(&cnn, "bn_merge_f32")?,
            bn_train_stats: f(&cnn, "bn_train_stats_f32")?,
            bn_train_fwd: f(&cnn, "bn_train_fwd_f32")?,
            bn_eval: f(&cnn, "bn_eval_f32")?,
            bn_grad_sums_rows: f(&cnn, "bn_grad_sums_rows_f32")?,
            bn_grad_sums_planes: f(&cnn, "bn_grad_sums_planes_f32")?,
            bn_grad_dx: f(&cnn, "bn_grad_dx_f32")?,
            f64_to_f32: f(&cnn, "f64_to_f32")?,
            f32_to_f64: f(&cnn, "f32_to_f64")?,
            axpy: f(&base, "axpy_f32")?,
            sgd: f(&base, "sgd_f32")?,
            adamw: f(&base, "adamw_f32")?,
        })
    }
}

/// The `kind` of ops.cu's activation kernels.
fn activation_kind(a: Activation) -> i32 {
    match a {
        Activation::Gelu => 0,
        Activation::GeluTanh => 1,
        Activation::Silu => 2,
    }
}

/// Whether `op` runs cuBLAS (its stream's handle is made before the buffers are taken).
pub(super) fn uses_blas(op: &Op) -> bool {
    matches!(
        op,
        Op::Gemm { .. }
            | Op::LinearForward(_)
            | Op::LinearBackward { .. }
            | Op::Conv2dForward(_)
            | Op::Conv2dBackward(_)
    )
}

impl CudaDevice {
    /// Zeros the first `len` values of `c` on `cs`: the result of a product over an empty
    /// inner dimension.
    pub(super) fn zero_fill(
        &self,
        what: &str,
        cs: &CudaStream,
        c: &mut CudaViewMut<'_, f32>,
        len: usize,
    ) -> Result<()> {
        let (len, zero) = (u64_of(len), 0.0f32);
        if len == 0 {
            return Ok(());
        }
        kernel!(self, format!("{what}: zero"), cs, &self.k.fill, elems(len), &mut *c, &zero, &len)
    }

    /// Row-major `c = op(a) op(b)` (`+=` when `accumulate`) through cuBLAS, whose handle is
    /// bound to the op's stream ([`gemm_config`], as `Cuda::gemm_dev`).
    #[allow(clippy::too_many_arguments)]
    fn sgemm(
        &self,
        what: &str,
        blas: &CudaBlas,
        cs: &CudaStream,
        shape: GemmShape,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        c: &mut CudaViewMut<'_, f32>,
        accumulate: bool,
    ) -> Result<()> {
        let GemmShape { m, n, k, .. } = shape;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            // An empty sum: zero, or nothing to add.
            if !accumulate {
                self.zero_fill(what, cs, c, m * n)?;
            }
            return Ok(());
        }
        let cfg = gemm_config(shape, accumulate)
            .map_err(|v| DeviceError::Invalid(format!("{what}: dimension {v} past 2^31 - 1")))?;
        // SAFETY: the op's check (CUDADEV-2) gave the views `a` m*k, `b` k*n and `c` at
        // least m*n elements (c may be a longer gradient buffer whose first m*n are the
        // product), so every access the dimensions and leading dimensions allow is inside
        // the views (DEVOP-2); `c` is borrowed mutably, from another allocation than `a`, `b`.
        unsafe { blas.gemm(cfg, b, a, c) }
            .map_err(|e| self.fail(&format!("{what}: cublas sgemm"), e))
    }

    /// Enqueues `op` on `cs` over its buffers' views (each `range()` of its allocation,
    /// DEVOP-2); `rl`, `wl` are the views' lengths, which the kernels bound their indices by.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_op(
        &self,
        op: &Op,
        cs: &Arc<CudaStream>,
        blas: Option<&CudaBlas>,
        r: &[CudaView<'_, f32>],
        w: &mut [CudaViewMut<'_, f32>],
        rl: &[usize],
        wl: &[usize],
    ) -> Result<()> {
        let name = op.label();
        let what = |step: &str| format!("{name}: {step}");
        let k = &self.k;
        let blas = || blas.ok_or_else(|| DeviceError::Invalid(format!("{name}: no cuBLAS handle")));
        match op {
            Op::ClipScale { max_norm } => {
                let n = u64_of(wl[0]);
                if n > 0 {
                    let cfg = elems(n);
                    kernel!(
                        self,
                        what("clip"),
                        cs,
                        &k.clip_scale,
                        cfg,
                        &r[0],
                        &mut w[0],
                        max_norm,
                        &n
                    )?;
                }
            }
            Op::NormSums { units, stop } => {
                let units = u64_of(*units);
                let cfg =
                    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
                kernel!(
                    self,
                    what("sums"),
                    cs,
                    &k.norm_sums,
                    cfg,
                    &r[0],
                    &r[1],
                    &mut w[0],
                    &units,
                    stop
                )?;
            }
            Op::Fill { value } => {
                let n = u64_of(wl[0]);
                if n > 0 {
                    kernel!(self, what("fill"), cs, &k.fill, elems(n), &mut w[0], value, &n)?;
                }
            }
            Op::Axpy { alpha } => {
                let n = u32_elems(name, rl[0])?;
                if n > 0 {
                    kernel!(
                        self,
                        what("axpy"),
                        cs,
                        &k.axpy,
                        grid(n as usize),
                        alpha,
                        &r[0],
                        &mut w[0],
                        &n
                    )?;
                }
            }
            Op::Gemm { shape, accumulate } => {
                self.sgemm(name, blas()?, cs, *shape, &r[0], &r[1], &mut w[0], *accumulate)?;
            }
            Op::LinearForward(l) => {
                let rows = rows_of(rl[1], l.in_dim);
                if rows * l.out_dim == 0 {
                    return Ok(());
                }
                if l.bias {
                    let (offset, rows64, out) =
                        (u64_of(l.out_dim * l.in_dim), u64_of(rows), u64_of(l.out_dim));
                    kernel!(
                        self,
                        what("bias rows"),
                        cs,
                        &k.bias_rows,
                        elems(rows64 * out),
                        &r[0],
                        &offset,
                        &mut w[0],
                        &rows64,
                        &out,
                    )?;
                }
                let shape =
                    GemmShape { m: rows, n: l.out_dim, k: l.in_dim, trans_a: false, trans_b: true };
                self.sgemm(name, blas()?, cs, shape, &r[1], &r[0], &mut w[0], l.bias)?;
            }
            Op::LinearBackward { linear: l, input_grad } => {
                let rows = rows_of(rl[1], l.in_dim);
                let (grads, rest) = w
                    .split_first_mut()
                    .ok_or_else(|| DeviceError::Invalid(format!("{name}: no grads")))?;
                let (params, x, dy) = (&r[0], &r[1], &r[2]);
                if *input_grad {
                    let dx = rest
                        .first_mut()
                        .ok_or_else(|| DeviceError::Invalid(format!("{name}: no dx")))?;
                    // dx = dy W
                    let shape = GemmShape {
                        m: rows,
                        n: l.in_dim,
                        k: l.out_dim,
                        trans_a: false,
                        trans_b: false,
                    };
                    self.sgemm(name, blas()?, cs, shape, dy, params, dx, false)?;
                }
                // dW += dy^T x, into the first out * in elements of grads.
                let shape =
                    GemmShape { m: l.out_dim, n: l.in_dim, k: rows, trans_a: true, trans_b: false };
                self.sgemm(name, blas()?, cs, shape, dy, x, grads, true)?;
                if l.bias && rows > 0 && l.out_dim > 0 {
                    // db += column sums of dy
                    let (offset, rows64, out) =
                        (u64_of(l.out_dim * l.in_dim), u64_of(rows), u64_of(l.out_dim));
                    kernel!(
                        self,
                        what("bias gradient"),
                        cs,
                        &k.col_sums_add,
                        per_col(out)?,
                        dy,
                        &mut *grads,
                        &offset,
                        &rows64,
                        &out,
                    )?;
                }
            }
            Op::Relu => {
                let n = u64_of(rl[0]);
                if n > 0 {
                    kernel!(self, what("relu"), cs, &k.relu, elems(n), &r[0], &mut w[0], &n)?;
                }
            }
            Op::ReluBackward => {
                let n = u64_of(rl[0]);
                if n > 0 {
                    kernel!(
                        self,
                        what("relu"),
                        cs,
                        &k.relu_bwd,
                        elems(n),
                        &r[0],
                        &r[1],
                        &mut w[0],
                        &n
                    )?;
                }
            }
            Op::Activation(a) => {
                let (n, kind) = (u64_of(rl[0]), activation_kind(*a));
                if n > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.act_fwd,
                        elems(n),
                        &r[0],
                        &mut w[0],
                        &kind,
                        &n
                    )?;
                }
            }
            Op::ActivationBackward(a) => {
                let (n, kind) = (u64_of(rl[0]), activation_kind(*a));
                if n > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.act_bwd,
                        elems(n),
                        &r[0],
                        &r[1],
                        &mut w[0],
                        &kind,
                        &n,
                    )?;
                }
            }
            Op::LayerNormForward(ln) => {
                let rows = rows_of(rl[1], ln.dim);
                if rows == 0 {
                    return Ok(());
                }
                let (rows64, dim, bias, eps) =
                    (u64_of(rows), u64_of(ln.dim), i32::from(ln.bias), ln.eps);
                let [y, mean, rstd] = w else {
                    return Err(DeviceError::Invalid(format!("{name}: three writes expected")));
                };
                kernel!(
                    self,
                    what("kernel"),
                    cs,
                    &k.ln_fwd,
                    per_row(rows64),
                    &r[0],
                    &r[1],
                    &mut *y,
                    &mut *mean,
                    &mut *rstd,
                    &rows64,
                    &dim,
                    &bias,
                    &eps,
                )?;
            }
            Op::LayerNormBackward(ln) => {
                let rows = rows_of(rl[1], ln.dim);
                if rows == 0 {
                    return Ok(());
                }
                let (rows64, dim, bias) = (u64_of(rows), u64_of(ln.dim), i32::from(ln.bias));
                let [dx, grads] = w else {
                    return Err(DeviceError::Invalid(format!("{name}: two writes expected")));
                };
                let (params, x, mean, rstd, dy) = (&r[0], &r[1], &r[2], &r[3], &r[4]);
                kernel!(
                    self,
                    what("input gradient"),
                    cs,
                    &k.ln_bwd_dx,
                    per_row(rows64),
                    params,
                    x,
                    mean,
                    rstd,
                    dy,
                    &mut *dx,
                    &rows64,
                    &dim,
                )?;
                kernel!(
                    self,
                    what("parameter gradients"),
                    cs,
                    &k.ln_bwd_params,
                    per_col(dim)?,
                    x,
                    mean,
                    rstd,
                    dy,
                    &mut *grads,
                    &rows64,
                    &dim,
                    &bias,
                )?;
            }
            Op::EmbeddingForward(e) => {
                let (n, dim, vocab) = (u64_of(rl[1]), u64_of(e.dim), u64_of(e.vocab));
                if n * dim > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.emb_fwd,
                        elems(n * dim),
                        &r[0],
                        &r[1],
                        &mut w[0],
                        &n,
                        &dim,
                        &vocab,
                    )?;
                }
            }
            Op::EmbeddingBackward(e) => {
                let (n, dim, vocab) = (u64_of(rl[0]), u64_of(e.dim), u64_of(e.vocab));
                if n * dim > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.emb_bwd,
                        elems(n * dim),
                        &r[0],
                        &r[1],
                        &mut w[0],
                        &n,
                        &dim,
                        &vocab,
                    )?;
                }
            }
            Op::SumSquares => {
                let n = u64_of(rl[0]);
                // A grid fixed by n, so the partials and their sum's order are.
                let parts = n.div_ceil(u64::from(BLOCK)).clamp(1, SUMSQ_PARTS);
                let (mut partial, _counted) =
                    self.scratch::<f64>(cs, parts as usize, "sum of squares partials")?;
                let cfg = LaunchConfig {
                    grid_dim: (parts as u32, 1, 1),
                    block_dim: (BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                };
                kernel!(
                    self,
                    what("partials"),
                    cs,
                    &k.sumsq_partial,
                    cfg,
                    &r[0],
                    &mut partial,
                    &n
                )?;
                kernel!(
                    self,
                    what("total"),
                    cs,
                    &k.sumsq_final,
                    one_block(),
                    &partial,
                    &parts,
                    &mut w[0],
                )?;
            }
            Op::Sgd(s) => {
                let n = u32_elems(name, wl[0])?;
                if n == 0 {
                    return Ok(());
                }
                let (nest, first) = (i32::from(s.nesterov), i32::from(s.step <= 1));
                let [p, buf] = w else {
                    return Err(DeviceError::Invalid(format!("{name}: two writes expected")));
                };
                // Without momentum the kernel never touches `buf` (which may be shorter, even
                // an empty view): it gets the view's address and never reads through it.
                kernel!(
                    self,
                    what("kernel"),
                    cs,
                    &k.sgd,
                    grid(n as usize),
                    &mut *p,
                    &r[0],
                    &mut *buf,
                    &s.lr,
                    &s.momentum,
                    &s.dampening,
                    &s.weight_decay,
                    &nest,
                    &first,
                    &n,
                )?;
            }
            Op::AdamW(a) => {
                // adamw_f32 indexes the state with 2 * i in 32 bits.
                let n = u32::try_from(wl[0]).ok().filter(|&n| n <= i32::MAX as u32).ok_or_else(
                    || DeviceError::Invalid(format!("{name}: {} elements past 2^31 - 1", wl[0])),
                )?;
                if n == 0 {
                    return Ok(());
                }
                let (step_size, bc2_sqrt, decay) = a.scalars();
                let [p, st] = w else {
                    return Err(DeviceError::Invalid(format!("{name}: two writes expected")));
                };
                kernel!(
                    self,
                    what("kernel"),
                    cs,
                    &k.adamw,
                    grid(n as usize),
                    &mut *p,
                    &r[0],
                    &mut *st,
                    &step_size,
                    &bc2_sqrt,
                    &a.beta1,
                    &a.beta2,
                    &a.eps,
                    &decay,
                    &n,
                )?;
            }
            Op::BatchNormStats { .. }
            | Op::BatchNormForward { .. }
            | Op::BatchNormBackwardReduce { .. }
            | Op::BatchNormBackwardDx { .. }
            | Op::AttentionForward(_)
            | Op::AttentionBackward(_)
            | Op::AttentionForwardTokens(_)
            | Op::AttentionBackwardTokens(_) => self.run_norm_attn(op, cs, r, w)?,
            Op::Copy
            | Op::Add
            | Op::Mul
            | Op::ActivationSavingDerivative(_)
            | Op::CrossEntropy { .. }
            | Op::SoftmaxCrossEntropy { .. } => self.run_elementwise(op, cs, r, w, rl)?,
            Op::Conv2dForward(_) | Op::Conv2dBackward(_) => self.run_conv(op, cs, blas()?, r, w)?,
            Op::MaxPoolForward(_)
            | Op::MaxPoolBackward(_)
            | Op::GlobalAvgPool(_)
            | Op::GlobalAvgPoolBackward(_)
            | Op::BatchNormLocalStats(_)
            | Op::BatchNormEncode { .. }
            | Op::BatchNormMerge { .. }
            | Op::BatchNormTrain { .. }
            | Op::BatchNormEval { .. }
            | Op::BatchNormGradSums(_)
            | Op::BatchNormGradDx(_)
            | Op::F64ToF32
            | Op::F32ToF64 => self.run_cnn(op, cs, r, w)?,
        }
        Ok(())
    }
}
