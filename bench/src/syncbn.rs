//! `shardline-bench syncbn`: the small-batch experiment. Train with W ranks x b samples per
//! rank using (a) per-rank BatchNorm, (b) SyncBatchNorm and (c) one rank holding the whole
//! batch W*b; report each variant's mean test accuracy over the seeds with its standard error,
//! step time, the SyncBN overhead and the statistics messages per step. Two workloads:
//! `convnet-bn` on the bundled digits (the default), and `resnet-bn` on Fashion-MNIST
//! (`--model resnet-bn --dataset idx:models/data/fashion-mnist --width 8`, or any data set
//! `shardline train --dataset` reads). Also measures the GEMM backend against the alternative
//! in the same run, and SyncBN's step-time overhead over local BN at a second world size.
//!
//! Every variant runs the same seeds, and seed `s` gives every variant the same initial
//! weights and the same global batches (the sampler cuts global batches before dealing them to
//! ranks), so the variants differ only in how BatchNorm sees the batch.
//!
//! Invariants:
//! - SBN-1: the standard error of a mean over n seeds is the sample standard deviation
//!   (n - 1 in the denominator) over sqrt(n); with one seed it is not defined and is reported
//!   as absent, never as 0.

use crate::report;
use serde::Serialize;
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{self, RunOptions, StageChoice, SyncBnMode, TrainConfig};
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
    /// Epochs over the training set.
    #[arg(long, default_value_t = 4)]
    pub epochs: u64,
    /// Optimizer steps instead of whole epochs (every variant runs the same number).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Model (convnet-bn, mlp-bn or resnet-bn).
    #[arg(long, default_value = "convnet-bn")]
    pub model: String,
    /// Data set, as `shardline train --dataset` names it (digits, fashion-mnist, idx:DIR, ...).
    #[arg(long, default_value = "digits")]
    pub dataset: String,
    /// `resnet-bn`: channels of `layer1` (torchvision's ResNet-18 has 64).
    #[arg(long)]
    pub width: Option<usize>,
    /// ZeRO stage of the distributed runs.
    #[arg(long, default_value_t = 0)]
    pub stage: u8,
    /// World size of the overhead comparison (local BN vs SyncBN, same per-rank batch).
    #[arg(long, default_value_t = 4)]
    pub overhead_world: usize,
    /// Steps of each overhead comparison run (its median step time is reported).
    #[arg(long, default_value_t = 40)]
    pub overhead_steps: u64,
    /// Seeds to average over (0, 1, ..., N-1); the standard error needs at least 2.
    #[arg(long, default_value_t = 1)]
    pub seeds: u64,
    /// Learning rate.
    #[arg(long, default_value_t = 0.02)]
    pub lr: f32,
    /// Skip the second-world overhead, the MLP overhead and the GEMM comparison.
    #[arg(long)]
    pub study_only: bool,
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
    /// Test accuracy of each seed, in seed order.
    seed_accuracies: Vec<f64>,
    test_accuracy: f64,
    /// `None` with fewer than two seeds (SBN-1).
    test_accuracy_stderr: Option<f64>,
    /// Median over seeds of each run's median step time.
    median_step_ms: f64,
    stats_messages_per_step: usize,
    /// Mean over seeds of the last step's loss.
    final_loss: f32,
    steps: u64,
}

/// Mean and standard error of `xs` (SBN-1): the sample standard deviation over sqrt(n), and
/// `None` for fewer than two values.
pub fn mean_stderr(xs: &[f64]) -> (f64, Option<f64>) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, None);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, Some((var / n).sqrt()))
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
        dataset: a.dataset.clone(),
        width: a.width,
        epochs: a.epochs,
        steps: a.steps,
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

