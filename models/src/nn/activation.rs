//! Elementwise activations of transformer MLPs, with PyTorch's definitions: GELU (exact, and
//! the tanh form of `approximate='tanh'`) and SiLU. Backward takes the saved INPUT (all three
//! derivatives are functions of `x`, not of `y`), so the caller keeps the input, not the
//! output.
//!
//! The exact GELU needs `erf`, which stable Rust's `std` lacks and [`num_traits::Float`] does
//! not provide. It comes from `libm` (the Rust port of FreeBSD's msun, kept with the Rust
//! compiler's builtins): `erf` for `f64` and `erff` for `f32`, each within an ulp or so.
//! `libm` is not generic, so [`Erf`] maps each float type to its function. A hand-written
//! approximation (Abramowitz-Stegun 7.1.26, about `1e-7` absolute) would not do: its error
//! would exceed the `f64` gradient check's tolerance and the agreement with torch in `f64`.
//! The `f32` slice route that training takes ([`Activation::forward_saving_derivative`]) has
//! its own `erfc` in `f32` arithmetic instead, with the tail's relative accuracy (ACTIV-5),
//! since a scalar `erff` and `expf` per element made the GELU a tenth of a GPT step.
//!
//! Invariants:
//! - `ACTIV-1`: [`Activation::Gelu`] is `torch.nn.functional.gelu(x)`:
//!   `y = x / 2 * (1 + erf(x / sqrt(2)))`, derivative `Phi(x) + x * phi(x)`.
//! - `ACTIV-2`: [`Activation::GeluTanh`] is `torch.nn.functional.gelu(x, approximate='tanh')`:
//!   `y = x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))`.
//! - `ACTIV-3`: [`Activation::Silu`] is `torch.nn.functional.silu(x)`: `y = x * sigmoid(x)`.
//! - `ACTIV-5`: [`Activation::forward_saving_derivative`] writes the values and derivatives of
//!   [`Activation::value`] and [`Activation::derivative`]: the same values in `f64` (and for
//!   the tanh form and SiLU); for the exact GELU in `f32`, within 4 ulp of the exact values
//!   (of the derivative's terms `Phi(x) + |x| phi(x)`, which cancel near GELU's minimum;
//!   plus `1e-37` absolute), through [`Erf::gelu_saving_derivative`]'s vectorised `f32`
//!   path, the same bits on every route (AVX-512, AVX2, none).
//! - `ACTIV-4`: every forward and derivative is finite for every finite input, `f32` and
//!   `f64`, up to `+-MAX` (the tanh form's derivative would give `0 * inf` there: it is
//!   taken as 0, its limit).

use num_traits::Float;

use super::{lit, same_len};
use crate::error::ModelError;

/// A float type with an error function: `f32` and `f64`, through `libm`.
pub trait Erf: Float {
    /// The error function, `2 / sqrt(pi) * integral from 0 to x of exp(-t^2) dt`.
    fn erf(self) -> Self;

    /// The exact GELU of every element of `x_then_d` into `y`, and its derivative written over
    /// `x_then_d` (ACTIV-5). Same lengths (the caller checks).
    fn gelu_saving_derivative(x_then_d: &mut [Self], y: &mut [Self]) {
        for (v, o) in x_then_d.iter_mut().zip(y) {
            (*o, *v) = Activation::Gelu.value_and_derivative(*v);
        }
    }
}

impl Erf for f32 {
    fn erf(self) -> f32 {
        libm::erff(self)
    }

    /// `libm`'s `erff` and `expf` are scalar calls, which made the exact GELU the largest
    /// elementwise cost of a training step; this path is branch-free `f32` arithmetic
    /// (`gelu_f32_one`) that the compiler vectorises, on x86-64 for AVX-512 or AVX2 with
    /// FMA, chosen at run time.
    fn gelu_saving_derivative(x_then_d: &mut [f32], y: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("fma") {
                // SAFETY: the CPU has the features the function is compiled for.
                unsafe { gelu_f32_avx512(x_then_d, y) };
                return;
            }
            if has!("avx2") && has!("fma") {
                // SAFETY: as above.
                unsafe { gelu_f32_avx2(x_then_d, y) };
                return;
            }
        }
        // Elsewhere the same arithmetic (`mul_add` is a fused multiply-add on every target,
        // a library call where the CPU lacks one), so every route gives the same bits.
        gelu_f32(x_then_d, y);
    }
}

