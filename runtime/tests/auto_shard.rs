//! `--stage auto --profile` (AUTO-1..5) through the CLI: the candidates printed, the choice
//! within the cap, 8-bit wires only with `--allow-lossy-comm`, bad input exiting 2 naming the
//! flag; and over two launched nodes on a slow link, the node group when it fits.

mod common;

use common::{finish, free_port, shardline};
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{self, StageChoice, TrainConfig};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn fixture() -> String {
    format!("{}/tests/fixtures/two-links-profile.json", env!("CARGO_MANIFEST_DIR"))
}

/// Many small units and no optimizer state: model state outweighs the gathered units and
/// gradients in flight, so a shard group of half the world fits below stage 2 over it.
const MODEL: [&str; 12] = [
    "--hidden",
    "128",
    "--depth",
    "32",
    "--momentum",
    "0",
    "--batch-size",
    "32",
    "--steps",
    "2",
    "--sync-bn",
    "off",
];

/// [`MODEL`] wider and deeper.
const WIDE: [&str; 12] = [
    "--hidden",
    "256",
    "--depth",
    "64",
    "--momentum",
    "0",
    "--batch-size",
    "32",
    "--steps",
    "2",
    "--sync-bn",
    "off",
];

fn cfg(world: usize) -> TrainConfig {
    TrainConfig {
        world,
        hidden: Some(128),
        depth: Some(32),
        momentum: 0.0,
        batch_size: 32,
        steps: Some(2),
        sync_bn: train::SyncBnMode::Off,
        stage: StageChoice::Fixed(Stage::Zero3),
        ..TrainConfig::default()
    }
}

/// `--stage auto`'s estimate of `stage` for `cfg` with shard groups of `g`: the stage's model
/// state in a world of `g` plus one microbatch's activations at the job's world (HSDP-2).
fn estimate(cfg: &TrainConfig, stage: Stage, g: usize) -> u64 {
    let p = train::plan(cfg).expect("plan");
    let act = shardline_runtime::activations::activation_peak(&*p.model, &p.train, cfg).unwrap();
    let at_g = TrainConfig { world: g, ..cfg.clone() };
    let est = train::stage_estimates(&*p.model, &at_g).unwrap();
    est.iter().find(|(s, _)| *s == stage).unwrap().1 + act
}

fn chose(stdout: &str) -> &str {
    stdout.lines().find(|l| l.trim_start().starts_with("chose ")).unwrap_or("")
}

/// AUTO-2: a cap that only stage 3 over the world fits picks it, after a line per candidate.
#[test]
fn a_cap_only_full_shard_fits_picks_stage_3_auto_2() {
    let c = cfg(4);
    let cap = estimate(&c, Stage::Zero3, 4);
    assert!(estimate(&c, Stage::Zero2, 4) > cap && estimate(&c, Stage::Zero3, 2) > cap);
    let cap = cap.to_string();
    let f = fixture();
    let mut args = vec!["train", "--world", "4", "--stage", "auto", "--profile", &f];
    args.extend(["--device-memory", &cap, "--no-progress"]);
    args.extend(MODEL);
    let out = shardline(&args);
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    assert!(chose(&out.stdout).contains("stage 3, group world (4 ranks)"), "{}", out.stdout);
    // Stage 0 over the world, stages 1-3 over groups of 4, 2 and 1: ten lines.
    let lines = out.stdout.lines().filter(|l| l.contains("communication ~")).count();
    assert_eq!(lines, 10, "{}", out.stdout);
    assert!(out.stdout.contains("world 4, stage 3"), "{}", out.stdout);
}

/// AUTO-1: 8-bit wires are listed and chosen only with --allow-lossy-comm (they send a
/// quarter of the gather bytes, so with it they win).
#[test]
fn lossy_wires_only_with_the_opt_in_auto_1() {
    let f = fixture();
    let base = ["train", "--world", "4", "--stage", "auto", "--profile", &f, "--no-progress"];
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend(MODEL);
        a.extend(extra);
        let out = shardline(&a);
        assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
        out.stdout
    };
    let plain = run(&[]);
    assert!(!plain.contains("[lossy]") && !chose(&plain).contains("int8"), "{plain}");
    assert!(!plain.contains("gathers: int8"), "{plain}");
    let lossy = run(&["--allow-lossy-comm"]);
    assert!(lossy.contains("[lossy]"), "{lossy}");
    assert!(chose(&lossy).contains("int8"), "{lossy}");
}

