//! Compute backends. Layers call the [`Backend`] trait for their heavy kernels (matrix
//! multiply, elementwise ops), so that a device backend can implement the same trait later.
//!
//! Invariants (cited by the tests):
//! - BACKEND-1: a kernel that fails returns its error, never panics: a device failure is
//!   [`ModelError::Device`] naming the call, operands that do not fit are
//!   [`ModelError::Shape`]; every layer and model hands it up unchanged and runs no further
//!   kernel, so the caller of a forward or backward gets the failed call's own error.
//!
//! ## Choice of the matrix multiply
//! Measured on the development machine (2-core Intel Xeon with AVX-512, one thread, f32,
//! `cargo run --release -p shardline-models --example gemm_compare`, best of 5):
//!
//! | m x n x k | `gemm` 0.19 (x86-v4) | `gemm` 0.19 (AVX2 only) | `matrixmultiply` 0.3 | naive loop |
//! |---|---|---|---|---|
//! | 256 x 1024 x 1024 | 170 GFLOP/s | 85 GFLOP/s | 145 GFLOP/s | 12 GFLOP/s |
//! | 256 x 1024 x 784 | 172 GFLOP/s | 87 GFLOP/s | 147 GFLOP/s | 13 GFLOP/s |
//! | 1024 x 1024 x 256 | 179 GFLOP/s | 89 GFLOP/s | 160 GFLOP/s | 13 GFLOP/s |
//!
//! `gemm` with its `x86-v4` feature (AVX-512 kernels, chosen at run time, so machines
//! without AVX-512 still run the AVX2 ones) is the fastest; without that feature it is the
//! slowest of the two crates, which is why the feature is on. It takes arbitrary row and
//! column strides, so the `A^T B` and `A B^T` products of the backward passes need no copy
//! (170 GFLOP/s with a transposed A), and it can use several threads when asked. OpenBLAS
//! was not taken: it needs a system library and brings its own thread pool, which fights
//! with one rank per core. `shardline-bench` re-measures through [`gemm_gflops`].

use std::time::Instant;

use crate::error::ModelError;

/// Heavy kernels used by the layers. Buffers are row-major and contiguous.
///
/// Every kernel returns a `Result`: a device backend can fail in the middle of a step (a
/// lost GPU, out of memory, a failed copy), and the layer that called it can only hand the
/// failure up, to the engine that ends the run with it. A device failure is
/// [`ModelError::Device`] naming the call; operands that do not fit are [`ModelError::Shape`].
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Short name for reports (`cpu-gemm`, ...).
    fn name(&self) -> &'static str;

    /// `c = op(a) * op(b)` (or `c += ...` when `accumulate`), where `op(a)` is `m x k` and
    /// `op(b)` is `k x n`. With `trans_a`, `a` is stored as `k x m`; with `trans_b`, `b` is
    /// stored as `n x k`. A slice shorter than its matrix is a [`ModelError::Shape`].
    fn gemm(
        &self,
        shape: GemmShape,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<(), ModelError>;

    /// `dst += alpha * src`.
    fn axpy(&self, alpha: f32, src: &[f32], dst: &mut [f32]) -> Result<(), ModelError> {
        same_len("axpy", src.len(), dst.len())?;
        for (d, s) in dst.iter_mut().zip(src) {
            *d += alpha * s;
        }
        Ok(())
    }

    /// `x = max(x, 0)` in place.
    fn relu(&self, x: &mut [f32]) -> Result<(), ModelError> {
        for v in x.iter_mut() {
            *v = v.max(0.0);
        }
        Ok(())
    }

    /// `grad *= (out > 0)` in place, where `out` is the ReLU's output.
    fn relu_backward(&self, out: &[f32], grad: &mut [f32]) -> Result<(), ModelError> {
        same_len("relu_backward", out.len(), grad.len())?;
        // A select, not a branch: the signs are random, and a branchy loop neither predicts
        // nor vectorises. Same result (NaN outputs keep their gradient, as before).
        for (g, o) in grad.iter_mut().zip(out) {
            *g = if *o <= 0.0 { 0.0 } else { *g };
        }
        Ok(())
    }
}

/// `Err(Shape)` unless an elementwise kernel's two operands have one length.
pub(crate) fn same_len(what: &str, a: usize, b: usize) -> Result<(), ModelError> {
    if a == b {
        Ok(())
    } else {
        Err(ModelError::shape(what, format!("equal lengths ({a})"), b))
    }
}