impl Erf for f64 {
    fn erf(self) -> f64 {
        libm::erf(self)
    }
}

/// Every element through [`gelu_f32_one`]; inlined into each of the routes below.
#[inline(always)]
fn gelu_f32(x_then_d: &mut [f32], y: &mut [f32]) {
    for (v, o) in x_then_d.iter_mut().zip(y) {
        (*o, *v) = gelu_f32_one(*v);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn gelu_f32_avx512(x_then_d: &mut [f32], y: &mut [f32]) {
    gelu_f32(x_then_d, y);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_f32_avx2(x_then_d: &mut [f32], y: &mut [f32]) {
    gelu_f32(x_then_d, y);
}

/// The exact GELU and its derivative at one `f32` (ACTIV-5), branch-free `f32` arithmetic
/// that the loops above vectorise (16 lanes with AVX-512), with one `exp` and one division.
///
/// `Phi(x)` goes through `erfc(|x| / sqrt(2)) = exp(-x^2 / 2) * erfcx(|x| / sqrt(2))` so that
/// the negative tail keeps its relative accuracy (`1 + erf` cancels there), and the same
/// `exp(-x^2 / 2)` is the derivative's `phi`. `erfcx(a) = P(q) / (a + 2)` with
/// `q = (a - 2) / (a + 2)` (the form of N. Juffa's `erfcf`), `P` a degree-10 polynomial.
#[inline(always)]
fn gelu_f32_one(x: f32) -> (f32, f32) {
    // `P`, highest coefficient first: a weighted least-squares fit (iterated towards minimax)
    // of `(a + 2) * erfcx(a)` over `a` in `[0, A_MAX]` (`q` in `[-1, 0.652]`), in `f64`
    // against `torch.special.erfcx`, rounded to `f32`: relative error below `3e-8`.
    const ERFCX: [f32; 11] = [
        6.700123e-05,
        4.217123e-05,
        -5.9266103e-04,
        -8.2795887e-04,
        3.0638243e-03,
        6.4746956e-03,
        -2.150612e-02,
        -3.6441654e-02,
        2.794718e-01,
        -6.8716073e-01,
        1.0215827e+00,
    ];
    // Past `x^2 / 2 = H_MAX` (`|x| > 13.2`) `exp` would leave `f32`'s normal range: `phi` is
    // taken as 0 there (what it rounds to is below `1e-37` in every result).
    const H_MAX: f32 = 87.3;
    // The fit's upper end, above `sqrt(H_MAX)`.
    const A_MAX: f32 = 9.5;
    // `x^2 / 2 = h + l` exactly (the FMA gives the product's rounding error): an `h` off by
    // its rounding would put `h * 2^-24` of relative error into `exp(-h)`, 87 ulp at `h = 87`.
    let sq = x * x;
    let h = 0.5 * sq;
    let l = 0.5 * x.mul_add(x, -sq);
    let gauss = exp_neg_f32(h.min(H_MAX), l);
    let gauss = if h <= H_MAX { gauss } else { 0.0 };
    let a = (x.abs() * std::f32::consts::FRAC_1_SQRT_2).min(A_MAX);
    // q = (a - 2) / (a + 2), its rounding corrected by the residual (a - 2) - q (a + 2).
    let r = 1.0 / (a + 2.0);
    let q = (a - 2.0) * r;
    let t = (q + 1.0).mul_add(-2.0, a);
    let q = r.mul_add(q.mul_add(-a, t), q);
    // P(q) = c0 + q P1(q), its last step kept unrounded in the quotient's residual, which
    // corrects both roundings of `P(q) / (a + 2)` (the sum's and the quotient's).
    let p1 = ERFCX[1..10].iter().fold(ERFCX[0], |p, &c| p.mul_add(q, c));
    let c0 = ERFCX[10];
    let erfcx = p1.mul_add(q, c0) * r;
    let res = q.mul_add(p1, (-erfcx).mul_add(a, (-erfcx).mul_add(2.0, c0)));
    let erfcx = res.mul_add(r, erfcx);
    let half_erfc = 0.5 * gauss * erfcx;
    let cdf = if x < 0.0 { half_erfc } else { 1.0 - half_erfc };
    (x * cdf, (x * gauss).mul_add(INV_SQRT_2PI as f32, cdf))
}

/// `exp(-h - l)` for `h` in `[0, 87.3]` and `|l|` below `h`'s half ulp (a normal `f32`),
/// within about an ulp: `2^n exp(r)`, `|r| <= ln 2 / 2`, `exp(r)` by Taylor to `r^7` (the
/// next term is below `5.4e-9`).
#[inline(always)]
fn exp_neg_f32(h: f32, l: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to an integer, which lands in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    // ln 2 in two parts, the first with 9 significant bits so that `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const TAYLOR: [f32; 8] =
        [1.0 / 5_040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];
    let k = (-h).mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = k - ROUND;
    // `n * LN2_HI - h` is exact; `l` and `n * LN2_LO` land below its ulp.
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, -h)) - l;
    let e = TAYLOR[1..].iter().fold(TAYLOR[0], |p, &c| p.mul_add(r, c));
    // 2^n from n's low bits (n + 127 lies in [1, 127]).
    e * f32::from_bits(k.to_bits().wrapping_add(127) << 23)
}

/// An elementwise activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// Exact GELU, `x * Phi(x)` (ACTIV-1).
    Gelu,
    /// GELU's tanh approximation, torch's `approximate='tanh'` (ACTIV-2).
    GeluTanh,
    /// SiLU (swish), `x * sigmoid(x)` (ACTIV-3).
    Silu,
}

