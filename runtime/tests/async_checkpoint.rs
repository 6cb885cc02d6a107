//! Checkpoints written in the background (`--async-checkpoint`): the same checkpoints and the
//! same resumed run as synchronous ones (DRIVE-4), a snapshot that later steps do not reach
//! (DRIVE-4), one save in flight (DRIVE-5), and a crash during a write that leaves the
//! previous checkpoint the one resumed from, in one process and launched (DRIVE-6).

mod common;
use common::*;
use shardline_runtime::checkpoint::{self, Checkpoint, ConsolidatedUnit};
use shardline_runtime::driver::ShardWriteHook;
use shardline_runtime::fault::{FaultInjector, FaultPlan};
use shardline_runtime::supervise::{run_supervised, Supervised};
use shardline_runtime::train::{RunOptions, TrainConfig};
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Duration;

fn ckpt_opts(dir: &Path, every: u64, background: bool) -> RunOptions {
    RunOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        checkpoint_every: every,
        async_checkpoint: background,
        ..quiet()
    }
}

/// The committed checkpoint of `step` under `dir`, verified.
fn at(dir: &Path, step: u64) -> Checkpoint {
    let ck = Checkpoint::open(dir.join(checkpoint::step_dir_name(step)))
        .unwrap_or_else(|e| panic!("checkpoint of step {step} in {}: {e}", dir.display()));
    ck.verify().unwrap_or_else(|e| panic!("checkpoint of step {step} verifies: {e}"));
    ck
}

/// Everything a checkpoint holds that a resume reads: shards (consolidated), buffers and
/// the loader's position.
fn content(ck: &Checkpoint) -> (Vec<ConsolidatedUnit>, Vec<Vec<f32>>, checkpoint::DataLoaderState) {
    let m = ck.manifest();
    (ck.consolidate().expect("consolidate"), ck.buffers().expect("buffers"), m.data_loader)
}

fn same_checkpoint(a: &Checkpoint, b: &Checkpoint, what: &str) {
    let (ua, ba, la) = content(a);
    let (ub, bb, lb) = content(b);
    assert_eq!(la, lb, "{what}: loader position");
    assert_eq!(ua.len(), ub.len(), "{what}: units");
    for (x, y) in ua.iter().zip(&ub) {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x.params), bits(&y.params), "{what}: params of a unit");
        assert_eq!(bits(&x.optim_state), bits(&y.optim_state), "{what}: optimizer state");
    }
    assert!(bits_eq(&ba, &bb), "{what}: buffers");
}

/// Asynchronous checkpoints every 2 steps, a stop after 5 and a resume to the end: every
/// checkpoint equals the synchronous run's of the same step bitwise, and the resumed run
/// ends where the uninterrupted synchronous one ends.
fn async_matches_sync(cfg: TrainConfig, total: u64, stop: u64) {
    let what = format!("world {} stage {:?} {}", cfg.world, cfg.stage, cfg.optimizer);
    let sync_dir = tempfile::tempdir().expect("tempdir");
    let sync = run_ok(cfg.clone(), ckpt_opts(sync_dir.path(), 2, false));
    assert_eq!(sync.losses.len() as u64, total, "{what}");

    let dir = tempfile::tempdir().expect("tempdir");
    let first = run_ok(
        cfg.clone(),
        RunOptions { stop_after: Some(stop), ..ckpt_opts(dir.path(), 2, true) },
    );
    assert!(losses_bits_eq(&first.losses, &sync.losses[..stop as usize]), "{what}: first part");
    assert_eq!(
        first.checkpoint_stalls.iter().map(|s| s.step).collect::<Vec<_>>(),
        (1..=stop).filter(|s| s % 2 == 0 || *s == stop).collect::<Vec<_>>(),
        "{what}: checkpoints of the first invocation"
    );
    assert_eq!(
        checkpoint::latest(dir.path()).expect("list"),
        Some(at(dir.path(), stop).dir().into())
    );

    let second = run_ok(cfg, RunOptions { resume: true, ..ckpt_opts(dir.path(), 2, true) });
    assert_eq!(second.total_steps, total, "{what}");
    assert!(
        losses_bits_eq(&second.losses, &sync.losses[stop as usize..]),
        "{what}: resumed losses {:?} differ from the synchronous run's {:?}",
        second.losses,
        &sync.losses[stop as usize..]
    );
    assert!(bits_eq(&second.final_params, &sync.final_params), "{what}: final params");
    assert!(bits_eq(&second.final_buffers, &sync.final_buffers), "{what}: final buffers");
    for step in (2..=total).step_by(2).chain([total]) {
        same_checkpoint(
            &at(dir.path(), step),
            &at(sync_dir.path(), step),
            &format!("{what}: {step}"),
        );
    }
}