/// The CPU backend: `gemm` for matrix multiplies, plain loops (auto-vectorised) for the rest.
///
/// Single-threaded by default: in data-parallel training the ranks are the parallelism, and
/// a kernel that spreads over every core would fight with the other ranks.
#[derive(Clone, Copy, Debug)]
pub struct Cpu {
    threads: usize,
}

impl Default for Cpu {
    fn default() -> Self {
        Cpu { threads: 1 }
    }
}

impl Cpu {
    /// The single-threaded CPU backend (the default).
    pub fn new() -> Self {
        Self::default()
    }

    /// A CPU backend whose matrix multiplies use `threads` threads (at least 1).
    ///
    /// ```
    /// let be = shardline_models::Cpu::with_threads(2);
    /// assert_eq!(be.threads(), 2);
    /// ```
    pub fn with_threads(threads: usize) -> Self {
        Cpu { threads: threads.max(1) }
    }

    /// A CPU backend with the thread count of [`crate::config::cpu_threads`]
    /// (`SHARDLINE_CPU_THREADS`, default 1).
    pub fn from_env() -> Self {
        Self::with_threads(crate::config::cpu_threads())
    }

    /// Threads used by one matrix multiply.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu-gemm"
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
        let par = if self.threads > 1 {
            gemm::Parallelism::Rayon(self.threads)
        } else {
            gemm::Parallelism::None
        };
        // The route of the float-generic kernels (`nn::gemm`): a large `a b^T` (a linear
        // forward) multiplies a transposed copy of `b`, the rest as `gemm` takes them.
        crate::nn::gemm::gemm_f32(shape, a, b, c, accumulate, par);
        Ok(())
    }
}

/// The shape of a matrix multiply `c = op(a) op(b)`, as [`Backend::gemm`] takes it: `op(a)`
/// is `m x k` and `op(b)` is `k x n`; with `trans_a`, `a` is stored as `k x m`, with
/// `trans_b`, `b` as `n x k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    /// Rows of `op(a)` and `c`.
    pub m: usize,
    /// Columns of `op(b)` and `c`.
    pub n: usize,
    /// Columns of `op(a)`, rows of `op(b)`.
    pub k: usize,
    /// `a` is stored transposed (`k x m`).
    pub trans_a: bool,
    /// `b` is stored transposed (`n x k`).
    pub trans_b: bool,
}

impl GemmShape {
    /// `Err(Shape)` unless slices of `a`, `b` and `c` elements hold their matrices.
    pub fn check(&self, a: usize, b: usize, c: usize) -> Result<(), ModelError> {
        let GemmShape { m, n, k, .. } = *self;
        if a < m * k || b < k * n || c < m * n {
            return Err(ModelError::shape(
                "gemm operands",
                format!("at least {}, {} and {} elements", m * k, k * n, m * n),
                format!("{a}, {b} and {c}"),
            ));
        }
        Ok(())
    }
}

/// Reference matrix multiply (`c = op(a) op(b)`), f64 accumulation; for tests and for the
/// naive baseline of the comparison.
pub fn naive_gemm(shape: GemmShape, a: &[f32], b: &[f32], c: &mut [f32]) {
    let GemmShape { m, n, k, trans_a, trans_b } = shape;
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let av = if trans_a { a[p * m + i] } else { a[i * k + p] };
                let bv = if trans_b { b[j * k + p] } else { b[p * n + j] };
                s += av as f64 * bv as f64;
            }
            c[i * n + j] = s as f32;
        }
    }
}

/// Measures a backend's matrix multiply: GFLOP/s of `m x n x k` products (best of `reps`
/// timed runs after one warm-up), on deterministic data; the backend's error if a multiply
/// fails.
pub fn gemm_gflops(
    backend: &dyn Backend,
    m: usize,
    n: usize,
    k: usize,
    reps: usize,
) -> Result<f64, ModelError> {
    let a: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let b: Vec<f32> = (0..k * n).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
    let mut c = vec![0.0f32; m * n];
    backend.gemm(GemmShape { m, n, k, trans_a: false, trans_b: false }, &a, &b, &mut c, false)?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        backend.gemm(
            GemmShape { m, n, k, trans_a: false, trans_b: false },
            &a,
            &b,
            &mut c,
            false,
        )?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (m * n * k) as f64 / best.max(1e-12) / 1e9)
}

