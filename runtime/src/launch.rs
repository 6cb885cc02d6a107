//! One process per rank: the worker side of `shardline train` when a launch environment is
//! present, and the per-node agent of `shardline launch`.
//!
//! A worker learns its place from the environment, in this order:
//! - `shardline launch`: `SHARDLINE_RANK`, `SHARDLINE_WORLD_SIZE`, `SHARDLINE_LOCAL_RANK`,
//!   `SHARDLINE_LOCAL_WORLD_SIZE`, `SHARDLINE_NODE_RANK`, `SHARDLINE_RDZV`, `SHARDLINE_TOKEN`,
//!   `SHARDLINE_JOB`; the agent of node 0 hosts the rendezvous store.
//! - torchrun style: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//!   `MASTER_PORT` (node from `GROUP_RANK` or `NODE_RANK`, else the host name);
//! - Slurm: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODEID`, and the store at
//!   `SHARDLINE_RDZV` (or `MASTER_ADDR`:`MASTER_PORT`).
//!
//! In the last two, rank 0 hosts the store, and the token comes from `SHARDLINE_TOKEN`
//! (required: the store refuses connections without it).
//!
//! Invariants:
//! - LAUNCH-1: every rank of a job runs the same configuration: each publishes the hash of
//!   its configuration in the store, and a rank whose hash differs from rank 0's fails the
//!   start-up on every rank, naming it.
//! - LAUNCH-2: ranks that publish the same node id share a node (shared memory between them);
//!   ranks of different nodes talk over RDMA when every rank opens a device, else TCP
//!   (`--transport auto`, see `shardline_collectives::transport::select`; rank 0 says once
//!   why RDMA was not used). `--transport tcp|rdma|shm` carries every pair over one transport.
//! - LAUNCH-3: ranks run the same steps on the same data order in lockstep; rank 0 alone
//!   prints progress, the per-step log and the summary.
//! - LAUNCH-4: a checkpoint is committed by rank 0 only after every rank wrote its shard
//!   (a collective barrier), with the file entries every rank published in the store.
//! - LAUNCH-5: the agent reports a worker that dies (rank, exit code or signal), stops the
//!   others after a short grace period in which they may report their own errors, and exits
//!   non-zero; SIGINT and SIGTERM are forwarded to the workers.
//! - LAUNCH-6: with `--max-restarts N` a failure (a worker's exit or signal, a node's report,
//!   a node's silence) does not end the job: node 0's agent decides a new generation in the
//!   store (`agent/JOB/gen`: number, nodes, state), every agent stops its workers and starts
//!   the new generation's, which resume from the last committed checkpoint (`--resume`), up
//!   to N times. Only node 0's agent writes the generation, so the agents cannot disagree.
//! - LAUNCH-7: a generation's workers use the job name `JOBgN`: fresh store keys and shm
//!   segment names, so nothing of a dead generation is read by the next.
//! - LAUNCH-8: the plan's rank faults fire inside the worker processes in generation 0 only;
//!   `kill` is a SIGKILL of the worker itself.
//! - LAUNCH-9: every fault, restart and recovery is logged by the agents with the time since
//!   start, the Unix time, the node, the rank and the step (rank 0 publishes its steps from
//!   a thread of its own, so the training thread never waits on the store for it).
//! - LAUNCH-10: `--nnodes MIN:MAX` is elastic: an agent heartbeats into the store; a node
//!   whose agent stays silent past `--heartbeat-timeout-s`, or does not answer a stop, leaves
//!   the next generation (ranks renumbered, the checkpoint resharded on load), down to MIN
//!   nodes; a node whose agent is back (fresh heartbeat) rejoins at the next restart. A
//!   fixed-size job instead waits for the missing node to come back before restarting.

use crate::checkpoint::{self, FileEntry, PendingCheckpoint};
use crate::engine::RankEngine;
use crate::error::{Result, RuntimeError};
use crate::fault::{FaultHook, FaultSpec, Phase};
use crate::memory::MemoryTracker;
use crate::telemetry::Trace;
use crate::train::{self, JobPlan, RunOptions, Summary, TrainConfig};
use shardline_collectives::transport::select::{open_for_job, Selection, TransportChoice};
use shardline_collectives::transport::tcp::TcpOptions;
use shardline_collectives::transport::Transport;
use shardline_collectives::{
    CommOptions, Communicator, Store, TcpStoreClient, TcpStoreServer, Topology,
};
use shardline_models::DistributedSampler;
use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Writes one line to stderr in a single write, so that it never interleaves with the
/// workers' lines.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let line = format!("{}\n", format_args!($($t)*));
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}

/// How long a worker waits for the store and for the other ranks to publish at start-up.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(60);

/// Where one worker process stands in its job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Rank among the processes of this node (as the launcher numbered them).
    pub local_rank: usize,
    /// Processes on this node (as the launcher numbered them).
    pub local_world: usize,
    /// This node's id: ranks with equal ids share memory (LAUNCH-2).
    pub node: String,
    /// Rendezvous store address, `HOST:PORT`.
    pub rdzv: String,
    /// Job token presented to the store.
    pub token: String,
    /// Job name (store keys, shm segment names).
    pub job: String,
    /// Whether this process hosts the store (rank 0 outside `shardline launch`).
    pub host_store: bool,
    /// Which convention the variables followed: `shardline`, `torchrun` or `slurm`.
    pub source: &'static str,
    /// Restart generation of the worker group (`SHARDLINE_GENERATION`, 0 for the first
    /// start; LAUNCH-7).
    pub generation: u64,
}

fn parse_var(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    match get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            RuntimeError::config(format!("{name}={v:?} is not a non-negative integer"))
        }),
    }
}

fn need(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<usize> {
    parse_var(get, name)?
        .ok_or_else(|| RuntimeError::config(format!("launch environment without {name}")))
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into())
}

