//! The engine on a [`Device`]: a rank's parameters, gradients, optimizer state and buffers
//! live in device memory, and a step is work enqueued on streams, ordered by events.
//!
//! Streams: `compute` runs every forward, backward, loss and update kernel; `gather` the
//! stage 3 gathers and the stage 1/2 all-gathers after the update; `reduce` the gradient
//! reductions and the loss reduction; `offload` the host functions of offloaded updates
//! ([`Offload`]). The gather and reduce streams each have their own communicator;
//! SyncBatchNorm's statistics are reduced by the kernel that needs them, on the compute
//! stream, over a third one (`stats`). The same pure cores as the host engine decide: the
//! step's order is the one walk of a step (`walk_step`, ENG-12; `step` runs each use as
//! device work), `StageRules` what a rank keeps and how it reduces, `GatherPlan` which
//! gathers go out when and what is kept (ENG-5), `Reductions` the reduce budget and the
//! order of updates (ENG-7, ENG-8, ENG-10).
//!
//! The data, the targets, each call's output and the gradients flowing back are device
//! buffers (`activations`, DACT-1). The tensors the model kernels make (what the layers save
//! for backward, their temporaries) are placed on the device (TENSOR-4) and are its memory:
//! probed once per microbatch size, reserved when each kernel is enqueued, checked when it
//! runs (`kernel_memory`, KMEM-1..3). What a forward saves is handed to its backward kernel
//! on the compute stream (in stream order, so never raced). With `--recompute units` a checkpointed call
//! keeps only its input and re-runs its forward inside its backward kernel (RECOMP-1..3).
//! Accumulation runs the microbatches of ACC-1..3; a reduce-scatter that adds to earlier
//! microbatches' goes through an output buffer and an add on the reduce stream. With
//! gradient clipping the updates read the global norm where the reduce stream summed it, so
//! clipping adds no host wait. bf16 is refused with a message naming it.
//!
//! Every device allocation is charged to the rank's [`MemoryTracker`] under its category
//! (`memory`, DMEM-1): the summary's breakdown is of device memory.
//!
//! The engine is a [`crate::engine::Driven`]: `train --device sim` runs it under the one
//! training loop ([`train_on_devices`]), with checkpoints in the host engine's format (`state`),
//! evaluation (`eval`), `--resume`, logs and the summary.
//!
//! Invariants:
//! - DEV-1: the host waits on the device once per step, for the reduced loss and gradient
//!   norm ([`DeviceStepStats::host_syncs`]); gathers, reductions and updates are ordered by
//!   events alone.
//! - DEV-2: every kernel that reads a unit's parameters runs after the event of the gather
//!   or update that wrote them; every update runs after its unit's reduction's event; a
//!   unit's transient gradient is freed on the reduce stream, after the reduction read it.
//! - DEV-3: the negative controls of [`InjectedBug`] each break one rule of DEV-2, and the
//!   simulated device refuses the step that breaks it, naming the buffer and the streams.
//! - DEV-4: on the simulated device (any delay seed) the results are bitwise those on the
//!   cpu device, whose every call runs at once: the order of the work is fixed by streams
//!   and events, not by timing.

mod activations;
mod calls;
mod cli;
mod eval;
mod io;
mod kernel_memory;
mod kernels;
mod lowered;
mod memory;
mod offload;
mod reduce;
mod run;
mod state;
mod stats;
mod step;
mod timeline;

pub use cli::{train_on_devices, DeviceTrainOptions};
pub use offload::Offload;
pub use run::{run_on_devices, run_on_devices_with, DeviceKind, DeviceRun, FaultSpec};

pub use timeline::{chrome_trace, overlap, Overlap};

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardline_collectives::device::{
    Device, DeviceBuffer, DeviceComm, DeviceError, Event, OpSpan, SimComm, SimWorld,
};
use shardline_models::{Backend, Ctx, DistributedSampler, Network, Tensor};

