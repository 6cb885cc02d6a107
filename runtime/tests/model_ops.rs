//! The engine on lowered calls (LOWDEV-1): with the model's calls and loss lowered to device ops
//! (`DeviceOptions::model_ops`), the engine trains on a simulated device that refuses every
//! host kernel, bitwise as the cpu device running the modules' host code: what a GPU needs
//! to train a model end to end without a host round trip.
//!
//! Every run is bounded: the communicators give up after `timeout_s`, the simulated
//! device's host waits after twice that, and `run_on_devices` after four times that.

mod common;

use common::{bits_eq, gpt_cfg, losses_bits_eq, small_cfg};
use shardline_collectives::device::SimOptions;
use shardline_runtime::engine::on_device::{run_on_devices, DeviceKind, DeviceOptions, DeviceRun};
use shardline_runtime::engine::Recompute;
use shardline_runtime::memory::Category;
use shardline_runtime::optim::WeightDecayOn;
use shardline_runtime::train::{SyncBnMode, TrainConfig};
use std::time::Duration;

/// A simulated device that runs no host code at all (SIM-4), with delays.
fn no_host_code(seed: u64) -> DeviceKind {
    DeviceKind::Sim(SimOptions {
        seed,
        max_delay_us: 100,
        timeout: Duration::from_secs(60),
        ops_only: true,
        ..SimOptions::default()
    })
}

/// The model's calls and loss as ops.
fn ops() -> DeviceOptions {
    DeviceOptions { model_ops: true, ..DeviceOptions::default() }
}

fn run(cfg: &TrainConfig, kind: DeviceKind, opts: DeviceOptions) -> DeviceRun {
    run_on_devices(cfg, kind.clone(), opts)
        .unwrap_or_else(|e| panic!("{} stage {:?} on {kind:?}: {e}", cfg.model, cfg.stage))
}

fn same(a: &DeviceRun, b: &DeviceRun) -> bool {
    let losses = |r: &DeviceRun| r.steps.iter().map(|s| s.loss).collect::<Vec<_>>();
    bits_eq(&a.final_params, &b.final_params)
        && losses_bits_eq(&losses(a), &losses(b))
        && a.steps.iter().zip(&b.steps).all(|(x, y)| x.grad_norm.to_bits() == y.grad_norm.to_bits())
}

/// The narrow gpt: AdamW with nanoGPT's decay groups and clipping, or SGD.
fn gpt(world: usize, stage: u8, adamw: bool) -> TrainConfig {
    let mut c = gpt_cfg(world, stage, 4);
    c.steps = Some(3);
    c.prefetch = 1;
    c.timeout_s = 20;
    if adamw {
        c.optimizer = "adamw".into();
        c.lr = 3e-3;
        c.weight_decay = 0.1;
        c.weight_decay_on = WeightDecayOn::Matrices;
        c.clip_grad_norm = Some(0.5);
    }
    c
}

#[test]
fn gpt_trains_as_ops_with_no_host_code_bitwise_as_the_host_modules_lowdev_1() {
    let mut rows = 0;
    for stage in 0..4u8 {
        let mut accum = gpt(2, stage, false);
        accum.grad_accum = 2;
        let recomputed = TrainConfig { recompute: Recompute::Units, ..gpt(2, stage, true) };
        for cfg in [gpt(2, stage, true), accum, recomputed] {
            let want = run(&cfg, DeviceKind::Cpu, DeviceOptions::default());
            let got = run(&cfg, no_host_code(7 + u64::from(stage)), ops());
            assert!(same(&got, &want), "stage {stage} accum {}: ops differ", cfg.grad_accum);
            assert!(got.steps.iter().all(|s| s.loss.is_finite()));
            // Every value the ops made is freed by the end of each step.
            for s in &got.steps {
                assert_eq!(s.memory.current(Category::Activations), 0, "stage {stage}");
            }
            rows += 1;
        }
    }
    assert_eq!(rows, 12);
}

/// The zoo's wide-mlp (linear and ReLU blocks) as ops, at every stage, with clipping.
fn wide(world: usize, stage: u8) -> TrainConfig {
    TrainConfig {
        model: "wide-mlp".into(),
        params: 20_000,
        clip_grad_norm: Some(0.5),
        timeout_s: 20,
        ..small_cfg(world, stage, 3, 16)
    }
}

