//! Hybrid sharding (`--shard-group`, HSDP-1..4): groups x group size 2x1, 2x2 and 3x1 train
//! as one rank does at every stage, with and without prefetch, on mlp-bn (SyncBN over the
//! world) and a narrow gpt; the traffic between groups is the gradient shards' all-reduce;
//! checkpoints hold each shard once and resume under another group shape; bad values exit
//! 2 naming the flag.

mod common;
use common::*;
use shardline_runtime::checkpoint::{self, Checkpoint};
use shardline_runtime::engine::ShardGroup;
use shardline_runtime::train::{RunOptions, Summary, TrainConfig};

/// The tolerances of equivalence.rs (mlp-bn) and gpt_equivalence.rs (gpt), for the same
/// reason: a sharded step sums the gradient in another order than one rank does. A group's
/// sum is two partial sums (the group's reduce-scatter, then the replica all-reduce), still
/// a sum of the same terms.
const MLP_LOSS_REL_TOL: f32 = 1e-6;
const MLP_PARAM_ABS_TOL: f32 = 4e-7;
const GPT_LOSS_REL_TOL: f32 = 2e-6;
const GPT_PARAM_ABS_TOL: f32 = 2e-6;

/// (groups, group size).
const SHAPES: [(usize, usize); 3] = [(2, 1), (2, 2), (3, 1)];

/// Every stage, and stage 3 with prefetch 0 as well as 1 (prefetch acts at stage 3 only).
const STAGES: [(u8, usize); 5] = [(0, 1), (1, 1), (2, 1), (3, 0), (3, 1)];

fn hybrid(cfg: TrainConfig, (groups, size): (usize, usize), prefetch: usize) -> TrainConfig {
    TrainConfig { world: groups * size, shard_group: ShardGroup::Ranks(size), prefetch, ..cfg }
}

fn check(s: &Summary, reference: &Summary, (loss_tol, param_tol): (f32, f32), what: &str) {
    let lrel = max_rel(&s.losses, &reference.losses);
    let pd = max_abs_diff(&s.final_params, &reference.final_params);
    assert!(lrel <= loss_tol, "{what}: loss curve differs by {lrel:e} relative");
    assert!(pd <= param_tol, "{what}: parameters differ by {pd:e}");
    let norms =
        |s: &Summary| -> Vec<f32> { s.step_stats.iter().map(|st| st.grad_norm as f32).collect() };
    let nrel = max_rel(&norms(s), &norms(reference));
    assert!(nrel <= loss_tol, "{what}: gradient norms differ by {nrel:e} relative");
}

/// HSDP-1, HSDP-3, HSDP-4: mlp-bn with SyncBN (statistics over the world), every shape,
/// stage and prefetch depth, against one rank; the BatchNorm buffers too.
#[test]
fn mlp_bn_groups_match_one_rank_at_every_stage_hsdp_3() {
    let (batch, steps) = (60, 4);
    let reference = run_ok(small_cfg(1, 0, steps, batch), quiet());
    for shape in SHAPES {
        for (stage, prefetch) in STAGES {
            let s = run_ok(hybrid(small_cfg(1, stage, steps, batch), shape, prefetch), quiet());
            let what = format!("mlp-bn {}x{} stage {stage} prefetch {prefetch}", shape.0, shape.1);
            check(&s, &reference, (MLP_LOSS_REL_TOL, MLP_PARAM_ABS_TOL), &what);
            let bd = max_abs_diff(&s.final_buffers, &reference.final_buffers);
            assert!(bd <= 6e-7, "{what}: BatchNorm buffers differ by {bd:e}");
        }
    }
}

/// HSDP-3: the narrow gpt, every shape, stage and prefetch depth, against one rank.
#[test]
fn gpt_groups_match_one_rank_at_every_stage_hsdp_3() {
    let batch = 12;
    let reference = run_ok(gpt_cfg(1, 0, batch), quiet());
    for shape in SHAPES {
        for (stage, prefetch) in STAGES {
            let s = run_ok(hybrid(gpt_cfg(1, stage, batch), shape, prefetch), quiet());
            let what = format!("gpt {}x{} stage {stage} prefetch {prefetch}", shape.0, shape.1);
            check(&s, &reference, (GPT_LOSS_REL_TOL, GPT_PARAM_ABS_TOL), &what);
        }
    }
}

