//! One training loop for every rank, whether the ranks are threads of this process
//! (`shardline train`) or one process each (a launched worker): resume, the per-step log,
//! progress, periodic checkpoints, interruption, evaluation and the summary exist once, here.
//! Either way each rank is a [`RankActor`] driven by messages; what differs between the two
//! sits behind [`Placement`]: [`local::InProcess`] and `launch`'s worker.
//!
//! Invariants:
//! - DRIVE-1: a configuration run in one process and the same one launched as processes
//!   write the same `--log-json` keys, and bitwise the same `step`, `epoch`, `loss`, `lr`,
//!   `grad_norm` and `stats_messages` on every line (the figures of a step are the job's,
//!   not a rank's: ENG-2). Timings are this process's ranks': `step_time_s` the slowest of
//!   them, `comm_s` and `comm_exposed_s` their mean.
//! - DRIVE-2: a step is checkpointed when it is a multiple of `--checkpoint-every`, the last
//!   step of the run, or the step at which the ranks agreed to stop (INT-1); a stop ends the
//!   run with [`RuntimeError::Interrupted`] naming that checkpoint.
//! - DRIVE-3: a rank's failure is reported with the first failing rank as its root cause
//!   (ACT-2), not the abort it caused elsewhere.
//! - DRIVE-7: each `--log-json` line reaches the file whole, in one write, as its step ends:
//!   a rank 0 killed later (SIGKILL, no unwinding) loses no step it logged and leaves no
//!   torn line, and the replacement or restarted rank 0 appends after it.
//! - DRIVE-8: a run recovered live after step `S` (not resumed) whose `--log-json` ends at
//!   step `S - 1` writes a line for `S` first, marked `"recovered": true` and without
//!   figures: `S` committed on the ranks that hold it, but the reduction that carries its
//!   loss and norm failed, so no rank logged it (LIVE-1). Every step of the run then has
//!   its line once. A log that ends elsewhere (a new rank 0's own file) is left as it is.
//!
//! Checkpoints written in the background (`--async-checkpoint`) are `background`'s, with
//! DRIVE-4..6.

mod background;
pub mod local;
mod stall_watch;

use background::Saves;
pub use background::{BackgroundSave, CheckpointStall, ShardWriteHook, WriteHooks};

use crate::actors::{
    Coordinator, Eval, FullParams, Load, RankActor, RankData, RankSnapshot, Shutdown, Snapshot,
    Step,
};
use crate::checkpoint::{self, CheckpointMeta};
use crate::engine::{Driven, StepStats};
use crate::error::{Result, RuntimeError};
use crate::fault::{FaultHook, FaultInjector};
use crate::memory::MemoryTracker;
use crate::optim::Optimizer;
use crate::shard::Stage;
use crate::straggler::Stragglers;
use crate::telemetry::Trace;
use crate::train::{self, JobPlan, RunOptions, Summary, TrainConfig};
use actix::prelude::*;
use shardline_collectives::Communicator;
use shardline_models::{DistributedSampler, Network};
use stall_watch::StallWatch;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the loop knows of the job: the same on every rank.
pub struct Job {
    /// The configuration.
    pub cfg: TrainConfig,
    /// Outputs and run length.
    pub opts: RunOptions,
    /// The model (SyncBatchNorm converted when on).
    pub model: Arc<dyn Network>,
    /// The stage used.
    pub stage: Stage,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Hash of the configuration a checkpoint must match to be resumed.
    pub hash: String,
    /// Optimizer steps of the whole job.
    pub total_steps: u64,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: u64,
    /// Whether SyncBatchNorm is on, and why.
    pub sync: (bool, String),
    /// The decoder's configuration when the model is `gpt`.
    pub gpt: Option<shardline_models::nn::GptConfig>,
    /// The shards of a checkpoint: the shard group's size (HSDP-2), the world without one;
    /// ranks `0..shards` write them. Set for one node; a launched worker sets it from the
    /// job's topology.
    pub shards: usize,
}

