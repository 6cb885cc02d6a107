//! Failure semantics (LANE-2, LANE-3, COMM-1, FP-2, LOCAL-3): each case must end well inside
//! its own deadline with the documented error on every rank.

use shardline_collectives::testing::run_ranks;
use shardline_collectives::{
    local_group_with_topology, Algorithm, CallOptions, CollectiveError, CommOptions, ReduceOp,
    Topology,
};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

fn group(world: usize, timeout: Duration) -> Vec<shardline_collectives::Communicator> {
    let mut o = CommOptions::new();
    o.timeout(timeout);
    local_group_with_topology(Topology::single_node(world), o).expect("group")
}

/// FP-2 / LANE-3: rank 1 issues another count; every rank gets Mismatch naming both ops,
/// long before the op timeout.
/// LANE-1: ranks that issue different ops are told so by the fingerprint check.
#[test]
fn mismatch_reaches_every_rank() {
    for algo in [Algorithm::Direct, Algorithm::Ring] {
        let start = Instant::now();
        let comms = group(4, Duration::from_secs(20));
        let errs = run_ranks(comms, WAIT, move |comm| {
            let lane = comm.lane("mm").expect("lane");
            let mut o = CallOptions::new();
            o.algorithm(algo);
            let count = if comm.rank() == 1 { 50 } else { 100 };
            let e = lane.all_reduce_opts(vec![1.0; count], ReduceOp::Sum, &o).wait_timeout(WAIT);
            let e = e.expect_err("mismatched op must fail");
            // LANE-2: the lane stays failed.
            let later = lane.barrier().wait_timeout(WAIT).expect_err("failed lane");
            assert_eq!(later, e);
            e
        });
        for (r, e) in errs.iter().enumerate() {
            match e {
                CollectiveError::Mismatch { rank, ours, theirs, .. } => {
                    assert_eq!(*rank, r);
                    let both = format!("{ours} {theirs}");
                    assert!(
                        both.contains("count=50") && both.contains("count=100"),
                        "rank {r}: {e}"
                    );
                }
                other => panic!("{algo:?} rank {r}: expected Mismatch, got {other}"),
            }
        }
        assert!(start.elapsed() < Duration::from_secs(15), "mismatch was found by timing out");
    }
}

/// A different kind of op is also a mismatch (not a hang, not wrong data).
#[test]
fn mismatched_kind_is_detected() {
    let comms = group(3, Duration::from_secs(20));
    let errs = run_ranks(comms, WAIT, |comm| {
        let lane = comm.lane("kind").expect("lane");
        if comm.rank() == 2 {
            lane.broadcast(vec![0.0; 4], 0).wait_timeout(WAIT).map(|_| ())
        } else {
            lane.all_reduce(vec![0.0; 4], ReduceOp::Sum).wait_timeout(WAIT).map(|_| ())
        }
    });
    for (r, e) in errs.iter().enumerate() {
        assert!(matches!(e, Err(CollectiveError::Mismatch { .. })), "rank {r}: {e:?}");
    }
}

/// Rank 3 never issues: the others get Timeout naming rank 3 (LANE-4, LOCAL-4), with Direct
/// (everyone waits on rank 3) and Ring (ranks 1 and 2 wait on ranks that wait on rank 3).
#[test]
fn timeout_names_the_missing_rank() {
    for algo in [Algorithm::Direct, Algorithm::Ring] {
        let comms = group(4, Duration::from_millis(500));
        let errs = run_ranks(comms, WAIT, move |comm| {
            let lane = comm.lane("to").expect("lane");
            if comm.rank() == 3 {
                // Alive but silent: keep the communicator open past the others' deadline.
                std::thread::sleep(Duration::from_millis(1500));
                return None;
            }
            let mut o = CallOptions::new();
            o.algorithm(algo);
            let w = lane.all_reduce_opts(vec![1.0; 1000], ReduceOp::Sum, &o);
            Some(w.wait_timeout(WAIT).expect_err("must time out"))
        });
        for (r, e) in errs.iter().enumerate().take(3) {
            match e {
                Some(CollectiveError::Timeout { peer: 3, lane, seq: 0, .. }) => {
                    assert_eq!(lane, "to")
                }
                other => panic!("{algo:?} rank {r}: expected Timeout naming rank 3, got {other:?}"),
            }
        }
    }
}

