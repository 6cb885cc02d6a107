//! One replica of the replicated store on the network: the pure log of `raft.rs` driven by
//! the wall clock, its messages carried over TCP to the other replicas, and the clients'
//! operations and reads answered when this replica leads ([`ReplicatedStore`] is the
//! client). The launch agents run one each, so that the store outlives any one node.
//!
//! Every connection opens with a hello carrying the job token, compared in constant time
//! (STORE-1); a frame longer than the protocol allows closes the connection (STORE-2).
//!
//! [`ReplicatedStore`]: super::ReplicatedStore

use super::raft::{Command, Refusal, Replica, Role, Timing};
use super::replica_wire::{self as wire, Frame, CLIENT};
use super::StoreError;
use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One tick of the log's clock.
pub const TICK: Duration = Duration::from_millis(20);
/// The log's timing over [`TICK`]s: an election after 1 to 2 s of silence, heartbeats every
/// 100 ms, a lease of 600 ms (below the shortest election timeout, RSTORE-4).
pub const TIMING: Timing = Timing { election_min: 50, election_max: 100, heartbeat: 5, lease: 30 };
/// How long a connection to another replica may take.
const PEER_CONNECT: Duration = Duration::from_millis(300);
/// How long an unauthenticated connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a read waits on a leader that lost its lease before answering so.
const NO_LEASE_WAIT: Duration = Duration::from_secs(2);
/// How often server threads look at the stop flag.
const SERVER_TICK: Duration = Duration::from_millis(50);

struct Shared {
    core: Replica,
    /// Ticks delivered to the core since `State::t0`.
    ticks: u64,
    /// Results of committed requests whose clients wait here.
    results: HashMap<(u64, u64), super::raft::OpResult>,
    waiting: HashSet<(u64, u64)>,
}

struct State {
    shared: Mutex<Shared>,
    changed: Condvar,
    peers: Vec<Sender<super::raft::Message>>,
    token: Vec<u8>,
    stop: AtomicBool,
    id: usize,
    t0: Instant,
}

impl State {
    /// The core, its clock brought up to the wall clock first: a lease is checked, and a
    /// message's arrival dated, at the true time even when the clock thread was starved
    /// (RSTORE-4).
    fn lock(&self) -> MutexGuard<'_, Shared> {
        // The core is only changed by whole method calls; a panic leaves it consistent.
        let mut s = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        let due = (self.t0.elapsed().as_millis() / TICK.as_millis()) as u64;
        while s.ticks < due {
            s.core.tick();
            s.ticks += 1;
        }
        s
    }

    /// Sends the core's messages and records the results of waited-for requests.
    fn flush(&self, s: &mut Shared) {
        for (to, m) in s.core.take_outbox() {
            if let Some(tx) = self.peers.get(to) {
                let _ = tx.send(m);
            }
        }
        let mut any = false;
        for a in s.core.take_applied() {
            any = true;
            if s.waiting.contains(&(a.client, a.seq)) {
                s.results.insert((a.client, a.seq), a.result);
            }
        }
        if any {
            self.changed.notify_all();
        }
    }
}

/// What the agent of this replica's node needs to know of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// This replica leads and holds its lease (RSTORE-4).
    pub leads: bool,
    /// How long since it last heard from a leader, or since a majority last answered it
    /// while it led; `None` if neither ever happened.
    pub out_of_contact: Option<Duration>,
    /// Its term.
    pub term: u64,
}

