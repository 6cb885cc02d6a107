//! The benchmark binary's command line: bad flags exit 2 with a message naming the flag
//! (clap's own errors and the checks clap cannot make alike), and a small run works.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `shardline-bench` with a deadline (a hang fails the test instead of blocking it).
fn bench(args: &[&str]) -> Out {
    let mut child = Command::new(env!("CARGO_BIN_EXE_shardline-bench"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start shardline-bench");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("shardline-bench {args:?} did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().expect("output");
    Out {
        code: o.status.code(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

#[test]
fn bad_flags_exit_2_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["collectives", "--transport", "carrier-pigeon"], "carrier-pigeon"),
        (&["collectives", "--world", "0"], "--world must be at least 1"),
        (&["collectives", "--min-bytes", "8K", "--max-bytes", "4K"], "is larger than --max-bytes"),
        (&["collectives", "--min-bytes", "0", "--max-bytes", "0"], "no size to measure"),
        (&["collectives", "--iters", "0"], "--iters must be at least 1"),
        (&["overlap", "--world", "1"], "--world must be at least 2"),
        (&["overlap", "--steps", "3", "--warmup", "4"], "must be larger than --warmup"),
        (&["overlap", "--nodes", "2"], "--nodes needs --link-rate"),
        (&["overlap", "--busbw-sizes", "lots"], "lots"),
        (&["syncbn", "--seeds", "0"], "--seeds must be at least 1"),
        (&["memory", "--world", "0"], "--world must be at least 1"),
        (&["memory-measured", "--recompute", "some"], "--recompute takes none, units"),
        (&["memory-measured", "--models", "vgg"], "unknown model 'vgg'"),
        (&["faults", "--world", "1"], "--world must be at least 2"),
        (&["ckpt-stall", "--every", "0"], "--every 0 must be at least 1"),
        (&["ckpt-stall", "--model", "vgg"], "--model vgg: gpt or wide-mlp"),
        (&["no-such-benchmark"], "no-such-benchmark"),
    ];
    for (args, needle) in cases {
        let o = bench(args);
        assert_eq!(o.code, Some(2), "{args:?}: exit code; stderr: {}", o.stderr);
        assert!(o.stderr.contains(needle), "{args:?}: stderr lacks '{needle}': {}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{args:?}: {}", o.stderr);
    }
}

/// machine-profile refuses a --products file that is not `plan --json`'s, and allocation
/// sizes below one float, before any probe runs.
#[test]
fn machine_profile_bad_products_and_alloc_exit_2() {
    let dir = std::env::temp_dir().join(format!("shardline-mp-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let coll = dir.join("coll.json");
    let row = r#"{"op":"all-reduce","world":2,"transport":"local","bytes":4096,"time_us":10.0}"#;
    std::fs::write(&coll, format!(r#"{{"rows":[{row}]}}"#)).unwrap();
    let (coll, out) = (coll.to_str().unwrap(), dir.join("p.json"));
    let missing = dir.join("missing.json");
    let cases: &[(&[&str], &str)] = &[
        (&["--products", missing.to_str().unwrap()], "--products"),
        (&["--products", coll], "not a `shardline plan --json` file"),
        (&["--alloc", "4096,2"], "--alloc 2"),
    ];
    for (args, needle) in cases {
        let mut all =
            vec!["machine-profile", "--collectives", coll, "--out", out.to_str().unwrap()];
        all.extend_from_slice(args);
        let o = bench(&all);
        assert_eq!(o.code, Some(2), "{args:?}: exit code; stderr: {}", o.stderr);
        assert!(o.stderr.contains(needle), "{args:?}: stderr lacks '{needle}': {}", o.stderr);
    }
    assert!(!out.exists(), "no profile written");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_small_local_run_prints_its_table_and_checks_results() {
    let o = bench(&[
        "collectives",
        "--transport",
        "local",
        "--world",
        "2",
        "--op",
        "all-reduce",
        "--min-bytes",
        "4K",
        "--max-bytes",
        "8K",
        "--iters",
        "3",
    ]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let rows: Vec<&str> =
        o.stdout.lines().filter(|l| l.trim_start().starts_with("all-reduce")).collect();
    assert_eq!(rows.len(), 2, "{}", o.stdout);
    for r in rows {
        let cols: Vec<&str> = r.split_whitespace().collect();
        assert_eq!(cols[6], "0", "#wrong in {r}");
    }
}

/// Both modes run the same job; each checkpoint's stall is recorded, and an asynchronous
/// one holds the loop for its snapshot only, not for the write.
#[test]
fn ckpt_stall_runs_both_modes_and_writes_json() {
    let dir = std::env::temp_dir().join(format!("ckpt-stall-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("checkpoint root");
    let json = dir.join("stall.json");
    let o = bench(&[
        "ckpt-stall",
        "--model",
        "wide-mlp",
        "--params",
        "2000000",
        "--rounds",
        "1",
        "--steps",
        "4",
        "--every",
        "2",
        "--dir",
        dir.to_str().expect("utf-8 temp path"),
        "--json",
        json.to_str().expect("utf-8 temp path"),
    ]);
    assert_eq!(o.code, Some(0), "{}\n{}", o.stdout, o.stderr);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("valid json");
    let _ = std::fs::remove_dir_all(&dir);
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    for r in runs {
        let steps: Vec<u64> = r["stalls"]
            .as_array()
            .expect("stalls")
            .iter()
            .map(|s| s["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, [2, 4], "{r}");
    }
    let modes = v["modes"].as_array().expect("modes");
    assert_eq!(
        (modes[0]["mode"].as_str(), modes[1]["mode"].as_str()),
        (Some("sync"), Some("async"))
    );
    // Synchronous: the loop waits for the whole write; none is left to wait for later.
    assert_eq!(modes[0]["median_waited_s"].as_f64(), Some(0.0));
    assert!(o.stdout.contains("blocked/ckpt"), "{}", o.stdout);
}

#[test]
fn memory_measured_runs_one_process_per_rank_meas_2() {
    // MEAS-1, MEAS-2: two rank processes each report their own figures; the tracker's
    // peak is at most the heap the process measurably held.
    let json = std::env::temp_dir().join(format!("memmeas-{}.json", std::process::id()));
    let json_s = json.to_str().expect("utf-8 path");
    let o = bench(&[
        "memory-measured",
        "--models",
        "mlp-bn",
        "--world",
        "2",
        "--stage",
        "3",
        "--steps",
        "1",
        "--recompute",
        "none",
        "--deadline-s",
        "100",
        "--json",
        json_s,
    ]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).expect("json");
    let _ = std::fs::remove_file(&json);
    let rows = doc["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{doc}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["rank"].as_u64(), Some(i as u64), "{r}");
        let acc = r["accounted_bytes"].as_u64().expect("accounted");
        let meas = r["measured_bytes"].as_u64().expect("measured");
        assert!(acc > 0 && r["baseline_bytes"].as_u64().expect("baseline") > 0, "{r}");
        assert!(meas >= acc, "MEAS-2: accounted {acc} > measured {meas}: {r}");
    }
}
