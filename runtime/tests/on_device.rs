//! The engine on devices (DEV-1..4): the simulated accelerator gives bitwise the results of
//! the cpu device across stages, prefetch depths, worlds and delay seeds; the cpu device
//! gives the host engine's results (bitwise at world 1, where no reduction reorders a sum);
//! each negative control is refused by name; a desync names the ranks and the calls.
//!
//! Every run is bounded: the communicators give up after `timeout_s`, the simulated
//! device's host waits after twice that, and `run_on_devices` after four times that.

mod common;

use common::{bits_eq, gpt_cfg, losses_bits_eq, max_abs_diff, quiet, run_ok, small_cfg};
use shardline_collectives::device::SimOptions;
use shardline_runtime::engine::on_device::{
    run_on_devices, DeviceKind, DeviceOptions, DeviceRun, InjectedBug, Offload,
};
use shardline_runtime::engine::Recompute;
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{SyncBnMode, TrainConfig};
use std::time::Duration;

fn sim(seed: u64) -> DeviceKind {
    DeviceKind::Sim(SimOptions {
        seed,
        max_delay_us: 150,
        timeout: Duration::from_secs(60),
        ..SimOptions::default()
    })
}

/// The small mlp-bn of the other tests, with per-rank BatchNorm.
fn mlp(world: usize, stage: u8, prefetch: usize) -> TrainConfig {
    let mut c = small_cfg(world, stage, 3, 24);
    c.sync_bn = SyncBnMode::Off;
    c.prefetch = prefetch;
    c.timeout_s = 20;
    c
}

/// The same with SyncBatchNorm.
fn mlp_sync(world: usize, stage: u8, prefetch: usize) -> TrainConfig {
    TrainConfig { sync_bn: SyncBnMode::On, ..mlp(world, stage, prefetch) }
}

/// `cfg` with every call but the last recomputed in backward (RECOMP-1).
fn recomputed(cfg: TrainConfig) -> TrainConfig {
    TrainConfig { recompute: Recompute::Units, ..cfg }
}

/// The narrow gpt, its gradient clipped (its norm is about 2 at the start, so the clip acts).
fn gpt(world: usize, stage: u8, prefetch: usize) -> TrainConfig {
    let mut c = gpt_cfg(world, stage, 4);
    c.steps = Some(2);
    c.clip_grad_norm = Some(0.5);
    c.prefetch = prefetch;
    c.timeout_s = 20;
    c
}

fn run(cfg: &TrainConfig, kind: DeviceKind) -> DeviceRun {
    run_on_devices(cfg, kind.clone(), DeviceOptions::default())
        .unwrap_or_else(|e| panic!("{} world {} on {kind:?}: {e}", cfg.model, cfg.world))
}

fn losses(r: &DeviceRun) -> Vec<f32> {
    r.steps.iter().map(|s| s.loss).collect()
}

fn same(a: &DeviceRun, b: &DeviceRun) -> bool {
    bits_eq(&a.final_params, &b.final_params)
        && losses_bits_eq(&losses(a), &losses(b))
        && a.steps.iter().zip(&b.steps).all(|(x, y)| x.grad_norm.to_bits() == y.grad_norm.to_bits())
        && (a.final_buffers.iter().all(Vec::is_empty)
            || bits_eq(&a.final_buffers, &b.final_buffers))
}

/// DEV-4: the full grid (stages 0-3 x prefetch 0/1/2, worlds 2 and 3; mlp-bn with per-rank
/// BatchNorm and with SyncBN, and gpt, each of the last two also with recomputation) on the
/// simulated device with one delay seed equals the cpu device bitwise; DEV-1: one host wait
/// per step; SyncBN sends its messages.
#[test]
fn sim_equals_cpu_bitwise_across_the_grid_dev_4() {
    let mut rows = 0;
    for world in [2, 3] {
        for stage in 0..4u8 {
            for prefetch in [0, 1, 2] {
                let (sync, g) = (mlp_sync(world, stage, prefetch), gpt(world, stage, prefetch));
                let (sync_r, g_r) = (recomputed(sync.clone()), recomputed(g.clone()));
                for cfg in [mlp(world, stage, prefetch), sync, g, sync_r, g_r] {
                    let want = run(&cfg, DeviceKind::Cpu);
                    let got = run(&cfg, sim(11));
                    assert!(
                        same(&got, &want),
                        "{} world {world} stage {stage} prefetch {prefetch}: sim differs from cpu",
                        cfg.model
                    );
                    assert!(got.steps.iter().all(|s| s.host_syncs == 1), "DEV-1");
                    assert!(losses(&got).iter().all(|l| l.is_finite()));
                    let messages = got.steps[0].stats_messages;
                    assert_eq!(messages > 0, cfg.sync_bn == SyncBnMode::On, "{messages}");
                    rows += 1;
                }
            }
        }
    }
    assert_eq!(rows, 120);
}

