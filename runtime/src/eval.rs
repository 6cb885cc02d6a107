//! `shardline eval`: a checkpoint's loss and accuracy on the test split of a data set.
//!
//! A checkpoint records its job's [`TrainConfig`] in the manifest ([`TRAIN_CONFIG_KEY`]);
//! [`evaluate`] rebuilds the job's plan from it, with the data set (and world) to evaluate
//! on, refuses a model whose parameters differ from the checkpoint's (the data's sample
//! shape or classes disagree with it), loads the checkpoint into one engine per rank as
//! threads of this process (resharded when the evaluating world differs from the writing
//! one, CKPT-3), and runs the training loop's own evaluation ([`RankEngine::eval_set`], in
//! forwards of the same size).
//!
//! Invariants:
//! - `EVAL-1`: evaluating at the training job's world, on its data set, gives bitwise the
//!   test loss and accuracy that the job reported after the checkpoint's step: the same
//!   parameters, buffers, test split, forwards and reduction order. At another world the
//!   per-rank partial sums of the loss are added in another order, so the loss agrees to f32
//!   rounding. This needs the BatchNorm running statistics to be the same on every rank
//!   (SyncBatchNorm on, one rank, or no BatchNorm): with per-rank statistics each rank of
//!   the job evaluated its share with its own, while a checkpoint keeps rank 0's.
//! - `EVAL-2`: an evaluation forward takes at most a training microbatch's samples per rank
//!   (`eval_batch`), so evaluation holds less than a training step, which also keeps what
//!   backward needs: a memory cap that trains also evaluates.

use crate::actors::eval_batch;
use crate::checkpoint::{Checkpoint, MANIFEST};
use crate::engine::{Device, RankEngine};
use crate::error::{Result, RuntimeError};
use crate::memory::MemoryTracker;
use crate::telemetry::Trace;
use crate::train::{self, StageChoice, TrainConfig, MAX_LOCAL_WORLD, TRAIN_CONFIG_KEY};
use shardline_collectives::{local_group_with_topology, CommOptions, Topology};
use shardline_models::data::source::FileData;
use shardline_models::{DistributedSampler, ModelSpec};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What to evaluate, and where.
#[derive(Clone, Debug, Default)]
pub struct EvalOptions {
    /// A `step-N` directory, or a checkpoint root (its newest checkpoint).
    pub checkpoint: PathBuf,
    /// The data set (`--dataset` names); none: the training job's.
    pub dataset: Option<String>,
    /// `--data-scale` for CSV and `.npy` data; none: the training job's when it applies.
    pub data_scale: Option<f32>,
    /// Ranks (threads of this process); none: the world that wrote the checkpoint.
    pub world: Option<usize>,
}

/// The result of [`evaluate`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct EvalReport {
    /// The checkpoint directory evaluated.
    pub checkpoint: PathBuf,
    /// Its optimizer step.
    pub step: u64,
    /// The world and stage that wrote it.
    pub written_by: (usize, u8),
    /// The model's name.
    pub model: String,
    /// Its parameter count.
    pub params: usize,
    /// The data set evaluated on.
    pub dataset: String,
    /// Where data read from files came from.
    pub data_origin: Option<String>,
    /// Ranks that evaluated.
    pub world: usize,
    /// Mean loss over the test split (for `gpt`: nats per held-out token).
    pub loss: f32,
    /// Correct predictions (samples, or next tokens).
    pub correct: u64,
    /// Predictions scored.
    pub count: u64,
    /// `exp(loss)`, for a language model.
    pub perplexity: Option<f64>,
}

impl EvalReport {
    /// Correct predictions over those scored (0 when none was).
    pub fn accuracy(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.correct as f64 / self.count as f64
        }
    }

    /// The lines `shardline eval` prints.
    pub fn lines(&self) -> Vec<String> {
        let unit = if self.perplexity.is_some() { "held-out tokens" } else { "test samples" };
        let mut out = vec![format!(
            "shardline eval: {} ({} params) from {} (step {}, written by world {} at stage {}) on {} ({} {unit}), world {}",
            self.model,
            self.params,
            self.checkpoint.display(),
            self.step,
            self.written_by.0,
            self.written_by.1,
            self.dataset,
            self.count,
            self.world
        )];
        if let Some(o) = &self.data_origin {
            out.push(format!("  data: {o}"));
        }
        out.push(format!("  test loss         {:.6}", self.loss));
        out.push(format!(
            "  test accuracy     {:.2}% ({} of {})",
            self.accuracy() * 100.0,
            self.correct,
            self.count
        ));
        if let Some(p) = self.perplexity {
            out.push(format!("  perplexity        {p:.4}"));
        }
        out
    }
}

/// The training job's configuration, as its checkpoint recorded it.
pub fn recorded_config(ck: &Checkpoint) -> Result<TrainConfig> {
    let mpath = ck.dir().join(MANIFEST);
    let v = ck.manifest().extra.get(TRAIN_CONFIG_KEY).ok_or_else(|| {
        RuntimeError::checkpoint(
            &mpath,
            "records no training configuration (written before checkpoints recorded it): \
             its model cannot be rebuilt for evaluation",
        )
    })?;
    serde_json::from_value(v.clone())
        .map_err(|e| RuntimeError::checkpoint(&mpath, format!("extra.{TRAIN_CONFIG_KEY}: {e}")))
}

