//! A model Shardline does not ship, defined with its public Module API only, and trained at
//! any ZeRO stage by its runtime ([`job`]).
//!
//! The model is a pre-norm decoder in the style of LLaMA: each block is
//! `x + attn(rmsnorm(x))`, then `x + mlp(rmsnorm(x))` with a SiLU-gated MLP
//! ([`GatedMlp`], a module written here), between a root ([`TiedEmbedding`]) that embeds
//! the tokens and, at the end, normalises and projects back onto the vocabulary with the
//! same table. Built-in layers (attention, RMSNorm, Linear) and the module written here
//! compose alike; the engine sees only units of parameters, one per block plus the root.

pub mod embedding;
pub mod gated_mlp;
pub mod job;

pub use embedding::TiedEmbedding;
pub use gated_mlp::GatedMlp;

use shardline_models::module::{
    CausalSelfAttention, Init, Residual, RmsNorm, Sequential, TokenCrossEntropy,
};
use shardline_models::{ModelError, ModuleNet};

/// The model's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Token ids are below this.
    pub vocab: usize,
    /// Longest context, in tokens.
    pub block: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads (dividing `dim`).
    pub heads: usize,
    /// Width of the residual stream.
    pub dim: usize,
    /// Width of the gated MLP.
    pub hidden: usize,
}

impl ModelConfig {
    /// A small model over a byte vocabulary (the bundled corpus): 2 blocks of width 64.
    pub fn small() -> Self {
        ModelConfig { vocab: 256, block: 32, layers: 2, heads: 4, dim: 64, hidden: 172 }
    }
}

/// Initial std of embeddings and projections (GPT-2's).
const STD: f32 = 0.02;

/// Block `i`'s modules: pre-norm attention and gated MLP, each inside a residual.
pub fn block(cfg: &ModelConfig) -> Result<Sequential, ModelError> {
    let (w, zero) = (Init::Normal(STD), Init::Zeros);
    // The projections into the residual stream start smaller as blocks are added, so the
    // stream's variance at init does not grow with depth (GPT-2).
    let out = Init::Normal(STD / ((2 * cfg.layers) as f32).sqrt());
    let mut attn = CausalSelfAttention::new(cfg.dim, cfg.heads, false)?;
    attn.c_attn = attn.c_attn.with_init(w, zero);
    attn.c_proj = attn.c_proj.with_init(out, zero);
    let mut mlp = GatedMlp::new(cfg.dim, cfg.hidden);
    mlp.w1 = mlp.w1.with_init(w, zero);
    mlp.w2 = mlp.w2.with_init(out, zero);
    mlp.w3 = mlp.w3.with_init(w, zero);
    let norm = || RmsNorm::new(cfg.dim, 1e-5);
    Ok(Sequential::new()
        .push("", Residual::new(Sequential::new().push("attn_norm", norm()).push("attn", attn)))
        .push("", Residual::new(Sequential::new().push("mlp_norm", norm()).push("mlp", mlp))))
}

/// The model of `cfg`, scored by next-token cross-entropy: the root unit `tok` and one unit
/// per block `layers.<i>`.
pub fn model(cfg: &ModelConfig) -> Result<ModuleNet, ModelError> {
    if cfg.heads == 0 || cfg.layers == 0 || cfg.block == 0 || !cfg.dim.is_multiple_of(cfg.heads) {
        return Err(ModelError::Config(format!("unusable model sizes: {cfg:?}")));
    }
    let root = TiedEmbedding::new(cfg.vocab, cfg.dim, cfg.block, STD);
    let mut net = ModuleNet::new("custom-model", TokenCrossEntropy).root("tok", root);
    for i in 0..cfg.layers {
        net = net.push(&format!("layers.{i}"), block(cfg)?);
    }
    Ok(net)
}
