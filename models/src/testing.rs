//! Test helpers for other crates (feature `test-utils`): an in-process [`StatsReducer`] over
//! threads, with a deadline on every wait, and a [`CountingReducer`] that counts the messages
//! sent through another reducer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::batchnorm::StatsReducer;
use crate::error::{StatsError, StatsFailure, StatsOp};

/// The lane name a [`ThreadReducer`]'s errors give.
pub const THREAD_LANE: &str = "threads";

struct State {
    slots: Vec<Option<Vec<f32>>>,
    arrived: usize,
    generation: u64,
    result: Arc<Vec<f32>>,
}

struct Group {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank's handle on a group of in-process reducers; results are folded in rank order,
/// so they are deterministic.
#[derive(Clone)]
pub struct ThreadReducer {
    group: Arc<Group>,
    rank: usize,
}

/// Handles for `world` ranks (one per thread); every wait fails after `timeout`.
pub fn thread_reducers(world: usize, timeout: Duration) -> Vec<ThreadReducer> {
    let group = Arc::new(Group {
        world,
        timeout,
        state: Mutex::new(State {
            slots: vec![None; world],
            arrived: 0,
            generation: 0,
            result: Arc::new(Vec::new()),
        }),
        cv: Condvar::new(),
    });
    (0..world).map(|rank| ThreadReducer { group: group.clone(), rank }).collect()
}

impl ThreadReducer {
    fn error(&self, op: StatsOp, what: StatsFailure) -> StatsError {
        StatsError::new(self.rank, THREAD_LANE, op, what)
    }

    fn round(
        &self,
        op: StatsOp,
        buf: Vec<f32>,
        fold: &dyn Fn(&mut Vec<f32>, &[f32]),
    ) -> Result<Vec<f32>, StatsError> {
        let g = &self.group;
        let deadline = Instant::now() + g.timeout;
        let mut st = g.state.lock().map_err(|_| self.error(op, StatsFailure::Poisoned))?;
        st.slots[self.rank] = Some(buf);
        st.arrived += 1;
        let gen = st.generation;
        if st.arrived == g.world {
            let mut slots =
                std::mem::replace(&mut st.slots, vec![None; g.world]).into_iter().flatten();
            let mut acc = slots.next().unwrap_or_default();
            for s in slots {
                if s.len() != acc.len() {
                    let what = StatsFailure::Length { ours: acc.len(), theirs: s.len() };
                    return Err(self.error(op, what));
                }
                fold(&mut acc, &s);
            }
            st.result = Arc::new(acc);
            st.arrived = 0;
            st.generation += 1;
            g.cv.notify_all();
        } else {
            while st.generation == gen {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(self.error(op, StatsFailure::Timeout(g.timeout)));
                }
                st =
                    g.cv.wait_timeout(st, left)
                        .map_err(|_| self.error(op, StatsFailure::Poisoned))?
                        .0;
            }
        }
        Ok(st.result.as_ref().clone())
    }
}

impl StatsReducer for ThreadReducer {
    fn world(&self) -> usize {
        self.group.world
    }
    fn reduce_records(
        &self,
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
    ) -> Result<Vec<f32>, StatsError> {
        if record_len == 0 || !buf.len().is_multiple_of(record_len) {
            let what = StatsFailure::Records { len: buf.len(), record_len };
            return Err(self.error(StatsOp::Forward, what));
        }
        // One record at a time, as a collective that splits the buffer between peers would.
        self.round(StatsOp::Forward, buf, &|acc, o| {
            for (a, b) in acc.chunks_exact_mut(record_len).zip(o.chunks_exact(record_len)) {
                combine(a, b);
            }
        })
    }
    fn reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, StatsError> {
        self.round(StatsOp::Backward, buf, &|acc, o| {
            acc.iter_mut().zip(o).for_each(|(a, b)| *a += b)
        })
    }
}

/// Wraps a reducer and counts the messages sent through it (one per reduction), for tests
/// that check how many statistics messages a forward or backward sends (BN-2, MODEL-2). The
/// runtime counts its own, in the one reducer it hands the model.
pub struct CountingReducer<'a> {
    inner: &'a dyn StatsReducer,
    messages: AtomicUsize,
}

impl<'a> CountingReducer<'a> {
    /// Counts from zero.
    pub fn new(inner: &'a dyn StatsReducer) -> Self {
        CountingReducer { inner, messages: AtomicUsize::new(0) }
    }
    /// Messages sent so far.
    pub fn messages(&self) -> usize {
        self.messages.load(Ordering::Relaxed)
    }
}

impl StatsReducer for CountingReducer<'_> {
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn reduce_records(
        &self,
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
    ) -> Result<Vec<f32>, StatsError> {
        self.messages.fetch_add(1, Ordering::Relaxed);
        self.inner.reduce_records(buf, record_len, combine)
    }
    fn reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, StatsError> {
        self.messages.fetch_add(1, Ordering::Relaxed);
        self.inner.reduce_sum(buf)
    }
}

/// Runs `f(rank)` on `world` threads and returns the results in rank order. Use with
/// reducers that have a timeout, so that a rank that never arrives fails the others
/// instead of hanging the test.
pub fn run_ranks<T: Send>(world: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                s.spawn({
                    let f = &f;
                    move || f(r)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}
