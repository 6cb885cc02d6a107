//! Every rank as threads of this process, over the local transport (`shardline train`
//! without a launch environment).

use super::background::died_writing;
use super::{AbortHook, BackgroundSave, Engines, Job, Placement, Ranks, WriteHooks};
use crate::actors::{Buffers, RankFailed, Save};
use crate::checkpoint::{CheckpointMeta, PendingCheckpoint};
use crate::engine::{Driven, EngineConfig, RankEngine};
use crate::error::{Result, RuntimeError};
use crate::memory::MemoryTracker;
use crate::telemetry::Trace;
use crate::train::{self, JobPlan, RunOptions, Summary, TrainConfig, MAX_LOCAL_WORLD};
use shardline_collectives::{local_group_with_topology, CommOptions, Communicator, Topology};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Ranks as threads of one process: this process speaks for the job and writes every shard.
pub struct InProcess;

impl Placement for InProcess {
    fn lead(&self) -> bool {
        true
    }

    async fn save(&self, ranks: &Ranks, dir: &Path, step: u64, meta: CheckpointMeta) -> Result<()> {
        let pending = Arc::new(PendingCheckpoint::begin(dir, step)?);
        // HSDP-2: the first replica group's ranks write the shards.
        let files = ranks
            .ask(|_| Save(Arc::clone(&pending), meta.world), &format!("checkpoint at step {step}"))
            .await?
            .into_iter()
            .flatten()
            .collect();
        // Buffers are replicated: rank 0's, read without any collective (gathering the
        // parameters here would put the whole model on every rank at every checkpoint).
        let buffers = ranks.addrs()[0]
            .send(Buffers)
            .await
            .map_err(|e| RuntimeError::config(format!("checkpoint buffers: rank 0: {e}")))?;
        let pending = Arc::try_unwrap(pending)
            .map_err(|_| RuntimeError::config("checkpoint still shared"))?;
        pending.commit(meta, files, &buffers)?;
        Ok(())
    }