use super::accum;
use super::pass::Kept;
use super::prefetch::GatherPlan;
use super::reduction::Reductions;
use super::stage::{BeforeUse, StageRules};
use super::walk::{walk_step, Walk};
use super::{open_backend, EngineConfig, StepStats};
use crate::error::{Result, RuntimeError};
use crate::memory::{Category, MemorySnapshot, MemoryTracker};
use crate::shard::ShardedModelLayout;
use activations::Shapes;
use io::{DeviceGathers, DeviceReduction, PendingGather};
use kernel_memory::{run_measured, Figures, Footprint};
use memory::{DeviceMemory, Reserved};
use offload::Held;
use stats::DeviceStats;

/// Test-only negative controls: each removes one ordering the engine relies on (DEV-3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InjectedBug {
    /// Stage 3: the compute stream does not wait for a gather's event before the kernels
    /// that read the gathered parameters.
    pub skip_gather_wait: bool,
    /// Stages 2 and 3: a unit's transient gradient is freed on the compute stream right
    /// after its reduce-scatter is enqueued, not on the reduce stream after it has read the
    /// buffer (the `record_stream` class of bug: the memory is reused while the reduction
    /// still reads it).
    pub free_grads_on_compute: bool,
    /// This rank issues an all-reduce of its loss before the step's first gradient
    /// reduction, where the others issue the reduction itself: a desync (SCOMM-1).
    pub desync_rank: Option<usize>,
    /// Each forward kernel's saved tensors are reserved 4 bytes short of what the probe
    /// measured (KMEM-2), so the kernel makes more than its reservation (KMEM-3).
    pub under_reserve: bool,
}

/// How a rank's engine runs on its device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceOptions {
    /// What lives in host memory (OFFL-1).
    pub offload: Offload,
    /// Test-only negative controls (DEV-3).
    pub bug: InjectedBug,
    /// Gathers and reductions share one stream and one communicator, as a single NCCL
    /// process group does (the default gives each its own).
    pub one_comm: bool,
    /// The model's calls and loss run as device ops, lowered from its modules (`lowered`,
    /// LOWDEV-1), not as host code: what a device that runs no host code needs. A model
    /// that does not lower is refused, naming the module.
    pub model_ops: bool,
}

/// The streams of a rank's device.
pub(crate) struct Streams {
    pub(crate) compute: usize,
    pub(crate) gather: usize,
    pub(crate) reduce: usize,
    /// Host functions of the offloaded updates.
    pub(crate) offload: usize,
}

/// Where the ranks of a job meet: one world per communicator.
#[derive(Clone)]
pub struct DeviceWorlds {
    /// The gather stream's communicator.
    pub gather: Arc<SimWorld>,
    /// The reduce stream's communicator.
    pub reduce: Arc<SimWorld>,
    /// SyncBatchNorm's statistics.
    pub stats: Arc<SimWorld>,
}

impl DeviceWorlds {
    /// Worlds of `size` ranks whose collectives give up after `timeout` (SCOMM-3).
    pub fn new(size: usize, timeout: Duration) -> Self {
        DeviceWorlds {
            gather: SimWorld::new(size, timeout),
            reduce: SimWorld::new(size, timeout),
            stats: SimWorld::new(size, timeout),
        }
    }

    /// Fails every rank's pending and later collectives, naming `why` (a rank failed).
    pub fn abort(&self, why: &str) {
        self.gather.abort(why);
        self.reduce.abort(why);
        self.stats.abort(why);
    }
}

/// Figures of one step on one rank.
#[derive(Clone, Debug)]
pub struct DeviceStepStats {
    /// Mean loss over the global batch (the same on every rank, ENG-2).
    pub loss: f32,
    /// Global gradient norm.
    pub grad_norm: f64,
    /// Wall time of the step.
    pub step_time: Duration,
    /// Times the host waited on the device during the step (DEV-1).
    pub host_syncs: u64,
    /// SyncBatchNorm statistics messages this step.
    pub stats_messages: usize,
    /// Device bytes allocated at the end of the step.
    pub device_bytes: u64,
    /// Most device bytes allocated at once so far.
    pub device_peak: u64,
    /// The accountant's counters at the end of the step: device bytes by category, now and
    /// at their peaks (DMEM-1).
    pub memory: MemorySnapshot,
    /// The learning rate of the step.
    pub lr: f32,
    /// Some rank asked to stop before this step's loss reduction (INT-1): every rank learns
    /// it from the same reduction.
    pub stop: bool,
}

