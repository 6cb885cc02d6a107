//! The per-rank training engine: the forward/backward schedule of each ZeRO stage.
//!
//! Stage 3 (FSDP full shard), per step (ARCHITECTURE.md, "Schedule"):
//! - forward, unit i: wait gather(i) -> issue gather(i+1..=i+k) (prefetch depth k, bounded by
//!   a byte budget) -> compute -> free the gathered parameters, unless they are kept for
//!   backward (ENG-5: the head, and with prefetch >= 1 the last block, go from forward
//!   straight into backward, so the first backward gather is not exposed);
//! - backward, unit i (reverse): issue gather(i-1) before computing -> wait gather(i) ->
//!   compute gradients -> free parameters -> issue reduce-scatter(grads i) on the `reduce` lane
//!   and go on without waiting;
//! - optimizer step on the own slices once every reduce-scatter is done.
//!
//! Stage 0 all-reduces each unit's gradients (one bucket per unit) as soon as backward has
//! produced them; stages 1 and 2 reduce-scatter them, step the own slice and all-gather the
//! updated parameters. Gathers, reductions and SyncBN statistics use three separate lanes.
//!
//! Invariants:
//! - ENG-1: the same seed, data and world size give bitwise-identical parameters with any
//!   prefetch depth (prefetch changes when a gather is issued, never what is computed).
//! - ENG-2: the loss reported for a step is the mean over the whole global batch.
//! - ENG-3: every buffer the engine holds is registered with the rank's [`MemoryTracker`].
//! - ENG-4: a step's communication time is the length of the union of the intervals in
//!   which any of its collectives was in flight on this rank (each op's own span on its lane
//!   thread, WORK-1; SyncBN statistics reductions by their blocking call). Exposed
//!   communication is the time the step was blocked waiting, so it never exceeds the
//!   communication time by more than the wake-up latency of a wait.
//! - ENG-5 (stage 3): gathered parameters resident or in flight (queued gathers, units kept
//!   for a later use, the unit in use) never exceed the prefetch byte budget, except that the
//!   unit needed now is always gathered. A unit used again later in the step is kept, not
//!   freed and gathered again, when it, the units used in between and the units already
//!   kept fit the budget together (the head; with prefetch >= 1 also the last block).
//! - ENG-6 (stage 3, prefetch >= 1): unit 0's gather for the next step or evaluation is
//!   issued right after the optimizer has updated unit 0's shard, and discarded when a
//!   checkpoint load replaces the parameters; every rank does the same, so lane order holds.
//! - ENG-9: a unit's gradients go to their reduction as soon as they are complete; where the
//!   unit starts with a linear layer its input gradient is computed afterwards (an
//!   `input grad` span), overlapping the reduction, and the first unit's input gradient (the
//!   data's) is never computed. Gradients and results are bitwise unchanged (MODEL-3).
//! - ENG-10 (no clipping): updates run lowest unit first among those whose reduction is in,
//!   so unit 0's, which releases the next pass's first gather (ENG-6), never waits for
//!   another unit's; the reported loss and norm are bitwise those of any other order.
//!
//! Trace rows: `compute` holds the compute spans and the blocking `wait ...` spans (what
//! the rank's own thread does); `gather` and `reduce` hold each collective's span on its
//! lane; `stats` the SyncBN reductions.

use crate::error::{Result, RuntimeError};
use crate::memory::{Allocation, Category, MemoryTracker};
use crate::optim::{self, Optimizer};
use crate::schedule::LrSchedule;
use crate::shard::{ShardedModelLayout, Stage};
use crate::telemetry::{Row, Trace};
use shardline_collectives::{Communicator, Lane, ReduceOp, Work};
use shardline_models::{
    softmax_cross_entropy, Backend, CountingReducer, Cpu, Ctx, Dataset, DistributedSampler,
    LaneReducer, Model, StatsReducer, Tensor, UnitSaved,
};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// ENG-10: the unit to update next, the lowest one not yet updated whose reduction is in
/// (`waiting` lists those still in flight); `None` when every such unit is done.
fn next_update(stepped: &[bool], waiting: &[usize]) -> Option<usize> {
    (0..stepped.len()).find(|u| !stepped[*u] && !waiting.contains(u))
}

/// Lane names.
pub const GATHER_LANE: &str = "gather";
/// Lane of gradient reductions.
pub const REDUCE_LANE: &str = "reduce";

/// What the engine needs to know about the run.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// ZeRO stage.
    pub stage: Stage,
    /// How many units ahead to gather (stage 3). 0 disables prefetch.
    pub prefetch: usize,
    /// Most bytes of gathered parameters in flight or held at once (stage 3); the current
    /// unit is always allowed.
    pub prefetch_budget_bytes: u64,
    /// Stages 2 and 3: most bytes of full, not yet reduced unit gradients in flight at once
    /// (the unit just computed always counts). When backward outruns the reductions, the
    /// oldest is waited for, so peak memory stays model state + gathered units + this budget
    /// (ENG-7). Two units' worth lets one reduction overlap the next unit's backward.
    pub reduce_budget_bytes: u64,
    /// Treat every BatchNorm as SyncBatchNorm.
    pub sync_bn: bool,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Learning-rate schedule.
    pub lr: LrSchedule,
    /// Clip the global gradient norm to this value.
    pub clip_grad_norm: Option<f64>,
    /// Parameter-init seed.
    pub seed: u64,
    /// Threads per rank for compute kernels (CPU backend).
    pub threads: usize,
    /// Where the kernels run.
    pub device: Device,
}

