//! The CUDA device: [`Device`] of shardline-collectives over one GPU, a thin mapping of its
//! calls to cudarc's. Streams are CUDA streams, events CUDA events, allocations
//! `CudaSlice<f32>` (each launch gets views of them); the model ops ([`Op`]) run as cuBLAS
//! products and the kernels of `ops.cu` and `kernels.cu`, each op's mapping in
//! `device_ops.rs`. There is no engine logic here: the caller orders its streams with
//! events, as on any device.
//!
//! Memory. Allocations are made and zeroed on an internal allocation stream and counted
//! against the capacity (USAGE-1). cudarc's event tracking (on, and made explicit at
//! [`CudaDevice::open`]) records each slice's last write and read; the zeroing is the first
//! write, so any stream that touches a new buffer first waits for it. A free is
//! stream-ordered: the allocation stream waits for an event recorded on the freeing stream,
//! then the slice is dropped, which frees it on the allocation stream after that work.
//!
//! Copies. [`Device::upload`] copies from the caller's (pageable) slice with
//! `cuMemcpyHtoDAsync`, which, for pageable memory, has staged the source by the time it
//! returns (CUDA's "API synchronization behavior"): the source is taken at call time.
//! [`Device::download`] copies into a page-locked buffer on the stream; its
//! [`Download`]'s finish copies that out once the copy's event has fired.
//!
//! Views (DEVOP-2). An op's buffers may be views ([`DeviceBuffer::view`]): each launch gets
//! a cudarc view (`CudaView`, `CudaViewMut`) of the handle's `range()` of its allocation,
//! as long as the handle, so the kernels and cuBLAS reach only those elements. Aliasing is
//! judged by allocation: two views of one allocation may both be read, never both written
//! nor one read and one written by the same op. A cudarc view shares its allocation's
//! read and write events, so a use of a view is ordered by cudarc's tracking as a use of
//! the whole allocation (more order than the views need, none less). Frees, copies
//! ([`Device::upload`], [`Device::download`], [`Device::copy`]) and NCCL's collectives take
//! whole allocations only and refuse views with `Invalid`.
//!
//! Enqueues hold the device's buffer table for their duration (buffers are borrowed from it,
//! writes mutably, as cudarc's tracking wants), so enqueues from several threads are
//! serialised; the work they enqueue still runs concurrently on the GPU.
//!
//! Invariants:
//! - CUDADEV-1: host closures ([`Device::launch`], [`Device::launch_fallible`]) are refused
//!   by name with `Invalid`; nothing is staged through the host.
//! - CUDADEV-2: every op is checked ([`check_op`]) and its buffers found live on this device
//!   (a view within its allocation), no allocation both read and written or written twice,
//!   before anything is enqueued, so every kernel stays within its buffers' views (the
//!   kernels bound their indices by the sizes checked there, the views' lengths: DEVOP-2).
//! - CUDADEV-3: any CUDA failure is returned as `DeviceError::Failed` naming the call and
//!   `cuda:{ordinal}`; the first is kept and every later call fails with it (a device that
//!   failed stays failed). Nothing panics on a CUDA error.
//! - CUDADEV-4: without the driver, a library or the GPU, [`CudaDevice::open`] is
//!   `Unavailable` naming what is missing, and no cudarc call is made before the libraries
//!   are found (cudarc panics on a missing one).
//! - CUDADEV-5: bytes in use are counted when allocated and given back when the free is
//!   enqueued (USAGE-1); past the capacity (or the driver's own out-of-memory) an allocation
//!   is refused with `OutOfMemory`, changing nothing and failing nothing; the memory itself
//!   is released only after the freeing stream's earlier work.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError,
    PinnedHostSlice,
};
use shardline_collectives::device::{
    check_op, Device, DeviceBuffer, DeviceError, DeviceOp, Download, Event, FallibleKernel,
    NativeEvent, Reservation, Result, StreamId, Usage,
};

