//! The order of one training step on a rank, as one function ([`walk_step`]) over a
//! [`StepWork`]: the host engine's step runs its kernels and collectives through it, the
//! device engine its device work (`on_device::step`), and the plan simulator (`crate::plan`)
//! its cost model over a simulated clock, so that what `shardline plan` predicts is the
//! schedule both engines run, not a second description of it.
//!
//! The walk decides the order and the hand-offs: forward through the calls, the loss, backward
//! through them in reverse, once per microbatch (ACC-1); which calls keep only their input
//! (RECOMP-1); after which backward call a unit's gradients go to their reduction and whether
//! they add to an earlier microbatch's (NET-1, ACC-2, ACC-3); the reduce budget's waits after
//! every backward call (ENG-7); the updates as the reductions come in or after the global norm
//! (ENG-8, ENG-10); the stage's gathers after the update. What each use costs, and the
//! gathers the prefetch plan issues inside it (ENG-5), are the [`StepWork`]'s.
//!
//! Invariant:
//! - ENG-12: a step is the same sequence of uses, hand-offs, budget waits, updates and
//!   gathers after the update whoever walks it: [`walk_step`] is the only place that orders
//!   them.

use super::accum::{self, AccumReduce};
use super::pass::Micro;
use super::recompute::Recompute;
use super::reduction::{InFlight, ReduceIo, Reductions};

/// What a step's walk needs to know of the job.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Walk<'a> {
    /// The unit of each call of a forward pass.
    pub(crate) calls: &'a [usize],
    /// Units of the model.
    pub(crate) units: usize,
    /// Microbatches of the step (ACC-1).
    pub(crate) micro: usize,
    /// The stage keeps gradient shards: full gradients are transient (ENG-7).
    pub(crate) transient_grads: bool,
    /// When the microbatches' gradients are reduced (ACC-3).
    pub(crate) accum: AccumReduce,
    /// Which calls keep only their input (RECOMP-1).
    pub(crate) recompute: Recompute,
    /// Most bytes of unreduced gradients in flight (ENG-7).
    pub(crate) reduce_budget: u64,
    /// Gradient clipping: every update waits for the global norm (ENG-8).
    pub(crate) clip: bool,
    /// The stage all-gathers the updated parameters after the step.
    pub(crate) gather_after_update: bool,
    /// Live recovery: every reduction, then the commit, then the updates (LIVE-1).
    pub(crate) commit: bool,
}

/// What a backward call does with its unit's gradients once they exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HandOff {
    /// They go to their reduction now (the unit's last call of the microbatch, and the
    /// microbatch after which the stage reduces, ACC-2, ACC-3); otherwise they stay in the
    /// unit's full gradient for a later call or microbatch.
    pub(crate) reduce: bool,
    /// The reduction's result adds to the shard's gradients of an earlier microbatch (ACC-3).
    pub(crate) add: bool,
}

/// What a step's walk asks of whoever runs it: the engine (kernels, lanes) or the plan
/// simulator (costs on a simulated clock).
pub(crate) trait StepWork: ReduceIo<Self::Op> {
    /// A reduction in flight.
    type Op: InFlight;
    /// Forward of use `i` (call `call` of microbatch `mb`); `checkpoint`: it keeps only its
    /// input (RECOMP-1).
    fn forward(
        &mut self,
        i: usize,
        call: usize,
        mb: Micro,
        checkpoint: bool,
    ) -> Result<(), Self::Error>;
    /// The loss of microbatch `mb` and its gradient.
    fn loss(&mut self, mb: Micro) -> Result<(), Self::Error>;
    /// Backward of use `i` (call `call` of microbatch `mb`): re-runs a checkpointed forward,
    /// computes the unit's gradients, issues their reduction into `reds` when `hand` says so
    /// (ENG-9), then the input gradient.
    fn backward(
        &mut self,
        i: usize,
        call: usize,
        mb: Micro,
        hand: HandOff,
        reds: &mut Reductions<Self::Op>,
    ) -> Result<(), Self::Error>;
    /// After backward use `i` and the reduce budget's waits.
    fn backward_done(&mut self, _i: usize, _mb: Micro) {}
    /// Every microbatch's passes are done.
    fn end_passes(&mut self) -> Result<(), Self::Error>;
    /// The updates are about to begin (the optimizer's step count moves on).
    fn begin_updates(&mut self) -> Result<(), Self::Error>;
    /// The step's loss and squared norm summed over the group (and, with clipping, the
    /// coefficient the updates use).
    fn loss_and_norm(&mut self) -> Result<(), Self::Error>;
    /// Every unit is stepped.
    fn end_updates(&mut self) -> Result<(), Self::Error>;
    /// All-gathers the updated parameters (stages 1 and 2).
    fn gather_updated(&mut self) -> Result<(), Self::Error>;
    /// Live recovery's commit (LIVE-1): returns once every rank of the group has finished its
    /// reductions (a one-value all-reduce); no rank updates before.
    fn commit(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }
    /// Every unit is stepped under live recovery's commit: the state is the new step's.
    fn committed(&mut self) {}
}

