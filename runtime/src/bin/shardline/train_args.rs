//! `shardline train`'s flags, their parsers, and the `TrainConfig` and `RunOptions` they make.

use super::*;

/// The model's size, shared by `train` and `plan`.
#[derive(Args, Debug, Clone)]
pub(crate) struct ModelArgs {
    /// gpt: transformer blocks [default: 4].
    #[arg(long)]
    pub(crate) n_layer: Option<usize>,
    /// gpt: attention heads; must divide --n-embd [default: 4].
    #[arg(long)]
    pub(crate) n_head: Option<usize>,
    /// gpt: embedding width [default: 128].
    #[arg(long)]
    pub(crate) n_embd: Option<usize>,
    /// gpt: context length in tokens; windows of block_size + 1 tokens must fit in the
    /// text [default: 64].
    #[arg(long)]
    pub(crate) block_size: Option<usize>,
    /// gpt: rows of the token embedding, at least the data set's vocabulary (50304 is
    /// nanoGPT's padded GPT-2 vocabulary) [default: the data set's, 256 for bytes].
    #[arg(long)]
    pub(crate) vocab_size: Option<usize>,
    /// resnet-bn: channels of conv1 and layer1, doubled by each of layer2..layer4 (8 or 16
    /// for a small study) [default: 64, torchvision's].
    #[arg(long)]
    pub(crate) width: Option<usize>,
    /// Hidden width (mlp-bn) or first-stage channels (convnet-bn).
    #[arg(long)]
    pub(crate) hidden: Option<usize>,
    /// Number of hidden blocks (mlp-bn).
    #[arg(long)]
    pub(crate) depth: Option<usize>,
    /// Synthetic data: input features.
    #[arg(long, default_value_t = 784)]
    pub(crate) input_dim: usize,
    /// Synthetic data: classes.
    #[arg(long, default_value_t = 10)]
    pub(crate) classes: usize,
    /// wide-mlp: parameter count (e.g. 50M).
    #[arg(long, value_parser = parse_count, default_value = "50M")]
    pub(crate) params: usize,
}

impl ModelArgs {
    /// Sets `cfg`'s model size from these flags.
    pub(crate) fn apply(&self, cfg: TrainConfig) -> TrainConfig {
        TrainConfig {
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            block_size: self.block_size,
            vocab_size: self.vocab_size,
            width: self.width,
            hidden: self.hidden,
            depth: self.depth,
            input_dim: self.input_dim,
            classes: self.classes,
            params: self.params,
            ..cfg
        }
    }
}

/// `--weight-decay-on`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum DecayOnArg {
    All,
    Matrices,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum OnOffAuto {
    On,
    Off,
    Auto,
}

/// `--accum-reduce`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum AccumReduceArg {
    /// Reduce-scatter after every microbatch, adding into the gradient shard.
    Each,
    /// Keep full gradients until the last microbatch, then reduce-scatter once.
    Last,
}

/// `--recompute`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum RecomputeArg {
    /// Keep what every layer saves for backward.
    None,
    /// Keep only each call's input, re-run its forward in backward.
    Units,
}

/// Where the kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum DeviceKind {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend (needs the `cuda` feature and a GPU).
    Cuda,
    /// A strict simulated accelerator, for testing (the device engine).
    Sim,
}

/// `--offload`: what lives in host memory (`--device sim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum OffloadArg {
    /// Everything on the device.
    None,
    /// The optimizer state; updates run on the host.
    Optimizer,
    /// The optimizer state and the parameter shards (stage 3).
    Params,
}

