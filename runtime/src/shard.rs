//! Flat parameters, padding, shard ranges and the ZeRO stage rules.
//!
//! Each unit's trainable parameters are flattened, in [`UnitSpec`] order, into one buffer
//! whose length is padded up to a multiple of the world size; rank `r` owns the contiguous
//! slice `r` of it. A [`FlatLayout`] is that arithmetic for one unit, a
//! [`ShardedModelLayout`] the same for every unit of a model. Nothing here allocates
//! parameter memory except the explicit flatten/reshard helpers.
//!
//! # Invariants
//!
//! - **SHARD-1**: rank `r` owns slice `r` of every unit: `shard_range(r)` is
//!   `r * shard_len .. (r + 1) * shard_len`, the same length on every rank.
//! - **SHARD-2**: padding is less than the world size: `0 <= padded_numel - numel < world`,
//!   and `padded_numel` is the smallest multiple of `world` that is `>= numel`.
//! - **SHARD-3**: the shards of ranks `0..world`, concatenated in rank order, are exactly
//!   the padded flat buffer (no gaps, no overlap).
//! - **SHARD-4**: per-parameter offsets round-trip: flattening tensors and reading each
//!   parameter back at its offset gives the original tensor, and the parameters tile
//!   `0..numel` in spec order without gaps.
//! - **SHARD-5**: the padding tail of a flat buffer is zero after flattening and stays zero
//!   through resharding.
//! - **SHARD-6**: resharding is exact: shards for world `W1` resharded to `W2` and back give
//!   bitwise the original shards, and both consolidate to the same unpadded buffer.
//!
//! # Stages
//!
//! [`Stage`] encodes the table of ARCHITECTURE.md ("runtime / Sharding"):
//!
//! | stage | params | grads | optimizer state |
//! |---|---|---|---|
//! | 0 (DDP) | full | full | full |
//! | 1 | full | full, then own slice | own slice |
//! | 2 | full | own slice only | own slice |
//! | 3 (FSDP) | own slice; full only while a unit runs | own slice | own slice |

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use shardline_models::{ModelSpec, ParamSpec, UnitSpec};

use crate::error::{Result, RuntimeError};
use crate::optim::Optimizer;

/// Bytes per element of every flat buffer (f32).
pub const ELEM_BYTES: u64 = 4;

/// Where one parameter lives in its unit's flat buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSlot {
    /// Stable parameter name.
    pub name: String,
    /// Original shape.
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
}

impl ParamSlot {
    /// The parameter's element range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// The flat-parameter layout of one unit for a given world size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatLayout {
    name: String,
    world: usize,
    numel: usize,
    padded_numel: usize,
    params: Vec<ParamSlot>,
}

impl FlatLayout {
    /// Lays out `unit`'s parameters for `world` ranks. Fails on world 0.
    pub fn new(unit: &UnitSpec, world: usize) -> Result<Self> {
        Self::from_params(&unit.name, &unit.params, world)
    }

    /// Lays out a named list of parameters for `world` ranks. Fails on world 0.
    pub fn from_params(name: &str, params: &[ParamSpec], world: usize) -> Result<Self> {
        if world == 0 {
            return Err(RuntimeError::config("world size must be at least 1"));
        }
        let mut offset = 0;
        let mut slots = Vec::with_capacity(params.len());
        for p in params {
            let numel = p.numel();
            slots.push(ParamSlot { name: p.name.clone(), shape: p.shape.clone(), offset, numel });
            offset += numel;
        }
        Ok(FlatLayout {
            name: name.to_string(),
            world,
            numel: offset,
            padded_numel: padded_len(offset, world),
            params: slots,
        })
    }

