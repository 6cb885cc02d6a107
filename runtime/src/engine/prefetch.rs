//! Stage 3's gathered units: the prefetch plan and its byte budget.
//!
//! [`GatherPlan`] is the pure core. It knows each unit's gathered size, the byte budget and
//! the prefetch depth, follows a pass's order of use, and decides which gathers to issue,
//! when to wait for one, and which gathered units to keep for a later use; the gathers
//! themselves go through a [`GatherIo`], so the same plan drives the engine's gather lane
//! ([`LaneGathers`]) or a simulated device. It reads no clock and does no I/O of its own.
//!
//! Invariants:
//! - ENG-5 (stage 3): gathered parameters resident or in flight (queued gathers, units kept
//!   for a later use, the unit in use) never exceed the prefetch byte budget, except that the
//!   unit needed now is always gathered. A unit used again later in the step is kept, not
//!   freed and gathered again, when it, the units used in between and the units already
//!   kept fit the budget together (the head; with prefetch >= 1 also the last block).
//! - ENG-6 (stage 3, prefetch >= 1): unit 0's gather for the next step or evaluation is
//!   issued right after the optimizer has updated unit 0's shard ([`GatherPlan::carry`]),
//!   and discarded when a checkpoint load replaces the parameters
//!   ([`GatherPlan::discard`]); every rank does the same, so lane order holds.

use std::collections::VecDeque;
use std::time::Instant;

use shardline_collectives::{Communicator, Lane, Work};

use super::clock::CommClock;
use super::hpz::{Pieces, Secondary};
use super::precision::{OwnPacked, Slots, Wire};
use super::stage::BeforeUse;
use crate::error::{Result, RuntimeError};
use crate::memory::{Allocation, Category, MemoryTracker};
use crate::shard::ShardedModelLayout;
use crate::telemetry::{Row, Trace};

/// What the plan asks of whoever moves the bytes.
pub(crate) trait GatherIo {
    /// A gather in flight.
    type Pending;
    /// A unit's gathered parameters.
    type Full;
    /// Why a gather failed.
    type Error;
    /// Issues `unit`'s gather without waiting for it.
    fn issue(&mut self, unit: usize) -> std::result::Result<Self::Pending, Self::Error>;
    /// Waits for `unit`'s gather.
    fn wait(
        &mut self,
        unit: usize,
        pending: Self::Pending,
    ) -> std::result::Result<Self::Full, Self::Error>;
    /// Frees a unit's gathered parameters.
    fn release(&mut self, full: Self::Full);
}

/// The gathers of a pass: its order of use, the gathers queued (in issue order) and the
/// units kept from an earlier use. `Q` is a gather in flight, `H` a gathered unit.
pub(crate) struct GatherPlan<Q, H> {
    /// Gathered bytes per unit.
    sizes: Vec<u64>,
    /// Most gathered bytes resident or in flight at once (ENG-5).
    budget: u64,
    /// Units to gather ahead of the one in use.
    depth: usize,
    /// The pass's units in order of use.
    uses: Vec<usize>,
    queued: VecDeque<(usize, Q)>,
    held: Vec<(usize, H)>,
    /// `done_with`'s list of the units used in between, kept to reuse its memory.
    between: Vec<usize>,
}

impl<Q, H> GatherPlan<Q, H> {
    /// A plan for units of `sizes` gathered bytes, within `budget` bytes, `depth` ahead.
    pub(crate) fn new(sizes: Vec<u64>, budget: u64, depth: usize) -> Self {
        let n = sizes.len();
        GatherPlan {
            sizes,
            budget,
            depth,
            uses: Vec::with_capacity(2 * n),
            queued: VecDeque::new(),
            held: Vec::new(),
            between: Vec::with_capacity(2 * n),
        }
    }

    /// Starts a training step's passes: forward through `calls` (the unit of each call, a
    /// unit possibly used more than once: a tied root), then backward through them in
    /// reverse, once for each of `micro` microbatches (ACC-1), so that gathers are planned
    /// and units kept across a microbatch's end as within one. A gather carried over from
    /// the previous step (ENG-6) stays queued; nothing is held across steps.
    pub(crate) fn begin_step(&mut self, calls: &[usize], micro: usize) {
        let pass = calls.iter().chain(calls.iter().rev()).copied();
        let uses: Vec<usize> = std::iter::repeat_n(pass, micro.max(1)).flatten().collect();
        self.begin(uses.into_iter());
    }

    /// Starts an evaluation pass: forward through `calls`.
    pub(crate) fn begin_eval(&mut self, calls: &[usize]) {
        self.begin(calls.iter().copied());
    }

