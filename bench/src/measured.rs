//! `shardline-bench memory-measured`: the peak the runtime's `MemoryTracker` accounts next to
//! the peak measured independently, per rank, for each model, world size and stage.
//!
//! Each rank is a process of its own (this binary's hidden `memory-rank` subcommand, in a
//! torchrun-style environment; rank 0 hosts the store), so the counting allocator
//! ([`crate::alloc`]) measures exactly that rank. The baseline, subtracted from the measured
//! peak, is what the process holds once the job is planned (data set loaded, model
//! described) and before the rank joins the job: the transport, engine and model state all
//! come after it. What the measured peak holds beyond the accounted one is what the tracker
//! misses (layers' scratch, evaluation, collective staging, runtime bookkeeping).
//!
//! Invariants:
//! - MEAS-1: a row's measured figure is `peak - baseline` of the rank's own process, the
//!   peak being taken from the baseline on (the allocator's peak is reset there).
//! - MEAS-2: the accounted peak never exceeds the measured one: every byte the tracker
//!   registers is a heap block the rank's process holds at that moment (a tracker counting
//!   bytes nobody allocated fails this).

use crate::alloc;
use crate::report;
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use shardline_runtime::engine::Recompute;
use shardline_runtime::launch::{run_worker_planned, WorkerEnv};
use shardline_runtime::memory::format_bytes;
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{self, RunOptions, StageChoice, SyncBnMode, TrainConfig};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Flags of `shardline-bench memory-measured`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Models, comma-separated: mlp-bn, convnet-bn (digits), gpt (bundled text, 2 layers,
    /// embd 64, block 32), resnet-bn (digits as 1x8x8 images, width 8).
    #[arg(long, value_delimiter = ',', default_value = "mlp-bn,convnet-bn,gpt,resnet-bn")]
    pub models: Vec<String>,
    /// World sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    pub world: Vec<usize>,
    /// ZeRO stages, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3")]
    pub stage: Vec<u8>,
    /// Recompute choices, comma-separated: none, units (`--recompute`).
    #[arg(long, value_delimiter = ',', default_value = "none,units")]
    pub recompute: Vec<String>,
    /// Training steps per run.
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    /// Global batch.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Seconds each run may take before its processes are killed.
    #[arg(long, default_value_t = 300)]
    pub deadline_s: u64,
    /// Write the rows as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Flags of the hidden per-rank worker.
#[derive(clap::Args, Debug)]
pub struct RankArgs {
    /// The job's `TrainConfig` as JSON.
    #[arg(long)]
    pub config: String,
}

/// What one rank reports (one JSON line on its stdout).
#[derive(Debug, Serialize, Deserialize)]
pub struct RankReport {
    /// Rank.
    pub rank: usize,
    /// The tracker's peak over the run.
    pub accounted_bytes: u64,
    /// The tracker's peak of each category.
    pub accounted_by_category: Vec<(String, u64)>,
    /// The counting allocator's peak minus the baseline (MEAS-1).
    pub measured_bytes: u64,
    /// Heap bytes held when the job was planned.
    pub baseline_bytes: u64,
}

/// One row of the table.
#[derive(Debug, Serialize)]
pub struct Row {
    /// Model name.
    pub model: String,
    /// Ranks.
    pub world: usize,
    /// ZeRO stage.
    pub stage: u8,
    /// `--recompute`.
    pub recompute: String,
    /// What the rank reported.
    #[serde(flatten)]
    pub report: RankReport,
    /// measured / accounted.
    pub ratio: f64,
}

fn config(
    a: &Args,
    model: &str,
    world: usize,
    (stage, recompute): (u8, &str),
) -> anyhow::Result<TrainConfig> {
    let recompute = match recompute {
        "none" => Recompute::None,
        "units" => Recompute::Units,
        other => bail!("--recompute: unknown choice '{other}' (none, units)"),
    };
    let mut cfg = TrainConfig {
        world,
        stage: StageChoice::Fixed(Stage::from_index(stage)?),
        model: model.into(),
        dataset: "digits".into(),
        steps: Some(a.steps),
        batch_size: a.batch_size,
        sync_bn: SyncBnMode::On,
        recompute,
        timeout_s: 120,
        ..TrainConfig::default()
    };
    match model {
        "gpt" => {
            cfg.dataset = "text".into();
            cfg.optimizer = "adamw".into();
            cfg.lr = 1e-3;
            (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size) =
                (Some(2), Some(4), Some(64), Some(32));
        }
        "resnet-bn" => cfg.width = Some(8),
        "mlp-bn" | "convnet-bn" => {}
        other => bail!("--models: unknown model '{other}' (mlp-bn, convnet-bn, gpt, resnet-bn)"),
    }
    Ok(cfg)
}

/// The hidden worker: plans, takes the baseline, runs its rank, prints its report.
pub fn rank(a: RankArgs) -> anyhow::Result<()> {
    let env = WorkerEnv::from_env()?.context("memory-rank needs a launch environment")?;
    let mut cfg: TrainConfig = serde_json::from_str(&a.config).context("--config")?;
    cfg.world = env.world;
    let plan = train::plan(&cfg)?;
    // MEAS-1: the baseline and the start of the peak.
    let baseline = alloc::live();
    alloc::reset_peak();
    let opts = RunOptions { quiet: true, skip_final_params: true, ..RunOptions::default() };
    let s = run_worker_planned(cfg, opts, &env, plan)?;
    let measured = alloc::peak().saturating_sub(baseline);
    let report = RankReport {
        rank: env.rank,
        accounted_bytes: s.peak_bytes.first().copied().unwrap_or(0),
        accounted_by_category: s.peak_by_category.first().cloned().unwrap_or_default(),
        measured_bytes: measured,
        baseline_bytes: baseline,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs one job as `world` processes of this binary and collects their reports.
fn run_job(cfg: &TrainConfig, deadline: Duration) -> anyhow::Result<Vec<RankReport>> {
    let exe = std::env::current_exe()?;
    let json = serde_json::to_string(cfg)?;
    let port = free_port()?.to_string();
    let job = format!("memmeas{}x{}", std::process::id(), port);
    let world = cfg.world.to_string();
    let mut children = Vec::new();
    for r in 0..cfg.world {
        let child = Command::new(&exe)
            .args(["memory-rank", "--config", &json])
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", &world)
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", &world)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("SHARDLINE_TOKEN", &job)
            .env("SHARDLINE_JOB", &job)
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting a rank process")?;
        children.push(child);
    }
    // Every rank must finish before the deadline; otherwise all are killed.
    let t0 = Instant::now();
    loop {
        let mut running = 0;
        for c in &mut children {
            if c.try_wait()?.is_none() {
                running += 1;
            }
        }
        if running == 0 {
            break;
        }
        if t0.elapsed() > deadline {
            for c in &mut children {
                let _ = c.kill();
            }
            bail!("ranks still running after {} s: killed", deadline.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut reports = Vec::new();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "rank {r} exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let line = stdout.lines().last().unwrap_or_default();
        reports.push(
            serde_json::from_str(line).with_context(|| format!("rank {r} printed {line:?}"))?,
        );
    }
    Ok(reports)
}

/// Runs the comparison.
pub fn run(a: Args) -> anyhow::Result<()> {
    report::check_flags(!a.world.is_empty() && a.world.iter().all(|&w| w > 0), || {
        "--world must be at least 1".into()
    })?;
    report::check_flags(a.stage.iter().all(|&s| s <= 3), || "--stage takes 0, 1, 2, 3".into())?;
    report::check_flags(a.steps > 0, || "--steps must be at least 1".into())?;
    let known = ["mlp-bn", "convnet-bn", "gpt", "resnet-bn"];
    if let Some(m) = a.models.iter().find(|m| !known.contains(&m.as_str())) {
        report::check_flags(false, || {
            format!("--models: unknown model '{m}' ({})", known.join(", "))
        })?;
    }
    if let Some(r) = a.recompute.iter().find(|r| !["none", "units"].contains(&r.as_str())) {
        report::check_flags(false, || format!("--recompute takes none, units, not '{r}'"))?;
    }
    println!(
        "shardline-bench memory-measured: accounted (MemoryTracker) against measured (counting allocator, one process per rank, minus the heap held once the job is planned); global batch {}, {} steps, SyncBN on",
        a.batch_size, a.steps
    );
    println!(
        "{:<10} {:>5} {:>5} {:>9} {:>4} {:>11} {:>11} {:>7} {:>11}  accounted categories",
        "model",
        "world",
        "stage",
        "recompute",
        "rank",
        "accounted",
        "measured",
        "ratio",
        "baseline"
    );
    let mut rows = Vec::new();
    for model in &a.models {
        for &world in &a.world {
            for (&stage, rec) in
                a.stage.iter().flat_map(|s| a.recompute.iter().map(move |r| (s, r)))
            {
                let cfg = config(&a, model, world, (stage, rec))?;
                let reports =
                    run_job(&cfg, Duration::from_secs(a.deadline_s)).with_context(|| {
                        format!("{model} world {world} stage {stage} recompute {rec}")
                    })?;
                for r in reports {
                    let ratio = r.measured_bytes as f64 / r.accounted_bytes.max(1) as f64;
                    let mut cats: Vec<&(String, u64)> =
                        r.accounted_by_category.iter().filter(|c| c.1 > 0).collect();
                    cats.sort_by_key(|c| std::cmp::Reverse(c.1));
                    let cats: Vec<String> = cats
                        .iter()
                        .take(4)
                        .map(|(k, b)| format!("{k} {}", format_bytes(*b)))
                        .collect();
                    println!(
                        "{:<10} {:>5} {:>5} {:>9} {:>4} {:>11} {:>11} {:>7.3} {:>11}  {}",
                        model,
                        world,
                        stage,
                        rec,
                        r.rank,
                        format_bytes(r.accounted_bytes),
                        format_bytes(r.measured_bytes),
                        ratio,
                        format_bytes(r.baseline_bytes),
                        cats.join(", ")
                    );
                    let recompute = rec.clone();
                    rows.push(Row {
                        model: model.clone(),
                        world,
                        stage,
                        recompute,
                        report: r,
                        ratio,
                    });
                }
            }
        }
    }
    let within = rows.iter().filter(|r| (r.ratio - 1.0).abs() <= 0.05).count();
    println!("{within} of {} rank rows: accounted within 5% of measured", rows.len());
    if let Some(p) = &a.json {
        report::write_json(
            p,
            &serde_json::json!({ "steps": a.steps, "batch_size": a.batch_size, "rows": rows }),
        )?;
        println!("wrote {}", p.display());
    }
    Ok(())
}
