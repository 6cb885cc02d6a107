//! The mixed-precision policy (`--param-dtype`, `--reduce-dtype`, PREC-1..5): bf16 gathers
//! and reductions halve the bytes each rank sends, measured by the lanes' counters
//! (LANE-8); sharded bf16 runs match one rank with the same policy; bf16 stays close to f32;
//! the masters that come out are f32.

mod common;
use common::*;
use shardline_runtime::engine::PrecisionDtype::{Bf16, F32};
use shardline_runtime::shard::ShardedModelLayout;
use shardline_runtime::train::{build_model, load_data, Summary, TrainConfig};

/// A small mlp-bn run with the given policy, prefetch 0 so that every gather of a step runs
/// within it (with prefetch, unit 0's gather for the next step may run in either step).
fn cfg(world: usize, stage: u8, param: bool, reduce: bool) -> TrainConfig {
    let mut c = small_cfg(world, stage, 6, 60);
    c.prefetch = 0;
    c.param_dtype = if param { Bf16 } else { F32 };
    c.reduce_dtype = Some(if reduce { Bf16 } else { F32 });
    c
}

/// The smallest hidden width from 30 up whose every unit shard is even at world 2, so that
/// packed bf16 is exactly half the bytes (an odd shard pads its last word, PREC-3).
fn even_hidden() -> usize {
    (30..64)
        .find(|&h| {
            let mut c = cfg(2, 3, false, false);
            c.hidden = Some(h);
            let (train, _) = load_data(&c, false).unwrap();
            let m = build_model(&c, &train.sample_shape, train.classes).unwrap();
            let l = ShardedModelLayout::new(&m.spec(), 2).unwrap();
            l.units().iter().all(|u| u.shard_len() % 2 == 0)
        })
        .expect("a width with even shards")
}

/// Bytes of the loss all-reduce (loss, norm, stop and one busy time per rank: five f32 at
/// world 2) that one rank sends at world 2, whatever the algorithm: each element crosses the
/// link once.
const LOSS_BYTES: u64 = 20;

/// PREC-3, PREC-4 (LANE-8's counters): at every stage, world 2, bf16 parameters halve the
/// bytes each rank sends on the gather lane, and a bf16 reduce dtype halves the gradient
/// bytes on the reduce lane, every step; f32 parameters with bf16 reductions touch only the
/// reductions.
#[test]
fn prec3_prec4_bf16_halves_the_bytes_each_rank_sends() {
    let hidden = even_hidden();
    let bytes = |s: &Summary| -> Vec<(u64, u64)> {
        s.step_stats.iter().map(|st| (st.gather_bytes, st.reduce_bytes)).collect()
    };
    for stage in 0..4u8 {
        let with = |p, r| {
            let mut c = cfg(2, stage, p, r);
            c.hidden = Some(hidden);
            bytes(&run_ok(c, quiet()))
        };
        let (f32s, bf16s, mixed) = (with(false, false), with(true, true), with(false, true));
        assert_eq!(f32s.len(), 6);
        for (step, ((f, b), m)) in f32s.iter().zip(&bf16s).zip(&mixed).enumerate() {
            let what = format!("stage {stage} step {}: f32 {f:?} bf16 {b:?}", step + 1);
            assert!(f.1 > LOSS_BYTES, "{what}: gradients were reduced");
            assert_eq!(2 * b.0, f.0, "{what}: gather bytes halve");
            assert_eq!(2 * (b.1 - LOSS_BYTES), f.1 - LOSS_BYTES, "{what}: gradient bytes halve");
            assert_eq!(m.0, f.0, "{what}: f32 parameters gather f32");
            assert_eq!(m.1, b.1, "{what}: bf16 reductions alone");
            // Stage 0 gathers nothing; 1 and 2 gather each unit once, 3 twice.
            assert_eq!(f.0 == 0, stage == 0, "{what}");
        }
    }
}

/// Tolerances between a sharded bf16 run and one rank with the same policy over 6 steps,
/// set ~10x above what was observed. With f32 reductions the rounded parameters are the same
/// values at both worlds and only the f32 partial sums differ (as in `equivalence.rs`):
/// observed loss 7e-8 relative, parameters 3e-8 absolute, at every stage. With bf16
/// reductions world 2 also rounds each rank's partial gradient before the sum, where one
/// rank rounds the whole gradient once: observed loss 1.2e-4 relative, parameters 3.6e-4
/// absolute. A dropped or doubled rank's gradient moves them by 1e-2 or more.
const F32_REDUCE_LOSS_REL: f32 = 1e-6;
const F32_REDUCE_PARAM_ABS: f32 = 4e-7;
const BF16_REDUCE_LOSS_REL: f32 = 2e-3;
const BF16_REDUCE_PARAM_ABS: f32 = 4e-3;

