//! Per-rank memory: sharding lowers the measured peak, and `--device-memory` turns a model
//! that does not fit at stage 0 into one that trains at stage 3 (issue item 5).

mod common;
use common::*;
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{StageChoice, SyncBnMode, TrainConfig};

fn wide(world: usize, stage: u8, params: usize) -> TrainConfig {
    TrainConfig {
        world,
        stage: StageChoice::Fixed(Stage::from_index(stage).expect("stage")),
        model: "wide-mlp".into(),
        dataset: "synthetic".into(),
        input_dim: 64,
        classes: 10,
        samples: 256,
        params,
        steps: Some(2),
        batch_size: 16,
        sync_bn: SyncBnMode::Off,
        timeout_s: 30,
        ..TrainConfig::default()
    }
}

#[test]
fn stage_3_peak_is_below_stage_0_on_every_rank() {
    let peaks: Vec<Vec<u64>> =
        (0..4u8).map(|stage| run_ok(wide(4, stage, 400_000), quiet()).peak_bytes).collect();
    for (stage, p) in peaks.iter().enumerate() {
        assert_eq!(p.len(), 4, "stage {stage}: one peak per rank");
        assert!(p.iter().all(|&b| b > 0), "stage {stage}: {p:?}");
    }
    for r in 0..4 {
        // Sharding the optimizer state (stage 1) and everything (stage 3) must show.
        assert!(peaks[1][r] < peaks[0][r], "rank {r}: stage 1 {peaks:?}");
        assert!(
            peaks[3][r] < peaks[0][r],
            "rank {r}: stage 3 {} >= stage 0 {}",
            peaks[3][r],
            peaks[0][r]
        );
    }
}

/// ENG-3: the engine's buffers are counted against the cap (stage 0 exceeds it, stage 3 fits).
#[test]
fn a_cap_that_stage_0_exceeds_is_enough_for_stage_3() {
    let stage0 = run_ok(wide(4, 0, 400_000), quiet());
    let stage3 = run_ok(wide(4, 3, 400_000), quiet());
    let (p0, p3) = (stage0.peak_bytes[0], stage3.peak_bytes.iter().copied().max().unwrap_or(0));
    assert!(p3 < p0);
    let cap = (p0 + p3) / 2;
    let mut cfg = wide(4, 0, 400_000);
    cfg.device_memory = Some(cap);
    let err = run_with_deadline(cfg, quiet()).expect_err("stage 0 must not fit under the cap");
    let msg = err.to_string();
    assert!(msg.contains("would exceed the"), "not an OutOfMemory: {msg}");
    assert!(msg.contains("allocating") && msg.contains("in use:"), "{msg}");
    let mut cfg = wide(4, 3, 400_000);
    cfg.device_memory = Some(cap);
    let s = run_ok(cfg, quiet());
    assert_eq!(s.total_steps, 2);
    assert!(s.peak_bytes.iter().all(|&b| b <= cap), "{:?} over the cap {cap}", s.peak_bytes);
}
