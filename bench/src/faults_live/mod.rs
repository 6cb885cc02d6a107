//! `shardline-bench faults --live`: the live-recovery fault campaign. Real jobs under
//! `shardline launch` on namespace nodes (4 nodes of one worker each, the store replicated
//! over all of them), each trial's fault once with `--live-recovery` and once without
//! (restart from the checkpoint), compared with a clean run of the same setting.
//!
//! Per run: hang, lost data, the steps run again, the time from the failure to training
//! again, and whether the final checkpoint equals the clean run's bitwise (required of a
//! kill recovered in place, at stage 0 and under HSDP 2x2).
//!
//! - LIVEB-1: a trial's fault is drawn from the campaign's seed and the trial's number
//!   alone, and both runs of the trial meet it; every run starts from an empty checkpoint
//!   directory and step log.
//! - LIVEB-2: lost data is a committed checkpoint that does not verify, a step of the run
//!   missing from the step log or a line of it that does not parse, or a run that does not
//!   finish (no checkpoint of the last step, or a hang). A node's agent that exits non-zero
//!   in a run that finished is counted apart: no data was lost. The steps run
//!   again are the step log's lines less its distinct steps: a step in flight at the failure
//!   was never logged, so only steps completed before it and run a second time count (the
//!   log loses no line, DRIVE-7).
//! - LIVEB-3: the recovery time runs from the fault (the worker's own `fault injected` line
//!   for a kill or a stall; the harness's clock when it cut the link or killed the agent) to
//!   the first step-log line the harness reads after the job's first reaction to the fault
//!   (an agent's `fault:` or `restart` line, a worker's `live recovery:` line). A run that
//!   never reacted has none. The harness reads the log every 5 ms.
//! - LIVEB-4: every run has a deadline (`--trial-deadline`); an agent still running at it is
//!   killed with its workers and the run counts as a hang.

mod draw;
mod job;
mod logs;

use crate::campaign::{hash_bits, median, torn};
use crate::faults::Args;
use crate::report;
use draw::{Action, Drawn, Kind, Setting, Shape};
use job::Job;
use serde::Serialize;
use shardline_runtime::checkpoint::Checkpoint;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use draw::{Kind as FaultKind, Setting as JobSetting};

/// Nodes (one worker each): world 4 for HSDP 2x2, and the replicated store keeps a
/// majority when one node is lost.
const NODES: usize = 4;

/// One run of a trial.
#[derive(Clone, Debug, Serialize)]
struct RunRow {
    live: bool,
    hang: bool,
    completed: bool,
    lost_data: bool,
    /// Nodes whose last agent did not exit 0.
    agents_failed: usize,
    torn_checkpoint: Option<String>,
    missing_steps: Vec<u64>,
    unreadable_log_lines: u64,
    steps_run_again: u64,
    fault_fired: bool,
    failure_seen: bool,
    recovered: logs::Recovered,
    recovery_s: Option<f64>,
    final_step: Option<u64>,
    bitwise_equal: bool,
    exits: Vec<Option<i32>>,
    wall_s: f64,
}

#[derive(Clone, Debug, Serialize)]
struct TrialRow {
    trial: usize,
    setting: Setting,
    kind: Kind,
    fault: String,
    /// Whether the live run's final checkpoint must equal the clean run's.
    bitwise_required: bool,
    live: RunRow,
    restart: RunRow,
}

#[derive(Debug, Default, Serialize)]
struct ModeSummary {
    runs: usize,
    hangs: usize,
    lost_data: usize,
    runs_with_an_agent_failed: usize,
    faults_not_fired: usize,
    failures_seen: usize,
    recovered_in_place: usize,
    recovered_from_checkpoint: usize,
    recovery_median_s: Option<f64>,
    recovery_max_s: Option<f64>,
    steps_run_again_median: Option<f64>,
    steps_run_again_max: Option<u64>,
    bitwise_equal: usize,
}

