//! Conformance grid over the local transport (ALGO-3, ALGO-4 end to end), determinism, and
//! hierarchical schedules on a simulated multi-node topology.

use shardline_collectives::testing::{
    check_close, conformance_grid, input, naive_reduce, run_ranks, GridConfig,
};
use shardline_collectives::{
    local_group, local_group_with_topology, Algorithm, CallOptions, CommOptions, ReduceOp, Topology,
};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn opts() -> CommOptions {
    let mut o = CommOptions::new();
    o.timeout(Duration::from_secs(60));
    o
}

/// LANE-7 (in-place and out-of-place forms, mixed across ranks) and LOCAL-1 over the whole grid;
/// LOCAL-2: worlds up to 8 share the machine's cores, which a busy-looping wait would starve.
#[test]
fn local_conformance_grid() {
    let factory = |w: usize| {
        local_group_with_topology(Topology::single_node(w), opts()).expect("local group")
    };
    conformance_grid(&factory, &GridConfig::default());
}

/// ALGO-3: the same op twice gives bitwise-identical results, identical on all ranks.
#[test]
fn all_reduce_is_deterministic_and_identical_on_all_ranks() {
    for algo in [Algorithm::Ring, Algorithm::Direct, Algorithm::Auto] {
        let comms = local_group(5).expect("group");
        let outs = run_ranks(comms, WAIT, move |comm| {
            let lane = comm.lane("det").expect("lane");
            let mut o = CallOptions::new();
            o.algorithm(algo);
            let x = input(42, comm.rank(), 10_007);
            let a = lane
                .all_reduce_opts(x.clone(), ReduceOp::Sum, &o)
                .wait_timeout(WAIT)
                .expect("first");
            let b = lane.all_reduce_opts(x, ReduceOp::Sum, &o).wait_timeout(WAIT).expect("second");
            assert!(
                a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "run to run differs"
            );
            a
        });
        for o in &outs[1..] {
            assert!(
                o.iter().zip(&outs[0]).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{algo:?}: ranks differ"
            );
        }
    }
}

#[test]
fn hierarchical_two_nodes_by_two_matches_naive() {
    for topo in [Topology::uniform(2, 2), Topology::from_nodes(vec![0, 1, 0, 1])] {
        let comms = local_group_with_topology(topo, opts()).expect("group");
        run_ranks(comms, WAIT, |comm| {
            let (rank, world) = (comm.rank(), comm.world());
            let lane = comm.lane("hier").expect("lane");
            let mut o = CallOptions::new();
            o.algorithm(Algorithm::Hierarchical);
            for count in [0usize, 1, 3, 997, 100_003] {
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                    let ins: Vec<_> = (0..world).map(|r| input(count as u64, r, count)).collect();
                    let got = lane
                        .all_reduce_opts(ins[rank].clone(), op, &o)
                        .wait_timeout(WAIT)
                        .expect("all_reduce");
                    check_close(&got, &naive_reduce(&ins, op), op, world)
                        .expect("all_reduce result");
                    let rs: Vec<_> =
                        (0..world).map(|r| input(count as u64 + 1, r, world * count)).collect();
                    let (_, got) = lane
                        .reduce_scatter_opts(rs[rank].clone(), vec![0.0; count], op, &o)
                        .wait_timeout(WAIT)
                        .expect("reduce_scatter");
                    let want = naive_reduce(&rs, op);
                    check_close(&got, &want[rank * count..(rank + 1) * count], op, world)
                        .expect("reduce_scatter result");
                    let got = lane
                        .reduce_scatter_in_place_opts(rs[rank].clone(), op, &o)
                        .wait_timeout(WAIT)
                        .expect("reduce_scatter_in_place");
                    let mine = rank * count..(rank + 1) * count;
                    check_close(&got[mine.clone()], &want[mine], op, world)
                        .expect("reduce_scatter_in_place result");
                }
                let shards: Vec<_> = (0..world).map(|r| input(9, r, count)).collect();
                let (_, full) = lane
                    .all_gather_opts(shards[rank].clone(), vec![0.0; world * count], &o)
                    .wait_timeout(WAIT)
                    .expect("all_gather");
                assert_eq!(full, shards.concat(), "all_gather follows global rank");
                let mut buf = vec![f32::NAN; world * count];
                buf[rank * count..(rank + 1) * count].copy_from_slice(&shards[rank]);
                let full = lane
                    .all_gather_in_place_opts(buf, &o)
                    .wait_timeout(WAIT)
                    .expect("all_gather_in_place");
                assert_eq!(full, shards.concat(), "in-place all_gather follows global rank");
            }
            // Auto picks Hierarchical for large buffers on a multi-node topology.
            let ins: Vec<_> = (0..world).map(|r| input(77, r, 50_000)).collect();
            let got =
                lane.all_reduce(ins[rank].clone(), ReduceOp::Sum).wait_timeout(WAIT).expect("auto");
            check_close(&got, &naive_reduce(&ins, ReduceOp::Sum), ReduceOp::Sum, world)
                .expect("auto result");
        });
    }
}