/// SIM-4 under the engine: with only the model's calls allowed as host code ("forward",
/// "backward", "loss"), a simulated device that refuses every other host kernel runs every
/// stage, with SGD and AdamW, clipping, weight-decay groups, SyncBN, gradient accumulation
/// and recomputation, bitwise as the cpu device: gathers, reductions, accumulation, the
/// updates, the norms and the loss sums are all ops.
#[test]
fn everything_but_the_model_calls_runs_as_ops_sim_4() {
    let ops_only = DeviceKind::Sim(SimOptions {
        seed: 5,
        max_delay_us: 100,
        timeout: Duration::from_secs(60),
        ops_only: true,
        host_kernels_allowed: vec!["forward ".into(), "backward ".into(), "loss".into()],
        ..SimOptions::default()
    });
    for stage in 0..4u8 {
        let mut accum = mlp_sync(2, stage, 1);
        accum.grad_accum = 2;
        for cfg in [mlp(2, stage, 0), accum, recomputed(gpt(2, stage, 1))] {
            let want = run(&cfg, DeviceKind::Cpu);
            let got = run(&cfg, ops_only.clone());
            assert!(
                same(&got, &want),
                "{} stage {stage}: ops differ from the cpu device",
                cfg.model
            );
        }
    }
    // The control: without the model calls allowed, the first forward is refused by name.
    let refused = DeviceKind::Sim(SimOptions { ops_only: true, ..SimOptions::default() });
    let e = run_on_devices(&mlp(2, 3, 0), refused, DeviceOptions::default()).unwrap_err();
    assert!(e.to_string().contains("'forward") && e.to_string().contains("host code"), "{e}");
}

/// DEV-4: twenty delay seeds on two configurations (gpt stage 3 with prefetch, mlp-bn with
/// SyncBN at stage 2), each bitwise the cpu device's.
#[test]
fn twenty_delay_seeds_equal_cpu_bitwise_dev_4() {
    for cfg in [gpt(2, 3, 1), mlp_sync(3, 2, 0)] {
        let want = run(&cfg, DeviceKind::Cpu);
        for seed in 0..20 {
            let got = run(&cfg, sim(1000 + seed));
            assert!(same(&got, &want), "{} stage {:?} seed {seed}", cfg.model, cfg.stage);
        }
    }
}

/// The cpu device against the host engine: bitwise at world 1 (every stage), and within
/// float rounding at worlds 2 and 4, where the host's ring reduction adds in another order
/// than the device communicator's rank order.
#[test]
fn the_cpu_device_equals_the_host_engine() {
    for (world, tol) in [(1usize, 0.0f32), (2, 2e-6), (4, 2e-6)] {
        for stage in 0..4u8 {
            let (sync, g) = (mlp_sync(world, stage, 1), gpt(world, stage, 1));
            let (sync_r, g_r) = (recomputed(sync.clone()), recomputed(g.clone()));
            for cfg in [mlp(world, stage, 1), sync, g, sync_r, g_r] {
                let host = run_ok(cfg.clone(), quiet());
                let dev = run(&cfg, DeviceKind::Cpu);
                let what = format!("{} world {world} stage {stage}", cfg.model);
                let diff = max_abs_diff(&dev.final_params, &host.final_params);
                let norms = dev.steps.iter().zip(&host.step_stats);
                if world == 1 {
                    assert!(bits_eq(&dev.final_params, &host.final_params), "{what}: {diff}");
                    assert!(losses_bits_eq(&losses(&dev), &host.losses), "{what}: losses");
                    for (d, h) in norms {
                        assert_eq!(d.grad_norm.to_bits(), h.grad_norm.to_bits(), "{what}: norm");
                    }
                } else {
                    assert!(diff <= tol, "{what}: parameters differ by {diff}");
                    for (a, b) in losses(&dev).iter().zip(&host.losses) {
                        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{what}: {a} vs {b}");
                    }
                    for (d, h) in norms {
                        let (a, b) = (d.grad_norm, h.grad_norm);
                        assert!((a - b).abs() <= 1e-5 * b.max(1.0), "{what}: norm {a} vs {b}");
                    }
                }
            }
        }
    }
}

