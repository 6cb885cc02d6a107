//! The replica all-reduce chained behind a unit's reduce-scatter (HSDP-3): a thread of the
//! rank waits for each reduce-scatter over the shard group, in issue order, and issues the
//! all-reduce of its reduced shard over the replica group on the replica lane, so that the
//! compute thread never blocks on either and the reductions overlap backward as plain
//! reduce-scatters do.
//!
//! Every rank of a replica group issues its reduce-scatters in the same unit order, they
//! complete in that order on their lane (LANE-1), and the chain issues in completion order:
//! the replica lane's ops line up on every member.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{unbounded, Sender};
use shardline_collectives::quant::Code;
use shardline_collectives::{CollectiveError, Lane, ReduceOp, Work};

use super::clock::CommClock;
use super::replica_quant;
use crate::error::{Result, RuntimeError};
use crate::telemetry::{Row, Trace};

/// A reduce-scatter over the shard group, as issued.
pub(crate) enum Scatter {
    /// Out of place (stages 2 and 3): `(full input, own reduced shard)`.
    Shard(Work<(Vec<f32>, Vec<f32>)>),
    /// In place (stage 1): the full buffer, whose `range` holds the reduced shard.
    InPlace(Work<Vec<f32>>, Range<usize>),
}

/// What the chain hands back: the reduce-scatter's buffers, its span, and the replica
/// all-reduce of the shard in flight.
pub(crate) struct Issued {
    /// The full buffer: a reduce-scatter's input (out of place) or the buffer whose range
    /// receives the all-reduced shard (in place).
    pub(crate) full: Vec<f32>,
    /// In place: where the shard goes back.
    pub(crate) range: Option<Range<usize>>,
    /// The reduce-scatter's span on its lane (WORK-1).
    pub(crate) scatter_span: Option<(Instant, Instant)>,
    /// The reduction of the shard over the replica group.
    pub(crate) op: ReplicaOp,
}

/// The reduction across the replica group in flight.
pub(crate) enum ReplicaOp {
    /// An f32 all-reduce (sum) of the shard.
    Sum(Work<Vec<f32>>),
    /// The packed shards' all-gather, summed when waited for (QREDUCE-1): `len` values
    /// over `replicas` replicas.
    Packed { work: Work<(Vec<f32>, Vec<f32>)>, quant: (Code, usize), len: usize, replicas: usize },
}

/// A chained reduction's result.
pub(crate) struct Reduced {
    /// The full buffer (see [`Issued::full`]).
    pub(crate) full: Vec<f32>,
    /// In place: where `shard` goes back in `full`.
    pub(crate) range: Option<Range<usize>>,
    /// The unit's gradient shard summed over the world.
    pub(crate) shard: Vec<f32>,
}

#[derive(Default)]
struct Slot {
    issued: Mutex<Option<std::result::Result<Issued, CollectiveError>>>,
    cv: Condvar,
}

/// One unit's chained reduction: done once its replica all-reduce is.
pub(crate) struct Chained {
    slot: Arc<Slot>,
    /// Longest wait for the chain to issue: the reduce-scatter's deadline has passed by then.
    patience: Duration,
}

impl Chained {
    /// Whether waiting would not block.
    pub(crate) fn is_done(&self) -> bool {
        match &*self.slot.issued.lock().unwrap_or_else(|e| e.into_inner()) {
            None => false,
            Some(Ok(i)) => match &i.op {
                ReplicaOp::Sum(w) => w.is_done(),
                ReplicaOp::Packed { work, .. } => work.is_done(),
            },
            Some(Err(_)) => true,
        }
    }

    /// Waits for both ops. The blocked time is exposed communication; both spans go on the
    /// reduce row and into the step's communication time (ENG-4).
    pub(crate) fn wait(
        self,
        clock: &mut CommClock,
        trace: &Trace,
        rank: usize,
        what: &str,
    ) -> Result<Reduced> {
        let t0 = Instant::now();
        let issued = {
            let _blocked = shardline_collectives::blocked::on(format!("{what} (rank {rank})"));
            let mut g = self.slot.issued.lock().unwrap_or_else(|e| e.into_inner());
            let end = t0 + self.patience;
            loop {
                if let Some(r) = g.take() {
                    break r;
                }
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(RuntimeError::config(format!(
                        "{what}: the replica chain did not issue within {:?}",
                        self.patience
                    )));
                }
                g = self.slot.cv.wait_timeout(g, left).unwrap_or_else(|e| e.into_inner()).0;
            }
        };
        clock.exposed += t0.elapsed();
        let Issued { full, range, scatter_span, op } = issued?;
        if let Some(span) = scatter_span {
            let bytes = full.len() as u64 * 4;
            trace.record_op(rank, Row::Reduce, format!("reduce-scatter {what}"), span, bytes);
            clock.spans.push(span);
        }
        let shard = match op {
            ReplicaOp::Sum(w) => {
                clock.wait(trace, rank, w, Row::Reduce, &format!("all-reduce (replica) {what}"))?
            }
            ReplicaOp::Packed { work, quant: (code, block), len, replicas } => {
                let label = format!("all-gather {} (replica) {what}", code.name());
                let (_, gathered) = clock.wait(trace, rank, work, Row::Reduce, &label)?;
                replica_quant::sum_packed(code, block, len, replicas, &gathered)
            }
        };
        Ok(Reduced { full, range, shard })
    }
}

struct Job {
    scatter: Scatter,
    slot: Arc<Slot>,
}

