//! Writing a checkpoint atomically.
//!
//! # Write protocol
//!
//! 1. The committer calls [`PendingCheckpoint::begin`], which makes `<root>/.tmp-step-N/`.
//! 2. Every rank, concurrently, calls [`PendingCheckpoint::write_shard`]: it writes its file,
//!    fsyncs it, and returns a [`FileEntry`] (size and checksums computed from memory).
//! 3. After all ranks finished, the committer calls [`PendingCheckpoint::commit`] with the
//!    entries: it checks every rank is there with the expected size, writes `buffers.bin` and
//!    `manifest.json`, fsyncs them and the temporary directory, renames it to `step-N`, and
//!    fsyncs `<root>`.
//!
//! # Invariants
//!
//! - **CKPT-1**: a directory named `step-N` is complete: it only appears through the final
//!   rename, after every file in it was fsynced. A crash at any point leaves the previous
//!   checkpoint valid and [`latest`](super::latest) ignores temporary directories.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use shardline_models::ModelSpec;

use super::codec::{encode_buffers, encode_shard, shard_file_len};
use super::{
    io_err, sha256_hex, shard_file_name, step_dir_name, DataLoaderState, FileEntry, Manifest,
    RankShard, UnitEntry, BUFFERS_FILE, FORMAT_VERSION, MANIFEST, TMP_PREFIX,
};
use crate::error::{Result, RuntimeError};
use crate::optim::Optimizer;
use crate::shard::{ShardedModelLayout, Stage};

/// What the committer knows about the run, besides the files.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointMeta {
    /// World size.
    pub world: usize,
    /// ZeRO stage.
    pub stage: Stage,
    /// Hash of the run configuration.
    pub config_hash: String,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Model spec.
    pub model: ModelSpec,
    /// Data-loader position.
    pub data_loader: DataLoaderState,
    /// Extra key-values.
    pub extra: BTreeMap<String, serde_json::Value>,
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err(dir, "fsync of directory failed", e))
}

/// Writes `bytes` to `path`, fsyncs, and returns its [`FileEntry`].
fn write_file(path: &Path, bytes: &[u8], rank: Option<usize>) -> Result<FileEntry> {
    let mut f = File::create(path).map_err(|e| io_err(path, "cannot create", e))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(|e| io_err(path, "write failed", e))?;
    Ok(FileEntry {
        file: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        rank,
        bytes: bytes.len() as u64,
        sha256: sha256_hex(bytes),
        crc32: crc32fast::hash(bytes),
    })
}

/// A checkpoint being written: ranks write their shards into it concurrently, then one
/// commit makes it visible. Cloning gives every rank a handle.
#[derive(Clone, Debug)]
pub struct PendingCheckpoint {
    root: PathBuf,
    step: u64,
    tmp: PathBuf,
}

