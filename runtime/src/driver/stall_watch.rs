//! A rank that stops progressing, reported live, long before the collectives' timeout ends
//! the job: a watch thread sees the step in flight run past its bound and says which rank
//! the others wait for (in one process, from every rank's recent collectives, DOC-2) or,
//! launched, what this process's rank waits in.
//!
//! Invariant:
//! - STALL-1: a step is reported at most once, when it has run longer than the larger of
//!   the floor (a sixth of the collective timeout) and `factor` times the median of the
//!   steps before it; a step that ends first is never reported.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use shardline_collectives::Communicator;

use crate::doctor::Diagnosis;

/// Multiple of the median step past which a step counts as stalled.
const FACTOR: f64 = 20.0;

/// The step in flight and the steps before it.
#[derive(Default)]
struct State {
    /// The step in flight (1-based) and when it began.
    current: Option<(u64, Instant)>,
    reported: bool,
    durations: Vec<f64>,
}

impl State {
    /// STALL-1: the bound for the step in flight.
    fn bound(&self, floor: Duration) -> Duration {
        let mut d = self.durations.clone();
        d.sort_by(f64::total_cmp);
        let median = d.get(d.len() / 2).copied().unwrap_or(0.0);
        floor.max(Duration::from_secs_f64(median * FACTOR))
    }
}

/// What a report is built from and where it goes.
type Report = Box<dyn Fn(u64, Duration) -> String + Send>;

/// The watch: started with the loop, stopped when dropped.
pub(crate) struct StallWatch {
    state: Arc<(Mutex<State>, Condvar)>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StallWatch {
    /// Watches the steps of a job whose collectives time out after `timeout`, describing a
    /// stall from `comms` (every rank's in one process; this rank's, launched) on stderr
    /// when `speak`, and always in the log.
    pub(crate) fn start(timeout: Duration, comms: Vec<Communicator>, speak: bool) -> Self {
        let report: Report = Box::new(move |step, ran| describe(&comms, step, ran));
        Self::with_report(timeout / 6, report, speak)
    }

    fn with_report(floor: Duration, report: Report, speak: bool) -> Self {
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (st, halt) = (Arc::clone(&state), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("stall-watch".into())
            .spawn(move || {
                let (m, cv) = &*st;
                let mut s = lock(m);
                while !halt.load(Ordering::Acquire) {
                    let due = match s.current {
                        Some((step, t0)) if !s.reported => {
                            let ran = t0.elapsed();
                            if ran >= s.bound(floor) {
                                s.reported = true;
                                drop(s);
                                let msg = report(step, ran);
                                tracing::warn!(step, "{msg}");
                                metrics::counter!("shardline_stall_reports_total").increment(1);
                                if speak {
                                    eprintln!("warning: {msg}");
                                }
                                s = lock(m);
                                continue;
                            }
                            s.bound(floor) - ran
                        }
                        _ => Duration::from_secs(3600),
                    };
                    s = cv.wait_timeout(s, due).unwrap_or_else(|e| e.into_inner()).0;
                }
            })
            .expect("spawn the stall watch");
        StallWatch { state, stop, thread: Some(thread) }
    }

    /// Step `step` begins.
    pub(crate) fn begin(&self, step: u64) {
        let (m, cv) = &*self.state;
        let mut s = lock(m);
        s.current = Some((step, Instant::now()));
        s.reported = false;
        cv.notify_all();
    }

    /// The step in flight ended.
    pub(crate) fn end(&self) {
        let (m, cv) = &*self.state;
        let mut s = lock(m);
        if let Some((_, t0)) = s.current.take() {
            s.durations.push(t0.elapsed().as_secs_f64());
        }
        cv.notify_all();
    }
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.state.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Which rank the others wait for (DOC-2, every rank's ring), or what this rank waits in.
fn describe(comms: &[Communicator], step: u64, ran: Duration) -> String {
    let head = format!("step {step} has run {:.1} s, past its bound", ran.as_secs_f64());
    if comms.is_empty() {
        return format!("{head} (this engine's collectives keep no recent-op record)");
    }
    if comms.len() > 1 {
        let d = Diagnosis::capture(comms, usize::MAX, "");
        let behind: Vec<String> = d
            .behind()
            .into_iter()
            .map(|(r, lane, seq, op)| {
                format!("rank {r} has not entered {op} #{seq} on lane {lane}, which others have")
            })
            .collect();
        if behind.is_empty() {
            return format!("{head}: no rank is behind in its collectives (a long computation, or a wait inside one collective)");
        }
        return format!("{head}: {}", behind.join("; "));
    }
    let waits: Vec<String> = comms
        .iter()
        .flat_map(|c| {
            c.recent_ops().into_iter().filter(|o| o.end.is_none()).map(move |o| {
                format!(
                    "rank {} has waited {:.1} s in {} #{} on lane {}",
                    c.rank(),
                    o.start.elapsed().as_secs_f64(),
                    o.op,
                    o.seq,
                    o.lane
                )
            })
        })
        .collect();
    if waits.is_empty() {
        format!("{head}: this process's rank is in no collective (it computes, or it is the one the others wait for)")
    } else {
        format!("{head}: {}", waits.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// STALL-1: a step past the floor is reported once; one that ends first is not; the
    /// bound follows the median of the steps before.
    #[test]
    fn a_step_past_its_bound_is_reported_once_stall_1() {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let report: Report = Box::new(move |step, _| {
            let _ = tx.lock().unwrap().send(step);
            format!("step {step}")
        });
        let w = StallWatch::with_report(Duration::from_millis(50), report, false);
        w.begin(1);
        std::thread::sleep(Duration::from_millis(10));
        w.end();
        assert!(rx.recv_timeout(Duration::from_millis(120)).is_err(), "ended before its bound");
        w.begin(2);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(2));
        assert!(rx.recv_timeout(Duration::from_millis(150)).is_err(), "reported once");
        w.end();
        // With a step of about 200 ms among those before, 20x the median is far past the floor.
        w.begin(3);
        assert!(rx.recv_timeout(Duration::from_millis(60)).is_err(), "past the floor only");
        w.end();
        drop(w);
    }

    #[test]
    fn the_bound_is_the_larger_of_the_floor_and_twenty_medians_stall_1() {
        let floor = Duration::from_secs(1);
        let s = State { durations: vec![0.01, 0.02, 0.03], ..State::default() };
        assert_eq!(s.bound(floor), floor);
        let s = State { durations: vec![0.2, 0.1, 0.3], ..State::default() };
        assert!((s.bound(floor).as_secs_f64() - 4.0).abs() < 1e-9);
    }
}