    fn begin(&mut self, uses: impl Iterator<Item = usize>) {
        self.uses.clear();
        self.uses.extend(uses);
        self.held.clear();
    }

    /// The unit of use `i`.
    pub(crate) fn unit_at(&self, i: usize) -> usize {
        self.uses[i]
    }

    /// Queues `unit`'s gather for the next pass (ENG-6: unit 0's, right after its update).
    pub(crate) fn carry(&mut self, unit: usize, pending: Q) {
        self.queued.push_back((unit, pending));
    }

    /// Drops every queued gather and held unit (ENG-6: the parameters they carry were
    /// replaced, or the engine shuts down).
    pub(crate) fn discard(&mut self) {
        self.queued.clear();
        self.held.clear();
    }

    /// [`GatherPlan::discard`], handing every queued gather (waited for) and held unit back
    /// through `io`, so that whoever allocated them frees them.
    pub(crate) fn discard_with<G: GatherIo<Pending = Q, Full = H>>(
        &mut self,
        io: &mut G,
    ) -> std::result::Result<(), G::Error> {
        while let Some((u, q)) = self.queued.pop_front() {
            let h = io.wait(u, q)?;
            io.release(h);
        }
        for (_, h) in self.held.drain(..) {
            io.release(h);
        }
        Ok(())
    }

    /// The units whose gathers are queued, in issue order.
    #[cfg(test)]
    pub(crate) fn queued_units(&self) -> Vec<usize> {
        self.queued.iter().map(|(u, _)| *u).collect()
    }

    fn is_queued(&self, unit: usize) -> bool {
        self.queued.iter().any(|(u, _)| *u == unit)
    }

    fn is_held(&self, unit: usize) -> bool {
        self.held.iter().any(|(u, _)| *u == unit)
    }

    /// Bytes of gathered parameters resident or in flight: queued gathers, held units and
    /// `current`, the unit in use (ENG-5).
    pub(crate) fn resident_bytes(&self, current: Option<usize>) -> u64 {
        let queued: u64 = self.queued.iter().map(|(u, _)| self.sizes[*u]).sum();
        let held: u64 = self.held.iter().map(|(u, _)| self.sizes[*u]).sum();
        queued + held + current.map_or(0, |u| self.sizes[u])
    }

    /// The next gather to issue so that the next `depth` distinct units used from
    /// `uses[from]` on (other than `current`, the unit in use) are queued or held, within
    /// the budget (ENG-5); `None` when there is none to issue now. Units already queued or
    /// held count towards the depth without a new gather.
    pub(crate) fn next_gather(
        &self,
        from: usize,
        current: Option<usize>,
        depth: usize,
    ) -> Option<usize> {
        let mut counted = 0;
        for i in from..self.uses.len() {
            if counted >= depth {
                return None;
            }
            let u = self.uses[i];
            if Some(u) == current || self.uses[from..i].contains(&u) {
                continue;
            }
            counted += 1;
            if self.is_queued(u) || self.is_held(u) {
                continue;
            }
            let resident = self.resident_bytes(current);
            if resident > 0 && resident + self.sizes[u] > self.budget {
                return None;
            }
            return Some(u);
        }
        None
    }

    fn fill<G>(
        &mut self,
        from: usize,
        current: Option<usize>,
        depth: usize,
        io: &mut G,
    ) -> std::result::Result<(), G::Error>
    where
        G: GatherIo<Pending = Q, Full = H>,
    {
        while let Some(u) = self.next_gather(from, current, depth) {
            let q = io.issue(u)?;
            self.queued.push_back((u, q));
        }
        Ok(())
    }

    /// The gathered parameters for use `i`: held from an earlier use, or gathered (issued
    /// now unless queued). The next uses' gathers go out before the wait, so the gather lane
    /// never idles while this rank waits.
    pub(crate) fn acquire<G>(&mut self, i: usize, io: &mut G) -> std::result::Result<H, G::Error>
    where
        G: GatherIo<Pending = Q, Full = H>,
    {
        let u = self.uses[i];
        let k = self.depth;
        if let Some(pos) = self.held.iter().position(|(h, _)| *h == u) {
            let (_, h) = self.held.swap_remove(pos);
            self.fill(i + 1, Some(u), k, io)?;
            return Ok(h);
        }
        self.fill(i, None, 1 + k, io)?;
        let q = match self.queued.iter().position(|(q, _)| *q == u) {
            Some(pos) => self.queued.remove(pos).map(|(_, q)| q),
            None => None,
        };
        let q = match q {
            Some(q) => q,
            None => io.issue(u)?,
        };
        let h = io.wait(u, q)?;
        self.fill(i + 1, Some(u), k, io)?;
        Ok(h)
    }

