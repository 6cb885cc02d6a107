//! Fault-injection suite (issue 6): kills at every phase with a restart, stalls under and over
//! the timeout, corrupted, delayed and lossy links, the hang report and the `shardline` flags.
//! Every case runs under a deadline; final parameters are compared bitwise with a clean run.

mod common;
use common::*;
use shardline_runtime::checkpoint::{self, Checkpoint};
use shardline_runtime::doctor::Diagnosis;
use shardline_runtime::fault::{FaultInjector, FaultPlan};
use shardline_runtime::supervise::{run_supervised, Supervised};
use shardline_runtime::train::{RunOptions, Summary, TrainConfig};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Instant;

const STEPS: u64 = 6;
const EVERY: u64 = 2;

fn cfg() -> TrainConfig {
    small_cfg(3, 3, STEPS, 48)
}

fn opts(dir: &Path) -> RunOptions {
    RunOptions { checkpoint_dir: Some(dir.to_path_buf()), checkpoint_every: EVERY, ..quiet() }
}

/// The clean run every faulty run must end equal to (computed once).
fn clean() -> &'static Summary {
    static CLEAN: OnceLock<Summary> = OnceLock::new();
    CLEAN.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        run_ok(cfg(), opts(dir.path()))
    })
}

/// `run_supervised` on its own thread; a run past the deadline fails the test (a hang).
fn supervised(cfg: TrainConfig, o: RunOptions, faults: &[&str], restarts: u32) -> Supervised {
    let specs: Vec<String> = faults.iter().map(|s| s.to_string()).collect();
    let plan = FaultPlan::parse(&specs, 11).expect("valid plan");
    let inj = FaultInjector::new(plan);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(run_supervised(cfg, o, Some(inj), restarts));
    });
    rx.recv_timeout(RUN_DEADLINE)
        .unwrap_or_else(|_| panic!("{faults:?}: no result within {RUN_DEADLINE:?} (a hang)"))
}

/// Every committed checkpoint verifies (no torn checkpoint) and the latest is the last step.
fn assert_checkpoints_intact(dir: &Path, what: &str) {
    let mut n = 0;
    for e in std::fs::read_dir(dir).expect("list checkpoint dir") {
        let p = e.expect("entry").path();
        if p.join("manifest.json").is_file() {
            Checkpoint::open(&p)
                .and_then(|c| c.verify())
                .unwrap_or_else(|e| panic!("{what}: torn checkpoint {}: {e}", p.display()));
            n += 1;
        }
    }
    assert!(n >= 1, "{what}: no committed checkpoint");
    let latest = checkpoint::latest(dir).expect("list").expect("latest");
    let c = Checkpoint::open(latest).expect("open latest");
    assert_eq!(c.manifest().step, STEPS, "{what}: latest checkpoint step");
}

fn kill_and_recover(phase: &str, step: u64) {
    let what = format!("kill rank 1 at step {step} ({phase})");
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = format!("kill:rank=1:step={step}:phase={phase}");
    let t0 = Instant::now();
    let s = supervised(cfg(), opts(dir.path()), &[&spec], 1);
    let summary = s.result.unwrap_or_else(|e| panic!("{what}: run failed: {e}"));
    assert_eq!(s.restarts, 1, "{what}");
    assert!(s.failures[0].contains("rank 1 died"), "{what}: {:?}", s.failures);
    let rec = &s.faults[0];
    assert!(rec.detected, "{what}: {rec:?}");
    // Detected well before the collective timeout would have fired (30 s).
    let det = rec.detection_s.expect("detection time");
    assert!(det < 30.0, "{what}: detection {det} s is not below the 30 s timeout");
    assert!(rec.recovery_s.is_some(), "{what}: no recovery time: {rec:?}");
    assert!(t0.elapsed() < RUN_DEADLINE);
    assert_eq!(summary.total_steps, STEPS, "{what}");
    assert!(bits_eq(&summary.final_params, &clean().final_params), "{what}: final params");
    assert!(bits_eq(&summary.final_buffers, &clean().final_buffers), "{what}: final buffers");
    assert_checkpoints_intact(dir.path(), &what);
}

/// ACT-3 (the dead rank is named), SUP-1 and SUP-3 (detection and recovery times reported).
#[test]
fn kill_in_forward_restarts_and_ends_equal() {
    kill_and_recover("forward", 3);
}