/// all_reduce_records folds in rank order 0..W-1 with the user combine (ALGO-3).
#[test]
fn records_fold_in_rank_order() {
    fn combine(acc: &mut [f32], other: &[f32]) {
        // Not commutative: exposes the fold order.
        acc[0] = acc[0] * 10.0 + other[0];
        acc[1] += other[1];
    }
    let comms = local_group(4).expect("group");
    let outs = run_ranks(comms, WAIT, |comm| {
        let lane = comm.lane("bn").expect("lane");
        let r = comm.rank() as f32;
        let buf = vec![r + 1.0, r, r + 1.0, 2.0 * r];
        lane.all_reduce_records(buf, 2, combine).wait_timeout(WAIT).expect("records")
    });
    for o in outs {
        assert_eq!(o, vec![1234.0, 6.0, 1234.0, 12.0]);
    }
}

/// Many lanes run concurrently and keep their own order; buffers round-trip through the pool
/// without new allocations in steady state.
/// EXEC-2 and POOL: a steady state allocates no new buffers.
#[test]
fn lanes_run_concurrently_and_pool_reaches_steady_state() {
    let comms = local_group(3).expect("group");
    run_ranks(comms, WAIT, |comm| {
        let a = comm.lane("a").expect("lane a");
        let b = comm.lane("b").expect("lane b");
        let world = comm.world() as f32;
        let mut allocs_after_warmup = 0;
        for it in 0..20 {
            let x = comm.pool().take(4096);
            let y = comm.pool().take(100);
            let mut x = x;
            x.fill(1.0);
            let mut y = y;
            y.fill(2.0);
            let wa = a.all_reduce(x, ReduceOp::Sum);
            let wb = b.all_reduce(y, ReduceOp::Max);
            let x = wa.wait_timeout(WAIT).expect("a");
            let y = wb.wait_timeout(WAIT).expect("b");
            assert!(x.iter().all(|&v| v == world) && y.iter().all(|&v| v == 2.0));
            comm.pool().give(x);
            comm.pool().give(y);
            if it == 1 {
                allocs_after_warmup = comm.pool().allocations();
            }
        }
        assert_eq!(
            comm.pool().allocations(),
            allocs_after_warmup,
            "pool allocated in steady state"
        );
    });
}

#[test]
fn invalid_arguments_fail_before_io() {
    let comms = local_group(2).expect("group");
    run_ranks(comms, WAIT, |comm| {
        let lane = comm.lane("args").expect("lane");
        let e = lane.reduce_scatter(vec![0.0; 5], vec![0.0; 2], ReduceOp::Sum).wait_timeout(WAIT);
        assert!(matches!(e, Err(shardline_collectives::CollectiveError::InvalidArgument(_))));
        let e = lane.all_gather_in_place(vec![0.0; 5]).wait_timeout(WAIT);
        assert!(matches!(e, Err(shardline_collectives::CollectiveError::InvalidArgument(_))));
        let e = lane.reduce_scatter_in_place(vec![0.0; 5], ReduceOp::Sum).wait_timeout(WAIT);
        assert!(matches!(e, Err(shardline_collectives::CollectiveError::InvalidArgument(_))));
        let e = lane.broadcast(vec![0.0; 5], 9).wait_timeout(WAIT);
        assert!(matches!(e, Err(shardline_collectives::CollectiveError::InvalidArgument(_))));
        // The lane still works afterwards.
        lane.barrier().wait_timeout(WAIT).expect("barrier");
    });
}

#[test]
fn work_is_a_future() {
    let comms = local_group(2).expect("group");
    run_ranks(comms, WAIT, |comm| {
        let lane = comm.lane("fut").expect("lane");
        let w = lane.all_reduce(vec![1.0; 8], ReduceOp::Sum);
        let out = block_on(w).expect("future");
        assert_eq!(out, vec![2.0; 8]);
    });
}

/// Minimal executor: parks the thread until woken (the lane completes the op).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    let end = std::time::Instant::now() + WAIT;
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        assert!(std::time::Instant::now() < end, "future did not complete in time");
        std::thread::park_timeout(Duration::from_millis(100));
    }
}

/// LANE-5: dropping every handle joins the lane threads (no thread outlives its group).
#[test]
fn dropping_the_group_joins_lane_threads() {
    fn lane_threads(prefix: &str) -> usize {
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return 0 };
        dir.filter_map(|e| e.ok())
            .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
            .filter(|c| c.trim_end().starts_with(prefix))
            .count()
    }
    let comms = local_group(3).expect("group");
    let lanes: Vec<_> = comms.iter().map(|c| c.lane("lk").expect("lane")).collect();
    let works: Vec<_> = lanes.iter().map(|l| l.barrier()).collect();
    for w in works {
        w.wait_timeout(WAIT).expect("barrier");
    }
    if std::path::Path::new("/proc/self/task").exists() {
        // A thread takes its name when it first runs, and an op may complete on its caller
        // (LANE-6), so on a loaded machine a lane thread can still carry its parent's name here.
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while lane_threads("lane-lk-") < 3 && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(lane_threads("lane-lk-"), 3);
    }
    drop(lanes);
    drop(comms);
    // The drop joined the threads. A joined thread's /proc entry goes a moment after the join
    // returns (the kernel wakes the joiner before it finishes removing the task), so a
    // loaded machine may still list it briefly; one that outlived its group stays.
    let end = std::time::Instant::now() + Duration::from_secs(2);
    while lane_threads("lane-lk-") > 0 && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(lane_threads("lane-lk-"), 0, "lane threads survived their communicators");
}

