//! `shardline-bench machine-profile`: the machine profile `shardline plan --profile` reads,
//! from microbenchmarks only: the rows of one or more `shardline-bench collectives --json`
//! files, a GEMM probe of the CPU backend on one thread at a few square sizes, the products
//! a model makes (their shapes and forms from `shardline plan --json`'s `products`, timed
//! alone through the layers' entry point `nn::Gemm`), fresh allocations by size (allocate,
//! touch, free), the single-thread memory bandwidth, the exact GELU's kernel per element and
//! the optimizers' update per parameter.
//! Each probe keeps its best pass: on a machine others share, the best is the machine's,
//! the rest its neighbours'. Nothing here runs a training step.

use anyhow::Context;
use serde::Deserialize;
use shardline_models::nn::products::{Form, Product};
use shardline_models::{gemm_gflops, Cpu};
use shardline_runtime::plan::profile::{
    AllocRow, CollectiveRow, GemmRow, ProductRow, Profile, SharedGemm, UpdateRow,
};
use std::path::PathBuf;
use std::time::Instant;

/// Options of `shardline-bench machine-profile`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// `shardline-bench collectives --json` files to read the collectives from (rows run in
    /// place are kept for all-gathers, which the engine runs in place; rows not in place for
    /// the other ops).
    #[arg(long, value_delimiter = ',', required = true)]
    pub collectives: Vec<PathBuf>,
    /// Square GEMM sizes to probe.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128,256,512")]
    pub gemm: Vec<usize>,
    /// Timed repetitions per GEMM size (the best is kept).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// The shared GEMM probe: 1 to this many threads multiplying at once (the most ranks a
    /// node of the jobs to predict runs).
    #[arg(long, default_value_t = 4)]
    pub shared_threads: usize,
    /// Square size of the shared probe's products.
    #[arg(long, default_value_t = 256)]
    pub shared_size: usize,
    /// `shardline plan --json` files whose `products` (the shapes and forms of one
    /// microbatch's matrix products) to time, each at its own shape; none: only the square
    /// probes.
    #[arg(long, value_delimiter = ',')]
    pub products: Vec<PathBuf>,
    /// Bytes of operand copies each probed product rotates over (at least the last-level
    /// cache's size: operands come from memory, as in a step); 0: one copy, hot in cache.
    #[arg(long, default_value_t = 64 << 20)]
    pub products_cold_bytes: u64,
    /// Sizes of fresh allocations to probe, bytes (each allocated, touched and freed, up to
    /// 32 MiB of them held at once).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4096,65536,262144,1048576,4194304,16777216"
    )]
    pub alloc: Vec<u64>,
    /// Where to write the profile.
    #[arg(long)]
    pub out: PathBuf,
}

/// The part of a collectives row the profile needs.
#[derive(Deserialize)]
struct Row {
    op: String,
    world: usize,
    transport: String,
    bytes: u64,
    time_us: f64,
    #[serde(default)]
    in_place: bool,
}

