//! NCCL collectives over a [`CudaDevice`]'s buffers: [`DeviceComm`] between GPUs, as
//! [`shardline_collectives::device::SimComm`] answers it between simulated devices.
//!
//! Rank 0 creates the NCCL unique id and publishes it in the rendezvous store under
//! `{key_prefix}/nccl/id`; the other ranks read it there (as the lanes of
//! `shardline_collectives::nccl` do). `ncclCommInitRank` blocks until every rank joined, so
//! it runs on a helper thread and a rank that never comes is a `Failed` naming the
//! rendezvous after the timeout, not a hang.
//!
//! The communicator runs on a stream of its own on the device. A call on `stream` makes the
//! communicator's stream wait for an event recorded on `stream`, enqueues the collective
//! there, then makes `stream` wait for an event recorded after it: the collective is ordered
//! after `stream`'s earlier work and before its later work, as if it ran on `stream`, while
//! other streams keep their own order.
//!
//! Invariants:
//! - CUDANCCL-1: a collective is ordered after the work enqueued on its `stream` before the
//!   call and before the work enqueued there after it.
//! - CUDANCCL-2: lengths that disagree (with the world size, the rank's block, each other)
//!   and buffers that are not live on the device are `Invalid` before anything is enqueued.
//! - CUDANCCL-3: after [`NcclComm::abort`] (or the drop) the NCCL communicator is aborted
//!   (`ncclCommAbort`) and never used again: every later call is `Failed`.
//! - CUDANCCL-4: the rendezvous (the id in the store, `ncclCommInitRank`) is bounded by the
//!   timeout; past it, `Failed` names the store key and the rank. A communicator that
//!   completes after its rank gave up is aborted by the helper thread.

use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::Duration;

use cudarc::driver::{DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};
use shardline_collectives::device::{
    Device, DeviceBuffer, DeviceComm, DeviceError, Result, StreamId,
};
use shardline_collectives::store::Store;

use super::device::CudaDevice;

