//! One job of the live-recovery campaign: a `shardline launch` agent per namespace node
//! (one worker each, the store replicated over every node, LAUNCH-14), the harness's part of
//! the fault (a link cut, an agent killed and started again), the step log read as it is
//! written, and every agent under the run's deadline (LIVEB-4).

use super::draw::Action;
use super::logs;
use shardline_runtime::launch::unix_ms;
use shardline_tests::netns::Net;
use shardline_tests::process::{kill_group, Child};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The job token of the campaign's agents.
const TOKEN: &str = "shardline-faults-live";

/// How often the harness reads the step log (and so the resolution of LIVEB-3's times).
const POLL: Duration = Duration::from_millis(5);

/// One job to run.
pub struct Job<'a> {
    pub net: &'a Net,
    pub shardline: &'a Path,
    /// The port of every node's store replica.
    pub port: u16,
    pub live: bool,
    pub max_restarts: u32,
    /// The workers' `train ...` arguments, a worker's `--fault` included.
    pub train: Vec<String>,
    /// The `--log-json` file among them.
    pub step_log: PathBuf,
    /// The harness's part of the fault, if any.
    pub action: Option<Action>,
    /// LIVEB-4: how long the job may run.
    pub deadline: Duration,
}

/// What a job did.
pub struct Ran {
    /// LIVEB-4: an agent was still running at the deadline (killed with its workers).
    pub hang: bool,
    /// Per node, the exit code of its last agent (`None`: ended by a signal, or hung).
    pub exits: Vec<Option<i32>>,
    /// Every agent's output, each under a header line.
    pub output: String,
    /// The step-log lines as the harness read them: step and Unix ms.
    pub seen: Vec<(u64, u128)>,
    /// When the harness made its part of the fault (Unix ms), if it did.
    pub harness_fault_ms: Option<u128>,
    pub wall_s: f64,
}

/// An agent being waited for on a thread of its own: its node, process group and waiter.
struct Running {
    node: usize,
    pid: u32,
    waiter: JoinHandle<Result<Output, String>>,
}

impl Job<'_> {
    fn start(&self, node: usize, deadline: Instant) -> anyhow::Result<Running> {
        let n = self.net.nodes();
        let rdzv: Vec<String> =
            (0..n).map(|k| format!("{}:{}", self.net.addr(k), self.port)).collect();
        let mut cmd = self.net.command(node, self.shardline);
        cmd.args(["launch", "--nproc-per-node", "1", "--nnodes", &n.to_string()])
            .args(["--node-rank", &node.to_string(), "--rdzv", &rdzv.join(",")])
            .args(["--token", TOKEN, "--max-restarts", &self.max_restarts.to_string()])
            .args(["--heartbeat-timeout-s", "1", "--grace-s", "0.5"]);
        if self.live {
            cmd.arg("--live-recovery");
        }
        cmd.arg("--").args(&self.train);
        let child = Child::spawn(cmd, &format!("node {node}'s agent"))?;
        let pid = child.id().unwrap_or(0);
        let waiter =
            std::thread::spawn(move || child.wait_output(deadline).map_err(|e| e.to_string()));
        Ok(Running { node, pid, waiter })
    }

    /// Runs the job to its end or its deadline.
    pub fn run(&self) -> anyhow::Result<Ran> {
        let t0 = Instant::now();
        let deadline = t0 + self.deadline;
        let nodes = self.net.nodes();
        let mut agents = Vec::new();
        for k in 0..nodes {
            agents.push(self.start(k, deadline)?);
        }
        let (mut seen, mut read, mut top) = (Vec::new(), 0usize, 0u64);
        let mut pending = self.action.clone();
        let mut harness_fault_ms = None;
        let mut link = None;
        let mut back: Option<(usize, Instant)> = None;
        loop {
            if let Ok(bytes) = std::fs::read(&self.step_log) {
                let (steps, used) =
                    logs::complete_steps(&String::from_utf8_lossy(&bytes[read.min(bytes.len())..]));
                read += used;
                let now = unix_ms();
                for s in steps {
                    top = top.max(s);
                    seen.push((s, now));
                }
            }
            match pending {
                Some(Action::Partition { node, step, secs }) if top >= step => {
                    link = Some((self.net.link_down(node)?, Instant::now() + secs_of(secs)));
                    harness_fault_ms = Some(unix_ms());
                    pending = None;
                }
                Some(Action::KillNode { node, step, secs }) if top >= step => {
                    // The node's agent and its worker, as a lost machine takes them.
                    if let Some(a) = agents.iter().rev().find(|a| a.node == node) {
                        kill_group(a.pid);
                    }
                    harness_fault_ms = Some(unix_ms());
                    back = Some((node, Instant::now() + secs_of(secs)));
                    pending = None;
                }
                _ => {}
            }
            if link.as_ref().is_some_and(|(_, until)| Instant::now() >= *until) {
                link = None;
            }
            let others_done = agents.iter().all(|a| a.waiter.is_finished());
            if let Some((node, at)) = back {
                if others_done {
                    // Nobody left to return to.
                    back = None;
                } else if Instant::now() >= at {
                    agents.push(self.start(node, deadline)?);
                    back = None;
                }
            }
            if others_done && back.is_none() {
                break;
            }
            std::thread::sleep(POLL);
        }
        drop(link);
        let mut hang = false;
        let mut exits = vec![None; nodes];
        let mut output = String::new();
        for a in agents {
            let got = a.waiter.join().unwrap_or_else(|_| Err("waiter panicked".into()));
            match got {
                Ok(o) => {
                    exits[a.node] = o.status.code();
                    output.push_str(&format!("== node {} agent: {} ==\n", a.node, o.status));
                    output.push_str(&String::from_utf8_lossy(&o.stdout));
                    output.push_str(&String::from_utf8_lossy(&o.stderr));
                }
                Err(e) => {
                    hang = true;
                    exits[a.node] = None;
                    output.push_str(&format!("== node {} agent: {e} ==\n", a.node));
                }
            }
        }
        Ok(Ran { hang, exits, output, seen, harness_fault_ms, wall_s: t0.elapsed().as_secs_f64() })
    }
}

fn secs_of(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}
