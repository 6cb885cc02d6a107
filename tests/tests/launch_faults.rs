//! Fault tolerance of `shardline launch` (LAUNCH-6 to LAUNCH-10 in the runtime's launch
//! module): a killed worker restarts the group from the last checkpoint, a lost node shrinks
//! an elastic job, a partitioned node is detected and the job recovers once the link is back.
//! Every process carries a deadline (NETNS-3): a bug fails the test instead of hanging it.
//! The namespace tests need root: without it they skip and say why on stderr; as root a
//! harness that fails fails them (NETNS-8).

use shardline_runtime::checkpoint::Checkpoint;
use shardline_runtime::fault::FaultSpec;
use shardline_tests::launch::{kill_group, shardline, spawn, wait_output, Child, LaunchNet};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);

fn train_args(steps: u64, every: u64, dir: &Path, tag: &str) -> Vec<String> {
    let ck = dir.join(format!("ck-{tag}"));
    let log = dir.join(format!("{tag}.jsonl"));
    [
        "train",
        "--model",
        "mlp-bn",
        "--dataset",
        "digits",
        "--batch-size",
        "48",
        "--steps",
        &steps.to_string(),
        "--sync-bn",
        "on",
        "--no-progress",
        "--timeout",
        "20",
        "--checkpoint-every",
        &every.to_string(),
        "--checkpoint-dir",
        &ck.to_string_lossy(),
        "--log-json",
        &log.to_string_lossy(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run(mut args: Vec<String>, what: &str) -> Output {
    let mut cmd = Command::new(shardline());
    cmd.args(args.drain(..));
    wait_output(spawn(cmd), Instant::now() + DEADLINE, what)
}

fn text(o: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn latest(root: &Path) -> Checkpoint {
    let dir = shardline_runtime::checkpoint::latest(root)
        .expect("list checkpoints")
        .unwrap_or_else(|| panic!("no checkpoint in {}", root.display()));
    let ck = Checkpoint::open(dir).expect("open checkpoint");
    ck.verify().expect("checkpoint verifies");
    ck
}

/// Final parameters of two checkpoint roots: bitwise equal (`tol` 0) or within `tol`
/// relative.
fn assert_same_params(a: &Path, b: &Path, tol: f32) {
    let (c1, c2) = (latest(a), latest(b));
    assert_eq!(c1.manifest().step, c2.manifest().step, "final steps differ");
    let (u1, u2) = (c1.consolidate().expect("consolidate"), c2.consolidate().expect("consolidate"));
    assert_eq!(u1.len(), u2.len());
    for (k, (x, y)) in u1.iter().zip(&u2).enumerate() {
        assert_eq!(x.params.len(), y.params.len());
        for (i, (p, q)) in x.params.iter().zip(&y.params).enumerate() {
            if tol == 0.0 {
                assert_eq!(p.to_bits(), q.to_bits(), "unit {k} param {i}: {p} vs {q}");
            } else {
                assert!((p - q).abs() <= tol * p.abs().max(1.0), "unit {k} param {i}: {p} vs {q}");
            }
        }
    }
}

/// The `unix_ms=` value of the first line containing `needle`.
fn unix_ms_of(log: &str, needle: &str) -> Option<u128> {
    let line = log.lines().find(|l| l.contains(needle))?;
    let v = line.split("unix_ms=").nth(1)?;
    v.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// The last step in a `--log-json` file (0 while there is none).
fn logged_step(path: &Path) -> u64 {
    shardline_tests::launch::logged_steps(path).into_iter().max().unwrap_or(0)
}

/// LAUNCH-6, LAUNCH-8, LAUNCH-9: a worker SIGKILLed at step 5 (first generation only) is
/// detected by its agent, the group restarts from the checkpoint of step 4 and ends where a
/// clean launch ends, bitwise (same world).
#[test]
fn killed_worker_restarts_and_ends_like_a_clean_launch() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let launch = |extra: &[&str], tag: &str, faults: &[&str]| {
        let mut args: Vec<String> =
            ["launch", "--nproc-per-node", "2"].iter().map(|s| s.to_string()).collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args.push("--".into());
        args.extend(train_args(12, 2, dir, tag));
        for f in faults {
            args.extend(["--fault".to_string(), f.to_string()]);
        }
        run(args, tag)
    };
    let clean = launch(&[], "clean", &[]);
    assert!(clean.status.success(), "clean launch failed:\n{}", text(&clean));
    let out = launch(&["--max-restarts", "1"], "fault", &["kill:rank=1:step=5"]);
    let log = text(&out);
    assert!(out.status.success(), "launch with a restart failed:\n{log}");
    assert!(log.contains("rank 1 exited with signal 9 (SIGKILL)"), "no detection:\n{log}");
    assert!(log.contains("restart 1/1: generation 1"), "no restart:\n{log}");
    assert!(log.contains("resumed from") && log.contains("(step 4)"), "resume point:\n{log}");
    assert!(log.contains("recovered: generation 1"), "no recovery line:\n{log}");
    let killed = unix_ms_of(&log, "fault injected: kill rank 1").expect("kill line");
    let seen = unix_ms_of(&log, "rank 1 exited with signal 9").expect("detection line");
    let took = seen.saturating_sub(killed);
    println!("killed worker detected {took} ms after the kill (collective timeout 20 s)");
    // A deadline, not a timing claim: detection must not wait for the collective timeout.
    assert!(seen >= killed && took < 20_000, "detected after {took} ms");
    assert_same_params(&dir.join("ck-clean"), &dir.join("ck-fault"), 0.0);
}

/// SUP-2 under launch: without restarts the same fault fails the launch, naming the rank.
#[test]
fn killed_worker_without_restarts_fails_the_launch() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args: Vec<String> =
        ["launch", "--nproc-per-node", "2", "--"].iter().map(|s| s.to_string()).collect();
    args.extend(train_args(8, 2, tmp.path(), "f"));
    args.extend(["--fault".to_string(), "kill:rank=0:step=3".to_string()]);
    let out = run(args, "launch");
    let log = text(&out);
    assert!(!out.status.success(), "should fail:\n{log}");
    assert!(log.contains("rank 0 exited with signal 9 (SIGKILL)"), "{log}");
    assert!(log.contains("giving up"), "{log}");
}

/// LAUNCH-10: `--nnodes 1:2` on two namespace nodes; node 1's agent and workers are
/// SIGKILLed mid-run; node 0's agent restarts with its own workers only (world 2 -> 1), the
/// world-2 checkpoint reshards on load, and training finishes. The result equals a clean
/// run that made the same world change at the same step (`train --world 2 --stop-after K`,
/// then `train --world 1 --resume`), within float tolerance (the tcp sums of world 2 may
/// differ from the one-process run's in order).
#[test]
fn elastic_job_shrinks_when_a_node_is_lost() {
    let test = "elastic_job_shrinks_when_a_node_is_lost";
    let Some(net) = LaunchNet::or_skip(2, test) else { return };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 300;
    let args = train_args(steps, 10, dir, "el");
    let flags = ["--nnodes", "1:2", "--max-restarts", "1", "--heartbeat-timeout-s", "1"];
    let flags = [&flags[..], &["--grace-s", "0.5"]].concat();
    let node0 = net.launch(0, 1, 29_611, &flags, &args);
    let node1 = net.launch(1, 1, 29_611, &flags, &args);
    let deadline = Instant::now() + DEADLINE;
    // Step 41 logged: the checkpoint of step 40, written before step 41 began, is
    // committed (a step's line is in the file as soon as the step ends, DRIVE-7).
    while logged_step(&dir.join("el.jsonl")) < 41 {
        assert!(Instant::now() < deadline, "training never reached step 41");
        std::thread::sleep(Duration::from_millis(10));
    }
    kill_group(&node1);
    let out1 = wait_output(node1, deadline, "node 1");
    assert!(!out1.status.success());
    let out = wait_output(node0, deadline, "node 0");
    let log = text(&out);
    assert!(out.status.success(), "node 0 failed:\n{log}");
    assert!(log.contains("restart 1/1: generation 1 on node(s) [0] (world 1)"), "{log}");
    let resumed = resumed_step(&log);
    assert!(resumed >= 40 && resumed.is_multiple_of(10), "resumed from step {resumed}");
    let ck = latest(&dir.join("ck-el"));
    assert_eq!(ck.manifest().step, steps);
    assert_eq!(ck.manifest().world, 1);
    // The clean run with the same world change.
    let mut a = train_args(steps, 10, dir, "ref");
    a.extend(["--world", "2", "--stop-after", &resumed.to_string()].map(String::from));
    let o = run(a, "reference, world 2");
    assert!(o.status.success(), "{}", text(&o));
    let mut b = train_args(steps, 10, dir, "ref");
    b.extend(["--world", "1", "--resume"].map(String::from));
    let o = run(b, "reference, world 1");
    assert!(o.status.success(), "{}", text(&o));
    assert_same_params(&dir.join("ck-ref"), &dir.join("ck-el"), 1e-4);
}

/// FAULT plan `partition:node=N:step=S:secs=T` on namespace nodes: the harness takes node
/// N's link down when rank 0 has logged step S and up again T seconds later. The ranks detect
/// it (an error naming the peer, no hang), and with `--max-restarts` the job recovers once
/// the link is back and ends like the one-process run (within float tolerance).
#[test]
fn partitioned_node_is_detected_and_the_job_recovers() {
    let test = "partitioned_node_is_detected_and_the_job_recovers";
    let Some(net) = LaunchNet::or_skip(2, test) else { return };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 200;
    let spec = "partition:node=1:step=30:secs=4";
    let Ok(FaultSpec::Partition { node, step, secs }) = FaultSpec::parse(spec) else {
        panic!("{spec} does not parse as a partition");
    };
    let mut args = train_args(steps, 10, dir, "part");
    let t = args.iter().position(|a| a == "--timeout").expect("timeout flag");
    args[t + 1] = "2".into();
    args.extend(["--fault".to_string(), spec.to_string()]);
    let flags = ["--max-restarts", "1", "--heartbeat-timeout-s", "1", "--grace-s", "0.5"];
    let children: Vec<_> = (0..2).map(|k| net.launch(k, 1, 29_612, &flags, &args)).collect();
    let deadline = Instant::now() + DEADLINE;
    while logged_step(&dir.join("part.jsonl")) < step {
        assert!(Instant::now() < deadline, "training never reached step {step}");
        std::thread::sleep(Duration::from_millis(5));
    }
    let link = net.link_down(node).expect("link down");
    std::thread::sleep(Duration::from_secs_f64(secs));
    link.up();
    let mut log = String::new();
    for (k, c) in children.into_iter().enumerate() {
        let out = wait_output(c, deadline, &format!("node {k}"));
        let t = text(&out);
        assert!(out.status.success(), "node {k} failed:\n{t}");
        log.push_str(&t);
    }
    // Detected, no hang: the rank cut off fails its collective with a timeout or a lost peer,
    // and node 0's agent names the silent node, or a rank's error names its peer. A timeout
    // never reports the placeholder usize::MAX as a rank.
    assert!(!log.contains(&usize::MAX.to_string()), "a timeout names no real rank:\n{log}");
    let failed = log
        .lines()
        .any(|l| l.starts_with("error: rank 1: ") && (l.contains("timeout") || l.contains("lost")));
    assert!(failed, "rank 1 reported no timeout or lost peer:\n{log}");
    let named = log.contains("fault: node 1 lost")
        || log.lines().any(|l| l.starts_with("error: rank 0: ") && l.contains("rank 1"));
    assert!(named, "nothing names the node or rank across the partition:\n{log}");
    assert!(log.contains("fault: node 1 lost") || log.contains("fault: rank"), "{log}");
    assert!(log.contains("restart 1/1: generation 1 on node(s) [0, 1] (world 2)"), "{log}");
    let ck = latest(&dir.join("ck-part"));
    assert_eq!(ck.manifest().world, 2);
    let mut r = train_args(steps, 10, dir, "ref");
    r.extend(["--world", "2"].map(String::from));
    let o = run(r, "reference");
    assert!(o.status.success(), "{}", text(&o));
    assert_same_params(&dir.join("ck-ref"), &dir.join("ck-part"), 1e-4);
}

/// A follower node whose store does not answer (node 0 not started yet, or a wrong address)
/// says what it waits for and why, instead of staying silent until it gives up.
#[test]
fn follower_without_a_store_says_what_it_waits_for() {
    // A port nobody listens on: bind one, note it, close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let rdzv = format!("127.0.0.1:{port}");
    let mut cmd = Command::new(shardline());
    cmd.args(["launch", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1"]).args([
        "--rdzv",
        &rdzv,
        "--token",
        "follower-test",
        "--",
        "train",
        "--steps",
        "1",
    ]);
    let child = spawn(cmd);
    std::thread::sleep(Duration::from_secs(5));
    kill_group(&child);
    let o = wait_output(child, Instant::now() + Duration::from_secs(20), "follower");
    let log = text(&o);
    assert!(log.contains(&format!("waiting for node 0's store at {rdzv}")), "{log}");
    assert!(log.contains("refused"), "the reason is named: {log}");
}

/// Ctrl-C on a launched job (SIGINT to the agent's process group, as a terminal sends it):
/// the agent forwards it, every worker stops after the same step (agreed through that step's
/// loss reduction), the group writes one checkpoint of it, and the launch exits 130 (INT-1).
#[test]
fn interrupted_launch_checkpoints_one_step_and_exits_130() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ck = dir.path().join("ck");
    let log = dir.path().join("steps.jsonl");
    let mut cmd = Command::new(shardline());
    cmd.args(["launch", "--nproc-per-node", "2", "--", "train", "--dataset", "synthetic"])
        .args(["--samples", "4096", "--hidden", "64", "--depth", "2", "--steps", "100000"])
        .args(["--no-progress", "--checkpoint-every", "100000", "--timeout", "20"])
        .arg("--checkpoint-dir")
        .arg(&ck)
        .arg("--log-json")
        .arg(&log);
    let child = spawn(cmd);
    let lines = || std::fs::read_to_string(&log).map_or(0, |s| s.lines().count());
    let t0 = Instant::now();
    while lines() < 20 {
        assert!(t0.elapsed() < DEADLINE, "no 20 steps logged in time");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pgid = nix::unistd::Pid::from_raw(child.id().expect("agent pid") as i32);
    nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let o = wait_output(child, Instant::now() + DEADLINE, "interrupted launch");
    let log_text = text(&o);
    assert_eq!(o.status.code(), Some(130), "{log_text}");
    assert!(log_text.contains("stopped by SIGINT after step"), "{log_text}");
    let latest = shardline_runtime::checkpoint::latest(&ck).expect("list").expect("a checkpoint");
    let c = Checkpoint::open(latest).expect("open");
    c.verify().expect("the checkpoint verifies");
    assert_eq!(c.manifest().world, 2);
    assert_eq!(c.manifest().step as usize, lines(), "the checkpoint holds the last logged step");
}

/// Three agents on this host with a replicated store (LAUNCH-14): one `--rdzv` address per
/// node, `--nnodes 2:3 --max-restarts 1`, one worker each, checkpoints every 10 steps.
struct Replicated {
    addrs: Vec<String>,
    agents: Vec<Option<shardline_tests::launch::Child>>,
}

const REPLICATED_TOKEN: &str = "replicated-store-test";

impl Replicated {
    fn start(args: &[String]) -> Replicated {
        let ls: Vec<std::net::TcpListener> =
            (0..3).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<String> = ls.iter().map(|l| l.local_addr().unwrap().to_string()).collect();
        drop(ls);
        let agents = (0..3)
            .map(|k| {
                let mut cmd = Command::new(shardline());
                cmd.args(["launch", "--nproc-per-node", "1", "--nnodes", "2:3"])
                    .args(["--max-restarts", "1", "--heartbeat-timeout-s", "1", "--grace-s", "0.5"])
                    .args(["--node-rank", &k.to_string(), "--rdzv", &addrs.join(",")])
                    .args(["--token", REPLICATED_TOKEN, "--"])
                    .args(args);
                Some(spawn(cmd))
            })
            .collect();
        Replicated { addrs, agents }
    }

    /// The node whose agent decided the running generation, read from the store.
    fn decider(&self, deadline: Instant) -> u64 {
        let rdzv = self.addrs.join(",");
        let hash = shardline_runtime::checkpoint::config_hash(&(rdzv.as_str(), REPLICATED_TOKEN))
            .expect("hash");
        let key = format!("agent/l{}/gen", &hash[..10]);
        let store = shardline_collectives::ReplicatedStore::new(
            self.addrs.clone(),
            REPLICATED_TOKEN,
            Duration::from_secs(5),
        )
        .expect("client");
        use shardline_collectives::Store as _;
        let left = deadline.saturating_duration_since(Instant::now());
        let v = store.get(&key, left).expect("the generation record");
        let g: serde_json::Value = serde_json::from_slice(&v).expect("json");
        g["by"].as_u64().expect("by")
    }

    fn kill(&mut self, node: usize) -> Output {
        let c = self.agents[node].take().expect("running");
        kill_group(&c);
        wait_output(c, Instant::now() + DEADLINE, &format!("node {node}"))
    }

    fn wait(&mut self, node: usize, deadline: Instant) -> Output {
        let c = self.agents[node].take().expect("running");
        wait_output(c, deadline, &format!("node {node}"))
    }
}

/// LAUNCH-14, LAUNCH-10: node 0's agent (with its worker) is SIGKILLed mid-run; the store
/// lives on in the other two replicas, the agent whose replica leads then decides a second
/// generation on the two survivors, which resumes from the last checkpoint and finishes.
/// Node 0's replica campaigns first at start-up, so node 0 is normally the leader and the
/// deciding agent when killed; the test says which it was.
#[test]
fn replicated_store_survives_node_0() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 200;
    let mut job = Replicated::start(&train_args(steps, 10, dir, "rep"));
    let deadline = Instant::now() + DEADLINE;
    // Step 31 logged: the checkpoint of step 30 is committed (DRIVE-7).
    while logged_step(&dir.join("rep.jsonl")) < 31 {
        assert!(Instant::now() < deadline, "training never reached step 30");
        std::thread::sleep(Duration::from_millis(10));
    }
    let decider = job.decider(deadline);
    println!("node {decider}'s agent decided generation 0; killing node 0's");
    let killed_at = Instant::now();
    job.kill(0);
    let mut log = String::new();
    for k in [1, 2] {
        let out = job.wait(k, deadline);
        let t = text(&out);
        assert!(out.status.success(), "node {k} failed:\n{t}");
        log.push_str(&t);
    }
    println!("the survivors finished {:.1} s after the kill", killed_at.elapsed().as_secs_f64());
    assert!(log.contains("restart 1/1: generation 1 on node(s) [1, 2] (world 2)"), "{log}");
    if decider == 0 {
        assert!(log.contains("takes over generation 0 from node 0"), "{log}");
    }
    let resumed = resumed_step(&log);
    assert!(resumed >= 30 && resumed.is_multiple_of(10), "resumed from step {resumed}");
    let ck = latest(&dir.join("ck-rep"));
    assert_eq!(ck.manifest().step, steps);
    assert_eq!(ck.manifest().world, 2);
}

/// LAUNCH-14: two of three agents are SIGKILLed mid-run (the deciding one among them when
/// it is not the third); the last agent's replica hears from no majority, so it stops its
/// worker and exits non-zero, saying it lost the quorum, within the test's deadline.
#[test]
fn a_lone_agent_stops_for_want_of_a_quorum() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let mut job = Replicated::start(&train_args(100_000, 1000, dir, "lone"));
    let deadline = Instant::now() + DEADLINE;
    while logged_step(&dir.join("lone.jsonl")) < 10 {
        assert!(Instant::now() < deadline, "training never reached step 10");
        std::thread::sleep(Duration::from_millis(10));
    }
    let decider = job.decider(deadline) as usize;
    let lone = if decider == 2 { 0 } else { 2 };
    let killed_at = Instant::now();
    for k in (0..3).filter(|&k| k != lone) {
        job.kill(k);
    }
    let out = job.wait(lone, deadline);
    let log = text(&out);
    println!(
        "node {lone} alone (node {decider} decided) exited {:.1} s after the kill",
        killed_at.elapsed().as_secs_f64()
    );
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(log.contains("lost the quorum"), "{log}");
}

/// Bad `--rdzv` lists exit 2 naming the flag: as many addresses as nodes, each HOST:PORT.
#[test]
fn a_bad_replica_list_is_refused_naming_the_flag() {
    for (rdzv, says) in [
        ("127.0.0.1:1,127.0.0.1:2", "2 addresses for --nnodes 3"),
        ("127.0.0.1:1,127.0.0.1:x,127.0.0.1:3", "--rdzv 127.0.0.1:x: expected HOST:PORT"),
    ] {
        let mut cmd = Command::new(shardline());
        cmd.args(["launch", "--nproc-per-node", "1", "--nnodes", "3", "--node-rank", "1"])
            .args(["--rdzv", rdzv, "--token", "t", "--", "train", "--steps", "1"]);
        let o = wait_output(spawn(cmd), Instant::now() + DEADLINE, "launch");
        let log = text(&o);
        assert_eq!(o.status.code(), Some(2), "{log}");
        assert!(log.contains(says), "{log}");
    }
}

/// LAUNCH-14 on namespace nodes: node 0 (normally the store's leader and the deciding
/// agent) is cut off for good mid-run. Its agent, a minority of one, stops its worker and
/// exits 1 saying it lost the quorum; nodes 1 and 2 elect a leader among their replicas,
/// whose agent takes the job over and restarts it on the two of them from the last
/// checkpoint, and it finishes.
#[test]
fn a_partitioned_minority_stops_and_the_majority_finishes() {
    let test = "a_partitioned_minority_stops_and_the_majority_finishes";
    let Some(net) = LaunchNet::or_skip(3, test) else { return };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 200;
    let args = train_args(steps, 10, dir, "cut");
    let rdzv: Vec<String> = (0..3).map(|k| format!("{}:29613", net.addr(k))).collect();
    let agents: Vec<_> = (0..3)
        .map(|k| {
            let mut cmd = net.command(k, shardline());
            cmd.args(["launch", "--nproc-per-node", "1", "--nnodes", "2:3"])
                .args(["--max-restarts", "1", "--heartbeat-timeout-s", "1", "--grace-s", "0.5"])
                .args(["--node-rank", &k.to_string(), "--rdzv", &rdzv.join(",")])
                .args(["--token", REPLICATED_TOKEN, "--"])
                .args(&args);
            spawn(cmd)
        })
        .collect();
    let deadline = Instant::now() + DEADLINE;
    while logged_step(&dir.join("cut.jsonl")) < 30 {
        assert!(Instant::now() < deadline, "training never reached step 30");
        std::thread::sleep(Duration::from_millis(10));
    }
    let link = net.link_down(0).expect("link down");
    let cut_at = Instant::now();
    let mut outs: Vec<Output> = Vec::new();
    for (k, c) in agents.into_iter().enumerate() {
        outs.push(wait_output(c, deadline, &format!("node {k}")));
        println!("node {k} exited {:.1} s after the cut", cut_at.elapsed().as_secs_f64());
    }
    drop(link);
    let lone = text(&outs[0]);
    assert_eq!(outs[0].status.code(), Some(1), "{lone}");
    assert!(lone.contains("lost the quorum"), "{lone}");
    let mut log = String::new();
    for (k, o) in outs.iter().enumerate().skip(1) {
        assert!(o.status.success(), "node {k} failed:\n{}", text(o));
        log.push_str(&text(o));
    }
    assert!(log.contains("restart 1/1: generation 1 on node(s) [1, 2] (world 2)"), "{log}");
    let ck = latest(&dir.join("ck-cut"));
    assert_eq!(ck.manifest().step, steps);
    assert_eq!(ck.manifest().world, 2);
}

/// The step the restarted generation resumed from, as the agents log it (`(step N)`).
fn resumed_step(log: &str) -> u64 {
    log.split("(step ")
        .nth(1)
        .and_then(|t| t.split(')').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no resume step:\n{log}"))
}

const ELASTIC_TOKEN: &str = "elastic-growth-test";

/// The last step rank 0 of generation 0 published in the store of node 0's agent at `port`
/// (0 while there is none): unlike the step log, which rank 0 buffers, it is published as
/// each step ends.
fn published_step(port: u16) -> u64 {
    use shardline_collectives::Store as _;
    let rdzv = format!("127.0.0.1:{port}");
    let hash =
        shardline_runtime::checkpoint::config_hash(&(rdzv.as_str(), ELASTIC_TOKEN)).expect("hash");
    let key = shardline_runtime::launch::progress_key(&format!("l{}g0", &hash[..10]));
    shardline_collectives::TcpStoreClient::connect(
        rdzv.as_str(),
        ELASTIC_TOKEN,
        Duration::from_secs(1),
    )
    .ok()
    .and_then(|c| c.get(&key, Duration::from_millis(1)).ok())
    .and_then(|v| String::from_utf8_lossy(&v).parse().ok())
    .unwrap_or(0)
}

/// An agent of `--nnodes 1:2 --max-restarts 0` on this host, with `nproc` workers, node 0
/// alone at start-up (`--join-wait-s 0.2`).
fn elastic_agent(node: usize, nproc: usize, port: u16, args: &[String]) -> Child {
    let mut cmd = Command::new(shardline());
    cmd.args(["launch", "--nproc-per-node", &nproc.to_string(), "--nnodes", "1:2"])
        .args(["--max-restarts", "0", "--heartbeat-timeout-s", "1", "--grace-s", "0.5"])
        .args(["--join-wait-s", "0.2", "--node-rank", &node.to_string()])
        .args(["--rdzv", &format!("127.0.0.1:{port}"), "--token", ELASTIC_TOKEN, "--"])
        .args(args);
    spawn(cmd)
}

/// Keeps generation 0 running long enough for an arriving agent to be seen: on an idle host
/// the small job's steps take under a millisecond, so it could end before the agent starts.
/// Rank 0 stalls 4 s at step 20 (generation 0 only, LAUNCH-8) unless the growth came first;
/// a growth's planned stop waits for it (INT-3).
const HOLD: [&str; 2] = ["--fault", "stall:rank=0:step=20:secs=4"];

/// Node 0's agent alone, then node 1's once rank 0 published `step`; both outputs.
fn grow_at(nproc: usize, step: u64, args: &[String]) -> (Output, Output) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let t0 = Instant::now();
    let deadline = t0 + DEADLINE;
    let node0 = elastic_agent(0, nproc, port, args);
    while published_step(port) < step {
        assert!(Instant::now() < deadline, "node 0 alone never reached step {step}");
        std::thread::sleep(Duration::from_millis(10));
    }
    let node1 = elastic_agent(1, nproc, port, args);
    let out0 = wait_output(node0, deadline, "node 0");
    let out1 = wait_output(node1, deadline, "node 1");
    println!("grown job ran {:.1} s", t0.elapsed().as_secs_f64());
    (out0, out1)
}

/// The number after the first `needle` in `log`.
fn step_after(log: &str, needle: &str) -> u64 {
    let t = log.split(needle).nth(1).unwrap_or_else(|| panic!("no '{needle}':\n{log}"));
    t.split(|c: char| !c.is_ascii_digit()).next().and_then(|d| d.parse().ok()).expect("step")
}

/// What every growth of one node into a job of `steps` steps shows: both agents exit 0 and
/// log node 1's join at step S; generation 0 stopped after step S and checkpointed it;
/// generation 1 on nodes [0, 1] resumed from it and finished; no restart was counted; the
/// step log holds every step exactly once (none lost, none run twice). Returns S.
fn assert_grown(
    out0: &Output,
    out1: &Output,
    steps: u64,
    nproc: usize,
    dir: &Path,
    tag: &str,
) -> u64 {
    let (log0, log1) = (text(out0), text(out1));
    for l in log0.lines().filter(|l| l.contains("join") || l.contains("training again")) {
        println!("{l}");
    }
    assert!(out0.status.success(), "node 0 failed:\n{log0}");
    assert!(out1.status.success(), "node 1 failed:\n{log1}\nnode 0:\n{log0}");
    let joined = "node 1 joins at step ";
    let s = step_after(&log0, joined);
    assert!(s < steps, "joined at step {s}:\n{log0}");
    let line = format!("{joined}{s}: generation 1 on nodes [0, 1] (world {})", 2 * nproc);
    assert!(log0.contains(&line) && log1.contains(&line), "{line}:\n{log0}\nnode 1:\n{log1}");
    // Generation 0 stopped after step S and checkpointed it; generation 1 resumed from it.
    assert_eq!(step_after(&log0, "stopped by SIGUSR1 after step "), s, "{log0}");
    assert_eq!(resumed_step(&log0), s, "{log0}");
    assert!(log0.contains("node 1 in generation 1: training again"), "{log0}");
    for log in [&log0, &log1] {
        assert!(!log.contains("fault:") && !log.contains("restart 1/"), "{log}");
    }
    let ck = latest(&dir.join(format!("ck-{tag}")));
    assert_eq!((ck.manifest().step, ck.manifest().world), (steps, 2 * nproc));
    let logged: Vec<u64> = std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
        .expect("step log")
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
        .collect();
    assert_eq!(logged, (1..=steps).collect::<Vec<_>>(), "every step logged exactly once");
    s
}

/// LAUNCH-15..LAUNCH-18: `--nnodes 1:2 --max-restarts 0` on this host; node 0's agent starts
/// alone and trains; node 1's agent starts once a few steps are logged. Without any failure
/// the job grows at a step boundary (generation 0's stop writes the only checkpoint before
/// the end) and finishes on both nodes (`assert_grown`).
#[test]
fn an_arriving_node_joins_at_a_step_boundary_launch_16() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 400;
    let mut args = train_args(steps, steps, dir, "grow");
    args.extend(HOLD.iter().map(|a| a.to_string()));
    let (out0, out1) = grow_at(1, 5, &args);
    let s = assert_grown(&out0, &out1, steps, 1, dir, "grow");
    assert!(s >= 5, "joined at step {s}");
}

