//! Harness for `shardline launch` tests over the runtime's namespace nodes
//! ([`shardline_runtime::netns`], whose NETNS-1 to NETNS-4 hold here): the `shardline`
//! binary, processes with deadlines that fail the test when they pass, and a [`Net`] that
//! launches one agent per node. Without root or `ip netns` a test prints why it is skipped
//! ([`Net::or_skip`]).

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

pub use shardline_runtime::netns::{Child, Link};

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

/// Namespace nodes that launch `shardline` agents; the runtime's [`shardline_runtime::netns::Net`]
/// underneath, removed on drop.
pub struct Net {
    net: shardline_runtime::netns::Net,
    token: &'static str,
}

impl Deref for Net {
    type Target = shardline_runtime::netns::Net;

    fn deref(&self) -> &Self::Target {
        &self.net
    }
}

impl Net {
    /// Builds `nodes` unshaped nodes named after `tag` (one letter per test file, NETNS-2)
    /// whose agents use the job token `token`, or prints why the test `test` is skipped.
    pub fn or_skip_as(tag: &str, token: &'static str, nodes: usize, test: &str) -> Option<Net> {
        match shardline_runtime::netns::Net::new(tag, nodes, None) {
            Ok(net) => Some(Net { net, token }),
            Err(why) => {
                println!("SKIPPED {test}: cannot build network namespaces ({why})");
                eprintln!("SKIPPED {test}: cannot build network namespaces ({why})");
                None
            }
        }
    }

    /// [`Net::or_skip_as`] for the launch fault tests.
    pub fn or_skip(nodes: usize, test: &str) -> Option<Net> {
        Net::or_skip_as("f", "launch-faults-test", nodes, test)
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