/// A raw NCCL communicator, aborted when dropped.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every call goes through `NcclComm::comm`'s mutex (or happens on the init
// thread before the communicator is handed over). The handle is a raw pointer, hence no
// automatic `Send`.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the communicator came from a successful ncclCommInitRank and is aborted
        // once (the value is dropped once); nothing uses it afterwards (CUDANCCL-3).
        // Its result is not actionable here.
        let _ = unsafe { nccl::comm_abort(self.0) };
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One rank's NCCL communicator over a [`CudaDevice`] (CUDANCCL-1..4).
pub struct NcclComm {
    // Declared first so that it is aborted before the device (and its context) may go.
    comm: Mutex<Option<RawComm>>,
    device: Arc<CudaDevice>,
    rank: usize,
    world: usize,
    /// The device stream the collectives run on.
    comm_stream: StreamId,
    /// Why the communicator is gone, once it is.
    aborted: Mutex<Option<String>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("ordinal", &self.device.ordinal())
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl NcclComm {
    /// Joins rank `rank` of `world` on `device`: the NCCL id goes through `store` under
    /// `{key_prefix}/nccl/id`, and the rendezvous is bounded by `timeout` (CUDANCCL-4).
    /// `Unavailable` without libnccl.
    pub fn new(
        device: Arc<CudaDevice>,
        rank: usize,
        world: usize,
        store: Arc<dyn Store>,
        key_prefix: &str,
        timeout: Duration,
    ) -> Result<NcclComm> {
        let ordinal = device.ordinal();
        if world == 0 || rank >= world {
            return Err(DeviceError::Invalid(format!("NCCL rank {rank} of world {world}")));
        }
        let (world_i, rank_i) = match (i32::try_from(world), i32::try_from(rank)) {
            (Ok(w), Ok(r)) => (w, r),
            _ => return Err(DeviceError::Invalid(format!("NCCL world {world}: too large"))),
        };
        // SAFETY: only tries to dlopen the library by its usual names (cudarc panics on a
        // missing library, so this comes before any NCCL call).
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::Unavailable("libnccl.so not found".into()));
        }
        device.begin()?;
        let key = format!("{key_prefix}/nccl/id");
        let id = if rank == 0 {
            let id = nccl::get_uniqueid().map_err(|e| {
                DeviceError::Failed(format!("ncclGetUniqueId on cuda:{ordinal}: {:?}", e.0))
            })?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            store.set(&key, &bytes).map_err(|e| {
                DeviceError::Failed(format!("publishing the NCCL id at '{key}': {e}"))
            })?;
            id
        } else {
            let bytes = store.get(&key, timeout).map_err(|e| {
                DeviceError::Failed(format!(
                    "NCCL rendezvous '{key}' (rank {rank} of {world}): rank 0's id never came: {e}"
                ))
            })?;
            let mut internal = [0 as std::ffi::c_char; 128];
            if bytes.len() != internal.len() {
                return Err(DeviceError::Failed(format!(
                    "NCCL rendezvous '{key}': an id of {} bytes, 128 expected",
                    bytes.len()
                )));
            }
            for (d, s) in internal.iter_mut().zip(&bytes) {
                *d = *s as std::ffi::c_char;
            }
            sys::ncclUniqueId { internal }
        };
        let comm_stream = device.stream("nccl");
        device.cuda_stream(comm_stream)?;
        // ncclCommInitRank blocks until every rank joined: aside, bounded by the timeout.
        let ctx = Arc::clone(device.context());
        let (tx, rx) = mpsc::channel::<std::result::Result<RawComm, String>>();
        std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let made = (|| {
                    // NCCL takes the device from the thread's current context.
                    ctx.bind_to_thread().map_err(|e| format!("binding the context: {e:?}"))?;
                    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `comm` is a valid place for the handle; the id is the one every
                    // rank of this rendezvous holds.
                    unsafe { nccl::comm_init_rank(&mut comm, world_i, id, rank_i) }
                        .map_err(|e| format!("ncclCommInitRank: {:?}", e.0))?;
                    Ok(RawComm(comm))
                })();
                // If the rank gave up waiting, the send fails and drops the communicator,
                // which aborts it (CUDANCCL-4).
                let _ = tx.send(made);
            })
            .map_err(|e| DeviceError::Failed(format!("spawning the NCCL init thread: {e}")))?;
        let comm = match rx.recv_timeout(timeout) {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                return Err(DeviceError::Failed(format!(
                    "NCCL rendezvous '{key}' on cuda:{ordinal} (rank {rank} of {world}): {e}"
                )))
            }
            Err(_) => {
                return Err(DeviceError::Failed(format!(
                    "NCCL rendezvous '{key}' on cuda:{ordinal}: ncclCommInitRank (rank {rank} \
                     of {world}) did not complete within {timeout:?}: a rank never joined"
                )))
            }
        };
        Ok(NcclComm {
            comm: Mutex::new(Some(comm)),
            device,
            rank,
            world,
            comm_stream,
            aborted: Mutex::new(None),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The device whose buffers the collectives move.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Aborts the NCCL communicator (`ncclCommAbort`): its kernels waiting for a lost peer
    /// exit, and every later call fails (CUDANCCL-3).
    pub fn abort(&self) {
        let taken = lock(&self.comm).take();
        if taken.is_some() {
            let mut a = lock(&self.aborted);
            if a.is_none() {
                *a = Some("aborted".into());
            }
        }
        drop(taken);
    }

    /// Enqueues `call` (given the communicator, the stream and the buffers' device
    /// addresses, reads then writes) ordered after `stream`'s work and before its later work
    /// (CUDANCCL-1). The buffers are checked first (CUDANCCL-2).
    fn run(
        &mut self,
        what: &str,
        stream: StreamId,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
        call: impl FnOnce(
            sys::ncclComm_t,
            sys::cudaStream_t,
            &[u64],
            &[u64],
        ) -> std::result::Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<()> {
        // DEVOP-2: collectives take whole allocations only.
        for b in reads.iter().chain(writes) {
            b.whole(what)?;
        }
        let d = Arc::clone(&self.device);
        let ordinal = d.ordinal();
        d.begin()?;
        let guard = lock(&self.comm);
        let Some(comm) = guard.as_ref() else {
            let why = lock(&self.aborted).clone().unwrap_or_else(|| "aborted".into());
            return Err(DeviceError::Failed(format!(
                "{what}: the NCCL communicator of cuda:{ordinal} (rank {} of {}) was {why}",
                self.rank, self.world
            )));
        };
        let user = d.cuda_stream(stream)?;
        let cs = d.cuda_stream(self.comm_stream)?;
        d.with_slices(what, reads, writes, |r, w| {
            let ev = user.record_event(None).map_err(|e| d.fail(&format!("{what}: record"), e))?;
            cs.wait(&ev).map_err(|e| d.fail(&format!("{what}: wait"), e))?;
            // The guards record the buffers' read and write events on the communicator's
            // stream once the call is enqueued (cudarc's tracking).
            let rg: Vec<_> = r.iter().map(|s| s.device_ptr(&cs)).collect();
            let wg: Vec<_> = w.iter_mut().map(|s| s.device_ptr_mut(&cs)).collect();
            let rp: Vec<u64> = rg.iter().map(|(p, _)| *p).collect();
            let wp: Vec<u64> = wg.iter().map(|(p, _)| *p).collect();
            let done = call(comm.0, cs.cu_stream() as sys::cudaStream_t, &rp, &wp);
            drop((rg, wg));
            done.map(|_| ()).map_err(|e| d.fail(&format!("{what}: nccl"), e.0))
        })?;
        let ev = cs.record_event(None).map_err(|e| d.fail(&format!("{what}: record"), e))?;
        user.wait(&ev).map_err(|e| d.fail(&format!("{what}: wait"), e))
    }

    /// The rank's block of an in-place buffer of `len` elements.
    fn block(&self, what: &str, buf: &DeviceBuffer) -> Result<usize> {
        if !buf.len().is_multiple_of(self.world) {
            return Err(DeviceError::Invalid(format!(
                "{what}: '{}' has {} elements, not a multiple of {} ranks",
                buf.label(),
                buf.len(),
                self.world
            )));
        }
        Ok(buf.len() / self.world)
    }
}

/// The address `elems` f32 elements past `base`.
fn offset(base: u64, elems: usize) -> u64 {
    base + 4 * elems as u64
}

const F32: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
const SUM: sys::ncclRedOp_t = sys::ncclRedOp_t::ncclSum;

impl DeviceComm for NcclComm {
    fn size(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()> {
        let n = buf.len();
        self.run("nccl all_reduce", stream, &[], &[buf], |c, s, _, w| {
            // SAFETY: in place over the buffer's n elements (checked live, CUDANCCL-2).
            unsafe { nccl::all_reduce(w[0] as _, w[0] as _, n, F32, SUM, c, s) }
        })
    }

    fn all_gather(
        &mut self,
        stream: StreamId,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
    ) -> Result<()> {
        let n = send.len();
        if recv.len() != n * self.world {
            return Err(DeviceError::Invalid(format!(
                "nccl all_gather: '{}' has {} elements for {} x {} ranks",
                recv.label(),
                recv.len(),
                n,
                self.world
            )));
        }
        self.run("nccl all_gather", stream, &[send], &[recv], |c, s, r, w| {
            // SAFETY: send has n elements, recv world * n (checked above and live).
            unsafe { nccl::all_gather(r[0] as _, w[0] as _, n, F32, c, s) }
        })
    }

    fn reduce_scatter(
        &mut self,
        stream: StreamId,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
    ) -> Result<()> {
        let n = recv.len();
        if send.len() != n * self.world {
            return Err(DeviceError::Invalid(format!(
                "nccl reduce_scatter: '{}' has {} elements for {} x {} ranks",
                send.label(),
                send.len(),
                n,
                self.world
            )));
        }
        self.run("nccl reduce_scatter", stream, &[send], &[recv], |c, s, r, w| {
            // SAFETY: send has world * n elements, recv n (checked above and live).
            unsafe { nccl::reduce_scatter(r[0] as _, w[0] as _, n, F32, SUM, c, s) }
        })
    }

    fn all_gather_in_place(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()> {
        let block = self.block("nccl all_gather in place", buf)?;
        let rank = self.rank;
        self.run("nccl all_gather in place", stream, &[], &[buf], |c, s, _, w| {
            // NCCL's in-place form: the send buffer is the rank's block of the receive one.
            let send = offset(w[0], rank * block);
            // SAFETY: buf has world * block elements (checked above and live).
            unsafe { nccl::all_gather(send as _, w[0] as _, block, F32, c, s) }
        })
    }

    fn reduce_scatter_in_place(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()> {
        let block = self.block("nccl reduce_scatter in place", buf)?;
        let rank = self.rank;
        self.run("nccl reduce_scatter in place", stream, &[], &[buf], |c, s, _, w| {
            // NCCL's in-place form: the receive buffer is the rank's block of the send one.
            let recv = offset(w[0], rank * block);
            // SAFETY: buf has world * block elements (checked above and live).
            unsafe { nccl::reduce_scatter(w[0] as _, recv as _, block, F32, SUM, c, s) }
        })
    }

    fn broadcast(&mut self, stream: StreamId, buf: &DeviceBuffer, root: usize) -> Result<()> {
        if root >= self.world {
            return Err(DeviceError::Invalid(format!(
                "nccl broadcast: root {root} of {} ranks",
                self.world
            )));
        }
        let (n, root) = (buf.len(), root as i32);
        self.run("nccl broadcast", stream, &[], &[buf], |c, s, _, w| {
            // SAFETY: in place over the buffer's n elements (checked live).
            unsafe { nccl::broadcast(w[0] as _, w[0] as _, n, F32, root, c, s) }
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // CUDANCCL-3: aborted (not destroyed, which would wait for a lost peer).
        self.abort();
    }
}
