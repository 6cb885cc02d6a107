//! Devices: memory the host touches only through copies, streams that run enqueued work in
//! order, events that order streams, and a communicator whose collectives are enqueued on a
//! stream, as a GPU and NCCL work.
//!
//! - [`Device`]: the interface (allocations, streams, events, copies, kernels);
//! - [`cpu`]: the host as a device, every call run at once (CPUDEV-n);
//! - [`hazard`]: the ordering rules as a pure core (vector clocks; HAZ-n);
//! - [`sim`]: a strict simulated accelerator: streams are workers with seeded random delays,
//!   every access is checked against the ordering rules, a refused access poisons the buffer
//!   and fails the device loudly, and memory has a capacity (SIM-n);
//! - [`sim_comm`]: collectives between simulated devices with NCCL's semantics: every rank
//!   must issue the same calls in the same order, or the desync is reported by rank and call
//!   (SCOMM-n).
//!
//! Values are `f32` elements. A [`DeviceBuffer`] is a handle: it has no accessor for its
//! values, so the host can read one only through [`Device::download`].

pub mod cpu;
pub mod hazard;
pub mod sim;
pub mod sim_comm;
mod usage;

pub use cpu::CpuDevice;
pub use hazard::{Hazard, StreamId, Use, VectorClock};
pub use sim::{SimDevice, SimOptions};
pub use sim_comm::{SimComm, SimWorld};
pub use usage::Reservation;

use std::sync::Arc;

/// What a device refuses or fails with.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum DeviceError {
    /// An access the ordering rules refuse (HAZ-1, HAZ-3); the buffer was poisoned.
    #[error("{0}")]
    Hazard(Hazard),
    /// An allocation past the device's capacity.
    #[error("out of device memory: allocating {bytes} bytes for '{label}' with {in_use} of {capacity} bytes in use")]
    OutOfMemory {
        /// What was being allocated.
        label: String,
        /// Its size.
        bytes: u64,
        /// Bytes in use before it.
        in_use: u64,
        /// The capacity.
        capacity: u64,
    },
    /// Ranks issued different collectives at the same place in their sequences.
    #[error("collective desync: {0}")]
    Desync(String),
    /// The device failed earlier (the first failure's message); nothing runs on it any more.
    #[error("device failed: {0}")]
    Failed(String),
    /// A call the device cannot make: sizes that disagree, a buffer of another device.
    #[error("{0}")]
    Invalid(String),
}

/// A device's results.
pub type Result<T> = std::result::Result<T, DeviceError>;

/// An allocation in device memory: a handle with no access to its values.
#[derive(Debug)]
pub struct DeviceBuffer {
    pub(crate) id: u64,
    pub(crate) device: u64,
    len: usize,
    label: Arc<str>,
}

