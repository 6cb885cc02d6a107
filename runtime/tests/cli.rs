//! The `shardline` command: usage errors and exit codes, checkpoint inspect/export, corrupted
//! shards, `--log-json` and `--trace` output, and `--device-memory`.

mod common;
use common::*;
use shardline_runtime::checkpoint::{self, shard_file_name, Checkpoint};
use shardline_runtime::shard::FlatLayout;
use shardline_runtime::train::RunOptions;
use std::path::Path;
use std::process::{Command, Stdio};

/// Flags of a small, fast training run.
const SMALL: &[&str] = &[
    "train",
    "--hidden",
    "32",
    "--depth",
    "2",
    "--batch-size",
    "60",
    "--steps",
    "3",
    "--no-progress",
];

fn small(extra: &[&str]) -> Vec<String> {
    SMALL.iter().chain(extra).map(|s| s.to_string()).collect()
}

fn run_small(extra: &[&str]) -> Out {
    let args = small(extra);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    shardline(&refs)
}

#[test]
fn help_works() {
    let o = shardline(&["--help"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(o.stdout.contains("train") && o.stdout.contains("checkpoint"), "{}", o.stdout);
    // The environment it reads, with defaults.
    for var in [
        "SHARDLINE_LOG",
        "SHARDLINE_TIMEOUT_MS",
        "SHARDLINE_TCP_CONGESTION",
        "SHARDLINE_LANE_SLICE_US",
        "SHARDLINE_SHM_SPIN_US",
        "SHARDLINE_TCP_SPIN_US",
    ] {
        assert!(o.stdout.contains(var), "--help lacks {var}: {}", o.stdout);
    }
    let o = shardline(&["train", "--help"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    for flag in ["--world", "--stage", "--device-memory", "--resume", "--log-json", "--trace"] {
        assert!(o.stdout.contains(flag), "train --help lacks {flag}");
    }
}

#[test]
fn usage_and_config_errors_exit_2_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["--bogus-flag"], "--bogus-flag"),
        (&["--world", "0"], "--world must be at least 1"),
        (&["--world", "two"], "--world"),
        (&["--model", "resnet-9000"], "unknown model 'resnet-9000'"),
        (&["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
        (&["--stage", "4"], "stage"),
        (&["--stage", "zero"], "--stage must be 0, 1, 2, 3 or auto"),
        (&["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
        (&["--resume"], "--resume needs --checkpoint-dir"),
        (&["--device-memory", "lots"], "--device-memory"),
        (&["--sync-bn", "maybe"], "--sync-bn"),
        (&["--world", "257"], "at most 256 run here"),
        (&["--dataset", "synthetic", "--samples", "0"], "the training set of 'synthetic' is empty"),
        (
            &["--model", "gpt", "--dataset", "text", "--dropout", "1.5"],
            "--dropout 1.5 must be in [0, 1)",
        ),
        (
            &["--model", "gpt", "--dataset", "text", "--n-embd", "30", "--n-head", "4"],
            "--n-embd 30 is not divisible by --n-head 4",
        ),
        // Without --dataset, gpt trains on the bundled text: the next error is gpt's own.
        (&["--model", "gpt", "--n-embd", "30", "--n-head", "4"], "--n-embd 30 is not divisible"),
        // Checked before the text is cut into windows of block_size + 1 tokens.
        (&["--model", "gpt", "--block-size", "0"], "--block-size must be at least 1"),
        // Terabytes per rank: refused before the allocation would abort the process.
        (
            &["--model", "gpt", "--n-embd", "400000", "--n-head", "1", "--n-layer", "1"],
            "of memory this process may use",
        ),
        (
            &["--model", "mlp-bn", "--width", "8"],
            "--width applies to --model resnet-bn, not 'mlp-bn'",
        ),
    ];
    for (extra, needle) in cases {
        let o = run_small(extra);
        assert_eq!(o.code, Some(2), "{extra:?}: exit code; stderr: {}", o.stderr);
        assert!(o.stderr.contains(needle), "{extra:?}: stderr lacks '{needle}': {}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{extra:?}: {}", o.stderr);
    }
    // The global batch is the last flag that wins; 0 must be refused, not divide by zero.
    let o = shardline(&["train", "--batch-size", "0", "--steps", "1", "--no-progress"]);
    assert_eq!(o.code, Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("--batch-size must be at least 1"), "{}", o.stderr);
    let o = shardline(&["train", "--hidden", "0", "--steps", "1", "--no-progress"]);
    assert_eq!(o.code, Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("--hidden must be at least 1"), "{}", o.stderr);
    let o = shardline(&["checkpoint", "inspect"]);
    assert_eq!(o.code, Some(2), "missing DIR: {}", o.stderr);
}

/// The first step whose loss is not finite is named once on stderr; the run goes on (its
/// log and checkpoints are the user's to judge).
#[test]
fn a_non_finite_loss_is_named_once_with_its_step() {
    let o = run_small(&["--lr", "1e30", "--optimizer", "sgd"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert_eq!(o.stderr.matches("(not finite)").count(), 1, "{}", o.stderr);
    assert!(o.stderr.contains("warning: step "), "{}", o.stderr);
    // A sound run says nothing of the kind.
    let o = run_small(&[]);
    assert!(!o.stderr.contains("not finite"), "{}", o.stderr);
}

/// Paths that hold no checkpoint, no dump or no directory are the caller's mistake: exit 2
/// naming the path (a checkpoint that fails verification is 1: see the corrupted-shard test).
#[test]
fn paths_of_the_wrong_kind_exit_2_naming_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "not a dump\n").expect("write");
    let (empty_s, file_s) = (empty.to_str().expect("utf-8"), file.to_str().expect("utf-8"));
    let out = dir.path().join("x.safetensors");
    let missing_dump = dir.path().join("no-such-dir").join("dump.json");
    let missing_dump = missing_dump.to_str().expect("utf-8").to_string();
    let cases: &[(&[&str], &str)] = &[
        (&["checkpoint", "inspect", empty_s], "no committed checkpoint here"),
        (
            &["checkpoint", "export", empty_s, "--out", out.to_str().expect("utf-8")],
            "no committed checkpoint here",
        ),
        (&["doctor", file_s], "is not a shardline failure dump"),
        (
            &["train", "--checkpoint-dir", file_s, "--steps", "1", "--no-progress"],
            "is a file, not a directory",
        ),
        (&["plan", "--model", "gpt", "--block-size", "0"], "--block-size must be at least 1"),
        (
            &["train", "--dump-on-failure", &missing_dump, "--steps", "1", "--no-progress"],
            "the directory",
        ),
    ];
    for (args, needle) in cases {
        let o = shardline(args);
        assert_eq!(o.code, Some(2), "{args:?}: exit code; stderr: {}", o.stderr);
        assert!(o.stderr.contains(needle), "{args:?}: stderr lacks '{needle}': {}", o.stderr);
        let named = args.iter().any(|a| o.stderr.contains(a) && a.contains('/'));
        assert!(named || !args.iter().any(|a| a.contains('/')), "{args:?}: {}", o.stderr);
    }
}

/// `--dataset` defaults to the bundled text for gpt (also when a `--config` file names the
/// model) and to digits otherwise.
#[test]
fn the_default_dataset_follows_the_model() {
    let gpt = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16"];
    let run = |args: &[&str]| {
        let o = shardline(args);
        assert_eq!(o.code, Some(0), "{args:?}: {}", o.stderr);
        o.stdout
    };
    let flags = [&["train", "--model", "gpt", "--steps", "1", "--no-progress"][..], &gpt].concat();
    let out = run(&flags);
    assert!(out.contains("gpt (") && out.contains(" on text ("), "{out}");
    let dir = std::env::temp_dir().join(format!("shardline-cli-dataset-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toml = dir.join("gpt.toml");
    std::fs::write(
        &toml,
        "[model]\nname = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n",
    )
    .unwrap();
    let out = run(&["train", "--config", toml.to_str().unwrap(), "--steps", "1", "--no-progress"]);
    assert!(out.contains(" on text ("), "{out}");
    let out = run(&["train", "--hidden", "8", "--steps", "1", "--no-progress"]);
    assert!(out.contains("mlp-bn (") && out.contains(" on digits ("), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without the `cuda` feature, `--device cuda` is refused before anything starts.
#[cfg(not(feature = "cuda"))]
#[test]
fn device_cuda_without_the_feature_exits_2() {
    let o = run_small(&["--device", "cuda"]);
    assert_eq!(o.code, Some(2), "stderr: {}", o.stderr);
    assert!(o.stderr.contains("device unavailable"), "{}", o.stderr);
    assert!(o.stderr.contains("--features cuda"), "{}", o.stderr);
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
}

#[test]
fn device_memory_too_small_is_out_of_memory_naming_the_allocation() {
    let o = run_small(&["--device-memory", "16K", "--world", "2", "--stage", "3"]);
    assert_ne!(o.code, Some(0), "{}", o.stdout);
    assert_ne!(o.code, Some(2), "OOM is a run failure, not a usage error: {}", o.stderr);
    assert!(o.code.is_some(), "killed by a signal: {}", o.stderr);
    // The message says what was being allocated, for which unit, against which cap.
    assert!(o.stderr.contains("would exceed the 16.0 KiB cap"), "{}", o.stderr);
    assert!(o.stderr.contains("allocating"), "{}", o.stderr);
    assert!(o.stderr.contains("in use:"), "{}", o.stderr);
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
}

fn read_safetensors(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).expect("read exported file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            // CKPT-7: torch's types, BatchNorm's batch counter an int64 of the same count.
            let data = if name.ends_with("num_batches_tracked") {
                assert_eq!(view.dtype(), safetensors::Dtype::I64, "{name}");
                let c = view.data().chunks_exact(8);
                c.map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect()
            } else {
                assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
                let c = view.data().chunks_exact(4);
                c.map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            };
            (name, view.shape().to_vec(), data)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn checkpoint_inspect_and_export_match_the_final_parameters() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ck_dir = dir.path().join("ckpt");
    let summary = run_ok(
        small_cfg(3, 3, 4, 62),
        RunOptions { checkpoint_dir: Some(ck_dir.clone()), ..quiet() },
    );
    let ck_path = checkpoint::latest(&ck_dir).expect("list").expect("a checkpoint");
    let ck = Checkpoint::open(&ck_path).expect("open");

    let o = shardline(&["checkpoint", "inspect", ck_dir.to_str().expect("utf-8 path")]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(o.stdout.contains("step 4, world 3, stage 3"), "{}", o.stdout);
    for r in 0..3 {
        assert!(o.stdout.contains(&shard_file_name(r)), "inspect lists rank {r}: {}", o.stdout);
    }

    let out = dir.path().join("model.safetensors");
    let o = shardline(&[
        "checkpoint",
        "export",
        ck_path.to_str().expect("utf-8 path"),
        "--out",
        out.to_str().expect("utf-8 path"),
    ]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let tensors = read_safetensors(&out);
    // An output directory that does not exist is the caller's mistake, named.
    let nowhere = dir.path().join("nowhere").join("model.safetensors");
    let (ck_s, nowhere_s) = (ck_path.to_str().expect("utf-8"), nowhere.to_str().expect("utf-8"));
    let o = shardline(&["checkpoint", "export", ck_s, "--out", nowhere_s]);
    assert_eq!(o.code, Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("does not exist") && o.stderr.contains(nowhere_s), "{}", o.stderr);

    // Expected: every parameter and buffer under its spec name, from the run's final state.
    let spec = &ck.manifest().model;
    let mut expected: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (u, unit) in spec.units.iter().enumerate() {
        let layout = FlatLayout::new(unit, 1).expect("layout");
        for (slot, view) in layout.params().iter().zip(layout.views(&summary.final_params[u])) {
            expected.push((slot.name.clone(), slot.shape.clone(), view.to_vec()));
        }
        let mut off = 0;
        for b in &unit.buffers {
            let n: usize = b.shape.iter().product();
            expected.push((
                b.name.clone(),
                b.shape.clone(),
                summary.final_buffers[u][off..off + n].to_vec(),
            ));
            off += n;
        }
    }
    expected.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(expected.iter().any(|t| t.0.contains("running_mean")), "buffers are exported");
    assert!(expected.iter().any(|t| t.0.ends_with("num_batches_tracked")), "and counters");
    assert_eq!(tensors.len(), expected.len(), "tensor count");
    for (got, want) in tensors.iter().zip(&expected) {
        assert_eq!(got.0, want.0, "tensor names");
        assert_eq!(got.1, want.1, "{}: shape", got.0);
        let same = got.2.iter().zip(&want.2).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same && got.2.len() == want.2.len(), "{}: values differ", got.0);
    }
}

#[test]
fn corrupted_or_truncated_shard_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ck_dir = dir.path().join("ckpt");
    let cfg = small_cfg(2, 2, 5, 60);
    run_ok(
        cfg.clone(),
        RunOptions { checkpoint_dir: Some(ck_dir.clone()), stop_after: Some(3), ..quiet() },
    );
    let ck_path = checkpoint::latest(&ck_dir).expect("list").expect("a checkpoint");
    let shard = ck_path.join(shard_file_name(1));
    let pristine = std::fs::read(&shard).expect("read shard");

    // One flipped bit in the middle of rank 1's file.
    let mut bad = pristine.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x10;
    std::fs::write(&shard, &bad).expect("corrupt shard");
    let out = dir.path().join("x.safetensors");
    let (ck_s, out_s) = (ck_path.to_str().expect("utf-8"), out.to_str().expect("utf-8"));
    for args in
        [vec!["checkpoint", "export", ck_s, "--out", out_s], vec!["checkpoint", "inspect", ck_s]]
    {
        let o = shardline(&args);
        assert_eq!(
            o.code,
            Some(1),
            "{args:?} accepted a corrupted shard: {}{}",
            o.stdout,
            o.stderr
        );
        assert!(o.stderr.contains(&shard.display().to_string()), "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains("corrupted"), "{args:?}: {}", o.stderr);
    }
    // Resuming from it is refused too, naming the file.
    let e = run_with_deadline(
        cfg.clone(),
        RunOptions { checkpoint_dir: Some(ck_dir.clone()), resume: true, ..quiet() },
    )
    .expect_err("resume from a corrupted shard must fail");
    assert!(e.to_string().contains(&shard.display().to_string()), "{e}");

    // Truncated.
    std::fs::write(&shard, &pristine[..pristine.len() - 7]).expect("truncate shard");
    for args in
        [vec!["checkpoint", "export", ck_s, "--out", out_s], vec!["checkpoint", "inspect", ck_s]]
    {
        let o = shardline(&args);
        assert_eq!(
            o.code,
            Some(1),
            "{args:?} accepted a truncated shard: {}{}",
            o.stdout,
            o.stderr
        );
        assert!(o.stderr.contains(&shard.display().to_string()), "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains("truncated"), "{args:?}: {}", o.stderr);
    }

    // Restored, it is accepted again.
    std::fs::write(&shard, &pristine).expect("restore shard");
    let o = shardline(&["checkpoint", "inspect", ck_s]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
}

#[test]
fn log_json_has_one_object_per_step_with_the_documented_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("steps.jsonl");
    let trace = dir.path().join("trace.json");
    let o = run_small(&[
        "--world",
        "2",
        "--stage",
        "3",
        "--sync-bn",
        "on",
        "--log-json",
        log.to_str().expect("utf-8"),
        "--trace",
        trace.to_str().expect("utf-8"),
    ]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let text = std::fs::read_to_string(&log).expect("read log");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l}: {e}")))
        .collect();
    assert_eq!(lines.len(), 3, "one object per step: {text}");
    // No warmup: the first step runs at the peak rate (the schedule is 0-based), and the
    // cosine has not reached 0 by the last step of the run.
    assert_eq!(lines[0]["lr"].as_f64(), Some(f64::from(0.05f32)), "{}", lines[0]);
    for (i, v) in lines.iter().enumerate() {
        assert_eq!(v["step"].as_u64(), Some(i as u64 + 1), "{v}");
        for key in ["loss", "lr", "step_time_s", "comm_exposed_s"] {
            let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing or not a number: {v}"));
            assert!(x.is_finite() && x >= 0.0, "{key} = {x}");
        }
        assert!(v["peak_bytes"].as_u64().is_some_and(|b| b > 0), "{v}");
        assert!(v["lr"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    }

    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&trace).expect("read trace")).expect("trace JSON");
    let events = doc["traceEvents"].as_array().expect("traceEvents");
    let complete: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    for e in &complete {
        assert!(e["ts"].as_f64().is_some() && e["dur"].as_f64().is_some_and(|d| d >= 0.0), "{e}");
    }
    for rank in 0..2u64 {
        for row in ["compute", "gather", "reduce", "stats"] {
            assert!(
                complete.iter().any(|e| e["pid"].as_u64() == Some(rank) && e["cat"] == row),
                "no {row} event for rank {rank} in the trace"
            );
        }
    }
}

/// Ctrl-C (SIGINT) in the middle of a run: the run stops after a whole step, writes a
/// checkpoint of it, says so and exits 130; `--resume` then ends exactly where an
/// uninterrupted run ends (INT-1; the handler only sets the flag the driver reads, INT-2; the
/// step the ranks agreed to stop at is checkpointed, DRIVE-2).
#[test]
fn interrupted_run_checkpoints_its_last_step_and_resumes_to_the_same_result() {
    interrupted_run_resumes(&[], 1500);
}

/// The same on the device engine (`--device sim`), which runs under the same loop: the
/// stop wish travels with its loss sums (INT-1).
#[test]
fn interrupted_device_run_checkpoints_its_last_step_and_resumes_to_the_same_result() {
    interrupted_run_resumes(&["--device", "sim", "--sim-delay-us", "0"], 600);
}

fn interrupted_run_resumes(extra: &[&str], total: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = |ck: &Path, log: &Path| -> Vec<String> {
        let mut v: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
        // SMALL's 3 steps, then more: long enough to be interrupted.
        let steps = v.iter().position(|a| a == "--steps").expect("--steps") + 1;
        v[steps] = total.to_string();
        v.extend(extra.iter().map(|s| s.to_string()));
        v.extend(["--checkpoint-dir".into(), ck.display().to_string()]);
        v.extend(["--checkpoint-every".into(), "100000".into()]);
        v.extend(["--log-json".into(), log.display().to_string()]);
        v
    };
    let (ck_b, log_b) = (dir.path().join("ck-b"), dir.path().join("b.jsonl"));
    let err_path = dir.path().join("b.err");
    let mut child = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(args(&ck_b, &log_b))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("start shardline");
    let status = interrupt_after_steps(&mut child, &log_b, 20);
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("stopped by SIGINT after step"), "{stderr}");
    assert!(stderr.contains("continue with --resume"), "{stderr}");
    let latest = checkpoint::latest(&ck_b).expect("list").expect("a checkpoint");
    let ck = Checkpoint::open(&latest).expect("open");
    ck.verify().expect("verifies");
    let k = ck.manifest().step;
    assert_eq!(k as usize, line_count(&log_b), "the checkpoint holds the last logged step");
    assert!((20..total).contains(&k), "stopped at step {k}");

    // Resume to the end, and run the same job without interruption.
    let mut resume = args(&ck_b, &log_b);
    resume.push("--resume".into());
    let r: Vec<&str> = resume.iter().map(String::as_str).collect();
    let o = shardline(&r);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let (ck_a, log_a) = (dir.path().join("ck-a"), dir.path().join("a.jsonl"));
    let full = args(&ck_a, &log_a);
    let f: Vec<&str> = full.iter().map(String::as_str).collect();
    let o = shardline(&f);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let end = |d: &Path| {
        let ck =
            Checkpoint::open(checkpoint::latest(d).expect("list").expect("one")).expect("open");
        assert_eq!(ck.manifest().step, total);
        ck.consolidate().expect("consolidate").into_iter().map(|u| u.params).collect::<Vec<_>>()
    };
    assert!(bits_eq(&end(&ck_b), &end(&ck_a)), "resumed run differs from the uninterrupted one");
}

/// STRAG-1 end to end: in a 3-rank job, a rank slowed by 40 ms a step (the `slow` fault) is
/// reported as a straggler by name, live, and marked in the log; with `--evict-stragglers`
/// the run ends failed, naming it.
#[test]
fn a_slow_rank_is_reported_as_a_straggler_and_can_be_evicted_strag_1() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("log.jsonl");
    // SMALL's model for 10 steps.
    let run = |extra: &[&str]| {
        let mut v = small(extra);
        let steps = v.iter().position(|a| a == "--steps").expect("--steps") + 1;
        v[steps] = "10".into();
        let refs: Vec<&str> = v.iter().map(String::as_str).collect();
        shardline(&refs)
    };
    let args = [
        "--world",
        "3",
        "--fault",
        "slow:rank=1:step=2:ms=40",
        "--straggler-steps",
        "3",
        "--log-json",
        log.to_str().unwrap(),
    ];
    let o = run(&args);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(o.stderr.contains("rank 1 is a straggler"), "{}", o.stderr);
    assert!(!o.stderr.contains("rank 0 is a straggler"), "{}", o.stderr);
    let text = std::fs::read_to_string(&log).expect("log");
    let marked: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["stragglers"].clone())
        .collect();
    assert_eq!(marked[0], serde_json::json!([]), "step 1 runs at full speed");
    assert_eq!(marked[9], serde_json::json!([1]), "{text}");
    let o = run(&[&args[..4], &["--straggler-steps", "3", "--evict-stragglers"]].concat());
    assert_eq!(o.code, Some(1), "{}", o.stderr);
    assert!(
        o.stderr.contains("rank 1 is a straggler") && o.stderr.contains("evicted"),
        "{}",
        o.stderr
    );
    // Bad policies exit 2 naming the flag.
    for bad in [["--straggler-factor", "1"], ["--straggler-steps", "0"]] {
        let o = run_small(&bad);
        assert_eq!(o.code, Some(2), "{bad:?}: {}", o.stderr);
        assert!(o.stderr.contains(bad[0]), "{}", o.stderr);
    }
}

/// STALL-1 end to end: a rank that stops for 4 s in a job whose collectives time out after
/// 12 s is named, live, after 2 s (a sixth of the timeout) as the rank the others wait for;
/// the run then goes on and ends normally.
#[test]
fn a_stalled_rank_is_named_long_before_the_timeout_stall_1() {
    let o =
        run_small(&["--world", "3", "--timeout", "12", "--fault", "stall:rank=1:step=3:secs=4"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let line = o.stderr.lines().find(|l| l.starts_with("warning: step 3 has run")).unwrap_or("");
    assert!(line.contains("rank 1 has not entered"), "{}", o.stderr);
    assert!(!line.contains("rank 0 has not") && !line.contains("rank 2 has not"), "{line}");
}
