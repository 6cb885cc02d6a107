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
//! - TCP-4: an exchange of at most [`SPIN_MAX_BYTES`] polls its sockets without sleeping for
//!   up to the lane's spin ([`SPIN_ENV`]; by default [`DEFAULT_SPIN`] while the job's ranks do
//!   not outnumber this process's cores, else none) before it waits in `poll(2)`: a small
//!   message then pays no wake-up, and a large transfer, which waits on the link far longer,
//!   never burns a core.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

use super::{LaneLinks, Poison, RecvOp, SendOp, Sink, Tag, Transport, TransportError};
use crate::store::{Store, StoreError};

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

/// Largest chunk (frame payload) of a message; also the striping unit.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Longest poison reason sent or accepted.
pub const MAX_POISON_REASON: usize = 1024;
/// Socket buffer size requested for every link.
pub const SOCKET_BUFFER_BYTES: usize = 4 << 20;
const SCRATCH_BYTES: usize = 256 << 10;
/// Bytes one receive reads before the exchange loop turns to the sends again.
const PULL_BUDGET_BYTES: usize = 1 << 20;
const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"SLTH");
const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"SLTF");
const VERSION: u16 = 1;
const HEADER_BYTES: usize = 64;
const HELLO_FIXED: usize = 4 + 2 + 2 + 16 + 8 + 4 + 4;
const MAX_LANE_NAME: usize = 256;
const KIND_DATA: u32 = 1;
const KIND_POISON: u32 = 2;
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
const POISON_BUDGET: Duration = Duration::from_millis(100);
const PEEK_PERIOD: Duration = Duration::from_millis(5);

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

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    if s.len() != 32 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len()
        && std::hint::black_box(a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y))) == 0
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
                format!("{addr} {}", hex(&nonce)).as_bytes(),
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
        let nonce = unhex(nonce).ok_or_else(bad)?;
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
        let mut hello = Vec::with_capacity(HELLO_FIXED + lane.len());
        hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&(lane.len() as u16).to_le_bytes());
        hello.extend_from_slice(&nonce);
        hello.extend_from_slice(&generation.to_le_bytes());
        hello.extend_from_slice(&(self.rank as u32).to_le_bytes());
        hello.extend_from_slice(&(idx as u32).to_le_bytes());
        hello.extend_from_slice(lane.as_bytes());
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
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    if u32_at(0) != HELLO_MAGIC {
        return Err("bad magic".into());
    }
    if u16::from_le_bytes([h[4], h[5]]) != VERSION {
        return Err("unsupported version".into());
    }
    let lane_len = u16::from_le_bytes([h[6], h[7]]) as usize;
    if !ct_eq(&h[8..24], nonce) {
        return Err("bad nonce".into());
    }
    let mut g = [0u8; 8];
    g.copy_from_slice(&h[24..32]);
    let generation = u64::from_le_bytes(g);
    let rank = u32_at(32) as usize;
    let idx = u32_at(36) as usize;
    if lane_len > MAX_LANE_NAME || rank >= world || idx >= sockets_per_peer {
        return Err(format!("bad hello (lane name {lane_len} B, rank {rank}, socket {idx})"));
    }
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
        Ok(Box::new(TcpLinks {
            rank: self.rank,
            peers,
            scratch: vec![0u32; SCRATCH_BYTES / 4],
            last_peek: Instant::now(),
            spin: lane_spin(self.world),
        }))
    }
}

/// One socket of a link, with the state of the frame it is writing.
struct Sock {
    stream: TcpStream,
    fd: RawFd,
    /// Header of the frame being written (for completing it on poison, TCP-3).
    tx_hdr: [u8; HEADER_BYTES],
    /// Bytes of the current frame written so far, and its total size (0: at a boundary).
    tx_written: usize,
    tx_total: usize,
}

struct PeerConn {
    socks: Vec<Sock>,
}

impl PeerConn {
    fn new(streams: Vec<TcpStream>) -> Self {
        PeerConn {
            socks: streams
                .into_iter()
                .map(|stream| Sock {
                    fd: stream.as_raw_fd(),
                    stream,
                    tx_hdr: [0; HEADER_BYTES],
                    tx_written: 0,
                    tx_total: 0,
                })
                .collect(),
        }
    }
}

