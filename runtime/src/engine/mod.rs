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
//! With a shard group smaller than the world (`hybrid`, HSDP-1..4) the gathers and the
//! reduce-scatters run over the rank's shard group, each reduced shard is then all-reduced
//! over its replica group on a fourth lane (`replica`, chained off the compute thread), and
//! the loss reduction and SyncBN statistics stay over the world.
//!
//! With secondary shards (`hpz`, HPZ-1..4, stage 3) a unit used again in the step leaves
//! the rank its piece of a copy sharded over its node, and its later gathers run over the
//! node's group on a fifth lane (`hpz:gather`).
//!
//! The engine is cut into pure cores, which decide, and a shell, which acts; the cores take
//! completions and sizes as inputs, read no clock and issue no collective, so that a
//! simulated device or a plan simulator can drive the same code:
//! - `stage`: the rules of each ZeRO stage, one table per stage (what a rank keeps, what is
//!   gathered before use, how gradients are reduced, what is stepped and gathered after);
//! - `prefetch`: stage 3's gather plan and byte budget (ENG-5, ENG-6);
//! - `reduction`: the reductions in flight, their budget, and when each unit steps (ENG-7,
//!   ENG-8, ENG-10);
//! - `clock`: the step's communication clock (ENG-4);
//! - `accum`: gradient accumulation's microbatches and when their gradients are reduced
//!   (ACC-1..ACC-5; the default at stages 2 and 3, and why, is in its docs);
//! - `recompute`: which calls keep only their input, and the statistics their re-run
//!   replays (RECOMP-1..RECOMP-3);
//! - `walk`: the order of a step's work, one function the engine's step and the plan
//!   simulator both walk (ENG-12).
//!
//! The shell: `pass` runs one unit's forward and backward (ENG-9), re-running a checkpointed
//! call's forward first (RECOMP-1), `stats` is the SyncBN
//! statistics path, `shard_state` what a rank keeps and checkpoints, `device` the compute
//! backend (`gpu_choice` the GPU of each rank, VIS-1..VIS-3), `precision` the bf16 gathers
//! and reductions of the mixed-precision policy (PREC-1..5), `step` one training step (the
//! walk's work on this rank); this module holds the rank's engine, its lanes and evaluation.
//!
//! Invariants (each of the others is defined in the module that implements it):
//! - ENG-1: the same seed, data and world size give bitwise-identical parameters with any
//!   prefetch depth (prefetch changes when a gather is issued, never what is computed), and
//!   the squared gradient norms are summed in unit order whatever the order in which the
//!   reductions complete.
//! - ENG-2: the loss reported for a step is the mean over the whole global batch, and the
//!   gradient norm counts every element of the global gradient once; both are the same on
//!   every rank.
//! - ENG-3: every buffer the engine holds is registered with the rank's [`MemoryTracker`]
//!   (model state, gathered units, unreduced gradients, activations).
//! - ENG-11: a kernel that fails on a rank (its backend's error, [`Backend`]'s BACKEND-1)
//!   ends the step and the run with that error, naming the call, whichever rank and stage;
//!   the other ranks stop too, and no thread panics.
//!
//! Trace rows: `compute` holds the compute spans and the blocking `wait ...` spans (what
//! the rank's own thread does); `gather` and `reduce` hold each collective's span on its
//! lane; `stats` the SyncBN reductions.

mod accum;
mod clock;
mod device;
mod driven;
mod gpu_choice;
mod hpz;
mod hybrid;
pub mod live;
pub mod on_device;
mod pass;
mod precision;
mod prefetch;
mod recompute;
mod reduction;
mod replica;
mod replica_quant;
mod shard_state;
mod stage;
mod stats;
mod step;
#[cfg(test)]
mod tests;
mod walk;

pub use accum::AccumReduce;

