//! The communication clock of a step: how long the rank was blocked waiting, and the spans
//! in which its collectives were in flight.
//!
//! [`CommClock`] and [`union_len`] are pure: they are given spans and blocked times and read
//! no clock. [`CommClock::wait`] is the one place that blocks on a collective and reads the
//! time, for the engine; a simulated device would add its simulated spans instead.
//!
//! Invariant:
//! - ENG-4: a step's communication time is the length of the union of the intervals in
//!   which any of its collectives was in flight on this rank (each op's own span on its lane
//!   thread, WORK-1; SyncBN statistics reductions by their blocking call, see
//!   [`super::stats`]), clipped to the step's start (a gather prefetched by the previous step,
//!   ENG-6, counts from this step's start). Exposed communication is the time the step was
//!   blocked waiting (a statistics reduction's blocking call, all of it), so it never
//!   exceeds the communication time by more than the wake-up latency of a wait.

use std::time::{Duration, Instant};

use shardline_collectives::Work;

use crate::error::Result;
use crate::telemetry::{Row, Trace};

/// A step's communication bookkeeping: blocked time and the spans of its collectives.
#[derive(Default)]
pub(crate) struct CommClock {
    /// Time the step was blocked waiting for communication (exposed communication).
    pub(crate) exposed: Duration,
    /// Spans in which one of the step's collectives was in flight (any lane).
    pub(crate) spans: Vec<(Instant, Instant)>,
}

impl CommClock {
    /// The step's communication time (ENG-4): the union of the spans, each clipped to begin
    /// no earlier than `start`. Reorders the spans.
    pub(crate) fn comm_time(&mut self, start: Instant) -> Duration {
        for sp in &mut self.spans {
            sp.0 = sp.0.max(start);
            sp.1 = sp.1.max(sp.0);
        }
        union_len(&mut self.spans)
    }

    /// Blocks on `w`: the blocked time is exposed communication (a `wait` span on the compute
    /// row), the op's own span goes on `row` and into the step's communication time.
    pub(crate) fn wait<T: OpBytes>(
        &mut self,
        trace: &Trace,
        rank: usize,
        w: Work<T>,
        row: Row,
        what: &str,
    ) -> Result<T> {
        let t0 = Instant::now();
        // Named for a stop's watchdog while it blocks (BLOCK-1).
        let blocked = (!w.is_done())
            .then(|| shardline_collectives::blocked::on(format!("{what} (rank {rank})")));
        let (r, span) = w.wait_timed();
        drop(blocked);
        let t1 = Instant::now();
        self.exposed += t1 - t0;
        if t1 - t0 >= Duration::from_micros(1) {
            trace.record(rank, Row::Compute, format!("wait {what}"), t0, t1);
        }
        let r = r?;
        if let Some((a, b)) = span {
            trace.record_op(rank, row, what, (a, b), r.op_bytes());
            self.spans.push((a, b));
        }
        Ok(r)
    }
}

/// Length of the union of `spans` (ENG-4). Sorts them by start.
pub(crate) fn union_len(spans: &mut [(Instant, Instant)]) -> Duration {
    spans.sort_by_key(|s| s.0);
    let mut total = Duration::ZERO;
    let mut cur: Option<(Instant, Instant)> = None;
    for &(a, b) in spans.iter() {
        match &mut cur {
            Some((_, e)) if a <= *e => *e = (*e).max(b),
            _ => {
                if let Some((s, e)) = cur {
                    total += e - s;
                }
                cur = Some((a, b));
            }
        }
    }
    if let Some((s, e)) = cur {
        total += e - s;
    }
    total
}

/// The size of a finished collective's whole buffer, for the trace (what the op moved, in the
/// units the benchmarks count wire bytes in).
pub(crate) trait OpBytes {
    /// Bytes of the op's whole buffer.
    fn op_bytes(&self) -> u64;
}

impl OpBytes for Vec<f32> {
    fn op_bytes(&self) -> u64 {
        self.len() as u64 * 4
    }
}

/// An out-of-place reduce-scatter's `(full input, own shard)`: the op is the size of the input.
impl OpBytes for (Vec<f32>, Vec<f32>) {
    fn op_bytes(&self) -> u64 {
        self.0.op_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ENG-4: communication time is the union of the spans, against a naive per-microsecond
    /// count.
    #[test]
    fn union_len_matches_a_naive_count() {
        let o = Instant::now();
        let us = |a: u64| o + Duration::from_micros(a);
        let cases: Vec<Vec<(u64, u64)>> = vec![
            vec![],
            vec![(5, 5)],
            vec![(0, 10), (20, 30)],
            vec![(0, 10), (5, 15), (14, 16), (40, 41)],
            vec![(30, 50), (0, 100), (10, 20)],
            vec![(7, 9), (1, 3), (3, 7), (60, 61), (60, 62)],
        ];
        for c in cases {
            let mut covered = [false; 128];
            for &(a, b) in &c {
                for x in a..b {
                    covered[x as usize] = true;
                }
            }
            let naive = covered.iter().filter(|x| **x).count() as u64;
            let mut spans: Vec<_> = c.iter().map(|&(a, b)| (us(a), us(b))).collect();
            assert_eq!(union_len(&mut spans), Duration::from_micros(naive), "{c:?}");
        }
    }

    /// ENG-4: a span that began before the step (a gather the previous step prefetched)
    /// counts from the step's start; one that ended before it counts nothing.
    #[test]
    fn spans_before_the_step_count_from_its_start() {
        let o = Instant::now();
        let us = |a: u64| o + Duration::from_micros(a);
        let spans = vec![(us(0), us(30)), (us(2), us(5)), (us(25), us(40)), (us(60), us(70))];
        let mut clock = CommClock { spans, ..CommClock::default() };
        assert_eq!(clock.comm_time(us(20)), Duration::from_micros(20 + 10));
        assert_eq!(clock.exposed, Duration::ZERO, "the clock only adds what it is given");
    }
}
