//! Reading committed checkpoints: finding the newest, opening and verifying one, joining its
//! shards into whole units and resharding them for another world size.
//!
//! # Invariants
//!
//! - **CKPT-2**: nothing is loaded unverified: every file's size, CRC32 and SHA-256 are
//!   checked against the manifest first; a mismatch is an error naming the file.
//! - **CKPT-3**: loading on another world size reshards through the unpadded flat buffer
//!   and is exact (SHARD-6); params and optimizer state round-trip bitwise.

use std::fs;
use std::path::{Path, PathBuf};

use shardline_models::ModelSpec;

use super::codec::{decode_buffers, decode_shard};
use super::{
    io_err, sha256_hex, FileEntry, Manifest, RankShard, UnitShard, FORMAT_VERSION, MANIFEST,
    STEP_PREFIX,
};
use crate::error::{Result, RuntimeError};
use crate::shard::{self, ShardedModelLayout};

/// Every committed checkpoint under `root`, newest first, as (step, directory) (CKPT-1:
/// temporary directories and directories without a manifest are ignored). Empty if there is
/// none or `root` does not exist.
pub fn committed(root: impl AsRef<Path>) -> Result<Vec<(u64, PathBuf)>> {
    let root = root.as_ref();
    let rd = match fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(root, "cannot list", e)),
    };
    let mut found = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| io_err(root, "cannot list", e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(digits) = name.strip_prefix(STEP_PREFIX) else {
            continue;
        };
        let Ok(step) = digits.parse::<u64>() else {
            continue;
        };
        let path = entry.path();
        if path.join(MANIFEST).is_file() {
            found.push((step, path));
        }
    }
    // Newest first; equal steps (`step-7` beside `step-00000007`) in a fixed order too.
    found.sort_unstable_by(|a, b| b.cmp(a));
    Ok(found)
}

/// The newest committed checkpoint under `root` (see [`committed`]). `None` if there is
/// none or `root` does not exist.
pub fn latest(root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    Ok(committed(root)?.into_iter().next().map(|(_, p)| p))
}

/// Why a checkpoint directory could not be opened.
#[derive(Debug)]
pub(super) enum OpenError {
    /// The manifest is unreadable, not a manifest, or disagrees with itself: damage.
    Damaged(RuntimeError),
    /// The manifest is of another on-disk format version: written by another build.
    Format(RuntimeError),
}

impl From<OpenError> for RuntimeError {
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::Damaged(e) | OpenError::Format(e) => e,
        }
    }
}

/// The one field read before the rest of a manifest, so that another format version is
/// told apart from damage whatever its other fields are.
#[derive(serde::Deserialize)]
struct FormatOnly {
    format_version: u32,
}

/// A consolidated unit: unpadded flat params and optimizer state.
#[derive(Clone, Debug, PartialEq)]
pub struct ConsolidatedUnit {
    /// Unpadded flat params (`numel`).
    pub params: Vec<f32>,
    /// Unpadded interleaved optimizer state (`numel * state_len_per_param`).
    pub optim_state: Vec<f32>,
}

/// A committed checkpoint opened for reading.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
}

