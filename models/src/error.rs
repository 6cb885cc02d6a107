//! The crate's error types: [`ModelError`], and [`StatsError`], the typed failure of a
//! SyncBatchNorm statistics reduction that a [`crate::StatsReducer`] returns and
//! [`ModelError::Stats`] carries on unchanged.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

/// Everything that can go wrong in the models crate.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A tensor or buffer did not have the shape or length an operation needs.
    #[error("shape mismatch in {what}: expected {expected}, got {got}")]
    Shape {
        /// Which operation or argument.
        what: String,
        /// What was expected.
        expected: String,
        /// What was found.
        got: String,
    },
    /// BatchNorm in training mode saw at most one value per channel in the (global) batch:
    /// the variance is undefined (PyTorch raises the same error).
    #[error(
        "expected more than 1 value per channel when training, got {count} in the global batch of layer {layer}"
    )]
    TooFewValues {
        /// Layer name (or `batchnorm` when unnamed).
        layer: String,
        /// Values per channel in the global batch.
        count: usize,
    },
    /// A SyncBatchNorm statistics reduction across ranks failed (rank, lane, which message,
    /// and why, typed).
    #[error(transparent)]
    Stats(#[from] StatsError),
    /// An index (a token id) is not below the number of entries of the table it indexes.
    #[error("{what}: index {index} at position {position} is out of range for {len} entries")]
    OutOfRange {
        /// Which operation or table.
        what: String,
        /// The index found.
        index: u64,
        /// Where it was in the list of indices.
        position: usize,
        /// Entries in the table (valid indices are below it).
        len: usize,
    },
    /// A data file could not be read or parsed.
    #[error("data error in {source_name}: {msg}")]
    Data {
        /// File or data set name.
        source_name: String,
        /// What went wrong (line numbers where known).
        msg: String,
    },
    /// A tensor of another element type than the operation computes on (TENSOR-2).
    #[error("element type mismatch: expected a {expected} tensor, got {got}")]
    DType {
        /// The type the operation needs.
        expected: crate::tensor::DType,
        /// The tensor's type.
        got: crate::tensor::DType,
    },
    /// A tensor's values were asked for away from where they live (TENSOR-4).
    #[error("placement mismatch: a tensor on {tensor} was read on {here}; copy it there first")]
    Placement {
        /// Where the tensor lives.
        tensor: crate::placement::Placement,
        /// Where the thread computes.
        here: crate::placement::Placement,
    },
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A compute device (GPU, driver, library) that was asked for is not on this host; the
    /// text names what was looked for.
    #[error("DeviceUnavailable: {0}")]
    DeviceUnavailable(String),
    /// A device operation failed (launch, copy, library call).
    #[error("device error: {0}")]
    Device(String),
}

impl ModelError {
    pub(crate) fn shape(what: &str, expected: impl ToString, got: impl ToString) -> Self {
        ModelError::Shape {
            what: what.to_string(),
            expected: expected.to_string(),
            got: got.to_string(),
        }
    }
}

/// Which SyncBatchNorm statistics message a [`StatsError`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatsOp {
    /// Forward: the per-channel `(count, mean, M2)` records
    /// ([`crate::StatsReducer::reduce_records`]).
    Forward,
    /// Backward: the per-channel gradient sums ([`crate::StatsReducer::reduce_sum`]).
    Backward,
}

impl fmt::Display for StatsOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StatsOp::Forward => "forward",
            StatsOp::Backward => "backward",
        })
    }
}

/// Why a statistics reduction failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StatsFailure {
    /// The collective under the reduction failed (a timeout, a lost peer, an abort...): its
    /// own error, typed (the runtime's reducer puts a `CollectiveError` here; downcast it).
    #[error(transparent)]
    Collective(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// Ranks contributed buffers of different lengths.
    #[error("ranks sent {ours} and {theirs} values")]
    Length {
        /// Values this rank (or the first rank folded) sent.
        ours: usize,
        /// Values another rank sent.
        theirs: usize,
    },
    /// A record reduction got a buffer that is not a whole number of records.
    #[error("{len} values are not whole records of {record_len}")]
    Records {
        /// Values in the buffer.
        len: usize,
        /// Values per record.
        record_len: usize,
    },
    /// Some peer did not arrive before the reducer's deadline.
    #[error("timed out after {0:?} waiting for peers")]
    Timeout(Duration),
    /// A peer panicked while holding the reducer's shared state (in-process reducers).
    #[error("the reducer's shared state is poisoned (a peer panicked)")]
    Poisoned,
}

/// A SyncBatchNorm statistics reduction that failed: which rank, on which lane (or
/// in-process group), for which message, and why. Returned by every
/// [`crate::StatsReducer`], carried by [`ModelError::Stats`] and converted with `From` by the
/// runtime, so it stays typed from the reducer to the caller.
#[derive(Debug, Error)]
#[error("rank {rank}: SyncBatchNorm {op} statistics on lane '{lane}': {what}")]
pub struct StatsError {
    /// The rank that saw the failure.
    pub rank: usize,
    /// The lane (or in-process group) the reduction ran on.
    pub lane: String,
    /// Which message.
    pub op: StatsOp,
    /// Why.
    #[source]
    pub what: StatsFailure,
}

impl StatsError {
    /// A failure of `op` on `rank`'s `lane`.
    pub fn new(rank: usize, lane: impl Into<String>, op: StatsOp, what: StatsFailure) -> Self {
        StatsError { rank, lane: lane.into(), op, what }
    }
}
