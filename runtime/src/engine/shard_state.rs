//! A rank's shard state: per unit, the parameters, gradients and optimizer state it keeps
//! (full or its own shard, as the stage's rules say), and the replicated BatchNorm buffers.
//! Built from the seed (the same on every rank), written to a checkpoint shard, restored
//! from one (all-gathering the slices where the stage keeps full copies), and gathered whole
//! for export.

use super::stage::{Holding, StageRules};
use super::{EngineConfig, RankEngine};
use crate::checkpoint::{RankShard, UnitShard};
use crate::error::{Result, RuntimeError};
use crate::memory::{Allocation, Category, MemoryTracker};
use crate::shard::{ShardedModelLayout, Stage};
use shardline_models::Network;

/// Bytes `rank` holds between steps (parameters, gradients, optimizer state of every unit, as
/// the stage's rules say), and what building the largest unit adds for a moment: its initial
/// values and their padded copy, which becomes the parameters where the rank keeps them whole
/// and is cut to the rank's shard where it does not.
fn persistent_bytes(layout: &ShardedModelLayout, rules: &StageRules, k: usize) -> (u64, u64) {
    let units = layout.units();
    let kept: usize = units
        .iter()
        .map(|l| rules.params.len(l) + rules.grads.len(l) + rules.optim_state.len(l) * k)
        .sum();
    let copies = if rules.params == Holding::Full { 1 } else { 2 };
    let init = units.iter().map(|l| copies * l.padded_numel()).max().unwrap_or(0);
    (kept as u64 * 4, init as u64 * 4)
}

/// Refuses, before allocating, `ranks` ranks (all in this process, built at once) whose
/// state is larger than the memory this process may use (`host`), which would otherwise abort
/// the process on the allocation or get it killed later; `who` names them in the error,
/// which says what would fit.
pub(crate) fn check_fits_host(
    layout: &ShardedModelLayout,
    stage: Stage,
    k: usize,
    (ranks, who): (usize, &str),
    host: Option<u64>,
) -> Result<()> {
    let (kept, init) = persistent_bytes(layout, StageRules::of(stage), k);
    let (kept, init) = (kept * ranks as u64, init * ranks as u64);
    let Some(host) = host.filter(|&h| kept + init > h) else { return Ok(()) };
    let fmt = crate::memory::format_bytes;
    let stage_hint = if stage == Stage::Zero3 { "" } else { "a higher --stage, " };
    Err(RuntimeError::config(format!(
        "{who} would hold {} ({} of parameters, gradients and optimizer state, and {} while \
         the largest unit is initialised whole) for {} parameters, more than the {} of memory \
         this process may use (the host's, or its control group's limit): use {stage_hint}\
         ranks on more hosts (`shardline launch`), or a smaller model (`shardline plan` \
         predicts the memory per rank)",
        fmt(kept + init),
        fmt(kept),
        fmt(init),
        layout.units().iter().map(|l| l.numel()).sum::<usize>(),
        fmt(host)
    )))
}

/// What a rank keeps of every unit between steps.
pub(crate) struct ShardState {
    /// Stage 0-2: full padded flat parameters per unit; stage 3: this rank's shard.
    pub(crate) params: Vec<Vec<f32>>,
    /// Stage 0/1: full padded gradients; stage 2/3: this rank's shard.
    pub(crate) grads: Vec<Vec<f32>>,
    /// Optimizer state: full (stage 0) or shard (1-3), `k` values per element.
    pub(crate) optim_state: Vec<Vec<f32>>,
    /// Replicated BatchNorm buffers per unit.
    pub(crate) buffers: Vec<Vec<f32>>,
    /// The tracker's record of the three per-unit buffers above (ENG-3).
    persistent: Vec<Allocation>,
}