#[derive(Args, Debug)]
pub(crate) struct TrainArgs {
    /// Compute device: cpu; cuda (a build with the `cuda` feature, on a host with a GPU:
    /// matrix multiplies and elementwise kernels run on each rank's own GPU, the one at its
    /// local rank among those CUDA_VISIBLE_DEVICES shows, the shards, the optimizer and the
    /// collectives stay on the host (with --model-ops: the device engine instead, see there);
    /// without a GPU: exit 2 naming what is missing; with fewer visible GPUs than ranks on a
    /// node, the run fails naming both); or
    /// sim, a simulated accelerator for testing: the device engine keeps each rank's
    /// parameters, gradients and optimizer state in device memory, runs kernels on a compute
    /// stream and gathers and reductions on their own streams ordered by events, and fails
    /// loudly on any unordered access. Kernels run on the CPU; timings include seeded delays.
    /// --device-memory is its capacity. It runs under the same training loop (checkpoints,
    /// --resume, evaluation, --log-json, the summary, whose memory figures are then device
    /// memory); it does not yet run bf16 or quantized gathers, --fault, --dump-on-failure,
    /// --metrics-addr or `shardline launch` (each is refused by name).
    #[arg(long, value_enum, default_value = "cpu")]
    pub(crate) device: DeviceKind,
    /// --device sim: what lives in host memory: none, optimizer (optimizer state; updates run
    /// on the host, overlapping device compute) or params (also the parameter shards; --stage
    /// 3). Results are bitwise those of none.
    #[arg(long, value_enum, default_value = "none")]
    pub(crate) offload: OffloadArg,
    /// --device sim: seed of the streams' delays (rank r uses seed + r).
    #[arg(long, default_value_t = 0)]
    pub(crate) sim_seed: u64,
    /// --device sim: longest delay before each device operation, in microseconds.
    #[arg(long, default_value_t = 50)]
    pub(crate) sim_delay_us: u64,
    /// --device sim: gathers and reductions share one stream and one communicator (as one
    /// NCCL process group would), instead of one each.
    #[arg(long)]
    pub(crate) sim_one_comm: bool,
    /// --device sim: the model's calls and loss run as device ops lowered from its modules
    /// (what a GPU runs), and the simulated device refuses any other host code (evaluation
    /// scores the downloaded logits on the host). Results are bitwise those without it.
    /// --device cuda --model-ops: the same device engine on GPUs (a build with the `cuda`
    /// feature): rank r on GPU r, each rank a thread of this process, gathers and reductions
    /// over NCCL, no host staging.
    /// Models whose layers all lower: gpt without dropout while training, mlp-bn, convnet-bn,
    /// resnet-bn and wide-mlp (BatchNorm and SyncBatchNorm, convolution, pooling, residual
    /// blocks); module trees of those and of LayerNorm, Embedding, GELU/SiLU and attention;
    /// others are refused, naming the layer.
    #[arg(long)]
    pub(crate) model_ops: bool,
    /// Number of ranks (threads, one actor each). Under a launcher (torchrun, srun,
    /// shardline launch) the launcher's world is used, with a warning where this differs.
    #[arg(long, default_value_t = 4)]
    pub(crate) world: usize,
    /// Whether --world was given on the command line (set from the parsed matches).
    #[arg(skip)]
    pub(crate) world_given: bool,
    /// ZeRO stage: 0 (DDP), 1, 2, 3 (FSDP full shard), or auto (the lowest whose estimate fits
    /// --device-memory: model state, plus the activations and scratch of one microbatch,
    /// measured by running it once with the --recompute choice). With --profile, auto
    /// chooses the shard group too (see --profile).
    #[arg(long, default_value = "3")]
    pub(crate) stage: String,
    /// With --stage auto: a machine profile (a file of `shardline-bench machine-profile`, or
    /// the shipped h100-8x-ib) whose collectives price each candidate's communication. The
    /// candidates are stages 0-3 x shard groups (unless --shard-group names one): the world
    /// and every group size dividing it (node: the ranks of a node, when launched on several
    /// nodes); a candidate's memory per rank is --stage auto's estimate in a world of the
    /// group's size; combinations train refuses (groups with bf16 gradients, say) are left
    /// out. One step's communication is the profile's time for its parameter all-gathers
    /// (stage 3: two per call of a unit; stages 1 and 2: one after the update), its
    /// gradient reduce-scatter or all-reduce and, across groups, the reduced shard's
    /// all-reduce (or its packed all-gather), each inside a node on the profile's transport
    /// there and across nodes on its transport across (lane time of one microbatch: overlap
    /// with compute, later microbatches, the loss all-reduce and SyncBN are not counted). Chosen: the
    /// least communication within --device-memory; ties go to less memory, the lower stage,
    /// the larger group. Every candidate is printed with its memory and communication. The
    /// profile needs transports_default (the transports inside and across nodes); one that
    /// does not read or parse exits 2.
    #[arg(long, value_name = "FILE|h100-8x-ib")]
    pub(crate) profile: Option<String>,
    /// With --stage auto --profile: candidates may also gather parameters in int8 and, across
    /// shard groups, reduce gradients in int8 (--gather-dtype, --cross-node-reduce-dtype; fp8
    /// sends the same bytes), both lossy; without it no 8-bit wire is chosen that the flags
    /// did not name.
    #[arg(long)]
    pub(crate) allow_lossy_comm: bool,
    /// Model: mlp-bn, convnet-bn, wide-mlp, resnet-bn (torchvision's ResNet-18 with a 3x3
    /// stride-1 stem and no max-pool, torchvision's names; sized by --width), or gpt
    /// (nanoGPT's decoder, byte-level on --dataset text; sized by --n-layer, --n-head,
    /// --n-embd, --block-size).
    /// [default: mlp-bn, or the --config file's `[model]` name]
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Data set: digits (bundled, 8x8 images), synthetic (a random teacher network),
    /// fashion-mnist (28x28 images, 10 classes: the full set when Debian's
    /// dataset-fashion-mnist is installed, else a bundled 4,000 + 1,000 subset; the header
    /// says which), idx:DIR (MNIST-format train-/t10k- images and labels files, plain or .gz),
    /// csv:PATH (rows label,v0,v1,..., an optional header line), npy:X.npy,Y.npy (samples of
    /// shape N x ... and integer labels, one per sample), text (the bundled license texts,
    /// bytes) or text:PATH (a file or folder of bytes, the last 10% held out; or a nanoGPT
    /// uint16 .bin token file, training only). Without t10k files, csv and npy data hold out a stratified 20%
    /// (seed 1234) for testing; classes are the largest label + 1.
    /// [default: text for --model gpt, else digits]
    #[arg(long)]
    pub(crate) dataset: Option<String>,
    /// Divide the values of csv:PATH and npy:X,Y data by this (e.g. 255 for pixel bytes);
    /// IDX pixels are always divided by 255 [default: values as they are].
    #[arg(long)]
    pub(crate) data_scale: Option<f32>,
    #[command(flatten)]
    pub(crate) size: ModelArgs,
    /// gpt: drop probability of nanoGPT's four dropout layers while training (the
    /// embeddings' sum, and in each block the attention probabilities after the softmax and
    /// the two residual branches), in [0, 1) [default: 0].
    #[arg(long)]
    pub(crate) dropout: Option<f64>,
    /// Start from the weights of a safetensors file with torch's names (a torch
    /// state_dict saved by safetensors.torch.save_file, or `checkpoint export`'s output)
    /// instead of the seed's initialisation. Strict, as torch's load_state_dict: every
    /// parameter and buffer of the model, nothing else (gpt's lm_head.weight, tied to
    /// transformer.wte.weight, may be left out); floats as F32, F64 (rounded), BF16 or F16;
    /// num_batches_tracked as I64. A mismatch exits 2 listing the missing, unexpected,
    /// wrongly shaped and wrongly typed names. --resume from a checkpoint wins over it.
    #[arg(long, value_name = "FILE")]
    pub(crate) init_from: Option<PathBuf>,
    /// Epochs over the training set.
    #[arg(long, default_value_t = 10)]
    pub(crate) epochs: u64,
    /// Total optimizer steps (overrides --epochs).
    #[arg(long)]
    pub(crate) steps: Option<u64>,
    /// Global batch size (split across ranks; uneven splits are allowed).
    #[arg(long, default_value_t = 64)]
    pub(crate) batch_size: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub(crate) lr: f32,
    /// Optimizer: sgd (momentum 0.9) or adamw.
    #[arg(long, default_value = "sgd")]
    pub(crate) optimizer: String,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub(crate) momentum: f32,
    /// Weight decay (coupled for SGD, decoupled for AdamW).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) weight_decay: f32,
    /// Which parameters --weight-decay applies to: all, or matrices (parameters of two or
    /// more dimensions; biases and norm gains get none, as nanoGPT's AdamW groups do).
    #[arg(long, value_enum, default_value_t = DecayOnArg::All)]
    pub(crate) weight_decay_on: DecayOnArg,
    /// Linear warmup steps before the cosine decay.
    #[arg(long, default_value_t = 0)]
    pub(crate) warmup_steps: u64,
    /// Keep the learning rate constant instead of cosine decay.
    #[arg(long)]
    pub(crate) constant_lr: bool,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    pub(crate) clip_grad_norm: Option<f64>,
    /// SyncBatchNorm: on, off, or auto (on when the per-rank batch is below
    /// --sync-bn-threshold; SyncBN costs a reduction per layer and pays only when per-rank
    /// statistics are noisy).
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) sync_bn: OnOffAuto,
    /// Per-rank batch below which auto turns SyncBN on.
    #[arg(long, default_value_t = 32)]
    pub(crate) sync_bn_threshold: usize,
    /// Seed for initialisation, shuffling and synthetic data.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Gradient accumulation: each rank's share of a global batch is cut into N
    /// microbatches, each run forward and backward, their gradients summed; the optimizer
    /// steps once per step. N must divide the per-rank batch (--batch-size / --world).
    /// BatchNorm normalises each microbatch with its own statistics and updates its running
    /// statistics once per microbatch, as torch does over N forward calls.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub(crate) grad_accum: usize,
    /// With --grad-accum at stages 2 and 3: each reduce-scatters every microbatch's
    /// gradients and adds them into the rank's gradient shard; last keeps every unit's full
    /// gradients until the last microbatch and reduce-scatters once (N times fewer
    /// reduce-scatter bytes, the whole model's gradients held meanwhile). Stages 0 and 1
    /// always reduce once, after the last microbatch; naming a policy with --stage 0 or 1
    /// exits 2 [default: each].
    #[arg(long, value_enum)]
    pub(crate) accum_reduce: Option<AccumReduceArg>,
    /// Activation recomputation: with units, every call of the forward pass but the last
    /// keeps only its input, and backward re-runs its forward (a call runs one unit; gpt's
    /// root unit runs first and last, so only its first call is recomputed). The re-run reuses the SyncBN statistics of the first forward (no second
    /// message) and does not update running statistics again; results are bitwise those of
    /// none.
    #[arg(long, value_enum, default_value = "none")]
    pub(crate) recompute: RecomputeArg,
    /// Units gathered ahead of use at stage 3 (0 disables prefetch).
    #[arg(long, default_value_t = 1)]
    pub(crate) prefetch: usize,
    /// Byte budget for gathered units in flight (default: (prefetch+1) x the largest unit).
    #[arg(long, value_parser = parse_bytes)]
    pub(crate) prefetch_budget: Option<u64>,
    /// Per-rank memory cap like a GPU's (e.g. 512M, 2G): exceeding it is an OutOfMemory error
    /// naming the category. It counts parameters, gradients, optimizer state, gathered units,
    /// every tensor the layers make (activations, what they save for backward), kernels'
    /// scratch and communication buffers (memory-measured: within 5% of the heap a rank
    /// process uses, on all 320 measured rank rows).
    #[arg(long, value_parser = parse_bytes)]
    pub(crate) device_memory: Option<u64>,
    /// Artificial bandwidth of each link between ranks (e.g. 1gbit, 200MB/s; default
    /// unlimited, or env SHARDLINE_LINK_RATE), so that communication costs what a network
    /// would.
    #[arg(long, value_parser = shardline_collectives::config::parse_rate)]
    pub(crate) link_rate: Option<u64>,
    /// Mixed precision: the type parameters are all-gathered and computed in, f32 or bf16
    /// (FSDP2's param_dtype). Masters, optimizer state, norm statistics and the loss stay f32.
    #[arg(long, default_value = "f32", value_parser = parse_param_dtype)]
    pub(crate) param_dtype: PrecisionDtype,
    /// The type gradients are reduced in, f32 or bf16 [default: the --param-dtype].
    #[arg(long, value_parser = parse_reduce_dtype)]
    pub(crate) reduce_dtype: Option<PrecisionDtype>,
    /// Quantized parameter gathers (ZeRO++'s qwZ, torchao's float8 all-gather): int8 or
    /// fp8 (e4m3), one f32 scale per block of --gather-block values (blocks restart at each
    /// tensor), about a quarter of f32's gather bytes. Lossy: every rank computes with the parameters dequantized (the same values
    /// on every rank and at every stage); masters, optimizer state and gradient reductions
    /// stay as the precision policy says. Needs --param-dtype f32 [default: gather in the
    /// param dtype].
    #[arg(long, value_parser = parse_gather_dtype)]
    pub(crate) gather_dtype: Option<GatherDtype>,
    /// Values per scale of a quantized gather (a tensor's last block may be shorter).
    #[arg(long, default_value_t = 256)]
    pub(crate) gather_block: usize,
    /// Hybrid sharding (HSDP): N shards the model inside groups of N consecutive ranks and
    /// replicates it across the world/N groups; node takes the ranks of each node (nodes of
    /// equal size, consecutive ranks); world, the default, shards over the whole world.
    /// Gathers and reduce-scatters stay inside a group; each reduced gradient shard is then
    /// all-reduced across the groups (ranks of equal index in every group) while backward
    /// goes on; the loss and SyncBN statistics are reduced over the world, and the
    /// gradients are averaged over the whole global batch as without groups. Checkpoints
    /// hold one copy of each shard (the first group writes them) and resume under any
    /// group shape or world. At stage 0 the group changes nothing (plain replication).
    /// N must divide the world; at stages 1-3 the gradients must be reduced in f32 (with
    /// --param-dtype bf16, pass --reduce-dtype f32); not with --device sim, and `plan`
    /// does not model it. auto: chosen by --stage auto with --profile, which implies it
    /// when no group is named [default: world; auto with --stage auto --profile].
    #[arg(long, value_parser = parse_shard_group, value_name = "N|node|world|auto")]
    pub(crate) shard_group: Option<ShardGroup>,
    /// Gradient shards reduced across shard groups (across nodes with --shard-group node)
    /// packed in int8 or fp8 (e4m3), one f32 scale per --gather-block values, as ZeRO++'s
    /// qgZ: each replica packs its reduced shard once, the packed shards are all-gathered
    /// (about a quarter of an f32 shard each), and every replica decodes all of them and sums
    /// them in f32 in replica order, so every replica steps the same values and the error is
    /// one rounding per replica, not one per hop. The reduce-scatter inside a group stays in
    /// the reduce dtype. Lossy; needs --shard-group below the world and a stage of 1-3
    /// [default: all-reduce in f32].
    #[arg(long, value_parser = parse_cross_node_reduce_dtype, value_name = "int8|fp8")]
    pub(crate) cross_node_reduce_dtype: Option<GatherDtype>,
    /// Secondary shards (ZeRO++'s hpZ) at stage 3: world, the default, frees a unit after
    /// its forward down to the rank's shard, so its backward gathers it again over the
    /// shard group (the world, or --shard-group's group), across nodes; node keeps instead
    /// the rank's piece of a copy of the unit sharded over the ranks of its node (nodes of
    /// equal size, consecutive ranks), and every later gather of the unit in the step (its
    /// backward's, a tied root's second call, the next microbatches') all-gathers those
    /// pieces inside the node alone. N takes groups of N consecutive ranks instead of nodes.
    /// The first gather of each unit in a step still goes over the shard group; results are
    /// bitwise those of world; the cost is each rank's pieces, held from a unit's forward to
    /// its last use in the step (memory category "secondary shards"); checkpoints are
    /// unchanged. At stage 3 the group (node or N) must divide the shard group and be
    /// smaller than it, so node is refused on one node, with --shard-group node, or with a
    /// --shard-group inside one node (its gathers already stay in the node); with
    /// --shard-group N the secondary groups cut each shard group. With packed gathers
    /// (--param-dtype bf16, --gather-dtype int8|fp8) only the first gather is packed: the
    /// pieces are f32 copies of the decoded unit, gathered in f32 inside the node. Stages
    /// 0-2 keep full parameters: there it changes nothing and no group size is checked.
    /// Not with --device sim.
    #[arg(long, default_value = "world", value_parser = parse_reshard, value_name = "N|node|world")]
    pub(crate) reshard_after_forward: ReshardAfterForward,
    /// Synthetic data: training samples.
    #[arg(long, default_value_t = 8192)]
    pub(crate) samples: usize,
    /// Group blocks into units of at least this many parameters (0: one unit per block).
    #[arg(long, value_parser = parse_count, default_value = "0")]
    pub(crate) wrap_params: usize,
    /// Compute threads per rank.
    #[arg(long, default_value_t = 1)]
    pub(crate) threads: usize,
    /// Collective timeout in seconds (a stuck rank fails the job instead of hanging it).
    #[arg(long, default_value_t = 60)]
    pub(crate) timeout: u64,
    /// Directory for sharded checkpoints. SIGINT (Ctrl-C) or SIGTERM stops the run after
    /// the step in progress and writes a checkpoint of it here (exit 130 / 143); a second
    /// signal ends it at once.
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N steps (and always at the end when --checkpoint-dir is set).
    #[arg(long, default_value_t = 0)]
    pub(crate) checkpoint_every: u64,
    /// Write each checkpoint in the background (needs --checkpoint-dir): at the step
    /// boundary every rank copies its shard of the parameters and optimizer state, and the
    /// BatchNorm buffers; the next steps then run while another thread writes the copies and
    /// commits them as without the flag (the manifest last, once every rank's shard is on
    /// disk, so a crash before that leaves the previous checkpoint the newest). One
    /// checkpoint in flight at a time: the next checkpoint and a stop wait for it to commit,
    /// and so does the end of the run, after the evaluation. Each rank holds the extra copy
    /// until the checkpoint is committed; a write that fails fails the run at the next step
    /// boundary.
    #[arg(long)]
    pub(crate) async_checkpoint: bool,
    /// Resume from the newest checkpoint in --checkpoint-dir whose files verify (sizes,
    /// CRC32, SHA-256); each newer one that does not is named on stderr with why and moved
    /// aside to damaged-step-N. Refused: a checkpoint of another configuration, model or
    /// format version (exit 1), and checkpoints none of which verifies (exit 2). With no
    /// checkpoint there, start fresh.
    #[arg(long)]
    pub(crate) resume: bool,
    /// Append one JSON object per step to this file: step, epoch, loss, lr, grad_norm and
    /// stats_messages (the job's figures, the same however the ranks run), and step_time_s
    /// (the slowest rank of this process), compute_s, comm_s, comm_exposed_s and peak_bytes;
    /// gather_bytes, reduce_bytes, replica_bytes and hpz_bytes (payload bytes the first rank
    /// of this process sent on each lane during the step; replica_bytes, the gradient
    /// shards' all-reduce across --shard-group groups, 0 without them; hpz_bytes, the
    /// gathers from secondary shards inside a node, 0 without --reshard-after-forward) and
    /// cast_s (its f32/bf16 conversion time); intra_node_bytes and inter_node_bytes (payload
    /// bytes this process's hybrid transport sent inside its node and to other nodes since
    /// the previous line, every lane; 0 for ranks that are threads of one process, which use
    /// none), and inter_node_gather_bytes (the part of inter_node_bytes sent on the
    /// parameter gather lanes).
    /// Launched (`shardline launch`, torchrun, Slurm), rank 0 writes it with its own timings.
    #[arg(long)]
    pub(crate) log_json: Option<PathBuf>,
    /// Write a Chrome trace (open in Perfetto) to this file.
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9100).
    #[arg(long)]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
    /// Stop after this many steps of this invocation (the checkpoint then lets --resume go on).
    #[arg(long)]
    pub(crate) stop_after: Option<u64>,
    /// Write the summary as JSON to this file.
    #[arg(long)]
    pub(crate) summary_json: Option<PathBuf>,
    /// No progress display (by default a bar on a terminal, else a line every ten steps;
    /// launched, rank 0 alone shows it).
    #[arg(long)]
    pub(crate) no_progress: bool,
    /// A rank whose busy time (not waiting for communication) is at least this many times
    /// the other ranks' median, and 5 ms more, for --straggler-steps steps in a row is
    /// reported as a straggler (stderr, the log, the metric shardline_straggler_ratio).
    #[arg(long, default_value = "3", value_parser = parse_straggler_factor)]
    pub(crate) straggler_factor: f64,
    /// Consecutive steps over --straggler-factor before a rank is reported.
    #[arg(long, default_value = "5", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) straggler_steps: u32,
    /// End the run as failed, naming the rank, when a straggler is reported (with
    /// `launch --max-restarts`, the agents then restart the group from its checkpoint).
    #[arg(long)]
    pub(crate) evict_stragglers: bool,
    /// Inject a fault (repeatable): kill:rank=R:step=S[:phase=forward|backward|reduce|update|checkpoint],
    /// stall:rank=R:step=S:secs=T, slow:rank=R:step=S:ms=M (sleeps M ms in every step from S:
    /// a straggler), delay:link=A-B:ms=M[:jitter=J], drop:link=A-B:p=P,
    /// corrupt:link=A-B:p=P (partition:node=N:step=S:secs=T needs `shardline launch`).
    #[arg(long = "fault", value_name = "SPEC")]
    pub(crate) faults: Vec<String>,
    /// Seed of every random fault decision (default: the config file's, else 0).
    #[arg(long)]
    pub(crate) fault_seed: Option<u64>,
    /// TOML config file: its `[model]` table (`name`, gpt's `n_layer`, `n_head`, `n_embd`,
    /// `block_size`, `dropout`, resnet-bn's `width`) and its `[faults]` table (`specs =
    /// [...]`, `seed = N`, the fault plan); flags given on the command line win over the file.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Restart the rank group from the last checkpoint up to N times after a failure.
    #[arg(long, default_value_t = 0)]
    pub(crate) max_restarts: u32,
    /// At the first failure, write every rank's recent collectives to this JSON file
    /// (read it with `shardline doctor FILE`).
    #[arg(long)]
    pub(crate) dump_on_failure: Option<PathBuf>,
}