/// INT-3: the growth's stop reaches generation 0 (two ranks on node 0) while rank 1 stalls
/// 3 s at the start of step 3 and rank 0 waits for it in the step's collectives (node 1's
/// agent starts once step 1 is done, and LAUNCH-18 allows the growth from then). The planned
/// stop cuts no such wait short (SIGTERM's watchdog would end rank 0 after 0.5 s, before the
/// step's checkpoint): the group finishes step 3, stops and checkpoints, and the job grows
/// as without the stall. Whether the stop came during the stall depends on how fast node 1's
/// agent starts; the test prints both moments.
#[test]
fn a_planned_stop_waits_for_a_slow_peer_int_3() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 200;
    let mut args = train_args(steps, steps, dir, "slow");
    args.extend(["--fault".to_string(), "stall:rank=1:step=3:secs=3".to_string()]);
    let (out0, out1) = grow_at(2, 1, &args);
    let log0 = text(&out0);
    let stall = unix_ms_of(&log0, "fault injected: stall");
    let stop = unix_ms_of(&log0, "to grow (SIGUSR1");
    println!("stall began at unix_ms {stall:?}, the growth's stop at {stop:?} (stall 3000 ms)");
    let s = assert_grown(&out0, &out1, steps, 2, dir, "slow");
    assert!(s >= 3, "joined at step {s}");
}

