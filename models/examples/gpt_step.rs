//! Times one training step (`GptConfig::loss_and_grads::<f32>`: forward, cross-entropy,
//! backward) of a small nanoGPT decoder on one thread, against the GEMM-bound limit.
//!
//! `cargo run --release -p shardline-models --example gpt_step -- [runs]`
//!
//! `-- --limit BATCH` prints only the GEMM-bound limit of a step over `BATCH` sequences (one
//! JSON line: matmul GFLOP, `gemm_gflops`, the bound in ms, and the core's measured FMA peak with
//! the bound at that peak), for `bench/gpt_vs_torch.sh`.
//!
//! Configuration: vocab 256, block 128, 4 layers, 4 heads, embd 256, biases, batch 16
//! sequences of 128 tokens. The limit is the step's matrix-multiply FLOPs (every linear
//! forward and backward, the tied head, attention's `Q K^T` and `P V` forward and backward
//! over the causal half; not the backward's recomputation of the scores) at the rate
//! `gemm_gflops` measures in the same run. The split into linear, attention and the rest
//! times the kernels on their own, on the step's shapes, and leaves the remainder to the
//! rest (norms, GELU, cross-entropy, embeddings, head split/merge, allocation).
//!
//! On the development machine (2 cores shared with other work, AVX-512, one thread): with the
//! products as plain loops the median step was 9099 ms (225 tokens/s, 4.4% of the limit,
//! `gemm_gflops` 102 GFLOP/s; 3 runs); through `nn::Gemm` it is 754 ms (2715 tokens/s, 43.8%
//! of the limit at 124 GFLOP/s): linear 404 ms, attention 71 ms, the rest 280 ms, of which
//! the exact GELU's `erf` and `exp` (forward and backward) are the largest part.

use shardline_models::nn::attention::{attention_backward, attention_forward, AttnShape, Qkv};
use shardline_models::nn::{GptConfig, Linear};
use shardline_models::rng::SplitMix64;
use shardline_models::{gemm_gflops, Cpu};
use std::time::Instant;

const BATCH: usize = 16;
const SEQ: usize = 128;
/// The decoder's attention block (`ATTN_BLOCK` in `nn::gpt`).
const ATTN_BLOCK: usize = 64;