impl<'a> Walk<'a> {
    /// The walk of an engine's step: `calls` over `units` units in `micro` microbatches,
    /// under the stage's rules and the engine's configuration.
    pub(crate) fn of(
        calls: &'a [usize],
        units: usize,
        micro: usize,
        rules: &super::stage::StageRules,
        cfg: &super::EngineConfig,
    ) -> Self {
        Walk {
            calls,
            units,
            micro,
            transient_grads: rules.transient_grads(),
            accum: cfg.accum_reduce,
            recompute: cfg.recompute,
            reduce_budget: cfg.reduce_budget_bytes,
            clip: cfg.clip_grad_norm.is_some(),
            gather_after_update: rules.gather_after_update,
            commit: false,
        }
    }

    /// How backward call `call` of microbatch `mb` hands on its unit's gradients: a unit
    /// called again earlier in the forward (a tied root, NET-1) reduces after that last
    /// backward call; with microbatches, after the microbatch the stage reduces after
    /// (ACC-2, ACC-3), adding to the shard when an earlier one already reduced.
    pub(crate) fn hand_off(&self, call: usize, mb: Micro) -> HandOff {
        let u = self.calls[call];
        let (transient, how) = (self.transient_grads, self.accum);
        let reduce = !self.calls[..call].contains(&u)
            && accum::reduces_after(mb.index, mb.count, transient, how);
        let add = mb.index > 0 && accum::reduces_after(mb.index - 1, mb.count, transient, how);
        HandOff { reduce, add }
    }
}

