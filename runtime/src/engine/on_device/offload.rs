//! Offload, as FSDP2's `CPUOffloadPolicy` and ZeRO-Offload: the optimizer state (and with
//! `params`, the parameter shards too) live in host memory, and a unit's update runs on the
//! host as a host function enqueued on the `offload` stream after its reduction (CUDA's
//! `cudaLaunchHostFunc`): it copies the reduced gradient shard to the host, steps there, and
//! writes the parameters back to the device (`optimizer`) or keeps them on the host
//! (`params`, where the shard is copied to the device before each all-gather). Compute
//! stays on the device, and the copies run on their own streams, overlapping it.
//!
//! Invariant:
//! - OFFL-1: offloading changes where values live, never what is computed: a run with
//!   either policy is bitwise the run without, and the device holds less (the optimizer
//!   state; with `params` also the parameter shards).

use std::sync::{Arc, Mutex, MutexGuard};

use shardline_collectives::device::DeviceBuffer;

/// `--offload`: what lives in host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    /// Everything on the device.
    #[default]
    None,
    /// The optimizer state; the update runs on the host.
    Optimizer,
    /// The optimizer state and the parameter shards (stage 3 only); the update runs on the
    /// host and each gather copies the shard to the device first.
    Params,
}

impl Offload {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::Params => "params",
        }
    }
}

/// Host memory a host function reads and writes.
pub(crate) type HostValues = Arc<Mutex<Vec<f32>>>;

/// Where a kept buffer lives.
pub(crate) enum Held {
    /// In device memory.
    Device(DeviceBuffer),
    /// In host memory (offloaded).
    Host(HostValues),
}

impl Held {
    /// The device buffer, if it is on the device.
    pub(crate) fn on_device(&self) -> Option<&DeviceBuffer> {
        match self {
            Held::Device(b) => Some(b),
            Held::Host(_) => None,
        }
    }

    /// The host values, if offloaded.
    pub(crate) fn on_host(&self) -> Option<HostValues> {
        match self {
            Held::Device(_) => None,
            Held::Host(v) => Some(Arc::clone(v)),
        }
    }
}

/// Locks host values (a poisoned lock still holds them).
pub(crate) fn lock(v: &HostValues) -> MutexGuard<'_, Vec<f32>> {
    v.lock().unwrap_or_else(|e| e.into_inner())
}
