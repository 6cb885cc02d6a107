//! Models as sequences of units, and the model zoo.
//!
//! A [`Model`] is a list of blocks (a small layer graph: a main path, an optional residual
//! shortcut, layers after the residual add); an auto-wrap policy ([`WrapPolicy`]) groups
//! consecutive blocks into units, the FSDP wrapping granularity. A unit's parameters are one
//! flat buffer (its [`UnitSpec`] order) and its BatchNorm buffers another.
//!
//! Invariants:
//! - `MODEL-1`: parameter names are stable (`blocks.0.linear.weight`) and do not depend on
//!   the wrap policy; neither do the initial values ([`Model::init_params`] draws each block
//!   from a stream derived from the seed and the block's name).
//! - `MODEL-2`: a block's main-path BN and shortcut BN reduce their statistics in one
//!   message (forward and backward), so a residual block with SyncBN sends 2 forward
//!   messages (one for the first BN, one fused) instead of 3.
//! - `MODEL-3`: building a spec allocates no parameter memory.
//! - `MODEL-4`: [`Model::backward_unit_split`] gives bitwise the parameter and input gradients
//!   of [`Model::backward_unit`] (the same products, in another order).

use std::ops::Range;

use crate::backend::Backend;
use crate::batchnorm::{BatchNorm, BnSaved, StatsReducer};
use crate::conv::{Conv2d, ConvSaved};
use crate::error::ModelError;
use crate::layers::{self, Linear, LinearSaved, MaxPool2d, MaxPoolSaved, ReluSaved, ShapeSaved};
use crate::loss::softmax_cross_entropy;
use crate::rng::SplitMix64;
use crate::spec::{ModelSpec, ParamSpec, UnitSpec};
use crate::tensor::Tensor;

mod block;
#[cfg(test)]
mod tests;

use block::{BlockBack, BlockRun, Path};

/// One layer operation.
#[derive(Clone, Debug, PartialEq)]
pub enum Layer {
    /// Fully connected.
    Linear(Linear),
    /// 2-d convolution.
    Conv2d(Conv2d),
    /// BatchNorm (1-d or 2-d; `sync` for SyncBatchNorm).
    BatchNorm(BatchNorm),
    /// ReLU.
    Relu,
    /// Max pooling.
    MaxPool2d(MaxPool2d),
    /// Global average pooling `[N, C, H, W] -> [N, C]`.
    GlobalAvgPool,
    /// `[N, ...] -> [N, prod]`.
    Flatten,
}

impl Layer {
    fn param_specs(&self) -> Vec<ParamSpec> {
        match self {
            Layer::Linear(l) => l.param_specs(),
            Layer::Conv2d(c) => c.param_specs(),
            Layer::BatchNorm(b) => b.param_specs(),
            _ => Vec::new(),
        }
    }
    fn buffer_specs(&self) -> Vec<ParamSpec> {
        match self {
            Layer::BatchNorm(b) => b.buffer_specs(),
            _ => Vec::new(),
        }
    }
    pub(crate) fn num_params(&self) -> usize {
        match self {
            Layer::Linear(l) => l.num_params(),
            Layer::Conv2d(c) => c.num_params(),
            Layer::BatchNorm(b) => b.num_params(),
            _ => 0,
        }
    }
    pub(crate) fn num_buffers(&self) -> usize {
        match self {
            Layer::BatchNorm(b) => b.num_buffers(),
            _ => 0,
        }
    }
    /// PyTorch's defaults: kaiming-uniform(a = sqrt 5) weights, i.e. U(-1/sqrt(fan_in),
    /// 1/sqrt(fan_in)), the same bound for biases; BatchNorm weight 1, bias 0.
    fn init_params(&self, rng: &mut SplitMix64, out: &mut Vec<f32>) {
        let (weights, biases, fan_in) = match self {
            Layer::Linear(l) => (
                l.out_features * l.in_features,
                if l.bias { l.out_features } else { 0 },
                l.in_features,
            ),
            Layer::Conv2d(c) => (
                c.out_channels * c.in_channels * c.kernel * c.kernel,
                if c.bias { c.out_channels } else { 0 },
                c.in_channels * c.kernel * c.kernel,
            ),
            Layer::BatchNorm(b) => {
                out.extend(b.init_params());
                return;
            }
            _ => return,
        };
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        out.extend((0..weights + biases).map(|_| rng.uniform(-bound, bound)));
    }
}