pub use super::device_ops::OPS_CU;
use super::device_ops::{uses_blas, Kernels};
use crate::error::ModelError;
use crate::ops::Op;

/// CUDA device ids: past the simulated (from 1) and host (from 2^40) devices' ids.
static NEXT_CUDA: AtomicU64 = AtomicU64::new(1 << 48);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn u64_of(n: usize) -> u64 {
    n as u64
}

/// A stream: the CUDA stream (`None` when creating it failed, which failed the device) and
/// its cuBLAS handle, made on first use.
struct StreamSlot {
    cuda: Option<Arc<CudaStream>>,
    blas: Option<Arc<CudaBlas>>,
}

/// A live allocation: at least one element (a zero-length buffer gets one, never touched),
/// its length as the handle gives it, and its bytes in the count.
struct Alloc {
    slice: CudaSlice<f32>,
    len: usize,
    _bytes: Reservation,
}

#[derive(Default)]
struct Buffers {
    map: HashMap<u64, Alloc>,
    next: u64,
}

/// One GPU as a [`Device`] (CUDADEV-1..5).
pub struct CudaDevice {
    id: u64,
    ordinal: usize,
    capacity: Option<u64>,
    ctx: Arc<CudaContext>,
    /// Allocations are made, zeroed and freed here.
    alloc_stream: Arc<CudaStream>,
    streams: Mutex<Vec<StreamSlot>>,
    buffers: Mutex<Buffers>,
    /// The memory count (USAGE-1, CUDADEV-5): allocations and [`Device::reserve`]'s
    /// reservations.
    count: Arc<Usage>,
    /// The first failure (CUDADEV-3); shared with the downloads' finishes.
    failed: Arc<Mutex<Option<String>>>,
    /// The ops' kernels (run in `device_ops.rs`).
    pub(super) k: Kernels,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("id", &self.id).field("ordinal", &self.ordinal).finish()
    }
}

/// Records `msg` as the device's failure unless one is there; returns the first.
fn record_failure(slot: &Mutex<Option<String>>, msg: String) -> DeviceError {
    let mut f = lock(slot);
    if f.is_none() {
        tracing::error!("CUDA device failed: {msg}");
        *f = Some(msg);
    }
    DeviceError::Failed(f.clone().unwrap_or_default())
}

impl CudaDevice {
    /// Opens GPU `ordinal` with at most `capacity` bytes of allocations and reservations
    /// (`None`: only the GPU's memory bounds them). `Unavailable` without the driver, the
    /// libraries or the GPU (CUDADEV-4).
    pub fn open(ordinal: usize, capacity: Option<u64>) -> Result<CudaDevice> {
        // CUDADEV-4: cudarc panics on a missing library, so nothing else runs before this
        // (the libraries first, then the ordinal).
        super::check_ordinal(ordinal).map_err(|e| match e {
            ModelError::DeviceUnavailable(what) => DeviceError::Unavailable(what),
            other => DeviceError::Unavailable(other.to_string()),
        })?;
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| DeviceError::Unavailable(format!("cuda:{ordinal}: {e:?}")))?;
        // SAFETY: no slice of this context exists yet, so every slice is tracked; tracking
        // (cudarc's default) is what orders a new buffer's zeroing before its first use.
        unsafe { ctx.enable_event_tracking() };
        let alloc_stream = ctx.new_stream().map_err(|e| {
            DeviceError::Failed(format!("allocation stream on cuda:{ordinal}: {e:?}"))
        })?;
        let k = Kernels::load(&ctx, ordinal)?;
        Ok(CudaDevice {
            id: NEXT_CUDA.fetch_add(1, Ordering::Relaxed),
            ordinal,
            capacity,
            ctx,
            alloc_stream,
            streams: Mutex::new(Vec::new()),
            buffers: Mutex::new(Buffers { map: HashMap::new(), next: 1 }),
            count: Usage::new(capacity),
            failed: Arc::new(Mutex::new(None)),
            k,
        })
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device name, as the driver reports it.
    pub fn name(&self) -> String {
        super::context_name(&self.ctx)
    }

