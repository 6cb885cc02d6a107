//! One rank's training steps on a simulated clock: the engine's own cores driven by costs
//! instead of kernels and collectives.
//!
//! [`SimRank`] walks each step with the engine's `walk_step` (ENG-12), gathers through the
//! engine's `GatherPlan` (ENG-5, ENG-6) and reduces through its `Reductions` (ENG-7,
//! ENG-8, ENG-10); what it adds is time and bytes. Three resources: the rank's own thread
//! (compute, and the waits), the gather lane and the reduce lane, each lane running its ops
//! one after another in issue order. An op issued at `t` starts when its lane is free and
//! takes its profiled cost; waiting for it moves the rank's clock to its end, the difference
//! being exposed communication. Memory is the engine's accounting (ENG-3) by category:
//! persistent state as the stage's rules hold it, transient full gradients from a unit's
//! first backward call until its reduction is finished, gathered units from issue to
//! release, each in the buffer the communicator's pool would hand out (its `Shelves`, on
//! sizes), and the pool's kept bytes as communication buffers. Every rank is assumed to run the same schedule (the same shard sizes; collectives
//! cost the slowest rank's time, which the profile measured).
//!
//! Invariants:
//! - PLAN-3: the simulated gathered-unit bytes never exceed the prefetch budget besides the
//!   unit in use (the plan's ENG-5 on a clock), and with free communication nothing is
//!   exposed: the step takes its compute.
//! - PLAN-4: a step's time is its compute plus its exposed communication.
//! - PLAN-11: a step's timeline is its figures: its compute spans add up to its compute,
//!   its `wait` spans to its exposed communication, its gather and reduce rows to the lanes'
//!   busy time.
//! - PLAN-6: with late reductions (none done before the walk waits for it) the gradients
//!   in flight are the most the reduce budget allows (ENG-7), never below those of any
//!   clock.
//! - PLAN-16: issuing a before-use gather costs the rank its own work, the shard's copy into
//!   the gathered buffer (`LaneGathers::issue`), on its compute, once per gather issued.

use std::cell::Cell;
use std::convert::Infallible;
use std::rc::Rc;

use shardline_collectives::pool::{Shelved, Shelves};

use crate::engine::sim_api::{
    carries_next_gather, walk_step, BeforeUse, GatherIo, GatherPlan, HandOff, Holding, InFlight,
    Micro, Recompute, ReduceIo, Reduction, Reductions, StageRules, StepWork, Walk,
};
use crate::memory::Category;
use crate::shard::ShardedModelLayout;
use crate::telemetry::{Event, Row};

use super::cost::{CallCosts, Parts};

/// Seconds each collective of a step costs on the profiled machine.
#[derive(Clone, Debug, Default)]
pub struct CommCosts {
    /// Per unit, its parameters' all-gather (stage 3 per use; stages 1 and 2 after the
    /// update).
    pub gather_s: Vec<f64>,
    /// Per unit, its gradients' reduction (all-reduce at stage 0, reduce-scatter otherwise).
    pub reduce_s: Vec<f64>,
    /// The step's (loss, norm, stop) all-reduce, waited for at once.
    pub loss_s: f64,
    /// Per unit, the rank's own work to issue its before-use gather: its shard copied into
    /// the gathered buffer (PLAN-16). Missing units cost nothing.
    pub issue_s: Vec<f64>,
}

/// Bytes by category, now and at their peak (MEM-1, MEM-3).
#[derive(Clone, Debug, Default)]
pub struct SimMemory {
    current: [u64; crate::memory::N_CATEGORIES],
    peak: [u64; crate::memory::N_CATEGORIES],
    total: u64,
    peak_total: u64,
}

fn idx(c: Category) -> usize {
    Category::ALL.iter().position(|&k| k == c).unwrap_or(0)
}

impl SimMemory {
    fn alloc(&mut self, c: Category, bytes: u64) {
        let i = idx(c);
        self.current[i] += bytes;
        self.peak[i] = self.peak[i].max(self.current[i]);
        self.total += bytes;
        self.peak_total = self.peak_total.max(self.total);
    }

