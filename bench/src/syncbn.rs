//! `shardline-bench syncbn`: the small-batch experiment. On digits with `convnet-bn`, train
//! with W ranks x b samples per rank using (a) per-rank BatchNorm, (b) SyncBatchNorm and
//! (c) one rank with batch W*b; report test accuracy, step time, the SyncBN overhead and the
//! statistics messages per step. Also measures the GEMM backend against the alternative in
//! the same run, and SyncBN's step-time overhead over local BN at a second world size.

use crate::report;
use serde::Serialize;
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{self, RunOptions, StageChoice, Summary, SyncBnMode, TrainConfig};
use std::path::PathBuf;

/// Options of `shardline-bench syncbn`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Ranks of the distributed runs.
    #[arg(long, default_value_t = 8)]
    pub world: usize,
    /// Samples per rank.
    #[arg(long, default_value_t = 2)]
    pub per_rank: usize,
    /// Epochs over the digits training set.
    #[arg(long, default_value_t = 4)]
    pub epochs: u64,
    /// Model (convnet-bn or mlp-bn).
    #[arg(long, default_value = "convnet-bn")]
    pub model: String,
    /// ZeRO stage of the distributed runs.
    #[arg(long, default_value_t = 0)]
    pub stage: u8,
    /// World size of the overhead comparison (local BN vs SyncBN, same per-rank batch).
    #[arg(long, default_value_t = 4)]
    pub overhead_world: usize,
    /// Seeds to average over.
    #[arg(long, default_value_t = 1)]
    pub seeds: u64,
    /// Learning rate.
    #[arg(long, default_value_t = 0.02)]
    pub lr: f32,
    /// JSON output.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    variant: String,
    world: usize,
    per_rank_batch: usize,
    global_batch: usize,
    test_accuracy: f64,
    median_step_ms: f64,
    stats_messages_per_step: usize,
    final_loss: f32,
}

fn config(
    a: &Args,
    world: usize,
    batch: usize,
    sync: SyncBnMode,
    seed: u64,
) -> anyhow::Result<TrainConfig> {
    let stage = Stage::from_index(a.stage)?;
    Ok(TrainConfig {
        world,
        stage: StageChoice::Fixed(stage),
        model: a.model.clone(),
        dataset: "digits".into(),
        epochs: a.epochs,
        batch_size: batch,
        lr: a.lr,
        sync_bn: sync,
        seed,
        ..TrainConfig::default()
    })
}

fn quiet() -> RunOptions {
    RunOptions { quiet: true, progress: false, ..RunOptions::default() }
}

fn run_avg(
    a: &Args,
    world: usize,
    batch: usize,
    sync: SyncBnMode,
) -> anyhow::Result<(Summary, f64)> {
    let mut acc = 0.0;
    let mut last = None;
    for s in 0..a.seeds {
        let sum = train::run(config(a, world, batch, sync, s)?, quiet())?;
        acc += sum.test_accuracy;
        last = Some(sum);
    }
    let last = last.ok_or_else(|| anyhow::anyhow!("--seeds must be at least 1"))?;
    Ok((last, acc / a.seeds as f64))
}

