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
//!
//! `shardline launch`'s agent uses the same handler (without the second-signal exit): it
//! forwards the signal to its workers and kills them on a second one.

use crate::error::{Result, RuntimeError};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};

/// The signal last received (0: none yet).
static STOP: AtomicI32 = AtomicI32::new(0);
/// Signals received so far.
static COUNT: AtomicU32 = AtomicU32::new(0);
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

/// The signal last received since [`install`], if any.
pub fn requested() -> Option<i32> {
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