    fn free(&mut self, c: Category, bytes: u64) {
        self.current[idx(c)] -= bytes;
        self.total -= bytes;
    }

    /// A category's peak.
    pub fn peak(&self, c: Category) -> u64 {
        self.peak[idx(c)]
    }

    /// The peak of the total.
    pub fn peak_total(&self) -> u64 {
        self.peak_total
    }
}

/// A buffer's length and capacity, in `f32` elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SimBuf {
    len: usize,
    cap: usize,
}

impl Shelved for SimBuf {
    fn shelved_len(&self) -> usize {
        self.len
    }
    fn shelved_capacity(&self) -> usize {
        self.cap
    }
}

/// The rank's accounted memory and the communicator's buffer pool, whose kept bytes are
/// communication buffers (MEM-5): the engine's takes and gives on sizes alone, under the
/// pool's own rules (POOL-1..3).
#[derive(Debug)]
struct Heap {
    mem: SimMemory,
    pool: Shelves<SimBuf>,
}

impl Heap {
    fn new() -> Self {
        let pool = Shelves::new(
            shardline_collectives::config::POOL_MAX_BYTES.get(),
            shardline_collectives::config::POOL_PER_CLASS.get() as usize,
        );
        Heap { mem: SimMemory::default(), pool }
    }

    /// The pool's kept bytes moved from `before`: communication buffers follow.
    fn sync(&mut self, before: u64) {
        let after = self.pool.bytes();
        if after > before {
            self.mem.alloc(Category::CommBuffers, after - before);
        } else {
            self.mem.free(Category::CommBuffers, before - after);
        }
    }

    /// A buffer of `len` from the pool (a kept one, or a new one of exactly `len`), then
    /// counted as `cat` by its capacity, as the engine registers it.
    fn take(&mut self, len: usize, cat: Category) -> SimBuf {
        let before = self.pool.bytes();
        let cap = self.pool.take(len).map_or(len.max(1), |b| b.cap);
        self.sync(before);
        self.mem.alloc(cat, cap as u64 * 4);
        SimBuf { len, cap }
    }

    /// Unregisters `b` from `cat`, then gives it back to the pool.
    fn give(&mut self, b: SimBuf, cat: Category) {
        self.mem.free(cat, b.cap as u64 * 4);
        let before = self.pool.bytes();
        let _ = self.pool.give(b, |_| true);
        self.sync(before);
    }
}

/// The simulated clock: the rank's time and when each lane is next free, and the spans it
/// ran, in the engine's trace rows (`telemetry::Row`).
#[derive(Debug, Default)]
struct Clock {
    spans: Vec<Event>,
    /// The rank's own time, shared with the reductions in flight (`is_done` reads it).
    now: Rc<Cell<f64>>,
    gather_free: f64,
    reduce_free: f64,
    compute: f64,
    /// The part of `compute` spent issuing gathers (PLAN-16).
    issue: f64,
    exposed: f64,
    gather_busy: f64,
    reduce_busy: f64,
}

impl Clock {
    fn now(&self) -> f64 {
        self.now.get()
    }

    fn span(&mut self, row: Row, name: String, start: f64, dur: f64) {
        if dur <= 0.0 {
            return; // free (world 1): nothing to draw
        }
        let (start_us, dur_us) = (start * 1e6, dur * 1e6);
        let (process_cpu_ms, bytes) = (None, None);
        self.spans.push(Event { name, rank: 0, row, start_us, dur_us, process_cpu_ms, bytes });
    }

    fn compute(&mut self, s: f64, name: impl FnOnce() -> String) {
        if s > 0.0 {
            self.span(Row::Compute, name(), self.now(), s);
        }
        self.compute += s;
        self.now.set(self.now() + s);
    }

    /// Waits until `end`; the time blocked is exposed communication (a `wait` span on the
    /// compute row, as the engine's clock records it).
    fn wait(&mut self, end: f64, what: impl FnOnce() -> String) {
        let now = self.now();
        if end > now {
            self.span(Row::Compute, format!("wait {}", what()), now, end - now);
            self.exposed += end - now;
            self.now.set(end);
        }
    }

