//! TCP transport: ranks on any hosts.
//!
//! Each rank listens on one socket (socket2: `TCP_NODELAY`, 4 MiB send and receive buffers,
//! cubic congestion control unless [`CONGESTION_ENV`] says otherwise)
//! and publishes `host:port` and a random nonce in the store. For each lane, the lower rank of
//! every pair connects to the higher one, `sockets_per_peer` times; the first bytes on a new
//! socket are a hello (magic, version, listener nonce, lane, generation, rank, socket index).
//! An acceptor thread checks the hello and parks the socket until the lane is opened here.
//!
//! A message travels as chunks of at most [`CHUNK_BYTES`]; chunk `j` goes on socket
//! `j % sockets_per_peer`, so several sockets carry one large message at once while the
//! receiver still delivers it in offset order. Each chunk is a frame: a 64-byte header
//! (magic, kind, tag, message length, offset, chunk length, crc32 of the header) and the
//! payload, written with one `sendmsg` (header and payload as two iovecs). The exchange loop
//! writes and reads as much as the non-blocking sockets take and waits in `poll(2)` when
//! nothing moves.
//!
//! The wire format (hello, frame header, chunks, poison body) lives in `wire`, which does no
//! I/O and is tested on its own; the exchange loop over a lane's sockets in `links`. This
//! file opens the sockets: listener, hellos, one set per lane.
//!
//! Invariants, besides the transport's TR-1..TR-5:
//! - TCP-1: a socket is used for a lane only after its hello carried the nonce this rank
//!   published in the store, a known lane generation and a valid rank and socket index;
//!   anything else is closed and logged.
//! - TCP-2: every frame header is checked (magic, crc, kind, lengths against the expected
//!   chunk) before its payload is read: a bad header is `Corrupt`, a foreign tag `TagMismatch`,
//!   another message length `LengthMismatch`; no length from the wire sizes an allocation
//!   beyond [`MAX_POISON_REASON`].
//! - TCP-3: a poison frame is only ever written at a frame boundary: `poison` first completes
//!   a half-written frame (with zeros), or shuts the socket down if it cannot within its
//!   time budget, so that the peer reads either the poison or an EOF (`PeerLost`).
//! - TCP-5: a peer found lost while another peer's poison waits unread reports the poison
//!   (`links`): the first failure's reason survives the resets that follow it.
//! - TCP-4: an exchange of at most [`SPIN_MAX_BYTES`] polls its sockets without sleeping for
//!   up to the lane's spin ([`SPIN_ENV`]; by default [`DEFAULT_SPIN`] while the job's ranks do
//!   not outnumber this process's cores, else none) before it waits in `poll(2)`: a small
//!   message then pays no wake-up, and a large transfer, which waits on the link far longer,
//!   never burns a core.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

use super::{LaneLinks, Transport, TransportError};
use crate::store::{Store, StoreError};

mod links;
mod wire;
use links::{PeerConn, TcpLinks};
pub use wire::{CHUNK_BYTES, MAX_POISON_REASON};
use wire::{HELLO_FIXED, MAX_LANE_NAME};

/// Largest exchange (bytes sent and received together) that spins before sleeping (TCP-4).
pub const SPIN_MAX_BYTES: usize = 64 << 10;
/// Default spin of a small exchange while the ranks do not outnumber the cores (TCP-4).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(30);
/// Environment variable that sets the spin of small exchanges, in microseconds (TCP-4).
pub const SPIN_ENV: &str = "SHARDLINE_TCP_SPIN_US";

/// TCP-4: the spin of a small exchange among `world` ranks.
fn lane_spin(world: usize) -> Duration {
    if let Some(us) = std::env::var(SPIN_ENV).ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        return Duration::from_micros(us);
    }
    super::spin_if_ranks_have_cores(world, DEFAULT_SPIN)
}

/// Socket buffer size requested for every link.
pub const SOCKET_BUFFER_BYTES: usize = 4 << 20;
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

fn setup(what: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(what.to_string())
}

