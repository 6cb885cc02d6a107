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

mod build;
mod config;
mod job;

pub use build::*;
pub use config::*;
pub use job::*;

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

/// `resnet-bn`'s default width: torchvision's ResNet-18.
pub const RESNET_WIDTH: usize = 64;

/// `gpt`'s defaults: nanoGPT's CPU example (4 layers, 4 heads, width 128, context 64).
pub const GPT_DEFAULTS: (usize, usize, usize, usize) = (4, 4, 128, 64);

/// Most ranks `run` starts as threads of one process (four threads per rank; beyond this the
/// threads' start-up alone outlasts a collective's deadline on a small machine).
pub const MAX_LOCAL_WORLD: usize = 256;

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
