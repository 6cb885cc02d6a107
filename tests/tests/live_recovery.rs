//! Live recovery under `shardline launch --live-recovery` (LIVE-1 to LIVE-6 in the runtime's
//! `engine::live` and `launch::live` modules): a killed worker is replaced in place, its
//! peers stay in their processes, and the run ends bitwise like a clean one; a stalled
//! worker rejoins without a replacement; without a peer holding a shard the group restarts
//! from the checkpoint. Every launch runs under a deadline: a bug fails the test instead of
//! hanging it.

use shardline_tests::launch::{logged_steps, shardline, spawn, wait_output};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(90);

/// One launch on this host: `nproc` workers training mlp-bn (SyncBN on, so that every
/// forward talks to the peers) for `steps` steps with `train` added, under `launch` flags.
/// Returns the output and the checkpoint directory.
fn launch(
    dir: &Path,
    tag: &str,
    nproc: usize,
    steps: u64,
    launch: &[&str],
    train: &[&str],
) -> (Output, PathBuf) {
    let ck = dir.join(format!("ck-{tag}"));
    let log = dir.join(format!("{tag}.jsonl"));
    let mut cmd = Command::new(shardline());
    cmd.args(["launch", "--nproc-per-node", &nproc.to_string()])
        .args(launch)
        .args(["--", "train", "--model", "mlp-bn", "--dataset", "digits", "--batch-size", "48"])
        .args(["--steps", &steps.to_string(), "--sync-bn", "on", "--no-progress"])
        .args(["--checkpoint-every", "4", "--checkpoint-dir"])
        .arg(&ck)
        .arg("--log-json")
        .arg(&log)
        .args(train);
    let out = wait_output(spawn(cmd), Instant::now() + DEADLINE, tag);
    (out, ck)
}

fn text(o: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn ok(o: &Output, what: &str) -> String {
    let t = text(o);
    assert!(o.status.success(), "{what} failed ({:?}):\n{t}", o.status);
    t
}

/// Every file of the newest checkpoint under `root`, by name: shards, buffers and the
/// manifest (which records every file's digest).
fn final_files(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let dir = shardline_runtime::checkpoint::latest(root)
        .expect("list checkpoints")
        .unwrap_or_else(|| panic!("no checkpoint in {}", root.display()));
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(&dir).expect("read checkpoint") {
        let e = e.expect("entry");
        let bytes = std::fs::read(e.path()).expect("read file");
        out.insert(e.file_name().to_string_lossy().into_owned(), bytes);
    }
    out
}

/// The final checkpoints under `a` and `b` hold the same bytes, file for file.
fn assert_bitwise(a: &Path, b: &Path, what: &str) {
    let (x, y) = (final_files(a), final_files(b));
    assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>(), "{what}: files");
    for (name, bytes) in &x {
        assert!(bytes == &y[name], "{what}: {name} differs from the clean run's");
    }
}

/// The senders named in the workers' `resuming after step N with rank D's state` lines, per
/// resuming rank, and the step N they name.
fn resumed(log: &str) -> Vec<(usize, u64, usize)> {
    log.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("shardline worker: rank ")?;
            let (rank, rest) = rest.split_once(": live recovery: resuming after step ")?;
            let (step, rest) = rest.split_once(" with rank ")?;
            let (sender, _) = rest.split_once("'s state")?;
            Some((rank.parse().ok()?, step.parse().ok()?, sender.parse().ok()?))
        })
        .collect()
}

/// Every one of `ranks` ranks resumed once, after step `step`.
fn assert_all_resumed_after(log: &str, ranks: usize, step: u64) {
    let r = resumed(log);
    assert_eq!(r.len(), ranks, "{log}");
    assert!(r.iter().all(|x| x.1 == step), "{r:?}");
}

/// Steps `1..=last` each logged once, in order: a step whose updates committed while the
/// reduction carrying its figures failed has its line written by the recovery (DRIVE-8).
fn assert_logged_once(steps: &[u64], last: u64) {
    assert_eq!(
        steps,
        (1..=last).collect::<Vec<_>>().as_slice(),
        "every step logged once, in order"
    );
}

