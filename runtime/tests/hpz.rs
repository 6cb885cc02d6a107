//! Secondary shards (`--reshard-after-forward`, HPZ-1..4) as threads of one process, whose
//! secondary groups are N consecutive ranks (a process's threads form one node): 2x2, 3x1,
//! and 2x2 inside each of two shard groups of 4 or 2x1 inside shard groups of 2, at stage 3
//! with prefetch 0 and 1, on mlp-bn (SyncBN) and a narrow gpt, bitwise the same run under
//! `world`; the later gathers go over the secondary lane; stages 0-2 ignore the flag;
//! checkpoints are unchanged; bad values exit 2 naming the flag.

mod common;
use common::*;
use shardline_runtime::engine::{ReshardAfterForward, ShardGroup};
use shardline_runtime::train::{RunOptions, Summary, TrainConfig};

/// hsdp.rs's tolerances against one rank (the same sums in another order).
const MLP_LOSS_REL_TOL: f32 = 1e-6;
const MLP_PARAM_ABS_TOL: f32 = 4e-7;
const GPT_LOSS_REL_TOL: f32 = 2e-6;
const GPT_PARAM_ABS_TOL: f32 = 2e-6;

/// (world, shard group, secondary group): 2 "nodes" of 2 over the world, 3 of 1 (the
/// secondary shard is the whole unit), 2 of 1 inside each shard group of 2, and 2 of 2
/// inside each of 2 shard groups of 4 (HSDP across them).
const SHAPES: [(usize, ShardGroup, usize); 4] = [
    (4, ShardGroup::World, 2),
    (3, ShardGroup::World, 1),
    (4, ShardGroup::Ranks(2), 1),
    (8, ShardGroup::Ranks(4), 2),
];

fn with(
    cfg: TrainConfig,
    (world, group, n): (usize, ShardGroup, usize),
    prefetch: usize,
) -> TrainConfig {
    TrainConfig {
        world,
        shard_group: group,
        prefetch,
        reshard_after_forward: ReshardAfterForward::Ranks(n),
        ..cfg
    }
}

fn world_of(cfg: &TrainConfig) -> TrainConfig {
    TrainConfig { reshard_after_forward: ReshardAfterForward::World, ..cfg.clone() }
}

/// The peak of a memory category on the first rank.
fn peak(s: &Summary, key: &str) -> u64 {
    s.peak_by_category[0].iter().find(|(k, _)| k == key).map_or(0, |(_, v)| *v)
}

/// `node` against `world` bitwise (HPZ-3), against one rank within the tolerance, and the
/// secondary path taken (pieces held; bytes on the secondary lane where it has two ranks).
fn check(s: &Summary, world: &Summary, one: &Summary, tol: (f32, f32), n: usize, what: &str) {
    assert!(
        losses_bits_eq(&s.losses, &world.losses),
        "{what}: losses {:?} vs {:?}",
        s.losses,
        world.losses
    );
    assert!(bits_eq(&s.final_params, &world.final_params), "{what}: final params");
    assert!(bits_eq(&s.final_buffers, &world.final_buffers), "{what}: buffers");
    let lrel = max_rel(&s.losses, &one.losses);
    let pd = max_abs_diff(&s.final_params, &one.final_params);
    assert!(lrel <= tol.0 && pd <= tol.1, "{what}: against one rank {lrel:e}, {pd:e}");
    assert!(peak(s, "secondary_shards") > 0, "{what}: secondary pieces held");
    assert_eq!(peak(world, "secondary_shards"), 0, "{what}: none under world");
    let hpz: u64 = s.step_stats.iter().map(|t| t.hpz_bytes).sum();
    assert_eq!(hpz > 0, n > 1, "{what}: {hpz} B on the secondary lane");
}

/// mlp-bn of 4 blocks: with prefetch 1 the head and the last block are kept whole from
/// forward into backward (ENG-5), the others are freed and gathered again.
fn mlp(stage: u8, steps: u64) -> TrainConfig {
    TrainConfig { depth: Some(4), ..small_cfg(1, stage, steps, 60) }
}

/// HPZ-3: mlp-bn with SyncBN, every shape, prefetch 0 and 1.
#[test]
fn mlp_bn_secondary_shards_are_bitwise_world_hpz_3() {
    let steps = 3;
    let one = run_ok(mlp(0, steps), quiet());
    for shape in SHAPES {
        for prefetch in [0, 1] {
            let cfg = with(mlp(3, steps), shape, prefetch);
            let world = run_ok(world_of(&cfg), quiet());
            let s = run_ok(cfg, quiet());
            let what = format!("mlp-bn {shape:?} prefetch {prefetch}");
            check(&s, &world, &one, (MLP_LOSS_REL_TOL, MLP_PARAM_ABS_TOL), shape.2, &what);
        }
    }
}