/// HSDP-3 with gradient accumulation (ACC-3): 2x2 with 2 microbatches per rank, each
/// microbatch's reduced shard summed over the replicas and added into the shard (`each`),
/// or one reduction after the last (`last`), against one rank without accumulation.
#[test]
fn gpt_groups_with_grad_accum_match_one_rank_hsdp_3() {
    use shardline_runtime::engine::AccumReduce;
    let batch = 16;
    let reference = run_ok(gpt_cfg(1, 0, batch), quiet());
    for stage in [1u8, 2, 3] {
        for how in [AccumReduce::Each, AccumReduce::Last] {
            let accum = TrainConfig {
                grad_accum: 2,
                accum_reduce: (stage >= 2).then_some(how),
                ..gpt_cfg(1, stage, batch)
            };
            let s = run_ok(hybrid(accum, (2, 2), 1), quiet());
            let what = format!("gpt 2x2 stage {stage} grad-accum 2 {how:?}");
            check(&s, &reference, (GPT_LOSS_REL_TOL, GPT_PARAM_ABS_TOL), &what);
        }
    }
}

/// HSDP-3, measured at the lanes (LANE-8) on gpt at stage 3, prefetch 0: a 2x2 job's gathers and
/// reduce-scatters are a world-2 job's (they stay inside the group of 2), and what crosses
/// the groups is the all-reduce of each unit's reduced gradient shard (replica lane) plus
/// the world's loss all-reduce. Byte counts per rank per step, both ops small enough to go
/// Direct or large enough for the ring: with 2 ranks an all-reduce of n values sends 4n
/// bytes either way, a reduce-scatter of 2n sends 4n; the loss all-reduce carries
/// 3 + world values to every peer: 20 bytes at world 2, 84 at world 4.
#[test]
fn cross_group_traffic_is_the_shard_all_reduce_hsdp_3() {
    // Prefetch 0: a gather prefetched across the step boundary counts in whichever step it
    // runs during (LANE-8), which timing decides.
    let cfg = TrainConfig { prefetch: 0, ..gpt_cfg(1, 3, 12) };
    let plain2 = run_ok(TrainConfig { world: 2, ..cfg.clone() }, quiet());
    let plain4 = run_ok(TrainConfig { world: 4, ..cfg.clone() }, quiet());
    let hsdp = run_ok(hybrid(cfg, (2, 2), 0), quiet());
    for (k, (h, p)) in hsdp.step_stats.iter().zip(&plain2.step_stats).enumerate() {
        assert_eq!(h.gather_bytes, p.gather_bytes, "step {k}: gathers stay in the group of 2");
        let scatter = p.reduce_bytes - 20;
        assert_eq!(h.reduce_bytes, scatter + 84, "step {k}: the group's reduce-scatters");
        assert_eq!(h.replica_bytes, scatter, "step {k}: each reduced shard, all-reduced once");
        assert_eq!(p.replica_bytes, 0, "step {k}: one group has no replica traffic");
        // Sharding over 4 sends each rank 3 of 4 quarters per gather, over 2 one half.
        let w4 = &plain4.step_stats[k];
        assert!(h.gather_bytes < w4.gather_bytes, "step {k}: gathers over 2, not 4");
        eprintln!(
            "hsdp 2x2 gpt stage 3 step {k}: gather {} B (world 2: {} B, world 4: {} B), \
             reduce {} B (world 4: {} B), replica {} B per rank",
            h.gather_bytes,
            p.gather_bytes,
            w4.gather_bytes,
            h.reduce_bytes,
            w4.reduce_bytes,
            h.replica_bytes
        );
    }
}

