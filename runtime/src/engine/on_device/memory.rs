//! The memory accountant on a device: every device allocation of the engine is charged to
//! the rank's [`MemoryTracker`] under what it is for, so that the summary's breakdown
//! (parameters, gradients, optimizer state, gathered units, activations, ...) is a breakdown
//! of device memory, as the host engine's is of host memory.
//!
//! What kernels make beyond their buffers (`kernel_memory`) is reserved on the device
//! ([`Device::reserve`]) and charged the same way, from the kernel's enqueue.
//!
//! Invariant:
//! - DMEM-1: a device buffer is charged from its allocation until its free is enqueued,
//!   when the device counts its bytes free ([`Device::free`]), and a reservation from its
//!   making to its drop: the tracker's total is the device's bytes in use at every point,
//!   and its peak is the device's peak.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use shardline_collectives::device::{Device, DeviceBuffer, DeviceError, Reservation, StreamId};

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
        let buf = self.dev.alloc(len, label).map_err(|e| self.refused(e))?;
        let charge = self.tracker.alloc_f32(cat, len, label)?;
        self.charges().insert(buf.id(), charge);
        Ok(buf)
    }

    /// `bytes` of device memory for what kernels make, charged to `cat` until the result
    /// is dropped (DMEM-1).
    pub(crate) fn reserve(&self, cat: Category, bytes: u64, label: &str) -> Result<Reserved> {
        let r = self.dev.reserve(bytes, label).map_err(|e| self.refused(e))?;
        let charge = self.tracker.alloc(cat, bytes, label)?;
        Ok(Reserved { _device: r, _charge: charge })
    }

    fn refused(&self, e: DeviceError) -> RuntimeError {
        match e {
            DeviceError::OutOfMemory { .. } => RuntimeError::Device(DeviceError::Failed(format!(
                "{e}; this rank holds {}",
                self.tracker.breakdown()
            ))),
            other => RuntimeError::Device(other),
        }
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

/// Device memory reserved for kernels and its charge, given back together when dropped
/// (DMEM-1).
pub(crate) struct Reserved {
    _device: Reservation,
    _charge: Allocation,
}
