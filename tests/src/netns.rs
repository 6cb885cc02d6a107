//! Nodes as network namespaces, for the tests and benchmarks that run `shardline launch` (or
//! any other process) across "nodes" over a real, optionally shaped, network on one machine.
//!
//! Each node is a namespace of its own with one veth pair (MTU [`LINK_MTU`]) to a bridge
//! created for the net;
//! addresses are `10.a.b.k/24` on the namespace ends only (the bridge and this machine's own
//! namespace get none, so nothing outside the net's namespaces is ever addressed). With a link
//! rate, both directions of every node's link go through a token bucket (`tc qdisc ... tbf`):
//! the namespace end shapes what the node sends, the bridge end what it receives. Building a
//! net needs root and iproute2 (`ip`, and `tc` for a rate); [`Net::new`] says why it cannot be
//! built otherwise, and a test builds its net through [`Net::or_skip`] (NETNS-8).
//!
//! Processes run through [`Child`](crate::process::Child): a process group of its own,
//! output pipes drained while it runs, every wait bounded by a deadline.
//!
//! - NETNS-1: everything [`Net::new`] creates is removed when the [`Net`] drops, also when
//!   building it failed half-way or its user errors out or panics (the host ends of the veth
//!   pairs first, then the namespaces, the bridge last); a [`Child`](crate::process::Child)
//!   dropped before it was waited for is killed with its whole process group, so no agent or
//!   worker stays behind.
//! - NETNS-2: names start with `sl` and the caller's tag (one lowercase letter per user of
//!   this module), then this process's id and a per-process counter, so concurrent nets of one
//!   or several processes and users never collide; every interface name stays within the
//!   kernel's 15 characters. The subnet's second octet is the tag's letter, so the users'
//!   address ranges differ too (addresses never leave a net's own bridge in any case).
//! - NETNS-3: every wait on a [`Child`](crate::process::Child) has a deadline; past it the
//!   child's process group is killed and the wait fails with the tail of its stderr, so a bug
//!   never hangs the caller. The pipes are read while waiting, so a chatty child never blocks
//!   on a full pipe.
//! - NETNS-4: a node cut off by [`Net::link_down`] gets its link back when the [`Link`] guard
//!   drops, which the borrow on the [`Net`] makes happen before the namespaces go.
//! - NETNS-5: SIGINT, SIGTERM or SIGHUP while a net exists (Ctrl-C on a benchmark or a test
//!   run) kills every [`Child`](crate::process::Child) group not yet waited for and removes
//!   every live net before the process exits with 128 + the signal's number, as the drops
//!   would have. The handler goes in with the first net and only where the signal still has
//!   its default action (a process that handles it itself keeps its handler); it only writes
//!   to a pipe, which a watcher thread reads (async-signal-safe).
//! - NETNS-6: what a killed process left behind (SIGKILL, a crash) is removed by the next
//!   [`Net::new`]: a net whose name carries the id of a process that no longer exists and
//!   whose namespaces hold no process. A live process's nets are never touched.
//! - NETNS-7: both ends of every link take packets of [`link_gso_size`] (up to 512 KiB, BIG
//!   TCP) in one piece, never more than half a shaped link's token bucket, so that the
//!   per-packet work of the simulated network, which a real NIC does in hardware, takes as
//!   little of the ranks' cores as the kernel allows.
//! - NETNS-8: a namespace test skips only where the process lacks root (effective uid 0),
//!   and then says why on stderr and in the skip log ([`crate::skip`]); as root, any error
//!   of the harness fails it. [`FORCE_FAIL_ENV`] makes [`Net::new`] fail as root, so that
//!   this can be seen to hold.

use std::ffi::OsStr;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::error::{HarnessError, Result};

/// Set to `1`, makes [`Net::new`] fail as root once it has checked its arguments (NETNS-8:
/// a test whose harness fails must fail). Without root `Net::new` fails anyway.
pub const FORCE_FAIL_ENV: &str = "SHARDLINE_NETNS_FORCE_FAIL";

/// The kernel's limit on interface names (`IFNAMSIZ` less the terminating zero).
const IFNAME_MAX: usize = 15;

/// The links' MTU: jumbo frames, as the Ethernet fabrics of training clusters run (RoCE runs
/// 4 KiB). Six times fewer packets through the bridge and the token buckets than at 1500,
/// and 0.5% of the shaped rate spent on headers instead of 3.5%.
pub const LINK_MTU: u32 = 9000;

/// The largest packet the links pass down their stacks in one piece: the kernel's
/// `GSO_MAX_SIZE` (8 x 65535 bytes; "BIG TCP", for IPv4 from Linux 6.3).
pub const LINK_GSO_MAX: u32 = 8 * 65_535;

