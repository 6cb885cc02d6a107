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
use crate::batchnorm::{
    batchnorm_backward_fused, batchnorm_forward_fused, fused_results, BatchNorm, BnBackward,
    BnForward, BnSaved, StatsReducer,
};
use crate::conv::{Conv2d, ConvSaved};
use crate::error::ModelError;
use crate::layers::{self, Linear, LinearSaved, MaxPool2d, MaxPoolSaved, ReluSaved, ShapeSaved};
use crate::loss::softmax_cross_entropy;
use crate::rng::SplitMix64;
use crate::spec::{ModelSpec, ParamSpec, UnitSpec};
use crate::tensor::Tensor;

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

fn effective_bn(bn: &BatchNorm, ctx: &Ctx<'_>) -> BatchNorm {
    BatchNorm { sync: bn.sync || ctx.sync_bn, ..bn.clone() }
}

fn run_layer(
    block: &Block,
    node: &Node,
    p: &[f32],
    buf: &mut [f32],
    x: Tensor,
    ctx: &Ctx<'_>,
) -> Result<(Tensor, Option<LayerSaved>), ModelError> {
    let be = ctx.backend;
    Ok(match &node.layer {
        Layer::Linear(l) => {
            let (y, s) = l.forward(be, p, x)?;
            (y, Some(LayerSaved::Linear(s)))
        }
        Layer::Conv2d(c) => {
            let (y, s) = c.forward(be, p, x)?;
            (y, Some(LayerSaved::Conv(s)))
        }
        Layer::BatchNorm(bn) => {
            let name = format!("{}.{}", block.name, node.name);
            let bn = effective_bn(bn, ctx);
            let out = batchnorm_forward_fused(
                vec![BnForward { name: &name, layer: &bn, params: p, buffers: buf, input: x }],
                ctx.training,
                ctx.reducer,
            )?;
            let [(y, s)] = fused_results("batchnorm forward", out)?;
            (y, Some(LayerSaved::Bn(s)))
        }
        Layer::Relu => {
            let (y, s) = layers::relu_forward(be, x)?;
            (y, Some(LayerSaved::Relu(s)))
        }
        Layer::MaxPool2d(m) => {
            let (y, s) = m.forward(x)?;
            (y, Some(LayerSaved::MaxPool(s)))
        }
        Layer::GlobalAvgPool => {
            let (y, s) = layers::global_avg_pool_forward(x)?;
            (y, Some(LayerSaved::Shape(s)))
        }
        Layer::Flatten => {
            let (y, s) = layers::flatten_forward(x)?;
            (y, Some(LayerSaved::Shape(s)))
        }
    })
}

fn back_layer(
    node: &Node,
    p: &[f32],
    saved: &LayerSaved,
    g: Tensor,
    grads: &mut [f32],
    ctx: &Ctx<'_>,
) -> Result<Tensor, ModelError> {
    let be = ctx.backend;
    if ctx.overwrite_grads && !matches!(node.layer, Layer::Linear(_)) {
        // Only the linear layer writes in place of adding (its weight gradient is one
        // matrix multiply); for the others a zeroed region is the same thing.
        grads.fill(0.0);
    }
    match (&node.layer, saved) {
        (Layer::Linear(l), LayerSaved::Linear(s)) => {
            l.backward_into(be, p, s, &g, grads, !ctx.overwrite_grads)
        }
        (Layer::Conv2d(c), LayerSaved::Conv(s)) => c.backward(be, p, s, &g, grads),
        (Layer::BatchNorm(bn), LayerSaved::Bn(s)) => {
            let bn = effective_bn(bn, ctx);
            bn.backward(p, s, &g, grads, ctx.reducer)
        }
        (Layer::Relu, LayerSaved::Relu(s)) => layers::relu_backward(be, s, g),
        (Layer::MaxPool2d(m), LayerSaved::MaxPool(s)) => m.backward(s, &g),
        (Layer::GlobalAvgPool, LayerSaved::Shape(s)) => layers::global_avg_pool_backward(s, &g),
        (Layer::Flatten, LayerSaved::Shape(s)) => layers::flatten_backward(s, g),
        _ => Err(ModelError::Config(format!("saved state does not match layer {}", node.name))),
    }
}

