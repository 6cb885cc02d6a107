//! `shardline-bench memory`: per ZeRO stage and world size, the measured per-rank peak of a
//! few training steps next to the theoretical model-state bytes (params + grads + optimizer
//! state, by stage), and a `wide-mlp` that fails at stage 0 under a `--device-memory` cap but
//! trains at stage 3 under the same cap.
//!
//! The goal: measured peak within 10% of theory plus the gathered-unit budget (stage
//! 3 holds up to `prefetch + 1` gathered units; the other stages none). Whatever the peak
//! holds beyond that (activations of the small batch, a unit's unreduced gradient, collective
//! staging) is printed as the excess, with each category's own peak.
//!
//! With `--hpz NODESxRANKS,...` it measures instead the cost of secondary shards
//! (`--reshard-after-forward`, HPZ-2) at stage 3: per shape, threads in secondary groups of
//! RANKS consecutive ranks (a node's worth), the peak per rank next to the full-shard run's
//! and the `secondary shards` category's own peak, all read from the ranks' trackers.

use crate::report;
use anyhow::Context;
use serde::Serialize;
use shardline_runtime::memory::format_bytes;
use shardline_runtime::shard::{ShardedModelLayout, Stage};
use shardline_runtime::train::{
    self, build_model, load_data, RunOptions, StageChoice, SyncBnMode, TrainConfig,
};
use shardline_runtime::{Optimizer, RuntimeError};
use std::path::PathBuf;

/// Flags of `shardline-bench memory`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// World sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub world: Vec<usize>,
    /// Model: wide-mlp (sized by --params) or mlp-bn; with --hpz also gpt (on the bundled
    /// text, shaped by --n-layer, --n-head, --n-embd, --block-size).
    #[arg(long, default_value = "wide-mlp")]
    pub model: String,
    /// mlp-bn hidden width (default the model's).
    #[arg(long)]
    pub hidden: Option<usize>,
    /// mlp-bn depth in blocks (default the model's).
    #[arg(long)]
    pub depth: Option<usize>,
    /// gpt layers (default the model's).
    #[arg(long)]
    pub n_layer: Option<usize>,
    /// gpt attention heads (default the model's).
    #[arg(long)]
    pub n_head: Option<usize>,
    /// gpt embedding width (default the model's).
    #[arg(long)]
    pub n_embd: Option<usize>,
    /// gpt context length (default the model's).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Measure secondary shards instead, at stage 3, for each NODESxRANKS shape (e.g.
    /// 2x2,2x4): the world is NODES*RANKS threads, the secondary groups RANKS consecutive
    /// ranks; prints the full-shard peak, the peak with secondary shards and the pieces' own
    /// peak per rank (the largest over the ranks).
    #[arg(long, value_delimiter = ',', value_parser = parse_shape)]
    pub hpz: Vec<(usize, usize)>,
    /// wide-mlp parameter count, e.g. 2M.
    #[arg(long, default_value = "2M", value_parser = parse_count)]
    pub params: usize,
    /// Synthetic input features.
    #[arg(long, default_value_t = 784)]
    pub input_dim: usize,
    /// Global batch (small, so that model state dominates).
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Training steps per configuration.
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    /// Optimizer: sgd (momentum, one state value per parameter) or adamw (two).
    #[arg(long, default_value = "sgd")]
    pub optimizer: String,
    /// Stage-3 prefetch depth.
    #[arg(long, default_value_t = 1)]
    pub prefetch: usize,
    /// Cap for the fits-at-stage-3 demonstration (default: between the largest world's
    /// stage-3 peak and its stage-0 model state).
    #[arg(long, value_parser = report::parse_bytes)]
    pub cap: Option<u64>,
    /// Write the rows and the demonstration as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn parse_shape(s: &str) -> Result<(usize, usize), String> {
    let bad = || format!("--hpz {s}: expected NODESxRANKS, e.g. 2x4");
    let (n, r) = s.split_once('x').ok_or_else(bad)?;
    match (n.trim().parse::<usize>(), r.trim().parse::<usize>()) {
        (Ok(n), Ok(r)) if n >= 2 && r >= 1 => Ok((n, r)),
        (Ok(_), Ok(_)) => Err(format!("--hpz {s}: needs at least 2 nodes of at least 1 rank")),
        _ => Err(bad()),
    }
}

fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mult) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1e3),
        Some('m') => (&t[..t.len() - 1], 1e6),
        Some('g') => (&t[..t.len() - 1], 1e9),
        _ => (t.as_str(), 1.0),
    };
    let n: f64 = num.parse().map_err(|_| format!("'{s}' is not a count (try 2M or 500000)"))?;
    if !(n.is_finite() && n > 0.0) {
        return Err(format!("'{s}' is not a positive count"));
    }
    Ok((n * mult) as usize)
}

