//! Transposed copies of row-major blocks, for the matrix products whose `b` is stored as the
//! rows of its transpose ([`super::gemm`]: a linear layer's `x W^T`, attention's `q k^T`):
//! those copy `b` (or their column-major result) transposed, several million values a
//! training step. A scalar copy reads one value per strided load; in `f32` with AVX2 the
//! copy moves 8 x 8 blocks through registers (eight row loads, three rounds of shuffles,
//! eight row stores): in a world-1 `gpt` step's profile the copies fell from 3.1% of the
//! samples to 0.9% (bench/RESULTS.md). Written by hand: no crate offers a strided,
//! accumulating SIMD transpose, and the `transpose` crate's is scalar.
//!
//! Invariants:
//! - `TRANS-1`: [`Transpose::transpose`] sets `dst[j * ds + i] = src[i * ss + j]`, or adds
//!   `src[i * ss + j]` to it when accumulating, for every `i < rows`, `j < cols`, and writes
//!   no other element of `dst`; the values are those of the scalar loop bit for bit (a copy,
//!   or one IEEE addition per element), on every route. A block reaching past either slice
//!   panics before anything is written.

use num_traits::Float;

/// Edge of the square tiles the copy walks, so that the rows it reads and writes stay in
/// the L1 cache.
const TILE: usize = 64;

/// A float type with a transposed copy: `f32` (AVX2 where the CPU has it) and `f64`.
pub trait Transpose: Float {
    /// The `rows x cols` block of `src` (row stride `ss`) transposed into the `cols x rows`
    /// block of `dst` (row stride `ds`), written or added (TRANS-1). The scalar loop unless
    /// the type has a faster route.
    fn transpose(
        src: &[Self],
        ss: usize,
        shape: (usize, usize),
        dst: &mut [Self],
        ds: usize,
        accumulate: bool,
    ) {
        check(src, ss, shape, dst, ds);
        scalar(src, ss, shape, dst, ds, accumulate);
    }
}

/// Panics unless both blocks lie inside their slices (TRANS-1).
fn check<T>(src: &[T], ss: usize, (rows, cols): (usize, usize), dst: &[T], ds: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    let (src_end, dst_end) = ((rows - 1) * ss + cols, (cols - 1) * ds + rows);
    assert!(src_end <= src.len(), "transpose: source block ends at {src_end}, past {}", src.len());
    assert!(dst_end <= dst.len(), "transpose: target block ends at {dst_end}, past {}", dst.len());
}

/// The plain tiled loop, for every float type and for the edges of the SIMD route.
fn scalar<T: Float>(
    src: &[T],
    ss: usize,
    (rows, cols): (usize, usize),
    dst: &mut [T],
    ds: usize,
    accumulate: bool,
) {
    for i0 in (0..rows).step_by(TILE) {
        for j0 in (0..cols).step_by(TILE) {
            for j in j0..(j0 + TILE).min(cols) {
                let out = &mut dst[j * ds + i0..j * ds + (i0 + TILE).min(rows)];
                let col = src[i0 * ss + j..].iter().step_by(ss.max(1));
                if accumulate {
                    out.iter_mut().zip(col).for_each(|(x, &v)| *x = *x + v);
                } else {
                    out.iter_mut().zip(col).for_each(|(x, &v)| *x = v);
                }
            }
        }
    }
}

impl Transpose for f64 {}

