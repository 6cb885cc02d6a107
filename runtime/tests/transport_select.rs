//! `shardline launch --transport`: two agents on this machine acting as two nodes. Without an
//! RDMA device (or the `rdma` feature) `auto` falls back to tcp across nodes and rank 0 says
//! so once (SEL-2). The refusals of explicit choices are unit tests of the selection.

mod common;
use common::{finish, free_port};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(120);

fn agent(node: usize, port: u16, transport: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(["launch", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank"])
        .arg(node.to_string())
        .args(["--rdzv", &format!("127.0.0.1:{port}"), "--token", "t0k", "--transport", transport])
        .args(["--", "train", "--steps", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting shardline launch")
}

fn two_nodes(transport: &str) -> (Output, Output) {
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    let a = agent(0, port, transport);
    let b = agent(1, port, transport);
    (finish(a, deadline), finish(b, deadline))
}

#[test]
fn auto_falls_back_to_tcp_across_nodes_saying_so_once() {
    let (a, b) = two_nodes("auto");
    let (ea, eb) = (String::from_utf8_lossy(&a.stderr), String::from_utf8_lossy(&b.stderr));
    assert!(a.status.success() && b.status.success(), "node 0:\n{ea}\nnode 1:\n{eb}");
    let out = String::from_utf8_lossy(&a.stdout);
    if out.contains("rdma across") {
        println!("an RDMA device is present: {out}");
        return;
    }
    let notes: Vec<&str> =
        ea.lines().chain(eb.lines()).filter(|l| l.contains("no RDMA device")).collect();
    assert_eq!(notes.len(), 1, "one line from rank 0: {notes:?}");
    assert!(notes[0].ends_with("): using tcp across nodes"), "{}", notes[0]);
    assert!(out.contains("tcp across"), "{out}");
}