/// One (world, stage) measurement.
#[derive(Debug, Serialize)]
pub struct Row {
    /// Ranks.
    pub world: usize,
    /// ZeRO stage.
    pub stage: u8,
    /// Rank.
    pub rank: usize,
    /// Measured peak of the rank's tracker over the run.
    pub peak_bytes: u64,
    /// Theoretical model-state bytes per rank for this stage and layout.
    pub theory_bytes: u64,
    /// Transient budget: gathered units ((prefetch + 1) x the largest padded unit, stage 3) plus the
    /// unreduced-gradient budget (stages 2 and 3, ENG-7).
    pub gathered_budget_bytes: u64,
    /// peak / theory.
    pub ratio: f64,
    /// peak - (theory + gathered budget), may be negative.
    pub excess_bytes: i64,
    /// excess / (theory + gathered budget).
    pub excess_frac: f64,
    /// Each category's own peak (they need not coincide in time).
    pub peak_by_category: Vec<(String, u64)>,
}

/// The outcome of one capped run.
#[derive(Debug, Serialize)]
pub struct CappedRun {
    /// ZeRO stage.
    pub stage: u8,
    /// Whether it trained.
    pub trained: bool,
    /// Peak per rank when it trained.
    pub peak_bytes: Vec<u64>,
    /// The error when it did not.
    pub error: Option<String>,
}

/// The fits-at-stage-3 demonstration.
#[derive(Debug, Serialize)]
pub struct CapDemo {
    /// World size.
    pub world: usize,
    /// The cap per rank.
    pub cap_bytes: u64,
    /// Stage 0 then stage 3 under the cap.
    pub runs: Vec<CappedRun>,
}

/// Everything the benchmark measured.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Model name.
    pub model: String,
    /// Trainable parameters (unpadded).
    pub params: usize,
    /// Global batch.
    pub batch_size: usize,
    /// Optimizer name.
    pub optimizer: String,
    /// Rows, per world, stage and rank.
    pub rows: Vec<Row>,
    /// The capped runs.
    pub cap_demo: Option<CapDemo>,
}

fn config(a: &Args, world: usize, stage: Stage) -> TrainConfig {
    TrainConfig {
        world,
        stage: StageChoice::Fixed(stage),
        model: a.model.clone(),
        dataset: "synthetic".into(),
        input_dim: a.input_dim,
        classes: 10,
        samples: (a.batch_size * a.steps as usize).max(64),
        params: a.params,
        steps: Some(a.steps),
        batch_size: a.batch_size,
        optimizer: a.optimizer.clone(),
        lr: 0.01,
        sync_bn: SyncBnMode::Auto,
        prefetch: a.prefetch,
        timeout_s: 120,
        hidden: a.hidden,
        depth: a.depth,
        n_layer: a.n_layer,
        n_head: a.n_head,
        n_embd: a.n_embd,
        block_size: a.block_size,
        ..TrainConfig::default()
    }
}

fn quiet() -> RunOptions {
    RunOptions { quiet: true, progress: false, ..RunOptions::default() }
}

/// The theoretical per-rank model state and the gathered-unit budget of a configuration.
fn theory(cfg: &TrainConfig, stage: Stage) -> anyhow::Result<(u64, u64, usize)> {
    let (train_set, _) = load_data(cfg, false)?;
    let model = build_model(cfg, &train_set.sample_shape, train_set.classes)?;
    let layout = ShardedModelLayout::new(&model.spec(), cfg.world)?;
    let opt = optimizer_of(cfg);
    let state = layout.model_state_bytes(stage, &opt);
    // Transient working set on top of the model state: stage 3 holds up to prefetch + 1
    // gathered units; stages 2 and 3 hold at most the reduce budget of full, unreduced unit
    // gradients (ENG-7). Stages 0 and 1 reduce in their persistent buffers.
    let gathered = if stage == Stage::Zero3 {
        layout.max_unit_padded_numel() as u64 * 4 * (cfg.prefetch as u64 + 1)
    } else {
        0
    };
    let unreduced = if matches!(stage, Stage::Zero2 | Stage::Zero3) {
        shardline_runtime::train::reduce_budget(&layout)
    } else {
        0
    };
    let budget = gathered + unreduced;
    Ok((state, budget, layout.numel()))
}

fn optimizer_of(cfg: &TrainConfig) -> Optimizer {
    use shardline_runtime::optim::{AdamWConfig, SgdConfig};
    match cfg.optimizer.as_str() {
        "adamw" => Optimizer::AdamW(AdamWConfig::default()),
        _ => Optimizer::Sgd(SgdConfig { momentum: cfg.momentum, ..SgdConfig::default() }),
    }
}

