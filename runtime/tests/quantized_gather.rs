//! Quantized parameter gathers (`--gather-dtype int8|fp8`, QGATHER-1, QUANT-1..4): each
//! rank sends its shard as 8-bit codes with one scale per block, about a quarter of the
//! `f32` bytes, measured by the lanes' counters; every stage at one world size computes with
//! the same dequantized values; the loss stays close to `f32`'s and the masters stay `f32`.

mod common;
use common::*;
use shardline_collectives::quant;
use shardline_runtime::engine::GatherDtype::{self, Fp8, Int8};
use shardline_runtime::shard::ShardedModelLayout;
use shardline_runtime::train::{build_model, load_data, Summary, TrainConfig};

/// A small mlp-bn run, prefetch 0 so that every gather of a step runs within it.
fn cfg(world: usize, stage: u8, gather: Option<GatherDtype>) -> TrainConfig {
    let mut c = small_cfg(world, stage, 6, 60);
    c.prefetch = 0;
    c.gather_dtype = gather;
    c.gather_block = 64;
    c
}

/// Per unit at `world`: its shard length, and the words of its quantized slot: the most any
/// rank's shard needs with blocks restarting at each tensor (and the padding) it holds.
fn shards(c: &TrainConfig) -> Vec<(usize, usize)> {
    let (train, _) = load_data(c, false).unwrap();
    let m = build_model(c, &train.sample_shape, train.classes).unwrap();
    let l = ShardedModelLayout::new(&m.spec(), c.world).unwrap();
    let slot_words = |u: &shardline_runtime::shard::FlatLayout| {
        (0..c.world)
            .map(|r| {
                let shard = u.shard_range(r);
                // Each tensor's (and the padding's) overlap with the shard.
                let mut pieces: Vec<std::ops::Range<usize>> =
                    u.params().iter().map(|p| p.range()).collect();
                pieces.push(u.numel()..u.padded_numel());
                let cuts: Vec<usize> = pieces
                    .iter()
                    .map(|p| p.end.min(shard.end).saturating_sub(p.start.max(shard.start)))
                    .filter(|&n| n > 0)
                    .collect();
                quant::words_cut(&cuts, c.gather_block)
            })
            .max()
            .unwrap()
    };
    l.units().iter().map(|u| (u.shard_len(), slot_words(u))).collect()
}

/// The counts `n` in `{1, 2}` per unit (a unit is gathered once or twice a step: stage 3
/// regathers for backward the units it did not keep) with `sum n_u * words_u == total`,
/// when exactly one fits.
fn gathers_per_unit(words: &[usize], total: usize) -> Option<Vec<usize>> {
    let fits: Vec<Vec<usize>> = (0..1usize << words.len())
        .map(|m| (0..words.len()).map(|u| 1 + (m >> u & 1)).collect::<Vec<_>>())
        .filter(|n| n.iter().zip(words).map(|(n, w)| n * w).sum::<usize>() == total)
        .collect();
    (fits.len() == 1).then(|| fits[0].clone())
}

/// QGATHER-1, QUANT-1 (LANE-8's counters): at stages 1-3, world 2, every gather carries
/// its quantized slot's words per rank instead of `shard`: with the gathers per unit that
/// the `f32` run's bytes give, the quantized run's bytes are exactly the quantized words,
/// and the gradient reductions are untouched.
#[test]
fn qgather_1_gathers_carry_the_quantized_words() {
    let bytes = |s: &Summary| -> Vec<(u64, u64)> {
        s.step_stats.iter().map(|st| (st.gather_bytes, st.reduce_bytes)).collect()
    };
    for stage in 1..4u8 {
        let base = cfg(2, stage, None);
        let (sh, q_words): (Vec<usize>, Vec<usize>) = shards(&base).into_iter().unzip();
        let f = bytes(&run_ok(base, quiet()));
        for dtype in [Int8, Fp8] {
            let q = bytes(&run_ok(cfg(2, stage, Some(dtype)), quiet()));
            for (step, (a, b)) in f.iter().zip(&q).enumerate() {
                let what = format!("{dtype:?} stage {stage} step {}: f32 {a:?}, {b:?}", step + 1);
                let n = gathers_per_unit(&sh, a.0 as usize / 4).expect(&what);
                assert_eq!(n.iter().all(|&k| k == 1), stage < 3, "{what}: {n:?}");
                let want: usize = n.iter().zip(&q_words).map(|(n, w)| n * w * 4).sum();
                assert_eq!(b.0 as usize, want, "{what}: gathers per unit {n:?}");
                assert_eq!(b.1, a.1, "{what}: reductions unchanged");
            }
            eprintln!(
                "{dtype:?} stage {stage}: gather bytes {:.3} of f32",
                q[0].0 as f64 / f[0].0 as f64
            );
        }
    }
}