impl Job {
    /// Splits a rank's plan into what the loop needs and the data its ranks read (the
    /// training set behind the job's distributed sampler).
    pub fn from_plan(
        mut cfg: TrainConfig,
        opts: RunOptions,
        plan: JobPlan,
    ) -> Result<(Job, Arc<RankData>)> {
        // What `--stage auto --profile` chose stands in the configuration from here on
        // (checkpoints record it).
        cfg.shard_group = plan.engine.shard_group;
        cfg.gather_dtype = plan.engine.precision.gather_quant.map(|q| q.dtype);
        cfg.cross_node_reduce_dtype = plan.engine.cross_node_reduce.map(|q| q.dtype);
        let JobPlan {
            train,
            test,
            model,
            stage,
            sync,
            total_steps,
            steps_per_epoch,
            optimizer,
            hash,
            gpt,
            ..
        } = plan;
        let sampler =
            DistributedSampler::new(train.len(), cfg.world, cfg.batch_size, cfg.seed, true)
                .map_err(RuntimeError::from_model)?;
        let data = Arc::new(RankData { train: Arc::new(train), test: Arc::new(test), sampler });
        let single = shardline_collectives::Topology::single_node(cfg.world);
        let shards = crate::engine::checkpoint_shards(cfg.shard_group, stage, &single)?;
        let job = Job {
            shards,
            cfg,
            opts,
            model,
            stage,
            optimizer,
            hash,
            total_steps,
            steps_per_epoch,
            sync,
            gpt,
        };
        Ok((job, data))
    }

    /// The manifest fields of a checkpoint whose loader stands after batch `next_index - 1`
    /// of `epoch`.
    pub fn checkpoint_meta(&self, epoch: u64, next_index: u64) -> CheckpointMeta {
        let position =
            train::loader_position(self.steps_per_epoch, epoch, next_index, self.cfg.seed);
        let mut meta = train::checkpoint_meta(
            &self.cfg,
            self.stage,
            &self.hash,
            self.optimizer,
            &*self.model,
            self.gpt.as_ref(),
            position,
        );
        // HSDP-2: one copy of each shard.
        meta.world = self.shards;
        meta
    }
}

/// The ranks this process drives, as actors, in rank order.
pub struct Ranks {
    addrs: Vec<Addr<RankActor>>,
    ranks: Vec<usize>,
    root: Arc<Mutex<Option<(usize, String)>>>,
    coordinator: Addr<Coordinator>,
}

impl Ranks {
    /// The actors, in rank order.
    pub fn addrs(&self) -> &[Addr<RankActor>] {
        &self.addrs
    }

    /// The global rank of each actor.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Sends every actor the message `make(i)` and waits for all answers; the first failure
    /// becomes the error, named after the rank that failed first (DRIVE-3).
    pub async fn ask<T, M>(&self, make: impl Fn(usize) -> M, what: &str) -> Result<Vec<T>>
    where
        T: Send + 'static,
        M: Message<Result = std::result::Result<T, String>> + Send + 'static,
        RankActor: Handler<M>,
    {
        let futs: Vec<_> = self.addrs.iter().enumerate().map(|(i, a)| a.send(make(i))).collect();
        let mut out = Vec::with_capacity(futs.len());
        let mut first_err: Option<String> = None;
        for (i, f) in futs.into_iter().enumerate() {
            let r = self.ranks[i];
            match f.await {
                Ok(Ok(v)) => out.push(v),
                Ok(Err(e)) => {
                    first_err.get_or_insert(format!("rank {r}: {e}"));
                }
                Err(e) => {
                    first_err.get_or_insert(format!("rank {r} is gone ({e})"));
                }
            }
        }
        if let Some(e) = first_err {
            // A dead rank's reply channel closes before its death notice reaches the
            // coordinator (ACT-3): give the notice a moment so that the root cause is named.
            for _ in 0..400 {
                if self.root.lock().map(|s| s.is_some()).unwrap_or(true) {
                    break;
                }
                actix::clock::sleep(Duration::from_millis(5)).await;
            }
            let cause = self.root.lock().ok().and_then(|s| s.clone());
            let msg = match cause {
                Some((rank, c)) => format!("{what} failed: rank {rank} failed first: {c}"),
                None => format!("{what} failed: {e}"),
            };
            return Err(RuntimeError::Failed(msg));
        }
        Ok(out)
    }

    /// The coordinator, for a failure of a rank outside its actor (its checkpoint writer
    /// died) to be reported as the actor reports its own (ACT-1).
    pub fn coordinator(&self) -> Addr<Coordinator> {
        self.coordinator.clone()
    }

    /// Every rank's checkpointed state as it is now, at a step boundary (DRIVE-4).
    pub async fn snapshot(&self, step: u64) -> Result<Vec<RankSnapshot>> {
        self.ask(|_| Snapshot, &format!("snapshot of step {step}")).await
    }

    async fn shutdown(&self) {
        for a in &self.addrs {
            let _ = a.send(Shutdown).await;
        }
    }
}

