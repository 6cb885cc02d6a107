//! `shardline`: train with every rank as an actor in one process, and inspect or export
//! checkpoints.

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use shardline_runtime::engine::Device;
use shardline_runtime::optim::WeightDecayOn;
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{RunOptions, StageChoice, SyncBnMode, TrainConfig};
use shardline_runtime::RuntimeError;
use std::path::PathBuf;

/// Large buffers come from a shared-memory arena, so that shm peers read them in place
/// (`shardline_collectives::arena`).
#[global_allocator]
static ALLOC: shardline_collectives::arena::SharedArena = shardline_collectives::arena::SharedArena;

/// Sharded data-parallel training (ZeRO 0-3 / FSDP) with SyncBatchNorm, on threads, processes
/// or nodes.
#[derive(Parser, Debug)]
#[command(
    name = "shardline",
    version,
    about = "Sharded data-parallel training (ZeRO 0-3 / FSDP) with SyncBatchNorm, on threads, processes or nodes",
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Train a model with every rank as an actor in this process.
    ///
    /// With no flags: mlp-bn on the bundled digits data, 4 ranks, ZeRO stage 3, SyncBN chosen
    /// automatically.
    ///
    /// Under a launcher (shardline launch, torchrun or srun; see `shardline launch --help`)
    /// this process is one rank of the job. SHARDLINE_TOKEN (the job token) is required.
    ///
    /// Examples:
    ///   shardline train
    ///   shardline train --stage auto --device-memory 64M --model wide-mlp --params 20M --dataset synthetic --steps 5
    ///   shardline train --model mlp-bn --hidden 1024 --depth 4 --dataset synthetic --input-dim 784 --classes 10 --batch-size 256 --world 2 --steps 20
    ///   shardline train --checkpoint-dir ckpt --checkpoint-every 20 --resume
    ///   SHARDLINE_TOKEN=T srun --nodes 2 --ntasks-per-node 4 shardline train --steps 50
    ///   SHARDLINE_TOKEN=T torchrun --no-python --nproc-per-node 4 shardline train --steps 50
    #[command(verbatim_doc_comment)]
    Train(Box<TrainArgs>),
    /// Inspect or export checkpoints.
    #[command(subcommand)]
    Checkpoint(CheckpointCmd),
    /// Print the hang/desync report from a failure dump (`train --dump-on-failure FILE`).
    Doctor {
        /// The dump file.
        dump: PathBuf,
    },
    /// Start one `train` process per rank on this node (run one agent per node).
    ///
    /// A job of several processes starts in one of three ways. Each rank is a `shardline
    /// train` process, and every rank needs the same SHARDLINE_TOKEN (the job's secret).
    ///
    /// With this launcher, one agent per node; node 0's agent hosts the rendezvous store:
    ///   shardline launch --nproc-per-node 4 -- train --steps 50
    ///   shardline launch --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29500 --token T \
    ///       --nproc-per-node 4 -- train --steps 50      (--node-rank 1 on the other node)
    ///
    /// With torchrun (also what Kubernetes PyTorchJob runs): the ranks meet in the TCPStore
    /// torchrun's agent serves at MASTER_ADDR:MASTER_PORT; one node, then several:
    ///   SHARDLINE_TOKEN=T torchrun --no-python --nproc-per-node 4 shardline train --steps 50
    ///   SHARDLINE_TOKEN=T torchrun --no-python --nnodes 2 --nproc-per-node 4 \
    ///       --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job1 \
    ///       shardline train --steps 50                  (the same on every node)
    /// With torchrun's --max-restarts, add --checkpoint-dir D --resume to the train flags so
    /// that a restarted group goes on from the newest checkpoint that verifies.
    ///
    /// With Slurm, one task per rank; rank 0 hosts the store on the step's first node at
    /// port 15000 + the last four digits of SLURM_JOB_ID (SHARDLINE_RDZV=HOST:PORT, or
    /// MASTER_ADDR with MASTER_PORT, names another):
    ///   SHARDLINE_TOKEN=T srun --nodes 2 --ntasks-per-node 4 shardline train --steps 50
    ///
    /// On SIGTERM or SIGINT the ranks stop together after the step in progress (and
    /// checkpoint it with --checkpoint-dir). A rank still waiting after the signal ends
    /// instead, naming what it waited for: in rendezvous at once, on a step's collective
    /// after 0.5 s, on a checkpoint's barrier after 20 s.
    #[command(verbatim_doc_comment)]
    Launch(LaunchArgs),
}