impl PendingCheckpoint {
    /// Starts checkpoint `step` under `root` (created if missing). A temporary directory
    /// left by an earlier crash at the same step is discarded. Fails if `step-N` exists.
    pub fn begin(root: impl AsRef<Path>, step: u64) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        fs::create_dir_all(&root).map_err(|e| io_err(&root, "cannot create", e))?;
        let fin = root.join(step_dir_name(step));
        if fin.exists() {
            return Err(RuntimeError::checkpoint(&fin, "checkpoint already exists"));
        }
        let tmp = root.join(format!("{TMP_PREFIX}{step:08}"));
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, "cannot remove stale", e))?;
        }
        fs::create_dir(&tmp).map_err(|e| io_err(&tmp, "cannot create", e))?;
        Ok(PendingCheckpoint { root, step, tmp })
    }

    /// A handle on a checkpoint that another process already began (ranks running as
    /// separate processes). Fails if the temporary directory does not exist.
    pub fn join(root: impl AsRef<Path>, step: u64) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        let tmp = root.join(format!("{TMP_PREFIX}{step:08}"));
        if !tmp.is_dir() {
            return Err(RuntimeError::checkpoint(
                &tmp,
                "no checkpoint in progress (the committer has not begun it)",
            ));
        }
        Ok(PendingCheckpoint { root, step, tmp })
    }

    /// The step being written.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The temporary directory.
    pub fn tmp_dir(&self) -> &Path {
        &self.tmp
    }

    /// Writes and fsyncs rank `rank`'s shard file; safe to call from every rank at once.
    pub fn write_shard(&self, rank: usize, shard: &RankShard) -> Result<FileEntry> {
        let path = self.tmp.join(shard_file_name(rank));
        write_file(&path, &encode_shard(rank, shard), Some(rank))
    }

    /// Commits the checkpoint once every rank has written (see the module's write
    /// protocol). `files` holds one entry per rank, in any order; `buffers` one vector per
    /// unit with that unit's replicated buffers concatenated in spec order. Returns the
    /// committed directory.
    pub fn commit(
        self,
        meta: CheckpointMeta,
        mut files: Vec<FileEntry>,
        buffers: &[Vec<f32>],
    ) -> Result<PathBuf> {
        let layout = ShardedModelLayout::new(&meta.model, meta.world)?;
        let k = meta.optimizer.state_len_per_param();
        files.sort_by_key(|f| f.rank);
        let ranks: Vec<Option<usize>> = files.iter().map(|f| f.rank).collect();
        let want: Vec<Option<usize>> = (0..meta.world).map(Some).collect();
        if ranks != want {
            return Err(RuntimeError::checkpoint(
                &self.tmp,
                format!(
                    "commit needs exactly one shard per rank 0..{}, got ranks {ranks:?}",
                    meta.world
                ),
            ));
        }
        let expected_len = shard_file_len(layout.units().len(), layout.shard_numel() * (1 + k));
        for f in &files {
            let path = self.tmp.join(&f.file);
            let on_disk =
                fs::metadata(&path).map_err(|e| io_err(&path, "shard missing at commit", e))?.len();
            if f.bytes != expected_len || on_disk != expected_len {
                return Err(RuntimeError::checkpoint(
                    &path,
                    format!(
                        "shard has {on_disk} bytes on disk ({} reported), the layout needs \
                         {expected_len}",
                        f.bytes
                    ),
                ));
            }
        }
        if buffers.len() != meta.model.units.len() {
            return Err(RuntimeError::config(format!(
                "{} buffer vectors for {} units",
                buffers.len(),
                meta.model.units.len()
            )));
        }
        for (u, b) in meta.model.units.iter().zip(buffers) {
            if b.len() != u.buffer_numel() {
                return Err(RuntimeError::config(format!(
                    "unit {}: {} buffer values, spec needs {}",
                    u.name,
                    b.len(),
                    u.buffer_numel()
                )));
            }
        }
        let buffers_entry =
            write_file(&self.tmp.join(BUFFERS_FILE), &encode_buffers(buffers), None)?;
        let units = layout
            .units()
            .iter()
            .zip(&meta.model.units)
            .map(|(l, u)| UnitEntry {
                name: l.name().to_string(),
                numel: l.numel(),
                padded_numel: l.padded_numel(),
                shard_ranges: (0..meta.world)
                    .map(|r| {
                        let s = l.shard_range(r);
                        [s.start, s.end]
                    })
                    .collect(),
                params: l.params().to_vec(),
                buffers: u.buffers.clone(),
            })
            .collect();
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            step: self.step,
            world: meta.world,
            stage: meta.stage,
            config_hash: meta.config_hash,
            optimizer: meta.optimizer,
            state_len_per_param: k,
            model: meta.model,
            units,
            files,
            buffers: buffers_entry,
            data_loader: meta.data_loader,
            extra: meta.extra,
        };
        let json = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| RuntimeError::checkpoint(&self.tmp, format!("manifest: {e}")))?;
        write_file(&self.tmp.join(MANIFEST), &json, None)?;
        fsync_dir(&self.tmp)?;
        let fin = self.root.join(step_dir_name(self.step));
        if fin.exists() {
            return Err(RuntimeError::checkpoint(&fin, "checkpoint already exists"));
        }
        fs::rename(&self.tmp, &fin).map_err(|e| io_err(&fin, "rename into place failed", e))?;
        fsync_dir(&self.root)?;
        Ok(fin)
    }

    /// Gives up: removes the temporary directory.
    pub fn abort(self) -> Result<()> {
        fs::remove_dir_all(&self.tmp).map_err(|e| io_err(&self.tmp, "cannot remove", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::fixtures::{
        adamw, buffers, meta, model_state, save, saved_once, shards_for, spec,
    };
    use crate::checkpoint::{latest, Checkpoint};

    /// CKPT-1: a crash leaves a temporary directory (and maybe a step dir without
    /// manifest); `latest` ignores both, and the same step can be written again.
    #[test]
    fn crash_leftovers_ignored() {
        let (tmp, dir) = saved_once();
        let spec = spec();
        let shards = shards_for(&model_state(&spec, 2), &spec, 2, 3);
        let crashed = PendingCheckpoint::begin(tmp.path(), 9).unwrap();
        crashed.write_shard(0, &shards[0]).unwrap();
        // Crash after the manifest was written, before the rename.
        fs::copy(dir.join(MANIFEST), crashed.tmp_dir().join(MANIFEST)).unwrap();
        drop(crashed);
        fs::create_dir(tmp.path().join("step-00000012")).unwrap();
        fs::write(tmp.path().join("step-00000012").join("shard-00000.bin"), b"x").unwrap();
        assert_eq!(latest(tmp.path()).unwrap(), Some(dir.clone()));
        assert_eq!(Checkpoint::open(tmp.path()).unwrap().manifest().step, 5);
        // Retrying step 9 discards the stale temporary directory.
        let redo = save(tmp.path(), 9, adamw(), shards);
        assert_eq!(latest(tmp.path()).unwrap(), Some(redo));
        assert!(!tmp.path().join(".tmp-step-00000009").exists());
        assert_eq!(latest(tmp.path().join("missing")).unwrap(), None);
        // A committed step cannot be overwritten.
        assert!(PendingCheckpoint::begin(tmp.path(), 5).is_err());
    }

    #[test]
    fn commit_refuses_missing_or_wrong_shards() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = spec();
        let shards = shards_for(&model_state(&spec, 2), &spec, 2, 2);
        let pending = PendingCheckpoint::begin(tmp.path(), 1).unwrap();
        let e0 = pending.write_shard(0, &shards[0]).unwrap();
        let err = pending
            .clone()
            .commit(meta(&spec, 2, adamw()), vec![e0.clone()], &buffers(&spec))
            .unwrap_err();
        assert!(err.to_string().contains("one shard per rank"), "{err}");
        // A shard laid out for another world has the wrong size.
        let wrong = shards_for(&model_state(&spec, 2), &spec, 2, 3);
        let e1 = pending.write_shard(1, &wrong[1]).unwrap();
        let err = pending
            .clone()
            .commit(meta(&spec, 2, adamw()), vec![e0, e1], &buffers(&spec))
            .unwrap_err();
        assert!(err.to_string().contains("shard-00001.bin"), "{err}");
        assert_eq!(latest(tmp.path()).unwrap(), None);
        pending.abort().unwrap();
    }

    /// A second process joins the checkpoint the committer began; nothing to join before
    /// that.
    #[test]
    fn join_a_begun_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(PendingCheckpoint::join(tmp.path(), 8).is_err());
        let pending = PendingCheckpoint::begin(tmp.path(), 8).unwrap();
        let joined = PendingCheckpoint::join(tmp.path(), 8).unwrap();
        assert_eq!(joined.tmp_dir(), pending.tmp_dir());
        assert!(PendingCheckpoint::join(tmp.path(), 9).is_err());
    }
}
