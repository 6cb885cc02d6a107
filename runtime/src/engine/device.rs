//! Where a rank's kernels run: [`Device`], [`open_backend`], which opens a compute backend
//! or says why it cannot, and [`open_rank_backend`], which opens a rank's own (its own GPU,
//! [`super::gpu_choice`]).

use std::sync::Arc;

use super::gpu_choice::{rank_gpu, GpuChoiceError};
use crate::error::{Result, RuntimeError};
use shardline_models::{Backend, Cpu};

/// Where a rank's kernels run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Device {
    /// The CPU backend (`gemm`).
    #[default]
    Cpu,
    /// The CUDA backend (feature `cuda`): cuBLAS matrix multiplies and NVRTC kernels,
    /// operands staged from the host buffers the engine keeps (the shards, the optimizer and
    /// the collectives stay on the host). [`open_backend`] opens this GPU ordinal; a training
    /// rank opens its own GPU instead, by its local rank ([`open_rank_backend`]).
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

/// Opens the backend of the rank with `local_rank` on its node: for [`Device::Cuda`], the
/// rank's own GPU, by [`rank_gpu`] over `CUDA_VISIBLE_DEVICES` and the driver's device count
/// (so that ranks never share one); other devices as [`open_backend`].
pub fn open_rank_backend(
    device: Device,
    threads: usize,
    local_rank: usize,
) -> Result<Box<dyn Backend>> {
    match device {
        Device::Cpu => open_backend(device, threads),
        Device::Cuda(_) => {
            let visible =
                std::env::var_os("CUDA_VISIBLE_DEVICES").map(|v| v.to_string_lossy().into_owned());
            let ordinal = rank_gpu(local_rank, visible.as_deref(), cuda_device_count).map_err(
                |e| match e {
                    GpuChoiceError::Malformed { .. } => RuntimeError::config(e.to_string()),
                    _ => RuntimeError::DeviceUnavailable(e.to_string()),
                },
            )?;
            open_backend(Device::Cuda(ordinal), threads)
        }
    }
}

/// How many CUDA devices the driver shows this process (after `CUDA_VISIBLE_DEVICES`);
/// [`RuntimeError::DeviceUnavailable`] without a driver or the `cuda` feature.
pub fn cuda_devices() -> Result<usize> {
    cuda_device_count().map_err(RuntimeError::DeviceUnavailable)
}

#[cfg(feature = "cuda")]
fn cuda_device_count() -> std::result::Result<usize, String> {
    shardline_models::cuda::device_count().map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn cuda_device_count() -> std::result::Result<usize, String> {
    Err("this build has no CUDA backend (cargo build -p shardline-runtime --features cuda)".into())
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
        assert!(open_rank_backend(Device::Cpu, 1, 3).is_ok());
        // Without the feature the driver cannot be asked how many GPUs there are.
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(
            open_rank_backend(Device::Cuda(0), 1, 0),
            Err(RuntimeError::DeviceUnavailable(_))
        ));
    }
}