/// Tolerances between stages at world 2 with quantized gathers: only the f32 reductions'
/// order differs (as between stages in `f32`), since every stage computes with each rank's
/// range dequantized from the same masters (QUANT-4 for the ranges that hold decoded
/// values). A stage that used a master where another used its dequantized value would
/// differ by the quantization step, ~1e-3 relative.
const LOSS_REL: f32 = 1e-6;
const PARAM_ABS: f32 = 4e-7;

/// QGATHER-1: at world 2 and at world 3, stages 0-3 with int8 or fp8 gathers train alike.
#[test]
fn qgather_1_every_stage_computes_with_the_same_values() {
    for (world, dtype) in [(2, Int8), (3, Fp8)] {
        let reference = run_ok(cfg(world, 3, Some(dtype)), quiet());
        let (first, last) = (reference.losses[0], reference.losses[5]);
        assert!(last < 0.9 * first, "{dtype:?} trains: {first} -> {last}");
        for stage in 0..3u8 {
            let s = run_ok(cfg(world, stage, Some(dtype)), quiet());
            let what = format!("{dtype:?} world {world} stage {stage} against stage 3");
            let lrel = max_rel(&s.losses, &reference.losses);
            let pd = max_abs_diff(&s.final_params, &reference.final_params);
            eprintln!("{what}: loss rel {lrel:e}, params abs {pd:e}");
            assert!(lrel <= LOSS_REL, "{what}: loss differs by {lrel:e}");
            assert!(pd <= PARAM_ABS, "{what}: params differ by {pd:e}");
        }
    }
}

/// Quantized gathers track f32 within their step size (6 steps, world 2, stage 3) and
/// differ from it by more than f32 rounding (the policy is in effect); the final
/// parameters are the f32 masters, not their dequantized copies.
#[test]
fn quantized_gathers_track_f32_and_keep_f32_masters() {
    let f32_run = run_ok(cfg(2, 3, None), quiet());
    for (dtype, tol) in [(Int8, 1e-2f32), (Fp8, 5e-2)] {
        let s = run_ok(cfg(2, 3, Some(dtype)), quiet());
        let lrel = max_rel(&s.losses, &f32_run.losses);
        eprintln!("{dtype:?} world 2 stage 3 against f32: loss rel {lrel:e}");
        assert!(lrel <= tol, "{dtype:?} drifts from f32 by {lrel:e}");
        assert!(lrel > 1e-5, "{dtype:?} equals f32 to {lrel:e}: the policy did nothing");
        let pd = max_abs_diff(&s.final_params, &f32_run.final_params);
        assert!(pd > 0.0, "{dtype:?}: the masters moved differently");
    }
}

/// Bad input exits 2 naming the flag.
#[test]
fn bad_gather_flags_exit_2_naming_them() {
    for (args, flag) in [
        (vec!["--gather-dtype", "int4"], "--gather-dtype"),
        (vec!["--gather-dtype", "int8", "--param-dtype", "bf16"], "--gather-dtype"),
        (vec!["--gather-dtype", "int8", "--gather-block", "0"], "--gather-block"),
    ] {
        let mut a = vec!["train", "--steps", "1", "--no-progress"];
        a.extend(args);
        let o = shardline(&a);
        assert_eq!(o.code, Some(2), "{a:?}: {}", o.stderr);
        assert!(o.stderr.contains(flag), "{a:?}: {}", o.stderr);
    }
}
