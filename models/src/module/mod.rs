//! The public Module API: how to write a layer or a model that Shardline can shard and train.
//!
//! # Writing a module
//! A [`Module`] is a unit of computation with named parameters ([`Module::params`]: name,
//! shape, initialisation, torch's names) and, optionally, non-trainable buffers
//! ([`Module::buffers`], e.g. BatchNorm's running statistics). It owns no parameter memory:
//! - [`Module::forward`] gets a view of its parameters ([`Params`], laid out as its
//!   `params()` in order), its buffers ([`Buffers`]), the input [`Tensor`] and the call's
//!   [`Ctx`] (backend, training or eval, step, the rank's place in the global batch). It
//!   returns the output and a [`Saved`] value: whatever backward needs, explicitly.
//! - [`Module::backward`] gets the same parameters, what forward saved, and the gradient of
//!   the output; it ADDS the parameter gradients into [`Grads`] (laid out as the parameters)
//!   and returns the gradient of the input (MODULE-2).
//!
//! Both are pure functions of their arguments over the backend in the context: no global
//! state, no I/O. Tensors carry their element type and placement, so a module asks for the
//! view it computes on ([`Tensor::as_f32`]) and a tensor it cannot use is an error, not a
//! misread.
//!
//! ```
//! use shardline_models::module::{Buffers, Grads, Init, Module, Param, Params, Saved};
//! use shardline_models::{Ctx, ModelError, Tensor};
//!
//! /// `y = x * scale` with one learned scale per feature.
//! #[derive(Debug)]
//! struct Scale(usize);
//!
//! impl Module for Scale {
//!     fn params(&self) -> Vec<Param> {
//!         vec![Param::new("scale", vec![self.0], Init::Ones)]
//!     }
//!     fn forward(&self, p: Params<'_>, _: Buffers<'_>, x: Tensor, _: &Ctx) -> Result<(Tensor, Saved), ModelError> {
//!         let s = p.f32()?;
//!         let y: Vec<f32> = x.as_f32()?.chunks_exact(self.0).flat_map(|r| r.iter().zip(s).map(|(a, b)| a * b)).collect();
//!         Ok((Tensor::new(x.shape().to_vec(), y)?, Box::new(x)))
//!     }
//!     fn backward(&self, p: Params<'_>, saved: Saved, dy: Tensor, mut g: Grads<'_>, _: &Ctx) -> Result<Tensor, ModelError> {
//!         let x = *saved.downcast::<Tensor>().map_err(|_| ModelError::Config("Scale: saved".into()))?;
//!         let (s, gs) = (p.f32()?, g.f32_mut()?);
//!         let dyv = dy.as_f32()?;
//!         for (xr, dr) in x.as_f32()?.chunks_exact(self.0).zip(dyv.chunks_exact(self.0)) {
//!             for j in 0..self.0 { gs[j] += xr[j] * dr[j]; }
//!         }
//!         let dx: Vec<f32> = dyv.chunks_exact(self.0).flat_map(|r| r.iter().zip(s).map(|(a, b)| a * b)).collect();
//!         Tensor::new(dy.shape().to_vec(), dx)
//!     }
//! }
//! # let m = Scale(3);
//! # assert_eq!(m.params()[0].spec.shape, vec![3]);
//! ```
//!
//! # Composing and training
//! [`Sequential`] runs named children in order (a child's parameter names are prefixed with
//! its name, as torch's `nn.Sequential` and attribute names do); [`Residual`] computes
//! `x + f(x)`, or `f(x) + shortcut(x)` (a ResNet block's `downsample`). A model is a
//! [`ModuleNet`](crate::network::ModuleNet): top-level children cut
//! into sharding units by a [`WrapPolicy`](crate::WrapPolicy) (per child, or by parameter
//! count, as FSDP wraps submodules), an optional [`RootModule`] whose parameters are used
//! before and after the body (a tied embedding and output head), and a [`Loss`]. The
//! engine shards, gathers and reduces by unit and never looks inside a module, so a model
//! defined in another crate trains at every ZeRO stage: `examples/custom-model` defines one
//! (a pre-norm transformer with a gated MLP module of its own) and trains it with
//! `shardline_runtime::train::run_network`.
//!
//! Invariants:
//! - `MODULE-1`: a parameter's initial value depends only on the seed and its full name,
//!   never on the wrap policy or on the other parameters.
//! - `MODULE-2`: backward ADDS parameter gradients (a parameter used twice, as a tied
//!   embedding, sums both uses) and every built-in module's backward is the exact derivative
//!   of its forward (f64 finite differences through the kernels of [`crate::nn`], and the
//!   module tests below).
//! - `MODULE-3`: a composite's parameter list is its children's, in order, each name
//!   prefixed with the child's name; the views a child gets are exactly its own slice.

mod compose;
pub(crate) use compose::{backward_children, forward_children, lower_children};
pub mod gpt;
mod layers;
mod loss;
pub mod resnet;
mod view;

pub use compose::{Residual, Sequential};
pub use gpt::GptRoot;
pub use layers::{
    Activation, CausalSelfAttention, Dropout, Embedding, Flatten, GlobalAvgPool, LayerNorm, Linear,
    Relu, RmsNorm,
};
pub use loss::{ClassCrossEntropy, Loss, Mse, TokenCrossEntropy};
pub use view::{Buffers, Grads, Params};

use std::any::Any;

