//! What this process's threads are blocked on right now, and since when: collectives waiting
//! for their peers, rendezvous steps waiting for the store or for other ranks.
//!
//! The registry is read by a launched worker's watchdog: once SIGTERM or SIGINT asked the
//! process to stop, a wait that goes on past its grace ends the process, naming what it
//! waited for, instead of leaving it hanging on a peer that will never answer.
//!
//! Invariants (cited by the tests):
//! - BLOCK-1: a wait is registered only while it may block (an op that completes within the
//!   poll before blocking registers nothing; an op run inline on the issuing thread registers
//!   while it runs) and is removed when it ends, however it ends (the guard's drop).
//! - BLOCK-2: a wait is overdue when it has lasted its grace past both its own start and the
//!   stop request: a wait that began long before the stop still gets its full grace, and a
//!   wait that begins after the stop gets it too.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The grace of a wait registered without [`with_grace`]: long enough for a step's
/// collectives to complete while every peer is alive and finishing the same step.
pub const DEFAULT_GRACE: Duration = Duration::from_millis(500);

/// What a wait is for; an op's text is made only when a report asks for it (an op's wait is
/// registered on every blocking wait and every inline op).
enum What {
    Text(String),
    Op { lane: Arc<str>, seq: u64 },
}

impl What {
    fn text(&self) -> String {
        match self {
            What::Text(t) => t.clone(),
            What::Op { lane, seq } => format!("collective #{seq} on lane '{lane}'"),
        }
    }
}

struct Entry {
    id: u64,
    what: What,
    since: Instant,
    grace: Duration,
}

static ENTRIES: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static GRACE: Cell<Duration> = const { Cell::new(DEFAULT_GRACE) };
}

fn entries() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    // Entries are pushed and removed whole: a poisoned lock still holds a consistent list.
    ENTRIES.lock().unwrap_or_else(|e| e.into_inner())
}

/// A registered wait; dropping it ends the registration (BLOCK-1).
#[must_use = "the wait is registered only while the guard lives"]
pub struct Blocked {
    id: u64,
}

impl Drop for Blocked {
    fn drop(&mut self) {
        entries().retain(|e| e.id != self.id);
    }
}

/// Registers that this thread now waits for `what`, with this thread's current grace.
pub fn on(what: impl Into<String>) -> Blocked {
    register(What::Text(what.into()))
}

/// Registers that this thread now waits for op `seq` of `lane` to complete.
pub fn on_op(lane: Arc<str>, seq: u64) -> Blocked {
    register(What::Op { lane, seq })
}

fn register(what: What) -> Blocked {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let grace = GRACE.with(Cell::get);
    entries().push(Entry { id, what, since: Instant::now(), grace });
    Blocked { id }
}

/// Restores the previous grace of this thread when dropped.
#[must_use = "the grace applies only while the guard lives"]
pub struct GraceGuard {
    previous: Duration,
}

impl Drop for GraceGuard {
    fn drop(&mut self) {
        GRACE.with(|g| g.set(self.previous));
    }
}

/// Waits this thread registers while the guard lives get `grace` (zero: a stop ends them at
/// once, as in rendezvous; longer: a checkpoint's barrier after a stop).
pub fn with_grace(grace: Duration) -> GraceGuard {
    GraceGuard { previous: GRACE.with(|g| g.replace(grace)) }
}

/// A wait that is overdue at `now` for a stop requested at `stop` (BLOCK-2): what it waits
/// for and how long it has waited. A described wait (a rendezvous step, an engine's named
/// op) is preferred to a bare op of a lane, which says less.
pub fn overdue(stop: Instant, now: Instant) -> Option<(String, Duration)> {
    let list = entries();
    let late: Vec<&Entry> =
        list.iter().filter(|e| is_overdue(e.since, e.grace, stop, now)).collect();
    late.iter()
        .find(|e| matches!(e.what, What::Text(_)))
        .or(late.first())
        .map(|e| (e.what.text(), now.saturating_duration_since(e.since)))
}

/// BLOCK-2: a wait that began at `since` with `grace` is overdue at `now` for a stop asked at
/// `stop`.
fn is_overdue(since: Instant, grace: Duration, stop: Instant, now: Instant) -> bool {
    now >= since.max(stop) + grace
}