/// The engine's pure cores, for the plan simulator (`crate::plan`) to drive on its clock.
pub(crate) mod sim_api {
    pub(crate) use super::pass::Micro;
    pub(crate) use super::prefetch::{carries_next_gather, GatherIo, GatherPlan};
    pub(crate) use super::recompute::Recompute;
    pub(crate) use super::reduction::{InFlight, ReduceIo, Reduction, Reductions};
    pub(crate) use super::stage::{BeforeUse, GradReduce, Holding, StageRules};
    pub(crate) use super::walk::{walk_step, HandOff, StepWork, Walk};
}
pub use device::{cuda_devices, open_backend, open_rank_backend, BackendOverride, Device};
pub use driven::Driven;
pub use gpu_choice::{rank_gpu, GpuChoiceError};
pub use hpz::{ReshardAfterForward, Secondary};
pub use hybrid::{checkpoint_shards, Groups, ShardGroup};
pub use precision::{gather_round_trip, GatherDtype, MixedPrecision, PrecisionDtype, QuantGather};
pub use recompute::Recompute;
pub use stats::STATS_LANE;

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clock::CommClock;
use pass::PassCtx;
use prefetch::{GatherPlan, Gathered, LaneGathers, PendingGather};
pub(crate) use shard_state::check_fits_host;
use shard_state::ShardState;
use shardline_collectives::{CallOptions, Communicator, Lane, ReduceOp};
use shardline_models::{Backend, Dataset, DistributedSampler, Network, Tensor};
use stage::StageRules;
use stats::StatsLane;

use crate::error::{Result, RuntimeError};
use crate::fault::Phase;
use crate::memory::{HeldBytes, MemoryTracker, RankMeter};
use crate::optim::{Optimizer, WeightDecayOn};
use crate::schedule::LrSchedule;
use crate::shard::{ShardedModelLayout, Stage};
use crate::telemetry::{Row, Trace};

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
    /// Stages 2 and 3: most bytes of full, not yet reduced unit gradients in flight once a
    /// unit's reduction is issued (the unit just computed always counts). When backward
    /// outruns the reductions, the oldest is waited for, so peak memory stays within model
    /// state + gathered units + this budget + the gradient of the unit being computed
    /// (ENG-7). Two units' worth lets one reduction overlap the next unit's backward.
    pub reduce_budget_bytes: u64,
    /// Treat every BatchNorm as SyncBatchNorm.
    pub sync_bn: bool,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Which parameters its weight decay applies to (OPT-5).
    pub weight_decay_on: WeightDecayOn,
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
    /// Microbatches per step (ACC-1); 1: none.
    pub grad_accum: usize,
    /// Stages 2 and 3: when the microbatches' gradients are reduced (ACC-3).
    pub accum_reduce: AccumReduce,
    /// Which calls keep only their input and are recomputed in backward (RECOMP-1).
    pub recompute: Recompute,
    /// The mixed-precision policy (PREC-1..5; default all `f32`).
    pub precision: MixedPrecision,
    /// The ranks that shard the model together (HSDP-1; default the whole world).
    pub shard_group: ShardGroup,
    /// `--cross-node-reduce-dtype`: gradient shards packed for the reduction across shard
    /// groups (QREDUCE-1); `None`: an f32 all-reduce.
    pub cross_node_reduce: Option<QuantGather>,
    /// What a stage-3 unit leaves after its forward (HPZ-1..4; default its shard).
    pub reshard_after_forward: ReshardAfterForward,
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
    /// Payload bytes this rank sent on the gather lane during the step (LANE-8: counted by
    /// the lane as each op runs; with prefetch at stage 3, unit 0's gather for the next
    /// step is counted in the step during which it ran).
    pub gather_bytes: u64,
    /// Payload bytes this rank sent on the reduce lanes during the step (gradient
    /// reductions over the shard group and the loss all-reduce over the world).
    pub reduce_bytes: u64,
    /// Payload bytes this rank sent on the replica lane during the step: the all-reduces of
    /// the reduced gradient shards across shard groups (HSDP-3); 0 with one shard group.
    pub replica_bytes: u64,
    /// Payload bytes this rank sent on the secondary groups' gather lane during the step:
    /// the gathers from secondary shards (HPZ-2); 0 without them.
    pub hpz_bytes: u64,
    /// Time spent converting between `f32` and bf16 (rounding shards and gradients,
    /// upcasting gathered units and reduced gradients); zero in `f32`.
    pub cast_time: Duration,
    /// Every rank's busy seconds this step (not waiting for communication, up to the loss
    /// reduction), the same list on every rank; empty where the engine does not measure it.
    pub rank_busy_s: Vec<f32>,
}