/// A value handed from one kernel of the compute stream to a later one (an activation, a
/// gradient flowing back, what a call saved): kernels of one stream run in order, so a slot
/// is filled before it is read.
struct Slot<T>(Mutex<Option<T>>);

impl<T> Slot<T> {
    fn new(v: Option<T>) -> Arc<Self> {
        Arc::new(Slot(Mutex::new(v)))
    }
    fn put(&self, v: T) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(v);
    }
    fn take(&self, what: &str) -> std::result::Result<T, DeviceError> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| DeviceError::Failed(format!("{what}: its input was never produced")))
    }
}

/// A model error inside a kernel, as the device reports it.
fn kernel_error(rank: usize, what: &str, e: impl std::fmt::Display) -> DeviceError {
    DeviceError::Failed(format!("rank {rank}: {what}: {e}"))
}

/// A rank's communicators on its device: the gathers', the reductions' and SyncBatchNorm's
/// statistics'.
pub struct Comms {
    /// The gather stream's communicator.
    pub gather: Box<dyn DeviceComm>,
    /// The reduce stream's communicator.
    pub reduce: Box<dyn DeviceComm>,
    /// The statistics' (model ops with SyncBatchNorm over several ranks).
    pub stats: Option<Box<dyn DeviceComm>>,
}

/// One rank's engine on a device.
pub struct DeviceEngine {
    rank: usize,
    world: usize,
    model: Arc<dyn Network>,
    calls: Vec<usize>,
    layout: ShardedModelLayout,
    cfg: EngineConfig,
    rules: &'static StageRules,
    labels: Vec<String>,
    dev: Arc<dyn Device>,
    /// Every device allocation, charged by category (DMEM-1).
    mem: Arc<DeviceMemory>,
    streams: Streams,
    gather_comm: Box<dyn DeviceComm>,
    reduce_comm: Box<dyn DeviceComm>,
    backend: Arc<dyn Backend>,
    /// SyncBatchNorm's reducer (with SyncBN on several ranks).
    stats: Option<Arc<DeviceStats>>,
    /// Per microbatch size, for training and for evaluation, what the model kernels make
    /// (KMEM-1).
    footprints: HashMap<(usize, bool), Footprint>,
    /// The kernels' scratch, reserved as a workspace (KMEM-2): its size and reservation.
    workspace: Option<(u64, Reserved)>,
    /// The calls' output shapes, probed for the data (DACT-1).
    shapes: Option<Shapes>,
    /// The host's waits since the timeline was last taken (DEV-1).
    host_waits: Vec<OpSpan>,
    /// Per unit, what the rank keeps (as the stage's rules say), on the device or offloaded.
    params: Vec<Held>,
    grads: Vec<DeviceBuffer>,
    optim_state: Vec<Held>,
    buffers: Vec<DeviceBuffer>,
    /// Per unit, the event after which its kept parameters are current.
    ready: Vec<Option<Event>>,
    /// Per unit, the event after its last reduction (an offloaded update waits for it).
    reduced: Vec<Option<Event>>,
    offload: Offload,
    plan: GatherPlan<PendingGather, DeviceBuffer>,
    no_decay: Vec<Vec<Range<usize>>>,
    /// Per unit, the squared norm of its own reduced gradient (an `f64`'s bits in two
    /// elements), written by its update.
    sq: DeviceBuffer,
    /// The rank's share of the loss.
    loss: DeviceBuffer,
    /// Loss, squared norm, stop wishes (INT-1): summed over the group.
    sums: DeviceBuffer,
    /// This rank wishes to stop (INT-1).
    stop_requested: bool,
    /// The communicators' worlds (aborted when a rank fails).
    worlds: DeviceWorlds,
    /// Where the driver keeps the streams' spans for a trace, when it asks for one.
    trace_sink: Option<Arc<Mutex<Vec<OpSpan>>>>,
    /// The streams' busy and overlapped time over the driven steps (TLINE-1).
    overlap_total: Arc<Mutex<Overlap>>,
    step: u64,
    bug: InjectedBug,
    /// The model's calls and loss run as device ops ([`DeviceOptions::model_ops`]).
    model_ops: bool,
    /// SyncBatchNorm's statistics as collectives of lowered calls (with model ops, where
    /// the job syncs over several ranks).
    stats_comm: Option<Mutex<Box<dyn DeviceComm>>>,
    /// The lowered calls, per call, input shape and mode.
    programs: HashMap<(usize, Vec<usize>, bool), Arc<shardline_models::lower::Program>>,
}

