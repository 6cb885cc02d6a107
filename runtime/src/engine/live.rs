//! Live recovery's engine side (`shardline launch --live-recovery`): what a rank keeps of a
//! failed communicator generation, and who hands state to whom in the next one.
//!
//! A rank's state between steps is its parameters, optimizer state, BatchNorm buffers and
//! step count; gradients and caches are rebuilt by the step. A survivor takes that state out
//! of its failed engine ([`RankEngine::live_state`]); the next generation's engine starts
//! fresh, installs it, and every rank that lacks the newest state receives it from a peer
//! holding the same shard ([`RankEngine::adopt_from`]), over a lane of the new communicator.
//!
//! Invariants:
//! - LIVE-1: under live recovery a step's updates begin only after a commit, a one-value
//!   all-reduce that no rank completes before every rank has finished its gradient
//!   reductions (at stages 1 and 2, whose updated parameters are gathered after the
//!   updates, the loss all-reduce is the commit, as clipping orders it). So a rank whose step
//!   failed before its updates holds the state of the step before, unchanged (its BatchNorm
//!   buffers as the step found them), and one whose updates all ran holds the new one (at
//!   stages 1 and 2, once the updated parameters are gathered): each is *clean* at its step.
//!   A rank that failed in between is not.
//! - LIVE-2 ([`recovery_plan`]): the job resumes at the newest step any clean survivor holds.
//!   Every replica set (the ranks holding the same shard: all ranks at stage 0, the ranks of
//!   equal shard index under hybrid sharding) needs a clean member at that step: its lowest
//!   such rank sends its state to every member of the set. Without one, live recovery is
//!   impossible and the job falls back to its checkpoint restart.
//! - LIVE-3: a state is installed only into an engine of the same shapes, and what it
//!   installs is bitwise what was taken: a resumed rank steps exactly as the donor would.
//! - LIVE-8: when the membership changed the world (LIVE-7), a stage-0 state is re-padded
//!   to the new world's multiple (the values themselves unchanged); a sharded state keeps
//!   its shapes only where the shard group's size did not change, and is refused otherwise
//!   (the job then falls back to its checkpoint, which reshards on load).

use super::RankEngine;
use crate::error::{Result, RuntimeError};
use crate::shard::Stage;
use shardline_collectives::Lane;

/// What a rank keeps between steps, as taken out of its engine.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiveState {
    /// Steps completed.
    pub step: u64,
    /// Whether the state is exactly that of `step` (LIVE-1).
    pub clean: bool,
    /// Per unit: the kept parameters (full or shard, as the stage keeps them).
    pub params: Vec<Vec<f32>>,
    /// Per unit: the optimizer state kept.
    pub optim_state: Vec<Vec<f32>>,
    /// Per unit: the replicated BatchNorm buffers.
    pub buffers: Vec<Vec<f32>>,
}

/// What one rank brings to a recovery: its replica set and, for a survivor, its step and
/// whether its state is clean there; `None` for a replacement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Standing {
    /// The replica set: ranks with equal keys hold the same state.
    pub set: usize,
    /// `(step, clean)` of a survivor.
    pub held: Option<(u64, bool)>,
}

/// Who sends state to whom (LIVE-2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryPlan {
    /// The step every rank resumes after.
    pub step: u64,
    /// Per replica set (in order of set key): the sending rank and the members.
    pub sets: Vec<(usize, Vec<usize>)>,
}

impl RecoveryPlan {
    /// The sending rank and the members of `rank`'s replica set.
    pub fn set_of(&self, rank: usize) -> Option<&(usize, Vec<usize>)> {
        self.sets.iter().find(|(_, m)| m.contains(&rank))
    }
}

/// LIVE-2: the plan for ranks `0..standings.len()`, or why none exists.
pub fn recovery_plan(standings: &[Standing]) -> std::result::Result<RecoveryPlan, String> {
    let step = standings
        .iter()
        .filter_map(|s| s.held.filter(|h| h.1).map(|h| h.0))
        .max()
        .ok_or("no surviving rank holds a clean state")?;
    let mut keys: Vec<usize> = standings.iter().map(|s| s.set).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut sets = Vec::with_capacity(keys.len());
    for key in keys {
        let members: Vec<usize> =
            (0..standings.len()).filter(|&r| standings[r].set == key).collect();
        let donor = members.iter().copied().find(|&r| standings[r].held == Some((step, true)));
        let Some(donor) = donor else {
            return Err(format!(
                "no surviving rank of {members:?} (one replica set) holds a clean state at step \
                 {step}"
            ));
        };
        sets.push((donor, members));
    }
    Ok(RecoveryPlan { step, sets })
}

impl RankEngine {
    /// The replica set of this rank (LIVE-2): every rank holds the whole state at stage 0;
    /// otherwise the ranks of one shard index across shard groups hold the same shard.
    pub fn replica_set(&self) -> usize {
        if self.cfg.stage == Stage::Zero0 {
            0
        } else {
            self.shard_rank
        }
    }

    /// Starts every later step's updates only after its commit (LIVE-1). The updates are
    /// the same; only when they begin moves.
    pub fn set_commit_after_sums(&mut self, on: bool) {
        self.commit_after_sums = on;
    }