/// Bad input exits 2 naming the flag.
#[test]
fn bad_auto_input_exits_2_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, "{ not a profile").unwrap();
    let junk = junk.to_str().unwrap().to_string();
    let missing = dir.path().join("none.json").to_str().unwrap().to_string();
    let base = ["train", "--world", "2", "--steps", "1", "--batch-size", "8", "--no-progress"];
    let f = fixture();
    let cases: [(&[&str], &str); 6] = [
        (&["--allow-lossy-comm"], "--allow-lossy-comm"),
        (&["--stage", "auto", "--allow-lossy-comm"], "--allow-lossy-comm"),
        (&["--profile", &f], "--profile prices"),
        (&["--shard-group", "auto"], "--shard-group auto"),
        (&["--stage", "auto", "--profile", &junk], "not a machine profile"),
        (&["--stage", "auto", "--profile", &missing], "--profile"),
    ];
    for (extra, want) in cases {
        let mut a: Vec<&str> = base.to_vec();
        a.extend(extra);
        let out = shardline(&a);
        assert_eq!(out.code, Some(2), "{extra:?}: {}\n{}", out.stdout, out.stderr);
        assert!(out.stderr.contains(want), "{extra:?}: want '{want}' in {}", out.stderr);
    }
}

const DEADLINE: Duration = Duration::from_secs(120);

fn agent(node: usize, port: u16, train: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(["launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank"])
        .arg(node.to_string())
        .args(["--rdzv", &format!("127.0.0.1:{port}"), "--token", "t0k", "--"])
        .args(train)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting shardline launch")
}

/// Two nodes of two ranks, `--stage auto --profile` with 1 Gbit/s across and `cap`: node 0's
/// output.
fn two_nodes(cap: u64, log: &std::path::Path) -> String {
    let (cap, f, log) = (cap.to_string(), fixture(), log.to_str().unwrap().to_string());
    let mut train = vec!["train", "--stage", "auto", "--profile", &f, "--device-memory", &cap];
    train.extend(["--log-json", &log]);
    // Wider: the estimate leaves out the lanes' staging (comm buffers), which the run's cap
    // counts; the caps below leave the gap to the next candidate for it.
    train.extend(WIDE);
    train.push("--no-progress");
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    let (a, b) = (agent(0, port, &train), agent(1, port, &train));
    let (a, b) = (finish(a, deadline), finish(b, deadline));
    let (oa, ea, eb) = (
        String::from_utf8_lossy(&a.stdout).to_string(),
        String::from_utf8_lossy(&a.stderr),
        String::from_utf8_lossy(&b.stderr),
    );
    assert!(a.status.success() && b.status.success(), "node 0:\n{oa}\n{ea}\nnode 1:\n{eb}");
    oa
}

/// AUTO-3 launched on two nodes: on a slow link across, the node group at stage 3 when it
/// fits (stage 2 over the world, as cheap, holds more), full shard when only that fits.
#[test]
fn two_nodes_on_a_slow_link_choose_the_node_group_when_it_fits_auto_3() {
    let c = TrainConfig { hidden: Some(256), depth: Some(64), ..cfg(4) };
    let (node, world) = (estimate(&c, Stage::Zero3, 2), estimate(&c, Stage::Zero3, 4));
    let stage2 = estimate(&c, Stage::Zero2, 4);
    assert!(stage2 > node && node > world, "premise");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.jsonl");
    let out = two_nodes(stage2 - 1, &log);
    assert!(out.contains("2 node(s) of 2 ranks"), "{out}");
    assert!(chose(&out).contains("stage 3, group node (2 ranks)"), "{out}");
    assert!(out.contains("shard group: the ranks of each node (HSDP)"), "{out}");
    // HYB-4 in the log: rank 0's transport sent inside its node (the shard group's gathers)
    // and across (the replica all-reduce) in every step.
    let text = std::fs::read_to_string(&log).unwrap();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let (inside, across) = (v["intra_node_bytes"].as_u64(), v["inter_node_bytes"].as_u64());
        assert!(inside > Some(0) && across > Some(0), "{line}");
        // ... and no gather crossed a node (HSDP-3).
        assert_eq!(v["inter_node_gather_bytes"].as_u64(), Some(0), "{line}");
    }
    let log2 = dir.path().join("log2.jsonl");
    let out = two_nodes(node - 1, &log2);
    assert!(chose(&out).contains("stage 3, group world (4 ranks)"), "{out}");
    // Full shard: the gathers cross the nodes every step (HYB-4).
    for line in std::fs::read_to_string(&log2).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v["inter_node_gather_bytes"].as_u64() > Some(0), "{line}");
    }
}
