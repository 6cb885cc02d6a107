//! Checkpoint, stop and resume: bitwise as if never stopped (CKPT-3), resharding through
//! real runs 4 -> 2 -> 3, and resume past damaged checkpoints in one process and launched
//! (CKPT-5, CKPT-6).

mod common;
use common::*;
use shardline_runtime::checkpoint::{self, shard_file_name, Checkpoint, BUFFERS_FILE, MANIFEST};
use shardline_runtime::train::RunOptions;
use shardline_runtime::Stage;
use std::path::{Path, PathBuf};

fn ckpt_opts(dir: &Path, every: u64) -> RunOptions {
    RunOptions { checkpoint_dir: Some(dir.to_path_buf()), checkpoint_every: every, ..quiet() }
}

fn latest(dir: &Path) -> Checkpoint {
    let p = checkpoint::latest(dir).expect("list checkpoints").expect("a committed checkpoint");
    Checkpoint::open(p).expect("open checkpoint")
}

/// Runs `total` steps uninterrupted, then `k` steps + stop + resume to `total`, and compares.
/// Returns the manifest of the checkpoint the interrupted run stopped at.
fn stop_and_resume_matches(
    world: usize,
    stage: u8,
    batch: usize,
    total: u64,
    k: u64,
    adamw: bool,
) -> checkpoint::Manifest {
    let what = format!("world {world} stage {stage} batch {batch}: stop at {k} of {total}");
    let mut cfg = small_cfg(world, stage, total, batch);
    if adamw {
        cfg.optimizer = "adamw".into();
        cfg.lr = 0.01;
        cfg.weight_decay = 0.01;
    }
    let full_dir = tempfile::tempdir().expect("tempdir");
    let full = run_ok(cfg.clone(), ckpt_opts(full_dir.path(), 3));
    assert_eq!(full.losses.len() as u64, total, "{what}");

    let dir = tempfile::tempdir().expect("tempdir");
    let first = run_ok(cfg.clone(), RunOptions { stop_after: Some(k), ..ckpt_opts(dir.path(), 0) });
    assert_eq!(first.steps, k, "{what}: first invocation steps");
    assert!(losses_bits_eq(&first.losses, &full.losses[..k as usize]), "{what}: first part");
    let manifest = latest(dir.path()).manifest().clone();
    assert_eq!(manifest.step, k, "{what}: checkpoint step");

    let second = run_ok(cfg, RunOptions { resume: true, ..ckpt_opts(dir.path(), 0) });
    assert_eq!(second.steps, total - k, "{what}: resumed invocation steps");
    assert_eq!(second.total_steps, total, "{what}");
    assert!(
        losses_bits_eq(&second.losses, &full.losses[k as usize..]),
        "{what}: resumed losses {:?} differ from the uninterrupted {:?}",
        second.losses,
        &full.losses[k as usize..]
    );
    assert!(bits_eq(&second.final_params, &full.final_params), "{what}: final params");
    assert!(bits_eq(&second.final_buffers, &full.final_buffers), "{what}: final buffers");
    // Both runs end with a checkpoint of the same state.
    let (a, b) = (latest(full_dir.path()), latest(dir.path()));
    assert_eq!(a.manifest().step, total);
    assert_eq!(a.consolidate().expect("consolidate"), b.consolidate().expect("consolidate"));
    manifest
}

#[test]
fn resume_is_bitwise_as_if_never_stopped_every_stage() {
    // 1438 samples / 200 = 8 steps per epoch (the last one 38 samples): stop mid-epoch.
    for stage in 0..4u8 {
        let m = stop_and_resume_matches(3, stage, 200, 11, 5, false);
        assert_eq!((m.data_loader.epoch, m.data_loader.step), (0, 5), "stage {stage}");
    }
}

#[test]
fn resume_at_an_epoch_boundary_starts_the_next_epoch() {
    // Stop right after the short last batch of epoch 0: the loader must start epoch 1 at
    // batch 0, neither replaying nor skipping a batch.
    let m = stop_and_resume_matches(4, 3, 200, 11, 8, false);
    assert_eq!((m.data_loader.epoch, m.data_loader.step), (1, 0));
    // And one step before the boundary: the short batch is still to come.
    let m = stop_and_resume_matches(2, 1, 200, 11, 7, false);
    assert_eq!((m.data_loader.epoch, m.data_loader.step), (0, 7));
}

#[test]
fn resume_with_adamw_state_is_bitwise() {
    stop_and_resume_matches(4, 2, 62, 7, 4, true);
}

