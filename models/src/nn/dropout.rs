//! Dropout whose mask is a pure function of where an element is, not of who computes it.
//!
//! An element is kept or dropped by a counter-based hash of (seed, step, layer, the sample's
//! index in the global batch, the element's index in the sample), so the mask does not
//! depend on how the global batch is split over ranks, on the world size, or on whether the
//! run was resumed: world-1 equivalence and resume stay exact with dropout on. Nothing is
//! saved for backward but the key, and backward recomputes the mask.
//!
//! Invariants:
//! - `DROP-1`: the mask of an element depends only on its [`DropoutKey`], the global index
//!   of its sample and its index in the sample: computing a batch whole or in slices (at
//!   their global offsets) gives the same output, bitwise.
//! - `DROP-2`: kept elements are scaled by `1 / (1 - p)` (PyTorch's inverted dropout), so
//!   the expectation of the output is the input; `p = 0` is the identity, `p = 1` gives
//!   zeros; the fraction kept is `1 - p` up to sampling error.
//! - `DROP-3`: backward is the same mask and scale applied to the output gradient.

use num_traits::Float;

use super::{lit, rows, same_len};
use crate::error::ModelError;

/// What makes one dropout layer's mask in one step: the run's seed, the optimizer step
/// (1-based, as the step being computed), and the layer's index in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutKey {
    /// The run's seed.
    pub seed: u64,
    /// The step being computed.
    pub step: u64,
    /// The layer's index (every dropout layer of a model has its own).
    pub layer: u64,
}

/// SplitMix64's output function: a bijective mix of 64 bits, enough to turn distinct
/// counters into independent-looking uniform bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// One more field `v` through the mix: the hash of a key is its fields absorbed in turn.
pub(crate) fn absorb(h: u64, v: u64) -> u64 {
    mix(h ^ v.wrapping_add(GOLDEN))
}

/// The smallest 53-bit draw that is kept at drop probability `p` (`p` in `[0, 1]`): a
/// draw `n` stands for the uniform `u = n / 2^53`, exactly, and `u >= p` exactly when
/// `n >= ceil(p 2^53)`, since scaling by a power of two is exact.
pub(crate) fn keep_threshold(p: f64) -> u64 {
    (p * (1u64 << 53) as f64).ceil() as u64
}

/// Whether 64 hashed bits are a kept element at `threshold` ([`keep_threshold`]): their
/// top 53 bits are the uniform draw.
pub(crate) fn kept(bits: u64, threshold: u64) -> bool {
    bits >> 11 >= threshold
}

impl DropoutKey {
    /// The hash of (seed, step, layer): the start of every element's hash under this key.
    pub(crate) fn state(&self) -> u64 {
        absorb(absorb(mix(self.seed.wrapping_add(GOLDEN)), self.step), self.layer)
    }

    /// 64 uniform bits for element `element` of global sample `sample` (DROP-1): each field
    /// goes through the mix in turn, so that nearby keys give unrelated streams.
    fn bits(&self, sample: u64, element: u64) -> u64 {
        absorb(absorb(self.state(), sample), element)
    }

    /// Whether the element is kept at drop probability `p`: its 53-bit uniform draw is at
    /// least `p`.
    fn keep(&self, p: f64, sample: u64, element: u64) -> bool {
        kept(self.bits(sample, element), keep_threshold(p))
    }
}

/// Inverted dropout with drop probability `p` over rows of `per_sample` values, the first
/// row being global sample `first_sample`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// Drop probability, in `[0, 1]`.
    pub p: f64,
    /// Values per sample (a sample's rows of every position flattened).
    pub per_sample: usize,
}

impl Dropout {
    /// Dropout with probability `p`; an error outside `[0, 1]`.
    pub fn new(p: f64, per_sample: usize) -> Result<Self, ModelError> {
        if !(0.0..=1.0).contains(&p) {
            return Err(ModelError::shape("Dropout", "p in [0, 1]", p));
        }
        Ok(Dropout { p, per_sample })
    }

    /// `y = x * mask / (1 - p)` (DROP-2); `x` holds whole samples, the first being global
    /// sample `first_sample`.
    pub fn forward<T: Float>(
        &self,
        key: DropoutKey,
        first_sample: u64,
        x: &[T],
        y: &mut [T],
    ) -> Result<(), ModelError> {
        self.apply(key, first_sample, x, y, "Dropout::forward")
    }

    /// `dx = dy * mask / (1 - p)` with the forward's mask, recomputed from the key (DROP-3).
    pub fn backward<T: Float>(
        &self,
        key: DropoutKey,
        first_sample: u64,
        dy: &[T],
        dx: &mut [T],
    ) -> Result<(), ModelError> {
        self.apply(key, first_sample, dy, dx, "Dropout::backward")
    }

