//! The runtime's error type. Recoverable faults (a cap exceeded, a bad or damaged checkpoint,
//! an impossible configuration, a failed collective) are errors; broken invariants are asserts.

use std::path::PathBuf;

use shardline_collectives::error::CollectiveError;

use crate::memory::{format_bytes, Category};

/// Errors of the runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// An allocation would exceed the rank's memory cap (`--device-memory`).
    #[error(
        "rank {rank}: allocating {} for {} {what} would exceed the {} cap; in use: {breakdown}",
        format_bytes(*requested),
        category.label(),
        format_bytes(*cap)
    )]
    OutOfMemory {
        /// The rank whose tracker refused.
        rank: usize,
        /// Category of the refused allocation.
        category: Category,
        /// What was being allocated, e.g. `blocks.3`.
        what: String,
        /// Bytes requested.
        requested: u64,
        /// The cap.
        cap: u64,
        /// Bytes in use before the request.
        in_use: u64,
        /// Human breakdown of what is in use, by category.
        breakdown: String,
    },
    /// A checkpoint file is missing, damaged, inconsistent or does not match this run.
    #[error("checkpoint {}: {detail}", file.display())]
    Checkpoint {
        /// The offending file or directory.
        file: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// `--resume` found committed checkpoints under `root` but none verifies (CKPT-5): each
    /// one, newest first, with why.
    #[error("{}", no_verified_checkpoint(root, skipped))]
    NoVerifiedCheckpoint {
        /// The checkpoint directory given (`--checkpoint-dir`).
        root: PathBuf,
        /// Every committed checkpoint there, newest first, with its verify error.
        skipped: Vec<crate::checkpoint::Skipped>,
    },
    /// An impossible or inconsistent configuration (world 0, unknown stage, mismatched sizes).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A failure while running that is not the configuration's: a step or a checkpoint that
    /// failed on some rank (named), a rendezvous that did not complete.
    #[error("{0}")]
    Failed(String),
    /// Live recovery found no peer holding a state every rank can resume from (LIVE-2): the
    /// job falls back to its checkpoint restart.
    #[error("live recovery impossible: {0}")]
    LiveRecoveryImpossible(String),
    /// A collective operation failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// The compute device asked for cannot be used here (no GPU, no driver, or a build
    /// without the feature); the text names what is missing.
    #[error("device unavailable: {0}")]
    DeviceUnavailable(String),
    /// A device refused or failed a call: an unordered access (naming the buffer and the
    /// streams), a collective desync (naming the ranks and the calls), memory past its
    /// capacity.
    #[error("device: {0}")]
    Device(#[from] shardline_collectives::device::DeviceError),
    /// A model computation failed (shapes, BatchNorm on a single value).
    #[error("model: {0}")]
    Model(String),
    /// A SyncBatchNorm statistics reduction failed: the rank, the lane, which message and
    /// why, with the collective's own error as the cause (typed from the engine's reducer
    /// through the model to here).
    #[error(transparent)]
    Stats(#[from] shardline_models::StatsError),
    /// The run was asked to stop by a signal (SIGINT, SIGTERM) and stopped after a whole
    /// step on every rank (INT-1), with a checkpoint of it when a checkpoint directory was
    /// given.
    #[error("stopped by {} after step {step}; {}", crate::interrupt::signal_name(*signal), match checkpoint {
        Some(p) => format!("its checkpoint is {} (continue with --resume)", p.display()),
        None => "nothing was saved (no --checkpoint-dir, or no step had finished)".to_string(),
    })]
    Interrupted {
        /// The signal's number.
        signal: i32,
        /// Steps completed (including resumed ones).
        step: u64,
        /// The checkpoint directory holding that step, if one was written or already held it.
        checkpoint: Option<PathBuf>,
    },
}

impl RuntimeError {
    /// Wraps a model error: a statistics reduction's stays typed ([`RuntimeError::Stats`]),
    /// the others are kept as text.
    pub fn from_model(e: shardline_models::ModelError) -> Self {
        match e {
            shardline_models::ModelError::Stats(s) => RuntimeError::Stats(s),
            other => RuntimeError::Model(other.to_string()),
        }
    }

    /// Shorthand for a [`RuntimeError::Checkpoint`] naming `file`.
    pub fn checkpoint(file: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        RuntimeError::Checkpoint { file: file.into(), detail: detail.into() }
    }

    /// Shorthand for a [`RuntimeError::Config`].
    pub fn config(detail: impl Into<String>) -> Self {
        RuntimeError::Config(detail.into())
    }
}

impl From<shardline_models::ModelError> for RuntimeError {
    fn from(e: shardline_models::ModelError) -> Self {
        RuntimeError::from_model(e)
    }
}

/// The text of [`RuntimeError::NoVerifiedCheckpoint`]: one line per checkpoint.
fn no_verified_checkpoint(
    root: &std::path::Path,
    skipped: &[crate::checkpoint::Skipped],
) -> String {
    let mut s = format!(
        "cannot resume: none of the {} checkpoint(s) in {} verifies",
        skipped.len(),
        root.display()
    );
    for k in skipped {
        s.push_str(&format!("\n  {}: {}", k.dir.display(), k.reason));
    }
    s
}

/// Result alias of the runtime.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
