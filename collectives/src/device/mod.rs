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
//!   (SCOMM-n);
//! - [`failing`]: any device made to fail at its n-th call, at the call or when the work
//!   runs, for fault-injection tests (FAILDEV-n);
//! - [`comm`]: what the engine asks of a device's communicator ([`DeviceComm`]), which the
//!   simulated collectives and NCCL (feature `cuda`, in the models crate) both answer.
//!
//! Values are `f32` elements. A [`DeviceBuffer`] is a handle: it has no accessor for its
//! values, so the host can read one only through [`Device::download`].
//!
//! Kernels come in two kinds. A [`Kernel`] is host code over the buffers' values: the cpu
//! and simulated devices run it, a GPU cannot. A [`DeviceOp`] is a kernel described by value
//! (a GEMM's shape, an update's hyper-parameters): a device with its own code for it (the
//! CUDA device runs cuBLAS or a compiled kernel) runs that, any other device runs the op's
//! host reference (DEVOP-1). [`SimOptions::ops_only`] makes the simulated device refuse host
//! kernels as a GPU does, so a test shows which work is already described as ops.
//!
//! Invariants:
//! - DEVOP-1: [`Device::launch_op`] checks the op against its buffers' lengths before
//!   anything is enqueued ([`DeviceOp::check`]), on every device; a device without code of
//!   its own runs [`DeviceOp::run_host`] as a fallible kernel, so the op's host reference is
//!   what the cpu and simulated devices compute.
//! - DEVOP-2: a kernel or op given a view ([`DeviceBuffer::view`]) reads and writes only the
//!   view's elements of its allocation; frees, copies and collectives refuse views.

pub mod comm;
pub mod cpu;
pub mod failing;
pub mod hazard;
pub mod sim;
pub mod sim_comm;
mod usage;

pub use comm::DeviceComm;
pub use cpu::CpuDevice;
pub use failing::{FailWhen, FailingDevice};
pub use hazard::{Hazard, StreamId, Use, VectorClock};
pub use sim::{SimDevice, SimOptions};
pub use sim_comm::{SimComm, SimWorld};
pub use usage::{Reservation, Usage};

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
    /// A call the device cannot make: sizes that disagree, a buffer of another device, a
    /// host kernel on a device that runs only ops.
    #[error("{0}")]
    Invalid(String),
    /// The device cannot be opened here: no driver, library or device (named).
    #[error("device unavailable: {0}")]
    Unavailable(String),
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
    /// Where a view starts in its allocation (0 for the allocation itself).
    offset: usize,
    /// Whether this is a view ([`DeviceBuffer::view`]) rather than the allocation.
    view: bool,
}

impl DeviceBuffer {
    /// A handle for a [`Device`] implementation to hand out: allocation `id` of device
    /// `device` (its [`Device::id`]), `len` elements.
    pub fn new(id: u64, device: u64, len: usize, label: &str) -> Self {
        DeviceBuffer { id, device, len, label: label.into(), offset: 0, view: false }
    }

    /// Elements `range` of this buffer as a buffer of their own, for kernels and ops
    /// (DEVOP-2): ordered as a use of the whole allocation, never freed, copied to or from
    /// the host, or handed to a collective.
    pub fn view(&self, range: std::ops::Range<usize>) -> Result<DeviceBuffer> {
        if range.start > range.end || range.end > self.len {
            return Err(DeviceError::Invalid(format!(
                "view {range:?} of '{}' ({} elements)",
                self.label, self.len
            )));
        }
        Ok(DeviceBuffer {
            id: self.id,
            device: self.device,
            len: range.len(),
            label: format!("{}[{}..{}]", self.label, range.start, range.end).into(),
            offset: self.offset + range.start,
            view: true,
        })
    }

    /// Its elements within the allocation: `0..len` for an allocation, a view's range.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }

    /// Whether it is a view of another buffer.
    pub fn is_view(&self) -> bool {
        self.view
    }

    /// `Invalid` for a view: `what` takes only whole allocations (DEVOP-2).
    pub fn whole(&self, what: &str) -> Result<()> {
        if self.view {
            Err(DeviceError::Invalid(format!(
                "{what} takes whole allocations, not the view '{}'",
                self.label
            )))
        } else {
            Ok(())
        }
    }

    /// The device it belongs to ([`Device::id`]).
    pub fn device(&self) -> u64 {
        self.device
    }

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
    /// A hardware device's own event (a `CUevent`), for the device that recorded it.
    pub(crate) native: Option<NativeEvent>,
}

/// A hardware device's event object, carried by an [`Event`] for the device that made it.
#[derive(Clone)]
pub struct NativeEvent(pub Arc<dyn std::any::Any + Send + Sync>);

impl std::fmt::Debug for NativeEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NativeEvent")
    }
}

impl Event {
    /// An event of a device outside this crate: recorded on `stream` of device `device`,
    /// carrying the device's own event object.
    pub fn native(device: u64, stream: StreamId, native: NativeEvent) -> Self {
        Event { device, stream, seq: 0, clock: VectorClock::default(), native: Some(native) }
    }

    /// The device that recorded it.
    pub fn device(&self) -> u64 {
        self.device
    }