/// Runs the experiment.
pub fn run(a: Args) -> anyhow::Result<()> {
    report::check_flags(a.world > 0 && a.per_rank > 0 && a.overhead_world > 0, || {
        "--world, --per-rank and --overhead-world must be at least 1".into()
    })?;
    report::check_flags(a.seeds > 0, || "--seeds must be at least 1".into())?;
    let global = a.world * a.per_rank;
    let mut rows = Vec::new();
    println!(
        "small-batch experiment: {} on digits, {} epochs, stage {}, {} seed(s)",
        a.model, a.epochs, a.stage, a.seeds
    );
    println!(
        "{:<28} {:>5} {:>9} {:>7} {:>9} {:>11} {:>10}",
        "variant", "world", "per-rank", "global", "test acc", "step (ms)", "stats msg"
    );
    let variants = [
        ("(a) per-rank BatchNorm", a.world, SyncBnMode::Off),
        ("(b) SyncBatchNorm", a.world, SyncBnMode::On),
        ("(c) one rank, whole batch", 1, SyncBnMode::Off),
    ];
    for (name, w, sync) in variants {
        let (s, acc) = run_avg(&a, w, global, sync)?;
        let row = Row {
            variant: name.into(),
            world: w,
            per_rank_batch: global / w,
            global_batch: global,
            test_accuracy: acc,
            median_step_ms: s.median_step_s * 1e3,
            stats_messages_per_step: s.stats_messages_per_step,
            final_loss: s.final_loss,
        };
        println!(
            "{:<28} {:>5} {:>9} {:>7} {:>8.2}% {:>11.3} {:>10}",
            row.variant,
            row.world,
            row.per_rank_batch,
            row.global_batch,
            row.test_accuracy * 100.0,
            row.median_step_ms,
            row.stats_messages_per_step
        );
        rows.push(row);
    }
    let overhead_ab = rows[1].median_step_ms / rows[0].median_step_ms - 1.0;
    println!("SyncBN step-time overhead at W={}: {:+.1}%", a.world, overhead_ab * 100.0);

    // Overhead at a second world size, same per-rank batch, fewer epochs suffice for timing.
    let ow = a.overhead_world;
    let timing = Args { epochs: 1, seeds: 1, ..a.clone() };
    let (loc, _) = run_avg(&timing, ow, ow * a.per_rank, SyncBnMode::Off)?;
    let (syn, _) = run_avg(&timing, ow, ow * a.per_rank, SyncBnMode::On)?;
    let overhead_w = syn.median_step_s / loc.median_step_s - 1.0;
    println!(
        "SyncBN step-time overhead at W={ow}: local BN {:.3} ms, SyncBN {:.3} ms ({:+.1}%), {} stats messages per step",
        loc.median_step_s * 1e3,
        syn.median_step_s * 1e3,
        overhead_w * 100.0,
        syn.stats_messages_per_step
    );

    // The same comparison on the MLP that BENCH.md measures in PyTorch (784 -> 4 x 1024 BN
    // ReLU -> 10, global batch 256): compute per step is realistic there, so the statistics
    // reductions' latency is a smaller share than on the tiny digits convnet.
    let mlp = |sync| TrainConfig {
        world: ow,
        stage: StageChoice::Fixed(Stage::Zero0),
        model: "mlp-bn".into(),
        dataset: "synthetic".into(),
        hidden: Some(1024),
        depth: Some(4),
        input_dim: 784,
        classes: 10,
        samples: 4096,
        steps: Some(12),
        batch_size: 256,
        sync_bn: sync,
        ..TrainConfig::default()
    };
    let mloc = train::run(mlp(SyncBnMode::Off), quiet())?;
    let msyn = train::run(mlp(SyncBnMode::On), quiet())?;
    let overhead_mlp = msyn.median_step_s / mloc.median_step_s - 1.0;
    println!(
        "SyncBN step-time overhead at W={ow}, mlp-bn 784-4x1024-10, batch 256: local BN {:.1} ms, SyncBN {:.1} ms ({:+.1}%), {} stats messages per step",
        mloc.median_step_s * 1e3,
        msyn.median_step_s * 1e3,
        overhead_mlp * 100.0,
        msyn.stats_messages_per_step
    );

    // GEMM backend vs the alternative, same run.
    use shardline_models::backend::{gemm_gflops, matrixmultiply_gflops};
    let cpu = shardline_models::Cpu::new();
    let (m, n, k) = (256, 1024, 1024);
    let ours = gemm_gflops(&cpu, m, n, k, 5);
    let alt = matrixmultiply_gflops(m, n, k, 5);
    println!("GEMM {m}x{n}x{k}, one thread: gemm crate {ours:.1} GFLOP/s, matrixmultiply {alt:.1} GFLOP/s ({:.2}x)", ours / alt);

    if let Some(p) = &a.json {
        report::write_json(
            p,
            &serde_json::json!({
                "rows": rows,
                "syncbn_overhead_at_world": {"world": a.world, "overhead": overhead_ab},
                "syncbn_overhead_second_world": {"world": ow, "local_ms": loc.median_step_s * 1e3, "sync_ms": syn.median_step_s * 1e3, "overhead": overhead_w},
                "syncbn_overhead_mlp": {"world": ow, "local_ms": mloc.median_step_s * 1e3, "sync_ms": msyn.median_step_s * 1e3, "overhead": overhead_mlp},
                "gemm": {"m": m, "n": n, "k": k, "gemm_gflops": ours, "matrixmultiply_gflops": alt},
            }),
        )?;
        println!("wrote {}", p.display());
    }
    Ok(())
}