impl Checkpoint {
    /// Opens a checkpoint directory (`step-N`), or the newest one if `path` is a root
    /// holding `step-N` directories. Reads and checks the manifest only.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let dir = if path.join(MANIFEST).is_file() {
            path.to_path_buf()
        } else {
            latest(path)?.ok_or_else(|| {
                RuntimeError::checkpoint(path, "no committed checkpoint (no manifest.json)")
            })?
        };
        Self::open_dir(dir).map_err(RuntimeError::from)
    }

    /// Opens the checkpoint directory `dir`: reads the manifest and checks it against
    /// itself and this build's format version.
    pub(super) fn open_dir(dir: PathBuf) -> std::result::Result<Self, OpenError> {
        let mpath = dir.join(MANIFEST);
        let damaged = |d: String| OpenError::Damaged(RuntimeError::checkpoint(&mpath, d));
        let bytes =
            fs::read(&mpath).map_err(|e| OpenError::Damaged(io_err(&mpath, "cannot read", e)))?;
        let version: FormatOnly = serde_json::from_slice(&bytes)
            .map_err(|e| damaged(format!("invalid manifest: {e}")))?;
        if version.format_version != FORMAT_VERSION {
            return Err(OpenError::Format(RuntimeError::checkpoint(
                &mpath,
                format!(
                    "format version {}, this build reads {FORMAT_VERSION}",
                    version.format_version
                ),
            )));
        }
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| damaged(format!("invalid manifest: {e}")))?;
        let ck = Checkpoint { dir, manifest };
        ck.check_manifest_consistent().map_err(OpenError::Damaged)?;
        Ok(ck)
    }

    fn check_manifest_consistent(&self) -> Result<()> {
        let m = &self.manifest;
        let mpath = self.dir.join(MANIFEST);
        let bad = |d: String| Err(RuntimeError::checkpoint(&mpath, d));
        if m.world == 0 || m.files.len() != m.world {
            return bad(format!("{} shard files for world {}", m.files.len(), m.world));
        }
        if m.state_len_per_param != m.optimizer.state_len_per_param() {
            return bad("optimizer state width disagrees with the optimizer".into());
        }
        let layout = ShardedModelLayout::new(&m.model, m.world)?;
        if layout.units().len() != m.units.len() {
            return bad("unit list disagrees with the model spec".into());
        }
        for (l, u) in layout.units().iter().zip(&m.units) {
            let ranges: Vec<[usize; 2]> = (0..m.world)
                .map(|r| {
                    let s = l.shard_range(r);
                    [s.start, s.end]
                })
                .collect();
            if l.numel() != u.numel
                || l.padded_numel() != u.padded_numel
                || ranges != u.shard_ranges
            {
                return bad(format!("unit {}: shard layout disagrees with the spec", u.name));
            }
        }
        for (r, f) in m.files.iter().enumerate() {
            if f.rank != Some(r) || f.file.contains(['/', '\\']) || f.file.starts_with('.') {
                return bad(format!("bad file entry for rank {r}: {}", f.file));
            }
        }
        Ok(())
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Refuses a checkpoint written under another configuration.
    pub fn check_config_hash(&self, expected: &str) -> Result<()> {
        if self.manifest.config_hash != expected {
            return Err(RuntimeError::checkpoint(
                self.dir.join(MANIFEST),
                format!(
                    "config hash {} does not match this run's {expected}",
                    self.manifest.config_hash
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a checkpoint of another model (units, names, shapes).
    pub fn check_model(&self, spec: &ModelSpec) -> Result<()> {
        if let Some(diff) = spec.first_difference(&self.manifest.model) {
            return Err(RuntimeError::checkpoint(
                self.dir.join(MANIFEST),
                format!(
                    "holds another model than this run builds ({diff}): the model's flags or \
                     [model] table must be the ones it was written with"
                ),
            ));
        }
        Ok(())
    }

    /// Reads a file and checks size and checksums (CKPT-2).
    fn read_verified(&self, entry: &FileEntry) -> Result<Vec<u8>> {
        let path = self.dir.join(&entry.file);
        let bytes = fs::read(&path).map_err(|e| io_err(&path, "cannot read", e))?;
        if bytes.len() as u64 != entry.bytes {
            return Err(RuntimeError::checkpoint(
                &path,
                format!(
                    "truncated or resized: {} bytes, manifest says {}",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        let crc = crc32fast::hash(&bytes);
        if crc != entry.crc32 {
            return Err(RuntimeError::checkpoint(
                &path,
                format!("corrupted: crc32 {crc:08x}, manifest says {:08x}", entry.crc32),
            ));
        }
        let sha = sha256_hex(&bytes);
        if sha != entry.sha256 {
            return Err(RuntimeError::checkpoint(
                &path,
                format!("corrupted: sha256 {sha}, manifest says {}", entry.sha256),
            ));
        }
        Ok(bytes)
    }

    /// Verifies every file of the checkpoint (sizes, checksums, structure).
    pub fn verify(&self) -> Result<()> {
        for r in 0..self.manifest.world {
            self.read_rank_file(r)?;
        }
        self.buffers()?;
        Ok(())
    }

    /// Reads rank `rank`'s own shard file as written (verified, checked against the layout).
    pub fn read_rank_file(&self, rank: usize) -> Result<RankShard> {
        let m = &self.manifest;
        let entry = m.files.get(rank).ok_or_else(|| {
            RuntimeError::config(format!("rank {rank} out of range for world {}", m.world))
        })?;
        let path = self.dir.join(&entry.file);
        let bytes = self.read_verified(entry)?;
        let shard = decode_shard(&path, &bytes, rank)?;
        if shard.units.len() != m.units.len() {
            return Err(RuntimeError::checkpoint(
                &path,
                format!("{} units, manifest has {}", shard.units.len(), m.units.len()),
            ));
        }
        for (u, e) in shard.units.iter().zip(&m.units) {
            let len = e.padded_numel / m.world;
            if u.params.len() != len || u.optim_state.len() != len * m.state_len_per_param {
                return Err(RuntimeError::checkpoint(
                    &path,
                    format!("unit {}: shard lengths disagree with the manifest", e.name),
                ));
            }
        }
        Ok(shard)
    }

    /// Every unit's unpadded flat params and optimizer state, joined from all shards.
    pub fn consolidate(&self) -> Result<Vec<ConsolidatedUnit>> {
        let m = &self.manifest;
        let k = m.state_len_per_param;
        let shards = (0..m.world).map(|r| self.read_rank_file(r)).collect::<Result<Vec<_>>>()?;
        (0..m.units.len())
            .map(|i| {
                let numel = m.units[i].numel;
                let p: Vec<&[f32]> = shards.iter().map(|s| s.units[i].params.as_slice()).collect();
                let st: Vec<&[f32]> =
                    shards.iter().map(|s| s.units[i].optim_state.as_slice()).collect();
                let wrap = |e: RuntimeError| {
                    RuntimeError::checkpoint(&self.dir, format!("unit {}: {e}", m.units[i].name))
                };
                Ok(ConsolidatedUnit {
                    params: shard::consolidate(numel, 1, &p).map_err(wrap)?,
                    optim_state: shard::consolidate(numel, k, &st).map_err(wrap)?,
                })
            })
            .collect()
    }

    /// The shards of every rank for a world of `world` ranks, resharding if it differs
    /// from the checkpoint's (CKPT-3).
    pub fn load_all(&self, world: usize) -> Result<Vec<RankShard>> {
        let m = &self.manifest;
        if world == m.world {
            return (0..world).map(|r| self.read_rank_file(r)).collect();
        }
        let k = m.state_len_per_param;
        let units = self.consolidate()?;
        let mut out = vec![RankShard::default(); world];
        for (u, e) in units.iter().zip(&m.units) {
            let ps = shard::split(&u.params, e.numel, 1, world)?;
            let ss = shard::split(&u.optim_state, e.numel, k, world)?;
            for (r, (p, s)) in ps.into_iter().zip(ss).enumerate() {
                out[r].units.push(UnitShard { params: p, optim_state: s });
            }
        }
        Ok(out)
    }

    /// Rank `rank`'s shards for a world of `world` ranks (resharding if needed, CKPT-3).
    pub fn load_rank(&self, rank: usize, world: usize) -> Result<RankShard> {
        if rank >= world {
            return Err(RuntimeError::config(format!(
                "rank {rank} out of range for world {world}"
            )));
        }
        if world == self.manifest.world {
            return self.read_rank_file(rank);
        }
        let mut all = self.load_all(world)?;
        Ok(all.swap_remove(rank))
    }

    /// The replicated buffers, one vector per unit (verified).
    pub fn buffers(&self) -> Result<Vec<Vec<f32>>> {
        let entry = &self.manifest.buffers;
        let path = self.dir.join(&entry.file);
        let bytes = self.read_verified(entry)?;
        let bufs = decode_buffers(&path, &bytes)?;
        let ok = bufs.len() == self.manifest.units.len()
            && bufs
                .iter()
                .zip(&self.manifest.model.units)
                .all(|(b, u)| b.len() == u.buffer_numel());
        if !ok {
            return Err(RuntimeError::checkpoint(
                &path,
                "buffer lengths disagree with the model spec",
            ));
        }
        Ok(bufs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::fixtures::{
        adamw, buffers, model_state, save, saved_once, shards_for, spec,
    };
    use crate::checkpoint::{inspect, BUFFERS_FILE};
    use crate::optim::{Optimizer, SgdConfig};
    use crate::shard::Stage;
    use std::fs::File;

    #[test]
    fn round_trip_same_world() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = spec();
        let units = model_state(&spec, 2);
        let shards = shards_for(&units, &spec, 2, 4);
        let dir = save(tmp.path(), 3, adamw(), shards.clone());
        assert_eq!(dir.file_name().unwrap(), "step-00000003");
        let ck = Checkpoint::open(tmp.path()).unwrap();
        ck.verify().unwrap();
        assert_eq!(ck.load_all(4).unwrap(), shards);
        assert_eq!(ck.load_rank(2, 4).unwrap(), shards[2]);
        assert_eq!(ck.consolidate().unwrap(), units);
        assert_eq!(ck.buffers().unwrap(), buffers(&spec));
        let m = ck.manifest();
        assert_eq!((m.step, m.world, m.stage), (3, 4, Stage::Zero3));
        assert_eq!(m.data_loader.seed, 42);
        assert_eq!(m.extra["rng"], serde_json::json!([1, 2, 3]));
        assert_eq!(m.units[0].shard_ranges, vec![[0, 5], [5, 10], [10, 15], [15, 20]]);
        assert_eq!(m.optimizer, adamw());
        ck.check_config_hash("cafe").unwrap();
        ck.check_model(&spec).unwrap();
    }

    /// CKPT-3: 4 -> 2 -> 3 -> 4, params and optimizer state exact.
    #[test]
    fn reshard_4_2_3_exact() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = spec();
        let opt = Optimizer::Sgd(SgdConfig { momentum: 0.9, ..SgdConfig::default() });
        let units = model_state(&spec, 1);
        let s4 = shards_for(&units, &spec, 1, 4);
        save(tmp.path(), 1, opt, s4.clone());
        let s2 = Checkpoint::open(tmp.path()).unwrap().load_all(2).unwrap();
        assert_eq!(s2, shards_for(&units, &spec, 1, 2));
        save(tmp.path(), 2, opt, s2);
        let ck2 = Checkpoint::open(tmp.path()).unwrap();
        assert_eq!(ck2.manifest().world, 2);
        let s3 = ck2.load_all(3).unwrap();
        assert_eq!(s3, shards_for(&units, &spec, 1, 3));
        assert_eq!(ck2.load_rank(1, 3).unwrap(), s3[1]);
        save(tmp.path(), 3, opt, s3);
        let back = Checkpoint::open(tmp.path()).unwrap().load_all(4).unwrap();
        assert_eq!(back, s4);
    }

    /// CKPT-2: one flipped byte is refused, naming the file.
    #[test]
    fn corrupt_byte_refused_naming_file() {
        let (_tmp, dir) = saved_once();
        let file = dir.join("shard-00001.bin");
        let mut bytes = fs::read(&file).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        fs::write(&file, &bytes).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        ck.read_rank_file(0).unwrap();
        let err = ck.load_rank(1, 3).unwrap_err().to_string();
        assert!(err.contains("shard-00001.bin"), "{err}");
        assert!(err.contains("corrupted"), "{err}");
        let err = ck.load_all(2).unwrap_err().to_string();
        assert!(err.contains("shard-00001.bin"), "{err}");
        assert!(ck.verify().is_err());
    }

    /// CKPT-2: a truncated shard (or buffers file) is refused, naming the file.
    #[test]
    fn truncated_file_refused() {
        let (_tmp, dir) = saved_once();
        let file = dir.join("shard-00002.bin");
        let len = fs::metadata(&file).unwrap().len();
        File::options().write(true).open(&file).unwrap().set_len(len - 3).unwrap();
        let err = Checkpoint::open(&dir).unwrap().load_rank(2, 3).unwrap_err().to_string();
        assert!(err.contains("shard-00002.bin") && err.contains("truncated"), "{err}");
        let bfile = dir.join(BUFFERS_FILE);
        fs::write(&bfile, b"SLBUFS01").unwrap();
        let err = Checkpoint::open(&dir).unwrap().buffers().unwrap_err().to_string();
        assert!(err.contains(BUFFERS_FILE), "{err}");
        // inspect still works and flags the bad sizes without reading data.
        let text = inspect(&dir).unwrap();
        assert!(text.contains("SIZE MISMATCH"), "{text}");
    }

    #[test]
    fn config_hash_and_model_mismatch_refused() {
        let (_tmp, dir) = saved_once();
        let ck = Checkpoint::open(&dir).unwrap();
        let err = ck.check_config_hash("beef").unwrap_err().to_string();
        assert!(err.contains("manifest.json") && err.contains("beef"), "{err}");
        let mut other = spec();
        other.units[2].params[0].shape = vec![5, 2];
        let err = ck.check_model(&other).unwrap_err().to_string();
        assert!(err.contains("manifest.json") && err.contains("[5, 2] here"), "{err}");
    }
}