    /// Every rank's shard is written by a thread of its own, as the ranks' actors write
    /// them in [`InProcess::save`], then committed with rank 0's buffers.
    async fn save_in_background(
        &self,
        ranks: &Ranks,
        dir: &Path,
        step: u64,
        meta: CheckpointMeta,
        hooks: WriteHooks,
    ) -> Result<BackgroundSave> {
        let snaps = ranks.snapshot(step).await?;
        let (dir, coordinator) = (dir.to_path_buf(), ranks.coordinator());
        // A failing run waits for it: a restart in this process must not meet its commit.
        BackgroundSave::start(step, true, move || {
            let pending = PendingCheckpoint::begin(&dir, step)?;
            // HSDP-2: the first replica group's ranks write the shards.
            let writing: Vec<_> = snaps.iter().filter(|snap| snap.rank < meta.world).collect();
            let files = std::thread::scope(|s| {
                let (pending, hooks) = (&pending, &hooks);
                let writers: Vec<_> = writing
                    .iter()
                    .map(|&snap| s.spawn(move || hooks.write(pending, snap)))
                    .collect();
                writers
                    .into_iter()
                    .zip(&writing)
                    .map(|(w, snap)| {
                        w.join().unwrap_or_else(|p| {
                            // The rank died (an injected kill): as when its actor dies, the
                            // coordinator aborts the steps and names it (ACT-1, ACT-3).
                            let e = died_writing(snap, &*p);
                            let error = e.to_string();
                            coordinator.do_send(RankFailed { rank: snap.rank, error });
                            Err(e)
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })?;
            pending.commit(meta, files, &snaps[0].buffers)?;
            Ok(())
        })
    }
}

/// The ranks' engines of a job in this process and what goes with them.
pub struct Built {
    /// One engine per rank, in rank order.
    pub engines: Vec<Box<dyn Driven>>,
    /// The communicators the coordinator aborts at a failure (and captures for a dump).
    pub comms: Vec<Communicator>,
    /// Anything else to abort at a failure (a device engine's collectives).
    pub abort: Option<AbortHook>,
    /// The ranks' memory trackers, for the summary.
    pub trackers: Vec<MemoryTracker>,
    /// The host engine's trace (disabled otherwise).
    pub trace: Trace,
}

/// Runs a training job with every rank in this process, its plan derived from the
/// configuration by `plan` once the world is known to fit; blocks until it ends.
pub fn run(
    cfg: TrainConfig,
    opts: RunOptions,
    plan: impl FnOnce(&TrainConfig) -> Result<JobPlan>,
) -> Result<Summary> {
    run_built(cfg, opts, plan, host_engines)
}

/// [`run`] with the engines `build` makes for the job (the host engine's, or the device
/// engine's on simulated devices): the same loop, checkpoints, evaluation and summary.
pub fn run_built(
    cfg: TrainConfig,
    opts: RunOptions,
    plan: impl FnOnce(&TrainConfig) -> Result<JobPlan>,
    build: impl FnOnce(&Job, EngineConfig, &RunOptions) -> Result<Built>,
) -> Result<Summary> {
    if cfg.world > MAX_LOCAL_WORLD {
        return Err(RuntimeError::config(format!(
            "--world {}: without `shardline launch` every rank is a set of threads of this one \
             process (an actor and three lanes, each with its own copy of the model state); at \
             most {MAX_LOCAL_WORLD} run here. Start more ranks as processes: shardline launch \
             --nproc-per-node N [--nnodes M ...] -- train ...",
            cfg.world
        )));
    }
    super::check_options(&opts)?;
    let p = plan(&cfg)?;
    if !opts.quiet {
        train::print_header(&cfg, &p);
    }
    let ecfg = p.engine.clone();
    let (job, data) = Job::from_plan(cfg, opts.clone(), p)?;
    let b = build(&job, ecfg, &opts)?;
    let ranks = Engines {
        engines: b.engines,
        comms: b.comms,
        data,
        faults: opts.faults.clone(),
        checkpoint_hook: opts.faults.as_ref().map(|f| f.hook()),
        dump_on_failure: opts.dump_on_failure.clone(),
        abort: b.abort,
        keep_on_failure: None,
        start_step: 0,
    };
    let result = super::run(job, ranks, InProcess);
    super::finish(result, &b.trace, opts.trace.as_deref(), &b.trackers, !opts.quiet)
}

/// The host engine's ranks over the local transport.
fn host_engines(job: &Job, ecfg: EngineConfig, opts: &RunOptions) -> Result<Built> {
    let (cfg, model) = (&job.cfg, Arc::clone(&job.model));
    let mut copts = CommOptions::new();
    copts.timeout(Duration::from_secs(cfg.timeout_s));
    if cfg.link_rate.is_some() {
        copts.link_rate(cfg.link_rate);
    }
    let comms = match &opts.faults {
        Some(f) => f.local_group(Topology::single_node(cfg.world), copts)?,
        None => local_group_with_topology(Topology::single_node(cfg.world), copts)?,
    };
    let trace = if opts.trace.is_some() { Trace::new() } else { Trace::disabled() };
    if let Some(f) = &opts.faults {
        f.attach_trace(&trace);
    }

    // Every rank of the job lives in this process: refuse what cannot fit before any of
    // them allocates (each engine also checks its own share).
    let layout = crate::shard::ShardedModelLayout::new(&model.spec(), cfg.world)?;
    crate::engine::check_fits_host(
        &layout,
        ecfg.stage,
        ecfg.optimizer.state_len_per_param(),
        (cfg.world, &format!("the {} ranks of this process", cfg.world)),
        crate::memory::host_memory_bytes(),
    )?;
    // Build every engine concurrently: opening lanes is collective.
    let engines: Vec<Result<RankEngine>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let (c, m, e, t) = (c.clone(), Arc::clone(&model), ecfg.clone(), trace.clone());
                let mem = MemoryTracker::new(c.rank(), cfg.device_memory);
                s.spawn(move || RankEngine::new(c, m, e, mem, t))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(RuntimeError::config("engine construction panicked")))
            })
            .collect()
    });
    let mut engines: Vec<RankEngine> = engines.into_iter().collect::<Result<_>>()?;
    if let Some(f) = &opts.faults {
        engines.iter_mut().for_each(|e| e.set_fault_hook(f.hook()));
    }
    if let Some(o) = &opts.backend {
        engines.iter_mut().for_each(|e| e.set_backend((o.0)(e.rank())));
    }
    let trackers: Vec<MemoryTracker> = engines.iter().map(|e| e.memory().clone()).collect();
    let engines = engines.into_iter().map(|e| Box::new(e) as Box<dyn Driven>).collect();
    Ok(Built { engines, comms, abort: None, trackers, trace })
}