#[test]
fn the_zoo_wide_mlp_trains_as_ops_bitwise_lowdev_1() {
    for stage in 0..4u8 {
        let cfg = wide(2, stage);
        let want = run(&cfg, DeviceKind::Cpu, DeviceOptions::default());
        let got = run(&cfg, no_host_code(3), ops());
        assert!(same(&got, &want), "wide-mlp stage {stage}: ops differ");
    }
}

/// The zoo's BatchNorm models as ops: mlp-bn with per-rank BatchNorm and with
/// SyncBatchNorm (its statistics and gradient sums as collectives of the programs), with
/// accumulation and with recomputation (the running statistics updated once), over 2 and 3
/// ranks; convnet-bn (convolutions, pooling, residual blocks with downsampling shortcuts)
/// and resnet-bn (the same as modules) with SyncBatchNorm. Each bitwise the cpu device running the zoo's host code, final
/// running statistics included.
#[test]
fn the_zoo_bn_and_conv_models_train_as_ops_bitwise_lowdev_1() {
    let mlp = |world: usize, stage: u8, sync: bool| TrainConfig {
        sync_bn: if sync { SyncBnMode::On } else { SyncBnMode::Off },
        timeout_s: 20,
        ..small_cfg(world, stage, 3, 24)
    };
    let mut rows = 0;
    for stage in 0..4u8 {
        let accum = TrainConfig { grad_accum: 2, ..mlp(2, stage, true) };
        let recomputed = TrainConfig { recompute: Recompute::Units, ..mlp(3, stage, true) };
        let conv = TrainConfig { model: "convnet-bn".into(), ..mlp(2, stage, true) };
        let resnet =
            TrainConfig { model: "resnet-bn".into(), width: Some(4), ..mlp(2, stage, true) };
        for cfg in [mlp(2, stage, false), mlp(3, stage, true), accum, recomputed, conv, resnet] {
            let what =
                format!("{} world {} stage {stage} sync {:?}", cfg.model, cfg.world, cfg.sync_bn);
            let want = run(&cfg, DeviceKind::Cpu, DeviceOptions::default());
            let got = run(&cfg, no_host_code(20 + u64::from(stage)), ops());
            assert!(same(&got, &want), "{what}: ops differ");
            assert!(bits_eq(&got.final_buffers, &want.final_buffers), "{what}: running statistics");
            assert!(got.final_buffers.iter().any(|b| !b.is_empty()), "{what}: has BatchNorm");
            rows += 1;
        }
    }
    assert_eq!(rows, 24);
}

#[test]
fn a_model_that_does_not_lower_is_refused_by_name_lowdev_1() {
    // gpt's dropout while training does not lower.
    let mut cfg = gpt(2, 3, false);
    cfg.dropout = Some(0.1);
    let e = run_on_devices(&cfg, no_host_code(1), ops()).unwrap_err().to_string();
    assert!(e.contains("--model-ops") && e.contains("transformer.drop"), "{e}");
    // Without model ops, the first forward is the refused host kernel.
    let e = run_on_devices(&gpt(2, 3, false), no_host_code(1), DeviceOptions::default());
    let e = e.unwrap_err().to_string();
    assert!(e.contains("'forward") && e.contains("host code"), "{e}");
}