    /// The device's first failure, if it failed.
    pub fn failure(&self) -> Option<String> {
        lock(&self.failed).clone()
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Records a CUDA failure of `what` (CUDADEV-3) and returns the device's first.
    pub(crate) fn fail(&self, what: &str, e: impl std::fmt::Debug) -> DeviceError {
        record_failure(&self.failed, format!("{what} on cuda:{}: {e:?}", self.ordinal))
    }

    /// `Failed` with the first failure if the device failed; binds its context to the
    /// calling thread otherwise (cuBLAS and NCCL use the thread's current context).
    pub(crate) fn begin(&self) -> Result<()> {
        if let Some(m) = self.failure() {
            return Err(DeviceError::Failed(m));
        }
        self.ctx.bind_to_thread().map_err(|e| self.fail("binding the context", e))
    }

    fn mine(&self, b: &DeviceBuffer) -> Result<()> {
        if b.device() == self.id {
            Ok(())
        } else {
            Err(DeviceError::Invalid(format!(
                "buffer '{}' belongs to another device than cuda:{}",
                b.label(),
                self.ordinal
            )))
        }
    }

    /// The CUDA stream of `s`.
    pub(crate) fn cuda_stream(&self, s: StreamId) -> Result<Arc<CudaStream>> {
        let st = lock(&self.streams);
        match st.get(s) {
            None => Err(DeviceError::Invalid(format!("no stream {s} on cuda:{}", self.ordinal))),
            Some(slot) => slot.cuda.clone().ok_or_else(|| {
                DeviceError::Failed(self.failure().unwrap_or_else(|| format!("stream {s} failed")))
            }),
        }
    }

    /// The cuBLAS handle of stream `s`, created on first use, bound to that stream.
    fn blas(&self, s: StreamId, cs: &Arc<CudaStream>) -> Result<Arc<CudaBlas>> {
        let mut st = lock(&self.streams);
        let Some(slot) = st.get_mut(s) else {
            return Err(DeviceError::Invalid(format!("no stream {s} on cuda:{}", self.ordinal)));
        };
        if let Some(b) = &slot.blas {
            return Ok(Arc::clone(b));
        }
        let b = Arc::new(
            CudaBlas::new(Arc::clone(cs))
                .map_err(|e| self.fail(&format!("cuBLAS handle of stream {s}"), e))?,
        );
        slot.blas = Some(Arc::clone(&b));
        Ok(b)
    }

    /// Runs `f` over device views of `reads` and `writes` (CUDADEV-2: each live on this
    /// device, an allocation with the handle's length or a view within its allocation; no
    /// allocation both read and written, none written twice), the buffer table held
    /// meanwhile. Each view is `range()` of its allocation and as long as its handle, so a
    /// launch over it reaches only the handle's elements (DEVOP-2).
    ///
    /// Event tracking with views: a cudarc view carries its parent slice's read and write
    /// events, so a launch over a view waits for the last recorded write of the whole
    /// allocation (and, writing, its last recorded read) and records the allocation's event
    /// after it. Views of one allocation are thus ordered as uses of the whole allocation,
    /// as [`DeviceBuffer::view`] says: disjoint views used on two streams are serialised
    /// through those events (more order than the views need, none less than whole
    /// allocations get; the engine's own events remain what orders its streams). The waits
    /// are enqueued (`cuStreamWaitEvent` on the event's latest record) and the records
    /// follow the enqueue, so nothing blocks the host, and nothing panics: the ranges are
    /// checked here and sliced with `try_slice`.
    pub(crate) fn with_slices<R>(
        &self,
        what: &str,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
        f: impl FnOnce(&[CudaView<'_, f32>], &mut [CudaViewMut<'_, f32>]) -> Result<R>,
    ) -> Result<R> {
        for b in reads.iter().chain(writes) {
            self.mine(b)?;
        }
        // By allocation id: two views of one allocation are one buffer here.
        for (i, w) in writes.iter().enumerate() {
            if reads.iter().any(|r| r.id() == w.id()) {
                return Err(DeviceError::Invalid(format!(
                    "{what}: buffer '{}' is both read and written",
                    w.label()
                )));
            }
            if writes[..i].iter().any(|o| o.id() == w.id()) {
                return Err(DeviceError::Invalid(format!(
                    "{what}: buffer '{}' is written twice",
                    w.label()
                )));
            }
        }
        let mut st = lock(&self.buffers);
        for b in reads.iter().chain(writes) {
            match st.map.get(&b.id()) {
                None => {
                    return Err(DeviceError::Invalid(format!(
                        "{what}: buffer '{}' was freed",
                        b.label()
                    )))
                }
                Some(a) if b.is_view() && b.range().end > a.len => {
                    return Err(DeviceError::Invalid(format!(
                        "{what}: view '{}' ({:?}) past its allocation's {} elements",
                        b.label(),
                        b.range(),
                        a.len
                    )))
                }
                Some(a) if !b.is_view() && a.len != b.len() => {
                    return Err(DeviceError::Invalid(format!(
                        "{what}: buffer '{}' has {} elements, its handle says {}",
                        b.label(),
                        a.len,
                        b.len()
                    )))
                }
                Some(_) => {}
            }
        }
        // The written slices leave the table for the call, so that they can be borrowed
        // mutably while the read ones are borrowed from it.
        let mut taken: Vec<(u64, Alloc)> = Vec::with_capacity(writes.len());
        for w in writes {
            if let Some(a) = st.map.remove(&w.id()) {
                taken.push((w.id(), a));
            }
        }
        let out = if taken.len() != writes.len() {
            Err(DeviceError::Invalid(format!("{what}: a written buffer was freed")))
        } else {
            // `range()` is within the allocation's handle length (checked above), which is
            // within the slice (at least one element): the slicing cannot fail.
            let rs: Vec<CudaView<'_, f32>> = reads
                .iter()
                .filter_map(|b| st.map.get(&b.id()).and_then(|a| a.slice.try_slice(b.range())))
                .collect();
            let mut ws: Vec<CudaViewMut<'_, f32>> = taken
                .iter_mut()
                .zip(writes)
                .filter_map(|((_, a), b)| a.slice.try_slice_mut(b.range()))
                .collect();
            if rs.len() != reads.len() || ws.len() != writes.len() {
                Err(DeviceError::Invalid(format!("{what}: a buffer was freed or out of range")))
            } else {
                f(&rs, &mut ws)
            }
        };
        for (id, a) in taken {
            st.map.insert(id, a);
        }
        out
    }

    /// A temporary of `len` elements on stream `cs` for an op (freed on that stream after
    /// the op's work when dropped), counted while the enqueue runs.
    pub(super) fn scratch<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        cs: &Arc<CudaStream>,
        len: usize,
        label: &str,
    ) -> Result<(CudaSlice<T>, Reservation)> {
        let bytes = u64_of(len.max(1)) * std::mem::size_of::<T>() as u64;
        let r = self.count.reserve(bytes, label)?;
        let s = cs.alloc_zeros::<T>(len.max(1)).map_err(|e| self.alloc_error(label, bytes, e))?;
        Ok((s, r))
    }