impl ModeSummary {
    fn of<'a>(runs: impl Iterator<Item = &'a RunRow>) -> ModeSummary {
        let runs: Vec<&RunRow> = runs.collect();
        let seen: Vec<&&RunRow> = runs.iter().filter(|r| r.failure_seen).collect();
        let rec: Vec<f64> = runs.iter().filter_map(|r| r.recovery_s).collect();
        let again: Vec<u64> = seen.iter().map(|r| r.steps_run_again).collect();
        let in_place =
            |r: &&&RunRow| matches!(r.recovered, logs::Recovered::InPlace | logs::Recovered::Both);
        let restarted = |r: &&&RunRow| {
            matches!(r.recovered, logs::Recovered::Checkpoint | logs::Recovered::Both)
        };
        ModeSummary {
            runs: runs.len(),
            hangs: runs.iter().filter(|r| r.hang).count(),
            lost_data: runs.iter().filter(|r| r.lost_data).count(),
            runs_with_an_agent_failed: runs.iter().filter(|r| r.agents_failed > 0).count(),
            faults_not_fired: runs.iter().filter(|r| !r.fault_fired).count(),
            failures_seen: seen.len(),
            recovered_in_place: runs.iter().filter(in_place).count(),
            recovered_from_checkpoint: runs.iter().filter(restarted).count(),
            recovery_median_s: median(rec.clone()),
            recovery_max_s: rec.iter().copied().reduce(f64::max),
            steps_run_again_median: median(again.iter().map(|&x| x as f64).collect()),
            steps_run_again_max: again.iter().copied().max(),
            bitwise_equal: runs.iter().filter(|r| r.bitwise_equal).count(),
        }
    }
}

#[derive(Debug, Serialize)]
struct KindRow {
    kind: Kind,
    trials: usize,
    live: ModeSummary,
    restart: ModeSummary,
}

#[derive(Debug, Serialize)]
struct Summary {
    trials: usize,
    live: ModeSummary,
    restart: ModeSummary,
    /// Median recovery time from the checkpoint over the median in place.
    recovery_median_ratio: Option<f64>,
    bitwise_required: usize,
    bitwise_required_equal: usize,
    per_kind: Vec<KindRow>,
    clean_runs_s: f64,
    campaign_s: f64,
}

/// The final state of a run: the newest committed checkpoint's step and the fingerprint of
/// its parameters, optimizer state and buffers.
fn final_state(ck: &Path) -> Option<(u64, String)> {
    let dir = shardline_runtime::checkpoint::latest(ck).ok()??;
    let c = Checkpoint::open(dir).ok()?;
    let units = c.consolidate().ok()?;
    let flat: Vec<Vec<f32>> = units.into_iter().flat_map(|u| [u.params, u.optim_state]).collect();
    Some((c.manifest().step, hash_bits(&flat, &c.buffers().ok()?)))
}

/// The `shardline` binary: `SHARDLINE_BIN`, else the one beside this executable.
fn shardline_bin() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("SHARDLINE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let bin = exe.with_file_name("shardline");
    anyhow::ensure!(
        bin.is_file(),
        "{} is missing: build it (`cargo build -p shardline-runtime`) or set SHARDLINE_BIN",
        bin.display()
    );
    Ok(bin)
}

/// What every run of the campaign shares.
struct Campaign<'a> {
    a: &'a Args,
    shape: Shape,
    net: shardline_tests::netns::Net,
    shardline: PathBuf,
    root: PathBuf,
    port: u16,
}