const LIVE: &[&str] = &["--live-recovery", "--max-restarts", "2"];

/// LIVE-1, LIVE-2, LIVE-4: at stage 0 a rank killed in any phase of a step, with 2 to 4
/// workers, is replaced in place; the survivors never restart, every rank resumes after the
/// step before the failure from one sender, and the run ends bitwise like a clean one
/// launched without `--live-recovery` (parameters, optimizer state, BatchNorm buffers and
/// the manifest).
#[test]
fn a_killed_rank_at_stage_0_is_replaced_and_the_run_ends_like_a_clean_one_live_4() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 12;
    // (world, killed rank, step, phase)
    let cases = [
        (2, 1, 5, "forward"),
        (2, 0, 6, "reduce"),
        (3, 2, 5, "backward"),
        (4, 0, 3, "backward"),
        (4, 3, 7, "reduce"),
        // While the checkpoint of step 8, and of the last step, is written: the survivors
        // hold step 8 (12), and the recovered run writes the checkpoint the failure cut.
        (4, 2, 8, "checkpoint"),
        (3, 1, 12, "checkpoint"),
    ];
    let mut clean = BTreeMap::new();
    for (world, rank, step, phase) in cases {
        let stage0 = ["--stage", "0"];
        let base = clean.entry(world).or_insert_with(|| {
            let tag = format!("clean-w{world}");
            let (o, ck) = launch(dir, &tag, world, steps, &[], &stage0);
            ok(&o, &tag);
            ck
        });
        let tag = format!("kill-w{world}-r{rank}-s{step}-{phase}");
        let fault = format!("kill:rank={rank}:step={step}:phase={phase}");
        let (o, ck) = launch(dir, &tag, world, steps, LIVE, &["--stage", "0", "--fault", &fault]);
        let t = ok(&o, &tag);
        assert!(t.contains(&format!("rank {rank} exited with signal 9")), "{tag}:\n{t}");
        assert!(t.contains("replaced in place, epoch 1"), "{tag}: no replacement:\n{t}");
        assert!(!t.contains("restart 1/"), "{tag}: the group restarted:\n{t}");
        let r = resumed(&t);
        assert_eq!(r.len(), world, "{tag}: every rank resumes once:\n{t}");
        let sender = r[0].2;
        // A checkpoint fault fires while the step's checkpoint is written: the step is done.
        let held = if phase == "checkpoint" { step } else { step - 1 };
        for (who, after, from) in &r {
            assert_eq!(*after, held, "{tag}: rank {who} resumed after another step");
            assert_eq!(*from, sender, "{tag}: one sender for the one replica set");
        }
        assert_ne!(sender, rank, "{tag}: the replaced rank cannot send");
        assert_bitwise(base, &ck, &tag);
    }
}

/// LIVE-2, LIVE-5: under hybrid sharding (2 shard groups of 2) a killed rank's shard comes
/// from its replica in the other group, at stages 1, 2 and 3, and the run ends bitwise like
/// a clean one launched without `--live-recovery`.
#[test]
fn a_killed_rank_under_hybrid_sharding_takes_its_shard_from_the_other_group_live_5() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    for (stage, rank, step) in [(3, 2, 5), (2, 1, 4), (1, 3, 6)] {
        let s = stage.to_string();
        let args = ["--stage", s.as_str(), "--shard-group", "2"];
        let tag = format!("clean-s{stage}");
        let (o, base) = launch(dir, &tag, 4, 10, &[], &args);
        ok(&o, &tag);
        let tag = format!("kill-s{stage}-r{rank}");
        let fault = format!("kill:rank={rank}:step={step}:phase=backward");
        let mut faulty = args.to_vec();
        faulty.extend(["--fault", fault.as_str()]);
        let (o, ck) = launch(dir, &tag, 4, 10, LIVE, &faulty);
        let t = ok(&o, &tag);
        assert!(t.contains("replaced in place"), "{tag}:\n{t}");
        let r = resumed(&t);
        assert_eq!(r.len(), 4, "{tag}: every rank resumes once:\n{t}");
        for (who, after, from) in r {
            assert_eq!(after, step - 1, "{tag}: rank {who}");
            // Rank r holds shard r % 2: its sender holds the same one and is no replacement.
            assert_eq!(from % 2, who % 2, "{tag}: rank {who} took another shard's state");
            assert_ne!(from, rank, "{tag}: the replaced rank cannot send");
        }
        assert_bitwise(&base, &ck, &tag);
    }
}