/// Options of [`TcpTransport`]. Private fields, `&mut Self` setters.
///
/// ```
/// use shardline_collectives::transport::tcp::TcpOptions;
/// let mut o = TcpOptions::default();
/// o.sockets_per_peer(2).job("train-42");
/// assert_eq!(o.get_sockets_per_peer(), 2);
/// ```
#[derive(Clone, Debug)]
pub struct TcpOptions {
    bind: SocketAddr,
    advertise: Option<String>,
    sockets_per_peer: usize,
    connect_timeout: Duration,
    job: String,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            // Env `SHARDLINE_TCP_SOCKETS_PER_PEER` (1-16), default 1.
            sockets_per_peer: std::env::var("SHARDLINE_TCP_SOCKETS_PER_PEER")
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .map_or(1, |n| n.clamp(1, 16)),
            connect_timeout: Duration::from_secs(10),
            job: "default".into(),
        }
    }
}

impl TcpOptions {
    /// Address to listen on. Default `127.0.0.1:0` (loopback, any free port).
    pub fn bind(&mut self, addr: SocketAddr) -> &mut Self {
        self.bind = addr;
        self
    }

    /// Host name or IP the peers should connect to. Default: the bind IP (or `127.0.0.1` when
    /// binding the unspecified address).
    pub fn advertise(&mut self, host: impl Into<String>) -> &mut Self {
        self.advertise = Some(host.into());
        self
    }

    /// Sockets per peer and lane; large messages are striped over them. Default 1.
    pub fn sockets_per_peer(&mut self, n: usize) -> &mut Self {
        self.sockets_per_peer = n.clamp(1, 64);
        self
    }

    /// Current sockets per peer.
    pub fn get_sockets_per_peer(&self) -> usize {
        self.sockets_per_peer
    }

    /// Bound on one connection attempt. Default 10 s (open_lane's deadline also applies).
    pub fn connect_timeout(&mut self, t: Duration) -> &mut Self {
        self.connect_timeout = t;
        self
    }

    /// Job name used in the store keys (ranks of one job share it). Default `"default"`.
    pub fn job(&mut self, job: &str) -> &mut Self {
        self.job = job.to_owned();
        self
    }
}

/// A peer's listening address and the nonce its hellos must carry.
type PeerAddr = (SocketAddr, [u8; 16]);

/// Key of a parked accepted socket: lane, generation, peer rank, socket index.
type ParkKey = (String, u64, usize, usize);

#[derive(Default)]
struct Parked {
    socks: Mutex<HashMap<ParkKey, TcpStream>>,
    arrived: Condvar,
}

/// The TCP transport (see the module docs).
pub struct TcpTransport {
    rank: usize,
    world: usize,
    store: Arc<dyn Store>,
    opts: TcpOptions,
    parked: Arc<Parked>,
    stop: Arc<AtomicBool>,
    opens: Mutex<HashMap<String, u64>>,
    peers: Mutex<Vec<Option<PeerAddr>>>,
}

fn random_nonce() -> [u8; 16] {
    let mut n = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut n)).is_ok();
    if !ok {
        // Not secret then, but still distinct per process and instant.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        h.write_u32(std::process::id());
        n[..8].copy_from_slice(&h.finish().to_le_bytes());
    }
    n
}

/// Environment variable naming the TCP congestion control every link asks for; empty or
/// `system` keeps the system's default.
pub const CONGESTION_ENV: &str = "SHARDLINE_TCP_CONGESTION";
/// Congestion control asked for when [`CONGESTION_ENV`] is unset. Cubic rather than a
/// system default such as BBR: a collective is a burst of a few MiB between idle gaps, and
/// BBR paces each burst at its estimate of the path's rate (with a timer per send on a
/// qdisc that does not pace, such as pfifo_fast or tbf). Measured on the 2-core reference
/// machine, system default switched between runs (bench/RESULTS.md): 64 MiB tcp all-gather
/// W=2 over loopback 2.35-2.41 GB/s busbw with cubic against 1.82-1.95 with BBR; over a
/// 4 Gbit/s tbf link between namespaces, all-reduce busbw 0.99-1.01 of the link against
/// 0.91-0.96, and the overlapped training step 1.11x of its communication against 1.16-1.17x.
pub const DEFAULT_CONGESTION: &str = "cubic";

