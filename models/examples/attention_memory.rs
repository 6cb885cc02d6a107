//! Activation memory of the causal attention kernel against the sequence length, measured.
//!
//! For each `T`, runs `attention_forward` and `attention_backward` (batch 1, 4 heads, head
//! width 32, f32) under a counting allocator and reports:
//! - `kept`: heap bytes still live after the forward beyond its inputs: what backward needs
//!   (q, k, v, the output, one logsumexp per row; ATTN-1);
//! - `peak_fwd`, `peak_bwd`: the largest live heap during each call, above what was live
//!   before it;
//! - `scores`: the bytes a `T x T` score matrix per head would take, which the blocked
//!   softmax never holds.
//!
//! `kept / T` stays constant (linear in `T`) while `scores` grows as `T^2`.
//!
//!     cargo run --release -p shardline-models --example attention_memory [-- --json out.json]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use shardline_models::nn::attention::{attention_backward, attention_forward, AttnShape, Qkv};

/// Counts live heap bytes and their peak: the only way to see what a call holds.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Relaxed) + l.size();
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Relaxed);
    }
}

#[global_allocator]
static A: Counting = Counting;

fn reset_peak() -> usize {
    let now = LIVE.load(Relaxed);
    PEAK.store(now, Relaxed);
    now
}

fn main() {
    let json = std::env::args().skip_while(|a| a != "--json").nth(1);
    let (heads, d) = (4usize, 32usize);
    let mut rows = Vec::new();
    // Warm-up: the first call's one-time allocations (thread-locals, stdout) are not the
    // kernel's.
    let shape = AttnShape { batch: 1, heads, seq: 64, head_dim: d };
    let z = vec![0.0f32; shape.numel()];
    drop(
        attention_forward(shape, 64, None, Qkv { q: z.clone(), k: z.clone(), v: z })
            .expect("warm-up"),
    );
    println!(
        "{:>6} {:>12} {:>12} {:>12} {:>14} {:>10}",
        "T", "kept", "peak_fwd", "peak_bwd", "scores (TxT)", "kept/T"
    );
    for t in [64usize, 128, 256, 512, 1024, 2048] {
        let shape = AttnShape { batch: 1, heads, seq: t, head_dim: d };
        let n = shape.numel();
        let v = |s: usize| (0..n).map(|i| ((i * s) % 97) as f32 / 97.0 - 0.5).collect::<Vec<f32>>();
        let qkv = Qkv { q: v(3), k: v(5), v: v(7) };
        let inputs = 3 * n * 4;
        let before = reset_peak();
        let saved = attention_forward(shape, 64.min(t), None, qkv).expect("forward");
        let peak_fwd = PEAK.load(Relaxed) - before;
        // The inputs moved into `saved`; what is live beyond them is what forward added.
        let kept = LIVE.load(Relaxed) - before + inputs;
        let dy = v(11);
        let before = reset_peak();
        let g = attention_backward(&saved, &dy).expect("backward");
        let peak_bwd = PEAK.load(Relaxed) - before;
        drop(g);
        let scores = heads * t * t * 4;
        println!("{t:>6} {kept:>12} {peak_fwd:>12} {peak_bwd:>12} {scores:>14} {:>10}", kept / t);
        rows.push(format!(
            "{{\"T\":{t},\"kept_bytes\":{kept},\"peak_forward_bytes\":{peak_fwd},\"peak_backward_bytes\":{peak_bwd},\"scores_bytes\":{scores}}}"
        ));
    }
    if let Some(path) = json {
        let body = format!(
            "{{\"batch\":1,\"heads\":{heads},\"head_dim\":{d},\"rows\":[{}]}}\n",
            rows.join(",")
        );
        std::fs::write(&path, body).expect("write json");
        println!("wrote {path}");
    }
}
