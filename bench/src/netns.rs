//! Nodes as network namespaces for the benchmarks that measure over a real (shaped) network:
//! `overlap --nodes` and `collectives --nodes`.
//!
//! Each node is a namespace of its own with one veth pair to a bridge created for the run;
//! addresses are `10.a.b.k/24` on the namespace ends only (the bridge and this machine's own
//! namespace get none, so nothing outside the run's namespaces is ever addressed). With a link
//! rate, both directions of every node's link go through a token bucket (`tc qdisc ... tbf`):
//! the namespace end shapes what the node sends, the bridge end what it receives.
//!
//! - NETNS-1: everything [`Net::new`] creates is removed when the [`Net`] drops, also when
//!   building it failed half-way or a benchmark run errors out or panics (deleting a namespace
//!   takes its veth pair with it; the bridge is deleted last).
//! - NETNS-2: names carry this process's id and a per-process counter, so concurrent runs (and
//!   the `tests/` namespace harness, which uses other prefixes and subnets) never collide;
//!   interface names stay within the kernel's 15 characters.

use anyhow::{bail, Context};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

fn run(prog: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {prog} {}", args.join(" ")))?;
    if !out.status.success() {
        bail!("{prog} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    run("ip", args)
}

/// Whether this process runs with uid 0 (from `/proc/self/status`, no libc needed).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2).map(|euid| euid == "0").unwrap_or(false))
        })
        .unwrap_or(false)
}

/// The `tbf` token bucket for `rate` bytes/s: the bucket holds 2 ms of traffic (at least
/// 32 KiB, so that a full-size GSO burst still fits at low rates) and the queue 25 ms.
pub fn tbf_args(rate: u64) -> Vec<String> {
    let burst = (rate / 500).max(32 << 10);
    ["root", "tbf", "rate", &format!("{}bit", rate * 8), "burst", &burst.to_string()]
        .into_iter()
        .map(String::from)
        .chain(["latency".to_string(), "25ms".to_string()])
        .collect()
}

/// Nodes as namespaces on one bridge, removed on drop (NETNS-1).
pub struct Net {
    bridge: String,
    namespaces: Vec<String>,
    hosts: Vec<String>,
    subnet: String,
    rate: Option<u64>,
}

