//! The replicated log over a deterministic simulated network: seeded message loss, delays
//! that reorder, partitions and crashed replicas, with every invariant of `raft.rs` checked
//! after every round, over many seeds.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

const TIMING: Timing = Timing { election_min: 10, election_max: 20, heartbeat: 2, lease: 8 };
const KEYS: [&str; 3] = ["a", "b", "n"];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A client with one request in flight at a time, retried to whoever leads (RSTORE-5).
struct Client {
    id: u64,
    seq: u64,
    op: Option<Op>,
    sent_at: u64,
}

struct Sim {
    reps: Vec<Replica>,
    up: Vec<bool>,
    rng: Rng,
    /// (deliver at, from, to, message)
    flight: Vec<(u64, usize, usize, Message)>,
    now: u64,
    /// A replica's side of the partition; messages cross no side.
    side: Vec<u8>,
    /// Links cut in both directions, as pairs of replicas.
    cut: Vec<(usize, usize)>,
    loss: u64,
    leaders: HashMap<u64, usize>,
    /// Every entry any replica committed, in order: the oracle.
    committed: Vec<Entry>,
    /// The oracle's state machine and each committed request's result.
    model: KvMachine,
    results: HashMap<(u64, u64), OpResult>,
    clients: Vec<Client>,
    reads_served: u64,
    completed: u64,
    /// No new client requests (the last stretch, so that followers catch up).
    quiet: bool,
    /// Snapshots delivered.
    snapshots: u64,
}

impl Sim {
    fn new(n: usize, seed: u64) -> Sim {
        let mut rng = Rng(seed);
        let loss = rng.below(20);
        Sim {
            // Compaction every few entries, so that snapshots travel under every fault.
            reps: (0..n).map(|i| Replica::new(i, n, TIMING, seed).with_compaction(16)).collect(),
            up: vec![true; n],
            rng,
            flight: Vec::new(),
            now: 0,
            side: vec![0; n],
            cut: Vec::new(),
            loss,
            leaders: HashMap::new(),
            committed: Vec::new(),
            model: KvMachine::new(),
            results: HashMap::new(),
            clients: (1..=3).map(|id| Client { id, seq: 0, op: None, sent_at: 0 }).collect(),
            reads_served: 0,
            completed: 0,
            quiet: false,
            snapshots: 0,
        }
    }

    fn n(&self) -> usize {
        self.reps.len()
    }

    fn collect(&mut self, from: usize) {
        for (to, m) in self.reps[from].take_outbox() {
            if self.rng.chance(self.loss) {
                continue;
            }
            let at = self.now + 1 + self.rng.below(3);
            self.flight.push((at, from, to, m));
        }
    }

    fn round(&mut self) {
        self.now += 1;
        for i in 0..self.n() {
            if self.up[i] {
                self.reps[i].tick();
                self.collect(i);
            }
        }
        let (due, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.flight).into_iter().partition(|f| f.0 <= self.now);
        self.flight = later;
        let mut due = due;
        // Reordering: the due messages in a seeded order.
        for k in (1..due.len()).rev() {
            let j = self.rng.below(k as u64 + 1) as usize;
            due.swap(k, j);
        }
        for (_, from, to, m) in due {
            let cut = self.cut.contains(&(from, to)) || self.cut.contains(&(to, from));
            if self.up[to] && self.side[from] == self.side[to] && !cut {
                self.snapshots += u64::from(matches!(m, Message::Snapshot { .. }));
                self.reps[to].step(from, m);
                self.collect(to);
            }
        }
        self.check();
        if !self.quiet {
            self.clients_act();
        }
        self.reads();
    }