fn randn(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.normal() * scale).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn secs(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// One matrix product of the step: `count` products of `m x n x k`.
struct Shape {
    what: &'static str,
    m: usize,
    n: usize,
    k: usize,
    count: usize,
    /// Fraction of the product's FLOPs that count (1/2 for the causal attention products).
    share: f64,
}

impl Shape {
    fn flops(&self) -> f64 {
        2.0 * (self.m * self.n * self.k * self.count) as f64 * self.share
    }
}

fn shapes(cfg: &GptConfig, batch: usize) -> Vec<Shape> {
    let (e, v, l) = (cfg.n_embd, cfg.vocab_size, cfg.n_layer);
    let rows = batch * SEQ;
    let mut out = Vec::new();
    for (what, o, i) in
        [("c_attn", 3 * e, e), ("attn.c_proj", e, e), ("c_fc", 4 * e, e), ("mlp.c_proj", e, 4 * e)]
    {
        out.push(Shape { what, m: rows, n: o, k: i, count: l, share: 1.0 });
        out.push(Shape { what: "  dx = dy W", m: rows, n: i, k: o, count: l, share: 1.0 });
        out.push(Shape { what: "  dW += dy^T x", m: o, n: i, k: rows, count: l, share: 1.0 });
    }
    out.push(Shape { what: "head (tied wte)", m: rows, n: v, k: e, count: 1, share: 1.0 });
    out.push(Shape { what: "  dx = dy W", m: rows, n: e, k: v, count: 1, share: 1.0 });
    out.push(Shape { what: "  dW += dy^T x", m: v, n: e, k: rows, count: 1, share: 1.0 });
    // Attention: per (batch, head), the block pairs at or below the diagonal, each product
    // `ATTN_BLOCK` cubed; the causal half of `seq x seq` is 2/3 of the 3 pairs at seq 128.
    let (d, bh) = (e / cfg.n_head, batch * cfg.n_head * l);
    let nb = SEQ.div_ceil(ATTN_BLOCK);
    let pairs = nb * (nb + 1) / 2;
    let share = (SEQ * SEQ) as f64 / 2.0 / (pairs * ATTN_BLOCK * ATTN_BLOCK) as f64;
    let b = ATTN_BLOCK;
    // (what, n, k, share): scores and their gradient are `b x b` over `d`, the others
    // `b x d` over `b`; the backward's recomputation of the scores is not counted.
    for (what, n, k, share) in [
        ("attn S = Q K^T", b, d, share),
        ("attn O += P V", d, b, share),
        ("  S again (bwd)", b, d, 0.0),
        ("  dV += P^T dO", d, b, share),
        ("  dP = dO V^T", b, d, share),
        ("  dQ += dS K", d, b, share),
        ("  dK += dS^T Q", d, b, share),
    ] {
        out.push(Shape { what, m: b, n, k, count: bh * pairs, share });
    }
    out
}

/// Seconds of every linear kernel's forward and backward at the step's shapes.
fn time_linears(cfg: &GptConfig) -> f64 {
    let (e, rows) = (cfg.n_embd, BATCH * SEQ);
    let mut total = 0.0;
    let kernels = [
        (Linear::new(e, 3 * e, cfg.bias), cfg.n_layer),
        (Linear::new(e, e, cfg.bias), cfg.n_layer),
        (Linear::new(e, 4 * e, cfg.bias), cfg.n_layer),
        (Linear::new(4 * e, e, cfg.bias), cfg.n_layer),
        (Linear::new(e, cfg.vocab_size, false), 1),
    ];
    for (lin, count) in kernels {
        let p = randn(lin.num_params(), 1, 0.02);
        let x = randn(rows * lin.in_dim, 2, 1.0);
        let dy = randn(rows * lin.out_dim, 3, 1.0);
        let (mut y, mut dx) = (vec![0.0f32; dy.len()], vec![0.0f32; x.len()]);
        let mut g = vec![0.0f32; p.len()];
        let t = secs(|| {
            lin.forward(&p, &x, &mut y).unwrap();
            lin.backward(&p, &x, &dy, Some(&mut dx), &mut g).unwrap();
        });
        total += t * count as f64;
    }
    total
}

/// Seconds of the attention kernel's forward and backward over all layers.
fn time_attention(cfg: &GptConfig) -> f64 {
    let s =
        AttnShape { batch: BATCH, heads: cfg.n_head, seq: SEQ, head_dim: cfg.n_embd / cfg.n_head };
    let qkv = Qkv {
        q: randn(s.numel(), 4, 1.0),
        k: randn(s.numel(), 5, 1.0),
        v: randn(s.numel(), 6, 1.0),
    };
    let dout = randn(s.numel(), 7, 1.0);
    let t = secs(|| {
        let saved = attention_forward(s, ATTN_BLOCK.min(SEQ), None, qkv).unwrap();
        attention_backward(&saved, &dout).unwrap();
    });
    t * cfg.n_layer as f64
}

/// The rate of the limit: `gemm_gflops` on `c_fc`'s forward shape over `rows` rows, the best
/// of 40 timed products (a quarter of a second here), so that a moment of interference on a
/// shared host does not lower the limit.
fn limit_gflops(
    cfg: &GptConfig,
    rows: usize,
) -> Result<(usize, usize, usize, f64), shardline_models::ModelError> {
    let (gm, gn, gk) = (rows, 4 * cfg.n_embd, cfg.n_embd);
    Ok((gm, gn, gk, gemm_gflops(&Cpu::new(), gm, gn, gk, 40)?))
}

/// The core's peak single-precision FMA rate in GFLOP/s, measured: twelve independent vector
/// accumulators (more than FMA latency times FMA ports on current x86 cores, so the loop is
/// throughput-bound), the widest vector the CPU has, best of 5 timed runs. No product can run
/// faster than this, so `matmul FLOPs / peak` bounds a step from below whatever its kernel.
fn fma_peak_gflops() -> f64 {
    const ITERS: usize = 20_000_000;
    (0..5)
        .map(|_| {
            let t = Instant::now();
            let (lanes, sink) = peak::run(ITERS);
            let s = t.elapsed().as_secs_f64();
            std::hint::black_box(sink);
            (ITERS * 12 * lanes * 2) as f64 / s / 1e9
        })
        .fold(0.0, f64::max)
}

mod peak {
    /// Runs `iters` rounds of 12 independent FMAs; returns the vector width in lanes and a value
    /// that depends on every accumulator (so nothing is optimised away).
    pub fn run(iters: usize) -> (usize, f32) {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (checked just above).
                return (16, unsafe { x86::avx512(iters) });
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA (checked just above).
                return (8, unsafe { x86::avx2(iters) });
            }
        }
        (1, scalar(iters))
    }

    fn scalar(iters: usize) -> f32 {
        let mut acc = [0.0f32; 12];
        for _ in 0..iters {
            for a in &mut acc {
                *a = std::hint::black_box(*a).mul_add(0.999_999, 1e-7);
            }
        }
        acc.iter().sum()
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn avx2(iters: usize) -> f32 {
            let (m, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
            let mut acc = [_mm256_setzero_ps(); 12];
            for _ in 0..iters {
                for a in &mut acc {
                    *a = _mm256_fmadd_ps(*a, m, c);
                }
            }
            let mut out = [0.0f32; 8];
            let sum = acc.iter().fold(_mm256_setzero_ps(), |s, &a| _mm256_add_ps(s, a));
            // SAFETY: `out` holds the 8 floats the unaligned store writes.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
            out.iter().sum()
        }

        #[target_feature(enable = "avx512f")]
        pub unsafe fn avx512(iters: usize) -> f32 {
            let (m, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            let mut acc = [_mm512_setzero_ps(); 12];
            for _ in 0..iters {
                for a in &mut acc {
                    *a = _mm512_fmadd_ps(*a, m, c);
                }
            }
            let sum = acc.iter().fold(_mm512_setzero_ps(), |s, &a| _mm512_add_ps(s, a));
            _mm512_reduce_add_ps(sum)
        }
    }
}

fn main() -> Result<(), shardline_models::ModelError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = GptConfig {
        vocab_size: 256,
        block_size: SEQ,
        n_layer: 4,
        n_head: 4,
        n_embd: 256,
        bias: true,
        layernorm_eps: 1e-5,
        dropout: 0.0,
    };
    if args.first().map(String::as_str) == Some("--limit") {
        let batch: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(BATCH).max(1);
        let flops: f64 = shapes(&cfg, batch).iter().map(Shape::flops).sum();
        let (.., gflops) = limit_gflops(&cfg, BATCH * SEQ)?;
        let peak = fma_peak_gflops();
        println!(
            "{{\"batch\": {batch}, \"seq\": {SEQ}, \"matmul_gflop\": {:.6}, \"gemm_gflops\": {gflops:.3}, \"bound_ms\": {:.3}, \"fma_peak_gflops\": {peak:.3}, \"peak_bound_ms\": {:.3}}}",
            flops / 1e9,
            flops / (gflops * 1e9) * 1e3,
            flops / (peak * 1e9) * 1e3
        );
        return Ok(());
    }
    let runs: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    // nanoGPT's init: N(0, 0.02) weights, zero biases, unit LayerNorm weights.
    let mut params = Vec::with_capacity(cfg.num_params());
    for (i, spec) in cfg.param_specs().iter().enumerate() {
        let n = spec.numel();
        if spec.name.contains(".ln_") && spec.name.ends_with(".weight") {
            params.extend(std::iter::repeat_n(1.0f32, n));
        } else if spec.name.ends_with(".bias") {
            params.extend(std::iter::repeat_n(0.0f32, n));
        } else {
            params.extend(randn(n, 100 + i as u64, 0.02));
        }
    }
    let mut rng = SplitMix64::new(9);
    let stream: Vec<u32> =
        (0..BATCH * (SEQ + 1)).map(|_| rng.below(cfg.vocab_size) as u32).collect();
    let rows: Vec<&[u32]> = stream.chunks_exact(SEQ + 1).collect();
    let tokens: Vec<&[u32]> = rows.iter().map(|r| &r[..SEQ]).collect();
    let targets: Vec<&[u32]> = rows.iter().map(|r| &r[1..]).collect();

    let step = || {
        let (loss, grads) = cfg.loss_and_grads::<f32, _>(&params, &tokens, &targets).unwrap();
        assert!(loss.is_finite() && grads.len() == params.len());
        loss
    };
    let loss = step();
    let times: Vec<f64> = (0..runs)
        .map(|_| {
            secs(|| {
                step();
            })
        })
        .collect();
    let ms = median(times.clone()) * 1e3;
    let min_ms = times.iter().copied().fold(f64::INFINITY, f64::min) * 1e3;

    let shapes = shapes(&cfg, BATCH);
    let flops: f64 = shapes.iter().map(Shape::flops).sum();
    let (gm, gn, gk, gflops) = limit_gflops(&cfg, BATCH * SEQ)?;
    let bound_ms = flops / (gflops * 1e9) * 1e3;

    println!(
        "gpt vocab {} block {} layers {} heads {} embd {} bias {}, batch {BATCH} x {SEQ} tokens, 1 thread",
        cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.bias
    );
    println!("first loss {loss:.4}; {runs} timed steps after one warm-up");
    println!(
        "median step {ms:.1} ms (min {min_ms:.1}), {:.0} tokens/s",
        (BATCH * SEQ) as f64 / (ms / 1e3)
    );
    println!(
        "matmul work {:.2} GFLOP/step; gemm_gflops({gm} x {gn} x {gk}) = {gflops:.1} GFLOP/s -> bound {bound_ms:.1} ms; step at {:.1}% of the GEMM-bound limit ({:.1} GFLOP/s achieved)",
        flops / 1e9,
        100.0 * bound_ms / ms,
        flops / (ms / 1e3) / 1e9
    );
    println!("\nGEMM shapes per step (m x n x k, count; attention counts half of each product):");
    for s in &shapes {
        println!(
            "  {:<18} {:>5} x {:>5} x {:>5}  x{:<3} {:>7.3} GFLOP",
            s.what,
            s.m,
            s.n,
            s.k,
            s.count,
            s.flops() / 1e9
        );
    }
    let lin = time_linears(&cfg) * 1e3;
    let attn = time_attention(&cfg) * 1e3;
    println!("\nsplit of the median step (kernels timed on their own, one pass):");
    println!("  linear    {lin:>9.1} ms  {:>5.1}%", 100.0 * lin / ms);
    println!("  attention {attn:>9.1} ms  {:>5.1}%", 100.0 * attn / ms);
    println!("  rest      {:>9.1} ms  {:>5.1}%", ms - lin - attn, 100.0 * (ms - lin - attn) / ms);
    Ok(())
}
