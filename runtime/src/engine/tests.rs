//! The engine's tests over real (in-process) communicators; the pure cores are tested in
//! their own modules.

use super::*;
use crate::memory::Category;
use shardline_models::{ConvNetBn, Network};

/// Class labels as the engine takes them.
fn lab(y: &[u32]) -> Tensor {
    Tensor::from_u32(vec![y.len()], y.to_vec()).unwrap()
}

/// Gathers per step on each rank (from the trace, before the final evaluation) and the
/// peak gathered-unit bytes, for a 4-unit mlp-bn (blocks of 64x64, head 64x10).
fn gathers_per_step(prefetch: usize) -> (Vec<usize>, u64, u64) {
    use crate::train::{build_model, load_data, run, RunOptions, StageChoice, SyncBnMode};
    let dir = std::env::temp_dir().join(format!("eng5-{}-{prefetch}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("t.json");
    let steps = 2;
    let cfg = crate::train::TrainConfig {
        world: 2,
        stage: StageChoice::Fixed(Stage::Zero3),
        model: "mlp-bn".into(),
        dataset: "synthetic".into(),
        input_dim: 64,
        classes: 10,
        samples: 64,
        hidden: Some(64),
        depth: Some(3),
        steps: Some(steps),
        batch_size: 16,
        sync_bn: SyncBnMode::Off,
        prefetch,
        timeout_s: 30,
        ..Default::default()
    };
    let (train_set, _) = load_data(&cfg, false).unwrap();
    let model = build_model(&cfg, &train_set.sample_shape, train_set.classes).unwrap();
    let layout = ShardedModelLayout::new(&model.spec(), 2).unwrap();
    assert_eq!(layout.units().len(), 4);
    let budget = layout.max_unit_padded_numel() as u64 * 4 * (prefetch as u64 + 1);
    let opts = RunOptions { trace: Some(trace.clone()), quiet: true, ..Default::default() };
    let summary = run(cfg, opts).unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let evs = doc["traceEvents"].as_array().unwrap();
    // OVL-3's input: every collective span carries its whole buffer's size, a unit's
    // padded size for gathers and reduce-scatters.
    let unit_bytes: Vec<u64> = layout.units().iter().map(|u| u.padded_numel() as u64 * 4).collect();
    for e in evs.iter().filter(|e| e["ph"] == "X") {
        let tid = e["tid"].as_u64();
        if tid == Some(Row::Gather as u64)
            || e["name"].as_str().unwrap().starts_with("reduce-scatter")
        {
            let b = e["args"]["bytes"].as_u64().unwrap_or(0);
            assert!(unit_bytes.contains(&b), "{e}: {b} B is no unit's size {unit_bytes:?}");
        }
    }
    // ENG-9: every unit but the first (each starts with a linear layer) computes its
    // input gradient after its backward, in a span of its own; the first unit never does.
    let names: Vec<&str> = evs
        .iter()
        .filter(|e| e["ph"] == "X" && e["tid"] == Row::Compute as u32)
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for u in 0..layout.units().len() {
        let label = model.unit_name(u);
        let n = names.iter().filter(|n| **n == format!("input grad {label}")).count();
        let backward = names.iter().filter(|n| **n == format!("backward {label}")).count();
        assert_eq!(backward, 2 * steps as usize, "{label}: one backward per rank and step");
        assert_eq!(n, if u == 0 { 0 } else { backward }, "{label}: input gradient spans");
    }
    let per_rank = (0..2u64)
        .map(|r| {
            let mine = |e: &&serde_json::Value| e["ph"] == "X" && e["pid"].as_u64() == Some(r);
            let end =
                |e: &serde_json::Value| e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap();
            let last_opt = evs
                .iter()
                .filter(mine)
                .filter(|e| e["name"] == "optimizer")
                .map(end)
                .fold(0.0, f64::max);
            let n = evs
                .iter()
                .filter(mine)
                .filter(|e| e["tid"] == Row::Gather as u32 && end(e) <= last_opt)
                .count();
            n / steps as usize
        })
        .collect();
    let peak = summary.peak_by_category[0]
        .iter()
        .find(|(k, _)| k == "gathered_units")
        .map(|(_, b)| *b)
        .unwrap();
    (per_rank, peak, budget)
}

/// ENG-5: the head is kept from forward into backward, and with prefetch 1 the last
/// block too (block + head fit two blocks' budget), never exceeding the budget; uses per
/// step are 2 x 4 = 8.
#[test]
fn units_used_again_soon_are_kept_within_the_budget() {
    let (p0, peak0, budget0) = gathers_per_step(0);
    assert_eq!(p0, vec![7, 7], "prefetch 0: only the head is kept");
    assert!(peak0 <= budget0, "{peak0} > {budget0}");
    let (p1, peak1, budget1) = gathers_per_step(1);
    assert_eq!(p1, vec![6, 6], "prefetch 1: the head and the last block are kept");
    assert!(peak1 <= budget1, "{peak1} > {budget1}");
}

/// A small stage-3 engine configuration with plain SGD on the CPU.
fn stage3_sgd(prefetch: usize, seed: u64) -> EngineConfig {
    EngineConfig {
        stage: Stage::Zero3,
        prefetch,
        prefetch_budget_bytes: 1 << 20,
        reduce_budget_bytes: 1 << 20,
        sync_bn: false,
        optimizer: Optimizer::Sgd(crate::optim::SgdConfig::default()),
        weight_decay_on: crate::optim::WeightDecayOn::All,
        lr: LrSchedule::constant(0.1),
        clip_grad_norm: None,
        seed,
        threads: 1,
        device: Device::Cpu,
        grad_accum: 1,
        accum_reduce: AccumReduce::Each,
        recompute: Recompute::None,
        precision: MixedPrecision::default(),
        shard_group: crate::engine::ShardGroup::World,
        cross_node_reduce: None,
        reshard_after_forward: crate::engine::ReshardAfterForward::World,
    }
}

/// Evaluation in forwards of a few samples gives what one forward over the whole share
/// gives, on every rank of a world whose shares differ in length (101 samples over 3
/// ranks: 34, 34, 33, so at batch 1 the last rank runs an empty last forward).
#[test]
fn eval_in_batches_matches_one_forward() {
    let test = Dataset::synthetic(101, 8, 3, 5).unwrap();
    let mut m = shardline_models::zoo::MlpBn::digits();
    (m.input_dim, m.hidden, m.depth, m.classes) = (8, 16, 2, 3);
    let model: Arc<dyn Network> = Arc::new(m.build());
    let comms = shardline_collectives::local_group(3).unwrap();
    let results: Vec<Vec<(u64, u64, f32)>> = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (model, test) = (Arc::clone(&model), &test);
                sc.spawn(move || {
                    let cfg = stage3_sgd(1, 3);
                    let mem = MemoryTracker::new(comm.rank(), None);
                    let mut e = RankEngine::new(comm, model, cfg, mem, Trace::disabled()).unwrap();
                    [1000, 17, 5, 1].iter().map(|&b| e.eval_set(test, b).unwrap()).collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, per_batch) in results.iter().enumerate() {
        let (c0, n0, l0) = per_batch[0];
        assert_eq!(n0, 101, "rank {rank}: every sample counted once");
        for &(c, n, l) in &per_batch[1..] {
            assert_eq!((c, n), (c0, n0), "rank {rank}");
            assert!((l - l0).abs() <= 1e-5 * l0.abs().max(1.0), "rank {rank}: loss {l} vs {l0}");
        }
    }
}

/// ENG-6: with prefetch, a step leaves unit 0's gather in flight for the next pass; a
/// checkpoint load drops it.
#[test]
fn the_next_passs_first_gather_leaves_with_the_optimizer() {
    let comm = shardline_collectives::local_group(1).unwrap().pop().unwrap();
    let mut m = shardline_models::zoo::MlpBn::digits();
    (m.input_dim, m.hidden, m.depth, m.classes) = (8, 8, 2, 3);
    let model: Arc<dyn Network> = Arc::new(m.build());
    for prefetch in [0, 1, 2] {
        let cfg = stage3_sgd(prefetch, 1);
        let mem = MemoryTracker::new(0, None);
        let mut e =
            RankEngine::new(comm.clone(), Arc::clone(&model), cfg, mem, Trace::disabled()).unwrap();
        let x = Tensor::new(vec![4, 8], (0..32).map(|i| i as f32 / 32.0).collect()).unwrap();
        e.train_step(x, &lab(&[0, 1, 2, 0]), 4).unwrap();
        let expect = (prefetch > 0).then_some(0);
        assert_eq!(e.plan.queued_units(), Vec::from_iter(expect), "prefetch {prefetch}");
        let (state, bufs) = (e.shard_state(), e.buffers().to_vec());
        e.load_state(&state, &bufs, 1).unwrap();
        assert!(e.plan.queued_units().is_empty());
        let x = Tensor::new(vec![4, 8], vec![0.25; 32]).unwrap();
        let (_, n, _) = e.eval(x, &lab(&[0, 1, 2, 0]), 4).unwrap();
        assert_eq!(n, 4);
    }
}

/// Runs `f(rank, engine)` on every rank of a local group of `world`, each engine built with
/// `cfg` and `trace` over `model`; returns the results in rank order.
fn on_ranks<T: Send>(
    world: usize,
    model: &Arc<dyn Network>,
    cfg: &EngineConfig,
    trace: &Trace,
    f: impl Fn(usize, &mut RankEngine) -> T + Sync,
) -> Vec<T> {
    let comms = shardline_collectives::local_group(world).unwrap();
    std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (model, cfg, trace, f) = (Arc::clone(model), cfg.clone(), trace.clone(), &f);
                sc.spawn(move || {
                    let r = comm.rank();
                    let mem = MemoryTracker::new(r, None);
                    let mut e = RankEngine::new(comm, model, cfg, mem, trace).unwrap();
                    f(r, &mut e)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A small mlp-bn (8 inputs, blocks of 16, 3 classes).
fn small_mlp(depth: usize) -> Arc<dyn Network> {
    let mut m = shardline_models::zoo::MlpBn::digits();
    (m.input_dim, m.hidden, m.depth, m.classes) = (8, 16, depth, 3);
    Arc::new(m.build())
}

/// Rank `r`'s slice of a global batch of 12 samples split 7/5 (world 2) or all (world 1),
/// and its labels.
fn slice(world: usize, r: usize) -> (Tensor, Vec<u32>) {
    let (start, n) = match (world, r) {
        (1, _) => (0, 12),
        (_, 0) => (0, 7),
        _ => (7, 5),
    };
    let x = (start * 8..(start + n) * 8).map(|i| ((i * 37) % 23) as f32 / 11.0 - 1.0).collect();
    let y = (start..start + n).map(|i| (i % 3) as u32).collect();
    (Tensor::new(vec![n, 8], x).unwrap(), y)
}

/// ENG-2: every rank reports the same loss and gradient norm, those of one rank on the
/// whole global batch (mean loss over it; each gradient element counted once, whichever rank
/// holds it and however the stage steps it), with SyncBN and uneven slices, at every stage.
#[test]
fn eng2_loss_and_norm_are_the_global_batchs_on_every_rank() {
    let model = small_mlp(2);
    let mut cfg = stage3_sgd(1, 4);
    cfg.sync_bn = true;
    let step = |world: usize, cfg: &EngineConfig| {
        on_ranks(world, &model, cfg, &Trace::disabled(), |r, e| {
            let (x, y) = slice(world, r);
            let s = e.train_step(x, &lab(&y), 12).unwrap();
            (s.loss, s.grad_norm)
        })
    };
    let one = step(1, &cfg)[0];
    for stage in Stage::ALL {
        cfg.stage = stage;
        let two = step(2, &cfg);
        assert_eq!(two[0].0.to_bits(), two[1].0.to_bits(), "{stage:?}: the ranks' losses");
        assert_eq!(two[0].1.to_bits(), two[1].1.to_bits(), "{stage:?}: the ranks' norms");
        assert!((two[0].0 - one.0).abs() <= 1e-6 * one.0.abs(), "{stage:?}: {two:?} vs {one:?}");
        assert!((two[0].1 - one.1).abs() <= 1e-5 * one.1, "{stage:?}: {two:?} vs {one:?}");
    }
}

/// ENG-3: the tracker holds exactly the stage's model state between steps (plus unit 0's
/// gather carried to the next pass, ENG-6), and saw the transient buffers of the step: the
/// activations, the gathered units and the unreduced gradients, the last within the reduce
/// budget and the unit being computed (ENG-7).
#[test]
fn eng3_every_buffer_is_counted_and_eng7_bounds_the_unreduced_gradients() {
    let model = small_mlp(3);
    for stage in Stage::ALL {
        let mut cfg = stage3_sgd(1, 2);
        cfg.stage = stage;
        let layout = ShardedModelLayout::new(&model.spec(), 2).unwrap();
        // One unit's worth: a reduction waits for the previous one.
        cfg.reduce_budget_bytes = layout.max_unit_padded_numel() as u64 * 4;
        let rules = StageRules::of(stage);
        let k = cfg.optimizer.state_len_per_param() as u64;
        let per_unit = |f: &dyn Fn(&crate::shard::FlatLayout) -> usize| -> u64 {
            layout.units().iter().map(|l| f(l) as u64 * 4).sum()
        };
        let params = per_unit(&|l| rules.params.len(l));
        let grads = per_unit(&|l| rules.grads.len(l));
        let state = per_unit(&|l| rules.optim_state.len(l)) * k;
        let gathered0 = layout.unit(0).padded_numel() as u64 * 4;
        let budget = cfg.reduce_budget_bytes;
        on_ranks(2, &model, &cfg, &Trace::disabled(), |r, e| {
            let (x, y) = slice(2, r);
            e.train_step(x, &lab(&y), 12).unwrap();
            let m = e.memory();
            let (pcat, other) = match rules.params {
                stage::Holding::Full => (Category::FullParams, Category::ShardParams),
                stage::Holding::Shard => (Category::ShardParams, Category::FullParams),
            };
            assert_eq!((m.current(pcat), m.current(other)), (params, 0), "{stage:?}");
            assert_eq!(m.current(Category::Grads), grads, "{stage:?}: the unreduced are freed");
            assert_eq!(m.current(Category::OptimizerState), state, "{stage:?}");
            assert_eq!(m.current(Category::Activations), 0, "{stage:?}");
            assert!(m.peak(Category::Activations) > 0, "{stage:?}: activations counted");
            let carried = if stage == Stage::Zero3 { gathered0 } else { 0 };
            assert_eq!(m.current(Category::GatheredUnits), carried, "{stage:?} (ENG-6)");
            assert_eq!(m.peak(Category::GatheredUnits) > 0, stage == Stage::Zero3);
            let unreduced = m.peak(Category::Grads) - grads;
            assert_eq!(unreduced > 0, rules.transient_grads(), "{stage:?}: {unreduced}");
            let unit = layout.max_unit_padded_numel() as u64 * 4;
            assert!(unreduced <= budget + unit, "{stage:?}: {unreduced} > {budget} + {unit}");
        });
    }
}

/// ENG-4: a step's communication time is the union of the spans of all its collectives,
/// SyncBN statistics reductions included, as the trace shows them.
#[test]
fn eng4_comm_time_is_the_union_of_every_collectives_span_stats_included() {
    let model = small_mlp(2);
    let mut cfg = stage3_sgd(1, 6);
    (cfg.stage, cfg.sync_bn) = (Stage::Zero0, true);
    let trace = Trace::new();
    let out = on_ranks(2, &model, &cfg, &trace, |r, e| {
        let (x, y) = slice(2, r);
        e.train_step(x, &lab(&y), 12).unwrap()
    });
    let evs = trace.events();
    for (r, s) in out.iter().enumerate() {
        assert_eq!(s.stats_messages, 4, "two BN layers, one message each way");
        let mut spans: Vec<(f64, f64)> = evs
            .iter()
            .filter(|e| e.rank == r && matches!(e.row, Row::Gather | Row::Reduce | Row::Stats))
            .map(|e| (e.start_us, e.start_us + e.dur_us))
            .collect();
        let stats_spans = evs.iter().filter(|e| e.rank == r && e.row == Row::Stats).count();
        assert_eq!(stats_spans, 4, "rank {r}: every statistics message on the stats row");
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (mut total, mut cur) = (0.0, None::<(f64, f64)>);
        for (a, b) in spans {
            match &mut cur {
                Some((_, e)) if a <= *e => *e = e.max(b),
                _ => {
                    total += cur.map_or(0.0, |(s, e)| e - s);
                    cur = Some((a, b));
                }
            }
        }
        total += cur.map_or(0.0, |(s, e)| e - s);
        let got = s.comm_time.as_secs_f64() * 1e6;
        assert!((got - total).abs() <= 2.0, "rank {r}: comm time {got} us, spans {total} us");
    }
}

/// A statistics reduction that fails reaches the caller of `train_step` typed: the rank,
/// the stats lane and the message, not a string.
#[test]
fn a_failed_statistics_reduction_reaches_the_caller_typed() {
    let model = small_mlp(1);
    let mut cfg = stage3_sgd(0, 1);
    (cfg.stage, cfg.sync_bn) = (Stage::Zero0, true);
    let errs = on_ranks(2, &model, &cfg, &Trace::disabled(), |r, e| {
        e.communicator().abort("test: the group is going down");
        let (x, y) = slice(2, r);
        e.train_step(x, &lab(&y), 12).unwrap_err()
    });
    for (r, e) in errs.into_iter().enumerate() {
        match e {
            RuntimeError::Stats(s) => {
                assert_eq!((s.rank, s.lane.as_str()), (r, STATS_LANE));
                assert_eq!(s.op, shardline_models::StatsOp::Forward);
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

/// ENG-1, ENG-9 on a residual model whose blocks start with convolutions (no deferred input
/// gradient) and fuse two SyncBN layers: stage 3 at every prefetch depth gives bitwise the
/// parameters of prefetch 0.
#[test]
fn eng1_prefetch_is_bitwise_invisible_on_a_residual_model() {
    let model =
        Arc::new(ConvNetBn { input: [1, 6, 6], widths: vec![3, 4], classes: 3 }.build().unwrap())
            as Arc<dyn Network>;
    let run = |prefetch: usize| {
        let mut cfg = stage3_sgd(prefetch, 9);
        cfg.sync_bn = true;
        on_ranks(2, &model, &cfg, &Trace::disabled(), |r, e| {
            let n = 3 + r;
            let x: Vec<f32> = (0..n * 36).map(|i| ((i * 13 + r) % 17) as f32 / 8.0 - 1.0).collect();
            let y: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
            for _ in 0..2 {
                e.train_step(Tensor::new(vec![n, 1, 6, 6], x.clone()).unwrap(), &lab(&y), 7)
                    .unwrap();
            }
            e.full_params().unwrap()
        })
    };
    let base = run(0);
    for k in [1, 2] {
        assert!(run(k) == base, "prefetch {k}");
    }
}

/// NET-1 through the engine: one SGD step of the `gpt` (its root unit used first and last)
/// at world 1 and at stage 3 over 2 ranks moves every parameter by `-lr x` the gradient of
/// the PyTorch-checked flat decoder (`GptConfig::loss_and_grads`), the tied embedding's
/// gradient summing both of its uses. The bound is 1e-6; `wte`'s own step is checked to be
/// above 1e-4, so a lost share of it of that order cannot pass.
#[test]
fn net1_gpt_step_equals_the_checked_decoder_at_any_world() {
    use shardline_models::nn::GptConfig;
    let g = GptConfig {
        vocab_size: 13,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        bias: true,
        layernorm_eps: 1e-5,
        dropout: 0.0,
    };
    let net: Arc<dyn Network> = Arc::new(shardline_models::module::gpt::gpt(&g).unwrap());
    let spec = net.spec();
    let tokens: Vec<Vec<u32>> =
        (0..4).map(|b| (0..6).map(|t| (b * 5 + t * 3) % 13).collect()).collect();
    let targets: Vec<Vec<u32>> =
        (0..4).map(|b| (0..6).map(|t| (b * 7 + t + 1) % 13).collect()).collect();
    // The flat decoder's buffer, by name, from the network's initial unit buffers.
    let init: Vec<Vec<f32>> =
        (0..spec.units.len()).map(|u| net.init_params(u, 5).unwrap()).collect();
    let at = |name: &str| {
        for (u, us) in spec.units.iter().enumerate() {
            let mut o = 0;
            for p in &us.params {
                if p.name == name {
                    return (u, o, p.numel());
                }
                o += p.numel();
            }
        }
        panic!("no parameter {name}")
    };
    let order = g.param_specs();
    let flat: Vec<f32> = order
        .iter()
        .flat_map(|s| {
            let (u, o, n) = at(&s.name);
            init[u][o..o + n].to_vec()
        })
        .collect();
    let (_, grads) = g
        .loss_and_grads::<f64, _>(
            &flat.iter().map(|&v| v as f64).collect::<Vec<_>>(),
            &tokens,
            &targets,
        )
        .unwrap();
    let lr = 0.1;
    let mut cfg = stage3_sgd(1, 5);
    cfg.lr = LrSchedule::constant(lr);
    for world in [1usize, 2] {
        let full = on_ranks(world, &net, &cfg, &Trace::disabled(), |r, e| {
            let rows = DistributedSampler::slice_range(4, world, r);
            let x: Vec<u32> = tokens[rows.clone()].concat();
            let y: Vec<u32> = targets[rows.clone()].concat();
            let x = Tensor::from_u32(vec![rows.len(), 6], x).unwrap();
            let y = Tensor::from_u32(vec![rows.len(), 6], y).unwrap();
            e.train_step(x, &y, 4).unwrap();
            e.full_params().unwrap()
        })
        .swap_remove(0);
        let mut k = 0;
        for s in &order {
            let (u, o, n) = at(&s.name);
            let err = (0..n)
                .map(|i| {
                    let want = flat[k + i] as f64 - lr as f64 * grads[k + i];
                    (full[u][o + i] as f64 - want).abs()
                })
                .fold(0.0, f64::max);
            assert!(err < 1e-6, "world {world}: {} is off by {err:e}", s.name);
            k += n;
        }
    }
    let (wte_u, wte_o, wte_n) = at("transformer.wte.weight");
    assert_eq!((wte_u, wte_o), (0, 0));
    let head_share = grads[..wte_n].iter().map(|v| v.abs()).fold(0.0, f64::max) * lr as f64;
    assert!(head_share > 1e-4, "wte's gradient is large enough to see: {head_share:e}");
}

/// QGATHER-2: with int8 gathers at stage 3 each unit's own shard is packed once per step
/// (its forward and backward gathers share the packed slot) and again only after its
/// update; with prefetch, unit 0's gather for the next step packs the updated shard at the
/// end of the step it was updated in.
#[test]
fn qgather_2_each_shard_is_packed_once_per_step() {
    let model = small_mlp(3);
    let n = model.spec().units.len() as u64;
    for prefetch in [0, 1] {
        let mut cfg = stage3_sgd(prefetch, 5);
        // No unit kept between its uses (ENG-5): backward gathers every unit again.
        cfg.prefetch_budget_bytes = 1;
        let q = QuantGather { dtype: GatherDtype::Int8, block: 16 };
        cfg.precision = MixedPrecision::default().with_gather(Some(q));
        let packs = on_ranks(2, &model, &cfg, &Trace::disabled(), |r, e| {
            (0..3)
                .map(|_| {
                    let before = e.own_packed.packs();
                    let (x, y) = slice(2, r);
                    e.train_step(x, &lab(&y), 12).unwrap();
                    e.own_packed.packs() - before
                })
                .collect::<Vec<u64>>()
        });
        let carry = u64::from(prefetch > 0);
        for p in packs {
            assert_eq!(p, vec![n + carry, n, n], "prefetch {prefetch}: packs per step");
        }
    }
}

/// LIVE-3: a state taken out of an engine mid-run and installed into a fresh one steps on
/// bitwise like the engine it came from (AdamW, so that the optimizer state matters; a
/// BatchNorm model, so that the buffers do). LIVE-8: a sharded state of other shapes is
/// refused; a stage-0 state padded for another world is re-padded.
#[test]
fn an_installed_live_state_steps_on_like_its_source_live_3_8() {
    let comm = shardline_collectives::local_group(1).unwrap().pop().unwrap();
    let mut m = shardline_models::zoo::MlpBn::digits();
    (m.input_dim, m.hidden, m.depth, m.classes) = (8, 8, 2, 3);
    let model: Arc<dyn Network> = Arc::new(m.build());
    let mut cfg = stage3_sgd(1, 5);
    cfg.optimizer = Optimizer::AdamW(crate::optim::AdamWConfig::default());
    let engine = |cfg: &EngineConfig| {
        let mem = MemoryTracker::new(0, None);
        let mut e =
            RankEngine::new(comm.clone(), Arc::clone(&model), cfg.clone(), mem, Trace::disabled())
                .unwrap();
        e.set_commit_after_sums(true);
        e
    };
    let batch = |k: usize| {
        let x = (0..32).map(|i| ((i * 7 + k * 3) % 11) as f32 / 11.0).collect();
        (Tensor::new(vec![4, 8], x).unwrap(), lab(&[0, 1, 2, (k % 3) as u32]))
    };
    let mut a = engine(&cfg);
    for k in 0..3 {
        let (x, y) = batch(k);
        a.train_step(x, &y, 4).unwrap();
    }
    let kept = a.live_state();
    assert!(kept.clean && kept.step == 3);
    assert!(kept.optim_state.iter().any(|s| s.iter().any(|v| *v != 0.0)));
    let mut b = engine(&cfg);
    b.install_live_state(&kept).unwrap();
    assert_eq!(b.live_state(), kept);
    for k in 3..5 {
        let (x, y) = batch(k);
        let sa = a.train_step(x.clone(), &y, 4).unwrap();
        let sb = b.train_step(x, &y, 4).unwrap();
        assert_eq!(sa.loss.to_bits(), sb.loss.to_bits(), "step {}", k + 1);
    }
    let (ka, kb) = (a.live_state(), b.live_state());
    let bits = |s: &crate::engine::live::LiveState| -> Vec<u32> {
        s.params
            .iter()
            .chain(&s.optim_state)
            .chain(&s.buffers)
            .flatten()
            .map(|v| v.to_bits())
            .collect()
    };
    assert_eq!(bits(&ka), bits(&kb));
    assert_eq!(ka.step, 5);
    // LIVE-8: a sharded state of other shapes is refused as a recovery that cannot be made
    // live (the job then falls back to its checkpoint) ...
    let mut wrong = kept.clone();
    wrong.params[0].push(0.0);
    let e = engine(&cfg).install_live_state(&wrong).unwrap_err();
    assert!(matches!(e, RuntimeError::LiveRecoveryImpossible(_)), "{e}");
    // ... while a stage-0 state padded for another world is re-padded, values unchanged.
    cfg.stage = Stage::Zero0;
    let mut a = engine(&cfg);
    let (x, y) = batch(7);
    a.train_step(x, &y, 4).unwrap();
    let kept = a.live_state();
    let mut wider = kept.clone();
    for v in wider.params.iter_mut().chain(wider.optim_state.iter_mut()) {
        v.extend([0.0; 5]);
    }
    let mut b = engine(&cfg);
    b.install_live_state(&wider).unwrap();
    assert_eq!(b.live_state(), kept);
}
