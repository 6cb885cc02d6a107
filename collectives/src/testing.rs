//! Test helpers shared with other crates (feature `test-utils`): running one closure per
//! rank under a deadline, naive references, deterministic inputs, and the conformance grid
//! that every transport runs.

use crate::{Algorithm, CallOptions, Communicator, ReduceOp};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `w` communicators (single node, 60 s timeout) over transports built by `make(rank,
/// store)` sharing one in-memory rendezvous store: ranks as threads over any transport.
pub fn group_over(
    w: usize,
    make: &dyn Fn(usize, Arc<dyn crate::Store>) -> Arc<dyn crate::transport::Transport>,
) -> Vec<Communicator> {
    let store: Arc<dyn crate::Store> = Arc::new(crate::MemStore::new());
    let mut o = crate::CommOptions::new();
    o.timeout(Duration::from_secs(60));
    (0..w)
        .map(|r| {
            Communicator::new(make(r, store.clone()), crate::Topology::single_node(w), o.clone())
                .expect("communicator")
        })
        .collect()
}

/// Runs `f(comm)` on one thread per rank. Returns the results in rank order, or an error
/// naming the ranks that panicked or had not finished by `deadline` (their threads are left
/// behind; the test fails instead of hanging).
pub fn try_run_ranks<R, F>(
    comms: Vec<Communicator>,
    deadline: Duration,
    f: F,
) -> Result<Vec<R>, String>
where
    R: Send + 'static,
    F: Fn(Communicator) -> R + Send + Sync + 'static,
{
    let world = comms.len();
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    let mut handles = Vec::with_capacity(world);
    for (i, comm) in comms.into_iter().enumerate() {
        let (f, tx) = (f.clone(), tx.clone());
        let h = std::thread::Builder::new()
            .name(format!("rank-{i}"))
            .spawn(move || {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                let _ = tx.send((i, out));
            })
            .map_err(|e| format!("cannot spawn rank {i}: {e}"))?;
        handles.push(Some(h));
    }
    drop(tx);
    let end = crate::config::deadline_after(deadline);
    let mut results: Vec<Option<R>> = (0..world).map(|_| None).collect();
    let mut errors = Vec::new();
    let mut left = world;
    while left > 0 {
        let now = Instant::now();
        let Some(rest) = end.checked_duration_since(now) else { break };
        match rx.recv_timeout(rest) {
            Ok((i, out)) => {
                left -= 1;
                if let Some(h) = handles[i].take() {
                    let _ = h.join();
                }
                match out {
                    Ok(r) => results[i] = Some(r),
                    Err(p) => {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "non-string panic".into());
                        errors.push(format!("rank {i} panicked: {msg}"));
                    }
                }
            }
            Err(_) => break,
        }
    }
    let late: Vec<usize> = (0..world).filter(|&i| handles[i].is_some()).collect();
    if !late.is_empty() {
        errors.push(format!("ranks {late:?} did not finish within {deadline:?}"));
    }
    if errors.is_empty() {
        Ok(results.into_iter().map(|r| r.expect("every rank reported")).collect())
    } else {
        Err(errors.join("; "))
    }
}

/// [`try_run_ranks`] that panics with the error message.
pub fn run_ranks<R, F>(comms: Vec<Communicator>, deadline: Duration, f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(Communicator) -> R + Send + Sync + 'static,
{
    match try_run_ranks(comms, deadline, f) {
        Ok(r) => r,
        Err(e) => panic!("run_ranks: {e}"),
    }
}

/// Naive element-wise reduction in f64 (Avg divides the sum by the number of inputs).
pub fn naive_reduce(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f64> {
    let Some(first) = inputs.first() else { return Vec::new() };
    let mut acc: Vec<f64> = first.iter().map(|&x| f64::from(x)).collect();
    for x in &inputs[1..] {
        for (a, &b) in acc.iter_mut().zip(x) {
            let b = f64::from(b);
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => *a + b,
                ReduceOp::Max => a.max(b),
                ReduceOp::Min => a.min(b),
                ReduceOp::SumBf16 => panic!("naive_reduce: packed bf16 is not a value per element"),
            };
        }
    }
    if op == ReduceOp::Avg {
        let w = inputs.len() as f64;
        acc.iter_mut().for_each(|a| *a /= w);
    }
    acc
}

/// Deterministic pseudo-random input in [-1, 1) for (`seed`, `rank`), `len` elements.
pub fn input(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut s = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            // splitmix64
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Checks `got` against the f64 reference: exact for Max/Min, else within a bound on the
/// f32 rounding of a `world`-term sum of values in [-1, 1]. Returns the first bad index.
pub fn check_close(got: &[f32], want: &[f64], op: ReduceOp, world: usize) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("length {} != {}", got.len(), want.len()));
    }
    let tol = match op {
        ReduceOp::Max | ReduceOp::Min => 0.0,
        ReduceOp::Sum => 2.0 * world as f64 * f64::from(f32::EPSILON) * world as f64,
        ReduceOp::Avg => 2.0 * world as f64 * f64::from(f32::EPSILON) * 2.0,
        ReduceOp::SumBf16 => {
            return Err("check_close: packed bf16 is not a value per element".into())
        }
    };
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if tol == 0.0 { f64::from(g) == w } else { (f64::from(g) - w).abs() <= tol };
        if !ok {
            return Err(format!("element {i}: got {g}, want {w} ({op:?})"));
        }
    }
    Ok(())
}

