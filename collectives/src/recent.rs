//! A small ring of each rank's recent collectives, fed by the lane threads, so that a hang or
//! a desync can be explained after the fact: which rank is behind, on which op of which lane,
//! and what every other rank was waiting for.
//!
//! - RECENT-1: an op is recorded when its lane thread starts it and completed in place when it
//!   ends; an op still running has `end == None`.
//! - RECENT-2: the ring keeps the last [`RecentOps::CAPACITY`] ops of the communicator (all
//!   lanes together), oldest first; recording never blocks a lane for long (one short mutex).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

/// One collective as seen by one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct OpRecord {
    /// Lane name.
    pub lane: String,
    /// Sequence number on the lane.
    pub seq: u64,
    /// Op name (`all_reduce`, `reduce_scatter`, ...).
    pub op: &'static str,
    /// Bytes of the op's buffer.
    pub bytes: usize,
    /// When the lane thread started it.
    pub start: Instant,
    /// When it ended (`None`: still running).
    pub end: Option<Instant>,
    /// Whether it ended with an error.
    pub failed: bool,
}

/// The ring (RECENT-2).
#[derive(Debug, Default)]
pub struct RecentOps {
    ring: Mutex<VecDeque<OpRecord>>,
}

impl RecentOps {
    /// Ops kept per communicator.
    pub const CAPACITY: usize = 32;

    /// Records the start of an op (RECENT-1).
    pub fn start(&self, lane: &str, seq: u64, op: &'static str, bytes: usize) {
        let mut r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if r.len() == Self::CAPACITY {
            r.pop_front();
        }
        r.push_back(OpRecord {
            lane: lane.to_string(),
            seq,
            op,
            bytes,
            start: Instant::now(),
            end: None,
            failed: false,
        });
    }

    /// Records the end of the op `seq` of `lane`.
    pub fn end(&self, lane: &str, seq: u64, failed: bool) {
        let mut r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(rec) = r.iter_mut().rev().find(|o| o.seq == seq && o.lane == lane) {
            rec.end = Some(Instant::now());
            rec.failed = failed;
        }
    }

    /// A copy of the ring, oldest first.
    pub fn snapshot(&self) -> Vec<OpRecord> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_last_ops_and_completes_in_place() {
        // RECENT-1, RECENT-2
        let r = RecentOps::default();
        for s in 0..40u64 {
            r.start(if s % 2 == 0 { "a" } else { "b" }, s / 2, "all_reduce", 16);
            if s != 39 {
                r.end(if s % 2 == 0 { "a" } else { "b" }, s / 2, false);
            }
        }
        let snap = r.snapshot();
        assert_eq!(snap.len(), RecentOps::CAPACITY);
        assert_eq!((snap[0].lane.as_str(), snap[0].seq), ("a", 4));
        let last = snap.last().unwrap();
        assert_eq!((last.lane.as_str(), last.seq, last.end), ("b", 19, None));
        assert!(snap[..snap.len() - 1].iter().all(|o| o.end.is_some()));
    }
}
