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
//!   ranks of different nodes talk over TCP ([`HybridTransport`]).
//! - LAUNCH-3: ranks run the same steps on the same data order in lockstep; rank 0 alone
//!   prints progress, the per-step log and the summary.
//! - LAUNCH-4: a checkpoint is committed by rank 0 only after every rank wrote its shard
//!   (a collective barrier), with the file entries every rank published in the store.
//! - LAUNCH-5: the agent reports a worker that dies (rank, exit code or signal), stops the
//!   others after a short grace period in which they may report their own errors, and exits
//!   non-zero; SIGINT and SIGTERM are forwarded to the workers.

use crate::checkpoint::{self, FileEntry, PendingCheckpoint};
use crate::engine::RankEngine;
use crate::error::{Result, RuntimeError};
use crate::memory::MemoryTracker;
use crate::telemetry::Trace;
use crate::train::{self, JobPlan, RunOptions, Summary, TrainConfig};
use shardline_collectives::transport::hybrid::HybridTransport;
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
        Ok(Some(WorkerEnv {
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
    let client = TcpStoreClient::connect(env.rdzv.as_str(), &env.token, RENDEZVOUS_TIMEOUT)
        .map_err(store_err("connecting"))?;
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
    let transport = HybridTransport::new(env.rank, &topology, Arc::clone(&store), &env.job, tcp)
        .map_err(|e| {
            RuntimeError::config(format!("rank {}: transport setup failed: {e}", env.rank))
        })?;
    let mut copts = CommOptions::new();
    copts.timeout(Duration::from_secs(cfg.timeout_s));
    let comm =
        Communicator::new(Arc::new(transport) as Arc<dyn Transport>, topology.clone(), copts)?;
    Ok(Joined { _server: server, store, topology, comm })
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
            "  processes: {} on {} node(s) ({}), hybrid transport (shm inside a node, tcp across)",
            env.world,
            joined.topology.nodes(),
            env.source
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
    for _ in 0..run_steps {
        let epoch = done / plan.steps_per_epoch;
        let index = (done % plan.steps_per_epoch) as usize;
        let batches = sampler.rank_batches(epoch, rank);
        let (global, idx) = batches
            .get(index)
            .ok_or_else(|| RuntimeError::config(format!("epoch {epoch} has no batch {index}")))?;
        let (x, y) = plan.train.batch(idx);
        let st = engine.train_step(x, &y, *global)?;
        done += 1;
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
        step_stats.push(st);
        if let Some(dir) = &opts.checkpoint_dir {
            let every = opts.checkpoint_every;
            let last = done == plan.total_steps || done - first == run_steps;
            if (every > 0 && done.is_multiple_of(every)) || last {
                let position =
                    train::loader_position(plan.steps_per_epoch, epoch, index as u64 + 1, cfg.seed);
                save(cfg, &plan, env, joined, &control, &engine, dir, done, position)?;
            }
        }
    }
    if let Some(w) = log.as_mut() {
        w.flush().map_err(|e| RuntimeError::config(format!("writing --log-json: {e}")))?;
    }
    let loop_s = t_loop.elapsed().as_secs_f64();
    let n = plan.test.len();
    let r = DistributedSampler::slice_range(n, cfg.world, rank);
    let idx: Vec<usize> = r.collect();
    let (x, y) = plan.test.batch(&idx);
    let (correct, count, _) = engine.eval(x, &y, n)?;
    let final_params = engine.full_params()?;
    let final_buffers = engine.buffers().to_vec();
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
    dir: &std::path::Path,
    step: u64,
    position: checkpoint::DataLoaderState,
) -> Result<()> {
    let wait = Duration::from_secs(cfg.timeout_s);
    let pending = if env.rank == 0 { Some(PendingCheckpoint::begin(dir, step)?) } else { None };
    control.barrier().wait_timeout(wait)?;
    let pending = match pending {
        Some(p) => p,
        None => PendingCheckpoint::join(dir, step)?,
    };
    let entry = pending.write_shard(env.rank, &engine.shard_state())?;
    let key = |r: usize| format!("launch/{}/ckpt/{step}/{r}", env.job);
    let text = serde_json::to_vec(&entry)
        .map_err(|e| RuntimeError::config(format!("encoding file entry: {e}")))?;
    joined.store.set(&key(env.rank), &text).map_err(store_err("publishing a shard"))?;
    control.barrier().wait_timeout(wait)?;
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
    control.barrier().wait_timeout(wait)?;
    Ok(())
}

/// Writes one line to stderr in a single write, so that it never interleaves with the
/// workers' lines.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let line = format!("{}\n", format_args!($($t)*));
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
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
}

/// Signal last received by the agent (0: none).
static RECEIVED: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn on_signal(sig: i32) {
    RECEIVED.store(sig, std::sync::atomic::Ordering::SeqCst);
}

fn install_forwarding() -> Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let act = SigAction::new(SigHandler::Handler(on_signal), SaFlags::SA_RESTART, SigSet::empty());
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { sigaction(sig, &act) }
            .map_err(|e| RuntimeError::config(format!("installing a {sig} handler: {e}")))?;
    }
    Ok(())
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