impl WorkerEnv {
    /// Reads a launch environment through `get` (the process environment in
    /// [`WorkerEnv::from_env`]); `Ok(None)` when none is present.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let token = || {
            get("SHARDLINE_TOKEN").filter(|t| !t.is_empty()).ok_or_else(|| {
                RuntimeError::config(
                    "SHARDLINE_TOKEN must be set: the store refuses peers without the job token",
                )
            })
        };
        let master = || -> Option<String> {
            Some(format!("{}:{}", get("MASTER_ADDR")?, get("MASTER_PORT")?))
        };
        let (rank, world, local_rank, local_world, node, rdzv, host, source);
        if get("SHARDLINE_RANK").is_some() {
            rank = need(get, "SHARDLINE_RANK")?;
            world = need(get, "SHARDLINE_WORLD_SIZE")?;
            local_rank = need(get, "SHARDLINE_LOCAL_RANK")?;
            local_world = need(get, "SHARDLINE_LOCAL_WORLD_SIZE")?;
            node = need(get, "SHARDLINE_NODE_RANK")?.to_string();
            rdzv = get("SHARDLINE_RDZV")
                .ok_or_else(|| RuntimeError::config("launch environment without SHARDLINE_RDZV"))?;
            host = false;
            source = "shardline";
        } else if get("RANK").is_some() && get("WORLD_SIZE").is_some() {
            rank = need(get, "RANK")?;
            world = need(get, "WORLD_SIZE")?;
            local_rank = parse_var(get, "LOCAL_RANK")?.unwrap_or(rank);
            local_world = parse_var(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world);
            node = get("GROUP_RANK").or_else(|| get("NODE_RANK")).unwrap_or_else(host_name);
            rdzv = master().ok_or_else(|| {
                RuntimeError::config("torchrun-style environment without MASTER_ADDR/MASTER_PORT")
            })?;
            host = rank == 0;
            source = "torchrun";
        } else if get("SLURM_PROCID").is_some() && get("SLURM_NTASKS").is_some() {
            rank = need(get, "SLURM_PROCID")?;
            world = need(get, "SLURM_NTASKS")?;
            local_rank = parse_var(get, "SLURM_LOCALID")?.unwrap_or(0);
            local_world = 0;
            node = get("SLURM_NODEID").unwrap_or_else(host_name);
            rdzv = get("SHARDLINE_RDZV").or_else(master).ok_or_else(|| {
                RuntimeError::config(
                    "Slurm environment: set SHARDLINE_RDZV=HOST:PORT (or MASTER_ADDR and MASTER_PORT) for the store",
                )
            })?;
            host = rank == 0;
            source = "slurm";
        } else {
            return Ok(None);
        }
        if world == 0 || rank >= world {
            return Err(RuntimeError::config(format!("rank {rank} out of world size {world}")));
        }
        let job = get("SHARDLINE_JOB").unwrap_or_else(|| "job".into());
        let generation = parse_var(get, "SHARDLINE_GENERATION")?.unwrap_or(0) as u64;
        Ok(Some(WorkerEnv {
            generation,
            rank,
            world,
            local_rank,
            local_world,
            node,
            rdzv,
            token: token()?,
            job,
            host_store: host,
            source,
        }))
    }

    /// [`WorkerEnv::from_vars`] over the process environment.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }
}

/// The local address this host uses to reach `rdzv`: what peers on other nodes connect to.
fn local_ip_towards(rdzv: &str) -> Result<std::net::IpAddr> {
    let target: SocketAddr = rdzv
        .to_socket_addrs()
        .map_err(|e| RuntimeError::config(format!("cannot resolve store address {rdzv}: {e}")))?
        .next()
        .ok_or_else(|| RuntimeError::config(format!("store address {rdzv} resolves to nothing")))?;
    let bind: SocketAddr =
        if target.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
    // A connected UDP socket sends nothing; it only asks the kernel for the route.
    let sock = UdpSocket::bind(bind)
        .and_then(|s| s.connect(target).map(|_| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| RuntimeError::config(format!("no route to the store at {rdzv}: {e}")))?;
    Ok(sock.ip())
}

fn store_err(what: &str) -> impl Fn(shardline_collectives::StoreError) -> RuntimeError + '_ {
    move |e| RuntimeError::config(format!("rendezvous failed ({what}): {e}"))
}

/// What a worker publishes about itself at start-up.
#[derive(serde::Serialize, serde::Deserialize)]
struct Hello {
    node: String,
    config_hash: String,
}

/// A worker's connection to its job: the store (and the server, when hosted here), the
/// topology and the communicator.
struct Joined {
    _server: Option<TcpStoreServer>,
    store: Arc<dyn Store>,
    topology: Topology,
    comm: Communicator,
    /// The transports chosen (LAUNCH-2).
    selection: Selection,
}

