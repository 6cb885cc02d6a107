//! Client of PyTorch's c10d `TCPStore`: the store a torchrun agent serves on `MASTER_PORT`
//! (and a c10d rendezvous endpoint serves across nodes). Workers of a torchrun job meet
//! through it instead of binding a store of their own on a port that is already taken.
//!
//! Wire format, as recorded from torch 2.15's own client and server in
//! `collectives/tests/fixtures/torch_store/transcript.json` (`record.py` next to it makes it
//! again): a request is a one-byte query type followed by its arguments; a string or byte
//! array is a `u64` length and the bytes; integers are native-endian (little-endian on every
//! target this builds for, checked below). Keys carry torch's `/` prefix on the wire, so a
//! torch client sees our keys under the same names.
//!
//! | query | request after the type byte | reply |
//! |---|---|---|
//! | VALIDATE 0 | `u32` magic `0x3C85F7CE` | none |
//! | SET 1 | key, value | none |
//! | COMPARE_SET 2 | key, expected, desired | the value now stored |
//! | GET 3 | key (present: the client waits for it first) | value |
//! | ADD 4 | key, `i64` delta | `i64` sum (stored as decimal text) |
//! | CHECK 5 | `u64` n, n keys | `u8` 0 ready, 1 not ready |
//! | WAIT 6 | `u64` n, n keys | `u8` 0 once all are set |
//! | CANCEL_WAIT 12 | nothing | `u8` 1 (after a late 0, if the wait ended meanwhile) |
//! | PING 13 | `u32` nonce | the nonce |
//!
//! Invariants (cited by the tests):
//! - STORE-3: the client sends the recorded bytes for the recorded operations and reads the
//!   recorded replies as torch's client does (the transcript is replayed in CI).
//! - STORE-4: a request is never paired with another's reply: a wait that times out is
//!   cancelled and the server's answers to it consumed before the timeout is returned, and a
//!   request that fails half-way closes the connection (later requests then fail).
//! - STORE-5: replies are bounded before allocation: a value longer than
//!   [`MAX_REPLY_BYTES`] fails the request and closes the connection.

use super::{Store, StoreError};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

// The protocol sends integers in the host's byte order; every target we build for is
// little-endian, which is what `to_le_bytes` below writes.
#[cfg(not(target_endian = "little"))]
compile_error!("the torch TCPStore client assumes a little-endian host");

/// `validationMagicNumber` of torch's TCPStore.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// Longest value a reply may carry (STORE-5).
pub const MAX_REPLY_BYTES: u64 = 64 << 20;

/// Query types of torch's TCPStore (`QueryType` in `TCPStoreBackend.hpp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Query {
    /// First message of a connection: the magic number.
    Validate = 0,
    /// Sets a key.
    Set = 1,
    /// Compare-and-set.
    CompareSet = 2,
    /// Reads a key.
    Get = 3,
    /// Adds to an integer key.
    Add = 4,
    /// Whether keys are set, without waiting.
    Check = 5,
    /// Waits until keys are set.
    Wait = 6,
    /// Cancels the connection's pending wait.
    CancelWait = 12,
    /// Echoes a nonce.
    Ping = 13,
}

/// `WaitResponseType::STOP_WAITING`.
const STOP_WAITING: u8 = 0;
/// `WaitResponseType::WAIT_CANCELED`.
const WAIT_CANCELED: u8 = 1;
/// `CheckResponseType::READY`.
const READY: u8 = 0;

/// A request being built: the query type and its arguments in wire order.
pub struct Request(Vec<u8>);

impl Request {
    /// A request of type `q`.
    pub fn new(q: Query) -> Self {
        Request(vec![q as u8])
    }

    /// Appends a length-prefixed byte string.
    pub fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }

    /// Appends a key, with torch's `/` prefix.
    pub fn key(self, k: &str) -> Self {
        let mut full = Vec::with_capacity(k.len() + 1);
        full.push(b'/');
        full.extend_from_slice(k.as_bytes());
        self.bytes(&full)
    }

    /// Appends a count then the keys.
    pub fn keys(mut self, keys: &[&str]) -> Self {
        self.0.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        keys.iter().fold(self, |r, k| r.key(k))
    }

    /// Appends a `u32`.
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends an `i64`.
    pub fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// The encoded bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

/// Client of a torch `TCPStore` server. Requests from several threads are serialized on one
/// connection, as torch's own client does.
pub struct TorchStoreClient {
    /// `None` once a request failed half-way (STORE-4).
    conn: Mutex<Option<TcpStream>>,
    addr: SocketAddr,
    timeout: Duration,
}

fn io(what: &str) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |e| {
        let why =
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                "no answer in time".to_owned()
            } else {
                e.to_string()
            };
        StoreError::Io(format!("torch store: {what}: {why}"))
    }
}

fn read_array<const N: usize>(s: &mut TcpStream, what: &str) -> Result<[u8; N], StoreError> {
    let mut b = [0u8; N];
    s.read_exact(&mut b).map_err(io(what))?;
    Ok(b)
}

fn read_value(s: &mut TcpStream, what: &str) -> Result<Vec<u8>, StoreError> {
    let n = u64::from_le_bytes(read_array(s, what)?);
    if n > MAX_REPLY_BYTES {
        return Err(StoreError::Io(format!(
            "torch store: {what}: a reply of {n} bytes (more than {MAX_REPLY_BYTES})"
        )));
    }
    let mut v = vec![0u8; n as usize];
    s.read_exact(&mut v).map_err(io(what))?;
    Ok(v)
}

