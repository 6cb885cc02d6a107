//! What the engine trains: a [`Network`], cut into sharding units, each called once or more
//! per forward pass, and scored by a [`Loss`].
//!
//! The engine shards, gathers and reduces by unit ([`ModelSpec`]) and knows nothing else of
//! the model: [`Network::calls`] says which unit runs at each position of the forward pass
//! (backward runs them in reverse), and the model computes each call. Two implementations:
//! - [`crate::Model`], the zoo's block models, one call per unit;
//! - [`ModuleNet`], any [`Module`] tree: top-level children cut into units by a
//!   [`WrapPolicy`], and an optional [`RootModule`] whose unit is called first and last (a
//!   tied embedding and head), as FSDP2 wraps a transformer's blocks and keeps the root's
//!   parameters for the whole step.
//!
//! Invariants:
//! - `NET-1`: a unit's gradients are complete only after its last backward call; a call
//!   ADDS into the unit's gradients, except where the context says to overwrite
//!   ([`Ctx::overwrite_grads`]), which the engine asks only of a unit's first backward call.
//! - `NET-2`: [`ModuleNet`]'s parameter names, shapes and initial values do not depend on the
//!   wrap policy (MODULE-1): only their grouping into units does.

use std::ops::Range;

use crate::error::ModelError;
use crate::lower::{LowerCtx, Lowering, Program};
use crate::model::{Ctx, InputGrad, UnitSaved};
use crate::module::{
    backward_children, forward_children, init_values, lower_children, numel, Buffers, Grads, Loss,
    Module, Param, Params, RootModule, Saved,
};
use crate::spec::{ModelSpec, ParamSpec, UnitSpec};
use crate::tensor::Tensor;
use crate::{Model, WrapPolicy};

/// One call's backward, as [`Network::backward_call`] takes it.
pub struct CallBackward<'a> {
    /// The unit's flat parameters (spec order).
    pub params: &'a [f32],
    /// What the call's forward saved.
    pub saved: Saved,
    /// Gradient of the call's output.
    pub grad_output: Tensor,
    /// The unit's parameter gradients (spec order), added or written as
    /// [`Ctx::overwrite_grads`] says (NET-1).
    pub grads_out: &'a mut [f32],
    /// Whether the input gradient is wanted (false for the pass's first call, whose input
    /// is data).
    pub input_grad: bool,
}

/// A model as the engine trains it; see the [module docs](self).
pub trait Network: Send + Sync + std::fmt::Debug {
    /// Names, shapes and units.
    fn spec(&self) -> ModelSpec;

    /// The unit of each call of a forward pass, in order (backward runs them in reverse).
    fn calls(&self) -> Vec<usize> {
        (0..self.spec().units.len()).collect()
    }

    /// Initial parameters of `unit` (spec order) from `seed`.
    fn init_params(&self, unit: usize, seed: u64) -> Result<Vec<f32>, ModelError>;

    /// Initial buffers of `unit`.
    fn init_buffers(&self, unit: usize) -> Result<Vec<f32>, ModelError>;

    /// Call `call` of the forward pass on `x`, with its unit's parameters and buffers.
    fn forward_call(
        &self,
        call: usize,
        params: &[f32],
        buffers: &mut [f32],
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError>;

    /// The backward of call `call` (NET-1).
    fn backward_call(
        &self,
        call: usize,
        b: CallBackward<'_>,
        ctx: &Ctx,
    ) -> Result<InputGrad, ModelError>;

    /// What the output is scored by.
    fn loss(&self) -> &dyn Loss;

    /// Call `call` on an input of `input` shape as device ops ([`crate::lower`]) in `ctx`.
    /// The default refuses (LOWER-3): the call runs as host code.
    fn lower_call(
        &self,
        call: usize,
        input: &[usize],
        ctx: &LowerCtx,
    ) -> Result<Program, ModelError> {
        let _ = (call, input, ctx);
        Err(Lowering::unlowered(&format!("{}'s calls", self.spec().name)))
    }

    /// Whether some BatchNorm computes per-rank statistics (a warning with several ranks).
    fn has_local_batchnorm(&self) -> bool {
        false
    }
}

impl Network for Model {
    fn spec(&self) -> ModelSpec {
        Model::spec(self)
    }
    fn init_params(&self, unit: usize, seed: u64) -> Result<Vec<f32>, ModelError> {
        Model::init_params(self, unit, seed)
    }
    fn init_buffers(&self, unit: usize) -> Result<Vec<f32>, ModelError> {
        Model::init_buffers(self, unit)
    }
    fn forward_call(
        &self,
        call: usize,
        params: &[f32],
        buffers: &mut [f32],
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (y, s) = self.forward_unit(call, params, buffers, x, ctx)?;
        Ok((y, Box::new(s)))
    }
    fn backward_call(
        &self,
        call: usize,
        b: CallBackward<'_>,
        ctx: &Ctx,
    ) -> Result<InputGrad, ModelError> {
        let saved: UnitSaved = crate::module::unsave(b.saved, "model unit")?;
        self.backward_unit_split(
            crate::UnitBackward {
                unit: call,
                params: b.params,
                saved: &saved,
                grad_output: b.grad_output,
                grads_out: b.grads_out,
                input_grad: b.input_grad,
            },
            ctx,
        )
    }
    fn loss(&self) -> &dyn Loss {
        &crate::module::ClassCrossEntropy
    }
    fn has_local_batchnorm(&self) -> bool {
        Model::has_local_batchnorm(self)
    }