fn last_bn(nodes: &[Node]) -> Option<usize> {
    nodes.iter().rposition(|n| matches!(n.layer, Layer::BatchNorm(_)))
}

/// One path of a block (main, shortcut or post): its nodes, and where its node 0 sits among
/// the block's nodes (the index into [`Offsets`]).
#[derive(Clone, Copy)]
struct Path<'a> {
    nodes: &'a [Node],
    base: usize,
}

impl<'a> Path<'a> {
    fn main(b: &'a Block) -> Self {
        Path { nodes: &b.main, base: 0 }
    }
    fn shortcut(b: &'a Block) -> Self {
        Path { nodes: b.shortcut.as_deref().unwrap_or(&[]), base: b.main.len() }
    }
    fn post(b: &'a Block) -> Self {
        let ns = b.shortcut.as_ref().map_or(0, Vec::len);
        Path { nodes: &b.post, base: b.main.len() + ns }
    }
}

/// One block's forward: the block, where its layers' parameters and buffers lie, the unit's
/// buffers it updates, and the call's context.
struct BlockRun<'a, 'c> {
    block: &'a Block,
    off: &'a Offsets,
    params: &'a [f32],
    buffers: &'a mut [f32],
    ctx: &'a Ctx<'c>,
}

impl BlockRun<'_, '_> {
    /// Runs `path.nodes[range]`, saving each layer's state into `saved` (the path's).
    fn path(
        &mut self,
        path: Path<'_>,
        range: Range<usize>,
        mut x: Tensor,
        saved: &mut [Option<LayerSaved>],
    ) -> Result<Tensor, ModelError> {
        for i in range {
            let k = path.base + i;
            let (y, s) = run_layer(
                self.block,
                &path.nodes[i],
                &self.params[self.off.params[k].clone()],
                &mut self.buffers[self.off.buffers[k].clone()],
                x,
                self.ctx,
            )?;
            saved[i] = s;
            x = y;
        }
        Ok(x)
    }

    fn forward(mut self, x: Tensor) -> Result<(Tensor, BlockSaved), ModelError> {
        let (block, off, ctx) = (self.block, self.off, self.ctx);
        let (main, sc, post) = (Path::main(block), Path::shortcut(block), Path::post(block));
        let (nm, ns) = (main.nodes.len(), sc.nodes.len());
        let mut s = BlockSaved {
            main: vec![None; nm],
            shortcut: vec![None; ns],
            post: vec![None; block.post.len()],
            fused: None,
        };
        let sc_input = block.shortcut.as_ref().map(|_| x.clone());
        let fuse = match (last_bn(main.nodes), last_bn(sc.nodes)) {
            (Some(i), Some(j)) if ctx.training => Some((i, j)),
            _ => None,
        };
        let y = match (fuse, sc_input) {
            (Some((i, j)), Some(xs)) => {
                let a = self.path(main, 0..i, x, &mut s.main)?;
                let b = self.path(sc, 0..j, xs, &mut s.shortcut)?;
                let (ka, kb) = (i, nm + j);
                let (bn_a, bn_b) = match (&main.nodes[i].layer, &sc.nodes[j].layer) {
                    (Layer::BatchNorm(p), Layer::BatchNorm(q)) => {
                        (effective_bn(p, ctx), effective_bn(q, ctx))
                    }
                    _ => return Err(ModelError::Config("fusion points are not BatchNorm".into())),
                };
                let (na, nb) = (
                    format!("{}.{}", block.name, main.nodes[i].name),
                    format!("{}.{}", block.name, sc.nodes[j].name),
                );
                // The two BN layers' buffers are disjoint ranges of the unit's buffer.
                let (ra, rb) = (off.buffers[ka].clone(), off.buffers[kb].clone());
                let (lo, hi) = self.buffers.split_at_mut(rb.start);
                let out = batchnorm_forward_fused(
                    vec![
                        BnForward {
                            name: &na,
                            layer: &bn_a,
                            params: &self.params[off.params[ka].clone()],
                            buffers: &mut lo[ra],
                            input: a,
                        },
                        BnForward {
                            name: &nb,
                            layer: &bn_b,
                            params: &self.params[off.params[kb].clone()],
                            buffers: &mut hi[..rb.len()],
                            input: b,
                        },
                    ],
                    true,
                    ctx.reducer,
                )?;
                let [(ya, sa), (yb, sb)] = fused_results("fused batchnorm forward", out)?;
                s.main[i] = Some(LayerSaved::Bn(sa));
                s.shortcut[j] = Some(LayerSaved::Bn(sb));
                s.fused = Some((i, j));
                let a = self.path(main, i + 1..nm, ya, &mut s.main)?;
                let b = self.path(sc, j + 1..ns, yb, &mut s.shortcut)?;
                layers::add_forward(ctx.backend, a, &b)?
            }
            (_, Some(xs)) => {
                let a = self.path(main, 0..nm, x, &mut s.main)?;
                let b = self.path(sc, 0..ns, xs, &mut s.shortcut)?;
                layers::add_forward(ctx.backend, a, &b)?
            }
            (_, None) => self.path(main, 0..nm, x, &mut s.main)?,
        };
        let y = self.path(post, 0..block.post.len(), y, &mut s.post)?;
        Ok((y, s))
    }
}