/// PREC-2: world 2 at every stage, bf16 parameters (with f32 and with bf16 reductions),
/// matches one rank with the same policy; every stage computes with the same rounded
/// values.
#[test]
fn prec2_sharded_bf16_matches_one_rank_with_the_same_policy() {
    for reduce in [false, true] {
        let reference = run_ok(cfg(1, 0, true, reduce), quiet());
        let (first, last) = (reference.losses[0], reference.losses[5]);
        assert!(last < 0.9 * first, "bf16 trains: {first} -> {last}");
        for stage in 0..4u8 {
            let s = run_ok(cfg(2, stage, true, reduce), quiet());
            let what = format!("stage {stage}, reduce bf16 {reduce}");
            let lrel = max_rel(&s.losses, &reference.losses);
            let pd = max_abs_diff(&s.final_params, &reference.final_params);
            eprintln!("{what}: loss rel {lrel:e}, params abs {pd:e}");
            let (ltol, ptol) = if reduce {
                (BF16_REDUCE_LOSS_REL, BF16_REDUCE_PARAM_ABS)
            } else {
                (F32_REDUCE_LOSS_REL, F32_REDUCE_PARAM_ABS)
            };
            assert!(lrel <= ltol, "{what}: loss differs by {lrel:e}");
            assert!(pd <= ptol, "{what}: params differ by {pd:e}");
        }
    }
}

/// PREC-2 against an independent reference: bf16 at world 2, stage 3, tracks one f32 rank
/// within a bf16-sized tolerance over 6 steps (observed 3.1e-4 relative), and differs from
/// it by more than f32 rounding would (the policy is in effect).
#[test]
fn prec2_bf16_tracks_f32_within_a_bf16_sized_tolerance() {
    let f32_ref = run_ok(cfg(1, 0, false, false), quiet());
    let s = run_ok(cfg(2, 3, true, true), quiet());
    let lrel = max_rel(&s.losses, &f32_ref.losses);
    eprintln!("bf16 world 2 stage 3 against f32 world 1: loss rel {lrel:e}");
    // bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3 per value).
    assert!(lrel <= 5e-3, "bf16 drifts from f32 by {lrel:e}");
    assert!(lrel > 1e-5, "bf16 equals f32 to {lrel:e}: the policy did nothing");
}

/// PREC-1: the final parameters (what export and checkpoints hold) are the f32 masters at
/// every stage, not their bf16 copies: after training most carry bits below bf16's.
#[test]
fn prec1_final_parameters_are_f32_masters() {
    for stage in 0..4u8 {
        let s = run_ok(cfg(2, stage, true, true), quiet());
        let all: Vec<f32> = s.final_params.concat();
        let below = all.iter().filter(|x| x.to_bits() & 0xffff != 0).count();
        assert!(below * 2 > all.len(), "stage {stage}: {below} of {} f32-only", all.len());
    }
}

/// Bad input: an unknown dtype exits 2 naming the flag.
#[test]
fn unknown_dtype_exits_2_naming_the_flag() {
    for flag in ["--param-dtype", "--reduce-dtype"] {
        let o = shardline(&["train", flag, "f16", "--steps", "1", "--no-progress"]);
        assert_eq!(o.code, Some(2), "{flag}: {}", o.stderr);
        assert!(o.stderr.contains(flag) && o.stderr.contains("f16"), "{}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    }
}

/// PREC-3 through the command line: `--param-dtype bf16` writes `gather_bytes` and
/// `reduce_bytes` to `--log-json`, and the gathers of a bf16 run send half the bytes of an
/// f32 run's (the counters of rank 0, prefetch 0; shards of this model are even).
#[test]
fn prec3_log_json_reports_half_the_gather_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hidden = even_hidden().to_string();
    let gathers = |dtype: &str| -> Vec<u64> {
        let log = dir.path().join(format!("{dtype}.jsonl"));
        let args = [
            "train",
            "--world",
            "2",
            "--stage",
            "3",
            "--prefetch",
            "0",
            "--hidden",
            &hidden,
            "--depth",
            "2",
            "--batch-size",
            "60",
            "--steps",
            "3",
            "--no-progress",
            "--param-dtype",
            dtype,
            "--log-json",
            log.to_str().expect("utf-8"),
        ];
        let o = shardline(&args);
        assert_eq!(o.code, Some(0), "{}", o.stderr);
        let text = std::fs::read_to_string(&log).expect("read log");
        text.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("JSON line");
                assert!(v["reduce_bytes"].as_u64().is_some_and(|b| b > 0), "{v}");
                assert!(v["cast_s"].as_f64().is_some(), "{v}");
                v["gather_bytes"].as_u64().expect("gather_bytes")
            })
            .collect()
    };
    let (f, b) = (gathers("f32"), gathers("bf16"));
    assert_eq!(f.len(), 3);
    assert!(f.iter().zip(&b).all(|(f, b)| *f > 0 && 2 * b == *f), "f32 {f:?} bf16 {b:?}");
}