/// A named layer inside a block (`linear`, `bn`, `downsample.conv` ...).
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Name relative to the block.
    pub name: String,
    /// The operation.
    pub layer: Layer,
}

/// A small layer graph: `post(main(x) + shortcut(x))`, or `post(main(x))` without a
/// residual. An empty shortcut is the identity.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// Stable name (`blocks.0`, `stem`, `head`).
    pub name: String,
    /// Main path.
    pub main: Vec<Node>,
    /// Residual shortcut; `Some(vec![])` is the identity.
    pub shortcut: Option<Vec<Node>>,
    /// After the residual add (e.g. ReLU).
    pub post: Vec<Node>,
}

impl Block {
    fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.main.iter().chain(self.shortcut.iter().flatten()).chain(self.post.iter())
    }
    fn nodes_mut(&mut self) -> impl Iterator<Item = &mut Node> {
        self.main.iter_mut().chain(self.shortcut.iter_mut().flatten()).chain(self.post.iter_mut())
    }
    fn num_params(&self) -> usize {
        self.nodes().map(|n| n.layer.num_params()).sum()
    }
    fn num_buffers(&self) -> usize {
        self.nodes().map(|n| n.layer.num_buffers()).sum()
    }
}

/// How blocks are grouped into units (the FSDP wrapping granularity).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrapPolicy {
    /// One unit per block.
    ByBlock,
    /// Consecutive blocks are merged until a unit holds at least this many parameters.
    ByParams(usize),
}

/// Per-call context of a unit's forward and backward.
pub struct Ctx<'a> {
    /// Training (batch statistics, running stats updated) or eval (running statistics).
    pub training: bool,
    /// Treat every BatchNorm as SyncBatchNorm (the runtime's `sync_bn = true`), whether or
    /// not the model was converted with [`convert_sync_batchnorm`].
    pub sync_bn: bool,
    /// Statistics reducer across the data-parallel group (None: a single rank). The runtime's
    /// counts and traces its messages; its failures arrive as [`ModelError::Stats`].
    pub reducer: Option<&'a dyn StatsReducer>,
    /// Samples in the global batch (all ranks), for the loss (LOSS-1).
    pub global_batch: usize,
    /// Compute backend.
    pub backend: &'a dyn Backend,
    /// Backward writes the unit's parameter gradients into `grads_out` instead of adding
    /// them (LAYER-1), so the caller need not zero the buffer first: for a gradient buffer
    /// that is fresh every step. Off: gradients are added.
    pub overwrite_grads: bool,
    /// The run's seed (dropout masks, DROP-1).
    pub seed: u64,
    /// The step being computed, 1-based (dropout masks).
    pub step: u64,
    /// Global index of the first sample of this rank's slice of the batch (dropout masks).
    pub first_sample: usize,
}

impl<'a> Ctx<'a> {
    /// A single-rank context (no reducer, `sync_bn` off, gradients added).
    pub fn new(backend: &'a dyn Backend, training: bool, global_batch: usize) -> Self {
        Ctx {
            training,
            sync_bn: false,
            reducer: None,
            global_batch,
            backend,
            overwrite_grads: false,
            seed: 0,
            step: 0,
            first_sample: 0,
        }
    }
    /// With a statistics reducer across the data-parallel group.
    pub fn with_reducer(mut self, reducer: &'a dyn StatsReducer) -> Self {
        self.reducer = Some(reducer);
        self
    }
    /// With every BatchNorm treated as SyncBatchNorm.
    pub fn with_sync_bn(mut self, sync_bn: bool) -> Self {
        self.sync_bn = sync_bn;
        self
    }
    /// With backward writing parameter gradients instead of adding them
    /// ([`Ctx::overwrite_grads`]).
    pub fn with_overwrite_grads(mut self, overwrite: bool) -> Self {
        self.overwrite_grads = overwrite;
        self
    }
}

