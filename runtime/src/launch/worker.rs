//! One process per rank: the worker side of `shardline train` in a launch environment.

use super::env::WorkerEnv;
use super::rendezvous::{join_job, store_err, Joined};
use crate::checkpoint::{self, FileEntry, PendingCheckpoint};
use crate::engine::RankEngine;
use crate::error::{Result, RuntimeError};
use crate::fault::{FaultHook, FaultSpec, Phase};
use crate::memory::MemoryTracker;
use crate::telemetry::Trace;
use crate::train::{self, JobPlan, RunOptions, Summary, TrainConfig};
use shardline_collectives::Store;
use shardline_models::DistributedSampler;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs this process as rank `env.rank` of a multi-process job (LAUNCH-3). `cfg.world` is
/// taken from the environment. Every rank returns the summary; only rank 0 prints.
pub fn run_worker(mut cfg: TrainConfig, opts: RunOptions, env: &WorkerEnv) -> Result<Summary> {
    if cfg.world != env.world {
        tracing::info!("world {} from the launch environment (not {})", env.world, cfg.world);
        cfg.world = env.world;
    }
    let plan = train::plan(&cfg)?;
    let lead = env.rank == 0 && !opts.quiet;
    let joined = join_job(&cfg, env)?;
    if lead {
        train::print_header(&cfg, &plan);
        println!(
            "  processes: {} on {} node(s) ({}), transport: {}",
            env.world,
            joined.topology.nodes(),
            env.source,
            joined.selection.describe()
        );
    }
    let comm = joined.comm.clone();
    let result = worker_loop(&cfg, &opts, env, plan, &joined);
    if let Err(e) = &result {
        // Peers waiting on this rank fail at once instead of at their timeout.
        comm.abort(&format!("rank {} failed: {e}", env.rank));
    }
    result
}