/// DRIVE-4: SGD with momentum at stage 3 (state sharded), BatchNorm buffers, a stop
/// mid-epoch.
#[test]
fn async_checkpoints_equal_sync_ones_and_resume_bitwise_drive_4() {
    async_matches_sync(small_cfg(3, 3, 9, 200), 9, 5);
}

/// DRIVE-4: AdamW (two state values per element) at stage 1, full copies sliced.
#[test]
fn async_checkpoints_with_adamw_at_stage_1_drive_4() {
    let mut cfg = small_cfg(2, 1, 7, 62);
    cfg.optimizer = "adamw".into();
    cfg.lr = 0.01;
    cfg.weight_decay = 0.01;
    async_matches_sync(cfg, 7, 3);
}

/// DRIVE-4, DRIVE-5: every shard write of the checkpoint of step 2 is held back 0.5 s, long
/// after the loop went on to steps 3 and 4 and changed every parameter: the checkpoint still
/// holds step 2's state, the loop did not wait for the writer at step 2's boundary, and the
/// save of step 4 waited for step 2's to commit first.
#[test]
fn a_delayed_write_holds_the_state_of_its_step_drive_4_drive_5() {
    const DELAY: Duration = Duration::from_millis(500);
    let cfg = small_cfg(2, 3, 6, 120);
    let every_step = tempfile::tempdir().expect("tempdir");
    run_ok(cfg.clone(), ckpt_opts(every_step.path(), 1, false));
    // The state did change in the steps run while step 2 was written.
    for later in [3, 4] {
        let (a, _, _) = content(&at(every_step.path(), 2));
        let (b, _, _) = content(&at(every_step.path(), later));
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.params != y.params),
            "step {later} left a unit's parameters as step 2 had them"
        );
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let (tx, rx) = mpsc::channel::<(usize, u64)>();
    let tx = std::sync::Mutex::new(tx);
    let hook = ShardWriteHook(Arc::new(move |rank, step| {
        if step == 2 {
            std::thread::sleep(DELAY);
        }
        let _ = tx.lock().map(|t| t.send((rank, step)));
    }));
    let opts = RunOptions { before_shard_write: Some(hook), ..ckpt_opts(dir.path(), 2, true) };
    let s = run_ok(cfg, opts);
    let mut written: Vec<(usize, u64)> = rx.try_iter().collect();
    written.sort();
    assert_eq!(written, [(0, 2), (0, 4), (0, 6), (1, 2), (1, 4), (1, 6)], "hook calls");
    same_checkpoint(&at(dir.path(), 2), &at(every_step.path(), 2), "delayed step 2");
    same_checkpoint(&at(dir.path(), 4), &at(every_step.path(), 4), "step 4");
    same_checkpoint(&at(dir.path(), 6), &at(every_step.path(), 6), "step 6");
    let st = &s.checkpoint_stalls;
    assert_eq!(st.iter().map(|s| s.step).collect::<Vec<_>>(), [2, 4, 6]);
    assert!(
        st[0].boundary_s < DELAY.as_secs_f64() / 2.0,
        "the loop waited {} s at step 2's boundary for a write held back {DELAY:?}",
        st[0].boundary_s
    );
    // Steps 3 and 4 take far less than the delay: the save of step 4 found step 2's in
    // flight and waited for it.
    assert!(st[0].waited_s > 0.1, "step 2's save was not waited for: {st:?}");
}