/// What differs between ranks as threads of one process and one process per rank.
pub trait Placement {
    /// Whether this process speaks for the job: prints progress and the summary, and writes
    /// `--log-json` (LAUNCH-3).
    fn lead(&self) -> bool;

    /// Writes the checkpoint of `step` under `dir`: every rank's shard, then one commit once
    /// all are written (CKPT-1, LAUNCH-4).
    fn save(
        &self,
        ranks: &Ranks,
        dir: &Path,
        step: u64,
        meta: CheckpointMeta,
    ) -> impl std::future::Future<Output = Result<()>>;

    /// Starts the checkpoint of `step` under `dir` from the ranks' state now, and returns it
    /// in flight: a thread writes this process's shards, calling `hooks`, and commits them by
    /// the protocol of [`Placement::save`] (DRIVE-4..6).
    fn save_in_background(
        &self,
        ranks: &Ranks,
        dir: &Path,
        step: u64,
        meta: CheckpointMeta,
        hooks: WriteHooks,
    ) -> impl std::future::Future<Output = Result<BackgroundSave>>;

    /// A step finished (a launched rank 0 publishes it for its agent, LAUNCH-9).
    fn step_done(&self, _step: u64) {}
}

/// The ranks' engines and what watches them.
pub struct Engines {
    /// One engine per rank this process drives, in rank order.
    pub engines: Vec<Box<dyn Driven>>,
    /// Every communicator of this process (the coordinator aborts them at a failure).
    pub comms: Vec<Communicator>,
    /// The data every rank reads its batches from.
    pub data: Arc<RankData>,
    /// A fault plan's injector (step progress, failure reports), in one process.
    pub faults: Option<Arc<FaultInjector>>,
    /// Called when a rank has written its checkpoint shard (an injected fault's point).
    pub checkpoint_hook: Option<FaultHook>,
    /// Where to write the collective-state dump at the first failure.
    pub dump_on_failure: Option<PathBuf>,
    /// Called with the reason at the first failure, after the communicators are aborted:
    /// what else must stop waiting (a device engine's collectives).
    pub abort: Option<AbortHook>,
    /// Live recovery (LIVE-1): where a failed run leaves what each rank kept between steps.
    pub keep_on_failure: Option<KeptStates>,
    /// The steps the ranks' state already holds (live recovery installed it); 0 otherwise.
    pub start_step: u64,
}

/// Where a failed run leaves each of this process's ranks' state for live recovery.
pub type KeptStates = Arc<Mutex<Vec<crate::engine::live::LiveState>>>;

/// Aborts collectives the coordinator does not hold as communicators.
pub type AbortHook = Arc<dyn Fn(&str) + Send + Sync>;

/// Runs `job` on `engines` in an actor system of its own; blocks until the run ends. The
/// summary's memory fields are left to the caller, which holds the trackers.
pub fn run<P: Placement>(job: Job, engines: Engines, placement: P) -> Result<Summary> {
    let system = actix::System::new();
    system.block_on(drive(job, engines, placement))
}

fn start_actors(e: Engines) -> Ranks {
    let coordinator = Coordinator::new(e.comms)
        .with_supervision(e.faults.clone(), e.dump_on_failure)
        .with_abort(e.abort);
    let root = coordinator.root_cause_slot();
    let coord = coordinator.start();
    let ranks: Vec<usize> = e.engines.iter().map(|x| x.rank()).collect();
    let mut addrs = Vec::with_capacity(e.engines.len());
    for engine in e.engines {
        let slot = Arc::new(Mutex::new(Some(engine)));
        let (data, coord) = (Arc::clone(&e.data), coord.clone());
        let (faults, hook) = (e.faults.clone(), e.checkpoint_hook.clone());
        addrs.push(SyncArbiter::start(1, move || {
            let engine = slot.lock().ok().and_then(|mut s| s.take());
            // The factory runs once: a SyncArbiter of one thread.
            RankActor::new(
                engine.expect("rank engine handed to its actor once"),
                Arc::clone(&data),
                coord.clone(),
            )
            .with_faults(faults.clone())
            .with_checkpoint_hook(hook.clone())
        }));
    }
    Ranks { addrs, ranks, root, coordinator: coord }
}

/// Progress for a person: a bar on a terminal, else a line every ten steps.
enum Progress {
    Off,
    Bar(indicatif::ProgressBar),
    Lines,
}