/// A replica of the store, serving on background threads until dropped.
pub struct ReplicaServer {
    addr: SocketAddr,
    state: Arc<State>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl ReplicaServer {
    /// Starts replica `id` of the replicas at `addrs` (one `HOST:PORT` each), listening on
    /// `bind` (port 0 picks one), with the job `token`; `seed` draws election timeouts.
    /// `joining`: the others already serve the store and this replica starts without the
    /// state it may have had, so it votes only once caught up (RSTORE-6).
    pub fn start(
        id: usize,
        addrs: &[String],
        bind: impl ToSocketAddrs,
        token: &str,
        seed: u64,
        joining: bool,
    ) -> Result<ReplicaServer, StoreError> {
        if id >= addrs.len() {
            return Err(StoreError::Io(format!("replica {id} of {} replicas", addrs.len())));
        }
        let listener = TcpListener::bind(bind).map_err(|e| StoreError::Io(format!("bind: {e}")))?;
        let addr = listener.local_addr().map_err(|e| StoreError::Io(e.to_string()))?;
        listener.set_nonblocking(true).map_err(|e| StoreError::Io(e.to_string()))?;
        let n = addrs.len();
        let mut senders = Vec::with_capacity(n);
        let mut receivers = Vec::with_capacity(n);
        for _ in 0..n {
            let (tx, rx) = channel();
            senders.push(tx);
            receivers.push(rx);
        }
        let state = Arc::new(State {
            shared: Mutex::new(Shared {
                core: {
                    let r = Replica::new(id, n, TIMING, seed);
                    if joining {
                        r.as_learner()
                    } else {
                        r
                    }
                },
                ticks: 0,
                results: HashMap::new(),
                waiting: HashSet::new(),
            }),
            changed: Condvar::new(),
            peers: senders,
            token: token.as_bytes().to_vec(),
            stop: AtomicBool::new(false),
            id,
            t0: Instant::now(),
        });
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| StoreError::Io(format!("spawn: {e}")))
        };
        let mut threads = Vec::new();
        for (p, rx) in receivers.into_iter().enumerate() {
            if p == id {
                continue;
            }
            let (st, to) = (state.clone(), addrs[p].clone());
            threads
                .push(spawn(format!("replica-to-{p}"), Box::new(move || send_loop(&st, &to, rx)))?);
        }
        let st = state.clone();
        threads.push(spawn("replica-clock".into(), Box::new(move || clock_loop(&st)))?);
        let st = state.clone();
        threads.push(spawn("replica-accept".into(), Box::new(move || accept_loop(listener, st)))?);
        Ok(ReplicaServer { addr, state, threads })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether it leads, and how long it has been cut off from a majority.
    pub fn status(&self) -> ReplicaStatus {
        let s = self.state.lock();
        ReplicaStatus {
            leads: s.core.role() == Role::Leader && s.core.lease_holds(),
            out_of_contact: s.core.out_of_contact().map(|t| TICK * t as u32),
            term: s.core.term(),
        }
    }
}

impl Drop for ReplicaServer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        self.state.changed.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// Ticks the core at the wall clock's rate (so that leases hold in real time, RSTORE-4)
/// and sends what the ticks produced.
fn clock_loop(st: &State) {
    while !st.stop.load(Ordering::Relaxed) {
        {
            let mut s = st.lock();
            st.flush(&mut s);
        }
        std::thread::sleep(TICK / 4);
    }
}

/// Carries messages to replica `to`: a message that cannot be sent now is dropped, as the
/// log tolerates.
fn send_loop(st: &State, to: &str, rx: Receiver<super::raft::Message>) {
    let mut conn: Option<TcpStream> = None;
    let mut last_try: Option<Instant> = None;
    while !st.stop.load(Ordering::Relaxed) {
        let Ok(m) = rx.recv_timeout(SERVER_TICK) else { continue };
        let mut batch = vec![m];
        batch.extend(rx.try_iter());
        if conn.is_none() && last_try.is_none_or(|t| t.elapsed() >= PEER_CONNECT) {
            last_try = Some(Instant::now());
            conn = connect(to, st.id as u64, &st.token, PEER_CONNECT).ok();
        }
        let Some(c) = conn.as_mut() else { continue };
        for m in batch {
            if wire::write(c, &Frame::Raft(m)).is_err() {
                conn = None;
                break;
            }
        }
    }
}

/// Connects to a replica and says hello as `who`.
pub(super) fn connect(
    addr: &str,
    who: u64,
    token: &[u8],
    timeout: Duration,
) -> Result<TcpStream, StoreError> {
    let io = |e: std::io::Error| StoreError::Io(format!("{addr}: {e}"));
    let target = addr
        .to_socket_addrs()
        .map_err(io)?
        .next()
        .ok_or_else(|| StoreError::Io(format!("{addr}: no address")))?;
    let mut s = TcpStream::connect_timeout(&target, timeout).map_err(io)?;
    s.set_nodelay(true).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    wire::write(&mut s, &Frame::Hello { token: token.to_vec(), who }).map_err(io)?;
    match wire::read(&mut s) {
        Ok(Frame::Welcome) => Ok(s),
        Ok(Frame::Refused(why)) => Err(StoreError::Refused(why)),
        Ok(f) => Err(StoreError::Io(format!("{addr}: unexpected reply to hello: {f:?}"))),
        Err(e) => Err(StoreError::Io(format!("{addr}: hello: {e}"))),
    }
}

