//! The client of the replicated store ([`ReplicaServer`](super::ReplicaServer)): it knows
//! every replica's address, sends each request to the leader, and when the leader is gone
//! or cut off tries the others until one leads, within its deadline. A request carries the
//! client's identity and number, so one sent again after a failover applies once
//! (RSTORE-5). It is a [`Store`], so the workers use it as any other.

use super::raft::{Command, Op, OpResult};
use super::replica::connect;
use super::replica_wire::{self as wire, Frame, CLIENT};
use super::{Store, StoreError, MAX_KEY_BYTES, MAX_VALUE_BYTES};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one connection attempt to a replica may take.
const CONNECT: Duration = Duration::from_millis(500);
/// Pause before trying the next replica when none was known to lead.
const RETRY: Duration = Duration::from_millis(50);
/// Slack on a reply beyond the wait the request asked for.
const REPLY_SLACK: Duration = Duration::from_secs(2);

struct Conn {
    /// The replica tried next, and the connection to it if open.
    target: usize,
    stream: Option<TcpStream>,
    seq: u64,
    last_err: String,
}

/// A client of the replicated store.
pub struct ReplicatedStore {
    addrs: Vec<String>,
    token: Vec<u8>,
    client: u64,
    /// How long a request may take to find a leader and be answered (failover included).
    timeout: Duration,
    conn: Mutex<Conn>,
}

fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    // 0 and CLIENT are taken (the replicas' no-ops, the hello's client mark).
    h.finish().clamp(1, u64::MAX - 1)
}

impl ReplicatedStore {
    /// A client of the replicas at `addrs`; `timeout` bounds every request other than the
    /// wait of a `get` (which waits as long as asked, plus `timeout`). Connects lazily: the
    /// first request finds the leader.
    pub fn new(addrs: Vec<String>, token: &str, timeout: Duration) -> Result<Self, StoreError> {
        if addrs.is_empty() {
            return Err(StoreError::Io("no replica addresses".into()));
        }
        Ok(ReplicatedStore {
            addrs,
            token: token.as_bytes().to_vec(),
            client: random_id(),
            timeout,
            conn: Mutex::new(Conn { target: 0, stream: None, seq: 0, last_err: String::new() }),
        })
    }

    /// The addresses of the replicas.
    pub fn addrs(&self) -> &[String] {
        &self.addrs
    }

    /// Sends `req(seq)` to the leader, following redirections and failing over, until
    /// `wait` plus the client's timeout passes.
    fn request(&self, wait: Duration, req: impl Fn(u64) -> Frame) -> Result<Frame, StoreError> {
        let mut c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        c.seq += 1;
        let frame = req(c.seq);
        let deadline = Instant::now() + wait + self.timeout;
        let mut tried = 0usize;
        loop {
            if Instant::now() >= deadline {
                return Err(StoreError::Io(format!(
                    "no leader of the replicated store ({}) answered within {:?}: {}",
                    self.addrs.join(","),
                    wait + self.timeout,
                    c.last_err
                )));
            }
            if c.stream.is_none() {
                let addr = &self.addrs[c.target];
                match connect(addr, CLIENT, &self.token, CONNECT) {
                    Ok(s) => c.stream = Some(s),
                    Err(StoreError::Refused(why)) => return Err(StoreError::Refused(why)),
                    Err(e) => {
                        c.last_err = e.to_string();
                        self.next(&mut c, None, &mut tried);
                        continue;
                    }
                }
            }
            let reply = {
                let Some(s) = c.stream.as_mut() else { continue };
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = s.set_read_timeout(Some(left.min(wait + REPLY_SLACK).max(CONNECT)));
                wire::write(s, &frame)
                    .map_err(|e| e.to_string())
                    .and_then(|_| wire::read(s).map_err(|e| format!("{e}")))
            };
            match reply {
                Ok(Frame::NotLeader(hint)) => {
                    c.last_err = format!("replica {} does not lead", c.target);
                    let hint = hint.map(|h| h as usize).filter(|&h| h < self.addrs.len());
                    self.next(&mut c, hint, &mut tried);
                }
                Ok(Frame::Unavailable(why)) => {
                    c.last_err = format!("replica {}: {why}", c.target);
                    self.next(&mut c, None, &mut tried);
                }
                Ok(f) => return Ok(f),
                Err(e) => {
                    // The reply may still come: the connection is not reused (a later
                    // request would read it).
                    c.last_err = format!("replica {} ({}): {e}", c.target, self.addrs[c.target]);
                    self.next(&mut c, None, &mut tried);
                }
            }
        }
    }

    /// Moves to the hinted replica, else the next one; pauses after a full round.
    fn next(&self, c: &mut Conn, hint: Option<usize>, tried: &mut usize) {
        c.stream = None;
        match hint {
            Some(h) if h != c.target => c.target = h,
            _ => {
                c.target = (c.target + 1) % self.addrs.len();
                *tried += 1;
                if (*tried).is_multiple_of(self.addrs.len()) {
                    std::thread::sleep(RETRY);
                }
            }
        }
    }

    fn op(&self, op: Op) -> Result<OpResult, StoreError> {
        let (key, len) = match &op {
            Op::Set { key, value } | Op::CompareSet { key, value, .. } => (key, value.len()),
            Op::Add { key, .. } | Op::Delete { key } => (key, 0),
            Op::Noop => return Ok(OpResult::Done),
        };
        if key.len() > MAX_KEY_BYTES || len > MAX_VALUE_BYTES {
            return Err(StoreError::Io(format!(
                "key or value too long ({} B, {len} B)",
                key.len()
            )));
        }
        let wait_ms = self.timeout.as_millis() as u64;
        let client = self.client;
        let reply = self.request(Duration::ZERO, |seq| Frame::Propose {
            cmd: Command { client, seq, op: op.clone() },
            wait_ms,
        })?;
        match reply {
            Frame::Result(OpResult::Failed(why)) => Err(StoreError::Io(why)),
            Frame::Result(r) => Ok(r),
            f => Err(StoreError::Io(format!("unexpected reply {f:?}"))),
        }
    }

    /// Sets `key` to `value` if it holds `expected` (`None`: if it is absent); returns
    /// whether it did and the value after.
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> Result<(bool, Option<Vec<u8>>), StoreError> {
        let op = Op::CompareSet {
            key: key.to_owned(),
            expected: expected.map(<[u8]>::to_vec),
            value: value.to_vec(),
        };
        match self.op(op)? {
            OpResult::Swapped { ok, current } => Ok((ok, current)),
            r => Err(StoreError::Io(format!("unexpected result {r:?}"))),
        }
    }

    /// Removes `key`.
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.op(Op::Delete { key: key.to_owned() }).map(|_| ())
    }
}

impl Store for ReplicatedStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.op(Op::Set { key: key.to_owned(), value: value.to_vec() }).map(|_| ())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let wait_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let owned = key.to_owned();
        match self.request(timeout, |_| Frame::Get { key: owned.clone(), wait_ms })? {
            Frame::Value(v) => Ok(v),
            Frame::Unset => Err(StoreError::Timeout { key: owned, timeout }),
            f => Err(StoreError::Io(format!("unexpected reply {f:?}"))),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        match self.op(Op::Add { key: key.to_owned(), delta })? {
            OpResult::Added(v) => Ok(v),
            r => Err(StoreError::Io(format!("unexpected result {r:?}"))),
        }
    }
}

#[cfg(test)]
#[path = "replicated_tests.rs"]
mod tests;
