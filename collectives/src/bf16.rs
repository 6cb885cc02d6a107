//! bfloat16 on the wire: values rounded to bf16 and packed two to a 32-bit element, so that
//! the lanes, whose buffers are `f32` words, move them at half the bytes of `f32` values.
//!
//! A gather moves the packed words bit for bit (every schedule's copies are bitwise); a
//! reduction combines them with [`ReduceOp::SumBf16`](crate::ReduceOp::SumBf16), which
//! unpacks each pair, adds in `f32` and rounds the sums back to bf16, once per hop.
//!
//! Invariants:
//! - BFLOAT-1: [`round`] is round-to-nearest, ties to even, as `half::bf16::from_f32`: a NaN
//!   stays a NaN (quiet), infinities and signed zeros are kept, and a finite value too large
//!   for bf16 becomes an infinity of its sign.
//! - BFLOAT-2: [`pack`] then [`unpack`] gives every value rounded to bf16 (BFLOAT-1), element
//!   `2i` in the low half of word `i` and element `2i + 1` in the high half; an odd count
//!   pads the last word with a zero.
//! - BFLOAT-3: [`add_packed`] adds each pair of bf16 values in `f32` and rounds the sum to
//!   bf16 (BFLOAT-1); a reduction over `w` ranks rounds at each of its `w - 1` additions.

/// Words needed for `n` bf16 values.
pub fn words(n: usize) -> usize {
    n.div_ceil(2)
}

/// `x` rounded to the nearest bf16, ties to even (BFLOAT-1), as its 16 bits.
#[inline]
pub fn round(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        // Keep the sign and the top of the payload; force a quiet NaN.
        return ((b >> 16) | 0x0040) as u16;
    }
    let lsb = (b >> 16) & 1;
    (b.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// The `f32` value of bf16 bits `h` (exact).
#[inline]
pub fn widen(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

#[inline]
fn word(lo: u16, hi: u16) -> f32 {
    f32::from_bits(u32::from(lo) | (u32::from(hi) << 16))
}

#[inline]
fn halves(w: f32) -> (u16, u16) {
    let b = w.to_bits();
    (b as u16, (b >> 16) as u16)
}

/// Rounds `src` to bf16 and packs it into `dst` (BFLOAT-2); `dst.len() == words(src.len())`.
///
/// Panics when the lengths disagree (a caller's broken invariant).
pub fn pack(src: &[f32], dst: &mut [f32]) {
    assert_eq!(dst.len(), words(src.len()), "pack: {} values into {} words", src.len(), dst.len());
    let pairs = src.len() / 2;
    for (d, s) in dst[..pairs].iter_mut().zip(src.chunks_exact(2)) {
        *d = word(round(s[0]), round(s[1]));
    }
    if src.len() % 2 == 1 {
        dst[pairs] = word(round(src[src.len() - 1]), 0);
    }
}

/// Unpacks the first `dst.len()` bf16 values of `src` into `f32` (BFLOAT-2);
/// `src.len() == words(dst.len())`.
///
/// Panics when the lengths disagree.
pub fn unpack(src: &[f32], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        words(dst.len()),
        "unpack: {} words into {} values",
        src.len(),
        dst.len()
    );
    let pairs = dst.len() / 2;
    for (d, s) in dst.chunks_exact_mut(2).zip(&src[..pairs]) {
        let (lo, hi) = halves(*s);
        d[0] = widen(lo);
        d[1] = widen(hi);
    }
    if dst.len() % 2 == 1 {
        let n = dst.len();
        dst[n - 1] = widen(halves(src[pairs]).0);
    }
}

/// `acc += src` over packed bf16 pairs, each sum taken in `f32` and rounded to bf16
/// (BFLOAT-3).
///
/// Panics when the lengths differ.
pub fn add_packed(acc: &mut [f32], src: &[f32]) {
    assert_eq!(acc.len(), src.len(), "add_packed: length mismatch");
    for (a, s) in acc.iter_mut().zip(src) {
        *a = sum_word(*a, *s);
    }
}

/// `dst = a + b` over packed bf16 pairs: [`add_packed`] of `b` into a copy of `a`, bitwise.
///
/// Panics when the lengths differ.
pub fn add_packed_to(dst: &mut [f32], a: &[f32], b: &[f32]) {
    assert!(dst.len() == a.len() && a.len() == b.len(), "add_packed_to: length mismatch");
    for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
        *d = sum_word(*x, *y);
    }
}