    /// Queues an op of `s` seconds on the gather lane; returns when it ends.
    fn on_gather(&mut self, s: f64, what: String) -> f64 {
        let end = self.now().max(self.gather_free) + s;
        self.span(Row::Gather, what, end - s, s);
        self.gather_free = end;
        self.gather_busy += s;
        end
    }

    fn on_reduce(&mut self, s: f64, what: String) -> f64 {
        let end = self.now().max(self.reduce_free) + s;
        self.span(Row::Reduce, what, end - s, s);
        self.reduce_free = end;
        self.reduce_busy += s;
        end
    }
}

/// A unit's gather in flight: when it ends and its buffer.
#[derive(Debug)]
pub(crate) struct SimGather {
    end: f64,
    buf: SimBuf,
}

/// A unit's gathered parameters: their buffer.
#[derive(Debug)]
pub(crate) struct SimFull {
    buf: SimBuf,
}

/// A reduction in flight: when it ends, the rank's clock it is compared with, the full
/// gradient it holds (stages 2 and 3) and the buffer its result lands in when it adds to an
/// earlier microbatch's (ACC-3).
pub(crate) struct SimOp {
    end: f64,
    now: Rc<Cell<f64>>,
    full: Option<SimBuf>,
    out: Option<SimBuf>,
    /// Never done before it is waited for (PLAN-6's bound).
    late: bool,
}

impl InFlight for SimOp {
    fn is_done(&self) -> bool {
        !self.late && self.end <= self.now.get()
    }
}

/// The plan's [`GatherIo`] on the clock: a gather occupies the gather lane for its cost; its
/// bytes are gathered units from issue to release.
struct SimGathers<'a> {
    clock: &'a mut Clock,
    heap: &'a mut Heap,
    /// Per unit, its padded length.
    lens: &'a [usize],
    cost: &'a [f64],
    /// Per unit, the rank's own work to issue it (PLAN-16).
    issue: &'a [f64],
    names: &'a [String],
}

impl GatherIo for SimGathers<'_> {
    type Pending = SimGather;
    type Full = SimFull;
    type Error = Infallible;

    fn issue(&mut self, unit: usize) -> Result<SimGather, Infallible> {
        let buf = self.heap.take(self.lens[unit], Category::GatheredUnits);
        // PLAN-16: the own shard into its slot, on the rank's thread, before the lane starts.
        let copy = self.issue.get(unit).copied().unwrap_or(0.0);
        self.clock.compute(copy, || format!("issue {}", self.names[unit]));
        self.clock.issue += copy;
        let what = format!("all-gather {}", self.names[unit]);
        Ok(SimGather { end: self.clock.on_gather(self.cost[unit], what), buf })
    }

    fn wait(&mut self, unit: usize, p: SimGather) -> Result<SimFull, Infallible> {
        self.clock.wait(p.end, || format!("all-gather {}", self.names[unit]));
        Ok(SimFull { buf: p.buf })
    }

    fn release(&mut self, full: SimFull) {
        self.heap.give(full.buf, Category::GatheredUnits);
    }
}

/// What a simulated step took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SimStep {
    /// Wall time of the step.
    pub step_s: f64,
    /// The rank's compute.
    pub compute_s: f64,
    /// Time the gather lane was busy with the step's gathers.
    pub gather_s: f64,
    /// Time the reduce lane was busy with the step's reductions and loss all-reduce.
    pub reduce_s: f64,
    /// Time the rank waited for communication.
    pub exposed_s: f64,
    /// The calls' compute by what it is.
    pub parts: Parts,
    /// The updates' compute.
    pub update_s: f64,
    /// The compute spent issuing gathers (PLAN-16).
    pub issue_s: f64,
}