    /// A copy of what this rank keeps between steps, with whether it is clean (LIVE-1). A
    /// step that failed before its updates leaves the buffers as it found them.
    pub fn live_state(&self) -> LiveState {
        let buffers = match &self.buffers_at_step {
            (b, true) => b.clone(),
            _ => self.state.buffers.clone(),
        };
        LiveState {
            step: self.step,
            clean: !self.updating,
            params: self.state.params.clone(),
            optim_state: self.state.optim_state.clone(),
            buffers,
        }
    }

    /// Installs `s` (LIVE-3): every buffer must have this engine's shape, except that at
    /// stage 0 a state taken in a world of another size is re-padded (LIVE-8): its full
    /// buffers differ only in their zero padding to a multiple of the world.
    pub fn install_live_state(&mut self, s: &LiveState) -> Result<()> {
        let full = self.cfg.stage == Stage::Zero0;
        let st = &mut self.state;
        let fits = |a: &[Vec<f32>], b: &[Vec<f32>], exact: bool| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| !exact || x.len() == y.len())
        };
        if !fits(&st.params, &s.params, !full)
            || !fits(&st.optim_state, &s.optim_state, !full)
            || !fits(&st.buffers, &s.buffers, true)
        {
            return Err(RuntimeError::LiveRecoveryImpossible(
                "the kept state's shards do not fit this world's (only stage 0, or shard groups \
                 of an unchanged size, keep their shapes when the world changes)"
                    .into(),
            ));
        }
        let copy = |d: &mut Vec<f32>, v: &Vec<f32>| {
            let n = d.len().min(v.len());
            d[..n].copy_from_slice(&v[..n]);
            d[n..].fill(0.0);
        };
        for (d, v) in st.params.iter_mut().zip(&s.params) {
            copy(d, v);
        }
        for (d, v) in st.optim_state.iter_mut().zip(&s.optim_state) {
            copy(d, v);
        }
        for (d, v) in st.buffers.iter_mut().zip(&s.buffers) {
            d.copy_from_slice(v);
        }
        self.settle(s.step);
        Ok(())
    }

    /// After a state was put in place: stands after `step`, with zero gradients and no cache
    /// or gather left from before (a fresh start of the step's walk).
    fn settle(&mut self, step: u64) {
        for g in self.state.grads.iter_mut() {
            g.fill(0.0);
        }
        self.step = step;
        self.updating = false;
        self.buffers_at_step.1 = false;
        for u in 0..self.state.params.len() {
            self.own_packed.invalidate(u);
        }
        self.pieces.clear();
        self.plan.discard();
    }

    /// Receives the state of `root` (an index of `lane`'s group) into this engine, or sends
    /// this one's when this rank is `root`: every member of the lane's group calls it at
    /// once (LIVE-2). Each buffer is broadcast as it is, so every member ends bitwise equal
    /// to the root (LIVE-3). The bytes this rank sent or received.
    pub fn adopt_from(&mut self, lane: &Lane, root: usize, step: u64) -> Result<u64> {
        let mut bytes = 0u64;
        let st = &mut self.state;
        for v in st.params.iter_mut().chain(st.optim_state.iter_mut()).chain(st.buffers.iter_mut())
        {
            if v.is_empty() {
                continue;
            }
            let buf = std::mem::take(v);
            bytes += buf.len() as u64 * 4;
            *v = lane.broadcast(buf, root).wait()?;
        }
        self.settle(step);
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(set: usize, held: Option<(u64, bool)>) -> Standing {
        Standing { set, held }
    }

    #[test]
    fn the_newest_clean_step_wins_and_each_set_sends_from_its_lowest_holder_live_2() {
        // Stage 0, world 3: rank 1 replaced, rank 2 finished the step rank 0 did not.
        let p = recovery_plan(&[s(0, Some((4, true))), s(0, None), s(0, Some((5, true)))]).unwrap();
        assert_eq!(p.step, 5);
        assert_eq!(p.sets, vec![(2, vec![0, 1, 2])]);
        // Hybrid 2x2: sets {0, 2} and {1, 3}; rank 2 replaced.
        let p = recovery_plan(&[
            s(0, Some((7, true))),
            s(1, Some((7, true))),
            s(0, None),
            s(1, Some((7, true))),
        ])
        .unwrap();
        assert_eq!(p.step, 7);
        assert_eq!(p.sets, vec![(0, vec![0, 2]), (1, vec![1, 3])]);
        assert_eq!(p.set_of(2), Some(&(0, vec![0, 2])));
    }

    #[test]
    fn a_state_caught_mid_update_never_sends_live_1() {
        // Rank 0 failed after its updates began: it holds neither step 3 nor step 4.
        let p =
            recovery_plan(&[s(0, Some((4, false))), s(0, Some((3, true))), s(0, None)]).unwrap();
        assert_eq!((p.step, p.sets[0].0), (3, 1));
        // Nobody clean at all.
        assert!(recovery_plan(&[s(0, Some((4, false))), s(0, None)]).is_err());
    }

    #[test]
    fn a_set_without_a_holder_of_the_newest_step_falls_back_live_2() {
        // One shard group at stage 3 (every rank its own set): the replaced rank's shard
        // exists nowhere else.
        let e = recovery_plan(&[s(0, Some((2, true))), s(1, None)]).unwrap_err();
        assert!(e.contains("[1]"), "{e}");
        // Hybrid: set 1's survivor is a step behind set 0's.
        let e = recovery_plan(&[
            s(0, Some((6, true))),
            s(1, None),
            s(0, Some((6, true))),
            s(1, Some((5, true))),
        ])
        .unwrap_err();
        assert!(e.contains("step 6"), "{e}");
    }
}