/// What the conformance grid covers.
#[derive(Clone, Debug)]
pub struct GridConfig {
    /// World sizes.
    pub worlds: Vec<usize>,
    /// Algorithms forced through `CallOptions`.
    pub algorithms: Vec<Algorithm>,
    /// Large element count, run with every op on `large_worlds`. For reduce-scatter and
    /// all-gather it is the whole buffer (per-rank slice `large_count / world`, rounded up),
    /// so memory stays near 4 MiB per buffer.
    pub large_count: usize,
    /// Worlds that run the large count.
    pub large_worlds: Vec<usize>,
    /// Direct runs the large count only up to this world (its scratch is `world` buffers).
    pub large_direct_max_world: usize,
    /// Deadline of each world's run.
    pub deadline: Duration,
}

impl Default for GridConfig {
    fn default() -> Self {
        GridConfig {
            worlds: vec![1, 2, 3, 4, 7, 8],
            algorithms: vec![Algorithm::Ring, Algorithm::Direct, Algorithm::Auto],
            large_count: (1 << 20) + 3,
            large_worlds: vec![1, 2, 3, 4, 7, 8],
            large_direct_max_world: 4,
            deadline: Duration::from_secs(120),
        }
    }
}

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

fn check(ctx: &str, r: Result<(), String>) {
    if let Err(e) = r {
        panic!("{ctx}: {e}");
    }
}

