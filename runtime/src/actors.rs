//! Actors (actix): one [`RankActor`] per rank on its own arbiter thread, owning its shard
//! state and engine, and a [`Coordinator`] that learns of failures and aborts every
//! communicator so that no rank hangs.
//!
//! - ACT-1: a failing rank reports to the coordinator before answering its caller, so the
//!   coordinator aborts the other ranks' communicators while they are still blocked.
//! - ACT-2: the first failure reported is the root cause named in the job's error; the
//!   `Aborted` errors it causes on the other ranks are consequences.
//! - ACT-3: a rank whose actor thread dies (a panic, an injected kill) reports `rank R died`
//!   from the actor's drop, so the coordinator aborts the others instead of letting them wait
//!   for the dead rank until their timeout.
//! - ACT-4: at the first failure the coordinator captures every rank's recent collectives
//!   before aborting (see [`crate::doctor`]); on a timeout it prints the hang report.

use crate::checkpoint::{FileEntry, PendingCheckpoint, RankShard};
use crate::doctor::Diagnosis;
use crate::engine::{Driven, StepStats};
use crate::error::{Result, RuntimeError};
use crate::fault::{FaultHook, FaultInjector, Phase};
use actix::prelude::*;
use shardline_collectives::Communicator;
use shardline_models::{Dataset, DistributedSampler};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Samples per evaluation forward: a training microbatch's (the per-rank batch over the
/// accumulation count), so that evaluation never needs more memory than training, whose
/// forwards also keep what backward needs (EVAL-2). At stage 3 each forward gathers the whole
/// model again, which tiny batches pay for in communication.
pub fn eval_batch(per_rank_batch: usize, grad_accum: usize) -> usize {
    (per_rank_batch / grad_accum.max(1)).max(1)
}

/// The data a rank reads its slices from (shared, read-only).
pub struct RankData {
    /// Training set.
    pub train: Arc<Dataset>,
    /// Test set.
    pub test: Arc<Dataset>,
    /// Global-batch sampler over the training set.
    pub sampler: DistributedSampler,
}

/// One training step: the `index`-th batch of `epoch`.
#[derive(Message)]
#[rtype(result = "std::result::Result<StepStats, String>")]
pub struct Step {
    /// Epoch.
    pub epoch: u64,
    /// Batch index within the epoch.
    pub index: usize,
    /// This rank's wish to stop after this step; it travels with the step's loss reduction,
    /// so every rank of the job learns the same answer ([`StepStats::stop`], INT-1).
    pub stop: bool,
}

/// Evaluate on the test set; answers (correct, count, mean loss).
#[derive(Message)]
#[rtype(result = "std::result::Result<(u64, u64, f32), String>")]
pub struct Eval;

/// Write this rank's shard into a pending checkpoint of this many shards: ranks from that
/// number on (the other replica groups, HSDP-2) write nothing.
#[derive(Message)]
#[rtype(result = "std::result::Result<Option<FileEntry>, String>")]
pub struct Save(pub Arc<PendingCheckpoint>, pub usize);

/// Copy this rank's checkpointed state now, at the step boundary, for a checkpoint written
/// in the background (DRIVE-4); no collective.
#[derive(Message)]
#[rtype(result = "std::result::Result<RankSnapshot, String>")]
pub struct Snapshot;

/// Copy what the rank keeps between steps, after a failure, for live recovery (LIVE-1); no
/// collective.
#[derive(Message)]
#[rtype(result = "std::result::Result<crate::engine::live::LiveState, String>")]
pub struct TakeLive;

/// A rank's checkpointed state as it was at a step boundary.
#[derive(Debug)]
pub struct RankSnapshot {
    /// The rank.
    pub rank: usize,
    /// Steps completed.
    pub step: u64,
    /// Its shard of every unit's parameters and optimizer state.
    pub shard: RankShard,
    /// Its replicated buffers per unit (the same on every rank).
    pub buffers: Vec<Vec<f32>>,
}

/// Restore state (collective: all ranks at once).
#[derive(Message)]
#[rtype(result = "std::result::Result<(), String>")]
pub struct Load {
    /// This rank's shard (already resharded for this world).
    pub shard: RankShard,
    /// Replicated buffers per unit.
    pub buffers: Vec<Vec<f32>>,
    /// Steps completed.
    pub step: u64,
}

/// Gather full parameters (collective); answers per-unit unpadded parameters.
#[derive(Message)]
#[rtype(result = "std::result::Result<(Vec<Vec<f32>>, Vec<Vec<f32>>), String>")]
pub struct FullParams;

/// This rank's replicated buffers (BatchNorm running statistics), per unit; no collective.
#[derive(Message)]
#[rtype(result = "Vec<Vec<f32>>")]
pub struct Buffers;

/// Abort this rank's communicator (pending and later ops fail).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Abort(pub String);