#[test]
fn kill_in_backward_restarts_and_ends_equal() {
    kill_and_recover("backward", 4);
}

#[test]
fn kill_in_reduce_restarts_and_ends_equal() {
    kill_and_recover("reduce", 5);
}

/// SUP-1: the restart resumes from the last committed checkpoint, not the torn one.
#[test]
fn kill_during_checkpoint_write_keeps_the_previous_one() {
    // The step-4 checkpoint is being written when rank 1 dies: it must never be committed
    // torn, and the restart resumes from step 2.
    let dir = tempfile::tempdir().expect("tempdir");
    let s = supervised(cfg(), opts(dir.path()), &["kill:rank=1:step=4:phase=checkpoint"], 0);
    let e = s.result.expect_err("the kill fails the job without restarts");
    assert!(e.to_string().contains("rank 1 died"), "{e}");
    let latest = checkpoint::latest(dir.path()).expect("list").expect("a committed checkpoint");
    let c = Checkpoint::open(&latest).expect("open");
    assert_eq!(c.manifest().step, 2, "the step-4 checkpoint was committed despite the kill");
    c.verify().expect("the previous checkpoint verifies");
    // With a restart the job continues from there and ends as the clean run does.
    kill_and_recover("checkpoint", 4);
}

/// ACT-3: `rank 2 died`, well inside the collective timeout.
#[test]
fn kill_without_restarts_is_reported_promptly() {
    let s = supervised(cfg(), quiet(), &["kill:rank=2:step=2:phase=backward"], 0);
    let e = s.result.expect_err("a kill without restarts fails");
    assert!(e.to_string().contains("rank 2 died"), "{e}");
    assert_eq!(s.restarts, 0);
    let det = s.faults[0].detection_s.expect("detected");
    assert!(det < 30.0, "detection {det} s");
}

#[test]
fn kill_without_checkpoints_restarts_from_scratch() {
    let s = supervised(cfg(), quiet(), &["kill:rank=0:step=5:phase=forward"], 1);
    let summary = s.result.expect("restarted from scratch");
    assert_eq!((s.restarts, summary.steps), (1, STEPS));
    assert!(bits_eq(&summary.final_params, &clean().final_params));
}

#[test]
fn stall_under_the_timeout_is_not_a_failure() {
    let s = supervised(cfg(), quiet(), &["stall:rank=1:step=2:secs=0.4"], 0);
    let summary = s.result.expect("a slow rank is not a dead one");
    assert_eq!(s.restarts, 0);
    assert_eq!(s.faults.len(), 1);
    assert!(!s.faults[0].detected, "{:?}", s.faults[0]);
    assert!(bits_eq(&summary.final_params, &clean().final_params));
}

/// ACT-1, ACT-2 and DRIVE-3 (the stalled rank's timeout is the root cause, not the aborts it
/// causes) and ACT-4
/// (the dump at the failure names the rank behind).
#[test]
fn stall_over_the_timeout_is_a_timeout_naming_the_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dump = dir.path().join("dump.json");
    let mut c = cfg();
    c.timeout_s = 1;
    let o = RunOptions { dump_on_failure: Some(dump.clone()), ..quiet() };
    let s = supervised(c, o, &["stall:rank=2:step=3:secs=4"], 0);
    let e = s.result.expect_err("a stall past the timeout fails").to_string();
    assert!(e.contains("timeout") && e.contains("rank 2"), "{e}");
    assert!(s.faults[0].detected);
    // The dump names rank 2 as behind on the op the others wait in.
    let d = Diagnosis::load(&dump).expect("dump written at the failure");
    assert!(d.is_timeout(), "{}", d.error);
    let behind: Vec<usize> = d.behind().iter().map(|b| b.0).collect();
    assert_eq!(behind.first(), Some(&2), "{}", d.report());
    assert!(d.report().contains("rank 2 is behind"), "{}", d.report());
}

#[test]
fn stall_over_the_timeout_recovers_with_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = cfg();
    c.timeout_s = 1;
    let s = supervised(c, opts(dir.path()), &["stall:rank=0:step=3:secs=3"], 1);
    let summary = s.result.expect("restarted after the timeout");
    assert_eq!(s.restarts, 1);
    assert!(bits_eq(&summary.final_params, &clean().final_params));
    assert_checkpoints_intact(dir.path(), "stall over timeout");
}

