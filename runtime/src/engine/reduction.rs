//! Gradient reductions in flight, and when each unit steps.
//!
//! [`Reductions`] is the pure core: the reductions of a step in issue order, each with the
//! bytes of full unreduced gradient it holds. Whether one has completed is its input
//! ([`InFlight::is_done`]); finishing one and updating a unit go through a [`ReduceIo`], so
//! the engine's lanes or a simulated device carry out the same decisions. It reads no
//! clock and does no I/O of its own.
//!
//! Invariants:
//! - ENG-7 (stages 2 and 3): the full, not yet reduced unit gradients in flight are bounded
//!   by the reduce budget (`EngineConfig::reduce_budget_bytes`; by default two of the
//!   largest unit, `train::reduce_budget`, so that one reduction overlaps the next unit's
//!   backward). Once a unit's reduction is issued, backward waits for the oldest while they
//!   exceed the budget and more than one is in flight, so they exceed it only by the
//!   gradient of the unit being computed (or when one unit alone does), and peak memory
//!   stays within model state + gathered units + the budget + that unit's gradient.
//! - ENG-8 (no clipping): no unit's update depends on the global gradient norm, so each unit
//!   steps as soon as its reduction is in, overlapping the reductions still in flight, and
//!   its squared norm comes out of the update's own pass (OPT-4). With clipping the norms
//!   are taken as the reductions come in, and every update waits for the global norm.
//! - ENG-10 (no clipping): updates run lowest unit first among those whose reduction is in,
//!   so unit 0's, which releases the next pass's first gather (ENG-6), never waits for
//!   another unit's; the reported loss and norm are bitwise those of any other order.

use std::collections::VecDeque;
use std::time::Instant;

use shardline_collectives::{ReduceOp, Work};

use super::prefetch::{carries_next_gather, GatherIo};
use super::stage::{GradReduce, Update};
use super::{RankEngine, StepState};
use crate::error::{Result, RuntimeError};
use crate::memory::{Allocation, Category};
use crate::optim;
use crate::telemetry::Row;

/// What the core needs to know of an op in flight: whether it has completed.
pub(crate) trait InFlight {
    /// Whether the op has completed (waiting for it would not block).
    fn is_done(&self) -> bool;
}

/// One unit's reduction in flight.
pub(crate) struct Reduction<W> {
    /// The unit.
    pub(crate) unit: usize,
    /// Bytes of full, unreduced gradient it holds until done (ENG-7); 0 where the gradient
    /// is reduced in a persistent buffer.
    pub(crate) unreduced_bytes: u64,
    /// The op.
    pub(crate) work: W,
}

/// What the core asks of whoever runs the reductions and the optimizer.
pub(crate) trait ReduceIo<W> {
    /// Why finishing or updating failed.
    type Error;
    /// Waits for a reduction (at once if it is done) and stores its result.
    fn finish(&mut self, r: Reduction<W>) -> std::result::Result<(), Self::Error>;
    /// Steps unit `unit`, whose reduction is finished.
    fn update(&mut self, unit: usize) -> std::result::Result<(), Self::Error>;
}

/// What to do next while updating units as their reductions come in (ENG-8, ENG-10).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Finish the oldest reduction: it is done, or nothing can step until it is.
    Finish,
    /// Step this unit.
    Update(usize),
    /// Every unit is stepped and every reduction finished.
    Done,
}

/// A step's reductions in flight, oldest first.
pub(crate) struct Reductions<W> {
    pending: VecDeque<Reduction<W>>,
    /// Most bytes of unreduced gradient in flight (ENG-7).
    budget: u64,
}

impl<W: InFlight> Reductions<W> {
    /// Room for `units` reductions, with `budget` bytes of unreduced gradients.
    pub(crate) fn new(units: usize, budget: u64) -> Self {
        Reductions { pending: VecDeque::with_capacity(units), budget }
    }

    /// Records a reduction just issued.
    pub(crate) fn issue(&mut self, unit: usize, unreduced_bytes: u64, work: W) {
        self.pending.push_back(Reduction { unit, unreduced_bytes, work });
    }

