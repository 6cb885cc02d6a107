//! Optimizers over flat slices: SGD (momentum, weight decay) and AdamW, with PyTorch's
//! semantics, plus global gradient-norm clipping.
//!
//! An optimizer step is elementwise, so it runs on any slice of a unit's flat buffer: the
//! engine calls [`Optimizer::step`] with a rank's own shard of params, grads and state. The
//! state is interleaved, `state_len_per_param()` values per element (`[m0, v0, m1, v1, ...]`
//! for AdamW), so the state of elements `a..b` is the contiguous range `a*k..b*k`, and it is
//! sharded, checkpointed and resharded exactly like the params with width `k`.
//!
//! # Invariants
//!
//! - **OPT-1**: stepping a slice equals stepping the whole buffer restricted to that slice,
//!   bitwise.
//! - **OPT-2**: zero padding stays zero: an element with param 0 and grad 0 and zero state is
//!   left at 0 with zero state.
//! - **OPT-3**: `step` is 1-based and counts optimizer steps taken including this one; SGD
//!   initializes its momentum buffer to the gradient at step 1 (PyTorch's first-step rule).
//! - **OPT-4**: [`Optimizer::step_sq_norm`] leaves parameters and state bitwise as `step`
//!   does and returns bitwise [`sq_norm`] of the gradients.
//! - **OPT-5**: weight decay by parameter group, as `torch.optim` parameter groups give it
//!   (nanoGPT decays only matrices): stepping a slice with no-decay ranges
//!   ([`Optimizer::step_groups`]) equals stepping every element of those ranges with
//!   `weight_decay = 0` and every other element with the configured decay, bitwise, at any
//!   offset of the slice in its unit; its squared norm is still bitwise [`sq_norm`].
//!
//! ```
//! use shardline_runtime::optim::{Optimizer, SgdConfig};
//! let opt = Optimizer::Sgd(SgdConfig { momentum: 0.9, ..SgdConfig::default() });
//! let mut p = vec![1.0f32, 2.0];
//! let mut state = vec![0.0; p.len() * opt.state_len_per_param()];
//! opt.step(0.1, 1, &mut p, &[1.0, -1.0], &mut state).unwrap();
//! assert_eq!(p, vec![0.9, 2.1]);
//! ```

use serde::{Deserialize, Serialize};

use crate::error::{Result, RuntimeError};
use std::ops::Range;

/// SGD hyper-parameters (PyTorch `torch.optim.SGD`, without the learning rate, which comes
/// from the schedule at each step).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Momentum factor; 0 disables the momentum buffer. Default 0.
    pub momentum: f32,
    /// Dampening for momentum. Default 0.
    pub dampening: f32,
    /// L2 penalty added to the gradient (coupled weight decay). Default 0.
    pub weight_decay: f32,
    /// Nesterov momentum. Default false.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

/// AdamW hyper-parameters (PyTorch `torch.optim.AdamW`, without the learning rate).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Coefficient of the first-moment average. Default 0.9.
    pub beta1: f32,
    /// Coefficient of the second-moment average. Default 0.999.
    pub beta2: f32,
    /// Added to the denominator. Default 1e-8.
    pub eps: f32,
    /// Decoupled weight decay. Default 0.01.
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// Which parameters weight decay applies to (`--weight-decay-on`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDecayOn {
    /// Every parameter (PyTorch's default for one parameter group).
    #[default]
    All,
    /// Parameters of two or more dimensions only: weight matrices and embeddings, not
    /// biases or norm gains (nanoGPT's two groups).
    Matrices,
}

impl WeightDecayOn {
    /// Whether this is the default, [`WeightDecayOn::All`].
    pub fn is_all(&self) -> bool {
        *self == WeightDecayOn::All
    }

    /// The element ranges of a unit's flat parameter buffer that get no weight decay, in
    /// order and merged where adjacent.
    pub fn no_decay_ranges(&self, unit: &shardline_models::UnitSpec) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        if *self == WeightDecayOn::All {
            return out;
        }
        let mut at = 0;
        for p in &unit.params {
            let r = at..at + p.numel();
            at = r.end;
            if p.shape.len() >= 2 || r.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        out
    }
}

