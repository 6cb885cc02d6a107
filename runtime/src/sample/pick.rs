//! The next token from a row of logits: temperature, top-k, then a draw from the softmax.
//!
//! # Invariants
//!
//! - **SAMPLE-1**: with `top_k = 1` the pick is the argmax (the first, on ties), whatever the
//!   temperature and the generator.
//! - **SAMPLE-2**: the pick is a function of the logits, the settings and the generator's
//!   state: the same seed gives the same tokens.

use shardline_models::rng::SplitMix64;

/// How a token is drawn from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pick {
    /// Logits are divided by this (> 0): below 1 sharpens, above 1 flattens.
    pub temperature: f32,
    /// Keep only the `k` largest logits (ties broken by the lower token); `None` keeps all.
    pub top_k: Option<usize>,
}

impl Pick {
    /// The probabilities of every token after temperature and top-k (zero outside the top k).
    pub fn probs(&self, logits: &[f32]) -> Vec<f64> {
        let t = f64::from(self.temperature);
        let mut keep: Vec<usize> = (0..logits.len()).collect();
        if let Some(k) = self.top_k.filter(|&k| k < logits.len()) {
            // Stable sort: equal logits keep token order, so k = 1 is the first argmax.
            keep.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            keep.truncate(k.max(1));
        }
        let max = keep.iter().map(|&i| f64::from(logits[i]) / t).fold(f64::NEG_INFINITY, f64::max);
        let mut p = vec![0.0; logits.len()];
        let mut total = 0.0;
        for &i in &keep {
            p[i] = (f64::from(logits[i]) / t - max).exp();
            total += p[i];
        }
        p.iter_mut().for_each(|v| *v /= total);
        p
    }

    /// One token drawn from [`Pick::probs`] with one number of `rng` (SAMPLE-2).
    pub fn next(&self, logits: &[f32], rng: &mut SplitMix64) -> usize {
        let p = self.probs(logits);
        let u = rng.next_f64();
        let mut acc = 0.0;
        let mut last = 0;
        for (i, &pi) in p.iter().enumerate() {
            if pi > 0.0 {
                acc += pi;
                last = i;
                if u < acc {
                    return i;
                }
            }
        }
        // Rounding left the sum just below u: the last token with any mass.
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGITS: [f32; 5] = [0.5, 2.0, -1.0, 2.0, 1.0];

    /// SAMPLE-1: top-k 1 always gives the first argmax.
    #[test]
    fn top_k_one_is_argmax() {
        let mut rng = SplitMix64::new(7);
        for t in [0.1, 1.0, 10.0] {
            let pick = Pick { temperature: t, top_k: Some(1) };
            for _ in 0..50 {
                assert_eq!(pick.next(&LOGITS, &mut rng), 1);
            }
        }
    }

    #[test]
    fn top_k_keeps_the_k_largest() {
        let p = Pick { temperature: 1.0, top_k: Some(3) }.probs(&LOGITS);
        assert_eq!(p[0], 0.0);
        assert_eq!(p[2], 0.0);
        assert!(p[1] > 0.0 && p[3] > 0.0 && p[4] > 0.0);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        // A k beyond the vocabulary keeps everything.
        let all = Pick { temperature: 1.0, top_k: Some(99) }.probs(&LOGITS);
        assert!(all.iter().all(|&v| v > 0.0));
    }

    /// Temperature divides the logits: log-probability gaps scale by 1/T.
    #[test]
    fn temperature_scales_logits() {
        let gap = |t: f32| {
            let p = Pick { temperature: t, top_k: None }.probs(&LOGITS);
            (p[1] / p[0]).ln()
        };
        assert!((gap(1.0) - 1.5).abs() < 1e-9);
        assert!((gap(0.5) - 3.0).abs() < 1e-9);
        assert!((gap(3.0) - 0.5).abs() < 1e-9);
        // Softmax itself at T = 1.
        let p = Pick { temperature: 1.0, top_k: None }.probs(&[0.0, 0.0]);
        assert_eq!(p, vec![0.5, 0.5]);
    }

    /// SAMPLE-2: the same seed draws the same tokens; draws follow the probabilities.
    #[test]
    fn seeded_draws_are_deterministic_and_follow_probs() {
        let pick = Pick { temperature: 1.0, top_k: None };
        let draw = |seed| {
            let mut rng = SplitMix64::new(seed);
            (0..2000).map(|_| pick.next(&LOGITS, &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        let p = pick.probs(&LOGITS);
        let d = draw(3);
        for (tok, &pt) in p.iter().enumerate() {
            let freq = d.iter().filter(|&&x| x == tok).count() as f64 / d.len() as f64;
            assert!((freq - pt).abs() < 0.04, "token {tok}: {freq} vs {pt}");
        }
    }
}