impl Net {
    /// Builds `nodes` namespaces, node `k` at [`Net::addr`]`(k)`, each link shaped to `rate`
    /// bytes/s in both directions when given. Needs root and iproute2 (`ip`, `tc`).
    pub fn new(nodes: usize, rate: Option<u64>) -> anyhow::Result<Net> {
        static N: AtomicU32 = AtomicU32::new(0);
        if nodes == 0 {
            bail!("--nodes must be at least 1");
        }
        if !is_root() {
            bail!(
                "--nodes builds one network namespace per node (ip netns, veth, bridge, tc) and \
                 needs root: run it as root, or leave out --nodes for the one-process benchmark"
            );
        }
        for prog in ["ip", "tc"] {
            Command::new(prog)
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .with_context(|| format!("--nodes needs iproute2's `{prog}` on PATH"))?;
        }
        let n = N.fetch_add(1, Ordering::Relaxed);
        let id = (std::process::id() % 100_000) * 4 + (n % 4);
        let mut net = Net {
            bridge: format!("slbb{id}"),
            namespaces: Vec::new(),
            hosts: Vec::new(),
            subnet: format!("10.{}.{}", 150 + (id / 250) % 50, id % 250),
            rate,
        };
        // From here on a failure drops `net`, which removes what was already built.
        ip(&["link", "add", &net.bridge, "type", "bridge"])?;
        ip(&["link", "set", &net.bridge, "up"])?;
        for k in 0..nodes {
            let ns = format!("slbn{id}-{k}");
            ip(&["netns", "add", &ns])?;
            net.namespaces.push(ns.clone());
            let (host, inner) = (format!("slbh{id}-{k}"), format!("slbi{id}-{k}"));
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner])?;
            net.hosts.push(host.clone());
            ip(&["link", "set", &inner, "netns", &ns])?;
            ip(&["link", "set", &host, "master", &net.bridge, "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", net.addr(k)), "dev", &inner])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            if let Some(r) = rate {
                let tbf = tbf_args(r);
                let tbf: Vec<&str> = tbf.iter().map(String::as_str).collect();
                let mut inside = vec!["-n", &ns, "qdisc", "add", "dev", &inner];
                inside.extend(&tbf);
                run("tc", &inside).context("shaping the node's outgoing traffic")?;
                let mut outside = vec!["qdisc", "add", "dev", &host];
                outside.extend(&tbf);
                run("tc", &outside).context("shaping the node's incoming traffic")?;
            }
        }
        Ok(net)
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.namespaces.len()
    }

    /// The link rate, bytes/s, if shaped.
    pub fn rate(&self) -> Option<u64> {
        self.rate
    }

    /// Node `k`'s address.
    pub fn addr(&self, k: usize) -> String {
        format!("{}.{}", self.subnet, k + 1)
    }

    /// A command that runs `prog` inside node `k`'s namespace.
    pub fn command(&self, k: usize, prog: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.namespaces[k]]).arg(prog);
        cmd
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // A namespace's veth goes with it only once the kernel's asynchronous cleanup has
        // run; deleting the pair from this end removes it now.
        for host in &self.hosts {
            let _ = ip(&["link", "del", host]);
        }
        for ns in &self.namespaces {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// A child process in a process group of its own, killed with its whole group when dropped
/// before it was waited for (so that an error or panic in the benchmark leaves no agent or
/// worker behind, NETNS-1).
pub struct Child {
    child: Option<std::process::Child>,
    what: String,
}

impl Child {
    /// Spawns `cmd` with stdout and stderr piped, as the leader of a new process group.
    pub fn spawn(mut cmd: Command, what: &str) -> anyhow::Result<Child> {
        use std::os::unix::process::CommandExt;
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        let child = cmd.spawn().with_context(|| format!("spawning {what}"))?;
        Ok(Child { child: Some(child), what: what.to_string() })
    }

    /// Waits until `deadline`; past it kills the group and fails. Returns the output; a
    /// non-zero exit fails with the tail of stderr.
    pub fn wait(mut self, deadline: std::time::Instant) -> anyhow::Result<std::process::Output> {
        let Some(mut child) = self.child.take() else { bail!("{} already waited for", self.what) };
        // Reading the pipes while waiting keeps a chatty child from blocking on a full pipe.
        let (out_r, err_r) = (child.stdout.take(), child.stderr.take());
        let reader = |p: Option<Box<dyn std::io::Read + Send>>| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                if let Some(mut p) = p {
                    let _ = p.read_to_end(&mut buf);
                }
                buf
            })
        };
        let out_t = reader(out_r.map(|p| Box::new(p) as Box<dyn std::io::Read + Send>));
        let err_t = reader(err_r.map(|p| Box::new(p) as Box<dyn std::io::Read + Send>));
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break s;
            }
            if std::time::Instant::now() >= deadline {
                kill_group(child.id());
                let _ = child.kill();
                let _ = child.wait();
                let err = err_t.join().unwrap_or_default();
                bail!(
                    "{} did not finish in time; stderr tail:\n{}",
                    self.what,
                    tail(&String::from_utf8_lossy(&err), 2000)
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let stdout = out_t.join().unwrap_or_default();
        let stderr = err_t.join().unwrap_or_default();
        if !status.success() {
            bail!(
                "{} exited with {status}; stderr tail:\n{}",
                self.what,
                tail(&String::from_utf8_lossy(&stderr), 2000)
            );
        }
        Ok(std::process::Output { status, stdout, stderr })
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_group(c.id());
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn kill_group(pid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pid}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Waits for every child until `deadline`; the first failure is returned after the others
/// were killed (dropping them), so one dead node never leaves the rest waiting.
pub fn wait_all(
    children: Vec<Child>,
    deadline: std::time::Instant,
) -> anyhow::Result<Vec<std::process::Output>> {
    let mut outs = Vec::new();
    for c in children {
        outs.push(c.wait(deadline)?);
    }
    Ok(outs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tbf_bucket_scales_with_the_rate_and_has_a_floor() {
        let a = tbf_args(125_000_000);
        assert_eq!(&a[..4], ["root", "tbf", "rate", "1000000000bit"]);
        assert_eq!(a[5], "250000");
        let b = tbf_args(1_000_000);
        assert_eq!(b[5], (32 << 10).to_string());
        assert_eq!(&b[6..], ["latency", "25ms"]);
    }

    #[test]
    fn tail_respects_char_boundaries() {
        assert_eq!(tail("abcdef", 3), "def");
        assert_eq!(tail("aé", 1), "");
        assert_eq!(tail("ab", 10), "ab");
    }

    /// NETNS-1: a built net is gone after drop (needs root; skipped with a printed reason).
    #[test]
    fn namespaces_are_removed_on_drop() {
        let net = match Net::new(2, Some(125_000_000)) {
            Ok(n) => n,
            Err(e) => {
                println!("SKIPPED namespaces_are_removed_on_drop: {e}");
                return;
            }
        };
        let (names, hosts) = (net.namespaces.clone(), net.hosts.clone());
        let qdisc = Command::new("tc")
            .args(["-n", &names[1], "qdisc", "show"])
            .output()
            .expect("tc qdisc show");
        let qdisc = String::from_utf8_lossy(&qdisc.stdout).into_owned();
        drop(net);
        assert!(qdisc.contains("tbf") && qdisc.contains("rate 1Gbit"), "{qdisc}");
        let listed = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
        let listed = String::from_utf8_lossy(&listed.stdout);
        let links = Command::new("ip").args(["link", "show"]).output().expect("ip link show");
        let links = String::from_utf8_lossy(&links.stdout);
        for n in names {
            assert!(!listed.contains(&n), "{n} left behind");
        }
        for h in hosts {
            assert!(!links.contains(&format!("{h}@")), "{h} left behind");
        }
    }
}