impl Campaign<'_> {
    /// Runs `setting` with `live` and the fault `drawn` (none: the clean run) in `tag`'s
    /// directory; `clean` is the clean run's final fingerprint.
    fn run(
        &mut self,
        tag: &str,
        setting: Setting,
        live: bool,
        drawn: Option<&Drawn>,
        clean: Option<&str>,
    ) -> anyhow::Result<(RunRow, String)> {
        let dir = self.root.join(tag);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let (ck, log) = (dir.join("ck"), dir.join("steps.jsonl"));
        let s = self.shape;
        let mut train: Vec<String> = ["train", "--model", "mlp-bn", "--dataset", "digits"]
            .iter()
            .map(|x| x.to_string())
            .collect();
        train.extend(
            [
                "--world".to_string(),
                NODES.to_string(),
                "--steps".into(),
                s.steps.to_string(),
                "--checkpoint-every".into(),
                s.checkpoint_every.to_string(),
                "--timeout".into(),
                s.timeout_s.to_string(),
                "--no-progress".into(),
                "--checkpoint-dir".into(),
                ck.display().to_string(),
                "--log-json".into(),
                log.display().to_string(),
            ]
            .into_iter()
            .chain(setting.train_flags().iter().map(|x| x.to_string())),
        );
        let action = drawn.map(|d| d.action.clone());
        if let Some(Action::Worker { spec }) = &action {
            train.extend(["--fault".to_string(), spec.clone()]);
        }
        // A fresh port per run, so that no replica of a finished run is ever reached, and
        // below the namespaces' ephemeral ports (32768 up): the TIME_WAIT of a connection the
        // last run made from that port would keep this run's replica from binding it.
        self.port = if self.port >= 32_000 { 20_000 } else { self.port + 1 };
        let job = Job {
            net: &self.net,
            shardline: &self.shardline,
            port: self.port,
            live,
            max_restarts: self.a.max_restarts,
            train,
            step_log: log.clone(),
            action: action.filter(|a| !matches!(a, Action::Worker { .. })),
            deadline: Duration::from_secs(self.a.trial_deadline),
        };
        let ran = job.run()?;
        let fault_ms = logs::injected_ms(&ran.output).or(ran.harness_fault_ms);
        let reaction = fault_ms.and_then(|f| logs::reaction_ms(&ran.output, f));
        let steplog = logs::step_log(&std::fs::read_to_string(&log).unwrap_or_default(), s.steps);
        let torn_ck = torn(&ck);
        let fin = final_state(&ck);
        let completed = !ran.hang && fin.as_ref().is_some_and(|f| f.0 == s.steps);
        let row = RunRow {
            live,
            hang: ran.hang,
            completed,
            lost_data: torn_ck.is_some()
                || !steplog.missing.is_empty()
                || steplog.unreadable > 0
                || !completed,
            agents_failed: ran.exits.iter().filter(|e| **e != Some(0)).count(),
            torn_checkpoint: torn_ck,
            missing_steps: steplog.missing.clone(),
            unreadable_log_lines: steplog.unreadable,
            steps_run_again: steplog.run_again,
            fault_fired: drawn.is_none() || fault_ms.is_some(),
            failure_seen: reaction.is_some(),
            recovered: logs::recovered(&ran.output),
            recovery_s: fault_ms.and_then(|f| logs::recovery_s(f, reaction, &ran.seen)),
            final_step: fin.as_ref().map(|f| f.0),
            bitwise_equal: fin.as_ref().is_some_and(|f| clean.is_none_or(|c| f.1 == c)),
            exits: ran.exits.clone(),
            wall_s: ran.wall_s,
        };
        if let Some(d) = &self.a.logs {
            std::fs::create_dir_all(d)?;
            std::fs::write(d.join(format!("{tag}.log")), &ran.output)?;
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok((row, fin.map(|f| f.1).unwrap_or_default()))
    }
}

fn short(r: &RunRow) -> String {
    let yes = |b: bool| if b { "yes" } else { "no" };
    format!(
        "rec {:>7} again {:>2} eq {:<3} lost {:<3} hang {:<3} via {:<10}",
        r.recovery_s.map_or("-".into(), |x| format!("{x:.3}s")),
        r.steps_run_again,
        yes(r.bitwise_equal),
        yes(r.lost_data),
        yes(r.hang),
        match r.recovered {
            logs::Recovered::None => "-",
            logs::Recovered::InPlace => "in-place",
            logs::Recovered::Checkpoint => "checkpoint",
            logs::Recovered::Both => "both",
        }
    )
}