    /// Unit name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// World size the layout was made for.
    pub fn world(&self) -> usize {
        self.world
    }
    /// Trainable elements, unpadded.
    pub fn numel(&self) -> usize {
        self.numel
    }
    /// Length of the padded flat buffer (a multiple of the world size).
    pub fn padded_numel(&self) -> usize {
        self.padded_numel
    }
    /// Padding elements at the end of the flat buffer (SHARD-2: `< world`).
    pub fn padding(&self) -> usize {
        self.padded_numel - self.numel
    }
    /// Elements per shard, equal on every rank.
    pub fn shard_len(&self) -> usize {
        self.padded_numel / self.world
    }
    /// The flat-buffer range rank `rank` owns (SHARD-1). Panics if `rank >= world`.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        assert!(rank < self.world, "rank {rank} out of range for world {}", self.world);
        let len = self.shard_len();
        rank * len..(rank + 1) * len
    }
    /// The part of `shard_range(rank)` that holds real elements (not padding).
    pub fn shard_valid_range(&self, rank: usize) -> Range<usize> {
        let r = self.shard_range(rank);
        r.start.min(self.numel)..r.end.min(self.numel)
    }
    /// Parameter slots in flat-buffer order.
    pub fn params(&self) -> &[ParamSlot] {
        &self.params
    }
    /// The slot of the parameter called `name`.
    pub fn param(&self, name: &str) -> Option<&ParamSlot> {
        self.params.iter().find(|p| p.name == name)
    }
    /// The same unit laid out for another world size.
    pub fn for_world(&self, world: usize) -> Result<Self> {
        if world == 0 {
            return Err(RuntimeError::config("world size must be at least 1"));
        }
        Ok(FlatLayout { world, padded_numel: padded_len(self.numel, world), ..self.clone() })
    }

    /// Flattens per-parameter tensors (in spec order) into a zero-padded flat buffer.
    pub fn flatten(&self, tensors: &[&[f32]]) -> Result<Vec<f32>> {
        if tensors.len() != self.params.len() {
            return Err(RuntimeError::config(format!(
                "unit {}: {} tensors given for {} parameters",
                self.name,
                tensors.len(),
                self.params.len()
            )));
        }
        let mut flat = vec![0.0; self.padded_numel];
        for (slot, t) in self.params.iter().zip(tensors) {
            if t.len() != slot.numel {
                return Err(RuntimeError::config(format!(
                    "parameter {}: {} elements given, shape {:?} needs {}",
                    slot.name,
                    t.len(),
                    slot.shape,
                    slot.numel
                )));
            }
            flat[slot.range()].copy_from_slice(t);
        }
        Ok(flat)
    }

    /// Views of each parameter in a flat buffer (padded or not), in spec order.
    /// Panics if `flat` is shorter than `numel`.
    pub fn views<'a>(&self, flat: &'a [f32]) -> Vec<&'a [f32]> {
        assert!(flat.len() >= self.numel, "flat buffer shorter than the unit");
        self.params.iter().map(|p| &flat[p.range()]).collect()
    }

    /// Mutable views of each parameter in a flat buffer, in spec order (the parameters are
    /// disjoint, so all can be borrowed at once). Panics if `flat` is shorter than `numel`.
    pub fn views_mut<'a>(&self, flat: &'a mut [f32]) -> Vec<&'a mut [f32]> {
        assert!(flat.len() >= self.numel, "flat buffer shorter than the unit");
        let mut rest = &mut flat[..self.numel];
        let mut out = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(p.numel);
            out.push(head);
            rest = tail;
        }
        out
    }

    /// Rank `rank`'s slice of a padded flat buffer.
    pub fn shard_of<'a>(&self, flat: &'a [f32], rank: usize) -> &'a [f32] {
        assert_eq!(flat.len(), self.padded_numel, "not a padded flat buffer");
        &flat[self.shard_range(rank)]
    }

    /// Concatenates one shard per rank into the padded flat buffer (SHARD-3).
    pub fn concat_shards(&self, shards: &[&[f32]]) -> Result<Vec<f32>> {
        if shards.len() != self.world {
            return Err(RuntimeError::config(format!(
                "unit {}: {} shards given for world {}",
                self.name,
                shards.len(),
                self.world
            )));
        }
        let mut flat = Vec::with_capacity(self.padded_numel);
        for (rank, s) in shards.iter().enumerate() {
            if s.len() != self.shard_len() {
                return Err(RuntimeError::config(format!(
                    "unit {}: shard of rank {rank} has {} elements, expected {}",
                    self.name,
                    s.len(),
                    self.shard_len()
                )));
            }
            flat.extend_from_slice(s);
        }
        Ok(flat)
    }
}

/// Smallest multiple of `world` that is at least `numel`.
pub fn padded_len(numel: usize, world: usize) -> usize {
    numel.div_ceil(world) * world
}

