//! Point-to-point transports. A transport moves byte messages between ranks and knows
//! nothing of reductions or schedules (as in Gloo: transports beside algorithms).
//!
//! The unit of work is one *exchange*: the set of sends and receives of one schedule step,
//! progressed concurrently until all are complete, the deadline passes, or the lane is
//! cancelled. Every message carries a [`Tag`] (the op's fingerprint plus the step number);
//! a receiver that finds a different tag than it expects fails with
//! [`TransportError::TagMismatch`] instead of consuming the data.
//!
//! Invariants every transport keeps (cited by the transport tests):
//! - TR-1: messages between one pair of ranks on one lane arrive in the order they were sent.
//! - TR-2: a receive delivers exactly `len` bytes to its sink, in order of offset, in pieces
//!   whose offsets and lengths are multiples of 4 bytes and whose start is 4-byte aligned
//!   (so a sink may view them as `f32`).
//! - TR-3: `exchange` never blocks past `deadline` and returns `Cancelled` soon after the
//!   cancel flag is set.
//! - TR-4: a peer that exits, is killed, or drops its endpoint is reported as
//!   `PeerLost { peer }` within the deadline, never as a hang.
//! - TR-5: a send buffer may be reused as soon as `exchange` returns.
//! - TR-6: a receive whose sink is [`Sink::Copy`] ends with exactly its `len` bytes in the
//!   sink's buffer, whether the transport wrote them there itself or through [`Sink::put`].

use std::sync::atomic::AtomicBool;
use std::time::Instant;

pub mod faulty;
pub mod group;
pub mod hybrid;
pub mod local;
pub mod rdma;
pub mod select;
pub mod shm;
#[cfg(test)]
mod suite;
pub mod tcp;

/// Identifies one message: the op's fingerprint and the step of its schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Tag {
    /// Hash of the lane name (so two lanes sharing a link can never be confused).
    pub lane: u32,
    /// Sequence number of the op on its lane.
    pub seq: u64,
    /// Op kind code (see `crate::fingerprint::OpKind`).
    pub kind: u32,
    /// Element count the op was issued with.
    pub count: u64,
    /// Root rank for rooted ops, `u32::MAX` otherwise.
    pub root: u32,
    /// Step of the schedule this message belongs to.
    pub step: u32,
}

impl Tag {
    /// Size of a tag on the wire.
    pub const WIRE_BYTES: usize = 32;

    /// Encodes the tag in little-endian into 32 bytes.
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[0..4].copy_from_slice(&self.lane.to_le_bytes());
        b[4..12].copy_from_slice(&self.seq.to_le_bytes());
        b[12..16].copy_from_slice(&self.kind.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..28].copy_from_slice(&self.root.to_le_bytes());
        b[28..32].copy_from_slice(&self.step.to_le_bytes());
        b
    }

    /// Decodes a tag written by [`Tag::encode`].
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Tag {
            lane: u32_at(0),
            seq: u64_at(4),
            kind: u32_at(12),
            count: u64_at(16),
            root: u32_at(24),
            step: u32_at(28),
        }
    }
}

/// One message to send in an exchange.
pub struct SendOp<'a> {
    /// Destination rank.
    pub peer: usize,
    /// Payload; length is a multiple of 4.
    pub data: &'a [u8],
    /// The receiver copies this message (its sink is [`Sink::Copy`]) rather than reducing
    /// it: a hint that lets a transport hand over the data in place (TR-6).
    pub copied: bool,
}

/// Where the bytes of one receive go.
pub enum Sink<'a> {
    /// Copied to this buffer at their offset (its length is the receive's `len`). A
    /// transport that can place bytes itself (a read from the peer's memory, a socket read)
    /// writes them here directly instead of staging them (TR-6).
    Copy(&'a mut [u8]),
    /// Handed to the closure as `(offset, piece)` (see TR-2), to be copied or reduced.
    Fn(&'a mut dyn FnMut(usize, &[u8])),
}

impl Sink<'_> {
    /// Delivers one piece at `offset` (TR-2).
    pub fn put(&mut self, offset: usize, piece: &[u8]) {
        match self {
            Sink::Copy(dst) => {
                // A correct transport keeps pieces inside the receive (TR-2); a broken one
                // must not write out of bounds, hence the checked index.
                let end = offset + piece.len();
                assert!(end <= dst.len(), "transport delivered a piece out of range");
                dst[offset..end].copy_from_slice(piece);
            }
            Sink::Fn(f) => f(offset, piece),
        }
    }

    /// The same sink, borrowed for a shorter time (to hand to an inner transport).
    pub fn reborrow(&mut self) -> Sink<'_> {
        match self {
            Sink::Copy(dst) => Sink::Copy(dst),
            Sink::Fn(f) => Sink::Fn(&mut **f),
        }
    }

    /// The destination buffer, when the receive is a plain copy.
    pub fn copy_target(&mut self) -> Option<&mut [u8]> {
        match self {
            Sink::Copy(dst) => Some(dst),
            Sink::Fn(_) => None,
        }
    }
}

/// One message to receive in an exchange.
pub struct RecvOp<'a> {
    /// Source rank.
    pub peer: usize,
    /// Expected payload length in bytes (multiple of 4). A different length is a
    /// `LengthMismatch`.
    pub len: usize,
    /// Where the bytes go (copied or reduced into the caller's buffer).
    pub sink: Sink<'a>,
}

/// A message a failing rank sends to every peer of a lane so that they fail too instead of
/// waiting for data that will never come.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Poison {
    /// Rank that detected the failure.
    pub origin: usize,
    /// Human-readable cause, forwarded verbatim into the peers' errors.
    pub reason: String,
}