/// One block's backward: where its layers' parameters lie, the unit's gradients it writes,
/// and the call's context.
struct BlockBack<'a, 'c> {
    off: &'a Offsets,
    params: &'a [f32],
    grads: &'a mut [f32],
    ctx: &'a Ctx<'c>,
}

impl BlockBack<'_, '_> {
    /// Backward through `path.nodes[range]` in reverse, from the path's saved states.
    fn path(
        &mut self,
        path: Path<'_>,
        range: Range<usize>,
        saved: &[Option<LayerSaved>],
        mut g: Tensor,
    ) -> Result<Tensor, ModelError> {
        for i in range.rev() {
            let k = path.base + i;
            let node = &path.nodes[i];
            let s = saved[i]
                .as_ref()
                .ok_or_else(|| ModelError::Config(format!("no saved state for {}", node.name)))?;
            let r = self.off.params[k].clone();
            g = back_layer(node, &self.params[r.clone()], s, g, &mut self.grads[r], self.ctx)?;
        }
        Ok(g)
    }

    fn block(&mut self, block: &Block, s: &BlockSaved, g: Tensor) -> Result<Tensor, ModelError> {
        let (off, params, ctx) = (self.off, self.params, self.ctx);
        let (main, sc, post) = (Path::main(block), Path::shortcut(block), Path::post(block));
        let (nm, ns) = (main.nodes.len(), sc.nodes.len());
        let g = self.path(post, 0..block.post.len(), &s.post, g)?;
        if block.shortcut.is_none() {
            return self.path(main, 0..nm, &s.main, g);
        }
        let (ga, gb) = layers::add_backward(&g);
        let (mut ga, gb) = match s.fused {
            Some((i, j)) => {
                let ga = self.path(main, i + 1..nm, &s.main, ga)?;
                let gb = self.path(sc, j + 1..ns, &s.shortcut, gb)?;
                let (ka, kb) = (i, nm + j);
                let (bn_a, bn_b) = match (&main.nodes[i].layer, &sc.nodes[j].layer) {
                    (Layer::BatchNorm(p), Layer::BatchNorm(q)) => {
                        (effective_bn(p, ctx), effective_bn(q, ctx))
                    }
                    _ => return Err(ModelError::Config("fusion points are not BatchNorm".into())),
                };
                let (sa, sb) = match (&s.main[i], &s.shortcut[j]) {
                    (Some(LayerSaved::Bn(a)), Some(LayerSaved::Bn(b))) => (a, b),
                    _ => return Err(ModelError::Config("fused BatchNorm state missing".into())),
                };
                let (ra, rb) = (off.params[ka].clone(), off.params[kb].clone());
                if ctx.overwrite_grads {
                    self.grads[ra.clone()].fill(0.0);
                    self.grads[rb.clone()].fill(0.0);
                }
                let (lo, hi) = self.grads.split_at_mut(rb.start);
                let out = batchnorm_backward_fused(
                    vec![
                        BnBackward {
                            layer: &bn_a,
                            params: &params[ra.clone()],
                            saved: sa,
                            grad_output: &ga,
                            grads_out: &mut lo[ra],
                        },
                        BnBackward {
                            layer: &bn_b,
                            params: &params[rb.clone()],
                            saved: sb,
                            grad_output: &gb,
                            grads_out: &mut hi[..rb.len()],
                        },
                    ],
                    ctx.reducer,
                )?;
                let [ga, gb] = fused_results("fused batchnorm backward", out)?;
                (self.path(main, 0..i, &s.main, ga)?, self.path(sc, 0..j, &s.shortcut, gb)?)
            }
            None => (self.path(main, 0..nm, &s.main, ga)?, self.path(sc, 0..ns, &s.shortcut, gb)?),
        };
        ctx.backend.axpy(1.0, gb.as_f32()?, ga.as_f32_mut()?)?;
        Ok(ga)
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // index loops over parallel arrays read best here
mod tests {
    use super::*;
    use crate::testing::{run_ranks, thread_reducers, CountingReducer};
    use crate::testutil::rand_tensor;
    use crate::zoo::{ConvNetBn, MlpBn, WideMlp};
    use crate::Cpu;
    use std::time::Duration;

    fn ctx<'a>(
        be: &'a Cpu,
        training: bool,
        reducer: Option<&'a dyn StatsReducer>,
        gb: usize,
    ) -> Ctx<'a> {
        Ctx { sync_bn: false, reducer, ..Ctx::new(be, training, gb) }
    }