impl DeviceEngine {
    /// Rank `rank`'s engine on `dev`, meeting the other ranks in `worlds`: the initial
    /// parameters from the seed, kept as the stage says, uploaded. Refuses what the device
    /// engine does not do yet, naming it.
    pub fn new(
        rank: usize,
        dev: Arc<dyn Device>,
        worlds: &DeviceWorlds,
        model: Arc<dyn Network>,
        cfg: EngineConfig,
        opts: DeviceOptions,
    ) -> Result<Self> {
        let (offload, bug) = (opts.offload, opts.bug);
        let world = worlds.gather.size();
        if offload == Offload::Params && cfg.stage != crate::shard::Stage::Zero3 {
            return Err(RuntimeError::config(
                "--offload params keeps the parameter shards on the host: it needs --stage 3",
            ));
        }
        let missing = [
            (
                !cfg.precision.is_f32(),
                "bf16 or quantized gathers (--param-dtype, --reduce-dtype, --gather-dtype)",
            ),
            (!cfg.shard_group.is_world(), "hybrid sharding (--shard-group)"),
            (!cfg.reshard_after_forward.is_world(), "secondary shards (--reshard-after-forward)"),
        ];
        if let Some((_, what)) = missing.iter().find(|m| m.0) {
            return Err(RuntimeError::config(format!(
                "the device engine does not run {what} yet; use the host engine"
            )));
        }
        let spec = model.spec();
        let layout = ShardedModelLayout::new(&spec, world)?;
        let labels: Vec<String> = spec.units.iter().map(|u| u.name.clone()).collect();
        let no_decay = spec.units.iter().map(|u| cfg.weight_decay_on.no_decay_ranges(u)).collect();
        let rules = StageRules::of(cfg.stage);
        let (compute, gather) = (dev.stream("compute"), dev.stream("gather"));
        let streams = Streams {
            compute,
            gather,
            reduce: if opts.one_comm { gather } else { dev.stream("reduce") },
            offload: dev.stream("offload"),
        };
        let n = layout.units().len();
        let k = cfg.optimizer.state_len_per_param();
        let (mut params, mut grads, mut optim_state, mut buffers) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mem = Arc::new(DeviceMemory::new(rank, Arc::clone(&dev)));
        let upload = |cat: Category, v: &[f32], what: String| -> Result<DeviceBuffer> {
            let b = mem.alloc(cat, v.len(), &what)?;
            dev.upload(streams.compute, v, &b)?;
            Ok(b)
        };
        for (u, name) in labels.iter().enumerate() {
            let l = layout.unit(u);
            let init = model.init_params(u, cfg.seed)?;
            let mut full = vec![0.0f32; l.padded_numel()];
            full[..init.len()].copy_from_slice(&init);
            let (kept, cat) = match rules.params {
                super::stage::Holding::Full => (full, Category::FullParams),
                super::stage::Holding::Shard => {
                    (full[l.shard_range(rank)].to_vec(), Category::ShardParams)
                }
            };
            let host = |v: Vec<f32>| Held::Host(Arc::new(Mutex::new(v)));
            params.push(match offload {
                Offload::Params => host(kept),
                _ => Held::Device(upload(cat, &kept, format!("{name} params"))?),
            });
            let zeros = vec![0.0; rules.grads.len(l)];
            grads.push(upload(Category::Grads, &zeros, format!("{name} grads"))?);
            let state = vec![0.0; rules.optim_state.len(l) * k];
            optim_state.push(match offload {
                Offload::None => Held::Device(upload(
                    Category::OptimizerState,
                    &state,
                    format!("{name} optimizer state"),
                )?),
                _ => host(state),
            });
            // Buffers (BatchNorm's running statistics), whole on every rank, count as full
            // parameters.
            let b = model.init_buffers(u)?;
            buffers.push(upload(Category::FullParams, &b, format!("{name} buffers"))?);
        }
        let up = dev.record(streams.compute);
        let sizes = layout.units().iter().map(|l| l.padded_numel() as u64 * 4).collect();
        let plan = GatherPlan::new(sizes, cfg.prefetch_budget_bytes, cfg.prefetch);
        let backend: Arc<dyn Backend> = Arc::from(open_backend(cfg.device, cfg.threads)?);
        let stats_comm = (opts.model_ops && cfg.sync_bn && world > 1).then(|| {
            let c = SimComm::new(rank, Arc::clone(&worlds.stats), Arc::clone(&dev));
            Mutex::new(Box::new(c) as Box<dyn DeviceComm>)
        });
        Ok(DeviceEngine {
            rank,
            world,
            calls: model.calls(),
            model,
            gather_comm: Box::new(SimComm::new(rank, Arc::clone(&worlds.gather), Arc::clone(&dev))),
            // One communicator: both sides number their calls in one sequence.
            reduce_comm: Box::new(SimComm::new(
                rank,
                Arc::clone(if opts.one_comm { &worlds.gather } else { &worlds.reduce }),
                Arc::clone(&dev),
            )),
            shapes: None,
            footprints: HashMap::new(),
            workspace: None,
            host_waits: Vec::new(),
            stats: (cfg.sync_bn && world > 1).then(|| {
                Arc::new(DeviceStats {
                    rank,
                    world: Arc::clone(&worlds.stats),
                    messages: Default::default(),
                })
            }),
            sq: mem.alloc(Category::Scratch, 2 * n, "squared norms")?,
            loss: mem.alloc(Category::Scratch, 1, "loss")?,
            sums: mem.alloc(Category::Scratch, 3, "loss, norm and stop (summed)")?,
            mem,
            ready: vec![Some(up); n],
            reduced: vec![None; n],
            offload,
            layout,
            rules,
            labels,
            streams,
            backend,
            params,
            grads,
            optim_state,
            buffers,
            plan,
            no_decay,
            cfg,
            dev,
            step: 0,
            bug,
            model_ops: opts.model_ops,
            stats_comm,
            programs: HashMap::new(),
            stop_requested: false,
            worlds: worlds.clone(),
            trace_sink: None,
            overlap_total: Arc::default(),
        })
    }

