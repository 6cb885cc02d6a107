//! Gradient accumulation (`--grad-accum N`, `runtime/src/engine/accum.rs`): N microbatches
//! of b samples per rank against one step of N x b, at every stage and worlds 1 and 2, for
//! models without BatchNorm (`gpt`, `wide-mlp`); with BatchNorm against ranks whose slices
//! are the microbatches (ACC-4); and the settings that are refused. SyncBN with
//! accumulation against a one-rank reference: `syncbn_accum.rs` (ACC-5).

mod common;
use common::*;
use shardline_runtime::engine::AccumReduce;
use shardline_runtime::train::{self, SyncBnMode, TrainConfig};

/// Why not zero: a microbatch's gradients are summed over its own samples, and the
/// microbatches' sums are added afterwards (in the gradient buffer, or in the shard after
/// their reductions), where one step sums all samples in one pass. The same rounding bounds
/// as the sharded-against-one-rank tests (`gpt_equivalence.rs`). Observed over the gpt grid
/// after 5 SGD steps: loss relative difference <= 1.1e-7, parameters <= 1.8e-7 absolute (the
/// test prints both). A different global batch moves the parameters by more than 100x this
/// (`gpt_equivalence.rs`'s control).
const LOSS_REL_TOL: f32 = 2e-6;
const PARAM_ABS_TOL: f32 = 2e-6;

/// Runs `cfg` with `n` microbatches (and `how` at stages 2 and 3) and checks it against
/// `reference` (losses, parameters, test loss); returns the differences.
fn check(
    cfg: TrainConfig,
    n: usize,
    how: Option<AccumReduce>,
    reference: &train::Summary,
) -> (f32, f32) {
    let what = format!(
        "{} world {} stage {:?} grad-accum {n} {how:?} dropout {:?}",
        cfg.model, cfg.world, cfg.stage, cfg.dropout
    );
    let s = run_ok(TrainConfig { grad_accum: n, accum_reduce: how, ..cfg }, quiet());
    let lrel = max_rel(&s.losses, &reference.losses);
    assert!(lrel <= LOSS_REL_TOL, "{what}: loss curve differs by {lrel:e}");
    let pd = max_abs_diff(&s.final_params, &reference.final_params);
    assert!(pd <= PARAM_ABS_TOL, "{what}: parameters differ by {pd:e}");
    let dl = (s.test_loss - reference.test_loss).abs();
    assert!(dl <= 1e-5 * reference.test_loss.abs(), "{what}: test loss {dl:e} apart");
    (lrel, pd)
}

/// ACC-1, ACC-2, ACC-3: gpt with N microbatches per rank ends where one step of the
/// whole batch on one rank ends, at every stage, worlds 1 and 2, both reduction policies
/// at stages 2 and 3; the loss reported is the global batch's mean (ENG-2).
#[test]
fn gpt_microbatches_equal_one_step_of_the_whole_batch_acc_1_2_3() {
    let reference = run_ok(gpt_cfg(1, 0, 8), quiet());
    let (first, last) = (reference.losses[0], *reference.losses.last().unwrap());
    assert!(last < 0.8 * first, "loss {first} -> {last} did not go down");
    let mut worst = (0.0f32, 0.0f32);
    for stage in 0..4u8 {
        for (world, n) in [(1usize, 2usize), (1, 4), (2, 2), (2, 4)] {
            let hows: &[Option<AccumReduce>] =
                if stage >= 2 { &[None, Some(AccumReduce::Last)] } else { &[None] };
            for &how in hows {
                let d = check(gpt_cfg(world, stage, 8), n, how, &reference);
                worst = (worst.0.max(d.0), worst.1.max(d.1));
            }
        }
    }
    eprintln!(
        "gpt grad-accum: worst loss relative difference {:e}, parameters {:e}",
        worst.0, worst.1
    );
}

/// ACC-1 with dropout: every microbatch's masks are keyed by its samples' global indices,
/// so accumulating still equals one step of the whole batch.
#[test]
fn gpt_microbatches_with_dropout_keep_each_samples_mask_acc_1() {
    let with = |world, stage| TrainConfig { dropout: Some(0.2), ..gpt_cfg(world, stage, 8) };
    let reference = run_ok(with(1, 0), quiet());
    for (world, stage, n) in [(1usize, 0u8, 4usize), (2, 1, 2), (2, 3, 2)] {
        check(with(world, stage), n, None, &reference);
    }
}