pub(crate) fn parse_param_dtype(s: &str) -> Result<PrecisionDtype, String> {
    PrecisionDtype::parse("--param-dtype", s)
}

pub(crate) fn parse_export_dtype(s: &str) -> Result<PrecisionDtype, String> {
    PrecisionDtype::parse("--dtype", s)
}

pub(crate) fn parse_shard_group(s: &str) -> Result<ShardGroup, String> {
    s.parse().map_err(|e| format!("--shard-group {s}: {e}"))
}

pub(crate) fn parse_reshard(s: &str) -> Result<ReshardAfterForward, String> {
    s.parse().map_err(|e| format!("--reshard-after-forward {s}: {e}"))
}

pub(crate) fn parse_gather_dtype(s: &str) -> Result<GatherDtype, String> {
    GatherDtype::parse("--gather-dtype", s)
}

pub(crate) fn parse_cross_node_reduce_dtype(s: &str) -> Result<GatherDtype, String> {
    GatherDtype::parse("--cross-node-reduce-dtype", s)
}

pub(crate) fn parse_reduce_dtype(s: &str) -> Result<PrecisionDtype, String> {
    PrecisionDtype::parse("--reduce-dtype", s)
}

pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_scaled(s, 1024).map_err(|e| format!("{e} (try 512M or 2G)"))
}