#[derive(Deserialize)]
struct File {
    rows: Vec<Row>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut collectives = Vec::new();
    for path in &a.collectives {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let f: File = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a collectives --json file", path.display()))?;
        // The engine gathers in place and reduce-scatters into a separate shard.
        let keep = |r: &Row| (r.op == "all-gather") == r.in_place;
        collectives.extend(f.rows.into_iter().filter(keep).map(|r| CollectiveRow {
            op: r.op,
            world: r.world,
            transport: r.transport,
            bytes: r.bytes,
            time_us: r.time_us,
            world_max: None,
            busbw_gbps: None,
            step_latency_us: None,
            source: None,
        }));
    }
    anyhow::ensure!(!collectives.is_empty(), "no usable collectives rows in --collectives");
    let mut wanted: Vec<Product> = Vec::new();
    for path in &a.products {
        let usage =
            |what: String| crate::report::Usage(format!("--products {}: {what}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| usage(e.to_string()))?;
        let plan: PlanProducts = serde_json::from_str(&text)
            .map_err(|e| usage(format!("not a `shardline plan --json` file: {e}")))?;
        wanted.extend(plan.products);
    }
    wanted.sort();
    wanted.dedup();
    for &bytes in &a.alloc {
        let ok = bytes >= 4;
        crate::report::check_flags(ok, || format!("--alloc {bytes}: sizes are bytes, at least 4"))?;
    }
    let be = Cpu::new();
    let mut gemm = Vec::new();
    for &s in &a.gemm {
        let gflops = gemm_gflops(&be, s, s, s, a.reps)?;
        println!("gemm {s}x{s}x{s}: {gflops:.2} GFLOP/s");
        gemm.push(GemmRow { m: s, n: s, k: s, gflops, source: None });
    }
    let mut gemm_shared = Vec::new();
    for t in 1..=a.shared_threads {
        // The best of a few windows, as every probe keeps its best pass: one window can
        // meet a burst of the machine's other work.
        let g = (0..a.reps.clamp(1, 3)).map(|_| shared_gemm(t, a.shared_size)).fold(0.0, f64::max);
        println!("gemm {0}x{0}x{0} on {t} threads at once: {g:.2} GFLOP/s each", a.shared_size);
        gemm_shared.push(SharedGemm { threads: t, size: a.shared_size, gflops_per_thread: g });
    }
    let mut products = Vec::new();
    for p in wanted {
        let gflops = product_best_gflops(p, a.reps, a.products_cold_bytes);
        println!("product {}x{}x{} {:?}: {gflops:.2} GFLOP/s", p.m, p.n, p.k, p.form);
        products.push(ProductRow { product: p, gflops });
    }
    let mut alloc = Vec::new();
    for &bytes in &a.alloc {
        let ns_per_byte = alloc_best_ns_per_byte(bytes, a.reps.max(5));
        println!("fresh allocation of {bytes} B: {ns_per_byte:.4} ns per byte beyond its write");
        alloc.push(AllocRow { bytes, ns_per_byte });
    }
    let memory_gbps = memcpy_best_gbps(a.reps.max(5));
    println!("memory: {memory_gbps:.2} GB/s (one thread, read + write, best pass)");
    let gelu_ns = gelu_best_ns(a.reps.max(5))?;
    println!("gelu (erf, value and derivative): {gelu_ns:.2} ns per element");
    let updates = update_rows(a.reps.max(5))?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let p = Profile {
        note: format!(
            "shardline-bench machine-profile: {} collectives rows from {}; gemm probe sizes {:?}; {cores} cores",
            collectives.len(),
            a.collectives.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
            a.gemm
        ),
        cores,
        memory_gbps,
        gelu_ns,
        gemm_shared,
        gemm,
        collectives,
        published: None,
        transports_default: None,
        device_memory: None,
        gemm_by: Default::default(),
        sources: vec![],
        products,
        alloc,
        updates,
    };
    std::fs::write(&a.out, serde_json::to_string_pretty(&p)?)
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!("wrote {}", a.out.display());
    Ok(())
}

/// The part of a `shardline plan --json` file the product probe reads.
#[derive(Deserialize)]
struct PlanProducts {
    /// Required, so that another JSON file is refused rather than read as no products.
    #[serde(rename = "model")]
    _model: String,
    #[serde(default)]
    products: Vec<Product>,
}

/// Best rate of `p` on this thread through `nn::Gemm` (the layers' entry point), on operands
/// laid out as its form says, GFLOP/s. The operands rotate over copies of `cold_bytes` in
/// all, so that each product finds its operands outside the caches, as a step's products
/// find the activations that other kernels wrote since (0: one copy, kept hot). Each pass
/// runs at least every copy once and a millisecond.
fn product_best_gflops(p: Product, reps: usize, cold_bytes: u64) -> f64 {
    use shardline_models::nn::gemm::{Gemm, View};
    use shardline_models::GemmShape;
    let Product { m, n, k, form, accumulate } = p;
    if m * n * k == 0 {
        return 0.0;
    }
    let set_bytes = ((m * k + k * n + m * n) * 4) as u64;
    let copies = (cold_bytes / set_bytes).clamp(1, 4096) as usize;
    let mut sets: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..copies)
        .map(|s| {
            let a = (0..m * k).map(|i| ((i % 13 + s) as f32 - 6.0) * 0.01).collect();
            let b = (0..k * n).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
            (a, b, vec![0.0f32; m * n])
        })
        .collect();
    let once = |(a, b, c): &mut (Vec<f32>, Vec<f32>, Vec<f32>)| match form {
        Form::View => {
            let rows = View::rows;
            f32::gemm_view((m, n, k), (a, rows(0, k)), (b, rows(0, n)), (c, rows(0, n)), accumulate)
        }
        Form::ViewT => {
            // `b` stored as the rows of its transpose, `n x k` (attention's keys).
            let (rows, bt) = (View::rows, View::rows(0, k).t());
            f32::gemm_view((m, n, k), (a, rows(0, k)), (b, bt), (c, rows(0, n)), accumulate)
        }
        _ => {
            let (trans_a, trans_b) = match form {
                Form::Nt => (false, true),
                Form::Tn => (true, false),
                Form::Tt => (true, true),
                _ => (false, false),
            };
            f32::gemm(GemmShape { m, n, k, trans_a, trans_b }, a, b, c, accumulate)
        }
    };
    sets.iter_mut().for_each(once);
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let (t0, mut calls) = (Instant::now(), 0usize);
        while calls < copies || t0.elapsed().as_secs_f64() < 1e-3 {
            once(&mut sets[calls % copies]);
            calls += 1;
        }
        best = best.min(t0.elapsed().as_secs_f64() / calls as f64);
    }
    std::hint::black_box(&sets);
    p.flops() / best.max(1e-12) / 1e9
}

