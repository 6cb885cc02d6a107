//! `shardline-bench overlap`: how much of stage 3's communication the schedule hides.
//!
//! In one process, stage 3, for each prefetch depth (default 0, 1, 2): per step the compute
//! time, the communication time (the union of the spans in which a collective was in flight
//! on a rank), the step time and the exposed communication (time a rank was blocked waiting),
//! as medians over the steps after a warmup. Threads exchange memory far faster than a
//! network would, so the local transport's links are capped (`--link-rate`, or chosen from a
//! calibration run so that the communication takes about `--comm-ratio` of the compute).
//!
//! The goal: with prefetch 1, exposed communication at most 10% of the step time
//! where communication time <= compute time; prefetch 0 is printed beside it. `--timeline
//! FILE.svg` draws one step per rank (rows compute, gather, reduce, stats) from the run's
//! trace.
//!
//! `--nodes N --link-rate R` (root) measures over a real network instead: N network-namespace
//! nodes (the test harness's [`shardline_tests::netns`]) whose links are shaped to R by
//! `tc ... tbf`, `shardline launch` in each with `--nproc-per-node` workers (shm inside a
//! node, TCP across), one job per prefetch depth with `--log-json` and `--trace`. Per rank and
//! step the figures come from the workers' traces (OVL-1); the CPU per step and the wire time
//! are floors under the step (OVL-2, OVL-3). The in-flight union reads lower than the wire
//! time on a shaped link (a peer's bytes can cross before this rank's op begins), so the check
//! takes communication as //! the larger of the two: prefetch 1's step time within 1.15x max(compute, communication)
//! where the two are comparable (ratio within [0.5, 2]). Then busbw of all-reduce, reduce-scatter and
//! all-gather over the same shaped links (`collectives --nodes`), against the link rate.
//!
//! Invariants:
//! - OVL-1: the step is the span between two optimizer ends on a rank's trace; compute is the
//!   forward, backward and optimizer spans in it, exposed the blocked waits, communication the
//!   union of the collectives' spans clipped to the step; per step the slowest rank's step
//!   time and the mean over ranks of the rest; medians over the steps after the warmup.
//! - OVL-2: the `optimizer` marks carry the process's CPU time, so each rank's CPU per step is
//!   known; the ranks' CPU per step together over the machine's cores is a floor under the
//!   step while they share those cores (the network stack's work included).
//! - OVL-3: collective spans on the trace carry their buffer's size, so the bytes each rank
//!   sends per step are counted (ring factors), and their time at the link rate alone (the
//!   wire time) is a floor under the step's communication.

use crate::report;
use anyhow::Context;
use plotters::prelude::*;
use serde::Serialize;
use shardline_runtime::engine::{GatherDtype, PrecisionDtype};
use shardline_runtime::shard::{ShardedModelLayout, Stage};
use shardline_runtime::train::{
    self, build_model, load_data, RunOptions, StageChoice, SyncBnMode, TrainConfig,
};
use shardline_tests::process;
use std::path::{Path, PathBuf};

mod draw;
mod nodes;
mod trace;

use draw::*;
use nodes::*;
use trace::*;

