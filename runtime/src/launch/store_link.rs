//! An agent's view of the store: a reconnecting link, the generation record (LAUNCH-6) and
//! the other agents' heartbeats (LAUNCH-10).

use super::agent::STORE_REQUEST_TIMEOUT;
use shardline_collectives::{ReplicatedStore, Store, TcpStoreClient};
use std::time::{Duration, Instant};

/// What the deciding agent (node 0's, or the one whose replica leads, LAUNCH-14) decided
/// for one generation of the worker group (LAUNCH-6).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Generation {
    pub(super) gen: u64,
    /// Nodes whose workers make up this generation, ascending; their position numbers ranks.
    pub(super) nodes: Vec<usize>,
    pub(super) state: GenState,
    /// The node whose agent decided it (LAUNCH-14).
    #[serde(default)]
    pub(super) by: usize,
    /// Restarts after failures used up to this generation (`--max-restarts`): an agent that
    /// takes the record over goes on counting from here (LAUNCH-14).
    #[serde(default)]
    pub(super) restarts: u32,
    /// Nodes that joined without a failure in this generation, and the step it resumes
    /// from, when it grew (LAUNCH-15..LAUNCH-18).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) grew: Option<Joined>,
}

/// The nodes a generation grew by, and the step of the checkpoint it resumes from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Joined {
    pub(super) nodes: Vec<usize>,
    pub(super) step: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum GenState {
    /// Workers of this generation run.
    Run,
    /// A failure was seen: every agent stops its workers and says so.
    Stop,
    /// A node joins (LAUNCH-15..LAUNCH-18): every agent of the generation says it is ready,
    /// the deciding one then sends SIGTERM to its workers, the group stops after a step and
    /// checkpoints it (INT-1), and every agent says its workers stopped.
    Grow,
    /// Training finished.
    Done,
    /// The job failed for good.
    Abort,
}

pub(super) fn agent_key(job: &str, what: &str) -> String {
    format!("agent/{job}/{what}")
}

/// Result of an agent's store read.
pub(super) enum Got {
    Value(Vec<u8>),
    Unset,
    Unreachable,
}

/// An agent's connection to the store. After an I/O error it reconnects (a request that timed
/// out may leave its late reply in the stream), and it remembers when it last got through.
/// With replicas (LAUNCH-14) the client finds the leader itself and is kept.
pub(super) struct StoreLink {
    pub(super) addr: String,
    pub(super) token: String,
    pub(super) client: Option<TcpStoreClient>,
    pub(super) replicated: Option<ReplicatedStore>,
    pub(super) last_ok: Instant,
    /// When a write last committed (none yet: `None`): with replicas, through a leader that
    /// a majority follows (LAUNCH-14), so this node was in contact with a majority then.
    pub(super) last_write: Option<Instant>,
    /// Why the last connection attempt failed (for the "still waiting" line).
    pub(super) last_err: Option<String>,
}

impl StoreLink {
    pub(super) fn client(&mut self) -> Option<&dyn Store> {
        if let Some(r) = &self.replicated {
            return Some(r);
        }
        if self.client.is_none() {
            match TcpStoreClient::connect(self.addr.as_str(), &self.token, STORE_REQUEST_TIMEOUT) {
                Ok(c) => {
                    self.client = Some(c);
                    self.last_err = None;
                }
                Err(e) => self.last_err = Some(e.to_string()),
            }
        }
        self.client.as_ref().map(|c| c as &dyn Store)
    }

    pub(super) fn set(&mut self, key: &str, value: &[u8]) -> bool {
        let Some(c) = self.client() else { return false };
        match c.set(key, value) {
            Ok(()) => {
                self.last_ok = Instant::now();
                self.last_write = Some(self.last_ok);
                true
            }
            Err(e) => {
                self.last_err = Some(e.to_string());
                self.client = None;
                false
            }
        }
    }

    /// LAUNCH-14: sets `key` to `value` only if it holds `expected`; `Some(true)` when it
    /// did, `Some(false)` when the key held something else, `None` when the store did not
    /// answer. A single store (no replicas) is written by one agent only and just set.
    pub(super) fn compare_set(
        &mut self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> Option<bool> {
        let Some(r) = &self.replicated else { return self.set(key, value).then_some(true) };
        match r.compare_set(key, expected, value) {
            Ok((ok, _)) => {
                self.last_ok = Instant::now();
                self.last_write = Some(self.last_ok);
                Some(ok)
            }
            Err(e) => {
                self.last_err = Some(e.to_string());
                None
            }
        }
    }

    pub(super) fn get(&mut self, key: &str) -> Got {
        let Some(c) = self.client() else { return Got::Unreachable };
        match c.get(key, Duration::from_millis(1)) {
            Ok(v) => {
                self.last_ok = Instant::now();
                Got::Value(v)
            }
            Err(shardline_collectives::StoreError::Timeout { .. }) => {
                self.last_ok = Instant::now();
                Got::Unset
            }
            Err(e) => {
                self.last_err = Some(e.to_string());
                self.client = None;
                Got::Unreachable
            }
        }
    }
}

/// When each node's heartbeat last moved, as node 0's agent sees it, and how often this
/// agent saw it move.
pub(super) struct Heartbeats {
    pub(super) last: Vec<Option<(Vec<u8>, Instant, u32)>>,
}

impl Heartbeats {
    pub(super) fn new(nodes: usize) -> Self {
        Heartbeats { last: vec![None; nodes] }
    }

    pub(super) fn poll(&mut self, link: &mut StoreLink, job: &str) {
        for n in 0..self.last.len() {
            if let Got::Value(v) = link.get(&agent_key(job, &format!("hb/{n}"))) {
                match &mut self.last[n] {
                    Some((old, at, moves)) if *old != v => {
                        *old = v;
                        *at = Instant::now();
                        *moves = moves.saturating_add(1);
                    }
                    Some(_) => {}
                    None => self.last[n] = Some((v, Instant::now(), 0)),
                }
            }
        }
    }

    /// How long node `n`'s heartbeat has been still, counting from `since` at most.
    pub(super) fn silent(&self, n: usize, since: Instant) -> Duration {
        match self.last.get(n).and_then(|x| x.as_ref()) {
            Some((_, t, _)) if *t > since => t.elapsed(),
            _ => since.elapsed(),
        }
    }

    pub(super) fn fresh(&self, n: usize, timeout: Duration) -> bool {
        self.last.get(n).and_then(|x| x.as_ref()).is_some_and(|(_, t, _)| t.elapsed() < timeout)
    }

    /// Fresh, and seen to move by this agent: a key left behind by an agent that is gone is
    /// read fresh once, but never moves.
    pub(super) fn moving(&self, n: usize, timeout: Duration) -> bool {
        self.fresh(n, timeout)
            && self.last.get(n).and_then(|x| x.as_ref()).is_some_and(|(_, _, m)| *m > 0)
    }
}