    /// Bytes of unreduced gradients in flight.
    pub(crate) fn unreduced_bytes(&self) -> u64 {
        self.pending.iter().map(|r| r.unreduced_bytes).sum()
    }

    /// ENG-7: whether the oldest reduction must be waited for before backward goes on (more
    /// than the newest in flight, over the budget).
    pub(crate) fn over_budget(&self) -> bool {
        self.pending.len() > 1 && self.unreduced_bytes() > self.budget
    }

    /// Whether the oldest reduction has completed.
    pub(crate) fn oldest_done(&self) -> bool {
        self.pending.front().is_some_and(|r| r.work.is_done())
    }

    /// The lowest unit not yet stepped whose reduction is in; `None` when every such unit is
    /// stepped (ENG-10).
    pub(crate) fn next_update(&self, stepped: &[bool]) -> Option<usize> {
        (0..stepped.len()).find(|&u| !stepped[u] && !self.pending.iter().any(|r| r.unit == u))
    }

    /// What to do next while updating units as their reductions come in: finish what is
    /// done, else step the lowest unit that can, else wait for the oldest (ENG-8, ENG-10).
    pub(crate) fn next(&self, stepped: &[bool]) -> Next {
        if self.oldest_done() {
            return Next::Finish;
        }
        match self.next_update(stepped) {
            Some(u) => Next::Update(u),
            None if self.pending.is_empty() => Next::Done,
            None => Next::Finish,
        }
    }

    fn finish_oldest<G: ReduceIo<W>>(&mut self, io: &mut G) -> std::result::Result<(), G::Error> {
        match self.pending.pop_front() {
            Some(r) => io.finish(r),
            None => Ok(()),
        }
    }

    /// ENG-7: after a unit's reduction is issued, waits for the oldest while over budget.
    pub(crate) fn bound<G: ReduceIo<W>>(
        &mut self,
        io: &mut G,
    ) -> std::result::Result<(), G::Error> {
        while self.over_budget() {
            self.finish_oldest(io)?;
        }
        Ok(())
    }

    /// Finishes the reductions that have already completed, oldest first, so their memory
    /// is freed as they are reduced; never blocks.
    pub(crate) fn collect<G: ReduceIo<W>>(
        &mut self,
        io: &mut G,
    ) -> std::result::Result<(), G::Error> {
        while self.oldest_done() {
            self.finish_oldest(io)?;
        }
        Ok(())
    }

    /// ENG-8, ENG-10: steps every one of `units` units as soon as its reduction is in,
    /// lowest unit first, finishing the reductions as they complete.
    pub(crate) fn update_as_reduced<G: ReduceIo<W>>(
        &mut self,
        units: usize,
        io: &mut G,
    ) -> std::result::Result<(), G::Error> {
        let mut stepped = vec![false; units];
        loop {
            match self.next(&stepped) {
                Next::Finish => self.finish_oldest(io)?,
                Next::Update(u) => {
                    io.update(u)?;
                    stepped[u] = true;
                }
                Next::Done => return Ok(()),
            }
        }
    }

    /// Finishes every reduction, oldest first (with clipping, before any update).
    pub(crate) fn finish_all<G: ReduceIo<W>>(
        &mut self,
        io: &mut G,
    ) -> std::result::Result<(), G::Error> {
        while !self.pending.is_empty() {
            self.finish_oldest(io)?;
        }
        Ok(())
    }
}