/// Joins per-rank shards of a strided flat buffer (`width` values per element, e.g. the
/// optimizer's state per parameter) and drops the padding: the result has `numel * width`
/// values. Shards must all have the same length, a multiple of `width`, and together cover
/// at least `numel` elements.
pub fn consolidate(numel: usize, width: usize, shards: &[&[f32]]) -> Result<Vec<f32>> {
    let total: usize = shards.iter().map(|s| s.len()).sum();
    let want = numel * width;
    if total < want {
        return Err(RuntimeError::config(format!(
            "shards hold {total} values, need {want} ({numel} elements x {width})"
        )));
    }
    if let Some(first) = shards.first() {
        if shards.iter().any(|s| s.len() != first.len()) || first.len() % width.max(1) != 0 {
            return Err(RuntimeError::config(
                "shards have unequal lengths or a length that is not a multiple of the width",
            ));
        }
    }
    let mut flat = Vec::with_capacity(total);
    for s in shards {
        flat.extend_from_slice(s);
    }
    if flat[want..].iter().any(|v| *v != 0.0) {
        return Err(RuntimeError::config("nonzero values in the padding of the shards"));
    }
    flat.truncate(want);
    Ok(flat)
}

/// Splits an unpadded strided flat buffer (`numel * width` values) into `world` equal,
/// zero-padded shards.
pub fn split(flat: &[f32], numel: usize, width: usize, world: usize) -> Result<Vec<Vec<f32>>> {
    if world == 0 {
        return Err(RuntimeError::config("world size must be at least 1"));
    }
    if flat.len() != numel * width {
        return Err(RuntimeError::config(format!(
            "buffer has {} values, expected {numel} elements x {width}",
            flat.len()
        )));
    }
    let shard_values = padded_len(numel, world) / world * width;
    Ok((0..world)
        .map(|r| {
            let start = (r * shard_values).min(flat.len());
            let end = ((r + 1) * shard_values).min(flat.len());
            let mut s = flat[start..end].to_vec();
            s.resize(shard_values, 0.0);
            s
        })
        .collect())
}

/// Reshards a unit's shards from one world size to another through the unpadded flat buffer
/// (SHARD-6). `width` is the values per element (1 for parameters).
pub fn reshard(
    numel: usize,
    width: usize,
    shards: &[&[f32]],
    to_world: usize,
) -> Result<Vec<Vec<f32>>> {
    let flat = consolidate(numel, width, shards)?;
    split(&flat, numel, width, to_world)
}

/// Flat layouts of every unit of a model for one world size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardedModelLayout {
    world: usize,
    units: Vec<FlatLayout>,
}

impl ShardedModelLayout {
    /// Lays out every unit of `spec` for `world` ranks.
    pub fn new(spec: &ModelSpec, world: usize) -> Result<Self> {
        let units =
            spec.units.iter().map(|u| FlatLayout::new(u, world)).collect::<Result<Vec<_>>>()?;
        Ok(ShardedModelLayout { world, units })
    }
    /// The same model laid out for another world size.
    pub fn for_world(&self, world: usize) -> Result<Self> {
        let units = self.units.iter().map(|u| u.for_world(world)).collect::<Result<Vec<_>>>()?;
        Ok(ShardedModelLayout { world, units })
    }
    /// World size.
    pub fn world(&self) -> usize {
        self.world
    }
    /// Unit layouts in forward order.
    pub fn units(&self) -> &[FlatLayout] {
        &self.units
    }
    /// Unit `i`'s layout.
    pub fn unit(&self, i: usize) -> &FlatLayout {
        &self.units[i]
    }
    /// Trainable elements of the model, unpadded.
    pub fn numel(&self) -> usize {
        self.units.iter().map(FlatLayout::numel).sum()
    }
    /// Sum of the padded flat-buffer lengths.
    pub fn padded_numel(&self) -> usize {
        self.units.iter().map(FlatLayout::padded_numel).sum()
    }
    /// Elements each rank owns across all units.
    pub fn shard_numel(&self) -> usize {
        self.units.iter().map(FlatLayout::shard_len).sum()
    }
    /// Largest padded unit (what one gathered unit costs at stage 3).
    pub fn max_unit_padded_numel(&self) -> usize {
        self.units.iter().map(FlatLayout::padded_numel).max().unwrap_or(0)
    }
    /// Per-rank model-state bytes for this exact layout (padding included), excluding
    /// gathered units and activations.
    pub fn model_state_bytes(&self, stage: Stage, optimizer: &Optimizer) -> u64 {
        let full = self.padded_numel() as u64;
        let shard = self.shard_numel() as u64;
        state_bytes(stage, full, shard, optimizer.state_len_per_param() as u64)
    }
}

