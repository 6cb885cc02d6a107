//! Completion handles. A [`Work`] is completed once by the lane's progress thread; the owner
//! blocks on it (`wait`), polls it (`is_done`) or awaits it (`Future`).
//!
//! - WORK-1: once an op is done, [`Work::timing`] gives the instants its lane thread started
//!   and finished it, `start <= end`; the span is the op itself, not the time the owner
//!   waited for it (an op still queued behind others on its lane has not started).

use crate::error::CollectiveError;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

enum State<T> {
    Pending(Option<Waker>),
    Done(Result<T, CollectiveError>),
    Taken,
}

struct Slot<T> {
    state: Mutex<State<T>>,
    cv: Condvar,
    /// Set after the result is stored, so waiters can poll without the lock.
    done: AtomicBool,
    /// When the lane thread began the op (WORK-1).
    started: OnceLock<Instant>,
    /// When the lane thread finished it; set before `done`.
    finished: OnceLock<Instant>,
}

/// How long `wait` polls (yielding the CPU between polls) before blocking: a small op
/// usually completes within this, and a condvar wake-up costs tens of microseconds.
const POLL_BEFORE_BLOCK: Duration = Duration::from_micros(30);

impl<T> Slot<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while holding this lock cannot leave the state half-written (plain moves).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Handle on an op in flight; hands the op's buffers back on success.
#[must_use = "an op's result (and buffers) come back through its Work"]
pub struct Work<T> {
    slot: Arc<Slot<T>>,
    lane: Arc<str>,
    seq: u64,
}

/// The completing side of a [`Work`].
pub(crate) struct Completer<T> {
    slot: Option<Arc<Slot<T>>>,
    lane: Arc<str>,
    seq: u64,
}

/// Creates a pending work and its completer.
pub(crate) fn pair<T>(lane: Arc<str>, seq: u64) -> (Work<T>, Completer<T>) {
    let slot = Arc::new(Slot {
        state: Mutex::new(State::Pending(None)),
        cv: Condvar::new(),
        done: AtomicBool::new(false),
        started: OnceLock::new(),
        finished: OnceLock::new(),
    });
    (
        Work { slot: slot.clone(), lane: lane.clone(), seq },
        Completer { slot: Some(slot), lane, seq },
    )
}

impl<T> Completer<T> {
    /// Records that the lane thread begins the op now (WORK-1). Only the first call counts.
    pub(crate) fn start(&self, at: Instant) {
        if let Some(slot) = &self.slot {
            let _ = slot.started.set(at);
        }
    }

    /// Completes the work; wakes a blocked `wait` and an awaiting task.
    pub(crate) fn complete(mut self, result: Result<T, CollectiveError>) {
        if let Some(slot) = self.slot.take() {
            let now = Instant::now();
            // An op completed without being started (argument error, abort before it ran)
            // took no time.
            let _ = slot.started.set(now);
            let _ = slot.finished.set(now);
            let waker = {
                let mut st = slot.lock();
                let prev = std::mem::replace(&mut *st, State::Done(result));
                slot.done.store(true, Ordering::Release);
                slot.cv.notify_all();
                match prev {
                    State::Pending(w) => w,
                    _ => None,
                }
            };
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if self.slot.is_some() {
            let err = CollectiveError::Aborted {
                lane: self.lane.to_string(),
                seq: self.seq,
                reason: "the lane's progress thread stopped before completing this op".into(),
            };
            let me = Completer { slot: self.slot.take(), lane: self.lane.clone(), seq: self.seq };
            me.complete(Err(err));
        }
    }
}

impl<T> Work<T> {
    /// A work that is already complete.
    pub(crate) fn ready(lane: Arc<str>, seq: u64, result: Result<T, CollectiveError>) -> Self {
        let (w, c) = pair(lane, seq);
        c.complete(result);
        w
    }

