//! `exp` over rows for the softmaxes (attention's blocks, the token cross-entropy): the
//! scalar `expf` / `exp` of `libm` is a call per element, which the loops cannot vectorise.
//! In `f32` the values go through `exp_f64`, branch-free `f64` arithmetic that the compiler
//! vectorises (AVX-512 or AVX2 with FMA, chosen at run time), then round to `f32`; `f64`
//! keeps `f64::exp`, so the gradient checks run on the exact function.
//!
//! Invariants:
//! - `EXP-1`: `exp_f64` is within `1e-9` relative of `f64::exp` for every argument in
//!   `[-700, 700]`, `exp_f64(0) = 1` exactly, and an argument below `-700` gives at most
//!   `exp(-700)` (0 once rounded to `f32`).
//! - `EXP-2`: [`RowExp::exp_shifted`] writes `exp(x * scale - shift)` over each `x` of the row,
//!   the product and difference rounded in the row's float type as the scalar expression
//!   would round them, and returns the sum of the written values: in `f64` exactly the
//!   scalar loop's values (`f64::exp`); in `f32` each value within 1 ulp of the scalar
//!   `expf`, the sum within `f32` rounding of the values' sum.
//! - `EXP-3`: [`sum_exp_f32`] and [`softmax_f32`] compute the token cross-entropy's `f64`
//!   softmax of `f32` logits: `sum_j exp(x_j - m)`, and `exp(x_j - m) / z * scale` rounded to
//!   `f32`, each within `1e-9` relative of the same expressions through `f64::exp`.

use num_traits::Float;

/// Horner's rule with fused multiply-adds, highest coefficient first.
#[inline(always)]
pub(crate) fn horner(t: f64, coefs: &[f64]) -> f64 {
    coefs[1..].iter().fold(coefs[0], |p, &c| p.mul_add(t, c))
}

/// `exp(x)`, branch-free (vectorises), relative error below 1e-9 (EXP-1); the argument is
/// clamped to `[-700, 700]` (past `f32`'s range).
#[inline(always)]
pub(crate) fn exp_f64(x: f64) -> f64 {
    // 1.5 * 2^52: adding it rounds to an integer, which lands in the low mantissa bits.
    const ROUND: f64 = 6_755_399_441_055_744.0;
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    // Taylor to r^8 on |r| <= ln 2 / 2 (the next term is below 2.1e-10).
    const TAYLOR: [f64; 9] = [
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];
    let x = x.clamp(-700.0, 700.0);
    let k = x.mul_add(std::f64::consts::LOG2_E, ROUND);
    let n = k - ROUND;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    // 2^n from n's low bits (n + 1023 lies in [13, 2033]).
    horner(r, &TAYLOR) * f64::from_bits(k.to_bits().wrapping_add(1023) << 52)
}

/// Runs `$body` (which must only call `#[inline(always)]` code) compiled for AVX-512 or
/// AVX2 with FMA when the CPU has them; otherwise as is (without FMA, `mul_add` would be a
/// library call, still correct).
macro_rules! dispatch {
    (|$($arg:ident: $ty:ty),*| -> $ret:ty $body:block) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) -> $ret $body
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) -> $ret $body
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("fma") {
                // SAFETY: the CPU has the features the function is compiled for.
                return unsafe { avx512($($arg),*) };
            }
            if has!("avx2") && has!("fma") {
                // SAFETY: as above.
                return unsafe { avx2($($arg),*) };
            }
        }
        fn plain($($arg: $ty),*) -> $ret $body
        plain($($arg),*)
    }};
}

/// A float type whose rows go through a vectorised `exp` where it has one (EXP-2).
pub trait RowExp: Float {
    /// `x = exp(x * scale - shift)` over `row`; returns the sum of the new values.
    fn exp_shifted(row: &mut [Self], scale: Self, shift: Self) -> Self {
        let mut sum = Self::zero();
        for x in row.iter_mut() {
            *x = (*x * scale - shift).exp();
            sum = sum + *x;
        }
        sum
    }
}

impl RowExp for f64 {}

impl RowExp for f32 {
    fn exp_shifted(row: &mut [f32], scale: f32, shift: f32) -> f32 {
        dispatch!(|row: &mut [f32], scale: f32, shift: f32| -> f32 {
            // Eight partial sums in a fixed order: one running sum is a serial chain.
            let mut acc = [0.0f64; 8];
            let mut chunks = row.chunks_exact_mut(8);
            for c in &mut chunks {
                for (x, a) in c.iter_mut().zip(acc.iter_mut()) {
                    let e = exp_f64(f64::from(*x * scale - shift)) as f32;
                    *x = e;
                    *a += f64::from(e);
                }
            }
            let mut tail = 0.0f64;
            for x in chunks.into_remainder() {
                let e = exp_f64(f64::from(*x * scale - shift)) as f32;
                *x = e;
                tail += f64::from(e);
            }
            (acc.iter().sum::<f64>() + tail) as f32
        })
    }
}