/// ZeRO stage: what each rank keeps (see the module table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "u8", try_from = "u8")]
pub enum Stage {
    /// Stage 0, DDP: everything replicated, gradients all-reduced.
    Zero0,
    /// Stage 1: optimizer state sharded.
    Zero1,
    /// Stage 2: optimizer state and gradients sharded.
    Zero2,
    /// Stage 3, FSDP full shard: parameters too.
    Zero3,
}

/// How gradients are reduced at a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradReduction {
    /// Bucketed all-reduce, every rank gets the full gradient.
    AllReduce,
    /// Reduce-scatter, each rank gets its own slice.
    ReduceScatter,
}

impl Stage {
    /// All stages in order.
    pub const ALL: [Stage; 4] = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3];

    /// The stage with number `n` (0..=3).
    pub fn from_index(n: u8) -> Result<Self> {
        match n {
            0 => Ok(Stage::Zero0),
            1 => Ok(Stage::Zero1),
            2 => Ok(Stage::Zero2),
            3 => Ok(Stage::Zero3),
            _ => {
                Err(RuntimeError::config(format!("unknown ZeRO stage {n}; stages are 0, 1, 2, 3")))
            }
        }
    }
    /// The stage's number.
    pub fn index(self) -> u8 {
        self as u8
    }
    /// Whether each rank keeps the full parameters between steps (stages 0-2).
    pub fn keeps_full_params(self) -> bool {
        self != Stage::Zero3
    }
    /// Whether a unit's full parameters are gathered just before use and freed after
    /// (stage 3).
    pub fn gathers_params_per_unit(self) -> bool {
        self == Stage::Zero3
    }
    /// Whether full gradients exist on a rank during backward (stages 0, 1: stage 1 keeps
    /// the full gradient, then uses only its own slice).
    pub fn keeps_full_grads(self) -> bool {
        matches!(self, Stage::Zero0 | Stage::Zero1)
    }
    /// Whether a rank keeps only its own slice of the gradients (stages 2, 3; gradient
    /// memory is freed as it is reduced).
    pub fn grads_sharded(self) -> bool {
        matches!(self, Stage::Zero2 | Stage::Zero3)
    }
    /// Whether the optimizer state is sharded (stages 1-3); stage 0 keeps it all.
    pub fn optimizer_sharded(self) -> bool {
        self != Stage::Zero0
    }
    /// Whether the optimizer steps only the own slice (stages 1-3).
    pub fn steps_own_slice(self) -> bool {
        self.optimizer_sharded()
    }
    /// Whether updated parameters are all-gathered after the step (stages 1, 2).
    pub fn all_gathers_after_step(self) -> bool {
        matches!(self, Stage::Zero1 | Stage::Zero2)
    }
    /// How gradients are reduced.
    pub fn grad_reduction(self) -> GradReduction {
        match self {
            Stage::Zero0 => GradReduction::AllReduce,
            _ => GradReduction::ReduceScatter,
        }
    }
}

impl From<Stage> for u8 {
    fn from(s: Stage) -> u8 {
        s.index()
    }
}

impl TryFrom<u8> for Stage {
    type Error = RuntimeError;
    fn try_from(n: u8) -> Result<Self> {
        Stage::from_index(n)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.index())
    }
}

impl std::str::FromStr for Stage {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self> {
        let n: u8 = s
            .trim()
            .parse()
            .map_err(|_| RuntimeError::config(format!("'{s}' is not a ZeRO stage (0-3)")))?;
        Stage::from_index(n)
    }
}