/// Where a rank's kernels run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Device {
    /// The CPU backend (`gemm`).
    #[default]
    Cpu,
    /// The CUDA backend on this GPU ordinal (feature `cuda`): cuBLAS matrix multiplies and
    /// NVRTC kernels, operands staged from the host buffers the engine keeps (the shards,
    /// the optimizer and the collectives stay on the host).
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Opens the compute backend of `device`: a GPU that is absent (or a build without the
/// `cuda` feature) is [`RuntimeError::DeviceUnavailable`], never a panic.
pub fn open_backend(device: Device, threads: usize) -> Result<Box<dyn Backend>> {
    match device {
        Device::Cpu => {
            Ok(Box::new(if threads > 1 { Cpu::with_threads(threads) } else { Cpu::new() }))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => shardline_models::cuda::Cuda::open(ordinal)
            .map(|c| Box::new(c) as Box<dyn Backend>)
            .map_err(|e| match e {
                shardline_models::ModelError::DeviceUnavailable(what) => {
                    RuntimeError::DeviceUnavailable(what)
                }
                other => RuntimeError::DeviceUnavailable(other.to_string()),
            }),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(RuntimeError::DeviceUnavailable(
            "this build has no CUDA backend (cargo build -p shardline-runtime --features cuda)"
                .into(),
        )),
    }
}

/// Figures of one step on one rank.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    /// Mean loss over the global batch (identical on every rank, ENG-2).
    pub loss: f32,
    /// Learning rate used.
    pub lr: f32,
    /// Wall time of the step.
    pub step_time: Duration,
    /// Time spent computing (forward, backward, optimizer).
    pub compute_time: Duration,
    /// Time spent blocked waiting for communication (exposed communication).
    pub comm_exposed: Duration,
    /// Time in which any collective of the step was in flight on this rank, overlapped or
    /// not (ENG-4).
    pub comm_time: Duration,
    /// Peak tracked bytes of this rank so far.
    pub peak_bytes: u64,
    /// SyncBatchNorm statistics messages this step.
    pub stats_messages: usize,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Some rank asked to stop ([`RankEngine::request_stop`]) before this step's loss
    /// reduction: every rank learns it from the same reduction, so all stop after this step
    /// (INT-1).
    pub stop: bool,
}

impl PendingReduce {
    fn unit(&self) -> usize {
        match self {
            PendingReduce::AllReduce { unit, .. }
            | PendingReduce::ReduceScatterInPlace { unit, .. }
            | PendingReduce::ReduceScatter { unit, .. } => *unit,
        }
    }

    fn is_done(&self) -> bool {
        match self {
            PendingReduce::AllReduce { work, .. }
            | PendingReduce::ReduceScatterInPlace { work, .. } => work.is_done(),
            PendingReduce::ReduceScatter { work, .. } => work.is_done(),
        }
    }
}

/// A step's communication bookkeeping: blocked time and the spans of its collectives.
#[derive(Default)]
struct CommClock {
    exposed: Duration,
    spans: Vec<(Instant, Instant)>,
}

/// Length of the union of `spans` (ENG-4).
fn union_len(spans: &mut [(Instant, Instant)]) -> Duration {
    spans.sort_by_key(|s| s.0);
    let mut total = Duration::ZERO;
    let mut cur: Option<(Instant, Instant)> = None;
    for &(a, b) in spans.iter() {
        match &mut cur {
            Some((_, e)) if a <= *e => *e = (*e).max(b),
            _ => {
                if let Some((s, e)) = cur {
                    total += e - s;
                }
                cur = Some((a, b));
            }
        }
    }
    if let Some((s, e)) = cur {
        total += e - s;
    }
    total
}

struct Gathered {
    full: Vec<f32>,
    _alloc: Allocation,
}

/// Stage 3's gathered units over one pass: `uses` lists the units in order of use (a
/// step: forward 0..n, then backward n-1..0).
struct GatherPlan {
    uses: Vec<usize>,
    queue: VecDeque<PendingGather>,
    held: Vec<(usize, Gathered)>,
}

impl GatherPlan {
    fn new(uses: Vec<usize>) -> Self {
        GatherPlan { uses, queue: VecDeque::new(), held: Vec::new() }
    }
}

struct PendingGather {
    unit: usize,
    work: Work<Vec<f32>>,
    alloc: Allocation,
}

enum PendingReduce {
    /// Stage 0: all-reduce of the unit's full gradient (its persistent buffer).
    AllReduce { unit: usize, work: Work<Vec<f32>> },
    /// Stage 1: reduce-scatter in place of the unit's persistent full gradient buffer; the
    /// own slice holds the result.
    ReduceScatterInPlace { unit: usize, work: Work<Vec<f32>> },
    /// Stages 2 and 3: reduce-scatter of the unit's transient full gradient (counted by
    /// `alloc`) into its shard.
    ReduceScatter { unit: usize, work: Work<(Vec<f32>, Vec<f32>)>, alloc: Option<Allocation> },
}

/// Records each SyncBatchNorm statistics reduction on the trace's `stats` row, and its span
/// for the step's communication time.
struct TracedReducer<'a> {
    inner: &'a dyn StatsReducer,
    trace: &'a Trace,
    rank: usize,
    spans: std::sync::Mutex<Vec<(Instant, Instant)>>,
}

impl TracedReducer<'_> {
    fn note(&self, name: &str, t0: Instant) {
        let t1 = Instant::now();
        self.trace.record(self.rank, Row::Stats, name, t0, t1);
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).push((t0, t1));
    }
}

impl StatsReducer for TracedReducer<'_> {
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn reduce_records(
        &self,
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
    ) -> std::result::Result<Vec<f32>, shardline_models::ModelError> {
        let t0 = Instant::now();
        let r = self.inner.reduce_records(buf, record_len, combine);
        self.note("stats forward", t0);
        r
    }
    fn reduce_sum(
        &self,
        buf: Vec<f32>,
    ) -> std::result::Result<Vec<f32>, shardline_models::ModelError> {
        let t0 = Instant::now();
        let r = self.inner.reduce_sum(buf);
        self.note("stats backward", t0);
        r
    }
}

/// One rank's engine: its shard state and the schedule that drives it.
pub struct RankEngine {
    rank: usize,
    world: usize,
    model: Arc<Model>,
    layout: ShardedModelLayout,
    cfg: EngineConfig,
    comm: Communicator,
    gather: Lane,
    reduce: Lane,
    /// Shared so that a step can hold it while the engine's other state changes.
    stats: Arc<LaneReducer>,
    backend: Box<dyn Backend>,
    mem: MemoryTracker,
    trace: Trace,
    /// Stage 0-2: full padded flat parameters per unit; stage 3: this rank's shard.
    params: Vec<Vec<f32>>,
    /// Stage 0/1: full padded gradients; stage 2/3: this rank's shard.
    grads: Vec<Vec<f32>>,
    /// Optimizer state: full (stage 0) or shard (1-3), `k` values per element.
    optim_state: Vec<Vec<f32>>,
    /// Replicated BatchNorm buffers per unit.
    buffers: Vec<Vec<f32>>,
    step: u64,
    _persistent: Vec<Allocation>,
    /// Fault injection points (`--fault`), none in a normal run.
    fault_hook: Option<crate::fault::FaultHook>,
    /// This rank asks the group to stop after the current step (INT-1).
    stop_requested: bool,
    /// Stage 3, prefetch >= 1: the first unit's gather for the next pass, issued as soon as
    /// the optimizer has updated its shard (ENG-6).
    prefetched: Option<PendingGather>,
}

/// The size of a finished collective's whole buffer, for the trace (what the op moved, in the
/// units the benchmarks count wire bytes in).
trait OpBytes {
    fn op_bytes(&self) -> u64;
}

impl OpBytes for Vec<f32> {
    fn op_bytes(&self) -> u64 {
        self.len() as u64 * 4
    }
}

/// An out-of-place reduce-scatter's `(full input, own shard)`: the op is the size of the input.
impl OpBytes for (Vec<f32>, Vec<f32>) {
    fn op_bytes(&self) -> u64 {
        self.0.op_bytes()
    }
}

fn unit_label(model: &Model, u: usize) -> String {
    model.unit_name(u)
}