/// A step's (or an evaluation's) running figures.
#[derive(Default)]
pub(crate) struct StepState {
    /// Blocked time and collective spans.
    pub(crate) clock: CommClock,
    /// Compute time.
    pub(crate) compute: Duration,
    /// Per-unit squared norms of the own reduced gradient slices, summed in unit order
    /// (ENG-1).
    pub(crate) unit_sq: Vec<f64>,
    /// With clipping the norms are taken as the reductions finish; without, the updates
    /// give them (ENG-8).
    pub(crate) norms_when_reduced: bool,
    /// The step's learning rate.
    pub(crate) lr: f32,
    /// The gradient scale of the updates (clipping; 1 otherwise).
    pub(crate) coef: f32,
    /// The updates' spans, for the trace.
    pub(crate) opt_spans: Vec<(Instant, Instant)>,
}

/// One rank's engine: its shard state and the schedule that drives it.
pub struct RankEngine {
    /// The world rank and size: data slices, the loss and SyncBN statistics, the trace.
    rank: usize,
    world: usize,
    /// The rank's index in its shard group: the shard it holds (HSDP-2); the layout's world
    /// is the group's size.
    shard_rank: usize,
    /// The rank's index in its replica group: the first replica's norms count (HSDP-3).
    replica_index: usize,
    model: Arc<dyn Network>,
    /// The unit of each call of a forward pass (a tied root's unit twice).
    calls: Vec<usize>,
    /// Per unit, its full gradient between two backward calls (NET-1): the unit's reduction
    /// goes out after its last one.
    partial_grads: Vec<Option<(Option<crate::memory::Allocation>, Vec<f32>)>>,
    layout: ShardedModelLayout,
    cfg: EngineConfig,
    /// The stage's rules.
    rules: &'static StageRules,
    /// Unit names, for the trace and the memory tracker.
    labels: Vec<String>,
    /// The world's communicator (what an abort stops, with its sub-groups, COMM-3).
    world_comm: Communicator,
    /// The shard group's communicator: gathers, reductions, the buffer pool.
    comm: Communicator,
    gather: Lane,
    reduce: Lane,
    /// The world's reduce lane: the loss and evaluation sums (`reduce` with one group).
    loss_lane: Lane,
    /// The replica all-reduces behind the reduce-scatters, with more than one shard group.
    replica: Option<replica::ReplicaChain>,
    /// The rank's secondary group and its gather lane (HPZ-1), under
    /// `--reshard-after-forward node|N` at stage 3.
    hpz: Option<(Secondary, Lane)>,
    /// The secondary pieces held (HPZ-2).
    pieces: hpz::Pieces,
    /// Shared so that a step can hand it to the model while the engine's other state changes.
    stats: Arc<StatsLane>,
    backend: Box<dyn Backend>,
    mem: MemoryTracker,
    /// Registers what the layers allocate while the engine computes (MEM-4).
    meter: Arc<RankMeter>,
    trace: Trace,
    /// What the rank keeps of every unit.
    state: ShardState,
    step: u64,
    /// Fault injection points (`--fault`), none in a normal run.
    fault_hook: Option<crate::fault::FaultHook>,
    /// This rank asks the group to stop after the current step (INT-1).
    stop_requested: bool,
    /// Each unit's own packed shard for gathers, kept until its update (QGATHER-2).
    own_packed: precision::OwnPacked,
    /// Stage 3's gathers; between passes it holds the next pass's first gather (ENG-6).
    plan: GatherPlan<PendingGather, Gathered>,
    /// Per unit, the flat ranges that get no weight decay (OPT-5).
    no_decay: Vec<Vec<std::ops::Range<usize>>>,
    /// Time spent in bf16 conversions since the step began (PREC-2..4).
    cast: Cell<Duration>,
    /// Live recovery: updates wait for the loss all-reduce (LIVE-1).
    commit_after_sums: bool,
    /// The step's updates began and the step has not completed (LIVE-1).
    updating: bool,
    /// Under live recovery, the BatchNorm buffers as the last step began (a forward moves
    /// them before the step can commit), and whether that step is still running (LIVE-1).
    buffers_at_step: (Vec<Vec<f32>>, bool),
}

