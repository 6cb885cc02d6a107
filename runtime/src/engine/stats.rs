//! The SyncBatchNorm statistics path: [`StatsLane`], the one [`StatsReducer`] the engine
//! hands the model. Each call counts one message, reduces it on the communicator's
//! [`STATS_LANE`] with a blocking call (forward records through
//! `Lane::all_reduce_records`, one message per peer and a rank-ordered fold, bitwise
//! identical on every rank; backward sums through `Lane::all_reduce`), records its span on
//! the trace's `stats` row and for the step's communication time (ENG-4), and turns a failure
//! into a typed [`StatsError`]: this rank, the lane, which message, and the collective's own
//! error as the cause. The model carries that error unchanged in `ModelError::Stats`, and the
//! runtime's error keeps it typed (`RuntimeError::Stats`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use shardline_collectives::{CallOptions, CollectiveError, Communicator, Lane, ReduceOp};
use shardline_models::{StatsError, StatsFailure, StatsOp, StatsReducer};

use super::clock::CommClock;
use crate::error::Result;
use crate::telemetry::{Row, Trace};

/// Name of the lane that carries SyncBatchNorm statistics, apart from the gather and reduce
/// lanes so that a large gather never delays a small, latency-bound statistics reduction.
pub const STATS_LANE: &str = "stats";

/// The engine's statistics reducer over its communicator's stats lane: counts, traces and
/// reduces every message.
pub(crate) struct StatsLane {
    lane: Lane,
    rank: usize,
    world: usize,
    trace: Trace,
    blocking: CallOptions,
    messages: AtomicUsize,
    /// The spans of this step's reductions, until the step takes them.
    spans: Mutex<Vec<(Instant, Instant)>>,
}

impl StatsLane {
    /// Opens the communicator's stats lane (collective: every rank opens it).
    pub(crate) fn open(comm: &Communicator, trace: Trace) -> Result<Self> {
        // The statistics are needed at once: a blocking call skips the lane thread hand-off.
        let mut blocking = CallOptions::new();
        blocking.blocking(true);
        Ok(StatsLane {
            lane: comm.lane(STATS_LANE)?,
            rank: comm.rank(),
            world: comm.world(),
            trace,
            blocking,
            messages: AtomicUsize::new(0),
            spans: Mutex::default(),
        })
    }

    /// The lane (its staging bytes are registered by the engine).
    pub(crate) fn lane(&self) -> &shardline_collectives::Lane {
        &self.lane
    }

    /// Starts a step's count and spans afresh.
    pub(crate) fn begin_step(&self) {
        self.messages.store(0, Ordering::Relaxed);
        self.lock_spans().clear();
    }

    /// Ends a step: moves its reductions' spans into the step's clock, and their time into
    /// its exposed communication, since each blocked the step (ENG-4); returns how many
    /// messages it sent.
    pub(crate) fn end_step(&self, clock: &mut CommClock) -> usize {
        for (t0, t1) in self.lock_spans().drain(..) {
            // A blocking call: the step waited for all of it (exposed, ENG-4).
            clock.exposed += t1 - t0;
            clock.spans.push((t0, t1));
        }
        self.messages.swap(0, Ordering::Relaxed)
    }

    fn lock_spans(&self) -> std::sync::MutexGuard<'_, Vec<(Instant, Instant)>> {
        self.spans.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a message, runs `reduce`, and records its span on the `stats` row and for the
    /// step; a failure becomes a [`StatsError`] for `op`.
    fn traced(
        &self,
        op: StatsOp,
        reduce: impl FnOnce() -> std::result::Result<Vec<f32>, CollectiveError>,
    ) -> std::result::Result<Vec<f32>, StatsError> {
        self.messages.fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        let r = reduce();
        let t1 = Instant::now();
        let name = match op {
            StatsOp::Forward => "stats forward",
            StatsOp::Backward => "stats backward",
        };
        self.trace.record(self.rank, Row::Stats, name, t0, t1);
        self.lock_spans().push((t0, t1));
        r.map_err(|e| {
            StatsError::new(self.rank, self.lane.name(), op, StatsFailure::Collective(Box::new(e)))
        })
    }
}

impl StatsReducer for StatsLane {
    fn world(&self) -> usize {
        self.world
    }

    fn reduce_records(
        &self,
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
    ) -> std::result::Result<Vec<f32>, StatsError> {
        self.traced(StatsOp::Forward, || {
            self.lane.all_reduce_records_opts(buf, record_len, combine, &self.blocking).wait()
        })
    }

    fn reduce_sum(&self, buf: Vec<f32>) -> std::result::Result<Vec<f32>, StatsError> {
        self.traced(StatsOp::Backward, || {
            self.lane.all_reduce_opts(buf, ReduceOp::Sum, &self.blocking).wait()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RuntimeError;
    use shardline_models::batchnorm::combine_stats;

    /// Every message is counted, traced on the `stats` row and handed to the step's clock
    /// (ENG-4); both ranks get the same sums.
    #[test]
    fn every_message_is_counted_traced_and_timed() {
        let comms = shardline_collectives::local_group(2).unwrap();
        let trace = Trace::new();
        let out: Vec<(Vec<f32>, usize, usize)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|comm| {
                    let trace = trace.clone();
                    s.spawn(move || {
                        let lane = StatsLane::open(comm, trace).unwrap();
                        lane.begin_step();
                        let r = comm.rank() as f32;
                        let sum = lane.reduce_sum(vec![r, 1.0]).unwrap();
                        // One channel's (count, mean, M2), each an (hi, lo) pair.
                        let rec = vec![2.0, 0.0, r, 0.0, 0.5, 0.0];
                        let merged = lane.reduce_records(rec, 6, combine_stats).unwrap();
                        assert_eq!((merged[0], merged[2]), (4.0, 0.5), "the merged count and mean");
                        let mut clock = CommClock::default();
                        let n = lane.end_step(&mut clock);
                        let again = lane.end_step(&mut clock);
                        assert_eq!(again, 0, "a step's count is taken once");
                        (sum, n, clock.spans.len())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sum, n, spans) in out {
            assert_eq!(sum, vec![1.0, 2.0]);
            assert_eq!((n, spans), (2, 2));
        }
        let evs = trace.events();
        let on_stats =
            |name: &str| evs.iter().filter(|e| e.row == Row::Stats && e.name == name).count();
        assert_eq!(on_stats("stats forward"), 2);
        assert_eq!(on_stats("stats backward"), 2);
    }

    /// A failed reduction is a typed error end to end: the reducer's [`StatsError`] names
    /// the rank, the lane and the message and carries the collective's own error; the model
    /// passes it on and the runtime's error keeps it.
    #[test]
    fn a_failed_reduction_is_a_typed_error_naming_rank_lane_and_message() {
        let mut comms = shardline_collectives::local_group(2).unwrap();
        let comm = comms.remove(0);
        let lane = StatsLane::open(&comm, Trace::disabled()).unwrap();
        comm.abort("test");
        let e = lane.reduce_sum(vec![1.0]).unwrap_err();
        assert_eq!((e.rank, e.lane.as_str(), e.op), (0, STATS_LANE, StatsOp::Backward));
        let StatsFailure::Collective(cause) = &e.what else { panic!("{e:?}") };
        assert!(cause.downcast_ref::<CollectiveError>().is_some(), "{cause:?}");
        let through_model = shardline_models::ModelError::from(e);
        match RuntimeError::from(through_model) {
            RuntimeError::Stats(s) => assert_eq!((s.rank, s.op), (0, StatsOp::Backward)),
            other => panic!("flattened: {other:?}"),
        }
    }
}