impl Progress {
    fn new(show: bool, steps: u64) -> Self {
        if !show {
            return Progress::Off;
        }
        if !std::io::stderr().is_terminal() {
            return Progress::Lines;
        }
        let b = indicatif::ProgressBar::new(steps);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta}]",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Progress::Bar(b)
    }

    fn step(&self, done: u64, total: u64, last: bool, loss: f32, step_s: f64, samples: usize) {
        match self {
            Progress::Off => {}
            Progress::Bar(b) => {
                let sps = samples as f64 / step_s.max(1e-9);
                b.set_message(format!("loss {loss:.4}  {sps:.0} samples/s"));
                b.inc(1);
            }
            Progress::Lines if done.is_multiple_of(10) || last => {
                println!("  step {done}/{total}: loss {loss:.4}, {:.1} ms", step_s * 1e3);
            }
            Progress::Lines => {}
        }
    }

    fn finish(&self) {
        if let Progress::Bar(b) = self {
            b.finish_and_clear();
        }
    }
}

/// `--log-json`: one JSON object per step, appended.
/// The `--log-json` file, and this process's hybrid transport counts (HYB-4) at the last
/// line, so that each line carries what was sent inside and across nodes since. A
/// [`std::io::LineWriter`]: every line goes to the file in one write when complete (DRIVE-7).
struct StepLog(Option<std::io::LineWriter<std::fs::File>>, (u64, u64, u64));

/// This process's hybrid transport counts (HYB-4): inside the node, across nodes, and the
/// part of the latter on gather lanes.
fn hybrid_sent() -> (u64, u64, u64) {
    use shardline_collectives::transport::hybrid::{sent_bytes, sent_gather_bytes_across};
    let (intra, inter) = sent_bytes();
    (intra, inter, sent_gather_bytes_across())
}

impl StepLog {
    fn open(path: Option<&Path>) -> Result<Self> {
        let sent = hybrid_sent();
        let Some(p) = path else { return Ok(StepLog(None, sent)) };
        let f = std::fs::OpenOptions::new().create(true).append(true).open(p).map_err(|e| {
            RuntimeError::config(format!("cannot open --log-json {}: {e}", p.display()))
        })?;
        Ok(StepLog(Some(std::io::LineWriter::new(f)), sent))
    }

    /// DRIVE-8: writes the line of step `step` (epoch `epoch`), committed but never logged,
    /// when the log at `path` ends at the step before it.
    fn fill_recovered(&mut self, path: Option<&Path>, step: u64, epoch: u64) -> Result<()> {
        let Some(p) = path.filter(|_| self.0.is_some() && step > 0) else { return Ok(()) };
        if last_logged_step(p) != Some(step - 1) {
            return Ok(());
        }
        self.write(serde_json::json!({ "step": step, "epoch": epoch, "recovered": true }))
    }

    fn write(&mut self, mut line: serde_json::Value) -> Result<()> {
        let now = hybrid_sent();
        if let Some(o) = line.as_object_mut() {
            o.insert("intra_node_bytes".into(), (now.0 - self.1 .0).into());
            o.insert("inter_node_bytes".into(), (now.1 - self.1 .1).into());
            o.insert("inter_node_gather_bytes".into(), (now.2 - self.1 .2).into());
        }
        self.1 = now;
        match self.0.as_mut() {
            Some(w) => writeln!(w, "{line}")
                .map_err(|e| RuntimeError::config(format!("writing --log-json: {e}"))),
            None => Ok(()),
        }
    }

    fn flush(&mut self) -> Result<()> {
        match self.0.as_mut() {
            Some(w) => {
                w.flush().map_err(|e| RuntimeError::config(format!("writing --log-json: {e}")))
            }
            None => Ok(()),
        }
    }
}

/// The step of the last whole line of the `--log-json` file at `path` (its last 64 KiB
/// read), if it has one.
fn last_logged_step(path: &Path) -> Option<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(64 << 10))).ok()?;
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).ok()?;
    last_step(&String::from_utf8_lossy(&tail))
}

/// DRIVE-8: the `step` of the last line of `text` that parses, if any.
fn last_step(text: &str) -> Option<u64> {
    text.lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .and_then(|v| v["step"].as_u64())
}

/// One step's figures over this process's ranks (DRIVE-1).
struct StepFigures {
    first: StepStats,
    step_s: f64,
    comm_s: f64,
    exposed_s: f64,
    peak: u64,
}

impl StepFigures {
    fn of(mut stats: Vec<StepStats>) -> Self {
        let n = stats.len().max(1) as f64;
        let step_s = stats.iter().map(|s| s.step_time.as_secs_f64()).fold(0.0, f64::max);
        let exposed_s = stats.iter().map(|s| s.comm_exposed.as_secs_f64()).sum::<f64>() / n;
        let comm_s = stats.iter().map(|s| s.comm_time.as_secs_f64()).sum::<f64>() / n;
        let peak = stats.iter().map(|s| s.peak_bytes).max().unwrap_or(0);
        StepFigures { first: stats.swap_remove(0), step_s, comm_s, exposed_s, peak }
    }