/// Release the rank's state (engine, communicator, lane threads). The actor thread itself
/// ends with the actor system; a `SyncArbiter` would restart a stopped actor.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Shutdown;

/// A rank reports its failure to the coordinator.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RankFailed {
    /// The rank.
    pub rank: usize,
    /// What happened.
    pub error: String,
}

/// One rank: engine plus data, on its own thread (a `SyncArbiter` of one).
pub struct RankActor {
    engine: Box<dyn Driven>,
    data: Arc<RankData>,
    coordinator: Addr<Coordinator>,
    faults: Option<Arc<FaultInjector>>,
    checkpoint_hook: Option<FaultHook>,
    /// This rank's batches of the current epoch (computed once per epoch).
    batches: shardline_models::RankBatches,
}

impl RankActor {
    /// A rank actor over an engine.
    pub fn new(
        engine: Box<dyn Driven>,
        data: Arc<RankData>,
        coordinator: Addr<Coordinator>,
    ) -> Self {
        RankActor {
            engine,
            data,
            coordinator,
            faults: None,
            checkpoint_hook: None,
            batches: shardline_models::RankBatches::default(),
        }
    }

    /// Carries a fault plan (`--fault`) in one process: step progress and failure reports.
    pub fn with_faults(mut self, faults: Option<Arc<FaultInjector>>) -> Self {
        self.faults = faults;
        self
    }

    /// Called once this rank has written its checkpoint shard (an injected fault's point,
    /// [`Phase::Checkpoint`]).
    pub fn with_checkpoint_hook(mut self, hook: Option<FaultHook>) -> Self {
        self.checkpoint_hook = hook;
        self
    }

    fn fail<T>(&self, e: RuntimeError) -> std::result::Result<T, String> {
        let msg = e.to_string();
        // ACT-1: tell the coordinator first, so it can abort the others while they wait.
        self.coordinator.do_send(RankFailed { rank: self.engine.rank(), error: msg.clone() });
        Err(msg)
    }

    fn do_step(&mut self, m: &Step) -> Result<StepStats> {
        let rank = self.engine.rank();
        let (global, idx) =
            self.batches.get(&self.data.sampler, m.epoch, rank, m.index).ok_or_else(|| {
                RuntimeError::config(format!("epoch {} has no batch {}", m.epoch, m.index))
            })?;
        // The slice is the step's input on the rank's device: registered with its tracker.
        let meter = self.engine.data_meter();
        let (x, y) = self.data.train.batch_tensors(idx);
        drop(meter);
        if m.stop {
            self.engine.request_stop();
        }
        self.engine.train_step(x, &y, *global)
    }

    fn do_eval(&mut self) -> Result<(u64, u64, f32)> {
        let batch = eval_batch(self.data.sampler.per_rank_batch(), self.engine.config().grad_accum);
        self.engine.eval_set(&self.data.test, batch)
    }
}

impl Actor for RankActor {
    type Context = SyncContext<Self>;
}

impl Handler<Step> for RankActor {
    type Result = std::result::Result<StepStats, String>;
    fn handle(&mut self, m: Step, _: &mut Self::Context) -> Self::Result {
        match self.do_step(&m) {
            Ok(s) => {
                if let Some(f) = &self.faults {
                    f.step_done(self.engine.rank(), self.engine.steps_done());
                }
                Ok(s)
            }
            Err(e) => self.fail(e),
        }
    }
}

impl Handler<Eval> for RankActor {
    type Result = std::result::Result<(u64, u64, f32), String>;
    fn handle(&mut self, _: Eval, _: &mut Self::Context) -> Self::Result {
        match self.do_eval() {
            Ok(s) => Ok(s),
            Err(e) => self.fail(e),
        }
    }
}

impl Handler<Save> for RankActor {
    type Result = std::result::Result<Option<FileEntry>, String>;
    fn handle(&mut self, m: Save, _: &mut Self::Context) -> Self::Result {
        let rank = self.engine.rank();
        let written = if rank < m.1 {
            self.engine.shard_state().and_then(|shard| m.0.write_shard(rank, &shard)).map(Some)
        } else {
            Ok(None)
        };
        match written {
            Ok(f) => {
                if let Some(hook) = &self.checkpoint_hook {
                    hook(self.engine.rank(), self.engine.steps_done(), Phase::Checkpoint);
                }
                Ok(f)
            }
            Err(e) => self.fail(e),
        }
    }
}

impl Handler<Snapshot> for RankActor {
    type Result = std::result::Result<RankSnapshot, String>;
    fn handle(&mut self, _: Snapshot, _: &mut Self::Context) -> Self::Result {
        let taken = self.engine.shard_state().and_then(|shard| Ok((shard, self.engine.buffers()?)));
        match taken {
            Ok((shard, buffers)) => Ok(RankSnapshot {
                rank: self.engine.rank(),
                step: self.engine.steps_done(),
                shard,
                buffers,
            }),
            Err(e) => self.fail(e),
        }
    }
}