use crate::error::ModelError;
use crate::lower::{Lowering, Val};
use crate::model::Ctx;
use crate::rng::SplitMix64;
use crate::spec::ParamSpec;
use crate::tensor::Tensor;

/// What a module's forward keeps for its backward: any value, owned.
pub type Saved = Box<dyn Any + Send>;

/// How a parameter or buffer starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Uniform in `[-bound, bound]` (torch's Linear/Conv default is `1/sqrt(fan_in)`).
    Uniform(f32),
    /// Normal with mean 0 and this standard deviation (nanoGPT: 0.02).
    Normal(f32),
}

impl Init {
    /// Fills `out` from `rng`.
    pub fn fill(self, rng: &mut SplitMix64, out: &mut [f32]) {
        match self {
            Init::Zeros => out.fill(0.0),
            Init::Ones => out.fill(1.0),
            Init::Uniform(b) => out.iter_mut().for_each(|v| *v = rng.uniform(-b, b)),
            Init::Normal(s) => out.iter_mut().for_each(|v| *v = rng.normal() * s),
        }
    }
}

/// A named parameter or buffer of a module: its spec (name relative to the module, shape)
/// and how it starts.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// Name and shape.
    pub spec: ParamSpec,
    /// Initial value.
    pub init: Init,
}

impl Param {
    /// A parameter `name` of `shape`, started by `init`.
    pub fn new(name: &str, shape: Vec<usize>, init: Init) -> Self {
        Param { spec: ParamSpec { name: name.to_string(), shape }, init }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.spec.numel()
    }

    /// The same parameter under `prefix.` (MODULE-3); an empty prefix leaves it.
    pub fn prefixed(mut self, prefix: &str) -> Self {
        if !prefix.is_empty() {
            self.spec.name = format!("{prefix}.{}", self.spec.name);
        }
        self
    }
}

/// Total elements of a parameter list.
pub fn numel(params: &[Param]) -> usize {
    params.iter().map(Param::numel).sum()
}

/// FNV-1a of a name: the stream a parameter's initial values are drawn from (MODULE-1).
pub(crate) fn name_stream(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Initial values of `params` in order, each from the seed and its full name (MODULE-1).
pub fn init_values(params: &[Param], seed: u64) -> Vec<f32> {
    let mut out = vec![0.0; numel(params)];
    let mut at = 0;
    for p in params {
        let mut rng = SplitMix64::derive(seed, name_stream(&p.spec.name));
        p.init.fill(&mut rng, &mut out[at..at + p.numel()]);
        at += p.numel();
    }
    out
}

/// A unit of computation with named parameters; see the [module docs](self).
pub trait Module: Send + Sync + std::fmt::Debug {
    /// Trainable parameters, in the order of the flat view [`Module::forward`] gets.
    fn params(&self) -> Vec<Param>;

    /// Non-trainable state (running statistics), replicated on every rank.
    fn buffers(&self) -> Vec<Param> {
        Vec::new()
    }

    /// The output of `x`, and what backward needs.
    fn forward(
        &self,
        p: Params<'_>,
        b: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError>;

    /// The gradient of the input from the gradient of the output `dy`; ADDS the parameter
    /// gradients into `g` (MODULE-2).
    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError>;

    /// Emits this module's forward over `x` as device ops into `l`, its parameters at
    /// `at..` of the unit's, and pushes its backward onto the lowering's tape
    /// ([`crate::lower`]); returns the output. The default refuses (LOWER-3): such a
    /// module runs as host code.
    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        let _ = (l, at, x);
        Err(Lowering::unlowered(std::any::type_name::<Self>()))
    }
}

/// The root of a model whose parameters are used both before and after the body: a token
/// embedding that is also the output head (nanoGPT's tied `lm_head`). Its parameters form
/// one unit, gathered for both uses (FSDP2 keeps tied parameters in one unit too); both
/// uses' gradients are summed into it before it is reduced.
pub trait RootModule: Send + Sync + std::fmt::Debug {
    /// Trainable parameters of the root (both uses' view).
    fn params(&self) -> Vec<Param>;

    /// Before the body: the model's input to the body's input.
    fn forward_in(
        &self,
        p: Params<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError>;

    /// Gradient of [`RootModule::forward_in`]; the model's input gets none.
    fn backward_in(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<(), ModelError>;

    /// After the body: the body's output to the model's output.
    fn forward_out(
        &self,
        p: Params<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError>;

    /// Gradient of [`RootModule::forward_out`]: the body output's gradient.
    fn backward_out(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError>;

    /// [`RootModule::forward_in`] as device ops ([`Module::lower`]); the model's input gets
    /// no gradient. The default refuses (LOWER-3).
    fn lower_in(&self, l: &mut Lowering, x: Val) -> Result<Val, ModelError> {
        let _ = (l, x);
        Err(Lowering::unlowered(std::any::type_name::<Self>()))
    }

    /// [`RootModule::forward_out`] as device ops. The default refuses (LOWER-3).
    fn lower_out(&self, l: &mut Lowering, x: Val) -> Result<Val, ModelError> {
        let _ = (l, x);
        Err(Lowering::unlowered(std::any::type_name::<Self>()))
    }
}

/// Takes back a saved value of type `T`; another type is a caller bug reported as an error.
pub fn unsave<T: 'static>(saved: Saved, what: &str) -> Result<T, ModelError> {
    saved.downcast::<T>().map(|b| *b).map_err(|_| {
        ModelError::Config(format!("{what}: backward got another module's saved state"))
    })
}