/// One rank's part of the grid for one (count, algorithm): every op, every ReduceOp,
/// broadcast from roots 0 and W-1. `large` makes `count` the whole reduce-scatter/all-gather
/// buffer instead of the per-rank slice. Each rank builds every rank's input itself, so it
/// checks its own result against the naive reference without extra communication.
fn grid_case(comm: &Communicator, count: usize, algo: Algorithm, large: bool, seed: u64) {
    let (rank, world) = (comm.rank(), comm.world());
    let wait = Duration::from_secs(60);
    let lane = comm.lane("grid").unwrap_or_else(|e| panic!("rank {rank}: lane: {e}"));
    let mut o = CallOptions::new();
    o.algorithm(algo);
    let ctx = |what: &str| format!("{what} world={world} count={count} algo={algo:?} rank={rank}");
    for (k, &op) in OPS.iter().enumerate() {
        let s = seed + k as u64;
        let ins: Vec<Vec<f32>> = (0..world).map(|r| input(s, r, count)).collect();
        let want = naive_reduce(&ins, op);
        let got = lane.all_reduce_opts(ins[rank].clone(), op, &o).wait_timeout(wait);
        let got = got.unwrap_or_else(|e| panic!("{}: {e}", ctx("all_reduce")));
        check(&ctx(&format!("all_reduce {op:?}")), check_close(&got, &want, op, world));
    }
    let n = if large { count.div_ceil(world) } else { count };
    for (k, &op) in OPS.iter().enumerate() {
        let s = seed + 10 + k as u64;
        let ins: Vec<Vec<f32>> = (0..world).map(|r| input(s, r, world * n)).collect();
        let want = naive_reduce(&ins, op);
        let out = comm.pool().take(n);
        let got = lane.reduce_scatter_opts(ins[rank].clone(), out, op, &o).wait_timeout(wait);
        let (scratch, got) = got.unwrap_or_else(|e| panic!("{}: {e}", ctx("reduce_scatter")));
        let mine = &want[rank * n..(rank + 1) * n];
        check(&ctx(&format!("reduce_scatter {op:?}")), check_close(&got, mine, op, world));
        comm.pool().give(scratch);
        comm.pool().give(got);
        // In place (NCCL's recvbuff == sendbuff + rank * recvcount): the same reduction in
        // slice `rank` of the input.
        let got = lane.reduce_scatter_in_place_opts(ins[rank].clone(), op, &o).wait_timeout(wait);
        let got = got.unwrap_or_else(|e| panic!("{}: {e}", ctx("reduce_scatter_in_place")));
        check(
            &ctx(&format!("reduce_scatter_in_place {op:?}")),
            check_close(&got[rank * n..(rank + 1) * n], mine, op, world),
        );
    }
    let shards: Vec<Vec<f32>> = (0..world).map(|r| input(seed + 20, r, n)).collect();
    let out = comm.pool().take(world * n);
    let got = lane.all_gather_opts(shards[rank].clone(), out, &o).wait_timeout(wait);
    let (_, got) = got.unwrap_or_else(|e| panic!("{}: {e}", ctx("all_gather")));
    if got != shards.concat() {
        panic!("{}: wrong result", ctx("all_gather"));
    }
    comm.pool().give(got);
    // In place, and the two forms mixed across ranks (odd ranks out of place): the wire
    // traffic is the same.
    for mixed in [false, true] {
        let got = if mixed && rank % 2 == 1 {
            let out = comm.pool().take(world * n);
            let got = lane.all_gather_opts(shards[rank].clone(), out, &o).wait_timeout(wait);
            got.map(|(_, full)| full)
        } else {
            let mut buf = vec![f32::NAN; world * n];
            buf[rank * n..(rank + 1) * n].copy_from_slice(&shards[rank]);
            lane.all_gather_in_place_opts(buf, &o).wait_timeout(wait)
        };
        let what = if mixed { "all_gather_in_place (mixed)" } else { "all_gather_in_place" };
        let got = got.unwrap_or_else(|e| panic!("{}: {e}", ctx(what)));
        let want = shards.concat();
        if got.len() != want.len() || got.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits())
        {
            panic!("{}: wrong result", ctx(what));
        }
    }
    for root in [0, world - 1] {
        let src = input(seed + 30 + root as u64, root, count);
        let buf = if rank == root { src.clone() } else { vec![f32::NAN; count] };
        let got = lane.broadcast_opts(buf, root, &o).wait_timeout(wait);
        let got = got.unwrap_or_else(|e| panic!("{}: {e}", ctx("broadcast")));
        if got.len() != src.len() || got.iter().zip(&src).any(|(a, b)| a.to_bits() != b.to_bits()) {
            panic!("{}: wrong result from root {root}", ctx("broadcast"));
        }
    }
    let done = lane.barrier_opts(&o).wait_timeout(wait);
    done.unwrap_or_else(|e| panic!("{}: {e}", ctx("barrier")));
}

/// The conformance grid: every op x ReduceOp x `cfg.worlds` x counts {0, 1, W-1, 997} x
/// `cfg.algorithms` against the naive reference, plus `cfg.large_count` on
/// `cfg.large_worlds` (see [`GridConfig::large_count`]). `factory(world)` builds the group,
/// so every transport runs the same grid. Panics naming the failing case.
pub fn conformance_grid(factory: &dyn Fn(usize) -> Vec<Communicator>, cfg: &GridConfig) {
    for &world in &cfg.worlds {
        let comms = factory(world);
        assert_eq!(comms.len(), world, "factory built the wrong number of ranks");
        let algos = cfg.algorithms.clone();
        let large = cfg.large_worlds.contains(&world).then_some(cfg.large_count);
        let direct_max = cfg.large_direct_max_world;
        run_ranks(comms, cfg.deadline, move |comm| {
            let w = comm.world();
            let mut counts = vec![0usize, 1, w - 1, 997];
            counts.sort_unstable();
            counts.dedup();
            for (a, &algo) in algos.iter().enumerate() {
                for (c, &count) in counts.iter().enumerate() {
                    grid_case(&comm, count, algo, false, (a * 100 + c) as u64 * 1000);
                }
                if let Some(big) = large {
                    if algo != Algorithm::Direct || w <= direct_max {
                        grid_case(&comm, big, algo, true, 7_000_000 + a as u64);
                    }
                }
            }
        });
    }
}
