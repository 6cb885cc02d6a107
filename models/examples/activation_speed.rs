//! Times the exact GELU's `f32` forward that saves its derivative
//! (`Activation::forward_saving_derivative`, what the `gpt` model's MLP calls) on the
//! benchmark step's shape: `[16 * 128, 4 * 256]` values drawn from a normal of std 1, one
//! thread. Prints the median over runs in ms and ns per element.
//!
//! `cargo run --release -p shardline-models --example activation_speed -- [runs]`

use shardline_models::nn::Activation;
use shardline_models::rng::SplitMix64;
use std::time::Instant;

/// Rows (16 sequences of 128 tokens) times the MLP's hidden width (4 * 256).
const N: usize = 16 * 128 * 4 * 256;

fn main() {
    let runs: usize = match std::env::args().nth(1) {
        None => 21,
        Some(s) => match s.parse() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("activation_speed: runs must be a positive integer, got {s:?}");
                std::process::exit(2);
            }
        },
    };
    let mut rng = SplitMix64::new(1);
    let x: Vec<f32> = (0..N).map(|_| rng.normal()).collect();
    let (mut d, mut y) = (x.clone(), vec![0.0f32; N]);
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        d.copy_from_slice(&x);
        let t = Instant::now();
        Activation::Gelu.forward_saving_derivative(&mut d, &mut y).expect("same lengths");
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    // A checksum, so the work cannot be optimised away and two builds can be compared.
    let sum: f64 = y.iter().zip(&d).map(|(&a, &b)| f64::from(a) + f64::from(b)).sum();
    println!(
        "gelu f32 forward+derivative, {N} elements: median {:.3} ms ({:.3} ns/element), \
         min {:.3} ms, checksum {sum:.6}",
        med * 1e3,
        med * 1e9 / N as f64,
        times[0] * 1e3
    );
}