/// HPZ-3: the narrow gpt (its root unit called first and last), every shape, prefetch 0
/// and 1, and with two microbatches per rank.
#[test]
fn gpt_secondary_shards_are_bitwise_world_hpz_3() {
    let batch = 12;
    let one = run_ok(gpt_cfg(1, 0, batch), quiet());
    for shape in SHAPES {
        for prefetch in [0, 1] {
            let cfg = with(gpt_cfg(1, 3, batch), shape, prefetch);
            let world = run_ok(world_of(&cfg), quiet());
            let s = run_ok(cfg, quiet());
            let what = format!("gpt {shape:?} prefetch {prefetch}");
            check(&s, &world, &one, (GPT_LOSS_REL_TOL, GPT_PARAM_ABS_TOL), shape.2, &what);
        }
    }
    // Two microbatches: the pieces serve the second microbatch's forward too.
    let accum = TrainConfig { grad_accum: 2, ..gpt_cfg(1, 3, 16) };
    let cfg = with(accum, (4, ShardGroup::World, 2), 1);
    let world = run_ok(world_of(&cfg), quiet());
    let s = run_ok(cfg, quiet());
    let one = run_ok(gpt_cfg(1, 0, 16), quiet());
    check(&s, &world, &one, (GPT_LOSS_REL_TOL, GPT_PARAM_ABS_TOL), 2, "gpt grad-accum 2");
}

/// HPZ-5: under packed gathers (bf16 parameters, int8 and fp8 gathers) the pieces are the
/// decoded unit's values, so the run is still bitwise the same run under `world`, on mlp-bn
/// and the narrow gpt; against one rank only the packing's own error separates them, so
/// that comparison is `world`'s business (precision tests), not this one's.
#[test]
fn packed_gathers_with_secondary_shards_are_bitwise_world_hpz_5() {
    use shardline_runtime::engine::{GatherDtype, PrecisionDtype};
    type Packing = fn(TrainConfig) -> TrainConfig;
    let packed: [(&str, Packing); 3] = [
        ("bf16", |c| TrainConfig {
            param_dtype: PrecisionDtype::Bf16,
            reduce_dtype: Some(PrecisionDtype::F32),
            ..c
        }),
        ("int8", |c| TrainConfig { gather_dtype: Some(GatherDtype::Int8), ..c }),
        ("fp8", |c| TrainConfig { gather_dtype: Some(GatherDtype::Fp8), ..c }),
    ];
    for (name, dtype) in packed {
        for (model, base) in [("mlp-bn", mlp(3, 3)), ("gpt", gpt_cfg(1, 3, 12))] {
            let cfg = dtype(with(base, (4, ShardGroup::World, 2), 0));
            let world = run_ok(world_of(&cfg), quiet());
            let s = run_ok(cfg, quiet());
            let what = format!("{model} {name}");
            assert!(losses_bits_eq(&s.losses, &world.losses), "{what}: losses");
            assert!(bits_eq(&s.final_params, &world.final_params), "{what}: final params");
            assert!(peak(&s, "secondary_shards") > 0, "{what}: secondary pieces held");
            let hpz: u64 = s.step_stats.iter().map(|t| t.hpz_bytes).sum();
            assert!(hpz > 0, "{what}: nothing on the secondary lane");
        }
    }
}

/// HPZ-2, measured at the lanes (LANE-8) at stage 3, prefetch 0 (no gather crosses a step
/// boundary), world 4 in secondary groups of 2: every gather that leaves the world's gather
/// lane is made on the secondary lane instead. A gather of a unit padded to p values sends
/// 3p/4 values per rank over 4 ranks and p/2 over 2, so the bytes the world lane loses are
/// 3/2 of those the secondary lane carries; the world lane keeps each unit's first gather.
#[test]
fn later_gathers_move_to_the_secondary_lane_hpz_2() {
    for (model, cfg) in [("mlp-bn", mlp(3, 3)), ("gpt", gpt_cfg(1, 3, 12))] {
        let cfg = with(cfg, (4, ShardGroup::World, 2), 0);
        let world = run_ok(world_of(&cfg), quiet());
        let s = run_ok(cfg, quiet());
        for (k, (h, w)) in s.step_stats.iter().zip(&world.step_stats).enumerate() {
            assert_eq!(w.hpz_bytes, 0, "{model} step {k}: no secondary lane under world");
            assert!(h.hpz_bytes > 0, "{model} step {k}");
            assert_eq!(
                (w.gather_bytes - h.gather_bytes) * 2,
                h.hpz_bytes * 3,
                "{model} step {k}: world {} B, node {} B + secondary {} B",
                w.gather_bytes,
                h.gather_bytes,
                h.hpz_bytes
            );
            assert_eq!(h.reduce_bytes, w.reduce_bytes, "{model} step {k}: reductions unchanged");
            eprintln!(
                "hpz {model} world 4 in groups of 2, stage 3 step {k}: gather lane {} B \
                 (world: {} B), secondary lane {} B per rank",
                h.gather_bytes, w.gather_bytes, h.hpz_bytes
            );
        }
    }
}

