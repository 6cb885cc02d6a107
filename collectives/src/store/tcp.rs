//! Shardline's own TCP store: a server that serves processes and nodes of a job, and its
//! client. Only peers presenting the job token are served.
//!
//! Wire protocol: every frame is a 16-byte header (magic `SLST`, version `u16`, kind `u16`,
//! key length `u32`, value length `u32`, little-endian) followed by the key and the value.
//! The client's first frame is a hello whose value is the job token.
//!
//! Invariants (cited by the tests):
//! - STORE-1: a connection is served only after a hello carrying the job token; tokens are
//!   compared in constant time; a refused peer is logged with its address and gets `Refused`.
//! - STORE-2: a frame whose key exceeds [`MAX_KEY_BYTES`] or whose value exceeds
//!   [`MAX_VALUE_BYTES`], or that is not a frame of this protocol, is rejected before anything
//!   is allocated for it, and closes the connection; the server keeps serving others.

use super::{MemInner, Store, StoreError};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Wire protocol of the TCP store
// ---------------------------------------------------------------------------------------------

const MAGIC: [u8; 4] = *b"SLST";
const VERSION: u16 = 1;
const HEADER_BYTES: usize = 16;
/// Longest key accepted on the wire (STORE-2).
pub const MAX_KEY_BYTES: usize = 256;
/// Longest value accepted on the wire (STORE-2).
pub const MAX_VALUE_BYTES: usize = 1 << 20;
/// How long an unauthenticated connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Poll period of server threads for the shutdown flag.
const SERVER_TICK: Duration = Duration::from_millis(100);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
enum Kind {
    Hello = 1,
    Set = 2,
    Get = 3,
    Add = 4,
    Ok = 16,
    Refused = 17,
    Timeout = 18,
    Error = 19,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Set,
            3 => Kind::Get,
            4 => Kind::Add,
            16 => Kind::Ok,
            17 => Kind::Refused,
            18 => Kind::Timeout,
            19 => Kind::Error,
            _ => return None,
        })
    }
}

struct Frame {
    kind: Kind,
    key: Vec<u8>,
    value: Vec<u8>,
}

fn encode_frame(kind: Kind, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_BYTES + key.len() + value.len());
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&(kind as u16).to_le_bytes());
    b.extend_from_slice(&(key.len() as u32).to_le_bytes());
    b.extend_from_slice(&(value.len() as u32).to_le_bytes());
    b.extend_from_slice(key);
    b.extend_from_slice(value);
    b
}

/// Why reading a frame failed.
enum ReadErr {
    /// The stream ended or failed.
    Io(std::io::Error),
    /// The bytes are not a frame of this protocol.
    Protocol(String),
    /// The server is shutting down.
    Shutdown,
}