impl ShardState {
    /// The initial state of `rank`: parameters from the configuration's seed, kept as the
    /// stage's rules say, zero gradients and optimizer state, initial buffers; every buffer
    /// registered with `mem` under its unit's label (ENG-3).
    pub(crate) fn init(
        model: &dyn Network,
        layout: &ShardedModelLayout,
        cfg: &EngineConfig,
        rank: usize,
        mem: &MemoryTracker,
        labels: &[String],
    ) -> Result<Self> {
        let rules = StageRules::of(cfg.stage);
        let (k, seed) = (cfg.optimizer.state_len_per_param(), cfg.seed);
        let n = layout.units().len();
        let who = format!("rank {rank}");
        check_fits_host(layout, cfg.stage, k, (1, &who), crate::memory::host_memory_bytes())?;
        let mut st = ShardState {
            params: Vec::with_capacity(n),
            grads: Vec::with_capacity(n),
            optim_state: Vec::with_capacity(n),
            buffers: Vec::with_capacity(n),
            persistent: Vec::with_capacity(3 * n),
        };
        for (u, name) in labels.iter().enumerate().take(n) {
            let l = layout.unit(u);
            let init = model.init_params(u, seed)?;
            let mut full = vec![0.0f32; l.padded_numel()];
            full[..init.len()].copy_from_slice(&init);
            let (p, pcat) = match rules.params {
                Holding::Full => (full, Category::FullParams),
                Holding::Shard => (full[l.shard_range(rank)].to_vec(), Category::ShardParams),
            };
            st.persistent.push(mem.alloc_f32(pcat, p.len(), name)?);
            let glen = rules.grads.len(l);
            st.persistent.push(mem.alloc_f32(Category::Grads, glen, name)?);
            let slen = rules.optim_state.len(l) * k;
            st.persistent.push(mem.alloc_f32(Category::OptimizerState, slen, name)?);
            st.params.push(p);
            st.grads.push(vec![0.0; glen]);
            st.optim_state.push(vec![0.0; slen]);
            st.buffers.push(model.init_buffers(u)?);
        }
        Ok(st)
    }

    /// Frees everything but the buffers.
    fn clear(&mut self) {
        self.params.clear();
        self.grads.clear();
        self.optim_state.clear();
        self.persistent.clear();
    }
}

