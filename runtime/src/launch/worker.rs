//! One process per rank: the worker side of `shardline train` in a launch environment. The
//! rank runs as an actor under [`crate::driver`], like every rank in one process; what
//! differs is [`Launched`]: rank 0 speaks for the job, and checkpoints are written by every
//! process and committed through the store (LAUNCH-4).

use super::env::WorkerEnv;
use super::rendezvous::{join_job, store_err, Joined};
use crate::actors::{Buffers, Save};
use crate::checkpoint::{CheckpointMeta, FileEntry, PendingCheckpoint};
use crate::driver::{self, BackgroundSave, Engines, Job, Placement, Ranks, WriteHooks};
use crate::engine::RankEngine;
use crate::error::{Result, RuntimeError};
use crate::fault::{FaultHook, FaultSpec, Phase};
use crate::memory::MemoryTracker;
use crate::telemetry::Trace;
use crate::train::{self, RunOptions, Summary, TrainConfig};
use shardline_collectives::{blocked, Lane, Store};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Runs this process as rank `env.rank` of a multi-process job (LAUNCH-3). `cfg.world` is
/// taken from the environment. Every rank returns the summary; only rank 0 prints.
pub fn run_worker(mut cfg: TrainConfig, opts: RunOptions, env: &WorkerEnv) -> Result<Summary> {
    if cfg.world != env.world {
        tracing::info!("world {} from the launch environment (not {})", env.world, cfg.world);
        cfg.world = env.world;
    }
    // Where `--stage auto --profile` places the shard groups.
    cfg.ranks_per_node = Some(env.local_world);
    let plan = train::plan(&cfg)?;
    run_worker_planned(cfg, opts, env, plan)
}

/// [`run_worker`] with the job already planned (data loaded, model built) by
/// `train::plan(&cfg)`, `cfg.world` being `env.world`: what a caller measuring the run
/// alone, without the loading, starts from.
pub fn run_worker_planned(
    cfg: TrainConfig,
    opts: RunOptions,
    env: &WorkerEnv,
    plan: train::JobPlan,
) -> Result<Summary> {
    if cfg.world != env.world {
        return Err(RuntimeError::config(format!(
            "planned for world {} but the launch environment has {}",
            cfg.world, env.world
        )));
    }
    crate::driver::check_options(&opts)?;
    if env.live {
        // LIVE-4: epoch after epoch, the survivors in this process.
        return super::live::run_live(
            cfg,
            opts,
            env,
            plan,
            |cfg, opts, env, plan, joined, live| {
                announce(&cfg, &opts, env, &plan, &joined);
                run_rank(cfg, opts, env, plan, joined, Some(live))
            },
        );
    }
    let joined = join_job(&cfg, env)?;
    announce(&cfg, &opts, env, &plan, &joined);
    let comm = joined.comm.clone();
    let result = run_rank(cfg, opts, env, plan, joined, None);
    if let Err(e) = &result {
        // Peers waiting on this rank fail at once instead of at their timeout.
        comm.abort(&format!("rank {} failed: {e}", env.rank));
    }
    result
}

/// Rank 0 prints the run's header once it met the others.
fn announce(
    cfg: &TrainConfig,
    opts: &RunOptions,
    env: &WorkerEnv,
    plan: &train::JobPlan,
    joined: &Joined,
) {
    if env.rank == 0 && !opts.quiet {
        train::print_header(cfg, plan);
        println!(
            "  processes: {} on {} node(s) ({}), transport: {}",
            env.world,
            joined.topology.nodes(),
            env.source,
            joined.selection.describe()
        );
    }
}

