//! Lanes: ordered streams of collective ops, each with its own progress thread.
//!
//! - LANE-1: ops on a lane run in issue order; every rank must issue the same ops in the
//!   same order (checked by fingerprints, see [`crate::fingerprint`]).
//! - LANE-2: after any error other than an argument error, the lane is failed for good:
//!   later ops fail at once with the same error.
//! - LANE-3: a failing rank poisons its peers so that every rank fails promptly with an
//!   error naming the same cause (mismatch, late or lost rank, abort) instead of timing out.
//! - LANE-4: each op's deadline is its issue time plus its timeout.
//! - LANE-5: dropping the last handle of a lane closes its queue; the thread finishes the
//!   queued ops, exits and is joined.
//! - LANE-6: a small op issued with `CallOptions::blocking` while its lane is idle (no op
//!   queued or running) runs on the issuing thread; `pending` counts ops from issue to completion, and an op runs inline
//!   only when it moves `pending` from 0 to 1, so issue order is still execution order.
//! - LANE-7: reduce-scatter and all-gather also run in place (NCCL's forms); an op's two
//!   forms share kind, count, schedule and wire traffic, so ranks may mix them in one op.
//! - LANE-8: [`Lane::bytes_sent`] counts the payload bytes this rank has handed to its
//!   transport on the lane (every send of every schedule step, headers not included), as
//!   each op runs; the communicator's [`crate::Communicator::bytes_sent`] sums its lanes.
//! - LANE-9: with an account set ([`Lane::set_account`]), the lane reports its staging heap
//!   bytes (links' receive scratch plus the collectives' scratch) when set and before every
//!   op that grows them, so an op never holds more than was reported.

use crate::algo::{self, Algorithm, Schedule};
use crate::communicator::Shared;
use crate::error::CollectiveError;
use crate::executor::{Executor, Regions, WireCtx};
use crate::fingerprint::{self, describe, describe_pair, op_tag, parse_reason, OpKind, Reason};
use crate::pool::PoolAccount;
use crate::reduce::{scale_avg, Combine, ReduceOp};
use crate::transport::{LaneLinks, Poison, Tag, TransportError};
use crate::work::{self, Completer, Work};
use crossbeam::channel::{unbounded, Receiver, Sender};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle lane thread polls its queue before blocking.
const POLL_BEFORE_BLOCK: Duration = Duration::from_micros(30);

/// Options of one call (Gloo style: options travel with the call).
#[derive(Clone, Debug, Default)]
pub struct CallOptions {
    timeout: Option<Duration>,
    algorithm: Algorithm,
    blocking: bool,
}

impl CallOptions {
    /// Defaults: the communicator's timeout, `Algorithm::Auto`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Deadline of this op, measured from issue (default: the communicator's timeout).
    ///
    /// ```
    /// use shardline_collectives::{Algorithm, CallOptions};
    /// let mut o = CallOptions::new();
    /// o.timeout(std::time::Duration::from_secs(5)).algorithm(Algorithm::Ring);
    /// ```
    pub fn timeout(&mut self, d: Duration) -> &mut Self {
        self.timeout = Some(d);
        self
    }

    /// Algorithm to use (default `Auto`). Every rank must pass the same one.
    pub fn algorithm(&mut self, a: Algorithm) -> &mut Self {
        self.algorithm = a;
        self
    }

    /// The caller waits for this op right away (default `false`). A small op (at most
    /// `SHARDLINE_INLINE_BYTES`) issued with this flag on an idle lane then runs on the calling
    /// thread and the issuing call returns only once it is complete, saving the two thread
    /// hand-offs of the progress thread (LANE-6). Use it only where the next thing the caller
    /// does is wait for the op: the call blocks until every peer has issued it.
    ///
    /// ```
    /// use shardline_collectives::CallOptions;
    /// let mut o = CallOptions::new();
    /// o.blocking(true);
    /// ```
    pub fn blocking(&mut self, b: bool) -> &mut Self {
        self.blocking = b;
        self
    }
}

enum Body {
    AllReduce {
        buf: Vec<f32>,
        op: ReduceOp,
        done: Completer<Vec<f32>>,
    },
    ReduceScatter {
        input: Vec<f32>,
        output: Vec<f32>,
        op: ReduceOp,
        done: Completer<(Vec<f32>, Vec<f32>)>,
    },
    AllGather {
        input: Vec<f32>,
        output: Vec<f32>,
        done: Completer<(Vec<f32>, Vec<f32>)>,
    },
    /// In place: slice `rank` of `buf` is the input; the result is all of `buf`.
    AllGatherInPlace {
        buf: Vec<f32>,
        done: Completer<Vec<f32>>,
    },
    /// In place: `buf` is the input; the result is slice `rank` of it.
    ReduceScatterInPlace {
        buf: Vec<f32>,
        op: ReduceOp,
        done: Completer<Vec<f32>>,
    },
    Broadcast {
        buf: Vec<f32>,
        root: usize,
        done: Completer<Vec<f32>>,
    },
    Barrier {
        done: Completer<()>,
    },
    Records {
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
        done: Completer<Vec<f32>>,
    },
}