impl TorchStoreClient {
    /// Connects to the torch store at `addr` (retrying until `timeout` while it starts),
    /// validates the connection and checks it with a ping, as torch's client does. `timeout`
    /// also bounds every later request other than a wait.
    pub fn connect(addr: impl ToSocketAddrs, timeout: Duration) -> Result<Self, StoreError> {
        let (mut s, addr) = super::connect_until(addr, Instant::now() + timeout, "torch store: ")?;
        let limit = timeout.max(Duration::from_millis(1));
        s.set_nodelay(true).map_err(io("connect"))?;
        s.set_read_timeout(Some(limit)).map_err(io("connect"))?;
        s.set_write_timeout(Some(limit)).map_err(io("connect"))?;
        // torch's client pings with its pid: any nonce works, the server echoes it.
        let nonce = std::process::id();
        let mut hello = Request::new(Query::Validate).u32(VALIDATION_MAGIC).into_bytes();
        hello.extend(Request::new(Query::Ping).u32(nonce).into_bytes());
        s.write_all(&hello).map_err(io("validate"))?;
        let echo = u32::from_le_bytes(read_array(&mut s, "ping").map_err(|e| match e {
            StoreError::Io(m) => StoreError::Io(format!(
                "{m} (is {addr} a torch TCPStore? torchrun serves one on MASTER_PORT)"
            )),
            e => e,
        })?);
        if echo != nonce {
            return Err(StoreError::Io(format!(
                "torch store: ping answered {echo:#x}, not the nonce {nonce:#x}: not a torch TCPStore at {addr}"
            )));
        }
        Ok(TorchStoreClient { conn: Mutex::new(Some(s)), addr, timeout: limit })
    }

    /// The store's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Runs `f` on the connection; closes it when `f` fails (STORE-4).
    fn with_conn<R>(
        &self,
        f: impl FnOnce(&mut TcpStream) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let mut guard = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let s = guard.as_mut().ok_or_else(|| {
            StoreError::Io(format!(
                "torch store at {}: connection closed after an earlier failure",
                self.addr
            ))
        })?;
        s.set_read_timeout(Some(self.timeout)).map_err(io("configure"))?;
        let r = f(s);
        if matches!(r, Err(StoreError::Io(_))) {
            let _ = s.shutdown(std::net::Shutdown::Both);
            *guard = None;
        }
        r
    }

    fn send(s: &mut TcpStream, r: Request, what: &str) -> Result<(), StoreError> {
        s.write_all(&r.into_bytes()).map_err(io(what))
    }

    /// WAIT for `keys` up to `timeout`, then CANCEL_WAIT (STORE-4). On the connection `s`.
    fn wait_on(
        &self,
        s: &mut TcpStream,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<(), StoreError> {
        Self::send(s, Request::new(Query::Wait).keys(keys), "wait")?;
        s.set_read_timeout(Some(timeout.max(Duration::from_millis(1)))).map_err(io("wait"))?;
        let mut b = [0u8; 1];
        match s.read_exact(&mut b) {
            Ok(()) if b[0] == STOP_WAITING => return Ok(()),
            Ok(()) => {
                return Err(StoreError::Io(format!("torch store: wait answered {}", b[0])));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(io("wait")(e)),
        }
        // Timed out: cancel, then read the answers until WAIT_CANCELED (a STOP_WAITING may
        // come first when the keys were set meanwhile).
        s.set_read_timeout(Some(self.timeout)).map_err(io("cancel wait"))?;
        Self::send(s, Request::new(Query::CancelWait), "cancel wait")?;
        let mut first = read_array::<1>(s, "cancel wait")?[0];
        if first == STOP_WAITING {
            first = read_array::<1>(s, "cancel wait")?[0];
        }
        if first != WAIT_CANCELED {
            return Err(StoreError::Io(format!("torch store: cancel wait answered {first}")));
        }
        Err(StoreError::Timeout { key: keys.join(","), timeout })
    }

    /// Waits until every key of `keys` is set, up to `timeout`.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.with_conn(|s| self.wait_on(s, keys, timeout))
    }

    /// Whether every key of `keys` is set, without waiting.
    pub fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.with_conn(|s| {
            Self::send(s, Request::new(Query::Check).keys(keys), "check")?;
            Ok(read_array::<1>(s, "check")?[0] == READY)
        })
    }

    /// Sets `key` to `desired` if it holds `expected` (or is absent and `expected` is empty);
    /// returns the value the key holds afterwards (torch's semantics).
    pub fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.with_conn(|s| {
            let r = Request::new(Query::CompareSet).key(key).bytes(expected).bytes(desired);
            Self::send(s, r, "compare_set")?;
            read_value(s, "compare_set")
        })
    }
}

impl Store for TorchStoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.with_conn(|s| Self::send(s, Request::new(Query::Set).key(key).bytes(value), "set"))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.with_conn(|s| {
            self.wait_on(s, &[key], timeout)?;
            s.set_read_timeout(Some(self.timeout)).map_err(io("get"))?;
            Self::send(s, Request::new(Query::Get).key(key), "get")?;
            read_value(s, "get")
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.with_conn(|s| {
            Self::send(s, Request::new(Query::Add).key(key).i64(delta), "add")?;
            Ok(i64::from_le_bytes(read_array(s, "add")?))
        })
    }
}