/// A unit's gradient reduction on the reduce lane, as its stage's rule says.
pub(crate) enum ReduceWork {
    /// Stage 0: all-reduce of the unit's full gradient (its persistent buffer).
    AllReduce(Work<Vec<f32>>),
    /// Stage 1: reduce-scatter in place of the unit's persistent full gradient buffer; the
    /// own slice holds the result.
    ReduceScatterInPlace(Work<Vec<f32>>),
    /// Stages 2 and 3: reduce-scatter of the unit's transient full gradient (counted by
    /// `alloc`) into its shard; `add`: into the gradients an earlier microbatch left there
    /// (ACC-3), else in place of the last step's. `out` counts the shard buffer the result
    /// arrives in until it takes the place of the kept shard (MEM-5).
    ReduceScatter {
        work: Work<(Vec<f32>, Vec<f32>)>,
        alloc: Option<Allocation>,
        out: Option<Allocation>,
        add: bool,
    },
    /// Any stage with reduce dtype bf16 (PREC-4).
    Packed(super::precision::PackedReduction),
    /// Stages 1-3 with more than one shard group (HSDP-3): the reduce-scatter over the
    /// shard group, then its shard's all-reduce over the replica group, chained. The
    /// allocations are the stage's, as above; `copy` counts stage 1's shard copy on the
    /// replica lane.
    Chained {
        chained: super::replica::Chained,
        alloc: Option<Allocation>,
        out: Option<Allocation>,
        copy: Option<Allocation>,
        add: bool,
    },
}

impl InFlight for ReduceWork {
    fn is_done(&self) -> bool {
        match self {
            ReduceWork::AllReduce(w) | ReduceWork::ReduceScatterInPlace(w) => w.is_done(),
            ReduceWork::ReduceScatter { work, .. } => work.is_done(),
            ReduceWork::Packed(p) => p.is_done(),
            ReduceWork::Chained { chained, .. } => chained.is_done(),
        }
    }
}

impl RankEngine {
    /// Whether a reduction whose result does not add to earlier microbatches' (`add`) lands
    /// in the kept shard's own buffer, taken out until it finishes: stages 2 and 3 in f32.
    pub(super) fn takes_kept_shard(&self, add: bool) -> bool {
        !add && self.rules.reduce == GradReduce::ReduceScatter && !self.bf16_grads()
    }

    /// Issues unit `u`'s reduction of its full gradient `gfull` (ENG-9: as soon as backward
    /// has produced it) and records it; `alloc` counts a transient gradient (ENG-7); `add`:
    /// a reduce-scatter's result adds to the shard's gradients (ACC-3); `kept_shard`: the
    /// kept shard's own buffer, taken for a reduce-scatter's result ([`Self::takes_kept_shard`]).
    pub(super) fn issue_reduction(
        &self,
        reds: &mut Reductions<ReduceWork>,
        u: usize,
        (gfull, alloc): (Vec<f32>, Option<Allocation>),
        add: bool,
        kept_shard: Option<Vec<f32>>,
    ) -> Result<()> {
        if self.bf16_grads() {
            return self.issue_packed_reduction(reds, u, (gfull, alloc), add);
        }
        let unreduced = alloc.as_ref().map_or(0, Allocation::bytes);
        let work = match (self.rules.reduce, &self.replica) {
            (GradReduce::AllReduce, _) => {
                ReduceWork::AllReduce(self.reduce.all_reduce(gfull, ReduceOp::Sum))
            }
            (GradReduce::ReduceScatterInPlace, Some(chain)) => {
                let own = self.layout.unit(u).shard_range(self.shard_rank);
                let what = format!("{} (replica all-reduce)", self.labels[u]);
                let copy = Some(self.mem.alloc_f32(Category::CommBuffers, own.len(), &what)?);
                let scatter = self.reduce.reduce_scatter_in_place(gfull, ReduceOp::Sum);
                let chained = chain.after(super::replica::Scatter::InPlace(scatter, own));
                ReduceWork::Chained { chained, alloc, out: None, copy, add: false }
            }
            (GradReduce::ReduceScatter, Some(chain)) => {
                let (buf, out) = self.scatter_output(u, kept_shard)?;
                let scatter = self.reduce.reduce_scatter(gfull, buf, ReduceOp::Sum);
                let chained = chain.after(super::replica::Scatter::Shard(scatter));
                ReduceWork::Chained { chained, alloc, out, copy: None, add }
            }
            (rule, None) => self.issue_one_group(rule, u, (gfull, alloc), add, kept_shard)?,
        };
        reds.issue(u, unreduced, work);
        Ok(())
    }

