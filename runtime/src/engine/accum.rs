//! Gradient accumulation (`--grad-accum N`): a step runs each rank's slice of the global
//! batch as N microbatches, forward and backward each, and the optimizer steps once.
//!
//! The pure core: which samples each microbatch holds ([`microbatches`]) and whether a
//! unit's gradients are reduced after a given microbatch ([`reduces_after`]); the engine's
//! step (`engine/mod.rs`) and a unit's backward (`engine/pass.rs`) follow them.
//!
//! Stages 2 and 3 choose between FSDP2's two ways ([`AccumReduce`]):
//! - `each` (the default): every microbatch reduce-scatters each unit's gradient as soon as
//!   backward has produced it, and the result is added into the rank's gradient shard. Full
//!   gradients stay transient and within the reduce budget (ENG-7) at every microbatch, so
//!   accumulation costs no memory beyond the stage's own; each microbatch sends a step's
//!   worth of reduce-scatter bytes. This is FSDP2's default (gradient sync on every
//!   backward), and it keeps what stages 2 and 3 are for: gradients never held in full.
//! - `last`: each unit's full gradient stays on the rank (counted as `grads`) and every
//!   microbatch adds into it; one reduce-scatter per unit follows the last microbatch, as
//!   FSDP2's `set_requires_gradient_sync(False)` on the earlier ones. It sends N times fewer
//!   bytes, and holds every unit's full gradient until the step's end (stage 1's gradient
//!   memory).
//!
//! bench/RESULTS.md ("Gradient accumulation") measures both.
//!
//! Invariants:
//! - ACC-1: a rank's slice is cut into N contiguous microbatches
//!   (`DistributedSampler::slice_range` of the slice: sizes differ by at most one, a short
//!   slice gives empty ones); each sample keeps its global index (dropout keys), and each
//!   microbatch's loss and gradients are divided by the GLOBAL batch, so their sum is the
//!   step's. Without BatchNorm, N microbatches of b samples give the parameters and losses
//!   of one step of N x b within rounding, and the loss reported is the mean over the global
//!   batch (ENG-2).
//! - ACC-2 (stages 0 and 1): a unit's gradients are reduced once per step, after the last
//!   microbatch's backward; earlier microbatches add into the persistent gradient buffer and
//!   communicate nothing.
//! - ACC-3 (stages 2 and 3): with `each`, every microbatch reduce-scatters each unit and the
//!   first microbatch's result replaces the shard's old gradient, later ones add to it; with
//!   `last`, as ACC-2. Either way the optimizer steps once, after the last microbatch, with
//!   the step's learning rate and one step count (OPT-3).
//! - ACC-4: BatchNorm normalises each microbatch with that microbatch's statistics (with
//!   SyncBN: the statistics of microbatch k over every rank's microbatch k), and its running
//!   statistics and `num_batches_tracked` update once per microbatch, as torch's do over N
//!   forward calls. So with per-rank statistics, a world-W run with N microbatches gives
//!   the losses and parameters of a world W x N run whose ranks' slices are those
//!   microbatches (its running statistics differ: N updates against each rank's one).
//! - ACC-5: with SyncBN, a world-W run with N microbatches gives, within rounding, the
//!   losses, parameters, running statistics and `num_batches_tracked` of one rank that runs
//!   per step N forward and backward passes, pass k over the union of every rank's
//!   microbatch k (BatchNorm over that union is SyncBN over microbatch k), adds their
//!   gradients and steps once: what torch's SyncBatchNorm does over N forward calls
//!   (`runtime/tests/syncbn_accum.rs` builds that reference from the model's calls).

use std::ops::Range;

use serde::{Deserialize, Serialize};
use shardline_models::DistributedSampler;

/// Stages 2 and 3: when the gradients of a step's microbatches are reduced (the module
/// docs weigh the two).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccumReduce {
    /// Reduce-scatter after every microbatch into the sharded accumulator.
    #[default]
    Each,
    /// Keep full gradients until the last microbatch, then reduce-scatter once.
    Last,
}

impl AccumReduce {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            AccumReduce::Each => "each",
            AccumReduce::Last => "last",
        }
    }
}

/// The microbatches of a rank's slice of `len` samples cut in `n` (ACC-1): sample ranges
/// relative to the slice, in order, covering it.
pub(crate) fn microbatches(len: usize, n: usize) -> Vec<Range<usize>> {
    let n = n.max(1);
    (0..n).map(|k| DistributedSampler::slice_range(len, n, k)).collect()
}

/// Whether a unit's gradients go to their reduction after microbatch `k` of `n` (ACC-2,
/// ACC-3): always after the last; before it only where the stage keeps gradient shards
/// (`transient_grads`) and the policy is [`AccumReduce::Each`].
pub(crate) fn reduces_after(k: usize, n: usize, transient_grads: bool, how: AccumReduce) -> bool {
    k + 1 >= n || (transient_grads && how == AccumReduce::Each)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ACC-1: the microbatches cover the slice in order, contiguous, sizes within one of
    /// each other; a slice shorter than N gives empty ones at the end.
    #[test]
    fn microbatches_cut_the_slice_in_order_acc_1() {
        for (len, n) in [(12, 1), (12, 3), (12, 4), (10, 4), (2, 4), (0, 3)] {
            let m = microbatches(len, n);
            assert_eq!(m.len(), n, "{len} in {n}");
            assert_eq!(m[0].start, 0);
            assert_eq!(m[n - 1].end, len);
            assert!(m.windows(2).all(|w| w[0].end == w[1].start), "{len} in {n}: {m:?}");
            let (lo, hi) = (m.iter().map(|r| r.len()).min(), m.iter().map(|r| r.len()).max());
            assert!(hi.unwrap() - lo.unwrap() <= 1, "{len} in {n}: {m:?}");
        }
        assert_eq!(microbatches(12, 3), vec![0..4, 4..8, 8..12]);
        assert_eq!(microbatches(2, 4), vec![0..1, 1..2, 2..2, 2..2]);
    }

    /// ACC-2 and ACC-3: a stage with full gradients reduces once, after the last
    /// microbatch, whatever the policy; a sharded one after every microbatch with `each`.
    #[test]
    fn when_gradients_are_reduced_acc_2_3() {
        for how in [AccumReduce::Each, AccumReduce::Last] {
            let full: Vec<bool> = (0..3).map(|k| reduces_after(k, 3, false, how)).collect();
            assert_eq!(full, [false, false, true], "{how:?}");
        }
        let each: Vec<bool> =
            (0..3).map(|k| reduces_after(k, 3, true, AccumReduce::Each)).collect();
        assert_eq!(each, [true, true, true]);
        let last: Vec<bool> =
            (0..3).map(|k| reduces_after(k, 3, true, AccumReduce::Last)).collect();
        assert_eq!(last, [false, false, true]);
        assert!(reduces_after(0, 1, false, AccumReduce::Last), "one microbatch: at once");
    }
}
