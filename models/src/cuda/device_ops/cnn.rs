//! The convolutional models' ops on the CUDA device (their length rules and host references
//! are in `ops/cnn.rs`): the convolution as im2col, cuBLAS products and a col2im gather; max
//! and global average pooling; BatchNorm on the exact route (statistics in f64 as element
//! pairs, SyncBatchNorm's records merged in rank order); the f64 conversions. The kernels
//! are `cnn.cu`'s, compiled without multiply-add contraction ([`super::compile_cnn`]), with
//! 64-bit sizes from the op's dimensions, which the op's check (CUDADEV-2) made the views'
//! lengths (DEVOP-2).
//!
//! Where they differ from their host reference:
//! - The convolution's products are cuBLAS's (strided-batched over a chunk of samples for
//!   the forward and the column gradients, one accumulating product per sample for the
//!   weight gradient, in sample order), equal to the host's to rounding; every other step
//!   (im2col, the bias fill and bias gradient, col2im) does the host's operations in its
//!   order. The columns of a chunk of samples (at most [`COL_BUDGET`] elements, at least
//!   one sample) are a stream-ordered temporary of the op.
//! - Pooling, the BatchNorm statistics, merge, normalisation, gradient sums and input
//!   gradient, and the conversions give the host's bits: the same IEEE operations in the
//!   same order (the sums sequential where the host's are, the threads of a block summing
//!   planes that one thread then adds in order). No atomics anywhere.
//! - The max pooling backward is a gather: an input element sums the gradients of the
//!   outputs whose window covers it and whose argmax it is, so an argmax outside its
//!   output's window (which the forward never writes, and the host would follow) routes
//!   nothing.
//! - `Op::BatchNormTrain` with a count of at most 1 (BN-4), which the host refuses before
//!   writing: a kernel cannot refuse, and the device has no error flag to raise, so the
//!   kernel writes NaN invstd (hence NaN `y` and `xhat`), still writes the count, and
//!   leaves the running statistics and `num_batches_tracked` as they were. The host
//!   reference's check is the only refusal.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm as _, StridedBatchedConfig};
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, PushKernelArg};
use shardline_collectives::device::{DeviceError, Result};

use super::{elems, gemm_config, per_row, CudaDevice};
use crate::backend::GemmShape;
use crate::cuda::device::u64_of;
use crate::ops::{ConvDims, Op};

/// Most column elements of one chunk of a convolution (64 MiB of f32); a chunk has at least
/// one sample whatever its columns take.
pub(super) const COL_BUDGET: usize = 1 << 24;

/// A strided batch of products: `count` of them, operand `i` of each at `i * stride` (0: the
/// same matrix for every product).
#[derive(Clone, Copy, Debug)]
struct Batch {
    count: usize,
    stride_a: usize,
    stride_b: usize,
    stride_c: usize,
}

/// A convolution's sizes: input planes `h * w`, output planes `ho * wo = p`, columns
/// `kk = in * k * k` per output position, per-sample lengths, the weight's length.
#[derive(Clone, Copy, Debug)]
struct ConvSizes {
    n: usize,
    cin: usize,
    cout: usize,
    h: u64,
    w: u64,
    k: u64,
    stride: u64,
    pad: u64,
    ho: u64,
    wo: u64,
    p: usize,
    kk: usize,
    in_len: usize,
    out_len: usize,
    weight: usize,
    /// Samples per chunk (at least 1).
    chunk: usize,
}

impl ConvSizes {
    fn of(d: &ConvDims) -> ConvSizes {
        let c = &d.conv;
        let (ho, wo) = (c.out_size(d.h), c.out_size(d.w));
        let (p, kk) = (ho * wo, c.in_channels * c.kernel * c.kernel);
        ConvSizes {
            n: d.n,
            cin: c.in_channels,
            cout: c.out_channels,
            h: u64_of(d.h),
            w: u64_of(d.w),
            k: u64_of(c.kernel),
            stride: u64_of(c.stride),
            pad: u64_of(c.padding),
            ho: u64_of(ho),
            wo: u64_of(wo),
            p,
            kk,
            in_len: c.in_channels * d.h * d.w,
            out_len: c.out_channels * p,
            weight: c.out_channels * kk,
            chunk: (COL_BUDGET / (kk * p).max(1)).clamp(1, d.n.max(1)),
        }
    }
}

/// `v[range]`, `Invalid` (never a panic) where the range is not inside the view.
fn sub<'a>(
    name: &str,
    v: &CudaView<'a, f32>,
    range: std::ops::Range<usize>,
) -> Result<CudaView<'a, f32>> {
    let len = v.len();
    v.try_slice(range.clone()).ok_or_else(|| {
        DeviceError::Invalid(format!("{name}: elements {range:?} of a view of {len}"))
    })
}