    /// The engine with its gathers and reductions over `comms` (NCCL on a GPU) instead of
    /// the simulated communicators of its worlds; refused with [`DeviceOptions::one_comm`],
    /// whose single communicator is the worlds'. Call it before the first step.
    pub fn with_comms(mut self, comms: Comms) -> Result<Self> {
        if self.streams.gather == self.streams.reduce {
            return Err(RuntimeError::config("one communicator (--sim-one-comm) with own comms"));
        }
        (self.gather_comm, self.reduce_comm) = (comms.gather, comms.reduce);
        if self.stats_comm.is_some() {
            let stats = comms.stats.ok_or_else(|| {
                RuntimeError::config(
                    "SyncBatchNorm over several ranks needs a statistics communicator",
                )
            })?;
            self.stats_comm = Some(Mutex::new(stats));
        }
        Ok(self)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Optimizer steps taken.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Asks every rank to stop after this step (the wish travels with the loss reduction,
    /// INT-1).
    pub fn request_stop(&mut self) {
        self.stop_requested = true;
    }

    /// Fails every rank's pending and later collectives, naming `why`.
    pub fn abort(&self, why: &str) {
        self.worlds.abort(why);
    }

    /// Frees the gathers queued for a next pass at the end of the job.
    pub fn shutdown(&mut self) {
        let _ = self.discard_gathers();
    }

    /// Keeps every step's stream spans in `sink` (for a trace); without one they are
    /// dropped after each step's figures are taken from them.
    pub fn set_trace_sink(&mut self, sink: Arc<Mutex<Vec<OpSpan>>>) {
        self.trace_sink = Some(sink);
    }

    /// The streams' busy and overlapped time summed over the driven steps, shared.
    pub fn overlap_handle(&self) -> Arc<Mutex<Overlap>> {
        Arc::clone(&self.overlap_total)
    }

    /// [`DeviceEngine::train_step`] for the driver: the step's figures with its
    /// communication times taken from the device's timeline (simulated timing, TLINE-1;
    /// zero where the device records none), and the spans kept for a trace if asked.
    pub fn driven_step(&mut self, x: Tensor, y: &Tensor, global_batch: usize) -> Result<StepStats> {
        let s = self.train_step(x, y, global_batch)?;
        let spans = self.take_timeline();
        let o = overlap(&spans);
        {
            let mut t = self.overlap_total.lock().unwrap_or_else(|e| e.into_inner());
            t.compute_s += o.compute_s;
            t.comm_s += o.comm_s;
            t.hidden_s += o.hidden_s;
        }
        if let Some(sink) = &self.trace_sink {
            sink.lock().unwrap_or_else(|e| e.into_inner()).extend(spans);
        }
        let secs = Duration::from_secs_f64;
        Ok(StepStats {
            loss: s.loss,
            lr: s.lr,
            step_time: s.step_time,
            compute_time: secs(o.compute_s),
            comm_exposed: secs((o.comm_s - o.hidden_s).max(0.0)),
            comm_time: secs(o.comm_s),
            peak_bytes: s.device_peak,
            stats_messages: s.stats_messages,
            grad_norm: s.grad_norm,
            stop: s.stop,
            ..StepStats::default()
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }

    /// The accountant of this rank's device memory (DMEM-1).
    pub fn memory(&self) -> &MemoryTracker {
        self.mem.tracker()
    }

    /// What ran since the last call: the device's operations (when it records them) and
    /// the host's waits.
    pub fn take_timeline(&mut self) -> Vec<OpSpan> {
        let mut t = self.dev.take_timeline();
        t.append(&mut self.host_waits);
        t
    }

    /// SyncBatchNorm messages so far.
    fn stats_messages(&self) -> usize {
        self.stats.as_ref().map_or(0, |s| s.messages.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// A kernel's context of this step.
    fn ctx_of(&self, global_batch: usize, first_sample: usize) -> CtxOf {
        CtxOf {
            training: true,
            sync_bn: self.cfg.sync_bn,
            stats: self.stats.clone(),
            global_batch,
            seed: self.cfg.seed,
            step: self.step + 1,
            first_sample,
            backend: Arc::clone(&self.backend),
        }
    }

    /// The gather plan and the gather stream that carries out its decisions, borrowed apart.
    fn gathers(&mut self) -> (&mut GatherPlan<PendingGather, DeviceBuffer>, DeviceGathers<'_>) {
        let io = DeviceGathers {
            dev: &self.dev,
            mem: &self.mem,
            streams: &self.streams,
            comm: &mut *self.gather_comm,
            layout: &self.layout,
            shards: &self.params,
            ready: &self.ready,
            labels: &self.labels,
            skip_wait: self.bug.skip_gather_wait,
        };
        (&mut self.plan, io)
    }

    /// Unit `u`'s kept parameters on the device (stages 0-2; offloading them needs stage 3).
    fn resident(&self, u: usize) -> Result<&DeviceBuffer> {
        self.params[u].on_device().ok_or_else(|| {
            RuntimeError::config(format!("{}: its parameters are on the host", self.labels[u]))
        })
    }

    /// The parameters use `i` of the pass reads: stage 3 gathers them (the plan decides
    /// when, ENG-5); the other stages keep them, current after `ready` (DEV-2).
    fn acquire(&mut self, i: usize) -> Result<Option<DeviceBuffer>> {
        let u = self.plan.unit_at(i);
        if self.rules.before_use != BeforeUse::Gather {
            if let Some(e) = &self.ready[u] {
                self.dev.wait(self.streams.compute, e);
            }
            return Ok(None);
        }
        let (plan, mut io) = self.gathers();
        plan.acquire(i, &mut io).map(Some)
    }

    /// After use `i`: the plan keeps or frees its gathered parameters.
    fn done_with(&mut self, i: usize, gathered: Option<DeviceBuffer>) {
        if let Some(g) = gathered {
            let (plan, mut io) = self.gathers();
            plan.done_with(i, g, &mut io);
        }
    }

    /// One training step on this rank's slice `x`/`y` of a global batch of `global_batch`
    /// samples; every rank calls it with its own slice.
    pub fn train_step(
        &mut self,
        x: Tensor,
        y: &Tensor,
        global_batch: usize,
    ) -> Result<DeviceStepStats> {
        let t0 = Instant::now();
        let (n, nc) = (self.layout.units().len(), self.calls.len());
        let messages0 = self.stats_messages();
        let first_sample =
            DistributedSampler::slice_range(global_batch, self.world, self.rank).start;
        // ACC-1: the slice in microbatches, each a forward and a backward; one set of
        // reductions and of partial gradients for the whole step (ACC-2, ACC-3).
        let micro = accum::microbatches(x.batch(), self.cfg.grad_accum);
        self.plan.begin_step(&self.calls, micro.len());
        self.fit_shapes(&x)?;
        let lr = self.cfg.lr.lr_at(self.step);
        let calls = self.calls.clone();
        // ENG-12: the step's order is the walk's, as on the host engine.
        let walk = Walk::of(&calls, n, micro.len(), self.rules, &self.cfg);
        let mut step = step::DeviceStep {
            eng: self,
            data: Some((x, y.clone())),
            micro,
            global_batch,
            first_sample,
            lr,
            partial: (0..n).map(|_| None).collect(),
            mb: None,
            targets: None,
            act: None,
            saved: Vec::with_capacity(nc),
            held: Vec::with_capacity(nc),
        };
        walk_step(&walk, &mut step)?;
        drop(step);
        // DEV-1: the step's one host wait.
        let download = self.dev.download(self.streams.reduce, &self.sums)?;
        let waited = Instant::now();
        let sums = download.wait(&*self.dev)?;
        self.host_waits.push(OpSpan {
            stream: "host".into(),
            op: "host wait (loss and norm)".into(),
            start: waited,
            end: Instant::now(),
        });
        let (loss, sq) = (sums[0], f64::from(sums[1]));
        Ok(DeviceStepStats {
            lr,
            stop: sums[2] > 0.0,
            loss,
            grad_norm: sq.sqrt(),
            step_time: t0.elapsed(),
            host_syncs: 1,
            stats_messages: self.stats_messages() - messages0,
            device_bytes: self.dev.in_use(),
            device_peak: self.dev.peak(),
            memory: self.mem.tracker().snapshot(),
        })
    }

    /// Probes the calls' shapes for data shaped like `x`'s samples unless they were probed
    /// for such data already (DACT-1); the kernels' figures go with the old shapes.
    fn fit_shapes(&mut self, x: &Tensor) -> Result<()> {
        if !self.shapes.as_ref().is_some_and(|s| s.fits(x)) {
            let probed = Shapes::probe(&*self.model, x, self.cfg.seed, &*self.backend);
            self.shapes = Some(probed.map_err(RuntimeError::config)?);
            self.footprints.clear();
        }
        Ok(())
    }

    /// The call shapes probed for this job's data.
    fn probed(&self) -> Result<&Shapes> {
        self.shapes.as_ref().ok_or_else(|| RuntimeError::config("no probed shapes"))
    }
}

/// What a kernel needs to build its [`Ctx`]: owned, so that it travels with the kernel.
#[derive(Clone)]
struct CtxOf {
    /// Training (a step) or evaluation.
    training: bool,
    sync_bn: bool,
    stats: Option<Arc<DeviceStats>>,
    global_batch: usize,
    seed: u64,
    step: u64,
    first_sample: usize,
    backend: Arc<dyn Backend>,
}

impl CtxOf {
    fn ctx(&self, overwrite_grads: bool) -> Ctx<'_> {
        Ctx {
            training: self.training,
            sync_bn: self.sync_bn,
            reducer: self.stats.as_deref().map(|s| s as &dyn shardline_models::StatsReducer),
            global_batch: self.global_batch,
            backend: &*self.backend,
            overwrite_grads,
            seed: self.seed,
            step: self.step,
            first_sample: self.first_sample,
        }
    }
}