impl Handler<TakeLive> for RankActor {
    type Result = std::result::Result<crate::engine::live::LiveState, String>;
    fn handle(&mut self, _: TakeLive, _: &mut Self::Context) -> Self::Result {
        // Not reported as the rank's failure: the run has already failed.
        self.engine.live_state().map_err(|e| e.to_string())
    }
}

impl Handler<Load> for RankActor {
    type Result = std::result::Result<(), String>;
    fn handle(&mut self, m: Load, _: &mut Self::Context) -> Self::Result {
        match self.engine.load_state(&m.shard, &m.buffers, m.step) {
            Ok(()) => Ok(()),
            Err(e) => self.fail(e),
        }
    }
}

impl Handler<FullParams> for RankActor {
    type Result = std::result::Result<(Vec<Vec<f32>>, Vec<Vec<f32>>), String>;
    fn handle(&mut self, _: FullParams, _: &mut Self::Context) -> Self::Result {
        match self.engine.full_params().and_then(|p| Ok((p, self.engine.buffers()?))) {
            Ok(v) => Ok(v),
            Err(e) => self.fail(e),
        }
    }
}

impl Handler<Buffers> for RankActor {
    type Result = Vec<Vec<f32>>;
    fn handle(&mut self, _: Buffers, _: &mut Self::Context) -> Self::Result {
        // A device engine that cannot read its buffers has failed; its step reports why.
        self.engine.buffers().unwrap_or_default()
    }
}

impl Drop for RankActor {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // ACT-3: the thread is unwinding; the engine (and its lanes) drop after this.
            let rank = self.engine.rank();
            self.coordinator.do_send(RankFailed {
                rank,
                error: format!("rank {rank} died (its actor thread panicked)"),
            });
        }
    }
}

impl Handler<Abort> for RankActor {
    type Result = ();
    fn handle(&mut self, m: Abort, _: &mut Self::Context) {
        self.engine.abort(&m.0);
    }
}

impl Handler<Shutdown> for RankActor {
    type Result = ();
    fn handle(&mut self, _: Shutdown, _: &mut Self::Context) {
        self.engine.shutdown();
    }
}

/// Membership and failure handling for one job.
pub struct Coordinator {
    comms: Vec<Communicator>,
    root_cause: Arc<Mutex<Option<(usize, String)>>>,
    faults: Option<Arc<FaultInjector>>,
    dump: Option<PathBuf>,
    abort: Option<crate::driver::AbortHook>,
}

impl Coordinator {
    /// A coordinator for the communicators of every rank of the job.
    pub fn new(comms: Vec<Communicator>) -> Self {
        Coordinator { comms, root_cause: Arc::default(), faults: None, dump: None, abort: None }
    }

    /// Reports failures to a fault plan's injector and writes the collective-state dump
    /// (`--dump-on-failure`) at the first failure.
    pub fn with_supervision(
        mut self,
        faults: Option<Arc<FaultInjector>>,
        dump: Option<PathBuf>,
    ) -> Self {
        self.faults = faults;
        self.dump = dump;
        self
    }

    /// Also calls `abort` at the first failure (collectives that are not communicators).
    pub fn with_abort(mut self, abort: Option<crate::driver::AbortHook>) -> Self {
        self.abort = abort;
        self
    }

    /// Shared slot holding the first failure (rank, cause), readable after the job.
    pub fn root_cause_slot(&self) -> Arc<Mutex<Option<(usize, String)>>> {
        Arc::clone(&self.root_cause)
    }
}

impl Actor for Coordinator {
    type Context = Context<Self>;
}

impl Handler<RankFailed> for Coordinator {
    type Result = ();
    fn handle(&mut self, m: RankFailed, _: &mut Self::Context) {
        let Ok(mut slot) = self.root_cause.lock() else { return };
        if slot.is_some() {
            return; // ACT-2: consequences of the first failure.
        }
        tracing::error!(rank = m.rank, error = %m.error, "rank failed; aborting every communicator");
        let reason = format!("rank {} failed: {}", m.rank, m.error);
        // ACT-4: the state at the failure, before the abort ends every op.
        let diag = Diagnosis::capture(&self.comms, m.rank, &m.error);
        if diag.is_timeout() {
            eprintln!("{}", diag.report());
        }
        if let Some(p) = &self.dump {
            if let Err(e) = diag.write(p) {
                tracing::warn!("{e}");
            }
        }
        if let Some(f) = &self.faults {
            f.failure_detected(m.rank, &m.error);
        }
        *slot = Some((m.rank, m.error));
        for c in &self.comms {
            c.abort(&reason);
        }
        if let Some(a) = &self.abort {
            a(&reason);
        }
    }
}