/// The configuration that evaluates on `o`'s data set and world what `recorded` trained.
fn eval_config(recorded: TrainConfig, ck: &Checkpoint, o: &EvalOptions) -> TrainConfig {
    let dataset = o.dataset.clone().unwrap_or_else(|| recorded.dataset.clone());
    // A scale is part of the model's input: keep the job's unless told otherwise, where the
    // data set takes one.
    let takes_scale = matches!(FileData::parse(&dataset), Some(Ok(f)) if f.takes_scale());
    let data_scale = o.data_scale.or(recorded.data_scale.filter(|_| takes_scale));
    TrainConfig {
        world: o.world.unwrap_or(ck.manifest().world),
        stage: StageChoice::Fixed(ck.manifest().stage),
        dataset,
        data_scale,
        device: Device::Cpu,
        // Training settings that evaluation does not use and another world may not allow.
        grad_accum: 1,
        accum_reduce: None,
        recompute: Default::default(),
        shard_group: Default::default(),
        cross_node_reduce_dtype: None,
        reshard_after_forward: Default::default(),
        ..recorded
    }
}

/// Why `got` (the model the data set gives) is not the checkpoint's `want`, or `None`.
fn model_mismatch(want: &ModelSpec, got: &ModelSpec) -> Option<String> {
    if want == got {
        return None;
    }
    let params = |s: &ModelSpec| -> Vec<(String, Vec<usize>)> {
        s.units.iter().flat_map(|u| &u.params).map(|p| (p.name.clone(), p.shape.clone())).collect()
    };
    let (w, g) = (params(want), params(got));
    let first = w.iter().zip(&g).find(|(a, b)| a != b);
    Some(match first {
        Some(((name, ws), (_, gs))) => {
            format!("parameter {name} has shape {ws:?} in the checkpoint, {gs:?} for this data")
        }
        None => format!("the checkpoint has {} parameters, this data's model {}", w.len(), g.len()),
    })
}

/// Evaluates the checkpoint `o.checkpoint` on the test split of `o.dataset` (see the module
/// doc). A missing or damaged checkpoint, one that does not record its configuration, and a
/// data set whose samples or classes do not fit the model are errors naming the file or flag.
pub fn evaluate(o: &EvalOptions) -> Result<EvalReport> {
    let ck = Checkpoint::open(&o.checkpoint)?;
    ck.verify()?;
    let recorded = recorded_config(&ck)?;
    // The job's microbatch sets the evaluation forwards' size (EVAL-1, EVAL-2).
    let accum = recorded.grad_accum;
    let cfg = eval_config(recorded, &ck, o);
    if cfg.world == 0 || cfg.world > MAX_LOCAL_WORLD {
        return Err(RuntimeError::config(format!(
            "--world {} must be between 1 and {MAX_LOCAL_WORLD}",
            cfg.world
        )));
    }
    // The checkpoint fixes the model, so a data set of the other kind (tokens for a model of
    // samples, or samples for gpt) is --dataset's mistake; train's message would name --model.
    let gpt = cfg.model == "gpt";
    if o.dataset.is_some() && gpt != train::is_text(&cfg.dataset) {
        let wants = if gpt { "text (--dataset text or text:PATH)" } else { "samples, not text" };
        return Err(RuntimeError::config(format!(
            "--dataset {}: the checkpoint's model {} takes {wants}",
            cfg.dataset, cfg.model
        )));
    }
    let p = train::plan(&cfg)?;
    let spec = p.model.spec();
    let m = ck.manifest();
    if let Some(why) = model_mismatch(&m.model, &spec) {
        return Err(RuntimeError::config(format!(
            "--dataset {}: samples of shape {:?} in {} classes do not fit the checkpoint's {} \
             ({why})",
            cfg.dataset, p.test.sample_shape, p.test.classes, m.model.name
        )));
    }
    let shards = ck.load_all(cfg.world)?;
    let buffers = ck.buffers()?;
    let mut copts = CommOptions::new();
    copts.timeout(Duration::from_secs(cfg.timeout_s));
    let comms = local_group_with_topology(Topology::single_node(cfg.world), copts)?;
    // The forward size of the training loop's evaluation (`RankActor`), so that the same
    // sums are made (EVAL-1).
    let sampler = DistributedSampler::new(p.train.len(), cfg.world, cfg.batch_size, cfg.seed, true)
        .map_err(RuntimeError::from_model)?;
    let batch = eval_batch(sampler.per_rank_batch(), accum);
    let (model, test, step) = (Arc::clone(&p.model), &p.test, m.step);
    // Every rank at once: building the engines, loading and evaluating are collective.
    let results: Vec<Result<(u64, u64, f32)>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(shards)
            .map(|(c, shard)| {
                let (c, m, e) = (c.clone(), Arc::clone(&model), p.engine.clone());
                let buffers = &buffers;
                s.spawn(move || {
                    let mem = MemoryTracker::new(c.rank(), None);
                    let mut eng = RankEngine::new(c, m, e, mem, Trace::disabled())?;
                    eng.load_state(&shard, buffers, step)?;
                    eng.eval_set(test, batch)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::Failed("an evaluating rank panicked".into()))
                })
            })
            .collect()
    });
    let mut results = results.into_iter().collect::<Result<Vec<_>>>()?;
    let (correct, count, loss) = results.swap_remove(0);
    Ok(EvalReport {
        checkpoint: ck.dir().to_path_buf(),
        step: m.step,
        written_by: (m.world, m.stage.index()),
        model: spec.name.clone(),
        params: spec.numel(),
        dataset: cfg.dataset.clone(),
        data_origin: p.data_origin.clone(),
        world: cfg.world,
        loss,
        correct,
        count,
        perplexity: p.gpt.is_some().then(|| f64::from(loss).exp()),
    })
}
