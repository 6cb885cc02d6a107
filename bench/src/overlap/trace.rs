//! The ranks' Chrome traces read back: events per step, step phases, CPU and wire bytes per
//! rank, and their combination into one row.

use super::*;

/// Per-step figures of one rank from its trace (OVL-1): `[step, compute, comm, exposed]` in
/// ms for every step after the first (whose start the trace does not mark).
/// The ends of rank `rank`'s `optimizer` marks in time order: the step boundaries (OVL-1).
pub(crate) fn optimizer_ends(events: &[Ev], rank: usize) -> Vec<f64> {
    let mut ends: Vec<f64> = events
        .iter()
        .filter(|e| e.rank == rank && e.row == 0 && e.name == "optimizer")
        .map(|e| e.end)
        .collect();
    ends.sort_by(|a, b| a.total_cmp(b));
    ends
}

pub(crate) fn rank_steps(events: &[Ev], rank: usize) -> Vec<[f64; 4]> {
    let mine: Vec<&Ev> = events.iter().filter(|e| e.rank == rank).collect();
    let ends = optimizer_ends(events, rank);
    let clip = |e: &Ev, lo: f64, hi: f64| (e.start.max(lo), e.end.min(hi));
    ends.windows(2)
        .map(|w| {
            let (lo, hi) = (w[0], w[1]);
            let (mut compute, mut exposed) = (0.0, 0.0);
            let mut spans = Vec::new();
            for e in mine.iter().filter(|e| e.end > lo && e.start < hi) {
                let (a, b) = clip(e, lo, hi);
                match e.row {
                    0 if e.name.starts_with("wait") => exposed += b - a,
                    0 => compute += b - a,
                    _ => spans.push((a, b)),
                }
            }
            spans.sort_by(|x, y| x.0.total_cmp(&y.0));
            let (mut comm, mut cur) = (0.0, None::<(f64, f64)>);
            for (a, b) in spans {
                cur = match cur {
                    Some((s, e)) if a <= e => Some((s, e.max(b))),
                    Some((s, e)) => {
                        comm += e - s;
                        Some((a, b))
                    }
                    None => Some((a, b)),
                };
            }
            if let Some((s, e)) = cur {
                comm += e - s;
            }
            [(hi - lo) / 1e3, compute / 1e3, comm / 1e3, exposed / 1e3]
        })
        .collect()
}

/// CPU time of rank `rank`'s process per step (OVL-2): the difference between the process
/// CPU times carried by consecutive `optimizer` marks, in ms, aligned with [`rank_steps`];
/// empty when the trace carries none.
pub(crate) fn rank_cpu_steps(events: &[Ev], rank: usize) -> Vec<f64> {
    let mut marks: Vec<(f64, Option<f64>)> = events
        .iter()
        .filter(|e| e.rank == rank && e.row == 0 && e.name == "optimizer")
        .map(|e| (e.end, e.cpu))
        .collect();
    marks.sort_by(|a, b| a.0.total_cmp(&b.0));
    let cpu: Option<Vec<f64>> = marks.iter().map(|m| m.1).collect();
    cpu.map(|c| c.windows(2).map(|w| w[1] - w[0]).collect()).unwrap_or_default()
}

/// OVL-3: the bytes rank `rank` sends per step (windows as in [`rank_steps`]), from the
/// collectives on its trace: a ring all-gather or reduce-scatter of B bytes sends
/// B (W-1)/W, an all-reduce twice that (nccl-tests' bus factors). Spans without a size
/// (SyncBN statistics, a few hundred bytes) count nothing.
pub(crate) fn rank_wire_bytes(events: &[Ev], rank: usize, world: usize) -> Vec<f64> {
    let ends = optimizer_ends(events, rank);
    let w = world.max(1) as f64;
    ends.windows(2)
        .map(|win| {
            events
                .iter()
                .filter(|e| e.rank == rank && e.row > 0 && e.start >= win[0] && e.start < win[1])
                .filter_map(|e| {
                    let b = e.bytes?;
                    let all_reduce = e.name.starts_with("all-reduce") || e.name == "loss+norm";
                    Some(b * (w - 1.0) / w * if all_reduce { 2.0 } else { 1.0 })
                })
                .sum()
        })
        .collect()
}

/// OVL-2: the CPU a step costs, from every rank's own process (one process per rank): the
/// ranks' mean of the per-step medians after `warmup`, and the floor it puts under the step
/// on `cores` cores (the ranks' CPU per step together, spread over every core); None when a
/// trace carries no CPU times.
pub(crate) fn cpu_per_step(per_rank: &[Vec<f64>], warmup: u64, cores: usize) -> Option<(f64, f64)> {
    let skip = (warmup as usize).saturating_sub(1);
    let medians: Option<Vec<f64>> =
        per_rank.iter().map(|r| (r.len() > skip).then(|| median(r[skip..].to_vec()))).collect();
    let m = medians.filter(|m| !m.is_empty())?;
    let sum: f64 = m.iter().sum();
    Some((sum / m.len() as f64, sum / cores.max(1) as f64))
}