    /// Every zoo layer lowers (`lower::layers`): linear and ReLU as their modules do,
    /// convolution, pooling, flatten, BatchNorm (SyncBatchNorm's statistics a collective),
    /// and each block's residual.
    fn lower_call(
        &self,
        call: usize,
        input: &[usize],
        ctx: &LowerCtx,
    ) -> Result<Program, ModelError> {
        let mut l = Lowering::new(*ctx);
        let x = l.input(input);
        let y = crate::lower::layers::zoo_unit(self, call, &mut l, x)?;
        l.finish(y, call > 0)
    }
}

/// A model built from [`Module`]s; see the [module docs](self).
#[derive(Debug)]
pub struct ModuleNet {
    name: String,
    root: Option<(String, Box<dyn RootModule>)>,
    body: Vec<(String, Box<dyn Module>)>,
    /// Each body child's name as a unit (its prefix, unless given another).
    labels: Vec<String>,
    /// Body children per body unit.
    units: Vec<Range<usize>>,
    loss: Box<dyn Loss>,
}

impl ModuleNet {
    /// An empty model `name` scored by `loss`.
    pub fn new(name: &str, loss: impl Loss + 'static) -> Self {
        ModuleNet {
            name: name.to_string(),
            root: None,
            body: Vec::new(),
            labels: Vec::new(),
            units: Vec::new(),
            loss: Box::new(loss),
        }
    }

    /// The root, its parameters named `prefix.<param>`: its unit is called first and last.
    pub fn root(mut self, prefix: &str, root: impl RootModule + 'static) -> Self {
        self.root = Some((prefix.to_string(), Box::new(root)));
        self
    }

    /// Appends a top-level child `name` (its own unit until [`ModuleNet::wrap`]).
    pub fn push(self, name: &str, module: impl Module + 'static) -> Self {
        self.push_boxed(name, Box::new(module))
    }

    /// Appends a boxed top-level child.
    pub fn push_boxed(self, name: &str, module: Box<dyn Module>) -> Self {
        self.push_unit(name, name, module)
    }

    /// Appends a top-level child whose parameters are named `prefix.<param>` (no prefix
    /// when empty: torchvision's ResNet has `conv1.weight` and `fc.weight` at the top) and
    /// whose unit, while it is one of its own, is called `label`.
    pub fn push_unit(mut self, label: &str, prefix: &str, module: Box<dyn Module>) -> Self {
        let i = self.body.len();
        self.body.push((prefix.to_string(), module));
        self.labels.push(label.to_string());
        self.units.push(i..i + 1);
        self
    }

