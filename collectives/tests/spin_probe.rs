//! Measures what spinning before yielding buys for small all-reduce latency over the local
//! transport (`cargo test -p shardline-collectives --test spin_probe -- --ignored
//! --nocapture`). Prints a table; asserts nothing about time.

use shardline_collectives::testing::run_ranks;
use shardline_collectives::{local_group_with_topology, CommOptions, ReduceOp, Topology};
use std::time::{Duration, Instant};

#[test]
#[ignore = "measurement, run by hand"]
fn spin_probe_small_all_reduce() {
    for world in [2usize, 4] {
        for spin in [0u64, 5, 20, 50, 200] {
            let mut o = CommOptions::new();
            o.spin_us(spin).timeout(Duration::from_secs(30));
            let comms = local_group_with_topology(Topology::single_node(world), o).expect("group");
            let times = run_ranks(comms, Duration::from_secs(120), |comm| {
                let lane = comm.lane("lat").expect("lane");
                let mut buf = vec![1.0f32; 1024];
                for _ in 0..200 {
                    buf = lane.all_reduce(buf, ReduceOp::Max).wait().expect("warmup");
                }
                let mut samples = Vec::with_capacity(2000);
                for _ in 0..2000 {
                    let t = Instant::now();
                    buf = lane.all_reduce(buf, ReduceOp::Max).wait().expect("op");
                    samples.push(t.elapsed());
                }
                samples.sort();
                samples[samples.len() / 2]
            });
            let worst = times.iter().max().copied().unwrap_or_default();
            println!(
                "world={world} spin_us={spin:>4} 4KiB all_reduce median {:>8.1} us",
                worst.as_secs_f64() * 1e6
            );
        }
    }
}