impl Body {
    /// Stamps the op's start on its work (WORK-1).
    fn start(&self, at: Instant) {
        match self {
            Body::AllReduce { done, .. } | Body::Broadcast { done, .. } => done.start(at),
            Body::Records { done, .. } => done.start(at),
            Body::AllGatherInPlace { done, .. } | Body::ReduceScatterInPlace { done, .. } => {
                done.start(at)
            }
            Body::ReduceScatter { done, .. } | Body::AllGather { done, .. } => done.start(at),
            Body::Barrier { done } => done.start(at),
        }
    }
}

struct Job {
    seq: u64,
    deadline: Instant,
    timeout: Duration,
    algo: Algorithm,
    body: Body,
}

enum Msg {
    Job(Job),
    Abort,
}

/// Most steps a pipelined schedule (broadcast chain, pieced all-gather) is split into: a
/// tiny `SHARDLINE_PIPELINE_BYTES` makes pieces larger than asked rather than millions of
/// steps.
const MAX_PIECES: usize = 256;

/// A lane: cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct Lane {
    inner: Arc<LaneInner>,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("name", &self.inner.name)
            .field("rank", &self.inner.shared.rank)
            .finish()
    }
}

struct LaneInner {
    name: Arc<str>,
    shared: Arc<Shared>,
    next_seq: Mutex<u64>,
    tx: Option<Sender<Msg>>,
    thread: Option<JoinHandle<()>>,
    /// The lane's state; the progress thread and inline issuers take turns (LANE-6).
    worker: Arc<Mutex<Worker>>,
    /// Ops issued and not yet completed (LANE-6).
    pending: Arc<AtomicUsize>,
    /// Largest payload run inline.
    inline_bytes: usize,
    /// Payload bytes sent on this lane (LANE-8).
    sent: Arc<AtomicU64>,
    /// Heap bytes its links hold for staging (`LaneLinks::staging_bytes`).
    staging: usize,
}

