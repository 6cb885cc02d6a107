//! Matrix products of the float-generic kernels, `c (+)= op(a) op(b)` on row-major buffers,
//! through the `gemm` crate (the crate [`crate::backend`] chose, for the reasons given there),
//! for both float types the kernels run in: `f32` for training, `f64` for the gradient checks,
//! so that the checked code is the code that trains (NN-2).
//!
//! Products run on the calling thread (`Parallelism::None`): in data-parallel training the
//! ranks are the parallelism, one per core, and a product that spread over every core would
//! fight with the other ranks. [`crate::Cpu`]'s matrix multiply takes the same route with its
//! own thread count (one by default).
//!
//! Invariants:
//! - `GEMM-1`: [`Gemm::gemm`] with a [`GemmShape`] computes what [`crate::Backend::gemm`]
//!   computes with it: `c = op(a) op(b)`, or `c += op(a) op(b)` when `accumulate`, `op(a)`
//!   `m x k` (stored `k x m` with `trans_a`), `op(b)` `k x n` (stored `n x k` with
//!   `trans_b`), `c` row-major `m x n`; it equals the plain triple loop to float rounding for
//!   every transpose, in `f32` and `f64`, including `k = 0` (zeros, or `c` unchanged when
//!   accumulating) and empty `m` or `n` (nothing written).
//! - `GEMM-2`: only the first `m * n` values of `c` are written; longer slices are fine,
//!   shorter ones are a caller bug and panic before anything is written.
//! - `GEMM-3`: [`Gemm::gemm_view`] computes `c (+)= a b` over matrices that lie inside their
//!   slices at any offset and row and column strides ([`View`]), as the plain triple loop
//!   does, and writes only the elements of `c`'s view; a view reaching past its slice panics
//!   before anything is written.

use std::cell::RefCell;

use num_traits::Float;

use super::products::Form;
use super::transpose::Transpose;
use crate::backend::GemmShape;
use crate::meter::{self, Scratch, Use};

/// A matrix inside a slice: element `(r, c)` at `off + r * rs + c * cs` (GEMM-3). Attention
/// reads one head of q, k and v in place from the fused `c_attn` output this way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// Index of element `(0, 0)`.
    pub off: usize,
    /// Distance between rows.
    pub rs: usize,
    /// Distance between columns.
    pub cs: usize,
}

impl View {
    /// Rows of `rs` values apart, each contiguous, from `off`.
    pub fn rows(off: usize, rs: usize) -> Self {
        View { off, rs, cs: 1 }
    }

    /// The transposed matrix over the same values.
    pub fn t(self) -> Self {
        View { off: self.off, rs: self.cs, cs: self.rs }
    }

    /// One past the last index of a `rows x cols` matrix at this view (0 when empty).
    fn end(&self, rows: usize, cols: usize) -> usize {
        if rows == 0 || cols == 0 {
            return 0;
        }
        self.off + (rows - 1) * self.rs + (cols - 1) * self.cs + 1
    }
}

/// A float type whose matrix products go through the `gemm` crate: `f32` and `f64`.
pub trait Gemm: Float + 'static {
    /// `c = op(a) op(b)`, or `c += op(a) op(b)` when `accumulate` (GEMM-1), on this thread.
    fn gemm(shape: GemmShape, a: &[Self], b: &[Self], c: &mut [Self], accumulate: bool);

    /// `c = a b`, or `c += a b` when `accumulate`, with `a` an `m x k`, `b` a `k x n` and `c`
    /// an `m x n` matrix at their views (GEMM-3), on this thread.
    fn gemm_view(
        mnk: (usize, usize, usize),
        a: (&[Self], View),
        b: (&[Self], View),
        c: (&mut [Self], View),
        accumulate: bool,
    );
}

