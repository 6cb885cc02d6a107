//! The hybrid transport (shm inside a node, tcp across nodes) on simulated multi-node
//! topologies, ranks as threads sharing a `MemStore`: the conformance grid against the naive
//! reference, equality with the single-node result, determinism, and errors naming global
//! ranks.

use shardline_collectives::testing::{
    check_close, conformance_grid, input, naive_reduce, run_ranks, GridConfig,
};
use shardline_collectives::transport::hybrid::HybridTransport;
use shardline_collectives::transport::tcp::TcpOptions;
use shardline_collectives::transport::Transport;
use shardline_collectives::{
    local_group_with_topology, Algorithm, CallOptions, CollectiveError, CommOptions, Communicator,
    MemStore, ReduceOp, Store, Topology,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn opts(timeout: Duration) -> CommOptions {
    let mut o = CommOptions::new();
    o.timeout(timeout);
    o
}

/// A job name per group, so that groups of one test process never share store keys.
fn job() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("hyb{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

fn hybrid_group(topo: &Topology, timeout: Duration) -> Vec<Communicator> {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let job = job();
    (0..topo.world())
        .map(|r| {
            let t = HybridTransport::new(r, topo, Arc::clone(&store), &job, TcpOptions::default())
                .expect("hybrid transport");
            Communicator::new(Arc::new(t) as Arc<dyn Transport>, topo.clone(), opts(timeout))
                .expect("communicator")
        })
        .collect()
}

/// Ranks alternate between two nodes, so that every step of a flat ring mixes a shm peer
/// and a tcp peer (HYB-2); hierarchical schedules see a uniform topology when W is even.
fn interleaved(world: usize) -> Topology {
    Topology::from_nodes((0..world).map(|r| r % 2).collect())
}

/// HYB-1, HYB-2, HYB-3: every op over hybrid links against the naive reference.
#[test]
fn hybrid_conformance_grid_interleaved_nodes() {
    let factory = |w: usize| hybrid_group(&interleaved(w), WAIT);
    let cfg = GridConfig {
        worlds: vec![1, 2, 3, 4, 5],
        algorithms: vec![Algorithm::Ring, Algorithm::Direct, Algorithm::Auto],
        large_count: 200_003,
        large_worlds: vec![3, 4],
        large_direct_max_world: 4,
        deadline: Duration::from_secs(240),
    };
    conformance_grid(&factory, &cfg);
}

/// Blocks of ranks per node: hierarchical steps touch one part only, flat rings cross nodes
/// once per direction.
#[test]
fn hybrid_conformance_grid_block_nodes_with_hierarchical() {
    let factory = |w: usize| {
        let per = w.div_ceil(2).max(1);
        hybrid_group(&Topology::from_nodes((0..w).map(|r| r / per).collect()), WAIT)
    };
    let cfg = GridConfig {
        worlds: vec![2, 4, 6],
        algorithms: vec![Algorithm::Hierarchical, Algorithm::Ring, Algorithm::Auto],
        large_count: 200_003,
        large_worlds: vec![4],
        large_direct_max_world: 4,
        deadline: Duration::from_secs(240),
    };
    conformance_grid(&factory, &cfg);
}

/// Results over 2 nodes x 2 ranks (Auto picks the hierarchical schedule) equal the
/// single-node result within float tolerance, are identical on every rank, and are bitwise
/// the same from run to run (ALGO-3 over the hybrid transport).
#[test]
fn two_nodes_match_single_node_and_are_deterministic() {
    let count = 300_007;
    let world = 4;
    let single = run_ranks(
        local_group_with_topology(Topology::single_node(world), opts(WAIT)).expect("local group"),
        WAIT,
        move |comm| {
            let lane = comm.lane("eq").expect("lane");
            let x = input(9, comm.rank(), count);
            lane.all_reduce(x, ReduceOp::Sum).wait_timeout(WAIT).expect("all_reduce")
        },
    );
    for topo in [Topology::uniform(2, 2), interleaved(world)] {
        let outs = run_ranks(hybrid_group(&topo, WAIT), WAIT, move |comm| {
            let lane = comm.lane("eq").expect("lane");
            let mut runs = Vec::new();
            for _ in 0..2 {
                let x = input(9, comm.rank(), count);
                runs.push(
                    lane.all_reduce(x, ReduceOp::Sum).wait_timeout(WAIT).expect("all_reduce"),
                );
            }
            runs
        });
        let want: Vec<f64> = single[0].iter().map(|&v| v as f64).collect();
        let ins: Vec<Vec<f32>> = (0..world).map(|r| input(9, r, count)).collect();
        let naive = naive_reduce(&ins, ReduceOp::Sum);
        for (rank, runs) in outs.iter().enumerate() {
            assert!(
                runs[0].iter().zip(&runs[1]).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{topo:?}: rank {rank} differs from run to run"
            );
            assert!(
                runs[0].iter().zip(&outs[0][0]).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{topo:?}: rank {rank} differs from rank 0"
            );
            check_close(&runs[0], &want, ReduceOp::Sum, world)
                .unwrap_or_else(|e| panic!("{topo:?} vs single node: {e}"));
            check_close(&runs[0], &naive, ReduceOp::Sum, world)
                .unwrap_or_else(|e| panic!("{topo:?} vs naive: {e}"));
        }
    }
}

/// HYB-1: a rank that never joins is named by its global rank, whether it is reached over
/// shm (same node) or tcp (other node).
#[test]
fn missing_rank_is_named_by_global_rank() {
    let topo = Topology::uniform(2, 2);
    for absent in [1usize, 2] {
        let mut comms = hybrid_group(&topo, Duration::from_secs(2));
        // The absent rank's transport stays alive (so its addresses resolve) but never
        // issues the op.
        let idle = comms.remove(absent);
        let present: Vec<usize> = (0..4).filter(|&r| r != absent).collect();
        let lane_idle = std::thread::spawn(move || {
            let lane = idle.lane("miss");
            (idle, lane.is_ok())
        });
        let outs = run_ranks(comms, WAIT, move |comm| {
            let lane = comm.lane("miss").expect("lane");
            let mut o = CallOptions::new();
            o.algorithm(Algorithm::Ring).timeout(Duration::from_secs(2));
            lane.all_reduce_opts(vec![1.0; 1000], ReduceOp::Sum, &o).wait_timeout(WAIT)
        });
        let (_idle, opened) = lane_idle.join().expect("idle rank thread");
        assert!(opened, "the idle rank opens the lane");
        let mut errors = Vec::new();
        for (r, out) in present.iter().zip(outs) {
            let e = out.expect_err("an op missing a rank must fail");
            // Every error names a real global rank (never a local index or a placeholder).
            if let CollectiveError::Timeout { peer, .. } = &e {
                assert!(*peer < 4, "rank {r}: timeout names no real rank: {e}");
            }
            errors.push((*r, e));
        }
        // The rank after the absent one waits for its data and names it by its global rank,
        // unless a poison forwarded from a rank whose own wait expired at the same deadline
        // (every rank issued at the same time) reached it first: then that rank's cause is
        // reported, which names a present rank. Either way it fails, by the deadline.
        let succ = (absent + 1) % 4;
        let (_, e) = errors.iter().find(|(r, _)| *r == succ).expect("successor ran");
        let named = matches!(e, CollectiveError::Timeout { peer, .. } if *peer == absent)
            || e.to_string().contains(&format!("rank {absent} "));
        let forwarded =
            matches!(e, CollectiveError::Timeout { peer, .. } if present.contains(peer));
        assert!(named || forwarded, "rank {succ} should name rank {absent}: {e}");
    }
}
