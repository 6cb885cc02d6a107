//! Model specifications: what a model's parameters are called and how they group into units
//! (the FSDP wrapping granularity). Building a spec allocates no parameter memory.

use serde::{Deserialize, Serialize};

/// One named tensor of a unit (a trainable parameter or a replicated buffer).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Stable name, e.g. `blocks.0.linear.weight`.
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A unit: a group of layers whose parameters are flattened, sharded and gathered together.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitSpec {
    /// Unit name, e.g. `blocks.0`.
    pub name: String,
    /// Trainable parameters in flat-buffer order.
    pub params: Vec<ParamSpec>,
    /// Non-trainable state (BatchNorm running mean/var), replicated on every rank.
    pub buffers: Vec<ParamSpec>,
}

impl UnitSpec {
    /// Total trainable elements of the unit (before padding).
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamSpec::numel).sum()
    }
    /// Total replicated-buffer elements of the unit.
    pub fn buffer_numel(&self) -> usize {
        self.buffers.iter().map(ParamSpec::numel).sum()
    }
}

/// A model's units in execution order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Zoo name, e.g. `mlp-bn`.
    pub name: String,
    /// Units in forward order.
    pub units: Vec<UnitSpec>,
}

impl ModelSpec {
    /// Total trainable elements.
    pub fn numel(&self) -> usize {
        self.units.iter().map(UnitSpec::numel).sum()
    }
}