thread_local! {
    /// Column-major scratch of the `a b^T` products, one per float type (grown, never shrunk:
    /// no allocation per call).
    /// Both are charged to the thread's meter (METER-3).
    static SCRATCH_F32: RefCell<Scratch<f32>> = const { RefCell::new(Scratch::new()) };
    static SCRATCH_F64: RefCell<Scratch<f64>> = const { RefCell::new(Scratch::new()) };
    /// The charge for the `gemm` crate's packing slab of this thread.
    static SLAB: RefCell<Option<meter::Kept>> = const { RefCell::new(None) };
}

/// Charges the `gemm` crate's per-thread packing slab (`gemm_common::gemm::L2_SLAB`, the
/// size of the L2 cache, made on the thread's first product that packs its left operand in
/// blocks and kept for the thread's life) to the thread's meter. The slab is made here if it
/// was not yet, so the charge is never for memory that does not exist (METER-3).
fn charge_slab() {
    if !meter::installed() {
        return;
    }
    let bytes = gemm_common::gemm::L2_SLAB.with(|m| m.borrow().len());
    SLAB.with(|c| meter::keep_charged(&mut c.borrow_mut(), bytes, Use::Scratch));
}

impl Gemm for f32 {
    fn gemm(shape: GemmShape, a: &[f32], b: &[f32], c: &mut [f32], accumulate: bool) {
        gemm_f32(shape, a, b, c, accumulate, gemm::Parallelism::None);
    }

    fn gemm_view(
        mnk: (usize, usize, usize),
        a: (&[f32], View),
        b: (&[f32], View),
        c: (&mut [f32], View),
        accumulate: bool,
    ) {
        charge_slab();
        SCRATCH_F32.with(|s| product_view(mnk, a, b, c, accumulate, &mut s.borrow_mut()));
    }
}

impl Gemm for f64 {
    fn gemm(shape: GemmShape, a: &[f64], b: &[f64], c: &mut [f64], accumulate: bool) {
        let par = gemm::Parallelism::None;
        charge_slab();
        SCRATCH_F64.with(|s| product(shape, a, b, c, accumulate, par, &mut s.borrow_mut()));
    }

    fn gemm_view(
        mnk: (usize, usize, usize),
        a: (&[f64], View),
        b: (&[f64], View),
        c: (&mut [f64], View),
        accumulate: bool,
    ) {
        charge_slab();
        SCRATCH_F64.with(|s| product_view(mnk, a, b, c, accumulate, &mut s.borrow_mut()));
    }
}

/// [`Gemm::gemm_view`] for a float type the `gemm` crate handles, with that type's scratch.
fn product_view<T: Transpose + Default + 'static>(
    (m, n, k): (usize, usize, usize),
    (a, va): (&[T], View),
    (b, vb): (&[T], View),
    (c, vc): (&mut [T], View),
    accumulate: bool,
    scratch: &mut Scratch<T>,
) {
    assert!(va.end(m, k) <= a.len(), "gemm_view: a {va:?} ({m} x {k}) past {} values", a.len());
    assert!(vb.end(k, n) <= b.len(), "gemm_view: b {vb:?} ({k} x {n}) past {} values", b.len());
    assert!(vc.end(m, n) <= c.len(), "gemm_view: c {vc:?} ({m} x {n}) past {} values", c.len());
    let transposed_b = vb.rs == 1 && vb.cs > 1 && vc.cs == 1;
    let form = if transposed_b { Form::ViewT } else { Form::View };
    super::products::note(m, n, k, form, accumulate);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    c[vc.off + i * vc.rs + j * vc.cs] = T::zero();
                }
            }
        }
        return;
    }
    // `b` stored as the rows of its transpose (`a b^T`, attention's scores) into a row-major
    // `c` is `gemm`'s slow case (see `product`): multiply a row-major copy of `b` instead,
    // `k x n` values, one key or value block.
    let (b, vb) = if transposed_b {
        let copy = scratch.get(k * n);
        // The stored rows (`n` of `k` values, `cs` apart) transposed into `k x n`.
        T::transpose(&b[vb.off..], vb.cs, (n, k), copy, n, false);
        (&*copy, View::rows(0, n))
    } else {
        (b, vb)
    };
    // SAFETY: the asserts above put every index the views reach (row < m, col < n,
    // inner < k) inside the slices (the copy of `b` is `k x n` at `View::rows(0, n)`); `c`
    // is borrowed mutably and does not alias `a` or `b`. `T` is f32 or f64 (the `Gemm`
    // impls), which `gemm` supports. Strides are below `isize::MAX` as slice lengths are.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr().add(vc.off),
            vc.cs as isize,
            vc.rs as isize,
            accumulate,
            a.as_ptr().add(va.off),
            va.cs as isize,
            va.rs as isize,
            b.as_ptr().add(vb.off),
            vb.cs as isize,
            vb.rs as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// [`Gemm::gemm`] in `f32` with a chosen parallelism: also the product of
