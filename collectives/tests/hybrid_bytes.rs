//! The hybrid transport counts the payload bytes it sends over each part (HYB-4). Alone in its
//! test binary: the count is the process's, and no other test's ranks may add to it.

use shardline_collectives::testing::run_ranks;
use shardline_collectives::transport::hybrid::{
    sent_bytes, sent_gather_bytes_across, HybridTransport,
};
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
fn all_gather(topo: &Topology, job: &str, lane: &'static str, count: usize) {
    run_ranks(group(topo, job), WAIT, move |comm| {
        let lane = comm.lane(lane).expect("lane");
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
    let pid = std::process::id();
    let before = (sent_bytes(), sent_gather_bytes_across());
    all_gather(&Topology::single_node(2), &format!("hb1-{pid}"), "g", count);
    let mid = (sent_bytes(), sent_gather_bytes_across());
    assert_eq!((mid.0 .0 - before.0 .0, mid.0 .1 - before.0 .1), (count as u64 * 4, 0), "one node");
    all_gather(&Topology::uniform(2, 1), &format!("hb2-{pid}"), "g", count);
    let after = (sent_bytes(), sent_gather_bytes_across());
    assert_eq!((after.0 .0 - mid.0 .0, after.0 .1 - mid.0 .1), (0, count as u64 * 4), "two nodes");
    // Not a gather lane: nothing counted apart.
    assert_eq!(after.1, mid.1, "lane 'g' is no gather lane");
    // Gather lanes, plain and a sub-group's: their bytes across nodes counted apart too.
    all_gather(&Topology::uniform(2, 1), &format!("hb3-{pid}"), "gather", count);
    all_gather(&Topology::uniform(2, 1), &format!("hb4-{pid}"), "shard:gather", count);
    let last = (sent_bytes(), sent_gather_bytes_across());
    assert_eq!(last.0 .1 - after.0 .1, 2 * count as u64 * 4, "two nodes, gather lanes");
    assert_eq!(last.1 - after.1, 2 * count as u64 * 4, "counted apart");
}