/// LAUNCH-14, LAUNCH-15: with one `--rdzv` address per node (`--nnodes 2:3`, a replicated
/// store) the agent whose replica leads grows the job: nodes 0 and 1 start, node 2's agent
/// (whose replica joins the running store) once rank 0 published a step; generation 1 runs
/// on all three from the step generation 0 stopped at, with no restart counted.
#[test]
fn the_leading_agent_grows_a_replicated_job_launch_15() {
    use shardline_collectives::Store as _;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 300;
    let mut args = train_args(steps, steps, dir, "rgrow");
    args.extend(HOLD.iter().map(|a| a.to_string()));
    let ls: Vec<std::net::TcpListener> =
        (0..3).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<String> = ls.iter().map(|l| l.local_addr().unwrap().to_string()).collect();
    drop(ls);
    let rdzv = addrs.join(",");
    let agent = |k: usize| {
        let mut cmd = Command::new(shardline());
        cmd.args(["launch", "--nproc-per-node", "1", "--nnodes", "2:3", "--max-restarts", "0"])
            .args(["--heartbeat-timeout-s", "1", "--grace-s", "0.5", "--join-wait-s", "0.2"])
            .args(["--node-rank", &k.to_string(), "--rdzv", &rdzv])
            .args(["--token", REPLICATED_TOKEN, "--"])
            .args(&args);
        spawn(cmd)
    };
    let deadline = Instant::now() + DEADLINE;
    let (node0, node1) = (agent(0), agent(1));
    let hash = shardline_runtime::checkpoint::config_hash(&(rdzv.as_str(), REPLICATED_TOKEN))
        .expect("hash");
    let key = shardline_runtime::launch::progress_key(&format!("l{}g0", &hash[..10]));
    let store =
        shardline_collectives::ReplicatedStore::new(addrs.clone(), REPLICATED_TOKEN, DEADLINE)
            .expect("client");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "generation 0 never published a step");
        let step =
            store.get(&key, left).ok().and_then(|v| String::from_utf8_lossy(&v).parse().ok());
        if step.is_some_and(|s: u64| s >= 5) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let node2 = agent(2);
    let outs = [
        wait_output(node0, deadline, "node 0"),
        wait_output(node1, deadline, "node 1"),
        wait_output(node2, deadline, "node 2"),
    ];
    let logs: Vec<String> = outs.iter().map(text).collect();
    for (k, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "node {k} failed:\n{}", logs[k]);
    }
    let s = step_after(&logs[0], "node 2 joins at step ");
    let line = format!("node 2 joins at step {s}: generation 1 on nodes [0, 1, 2] (world 3)");
    println!("{line}");
    for log in &logs {
        assert!(log.contains(&line), "{line}:\n{log}");
        assert!(!log.contains("fault:") && !log.contains("restart 1/"), "{log}");
    }
    assert_eq!(step_after(&logs[0], "stopped by SIGUSR1 after step "), s, "{}", logs[0]);
    assert_eq!(resumed_step(&logs[0]), s, "{}", logs[0]);
    let ck = latest(&dir.join("ck-rgrow"));
    assert_eq!((ck.manifest().step, ck.manifest().world), (steps, 3));
    let logged: Vec<u64> = std::fs::read_to_string(dir.join("rgrow.jsonl"))
        .expect("step log")
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
        .collect();
    assert_eq!(logged, (1..=steps).collect::<Vec<_>>(), "every step logged exactly once");
}