/// One prefetch depth's row from every rank's per-step figures (OVL-1): per step the slowest
/// rank's step time and the ranks' mean of the rest; medians over the steps after `warmup`
/// (step k of the list is training step k + 2).
pub(crate) fn combine_ranks(
    prefetch: usize,
    per_rank: &[Vec<[f64; 4]>],
    warmup: u64,
) -> anyhow::Result<Row> {
    let n = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    let skip = (warmup as usize).saturating_sub(1);
    if n <= skip || per_rank.is_empty() {
        anyhow::bail!("no steps left after {warmup} warmup steps (use --steps)");
    }
    let ranks = per_rank.len() as f64;
    let steps: Vec<[f64; 4]> = (skip..n)
        .map(|k| {
            let mean = |i: usize| per_rank.iter().map(|r| r[k][i]).sum::<f64>() / ranks;
            [per_rank.iter().map(|r| r[k][0]).fold(0.0, f64::max), mean(1), mean(2), mean(3)]
        })
        .collect();
    let col = |i: usize| median(steps.iter().map(|s| s[i]).collect());
    let (step_ms, compute_ms, comm_ms, exposed_ms) = (col(0), col(1), col(2), col(3));
    Ok(Row {
        prefetch,
        compute_ms,
        comm_ms,
        step_ms,
        exposed_ms,
        exposed_pct: median(steps.iter().map(|s| 100.0 * s[3] / s[0].max(1e-12)).collect()),
        comm_over_compute: comm_ms / compute_ms.max(1e-9),
        steps: steps.len(),
        rank0_log_step_ms: None,
        rank0_log_exposed_ms: None,
        rank0_sent_bytes: None,
        cpu_ms: None,
        cpu_floor_ms: None,
        wire_bytes: None,
        wire_ms: None,
        inter_node_bytes: None,
        final_loss: None,
    })
}

/// Every rank's trace of one launched job (`--trace p{P}.json` becomes `p{P}.rank{R}.json`).
pub(crate) fn load_rank_traces(
    dir: &Path,
    prefetch: usize,
    world: usize,
) -> anyhow::Result<Vec<Ev>> {
    let mut all = Vec::new();
    for r in 0..world {
        let evs = load_trace(&dir.join(format!("p{prefetch}.rank{r}.json")))?;
        all.extend(evs.into_iter().map(|mut e| {
            e.rank = r;
            e
        }));
    }
    Ok(all)
}

/// Shifts each rank's events so that its step `step` begins at 0: the processes' clocks
/// have separate origins.
pub(crate) fn align_ranks(events: &mut [Ev], step: usize) {
    let ranks = events.iter().map(|e| e.rank).max().map_or(0, |r| r + 1);
    for r in 0..ranks {
        let mut ends: Vec<f64> = events
            .iter()
            .filter(|e| e.rank == r && e.row == 0 && e.name == "optimizer")
            .map(|e| e.end)
            .collect();
        ends.sort_by(|a, b| a.total_cmp(b));
        let Some(&t0) = ends.get(step.saturating_sub(2)) else { continue };
        for e in events.iter_mut().filter(|e| e.rank == r) {
            e.start -= t0;
            e.end -= t0;
        }
    }
}

/// A trace event: rank, row (0 compute, 1 gather, 2 reduce, 3 stats), name, start and
/// end in microseconds.
#[derive(Clone, Debug)]
pub(crate) struct Ev {
    pub(crate) rank: usize,
    pub(crate) row: usize,
    pub(crate) name: String,
    pub(crate) start: f64,
    pub(crate) end: f64,
    /// The process's CPU time at the event, ms (on `optimizer` marks).
    pub(crate) cpu: Option<f64>,
    /// A collective's whole buffer, bytes (on collective spans).
    pub(crate) bytes: Option<f64>,
}

pub(crate) fn load_trace(path: &Path) -> anyhow::Result<Vec<Ev>> {
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
                cpu: e["args"]["process_cpu_ms"].as_f64(),
                bytes: e["args"]["bytes"].as_f64(),
            })
        })
        .collect())
}

/// The window of step `step` (1-based): from the end of the previous step's optimizer on
/// the earliest rank to the end of this step's optimizer on the latest.
pub(crate) fn step_window(events: &[Ev], step: usize) -> anyhow::Result<(f64, f64)> {
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