/// LIVE-1, DRIVE-8: a rank killed after its step committed and the updates ran, before the
/// loss all-reduce (`phase=update`): the survivors hold the new step, so every rank resumes
/// after it, not before; nobody logged that step, so the recovery writes its line (marked
/// `recovered`), whether rank 0 survived or was the one replaced; the run ends bitwise like
/// a clean one.
#[test]
fn a_kill_after_the_commit_resumes_after_that_step_and_logs_it_live_1_drive_8() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let (o, base) = launch(dir, "clean", 3, 10, &[], &["--stage", "0"]);
    ok(&o, "clean");
    for rank in [1, 0] {
        let tag = format!("update-r{rank}");
        let fault = format!("kill:rank={rank}:step=6:phase=update");
        let (o, ck) = launch(dir, &tag, 3, 10, LIVE, &["--stage", "0", "--fault", &fault]);
        let t = ok(&o, &tag);
        assert!(t.contains("replaced in place, epoch 1"), "{tag}:\n{t}");
        assert_all_resumed_after(&t, 3, 6);
        let log = std::fs::read_to_string(dir.join(format!("{tag}.jsonl"))).expect("log");
        let recovered: Vec<&str> =
            log.lines().filter(|l| l.contains("\"recovered\":true")).collect();
        assert_eq!(recovered.len(), 1, "{tag}: one recovered line:\n{log}");
        assert!(recovered[0].contains("\"step\":6"), "{tag}: {}", recovered[0]);
        assert_logged_once(&logged_steps(&dir.join(format!("{tag}.jsonl"))), 10);
        assert_bitwise(&base, &ck, &tag);
    }
}

/// LIVE-5: at stage 3 with one shard group nobody else holds the killed rank's shard: the
/// workers exit 3 and the group restarts from the checkpoint, ending like a clean run.
#[test]
fn without_a_peer_holding_the_shard_the_group_restarts_from_the_checkpoint_live_5() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let (o, base) = launch(dir, "clean", 2, 10, LIVE, &["--stage", "3"]);
    ok(&o, "clean");
    let fault = ["--stage", "3", "--fault", "kill:rank=1:step=6:phase=backward"];
    let (o, ck) = launch(dir, "fallback", 2, 10, LIVE, &fault);
    let t = ok(&o, "fallback");
    assert!(t.contains("live recovery impossible: no surviving rank of [1]"), "{t}");
    assert!(t.contains("exited with exit code 3"), "{t}");
    assert!(t.contains("restart 1/2: generation 1"), "{t}");
    assert_bitwise(&base, &ck, "fallback");
}

/// LIVE-11, LIVE-4: a rank that stalls (2.5 s against a 1 s collective timeout) is found
/// by its waiting peers at half the timeout, stopped by its agent and replaced in place,
/// before its peers' collectives time out; its fault fires once (the rerun step does not
/// stall again), and the run ends bitwise like a clean one.
#[test]
fn a_stalled_rank_is_stopped_and_replaced_before_the_timeout_live_11() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let args = ["--stage", "0", "--timeout", "1"];
    let (o, base) = launch(dir, "clean", 3, 10, LIVE, &args);
    ok(&o, "clean");
    let mut stalled = args.to_vec();
    stalled.extend(["--fault", "stall:rank=1:step=4:secs=2.5"]);
    let (o, ck) = launch(dir, "stall", 3, 10, LIVE, &stalled);
    let t = ok(&o, "stall");
    assert!(t.contains("rank 1 stalled: reported to node 0's agent"), "{t}");
    assert!(t.contains("rank 1 stalled: its peers waited"), "the agent's reason:\n{t}");
    assert!(t.contains("rank 1 exited with signal 9"), "{t}");
    assert!(t.contains("replaced in place, epoch 1"), "{t}");
    assert!(!t.contains("timeout on lane"), "a collective ran to its timeout:\n{t}");
    assert_eq!(t.matches("fault injected: stall").count(), 1, "{t}");
    assert_all_resumed_after(&t, 3, 3);
    assert_bitwise(&base, &ck, "stall");
}