/// Every wait registered now, oldest first: what and since when.
pub fn current() -> Vec<(String, Instant)> {
    entries().iter().map(|e| (e.what.text(), e.since)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mine(what: &str) -> Option<(Instant, Duration)> {
        entries().iter().find(|e| e.what.text() == what).map(|e| (e.since, e.grace))
    }

    #[test]
    fn a_wait_is_registered_while_its_guard_lives() {
        // BLOCK-1 (entries of concurrent tests may be present: look for ours only).
        let g = on("blocked-test: peer 3");
        assert!(mine("blocked-test: peer 3").is_some());
        assert!(current().iter().any(|(w, _)| w == "blocked-test: peer 3"));
        drop(g);
        assert!(mine("blocked-test: peer 3").is_none());
    }

    #[test]
    fn overdue_counts_the_grace_from_the_later_of_start_and_stop() {
        // BLOCK-2.
        let ms = Duration::from_millis;
        let t = Instant::now() + ms(10_000);
        // A stop long before the wait began: the wait still gets its 200 ms.
        assert!(!is_overdue(t, ms(200), t - ms(5000), t + ms(199)));
        assert!(is_overdue(t, ms(200), t - ms(5000), t + ms(200)));
        // A stop 1 s into the wait: 200 ms more from the stop.
        assert!(!is_overdue(t, ms(200), t + ms(1000), t + ms(1199)));
        assert!(is_overdue(t, ms(200), t + ms(1000), t + ms(1200)));
        // Zero grace: overdue as soon as the stop comes.
        assert!(is_overdue(t, Duration::ZERO, t + ms(3), t + ms(3)));
    }

    #[test]
    fn a_grace_guard_applies_to_waits_registered_under_it_and_then_restores() {
        // Registered first: a bare op, which the report passes over for a described wait.
        let _op = {
            let _grace = with_grace(Duration::ZERO);
            on_op(Arc::from("blocked-test-lane"), 7)
        };
        let _a = {
            let _grace = with_grace(Duration::ZERO);
            on("blocked-test: rendezvous")
        };
        let _b = on("blocked-test: default grace");
        assert_eq!(mine("blocked-test: rendezvous").unwrap().1, Duration::ZERO);
        assert_eq!(mine("blocked-test: default grace").unwrap().1, DEFAULT_GRACE);
        // A zero-grace wait is reported once a stop has come, a described one before a
        // bare op registered earlier.
        let now = Instant::now();
        let (w, _) = overdue(now, now).unwrap();
        assert!(w.starts_with("blocked-test: "), "{w}");
    }

    #[test]
    fn an_op_waiting_for_a_peer_is_registered_until_it_completes() {
        // BLOCK-1, for an inline op (blocking, small, idle lane) and a queued one.
        for blocking in [true, false] {
            let name: &str = if blocking { "blocked-inline" } else { "blocked-queued" };
            let mut comms = crate::local_group(2).unwrap();
            let late = comms.pop().unwrap();
            let early = comms.pop().unwrap();
            let waiting = std::thread::spawn(move || {
                let lane = early.lane(name).unwrap();
                let mut o = crate::CallOptions::new();
                o.blocking(blocking);
                lane.all_reduce_opts(vec![1.0f32; 4], crate::ReduceOp::Sum, &o).wait().unwrap()
            });
            let seen = |n: &str| current().iter().any(|(w, _)| w.contains(&format!("'{n}'")));
            let t0 = Instant::now();
            while !seen(name) {
                assert!(t0.elapsed() < Duration::from_secs(10), "{name}: never registered");
                std::thread::sleep(Duration::from_millis(5));
            }
            let lane = late.lane(name).unwrap();
            assert_eq!(
                lane.all_reduce(vec![2.0f32; 4], crate::ReduceOp::Sum).wait().unwrap(),
                vec![3.0; 4]
            );
            assert_eq!(waiting.join().unwrap(), vec![3.0; 4]);
            assert!(!seen(name), "{name}: still registered after completing");
        }
    }
}