/// One rank, stepping on the simulated clock.
pub struct SimRank<'a> {
    calls: &'a [usize],
    rules: &'static StageRules,
    prefetch: usize,
    recompute: Recompute,
    costs: &'a CallCosts,
    comm: &'a CommCosts,
    /// Per unit, its padded buffer's length.
    lens: Vec<usize>,
    /// Per unit, its shard's length.
    shard_lens: Vec<usize>,
    /// Per unit, its name.
    names: Vec<String>,
    plan: GatherPlan<SimGather, SimFull>,
    clock: Clock,
    heap: Heap,
    /// Per unit, a full gradient held between backward calls or microbatches.
    partial: Vec<Option<SimBuf>>,
    /// Reductions are done only when waited for.
    late: bool,
    walk: WalkConfig,
    /// The calls' compute so far by what it is, and the updates'.
    parts: Parts,
    updates: f64,
}

/// The walk's settings, kept apart from the calls it borrows.
#[derive(Clone, Copy, Debug)]
pub struct WalkConfig {
    /// Microbatches per step.
    pub micro: usize,
    /// When the microbatches' gradients are reduced.
    pub accum: crate::engine::AccumReduce,
    /// Most bytes of unreduced gradients in flight.
    pub reduce_budget: u64,
    /// Gradient clipping.
    pub clip: bool,
}

impl<'a> SimRank<'a> {
    /// A rank of `layout` at `stage`'s rules, its persistent state allocated as the engine's
    /// shard state allocates it (ENG-3).
    pub fn new(
        layout: &ShardedModelLayout,
        calls: &'a [usize],
        engine: &crate::engine::EngineConfig,
        costs: &'a CallCosts,
        comm: &'a CommCosts,
    ) -> Self {
        let rules = StageRules::of(engine.stage);
        let lens: Vec<usize> = layout.units().iter().map(|l| l.padded_numel()).collect();
        let mut heap = Heap::new();
        let k = engine.optimizer.state_len_per_param() as u64;
        let pcat = match rules.params {
            Holding::Full => Category::FullParams,
            Holding::Shard => Category::ShardParams,
        };
        for l in layout.units() {
            heap.mem.alloc(pcat, rules.params.len(l) as u64 * 4);
            heap.mem.alloc(Category::Grads, rules.grads.len(l) as u64 * 4);
            heap.mem.alloc(Category::OptimizerState, rules.optim_state.len(l) as u64 * 4 * k);
        }
        let sizes = lens.iter().map(|&n| n as u64 * 4).collect();
        let plan = GatherPlan::new(sizes, engine.prefetch_budget_bytes, engine.prefetch);
        SimRank {
            calls,
            rules,
            prefetch: engine.prefetch,
            recompute: engine.recompute,
            costs,
            comm,
            partial: vec![None; lens.len()],
            late: false,
            shard_lens: layout.units().iter().map(|l| l.shard_len()).collect(),
            names: layout.units().iter().map(|l| l.name().to_string()).collect(),
            lens,
            plan,
            clock: Clock::default(),
            heap,
            walk: WalkConfig {
                micro: engine.grad_accum.max(1),
                accum: engine.accum_reduce,
                reduce_budget: engine.reduce_budget_bytes,
                clip: engine.clip_grad_norm.is_some(),
            },
            parts: Parts::default(),
            updates: 0.0,
        }
    }

    /// From now on no reduction is done before the walk waits for it: the most full
    /// gradients the reduce budget lets be in flight (ENG-7), what a rank holds when its
    /// reduce lane falls behind its backward (PLAN-6).
    pub fn late_reductions(mut self) -> Self {
        self.late = true;
        self
    }

    /// The memory accounted so far.
    pub fn memory(&self) -> &SimMemory {
        &self.heap.mem
    }

    /// The spans of the steps so far from `t0` seconds on, shifted to start there, as the
    /// engine's trace records them (rank 0).
    pub fn timeline_since(&self, t0: f64) -> Vec<Event> {
        let t0_us = t0 * 1e6;
        let keep = self.clock.spans.iter().filter(|e| e.start_us + 1e-9 >= t0_us);
        keep.map(|e| Event { start_us: e.start_us - t0_us, ..e.clone() }).collect()
    }