    fn check(&mut self) {
        for i in 0..self.n() {
            let r = &self.reps[i];
            // RSTORE-1.
            if r.role() == Role::Leader {
                let l = *self.leaders.entry(r.term()).or_insert(i);
                assert_eq!(l, i, "two leaders in term {}: {l} and {i}", r.term());
            }
        }
        // The oracle learns each committed entry from the first replica that applies it
        // (the leader that committed it); every later application agrees (RSTORE-2, -5).
        let mut applied: Vec<Applied> = Vec::new();
        for r in self.reps.iter_mut() {
            applied.extend(r.take_applied());
        }
        applied.sort_by_key(|a| a.index);
        for a in applied {
            let k = a.index as usize;
            assert!(k <= self.committed.len() + 1, "entry {k} applied before entry {}", k - 1);
            if k == self.committed.len() + 1 {
                let e = Entry { term: a.term, cmd: a.cmd.clone() };
                // RSTORE-3: an entry commits only once a majority stores it (compacted into
                // a snapshot counts: only applied entries are).
                let stored = self
                    .reps
                    .iter()
                    .filter(|x| x.entry(a.index) == Some(&e) || x.snapshot_index() >= a.index)
                    .count();
                assert!(stored > self.n() / 2, "entry {k} committed on {stored} replica(s)");
                let result = self.model.apply(&e.cmd);
                if e.cmd.client != 0 {
                    self.results.entry((e.cmd.client, e.cmd.seq)).or_insert(result);
                }
                self.committed.push(e);
            }
            let e = &self.committed[k - 1];
            assert_eq!((e.term, &e.cmd), (a.term, &a.cmd), "entry {k} applied differently");
            if a.client != 0 {
                assert_eq!(self.results.get(&(a.client, a.seq)), Some(&a.result));
            }
        }
        // RSTORE-2: every replica's committed entries are the oracle's.
        for r in &self.reps {
            let upto = r.commit_index().min(self.committed.len() as u64);
            for idx in r.snapshot_index() + 1..=upto {
                let want = &self.committed[idx as usize - 1];
                assert_eq!(r.entry(idx), Some(want), "replica {}'s entry {idx} differs", r.id());
            }
        }
    }

    fn leader(&mut self) -> Option<usize> {
        let ls: Vec<usize> =
            (0..self.n()).filter(|&i| self.up[i] && self.reps[i].role() == Role::Leader).collect();
        (!ls.is_empty()).then(|| ls[self.rng.below(ls.len() as u64) as usize])
    }

    fn clients_act(&mut self) {
        for c in 0..self.clients.len() {
            let (id, seq) = (self.clients[c].id, self.clients[c].seq);
            if self.clients[c].op.is_some() && self.results.contains_key(&(id, seq)) {
                self.clients[c].op = None;
                self.completed += 1;
            }
            let fresh = self.clients[c].op.is_none();
            if fresh && self.rng.chance(30) {
                let key = KEYS[self.rng.below(KEYS.len() as u64) as usize].to_string();
                let v = vec![self.rng.below(256) as u8];
                let op = match self.rng.below(4) {
                    0 => Op::Set { key, value: v },
                    1 => Op::Add { key: "n".into(), delta: 1 + self.rng.below(5) as i64 },
                    2 => Op::CompareSet { key, expected: None, value: v },
                    _ => Op::Delete { key },
                };
                self.clients[c].seq += 1;
                self.clients[c].op = Some(op);
                self.clients[c].sent_at = 0;
            }
            let retry = self.clients[c].sent_at == 0 || self.now - self.clients[c].sent_at > 15;
            if let (Some(op), true) = (self.clients[c].op.clone(), retry) {
                if let Some(l) = self.leader() {
                    let cmd = Command { client: id, seq: self.clients[c].seq, op };
                    if self.reps[l].propose(cmd).is_ok() {
                        self.clients[c].sent_at = self.now;
                        self.collect(l);
                    }
                }
            }
        }
    }

    /// RSTORE-4: a read a replica answers is the value of the last committed write.
    fn reads(&mut self) {
        for i in 0..self.n() {
            if !self.up[i] {
                continue;
            }
            let key = KEYS[self.rng.below(KEYS.len() as u64) as usize];
            if let Ok(v) = self.reps[i].read(key) {
                assert_eq!(
                    v.as_deref(),
                    self.model.get(key),
                    "replica {i} read a stale '{key}' at round {}",
                    self.now
                );
                self.reads_served += 1;
            }
        }
    }

    fn partition(&mut self, minority: &[usize]) {
        for i in 0..self.n() {
            let out = minority.contains(&i);
            self.side[i] = u8::from(out);
        }
    }

