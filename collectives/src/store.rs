//! Rendezvous store: a small key-value store through which ranks exchange addresses,
//! segment names and pids before links exist. `MemStore` serves threads of one process;
//! `TcpStoreServer`/`TcpStoreClient` serve processes and nodes and require the job token.

use std::time::Duration;

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
