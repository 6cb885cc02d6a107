//! A run's configuration ([`TrainConfig`], [`RunOptions`]) and its validation: every check
//! that refuses a configuration before anything starts.

use super::*;

/// `--sync-bn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncBnMode {
    /// Always SyncBatchNorm.
    On,
    /// Per-rank statistics.
    Off,
    /// On when the per-rank batch is below the threshold.
    Auto,
}

/// `--stage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StageChoice {
    /// A fixed stage.
    Fixed(Stage),
    /// The lowest stage whose estimate fits `--device-memory`.
    Auto,
}

pub use crate::dataset::{load_corpus, load_data, load_data_with_origin};

/// Everything a training run is configured by.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Ranks.
    pub world: usize,
    /// ZeRO stage.
    pub stage: StageChoice,
    /// Zoo model name.
    pub model: String,
    /// `digits`, `synthetic`, `fashion-mnist`, `idx:DIR`, `csv:PATH`, `npy:X,Y`, `text` or
    /// `text:PATH`.
    pub dataset: String,
    /// `--data-scale`: CSV and `.npy` values are divided by it (none: used as they are).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_scale: Option<f32>,
    /// Epochs (ignored when `steps` is set).
    pub epochs: u64,
    /// Total optimizer steps (overrides epochs).
    pub steps: Option<u64>,
    /// Global batch size.
    pub batch_size: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// `sgd` or `adamw`.
    pub optimizer: String,
    /// SGD momentum.
    pub momentum: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// Which parameters the weight decay applies to (OPT-5).
    #[serde(default, skip_serializing_if = "WeightDecayOn::is_all")]
    pub weight_decay_on: WeightDecayOn,
    /// Warmup steps of the LR schedule.
    pub warmup_steps: u64,
    /// Cosine decay after warmup (else constant).
    pub cosine: bool,
    /// Global gradient-norm clipping.
    pub clip_grad_norm: Option<f64>,
    /// SyncBN mode.
    pub sync_bn: SyncBnMode,
    /// Auto mode's threshold on the per-rank batch.
    pub sync_bn_threshold: usize,
    /// Seed for init, shuffling and synthetic data.
    pub seed: u64,
    /// Microbatches per step: each rank's slice is computed in this many forward and
    /// backward passes, gradients accumulated, one optimizer step (ACC-1). Not part of the
    /// configuration hash, as neither is `recompute`: a run may resume with other values.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub grad_accum: usize,
    /// Stages 2 and 3: when the microbatches' gradients are reduced (ACC-3); `None`: the
    /// default, [`AccumReduce::Each`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accum_reduce: Option<AccumReduce>,
    /// Which calls of the forward pass keep only their input and are recomputed in backward
    /// (RECOMP-1).
    #[serde(default, skip_serializing_if = "is_no_recompute")]
    pub recompute: Recompute,
    /// Prefetch depth (stage 3).
    pub prefetch: usize,
    /// Byte budget for gathered units in flight.
    pub prefetch_budget: Option<u64>,
    /// Per-rank memory cap.
    pub device_memory: Option<u64>,
    /// Hidden width (mlp-bn) / channels (convnet-bn).
    pub hidden: Option<usize>,
    /// Depth (blocks).
    pub depth: Option<usize>,
    /// Synthetic data input dimension.
    pub input_dim: usize,
    /// Synthetic data classes.
    pub classes: usize,
    /// Synthetic training samples.
    pub samples: usize,
    /// wide-mlp parameter count.
    pub params: usize,
    /// Group blocks into units of at least this many parameters (0: one unit per block).
    pub wrap_params: usize,
    /// `gpt`: transformer blocks (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_layer: Option<usize>,
    /// `gpt`: attention heads (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_head: Option<usize>,
    /// `gpt`: embedding width (default 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_embd: Option<usize>,
    /// `gpt`: context length in tokens (default 64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// `gpt`: nanoGPT's dropout probability while training (default 0: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    /// `gpt`: rows of the token embedding (default: the data set's vocabulary; at least it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<usize>,
    /// `resnet-bn`: channels of `conv1` and `layer1`, doubled by each later layer (default
    /// 64, torchvision's ResNet-18).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<usize>,
    /// Start from the torch-named weights of this safetensors file instead of the seed's
    /// initialisation (CKPT-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// Compute threads per rank.
    pub threads: usize,
    /// Where the kernels run (`--device`).
    #[serde(default)]
    pub device: crate::engine::Device,
    /// Collective timeout.
    pub timeout_s: u64,
    /// Artificial bandwidth of each link between ranks in bytes per second (local
    /// transport); `None`: unlimited unless `SHARDLINE_LINK_RATE` says otherwise. Changes
    /// timing only, never results.
    pub link_rate: Option<u64>,
    /// `--param-dtype`: what parameters are gathered and computed in (masters stay `f32`,
    /// PREC-1).
    #[serde(default, skip_serializing_if = "is_f32")]
    pub param_dtype: PrecisionDtype,
    /// `--reduce-dtype`: what gradients are reduced in; `None`: the param dtype (PREC-5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce_dtype: Option<PrecisionDtype>,
    /// `--gather-dtype`: parameters all-gathered block-quantized (QGATHER-1); `None`: in
    /// the param dtype.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gather_dtype: Option<GatherDtype>,
    /// `--gather-block`: values per scale of a quantized gather.
    #[serde(default = "default_gather_block")]
    pub gather_block: usize,
    /// `--shard-group`: the ranks that shard the model together, replicated across groups
    /// (HSDP-1). Not part of the configuration hash: a checkpoint resumes under any group
    /// shape (HSDP-2).
    #[serde(default, skip_serializing_if = "ShardGroup::is_world")]
    pub shard_group: ShardGroup,
    /// `--cross-node-reduce-dtype`: the gradient shards' reduction across shard groups
    /// packed in blocks of `gather_block` values (QREDUCE-1); `None`: in f32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cross_node_reduce_dtype: Option<GatherDtype>,
    /// `--reshard-after-forward`: what a stage-3 unit leaves after its forward, a secondary
    /// shard over the node or groups of N ranks (HPZ-1..4). Not part of the configuration
    /// hash: the pieces live inside a step, checkpoints are unchanged.
    #[serde(default, skip_serializing_if = "ReshardAfterForward::is_world")]
    pub reshard_after_forward: ReshardAfterForward,
    /// `--profile`: the machine profile (a shipped name or a file) `--stage auto` prices
    /// each stage and shard group's communication on (AUTO-3); `None`: the stage alone is
    /// chosen, by memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// `--allow-lossy-comm`: `--stage auto --profile` may choose 8-bit gathers and 8-bit
    /// reductions across shard groups (AUTO-1).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_lossy_comm: bool,
    /// Ranks on each node, as the launch environment says (`None`: one node); where
    /// `--stage auto --profile` places the shard groups.
    #[serde(skip)]
    pub ranks_per_node: Option<usize>,
}