/// `train --device sim --model-ops`: the same run as without it (final and test loss
/// bitwise, evaluation included), on devices that refuse other host code; a model whose
/// modules do not all lower, and the flag without `--device sim`, exit 2 naming the flag.
#[test]
fn the_model_ops_flag_trains_gpt_as_without_it_and_refuses_what_it_cannot_lowdev_1() {
    let dir = std::env::temp_dir().join(format!("shardline-model-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    let words = "the quick brown fox jumps over the lazy dog; ".repeat(40);
    std::fs::write(&text, words).unwrap();
    let data = format!("text:{}", text.display());
    let base = [
        "train",
        "--device",
        "sim",
        "--model",
        "gpt",
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--block-size",
        "16",
        "--dataset",
        &data,
        "--world",
        "2",
        "--stage",
        "3",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--optimizer",
        "adamw",
        "--lr",
        "3e-3",
    ];
    let summary = |name: &str, extra: &[&str]| {
        let p = dir.join(format!("{name}.json"));
        let args = [&base[..], extra, &["--summary-json", p.to_str().unwrap()]].concat();
        let out = common::shardline(&args);
        assert_eq!(out.code, Some(0), "{name}: {}", out.stderr);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        (v, out.stdout)
    };
    let (host, _) = summary("host", &[]);
    let (ops, stdout) = summary("ops", &["--model-ops"]);
    assert!(stdout.contains("run as device ops (--model-ops)"), "{stdout}");
    for k in ["final_loss", "test_loss"] {
        assert_eq!(ops[k].as_f64(), host[k].as_f64(), "{k}");
        assert!(ops[k].as_f64().unwrap().is_finite(), "{k}");
    }
    let refused = |args: &[&str], want: &str| {
        let out = common::shardline(args);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains(want), "{args:?}: {}", out.stderr);
    };
    refused(&[&base[..], &["--model-ops", "--dropout", "0.1"]].concat(), "--dropout 0.1");
    let cpu = ["train", "--model-ops", "--steps", "1", "--dataset", "synthetic"];
    refused(&cpu, "--model-ops runs on the device engine");
    // On GPUs: without a GPU (or the `cuda` feature) the device is refused before any step.
    if cfg!(not(feature = "cuda")) {
        let gpu = [&base[..], &["--model-ops"]].concat();
        let gpu: Vec<&str> = gpu.iter().map(|a| if *a == "sim" { "cuda" } else { a }).collect();
        refused(&gpu, "device unavailable");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// On a GPU (feature `cuda`): gpt as model ops on the CUDA device, its gathers and
/// reductions over NCCL, follows the same run on the cpu device (the ops' host references)
/// to f32 rounding, at world 1 (2 where two GPUs are visible): the narrow gpt, and the
/// torch benchmark's configuration (4 layers, 4 heads, embd 256, block 128, global batch 16),
/// whose step times are reported as figures. Without a GPU it says so and checks nothing.
#[cfg(feature = "cuda")]
#[test]
fn gpt_on_the_cuda_device_follows_the_cpu_device_lowdev_1() {
    use shardline_collectives::device::DeviceError;
    use shardline_runtime::RuntimeError;
    let world = shardline_runtime::engine::cuda_devices().unwrap_or(1).clamp(1, 2);
    let mut bench = gpt(world, 3, true);
    (bench.n_layer, bench.n_head, bench.n_embd, bench.block_size) =
        (Some(4), Some(4), Some(256), Some(128));
    bench.batch_size = 16;
    let models = [
        ("narrow gpt", gpt(world, 3, true)),
        ("gpt embd 256 block 128", bench),
        ("wide-mlp", wide(world, 3)),
        (
            "mlp-bn (SyncBatchNorm)",
            TrainConfig { sync_bn: SyncBnMode::On, ..small_cfg(world, 3, 3, 24) },
        ),
        ("convnet-bn", TrainConfig { model: "convnet-bn".into(), ..small_cfg(world, 3, 3, 24) }),
        (
            "resnet-bn",
            TrainConfig { model: "resnet-bn".into(), width: Some(4), ..small_cfg(world, 3, 3, 24) },
        ),
    ];
    for (name, cfg) in models {
        let cuda = match run_on_devices(&cfg, DeviceKind::Cuda, ops()) {
            Err(RuntimeError::Device(DeviceError::Unavailable(what))) => {
                println!("skipped: no usable GPU ({what})");
                return;
            }
            r => r.unwrap_or_else(|e| panic!("{name} on the CUDA device: {e}")),
        };
        let cpu = run(&cfg, DeviceKind::Cpu, ops());
        let median = |r: &DeviceRun| {
            let mut t: Vec<f64> =
                r.steps.iter().skip(1).map(|s| s.step_time.as_secs_f64()).collect();
            t.sort_by(f64::total_cmp);
            t[t.len() / 2] * 1e3
        };
        let pd = common::max_abs_diff(&cuda.final_params, &cpu.final_params);
        let rel: f32 = cuda
            .steps
            .iter()
            .zip(&cpu.steps)
            .map(|(a, b)| ((a.loss - b.loss) / b.loss).abs())
            .fold(0.0, f32::max);
        let (tc, th) = (median(&cuda), median(&cpu));
        println!(
            "figure: {name} stage 3 world {world} as model ops, {} steps: cuda {tc:.2} ms/step, \
             cpu device {th:.1} ms/step ({:.1}x); losses rel diff {rel:e}, params max abs diff {pd:e}",
            cfg.steps.unwrap_or(0),
            th / tc
        );
        assert!(rel <= 1e-4, "{name}: losses differ by {rel:e}");
        assert!(pd <= 1e-4, "{name}: parameters differ by {pd:e}");
    }
}
