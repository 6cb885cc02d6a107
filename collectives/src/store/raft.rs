//! The replicated log of the store's operations, as one replica sees it: a pure state
//! machine (no clock, no socket) that the networked replica (`replica.rs`) and the simulated
//! network of the tests drive with [`Replica::tick`], [`Replica::step`] and
//! [`Replica::propose`], and whose messages they carry from [`Replica::take_outbox`].
//!
//! It follows Raft (Ongaro and Ousterhout, "In Search of an Understandable Consensus
//! Algorithm", 2014, Figure 2; section numbers below are that paper's, "diss." is Ongaro's
//! dissertation, 2014): terms, one vote per term, the election restriction, AppendEntries
//! with its consistency check, and commitment by a majority of an entry of the leader's own
//! term. Committed commands are applied in log order to a [`KvMachine`]; every
//! [`COMPACT_AFTER`] applied entries the log's prefix is compacted into a snapshot of it,
//! which the leader sends (InstallSnapshot, §7) to a follower that needs compacted entries,
//! so that a long job's store holds its state, not its history.
//!
//! Time is counted in ticks that the driver delivers at one rate on every replica. The
//! replica's state lives in memory: a replica that is restarted by [`Replica::restart`] keeps
//! its term, vote, log and snapshot (Raft's persistent state), as a process that wrote them to disk
//! would; the networked replica keeps them only as long as its process lives.
//!
//! Invariants:
//! - RSTORE-1: at most one leader per term: a replica grants one vote per term (§5.2), to a
//!   candidate whose log is at least as up to date as its own (§5.4.1), and a candidate
//!   leads only with the votes of a majority.
//! - RSTORE-2: a committed command is never lost while a majority lives: an entry commits
//!   once a majority stores it and it is of the leader's term (§5.4.2), and the election
//!   restriction gives every later leader every committed entry (§5.4.3).
//! - RSTORE-3: a minority never commits: an entry commits only once a majority stores it,
//!   so a leader that hears from no majority commits nothing new, and its lease lapses so
//!   that it answers no read.
//! - RSTORE-4: reads are linearizable: a leader answers a read from its state machine only
//!   while it holds a lease (a majority acknowledged a message it sent less than `lease`
//!   ticks ago) and after an entry of its term committed (§8); a follower that heard from a
//!   leader less than the minimum election timeout ago neither votes nor takes a higher term
//!   (diss. §4.2.3, §6.4.1), so with `lease` below that timeout no other leader is elected
//!   while the lease holds.
//! - RSTORE-5: a command retried by its client applies once (`kv_machine.rs`, diss. §6.3).
//! - RSTORE-6: a replica that lost its state (started again empty while the group runs)
//!   neither votes nor campaigns until a leader brought it up to that leader's commit, so
//!   its empty log cannot elect a leader that lacks committed entries; while it catches up,
//!   the group without it may be unable to elect, never unsafe.

pub use super::kv_machine::{Command, KvMachine, Op, OpResult};

/// The timing of a replica, in ticks.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Shortest election timeout; also how long a follower that heard from a leader refuses
    /// to vote (RSTORE-4).
    pub election_min: u64,
    /// Longest election timeout (each is drawn in `election_min..=election_max`).
    pub election_max: u64,
    /// How often a leader sends AppendEntries, empty or not.
    pub heartbeat: u64,
    /// How long a majority's acknowledgement lets the leader answer reads; below
    /// `election_min` (RSTORE-4).
    pub lease: u64,
}

/// Most entries in one AppendEntries.
const MAX_BATCH: usize = 256;
/// Applied entries kept in the log before they are compacted into a snapshot (§7).
pub const COMPACT_AFTER: u64 = 4096;

/// One entry of the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The term of the leader that appended it.
    pub term: u64,
    /// What it does.
    pub cmd: Command,
}