/// The GSO limit every device starts with.
const GSO_LEGACY_MAX: u32 = 65_536;

/// The GSO and GRO size of a link shaped to `rate` bytes/s (NETNS-7): [`LINK_GSO_MAX`] on an
/// unshaped link; on a shaped one at most half the token bucket (a packet larger than the
/// bucket is split by `tbf` into MTU-sized ones, which costs more than it saves), and never
/// below the kernel's legacy 64 KiB.
///
/// Why larger packets: every packet costs the CPU about the same whatever its size on its way
/// through the sender's stack, the veth pair, the bridge, the token buckets and the receiver's
/// stack. A NIC with TSO and GRO does that segmentation in hardware; the namespaces' links do
/// it on the very cores the ranks compute on. Measured (`bench/RESULTS.md`, shaped links):
/// 8gbit, prefetch 1, CPU per rank and step 25.7-26.2 ms at 32 KiB, 23.1-23.5 at 64 KiB,
/// 20.4-20.6 at 512 KiB.
pub fn link_gso_size(rate: Option<u64>) -> u32 {
    match rate {
        None => LINK_GSO_MAX,
        Some(r) => {
            (tbf_burst(r) / 2).clamp(u64::from(GSO_LEGACY_MAX), u64::from(LINK_GSO_MAX)) as u32
        }
    }
}

/// Sets `ifname`'s (in this process's namespace) largest GSO and GRO packet, IPv4 and IPv6,
/// through one `RTM_SETLINK` (iproute2 6.1, Debian 12's, cannot set the IPv4 sizes). The
/// kernel refuses a size above the device's TSO limit.
fn set_link_gso(ifname: &str, size: u32) -> std::io::Result<()> {
    use netlink_packet_core::{NetlinkPayload, NLM_F_ACK};
    use netlink_packet_route::link::{LinkAttribute, LinkMessage};
    use netlink_packet_route::RouteNetlinkMessage;

    let mut link = LinkMessage::default();
    link.header.index = if_index(ifname)?;
    link.attributes = vec![
        LinkAttribute::GsoMaxSize(size),
        LinkAttribute::GroMaxSize(size),
        LinkAttribute::GsoIpv4MaxSize(size),
        LinkAttribute::GroIpv4MaxSize(size),
    ];
    match rtnetlink_request(RouteNetlinkMessage::SetLink(link), NLM_F_ACK)?.payload {
        NetlinkPayload::Error(e) => match e.code {
            Some(code) => Err(std::io::Error::from_raw_os_error(-code.get())),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

/// `ifname`'s index in this process's namespace.
fn if_index(ifname: &str) -> std::io::Result<u32> {
    let path = format!("/sys/class/net/{ifname}/ifindex");
    std::fs::read_to_string(&path)?
        .trim()
        .parse()
        .map_err(|e| std::io::Error::other(format!("{path}: {e}")))
}

/// Sends one rtnetlink request (`NLM_F_REQUEST` and `flags`) and returns the kernel's first
/// answer.
fn rtnetlink_request(
    request: netlink_packet_route::RouteNetlinkMessage,
    flags: u16,
) -> std::io::Result<netlink_packet_core::NetlinkMessage<netlink_packet_route::RouteNetlinkMessage>>
{
    use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_REQUEST};
    use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags;
    let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(request));
    msg.finalize();
    let mut buf = vec![0; msg.buffer_len()];
    msg.serialize(&mut buf);
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    // The kernel answers at once; the timeout only keeps a broken one from hanging the caller.
    socket2::SockRef::from(&socket).set_read_timeout(Some(Duration::from_secs(5)))?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    socket.send(&buf, 0)?;
    let (reply, _) = socket.recv_from_full()?;
    netlink_packet_core::NetlinkMessage::deserialize(&reply)
        .map_err(|e| std::io::Error::other(format!("rtnetlink answer: {e}")))
}

fn run(prog: &str, args: &[&str]) -> Result<()> {
    let what = format!("{prog} {}", args.join(" "));
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| HarnessError::process(&what, e.to_string()))?;
    if !out.status.success() {
        return Err(HarnessError::process(&what, String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    run("ip", args)
}

/// Whether this process runs with effective uid 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// For a test that needs root but builds its nets itself (NETNS-8): whether this process
/// has root; if not, [`skip`](crate::skip::skip) says that `test` is skipped for it.
pub fn root_or_skip(test: &str) -> bool {
    if !is_root() {
        crate::skip::skip(test, "needs root (ip netns, veth, bridge, tc)");
    }
    is_root()
}

/// The `tbf` token bucket's size for `rate` bytes/s: 2 ms of traffic, at least 32 KiB.
pub fn tbf_burst(rate: u64) -> u64 {
    (rate / 500).max(32 << 10)
}

/// The `tbf` token bucket for `rate` bytes/s: the bucket holds [`tbf_burst`] (2 ms of traffic,
/// at least 32 KiB, so that a full-size legacy GSO burst still fits at low rates) and the
/// queue 25 ms.
pub fn tbf_args(rate: u64) -> Vec<String> {
    let burst = tbf_burst(rate);
    ["root", "tbf", "rate", &format!("{}bit", rate * 8), "burst", &burst.to_string()]
        .into_iter()
        .map(String::from)
        .chain(["latency".to_string(), "25ms".to_string()])
        .collect()
}

/// The interfaces and namespaces of one net, in the order they are removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Names {
    bridge: String,
    namespaces: Vec<String>,
    hosts: Vec<String>,
}

impl Names {
    /// Removes everything named, ignoring what is already gone: the host ends of the veth
    /// pairs first (a namespace's end goes with it only once the kernel's asynchronous
    /// cleanup has run; deleting the pair from this end removes it now), then the
    /// namespaces, the bridge last.
    fn remove(&self) {
        for host in &self.hosts {
            let _ = ip(&["link", "del", host]);
        }
        for ns in &self.namespaces {
            let _ = ip(&["netns", "del", ns]);
        }
        if !self.bridge.is_empty() {
            let _ = ip(&["link", "del", &self.bridge]);
        }
    }

    /// A net with no interface or namespace yet.
    fn is_empty(&self) -> bool {
        self.bridge.is_empty() && self.namespaces.is_empty() && self.hosts.is_empty()
    }
}

/// The nets of this process that a signal must not leave behind (NETNS-5; the child
/// process groups are [`crate::process`]'s).
static LIVE_NETS: Mutex<Vec<Names>> = Mutex::new(Vec::new());

fn live_nets() -> std::sync::MutexGuard<'static, Vec<Names>> {
    LIVE_NETS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The write end of the pipe the signal handler wakes the watcher with (-1: none).
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);
/// The signal the handler received.
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: i32) {
    SIGNALLED.store(sig, Ordering::SeqCst);
    let fd = SIGNAL_PIPE.load(Ordering::SeqCst);
    if fd >= 0 {
        let b = [1u8];
        // SAFETY: `write` is async-signal-safe; the buffer is one valid byte (NETNS-5).
        unsafe { libc::write(fd, b.as_ptr().cast(), 1) };
    }
}