/// Theoretical per-rank model-state bytes (params + grads + optimizer state, f32) of a model
/// with `numel` trainable elements, as in the ZeRO paper: stage 0 keeps
/// `(2 + K) * numel` values, stage 1 `2 * numel + K * numel / world`, stage 2
/// `numel + (1 + K) * numel / world`, stage 3 `(2 + K) * numel / world`, where `K` is the
/// optimizer's `state_len_per_param()` (AdamW 2, SGD with momentum 1, plain SGD 0). Shards
/// round up. Gathered units, activations and communication buffers come on top.
///
/// ```
/// use shardline_runtime::optim::{AdamWConfig, Optimizer};
/// use shardline_runtime::shard::{model_state_bytes, Stage};
/// let adam = Optimizer::AdamW(AdamWConfig::default());
/// // 1M parameters, world 4: stage 0 holds 16 MB per rank, stage 3 a quarter of it.
/// assert_eq!(model_state_bytes(Stage::Zero0, 4, 1_000_000, &adam), 16_000_000);
/// assert_eq!(model_state_bytes(Stage::Zero3, 4, 1_000_000, &adam), 4_000_000);
/// ```
pub fn model_state_bytes(stage: Stage, world: usize, numel: usize, optimizer: &Optimizer) -> u64 {
    model_state_bytes_for_width(stage, world, numel, optimizer.state_len_per_param())
}

/// [`model_state_bytes`] with the optimizer-state width `K` given directly.
pub fn model_state_bytes_for_width(
    stage: Stage,
    world: usize,
    numel: usize,
    state_len_per_param: usize,
) -> u64 {
    let world = world.max(1);
    let full = numel as u64;
    let shard = numel.div_ceil(world) as u64;
    state_bytes(stage, full, shard, state_len_per_param as u64)
}