/// What a layer's backward needs.
#[derive(Clone, Debug)]
enum LayerSaved {
    Linear(LinearSaved),
    Conv(ConvSaved),
    Bn(BnSaved),
    Relu(ReluSaved),
    MaxPool(MaxPoolSaved),
    Shape(ShapeSaved),
}

#[derive(Clone, Debug)]
struct BlockSaved {
    main: Vec<Option<LayerSaved>>,
    shortcut: Vec<Option<LayerSaved>>,
    post: Vec<Option<LayerSaved>>,
    /// Indices of the main-path and shortcut BN that were run fused (MODEL-2).
    fused: Option<(usize, usize)>,
}

/// What [`Model::backward_unit`] needs from [`Model::forward_unit`].
#[derive(Clone, Debug)]
pub struct UnitSaved {
    blocks: Vec<BlockSaved>,
}

/// A model: blocks, and their grouping into units.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    /// Zoo name (`mlp-bn`, `convnet-bn`, `wide-mlp`).
    pub name: String,
    /// Shape of one input sample (`[784]`, `[1, 8, 8]`).
    pub input_shape: Vec<usize>,
    /// Output classes.
    pub classes: usize,
    blocks: Vec<Block>,
    units: Vec<Range<usize>>,
}

struct Offsets {
    params: Vec<Range<usize>>,
    buffers: Vec<Range<usize>>,
}

fn block_stream(name: &str) -> u64 {
    // FNV-1a: a stable stream id per block name (MODEL-1).
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// What [`Model::backward_unit_split`] leaves of a unit's input gradient.
#[derive(Debug)]
pub enum InputGrad {
    /// Computed with the rest of the backward.
    Ready(Tensor),
    /// The unit's first layer is linear; its `dX = dY W` is still to do
    /// ([`InputGrad::finish`]).
    Deferred {
        /// The layer.
        layer: Linear,
        /// Where its parameters lie in the unit's flat buffer.
        params: Range<usize>,
        /// `dY`, the gradient of its output.
        grad_output: Tensor,
    },
    /// Not asked for (and, where it could be left out, not computed).
    Skipped,
}

impl InputGrad {
    /// The input gradient, computing a deferred one from the unit's parameters (the same
    /// buffer its backward was given); `None` when skipped.
    pub fn finish(self, be: &dyn Backend, params: &[f32]) -> Result<Option<Tensor>, ModelError> {
        match self {
            InputGrad::Ready(g) => Ok(Some(g)),
            InputGrad::Skipped => Ok(None),
            InputGrad::Deferred { layer, params: r, grad_output } => {
                let p = params.get(r.clone()).ok_or_else(|| {
                    ModelError::shape(
                        "unit params",
                        format!(">= {}", r.end),
                        params.len().to_string(),
                    )
                })?;
                layer.input_grad(be, p, &grad_output).map(Some)
            }
        }
    }

    /// Whether work is left for [`InputGrad::finish`].
    pub fn is_deferred(&self) -> bool {
        matches!(self, InputGrad::Deferred { .. })
    }
}

/// One unit's backward, as [`Model::backward_unit_split`] takes it: what it reads and what
/// it writes.
pub struct UnitBackward<'a> {
    /// The unit.
    pub unit: usize,
    /// The unit's flat parameters (spec order).
    pub params: &'a [f32],
    /// What the unit's forward saved.
    pub saved: &'a UnitSaved,
    /// Gradient of the unit's output.
    pub grad_output: Tensor,
    /// The unit's parameter gradients (spec order), added or written as
    /// [`Ctx::overwrite_grads`] says.
    pub grads_out: &'a mut [f32],
    /// Whether the input gradient is wanted; false for the model's first unit, whose input
    /// is data.
    pub input_grad: bool,
}