impl RankEngine {
    /// Builds the rank's state: initial parameters (the same on every rank, from the seed),
    /// sharded as the stage says, and opens the lanes (collective: every rank calls it).
    pub fn new(
        comm: Communicator,
        model: Arc<Model>,
        cfg: EngineConfig,
        mem: MemoryTracker,
        trace: Trace,
    ) -> Result<Self> {
        let rank = comm.rank();
        let world = comm.world();
        let spec = model.spec();
        let layout = ShardedModelLayout::new(&spec, world)?;
        let gather = comm.lane(GATHER_LANE)?;
        let reduce = comm.lane(REDUCE_LANE)?;
        let stats = Arc::new(LaneReducer::stats_lane(&comm).map_err(RuntimeError::from_model)?);
        let k = cfg.optimizer.state_len_per_param();
        let mut persistent = Vec::new();
        let mut params = Vec::new();
        let mut grads = Vec::new();
        let mut optim_state = Vec::new();
        let mut buffers = Vec::new();
        for u in 0..layout.units().len() {
            let l = layout.unit(u);
            let name = unit_label(&model, u);
            let init = model.init_params(u, cfg.seed).map_err(RuntimeError::from_model)?;
            let mut full = vec![0.0f32; l.padded_numel()];
            full[..init.len()].copy_from_slice(&init);
            let (p, pcat) = if cfg.stage.keeps_full_params() {
                (full, Category::FullParams)
            } else {
                (full[l.shard_range(rank)].to_vec(), Category::ShardParams)
            };
            persistent.push(mem.alloc_f32(pcat, p.len(), &name)?);
            let glen = match cfg.stage {
                Stage::Zero0 | Stage::Zero1 => l.padded_numel(),
                Stage::Zero2 | Stage::Zero3 => l.shard_len(),
            };
            persistent.push(mem.alloc_f32(Category::Grads, glen, &name)?);
            let slen =
                if cfg.stage.optimizer_sharded() { l.shard_len() } else { l.padded_numel() } * k;
            persistent.push(mem.alloc_f32(Category::OptimizerState, slen, &name)?);
            let b = model.init_buffers(u).map_err(RuntimeError::from_model)?;
            params.push(p);
            grads.push(vec![0.0; glen]);
            optim_state.push(vec![0.0; slen]);
            buffers.push(b);
        }
        let backend = open_backend(cfg.device, cfg.threads)?;
        Ok(RankEngine {
            rank,
            world,
            model,
            layout,
            cfg,
            comm,
            gather,
            reduce,
            stats,
            backend,
            mem,
            trace,
            params,
            grads,
            optim_state,
            buffers,
            step: 0,
            _persistent: persistent,
            prefetched: None,
            fault_hook: None,
            stop_requested: false,
        })
    }

    /// Installs the fault plan's hook, called at each phase of each step.
    pub fn set_fault_hook(&mut self, hook: crate::fault::FaultHook) {
        self.fault_hook = Some(hook);
    }