/// `--straggler-factor`: a finite number above 1.
pub(crate) fn parse_straggler_factor(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 1.0 => Ok(v),
        _ => Err(format!("'{s}' is not a factor above 1 (for example 3)")),
    }
}

pub(crate) fn parse_join_wait(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("--join-wait-s '{s}': expected seconds from 0 to 3600")),
    }
}

pub(crate) fn parse_count(s: &str) -> Result<usize, String> {
    parse_scaled(s, 1000).map(|v| v as usize).map_err(|e| format!("{e} (try 50M or 1500000)"))
}

pub(crate) fn parse_scaled(s: &str, base: u64) -> Result<u64, String> {
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

/// The data set when `--dataset` is not given: the bundled text for `gpt`, a language model,
/// the bundled digits for the image classifiers.
pub(crate) fn default_dataset(model: Option<&str>) -> &'static str {
    if model == Some("gpt") {
        "text"
    } else {
        "digits"
    }
}

pub(crate) fn to_config(a: &TrainArgs) -> Result<TrainConfig, String> {
    let stage = match a.stage.as_str() {
        "auto" => StageChoice::Auto,
        s => {
            let n: u8 =
                s.parse().map_err(|_| format!("--stage must be 0, 1, 2, 3 or auto, not '{s}'"))?;
            StageChoice::Fixed(Stage::from_index(n).map_err(|e| e.to_string())?)
        }
    };
    Ok(a.size.apply(TrainConfig {
        world: a.world,
        stage,
        model: a.model.clone().unwrap_or_else(|| "mlp-bn".into()),
        dataset: a.dataset.clone().unwrap_or_else(|| default_dataset(a.model.as_deref()).into()),
        data_scale: a.data_scale,
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
        grad_accum: a.grad_accum,
        accum_reduce: a.accum_reduce.map(|r| match r {
            AccumReduceArg::Each => AccumReduce::Each,
            AccumReduceArg::Last => AccumReduce::Last,
        }),
        recompute: match a.recompute {
            RecomputeArg::None => Recompute::None,
            RecomputeArg::Units => Recompute::Units,
        },
        prefetch: a.prefetch,
        prefetch_budget: a.prefetch_budget,
        device_memory: a.device_memory,
        samples: a.samples,
        wrap_params: a.wrap_params,
        dropout: a.dropout,
        init_from: a.init_from.clone(),
        threads: a.threads,
        device: Device::Cpu,
        timeout_s: a.timeout,
        link_rate: a.link_rate,
        param_dtype: a.param_dtype,
        reduce_dtype: a.reduce_dtype,
        gather_dtype: a.gather_dtype,
        gather_block: a.gather_block,
        // A profile lets --stage auto choose the group unless one is named.
        shard_group: a.shard_group.unwrap_or(match (stage, &a.profile) {
            (StageChoice::Auto, Some(_)) => ShardGroup::Auto,
            _ => ShardGroup::World,
        }),
        cross_node_reduce_dtype: a.cross_node_reduce_dtype,
        reshard_after_forward: a.reshard_after_forward,
        profile: a.profile.clone(),
        allow_lossy_comm: a.allow_lossy_comm,
        ..TrainConfig::default()
    }))
}

/// What `train`'s flags ask of the run (outputs, checkpoints, stragglers), for either
/// engine; fault injection is added by the caller that runs it.
pub(crate) fn run_options(a: &TrainArgs) -> RunOptions {
    RunOptions {
        checkpoint_dir: a.checkpoint_dir.clone(),
        checkpoint_every: a.checkpoint_every,
        async_checkpoint: a.async_checkpoint,
        before_shard_write: None,
        resume: a.resume,
        log_json: a.log_json.clone(),
        trace: a.trace.clone(),
        progress: !a.no_progress,
        stop_after: a.stop_after,
        quiet: false,
        faults: None,
        dump_on_failure: a.dump_on_failure.clone(),
        // The run's result is in its checkpoints (`checkpoint export`); gathering the whole
        // model on every rank at the end would cost what sharding saved.
        skip_final_params: true,
        stop_on_signal: true,
        backend: None,
        stragglers: shardline_runtime::straggler::StragglerPolicy {
            factor: a.straggler_factor,
            steps: a.straggler_steps,
            ..Default::default()
        },
        evict_stragglers: a.evict_stragglers,
    }
}
