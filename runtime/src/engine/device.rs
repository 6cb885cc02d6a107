//! Where a rank's kernels run: [`Device`], and [`open_backend`], which opens its compute
//! backend or says why it cannot.

use std::sync::Arc;

use crate::error::{Result, RuntimeError};
use shardline_models::{Backend, Cpu};

/// Where a rank's kernels run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Device {
    /// The CPU backend (`gemm`).
    #[default]
    Cpu,
    /// The CUDA backend on this GPU ordinal (feature `cuda`): cuBLAS matrix multiplies and
    /// NVRTC kernels, operands staged from the host buffers the engine keeps (the shards,
    /// the optimizer and the collectives stay on the host).
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Opens the compute backend of `device`: a GPU that is absent (or a build without the
/// `cuda` feature) is [`RuntimeError::DeviceUnavailable`], never a panic.
pub fn open_backend(device: Device, threads: usize) -> Result<Box<dyn Backend>> {
    match device {
        Device::Cpu => {
            Ok(Box::new(if threads > 1 { Cpu::with_threads(threads) } else { Cpu::new() }))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => shardline_models::cuda::Cuda::open(ordinal)
            .map(|c| Box::new(c) as Box<dyn Backend>)
            .map_err(|e| match e {
                shardline_models::ModelError::DeviceUnavailable(what) => {
                    RuntimeError::DeviceUnavailable(what)
                }
                other => RuntimeError::DeviceUnavailable(other.to_string()),
            }),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(RuntimeError::DeviceUnavailable(
            "this build has no CUDA backend (cargo build -p shardline-runtime --features cuda)"
                .into(),
        )),
    }
}

/// Opens each rank's backend in place of its device's (the argument is the rank): for
/// callers that bring a backend of their own, such as a test's backend that fails on
/// purpose.
#[derive(Clone)]
pub struct BackendOverride(pub Arc<dyn Fn(usize) -> Box<dyn Backend> + Send + Sync>);

impl std::fmt::Debug for BackendOverride {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BackendOverride")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_print_as_the_cli_names_them_and_the_cpu_always_opens() {
        assert_eq!(Device::Cpu.to_string(), "cpu");
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert!(open_backend(Device::Cpu, 1).is_ok());
        assert!(open_backend(Device::Cpu, 2).is_ok());
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(
            open_backend(Device::Cuda(0), 1),
            Err(RuntimeError::DeviceUnavailable(_))
        ));
    }
}
