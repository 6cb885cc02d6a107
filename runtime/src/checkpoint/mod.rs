//! Sharded, atomic, reshardable checkpoints, and export to safetensors.
//!
//! One concept per file: this one holds the on-disk layout, its names and the manifest
//! types; `codec` the binary format of the shard and buffers files; `write` the atomic write
//! protocol ([`PendingCheckpoint`], CKPT-1); `read` opening, verifying, consolidating and
//! resharding ([`Checkpoint`], [`latest`], CKPT-2 and CKPT-3); `resume` the choice of the
//! checkpoint to resume from ([`newest_verified`], [`set_aside`], CKPT-5 and CKPT-6); `export` the safetensors export
//! and [`inspect`] (CKPT-4); `torch` torch's `state_dict` types and tied aliases (CKPT-7), and
//! the floats of a bf16 export (CKPT-9);
//! `import` weights from a torch-named safetensors file, `--init-from` (CKPT-8).
//!
//! # Layout
//!
//! ```text
//! <root>/step-00000120/
//!     manifest.json        format version, world, stage, step, model spec, shard ranges,
//!                          per-file sizes and checksums, config hash, data-loader state, extras
//!     shard-00000.bin      rank 0: per unit, its params shard then its optimizer-state shard
//!     shard-00001.bin      ...
//!     buffers.bin          replicated buffers (BatchNorm running stats), stored once
//! ```
//!
//! Every rank stores slice `r` of each unit's flat buffer whatever the stage (at stages 0-2
//! the engine slices its full copy), so a checkpoint is stage independent and can be loaded
//! at any stage and, by resharding, any world size.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use shardline_models::{ModelSpec, ParamSpec};

use crate::error::{Result, RuntimeError};
use crate::optim::Optimizer;
use crate::shard::{ParamSlot, ShardedModelLayout, Stage};

mod codec;
mod export;
mod import;
mod read;
mod resume;
pub mod torch;
mod write;

#[cfg(test)]
mod fixtures;

pub use export::{export_safetensors, export_safetensors_as, inspect};
pub use import::{load_torch_weights, match_torch_weights, Initialized, TorchWeights};
pub use read::{committed, latest, Checkpoint, ConsolidatedUnit};
pub use resume::{newest_verified, set_aside, Resumable, Skipped};
pub use write::{CheckpointMeta, PendingCheckpoint};

/// Version of the on-disk format written by this code.
pub const FORMAT_VERSION: u32 = 1;
/// Name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Name of the replicated-buffers file.
pub const BUFFERS_FILE: &str = "buffers.bin";

/// Prefix of a committed checkpoint directory.
const STEP_PREFIX: &str = "step-";
/// Prefix of a checkpoint directory being written (CKPT-1).
const TMP_PREFIX: &str = ".tmp-step-";

/// Name of a committed checkpoint directory: `step-00000120`.
pub fn step_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:08}")
}

/// Name of rank `rank`'s shard file: `shard-00003.bin`.
pub fn shard_file_name(rank: usize) -> String {
    format!("shard-{rank:05}.bin")
}

/// One unit's part of a rank's checkpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UnitShard {
    /// The rank's slice of the unit's padded flat parameters.
    pub params: Vec<f32>,
    /// The rank's slice of the optimizer state (`state_len_per_param` values per element,
    /// interleaved).
    pub optim_state: Vec<f32>,
}

/// What one rank stores: its shard of every unit.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankShard {
    /// Units in model order.
    pub units: Vec<UnitShard>,
}

impl RankShard {
    /// Rank `rank`'s slices of full padded flat buffers, one params buffer and one optimizer
    /// state buffer (`state_len_per_param` values per element) per unit: what a rank that
    /// keeps full copies (stages 0-2) stores.
    pub fn from_full(
        layout: &ShardedModelLayout,
        rank: usize,
        params: &[&[f32]],
        optim_state: &[&[f32]],
        state_len_per_param: usize,
    ) -> Result<Self> {
        let k = state_len_per_param;
        if params.len() != layout.units().len() || optim_state.len() != layout.units().len() {
            return Err(RuntimeError::config("one params and one state buffer per unit needed"));
        }
        let mut units = Vec::with_capacity(params.len());
        for ((l, p), s) in layout.units().iter().zip(params).zip(optim_state) {
            if p.len() != l.padded_numel() || s.len() != l.padded_numel() * k {
                return Err(RuntimeError::config(format!(
                    "unit {}: full buffers have {} params and {} state values, layout needs {} \
                     and {}",
                    l.name(),
                    p.len(),
                    s.len(),
                    l.padded_numel(),
                    l.padded_numel() * k
                )));
            }
            let r = l.shard_range(rank);
            units.push(UnitShard {
                params: p[r.clone()].to_vec(),
                optim_state: s[r.start * k..r.end * k].to_vec(),
            });
        }
        Ok(RankShard { units })
    }
}

