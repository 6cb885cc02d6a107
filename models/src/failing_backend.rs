//! A backend that fails on purpose (feature `test-utils`): it computes as [`Cpu`] and fails
//! its N-th matrix multiply with [`ModelError::Device`], as a device would that is lost in
//! the middle of a step, so that tests can follow the error from the kernel to the caller.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::{Backend, Cpu, GemmShape};
use crate::error::ModelError;

/// [`Cpu`], except that its `fail_at`-th [`Backend::gemm`] (1-based, counted over every
/// thread sharing it) computes nothing and returns [`FailingBackend::error_text`]'s error.
/// Calls before and after it compute normally.
#[derive(Debug)]
pub struct FailingBackend {
    cpu: Cpu,
    fail_at: u64,
    gemms: AtomicU64,
}

impl FailingBackend {
    /// A backend whose `fail_at`-th matrix multiply fails (0: none does).
    pub fn new(fail_at: u64) -> Self {
        FailingBackend { cpu: Cpu::new(), fail_at, gemms: AtomicU64::new(0) }
    }

    /// Matrix multiplies called so far, the failed one included.
    pub fn gemms(&self) -> u64 {
        self.gemms.load(Ordering::Relaxed)
    }

    /// The text of the error of the `n`-th multiply, which names the call.
    pub fn error_text(n: u64) -> String {
        format!("gemm #{n}: injected device failure")
    }
}

impl Backend for FailingBackend {
    fn name(&self) -> &'static str {
        "failing-cpu"
    }

    fn gemm(
        &self,
        shape: GemmShape,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<(), ModelError> {
        let n = self.gemms.fetch_add(1, Ordering::Relaxed) + 1;
        if n == self.fail_at {
            return Err(ModelError::Device(Self::error_text(n)));
        }
        self.cpu.gemm(shape, a, b, c, accumulate)
    }
}
