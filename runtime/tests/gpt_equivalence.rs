//! `gpt` trained sharded equals `gpt` trained on one rank: worlds 2, 3 and 4 at every ZeRO
//! stage, with and without prefetch, on the same global batches of the bundled text. The
//! root unit (`transformer.wte`, `wpe`, `ln_f`) is used first and last in every pass, so
//! this also checks that its gradient sums both uses before it is reduced (NET-1, MGPT-2).

mod common;
use common::*;
use shardline_runtime::train::{RunOptions, TrainConfig};

/// Why not zero: a world-W step sums each gradient as W partial sums combined by the
/// collective, one rank in one pass, so the rounding differs. Observed over this grid after 5
/// SGD steps: loss relative difference <= 1.2e-7, parameters <= 2.4e-7 absolute (the test
/// prints both). A different global batch moves the parameters by far more
/// (`a_different_global_batch_is_outside_the_tolerance` checks that the bounds see a change that small).
const LOSS_REL_TOL: f32 = 2e-6;
const PARAM_ABS_TOL: f32 = 2e-6;

/// A global batch of 10: even over 2 ranks, uneven over 3 and 4.
#[test]
fn gpt_every_stage_world_and_prefetch_matches_one_rank() {
    let (mut worst_l, mut worst_p) = (0.0f32, 0.0f32);
    for batch in [10usize] {
        let reference = run_ok(gpt_cfg(1, 0, batch), quiet());
        let (first, last) = (reference.losses[0], *reference.losses.last().unwrap());
        assert!(last < 0.8 * first, "batch {batch}: loss {first} -> {last} did not go down");
        for stage in 0..4u8 {
            for world in [2usize, 3, 4] {
                for prefetch in [0usize, 1] {
                    let mut cfg = gpt_cfg(world, stage, batch);
                    cfg.prefetch = prefetch;
                    let s = run_ok(cfg, quiet());
                    let what =
                        format!("batch {batch} stage {stage} world {world} prefetch {prefetch}");
                    let lrel = max_rel(&s.losses, &reference.losses);
                    assert!(lrel <= LOSS_REL_TOL, "{what}: loss curve differs by {lrel:e}");
                    let pd = max_abs_diff(&s.final_params, &reference.final_params);
                    assert!(pd <= PARAM_ABS_TOL, "{what}: parameters differ by {pd:e}");
                    (worst_l, worst_p) = (worst_l.max(lrel), worst_p.max(pd));
                    let dl = (s.test_loss - reference.test_loss).abs();
                    assert!(
                        dl <= 1e-5 * reference.test_loss,
                        "{what}: test loss {} vs {}",
                        s.test_loss,
                        reference.test_loss
                    );
                }
            }
        }
    }
    eprintln!(
        "gpt equivalence: worst loss relative difference {worst_l:e}, parameters {worst_p:e}"
    );
}

/// The negative control of the test above: a different global batch (one sample fewer, as a
/// rank's slice lost) moves the parameters well outside the bounds.
#[test]
fn a_different_global_batch_is_outside_the_tolerance() {
    let reference = run_ok(gpt_cfg(1, 0, 12), quiet());
    let s = run_ok(gpt_cfg(1, 0, 11), quiet());
    let pd = max_abs_diff(&s.final_params, &reference.final_params);
    eprintln!("gpt equivalence control: a different global batch moves the parameters by {pd:e}");
    assert!(pd > 100.0 * PARAM_ABS_TOL, "a changed batch moves the parameters by only {pd:e}");
}

/// MGPT-3 through the engine: with dropout on, every mask is keyed by the sample's global
/// index, so a sharded run at any world and stage still equals the one-rank run (to the
/// same rounding bounds), while the dropout visibly changes training (the control).
#[test]
fn gpt_with_dropout_matches_one_rank_mgpt_3() {
    let with = |world: usize, stage: u8, p: f64| TrainConfig {
        dropout: Some(p),
        ..gpt_cfg(world, stage, 10)
    };
    let reference = run_ok(with(1, 0, 0.2), quiet());
    let plain = run_ok(with(1, 0, 0.0), quiet());
    let moved = max_rel(&reference.losses[1..], &plain.losses[1..]);
    assert!(moved > 1e-3, "dropout 0.2 changes the loss curve by only {moved:e}");
    let mut worst = (0.0f32, 0.0f32);
    for (world, stage, prefetch) in
        [(2usize, 0u8, 0usize), (3, 1, 0), (2, 2, 1), (3, 3, 1), (4, 3, 0)]
    {
        let mut cfg = with(world, stage, 0.2);
        cfg.prefetch = prefetch;
        let s = run_ok(cfg, quiet());
        let what = format!("dropout 0.2, stage {stage} world {world} prefetch {prefetch}");
        let lrel = max_rel(&s.losses, &reference.losses);
        assert!(lrel <= LOSS_REL_TOL, "{what}: loss curve differs by {lrel:e}");
        let pd = max_abs_diff(&s.final_params, &reference.final_params);
        assert!(pd <= PARAM_ABS_TOL, "{what}: parameters differ by {pd:e}");
        worst = (worst.0.max(lrel), worst.1.max(pd));
    }
    eprintln!(
        "gpt dropout equivalence: worst loss relative difference {:e}, parameters {:e}; \
         dropout moves the loss curve by {moved:e}",
        worst.0, worst.1
    );
}

/// MGPT-3 and CKPT-3: a run with dropout stopped after 3 steps and resumed ends bitwise
/// equal to the uninterrupted run (the masks depend on the step, not on the invocation).
#[test]
fn gpt_with_dropout_resumes_bitwise_mgpt_3() {
    let cfg = TrainConfig { dropout: Some(0.2), ..gpt_cfg(2, 3, 10) };
    let ckpt = |dir: &std::path::Path| RunOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        checkpoint_every: 0,
        ..quiet()
    };
    let full_dir = tempfile::tempdir().expect("tempdir");
    let full = run_ok(cfg.clone(), ckpt(full_dir.path()));
    let dir = tempfile::tempdir().expect("tempdir");
    let first = run_ok(cfg.clone(), RunOptions { stop_after: Some(3), ..ckpt(dir.path()) });
    assert_eq!(first.steps, 3);
    let second = run_ok(cfg, RunOptions { resume: true, ..ckpt(dir.path()) });
    assert!(
        losses_bits_eq(&second.losses, &full.losses[3..]),
        "resumed losses {:?} differ from the uninterrupted {:?}",
        second.losses,
        &full.losses[3..]
    );
    assert!(bits_eq(&second.final_params, &full.final_params), "final params differ");
}