/// ACC-1, ACC-3 with gradient clipping: the global norm (taken as the reductions finish)
/// is the norm of the whole step's gradient, so a wide-mlp without BatchNorm ends where
/// one step ends, and the reported norms agree. SGD, as in the other equivalence tests:
/// Adam's division by the root of the second moment turns the rounding of a gradient near
/// zero into a step of the learning rate's size.
#[test]
fn wide_mlp_microbatches_with_clipping_equal_one_step_acc_1_3() {
    let cfg = |world: usize, stage: u8| TrainConfig {
        model: "wide-mlp".into(),
        params: 20_000,
        clip_grad_norm: Some(0.5),
        ..small_cfg(world, stage, 5, 16)
    };
    let reference = run_ok(cfg(1, 0), quiet());
    for stage in 0..4u8 {
        for (world, n, how) in
            [(1usize, 4usize, None), (2, 2, None), (2, 4, Some(AccumReduce::Last))]
        {
            let how = how.filter(|_| stage >= 2);
            let s = run_ok(
                TrainConfig { grad_accum: n, accum_reduce: how, ..cfg(world, stage) },
                quiet(),
            );
            let what = format!("wide-mlp world {world} stage {stage} grad-accum {n} {how:?}");
            let lrel = max_rel(&s.losses, &reference.losses);
            assert!(lrel <= LOSS_REL_TOL, "{what}: loss curve differs by {lrel:e}");
            let pd = max_abs_diff(&s.final_params, &reference.final_params);
            assert!(pd <= PARAM_ABS_TOL, "{what}: parameters differ by {pd:e}");
            for (a, b) in s.step_stats.iter().zip(&reference.step_stats) {
                let rel = ((a.grad_norm - b.grad_norm) / b.grad_norm).abs();
                assert!(rel <= 1e-5, "{what}: gradient norm {} vs {}", a.grad_norm, b.grad_norm);
            }
        }
    }
}

/// mlp-bn without SyncBN (per-rank statistics).
fn bn_cfg(world: usize, stage: u8) -> TrainConfig {
    TrainConfig { sync_bn: SyncBnMode::Off, ..small_cfg(world, stage, 5, 16) }
}

/// ACC-4: with BatchNorm each microbatch is normalised with its own statistics. The
/// independent reference: a run at W x N ranks without SyncBN, whose rank slices are
/// exactly the microbatches (world 1 with 2 microbatches against world 2; world 2 with 2
/// against world 4: rank r's microbatch k is rank 2r + k's slice), so the batch statistics,
/// losses and parameters agree. A single step of the whole slice (no accumulation) does not.
#[test]
fn batchnorm_microbatches_equal_ranks_whose_slices_they_are_acc_4() {
    let whole = run_ok(bn_cfg(1, 0), quiet());
    for (world, n, stage) in [(1usize, 2usize, 0u8), (1, 2, 3), (2, 2, 1), (2, 2, 2), (2, 2, 3)] {
        let reference = run_ok(bn_cfg(world * n, 0), quiet());
        let s = run_ok(TrainConfig { grad_accum: n, ..bn_cfg(world, stage) }, quiet());
        let what = format!("mlp-bn world {world} stage {stage} grad-accum {n}");
        let lrel = max_rel(&s.losses, &reference.losses);
        assert!(lrel <= LOSS_REL_TOL, "{what}: loss curve differs by {lrel:e}");
        let pd = max_abs_diff(&s.final_params, &reference.final_params);
        assert!(pd <= PARAM_ABS_TOL, "{what}: parameters differ by {pd:e}");
        // The control: statistics of the whole slice give another trajectory.
        let moved = max_abs_diff(&s.final_params, &whole.final_params);
        assert!(
            moved > 100.0 * PARAM_ABS_TOL,
            "{what}: microbatch statistics moved only {moved:e}"
        );
    }
}

/// ACC-4: running statistics update once per microbatch (torch's `num_batches_tracked`
/// counts N per step), and with SyncBN every microbatch sends its own statistics messages.
#[test]
fn batchnorm_buffers_and_syncbn_messages_count_microbatches_acc_4() {
    let steps = 5;
    let cfg = bn_cfg(1, 0);
    let (train_set, _) = train::load_data(&cfg, false).expect("digits");
    let model = train::build_model(&cfg, &train_set.sample_shape, train_set.classes).unwrap();
    let spec = model.spec();
    let tracked = |s: &train::Summary| -> Vec<f32> {
        let mut out = Vec::new();
        for (u, unit) in spec.units.iter().enumerate() {
            let mut at = 0;
            for b in &unit.buffers {
                let len: usize = b.shape.iter().product();
                if b.name.ends_with("num_batches_tracked") {
                    out.push(s.final_buffers[u][at]);
                }
                at += len;
            }
        }
        out
    };
    for n in [1usize, 2, 4] {
        let s = run_ok(TrainConfig { grad_accum: n, ..cfg.clone() }, quiet());
        let counts = tracked(&s);
        assert!(!counts.is_empty(), "mlp-bn has BatchNorm layers");
        assert!(
            counts.iter().all(|&c| c == (steps * n) as f32),
            "grad-accum {n}: num_batches_tracked {counts:?}, want {}",
            steps * n
        );
    }
    let sync = |n| {
        let c = TrainConfig { grad_accum: n, ..small_cfg(2, 3, 2, 16) };
        run_ok(c, quiet()).stats_messages_per_step
    };
    let (one, two) = (sync(1), sync(2));
    assert!(one > 0, "SyncBN sends statistics");
    assert_eq!(two, 2 * one, "two microbatches send each layer's statistics twice");
}

