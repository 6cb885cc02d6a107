//! `--device cuda`: where no GPU (or no `cuda` feature) is present, the run is refused with
//! `DeviceUnavailable` naming what is missing, never a panic; where a GPU answers, training on
//! it follows the CPU run (the CUDA backend computes the same step up to f32 rounding), with
//! each rank on its own GPU (VIS-1: two ranks where two GPUs are visible, else one).

mod common;
use common::*;
use shardline_runtime::engine::{cuda_devices, open_backend, Device};
use shardline_runtime::train::TrainConfig;
use shardline_runtime::RuntimeError;

#[test]
fn cuda_device_trains_like_the_cpu_or_is_unavailable() {
    let mut cfg = small_cfg(2, 3, 6, 60);
    cfg.device = Device::Cuda(0);
    match open_backend(Device::Cuda(0), 1) {
        Err(RuntimeError::DeviceUnavailable(what)) => {
            assert!(!what.is_empty());
            // The run is refused the same way, before any step.
            let r = run_with_deadline(cfg, quiet());
            assert!(
                matches!(r, Err(RuntimeError::DeviceUnavailable(_))),
                "a run on an absent device must fail with DeviceUnavailable: {r:?}"
            );
            println!("skipped: no usable GPU ({what})");
        }
        Err(e) => panic!("opening the GPU failed with an unexpected error: {e}"),
        Ok(be) => {
            // Each rank opens its own GPU, so the world is at most the GPUs visible.
            let world = cuda_devices().expect("a GPU opened, so the driver counts").clamp(1, 2);
            println!("training on {} with {world} ranks", be.name());
            let cpu = run_ok(small_cfg(world, 3, 6, 60), quiet());
            let gpu = run_ok(TrainConfig { world, ..cfg }, quiet());
            // cuBLAS sums in another order than gemm: allow f32 rounding over 6 steps.
            let pd = max_abs_diff(&gpu.final_params, &cpu.final_params);
            let last = |s: &shardline_runtime::train::Summary| *s.losses.last().unwrap();
            let lrel = ((last(&gpu) - last(&cpu)) / last(&cpu)).abs();
            println!("figure: --device cuda vs cpu, 6 steps: params max abs diff {pd:e}, final loss rel diff {lrel:e}");
            assert!(pd <= 1e-4, "parameters differ by {pd:e}");
            assert!(lrel <= 1e-4, "final loss differs by {lrel:e}");
        }
    }
}