/// Where a slice sits in its unit, and which of the unit's elements get no weight decay.
#[derive(Clone, Copy, Debug, Default)]
pub struct Groups<'a> {
    /// The slice's first element in the unit's flat buffer.
    pub offset: usize,
    /// The unit's no-decay ranges ([`WeightDecayOn::no_decay_ranges`]), unit coordinates.
    pub no_decay: &'a [Range<usize>],
}

/// Splits a slice `offset..offset + len` of a unit into runs that are decayed or not, given
/// the unit's no-decay ranges: `(start, end, decayed)` relative to the slice, in order.
pub(crate) fn decay_runs(
    offset: usize,
    len: usize,
    no_decay: &[Range<usize>],
) -> Vec<(usize, usize, bool)> {
    let mut runs = Vec::new();
    let mut at = 0;
    for r in no_decay {
        let (a, b) = (r.start.max(offset), r.end.min(offset + len));
        if a >= b {
            continue;
        }
        if a - offset > at {
            runs.push((at, a - offset, true));
        }
        runs.push((a - offset, b - offset, false));
        at = b - offset;
    }
    if at < len {
        runs.push((at, len, true));
    }
    runs
}

/// An optimizer over flat slices.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Optimizer {
    /// Stochastic gradient descent.
    Sgd(SgdConfig),
    /// Adam with decoupled weight decay.
    AdamW(AdamWConfig),
}

impl Optimizer {
    /// Short name (`sgd`, `adamw`).
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd(_) => "sgd",
            Optimizer::AdamW(_) => "adamw",
        }
    }

    /// State values per parameter element: SGD 1 with momentum, else 0; AdamW 2.
    pub fn state_len_per_param(&self) -> usize {
        match self {
            Optimizer::Sgd(c) if c.momentum != 0.0 => 1,
            Optimizer::Sgd(_) => 0,
            Optimizer::AdamW(_) => 2,
        }
    }

    /// One step over a slice. `step` is the 1-based number of this step (OPT-3), `lr` the
    /// learning rate for it. `state` holds `state_len_per_param()` values per element.
    pub fn step(
        &self,
        lr: f32,
        step: u64,
        params: &mut [f32],
        grads: &[f32],
        state: &mut [f32],
    ) -> Result<()> {
        let k = self.state_len_per_param();
        if grads.len() != params.len() || state.len() != params.len() * k {
            return Err(RuntimeError::config(format!(
                "optimizer slices disagree: {} params, {} grads, {} state values (want {})",
                params.len(),
                grads.len(),
                state.len(),
                params.len() * k
            )));
        }
        if step == 0 {
            return Err(RuntimeError::config("optimizer steps are numbered from 1"));
        }
        match self {
            Optimizer::Sgd(c) => sgd_step(c, lr, step, params, grads, state),
            Optimizer::AdamW(c) => adamw_step(c, lr, step, params, grads, state),
        }
        Ok(())
    }

    /// [`Optimizer::step`] that also returns [`sq_norm`] of `grads`, bitwise the same value,
    /// taken block by block while each block is in cache for the update: one pass over the
    /// gradients less per step. The update is elementwise, so stepping block by block
    /// changes nothing either (OPT-4).
    pub fn step_sq_norm(
        &self,
        lr: f32,
        step: u64,
        params: &mut [f32],
        grads: &[f32],
        state: &mut [f32],
    ) -> Result<f64> {
        // A multiple of 8, so that every block but the last feeds whole chunks to the eight
        // partial sums in the order `sq_norm` takes them; small enough to stay in L1.
        const BLOCK: usize = 2048;
        let k = self.state_len_per_param();
        if grads.len() != params.len() || state.len() != params.len() * k {
            // The plain step reports the mismatch.
            return self.step(lr, step, params, grads, state).map(|()| 0.0);
        }
        let mut acc = [0.0f64; 8];
        let mut tail = 0.0;
        let blocks = params.chunks_mut(BLOCK).zip(grads.chunks(BLOCK));
        for (i, (p, g)) in blocks.enumerate() {
            let mut chunks = g.chunks_exact(8);
            for c in &mut chunks {
                for (a, &x) in acc.iter_mut().zip(c) {
                    *a += (x as f64) * (x as f64);
                }
            }
            // Only the last block can leave a remainder.
            tail = chunks.remainder().iter().map(|&x| (x as f64) * (x as f64)).sum();
            let st = &mut state[i * BLOCK * k..(i * BLOCK + p.len()) * k];
            self.step(lr, step, p, g, st)?;
        }
        Ok(acc.iter().sum::<f64>() + tail)
    }
}