/// Runs the agent of one node (LAUNCH-5): hosts the store on node 0, starts the workers,
/// watches them. Returns the process exit code: 0 when every worker succeeded.
pub fn run_agent(o: &LaunchOptions) -> Result<i32> {
    use nix::sys::signal::Signal;
    use std::os::unix::process::CommandExt;
    if o.nproc_per_node == 0 || o.nnodes == 0 || o.node_rank >= o.nnodes {
        return Err(RuntimeError::config(format!(
            "--nproc-per-node {} --nnodes {} --node-rank {}: need at least one process and node, and node rank < nodes",
            o.nproc_per_node, o.nnodes, o.node_rank
        )));
    }
    if o.worker_args.first().map(String::as_str) != Some("train") {
        return Err(RuntimeError::config("launch runs `train ...` after `--`"));
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
    install_forwarding()?;
    let exe = std::env::current_exe()
        .map_err(|e| RuntimeError::config(format!("cannot find the shardline binary: {e}")))?;
    let world = o.nnodes * o.nproc_per_node;
    let mut workers: Vec<Worker> = Vec::with_capacity(o.nproc_per_node);
    for local in 0..o.nproc_per_node {
        let rank = o.node_rank * o.nproc_per_node + local;
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(&o.worker_args)
            .env("SHARDLINE_RANK", rank.to_string())
            .env("SHARDLINE_WORLD_SIZE", world.to_string())
            .env("SHARDLINE_LOCAL_RANK", local.to_string())
            .env("SHARDLINE_LOCAL_WORLD_SIZE", o.nproc_per_node.to_string())
            .env("SHARDLINE_NODE_RANK", o.node_rank.to_string())
            .env("SHARDLINE_RDZV", &rdzv)
            .env("SHARDLINE_TOKEN", &token)
            .env("SHARDLINE_JOB", &job);
        // SAFETY: prctl is async-signal-safe; a worker must not outlive a killed agent.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
            });
        }
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                signal_all(&workers, Signal::SIGKILL);
                return Err(RuntimeError::config(format!("starting rank {rank}: {e}")));
            }
        };
        workers.push(Worker { rank, child, status: None });
    }
    eprintln!(
        "shardline launch: node {}/{}: ranks {}..{} of {world} started (store {rdzv})",
        o.node_rank,
        o.nnodes,
        o.node_rank * o.nproc_per_node,
        (o.node_rank + 1) * o.nproc_per_node - 1
    );
    let mut failed: Option<Instant> = None;
    let mut killed = false;
    let mut forwarded = 0;
    loop {
        let sig = RECEIVED.load(std::sync::atomic::Ordering::SeqCst);
        if sig != 0 && sig != forwarded {
            forwarded = sig;
            if let Ok(s) = Signal::try_from(sig) {
                say!("shardline launch: forwarding {s} to the workers");
                signal_all(&workers, s);
            }
        }
        for w in workers.iter_mut().filter(|w| w.status.is_none()) {
            match w.child.try_wait() {
                Ok(Some(st)) => {
                    w.status = Some(st);
                    if !st.success() {
                        say!("shardline launch: rank {} exited with {}", w.rank, describe(st));
                        failed.get_or_insert_with(Instant::now);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    say!("shardline launch: cannot wait for rank {}: {e}", w.rank);
                    failed.get_or_insert_with(Instant::now);
                }
            }
        }
        if workers.iter().all(|w| w.status.is_some()) {
            break;
        }
        if let Some(t) = failed {
            if !killed && t.elapsed() >= o.grace {
                let left: Vec<usize> =
                    workers.iter().filter(|w| w.status.is_none()).map(|w| w.rank).collect();
                say!("shardline launch: stopping ranks {left:?}");
                signal_all(&workers, Signal::SIGKILL);
                killed = true;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(server);
    let bad: Vec<usize> =
        workers.iter().filter(|w| !w.status.is_some_and(|s| s.success())).map(|w| w.rank).collect();
    if bad.is_empty() {
        Ok(0)
    } else {
        say!("shardline launch: failed ranks {bad:?}");
        Ok(1)
    }
}
