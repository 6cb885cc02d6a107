//! Times the CPU backend's matrix multiply on the three shapes of a linear layer's step
//! (forward, weight gradient, input gradient) for `out x in` at batch `n`, one thread.
//!
//! `cargo run --release -p shardline-models --example gemm_shapes -- [n] [in] [out]`

use shardline_models::{Backend, Cpu, GemmShape, ModelError};
use std::time::Instant;

fn main() -> Result<(), ModelError> {
    let a: Vec<usize> = std::env::args().skip(1).filter_map(|s| s.parse().ok()).collect();
    let (n, i, o) = (
        a.first().copied().unwrap_or(128),
        a.get(1).copied().unwrap_or(1024),
        a.get(2).copied().unwrap_or(1024),
    );
    let be = Cpu::new();
    let x: Vec<f32> = (0..n * i).map(|k| (k % 7) as f32 * 0.1).collect();
    let w: Vec<f32> = (0..o * i).map(|k| (k % 5) as f32 * 0.1).collect();
    let dy: Vec<f32> = (0..n * o).map(|k| (k % 3) as f32 * 0.1).collect();
    let mut y = vec![0.0f32; n * o];
    let mut gw = vec![0.0f32; o * i];
    let mut gx = vec![0.0f32; n * i];
    let flops = 2.0 * (n * i * o) as f64;
    let time = |f: &mut dyn FnMut() -> Result<(), ModelError>| -> Result<f64, ModelError> {
        let mut ts = Vec::new();
        for _ in 0..15 {
            let t = Instant::now();
            f()?;
            ts.push(t.elapsed().as_secs_f64());
        }
        ts.sort_by(f64::total_cmp);
        Ok(ts[ts.len() / 2])
    };
    let t = time(&mut || {
        be.gemm(
            GemmShape { m: n, n: o, k: i, trans_a: false, trans_b: true },
            &x,
            &w,
            &mut y,
            false,
        )
    })?;
    println!("forward  y[n,o] = x w^T      {:7.3} ms {:6.1} GFLOP/s", t * 1e3, flops / t / 1e9);
    let t = time(&mut || {
        be.gemm(
            GemmShape { m: o, n: i, k: n, trans_a: true, trans_b: false },
            &dy,
            &x,
            &mut gw,
            false,
        )
    })?;
    println!("weight   dW[o,i] = dy^T x    {:7.3} ms {:6.1} GFLOP/s", t * 1e3, flops / t / 1e9);
    let t = time(&mut || {
        be.gemm(
            GemmShape { m: o, n: i, k: n, trans_a: true, trans_b: false },
            &dy,
            &x,
            &mut gw,
            true,
        )
    })?;
    println!("weight+  dW += dy^T x        {:7.3} ms {:6.1} GFLOP/s", t * 1e3, flops / t / 1e9);
    let t = time(&mut || {
        be.gemm(
            GemmShape { m: n, n: i, k: o, trans_a: false, trans_b: false },
            &dy,
            &w,
            &mut gx,
            false,
        )
    })?;
    println!("input    dx[n,i] = dy w      {:7.3} ms {:6.1} GFLOP/s", t * 1e3, flops / t / 1e9);
    Ok(())
}