/// One rank's TCP links on one lane.
struct TcpLinks {
    rank: usize,
    peers: Vec<Option<PeerConn>>,
    /// Receive buffer; u32-backed so that pieces handed to sinks are 4-byte aligned (TR-2).
    scratch: Vec<u32>,
    /// When idle sockets were last checked for a poison frame (at most every PEEK_PERIOD,
    /// so that small exchanges do not pay a syscall per idle peer).
    last_peek: Instant,
    /// How long a small exchange polls without sleeping (TCP-4).
    spin: Duration,
}

fn chunks_of(len: usize) -> usize {
    len.div_ceil(CHUNK_BYTES).max(1)
}

fn chunk_range(len: usize, j: usize) -> (usize, usize) {
    let off = j * CHUNK_BYTES;
    (off, (len - off).min(CHUNK_BYTES))
}

fn encode_header(kind: u32, tag: &Tag, msg_len: u64, offset: u64, n: u32) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&kind.to_le_bytes());
    h[8..40].copy_from_slice(&tag.encode());
    h[40..48].copy_from_slice(&msg_len.to_le_bytes());
    h[48..56].copy_from_slice(&offset.to_le_bytes());
    h[56..60].copy_from_slice(&n.to_le_bytes());
    let crc = crc32fast::hash(&h[0..60]);
    h[60..64].copy_from_slice(&crc.to_le_bytes());
    h
}

struct Header {
    kind: u32,
    tag: Tag,
    msg_len: u64,
    offset: u64,
    n: u32,
}

fn decode_header(h: &[u8; HEADER_BYTES], peer: usize) -> Result<Header, TransportError> {
    let corrupt = |detail: &str| TransportError::Corrupt { peer, detail: detail.to_owned() };
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let u64_at = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(a)
    };
    if u32_at(0) != FRAME_MAGIC {
        return Err(corrupt("bad frame magic"));
    }
    if u32_at(60) != crc32fast::hash(&h[0..60]) {
        return Err(corrupt("header crc mismatch"));
    }
    let mut tb = [0u8; Tag::WIRE_BYTES];
    tb.copy_from_slice(&h[8..40]);
    Ok(Header {
        kind: u32_at(4),
        tag: Tag::decode(&tb),
        msg_len: u64_at(40),
        offset: u64_at(48),
        n: u32_at(56),
    })
}

fn is_lost(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof | NotConnected
    )
}

fn link_err(peer: usize, e: std::io::Error) -> TransportError {
    if is_lost(&e) {
        TransportError::PeerLost { peer, detail: e.to_string() }
    } else {
        TransportError::Io { peer, detail: e.to_string() }
    }
}