/// `shardline launch`.
#[derive(Args, Debug)]
struct LaunchArgs {
    /// Worker processes on this node.
    #[arg(long)]
    nproc_per_node: usize,
    /// Nodes in the job: N, or MIN:MAX for an elastic job (a lost node shrinks the world
    /// down to MIN nodes; the checkpoint reshards on load).
    #[arg(long, default_value = "1", value_parser = shardline_runtime::launch::parse_nnodes)]
    nnodes: (usize, usize),
    /// This node's index (0 hosts the rendezvous store).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Rendezvous store HOST:PORT (node 0's address); required for several nodes.
    #[arg(long)]
    rdzv: Option<String>,
    /// Job token (else SHARDLINE_TOKEN); required for several nodes, generated for one.
    #[arg(long)]
    token: Option<String>,
    /// Seconds the other workers get to exit on their own after one died.
    #[arg(long, default_value_t = 2.0)]
    grace_s: f64,
    /// Restart the worker group (on every node) from the newest checkpoint that verifies, up
    /// to N times, after a worker dies or a node is lost (not after a worker's exit code 2,
    /// invalid input); needs --checkpoint-dir in the train arguments.
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// Seconds without a heartbeat after which node 0's agent counts a node as lost.
    #[arg(long, default_value_t = 3.0)]
    heartbeat_timeout_s: f64,
    /// Transport between the workers: auto (shm inside a node; rdma across nodes when every
    /// rank opens an RDMA device, else tcp), or tcp, rdma, shm for every pair of ranks.
    #[arg(long, default_value = "auto")]
    transport: shardline_collectives::transport::select::TransportChoice,
    /// The worker command: `train ...`.
    #[arg(last = true, required = true)]
    worker: Vec<String>,
}

#[derive(Subcommand, Debug)]
enum CheckpointCmd {
    /// Print a checkpoint's manifest summary and verify its files.
    Inspect {
        /// A `step-NNNNNNNN` directory, or a checkpoint root (its latest checkpoint is used).
        dir: PathBuf,
    },
    /// Write a consolidated safetensors file with stable parameter names.
    Export {
        /// A `step-NNNNNNNN` directory, or a checkpoint root (its latest checkpoint is used).
        dir: PathBuf,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
    },
}

/// `--weight-decay-on`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum DecayOnArg {
    All,
    Matrices,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OnOffAuto {
    On,
    Off,
    Auto,
}

/// Where the kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend (needs the `cuda` feature and a GPU).
    Cuda,
}