    fn json(&self, step: u64, epoch: u64, stragglers: &[usize]) -> serde_json::Value {
        let s = &self.first;
        serde_json::json!({
            "stragglers": stragglers,
            "step": step, "epoch": epoch, "loss": s.loss, "lr": s.lr, "step_time_s": self.step_s,
            "comm_exposed_s": self.exposed_s, "compute_s": s.compute_time.as_secs_f64(),
            "comm_s": self.comm_s, "peak_bytes": self.peak, "stats_messages": s.stats_messages,
            "grad_norm": s.grad_norm, "gather_bytes": s.gather_bytes,
            "reduce_bytes": s.reduce_bytes, "replica_bytes": s.replica_bytes,
            "hpz_bytes": s.hpz_bytes,
            "cast_s": s.cast_time.as_secs_f64(),
        })
    }
}

/// Refuses an output file `file` (given by `flag`) whose directory does not exist, naming
/// both, before any work that would be lost when the file cannot be written.
pub fn check_output_dir(flag: &str, file: &Path) -> Result<()> {
    let parent = file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if parent.is_dir() {
        return Ok(());
    }
    Err(RuntimeError::config(format!(
        "{flag} {}: the directory {} does not exist",
        file.display(),
        parent.display()
    )))
}

/// Refuses run options that cannot work, before any rank meets another: every rank then
/// reports the same error itself, instead of one reporting it and the others the transport
/// failure its exit causes.
pub(crate) fn check_options(opts: &RunOptions) -> Result<()> {
    if opts.resume && opts.checkpoint_dir.is_none() {
        return Err(RuntimeError::config("--resume needs --checkpoint-dir"));
    }
    if opts.async_checkpoint && opts.checkpoint_dir.is_none() {
        return Err(RuntimeError::config("--async-checkpoint needs --checkpoint-dir"));
    }
    // The dump is written when the run fails: a path it cannot be written to would lose it
    // just when it is needed.
    if let Some(f) = &opts.dump_on_failure {
        check_output_dir("--dump-on-failure", f)?;
    }
    if let Some(d) = opts.checkpoint_dir.as_deref().filter(|d| d.exists() && !d.is_dir()) {
        return Err(RuntimeError::config(format!(
            "--checkpoint-dir {} is a file, not a directory",
            d.display()
        )));
    }
    Ok(())
}

/// Loads the newest checkpoint that verifies into every rank when `--resume` asks (CKPT-5);
/// the steps it holds. Each process selects on its own: every rank, in this process or in
/// its own, runs the same selection over the same files, so all load the same checkpoint.
/// The lead process names each checkpoint skipped on stderr, whether or not it is quiet,
/// and moves it aside (CKPT-6).
async fn resume(job: &Job, ranks: &Ranks, lead: bool, speak: bool) -> Result<u64> {
    let dir = job
        .opts
        .checkpoint_dir
        .as_ref()
        .ok_or_else(|| RuntimeError::config("--resume needs --checkpoint-dir"))?;
    let Some(found) = checkpoint::newest_verified(dir, &job.hash, &job.model.spec())? else {
        if speak {
            println!("  no checkpoint in {} yet; starting fresh", dir.display());
        }
        return Ok(0);
    };
    if lead {
        for s in &found.skipped {
            // One write per line.
            let line =
                format!("shardline: skipping checkpoint {}: {}\n", s.dir.display(), s.reason);
            eprint!("{line}");
            // CKPT-6: the run will write this step again.
            let to = checkpoint::set_aside(&s.dir)?;
            let line = format!("shardline: moved {} to {}\n", s.dir.display(), to.display());
            eprint!("{line}");
        }
    }
    let ck = found.checkpoint;
    let latest = ck.dir().to_path_buf();
    let buffers = ck.buffers()?;
    let step = ck.manifest().step;
    // HSDP-2: rank r holds shard r % shards, whichever group shape wrote the checkpoint.
    let world = job.shards;
    let mut shards: Vec<_> = if ranks.ranks().len() >= world {
        let all = ck.load_all(world)?;
        ranks.ranks().iter().map(|&r| all[r % world].clone()).collect()
    } else {
        ranks.ranks().iter().map(|&r| ck.load_rank(r % world, world)).collect::<Result<_>>()?
    };
    let shards: Vec<_> = shards.drain(..).map(Some).collect();
    let shards = Mutex::new(shards);
    ranks
        .ask(
            |i| Load {
                shard: shards.lock().ok().and_then(|mut s| s[i].take()).unwrap_or_default(),
                buffers: buffers.clone(),
                step,
            },
            "resume",
        )
        .await?;
    if speak {
        println!(
            "  resumed from {} (step {step}), written by world {}",
            latest.display(),
            ck.manifest().world
        );
    }
    Ok(step)
}