/// LIVE-6 and the agent's bound: without replacements left the kill fails the launch, and
/// an interrupted live run stops with its group (exit 130) instead of recovering.
#[test]
fn replacements_are_bounded_and_a_stop_is_not_recovered_live_6() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let none_left = ["--live-recovery", "--max-restarts", "0"];
    let fault = ["--stage", "0", "--fault", "kill:rank=1:step=3:phase=forward"];
    let (o, _) = launch(dir, "bounded", 2, 8, &none_left, &fault);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(!t.contains("replaced in place"), "{t}");
    assert!(t.contains("rank 1 exited with signal 9"), "{t}");

    // SIGINT to the agent mid-run: the workers stop after a step, checkpoint it and exit.
    let (ck, log) = (dir.join("ck-int"), dir.join("int.jsonl"));
    let mut cmd = Command::new(shardline());
    cmd.args(["launch", "--nproc-per-node", "2", "--live-recovery", "--max-restarts", "2"])
        .args(["--", "train", "--model", "mlp-bn", "--dataset", "digits", "--steps", "100000"])
        .args(["--stage", "0", "--no-progress", "--checkpoint-dir"])
        .arg(&ck)
        .arg("--log-json")
        .arg(&log);
    let child = spawn(cmd);
    let until = Instant::now() + DEADLINE;
    let steps = || std::fs::read_to_string(&log).map(|t| t.lines().count()).unwrap_or(0);
    while steps() < 3 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = nix::unistd::Pid::from_raw(child.id().expect("agent pid") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let o = wait_output(child, until, "interrupted");
    let t = text(&o);
    assert_eq!(o.status.code(), Some(130), "{t}");
    assert!(!t.contains("live recovery:"), "an interrupted run recovered:\n{t}");
    assert!(!t.contains("replaced in place"), "{t}");
}

/// One agent of a 2-node elastic job on this host (loopback), 2 workers, stage 0, SyncBN,
/// long enough that it cannot end before the test acts.
fn elastic_agent(
    dir: &Path,
    node: usize,
    port: u16,
    tag: &str,
    extra: &[&str],
) -> shardline_tests::launch::Child {
    elastic_agent_with(dir, node, port, tag, &[], extra)
}

/// [`elastic_agent`] with `launch` flags added.
fn elastic_agent_with(
    dir: &Path,
    node: usize,
    port: u16,
    tag: &str,
    launch: &[&str],
    extra: &[&str],
) -> shardline_tests::launch::Child {
    agent_of(dir, (node, "1:2"), port, tag, launch, extra)
}

/// [`elastic_agent_with`] of a job of `nnodes` nodes (`MIN:MAX` or a fixed number).
fn agent_of(
    dir: &Path,
    (node, nnodes): (usize, &str),
    port: u16,
    tag: &str,
    launch: &[&str],
    extra: &[&str],
) -> shardline_tests::launch::Child {
    let mut cmd = Command::new(shardline());
    cmd.args(["launch", "--nnodes", nnodes, "--node-rank", &node.to_string()])
        .args(["--rdzv", &format!("127.0.0.1:{port}"), "--token", "live-elastic"])
        .args(["--nproc-per-node", "2", "--join-wait-s", "0.5"])
        .args(LIVE)
        .args(launch)
        .args(["--", "train", "--model", "mlp-bn", "--dataset", "digits", "--batch-size", "48"])
        .args(["--sync-bn", "on", "--no-progress", "--steps", "400"])
        .args(["--checkpoint-every", "100", "--checkpoint-dir"])
        .arg(dir.join("ck"))
        .arg("--log-json")
        .arg(dir.join(format!("{tag}.jsonl")))
        .args(extra);
    spawn(cmd)
}