/// QREDUCE-1, QREDUCE-2 in training: with `--cross-node-reduce-dtype int8|fp8` the traffic
/// between groups is the packed shards' all-gather, about a quarter of the f32 all-reduce
/// (2 replicas: an all-reduce of n values sends 4n bytes, the all-gather of n packed values
/// 4 (n/4 + n/256) bytes); the loss curve stays within 1% of f32's and is not f32's (the
/// path is taken), at 2x2 and 3x1 (three replicas) and stages 1-3.
#[test]
fn packed_cross_group_reduction_quarters_the_bytes_qreduce_2() {
    use shardline_runtime::engine::GatherDtype;
    let cfg = TrainConfig { prefetch: 0, steps: Some(6), ..gpt_cfg(1, 3, 12) };
    let f32_run = run_ok(hybrid(cfg.clone(), (2, 2), 0), quiet());
    for (dtype, shape, stage) in [
        (GatherDtype::Int8, (2, 2), 3u8),
        (GatherDtype::Fp8, (2, 2), 3),
        (GatherDtype::Int8, (3, 1), 1),
        (GatherDtype::Int8, (2, 2), 2),
    ] {
        let q = TrainConfig {
            cross_node_reduce_dtype: Some(dtype),
            ..hybrid(gpt_cfg(1, stage, 12), shape, 0)
        };
        let q = run_ok(TrainConfig { steps: Some(6), ..q }, quiet());
        let what = format!("{} {}x{} stage {stage}", dtype.name(), shape.0, shape.1);
        let rel = max_rel(&q.losses, &f32_run.losses);
        assert!(rel <= 1e-2, "{what}: losses differ from f32 by {rel:e} relative");
        assert!(q.losses != f32_run.losses, "{what}: the same losses as f32");
        if shape == (2, 2) && stage == 3 {
            for (k, (a, b)) in q.step_stats.iter().zip(&f32_run.step_stats).enumerate() {
                let ratio = a.replica_bytes as f64 / b.replica_bytes as f64;
                assert!(
                    (0.25..0.27).contains(&ratio),
                    "{what} step {k}: {} against {} B across groups",
                    a.replica_bytes,
                    b.replica_bytes
                );
                assert_eq!(a.gather_bytes, b.gather_bytes, "{what} step {k}: gathers unchanged");
            }
            eprintln!(
                "{what}: {} B across groups per rank per step against f32's {} B; losses within \
                 {rel:e} relative of f32's",
                q.step_stats[1].replica_bytes, f32_run.step_stats[1].replica_bytes
            );
        }
    }
}

/// Bad values exit 2 naming the flag; the device engine refuses it by name.
#[test]
fn bad_shard_groups_exit_2_naming_the_flag() {
    let base = ["train", "--steps", "1", "--world", "4", "--batch-size", "8", "--no-progress"];
    for (extra, says) in [
        (&["--shard-group", "3"][..], "--shard-group 3 does not divide"),
        (&["--shard-group", "0"][..], "--shard-group 0"),
        (&["--shard-group", "x"][..], "--shard-group x: 'x' is not a number"),
        (&["--shard-group", "2", "--param-dtype", "bf16"][..], "--reduce-dtype f32"),
        (&["--shard-group", "2", "--device", "sim"][..], "--shard-group is not supported"),
        (&["--cross-node-reduce-dtype", "int8"][..], "--cross-node-reduce-dtype int8 packs"),
        (&["--shard-group", "2", "--cross-node-reduce-dtype", "int4"][..], "must be int8 or fp8"),
        (
            &["--shard-group", "2", "--stage", "0", "--cross-node-reduce-dtype", "fp8"][..],
            "a stage of 1-3",
        ),
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let out = shardline(&args);
        assert_eq!(out.code, Some(2), "{extra:?}: {}", out.stderr);
        assert!(out.stderr.contains(says), "{extra:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{extra:?}: {}", out.stderr);
    }
}

fn ckpt_opts(dir: &std::path::Path) -> RunOptions {
    RunOptions { checkpoint_dir: Some(dir.to_path_buf()), checkpoint_every: 0, ..quiet() }
}

fn newest(dir: &std::path::Path) -> Checkpoint {
    let p = checkpoint::latest(dir).expect("list checkpoints").expect("a committed checkpoint");
    Checkpoint::open(p).expect("open checkpoint")
}

/// The shard files of a checkpoint directory.
fn shard_files(ck: &Checkpoint) -> usize {
    let names = std::fs::read_dir(ck.dir()).expect("read checkpoint dir");
    names
        .filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().starts_with("shard")))
        .count()
}

/// HSDP-2: a 2x2 job stopped and resumed as 2x2 is bitwise the uninterrupted 2x2 job, and
/// its checkpoint holds one copy of each of the 2 shards.
#[test]
fn a_2x2_checkpoint_holds_each_shard_once_and_resumes_bitwise_hsdp_2() {
    let cfg = hybrid(small_cfg(1, 3, 6, 60), (2, 2), 1);
    let full = run_ok(cfg.clone(), quiet());
    let dir = tempfile::tempdir().expect("tempdir");
    run_ok(cfg.clone(), RunOptions { stop_after: Some(3), ..ckpt_opts(dir.path()) });
    let ck = newest(dir.path());
    assert_eq!((ck.manifest().world, ck.manifest().step), (2, 3), "shards and step");
    assert_eq!(shard_files(&ck), 2, "one file per shard, written by the first group");
    ck.verify().expect("the checkpoint verifies");
    let rest = run_ok(cfg, RunOptions { resume: true, ..ckpt_opts(dir.path()) });
    assert!(
        losses_bits_eq(&rest.losses, &full.losses[3..]),
        "{:?} vs {:?}",
        rest.losses,
        full.losses
    );
    assert!(bits_eq(&rest.final_params, &full.final_params), "final params");
}