/// Flags of `shardline-bench overlap`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Ranks (threads of this process).
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Prefetch depths to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
    pub prefetch: Vec<usize>,
    /// mlp-bn hidden width.
    #[arg(long, default_value_t = 1024)]
    pub hidden: usize,
    /// mlp-bn hidden blocks.
    #[arg(long, default_value_t = 4)]
    pub depth: usize,
    /// Synthetic input features.
    #[arg(long, default_value_t = 784)]
    pub input_dim: usize,
    /// Synthetic classes.
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// Global batch size.
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Steps per run (the first `--warmup` are not counted).
    #[arg(long, default_value_t = 16)]
    pub steps: u64,
    /// Warmup steps left out of the medians.
    #[arg(long, default_value_t = 4)]
    pub warmup: u64,
    /// Per-link bandwidth (e.g. 1gbit, 400MB/s); default: chosen from a calibration run so
    /// that communication takes about `--comm-ratio` of the compute time.
    #[arg(long, value_parser = shardline_collectives::config::parse_rate)]
    pub link_rate: Option<u64>,
    /// Target communication / compute ratio when choosing the link rate.
    #[arg(long, default_value_t = 0.7)]
    pub comm_ratio: f64,
    /// Compute threads per rank.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Byte budget for gathered units, passed to `train --prefetch-budget` (default: the
    /// trainer's, (prefetch+1) x the largest unit).
    #[arg(long, value_parser = report::parse_bytes)]
    pub prefetch_budget: Option<u64>,
    /// JSON output.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// SVG timeline of one step per rank (of the `--timeline-prefetch` run).
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Which prefetch depth's run the timeline shows.
    #[arg(long, default_value_t = 1)]
    pub timeline_prefetch: usize,
    /// Run across this many network-namespace nodes with `shardline launch`, links shaped to
    /// --link-rate (needs root; --world is then nodes x --nproc-per-node).
    #[arg(long)]
    pub nodes: Option<usize>,
    /// Worker processes per node with --nodes.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Buffer sizes of the busbw measurement with --nodes (`--busbw-sizes` with no value
    /// skips it).
    #[arg(long, value_delimiter = ',', default_value = "1M,16M,64M", num_args = 0..,
          value_parser = report::parse_bytes)]
    pub busbw_sizes: Vec<u64>,
    /// Timed iterations per busbw size.
    #[arg(long, default_value_t = 3)]
    pub busbw_iters: usize,
    /// Keep the workers' logs and traces in this directory (default: a temporary one).
    #[arg(long)]
    pub keep_dir: Option<PathBuf>,
    /// `train --param-dtype`: f32 or bf16 (bf16 gathers half the bytes, PREC-3).
    #[arg(long, default_value = "f32", value_parser = parse_param_dtype)]
    pub param_dtype: PrecisionDtype,
    /// `train --reduce-dtype` [default: the --param-dtype].
    #[arg(long, value_parser = parse_reduce_dtype)]
    pub reduce_dtype: Option<PrecisionDtype>,
    /// `train --gather-dtype`: int8 or fp8 quantized parameter gathers (QGATHER-1)
    /// [default: the --param-dtype].
    #[arg(long, value_parser = parse_gather_dtype)]
    pub gather_dtype: Option<GatherDtype>,
    /// With --nodes: `train --shard-group` (N, node or world) [default: train's, world].
    #[arg(long)]
    pub shard_group: Option<String>,
    /// With --nodes: `train --cross-node-reduce-dtype` (int8 or fp8; needs --shard-group).
    #[arg(long, value_parser = parse_gather_dtype)]
    pub cross_node_reduce_dtype: Option<GatherDtype>,
    /// With --nodes: `train --seed`.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// With --nodes: one more flag or value passed to `train` as it is (repeatable, e.g.
    /// --train-arg=--reshard-after-forward --train-arg=node).
    #[arg(long = "train-arg", allow_hyphen_values = true)]
    pub train_args: Vec<String>,
}

fn parse_gather_dtype(s: &str) -> Result<GatherDtype, String> {
    GatherDtype::parse("--gather-dtype", s)
}

fn parse_param_dtype(s: &str) -> Result<PrecisionDtype, String> {
    PrecisionDtype::parse("--param-dtype", s)
}

fn parse_reduce_dtype(s: &str) -> Result<PrecisionDtype, String> {
    PrecisionDtype::parse("--reduce-dtype", s)
}