/// `v[range]` writable, `Invalid` where the range is not inside the view.
fn sub_mut<'b>(
    name: &str,
    v: &'b mut CudaViewMut<'_, f32>,
    range: std::ops::Range<usize>,
) -> Result<CudaViewMut<'b, f32>> {
    let len = v.len();
    v.try_slice_mut(range.clone()).ok_or_else(|| {
        DeviceError::Invalid(format!("{name}: elements {range:?} of a view of {len}"))
    })
}

impl CudaDevice {
    /// `count` row-major products `c_i = op(a_i) op(b_i)` (`+=` when `accumulate`) through
    /// cuBLAS's strided-batched sgemm on `cs` (the handle is bound to it), operand `i` at `i`
    /// times its stride ([`gemm_config`]'s transposition: cuBLAS's first operand is `b`).
    #[allow(clippy::too_many_arguments)]
    fn sgemm_batched(
        &self,
        what: &str,
        blas: &CudaBlas,
        cs: &Arc<CudaStream>,
        shape: GemmShape,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        c: &mut CudaViewMut<'_, f32>,
        batch: Batch,
        accumulate: bool,
    ) -> Result<()> {
        let GemmShape { m, n, k, .. } = shape;
        if m == 0 || n == 0 || batch.count == 0 {
            return Ok(());
        }
        let span = |stride: usize, len: usize| (batch.count - 1) * stride + len;
        if a.len() < span(batch.stride_a, m * k)
            || b.len() < span(batch.stride_b, k * n)
            || c.len() < span(batch.stride_c, m * n)
        {
            return Err(DeviceError::Invalid(format!("{what}: a batched product past its views")));
        }
        if k == 0 {
            // Empty sums: zeros, or nothing to add.
            if !accumulate {
                let len = c.len();
                self.zero_fill(what, cs, c, len)?;
            }
            return Ok(());
        }
        let invalid = |v: usize| DeviceError::Invalid(format!("{what}: {v} past 2^31 - 1"));
        let gemm = gemm_config(shape, accumulate).map_err(invalid)?;
        let stride = |v: usize| i64::try_from(v).map_err(|_| invalid(v));
        let cfg = StridedBatchedConfig {
            gemm,
            batch_size: i32::try_from(batch.count).map_err(|_| invalid(batch.count))?,
            // cuBLAS's first operand is the row-major `b`, its second `a`.
            stride_a: stride(batch.stride_b)?,
            stride_b: stride(batch.stride_a)?,
            stride_c: stride(batch.stride_c)?,
        };
        // SAFETY: checked above: each of the `count` products reads `a` at `i * stride_a` for
        // m*k elements, `b` at `i * stride_b` for k*n and writes `c` at `i * stride_c` for m*n,
        // all inside the views (DEVOP-2); the c blocks of two products do not overlap (the
        // callers' `stride_c` is at least m*n); `c` is borrowed mutably, from another
        // allocation than `a` and `b`.
        unsafe { blas.gemm_strided_batched(cfg, b, a, c) }
            .map_err(|e| self.fail(&format!("{what}: cublas strided batched sgemm"), e))
    }

