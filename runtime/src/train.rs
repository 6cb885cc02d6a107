//! `shardline train`: the configuration of a run and the plan every rank derives from it.
//!
//! Every rank of a job, whether a thread of one process or a process of its own, validates
//! the same [`TrainConfig`] and derives the same [`JobPlan`] (data, model, stage, schedule);
//! [`crate::driver`] then runs the steps.

use crate::checkpoint::{self, CheckpointMeta, DataLoaderState};
use crate::engine::{
    AccumReduce, EngineConfig, GatherDtype, MixedPrecision, PrecisionDtype, QuantGather, Recompute,
    ReshardAfterForward, ShardGroup, StepStats,
};
use crate::error::{Result, RuntimeError};
use crate::memory::{format_bytes, MemoryTracker};
use crate::optim::{AdamWConfig, Optimizer, SgdConfig, WeightDecayOn};
use crate::schedule::LrSchedule;
use crate::shard::{ShardedModelLayout, Stage};
use serde::{Deserialize, Serialize};
use shardline_models::data::source::FileData;
use shardline_models::module::resnet;
use shardline_models::nn::GptConfig;
use shardline_models::{convert_sync_batchnorm, zoo, Dataset, Model, Network, WrapPolicy};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

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

fn default_gather_block() -> usize {
    256
}

