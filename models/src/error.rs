//! The crate's one error type.

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
    /// A statistics reduction across ranks failed.
    #[error("statistics reduction failed: {0}")]
    Reduce(String),
    /// A data file could not be read or parsed.
    #[error("data error in {source_name}: {msg}")]
    Data {
        /// File or data set name.
        source_name: String,
        /// What went wrong (line numbers where known).
        msg: String,
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
