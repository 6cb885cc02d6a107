//! Training the model through Shardline's runtime: the bundled text corpus, a
//! [`TrainConfig`] naming the stage and world, and [`train::run_network`], which runs every
//! rank as threads of this process with the same engine as `shardline train`.

use crate::{model, ModelConfig};
use shardline_models::text::{Split, TextCorpus};
use shardline_models::Dataset;
use shardline_runtime::train::{self, RunOptions, StageChoice, Summary, TrainConfig};
use shardline_runtime::Stage;
use std::sync::Arc;

/// What a run trains and how.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// The model's sizes.
    pub model: ModelConfig,
    /// ZeRO stage, 0 to 3.
    pub stage: u8,
    /// Ranks.
    pub world: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Global batch, in windows of `model.block` tokens.
    pub batch: usize,
    /// AdamW's learning rate.
    pub lr: f32,
    /// Seed of the initial parameters and of the windows drawn.
    pub seed: u64,
}

impl Default for Job {
    fn default() -> Self {
        Job {
            model: ModelConfig::small(),
            stage: 3,
            world: 2,
            steps: 5,
            batch: 8,
            lr: 3e-3,
            seed: 0,
        }
    }
}

impl Job {
    /// The runtime's configuration of this job; the fields not set here keep
    /// `TrainConfig`'s defaults.
    pub fn train_config(&self) -> anyhow::Result<TrainConfig> {
        Ok(TrainConfig {
            world: self.world,
            stage: StageChoice::Fixed(Stage::from_index(self.stage)?),
            model: "custom-model".into(),
            dataset: "text".into(),
            steps: Some(self.steps),
            batch_size: self.batch,
            lr: self.lr,
            optimizer: "adamw".into(),
            cosine: false,
            seed: self.seed,
            ..TrainConfig::default()
        })
    }

    /// Training and held-out windows of the bundled corpus: as many training windows as
    /// the steps read, and a few held-out ones for the summary's test loss.
    pub fn data(&self) -> anyhow::Result<(Dataset, Dataset)> {
        let corpus = TextCorpus::bundled();
        let block = self.model.block;
        let n = self.batch * self.steps as usize;
        let train = Dataset::from_text(&corpus, Split::Train, block, n, self.seed)?;
        let test =
            Dataset::from_text(&corpus, Split::Validation, block, 4 * self.batch, self.seed)?;
        Ok((train, test))
    }

    /// Trains the model; the summary holds each step's loss.
    pub fn run(&self) -> anyhow::Result<Summary> {
        let net = model(&self.model)?;
        let (train, test) = self.data()?;
        let opts = RunOptions { quiet: true, ..RunOptions::default() };
        Ok(train::run_network(self.train_config()?, Arc::new(net), train, test, opts)?)
    }
}