/// The congestion control the links ask for (`None`: the system's).
pub fn congestion() -> Option<String> {
    congestion_from(std::env::var(CONGESTION_ENV).ok().as_deref())
}

fn congestion_from(env: Option<&str>) -> Option<String> {
    match env.map(str::trim) {
        None => Some(DEFAULT_CONGESTION.to_string()),
        Some("" | "system") => None,
        Some(v) => Some(v.to_string()),
    }
}

/// Asks for [`congestion`] on one socket. An algorithm the kernel lacks or does not allow
/// leaves the system's in place, with one warning per process: a link that works matters
/// more than its tuning.
pub fn set_congestion(sock: socket2::SockRef<'_>) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let Some(cc) = congestion() else { return };
    if let Err(e) = sock.set_tcp_congestion(cc.as_bytes()) {
        WARNED.call_once(|| {
            tracing::warn!(
                "tcp: congestion control '{cc}' not available ({e}); links use the system's \
                 (see net.ipv4.tcp_allowed_congestion_control, or set {CONGESTION_ENV})"
            )
        });
    }
}

fn tune(sock: &Socket) -> std::io::Result<()> {
    sock.set_tcp_nodelay(true)?;
    sock.set_send_buffer_size(SOCKET_BUFFER_BYTES)?;
    sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES)?;
    set_congestion(socket2::SockRef::from(sock));
    Ok(())
}