#[test]
fn corrupt_frames_are_reported_never_used() {
    let s = supervised(cfg(), quiet(), &["corrupt:link=0-1:p=1"], 1);
    let e = s.result.expect_err("every frame on 0-1 is corrupt").to_string();
    assert!(e.contains("corrupt frame"), "{e}");
    assert_eq!(s.restarts, 1);
    assert!(s.failures.iter().all(|f| f.contains("corrupt frame")), "{:?}", s.failures);
    assert!(s.faults.iter().any(|f| f.kind == "corrupt" && f.detected), "{:?}", s.faults);
}

#[test]
fn rare_corruption_is_caught_and_recovered() {
    // Some frames are corrupted; each is caught by its checksum, and the restarted group
    // (which draws afresh) ends equal to the clean run: nothing corrupt was ever used.
    let dir = tempfile::tempdir().expect("tempdir");
    let s = supervised(cfg(), opts(dir.path()), &["corrupt:link=1-2:p=0.02"], 8);
    let summary = s.result.expect("recovered");
    assert!(s.restarts >= 1, "p = 0.02 over a run corrupts at least one frame");
    assert!(bits_eq(&summary.final_params, &clean().final_params));
}

#[test]
fn delayed_links_complete_equal_to_clean() {
    let s = supervised(cfg(), quiet(), &["delay:link=0-1:ms=3:jitter=2", "delay:link=1-2:ms=1"], 0);
    let summary = s.result.expect("delays are not failures");
    assert!(bits_eq(&summary.final_params, &clean().final_params));
}

#[test]
fn lossy_links_are_retransmitted_or_reported() {
    let s = supervised(cfg(), quiet(), &["drop:link=0-2:p=0.3"], 0);
    let summary = s.result.expect("losses at 30% are retransmitted");
    assert!(bits_eq(&summary.final_params, &clean().final_params));
    let s = supervised(cfg(), quiet(), &["drop:link=0-2:p=1"], 0);
    let e = s.result.expect_err("a link losing everything is down").to_string();
    assert!(e.contains("transmissions lost"), "{e}");
}

/// Runs `shardline ARGS` with a deadline.
fn shardline(args: &[&str]) -> (Option<i32>, String, String) {
    let child = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start shardline");
    let (tx, rx) = mpsc::channel();
    let pid = child.id();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(RUN_DEADLINE) {
        Ok(Ok(o)) => (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        ),
        _ => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("shardline {args:?} did not exit within {RUN_DEADLINE:?}");
        }
    }
}

const SMALL: &[&str] = &[
    "train",
    "--world",
    "2",
    "--steps",
    "4",
    "--batch-size",
    "32",
    "--hidden",
    "16",
    "--depth",
    "1",
    "--no-progress",
];

#[test]
fn cli_refuses_malformed_fault_specs_with_exit_2() {
    for bad in ["kill:rank=1", "explode:x=1", "drop:link=0-1:p=3", "kill:rank=5:step=1"] {
        let mut args = SMALL.to_vec();
        args.extend(["--fault", bad]);
        let (code, _, err) = shardline(&args);
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("--fault"), "{bad}: {err}");
    }
}

/// FAULT-3 (injection, detection and recovery logged), SUP-3 (their times in --log-json), ACT-4.
#[test]
fn cli_restarts_reports_times_and_doctor_reads_the_dump() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ck, log, dump) =
        (dir.path().join("ck"), dir.path().join("log.json"), dir.path().join("dump.json"));
    let mut args = SMALL.to_vec();
    let (ck_s, log_s, dump_s) =
        (ck.display().to_string(), log.display().to_string(), dump.display().to_string());
    args.extend([
        "--fault",
        "kill:rank=1:step=3:phase=backward",
        "--max-restarts",
        "1",
        "--checkpoint-dir",
        &ck_s,
        "--checkpoint-every",
        "2",
        "--log-json",
        &log_s,
        "--dump-on-failure",
        &dump_s,
    ]);
    let (code, out, err) = shardline(&args);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("restart 1/1") && out.contains("detected in"), "{out}");
    let text = std::fs::read_to_string(&log).expect("log");
    let fault: serde_json::Value = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "fault")
        .expect("a fault line in --log-json");
    assert!(fault["detection_s"].as_f64().is_some() && fault["recovery_s"].as_f64().is_some());
    let (code, report, err) = shardline(&["doctor", &dump_s]);
    assert_eq!(code, Some(0), "{err}");
    assert!(report.contains("rank 1 first") && report.contains("lane"), "{report}");
}
