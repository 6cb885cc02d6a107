//! The memory accountant on a device: every device allocation of the engine is charged to
//! the rank's [`MemoryTracker`] under what it is for, so that the summary's breakdown
//! (parameters, gradients, optimizer state, gathered units, activations, ...) is a breakdown
//! of device memory, as the host engine's is of host memory.
//!
//! Invariant:
//! - DMEM-1: a device buffer is charged from its allocation until its free is enqueued,
//!   when the device counts its bytes free ([`Device::free`]): the tracker's total is the
//!   device's bytes in use at every point, and its peak is the device's peak.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use shardline_collectives::device::{Device, DeviceBuffer, DeviceError, StreamId};

use crate::error::{Result, RuntimeError};
use crate::memory::{Allocation, Category, MemoryTracker};

/// Allocates and frees a rank's device buffers, charging each to the tracker (DMEM-1).
pub(crate) struct DeviceMemory {
    dev: Arc<dyn Device>,
    tracker: MemoryTracker,
    charges: Mutex<HashMap<u64, Allocation>>,
}

impl DeviceMemory {
    /// Rank `rank`'s accountant for `dev`; the device enforces its own capacity.
    pub(crate) fn new(rank: usize, dev: Arc<dyn Device>) -> Self {
        DeviceMemory { dev, tracker: MemoryTracker::new(rank, None), charges: Default::default() }
    }

    /// The tracker the charges go to.
    pub(crate) fn tracker(&self) -> &MemoryTracker {
        &self.tracker
    }

    /// `len` elements on the device for `cat`. A device that refuses names the buffer and
    /// its capacity; the error adds what the rank holds, by category.
    pub(crate) fn alloc(&self, cat: Category, len: usize, label: &str) -> Result<DeviceBuffer> {
        let buf = self.dev.alloc(len, label).map_err(|e| match e {
            DeviceError::OutOfMemory { .. } => RuntimeError::Device(DeviceError::Failed(format!(
                "{e}; this rank holds {}",
                self.tracker.breakdown()
            ))),
            other => RuntimeError::Device(other),
        })?;
        let charge = self.tracker.alloc_f32(cat, len, label)?;
        self.charges().insert(buf.id(), charge);
        Ok(buf)
    }

    /// Frees `buf` once `stream`'s earlier work is done; its charge ends now, as the
    /// device's count does (DMEM-1).
    pub(crate) fn free(&self, stream: StreamId, buf: DeviceBuffer) -> Result<()> {
        let charge = self.charges().remove(&buf.id());
        self.dev.free(stream, buf)?;
        drop(charge);
        Ok(())
    }

    fn charges(&self) -> MutexGuard<'_, HashMap<u64, Allocation>> {
        self.charges.lock().unwrap_or_else(|e| e.into_inner())
    }
}