fn run_rank(
    cfg: TrainConfig,
    opts: RunOptions,
    env: &WorkerEnv,
    plan: train::JobPlan,
    joined: Joined,
    live: Option<&mut super::live::LiveRun>,
) -> Result<Summary> {
    let rank = env.rank;
    let trace = if opts.trace.is_some() { Trace::new() } else { Trace::disabled() };
    let mem = MemoryTracker::new(rank, cfg.device_memory);
    let mut engine = RankEngine::new(
        joined.comm.clone(),
        Arc::clone(&plan.model),
        plan.engine.clone(),
        mem,
        trace.clone(),
    )?;
    let control = joined.comm.lane("launch")?;
    // The control lane's staging is communication memory for the rank's whole run (MEM-5).
    control
        .set_account(crate::memory::HeldBytes::new(engine.memory(), "launch lane staging")? as _);
    let hook = worker_fault_hook(&opts, env);
    if let Some(h) = &hook {
        engine.set_fault_hook(Arc::clone(h));
    }
    if let Some(o) = &opts.backend {
        engine.set_backend((o.0)(rank));
    }
    let mut start_step = 0;
    let mut keep = None;
    if let Some(live) = live {
        engine.set_commit_after_sums(true);
        if live.recover {
            let kept = live.kept.take();
            start_step =
                super::live::recover(&mut engine, &joined.comm, kept.as_ref(), live.failed_at)?;
        }
        keep = Some(Arc::clone(&live.slot));
    }
    let tracker = engine.memory().clone();
    let (mut job, data) = Job::from_plan(cfg, opts.clone(), plan)?;
    // HSDP-2: `--shard-group node` follows the nodes the job runs on.
    job.shards =
        crate::engine::checkpoint_shards(job.cfg.shard_group, job.stage, &joined.topology)?;
    let placement = Launched {
        commit: StoreCommit {
            rank,
            job: env.meeting(),
            wait: Duration::from_secs(job.cfg.timeout_s),
            store: Arc::clone(&joined.store),
            control,
        },
        progress: (rank == 0).then(|| ProgressPublisher::start(&joined.store, &env.job)),
    };
    let engines = Engines {
        engines: vec![Box::new(engine)],
        comms: vec![joined.comm.clone()],
        data,
        faults: None,
        checkpoint_hook: hook,
        dump_on_failure: opts.dump_on_failure.clone(),
        abort: None,
        keep_on_failure: keep,
        start_step,
    };
    let result = driver::run(job, engines, placement);
    let path = opts.trace.as_ref().map(|p| p.with_extension(format!("rank{rank}.json")));
    driver::finish(result, &trace, path.as_deref(), &[tracker], rank == 0 && !opts.quiet)
}

/// One process per rank: rank 0 speaks for the job; checkpoints go through the store.
struct Launched {
    commit: StoreCommit,
    progress: Option<ProgressPublisher>,
}

impl Placement for Launched {
    fn lead(&self) -> bool {
        self.commit.rank == 0
    }

    fn step_done(&self, step: u64) {
        if let Some(p) = &self.progress {
            p.publish(step);
        }
    }

    /// LAUNCH-4: rank 0 begins, every rank writes its shard and publishes its file entry, and
    /// rank 0 commits once the barrier says every rank is done.
    async fn save(&self, ranks: &Ranks, dir: &Path, step: u64, meta: CheckpointMeta) -> Result<()> {
        let pending = Arc::new(self.commit.begin(dir, step)?);
        let mut entry = ranks
            .ask(|_| Save(Arc::clone(&pending), meta.world), &format!("checkpoint at step {step}"))
            .await?;
        let entry = entry.swap_remove(0);
        let buffers = if self.commit.rank == 0 {
            let b = ranks.addrs()[0]
                .send(Buffers)
                .await
                .map_err(|e| RuntimeError::config(format!("checkpoint buffers: {e}")))?;
            Some(b)
        } else {
            None
        };
        let pending = Arc::try_unwrap(pending)
            .map_err(|_| RuntimeError::config("checkpoint still shared"))?;
        self.commit.finish(pending, entry.as_ref(), meta, buffers.as_deref())
    }

    /// LAUNCH-4 on a thread of the rank's process, from the snapshot taken now: its barriers
    /// are on the control lane, which no step uses, so the steps go on meanwhile.
    async fn save_in_background(
        &self,
        ranks: &Ranks,
        dir: &Path,
        step: u64,
        meta: CheckpointMeta,
        hooks: WriteHooks,
    ) -> Result<BackgroundSave> {
        let snap = ranks.snapshot(step).await?.swap_remove(0);
        let (commit, dir) = (self.commit.clone(), dir.to_path_buf());
        // A failing rank does not wait for it: its barriers end with the aborted
        // communicator, and so does the process.
        BackgroundSave::start(step, false, move || {
            let pending = commit.begin(&dir, step)?;
            // HSDP-2: the first replica group's ranks write the shards.
            let entry = match snap.rank < meta.world {
                true => Some(hooks.write(&pending, &snap)?),
                false => None,
            };
            let buffers = (commit.rank == 0).then_some(snap.buffers.as_slice());
            commit.finish(pending, entry.as_ref(), meta, buffers)
        })
    }
}