    /// A failed allocation: the driver's out-of-memory as `OutOfMemory` (the device stays
    /// usable), anything else a device failure.
    fn alloc_error(&self, label: &str, bytes: u64, e: DriverError) -> DeviceError {
        if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let total = self.ctx.total_mem().map(|t| t as u64).unwrap_or(0);
            DeviceError::OutOfMemory {
                label: label.to_string(),
                bytes,
                in_use: self.count.in_use().saturating_sub(bytes),
                capacity: self.capacity.unwrap_or(total),
            }
        } else {
            self.fail(&format!("allocating {bytes} bytes for '{label}'"), e)
        }
    }

    /// An event recorded on stream `s` (`cs`).
    fn record_on(&self, s: StreamId, cs: &CudaStream) -> Result<Event> {
        let ev =
            cs.record_event(None).map_err(|e| self.fail(&format!("record on stream {s}"), e))?;
        Ok(Event::native(self.id, s, NativeEvent(Arc::new(ev))))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // cudarc's CudaBlas panics when cublasDestroy fails, as it may on a context that hit
        // a sticky error: a failed device leaks its handles instead (CUDADEV-3).
        if self.failure().is_some() {
            for slot in lock(&self.streams).iter_mut() {
                if let Some(b) = slot.blas.take() {
                    std::mem::forget(b);
                }
            }
        }
    }
}