/// Lanes are independent: an op pending on lane "a" does not hold back lane "b".
/// COMM-2: a second `lane(name)` is the same lane: ops issued through either handle take
/// one sequence, so ranks may mix the handles.
#[test]
fn the_same_name_opens_the_same_lane() {
    let comms = local_group(2).expect("group");
    run_ranks(comms, WAIT, |comm| {
        let first = comm.lane("x").expect("lane x");
        let again = comm.lane("x").expect("lane x again");
        let (a, b) = if comm.rank() == 0 { (&first, &again) } else { (&again, &first) };
        let got = a.all_reduce(vec![1.0; 8], ReduceOp::Sum).wait_timeout(WAIT).expect("first op");
        assert_eq!(got, vec![2.0; 8]);
        let got = b.all_reduce(vec![3.0; 8], ReduceOp::Sum).wait_timeout(WAIT).expect("second op");
        assert_eq!(got, vec![6.0; 8]);
    });
}

#[test]
fn a_pending_lane_does_not_block_another() {
    let comms = local_group(2).expect("group");
    run_ranks(comms, WAIT, |comm| {
        let a = comm.lane("a").expect("lane a");
        let b = comm.lane("b").expect("lane b");
        if comm.rank() == 0 {
            let wa = a.all_reduce(vec![1.0; 64], ReduceOp::Sum);
            let got = b.all_reduce(vec![2.0; 64], ReduceOp::Sum).wait_timeout(WAIT).expect("b");
            assert_eq!(got, vec![4.0; 64]);
            assert_eq!(wa.wait_timeout(WAIT).expect("a"), vec![2.0; 64]);
        } else {
            let got = b.all_reduce(vec![2.0; 64], ReduceOp::Sum).wait_timeout(WAIT).expect("b");
            assert_eq!(got, vec![4.0; 64]);
            let got = a.all_reduce(vec![1.0; 64], ReduceOp::Sum).wait_timeout(WAIT).expect("a");
            assert_eq!(got, vec![2.0; 64]);
        }
    });
}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync + Clone>() {}
    check::<shardline_collectives::Communicator>();
    check::<shardline_collectives::Lane>();
    fn send<T: Send>() {}
    send::<shardline_collectives::Work<Vec<f32>>>();
}

/// A timeout of `Duration::MAX` means "no limit" and must not overflow the deadline.
#[test]
fn unbounded_timeout_is_accepted() {
    let mut o = CommOptions::new();
    o.timeout(Duration::MAX);
    let comms = local_group_with_topology(Topology::single_node(2), o).expect("group");
    run_ranks(comms, WAIT, |comm| {
        let lane = comm.lane("max").expect("lane");
        let mut c = CallOptions::new();
        c.timeout(Duration::MAX);
        let got = lane.all_reduce_opts(vec![1.0; 3], ReduceOp::Sum, &c).wait_timeout(Duration::MAX);
        assert_eq!(got.expect("op"), vec![2.0; 3]);
    });
}

/// LANE-6: a blocking small op runs on the caller when the lane is idle, and queues behind a
/// pending op otherwise; either way results and issue order are those of the queued path.
/// LANE-1: ops complete in issue order.
#[test]
fn blocking_small_ops_keep_issue_order_and_results() {
    let comms = local_group(3).expect("group");
    run_ranks(comms, WAIT, |comm| {
        let lane = comm.lane("inline").expect("lane");
        let mut now = CallOptions::new();
        now.blocking(true);
        let r = comm.rank() as f32;
        // Idle lane: runs inline, completes before the call returns.
        let w = lane.all_reduce_opts(vec![r; 16], ReduceOp::Sum, &now);
        assert!(w.is_done(), "a blocking small op on an idle lane is complete on return");
        assert_eq!(w.wait_timeout(WAIT).expect("inline"), vec![3.0; 16]);
        // Busy lane: a large op is queued first; the blocking one must queue behind it.
        let big = lane.all_reduce(vec![1.0; 1 << 18], ReduceOp::Sum);
        let small = lane.all_reduce_opts(vec![r + 1.0; 4], ReduceOp::Max, &now);
        assert_eq!(small.wait_timeout(WAIT).expect("small"), vec![3.0; 4]);
        assert!(big.is_done(), "the earlier op completed first (issue order)");
        assert_eq!(big.wait_timeout(WAIT).expect("big"), vec![3.0; 1 << 18]);
    });
}
