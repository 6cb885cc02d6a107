//! Three replicas on this host: the store's operations, a leader's loss (failover within the
//! client's deadline, nothing committed lost), a lone replica (no answer, said so within the
//! deadline), a bad token. Every wait has a deadline.

use super::super::replica::{ReplicaServer, TICK, TIMING};
use super::super::tests::exercise;
use super::*;
use std::sync::Arc;

/// Long enough for an election on a loaded host (at most two election timeouts).
const FAILOVER: Duration = Duration::from_secs(10);

fn free_ports(n: usize) -> Vec<String> {
    let ls: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    ls.iter().map(|l| l.local_addr().unwrap().to_string()).collect()
}

fn start(addrs: &[String], token: &str) -> Vec<Option<ReplicaServer>> {
    (0..addrs.len())
        .map(|i| Some(ReplicaServer::start(i, addrs, addrs[i].as_str(), token, 7, false).unwrap()))
        .collect()
}

/// The replica that leads, waiting up to the failover deadline.
fn leader(reps: &[Option<ReplicaServer>]) -> usize {
    let t0 = Instant::now();
    loop {
        if let Some(i) = reps.iter().position(|r| r.as_ref().is_some_and(|r| r.status().leads)) {
            return i;
        }
        assert!(t0.elapsed() < FAILOVER, "no leader within {FAILOVER:?}");
        std::thread::sleep(TICK);
    }
}

#[test]
fn replicated_store_set_get_add_across_threads() {
    let addrs = free_ports(3);
    let _reps = start(&addrs, "tok");
    exercise(|| Arc::new(ReplicatedStore::new(addrs.clone(), "tok", FAILOVER).unwrap()) as _);
    let c = ReplicatedStore::new(addrs.clone(), "tok", FAILOVER).unwrap();
    assert_eq!(c.compare_set("g", None, b"1").unwrap(), (true, Some(b"1".to_vec())));
    assert_eq!(c.compare_set("g", None, b"2").unwrap(), (false, Some(b"1".to_vec())));
    c.delete("g").unwrap();
    assert!(matches!(c.get("g", Duration::from_millis(30)), Err(StoreError::Timeout { .. })));
}

/// RSTORE-2 on the network: the leader's replica stops; the client finds the new leader
/// within its deadline, and every value committed before is there.
#[test]
fn losing_the_leader_loses_no_committed_value_id_2() {
    let addrs = free_ports(3);
    let mut reps = start(&addrs, "tok");
    let c = ReplicatedStore::new(addrs.clone(), "tok", FAILOVER).unwrap();
    for i in 0..20 {
        c.set(&format!("k{i}"), &[i as u8]).unwrap();
    }
    assert_eq!(c.add("n", 5).unwrap(), 5);
    let old = leader(&reps);
    let term = reps[old].as_ref().unwrap().status().term;
    reps[old] = None;
    let t0 = Instant::now();
    assert_eq!(c.add("n", 1).unwrap(), 6);
    println!("failover: the first request after the leader stopped took {:?}", t0.elapsed());
    for i in 0..20 {
        assert_eq!(c.get(&format!("k{i}"), FAILOVER).unwrap(), vec![i as u8]);
    }
    let new = leader(&reps);
    assert_ne!(new, old);
    assert!(reps[new].as_ref().unwrap().status().term > term);
}

/// RSTORE-3 on the network: a replica left alone answers nothing; the client says so within
/// its deadline, and the replica knows how long it has been out of contact.
#[test]
fn a_lone_replica_commits_nothing_and_says_so_id_3() {
    let addrs = free_ports(3);
    let mut reps = start(&addrs, "tok");
    let c = ReplicatedStore::new(addrs.clone(), "tok", Duration::from_secs(3)).unwrap();
    c.set("a", b"1").unwrap();
    let l = leader(&reps);
    // Keep the leader alone: a lone leader loses its lease, a lone follower never wins.
    let lone = l;
    for (i, r) in reps.iter_mut().enumerate() {
        if i != lone {
            *r = None;
        }
    }
    let t0 = Instant::now();
    let e = c.set("a", b"2").unwrap_err().to_string();
    assert!(e.contains("no leader of the replicated store"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}", t0.elapsed());
    let st = reps[lone].as_ref().unwrap().status();
    assert!(!st.leads);
    let cut = st.out_of_contact.expect("it was in contact once");
    assert!(cut >= TICK * TIMING.lease as u32, "out of contact for only {cut:?}");
}

/// STORE-1 for the replicas: a client with another token is refused at once.
#[test]
fn a_bad_token_is_refused() {
    let addrs = free_ports(3);
    let _reps = start(&addrs, "secret");
    let c = ReplicatedStore::new(addrs, "secreT", FAILOVER).unwrap();
    assert!(matches!(c.set("a", b"1"), Err(StoreError::Refused(_))));
}

/// What the launch agents rely on to never both start a generation: of clients that race a
/// compare-and-set from the same value, exactly one succeeds, and each loser sees the
/// winner's value.
#[test]
fn racing_compare_sets_have_one_winner() {
    let addrs = free_ports(3);
    let _reps = start(&addrs, "tok");
    let c = ReplicatedStore::new(addrs.clone(), "tok", FAILOVER).unwrap();
    c.set("gen", b"0").unwrap();
    for round in 0..5u8 {
        let old = [b'0' + round];
        let hs: Vec<_> = (0..4u8)
            .map(|k| {
                let addrs = addrs.clone();
                std::thread::spawn(move || {
                    let c = ReplicatedStore::new(addrs, "tok", FAILOVER).unwrap();
                    let mine = [b'a' + k];
                    (mine, c.compare_set("gen", Some(&old), &mine).unwrap())
                })
            })
            .collect();
        let results: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let winners: Vec<_> = results.iter().filter(|(_, (ok, _))| *ok).collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        let won = winners[0].0.to_vec();
        for (_, (_, current)) in &results {
            assert_eq!(current.as_deref(), Some(&won[..]));
        }
        c.set("gen", &[b'0' + round + 1]).unwrap();
    }
}
