//! What the one training loop ([`crate::driver`]) asks of a rank's engine: a step, an
//! evaluation, its checkpoint shard, a load, the full parameters, an abort. The host engine
//! ([`RankEngine`]) and the device engine ([`DeviceEngine`]) both answer it, so that resume,
//! checkpoints, evaluation, interruption, logs and the summary exist once for both.

use shardline_models::meter::Installed;
use shardline_models::{Dataset, Tensor};

use super::on_device::DeviceEngine;
use super::{EngineConfig, RankEngine, StepStats};
use crate::checkpoint::RankShard;
use crate::error::Result;

/// A rank's engine as the driver's actors drive it.
pub trait Driven: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Optimizer steps taken.
    fn steps_done(&self) -> u64;
    /// The configuration.
    fn config(&self) -> &EngineConfig;
    /// Registers the host tensors made on this thread (a step's data slice) with the rank's
    /// tracker while the guard lives, for an engine that computes on the host.
    fn data_meter(&self) -> Option<Installed>;
    /// Asks every rank to stop after this step or the next (INT-1).
    fn request_stop(&mut self);
    /// One training step on this rank's slice of a global batch of `global_batch` samples.
    fn train_step(&mut self, x: Tensor, y: &Tensor, global_batch: usize) -> Result<StepStats>;
    /// The global (correct, count, mean loss) over `test`, in forwards of at most `batch`
    /// samples per rank (collective).
    fn eval_set(&mut self, test: &Dataset, batch: usize) -> Result<(u64, u64, f32)>;
    /// This rank's checkpoint content.
    fn shard_state(&mut self) -> Result<RankShard>;
    /// Replaces the rank's state with a checkpoint's, which stands after `step`.
    fn load_state(&mut self, shard: &RankShard, buffers: &[Vec<f32>], step: u64) -> Result<()>;
    /// Every unit's full parameters, unpadded (collective).
    fn full_params(&mut self) -> Result<Vec<Vec<f32>>>;
    /// The replicated buffers (BatchNorm running statistics), per unit.
    fn buffers(&mut self) -> Result<Vec<Vec<f32>>>;
    /// Ends the rank's collectives in flight, so that no rank waits for a failed one.
    fn abort(&self, why: &str);
    /// Frees what the engine holds at the end of the job.
    fn shutdown(&mut self);
    /// A copy of what the rank keeps between steps, for live recovery (LIVE-1).
    fn live_state(&self) -> Result<super::live::LiveState> {
        Err(crate::error::RuntimeError::config("live recovery needs the host engine"))
    }
}

impl Driven for RankEngine {
    fn rank(&self) -> usize {
        RankEngine::rank(self)
    }
    fn steps_done(&self) -> u64 {
        RankEngine::steps_done(self)
    }
    fn config(&self) -> &EngineConfig {
        RankEngine::config(self)
    }
    fn data_meter(&self) -> Option<Installed> {
        Some(self.install_meter())
    }
    fn request_stop(&mut self) {
        RankEngine::request_stop(self)
    }
    fn train_step(&mut self, x: Tensor, y: &Tensor, global_batch: usize) -> Result<StepStats> {
        RankEngine::train_step(self, x, y, global_batch)
    }
    fn eval_set(&mut self, test: &Dataset, batch: usize) -> Result<(u64, u64, f32)> {
        RankEngine::eval_set(self, test, batch)
    }
    fn shard_state(&mut self) -> Result<RankShard> {
        Ok(RankEngine::shard_state(self))
    }
    fn load_state(&mut self, shard: &RankShard, buffers: &[Vec<f32>], step: u64) -> Result<()> {
        RankEngine::load_state(self, shard, buffers, step)
    }
    fn full_params(&mut self) -> Result<Vec<Vec<f32>>> {
        RankEngine::full_params(self)
    }
    fn buffers(&mut self) -> Result<Vec<Vec<f32>>> {
        Ok(RankEngine::buffers(self).to_vec())
    }
    fn abort(&self, why: &str) {
        self.communicator().abort(why)
    }
    fn shutdown(&mut self) {
        RankEngine::shutdown(self)
    }
    fn live_state(&self) -> Result<super::live::LiveState> {
        Ok(RankEngine::live_state(self))
    }
}

impl Driven for DeviceEngine {
    fn rank(&self) -> usize {
        DeviceEngine::rank(self)
    }
    fn steps_done(&self) -> u64 {
        DeviceEngine::steps_done(self)
    }
    fn config(&self) -> &EngineConfig {
        DeviceEngine::config(self)
    }
    fn data_meter(&self) -> Option<Installed> {
        // The slice is host data the engine uploads; the device's memory is its accountant's.
        None
    }
    fn request_stop(&mut self) {
        DeviceEngine::request_stop(self)
    }
    fn train_step(&mut self, x: Tensor, y: &Tensor, global_batch: usize) -> Result<StepStats> {
        self.driven_step(x, y, global_batch)
    }
    fn eval_set(&mut self, test: &Dataset, batch: usize) -> Result<(u64, u64, f32)> {
        DeviceEngine::eval_set(self, test, batch)
    }
    fn shard_state(&mut self) -> Result<RankShard> {
        DeviceEngine::shard_state(self)
    }
    fn load_state(&mut self, shard: &RankShard, buffers: &[Vec<f32>], step: u64) -> Result<()> {
        DeviceEngine::load_state(self, shard, buffers, step)
    }
    fn full_params(&mut self) -> Result<Vec<Vec<f32>>> {
        DeviceEngine::full_params(self)
    }
    fn buffers(&mut self) -> Result<Vec<Vec<f32>>> {
        DeviceEngine::buffers(self)
    }
    fn abort(&self, why: &str) {
        DeviceEngine::abort(self, why)
    }
    fn shutdown(&mut self) {
        DeviceEngine::shutdown(self)
    }
}
