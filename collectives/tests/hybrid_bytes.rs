//! The hybrid transport counts the payload bytes it sends over each part (HYB-4). Alone in its
//! test binary: the count is the process's, and no other test's ranks may add to it.

use shardline_collectives::testing::run_ranks;
use shardline_collectives::transport::hybrid::{sent_bytes, HybridTransport};
use shardline_collectives::transport::tcp::TcpOptions;
use shardline_collectives::transport::Transport;
use shardline_collectives::{
    Algorithm, CallOptions, CommOptions, Communicator, MemStore, Store, Topology,
};
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn group(topo: &Topology, job: &str) -> Vec<Communicator> {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let mut o = CommOptions::new();
    o.timeout(WAIT);
    (0..topo.world())
        .map(|r| {
            let t = HybridTransport::new(r, topo, Arc::clone(&store), job, TcpOptions::default())
                .expect("hybrid transport");
            Communicator::new(Arc::new(t) as Arc<dyn Transport>, topo.clone(), o.clone())
                .expect("communicator")
        })
        .collect()
}

/// A 2-rank all-gather of `count` floats: each rank sends its half once, `count * 4` bytes
/// in all.
fn all_gather(topo: &Topology, job: &str, count: usize) {
    run_ranks(group(topo, job), WAIT, move |comm| {
        let lane = comm.lane("g").expect("lane");
        let mut opts = CallOptions::new();
        opts.algorithm(Algorithm::Ring);
        let mut x = vec![0.0f32; count];
        let half = count / 2;
        x[comm.rank() * half..(comm.rank() + 1) * half].fill(comm.rank() as f32 + 1.0);
        lane.all_gather_in_place_opts(x, &opts).wait_timeout(WAIT).expect("all_gather")
    });
}

#[test]
fn each_part_counts_what_it_sends_hyb_4() {
    let count = 4096;
    let before = sent_bytes();
    all_gather(&Topology::single_node(2), &format!("hb1-{}", std::process::id()), count);
    let mid = sent_bytes();
    assert_eq!((mid.0 - before.0, mid.1 - before.1), (count as u64 * 4, 0), "one node");
    all_gather(&Topology::uniform(2, 1), &format!("hb2-{}", std::process::id()), count);
    let after = sent_bytes();
    assert_eq!((after.0 - mid.0, after.1 - mid.1), (0, count as u64 * 4), "two nodes");
}
