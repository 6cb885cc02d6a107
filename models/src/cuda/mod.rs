//! CUDA backend (feature `cuda`): cuBLAS for matrix multiplies, NVRTC-compiled kernels
//! (`kernels.cu`) for the elementwise ops, BatchNorm statistics, normalisation and backward,
//! and the SGD / AdamW updates.
//!
//! cudarc loads libcuda, libcublas, libnvrtc at run time, so a binary built with the feature
//! starts on any host; [`Cuda::open`] checks for each library first (cudarc panics on a
//! missing one) and answers [`ModelError::DeviceUnavailable`] naming what was not found.
//!
//! The [`Backend`] trait takes host slices, so its methods copy their operands to the device
//! and the result back: correct everywhere, fast only for large matrix multiplies. The
//! `*_dev` methods work on device buffers ([`CudaSlice`]) and are what a device-resident
//! training step calls.
//!
//! [`CudaDevice`] ([`device`]) is the GPU as a `shardline_collectives` device: streams, events,
//! stream-ordered memory, and the model ops (`crate::ops::Op`) run as cuBLAS products and the
//! kernels of `ops.cu`; [`NcclComm`] ([`nccl`]) is its NCCL communicator.
//!
//! Invariants (cited by the tests):
//! - CUDA-1: every kernel agrees with the CPU backend (or the CPU layer) on the same inputs
//!   within f32 rounding (relative 1e-4 for reductions, 1e-5 elementwise).
//! - CUDA-2: without a GPU or driver, opening fails with `DeviceUnavailable`, never a panic.

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::backend::{Backend, GemmShape};
use crate::error::ModelError;

pub mod device;
mod device_ops;
pub mod nccl;

pub use device::CudaDevice;
pub use nccl::NcclComm;

/// The kernels' CUDA C source.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// Threads per block of the 1-D kernels (`BLOCK` of kernels.cu, `OPS_BLOCK` of ops.cu).
const BLOCK: u32 = 256;

/// Which libraries of the CUDA stack can be loaded; `Err` names the first one missing.
/// Needed before any cudarc call: cudarc panics when a library is absent.
pub fn check_libraries() -> Result<(), ModelError> {
    // SAFETY: each check only tries to dlopen the library by its usual names and drops it.
    let present = unsafe {
        [
            ("libcuda.so (the NVIDIA driver)", cudarc::driver::sys::is_culib_present()),
            ("libcublas.so", cudarc::cublas::sys::is_culib_present()),
            ("libnvrtc.so", cudarc::nvrtc::sys::is_culib_present()),
        ]
    };
    match present.iter().find(|(_, ok)| !ok) {
        Some((name, _)) => Err(ModelError::DeviceUnavailable(format!("{name} not found"))),
        None => Ok(()),
    }
}

/// How many CUDA devices the driver shows this process (after `CUDA_VISIBLE_DEVICES`);
/// `DeviceUnavailable` without the libraries or a driver.
pub fn device_count() -> Result<usize, ModelError> {
    check_libraries()?;
    let n = CudaContext::device_count()
        .map_err(|e| ModelError::DeviceUnavailable(format!("no CUDA device: {e:?}")))?;
    Ok(n.max(0) as usize)
}

/// Whether GPU `ordinal` is there, the libraries checked first (no cudarc call before):
/// `DeviceUnavailable` naming what is missing otherwise. The check of [`Cuda::open`] and
/// [`CudaDevice::open`] before they create a context.
fn check_ordinal(ordinal: usize) -> Result<(), ModelError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(ModelError::DeviceUnavailable(format!(
            "no CUDA device {ordinal} ({count} present)"
        )));
    }
    Ok(())
}

/// The device name of `ctx`, as the driver reports it (`cuda:{ordinal}` and the error when
/// the driver does not answer).
fn context_name(ctx: &CudaContext) -> String {
    ctx.name().unwrap_or_else(|e| format!("cuda:{} ({e:?})", ctx.ordinal()))
}

fn dev_err(what: &str, e: impl std::fmt::Debug) -> ModelError {
    ModelError::Device(format!("{what}: {e:?}"))
}

/// The layout `[n, c, s]` of a BatchNorm input: `n` samples, `c` channels, `s` values per
/// channel and sample (1 for `[N, C]`, `H * W` for `[N, C, H, W]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BnShape {
    /// Samples.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Values per channel and sample.
    pub s: usize,
}

