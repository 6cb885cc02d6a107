//! Stopping a run on SIGINT or SIGTERM without losing it (Ctrl-C, a scheduler's preemption).
//!
//! The first signal asks the run to stop once the step in progress has finished on every
//! rank; with `--checkpoint-dir` a checkpoint of that step is written before the process
//! exits with 128 + the signal's number. A second signal ends the process at once.
//!
//! Invariants:
//! - INT-1: every rank stops after the same step: a rank's wish to stop travels with the
//!   step's loss all-reduce, in one process as across processes, so every rank learns it from
//!   the same step and the checkpoint written is one consistent step.
//! - INT-2: the handler only stores to atomics or calls `_exit` (both async-signal-safe).
//! - INT-3: a planned stop (SIGUSR1, which `shardline launch`'s agent sends its workers to
//!   grow an elastic job) stops every rank after the same step as INT-1 and checkpoints it,
//!   but cuts no wait short: [`watch_waits`] acts on SIGINT and SIGTERM only, which may come
//!   because a peer is gone; an agent that asks for a planned stop knows its peers are not.
//!
//! `shardline launch`'s agent uses the same handler (without the second-signal exit): it
//! forwards the signal to its workers and kills them on a second one.
//!
//! A launched worker also runs [`watch_waits`]: a stop must not wait on a peer that is gone
//! (torchrun and Slurm signal every worker when one fails, then kill them 30 s later).
//! LAUNCH-13 in `launch` says how long each kind of wait may go on.

use crate::error::{Result, RuntimeError};
use shardline_collectives::blocked;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The signal last received (0: none yet).
static STOP: AtomicI32 = AtomicI32::new(0);
/// Signals received so far.
static COUNT: AtomicU32 = AtomicU32::new(0);
/// A planned stop was asked (SIGUSR1, INT-3).
static PLANNED: AtomicBool = AtomicBool::new(false);
/// Whether a second signal ends the process at once (not for a launched worker: Ctrl-C
/// reaches it and its agent, which forwards it again, and the agent kills what overstays).
static HARD_SECOND: AtomicBool = AtomicBool::new(true);

extern "C" fn on_stop(sig: i32) {
    STOP.store(sig, Ordering::SeqCst);
    if COUNT.fetch_add(1, Ordering::SeqCst) > 0 && HARD_SECOND.load(Ordering::SeqCst) {
        // The second signal means "now". SAFETY: `_exit` takes no locks and runs no
        // destructors (INT-2).
        unsafe { libc::_exit(128 + sig) };
    }
}

extern "C" fn on_planned(_sig: i32) {
    PLANNED.store(true, Ordering::SeqCst);
}

/// Installs the SIGUSR1 handler of a worker started by `shardline launch`: its agent's
/// planned stop (INT-3).
pub fn install_planned_stop() -> Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let act = SigAction::new(SigHandler::Handler(on_planned), SaFlags::SA_RESTART, SigSet::empty());
    // SAFETY: the handler keeps to INT-2.
    unsafe { sigaction(Signal::SIGUSR1, &act) }
        .map(|_| ())
        .map_err(|e| RuntimeError::config(format!("installing a SIGUSR1 handler: {e}")))
}

/// Forgets a planned stop once it was carried out without ending the process (live
/// recovery's growth moves the worker to its next epoch, LIVE-9).
pub fn clear_planned() {
    PLANNED.store(false, Ordering::SeqCst);
}

/// Installs the SIGINT and SIGTERM handlers for this process; `hard_second`: a second signal
/// ends the process at once.
pub fn install(hard_second: bool) -> Result<()> {
    HARD_SECOND.store(hard_second, Ordering::SeqCst);
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let act = SigAction::new(SigHandler::Handler(on_stop), SaFlags::SA_RESTART, SigSet::empty());
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler keeps to INT-2.
        unsafe { sigaction(sig, &act) }
            .map_err(|e| RuntimeError::config(format!("installing a {sig} handler: {e}")))?;
    }
    Ok(())
}

/// The signal last received since [`install`], if any; SIGUSR1 for a planned stop alone
/// (INT-3).
pub fn requested() -> Option<i32> {
    match STOP.load(Ordering::SeqCst) {
        0 if PLANNED.load(Ordering::SeqCst) => Some(libc::SIGUSR1),
        0 => None,
        s => Some(s),
    }
}

/// SIGINT or SIGTERM, if one was received: what the watchdog acts on (INT-3).
fn signalled() -> Option<i32> {
    match STOP.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// How many signals arrived since [`install`] (an agent kills its workers on the second).
pub fn count() -> u32 {
    COUNT.load(Ordering::SeqCst)
}

/// A signal's name for messages (`SIGINT`), or its number.
pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map_or_else(|_| format!("signal {sig}"), |s| s.to_string())
}

/// How often the watchdog of [`watch_waits`] looks.
const WATCH_TICK: Duration = Duration::from_millis(20);

/// Starts the watchdog of a worker process: once a signal asked it to stop, a wait in
/// [`shardline_collectives::blocked`] that outlasts its grace (BLOCK-2) ends the process with
/// 128 + the signal, after one line on stderr, `{label}: stopped by SIGTERM while waiting
/// for <what> (<seconds> s)`.
pub fn watch_waits(label: String) -> Result<()> {
    std::thread::Builder::new()
        .name("stop-watchdog".into())
        .spawn(move || {
            let mut stop_at = None;
            loop {
                std::thread::sleep(WATCH_TICK);
                let Some(sig) = signalled() else { continue };
                let since = *stop_at.get_or_insert_with(Instant::now);
                if let Some((what, waited)) = blocked::overdue(since, Instant::now()) {
                    let line = format!(
                        "{label}: stopped by {} while waiting for {what} ({:.1} s)\n",
                        signal_name(sig),
                        waited.as_secs_f64()
                    );
                    use std::io::Write as _;
                    let _ = std::io::stderr().write_all(line.as_bytes());
                    // Other threads are blocked on peers that will not answer: end here,
                    // without unwinding them. SAFETY: `_exit` takes no locks.
                    unsafe { libc::_exit(128 + sig) };
                }
            }
        })
        .map(|_| ())
        .map_err(|e| RuntimeError::config(format!("starting the stop watchdog: {e}")))
}