/// One prefetch depth's figures (medians over the counted steps, milliseconds; means over
/// ranks where the ranks differ, step time the slowest rank's).
#[derive(Serialize, Clone, Debug)]
pub struct Row {
    /// Prefetch depth.
    pub prefetch: usize,
    /// Compute time per step.
    pub compute_ms: f64,
    /// Communication time per step (collectives in flight).
    pub comm_ms: f64,
    /// Step time.
    pub step_ms: f64,
    /// Exposed (blocked) communication per step.
    pub exposed_ms: f64,
    /// Exposed communication as a percentage of step time (median of the per-step ratios).
    pub exposed_pct: f64,
    /// Communication time over compute time.
    pub comm_over_compute: f64,
    /// Steps counted.
    pub steps: usize,
    /// With --nodes: rank 0's own median step time from its `--log-json`, ms (a cross-check
    /// of the trace-derived figures).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank0_log_step_ms: Option<f64>,
    /// With --nodes: rank 0's median exposed communication from its `--log-json`, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank0_log_exposed_ms: Option<f64>,
    /// With --nodes: rank 0's median payload bytes sent per step on the gather, reduce and
    /// replica lanes, from its `--log-json` (the lanes' counters, LANE-8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank0_sent_bytes: Option<f64>,
    /// With --nodes: CPU time per step of one rank's process (every thread, user + system;
    /// mean over ranks), ms (OVL-2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_ms: Option<f64>,
    /// With --nodes: the ranks' CPU per step together over this machine's cores, ms: no step
    /// can be shorter while the ranks share these cores (OVL-2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_floor_ms: Option<f64>,
    /// With --nodes: bytes one rank sends per step, from the collectives on its trace
    /// (OVL-3; mean over ranks of the per-step medians).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wire_bytes: Option<f64>,
    /// With --nodes: `wire_bytes` at the link rate alone, ms: the least time the step's
    /// communication can take on the shaped link.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wire_ms: Option<f64>,
    /// With --nodes: bytes sent across nodes per rank and step, measured at the nodes'
    /// interfaces over the whole job (LINKB-1) and divided by its steps and ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inter_node_bytes: Option<f64>,
    /// With --nodes: the loss of the job's last step (rank 0's `--log-json`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_loss: Option<f64>,
}

/// The whole report.
#[derive(Serialize, Debug)]
pub struct Report {
    /// Ranks.
    pub world: usize,
    /// Model description.
    pub model: String,
    /// Global batch.
    pub batch_size: usize,
    /// Link rate used, bytes/s.
    pub link_rate: u64,
    /// Whether the rate came from the calibration.
    pub link_rate_calibrated: bool,
    /// Bytes each directed link carries per step (two all-gathers and one reduce-scatter of
    /// every unit, ring).
    pub bytes_per_link_per_step: u64,
    /// Least compute time of a step in the calibration run (unlimited links), ms.
    pub calibration_compute_ms: Option<f64>,
    /// Per prefetch depth.
    pub rows: Vec<Row>,
    /// The goal check on prefetch 1.
    pub goal: Option<Goal>,
}

/// The goal on prefetch 1.
#[derive(Serialize, Debug)]
pub struct Goal {
    /// Prefetch 1's exposed communication, % of step time.
    pub prefetch1_exposed_pct: f64,
    /// Prefetch 0's, for comparison (if measured).
    pub prefetch0_exposed_pct: Option<f64>,
    /// Whether communication time <= compute time held for prefetch 1 (the goal's premise).
    pub comm_le_compute: bool,
    /// Exposed <= 10% of step time.
    pub met: bool,
}

fn config(a: &Args, prefetch: usize, rate: Option<u64>, steps: u64) -> TrainConfig {
    TrainConfig {
        world: a.world,
        stage: StageChoice::Fixed(Stage::Zero3),
        model: "mlp-bn".into(),
        dataset: "synthetic".into(),
        hidden: Some(a.hidden),
        depth: Some(a.depth),
        input_dim: a.input_dim,
        classes: a.classes,
        samples: (a.batch_size * steps as usize).max(a.batch_size),
        steps: Some(steps),
        batch_size: a.batch_size,
        lr: 0.01,
        sync_bn: SyncBnMode::Auto,
        prefetch,
        threads: a.threads,
        timeout_s: 120,
        link_rate: rate,
        prefetch_budget: a.prefetch_budget,
        param_dtype: a.param_dtype,
        reduce_dtype: a.reduce_dtype,
        gather_dtype: a.gather_dtype,
        ..TrainConfig::default()
    }
}

