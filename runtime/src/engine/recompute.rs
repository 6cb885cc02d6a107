//! Activation recomputation (`--recompute units`): a checkpointed call of the forward pass
//! keeps only its input, and its backward re-runs its forward to get back what its layers
//! save, as torch's `checkpoint` does around an FSDP unit.
//!
//! The re-run must compute what the first forward computed, bitwise, without acting twice:
//! - SyncBatchNorm's statistics: the first forward runs through a [`Recording`] reducer,
//!   which keeps every reduced statistics message it receives; the re-run gets a [`Replay`]
//!   of them, which answers each of the layers' reductions, in order, with what the first
//!   forward received, and sends nothing. Local (per-rank) statistics are recomputed from the
//!   same input by the same kernels, so they are the same values.
//! - running statistics: the re-run updates a scratch copy of the unit's buffers, which is
//!   then dropped.
//! - dropout: its masks are keyed by (seed, step, global sample), which the re-run's context
//!   repeats.
//!
//! Invariants:
//! - RECOMP-1: with `units`, every call of the forward pass but the last keeps only its input
//!   (and the statistics messages it received) from its forward until its backward, whose
//!   re-run of the forward gives the state its backward needs; the last call's backward
//!   follows its forward at once, so it is not checkpointed.
//! - RECOMP-2: the re-run sends no statistics message and leaves the running statistics as
//!   the first forward left them: a step's SyncBN messages and the final buffers are those
//!   of a run without recomputation.
//! - RECOMP-3: losses, gradients, parameters and buffers are bitwise those without
//!   recomputation, at every stage, with SyncBN and with dropout.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use shardline_models::{StatsError, StatsFailure, StatsOp, StatsReducer, Tensor};

/// `--recompute`: which calls of the forward pass are recomputed in backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Every call keeps what its layers save.
    #[default]
    None,
    /// Every call but the last keeps only its input (RECOMP-1).
    Units,
}

impl Recompute {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Units => "units",
        }
    }

    /// Whether call `call` of a forward pass of `calls` calls is checkpointed (RECOMP-1).
    pub(crate) fn checkpoints(self, call: usize, calls: usize) -> bool {
        self == Recompute::Units && call + 1 < calls
    }
}

/// What a checkpointed call keeps until its backward: its input and the statistics
/// messages its forward received (RECOMP-1).
pub(crate) struct Checkpoint {
    /// The call's input.
    pub(crate) input: Tensor,
    /// Each statistics reduction's result, in the order the forward asked for them.
    pub(crate) received: VecDeque<Vec<f32>>,
}

/// The first forward's reducer: reduces through `inner` and keeps each result.
pub(crate) struct Recording<'a> {
    inner: &'a dyn StatsReducer,
    received: Mutex<VecDeque<Vec<f32>>>,
}

impl<'a> Recording<'a> {
    /// Records what `inner` answers.
    pub(crate) fn new(inner: &'a dyn StatsReducer) -> Self {
        Recording { inner, received: Mutex::default() }
    }

    /// The results received, in order.
    pub(crate) fn into_received(self) -> VecDeque<Vec<f32>> {
        self.received.into_inner().unwrap_or_else(|e| e.into_inner())
    }

    fn keep(&self, r: &[f32]) {
        self.received.lock().unwrap_or_else(|e| e.into_inner()).push_back(r.to_vec());
    }
}

impl StatsReducer for Recording<'_> {
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn reduce_records(
        &self,
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
    ) -> Result<Vec<f32>, StatsError> {
        let r = self.inner.reduce_records(buf, record_len, combine)?;
        self.keep(&r);
        Ok(r)
    }
    fn reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, StatsError> {
        let r = self.inner.reduce_sum(buf)?;
        self.keep(&r);
        Ok(r)
    }
}

/// The re-run's reducer: answers each reduction with the next result the first forward
/// received, and sends nothing (RECOMP-2).
pub(crate) struct Replay {
    rank: usize,
    world: usize,
    received: Mutex<VecDeque<Vec<f32>>>,
}

impl Replay {
    /// Replays `received` as rank `rank` of `world`.
    pub(crate) fn new(rank: usize, world: usize, received: VecDeque<Vec<f32>>) -> Self {
        Replay { rank, world, received: Mutex::new(received) }
    }

    /// The next result; a re-run that asks for more, or for another length, than the first
    /// forward did is an error (it would not be the same computation).
    fn next(&self, op: StatsOp, len: usize) -> Result<Vec<f32>, StatsError> {
        let next = self.received.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
        match next {
            Some(r) if r.len() == len => Ok(r),
            other => Err(StatsError::new(
                self.rank,
                "recompute replay",
                op,
                StatsFailure::Length { ours: len, theirs: other.map_or(0, |r| r.len()) },
            )),
        }
    }
}

impl StatsReducer for Replay {
    fn world(&self) -> usize {
        self.world
    }
    fn reduce_records(
        &self,
        buf: Vec<f32>,
        _record_len: usize,
        _combine: fn(&mut [f32], &[f32]),
    ) -> Result<Vec<f32>, StatsError> {
        self.next(StatsOp::Forward, buf.len())
    }
    fn reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, StatsError> {
        self.next(StatsOp::Backward, buf.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A one-rank reducer that counts its messages and answers with doubled values.
    #[derive(Default)]
    struct Doubling(AtomicUsize);

    impl StatsReducer for Doubling {
        fn world(&self) -> usize {
            2
        }
        fn reduce_records(
            &self,
            buf: Vec<f32>,
            _: usize,
            _: fn(&mut [f32], &[f32]),
        ) -> Result<Vec<f32>, StatsError> {
            self.reduce_sum(buf)
        }
        fn reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, StatsError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(buf.iter().map(|v| 2.0 * v).collect())
        }
    }

    fn noop(_: &mut [f32], _: &[f32]) {}

    /// RECOMP-2: the replay answers what the recording received, in order, and sends
    /// nothing; asking for more than was recorded, or another length, is an error.
    #[test]
    fn the_replay_answers_what_the_first_forward_received_recomp_2() {
        let inner = Doubling::default();
        let rec = Recording::new(&inner);
        let a = rec.reduce_records(vec![1.0, 2.0], 1, noop).unwrap();
        let b = rec.reduce_records(vec![3.0], 1, noop).unwrap();
        assert_eq!((a.as_slice(), b.as_slice()), ([2.0, 4.0].as_slice(), [6.0].as_slice()));
        let replay = Replay::new(0, 2, rec.into_received());
        // The re-run's inputs are the same values; what comes back is the first answer.
        assert_eq!(replay.reduce_records(vec![1.0, 2.0], 1, noop).unwrap(), a);
        assert!(replay.reduce_records(vec![0.0, 0.0], 1, noop).is_err(), "length 1 was next");
        assert!(replay.reduce_records(vec![3.0], 1, noop).is_err(), "nothing left");
        assert_eq!(inner.0.load(Ordering::Relaxed), 2, "the replay sent nothing");
        assert_eq!(replay.world(), 2);
    }

    /// RECOMP-1: every call but the last is checkpointed with `units`, none without.
    #[test]
    fn every_call_but_the_last_is_checkpointed_recomp_1() {
        let units: Vec<bool> = (0..4).map(|c| Recompute::Units.checkpoints(c, 4)).collect();
        assert_eq!(units, [true, true, true, false]);
        assert!((0..4).all(|c| !Recompute::None.checkpoints(c, 4)));
    }
}