#[derive(Args, Debug)]
struct TrainArgs {
    /// Compute device: cpu, or cuda (a build with the `cuda` feature, on a host with a GPU:
    /// matrix multiplies and elementwise kernels run on GPU 0, the shards, the optimizer and
    /// the collectives stay on the host). Without a GPU: exit 2 naming what is missing.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceKind,
    /// Number of ranks (threads, one actor each).
    #[arg(long, default_value_t = 4)]
    world: usize,
    /// ZeRO stage: 0 (DDP), 1, 2, 3 (FSDP full shard), or auto (the lowest whose estimate fits
    /// --device-memory).
    #[arg(long, default_value = "3")]
    stage: String,
    /// Model: mlp-bn, convnet-bn, wide-mlp, or gpt (nanoGPT's decoder, byte-level on
    /// --dataset text; sized by --n-layer, --n-head, --n-embd, --block-size).
    /// [default: mlp-bn, or the --config file's [model] name]
    #[arg(long)]
    model: Option<String>,
    /// Data set: digits (bundled, 8x8 images), synthetic (a random teacher network), text
    /// (the bundled license texts, bytes) or text:PATH (a file or folder of bytes, the last
    /// 10% held out; or a nanoGPT uint16 .bin token file, training only).
    #[arg(long, default_value = "digits")]
    dataset: String,
    /// gpt: transformer blocks [default: 4].
    #[arg(long)]
    n_layer: Option<usize>,
    /// gpt: attention heads; must divide --n-embd [default: 4].
    #[arg(long)]
    n_head: Option<usize>,
    /// gpt: embedding width [default: 128].
    #[arg(long)]
    n_embd: Option<usize>,
    /// gpt: context length in tokens; windows of block_size + 1 tokens must fit in the
    /// text [default: 64].
    #[arg(long)]
    block_size: Option<usize>,
    /// Epochs over the training set.
    #[arg(long, default_value_t = 10)]
    epochs: u64,
    /// Total optimizer steps (overrides --epochs).
    #[arg(long)]
    steps: Option<u64>,
    /// Global batch size (split across ranks; uneven splits are allowed).
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 0.05)]
    lr: f32,
    /// Optimizer: sgd (momentum 0.9) or adamw.
    #[arg(long, default_value = "sgd")]
    optimizer: String,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    /// Weight decay (coupled for SGD, decoupled for AdamW).
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f32,
    /// Which parameters --weight-decay applies to: all, or matrices (parameters of two or
    /// more dimensions; biases and norm gains get none, as nanoGPT's AdamW groups do).
    #[arg(long, value_enum, default_value_t = DecayOnArg::All)]
    weight_decay_on: DecayOnArg,
    /// Linear warmup steps before the cosine decay.
    #[arg(long, default_value_t = 0)]
    warmup_steps: u64,
    /// Keep the learning rate constant instead of cosine decay.
    #[arg(long)]
    constant_lr: bool,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    clip_grad_norm: Option<f64>,
    /// SyncBatchNorm: on, off, or auto (on when the per-rank batch is below
    /// --sync-bn-threshold; SyncBN costs a reduction per layer and pays only when per-rank
    /// statistics are noisy).
    #[arg(long, value_enum, default_value = "auto")]
    sync_bn: OnOffAuto,
    /// Per-rank batch below which auto turns SyncBN on.
    #[arg(long, default_value_t = 32)]
    sync_bn_threshold: usize,
    /// Seed for initialisation, shuffling and synthetic data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Units gathered ahead of use at stage 3 (0 disables prefetch).
    #[arg(long, default_value_t = 1)]
    prefetch: usize,
    /// Byte budget for gathered units in flight (default: (prefetch+1) x the largest unit).
    #[arg(long, value_parser = parse_bytes)]
    prefetch_budget: Option<u64>,
    /// Per-rank memory cap like a GPU's (e.g. 512M, 2G): exceeding it is an OutOfMemory error.
    #[arg(long, value_parser = parse_bytes)]
    device_memory: Option<u64>,
    /// Artificial bandwidth of each link between ranks (e.g. 1gbit, 200MB/s; default
    /// unlimited, or env SHARDLINE_LINK_RATE), so that communication costs what a network
    /// would.
    #[arg(long, value_parser = shardline_collectives::config::parse_rate)]
    link_rate: Option<u64>,
    /// Hidden width (mlp-bn) or first-stage channels (convnet-bn).
    #[arg(long)]
    hidden: Option<usize>,
    /// Number of hidden blocks (mlp-bn).
    #[arg(long)]
    depth: Option<usize>,
    /// Synthetic data: input features.
    #[arg(long, default_value_t = 784)]
    input_dim: usize,
    /// Synthetic data: classes.
    #[arg(long, default_value_t = 10)]
    classes: usize,
    /// Synthetic data: training samples.
    #[arg(long, default_value_t = 8192)]
    samples: usize,
    /// wide-mlp: parameter count (e.g. 50M).
    #[arg(long, value_parser = parse_count, default_value = "50M")]
    params: usize,
    /// Group blocks into units of at least this many parameters (0: one unit per block).
    #[arg(long, value_parser = parse_count, default_value = "0")]
    wrap_params: usize,
    /// Compute threads per rank.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Collective timeout in seconds (a stuck rank fails the job instead of hanging it).
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Directory for sharded checkpoints. SIGINT (Ctrl-C) or SIGTERM stops the run after
    /// the step in progress and writes a checkpoint of it here (exit 130 / 143); a second
    /// signal ends it at once.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N steps (and always at the end when --checkpoint-dir is set).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Resume from the newest checkpoint in --checkpoint-dir whose files verify (sizes,
    /// CRC32, SHA-256); each newer one that does not is named on stderr with why and moved
    /// aside to damaged-step-N. Refused: a checkpoint of another configuration, model or
    /// format version (exit 1), and checkpoints none of which verifies (exit 2). With no
    /// checkpoint there, start fresh.
    #[arg(long)]
    resume: bool,
    /// Append one JSON object per step to this file: step, epoch, loss, lr, grad_norm and
    /// stats_messages (the job's figures, the same however the ranks run), and step_time_s
    /// (the slowest rank of this process), compute_s, comm_s, comm_exposed_s and peak_bytes.
    /// Launched (`shardline launch`, torchrun, Slurm), rank 0 writes it with its own timings.
    #[arg(long)]
    log_json: Option<PathBuf>,
    /// Write a Chrome trace (open in Perfetto) to this file.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9100).
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Stop after this many steps of this invocation (the checkpoint then lets --resume go on).
    #[arg(long)]
    stop_after: Option<u64>,
    /// Write the summary as JSON to this file.
    #[arg(long)]
    summary_json: Option<PathBuf>,
    /// No progress display (by default a bar on a terminal, else a line every ten steps;
    /// launched, rank 0 alone shows it).
    #[arg(long)]
    no_progress: bool,
    /// Inject a fault (repeatable): kill:rank=R:step=S[:phase=forward|backward|reduce|checkpoint],
    /// stall:rank=R:step=S:secs=T, delay:link=A-B:ms=M[:jitter=J], drop:link=A-B:p=P,
    /// corrupt:link=A-B:p=P (partition:node=N:step=S:secs=T needs `shardline launch`).
    #[arg(long = "fault", value_name = "SPEC")]
    faults: Vec<String>,
    /// Seed of every random fault decision (default: the config file's, else 0).
    #[arg(long)]
    fault_seed: Option<u64>,
    /// TOML config file: its `[model]` table (`name`, and gpt's `n_layer`, `n_head`,
    /// `n_embd`, `block_size`) and its `[faults]` table (`specs = [...]`, `seed = N`, the
    /// fault plan); flags given on the command line win over the file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Restart the rank group from the last checkpoint up to N times after a failure.
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// At the first failure, write every rank's recent collectives to this JSON file
    /// (read it with `shardline doctor FILE`).
    #[arg(long)]
    dump_on_failure: Option<PathBuf>,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_scaled(s, 1024).map_err(|e| format!("{e} (try 512M or 2G)"))
}

