//! The example's model trains through Shardline's runtime at every ZeRO stage with two
//! ranks, and sharding does not change what it computes: two ranks at stage 3 give one
//! rank's losses.

use custom_model::job::Job;
use custom_model::ModelConfig;

/// A model small enough for a test: two blocks of width 32 over bytes.
fn job(stage: u8, world: usize) -> Job {
    let model = ModelConfig { vocab: 256, block: 16, layers: 2, heads: 2, dim: 32, hidden: 64 };
    Job { model, stage, world, steps: 8, batch: 8, lr: 1e-2, seed: 3 }
}

/// Ranks wait on each other: a run that hangs fails the test after this long.
const DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);

fn losses(stage: u8, world: usize) -> Vec<f32> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(job(stage, world).run().map_err(|e| format!("{e:#}")));
    });
    let s = rx
        .recv_timeout(DEADLINE)
        .unwrap_or_else(|_| panic!("stage {stage}, world {world}: no result within {DEADLINE:?}"))
        .unwrap_or_else(|e| panic!("stage {stage}, world {world}: {e}"));
    assert_eq!(s.stage, stage);
    assert!(s.test_loss.is_finite());
    s.losses
}

#[test]
fn every_stage_trains_on_two_ranks() {
    for stage in 0..=3 {
        let l = losses(stage, 2);
        assert_eq!(l.len(), 8);
        let (first, last) = (l[0], l[l.len() - 1]);
        // From uniform over 256 bytes (ln 256 = 5.55) towards the corpus's byte frequencies.
        assert!(last < first - 0.5, "stage {stage}: loss {first} -> {last} ({l:?})");
    }
}

#[test]
fn stage_3_on_two_ranks_matches_one_rank() {
    let (one, two) = (losses(3, 1), losses(3, 2));
    for (step, (a, b)) in one.iter().zip(&two).enumerate() {
        // Only the order of the sums differs.
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {}: {a} vs {b}", step + 1);
    }
}