/// Reads exactly `buf.len()` bytes, tolerating read timeouts (used to poll `stop`).
fn read_full(s: &mut TcpStream, buf: &mut [u8], stop: Option<&AtomicBool>) -> Result<(), ReadErr> {
    let mut done = 0;
    while done < buf.len() {
        match s.read(&mut buf[done..]) {
            Ok(0) => {
                return Err(ReadErr::Io(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) && stop.is_some() =>
            {
                if stop.is_some_and(|f| f.load(Ordering::Relaxed)) {
                    return Err(ReadErr::Shutdown);
                }
            }
            Err(e) => return Err(ReadErr::Io(e)),
        }
    }
    Ok(())
}

/// Reads one frame; lengths are checked against the caps before anything is allocated.
fn read_frame(s: &mut TcpStream, stop: Option<&AtomicBool>) -> Result<Frame, ReadErr> {
    let mut h = [0u8; HEADER_BYTES];
    read_full(s, &mut h, stop)?;
    if h[0..4] != MAGIC {
        return Err(ReadErr::Protocol("bad magic".into()));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(ReadErr::Protocol(format!("unsupported version {version}")));
    }
    let kind = Kind::from_u16(u16::from_le_bytes([h[6], h[7]]))
        .ok_or_else(|| ReadErr::Protocol("unknown frame kind".into()))?;
    let key_len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    let value_len = u32::from_le_bytes([h[12], h[13], h[14], h[15]]) as usize;
    if key_len > MAX_KEY_BYTES || value_len > MAX_VALUE_BYTES {
        return Err(ReadErr::Protocol(format!(
            "oversize frame (key {key_len} B, value {value_len} B)"
        )));
    }
    let mut key = vec![0u8; key_len];
    read_full(s, &mut key, stop)?;
    let mut value = vec![0u8; value_len];
    read_full(s, &mut value, stop)?;
    Ok(Frame { kind, key, value })
}

/// Compares two secrets in time that depends only on their lengths (STORE-1).
pub(super) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    // Keep the loop from being turned into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

// ---------------------------------------------------------------------------------------------
// TcpStoreServer
// ---------------------------------------------------------------------------------------------

/// Store server for ranks that are processes or on other nodes. Serves on background
/// threads; shuts down when dropped. Only connections presenting the job token are served.
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving.
    pub fn bind(addr: impl ToSocketAddrs, token: &str) -> Result<Self, StoreError> {
        let listener = TcpListener::bind(addr).map_err(|e| StoreError::Io(format!("bind: {e}")))?;
        let addr = listener.local_addr().map_err(|e| StoreError::Io(format!("local_addr: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| StoreError::Io(format!("set_nonblocking: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(MemInner::default());
        let token: Arc<[u8]> = Arc::from(token.as_bytes());
        let stop2 = stop.clone();
        let acceptor = std::thread::Builder::new()
            .name("store-accept".into())
            .spawn(move || accept_loop(listener, state, token, stop2))
            .map_err(|e| StoreError::Io(format!("spawn: {e}")))?;
        Ok(TcpStoreServer { addr, stop, acceptor: Some(acceptor) })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    state: Arc<MemInner>,
    token: Arc<[u8]>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let (state, token, stop) = (state.clone(), token.clone(), stop.clone());
                let spawned = std::thread::Builder::new()
                    .name("store-conn".into())
                    .spawn(move || serve_conn(stream, peer, &state, &token, &stop));
                if let Err(e) = spawned {
                    tracing::warn!("store: cannot serve {peer}: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                tracing::warn!("store: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn serve_conn(
    mut s: TcpStream,
    peer: SocketAddr,
    state: &MemInner,
    token: &[u8],
    stop: &AtomicBool,
) {
    // The accepted socket may inherit non-blocking mode from the listener.
    if s.set_nonblocking(false).is_err() || s.set_nodelay(true).is_err() {
        return;
    }
    // STORE-1: nothing but a hello with the right token is read before authentication, and
    // a slow or silent client is dropped after HELLO_TIMEOUT.
    if s.set_read_timeout(Some(HELLO_TIMEOUT)).is_err() {
        return;
    }
    let hello = match read_frame(&mut s, None) {
        Ok(f) => f,
        Err(ReadErr::Protocol(why)) => {
            tracing::warn!("store: refused {peer}: {why}");
            let _ = s.write_all(&encode_frame(Kind::Refused, b"", why.as_bytes()));
            return;
        }
        Err(_) => return,
    };
    if hello.kind != Kind::Hello || !ct_eq(&hello.value, token) {
        tracing::warn!("store: refused {peer}: bad job token");
        let _ = s.write_all(&encode_frame(Kind::Refused, b"", b"bad job token"));
        return;
    }
    if s.write_all(&encode_frame(Kind::Ok, b"", b"")).is_err() {
        return;
    }
    if s.set_read_timeout(Some(SERVER_TICK)).is_err() {
        return;
    }
    loop {
        let f = match read_frame(&mut s, Some(stop)) {
            Ok(f) => f,
            Err(ReadErr::Protocol(why)) => {
                tracing::warn!("store: dropping {peer}: {why}");
                let _ = s.write_all(&encode_frame(Kind::Error, b"", why.as_bytes()));
                return;
            }
            Err(_) => return,
        };
        let Ok(key) = std::str::from_utf8(&f.key) else {
            let _ = s.write_all(&encode_frame(Kind::Error, b"", b"key is not utf-8"));
            return;
        };
        let reply = match f.kind {
            Kind::Set => {
                state.set(key, &f.value);
                encode_frame(Kind::Ok, b"", b"")
            }
            Kind::Get => {
                let ms = f
                    .value
                    .get(..8)
                    .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                    .unwrap_or(0);
                // Waits in slices so that a shutdown is noticed.
                let end = Instant::now() + Duration::from_millis(ms);
                loop {
                    let slice = end.saturating_duration_since(Instant::now()).min(SERVER_TICK);
                    match state.get(key, slice) {
                        Ok(v) => break encode_frame(Kind::Ok, b"", &v),
                        Err(_) if Instant::now() < end && !stop.load(Ordering::Relaxed) => {}
                        Err(_) => break encode_frame(Kind::Timeout, b"", b""),
                    }
                }
            }
            Kind::Add => match f.value.get(..8) {
                Some(b) => {
                    let delta = i64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
                    match state.add(key, delta) {
                        Ok(v) => encode_frame(Kind::Ok, b"", &v.to_le_bytes()),
                        Err(e) => encode_frame(Kind::Error, b"", e.to_string().as_bytes()),
                    }
                }
                None => encode_frame(Kind::Error, b"", b"add needs 8 bytes"),
            },
            _ => {
                tracing::warn!("store: dropping {peer}: unexpected frame {:?}", f.kind);
                let _ = s.write_all(&encode_frame(Kind::Error, b"", b"unexpected frame"));
                return;
            }
        };
        if s.write_all(&reply).is_err() {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// TcpStoreClient
// ---------------------------------------------------------------------------------------------

/// Client of a [`TcpStoreServer`]. Requests from several threads are serialized.
pub struct TcpStoreClient {
    conn: Mutex<TcpStream>,
    timeout: Duration,
}

impl TcpStoreClient {
    /// Connects to `addr` and authenticates with `token`; `timeout` bounds the connection
    /// and every request other than `get` (which waits as long as asked, plus `timeout`).
    pub fn connect(
        addr: impl ToSocketAddrs,
        token: &str,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        // The server may still be starting: retry until the deadline.
        let (mut s, _) = super::connect_until(addr, Instant::now() + timeout, "")?;
        let io = |e: std::io::Error| StoreError::Io(e.to_string());
        s.set_nodelay(true).map_err(io)?;
        s.set_read_timeout(Some(timeout.max(Duration::from_millis(1)))).map_err(io)?;
        s.write_all(&encode_frame(Kind::Hello, b"", token.as_bytes())).map_err(io)?;
        let reply = read_reply(&mut s, timeout.max(Duration::from_millis(1)))?;
        match reply.kind {
            Kind::Ok => {}
            Kind::Refused => {
                return Err(StoreError::Refused(String::from_utf8_lossy(&reply.value).into_owned()))
            }
            k => return Err(StoreError::Io(format!("unexpected reply {k:?} to hello"))),
        }
        Ok(TcpStoreClient { conn: Mutex::new(s), timeout })
    }

    /// Bounds every later request other than `get` (and a `get`'s slack beyond its own
    /// wait) by `t`: a client that connected with a long rendezvous deadline need not wait
    /// that long for a store it can no longer reach.
    pub fn set_request_timeout(&mut self, t: Duration) {
        self.timeout = t;
    }

    fn request(
        &self,
        kind: Kind,
        key: &str,
        value: &[u8],
        wait: Duration,
    ) -> Result<Frame, StoreError> {
        if key.len() > MAX_KEY_BYTES || value.len() > MAX_VALUE_BYTES {
            return Err(StoreError::Io(format!(
                "key or value too long ({} B, {} B)",
                key.len(),
                value.len()
            )));
        }
        let mut s = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let limit = self.timeout.max(Duration::from_millis(1));
        let io = |e: std::io::Error| StoreError::Io(e.to_string());
        s.set_read_timeout(Some(limit + wait)).map_err(io)?;
        s.set_write_timeout(Some(limit)).map_err(io)?;
        let sent = s.write_all(&encode_frame(kind, key.as_bytes(), value)).map_err(|e| {
            let why = timed_out(&e, limit).unwrap_or_else(|| e.to_string());
            StoreError::Io(format!("sending a request: {why}"))
        });
        let reply = sent.and_then(|_| read_reply(&mut s, limit + wait));
        if reply.is_err() {
            // A request left half-way (a reply may still come) would pair the next request
            // with this one's reply: the connection is closed, and later requests fail.
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let reply = reply?;
        match reply.kind {
            Kind::Ok | Kind::Timeout => Ok(reply),
            Kind::Refused => {
                Err(StoreError::Refused(String::from_utf8_lossy(&reply.value).into_owned()))
            }
            _ => Err(StoreError::Io(String::from_utf8_lossy(&reply.value).into_owned())),
        }
    }
}

/// "timeout: no reply within `limit`" for a socket timeout (which the OS reports as
/// `WouldBlock` or `TimedOut`), None for any other error.
fn timed_out(e: &std::io::Error, limit: Duration) -> Option<String> {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
        .then(|| format!("timeout: the store did not answer within {limit:?}"))
}

fn read_reply(s: &mut TcpStream, limit: Duration) -> Result<Frame, StoreError> {
    read_frame(s, None).map_err(|e| match e {
        ReadErr::Io(e) => StoreError::Io(format!(
            "reading reply: {}",
            timed_out(&e, limit).unwrap_or_else(|| e.to_string())
        )),
        ReadErr::Protocol(why) => StoreError::Io(format!("bad reply: {why}")),
        ReadErr::Shutdown => StoreError::Io("shut down".into()),
    })
}

impl Store for TcpStoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.request(Kind::Set, key, value, Duration::ZERO).map(|_| ())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let reply = self.request(Kind::Get, key, &ms.to_le_bytes(), timeout)?;
        match reply.kind {
            Kind::Ok => Ok(reply.value),
            _ => Err(StoreError::Timeout { key: key.to_owned(), timeout }),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let reply = self.request(Kind::Add, key, &delta.to_le_bytes(), Duration::ZERO)?;
        let b: [u8; 8] = reply
            .value
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| StoreError::Io("short add reply".into()))?;
        Ok(i64::from_le_bytes(b))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::exercise;
    use super::*;

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn tcp_store_set_get_add_across_threads() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "tok").unwrap();
        let addr = server.addr();
        exercise(|| Arc::new(TcpStoreClient::connect(addr, "tok", T).unwrap()) as Arc<dyn Store>);
    }

    #[test]
    fn tcp_store_get_waits_for_a_later_set() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "tok").unwrap();
        let addr = server.addr();
        let waiter = std::thread::spawn(move || {
            let c = TcpStoreClient::connect(addr, "tok", T).unwrap();
            c.get("late", T)
        });
        std::thread::sleep(Duration::from_millis(30));
        let c = TcpStoreClient::connect(addr, "tok", T).unwrap();
        c.set("late", b"v").unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), b"v".to_vec());
    }

    /// STORE-1
    /// A store that answers the hello, then nothing: a request fails within its timeout with
    /// an error that says so, and the next one fails at once instead of reading a late
    /// reply to the first.
    #[test]
    fn silent_store_times_out_and_the_connection_is_dropped() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let _ = read_frame(&mut c, None);
            c.write_all(&encode_frame(Kind::Ok, b"", b"")).unwrap();
            // Read and hold requests without answering until the client gives up.
            let mut buf = [0u8; 1024];
            while matches!(c.read(&mut buf), Ok(n) if n > 0) {}
        });
        let mut client = TcpStoreClient::connect(addr, "tok", T).unwrap();
        client.set_request_timeout(Duration::from_millis(200));
        let t0 = std::time::Instant::now();
        let e = client.set("k", b"v").unwrap_err().to_string();
        assert!(e.contains("timeout"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
        // Failed on the closed connection, not by waiting out another timeout.
        let e2 = client.add("n", 1).unwrap_err().to_string();
        assert!(!e2.contains("timeout"), "{e2}");
        drop(client);
        server.join().unwrap();
    }

    #[test]
    fn bad_token_is_refused() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "secret").unwrap();
        for bad in ["secreT", "secret2", "", "s"] {
            match TcpStoreClient::connect(server.addr(), bad, T) {
                Err(StoreError::Refused(_)) => {}
                Err(e) => panic!("token {bad:?}: expected Refused, got {e}"),
                Ok(_) => panic!("token {bad:?} accepted"),
            }
        }
        // The server still serves a good client.
        let c = TcpStoreClient::connect(server.addr(), "secret", T).unwrap();
        c.set("a", b"1").unwrap();
        assert_eq!(c.get("a", T).unwrap(), b"1".to_vec());
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"abcd"));
    }

    /// Sends raw bytes and returns what the server answers before closing.
    fn raw(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let _ = s.write_all(bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        out
    }

    fn header(kind: u16, key_len: u32, value_len: u32) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&kind.to_le_bytes());
        b.extend_from_slice(&key_len.to_le_bytes());
        b.extend_from_slice(&value_len.to_le_bytes());
        b
    }

    /// STORE-1, STORE-2
    #[test]
    fn garbage_and_oversize_frames_are_rejected() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "tok").unwrap();
        let addr = server.addr();
        // Plain garbage, a short header, a wrong version.
        let garbage: Vec<u8> = (0..200u32).map(|i| (i * 37 + 11) as u8).collect();
        assert!(!raw(addr, &garbage).starts_with(&encode_frame(Kind::Ok, b"", b"")));
        assert!(raw(addr, b"SLS").is_empty());
        let mut wrong_version = header(1, 0, 3);
        wrong_version[4] = 9;
        wrong_version.extend_from_slice(b"tok");
        assert!(!raw(addr, &wrong_version).starts_with(&encode_frame(Kind::Ok, b"", b"")));
        // Oversize lengths in the hello: refused without waiting for 4 GiB to arrive.
        let reply = raw(addr, &header(1, u32::MAX, u32::MAX));
        assert_eq!(Kind::from_u16(u16::from_le_bytes([reply[6], reply[7]])), Some(Kind::Refused));
        // Oversize value after a good hello: the connection is dropped, nothing stored.
        let mut bytes = encode_frame(Kind::Hello, b"", b"tok");
        bytes.extend_from_slice(&header(2, 1, (MAX_VALUE_BYTES + 1) as u32));
        bytes.push(b'x');
        let reply = raw(addr, &bytes);
        assert!(reply.len() > HEADER_BYTES, "expected ok + error replies");
        // A set without a hello is not served.
        let reply = raw(addr, &encode_frame(Kind::Set, b"x", b"1"));
        assert_eq!(Kind::from_u16(u16::from_le_bytes([reply[6], reply[7]])), Some(Kind::Refused));
        let c = TcpStoreClient::connect(addr, "tok", T).unwrap();
        assert!(matches!(c.get("x", Duration::from_millis(20)), Err(StoreError::Timeout { .. })));
        c.set("y", b"2").unwrap();
        assert_eq!(c.get("y", T).unwrap(), b"2".to_vec());
    }
}