fn parse_count(s: &str) -> Result<usize, String> {
    parse_scaled(s, 1000).map(|v| v as usize).map_err(|e| format!("{e} (try 50M or 1500000)"))
}

fn parse_scaled(s: &str, base: u64) -> Result<u64, String> {
    let t = s.trim();
    let idx = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(idx);
    let n: f64 = num.parse().map_err(|_| format!("'{s}' is not a number"))?;
    let m = match unit.trim().to_ascii_lowercase().trim_end_matches("ib").trim_end_matches('b') {
        "" => 1,
        "k" => base,
        "m" => base * base,
        "g" => base * base * base,
        other => return Err(format!("unknown suffix '{other}' in '{s}'")),
    };
    if !(n.is_finite() && n >= 0.0) {
        return Err(format!("'{s}' is not a valid size"));
    }
    Ok((n * m as f64) as u64)
}

fn to_config(a: &TrainArgs) -> Result<TrainConfig, String> {
    let stage = match a.stage.as_str() {
        "auto" => StageChoice::Auto,
        s => {
            let n: u8 =
                s.parse().map_err(|_| format!("--stage must be 0, 1, 2, 3 or auto, not '{s}'"))?;
            StageChoice::Fixed(Stage::from_index(n).map_err(|e| e.to_string())?)
        }
    };
    Ok(TrainConfig {
        world: a.world,
        stage,
        model: a.model.clone().unwrap_or_else(|| "mlp-bn".into()),
        dataset: a.dataset.clone(),
        epochs: a.epochs,
        steps: a.steps,
        batch_size: a.batch_size,
        lr: a.lr,
        optimizer: a.optimizer.clone(),
        momentum: a.momentum,
        weight_decay: a.weight_decay,
        weight_decay_on: match a.weight_decay_on {
            DecayOnArg::All => WeightDecayOn::All,
            DecayOnArg::Matrices => WeightDecayOn::Matrices,
        },
        warmup_steps: a.warmup_steps,
        cosine: !a.constant_lr,
        clip_grad_norm: a.clip_grad_norm,
        sync_bn: match a.sync_bn {
            OnOffAuto::On => SyncBnMode::On,
            OnOffAuto::Off => SyncBnMode::Off,
            OnOffAuto::Auto => SyncBnMode::Auto,
        },
        sync_bn_threshold: a.sync_bn_threshold,
        seed: a.seed,
        prefetch: a.prefetch,
        prefetch_budget: a.prefetch_budget,
        device_memory: a.device_memory,
        hidden: a.hidden,
        depth: a.depth,
        input_dim: a.input_dim,
        classes: a.classes,
        samples: a.samples,
        params: a.params,
        wrap_params: a.wrap_params,
        n_layer: a.n_layer,
        n_head: a.n_head,
        n_embd: a.n_embd,
        block_size: a.block_size,
        threads: a.threads,
        device: Device::Cpu,
        timeout_s: a.timeout,
        link_rate: a.link_rate,
    })
}