/// LIVE-5: a run recovered live after step `step` writes that step's checkpoint now when it
/// was due (DRIVE-2) and is not committed: the failure hit its write. Nothing is lost, not
/// even the last step's.
async fn save_missed<P: Placement>(
    job: &Job,
    ranks: &Ranks,
    placement: &P,
    step: u64,
) -> Result<()> {
    let Some(dir) = &job.opts.checkpoint_dir else { return Ok(()) };
    let every = job.opts.checkpoint_every;
    let due = (every > 0 && step.is_multiple_of(every)) || step == job.total_steps;
    if !due || checkpoint::committed(dir)?.iter().any(|(s, _)| *s == step) {
        return Ok(());
    }
    let (epoch, index) = ((step - 1) / job.steps_per_epoch, (step - 1) % job.steps_per_epoch);
    placement.save(ranks, dir, step, job.checkpoint_meta(epoch, index + 1)).await
}

async fn drive<P: Placement>(job: Job, engines: Engines, placement: P) -> Result<Summary> {
    let started = Instant::now();
    let hooks = WriteHooks {
        before: job.opts.before_shard_write.clone(),
        written: engines.checkpoint_hook.clone(),
    };
    // STALL-1: a step that stops progressing is reported long before the timeout.
    let speak = placement.lead() && !job.opts.quiet;
    let timeout = Duration::from_secs(job.cfg.timeout_s.max(1));
    let watch = StallWatch::start(timeout, engines.comms.clone(), speak);
    let (keep, start_step) = (engines.keep_on_failure.clone(), engines.start_step);
    let ranks = start_actors(engines);
    let mut saves = Saves::default();
    let begun = std::cell::Cell::new(false);
    let result = steps(
        &job,
        &ranks,
        &placement,
        started,
        (&hooks, &watch),
        &mut saves,
        (start_step, &begun),
    )
    .await;
    if result.is_err() {
        saves.abandon();
        // LIVE-1: a state is kept only from a run that stood at its start step (resumed or
        // recovered): an engine that failed before holds its initial state, no step's.
        if let Some(slot) = keep.filter(|_| begun.get()) {
            // LIVE-1: each engine says itself whether its state is clean.
            if let Ok(states) = ranks.ask(|_| crate::actors::TakeLive, "keeping state").await {
                if let Ok(mut s) = slot.lock() {
                    *s = states;
                }
            }
        }
    }
    ranks.shutdown().await;
    System::current().stop();
    result
}

