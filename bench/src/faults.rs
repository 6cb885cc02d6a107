//! `shardline-bench faults`: a randomised, seeded campaign of faults over short supervised
//! runs. Each trial runs in its own process (`faults-trial`) under a deadline, so a hang is
//! counted and killed instead of stalling the campaign. Per trial: the fault, whether the job
//! detected it, hang, torn checkpoint (every committed checkpoint is verified afterwards),
//! whether the final parameters equal the clean run's bitwise, detection and recovery times.

use crate::campaign::{hash_bits, median, torn, Rng};
use crate::report;
use serde::{Deserialize, Serialize};
use shardline_runtime::fault::{FaultInjector, FaultPlan};
use shardline_runtime::shard::Stage;
use shardline_runtime::supervise::run_supervised;
use shardline_runtime::train::{RunOptions, StageChoice, SyncBnMode, TrainConfig};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Options of `shardline-bench faults`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// The live-recovery campaign instead: real jobs under `shardline launch` on 4 network
    /// namespace nodes of one worker each (needs root), each trial's fault run once with
    /// `--live-recovery` and once restarting from the checkpoint, both compared with a clean
    /// run bitwise.
    #[arg(long)]
    pub live: bool,
    /// Trials (one fault each).
    #[arg(long, default_value_t = 100)]
    pub trials: usize,
    /// Campaign seed (faults drawn and link decisions).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Ranks (default 3; with --live only 4).
    #[arg(long)]
    pub world: Option<usize>,
    /// Steps per run (default 8; 50 with --live).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Checkpoint interval in steps (default 2; 20 with --live).
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Collective timeout in seconds (`train --timeout`).
    #[arg(long, default_value_t = 2)]
    pub timeout: u64,
    /// Restarts allowed per trial (with --live: `launch --max-restarts`, which also bounds
    /// each agent's replacements in place).
    #[arg(long, default_value_t = 3)]
    pub max_restarts: u32,
    /// A trial (with --live: each run) running longer than this many seconds is a hang
    /// (killed).
    #[arg(long, default_value_t = 90)]
    pub trial_deadline: u64,
    /// With --live: the fault kinds drawn from (kills twice as often as each other kind).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        requires = "live",
        default_value = "kill,stall,partition,node0-loss,node-return"
    )]
    pub kinds: Vec<crate::faults_live::FaultKind>,
    /// With --live: the settings drawn from (stage0: --stage 0; hsdp: --shard-group 2
    /// --stage 3).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        requires = "live",
        default_value = "stage0,hsdp"
    )]
    pub settings: Vec<crate::faults_live::JobSetting>,
    /// With --live: write every run's agent output (workers' lines included) to
    /// DIR/clean-SETTING.log and DIR/tN-live.log, DIR/tN-restart.log.
    #[arg(long, requires = "live")]
    pub logs: Option<PathBuf>,
    /// JSON output.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl Args {
    fn world(&self) -> usize {
        self.world.unwrap_or(3)
    }

    fn steps(&self) -> u64 {
        self.steps.unwrap_or(8)
    }

    fn checkpoint_every(&self) -> u64 {
        self.checkpoint_every.unwrap_or(2)
    }
}