const STAGES: [Stage; 4] = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3];

/// Runs the benchmark.
pub fn run(a: Args) -> anyhow::Result<()> {
    report::check_flags(!a.world.is_empty() && a.world.iter().all(|&w| w > 0), || {
        "--world must be at least 1".into()
    })?;
    if !a.hpz.is_empty() {
        return hpz(&a);
    }
    let mut rows = Vec::new();
    let mut params = 0;
    println!(
        "shardline-bench memory: {} ({}), global batch {}, {} steps, optimizer {}, prefetch {}",
        a.model, a.params, a.batch_size, a.steps, a.optimizer, a.prefetch
    );
    println!(
        "{:>5} {:>5} {:>4} {:>11} {:>11} {:>11} {:>6} {:>11} {:>7}  largest categories",
        "world", "stage", "rank", "peak", "theory", "transient", "ratio", "excess", "excess%"
    );
    for &world in &a.world {
        for stage in STAGES {
            let cfg = config(&a, world, stage);
            let (state, budget, n) = theory(&cfg, stage)?;
            params = n;
            let s = train::run(cfg, quiet())
                .with_context(|| format!("world {world} stage {}", stage.index()))?;
            for (rank, &peak) in s.peak_bytes.iter().enumerate() {
                let bound = state + budget;
                let excess = peak as i64 - bound as i64;
                let cats = s.peak_by_category.get(rank).cloned().unwrap_or_default();
                let mut top: Vec<&(String, u64)> = cats.iter().filter(|c| c.1 > 0).collect();
                top.sort_by_key(|c| std::cmp::Reverse(c.1));
                let top: Vec<String> =
                    top.iter().take(4).map(|(k, b)| format!("{k} {}", format_bytes(*b))).collect();
                let row = Row {
                    world,
                    stage: stage.index(),
                    rank,
                    peak_bytes: peak,
                    theory_bytes: state,
                    gathered_budget_bytes: budget,
                    ratio: peak as f64 / state.max(1) as f64,
                    excess_bytes: excess,
                    excess_frac: excess as f64 / bound.max(1) as f64,
                    peak_by_category: cats,
                };
                println!(
                    "{:>5} {:>5} {:>4} {:>11} {:>11} {:>11} {:>6.3} {:>11} {:>6.1}%  {}",
                    world,
                    row.stage,
                    rank,
                    format_bytes(peak),
                    format_bytes(state),
                    format_bytes(budget),
                    row.ratio,
                    signed_bytes(excess),
                    row.excess_frac * 100.0,
                    top.join(", ")
                );
                rows.push(row);
            }
        }
    }
    let within = rows.iter().filter(|r| r.excess_frac <= 0.10).count();
    println!(
        "{within} of {} rank rows within 10% of theory + transient budget (gathered units + unreduced grads)",
        rows.len()
    );

    let cap_demo = cap_demo(&a, &rows)?;
    let report = Report {
        model: a.model.clone(),
        params,
        batch_size: a.batch_size,
        optimizer: a.optimizer.clone(),
        rows,
        cap_demo,
    };
    if let Some(p) = &a.json {
        report::write_json(p, &report)?;
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn signed_bytes(b: i64) -> String {
    if b < 0 {
        format!("-{}", format_bytes(b.unsigned_abs()))
    } else {
        format!("+{}", format_bytes(b as u64))
    }
}

/// Stage 0 and stage 3 of the largest world under one cap: the first must fail with
/// OutOfMemory, the second must train.
fn cap_demo(a: &Args, rows: &[Row]) -> anyhow::Result<Option<CapDemo>> {
    let Some(&world) = a.world.iter().max() else { return Ok(None) };
    if world < 2 {
        println!("(cap demonstration skipped: it needs a world of at least 2)");
        return Ok(None);
    }
    let peak_of = |stage: u8| {
        rows.iter()
            .filter(|r| r.world == world && r.stage == stage)
            .map(|r| r.peak_bytes)
            .max()
            .unwrap_or(0)
    };
    let (p3, state0) = (
        peak_of(3),
        rows.iter().find(|r| r.world == world && r.stage == 0).map_or(0, |r| r.theory_bytes),
    );
    // Halfway between what stage 3 needs and what stage 0 cannot do without.
    let cap = a.cap.unwrap_or((p3 + state0) / 2);
    println!();
    println!(
        "cap demonstration: {} at world {world}, --device-memory {} per rank",
        a.model,
        format_bytes(cap)
    );
    let mut runs = Vec::new();
    for stage in [Stage::Zero0, Stage::Zero3] {
        let mut cfg = config(a, world, stage);
        cfg.device_memory = Some(cap);
        let run = match train::run(cfg, quiet()) {
            Ok(s) => {
                let max = s.peak_bytes.iter().copied().max().unwrap_or(0);
                println!(
                    "  stage {}: trained {} steps, peak {} per rank (of {})",
                    stage.index(),
                    s.total_steps,
                    format_bytes(max),
                    format_bytes(cap)
                );
                CappedRun {
                    stage: stage.index(),
                    trained: true,
                    peak_bytes: s.peak_bytes,
                    error: None,
                }
            }
            Err(e) => {
                let oom = matches!(e, RuntimeError::OutOfMemory { .. })
                    || e.to_string().contains("would exceed");
                println!(
                    "  stage {}: {}: {e}",
                    stage.index(),
                    if oom { "OutOfMemory" } else { "failed" }
                );
                CappedRun {
                    stage: stage.index(),
                    trained: false,
                    peak_bytes: vec![],
                    error: Some(e.to_string()),
                }
            }
        };
        runs.push(run);
    }
    Ok(Some(CapDemo { world, cap_bytes: cap, runs }))
}

/// One shape's secondary-shard measurement (HPZ-2), the largest figure over its ranks.
#[derive(Debug, Serialize)]
pub struct HpzRow {
    /// Nodes (secondary groups per shard group).
    pub nodes: usize,
    /// Ranks per node (the secondary group's size).
    pub ranks_per_node: usize,
    /// Peak per rank at stage 3, `--reshard-after-forward world`.
    pub full_shard_peak_bytes: u64,
    /// Peak per rank with secondary shards over each node.
    pub hpz_peak_bytes: u64,
    /// The `secondary shards` category's own peak per rank: the pieces held at once.
    pub secondary_peak_bytes: u64,
    /// The `gathered units` category's peak per rank under `world`, for scale.
    pub gathered_peak_bytes: u64,
}

/// Secondary shards: per `--hpz` shape, stage 3 under `world` and under groups of the
/// node's ranks, the peaks read from the trackers.
fn hpz(a: &Args) -> anyhow::Result<()> {
    use shardline_runtime::engine::ReshardAfterForward;
    println!(
        "shardline-bench memory --hpz: {} (hidden {:?}, depth {:?}; gpt layers {:?}, heads {:?}, \
         embd {:?}, block {:?}), global batch {}, {} steps, optimizer {}, prefetch {}, stage 3; \
         per rank, the largest over the ranks",
        a.model,
        a.hidden,
        a.depth,
        a.n_layer,
        a.n_head,
        a.n_embd,
        a.block_size,
        a.batch_size,
        a.steps,
        a.optimizer,
        a.prefetch
    );
    println!(
        "{:>5} {:>5} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "nodes", "ranks", "full shard", "with hpZ", "difference", "pieces", "gathered"
    );
    let max = |s: &train::Summary, key: &str| {
        s.peak_by_category
            .iter()
            .map(|c| c.iter().find(|(k, _)| k == key).map_or(0, |(_, b)| *b))
            .max()
            .unwrap_or(0)
    };
    let mut rows = Vec::new();
    for &(nodes, per) in &a.hpz {
        let mut cfg = config(a, nodes * per, Stage::Zero3);
        if a.model == "gpt" {
            cfg.dataset = "text".into();
        }
        let what = |r: &str| format!("{nodes}x{per} {r}");
        let full = train::run(cfg.clone(), quiet()).with_context(|| what("world"))?;
        cfg.reshard_after_forward = ReshardAfterForward::Ranks(per);
        let hpz = train::run(cfg, quiet()).with_context(|| what("node"))?;
        let peak = |s: &train::Summary| s.peak_bytes.iter().copied().max().unwrap_or(0);
        let row = HpzRow {
            nodes,
            ranks_per_node: per,
            full_shard_peak_bytes: peak(&full),
            hpz_peak_bytes: peak(&hpz),
            secondary_peak_bytes: max(&hpz, "secondary_shards"),
            gathered_peak_bytes: max(&full, "gathered_units"),
        };
        println!(
            "{:>5} {:>5} {:>12} {:>12} {:>12} {:>12} {:>12}",
            nodes,
            per,
            format_bytes(row.full_shard_peak_bytes),
            format_bytes(row.hpz_peak_bytes),
            signed_bytes(row.hpz_peak_bytes as i64 - row.full_shard_peak_bytes as i64),
            format_bytes(row.secondary_peak_bytes),
            format_bytes(row.gathered_peak_bytes)
        );
        rows.push(row);
    }
    if let Some(p) = &a.json {
        report::write_json(p, &rows)?;
        println!("wrote {}", p.display());
    }
    Ok(())
}