/// A message between replicas (Figure 2's RPCs and their replies).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// RequestVote.
    Vote {
        /// The candidate's term.
        term: u64,
        /// Index of its last entry.
        last_index: u64,
        /// Term of its last entry.
        last_term: u64,
    },
    /// RequestVote's reply.
    VoteReply {
        /// The voter's term.
        term: u64,
        /// Whether the vote was granted.
        granted: bool,
    },
    /// AppendEntries (a heartbeat when `entries` is empty).
    Append {
        /// The leader's term.
        term: u64,
        /// Index of the entry before `entries`.
        prev_index: u64,
        /// Its term.
        prev_term: u64,
        /// New entries.
        entries: Vec<Entry>,
        /// The leader's commit index.
        commit: u64,
        /// The leader's tick when it sent this, echoed back for its lease (RSTORE-4).
        sent: u64,
    },
    /// InstallSnapshot (§7): the state machine up to `index`, for a follower that needs
    /// entries the leader compacted. Answered by an `AppendReply`.
    Snapshot {
        /// The leader's term.
        term: u64,
        /// The last index the snapshot covers.
        index: u64,
        /// That entry's term.
        last_term: u64,
        /// The state machine after it.
        machine: KvMachine,
        /// As in `Append`.
        sent: u64,
    },
    /// AppendEntries' reply.
    AppendReply {
        /// The follower's term.
        term: u64,
        /// Whether the entries were appended.
        ok: bool,
        /// On success the index of the last entry now known to match; on a failure where the
        /// leader should try next, minus one.
        match_index: u64,
        /// The `sent` of the message answered.
        sent: u64,
    },
}

impl Message {
    /// The term the message carries.
    pub fn term(&self) -> u64 {
        match self {
            Message::Vote { term, .. }
            | Message::VoteReply { term, .. }
            | Message::Append { term, .. }
            | Message::Snapshot { term, .. }
            | Message::AppendReply { term, .. } => *term,
        }
    }
}

/// A replica's role (§5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Answers leaders and candidates.
    Follower,
    /// Asks for votes.
    Candidate,
    /// Appends and commits.
    Leader,
}

/// A committed command, applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// Its log index.
    pub index: u64,
    /// The term of its entry.
    pub term: u64,
    /// Its client.
    pub client: u64,
    /// The client's request number.
    pub seq: u64,
    /// The command itself.
    pub cmd: Command,
    /// What applying it returned.
    pub result: OpResult,
}

/// Why a replica does not take a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not the leader; the leader it knows of, if any.
    NotLeader(Option<usize>),
    /// The leader, but without a lease now (RSTORE-4).
    NoLease,
}

/// One replica of the store.
#[derive(Debug)]
pub struct Replica {
    id: usize,
    n: usize,
    timing: Timing,
    // Persistent state (Figure 2).
    term: u64,
    voted: Option<usize>,
    /// The entries after `snap_index`.
    log: Vec<Entry>,
    /// The last index compacted into `snap`, and its term (§7).
    snap_index: u64,
    snap_term: u64,
    snap: KvMachine,
    compact_after: u64,
    /// Started without the state it had (an agent restarted): it neither votes nor
    /// campaigns until a leader brought it up to that leader's commit (RSTORE-6).
    learner: bool,
    // Volatile state.
    commit: u64,
    applied: u64,
    kv: KvMachine,
    role: Role,
    leader: Option<usize>,
    now: u64,
    election_due: u64,
    leader_contact: Option<u64>,
    /// Votes are ignored before this tick (RSTORE-4): set a minimum election timeout past a
    /// leader's message, and past a start, when this replica may have acknowledged a leader
    /// it no longer remembers.
    quiet_until: u64,
    /// When it last became leader.
    led_since: u64,
    votes: Vec<bool>,
    // Leader state.
    next: Vec<u64>,
    matched: Vec<u64>,
    acked_sent: Vec<u64>,
    last_heartbeat: u64,
    rng: u64,
    outbox: Vec<(usize, Message)>,
    done: Vec<Applied>,
}

