//! A `shardline train --config FILE` TOML file: its `[model]` table (which model, the
//! `gpt`'s sizes, `resnet-bn`'s `width`) and its `[faults]` table ([`crate::fault::FaultsConfig`]). Anything else
//! is refused rather than silently ignored.
//!
//! ```toml
//! [model]
//! name = "gpt"
//! n_layer = 4
//! n_head = 4
//! n_embd = 128
//! block_size = 64
//! dropout = 0.1
//!
//! [faults]
//! specs = ["kill:rank=1:step=3"]
//! ```
//!
//! Invariants:
//! - `CFG-1`: a value given on the command line wins over the file's, and the file's over
//!   the default; a field of `[model]` the code does not know is an error naming it.

use crate::error::{Result, RuntimeError};
use crate::fault::FaultsConfig;
use crate::train::TrainConfig;

/// The `[model]` table.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelTable {
    /// `--model`.
    pub name: Option<String>,
    /// `--n-layer`.
    pub n_layer: Option<usize>,
    /// `--n-head`.
    pub n_head: Option<usize>,
    /// `--n-embd`.
    pub n_embd: Option<usize>,
    /// `--block-size`.
    pub block_size: Option<usize>,
    /// `--dropout`.
    pub dropout: Option<f64>,
    /// `--width` (`resnet-bn`).
    pub width: Option<usize>,
}

/// A config file's tables.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// `[model]`.
    #[serde(default)]
    pub model: ModelTable,
    /// `[faults]`.
    #[serde(default)]
    pub faults: FaultsConfig,
}

impl ConfigFile {
    /// Parses a config file's text.
    pub fn from_toml(text: &str) -> std::result::Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Reads `path`; errors name the file (exit 2).
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            RuntimeError::config(format!("cannot read --config {}: {e}", path.display()))
        })?;
        Self::from_toml(&text)
            .map_err(|e| RuntimeError::config(format!("--config {}: {e}", path.display())))
    }
}

impl ModelTable {
    /// Fills what the command line left unset (`None`) from the table (CFG-1); the model
    /// name falls back to `mlp-bn`.
    pub fn apply(&self, model_flag: Option<&str>, cfg: &mut TrainConfig) {
        cfg.model = model_flag.or(self.name.as_deref()).unwrap_or("mlp-bn").to_string();
        cfg.n_layer = cfg.n_layer.or(self.n_layer);
        cfg.n_head = cfg.n_head.or(self.n_head);
        cfg.n_embd = cfg.n_embd.or(self.n_embd);
        cfg.block_size = cfg.block_size.or(self.block_size);
        cfg.dropout = cfg.dropout.or(self.dropout);
        cfg.width = cfg.width.or(self.width);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_unknown_fields_are_named_cfg_1() {
        let f =
            ConfigFile::from_toml("[model]\nname = \"gpt\"\nn_layer = 2\nn_embd = 64\n").unwrap();
        let mut cfg = TrainConfig { n_embd: Some(32), ..TrainConfig::default() };
        f.model.apply(None, &mut cfg);
        assert_eq!((cfg.model.as_str(), cfg.n_layer, cfg.n_embd), ("gpt", Some(2), Some(32)));
        f.model.apply(Some("mlp-bn"), &mut cfg);
        assert_eq!(cfg.model, "mlp-bn");
        let r = ConfigFile::from_toml("[model]\nname = \"resnet-bn\"\nwidth = 8\n").unwrap();
        let mut rc = TrainConfig { width: Some(16), ..TrainConfig::default() };
        r.model.apply(None, &mut rc);
        assert_eq!((rc.model.as_str(), rc.width), ("resnet-bn", Some(16)), "CFG-1");
        rc.width = None;
        r.model.apply(None, &mut rc);
        assert_eq!(rc.width, Some(8));
        ConfigFile::default().model.apply(None, &mut cfg);
        assert_eq!(cfg.model, "mlp-bn", "the default");
        let e = ConfigFile::from_toml("[model]\nn_layers = 2\n").unwrap_err();
        assert!(e.contains("n_layers"), "{e}");
        let e = ConfigFile::from_toml("[optim]\nlr = 1\n").unwrap_err();
        assert!(e.contains("optim"), "{e}");
    }
}