/// `sendmsg` of up to two buffers, non-blocking and without SIGPIPE.
fn send2(fd: RawFd, a: &[u8], b: &[u8]) -> std::io::Result<usize> {
    let mut iov = [
        libc::iovec { iov_base: a.as_ptr() as *mut libc::c_void, iov_len: a.len() },
        libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() },
    ];
    let n_iov = if b.is_empty() { 1 } else { 2 };
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = n_iov as _;
    loop {
        // SAFETY: msg points at iovecs describing live buffers that outlive the call; the
        // kernel only reads them.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Non-blocking read; `Ok(None)` when nothing is available.
fn recv_some(fd: RawFd, buf: &mut [u8], flags: libc::c_int) -> std::io::Result<Option<usize>> {
    loop {
        // SAFETY: buf is a live, writable buffer of buf.len() bytes.
        let r = unsafe {
            libc::recv(
                fd,
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                flags | libc::MSG_DONTWAIT,
            )
        };
        if r >= 0 {
            return Ok(Some(r as usize));
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Progress of one send: per socket, the next chunk it carries.
struct SendState {
    next_chunk: Vec<usize>,
    done: bool,
}

/// Progress of one receive.
struct RecvState {
    chunk: usize,
    hdr: [u8; HEADER_BYTES],
    hdr_got: usize,
    /// Payload bytes of the current chunk received (delivered or carried).
    got: usize,
    /// Bytes received but not delivered yet (fewer than 4).
    carry: [u8; 4],
    carry_len: usize,
    /// Poison reason being read after a poison header.
    poison: Option<(usize, Vec<u8>)>,
    done: bool,
}

impl TcpLinks {
    fn conn(&self, p: usize) -> Result<&PeerConn, TransportError> {
        self.peers
            .get(p)
            .and_then(|c| c.as_ref())
            .ok_or_else(|| setup(format!("rank {} has no link to rank {p}", self.rank)))
    }

    fn push(
        conn: &mut PeerConn,
        peer: usize,
        tag: &Tag,
        data: &[u8],
        st: &mut SendState,
    ) -> Result<bool, TransportError> {
        let n_chunks = chunks_of(data.len());
        let spp = conn.socks.len();
        let mut moved = false;
        let mut all_done = true;
        for (s, sock) in conn.socks.iter_mut().enumerate() {
            loop {
                let j = st.next_chunk[s];
                if j >= n_chunks {
                    break;
                }
                let (off, n) = chunk_range(data.len(), j);
                if sock.tx_total == 0 {
                    sock.tx_hdr =
                        encode_header(KIND_DATA, tag, data.len() as u64, off as u64, n as u32);
                    sock.tx_total = HEADER_BYTES + n;
                    sock.tx_written = 0;
                }
                let w = sock.tx_written;
                let payload = &data[off..off + n];
                let r = if w < HEADER_BYTES {
                    send2(sock.fd, &sock.tx_hdr[w..], payload)
                } else {
                    send2(sock.fd, &payload[w - HEADER_BYTES..], &[])
                };
                match r {
                    Ok(k) => {
                        moved |= k > 0;
                        sock.tx_written += k;
                        if sock.tx_written == sock.tx_total {
                            sock.tx_total = 0;
                            sock.tx_written = 0;
                            st.next_chunk[s] += spp;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(link_err(peer, e)),
                }
            }
            all_done &= st.next_chunk[s] >= n_chunks;
        }
        st.done = all_done;
        Ok(moved)
    }

    fn pull(
        conn: &mut PeerConn,
        peer: usize,
        tag: &Tag,
        op: &mut RecvOp<'_>,
        st: &mut RecvState,
        scratch: &mut [u32],
    ) -> Result<bool, TransportError> {
        let n_chunks = chunks_of(op.len);
        let spp = conn.socks.len();
        let mut moved = false;
        let mut budget = PULL_BUDGET_BYTES;
        while !st.done {
            let fd = conn.socks[st.chunk % spp].fd;
            if let Some((want, reason)) = &mut st.poison {
                let have = reason.len();
                let mut buf = vec![0u8; *want - have];
                match recv_some(fd, &mut buf, 0).map_err(|e| link_err(peer, e))? {
                    None => return Ok(moved),
                    Some(0) => return Err(lost_eof(peer)),
                    Some(k) => reason.extend_from_slice(&buf[..k]),
                }
                if reason.len() == *want {
                    return Err(poisoned(reason));
                }
                continue;
            }
            if st.hdr_got < HEADER_BYTES {
                match recv_some(fd, &mut st.hdr[st.hdr_got..], 0).map_err(|e| link_err(peer, e))? {
                    None => return Ok(moved),
                    Some(0) => return Err(lost_eof(peer)),
                    Some(k) => {
                        st.hdr_got += k;
                        moved = true;
                    }
                }
                if st.hdr_got < HEADER_BYTES {
                    continue;
                }
                // TCP-2
                let h = decode_header(&st.hdr, peer)?;
                if h.kind == KIND_POISON {
                    let n = h.n as usize;
                    if !(4..=MAX_POISON_REASON + 4).contains(&n) {
                        return Err(TransportError::Corrupt {
                            peer,
                            detail: format!("poison frame of {n} B"),
                        });
                    }
                    st.poison = Some((n, Vec::with_capacity(n)));
                    continue;
                }
                if h.kind != KIND_DATA {
                    return Err(TransportError::Corrupt {
                        peer,
                        detail: format!("unknown frame kind {}", h.kind),
                    });
                }
                if h.tag != *tag {
                    return Err(TransportError::TagMismatch { peer, expected: *tag, got: h.tag });
                }
                if h.msg_len != op.len as u64 {
                    return Err(TransportError::LengthMismatch {
                        peer,
                        expected: op.len,
                        got: h.msg_len as usize,
                    });
                }
                let (off, n) = chunk_range(op.len, st.chunk);
                if h.offset != off as u64 || h.n as usize != n {
                    return Err(TransportError::Corrupt {
                        peer,
                        detail: format!(
                            "chunk at {} of {} B, expected {off} of {n} B",
                            h.offset, h.n
                        ),
                    });
                }
                st.got = 0;
            }
            let (off, n) = chunk_range(op.len, st.chunk);
            if st.got < n {
                // TR-6: a plain copy is read from the socket straight into its destination;
                // anything else through the scratch, handed on in whole f32s.
                let c = st.carry_len;
                let read = match &mut op.sink {
                    Sink::Copy(dst) => recv_some(fd, &mut dst[off + st.got..off + n], 0),
                    Sink::Fn(_) => {
                        let bytes: &mut [u8] = bytemuck::cast_slice_mut(scratch);
                        bytes[..c].copy_from_slice(&st.carry[..c]);
                        let room = (n - st.got).min(bytes.len() - c);
                        recv_some(fd, &mut bytes[c..c + room], 0)
                    }
                };
                let k = match read.map_err(|e| link_err(peer, e))? {
                    None => return Ok(moved),
                    Some(0) => return Err(lost_eof(peer)),
                    Some(k) => k,
                };
                moved = true;
                if let Sink::Fn(_) = op.sink {
                    let bytes: &[u8] = bytemuck::cast_slice(scratch);
                    let have = c + k;
                    let whole = have & !3;
                    if whole > 0 {
                        op.sink.put(off + st.got - c, &bytes[..whole]);
                    }
                    st.carry_len = have - whole;
                    st.carry[..st.carry_len].copy_from_slice(&bytes[whole..have]);
                }
                st.got += k;
                budget = budget.saturating_sub(k);
            }
            if st.got == n {
                st.chunk += 1;
                st.hdr_got = 0;
                st.got = 0;
                st.done = st.chunk >= n_chunks;
            }
            if budget == 0 {
                // Back to the exchange loop, so that this rank's own sends keep flowing.
                return Ok(moved);
            }
        }
        Ok(moved)
    }

    /// Reads a poison frame waiting at the head of an idle socket, if any.
    fn peek_poison(&mut self, active: &[bool]) -> Result<(), TransportError> {
        for (p, conn) in self.peers.iter().enumerate() {
            let Some(conn) = conn else { continue };
            if active[p] {
                continue;
            }
            for s in &conn.socks {
                let mut h = [0u8; HEADER_BYTES];
                if let Ok(Some(HEADER_BYTES)) = recv_some(s.fd, &mut h, libc::MSG_PEEK) {
                    let Ok(hd) = decode_header(&h, p) else { continue };
                    if hd.kind != KIND_POISON || hd.n as usize > MAX_POISON_REASON + 4 {
                        continue;
                    }
                    let mut buf = vec![0u8; HEADER_BYTES + hd.n as usize];
                    if let Ok(Some(k)) = recv_some(s.fd, &mut buf, libc::MSG_PEEK) {
                        if k == buf.len() {
                            return Err(poisoned(&buf[HEADER_BYTES..]));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

fn lost_eof(peer: usize) -> TransportError {
    TransportError::PeerLost { peer, detail: "connection closed (EOF)".into() }
}

fn poisoned(body: &[u8]) -> TransportError {
    let origin = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
    TransportError::Poisoned(Poison {
        origin,
        reason: String::from_utf8_lossy(&body[4..]).into_owned(),
    })
}

impl LaneLinks for TcpLinks {
    /// Every byte sent is read by this rank's CPU (the kernel copies it into the socket), so
    /// a shard read once per piece from memory and sent from the cache to every peer costs
    /// less than one read per peer; the own copy of an out-of-place gather reads it from the
    /// cache too. W=2, 64 MiB, 2 cores: 2.98-3.27 GB/s busbw against 2.30-2.48 for the ring
    /// with the own copy first; W=4: 1.46 against 1.31-1.38 (RESULTS.md, "TCP all-gather in
    /// pieces").
    fn prefers_pieced_gather(&self) -> bool {
        true
    }

    fn exchange(
        &mut self,
        tag: Tag,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError> {
        let world = self.peers.len();
        let mut active = vec![false; world];
        for p in sends.iter().map(|s| s.peer).chain(recvs.iter().map(|r| r.peer)) {
            self.conn(p)?;
            active[p] = true;
        }
        let mut send_st: Vec<SendState> = sends
            .iter()
            .map(|s| SendState {
                next_chunk: (0..self.peers[s.peer].as_ref().map_or(1, |c| c.socks.len())).collect(),
                done: false,
            })
            .collect();
        let mut recv_st: Vec<RecvState> = recvs
            .iter()
            .map(|_| RecvState {
                chunk: 0,
                hdr: [0; HEADER_BYTES],
                hdr_got: 0,
                got: 0,
                carry: [0; 4],
                carry_len: 0,
                poison: None,
                done: false,
            })
            .collect();
        if self.last_peek.elapsed() >= PEEK_PERIOD {
            self.last_peek = Instant::now();
            self.peek_poison(&active)?;
        }
        let mut busy = vec![false; world];
        let mut pfds: Vec<libc::pollfd> = Vec::new();
        let mut waiting: Vec<usize> = Vec::new();
        let bytes: usize = sends.iter().map(|s| s.data.len()).sum::<usize>()
            + recvs.iter().map(|r| r.len).sum::<usize>();
        let spin_until =
            (bytes <= SPIN_MAX_BYTES && !self.spin.is_zero()).then(|| Instant::now() + self.spin);
        loop {
            let mut moved = false;
            pfds.clear();
            waiting.clear();
            busy.iter_mut().for_each(|b| *b = false);
            // Several messages to one peer in one step go in list order (TR-1).
            for (op, st) in sends.iter().zip(send_st.iter_mut()) {
                if st.done || busy[op.peer] {
                    continue;
                }
                busy[op.peer] = true;
                let conn = self.peers[op.peer].as_mut().ok_or_else(|| setup("no link"))?;
                moved |= Self::push(conn, op.peer, &tag, op.data, st)?;
                if !st.done {
                    waiting.push(op.peer);
                    for (s, sock) in conn.socks.iter().enumerate() {
                        if st.next_chunk[s] < chunks_of(op.data.len()) {
                            pfds.push(libc::pollfd {
                                fd: sock.fd,
                                events: libc::POLLOUT,
                                revents: 0,
                            });
                        }
                    }
                }
            }
            busy.iter_mut().for_each(|b| *b = false);
            for (op, st) in recvs.iter_mut().zip(recv_st.iter_mut()) {
                if st.done || busy[op.peer] {
                    continue;
                }
                busy[op.peer] = true;
                let p = op.peer;
                let conn = self.peers[p].as_mut().ok_or_else(|| setup("no link"))?;
                moved |= Self::pull(conn, p, &tag, op, st, &mut self.scratch)?;
                if !st.done {
                    waiting.insert(0, p);
                    pfds.push(libc::pollfd {
                        fd: conn.socks[st.chunk % conn.socks.len()].fd,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
            }
            let pending = send_st.iter().any(|s| !s.done) || recv_st.iter().any(|r| !r.done);
            if !pending {
                return Ok(());
            }
            if moved {
                continue;
            }
            if cancel.load(Ordering::Relaxed) {
                return Err(TransportError::Cancelled);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout {
                    peer: waiting.first().copied().unwrap_or(self.rank),
                });
            }
            if now.duration_since(self.last_peek) >= PEEK_PERIOD {
                self.last_peek = now;
                self.peek_poison(&active)?;
            }
            // Short waits keep the cancel flag and idle sockets (poison) observed; a small
            // exchange does not sleep within its spin (TCP-4).
            let ms = if spin_until.is_some_and(|t| now < t) {
                0
            } else {
                deadline.saturating_duration_since(now).as_millis().clamp(1, 2) as libc::c_int
            };
            // SAFETY: pfds is a live array of pfds.len() pollfds.
            let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(TransportError::Io {
                        peer: waiting.first().copied().unwrap_or(self.rank),
                        detail: format!("poll: {e}"),
                    });
                }
            }
        }
    }

    fn poison(&mut self, poison: &Poison) {
        let mut reason = poison.reason.as_bytes();
        if reason.len() > MAX_POISON_REASON {
            let mut n = MAX_POISON_REASON;
            while !poison.reason.is_char_boundary(n) {
                n -= 1;
            }
            reason = &reason[..n];
        }
        let mut body = (poison.origin as u32).to_le_bytes().to_vec();
        body.extend_from_slice(reason);
        let hdr = encode_header(KIND_POISON, &Tag::default(), 0, 0, body.len() as u32);
        let end = Instant::now() + POISON_BUDGET;
        for sock in self.peers.iter_mut().flatten().flat_map(|c| c.socks.iter_mut()) {
            // TCP-3: finish a half-written frame first.
            let zeros = vec![0u8; 64 << 10];
            let mut ok = true;
            while ok && sock.tx_total > 0 {
                let w = sock.tx_written;
                let r = if w < HEADER_BYTES {
                    send2(sock.fd, &sock.tx_hdr[w..], &[])
                } else {
                    let left = (sock.tx_total - w).min(zeros.len());
                    send2(sock.fd, &zeros[..left], &[])
                };
                match r {
                    Ok(k) => {
                        sock.tx_written += k;
                        if sock.tx_written == sock.tx_total {
                            sock.tx_total = 0;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        ok = Instant::now() < end;
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    Err(_) => ok = false,
                }
            }
            let mut frame = hdr.to_vec();
            frame.extend_from_slice(&body);
            let mut sent = 0;
            while ok && sent < frame.len() {
                match send2(sock.fd, &frame[sent..], &[]) {
                    Ok(k) => sent += k,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        ok = Instant::now() < end;
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    Err(_) => ok = false,
                }
            }
            if !ok {
                // The peer sees EOF instead of a torn frame.
                let _ = sock.stream.shutdown(Shutdown::Both);
            }
        }
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
        if std::env::var(CONGESTION_ENV).is_ok() {
            eprintln!("skipped the congestion check: {CONGESTION_ENV} is set");
        } else if !offered.split_whitespace().any(|a| a == DEFAULT_CONGESTION) {
            eprintln!(
                "skipped the congestion check: this kernel does not allow cubic ({offered:?})"
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
            println!("SKIPPED small_exchanges_spin_while_ranks_have_cores: {SPIN_ENV} is set");
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
        let mut hello = HELLO_MAGIC.to_le_bytes().to_vec();
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&1u16.to_le_bytes());
        hello.extend_from_slice(&[7u8; 16]);
        hello.extend_from_slice(&1u64.to_le_bytes());
        hello.extend_from_slice(&0u32.to_le_bytes());
        hello.extend_from_slice(&0u32.to_le_bytes());
        hello.extend_from_slice(b"l");
        s.write_all(&hello).unwrap();
        let r = t1.open_lane("l", Instant::now() + Duration::from_millis(300));
        assert!(matches!(r, Err(TransportError::Timeout { peer: 0 })));
    }

    #[test]
    fn header_roundtrip_and_crc() {
        let t = suite::tag(5);
        let h = encode_header(KIND_DATA, &t, 100, 8, 92);
        let d = decode_header(&h, 1).unwrap();
        assert_eq!((d.kind, d.tag, d.msg_len, d.offset, d.n), (KIND_DATA, t, 100, 8, 92));
        let mut bad = h;
        bad[50] ^= 1;
        assert!(matches!(decode_header(&bad, 1), Err(TransportError::Corrupt { peer: 1, .. })));
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