    /// The rank's time, seconds since its first step began.
    pub fn now(&self) -> f64 {
        self.clock.now()
    }

    /// Runs one step (ENG-12) and returns its figures.
    pub fn step(&mut self) -> SimStep {
        let t0 = self.clock.now();
        let before = (self.clock.compute, self.clock.exposed, self.clock.issue);
        let (parts, updates) = (self.parts, self.updates);
        let busy = (self.clock.gather_busy, self.clock.reduce_busy);
        self.plan.begin_step(self.calls, self.walk.micro);
        let calls = self.calls;
        let walk = Walk {
            calls,
            units: self.lens.len(),
            micro: self.walk.micro,
            transient_grads: self.rules.transient_grads(),
            accum: self.walk.accum,
            recompute: self.recompute,
            reduce_budget: self.walk.reduce_budget,
            clip: self.walk.clip,
            gather_after_update: self.rules.gather_after_update,
            // The plan prices a run without live recovery.
            commit: false,
        };
        let Ok(()) = walk_step(&walk, self);
        SimStep {
            step_s: self.clock.now() - t0,
            compute_s: self.clock.compute - before.0,
            gather_s: self.clock.gather_busy - busy.0,
            reduce_s: self.clock.reduce_busy - busy.1,
            exposed_s: self.clock.exposed - before.1,
            parts: Parts {
                products_s: self.parts.products_s - parts.products_s,
                elementwise_s: self.parts.elementwise_s - parts.elementwise_s,
                alloc_s: self.parts.alloc_s - parts.alloc_s,
                lanes_s: self.parts.lanes_s - parts.lanes_s,
            },
            update_s: self.updates - updates,
            issue_s: self.clock.issue - before.2,
        }
    }

    fn gathers(&mut self) -> (&mut GatherPlan<SimGather, SimFull>, SimGathers<'_>) {
        let io = SimGathers {
            clock: &mut self.clock,
            heap: &mut self.heap,
            lens: &self.lens,
            cost: &self.comm.gather_s,
            issue: &self.comm.issue_s,
            names: &self.names,
        };
        (&mut self.plan, io)
    }

    /// Use `i`'s gathered unit, at a stage that gathers before use (ENG-5).
    fn acquire(&mut self, i: usize) -> Option<SimFull> {
        if self.rules.before_use != BeforeUse::Gather {
            return None;
        }
        let (plan, mut io) = self.gathers();
        let Ok(full) = plan.acquire(i, &mut io);
        Some(full)
    }

    fn done_with(&mut self, i: usize, full: Option<SimFull>) {
        if let Some(f) = full {
            let (plan, mut io) = self.gathers();
            plan.done_with(i, f, &mut io);
        }
    }
}

impl ReduceIo<SimOp> for SimRank<'_> {
    type Error = Infallible;

    fn finish(&mut self, r: Reduction<SimOp>) -> Result<(), Infallible> {
        let name = &self.names[r.unit];
        self.clock.wait(r.work.end, || format!("reduce {name}"));
        // The full gradient, then the result's buffer, back to the pool (MEM-5).
        if let Some(b) = r.work.full {
            self.heap.give(b, Category::Grads);
        }
        if let Some(b) = r.work.out {
            self.heap.give(b, Category::CommBuffers);
        }
        Ok(())
    }

    fn update(&mut self, unit: usize) -> Result<(), Infallible> {
        let name = &self.names[unit];
        self.updates += self.costs.update_s[unit];
        self.clock.compute(self.costs.update_s[unit], || format!("update {name}"));
        // ENG-6: unit 0's gather for the next pass leaves right after its update.
        if carries_next_gather(self.rules.before_use, self.prefetch, unit) {
            let (plan, mut io) = self.gathers();
            let Ok(p) = io.issue(0);
            plan.carry(0, p);
        }
        Ok(())
    }
}

