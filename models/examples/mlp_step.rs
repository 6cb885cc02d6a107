//! Times one training step (forward, loss, backward) of `mlp-bn` 784 -> 4x1024 -> 10 at
//! batch 256 on one thread, the shape of the PyTorch comparison in the benchmarks.
//!
//! `cargo run --release -p shardline-models --example mlp_step`
//!
//! On the development machine (AVX-512, one thread) the median step was 47.8 ms (54.4 ms
//! before the forward's `x w^T` went through a column-major scratch, see `gemm_shapes`).

use shardline_models::{Cpu, Ctx, MlpBn, Tensor};
use std::time::Instant;

fn main() -> Result<(), shardline_models::ModelError> {
    let m = MlpBn { input_dim: 784, hidden: 1024, depth: 4, classes: 10 }.build();
    let params: Vec<Vec<f32>> =
        (0..m.num_units()).map(|u| m.init_params(u, 0)).collect::<Result<_, _>>()?;
    let mut buffers: Vec<Vec<f32>> =
        (0..m.num_units()).map(|u| m.init_buffers(u)).collect::<Result<_, _>>()?;
    let n = 256;
    let x = Tensor::new(
        vec![n, 784],
        (0..n * 784).map(|i| ((i * 7919) % 255) as f32 / 255.0).collect(),
    )?;
    let y: Vec<u32> = (0..n as u32).map(|i| i % 10).collect();
    let be = Cpu::new();
    let ctx = Ctx::new(&be, true, n);
    let mut times = Vec::new();
    for _ in 0..6 {
        let t = Instant::now();
        let (loss, grads) = m.loss_and_grads(&params, &mut buffers, x.clone(), &y, &ctx)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(loss.is_finite() && !grads.is_empty());
    }
    times.sort_by(f64::total_cmp);
    println!(
        "mlp-bn 784-4x1024-10 batch {n}: median step {:.1} ms (min {:.1})",
        times[times.len() / 2],
        times[0]
    );
    Ok(())
}
