//! `shardline-bench ckpt-stall`: how long the step loop stands still for each checkpoint,
//! synchronous against asynchronous (`--async-checkpoint`, DRIVE-4..6), the same job run
//! both ways in alternating rounds of one invocation. A synchronous save holds the loop for
//! the whole write and commit; an asynchronous one for the snapshot at the step boundary
//! and for whatever of its write is still running when the next save (or the run's end)
//! waits for it. The run's wall time is reported beside it: the writer thread competes with
//! the steps for this host's cores.

use crate::report;
use serde::Serialize;
use shardline_runtime::driver::CheckpointStall;
use shardline_runtime::train::StageChoice;
use shardline_runtime::train::{self, RunOptions, TrainConfig};
use std::path::PathBuf;

/// Flags of `shardline-bench ckpt-stall`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model: gpt (4 layers, width 128, AdamW) or wide-mlp (--params, AdamW).
    #[arg(long, default_value = "gpt")]
    pub model: String,
    /// wide-mlp's parameter count.
    #[arg(long, default_value_t = 8_000_000)]
    pub params: usize,
    /// Ranks, as threads of this process.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Steps per run.
    #[arg(long, default_value_t = 40)]
    pub steps: u64,
    /// Checkpoint every N steps (and at the end).
    #[arg(long, default_value_t = 5)]
    pub every: u64,
    /// Rounds; each runs the job synchronously, then asynchronously.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Where the checkpoints go (a fresh directory per run inside it) [default: the system's
    /// temporary directory].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Write the figures as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One run's figures.
#[derive(Serialize, Debug)]
struct Run {
    round: usize,
    mode: &'static str,
    /// Every checkpoint of the run, in step order.
    stalls: Vec<CheckpointStall>,
    median_step_s: f64,
    wall_s: f64,
    final_loss: f32,
}

/// The figures of one mode over every round.
#[derive(Serialize, Debug)]
struct Mode {
    mode: &'static str,
    checkpoints: usize,
    /// Median over the checkpoints before the last of each run: the loop's stall per
    /// checkpoint during training.
    median_blocked_s: f64,
    max_blocked_s: f64,
    median_boundary_s: f64,
    median_waited_s: f64,
    /// Median of the run's last checkpoint (asynchronous: the end waits for its commit,
    /// which overlapped the evaluation).
    median_final_blocked_s: f64,
    median_step_s: f64,
    median_wall_s: f64,
}

#[derive(Serialize, Debug)]
struct Report {
    model: String,
    params: Option<usize>,
    world: usize,
    steps: u64,
    every: u64,
    rounds: usize,
    checkpoint_bytes: u64,
    modes: Vec<Mode>,
    runs: Vec<Run>,
}

fn config(a: &Args) -> anyhow::Result<TrainConfig> {
    let base = TrainConfig {
        world: a.world,
        stage: StageChoice::Fixed(shardline_runtime::Stage::Zero3),
        steps: Some(a.steps),
        optimizer: "adamw".into(),
        lr: 1e-3,
        seed: 1,
        ..TrainConfig::default()
    };
    Ok(match a.model.as_str() {
        "gpt" => TrainConfig {
            model: "gpt".into(),
            dataset: "text".into(),
            n_layer: Some(4),
            n_head: Some(4),
            n_embd: Some(128),
            block_size: Some(64),
            batch_size: 16,
            ..base
        },
        "wide-mlp" => TrainConfig {
            model: "wide-mlp".into(),
            dataset: "synthetic".into(),
            params: a.params,
            batch_size: 32,
            ..base
        },
        other => return Err(report::Usage(format!("--model {other}: gpt or wide-mlp")).into()),
    })
}

fn median(v: impl IntoIterator<Item = f64>) -> f64 {
    train::median(&mut v.into_iter().collect::<Vec<_>>())
}