/// `run_supervised` on its own thread; a run past the deadline fails the test (a hang).
fn supervised(cfg: TrainConfig, o: RunOptions, fault: &str, restarts: u32) -> Supervised {
    let plan = FaultPlan::parse(&[fault.to_string()], 11).expect("valid plan");
    let inj = FaultInjector::new(plan);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(run_supervised(cfg, o, Some(inj), restarts));
    });
    rx.recv_timeout(RUN_DEADLINE)
        .unwrap_or_else(|_| panic!("{fault}: no result within {RUN_DEADLINE:?} (a hang)"))
}

/// DRIVE-6 in one process: rank 1 dies once its shard of step 4 is written in the
/// background; the failure is detected as a rank's death, step 4 is never committed, step 2
/// stays the newest checkpoint and verifies, and with a restart the job resumes from it and
/// ends as the clean run does.
#[test]
fn a_rank_killed_during_an_async_write_leaves_the_previous_checkpoint_drive_6() {
    let cfg = small_cfg(3, 3, 6, 48);
    let clean_dir = tempfile::tempdir().expect("tempdir");
    let clean = run_ok(cfg.clone(), ckpt_opts(clean_dir.path(), 2, true));

    let dir = tempfile::tempdir().expect("tempdir");
    let kill = "kill:rank=1:step=4:phase=checkpoint";
    let s = supervised(cfg.clone(), ckpt_opts(dir.path(), 2, true), kill, 0);
    let e = s.result.expect_err("the kill fails the job without restarts");
    assert!(e.to_string().contains("rank 1 died"), "{e}");
    // The writer's death reaches the coordinator as an actor's does (ACT-1).
    assert!(s.faults[0].detected, "the kill was not detected: {:?}", s.faults);
    let latest = checkpoint::latest(dir.path()).expect("list").expect("a committed checkpoint");
    assert_eq!(latest, dir.path().join(checkpoint::step_dir_name(2)), "step 4 was committed");
    at(dir.path(), 2);
    assert!(!dir.path().join(checkpoint::step_dir_name(4)).exists(), "a torn step 4");

    let dir = tempfile::tempdir().expect("tempdir");
    let s = supervised(cfg, ckpt_opts(dir.path(), 2, true), kill, 1);
    let summary = s.result.unwrap_or_else(|e| panic!("restarted run failed: {e}"));
    assert_eq!((s.restarts, summary.total_steps), (1, 6));
    assert!(bits_eq(&summary.final_params, &clean.final_params), "final params");
    assert!(bits_eq(&summary.final_buffers, &clean.final_buffers), "final buffers");
    same_checkpoint(&at(dir.path(), 6), &at(clean_dir.path(), 6), "step 6");
}