/// The rank's chain thread over the replica lane (HSDP-3).
pub(crate) struct ReplicaChain {
    lane: Lane,
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    patience: Duration,
}

impl ReplicaChain {
    /// Starts the chain over `lane`, the replica group's; `timeout` is the collectives'
    /// deadline (a reduce-scatter has ended, one way or the other, within it).
    /// `quant`: pack the shards with this code and block for the `replicas` ranks of the
    /// replica group instead of an f32 all-reduce.
    pub(crate) fn start(
        lane: Lane,
        timeout: Duration,
        quant: Option<(Code, usize)>,
        replicas: usize,
    ) -> Result<Self> {
        let (tx, rx) = unbounded::<Job>();
        let chain_lane = lane.clone();
        let thread = std::thread::Builder::new()
            .name("replica-chain".into())
            .spawn(move || {
                for job in rx {
                    let out = chain(&chain_lane, quant.map(|q| (q, replicas)), job.scatter);
                    *job.slot.issued.lock().unwrap_or_else(|e| e.into_inner()) = Some(out);
                    job.slot.cv.notify_all();
                }
            })
            .map_err(|e| RuntimeError::config(format!("cannot start the replica chain: {e}")))?;
        Ok(ReplicaChain { lane, tx: Some(tx), thread: Some(thread), patience: timeout * 2 })
    }

    /// Queues a unit's reduce-scatter; its replica all-reduce follows it.
    pub(crate) fn after(&self, scatter: Scatter) -> Chained {
        let slot = Arc::new(Slot::default());
        let job = Job { scatter, slot: Arc::clone(&slot) };
        if let Some(tx) = &self.tx {
            if let Err(e) = tx.send(job) {
                // The thread is gone: fail the reduction instead of waiting for it.
                let what = "the replica chain has stopped".to_string();
                *e.0.slot.issued.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(Err(CollectiveError::InvalidArgument(what)));
            }
        }
        Chained { slot, patience: self.patience }
    }

    /// The replica lane.
    pub(crate) fn lane(&self) -> &Lane {
        &self.lane
    }
}

impl Drop for ReplicaChain {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits for the reduce-scatter and issues the replica reduction of its shard: an f32
/// all-reduce, or with `quant` the all-gather of the shard packed once (QREDUCE-2).
fn chain(
    lane: &Lane,
    quant: Option<((Code, usize), usize)>,
    scatter: Scatter,
) -> std::result::Result<Issued, CollectiveError> {
    let (r, scatter_span) = match scatter {
        Scatter::Shard(w) => {
            let (r, span) = w.wait_timed();
            (r.map(|(full, shard)| (shard, full, None)), span)
        }
        Scatter::InPlace(w, range) => {
            let (r, span) = w.wait_timed();
            (r.map(|full| (full[range.clone()].to_vec(), full, Some(range))), span)
        }
    };
    let (shard, full, range) = r?;
    let op = match quant {
        None => ReplicaOp::Sum(lane.all_reduce(shard, ReduceOp::Sum)),
        Some(((code, block), replicas)) => {
            let len = shard.len();
            let packed = replica_quant::pack_shard(code, block, &shard).map_err(|i| {
                CollectiveError::InvalidArgument(format!(
                    "--cross-node-reduce-dtype {}: gradient element {i} of the shard is not finite",
                    code.name()
                ))
            })?;
            let out = vec![0.0f32; packed.len() * replicas];
            ReplicaOp::Packed {
                work: lane.all_gather(packed, out),
                quant: (code, block),
                len,
                replicas,
            }
        }
    };
    Ok(Issued { full, range, scatter_span, op })
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_collectives::local_group;
    use shardline_collectives::testing::run_ranks;
    use std::sync::mpsc;

    /// HSDP-3: queuing a reduction never waits for its reduce-scatter (the peer has not
    /// even issued its part yet); the all-reduce follows it on the replica lane and the
    /// result is the sum over both groups.
    #[test]
    fn the_chain_never_blocks_its_caller_hsdp_3() {
        let t = Duration::from_secs(30);
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (go_tx, go_rx) = (Mutex::new(go_tx), Mutex::new(go_rx));
        let shards = run_ranks(local_group(4).unwrap(), 2 * t, move |comm| {
            let r = comm.rank();
            // Shard groups {0, 1}, {2, 3}; replica groups {0, 2}, {1, 3}.
            let shard = comm.subgroup("shard", &[r / 2 * 2, r / 2 * 2 + 1]).unwrap();
            let replica = comm.subgroup("replica", &[r % 2, r % 2 + 2]).unwrap();
            let chain = ReplicaChain::start(replica.lane("reduce").unwrap(), t, None, 2).unwrap();
            let scatter_lane = shard.lane("reduce").unwrap();
            if r == 1 {
                // Rank 1 joins only once rank 0's chain is queued.
                go_rx.lock().unwrap().recv_timeout(t).unwrap();
            }
            let input = vec![r as f32 + 1.0; 4];
            let w = scatter_lane.reduce_scatter(input, vec![0.0; 2], ReduceOp::Sum);
            let chained = chain.after(Scatter::Shard(w));
            if r == 0 {
                assert!(!chained.is_done(), "rank 1 has not issued its part");
                go_tx.lock().unwrap().send(()).unwrap();
            }
            let mut clock = CommClock::default();
            chained.wait(&mut clock, &Trace::disabled(), r, "unit").unwrap().shard
        });
        // 1 + 2 + 3 + 4: both shard groups' sums, summed across the replicas.
        assert!(shards.iter().all(|s| s == &vec![10.0; 2]), "{shards:?}");
    }
}