/// The per-channel sums a BatchNorm backward needs for the input gradient (from
/// [`Cuda::bn_backward_reduce_dev`], possibly reduced across ranks), and how many values
/// per channel they cover.
#[derive(Clone, Copy, Debug)]
pub struct BnGradSums<'a> {
    /// `sum dy` per channel.
    pub sum_dy: &'a CudaSlice<f32>,
    /// `sum dy * xhat` per channel.
    pub sum_dy_xhat: &'a CudaSlice<f32>,
    /// Values per channel in the (global) batch.
    pub count: f32,
}

pub use crate::ops::{AdamWStep, SgdStep};

struct Kernels {
    relu: CudaFunction,
    relu_backward: CudaFunction,
    axpy: CudaFunction,
    bn_stats: CudaFunction,
    bn_normalize: CudaFunction,
    bn_backward_reduce: CudaFunction,
    bn_backward_dx: CudaFunction,
    sgd: CudaFunction,
    adamw: CudaFunction,
}

/// A CUDA device with its stream, cuBLAS handle and compiled kernels.
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda").field("ordinal", &self.ctx.ordinal()).finish()
    }
}

/// One thread per element, every element covered (the kernels of kernels.cu have no
/// grid-stride loop); `n` is at most `u32::MAX` (checked by the callers), so the grid fits.
fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(BLOCK).max(1), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_channel(c: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (c as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// The cuBLAS call of a row-major `c = op(a) op(b)` (`c +=` when `accumulate`), `m`, `n`,
/// `k` all non-zero: cuBLAS is column-major, where a row-major matrix is its transpose, so
/// the row-major C = op(A) op(B) is the column-major C^T = op(B)^T op(A)^T, with B as the
/// first operand: `blas.gemm(cfg, b, a, c)`. `Err` is a dimension past `i32::MAX`.
fn gemm_config(shape: GemmShape, accumulate: bool) -> Result<GemmConfig<f32>, usize> {
    let GemmShape { m, n, k, trans_a, trans_b } = shape;
    let dim = |v: usize| i32::try_from(v).map_err(|_| v);
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    Ok(GemmConfig {
        transa: op(trans_b),
        transb: op(trans_a),
        m: dim(n)?,
        n: dim(m)?,
        k: dim(k)?,
        alpha: 1.0f32,
        lda: dim(if trans_b { k } else { n })?,
        ldb: dim(if trans_a { m } else { k })?,
        beta: if accumulate { 1.0 } else { 0.0 },
        ldc: dim(n)?,
    })
}

fn u32_len(what: &str, n: usize) -> Result<u32, ModelError> {
    u32::try_from(n).map_err(|_| ModelError::shape(what, "at most 2^32 - 1 values", n))
}

/// Launches a kernel of `kernels.cu` over `n` elements (nothing when `n` is 0).
macro_rules! launch {
    ($self:expr, $f:expr, $n:expr, $($arg:expr),* $(,)?) => {{
        if $n == 0 {
            Ok(())
        } else {
            let mut b = $self.stream.launch_builder($f);
            $( b.arg($arg); )*
            // SAFETY: every kernel of kernels.cu bounds its index by the `n` it is given, and
            // the callers pass buffers of at least `n` elements (checked before the launch).
            unsafe { b.launch(grid($n)) }.map(|_| ()).map_err(|e| dev_err("kernel launch", e))
        }
    }};
}

impl Cuda {
    /// Opens GPU `ordinal`: checks the libraries, creates the context, compiles the kernels.
    pub fn open(ordinal: usize) -> Result<Self, ModelError> {
        check_ordinal(ordinal)?;
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| ModelError::DeviceUnavailable(format!("cuda device {ordinal}: {e:?}")))?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| dev_err("cublas handle", e))?;
        let ptx = cudarc::nvrtc::compile_ptx(KERNELS_CU).map_err(|e| dev_err("nvrtc", e))?;
        let module = ctx.load_module(ptx).map_err(|e| dev_err("load module", e))?;
        let f = |name: &str| module.load_function(name).map_err(|e| dev_err(name, e));
        let k = Kernels {
            relu: f("relu_f32")?,
            relu_backward: f("relu_backward_f32")?,
            axpy: f("axpy_f32")?,
            bn_stats: f("bn_stats_f32")?,
            bn_normalize: f("bn_normalize_f32")?,
            bn_backward_reduce: f("bn_backward_reduce_f32")?,
            bn_backward_dx: f("bn_backward_dx_f32")?,
            sgd: f("sgd_f32")?,
            adamw: f("adamw_f32")?,
        };
        Ok(Cuda { ctx, stream, blas, k })
    }

    /// Device name, as the driver reports it.
    pub fn device_name(&self) -> String {
        context_name(&self.ctx)
    }

    /// Copies host values to a new device buffer.
    pub fn upload(&self, v: &[f32]) -> Result<CudaSlice<f32>, ModelError> {
        self.stream.clone_htod(v).map_err(|e| dev_err("copy to device", e))
    }

    /// Copies a device buffer back to the host (waits for the stream).
    pub fn download(&self, d: &CudaSlice<f32>) -> Result<Vec<f32>, ModelError> {
        self.stream.clone_dtoh(d).map_err(|e| dev_err("copy to host", e))
    }

    /// A zeroed device buffer.
    pub fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, ModelError> {
        self.stream.alloc_zeros(n).map_err(|e| dev_err("alloc", e))
    }

    /// Waits for every queued operation.
    pub fn synchronize(&self) -> Result<(), ModelError> {
        self.stream.synchronize().map_err(|e| dev_err("synchronize", e))
    }

    /// Row-major `c = op(a) op(b)` (or `+=` when `accumulate`) on device buffers, same
    /// contract as [`Backend::gemm`].
    pub fn gemm_dev(
        &self,
        shape: GemmShape,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<(), ModelError> {
        let GemmShape { m, n, k, .. } = shape;
        if a.len() < m * k || b.len() < k * n || c.len() < m * n {
            return Err(ModelError::shape(
                "gemm_dev",
                format!("{m}x{k}, {k}x{n}, {m}x{n}"),
                "shorter buffers",
            ));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            if !accumulate {
                self.stream.memset_zeros(c).map_err(|e| dev_err("memset", e))?;
            }
            return Ok(());
        }
        let cfg = gemm_config(shape, accumulate)
            .map_err(|v| ModelError::shape("gemm_dev", "< 2^31", v))?;
        // SAFETY: the length checks above keep every access that the dimensions and leading
        // dimensions allow inside the three buffers; `c` is borrowed mutably, so it does not
        // alias `a` or `b`.
        unsafe { self.blas.gemm(cfg, b, a, c) }.map_err(|e| dev_err("cublas sgemm", e))
    }

    /// `x = max(x, 0)` on the device.
    pub fn relu_dev(&self, x: &mut CudaSlice<f32>) -> Result<(), ModelError> {
        let len = x.len();
        let n = u32_len("relu", len)?;
        launch!(self, &self.k.relu, len, x, &n)
    }

    /// `grad *= (out > 0)` on the device.
    pub fn relu_backward_dev(
        &self,
        out: &CudaSlice<f32>,
        grad: &mut CudaSlice<f32>,
    ) -> Result<(), ModelError> {
        if out.len() != grad.len() {
            return Err(ModelError::shape("relu_backward", out.len(), grad.len()));
        }
        let n = u32_len("relu_backward", out.len())?;
        launch!(self, &self.k.relu_backward, n as usize, out, grad, &n)
    }

    /// `y += alpha * x` on the device.
    pub fn axpy_dev(
        &self,
        alpha: f32,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), ModelError> {
        if x.len() != y.len() {
            return Err(ModelError::shape("axpy", x.len(), y.len()));
        }
        let n = u32_len("axpy", x.len())?;
        launch!(self, &self.k.axpy, n as usize, &alpha, x, y, &n)
    }

    /// Per-channel mean and M2 (sum of squared deviations) of `x` laid out `[n, c, s]`.
    pub fn bn_stats_dev(
        &self,
        x: &CudaSlice<f32>,
        shape: BnShape,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>), ModelError> {
        let BnShape { n, c, s } = shape;
        if x.len() != n * c * s {
            return Err(ModelError::shape("bn_stats", n * c * s, x.len()));
        }
        let mut mean = self.zeros(c)?;
        let mut m2 = self.zeros(c)?;
        if c > 0 {
            let (nn, cc, ss) = (u32_len("n", n)?, u32_len("c", c)?, u32_len("s", s)?);
            let mut b = self.stream.launch_builder(&self.k.bn_stats);
            b.arg(x).arg(&mut mean).arg(&mut m2).arg(&nn).arg(&cc).arg(&ss);
            // SAFETY: one block per channel (c blocks), each reads only its channel's n*s
            // values of x (length checked) and writes mean[ch], m2[ch] (length c).
            unsafe { b.launch(per_channel(c)) }.map_err(|e| dev_err("bn_stats", e))?;
        }
        Ok((mean, m2))
    }

    /// Normalises `x` in place to `xhat = (x - mean) * invstd` and returns
    /// `y = xhat * w + b`; `params` is `[w; c] ++ [b; c]`.
    pub fn bn_normalize_dev(
        &self,
        x: &mut CudaSlice<f32>,
        mean: &CudaSlice<f32>,
        invstd: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        shape: BnShape,
    ) -> Result<CudaSlice<f32>, ModelError> {
        let BnShape { n, c, s } = shape;
        if x.len() != n * c * s || [mean.len(), invstd.len(), weight.len(), bias.len()] != [c; 4] {
            return Err(ModelError::shape("bn_normalize", format!("[{n}, {c}, {s}]"), x.len()));
        }
        let mut y = self.zeros(x.len())?;
        let (nn, cc, ss) = (u32_len("n", n)?, u32_len("c", c)?, u32_len("s", s)?);
        let len = x.len();
        launch!(
            self,
            &self.k.bn_normalize,
            len,
            x,
            &mut y,
            mean,
            invstd,
            weight,
            bias,
            &nn,
            &cc,
            &ss
        )?;
        Ok(y)
    }

    /// Per-channel `(sum dy, sum dy * xhat)`: the two values SyncBatchNorm reduces across
    /// ranks in its backward, and the bias and weight gradients of this rank.
    pub fn bn_backward_reduce_dev(
        &self,
        dy: &CudaSlice<f32>,
        xhat: &CudaSlice<f32>,
        shape: BnShape,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>), ModelError> {
        let BnShape { n, c, s } = shape;
        if dy.len() != n * c * s || xhat.len() != dy.len() {
            return Err(ModelError::shape("bn_backward_reduce", n * c * s, dy.len()));
        }
        let mut sdy = self.zeros(c)?;
        let mut sdyx = self.zeros(c)?;
        if c > 0 {
            let (nn, cc, ss) = (u32_len("n", n)?, u32_len("c", c)?, u32_len("s", s)?);
            let mut b = self.stream.launch_builder(&self.k.bn_backward_reduce);
            b.arg(dy).arg(xhat).arg(&mut sdy).arg(&mut sdyx).arg(&nn).arg(&cc).arg(&ss);
            // SAFETY: as bn_stats: block ch reads channel ch of dy and xhat, writes index ch.
            unsafe { b.launch(per_channel(c)) }.map_err(|e| dev_err("bn_backward_reduce", e))?;
        }
        Ok((sdy, sdyx))
    }

    /// The input gradient of BatchNorm in training mode, from the (possibly globally
    /// reduced) sums and the number of values per channel in the global batch.
    pub fn bn_backward_dx_dev(
        &self,
        dy: &CudaSlice<f32>,
        xhat: &CudaSlice<f32>,
        invstd: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        sums: BnGradSums<'_>,
        shape: BnShape,
    ) -> Result<CudaSlice<f32>, ModelError> {
        let BnGradSums { sum_dy, sum_dy_xhat, count } = sums;
        let BnShape { n, c, s } = shape;
        if dy.len() != n * c * s
            || xhat.len() != dy.len()
            || [invstd.len(), weight.len(), sum_dy.len(), sum_dy_xhat.len()] != [c; 4]
        {
            return Err(ModelError::shape("bn_backward_dx", format!("[{n}, {c}, {s}]"), dy.len()));
        }
        let mut dx = self.zeros(dy.len())?;
        let (nn, cc, ss) = (u32_len("n", n)?, u32_len("c", c)?, u32_len("s", s)?);
        let len = dy.len();
        launch!(
            self,
            &self.k.bn_backward_dx,
            len,
            dy,
            xhat,
            invstd,
            weight,
            sum_dy,
            sum_dy_xhat,
            &mut dx,
            &count,
            &nn,
            &cc,
            &ss
        )?;
        Ok(dx)
    }

    /// One `torch.optim.SGD` step on device buffers (`buf` is the momentum buffer; unused
    /// and may be empty without momentum).
    pub fn sgd_dev(
        &self,
        p: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        buf: &mut CudaSlice<f32>,
        hp: SgdStep,
    ) -> Result<(), ModelError> {
        let SgdStep { lr, momentum, dampening, weight_decay, nesterov, step } = hp;
        if g.len() != p.len() || (momentum != 0.0 && buf.len() != p.len()) {
            return Err(ModelError::shape("sgd", p.len(), g.len()));
        }
        if momentum == 0.0 && buf.len() < p.len() {
            // the kernel never touches buf without momentum, but needs a valid pointer
            *buf = self.zeros(p.len())?;
        }
        let n = u32_len("sgd", p.len())?;
        let (nest, first) = (i32::from(nesterov), i32::from(step <= 1));
        let len = p.len();
        launch!(
            self,
            &self.k.sgd,
            len,
            p,
            g,
            buf,
            &lr,
            &momentum,
            &dampening,
            &weight_decay,
            &nest,
            &first,
            &n
        )
    }

    /// One `torch.optim.AdamW` step on device buffers; `state` interleaves `(m, v)` per
    /// element.
    pub fn adamw_dev(
        &self,
        p: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        hp: AdamWStep,
    ) -> Result<(), ModelError> {
        let AdamWStep { beta1, beta2, eps, step, .. } = hp;
        if g.len() != p.len() || state.len() != 2 * p.len() || step == 0 {
            return Err(ModelError::shape("adamw", p.len(), g.len()));
        }
        let (step_size, bc2_sqrt, decay) = hp.scalars();
        let n = u32_len("adamw", p.len())?;
        let len = p.len();
        launch!(
            self,
            &self.k.adamw,
            len,
            p,
            g,
            state,
            &step_size,
            &bc2_sqrt,
            &beta1,
            &beta2,
            &eps,
            &decay,
            &n
        )
    }

    /// A [`Backend`] call's device failure, naming the call and the GPU before what failed
    /// inside it (a copy, the cuBLAS call, a launch); other errors pass unchanged.
    fn in_call(&self, call: &str, r: Result<(), ModelError>) -> Result<(), ModelError> {
        r.map_err(|e| match e {
            ModelError::Device(what) => {
                ModelError::Device(format!("{call} on cuda:{}: {what}", self.ctx.ordinal()))
            }
            other => other,
        })
    }
}

impl Backend for Cuda {
    fn name(&self) -> &'static str {
        "cuda-cublas"
    }

    fn gemm(
        &self,
        shape: GemmShape,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<(), ModelError> {
        shape.check(a.len(), b.len(), c.len())?;
        let GemmShape { m, n, k, .. } = shape;
        let r = (|| {
            let da = self.upload(&a[..m * k])?;
            let db = self.upload(&b[..k * n])?;
            let mut dc = if accumulate { self.upload(&c[..m * n])? } else { self.zeros(m * n)? };
            self.gemm_dev(shape, &da, &db, &mut dc, accumulate)?;
            let out = self.download(&dc)?;
            c[..m * n].copy_from_slice(&out);
            Ok(())
        })();
        self.in_call(&format!("gemm {m}x{n}x{k}"), r)
    }

    fn axpy(&self, alpha: f32, src: &[f32], dst: &mut [f32]) -> Result<(), ModelError> {
        crate::backend::same_len("axpy", src.len(), dst.len())?;
        let r = (|| {
            let x = self.upload(src)?;
            let mut y = self.upload(dst)?;
            self.axpy_dev(alpha, &x, &mut y)?;
            dst.copy_from_slice(&self.download(&y)?);
            Ok(())
        })();
        self.in_call("axpy", r)
    }

    fn relu(&self, x: &mut [f32]) -> Result<(), ModelError> {
        let r = (|| {
            let mut d = self.upload(x)?;
            self.relu_dev(&mut d)?;
            x.copy_from_slice(&self.download(&d)?);
            Ok(())
        })();
        self.in_call("relu", r)
    }

    fn relu_backward(&self, out: &[f32], grad: &mut [f32]) -> Result<(), ModelError> {
        crate::backend::same_len("relu_backward", out.len(), grad.len())?;
        let r = (|| {
            let o = self.upload(out)?;
            let mut g = self.upload(grad)?;
            self.relu_backward_dev(&o, &mut g)?;
            grad.copy_from_slice(&self.download(&g)?);
            Ok(())
        })();
        self.in_call("relu_backward", r)
    }
}

/// Measures cuBLAS sgemm on device-resident `m x n x k` operands: TFLOP/s, best of `reps`
/// after one warm-up (each rep synchronised, so it is the kernel's time, not the launch's).
pub fn cublas_tflops(
    cuda: &Cuda,
    m: usize,
    n: usize,
    k: usize,
    reps: usize,
) -> Result<f64, ModelError> {
    let a = cuda.upload(&(0..m * k).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect::<Vec<_>>())?;
    let b = cuda.upload(&(0..k * n).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect::<Vec<_>>())?;
    let mut c = cuda.zeros(m * n)?;
    let shape = GemmShape { m, n, k, trans_a: false, trans_b: false };
    cuda.gemm_dev(shape, &a, &b, &mut c, false)?;
    cuda.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = std::time::Instant::now();
        cuda.gemm_dev(shape, &a, &b, &mut c, false)?;
        cuda.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (m * n * k) as f64 / best.max(1e-12) / 1e12)
}

#[cfg(test)]
mod device_figures;
#[cfg(test)]
mod device_tests;
#[cfg(test)]
mod device_tests_cnn;
#[cfg(test)]
mod device_tests_model;
#[cfg(test)]
mod tests;