pub(crate) fn default_gather_block() -> usize {
    256
}

pub(crate) fn is_f32(d: &PrecisionDtype) -> bool {
    *d == PrecisionDtype::F32
}

impl TrainConfig {
    /// The run's mixed-precision policy (PREC-5: the reduce dtype defaults to the param
    /// dtype).
    pub fn precision(&self) -> MixedPrecision {
        MixedPrecision::new(self.param_dtype, self.reduce_dtype).with_gather(
            self.gather_dtype.map(|dtype| QuantGather { dtype, block: self.gather_block }),
        )
    }

    /// The policy in words, e.g. `params bf16, reduce f32`.
    pub fn precision_label(&self) -> String {
        let p = self.precision();
        let gather = p.gather_quant.map_or(String::new(), |q| {
            format!(", gathers {} (blocks of {})", q.dtype.name(), q.block)
        });
        format!("params {}, reduce {}{gather}", p.param_dtype.name(), p.reduce_dtype.name())
    }
}

pub(crate) fn one() -> usize {
    1
}

pub(crate) fn is_one(v: &usize) -> bool {
    *v == 1
}

pub(crate) fn is_no_recompute(r: &Recompute) -> bool {
    *r == Recompute::None
}

/// Where a run writes things; not part of the configuration hash.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Checkpoint root.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Write checkpoints in the background from a copy taken at the step boundary, while
    /// the steps go on (DRIVE-4..6); `false` writes and commits them before the next step.
    pub async_checkpoint: bool,
    /// Called before each rank's shard of an asynchronous checkpoint is written (tests).
    pub before_shard_write: Option<crate::driver::ShardWriteHook>,
    /// Resume from the latest checkpoint in `checkpoint_dir`.
    pub resume: bool,
    /// One JSON object per step.
    pub log_json: Option<PathBuf>,
    /// Chrome trace output.
    pub trace: Option<PathBuf>,
    /// Show a progress bar.
    pub progress: bool,
    /// Stop after this many steps of this invocation (for tests of resume).
    pub stop_after: Option<u64>,
    /// Print the summary.
    pub quiet: bool,
    /// Fault plan being injected (`--fault`), shared across restarts.
    pub faults: Option<Arc<crate::fault::FaultInjector>>,
    /// Write every rank's recent collectives here at the first failure (`--dump-on-failure`).
    pub dump_on_failure: Option<PathBuf>,
    /// Stop after the step in progress when SIGINT or SIGTERM arrives (after
    /// [`crate::interrupt::install`]), writing a checkpoint of it when `checkpoint_dir` is set;
    /// the run then ends with [`RuntimeError::Interrupted`].
    pub stop_on_signal: bool,
    /// Leave `Summary::final_params` and `final_buffers` empty: gathering them puts the whole
    /// model on every rank at the end of the run, which a model that only fits sharded
    /// cannot afford (the CLI sets it; checkpoints hold the result).
    pub skip_final_params: bool,
    /// Each rank's compute backend in place of `--device`'s (tests: one that fails on
    /// purpose); `None` opens the device's.
    pub backend: Option<crate::engine::BackendOverride>,
    /// When a rank counts as a straggler (reported live: log, metrics, stderr).
    pub stragglers: crate::straggler::StragglerPolicy,
    /// End the run as failed, naming the rank, when a straggler is flagged.
    pub evict_stragglers: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            world: 4,
            stage: StageChoice::Fixed(Stage::Zero3),
            model: "mlp-bn".into(),
            dataset: "digits".into(),
            data_scale: None,
            epochs: 10,
            steps: None,
            batch_size: 64,
            lr: 0.05,
            optimizer: "sgd".into(),
            momentum: 0.9,
            weight_decay: 0.0,
            weight_decay_on: WeightDecayOn::All,
            warmup_steps: 0,
            cosine: true,
            clip_grad_norm: None,
            sync_bn: SyncBnMode::Auto,
            sync_bn_threshold: 32,
            seed: 0,
            grad_accum: 1,
            accum_reduce: None,
            recompute: Recompute::None,
            prefetch: 1,
            prefetch_budget: None,
            device_memory: None,
            hidden: None,
            depth: None,
            input_dim: 784,
            classes: 10,
            samples: 8192,
            params: 50_000_000,
            wrap_params: 0,
            n_layer: None,
            n_head: None,
            n_embd: None,
            block_size: None,
            dropout: None,
            vocab_size: None,
            width: None,
            init_from: None,
            threads: 1,
            device: crate::engine::Device::Cpu,
            timeout_s: 60,
            link_rate: None,
            param_dtype: PrecisionDtype::F32,
            reduce_dtype: None,
            gather_dtype: None,
            gather_block: default_gather_block(),
            shard_group: ShardGroup::World,
            cross_node_reduce_dtype: None,
            reshard_after_forward: ReshardAfterForward::World,
            profile: None,
            allow_lossy_comm: false,
            ranks_per_node: None,
        }
    }
}