/// What a failed record leaves in its event: the device failed, so waiting on it fails.
struct RecordFailed;

impl Device for CudaDevice {
    fn id(&self) -> u64 {
        self.id
    }

    fn stream(&self, name: &str) -> StreamId {
        // The trait's `stream` returns no Result: a failure to create one fails the device
        // (CUDADEV-3), and the index it gets fails every later use.
        let cuda = match self.begin() {
            Ok(()) => match self.ctx.new_stream() {
                Ok(s) => Some(s),
                Err(e) => {
                    self.fail(&format!("creating stream '{name}'"), e);
                    None
                }
            },
            Err(_) => None,
        };
        let mut st = lock(&self.streams);
        st.push(StreamSlot { cuda, blas: None });
        st.len() - 1
    }

    fn alloc(&self, len: usize, label: &str) -> Result<DeviceBuffer> {
        self.begin()?;
        let bytes = u64_of(len)
            .checked_mul(4)
            .ok_or_else(|| DeviceError::Invalid(format!("'{label}': {len} elements")))?;
        // CUDADEV-5: counted first; a refusal changes nothing.
        let counted = self.count.reserve(bytes, label)?;
        // Zeroed on the allocation stream; cudarc's tracking makes a stream that uses the
        // buffer wait for the zeroing first (its write event).
        let slice = self
            .alloc_stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(|e| self.alloc_error(label, bytes, e))?;
        let mut st = lock(&self.buffers);
        let id = st.next;
        st.next += 1;
        st.map.insert(id, Alloc { slice, len, _bytes: counted });
        Ok(DeviceBuffer::new(id, self.id, len, label))
    }

    fn free(&self, stream: StreamId, buf: DeviceBuffer) -> Result<()> {
        self.begin()?;
        self.mine(&buf)?;
        buf.whole("free")?;
        let cs = self.cuda_stream(stream)?;
        let alloc = {
            let mut st = lock(&self.buffers);
            match st.map.get(&buf.id()) {
                None => {
                    return Err(DeviceError::Invalid(format!(
                        "free of '{}': already freed",
                        buf.label()
                    )))
                }
                Some(a) if a.len != buf.len() => {
                    return Err(DeviceError::Invalid(format!(
                        "free of '{}': {} elements, its handle says {}",
                        buf.label(),
                        a.len,
                        buf.len()
                    )))
                }
                Some(_) => st.map.remove(&buf.id()),
            }
        };
        let Some(Alloc { slice, len: _, _bytes: counted }) = alloc else {
            return Err(DeviceError::Invalid(format!("free of '{}': already freed", buf.label())));
        };
        // CUDADEV-5: the bytes count as free now.
        drop(counted);
        // Stream-ordered: the allocation stream waits for `stream`'s work so far, then the
        // drop frees the slice there (cuMemFreeAsync, after also waiting for the slice's last
        // recorded read and write).
        match cs.record_event(None).and_then(|ev| self.alloc_stream.wait(&ev)) {
            Ok(()) => {
                drop(slice);
                Ok(())
            }
            Err(e) => {
                // Unordered, the free could race the stream's work: leak it instead.
                std::mem::forget(slice);
                Err(self.fail(&format!("free of '{}'", buf.label()), e))
            }
        }
    }