/// ACC-3: `--stage auto`'s estimates count the full gradients that `--accum-reduce last`
/// holds at stages 2 and 3 until the last microbatch, and nothing more at stages 0 and 1
/// or with `each`.
#[test]
fn stage_estimates_count_the_gradients_last_holds_acc_3() {
    let cfg = bn_cfg(2, 0);
    let (train_set, _) = train::load_data(&cfg, false).expect("digits");
    let model = train::build_model(&cfg, &train_set.sample_shape, train_set.classes).unwrap();
    let layout = shardline_runtime::shard::ShardedModelLayout::new(&model.spec(), 2).unwrap();
    let full = layout.padded_numel() as u64 * 4;
    let est = |n: usize, how: Option<AccumReduce>| {
        let c = TrainConfig { grad_accum: n, accum_reduce: how, ..cfg.clone() };
        train::stage_estimates(&model, &c).unwrap()
    };
    let plain = est(1, None);
    assert_eq!(est(2, Some(AccumReduce::Each)), plain);
    assert_eq!(est(1, Some(AccumReduce::Last)), plain, "one microbatch holds nothing more");
    for ((stage, last), (_, base)) in est(2, Some(AccumReduce::Last)).into_iter().zip(&plain) {
        let more = if stage.grads_sharded() { full } else { 0 };
        assert_eq!(last, base + more, "{stage:?}");
    }
}

/// Bad `--grad-accum` and `--accum-reduce` settings exit 2 naming what to change: zero,
/// a count that does not divide the per-rank batch (both numbers named), a batch that is
/// not the same on every rank, and a reduction policy at a stage it does not apply to.
#[test]
fn bad_accumulation_settings_exit_2_naming_what_to_change() {
    let base = ["train", "--model", "mlp-bn", "--steps", "1", "--no-progress"];
    let cases: [(&[&str], &[&str]); 4] = [
        (&["--grad-accum", "0"], &["--grad-accum 0", "at least one microbatch"]),
        (
            &["--grad-accum", "3", "--batch-size", "16", "--world", "2"],
            &["--grad-accum 3", "per-rank batch 8", "--batch-size 16", "--world 2"],
        ),
        (
            &["--grad-accum", "2", "--batch-size", "15", "--world", "2"],
            &["--grad-accum 2", "--batch-size 15", "--world 2", "multiple of 4"],
        ),
        (
            &["--accum-reduce", "last", "--stage", "1"],
            &["--accum-reduce last", "stages 2 and 3", "stage 1"],
        ),
    ];
    for (args, says) in cases {
        let all: Vec<&str> = base.iter().chain(args).copied().collect();
        let out = shardline(&all);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.stderr);
        for s in says {
            assert!(out.stderr.contains(s), "{args:?}: stderr does not say {s:?}: {}", out.stderr);
        }
        assert!(!out.stderr.contains("panicked"), "{args:?}: {}", out.stderr);
    }
}

/// ACC-3 with PREC-4: bf16 reductions of each microbatch add into the f32 shard. Four
/// microbatches at world 2, stage 3, with bf16 reductions, track the same run without
/// accumulation within bf16's rounding of the partial sums; a shard replaced instead of
/// added to would keep only the last microbatch's gradient and move the curve far more.
#[test]
fn bf16_reductions_of_microbatches_add_into_the_f32_shard_acc_3() {
    use shardline_runtime::engine::PrecisionDtype::Bf16;
    let base = TrainConfig { reduce_dtype: Some(Bf16), ..gpt_cfg(2, 3, 16) };
    let whole = run_ok(base.clone(), quiet());
    let micro = run_ok(
        TrainConfig { grad_accum: 4, accum_reduce: Some(AccumReduce::Each), ..base.clone() },
        quiet(),
    );
    let lrel = max_rel(&micro.losses, &whole.losses);
    let pd = max_abs_diff(&micro.final_params, &whole.final_params);
    eprintln!("bf16 reductions, grad-accum 4 against 1: loss rel {lrel:e}, params {pd:e}");
    assert!(lrel <= 2e-3 && pd <= 4e-3, "loss {lrel:e}, params {pd:e}");
    // The control: the last microbatch alone (a quarter of the batch) moves the curve.
    let quarter = run_ok(TrainConfig { batch_size: 4, ..base }, quiet());
    let far = max_rel(&quarter.losses, &whole.losses);
    assert!(far > 10.0 * lrel.max(1e-6), "a quarter batch is only {far:e} away");
}