fn consolidated_params(ck: &Checkpoint) -> Vec<Vec<f32>> {
    ck.consolidate().expect("consolidate").into_iter().map(|u| u.params).collect()
}

/// Train at world 4, resume at world 2, resume at world 3; every load holds exactly the
/// consolidated checkpoint (CKPT-3).
fn reshard_4_to_2_to_3(adamw: bool) {
    let base = |world: usize, stage: u8, steps: u64| {
        let mut c = small_cfg(world, stage, steps, 60);
        if adamw {
            c.optimizer = "adamw".into();
            c.lr = 0.01;
        }
        c
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = || ckpt_opts(dir.path(), 0);
    let resume = || RunOptions { resume: true, ..ckpt_opts(dir.path(), 0) };

    // A 6-step job (the cosine schedule spans 6 steps throughout). World 4, stage 3 stops
    // after 4 steps -> step-4 written by world 4.
    run_ok(base(4, 3, 6), RunOptions { stop_after: Some(4), ..opts() });
    let ck4 = latest(dir.path());
    assert_eq!((ck4.manifest().world, ck4.manifest().step), (4, 4));

    // Load at world 2, stage 1, training no step: what the ranks hold is exactly the
    // consolidated world-4 checkpoint.
    let loaded2 = run_ok(base(2, 1, 6), RunOptions { stop_after: Some(0), ..resume() });
    assert_eq!(latest(dir.path()).manifest().step, 4, "a run of no steps writes nothing");
    assert_eq!(loaded2.steps, 0);
    assert!(bits_eq(&loaded2.final_params, &consolidated_params(&ck4)), "4 -> 2 params");
    assert!(bits_eq(&loaded2.final_buffers, &ck4.buffers().expect("buffers")), "4 -> 2 buffers");

    // Train on at world 2 to step 6 -> step-6 written by world 2.
    let on2 = run_ok(base(2, 1, 6), resume());
    assert_eq!((on2.steps, on2.total_steps), (2, 6));
    let ck2 = latest(dir.path());
    assert_eq!(
        (ck2.manifest().world, ck2.manifest().stage, ck2.manifest().step),
        (2, Stage::Zero1, 6)
    );

    // Load at world 3, stage 0 and stage 2: exactly the world-2 checkpoint again.
    for stage in [0u8, 2] {
        let loaded3 = run_ok(base(3, stage, 6), resume());
        assert_eq!(loaded3.steps, 0);
        assert!(
            bits_eq(&loaded3.final_params, &consolidated_params(&ck2)),
            "2 -> 3 (stage {stage})"
        );
        assert!(
            bits_eq(&loaded3.final_buffers, &ck2.buffers().expect("buffers")),
            "2 -> 3 buffers"
        );
    }

    // The optimizer state went across too: the run continued at world 2 matches one that
    // stayed at world 4, within the equivalence tolerance (tests/equivalence.rs; only the
    // summation order differs). Not for AdamW: its normalisation turns the rounding noise of
    // gradients that are zero in exact arithmetic (a linear bias ahead of a BatchNorm) into
    // steps of +-lr, so worlds 4 and 2 already differ by ~1e-2 without any checkpoint.
    if adamw {
        return;
    }
    let dir4 = tempfile::tempdir().expect("tempdir");
    let stayed = run_ok(base(4, 3, 6), ckpt_opts(dir4.path(), 0));
    let d = max_abs_diff(&on2.final_params, &stayed.final_params);
    assert!(d <= 4e-7, "world 4 -> 2 continuation differs from world 4 throughout by {d:e}");
}

#[test]
fn reshard_4_to_2_to_3_through_real_runs_sgd() {
    reshard_4_to_2_to_3(false);
}

#[test]
fn reshard_4_to_2_to_3_through_real_runs_adamw() {
    // Two state values per parameter get resharded.
    reshard_4_to_2_to_3(true);
}

// ---------------------------------------------------------------------------------------
// Damaged checkpoints, through the `shardline` command (every process has a deadline).

/// A 9-step job of 2 ranks at stage 3 checkpointing every 3 steps into `dir`, logging to
/// `log`, plus `extra`.
fn job_args(dir: &Path, log: &Path, extra: &[&str]) -> Vec<String> {
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
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(["--checkpoint-dir".into(), utf8(dir), "--log-json".into(), utf8(log)]);
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn utf8(p: &Path) -> String {
    p.to_str().expect("utf-8 temp path").to_owned()
}

/// `shardline ARGS` with the common deadline.
fn run_cli(args: &[String]) -> Out {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    shardline(&refs)
}

/// `shardline ARGS`, expecting exit 0.
fn run_cli_ok(args: &[String]) -> Out {
    let o = run_cli(args);
    assert_eq!(o.code, Some(0), "shardline {args:?}\n{}\n{}", o.stdout, o.stderr);
    o
}

/// (step, loss as its exact bits) of every line of a `--log-json` file (f32 losses are
/// logged as the f64 they widen to).
fn logged_losses(path: &Path) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(path).expect("read log");
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON log line");
            let step = v["step"].as_u64().expect("step");
            (step, v["loss"].as_f64().expect("loss").to_bits())
        })
        .collect()
}