    fn heal(&mut self) {
        self.side.iter_mut().for_each(|s| *s = 0);
    }

    fn crash(&mut self, i: usize) {
        self.up[i] = false;
    }

    /// Replica `i` starts again empty, as an agent restarted on its node (RSTORE-6).
    fn amnesia(&mut self, i: usize, seed: u64) {
        let n = self.n();
        self.reps[i] = Replica::new(i, n, TIMING, seed ^ self.now).with_compaction(16).as_learner();
        self.up[i] = true;
    }

    fn restart(&mut self, i: usize) {
        self.reps[i].restart();
        self.up[i] = true;
    }
}

/// Rounds of faults (a partition of a minority, a crash of a minority, or none), each
/// followed by a healed, fully live stretch, then a last check that everything committed is
/// on every replica and that a request still commits.
fn run(n: usize, seed: u64) -> Sim {
    let mut s = Sim::new(n, seed);
    let f = (n - 1) / 2;
    for _phase in 0..6 {
        let k = 1 + s.rng.below(f as u64) as usize;
        let mut pick: Vec<usize> = (0..n).collect();
        for j in (1..n).rev() {
            let r = s.rng.below(j as u64 + 1) as usize;
            pick.swap(j, r);
        }
        let victims = pick[..k].to_vec();
        match s.rng.below(3) {
            0 => s.partition(&victims),
            1 => victims.iter().for_each(|&v| s.crash(v)),
            _ => {}
        }
        for _ in 0..150 {
            s.round();
        }
        for v in 0..n {
            if !s.up[v] {
                // Half the crashed replicas come back with their state, half without it
                // (RSTORE-6), as long as a majority keeps its state: a replica still
                // catching up after an earlier loss counts as one without, and with a
                // majority of those no leader can be elected again (safety holds, liveness
                // cannot), which is past the failures the store is built to survive.
                let stateless = s.reps.iter().filter(|r| r.is_learner()).count();
                if s.rng.chance(50) || stateless + 1 > f {
                    s.restart(v);
                } else {
                    s.amnesia(v, seed);
                }
            }
        }
        s.heal();
        for _ in 0..100 {
            s.round();
        }
    }
    // Liveness once healed: a last request commits on every replica.
    s.loss = 0;
    let before = s.committed.len();
    let mut sent = false;
    for round in 0..400 {
        s.quiet = round >= 300;
        s.round();
        if !sent {
            if let Some(l) = s.leader() {
                let cmd =
                    Command { client: 99, seq: 1, op: Op::Set { key: "z".into(), value: vec![1] } };
                sent = s.reps[l].propose(cmd).is_ok();
                s.collect(l);
            }
        }
    }
    assert!(s.committed.len() > before, "nothing committed once healed (seed {seed})");
    for r in &s.reps {
        assert_eq!(r.commit_index() as usize, s.committed.len(), "replica {} lags", r.id());
        for k in KEYS.iter().chain(&["z"]) {
            assert_eq!(r.machine().get(k), s.model.get(k), "replica {} key {k}", r.id());
        }
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// RSTORE-1 to RSTORE-6 over three replicas.
    #[test]
    fn three_replicas_keep_the_invariants_id_1_2_3_4_5_6(seed in any::<u64>()) {
        run(3, seed);
    }

    /// The same over five replicas (two may fail at once).
    #[test]
    fn five_replicas_keep_the_invariants_id_1_2_3_4_5_6(seed in any::<u64>()) {
        run(5, seed);
    }
}

/// The checks are not vacuous: over a few fixed seeds, leaders change, requests complete and
/// leaders answer reads.
#[test]
fn the_simulation_exercises_elections_commits_and_reads() {
    let (mut terms, mut completed, mut reads, mut snapshots) = (0, 0, 0, 0);
    for seed in 0..8 {
        let s = run(3, seed);
        terms += s.leaders.len();
        completed += s.completed;
        reads += s.reads_served;
        snapshots += s.snapshots;
    }
    assert!(terms > 8 * 2, "leaders changed in only {terms} terms");
    assert!(snapshots > 8, "only {snapshots} snapshots were installed");
    assert!(completed > 100 && reads > 100, "completed {completed}, reads {reads}");
}

/// RSTORE-3: two of three replicas cut off (each alone): no side commits, and reads stop
/// once the lease lapses.
#[test]
fn no_majority_no_commit_and_no_read_id_3() {
    let mut s = Sim::new(3, 7);
    while s.leader().is_none() {
        s.round();
    }
    for _ in 0..20 {
        s.round();
    }
    let l = s.leader().expect("a leader");
    s.side = vec![0, 1, 2];
    let commits: Vec<u64> = s.reps.iter().map(Replica::commit_index).collect();
    let cmd = Command { client: 50, seq: 1, op: Op::Set { key: "a".into(), value: vec![9] } };
    s.reps[l].propose(cmd).expect("still leads");
    for _ in 0..200 {
        s.round();
    }
    let after: Vec<u64> = s.reps.iter().map(Replica::commit_index).collect();
    assert_eq!(commits, after);
    assert!(s.reps.iter().all(|r| r.read("a").is_err()), "a replica cut off answered a read");
    assert!(s.reps.iter().all(|r| r.out_of_contact().is_some_and(|t| t >= 150)));
}

/// RSTORE-4: the link between the leader and one follower is cut while the other follower
/// hears both. The cut-off follower campaigns, but the one that hears the leader neither
/// votes nor takes the higher term, so the leader keeps leading, no second leader commits
/// behind its lease, and every read it answers is current (checked each round).
#[test]
fn a_follower_that_hears_the_leader_does_not_depose_it_id_4() {
    for seed in 0..16 {
        let mut s = Sim::new(3, seed);
        s.loss = 0;
        while s.leader().is_none() {
            s.round();
        }
        for _ in 0..20 {
            s.round();
        }
        let l = s.leader().expect("a leader");
        let term = s.reps[l].term();
        s.cut = vec![(l, (l + 1) % 3)];
        let served = s.reads_served;
        for _ in 0..300 {
            s.round();
        }
        assert_eq!(s.leader(), Some(l), "seed {seed}: the leader was deposed");
        assert_eq!(s.reps[l].term(), term, "seed {seed}");
        assert!(s.reads_served > served + 100, "seed {seed}: the leader stopped answering reads");
    }
}

/// RSTORE-6: entries committed on the leader and one follower only (the third cut off);
/// then the leader crashes and the follower comes back empty. The empty replica votes for
/// nobody until it caught up, so the replica that lacks the commits is not elected (which
/// `check` would catch as a committed entry applied differently); once the old leader is
/// back, a leader with every commit is elected and the empty replica catches up.
#[test]
fn an_emptied_replica_elects_no_leader_missing_commits_id_6() {
    for seed in 0..8 {
        let mut s = Sim::new(3, seed);
        s.loss = 0;
        while s.leader().is_none() {
            s.round();
        }
        for _ in 0..20 {
            s.round();
        }
        let a = s.leader().expect("a leader");
        let (b, c) = ((a + 1) % 3, (a + 2) % 3);
        let before = s.committed.len();
        s.partition(&[c]);
        for _ in 0..60 {
            s.round();
        }
        let committed = s.committed.len();
        assert!(committed > before, "seed {seed}: nothing committed on two replicas");
        s.crash(a);
        s.amnesia(b, seed);
        s.heal();
        for _ in 0..300 {
            s.round();
        }
        assert_eq!(s.leader(), None, "seed {seed}: a leader without the commits");
        s.restart(a);
        for _ in 0..300 {
            s.round();
        }
        assert!(s.leader().is_some(), "seed {seed}: no leader once the old one is back");
        assert!(!s.reps[b].is_learner(), "seed {seed}: the emptied replica never caught up");
        assert!(s.committed.len() > committed);
    }
}

/// A fixed seed whose faults once left a majority of five replicas without their state (two
/// still catching up, then a third restarted empty): no leader could be elected again. The
/// faults now keep a majority with its state, and the run ends live.
#[test]
fn a_majority_keeps_its_state_across_phases() {
    run(5, 16_273_537_939_150_559_083);
}
