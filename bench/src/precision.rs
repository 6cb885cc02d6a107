//! `shardline-bench precision`: bf16 against f32 (`--param-dtype`, `--reduce-dtype`), per
//! model: the loss curves over several seeds, and per step the bytes a rank sends (the
//! lanes' counters, LANE-8), the conversion time and the step time.
//!
//! The check: the loss curves are cut into windows of `--window` steps (a window's mean
//! smooths the batch-to-batch noise); per window, f32's seed-to-seed spread is the band from
//! its lowest to its highest seed mean, and the bf16 curve (its seeds' mean) should lie in
//! the band.
//!
//! Invariant:
//! - PRECB-1: a window counts as inside when the bf16 seeds' mean of window means lies in
//!   [min, max] of the f32 seeds' window means; the report gives every window's band and
//!   bf16 value, so the verdict can be recomputed from the JSON.

use crate::report;
use serde::Serialize;
use shardline_runtime::engine::PrecisionDtype;
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{self, RunOptions, StageChoice, Summary, SyncBnMode, TrainConfig};
use std::path::PathBuf;

/// Flags of `shardline-bench precision`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Models to compare: mlp-bn (digits) and gpt (text: 2 layers, 2 heads, embd 64).
    #[arg(long, value_delimiter = ',', default_value = "mlp-bn,gpt")]
    pub models: Vec<String>,
    /// Seeds per precision.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
    pub seeds: Vec<u64>,
    /// Steps per run.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Ranks (threads).
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// ZeRO stage.
    #[arg(long, default_value_t = 3)]
    pub stage: u8,
    /// Steps per window of the check.
    #[arg(long, default_value_t = 20)]
    pub window: usize,
    /// The reduce dtype of the bf16 runs (default bf16, FSDP2's default for bf16 params).
    #[arg(long, default_value = "bf16", value_parser = parse_reduce)]
    pub reduce_dtype: PrecisionDtype,
    /// JSON output.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// SVG of the windowed loss curves (one file per model: NAME.svg becomes NAME-MODEL.svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

fn parse_reduce(s: &str) -> Result<PrecisionDtype, String> {
    PrecisionDtype::parse("--reduce-dtype", s)
}

/// One run's figures.
#[derive(Serialize, Debug, Clone)]
pub struct Run {
    /// `f32` or `bf16`.
    pub precision: String,
    /// Seed.
    pub seed: u64,
    /// Loss per step.
    pub losses: Vec<f32>,
    /// Median bytes rank 0 sent per step on the gather lane.
    pub gather_bytes: f64,
    /// Median bytes rank 0 sent per step on the reduce lane.
    pub reduce_bytes: f64,
    /// Median f32/bf16 conversion time per step, ms.
    pub cast_ms: f64,
    /// Median step time, ms.
    pub step_ms: f64,
    /// Test loss after training.
    pub test_loss: f32,
}

/// One window of the check (PRECB-1).
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Window {
    /// First step of the window (1-based).
    pub first_step: usize,
    /// Lowest f32 seed's window mean.
    pub f32_min: f64,
    /// Highest f32 seed's window mean.
    pub f32_max: f64,
    /// The bf16 seeds' mean of window means.
    pub bf16: f64,
    /// `bf16` within [f32_min, f32_max].
    pub inside: bool,
}

/// A model's comparison.
#[derive(Serialize, Debug)]
pub struct ModelReport {
    /// Model and size.
    pub model: String,
    /// Every run.
    pub runs: Vec<Run>,
    /// The windows (PRECB-1).
    pub windows: Vec<Window>,
    /// Windows inside the band.
    pub inside: usize,
}

/// The whole report.
#[derive(Serialize, Debug)]
pub struct Report {
    /// Ranks.
    pub world: usize,
    /// Stage.
    pub stage: u8,
    /// Steps per run.
    pub steps: u64,
    /// Per model.
    pub models: Vec<ModelReport>,
}

/// PRECB-1: the windows of `window` steps of the f32 curves' band and the bf16 seeds' mean.
pub fn windows(f32s: &[Vec<f32>], bf16s: &[Vec<f32>], window: usize) -> Vec<Window> {
    let len = f32s.iter().chain(bf16s).map(Vec::len).min().unwrap_or(0);
    let window = window.max(1);
    let mean = |c: &[f32], k: usize| -> f64 {
        c[k..k + window].iter().map(|&x| f64::from(x)).sum::<f64>() / window as f64
    };
    (0..len / window)
        .map(|w| {
            let k = w * window;
            let f: Vec<f64> = f32s.iter().map(|c| mean(c, k)).collect();
            let (f32_min, f32_max) =
                f.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            let bf16 = bf16s.iter().map(|c| mean(c, k)).sum::<f64>() / bf16s.len().max(1) as f64;
            Window {
                first_step: k + 1,
                f32_min,
                f32_max,
                bf16,
                inside: (f32_min..=f32_max).contains(&bf16),
            }
        })
        .collect()
}