fn join_job(cfg: &TrainConfig, env: &WorkerEnv) -> Result<Joined> {
    let server = if env.host_store {
        let port = env.rdzv.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()).ok_or_else(
            || RuntimeError::config(format!("store address {} has no port", env.rdzv)),
        )?;
        Some(
            TcpStoreServer::bind(("0.0.0.0", port), &env.token)
                .map_err(store_err("hosting the store"))?,
        )
    } else {
        None
    };
    let mut client = TcpStoreClient::connect(env.rdzv.as_str(), &env.token, RENDEZVOUS_TIMEOUT)
        .map_err(store_err("connecting"))?;
    // Once connected, a request the store does not answer fails within the collective
    // timeout like a collective would (a partitioned rank then reports it instead of
    // waiting out the rendezvous deadline in a checkpoint's store write).
    client.set_request_timeout(Duration::from_secs(cfg.timeout_s.max(1)));
    let store: Arc<dyn Store> = Arc::new(client);
    let key = |r: usize| format!("launch/{}/hello/{r}", env.job);
    let mine = Hello { node: env.node.clone(), config_hash: checkpoint::config_hash(cfg)? };
    let text = serde_json::to_vec(&mine)
        .map_err(|e| RuntimeError::config(format!("encoding hello: {e}")))?;
    store.set(&key(env.rank), &text).map_err(store_err("publishing"))?;
    let mut hellos = Vec::with_capacity(env.world);
    for r in 0..env.world {
        let v = store.get(&key(r), RENDEZVOUS_TIMEOUT).map_err(store_err("waiting for ranks"))?;
        let h: Hello = serde_json::from_slice(&v)
            .map_err(|e| RuntimeError::config(format!("rank {r} published a bad hello: {e}")))?;
        hellos.push(h);
    }
    // LAUNCH-1.
    let differ: Vec<usize> =
        (1..env.world).filter(|&r| hellos[r].config_hash != hellos[0].config_hash).collect();
    if !differ.is_empty() {
        return Err(RuntimeError::config(format!(
            "configuration mismatch: rank(s) {differ:?} run another configuration than rank 0 \
             (same flags on every rank required)"
        )));
    }
    // LAUNCH-2: node labels numbered in order of first appearance by rank.
    let mut ids: HashMap<&str, usize> = HashMap::new();
    let node_of: Vec<usize> = hellos
        .iter()
        .map(|h| {
            let n = ids.len();
            *ids.entry(h.node.as_str()).or_insert(n)
        })
        .collect();
    let topology = Topology::from_nodes(node_of);
    let mut tcp = TcpOptions::default();
    tcp.bind(SocketAddr::from(([0, 0, 0, 0], 0)))
        .advertise(local_ip_towards(&env.rdzv)?.to_string());
    let choice = TransportChoice::from_env()
        .map_err(|e| RuntimeError::config(format!("SHARDLINE_TRANSPORT: {e}")))?;
    let (transport, selection) = open_for_job(
        choice,
        env.rank,
        &topology,
        Arc::clone(&store),
        &env.job,
        tcp,
        RENDEZVOUS_TIMEOUT,
    )
    .map_err(|e| RuntimeError::config(format!("rank {}: transport setup failed: {e}", env.rank)))?;
    if env.rank == 0 {
        for note in &selection.notes {
            say!("shardline: {note}");
        }
    }
    let mut copts = CommOptions::new();
    copts.timeout(Duration::from_secs(cfg.timeout_s));
    let comm = Communicator::new(transport as Arc<dyn Transport>, topology.clone(), copts)?;
    Ok(Joined { _server: server, store, topology, comm, selection })
}

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

/// What `shardline launch` is asked to run on this node.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// Worker processes on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Store address `HOST:PORT`; node 0 listens on its port. Required for several nodes.
    pub rdzv: Option<String>,
    /// Job token; required for several nodes (else generated).
    pub token: Option<String>,
    /// Arguments of each worker (`train ...`).
    pub worker_args: Vec<String>,
    /// How long the other workers may take to exit on their own after one died (LAUNCH-5).
    pub grace: Duration,
    /// Fewest nodes the job may shrink to (`--nnodes MIN:MAX`, LAUNCH-10); `nnodes` is the
    /// most. Equal to `nnodes` for a fixed-size job.
    pub min_nodes: usize,
    /// Restarts of the worker group after a failure (`--max-restarts`, LAUNCH-6).
    pub max_restarts: u32,
    /// Node 0's agent counts an agent whose heartbeat stayed still this long as lost.
    pub heartbeat_timeout: Duration,
    /// Transport of the workers (`--transport`, passed as `SHARDLINE_TRANSPORT`).
    pub transport: TransportChoice,
}

impl LaunchOptions {
    /// Options for one node of a fixed-size job without restarts.
    pub fn new(nproc_per_node: usize, worker_args: Vec<String>) -> Self {
        LaunchOptions {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            rdzv: None,
            token: None,
            worker_args,
            grace: Duration::from_secs(2),
            min_nodes: 1,
            max_restarts: 0,
            heartbeat_timeout: Duration::from_secs(3),
            transport: TransportChoice::Auto,
        }
    }
}

/// Parses `--nnodes`: `N` (fixed) or `MIN:MAX` (elastic); returns `(min, max)`.
pub fn parse_nnodes(s: &str) -> std::result::Result<(usize, usize), String> {
    let num = |t: &str| {
        t.trim().parse::<usize>().map_err(|_| format!("--nnodes '{s}': expected N or MIN:MAX"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => {
            let n = num(s)?;
            (n, n)
        }
    };
    if min == 0 || min > max {
        return Err(format!("--nnodes '{s}': need 1 <= MIN <= MAX"));
    }
    Ok((min, max))
}

/// How long workers get to finish their step and checkpoint it after a forwarded SIGINT or
/// SIGTERM (INT-1), unless a second signal arrives.
const SIGNAL_STOP_WAIT: Duration = Duration::from_secs(120);

/// The signal last received by the agent (0: none).
fn received() -> i32 {
    crate::interrupt::requested().unwrap_or(0)
}

fn random_token() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_ok();
    if !ok {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b.copy_from_slice(&(t ^ ((std::process::id() as u128) << 64)).to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// How a worker ended, in words: `exit code 3`, `signal 9 (SIGKILL)`.
fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => {
            let name = nix::sys::signal::Signal::try_from(s).map(|s| s.as_str()).unwrap_or("?");
            format!("signal {s} ({name})")
        }
        _ => "an unknown status".into(),
    }
}

struct Worker {
    rank: usize,
    child: std::process::Child,
    status: Option<std::process::ExitStatus>,
}

fn signal_all(workers: &[Worker], sig: nix::sys::signal::Signal) {
    for w in workers.iter().filter(|w| w.status.is_none()) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(w.child.id() as i32), sig);
    }
}

/// How often an agent writes its heartbeat key.
const HEARTBEAT_EVERY: Duration = Duration::from_millis(200);
/// How often an agent reads the store (generation, reports, heartbeats, progress).
const POLL_EVERY: Duration = Duration::from_millis(100);
/// How often an agent polls the store once a failure is under way (stop, abort, restart):
/// every hand-off of that path waits at most this long.
const FAST_POLL: Duration = Duration::from_millis(20);
/// Bound of one store request of an agent (and of its reconnection attempts).
const STORE_REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
/// An agent that has not reached the store for this long gives up on its job.
const STORE_LOST: Duration = Duration::from_secs(60);
/// After this long without reaching the store, a node's agent says what it waits for.
const WAITING_NOTE_AFTER: Duration = Duration::from_secs(3);
/// How long an elastic job's node 0 waits at start-up for the most nodes to join.
const ELASTIC_JOIN_WAIT: Duration = Duration::from_secs(10);
/// How long node 0's agent keeps the store up after success for the other nodes' reports.
const END_WAIT: Duration = Duration::from_secs(10);