/// The consolidated parameters of the newest checkpoint under `dir`, which must hold step
/// `step`.
fn final_params(dir: &Path, step: u64) -> Vec<Vec<f32>> {
    let ck = latest(dir);
    assert_eq!(ck.manifest().step, step, "newest checkpoint in {}", dir.display());
    ck.verify().expect("the newest checkpoint verifies");
    consolidated_params(&ck)
}

fn flip_byte(file: &Path) {
    let mut bytes = std::fs::read(file).expect("read file to damage");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x20;
    std::fs::write(file, &bytes).expect("damage file");
}

/// An uninterrupted 9-step run into `root/full`: its log.
fn uninterrupted(root: &Path) -> (PathBuf, PathBuf) {
    let (dir, log) = (root.join("full"), root.join("full.jsonl"));
    run_cli_ok(&job_args(&dir, &log, &[]));
    (dir, log)
}

/// A run stopped after 6 steps into `root/ck` (checkpoints of steps 3 and 6), then one byte
/// of rank 1's shard of step 6 flipped: the checkpoint directory and the damaged file.
fn stopped_then_damaged(root: &Path) -> (PathBuf, PathBuf) {
    let dir = root.join("ck");
    run_cli_ok(&job_args(&dir, &root.join("part.jsonl"), &["--stop-after", "6"]));
    let damaged = dir.join(checkpoint::step_dir_name(6)).join(shard_file_name(1));
    flip_byte(&damaged);
    (dir, damaged)
}

/// Checks a resumed invocation after [`stopped_then_damaged`]: it skipped step 6 naming the
/// file, moved it aside, resumed from step 3, wrote step 6 anew (a multiple of
/// --checkpoint-every), and its losses and final parameters are bitwise the uninterrupted
/// run's.
fn check_resumed_past_step_6(o: &Out, root: &Path, dir: &Path, damaged: &Path, log: &Path) {
    let (full_dir, full_log) = (root.join("full"), root.join("full.jsonl"));
    let step6 = dir.join(checkpoint::step_dir_name(6));
    let skip = format!(
        "shardline: skipping checkpoint {}: {}: corrupted",
        step6.display(),
        damaged.display()
    );
    assert_eq!(o.stderr.matches(&skip).count(), 1, "said once, by the lead:\n{}", o.stderr);
    let aside = dir.join("damaged-step-00000006");
    let moved = format!("shardline: moved {} to {}", step6.display(), aside.display());
    assert_eq!(o.stderr.matches(&moved).count(), 1, "{}", o.stderr);
    let step3 = dir.join(checkpoint::step_dir_name(3));
    assert!(
        o.stdout.contains(&format!("resumed from {} (step 3)", step3.display())),
        "{}",
        o.stdout
    );
    assert!(aside.join(shard_file_name(1)).is_file(), "the damaged checkpoint is kept aside");
    let again = Checkpoint::open(&step6).expect("step 6 written again");
    again.verify().expect("the new step 6 verifies");

    let full = logged_losses(&full_log);
    let resumed = logged_losses(log);
    assert_eq!(resumed.iter().map(|l| l.0).collect::<Vec<_>>(), (4..=9).collect::<Vec<_>>());
    assert_eq!(resumed, full[3..], "resumed losses differ from the uninterrupted run's");
    assert!(
        bits_eq(&final_params(dir, 9), &final_params(&full_dir, 9)),
        "final parameters differ from the uninterrupted run's"
    );
    let (a, b) = (latest(dir), latest(&full_dir));
    assert!(bits_eq(&a.buffers().expect("buffers"), &b.buffers().expect("buffers")), "buffers");
}