#[inline]
fn sum_word(a: f32, b: f32) -> f32 {
    let ((a0, a1), (b0, b1)) = (halves(a), halves(b));
    word(round(widen(a0) + widen(b0)), round(widen(a1) + widen(b1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Values that probe every rounding case: ties (even and odd), the largest finite, the
    /// smallest subnormals, signed zeros, infinities, NaNs, and a spread of random bits.
    fn probes() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(0x8000_0001),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN whose payload is all below bit 16
            f32::from_bits(0x3f80_8000), // a tie, even below: rounds down
            f32::from_bits(0x3f81_8000), // a tie, odd below: rounds up
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x3f80_7fff),
            f32::from_bits(0x7f7f_ffff), // rounds up to infinity
        ];
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            v.push(f32::from_bits(s as u32));
        }
        v
    }

    /// BFLOAT-1: the rounding is `half`'s round-to-nearest-even, bit for bit (NaN: a NaN).
    #[test]
    fn bfloat_1_rounding_matches_half() {
        for x in probes() {
            let want = bf16::from_f32(x);
            let got = round(x);
            if x.is_nan() {
                assert!(widen(got).is_nan() && want.is_nan(), "{x:?}");
                assert_eq!(got & 0x8000, want.to_bits() & 0x8000, "NaN sign of {x:?}");
            } else {
                assert_eq!(got, want.to_bits(), "{x:?} ({:#010x})", x.to_bits());
                assert_eq!(widen(got).to_bits(), want.to_f32().to_bits());
            }
        }
    }

    /// BFLOAT-2: a pack/unpack round trip is the rounding, for even and odd counts, with the
    /// documented placement of each value in its word.
    #[test]
    fn bfloat_2_round_trip_is_the_rounding() {
        let all = probes();
        for n in [0, 1, 2, 3, 7, 1000, 1001] {
            let src = &all[all.len() - n..];
            let mut packed = vec![0.0f32; words(n)];
            pack(src, &mut packed);
            let mut back = vec![0.0f32; n];
            unpack(&packed, &mut back);
            for (i, (&x, &y)) in src.iter().zip(&back).enumerate() {
                let want = bf16::from_f32(x).to_f32();
                assert!(
                    y.to_bits() == want.to_bits() || (x.is_nan() && y.is_nan()),
                    "n={n} i={i}: {x:?} -> {y:?}, want {want:?}"
                );
                let (lo, hi) = halves(packed[i / 2]);
                assert_eq!(if i % 2 == 0 { lo } else { hi }, round(x));
            }
            if n % 2 == 1 {
                assert_eq!(halves(packed[n / 2]).1, 0, "the odd count's pad is zero");
            }
        }
    }

    /// BFLOAT-3: a packed sum is the f32 sum of the two bf16 values, rounded once; both forms
    /// agree bitwise.
    #[test]
    fn bfloat_3_packed_sums_round_the_f32_sum() {
        let xs: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let ys: Vec<f32> = (0..64).map(|i| (i as f32 * 0.91).cos() * 1e-2).collect();
        let (mut a, mut b) = (vec![0.0; 32], vec![0.0; 32]);
        pack(&xs, &mut a);
        pack(&ys, &mut b);
        let mut to = vec![0.0; 32];
        add_packed_to(&mut to, &a, &b);
        add_packed(&mut a, &b);
        assert!(a.iter().zip(&to).all(|(p, q)| p.to_bits() == q.to_bits()));
        let mut sum = vec![0.0; 64];
        unpack(&a, &mut sum);
        for i in 0..64 {
            let exact = bf16::from_f32(xs[i]).to_f32() + bf16::from_f32(ys[i]).to_f32();
            assert_eq!(sum[i].to_bits(), bf16::from_f32(exact).to_f32().to_bits(), "{i}");
        }
    }
}