/// Walks one training step over `work` (ENG-12); returns when every unit is stepped and,
/// where the stage says so, its parameters gathered.
pub(crate) fn walk_step<W: StepWork>(walk: &Walk<'_>, work: &mut W) -> Result<(), W::Error> {
    let nc = walk.calls.len();
    let count = walk.micro.max(1);
    // One set of reductions for the whole step: an earlier microbatch's may still be in
    // flight while the next one computes (ACC-3).
    let mut reds = Reductions::new(walk.units, walk.reduce_budget);
    for index in 0..count {
        let mb = Micro { index, count };
        // The plan's uses of this microbatch start here (`GatherPlan::begin_step`).
        let base = 2 * nc * index;
        for call in 0..nc {
            work.forward(base + call, call, mb, walk.recompute.checkpoints(call, nc))?;
        }
        work.loss(mb)?;
        // Backward: each unit's reduction leaves as soon as its gradients exist.
        for k in 0..nc {
            let call = nc - 1 - k;
            work.backward(base + nc + k, call, mb, walk.hand_off(call, mb), &mut reds)?;
            reds.bound(work)?; // ENG-7
            work.backward_done(base + nc + k, mb);
            // Reductions that already finished give their memory back now; never blocks.
            reds.collect(work)?;
        }
    }
    work.end_passes()?;
    if walk.clip {
        // Every norm first: the updates need the global one.
        reds.finish_all(work)?;
        work.loss_and_norm()?;
        work.begin_updates()?;
        (0..walk.units).try_for_each(|u| work.update(u))?;
    } else if walk.commit {
        // LIVE-1: no rank updates before every rank has its reduced gradients; the updates
        // then give the norms as without the commit (ENG-8).
        reds.finish_all(work)?;
        work.commit()?;
        work.begin_updates()?;
        (0..walk.units).try_for_each(|u| work.update(u))?;
        work.committed();
        work.loss_and_norm()?;
    } else {
        // ENG-8, ENG-10: each unit steps as soon as its reduction is in.
        work.begin_updates()?;
        reds.update_as_reduced(walk.units, work)?;
        work.loss_and_norm()?;
    }
    work.end_updates()?;
    if walk.gather_after_update {
        work.gather_updated()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::reduction::Reduction;
    use super::*;

    /// Records the walk; reductions complete at once.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl InFlight for usize {
        fn is_done(&self) -> bool {
            true
        }
    }

    impl ReduceIo<usize> for Log {
        type Error = ();
        fn finish(&mut self, r: Reduction<usize>) -> Result<(), ()> {
            self.0.push(format!("finish {}", r.unit));
            Ok(())
        }
        fn update(&mut self, unit: usize) -> Result<(), ()> {
            self.0.push(format!("update {unit}"));
            Ok(())
        }
    }

    impl StepWork for Log {
        type Op = usize;
        fn forward(&mut self, i: usize, call: usize, _: Micro, cp: bool) -> Result<(), ()> {
            self.0.push(format!("fwd {i} call {call}{}", if cp { " cp" } else { "" }));
            Ok(())
        }
        fn loss(&mut self, mb: Micro) -> Result<(), ()> {
            self.0.push(format!("loss {}", mb.index));
            Ok(())
        }
        fn backward(
            &mut self,
            i: usize,
            call: usize,
            _: Micro,
            hand: HandOff,
            reds: &mut Reductions<usize>,
        ) -> Result<(), ()> {
            self.0.push(format!("bwd {i} call {call} reduce {} add {}", hand.reduce, hand.add));
            if hand.reduce {
                reds.issue(call, 0, call);
            }
            Ok(())
        }
        fn end_passes(&mut self) -> Result<(), ()> {
            self.0.push("end".into());
            Ok(())
        }
        fn begin_updates(&mut self) -> Result<(), ()> {
            self.0.push("begin updates".into());
            Ok(())
        }
        fn loss_and_norm(&mut self) -> Result<(), ()> {
            self.0.push("loss+norm".into());
            Ok(())
        }
        fn end_updates(&mut self) -> Result<(), ()> {
            Ok(())
        }
        fn gather_updated(&mut self) -> Result<(), ()> {
            self.0.push("gather updated".into());
            Ok(())
        }
        fn commit(&mut self) -> Result<(), ()> {
            self.0.push("commit".into());
            Ok(())
        }
        fn committed(&mut self) {
            self.0.push("committed".into());
        }
    }

    fn walk(calls: &[usize], micro: usize, transient: bool, clip: bool) -> Walk<'_> {
        Walk {
            calls,
            units: calls.iter().max().map_or(0, |m| m + 1),
            micro,
            transient_grads: transient,
            accum: AccumReduce::Each,
            recompute: Recompute::Units,
            reduce_budget: u64::MAX,
            clip,
            gather_after_update: !transient,
            commit: false,
        }
    }

    /// ENG-12: a tied root (unit 0 called first and last) reduces after its first call's
    /// backward, the last of the pass; every call but the last is checkpointed; without
    /// clipping the loss and norm follow the updates, with it they precede them.
    #[test]
    fn the_walk_orders_uses_hand_offs_and_updates_eng_12() {
        let calls = [0, 1, 0];
        let mut log = Log::default();
        walk_step(&walk(&calls, 1, true, false), &mut log).unwrap();
        let want = [
            "fwd 0 call 0 cp",
            "fwd 1 call 1 cp",
            "fwd 2 call 2",
            "loss 0",
            "bwd 3 call 2 reduce false add false",
            "bwd 4 call 1 reduce true add false",
            "finish 1",
            "bwd 5 call 0 reduce true add false",
            "finish 0",
            "end",
            "begin updates",
            "update 0",
            "update 1",
            "loss+norm",
        ];
        assert_eq!(log.0, want);
        let mut clipped = Log::default();
        walk_step(&walk(&calls, 1, false, true), &mut clipped).unwrap();
        let at = |e: &str| clipped.0.iter().position(|x| x == e).unwrap();
        assert!(at("loss+norm") < at("update 0"), "{:?}", clipped.0);
        assert_eq!(clipped.0.last().map(String::as_str), Some("gather updated"));
    }

    /// LIVE-1 in the walk: under live recovery every reduction finishes, then the commit,
    /// then all updates, marked done before the loss and norm.
    #[test]
    fn the_commit_stands_between_the_reductions_and_the_updates_live_1() {
        let calls = [0, 1, 2];
        let mut log = Log::default();
        let mut w = walk(&calls, 1, true, false);
        w.commit = true;
        walk_step(&w, &mut log).unwrap();
        let at = |e: &str| log.0.iter().position(|x| x == e).unwrap();
        for u in 0..3 {
            assert!(at(&format!("finish {u}")) < at("commit"), "{:?}", log.0);
            assert!(at("begin updates") < at(&format!("update {u}")), "{:?}", log.0);
            assert!(at(&format!("update {u}")) < at("committed"), "{:?}", log.0);
        }
        assert!(at("commit") < at("begin updates") && at("committed") < at("loss+norm"));
        // Without live recovery there is no commit.
        let mut plain = Log::default();
        walk_step(&walk(&calls, 1, true, false), &mut plain).unwrap();
        assert!(!plain.0.iter().any(|e| e.starts_with("commit")), "{:?}", plain.0);
    }

    /// ENG-12 with ACC-2 and ACC-3: full gradients reduce after the last microbatch only;
    /// transient ones after every microbatch, the later ones adding to the shard.
    #[test]
    fn microbatches_hand_off_as_the_stage_reduces_eng_12() {
        let calls = [0, 1];
        let full = walk(&calls, 2, false, false);
        let m = |index| Micro { index, count: 2 };
        assert_eq!(full.hand_off(1, m(0)), HandOff { reduce: false, add: false });
        assert_eq!(full.hand_off(1, m(1)), HandOff { reduce: true, add: false });
        let each = walk(&calls, 2, true, false);
        assert_eq!(each.hand_off(0, m(0)), HandOff { reduce: true, add: false });
        assert_eq!(each.hand_off(0, m(1)), HandOff { reduce: true, add: true });
        let mut log = Log::default();
        walk_step(&each, &mut log).unwrap();
        let fwd = log.0.iter().filter(|e| e.starts_with("fwd")).count();
        let finish = log.0.iter().filter(|e| e.starts_with("finish")).count();
        assert_eq!((fwd, finish), (4, 4), "{:?}", log.0);
    }
}