/// Waits until `log` holds at least `n` steps (the job runs), within the deadline.
fn wait_steps(log: &Path, n: usize, until: Instant) {
    while logged_steps(log).len() < n {
        assert!(Instant::now() < until, "{} did not reach {n} steps", log.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// LIVE-7, LIVE-8: an elastic job that loses a node (its agent SIGKILLed, its workers with
/// it) goes on live on the node left: no restart, the survivors renumbered into a world of
/// 2, every step logged once and the run finished. At stage 0 the state is re-padded to the
/// new world; under shard groups of a node (stage 3) the node left holds every shard.
#[test]
fn a_lost_node_leaves_the_job_running_live_on_the_others_live_7_8() {
    for args in [&["--stage", "0"][..], &["--stage", "3", "--shard-group", "node"][..]] {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        let port = free_port();
        // A stall keeps the job from ending before the loss is seen, on a fast host.
        let mut extra = args.to_vec();
        extra.extend(["--fault", "stall:rank=0:step=60:secs=4"]);
        let a0 = elastic_agent(dir, 0, port, "n0", &extra);
        let a1 = elastic_agent(dir, 1, port, "n1", &extra);
        let until = Instant::now() + DEADLINE;
        wait_steps(&dir.join("n0.jsonl"), 20, until);
        shardline_tests::launch::kill_group(&a1);
        let _ = wait_output(a1, until, "node 1");
        let o = wait_output(a0, until, "node 0");
        let t = ok(&o, "node 0");
        assert!(t.contains("the job goes on live on node(s) [0]"), "{args:?}:\n{t}");
        assert!(t.contains("world 2"), "{t}");
        assert!(!t.contains("restart 1/"), "{args:?}: the group restarted:\n{t}");
        let r = resumed(&t);
        assert_eq!(r.len(), 2, "{args:?}: both survivors resume:\n{t}");
        let steps = logged_steps(&dir.join("n0.jsonl"));
        assert_logged_once(&steps, 400);
        let last = shardline_runtime::checkpoint::latest(dir.join("ck")).unwrap().unwrap();
        let ck = shardline_runtime::checkpoint::Checkpoint::open(last).unwrap();
        ck.verify().unwrap();
        assert_eq!((ck.manifest().step, ck.manifest().world), (400, 2), "{args:?}");
    }
}

/// LIVE-9: a node that arrives joins the running job in memory: the group stops after a
/// step, the arriving workers receive the state from a peer over the transport, and the job
/// goes on at world 4 from that step, with no restart and every step logged once.
#[test]
fn an_arriving_node_joins_in_memory_at_a_step_boundary_live_9() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let port = free_port();
    // Rank 0 stalls at step 60 (4 s) so that the arrival is seen before the job ends.
    let hold = ["--stage", "0", "--fault", "stall:rank=0:step=60:secs=4"];
    let a0 = elastic_agent(dir, 0, port, "n0", &hold);
    let until = Instant::now() + DEADLINE;
    wait_steps(&dir.join("n0.jsonl"), 20, until);
    let a1 = elastic_agent(dir, 1, port, "n1", &hold);
    let o1 = wait_output(a1, until, "node 1");
    let o0 = wait_output(a0, until, "node 0");
    let (t0, t1) = (ok(&o0, "node 0"), ok(&o1, "node 1"));
    assert!(t0.contains("the job grows live to node(s) [0, 1]"), "{t0}");
    assert!(t1.contains("joining generation 0 live at epoch"), "{t1}");
    assert!(!t0.contains("restart 1/") && !t0.contains("generation 1"), "{t0}");
    let all = format!("{t0}\n{t1}");
    let r = resumed(&all);
    assert_eq!(r.len(), 4, "four ranks resume:\n{all}");
    let at = r[0].1;
    assert!(r.iter().all(|x| x.1 == at && x.2 < 2), "one step, a sender of node 0: {r:?}");
    let steps = logged_steps(&dir.join("n0.jsonl"));
    assert_logged_once(&steps, 400);
    let last = shardline_runtime::checkpoint::latest(dir.join("ck")).unwrap().unwrap();
    let ck = shardline_runtime::checkpoint::Checkpoint::open(last).unwrap();
    ck.verify().unwrap();
    assert_eq!((ck.manifest().step, ck.manifest().world), (400, 4));
}

/// LIVE-10: a rank that hangs for good in the first step, before any collective of its
/// epoch ended (so LIVE-11 is not armed), is out: its peers time out, report it late to the
/// next epoch's meeting, its agent stops and replaces it, and the run ends bitwise like a
/// clean one.
#[test]
fn a_hung_rank_is_stopped_and_replaced_live_10() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let args = ["--stage", "0", "--timeout", "1"];
    let (o, base) = launch(dir, "clean", 3, 10, LIVE, &args);
    ok(&o, "clean");
    let mut hung = args.to_vec();
    hung.extend(["--fault", "stall:rank=1:step=1:secs=1000"]);
    let (o, ck) = launch(dir, "hung", 3, 10, LIVE, &hung);
    let t = ok(&o, "hung");
    assert!(t.contains("did not come to its peers' next epoch in time (1 1)"), "{t}");
    assert!(!t.contains("stalled: reported"), "LIVE-11 armed before a collective ended:\n{t}");
    assert!(t.contains("rank 1 exited with signal 9"), "{t}");
    assert!(t.contains("replaced in place, epoch 1"), "{t}");
    assert_all_resumed_after(&t, 3, 0);
    assert_bitwise(&base, &ck, "hung");
}

/// LIVE-7 with the replicated store (LAUNCH-14): node 0's agent, which decided the job and
/// served a replica, is SIGKILLed with its worker; the agent whose replica leads next takes
/// the job over and, without a restart, the job goes on live on nodes 1 and 2 to its end.
#[test]
fn the_loss_of_node_0_is_survived_live_7() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let rdzv = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect::<Vec<_>>().join(",");
    let agent = |node: usize| {
        let mut cmd = Command::new(shardline());
        cmd.args(["launch", "--nnodes", "2:3", "--node-rank", &node.to_string()])
            .args(["--rdzv", &rdzv, "--token", "live-node-0", "--nproc-per-node", "1"])
            .args(LIVE)
            .args(["--", "train", "--model", "mlp-bn", "--dataset", "digits", "--stage", "0"])
            .args(["--sync-bn", "on", "--no-progress", "--steps", "300", "--checkpoint-every"])
            .args(["100", "--fault", "stall:rank=1:step=60:secs=5", "--checkpoint-dir"])
            .arg(dir.join("ck"))
            .arg("--log-json")
            .arg(dir.join(format!("n{node}.jsonl")));
        spawn(cmd)
    };
    let agents: Vec<_> = (0..3).map(agent).collect();
    let until = Instant::now() + DEADLINE;
    wait_steps(&dir.join("n0.jsonl"), 20, until);
    let mut agents = agents.into_iter();
    let a0 = agents.next().expect("node 0");
    shardline_tests::launch::kill_group(&a0);
    let _ = wait_output(a0, until, "node 0");
    let outs: Vec<_> = agents.map(|a| wait_output(a, until, "agent")).collect();
    let t: String = outs.iter().map(|o| ok(o, "node 1 or 2")).collect();
    assert!(t.contains("takes over generation 0 from node 0"), "{t}");
    assert!(t.contains("the job goes on live on node(s) [1, 2]"), "{t}");
    assert!(!t.contains("restart 1/"), "the group restarted:\n{t}");
    // Node 0 logged until its loss, node 1 (rank 0 since) from the step after the one the
    // job resumed after. A step the survivors completed while node 0 died before logging it
    // is in no log (its figures were rank 0's to write): at most that one step is missing.
    let (mut a, b) = (logged_steps(&dir.join("n0.jsonl")), logged_steps(&dir.join("n1.jsonl")));
    let first = *b.first().expect("node 1 logged");
    a.retain(|&s| s < first);
    let gap = first - a.last().copied().unwrap_or(0) - 1;
    assert!(gap <= 1, "{gap} steps missing before step {first}");
    a.extend(b);
    assert_eq!(a.len() as u64 + gap, 300, "every other step logged once: {a:?}");
    assert_eq!(a.last(), Some(&300));
}

