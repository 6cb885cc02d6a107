//! Compares matrix multiply implementations on this machine (single-threaded f32):
//! the `gemm` crate (the backend's choice), `matrixmultiply`, and a naive loop.
//!
//! `cargo run --release -p shardline-models --example gemm_compare`

use shardline_models::backend::{gemm_gflops, matrixmultiply_gflops, Backend, Cpu, GemmShape};
use shardline_models::ModelError;
use std::time::Instant;

fn best_of<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn main() -> Result<(), ModelError> {
    let shapes = [(256usize, 1024usize, 1024usize), (256, 1024, 784), (1024, 1024, 256)];
    println!("{:>20} {:>12} {:>16} {:>12}", "m x n x k", "gemm", "matrixmultiply", "naive");
    for &(m, n, k) in &shapes {
        let a: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
        let mut c = vec![0.0f32; m * n];
        let flops = 2.0 * (m * n * k) as f64 / 1e9;
        let g = gemm_gflops(&Cpu::new(), m, n, k, 5)?;
        let mm = matrixmultiply_gflops(m, n, k, 5);
        // i-p-j order keeps the inner loop contiguous so the compiler vectorises it; this is
        // the best a plain loop does.
        let naive = flops
            / best_of(1, || {
                c.fill(0.0);
                for i in 0..m {
                    let crow = &mut c[i * n..(i + 1) * n];
                    for p in 0..k {
                        let av = a[i * k + p];
                        let brow = &b[p * n..(p + 1) * n];
                        for (cv, bv) in crow.iter_mut().zip(brow) {
                            *cv += av * bv;
                        }
                    }
                }
            });
        println!(
            "{:>20} {:>10.1} GF {:>14.1} GF {:>10.1} GF",
            format!("{m}x{n}x{k}"),
            g,
            mm,
            naive
        );
    }
    let be = Cpu::new();
    let (m, n, k) = (1024, 1024, 256);
    let a: Vec<f32> = vec![0.5; k * m];
    let b: Vec<f32> = vec![0.25; k * n];
    let mut c = vec![0.0f32; m * n];
    // A failed multiply ends the loop early; it is reported below, not timed.
    let mut failed = Ok(());
    let t = best_of(5, || {
        if failed.is_ok() {
            failed = be.gemm(
                GemmShape { m, n, k, trans_a: true, trans_b: false },
                &a,
                &b,
                &mut c,
                false,
            );
        }
    });
    failed?;
    println!(
        "gemm with transposed A (1024x1024x256): {:.1} GF",
        2.0 * (m * n * k) as f64 / t / 1e9
    );
    Ok(())
}