/// How long a checkpoint's barrier may go on after a stop was asked (LAUNCH-13): the other
/// ranks may still be writing their shards of the step the stop is saving.
const CHECKPOINT_GRACE: Duration = Duration::from_secs(20);

/// The store and barriers of LAUNCH-4, in the two halves around the shard write: a
/// synchronous save runs them in place, an asynchronous one on its writer thread.
#[derive(Clone)]
struct StoreCommit {
    rank: usize,
    job: String,
    /// Deadline of the checkpoint barriers and store reads (the collective timeout).
    wait: Duration,
    store: Arc<dyn Store>,
    /// The lane of the checkpoint barriers.
    control: Lane,
}

impl StoreCommit {
    /// Rank 0 begins checkpoint `step`; every rank joins it once the barrier says it exists.
    fn begin(&self, dir: &Path, step: u64) -> Result<PendingCheckpoint> {
        let pending =
            if self.rank == 0 { Some(PendingCheckpoint::begin(dir, step)?) } else { None };
        self.barrier(step, "begun")?;
        match pending {
            Some(p) => Ok(p),
            None => PendingCheckpoint::join(dir, step),
        }
    }

    /// Publishes this rank's written shard `entry` (none from the replica groups but the
    /// first, HSDP-2); rank 0, which passes the replicated `buffers`, commits once the
    /// barrier says every shard of `meta.world` is durable. Returns once the checkpoint is
    /// committed on every rank.
    fn finish(
        &self,
        pending: PendingCheckpoint,
        entry: Option<&FileEntry>,
        meta: CheckpointMeta,
        buffers: Option<&[Vec<f32>]>,
    ) -> Result<()> {
        let step = pending.step();
        let key = |r: usize| format!("launch/{}/ckpt/{step}/{r}", self.job);
        if let Some(entry) = entry {
            let text = serde_json::to_vec(entry)
                .map_err(|e| RuntimeError::config(format!("encoding file entry: {e}")))?;
            self.store.set(&key(self.rank), &text).map_err(store_err("publishing a shard"))?;
        }
        self.barrier(step, "written by every rank")?;
        if let Some(buffers) = buffers {
            let mut files = Vec::with_capacity(meta.world);
            let grace = blocked::with_grace(CHECKPOINT_GRACE);
            for r in 0..meta.world {
                let _b = blocked::on(format!("rank {r}'s shard entry of step {step}"));
                let v =
                    self.store.get(&key(r), self.wait).map_err(store_err("collecting shards"))?;
                let f: FileEntry = serde_json::from_slice(&v).map_err(|e| {
                    RuntimeError::config(format!("rank {r} published a bad file entry: {e}"))
                })?;
                files.push(f);
            }
            drop(grace);
            pending.commit(meta, files, buffers)?;
        }
        // Nobody begins the next checkpoint (or reads this one) before it is committed.
        self.barrier(step, "committed")?;
        Ok(())
    }

    fn barrier(&self, step: u64, what: &str) -> Result<()> {
        // The barrier's own deadline, not a local wait's: its timeout then names the rank
        // that did not arrive.
        let mut opts = shardline_collectives::CallOptions::new();
        opts.timeout(self.wait);
        let _grace = blocked::with_grace(CHECKPOINT_GRACE);
        let _b = blocked::on(format!("the checkpoint of step {step} to be {what}"));
        self.control.barrier_opts(&opts).wait()?;
        Ok(())
    }
}

/// LAUNCH-9: rank 0's finished steps, for the agents' fault log, published from a thread of
/// their own: a store round trip per step on the training thread would stall rank 0, and
/// with it every rank, for the agent's reply. The thread sets the newest step it was handed
/// (steps handed on while a write is under way collapse into the next one) and ends when the
/// publisher is dropped; it is not joined, so a rank that fails never waits on a store it
/// cannot reach for it. A lost update only blurs a log.
struct ProgressPublisher {
    tx: crossbeam::channel::Sender<u64>,
}