    /// The stream it was recorded on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// The device's own event object, if it has one.
    pub fn native_event(&self) -> Option<&NativeEvent> {
        self.native.as_ref()
    }
}

/// A kernel: reads the buffers it was given to read, writes those it was given to write.
pub type Kernel = Box<dyn FnOnce(&[&[f32]], &mut [&mut [f32]]) + Send>;

/// A kernel that may fail: a collective whose peers never come, a layer that refuses its
/// input. Its error fails the device (SIM-2) and every later call reports it.
pub type FallibleKernel = Box<dyn FnOnce(&[&[f32]], &mut [&mut [f32]]) -> Result<()> + Send>;

/// What a download finishes with once its event has fired: the values (pinned memory
/// copied out, for a hardware device).
pub type Finish = Box<dyn FnOnce() -> Result<Vec<f32>> + Send>;

/// A copy to the host in flight: [`Download::wait`] blocks until it is done.
pub struct Download {
    pub(crate) event: Event,
    pub(crate) data: Arc<std::sync::Mutex<Option<Vec<f32>>>>,
    pub(crate) finish: Option<Finish>,
}

impl Download {
    /// A download of a device outside this crate: done when `event` has fired, its values
    /// then given by `finish`.
    pub fn deferred(event: Event, finish: Finish) -> Self {
        Download { event, data: Arc::default(), finish: Some(finish) }
    }

    /// Waits for the copy (a host synchronisation) and returns the values.
    pub fn wait(self, device: &dyn Device) -> Result<Vec<f32>> {
        device.synchronize(&self.event)?;
        if let Some(finish) = self.finish {
            return finish();
        }
        let mut d = self.data.lock().unwrap_or_else(|e| e.into_inner());
        d.take().ok_or_else(|| DeviceError::Failed("the copy to the host did not run".into()))
    }
}

/// A kernel described by value (DEVOP-1): its buffers are passed as reads and writes, in the
/// order the op documents. A device with code of its own for the op runs that (it finds the
/// op's type through [`DeviceOp::as_any`]); others run [`DeviceOp::run_host`].
pub trait DeviceOp: Send + Sync + std::fmt::Debug + 'static {
    /// What errors and timelines call it.
    fn name(&self) -> String;
    /// Whether `reads` and `writes` (the buffers' lengths, in order) fit the op; checked
    /// before every launch, so a device's own code never runs out of its buffers.
    fn check(&self, reads: &[usize], writes: &[usize]) -> std::result::Result<(), String>;
    /// The host reference: what the op computes, over the buffers' values.
    fn run_host(&self, reads: &[&[f32]], writes: &mut [&mut [f32]]) -> Result<()>;
    /// The op as `Any`, for a device to find its own code by the op's type.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Host work run once as an op, so that a device refusing host kernels still runs it: a
/// simulated collective (as a GPU runs NCCL's kernels), an injected failure. Its lengths
/// were checked by whoever made it.
pub(crate) struct HostOnce {
    name: String,
    body: std::sync::Mutex<Option<FallibleKernel>>,
}

impl HostOnce {
    pub(crate) fn arc(name: String, body: FallibleKernel) -> Arc<dyn DeviceOp> {
        Arc::new(HostOnce { name, body: std::sync::Mutex::new(Some(body)) })
    }
}

impl std::fmt::Debug for HostOnce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostOnce({})", self.name)
    }
}

impl DeviceOp for HostOnce {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn check(&self, _reads: &[usize], _writes: &[usize]) -> std::result::Result<(), String> {
        Ok(())
    }
    fn run_host(&self, reads: &[&[f32]], writes: &mut [&mut [f32]]) -> Result<()> {
        match self.body.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(b) => b(reads, writes),
            None => Err(DeviceError::Failed(format!("{} ran twice", self.name))),
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// An op as a host kernel (its host reference), after [`check_op`]: what a device without
/// code of its own enqueues for it (DEVOP-1).
pub(crate) fn host_reference(
    op: Arc<dyn DeviceOp>,
    reads: &[&DeviceBuffer],
    writes: &[&DeviceBuffer],
) -> Result<(String, FallibleKernel)> {
    check_op(&*op, reads, writes)?;
    Ok((op.name(), Box::new(move |r, w| op.run_host(r, w))))
}

/// [`DeviceOp::check`] on the buffers, as every device runs it first (DEVOP-1).
pub fn check_op(
    op: &dyn DeviceOp,
    reads: &[&DeviceBuffer],
    writes: &[&DeviceBuffer],
) -> Result<()> {
    let r: Vec<usize> = reads.iter().map(|b| b.len()).collect();
    let w: Vec<usize> = writes.iter().map(|b| b.len()).collect();
    op.check(&r, &w).map_err(|e| DeviceError::Invalid(format!("{}: {e}", op.name())))
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
    /// Runs `op` on `stream` over `reads` and `writes` (DEVOP-1): the device's own code for
    /// it, or its host reference.
    fn launch_op(
        &self,
        stream: StreamId,
        op: Arc<dyn DeviceOp>,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
    ) -> Result<()> {
        let (name, kernel) = host_reference(op, reads, writes)?;
        self.launch_fallible(stream, &name, reads, writes, kernel)
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