/// Installs the NETNS-5 handlers and their watcher thread, once per process. Signals whose
/// action is not the default keep it (the process handles them itself).
fn watch_signals() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
        let Ok((rd, wr)) = nix::unistd::pipe() else {
            return;
        };
        use std::os::fd::IntoRawFd;
        SIGNAL_PIPE.store(wr.into_raw_fd(), Ordering::SeqCst);
        let ours =
            SigAction::new(SigHandler::Handler(on_signal), SaFlags::empty(), SigSet::empty());
        for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
            // SAFETY: the handler only stores to an atomic and writes to a pipe.
            match unsafe { sigaction(sig, &ours) } {
                Ok(old) if old.handler() != SigHandler::SigDfl => {
                    // SAFETY: puts back exactly what was there.
                    let _ = unsafe { sigaction(sig, &old) };
                }
                _ => {}
            }
        }
        std::thread::Builder::new()
            .name("netns-signals".into())
            .spawn(move || {
                let mut f = std::fs::File::from(rd);
                let mut b = [0u8; 1];
                while matches!(f.read(&mut b), Ok(0)) {}
                let sig = SIGNALLED.load(Ordering::SeqCst);
                let groups = crate::process::kill_live_groups();
                let nets = live_nets().clone();
                for n in &nets {
                    n.remove();
                }
                // Straight to the handle: this thread inherited a test's captured output,
                // which nobody would show once the process exits.
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "{}: killed {groups} process group(s) and removed {} network namespace \
                     net(s)",
                    shardline_runtime::interrupt::signal_name(sig),
                    nets.len()
                );
                std::process::exit(128 + sig);
            })
            .ok();
    });
}

/// The process id in a name this module gives (NETNS-2: `sl`, tag, kind, id, `-k`), where
/// the id is the pid times 16 plus a counter.
fn owner_pid(name: &str) -> Option<(char, u32)> {
    let rest = name.strip_prefix("sl")?;
    let mut chars = rest.chars();
    let tag = chars.next()?;
    let kind = chars.next()?;
    if !tag.is_ascii_lowercase() || !"bhin".contains(kind) {
        return None;
    }
    let digits = chars.as_str().split('-').next()?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let id: u64 = digits.parse().ok()?;
    u32::try_from(id / 16).ok().map(|pid| (kind, pid))
}