/// DEV-3, first control: without the compute stream's wait for a gather, the simulated
/// device refuses the first kernel that reads the gathered parameters, naming the buffer
/// and the gather stream, in every delay seed (HAZ-2); the cpu device, which runs every
/// call at once, cannot tell.
#[test]
fn a_missing_gather_wait_is_caught_dev_3() {
    let bug = InjectedBug { skip_gather_wait: true, ..InjectedBug::default() };
    for seed in 0..5 {
        for cfg in [gpt(2, 3, 1), mlp(2, 3, 0)] {
            let msg = refused(&cfg, sim(seed), with_bug(bug));
            assert!(msg.contains("(gathered)") && msg.contains("gather"), "{msg}");
        }
    }
    assert!(run_on_devices(&mlp(2, 3, 0), DeviceKind::Cpu, with_bug(bug)).is_ok());
}

/// DEV-3, second control: a transient gradient freed on the compute stream while its
/// reduce-scatter still reads it is refused, naming the buffer.
#[test]
fn a_gradient_freed_before_its_reduction_is_caught_dev_3() {
    let bug = InjectedBug { free_grads_on_compute: true, ..InjectedBug::default() };
    for stage in [2, 3] {
        for cfg in [gpt(2, stage, 1), mlp(2, stage, 0)] {
            let msg = refused(&cfg, sim(3), with_bug(bug));
            assert!(msg.contains("(unreduced)") && msg.contains("reduce"), "stage {stage}: {msg}");
        }
    }
}

/// SCOMM-1 through the engine: a rank that issues another collective than its peers is
/// named, with both calls, on the simulated device and on the cpu device alike.
#[test]
fn a_desync_names_the_ranks_and_the_calls() {
    let bug = InjectedBug { desync_rank: Some(1), ..InjectedBug::default() };
    for kind in [sim(5), DeviceKind::Cpu] {
        let msg = refused(&mlp(2, 2, 0), kind, with_bug(bug));
        assert!(msg.contains("desync") && msg.contains("rank 1"), "{msg}");
        assert!(msg.contains("all_reduce(1 elements)"), "{msg}");
        assert!(msg.contains("reduce_scatter"), "{msg}");
    }
}

fn with_bug(bug: InjectedBug) -> DeviceOptions {
    DeviceOptions { bug, ..DeviceOptions::default() }
}

/// The error of a run that must fail (no dump of a successful run's parameters).
fn refused(cfg: &TrainConfig, kind: DeviceKind, opts: DeviceOptions) -> String {
    match run_on_devices(cfg, kind, opts) {
        Ok(_) => panic!("{} stage {:?}: the run should have been refused", cfg.model, cfg.stage),
        Err(e) => e.to_string(),
    }
}

/// What the device engine does not run yet is refused by name, before any step.
#[test]
fn unsupported_settings_are_refused_by_name() {
    let mut c = gpt(2, 3, 1);
    c.param_dtype = shardline_runtime::engine::PrecisionDtype::Bf16;
    let msg = refused(&c, DeviceKind::Cpu, DeviceOptions::default());
    assert!(msg.contains("bf16"), "{msg}");
}

fn offloading(offload: Offload) -> DeviceOptions {
    DeviceOptions { offload, ..DeviceOptions::default() }
}