/// One variant over every seed.
fn run_seeds(
    a: &Args,
    name: &str,
    world: usize,
    global: usize,
    sync: SyncBnMode,
) -> anyhow::Result<Row> {
    let (mut accs, mut steps_ms, mut losses) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    for s in 0..a.seeds {
        let t = std::time::Instant::now();
        let sum = train::run(config(a, world, global, sync, s)?, quiet())?;
        eprintln!(
            "  {name}, seed {s}: test accuracy {:.2}%, {} steps, median step {:.2} ms, {:.0} s",
            sum.test_accuracy * 100.0,
            sum.steps,
            sum.median_step_s * 1e3,
            t.elapsed().as_secs_f64()
        );
        accs.push(sum.test_accuracy);
        steps_ms.push(sum.median_step_s * 1e3);
        losses.push(sum.final_loss);
        last = Some(sum);
    }
    let last = last.ok_or_else(|| anyhow::anyhow!("--seeds must be at least 1"))?;
    let (mean, se) = mean_stderr(&accs);
    Ok(Row {
        variant: name.into(),
        world,
        per_rank_batch: global / world,
        global_batch: global,
        test_accuracy: mean,
        test_accuracy_stderr: se,
        seed_accuracies: accs,
        median_step_ms: train::median(&mut steps_ms),
        stats_messages_per_step: last.stats_messages_per_step,
        final_loss: losses.iter().sum::<f32>() / losses.len() as f32,
        steps: last.steps,
    })
}

fn pct(se: Option<f64>) -> String {
    se.map_or("n/a".into(), |s| format!("{:.2}", s * 100.0))
}

/// Runs the experiment.
pub fn run(a: Args) -> anyhow::Result<()> {
    report::check_flags(a.world > 0 && a.per_rank > 0 && a.overhead_world > 0, || {
        "--world, --per-rank and --overhead-world must be at least 1".into()
    })?;
    report::check_flags(a.seeds > 0, || "--seeds must be at least 1".into())?;
    report::check_flags(a.steps != Some(0) && a.overhead_steps > 0, || {
        "--steps and --overhead-steps must be at least 1".into()
    })?;
    let global = a.world * a.per_rank;
    let length = a.steps.map_or(format!("{} epochs", a.epochs), |s| format!("{s} steps"));
    println!(
        "small-batch experiment: {} on {}, {length}, stage {}, seeds 0..{}",
        a.model, a.dataset, a.stage, a.seeds
    );
    let variants = [
        ("(a) per-rank BatchNorm", a.world, SyncBnMode::Off),
        ("(b) SyncBatchNorm", a.world, SyncBnMode::On),
        ("(c) one rank, whole batch", 1, SyncBnMode::Off),
    ];
    let mut rows = Vec::new();
    for (name, w, sync) in variants {
        rows.push(run_seeds(&a, name, w, global, sync)?);
    }
    println!(
        "{:<28} {:>5} {:>9} {:>7} {:>9} {:>9} {:>11} {:>10}",
        "variant", "world", "per-rank", "global", "test acc", "std err", "step (ms)", "stats msg"
    );
    for row in &rows {
        println!(
            "{:<28} {:>5} {:>9} {:>7} {:>8.2}% {:>8}% {:>11.3} {:>10}",
            row.variant,
            row.world,
            row.per_rank_batch,
            row.global_batch,
            row.test_accuracy * 100.0,
            pct(row.test_accuracy_stderr),
            row.median_step_ms,
            row.stats_messages_per_step
        );
    }
    // SyncBN against per-rank BN: the difference of the means and its standard error, the
    // seeds' runs being independent draws for each variant.
    let gain = rows[1].test_accuracy - rows[0].test_accuracy;
    let gain_se = match (rows[0].test_accuracy_stderr, rows[1].test_accuracy_stderr) {
        (Some(x), Some(y)) => Some((x * x + y * y).sqrt()),
        _ => None,
    };
    match gain_se {
        Some(se) => println!(
            "SyncBN - per-rank BN: {:+.2} points, standard error {:.2} ({:.1} standard errors)",
            gain * 100.0,
            se * 100.0,
            if se > 0.0 { gain / se } else { f64::INFINITY }
        ),
        None => println!(
            "SyncBN - per-rank BN: {:+.2} points (one seed: no standard error)",
            gain * 100.0
        ),
    }
    // Paired by seed: seed s gives both variants the same initial weights and batches, so
    // the per-seed differences remove what the seeds share.
    let diffs: Vec<f64> =
        rows[1].seed_accuracies.iter().zip(&rows[0].seed_accuracies).map(|(b, a)| b - a).collect();
    let (paired, paired_se) = mean_stderr(&diffs);
    if let Some(se) = paired_se {
        println!(
            "paired by seed: {:+.2} points, standard error {:.2} ({:.1} standard errors)",
            paired * 100.0,
            se * 100.0,
            if se > 0.0 { paired / se } else { f64::INFINITY }
        );
    }
    let overhead_ab = rows[1].median_step_ms / rows[0].median_step_ms - 1.0;
    println!("SyncBN step-time overhead at W={}: {:+.1}%", a.world, overhead_ab * 100.0);
    let mut extra = serde_json::Map::new();
    if !a.study_only {
        extras(&a, &mut extra)?;
    }
    if let Some(p) = &a.json {
        let mut doc = serde_json::json!({
            "model": a.model, "dataset": a.dataset, "width": a.width, "stage": a.stage,
            "seeds": a.seeds, "epochs": a.epochs, "steps": a.steps, "lr": a.lr,
            "rows": rows,
            "syncbn_minus_local": {"points": gain, "stderr": gain_se},
            "syncbn_minus_local_paired": {"points": paired, "stderr": paired_se},
            "syncbn_overhead_at_world": {"world": a.world, "overhead": overhead_ab},
        });
        if let Some(map) = doc.as_object_mut() {
            map.extend(extra);
        }
        report::write_json(p, &doc)?;
        println!("wrote {}", p.display());
    }
    Ok(())
}

