//! torchrun's environment end to end: workers meet in the agent's torch `TCPStore` (played by
//! `TorchStoreServer` where torch is not installed, by the real torchrun where it is) and
//! train exactly as the in-process run does; a signal while a worker waits ends it within a
//! second (LAUNCH-13).
//!
//! Run `cargo build -p shardline-runtime` first: these tests start `target/<profile>/shardline`.

use shardline_collectives::store::TorchStoreServer;
use shardline_collectives::{Store, TcpStoreClient, TorchStoreClient};
use shardline_tests::launch::{
    job_figures, shardline, small_train_args, spawn, wait_output, Child,
};
use shardline_tests::netns::Net;
use shardline_tests::skip::skip_optional;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Every process of these tests ends well within this; a hang fails the test.
const DEADLINE: Duration = Duration::from_secs(120);
/// LAUNCH-13's bound: a waiting worker ends within a second of the signal.
const PROMPT: Duration = Duration::from_secs(1);
const TOKEN: &str = "torchrun-test";
fn train_args(steps: u64, log: &Path) -> Vec<String> {
    let mut a = small_train_args(steps);
    a.extend(["--timeout".into(), "20".into(), "--log-json".into(), path(log)]);
    a
}

fn path(p: &Path) -> String {
    p.to_str().expect("utf-8 path").to_owned()
}

/// `shardline train --world 2` in one process: the reference.
fn in_process(steps: u64, dir: &Path) -> Vec<Vec<String>> {
    let log = dir.join("in-process.jsonl");
    let mut cmd = Command::new(shardline());
    cmd.args(train_args(steps, &log)).args(["--world", "2"]);
    let out = wait_output(spawn(cmd), Instant::now() + DEADLINE, "in-process run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    job_figures(&log)
}

/// A worker with the variables torchrun gives its workers (recorded from torch 2.15's
/// torchrun), the store at `port` on loopback.
fn worker(rank: usize, world: usize, port: u16, agent_store: bool, args: &[String]) -> Child {
    let mut cmd = Command::new(shardline());
    for v in ["SHARDLINE_RANK", "SHARDLINE_RDZV", "SHARDLINE_JOB", "SLURM_PROCID", "SLURM_NTASKS"] {
        cmd.env_remove(v);
    }
    cmd.args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("GROUP_RANK", "0")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TORCHELASTIC_RUN_ID", format!("run-{port}"))
        .env("TORCHELASTIC_RESTART_COUNT", "0")
        .env("SHARDLINE_TOKEN", TOKEN);
    if agent_store {
        cmd.env("TORCHELASTIC_USE_AGENT_STORE", "True");
    }
    spawn(cmd)
}

/// The job name the workers of [`worker`] use (LAUNCH-11).
fn job_of(port: u16) -> String {
    format!("run-{port}g0")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn workers_meet_in_the_agents_torch_store_and_train_as_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let reference = in_process(4, dir.path());
    let store = TorchStoreServer::bind("127.0.0.1:0").unwrap();
    let port = store.addr().port();
    let log = dir.path().join("torchrun.jsonl");
    let args = train_args(4, &log);
    let ranks: Vec<Child> = (0..2).map(|r| worker(r, 2, port, true, &args)).collect();
    for (r, c) in ranks.into_iter().enumerate() {
        let out = wait_output(c, Instant::now() + DEADLINE, &format!("rank {r}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "rank {r}: {err}");
        // No --world was given: nothing to warn of.
        assert!(!err.contains("--world"), "rank {r}: {err}");
    }
    assert_eq!(job_figures(&log), reference, "torchrun-style ranks differ from the in-process run");
    // The hellos are in the agent's store, under the run id and restart count (LAUNCH-11).
    let c = TorchStoreClient::connect(store.addr(), DEADLINE).unwrap();
    for r in 0..2 {
        let key = format!("launch/{}/hello/{r}", job_of(port));
        assert!(c.check(&[key.as_str()]).unwrap(), "{key} missing from the agent's store");
    }
}

#[test]
fn an_explicit_world_the_launcher_overrides_is_named_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = TorchStoreServer::bind("127.0.0.1:0").unwrap();
    let port = store.addr().port();
    let mut args = train_args(1, &dir.path().join("log.jsonl"));
    args.extend(["--world".into(), "4".into()]);
    let ranks: Vec<Child> = (0..2).map(|r| worker(r, 2, port, true, &args)).collect();
    let errs: Vec<String> = ranks
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let out = wait_output(c, Instant::now() + DEADLINE, &format!("rank {r}"));
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success(), "rank {r}: {err}");
            err
        })
        .collect();
    let warning = "warning: --world 4 is not used: the torchrun launch environment sets the \
                   world to 2";
    assert_eq!(errs[0].matches(warning).count(), 1, "rank 0: {}", errs[0]);
    assert!(!errs[1].contains("--world"), "rank 1 repeats the warning: {}", errs[1]);
}