    fn apply<T: Float>(
        &self,
        key: DropoutKey,
        first_sample: u64,
        x: &[T],
        y: &mut [T],
        what: &str,
    ) -> Result<(), ModelError> {
        let samples = rows(what, x.len(), self.per_sample)?;
        same_len(&[(what, y.len())], x.len())?;
        if self.p == 0.0 {
            y.copy_from_slice(x);
            return Ok(());
        }
        if self.p >= 1.0 {
            y.iter_mut().for_each(|v| *v = T::zero());
            return Ok(());
        }
        let scale: T = lit(1.0 / (1.0 - self.p));
        for s in 0..samples {
            let at = s * self.per_sample;
            let sample = first_sample + s as u64;
            for (j, (yi, &xi)) in
                y[at..at + self.per_sample].iter_mut().zip(&x[at..at + self.per_sample]).enumerate()
            {
                *yi = if key.keep(self.p, sample, j as u64) { xi * scale } else { T::zero() };
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: DropoutKey = DropoutKey { seed: 7, step: 3, layer: 2 };

    fn input(n: usize) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.37).sin() + 1.5).collect()
    }

    #[test]
    fn a_batch_in_slices_gives_the_whole_batchs_output_drop_1() {
        let d = Dropout::new(0.3, 10).unwrap();
        let x = input(8 * 10);
        let mut whole = vec![0.0f32; x.len()];
        d.forward(KEY, 100, &x, &mut whole).unwrap();
        // Ranks holding samples 100..103 and 103..108 of the global batch.
        let (mut a, mut b) = (vec![0.0f32; 30], vec![0.0f32; 50]);
        d.forward(KEY, 100, &x[..30], &mut a).unwrap();
        d.forward(KEY, 103, &x[30..], &mut b).unwrap();
        a.extend(b);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&whole));
        // Another step, layer or seed draws another mask.
        for other in [
            DropoutKey { step: 4, ..KEY },
            DropoutKey { layer: 3, ..KEY },
            DropoutKey { seed: 8, ..KEY },
        ] {
            let mut y = vec![0.0f32; x.len()];
            d.forward(other, 100, &x, &mut y).unwrap();
            assert_ne!(bits(&y), bits(&whole), "{other:?}");
        }
    }

    #[test]
    fn kept_values_are_scaled_and_the_kept_fraction_is_one_minus_p_drop_2() {
        for p in [0.1, 0.5, 0.9] {
            let n = 200_000;
            let d = Dropout::new(p, 1000).unwrap();
            let x = vec![1.0f64; n];
            let mut y = vec![0.0f64; n];
            d.forward(KEY, 0, &x, &mut y).unwrap();
            let kept = y.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
            // Binomial standard deviation at n = 2e5 is at most 1.2e-3: 5 sigma.
            assert!((kept - (1.0 - p)).abs() < 6e-3, "p {p}: kept {kept}");
            assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / (1.0 - p)).abs() < 1e-12));
        }
        let x = input(20);
        let mut y = vec![9.0f32; 20];
        Dropout::new(0.0, 4).unwrap().forward(KEY, 0, &x, &mut y).unwrap();
        assert_eq!(y, x);
        Dropout::new(1.0, 4).unwrap().forward(KEY, 0, &x, &mut y).unwrap();
        assert!(y.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn backward_applies_the_forwards_mask_drop_3() {
        let d = Dropout::new(0.25, 6).unwrap();
        let x = input(36);
        let mut y = vec![0.0f32; 36];
        d.forward(KEY, 5, &x, &mut y).unwrap();
        let dy: Vec<f32> = (0..36).map(|i| i as f32 - 17.0).collect();
        let mut dx = vec![0.0f32; 36];
        d.backward(KEY, 5, &dy, &mut dx).unwrap();
        let scale = 1.0 / 0.75f32;
        for i in 0..36 {
            // The forward is linear: dx = mask * scale * dy wherever y = mask * scale * x.
            let kept = y[i] != 0.0;
            assert_eq!(dx[i], if kept { dy[i] * scale } else { 0.0 }, "element {i}");
        }
    }

    /// The integer threshold keeps exactly the draws `u = n / 2^53 >= p` (DROP-2), at the
    /// edges of every probability the kernels use.
    #[test]
    fn the_integer_threshold_is_the_float_comparison_drop_2() {
        let unit = 1.0 / (1u64 << 53) as f64;
        for p in [0.0, 1e-9, 0.1, 0.2, 0.25, 1.0 / 3.0, 0.5, 0.9, 1.0 - 1e-16, 1.0] {
            let t = keep_threshold(p);
            for n in [t.saturating_sub(2), t.saturating_sub(1), t, t + 1, (1u64 << 53) - 1] {
                let n = n.min((1u64 << 53) - 1);
                assert_eq!(kept(n << 11, t), n as f64 * unit >= p, "p {p} n {n}");
            }
        }
    }

    #[test]
    fn bad_probabilities_and_lengths_are_errors() {
        assert!(Dropout::new(-0.1, 4).is_err());
        assert!(Dropout::new(1.5, 4).is_err());
        let d = Dropout::new(0.5, 4).unwrap();
        let mut y = [0.0f32; 8];
        assert!(d.forward(KEY, 0, &[1.0f32; 6], &mut y[..6]).is_err(), "6 is not whole samples");
        assert!(d.forward(KEY, 0, &[1.0f32; 8], &mut y[..4]).is_err(), "output too short");
    }
}