/// The same measurement for `matrixmultiply::sgemm` (the runner-up of the comparison in
/// this module's docs), so that a benchmark reports both in one run.
pub fn matrixmultiply_gflops(m: usize, n: usize, k: usize, reps: usize) -> f64 {
    let a: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let b: Vec<f32> = (0..k * n).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
    let mut c = vec![0.0f32; m * n];
    let mut run = || {
        // SAFETY: row-major m x k, k x n and m x n buffers of exactly those sizes, strides
        // (k, 1), (n, 1), (n, 1) stay inside them; `c` does not alias `a` or `b`.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                k as isize,
                1,
                b.as_ptr(),
                n as isize,
                1,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        }
    };
    run();
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        run();
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (m * n * k) as f64 / best.max(1e-12) / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    #[test]
    fn gemm_matches_naive_for_every_transpose() {
        let mut rng = SplitMix64::new(1);
        for &(m, n, k) in
            &[(1, 1, 1), (3, 5, 7), (17, 9, 33), (64, 40, 1), (70, 45, 20), (0, 3, 2), (2, 3, 0)]
        {
            let a: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.normal()).collect();
            for &ta in &[false, true] {
                for &tb in &[false, true] {
                    for threads in [1, 2] {
                        let mut want = vec![0.0; m * n];
                        let shape = GemmShape { m, n, k, trans_a: ta, trans_b: tb };
                        naive_gemm(shape, &a, &b, &mut want);
                        let mut got = vec![7.0; m * n];
                        Cpu::with_threads(threads)
                            .gemm(
                                GemmShape { m, n, k, trans_a: ta, trans_b: tb },
                                &a,
                                &b,
                                &mut got,
                                false,
                            )
                            .unwrap();
                        for (g, w) in got.iter().zip(&want) {
                            assert!(
                                (g - w).abs() < 1e-4,
                                "{m}x{n}x{k} ta={ta} tb={tb}: {g} vs {w}"
                            );
                        }
                        // accumulate adds onto what is there
                        let mut acc = vec![1.0; m * n];
                        Cpu::new()
                            .gemm(
                                GemmShape { m, n, k, trans_a: ta, trans_b: tb },
                                &a,
                                &b,
                                &mut acc,
                                true,
                            )
                            .unwrap();
                        for (g, w) in acc.iter().zip(&want) {
                            assert!((g - (w + 1.0)).abs() < 1e-4);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn operands_that_do_not_fit_are_shape_errors_not_panics_backend_1() {
        let shape = GemmShape { m: 2, n: 3, k: 4, trans_a: false, trans_b: false };
        let (a, b) = (vec![1.0; 8], vec![1.0; 12]);
        for (a, b, c) in [(&a[..7], &b[..], 6), (&a[..], &b[..11], 6), (&a[..], &b[..], 5)] {
            let r = Cpu::new().gemm(shape, a, b, &mut vec![0.0; c], false);
            assert!(matches!(r, Err(ModelError::Shape { .. })), "{r:?}");
        }
        let r = Cpu::new().axpy(1.0, &[1.0; 3], &mut [0.0; 2]);
        assert!(matches!(r, Err(ModelError::Shape { .. })), "{r:?}");
        let r = Cpu::new().relu_backward(&[1.0; 3], &mut [0.0; 4]);
        assert!(matches!(r, Err(ModelError::Shape { .. })), "{r:?}");
    }

    #[test]
    fn the_failing_backend_fails_only_its_nth_gemm_backend_1() {
        let be = crate::failing_backend::FailingBackend::new(2);
        let shape = GemmShape { m: 1, n: 1, k: 1, trans_a: false, trans_b: false };
        let mut c = [0.0];
        assert!(be.gemm(shape, &[2.0], &[3.0], &mut c, false).is_ok());
        assert_eq!(c, [6.0]);
        match be.gemm(shape, &[2.0], &[3.0], &mut c, true) {
            Err(ModelError::Device(what)) => assert!(what.contains("gemm #2"), "{what}"),
            other => panic!("gemm #2 must fail: {other:?}"),
        }
        assert_eq!(c, [6.0], "the failed call computes nothing");
        assert!(be.gemm(shape, &[2.0], &[3.0], &mut c, true).is_ok());
        assert_eq!((c, be.gemms()), ([12.0], 3));
    }

    #[test]
    fn gflops_helper_reports_a_positive_rate() {
        let r = gemm_gflops(&Cpu::new(), 32, 32, 32, 2).unwrap();
        assert!(r.is_finite() && r > 0.0);
        let r = matrixmultiply_gflops(32, 32, 32, 2);
        assert!(r.is_finite() && r > 0.0);
    }
}