/// The tracker's reclaim holds the communicator: removed here, so that neither keeps the
/// other alive.
impl Drop for RankEngine {
    fn drop(&mut self) {
        self.mem.set_reclaim(None);
    }
}

impl RankEngine {
    /// Builds the rank's state: initial parameters (the same on every rank, from the seed),
    /// sharded as the stage says, and opens the lanes (collective: every rank calls it).
    pub fn new(
        comm: Communicator,
        model: Arc<dyn Network>,
        cfg: EngineConfig,
        mem: MemoryTracker,
        trace: Trace,
    ) -> Result<Self> {
        let (rank, world) = (comm.rank(), comm.world());
        let spec = model.spec();
        // HSDP-4: stage 0 keeps everything everywhere; a group changes nothing.
        let size = checkpoint_shards(cfg.shard_group, cfg.stage, comm.topology())?;
        let groups = Groups::new(world, size, rank);
        if size < world && cfg.precision.bf16_grads() {
            return Err(RuntimeError::config(
                "--shard-group below the world reduces gradients in f32: use --reduce-dtype f32",
            ));
        }
        let (shard_comm, replica_comm) = groups.open(&comm)?;
        let hpz = Self::open_secondary(&cfg, size, &comm)?;
        let layout = ShardedModelLayout::new(&spec, size)?;
        let no_decay = spec.units.iter().map(|u| cfg.weight_decay_on.no_decay_ranges(u)).collect();
        let gather = shard_comm.lane(GATHER_LANE)?;
        let reduce = shard_comm.lane(REDUCE_LANE)?;
        let loss_lane = comm.lane(REDUCE_LANE)?;
        let replica = match &replica_comm {
            Some(c) => {
                let quant = cfg.cross_node_reduce.map(|q| (q.dtype.code(), q.block));
                Some(replica::ReplicaChain::start(
                    c.lane(REDUCE_LANE)?,
                    c.options().get_timeout(),
                    quant,
                    c.world(),
                )?)
            }
            None => None,
        };
        let stats = Arc::new(StatsLane::open(&comm, trace.clone())?);
        let n = layout.units().len();
        let labels: Vec<String> = spec.units.iter().map(|u| u.name.clone()).collect();
        let calls = model.calls();
        if calls.iter().any(|&u| u >= n) || (0..n).any(|u| !calls.contains(&u)) {
            return Err(RuntimeError::config(format!(
                "model {}: its calls {calls:?} must use each of its {n} units",
                spec.name
            )));
        }
        // The lanes' staging and the pool's kept buffers are communication memory (MEM-5).
        let mut lanes = vec![&gather, &reduce, stats.lane()];
        if size < world {
            lanes.push(&loss_lane);
        }
        if let Some(r) = &replica {
            lanes.push(r.lane());
        }
        if let Some((_, l)) = &hpz {
            lanes.push(l);
        }
        for l in lanes {
            l.set_account(HeldBytes::new(&mem, &format!("{} lane staging", l.name()))? as _);
        }
        shard_comm.pool().set_account(HeldBytes::new(&mem, "buffer pool")? as _);
        // MEM-6: under a cap, the pool's idle buffers give way to an allocation.
        let pool_comm = shard_comm.clone();
        mem.set_reclaim(Some(Arc::new(move || pool_comm.pool().clear())));
        let shard_rank = groups.shard_index();
        let state = ShardState::init(&*model, &layout, &cfg, shard_rank, &mem, &labels)?;
        let own_packed = precision::OwnPacked::new(state.params.len());
        let sizes = layout.units().iter().map(|l| l.padded_numel() as u64 * 4).collect();
        let plan = GatherPlan::new(sizes, cfg.prefetch_budget_bytes, cfg.prefetch);
        let backend = open_rank_backend(cfg.device, cfg.threads, comm.topology().local_rank(rank))?;
        Ok(RankEngine {
            rank,
            world,
            shard_rank,
            replica_index: groups.replica_index(),
            model,
            calls,
            partial_grads: (0..n).map(|_| None).collect(),
            layout,
            rules: StageRules::of(cfg.stage),
            cfg,
            labels,
            world_comm: comm,
            comm: shard_comm,
            gather,
            reduce,
            loss_lane,
            replica,
            hpz,
            pieces: hpz::Pieces::new(n),
            stats,
            backend,
            meter: RankMeter::new(mem.clone()),
            mem,
            trace,
            state,
            step: 0,
            fault_hook: None,
            stop_requested: false,
            own_packed,
            plan,
            no_decay,
            cast: Cell::new(Duration::ZERO),
            commit_after_sums: false,
            updating: false,
            buffers_at_step: (Vec::new(), false),
        })
    }