fn worker_loop(
    cfg: &TrainConfig,
    opts: &RunOptions,
    env: &WorkerEnv,
    plan: JobPlan,
    joined: &Joined,
) -> Result<Summary> {
    let started = Instant::now();
    let rank = env.rank;
    let lead = rank == 0 && !opts.quiet;
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
    let hook = worker_fault_hook(opts, env);
    if let Some(h) = &hook {
        engine.set_fault_hook(Arc::clone(h));
    }
    let sampler =
        DistributedSampler::new(plan.train.len(), cfg.world, cfg.batch_size, cfg.seed, true)
            .map_err(RuntimeError::from_model)?;
    let mut done: u64 = 0;
    if opts.resume {
        let dir = opts
            .checkpoint_dir
            .as_ref()
            .ok_or_else(|| RuntimeError::config("--resume needs --checkpoint-dir"))?;
        if let Some(latest) = checkpoint::latest(dir)? {
            let ck = checkpoint::Checkpoint::open(&latest)?;
            ck.check_config_hash(&plan.hash)?;
            ck.check_model(&plan.model.spec())?;
            let buffers = ck.buffers()?;
            let step = ck.manifest().step;
            let shard = ck.load_rank(rank, cfg.world)?;
            engine.load_state(&shard, &buffers, step)?;
            done = step;
            if lead {
                println!("  resumed from {} (step {step})", latest.display());
            }
        } else if lead {
            println!("  no checkpoint in {} yet; starting fresh", dir.display());
        }
    }
    let mut log = match (&opts.log_json, rank) {
        (Some(p), 0) => Some(std::io::BufWriter::new(
            std::fs::OpenOptions::new().create(true).append(true).open(p).map_err(|e| {
                RuntimeError::config(format!("cannot open --log-json {}: {e}", p.display()))
            })?,
        )),
        _ => None,
    };
    let remaining = plan.total_steps.saturating_sub(done);
    let run_steps = opts.stop_after.map_or(remaining, |s| s.min(remaining));
    let first = done;
    let mut losses = Vec::new();
    let mut step_stats = Vec::new();
    let mut step_times = Vec::new();
    let mut exposed = Vec::new();
    let t_loop = Instant::now();
    let progress = (rank == 0).then(|| ProgressPublisher::start(&joined.store, &env.job));
    let mut batches = shardline_models::RankBatches::default();
    let mut interrupted = None::<i32>;
    for _ in 0..run_steps {
        // INT-1: this rank's wish to stop travels with the step's loss reduction.
        if opts.stop_on_signal && crate::interrupt::requested().is_some() {
            engine.request_stop();
        }
        let epoch = done / plan.steps_per_epoch;
        let index = (done % plan.steps_per_epoch) as usize;
        let (global, idx) = batches
            .get(&sampler, epoch, rank, index)
            .ok_or_else(|| RuntimeError::config(format!("epoch {epoch} has no batch {index}")))?;
        let (x, y) = plan.train.batch(idx);
        let st = engine.train_step(x, &y, *global)?;
        done += 1;
        if let Some(p) = &progress {
            p.publish(done);
        }
        let t = st.step_time.as_secs_f64();
        if let Some(w) = log.as_mut() {
            let line = serde_json::json!({
                "step": done, "epoch": epoch, "loss": st.loss, "lr": st.lr, "step_time_s": t,
                "comm_exposed_s": st.comm_exposed.as_secs_f64(),
                "compute_s": st.compute_time.as_secs_f64(), "peak_bytes": st.peak_bytes,
                "stats_messages": st.stats_messages, "grad_norm": st.grad_norm,
            });
            writeln!(w, "{line}")
                .map_err(|e| RuntimeError::config(format!("writing --log-json: {e}")))?;
        }
        if lead && opts.progress && (done.is_multiple_of(10) || done == first + run_steps) {
            println!("  step {done}/{}: loss {:.4}, {:.1} ms", plan.total_steps, st.loss, t * 1e3);
        }
        losses.push(st.loss);
        step_times.push(t);
        exposed.push(if t > 0.0 { st.comm_exposed.as_secs_f64() / t } else { 0.0 });
        let stop_now = st.stop;
        step_stats.push(st);
        if let Some(dir) = &opts.checkpoint_dir {
            let every = opts.checkpoint_every;
            let last = done == plan.total_steps || done - first == run_steps;
            // INT-1: a stop agreed in this step's reduction checkpoints this step everywhere.
            if (every > 0 && done.is_multiple_of(every)) || last || stop_now {
                let position =
                    train::loader_position(plan.steps_per_epoch, epoch, index as u64 + 1, cfg.seed);
                save(
                    cfg,
                    &plan,
                    env,
                    joined,
                    &control,
                    &engine,
                    hook.as_ref(),
                    dir,
                    done,
                    position,
                )?;
            }
        }
        if stop_now {
            // Every rank saw the same flag in the same reduction: all stop here (INT-1).
            interrupted = Some(crate::interrupt::requested().unwrap_or(libc::SIGTERM));
            break;
        }
    }
    if let Some(w) = log.as_mut() {
        w.flush().map_err(|e| RuntimeError::config(format!("writing --log-json: {e}")))?;
    }
    if let Some(signal) = interrupted {
        // The stop step was checkpointed with the periodic ones, when there is a directory.
        let checkpoint = match &opts.checkpoint_dir {
            Some(dir) => checkpoint::latest(dir)?,
            None => None,
        };
        engine.shutdown();
        return Err(RuntimeError::Interrupted { signal, step: done, checkpoint });
    }
    let loop_s = t_loop.elapsed().as_secs_f64();
    let batch = sampler.per_rank_batch().max(crate::actors::EVAL_MIN_BATCH);
    let (correct, count, _) = engine.eval_set(&plan.test, batch)?;
    let (final_params, final_buffers) = if opts.skip_final_params {
        (Vec::new(), Vec::new())
    } else {
        (engine.full_params()?, engine.buffers().to_vec())
    };
    let tracker = engine.memory().clone();
    engine.shutdown();
    if let (Some(path), true) = (&opts.trace, trace.enabled()) {
        let path = path.with_extension(format!("rank{rank}.json"));
        trace
            .write_chrome(&path)
            .map_err(|e| RuntimeError::config(format!("writing trace {}: {e}", path.display())))?;
    }
    let summary = Summary {
        steps: run_steps,
        total_steps: done,
        test_accuracy: if count > 0 { correct as f64 / count as f64 } else { 0.0 },
        final_loss: losses.last().copied().unwrap_or(f32::NAN),
        steps_per_s: if loop_s > 0.0 { run_steps as f64 / loop_s } else { 0.0 },
        median_step_s: train::median(&mut step_times.clone()),
        comm_exposed_frac: if exposed.is_empty() {
            0.0
        } else {
            exposed.iter().sum::<f64>() / exposed.len() as f64
        },
        peak_bytes: vec![tracker.peak_total()],
        peak_by_category: vec![crate::memory::Category::ALL
            .iter()
            .map(|c| (c.key().to_string(), tracker.peak(*c)))
            .collect()],
        stage: plan.stage.index(),
        sync_bn: plan.sync.clone(),
        stats_messages_per_step: step_stats.last().map_or(0, |s| s.stats_messages),
        wall_s: started.elapsed().as_secs_f64(),
        losses,
        final_params,
        final_buffers,
        step_stats,
    };
    if lead {
        train::print_summary(&summary, &[tracker]);
    }
    Ok(summary)
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
    if env.generation > 0 {
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

/// LAUNCH-4: rank 0 begins, every rank writes its shard and publishes its file entry, and
/// rank 0 commits once the barrier says every rank is done.
#[allow(clippy::too_many_arguments)]
fn save(
    cfg: &TrainConfig,
    plan: &JobPlan,
    env: &WorkerEnv,
    joined: &Joined,
    control: &shardline_collectives::Lane,
    engine: &RankEngine,
    hook: Option<&FaultHook>,
    dir: &std::path::Path,
    step: u64,
    position: checkpoint::DataLoaderState,
) -> Result<()> {
    let wait = Duration::from_secs(cfg.timeout_s);
    // The barrier's own deadline, not a local wait's: its timeout then names the rank that
    // did not arrive.
    let mut barrier = shardline_collectives::CallOptions::new();
    barrier.timeout(wait);
    let pending = if env.rank == 0 { Some(PendingCheckpoint::begin(dir, step)?) } else { None };
    control.barrier_opts(&barrier).wait()?;
    let pending = match pending {
        Some(p) => p,
        None => PendingCheckpoint::join(dir, step)?,
    };
    let entry = pending.write_shard(env.rank, &engine.shard_state())?;
    if let Some(h) = hook {
        h(env.rank, step, Phase::Checkpoint);
    }
    let key = |r: usize| format!("launch/{}/ckpt/{step}/{r}", env.job);
    let text = serde_json::to_vec(&entry)
        .map_err(|e| RuntimeError::config(format!("encoding file entry: {e}")))?;
    joined.store.set(&key(env.rank), &text).map_err(store_err("publishing a shard"))?;
    control.barrier_opts(&barrier).wait()?;
    if env.rank == 0 {
        let mut files = Vec::with_capacity(cfg.world);
        for r in 0..cfg.world {
            let v = joined.store.get(&key(r), wait).map_err(store_err("collecting shards"))?;
            let f: FileEntry = serde_json::from_slice(&v).map_err(|e| {
                RuntimeError::config(format!("rank {r} published a bad file entry: {e}"))
            })?;
            files.push(f);
        }
        let meta = train::checkpoint_meta(
            cfg,
            plan.stage,
            &plan.hash,
            plan.optimizer,
            &plan.model,
            position,
        );
        pending.commit(meta, files, engine.buffers())?;
    }
    // Nobody begins the next checkpoint (or reads this one) before it is committed.
    control.barrier_opts(&barrier).wait()?;
    Ok(())
}