/// [`crate::Cpu`]'s [`crate::Backend::gemm`], so that the layers and the float-generic
/// kernels share one route (and one scratch per thread).
pub(crate) fn gemm_f32(
    shape: GemmShape,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    accumulate: bool,
    par: gemm::Parallelism,
) {
    charge_slab();
    SCRATCH_F32.with(|s| product(shape, a, b, c, accumulate, par, &mut s.borrow_mut()));
}

/// `c[i * n + j] (+)= t[j * m + i]`: a column-major `m x n` matrix into a row-major one
/// (TRANS-1).
fn transpose_into<T: Transpose>(t: &[T], m: usize, n: usize, c: &mut [T], accumulate: bool) {
    T::transpose(t, m, (n, m), c, n, accumulate);
}

/// Multiply-adds from which an `a b^T` product copies `b` transposed rather than `c`.
const COPY_B_MIN: usize = 64 * 64 * 64;

/// [`Gemm::gemm`] for a float type the `gemm` crate handles, with that type's scratch.
fn product<T: Transpose + Default + 'static>(
    shape: GemmShape,
    a: &[T],
    b: &[T],
    c: &mut [T],
    accumulate: bool,
    par: gemm::Parallelism,
    scratch: &mut Scratch<T>,
) {
    let GemmShape { m, n, k, trans_a, trans_b } = shape;
    assert!(a.len() >= m * k, "gemm: a has {} values, needs {}", a.len(), m * k);
    assert!(b.len() >= k * n, "gemm: b has {} values, needs {}", b.len(), k * n);
    assert!(c.len() >= m * n, "gemm: c has {} values, needs {}", c.len(), m * n);
    super::products::note(m, n, k, Form::of(trans_a, trans_b), accumulate);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(T::zero());
        }
        return;
    }
    let (a_rs, a_cs) = if trans_a { (1, m as isize) } else { (k as isize, 1) };
    // `op(a) rhs` into `dst` (m * n values), row-major or column-major, where `rhs` is `op(b)`
    // with row and column strides `rhs_rs`, `rhs_cs`.
    let multiply = |dst: &mut [T], col_major: bool, read_dst: bool, rhs: &[T], rhs_rs, rhs_cs| {
        assert!(dst.len() >= m * n, "gemm: destination has {} values", dst.len());
        assert!(rhs.len() >= k * n, "gemm: b has {} values, needs {}", rhs.len(), k * n);
        let (dst_rs, dst_cs) = if col_major { (1, m as isize) } else { (n as isize, 1) };
        // SAFETY: the asserts guarantee that every index the strides reach (row < m, col < n,
        // inner < k) lies inside the slices; `dst` is borrowed mutably and does not alias `a`
        // or `rhs`. `T` is f32 or f64 (the `Gemm` impls), which `gemm` supports.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                dst_cs,
                dst_rs,
                read_dst,
                a.as_ptr(),
                a_cs,
                a_rs,
                rhs.as_ptr(),
                rhs_cs,
                rhs_rs,
                T::one(),
                T::one(),
                false,
                false,
                false,
                par,
            );
        }
    };
    if trans_b && !trans_a {
        // `a b^T` (a linear forward, attention's scores) into a row-major `c` is the slow
        // case of `gemm` (`examples/gemm_shapes.rs`: about 60% of the rate of `a b`). For a
        // large product with `k <= m` (a linear forward over many rows), `b` is copied
        // transposed (`k x n` values, fewer than `c`'s), which makes it `a b`. Otherwise
        // the product goes into a column-major scratch that is then transposed into `c`: on
        // small products the two cost the same, and this one stays the
        // closer to the `f64` result on the small test models (NN-2).
        let copy_b = k <= m && m * n * k >= COPY_B_MIN;
        let want = if copy_b { k * n } else { m * n };
        let t = scratch.get(want);
        if copy_b {
            transpose_into(b, k, n, t, false);
            multiply(c, false, accumulate, t, n as isize, 1);
        } else {
            multiply(t, true, false, b, 1, k as isize);
            transpose_into(t, m, n, &mut c[..m * n], accumulate);
        }
    } else {
        let (b_rs, b_cs) = if trans_b { (1, k as isize) } else { (n as isize, 1) };
        multiply(c, false, accumulate, b, b_rs, b_cs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::{randn, to_f32};

    /// The plain triple loop, summed in `f64`.
    fn naive<T: Float>(shape: GemmShape, a: &[T], b: &[T], c: &mut [T], accumulate: bool) {
        let GemmShape { m, n, k, trans_a, trans_b } = shape;
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    let av = if trans_a { a[p * m + i] } else { a[i * k + p] };
                    let bv = if trans_b { b[j * k + p] } else { b[p * n + j] };
                    s += av.to_f64().unwrap() * bv.to_f64().unwrap();
                }
                let s = T::from(s).unwrap();
                let cij = &mut c[i * n + j];
                *cij = if accumulate { *cij + s } else { s };
            }
        }
    }

    fn check<T: Gemm + std::fmt::Debug>(conv: impl Fn(Vec<f64>) -> Vec<T>, tol: f64) {
        let mut seed = 1;
        for (m, n, k) in [
            (1, 1, 1),
            (3, 5, 7),
            (17, 9, 33),
            (64, 40, 1),
            (70, 45, 20),
            (130, 40, 64),
            (0, 3, 2),
            (2, 3, 0),
        ] {
            for (trans_a, trans_b) in [(false, false), (false, true), (true, false), (true, true)] {
                let shape = GemmShape { m, n, k, trans_a, trans_b };
                seed += 3;
                let (a, b) = (conv(randn(m * k, seed)), conv(randn(k * n, seed + 1)));
                // Two values past the matrix, which GEMM-2 leaves alone.
                let c0 = conv(randn(m * n + 2, seed + 2));
                for accumulate in [false, true] {
                    let mut want = c0.clone();
                    naive(shape, &a, &b, &mut want, accumulate);
                    let mut got = c0.clone();
                    T::gemm(shape, &a, &b, &mut got, accumulate);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let (g, w) = (g.to_f64().unwrap(), w.to_f64().unwrap());
                        assert!(
                            (g - w).abs() <= tol * (1.0 + w.abs()),
                            "{shape:?} accumulate {accumulate}: c[{i}] {g} vs {w}"
                        );
                    }
                    assert_eq!(got[m * n..], c0[m * n..], "{shape:?}: past the matrix");
                }
            }
        }
    }

    /// GEMM-1, GEMM-2: f64 to 1e-13, f32 to its rounding, against the triple loop.
    #[test]
    fn matches_the_triple_loop_gemm_1_2() {
        check::<f64>(|v| v, 1e-13);
        check::<f32>(|v| to_f32(&v), 1e-5);
    }

    /// GEMM-3: products over views (offsets, row strides, transposes) equal the triple loop
    /// on the matrices copied out, and leave everything outside `c`'s view alone.
    #[test]
    fn views_match_the_triple_loop_gemm_3() {
        fn run<T: Gemm + std::fmt::Debug>(conv: impl Fn(Vec<f64>) -> Vec<T>, tol: f64) {
            let mut seed = 70;
            for (m, n, k) in [(1, 1, 1), (3, 5, 7), (17, 9, 33), (64, 64, 64), (5, 4, 0), (0, 2, 3)]
            {
                for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                    seed += 3;
                    // Each matrix at an offset inside wider rows (a head inside fused rows).
                    let (wa, wb, wc) = (3 * k.max(m) + 2, 2 * n.max(k) + 5, 3 * n + 1);
                    let va = if ta { View::rows(1, wa).t() } else { View::rows(2, wa) };
                    let vb = if tb { View::rows(3, wb).t() } else { View::rows(1, wb) };
                    let vc = View::rows(n + 1, wc);
                    let a = conv(randn(wa * (m.max(k) + 1), seed));
                    let b = conv(randn(wb * (k.max(n) + 1), seed + 1));
                    let c0 = conv(randn(wc * (m + 1) + n + 1, seed + 2));
                    let at = |v: &[T], w: View, r: usize, c: usize| v[w.off + r * w.rs + c * w.cs];
                    let dense = |v: &[T], w: View, rows: usize, cols: usize| -> Vec<T> {
                        (0..rows * cols).map(|i| at(v, w, i / cols, i % cols)).collect()
                    };
                    let shape = GemmShape { m, n, k, trans_a: false, trans_b: false };
                    for accumulate in [false, true] {
                        let mut want = dense(&c0, vc, m, n);
                        naive(
                            shape,
                            &dense(&a, va, m, k),
                            &dense(&b, vb, k, n),
                            &mut want,
                            accumulate,
                        );
                        let mut got = c0.clone();
                        T::gemm_view((m, n, k), (&a, va), (&b, vb), (&mut got, vc), accumulate);
                        let what = format!("{m}x{n}x{k} ta {ta} tb {tb} acc {accumulate}");
                        for (i, (g, w)) in dense(&got, vc, m, n).iter().zip(&want).enumerate() {
                            let (g, w) = (g.to_f64().unwrap(), w.to_f64().unwrap());
                            assert!(
                                (g - w).abs() <= tol * (1.0 + w.abs()),
                                "{what}: c[{i}] {g} vs {w}"
                            );
                        }
                        // Outside the view nothing moved.
                        let mut inside = vec![false; got.len()];
                        (0..m * n).for_each(|i| inside[vc.off + (i / n) * vc.rs + i % n] = true);
                        for (i, (g, c)) in got.iter().zip(&c0).enumerate() {
                            assert!(inside[i] || g == c, "{what}: wrote outside the view at {i}");
                        }
                    }
                }
            }
        }
        run::<f64>(|v| v, 1e-13);
        run::<f32>(|v| to_f32(&v), 1e-5);
    }

    /// GEMM-3: a view reaching past its slice panics.
    #[test]
    #[should_panic(expected = "gemm_view: b")]
    fn a_view_past_its_slice_panics_gemm_3() {
        let v = View::rows(0, 2);
        f64::gemm_view((2, 2, 2), (&[1.0; 4], v), (&[1.0; 3], v), (&mut [0.0; 4], v), false);
    }

    /// GEMM-2: a destination shorter than `m * n` panics.
    #[test]
    #[should_panic(expected = "gemm: c has")]
    fn short_destination_panics_gemm_2() {
        let shape = GemmShape { m: 2, n: 2, k: 1, trans_a: false, trans_b: false };
        f64::gemm(shape, &[1.0, 2.0], &[3.0, 4.0], &mut [0.0; 3], false);
    }
}