/// Validates what clap cannot.
pub fn validate(cfg: &TrainConfig) -> Result<()> {
    if cfg.world == 0 {
        return Err(RuntimeError::config("--world must be at least 1"));
    }
    if cfg.batch_size == 0 {
        return Err(RuntimeError::config("--batch-size must be at least 1"));
    }
    if !(cfg.lr.is_finite() && cfg.lr > 0.0) {
        return Err(RuntimeError::config("--lr must be a positive number"));
    }
    if cfg.threads == 0 {
        return Err(RuntimeError::config("--threads must be at least 1"));
    }
    if cfg.gather_block == 0 {
        return Err(RuntimeError::config("--gather-block must be at least 1"));
    }
    if cfg.gather_dtype.is_some() && cfg.param_dtype != PrecisionDtype::F32 {
        return Err(RuntimeError::config(
            "--gather-dtype dequantizes into f32 parameters: it needs --param-dtype f32",
        ));
    }
    if cfg.hidden == Some(0) {
        return Err(RuntimeError::config("--hidden must be at least 1"));
    }
    if cfg.width.is_some() && cfg.model != "resnet-bn" {
        return Err(RuntimeError::config(format!(
            "--width applies to --model resnet-bn, not '{}' (mlp-bn and convnet-bn take --hidden)",
            cfg.model
        )));
    }
    if !matches!(cfg.optimizer.as_str(), "sgd" | "adamw") {
        return Err(RuntimeError::config(format!(
            "unknown optimizer '{}' (choose sgd or adamw)",
            cfg.optimizer
        )));
    }
    if cfg.steps == Some(0) || (cfg.steps.is_none() && cfg.epochs == 0) {
        return Err(RuntimeError::config("nothing to do: --epochs or --steps must be at least 1"));
    }
    validate_accum(cfg)?;
    validate_shard_group(cfg)?;
    validate_reshard(cfg)?;
    if let Some(s) = cfg.data_scale {
        if !(s.is_finite() && s > 0.0) {
            return Err(RuntimeError::config(format!(
                "--data-scale {s} must be a positive number"
            )));
        }
        if !matches!(FileData::parse(&cfg.dataset), Some(Ok(f)) if f.takes_scale()) {
            return Err(RuntimeError::config(format!(
                "--data-scale applies to csv:PATH and npy:X,Y data, not '{}'",
                cfg.dataset
            )));
        }
    }
    Ok(())
}