/// Where the data loader was, so that a resumed run sees the same batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataLoaderState {
    /// Epoch in progress.
    pub epoch: u64,
    /// Batches already consumed in that epoch.
    pub step: u64,
    /// Shuffling seed.
    pub seed: u64,
}

/// A file of a checkpoint with its size and checksums.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint directory.
    pub file: String,
    /// The rank that wrote it (none for replicated files).
    pub rank: Option<usize>,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256, lowercase hex.
    pub sha256: String,
    /// CRC32 (IEEE).
    pub crc32: u32,
}

/// A unit as recorded in the manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitEntry {
    /// Unit name.
    pub name: String,
    /// Trainable elements, unpadded.
    pub numel: usize,
    /// Padded flat length for the checkpoint's world size.
    pub padded_numel: usize,
    /// Flat-buffer range `[start, end)` of each rank, in rank order.
    pub shard_ranges: Vec<[usize; 2]>,
    /// Parameter slots (name, shape, offset).
    pub params: Vec<ParamSlot>,
    /// Replicated buffers of the unit, stored in `buffers.bin`.
    pub buffers: Vec<ParamSpec>,
}

/// The manifest of a committed checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// On-disk format version.
    pub format_version: u32,
    /// Optimizer steps completed when the checkpoint was taken.
    pub step: u64,
    /// World size that wrote it.
    pub world: usize,
    /// ZeRO stage that wrote it.
    pub stage: Stage,
    /// Hash of the run configuration (see [`config_hash`]).
    pub config_hash: String,
    /// Optimizer and its hyper-parameters.
    pub optimizer: Optimizer,
    /// Optimizer-state values per parameter element.
    pub state_len_per_param: usize,
    /// The model's spec (units, parameter names, shapes).
    pub model: ModelSpec,
    /// Per-unit shard layout.
    pub units: Vec<UnitEntry>,
    /// Shard files, one per rank in rank order.
    pub files: Vec<FileEntry>,
    /// The replicated-buffers file.
    pub buffers: FileEntry,
    /// Data-loader position.
    pub data_loader: DataLoaderState,
    /// Anything else the engine stores (RNG state, counters, ...).
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// SHA-256 (hex) of a configuration's canonical JSON, for [`Manifest::config_hash`].
pub fn config_hash<T: Serialize>(config: &T) -> Result<String> {
    let bytes = serde_json::to_vec(config)
        .map_err(|e| RuntimeError::config(format!("configuration not serializable: {e}")))?;
    Ok(sha256_hex(&bytes))
}

/// SHA-256, lowercase hex, as [`FileEntry::sha256`] holds it.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in digest {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// An I/O error on `path` as a checkpoint error naming it.
fn io_err(path: &Path, what: &str, e: std::io::Error) -> RuntimeError {
    RuntimeError::checkpoint(path, format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::fixtures::{model_state, save, shards_for, spec};
    use super::*;
    use crate::optim::SgdConfig;

    /// Plain SGD keeps no optimizer state; a full-copy rank's slices equal the shards.
    #[test]
    fn stateless_optimizer_and_from_full() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = spec();
        let opt = Optimizer::Sgd(SgdConfig::default());
        let units = model_state(&spec, 0);
        let s3 = shards_for(&units, &spec, 0, 3);
        let layout = ShardedModelLayout::new(&spec, 3).unwrap();
        let full: Vec<Vec<f32>> = units
            .iter()
            .zip(layout.units())
            .map(|(u, l)| {
                let mut f = u.params.clone();
                f.resize(l.padded_numel(), 0.0);
                f
            })
            .collect();
        let fp: Vec<&[f32]> = full.iter().map(|f| f.as_slice()).collect();
        let fs: Vec<&[f32]> = vec![&[]; full.len()];
        for (r, s) in s3.iter().enumerate() {
            assert_eq!(&RankShard::from_full(&layout, r, &fp, &fs, 0).unwrap(), s);
        }
        save(tmp.path(), 4, opt, s3);
        let ck = Checkpoint::open(tmp.path()).unwrap();
        assert_eq!(ck.load_all(2).unwrap(), shards_for(&units, &spec, 0, 2));
    }

    #[test]
    fn config_hash_is_stable_sha256() {
        let a = config_hash(&serde_json::json!({"lr": 0.1, "world": 4})).unwrap();
        assert_eq!(a.len(), 64);
        assert_eq!(a, config_hash(&serde_json::json!({"lr": 0.1, "world": 4})).unwrap());
        assert_ne!(a, config_hash(&serde_json::json!({"lr": 0.2, "world": 4})).unwrap());
        // Known vector: SHA-256 of the empty string.
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