fn accept_loop(listener: TcpListener, st: Arc<State>) {
    while !st.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((s, peer)) => {
                let st = st.clone();
                let spawned = std::thread::Builder::new()
                    .name("replica-conn".into())
                    .spawn(move || serve(s, peer, &st));
                if let Err(e) = spawned {
                    tracing::warn!("replica: cannot serve {peer}: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                tracing::warn!("replica: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Reads a frame, waking every [`SERVER_TICK`] to notice a stop; `None` ends the
/// connection.
fn next_frame(s: &mut TcpStream, st: &State) -> Option<Frame> {
    // A frame is read whole once its first byte came: peek with the short timeout first.
    let mut b = [0u8; 1];
    loop {
        if st.stop.load(Ordering::Relaxed) {
            return None;
        }
        match s.peek(&mut b) {
            Ok(0) => return None,
            Ok(_) => break,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return None,
        }
    }
    let _ = s.set_read_timeout(Some(HELLO_TIMEOUT));
    let f = wire::read(s);
    let _ = s.set_read_timeout(Some(SERVER_TICK));
    match f {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!("replica: dropping a connection: {e}");
            None
        }
    }
}

fn serve(mut s: TcpStream, peer: SocketAddr, st: &State) {
    if s.set_nonblocking(false).is_err()
        || s.set_nodelay(true).is_err()
        || s.set_read_timeout(Some(HELLO_TIMEOUT)).is_err()
    {
        return;
    }
    // STORE-1: nothing but a hello with the token is read before authentication.
    let who = match wire::read(&mut s) {
        Ok(Frame::Hello { token, who }) if super::tcp::ct_eq(&token, &st.token) => who,
        Ok(_) => {
            tracing::warn!("replica: refused {peer}: bad job token");
            let _ = wire::write(&mut s, &Frame::Refused("bad job token".into()));
            return;
        }
        Err(e) => {
            tracing::warn!("replica: refused {peer}: {e}");
            let _ = wire::write(&mut s, &Frame::Refused("not a hello".into()));
            return;
        }
    };
    if wire::write(&mut s, &Frame::Welcome).is_err()
        || s.set_read_timeout(Some(SERVER_TICK)).is_err()
    {
        return;
    }
    while let Some(f) = next_frame(&mut s, st) {
        let reply = match (who, f) {
            (from, Frame::Raft(m)) if from != CLIENT => {
                let mut g = st.lock();
                g.core.step(from as usize, m);
                st.flush(&mut g);
                continue;
            }
            (CLIENT, Frame::Propose { cmd, wait_ms }) => propose(st, cmd, wait_ms),
            (CLIENT, Frame::Get { key, wait_ms }) => get(st, &key, wait_ms),
            (_, f) => {
                tracing::warn!("replica: dropping {peer}: unexpected {f:?}");
                return;
            }
        };
        if wire::write(&mut s, &reply).is_err() {
            return;
        }
    }
}

fn not_leader(r: Refusal) -> Frame {
    match r {
        Refusal::NotLeader(h) => Frame::NotLeader(h.map(|h| h as u64)),
        Refusal::NoLease => Frame::Unavailable("the leader holds no lease".into()),
    }
}

/// Appends a client's operation and waits until it is applied, this replica stops leading,
/// or `wait_ms` passes.
fn propose(st: &State, cmd: Command, wait_ms: u64) -> Frame {
    let key = (cmd.client, cmd.seq);
    let deadline = Instant::now() + Duration::from_millis(wait_ms);
    let mut s = st.lock();
    let term = s.core.term();
    if let Err(r) = s.core.propose(cmd) {
        return not_leader(r);
    }
    s.waiting.insert(key);
    st.flush(&mut s);
    let reply = loop {
        if let Some(r) = s.results.remove(&key) {
            break Frame::Result(r);
        }
        if s.core.role() != Role::Leader || s.core.term() != term {
            break Frame::NotLeader(s.core.leader().map(|h| h as u64));
        }
        let now = Instant::now();
        if now >= deadline || st.stop.load(Ordering::Relaxed) {
            break Frame::Unavailable(format!(
                "not committed within {wait_ms} ms: no majority of the replicas answers"
            ));
        }
        let slice = (deadline - now).min(SERVER_TICK);
        drop(st.changed.wait_timeout(s, slice).unwrap_or_else(|e| e.into_inner()).0);
        s = st.lock();
    };
    s.waiting.remove(&key);
    reply
}

/// Reads `key` on the leader under its lease, waiting up to `wait_ms` for it to be set.
fn get(st: &State, key: &str, wait_ms: u64) -> Frame {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(wait_ms);
    let mut s = st.lock();
    loop {
        let refusal = match s.core.read(key) {
            Ok(Some(v)) => return Frame::Value(v),
            Ok(None) => None,
            Err(Refusal::NotLeader(h)) => return not_leader(Refusal::NotLeader(h)),
            Err(r) => Some(r),
        };
        let now = Instant::now();
        // A leader without its lease for this long is likely cut off: the client had
        // better try the others than wait out its whole wait here.
        let lost = refusal.is_some() && now - t0 >= NO_LEASE_WAIT;
        if now >= deadline || lost || st.stop.load(Ordering::Relaxed) {
            return refusal.map_or(Frame::Unset, not_leader);
        }
        let slice = (deadline - now).min(SERVER_TICK);
        drop(st.changed.wait_timeout(s, slice).unwrap_or_else(|e| e.into_inner()).0);
        s = st.lock();
    }
}