/// Best extra time per byte of making `bytes`-byte tensors fresh, nanoseconds: up to
/// 32 MiB of them allocated zeroed (`vec!`, as tensors are), written once and freed
/// together, less writing as many bytes into buffers already in use.
fn alloc_best_ns_per_byte(bytes: u64, passes: usize) -> f64 {
    let n = (bytes / 4) as usize;
    let count = ((32u64 << 20) / bytes).clamp(1, 256) as usize;
    let mut kept: Vec<Vec<f32>> = (0..count).map(|_| vec![0.0f32; n]).collect();
    let (mut fresh, mut reuse) = (f64::INFINITY, f64::INFINITY);
    for pass in 0..passes {
        let t = Instant::now();
        let made: Vec<Vec<f32>> = (0..count)
            .map(|_| {
                let mut v = vec![0.0f32; n];
                v.fill(pass as f32);
                v
            })
            .collect();
        std::hint::black_box(&made);
        drop(made);
        fresh = fresh.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        kept.iter_mut().for_each(|v| v.fill(pass as f32));
        std::hint::black_box(&kept);
        reuse = reuse.min(t.elapsed().as_secs_f64());
    }
    ((fresh - reuse) / (bytes as f64 * count as f64) * 1e9).max(0.0)
}

/// Best single-thread memcpy over 32 MiB buffers, GB/s counting bytes read + written.
fn memcpy_best_gbps(passes: usize) -> f64 {
    let n = 8 << 20;
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut dst = vec![0.0f32; n];
    let mut best = f64::INFINITY;
    for _ in 0..passes {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    2.0 * (n * 4) as f64 / best / 1e9
}

/// Best time per element of the exact GELU's forward that keeps its derivative (what `gpt`'s
/// MLP runs), over 1M elements, nanoseconds.
fn gelu_best_ns(passes: usize) -> anyhow::Result<f64> {
    use shardline_models::nn::Activation;
    let n = 1 << 20;
    let x: Vec<f32> = (0..n).map(|i| (i % 2000) as f32 * 0.003 - 3.0).collect();
    let mut best = f64::INFINITY;
    for _ in 0..passes {
        let mut d = x.clone();
        let t = Instant::now();
        let y = Activation::Gelu.forward_saving_derivative_new(&mut d)?;
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&y);
    }
    Ok(best / n as f64 * 1e9)
}

/// The optimizers' update with the gradients' squared norm on the way
/// (`Optimizer::step_sq_norm`, what a sharded stage's update runs; stage 0 steps, then takes
/// the norm of its own slice in a pass of its own), best pass over 16 Mi
/// parameters (64 MiB per array, past the last-level cache: parameters, gradients and state
/// come from memory, as in a step), nanoseconds per parameter, for plain SGD, SGD with
/// momentum and AdamW.
fn update_rows(passes: usize) -> anyhow::Result<Vec<UpdateRow>> {
    use shardline_runtime::optim::{AdamWConfig, Optimizer, SgdConfig};
    let n = 16 << 20;
    let momentum = SgdConfig { momentum: 0.9, ..SgdConfig::default() };
    let opts = [
        Optimizer::Sgd(SgdConfig::default()),
        Optimizer::Sgd(momentum),
        Optimizer::AdamW(AdamWConfig::default()),
    ];
    let mut rows = Vec::new();
    for opt in opts {
        let k = opt.state_len_per_param();
        let mut params: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
        let grads: Vec<f32> = (0..n).map(|i| (i % 997) as f32 * 1e-4).collect();
        let mut state = vec![0.0f32; n * k];
        let mut best = f64::INFINITY;
        for step in 1..=passes as u64 {
            let t = Instant::now();
            let norm = opt.step_sq_norm(1e-3, step, &mut params, &grads, &mut state)?;
            best = best.min(t.elapsed().as_secs_f64());
            std::hint::black_box(norm);
        }
        let ns_per_elem = best / n as f64 * 1e9;
        println!("update {} ({k} state words): {ns_per_elem:.3} ns per parameter", opt.name());
        rows.push(UpdateRow { state_words: k, ns_per_elem });
    }
    Ok(rows)
}

/// Each of `threads` threads multiplies `size`-square matrices for the same half second;
/// returns the mean rate per thread, GFLOP/s: what a rank gets while the others (and the
/// machine's other work) compute too.
fn shared_gemm(threads: usize, size: usize) -> f64 {
    use shardline_models::{Backend, GemmShape};
    let window = std::time::Duration::from_millis(500);
    let rates: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    let be = Cpu::new();
                    let a: Vec<f32> = (0..size * size).map(|i| (i % 13) as f32 * 0.01).collect();
                    let mut c = vec![0.0f32; size * size];
                    let shape =
                        GemmShape { m: size, n: size, k: size, trans_a: false, trans_b: false };
                    let (t0, mut n) = (Instant::now(), 0u64);
                    while t0.elapsed() < window {
                        if be.gemm(shape, &a, &a, &mut c, false).is_err() {
                            return 0.0;
                        }
                        n += 1;
                    }
                    2.0 * (size * size * size) as f64 * n as f64 / t0.elapsed().as_secs_f64() / 1e9
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0.0)).collect()
    });
    rates.iter().sum::<f64>() / threads as f64
}