/// Options of one trial (a child process).
#[derive(clap::Args, Clone, Debug)]
pub struct TrialArgs {
    /// Fault specs (none: the clean run).
    #[arg(long = "fault")]
    pub faults: Vec<String>,
    /// Fault seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Checkpoint directory.
    #[arg(long)]
    pub dir: PathBuf,
    /// Ranks.
    #[arg(long)]
    pub world: usize,
    /// Steps.
    #[arg(long)]
    pub steps: u64,
    /// Checkpoint interval.
    #[arg(long)]
    pub checkpoint_every: u64,
    /// Timeout in seconds.
    #[arg(long)]
    pub timeout: u64,
    /// Restarts allowed.
    #[arg(long)]
    pub max_restarts: u32,
    /// Where to write the outcome (JSON).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Serialize, Deserialize)]
struct TrialOutcome {
    ok: bool,
    error: Option<String>,
    restarts: u32,
    faults: Vec<serde_json::Value>,
    params_hash: String,
    wall_s: f64,
    steps: u64,
    median_step_s: f64,
}

fn config(world: usize, steps: u64, timeout: u64) -> TrainConfig {
    TrainConfig {
        world,
        stage: StageChoice::Fixed(Stage::Zero3),
        model: "mlp-bn".into(),
        dataset: "digits".into(),
        steps: Some(steps),
        batch_size: 16 * world,
        lr: 0.05,
        hidden: Some(16),
        depth: Some(1),
        sync_bn: SyncBnMode::On,
        seed: 5,
        timeout_s: timeout,
        ..TrainConfig::default()
    }
}

/// Runs one trial in this process and writes its outcome.
pub fn trial(a: TrialArgs) -> anyhow::Result<()> {
    let cfg = config(a.world, a.steps, a.timeout);
    let opts = RunOptions {
        quiet: true,
        progress: false,
        checkpoint_dir: Some(a.dir.clone()),
        checkpoint_every: a.checkpoint_every,
        ..RunOptions::default()
    };
    let plan = FaultPlan::parse(&a.faults, a.seed).map_err(anyhow::Error::msg)?;
    let inj = (!plan.faults.is_empty()).then(|| FaultInjector::new(plan));
    let s = run_supervised(cfg, opts, inj, a.max_restarts);
    let faults = s.faults.iter().map(|f| serde_json::to_value(f).unwrap_or_default()).collect();
    let out = match &s.result {
        Ok(sum) => TrialOutcome {
            ok: true,
            error: None,
            restarts: s.restarts,
            faults,
            params_hash: hash_bits(&sum.final_params, &sum.final_buffers),
            wall_s: s.wall_s,
            steps: sum.total_steps,
            median_step_s: sum.median_step_s,
        },
        Err(e) => TrialOutcome {
            ok: false,
            error: Some(e.to_string()),
            restarts: s.restarts,
            faults,
            params_hash: String::new(),
            wall_s: s.wall_s,
            steps: 0,
            median_step_s: 0.0,
        },
    };
    std::fs::write(&a.out, serde_json::to_vec(&out)?)?;
    Ok(())
}

/// Draws one fault and whether the job must notice it as a failure (`None`: it may or may
/// not, e.g. a low-probability corruption that never hits a frame).
fn draw(r: &mut Rng, a: &Args) -> (String, &'static str, Option<bool>) {
    let w = a.world() as u64;
    let rank = r.below(w);
    let step = 1 + r.below(a.steps());
    let (x, y) = {
        let x = r.below(w);
        (x, (x + 1 + r.below(w - 1)) % w)
    };
    match r.below(8) {
        0..=2 => {
            let phase = ["forward", "backward", "reduce", "checkpoint"][r.below(4) as usize];
            // A checkpoint kill needs a step that writes one.
            let step = if phase == "checkpoint" {
                a.checkpoint_every() * (1 + r.below(a.steps() / a.checkpoint_every()))
            } else {
                step
            };
            (format!("kill:rank={rank}:step={step}:phase={phase}"), "kill", Some(true))
        }
        3 => {
            let secs = a.timeout as f64 * (0.1 + 0.3 * r.unit());
            (format!("stall:rank={rank}:step={step}:secs={secs:.2}"), "stall-under", Some(false))
        }
        4 => {
            let secs = a.timeout as f64 * (1.5 + r.unit());
            (format!("stall:rank={rank}:step={step}:secs={secs:.2}"), "stall-over", Some(true))
        }
        5 => {
            let (ms, j) = (1 + r.below(5), r.below(3));
            (format!("delay:link={x}-{y}:ms={ms}:jitter={j}"), "delay", Some(false))
        }
        6 => {
            let p = 0.05 + 0.35 * r.unit();
            (format!("drop:link={x}-{y}:p={p:.3}"), "drop", Some(false))
        }
        _ => {
            let p = 0.002 + 0.03 * r.unit();
            (format!("corrupt:link={x}-{y}:p={p:.4}"), "corrupt", None)
        }
    }
}

#[derive(Serialize, Clone)]
struct TrialRow {
    trial: usize,
    fault: String,
    class: String,
    detected: bool,
    must_detect: Option<bool>,
    hang: bool,
    torn_checkpoint: bool,
    equal_to_clean: bool,
    completed: bool,
    restarts: u32,
    detection_s: Option<f64>,
    recovery_s: Option<f64>,
    wall_s: f64,
    error: Option<String>,
}

#[derive(Serialize)]
struct CampaignSummary {
    trials: usize,
    faults_detected: usize,
    faults_that_must_be_detected: usize,
    missed_detections: usize,
    false_detections: usize,
    hangs: usize,
    torn_checkpoints: usize,
    runs_equal_to_clean: usize,
    runs_completed: usize,
    median_detection_s: Option<f64>,
    median_recovery_s: Option<f64>,
    checkpoint_interval_steps: u64,
    checkpoint_interval_s: f64,
    clean_run_s: f64,
    campaign_s: f64,
}

fn run_child(
    a: &Args,
    faults: &[String],
    seed: u64,
    dir: &Path,
    out: &Path,
) -> anyhow::Result<(Option<TrialOutcome>, bool, f64)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg("faults-trial");
    for f in faults {
        cmd.arg("--fault").arg(f);
    }
    cmd.args(["--seed", &seed.to_string(), "--world", &a.world().to_string()])
        .args(["--steps", &a.steps().to_string()])
        .args(["--checkpoint-every", &a.checkpoint_every().to_string()])
        .args(["--timeout", &a.timeout.to_string()])
        .args(["--max-restarts", &a.max_restarts.to_string()])
        .arg("--dir")
        .arg(dir)
        .arg("--out")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let t0 = Instant::now();
    let mut child = cmd.spawn()?;
    let deadline = Duration::from_secs(a.trial_deadline);
    let hang = loop {
        if child.try_wait()?.is_some() {
            break false;
        }
        if t0.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break true;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let wall = t0.elapsed().as_secs_f64();
    let outcome = std::fs::read(out).ok().and_then(|b| serde_json::from_slice(&b).ok());
    Ok((outcome, hang, wall))
}

/// Runs the campaign.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.live {
        return crate::faults_live::run(&a);
    }
    report::check_flags(a.world() >= 2, || {
        "--world must be at least 2 (links need two ranks)".into()
    })?;
    anyhow::ensure!(
        a.checkpoint_every() >= 1 && a.checkpoint_every() <= a.steps(),
        "--checkpoint-every must be between 1 and --steps"
    );
    let started = Instant::now();
    let root = std::env::temp_dir().join(format!("shardline-faults-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    // The clean run, in a child like every trial.
    let (clean, hang, clean_s) =
        run_child(&a, &[], a.seed, &root.join("clean"), &root.join("clean.json"))?;
    let clean = match clean {
        Some(c) if c.ok && !hang => c,
        _ => anyhow::bail!("the clean run failed; nothing to compare against"),
    };
    // The work a failure can lose: the steps of one checkpoint interval.
    let interval_s = clean.median_step_s * a.checkpoint_every() as f64;
    println!(
        "shardline-bench faults: {} trials, world {}, {} steps, checkpoint every {} steps (~{:.2} s), timeout {} s, {} restarts allowed",
        a.trials, a.world(), a.steps(), a.checkpoint_every(), interval_s, a.timeout, a.max_restarts
    );
    let mut rng = Rng(a.seed ^ 0xFA17);
    let mut rows = Vec::with_capacity(a.trials);
    for t in 0..a.trials {
        let (spec, class, must) = draw(&mut rng, &a);
        let dir = root.join(format!("t{t}"));
        let out = root.join(format!("t{t}.json"));
        let (o, hang, wall) =
            run_child(&a, std::slice::from_ref(&spec), a.seed + t as u64, &dir, &out)?;
        let torn_ck = torn(&dir);
        let recs: Vec<FaultRecordView> = o
            .as_ref()
            .map(|o| {
                o.faults.iter().filter_map(|v| serde_json::from_value(v.clone()).ok()).collect()
            })
            .unwrap_or_default();
        let detected = recs.iter().any(|r| r.detected);
        let row = TrialRow {
            trial: t,
            fault: spec,
            class: class.into(),
            detected,
            must_detect: must,
            hang,
            torn_checkpoint: torn_ck.is_some(),
            equal_to_clean: o.as_ref().is_some_and(|o| o.ok && o.params_hash == clean.params_hash),
            completed: o.as_ref().is_some_and(|o| o.ok),
            restarts: o.as_ref().map_or(0, |o| o.restarts),
            detection_s: recs.iter().find_map(|r| r.detection_s),
            recovery_s: recs.iter().find_map(|r| r.recovery_s),
            wall_s: wall,
            error: o.as_ref().and_then(|o| o.error.clone()).or(torn_ck),
        };
        println!(
            "  {:>3} {:<44} detected {:<5} hang {:<5} torn {:<5} equal {:<5} restarts {} det {} rec {}",
            t,
            row.fault,
            row.detected,
            row.hang,
            row.torn_checkpoint,
            row.equal_to_clean,
            row.restarts,
            row.detection_s.map_or("-".into(), |d| format!("{d:.3}s")),
            row.recovery_s.map_or("-".into(), |d| format!("{d:.3}s")),
        );
        rows.push(row);
        let _ = std::fs::remove_dir_all(&dir);
    }
    let summary = CampaignSummary {
        trials: rows.len(),
        faults_detected: rows.iter().filter(|r| r.detected).count(),
        faults_that_must_be_detected: rows.iter().filter(|r| r.must_detect == Some(true)).count(),
        missed_detections: rows
            .iter()
            .filter(|r| r.must_detect == Some(true) && !r.detected)
            .count(),
        false_detections: rows
            .iter()
            .filter(|r| r.must_detect == Some(false) && r.detected)
            .count(),
        hangs: rows.iter().filter(|r| r.hang).count(),
        torn_checkpoints: rows.iter().filter(|r| r.torn_checkpoint).count(),
        runs_equal_to_clean: rows.iter().filter(|r| r.equal_to_clean).count(),
        runs_completed: rows.iter().filter(|r| r.completed).count(),
        median_detection_s: median(rows.iter().filter_map(|r| r.detection_s).collect()),
        median_recovery_s: median(rows.iter().filter_map(|r| r.recovery_s).collect()),
        checkpoint_interval_steps: a.checkpoint_every(),
        checkpoint_interval_s: interval_s,
        clean_run_s: clean_s,
        campaign_s: started.elapsed().as_secs_f64(),
    };
    println!("summary:");
    println!("  trials                  {}", summary.trials);
    println!(
        "  faults detected         {} ({} had to be; {} missed, {} tolerated faults flagged)",
        summary.faults_detected,
        summary.faults_that_must_be_detected,
        summary.missed_detections,
        summary.false_detections
    );
    println!("  hangs                   {}", summary.hangs);
    println!("  torn checkpoints        {}", summary.torn_checkpoints);
    println!(
        "  runs equal to clean     {} of {} ({} completed)",
        summary.runs_equal_to_clean, summary.trials, summary.runs_completed
    );
    let f = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.3} s"));
    println!(
        "  median detection        {} (checkpoint interval {} steps ~ {:.3} s, timeout {} s)",
        f(summary.median_detection_s),
        a.checkpoint_every(),
        interval_s,
        a.timeout
    );
    println!(
        "  median recovery         {} ({:.2}x the checkpoint interval)",
        f(summary.median_recovery_s),
        summary.median_recovery_s.map_or(f64::NAN, |r| r / interval_s.max(1e-9))
    );
    if let Some(p) = &a.json {
        let doc = serde_json::json!({"summary": summary, "trials": rows, "args": format!("{a:?}")});
        report::write_json(p, &doc)?;
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

/// The fields of a fault record the campaign reads back.
#[derive(Deserialize)]
struct FaultRecordView {
    detected: bool,
    detection_s: Option<f64>,
    recovery_s: Option<f64>,
}