impl RankEngine {
    /// Full (unpadded) parameters of every unit, gathered if sharded. Collective.
    pub fn full_params(&mut self) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        for u in 0..self.layout.units().len() {
            let l = self.layout.unit(u);
            // PREC-1: with packed gathers after the update (stages 1 and 2) only the own range
            // of a full copy is the f32 master; the masters are gathered in f32.
            let masters_elsewhere = self.rules.gather_after_update && self.packed_params();
            let full = match self.rules.params {
                Holding::Full if masters_elsewhere => {
                    let own = self.state.params[u][l.shard_range(self.shard_rank)].to_vec();
                    let (_, full) =
                        self.gather.all_gather(own, vec![0.0; l.padded_numel()]).wait()?;
                    full
                }
                Holding::Full => self.state.params[u].clone(),
                Holding::Shard => {
                    let (_, full) = self
                        .gather
                        .all_gather(self.state.params[u].clone(), vec![0.0; l.padded_numel()])
                        .wait()?;
                    full
                }
            };
            out.push(full[..l.numel()].to_vec());
        }
        Ok(out)
    }

    /// Frees the state and returns pooled buffers; later steps fail. Idempotent.
    pub fn shutdown(&mut self) {
        self.plan.discard();
        self.pieces.clear();
        self.state.clear();
    }

    /// Replicated buffers (BatchNorm running statistics), per unit.
    pub fn buffers(&self) -> &[Vec<f32>] {
        &self.state.buffers
    }

    /// This rank's checkpoint content: its parameter and optimizer-state slices per unit.
    pub fn shard_state(&self) -> RankShard {
        let k = self.cfg.optimizer.state_len_per_param();
        let units = (0..self.layout.units().len())
            .map(|u| {
                let r = self.layout.unit(u).shard_range(self.shard_rank);
                let params = match self.rules.params {
                    Holding::Full => self.state.params[u][r.clone()].to_vec(),
                    Holding::Shard => self.state.params[u].clone(),
                };
                let optim_state = match self.rules.optim_state {
                    Holding::Shard => self.state.optim_state[u].clone(),
                    Holding::Full => self.state.optim_state[u][r.start * k..r.end * k].to_vec(),
                };
                UnitShard { params, optim_state }
            })
            .collect();
        RankShard { units }
    }

    /// Restores state from a checkpoint shard written for this world size (resharded by the
    /// loader when it was written for another), the replicated buffers and the step count.
    /// Stages that keep full copies all-gather the slices. Collective.
    pub fn load_state(&mut self, shard: &RankShard, buffers: &[Vec<f32>], step: u64) -> Result<()> {
        // A gather issued before the load carries the old parameters (ENG-6), and a packed
        // shard the old master (QGATHER-2).
        self.plan.discard();
        self.own_packed.clear();
        self.pieces.clear();
        let k = self.cfg.optimizer.state_len_per_param();
        if shard.units.len() != self.layout.units().len()
            || buffers.len() != self.state.buffers.len()
        {
            return Err(RuntimeError::config(
                "checkpoint has another number of units than the model",
            ));
        }
        for (u, us) in shard.units.iter().enumerate() {
            let l = self.layout.unit(u);
            if us.params.len() != l.shard_len() || us.optim_state.len() != l.shard_len() * k {
                return Err(RuntimeError::config(format!(
                    "checkpoint shard of unit {} has the wrong size",
                    l.name()
                )));
            }
            if buffers[u].len() != self.state.buffers[u].len() {
                return Err(RuntimeError::config(format!(
                    "checkpoint buffers of unit {} have the wrong size",
                    l.name()
                )));
            }
            self.state.params[u] = match self.rules.params {
                Holding::Full => {
                    let (_, full) = self
                        .gather
                        .all_gather(us.params.clone(), vec![0.0; l.padded_numel()])
                        .wait()?;
                    full
                }
                Holding::Shard => us.params.clone(),
            };
            self.state.optim_state[u] = match self.rules.optim_state {
                Holding::Shard => us.optim_state.clone(),
                Holding::Full => {
                    let (_, full) = self
                        .gather
                        .all_gather(us.optim_state.clone(), vec![0.0; l.padded_numel() * k])
                        .wait()?;
                    // The gathered state is rank-major blocks of shard_len*k: the same layout
                    // as the full interleaved state, because each rank's block is contiguous.
                    full
                }
            };
            self.state.buffers[u].copy_from_slice(&buffers[u]);
        }
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_models::{ModelSpec, ParamSpec, UnitSpec};

    fn layout(world: usize) -> ShardedModelLayout {
        let unit = |name: &str, n: usize| UnitSpec {
            name: name.into(),
            params: vec![ParamSpec { name: format!("{name}.w"), shape: vec![n] }],
            buffers: vec![],
        };
        let spec = ModelSpec { name: "m".into(), units: vec![unit("a", 1000), unit("b", 3000)] };
        ShardedModelLayout::new(&spec, world).unwrap()
    }

    /// What a rank holds follows the stage (AdamW: 2 state values per element), plus the
    /// largest unit built whole; the check refuses only above the host's memory.
    #[test]
    fn a_rank_larger_than_the_host_is_refused_before_allocating() {
        let l = layout(4);
        let (k, n) = (2, 4000u64);
        let (kept0, init) = persistent_bytes(&l, StageRules::of(Stage::Zero0), k);
        assert_eq!((kept0, init), (4 * n * 4, 3000 * 4));
        let (kept3, init3) = persistent_bytes(&l, StageRules::of(Stage::Zero3), k);
        assert_eq!(init3, 2 * 3000 * 4, "the whole unit and its padded copy");
        assert_eq!(kept3, 4 * (n / 4) * 4);
        let fits = |stage, host| check_fits_host(&l, stage, k, (1, "rank 0"), host);
        assert!(fits(Stage::Zero0, Some(kept0 + init)).is_ok());
        assert!(fits(Stage::Zero0, None).is_ok());
        let err = fits(Stage::Zero0, Some(kept0 + init - 1)).unwrap_err();
        assert!(matches!(err, RuntimeError::Config(_)), "{err}");
        assert!(err.to_string().contains("4000 parameters"), "{err}");
        assert!(fits(Stage::Zero3, Some(kept0)).is_ok(), "stage 3 holds a quarter");
        // Four ranks in one process hold four times one rank's state.
        let four = |host| check_fits_host(&l, Stage::Zero0, k, (4, "the 4 ranks"), host);
        assert!(four(Some(4 * (kept0 + init))).is_ok());
        let err = four(Some(4 * (kept0 + init) - 1)).unwrap_err().to_string();
        assert!(err.starts_with("invalid configuration: the 4 ranks would hold"), "{err}");
    }
}
