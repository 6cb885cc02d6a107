//! Bandwidth probe for the local transport (`cargo test -p shardline-collectives --test
//! bw_probe -- --ignored --nocapture`): 64 MiB all-reduce, reduce-scatter and all-gather
//! busbw beside this machine's memcpy bandwidth measured in the same run. Asserts nothing
//! about time.

use shardline_collectives::testing::run_ranks;
use shardline_collectives::{local_group, Algorithm, CallOptions, ReduceOp};
use std::time::{Duration, Instant};

fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    // Read + write.
    2.0 * bytes as f64 / best / 1e9
}

#[test]
#[ignore = "measurement, run by hand"]
fn bw_probe_64mib() {
    let bytes = 64 << 20;
    println!("memcpy (1 thread, read+write) {:.2} GB/s", memcpy_gbps(bytes));
    for world in [2usize, 4] {
        for (op, algo) in [
            ("all_reduce", Algorithm::Ring),
            ("all_reduce", Algorithm::Direct),
            ("reduce_scatter", Algorithm::Ring),
            ("reduce_scatter", Algorithm::Direct),
            ("all_gather", Algorithm::Ring),
            ("all_gather", Algorithm::Direct),
        ] {
            let comms = local_group(world).expect("group");
            let times = run_ranks(comms, Duration::from_secs(300), move |comm| {
                let lane = comm.lane("bw").expect("lane");
                let mut o = CallOptions::new();
                o.algorithm(algo);
                let w = comm.world();
                let count = bytes / 4;
                let mut a = vec![1.0f32; count];
                let mut b = vec![0.0f32; count / w];
                let mut samples = Vec::new();
                for _ in 0..6 {
                    lane.barrier().wait().expect("barrier");
                    let t = Instant::now();
                    match op {
                        "all_reduce" => {
                            a = lane.all_reduce_opts(a, ReduceOp::Sum, &o).wait().expect("ar")
                        }
                        "reduce_scatter" => {
                            (a, b) = lane
                                .reduce_scatter_opts(a, b, ReduceOp::Sum, &o)
                                .wait()
                                .expect("rs")
                        }
                        _ => (b, a) = lane.all_gather_opts(b, a, &o).wait().expect("ag"),
                    }
                    samples.push(t.elapsed());
                }
                samples.sort();
                samples[samples.len() / 2]
            });
            let t = times.iter().max().copied().unwrap_or_default().as_secs_f64();
            let factor =
                if op == "all_reduce" { 2.0 } else { 1.0 } * (world - 1) as f64 / world as f64;
            let algbw = bytes as f64 / t / 1e9;
            println!(
                "{op:>15} {algo:?} W={world} 64MiB: {:8.2} ms algbw {algbw:5.2} busbw {:5.2} GB/s",
                t * 1e3,
                algbw * factor
            );
        }
    }
}