    /// Whether the unit of use `i` is used again later in the pass (HPZ-2).
    pub(crate) fn used_again(&self, i: usize) -> bool {
        self.uses[i + 1..].contains(&self.uses[i])
    }

    /// Whether the unit of use `i` is kept after it: it is used again, and it, the units
    /// used in between and the units already held fit the budget together (ENG-5).
    pub(crate) fn keeps(&mut self, i: usize) -> bool {
        let u = self.uses[i];
        let Some(j) = self.uses[i + 1..].iter().position(|&v| v == u).map(|k| i + 1 + k) else {
            return false;
        };
        self.between.clear();
        self.between.extend_from_slice(&self.uses[i + 1..j]);
        self.between.sort_unstable();
        self.between.dedup();
        let held: u64 = self.held.iter().map(|(h, _)| self.sizes[*h]).sum();
        let need = held + self.sizes[u] + self.between.iter().map(|&v| self.sizes[v]).sum::<u64>();
        need <= self.budget
    }

    /// After use `i`: keeps the unit's gathered parameters for its next use when
    /// [`GatherPlan::keeps`] says so, frees them otherwise.
    pub(crate) fn done_with<G>(&mut self, i: usize, full: H, io: &mut G)
    where
        G: GatherIo<Pending = Q, Full = H>,
    {
        if self.keeps(i) {
            self.held.push((self.uses[i], full));
        } else {
            io.release(full);
        }
    }

    /// Ends a pass: frees whatever is still held (every unit's last use frees it, so this
    /// finds nothing unless a pass ends early).
    pub(crate) fn end_pass<G>(&mut self, io: &mut G)
    where
        G: GatherIo<Pending = Q, Full = H>,
    {
        for (_, h) in self.held.drain(..) {
            io.release(h);
        }
    }
}

/// ENG-6: whether updating `unit` issues the next pass's first gather (unit 0's, at a stage
/// that gathers before use, with prefetch).
pub(crate) fn carries_next_gather(before_use: BeforeUse, prefetch: usize, unit: usize) -> bool {
    unit == 0 && before_use == BeforeUse::Gather && prefetch > 0
}

/// A unit's gather in flight on the gather lane, its bytes counted (ENG-3).
pub(crate) struct PendingGather {
    work: Work<Vec<f32>>,
    alloc: Allocation,
    /// The buffer holds packed bf16 slots, upcast on arrival (PREC-3).
    packed: bool,
}

/// A unit's gathered parameters, counted until freed (ENG-3).
pub(crate) struct Gathered {
    /// The full padded parameters.
    pub(crate) full: Vec<f32>,
    _alloc: Allocation,
}

impl Gathered {
    /// Parameters `full`, whose bytes `alloc` counts.
    pub(crate) fn new(full: Vec<f32>, alloc: Allocation) -> Self {
        Gathered { full, _alloc: alloc }
    }

    /// Gives the buffer back to `pool`, its registration dropped first so that the pool's
    /// account never counts it twice (MEM-5).
    pub(crate) fn give_back(self, pool: &shardline_collectives::BufferPool) {
        let Gathered { full, _alloc } = self;
        drop(_alloc);
        pool.give(full);
    }
}

/// The engine's [`GatherIo`]: in-place all-gathers of the shards on the gather lane, buffers
/// from the communicator's pool, counted by the memory tracker, waited on with the step's
/// clock.
pub(crate) struct LaneGathers<'a> {
    /// The world rank (the trace's row).
    pub(crate) rank: usize,
    /// The rank's index in its shard group: the shard it holds (HSDP-2).
    pub(crate) shard_rank: usize,
    pub(crate) layout: &'a ShardedModelLayout,
    /// This rank's parameter shards, per unit.
    pub(crate) shards: &'a [Vec<f32>],
    pub(crate) comm: &'a Communicator,
    pub(crate) lane: &'a Lane,
    pub(crate) mem: &'a MemoryTracker,
    pub(crate) trace: &'a Trace,
    pub(crate) labels: &'a [String],
    pub(crate) clock: &'a mut CommClock,
    /// Gather packed bf16 (PREC-3) or quantized (QGATHER-1); `None`: `f32`.
    pub(crate) wire: Option<Wire>,
    /// The step's conversion time.
    pub(crate) cast: &'a std::cell::Cell<std::time::Duration>,
    /// Each unit's own packed shard, kept until its update (QGATHER-2).
    pub(crate) own_packed: &'a mut OwnPacked,
    /// The rank's secondary group and its gather lane (HPZ-1), with secondary shards.
    pub(crate) hpz: Option<(Secondary, &'a Lane)>,
    /// The secondary pieces held: a unit's gather reads its piece where one is (HPZ-2).
    pub(crate) pieces: &'a Pieces,
}

