//! The [`JobPlan`] every rank derives from a [`TrainConfig`] (data, model, stage, schedule),
//! and the header a run prints about it.

use super::*;

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

/// Whether `dataset` names a text corpus (`text`, `text:PATH`): tokens, which only gpt takes.
pub(crate) fn is_text(dataset: &str) -> bool {
    dataset == "text" || dataset.starts_with("text:")
}

/// Whether the job is a language model on text: `--model gpt` with `--dataset text[:PATH]`
/// (either without the other is an error naming both flags).
pub(crate) fn train_on_text(cfg: &TrainConfig) -> Result<bool> {
    let text = is_text(&cfg.dataset);
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
    } else if model.has_local_batchnorm() {
        note_local_batchnorm(cfg);
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
    if bn && !sync.0 {
        note_local_batchnorm(cfg);
    }
    job_plan(cfg, model, sync, train, test)
}

/// Says that a model's BatchNorms keep per-rank statistics at `cfg.world` > 1: a warning
/// where `--sync-bn off` chose it, a log line where auto did (the header says why).
fn note_local_batchnorm(cfg: &TrainConfig) {
    let world = cfg.world;
    match cfg.sync_bn {
        _ if world <= 1 => {}
        SyncBnMode::Auto => tracing::info!("world {world}: BatchNorm statistics are per rank"),
        _ => tracing::warn!("world {world} with plain BatchNorm: batch statistics are per rank"),
    }
}

/// Whether SyncBatchNorm is on, and why; `no_batchnorm` names a model known to have none.
pub(crate) fn sync_bn_choice(cfg: &TrainConfig, no_batchnorm: Option<&str>) -> (bool, String) {
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
pub(crate) fn job_plan(
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