/// COMM-1: abort fails the pending op and every later op with Aborted.
#[test]
fn abort_fails_pending_and_later_ops() {
    let comms = group(2, Duration::from_secs(20));
    let start = Instant::now();
    run_ranks(comms, WAIT, move |comm| {
        let lane = comm.lane("ab").expect("lane");
        if comm.rank() == 1 {
            // Never joins; rank 0's op stays pending until the abort. Keep the comm alive
            // until rank 0 has seen its error.
            std::thread::sleep(Duration::from_millis(300));
            return;
        }
        let pending = lane.all_reduce(vec![1.0; 1000], ReduceOp::Sum);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!pending.is_done());
        comm.abort("test abort");
        match pending.wait_timeout(WAIT) {
            Err(CollectiveError::Aborted { reason, .. }) => assert_eq!(reason, "test abort"),
            other => panic!("pending op: expected Aborted, got {other:?}"),
        }
        let later = comm.lane("other").expect("lane").barrier().wait_timeout(WAIT);
        assert!(matches!(later, Err(CollectiveError::Aborted { .. })), "{later:?}");
        let later = lane.all_reduce(vec![1.0], ReduceOp::Sum).wait_timeout(WAIT);
        assert!(matches!(later, Err(CollectiveError::Aborted { .. })), "{later:?}");
    });
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// LOCAL-3: a rank drops its communicator mid-collective; the others get PeerLost naming it.
#[test]
fn dropped_peer_is_lost() {
    let comms = group(3, Duration::from_secs(20));
    let start = Instant::now();
    let errs = run_ranks(comms, WAIT, |comm| {
        let lane = comm.lane("lost").expect("lane");
        // One op together, so everyone is in the lane before rank 2 leaves.
        lane.barrier().wait_timeout(WAIT).expect("barrier");
        if comm.rank() == 2 {
            drop(lane);
            drop(comm);
            return None;
        }
        let mut o = CallOptions::new();
        o.algorithm(Algorithm::Ring);
        Some(
            lane.all_reduce_opts(vec![1.0; 100_000], ReduceOp::Sum, &o)
                .wait_timeout(WAIT)
                .expect_err("peer gone"),
        )
    });
    for (r, e) in errs.iter().enumerate().take(2) {
        match e {
            Some(CollectiveError::PeerLost { rank: 2, .. }) => {}
            other => panic!("rank {r}: expected PeerLost of rank 2, got {other:?}"),
        }
    }
    assert!(start.elapsed() < Duration::from_secs(15), "loss was found by timing out");
}

/// FP-1: ranks that disagree on the record length of all_reduce_records get Mismatch.
#[test]
fn records_with_different_record_len_mismatch() {
    fn keep(_acc: &mut [f32], _other: &[f32]) {}
    let comms = group(2, Duration::from_secs(20));
    let errs = run_ranks(comms, WAIT, |comm| {
        let lane = comm.lane("rec").expect("lane");
        let len = if comm.rank() == 0 { 2 } else { 3 };
        lane.all_reduce_records(vec![0.0; 6], len, keep).wait_timeout(WAIT).map(|_| ())
    });
    for (r, e) in errs.iter().enumerate() {
        match e {
            Err(CollectiveError::Mismatch { ours, theirs, .. }) => {
                assert!(ours.contains("record_len") && theirs.contains("record_len"), "rank {r}")
            }
            other => panic!("rank {r}: expected Mismatch, got {other:?}"),
        }
    }
}