/// `sum_j exp(x_j - m)` in `f64` over `f32` values (EXP-3).
pub fn sum_exp_f32(row: &[f32], m: f64) -> f64 {
    dispatch!(|row: &[f32], m: f64| -> f64 {
        let mut acc = [0.0f64; 8];
        let mut chunks = row.chunks_exact(8);
        for c in &mut chunks {
            for (&x, a) in c.iter().zip(acc.iter_mut()) {
                *a += exp_f64(f64::from(x) - m);
            }
        }
        let tail: f64 = chunks.remainder().iter().map(|&x| exp_f64(f64::from(x) - m)).sum();
        acc.iter().sum::<f64>() + tail
    })
}

/// `x_j = (exp(x_j - m) / z * scale) as f32` over the row (EXP-3).
pub fn softmax_f32(row: &mut [f32], m: f64, z: f64, scale: f64) {
    dispatch!(|row: &mut [f32], m: f64, z: f64, scale: f64| -> () {
        for x in row.iter_mut() {
            *x = (exp_f64(f64::from(*x) - m) / z * scale) as f32;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn ulps(a: f32, b: f32) -> i64 {
        (a.to_bits() as i64 - b.to_bits() as i64).abs()
    }

    /// EXP-1: against `f64::exp` over the range, at 0, and past the clamp.
    #[test]
    fn exp_f64_is_within_1e9_of_std_exp_1() {
        let mut rng = SplitMix64::new(3);
        for i in 0..200_000 {
            let x = if i % 2 == 0 {
                1400.0 * rng.next_f64() - 700.0
            } else {
                8.0 * rng.next_f64() - 4.0
            };
            let (got, want) = (exp_f64(x), x.exp());
            assert!((got - want).abs() <= 1e-9 * want, "exp({x}) = {got}, want {want}");
        }
        assert_eq!(exp_f64(0.0), 1.0);
        assert!(exp_f64(-1e6) <= (-700.0f64).exp() && (exp_f64(-1e6) as f32) == 0.0);
        assert!(exp_f64(f64::NEG_INFINITY) as f32 == 0.0);
    }

    /// EXP-2: f32 within 1 ulp of `expf` (lengths off the 8-lane chunks too); f64 exact.
    #[test]
    fn exp_shifted_matches_the_scalar_loop_exp_2() {
        let mut rng = SplitMix64::new(5);
        for len in [0, 1, 7, 8, 9, 64, 100] {
            let x: Vec<f64> = (0..len).map(|_| 20.0 * rng.next_f64() - 15.0).collect();
            let (scale, shift) = (0.125f64, 2.5f64);
            let mut want64 = x.clone();
            let s64 = <f64 as RowExp>::exp_shifted(&mut want64, scale, shift);
            for (w, &v) in want64.iter().zip(&x) {
                assert_eq!(*w, (v * scale - shift).exp());
            }
            assert!((s64 - want64.iter().sum::<f64>()).abs() <= 1e-12 * s64.max(1.0));
            let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            let mut got = x32.clone();
            let s32 = f32::exp_shifted(&mut got, scale as f32, shift as f32);
            let mut sum = 0.0f64;
            for (g, &v) in got.iter().zip(&x32) {
                let w = (v * scale as f32 - shift as f32).exp();
                assert!(ulps(*g, w) <= 1, "exp({v} * {scale} - {shift}) = {g}, want {w}");
                sum += f64::from(*g);
            }
            assert!((f64::from(s32) - sum).abs() <= 1e-6 * sum.max(1e-30), "{s32} vs {sum}");
        }
        // A shift far above the values gives zeros, not NaN.
        let mut row = [-1e30f32, 0.0, 3.0];
        assert_eq!(f32::exp_shifted(&mut row, 1.0, 1e30), 0.0);
        assert_eq!(row, [0.0; 3]);
    }

    /// EXP-3: the cross-entropy's f64 softmax over f32 logits, against `f64::exp`.
    #[test]
    fn softmax_f32_matches_std_exp_3() {
        let mut rng = SplitMix64::new(7);
        let row: Vec<f32> = (0..37).map(|_| (30.0 * rng.next_f64() - 10.0) as f32).collect();
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let want_z: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        let z = sum_exp_f32(&row, m);
        assert!((z - want_z).abs() <= 1e-9 * want_z, "{z} vs {want_z}");
        let mut got = row.clone();
        softmax_f32(&mut got, m, z, 0.25);
        for (g, &v) in got.iter().zip(&row) {
            let w = (v as f64 - m).exp() / want_z * 0.25;
            assert!(
                (f64::from(*g) - w).abs() <= 1e-9 * w + f64::from(f32::EPSILON) * w,
                "{g} vs {w}"
            );
        }
    }
}
