//! One configuration run with every rank in one process (`shardline train --world W`) and
//! launched as W processes (`shardline launch --nproc-per-node W -- train`): one driver runs
//! both, so their `--log-json` logs have the same keys and bitwise the same job figures on
//! every line (DRIVE-1).

mod common;
use common::shardline;
use std::path::Path;

/// The figures of a step that are the job's, not a rank's or a clock's.
const JOB_FIGURES: [&str; 6] = ["step", "epoch", "loss", "lr", "grad_norm", "stats_messages"];

/// Runs `shardline ARGS` with the common deadline; panics with its output unless it exits 0.
fn run(args: &[String]) {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = shardline(&refs);
    assert_eq!(o.code, Some(0), "shardline {args:?}\n{}\n{}", o.stdout, o.stderr);
}

fn read_log(path: &Path) -> Vec<serde_json::Map<String, serde_json::Value>> {
    let text = std::fs::read_to_string(path).expect("read log");
    text.lines()
        .map(|l| match serde_json::from_str(l) {
            Ok(serde_json::Value::Object(m)) => m,
            other => panic!("bad log line {l}: {other:?}"),
        })
        .collect()
}

/// A number as its exact bits (f32 figures are logged as the f64 they widen to).
fn bits(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => {
            format!("{:x}", n.as_f64().unwrap_or(0.0).to_bits())
        }
        other => other.to_string(),
    }
}

fn in_process_and_launched_agree(world: usize, stage: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let train: Vec<String> = [
        "train",
        "--hidden",
        "32",
        "--depth",
        "2",
        "--batch-size",
        "48",
        "--steps",
        "4",
        "--stage",
        stage,
        "--sync-bn",
        "on",
        "--optimizer",
        "adamw",
        "--clip-grad-norm",
        "1.0",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let local = dir.path().join("local.jsonl");
    let launched = dir.path().join("launched.jsonl");
    let mut a = train.clone();
    a.extend(["--world".into(), world.to_string(), "--log-json".into(), path(&local)]);
    run(&a);
    let mut b: Vec<String> = ["launch", "--nproc-per-node", &world.to_string(), "--"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    b.extend(train);
    b.extend(["--log-json".into(), path(&launched)]);
    run(&b);

    let (la, lb) = (read_log(&local), read_log(&launched));
    assert_eq!(la.len(), 4, "one line per step in one process");
    assert_eq!(lb.len(), 4, "one line per step launched");
    for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
        let keys = |m: &serde_json::Map<String, serde_json::Value>| {
            m.keys().cloned().collect::<std::collections::BTreeSet<_>>()
        };
        assert_eq!(keys(x), keys(y), "step {}: the two logs have different keys", i + 1);
        for k in JOB_FIGURES {
            let (vx, vy) = (&x[k], &y[k]);
            assert!(!vx.is_null(), "step {}: {k} missing", i + 1);
            assert_eq!(
                bits(vx),
                bits(vy),
                "world {world} stage {stage} step {}: {k} {vx} in one process, {vy} launched",
                i + 1
            );
        }
    }
    assert!(la[0]["stats_messages"].as_u64().is_some_and(|n| n > 0), "SyncBN sends statistics");
}

fn path(p: &Path) -> String {
    p.to_str().expect("utf-8 temp path").to_owned()
}

/// DRIVE-1
#[test]
fn in_process_and_launched_logs_agree_world_2_stage_0() {
    in_process_and_launched_agree(2, "0");
}

/// DRIVE-1
#[test]
fn in_process_and_launched_logs_agree_world_3_stage_2() {
    in_process_and_launched_agree(3, "2");
}

/// DRIVE-1
#[test]
fn in_process_and_launched_logs_agree_world_4_stage_3() {
    in_process_and_launched_agree(4, "3");
}
