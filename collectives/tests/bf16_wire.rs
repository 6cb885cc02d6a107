//! Packed bf16 through real lanes (local transport): gathers move the packed words bit for
//! bit, `SumBf16` reductions round per hop (BFLOAT-2, BFLOAT-3), and the lanes' sent-byte
//! counters see half the bytes of the f32 ops (LANE-8).

use half::bf16 as h;
use shardline_collectives::testing::run_ranks;
use shardline_collectives::{bf16, local_group, Algorithm, CallOptions, ReduceOp};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(60);

fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 13) as f32 * 0.173).sin() * (1.0 + rank as f32)).collect()
}

/// BFLOAT-2 over a lane, LANE-8: a packed all-gather hands every rank every rank's values
/// rounded to bf16, and sends half the bytes of the same f32 all-gather, counted exactly
/// (ring: world - 1 shards per rank).
#[test]
fn packed_all_gather_round_trips_at_half_the_bytes_bfloat_2_lane_8() {
    for (world, n) in [(2usize, 10usize), (3, 7), (4, 64)] {
        let out = run_ranks(local_group(world).unwrap(), DEADLINE, move |comm| {
            let (rank, w) = (comm.rank(), comm.world());
            let lane = comm.lane("g").unwrap();
            let mut ring = CallOptions::new();
            ring.algorithm(Algorithm::Ring);
            let words = bf16::words(n);
            let mut buf = vec![0.0f32; w * words];
            bf16::pack(&values(rank, n), &mut buf[rank * words..(rank + 1) * words]);
            let before = lane.bytes_sent();
            let buf = lane.all_gather_in_place_opts(buf, &ring).wait_timeout(DEADLINE).unwrap();
            let packed_bytes = lane.bytes_sent() - before;
            let mut f32_buf = vec![0.0f32; w * n];
            f32_buf[rank * n..(rank + 1) * n].copy_from_slice(&values(rank, n));
            let before = lane.bytes_sent();
            lane.all_gather_in_place_opts(f32_buf, &ring).wait_timeout(DEADLINE).unwrap();
            let f32_bytes = lane.bytes_sent() - before;
            let mut got = vec![0.0f32; w * n];
            for r in 0..w {
                bf16::unpack(&buf[r * words..(r + 1) * words], &mut got[r * n..(r + 1) * n]);
            }
            (got, packed_bytes, f32_bytes, comm.bytes_sent())
        });
        for (rank, (got, packed, full, total)) in out.into_iter().enumerate() {
            for r in 0..world {
                for (i, x) in values(r, n).into_iter().enumerate() {
                    let want = h::from_f32(x).to_f32();
                    assert_eq!(got[r * n + i].to_bits(), want.to_bits(), "world {world} r {r}");
                }
            }
            let words = bf16::words(n) as u64;
            assert_eq!(packed, (world as u64 - 1) * words * 4, "rank {rank}, world {world}");
            assert_eq!(full, (world as u64 - 1) * n as u64 * 4, "rank {rank}");
            if n % 2 == 0 {
                assert_eq!(2 * packed, full, "half the bytes");
            }
            assert_eq!(total, packed + full, "the communicator sums its lanes");
        }
    }
}

/// BFLOAT-3 over a lane: at world 2 a `SumBf16` reduce-scatter gives bf16(bf16(a) + bf16(b))
/// exactly; at world 4 (three rounded additions) it stays within three bf16 roundings of the
/// exact sum. Ranks that mix `Sum` and `SumBf16` in one op are refused by the fingerprint.
#[test]
fn packed_reduce_scatter_rounds_per_hop_bfloat_3() {
    for world in [2usize, 4] {
        let n = 6; // values per rank's slot
        let out = run_ranks(local_group(world).unwrap(), DEADLINE, move |comm| {
            let (rank, w) = (comm.rank(), comm.world());
            let lane = comm.lane("r").unwrap();
            let words = bf16::words(n);
            let full = values(rank, w * n);
            let mut packed = vec![0.0f32; w * words];
            for r in 0..w {
                let slot = &mut packed[r * words..(r + 1) * words];
                bf16::pack(&full[r * n..(r + 1) * n], slot);
            }
            let out = vec![0.0f32; words];
            let (_, out) =
                lane.reduce_scatter(packed, out, ReduceOp::SumBf16).wait_timeout(DEADLINE).unwrap();
            let mut got = vec![0.0f32; n];
            bf16::unpack(&out, &mut got);
            got
        });
        for (rank, got) in out.into_iter().enumerate() {
            for (i, &g) in got.iter().enumerate() {
                let terms: Vec<f32> = (0..world)
                    .map(|r| h::from_f32(values(r, world * n)[rank * n + i]).to_f32())
                    .collect();
                let exact: f64 = terms.iter().map(|&t| f64::from(t)).sum();
                if world == 2 {
                    let want = h::from_f32(terms[0] + terms[1]).to_f32();
                    assert_eq!(g.to_bits(), want.to_bits(), "rank {rank} i {i}");
                } else {
                    let mag: f64 = terms.iter().map(|&t| f64::from(t).abs()).sum();
                    let tol = 3.0 * mag * 2f64.powi(-8);
                    assert!((f64::from(g) - exact).abs() <= tol, "{g} vs {exact} ({tol})");
                }
            }
        }
    }
    let out =
        shardline_collectives::testing::try_run_ranks(local_group(2).unwrap(), DEADLINE, |comm| {
            let lane = comm.lane("m").unwrap();
            let op = if comm.rank() == 0 { ReduceOp::Sum } else { ReduceOp::SumBf16 };
            lane.all_reduce(vec![1.0; 4], op).wait_timeout(DEADLINE).map_err(|e| e.to_string())
        })
        .unwrap();
    assert!(out.iter().all(|r| r.as_ref().is_err_and(|e| e.contains("sum-bf16"))), "{out:?}");
}
