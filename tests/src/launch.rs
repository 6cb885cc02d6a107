//! Harness for `shardline launch` tests over namespace nodes ([`crate::netns`], whose
//! NETNS-1 to NETNS-4 and NETNS-8 hold here): the `shardline` binary, processes with
//! deadlines that fail the test when they pass, and a [`LaunchNet`] that launches one agent
//! per node. Without root a namespace test skips and says why; as root a harness that fails
//! fails the test ([`LaunchNet::or_skip`]).

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use crate::netns::Net;
pub use crate::process::Child;

/// The `shardline` binary: `SHARDLINE_BIN`, else the one beside the test executable's
/// directory (`target/<profile>/shardline`, built by `cargo build -p shardline-runtime`).
pub fn shardline() -> PathBuf {
    if let Ok(p) = std::env::var("SHARDLINE_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let bin = exe.parent().and_then(Path::parent).map(|d| d.join("shardline")).unwrap_or_default();
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build -p shardline-runtime` first (or set SHARDLINE_BIN)",
        bin.display()
    );
    bin
}

/// Spawns `cmd` with piped output, in a process group of its own (so that a test can kill
/// an agent together with its workers, and dropping it kills the group).
pub fn spawn(cmd: Command) -> Child {
    let what = format!("{cmd:?}");
    match Child::spawn(cmd, &what) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    }
}

/// Waits for `child` until `deadline` and returns its output whatever the exit status;
/// panics past the deadline, after killing its process group (NETNS-3).
pub fn wait_output(child: Child, deadline: Instant, what: &str) -> Output {
    match child.wait_output(deadline) {
        Ok(o) => o,
        Err(e) => panic!("{what}: {e}"),
    }
}

/// SIGKILL to the process group led by `child` (see [`spawn`]).
pub fn kill_group(child: &Child) {
    child.kill_group();
}

/// Namespace nodes that launch `shardline` agents; a [`Net`] underneath, removed on drop.
pub struct LaunchNet {
    net: Net,
    token: &'static str,
}

impl Deref for LaunchNet {
    type Target = Net;

    fn deref(&self) -> &Self::Target {
        &self.net
    }
}

impl LaunchNet {
    /// Builds `nodes` unshaped nodes named after `tag` (one letter per test file, NETNS-2)
    /// whose agents use the job token `token`, through [`Net::or_skip`] (NETNS-8): without
    /// root `None`, after saying why the test `test` is skipped; as root a failure panics.
    pub fn or_skip_as(
        tag: &str,
        token: &'static str,
        nodes: usize,
        test: &str,
    ) -> Option<LaunchNet> {
        Net::or_skip(tag, nodes, None, test).map(|net| LaunchNet { net, token })
    }

    /// [`LaunchNet::or_skip_as`] for the launch fault tests.
    pub fn or_skip(nodes: usize, test: &str) -> Option<LaunchNet> {
        LaunchNet::or_skip_as("f", "launch-faults-test", nodes, test)
    }

    /// `shardline launch` for `node` inside its namespace, with `launch_flags` before `--`
    /// (`--nnodes` defaults to the number of namespaces).
    pub fn launch(
        &self,
        node: usize,
        nproc: usize,
        port: u16,
        launch_flags: &[&str],
        args: &[String],
    ) -> Child {
        let mut cmd = self.net.command(node, shardline());
        cmd.args(["launch", "--nproc-per-node", &nproc.to_string()]);
        if !launch_flags.contains(&"--nnodes") {
            cmd.args(["--nnodes", &self.net.nodes().to_string()]);
        }
        cmd.args(launch_flags)
            .args(["--node-rank", &node.to_string()])
            .args(["--rdzv", &format!("{}:{port}", self.net.addr(0))])
            .args(["--token", self.token, "--"])
            .args(args);
        match Child::spawn(cmd, &format!("launch on node {node}")) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }
}

/// The figures of a `--log-json` step line that are the job's, not a rank's or a clock's:
/// equal, bitwise, however the job's ranks were started.
pub const JOB_FIGURES: [&str; 6] = ["step", "epoch", "loss", "lr", "grad_norm", "stats_messages"];

/// The [`JOB_FIGURES`] of every line of a `--log-json` file, each as exact text (a float as
/// the bits of the f64 it was logged as); panics naming the file on a bad or incomplete line.
pub fn job_figures(log: &Path) -> Vec<Vec<String>> {
    let text =
        std::fs::read_to_string(log).unwrap_or_else(|e| panic!("reading {}: {e}", log.display()));
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            let v: serde_json::Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{} line {}: {e}: {l}", log.display(), i + 1));
            JOB_FIGURES
                .iter()
                .map(|k| match &v[k] {
                    serde_json::Value::Null => {
                        panic!("{} line {}: {k} missing", log.display(), i + 1)
                    }
                    serde_json::Value::Number(n) if n.is_f64() => {
                        format!("{:x}", n.as_f64().unwrap_or(0.0).to_bits())
                    }
                    other => other.to_string(),
                })
                .collect()
        })
        .collect()
}

/// `train` flags of the small job the launcher tests start (mlp-bn on digits, stage 3,
/// SyncBN on, AdamW, no progress bar), for `steps` steps.
pub fn small_train_args(steps: u64) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--hidden",
        "32",
        "--depth",
        "2",
        "--batch-size",
        "48",
        "--stage",
        "3",
        "--sync-bn",
        "on",
        "--optimizer",
        "adamw",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(["--steps".into(), steps.to_string()]);
    a
}

/// The steps of a `--log-json` file, in order (none while it does not exist).
pub fn logged_steps(log: &Path) -> Vec<u64> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["step"].as_u64())
        .collect()
}
