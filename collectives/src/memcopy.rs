//! Large copies with non-temporal stores.
//!
//! A plain `copy_from_slice` of a buffer that does not fit in cache reads every destination
//! line before overwriting it (read-for-ownership) and leaves the cache full of lines nobody
//! reads soon. glibc switches to non-temporal stores only above a threshold derived from the
//! last-level cache size, which on hosts with a large shared cache (hundreds of MiB) is
//! never reached by a collective's buffers. No crate offers a maintained non-temporal
//! memcpy, so this module writes the loop (SSE2, part of every x86-64 CPU, so no run-time
//! detection).
//!
//! Where it is used, by measurement (2 cores, 260 MiB L3, 64 MiB buffers): the copies of
//! shm messages read in place from a peer's arena and the own shard of an all-gather
//! (shm all-gather W=2 2.9-3.9 -> 5.6-5.7 GB/s busbw, W=4 2.3-2.5 -> 3.1-3.2), and the
//! output of an out-of-place reduce-scatter, now written by its last reduction (`add_nt`;
//! shm W=2 busbw with the earlier non-temporal copy 3.2-3.6, fused 6.0). Not for the
//! slot ring, whose data a peer reads at once, nor for the `local` and `tcp` receive paths,
//! where it measured no better (local all-gather W=2 3.2 vs 3.8-4.3 GB/s in one run).
//!
//! Invariants:
//! - MC-1: [`copy`] leaves `dst` equal to `src`, for every length and alignment (the
//!   non-temporal body covers only whole 64-byte lines of a 16-byte-aligned destination;
//!   head and tail are copied plainly), and its stores are fenced before it returns.
//! - MC-2: copies shorter than [`NT_MIN_BYTES`] are plain copies (small data is read again
//!   soon and belongs in cache).
//! - MC-3: `add_nt` leaves `dst` bitwise equal to the plain loop `a[i] + b[i]`, for every
//!   length and alignment, its stores fenced before it returns.

/// Smallest copy done with non-temporal stores (env `SHARDLINE_NT_COPY_MIN_BYTES`, read
/// once; 0 turns them off).
pub const NT_MIN_BYTES: usize = 1 << 20;

fn nt_min() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        match std::env::var("SHARDLINE_NT_COPY_MIN_BYTES").ok().and_then(|v| v.trim().parse().ok())
        {
            Some(0) => usize::MAX,
            Some(n) => n,
            None => NT_MIN_BYTES,
        }
    })
}

/// Copies `src` into `dst` (equal lengths), with non-temporal stores when the copy is large
/// (MC-1, MC-2).
pub fn copy<T: bytemuck::Pod>(dst: &mut [T], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "copy: lengths differ");
    let dst: &mut [u8] = bytemuck::cast_slice_mut(dst);
    let src: &[u8] = bytemuck::cast_slice(src);
    if dst.len() >= nt_min() {
        copy_nt(dst, src);
    } else {
        dst.copy_from_slice(src);
    }
}

#[cfg(target_arch = "x86_64")]
fn copy_nt(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    /// Copies 64 bytes at `s` to `d` with non-temporal stores.
    ///
    /// # Safety
    /// `s` must be readable and `d` writable for 64 bytes, `d` 16-byte aligned.
    #[inline(always)]
    unsafe fn line(s: *const u8, d: *mut u8) {
        let (sp, dp) = (s as *const __m128i, d as *mut __m128i);
        // SAFETY: the caller's contract (64 readable / writable bytes, aligned `d`).
        unsafe {
            let a = _mm_loadu_si128(sp);
            let b = _mm_loadu_si128(sp.add(1));
            let c = _mm_loadu_si128(sp.add(2));
            let e = _mm_loadu_si128(sp.add(3));
            _mm_stream_si128(dp, a);
            _mm_stream_si128(dp.add(1), b);
            _mm_stream_si128(dp.add(2), c);
            _mm_stream_si128(dp.add(3), e);
        }
    }
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let lines = (dst.len() - head) / 64;
    let body_end = head + lines * 64;
    // SAFETY: every address passed to `line` is `head + k` with k + 64 <= body_end - head,
    // so all 64 bytes lie inside both slices; `head` makes the destination 16-byte aligned
    // and every offset added to it is a multiple of 64. SSE2 is part of the x86-64
    // baseline. The slices do not overlap (one is &mut).
    unsafe {
        let s = src.as_ptr().add(head);
        let d = dst.as_mut_ptr().add(head);
        // One line after the other. Copying four 4 KiB stripes side by side (glibc's large
        // copy) measured half as fast on a 32 MiB-L3 host: two threads each copying 2 x 32
        // MiB took 4.5-4.7 ms striped against 2.3-2.4 ms in line order
        // (`bench/baselines/nt_copy_orders.c`, `bench/RESULTS.md`).
        for i in 0..lines {
            line(s.add(i * 64), d.add(i * 64));
        }
        // Non-temporal stores are weakly ordered: fence them before anyone is told the data
        // is there (a Release store after this call then orders them too).
        _mm_sfence();
    }
    dst[body_end..].copy_from_slice(&src[body_end..]);
}

