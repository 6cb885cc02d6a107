//! Activation recomputation (`--recompute units`, `runtime/src/engine/recompute.rs`):
//! bitwise the run without it, at every stage, for BatchNorm models with SyncBN at world 2
//! and for `gpt` with dropout; the re-run sends no statistics message and leaves the running
//! statistics alone.

mod common;
use common::*;
use shardline_runtime::engine::Recompute;
use shardline_runtime::train::{RunOptions, Summary, SyncBnMode, TrainConfig};

/// Runs `cfg` with and without recomputation and checks the two bitwise equal (RECOMP-3)
/// with the same statistics messages (RECOMP-2); returns the recomputing run's summary.
fn same_with_and_without(cfg: TrainConfig, opts: RunOptions) -> Summary {
    let what = format!("{} world {} stage {:?}", cfg.model, cfg.world, cfg.stage);
    let plain = run_ok(TrainConfig { recompute: Recompute::None, ..cfg.clone() }, quiet());
    let re = run_ok(TrainConfig { recompute: Recompute::Units, ..cfg }, opts);
    assert!(losses_bits_eq(&re.losses, &plain.losses), "{what}: losses differ");
    assert!(bits_eq(&re.final_params, &plain.final_params), "{what}: parameters differ");
    if plain.final_buffers.iter().any(|b| !b.is_empty()) {
        assert!(bits_eq(&re.final_buffers, &plain.final_buffers), "{what}: buffers differ");
    }
    assert_eq!(
        re.stats_messages_per_step, plain.stats_messages_per_step,
        "{what}: the re-run sent statistics messages"
    );
    assert_eq!(re.test_loss.to_bits(), plain.test_loss.to_bits(), "{what}: test loss");
    re
}

/// RECOMP-2, RECOMP-3: mlp-bn with SyncBN at world 2, every stage: the same losses,
/// parameters and running statistics, bit for bit, and the same SyncBN messages per step.
/// The trace shows the re-runs happened: one `recompute` span per checkpointed call.
#[test]
fn mlp_bn_with_syncbn_recomputes_bitwise_at_every_stage_recomp_2_3() {
    let dir = tempfile::tempdir().expect("tempdir");
    for stage in 0..4u8 {
        let cfg = small_cfg(2, stage, 4, 16);
        assert_eq!(cfg.sync_bn, SyncBnMode::On);
        let trace = dir.path().join(format!("stage{stage}.json"));
        let opts = RunOptions { trace: Some(trace.clone()), ..quiet() };
        let s = same_with_and_without(cfg, opts);
        assert!(s.stats_messages_per_step > 0, "SyncBN is on");
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&trace).expect("trace")).expect("json");
        let spans = doc["traceEvents"]
            .as_array()
            .expect("events")
            .iter()
            .filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with("recompute ")))
            .count();
        // RECOMP-1: mlp-bn's 3 units: the first two are checkpointed, on 2 ranks, 4 steps.
        assert_eq!(spans, 2 * 2 * 4, "stage {stage}: recompute spans");
    }
}

/// RECOMP-3 with convolutions: convnet-bn with SyncBN at world 2.
#[test]
fn convnet_bn_with_syncbn_recomputes_bitwise_recomp_3() {
    for stage in [0u8, 3] {
        let cfg = TrainConfig {
            model: "convnet-bn".into(),
            hidden: Some(4),
            ..small_cfg(2, stage, 3, 8)
        };
        same_with_and_without(cfg, quiet());
    }
}

/// RECOMP-3 with dropout: gpt's masks are keyed by (seed, step, sample), so the re-run
/// draws the first forward's; every stage, world 2, with and without gradient accumulation.
#[test]
fn gpt_with_dropout_recomputes_bitwise_at_every_stage_recomp_3() {
    let gpt = |stage: u8, accum: usize| TrainConfig {
        dropout: Some(0.2),
        steps: Some(4),
        grad_accum: accum,
        ..gpt_cfg(2, stage, 8)
    };
    for stage in 0..4u8 {
        same_with_and_without(gpt(stage, 1), quiet());
    }
    same_with_and_without(gpt(3, 2), quiet());
}