/// HSDP-2: a checkpoint written under one group shape resumes under another: 2x2 -> 1x4 ->
/// 2x2 -> world 1 -> 4x1, two steps each at stage 3 (the stage is part of the configuration
/// a checkpoint must match), the losses those of
/// an uninterrupted world-1 run within the equivalence tolerance (only summation orders
/// differ), and each checkpoint holds the shards of its writer's group size.
#[test]
fn checkpoints_resume_under_another_group_shape_hsdp_2() {
    let steps = 10;
    let reference = run_ok(small_cfg(1, 0, steps, 60), quiet());
    let dir = tempfile::tempdir().expect("tempdir");
    let legs: [((usize, usize), u8, usize); 5] =
        [((2, 2), 3, 2), ((1, 4), 3, 4), ((2, 2), 3, 2), ((1, 1), 3, 1), ((4, 1), 3, 1)];
    let mut losses = Vec::new();
    for (k, (shape, stage, shards)) in legs.into_iter().enumerate() {
        let cfg = hybrid(small_cfg(1, stage, steps, 60), shape, 1);
        let opts = RunOptions { stop_after: Some(2), resume: k > 0, ..ckpt_opts(dir.path()) };
        let s = run_ok(cfg, opts);
        losses.extend(s.losses);
        let ck = newest(dir.path());
        let what = format!("leg {k}: {}x{} stage {stage}", shape.0, shape.1);
        assert_eq!(ck.manifest().step, 2 * (k as u64 + 1), "{what}");
        assert_eq!((ck.manifest().world, shard_files(&ck)), (shards, shards), "{what}");
    }
    let lrel = max_rel(&losses, &reference.losses);
    assert!(lrel <= MLP_LOSS_REL_TOL, "resumed across shapes: losses differ by {lrel:e}");
}

/// (step, loss bits) of each line of a `--log-json` file.
fn logged_losses(path: &std::path::Path) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(path).expect("read log");
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON log line");
            (v["step"].as_u64().expect("step"), v["loss"].as_f64().expect("loss").to_bits())
        })
        .collect()
}

/// HSDP-1..3 with one process per rank (`shardline launch`, over shm and over tcp): a 2x2
/// job at stage 3 logs bitwise the losses of the same job with its ranks as threads, and its
/// checkpoint holds the 2 shards once (the launched commit, HSDP-2).
#[test]
fn launched_2x2_matches_threads_and_writes_each_shard_once_hsdp_2() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let utf8 = |p: &std::path::Path| p.to_str().expect("utf-8 temp path").to_owned();
    let train: Vec<String> = [
        "train",
        "--hidden",
        "32",
        "--depth",
        "2",
        "--batch-size",
        "48",
        "--steps",
        "4",
        "--stage",
        "3",
        "--sync-bn",
        "on",
        "--shard-group",
        "2",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let run = |args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = shardline(&refs);
        assert_eq!(o.code, Some(0), "shardline {args:?}\n{}\n{}", o.stdout, o.stderr);
    };
    let local = tmp.path().join("local.jsonl");
    let mut a = train.clone();
    a.extend(["--world".into(), "4".into(), "--log-json".into(), utf8(&local)]);
    run(a);
    let la = logged_losses(&local);
    assert_eq!(la.len(), 4, "one line per step");
    // auto: shm between the processes of one node.
    for transport in ["auto", "tcp"] {
        let launched = tmp.path().join(format!("{transport}.jsonl"));
        let ck = tmp.path().join(format!("ck-{transport}"));
        let mut b: Vec<String> =
            ["launch", "--nproc-per-node", "4", "--transport", transport, "--"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        b.extend(train.clone());
        b.extend(["--log-json".into(), utf8(&launched), "--checkpoint-dir".into(), utf8(&ck)]);
        run(b);
        let lb = logged_losses(&launched);
        assert_eq!(la, lb, "{transport}: threads and processes log the same losses");
        let c = newest(&ck);
        assert_eq!((c.manifest().world, c.manifest().step, shard_files(&c)), (2, 4, 2));
        c.verify().expect("the launched checkpoint verifies");
    }
}