#[cfg(not(target_arch = "x86_64"))]
fn copy_nt(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

/// Whether a write of `bytes` into a fresh destination goes with non-temporal stores (MC-2).
pub(crate) fn wants_nt(bytes: usize) -> bool {
    bytes >= nt_min()
}

/// `dst[i] = a[i] + b[i]` with non-temporal stores (MC-3): an out-of-place reduction whose
/// result nobody reads at once (a reduce-scatter's output) skips reading the destination
/// for ownership and leaves the cache to its operands. Equal lengths.
pub(crate) fn add_nt(dst: &mut [f32], a: &[f32], b: &[f32]) {
    assert!(dst.len() == a.len() && a.len() == b.len(), "add_nt: lengths differ");
    add_nt_impl(dst, a, b);
}

#[cfg(target_arch = "x86_64")]
fn add_nt_impl(dst: &mut [f32], a: &[f32], b: &[f32]) {
    use std::arch::x86_64::{_mm_add_ps, _mm_loadu_ps, _mm_sfence, _mm_stream_ps};
    let plain = |d: &mut [f32], x: &[f32], y: &[f32]| {
        for ((d, x), y) in d.iter_mut().zip(x).zip(y) {
            *d = *x + *y;
        }
    };
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    plain(&mut dst[..head], &a[..head], &b[..head]);
    let blocks = (dst.len() - head) / 16;
    let body_end = head + blocks * 16;
    // SAFETY: every access is at `head + 16k + 4j` with 16(k + 1) <= body_end - head, inside
    // all three slices; `head` makes the destination 16-byte aligned, as `_mm_stream_ps`
    // needs. SSE2 is part of the x86-64 baseline. `dst` is &mut, so it overlaps neither
    // operand. `_mm_add_ps` rounds each lane as the scalar `+` does, so the result is
    // bitwise the plain loop's.
    unsafe {
        let (x, y, d) = (a.as_ptr().add(head), b.as_ptr().add(head), dst.as_mut_ptr().add(head));
        for k in 0..blocks {
            for j in 0..4 {
                let o = k * 16 + j * 4;
                _mm_stream_ps(d.add(o), _mm_add_ps(_mm_loadu_ps(x.add(o)), _mm_loadu_ps(y.add(o))));
            }
        }
        // Weakly ordered stores: fenced before anyone is told the data is there.
        _mm_sfence();
    }
    plain(&mut dst[body_end..], &a[body_end..], &b[body_end..]);
}

#[cfg(not(target_arch = "x86_64"))]
fn add_nt_impl(dst: &mut [f32], a: &[f32], b: &[f32]) {
    for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
        *d = *x + *y;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MC-3: every length around the block size, every misalignment, bitwise the plain sum.
    #[test]
    fn nt_add_equals_plain_sum_mc_3() {
        let a: Vec<f32> = (0..300).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let b: Vec<f32> = (0..300).map(|i| (i as f32 * 1.91).cos() / 7.0).collect();
        for len in [0usize, 1, 3, 4, 15, 16, 17, 31, 32, 33, 64, 250] {
            for off in 0..5 {
                let mut dst = vec![f32::NAN; len + 10];
                add_nt(&mut dst[off..off + len], &a[..len], &b[3..3 + len]);
                for i in 0..len {
                    assert_eq!(dst[off + i].to_bits(), (a[i] + b[3 + i]).to_bits(), "len {len}");
                }
                assert!(dst[..off].iter().all(|x| x.is_nan()), "wrote before dst");
                assert!(dst[off + len..].iter().all(|x| x.is_nan()), "wrote after dst");
            }
        }
    }

    /// MC-1: every length around the line size and 16 KiB, every misalignment.
    #[test]
    fn nt_copy_equals_source_mc_1() {
        let src: Vec<u8> = (0..16384 + 300).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0usize, 1, 15, 16, 63, 64, 65, 127, 128, 1000, 4096, 16384, 16384 + 100] {
            for so in 0..4 {
                for d_off in 0..17 {
                    let mut dst = vec![0xEEu8; len + 40];
                    copy_nt(&mut dst[d_off..d_off + len], &src[so..so + len]);
                    assert_eq!(&dst[d_off..d_off + len], &src[so..so + len], "len {len}");
                    assert!(dst[..d_off].iter().all(|&b| b == 0xEE), "wrote before dst");
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xEE), "wrote after dst");
                }
            }
        }
    }

    /// MC-2: below the threshold (and at zero bytes) no copy goes non-temporal; at and above
    /// it, one does unless the variable turned them off.
    #[test]
    fn only_large_copies_go_non_temporal_mc_2() {
        let min = nt_min();
        assert!(!wants_nt(0));
        assert!(!wants_nt(min - 1));
        // SHARDLINE_NT_COPY_MIN_BYTES=0 (off) reads as an unreachable minimum.
        if min != usize::MAX {
            assert!(wants_nt(min));
            assert!(wants_nt(min.saturating_mul(4)));
        }
    }

    /// MC-1 through the public entry, above the threshold.
    #[test]
    fn large_copy_of_f32() {
        let src: Vec<f32> = (0..(3 << 18) + 5).map(|i| i as f32).collect();
        let mut dst = vec![0.0f32; src.len()];
        copy(&mut dst, &src);
        assert_eq!(dst, src);
    }
}
