//! `resnet-bn` trained sharded with SyncBatchNorm equals `resnet-bn` trained on one rank:
//! worlds 2, 3 and 4 at every ZeRO stage, with and without prefetch, on the same global
//! batches of the digits images (1x8x8). A narrow ResNet-18 (width 4: 4, 8, 16, 32
//! channels) keeps it small; its 20 BatchNorms (three in `downsample` shortcuts, layer4's
//! over 1x1 planes) reduce their statistics over the ranks, so per-rank statistics would
//! move the result (`per_rank_batchnorm_is_outside_the_tolerance` checks that the bounds
//! see it).

mod common;
use common::*;
use shardline_runtime::train::{SyncBnMode, TrainConfig};

/// Why not zero: a world-W step sums each gradient and each channel's statistics as W
/// partial sums combined by the collective, one rank in one pass, so the rounding differs.
/// Observed over this grid after 4 SGD steps (the test prints them): loss relative
/// difference <= 9.6e-7, parameters <= 9.6e-7 absolute, running statistics <= 1.4e-6 (layer4's
/// BatchNorms normalise 22 values per channel, which magnifies rounding); the bounds are
/// about ten times that. Per-rank statistics move the parameters by about 0.8.
const LOSS_REL_TOL: f32 = 1e-5;
const PARAM_ABS_TOL: f32 = 1e-5;
const BUFFER_ABS_TOL: f32 = 1.5e-5;

/// `resnet-bn` at width 4 on digits images, SGD, SyncBN on.
fn resnet_cfg(world: usize, stage: u8, batch: usize) -> TrainConfig {
    TrainConfig {
        model: "resnet-bn".into(),
        width: Some(4),
        lr: 0.05,
        cosine: false,
        sync_bn: SyncBnMode::On,
        ..small_cfg(world, stage, 4, batch)
    }
}

/// A global batch of 22: even over 2 ranks, uneven over 3 and 4 (slices of 7, 7, 8 and
/// 5, 5, 6, 6), so SyncBN's merge of unequal counts is exercised.
#[test]
fn resnet_every_stage_world_and_prefetch_matches_one_rank_with_sync_bn() {
    let t0 = std::time::Instant::now();
    let batch = 22;
    let reference = run_ok(resnet_cfg(1, 0, batch), quiet());
    let (first, last) = (reference.losses[0], *reference.losses.last().unwrap());
    assert!(last < first, "loss {first} -> {last} did not go down");
    let (mut worst_l, mut worst_p, mut worst_b) = (0.0f32, 0.0f32, 0.0f32);
    for stage in 0..4u8 {
        for world in [2usize, 3, 4] {
            for prefetch in [0usize, 1] {
                let mut cfg = resnet_cfg(world, stage, batch);
                cfg.prefetch = prefetch;
                let s = run_ok(cfg, quiet());
                let what = format!("stage {stage} world {world} prefetch {prefetch}");
                assert!(s.sync_bn.0, "{what}: SyncBN should be on");
                // 20 BatchNorms, one statistics message each way.
                assert_eq!(s.stats_messages_per_step, 40, "{what}: stats messages per step");
                let lrel = max_rel(&s.losses, &reference.losses);
                let pd = max_abs_diff(&s.final_params, &reference.final_params);
                let bd = max_abs_diff(&s.final_buffers, &reference.final_buffers);
                assert!(lrel <= LOSS_REL_TOL, "{what}: loss curve differs by {lrel:e}");
                assert!(pd <= PARAM_ABS_TOL, "{what}: parameters differ by {pd:e}");
                assert!(bd <= BUFFER_ABS_TOL, "{what}: BatchNorm buffers differ by {bd:e}");
                (worst_l, worst_p, worst_b) = (worst_l.max(lrel), worst_p.max(pd), worst_b.max(bd));
            }
        }
    }
    eprintln!(
        "resnet-bn equivalence: worst loss relative difference {worst_l:e}, parameters \
         {worst_p:e}, buffers {worst_b:e}; 25 runs in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

/// The negative control: per-rank BatchNorm statistics (SyncBN off) on 4 ranks are a
/// different computation, and the bounds above reject it.
#[test]
fn per_rank_batchnorm_is_outside_the_tolerance() {
    let reference = run_ok(resnet_cfg(1, 0, 22), quiet());
    let mut cfg = resnet_cfg(4, 3, 22);
    cfg.sync_bn = SyncBnMode::Off;
    let s = run_ok(cfg, quiet());
    assert_eq!(s.stats_messages_per_step, 0);
    let pd = max_abs_diff(&s.final_params, &reference.final_params);
    eprintln!("resnet-bn equivalence control: per-rank BatchNorm moves the parameters by {pd:e}");
    assert!(pd > 100.0 * PARAM_ABS_TOL, "per-rank BN moves the parameters by only {pd:e}");
}
