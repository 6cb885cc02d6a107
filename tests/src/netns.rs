//! Harness for `shardline launch` tests: the `shardline` binary, processes with deadlines, and
//! "nodes" as network namespaces with a veth link each to a bridge of their own (needs root
//! and `ip netns`; [`Net::new`] says why it cannot be built otherwise). Everything a [`Net`]
//! creates is removed in `Drop`, also when a test fails.
//!
//! - NET-1: every wait on a child has a deadline ([`wait_output`] kills it past the deadline),
//!   so a failing test never hangs.
//! - NET-2: a [`Link`] cut by [`Net::link_down`] is set up again when the guard drops, before
//!   the namespaces go.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

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
/// an agent together with its workers).
pub fn spawn(mut cmd: Command) -> Child {
    use std::os::unix::process::CommandExt;
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    match cmd.spawn() {
        Ok(c) => c,
        Err(e) => panic!("spawning {cmd:?}: {e}"),
    }
}

/// Waits for `child` until `deadline`, killing its process group past it (NET-1).
pub fn wait_output(mut child: Child, deadline: Instant, what: &str) -> Output {
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() >= deadline => {
                kill_group(&child);
                let _ = child.kill();
                let out = child.wait_with_output();
                let err = out.map(|o| String::from_utf8_lossy(&o.stderr).into_owned());
                panic!("{what} did not finish in time; stderr:\n{}", err.unwrap_or_default());
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("{what}: wait failed: {e}"),
        }
    }
    match child.wait_with_output() {
        Ok(o) => o,
        Err(e) => panic!("{what}: collecting output: {e}"),
    }
}

/// SIGKILL to the process group led by `child` (see [`spawn`]).
pub fn kill_group(child: &Child) {
    let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Nodes as namespaces on one bridge; removed on drop.
pub struct Net {
    bridge: String,
    namespaces: Vec<String>,
    hosts: Vec<String>,
    subnet: String,
}

/// A cut link, set up again on drop (NET-2).
pub struct Link {
    host: String,
}

impl Link {
    /// Sets the link up again now.
    pub fn up(self) {}
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = ip(&["link", "set", &self.host, "up"]);
    }
}

impl Net {
    /// `nodes` namespaces `10.<a>.<b>.1..` on a bridge; `Err` says why it cannot be built.
    pub fn new(nodes: usize) -> Result<Net, String> {
        static N: AtomicU32 = AtomicU32::new(0);
        if !is_root() {
            return Err("not root".into());
        }
        let n = N.fetch_add(1, Ordering::Relaxed);
        // Apart from the ids of the multinode tests (which count from pid * 16).
        let id = (std::process::id() % 10_000) * 16 + 8 + n;
        let mut net = Net {
            bridge: format!("slfb{id}"),
            namespaces: Vec::new(),
            hosts: Vec::new(),
            subnet: format!("10.{}.{}", 50 + (id / 250) % 50, id % 250),
        };
        ip(&["link", "add", &net.bridge, "type", "bridge"])?;
        ip(&["link", "set", &net.bridge, "up"])?;
        for i in 0..nodes {
            let ns = format!("slfn{id}-{i}");
            ip(&["netns", "add", &ns])?;
            net.namespaces.push(ns.clone());
            let (host, inner) = (format!("slfh{id}-{i}"), format!("slfi{id}-{i}"));
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner])?;
            net.hosts.push(host.clone());
            ip(&["link", "set", &inner, "netns", &ns])?;
            ip(&["link", "set", &host, "master", &net.bridge, "up"])?;
            let addr = format!("{}.{}/24", net.subnet, i + 1);
            ip(&["-n", &ns, "addr", "add", &addr, "dev", &inner])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Builds the net or prints why the test `test` is skipped.
    pub fn or_skip(nodes: usize, test: &str) -> Option<Net> {
        match Net::new(nodes) {
            Ok(n) => Some(n),
            Err(why) => {
                println!("SKIPPED {test}: cannot build network namespaces ({why})");
                eprintln!("SKIPPED {test}: cannot build network namespaces ({why})");
                None
            }
        }
    }

    /// Node `node`'s address.
    pub fn addr(&self, node: usize) -> String {
        format!("{}.{}", self.subnet, node + 1)
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
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.namespaces[node]]).arg(shardline()).args([
            "launch",
            "--nproc-per-node",
            &nproc.to_string(),
        ]);
        if !launch_flags.contains(&"--nnodes") {
            cmd.args(["--nnodes", &self.namespaces.len().to_string()]);
        }
        cmd.args(launch_flags)
            .args(["--node-rank", &node.to_string()])
            .args(["--rdzv", &format!("{}:{port}", self.addr(0))])
            .args(["--token", "launch-faults-test", "--"])
            .args(args);
        spawn(cmd)
    }

    /// Cuts node `node` off: its veth link goes down on the bridge side until the guard
    /// drops (NET-2).
    pub fn link_down(&self, node: usize) -> Result<Link, String> {
        let host = self.hosts[node].clone();
        ip(&["link", "set", &host, "down"])?;
        Ok(Link { host })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            // Deleting a namespace removes its end of the veth pair, and with it the other.
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}