impl Drop for LaneInner {
    fn drop(&mut self) {
        // LANE-5: closing the channel lets the thread drain and exit.
        self.tx.take();
        if let Some(h) = self.thread.take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Lane {
    /// Starts the lane's progress thread over `links`.
    pub(crate) fn start(
        name: &str,
        shared: Arc<Shared>,
        links: Box<dyn LaneLinks>,
    ) -> Result<Lane, CollectiveError> {
        let (tx, rx) = unbounded();
        let sent = Arc::new(AtomicU64::new(0));
        let staging = links.staging_bytes();
        let worker = Worker {
            sent: Arc::clone(&sent),
            name: name.into(),
            hash: fingerprint::lane_hash(name),
            shared: shared.clone(),
            links,
            exec: Executor::default(),
            failed: None,
            next_seq: 0,
            schedules: HashMap::new(),
            account: None,
        };
        let worker = Arc::new(Mutex::new(worker));
        let pending = Arc::new(AtomicUsize::new(0));
        let (w2, p2) = (Arc::clone(&worker), Arc::clone(&pending));
        let thread = std::thread::Builder::new()
            .name(format!("lane-{name}-r{}", shared.rank))
            .spawn(move || Worker::run(w2, p2, rx))
            .map_err(|e| CollectiveError::Transport {
                lane: name.to_string(),
                source: TransportError::Setup(format!("cannot spawn the lane thread: {e}")),
            })?;
        Ok(Lane {
            inner: Arc::new(LaneInner {
                name: name.into(),
                shared,
                next_seq: Mutex::new(0),
                tx: Some(tx),
                thread: Some(thread),
                worker,
                pending,
                inline_bytes: crate::config::INLINE_BYTES.get() as usize,
                sent,
                staging,
            }),
        })
    }

    /// The lane's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Payload bytes this rank has sent on the lane so far, counted as each op runs
    /// (LANE-8): an op issued but not yet run is not in it, so read it after waiting.
    pub fn bytes_sent(&self) -> u64 {
        self.inner.sent.load(Ordering::Acquire)
    }

    /// Heap bytes the lane's links held for staging when it opened (receive scratch; not
    /// the mapped shared-memory rings).
    pub fn staging_bytes(&self) -> usize {
        self.inner.staging
    }

    /// Reports the lane's staging bytes (its links' receive scratch and its collectives'
    /// scratch, which grows with the largest op) to `account`: now, and before every op
    /// that changes them (LANE-9).
    pub fn set_account(&self, account: Arc<dyn PoolAccount>) {
        let mut w = self.inner.worker.lock().unwrap_or_else(|e| e.into_inner());
        let now = w.staging_bytes();
        account.held(now as u64);
        w.account = Some((account, now));
    }

    pub(crate) fn poke_abort(&self) {
        if let Some(tx) = &self.inner.tx {
            let _ = tx.send(Msg::Abort);
        }
    }

    fn aborted(&self, seq: u64) -> CollectiveError {
        CollectiveError::Aborted {
            lane: self.inner.name.to_string(),
            seq,
            reason: self.inner.shared.abort_reason(),
        }
    }

    /// Queues an op; `make` builds its body from the completer once the seq is known.
    fn issue<T>(
        &self,
        opts: &CallOptions,
        bytes: usize,
        check: Result<(), String>,
        make: impl FnOnce(Completer<T>) -> Body,
    ) -> Work<T> {
        let mut next = self.inner.next_seq.lock().unwrap_or_else(|e| e.into_inner());
        let seq = *next;
        if let Err(msg) = check {
            // Argument errors are caught before any I/O and consume no sequence number.
            return Work::ready(
                self.inner.name.clone(),
                seq,
                Err(CollectiveError::InvalidArgument(msg)),
            );
        }
        *next += 1;
        if self.inner.shared.cancel.load(Ordering::Acquire) {
            return Work::ready(self.inner.name.clone(), seq, Err(self.aborted(seq)));
        }
        let (work, done) = work::pair(self.inner.name.clone(), seq);
        let timeout = opts.timeout.unwrap_or(self.inner.shared.opts.get_timeout());
        let job = Job {
            seq,
            deadline: crate::config::deadline_after(timeout),
            timeout,
            algo: opts.algorithm,
            body: make(done),
        };
        // LANE-6: a small op on an idle lane runs here, under the issue lock (so later issuers
        // on this lane queue behind it), without a hand-off to the progress thread.
        let inner = &self.inner;
        if opts.blocking
            && bytes <= inner.inline_bytes
            && inner.pending.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            // Waits on the peers here, on the issuing thread (BLOCK-1).
            let _blocked = crate::blocked::on_op(inner.name.clone(), seq);
            let mut w = inner.worker.lock().unwrap_or_else(|e| e.into_inner());
            w.next_seq = job.seq + 1;
            w.handle(job);
            drop(w);
            inner.pending.fetch_sub(1, Ordering::AcqRel);
            return work;
        }
        inner.pending.fetch_add(1, Ordering::AcqRel);
        if let Some(tx) = &self.inner.tx {
            if let Err(e) = tx.send(Msg::Job(job)) {
                // The thread is gone (it panicked): completing through the dropped job's
                // completer already reported it.
                drop(e);
            }
        }
        work
    }

    /// All-reduce `buf` in place; returns it.
    pub fn all_reduce(&self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.all_reduce_opts(buf, op, &CallOptions::default())
    }

    /// [`Lane::all_reduce`] with options.
    pub fn all_reduce_opts(
        &self,
        buf: Vec<f32>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Work<Vec<f32>> {
        let bytes = buf.len() * 4;
        self.issue(opts, bytes, Ok(()), |done| Body::AllReduce { buf, op, done })
    }

    /// `input.len() == world * output.len()`; rank r gets the reduction of slice r of every
    /// rank's input. `input` is used as scratch and handed back.
    pub fn reduce_scatter(
        &self,
        input: Vec<f32>,
        output: Vec<f32>,
        op: ReduceOp,
    ) -> Work<(Vec<f32>, Vec<f32>)> {
        self.reduce_scatter_opts(input, output, op, &CallOptions::default())
    }

    /// [`Lane::reduce_scatter`] with options.
    pub fn reduce_scatter_opts(
        &self,
        input: Vec<f32>,
        output: Vec<f32>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Work<(Vec<f32>, Vec<f32>)> {
        let w = self.inner.shared.world;
        let check = if input.len() == w * output.len() {
            Ok(())
        } else {
            Err(format!(
                "reduce_scatter: input has {} elements, expected world {w} x output {}",
                input.len(),
                output.len()
            ))
        };
        let bytes = input.len() * 4;
        self.issue(opts, bytes, check, |done| Body::ReduceScatter { input, output, op, done })
    }

    /// `output.len() == world * input.len()`; slice r of output is rank r's input.
    pub fn all_gather(&self, input: Vec<f32>, output: Vec<f32>) -> Work<(Vec<f32>, Vec<f32>)> {
        self.all_gather_opts(input, output, &CallOptions::default())
    }

    /// [`Lane::all_gather`] with options.
    pub fn all_gather_opts(
        &self,
        input: Vec<f32>,
        output: Vec<f32>,
        opts: &CallOptions,
    ) -> Work<(Vec<f32>, Vec<f32>)> {
        let w = self.inner.shared.world;
        let check = if output.len() == w * input.len() {
            Ok(())
        } else {
            Err(format!(
                "all_gather: output has {} elements, expected world {w} x input {}",
                output.len(),
                input.len()
            ))
        };
        let bytes = output.len() * 4;
        self.issue(opts, bytes, check, |done| Body::AllGather { input, output, done })
    }

    /// In-place all-gather (NCCL's `sendbuff == recvbuff + rank * count`): `buf` holds
    /// `world` slices of equal length and slice `rank` is this rank's shard on entry; on
    /// return every slice holds its rank's shard. Saves the copy of the own shard that
    /// [`Lane::all_gather`] makes. Ranks may mix the two forms in one op.
    pub fn all_gather_in_place(&self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.all_gather_in_place_opts(buf, &CallOptions::default())
    }

    /// [`Lane::all_gather_in_place`] with options.
    pub fn all_gather_in_place_opts(&self, buf: Vec<f32>, opts: &CallOptions) -> Work<Vec<f32>> {
        let check = self.check_world_multiple("all_gather_in_place", buf.len());
        let bytes = buf.len() * 4;
        self.issue(opts, bytes, check, |done| Body::AllGatherInPlace { buf, done })
    }

    /// In-place reduce-scatter (NCCL's `recvbuff == sendbuff + rank * recvcount`): `buf`
    /// holds `world` slices of equal length; on return slice `rank` holds the reduction of
    /// slice `rank` of every rank's `buf`, and the other slices are scratch. Saves the copy
    /// into a separate output that [`Lane::reduce_scatter`] makes.
    pub fn reduce_scatter_in_place(&self, buf: Vec<f32>, op: ReduceOp) -> Work<Vec<f32>> {
        self.reduce_scatter_in_place_opts(buf, op, &CallOptions::default())
    }

    /// [`Lane::reduce_scatter_in_place`] with options.
    pub fn reduce_scatter_in_place_opts(
        &self,
        buf: Vec<f32>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Work<Vec<f32>> {
        let check = self.check_world_multiple("reduce_scatter_in_place", buf.len());
        let bytes = buf.len() * 4;
        self.issue(opts, bytes, check, |done| Body::ReduceScatterInPlace { buf, op, done })
    }

    fn check_world_multiple(&self, what: &str, len: usize) -> Result<(), String> {
        let w = self.inner.shared.world;
        if len.is_multiple_of(w) {
            Ok(())
        } else {
            Err(format!("{what}: buffer has {len} elements, not a multiple of world {w}"))
        }
    }

    /// Copies `root`'s buffer into every rank's buffer.
    pub fn broadcast(&self, buf: Vec<f32>, root: usize) -> Work<Vec<f32>> {
        self.broadcast_opts(buf, root, &CallOptions::default())
    }

    /// [`Lane::broadcast`] with options.
    pub fn broadcast_opts(&self, buf: Vec<f32>, root: usize, opts: &CallOptions) -> Work<Vec<f32>> {
        let w = self.inner.shared.world;
        let check = if root < w {
            Ok(())
        } else {
            Err(format!("broadcast: root {root} outside world {w}"))
        };
        let bytes = buf.len() * 4;
        self.issue(opts, bytes, check, |done| Body::Broadcast { buf, root, done })
    }

    /// Completes once every rank has reached it.
    pub fn barrier(&self) -> Work<()> {
        self.barrier_opts(&CallOptions::default())
    }

    /// [`Lane::barrier`] with options (the algorithm is ignored).
    pub fn barrier_opts(&self, opts: &CallOptions) -> Work<()> {
        self.issue(opts, 0, Ok(()), |done| Body::Barrier { done })
    }

    /// Latency path with a user combine over records of `record_len` elements: the result
    /// on every rank is the fold of all ranks' buffers in rank order 0..world,
    /// `combine(acc, other)` called once per record; bitwise identical on every rank; one
    /// message per peer.
    pub fn all_reduce_records(
        &self,
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
    ) -> Work<Vec<f32>> {
        self.all_reduce_records_opts(buf, record_len, combine, &CallOptions::default())
    }

    /// [`Lane::all_reduce_records`] with options (the algorithm is always Direct).
    pub fn all_reduce_records_opts(
        &self,
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
        opts: &CallOptions,
    ) -> Work<Vec<f32>> {
        let check = if record_len > 0 && buf.len().is_multiple_of(record_len) {
            Ok(())
        } else {
            Err(format!(
                "all_reduce_records: {} elements are not whole records of {record_len}",
                buf.len()
            ))
        };
        let bytes = buf.len() * 4;
        self.issue(opts, bytes, check, |done| Body::Records { buf, record_len, combine, done })
    }
}

/// Asks the scheduler for a `us` microsecond slice on this thread ([`crate::config::
/// LANE_SLICE_US`]), keeping its nice value. Best effort: a kernel without custom slices
/// refuses or ignores it, and nothing else depends on it.
#[cfg(target_os = "linux")]
fn request_slice(us: u64) {
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
        util_min: u32,
        util_max: u32,
    }
    if us == 0 {
        return;
    }
    // SAFETY: plain syscalls on the calling thread (pid 0) with a fully initialised,
    // correctly sized sched_attr (SCHED_ATTR_SIZE_VER1) that outlives the call.
    unsafe {
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        let attr = SchedAttr {
            size: std::mem::size_of::<SchedAttr>() as u32,
            policy: libc::SCHED_OTHER as u32,
            flags: 0,
            nice,
            priority: 0,
            runtime: us.saturating_mul(1000),
            deadline: 0,
            period: 0,
            util_min: 0,
            util_max: 0,
        };
        let _ = libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0u32);
    }
}

#[cfg(not(target_os = "linux"))]
fn request_slice(_us: u64) {}

struct Worker {
    /// The lane's sent-bytes counter (LANE-8).
    sent: Arc<AtomicU64>,
    name: Arc<str>,
    hash: u32,
    shared: Arc<Shared>,
    links: Box<dyn LaneLinks>,
    exec: Executor,
    failed: Option<CollectiveError>,
    next_seq: u64,
    /// Schedules by (kind, algorithm, count, root): steady-state training repeats the same
    /// few ops, so each schedule is built once.
    schedules: HashMap<(OpKind, Algorithm, usize, usize), Arc<Schedule>>,
    /// Told the lane's staging bytes whenever they change (`Lane::set_account`).
    account: Option<(Arc<dyn PoolAccount>, usize)>,
}

impl Worker {
    /// The links' staging and the executor's scratch.
    fn staging_bytes(&self) -> usize {
        self.links.staging_bytes() + self.exec.scratch_bytes()
    }

    /// Reports the staging bytes to the account when they changed.
    fn report_staging(&mut self) {
        let now = self.staging_bytes();
        if let Some((a, told)) = &mut self.account {
            if *told != now {
                // A refusal cannot take back scratch an op needs: the account keeps its
                // old figure (the accountant reports its refusals itself).
                a.held(now as u64);
                *told = now;
            }
        }
    }
}

/// Most schedules a lane keeps; beyond it the cache starts over.
const SCHEDULE_CACHE: usize = 64;

struct OpCtx {
    seq: u64,
    deadline: Instant,
    timeout: Duration,
    tag: Tag,
}

impl Worker {
    /// Takes the next message, polling briefly first: ops issued back to back then skip the
    /// thread wake-up (yielding keeps the poll cheap when cores are oversubscribed).
    fn next(rx: &Receiver<Msg>) -> Option<Msg> {
        let start = Instant::now();
        while start.elapsed() < POLL_BEFORE_BLOCK {
            match rx.try_recv() {
                Ok(m) => return Some(m),
                Err(crossbeam::channel::TryRecvError::Disconnected) => return None,
                Err(crossbeam::channel::TryRecvError::Empty) => std::thread::yield_now(),
            }
        }
        rx.recv().ok()
    }

    fn run(worker: Arc<Mutex<Worker>>, pending: Arc<AtomicUsize>, rx: Receiver<Msg>) {
        request_slice(crate::config::LANE_SLICE_US.get());
        while let Some(msg) = Self::next(&rx) {
            let mut guard = worker.lock().unwrap_or_else(|e| e.into_inner());
            let this = &mut *guard;
            match msg {
                Msg::Job(job) => {
                    this.next_seq = job.seq + 1;
                    this.handle(job);
                    drop(guard);
                    pending.fetch_sub(1, Ordering::AcqRel);
                }
                Msg::Abort => {
                    if this.failed.is_none() {
                        let e = CollectiveError::Aborted {
                            lane: this.name.to_string(),
                            seq: this.next_seq,
                            reason: this.shared.abort_reason(),
                        };
                        let reason = format!("aborted: {}", this.shared.abort_reason());
                        this.fail(e, Some(Reason::Other(reason)));
                    }
                }
            }
        }
    }

    fn fail(&mut self, e: CollectiveError, reason: Option<Reason>) {
        tracing::debug!(lane = %self.name, rank = self.shared.rank, error = %e, "lane failed");
        if let Some(r) = reason {
            self.links.poison(&Poison {
                origin: self.shared.rank,
                reason: fingerprint::format_reason(&r),
            });
        }
        self.failed = Some(e);
    }

    /// Whether `Auto`, resolved to a ring, gathers directly instead: where the transport
    /// prefers it (`LaneLinks::prefers_direct_gather`, the same on every rank).
    fn auto_gathers_direct(&self, asked: Algorithm, resolved: Algorithm) -> bool {
        asked == Algorithm::Auto
            && resolved == Algorithm::Ring
            && self.links.prefers_direct_gather()
    }

    fn resolve(&self, algo: Algorithm, bytes: usize) -> Algorithm {
        match algo {
            Algorithm::Auto => {
                let t = &self.shared.topology;
                if bytes <= self.shared.opts.get_small_bytes() {
                    Algorithm::Direct
                } else if t.nodes() > 1 && t.is_uniform() {
                    Algorithm::Hierarchical
                } else {
                    Algorithm::Ring
                }
            }
            a => a,
        }
    }

    fn handle(&mut self, job: Job) {
        job.body.start(Instant::now());
        let (rank, world) = (self.shared.rank, self.shared.world);
        let shared = self.shared.clone();
        let topo = &shared.topology;
        let mk = |me: &Self, kind, op, algo, count, root| OpCtx {
            seq: job.seq,
            deadline: job.deadline,
            timeout: job.timeout,
            tag: op_tag(me.hash, job.seq, kind, op, algo, count, root),
        };
        match job.body {
            Body::AllReduce { mut buf, op, done } => {
                let n = buf.len();
                let algo = self.resolve(job.algo, n * 4);
                // The ring's all-gather half goes direct where the transport prefers it
                // (every rank decides alike). Not where it prefers pieces: over tcp a direct
                // half in pieces measured the same as the ring (W=4, 64 MiB: 1.32-1.44 GB/s
                // busbw either way), so the ring stays.
                let direct_gather = self.auto_gathers_direct(job.algo, algo);
                let key = (OpKind::AllReduce, algo, n, usize::from(direct_gather));
                let sched = self.schedule(key, || match algo {
                    Algorithm::Direct => algo::direct_all_reduce(rank, world, n),
                    Algorithm::Hierarchical => algo::hier_all_reduce(rank, topo, n),
                    _ if direct_gather => algo::ring_all_reduce_direct_gather(rank, world, n),
                    _ => algo::ring_all_reduce(rank, world, n),
                });
                let ctx = mk(self, OpKind::AllReduce, Some(op), algo, n, None);
                let r = self.execute(&ctx, &sched, Regions::work(&mut buf), Combine::Op(op));
                if r.is_ok() && op == ReduceOp::Avg {
                    scale_avg(&mut buf, world);
                }
                done.complete(r.map(|_| buf));
            }
            Body::Records { mut buf, record_len, combine, done } => {
                let n = buf.len();
                let sched = self.schedule((OpKind::AllReduce, Algorithm::Direct, n, 0), || {
                    algo::direct_all_reduce(rank, world, n)
                });
                // The record length rides in the root field, so ranks that disagree on it
                // get a Mismatch too.
                let ctx = mk(
                    self,
                    OpKind::AllReduceRecords,
                    None,
                    Algorithm::Direct,
                    n,
                    Some(record_len),
                );
                let r = self.execute(
                    &ctx,
                    &sched,
                    Regions::work(&mut buf),
                    Combine::Records { len: record_len, f: combine },
                );
                done.complete(r.map(|_| buf));
            }
            Body::ReduceScatter { mut input, mut output, op, done } => {
                let n = output.len();
                let algo = self.resolve(job.algo, input.len() * 4);
                let ctx = mk(self, OpKind::ReduceScatter, Some(op), algo, input.len(), None);
                // The last step reduces straight into the output where the schedule allows
                // it (ALGO-5): one pass over the own slot less than reducing in place and
                // copying it out.
                let rs = self.reduce_scatter_schedule(algo, n);
                let sched = self.schedule((OpKind::ReduceScatter, algo, n, 1), || {
                    algo::reduce_scatter_into((*rs).clone(), rank, n)
                });
                let r = self.execute(
                    &ctx,
                    &sched,
                    Regions { buf: &mut input, input: &[], output: &mut output },
                    Combine::Op(op),
                );
                if r.is_ok() && op == ReduceOp::Avg {
                    scale_avg(&mut output, world);
                }
                done.complete(r.map(|_| (input, output)));
            }
            Body::AllGather { input, mut output, done } => {
                let n = input.len();
                let algo = self.all_gather_algorithm(job.algo, output.len() * 4);
                // Direct over a transport that prefers it, or in pieces: peers read the shard
                // from the input where the caller left it, and the own copy comes last (in
                // pieces: each piece right after it went out).
                let from_input = algo == Algorithm::Direct
                    && (self.links.prefers_direct_gather() || self.links.prefers_pieced_gather());
                let sched = self.all_gather_schedule(algo, n, from_input);
                let ctx = mk(self, OpKind::AllGather, None, algo, output.len(), None);
                let r = if from_input {
                    self.execute(
                        &ctx,
                        &sched,
                        Regions { buf: &mut output, input: &input, output: &mut [] },
                        Combine::Op(ReduceOp::Sum),
                    )
                } else {
                    crate::memcopy::copy(&mut output[rank * n..(rank + 1) * n], &input);
                    self.execute(
                        &ctx,
                        &sched,
                        Regions::work(&mut output),
                        Combine::Op(ReduceOp::Sum),
                    )
                };
                done.complete(r.map(|_| (input, output)));
            }
            Body::ReduceScatterInPlace { mut buf, op, done } => {
                let n = buf.len() / world;
                // The same schedule (and wire traffic) as the out-of-place form, whose work
                // buffer is its input; only the final copy into a separate output is gone.
                let algo = self.resolve(job.algo, buf.len() * 4);
                let sched = self.reduce_scatter_schedule(algo, n);
                let ctx = mk(self, OpKind::ReduceScatter, Some(op), algo, buf.len(), None);
                let r = self.execute(&ctx, &sched, Regions::work(&mut buf), Combine::Op(op));
                if r.is_ok() && op == ReduceOp::Avg {
                    scale_avg(&mut buf[rank * n..(rank + 1) * n], world);
                }
                done.complete(r.map(|_| buf));
            }
            Body::AllGatherInPlace { mut buf, done } => {
                let n = buf.len() / world;
                let algo = self.all_gather_algorithm(job.algo, buf.len() * 4);
                // The shard already lies in its slot: the schedules that send from the work
                // buffer need no own copy (the direct one is wire-identical to the form that
                // sends from a separate input).
                let sched = self.all_gather_schedule(algo, n, false);
                let ctx = mk(self, OpKind::AllGather, None, algo, buf.len(), None);
                let r =
                    self.execute(&ctx, &sched, Regions::work(&mut buf), Combine::Op(ReduceOp::Sum));
                done.complete(r.map(|_| buf));
            }
            Body::Broadcast { mut buf, root, done } => {
                let n = buf.len();
                let algo = match self.resolve(job.algo, n * 4) {
                    Algorithm::Direct => Algorithm::Direct,
                    _ => Algorithm::Ring,
                };
                let piece = (self.shared.opts.get_pipeline_bytes() / 4).max(1);
                let sched = self.schedule((OpKind::Broadcast, algo, n, root), || {
                    if algo == Algorithm::Direct {
                        algo::direct_broadcast(rank, world, root, n)
                    } else {
                        let pieces = n.div_ceil(piece).clamp(1, MAX_PIECES);
                        algo::chain_broadcast(rank, world, root, n, pieces)
                    }
                });
                let ctx = mk(self, OpKind::Broadcast, None, algo, n, Some(root));
                let r =
                    self.execute(&ctx, &sched, Regions::work(&mut buf), Combine::Op(ReduceOp::Sum));
                done.complete(r.map(|_| buf));
            }
            Body::Barrier { done } => {
                let sched = self.schedule((OpKind::AllReduce, Algorithm::Direct, 0, 0), || {
                    algo::direct_all_reduce(rank, world, 0)
                });
                let ctx = mk(self, OpKind::Barrier, None, Algorithm::Direct, 0, None);
                let r =
                    self.execute(&ctx, &sched, Regions::work(&mut []), Combine::Op(ReduceOp::Sum));
                done.complete(r);
            }
        }
    }

    /// Reduce-scatter's schedule for `n` elements per rank (both forms: the work buffer is
    /// the whole input).
    fn reduce_scatter_schedule(&mut self, algo: Algorithm, n: usize) -> Arc<Schedule> {
        let (rank, world, shared) = (self.shared.rank, self.shared.world, self.shared.clone());
        self.schedule((OpKind::ReduceScatter, algo, n, 0), || match algo {
            Algorithm::Direct => algo::direct_reduce_scatter(rank, world, n),
            Algorithm::Hierarchical => algo::hier_reduce_scatter(rank, &shared.topology, n),
            _ => algo::ring_reduce_scatter(rank, world, n),
        })
    }

    /// All-gather's algorithm: `Auto` resolved, and direct where the transport prefers it,
    /// or prefers pieces at a small world (`LaneLinks::prefers_pieced_gather`; the same on
    /// every rank).
    fn all_gather_algorithm(&self, requested: Algorithm, bytes: usize) -> Algorithm {
        let algo = self.resolve(requested, bytes);
        let pieced = requested == Algorithm::Auto
            && algo == Algorithm::Ring
            && self.links.prefers_pieced_gather()
            && self.shared.world <= crate::transport::PIECED_GATHER_MAX_WORLD;
        if pieced || self.auto_gathers_direct(requested, algo) {
            Algorithm::Direct
        } else {
            algo
        }
    }

    /// All-gather's schedule for `n` elements per rank; `from_input`: direct, sending from
    /// the op's separate input.
    fn all_gather_schedule(
        &mut self,
        algo: Algorithm,
        n: usize,
        from_input: bool,
    ) -> Arc<Schedule> {
        let (rank, world, shared) = (self.shared.rank, self.shared.world, self.shared.clone());
        // Pieces change the steps, not the wire bytes; every rank decides alike (the
        // transport's kind and the size).
        let pieces = if self.links.prefers_pieced_gather() {
            n.div_ceil((shared.opts.get_pipeline_bytes() / 4).max(1)).clamp(1, MAX_PIECES)
        } else {
            1
        };
        self.schedule((OpKind::AllGather, algo, n, usize::from(from_input)), || match algo {
            Algorithm::Direct if from_input => {
                algo::direct_all_gather_from_input(rank, world, n, pieces)
            }
            Algorithm::Direct => algo::direct_all_gather(rank, world, n, pieces),
            Algorithm::Hierarchical => algo::hier_all_gather(rank, &shared.topology, n),
            _ => algo::ring_all_gather(rank, world, n),
        })
    }

    fn schedule(
        &mut self,
        key: (OpKind, Algorithm, usize, usize),
        build: impl FnOnce() -> Schedule,
    ) -> Arc<Schedule> {
        if let Some(s) = self.schedules.get(&key) {
            return s.clone();
        }
        if self.schedules.len() >= SCHEDULE_CACHE {
            self.schedules.clear();
        }
        let s = Arc::new(build());
        self.schedules.insert(key, s.clone());
        s
    }

    fn execute(
        &mut self,
        ctx: &OpCtx,
        sched: &Schedule,
        regions: Regions<'_>,
        combine: Combine,
    ) -> Result<(), CollectiveError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.shared.cancel.load(Ordering::Acquire) {
            let reason = self.shared.abort_reason();
            let e = CollectiveError::Aborted {
                lane: self.name.to_string(),
                seq: ctx.seq,
                reason: reason.clone(),
            };
            self.fail(e.clone(), Some(Reason::Other(format!("aborted: {reason}"))));
            return Err(e);
        }
        let kind = fingerprint::OpKind::from_code(ctx.tag.kind & 0xff).map_or("op", |k| k.name());
        self.shared.recent.start(&self.name, ctx.seq, kind, regions.buf.len() * 4);
        self.exec.reserve_scratch(sched.scratch_len);
        self.report_staging();
        let wire = WireCtx { tag: ctx.tag, deadline: ctx.deadline, cancel: &self.shared.cancel };
        let before = self.exec.sent_bytes();
        let res = self.exec.run(&mut *self.links, sched, regions, combine, wire);
        let sent = self.exec.sent_bytes() - before;
        self.sent.fetch_add(sent, Ordering::AcqRel);
        self.shared.sent.fetch_add(sent, Ordering::AcqRel);
        self.shared.recent.end(&self.name, ctx.seq, res.is_err());
        match res {
            Ok(()) => Ok(()),
            Err(te) => {
                let (e, reason) = self.convert(te, ctx);
                self.fail(e.clone(), reason);
                Err(e)
            }
        }
    }

    /// Maps a transport error to this rank's error and the reason to poison peers with
    /// (LANE-3; none when the error itself came from a peer's poison).
    fn convert(&self, te: TransportError, ctx: &OpCtx) -> (CollectiveError, Option<Reason>) {
        let lane = self.name.to_string();
        let (seq, me) = (ctx.seq, self.shared.rank);
        let timeout_ms = ctx.timeout.as_millis() as u64;
        match te {
            TransportError::Timeout { peer } => (
                CollectiveError::Timeout { lane, seq, peer, timeout_ms },
                Some(Reason::Timeout { peer }),
            ),
            TransportError::PeerLost { peer, detail } => (
                CollectiveError::PeerLost { rank: peer, lane, seq, detail: detail.clone() },
                Some(Reason::Lost { peer, detail }),
            ),
            TransportError::TagMismatch { peer, expected, got } => {
                let (ours, theirs) = describe_pair(&expected, &got);
                (
                    CollectiveError::Mismatch {
                        lane,
                        seq,
                        rank: me,
                        ours: ours.clone(),
                        peer,
                        theirs: theirs.clone(),
                    },
                    Some(Reason::Mismatch { peer, ours, theirs }),
                )
            }
            TransportError::Poisoned(p) => {
                let origin = p.origin;
                let e = match parse_reason(&p.reason) {
                    Reason::Mismatch { peer, ours: a, theirs: b } => {
                        if peer == me {
                            CollectiveError::Mismatch {
                                lane,
                                seq,
                                rank: me,
                                ours: b,
                                peer: origin,
                                theirs: a,
                            }
                        } else {
                            let mine = describe(&ctx.tag);
                            let (peer, theirs) = if mine == b { (origin, a) } else { (peer, b) };
                            CollectiveError::Mismatch {
                                lane,
                                seq,
                                rank: me,
                                ours: mine,
                                peer,
                                theirs,
                            }
                        }
                    }
                    Reason::Timeout { peer } if peer != me => {
                        CollectiveError::Timeout { lane, seq, peer, timeout_ms }
                    }
                    Reason::Timeout { .. } => CollectiveError::PeerFailed {
                        lane,
                        seq,
                        detail: format!("rank {origin} timed out waiting for this rank"),
                    },
                    Reason::Lost { peer, detail } => CollectiveError::PeerLost {
                        rank: peer,
                        lane,
                        seq,
                        detail: format!("{detail} (reported by rank {origin})"),
                    },
                    Reason::Other(s) => CollectiveError::PeerFailed {
                        lane,
                        seq,
                        detail: format!("rank {origin} failed: {s}"),
                    },
                };
                (e, None)
            }
            TransportError::Cancelled => {
                let reason = self.shared.abort_reason();
                (
                    CollectiveError::Aborted { lane, seq, reason: reason.clone() },
                    Some(Reason::Other(format!("aborted: {reason}"))),
                )
            }
            other => {
                let text = other.to_string();
                (CollectiveError::Transport { lane, source: other }, Some(Reason::Other(text)))
            }
        }
    }
}