impl StepWork for SimRank<'_> {
    type Op = SimOp;

    fn forward(&mut self, i: usize, call: usize, _mb: Micro, _cp: bool) -> Result<(), Infallible> {
        let full = self.acquire(i);
        let name = &self.names[self.calls[call]];
        let c = self.costs.calls[call];
        self.parts.add(&c.forward);
        self.clock.compute(c.forward_s(), || format!("forward {name}"));
        self.done_with(i, full);
        Ok(())
    }

    fn loss(&mut self, _mb: Micro) -> Result<(), Infallible> {
        Ok(())
    }

    fn backward(
        &mut self,
        i: usize,
        call: usize,
        _mb: Micro,
        hand: HandOff,
        reds: &mut Reductions<SimOp>,
    ) -> Result<(), Infallible> {
        let u = self.calls[call];
        let full = self.acquire(i);
        let name = self.names[u].clone();
        if self.recompute.checkpoints(call, self.calls.len()) {
            // RECOMP-1
            let c = self.costs.calls[call];
            self.parts.add(&c.forward);
            self.clock.compute(c.forward_s(), || format!("recompute {name}"));
        }
        // A transient full gradient exists from the unit's first backward call until its
        // reduction is finished (ENG-7), in a pooled buffer.
        let transient = self.rules.transient_grads();
        let grad = match self.partial[u].take() {
            Some(b) => Some(b),
            None if transient => Some(self.heap.take(self.lens[u], Category::Grads)),
            None => None,
        };
        let c = self.costs.calls[call];
        self.parts.add(&c.grads);
        self.clock.compute(c.grads_s(), || format!("backward {name}"));
        if hand.reduce {
            // ACC-3: a result added to an earlier microbatch's arrives in a pooled buffer.
            let out = (transient && hand.add)
                .then(|| self.heap.take(self.shard_lens[u], Category::CommBuffers));
            let end = self.clock.on_reduce(self.comm.reduce_s[u], format!("reduce {name}"));
            let unreduced = grad.map_or(0, |b| b.cap as u64 * 4);
            let now = Rc::clone(&self.clock.now);
            let late = self.late;
            reds.issue(u, unreduced, SimOp { end, now, full: grad, out, late });
        } else {
            // Held for a later call or microbatch (a kept buffer at stages 0 and 1).
            self.partial[u] = grad.or(Some(SimBuf { len: 0, cap: 0 }));
        }
        // ENG-9: after the hand-off
        self.parts.add(&c.input_grad);
        self.clock.compute(c.input_grad_s(), || format!("input grad {name}"));
        self.done_with(i, full);
        Ok(())
    }

    fn end_passes(&mut self) -> Result<(), Infallible> {
        let (plan, mut io) = self.gathers();
        plan.end_pass(&mut io);
        Ok(())
    }

    fn begin_updates(&mut self) -> Result<(), Infallible> {
        Ok(())
    }

    fn loss_and_norm(&mut self) -> Result<(), Infallible> {
        let end = self.clock.on_reduce(self.comm.loss_s, "loss+norm".into());
        self.clock.wait(end, || "loss+norm".into());
        Ok(())
    }

    fn end_updates(&mut self) -> Result<(), Infallible> {
        Ok(())
    }

    fn gather_updated(&mut self) -> Result<(), Infallible> {
        let ends: Vec<f64> = (0..self.lens.len())
            .map(|u| {
                let what = format!("all-gather {}", self.names[u]);
                self.clock.on_gather(self.comm.gather_s[u], what)
            })
            .collect();
        for (u, e) in ends.into_iter().enumerate() {
            self.clock.wait(e, || format!("all-gather {}", self.names[u]));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::plan::cost::CallCost;
    use crate::shard::Stage;
    use shardline_models::{ModelSpec, ParamSpec, UnitSpec};

    fn layout(sizes: &[usize], world: usize) -> ShardedModelLayout {
        let units = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| UnitSpec {
                name: format!("u{i}"),
                params: vec![ParamSpec { name: format!("u{i}.w"), shape: vec![n] }],
                buffers: vec![],
            })
            .collect();
        ShardedModelLayout::new(&ModelSpec { name: "m".into(), units }, world).unwrap()
    }

    fn engine(stage: Stage, prefetch: usize, unit_bytes: u64) -> EngineConfig {
        EngineConfig {
            stage,
            prefetch,
            prefetch_budget_bytes: unit_bytes * (prefetch as u64 + 1),
            reduce_budget_bytes: 2 * unit_bytes,
            sync_bn: false,
            optimizer: crate::optim::Optimizer::Sgd(crate::optim::SgdConfig::default()),
            weight_decay_on: crate::optim::WeightDecayOn::All,
            lr: crate::schedule::LrSchedule::constant(0.1),
            clip_grad_norm: None,
            seed: 0,
            threads: 1,
            device: crate::engine::Device::Cpu,
            grad_accum: 1,
            accum_reduce: crate::engine::AccumReduce::Each,
            recompute: Recompute::None,
            precision: crate::engine::MixedPrecision::default(),
            shard_group: crate::engine::ShardGroup::World,
            cross_node_reduce: None,
            reshard_after_forward: crate::engine::ReshardAfterForward::World,
        }
    }

    fn costs(n: usize, compute: f64) -> CallCosts {
        let p = Parts { products_s: compute, ..Parts::default() };
        let c = CallCost { forward: p, grads: p, input_grad: p };
        CallCosts { calls: vec![c; n], update_s: vec![compute / 10.0; n], flops: (0.0, 0.0) }
    }

    /// PLAN-6: late reductions hold at least the gradients of any clock, and at stage 3
    /// the reduce budget's two largest units and the one being computed at most.
    #[test]
    fn late_reductions_bound_the_gradients_in_flight_plan_6() {
        let l = layout(&[1000, 3000, 2000, 500], 2);
        let calls: Vec<usize> = (0..4).collect();
        let c = costs(4, 1e-3);
        let unit = 3000 * 4;
        for reduce in [0.0, 5e-4, 5e-3] {
            let comm = CommCosts {
                gather_s: vec![1e-4; 4],
                reduce_s: vec![reduce; 4],
                loss_s: 0.0,
                ..Default::default()
            };
            let e = engine(Stage::Zero3, 1, unit);
            let mut timed = SimRank::new(&l, &calls, &e, &c, &comm);
            let mut late = SimRank::new(&l, &calls, &e, &c, &comm).late_reductions();
            for _ in 0..2 {
                timed.step();
                late.step();
            }
            let (t, b) =
                (timed.memory().peak(Category::Grads), late.memory().peak(Category::Grads));
            let shards: u64 = [1000u64, 3000, 2000, 500].iter().map(|n| n / 2 * 4).sum();
            assert!(t <= b, "reduce {reduce}: {t} > {b}");
            assert!(b <= shards + 3 * unit, "{b}");
        }
    }

    /// PLAN-3, PLAN-4: with free communication a step is its compute and nothing is
    /// exposed; with costly gathers, prefetch hides part of them; gathered bytes besides the
    /// unit in use stay within the budget.
    #[test]
    fn the_clock_hides_what_prefetch_overlaps_plan_3_plan_4() {
        let l = layout(&[1000; 4], 2);
        let calls: Vec<usize> = (0..4).collect();
        let c = costs(4, 1e-3);
        let free = CommCosts {
            gather_s: vec![0.0; 4],
            reduce_s: vec![0.0; 4],
            loss_s: 0.0,
            ..Default::default()
        };
        for stage in Stage::ALL {
            let mut r = SimRank::new(&l, &calls, &engine(stage, 1, 4000), &c, &free);
            let s = r.step();
            assert_eq!(s.exposed_s, 0.0, "{stage:?}");
            assert!((s.step_s - s.compute_s).abs() < 1e-12, "{stage:?}");
        }
        let slow = CommCosts {
            gather_s: vec![2e-3; 4],
            reduce_s: vec![1e-3; 4],
            loss_s: 1e-4,
            ..Default::default()
        };
        let step = |prefetch| {
            let mut r = SimRank::new(&l, &calls, &engine(Stage::Zero3, prefetch, 4000), &c, &slow);
            r.step();
            let s = r.step();
            assert!((s.step_s - s.compute_s - s.exposed_s).abs() < 1e-12);
            (s, r.memory().peak(Category::GatheredUnits))
        };
        let ((s0, g0), (s1, g1)) = (step(0), step(1));
        assert!(s1.exposed_s < s0.exposed_s, "{s0:?} {s1:?}");
        // ENG-5: besides the unit in use, within the budget of (prefetch + 1) units.
        assert!(g0 <= 4000 + 4000 && g1 <= 4000 * 2 + 4000, "{g0} {g1}");
        assert!(g1 > g0, "prefetch holds more gathered bytes: {g0} {g1}");
    }

    /// PLAN-16: each before-use gather issued costs the rank its shard's copy on its
    /// compute, once per gather on the gather lane; stages that gather after the update
    /// (in place) or not at all pay nothing.
    #[test]
    fn issuing_a_gather_costs_the_shard_copy_plan_16() {
        let l = layout(&[1000, 3000, 2000], 2);
        let calls: Vec<usize> = (0..3).collect();
        let c = costs(3, 1e-3);
        let base = CommCosts {
            gather_s: vec![2e-4; 3],
            reduce_s: vec![1e-4; 3],
            loss_s: 1e-5,
            ..Default::default()
        };
        let copying = CommCosts { issue_s: vec![1e-5, 3e-5, 2e-5], ..base.clone() };
        for stage in Stage::ALL {
            let run = |comm: &CommCosts| {
                let mut r = SimRank::new(&l, &calls, &engine(stage, 1, 12000), &c, comm);
                r.step();
                let t0 = r.now();
                (r.step(), r.timeline_since(t0))
            };
            let ((without, _), (with, spans)) = (run(&base), run(&copying));
            let issued: f64 = spans
                .iter()
                .filter(|e| e.row == Row::Compute && e.name.starts_with("issue "))
                .map(|e| copying.issue_s[e.name[7..].parse::<usize>().unwrap()])
                .sum();
            let gathers = spans.iter().filter(|e| e.row == Row::Gather).count();
            assert!((with.issue_s - issued).abs() < 1e-12, "{stage:?}");
            assert!((with.compute_s - without.compute_s - with.issue_s).abs() < 1e-12);
            if stage == Stage::Zero3 {
                let issues = spans.iter().filter(|e| e.name.starts_with("issue ")).count();
                assert!(issues > 0 && issues == gathers, "{issues} issues, {gathers} gathers");
            } else {
                assert_eq!(with.issue_s, 0.0, "{stage:?}: no gather issued before use");
            }
        }
    }

    /// PLAN-11: the steady step's spans add up to its figures, row by row.
    #[test]
    fn the_timeline_adds_up_to_the_step_plan_11() {
        let l = layout(&[1000, 3000, 2000], 2);
        let calls: Vec<usize> = (0..3).collect();
        let c = costs(3, 1e-3);
        let comm = CommCosts {
            gather_s: vec![2e-3; 3],
            reduce_s: vec![1e-3; 3],
            loss_s: 1e-4,
            ..Default::default()
        };
        for stage in Stage::ALL {
            let mut r = SimRank::new(&l, &calls, &engine(stage, 1, 12000), &c, &comm);
            r.step();
            let t0 = r.now();
            let s = r.step();
            let spans = r.timeline_since(t0);
            let sum = |row: Row, wait: bool| -> f64 {
                let of = |e: &&Event| e.row == row && e.name.starts_with("wait ") == wait;
                spans.iter().filter(of).map(|e| e.dur_us * 1e-6).sum()
            };
            assert!((sum(Row::Compute, false) - s.compute_s).abs() < 1e-9, "{stage:?}");
            assert!((sum(Row::Compute, true) - s.exposed_s).abs() < 1e-9, "{stage:?}");
            assert!((sum(Row::Gather, false) - s.gather_s).abs() < 1e-9, "{stage:?}");
            assert!((sum(Row::Reduce, false) - s.reduce_s).abs() < 1e-9, "{stage:?}");
            assert!(spans.iter().all(|e| e.start_us >= 0.0), "{stage:?}");
        }
    }
}