/// What node 0's agent decided for one generation of the worker group (LAUNCH-6).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Generation {
    gen: u64,
    /// Nodes whose workers make up this generation, ascending; their position numbers ranks.
    nodes: Vec<usize>,
    state: GenState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum GenState {
    /// Workers of this generation run.
    Run,
    /// A failure was seen: every agent stops its workers and says so.
    Stop,
    /// Training finished.
    Done,
    /// The job failed for good.
    Abort,
}

fn agent_key(job: &str, what: &str) -> String {
    format!("agent/{job}/{what}")
}

/// Result of an agent's store read.
enum Got {
    Value(Vec<u8>),
    Unset,
    Unreachable,
}

/// An agent's connection to the store. After an I/O error it reconnects (a request that timed
/// out may leave its late reply in the stream), and it remembers when it last got through.
struct StoreLink {
    addr: String,
    token: String,
    client: Option<TcpStoreClient>,
    last_ok: Instant,
    /// Why the last connection attempt failed (for the "still waiting" line).
    last_err: Option<String>,
}

impl StoreLink {
    fn client(&mut self) -> Option<&TcpStoreClient> {
        if self.client.is_none() {
            match TcpStoreClient::connect(self.addr.as_str(), &self.token, STORE_REQUEST_TIMEOUT) {
                Ok(c) => {
                    self.client = Some(c);
                    self.last_err = None;
                }
                Err(e) => self.last_err = Some(e.to_string()),
            }
        }
        self.client.as_ref()
    }

    fn set(&mut self, key: &str, value: &[u8]) -> bool {
        let Some(c) = self.client() else { return false };
        match c.set(key, value) {
            Ok(()) => {
                self.last_ok = Instant::now();
                true
            }
            Err(_) => {
                self.client = None;
                false
            }
        }
    }

    fn get(&mut self, key: &str) -> Got {
        let Some(c) = self.client() else { return Got::Unreachable };
        match c.get(key, Duration::from_millis(1)) {
            Ok(v) => {
                self.last_ok = Instant::now();
                Got::Value(v)
            }
            Err(shardline_collectives::StoreError::Timeout { .. }) => {
                self.last_ok = Instant::now();
                Got::Unset
            }
            Err(_) => {
                self.client = None;
                Got::Unreachable
            }
        }
    }
}

/// When each node's heartbeat last moved, as node 0's agent sees it.
struct Heartbeats {
    last: Vec<Option<(Vec<u8>, Instant)>>,
}

impl Heartbeats {
    fn new(nodes: usize) -> Self {
        Heartbeats { last: vec![None; nodes] }
    }

    fn poll(&mut self, link: &mut StoreLink, job: &str) {
        for n in 0..self.last.len() {
            if let Got::Value(v) = link.get(&agent_key(job, &format!("hb/{n}"))) {
                if self.last[n].as_ref().is_none_or(|(old, _)| *old != v) {
                    self.last[n] = Some((v, Instant::now()));
                }
            }
        }
    }

    /// How long node `n`'s heartbeat has been still, counting from `since` at most.
    fn silent(&self, n: usize, since: Instant) -> Duration {
        match self.last.get(n).and_then(|x| x.as_ref()) {
            Some((_, t)) if *t > since => t.elapsed(),
            _ => since.elapsed(),
        }
    }

    fn fresh(&self, n: usize, timeout: Duration) -> bool {
        self.last.get(n).and_then(|x| x.as_ref()).is_some_and(|(_, t)| t.elapsed() < timeout)
    }
}

/// How one generation ended for node 0's agent.
enum Outcome {
    Done,
    Failed(String),
}

/// One node's agent.
struct Agent<'a> {
    o: &'a LaunchOptions,
    exe: std::path::PathBuf,
    rdzv: String,
    token: String,
    job: String,
    link: StoreLink,
    t0: Instant,
    beats: u64,
    last_beat: Option<Instant>,
    forwarded: i32,
    /// Last step rank 0 reported, per generation's job.
    progress: u64,
}