/// `--shard-group` (HSDP-1): a size that divides the world (`node` is checked against the
/// topology where a rank learns it); gradients reduced in f32 across groups.
pub(crate) fn validate_shard_group(cfg: &TrainConfig) -> Result<()> {
    let auto = cfg.stage == StageChoice::Auto;
    if cfg.profile.is_some() && !auto {
        return Err(RuntimeError::config(
            "--profile prices --stage auto's candidates: it needs --stage auto",
        ));
    }
    if cfg.allow_lossy_comm && !(auto && cfg.profile.is_some()) {
        return Err(RuntimeError::config(
            "--allow-lossy-comm lets --stage auto --profile choose 8-bit gathers and \
             cross-group reductions: it needs --stage auto and --profile",
        ));
    }
    if cfg.shard_group == ShardGroup::Auto {
        if !(auto && cfg.profile.is_some()) {
            return Err(RuntimeError::config(
                "--shard-group auto is chosen by --stage auto on a machine profile: it needs \
                 --stage auto and --profile",
            ));
        }
        // The candidates are checked one by one.
        return Ok(());
    }
    if let Some(d) = cfg.cross_node_reduce_dtype {
        let stage0 = matches!(cfg.stage, StageChoice::Fixed(Stage::Zero0));
        if cfg.shard_group.is_world() || stage0 {
            return Err(RuntimeError::config(format!(
                "--cross-node-reduce-dtype {} packs the reduction across shard groups: it needs \
                 --shard-group N|node and a stage of 1-3",
                d.name()
            )));
        }
    }
    if let ShardGroup::Ranks(n) = cfg.shard_group {
        ShardGroup::Ranks(n).size(&shardline_collectives::Topology::single_node(cfg.world))?;
        let stage0 = matches!(cfg.stage, StageChoice::Fixed(Stage::Zero0));
        if n < cfg.world && !stage0 && cfg.precision().bf16_grads() {
            return Err(RuntimeError::config(format!(
                "--shard-group {n} reduces gradients across groups in f32: it needs \
                 --reduce-dtype f32 (with --param-dtype bf16 the reduce dtype defaults to bf16)"
            )));
        }
    }
    Ok(())
}