impl Optimizer {
    /// This optimizer without weight decay.
    fn without_decay(&self) -> Optimizer {
        match *self {
            Optimizer::Sgd(c) => Optimizer::Sgd(SgdConfig { weight_decay: 0.0, ..c }),
            Optimizer::AdamW(c) => Optimizer::AdamW(AdamWConfig { weight_decay: 0.0, ..c }),
        }
    }

    /// [`Optimizer::step`] (with `sq_norm_too`: [`Optimizer::step_sq_norm`]) over a slice of
    /// a unit placed by `groups` (OPT-5). Returns the squared norm of `grads` when
    /// `sq_norm_too` is set, else 0.
    pub fn step_groups(
        &self,
        lr: f32,
        step: u64,
        slice: (&mut [f32], &[f32], &mut [f32]),
        groups: Groups<'_>,
        sq_norm_too: bool,
    ) -> Result<f64> {
        let (params, grads, state) = slice;
        let runs = decay_runs(groups.offset, params.len(), groups.no_decay);
        if runs.iter().all(|r| r.2) {
            return if sq_norm_too {
                self.step_sq_norm(lr, step, params, grads, state)
            } else {
                self.step(lr, step, params, grads, state).map(|()| 0.0)
            };
        }
        let k = self.state_len_per_param();
        if grads.len() != params.len() || state.len() != params.len() * k {
            // The plain step reports the mismatch.
            return self.step(lr, step, params, grads, state).map(|()| 0.0);
        }
        let plain = self.without_decay();
        for (a, b, decayed) in runs {
            let opt = if decayed { self } else { &plain };
            opt.step(lr, step, &mut params[a..b], &grads[a..b], &mut state[a * k..b * k])?;
        }
        // One pass more over the gradients: the runs' own sums would group differently.
        Ok(if sq_norm_too { sq_norm(grads) } else { 0.0 })
    }
}

fn sgd_step(c: &SgdConfig, lr: f32, step: u64, p: &mut [f32], g: &[f32], buf: &mut [f32]) {
    // The configuration's branches are decided once, outside the loops, so that each loop
    // runs vectorised; per element the arithmetic is the same as before (and as PyTorch's),
    // so results are bitwise unchanged.
    let (wd, mom, damp, nesterov) = (c.weight_decay, c.momentum, 1.0 - c.dampening, c.nesterov);
    let decayed = |pi: f32, gi: f32| if wd != 0.0 { gi + wd * pi } else { gi };
    if mom == 0.0 {
        for (pi, &gi) in p.iter_mut().zip(g) {
            *pi -= lr * decayed(*pi, gi);
        }
        return;
    }
    let first = step == 1;
    for ((pi, &gi), bi) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
        let d = decayed(*pi, gi);
        let b = if first { d } else { mom * *bi + damp * d };
        *bi = b;
        *pi -= lr * if nesterov { d + mom * b } else { b };
    }
}

