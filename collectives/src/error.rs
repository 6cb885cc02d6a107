//! The crate's error type. Recoverable faults (timeout, lost peer, i/o, mismatch) are errors;
//! broken invariants are asserts.

use crate::transport::TransportError;

/// The `peer` of a [`CollectiveError::Timeout`] that names no rank: a local wait expired
/// before the op's own deadline could say who is late. Its text never shows the number.
pub const NO_PEER: usize = usize::MAX;

/// The text of a timeout after its lane and sequence number.
fn timeout_detail(peer: usize, timeout_ms: u64) -> String {
    if peer == NO_PEER {
        format!("no rank named: the local wait expired after {timeout_ms} ms")
    } else {
        format!("rank {peer} did not arrive within {timeout_ms} ms")
    }
}

/// Errors of collective operations. Each names the lane and the op's sequence number.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum CollectiveError {
    /// Ranks issued different ops at the same point of a lane. Every rank involved gets this.
    #[error("collective mismatch on lane '{lane}' seq {seq}: this rank (rank {rank}) issued {ours}, rank {peer} issued {theirs}")]
    Mismatch {
        /// Lane name.
        lane: String,
        /// Sequence number on the lane.
        seq: u64,
        /// This rank.
        rank: usize,
        /// This rank's op, described.
        ours: String,
        /// The disagreeing peer.
        peer: usize,
        /// The peer's op, described.
        theirs: String,
    },
    /// A wait passed its deadline.
    #[error("timeout on lane '{lane}' seq {seq}: {}", timeout_detail(*peer, *timeout_ms))]
    Timeout {
        /// Lane name.
        lane: String,
        /// Sequence number.
        seq: u64,
        /// The peer that did not arrive; [`NO_PEER`] when a local wait expired first
        /// (`Work::wait_timeout`) and no rank is known to be late.
        peer: usize,
        /// The deadline that passed, in milliseconds.
        timeout_ms: u64,
    },
    /// The communicator was aborted.
    #[error("aborted on lane '{lane}' seq {seq}: {reason}")]
    Aborted {
        /// Lane name.
        lane: String,
        /// Sequence number.
        seq: u64,
        /// The reason given to `abort`.
        reason: String,
    },
    /// A peer process or thread died.
    #[error("rank {rank} lost (lane '{lane}' seq {seq}): {detail}")]
    PeerLost {
        /// The lost rank.
        rank: usize,
        /// Lane name.
        lane: String,
        /// Sequence number.
        seq: u64,
        /// What was observed.
        detail: String,
    },
    /// A peer failed and told us so (its reason is forwarded).
    #[error("lane '{lane}' seq {seq}: {detail}")]
    PeerFailed {
        /// Lane name.
        lane: String,
        /// Sequence number.
        seq: u64,
        /// The forwarded failure.
        detail: String,
    },
    /// Invalid arguments (buffer sizes, root out of range...). Detected before any I/O.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A device (GPU, NCCL, RDMA NIC) that was asked for is not on this host; the text names
    /// what was looked for.
    #[error("DeviceUnavailable: {0}")]
    DeviceUnavailable(String),
    /// Transport failure not covered above (setup, i/o, corruption).
    #[error("transport error on lane '{lane}': {source}")]
    Transport {
        /// Lane name.
        lane: String,
        /// The transport's error.
        source: TransportError,
    },
}
