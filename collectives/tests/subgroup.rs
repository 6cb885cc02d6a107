//! Sub-group communicators (COMM-3, GROUP-1..3): a world cut into shard groups of
//! consecutive ranks and replica groups of equal index, every op against the naive
//! reduction of its members' inputs, groups of one kind on one lane name at once without
//! mixing, over the local transport and over shm inside a node with tcp across (the hybrid
//! transport), bytes counted per group, and aborts reaching the sub-groups.

use shardline_collectives::testing::{check_close, input, naive_reduce, run_ranks};
use shardline_collectives::transport::hybrid::HybridTransport;
use shardline_collectives::transport::tcp::TcpOptions;
use shardline_collectives::transport::Transport;
use shardline_collectives::{
    local_group, local_group_with_topology, CollectiveError, CommOptions, Communicator, MemStore,
    ReduceOp, Store, Topology,
};
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// The members of rank `r`'s shard group (`size` consecutive ranks) and of its replica
/// group (the ranks of equal index in every shard group) in a world of `world`.
fn groups(world: usize, size: usize, r: usize) -> (Vec<usize>, Vec<usize>) {
    let first = r / size * size;
    let shard = (first..first + size).collect();
    let replica = (r % size..world).step_by(size).collect();
    (shard, replica)
}

/// What one rank's group computed: all-reduce, reduce-scatter and all-gather of its
/// members' inputs (seeded by world rank), and the group's members.
struct Out {
    members: Vec<usize>,
    all_reduce: Vec<f32>,
    reduce_scatter: Vec<f32>,
    all_gather: Vec<f32>,
}

/// The three ops on group `g` (lane "ops"), inputs from `seed` and the world rank; the
/// count differs per group so that mixed traffic would fail its length or tag check.
fn run_ops(g: &Communicator, world_rank: usize, members: Vec<usize>, seed: u64) -> Out {
    let lane = g.lane("ops").expect("lane");
    let n = g.world();
    let count = 24 * n + 4 * members[0];
    let ar = lane
        .all_reduce(input(seed, world_rank, count), ReduceOp::Sum)
        .wait_timeout(WAIT)
        .expect("all_reduce");
    let (_, rs) = lane
        .reduce_scatter(input(seed + 1, world_rank, count), vec![0.0; count / n], ReduceOp::Sum)
        .wait_timeout(WAIT)
        .expect("reduce_scatter");
    let (_, ag) = lane
        .all_gather(input(seed + 2, world_rank, 5), vec![0.0; 5 * n])
        .wait_timeout(WAIT)
        .expect("all_gather");
    Out { members, all_reduce: ar, reduce_scatter: rs, all_gather: ag }
}

/// Checks every rank's results against the naive reductions over its group's members.
fn check(outs: &[Out], seed: u64, what: &str) {
    for (r, o) in outs.iter().enumerate() {
        let n = o.members.len();
        let count = 24 * n + 4 * o.members[0];
        let me = o.members.iter().position(|&m| m == r).expect("a member");
        let ins = |s: u64, len: usize| -> Vec<Vec<f32>> {
            o.members.iter().map(|&m| input(s, m, len)).collect()
        };
        let ar = naive_reduce(&ins(seed, count), ReduceOp::Sum);
        check_close(&o.all_reduce, &ar, ReduceOp::Sum, n)
            .unwrap_or_else(|e| panic!("{what}: rank {r} all-reduce: {e}"));
        let rs = naive_reduce(&ins(seed + 1, count), ReduceOp::Sum);
        let slice = count / n;
        check_close(&o.reduce_scatter, &rs[me * slice..(me + 1) * slice], ReduceOp::Sum, n)
            .unwrap_or_else(|e| panic!("{what}: rank {r} reduce-scatter: {e}"));
        let ag: Vec<f32> = ins(seed + 2, 5).concat();
        assert_eq!(o.all_gather, ag, "{what}: rank {r} all-gather");
    }
}

/// Both kinds of groups of `comms` (shard groups of `size`), every op on each, the shard
/// groups' ops and the replica groups' ops issued from two threads of every rank at once.
fn shard_and_replica(comms: Vec<Communicator>, size: usize, what: &str) {
    let world = comms.len();
    let outs = run_ranks(comms, WAIT, move |comm| {
        let r = comm.rank();
        let (shard, replica) = groups(world, size, r);
        let s = comm.subgroup("shard", &shard).expect("shard group");
        let p = comm.subgroup("replica", &replica).expect("replica group");
        assert_eq!((s.rank(), s.world()), (r % size, size));
        assert_eq!((p.rank(), p.world()), (r / size, world / size));
        let on_replica = std::thread::spawn(move || run_ops(&p, r, replica, 20));
        let shard_out = run_ops(&s, r, shard, 10);
        (shard_out, on_replica.join().expect("replica thread"))
    });
    let (shard, replica): (Vec<Out>, Vec<Out>) = outs.into_iter().unzip();
    check(&shard, 10, &format!("{what}: shard groups"));
    check(&replica, 20, &format!("{what}: replica groups"));
}

/// COMM-3, GROUP-1, GROUP-2: 2 groups x 2 ranks and 3 groups x 1 rank of a local world, and
/// 2 x 3 with a replica group of 2: each group's ops equal the naive reductions over its
/// members while the other groups of its kind use the same lane name at the same time.
#[test]
fn local_subgroups_equal_naive_reductions_comm_3_group_1_group_2() {
    for (groups, size) in [(2, 2), (3, 1), (2, 3), (1, 4)] {
        let comms = local_group(groups * size).expect("local group");
        shard_and_replica(comms, size, &format!("local {groups}x{size}"));
    }
}