    /// Where a reduce-scatter's shard lands. The kept shard's own buffer, whose last values
    /// the optimizer has used: no second shard-sized buffer, and the kept one keeps its
    /// registration. An earlier microbatch's gradients there are added to instead (ACC-3):
    /// the result then comes in a pool buffer, counted while in flight (MEM-5).
    fn scatter_output(
        &self,
        u: usize,
        kept_shard: Option<Vec<f32>>,
    ) -> Result<(Vec<f32>, Option<Allocation>)> {
        let len = self.layout.unit(u).shard_len();
        Ok(match kept_shard {
            Some(mut buf) => {
                buf.resize(len, 0.0);
                (buf, None)
            }
            _ => {
                let mut buf = self.comm.pool().take(len);
                buf.resize(len, 0.0);
                let what = format!("{} (reduce-scatter output)", self.labels[u]);
                let out = self.mem.alloc_f32(Category::CommBuffers, buf.capacity(), &what)?;
                (buf, Some(out))
            }
        })
    }

    /// A unit's reduction with one shard group: the stage's collective on the reduce lane.
    fn issue_one_group(
        &self,
        rule: GradReduce,
        u: usize,
        (gfull, alloc): (Vec<f32>, Option<Allocation>),
        add: bool,
        kept_shard: Option<Vec<f32>>,
    ) -> Result<ReduceWork> {
        Ok(match rule {
            GradReduce::AllReduce => {
                ReduceWork::AllReduce(self.reduce.all_reduce(gfull, ReduceOp::Sum))
            }
            GradReduce::ReduceScatterInPlace => ReduceWork::ReduceScatterInPlace(
                self.reduce.reduce_scatter_in_place(gfull, ReduceOp::Sum),
            ),
            GradReduce::ReduceScatter => {
                let (buf, out) = self.scatter_output(u, kept_shard)?;
                let work = self.reduce.reduce_scatter(gfull, buf, ReduceOp::Sum);
                ReduceWork::ReduceScatter { work, alloc, out, add }
            }
        })
    }

    /// Waits for a unit's gradient reduction and stores the result where the optimizer reads
    /// it; a transient full gradient goes back to the pool and its bytes are freed.
    pub(super) fn finish_reduction(
        &mut self,
        r: Reduction<ReduceWork>,
        clock: &mut super::clock::CommClock,
    ) -> Result<()> {
        let unit = r.unit;
        let (trace, rank) = (&self.trace, self.rank);
        match r.work {
            ReduceWork::AllReduce(work) => {
                let what = format!("all-reduce {}", self.labels[unit]);
                self.state.grads[unit] = clock.wait(trace, rank, work, Row::Reduce, &what)?;
            }
            ReduceWork::ReduceScatterInPlace(work) => {
                let what = format!("reduce-scatter {}", self.labels[unit]);
                // The persistent full buffer; its own slice holds the result.
                self.state.grads[unit] = clock.wait(trace, rank, work, Row::Reduce, &what)?;
            }
            ReduceWork::ReduceScatter { work, alloc, out, add } => {
                let what = format!("reduce-scatter {}", self.labels[unit]);
                let (full, shard) = clock.wait(trace, rank, work, Row::Reduce, &what)?;
                self.store_shard(unit, shard, add, full, (alloc, out));
            }
            ReduceWork::Packed(p) => self.finish_packed_reduction(unit, p, clock)?,
            ReduceWork::Chained { chained, alloc, out, copy, add } => {
                let what = self.labels[unit].clone();
                let super::replica::Reduced { full, range, shard } =
                    chained.wait(clock, trace, rank, &what)?;
                match range {
                    // Stage 1: the summed shard back into the persistent full buffer.
                    Some(range) => {
                        let mut full = full;
                        full[range].copy_from_slice(&shard);
                        self.state.grads[unit] = full;
                        drop(copy);
                    }
                    None => self.store_shard(unit, shard, add, full, (alloc, out)),
                }
            }
        }
        Ok(())
    }