/// CKPT-5, CKPT-6: the newest checkpoint has a flipped byte; `--resume` names it and its
/// file on stderr, resumes from the one before, writes the skipped step again, and ends
/// bitwise where an uninterrupted run ends.
#[test]
fn resume_skips_a_corrupted_newest_checkpoint_and_ends_as_if_never_stopped() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path();
    uninterrupted(root);
    let (dir, damaged) = stopped_then_damaged(root);
    let log = root.join("resumed.jsonl");
    let o = run_cli_ok(&job_args(&dir, &log, &["--resume"]));
    check_resumed_past_step_6(&o, root, &dir, &damaged, &log);
}

/// CKPT-5, CKPT-6 with one process per rank: every launched rank runs the driver's resume
/// and selects alone; all load step 3, rank 0 alone speaks, and the run ends bitwise where
/// the uninterrupted in-process run ends (DRIVE-1).
#[test]
fn launched_ranks_skip_the_same_corrupted_checkpoint() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path();
    uninterrupted(root);
    let (dir, damaged) = stopped_then_damaged(root);
    let log = root.join("resumed.jsonl");
    let mut args: Vec<String> =
        ["launch", "--nproc-per-node", "2", "--"].iter().map(|s| s.to_string()).collect();
    args.extend(job_args(&dir, &log, &["--resume"]));
    let o = run_cli_ok(&args);
    check_resumed_past_step_6(&o, root, &dir, &damaged, &log);
}

/// CKPT-5: when no checkpoint verifies (a flipped byte, a missing file, a manifest that does
/// not parse), `--resume` is refused with exit 2, naming every checkpoint and why, and
/// nothing is moved.
#[test]
fn resume_refuses_with_exit_2_when_no_checkpoint_verifies() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("ck");
    let log = tmp.path().join("log.jsonl");
    run_cli_ok(&job_args(&dir, &log, &[]));
    let step = |n: u64| dir.join(checkpoint::step_dir_name(n));
    flip_byte(&step(9).join(shard_file_name(0)));
    std::fs::remove_file(step(6).join(BUFFERS_FILE)).expect("remove buffers file");
    std::fs::write(step(3).join(MANIFEST), b"{\"format_version\": 1, \"step\"").expect("manifest");

    let o = run_cli(&job_args(&dir, &log, &["--resume"]));
    assert_eq!(o.code, Some(2), "{}\n{}", o.stdout, o.stderr);
    assert!(o.stderr.contains("none of the 3 checkpoint(s)"), "{}", o.stderr);
    for (n, file, why) in [
        (9, shard_file_name(0), "corrupted"),
        (6, BUFFERS_FILE.to_string(), "cannot read"),
        (3, MANIFEST.to_string(), "invalid manifest"),
    ] {
        let line = format!("{}: {}: {why}", step(n).display(), step(n).join(&file).display());
        assert!(o.stderr.contains(&line), "no {line:?} in:\n{}", o.stderr);
        assert!(step(n).is_dir(), "step {n} was moved");
    }
    assert!(!o.stdout.contains("resumed from"), "{}", o.stdout);

    // LAUNCH-6: launched with restarts, the job gives up at once: every generation would
    // fail the same way.
    let mut launched: Vec<String> =
        ["launch", "--nproc-per-node", "2", "--max-restarts", "2", "--"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    launched.extend(job_args(&dir, &log, &["--resume"]));
    let o = run_cli(&launched);
    assert_eq!(o.code, Some(1), "{}\n{}", o.stdout, o.stderr);
    assert!(o.stderr.contains("a restart would fail the same way"), "{}", o.stderr);
    assert!(!o.stderr.contains("restart 1/2"), "{}", o.stderr);
}

/// CKPT-5: a checkpoint of another configuration is refused as before (exit 1, naming its
/// manifest and the config hash), not skipped, even when one of its files is damaged.
#[test]
fn resume_refuses_another_configuration_even_when_damaged() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (dir, damaged) = stopped_then_damaged(tmp.path());
    let mut args = job_args(&dir, &tmp.path().join("log.jsonl"), &["--resume"]);
    args.extend(["--lr".into(), "0.02".into()]);
    let o = run_cli(&args);
    assert_eq!(o.code, Some(1), "{}\n{}", o.stdout, o.stderr);
    let manifest = dir.join(checkpoint::step_dir_name(6)).join(MANIFEST);
    assert!(o.stderr.contains(&manifest.display().to_string()), "{}", o.stderr);
    assert!(o.stderr.contains("config hash"), "{}", o.stderr);
    assert!(damaged.is_file(), "nothing is moved when resume is refused");
}