impl Agent<'_> {
    /// LAUNCH-9: every fault and recovery line carries the time since start, the Unix time
    /// (comparable with the workers' lines), the node and what is known of rank and step.
    fn log(&self, msg: std::fmt::Arguments<'_>) {
        say!(
            "shardline launch: [node {} t={:.3}s unix_ms={}] {msg}",
            self.o.node_rank,
            self.t0.elapsed().as_secs_f64(),
            unix_ms()
        );
    }

    fn gen_job(&self, gen: u64) -> String {
        format!("{}g{gen}", self.job)
    }

    fn heartbeat(&mut self) {
        if self.last_beat.is_some_and(|t| t.elapsed() < HEARTBEAT_EVERY) {
            return;
        }
        self.beats += 1;
        let key = agent_key(&self.job, &format!("hb/{}", self.o.node_rank));
        let v = self.beats.to_string();
        self.link.set(&key, v.as_bytes());
        self.last_beat = Some(Instant::now());
    }

    fn poll_progress(&mut self, gen: u64) {
        if let Got::Value(v) = self.link.get(&progress_key(&self.gen_job(gen))) {
            if let Some(s) = std::str::from_utf8(&v).ok().and_then(|t| t.parse::<u64>().ok()) {
                self.progress = self.progress.max(s);
            }
        }
    }

    /// Forwards a newly received SIGINT/SIGTERM; true once one was received.
    fn forward_signals(&mut self, workers: &[Worker]) -> bool {
        let sig = received();
        if sig != 0 && sig != self.forwarded {
            self.forwarded = sig;
            if let Ok(s) = nix::sys::signal::Signal::try_from(sig) {
                say!("shardline launch: forwarding {s} to the workers");
                signal_all(workers, s);
            }
        }
        sig != 0
    }

    fn spawn(&mut self, g: &Generation) -> Result<Vec<Worker>> {
        use nix::sys::signal::Signal;
        use std::os::unix::process::CommandExt;
        let o = self.o;
        let pos = g.nodes.iter().position(|&n| n == o.node_rank).ok_or_else(|| {
            RuntimeError::config(format!("node {} is not in generation {}", o.node_rank, g.gen))
        })?;
        let world = g.nodes.len() * o.nproc_per_node;
        let mut args = o.worker_args.clone();
        // LAUNCH-6: a restarted group goes on from the last committed checkpoint.
        if g.gen > 0 && !args.iter().any(|a| a == "--resume") {
            args.push("--resume".into());
        }
        let job = self.gen_job(g.gen);
        let mut workers: Vec<Worker> = Vec::with_capacity(o.nproc_per_node);
        for local in 0..o.nproc_per_node {
            let rank = pos * o.nproc_per_node + local;
            let mut cmd = std::process::Command::new(&self.exe);
            cmd.args(&args)
                .env("SHARDLINE_RANK", rank.to_string())
                .env("SHARDLINE_WORLD_SIZE", world.to_string())
                .env("SHARDLINE_LOCAL_RANK", local.to_string())
                .env("SHARDLINE_LOCAL_WORLD_SIZE", o.nproc_per_node.to_string())
                .env("SHARDLINE_NODE_RANK", o.node_rank.to_string())
                .env("SHARDLINE_RDZV", &self.rdzv)
                .env("SHARDLINE_TOKEN", &self.token)
                .env("SHARDLINE_JOB", &job)
                .env("SHARDLINE_GENERATION", g.gen.to_string())
                .env("SHARDLINE_TRANSPORT", o.transport.to_string());
            // SAFETY: prctl is async-signal-safe; a worker must not outlive a killed agent.
            unsafe {
                cmd.pre_exec(|| {
                    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
                });
            }
            match cmd.spawn() {
                Ok(child) => workers.push(Worker { rank, child, status: None }),
                Err(e) => {
                    signal_all(&workers, Signal::SIGKILL);
                    for w in &mut workers {
                        let _ = w.child.wait();
                    }
                    return Err(RuntimeError::config(format!("starting rank {rank}: {e}")));
                }
            }
        }
        say!(
            "shardline launch: node {}/{}: ranks {}..{} of {world} started (store {}, generation {})",
            o.node_rank,
            o.nnodes,
            pos * o.nproc_per_node,
            (pos + 1) * o.nproc_per_node - 1,
            self.rdzv,
            g.gen
        );
        Ok(workers)
    }

    /// Reaps exited workers; logs and returns the failures seen now (LAUNCH-5).
    fn poll_workers(&mut self, workers: &mut [Worker], gen: u64) -> Vec<String> {
        let mut bad: Vec<(usize, String)> = Vec::new();
        for w in workers.iter_mut().filter(|w| w.status.is_none()) {
            match w.child.try_wait() {
                Ok(Some(st)) => {
                    w.status = Some(st);
                    if !st.success() {
                        bad.push((w.rank, format!("exited with {}", describe(st))));
                    }
                }
                Ok(None) => {}
                Err(e) => bad.push((w.rank, format!("cannot be waited for: {e}"))),
            }
        }
        if bad.is_empty() {
            return Vec::new();
        }
        // The step in the line is where rank 0 stood: read it now, not at the last poll.
        self.poll_progress(gen);
        let step = self.progress + 1;
        let failed: Vec<String> = bad
            .into_iter()
            .map(|(rank, what)| format!("rank {rank} {what} during step {step} (generation {gen})"))
            .collect();
        for f in &failed {
            self.log(format_args!("fault: {f}"));
        }
        failed
    }

    /// Gives the workers `grace` to exit on their own (and report their errors), then kills
    /// the rest and reaps them all.
    fn stop(&mut self, workers: &mut [Worker], gen: u64) {
        // After a forwarded SIGINT/SIGTERM the workers are finishing a step and writing its
        // checkpoint: give them time for that, unless the user signals again.
        let asked = self.forwarded != 0;
        let wait = if asked { self.o.grace.max(SIGNAL_STOP_WAIT) } else { self.o.grace };
        let until = Instant::now() + wait;
        while workers.iter().any(|w| w.status.is_none())
            && Instant::now() < until
            && !(asked && crate::interrupt::count() >= 2)
        {
            self.heartbeat();
            self.poll_workers(workers, gen);
            std::thread::sleep(Duration::from_millis(20));
        }
        let left: Vec<usize> =
            workers.iter().filter(|w| w.status.is_none()).map(|w| w.rank).collect();
        if !left.is_empty() {
            say!("shardline launch: stopping ranks {left:?}");
            signal_all(workers, nix::sys::signal::Signal::SIGKILL);
            for w in workers.iter_mut().filter(|w| w.status.is_none()) {
                w.status = w.child.wait().ok();
            }
        }
    }

    fn publish(&mut self, g: &Generation) -> Result<()> {
        let text = serde_json::to_vec(g)
            .map_err(|e| RuntimeError::config(format!("encoding generation: {e}")))?;
        let key = agent_key(&self.job, "gen");
        let deadline = Instant::now() + STORE_LOST;
        while !self.link.set(&key, &text) {
            if Instant::now() >= deadline {
                return Err(RuntimeError::config("node 0's agent cannot reach its own store"));
            }
            std::thread::sleep(POLL_EVERY);
        }
        Ok(())
    }

    /// Node 0: which nodes start the job. A fixed-size job takes them all (its workers'
    /// rendezvous waits for them); an elastic one waits a while for the most nodes and goes
    /// with those whose agents showed up, if at least the fewest.
    fn initial_nodes(&mut self, beats: &mut Heartbeats) -> Result<Vec<usize>> {
        let o = self.o;
        if o.min_nodes >= o.nnodes {
            return Ok((0..o.nnodes).collect());
        }
        let start = Instant::now();
        loop {
            self.heartbeat();
            beats.poll(&mut self.link, &self.job);
            let up: Vec<usize> = (0..o.nnodes)
                .filter(|&n| n == o.node_rank || beats.fresh(n, o.heartbeat_timeout))
                .collect();
            if up.len() == o.nnodes
                || (start.elapsed() >= ELASTIC_JOIN_WAIT && up.len() >= o.min_nodes)
            {
                return Ok(up);
            }
            if start.elapsed() >= RENDEZVOUS_TIMEOUT {
                return Err(RuntimeError::config(format!(
                    "only node(s) {up:?} joined within {RENDEZVOUS_TIMEOUT:?}; --nnodes needs at least {}",
                    o.min_nodes
                )));
            }
            std::thread::sleep(POLL_EVERY);
        }
    }

    /// Node 0's agent: decides every generation (LAUNCH-6, LAUNCH-10).
    fn coordinate(&mut self) -> Result<i32> {
        let o = self.o;
        let me = o.node_rank;
        let mut beats = Heartbeats::new(o.nnodes);
        let nodes = self.initial_nodes(&mut beats)?;
        let mut g = Generation { gen: 0, nodes, state: GenState::Run };
        let mut restarts = 0u32;
        // (step to pass, when the failure was detected)
        let mut recovering: Option<(u64, Instant)> = None;
        loop {
            self.publish(&g)?;
            self.progress = 0;
            let mut workers = self.spawn(&g)?;
            let started = Instant::now();
            let mut last_poll: Option<Instant> = None;
            let mut interrupted = false;
            let outcome = loop {
                self.heartbeat();
                interrupted |= self.forward_signals(&workers);
                let failed = self.poll_workers(&mut workers, g.gen);
                if let Some(f) = failed.into_iter().next() {
                    break Outcome::Failed(f);
                }
                if workers.iter().all(|w| w.status.is_some_and(|s| s.success())) {
                    break Outcome::Done;
                }
                if last_poll.is_none_or(|t| t.elapsed() >= POLL_EVERY) {
                    last_poll = Some(Instant::now());
                    self.poll_progress(g.gen);
                    if let Some((target, at)) = recovering {
                        if self.progress >= target {
                            self.log(format_args!(
                                "recovered: generation {} passed step {target} again, {:.3} s after the failure was detected",
                                g.gen,
                                at.elapsed().as_secs_f64()
                            ));
                            recovering = None;
                        }
                    }
                    beats.poll(&mut self.link, &self.job);
                    let mut lost = None;
                    for &n in g.nodes.iter().filter(|&&n| n != me) {
                        let key = agent_key(&self.job, &format!("fail/{}/{n}", g.gen));
                        if let Got::Value(v) = self.link.get(&key) {
                            lost =
                                Some(format!("node {n} reports: {}", String::from_utf8_lossy(&v)));
                            break;
                        }
                        let quiet = beats.silent(n, started);
                        if quiet >= o.heartbeat_timeout {
                            lost = Some(format!(
                                "node {n} lost: no heartbeat for {:.1} s during step {} (generation {})",
                                quiet.as_secs_f64(),
                                self.progress + 1,
                                g.gen
                            ));
                            break;
                        }
                    }
                    if let Some(why) = lost {
                        self.log(format_args!("fault: {why}"));
                        break Outcome::Failed(why);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let why = match outcome {
                Outcome::Done => {
                    if let Some((target, at)) = recovering {
                        // Finished before the next poll: the group passed the step all the same.
                        self.log(format_args!(
                            "recovered: generation {} passed step {target} again and finished, {:.3} s after the failure was detected",
                            g.gen,
                            at.elapsed().as_secs_f64()
                        ));
                    }
                    g.state = GenState::Done;
                    self.publish(&g)?;
                    self.wait_for_ends(&g, &mut beats);
                    if restarts > 0 {
                        self.log(format_args!("finished after {restarts} restart(s)"));
                    }
                    return Ok(0);
                }
                Outcome::Failed(why) => why,
            };
            let detected = Instant::now();
            let failed_step = self.progress + 1;
            g.state = GenState::Stop;
            self.publish(&g)?;
            self.stop(&mut workers, g.gen);
            let alive = self.wait_stopped(&g, &mut beats, started);
            interrupted |= received() != 0;
            let give_up = |reason: String,
                           agent: &mut Self,
                           g: &mut Generation,
                           beats: &mut Heartbeats|
             -> Result<i32> {
                g.state = GenState::Abort;
                agent.publish(g)?;
                agent.log(format_args!("giving up: {reason} (last failure: {why})"));
                // The others learn of the end through this store: keep it up until they did.
                agent.wait_for_ends(g, beats);
                Ok(1)
            };
            if interrupted {
                let sig = received();
                give_up(
                    format!("stopped by {}", crate::interrupt::signal_name(sig)),
                    self,
                    &mut g,
                    &mut beats,
                )?;
                // As a shell reports a process ended by the signal.
                return Ok(128 + sig);
            }
            if restarts >= o.max_restarts {
                return give_up(
                    format!("{restarts} restart(s) of --max-restarts {} used", o.max_restarts),
                    self,
                    &mut g,
                    &mut beats,
                );
            }
            let next: Vec<usize> = if o.min_nodes >= o.nnodes {
                (0..o.nnodes).collect()
            } else {
                // LAUNCH-10: lost nodes leave; a node whose agent is back rejoins.
                (0..o.nnodes)
                    .filter(|&n| {
                        n == me
                            || alive.contains(&n)
                            || (!g.nodes.contains(&n) && beats.fresh(n, o.heartbeat_timeout))
                    })
                    .collect()
            };
            // A fixed-size job needs every node back (a partition heals, an agent restarts):
            // starting without them would only burn a restart.
            let missing: Vec<usize> = next.iter().copied().filter(|n| !alive.contains(n)).collect();
            if o.min_nodes >= o.nnodes && !missing.is_empty() {
                self.log(format_args!("waiting for node(s) {missing:?} to come back"));
                let until = Instant::now() + RENDEZVOUS_TIMEOUT;
                while Instant::now() < until
                    && !missing.iter().all(|&n| beats.fresh(n, o.heartbeat_timeout))
                {
                    self.heartbeat();
                    beats.poll(&mut self.link, &self.job);
                    std::thread::sleep(POLL_EVERY);
                }
            }
            if next.len() < o.min_nodes {
                return give_up(
                    format!("{} node(s) left, --nnodes needs at least {}", next.len(), o.min_nodes),
                    self,
                    &mut g,
                    &mut beats,
                );
            }
            restarts += 1;
            recovering = Some((failed_step, detected));
            self.log(format_args!(
                "restart {restarts}/{}: generation {} on node(s) {next:?} (world {}) resumes from the last checkpoint; the failure was at step {failed_step}",
                o.max_restarts,
                g.gen + 1,
                next.len() * o.nproc_per_node
            ));
            g = Generation { gen: g.gen + 1, nodes: next, state: GenState::Run };
        }
    }

    /// Node 0, after publishing a stop: the nodes of `g` whose agents stopped their workers,
    /// waiting at most the grace period plus the heartbeat timeout; a node whose heartbeat
    /// stays still that long is lost.
    fn wait_stopped(
        &mut self,
        g: &Generation,
        beats: &mut Heartbeats,
        started: Instant,
    ) -> Vec<usize> {
        let me = self.o.node_rank;
        let until = Instant::now() + self.o.grace + self.o.heartbeat_timeout;
        let mut alive = vec![me];
        let mut pending: Vec<usize> = g.nodes.iter().copied().filter(|&n| n != me).collect();
        while !pending.is_empty() && Instant::now() < until {
            self.heartbeat();
            beats.poll(&mut self.link, &self.job);
            let mut still = Vec::new();
            for n in pending {
                let key = agent_key(&self.job, &format!("stopped/{}/{n}", g.gen));
                match self.link.get(&key) {
                    Got::Value(_) => alive.push(n),
                    _ if beats.silent(n, started) >= self.o.heartbeat_timeout => {
                        self.log(format_args!("node {n} did not answer the stop: counted as lost"));
                    }
                    _ => still.push(n),
                }
            }
            pending = still;
            if !pending.is_empty() {
                std::thread::sleep(FAST_POLL);
            }
        }
        for n in pending {
            self.log(format_args!("node {n} did not stop in time: counted as lost"));
        }
        alive.sort_unstable();
        alive
    }

    /// Node 0 after success: keeps the store up until the other nodes' workers are done.
    fn wait_for_ends(&mut self, g: &Generation, beats: &mut Heartbeats) {
        let me = self.o.node_rank;
        let since = Instant::now();
        let mut pending: Vec<usize> = g.nodes.iter().copied().filter(|&n| n != me).collect();
        while !pending.is_empty() && since.elapsed() < END_WAIT {
            beats.poll(&mut self.link, &self.job);
            let job = self.job.clone();
            pending.retain(|&n| {
                let key = agent_key(&job, &format!("end/{}/{n}", g.gen));
                !matches!(self.link.get(&key), Got::Value(_))
                    && beats.silent(n, since) < self.o.heartbeat_timeout
            });
            if !pending.is_empty() {
                std::thread::sleep(FAST_POLL);
            }
        }
    }

    /// Any other node's agent: runs the generations node 0 decides (LAUNCH-6).
    fn follow(&mut self) -> Result<i32> {
        let me = self.o.node_rank;
        let mut cur: Option<Generation> = None;
        let mut workers: Vec<Worker> = Vec::new();
        let mut reported = false;
        let mut stopped_sent = false;
        let mut last_poll: Option<Instant> = None;
        let start = Instant::now();
        let mut told_waiting = false;
        loop {
            self.heartbeat();
            if self.forward_signals(&workers) {
                let gen = cur.as_ref().map_or(0, |g| g.gen);
                self.stop(&mut workers, gen);
                return Ok(128 + self.forwarded);
            }
            let gen = cur.as_ref().map_or(0, |g| g.gen);
            let failed = self.poll_workers(&mut workers, gen);
            if !failed.is_empty() && !reported {
                let key = agent_key(&self.job, &format!("fail/{gen}/{me}"));
                reported = self.link.set(&key, failed.join("; ").as_bytes());
            }
            let all_exited = !workers.is_empty() && workers.iter().all(|w| w.status.is_some());
            if all_exited {
                if workers.iter().all(|w| w.status.is_some_and(|s| s.success())) {
                    let key = agent_key(&self.job, &format!("end/{gen}/{me}"));
                    self.link.set(&key, b"ok");
                    return Ok(0);
                }
                if !reported {
                    let key = agent_key(&self.job, &format!("fail/{gen}/{me}"));
                    reported = self.link.set(&key, b"workers stopped");
                }
                if !stopped_sent {
                    let key = agent_key(&self.job, &format!("stopped/{gen}/{me}"));
                    stopped_sent = self.link.set(&key, b"stopped");
                }
            }
            // Once this node's workers failed or stopped, node 0's next decision is awaited
            // closely.
            let every = if reported || all_exited { FAST_POLL } else { POLL_EVERY };
            if last_poll.is_none_or(|t| t.elapsed() >= every) {
                last_poll = Some(Instant::now());
                let got = self.link.get(&agent_key(&self.job, "gen"));
                if matches!(got, Got::Unreachable)
                    && !told_waiting
                    && self.link.last_ok.elapsed() >= WAITING_NOTE_AFTER
                {
                    // Node 0 may simply start later; say what is awaited instead of silence.
                    told_waiting = true;
                    self.log(format_args!(
                        "waiting for node 0's store at {} ({}); giving up after {:?}",
                        self.rdzv,
                        self.link.last_err.as_deref().unwrap_or("no answer"),
                        STORE_LOST
                    ));
                }
                match got {
                    Got::Unreachable if self.link.last_ok.elapsed() >= STORE_LOST => {
                        self.log(format_args!(
                            "the store at {} is unreachable for {:?}: giving up",
                            self.rdzv, STORE_LOST
                        ));
                        self.stop(&mut workers, gen);
                        return Ok(1);
                    }
                    Got::Unset if start.elapsed() >= RENDEZVOUS_TIMEOUT => {
                        return Err(RuntimeError::config(format!(
                            "node 0's agent published no generation within {RENDEZVOUS_TIMEOUT:?}"
                        )));
                    }
                    Got::Value(v) => {
                        let g: Generation = serde_json::from_slice(&v).map_err(|e| {
                            RuntimeError::config(format!("node 0 published a bad generation: {e}"))
                        })?;
                        if !workers.is_empty() {
                            self.poll_progress(gen);
                        }
                        let newer = cur.as_ref().is_none_or(|c| g.gen > c.gen);
                        match g.state {
                            GenState::Abort => {
                                self.log(format_args!("node 0 ended the job after a failure"));
                                self.stop(&mut workers, gen);
                                let key = agent_key(&self.job, &format!("end/{}/{me}", g.gen));
                                self.link.set(&key, b"aborted");
                                return Ok(1);
                            }
                            GenState::Done if workers.is_empty() || all_exited => return Ok(0),
                            GenState::Run if newer => {
                                if workers.iter().any(|w| w.status.is_none()) {
                                    self.stop(&mut workers, gen);
                                }
                                workers.clear();
                                reported = false;
                                stopped_sent = false;
                                self.progress = 0;
                                if g.nodes.contains(&me) {
                                    if g.gen > 0 {
                                        self.log(format_args!(
                                            "restarting with generation {} on node(s) {:?}",
                                            g.gen, g.nodes
                                        ));
                                    }
                                    workers = self.spawn(&g)?;
                                } else {
                                    self.log(format_args!(
                                        "not in generation {} (node(s) {:?}): waiting to rejoin",
                                        g.gen, g.nodes
                                    ));
                                }
                                cur = Some(g);
                            }
                            GenState::Stop if cur.as_ref().is_some_and(|c| c.gen == g.gen) => {
                                if workers.iter().any(|w| w.status.is_none()) {
                                    self.stop(&mut workers, gen);
                                }
                                if !stopped_sent {
                                    let key = agent_key(&self.job, &format!("stopped/{gen}/{me}"));
                                    stopped_sent = self.link.set(&key, b"stopped");
                                }
                            }
                            _ => {}
                        }
                    }
                    _ => {}
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Runs the agent of one node (LAUNCH-5, LAUNCH-6): hosts the store on node 0, starts the
/// workers of each generation, watches them and the other agents. Returns the process exit
/// code: 0 when training finished.
pub fn run_agent(o: &LaunchOptions) -> Result<i32> {
    if o.nproc_per_node == 0 || o.nnodes == 0 || o.node_rank >= o.nnodes {
        return Err(RuntimeError::config(format!(
            "--nproc-per-node {} --nnodes {} --node-rank {}: need at least one process and node, and node rank < nodes",
            o.nproc_per_node, o.nnodes, o.node_rank
        )));
    }
    if o.min_nodes == 0 || o.min_nodes > o.nnodes {
        return Err(RuntimeError::config(format!(
            "--nnodes {}:{}: need 1 <= MIN <= MAX",
            o.min_nodes, o.nnodes
        )));
    }
    if o.worker_args.first().map(String::as_str) != Some("train") {
        return Err(RuntimeError::config("launch runs `train ...` after `--`"));
    }
    if (o.max_restarts > 0 || o.min_nodes < o.nnodes)
        && !o
            .worker_args
            .iter()
            .any(|a| a == "--checkpoint-dir" || a.starts_with("--checkpoint-dir="))
    {
        return Err(RuntimeError::config(
            "--max-restarts and elastic --nnodes restart from checkpoints: give --checkpoint-dir to train",
        ));
    }
    let token = match o.token.clone().or_else(|| std::env::var("SHARDLINE_TOKEN").ok()) {
        Some(t) if !t.is_empty() => t,
        _ if o.nnodes > 1 => return Err(RuntimeError::config(
            "several nodes need a job token: --token or SHARDLINE_TOKEN (the same on every node)",
        )),
        _ => random_token(),
    };
    let rdzv = match (&o.rdzv, o.nnodes) {
        (Some(r), _) => r.clone(),
        (None, 1) => "127.0.0.1:0".into(),
        (None, _) => {
            return Err(RuntimeError::config(
                "several nodes need --rdzv HOST:PORT (node 0's address)",
            ))
        }
    };
    let (server, rdzv) = if o.node_rank == 0 {
        let port = rdzv
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .ok_or_else(|| RuntimeError::config(format!("--rdzv {rdzv}: expected HOST:PORT")))?;
        // An address given by the user is reached through whatever interface it names.
        let bind = if o.rdzv.is_some() { "0.0.0.0" } else { "127.0.0.1" };
        let server = TcpStoreServer::bind((bind, port), &token)
            .map_err(|e| RuntimeError::config(format!("hosting the store on port {port}: {e}")))?;
        let host = rdzv.rsplit_once(':').map(|(h, _)| h.to_owned()).unwrap_or_default();
        let actual = format!("{host}:{}", server.addr().port());
        (Some(server), actual)
    } else {
        (None, rdzv)
    };
    // One job name for every node: derived from what every node was given.
    let job = format!("l{}", &checkpoint::config_hash(&(rdzv.as_str(), token.as_str()))?[..10]);
    // The agent forwards signals itself; its workers' own handlers stop them (INT-1).
    crate::interrupt::install(false)?;
    let exe = std::env::current_exe()
        .map_err(|e| RuntimeError::config(format!("cannot find the shardline binary: {e}")))?;
    let link = StoreLink {
        addr: rdzv.clone(),
        token: token.clone(),
        client: None,
        last_ok: Instant::now(),
        last_err: None,
    };
    let mut agent = Agent {
        o,
        exe,
        rdzv,
        token,
        job,
        link,
        t0: Instant::now(),
        beats: 0,
        last_beat: None,
        forwarded: 0,
        progress: 0,
    };
    let code = if o.node_rank == 0 { agent.coordinate()? } else { agent.follow()? };
    drop(server);
    if code > 128 {
        say!(
            "shardline launch: node {} stopped by {}",
            o.node_rank,
            crate::interrupt::signal_name(code - 128)
        );
    } else if code != 0 {
        say!("shardline launch: node {} failed", o.node_rank);
    }
    Ok(code)
}