impl Activation {
    /// The activation of one value.
    pub fn value<T: Erf>(self, x: T) -> T {
        match self {
            Activation::Gelu => gelu(x),
            Activation::GeluTanh => gelu_tanh(x),
            Activation::Silu => silu(x),
        }
    }

    /// The derivative at one value.
    pub fn derivative<T: Erf>(self, x: T) -> T {
        match self {
            Activation::Gelu => gelu_derivative(x),
            Activation::GeluTanh => gelu_tanh_derivative(x),
            Activation::Silu => silu_derivative(x),
        }
    }

    /// The activation and its derivative at one value, the same values as [`Self::value`]
    /// and [`Self::derivative`]; the exact GELU computes its `erf` once for both.
    pub fn value_and_derivative<T: Erf>(self, x: T) -> (T, T) {
        match self {
            Activation::Gelu => {
                let e = (x * lit(std::f64::consts::FRAC_1_SQRT_2)).erf();
                let y = lit::<T>(0.5) * x * (T::one() + e);
                let cdf = lit::<T>(0.5) * (T::one() + e);
                (y, cdf + x * (lit::<T>(-0.5) * x * x).exp() * lit(INV_SQRT_2PI))
            }
            _ => (self.value(x), self.derivative(x)),
        }
    }

    /// Writes the activation of every element of `x_then_d` into `y` and its derivative over
    /// `x_then_d` (ACTIV-5): what a backward needs, with the transcendental functions
    /// computed once.
    pub fn forward_saving_derivative<T: Erf>(
        self,
        x_then_d: &mut [T],
        y: &mut [T],
    ) -> Result<(), ModelError> {
        same_len(&[("activation output", y.len())], x_then_d.len())?;
        if self == Activation::Gelu {
            T::gelu_saving_derivative(x_then_d, y);
        } else {
            for (v, o) in x_then_d.iter_mut().zip(y) {
                (*o, *v) = self.value_and_derivative(*v);
            }
        }
        Ok(())
    }