    /// Blocks until the op completes. The op's own deadline bounds the wait.
    pub fn wait(self) -> Result<T, CollectiveError> {
        self.poll_briefly();
        let _blocked = self.register_block();
        let mut st = self.slot.lock();
        loop {
            if let State::Done(_) = &*st {
                return take(&mut st);
            }
            st = self.slot.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Like [`Work::wait`] but gives up after `d` with `CollectiveError::Timeout`, whose
    /// `peer` is [`crate::error::NO_PEER`] (a local wait does not know which peer is late; its
    /// text says "no rank named"). The op keeps running; its buffers are dropped when it
    /// completes. To learn which rank is late, give the op that deadline instead
    /// (`CallOptions::timeout`) and [`Work::wait`].
    pub fn wait_timeout(self, d: Duration) -> Result<T, CollectiveError> {
        let end = crate::config::deadline_after(d);
        self.poll_briefly();
        let _blocked = self.register_block();
        let mut st = self.slot.lock();
        loop {
            if let State::Done(_) = &*st {
                return take(&mut st);
            }
            let now = Instant::now();
            if now >= end {
                return Err(CollectiveError::Timeout {
                    lane: self.lane.to_string(),
                    seq: self.seq,
                    peer: crate::error::NO_PEER,
                    timeout_ms: d.as_millis() as u64,
                });
            }
            st = self.slot.cv.wait_timeout(st, end - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Registers the wait in [`crate::blocked`] when the op is still pending after the poll
    /// (BLOCK-1): a watchdog can then name it.
    fn register_block(&self) -> Option<crate::blocked::Blocked> {
        (!self.slot.done.load(Ordering::Acquire))
            .then(|| crate::blocked::on_op(self.lane.clone(), self.seq))
    }

    fn poll_briefly(&self) {
        let start = Instant::now();
        while !self.slot.done.load(Ordering::Acquire) && start.elapsed() < POLL_BEFORE_BLOCK {
            std::thread::yield_now();
        }
    }

    /// Like [`Work::wait`], also returning [`Work::timing`]'s span of the op.
    pub fn wait_timed(self) -> (Result<T, CollectiveError>, Option<(Instant, Instant)>) {
        let slot = self.slot.clone();
        let r = self.wait();
        (r, timing_of(&slot))
    }

    /// Like [`Work::wait_timeout`], also returning [`Work::timing`]'s span of the op (`None`
    /// when it timed out).
    pub fn wait_timeout_timed(
        self,
        d: Duration,
    ) -> (Result<T, CollectiveError>, Option<(Instant, Instant)>) {
        let slot = self.slot.clone();
        let r = self.wait_timeout(d);
        (r, timing_of(&slot))
    }

    /// When the op's lane thread started and finished it, once it is done (WORK-1); `None`
    /// while it is pending.
    pub fn timing(&self) -> Option<(Instant, Instant)> {
        timing_of(&self.slot)
    }

    /// True once the op has completed (successfully or not).
    pub fn is_done(&self) -> bool {
        matches!(&*self.slot.lock(), State::Done(_) | State::Taken)
    }

    /// Sequence number of the op on its lane.
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

fn timing_of<T>(slot: &Slot<T>) -> Option<(Instant, Instant)> {
    if !slot.done.load(Ordering::Acquire) {
        return None;
    }
    let end = *slot.finished.get()?;
    let start = slot.started.get().copied().unwrap_or(end).min(end);
    Some((start, end))
}

fn take<T>(st: &mut State<T>) -> Result<T, CollectiveError> {
    match std::mem::replace(st, State::Taken) {
        State::Done(r) => r,
        // A Work is consumed by wait and polled to completion once; Taken cannot be seen twice.
        _ => unreachable!("work result taken twice"),
    }
}

impl<T> Future for Work<T> {
    type Output = Result<T, CollectiveError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = self.slot.lock();
        match &mut *st {
            State::Done(_) => Poll::Ready(take(&mut st)),
            State::Pending(w) => {
                *w = Some(cx.waker().clone());
                Poll::Pending
            }
            State::Taken => panic!("Work polled after completion"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_timeout_then_complete() {
        let (w, c) = pair::<u32>("l".into(), 1);
        assert!(!w.is_done());
        assert!(matches!(
            w.wait_timeout(Duration::from_millis(1)),
            Err(CollectiveError::Timeout { .. })
        ));
        let (w, c2) = pair::<u32>("l".into(), 2);
        let t = std::thread::spawn(move || c2.complete(Ok(7)));
        assert_eq!(w.wait_timeout(Duration::from_secs(10)), Ok(7));
        t.join().unwrap();
        drop(c);
        let (w, c) = pair::<u32>("l".into(), 3);
        drop(c);
        assert!(matches!(
            w.wait_timeout(Duration::from_secs(10)),
            Err(CollectiveError::Aborted { .. })
        ));
    }

    /// A local wait that expires names no rank, and its text never shows `usize::MAX`.
    #[test]
    fn expired_local_wait_names_no_rank() {
        let (w, _c) = pair::<u32>("l".into(), 4);
        let e = w.wait_timeout(Duration::from_millis(1)).expect_err("nothing completes it");
        assert!(matches!(e, CollectiveError::Timeout { peer: crate::error::NO_PEER, .. }));
        let text = e.to_string();
        assert!(text.contains("no rank named: the local wait expired"), "{text}");
        assert!(!text.contains(&usize::MAX.to_string()), "{text}");
    }

    /// A barrier given the deadline itself (`CallOptions::timeout`) and waited for with
    /// `wait` reports the rank that did not arrive, by number and in its text.
    #[test]
    fn barrier_with_its_own_deadline_names_the_missing_rank() {
        let mut o = crate::CommOptions::new();
        o.timeout(Duration::from_secs(30));
        let comms =
            crate::local_group_with_topology(crate::Topology::single_node(3), o).expect("group");
        let errs = crate::testing::run_ranks(comms, Duration::from_secs(30), |comm| {
            let lane = comm.lane("bar").expect("lane");
            if comm.rank() == 2 {
                // Alive but silent past the others' deadline.
                std::thread::sleep(Duration::from_millis(1200));
                return None;
            }
            let mut call = crate::CallOptions::new();
            call.timeout(Duration::from_millis(300));
            Some(lane.barrier_opts(&call).wait().expect_err("rank 2 never arrives"))
        });
        for (r, e) in errs.iter().enumerate().take(2) {
            let Some(e) = e else { panic!("rank {r} returned no error") };
            assert!(!e.to_string().contains(&usize::MAX.to_string()), "rank {r}: {e}");
            if let CollectiveError::Timeout { peer, .. } = e {
                assert_ne!(*peer, crate::error::NO_PEER, "rank {r}: {e}");
                assert!(e.to_string().contains(&format!("rank {peer} did not arrive")), "{e}");
            }
        }
        // Whoever waits on whom, some rank's error names the silent rank 2.
        let named =
            errs.iter().flatten().any(|e| matches!(e, CollectiveError::Timeout { peer: 2, .. }));
        assert!(named, "no error names rank 2: {errs:?}");
    }

    /// WORK-1: the span runs from `start` to completion, whoever waits and however late.
    #[test]
    fn timing_spans_the_op_not_the_wait() {
        let (w, c) = pair::<u32>("l".into(), 1);
        assert_eq!(w.timing(), None);
        let issued = Instant::now();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            let s = Instant::now();
            c.start(s);
            std::thread::sleep(Duration::from_millis(5));
            c.complete(Ok(3));
            s
        });
        let s = t.join().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let before_wait = Instant::now();
        let (st, en) = w.timing().expect("done");
        assert_eq!(st, s);
        assert!(st > issued && en >= st + Duration::from_millis(5) && en < before_wait);
        let (r, tm) = w.wait_timeout_timed(Duration::from_secs(10));
        assert_eq!((r, tm), (Ok(3), Some((st, en))));
        let w = Work::ready("l".into(), 2, Ok(1u32));
        let (a, b) = w.timing().expect("a ready work is done");
        assert_eq!(a, b);
    }
}