    /// Stages 2 and 3: stores a unit's reduced gradient shard (adding it to an earlier
    /// microbatch's, ACC-3) and gives the buffers back to the pool, unregistered first
    /// (MEM-5).
    fn store_shard(
        &mut self,
        unit: usize,
        shard: Vec<f32>,
        add: bool,
        full: Vec<f32>,
        allocs: (Option<Allocation>, Option<Allocation>),
    ) {
        let old = if add {
            // ACC-3: the microbatches' reduced gradients sum in the shard.
            let acc = &mut self.state.grads[unit];
            acc.iter_mut().zip(&shard).for_each(|(a, s)| *a += s);
            shard
        } else {
            // The kept shard's own buffer, back with the result.
            std::mem::replace(&mut self.state.grads[unit], shard)
        };
        // The result now holds the kept shard's registration, or was added into it.
        drop(allocs);
        self.comm.pool().give(old);
        self.comm.pool().give(full);
    }
}

/// The engine's [`ReduceIo`] for one step: finishing a reduction stores it (and, with
/// clipping, takes the unit's squared norm at once, ENG-8); updating steps the unit with the
/// step's learning rate and clipping coefficient.
pub(crate) struct StepIo<'a> {
    pub(crate) eng: &'a mut RankEngine,
    pub(crate) st: &'a mut StepState,
}

impl ReduceIo<ReduceWork> for StepIo<'_> {
    type Error = RuntimeError;

    fn finish(&mut self, r: Reduction<ReduceWork>) -> Result<()> {
        let u = r.unit;
        self.eng.finish_reduction(r, &mut self.st.clock)?;
        if self.st.norms_when_reduced {
            let t0 = Instant::now();
            let own = self.eng.layout.unit(u).shard_range(self.eng.shard_rank);
            self.st.unit_sq[u] =
                optim::sq_norm(self.eng.rules.own_grads(&self.eng.state.grads[u], &own));
            self.st.compute += t0.elapsed();
        }
        Ok(())
    }

    fn update(&mut self, u: usize) -> Result<()> {
        let sq = self.eng.step_unit(u, self.st)?;
        if !self.st.norms_when_reduced {
            self.st.unit_sq[u] = sq;
        }
        Ok(())
    }
}

impl RankEngine {
    /// Steps unit `u`'s kept state with the step's learning rate and clipping coefficient
    /// (its span goes to the step's optimizer spans); returns the squared norm of its own
    /// gradient slice, taken in the update's pass (OPT-4). ENG-6: the next pass starts with
    /// unit 0, so its gather leaves right after unit 0 is updated and overlaps the rest of
    /// the step and whatever the caller does between steps.
    fn step_unit(&mut self, u: usize, st: &mut StepState) -> Result<f64> {
        let t0 = Instant::now();
        let own = self.layout.unit(u).shard_range(self.shard_rank);
        let update = Update { opt: &self.cfg.optimizer, lr: st.lr, step: self.step, coef: st.coef };
        let s = &mut self.state;
        let sq = self.rules.update_unit(
            &update,
            &own,
            &self.no_decay[u],
            &mut s.params[u],
            &mut s.grads[u],
            &mut s.optim_state[u],
        )?;
        // QGATHER-2: the master changed; its packed slot is stale (and so is a secondary
        // piece, HPZ-2).
        self.own_packed.invalidate(u);
        self.pieces.drop_unit(u);
        if carries_next_gather(self.rules.before_use, self.cfg.prefetch, u) {
            let (plan, mut io) = self.gathers(&mut st.clock);
            let pending = io.issue(0)?;
            plan.carry(0, pending);
        }
        st.opt_spans.push((t0, Instant::now()));
        Ok(sq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A reduction whose completion the test sets.
    struct Op<'a>(&'a Cell<bool>);

    impl InFlight for Op<'_> {
        fn is_done(&self) -> bool {
            self.0.get()
        }
    }