    /// [`Self::forward_saving_derivative`] into a new output buffer, the same values. The
    /// buffer grows a block at a time, each block first a copy of its inputs (in cache),
    /// so that it is written once, with no zero fill first.
    pub fn forward_saving_derivative_new<T: Erf>(
        self,
        x_then_d: &mut [T],
    ) -> Result<Vec<T>, ModelError> {
        const BLOCK: usize = 1024;
        let mut y = Vec::with_capacity(x_then_d.len());
        for block in x_then_d.chunks_mut(BLOCK) {
            let at = y.len();
            y.extend_from_slice(block);
            self.forward_saving_derivative(block, &mut y[at..])?;
        }
        Ok(y)
    }

    /// Writes the activation of every element of `x` into `y` (same length).
    pub fn forward<T: Erf>(self, x: &[T], y: &mut [T]) -> Result<(), ModelError> {
        same_len(&[("activation output", y.len())], x.len())?;
        for (o, &v) in y.iter_mut().zip(x) {
            *o = self.value(v);
        }
        Ok(())
    }

    /// Writes `dx = dy * f'(x)` from the saved input `x` (NN-3).
    pub fn backward<T: Erf>(self, x: &[T], dy: &[T], dx: &mut [T]) -> Result<(), ModelError> {
        same_len(&[("activation dy", dy.len()), ("activation dx", dx.len())], x.len())?;
        for ((g, &v), &d) in dx.iter_mut().zip(x).zip(dy) {
            *g = d * self.derivative(v);
        }
        Ok(())
    }
}

