//! A stalled worker found before the collectives' timeout, under live recovery: a worker
//! that waits in a collective says so in the store; one whose peers all wait while it waits
//! in nothing is the one they wait for, and is reported to its agent, which stops it and
//! replaces it as a failed worker (LIVE-10, LIVE-4). A stall then costs half the timeout and
//! a replacement, where waiting for the timeout costs the whole timeout and a restart or a
//! meeting that waits for the stalled worker to wake.
//!
//! Invariant:
//! - LIVE-11: in an epoch, once a collective of this rank has ended (so every rank was built
//!   and met), a rank that has waited `bound` (half the collective timeout) in a collective
//!   publishes a wait record for the epoch. One that has waited `bound + GRACE` reports every
//!   other rank with no record as stalled, once per epoch ([`suspects`]). A rank that waits
//!   in a collective is never reported; nor is one that waited long once before in the
//!   epoch (its record stands), which leaves it to the timeout (LIVE-10).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use shardline_collectives::{Communicator, Store};

/// How long after its own record a waiting rank reads its peers': they wait in the same
/// collectives, entered within a step's compute of each other, and publish as it did.
pub const GRACE: Duration = Duration::from_millis(250);

/// How often the scout looks at this rank's collectives.
const TICK: Duration = Duration::from_millis(50);

/// The store key of rank `rank`'s wait record in epoch `epoch` of job `job` (LIVE-11).
pub fn wait_key(job: &str, epoch: u64, rank: usize) -> String {
    format!("launch/{job}/live/wait/{epoch}/{rank}")
}

/// LIVE-11: the ranks a rank that has waited `waited` reports as stalled, given which ranks
/// have a wait record (`recorded`, this rank's own included): none before `bound + GRACE`,
/// then every other rank without one.
pub fn suspects(me: usize, waited: Duration, bound: Duration, recorded: &[bool]) -> Vec<usize> {
    if waited < bound + GRACE {
        return Vec::new();
    }
    (0..recorded.len()).filter(|&r| r != me && !recorded[r]).collect()
}

/// Where a report about rank `rank` goes: its node and its worker index there.
pub type Locate = Box<dyn Fn(usize) -> (usize, usize) + Send>;

/// One epoch's scout: a thread watching this rank's collectives, stopped when dropped.
pub struct Scout {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What a scout needs to know of its rank and epoch.
pub struct ScoutJob {
    /// The launch job (the generation's name, as the agents key it).
    pub job: String,
    /// The communicator epoch (LIVE-4).
    pub epoch: u64,
    /// This rank and the world of the epoch.
    pub rank: usize,
    /// Ranks in the epoch.
    pub world: usize,
    /// Half the collective timeout.
    pub bound: Duration,
    /// A rank's node and worker index.
    pub locate: Locate,
}

impl Scout {
    /// Watches `comm` for job `j`, publishing and reading records in `store`.
    pub fn start(comm: Communicator, store: Arc<dyn Store>, j: ScoutJob) -> Scout {
        let stop = Arc::new(AtomicBool::new(false));
        let halt = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("live-scout".into())
            .spawn(move || watch(&comm, &*store, &j, &halt))
            .ok();
        Scout { stop, thread }
    }
}

impl Drop for Scout {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch(comm: &Communicator, store: &dyn Store, j: &ScoutJob, halt: &AtomicBool) {
    let (mut armed, mut published) = (false, false);
    while !halt.load(Ordering::Acquire) && !comm.is_aborted() {
        std::thread::sleep(TICK);
        let (ended, longest) = comm.waits();
        armed |= ended;
        let Some(waited) = longest.filter(|_| armed) else { continue };
        if waited < j.bound {
            continue;
        }
        if !published {
            published = store.set(&wait_key(&j.job, j.epoch, j.rank), b"waiting").is_ok();
            continue;
        }
        if waited < j.bound + GRACE {
            continue;
        }
        let recorded: Vec<bool> = (0..j.world)
            .map(|r| {
                r == j.rank || store.get(&wait_key(&j.job, j.epoch, r), Duration::ZERO).is_ok()
            })
            .collect();
        let stalled = suspects(j.rank, waited, j.bound, &recorded);
        for &r in &stalled {
            let (node, local) = (j.locate)(r);
            // LIVE-10's report, for the epoch the peers are about to move to: the agent stops
            // the worker only while it has not published that epoch.
            let text = format!(
                "{local} {} (rank {r} stalled: its peers waited {:.1} s in collectives it had not entered)",
                j.epoch + 1,
                waited.as_secs_f64()
            );
            let _ = store.set(&super::live::lag_key(&j.job, node), text.as_bytes());
            say!(
                "shardline worker: rank {}: rank {r} stalled: reported to node {node}'s agent after {:.1} s waiting (live recovery)",
                j.rank,
                waited.as_secs_f64()
            );
        }
        // Once per epoch: whatever comes next is the next epoch's, or the timeout's.
        return;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ranks_without_a_record_are_reported_after_the_grace_live_11() {
        let b = Duration::from_secs(1);
        let rec = [true, true, false, true];
        assert!(suspects(0, b, b, &rec).is_empty(), "not before the grace");
        assert_eq!(suspects(0, b + GRACE, b, &rec), vec![2]);
        assert!(suspects(0, b * 3, b, &[true; 4]).is_empty(), "every peer waits too");
        assert_eq!(suspects(1, b * 3, b, &[false, false]), vec![0], "never itself");
    }
}
