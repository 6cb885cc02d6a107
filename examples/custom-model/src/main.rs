//! Trains the example's own model with Shardline: `cargo run --release -p custom-model --
//! --stage 3 --world 2 --steps 5`.

use clap::Parser;
use custom_model::job::Job;
use shardline_models::Network;

/// Train a pre-norm transformer with a SiLU-gated MLP, defined outside Shardline, on the
/// bundled text corpus.
#[derive(Parser, Debug)]
struct Args {
    /// ZeRO stage (0-3).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(0..=3))]
    stage: u8,
    /// Ranks (threads of this process).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    world: u64,
    /// Optimizer steps.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let job = Job { stage: a.stage, world: a.world as usize, steps: a.steps, ..Job::default() };
    let spec = custom_model::model(&job.model)?.spec();
    println!(
        "custom-model: {} parameters in {} units, stage {}, world {}, {} steps",
        spec.numel(),
        spec.units.len(),
        job.stage,
        job.world,
        job.steps
    );
    let s = job.run()?;
    for (i, loss) in s.losses.iter().enumerate() {
        println!("step {}: loss {loss:.4}", i + 1);
    }
    println!("test loss {:.4}", s.test_loss);
    Ok(())
}