/// OFFL-1: each offload policy trains bitwise as without, on the simulated device (three
/// delay seeds), and the device holds less: the optimizer state, and with `params` also
/// the parameter shards.
#[test]
fn offloading_changes_where_values_live_not_results_offl_1() {
    for cfg in [gpt(2, 3, 1), mlp(2, 3, 0), gpt(2, 1, 0), mlp(3, 0, 0), mlp(2, 2, 1)] {
        let want = run(&cfg, DeviceKind::Cpu);
        let stage3 = cfg.stage == shardline_runtime::train::StageChoice::Fixed(Stage::Zero3);
        let mut policies = vec![Offload::Optimizer];
        if stage3 {
            policies.push(Offload::Params);
        }
        let mut last = want.max_device_bytes;
        for offload in policies {
            for seed in 0..3 {
                let got = run_on_devices(&cfg, sim(seed), offloading(offload))
                    .unwrap_or_else(|e| panic!("{offload:?}: {e}"));
                let what = format!("{} {:?} {offload:?} seed {seed}", cfg.model, cfg.stage);
                assert!(same(&got, &want), "{what}: results differ");
                assert!(got.max_device_bytes < last, "{what}: {} bytes", got.max_device_bytes);
                assert!(got.peak_device_bytes < want.peak_device_bytes, "{what}: peak");
            }
            last = run_on_devices(&cfg, DeviceKind::Cpu, offloading(offload))
                .expect("cpu device")
                .max_device_bytes;
        }
    }
    let e = refused(&mlp(2, 2, 0), DeviceKind::Cpu, offloading(Offload::Params));
    assert!(e.contains("--stage 3"), "{e}");
}

/// `shardline train --device sim`: trains and says what runs where; what it does not
/// support exits 2 naming the flag.
#[test]
fn the_cli_trains_on_the_simulated_device() {
    let base = ["train", "--device", "sim", "--world", "2", "--steps", "3", "--sync-bn", "on"];
    let out = common::shardline(&[&base[..], &["--stage", "3", "--offload", "params"]].concat());
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("device: sim (a simulated accelerator for testing"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("offload params"), "{}", out.stdout);
    assert!(out.stdout.contains("steps             3 (3 in this run)"), "{}", out.stdout);
    // Offloaded parameters: the device holds no parameter shard, only copies in flight.
    let mem = out.stdout.lines().find(|l| l.contains("peaks by category")).unwrap_or_default();
    assert!(mem.contains("comm buffers") && !mem.contains("shard params"), "{}", out.stdout);
    for (extra, flag) in [
        (&["--fault", "kill:rank=1:step=2"][..], "--fault"),
        (&["--stage", "2", "--offload", "params"][..], "--stage 3"),
        (&["--param-dtype", "bf16"][..], "bf16"),
    ] {
        let out = common::shardline(&[&base[..], extra].concat());
        assert_eq!(out.code, Some(2), "{extra:?}: {}{}", out.stdout, out.stderr);
        assert!(out.stderr.contains(flag), "{extra:?}: {}", out.stderr);
    }
    let out =
        common::shardline(&["train", "--world", "2", "--steps", "1", "--offload", "optimizer"]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("--device sim"), "{}", out.stderr);
}

/// ACC-1..3 on devices: two microbatches per step with each reduction policy, at every
/// stage, on the simulated device equal the cpu device bitwise and the host engine (bitwise
/// at world 1, within rounding at world 2).
#[test]
fn accumulation_on_devices_matches_dev_4() {
    use shardline_runtime::engine::AccumReduce;
    for world in [1, 2, 3] {
        for stage in 0..4u8 {
            // The policy is a choice at stages 2 and 3 only (ACC-2).
            let hows = if stage >= 2 { 2 } else { 1 };
            for how in [AccumReduce::Each, AccumReduce::Last].into_iter().take(hows) {
                let policy = (stage >= 2).then_some(how);
                let accum =
                    |c: TrainConfig| TrainConfig { grad_accum: 2, accum_reduce: policy, ..c };
                // Both batches split evenly over 1-3 ranks x 2 microbatches.
                let g = TrainConfig { batch_size: 12, ..gpt(world, stage, 1) };
                for cfg in [accum(mlp_sync(world, stage, 1)), accum(g)] {
                    let what = format!("{} world {world} stage {stage} {how:?}", cfg.model);
                    let dev = run(&cfg, DeviceKind::Cpu);
                    assert!(same(&run(&cfg, sim(21)), &dev), "{what}: sim differs from cpu");
                    if world == 3 {
                        continue;
                    }
                    let host = run_ok(cfg.clone(), quiet());
                    let diff = max_abs_diff(&dev.final_params, &host.final_params);
                    if world == 1 {
                        assert!(bits_eq(&dev.final_params, &host.final_params), "{what}: {diff}");
                        assert!(losses_bits_eq(&losses(&dev), &host.losses), "{what}");
                    } else {
                        assert!(diff <= 2e-6, "{what}: parameters differ by {diff}");
                    }
                }
            }
        }
    }
}