    /// Records what the core asks for.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl<W> ReduceIo<W> for Log {
        type Error = ();
        fn finish(&mut self, r: Reduction<W>) -> std::result::Result<(), ()> {
            self.0.push(format!("finish {}", r.unit));
            Ok(())
        }
        fn update(&mut self, unit: usize) -> std::result::Result<(), ()> {
            self.0.push(format!("update {unit}"));
            Ok(())
        }
    }

    /// ENG-10: unit 0 goes first as soon as its reduction is in, whatever else is ready;
    /// while it waits the others go lowest first, and nothing still reducing is picked.
    #[test]
    fn unit_zeros_update_goes_first_once_its_reduction_is_in() {
        let n = 5;
        let mut stepped = vec![false; n];
        let not_done = Cell::new(false);
        let mut reds = Reductions::new(n, u64::MAX);
        // Reductions complete in issue order: the head (4) first, unit 0 last.
        for u in [2, 1, 0] {
            reds.issue(u, 0, Op(&not_done));
        }
        assert_eq!(reds.next_update(&stepped), Some(3));
        stepped[3] = true;
        assert_eq!(reds.next_update(&stepped), Some(4));
        stepped[4] = true;
        assert_eq!(reds.next_update(&stepped), None, "everything ready is done: wait");
        assert_eq!(reds.next(&stepped), Next::Finish, "nothing can step: wait for the oldest");
        reds.finish_all(&mut Log::default()).unwrap();
        assert_eq!(reds.next_update(&stepped), Some(0), "all in: unit 0 before 1 and 2");
        stepped[0] = true;
        assert_eq!(reds.next_update(&stepped), Some(1));
        stepped[1] = true;
        stepped[2] = true;
        assert_eq!(reds.next(&stepped), Next::Done);
    }

    /// ENG-8: without clipping each unit steps as soon as its reduction is in, before the
    /// reductions still in flight finish; a completed reduction is finished before anything
    /// steps (it frees memory and may let a lower unit go first).
    #[test]
    fn eng8_units_step_as_their_reductions_come_in() {
        let done = [Cell::new(false), Cell::new(true), Cell::new(false)];
        let mut reds = Reductions::new(3, u64::MAX);
        // Backward issues the head's first; unit 1's is done, the head's and unit 0's not.
        reds.issue(2, 0, Op(&done[2]));
        reds.issue(1, 0, Op(&done[1]));
        reds.issue(0, 0, Op(&done[0]));
        let stepped = [false; 3];
        assert_eq!(reds.next(&stepped), Next::Finish, "the oldest (head) blocks the others");
        done[2].set(true);
        let mut log = Log::default();
        reds.collect(&mut log).unwrap();
        assert_eq!(log.0, vec!["finish 2", "finish 1"], "completed ones are finished in order");
        assert_eq!(reds.next(&stepped), Next::Update(1), "unit 1 steps while unit 0 reduces");
        let mut log = Log::default();
        reds.update_as_reduced(3, &mut log).unwrap();
        assert_eq!(log.0, vec!["update 1", "update 2", "finish 0", "update 0"]);
    }

    /// ENG-7: backward waits for the oldest reduction only while the unreduced gradients
    /// in flight exceed the budget, and never for the one just issued.
    #[test]
    fn eng7_unreduced_gradients_stay_within_the_reduce_budget() {
        let never = Cell::new(false);
        let unit_bytes = 100;
        let mut reds = Reductions::new(4, 2 * unit_bytes);
        let mut log = Log::default();
        for u in (0..4).rev() {
            reds.issue(u, unit_bytes, Op(&never));
            reds.bound(&mut log).unwrap();
            assert!(reds.unreduced_bytes() <= 2 * unit_bytes, "unit {u}");
        }
        assert_eq!(log.0, vec!["finish 3", "finish 2"], "two units in flight at most");
        // A unit larger than the budget alone is never waited for by itself.
        let mut one = Reductions::new(1, 10);
        one.issue(0, unit_bytes, Op(&never));
        assert!(!one.over_budget());
        // Reductions in persistent buffers hold nothing unreduced.
        let mut persistent = Reductions::new(4, 0);
        (0..4).for_each(|u| persistent.issue(u, 0, Op(&never)));
        assert!(!persistent.over_budget());
    }
}