    /// Enqueues a convolution's forward or backward on `cs` over its (checked) views, with
    /// `blas` bound to `cs`.
    pub(super) fn run_conv(
        &self,
        op: &Op,
        cs: &Arc<CudaStream>,
        blas: &CudaBlas,
        r: &[CudaView<'_, f32>],
        w: &mut [CudaViewMut<'_, f32>],
    ) -> Result<()> {
        let name = op.label();
        let writes = |n: usize| DeviceError::Invalid(format!("{name}: {n} writes expected"));
        match op {
            Op::Conv2dForward(d) => {
                let [y] = w else { return Err(writes(1)) };
                self.conv_forward(name, cs, blas, d, r, y)
            }
            Op::Conv2dBackward(d) => {
                let [grads, dx] = w else { return Err(writes(2)) };
                self.conv_backward(name, cs, blas, d, r, grads, dx)
            }
            _ => Err(DeviceError::Invalid(format!("{name}: not a convolution"))),
        }
    }

    /// im2col of samples `s0 .. s0 + bs` of `x` into `col` (`[bs, kk, p]`).
    #[allow(clippy::too_many_arguments)]
    fn im2col(
        &self,
        name: &str,
        cs: &Arc<CudaStream>,
        z: &ConvSizes,
        x: &CudaView<'_, f32>,
        s0: usize,
        bs: usize,
        col: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let total = u64_of(bs * z.kk * z.p);
        if total == 0 {
            return Ok(());
        }
        let xs = sub(name, x, s0 * z.in_len..(s0 + bs) * z.in_len)?;
        let (bs, cin) = (u64_of(bs), u64_of(z.cin));
        kernel!(
            self,
            format!("{name}: im2col"),
            cs,
            &self.k.conv_im2col,
            elems(total),
            &xs,
            &mut *col,
            &bs,
            &cin,
            &z.h,
            &z.w,
            &z.k,
            &z.stride,
            &z.pad,
            &z.ho,
            &z.wo,
        )
    }

    /// `y = W * col (+ bias)` per sample, a chunk of samples at a time (conv.rs's forward).
    fn conv_forward(
        &self,
        name: &str,
        cs: &Arc<CudaStream>,
        blas: &CudaBlas,
        d: &ConvDims,
        r: &[CudaView<'_, f32>],
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let z = ConvSizes::of(d);
        if z.n * z.out_len == 0 {
            return Ok(());
        }
        let (params, x) = (&r[0], &r[1]);
        let weight = sub(name, params, 0..z.weight)?;
        let (mut col, _counted) = self.scratch::<f32>(cs, z.chunk * z.kk * z.p, "conv columns")?;
        let shape = GemmShape { m: z.cout, n: z.p, k: z.kk, trans_a: false, trans_b: false };
        for s0 in (0..z.n).step_by(z.chunk) {
            let bs = z.chunk.min(z.n - s0);
            let cols = bs * z.kk * z.p;
            let mut colv = col
                .try_slice_mut(0..cols.max(1))
                .ok_or_else(|| DeviceError::Invalid(format!("{name}: {cols} column elements")))?;
            self.im2col(name, cs, &z, x, s0, bs, &mut colv)?;
            let mut ys = sub_mut(name, y, s0 * z.out_len..(s0 + bs) * z.out_len)?;
            if d.conv.bias {
                let (offset, total, p, cout) =
                    (u64_of(z.weight), u64_of(bs * z.out_len), u64_of(z.p), u64_of(z.cout));
                kernel!(
                    self,
                    format!("{name}: bias"),
                    cs,
                    &self.k.conv_bias_fill,
                    elems(total),
                    params,
                    &offset,
                    &mut ys,
                    &total,
                    &p,
                    &cout,
                )?;
            }
            let colr = sub(name, &colv.as_view(), 0..cols)?;
            let batch = Batch { count: bs, stride_a: 0, stride_b: z.kk * z.p, stride_c: z.out_len };
            self.sgemm_batched(name, blas, cs, shape, &weight, &colr, &mut ys, batch, d.conv.bias)?;
        }
        Ok(())
    }

    /// conv.rs's backward: per sample `dW += dY col^T` (in sample order), the bias gradient,
    /// `dcol = W^T dY` (batched over a chunk) and col2im into `dx` (overwritten).
    #[allow(clippy::too_many_arguments)]
    fn conv_backward(
        &self,
        name: &str,
        cs: &Arc<CudaStream>,
        blas: &CudaBlas,
        d: &ConvDims,
        r: &[CudaView<'_, f32>],
        grads: &mut CudaViewMut<'_, f32>,
        dx: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let z = ConvSizes::of(d);
        let (params, x, dy) = (&r[0], &r[1], &r[2]);
        let weight = sub(name, params, 0..z.weight)?;
        let cols = z.chunk * z.kk * z.p;
        let (mut col, _c1) = self.scratch::<f32>(cs, cols, "conv columns")?;
        let (mut dcol, _c2) = self.scratch::<f32>(cs, cols, "conv column gradients")?;
        let dw_shape = GemmShape { m: z.cout, n: z.kk, k: z.p, trans_a: false, trans_b: true };
        let dcol_shape = GemmShape { m: z.kk, n: z.p, k: z.cout, trans_a: true, trans_b: false };
        for s0 in (0..z.n).step_by(z.chunk) {
            let bs = z.chunk.min(z.n - s0);
            let len = bs * z.kk * z.p;
            let mut colv = col
                .try_slice_mut(0..len.max(1))
                .ok_or_else(|| DeviceError::Invalid(format!("{name}: {len} column elements")))?;
            self.im2col(name, cs, &z, x, s0, bs, &mut colv)?;
            let colr = colv.as_view();
            for s in 0..bs {
                let dys = sub(name, dy, (s0 + s) * z.out_len..(s0 + s + 1) * z.out_len)?;
                let col_s = sub(name, &colr, s * z.kk * z.p..(s + 1) * z.kk * z.p)?;
                self.sgemm(name, blas, cs, dw_shape, &dys, &col_s, grads, true)?;
            }
            let dyc = sub(name, dy, s0 * z.out_len..(s0 + bs) * z.out_len)?;
            let mut dcolv = dcol
                .try_slice_mut(0..len.max(1))
                .ok_or_else(|| DeviceError::Invalid(format!("{name}: {len} column elements")))?;
            if len > 0 {
                let mut dcols = sub_mut(name, &mut dcolv, 0..len)?;
                let batch =
                    Batch { count: bs, stride_a: 0, stride_b: z.out_len, stride_c: z.kk * z.p };
                self.sgemm_batched(
                    name, blas, cs, dcol_shape, &weight, &dyc, &mut dcols, batch, false,
                )?;
            }
            let total = u64_of(bs * z.in_len);
            if total > 0 {
                let mut dxs = sub_mut(name, dx, s0 * z.in_len..(s0 + bs) * z.in_len)?;
                let (bs, cin) = (u64_of(bs), u64_of(z.cin));
                let dcolr = dcolv.as_view();
                kernel!(
                    self,
                    format!("{name}: col2im"),
                    cs,
                    &self.k.conv_col2im,
                    elems(total),
                    &dcolr,
                    &mut dxs,
                    &bs,
                    &cin,
                    &z.h,
                    &z.w,
                    &z.k,
                    &z.stride,
                    &z.pad,
                    &z.ho,
                    &z.wo,
                )?;
            }
        }
        if d.conv.bias && z.cout > 0 {
            let (offset, n, cout, p) = (u64_of(z.weight), u64_of(z.n), u64_of(z.cout), u64_of(z.p));
            kernel!(
                self,
                format!("{name}: bias gradient"),
                cs,
                &self.k.conv_bias_grad,
                per_row(cout),
                dy,
                &mut *grads,
                &offset,
                &n,
                &cout,
                &p,
            )?;
        }
        Ok(())
    }

    /// Enqueues a pooling, exact-route BatchNorm or conversion op on `cs` over its (checked)
    /// views.
    pub(super) fn run_cnn(
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
            Op::MaxPoolForward(d) => {
                let [y, argmax] = w else { return Err(writes(2)) };
                let (ho, wo) = (u64_of(d.pool.out_size(d.h)), u64_of(d.pool.out_size(d.w)));
                let planes = u64_of(d.n * d.c);
                let (h, wd, kk, st) =
                    (u64_of(d.h), u64_of(d.w), u64_of(d.pool.kernel), u64_of(d.pool.stride));
                if planes * ho * wo > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.maxpool_fwd,
                        elems(planes * ho * wo),
                        &r[0],
                        &mut *y,
                        &mut *argmax,
                        &planes,
                        &h,
                        &wd,
                        &kk,
                        &st,
                        &ho,
                        &wo,
                    )?;
                }
            }
            Op::MaxPoolBackward(d) => {
                let [dx] = w else { return Err(writes(1)) };
                let (ho, wo) = (u64_of(d.pool.out_size(d.h)), u64_of(d.pool.out_size(d.w)));
                let planes = u64_of(d.n * d.c);
                let (h, wd, kk, st) =
                    (u64_of(d.h), u64_of(d.w), u64_of(d.pool.kernel), u64_of(d.pool.stride));
                if planes * h * wd > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.maxpool_bwd,
                        elems(planes * h * wd),
                        &r[0],
                        &r[1],
                        &mut *dx,
                        &planes,
                        &h,
                        &wd,
                        &kk,
                        &st,
                        &ho,
                        &wo,
                    )?;
                }
            }
            Op::GlobalAvgPool(d) | Op::GlobalAvgPoolBackward(d) => {
                let [out] = w else { return Err(writes(1)) };
                let (planes, s) = (u64_of(d.n * d.c), u64_of(d.s));
                let (f, total) = if matches!(op, Op::GlobalAvgPool(_)) {
                    (&k.gap_fwd, planes)
                } else {
                    (&k.gap_bwd, planes * s)
                };
                if total > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        f,
                        elems(total),
                        &r[0],
                        &mut *out,
                        &planes,
                        &s
                    )?;
                }
            }
            Op::BatchNormLocalStats(d) => {
                let [stats] = w else { return Err(writes(1)) };
                let (n, c, s) = (u64_of(d.n), u64_of(d.c), u64_of(d.s));
                if c > 0 {
                    if s == 1 {
                        let f = &k.bn_local_stats_rows;
                        kernel!(self, what("rows"), cs, f, elems(c), &r[0], &mut *stats, &n, &c)?;
                    } else {
                        kernel!(
                            self,
                            what("planes"),
                            cs,
                            &k.bn_local_stats_planes,
                            per_row(c),
                            &r[0],
                            &mut *stats,
                            &n,
                            &c,
                            &s,
                        )?;
                    }
                }
            }
            Op::BatchNormEncode { c } => {
                let [records] = w else { return Err(writes(1)) };
                let values = u64_of(3 * c);
                if values > 0 {
                    let f = &k.bn_encode;
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        f,
                        elems(values),
                        &r[0],
                        &mut *records,
                        &values
                    )?;
                }
            }
            Op::BatchNormMerge { c, world } => {
                let [stats] = w else { return Err(writes(1)) };
                let (c, world) = (u64_of(*c), u64_of(*world));
                if c > 0 {
                    let f = &k.bn_merge;
                    kernel!(self, what("kernel"), cs, f, elems(c), &r[0], &mut *stats, &c, &world)?;
                }
            }
            Op::BatchNormTrain { dims: d, eps, momentum } => {
                let [y, xhat, invstd, count, buffers] = w else { return Err(writes(5)) };
                let (n, c, s) = (u64_of(d.n), u64_of(d.c), u64_of(d.s));
                let (x, params, stats) = (&r[0], &r[1], &r[2]);
                // At least one thread: the count is written (and checked) with no channel.
                kernel!(
                    self,
                    what("statistics"),
                    cs,
                    &k.bn_train_stats,
                    elems(c.max(1)),
                    stats,
                    &mut *invstd,
                    &mut *count,
                    &mut *buffers,
                    &c,
                    eps,
                    momentum,
                )?;
                if n * c * s > 0 {
                    // Written above, read here: a read view of the written one (its tracking
                    // is the allocation's, so the launch waits for the write).
                    let invstd = invstd.as_view();
                    kernel!(
                        self,
                        what("normalize"),
                        cs,
                        &k.bn_train_fwd,
                        elems(n * c * s),
                        params,
                        x,
                        stats,
                        &invstd,
                        &mut *y,
                        &mut *xhat,
                        &n,
                        &c,
                        &s,
                    )?;
                }
            }
            Op::BatchNormEval { dims: d, eps } => {
                let [y] = w else { return Err(writes(1)) };
                let (n, c, s) = (u64_of(d.n), u64_of(d.c), u64_of(d.s));
                if n * c * s > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.bn_eval,
                        elems(n * c * s),
                        &r[1],
                        &r[0],
                        &r[2],
                        &mut *y,
                        &n,
                        &c,
                        &s,
                        eps,
                    )?;
                }
            }
            Op::BatchNormGradSums(d) => {
                let [sums, grads] = w else { return Err(writes(2)) };
                let (n, c, s) = (u64_of(d.n), u64_of(d.c), u64_of(d.s));
                if c > 0 {
                    if s == 1 {
                        kernel!(
                            self,
                            what("rows"),
                            cs,
                            &k.bn_grad_sums_rows,
                            elems(c),
                            &r[0],
                            &r[1],
                            &mut *sums,
                            &mut *grads,
                            &n,
                            &c,
                        )?;
                    } else {
                        kernel!(
                            self,
                            what("planes"),
                            cs,
                            &k.bn_grad_sums_planes,
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
            }
            Op::BatchNormGradDx(d) => {
                let [dx] = w else { return Err(writes(1)) };
                let (n, c, s) = (u64_of(d.n), u64_of(d.c), u64_of(d.s));
                if n * c * s > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.bn_grad_dx,
                        elems(n * c * s),
                        &r[0],
                        &r[1],
                        &r[2],
                        &r[3],
                        &r[4],
                        &r[5],
                        &mut *dx,
                        &n,
                        &c,
                        &s,
                    )?;
                }
            }
            Op::F64ToF32 | Op::F32ToF64 => {
                let [out] = w else { return Err(writes(1)) };
                let (f, n) = if matches!(op, Op::F64ToF32) {
                    (&k.f64_to_f32, u64_of(out.len()))
                } else {
                    (&k.f32_to_f64, u64_of(r[0].len()))
                };
                if n > 0 {
                    kernel!(self, what("kernel"), cs, f, elems(n), &r[0], &mut *out, &n)?;
                }
            }
            _ => {
                return Err(DeviceError::Invalid(format!(
                    "{name}: not a pooling, BatchNorm or conversion op"
                )))
            }
        }
        Ok(())
    }
}