fn exit_for(e: &RuntimeError) -> i32 {
    // Configuration mistakes are usage errors (2); failures while running are 1.
    match e {
        RuntimeError::Config(_) => 2,
        RuntimeError::DeviceUnavailable(_) => 2,
        // `--resume` over checkpoints none of which verifies (CKPT-5).
        RuntimeError::NoVerifiedCheckpoint { .. } => 2,
        // As a shell reports a process ended by the signal.
        RuntimeError::Interrupted { signal, .. } => 128 + signal,
        RuntimeError::OutOfMemory { .. } => 1,
        _ => 1,
    }
}

/// Opens `--device` before anything starts: a host without a GPU (or a build without the
/// feature) is a usage error with exit code 2, naming what is missing.
fn check_device(device: DeviceKind) -> Result<Device, String> {
    let d = match device {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => Device::Cuda(0),
    };
    shardline_runtime::engine::open_backend(d, 1).map_err(|e| format!("--device {d}: {e}"))?;
    Ok(d)
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHARDLINE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let help = format!(
        "Environment:\n  SHARDLINE_LOG              log filter (default warn; e.g. info, \
         shardline_runtime=debug)\n  SHARDLINE_TOKEN            launch: the job token when \
         --token is not given\n{}",
        shardline_collectives::config::env_help()
    );
    let parsed =
        Cli::command().after_help(help).try_get_matches().and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    let code = match cli.cmd {
        Cmd::Train(a) => {
            let device = match check_device(a.device) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(2);
                }
            };
            let cfg = match to_config(&a).and_then(|c| {
                let mut c = TrainConfig { device, ..c };
                if let Some(path) = &a.config {
                    let f = shardline_runtime::config_file::ConfigFile::load(path)
                        .map_err(|e| e.to_string())?;
                    f.model.apply(a.model.as_deref(), &mut c);
                }
                Ok(c)
            }) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(2);
                }
            };
            if let Some(addr) = a.metrics_addr {
                if let Err(e) = shardline_runtime::telemetry::serve_prometheus(addr) {
                    eprintln!("error: {e}");
                    std::process::exit(2);
                }
            }
            let launched = match shardline_runtime::launch::WorkerEnv::from_env() {
                Ok(env) => env,
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(2);
                }
            };
            let file = match &a.config {
                Some(path) => match shardline_runtime::fault::FaultsConfig::load(path) {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("error: {e}");
                        std::process::exit(2);
                    }
                },
                None => shardline_runtime::fault::FaultsConfig::default(),
            };
            let plan = match file.plan(&a.faults, a.fault_seed).and_then(|p| {
                match &launched {
                    Some(env) => p.validate_launched(env.world),
                    None => p.validate(cfg.world),
                }
                .map(|_| p)
                .map_err(|e| e.to_string())
            }) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(2);
                }
            };
            let injector = (!plan.faults.is_empty())
                .then(|| shardline_runtime::fault::FaultInjector::new(plan));
            let mut opts = RunOptions {
                checkpoint_dir: a.checkpoint_dir.clone(),
                checkpoint_every: a.checkpoint_every,
                resume: a.resume,
                log_json: a.log_json.clone(),
                trace: a.trace.clone(),
                progress: !a.no_progress,
                stop_after: a.stop_after,
                quiet: false,
                faults: None,
                dump_on_failure: a.dump_on_failure.clone(),
                // The run's result is in its checkpoints (`checkpoint export`); gathering the
                // whole model on every rank at the end would cost what sharding saved.
                skip_final_params: true,
                stop_on_signal: true,
            };
            if let Some(env) = launched {
                // The worker's rank faults fire in the process itself (LAUNCH-8); restarts
                // are the agent's (`launch --max-restarts`).
                opts.faults = injector;
                std::process::exit(worker_mode(&a, &cfg, &opts, env));
            }
            // Ctrl-C or a scheduler's SIGTERM: stop after the step in progress, checkpoint it.
            if let Err(e) = shardline_runtime::interrupt::install(true) {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
            let sup =
                shardline_runtime::supervise::run_supervised(cfg, opts, injector, a.max_restarts);
            sup.print();
            let faults = sup.fault_summary();
            match sup.result {
                Ok(summary) => {
                    if let Some(p) = &a.summary_json {
                        let mut v = serde_json::to_value(&summary).unwrap_or_default();
                        if let Some(o) = v.as_object_mut() {
                            o.insert(
                                "faults".into(),
                                serde_json::to_value(&faults).unwrap_or_default(),
                            );
                        }
                        let text = serde_json::to_string_pretty(&v).unwrap_or_default();
                        if let Err(e) = std::fs::write(p, text) {
                            eprintln!("error: writing {}: {e}", p.display());
                            std::process::exit(1);
                        }
                    }
                    0
                }
                Err(e @ RuntimeError::Interrupted { .. }) => {
                    eprintln!("{e}");
                    exit_for(&e)
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    exit_for(&e)
                }
            }
        }
        Cmd::Launch(l) => launch_cmd(l),
        Cmd::Doctor { dump } => match shardline_runtime::doctor::Diagnosis::load(&dump) {
            Ok(d) => {
                print!("{}", d.report());
                0
            }
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        },
        Cmd::Checkpoint(c) => match checkpoint_cmd(c) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        },
    };
    std::process::exit(code);
}