impl Transpose for f32 {
    fn transpose(
        src: &[f32],
        ss: usize,
        shape: (usize, usize),
        dst: &mut [f32],
        ds: usize,
        accumulate: bool,
    ) {
        check(src, ss, shape, dst, ds);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above); `check` put both blocks inside
            // their slices, which `avx2::transpose` reads and writes only within.
            unsafe { avx2::transpose(src, ss, shape, dst, ds, accumulate) };
            return;
        }
        scalar(src, ss, shape, dst, ds, accumulate);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// One 8 x 8 block: rows `src + r * ss` (r < 8) to rows `dst + c * ds` (c < 8).
    ///
    /// # Safety
    /// AVX2 is available; the 8 rows of 8 values at `src` (stride `ss`) and at `dst` (stride
    /// `ds`) are readable, respectively writable.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block8(src: *const f32, ss: usize, dst: *mut f32, ds: usize, accumulate: bool) {
        // SAFETY: the caller's promise: AVX2, and these 8 + 8 rows of 8 values in bounds.
        unsafe {
            let r0 = _mm256_loadu_ps(src);
            let r1 = _mm256_loadu_ps(src.add(ss));
            let r2 = _mm256_loadu_ps(src.add(2 * ss));
            let r3 = _mm256_loadu_ps(src.add(3 * ss));
            let r4 = _mm256_loadu_ps(src.add(4 * ss));
            let r5 = _mm256_loadu_ps(src.add(5 * ss));
            let r6 = _mm256_loadu_ps(src.add(6 * ss));
            let r7 = _mm256_loadu_ps(src.add(7 * ss));
            // Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves
            // swapped: row c of the result holds element c of every source row.
            let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
            let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
            let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
            let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
            let (u0, u1) = (_mm256_shuffle_ps::<0x44>(t0, t2), _mm256_shuffle_ps::<0xEE>(t0, t2));
            let (u2, u3) = (_mm256_shuffle_ps::<0x44>(t1, t3), _mm256_shuffle_ps::<0xEE>(t1, t3));
            let (u4, u5) = (_mm256_shuffle_ps::<0x44>(t4, t6), _mm256_shuffle_ps::<0xEE>(t4, t6));
            let (u6, u7) = (_mm256_shuffle_ps::<0x44>(t5, t7), _mm256_shuffle_ps::<0xEE>(t5, t7));
            let rows = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for (c, v) in rows.into_iter().enumerate() {
                let at = dst.add(c * ds);
                let v = if accumulate { _mm256_add_ps(_mm256_loadu_ps(at), v) } else { v };
                _mm256_storeu_ps(at, v);
            }
        }
    }

    /// The tiled copy in 8 x 8 blocks, the edges of each tile (rows or columns past a
    /// multiple of 8) element by element.
    ///
    /// # Safety
    /// AVX2 is available, and both blocks lie inside their slices (`super::check`).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn transpose(
        src: &[f32],
        ss: usize,
        (rows, cols): (usize, usize),
        dst: &mut [f32],
        ds: usize,
        accumulate: bool,
    ) {
        let one = |dst: &mut [f32], i: usize, j: usize| {
            let (v, at) = (src[i * ss + j], &mut dst[j * ds + i]);
            *at = if accumulate { *at + v } else { v };
        };
        for i0 in (0..rows).step_by(super::TILE) {
            let i1 = (i0 + super::TILE).min(rows);
            for j0 in (0..cols).step_by(super::TILE) {
                let j1 = (j0 + super::TILE).min(cols);
                let mut i = i0;
                while i + 8 <= i1 {
                    let mut j = j0;
                    while j + 8 <= j1 {
                        // SAFETY: AVX2 (the caller's promise); rows i..i + 8 of the source
                        // reach column j + 8 <= cols, rows j..j + 8 of the target column
                        // i + 8 <= rows, inside the slices as `check` found.
                        unsafe {
                            let (s, d) = (src.as_ptr().add(i * ss + j), dst.as_mut_ptr());
                            block8(s, ss, d.add(j * ds + i), ds, accumulate);
                        }
                        j += 8;
                    }
                    for jj in j..j1 {
                        (i..i + 8).for_each(|ii| one(dst, ii, jj));
                    }
                    i += 8;
                }
                for ii in i..i1 {
                    (j0..j1).for_each(|jj| one(dst, ii, jj));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain double loop.
    fn naive<T: Float>(
        src: &[T],
        ss: usize,
        (rows, cols): (usize, usize),
        dst: &mut [T],
        ds: usize,
        accumulate: bool,
    ) {
        for i in 0..rows {
            for j in 0..cols {
                let v = src[i * ss + j];
                let x = &mut dst[j * ds + i];
                *x = if accumulate { *x + v } else { v };
            }
        }
    }

    /// A transposing route: [`Transpose::transpose`] or [`scalar`].
    type Route<T> = fn(&[T], usize, (usize, usize), &mut [T], usize, bool);

    fn values<T: Float>(n: usize, seed: u64) -> Vec<T> {
        let mut rng = crate::rng::SplitMix64::new(seed);
        (0..n).map(|_| T::from(rng.normal()).unwrap()).collect()
    }

    /// TRANS-1: bit for bit the naive loop's values, written or added, with every element
    /// outside the block untouched; square, ragged and strided blocks, on the SIMD route
    /// (where the CPU has it) and the scalar one.
    fn check_route<T: Float + std::fmt::Debug>(route: Route<T>) {
        let mut seed = 1;
        for (rows, cols) in [(1, 1), (8, 8), (3, 17), (64, 64), (70, 9), (129, 65), (0, 5)] {
            for (pad_s, pad_d) in [(0, 0), (5, 3)] {
                let (ss, ds) = (cols + pad_s, rows + pad_d);
                seed += 2;
                let src: Vec<T> = values(rows * ss + 1, seed);
                let dst0: Vec<T> = values(cols.max(1) * ds + 2, seed + 1);
                for accumulate in [false, true] {
                    let (mut want, mut got) = (dst0.clone(), dst0.clone());
                    naive(&src, ss, (rows, cols), &mut want, ds, accumulate);
                    route(&src, ss, (rows, cols), &mut got, ds, accumulate);
                    let bits = |v: &[T]| v.iter().map(|x| x.to_f64().unwrap().to_bits()).collect();
                    let (w, g): (Vec<u64>, Vec<u64>) = (bits(&want), bits(&got));
                    assert!(w == g, "{rows} x {cols}, strides {ss}, {ds}, accumulate {accumulate}");
                }
            }
        }
    }

    #[test]
    fn transposes_are_the_naive_loops_bit_for_bit_trans_1() {
        check_route::<f32>(f32::transpose);
        check_route::<f64>(f64::transpose);
        check_route::<f32>(scalar::<f32>);
    }

    #[test]
    #[should_panic(expected = "past")]
    fn a_block_past_its_slice_panics_trans_1() {
        let src = vec![0.0f32; 15];
        let mut dst = vec![0.0f32; 16];
        f32::transpose(&src, 4, (4, 4), &mut dst, 4, false);
    }
}