    /// Regroups the top-level children into units (NET-2).
    pub fn wrap(mut self, policy: WrapPolicy) -> Self {
        let n = self.body.len();
        self.units = match policy {
            WrapPolicy::ByBlock => (0..n).map(|i| i..i + 1).collect(),
            WrapPolicy::ByParams(min) => {
                let mut units = Vec::new();
                let (mut start, mut acc) = (0, 0);
                for (i, (_, m)) in self.body.iter().enumerate() {
                    acc += numel(&m.params());
                    if acc >= min || i + 1 == n {
                        units.push(start..i + 1);
                        start = i + 1;
                        acc = 0;
                    }
                }
                units
            }
        };
        self
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn root_offset(&self) -> usize {
        usize::from(self.root.is_some())
    }

    /// The body units' children, or `None` for the root's unit.
    fn body_unit(&self, unit: usize) -> Result<Option<Range<usize>>, ModelError> {
        if self.root.is_some() && unit == 0 {
            return Ok(None);
        }
        self.units
            .get(unit - self.root_offset())
            .cloned()
            .map(Some)
            .ok_or_else(|| ModelError::Config(format!("{}: no unit {unit}", self.name)))
    }

    fn unit_params(&self, unit: usize, buffers: bool) -> Result<Vec<Param>, ModelError> {
        Ok(match self.body_unit(unit)? {
            None => match (&self.root, buffers) {
                (Some((prefix, r)), false) => {
                    r.params().into_iter().map(|p| p.prefixed(prefix)).collect()
                }
                _ => Vec::new(),
            },
            Some(r) => self.body[r]
                .iter()
                .flat_map(|(n, m)| {
                    let ps = if buffers { m.buffers() } else { m.params() };
                    ps.into_iter().map(move |p| p.prefixed(n))
                })
                .collect(),
        })
    }

    fn unit_name(&self, unit: usize) -> Result<String, ModelError> {
        Ok(match self.body_unit(unit)? {
            None => self
                .root
                .as_ref()
                .map(|(p, _)| p.clone())
                .filter(|p| !p.is_empty())
                .unwrap_or_else(|| "root".into()),
            Some(r) if r.len() == 1 => self.labels[r.start].clone(),
            Some(r) => format!("{}..{}", self.labels[r.start], self.labels[r.end - 1]),
        })
    }

    /// The role of call `call`: the root's entry, its exit, or a body unit.
    fn call_unit(&self, call: usize) -> (usize, Role) {
        let n = self.units.len();
        match &self.root {
            Some(_) if call == 0 => (0, Role::RootIn),
            Some(_) if call == n + 1 => (0, Role::RootOut),
            Some(_) => (call, Role::Body),
            None => (call, Role::Body),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    RootIn,
    RootOut,
    Body,
}

fn spec_of(params: Vec<Param>) -> Vec<ParamSpec> {
    params.into_iter().map(|p| p.spec).collect()
}

impl Network for ModuleNet {
    fn spec(&self) -> ModelSpec {
        let units = (0..self.root_offset() + self.units.len())
            .map(|u| UnitSpec {
                name: self.unit_name(u).unwrap_or_default(),
                params: spec_of(self.unit_params(u, false).unwrap_or_default()),
                buffers: spec_of(self.unit_params(u, true).unwrap_or_default()),
            })
            .collect();
        ModelSpec { name: self.name.clone(), units }
    }

    fn calls(&self) -> Vec<usize> {
        let body = self.root_offset()..self.root_offset() + self.units.len();
        match self.root {
            Some(_) => std::iter::once(0).chain(body).chain(std::iter::once(0)).collect(),
            None => body.collect(),
        }
    }

    fn init_params(&self, unit: usize, seed: u64) -> Result<Vec<f32>, ModelError> {
        Ok(init_values(&self.unit_params(unit, false)?, seed))
    }

    fn init_buffers(&self, unit: usize) -> Result<Vec<f32>, ModelError> {
        Ok(init_values(&self.unit_params(unit, true)?, 0))
    }

    fn forward_call(
        &self,
        call: usize,
        params: &[f32],
        buffers: &mut [f32],
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let (unit, role) = self.call_unit(call);
        let p = Params::new(params);
        let root = self.root.as_ref().map(|(_, r)| r);
        match (role, root) {
            (Role::RootIn, Some(r)) => r.forward_in(p, x, ctx),
            (Role::RootOut, Some(r)) => r.forward_out(p, x, ctx),
            _ => {
                let r = self.body_unit(unit)?.unwrap_or(0..0);
                forward_children(&self.body[r], p, Buffers::new(buffers), x, ctx)
            }
        }
    }

    fn backward_call(
        &self,
        call: usize,
        b: CallBackward<'_>,
        ctx: &Ctx,
    ) -> Result<InputGrad, ModelError> {
        let (unit, role) = self.call_unit(call);
        if ctx.overwrite_grads {
            b.grads_out.fill(0.0); // NET-1: the modules add.
        }
        let p = Params::new(b.params);
        let g = Grads::new(b.grads_out);
        let root = self.root.as_ref().map(|(_, r)| r);
        match (role, root) {
            (Role::RootIn, Some(r)) => {
                r.backward_in(p, b.saved, b.grad_output, g, ctx)?;
                Ok(InputGrad::Skipped)
            }
            (Role::RootOut, Some(r)) => {
                Ok(InputGrad::Ready(r.backward_out(p, b.saved, b.grad_output, g, ctx)?))
            }
            _ => {
                let r = self.body_unit(unit)?.unwrap_or(0..0);
                let dy = backward_children(&self.body[r], p, b.saved, b.grad_output, g, ctx)?;
                Ok(if b.input_grad { InputGrad::Ready(dy) } else { InputGrad::Skipped })
            }
        }
    }

    fn loss(&self) -> &dyn Loss {
        &*self.loss
    }

    fn lower_call(
        &self,
        call: usize,
        input: &[usize],
        ctx: &LowerCtx,
    ) -> Result<Program, ModelError> {
        let (unit, role) = self.call_unit(call);
        let mut l = Lowering::new(*ctx);
        let x = l.input(input);
        let root = self.root.as_ref().map(|(_, r)| r);
        let (out, input_grad) = match (role, root) {
            (Role::RootIn, Some(r)) => (r.lower_in(&mut l, x)?, false),
            (Role::RootOut, Some(r)) => (r.lower_out(&mut l, x)?, true),
            _ => {
                let r = self.body_unit(unit)?.unwrap_or(0..0);
                (lower_children(&self.body[r], &mut l, 0, x)?, call > 0)
            }
        };
        l.finish(out, input_grad)
    }
}