fn resolve(dir: PathBuf) -> Result<PathBuf, RuntimeError> {
    if dir.join("manifest.json").exists() {
        return Ok(dir);
    }
    shardline_runtime::checkpoint::latest(&dir)?.ok_or_else(|| {
        RuntimeError::checkpoint(
            &dir,
            "no committed checkpoint here (expected manifest.json or step-* directories)",
        )
    })
}

fn checkpoint_cmd(c: CheckpointCmd) -> Result<(), RuntimeError> {
    match c {
        CheckpointCmd::Inspect { dir } => {
            let d = resolve(dir)?;
            println!("{}", shardline_runtime::checkpoint::inspect(&d)?);
            // The summary only compares sizes; a damaged shard must fail the command.
            shardline_runtime::checkpoint::Checkpoint::open(&d)?.verify()?;
            println!("all files verified (sizes, crc32, sha256)");
        }
        CheckpointCmd::Export { dir, out } => {
            let d = resolve(dir)?;
            let n = shardline_runtime::checkpoint::export_safetensors(&d, &out)?;
            println!("wrote {} tensors from {} to {}", n, d.display(), out.display());
        }
    }
    Ok(())
}

/// `shardline train` as one rank of a multi-process job, when a launch environment is set
/// (`shardline launch`, torchrun or Slurm variables); returns the exit code.
fn worker_mode(
    a: &TrainArgs,
    cfg: &TrainConfig,
    opts: &RunOptions,
    env: shardline_runtime::launch::WorkerEnv,
) -> i32 {
    use shardline_runtime::launch::run_worker;
    let mut opts = opts.clone();
    opts.progress = opts.progress && env.rank == 0;
    // The agent forwards SIGINT/SIGTERM: stop with the group after a step, checkpoint it.
    // LAUNCH-13: a wait that outlasts its grace after the signal ends the worker.
    let installed = shardline_runtime::interrupt::install(false).and_then(|_| {
        shardline_runtime::interrupt::watch_waits(format!("shardline: rank {}", env.rank))
    });
    if let Err(e) = installed {
        eprintln!("error: rank {}: {e}", env.rank);
        return 1;
    }
    match run_worker(cfg.clone(), opts, &env) {
        Ok(summary) => {
            if let (Some(p), 0) = (&a.summary_json, env.rank) {
                let text = serde_json::to_string_pretty(&summary).unwrap_or_default();
                if let Err(e) = std::fs::write(p, text) {
                    eprintln!("error: writing {}: {e}", p.display());
                    return 1;
                }
            }
            0
        }
        Err(e) => {
            // One write, so that the lines of ranks sharing a terminal never interleave.
            use std::io::Write;
            let interrupted = matches!(e, RuntimeError::Interrupted { .. });
            // A failure after a stop was asked (a peer that stopped first closed the store or a
            // link) is the stop's doing: reported, and ended, as the stop.
            let stopped = shardline_runtime::interrupt::requested().filter(|_| !interrupted);
            let line = match stopped {
                Some(sig) => format!(
                    "rank {}: stopped by {}; meanwhile: {e}\n",
                    env.rank,
                    shardline_runtime::interrupt::signal_name(sig)
                ),
                None if interrupted => format!("rank {}: {e}\n", env.rank),
                None => format!("error: rank {}: {e}\n", env.rank),
            };
            let _ = std::io::stderr().write_all(line.as_bytes());
            if env.source == "torchrun" {
                shardline_runtime::launch::record_torchrun_error(line.trim_end());
            }
            stopped.map_or_else(|| exit_for(&e), |sig| 128 + sig)
        }
    }
}

fn launch_cmd(l: LaunchArgs) -> i32 {
    let o = shardline_runtime::launch::LaunchOptions {
        nproc_per_node: l.nproc_per_node,
        nnodes: l.nnodes.1,
        node_rank: l.node_rank,
        rdzv: l.rdzv,
        token: l.token,
        worker_args: l.worker,
        grace: std::time::Duration::from_secs_f64(l.grace_s.clamp(0.0, 3600.0)),
        min_nodes: l.nnodes.0,
        max_restarts: l.max_restarts,
        heartbeat_timeout: std::time::Duration::from_secs_f64(
            l.heartbeat_timeout_s.clamp(0.2, 3600.0),
        ),
        transport: l.transport,
    };
    match shardline_runtime::launch::run_agent(&o) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}