fn adamw_step(c: &AdamWConfig, lr: f32, step: u64, p: &mut [f32], g: &[f32], st: &mut [f32]) {
    // PyTorch computes these scalars in double precision on the host, then applies them
    // to f32 tensors.
    let t = step as i32;
    let bc1 = 1.0 - (c.beta1 as f64).powi(t);
    let bc2_sqrt = (1.0 - (c.beta2 as f64).powi(t)).sqrt();
    let step_size = (lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2_sqrt as f32;
    let decay = 1.0 - lr * c.weight_decay;
    let (b2, one_b1, one_b2, eps) = (c.beta2, 1.0 - c.beta1, 1.0 - c.beta2, c.eps);
    // Iterators instead of indexing: no bounds checks in the loop. Same arithmetic per element.
    for ((pi, &gi), mv) in p.iter_mut().zip(g).zip(st.chunks_exact_mut(2)) {
        *pi *= decay;
        mv[0] += (gi - mv[0]) * one_b1;
        let m = mv[0];
        mv[1] = mv[1] * b2 + one_b2 * gi * gi;
        let denom = mv[1].sqrt() / bc2_sqrt + eps;
        *pi -= step_size * (m / denom);
    }
}

pub use shardline_models::ops::{clip_coef, sq_norm};

/// Multiplies a gradient slice by `coef` (no-op when it is 1).
pub fn scale(grads: &mut [f32], coef: f32) {
    if coef != 1.0 {
        grads.iter_mut().for_each(|g| *g *= coef);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Naive PyTorch-semantics SGD in f64, one element at a time, written from the
    /// `torch.optim.SGD` documentation's algorithm box.
    fn ref_sgd(c: &SgdConfig, lrs: &[f64], p0: f64, grads: &[f64]) -> f64 {
        let (mu, tau, wd) = (c.momentum as f64, c.dampening as f64, c.weight_decay as f64);
        let mut p = p0;
        let mut b: Option<f64> = None;
        for (t, (&g, &lr)) in grads.iter().zip(lrs).enumerate() {
            let mut g = g;
            if wd != 0.0 {
                g += wd * p;
            }
            if mu != 0.0 {
                let nb = match b {
                    Some(prev) if t > 0 => mu * prev + (1.0 - tau) * g,
                    _ => g,
                };
                b = Some(nb);
                g = if c.nesterov { g + mu * nb } else { nb };
            }
            p -= lr * g;
        }
        p
    }

    /// Naive PyTorch-semantics AdamW in f64 (the `torch.optim.AdamW` algorithm box).
    fn ref_adamw(c: &AdamWConfig, lrs: &[f64], p0: f64, grads: &[f64]) -> f64 {
        let (b1, b2, eps, wd) =
            (c.beta1 as f64, c.beta2 as f64, c.eps as f64, c.weight_decay as f64);
        let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
        for (i, (&g, &lr)) in grads.iter().zip(lrs).enumerate() {
            let t = (i + 1) as i32;
            p -= lr * wd * p;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let mhat = m / (1.0 - b1.powi(t));
            let vhat = v / (1.0 - b2.powi(t));
            p -= lr * mhat / (vhat.sqrt() + eps);
        }
        p
    }

    fn run(opt: &Optimizer, lrs: &[f32], p0: &[f32], grads: &[Vec<f32>]) -> Vec<f32> {
        let mut p = p0.to_vec();
        let mut st = vec![0.0; p.len() * opt.state_len_per_param()];
        for (t, (g, &lr)) in grads.iter().zip(lrs).enumerate() {
            opt.step(lr, t as u64 + 1, &mut p, g, &mut st).unwrap();
        }
        p
    }

    fn check_against_ref(opt: Optimizer, steps: usize) {
        let n = 37;
        let p0: Vec<f32> = (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1).collect();
        let grads: Vec<Vec<f32>> = (0..steps)
            .map(|t| (0..n).map(|i| (((i * 13 + t * 5) % 17) as f32 - 8.0) * 0.05).collect())
            .collect();
        let lrs: Vec<f32> = (0..steps).map(|t| 0.05 / (1.0 + t as f32)).collect();
        let got = run(&opt, &lrs, &p0, &grads);
        let lrs64: Vec<f64> = lrs.iter().map(|&x| x as f64).collect();
        for i in 0..n {
            let g: Vec<f64> = grads.iter().map(|g| g[i] as f64).collect();
            let want = match &opt {
                Optimizer::Sgd(c) => ref_sgd(c, &lrs64, p0[i] as f64, &g),
                Optimizer::AdamW(c) => ref_adamw(c, &lrs64, p0[i] as f64, &g),
            };
            // f32 arithmetic against an f64 reference over a few steps.
            let tol = 1e-5 * (1.0 + want.abs());
            assert!(
                (got[i] as f64 - want).abs() <= tol,
                "{opt:?} element {i}: got {} want {want}",
                got[i]
            );
        }
    }

    /// OPT-4: the fused step gives bitwise the parameters, state and squared norm of a
    /// plain step followed by `sq_norm`, for both optimizers, over lengths around the block
    /// and chunk sizes.
    #[test]
    fn fused_step_and_norm_match_the_separate_passes() {
        let opts = [
            Optimizer::Sgd(SgdConfig { momentum: 0.9, weight_decay: 1e-4, ..SgdConfig::default() }),
            Optimizer::Sgd(SgdConfig { momentum: 0.0, ..SgdConfig::default() }),
            Optimizer::AdamW(AdamWConfig::default()),
        ];
        for opt in opts {
            let k = opt.state_len_per_param();
            for n in [0usize, 1, 7, 8, 9, 2047, 2048, 2049, 4096 + 13, 10_000] {
                let g: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
                let p0: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
                let s0: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.01).collect();
                let (mut pa, mut sa) = (p0.clone(), s0.clone());
                let (mut pb, mut sb) = (p0.clone(), s0.clone());
                for step in 1..=3 {
                    opt.step(0.05, step, &mut pa, &g, &mut sa).unwrap();
                    let na = sq_norm(&g);
                    let nb = opt.step_sq_norm(0.05, step, &mut pb, &g, &mut sb).unwrap();
                    assert_eq!(na.to_bits(), nb.to_bits(), "{} n={n}", opt.name());
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&pa), bits(&pb), "{} n={n}: params", opt.name());
                assert_eq!(bits(&sa), bits(&sb), "{} n={n}: state", opt.name());
            }
        }
        let opt = Optimizer::Sgd(SgdConfig::default());
        let err = opt.step_sq_norm(0.1, 1, &mut [0.0; 3], &[0.0; 2], &mut []).unwrap_err();
        assert!(err.to_string().contains("disagree"), "{err}");
    }

    #[test]
    fn sgd_plain_matches_reference() {
        check_against_ref(Optimizer::Sgd(SgdConfig::default()), 5);
    }

    /// OPT-3: first-step buffer initialization, with dampening and weight decay.
    #[test]
    fn sgd_momentum_matches_reference() {
        for (momentum, dampening, weight_decay, nesterov) in [
            (0.9, 0.0, 0.0, false),
            (0.9, 0.5, 0.0, false),
            (0.8, 0.0, 1e-2, false),
            (0.9, 0.0, 1e-3, true),
        ] {
            let c = SgdConfig { momentum, dampening, weight_decay, nesterov };
            check_against_ref(Optimizer::Sgd(c), 8);
        }
    }

    /// OPT-3: a hand-computed two-step momentum example with dampening (the first step
    /// copies the gradient, undamped).
    #[test]
    fn sgd_first_step_is_undamped() {
        let opt =
            Optimizer::Sgd(SgdConfig { momentum: 0.5, dampening: 0.5, ..SgdConfig::default() });
        let mut p = vec![1.0f32];
        let mut b = vec![0.0f32];
        opt.step(1.0, 1, &mut p, &[2.0], &mut b).unwrap();
        assert_eq!((p[0], b[0]), (-1.0, 2.0));
        opt.step(1.0, 2, &mut p, &[2.0], &mut b).unwrap();
        // b = 0.5 * 2 + 0.5 * 2 = 2
        assert_eq!((p[0], b[0]), (-3.0, 2.0));
    }

    #[test]
    fn adamw_matches_reference() {
        check_against_ref(Optimizer::AdamW(AdamWConfig::default()), 10);
        check_against_ref(
            Optimizer::AdamW(AdamWConfig { beta1: 0.8, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 }),
            6,
        );
    }

    /// AdamW's first step moves every element with a nonzero gradient by about lr (bias
    /// correction makes m/sqrt(v) = sign(g)), after the decoupled decay.
    #[test]
    fn adamw_first_step_by_hand() {
        let opt =
            Optimizer::AdamW(AdamWConfig { weight_decay: 0.5, eps: 0.0, ..AdamWConfig::default() });
        let mut p = vec![2.0f32, -2.0];
        let mut st = vec![0.0; 4];
        opt.step(0.1, 1, &mut p, &[3.0, -0.25], &mut st).unwrap();
        // p * (1 - 0.1 * 0.5) - 0.1 * sign(g)
        assert!((p[0] - (1.9 - 0.1)).abs() < 1e-6, "{}", p[0]);
        assert!((p[1] - (-1.9 + 0.1)).abs() < 1e-6, "{}", p[1]);
    }

    #[test]
    fn state_len_and_slice_checks() {
        assert_eq!(Optimizer::Sgd(SgdConfig::default()).state_len_per_param(), 0);
        let m = Optimizer::Sgd(SgdConfig { momentum: 0.9, ..SgdConfig::default() });
        assert_eq!(m.state_len_per_param(), 1);
        let a = Optimizer::AdamW(AdamWConfig::default());
        assert_eq!(a.state_len_per_param(), 2);
        let mut p = vec![0.0; 3];
        assert!(a.step(0.1, 1, &mut p, &[0.0; 3], &mut [0.0; 5]).is_err());
        assert!(a.step(0.1, 1, &mut p, &[0.0; 2], &mut [0.0; 6]).is_err());
        assert!(a.step(0.1, 0, &mut p, &[0.0; 3], &mut [0.0; 6]).is_err());
    }

    #[test]
    fn clip_coef_matches_torch_rule() {
        // norm 5, max 1 -> 1 / (5 + 1e-6)
        let c = clip_coef(25.0, 1.0);
        assert!((c as f64 - 1.0 / (5.0 + 1e-6)).abs() < 1e-7);
        assert_eq!(clip_coef(0.25, 1.0), 1.0);
        assert_eq!(clip_coef(0.0, 1.0), 1.0);
        // Sum of local squared norms of two "ranks" equals the norm of the whole.
        let g: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
        let total = sq_norm(&g[..4]) + sq_norm(&g[4..]);
        assert!((total - sq_norm(&g)).abs() < 1e-12);
        let mut g2 = g.clone();
        scale(&mut g2, clip_coef(total, 2.0));
        assert!((sq_norm(&g2).sqrt() - 2.0).abs() < 1e-4);
    }

    fn optimizers() -> impl Strategy<Value = Optimizer> {
        prop_oneof![
            Just(Optimizer::Sgd(SgdConfig::default())),
            Just(Optimizer::Sgd(SgdConfig {
                momentum: 0.9,
                dampening: 0.1,
                weight_decay: 1e-2,
                nesterov: false
            })),
            Just(Optimizer::AdamW(AdamWConfig::default())),
        ]
    }

    proptest! {
        /// OPT-1 and OPT-2: stepping each rank's shard of a zero-padded buffer equals stepping
        /// the whole buffer, and the padding stays zero.
        #[test]
        fn shard_step_equals_full_step(opt in optimizers(), numel in 0usize..50,
                                       world in 1usize..=7, steps in 1usize..4) {
            let padded = numel.div_ceil(world) * world;
            let k = opt.state_len_per_param();
            let mut full_p: Vec<f32> = (0..padded)
                .map(|i| if i < numel { (i as f32 * 0.37).sin() } else { 0.0 })
                .collect();
            let mut full_s = vec![0.0; padded * k];
            let len = padded / world;
            let mut shards_p: Vec<Vec<f32>> =
                (0..world).map(|r| full_p[r * len..(r + 1) * len].to_vec()).collect();
            let mut shards_s = vec![vec![0.0; len * k]; world];
            for t in 1..=steps as u64 {
                let g: Vec<f32> = (0..padded)
                    .map(|i| if i < numel { ((i as f32 + t as f32) * 0.91).cos() } else { 0.0 })
                    .collect();
                opt.step(0.01, t, &mut full_p, &g, &mut full_s).unwrap();
                for r in 0..world {
                    let gr = &g[r * len..(r + 1) * len];
                    opt.step(0.01, t, &mut shards_p[r], gr, &mut shards_s[r]).unwrap();
                }
            }
            let joined: Vec<f32> = shards_p.concat();
            prop_assert_eq!(&joined, &full_p);
            prop_assert_eq!(shards_s.concat(), full_s.clone());
            prop_assert!(full_p[numel..].iter().all(|v| *v == 0.0));
            prop_assert!(full_s[numel * k..].iter().all(|v| *v == 0.0));
        }
    }

    fn unit_of(shapes: &[&[usize]]) -> shardline_models::UnitSpec {
        shardline_models::UnitSpec {
            name: "u".into(),
            params: shapes
                .iter()
                .enumerate()
                .map(|(i, sh)| shardline_models::ParamSpec {
                    name: format!("p{i}"),
                    shape: sh.to_vec(),
                })
                .collect(),
            buffers: Vec::new(),
        }
    }

    #[test]
    fn matrices_only_leaves_vectors_undecayed_and_merges_neighbours() {
        // weight [4, 3], bias [4], gain [4], weight [2, 4], bias [2]
        let u = unit_of(&[&[4, 3], &[4], &[4], &[2, 4], &[2]]);
        assert_eq!(WeightDecayOn::Matrices.no_decay_ranges(&u), vec![12..20, 28..30]);
        assert!(WeightDecayOn::All.no_decay_ranges(&u).is_empty());
    }

    proptest! {
        /// OPT-5: grouped steps equal per-element steps with or without decay, bitwise, for
        /// any slice of the unit; the squared norm is bitwise `sq_norm`.
        #[test]
        fn grouped_steps_equal_per_element_steps(
            seed in 0u64..1000,
            start in 0usize..30,
            len in 0usize..30,
            adam in any::<bool>(),
        ) {
            let u = unit_of(&[&[4, 3], &[4], &[4], &[2, 4], &[2], &[3, 3]]);
            let n = u.numel();
            let (start, len) = (start.min(n), len.min(n - start.min(n)));
            let no_decay = WeightDecayOn::Matrices.no_decay_ranges(&u);
            let opt = if adam {
                Optimizer::AdamW(AdamWConfig { weight_decay: 0.3, ..AdamWConfig::default() })
            } else {
                Optimizer::Sgd(SgdConfig { momentum: 0.9, weight_decay: 0.3, ..SgdConfig::default() })
            };
            let k = opt.state_len_per_param();
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut rnd = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2000) as f32 / 1000.0 - 1.0
            };
            let p0: Vec<f32> = (0..len).map(|_| rnd()).collect();
            let mut want = p0.clone();
            let mut want_st = vec![0.0f32; len * k];
            let mut got = p0.clone();
            let mut got_st = vec![0.0f32; len * k];
            for step in 1..=3u64 {
                let g: Vec<f32> = (0..len).map(|_| rnd()).collect();
                for i in 0..len {
                    let at = start + i;
                    let plain = no_decay.iter().any(|r| r.contains(&at));
                    let o = if plain { opt.without_decay() } else { opt };
                    o.step(0.05, step, &mut want[i..i + 1], &g[i..i + 1], &mut want_st[i * k..(i + 1) * k]).unwrap();
                }
                let groups = Groups { offset: start, no_decay: &no_decay };
                let sq = opt
                    .step_groups(0.05, step, (&mut got, &g, &mut got_st), groups, true)
                    .unwrap();
                prop_assert_eq!(sq.to_bits(), sq_norm(&g).to_bits());
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got), bits(&want));
            prop_assert_eq!(bits(&got_st), bits(&want_st));
        }
    }

    #[test]
    fn a_grouped_step_decays_matrices_and_not_vectors() {
        // OPT-5 against the definition: zero gradients, AdamW: only the decay moves a weight.
        let u = unit_of(&[&[2, 2], &[2]]);
        let no_decay = WeightDecayOn::Matrices.no_decay_ranges(&u);
        let opt = Optimizer::AdamW(AdamWConfig { weight_decay: 0.5, ..AdamWConfig::default() });
        let mut p = vec![1.0f32; 6];
        let mut st = vec![0.0f32; 12];
        let groups = Groups { offset: 0, no_decay: &no_decay };
        opt.step_groups(0.1, 1, (&mut p, &[0.0; 6], &mut st), groups, false).unwrap();
        assert_eq!(p, vec![0.95, 0.95, 0.95, 0.95, 1.0, 1.0]);
    }
}
