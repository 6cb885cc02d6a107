//! `shardline-bench faults --live` (LIVEB-n in the bench's `faults_live` module) on
//! namespace nodes: a few trials of the live-recovery campaign, each fault run with and
//! without `--live-recovery`. Every process carries a deadline (NETNS-3). Needs root: without
//! it the tests skip and say why (NETNS-8); as root a harness that fails fails them.
//! Needs `shardline-bench` and `shardline` built (`cargo build -p shardline-bench -p
//! shardline-runtime`; `cargo test --workspace` builds both).

use shardline_tests::launch::{shardline, spawn, wait_output};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The `shardline-bench` binary beside `shardline` (`target/<profile>/`).
fn bench() -> PathBuf {
    let bin = shardline().with_file_name("shardline-bench");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build -p shardline-bench` first",
        bin.display()
    );
    bin
}

fn campaign(args: &[&str], json: &Path, deadline: Duration) -> Output {
    let mut cmd = Command::new(bench());
    cmd.args(["faults", "--live"]).args(args).arg("--json").arg(json);
    cmd.env("SHARDLINE_BIN", shardline());
    wait_output(spawn(cmd), Instant::now() + deadline, "shardline-bench faults --live")
}

fn text(o: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Three trials (seed 21 draws a kill at stage 0, node 3's agent killed and started again,
/// and a kill under HSDP 2x2): no run hangs, none loses data, and each kill recovered in
/// place ends bitwise equal to the clean run (LIVEB-2), as does every other run here.
#[test]
fn three_trials_neither_hang_nor_lose_data_and_kills_end_bitwise_liveb_2() {
    let test = "three_trials_neither_hang_nor_lose_data_and_kills_end_bitwise_liveb_2";
    if !shardline_tests::netns::root_or_skip(test) {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let json = tmp.path().join("live.json");
    let args = ["--trials", "3", "--seed", "21", "--kinds", "kill,stall,node-return"];
    let o = campaign(&[&args[..], &["--trial-deadline", "40"]].concat(), &json, DEADLINE);
    let log = text(&o);
    println!("{log}");
    assert!(o.status.success(), "{log}");
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("json")).expect("parse");
    let s = &doc["summary"];
    for mode in ["live", "restart"] {
        assert_eq!(s[mode]["runs"], 3, "{mode}: {log}");
        assert_eq!(s[mode]["hangs"], 0, "{mode}: {log}");
        assert_eq!(s[mode]["lost_data"], 0, "{mode}: {log}");
        assert_eq!(s[mode]["runs_with_an_agent_failed"], 0, "{mode}: {log}");
        assert_eq!(s[mode]["faults_not_fired"], 0, "{mode}: {log}");
        assert_eq!(s[mode]["failures_seen"], 3, "{mode}: {log}");
    }
    assert_eq!(s["bitwise_required"], 2, "{log}");
    assert_eq!(s["bitwise_required_equal"], 2, "{log}");
    let trials = doc["trials"].as_array().expect("trials");
    for t in trials.iter().filter(|t| t["kind"] == "kill") {
        assert_eq!(t["live"]["recovered"], "in-place", "{t}");
        assert_eq!(t["live"]["steps_run_again"], 0, "{t}");
    }
}

/// The campaign's own bound on every run (NETNS-3 for the test).
const DEADLINE: Duration = Duration::from_secs(180);

/// LIVEB-4: a run that outlives `--trial-deadline` is killed with its agents and workers and
/// counted as a hang; here the clean run itself (5000 steps in a 1 s deadline), so the
/// campaign stops at once, saying so, instead of waiting for the job.
#[test]
fn a_run_past_its_deadline_is_killed_and_counted_as_a_hang_liveb_4() {
    let test = "a_run_past_its_deadline_is_killed_and_counted_as_a_hang_liveb_4";
    if !shardline_tests::netns::root_or_skip(test) {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let json = tmp.path().join("live.json");
    let args =
        ["--trials", "1", "--steps", "5000", "--trial-deadline", "1", "--settings", "stage0"];
    let o = campaign(&args, &json, Duration::from_secs(60));
    let log = text(&o);
    assert_eq!(o.status.code(), Some(1), "{log}");
    assert!(log.contains("the clean stage0 run failed") && log.contains("hang: true"), "{log}");
}

/// Flags the live campaign cannot run with exit 2 naming the flag, root or not.
#[test]
fn bad_live_flags_exit_2_naming_the_flag() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let json = tmp.path().join("x.json");
    for (args, says) in [
        (&["--world", "3"][..], "--world"),
        (&["--kinds", "meteor"][..], "--kinds"),
        (&["--steps", "4"][..], "--steps"),
    ] {
        let o = campaign(args, &json, Duration::from_secs(30));
        let log = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {log}");
        assert!(log.contains(says), "{args:?}: {log}");
    }
    // A live-only flag without --live.
    let mut cmd = Command::new(bench());
    cmd.args(["faults", "--kinds", "kill"]);
    let o = wait_output(spawn(cmd), Instant::now() + Duration::from_secs(30), "faults");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--live"), "{}", text(&o));
}