fn state_bytes(stage: Stage, full: u64, shard: u64, k: u64) -> u64 {
    let params = if stage.keeps_full_params() { full } else { shard };
    let grads = if stage.grads_sharded() { shard } else { full };
    let optim = if stage.optimizer_sharded() { k * shard } else { k * full };
    (params + grads + optim) * ELEM_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamWConfig, SgdConfig};
    use proptest::prelude::*;

    fn unit_from_sizes(sizes: &[usize]) -> UnitSpec {
        UnitSpec {
            name: "u".into(),
            params: sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| ParamSpec { name: format!("u.p{i}"), shape: vec![n] })
                .collect(),
            buffers: vec![],
        }
    }

    fn tensors(sizes: &[usize], seed: f32) -> Vec<Vec<f32>> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| seed + (i * 1000 + j) as f32 + 1.0).collect())
            .collect()
    }

    // Sizes include 0 (empty parameters) and empty units (no parameters).
    fn sizes() -> impl Strategy<Value = Vec<usize>> {
        proptest::collection::vec(0usize..40, 0..6)
    }

    proptest! {
        /// SHARD-1 and SHARD-2.
        #[test]
        fn shard_ranges_and_padding(sizes in sizes(), world in 1usize..=16) {
            let l = FlatLayout::new(&unit_from_sizes(&sizes), world).unwrap();
            let numel: usize = sizes.iter().sum();
            prop_assert_eq!(l.numel(), numel);
            // SHARD-2
            prop_assert!(l.padding() < world);
            prop_assert_eq!(l.padded_numel() % world, 0);
            prop_assert!(l.padded_numel() >= numel);
            prop_assert!(l.padded_numel() < numel + world);
            // SHARD-1
            for r in 0..world {
                let range = l.shard_range(r);
                prop_assert_eq!(range.start, r * l.shard_len());
                prop_assert_eq!(range.len(), l.shard_len());
            }
        }

        /// SHARD-3 and SHARD-5.
        #[test]
        fn shards_concatenate_to_padded_buffer(sizes in sizes(), world in 1usize..=16) {
            let l = FlatLayout::new(&unit_from_sizes(&sizes), world).unwrap();
            let ts = tensors(&sizes, 0.5);
            let refs: Vec<&[f32]> = ts.iter().map(|t| t.as_slice()).collect();
            let flat = l.flatten(&refs).unwrap();
            prop_assert_eq!(flat.len(), l.padded_numel());
            // SHARD-5
            prop_assert!(flat[l.numel()..].iter().all(|v| *v == 0.0));
            let shards: Vec<&[f32]> = (0..world).map(|r| l.shard_of(&flat, r)).collect();
            // SHARD-3
            prop_assert_eq!(l.concat_shards(&shards).unwrap(), flat.clone());
            // The valid part of each shard never reaches into the padding.
            for r in 0..world {
                let v = l.shard_valid_range(r);
                prop_assert!(v.end <= l.numel());
            }
        }

        /// SHARD-4.
        #[test]
        fn param_offsets_round_trip(sizes in sizes(), world in 1usize..=16) {
            let l = FlatLayout::new(&unit_from_sizes(&sizes), world).unwrap();
            let ts = tensors(&sizes, 3.0);
            let refs: Vec<&[f32]> = ts.iter().map(|t| t.as_slice()).collect();
            let flat = l.flatten(&refs).unwrap();
            let views = l.views(&flat);
            for (v, t) in views.iter().zip(&ts) {
                prop_assert_eq!(*v, t.as_slice());
            }
            let mut flat2 = vec![0.0; l.padded_numel()];
            for (v, t) in l.views_mut(&mut flat2).into_iter().zip(&ts) {
                v.copy_from_slice(t);
            }
            prop_assert_eq!(&flat2, &flat);
            // Slots tile 0..numel in spec order.
            let mut next = 0;
            for (slot, &n) in l.params().iter().zip(&sizes) {
                prop_assert_eq!(slot.offset, next);
                prop_assert_eq!(slot.numel, n);
                next += n;
            }
            prop_assert_eq!(next, l.numel());
        }

        /// SHARD-6 (and SHARD-5 through resharding), for parameters and strided state.
        #[test]
        fn reshard_round_trips(numel in 0usize..200, w1 in 1usize..=16, w2 in 1usize..=16,
                               width in 1usize..=3) {
            let flat: Vec<f32> = (0..numel * width).map(|i| i as f32 + 0.25).collect();
            let s1 = split(&flat, numel, width, w1).unwrap();
            prop_assert_eq!(s1.len(), w1);
            for s in &s1 {
                prop_assert_eq!(s.len(), padded_len(numel, w1) / w1 * width);
            }
            let r1: Vec<&[f32]> = s1.iter().map(|s| s.as_slice()).collect();
            let s2 = reshard(numel, width, &r1, w2).unwrap();
            let r2: Vec<&[f32]> = s2.iter().map(|s| s.as_slice()).collect();
            prop_assert_eq!(consolidate(numel, width, &r2).unwrap(), flat.clone());
            let back = reshard(numel, width, &r2, w1).unwrap();
            prop_assert_eq!(back, s1);
        }
    }

    /// SHARD-6: the 4 -> 2 -> 3 chain on a real layout.
    #[test]
    fn reshard_4_2_3_exact() {
        let sizes = [7, 0, 13, 1];
        let unit = unit_from_sizes(&sizes);
        let l4 = FlatLayout::new(&unit, 4).unwrap();
        let ts = tensors(&sizes, 0.125);
        let refs: Vec<&[f32]> = ts.iter().map(|t| t.as_slice()).collect();
        let flat4 = l4.flatten(&refs).unwrap();
        let s4: Vec<&[f32]> = (0..4).map(|r| l4.shard_of(&flat4, r)).collect();
        let s2 = reshard(l4.numel(), 1, &s4, 2).unwrap();
        let r2: Vec<&[f32]> = s2.iter().map(|s| s.as_slice()).collect();
        let s3 = reshard(l4.numel(), 1, &r2, 3).unwrap();
        let l3 = l4.for_world(3).unwrap();
        let flat3 = l3.flatten(&refs).unwrap();
        for (r, s) in s3.iter().enumerate() {
            assert_eq!(s.as_slice(), l3.shard_of(&flat3, r));
        }
        let r3: Vec<&[f32]> = s3.iter().map(|s| s.as_slice()).collect();
        let back4 = reshard(l4.numel(), 1, &r3, 4).unwrap();
        let b4: Vec<&[f32]> = back4.iter().map(|s| s.as_slice()).collect();
        assert_eq!(b4, s4);
    }

    #[test]
    fn world_zero_is_a_config_error() {
        let unit = unit_from_sizes(&[3]);
        assert!(matches!(FlatLayout::new(&unit, 0), Err(RuntimeError::Config(_))));
        assert!(split(&[1.0], 1, 1, 0).is_err());
    }

    #[test]
    fn flatten_rejects_wrong_sizes() {
        let l = FlatLayout::new(&unit_from_sizes(&[2, 3]), 2).unwrap();
        assert!(l.flatten(&[&[1.0, 2.0]]).is_err());
        assert!(l.flatten(&[&[1.0, 2.0], &[1.0]]).is_err());
    }

    #[test]
    fn consolidate_rejects_nonzero_padding() {
        let shards: Vec<&[f32]> = vec![&[1.0, 2.0], &[3.0, 9.0]];
        assert!(consolidate(3, 1, &shards).is_err());
        assert_eq!(consolidate(4, 1, &shards).unwrap(), vec![1.0, 2.0, 3.0, 9.0]);
    }

    /// The stage table of ARCHITECTURE.md, row by row.
    #[test]
    fn stage_table() {
        use Stage::*;
        let rows = [
            // stage, full params, full grads in backward, grads sharded, optimizer sharded
            (Zero0, true, true, false, false),
            (Zero1, true, true, false, true),
            (Zero2, true, false, true, true),
            (Zero3, false, false, true, true),
        ];
        for (s, fp, fg, gs, os) in rows {
            assert_eq!(s.keeps_full_params(), fp, "{s:?}");
            assert_eq!(s.keeps_full_grads(), fg, "{s:?}");
            assert_eq!(s.grads_sharded(), gs, "{s:?}");
            assert_eq!(s.optimizer_sharded(), os, "{s:?}");
            assert_eq!(s.gathers_params_per_unit(), s == Zero3);
            assert_eq!(s.all_gathers_after_step(), matches!(s, Zero1 | Zero2));
        }
        assert_eq!(Zero0.grad_reduction(), GradReduction::AllReduce);
        assert_eq!(Zero3.grad_reduction(), GradReduction::ReduceScatter);
        for s in Stage::ALL {
            assert_eq!(Stage::from_index(s.index()).unwrap(), s);
            assert_eq!(s.to_string().parse::<Stage>().unwrap(), s);
        }
        assert!(Stage::from_index(4).is_err());
        assert!("x".parse::<Stage>().is_err());
    }

    /// Per-rank bytes of the four ZeRO formulas, computed by hand (f32 values, Adam K = 2).
    #[test]
    fn model_state_bytes_matches_formulas() {
        let n = 1000;
        let w = 4;
        let adam = Optimizer::AdamW(AdamWConfig::default());
        assert_eq!(model_state_bytes(Stage::Zero0, w, n, &adam), 4 * 4000);
        assert_eq!(model_state_bytes(Stage::Zero1, w, n, &adam), 4 * (2000 + 500));
        assert_eq!(model_state_bytes(Stage::Zero2, w, n, &adam), 4 * (1000 + 750));
        assert_eq!(model_state_bytes(Stage::Zero3, w, n, &adam), 4 * 1000);
        // SGD with momentum, odd size: shards round up.
        let sgd = Optimizer::Sgd(SgdConfig { momentum: 0.9, ..SgdConfig::default() });
        assert_eq!(model_state_bytes(Stage::Zero3, 3, 10, &sgd), 4 * 12);
        // Plain SGD keeps no state.
        let plain = Optimizer::Sgd(SgdConfig::default());
        assert_eq!(model_state_bytes(Stage::Zero0, 3, 10, &plain), 4 * 20);
        // World 1: every stage keeps everything.
        for s in Stage::ALL {
            assert_eq!(model_state_bytes_for_width(s, 1, 10, 2), 4 * 40);
        }
    }

    #[test]
    fn model_layout_sums_units() {
        let spec = ModelSpec {
            name: "m".into(),
            units: vec![unit_from_sizes(&[5, 2]), unit_from_sizes(&[]), unit_from_sizes(&[9])],
        };
        let l = ShardedModelLayout::new(&spec, 4).unwrap();
        assert_eq!(l.numel(), 16);
        assert_eq!(l.padded_numel(), 20);
        assert_eq!(l.shard_numel(), 5);
        assert_eq!(l.max_unit_padded_numel(), 12);
        let adam = Optimizer::AdamW(AdamWConfig::default());
        assert_eq!(l.model_state_bytes(Stage::Zero3, &adam), 4 * 5 * 4);
        assert_eq!(l.model_state_bytes(Stage::Zero0, &adam), 4 * 20 * 4);
        let l3 = l.for_world(3).unwrap();
        assert_eq!(l3.padded_numel(), 18);
        assert_eq!(l3, ShardedModelLayout::new(&spec, 3).unwrap());
    }
}