/// A 2-node job (`nnodes`: `1:2` or `2`) of 2 workers each, held at step 60 so that it runs
/// on; node 1's agent is killed with its workers after step 20 and started again `away`
/// later. Both agents' output once they ended successfully, within the deadline.
fn node_1_killed_and_back(dir: &Path, nnodes: &str, beat: &[&str], away: Duration) -> String {
    let port = free_port();
    let hold = ["--stage", "0", "--fault", "stall:rank=0:step=60:secs=4"];
    let a0 = agent_of(dir, (0, nnodes), port, "n0", beat, &hold);
    let a1 = agent_of(dir, (1, nnodes), port, "n1", beat, &hold);
    let until = Instant::now() + DEADLINE;
    wait_steps(&dir.join("n0.jsonl"), 20, until);
    shardline_tests::launch::kill_group(&a1);
    let _ = wait_output(a1, until, "node 1");
    std::thread::sleep(away);
    let back = agent_of(dir, (1, nnodes), port, "n1", beat, &hold);
    let (o1, o0) = (wait_output(back, until, "node 1 again"), wait_output(a0, until, "node 0"));
    format!("{}\n{}", ok(&o0, "node 0"), ok(&o1, "node 1 again"))
}

/// LIVE-4: a node's agent that is killed with its workers and started again within the
/// heartbeat timeout starts its workers as replacements into the epoch after theirs; the job
/// goes on in place, neither restarted nor shrunk, every step logged once.
#[test]
fn an_agent_that_comes_back_replaces_its_workers_in_place_live_4() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // The heartbeat timeout is long enough that a loaded host never counts node 1 as lost
    // while its agent comes back (the job would then go on without it, LIVE-7).
    let beat = ["--heartbeat-timeout-s", "20"];
    let t = node_1_killed_and_back(dir, "1:2", &beat, Duration::from_millis(300));
    assert!(!t.contains("restart 1/") && !t.contains("goes on live on"), "{t}");
    let r = resumed(&t);
    assert_eq!(r.len(), 4, "every rank resumes once:\n{t}");
    assert_logged_once(&logged_steps(&dir.join("n0.jsonl")), 400);
}