/// `--reshard-after-forward` (HPZ-1, HPZ-4): at stage 3, an N that divides the shard group
/// and is smaller than it (`node` is checked against the topology where a rank learns it);
/// the other stages ignore it.
pub(crate) fn validate_reshard(cfg: &TrainConfig) -> Result<()> {
    // The profile's choice prices no secondary shards and may pick 8-bit gathers.
    if !cfg.reshard_after_forward.is_world() && cfg.profile.is_some() {
        return Err(RuntimeError::config(format!(
            "--reshard-after-forward {} is not among --stage auto --profile's candidates: \
             choose the stage and the group yourself to use it",
            cfg.reshard_after_forward
        )));
    }
    if cfg.reshard_after_forward.is_world()
        || !matches!(cfg.stage, StageChoice::Fixed(Stage::Zero3))
    {
        return Ok(());
    }
    if let ReshardAfterForward::Ranks(_) = cfg.reshard_after_forward {
        let single = shardline_collectives::Topology::single_node(cfg.world);
        let shard = cfg.shard_group.size(&single)?;
        cfg.reshard_after_forward.size(shard, &single)?;
    }
    Ok(())
}

/// `--grad-accum` and `--accum-reduce` (ACC-1, ACC-3): at least one microbatch, as many as
/// divide the per-rank batch evenly, and a reduction policy only where it applies.
pub(crate) fn validate_accum(cfg: &TrainConfig) -> Result<()> {
    let n = cfg.grad_accum;
    if n == 0 {
        return Err(RuntimeError::config(
            "--grad-accum 0: a step needs at least one microbatch (1: no accumulation)",
        ));
    }
    let (batch, world) = (cfg.batch_size, cfg.world.max(1));
    if n > 1 && !batch.is_multiple_of(world) {
        return Err(RuntimeError::config(format!(
            "--grad-accum {n} needs the same per-rank batch on every rank, but --batch-size \
             {batch} does not split evenly over --world {world}: make --batch-size a multiple \
             of {}",
            world * n
        )));
    }
    let per_rank = batch / world;
    if !per_rank.is_multiple_of(n) {
        return Err(RuntimeError::config(format!(
            "--grad-accum {n} does not divide the per-rank batch {per_rank} (--batch-size \
             {batch} over --world {world}): choose a --grad-accum that divides {per_rank}, or \
             a --batch-size that is a multiple of {}",
            world * n
        )));
    }
    if let (Some(how), StageChoice::Fixed(s)) = (cfg.accum_reduce, cfg.stage) {
        if !s.grads_sharded() {
            return Err(RuntimeError::config(format!(
                "--accum-reduce {} applies to stages 2 and 3; stage {} always reduces after \
                 the last microbatch: drop --accum-reduce or use --stage 2 or 3",
                how.name(),
                s.index()
            )));
        }
    }
    Ok(())
}