/// The overhead at a second world size, on the MLP, and the GEMM comparison.
fn extras(a: &Args, out: &mut serde_json::Map<String, serde_json::Value>) -> anyhow::Result<()> {
    // Overhead at a second world size, same per-rank batch; a fixed number of steps suffices
    // for timing.
    let ow = a.overhead_world;
    let timing = Args { steps: Some(a.overhead_steps), seeds: 1, ..a.clone() };
    let once = |sync| -> anyhow::Result<_> {
        Ok(train::run(config(&timing, ow, ow * a.per_rank, sync, 0)?, quiet())?)
    };
    let loc = once(SyncBnMode::Off)?;
    let syn = once(SyncBnMode::On)?;
    let overhead_w = syn.median_step_s / loc.median_step_s - 1.0;
    println!(
        "SyncBN step-time overhead at W={ow}: local BN {:.3} ms, SyncBN {:.3} ms ({:+.1}%), {} stats messages per step",
        loc.median_step_s * 1e3,
        syn.median_step_s * 1e3,
        overhead_w * 100.0,
        syn.stats_messages_per_step
    );
    out.insert(
        "syncbn_overhead_second_world".into(),
        serde_json::json!({"world": ow, "local_ms": loc.median_step_s * 1e3, "sync_ms": syn.median_step_s * 1e3, "overhead": overhead_w}),
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
    let ours = gemm_gflops(&cpu, m, n, k, 5)?;
    let alt = matrixmultiply_gflops(m, n, k, 5);
    println!("GEMM {m}x{n}x{k}, one thread: gemm crate {ours:.1} GFLOP/s, matrixmultiply {alt:.1} GFLOP/s ({:.2}x)", ours / alt);

    out.insert(
        "syncbn_overhead_mlp".into(),
        serde_json::json!({"world": ow, "local_ms": mloc.median_step_s * 1e3, "sync_ms": msyn.median_step_s * 1e3, "overhead": overhead_mlp}),
    );
    out.insert(
        "gemm".into(),
        serde_json::json!({"m": m, "n": n, "k": k, "gemm_gflops": ours, "matrixmultiply_gflops": alt}),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::mean_stderr;

    #[test]
    fn standard_error_of_the_mean_sbn_1() {
        // SBN-1: sample standard deviation (n - 1) over sqrt(n).
        let (m, se) = mean_stderr(&[0.80, 0.82, 0.84, 0.86]);
        assert!((m - 0.83).abs() < 1e-12);
        // sd = sqrt((0.03^2 + 0.01^2) * 2 / 3) = 0.0258199; / sqrt(4) = 0.0129099.
        assert!((se.unwrap() - 0.012_909_944_487_358_056).abs() < 1e-12);
        // One value: the mean, and no standard error (not 0).
        assert_eq!(mean_stderr(&[0.5]), (0.5, None));
        // Equal values: a standard error of exactly 0.
        assert_eq!(mean_stderr(&[0.25, 0.25, 0.25]).1, Some(0.0));
    }
}