impl ProgressPublisher {
    fn start(store: &Arc<dyn Store>, job: &str) -> Self {
        let (tx, rx) = crossbeam::channel::unbounded::<u64>();
        let (store, key) = (Arc::clone(store), progress_key(job));
        let spawned = std::thread::Builder::new().name("progress".into()).spawn(move || {
            while let Ok(first) = rx.recv() {
                let step = rx.try_iter().fold(first, u64::max);
                let _ = store.set(&key, step.to_string().as_bytes());
            }
        });
        // Without the thread the steps are not published: only the log is less precise.
        drop(spawned);
        ProgressPublisher { tx }
    }

    fn publish(&self, step: u64) {
        let _ = self.tx.send(step);
    }
}

/// The store key where rank 0 of job `job` publishes the steps it finished.
pub fn progress_key(job: &str) -> String {
    format!("launch/{job}/progress")
}

/// Milliseconds since the Unix epoch: the clock that lines of different processes share.
pub fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// LAUNCH-8: the plan's rank faults (kill, stall) of this rank in a worker process, in the
/// first generation only, so that a restarted group replays the lost steps without meeting
/// them again (FAULT-2). A kill ends the process with SIGKILL: no error report, no unwinding,
/// exactly what a crashed or OOM-killed worker looks like to its peers and agent.
fn worker_fault_hook(opts: &RunOptions, env: &WorkerEnv) -> Option<FaultHook> {
    // A replacement started in place of a failed worker (LIVE-4) replays the step without
    // meeting its predecessor's fault again, and a survivor in a later epoch without meeting
    // its own: a stall that fired in every epoch would stall the rerun of its step forever.
    if env.generation > 0 || env.live_epoch.is_some() || env.epoch > 0 {
        return None;
    }
    let rank = env.rank;
    let specs: Vec<FaultSpec> = opts
        .faults
        .as_ref()?
        .plan()
        .faults
        .iter()
        .filter(|f| {
            matches!(f, FaultSpec::Kill { rank: r, .. } | FaultSpec::Stall { rank: r, .. } if *r == rank)
        })
        .cloned()
        .collect();
    if specs.is_empty() {
        return None;
    }
    Some(Arc::new(move |r, step, phase| {
        for f in &specs {
            match *f {
                FaultSpec::Kill { step: s, phase: p, .. } if s == step && p == phase => {
                    say!(
                        "shardline worker: fault injected: kill rank {r} at step {step} ({}) unix_ms={}",
                        phase.name(),
                        unix_ms()
                    );
                    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
                    std::process::abort();
                }
                FaultSpec::Stall { step: s, secs, .. } if s == step && phase == Phase::Forward => {
                    say!(
                        "shardline worker: fault injected: stall rank {r} at step {step} for {secs} s unix_ms={}",
                        unix_ms()
                    );
                    std::thread::sleep(Duration::from_secs_f64(secs));
                }
                _ => {}
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::{FaultInjector, FaultPlan};

    fn env(vars: &[(&str, &str)]) -> WorkerEnv {
        let map: std::collections::HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        WorkerEnv::from_vars(&|k| map.get(k).cloned()).expect("environment").expect("launched")
    }

    /// LAUNCH-8 under live recovery: a rank's fault fires in its first epoch only; the
    /// survivor that stalled reruns the step in the next epoch without stalling again.
    #[test]
    fn a_rank_fault_fires_in_the_first_epoch_only_launch_8() {
        let mut e = env(&[
            ("SHARDLINE_RANK", "0"),
            ("SHARDLINE_WORLD_SIZE", "2"),
            ("SHARDLINE_LOCAL_RANK", "0"),
            ("SHARDLINE_LOCAL_WORLD_SIZE", "2"),
            ("SHARDLINE_NODE_RANK", "0"),
            ("SHARDLINE_RDZV", "127.0.0.1:1"),
            ("SHARDLINE_TOKEN", "t"),
            ("SHARDLINE_LIVE", "1"),
        ]);
        let plan = FaultPlan::parse(&["stall:rank=0:step=3:secs=5".to_string()], 0).expect("plan");
        let opts = RunOptions { faults: Some(FaultInjector::new(plan)), ..RunOptions::default() };
        assert!(worker_fault_hook(&opts, &e).is_some(), "epoch 0 meets the fault");
        e.epoch = 1;
        assert!(worker_fault_hook(&opts, &e).is_none(), "a later epoch does not");
        e.epoch = 0;
        e.generation = 1;
        assert!(worker_fault_hook(&opts, &e).is_none(), "nor does a restarted generation");
    }
}