async fn steps<P: Placement>(
    job: &Job,
    ranks: &Ranks,
    placement: &P,
    started: Instant,
    (hooks, watch): (&WriteHooks, &StallWatch),
    saves: &mut Saves,
    (start_step, begun): (u64, &std::cell::Cell<bool>),
) -> Result<Summary> {
    let (cfg, opts) = (&job.cfg, &job.opts);
    let lead = placement.lead();
    let speak = lead && !opts.quiet;
    let mut done = if opts.resume { resume(job, ranks, lead, speak).await? } else { start_step };
    begun.set(true);
    if !opts.resume && start_step > 0 {
        save_missed(job, ranks, placement, start_step).await?;
    }
    let mut log = StepLog::open(opts.log_json.as_deref().filter(|_| lead))?;
    if !opts.resume && start_step > 0 {
        log.fill_recovered(
            opts.log_json.as_deref(),
            start_step,
            (start_step - 1) / job.steps_per_epoch,
        )?;
    }
    let remaining = job.total_steps.saturating_sub(done);
    let run_steps = opts.stop_after.map_or(remaining, |s| s.min(remaining));
    let first = done;
    let progress = Progress::new(lead && opts.progress, run_steps);
    let (mut losses, mut step_stats, mut step_times, mut exposed_frac) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let t_loop = Instant::now();
    let mut interrupted = None::<i32>;
    let mut stragglers = Stragglers::new(opts.stragglers);
    let mut warned_nonfinite = false;
    for _ in 0..run_steps {
        // INT-1: this process's wish to stop travels with the step's loss reduction, so
        // every rank of the job learns it from the same step.
        let stop = opts.stop_on_signal && crate::interrupt::requested().is_some();
        let epoch = done / job.steps_per_epoch;
        let index = (done % job.steps_per_epoch) as usize;
        watch.begin(done + 1);
        let stats =
            ranks.ask(|_| Step { epoch, index, stop }, &format!("step {}", done + 1)).await?;
        watch.end();
        done += 1;
        placement.step_done(done);
        let f = StepFigures::of(stats);
        metrics::histogram!("shardline_step_seconds").record(f.step_s);
        metrics::gauge!("shardline_loss").set(f.first.loss as f64);
        metrics::histogram!("shardline_comm_exposed_seconds").record(f.exposed_s);
        metrics::counter!("shardline_steps_total").increment(1);
        metrics::gauge!("shardline_peak_bytes").set(f.peak as f64);
        // STRAG-1: every process reads the same busy times, so all reach the same verdict.
        for s in stragglers.observe(&f.first.rank_busy_s) {
            metrics::gauge!("shardline_straggler_ratio", "rank" => s.rank.to_string())
                .set(s.ratio());
            tracing::warn!(rank = s.rank, step = done, "{s}");
            if lead {
                eprintln!("warning: step {done}: {s}");
            }
            if opts.evict_stragglers {
                log.write(f.json(done, epoch, &stragglers.flagged()))?;
                log.flush()?;
                return Err(RuntimeError::Failed(format!(
                    "step {done}: {s}; evicted (--evict-stragglers)"
                )));
            }
        }
        // The first step whose loss is NaN or infinite is named once: every step after it
        // trains damaged parameters, and a summary's "final loss NaN" does not say when.
        if !f.first.loss.is_finite() && !warned_nonfinite {
            warned_nonfinite = true;
            if lead {
                eprintln!(
                    "warning: step {done}: the loss is {} (not finite); the parameters are \
                     damaged from here on (try a lower --lr or --clip-grad-norm)",
                    f.first.loss
                );
            }
        }
        log.write(f.json(done, epoch, &stragglers.flagged()))?;
        let last = done - first == run_steps;
        progress.step(done, job.total_steps, last, f.first.loss, f.step_s, cfg.batch_size);
        losses.push(f.first.loss);
        step_times.push(f.step_s);
        exposed_frac.push(if f.step_s > 0.0 { f.exposed_s / f.step_s } else { 0.0 });
        let stop_now = f.first.stop;
        step_stats.push(f.first);
        // A background save that ended fails the run now if it failed (DRIVE-5).
        saves.poll()?;
        if let Some(dir) = &opts.checkpoint_dir {
            let every = opts.checkpoint_every;
            // DRIVE-2.
            if (every > 0 && done.is_multiple_of(every)) || last || stop_now {
                let meta = job.checkpoint_meta(epoch, index as u64 + 1);
                if opts.async_checkpoint {
                    // DRIVE-5: the previous one commits before this one begins.
                    saves.wait()?;
                    let t = Instant::now();
                    let save =
                        placement.save_in_background(ranks, dir, done, meta, hooks.clone()).await?;
                    saves.started(save, t.elapsed());
                } else {
                    let t = Instant::now();
                    placement.save(ranks, dir, done, meta).await?;
                    saves.done_in_place(done, t.elapsed());
                }
            }
        }
        if stop_now {
            // Every rank saw the same flag in the same reduction: all stop here (INT-1).
            interrupted = Some(crate::interrupt::requested().unwrap_or(libc::SIGTERM));
            break;
        }
    }
    progress.finish();
    log.flush()?;
    if let Some(signal) = interrupted {
        // The stop's checkpoint is the one the error names: committed first (DRIVE-5).
        saves.wait()?;
        let checkpoint = match &opts.checkpoint_dir {
            Some(dir) => checkpoint::latest(dir)?,
            None => None,
        };
        return Err(RuntimeError::Interrupted { signal, step: done, checkpoint });
    }
    let loop_s = t_loop.elapsed().as_secs_f64();
    let ev = ranks.ask(|_| Eval, "evaluation").await?;
    let (correct, count, test_loss) = ev[0];
    let (final_params, final_buffers) = if opts.skip_final_params {
        (Vec::new(), Vec::new())
    } else {
        let mut full = ranks.ask(|_| FullParams, "gathering parameters").await?;
        full.swap_remove(0)
    };
    // The last checkpoint was written while the ranks evaluated; the run ends once it is
    // committed (DRIVE-5).
    saves.wait()?;
    Ok(Summary {
        steps: run_steps,
        total_steps: done,
        test_accuracy: if count > 0 { correct as f64 / count as f64 } else { 0.0 },
        test_loss,
        test_count: count,
        final_loss: losses.last().copied().unwrap_or(f32::NAN),
        steps_per_s: if loop_s > 0.0 { run_steps as f64 / loop_s } else { 0.0 },
        median_step_s: train::median(&mut step_times),
        comm_exposed_frac: if exposed_frac.is_empty() {
            0.0
        } else {
            exposed_frac.iter().sum::<f64>() / exposed_frac.len() as f64
        },
        peak_bytes: vec![],
        peak_by_category: vec![],
        stage: job.stage.index(),
        sync_bn: job.sync.clone(),
        stats_messages_per_step: step_stats.last().map_or(0, |s| s.stats_messages),
        wall_s: started.elapsed().as_secs_f64(),
        losses,
        final_params,
        final_buffers,
        step_stats,
        checkpoint_stalls: saves.stalls().to_vec(),
    })
}