    /// A fault injection point of the step being run.
    fn fault_point(&self, phase: crate::fault::Phase) {
        if let Some(h) = &self.fault_hook {
            h(self.rank, self.step + 1, phase);
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Optimizer steps taken.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The rank's memory tracker.
    pub fn memory(&self) -> &MemoryTracker {
        &self.mem
    }

    /// The model's sharded layout.
    pub fn layout(&self) -> &ShardedModelLayout {
        &self.layout
    }

    /// The communicator (for aborting from outside).
    pub fn communicator(&self) -> &Communicator {
        &self.comm
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Blocks on `w`: the blocked time is exposed communication (a `wait` span on the compute
    /// row), the op's own span goes on `row` and into the step's communication time.
    fn wait<T: OpBytes>(
        &self,
        w: Work<T>,
        row: Row,
        what: &str,
        clock: &mut CommClock,
    ) -> Result<T> {
        let t0 = Instant::now();
        let (r, span) = w.wait_timed();
        let t1 = Instant::now();
        clock.exposed += t1 - t0;
        if t1 - t0 >= Duration::from_micros(1) {
            self.trace.record(self.rank, Row::Compute, format!("wait {what}"), t0, t1);
        }
        let r = r?;
        if let Some((a, b)) = span {
            self.trace.record_op(self.rank, row, what, (a, b), r.op_bytes());
            clock.spans.push((a, b));
        }
        Ok(r)
    }

    fn issue_gather(&self, unit: usize) -> Result<PendingGather> {
        let l = self.layout.unit(unit);
        let alloc = self.mem.alloc_f32(
            Category::GatheredUnits,
            l.padded_numel(),
            &unit_label(&self.model, unit),
        )?;
        // In place: the own shard goes straight into its slot of the gathered buffer, with no
        // separate input to copy from.
        let mut full = self.comm.pool().take(l.padded_numel());
        full[l.shard_range(self.rank)].copy_from_slice(&self.params[unit]);
        let work = self.gather.all_gather_in_place(full);
        Ok(PendingGather { unit, work, alloc })
    }

    fn gathered_bytes(&self, unit: usize) -> u64 {
        self.layout.unit(unit).padded_numel() as u64 * 4
    }

    /// Bytes of gathered parameters resident or in flight: queued gathers, held units and
    /// the unit in use.
    fn resident_bytes(&self, plan: &GatherPlan, current: Option<usize>) -> u64 {
        let queued: u64 = plan.queue.iter().map(|p| self.gathered_bytes(p.unit)).sum();
        let held: u64 = plan.held.iter().map(|(u, _)| self.gathered_bytes(*u)).sum();
        queued + held + current.map_or(0, |u| self.gathered_bytes(u))
    }

    /// Issues gathers for the next `depth` distinct units used from `plan.uses[from]` on
    /// (other than `current`, the unit in use), within the byte budget (ENG-5). Units
    /// already queued or held count towards the depth without a new gather.
    fn fill_gathers(
        &self,
        plan: &mut GatherPlan,
        from: usize,
        current: Option<usize>,
        depth: usize,
    ) -> Result<()> {
        let mut counted: Vec<usize> = Vec::with_capacity(depth);
        for i in from..plan.uses.len() {
            let u = plan.uses[i];
            if counted.len() >= depth {
                break;
            }
            if Some(u) == current || counted.contains(&u) {
                continue;
            }
            counted.push(u);
            if plan.queue.iter().any(|p| p.unit == u) || plan.held.iter().any(|(h, _)| *h == u) {
                continue;
            }
            let resident = self.resident_bytes(plan, current);
            if resident > 0 && resident + self.gathered_bytes(u) > self.cfg.prefetch_budget_bytes {
                break;
            }
            plan.queue.push_back(self.issue_gather(u)?);
        }
        Ok(())
    }

    /// The gathered parameters for use `i` of the plan: held from an earlier use, or
    /// gathered (issued now unless prefetched). The next uses' gathers go out before the
    /// wait, so the gather lane never idles while this rank waits.
    fn acquire(&self, plan: &mut GatherPlan, i: usize, clock: &mut CommClock) -> Result<Gathered> {
        let u = plan.uses[i];
        let k = self.cfg.prefetch;
        if let Some(pos) = plan.held.iter().position(|(h, _)| *h == u) {
            let (_, g) = plan.held.swap_remove(pos);
            self.fill_gathers(plan, i + 1, Some(u), k)?;
            return Ok(g);
        }
        self.fill_gathers(plan, i, None, 1 + k)?;
        let g = self.take_gathered(&mut plan.queue, u, clock)?;
        self.fill_gathers(plan, i + 1, Some(u), k)?;
        Ok(g)
    }

    /// After use `i`: keeps the unit's gathered parameters when it is used again and they,
    /// the units used in between and the other held units fit the budget together (ENG-5);
    /// frees them otherwise.
    fn done_with(&self, plan: &mut GatherPlan, i: usize, g: Gathered) {
        let u = plan.uses[i];
        if let Some(j) = plan.uses[i + 1..].iter().position(|&v| v == u).map(|k| i + 1 + k) {
            let mut between: Vec<usize> = plan.uses[i + 1..j].to_vec();
            between.sort_unstable();
            between.dedup();
            let held: u64 = plan.held.iter().map(|(h, _)| self.gathered_bytes(*h)).sum();
            let need = held
                + self.gathered_bytes(u)
                + between.iter().map(|&v| self.gathered_bytes(v)).sum::<u64>();
            if need <= self.cfg.prefetch_budget_bytes {
                plan.held.push((u, g));
                return;
            }
        }
        self.release(g);
    }

    fn take_gathered(
        &self,
        queue: &mut VecDeque<PendingGather>,
        unit: usize,
        clock: &mut CommClock,
    ) -> Result<Gathered> {
        let pos = queue.iter().position(|p| p.unit == unit);
        let p = match pos {
            Some(i) => queue.remove(i).ok_or_else(|| RuntimeError::config("gather queue"))?,
            None => self.issue_gather(unit)?,
        };
        let label = unit_label(&self.model, unit);
        let full = self.wait(p.work, Row::Gather, &format!("gather {label}"), clock)?;
        Ok(Gathered { full, _alloc: p.alloc })
    }

    fn release(&self, g: Gathered) {
        self.comm.pool().give(g.full);
    }

    /// One training step on this rank's slice `x`/`y` of a global batch of `global_batch`
    /// samples. Every rank of the group must call it with its own slice (possibly empty).
    pub fn train_step(&mut self, x: Tensor, y: &[u32], global_batch: usize) -> Result<StepStats> {
        let t_step = Instant::now();
        let mut clock = CommClock::default();
        let mut compute = Duration::ZERO;
        let n_units = self.layout.units().len();
        let stage = self.cfg.stage;
        let (stats, trace) = (Arc::clone(&self.stats), self.trace.clone());
        let traced = TracedReducer {
            inner: &*stats,
            trace: &trace,
            rank: self.rank,
            spans: std::sync::Mutex::default(),
        };
        let counting = CountingReducer::new(&traced as &dyn StatsReducer);
        let reducer: Option<&dyn StatsReducer> =
            if self.world > 1 { Some(&counting) } else { None };
        let model = Arc::clone(&self.model);

        // ---- forward ----
        let mut saved: Vec<UnitSaved> = Vec::with_capacity(n_units);
        let mut act_allocs = Vec::with_capacity(n_units);
        let mut plan = GatherPlan::new((0..n_units).chain((0..n_units).rev()).collect());
        plan.queue.extend(self.prefetched.take());
        let mut xin = x;
        self.fault_point(crate::fault::Phase::Forward);
        for u in 0..n_units {
            let label = unit_label(&model, u);
            let gathered = if stage.gathers_params_per_unit() {
                Some(self.acquire(&mut plan, u, &mut clock)?)
            } else {
                None
            };
            let numel = self.layout.unit(u).numel();
            let t0 = Instant::now();
            let ctx = Ctx {
                training: true,
                sync_bn: self.cfg.sync_bn,
                reducer,
                global_batch,
                backend: &*self.backend,
                overwrite_grads: false,
            };
            let params: &[f32] = match &gathered {
                Some(g) => &g.full[..numel],
                None => &self.params[u][..numel],
            };
            let (yout, s) = model
                .forward_unit(u, params, &mut self.buffers[u], xin, &ctx)
                .map_err(RuntimeError::from_model)?;
            let t1 = Instant::now();
            compute += t1 - t0;
            self.trace.record(self.rank, Row::Compute, format!("forward {label}"), t0, t1);
            act_allocs.push(self.mem.alloc_f32(Category::Activations, yout.data.len(), &label)?);
            if let Some(g) = gathered {
                self.done_with(&mut plan, u, g);
            }
            saved.push(s);
            xin = yout;
        }
        let t0 = Instant::now();
        let (local_loss, mut grad) =
            softmax_cross_entropy(&xin, y, global_batch).map_err(RuntimeError::from_model)?;
        compute += t0.elapsed();

        // ---- backward ----
        let mut pending: VecDeque<PendingReduce> = VecDeque::with_capacity(n_units);
        let mut unit_sq = vec![0.0f64; n_units];
        // ENG-8: without clipping no unit's update depends on the global norm, so each unit
        // is stepped as soon as its reduction is in, overlapping the reductions still in
        // flight, and its squared norm comes out of the update's own pass (OPT-4); with
        // clipping the norms are taken as the reductions come in and the updates wait.
        let early = self.cfg.clip_grad_norm.is_none();
        for u in (0..n_units).rev() {
            let label = unit_label(&model, u);
            // Backward prefetch: the previous units' gathers go out before computing.
            let gathered = if stage.gathers_params_per_unit() {
                Some(self.acquire(&mut plan, 2 * n_units - 1 - u, &mut clock)?)
            } else {
                None
            };
            let l = self.layout.unit(u);
            let (numel, padded) = (l.numel(), l.padded_numel());
            // Stages 0 and 1 keep a full gradient buffer: backward writes into it and the
            // collective reduces it in place of a second copy. Stages 2 and 3 hold a unit's
            // full gradient only until its reduce-scatter is done.
            let (galloc, mut gfull) = if stage.keeps_full_grads() {
                (None, std::mem::take(&mut self.grads[u]))
            } else {
                let a =
                    self.mem.alloc_f32(Category::Grads, padded, &format!("{label} (unreduced)"))?;
                (Some(a), self.comm.pool().take(padded))
            };
            // Backward writes the gradients (no zeroing pass over the buffer first); only the
            // padding, which no layer writes, is cleared.
            gfull[numel..].fill(0.0);
            let t0 = Instant::now();
            let ctx = Ctx {
                training: true,
                sync_bn: self.cfg.sync_bn,
                reducer,
                global_batch,
                backend: &*self.backend,
                overwrite_grads: true,
            };
            let params: &[f32] = match &gathered {
                Some(g) => &g.full[..numel],
                None => &self.params[u][..numel],
            };
            let s = saved
                .pop()
                .ok_or_else(|| RuntimeError::config("saved activations out of order"))?;
            // ENG-9: the first unit's input gradient (of the data) is never computed; where a
            // unit starts with a linear layer its input gradient is computed after the
            // unit's gradients have gone to their reduction, which it then overlaps.
            let input_grad = model
                .backward_unit_split(u, params, &s, grad, &mut gfull[..numel], &ctx, u > 0)
                .map_err(RuntimeError::from_model)?;
            drop(s);
            act_allocs.pop();
            let t1 = Instant::now();
            compute += t1 - t0;
            self.trace.record(self.rank, Row::Compute, format!("backward {label}"), t0, t1);
            // Reduce as soon as the unit's gradients exist; do not wait (overlap).
            let p = if stage == Stage::Zero0 {
                PendingReduce::AllReduce {
                    unit: u,
                    work: self.reduce.all_reduce(gfull, ReduceOp::Sum),
                }
            } else if stage == Stage::Zero1 {
                PendingReduce::ReduceScatterInPlace {
                    unit: u,
                    work: self.reduce.reduce_scatter_in_place(gfull, ReduceOp::Sum),
                }
            } else {
                let mut out = self.comm.pool().take(l.shard_len());
                out.resize(l.shard_len(), 0.0);
                PendingReduce::ReduceScatter {
                    unit: u,
                    work: self.reduce.reduce_scatter(gfull, out, ReduceOp::Sum),
                    alloc: galloc,
                }
            };
            pending.push_back(p);
            let deferred = input_grad.is_deferred();
            let t0 = Instant::now();
            grad = input_grad
                .finish(&*self.backend, params)
                .map_err(RuntimeError::from_model)?
                .unwrap_or_default();
            if deferred {
                let t1 = Instant::now();
                compute += t1 - t0;
                self.trace.record(self.rank, Row::Compute, format!("input grad {label}"), t0, t1);
            }
            if let Some(g) = gathered {
                self.done_with(&mut plan, 2 * n_units - 1 - u, g);
            }
            // ENG-7: bound the unreduced gradients in flight (stages 2 and 3 hold them in
            // transient buffers); wait for the oldest when over the budget.
            if matches!(stage, Stage::Zero2 | Stage::Zero3) {
                while pending.len() > 1
                    && self.unreduced_bytes(&pending) > self.cfg.reduce_budget_bytes
                {
                    if let Some(p) = pending.pop_front() {
                        let done = self.finish_reduce(p, &mut clock)?;
                        if !early {
                            compute += self.unit_sq_norm(done, &mut unit_sq);
                        }
                    }
                }
            }
            if u + 1 == n_units {
                self.fault_point(crate::fault::Phase::Backward);
            }
            // Reductions that already finished give their memory back now ("freed as they
            // are reduced"); this never blocks, and when a result is stored does not change
            // what it is.
            while pending.front().is_some_and(PendingReduce::is_done) {
                if let Some(p) = pending.pop_front() {
                    let done = self.finish_reduce(p, &mut clock)?;
                    if !early {
                        compute += self.unit_sq_norm(done, &mut unit_sq);
                    }
                }
            }
        }
        drop(grad);
        // Every unit's last use is in backward: nothing stays held or queued past the step.
        for (_, g) in plan.held.drain(..) {
            self.release(g);
        }
        let stats_messages = counting.messages();

        // ---- wait for the reductions ----
        self.fault_point(crate::fault::Phase::Reduce);
        // Per-unit updates are independent: the result does not depend on the order.
        // The schedule is 0-based (`lr_at(0)` is the first step's rate); the optimizer's step
        // count is 1-based (OPT-3).
        let lr = self.cfg.lr.lr_at(self.step);
        let mut opt_spans: Vec<(Instant, Instant)> = Vec::new();
        if early {
            self.step += 1;
            // ENG-10: lowest unit first among those whose reduction is in. Unit 0's update
            // releases the next pass's first gather (ENG-6), so once its reduction is in it
            // goes before the others, which then run while that gather is on the wire.
            let mut stepped = vec![false; n_units];
            loop {
                while pending.front().is_some_and(PendingReduce::is_done) {
                    if let Some(p) = pending.pop_front() {
                        self.finish_reduce(p, &mut clock)?;
                    }
                }
                let waiting: Vec<usize> = pending.iter().map(PendingReduce::unit).collect();
                match next_update(&stepped, &waiting) {
                    Some(u) => {
                        let (t0, t1, sq) = self.step_unit(u, lr, 1.0)?;
                        stepped[u] = true;
                        unit_sq[u] = sq;
                        opt_spans.push((t0, t1));
                    }
                    None => match pending.pop_front() {
                        Some(p) => self.finish_reduce(p, &mut clock).map(drop)?,
                        None => break,
                    },
                }
            }
        }
        // With clipping, each unit's squared norm is taken as soon as its reduction is in,
        // while the later ones are still in flight (without, `pending` is empty by now).
        for p in pending {
            let done = self.finish_reduce(p, &mut clock)?;
            compute += self.unit_sq_norm(done, &mut unit_sq);
        }

        // ---- loss and gradient norm: one small all-reduce ----
        // Summed in unit order whatever the order of completion (ENG-1).
        let sq: f64 = unit_sq.iter().sum();
        // Waited for at once: a blocking call runs on this thread when the lane is idle.
        let mut now = shardline_collectives::CallOptions::new();
        now.blocking(true);
        // The third value carries this rank's wish to stop (INT-1).
        let stop = if self.stop_requested { 1.0 } else { 0.0 };
        let w = self.reduce.all_reduce_opts(vec![local_loss, sq as f32, stop], ReduceOp::Sum, &now);
        let sums = self.wait(w, Row::Reduce, "loss+norm", &mut clock)?;
        let (loss, total_sq, stop) = (sums[0], sums[1] as f64, sums[2] > 0.0);

        // ---- optimizer on the own slices (with clipping: after the global norm) ----
        if !early {
            let coef = match self.cfg.clip_grad_norm {
                Some(max) => optim::clip_coef(total_sq, max),
                None => 1.0,
            };
            self.step += 1;
            for u in 0..n_units {
                let (t0, t1, _) = self.step_unit(u, lr, coef)?;
                opt_spans.push((t0, t1));
            }
        }
        // Each unit's update is its own span; one `optimizer` mark at the end of the last
        // closes the step on the trace (tools split a rank's trace into steps at it) and
        // carries the process's CPU time (what a step cost the machine's cores).
        let mut last = None::<Instant>;
        for (t0, t1) in opt_spans {
            compute += t1 - t0;
            self.trace.record(self.rank, Row::Compute, "optimizer step", t0, t1);
            last = Some(last.map_or(t1, |l: Instant| l.max(t1)));
        }
        if let Some(end) = last {
            self.trace.mark_cpu(self.rank, Row::Compute, "optimizer", end);
        }

        // ---- stages 1 and 2: all-gather the updated parameters ----
        if matches!(stage, Stage::Zero1 | Stage::Zero2) {
            // In place: the updated own slice already lies in the full buffer.
            let mut works = Vec::with_capacity(n_units);
            for u in 0..n_units {
                let full = std::mem::take(&mut self.params[u]);
                works.push((u, self.gather.all_gather_in_place(full)));
            }
            for (u, work) in works {
                let full = self.wait(
                    work,
                    Row::Gather,
                    &format!("all-gather {}", unit_label(&model, u)),
                    &mut clock,
                )?;
                self.params[u] = full;
            }
        }
        drop(act_allocs);
        Ok(StepStats {
            loss,
            lr,
            step_time: t_step.elapsed(),
            compute_time: compute,
            comm_exposed: clock.exposed,
            comm_time: {
                // A gather prefetched by the previous step counts from this step's start.
                for sp in &mut clock.spans {
                    sp.0 = sp.0.max(t_step);
                    sp.1 = sp.1.max(sp.0);
                }
                union_len(&mut clock.spans)
            },
            peak_bytes: self.mem.peak_total(),
            stats_messages,
            grad_norm: total_sq.sqrt(),
            stop,
        })
    }

    /// Asks every rank to stop after the step in progress or the next one: the wish travels
    /// with the step's loss reduction, so all ranks see it at the same step
    /// ([`StepStats::stop`], INT-1).
    pub fn request_stop(&mut self) {
        self.stop_requested = true;
    }

    /// The squared norm of unit `u`'s reduced own gradient slice into `out[u]`; returns the
    /// time it took.
    fn unit_sq_norm(&self, u: usize, out: &mut [f64]) -> Duration {
        let t0 = Instant::now();
        out[u] = optim::sq_norm(self.own_grads(u));
        t0.elapsed()
    }

    /// Waits for a unit's gradient reduction and stores the result where the optimizer
    /// reads it; returns the unit.
    /// Steps unit `u`'s own slice; returns the span it took. ENG-6: the next pass starts with
    /// unit 0, so its gather leaves right after unit 0 is updated and overlaps the rest of the
    /// step and whatever the caller does between steps.
    /// The span and the squared norm of this rank's own gradient slice (`own_grads`, after
    /// scaling by `coef`), taken in the update's pass where the update reads just that
    /// slice (OPT-4).
    fn step_unit(&mut self, u: usize, lr: f32, coef: f32) -> Result<(Instant, Instant, f64)> {
        let t0 = Instant::now();
        let sq = self.optimizer_step_unit(u, lr, coef)?;
        if u == 0 && self.cfg.stage.gathers_params_per_unit() && self.cfg.prefetch > 0 {
            self.prefetched = Some(self.issue_gather(0)?);
        }
        Ok((t0, Instant::now(), sq))
    }

    /// Bytes of the transient full gradients of the pending reductions.
    fn unreduced_bytes(&self, pending: &VecDeque<PendingReduce>) -> u64 {
        pending
            .iter()
            .map(|p| match p {
                PendingReduce::ReduceScatter { alloc: Some(a), .. } => a.bytes(),
                _ => 0,
            })
            .sum()
    }

    fn finish_reduce(&mut self, p: PendingReduce, clock: &mut CommClock) -> Result<usize> {
        let unit = match p {
            PendingReduce::AllReduce { unit, work } => {
                let what = format!("all-reduce {}", unit_label(&self.model, unit));
                self.grads[unit] = self.wait(work, Row::Reduce, &what, clock)?;
                unit
            }
            PendingReduce::ReduceScatterInPlace { unit, work } => {
                let what = format!("reduce-scatter {}", unit_label(&self.model, unit));
                // The persistent full buffer; its own slice holds the result.
                self.grads[unit] = self.wait(work, Row::Reduce, &what, clock)?;
                unit
            }
            PendingReduce::ReduceScatter { unit, work, alloc } => {
                let what = format!("reduce-scatter {}", unit_label(&self.model, unit));
                let (full, shard) = self.wait(work, Row::Reduce, &what, clock)?;
                let old = std::mem::replace(&mut self.grads[unit], shard);
                self.comm.pool().give(old);
                self.comm.pool().give(full);
                drop(alloc);
                unit
            }
        };
        Ok(unit)
    }

    /// This rank's reduced gradient slice of unit `u` (what its optimizer steps on).
    fn own_grads(&self, u: usize) -> &[f32] {
        match self.cfg.stage {
            Stage::Zero0 => {
                // Every rank holds the full reduced gradient; count each element once globally
                // by taking the own slice only.
                let r = self.layout.unit(u).shard_range(self.rank);
                &self.grads[u][r]
            }
            Stage::Zero1 => {
                let r = self.layout.unit(u).shard_range(self.rank);
                &self.grads[u][r]
            }
            Stage::Zero2 | Stage::Zero3 => &self.grads[u],
        }
    }

    fn optimizer_step_unit(&mut self, u: usize, lr: f32, coef: f32) -> Result<f64> {
        let l = self.layout.unit(u);
        let r = l.shard_range(self.rank);
        let opt = self.cfg.optimizer;
        let step = self.step;
        match self.cfg.stage {
            Stage::Zero0 => {
                if coef != 1.0 {
                    optim::scale(&mut self.grads[u], coef);
                }
                // Every rank steps the whole unit, but the norm counts each element once
                // globally: the own slice only (as `own_grads`).
                opt.step(lr, step, &mut self.params[u], &self.grads[u], &mut self.optim_state[u])?;
                Ok(optim::sq_norm(&self.grads[u][r]))
            }
            Stage::Zero1 => {
                let g = &mut self.grads[u][r.clone()];
                if coef != 1.0 {
                    optim::scale(g, coef);
                }
                opt.step_sq_norm(
                    lr,
                    step,
                    &mut self.params[u][r.clone()],
                    &self.grads[u][r],
                    &mut self.optim_state[u],
                )
            }
            Stage::Zero2 => {
                if coef != 1.0 {
                    optim::scale(&mut self.grads[u], coef);
                }
                opt.step_sq_norm(
                    lr,
                    step,
                    &mut self.params[u][r],
                    &self.grads[u],
                    &mut self.optim_state[u],
                )
            }
            Stage::Zero3 => {
                if coef != 1.0 {
                    optim::scale(&mut self.grads[u], coef);
                }
                opt.step_sq_norm(
                    lr,
                    step,
                    &mut self.params[u],
                    &self.grads[u],
                    &mut self.optim_state[u],
                )
            }
        }
    }

    /// Evaluates this rank's slice in eval mode; returns (correct, count, summed loss over the
    /// slice divided by `global_n`). Collective: every rank calls it.
    pub fn eval(&mut self, x: Tensor, y: &[u32], global_n: usize) -> Result<(u64, u64, f32)> {
        let n_units = self.layout.units().len();
        let model = Arc::clone(&self.model);
        let mut clock = CommClock::default();
        let mut plan = GatherPlan::new((0..n_units).collect());
        plan.queue.extend(self.prefetched.take());
        let mut xin = x;
        for u in 0..n_units {
            let gathered = if self.cfg.stage.gathers_params_per_unit() {
                Some(self.acquire(&mut plan, u, &mut clock)?)
            } else {
                None
            };
            let numel = self.layout.unit(u).numel();
            let ctx = Ctx {
                training: false,
                sync_bn: false,
                reducer: None,
                global_batch: global_n.max(1),
                backend: &*self.backend,
                overwrite_grads: false,
            };
            let params: &[f32] = match &gathered {
                Some(g) => &g.full[..numel],
                None => &self.params[u][..numel],
            };
            let (yout, _) = model
                .forward_unit(u, params, &mut self.buffers[u], xin, &ctx)
                .map_err(RuntimeError::from_model)?;
            if let Some(g) = gathered {
                self.done_with(&mut plan, u, g);
            }
            xin = yout;
        }
        let classes = *xin.shape.last().unwrap_or(&1);
        let mut correct = 0u64;
        for (i, &label) in y.iter().enumerate() {
            let row = &xin.data[i * classes..(i + 1) * classes];
            let mut best = 0;
            for (j, v) in row.iter().enumerate() {
                if *v > row[best] {
                    best = j;
                }
            }
            correct += u64::from(best as u32 == label);
        }
        let (loss, _) = softmax_cross_entropy(&xin, y, global_n.max(y.len()))
            .map_err(RuntimeError::from_model)?;
        let sums = self
            .reduce
            .all_reduce(vec![correct as f32, y.len() as f32, loss], ReduceOp::Sum)
            .wait()?;
        Ok((sums[0] as u64, sums[1] as u64, sums[2]))
    }

    /// Evaluates this rank's share of `test` (its [`DistributedSampler::slice_range`]) in
    /// forwards of at most `batch` samples, so that evaluation never holds more activations
    /// than a training step of that per-rank batch; returns the global (correct, count,
    /// mean loss). Collective: every rank runs the same number of forwards (a rank whose
    /// share is one sample shorter runs an empty last one).
    pub fn eval_set(&mut self, test: &Dataset, batch: usize) -> Result<(u64, u64, f32)> {
        let n = test.len();
        let world = self.layout.world();
        let mine: Vec<usize> = DistributedSampler::slice_range(n, world, self.rank).collect();
        let batch = batch.max(1);
        let forwards = n.div_ceil(world).div_ceil(batch).max(1);
        let (mut correct, mut count, mut loss) = (0u64, 0u64, 0.0f32);
        for k in 0..forwards {
            let idx = &mine[(k * batch).min(mine.len())..((k + 1) * batch).min(mine.len())];
            let (x, y) = test.batch(idx);
            let (c, m, l) = self.eval(x, &y, n)?;
            correct += c;
            count += m;
            loss += l;
        }
        Ok((correct, count, loss))
    }

    /// Full (unpadded) parameters of every unit, gathered if sharded. Collective.
    pub fn full_params(&mut self) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        for u in 0..self.layout.units().len() {
            let l = self.layout.unit(u);
            let full = if self.cfg.stage.keeps_full_params() {
                self.params[u].clone()
            } else {
                let (_, full) = self
                    .gather
                    .all_gather(self.params[u].clone(), vec![0.0; l.padded_numel()])
                    .wait()?;
                full
            };
            out.push(full[..l.numel()].to_vec());
        }
        Ok(out)
    }

    /// Frees the state and returns pooled buffers; later steps fail. Idempotent.
    pub fn shutdown(&mut self) {
        self.prefetched = None;
        self.params.clear();
        self.grads.clear();
        self.optim_state.clear();
        self._persistent.clear();
    }

    /// Replicated buffers (BatchNorm running statistics), per unit.
    pub fn buffers(&self) -> &[Vec<f32>] {
        &self.buffers
    }

    /// This rank's checkpoint content: its parameter and optimizer-state slices per unit.
    pub fn shard_state(&self) -> crate::checkpoint::RankShard {
        use crate::checkpoint::{RankShard, UnitShard};
        let k = self.cfg.optimizer.state_len_per_param();
        let units = (0..self.layout.units().len())
            .map(|u| {
                let r = self.layout.unit(u).shard_range(self.rank);
                let params = if self.cfg.stage.keeps_full_params() {
                    self.params[u][r.clone()].to_vec()
                } else {
                    self.params[u].clone()
                };
                let optim_state = if self.cfg.stage.optimizer_sharded() {
                    self.optim_state[u].clone()
                } else {
                    self.optim_state[u][r.start * k..r.end * k].to_vec()
                };
                UnitShard { params, optim_state }
            })
            .collect();
        RankShard { units }
    }

    /// Restores state from a checkpoint shard written for this world size (resharded by the
    /// loader when it was written for another), the replicated buffers and the step count.
    /// Stages that keep full copies all-gather the slices. Collective.
    pub fn load_state(
        &mut self,
        shard: &crate::checkpoint::RankShard,
        buffers: &[Vec<f32>],
        step: u64,
    ) -> Result<()> {
        // A gather issued before the load carries the old parameters (ENG-6).
        self.prefetched = None;
        let k = self.cfg.optimizer.state_len_per_param();
        if shard.units.len() != self.layout.units().len() || buffers.len() != self.buffers.len() {
            return Err(RuntimeError::config(
                "checkpoint has another number of units than the model",
            ));
        }
        for (u, us) in shard.units.iter().enumerate() {
            let l = self.layout.unit(u);
            if us.params.len() != l.shard_len() || us.optim_state.len() != l.shard_len() * k {
                return Err(RuntimeError::config(format!(
                    "checkpoint shard of unit {} has the wrong size",
                    l.name()
                )));
            }
            if buffers[u].len() != self.buffers[u].len() {
                return Err(RuntimeError::config(format!(
                    "checkpoint buffers of unit {} have the wrong size",
                    l.name()
                )));
            }
            if self.cfg.stage.keeps_full_params() {
                let (_, full) = self
                    .gather
                    .all_gather(us.params.clone(), vec![0.0; l.padded_numel()])
                    .wait()?;
                self.params[u] = full;
            } else {
                self.params[u] = us.params.clone();
            }
            if self.cfg.stage.optimizer_sharded() {
                self.optim_state[u] = us.optim_state.clone();
            } else {
                let (_, full) = self
                    .gather
                    .all_gather(us.optim_state.clone(), vec![0.0; l.padded_numel() * k])
                    .wait()?;
                // The gathered state is rank-major blocks of shard_len*k: the same layout as
                // the full interleaved state, because each rank's block is contiguous.
                self.optim_state[u] = full;
            }
            self.buffers[u].copy_from_slice(&buffers[u]);
        }
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gathers per step on each rank (from the trace, before the final evaluation) and the
    /// peak gathered-unit bytes, for a 4-unit mlp-bn (blocks of 64x64, head 64x10).
    fn gathers_per_step(prefetch: usize) -> (Vec<usize>, u64, u64) {
        use crate::train::{build_model, load_data, run, RunOptions, StageChoice, SyncBnMode};
        let dir = std::env::temp_dir().join(format!("eng5-{}-{prefetch}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let trace = dir.join("t.json");
        let steps = 2;
        let cfg = crate::train::TrainConfig {
            world: 2,
            stage: StageChoice::Fixed(Stage::Zero3),
            model: "mlp-bn".into(),
            dataset: "synthetic".into(),
            input_dim: 64,
            classes: 10,
            samples: 64,
            hidden: Some(64),
            depth: Some(3),
            steps: Some(steps),
            batch_size: 16,
            sync_bn: SyncBnMode::Off,
            prefetch,
            timeout_s: 30,
            ..Default::default()
        };
        let (train_set, _) = load_data(&cfg, false).unwrap();
        let model = build_model(&cfg, &train_set.sample_shape, train_set.classes).unwrap();
        let layout = ShardedModelLayout::new(&model.spec(), 2).unwrap();
        assert_eq!(layout.units().len(), 4);
        let budget = layout.max_unit_padded_numel() as u64 * 4 * (prefetch as u64 + 1);
        let opts = RunOptions { trace: Some(trace.clone()), quiet: true, ..Default::default() };
        let summary = run(cfg, opts).unwrap();
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let evs = doc["traceEvents"].as_array().unwrap();
        // OVL-3's input: every collective span carries its whole buffer's size, a unit's
        // padded size for gathers and reduce-scatters.
        let unit_bytes: Vec<u64> =
            layout.units().iter().map(|u| u.padded_numel() as u64 * 4).collect();
        for e in evs.iter().filter(|e| e["ph"] == "X") {
            let tid = e["tid"].as_u64();
            if tid == Some(Row::Gather as u64)
                || e["name"].as_str().unwrap().starts_with("reduce-scatter")
            {
                let b = e["args"]["bytes"].as_u64().unwrap_or(0);
                assert!(unit_bytes.contains(&b), "{e}: {b} B is no unit's size {unit_bytes:?}");
            }
        }
        // ENG-9: every unit but the first (each starts with a linear layer) computes its
        // input gradient after its backward, in a span of its own; the first unit never does.
        let names: Vec<&str> = evs
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == Row::Compute as u32)
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        for u in 0..layout.units().len() {
            let label = unit_label(&model, u);
            let n = names.iter().filter(|n| **n == format!("input grad {label}")).count();
            let backward = names.iter().filter(|n| **n == format!("backward {label}")).count();
            assert_eq!(backward, 2 * steps as usize, "{label}: one backward per rank and step");
            assert_eq!(n, if u == 0 { 0 } else { backward }, "{label}: input gradient spans");
        }
        let per_rank = (0..2u64)
            .map(|r| {
                let mine = |e: &&serde_json::Value| e["ph"] == "X" && e["pid"].as_u64() == Some(r);
                let end =
                    |e: &serde_json::Value| e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap();
                let last_opt = evs
                    .iter()
                    .filter(mine)
                    .filter(|e| e["name"] == "optimizer")
                    .map(end)
                    .fold(0.0, f64::max);
                let n = evs
                    .iter()
                    .filter(mine)
                    .filter(|e| e["tid"] == Row::Gather as u32 && end(e) <= last_opt)
                    .count();
                n / steps as usize
            })
            .collect();
        let peak = summary.peak_by_category[0]
            .iter()
            .find(|(k, _)| k == "gathered_units")
            .map(|(_, b)| *b)
            .unwrap();
        (per_rank, peak, budget)
    }

    /// ENG-5: the head is kept from forward into backward, and with prefetch 1 the last
    /// block too (block + head fit two blocks' budget), never exceeding the budget; uses per
    /// step are 2 x 4 = 8.
    #[test]
    fn units_used_again_soon_are_kept_within_the_budget() {
        let (p0, peak0, budget0) = gathers_per_step(0);
        assert_eq!(p0, vec![7, 7], "prefetch 0: only the head is kept");
        assert!(peak0 <= budget0, "{peak0} > {budget0}");
        let (p1, peak1, budget1) = gathers_per_step(1);
        assert_eq!(p1, vec![6, 6], "prefetch 1: the head and the last block are kept");
        assert!(peak1 <= budget1, "{peak1} > {budget1}");
    }

    /// A small stage-3 engine configuration with plain SGD on the CPU.
    fn stage3_sgd(prefetch: usize, seed: u64) -> EngineConfig {
        EngineConfig {
            stage: Stage::Zero3,
            prefetch,
            prefetch_budget_bytes: 1 << 20,
            reduce_budget_bytes: 1 << 20,
            sync_bn: false,
            optimizer: Optimizer::Sgd(crate::optim::SgdConfig::default()),
            lr: LrSchedule::constant(0.1),
            clip_grad_norm: None,
            seed,
            threads: 1,
            device: Device::Cpu,
        }
    }

    /// Evaluation in forwards of a few samples gives what one forward over the whole share
    /// gives, on every rank of a world whose shares differ in length (101 samples over 3
    /// ranks: 34, 34, 33, so at batch 1 the last rank runs an empty last forward).
    #[test]
    fn eval_in_batches_matches_one_forward() {
        let test = Dataset::synthetic(101, 8, 3, 5).unwrap();
        let mut m = shardline_models::zoo::MlpBn::digits();
        (m.input_dim, m.hidden, m.depth, m.classes) = (8, 16, 2, 3);
        let model = Arc::new(m.build());
        let comms = shardline_collectives::local_group(3).unwrap();
        let results: Vec<Vec<(u64, u64, f32)>> = std::thread::scope(|sc| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let (model, test) = (Arc::clone(&model), &test);
                    sc.spawn(move || {
                        let cfg = stage3_sgd(1, 3);
                        let mem = MemoryTracker::new(comm.rank(), None);
                        let mut e =
                            RankEngine::new(comm, model, cfg, mem, Trace::disabled()).unwrap();
                        [1000, 17, 5, 1].iter().map(|&b| e.eval_set(test, b).unwrap()).collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, per_batch) in results.iter().enumerate() {
            let (c0, n0, l0) = per_batch[0];
            assert_eq!(n0, 101, "rank {rank}: every sample counted once");
            for &(c, n, l) in &per_batch[1..] {
                assert_eq!((c, n), (c0, n0), "rank {rank}");
                assert!(
                    (l - l0).abs() <= 1e-5 * l0.abs().max(1.0),
                    "rank {rank}: loss {l} vs {l0}"
                );
            }
        }
    }

    /// ENG-6: with prefetch, a step leaves unit 0's gather in flight for the next pass; a
    /// checkpoint load drops it.
    #[test]
    fn the_next_passs_first_gather_leaves_with_the_optimizer() {
        let comm = shardline_collectives::local_group(1).unwrap().pop().unwrap();
        let mut m = shardline_models::zoo::MlpBn::digits();
        (m.input_dim, m.hidden, m.depth, m.classes) = (8, 8, 2, 3);
        let model = Arc::new(m.build());
        for prefetch in [0, 1, 2] {
            let cfg = stage3_sgd(prefetch, 1);
            let mem = MemoryTracker::new(0, None);
            let mut e =
                RankEngine::new(comm.clone(), Arc::clone(&model), cfg, mem, Trace::disabled())
                    .unwrap();
            let x = Tensor::new(vec![4, 8], (0..32).map(|i| i as f32 / 32.0).collect()).unwrap();
            e.train_step(x, &[0, 1, 2, 0], 4).unwrap();
            let expect = (prefetch > 0).then_some(0);
            assert_eq!(e.prefetched.as_ref().map(|p| p.unit), expect, "prefetch {prefetch}");
            let (state, bufs) = (e.shard_state(), e.buffers().to_vec());
            e.load_state(&state, &bufs, 1).unwrap();
            assert!(e.prefetched.is_none());
            let x = Tensor::new(vec![4, 8], vec![0.25; 32]).unwrap();
            let (_, n, _) = e.eval(x, &[0, 1, 2, 0], 4).unwrap();
            assert_eq!(n, 4);
        }
    }

    /// ENG-10: unit 0 goes first as soon as its reduction is in, whatever else is ready;
    /// while it waits the others go lowest first, and nothing still reducing is picked.
    #[test]
    fn unit_zeros_update_goes_first_once_its_reduction_is_in() {
        let n = 5;
        let mut stepped = vec![false; n];
        // Reductions complete in issue order: the head (4) first, unit 0 last.
        let mut waiting: Vec<usize> = vec![2, 1, 0];
        assert_eq!(next_update(&stepped, &waiting), Some(3));
        stepped[3] = true;
        assert_eq!(next_update(&stepped, &waiting), Some(4));
        stepped[4] = true;
        assert_eq!(next_update(&stepped, &waiting), None, "everything ready is done: wait");
        waiting.clear();
        assert_eq!(next_update(&stepped, &waiting), Some(0), "all in: unit 0 before 1 and 2");
        stepped[0] = true;
        assert_eq!(next_update(&stepped, &waiting), Some(1));
        stepped[1] = true;
        stepped[2] = true;
        assert_eq!(next_update(&stepped, &waiting), None);
    }

    /// ENG-4: communication time is the union of the spans, against a naive per-microsecond
    /// count.
    #[test]
    fn union_len_matches_a_naive_count() {
        let o = Instant::now();
        let us = |a: u64| o + Duration::from_micros(a);
        let cases: Vec<Vec<(u64, u64)>> = vec![
            vec![],
            vec![(5, 5)],
            vec![(0, 10), (20, 30)],
            vec![(0, 10), (5, 15), (14, 16), (40, 41)],
            vec![(30, 50), (0, 100), (10, 20)],
            vec![(7, 9), (1, 3), (3, 7), (60, 61), (60, 62)],
        ];
        for c in cases {
            let mut covered = [false; 128];
            for &(a, b) in &c {
                for x in a..b {
                    covered[x as usize] = true;
                }
            }
            let naive = covered.iter().filter(|x| **x).count() as u64;
            let mut spans: Vec<_> = c.iter().map(|&(a, b)| (us(a), us(b))).collect();
            assert_eq!(union_len(&mut spans), Duration::from_micros(naive), "{c:?}");
        }
    }
}