/// `Phi(x) = (1 + erf(x / sqrt(2))) / 2`, the standard normal CDF.
fn normal_cdf<T: Erf>(x: T) -> T {
    lit::<T>(0.5) * (T::one() + (x * lit(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

/// Exact GELU: `x * Phi(x)`, computed as torch does, `x / 2 * (1 + erf(x / sqrt(2)))`
/// (halving first, so that `x` near `MAX` does not overflow).
pub fn gelu<T: Erf>(x: T) -> T {
    lit::<T>(0.5) * x * (T::one() + (x * lit(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

/// `d/dx gelu = Phi(x) + x * phi(x)`, `phi(x) = exp(-x^2 / 2) / sqrt(2 pi)`.
pub fn gelu_derivative<T: Erf>(x: T) -> T {
    normal_cdf(x) + x * (lit::<T>(-0.5) * x * x).exp() * lit(INV_SQRT_2PI)
}

/// `1 / sqrt(2 pi)`.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `sqrt(2 / pi)` and the cubic coefficient of GELU's tanh form (torch's constants).
const TANH_BETA: f64 = 0.797_884_560_802_865_4;
const TANH_KAPPA: f64 = 0.044_715;

/// GELU's tanh form: `x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))`.
pub fn gelu_tanh<T: Float>(x: T) -> T {
    let inner = lit::<T>(TANH_BETA) * (x + lit::<T>(TANH_KAPPA) * x * x * x);
    lit::<T>(0.5) * x * (T::one() + inner.tanh())
}

/// Derivative of [`gelu_tanh`]:
/// `(1 + t) / 2 + x / 2 * (1 - t^2) * sqrt(2 / pi) * (1 + 3 * 0.044715 x^2)`, `t = tanh(..)`.
pub fn gelu_tanh_derivative<T: Float>(x: T) -> T {
    let inner = lit::<T>(TANH_BETA) * (x + lit::<T>(TANH_KAPPA) * x * x * x);
    let t = inner.tanh();
    let sech2 = T::one() - t * t;
    let left = lit::<T>(0.5) * x;
    // Where tanh has saturated, sech^2 is 0 and the cubic's slope may be inf: 0 (ACTIV-4).
    let right = if sech2 == T::zero() {
        T::zero()
    } else {
        let slope = lit::<T>(TANH_BETA) * (T::one() + lit::<T>(3.0 * TANH_KAPPA) * x * x);
        left * sech2 * slope
    };
    lit::<T>(0.5) * (T::one() + t) + right
}

/// `sigmoid(x) = 1 / (1 + exp(-x))`; exact limits 0 and 1 where `exp` overflows or vanishes.
fn sigmoid<T: Float>(x: T) -> T {
    (T::one() + (-x).exp()).recip()
}

/// SiLU: `x * sigmoid(x)`.
pub fn silu<T: Float>(x: T) -> T {
    x * sigmoid(x)
}

/// `d/dx silu = sigmoid(x) * (1 + x * (1 - sigmoid(x)))`.
pub fn silu_derivative<T: Float>(x: T) -> T {
    let s = sigmoid(x);
    s * (T::one() + x * (T::one() - s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::{
        assert_close, assert_f32_close, assert_grads, randn, to_f32, to_f64,
    };

    const ALL: [Activation; 3] = [Activation::Gelu, Activation::GeluTanh, Activation::Silu];

    // A = torch.tensor([-6.0, -3.5, -1.0, -0.25, 0.0, 0.3, 1.0, 2.5, 5.0],
    //                  dtype=torch.float64, requires_grad=True)
    // For each activation f below: y = f(A); (dx,) = torch.autograd.grad(y, (A,), torch.ones_like(A))
    // (PyTorch 2.15), so dx is the derivative at A.
    const A: [f64; 9] = [-6.0, -3.5, -1.0, -0.25, 0.0, 0.3, 1.0, 2.5, 5.0];
    // f = torch.nn.functional.gelu
    const GELU_Y: [f64; 9] = [
        -5.919525869479969e-09,
        -0.0008142017766243903,
        -0.15865525393145702,
        -0.10032341857926907,
        0.0,
        0.1853734266566858,
        0.841344746068543,
        2.4844758366855597,
        4.999998566742141,
    ];
    const GELU_DX: [f64; 9] = [
        -3.546870945402639e-08,
        -0.0028217603536246205,
        -0.08331547058768635,
        0.304626645116364,
        0.5,
        0.7323277668271099,
        1.0833154705876864,
        1.037611085908145,
        1.000007146946002,
    ];
    // f = lambda a: torch.nn.functional.gelu(a, approximate='tanh')
    const GELU_TANH_Y: [f64; 9] = [
        -8.43964897967453e-11,
        -0.0006161976553737403,
        -0.15880800939172324,
        -0.100324649298315,
        0.0,
        0.18537092354275922,
        0.8411919906082768,
        2.484915733910001,
        4.999999770820381,
    ];
    const GELU_TANH_DX: [f64; 9] = [
        -7.709976012836329e-10,
        -0.0024226437601167334,
        -0.08296408384578252,
        0.30464590484893955,
        0.5,
        0.7322954516388018,
        1.0829640838457826,
        1.037951576212666,
        1.000001546361988,
    ];
    // f = torch.nn.functional.silu
    const SILU_Y: [f64; 9] = [
        -0.014835738939808647,
        -0.10259280762974712,
        -0.2689414213699951,
        -0.10945587477855048,
        0.0,
        0.1723327550434977,
        0.7310585786300049,
        2.3103545499468914,
        4.966535745378576,
    ];
    const SILU_DX: [f64; 9] = [
        -0.012326432591525513,
        -0.07027335282771814,
        0.07232948812851325,
        0.37628997842980233,
        0.5,
        0.6477800103188829,
        0.9276705118714869,
        1.0994011113415267,
        1.0265474324296655,
    ];

    /// Agreement with torch's float64 results: a few ulps.
    const TORCH_TOL: f64 = 1e-15;

    fn run<T: Erf>(act: Activation, x: &[T], dy: &[T]) -> (Vec<T>, Vec<T>) {
        let (mut y, mut dx) = (vec![T::zero(); x.len()], vec![T::zero(); x.len()]);
        act.forward(x, &mut y).expect("forward");
        act.backward(x, dy, &mut dx).expect("backward");
        (y, dx)
    }

    /// ACTIV-1, ACTIV-2, ACTIV-3: values and derivatives equal torch's.
    #[test]
    fn activations_match_torch() {
        let cases = [
            (Activation::Gelu, &GELU_Y, &GELU_DX),
            (Activation::GeluTanh, &GELU_TANH_Y, &GELU_TANH_DX),
            (Activation::Silu, &SILU_Y, &SILU_DX),
        ];
        for (act, want_y, want_dx) in cases {
            let (y, dx) = run(act, &A, &[1.0; 9]);
            assert_close(&format!("{act:?} y"), &y, want_y, TORCH_TOL);
            assert_close(&format!("{act:?} dx"), &dx, want_dx, TORCH_TOL);
            // The f32 instance, against the same float64 values (NN-2).
            let (y32, dx32) = run(act, &to_f32(&A), &[1.0f32; 9]);
            assert_f32_close(&format!("{act:?} y f32"), &y32, want_y);
            assert_f32_close(&format!("{act:?} dx f32"), &dx32, want_dx);
        }
    }

    #[test]
    fn activation_gradients_match_finite_differences_nn_1() {
        for (k, act) in ALL.into_iter().enumerate() {
            // Spread over [-6, 6]: the tails, where the derivatives are smallest, included.
            let x: Vec<f64> = randn(3 * 7, 30 + k as u64).iter().map(|v| 2.5 * v).collect();
            let r = randn(x.len(), 40 + k as u64);
            let (_, dx) = run(act, &x, &r);
            let f = |a: &[Vec<f64>]| {
                let mut y = vec![0.0; a[0].len()];
                act.forward(&a[0], &mut y).unwrap();
                y
            };
            assert_grads(&["x"], &[x], &r, &f, &[dx]);
        }
    }

    #[test]
    fn f32_and_f64_agree_to_f32_rounding_nn_2() {
        let x = to_f32(&randn(200, 50).iter().map(|v| 3.0 * v).collect::<Vec<_>>());
        let dy = to_f32(&randn(200, 51));
        for act in ALL {
            let (y32, dx32) = run(act, &x, &dy);
            let (y64, dx64) = run(act, &to_f64(&x), &to_f64(&dy));
            assert_f32_close(&format!("{act:?} y"), &y32, &y64);
            assert_f32_close(&format!("{act:?} dx"), &dx32, &dx64);
        }
    }

    use std::f64::consts::FRAC_1_SQRT_2;

    /// ACTIV-5: the slice path against the scalar one, `f64` exactly and `f32` (the exact
    /// GELU's vectorised path) within 4 ulp, over the tails, the extremes and zero.
    #[test]
    fn forward_saving_derivative_matches_value_and_derivative_activ_5() {
        let mut x: Vec<f64> = (-40_000..=40_000).map(|i| i as f64 * 3e-4).collect();
        x.extend([40.0, -40.0, 1e-30, -1e-30, 1e30, -1e30, f32::MAX as f64, f32::MIN as f64]);
        for act in ALL {
            let (mut d, mut y) = (x.clone(), vec![0.0; x.len()]);
            act.forward_saving_derivative(&mut d, &mut y).unwrap();
            for (i, &v) in x.iter().enumerate() {
                assert_eq!((y[i], d[i]), (act.value(v), act.derivative(v)), "{act:?} f64 at {v}");
            }
            // f32 against the f64 values: within 4 ulp of the value, and of the derivative's
            // terms `Phi(x) + |x| phi(x)` (they cancel near GELU's minimum).
            let x32 = to_f32(&x);
            let (mut d, mut y) = (x32.clone(), vec![0.0f32; x.len()]);
            act.forward_saving_derivative(&mut d, &mut y).unwrap();
            if act != Activation::Gelu {
                for (i, &v) in x32.iter().enumerate() {
                    assert_eq!((y[i], d[i]), (act.value(v), act.derivative(v)), "{act:?} at {v}");
                }
                continue;
            }
            for (i, &v) in x32.iter().enumerate() {
                // Phi through erfc: `1 + erf` cancels to 0 in the tail even in f64.
                let v = f64::from(v);
                let (cdf, pdf) = (0.5 * libm::erfc(-v * FRAC_1_SQRT_2), (-0.5 * v * v).exp());
                let (want_y, want_d) = (v * cdf, cdf + v * pdf * INV_SQRT_2PI);
                let terms = cdf + v.abs() * pdf * INV_SQRT_2PI;
                let eps = f64::from(f32::EPSILON);
                for (what, got, want, scale) in
                    [("y", y[i], want_y, want_y.abs()), ("d", d[i], want_d, terms)]
                {
                    let err = (f64::from(got) - want).abs();
                    assert!(err <= 4.0 * eps * scale + 1e-37, "{what} at {v}: {got} vs {want}");
                }
            }
        }
    }

    /// ACTIV-5: the vectorised routes and the plain loop give the same bits (every
    /// `mul_add` is one rounding), on normal draws, the tails and the extremes.
    #[test]
    fn gelu_f32_routes_agree_bitwise_activ_5() {
        let mut x: Vec<f32> = to_f32(&randn(1000, 60)).iter().map(|v| 4.0 * v).collect();
        x.extend([0.0, -0.0, 1e-30, -13.0, -13.3, 13.3, 40.0, -40.0, 1e30, f32::MAX, f32::MIN]);
        let (mut d, mut y) = (x.clone(), vec![0.0f32; x.len()]);
        f32::gelu_saving_derivative(&mut d, &mut y);
        for (i, &v) in x.iter().enumerate() {
            let (want_y, want_d) = gelu_f32_one(v);
            assert_eq!((y[i].to_bits(), d[i].to_bits()), (want_y.to_bits(), want_d.to_bits()));
        }
    }

    /// ACTIV-5: the new-buffer form writes what the slice form writes, over lengths off the
    /// blocks too.
    #[test]
    fn forward_saving_derivative_new_matches_the_slice_form_activ_5() {
        for act in ALL {
            for len in [0, 1, 1023, 1024, 2500] {
                let x = to_f32(&randn(len, 70 + len as u64));
                let (mut d, mut y) = (x.clone(), vec![0.0f32; len]);
                act.forward_saving_derivative(&mut d, &mut y).unwrap();
                let mut d_new = x.clone();
                let y_new = act.forward_saving_derivative_new(&mut d_new).unwrap();
                assert_eq!((y_new, d_new), (y.clone(), d.clone()), "{act:?} over {len}");
            }
        }
    }

    #[test]
    fn backward_writes_and_checks_lengths_nn_3_4() {
        let x = [0.5, -1.0, 2.0];
        let mut dx = [f64::NAN; 3];
        Activation::Silu.backward(&x, &[1.0; 3], &mut dx).unwrap();
        assert!(dx.iter().zip(&x).all(|(g, &v)| *g == silu_derivative(v)), "written over NaN");
        let mut out = [7.0; 3];
        let e1 = Activation::Gelu.forward(&x, &mut out[..2]);
        let e2 = Activation::Gelu.backward(&x, &[1.0; 2], &mut out);
        let e3 = Activation::Gelu.backward(&x, &[1.0; 3], &mut out[..1]);
        for e in [e1, e2, e3] {
            assert!(matches!(e, Err(ModelError::Shape { .. })), "{e:?}");
        }
        assert_eq!(out, [7.0; 3], "nothing written");
    }

    fn finite_everywhere<T: Erf + std::fmt::Debug>(extremes: &[T]) {
        for act in ALL {
            for &x in extremes {
                for v in [x, -x] {
                    let (y, d) = (act.value(v), act.derivative(v));
                    assert!(y.is_finite() && d.is_finite(), "{act:?} at {v:?}: {y:?}, {d:?}");
                }
            }
        }
    }

    #[test]
    fn finite_for_every_finite_input_activ_4() {
        finite_everywhere(&[0.0f32, 1e-30, 9.0, 20.0, 89.0, 1e10, 1e13, 1e20, 1e30, f32::MAX]);
        finite_everywhere(&[0.0f64, 1e-300, 9.0, 40.0, 710.0, 1e100, 1e103, 1e200, f64::MAX]);
        // The limits: x at +inf, 0 at -inf, derivatives 1 and 0.
        for act in ALL {
            assert_eq!(act.value(f32::MAX), f32::MAX, "{act:?}");
            assert_eq!(act.value(-f32::MAX), 0.0, "{act:?}");
            assert_eq!(act.derivative(f32::MAX), 1.0, "{act:?}");
            assert_eq!(act.derivative(-f32::MAX), 0.0, "{act:?}");
        }
    }
}