fn process_exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// NETNS-6: removes the nets of processes that no longer exist and whose namespaces are
/// empty. Best effort: whatever cannot be listed or removed is left as it is.
fn sweep_stale() {
    let out = |args: &[&str]| {
        Command::new("ip")
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    let dead = |name: &str| owner_pid(name).filter(|(_, pid)| !process_exists(*pid));
    let mut stale = Names::default();
    // Owners with a namespace still in use: nothing of theirs is removed.
    let mut in_use = Vec::new();
    for line in out(&["netns", "list"]).lines() {
        let Some(ns) = line.split_whitespace().next() else { continue };
        if let Some(('n', pid)) = dead(ns) {
            if out(&["netns", "pids", ns]).trim().is_empty() {
                stale.namespaces.push(ns.to_string());
            } else {
                in_use.push(pid);
            }
        }
    }
    let mut bridges = Vec::new();
    for line in out(&["-o", "link", "show"]).lines() {
        // "7: name@peer: <...>" or "7: name: <...>"
        let name = line.split(':').nth(1).map_or("", |n| n.trim().split('@').next().unwrap_or(""));
        match dead(name) {
            Some(('h', pid)) if !in_use.contains(&pid) => stale.hosts.push(name.to_string()),
            Some(('b', pid)) if !in_use.contains(&pid) => bridges.push(name.to_string()),
            _ => {}
        }
    }
    if stale.is_empty() && bridges.is_empty() {
        return;
    }
    tracing::info!(
        namespaces = stale.namespaces.len(),
        links = stale.hosts.len() + bridges.len(),
        "removing network namespaces left by processes that no longer exist"
    );
    stale.remove();
    for b in bridges {
        let _ = ip(&["link", "del", &b]);
    }
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
    /// Builds `nodes` namespaces named after `tag` (one lowercase ASCII letter, NETNS-2), node
    /// `k` at [`Net::addr`]`(k)`, each link shaped to `rate` bytes/s in both directions when
    /// given. Needs root and iproute2 (`ip`, and `tc` with a rate); the error says which is
    /// missing.
    pub fn new(tag: &str, nodes: usize, rate: Option<u64>) -> Result<Net> {
        static N: AtomicU32 = AtomicU32::new(0);
        let letter = match tag.as_bytes() {
            [c] if c.is_ascii_lowercase() => *c,
            _ => {
                return Err(HarnessError::config(format!(
                    "network namespace tag {tag:?} is not one lowercase letter"
                )))
            }
        };
        if !(1..=99).contains(&nodes) {
            return Err(HarnessError::config(format!(
                "{nodes} namespace nodes: between 1 and 99 are supported"
            )));
        }
        if !is_root() {
            return Err(HarnessError::process(
                "building network namespaces",
                "needs root (ip netns, veth, bridge, tc)",
            ));
        }
        if std::env::var_os(FORCE_FAIL_ENV).is_some_and(|v| v == "1") {
            return Err(HarnessError::process(
                "building network namespaces",
                format!("failed on purpose ({FORCE_FAIL_ENV}=1)"),
            ));
        }
        sweep_stale();
        watch_signals();
        let progs: &[&str] = if rate.is_some() { &["ip", "tc"] } else { &["ip"] };
        for prog in progs {
            Command::new(prog)
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map_err(|e| {
                    HarnessError::process(format!("iproute2's `{prog}`"), e.to_string())
                })?;
        }
        let n = N.fetch_add(1, Ordering::Relaxed);
        // At most 8 digits: pids stay below 2^22.
        let id = std::process::id() as u64 * 16 + u64::from(n % 16);
        let name = |kind: char, k: Option<usize>| match k {
            Some(k) => format!("sl{tag}{kind}{id}-{k}"),
            None => format!("sl{tag}{kind}{id}"),
        };
        let longest = name('h', Some(nodes - 1));
        if longest.len() > IFNAME_MAX {
            return Err(HarnessError::config(format!(
                "interface name {longest} is longer than {IFNAME_MAX} characters"
            )));
        }
        let mut net = Net {
            bridge: name('b', None),
            namespaces: Vec::new(),
            hosts: Vec::new(),
            subnet: format!("10.{letter}.{}", id % 250),
            rate,
        };
        // From here on a failure drops `net`, which removes what was already built; a signal
        // removes what is named so far (NETNS-5), so each name is registered before it is
        // created.
        live_nets().push(Names { bridge: net.bridge.clone(), ..Names::default() });
        ip(&["link", "add", &net.bridge, "type", "bridge"])?;
        ip(&["link", "set", &net.bridge, "up"])?;
        for k in 0..nodes {
            let ns = name('n', Some(k));
            net.register(|n| n.namespaces.push(ns.clone()));
            ip(&["netns", "add", &ns])?;
            net.namespaces.push(ns.clone());
            let (host, inner) = (name('h', Some(k)), name('i', Some(k)));
            let mtu = LINK_MTU.to_string();
            net.register(|n| n.hosts.push(host.clone()));
            ip(&["link", "add", &host, "mtu", &mtu, "type", "veth", "peer", "name", &inner])?;
            ip(&["link", "set", &inner, "mtu", &mtu])?;
            // NETNS-7: set on both ends while they are in this namespace (the sizes go with
            // the device into the node's). A kernel that refuses them leaves the legacy
            // 64 KiB: slower links, but links.
            let gso = link_gso_size(rate);
            for dev in [&host, &inner] {
                if let Err(e) = set_link_gso(dev, gso) {
                    static ONCE: std::sync::Once = std::sync::Once::new();
                    ONCE.call_once(|| {
                        tracing::warn!(
                            "{dev}: GSO/GRO size {gso} refused ({e}); the links keep the \
                             kernel's 64 KiB"
                        )
                    });
                }
            }
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
                run("tc", &inside)?;
                let mut outside = vec!["qdisc", "add", "dev", &host];
                outside.extend(&tbf);
                run("tc", &outside)?;
            }
        }
        Ok(net)
    }

    /// [`Net::new`] for the test `test` (its name in the skip report), applying NETNS-8:
    /// without root, `None` after [`skip`](crate::skip::skip) said why; as root, the net,
    /// or a panic with the error that kept it from being built. A bad tag or node count
    /// panics either way (a bug, not a missing privilege).
    pub fn or_skip(tag: &str, nodes: usize, rate: Option<u64>, test: &str) -> Option<Net> {
        match Net::new(tag, nodes, rate) {
            Ok(net) => Some(net),
            Err(e @ HarnessError::Config(_)) => panic!("{test}: {e}"),
            Err(e) if is_root() => panic!("{test}: running as root, so the harness must work: {e}"),
            Err(e) => {
                crate::skip::skip(test, &e.to_string());
                None
            }
        }
    }

    /// Updates this net's entry among the live nets (found by its bridge's name, unique to
    /// the net).
    fn register(&self, f: impl FnOnce(&mut Names)) {
        if let Some(n) = live_nets().iter_mut().find(|n| n.bridge == self.bridge) {
            f(n);
        }
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

    /// Node `k`'s namespace name.
    pub fn namespace(&self, k: usize) -> &str {
        &self.namespaces[k]
    }

    /// A command that runs `prog` inside node `k`'s namespace.
    pub fn command(&self, k: usize, prog: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.namespaces[k]]).arg(prog);
        cmd
    }

    /// Cuts node `k` off: its link goes down on the bridge side until the guard drops
    /// (NETNS-4).
    pub fn link_down(&self, k: usize) -> Result<Link<'_>> {
        ip(&["link", "set", &self.hosts[k], "down"])?;
        Ok(Link { net: self, node: k })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let names = Names {
            bridge: self.bridge.clone(),
            namespaces: self.namespaces.clone(),
            hosts: self.hosts.clone(),
        };
        names.remove();
        live_nets().retain(|n| n.bridge != self.bridge);
    }
}