/// A 9-step job of 2 ranks at stage 3 with asynchronous checkpoints every 3 steps into
/// `dir`, plus `extra`.
fn job_args(dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        "--world",
        "2",
        "--hidden",
        "32",
        "--depth",
        "2",
        "--batch-size",
        "60",
        "--sync-bn",
        "on",
        "--steps",
        "9",
        "--checkpoint-every",
        "3",
        "--async-checkpoint",
        "--no-progress",
        "--checkpoint-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(dir.to_str().expect("utf-8 temp path").to_owned());
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn launched(dir: &Path, launch: &[&str], extra: &[&str]) -> Out {
    let mut args: Vec<String> =
        ["launch", "--nproc-per-node", "2"].iter().map(|s| s.to_string()).collect();
    args.extend(launch.iter().map(|s| s.to_string()));
    args.push("--".into());
    args.extend(job_args(dir, extra));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    shardline(&refs)
}

/// DRIVE-6 launched: rank 1's process is SIGKILLed once its shard of step 6 is written by
/// its background thread, before rank 0 can commit; step 3 stays the newest checkpoint.
/// Restarted with --resume, the group goes on from step 3 and ends with the checkpoints an
/// uninterrupted run of one process writes (DRIVE-1, DRIVE-4).
#[test]
fn launched_kill_during_an_async_write_resumes_from_the_previous_checkpoint_drive_6() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let full = tmp.path().join("full");
    let refs: Vec<String> = job_args(&full, &[]);
    let o = shardline(&refs.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(o.code, Some(0), "{}\n{}", o.stdout, o.stderr);

    let kill = ["--fault", "kill:rank=1:step=6:phase=checkpoint"];
    let dir = tmp.path().join("killed");
    let o = launched(&dir, &[], &kill);
    assert_ne!(o.code, Some(0), "the kill fails the job:\n{}\n{}", o.stdout, o.stderr);
    assert!(o.stderr.contains("fault injected: kill rank 1 at step 6"), "{}", o.stderr);
    let latest = checkpoint::latest(&dir).expect("list").expect("a committed checkpoint");
    assert_eq!(latest, dir.join(checkpoint::step_dir_name(3)), "{}", o.stderr);
    at(&dir, 3);
    assert!(!dir.join(checkpoint::step_dir_name(6)).exists(), "a torn step 6");

    let dir = tmp.path().join("restarted");
    let mut extra = kill.to_vec();
    extra.push("--resume");
    let o = launched(&dir, &["--max-restarts", "1"], &extra);
    assert_eq!(o.code, Some(0), "{}\n{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("(step 3)"), "the restart resumed from step 3:\n{}", o.stdout);
    for step in [3, 6, 9] {
        same_checkpoint(&at(&dir, step), &at(&full, step), &format!("launched step {step}"));
    }
}

/// DRIVE-5 with DRIVE-2: SIGINT during a run checkpointing in the background every 5 steps
/// (the writes overlap the steps): the run exits 130 only once the checkpoint of the step
/// it stopped at is committed; it is the newest, verifies, holds the last logged step, and
/// no write is left half done.
#[test]
fn a_stop_commits_its_async_checkpoint_before_exiting_drive_5() {
    use std::process::{Command, Stdio};
    let tmp = tempfile::tempdir().expect("tempdir");
    let (dir, log) = (tmp.path().join("ck"), tmp.path().join("log.jsonl"));
    let mut args = job_args(&dir, &["--log-json", log.to_str().expect("utf-8 temp path")]);
    let steps = args.iter().position(|a| a == "--steps").expect("--steps") + 1;
    args[steps] = "3000".into();
    let every = args.iter().position(|a| a == "--checkpoint-every").expect("every") + 1;
    args[every] = "5".into();
    let mut child = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start shardline");
    let status = interrupt_after_steps(&mut child, &log, 20);
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    assert_eq!(status.code(), Some(130), "{stderr}");
    let latest = checkpoint::latest(&dir).expect("list").expect("a checkpoint");
    let ck = Checkpoint::open(&latest).expect("open");
    ck.verify().expect("the stop's checkpoint verifies");
    assert_eq!(ck.manifest().step as usize, line_count(&log), "the checkpoint of the last step");
    assert!(stderr.contains(&latest.display().to_string()), "the stop names it: {stderr}");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .expect("list")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "writes left unfinished: {left:?}");
}

/// The flag needs somewhere to write.
#[test]
fn async_checkpoint_without_a_directory_exits_2() {
    let o = shardline(&["train", "--steps", "1", "--no-progress", "--async-checkpoint"]);
    assert_eq!(o.code, Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("--async-checkpoint needs --checkpoint-dir"), "{}", o.stderr);
}
