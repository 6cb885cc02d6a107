//! Rendezvous store: a small key-value store through which ranks exchange addresses,
//! segment names and pids before links exist.
//!
//! - [`MemStore`] serves threads of one process;
//! - [`TcpStoreServer`]/[`TcpStoreClient`] (`tcp.rs`) serve processes and nodes and require
//!   the job token;
//! - [`ReplicaServer`]/[`ReplicatedStore`] (`replica.rs`, `replicated.rs`) replicate the
//!   store across the launch agents (a Raft log, `raft.rs`), so that it outlives any one
//!   node, and require the job token;
//! - [`TorchStoreClient`] (`torch.rs`) speaks PyTorch's c10d `TCPStore` protocol, so that the
//!   workers of a torchrun job rendezvous through the store its agent already serves;
//!   `TorchStoreServer` (feature `test-utils`) plays that store in tests without torch.
//!
//! Values set through [`Store::add`] are stored as decimal text (in all three), so `get` on
//! such a key returns e.g. `b"3"`.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod kv_machine;
pub mod raft;
mod replica;
mod replica_wire;
mod replicated;
mod tcp;
pub mod torch;
#[cfg(any(test, feature = "test-utils"))]
mod torch_server;

pub use replica::{ReplicaServer, ReplicaStatus};
pub use replicated::ReplicatedStore;
pub use tcp::{TcpStoreClient, TcpStoreServer, MAX_KEY_BYTES, MAX_VALUE_BYTES};
pub use torch::TorchStoreClient;
#[cfg(any(test, feature = "test-utils"))]
pub use torch_server::TorchStoreServer;

/// Connects to the first address of `addr`, retrying until `deadline` while the server may
/// still be starting; `who` prefixes the errors (both clients connect this way).
fn connect_until(
    addr: impl ToSocketAddrs,
    deadline: Instant,
    who: &str,
) -> Result<(TcpStream, SocketAddr), StoreError> {
    let first = addr
        .to_socket_addrs()
        .map_err(|e| StoreError::Io(format!("{who}resolve: {e}")))?
        .next()
        .ok_or_else(|| StoreError::Io(format!("{who}no address to connect to")))?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&first, left.max(Duration::from_millis(10))) {
            Ok(s) => return Ok((s, first)),
            Err(e) if Instant::now() + Duration::from_millis(50) < deadline => {
                tracing::debug!("{who}connect to {first}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(StoreError::Io(format!("{who}connect {first}: {e}"))),
        }
    }
}

/// Errors of the rendezvous store.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum StoreError {
    /// `get`/`wait` did not see the key in time.
    #[error("store: key '{key}' not set within {timeout:?}")]
    Timeout {
        /// The awaited key.
        key: String,
        /// How long we waited.
        timeout: Duration,
    },
    /// The server refused us (bad token, bad version).
    #[error("store: refused: {0}")]
    Refused(String),
    /// Connection or protocol failure.
    #[error("store: {0}")]
    Io(String),
}

/// Key-value rendezvous store.
pub trait Store: Send + Sync {
    /// Sets `key` to `value` (overwrites).
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Returns the value of `key`, waiting up to `timeout` for it to be set.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError>;
    /// Atomically adds `delta` to the integer at `key` (0 when absent) and returns the result.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;
}

// ---------------------------------------------------------------------------------------------
// MemStore
// ---------------------------------------------------------------------------------------------

/// In-process store for ranks that are threads (and for tests). Cloning shares the map.
#[derive(Clone, Default)]
pub struct MemStore {
    inner: Arc<MemInner>,
}

#[derive(Default)]
pub(super) struct MemInner {
    map: Mutex<HashMap<String, Vec<u8>>>,
    pub(super) changed: Condvar,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl MemInner {
    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panicking setter cannot leave the map half-updated (inserts are atomic), so a
        // poisoned lock is still consistent.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn set(&self, key: &str, value: &[u8]) {
        self.lock().insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
    }

    pub(super) fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            if let Some(v) = map.get(key) {
                return Ok(v.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::Timeout { key: key.to_owned(), timeout });
            }
            map =
                self.changed.wait_timeout(map, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    pub(super) fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let mut map = self.lock();
        let cur = match map.get(key) {
            None => 0,
            Some(v) => parse_i64(key, v)?,
        };
        let new = cur.wrapping_add(delta);
        map.insert(key.to_owned(), new.to_string().into_bytes());
        drop(map);
        self.changed.notify_all();
        Ok(new)
    }
}

fn parse_i64(key: &str, v: &[u8]) -> Result<i64, StoreError> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .ok_or_else(|| StoreError::Io(format!("key '{key}' does not hold an integer")))
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.set(key, value);
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.inner.get(key, timeout)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.inner.add(key, delta)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::sync::Arc;

    const T: Duration = Duration::from_secs(10);

    pub(super) fn exercise(make: impl Fn() -> Arc<dyn Store>) {
        let store = make();
        let mut hs = Vec::new();
        for t in 0..4i64 {
            let s = make();
            hs.push(std::thread::spawn(move || {
                for _ in 0..25 {
                    s.add("counter", t + 1).unwrap();
                }
                s.set(&format!("k{t}"), &[t as u8; 3]).unwrap();
                // Every thread sees every other thread's key.
                for u in 0..4 {
                    assert_eq!(s.get(&format!("k{u}"), T).unwrap(), vec![u as u8; 3]);
                }
            }));
        }
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(store.add("counter", 0).unwrap(), 25 * (1 + 2 + 3 + 4));
        assert_eq!(store.get("counter", T).unwrap(), b"250".to_vec());
        store.set("k0", b"over").unwrap();
        assert_eq!(store.get("k0", T).unwrap(), b"over".to_vec());
        let short = Duration::from_millis(50);
        assert!(matches!(store.get("never", short), Err(StoreError::Timeout { .. })));
    }

    #[test]
    fn mem_store_set_get_add_across_threads() {
        let s = MemStore::new();
        exercise(|| Arc::new(s.clone()) as Arc<dyn Store>);
    }
}
