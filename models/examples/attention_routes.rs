//! Time of the causal attention kernel's two routes, forward and backward, on one rank's
//! share of the `gpt` benchmark configuration (batch 8, 4 heads, 128 tokens, head width 64,
//! f32, one thread):
//! - `tokens`: [`attention_forward_tokens`] and [`attention_backward_tokens`], reading q, k,
//!   v in place from the fused `c_attn` rows and writing the merged output (what the `gpt`
//!   module runs, ATTN-5);
//! - `split+heads+merge`: [`split_qkv`], [`attention_forward`] with the heads apart,
//!   [`merge_heads`], and their backwards (the copies the module made before).
//!
//! Prints the minimum and median over the repetitions, in milliseconds.
//!
//!     cargo run --release -p shardline-models --example attention_routes [-- REPS]

use std::time::Instant;

use shardline_models::nn::attention::{
    attention_backward, attention_backward_tokens, attention_forward, attention_forward_tokens,
    merge_heads, merge_heads_backward, split_qkv, split_qkv_backward, AttnShape,
};

/// The attention block of the `gpt` module.
const BLOCK: usize = 64;

fn tokens(s: AttnShape, qkv: &[f32], dy: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f32; s.numel()];
    let saved = attention_forward_tokens(s, BLOCK, None, qkv.to_vec(), &mut out).expect("fwd");
    attention_backward_tokens(&saved, &out, dy).expect("bwd")
}

fn split_heads_merge(s: AttnShape, qkv: &[f32], dy: &[f32]) -> Vec<f32> {
    let saved = attention_forward(s, BLOCK, None, split_qkv(s, qkv).expect("split")).expect("fwd");
    std::hint::black_box(merge_heads(s, saved.output()).expect("merge"));
    let g = attention_backward(&saved, &merge_heads_backward(s, dy).expect("merge bwd"));
    split_qkv_backward(s, &g.expect("bwd")).expect("split bwd")
}

fn summary(mut ms: Vec<f64>) -> String {
    ms.sort_by(f64::total_cmp);
    format!("min {:.2} median {:.2}", ms[0], ms[ms.len() / 2])
}

fn main() {
    let reps: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(30).max(1);
    let s = AttnShape { batch: 8, heads: 4, seq: 128, head_dim: 64 };
    let qkv: Vec<f32> = (0..3 * s.numel()).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect();
    let dy: Vec<f32> = (0..s.numel()).map(|i| ((i % 89) as f32 - 44.0) * 0.01).collect();
    let (mut a, mut b) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    // The two routes alternate, so that a busy host slows both alike.
    for _ in 0..reps {
        let t = Instant::now();
        std::hint::black_box(tokens(s, &qkv, &dy));
        a.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        std::hint::black_box(split_heads_merge(s, &qkv, &dy));
        b.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!("{s:?}, block {BLOCK}, {reps} repetitions, forward + backward");
    println!("tokens:            {} ms", summary(a));
    println!("split+heads+merge: {} ms", summary(b));
}