/// HPZ-4: stages 0-2 keep full parameters: the flag changes nothing there, and a group
/// size stage 3 would refuse is not refused.
#[test]
fn stages_0_to_2_ignore_the_flag_hpz_4() {
    for stage in [0u8, 1, 2] {
        for n in [2, 3] {
            let cfg = TrainConfig {
                world: 4,
                reshard_after_forward: ReshardAfterForward::Ranks(n),
                ..small_cfg(1, stage, 2, 60)
            };
            let world = run_ok(world_of(&cfg), quiet());
            let s = run_ok(cfg, quiet());
            let what = format!("stage {stage}, groups of {n}");
            assert!(losses_bits_eq(&s.losses, &world.losses), "{what}");
            assert!(bits_eq(&s.final_params, &world.final_params), "{what}");
            assert_eq!(peak(&s, "secondary_shards"), 0, "{what}");
            assert!(s.step_stats.iter().all(|t| t.hpz_bytes == 0), "{what}");
        }
    }
}

/// HPZ-2: the pieces live inside a step, so checkpoints are unchanged: a run stopped under
/// `world` and resumed under secondary groups of 2 is bitwise the uninterrupted run.
#[test]
fn a_world_checkpoint_resumes_under_secondary_shards_bitwise_hpz_2() {
    let cfg = with(mlp(3, 6), (4, ShardGroup::World, 2), 1);
    let full = run_ok(world_of(&cfg), quiet());
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = RunOptions { checkpoint_dir: Some(dir.path().to_path_buf()), ..quiet() };
    run_ok(world_of(&cfg), RunOptions { stop_after: Some(3), ..opts.clone() });
    let rest = run_ok(cfg, RunOptions { resume: true, ..opts });
    assert!(
        losses_bits_eq(&rest.losses, &full.losses[3..]),
        "{:?} vs {:?}",
        rest.losses,
        full.losses
    );
    assert!(bits_eq(&rest.final_params, &full.final_params), "final params");
}

/// HPZ-1: bad values and combinations exit 2 naming the flag, before any step; the device
/// engine refuses it by name.
#[test]
fn bad_values_exit_2_naming_the_flag_hpz_1() {
    let base = ["train", "--steps", "1", "--world", "4", "--batch-size", "8", "--stage", "3"];
    let flag = "--reshard-after-forward";
    for (extra, says) in [
        (&[flag, "3"][..], "--reshard-after-forward 3: a secondary group of 3 ranks must divide"),
        (&[flag, "4"][..], "would be the whole shard group of 4 ranks"),
        (&[flag, "node"][..], "--reshard-after-forward node: the secondary group would be"),
        (&[flag, "2", "--shard-group", "2"][..], "whole shard group of 2 ranks"),
        (&[flag, "node", "--shard-group", "node"][..], "whole shard group of 4 ranks"),
        (&[flag, "0"][..], "--reshard-after-forward 0: a secondary group needs"),
        (&[flag, "x"][..], "--reshard-after-forward x: 'x' is not a number"),
        (&[flag, "2", "--device", "sim"][..], "--reshard-after-forward is not supported"),
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let out = shardline(&args);
        assert_eq!(out.code, Some(2), "{extra:?}: {}", out.stderr);
        assert!(out.stderr.contains(says), "{extra:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{extra:?}: {}", out.stderr);
    }
    // `--stage auto --profile` prices no secondary shards: refused, not silently ignored.
    let profile = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/two-links-profile.json");
    let args = ["train", "--steps", "1", "--world", "4", "--batch-size", "8", "--stage", "auto"];
    let out = shardline(&[&args[..], &["--profile", profile, flag, "2"]].concat());
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("not among --stage auto --profile's candidates"), "{}", out.stderr);
}