    /// Computes on `backend` from now on, in place of the one its device opened.
    pub fn set_backend(&mut self, backend: Box<dyn Backend>) {
        self.backend = backend;
    }

    /// Installs the fault plan's hook, called at each phase of each step.
    pub fn set_fault_hook(&mut self, hook: crate::fault::FaultHook) {
        self.fault_hook = Some(hook);
    }

    /// A fault injection point of the step being run.
    fn fault_point(&self, phase: Phase) {
        if let Some(h) = &self.fault_hook {
            // The step in flight: `step` counts it once its updates began.
            let step = if phase == Phase::Update { self.step } else { self.step + 1 };
            h(self.rank, step, phase);
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

    /// Registers the tensors and kernel scratch made on this thread with the rank's tracker
    /// until the guard is dropped (MEM-4): a step's data slice, its activations, what layers
    /// save, and evaluation's.
    pub fn install_meter(&self) -> shardline_models::meter::Installed {
        shardline_models::meter::install(Arc::clone(&self.meter) as _)
    }

    /// The model's sharded layout.
    pub fn layout(&self) -> &ShardedModelLayout {
        &self.layout
    }

    /// The world's communicator (for aborting from outside; its sub-groups stop with it).
    pub fn communicator(&self) -> &Communicator {
        &self.world_comm
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The gather plan and the gather lane that carries out its decisions, borrowed apart.
    fn gathers<'a>(
        &'a mut self,
        clock: &'a mut CommClock,
    ) -> (&'a mut GatherPlan<PendingGather, Gathered>, LaneGathers<'a>) {
        let io = LaneGathers {
            rank: self.rank,
            shard_rank: self.shard_rank,
            layout: &self.layout,
            shards: &self.state.params,
            comm: &self.comm,
            lane: &self.gather,
            mem: &self.mem,
            trace: &self.trace,
            labels: &self.labels,
            clock,
            wire: self.param_wire(),
            cast: &self.cast,
            own_packed: &mut self.own_packed,
            hpz: self.hpz.as_ref().map(|(s, l)| (*s, l)),
            pieces: &self.pieces,
        };
        (&mut self.plan, io)
    }

    /// The step's loss and squared gradient norm summed over the group in one small
    /// all-reduce (ENG-2), the norms in unit order whatever the order of completion
    /// (ENG-1); the third value carries whether some rank asked to stop (INT-1), and one
    /// slot per rank its busy seconds (each rank fills its own, so the sum is every rank's:
    /// what the straggler detector reads, STRAG-1).
    fn reduce_loss_and_norm(
        &self,
        local_loss: f32,
        busy: f32,
        st: &mut StepState,
    ) -> Result<(f32, f64, bool, Vec<f32>)> {
        // ENG-2: every replica holds the same shards: one copy of each counts (HSDP-3).
        let sq: f64 = if self.replica_index == 0 { st.unit_sq.iter().sum() } else { 0.0 };
        // Waited for at once: a blocking call runs on this thread when the lane is idle.
        let mut now = CallOptions::new();
        now.blocking(true);
        let stop = if self.stop_requested { 1.0 } else { 0.0 };
        let mut v = vec![0.0; 3 + self.world];
        v[..3].copy_from_slice(&[local_loss, sq as f32, stop]);
        v[3 + self.rank] = busy;
        let w = self.loss_lane.all_reduce_opts(v, ReduceOp::Sum, &now);
        let sums = st.clock.wait(&self.trace, self.rank, w, Row::Reduce, "loss+norm")?;
        Ok((sums[0], sums[1] as f64, sums[2] > 0.0, sums[3..].to_vec()))
    }

    /// Bytes sent on the shard group's reduce lane and, where it is another lane, the
    /// world's loss lane.
    fn reduce_bytes(&self) -> u64 {
        let loss = if self.layout.world() < self.world { self.loss_lane.bytes_sent() } else { 0 };
        self.reduce.bytes_sent() + loss
    }

    /// Bytes sent on the secondary groups' gather lane (HPZ-2).
    fn hpz_bytes(&self) -> u64 {
        self.hpz.as_ref().map_or(0, |(_, l)| l.bytes_sent())
    }

    /// Stage 3 under `--reshard-after-forward node|N`: the rank's secondary group inside its
    /// shard group of `shard` ranks and its gather lane (HPZ-1); `None` otherwise (HPZ-4).
    /// The pieces are kept in f32, also under packed gathers (HPZ-5).
    fn open_secondary(
        cfg: &EngineConfig,
        shard: usize,
        world: &Communicator,
    ) -> Result<Option<(Secondary, Lane)>> {
        if StageRules::of(cfg.stage).before_use != stage::BeforeUse::Gather {
            return Ok(None);
        }
        let Some(size) = cfg.reshard_after_forward.size(shard, world.topology())? else {
            return Ok(None);
        };
        let sec = Secondary::new(shard, size, world.rank());
        let lane = world.subgroup("hpz", &sec.members())?.lane(GATHER_LANE)?;
        Ok(Some((sec, lane)))
    }

    /// Bytes sent on the replica lane (HSDP-3).
    fn replica_bytes(&self) -> u64 {
        self.replica.as_ref().map_or(0, |r| r.lane().bytes_sent())
    }

    /// Each unit's update is its own span; one `optimizer` mark at the end of the last
    /// closes the step on the trace (tools split a rank's trace into steps at it) and
    /// carries the process's CPU time (what a step cost the machine's cores).
    fn trace_updates(&self, st: &mut StepState) {
        let mut last = None::<Instant>;
        for &(t0, t1) in &st.opt_spans {
            st.compute += t1 - t0;
            self.trace.record(self.rank, Row::Compute, "optimizer step", t0, t1);
            last = Some(last.map_or(t1, |l| l.max(t1)));
        }
        if let Some(end) = last {
            self.trace.mark_cpu(self.rank, Row::Compute, "optimizer", end);
        }
    }

    /// Stages 1 and 2: all-gathers the updated parameters, in place (the updated own slice
    /// already lies in the full buffer).
    fn gather_updated(&mut self, clock: &mut CommClock) -> Result<()> {
        if self.packed_params() {
            return self.gather_updated_packed(clock); // PREC-3
        }
        let n = self.layout.units().len();
        let mut works = Vec::with_capacity(n);
        for u in 0..n {
            let full = std::mem::take(&mut self.state.params[u]);
            works.push((u, self.gather.all_gather_in_place(full)));
        }
        for (u, work) in works {
            let what = format!("all-gather {}", self.labels[u]);
            self.state.params[u] = clock.wait(&self.trace, self.rank, work, Row::Gather, &what)?;
        }
        Ok(())
    }

    /// Asks every rank to stop after the step in progress or the next one: the wish travels
    /// with the step's loss reduction, so all ranks see it at the same step
    /// ([`StepStats::stop`], INT-1).
    pub fn request_stop(&mut self) {
        self.stop_requested = true;
    }

    /// Evaluates this rank's slice in eval mode; returns (correct, count, summed loss over the
    /// slice divided by `global_n`). Collective: every rank calls it.
    pub fn eval(&mut self, x: Tensor, y: &Tensor, global_n: usize) -> Result<(u64, u64, f32)> {
        let mut st = StepState::default();
        let pass = PassCtx {
            training: false,
            sync_bn: false,
            reducer: None,
            global_batch: global_n.max(1),
            seed: self.cfg.seed,
            step: self.step,
            first_sample: 0,
        };
        self.plan.begin_eval(&self.calls);
        let mut x = x;
        for i in 0..self.calls.len() {
            x = self.forward_unit(i, x, pass, false, &mut st)?.0;
        }
        let loss_fn = self.model.loss();
        let local = y.batch() as u64;
        let (correct, count) = loss_fn.correct(&x, y)?.unwrap_or((0, local));
        let (loss, _) = loss_fn.forward_backward(&x, y, global_n.max(y.batch()))?;
        let sums = self
            .loss_lane
            .all_reduce(vec![correct as f32, count as f32, loss], ReduceOp::Sum)
            .wait()?;
        self.meter.check()?;
        Ok((sums[0] as u64, sums[1] as u64, sums[2]))
    }

    /// Evaluates this rank's share of `test` (its [`DistributedSampler::slice_range`]) in
    /// forwards of at most `batch` samples, so that evaluation never holds more activations
    /// than a training step of that per-rank batch; returns the global (correct, count,
    /// mean loss). Collective: every rank runs the same number of forwards (a rank whose
    /// share is one sample shorter runs an empty last one).
    pub fn eval_set(&mut self, test: &Dataset, batch: usize) -> Result<(u64, u64, f32)> {
        let _meter = self.install_meter();
        let (world, rank) = (self.world, self.rank);
        eval_share(test, world, rank, batch, |x, y, n| self.eval(x, y, n))
    }
}

/// Rank `rank`'s share of `test` (its [`DistributedSampler::slice_range`]) in forwards of at
/// most `batch` samples through `eval` (slice, labels, global count), summed: every rank of
/// `world` runs the same number of forwards, a rank whose share is one sample shorter an
/// empty last one, so that the collectives inside line up.
pub(crate) fn eval_share(
    test: &Dataset,
    world: usize,
    rank: usize,
    batch: usize,
    mut eval: impl FnMut(Tensor, &Tensor, usize) -> Result<(u64, u64, f32)>,
) -> Result<(u64, u64, f32)> {
    let n = test.len();
    let mine: Vec<usize> = DistributedSampler::slice_range(n, world, rank).collect();
    let batch = batch.max(1);
    let forwards = n.div_ceil(world).div_ceil(batch).max(1);
    let (mut correct, mut count, mut loss) = (0u64, 0u64, 0.0f32);
    for k in 0..forwards {
        let idx = &mine[(k * batch).min(mine.len())..((k + 1) * batch).min(mine.len())];
        let (x, y) = test.batch_tensors(idx);
        let (c, m, l) = eval(x, &y, n)?;
        correct += c;
        count += m;
        loss += l;
    }
    Ok((correct, count, loss))
}