#[test]
fn a_rank_with_another_token_is_named_and_refused() {
    // LAUNCH-12: torch's store checks no token; the ranks check each other's.
    let dir = tempfile::tempdir().unwrap();
    let store = TorchStoreServer::bind("127.0.0.1:0").unwrap();
    let port = store.addr().port();
    let args = train_args(2, &dir.path().join("log.jsonl"));
    let a = worker(0, 2, port, true, &args);
    let mut cmd = Command::new(shardline());
    cmd.args(&args)
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TORCHELASTIC_RUN_ID", format!("run-{port}"))
        .env("TORCHELASTIC_RESTART_COUNT", "0")
        .env("TORCHELASTIC_USE_AGENT_STORE", "True")
        .env("SHARDLINE_TOKEN", "another-token");
    let b = spawn(cmd);
    for (r, c) in [a, b].into_iter().enumerate() {
        let out = wait_output(c, Instant::now() + DEADLINE, &format!("rank {r}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "rank {r}: {err}");
        assert!(err.contains("another SHARDLINE_TOKEN"), "rank {r}: {err}");
    }
}

/// Waits until `done()` holds, polling; panics with `what` past the deadline.
fn until(what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !done() {
        assert!(Instant::now() < end, "{what}: not seen within {DEADLINE:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn sigterm(c: &Child) {
    let pid = nix::unistd::Pid::from_raw(c.id().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
}

/// Sends SIGTERM to every child at once and checks each ends within [`PROMPT`] with 128 + 15,
/// saying it was stopped; the ones in `naming` also say they were waiting for something that
/// contains `waited` (a rank whose store or peer went away with a stopped rank may end on that
/// failure first, and says so after the stop).
fn stop_all_promptly(children: Vec<Child>, naming: &[usize], waited: &str) {
    let t0 = Instant::now();
    for c in &children {
        sigterm(c);
    }
    for (r, c) in children.into_iter().enumerate() {
        let out = wait_output(c, Instant::now() + DEADLINE, &format!("rank {r}"));
        let took = t0.elapsed();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(took < PROMPT, "rank {r} took {took:?} to end after SIGTERM:\n{err}");
        assert_eq!(out.status.code(), Some(128 + 15), "rank {r}:\n{err}");
        assert!(err.contains("stopped by SIGTERM"), "rank {r}:\n{err}");
        if naming.contains(&r) {
            assert!(
                err.contains("stopped by SIGTERM while waiting for") && err.contains(waited),
                "rank {r} does not say what it waited for ({waited}):\n{err}"
            );
        }
    }
}

#[test]
fn sigterm_during_rendezvous_in_the_agents_store_ends_every_worker_within_a_second() {
    // LAUNCH-13: ranks 0 and 1 of 3 wait for rank 2, which never comes.
    let dir = tempfile::tempdir().unwrap();
    let store = TorchStoreServer::bind("127.0.0.1:0").unwrap();
    let port = store.addr().port();
    let args = train_args(2, &dir.path().join("log.jsonl"));
    let ranks: Vec<Child> = (0..2).map(|r| worker(r, 3, port, true, &args)).collect();
    let c = TorchStoreClient::connect(store.addr(), DEADLINE).unwrap();
    let hellos: Vec<String> =
        (0..2).map(|r| format!("launch/{}/hello/{r}", job_of(port))).collect();
    let keys: Vec<&str> = hellos.iter().map(String::as_str).collect();
    until("both hellos in the store", || c.check(&keys).unwrap());
    stop_all_promptly(ranks, &[0, 1], "rank 2 of 3 to join");
}

#[test]
fn sigterm_during_rendezvous_in_rank_0s_store_ends_every_worker_within_a_second() {
    // LAUNCH-13 without torchrun's agent store: rank 0 hosts Shardline's store.
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let args = train_args(2, &dir.path().join("log.jsonl"));
    let ranks: Vec<Child> = (0..2).map(|r| worker(r, 3, port, false, &args)).collect();
    let c = TcpStoreClient::connect(("127.0.0.1", port), TOKEN, DEADLINE).unwrap();
    for r in 0..2 {
        let key = format!("launch/{}/hello/{r}", job_of(port));
        c.get(&key, DEADLINE).unwrap_or_else(|e| panic!("{key}: {e}"));
    }
    // Rank 1 may first see rank 0's store close.
    stop_all_promptly(ranks, &[0], "rank 2 of 3 to join");
}

#[test]
fn sigterm_while_a_peer_is_stopped_ends_the_waiting_worker_within_a_second() {
    // LAUNCH-13: rank 1 is frozen (SIGSTOP) mid-training; rank 0 waits in a collective.
    let dir = tempfile::tempdir().unwrap();
    let store = TorchStoreServer::bind("127.0.0.1:0").unwrap();
    let port = store.addr().port();
    let args = train_args(100_000, &dir.path().join("log.jsonl"));
    let mut ranks: Vec<Child> = (0..2).map(|r| worker(r, 2, port, true, &args)).collect();
    let c = TorchStoreClient::connect(store.addr(), DEADLINE).unwrap();
    let progress = shardline_runtime::launch::progress_key(&job_of(port));
    until("rank 0's progress in the store", || c.check(&[progress.as_str()]).unwrap());
    let frozen = ranks.pop().expect("rank 1");
    let pid = nix::unistd::Pid::from_raw(frozen.id().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    // Rank 0 blocks in the next collective with rank 1.
    std::thread::sleep(Duration::from_millis(300));
    // What it waited for is a collective of the step (named by the engine or by its lane).
    stop_all_promptly(ranks, &[0], "");
    drop(frozen);
}

/// `torchrun` on PATH, or a visible optional skip.
fn torchrun_or_skip(test: &str) -> bool {
    let found = Command::new("torchrun").arg("--help").output().is_ok_and(|o| o.status.success());
    if !found {
        skip_optional(test, "torchrun is not installed (pip install torch==2.15.0)");
    }
    found
}

#[test]
fn real_torchrun_trains_as_in_process() {
    if !torchrun_or_skip("real_torchrun_trains_as_in_process") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let reference = in_process(4, dir.path());
    let log = dir.path().join("torchrun.jsonl");
    let mut cmd = Command::new("torchrun");
    cmd.args(["--no-python", "--nproc-per-node", "2"])
        .arg(shardline())
        .args(train_args(4, &log))
        .env("SHARDLINE_TOKEN", TOKEN);
    let out = wait_output(spawn(cmd), Instant::now() + DEADLINE, "torchrun");
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "torchrun:\n{err}");
    assert!(text.contains("on 1 node(s) (torchrun)"), "not run as torchrun's workers:\n{text}");
    assert_eq!(job_figures(&log), reference, "torchrun's ranks differ from the in-process run");
}

#[test]
fn real_torchrun_across_two_namespace_nodes_trains_as_in_process() {
    let test = "real_torchrun_across_two_namespace_nodes_trains_as_in_process";
    if !torchrun_or_skip(test) {
        return;
    }
    // Tag `t` (NETNS-2); without root the harness says why it skips (NETNS-8).
    let Some(net) = Net::or_skip("t", 2, None, test) else { return };
    let dir = tempfile::tempdir().unwrap();
    let reference = in_process(4, dir.path());
    let log = dir.path().join("torchrun.jsonl");
    let port = 29_411;
    let nodes: Vec<Child> = (0..2)
        .map(|k| {
            let mut cmd = net.command(k, "torchrun");
            cmd.args(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"])
                .args(["--rdzv-endpoint", &format!("{}:{port}", net.addr(0))])
                .args(["--rdzv-id", "shardline-torchrun-test", "--no-python"])
                // torchrun decides whether it hosts the rendezvous store by comparing the
                // endpoint with the host name's addresses; a namespace's address is not among
                // them, so node 0 is told.
                .args(["--rdzv-conf", if k == 0 { "is_host=1" } else { "is_host=0" }])
                // Node 0's agent publishes this address as the workers' MASTER_ADDR (else the
                // host name's, which is not the namespace's).
                .args(["--local-addr", &net.addr(k)])
                .arg(shardline())
                .args(train_args(4, &log))
                .env("SHARDLINE_TOKEN", TOKEN);
            spawn(cmd)
        })
        .collect();
    let outs: Vec<_> = nodes
        .into_iter()
        .enumerate()
        .map(|(k, c)| wait_output(c, Instant::now() + DEADLINE, &format!("torchrun on node {k}")))
        .collect();
    let all: String = outs
        .iter()
        .enumerate()
        .map(|(k, o)| {
            let text = String::from_utf8_lossy(&o.stdout);
            let err = String::from_utf8_lossy(&o.stderr);
            format!("--- node {k} ({}):\n{text}\n{err}\n", o.status)
        })
        .collect();
    for (k, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "torchrun on node {k} failed:\n{all}");
    }
    assert!(all.contains("on 2 node(s) (torchrun)"), "not two nodes:\n{all}");
    assert_eq!(job_figures(&log), reference, "torchrun's ranks differ from the in-process run");
}

#[test]
fn real_torchrun_prints_a_failing_workers_error() {
    // The worker writes TORCHELASTIC_ERROR_FILE: torchrun's failure summary shows its message.
    if !torchrun_or_skip("real_torchrun_prints_a_failing_workers_error") {
        return;
    }
    let mut cmd = Command::new("torchrun");
    cmd.args(["--no-python", "--nproc-per-node", "2"])
        .arg(shardline())
        .args(["train", "--steps", "2", "--resume", "--no-progress"])
        .env("SHARDLINE_TOKEN", TOKEN);
    let out = wait_output(spawn(cmd), Instant::now() + DEADLINE, "torchrun");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(
            "traceback : error: rank 0: invalid configuration: --resume needs --checkpoint-dir"
        ),
        "torchrun's summary does not show the worker's error:\n{err}"
    );
}