    fn init(m: &Model, seed: u64) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let p = (0..m.num_units()).map(|u| m.init_params(u, seed).unwrap()).collect();
        let b = (0..m.num_units()).map(|u| m.init_buffers(u).unwrap()).collect();
        (p, b)
    }

    /// Full model forward + backward (training mode, batch statistics, cross-entropy)
    /// against central finite differences of every parameter and input value.
    fn model_gradcheck(m: &Model, batch: usize, seed: u64) {
        let be = Cpu::new();
        let (params, buffers) = init(m, seed);
        let mut shape = vec![batch];
        shape.extend_from_slice(&m.input_shape);
        let x = rand_tensor(&shape, seed + 1);
        let labels: Vec<u32> = (0..batch).map(|i| (i % m.classes) as u32).collect();
        let c = ctx(&be, true, None, batch);
        let loss = |p: &[Vec<f32>], x: Tensor| -> f64 {
            let mut b = buffers.clone();
            let (logits, _) = m.forward(p, &mut b, x, &c).unwrap();
            let k = m.classes;
            // f64 cross-entropy so that the difference quotient is not drowned in rounding
            (0..batch)
                .map(|i| {
                    let row: Vec<f64> = logits.as_f32().unwrap()[i * k..(i + 1) * k]
                        .iter()
                        .map(|&v| v as f64)
                        .collect();
                    let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = row.iter().map(|v| (v - mx).exp()).sum();
                    z.ln() + mx - row[labels[i] as usize]
                })
                .sum::<f64>()
                / batch as f64
        };
        let (_, grads) =
            m.loss_and_grads(&params, &mut buffers.clone(), x.clone(), &labels, &c).unwrap();
        let (logits, saved) = m.forward(&params, &mut buffers.clone(), x.clone(), &c).unwrap();
        let (_, gl) = softmax_cross_entropy(&logits, &labels, batch).unwrap();
        // input gradient through a second backward that keeps the input gradient
        let mut g = gl;
        let mut scratch: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        for u in (0..m.num_units()).rev() {
            g = m.backward_unit(u, &params[u], &saved[u], g, &mut scratch[u], &c).unwrap();
        }
        assert_eq!(scratch, grads, "backward is deterministic");
        // Ctx::overwrite_grads: written over whatever the buffer held (NaN here), the same.
        let cw = ctx(&be, true, None, batch).with_overwrite_grads(true);
        let mut g = softmax_cross_entropy(&logits, &labels, batch).unwrap().1;
        let mut stale: Vec<Vec<f32>> = params.iter().map(|p| vec![f32::NAN; p.len()]).collect();
        for u in (0..m.num_units()).rev() {
            g = m.backward_unit(u, &params[u], &saved[u], g, &mut stale[u], &cw).unwrap();
        }
        assert_eq!(stale, grads, "overwriting backward differs from adding into zeros");
        let eps = 1e-3f32;
        let close = |num: f64, ana: f32, what: String| {
            assert!(
                (num - ana as f64).abs() <= 3e-3 + 2e-2 * (ana as f64).abs(),
                "{what}: numeric {num} vs analytical {ana}"
            );
        };
        for u in 0..params.len() {
            for i in 0..params[u].len() {
                let mut p = params.clone();
                p[u][i] += eps;
                let up = loss(&p, x.clone());
                p[u][i] -= 2.0 * eps;
                let down = loss(&p, x.clone());
                close(
                    (up - down) / (2.0 * eps as f64),
                    grads[u][i],
                    format!("{} unit {u} param {i}", m.name),
                );
            }
        }
        for i in 0..x.numel() {
            let mut xp = x.clone();
            xp.as_f32_mut().unwrap()[i] += eps;
            let up = loss(&params, xp.clone());
            xp.as_f32_mut().unwrap()[i] -= 2.0 * eps;
            let down = loss(&params, xp);
            close(
                (up - down) / (2.0 * eps as f64),
                g.as_f32().unwrap()[i],
                format!("{} input {i}", m.name),
            );
        }
    }

    #[test]
    fn mlp_bn_gradients_match_finite_differences() {
        model_gradcheck(&MlpBn { input_dim: 3, hidden: 4, depth: 2, classes: 3 }.build(), 5, 1);
    }

    #[test]
    fn convnet_bn_gradients_match_finite_differences() {
        let m = ConvNetBn { input: [1, 4, 4], widths: vec![2, 3], classes: 3 }.build().unwrap();
        model_gradcheck(&m, 3, 2);
    }

    /// MODEL-4: the split backward gives bitwise the gradients and input gradients of
    /// `backward_unit`, defers exactly where a unit starts with a linear layer, and skipping
    /// the input gradient changes no parameter gradient.
    #[test]
    fn split_backward_matches_backward_unit() {
        let be = Cpu::new();
        let models = [
            (MlpBn { input_dim: 5, hidden: 6, depth: 3, classes: 4 }.build(), true),
            (
                MlpBn { input_dim: 5, hidden: 6, depth: 3, classes: 4 }
                    .build()
                    .wrap(WrapPolicy::ByParams(60)),
                true,
            ),
            (
                ConvNetBn { input: [1, 4, 4], widths: vec![2, 3], classes: 3 }.build().unwrap(),
                false,
            ),
        ];
        for (m, linear_first) in &models {
            assert!(m.num_units() >= 2, "{}: one unit tests nothing", m.name);
            let (params, buffers) = init(m, 7);
            let batch = 6;
            let mut shape = vec![batch];
            shape.extend_from_slice(&m.input_shape);
            let x = rand_tensor(&shape, 8);
            let labels: Vec<u32> = (0..batch).map(|i| (i % m.classes) as u32).collect();
            for overwrite in [false, true] {
                let c = ctx(&be, true, None, batch).with_overwrite_grads(overwrite);
                let (logits, saved) =
                    m.forward(&params, &mut buffers.clone(), x.clone(), &c).unwrap();
                let gl = softmax_cross_entropy(&logits, &labels, batch).unwrap().1;
                let fresh = || -> Vec<Vec<f32>> {
                    params
                        .iter()
                        .map(|p| vec![if overwrite { f32::NAN } else { 0.0 }; p.len()])
                        .collect()
                };
                let (mut want, mut got, mut skipped) = (fresh(), fresh(), fresh());
                let (mut gw, mut gg, mut gs) = (gl.clone(), gl.clone(), gl);
                for u in (0..m.num_units()).rev() {
                    let p = &params[u];
                    gw = m.backward_unit(u, p, &saved[u], gw, &mut want[u], &c).unwrap();
                    let call = |grad_output, grads_out, input_grad| UnitBackward {
                        unit: u,
                        params: p,
                        saved: &saved[u],
                        grad_output,
                        grads_out,
                        input_grad,
                    };
                    let split = m.backward_unit_split(call(gg, &mut got[u], true), &c).unwrap();
                    // Every MLP unit starts with a linear layer; the conv net's units start
                    // with a convolution (its head with pooling).
                    assert_eq!(split.is_deferred(), *linear_first, "{} unit {u}", m.name);
                    gg = split.finish(&be, p).unwrap().expect("asked for");
                    assert_eq!(gg, gw, "{} unit {u}: input gradient", m.name);
                    let skip = m.backward_unit_split(call(gs, &mut skipped[u], u > 0), &c).unwrap();
                    if u == 0 {
                        assert!(matches!(skip, InputGrad::Skipped), "{}", m.name);
                        gs = Tensor::default();
                    } else {
                        gs = skip.finish(&be, p).unwrap().expect("asked for");
                    }
                }
                assert_eq!(got, want, "{} overwrite {overwrite}: split gradients", m.name);
                assert_eq!(skipped, want, "{} overwrite {overwrite}: skipped input", m.name);
                assert!(want.iter().flatten().all(|v| v.is_finite()));
            }
        }
    }

    #[test]
    fn names_are_stable_and_independent_of_wrapping() {
        // MODEL-1
        let m = ConvNetBn::digits().build().unwrap();
        let spec = m.spec();
        let names: Vec<String> =
            spec.units.iter().flat_map(|u| u.params.iter().map(|p| p.name.clone())).collect();
        assert_eq!(names[0], "stem.conv.weight");
        assert!(names.contains(&"blocks.1.downsample.bn.weight".to_string()));
        assert!(names.contains(&"head.fc.bias".to_string()));
        let bufs: Vec<String> =
            spec.units.iter().flat_map(|u| u.buffers.iter().map(|p| p.name.clone())).collect();
        assert!(bufs.contains(&"blocks.0.bn1.running_mean".to_string()));
        assert!(bufs.contains(&"stem.bn.num_batches_tracked".to_string()));
        let mlp = MlpBn::digits().build();
        let s = mlp.spec();
        assert_eq!(s.units[0].name, "blocks.0");
        assert_eq!(
            s.units[0].params.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            [
                "blocks.0.linear.weight",
                "blocks.0.linear.bias",
                "blocks.0.bn.weight",
                "blocks.0.bn.bias"
            ]
        );
        assert_eq!(s.units[0].buffers[0].name, "blocks.0.bn.running_mean");
        // the same names and values under another wrap policy
        let merged = m.clone().wrap(WrapPolicy::ByParams(6000));
        assert!(merged.num_units() < m.num_units());
        let mn: Vec<String> = merged
            .spec()
            .units
            .iter()
            .flat_map(|u| u.params.iter().map(|p| p.name.clone()))
            .collect();
        assert_eq!(mn, names);
        let a: Vec<f32> = (0..m.num_units()).flat_map(|u| m.init_params(u, 7).unwrap()).collect();
        let b: Vec<f32> =
            (0..merged.num_units()).flat_map(|u| merged.init_params(u, 7).unwrap()).collect();
        assert_eq!(a, b);
        assert_eq!(m.spec().numel(), m.num_params());
        assert_ne!(
            a,
            (0..m.num_units()).flat_map(|u| m.init_params(u, 8).unwrap()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn init_follows_pytorch_bounds() {
        let m = MlpBn { input_dim: 100, hidden: 50, depth: 1, classes: 10 }.build();
        let p = m.init_params(0, 3).unwrap();
        let bound = 0.1f32;
        assert!(p[..5050].iter().all(|v| v.abs() <= bound));
        assert!(p[..5000].iter().any(|v| v.abs() > 0.09));
        assert!(p[5050..5100].iter().all(|&v| v == 1.0) && p[5100..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn wide_mlp_is_sized_by_parameter_count() {
        // MODEL-3: a 50M-parameter spec without parameter memory
        let w = WideMlp::with_params(50_000_000);
        let m = w.build();
        assert_eq!(m.spec().numel(), w.num_params());
        assert!((w.num_params() as f64 - 5e7).abs() / 5e7 < 0.01);
        assert_eq!(m.spec().units[0].params[0].name, "blocks.0.linear.weight");
        let small = WideMlp::with_params(100_000);
        assert!((small.num_params() as f64 - 1e5).abs() / 1e5 < 0.2);
    }

    fn slice_rows(x: &Tensor, a: usize, b: usize) -> Tensor {
        let per: usize = x.shape()[1..].iter().product();
        let mut shape = x.shape().to_vec();
        shape[0] = b - a;
        Tensor::new(shape, x.as_f32().unwrap()[a * per..b * per].to_vec()).unwrap()
    }

    #[test]
    fn sync_convnet_on_uneven_ranks_equals_single_process() {
        // BN-1 at model level, LOSS-1, MODEL-2 (fused messages counted)
        let mut m = ConvNetBn { input: [1, 6, 6], widths: vec![3, 4], classes: 4 }.build().unwrap();
        let sizes = [3usize, 0, 4, 1];
        let total: usize = sizes.iter().sum();
        let x = rand_tensor(&[total, 1, 6, 6], 5);
        let labels: Vec<u32> = (0..total).map(|i| (i % 4) as u32).collect();
        let be = Cpu::new();
        let (params, buffers) = init(&m, 4);
        let mut want_buf = buffers.clone();
        let (want_loss, want_grads) = m
            .loss_and_grads(
                &params,
                &mut want_buf,
                x.clone(),
                &labels,
                &ctx(&be, true, None, total),
            )
            .unwrap();
        assert!(m.has_local_batchnorm());
        let converted = convert_sync_batchnorm(&mut m);
        assert_eq!(converted, 6);
        assert!(!m.has_local_batchnorm());
        let reducers = thread_reducers(sizes.len(), Duration::from_secs(30));
        let starts: Vec<usize> = sizes
            .iter()
            .scan(0, |s, &n| {
                *s += n;
                Some(*s - n)
            })
            .collect();
        let res = run_ranks(sizes.len(), |r| {
            let counter = CountingReducer::new(&reducers[r]);
            let mut b = buffers.clone();
            let xr = slice_rows(&x, starts[r], starts[r] + sizes[r]);
            let c = ctx(&be, true, Some(&counter), total);
            let out = m
                .loss_and_grads(&params, &mut b, xr, &labels[starts[r]..starts[r] + sizes[r]], &c)
                .unwrap();
            (out, b, counter.messages())
        });
        let loss: f32 = res.iter().map(|r| r.0 .0).sum();
        assert!((loss - want_loss).abs() < 1e-5);
        for u in 0..params.len() {
            for i in 0..params[u].len() {
                let g: f32 = res.iter().map(|r| r.0 .1[u][i]).sum();
                assert!(
                    (g - want_grads[u][i]).abs() < 1e-4 + 1e-3 * want_grads[u][i].abs(),
                    "unit {u} param {i}: {g} vs {}",
                    want_grads[u][i]
                );
            }
        }
        for r in &res {
            for (a, b) in r.1.iter().flatten().zip(want_buf.iter().flatten()) {
                assert!((a - b).abs() < 1e-5);
            }
            // stem 1 + block0 2 (bn1, bn2 with identity shortcut) + block1 2 (bn1, fused bn2+downsample.bn), each way
            assert_eq!(r.2, 10, "stats messages per step");
        }
        // ctx.sync_bn converts on the fly: an unconverted model gives the same messages
        let plain = ConvNetBn { input: [1, 6, 6], widths: vec![3, 4], classes: 4 }.build().unwrap();
        let res2 = run_ranks(sizes.len(), |r| {
            let counter = CountingReducer::new(&reducers[r]);
            let mut b = buffers.clone();
            let xr = slice_rows(&x, starts[r], starts[r] + sizes[r]);
            let c = Ctx { sync_bn: true, ..ctx(&be, true, Some(&counter), total) };
            let out = plain
                .loss_and_grads(&params, &mut b, xr, &labels[starts[r]..starts[r] + sizes[r]], &c)
                .unwrap();
            (out.0, counter.messages())
        });
        assert!((res2.iter().map(|r| r.0).sum::<f32>() - want_loss).abs() < 1e-5);
        assert!(res2.iter().all(|r| r.1 == 10));
    }

    #[test]
    fn eval_mode_sends_no_messages() {
        let mut m = MlpBn { input_dim: 4, hidden: 5, depth: 2, classes: 3 }.build();
        convert_sync_batchnorm(&mut m);
        let (params, mut buffers) = init(&m, 1);
        let be = Cpu::new();
        let reducers = thread_reducers(1, Duration::from_secs(5));
        let counter = CountingReducer::new(&reducers[0]);
        let (y, _) = m
            .forward(
                &params,
                &mut buffers,
                rand_tensor(&[1, 4], 2),
                &ctx(&be, false, Some(&counter), 1),
            )
            .unwrap();
        assert_eq!(y.shape(), vec![1, 3]);
        assert_eq!(counter.messages(), 0);
    }

    /// SGD with momentum over the digits train split; returns the test accuracy.
    fn train_digits(m: &Model, image: bool, epochs: u64, batch: usize, lr: f32) -> f64 {
        let data = crate::data::Dataset::digits(image).unwrap();
        let (train, test) = data.split(0.2, 0);
        let (mut params, mut buffers) = init(m, 0);
        let be = Cpu::new();
        let sampler = crate::data::DistributedSampler::new(train.len(), 1, batch, 0, true).unwrap();
        let mut mom: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        for epoch in 0..epochs {
            for (gb, idx) in sampler.rank_batches(epoch, 0) {
                if gb < 2 {
                    continue;
                }
                let (x, y) = train.batch(&idx);
                let (_, grads) = m
                    .loss_and_grads(&params, &mut buffers, x, &y, &ctx(&be, true, None, gb))
                    .unwrap();
                for u in 0..params.len() {
                    for i in 0..params[u].len() {
                        mom[u][i] = 0.9 * mom[u][i] + grads[u][i];
                        params[u][i] -= lr * mom[u][i];
                    }
                }
            }
        }
        let idx: Vec<usize> = (0..test.len()).collect();
        let (x, y) = test.batch(&idx);
        let (logits, _) =
            m.forward(&params, &mut buffers, x, &ctx(&be, false, None, test.len())).unwrap();
        crate::loss::correct_count(&logits, &y).unwrap() as f64 / test.len() as f64
    }

    #[test]
    fn convnet_bn_learns_digits() {
        let acc = train_digits(&ConvNetBn::digits().build().unwrap(), true, 4, 32, 0.05);
        assert!(acc >= 0.9, "test accuracy {acc}");
    }

    #[test]
    fn mlp_bn_learns_digits() {
        // the default digits configuration reaches >= 95% test accuracy
        let acc = train_digits(&MlpBn::digits().build(), false, 15, 32, 0.05);
        assert!(acc >= 0.95, "test accuracy {acc}");
    }
}
