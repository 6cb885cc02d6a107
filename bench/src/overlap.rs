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

use crate::report;
use anyhow::Context;
use plotters::prelude::*;
use serde::Serialize;
use shardline_runtime::shard::{ShardedModelLayout, Stage};
use shardline_runtime::train::{
    self, build_model, load_data, RunOptions, StageChoice, SyncBnMode, TrainConfig,
};
use std::path::{Path, PathBuf};

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
    /// JSON output.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// SVG timeline of one step per rank (of the `--timeline-prefetch` run).
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Which prefetch depth's run the timeline shows.
    #[arg(long, default_value_t = 1)]
    pub timeline_prefetch: usize,
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
        },
        trace,
    })
}

/// Runs the benchmark.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.world < 2 {
        anyhow::bail!("--world must be at least 2 (one rank has nothing to communicate)");
    }
    if a.prefetch.is_empty() {
        anyhow::bail!("--prefetch needs at least one depth");
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
        "mlp-bn {}-{}x{}-{} ({} units, {:.1}M params)",
        a.input_dim,
        a.depth,
        a.hidden,
        a.classes,
        units,
        layout.padded_numel() as f64 / 1e6
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

/// A trace event: rank, row (0 compute, 1 gather, 2 reduce, 3 stats), name, start and
/// end in microseconds.
#[derive(Clone, Debug)]
struct Ev {
    rank: usize,
    row: usize,
    name: String,
    start: f64,
    end: f64,
}

fn load_trace(path: &Path) -> anyhow::Result<Vec<Ev>> {
    let doc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
    )?;
    let events = doc["traceEvents"].as_array().ok_or_else(|| anyhow::anyhow!("no traceEvents"))?;
    Ok(events
        .iter()
        .filter(|e| e["ph"] == "X")
        .filter_map(|e| {
            let start = e["ts"].as_f64()?;
            Some(Ev {
                rank: e["pid"].as_u64()? as usize,
                row: e["tid"].as_u64()? as usize,
                name: e["name"].as_str()?.to_string(),
                start,
                end: start + e["dur"].as_f64()?,
            })
        })
        .collect())
}

/// The window of step `step` (1-based): from the end of the previous step's optimizer on
/// the earliest rank to the end of this step's optimizer on the latest.
fn step_window(events: &[Ev], step: usize) -> anyhow::Result<(f64, f64)> {
    let ranks = events.iter().map(|e| e.rank).max().map_or(0, |r| r + 1);
    let (mut lo, mut hi) = (f64::MAX, f64::MIN);
    for r in 0..ranks {
        let mut opt: Vec<f64> =
            events.iter().filter(|e| e.rank == r && e.name == "optimizer").map(|e| e.end).collect();
        opt.sort_by(|a, b| a.total_cmp(b));
        if opt.len() < step.max(2) {
            anyhow::bail!("the trace has {} steps on rank {r}, need {}", opt.len(), step.max(2));
        }
        let prev = if step >= 2 { opt[step - 2] } else { 0.0 };
        lo = lo.min(prev);
        hi = hi.max(opt[step - 1]);
    }
    Ok((lo, hi))
}

fn color_of(e: &Ev) -> RGBColor {
    match e.row {
        0 if e.name.starts_with("wait") => RGBColor(214, 39, 40),
        0 if e.name.starts_with("forward") => RGBColor(31, 119, 180),
        0 if e.name.starts_with("backward") => RGBColor(44, 160, 44),
        0 => RGBColor(148, 103, 189),
        1 => RGBColor(255, 127, 14),
        2 => RGBColor(23, 190, 207),
        _ => RGBColor(127, 127, 127),
    }
}

const ROWS: [&str; 4] = ["compute", "gather", "reduce", "stats"];

/// Draws one step per rank: a lane of rectangles per (rank, row), time in ms on x.
fn draw_timeline(path: &Path, title: &str, events: &[Ev], step: usize) -> anyhow::Result<()> {
    let (lo, hi) = step_window(events, step)?;
    let ranks = events.iter().map(|e| e.rank).max().map_or(0, |r| r + 1);
    let lanes = ranks * ROWS.len();
    let span_ms = ((hi - lo) / 1e3).max(1e-3);
    let height = 120 + 34 * lanes as u32;
    let root = SVGBackend::new(path, (1200, height)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing the timeline: {e}");
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(130)
        // The right fifth stays empty for the legend.
        .build_cartesian_2d(0.0..span_ms * 1.25, 0.0..lanes as f64)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_desc("ms since the step began")
        .draw()
        .map_err(|e| err(&e))?;
    // Lane i (top to bottom) occupies y in [lanes-1-i, lanes-i]; its label goes in the left
    // margin at the lane's middle.
    for i in 0..lanes {
        let (_, py) = chart.backend_coord(&(0.0, (lanes - i) as f64 - 0.5));
        let label = format!("rank {} {}", i / ROWS.len(), ROWS[i % ROWS.len()]);
        root.draw(&Text::new(label, (14, py - 7), ("sans-serif", 14).into_font()))
            .map_err(|e| err(&e))?;
    }
    let mut rects = Vec::new();
    for e in events.iter().filter(|e| e.end > lo && e.start < hi && e.row < ROWS.len()) {
        let lane = e.rank * ROWS.len() + e.row;
        let y1 = (lanes - lane) as f64 - 0.12;
        let y0 = (lanes - lane - 1) as f64 + 0.12;
        let x0 = (e.start.max(lo) - lo) / 1e3;
        let x1 = ((e.end.min(hi) - lo) / 1e3).max(x0 + span_ms * 1e-4);
        rects.push(Rectangle::new([(x0, y0), (x1, y1)], color_of(e).filled()));
        // A thin white edge keeps back-to-back ops on a lane apart.
        rects.push(Rectangle::new([(x0, y0), (x1, y1)], WHITE.stroke_width(1)));
    }
    chart.draw_series(rects).map_err(|e| err(&e))?;
    for k in 1..ranks {
        let y = (lanes - k * ROWS.len()) as f64;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, y), (span_ms, y)],
                BLACK.stroke_width(1),
            )))
            .map_err(|e| err(&e))?;
    }
    let legend = [
        ("forward", RGBColor(31, 119, 180)),
        ("backward", RGBColor(44, 160, 44)),
        ("optimizer", RGBColor(148, 103, 189)),
        ("blocked wait", RGBColor(214, 39, 40)),
        ("all-gather", RGBColor(255, 127, 14)),
        ("reduce-scatter / all-reduce", RGBColor(23, 190, 207)),
        ("SyncBN stats", RGBColor(127, 127, 127)),
    ];
    for (name, c) in legend {
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(rank: usize, row: usize, name: &str, start: f64, end: f64) -> Ev {
        Ev { rank, row, name: name.into(), start, end }
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