/// Errors of a transport. An error other than `Cancelled` leaves the lane's links in an
/// unknown state: the lane is failed for good (recreate the communicator).
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum TransportError {
    /// The deadline passed while waiting on `peer` (receiving from it or for it to take data).
    #[error("timed out waiting for rank {peer}")]
    Timeout {
        /// The peer that did not arrive.
        peer: usize,
    },
    /// The peer exited, was killed, or closed its endpoint.
    #[error("rank {peer} is gone: {detail}")]
    PeerLost {
        /// The lost peer.
        peer: usize,
        /// What was observed (EOF, reset, process not alive...).
        detail: String,
    },
    /// The peer sent a message for a different op than this rank expects.
    #[error("rank {peer} sent {got:?}, expected {expected:?}")]
    TagMismatch {
        /// Sender of the unexpected message.
        peer: usize,
        /// Tag this rank expected.
        expected: Tag,
        /// Tag that arrived.
        got: Tag,
    },
    /// The peer sent a message of another length than expected.
    #[error("rank {peer} sent {got} bytes, expected {expected}")]
    LengthMismatch {
        /// Sender.
        peer: usize,
        /// Expected length.
        expected: usize,
        /// Received length.
        got: usize,
    },
    /// A peer reported that it failed; its reason is forwarded.
    #[error("rank {} failed: {}", .0.origin, .0.reason)]
    Poisoned(Poison),
    /// The cancel flag was set (abort).
    #[error("cancelled")]
    Cancelled,
    /// A frame failed its integrity check.
    #[error("corrupt frame from rank {peer}: {detail}")]
    Corrupt {
        /// Sender.
        peer: usize,
        /// What was wrong.
        detail: String,
    },
    /// Setting up links failed (store, sockets, segments).
    #[error("transport setup failed: {0}")]
    Setup(String),
    /// An I/O error on a link.
    #[error("i/o error with rank {peer}: {detail}")]
    Io {
        /// Peer of the link.
        peer: usize,
        /// The OS error text.
        detail: String,
    },
}

/// A transport: a factory for the links of each lane (Gloo's `Device`).
pub trait Transport: Send + Sync {
    /// Short name: "local", "shm", "tcp".
    fn name(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Opens this rank's endpoint of lane `lane`: links to every peer, independent of other
    /// lanes' links. Every rank must open the same lanes (in any order); this call waits for
    /// the peers up to `deadline`.
    fn open_lane(
        &self,
        lane: &str,
        deadline: Instant,
    ) -> Result<Box<dyn LaneLinks>, TransportError>;
}

/// One rank's links to all its peers on one lane (Gloo's `Pair`s, gathered).
pub trait LaneLinks: Send {
    /// Progresses every send and receive of one schedule step concurrently, until all are
    /// complete (`Ok`), the deadline passes, `cancel` is set, or a link fails.
    ///
    /// Each message is framed with `tag`; each receive checks the arriving tag against `tag`.
    /// A receive may deliver its bytes to the sink in pieces (TR-2).
    fn exchange(
        &mut self,
        tag: Tag,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError>;

    /// Best-effort: tells every peer that this lane failed on this rank, so that their
    /// pending and later exchanges fail with `Poisoned` instead of waiting. Never blocks
    /// for long.
    fn poison(&mut self, poison: &Poison);

    /// Whether `Algorithm::Auto` should gather directly (every rank sends its shard to every
    /// other in one step) rather than around a ring. Must depend only on the transport's
    /// kind, never on this rank's state, so that every rank of a group decides alike.
    fn prefers_direct_gather(&self) -> bool {
        false
    }

    /// Whether a direct all-gather of a large message should go in pieces of
    /// `CommOptions::pipeline_bytes`, and `Auto` gather directly in pieces instead of around
    /// a ring at worlds up to [`PIECED_GATHER_MAX_WORLD`]: where every byte sent costs a
    /// read of the source by the sender's CPU (kernel sockets), a piece read once from memory
    /// stays in the cache while it goes to every peer. The same rules as
    /// [`LaneLinks::prefers_direct_gather`].
    fn prefers_pieced_gather(&self) -> bool {
        false
    }

    /// Heap bytes these links hold for staging while the lane is open (receive scratch);
    /// shared-memory rings and registered regions are mapped, not heap, and not counted. The
    /// runtime's memory accountant registers them as communication buffers.
    fn staging_bytes(&self) -> usize {
        0
    }
}

/// Largest world at which `Auto` gathers directly in pieces where the transport prefers it
/// ([`LaneLinks::prefers_pieced_gather`]); measured at W=2 and W=4 over tcp on 2 cores
/// (RESULTS.md), the ring beyond.
pub const PIECED_GATHER_MAX_WORLD: usize = 4;

/// Splits a 4-byte-aligned byte slice into f32s (TR-2 makes this always valid for sinks).
pub fn as_f32(piece: &[u8]) -> &[f32] {
    bytemuck::cast_slice(piece)
}

/// Whether `ranks` processes can each have a core of their own, judged by the cores this
/// process may use (its CPU set and quota): while they can, a waiter may spin before it gives
/// its core away (SHM-7, TCP-4); past that a spinner holds the core its peer needs.
fn ranks_have_cores(ranks: usize) -> bool {
    ranks <= std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `spin` while `ranks` processes each have a core ([`ranks_have_cores`]), else none.
pub(crate) fn spin_if_ranks_have_cores(
    ranks: usize,
    spin: std::time::Duration,
) -> std::time::Duration {
    if ranks_have_cores(ranks) {
        spin
    } else {
        std::time::Duration::ZERO
    }
}