impl Replica {
    /// Replica `id` of `n`; `seed` draws its election timeouts.
    pub fn new(id: usize, n: usize, timing: Timing, seed: u64) -> Replica {
        assert!(id < n && timing.election_min <= timing.election_max);
        let mut r = Replica {
            id,
            n,
            timing,
            term: 0,
            voted: None,
            log: Vec::new(),
            snap_index: 0,
            snap_term: 0,
            snap: KvMachine::new(),
            compact_after: COMPACT_AFTER,
            learner: false,
            commit: 0,
            applied: 0,
            kv: KvMachine::new(),
            role: Role::Follower,
            leader: None,
            now: 0,
            election_due: 0,
            leader_contact: None,
            // A fresh replica acknowledged no leader: no lease to protect (RSTORE-4).
            quiet_until: 0,
            led_since: 0,
            votes: vec![false; n],
            next: vec![1; n],
            matched: vec![0; n],
            acked_sent: vec![0; n],
            last_heartbeat: 0,
            rng: seed ^ (id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d_4c95_7f2d,
            outbox: Vec::new(),
            done: Vec::new(),
        };
        r.reset_election();
        // Replica 0 campaigns first at start-up, so that a healthy group's leader is the
        // first node's, as a single store would be; later timeouts are drawn alike.
        if id == 0 {
            r.election_due = timing.election_min / 2;
        }
        r
    }

    /// Loses the volatile state as a crash would and starts again as a follower from the
    /// persistent state (term, vote, log); the state machine is rebuilt as entries commit.
    pub fn restart(&mut self) {
        // The snapshot is persistent state too: it holds committed entries only.
        self.commit = self.snap_index;
        self.applied = self.snap_index;
        self.kv = self.snap.clone();
        self.role = Role::Follower;
        self.leader = None;
        self.leader_contact = None;
        self.quiet_until = self.now + self.timing.election_min;
        self.outbox.clear();
        self.done.clear();
        self.reset_election();
    }

    /// This replica's index.
    pub fn id(&self) -> usize {
        self.id
    }

    /// Its current term.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// Its role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The leader it knows of in its term.
    pub fn leader(&self) -> Option<usize> {
        self.leader
    }

    /// Its commit index.
    pub fn commit_index(&self) -> u64 {
        self.commit
    }

    /// A replica that lost the state it had before (RSTORE-6): it votes and campaigns only
    /// once a leader brought it up to that leader's commit.
    pub fn as_learner(mut self) -> Self {
        self.learner = true;
        self
    }

    /// Whether it still waits to catch up before it votes (RSTORE-6).
    pub fn is_learner(&self) -> bool {
        self.learner
    }

    /// Compacts applied entries into a snapshot once `entries` of them are kept (§7).
    pub fn with_compaction(mut self, entries: u64) -> Self {
        self.compact_after = entries.max(1);
        self
    }

    /// The entry at `index`, unless it is compacted or not there.
    pub fn entry(&self, index: u64) -> Option<&Entry> {
        if index <= self.snap_index {
            return None;
        }
        self.log.get((index - self.snap_index - 1) as usize)
    }

    /// The last index compacted into the snapshot (0: none).
    pub fn snapshot_index(&self) -> u64 {
        self.snap_index
    }

    /// Its last index.
    pub fn last_log_index(&self) -> u64 {
        self.last_index()
    }

    /// The entries it keeps (after the snapshot).
    pub fn log(&self) -> &[Entry] {
        &self.log
    }

    /// Ticks since it last heard from a leader of its term, or led with a lease; `None`
    /// when it never did. The agent counts a replica cut off this long as out of quorum.
    pub fn out_of_contact(&self) -> Option<u64> {
        if self.role == Role::Leader {
            let since = self.majority_ack();
            return Some(self.now - if since > 0 { since } else { self.led_since });
        }
        self.leader_contact.map(|t| self.now - t)
    }

    /// The messages to send, as `(to, message)`.
    pub fn take_outbox(&mut self) -> Vec<(usize, Message)> {
        std::mem::take(&mut self.outbox)
    }

    /// The commands applied since the last call, in log order.
    pub fn take_applied(&mut self) -> Vec<Applied> {
        std::mem::take(&mut self.done)
    }

    fn majority(&self) -> usize {
        self.n / 2 + 1
    }

    fn last_index(&self) -> u64 {
        self.snap_index + self.log.len() as u64
    }

    /// The term of the entry at `index`: the snapshot's for its last index, 0 for one
    /// compacted before it or absent.
    fn term_at(&self, index: u64) -> u64 {
        if index == self.snap_index {
            self.snap_term
        } else {
            self.entry(index).map_or(0, |e| e.term)
        }
    }

    fn reset_election(&mut self) {
        // xorshift64*: deterministic per seed, spread enough for timeouts.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let span = self.timing.election_max - self.timing.election_min + 1;
        self.election_due = self.now + self.timing.election_min + self.rng % span;
    }

    fn send(&mut self, to: usize, m: Message) {
        self.outbox.push((to, m));
    }

    /// One tick: a leader sends heartbeats when due; a follower or candidate whose election
    /// timeout passed starts an election (§5.2).
    pub fn tick(&mut self) {
        self.now += 1;
        if self.role == Role::Leader {
            if self.now - self.last_heartbeat >= self.timing.heartbeat {
                self.broadcast_append();
            }
        } else if self.now >= self.election_due && self.learner {
            self.reset_election();
        } else if self.now >= self.election_due {
            self.start_election();
        }
    }

    /// An append or snapshot from `from` in `term`: refused (and answered) from a stale
    /// term; otherwise a leader of this term exists, so a candidate steps down (§5.2) and
    /// votes are ignored for a while (RSTORE-4). Whether to go on with the message.
    fn hear_leader(&mut self, from: usize, term: u64, sent: u64) -> bool {
        if term < self.term {
            let reply = Message::AppendReply { term: self.term, ok: false, match_index: 0, sent };
            self.send(from, reply);
            return false;
        }
        self.become_follower(term);
        self.leader = Some(from);
        self.leader_contact = Some(self.now);
        self.quiet_until = self.now + self.timing.election_min;
        self.reset_election();
        true
    }

    fn start_election(&mut self) {
        self.term += 1;
        self.role = Role::Candidate;
        self.voted = Some(self.id);
        self.leader = None;
        self.votes = vec![false; self.n];
        self.votes[self.id] = true;
        self.reset_election();
        if self.majority() == 1 {
            self.become_leader();
            return;
        }
        let (last_index, last_term) = (self.last_index(), self.term_at(self.last_index()));
        let me = self.id;
        for p in (0..self.n).filter(|&p| p != me) {
            self.send(p, Message::Vote { term: self.term, last_index, last_term });
        }
    }

    fn become_follower(&mut self, term: u64) {
        if term > self.term {
            self.term = term;
            self.voted = None;
            self.leader = None;
        }
        if self.role != Role::Follower {
            self.role = Role::Follower;
            self.reset_election();
        }
    }

    fn become_leader(&mut self) {
        self.role = Role::Leader;
        self.leader = Some(self.id);
        self.led_since = self.now;
        self.next = vec![self.last_index() + 1; self.n];
        self.matched = vec![0; self.n];
        self.acked_sent = vec![0; self.n];
        // §8: a no-op of its own term tells the new leader what is committed.
        self.log.push(Entry { term: self.term, cmd: Command { client: 0, seq: 0, op: Op::Noop } });
        self.matched[self.id] = self.last_index();
        self.advance_commit();
        self.broadcast_append();
    }

    fn broadcast_append(&mut self) {
        self.last_heartbeat = self.now;
        let me = self.id;
        for p in (0..self.n).filter(|&p| p != me) {
            self.send_append(p);
        }
    }

    fn send_append(&mut self, p: usize) {
        let prev_index = self.next[p].saturating_sub(1).min(self.last_index());
        if prev_index < self.snap_index {
            // §7: the entries it needs are compacted: it gets the snapshot.
            let m = Message::Snapshot {
                term: self.term,
                index: self.snap_index,
                last_term: self.snap_term,
                machine: self.snap.clone(),
                sent: self.now,
            };
            self.send(p, m);
            return;
        }
        let from = (prev_index - self.snap_index) as usize;
        let to = (from + MAX_BATCH).min(self.log.len());
        let m = Message::Append {
            term: self.term,
            prev_index,
            prev_term: self.term_at(prev_index),
            entries: self.log[from..to].to_vec(),
            commit: self.commit,
            sent: self.now,
        };
        self.send(p, m);
    }

    /// Appends a command if this replica leads; returns its log index. The command is applied
    /// (and reported by [`Replica::take_applied`]) once committed, or never if this leader is
    /// deposed first.
    pub fn propose(&mut self, cmd: Command) -> Result<u64, Refusal> {
        if self.role != Role::Leader {
            return Err(Refusal::NotLeader(self.leader));
        }
        self.log.push(Entry { term: self.term, cmd });
        self.matched[self.id] = self.last_index();
        self.advance_commit();
        // Sent now rather than at the next heartbeat: a request waits one round trip.
        self.broadcast_append();
        Ok(self.last_index())
    }

    /// Whether this leader may answer reads now (RSTORE-4).
    pub fn lease_holds(&self) -> bool {
        if self.role != Role::Leader || self.term_at(self.commit) != self.term {
            return false;
        }
        let since = self.majority_ack();
        since > 0 && self.now < since + self.timing.lease
    }

    /// The latest tick at which this leader sent a message that a majority (itself
    /// included) acknowledged; 0 when none did.
    fn majority_ack(&self) -> u64 {
        let mut acks: Vec<u64> =
            (0..self.n).map(|p| if p == self.id { self.now } else { self.acked_sent[p] }).collect();
        acks.sort_unstable_by(|a, b| b.cmp(a));
        acks[self.majority() - 1]
    }

    /// The committed value of `key`, answered by a leader that holds its lease (RSTORE-4).
    pub fn read(&self, key: &str) -> Result<Option<Vec<u8>>, Refusal> {
        if self.role != Role::Leader {
            return Err(Refusal::NotLeader(self.leader));
        }
        if !self.lease_holds() {
            return Err(Refusal::NoLease);
        }
        Ok(self.kv.get(key).map(<[u8]>::to_vec))
    }

    /// Handles a message from replica `from`.
    pub fn step(&mut self, from: usize, m: Message) {
        if from >= self.n || from == self.id {
            return;
        }
        if let Message::Vote { .. } = m {
            // RSTORE-4 (diss. §4.2.3): while a leader is heard from, a vote request is
            // ignored, term and all; a leader ignores them too.
            if self.role == Role::Leader || self.now < self.quiet_until || self.learner {
                return;
            }
        }
        if m.term() > self.term {
            self.become_follower(m.term());
        }
        match m {
            Message::Vote { term, last_index, last_term } => {
                // §5.4.1: the candidate's log is at least as up to date as ours.
                let mine = (self.term_at(self.last_index()), self.last_index());
                let granted = term == self.term
                    && self.voted.is_none_or(|v| v == from)
                    && (last_term, last_index) >= mine;
                if granted {
                    self.voted = Some(from);
                    self.reset_election();
                }
                self.send(from, Message::VoteReply { term: self.term, granted });
            }
            Message::VoteReply { term, granted } => {
                if self.role == Role::Candidate && term == self.term && granted {
                    self.votes[from] = true;
                    if self.votes.iter().filter(|&&v| v).count() >= self.majority() {
                        self.become_leader();
                    }
                }
            }
            Message::Append { term, prev_index, prev_term, entries, commit, sent } => {
                if !self.hear_leader(from, term, sent) {
                    return;
                }
                // Entries up to the snapshot are committed: they match (§5.3, §7).
                let matches = prev_index <= self.snap_index
                    || (prev_index <= self.last_index() && self.term_at(prev_index) == prev_term);
                if !matches {
                    let hint = self.last_index().min(prev_index.saturating_sub(1));
                    let reply = Message::AppendReply {
                        term: self.term,
                        ok: false,
                        match_index: hint,
                        sent,
                    };
                    self.send(from, reply);
                    return;
                }
                let count = entries.len() as u64;
                for (k, e) in entries.into_iter().enumerate() {
                    let index = prev_index + 1 + k as u64;
                    if index <= self.snap_index {
                        continue;
                    }
                    if index <= self.last_index() {
                        if self.term_at(index) == e.term {
                            continue;
                        }
                        // Figure 2, AppendEntries 3: a conflict removes the entry and all
                        // that follow it (never a committed one, RSTORE-2).
                        debug_assert!(index > self.commit, "a committed entry conflicts");
                        self.log.truncate((index - self.snap_index - 1) as usize);
                    }
                    self.log.push(e);
                }
                let last_new = prev_index + count;
                if commit > self.commit {
                    self.commit = self.commit.max(commit.min(last_new));
                    self.apply();
                }
                self.learner &= self.commit < commit;
                let reply =
                    Message::AppendReply { term: self.term, ok: true, match_index: last_new, sent };
                self.send(from, reply);
            }
            Message::Snapshot { term, index, last_term, machine, sent } => {
                if !self.hear_leader(from, term, sent) {
                    return;
                }
                if index > self.commit {
                    // §7: a log that holds the snapshot's last entry keeps what follows it.
                    if self.term_at(index) == last_term && index <= self.last_index() {
                        self.log.drain(..(index - self.snap_index) as usize);
                    } else {
                        self.log.clear();
                    }
                    self.snap_index = index;
                    self.snap_term = last_term;
                    self.snap = machine.clone();
                    self.kv = machine;
                    self.commit = index;
                    self.applied = index;
                }
                self.learner &= self.commit < index;
                let reply =
                    Message::AppendReply { term: self.term, ok: true, match_index: index, sent };
                self.send(from, reply);
            }
            Message::AppendReply { term, ok, match_index, sent } => {
                if self.role != Role::Leader || term != self.term {
                    return;
                }
                self.acked_sent[from] = self.acked_sent[from].max(sent);
                if ok {
                    self.matched[from] = self.matched[from].max(match_index);
                    self.next[from] = self.matched[from] + 1;
                    self.advance_commit();
                    if self.next[from] <= self.last_index() {
                        self.send_append(from);
                    }
                } else {
                    self.next[from] =
                        (match_index + 1).min(self.next[from].saturating_sub(1)).max(1);
                    self.send_append(from);
                }
            }
        }
    }

    /// §5.3, §5.4.2: the highest index of the current term that a majority stores commits.
    fn advance_commit(&mut self) {
        let mut m = self.matched.clone();
        m.sort_unstable_by(|a, b| b.cmp(a));
        let candidate = m[self.majority() - 1];
        if candidate > self.commit && self.term_at(candidate) == self.term {
            self.commit = candidate;
            self.apply();
        }
    }

    fn apply(&mut self) {
        while self.applied < self.commit {
            self.applied += 1;
            let e = &self.log[(self.applied - self.snap_index - 1) as usize];
            let (term, client, seq) = (e.term, e.cmd.client, e.cmd.seq);
            let result = self.kv.apply(&e.cmd);
            let cmd = e.cmd.clone();
            self.done.push(Applied { index: self.applied, term, client, seq, cmd, result });
        }
        if self.applied - self.snap_index >= self.compact_after {
            // §7: the applied prefix becomes the snapshot.
            self.snap_term = self.term_at(self.applied);
            self.log.drain(..(self.applied - self.snap_index) as usize);
            self.snap_index = self.applied;
            self.snap = self.kv.clone();
        }
    }

    /// The state machine (committed state, possibly stale on a follower).
    pub fn machine(&self) -> &KvMachine {
        &self.kv
    }
}

#[cfg(test)]
#[path = "raft_sim.rs"]
mod sim;