/// Bytes of a committed checkpoint directory's files.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|es| es.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// Runs the benchmark.
pub fn run(a: Args) -> anyhow::Result<()> {
    report::check_flags(a.world >= 1, || "--world must be at least 1".into())?;
    report::check_flags(a.every >= 1 && a.every < a.steps, || {
        format!("--every {} must be at least 1 and below --steps {}", a.every, a.steps)
    })?;
    report::check_flags(a.rounds >= 1, || "--rounds must be at least 1".into())?;
    let cfg = config(&a)?;
    let root = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&root)?;
    let (mut runs, mut checkpoint_bytes) = (Vec::new(), 0);
    for round in 0..a.rounds {
        for (mode, background) in [("sync", false), ("async", true)] {
            let dir = tempfile_in(&root)?;
            let opts = RunOptions {
                checkpoint_dir: Some(dir.path().to_path_buf()),
                checkpoint_every: a.every,
                async_checkpoint: background,
                quiet: true,
                skip_final_params: true,
                ..RunOptions::default()
            };
            let s = train::run(cfg.clone(), opts)?;
            let last = shardline_runtime::checkpoint::latest(dir.path())?;
            checkpoint_bytes = last.as_deref().map(dir_bytes).unwrap_or(0);
            let blocked: Vec<String> =
                s.checkpoint_stalls.iter().map(|c| format!("{:.1}", c.blocked_s() * 1e3)).collect();
            println!(
                "round {round} {mode:5}: blocked per checkpoint (ms) [{}], median step {:.1} ms, \
                 wall {:.2} s",
                blocked.join(", "),
                s.median_step_s * 1e3,
                s.wall_s
            );
            runs.push(Run {
                round,
                mode,
                stalls: s.checkpoint_stalls,
                median_step_s: s.median_step_s,
                wall_s: s.wall_s,
                final_loss: s.final_loss,
            });
        }
    }
    let modes: Vec<Mode> = ["sync", "async"]
        .into_iter()
        .map(|mode| {
            let of: Vec<&Run> = runs.iter().filter(|r| r.mode == mode).collect();
            // Every checkpoint but each run's last.
            let during = || of.iter().flat_map(|r| &r.stalls[..r.stalls.len().saturating_sub(1)]);
            Mode {
                mode,
                checkpoints: of.iter().map(|r| r.stalls.len()).sum(),
                median_blocked_s: median(during().map(|c| c.blocked_s())),
                max_blocked_s: during().map(|c| c.blocked_s()).fold(0.0, f64::max),
                median_boundary_s: median(during().map(|c| c.boundary_s)),
                median_waited_s: median(during().map(|c| c.waited_s)),
                median_final_blocked_s: median(
                    of.iter().filter_map(|r| r.stalls.last()).map(|c| c.blocked_s()),
                ),
                median_step_s: median(of.iter().map(|r| r.median_step_s)),
                median_wall_s: median(of.iter().map(|r| r.wall_s)),
            }
        })
        .collect();
    println!(
        "\n{} world {} stage 3 AdamW, {} steps, a checkpoint every {} ({}), {} round(s)",
        a.model,
        a.world,
        a.steps,
        a.every,
        report::human_bytes(checkpoint_bytes as f64),
        a.rounds
    );
    println!(
        "{:6} {:>12} {:>10} {:>12} {:>10} {:>12} {:>10} {:>9}",
        "mode", "blocked/ckpt", "max", "at boundary", "waiting", "last ckpt", "step", "wall"
    );
    for m in &modes {
        println!(
            "{:6} {:>9.1} ms {:>7.1} ms {:>9.1} ms {:>7.1} ms {:>9.1} ms {:>7.1} ms {:>7.2} s",
            m.mode,
            m.median_blocked_s * 1e3,
            m.max_blocked_s * 1e3,
            m.median_boundary_s * 1e3,
            m.median_waited_s * 1e3,
            m.median_final_blocked_s * 1e3,
            m.median_step_s * 1e3,
            m.median_wall_s
        );
    }
    if let Some(p) = &a.json {
        let rep = Report {
            model: a.model.clone(),
            params: (a.model == "wide-mlp").then_some(a.params),
            world: a.world,
            steps: a.steps,
            every: a.every,
            rounds: a.rounds,
            checkpoint_bytes,
            modes,
            runs,
        };
        report::write_json(p, &rep)?;
        println!("wrote {}", p.display());
    }
    Ok(())
}

/// A fresh directory under `root`, removed when dropped.
fn tempfile_in(root: &std::path::Path) -> anyhow::Result<TempDir> {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let path = root.join(format!("ckpt-stall-{}-{n}", std::process::id()));
    std::fs::create_dir(&path)?;
    Ok(TempDir(path))
}

struct TempDir(PathBuf);

impl TempDir {
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