impl Model {
    /// A model from blocks, one unit per block.
    pub fn new(name: &str, input_shape: Vec<usize>, classes: usize, blocks: Vec<Block>) -> Self {
        let units = (0..blocks.len()).map(|i| i..i + 1).collect();
        Model { name: name.to_string(), input_shape, classes, blocks, units }
    }

    /// Regroups the blocks into units.
    pub fn wrap(mut self, policy: WrapPolicy) -> Self {
        self.units = match policy {
            WrapPolicy::ByBlock => (0..self.blocks.len()).map(|i| i..i + 1).collect(),
            WrapPolicy::ByParams(min) => {
                let mut units = Vec::new();
                let (mut start, mut acc) = (0, 0);
                for (i, b) in self.blocks.iter().enumerate() {
                    acc += b.num_params();
                    if acc >= min.max(1) {
                        units.push(start..i + 1);
                        start = i + 1;
                        acc = 0;
                    }
                }
                if start < self.blocks.len() {
                    units.push(start..self.blocks.len());
                }
                units
            }
        };
        self
    }

    /// The blocks in forward order.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// Number of units.
    pub fn num_units(&self) -> usize {
        self.units.len()
    }

    pub(crate) fn unit_blocks(&self, unit: usize) -> Result<&[Block], ModelError> {
        let r = self
            .units
            .get(unit)
            .ok_or_else(|| ModelError::Config(format!("unit {unit} of {}", self.units.len())))?;
        Ok(&self.blocks[r.clone()])
    }

    /// Unit name: its block's name, or `first+last` for merged blocks.
    pub fn unit_name(&self, unit: usize) -> String {
        match self.units.get(unit) {
            Some(r) if r.len() == 1 => self.blocks[r.start].name.clone(),
            Some(r) => format!("{}+{}", self.blocks[r.start].name, self.blocks[r.end - 1].name),
            None => String::new(),
        }
    }

    /// Names, shapes and grouping of every parameter and buffer (MODEL-1, MODEL-3).
    pub fn spec(&self) -> ModelSpec {
        let units = (0..self.units.len())
            .map(|u| {
                let blocks = &self.blocks[self.units[u].clone()];
                let mut params = Vec::new();
                let mut buffers = Vec::new();
                for b in blocks {
                    for n in b.nodes() {
                        let full = |s: ParamSpec| ParamSpec {
                            name: format!("{}.{}.{}", b.name, n.name, s.name),
                            shape: s.shape,
                        };
                        params.extend(n.layer.param_specs().into_iter().map(full));
                        buffers.extend(n.layer.buffer_specs().into_iter().map(full));
                    }
                }
                UnitSpec { name: self.unit_name(u), params, buffers }
            })
            .collect();
        ModelSpec { name: self.name.clone(), units }
    }

    /// Trainable parameters of the whole model.
    pub fn num_params(&self) -> usize {
        self.blocks.iter().map(Block::num_params).sum()
    }

    /// Deterministic initial parameters of a unit, in spec order (MODEL-1).
    pub fn init_params(&self, unit: usize, seed: u64) -> Result<Vec<f32>, ModelError> {
        let blocks = self.unit_blocks(unit)?;
        let mut out = Vec::with_capacity(blocks.iter().map(Block::num_params).sum());
        for b in blocks {
            let mut rng = SplitMix64::derive(seed, block_stream(&b.name));
            for n in b.nodes() {
                n.layer.init_params(&mut rng, &mut out);
            }
        }
        Ok(out)
    }