fn is_f32(d: &PrecisionDtype) -> bool {
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

fn one() -> usize {
    1
}

fn is_one(v: &usize) -> bool {
    *v == 1
}

fn is_no_recompute(r: &Recompute) -> bool {
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

/// The result of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Steps run in this invocation.
    pub steps: u64,
    /// Total steps completed (including resumed ones).
    pub total_steps: u64,
    /// Test accuracy after training (for `gpt`: next tokens predicted, over the held-out
    /// tokens).
    pub test_accuracy: f64,
    /// Mean loss over the test set after training (for `gpt`: nats per held-out token).
    pub test_loss: f32,
    /// Predictions scored by the evaluation (samples, or tokens); 0 when the data set has no
    /// held-out part (a `.bin` token file).
    pub test_count: u64,
    /// Final loss (mean over the last global batch).
    pub final_loss: f32,
    /// Steps per second (wall).
    pub steps_per_s: f64,
    /// Median step time over ranks' max.
    pub median_step_s: f64,
    /// Exposed communication as a fraction of step time (mean over steps).
    pub comm_exposed_frac: f64,
    /// Peak tracked bytes per rank.
    pub peak_bytes: Vec<u64>,
    /// Per rank, each category's own peak (`Category::key`, bytes); they need not coincide
    /// in time, so they may sum to more than the total peak.
    pub peak_by_category: Vec<Vec<(String, u64)>>,
    /// Stage used.
    pub stage: u8,
    /// Whether SyncBN was on, and why.
    pub sync_bn: (bool, String),
    /// Stats messages per step.
    pub stats_messages_per_step: usize,
    /// Wall time of the run.
    pub wall_s: f64,
    /// Per-step losses.
    pub losses: Vec<f32>,
    /// Final full parameters per unit (unpadded).
    #[serde(skip)]
    pub final_params: Vec<Vec<f32>>,
    /// Final replicated buffers per unit.
    #[serde(skip)]
    pub final_buffers: Vec<Vec<f32>>,
    /// Per-step figures.
    #[serde(skip)]
    pub step_stats: Vec<StepStats>,
    /// How long the step loop stood still for each checkpoint of this invocation.
    pub checkpoint_stalls: Vec<crate::driver::CheckpointStall>,
}

/// Builds the model named in the config.
pub fn build_model(cfg: &TrainConfig, input_shape: &[usize], classes: usize) -> Result<Model> {
    let model = match cfg.model.as_str() {
        "mlp-bn" => {
            let mut m = zoo::MlpBn::digits();
            m.input_dim = input_shape.iter().product();
            m.classes = classes;
            if let Some(h) = cfg.hidden {
                m.hidden = h;
            }
            if let Some(d) = cfg.depth {
                m.depth = d;
            }
            m.build()
        }
        "convnet-bn" => {
            let mut m = zoo::ConvNetBn::digits();
            // DATA-6: the data set's [C, H, W]; the convolutions take any H and W.
            m.input = match input_shape {
                [c, h, w] => [*c, *h, *w],
                other => {
                    return Err(RuntimeError::config(format!(
                        "convnet-bn needs image samples [C, H, W], not {other:?}"
                    )))
                }
            };
            if let Some(h) = cfg.hidden {
                m.widths = vec![h, 2 * h];
            }
            m.classes = classes;
            m.build().map_err(RuntimeError::from_model)?
        }
        "wide-mlp" => {
            // Sized by --params, but fed by the data set: its input width and classes.
            let mut m = zoo::WideMlp::with_params(cfg.params);
            m.input_dim = input_shape.iter().product();
            m.classes = classes;
            m.build()
        }
        other => {
            return Err(RuntimeError::config(format!(
                "unknown model '{other}' (choose mlp-bn, convnet-bn, wide-mlp, resnet-bn or gpt)"
            )))
        }
    };
    Ok(if cfg.wrap_params > 0 { model.wrap(WrapPolicy::ByParams(cfg.wrap_params)) } else { model })
}

/// `resnet-bn`'s default width: torchvision's ResNet-18.
pub const RESNET_WIDTH: usize = 64;

/// The `resnet-bn` of `cfg` for images of `input_shape` (`[C, H, W]`) and `classes`
/// (MRES-1): `--width` channels in `layer1` (default [`RESNET_WIDTH`]), units per block
/// unless `--wrap-params` groups them.
pub fn build_resnet(
    cfg: &TrainConfig,
    input_shape: &[usize],
    classes: usize,
) -> Result<shardline_models::ModuleNet> {
    let &[c, _, _] = input_shape else {
        return Err(RuntimeError::config(format!(
            "--model resnet-bn needs images [C, H, W]; --dataset {} gives samples of shape {input_shape:?}",
            cfg.dataset
        )));
    };
    let width = cfg.width.unwrap_or(RESNET_WIDTH);
    if width == 0 {
        return Err(RuntimeError::config("--width must be at least 1"));
    }
    let rc = resnet::ResNetConfig::resnet18(c, classes, width);
    let net = resnet::resnet_bn(&rc).map_err(|e| RuntimeError::config(e.to_string()))?;
    Ok(if cfg.wrap_params > 0 { net.wrap(WrapPolicy::ByParams(cfg.wrap_params)) } else { net })
}

/// `gpt`'s defaults: nanoGPT's CPU example (4 layers, 4 heads, width 128, context 64).
pub const GPT_DEFAULTS: (usize, usize, usize, usize) = (4, 4, 128, 64);

/// The `gpt` configuration of `cfg` for a vocabulary of `vocab`, checked (GPT-6); errors
/// name the flag.
pub fn gpt_config(cfg: &TrainConfig, vocab: usize) -> Result<GptConfig> {
    let (l, h, e, b) = GPT_DEFAULTS;
    if let Some(v) = cfg.vocab_size.filter(|&v| v < vocab) {
        return Err(RuntimeError::config(format!(
            "--vocab-size {v} is below the data set's {vocab} tokens"
        )));
    }
    let g = GptConfig {
        vocab_size: cfg.vocab_size.unwrap_or(vocab),
        block_size: cfg.block_size.unwrap_or(b),
        n_layer: cfg.n_layer.unwrap_or(l),
        n_head: cfg.n_head.unwrap_or(h),
        n_embd: cfg.n_embd.unwrap_or(e),
        bias: true,
        layernorm_eps: 1e-5,
        dropout: cfg.dropout.unwrap_or(0.0),
    };
    for (flag, v) in [
        ("--n-layer", g.n_layer),
        ("--n-head", g.n_head),
        ("--n-embd", g.n_embd),
        ("--block-size", g.block_size),
    ] {
        if v == 0 {
            return Err(RuntimeError::config(format!("{flag} must be at least 1")));
        }
    }
    if !(0.0..1.0).contains(&g.dropout) {
        return Err(RuntimeError::config(format!("--dropout {} must be in [0, 1)", g.dropout)));
    }
    if !g.n_embd.is_multiple_of(g.n_head) {
        return Err(RuntimeError::config(format!(
            "--n-embd {} is not divisible by --n-head {}",
            g.n_embd, g.n_head
        )));
    }
    g.validate().map_err(|e| RuntimeError::config(format!("gpt: {e}")))?;
    Ok(g)
}

/// The default bound on unreduced gradients in flight (stages 2 and 3): two of the largest
/// unit, so that one reduction overlaps the next unit's backward (ENG-7).
pub fn reduce_budget(layout: &ShardedModelLayout) -> u64 {
    layout.max_unit_padded_numel() as u64 * 4 * 2
}

/// Most ranks `run` starts as threads of one process (four threads per rank; beyond this the
/// threads' start-up alone outlasts a collective's deadline on a small machine).
pub const MAX_LOCAL_WORLD: usize = 256;

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
fn validate_shard_group(cfg: &TrainConfig) -> Result<()> {
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
fn validate_reshard(cfg: &TrainConfig) -> Result<()> {
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
fn validate_accum(cfg: &TrainConfig) -> Result<()> {
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

fn optimizer_of(cfg: &TrainConfig) -> Optimizer {
    match cfg.optimizer.as_str() {
        "adamw" => Optimizer::AdamW(AdamWConfig {
            weight_decay: cfg.weight_decay,
            ..AdamWConfig::default()
        }),
        _ => Optimizer::Sgd(SgdConfig {
            momentum: cfg.momentum,
            weight_decay: cfg.weight_decay,
            ..SgdConfig::default()
        }),
    }
}

/// Per-stage per-rank memory estimate: model state plus gathered units (stage 3) or the full
/// unsharded working copy, and at stages 2 and 3 with `--grad-accum` and `--accum-reduce
/// last` the full gradients held until the last microbatch (ACC-3).
pub fn stage_estimates(model: &dyn Network, cfg: &TrainConfig) -> Result<Vec<(Stage, u64)>> {
    let layout = ShardedModelLayout::new(&model.spec(), cfg.world)?;
    let opt = optimizer_of(cfg);
    let unit = layout.max_unit_padded_numel() as u64 * 4;
    Ok([Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3]
        .into_iter()
        .map(|s| {
            let state = layout.model_state_bytes(s, &opt);
            // Transient: the unreduced gradients in flight where gradients are sharded (the
            // reduce budget, and the unit whose backward runs while it is full, ENG-7) and,
            // at stage 3, the gathered units (current + prefetch).
            let unreduced = if s.grads_sharded() { reduce_budget(&layout) + unit } else { 0 };
            let gathered = if s == Stage::Zero3 { unit * (2 + cfg.prefetch as u64) } else { 0 };
            let transient = unreduced + gathered;
            // ACC-3: `--accum-reduce last` keeps every unit's full gradient until the last
            // microbatch.
            let held = cfg.grad_accum > 1
                && s.grads_sharded()
                && cfg.accum_reduce == Some(AccumReduce::Last);
            let full_grads = if held { layout.padded_numel() as u64 * 4 } else { 0 };
            (s, state + transient + full_grads)
        })
        .collect())
}

/// Resolves `--stage auto`; returns the stage and the explanation lines.
///
/// Each stage's estimate is its model state ([`stage_estimates`]) plus the activations and
/// kernel scratch of one microbatch, measured by running it once
/// ([`crate::activations::activation_peak`]), with the job's recompute choice.
pub fn choose_stage(
    model: &dyn Network,
    cfg: &TrainConfig,
    train: &Dataset,
) -> Result<(Stage, Vec<String>)> {
    match cfg.stage {
        StageChoice::Fixed(s) => Ok((s, vec![])),
        StageChoice::Auto => {
            let act = crate::activations::activation_peak(model, train, cfg)?;
            let est = stage_estimates(model, cfg)?;
            let mut lines = vec![format!(
                "  activations and scratch: ~{} per rank (one microbatch of {} samples run once, --recompute {})",
                format_bytes(act),
                crate::activations::microbatch(cfg),
                cfg.recompute.name()
            )];
            let est: Vec<(Stage, u64)> = est.into_iter().map(|(s, b)| (s, b + act)).collect();
            lines.extend(est.iter().map(|(s, b)| {
                format!(
                    "  stage {}: ~{} per rank (model state + activations)",
                    s.index(),
                    format_bytes(*b)
                )
            }));
            let pick = match cfg.device_memory {
                None => Some(Stage::Zero0),
                Some(cap) => est.iter().find(|(_, b)| *b <= cap).map(|(s, _)| *s),
            };
            match pick {
                Some(s) => {
                    lines.push(format!(
                        "  chose stage {} (the lowest that fits{}; if the model fits, plain data parallel is simplest)",
                        s.index(),
                        cfg.device_memory.map(|c| format!(" {}", format_bytes(c))).unwrap_or_default()
                    ));
                    Ok((s, lines))
                }
                None => Err(RuntimeError::config(format!(
                    "no ZeRO stage fits --device-memory {}:\n{}",
                    format_bytes(cfg.device_memory.unwrap_or(0)),
                    lines.join("\n")
                ))),
            }
        }
    }
}

/// The part of the configuration that must match to resume (not run length or outputs).
fn resume_hash(cfg: &TrainConfig, stage: Stage, sync: bool) -> Result<String> {
    #[derive(Serialize)]
    struct H<'a> {
        model: &'a str,
        dataset: &'a str,
        /// Absent when unset, so earlier checkpoints still match.
        #[serde(skip_serializing_if = "Option::is_none")]
        data_scale: Option<f32>,
        batch: usize,
        lr: f32,
        optimizer: &'a str,
        momentum: f32,
        wd: f32,
        /// Absent for the default (every parameter), so earlier checkpoints still match.
        #[serde(skip_serializing_if = "WeightDecayOn::is_all")]
        wd_on: WeightDecayOn,
        seed: u64,
        hidden: Option<usize>,
        depth: Option<usize>,
        /// Absent unless set, so earlier checkpoints still match.
        #[serde(skip_serializing_if = "Option::is_none")]
        width: Option<usize>,
        input_dim: usize,
        classes: usize,
        samples: usize,
        params: usize,
        wrap: usize,
        sync: bool,
        warmup: u64,
        cosine: bool,
        clip: Option<f64>,
        stage_is_3: bool,
    }
    let _ = stage;
    checkpoint::config_hash(&H {
        model: &cfg.model,
        dataset: &cfg.dataset,
        data_scale: cfg.data_scale,
        batch: cfg.batch_size,
        lr: cfg.lr,
        optimizer: &cfg.optimizer,
        momentum: cfg.momentum,
        wd: cfg.weight_decay,
        wd_on: cfg.weight_decay_on,
        seed: cfg.seed,
        hidden: cfg.hidden,
        depth: cfg.depth,
        width: cfg.width,
        input_dim: cfg.input_dim,
        classes: cfg.classes,
        samples: cfg.samples,
        params: cfg.params,
        wrap: cfg.wrap_params,
        sync,
        warmup: cfg.warmup_steps,
        cosine: cfg.cosine,
        clip: cfg.clip_grad_norm,
        stage_is_3: false,
    })
}

/// Median of `v` (sorts it); 0 when empty.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// What a job derives from its configuration before any rank starts: the same on every
/// rank of a job, whether ranks are threads of one process or separate processes.
#[derive(Clone)]
pub struct JobPlan {
    /// Training split.
    pub train: Dataset,
    /// Test split.
    pub test: Dataset,
    /// The model (SyncBatchNorm already converted when on).
    pub model: Arc<dyn Network>,
    /// The stage used.
    pub stage: Stage,
    /// Lines explaining `--stage auto`.
    pub stage_lines: Vec<String>,
    /// Whether SyncBatchNorm is on, and why.
    pub sync: (bool, String),
    /// Optimizer steps of the whole job.
    pub total_steps: u64,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: u64,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Each rank's engine configuration.
    pub engine: EngineConfig,
    /// Hash of the configuration a checkpoint must match to be resumed.
    pub hash: String,
    /// The decoder's configuration when the model is `gpt` (recorded in checkpoints).
    pub gpt: Option<GptConfig>,
    /// Where data read from files came from and how its test split was made.
    pub data_origin: Option<String>,
}

/// Whether the job is a language model on text: `--model gpt` with `--dataset text[:PATH]`
/// (either without the other is an error naming both flags).
fn train_on_text(cfg: &TrainConfig) -> Result<bool> {
    let text = cfg.dataset == "text" || cfg.dataset.starts_with("text:");
    match (cfg.model == "gpt", text) {
        (true, true) => Ok(true),
        (false, false) => Ok(false),
        (true, false) => Err(RuntimeError::config(format!(
            "--model gpt trains on text: use --dataset text (the bundled corpus) or text:PATH, not '{}'",
            cfg.dataset
        ))),
        (false, true) => Err(RuntimeError::config(format!(
            "--dataset {} holds tokens: use --model gpt (not '{}')",
            cfg.dataset, cfg.model
        ))),
    }
}

/// Validates `cfg` and derives the job's plan (data, model, stage, schedule) from the model
/// and data set it names.
pub fn plan(cfg: &TrainConfig) -> Result<JobPlan> {
    validate(cfg)?;
    let image = matches!(cfg.model.as_str(), "convnet-bn" | "resnet-bn");
    let text = train_on_text(cfg)?;
    let (train, test, data_origin) = load_data_with_origin(cfg, image)?;
    if text {
        let g = gpt_config(cfg, train.classes)?;
        let net = shardline_models::module::gpt::gpt(&g)
            .map_err(|e| RuntimeError::config(format!("gpt: {e}")))?;
        let net =
            if cfg.wrap_params > 0 { net.wrap(WrapPolicy::ByParams(cfg.wrap_params)) } else { net };
        let p = plan_network(cfg, Arc::new(net), train, test)?;
        return Ok(JobPlan { gpt: Some(g), data_origin, ..p });
    }
    if cfg.model == "resnet-bn" {
        let net = build_resnet(cfg, &train.sample_shape, train.classes)?;
        let p = plan_network(cfg, Arc::new(net), train, test)?;
        return Ok(JobPlan { data_origin, ..p });
    }
    let mut model = build_model(cfg, &train.sample_shape, train.classes)?;
    // A zoo model follows the mode whether or not it has BatchNorm (one without ignores it).
    let sync = sync_bn_choice(cfg, None);
    if sync.0 {
        convert_sync_batchnorm(&mut model);
    } else if cfg.world > 1 && model.has_local_batchnorm() {
        tracing::warn!("world {} with plain BatchNorm: batch statistics are per rank", cfg.world);
    }
    let p = job_plan(cfg, Arc::new(model), sync, train, test)?;
    Ok(JobPlan { data_origin, ..p })
}

/// Validates `cfg` and derives the plan of a job that trains `model` on `train` and
/// evaluates it on `test`: how a model defined outside Shardline (a
/// [`ModuleNet`](shardline_models::ModuleNet) of its own modules) trains through the same
/// job as the named models. `cfg.model` and `cfg.dataset` only name them (in the header and
/// the checkpoint's configuration hash); the model's parameters are initialised from
/// `cfg.seed`.
pub fn plan_network(
    cfg: &TrainConfig,
    model: Arc<dyn Network>,
    train: Dataset,
    test: Dataset,
) -> Result<JobPlan> {
    validate(cfg)?;
    let spec = model.spec();
    // BatchNorm is the only layer with buffers (running statistics): a model without any
    // has nothing to synchronise.
    let bn = spec.units.iter().any(|u| !u.buffers.is_empty());
    let sync = sync_bn_choice(cfg, (!bn).then_some(spec.name.as_str()));
    if bn && !sync.0 && cfg.world > 1 {
        tracing::warn!("world {} with plain BatchNorm: batch statistics are per rank", cfg.world);
    }
    job_plan(cfg, model, sync, train, test)
}

/// Whether SyncBatchNorm is on, and why; `no_batchnorm` names a model known to have none.
fn sync_bn_choice(cfg: &TrainConfig, no_batchnorm: Option<&str>) -> (bool, String) {
    if let Some(name) = no_batchnorm {
        return (false, format!("off ({name} has no BatchNorm)"));
    }
    // What a BatchNorm sees: the per-rank microbatch (ACC-4).
    let per_rank_batch = cfg.batch_size / cfg.world / cfg.grad_accum.max(1);
    let per = if cfg.grad_accum > 1 { "per rank and microbatch" } else { "per rank" };
    match cfg.sync_bn {
        SyncBnMode::On => (true, "on (--sync-bn on)".to_string()),
        SyncBnMode::Off => (false, "off (--sync-bn off)".to_string()),
        SyncBnMode::Auto if cfg.world == 1 => (false, "off (auto: one rank, local statistics are global)".into()),
        SyncBnMode::Auto if per_rank_batch < cfg.sync_bn_threshold => (
            true,
            format!("on (auto: {per_rank_batch} samples {per} < {}, per-rank statistics would be noisy)", cfg.sync_bn_threshold),
        ),
        SyncBnMode::Auto => (
            false,
            format!("off (auto: {per_rank_batch} samples {per} >= {}, local statistics suffice)", cfg.sync_bn_threshold),
        ),
    }
}

/// The plan of a validated `cfg` for `model` (SyncBatchNorm already as `sync` says); `plan`
/// adds the `gpt` configuration.
fn job_plan(
    cfg: &TrainConfig,
    model: Arc<dyn Network>,
    (sync, why): (bool, String),
    train: Dataset,
    test: Dataset,
) -> Result<JobPlan> {
    // CKPT-8: a file that does not match is refused here, before any rank starts.
    let model: Arc<dyn Network> = match &cfg.init_from {
        Some(path) => {
            let w = checkpoint::load_torch_weights(path, &model.spec())?;
            Arc::new(checkpoint::Initialized::new(model, w))
        }
        None => model,
    };
    // AUTO-1..5: with a profile, the stage, shard group and wires are chosen together.
    let resolved = crate::auto_shard::estimate::resolve(&*model, cfg, &train)?;
    let chosen;
    let (stage, stage_lines, cfg) = match resolved {
        Some((r, lines)) => {
            chosen = r.apply(cfg);
            (r.stage, lines, &chosen)
        }
        None => {
            let (stage, lines) = choose_stage(&*model, cfg, &train)?;
            (stage, lines, cfg)
        }
    };
    if train.is_empty() {
        return Err(RuntimeError::config(format!(
            "the training set of '{}' is empty (--samples {}): nothing to train on",
            cfg.dataset, cfg.samples
        )));
    }
    let steps_per_epoch = train.len().div_ceil(cfg.batch_size) as u64;
    let total_steps = cfg.steps.unwrap_or(cfg.epochs * steps_per_epoch);
    let lr = if cfg.cosine {
        LrSchedule::warmup_cosine(cfg.lr, cfg.warmup_steps, total_steps, 0.0)
    } else {
        LrSchedule::constant(cfg.lr)
    };
    let optimizer = optimizer_of(cfg);
    let layout = ShardedModelLayout::new(&model.spec(), cfg.world)?;
    let budget = cfg
        .prefetch_budget
        .unwrap_or(layout.max_unit_padded_numel() as u64 * 4 * (cfg.prefetch as u64 + 1));
    let engine = EngineConfig {
        stage,
        prefetch: cfg.prefetch,
        prefetch_budget_bytes: budget,
        reduce_budget_bytes: reduce_budget(&layout),
        sync_bn: sync,
        optimizer,
        weight_decay_on: cfg.weight_decay_on,
        lr,
        clip_grad_norm: cfg.clip_grad_norm,
        seed: cfg.seed,
        threads: cfg.threads,
        device: cfg.device,
        grad_accum: cfg.grad_accum,
        accum_reduce: cfg.accum_reduce.unwrap_or_default(),
        recompute: cfg.recompute,
        precision: cfg.precision(),
        shard_group: cfg.shard_group,
        cross_node_reduce: cfg
            .cross_node_reduce_dtype
            .map(|dtype| QuantGather { dtype, block: cfg.gather_block }),
        reshard_after_forward: cfg.reshard_after_forward,
    };
    let hash = resume_hash(cfg, stage, sync)?;
    Ok(JobPlan {
        train,
        test,
        model,
        stage,
        stage_lines,
        sync: (sync, why),
        total_steps,
        steps_per_epoch,
        optimizer,
        engine,
        hash,
        gpt: None,
        data_origin: None,
    })
}

/// Prints the job's header lines (what `shardline train` shows before the first step).
pub fn print_header(cfg: &TrainConfig, p: &JobPlan) {
    let spec = p.model.spec();
    println!(
        "shardline train: {} ({} params, {} units) on {} ({} train / {} test), world {}, stage {}, global batch {}, {} steps",
        spec.name,
        spec.numel(),
        spec.units.len(),
        cfg.dataset,
        p.train.len(),
        p.test.len(),
        cfg.world,
        p.stage.index(),
        cfg.batch_size,
        p.total_steps
    );
    if let Some(origin) = &p.data_origin {
        println!("  data: {origin}");
    }
    if cfg.device != crate::engine::Device::Cpu {
        println!(
            "  device: {} (matrix multiplies and elementwise kernels on the GPU; shards, \
             optimizer and collectives on the host)",
            cfg.device
        );
    }
    for l in &p.stage_lines {
        println!("{l}");
    }
    println!("  sync-bn: {}", p.sync.1);
    let group = p.engine.shard_group;
    match group {
        ShardGroup::World | ShardGroup::Auto => {}
        // HSDP-4.
        _ if p.stage == Stage::Zero0 => {
            println!("  shard group: {group} (stage 0: plain replication)")
        }
        ShardGroup::Node => println!("  shard group: the ranks of each node (HSDP)"),
        ShardGroup::Ranks(n) => println!(
            "  shard group: {n} consecutive ranks, {} replica groups (HSDP)",
            cfg.world / n.max(1)
        ),
    }
    match cfg.reshard_after_forward {
        ReshardAfterForward::World => {}
        // HPZ-4.
        r if p.stage != Stage::Zero3 => {
            println!("  reshard after forward: {r} (stages 0-2 keep full parameters: no effect)")
        }
        ReshardAfterForward::Node => println!(
            "  reshard after forward: a secondary shard over each node (hpZ: later gathers \
             of a unit in the step stay in the node)"
        ),
        ReshardAfterForward::Ranks(n) => {
            println!("  reshard after forward: a secondary shard over {n} consecutive ranks (hpZ)")
        }
    }
    if cfg.grad_accum > 1 {
        let reduce = if p.stage.grads_sharded() {
            format!("reduce-scatter {}", p.engine.accum_reduce.name())
        } else {
            "reduced after the last".to_string()
        };
        println!(
            "  grad-accum: {} microbatches of {} samples per rank ({reduce})",
            cfg.grad_accum,
            cfg.batch_size / cfg.world / cfg.grad_accum
        );
    }
    if cfg.recompute != Recompute::None {
        println!("  recompute: {}", cfg.recompute.name());
    }
    let prec = p.engine.precision;
    if !prec.with_gather(None).is_f32() {
        println!(
            "  precision: params {} (gathers and compute), gradients reduced in {}; masters, \
             optimizer state, norms statistics and loss in f32",
            prec.param_dtype.name(),
            prec.reduce_dtype.name()
        );
    }
    if let Some(q) = prec.gather_quant {
        println!(
            "  gathers: {} in blocks of {} (lossy: compute sees the dequantized parameters)",
            q.dtype.name(),
            q.block
        );
    }
    if let Some(q) = p.engine.cross_node_reduce {
        println!(
            "  reduction across shard groups: {} in blocks of {} (lossy)",
            q.dtype.name(),
            q.block
        );
    }
}

/// The data-loader position after batch `next_index - 1` of `epoch`: batches consumed in
/// the epoch so far, rolling over to the next epoch at its end.
pub fn loader_position(
    steps_per_epoch: u64,
    epoch: u64,
    next_index: u64,
    seed: u64,
) -> DataLoaderState {
    let (epoch, step) =
        if next_index >= steps_per_epoch { (epoch + 1, 0) } else { (epoch, next_index) };
    DataLoaderState { epoch, step, seed }
}

/// Key of the manifest's `extra` entry holding a `gpt` run's [`GptConfig`]: `n_head` cannot be
/// read off the parameter shapes, and `shardline sample` must rebuild the same decoder.
pub const GPT_CONFIG_KEY: &str = "gpt_config";

/// Key of the manifest's `extra` entry holding the job's [`TrainConfig`]: `shardline eval`
/// rebuilds the model from it (sizes such as `--hidden` are not all readable off the shapes).
pub const TRAIN_CONFIG_KEY: &str = "train_config";

/// The manifest fields of a checkpoint of this job at `position`.
pub fn checkpoint_meta(
    cfg: &TrainConfig,
    stage: Stage,
    hash: &str,
    optimizer: Optimizer,
    model: &dyn Network,
    gpt: Option<&GptConfig>,
    position: DataLoaderState,
) -> CheckpointMeta {
    let mut extra = BTreeMap::new();
    if let Some(g) = gpt.and_then(|g| serde_json::to_value(g).ok()) {
        extra.insert(GPT_CONFIG_KEY.to_string(), g);
    }
    if let Ok(c) = serde_json::to_value(cfg) {
        extra.insert(TRAIN_CONFIG_KEY.to_string(), c);
    }
    CheckpointMeta {
        world: cfg.world,
        stage,
        config_hash: hash.to_owned(),
        optimizer,
        model: model.spec(),
        data_loader: position,
        extra,
    }
}

/// Runs a training job with every rank as threads of this process; blocks until it ends
/// (the loop itself: [`crate::driver`]).
pub fn run(cfg: TrainConfig, opts: RunOptions) -> Result<Summary> {
    crate::driver::local::run(cfg, opts, plan)
}

/// Runs a job that trains a model of the caller's own ([`plan_network`]) with every rank as
/// threads of this process, as [`run`] runs the named models: the same stages, checkpoints,
/// logs and summary.
pub fn run_network(
    cfg: TrainConfig,
    model: Arc<dyn Network>,
    train: Dataset,
    test: Dataset,
    opts: RunOptions,
) -> Result<Summary> {
    crate::driver::local::run(cfg, opts, |cfg| plan_network(cfg, model, train, test))
}

/// Prints the summary block of a finished run.
pub fn print_summary(s: &Summary, trackers: &[MemoryTracker]) {
    println!("summary:");
    if s.test_count == 0 {
        println!("  test              none (the data set has no held-out part)");
    } else {
        println!("  test accuracy     {:.2}%", s.test_accuracy * 100.0);
        println!("  test loss         {:.4}", s.test_loss);
    }
    println!("  final loss        {:.4}", s.final_loss);
    println!(
        "  steps             {} ({} in this run) in {:.1} s, {:.1} steps/s",
        s.total_steps, s.steps, s.wall_s, s.steps_per_s
    );
    println!("  median step       {:.2} ms", s.median_step_s * 1e3);
    println!("  exposed comm      {:.1}% of step time", s.comm_exposed_frac * 100.0);
    println!(
        "  sync-bn           {}; {} stats messages per step",
        s.sync_bn.1, s.stats_messages_per_step
    );
    for t in trackers {
        let parts: Vec<String> = crate::memory::Category::ALL
            .iter()
            .filter(|c| t.peak(**c) > 0)
            .map(|c| format!("{} {}", c.label(), format_bytes(t.peak(*c))))
            .collect();
        println!(
            "  rank {} peak       {} (peaks by category: {})",
            t.rank(),
            format_bytes(t.peak_total()),
            parts.join(", ")
        );
    }
}