    fn upload(&self, stream: StreamId, src: &[f32], dst: &DeviceBuffer) -> Result<()> {
        self.begin()?;
        dst.whole("upload")?;
        if src.len() != dst.len() {
            return Err(DeviceError::Invalid(format!(
                "upload of {} elements into '{}' of {}",
                src.len(),
                dst.label(),
                dst.len()
            )));
        }
        let cs = self.cuda_stream(stream)?;
        self.with_slices("upload", &[], &[dst], |_, w| {
            if src.is_empty() {
                return Ok(());
            }
            // From pageable memory the driver stages `src` before returning, so the caller
            // may reuse it at once (the copy to the device itself runs in stream order).
            cs.memcpy_htod(src, &mut w[0])
                .map_err(|e| self.fail(&format!("upload into '{}'", dst.label()), e))
        })
    }

    fn download(&self, stream: StreamId, src: &DeviceBuffer) -> Result<Download> {
        self.begin()?;
        src.whole("download")?;
        let cs = self.cuda_stream(stream)?;
        let n = src.len();
        let pinned = self.with_slices("download", &[src], &[], |r, _| {
            if n == 0 {
                return Ok(None);
            }
            // SAFETY: the buffer is uninitialised until the copy below writes all `n`
            // elements; it is read only in the finish, after the copy's event. Flags 0: cached
            // (not write-combined) memory, which the host reads back fast.
            let mut host: PinnedHostSlice<f32> = unsafe { self.ctx.alloc_pinned_with_flags(n, 0) }
                .map_err(|e| self.fail(&format!("pinned buffer for '{}'", src.label()), e))?;
            cs.memcpy_dtoh(&r[0], &mut host)
                .map_err(|e| self.fail(&format!("download of '{}'", src.label()), e))?;
            Ok(Some(host))
        })?;
        let event = self.record_on(stream, &cs)?;
        let (failed, what) = (
            Arc::clone(&self.failed),
            format!("download of '{}' on cuda:{}", src.label(), self.ordinal),
        );
        Ok(Download::deferred(
            event,
            Box::new(move || match pinned {
                None => Ok(Vec::new()),
                Some(host) => host
                    .as_slice()
                    .map(|v| v.to_vec())
                    .map_err(|e| record_failure(&failed, format!("{what}: {e:?}"))),
            }),
        ))
    }

    fn copy(&self, stream: StreamId, src: &DeviceBuffer, dst: &DeviceBuffer) -> Result<()> {
        self.begin()?;
        src.whole("copy")?;
        dst.whole("copy")?;
        if src.len() != dst.len() {
            return Err(DeviceError::Invalid(format!(
                "copy of '{}' ({} elements) into '{}' ({})",
                src.label(),
                src.len(),
                dst.label(),
                dst.len()
            )));
        }
        let cs = self.cuda_stream(stream)?;
        if src.id() == dst.id() && src.device() == dst.device() {
            // A buffer onto itself changes nothing.
            return self.with_slices("copy", &[src], &[], |_, _| Ok(()));
        }
        self.with_slices("copy", &[src], &[dst], |r, w| {
            if src.is_empty() {
                return Ok(());
            }
            cs.memcpy_dtod(&r[0], &mut w[0]).map_err(|e| {
                self.fail(&format!("copy of '{}' into '{}'", src.label(), dst.label()), e)
            })
        })
    }

    fn launch_fallible(
        &self,
        _stream: StreamId,
        name: &str,
        _reads: &[&DeviceBuffer],
        _writes: &[&DeviceBuffer],
        _kernel: FallibleKernel,
    ) -> Result<()> {
        // CUDADEV-1
        Err(DeviceError::Invalid(format!(
            "kernel '{name}' is host code: the CUDA device runs only ops (DeviceOp)"
        )))
    }

