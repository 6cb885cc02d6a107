//! `shardline-bench quant-error`: what a quantized gather (`--gather-dtype int8|fp8`,
//! QGATHER-1) does to each parameter tensor of `gpt`, at initialisation and after training
//! in `f32`. Each unit goes through the engine's own gather round trip for the world size
//! (`gather_round_trip`: each rank's shard in blocks restarting at every tensor); the
//! errors are then read per tensor: the relative L2 error `|x - q(x)| / |x|` and the largest
//! absolute error against the tensor's largest magnitude.

use crate::report;
use serde::Serialize;
use shardline_runtime::engine::{gather_round_trip, GatherDtype, QuantGather};
use shardline_runtime::shard::ShardedModelLayout;
use shardline_runtime::train::{self, RunOptions, TrainConfig};
use std::path::PathBuf;

/// Flags of `shardline-bench quant-error`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Steps of f32 training (world 1) before the second measurement.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// The world size whose shards the blocks follow.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Values per scale.
    #[arg(long, default_value_t = 256)]
    pub block: usize,
    /// Write the rows as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One tensor's errors under one code.
#[derive(Serialize, Debug)]
struct Row {
    when: &'static str,
    tensor: String,
    numel: usize,
    code: &'static str,
    rel_l2: f64,
    max_abs_over_amax: f64,
}

/// The `gpt` of `bench/quantized-gather.sh`, f32, one rank.
fn config(steps: u64) -> TrainConfig {
    TrainConfig {
        model: "gpt".into(),
        dataset: "text".into(),
        n_layer: Some(4),
        n_head: Some(4),
        n_embd: Some(128),
        block_size: Some(64),
        batch_size: 16,
        optimizer: "adamw".into(),
        lr: 1e-3,
        steps: Some(steps),
        seed: 1,
        ..TrainConfig::default()
    }
}

/// Every unit's values as the world's gathers decode them (the engine's own code).
fn decoded(
    layout: &ShardedModelLayout,
    units: &[Vec<f32>],
    dtype: GatherDtype,
    block: usize,
) -> anyhow::Result<Vec<Vec<f32>>> {
    units
        .iter()
        .enumerate()
        .map(|(u, v)| {
            let l = layout.unit(u);
            let mut full = vec![0.0f32; l.padded_numel()];
            full[..v.len()].copy_from_slice(v);
            gather_round_trip(l, layout.world(), QuantGather { dtype, block }, &mut full)?;
            full.truncate(v.len());
            Ok(full)
        })
        .collect()
}

fn rows(
    when: &'static str,
    layout: &ShardedModelLayout,
    units: &[Vec<f32>],
    block: usize,
) -> anyhow::Result<Vec<Row>> {
    let mut out = Vec::new();
    for code in [GatherDtype::Int8, GatherDtype::Fp8] {
        let dec = decoded(layout, units, code, block)?;
        for (u, (x, y)) in units.iter().zip(&dec).enumerate() {
            for p in layout.unit(u).params() {
                let (xs, ys) = (&x[p.range()], &y[p.range()]);
                let (mut d2, mut n2, mut dmax, mut amax) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
                for (&a, &b) in xs.iter().zip(ys) {
                    let d = f64::from(a) - f64::from(b);
                    d2 += d * d;
                    n2 += f64::from(a) * f64::from(a);
                    dmax = dmax.max(d.abs());
                    amax = amax.max(f64::from(a).abs());
                }
                out.push(Row {
                    when,
                    tensor: p.name.clone(),
                    numel: p.numel,
                    code: code.name(),
                    rel_l2: if n2 > 0.0 { (d2 / n2).sqrt() } else { 0.0 },
                    max_abs_over_amax: if amax > 0.0 { dmax / amax } else { 0.0 },
                });
            }
        }
    }
    Ok(out)
}

pub fn run(a: Args) -> anyhow::Result<()> {
    report::check_flags(a.world >= 1 && a.block >= 1, || {
        "--world and --block must be at least 1".to_string()
    })?;
    let cfg = config(a.steps);
    let model = train::plan(&cfg)?.model;
    let layout = ShardedModelLayout::new(&model.spec(), a.world)?;
    let init: Vec<Vec<f32>> = (0..layout.units().len())
        .map(|u| model.init_params(u, cfg.seed))
        .collect::<Result<_, _>>()?;
    let s = train::run(cfg, RunOptions { quiet: true, ..RunOptions::default() })?;
    let mut all = rows("init", &layout, &init, a.block)?;
    all.extend(rows("trained", &layout, &s.final_params, a.block)?);
    println!(
        "gpt (4 layers, embd 128), blocks of {} from each of {} shards; trained: {} f32 steps",
        a.block, a.world, a.steps
    );
    println!("when | tensor | numel | code | relative L2 error | max abs error / max |x|");
    println!("---|---|---|---|---|---");
    for r in &all {
        println!(
            "{} | {} | {} | {} | {:.2e} | {:.2e}",
            r.when, r.tensor, r.numel, r.code, r.rel_l2, r.max_abs_over_amax
        );
    }
    if let Some(p) = &a.json {
        report::write_json(p, &all)?;
    }
    Ok(())
}