    /// Initial buffers of a unit (BatchNorm: mean 0, var 1, 0 batches).
    pub fn init_buffers(&self, unit: usize) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::new();
        for b in self.unit_blocks(unit)? {
            for n in b.nodes() {
                if let Layer::BatchNorm(bn) = &n.layer {
                    out.extend(bn.init_buffers());
                }
            }
        }
        Ok(out)
    }

    fn offsets(block: &Block, p0: usize, b0: usize) -> Offsets {
        let (mut p, mut b) = (p0, b0);
        let mut o = Offsets { params: Vec::new(), buffers: Vec::new() };
        for n in block.nodes() {
            o.params.push(p..p + n.layer.num_params());
            o.buffers.push(b..b + n.layer.num_buffers());
            p += n.layer.num_params();
            b += n.layer.num_buffers();
        }
        o
    }

    /// Forward of one unit: `params` is the unit's flat parameter buffer (spec order),
    /// `buffers` its BatchNorm buffers (updated in training mode).
    pub fn forward_unit(
        &self,
        unit: usize,
        params: &[f32],
        buffers: &mut [f32],
        input: Tensor,
        ctx: &Ctx<'_>,
    ) -> Result<(Tensor, UnitSaved), ModelError> {
        let blocks = self.unit_blocks(unit)?;
        let (np, nb): (usize, usize) = (
            blocks.iter().map(Block::num_params).sum(),
            blocks.iter().map(Block::num_buffers).sum(),
        );
        layers::check_len(&format!("unit {unit} params"), params.len(), np)?;
        layers::check_len(&format!("unit {unit} buffers"), buffers.len(), nb)?;
        let mut x = input;
        let mut saved = Vec::with_capacity(blocks.len());
        let (mut p0, mut b0) = (0, 0);
        for b in blocks {
            let off = Self::offsets(b, p0, b0);
            let (y, s) =
                BlockRun { block: b, off: &off, params, buffers: &mut *buffers, ctx }.forward(x)?;
            x = y;
            saved.push(s);
            p0 += b.num_params();
            b0 += b.num_buffers();
        }
        Ok((x, UnitSaved { blocks: saved }))
    }

    /// Backward of one unit: ADDS parameter gradients into `grads_out` (spec order) and
    /// returns the input gradient.
    pub fn backward_unit(
        &self,
        unit: usize,
        params: &[f32],
        saved: &UnitSaved,
        grad_output: Tensor,
        grads_out: &mut [f32],
        ctx: &Ctx<'_>,
    ) -> Result<Tensor, ModelError> {
        let call = UnitBackward { unit, params, saved, grad_output, grads_out, input_grad: true };
        let g = self.backward_unit_split(call, ctx)?;
        g.finish(ctx.backend, params)?
            .ok_or_else(|| ModelError::Config("input gradient asked for but skipped".into()))
    }

    /// [`Model::backward_unit`] that returns as soon as the unit's parameter gradients are
    /// complete (MODEL-4). Where the unit's first layer is linear, its input gradient
    /// `dX = dY W` (as much work as its weight gradient) is left in the returned
    /// [`InputGrad`], so that a caller can hand the gradients to their reduction before
    /// computing it; [`UnitBackward::input_grad`] false (the model's first unit, whose input is
    /// data) skips that product altogether. Gradients and input gradient are bitwise those of
    /// `backward_unit`: the same products, only in another order.
    pub fn backward_unit_split(
        &self,
        call: UnitBackward<'_>,
        ctx: &Ctx<'_>,
    ) -> Result<InputGrad, ModelError> {
        let UnitBackward { unit, params, saved, grad_output, grads_out, input_grad } = call;
        let blocks = self.unit_blocks(unit)?;
        let np: usize = blocks.iter().map(Block::num_params).sum();
        layers::check_len(&format!("unit {unit} grads"), grads_out.len(), np)?;
        layers::check_len(&format!("unit {unit} saved blocks"), saved.blocks.len(), blocks.len())?;
        let mut starts = Vec::with_capacity(blocks.len());
        let (mut p0, mut b0) = (0, 0);
        for b in blocks {
            starts.push((p0, b0));
            p0 += b.num_params();
            b0 += b.num_buffers();
        }
        // The first block's first layer, when it is linear and nothing bypasses it: its
        // input gradient is the one that can wait.
        let split = match (blocks.first(), saved.blocks.first()) {
            (Some(b), Some(s)) if b.shortcut.is_none() => match (b.main.first(), s.main.first()) {
                (
                    Some(Node { layer: Layer::Linear(l), .. }),
                    Some(Some(LayerSaved::Linear(ls))),
                ) => Some((b, s, l, ls)),
                _ => None,
            },
            _ => None,
        };
        let mut g = grad_output;
        for (i, b) in blocks.iter().enumerate().skip(usize::from(split.is_some())).rev() {
            let off = Self::offsets(b, starts[i].0, starts[i].1);
            let mut back = BlockBack { off: &off, params, grads: &mut *grads_out, ctx };
            g = back.block(b, &saved.blocks[i], g)?;
        }
        let Some((b, s, l, ls)) = split else {
            return Ok(if input_grad { InputGrad::Ready(g) } else { InputGrad::Skipped });
        };
        let off = Self::offsets(b, starts[0].0, starts[0].1);
        // The block's layers after the linear one, then the linear layer's parameter half.
        let mut back = BlockBack { off: &off, params, grads: &mut *grads_out, ctx };
        let g = back.path(Path::post(b), 0..b.post.len(), &s.post, g)?;
        let g = back.path(Path::main(b), 1..b.main.len(), &s.main, g)?;
        let r = off.params[0].clone();
        l.backward_params(ctx.backend, ls, &g, &mut grads_out[r.clone()], !ctx.overwrite_grads)?;
        Ok(if input_grad {
            InputGrad::Deferred { layer: l.clone(), params: r, grad_output: g }
        } else {
            InputGrad::Skipped
        })
    }

    /// Forward of every unit in turn (a single-process convenience).
    pub fn forward(
        &self,
        params: &[Vec<f32>],
        buffers: &mut [Vec<f32>],
        input: Tensor,
        ctx: &Ctx<'_>,
    ) -> Result<(Tensor, Vec<UnitSaved>), ModelError> {
        let mut x = input;
        let mut saved = Vec::with_capacity(self.units.len());
        for u in 0..self.units.len() {
            let (y, s) = self.forward_unit(u, &params[u], &mut buffers[u], x, ctx)?;
            x = y;
            saved.push(s);
        }
        Ok((x, saved))
    }

    /// Backward of every unit in reverse; returns per-unit gradients (fresh buffers).
    pub fn backward(
        &self,
        params: &[Vec<f32>],
        saved: &[UnitSaved],
        grad_output: Tensor,
        ctx: &Ctx<'_>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        let mut g = grad_output;
        for u in (0..self.units.len()).rev() {
            g = self.backward_unit(u, &params[u], &saved[u], g, &mut grads[u], ctx)?;
        }
        Ok(grads)
    }

    /// One training step's loss and gradients on this rank's slice (forward, softmax
    /// cross-entropy over `ctx.global_batch`, backward).
    pub fn loss_and_grads(
        &self,
        params: &[Vec<f32>],
        buffers: &mut [Vec<f32>],
        input: Tensor,
        labels: &[u32],
        ctx: &Ctx<'_>,
    ) -> Result<(f32, Vec<Vec<f32>>), ModelError> {
        let (logits, saved) = self.forward(params, buffers, input, ctx)?;
        let (loss, g) = softmax_cross_entropy(&logits, labels, ctx.global_batch)?;
        Ok((loss, self.backward(params, &saved, g, ctx)?))
    }

    /// Whether any BatchNorm layer computes per-rank statistics (for the runtime's warning
    /// when world > 1).
    pub fn has_local_batchnorm(&self) -> bool {
        self.blocks
            .iter()
            .flat_map(|b| b.nodes())
            .any(|n| matches!(&n.layer, Layer::BatchNorm(bn) if !bn.sync))
    }
}

/// Converts every BatchNorm of the model into a SyncBatchNorm; returns how many.
pub fn convert_sync_batchnorm(model: &mut Model) -> usize {
    let mut n = 0;
    for b in model.blocks.iter_mut() {
        for node in b.nodes_mut() {
            if let Layer::BatchNorm(bn) = &mut node.layer {
                bn.sync = true;
                n += 1;
            }
        }
    }
    n
}
