//! Figures of the CUDA device for the device check (`bench/device-bundle/run.sh` collects
//! every line starting `figure:` into its summary): cuBLAS through [`Op::Gemm`] in TFLOP/s,
//! and a training step of a two-layer GELU perceptron written as ops, timed on the GPU and on
//! the host device (which runs the same ops' host references), with their results compared.
//! Without a GPU each test prints `skipped: ...`.

use std::sync::Arc;
use std::time::Instant;

use shardline_collectives::device::{CpuDevice, Device, DeviceBuffer, DeviceError};

use super::device::CudaDevice;
use crate::backend::GemmShape;
use crate::nn::activation::Activation;
use crate::nn::linear::Linear;
use crate::ops::{AdamWStep, Op};
use crate::rng::SplitMix64;

fn gpu(test: &str) -> Option<Arc<CudaDevice>> {
    match CudaDevice::open(0, None) {
        Ok(d) => Some(Arc::new(d)),
        Err(DeviceError::Unavailable(why)) => {
            println!("skipped: {test}: {why}");
            None
        }
        Err(e) => panic!("{test}: a GPU that does not open: {e}"),
    }
}

fn put(d: &dyn Device, s: usize, v: &[f32], label: &str) -> DeviceBuffer {
    let b = d.alloc(v.len(), label).unwrap();
    d.upload(s, v, &b).unwrap();
    b
}

fn randn(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * scale).collect()
}

/// Waits for everything enqueued on `s` so far.
fn sync(d: &dyn Device, s: usize) {
    d.synchronize(&d.record(s)).unwrap();
}

#[test]
fn figure_gemm_tflops_through_the_gemm_op() {
    let Some(d) = gpu("figure_gemm_tflops_through_the_gemm_op") else { return };
    let s = d.stream("compute");
    let n = 4096;
    let mut rng = SplitMix64::new(1);
    let a = put(&*d, s, &randn(&mut rng, n * n, 0.01), "a");
    let b = put(&*d, s, &randn(&mut rng, n * n, 0.01), "b");
    let c = d.alloc(n * n, "c").unwrap();
    let shape = GemmShape { m: n, n, k: n, trans_a: false, trans_b: false };
    let op = Op::Gemm { shape, accumulate: false }.arc();
    d.launch_op(s, Arc::clone(&op), &[&a, &b], &[&c]).unwrap();
    sync(&*d, s);
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        d.launch_op(s, Arc::clone(&op), &[&a, &b], &[&c]).unwrap();
    }
    sync(&*d, s);
    let secs = t.elapsed().as_secs_f64() / f64::from(reps);
    let tflops = 2.0 * (n as f64).powi(3) / secs / 1e12;
    println!("figure: gemm 4096^3 f32 via Op::Gemm on {}: {tflops:.1} TFLOP/s", d.name());
    assert!(tflops > 0.0);
}

/// One AdamW step of `x -> Linear -> GELU -> Linear -> cross-entropy` on `d`, every kernel
/// an op; returns the loss of each of `steps` steps and the seconds per step after the first.
fn mlp_steps(
    d: &dyn Device,
    rows: usize,
    dims: (usize, usize, usize),
    steps: u64,
) -> (Vec<f32>, f64) {
    let (din, hid, classes) = dims;
    let s = d.stream("compute");
    let (l1, l2) = (Linear::new(din, hid, true), Linear::new(hid, classes, true));
    let mut rng = SplitMix64::new(7);
    let p1 = put(d, s, &randn(&mut rng, l1.num_params(), 0.05), "p1");
    let p2 = put(d, s, &randn(&mut rng, l2.num_params(), 0.05), "p2");
    let x = put(d, s, &randn(&mut rng, rows * din, 1.0), "x");
    let t: Vec<f32> = (0..rows).map(|i| f32::from_bits((i * 7 % classes) as u32)).collect();
    let t = put(d, s, &t, "targets");
    let z = |n: usize, l: &str| d.alloc(n, l).unwrap();
    let (h, a, y) = (z(rows * hid, "h"), z(rows * hid, "a"), z(rows * classes, "y"));
    let (loss, dy) = (z(1, "loss"), z(rows * classes, "dy"));
    let (da, dh) = (z(rows * hid, "da"), z(rows * hid, "dh"));
    let (g1, g2) = (z(l1.num_params(), "g1"), z(l2.num_params(), "g2"));
    let (m1, m2) = (z(2 * l1.num_params(), "m1"), z(2 * l2.num_params(), "m2"));
    let run = |op: Op, r: &[&DeviceBuffer], w: &[&DeviceBuffer]| {
        d.launch_op(s, op.arc(), r, w).unwrap_or_else(|e| panic!("{e}"))
    };
    let mut losses = Vec::new();
    let mut t0 = Instant::now();
    for step in 1..=steps {
        if step == 2 {
            sync(d, s);
            t0 = Instant::now();
        }
        run(Op::LinearForward(l1), &[&p1, &x], &[&h]);
        run(Op::Activation(Activation::Gelu), &[&h], &[&a]);
        run(Op::LinearForward(l2), &[&p2, &a], &[&y]);
        run(Op::CrossEntropy { vocab: classes, dloss: 1.0 }, &[&y, &t], &[&loss, &dy]);
        run(Op::Fill { value: 0.0 }, &[], &[&g1]);
        run(Op::Fill { value: 0.0 }, &[], &[&g2]);
        run(Op::LinearBackward { linear: l2, input_grad: true }, &[&p2, &a, &dy], &[&g2, &da]);
        run(Op::ActivationBackward(Activation::Gelu), &[&h, &da], &[&dh]);
        run(Op::LinearBackward { linear: l1, input_grad: false }, &[&p1, &x, &dh], &[&g1]);
        let adamw =
            AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step };
        run(Op::AdamW(adamw), &[&g1], &[&p1, &m1]);
        run(Op::AdamW(adamw), &[&g2], &[&p2, &m2]);
        losses.push(d.download(s, &loss).unwrap().wait(d).unwrap()[0]);
    }
    sync(d, s);
    let per = t0.elapsed().as_secs_f64() / (steps.max(2) - 1) as f64;
    (losses, per)
}

#[test]
fn figure_a_training_step_as_ops_on_the_gpu_against_the_host_device() {
    let test = "figure_a_training_step_as_ops_on_the_gpu_against_the_host_device";
    let Some(d) = gpu(test) else { return };
    // 2048 rows of 512 features, hidden 2048, 256 classes: about 13 GFLOP per step.
    let (rows, dims, steps) = (2048, (512, 2048, 256), 4);
    let (gl, gs) = mlp_steps(&*d, rows, dims, steps);
    let (cl, cs) = mlp_steps(&CpuDevice::new(), rows, dims, steps);
    println!(
        "figure: mlp step as ops (2048 x 512 -> 2048 GELU -> 256, AdamW): {:.2} ms on {}, \
         {:.1} ms on the host device, {:.0}x",
        gs * 1e3,
        d.name(),
        cs * 1e3,
        cs / gs
    );
    for (i, (g, c)) in gl.iter().zip(&cl).enumerate() {
        assert!(
            (g - c).abs() <= 1e-3 * c.abs().max(1.0),
            "step {i}: loss {g} on the GPU, {c} on the host"
        );
    }
}