impl GatherIo for LaneGathers<'_> {
    type Pending = PendingGather;
    type Full = Gathered;
    type Error = RuntimeError;

    fn issue(&mut self, unit: usize) -> Result<PendingGather> {
        let l = self.layout.unit(unit);
        // HPZ-2: a unit used earlier in the step is gathered from the secondary pieces, over
        // the secondary group alone; the pieces are f32 copies of the unit as it was used
        // (decoded, where the gathers are packed: HPZ-5), so this gather is never packed.
        if let (Some((sec, lane)), Some(piece)) = (self.hpz, self.pieces.get(unit)) {
            let mut full = self.comm.pool().take(l.padded_numel());
            let cap = full.capacity();
            let alloc = self.mem.alloc_f32(Category::GatheredUnits, cap, &self.labels[unit])?;
            full[sec.own_piece(l.padded_numel())].copy_from_slice(piece);
            let work = lane.all_gather_in_place(full);
            return Ok(PendingGather { work, alloc, packed: false });
        }
        if let Some(wire) = self.wire {
            // PREC-3, QGATHER-1: the own shard rounded or quantized into its packed slot; the
            // packed buffer is a communication buffer until the unit is decoded on arrival.
            let slots = Slots::on(l, self.layout.world(), wire);
            let what = format!("{} (packed gather)", self.labels[unit]);
            let alloc = self.mem.alloc_f32(Category::CommBuffers, slots.len(), &what)?;
            let t0 = Instant::now();
            let mut packed = self.comm.pool().take(slots.len());
            let (shard, label) = (&self.shards[unit], &self.labels[unit][..]);
            self.own_packed.fill(
                unit,
                &slots,
                self.shard_rank,
                shard,
                &mut packed,
                (label, self.mem),
            )?;
            self.cast.set(self.cast.get() + t0.elapsed());
            let work = self.lane.all_gather_in_place(packed);
            return Ok(PendingGather { work, alloc, packed: true });
        }
        // Taken from the pool before it is registered, so that it is never counted twice
        // (MEM-5). In place: the own shard goes straight into its slot of the gathered
        // buffer, with no separate input to copy from.
        let mut full = self.comm.pool().take(l.padded_numel());
        // Its capacity: a kept buffer may be longer than asked for.
        let alloc =
            self.mem.alloc_f32(Category::GatheredUnits, full.capacity(), &self.labels[unit])?;
        full[l.shard_range(self.shard_rank)].copy_from_slice(&self.shards[unit]);
        let work = self.lane.all_gather_in_place(full);
        Ok(PendingGather { work, alloc, packed: false })
    }

    fn wait(&mut self, unit: usize, p: PendingGather) -> Result<Gathered> {
        let what = format!("gather {}", self.labels[unit]);
        let buf = self.clock.wait(self.trace, self.rank, p.work, Row::Gather, &what)?;
        if !p.packed {
            return Ok(Gathered { full: buf, _alloc: p.alloc });
        }
        // PREC-3: upcast once per gathered unit, into the f32 buffer the kernels read.
        let l = self.layout.unit(unit);
        let alloc =
            self.mem.alloc_f32(Category::GatheredUnits, l.padded_numel(), &self.labels[unit])?;
        let t0 = Instant::now();
        let mut full = self.comm.pool().take(l.padded_numel());
        let wire = self.wire.unwrap_or(Wire::Bf16);
        Slots::on(l, self.layout.world(), wire).unpack_all(&buf, &mut full, None);
        self.cast.set(self.cast.get() + t0.elapsed());
        self.comm.pool().give(buf);
        drop(p.alloc);
        Ok(Gathered { full, _alloc: alloc })
    }

    fn release(&mut self, g: Gathered) {
        g.give_back(self.comm.pool());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recording [`GatherIo`]: gathers and gathered units are unit numbers.
    #[derive(Default)]
    struct Log {
        events: Vec<String>,
    }

    impl GatherIo for Log {
        type Pending = usize;
        type Full = usize;
        type Error = ();
        fn issue(&mut self, unit: usize) -> std::result::Result<usize, ()> {
            self.events.push(format!("issue {unit}"));
            Ok(unit)
        }
        fn wait(&mut self, unit: usize, p: usize) -> std::result::Result<usize, ()> {
            assert_eq!(unit, p);
            self.events.push(format!("wait {unit}"));
            Ok(unit)
        }
        fn release(&mut self, full: usize) {
            self.events.push(format!("free {full}"));
        }
    }

    /// Runs a training pass; returns the log, the largest resident bytes seen while a unit
    /// was in use, and the largest besides the unit in use.
    fn step_pass(sizes: &[u64], budget: u64, depth: usize) -> (Vec<String>, u64, u64) {
        let mut plan: GatherPlan<usize, usize> = GatherPlan::new(sizes.to_vec(), budget, depth);
        let mut io = Log::default();
        let (mut peak, mut others) = (0, 0);
        plan.begin_step(&(0..sizes.len()).collect::<Vec<_>>(), 1);
        for i in 0..2 * sizes.len() {
            let g = plan.acquire(i, &mut io).unwrap();
            assert_eq!(g, plan.unit_at(i));
            let resident = plan.resident_bytes(Some(g));
            (peak, others) = (peak.max(resident), others.max(resident - sizes[g]));
            io.events.push(format!("use {g}"));
            plan.done_with(i, g, &mut io);
        }
        plan.end_pass(&mut io);
        assert!(plan.queued.is_empty() && plan.held.is_empty(), "nothing outlives the pass");
        (io.events, peak, others)
    }

    /// ENG-5: with prefetch 0 only the head is kept from forward into backward; with
    /// prefetch 1 the last block too, and each use's gather goes out before the wait for the
    /// one in use; the budget is never exceeded.
    #[test]
    fn eng5_the_plan_keeps_what_fits_and_gathers_ahead_within_the_budget() {
        let sizes = [4, 4, 4, 1]; // three blocks and a small head
        let (log0, peak0, _) = step_pass(&sizes, 4, 0);
        let gathers0 = log0.iter().filter(|e| e.starts_with("issue")).count();
        assert_eq!(gathers0, 7, "the head is used twice and gathered once: {log0:?}");
        assert!(peak0 <= 4 + 1, "{peak0}");
        let (log1, peak1, _) = step_pass(&sizes, 8, 1);
        let gathers1 = log1.iter().filter(|e| e.starts_with("issue")).count();
        assert_eq!(gathers1, 6, "the head and the last block are kept: {log1:?}");
        assert!(peak1 <= 8, "{peak1}");
        let at = |e: &str| log1.iter().position(|x| x == e).unwrap();
        assert!(at("issue 1") < at("wait 0"), "prefetch 1 issues unit 1 before waiting for 0");
        // The one unit needed now is always gathered, whatever the budget.
        let (log, _, _) = step_pass(&[8, 8], 1, 2);
        assert_eq!(log.iter().filter(|e| e.starts_with("use")).count(), 4);
    }

    /// ENG-5, with random sizes, budgets and depths: besides the unit in use (always
    /// gathered), resident bytes never exceed the budget; every use gets its own unit.
    #[test]
    fn eng5_resident_bytes_stay_within_the_budget() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for _ in 0..300 {
            let n = 1 + next(6) as usize;
            let sizes: Vec<u64> = (0..n).map(|_| 1 + next(9)).collect();
            let budget = next(30);
            let depth = next(4) as usize;
            let (log, _, others) = step_pass(&sizes, budget, depth);
            assert!(others <= budget, "{sizes:?} budget {budget} depth {depth}: {others}");
            let uses: Vec<String> = log.iter().filter(|e| e.starts_with("use")).cloned().collect();
            let want: Vec<String> =
                (0..n).chain((0..n).rev()).map(|u| format!("use {u}")).collect();
            assert_eq!(uses, want);
        }
    }

    /// ENG-6: a carried gather serves the next pass's first use without a new issue; a
    /// discard drops it.
    #[test]
    fn eng6_a_carried_gather_serves_the_next_pass_and_a_discard_drops_it() {
        let mut plan: GatherPlan<usize, usize> = GatherPlan::new(vec![2, 2], 4, 1);
        let mut io = Log::default();
        plan.carry(0, 0);
        plan.begin_eval(&[0, 1]);
        assert_eq!(plan.acquire(0, &mut io), Ok(0));
        assert_eq!(io.events, vec!["issue 1", "wait 0"], "unit 0's gather was already out");
        plan.carry(0, 0);
        plan.discard();
        assert!(plan.queued_units().is_empty());
    }
}