fn fmt_s(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.3}"))
}

fn print_summary(s: &Summary) {
    let (l, r) = (&s.live, &s.restart);
    println!("summary ({} trials, each run with and without --live-recovery):", s.trials);
    println!("  {:<34} {:>12} {:>12}", "", "live", "restart");
    let row = |name: &str, a: String, b: String| println!("  {name:<34} {a:>12} {b:>12}");
    row("runs", l.runs.to_string(), r.runs.to_string());
    row("hangs", l.hangs.to_string(), r.hangs.to_string());
    row("lost data", l.lost_data.to_string(), r.lost_data.to_string());
    row(
        "runs with an agent exiting non-zero",
        l.runs_with_an_agent_failed.to_string(),
        r.runs_with_an_agent_failed.to_string(),
    );
    row("faults that never fired", l.faults_not_fired.to_string(), r.faults_not_fired.to_string());
    row("failures seen", l.failures_seen.to_string(), r.failures_seen.to_string());
    row("recovered in place", l.recovered_in_place.to_string(), r.recovered_in_place.to_string());
    row(
        "recovered from a checkpoint",
        l.recovered_from_checkpoint.to_string(),
        r.recovered_from_checkpoint.to_string(),
    );
    row("recovery median (s)", fmt_s(l.recovery_median_s), fmt_s(r.recovery_median_s));
    row("recovery max (s)", fmt_s(l.recovery_max_s), fmt_s(r.recovery_max_s));
    row(
        "steps run again, median",
        fmt_s(l.steps_run_again_median),
        fmt_s(r.steps_run_again_median),
    );
    let max = |v: Option<u64>| v.map_or("-".into(), |x| x.to_string());
    row("steps run again, max", max(l.steps_run_again_max), max(r.steps_run_again_max));
    row(
        "final checkpoint = clean, bitwise",
        l.bitwise_equal.to_string(),
        r.bitwise_equal.to_string(),
    );
    println!(
        "  median recovery, restart / live: {}",
        s.recovery_median_ratio.map_or("-".into(), |x| format!("{x:.1}x"))
    );
    println!(
        "  required bitwise (kill, live): {} of {} equal",
        s.bitwise_required_equal, s.bitwise_required
    );
    println!(
        "  {:<12} {:>6} {:>11} {:>11} {:>9} {:>9} {:>8} {:>8}",
        "kind", "trials", "rec live", "rec restart", "again l", "again r", "eq live", "eq rest"
    );
    for k in &s.per_kind {
        println!(
            "  {:<12} {:>6} {:>11} {:>11} {:>9} {:>9} {:>8} {:>8}",
            k.kind.name(),
            k.trials,
            fmt_s(k.live.recovery_median_s),
            fmt_s(k.restart.recovery_median_s),
            fmt_s(k.live.steps_run_again_median),
            fmt_s(k.restart.steps_run_again_median),
            k.live.bitwise_equal,
            k.restart.bitwise_equal
        );
    }
}