/// Per-step figures from `--log-json` lines: (step, compute, comm, exposed) in seconds.
fn read_log(path: &Path) -> anyhow::Result<Vec<[f64; 4]>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let f = |k: &str| v[k].as_f64().ok_or_else(|| anyhow::anyhow!("log line without {k}: {v}"));
        out.push([f("step_time_s")?, f("compute_s")?, f("comm_s")?, f("comm_exposed_s")?]);
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

struct RunOut {
    row: Row,
    trace: PathBuf,
    /// The least compute time of a counted step, ms: the calibration's estimate of compute
    /// undisturbed by the other users of the machine.
    min_compute_ms: f64,
}

fn run_one(
    a: &Args,
    prefetch: usize,
    rate: Option<u64>,
    steps: u64,
    dir: &Path,
) -> anyhow::Result<RunOut> {
    let log = dir.join(format!("p{prefetch}-{}.jsonl", rate.unwrap_or(0)));
    let trace = dir.join(format!("p{prefetch}-{}.trace.json", rate.unwrap_or(0)));
    let _ = std::fs::remove_file(&log);
    let opts = RunOptions {
        log_json: Some(log.clone()),
        trace: Some(trace.clone()),
        quiet: true,
        progress: false,
        ..RunOptions::default()
    };
    train::run(config(a, prefetch, rate, steps), opts)?;
    let per_step = read_log(&log)?;
    let counted: Vec<[f64; 4]> = per_step.into_iter().skip(a.warmup as usize).collect();
    if counted.is_empty() {
        anyhow::bail!("no steps left after {} warmup steps (use --steps)", a.warmup);
    }
    let col = |i: usize| median(counted.iter().map(|s| s[i] * 1e3).collect());
    let (step_ms, compute_ms, comm_ms, exposed_ms) = (col(0), col(1), col(2), col(3));
    let exposed_pct = median(counted.iter().map(|s| 100.0 * s[3] / s[0].max(1e-12)).collect());
    let min_compute_ms = counted.iter().map(|s| s[1] * 1e3).fold(f64::MAX, f64::min);
    Ok(RunOut {
        min_compute_ms,
        row: Row {
            prefetch,
            compute_ms,
            comm_ms,
            step_ms,
            exposed_ms,
            exposed_pct,
            comm_over_compute: comm_ms / compute_ms.max(1e-9),
            steps: counted.len(),
            rank0_log_step_ms: None,
            rank0_log_exposed_ms: None,
            rank0_sent_bytes: None,
            inter_node_bytes: None,
            final_loss: None,
            cpu_ms: None,
            cpu_floor_ms: None,
            wire_bytes: None,
            wire_ms: None,
        },
        trace,
    })
}