/// A node's link cut by [`Net::link_down`], set up again on drop (NETNS-4).
pub struct Link<'a> {
    net: &'a Net,
    node: usize,
}

impl Link<'_> {
    /// Sets the link up again now.
    pub fn up(self) {}
}

impl Drop for Link<'_> {
    fn drop(&mut self) {
        let _ = ip(&["link", "set", &self.net.hosts[self.node], "up"]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::{alive, Child};
    use crate::skip::SKIP_LOG_ENV;
    use std::path::Path;
    use std::process::ExitStatus;
    use std::time::Instant;

    #[test]
    fn tbf_bucket_scales_with_the_rate_and_has_a_floor() {
        let a = tbf_args(125_000_000);
        assert_eq!(&a[..4], ["root", "tbf", "rate", "1000000000bit"]);
        assert_eq!(a[5], "250000");
        let b = tbf_args(1_000_000);
        assert_eq!(b[5], (32 << 10).to_string());
        assert_eq!(&b[6..], ["latency", "25ms"]);
    }

    /// NETNS-7: the largest packet on a shaped link stays within half its bucket.
    #[test]
    fn gso_size_fits_the_bucket() {
        assert_eq!(link_gso_size(None), LINK_GSO_MAX);
        for rate in [1_000_000u64, 62_500_000, 125_000_000, 250_000_000, 625_000_000, 1 << 34] {
            let g = u64::from(link_gso_size(Some(rate)));
            assert!(g >= u64::from(GSO_LEGACY_MAX) && g <= u64::from(LINK_GSO_MAX), "{rate}");
            assert!(g <= tbf_burst(rate) / 2 || g == u64::from(GSO_LEGACY_MAX), "{rate}: {g}");
        }
        // 1gbit: a 250 KB bucket; 5gbit and up: the whole 512 KiB.
        assert_eq!(link_gso_size(Some(125_000_000)), 125_000);
        assert_eq!(link_gso_size(Some(625_000_000)), LINK_GSO_MAX);
    }

    /// The IPv4 GSO size the kernel reports for `ifname` (this namespace), if it has one.
    fn gso_ipv4_max(ifname: &str) -> Option<u32> {
        use netlink_packet_core::NetlinkPayload;
        use netlink_packet_route::link::{LinkAttribute, LinkMessage};
        use netlink_packet_route::RouteNetlinkMessage;
        let mut link = LinkMessage::default();
        link.header.index = if_index(ifname).ok()?;
        match rtnetlink_request(RouteNetlinkMessage::GetLink(link), 0).ok()?.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => {
                l.attributes.iter().find_map(|a| match a {
                    LinkAttribute::GsoIpv4MaxSize(v) => Some(*v),
                    _ => None,
                })
            }
            _ => None,
        }
    }

    /// NETNS-7: both ends of a built link take the chosen packet size; on a kernel without
    /// IPv4 sizes (before Linux 6.3) they take it or keep the legacy 64 KiB (needs root,
    /// NETNS-8).
    #[test]
    fn links_take_large_packets() {
        let rate = 625_000_000;
        let Some(net) = Net::or_skip("g", 1, Some(rate), "links_take_large_packets") else {
            return;
        };
        let want = link_gso_size(Some(rate));
        let o = Command::new("ip")
            .args(["-n", &net.namespaces[0], "-d", "link", "show"])
            .output()
            .expect("iproute2");
        let inside = String::from_utf8_lossy(&o.stdout);
        let takes = |size: u32| inside.contains(&format!("gso_max_size {size}"));
        match gso_ipv4_max(&net.hosts[0]) {
            Some(v) => {
                assert_eq!(v, want, "host end");
                assert!(takes(want), "{inside}");
            }
            None => assert!(takes(want) || takes(GSO_LEGACY_MAX), "{inside}"),
        }
    }

    /// NETNS-2: tags other than one lowercase letter are refused before anything is built.
    #[test]
    fn bad_tags_are_refused() {
        for tag in ["", "ab", "B", "-"] {
            assert!(matches!(Net::new(tag, 1, None), Err(HarnessError::Config(_))), "{tag:?}");
        }
    }

    #[test]
    fn owner_pids_come_from_this_modules_names() {
        assert_eq!(owner_pid("slbn240720-0"), Some(('n', 15045)));
        assert_eq!(owner_pid("slbh240735-1"), Some(('h', 15045)));
        assert_eq!(owner_pid("slub33"), Some(('b', 2)));
        for other in ["eth0", "sl", "slb", "slbx12", "slBn12-0", "slbn-0", "slbn12a-0", "lo"] {
            assert_eq!(owner_pid(other), None, "{other}");
        }
    }

    fn show(args: &[&str]) -> String {
        let o = Command::new(args[0]).args(&args[1..]).output().expect("iproute2");
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// NETNS-6: a net left by a process that no longer exists goes with the next `Net::new`;
    /// one named after a live process stays (needs root, NETNS-8).
    #[test]
    fn nets_of_dead_processes_are_swept() {
        if !root_or_skip("nets_of_dead_processes_are_swept") {
            return;
        }
        // The dead process's pid must stay unused until the sweep is checked; should the
        // kernel hand it out again meanwhile, the round proves nothing and another one runs.
        for _ in 0..3 {
            let mut gone = Command::new("true").spawn().expect("spawn true");
            let dead = gone.id();
            gone.wait().expect("wait true");
            let stale = dead as u64 * 16;
            let ours = std::process::id() as u64 * 16 + 15;
            let (bridge, ns, host) =
                (format!("slxb{stale}"), format!("slxn{stale}-0"), format!("slxh{stale}-0"));
            let kept = format!("slxb{ours}");
            ip(&["link", "add", &bridge, "type", "bridge"]).expect("bridge");
            ip(&["link", "add", &kept, "type", "bridge"]).expect("bridge");
            ip(&["netns", "add", &ns]).expect("netns");
            let inner = format!("slxi{stale}-0");
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner]).expect("veth");
            let net = Net::new("w", 1, None).expect("net");
            let links = show(&["ip", "-o", "link", "show"]);
            let spaces = show(&["ip", "netns", "list"]);
            let _ = ip(&["link", "del", &kept]);
            drop(net);
            if process_exists(dead) {
                for n in [&bridge, &host] {
                    let _ = ip(&["link", "del", n]);
                }
                let _ = ip(&["netns", "del", &ns]);
                continue;
            }
            assert!(!links.contains(&format!(": {bridge}:")), "{bridge} left: {links}");
            assert!(!links.contains(&format!(": {host}@")), "{host} left: {links}");
            assert!(!spaces.contains(&ns), "{ns} left: {spaces}");
            assert!(links.contains(&format!(": {kept}:")), "a live process's bridge was removed");
            return;
        }
        panic!("three pids in a row were reused before the sweep could be checked");
    }

    /// Run by `signal_removes_live_nets` in a process of its own: builds a net and a child
    /// group, says where they are, and waits to be signalled.
    #[test]
    #[ignore = "run by signal_removes_live_nets in a child process"]
    fn holds_a_net_until_signalled() {
        if std::env::var_os("SHARDLINE_NETNS_HOLD").is_none() {
            return;
        }
        let net = Net::new("v", 1, None).expect("net");
        let mut cmd = Command::new("sleep");
        cmd.arg("60");
        let child = Child::spawn(cmd, "sleeper").expect("sleep");
        println!("READY {} {} {}", net.bridge, net.namespaces[0], child.id().unwrap_or(0));
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::thread::sleep(Duration::from_secs(60));
        drop((child, net));
    }

    /// NETNS-5: SIGINT to a process holding a net and a child group removes the net, kills
    /// the group and exits with 130 (needs root, NETNS-8).
    #[test]
    fn signal_removes_live_nets() {
        if !root_or_skip("signal_removes_live_nets") {
            return;
        }
        let exe = std::env::current_exe().expect("test binary");
        let mut cmd = Command::new(exe);
        cmd.args(["--exact", "netns::tests::holds_a_net_until_signalled", "--ignored"])
            .args(["--nocapture", "--test-threads=1"])
            .env("SHARDLINE_NETNS_HOLD", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The holder's SIGINT has its default action whatever this process inherited: a
        // test started in the background by a non-interactive shell ignores SIGINT, and
        // NETNS-5 keeps an ignored signal ignored.
        use std::os::unix::process::CommandExt;
        // SAFETY: `signal` is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                use nix::sys::signal::{signal, SigHandler, Signal};
                for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
                    signal(sig, SigHandler::SigDfl).map_err(std::io::Error::from)?;
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawn the holder");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                // libtest prints the test's name first, on the same line.
                if let Some((_, rest)) = line.split_once("READY ") {
                    let _ = tx.send(rest.to_string());
                }
            }
        });
        let ready = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(r) => r,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the holder never got ready: {e}");
            }
        };
        let parts: Vec<&str> = ready.split_whitespace().collect();
        let (bridge, ns, sleeper) = (parts[0], parts[1], parts[2].parse::<u32>().unwrap_or(0));
        assert!(show(&["ip", "-o", "link", "show"]).contains(&format!(": {bridge}:")));
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the holder did not exit after SIGINT");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(status.code(), Some(130), "{status}");
        assert!(!show(&["ip", "-o", "link", "show"]).contains(&format!(": {bridge}:")));
        assert!(!show(&["ip", "netns", "list"]).contains(ns), "{ns} left behind");
        let gone = Instant::now() + Duration::from_secs(10);
        while sleeper != 0 && alive(sleeper) {
            assert!(Instant::now() < gone, "the child group survived the signal");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// NETNS-1, NETNS-4: a built net is shaped both ways, a cut link comes back with the
    /// guard, and nothing is left after drop (needs root, NETNS-8).
    #[test]
    fn namespaces_are_removed_on_drop() {
        let test = "namespaces_are_removed_on_drop";
        let Some(net) = Net::or_skip("u", 2, Some(125_000_000), test) else { return };
        let (names, hosts) = (net.namespaces.clone(), net.hosts.clone());
        let inside = show(&["tc", "-n", &names[1], "qdisc", "show"]);
        let outside = show(&["tc", "qdisc", "show", "dev", &hosts[1]]);
        for q in [&inside, &outside] {
            assert!(q.contains("tbf") && q.contains("rate 1Gbit"), "{q}");
        }
        let link = net.link_down(1).expect("link down");
        let down = show(&["ip", "-o", "link", "show", &hosts[1]]);
        drop(link);
        let up = show(&["ip", "-o", "link", "show", &hosts[1]]);
        assert!(!down.contains("<BROADCAST,MULTICAST,UP"), "{down}");
        assert!(up.contains(",UP"), "{up}");
        drop(net);
        let listed = show(&["ip", "netns", "list"]);
        let links = show(&["ip", "link", "show"]);
        for n in names {
            assert!(!listed.contains(&n), "{n} left behind");
        }
        for h in hosts {
            assert!(!links.contains(&format!("{h}@")), "{h} left behind");
        }
    }

    /// The namespace test that the NETNS-8 tests run in a process of their own.
    const PROBE: &str = "netns::tests::namespaces_are_removed_on_drop";

    /// What a run of [`PROBE`] left: exit status, stdout, stderr, skip log.
    struct ProbeRun {
        status: ExitStatus,
        stdout: String,
        stderr: String,
        logged: String,
    }

    /// Runs [`PROBE`] alone, as libtest runs it under `cargo test` (output captured), in the
    /// test binary `exe` with its skip log in `dir`; with [`FORCE_FAIL_ENV`]`=1` when
    /// `force_fail`, as the user `uid` when given.
    fn run_probe(exe: &Path, dir: &Path, force_fail: bool, uid: Option<u32>) -> ProbeRun {
        use std::os::unix::process::CommandExt;
        let log = dir.join("skipped.log");
        let mut cmd = Command::new(exe);
        cmd.args(["--exact", PROBE, "--test-threads=1"])
            .current_dir(dir)
            .env(SKIP_LOG_ENV, &log)
            .env_remove(FORCE_FAIL_ENV);
        if force_fail {
            cmd.env(FORCE_FAIL_ENV, "1");
        }
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        let out = Child::spawn(cmd, PROBE)
            .and_then(|c| c.wait_output(Instant::now() + Duration::from_secs(120)))
            .unwrap_or_else(|e| panic!("{e}"));
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        ProbeRun {
            status: out.status,
            stdout: text(&out.stdout),
            stderr: text(&out.stderr),
            logged: std::fs::read_to_string(&log).unwrap_or_default(),
        }
    }

    /// NETNS-8 without root: the probe passed, its skip and the reason are on stderr
    /// although libtest captured its output, and the skip log has one line of it.
    fn assert_skipped_with_reason(run: &ProbeRun) {
        let ProbeRun { status, stdout, stderr, logged } = run;
        assert!(status.success() && stdout.contains("1 passed"), "{status}\n{stdout}\n{stderr}");
        let line = "namespaces_are_removed_on_drop: building network namespaces: needs root";
        assert!(stderr.contains(&format!("SKIPPED {line}")), "no reason shown:\n{stderr}");
        assert_eq!(logged.lines().count(), 1, "{logged}");
        assert!(logged.starts_with(line), "{logged}");
    }

    /// NETNS-8: a namespace test whose harness fails (here on purpose, [`FORCE_FAIL_ENV`])
    /// fails as root and logs no skip; without root it skips and says why.
    #[test]
    fn a_failing_harness_fails_the_test_as_root() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exe = std::env::current_exe().expect("test binary");
        let run = run_probe(&exe, dir.path(), true, None);
        if !is_root() {
            assert_skipped_with_reason(&run);
            return;
        }
        let ProbeRun { status, stdout, stderr, logged } = &run;
        assert!(!status.success(), "passed with a failing harness:\n{stdout}\n{stderr}");
        assert!(stdout.contains("1 failed"), "{stdout}\n{stderr}");
        let why = format!("failed on purpose ({FORCE_FAIL_ENV}=1)");
        assert!(stdout.contains(&why) || stderr.contains(&why), "{stdout}\n{stderr}");
        assert!(!stderr.contains("SKIPPED") && logged.is_empty(), "{stderr}\n{logged}");
    }

    /// NETNS-8: without root a namespace test passes without running, and says so where
    /// `cargo test` shows it and in the skip log. As root, the probe runs as `nobody`
    /// (uid 65534) from a copy of this binary that user can read.
    #[test]
    fn without_root_a_namespace_test_skips_and_says_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut exe = std::env::current_exe().expect("test binary");
        let mut uid = None;
        if is_root() {
            use std::os::unix::fs::PermissionsExt;
            let copy = dir.path().join("probe");
            std::fs::copy(&exe, &copy).expect("copy the test binary");
            let open = std::fs::Permissions::from_mode(0o777);
            std::fs::set_permissions(dir.path(), open).expect("chmod the directory");
            (exe, uid) = (copy, Some(65_534));
        }
        assert_skipped_with_reason(&run_probe(&exe, dir.path(), false, uid));
    }
}
