//! The state machine of the replicated store: a key-value map that applies the committed
//! operations of the replicated log in order (`raft.rs`), and the client sessions that make
//! a retried operation apply once (RSTORE-5).

use std::collections::{BTreeMap, HashMap};

/// One operation of the store, as the log carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Sets `key` to `value` (overwrites).
    Set {
        /// The key.
        key: String,
        /// The new value.
        value: Vec<u8>,
    },
    /// Adds `delta` to the decimal integer at `key` (0 when absent).
    Add {
        /// The key.
        key: String,
        /// What to add.
        delta: i64,
    },
    /// Sets `key` to `value` only if its value is `expected` (`None`: the key is absent).
    CompareSet {
        /// The key.
        key: String,
        /// The value the key must hold for the swap.
        expected: Option<Vec<u8>>,
        /// The new value.
        value: Vec<u8>,
    },
    /// Removes `key`.
    Delete {
        /// The key.
        key: String,
    },
    /// Changes nothing: a new leader commits one to learn what is committed (Raft §8).
    Noop,
}

/// What applying an operation returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpResult {
    /// A set, delete or no-op was applied.
    Done,
    /// The integer after an add.
    Added(i64),
    /// Whether a compare-set swapped, and the key's value after it.
    Swapped {
        /// True when the expected value matched.
        ok: bool,
        /// The value after the operation.
        current: Option<Vec<u8>>,
    },
    /// The operation could not apply (an add to a key that holds no integer, a request of a
    /// client older than the one it already made).
    Failed(String),
}

/// An operation with its client's identity: `(client, seq)` is unique per request, and a
/// request sent again with the same pair applies once (RSTORE-5). Client 0 is the replicas'
/// own (no-ops) and is not deduplicated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    /// The client's random identity.
    pub client: u64,
    /// The client's request number, increasing.
    pub seq: u64,
    /// The operation.
    pub op: Op,
}

/// The map and the sessions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvMachine {
    pub(super) map: BTreeMap<String, Vec<u8>>,
    /// Per client: its last applied request number and that request's result.
    pub(super) sessions: HashMap<u64, (u64, OpResult)>,
}

impl KvMachine {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.map.get(key).map(Vec::as_slice)
    }

    /// Applies one committed command and returns its result; a repeat of a client's last
    /// request returns that request's result without applying it again (RSTORE-5).
    pub fn apply(&mut self, cmd: &Command) -> OpResult {
        if cmd.client != 0 {
            if let Some((last, result)) = self.sessions.get(&cmd.client) {
                if cmd.seq == *last {
                    return result.clone();
                }
                if cmd.seq < *last {
                    return OpResult::Failed(format!(
                        "request {} of client {:x} is older than its request {last}",
                        cmd.seq, cmd.client
                    ));
                }
            }
        }
        let result = self.apply_op(&cmd.op);
        if cmd.client != 0 {
            self.sessions.insert(cmd.client, (cmd.seq, result.clone()));
        }
        result
    }

    fn apply_op(&mut self, op: &Op) -> OpResult {
        match op {
            Op::Set { key, value } => {
                self.map.insert(key.clone(), value.clone());
                OpResult::Done
            }
            Op::Add { key, delta } => {
                let cur = match self.map.get(key) {
                    None => 0,
                    Some(v) => {
                        match std::str::from_utf8(v).ok().and_then(|s| s.trim().parse::<i64>().ok())
                        {
                            Some(x) => x,
                            None => {
                                return OpResult::Failed(format!(
                                    "key '{key}' does not hold an integer"
                                ))
                            }
                        }
                    }
                };
                let new = cur.wrapping_add(*delta);
                self.map.insert(key.clone(), new.to_string().into_bytes());
                OpResult::Added(new)
            }
            Op::CompareSet { key, expected, value } => {
                let ok = self.map.get(key) == expected.as_ref();
                if ok {
                    self.map.insert(key.clone(), value.clone());
                }
                OpResult::Swapped { ok, current: self.map.get(key).cloned() }
            }
            Op::Delete { key } => {
                self.map.remove(key);
                OpResult::Done
            }
            Op::Noop => OpResult::Done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(client: u64, seq: u64, op: Op) -> Command {
        Command { client, seq, op }
    }

    fn add(key: &str, delta: i64) -> Op {
        Op::Add { key: key.into(), delta }
    }

    /// RSTORE-5
    #[test]
    fn a_repeated_request_applies_once_id_5() {
        let mut m = KvMachine::new();
        assert_eq!(m.apply(&cmd(7, 1, add("n", 2))), OpResult::Added(2));
        assert_eq!(m.apply(&cmd(7, 1, add("n", 2))), OpResult::Added(2));
        assert_eq!(m.get("n"), Some(&b"2"[..]));
        assert_eq!(m.apply(&cmd(8, 1, add("n", 2))), OpResult::Added(4));
        assert!(matches!(m.apply(&cmd(7, 0, add("n", 2))), OpResult::Failed(_)));
        assert_eq!(m.get("n"), Some(&b"4"[..]));
    }

    #[test]
    fn compare_set_swaps_only_on_the_expected_value() {
        let mut m = KvMachine::new();
        let cs = |e: Option<&[u8]>, v: &[u8]| Op::CompareSet {
            key: "g".into(),
            expected: e.map(<[u8]>::to_vec),
            value: v.to_vec(),
        };
        let r = m.apply(&cmd(1, 1, cs(None, b"a")));
        assert_eq!(r, OpResult::Swapped { ok: true, current: Some(b"a".to_vec()) });
        let r = m.apply(&cmd(2, 1, cs(None, b"b")));
        assert_eq!(r, OpResult::Swapped { ok: false, current: Some(b"a".to_vec()) });
        let r = m.apply(&cmd(2, 2, cs(Some(b"a"), b"b")));
        assert_eq!(r, OpResult::Swapped { ok: true, current: Some(b"b".to_vec()) });
        m.apply(&cmd(2, 3, Op::Delete { key: "g".into() }));
        assert_eq!(m.get("g"), None);
        m.apply(&cmd(2, 4, Op::Set { key: "x".into(), value: b"y".to_vec() }));
        assert!(matches!(m.apply(&cmd(2, 5, add("x", 1))), OpResult::Failed(_)));
    }
}
