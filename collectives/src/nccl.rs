//! NCCL communicator for device buffers (feature `cuda`): the lane API (all-gather,
//! reduce-scatter, all-reduce, broadcast) on CUDA streams, for ranks inside a node.
//!
//! Each lane is its own NCCL communicator on its own stream, so that lanes progress
//! independently as host lanes do (NCCL requires every rank to issue the ops of one
//! communicator in the same order; one communicator per lane keeps that a per-lane rule).
//! Rank 0 of a lane creates the NCCL unique id and publishes it in the rendezvous [`Store`]
//! under `{prefix}/nccl/{lane}/id`; the other ranks read it there.
//!
//! Ops are enqueued at once and return an [`NcclWork`] holding the buffers; `wait` polls a
//! CUDA event until the op completes or the deadline passes. A watchdog in `wait` turns a
//! stuck op into `Timeout` and aborts the lane's communicator (`ncclCommAbort`), so that the
//! kernels waiting for a lost peer exit instead of spinning forever.
//!
//! Invariants:
//! - NCCL-1: without libcuda, libnccl or a GPU, opening fails with `DeviceUnavailable`
//!   naming what was missing; no cudarc call is made before the libraries are found.
//! - NCCL-2: after `abort` (or a watchdog timeout), every pending and later op on every lane
//!   fails with `Aborted`; a communicator is never used after ncclCommAbort.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id};

use crate::error::CollectiveError;
use crate::store::Store;
use crate::ReduceOp;

/// Checks that the driver and NCCL libraries can be loaded (cudarc panics on a missing one).
pub fn check_libraries() -> Result<(), CollectiveError> {
    // SAFETY: each check only tries to dlopen the library by its usual names.
    let (cuda, nccl) =
        unsafe { (cudarc::driver::sys::is_culib_present(), cudarc::nccl::sys::is_culib_present()) };
    if !cuda {
        return Err(CollectiveError::DeviceUnavailable("libcuda.so not found".into()));
    }
    if !nccl {
        return Err(CollectiveError::DeviceUnavailable("libnccl.so not found".into()));
    }
    Ok(())
}

/// An NCCL communicator that may move between threads.
struct SendComm(Comm);

// SAFETY: an NCCL communicator may be called from any thread as long as calls on it are not
// concurrent; every use here goes through the lane's mutex (or happens before the lane is
// shared, during init). cudarc only omits `Send` because the handle is a raw pointer.
unsafe impl Send for SendComm {}

struct AbortState {
    aborted: AtomicBool,
    reason: Mutex<String>,
}

impl AbortState {
    fn reason(&self) -> String {
        self.reason.lock().map(|r| r.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }
}

/// One rank's NCCL endpoint: a GPU, the store, and the lanes opened so far.
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    ctx: Arc<CudaContext>,
    store: Arc<dyn Store>,
    prefix: String,
    timeout: Duration,
    abort: Arc<AbortState>,
    lanes: Mutex<Vec<Arc<LaneInner>>>,
}