    fn launch_op(
        &self,
        stream: StreamId,
        op: Arc<dyn DeviceOp>,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
    ) -> Result<()> {
        // CUDADEV-2: the lengths first, on every device (DEVOP-1).
        check_op(&*op, reads, writes)?;
        let Some(model_op) = op.as_any().downcast_ref::<Op>() else {
            return Err(DeviceError::Invalid(format!(
                "op '{}' has no CUDA code: the CUDA device runs the models crate's ops (ops::Op)",
                op.name()
            )));
        };
        self.begin()?;
        let cs = self.cuda_stream(stream)?;
        let blas = if uses_blas(model_op) { Some(self.blas(stream, &cs)?) } else { None };
        let rl: Vec<usize> = reads.iter().map(|b| b.len()).collect();
        let wl: Vec<usize> = writes.iter().map(|b| b.len()).collect();
        self.with_slices(model_op.label(), reads, writes, |r, w| {
            self.run_op(model_op, &cs, blas.as_deref(), r, w, &rl, &wl)
        })
    }

    fn reserve(&self, bytes: u64, label: &str) -> Result<Reservation> {
        if let Some(m) = self.failure() {
            return Err(DeviceError::Failed(m));
        }
        self.count.reserve(bytes, label)
    }

    fn record(&self, stream: StreamId) -> Event {
        let recorded = self.begin().and_then(|()| {
            let cs = self.cuda_stream(stream)?;
            self.record_on(stream, &cs)
        });
        match recorded {
            Ok(e) => e,
            Err(e) => {
                // No Result here: the failure is the device's (CUDADEV-3), and waiting on
                // the event fails with it.
                self.fail(&format!("record on stream {stream}"), e);
                Event::native(self.id, stream, NativeEvent(Arc::new(RecordFailed)))
            }
        }
    }

    fn wait(&self, stream: StreamId, event: &Event) {
        if event.device() != self.id {
            self.fail(
                &format!("wait on stream {stream}"),
                format!("the event was recorded on device {}", event.device()),
            );
            return;
        }
        let Some(ev) = event.native_event().and_then(|n| n.0.downcast_ref::<CudaEvent>()) else {
            self.fail(&format!("wait on stream {stream}"), "the event's record failed");
            return;
        };
        let waited = self.begin().and_then(|()| {
            let cs = self.cuda_stream(stream)?;
            cs.wait(ev).map_err(|e| self.fail(&format!("wait on stream {stream}"), e))
        });
        if let Err(e) = waited {
            self.fail(&format!("wait on stream {stream}"), e);
        }
    }

    fn query(&self, event: &Event) -> bool {
        if event.device() != self.id {
            return true;
        }
        match event.native_event().and_then(|n| n.0.downcast_ref::<CudaEvent>()) {
            // A failed record: nothing to wait for, and synchronize reports the failure.
            None => true,
            Some(ev) => match ev.try_is_complete() {
                Ok(done) => done,
                Err(e) => {
                    self.fail("event query", e);
                    true
                }
            },
        }
    }

    fn synchronize(&self, event: &Event) -> Result<()> {
        if event.device() != self.id {
            return Err(DeviceError::Invalid(format!(
                "synchronize on cuda:{}: the event was recorded on device {}",
                self.ordinal,
                event.device()
            )));
        }
        self.begin()?;
        let Some(ev) = event.native_event().and_then(|n| n.0.downcast_ref::<CudaEvent>()) else {
            return Err(self.fail("synchronize", "the event's record failed"));
        };
        ev.synchronize().map_err(|e| self.fail("event synchronize", e))?;
        // Errors cudarc could only record (in drops, and its tracking's event records).
        self.ctx.check_err().map_err(|e| self.fail("an earlier asynchronous call", e))?;
        match self.failure() {
            Some(m) => Err(DeviceError::Failed(m)),
            None => Ok(()),
        }
    }

    fn in_use(&self) -> u64 {
        self.count.in_use()
    }

    fn peak(&self) -> u64 {
        self.count.peak()
    }
}