fn config(a: &Args, model: &str, seed: u64, bf16: bool) -> anyhow::Result<TrainConfig> {
    let base = TrainConfig {
        world: a.world,
        stage: StageChoice::Fixed(Stage::from_index(a.stage)?),
        steps: Some(a.steps),
        seed,
        prefetch: 1,
        timeout_s: 120,
        param_dtype: if bf16 { PrecisionDtype::Bf16 } else { PrecisionDtype::F32 },
        reduce_dtype: Some(if bf16 { a.reduce_dtype } else { PrecisionDtype::F32 }),
        ..TrainConfig::default()
    };
    Ok(match model {
        "mlp-bn" => TrainConfig {
            model: "mlp-bn".into(),
            dataset: "digits".into(),
            hidden: Some(64),
            depth: Some(2),
            batch_size: 64,
            lr: 0.05,
            sync_bn: SyncBnMode::On,
            ..base
        },
        "gpt" => TrainConfig {
            model: "gpt".into(),
            dataset: "text".into(),
            n_layer: Some(2),
            n_head: Some(2),
            n_embd: Some(64),
            block_size: Some(64),
            batch_size: 16,
            optimizer: "adamw".into(),
            lr: 3e-3,
            warmup_steps: 10,
            ..base
        },
        other => {
            return Err(report::Usage(format!("--models: mlp-bn or gpt, not '{other}'")).into())
        }
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn figures(precision: &str, seed: u64, s: &Summary) -> Run {
    let med = |f: &dyn Fn(&shardline_runtime::engine::StepStats) -> f64| {
        median(s.step_stats.iter().skip(1).map(f).collect())
    };
    Run {
        precision: precision.into(),
        seed,
        losses: s.losses.clone(),
        gather_bytes: med(&|x| x.gather_bytes as f64),
        reduce_bytes: med(&|x| x.reduce_bytes as f64),
        cast_ms: med(&|x| x.cast_time.as_secs_f64() * 1e3),
        step_ms: med(&|x| x.step_time.as_secs_f64() * 1e3),
        test_loss: s.test_loss,
    }
}

/// Runs the comparison.
pub fn run(a: Args) -> anyhow::Result<()> {
    report::check_flags(!a.seeds.is_empty(), || "--seeds needs at least one seed".into())?;
    report::check_flags(a.window >= 1 && a.window as u64 <= a.steps, || {
        format!("--window {} must be in 1..=--steps {}", a.window, a.steps)
    })?;
    let mut models = Vec::new();
    for model in &a.models {
        let mut runs = Vec::new();
        for bf16 in [false, true] {
            let name = if bf16 { "bf16" } else { "f32" };
            for &seed in &a.seeds {
                let cfg = config(&a, model, seed, bf16)?;
                let label = cfg.precision_label();
                let opts = RunOptions { quiet: true, ..RunOptions::default() };
                let s = train::run(cfg, opts)?;
                let r = figures(name, seed, &s);
                println!(
                    "{model} {label} seed {seed}: loss {:.4} -> {:.4} (test {:.4}), step {:.1} ms, \
                     cast {:.2} ms, sent/step gather {} + reduce {}",
                    r.losses[0],
                    r.losses.last().copied().unwrap_or(f32::NAN),
                    r.test_loss,
                    r.step_ms,
                    r.cast_ms,
                    report::human_bytes(r.gather_bytes),
                    report::human_bytes(r.reduce_bytes)
                );
                runs.push(r);
            }
        }
        let curves = |p: &str| -> Vec<Vec<f32>> {
            runs.iter().filter(|r| r.precision == p).map(|r| r.losses.clone()).collect()
        };
        let ws = windows(&curves("f32"), &curves("bf16"), a.window);
        let inside = ws.iter().filter(|w| w.inside).count();
        println!(
            "{model}: windows of {} steps (f32 band over seeds | bf16 seeds' mean):",
            a.window
        );
        for w in &ws {
            println!(
                "  steps {:>4}..{:<4} f32 [{:.4}, {:.4}]  bf16 {:.4}  {}",
                w.first_step,
                w.first_step + a.window - 1,
                w.f32_min,
                w.f32_max,
                w.bf16,
                if w.inside { "inside" } else { "OUTSIDE" }
            );
        }
        println!(
            "{model}: bf16 inside f32's seed-to-seed spread in {inside} of {} windows",
            ws.len()
        );
        if let Some(p) = &a.plot {
            let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or("precision");
            let path = p.with_file_name(format!("{stem}-{model}.svg"));
            let series: Vec<report::Series> = runs
                .iter()
                .map(|r| report::Series {
                    label: format!("{} seed {}", r.precision, r.seed),
                    points: r
                        .losses
                        .chunks(a.window)
                        .enumerate()
                        .map(|(i, c)| {
                            let m = c.iter().map(|&x| f64::from(x)).sum::<f64>() / c.len() as f64;
                            ((i * a.window + 1) as f64, m)
                        })
                        .collect(),
                })
                .collect();
            let title = format!("{model}: loss per {}-step window, f32 vs bf16", a.window);
            report::plot_lines(&path, &title, "step", "loss", &series, false)?;
            println!("plot: {}", path.display());
        }
        models.push(ModelReport { model: model.clone(), runs, windows: ws, inside });
    }
    if let Some(p) = &a.json {
        report::write_json(p, &Report { world: a.world, stage: a.stage, steps: a.steps, models })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PRECB-1: the band is the f32 seeds' extremes per window, bf16 is its seeds' mean, a
    /// value on the edge is inside, and a trailing partial window is left out.
    #[test]
    fn precb1_windows_band_and_mean() {
        let f = vec![vec![1.0, 3.0, 5.0, 5.0, 9.0], vec![3.0, 3.0, 4.0, 4.0, 0.0]];
        let b = vec![vec![2.0, 2.0, 6.0, 6.0, 1.0], vec![4.0, 4.0, 6.0, 6.0, 1.0]];
        let w = windows(&f, &b, 2);
        assert_eq!(w.len(), 2);
        assert_eq!((w[0].f32_min, w[0].f32_max, w[0].bf16), (2.0, 3.0, 3.0));
        assert!(w[0].inside, "on the edge is inside");
        assert_eq!((w[1].first_step, w[1].f32_min, w[1].f32_max, w[1].bf16), (3, 4.0, 5.0, 6.0));
        assert!(!w[1].inside);
    }
}