impl TcpTransport {
    /// Starts listening and publishes this rank's address in the store.
    pub fn new(
        rank: usize,
        world: usize,
        store: Arc<dyn Store>,
        opts: TcpOptions,
    ) -> Result<Self, TransportError> {
        if rank >= world {
            return Err(setup(format!("rank {rank} out of world {world}")));
        }
        let sock = Socket::new(Domain::for_address(opts.bind), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| setup(format!("socket: {e}")))?;
        // Accepted sockets inherit the buffer sizes, which must be set before listen for the
        // window scale to be negotiated.
        tune(&sock).map_err(|e| setup(format!("socket options: {e}")))?;
        sock.set_reuse_address(true).map_err(|e| setup(format!("SO_REUSEADDR: {e}")))?;
        sock.bind(&opts.bind.into()).map_err(|e| setup(format!("bind {}: {e}", opts.bind)))?;
        sock.listen(1024).map_err(|e| setup(format!("listen: {e}")))?;
        let listener: TcpListener = sock.into();
        let local = listener.local_addr().map_err(|e| setup(format!("local_addr: {e}")))?;
        let host = match &opts.advertise {
            Some(h) => h.clone(),
            None if local.ip().is_unspecified() => "127.0.0.1".to_owned(),
            None => local.ip().to_string(),
        };
        let nonce = random_nonce();
        let parked = Arc::new(Parked::default());
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (parked, stop) = (parked.clone(), stop.clone());
            let spp = opts.sockets_per_peer;
            listener.set_nonblocking(true).map_err(|e| setup(format!("listener: {e}")))?;
            std::thread::Builder::new()
                .name(format!("tcp-accept-{rank}"))
                .spawn(move || accept_loop(listener, nonce, world, spp, parked, stop))
                .map_err(|e| setup(format!("spawn: {e}")))?;
        }
        let addr = if host.contains(':') {
            format!("[{host}]:{}", local.port())
        } else {
            format!("{host}:{}", local.port())
        };
        store
            .set(
                &format!("tcp/{}/{rank}/addr", opts.job),
                format!("{addr} {}", wire::hex(&nonce)).as_bytes(),
            )
            .map_err(|e| setup(format!("publishing address: {e}")))?;
        Ok(TcpTransport {
            rank,
            world,
            store,
            opts,
            parked,
            stop,
            opens: Mutex::new(HashMap::new()),
            peers: Mutex::new(vec![None; world]),
        })
    }

    fn peer_addr(
        &self,
        peer: usize,
        deadline: Instant,
    ) -> Result<(SocketAddr, [u8; 16]), TransportError> {
        if let Some(a) = self.peers.lock().unwrap_or_else(|e| e.into_inner())[peer] {
            return Ok(a);
        }
        let key = format!("tcp/{}/{peer}/addr", self.opts.job);
        let v = self.store.get(&key, deadline.saturating_duration_since(Instant::now())).map_err(
            |e| match e {
                StoreError::Timeout { .. } => TransportError::Timeout { peer },
                e => setup(e),
            },
        )?;
        let bad = || setup(format!("rank {peer} published a bad address"));
        let s = std::str::from_utf8(&v).map_err(|_| bad())?;
        let (addr, nonce) = s.split_once(' ').ok_or_else(bad)?;
        let addr = addr
            .to_socket_addrs()
            .map_err(|e| setup(format!("resolving {addr}: {e}")))?
            .next()
            .ok_or_else(bad)?;
        let nonce = wire::unhex(nonce).ok_or_else(bad)?;
        self.peers.lock().unwrap_or_else(|e| e.into_inner())[peer] = Some((addr, nonce));
        Ok((addr, nonce))
    }

    fn connect(
        &self,
        peer: usize,
        lane: &str,
        generation: u64,
        idx: usize,
        deadline: Instant,
    ) -> Result<TcpStream, TransportError> {
        let (addr, nonce) = self.peer_addr(peer, deadline)?;
        let io = |e: std::io::Error| TransportError::Io { peer, detail: e.to_string() };
        let stream = loop {
            let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
                .map_err(io)?;
            tune(&sock).map_err(io)?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout { peer });
            }
            match sock.connect_timeout(&addr.into(), left.min(self.opts.connect_timeout)) {
                Ok(()) => break TcpStream::from(sock),
                Err(e) => {
                    tracing::debug!("connect to rank {peer} at {addr}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        let hello = wire::encode_hello(&nonce, generation, self.rank, idx, lane);
        (&stream).write_all(&hello).map_err(io)?;
        Ok(stream)
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // The acceptor notices within its poll period and closes the listener.
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn accept_loop(
    listener: TcpListener,
    nonce: [u8; 16],
    world: usize,
    sockets_per_peer: usize,
    parked: Arc<Parked>,
    stop: Arc<AtomicBool>,
) {
    let fd = listener.as_raw_fd();
    while !stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd that outlives the call.
        unsafe { libc::poll(&mut pfd, 1, 50) };
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    let parked = parked.clone();
                    let _ = std::thread::Builder::new().name("tcp-hello".into()).spawn(move || {
                        match read_hello(&stream, &nonce, world, sockets_per_peer) {
                            Ok(key) => {
                                let mut socks =
                                    parked.socks.lock().unwrap_or_else(|e| e.into_inner());
                                socks.insert(key, stream);
                                parked.arrived.notify_all();
                            }
                            Err(why) => {
                                tracing::warn!("tcp: refused connection from {from}: {why}")
                            }
                        }
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!("tcp: accept failed: {e}");
                    break;
                }
            }
        }
    }
}

/// TCP-1: reads and checks a hello; returns where to park the socket.
fn read_hello(
    mut s: &TcpStream,
    nonce: &[u8; 16],
    world: usize,
    sockets_per_peer: usize,
) -> Result<ParkKey, String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(|e| e.to_string())?;
    let mut h = [0u8; HELLO_FIXED];
    s.read_exact(&mut h).map_err(|e| format!("reading hello: {e}"))?;
    let wire::Hello { lane_len, generation, rank, idx } =
        wire::decode_hello(&h, nonce, world, sockets_per_peer)?;
    let mut lane = vec![0u8; lane_len];
    s.read_exact(&mut lane).map_err(|e| format!("reading hello: {e}"))?;
    let lane = String::from_utf8(lane).map_err(|_| "lane name is not utf-8".to_string())?;
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok((lane, generation, rank, idx))
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn open_lane(
        &self,
        lane: &str,
        deadline: Instant,
    ) -> Result<Box<dyn LaneLinks>, TransportError> {
        if lane.len() > MAX_LANE_NAME {
            return Err(setup(format!("lane name longer than {MAX_LANE_NAME} B")));
        }
        let generation = {
            let mut opens = self.opens.lock().unwrap_or_else(|e| e.into_inner());
            let g = opens.entry(lane.to_owned()).or_insert(0);
            *g += 1;
            *g
        };
        let spp = self.opts.sockets_per_peer;
        let mut peers: Vec<Option<PeerConn>> = (0..self.world).map(|_| None).collect();
        for (p, slot) in peers.iter_mut().enumerate().skip(self.rank + 1) {
            let socks = (0..spp)
                .map(|i| self.connect(p, lane, generation, i, deadline))
                .collect::<Result<Vec<_>, _>>()?;
            *slot = Some(PeerConn::new(socks));
        }
        let mut socks = self.parked.socks.lock().unwrap_or_else(|e| e.into_inner());
        for (p, slot) in peers.iter_mut().enumerate().take(self.rank) {
            let mut mine = Vec::with_capacity(spp);
            for i in 0..spp {
                let key = (lane.to_owned(), generation, p, i);
                loop {
                    if let Some(s) = socks.remove(&key) {
                        mine.push(s);
                        break;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(TransportError::Timeout { peer: p });
                    }
                    socks = self
                        .parked
                        .arrived
                        .wait_timeout(socks, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
            *slot = Some(PeerConn::new(mine));
        }
        drop(socks);
        for (p, conn) in peers.iter().enumerate() {
            for s in conn.iter().flat_map(|c| &c.socks) {
                s.stream
                    .set_nonblocking(true)
                    .and_then(|_| s.stream.set_nodelay(true))
                    .map_err(|e| TransportError::Io { peer: p, detail: e.to_string() })?;
                set_congestion(socket2::SockRef::from(&s.stream));
            }
        }
        Ok(Box::new(TcpLinks::new(self.rank, peers, lane_spin(self.world))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;
    use crate::transport::suite;

    fn make(rank: usize, world: usize, store: Arc<dyn Store>) -> Box<dyn Transport> {
        Box::new(TcpTransport::new(rank, world, store, TcpOptions::default()).unwrap())
    }

    fn make_striped(rank: usize, world: usize, store: Arc<dyn Store>) -> Box<dyn Transport> {
        let mut o = TcpOptions::default();
        o.sockets_per_peer(3);
        Box::new(TcpTransport::new(rank, world, store, o).unwrap())
    }

    #[test]
    fn congestion_control_choice() {
        assert_eq!(congestion_from(None).as_deref(), Some("cubic"));
        assert_eq!(congestion_from(Some(" reno ")).as_deref(), Some("reno"));
        assert_eq!(congestion_from(Some("")), None);
        assert_eq!(congestion_from(Some("system")), None);
    }

    /// The links' socket options, congestion control included where the kernel offers it.
    #[test]
    fn tuned_sockets_ask_for_cubic() {
        let sock = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        tune(&sock).unwrap();
        assert!(sock.tcp_nodelay().unwrap());
        let offered = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
            .unwrap_or_default();
        // Skips go to the stderr handle: libtest hides a passing test's `eprintln!`.
        use std::io::Write;
        if std::env::var(CONGESTION_ENV).is_ok() {
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED tuned_sockets_ask_for_cubic's congestion check: {CONGESTION_ENV} is set"
            );
        } else if !offered.split_whitespace().any(|a| a == DEFAULT_CONGESTION) {
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED tuned_sockets_ask_for_cubic's congestion check: this kernel does not \
                 allow cubic ({offered:?})"
            );
        } else {
            let name = sock.tcp_congestion().unwrap();
            let name: Vec<u8> = name.into_iter().take_while(|&b| b != 0).collect();
            assert_eq!(name, DEFAULT_CONGESTION.as_bytes());
        }
    }

    /// TR-1, TR-2, TR-5
    #[test]
    fn tcp_all_to_all_w2_w3() {
        suite::all_to_all(&make, 2);
        suite::all_to_all(&make, 3);
    }

    /// TCP-4: small exchanges spin while the ranks have cores; the variable overrides.
    #[test]
    fn small_exchanges_spin_while_ranks_have_cores() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if std::env::var(SPIN_ENV).is_ok() {
            // To the stderr handle: libtest hides a passing test's `println!`.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED small_exchanges_spin_while_ranks_have_cores: {SPIN_ENV} is set"
            );
            return;
        }
        assert_eq!(lane_spin(1), DEFAULT_SPIN);
        assert_eq!(lane_spin(cores), DEFAULT_SPIN);
        assert_eq!(lane_spin(cores + 1), Duration::ZERO);
    }

    /// TR-1, TR-2 with large messages striped over several sockets.
    #[test]
    fn tcp_striped_all_to_all() {
        suite::all_to_all(&make_striped, 2);
        suite::all_to_all(&make_striped, 3);
    }

    /// TCP-2
    #[test]
    fn tcp_mismatches() {
        suite::mismatches(&make);
    }

    /// TR-3, TR-4, TCP-3
    #[test]
    fn tcp_failures() {
        suite::failures(&make);
        suite::failures(&make_striped);
    }

    /// TCP-1: a connection without the published nonce is never handed to a lane.
    #[test]
    fn tcp_refuses_foreign_hello() {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let t1 = TcpTransport::new(1, 2, store.clone(), TcpOptions::default()).unwrap();
        let v = store.get("tcp/default/1/addr", suite::T).unwrap();
        let addr = String::from_utf8(v).unwrap();
        let addr = addr.split(' ').next().unwrap().to_owned();
        // A hello with a wrong nonce, claiming to be rank 0 on lane "l".
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(&wire::encode_hello(&[7u8; 16], 1, 0, 0, "l")).unwrap();
        let r = t1.open_lane("l", Instant::now() + Duration::from_millis(300));
        assert!(matches!(r, Err(TransportError::Timeout { peer: 0 })));
    }

    /// TCP-5: rank 0 poisons rank 2 and at once rank 1, which rank 2 waits on, closes its
    /// endpoint; rank 2 reports rank 0's poison, not rank 1's loss.
    #[test]
    fn a_loss_after_a_poison_reports_the_poison_tcp_5() {
        use crate::transport::suite::T;
        use crate::transport::{Poison, RecvOp, Sink, Tag};
        use std::sync::mpsc;
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let (waiting_tx, waiting_rx) = mpsc::channel::<()>();
        let (poisoned_tx, poisoned_rx) = mpsc::channel::<()>();
        let s0 = store.clone();
        let r0 = std::thread::spawn(move || {
            let t = make(0, 3, s0);
            let mut links = t.open_lane("l", Instant::now() + T).unwrap();
            waiting_rx.recv_timeout(T).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            links.poison(&Poison { origin: 0, reason: "rank 3 lost".into() });
            poisoned_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_secs(1));
        });
        let s1 = store.clone();
        let r1 = std::thread::spawn(move || {
            let t = make(1, 3, s1);
            let links = t.open_lane("l", Instant::now() + T).unwrap();
            poisoned_rx.recv_timeout(T).unwrap();
            drop(links);
            drop(t);
        });
        let t = make(2, 3, store);
        let mut links = t.open_lane("l", Instant::now() + T).unwrap();
        waiting_tx.send(()).unwrap();
        let mut sink = |_: usize, _: &[u8]| {};
        let mut recvs = [RecvOp { peer: 1, len: 4, sink: Sink::Fn(&mut sink) }];
        let tag = Tag { lane: 7, seq: 3, kind: 1, count: 1, root: u32::MAX, step: 0 };
        let cancel = AtomicBool::new(false);
        let err = links.exchange(tag, &[], &mut recvs, Instant::now() + T, &cancel).unwrap_err();
        r0.join().unwrap();
        r1.join().unwrap();
        match err {
            TransportError::Poisoned(p) => {
                assert_eq!((p.origin, p.reason.as_str()), (0, "rank 3 lost"))
            }
            other => panic!("expected rank 0's poison, got {other:?}"),
        }
    }

    fn group(w: usize) -> Vec<crate::Communicator> {
        crate::testing::group_over(w, &|r, store| {
            Arc::new(TcpTransport::new(r, w, store, TcpOptions::default()).expect("tcp transport"))
        })
    }

    /// The core's conformance grid, ranks as threads over tcp.
    #[test]
    fn tcp_conformance_grid() {
        crate::testing::conformance_grid(&group, &crate::testing::GridConfig::default());
    }

    /// A quick probe of raw link latency and bandwidth (not a test of timing).
    #[test]
    #[ignore]
    fn tcp_probe_exchange() {
        suite::probe(&make, "tcp");
    }
}
