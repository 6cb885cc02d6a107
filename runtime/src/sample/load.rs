//! A `gpt` checkpoint as a decoder: its [`GptConfig`] and flat parameter buffer.
//!
//! Checkpoints of `gpt` runs record the configuration in the manifest's `extra` map
//! ([`GPT_CONFIG_KEY`]). Older ones do not: every size but `n_head` is read off the
//! parameter shapes, and `n_head` must then be given.

use shardline_models::nn::GptConfig;

use crate::checkpoint::{Checkpoint, Manifest, MANIFEST};
use crate::error::{Result, RuntimeError};
use crate::shard::FlatLayout;
use crate::train::GPT_CONFIG_KEY;

/// A decoder ready to run: its configuration and its parameters in GPT-1 order.
pub struct Decoder {
    /// The configuration the run trained.
    pub config: GptConfig,
    /// The flat parameter buffer ([`GptConfig::param_specs`] order).
    pub params: Vec<f32>,
    /// The optimizer step of the checkpoint.
    pub step: u64,
}

/// Opens the checkpoint at `path` (a `step-N` directory, or a root meaning its newest),
/// verifies its files and rebuilds the decoder. `n_head` is needed only for checkpoints that
/// do not record their configuration; one that does must agree with it.
pub fn load_decoder(path: &std::path::Path, n_head: Option<usize>) -> Result<Decoder> {
    let ck = Checkpoint::open(path)?;
    ck.verify()?;
    let m = ck.manifest();
    let mpath = ck.dir().join(MANIFEST);
    if m.model.name != "gpt" {
        return Err(RuntimeError::checkpoint(
            &mpath,
            format!("a checkpoint of model '{}'; sampling needs a gpt checkpoint", m.model.name),
        ));
    }
    let config = config_of(m, n_head).map_err(|d| RuntimeError::checkpoint(&mpath, d))?;
    let units = ck.consolidate()?;
    let mut named: Vec<(String, &[f32])> = Vec::new();
    for (u, spec) in units.iter().zip(&m.model.units) {
        let layout = FlatLayout::new(spec, 1)?;
        for (slot, view) in layout.params().iter().zip(layout.views(&u.params)) {
            named.push((slot.name.clone(), view));
        }
    }
    let params = config
        .flatten(|name| named.iter().find(|(n, _)| n == name).map(|(_, v)| *v))
        .map_err(|e| RuntimeError::checkpoint(&mpath, e.to_string()))?;
    Ok(Decoder { config, params, step: m.step })
}

/// The recorded configuration, or the one the shapes and `n_head` give.
fn config_of(m: &Manifest, n_head: Option<usize>) -> std::result::Result<GptConfig, String> {
    if let Some(v) = m.extra.get(GPT_CONFIG_KEY) {
        let g: GptConfig = serde_json::from_value(v.clone())
            .map_err(|e| format!("extra.{GPT_CONFIG_KEY}: {e}"))?;
        return match n_head {
            Some(h) if h != g.n_head => Err(format!(
                "--n-head {h} disagrees with the recorded n_head {} (omit --n-head)",
                g.n_head
            )),
            _ => Ok(g),
        };
    }
    let n_head = n_head.ok_or(
        "records no model configuration (written before it was recorded); give --n-head, \
         the one the run used"
            .to_string(),
    )?;
    let shape = |name: &str| {
        m.model
            .units
            .iter()
            .flat_map(|u| &u.params)
            .find(|p| p.name == name)
            .map(|p| p.shape.clone())
            .ok_or(format!("no parameter {name}"))
    };
    let wte = shape("transformer.wte.weight")?;
    let wpe = shape("transformer.wpe.weight")?;
    let (&[vocab_size, n_embd], &[block_size, _]) = (wte.as_slice(), wpe.as_slice()) else {
        return Err("transformer.wte.weight and transformer.wpe.weight must be matrices".into());
    };
    // Units may group blocks (--wrap-params): count blocks by their first parameter.
    let n_layer = m
        .model
        .units
        .iter()
        .flat_map(|u| &u.params)
        .filter(|p| p.name.starts_with("transformer.h.") && p.name.ends_with(".ln_1.weight"))
        .count();
    let g = GptConfig {
        vocab_size,
        block_size,
        n_layer,
        n_head,
        n_embd,
        bias: shape("transformer.ln_f.bias").is_ok(),
        layernorm_eps: 1e-5,
        dropout: 0.0,
    };
    g.validate().map_err(|e| format!("with --n-head {n_head}: {e}"))?;
    Ok(g)
}