/// Runs the benchmark.
pub fn run(a: Args) -> anyhow::Result<()> {
    report::check_flags(a.world >= 2, || {
        "--world must be at least 2 (one rank has nothing to communicate)".into()
    })?;
    report::check_flags(!a.prefetch.is_empty(), || "--prefetch needs at least one depth".into())?;
    report::check_flags(a.steps > a.warmup, || {
        format!(
            "--steps ({}) must be larger than --warmup ({}): no step would be counted",
            a.steps, a.warmup
        )
    })?;
    if let Some(nodes) = a.nodes {
        return run_nodes(&a, nodes);
    }
    let dir = std::env::temp_dir().join(format!("shardline-overlap-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let res = run_in(&a, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    res
}

fn run_in(a: &Args, dir: &Path) -> anyhow::Result<()> {
    // Bytes per directed link per step: ring all-gather and reduce-scatter each move
    // (W-1)/W of the padded unit over every link; stage 3 gathers each unit twice (forward,
    // backward) and reduce-scatters it once.
    let cfg0 = config(a, 0, None, 1);
    let (train_set, _) = load_data(&cfg0, false)?;
    let model = build_model(&cfg0, &train_set.sample_shape, train_set.classes)?;
    let layout = ShardedModelLayout::new(&model.spec(), a.world)?;
    let w = a.world as u64;
    let per_link = 3 * (w - 1) * layout.padded_numel() as u64 * 4 / w;
    let units = layout.units().len();
    let model_desc = format!(
        "mlp-bn {}-{}x{}-{} ({} units, {:.1}M params, {})",
        a.input_dim,
        a.depth,
        a.hidden,
        a.classes,
        units,
        layout.padded_numel() as f64 / 1e6,
        cfg0.precision_label()
    );
    println!("overlap: {model_desc}, world {}, global batch {}, stage 3", a.world, a.batch_size);

    let (rate, calibrated, calib_ms) = match a.link_rate {
        Some(r) => (r, false, None),
        None => {
            // Compute alone: prefetch 0 on unlimited links.
            let c = run_one(a, 0, None, a.warmup + 8, dir)?;
            let compute_s = c.min_compute_ms / 1e3;
            let r = (per_link as f64 / (a.comm_ratio * compute_s).max(1e-6)) as u64;
            println!(
                "calibration: compute {:.1} ms/step (least of {} steps), {} per link per step -> \
                 link rate {}/s (comm ~ {:.0}% of compute)",
                c.min_compute_ms,
                c.row.steps,
                report::human_bytes(per_link as f64),
                report::human_bytes(r as f64),
                a.comm_ratio * 100.0
            );
            (r, true, Some(c.min_compute_ms))
        }
    };

    let mut rows = Vec::new();
    let mut timeline_trace = None;
    for &p in &a.prefetch {
        let out = run_one(a, p, Some(rate), a.steps, dir)?;
        if p == a.timeline_prefetch {
            timeline_trace = Some(out.trace.clone());
        }
        rows.push(out.row);
    }

    println!(
        "link rate {}/s per link; {} per link per step; medians over {} steps after {} warmup",
        report::human_bytes(rate as f64),
        report::human_bytes(per_link as f64),
        rows.first().map_or(0, |r| r.steps),
        a.warmup
    );
    println!(
        "{:>8} {:>11} {:>9} {:>9} {:>11} {:>10} {:>12}",
        "prefetch", "compute_ms", "comm_ms", "step_ms", "exposed_ms", "exposed_%", "comm/compute"
    );
    for r in &rows {
        println!(
            "{:>8} {:>11.1} {:>9.1} {:>9.1} {:>11.1} {:>10.1} {:>12.2}",
            r.prefetch,
            r.compute_ms,
            r.comm_ms,
            r.step_ms,
            r.exposed_ms,
            r.exposed_pct,
            r.comm_over_compute
        );
    }
    let find = |p: usize| rows.iter().find(|r| r.prefetch == p);
    let goal = find(1).map(|r1| Goal {
        prefetch1_exposed_pct: r1.exposed_pct,
        prefetch0_exposed_pct: find(0).map(|r| r.exposed_pct),
        comm_le_compute: r1.comm_ms <= r1.compute_ms,
        met: r1.exposed_pct <= 10.0,
    });
    if let Some(g) = &goal {
        println!(
            "goal (prefetch 1: exposed <= 10% of step time where comm <= compute): {:.1}% -> {}{}{}",
            g.prefetch1_exposed_pct,
            if g.met { "met" } else { "NOT met" },
            if g.comm_le_compute { "" } else { " (comm > compute here: outside the goal's premise)" },
            g.prefetch0_exposed_pct
                .map(|p0| format!("; prefetch 0: {p0:.1}%"))
                .unwrap_or_default()
        );
    }

    if let Some(svg) = &a.timeline {
        let trace = timeline_trace.ok_or_else(|| {
            anyhow::anyhow!("--timeline-prefetch {} was not among --prefetch", a.timeline_prefetch)
        })?;
        let events = load_trace(&trace)?;
        let step = a.steps.saturating_sub(2).max(1) as usize;
        let title = format!(
            "stage 3, prefetch {}, world {}, step {step}: {model_desc}, link {}/s",
            a.timeline_prefetch,
            a.world,
            report::human_bytes(rate as f64)
        );
        draw_timeline(svg, &title, &events, step)?;
        println!("timeline: {}", svg.display());
    }

    if let Some(p) = &a.json {
        report::write_json(
            p,
            &Report {
                world: a.world,
                model: model_desc,
                batch_size: a.batch_size,
                link_rate: rate,
                link_rate_calibrated: calibrated,
                bytes_per_link_per_step: per_link,
                calibration_compute_ms: calib_ms,
                rows,
                goal,
            },
        )?;
    }
    Ok(())
}

/// The `shardline` binary: `SHARDLINE_BIN`, else the one beside this executable.
fn shardline_bin() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("SHARDLINE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let bin = exe.with_file_name("shardline");
    if !bin.exists() {
        anyhow::bail!(
            "{} is missing: build it (cargo build --release -p shardline-runtime) or set \
             SHARDLINE_BIN",
            bin.display()
        );
    }
    Ok(bin)
}

fn train_args(a: &Args, prefetch: usize, dir: &Path) -> Vec<String> {
    let d = |f: String| dir.join(f).to_string_lossy().into_owned();
    let mut v: Vec<String> = [
        "train",
        "--model",
        "mlp-bn",
        "--dataset",
        "synthetic",
        "--stage",
        "3",
        "--lr",
        "0.01",
        "--no-progress",
        "--timeout",
        "120",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let samples = (a.batch_size * a.steps as usize).max(a.batch_size);
    for (k, x) in [
        ("--hidden", a.hidden.to_string()),
        ("--depth", a.depth.to_string()),
        ("--input-dim", a.input_dim.to_string()),
        ("--classes", a.classes.to_string()),
        ("--samples", samples.to_string()),
        ("--batch-size", a.batch_size.to_string()),
        ("--steps", a.steps.to_string()),
        ("--prefetch", prefetch.to_string()),
        ("--threads", a.threads.to_string()),
        ("--log-json", d(format!("p{prefetch}.jsonl"))),
        ("--trace", d(format!("p{prefetch}.json"))),
    ] {
        v.push(k.to_string());
        v.push(x);
    }
    if let Some(b) = a.prefetch_budget {
        v.extend(["--prefetch-budget".to_string(), b.to_string()]);
    }
    v.extend(["--param-dtype".to_string(), a.param_dtype.name().to_string()]);
    if let Some(g) = a.gather_dtype {
        v.extend(["--gather-dtype".to_string(), g.name().to_string()]);
    }
    if let Some(r) = a.reduce_dtype {
        v.extend(["--reduce-dtype".to_string(), r.name().to_string()]);
    }
    if let Some(g) = &a.shard_group {
        v.extend(["--shard-group".to_string(), g.clone()]);
    }
    if let Some(d) = a.cross_node_reduce_dtype {
        v.extend(["--cross-node-reduce-dtype".to_string(), d.name().to_string()]);
    }
    v.extend(["--seed".to_string(), a.seed.to_string()]);
    v.extend(a.train_args.iter().cloned());
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(rank: usize, row: usize, name: &str, start: f64, end: f64) -> Ev {
        Ev { rank, row, name: name.into(), start, end, cpu: None, bytes: None }
    }

    #[test]
    fn step_window_spans_from_the_previous_optimizer_to_this_one() {
        let evs = vec![
            ev(0, 0, "optimizer", 90.0, 100.0),
            ev(1, 0, "optimizer", 95.0, 105.0),
            ev(0, 0, "forward u0", 110.0, 150.0),
            ev(0, 0, "optimizer", 190.0, 200.0),
            ev(1, 0, "optimizer", 200.0, 210.0),
        ];
        assert_eq!(step_window(&evs, 2).unwrap(), (100.0, 210.0));
        assert_eq!(step_window(&evs, 1).unwrap(), (0.0, 105.0));
        assert!(step_window(&evs, 3).is_err());
    }

    /// OVL-1: per-step figures from a trace against values worked out by hand.
    #[test]
    fn rank_steps_split_a_trace_into_steps() {
        let evs = vec![
            ev(0, 0, "optimizer", 0.0, 1000.0),
            ev(0, 1, "all-gather u0", 500.0, 3000.0), // prefetched by the previous step
            ev(0, 0, "wait all-gather u0", 1000.0, 3000.0),
            ev(0, 0, "forward u0", 3000.0, 5000.0),
            ev(0, 2, "reduce-scatter u0", 4000.0, 7000.0),
            ev(0, 1, "all-gather u1", 6000.0, 8000.0),
            ev(0, 0, "backward u0", 5000.0, 9000.0),
            ev(0, 0, "optimizer", 9000.0, 10_000.0),
            ev(1, 0, "optimizer", 0.0, 50.0),
            ev(1, 0, "optimizer", 50.0, 100.0),
        ];
        let s = rank_steps(&evs, 0);
        assert_eq!(s.len(), 1);
        // step 9 ms; compute 2+4+1; comm union [1,3]+[4,8] ms; exposed 2 ms
        assert_eq!(s[0], [9.0, 7.0, 6.0, 2.0]);
        assert_eq!(rank_steps(&evs, 1), vec![[0.05, 0.05, 0.0, 0.0]]);
    }

    /// OVL-3: the bytes each collective sends, by its ring factor.
    #[test]
    fn wire_bytes_count_what_each_collective_sends() {
        let op = |rank, row, name: &str, start: f64, bytes: f64| Ev {
            bytes: Some(bytes),
            ..ev(rank, row, name, start, start + 5.0)
        };
        let evs = vec![
            ev(0, 0, "optimizer", 100.0, 100.0),
            // Step 1 of rank 0 (world 4): gathers send 3/4 of their buffer, a reduce-scatter
            // too, an all-reduce twice that; a span without a size counts nothing.
            op(0, 1, "gather blocks.0", 110.0, 400.0),
            op(0, 2, "reduce-scatter blocks.0", 150.0, 800.0),
            op(0, 2, "loss+norm", 160.0, 8.0),
            op(0, 2, "all-reduce blocks.1", 170.0, 40.0),
            ev(0, 3, "stats forward", 120.0, 121.0),
            // Rank 1's op and an op after the last mark stay out.
            op(1, 1, "gather blocks.0", 120.0, 4000.0),
            ev(0, 0, "optimizer", 200.0, 200.0),
            // Step 2: a gather issued right at the window's start belongs to it.
            op(0, 1, "gather blocks.1", 200.0, 80.0),
            ev(0, 0, "optimizer", 300.0, 300.0),
            op(0, 1, "gather head", 310.0, 4.0),
        ];
        let b = rank_wire_bytes(&evs, 0, 4);
        assert_eq!(b, vec![300.0 + 600.0 + 12.0 + 60.0, 60.0]);
        assert!(rank_wire_bytes(&evs, 2, 4).is_empty());
    }

    /// OVL-2: CPU per step from the marks' process CPU times, against values by hand.
    #[test]
    fn cpu_per_step_comes_from_consecutive_marks() {
        let mark = |rank, end: f64, cpu| Ev {
            rank,
            row: 0,
            name: "optimizer".into(),
            start: end,
            end,
            cpu: Some(cpu),
            bytes: None,
        };
        let evs = vec![
            mark(0, 100.0, 10.0),
            mark(0, 200.0, 18.0),
            mark(0, 300.0, 30.0),
            mark(0, 400.0, 41.0),
            ev(0, 0, "forward u0", 110.0, 150.0),
            mark(1, 100.0, 5.0),
            mark(1, 200.0, 12.0),
            mark(1, 300.0, 21.0),
            mark(1, 400.0, 30.0),
        ];
        let r0 = rank_cpu_steps(&evs, 0);
        assert_eq!(r0, vec![8.0, 12.0, 11.0]);
        let r1 = rank_cpu_steps(&evs, 1);
        assert_eq!(r1, vec![7.0, 9.0, 9.0]);
        // warmup 2 skips the first step: medians 11.5 (12, 11) and 9 -> mean 10.25; on two
        // cores the floor is (11.5 + 9) / 2.
        let (mean, floor) = cpu_per_step(&[r0, r1], 2, 2).unwrap();
        assert!((mean - 10.25).abs() < 1e-9 && (floor - 10.25).abs() < 1e-9, "{mean} {floor}");
        let (_, floor1) = cpu_per_step(&[vec![4.0], vec![6.0]], 1, 1).unwrap();
        assert!((floor1 - 10.0).abs() < 1e-9);
        // A trace without CPU times gives none.
        assert!(rank_cpu_steps(&[ev(0, 0, "optimizer", 1.0, 1.0)], 0).is_empty());
        assert!(cpu_per_step(&[vec![], vec![1.0]], 1, 2).is_none());
    }

    /// OVL-1: the slowest rank's step, the ranks' mean of the rest, medians after warmup.
    #[test]
    fn combine_ranks_takes_the_slowest_step_and_mean_figures() {
        let r0 = vec![[100.0, 1.0, 1.0, 1.0], [10.0, 4.0, 2.0, 1.0], [20.0, 6.0, 4.0, 3.0]];
        let r1 = vec![[1.0, 1.0, 1.0, 1.0], [12.0, 2.0, 4.0, 3.0], [11.0, 2.0, 2.0, 1.0]];
        // warmup 2: list entries 1.. (training steps 3, 4) are counted.
        let row = combine_ranks(1, &[r0, r1], 2).unwrap();
        assert_eq!(row.steps, 2);
        assert_eq!(row.step_ms, 16.0); // median of 12, 20
        assert_eq!(row.compute_ms, 3.5); // median of 3, 4
        assert_eq!(row.comm_ms, 3.0);
        assert_eq!(row.exposed_ms, 2.0);
        assert!(combine_ranks(1, &[vec![[1.0; 4]]], 3).is_err());
        let g = net_goal(&row);
        assert!((g.step_over_max - 16.0 / 3.5).abs() < 1e-12 && !g.met && g.comparable);
    }

    #[test]
    fn align_ranks_starts_every_rank_at_its_own_step() {
        let mut evs = vec![
            ev(0, 0, "optimizer", 0.0, 10.0),
            ev(0, 0, "optimizer", 30.0, 40.0),
            ev(1, 0, "optimizer", 1000.0, 1010.0),
            ev(1, 0, "forward u0", 1020.0, 1030.0),
            ev(1, 0, "optimizer", 1030.0, 1045.0),
        ];
        align_ranks(&mut evs, 2);
        assert_eq!(step_window(&evs, 2).unwrap(), (0.0, 35.0));
        assert_eq!((evs[3].start, evs[3].end), (10.0, 20.0));
    }

    #[test]
    fn timeline_draws_an_svg() {
        let evs = vec![
            ev(0, 0, "optimizer", 0.0, 10.0),
            ev(1, 0, "optimizer", 0.0, 10.0),
            ev(0, 1, "gather u0", 12.0, 40.0),
            ev(0, 0, "wait gather u0", 12.0, 40.0),
            ev(0, 0, "forward u0", 40.0, 90.0),
            ev(1, 2, "reduce-scatter u0", 90.0, 120.0),
            ev(0, 0, "optimizer", 150.0, 160.0),
            ev(1, 0, "optimizer", 150.0, 170.0),
        ];
        let p = std::env::temp_dir().join(format!("overlap-tl-{}.svg", std::process::id()));
        draw_timeline(&p, "t", &evs, 2).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        std::fs::remove_file(&p).ok();
        assert!(svg.contains("<svg") && svg.contains("rank 1 reduce"), "{}", &svg[..200]);
        assert!(svg.matches("<rect").count() >= 5);
    }
}
