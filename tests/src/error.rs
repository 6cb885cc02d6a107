//! The harness's error type.

/// Errors of the namespace nodes ([`crate::netns`]) and the child processes
/// ([`crate::process`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// The caller asked for something the harness cannot build (a bad tag, a node count out
    /// of range): a bug in the caller, never a reason to skip.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A child process or a network-namespace command failed or missed its deadline.
    #[error("{what}: {detail}")]
    Process {
        /// The process or command, e.g. `launch on node 1`.
        what: String,
        /// What went wrong, with the tail of its stderr where there is one.
        detail: String,
    },
}

impl HarnessError {
    /// Shorthand for a [`HarnessError::Process`].
    pub fn process(what: impl Into<String>, detail: impl Into<String>) -> Self {
        HarnessError::Process { what: what.into(), detail: detail.into() }
    }

    /// Shorthand for a [`HarnessError::Config`].
    pub fn config(detail: impl Into<String>) -> Self {
        HarnessError::Config(detail.into())
    }
}

/// Result alias of the harness.
pub type Result<T, E = HarnessError> = std::result::Result<T, E>;
