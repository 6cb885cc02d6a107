//! Learning-rate schedules: constant, and linear warmup followed by cosine decay.
//!
//! Steps are 0-based here (`lr_at(0)` is the rate of the first optimizer step), and the
//! schedule is a pure function of the step so that a resumed run gets the same rates.
//!
//! # Invariants
//!
//! - **LR-1**: during warmup the rate rises linearly, `base * (s + 1) / warmup`, reaching
//!   `base` at the last warmup step.
//! - **LR-2**: after warmup it decays along a half cosine from `base` to `min_lr` at
//!   `total_steps`, and stays at `min_lr` after that; it never leaves `[min_lr, base]`.
//!
//! ```
//! use shardline_runtime::schedule::LrSchedule;
//! let s = LrSchedule::warmup_cosine(0.1, 10, 110, 0.0);
//! assert!((s.lr_at(4) - 0.05).abs() < 1e-7);
//! assert!((s.lr_at(60) - 0.05).abs() < 1e-7);
//! assert_eq!(s.lr_at(110), 0.0);
//! ```

use serde::{Deserialize, Serialize};

/// A learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LrSchedule {
    /// The same rate at every step.
    Constant {
        /// The rate.
        lr: f32,
    },
    /// Linear warmup, then cosine decay.
    WarmupCosine {
        /// Peak rate, reached at the end of warmup.
        base_lr: f32,
        /// Warmup steps (0: start at `base_lr`).
        warmup_steps: u64,
        /// Step at which the decay reaches `min_lr`.
        total_steps: u64,
        /// Final rate.
        min_lr: f32,
    },
}

impl LrSchedule {
    /// A constant rate.
    pub fn constant(lr: f32) -> Self {
        LrSchedule::Constant { lr }
    }

    /// Linear warmup over `warmup_steps`, then cosine decay to `min_lr` at `total_steps`.
    pub fn warmup_cosine(base_lr: f32, warmup_steps: u64, total_steps: u64, min_lr: f32) -> Self {
        LrSchedule::WarmupCosine { base_lr, warmup_steps, total_steps, min_lr }
    }

    /// The rate of 0-based step `step`.
    pub fn lr_at(&self, step: u64) -> f32 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine { base_lr, warmup_steps, total_steps, min_lr } => {
                if step < warmup_steps {
                    return (base_lr as f64 * (step + 1) as f64 / warmup_steps as f64) as f32;
                }
                let decay_steps = total_steps.saturating_sub(warmup_steps);
                if decay_steps == 0 {
                    return base_lr;
                }
                let progress = ((step - warmup_steps) as f64 / decay_steps as f64).min(1.0);
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                (min_lr as f64 + (base_lr as f64 - min_lr as f64) * cos) as f32
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LR-1.
    #[test]
    fn warmup_is_linear() {
        let s = LrSchedule::warmup_cosine(1.0, 4, 20, 0.1);
        let got: Vec<f32> = (0..4).map(|t| s.lr_at(t)).collect();
        assert_eq!(got, vec![0.25, 0.5, 0.75, 1.0]);
        assert_eq!(s.lr_at(4), 1.0);
    }

    /// LR-2: hand-computed points of the half cosine, monotone decay, bounds.
    #[test]
    fn cosine_decay_points_and_bounds() {
        let s = LrSchedule::warmup_cosine(1.0, 0, 4, 0.0);
        let want = [1.0, 0.853_553_4, 0.5, 0.146_446_6, 0.0, 0.0];
        for (t, w) in want.iter().enumerate() {
            assert!((s.lr_at(t as u64) - w).abs() < 1e-6, "step {t}");
        }
        let s = LrSchedule::warmup_cosine(0.3, 5, 50, 0.01);
        let mut prev = f32::INFINITY;
        for t in 4..80 {
            let lr = s.lr_at(t);
            assert!(lr <= prev + 1e-9, "not decaying at {t}");
            assert!((0.01..=0.3).contains(&lr), "out of bounds at {t}: {lr}");
            prev = lr;
        }
        assert!((s.lr_at(50) - 0.01).abs() < 1e-7);
    }

    #[test]
    fn degenerate_and_constant() {
        assert_eq!(LrSchedule::constant(0.2).lr_at(1000), 0.2);
        // total <= warmup: no decay phase.
        assert_eq!(LrSchedule::warmup_cosine(0.5, 3, 3, 0.0).lr_at(10), 0.5);
    }
}
