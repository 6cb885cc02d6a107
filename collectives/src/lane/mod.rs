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

mod worker;

use worker::*;

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