/// Runs the live-recovery campaign.
pub fn run(a: &Args) -> anyhow::Result<()> {
    let steps = a.steps.unwrap_or(50);
    let every = a.checkpoint_every.unwrap_or(20);
    report::check_flags(a.world.is_none_or(|w| w == NODES), || {
        format!("--world: the live campaign runs {NODES} nodes of one worker each (world {NODES})")
    })?;
    report::check_flags(steps >= 8, || "--steps must be at least 8 with --live".into())?;
    report::check_flags(every >= 1 && every <= steps, || {
        "--checkpoint-every must be between 1 and --steps".into()
    })?;
    report::check_flags(a.timeout >= 1, || "--timeout must be at least 1 s".into())?;
    let started = Instant::now();
    let net = shardline_tests::netns::Net::new("l", NODES, None).map_err(|e| {
        anyhow::anyhow!(
            "faults --live builds {NODES} network namespaces (ip netns, veth, bridge) and needs \
             root: {e}"
        )
    })?;
    let root = std::env::temp_dir().join(format!("shardline-faults-live-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let shape = Shape { nodes: NODES, steps, checkpoint_every: every, timeout_s: a.timeout };
    let mut c = Campaign {
        a,
        shape,
        net,
        shardline: shardline_bin()?,
        root: root.clone(),
        port: 20_000 + (std::process::id() % 12_000) as u16,
    };
    println!(
        "shardline-bench faults --live: {} trials, {NODES} nodes x 1 worker, mlp-bn {steps} steps, checkpoint every {every}, timeout {} s, --max-restarts {}, deadline {} s per run",
        a.trials, a.timeout, a.max_restarts, a.trial_deadline
    );
    let mut clean = std::collections::HashMap::new();
    let t_clean = Instant::now();
    for &setting in &a.settings {
        let (row, hash) =
            c.run(&format!("clean-{}", setting.name()), setting, false, None, None)?;
        anyhow::ensure!(
            row.completed && !row.lost_data && row.agents_failed == 0,
            "the clean {} run failed ({row:?}); nothing to compare against",
            setting.name()
        );
        clean.insert(setting.name(), hash);
    }
    let clean_runs_s = t_clean.elapsed().as_secs_f64();
    let mut rows = Vec::with_capacity(a.trials);
    for t in 0..a.trials {
        let d = draw::draw(a.seed, t, &a.kinds, &a.settings, shape);
        let want = clean.get(d.setting.name()).map(String::as_str);
        // Alternate which mode runs first, so that neither always meets a warmer machine.
        let mut live = None;
        let mut restart = None;
        for first_live in [t % 2 == 0, t % 2 != 0] {
            let tag = format!("t{t}-{}", if first_live { "live" } else { "restart" });
            let (row, _) = c.run(&tag, d.setting, first_live, Some(&d), want)?;
            if first_live {
                live = Some(row);
            } else {
                restart = Some(row);
            }
        }
        let (Some(live), Some(restart)) = (live, restart) else { unreachable!() };
        let row = TrialRow {
            trial: t,
            setting: d.setting,
            kind: d.kind,
            fault: d.action.describe(),
            bitwise_required: d.kind == Kind::Kill,
            live,
            restart,
        };
        println!(
            "  {t:>3} {:<6} {:<44} live: {} | restart: {}",
            row.setting.name(),
            row.fault,
            short(&row.live),
            short(&row.restart)
        );
        rows.push(row);
    }
    let live = ModeSummary::of(rows.iter().map(|r| &r.live));
    let restart = ModeSummary::of(rows.iter().map(|r| &r.restart));
    let per_kind = a
        .kinds
        .iter()
        .map(|&k| {
            let of = rows.iter().filter(|r| r.kind == k);
            KindRow {
                kind: k,
                trials: of.clone().count(),
                live: ModeSummary::of(of.clone().map(|r| &r.live)),
                restart: ModeSummary::of(of.map(|r| &r.restart)),
            }
        })
        .collect();
    let required: Vec<&TrialRow> = rows.iter().filter(|r| r.bitwise_required).collect();
    let summary = Summary {
        trials: rows.len(),
        recovery_median_ratio: match (live.recovery_median_s, restart.recovery_median_s) {
            (Some(l), Some(r)) if l > 0.0 => Some(r / l),
            _ => None,
        },
        live,
        restart,
        bitwise_required: required.len(),
        bitwise_required_equal: required.iter().filter(|r| r.live.bitwise_equal).count(),
        per_kind,
        clean_runs_s,
        campaign_s: started.elapsed().as_secs_f64(),
    };
    print_summary(&summary);
    if let Some(p) = &a.json {
        let doc = serde_json::json!({"summary": summary, "trials": rows, "args": format!("{a:?}")});
        report::write_json(p, &doc)?;
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