impl DeviceBuffer {
    /// Elements (`f32`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The label it was allocated under (reports name it).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Its number, unique among its device's allocations (an accountant keys its charges
    /// by it).
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// A point in a stream's work: everything enqueued on it before the record.
#[derive(Clone, Debug)]
pub struct Event {
    pub(crate) device: u64,
    pub(crate) stream: StreamId,
    /// Operations of `stream` before the event.
    pub(crate) seq: u64,
    /// What is known done when the event has fired.
    pub(crate) clock: VectorClock,
}

/// A kernel: reads the buffers it was given to read, writes those it was given to write.
pub type Kernel = Box<dyn FnOnce(&[&[f32]], &mut [&mut [f32]]) + Send>;

/// A kernel that may fail: a collective whose peers never come, a layer that refuses its
/// input. Its error fails the device (SIM-2) and every later call reports it.
pub type FallibleKernel = Box<dyn FnOnce(&[&[f32]], &mut [&mut [f32]]) -> Result<()> + Send>;

/// A copy to the host in flight: [`Download::wait`] blocks until it is done.
pub struct Download {
    pub(crate) event: Event,
    pub(crate) data: Arc<std::sync::Mutex<Option<Vec<f32>>>>,
}

impl Download {
    /// Waits for the copy (a host synchronisation) and returns the values.
    pub fn wait(self, device: &dyn Device) -> Result<Vec<f32>> {
        device.synchronize(&self.event)?;
        let mut d = self.data.lock().unwrap_or_else(|e| e.into_inner());
        d.take().ok_or_else(|| DeviceError::Failed("the copy to the host did not run".into()))
    }
}

/// A device: memory, streams, events, copies and kernels. Every call that enqueues work
/// returns at once; the work runs later, in its stream's order.
pub trait Device: Send + Sync {
    /// The device's number, unique in the process: a tensor made by its kernels is placed
    /// on it, and its buffers carry it.
    fn id(&self) -> u64;
    /// Adds a stream; its name appears in reports.
    fn stream(&self, name: &str) -> StreamId;
    /// Allocates `len` elements, refused past the capacity.
    fn alloc(&self, len: usize, label: &str) -> Result<DeviceBuffer>;
    /// Frees `buf` once the work enqueued on `stream` before it is done (stream-ordered);
    /// its bytes count as free at once.
    fn free(&self, stream: StreamId, buf: DeviceBuffer) -> Result<()>;
    /// Copies `src` (taken now) into `dst` on `stream`.
    fn upload(&self, stream: StreamId, src: &[f32], dst: &DeviceBuffer) -> Result<()>;
    /// Copies `src` to the host on `stream`.
    fn download(&self, stream: StreamId, src: &DeviceBuffer) -> Result<Download>;
    /// Copies `src` into `dst` (equal lengths) on `stream`.
    fn copy(&self, stream: StreamId, src: &DeviceBuffer, dst: &DeviceBuffer) -> Result<()>;
    /// Runs `kernel` on `stream` over `reads` and `writes` (no buffer in both).
    fn launch(
        &self,
        stream: StreamId,
        name: &str,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
        kernel: Kernel,
    ) -> Result<()> {
        let k: FallibleKernel = Box::new(move |r, w| {
            kernel(r, w);
            Ok(())
        });
        self.launch_fallible(stream, name, reads, writes, k)
    }
    /// [`Device::launch`] for a kernel that may fail: its error fails the device.
    fn launch_fallible(
        &self,
        stream: StreamId,
        name: &str,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
        kernel: FallibleKernel,
    ) -> Result<()>;
    /// Takes `bytes` of device memory for what a running kernel makes (the tensors a layer
    /// saves for backward, its temporaries), counted with the allocations (in use, peak,
    /// capacity) until the reservation is dropped (USAGE-1). Kernels call it while they run,
    /// as a caching allocator serves them; past the capacity it is refused.
    fn reserve(&self, bytes: u64, label: &str) -> Result<Reservation>;
    /// Records an event on `stream`.
    fn record(&self, stream: StreamId) -> Event;
    /// Makes `stream`'s later work wait for `event`.
    fn wait(&self, stream: StreamId, event: &Event);
    /// Whether `event` has fired.
    fn query(&self, event: &Event) -> bool;
    /// Blocks the host until `event` has fired; fails if the device failed.
    fn synchronize(&self, event: &Event) -> Result<()>;
    /// Bytes allocated and not freed.
    fn in_use(&self) -> u64;
    /// Most bytes allocated at once so far (freed bytes count as free when the free is
    /// enqueued, as a caching allocator reuses them for work ordered after it).
    fn peak(&self) -> u64;
    /// The operations run since the last call, when the device records them
    /// ([`SimOptions::timeline`]); none otherwise.
    fn take_timeline(&self) -> Vec<OpSpan> {
        Vec::new()
    }
}

/// One operation as a stream ran it: for traces and overlap figures.
#[derive(Clone, Debug)]
pub struct OpSpan {
    /// The stream's name.
    pub stream: String,
    /// The operation's name.
    pub op: String,
    /// When it started running (after its delay and its waits).
    pub start: std::time::Instant,
    /// When it ended.
    pub end: std::time::Instant,
}