/// SIM-3 through the engine: a device too small for the run fails it naming the buffer and
/// the bytes; offloading the optimizer state and the shards lets the same run fit a device
/// that held too little for it without (OFFL-1's purpose).
#[test]
fn device_capacity_is_enforced_and_offload_fits_a_smaller_device() {
    let cfg = gpt(2, 3, 1);
    let peak = |o: Offload| {
        run_on_devices(&cfg, DeviceKind::Cpu, offloading(o)).unwrap().peak_device_bytes
    };
    let (none, params) = (peak(Offload::None), peak(Offload::Params));
    assert!(params < none, "{params} vs {none}");
    let small = |capacity: u64| {
        DeviceKind::Sim(SimOptions {
            capacity: Some(capacity),
            max_delay_us: 50,
            timeout: Duration::from_secs(60),
            ..SimOptions::default()
        })
    };
    let capacity = (none + params) / 2;
    let msg = refused(&cfg, small(capacity), DeviceOptions::default());
    assert!(msg.contains("out of device memory") && msg.contains(&capacity.to_string()), "{msg}");
    let got = run_on_devices(&cfg, small(capacity), offloading(Offload::Params)).unwrap();
    assert!(got.peak_device_bytes <= capacity);
    assert!(same(&got, &run(&cfg, DeviceKind::Cpu)));
}

/// One stream and one communicator for gathers and reductions (one NCCL process group)
/// gives the same results bitwise: only when the collectives run changes.
#[test]
fn one_communicator_gives_the_same_results_dev_4() {
    let one = DeviceOptions { one_comm: true, ..DeviceOptions::default() };
    let accum = TrainConfig { grad_accum: 2, ..mlp_sync(2, 2, 0) };
    for cfg in [gpt(2, 3, 1), gpt(3, 1, 0), accum] {
        let want = run(&cfg, DeviceKind::Cpu);
        for seed in 0..3 {
            let got = run_on_devices(&cfg, sim(seed), one).expect("one communicator");
            assert!(same(&got, &want), "{} {:?} seed {seed}", cfg.model, cfg.stage);
        }
    }
}