/// After a run: writes the trace to `trace_path` (when one was asked for), fills the summary's
/// memory fields from this process's trackers and prints the summary where `speak`.
pub fn finish(
    result: Result<Summary>,
    trace: &Trace,
    trace_path: Option<&Path>,
    trackers: &[MemoryTracker],
    speak: bool,
) -> Result<Summary> {
    if let (Some(path), true) = (trace_path, trace.enabled()) {
        trace
            .write_chrome(path)
            .map_err(|e| RuntimeError::config(format!("writing trace {}: {e}", path.display())))?;
    }
    let mut summary = result?;
    add_memory(&mut summary, trackers);
    if speak {
        train::print_summary(&summary, trackers);
    }
    Ok(summary)
}

/// Fills a summary's memory fields from the trackers of this process's ranks.
fn add_memory(summary: &mut Summary, trackers: &[MemoryTracker]) {
    summary.peak_bytes = trackers.iter().map(|t| t.peak_total()).collect();
    summary.peak_by_category = trackers
        .iter()
        .map(|t| {
            crate::memory::Category::ALL.iter().map(|c| (c.key().to_string(), t.peak(*c))).collect()
        })
        .collect();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DRIVE-7: a logged line is in the file, whole, before anything is flushed or dropped
    /// (what a SIGKILL of rank 0 would leave).
    #[test]
    fn a_logged_step_is_in_the_file_at_once_drive_7() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("steps.jsonl");
        let mut log = StepLog::open(Some(&path)).expect("open");
        for step in 1..=3u64 {
            log.write(serde_json::json!({ "step": step })).expect("write");
            let text = std::fs::read_to_string(&path).expect("read");
            let steps: Vec<u64> = text
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("whole line"))
                .filter_map(|v| v["step"].as_u64())
                .collect();
            assert_eq!(steps, (1..=step).collect::<Vec<_>>(), "{text}");
            assert!(text.ends_with('\n'), "{text}");
        }
        std::mem::forget(log);
    }

    /// DRIVE-8: a recovered run writes the committed step's line only where the log ends at
    /// the step before it.
    #[test]
    fn a_committed_step_nobody_logged_gets_its_line_drive_8() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("steps.jsonl");
        let steps = |p: &Path| -> Vec<(u64, bool)> {
            std::fs::read_to_string(p)
                .unwrap_or_default()
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("whole line"))
                .map(|v| (v["step"].as_u64().unwrap(), v["recovered"].as_bool().unwrap_or(false)))
                .collect()
        };
        let mut log = StepLog::open(Some(&path)).expect("open");
        log.write(serde_json::json!({ "step": 1 })).expect("write");
        log.write(serde_json::json!({ "step": 2 })).expect("write");
        log.fill_recovered(Some(&path), 3, 0).expect("fill");
        assert_eq!(steps(&path), vec![(1, false), (2, false), (3, true)]);
        // Step 3 is logged now: recovering after it again writes nothing, nor does a gap.
        log.fill_recovered(Some(&path), 3, 0).expect("fill");
        log.fill_recovered(Some(&path), 6, 0).expect("fill");
        assert_eq!(steps(&path).len(), 3);
        // A new rank 0's own, empty log is left as it is.
        let other = dir.path().join("other.jsonl");
        let mut fresh = StepLog::open(Some(&other)).expect("open");
        fresh.fill_recovered(Some(&other), 3, 0).expect("fill");
        assert!(steps(&other).is_empty());
        assert_eq!(last_step("{\"step\": 4}\n{\"step\": 5}\n{\"st"), Some(5), "a torn tail");
    }
}
