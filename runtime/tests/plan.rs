//! `shardline plan`'s memory prediction against what the engine's tracker measures, over a
//! grid of small jobs run here (PLAN-5): models mlp-bn and gpt, worlds 1-4 as threads,
//! stages 0-3, prefetch 0-2 at stage 3.

use shardline_runtime::memory::Category;
use shardline_runtime::plan::{predict, Placement};
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{self, RunOptions, StageChoice, TrainConfig};

fn job(model: &str, world: usize, stage: Stage, prefetch: usize) -> TrainConfig {
    let mut c = TrainConfig {
        world,
        stage: StageChoice::Fixed(stage),
        model: model.into(),
        steps: Some(2),
        batch_size: 24,
        prefetch,
        ..TrainConfig::default()
    };
    if model == "gpt" {
        c.dataset = "text".into();
        c.n_layer = Some(2);
        c.n_head = Some(2);
        c.n_embd = Some(32);
        c.block_size = Some(16);
        c.optimizer = "adamw".into();
        c.lr = 1e-3;
    }
    c
}

/// The categories whose peak is decided by the layout and the stage's rules alone.
const EXACT: [Category; 3] =
    [Category::FullParams, Category::ShardParams, Category::OptimizerState];

/// PLAN-5: every job's predicted parameters and optimizer state, and its gradients where the
/// stage keeps them whole (stages 0 and 1), are the peaks rank 0's tracker measured. Where
/// the gradients in flight and the gathered units peak depends on when reductions complete
/// and which pooled buffer a unit gets (the pool hands out a larger buffer of a nearby size
/// class, POOL-1), the prediction is the schedule's floor (every buffer its exact size, every
/// reduction done as early as it can be): never above the measured peak. The errors of
/// these and of the activations are printed.
#[test]
fn predicted_state_memory_is_what_the_engine_measures_plan_5() {
    let mut jobs = Vec::new();
    for model in ["mlp-bn", "gpt"] {
        for world in 1..=4 {
            for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
                jobs.push(job(model, world, stage, 1));
            }
            for prefetch in 0..=2 {
                jobs.push(job(model, world, Stage::Zero3, prefetch));
            }
        }
    }
    let mut misses = Vec::new();
    println!("model   world stage prefetch  grads (pred/meas err)  gathered (pred/meas err)  activations (pred/meas err)");
    for cfg in jobs {
        let at = Placement { nodes: 1, ranks_per_node: cfg.world, transport: "local".into() };
        let p = predict(&cfg, &at, None).unwrap();
        let opts = RunOptions { quiet: true, skip_final_params: true, ..RunOptions::default() };
        let s = train::run(cfg.clone(), opts).unwrap();
        let measured = |c: Category| {
            s.peak_by_category[0].iter().find(|(k, _)| k == c.key()).map_or(0, |(_, b)| *b)
        };
        let whole_grads = p.stage <= 1;
        let name = format!(
            "{} world {} stage {} prefetch {}",
            cfg.model, cfg.world, p.stage, cfg.prefetch
        );
        for c in EXACT.into_iter().chain(whole_grads.then_some(Category::Grads)) {
            if p.bytes(c) != measured(c) {
                misses.push(format!(
                    "{name}: {} predicted {} measured {}",
                    c.key(),
                    p.bytes(c),
                    measured(c)
                ));
            }
        }
        for c in [Category::Grads, Category::GatheredUnits] {
            if p.bytes(c) > measured(c) {
                misses.push(format!(
                    "{name}: {} predicted {} above measured {}",
                    c.key(),
                    p.bytes(c),
                    measured(c)
                ));
            }
        }
        let e = |c: Category| {
            let (a, b) = (p.bytes(c), measured(c));
            format!("{a}/{b} {:+.1}%", (a as f64 - b as f64) / b.max(1) as f64 * 100.0)
        };
        println!(
            "{:<7} {:>5} {:>5} {:>8}  {:>22}  {:>24}  {:>26}",
            cfg.model,
            cfg.world,
            p.stage,
            cfg.prefetch,
            e(Category::Grads),
            e(Category::GatheredUnits),
            e(Category::Activations)
        );
    }
    assert!(misses.is_empty(), "{} misses:\n{}", misses.len(), misses.join("\n"));
}