/// `--trace`: a Chrome trace with every rank's compute, gather and reduce streams and the
/// host's one wait per step; the overlap line is printed.
#[test]
fn the_cli_writes_a_trace_of_the_streams() {
    let dir = std::env::temp_dir().join(format!("shardline-devtrace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trace.json");
    let p = path.to_str().unwrap();
    let args = ["train", "--device", "sim", "--world", "2", "--steps", "2", "--trace", p];
    let out = common::shardline(&args);
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("while compute ran (simulated timing)"), "{}", out.stdout);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    for rank in 0..2 {
        for tid in ["compute", "gather", "reduce", "host"] {
            let n = events.iter().filter(|e| e["pid"] == rank && e["tid"] == tid).count();
            assert!(n > 0, "rank {rank} has no {tid} row");
        }
        let waits = events.iter().filter(|e| e["pid"] == rank && e["tid"] == "host").count();
        assert_eq!(waits, 2, "one host wait per step (DEV-1)");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// DMEM-1: the accountant charges every device allocation under its category: at the end of
/// every step its total is the device's bytes in use and its peak the device's peak (cpu
/// and simulated devices, with and without offload and accumulation). Independently, the
/// parameters and optimizer state it charges are what the host engine's accountant charges
/// for the same job; offloading moves them off the device.
#[test]
fn the_accountant_charges_device_memory_dmem_1() {
    use shardline_runtime::memory::Category;
    let accum = TrainConfig { grad_accum: 2, ..gpt(2, 2, 0) };
    for (cfg, offload) in [
        (gpt(2, 3, 1), Offload::None),
        (gpt(2, 3, 1), Offload::Params),
        (gpt(3, 1, 0), Offload::Optimizer),
        (gpt(2, 0, 0), Offload::None),
        (accum, Offload::None),
        (mlp_sync(2, 2, 1), Offload::None),
    ] {
        let host = run_ok(cfg.clone(), quiet());
        let host_peak = |key: &str| {
            host.peak_by_category[0].iter().find(|(k, _)| k == key).map_or(0, |(_, v)| *v)
        };
        for kind in [DeviceKind::Cpu, sim(7)] {
            let what = format!("{} {:?} {offload:?} on {kind:?}", cfg.model, cfg.stage);
            let got = run_on_devices(&cfg, kind, offloading(offload)).expect(&what);
            for s in &got.steps {
                let m = &s.memory;
                assert_eq!(m.total, s.device_bytes, "{what}: in use");
                assert_eq!(m.peak_total, s.device_peak, "{what}: peak");
                let sum: u64 = Category::ALL.iter().map(|c| m.current(*c)).sum();
                assert_eq!(sum, m.total, "{what}: the categories add up");
                assert_eq!(m.current(Category::Activations), 0, "{what}: freed by step end");
                assert!(m.peak(Category::Activations) > 0, "{what}: activations charged");
            }
            let m = &got.steps.last().unwrap().memory;
            let params = m.peak(Category::ShardParams) + m.peak(Category::FullParams);
            let state = m.peak(Category::OptimizerState);
            // BatchNorm's running statistics count as full parameters on the device.
            let buffers: u64 = got.final_buffers.iter().map(|b| b.len() as u64 * 4).sum();
            let host_params = host_peak("shard_params") + host_peak("full_params") + buffers;
            match offload {
                Offload::None => {
                    assert_eq!(params, host_params, "{what}: parameters");
                    assert_eq!(state, host_peak("optimizer_state"), "{what}: optimizer state");
                }
                Offload::Optimizer => {
                    assert_eq!(params, host_params, "{what}: parameters");
                    assert_eq!(state, 0, "{what}: the optimizer state is on the host");
                }
                Offload::Params => {
                    assert_eq!((params, state), (buffers, 0), "{what}: both on the host");
                    assert!(m.peak(Category::CommBuffers) > 0, "{what}: shards copied in");
                }
            }
            let stage3 = cfg.stage == shardline_runtime::train::StageChoice::Fixed(Stage::Zero3);
            assert_eq!(m.peak(Category::GatheredUnits) > 0, stage3, "{what}: gathered units");
        }
    }
}

/// KMEM-2: what a forward saves is device memory from its enqueue to its backward's, so
/// recomputation, which keeps only each call's input, lowers the device's activations peak,
/// with results bitwise unchanged; the kernels' scratch is charged as a workspace. Every
/// byte is reserved in the host's order, so the peak is the same whatever the streams'
/// timing: the cpu device's, and the simulated one's under any delays.
#[test]
fn saved_tensors_are_device_memory_kmem_2() {
    use shardline_runtime::memory::Category;
    let mut peaks = Vec::new();
    for kind in [DeviceKind::Cpu, sim(3), sim(4)] {
        let full = run_on_devices(&gpt(2, 3, 1), kind.clone(), DeviceOptions::default()).unwrap();
        let rec = run_on_devices(&recomputed(gpt(2, 3, 1)), kind, DeviceOptions::default());
        let rec = rec.unwrap();
        let peak = |r: &DeviceRun, c| r.steps.last().unwrap().memory.peak(c);
        let (a, b) = (peak(&rec, Category::Activations), peak(&full, Category::Activations));
        assert!(a < b, "recomputed {a} against {b}");
        assert!(rec.peak_device_bytes < full.peak_device_bytes);
        assert!(peak(&full, Category::Scratch) > 0, "the scratch workspace is charged");
        assert!(same(&rec, &full));
        peaks.push((full.peak_device_bytes, rec.peak_device_bytes));
    }
    assert!(peaks.iter().all(|p| *p == peaks[0]), "{peaks:?}");
}

/// KMEM-3: a kernel that makes more than was reserved for it fails the run, naming the
/// kernel and both figures, on either device.
#[test]
fn a_kernel_past_its_reservation_fails_naming_it_kmem_3() {
    let bug = InjectedBug { under_reserve: true, ..InjectedBug::default() };
    for kind in [sim(2), DeviceKind::Cpu] {
        let msg = refused(&gpt(2, 3, 1), kind, with_bug(bug));
        assert!(msg.contains("kernel 'forward") && msg.contains("saved tensors"), "{msg}");
        assert!(msg.contains("were reserved"), "{msg}");
    }
}

/// The device engine runs under the one training loop: a run stopped after 3 steps and
/// resumed from its checkpoint ends bitwise where the uninterrupted run ends, at every stage,
/// with the optimizer state or the shards offloaded, with AdamW and with background
/// checkpoints; the host engine resumes the device engine's checkpoint to the same end, and
/// the evaluation at the end scores as the host engine's does.
#[test]
fn the_device_engine_checkpoints_resumes_and_evaluates_under_the_driver() {
    let dir = std::env::temp_dir().join(format!("shardline-devdrive-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let summary = |name: &str, extra: &[&str]| -> serde_json::Value {
        let json = dir.join(format!("{name}.json"));
        // SyncBN: every rank holds the same running statistics, which a checkpoint stores once.
        let base = ["train", "--model", "mlp-bn", "--world", "2", "--steps", "6"];
        let base = [&base[..], &["--sync-bn", "on"]].concat();
        let j = ["--summary-json", json.to_str().unwrap(), "--no-progress"];
        let out = common::shardline(&[&base[..], &j[..], extra].concat());
        assert_eq!(out.code, Some(0), "{name}: {}{}", out.stdout, out.stderr);
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
    };
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    // Each case's flags, and those of its runs that checkpoint.
    let cases: [(&[&str], &[&str]); 6] = [
        (&["--stage", "3"], &[]),
        (&["--stage", "0"], &[]),
        (&["--stage", "1", "--offload", "optimizer", "--optimizer", "adamw"], &[]),
        (&["--stage", "2"], &[]),
        (&["--stage", "3", "--offload", "params"], &[]),
        (&["--stage", "3", "--offload", "optimizer"], &["--async-checkpoint"]),
    ];
    for (c, (case, ck_flags)) in cases.iter().enumerate() {
        let ck = dir.join(format!("ck{c}"));
        let ck = ck.to_str().unwrap();
        let sim = [&["--device", "sim", "--sim-delay-us", "30"][..], case].concat();
        let full = summary("full", &sim);
        let stop = ["--checkpoint-dir", ck, "--checkpoint-every", "3", "--stop-after", "3"];
        summary("first", &[&sim[..], &stop[..], ck_flags].concat());
        let resume = ["--checkpoint-dir", ck, "--resume"];
        let resumed = summary("resumed", &[&sim[..], &resume[..], ck_flags].concat());
        let what = format!("{case:?}");
        assert_eq!(f(&resumed, "final_loss"), f(&full, "final_loss"), "{what}: bitwise");
        assert_eq!(f(&resumed, "test_loss"), f(&full, "test_loss"), "{what}");
        assert_eq!(f(&resumed, "total_steps"), 6.0, "{what}");
        assert!(f(&full, "test_accuracy") > 0.0, "{what}");
        if c > 0 {
            continue;
        }
        let host = summary("host", case);
        // The host engine from the device engine's step-3 checkpoint (the later one removed).
        std::fs::remove_dir_all(dir.join("ck0").join("step-00000006")).unwrap();
        let host_resumed = summary("host-resumed", &[case, &resume[..]].concat());
        for other in [&host, &host_resumed] {
            let (a, b) = (f(other, "final_loss"), f(&full, "final_loss"));
            assert!((a - b).abs() < 1e-5, "{a} against {b}");
            let (a, b) = (f(other, "test_loss"), f(&full, "test_loss"));
            assert!((a - b).abs() < 1e-5, "{a} against {b}");
            assert_eq!(f(other, "test_accuracy"), f(&full, "test_accuracy"), "the same scoring");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