/// The same over the hybrid transport on 2 nodes x 2 ranks: the shard groups are the nodes
/// (shm links), the replica groups cross them (tcp links); and with ranks alternating
/// between nodes, so that each group mixes both.
#[test]
fn hybrid_subgroups_over_shm_and_tcp_equal_naive_reductions_group_1_group_2() {
    for topo in [Topology::uniform(2, 2), Topology::from_nodes(vec![0, 1, 0, 1])] {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let job = format!("sub{}-{}", std::process::id(), topo.node_of(1));
        let mut o = CommOptions::new();
        o.timeout(WAIT);
        let comms = (0..topo.world())
            .map(|r| {
                let t =
                    HybridTransport::new(r, &topo, Arc::clone(&store), &job, TcpOptions::default())
                        .expect("hybrid transport");
                Communicator::new(Arc::new(t) as Arc<dyn Transport>, topo.clone(), o.clone())
                    .expect("communicator")
            })
            .collect();
        shard_and_replica(comms, 2, &format!("hybrid {topo:?}"));
    }
}

/// COMM-3: a sub-group's topology is its members' part of the parent's, and its bytes are
/// counted apart from the parent's.
#[test]
fn subgroup_topology_and_bytes_are_its_own_comm_3() {
    let topo = Topology::uniform(2, 2);
    let comms = local_group_with_topology(topo, CommOptions::new()).expect("local group");
    let outs = run_ranks(comms, WAIT, |comm| {
        let r = comm.rank();
        let (shard, replica) = groups(4, 2, r);
        let s = comm.subgroup("shard", &shard).expect("shard group");
        let p = comm.subgroup("replica", &replica).expect("replica group");
        let lane = s.lane("x").expect("lane");
        lane.all_reduce(vec![1.0; 256], ReduceOp::Sum).wait_timeout(WAIT).expect("all_reduce");
        (
            s.topology().clone(),
            p.topology().clone(),
            s.bytes_sent(),
            p.bytes_sent(),
            comm.bytes_sent(),
        )
    });
    for (r, (st, pt, sb, pb, wb)) in outs.into_iter().enumerate() {
        assert_eq!(st, Topology::single_node(2), "rank {r}: a shard group lies in one node");
        assert_eq!(pt, Topology::uniform(2, 1), "rank {r}: a replica group spans both nodes");
        assert!(sb >= 512, "rank {r}: the shard group sent {sb} bytes");
        assert_eq!((pb, wb), (0, 0), "rank {r}: nothing on the replica group or the parent");
    }
}

/// COMM-3: aborting the parent fails an op pending on a sub-group; a bad member list is an
/// argument error.
#[test]
fn aborting_the_parent_aborts_its_subgroups_comm_3() {
    // Rank 1 keeps its endpoint open until rank 0's op has ended.
    let done = Arc::new(std::sync::Barrier::new(2));
    let outs = run_ranks(local_group(2).expect("local group"), WAIT, move |comm| {
        let r = comm.rank();
        let bad = comm.subgroup("pair", &[r, r]).err();
        let g = comm.subgroup("pair", &[0, 1]).expect("group");
        let lane = g.lane("x").expect("lane");
        if r == 0 {
            // Rank 1 never joins: only the abort ends the op.
            let w = lane.all_reduce(vec![1.0; 4], ReduceOp::Sum);
            comm.abort("stop");
            let res = w.wait_timeout(WAIT);
            done.wait();
            (bad, Some(res))
        } else {
            done.wait();
            (bad, None)
        }
    });
    for (bad, _) in &outs {
        assert!(matches!(bad, Some(CollectiveError::InvalidArgument(_))), "{bad:?}");
    }
    match &outs[0].1 {
        Some(Err(CollectiveError::Aborted { reason, .. })) => assert_eq!(reason, "stop"),
        other => panic!("rank 0's op: {other:?}"),
    }
}

/// `Communicator::waits` covers the sub-groups (COMM-3): rank 0 waiting in a sub-group's
/// all-reduce that rank 1 has not entered shows on rank 0's world communicator, with nothing
/// ended; once both ran it, an op has ended and none runs.
#[test]
fn waits_cover_the_sub_groups_comm_3() {
    let comms = local_group(2).expect("group");
    let subs: Vec<Communicator> =
        comms.iter().map(|c| c.subgroup("g", &[0, 1]).expect("subgroup")).collect();
    assert_eq!(comms[0].waits(), (false, None), "nothing issued");
    let s0 = subs[0].clone();
    let t = std::thread::spawn(move || {
        let lane = s0.lane("ops").expect("lane");
        lane.all_reduce(vec![1.0; 4], ReduceOp::Sum).wait_timeout(WAIT).expect("all_reduce")
    });
    let until = std::time::Instant::now() + WAIT;
    while comms[0].waits().1.is_none_or(|w| w < Duration::from_millis(50)) {
        assert!(std::time::Instant::now() < until, "rank 0's wait never showed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!comms[0].waits().0, "nothing ended yet");
    assert_eq!(comms[1].waits(), (false, None), "rank 1 waits in nothing");
    let lane = subs[1].lane("ops").expect("lane");
    let r1 = lane.all_reduce(vec![2.0; 4], ReduceOp::Sum).wait_timeout(WAIT).expect("all_reduce");
    assert_eq!((t.join().expect("rank 0"), r1), (vec![3.0; 4], vec![3.0; 4]));
    for c in &comms {
        assert_eq!(c.waits(), (true, None), "rank {}", c.rank());
    }
}