/// LIVE-12: in a fixed-size job, a node whose agent is killed with its workers and comes
/// back after the heartbeat timeout is awaited in place: the deciding agent does not restart
/// the group, the returning agent starts its workers as replacements, and the job goes on
/// in place, every step logged once, ending at world 4.
#[test]
fn a_fixed_size_job_awaits_a_silent_node_in_place_live_12() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // Away past the heartbeat timeout: without LIVE-12 the group would restart.
    let t =
        node_1_killed_and_back(dir, "2", &["--heartbeat-timeout-s", "1"], Duration::from_secs(2));
    assert!(t.contains("node 1 silent for"), "{t}");
    assert!(t.contains("awaited in place"), "{t}");
    assert!(!t.contains("restart 1/") && !t.contains("node 1 lost"), "{t}");
    let r = resumed(&t);
    assert_eq!(r.len(), 4, "every rank resumes once:\n{t}");
    assert_logged_once(&logged_steps(&dir.join("n0.jsonl")), 400);
    let last = shardline_runtime::checkpoint::latest(dir.join("ck")).unwrap().unwrap();
    let ck = shardline_runtime::checkpoint::Checkpoint::open(last).unwrap();
    ck.verify().unwrap();
    assert_eq!((ck.manifest().step, ck.manifest().world), (400, 4));
}