impl NcclCommunicator {
    /// Opens GPU `ordinal` for rank `rank` of `world`. `prefix` namespaces the store keys (a
    /// job id); `timeout` bounds every rendezvous and every op's wait.
    pub fn new(
        rank: usize,
        world: usize,
        ordinal: usize,
        store: Arc<dyn Store>,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        if rank >= world {
            return Err(CollectiveError::InvalidArgument(format!("rank {rank} of world {world}")));
        }
        check_libraries()?;
        let count = CudaContext::device_count()
            .map_err(|e| CollectiveError::DeviceUnavailable(format!("no CUDA device: {e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(CollectiveError::DeviceUnavailable(format!(
                "no CUDA device {ordinal} ({count} present)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            CollectiveError::DeviceUnavailable(format!("cuda device {ordinal}: {e:?}"))
        })?;
        Ok(NcclCommunicator {
            rank,
            world,
            ctx,
            store,
            prefix: prefix.to_string(),
            timeout,
            abort: Arc::new(AbortState {
                aborted: AtomicBool::new(false),
                reason: Mutex::new(String::new()),
            }),
            lanes: Mutex::new(Vec::new()),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The CUDA context of this rank's GPU (to allocate buffers for the lanes).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Opens lane `name`: a new stream and a new NCCL communicator, its unique id exchanged
    /// through the store. Every rank must open the same lanes in the same order.
    pub fn lane(&self, name: &str) -> Result<NcclLane, CollectiveError> {
        let lane_err = |detail: String| CollectiveError::Transport {
            lane: name.to_string(),
            source: crate::transport::TransportError::Setup(detail),
        };
        if self.abort.aborted.load(Ordering::Acquire) {
            return Err(CollectiveError::Aborted {
                lane: name.to_string(),
                seq: 0,
                reason: self.abort.reason(),
            });
        }
        let key = format!("{}/nccl/{name}/id", self.prefix);
        let id = if self.rank == 0 {
            let id = Id::new().map_err(|e| lane_err(format!("ncclGetUniqueId: {e:?}")))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            self.store.set(&key, &bytes).map_err(|e| lane_err(e.to_string()))?;
            id
        } else {
            let bytes = self.store.get(&key, self.timeout).map_err(|e| lane_err(e.to_string()))?;
            let mut internal = [0 as std::ffi::c_char; 128];
            if bytes.len() != internal.len() {
                return Err(lane_err(format!("nccl id of {} bytes, want 128", bytes.len())));
            }
            for (d, s) in internal.iter_mut().zip(&bytes) {
                *d = *s as std::ffi::c_char;
            }
            Id::uninit(internal)
        };
        let stream = self.ctx.new_stream().map_err(|e| lane_err(format!("stream: {e:?}")))?;
        // ncclCommInitRank blocks until every rank joined; run it aside so that a rank that
        // never comes is a Timeout here, not a hang (the init thread is left behind then).
        let (tx, rx) = std::sync::mpsc::channel();
        let (rank, world, st) = (self.rank, self.world, stream.clone());
        std::thread::Builder::new()
            .name(format!("nccl-init-{name}"))
            .spawn(move || {
                let _ = tx.send(
                    Comm::from_rank(st, rank, world, id)
                        .map(SendComm)
                        .map_err(|e| format!("{e:?}")),
                );
            })
            .map_err(|e| lane_err(format!("spawn: {e}")))?;
        let comm = match rx.recv_timeout(self.timeout) {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(lane_err(format!("ncclCommInitRank: {e}"))),
            Err(_) => {
                return Err(CollectiveError::Timeout {
                    lane: name.to_string(),
                    seq: 0,
                    peer: usize::MAX,
                    timeout_ms: self.timeout.as_millis() as u64,
                })
            }
        };
        let inner = Arc::new(LaneInner {
            name: name.to_string(),
            comm: Mutex::new(Some(comm)),
            stream,
            seq: AtomicU64::new(0),
            abort: self.abort.clone(),
            world: self.world,
            timeout: self.timeout,
        });
        if let Ok(mut l) = self.lanes.lock() {
            l.push(inner.clone());
        }
        Ok(NcclLane { inner })
    }

    /// Fails every pending and later op on every lane with `Aborted` (NCCL-2) and aborts
    /// every lane's NCCL communicator.
    pub fn abort(&self, reason: &str) {
        if let Ok(mut r) = self.abort.reason.lock() {
            if r.is_empty() {
                *r = reason.to_string();
            }
        }
        self.abort.aborted.store(true, Ordering::Release);
        let lanes = self.lanes.lock().map(|l| l.clone()).unwrap_or_default();
        for l in lanes {
            l.abort_comm();
        }
    }
}

struct LaneInner {
    name: String,
    comm: Mutex<Option<SendComm>>,
    stream: Arc<CudaStream>,
    seq: AtomicU64,
    abort: Arc<AbortState>,
    world: usize,
    timeout: Duration,
}

impl LaneInner {
    fn abort_comm(&self) {
        // Dropping a cudarc `Comm` calls ncclCommAbort.
        let taken = match self.comm.lock() {
            Ok(mut c) => c.take(),
            Err(p) => p.into_inner().take(),
        };
        drop(taken);
    }

    fn aborted(&self, seq: u64) -> CollectiveError {
        CollectiveError::Aborted { lane: self.name.clone(), seq, reason: self.abort.reason() }
    }
}

/// A lane of an [`NcclCommunicator`]: ops are issued in order on the lane's stream.
pub struct NcclLane {
    inner: Arc<LaneInner>,
}

fn nccl_op(op: ReduceOp) -> Result<cudarc::nccl::ReduceOp, String> {
    Ok(match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Avg => cudarc::nccl::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
        ReduceOp::Min => cudarc::nccl::ReduceOp::Min,
        // Packed bf16 pairs in f32 buffers have no NCCL op (NCCL reduces bf16 buffers).
        ReduceOp::SumBf16 => return Err("sum-bf16 (packed pairs) is not an NCCL op".into()),
    })
}

impl NcclLane {
    /// Lane name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    fn issue<T>(
        &self,
        buffers: T,
        enqueue: impl FnOnce(&Comm, &mut T) -> Result<(), String>,
    ) -> NcclWork<T> {
        let l = &self.inner;
        let seq = l.seq.fetch_add(1, Ordering::AcqRel);
        let deadline = Instant::now() + l.timeout;
        let mut buffers = buffers;
        let fail = |e: CollectiveError| NcclWork { state: Err(e), lane: l.clone(), seq, deadline };
        if l.abort.aborted.load(Ordering::Acquire) {
            return fail(l.aborted(seq));
        }
        let guard = match l.comm.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let Some(SendComm(comm)) = guard.as_ref() else { return fail(l.aborted(seq)) };
        if let Err(e) = enqueue(comm, &mut buffers) {
            return fail(CollectiveError::Transport {
                lane: l.name.clone(),
                source: crate::transport::TransportError::Io { peer: usize::MAX, detail: e },
            });
        }
        drop(guard);
        match l.stream.record_event(None) {
            Ok(ev) => NcclWork { state: Ok((buffers, ev)), lane: l.clone(), seq, deadline },
            Err(e) => fail(CollectiveError::Transport {
                lane: l.name.clone(),
                source: crate::transport::TransportError::Io {
                    peer: usize::MAX,
                    detail: format!("{e:?}"),
                },
            }),
        }
    }

    /// In-place all-reduce of `buf`.
    pub fn all_reduce(&self, buf: CudaSlice<f32>, op: ReduceOp) -> NcclWork<CudaSlice<f32>> {
        self.issue(buf, |c, b| {
            c.all_reduce_in_place(b, &nccl_op(op)?).map(|_| ()).map_err(|e| format!("{e:?}"))
        })
    }

    /// Reduce-scatter: `input` (`world * output.len()` values) reduced, slice `rank` into
    /// `output`. Returns both buffers.
    pub fn reduce_scatter(
        &self,
        input: CudaSlice<f32>,
        output: CudaSlice<f32>,
        op: ReduceOp,
    ) -> NcclWork<(CudaSlice<f32>, CudaSlice<f32>)> {
        let world = self.inner.world;
        self.issue((input, output), |c, (i, o)| {
            if i.len() != o.len() * world {
                return Err(format!(
                    "reduce_scatter: {} inputs for {} x {world}",
                    i.len(),
                    o.len()
                ));
            }
            c.reduce_scatter(i, o, &nccl_op(op)?).map(|_| ()).map_err(|e| format!("{e:?}"))
        })
    }

    /// All-gather: every rank's `shard` into `full` (`world * shard.len()` values), in rank
    /// order. Returns both buffers.
    pub fn all_gather(
        &self,
        shard: CudaSlice<f32>,
        full: CudaSlice<f32>,
    ) -> NcclWork<(CudaSlice<f32>, CudaSlice<f32>)> {
        let world = self.inner.world;
        self.issue((shard, full), |c, (s, f)| {
            if f.len() != s.len() * world {
                return Err(format!("all_gather: {} outputs for {} x {world}", f.len(), s.len()));
            }
            c.all_gather(s, f).map(|_| ()).map_err(|e| format!("{e:?}"))
        })
    }

    /// In-place broadcast of `buf` from `root`.
    pub fn broadcast(&self, buf: CudaSlice<f32>, root: usize) -> NcclWork<CudaSlice<f32>> {
        let world = self.inner.world;
        self.issue(buf, |c, b| {
            if root >= world {
                return Err(format!("broadcast root {root} of world {world}"));
            }
            c.broadcast_in_place(b, root as i32).map(|_| ()).map_err(|e| format!("{e:?}"))
        })
    }
}

/// An NCCL op in flight: the buffers come back from [`NcclWork::wait`].
pub struct NcclWork<T> {
    state: Result<(T, CudaEvent), CollectiveError>,
    lane: Arc<LaneInner>,
    seq: u64,
    deadline: Instant,
}

impl<T> NcclWork<T> {
    /// Waits for the op, at most until its deadline; a stuck op aborts the lane's
    /// communicator and returns `Timeout` (its peer is `usize::MAX`: NCCL does not say
    /// which rank is late).
    pub fn wait(self) -> Result<T, CollectiveError> {
        let (buffers, event) = self.state?;
        let l = &self.lane;
        loop {
            if l.abort.aborted.load(Ordering::Acquire) {
                return Err(l.aborted(self.seq));
            }
            match event.try_is_complete() {
                Ok(true) => return Ok(buffers),
                Ok(false) => {}
                Err(e) => {
                    return Err(CollectiveError::Transport {
                        lane: l.name.clone(),
                        source: crate::transport::TransportError::Io {
                            peer: usize::MAX,
                            detail: format!("{e:?}"),
                        },
                    })
                }
            }
            if Instant::now() >= self.deadline {
                if let Ok(mut r) = l.abort.reason.lock() {
                    if r.is_empty() {
                        *r = format!("watchdog: lane '{}' seq {} timed out", l.name, self.seq);
                    }
                }
                l.abort.aborted.store(true, Ordering::Release);
                l.abort_comm();
                return Err(CollectiveError::Timeout {
                    lane: l.name.clone(),
                    seq: self.seq,
                    peer: usize::MAX,
                    timeout_ms: l.timeout.as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemStore;

    #[test]
    fn without_a_gpu_opening_is_device_unavailable() {
        // NCCL-1
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        match NcclCommunicator::new(0, 1, 0, store, "t", Duration::from_secs(5)) {
            Err(CollectiveError::DeviceUnavailable(what)) => {
                println!("no NCCL here: {what}");
                assert!(what.contains("not found") || what.contains("CUDA device"), "{what}");
            }
            Err(e) => panic!("expected DeviceUnavailable, got {e}"),
            Ok(_) => println!("a GPU with NCCL is present: see the world-1 test"),
        }
    }

    #[test]
    fn world_one_ops_return_their_input_and_abort_fails_later_ops() {
        // NCCL-2, on one GPU: with one rank every collective is a copy.
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let comm = match NcclCommunicator::new(0, 1, 0, store, "t", Duration::from_secs(20)) {
            Ok(c) => c,
            Err(e) => {
                println!("skipped: {e}");
                return;
            }
        };
        let lane = comm.lane("grads").unwrap();
        let stream = comm.context().default_stream();
        let host: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let buf = stream.clone_htod(&host).unwrap();
        let buf = lane.all_reduce(buf, ReduceOp::Sum).wait().unwrap();
        assert_eq!(stream.clone_dtoh(&buf).unwrap(), host);
        let full = stream.alloc_zeros::<f32>(1000).unwrap();
        let (_, full) = lane.all_gather(buf, full).wait().unwrap();
        assert_eq!(stream.clone_dtoh(&full).unwrap(), host);
        comm.abort("test");
        let again = lane.broadcast(full, 0).wait();
        assert!(matches!(again, Err(CollectiveError::Aborted { .. })), "{:?}", again.err());
    }
}
