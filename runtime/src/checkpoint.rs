//! Sharded, atomic, reshardable checkpoints, and export to safetensors.
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
//!   checkpoint valid and [`latest`] ignores temporary directories.
//! - **CKPT-2**: nothing is loaded unverified: every file's size, CRC32 and SHA-256 are
//!   checked against the manifest first; a mismatch is an error naming the file.
//! - **CKPT-3**: loading on another world size reshards through the unpadded flat buffer
//!   and is exact (SHARD-6); params and optimizer state round-trip bitwise.
//! - **CKPT-4**: the export holds every parameter and buffer once, under its stable spec
//!   name, in its original shape, equal to the consolidated flat buffer.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use shardline_models::{ModelSpec, ParamSpec};

use crate::error::{Result, RuntimeError};
use crate::memory::format_bytes;
use crate::optim::Optimizer;
use crate::shard::{self, FlatLayout, ParamSlot, ShardedModelLayout, Stage};

/// Version of the on-disk format written by this code.
pub const FORMAT_VERSION: u32 = 1;
/// Name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Name of the replicated-buffers file.
pub const BUFFERS_FILE: &str = "buffers.bin";

const SHARD_MAGIC: &[u8; 8] = b"SLSHARD1";
const BUFFERS_MAGIC: &[u8; 8] = b"SLBUFS01";
const STEP_PREFIX: &str = "step-";
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

/// SHA-256 (hex) of a configuration's canonical JSON, for [`Manifest::config_hash`].
pub fn config_hash<T: Serialize>(config: &T) -> Result<String> {
    let bytes = serde_json::to_vec(config)
        .map_err(|e| RuntimeError::config(format!("configuration not serializable: {e}")))?;
    Ok(sha256_hex(&bytes))
}

fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in digest {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> RuntimeError {
    RuntimeError::checkpoint(path, format!("{what}: {e}"))
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

fn push_f32s(out: &mut Vec<u8>, vals: &[f32]) {
    out.reserve(vals.len() * 4);
    for v in vals {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn encode_shard(rank: usize, shard: &RankShard) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(SHARD_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(rank as u32).to_le_bytes());
    out.extend_from_slice(&(shard.units.len() as u32).to_le_bytes());
    for u in &shard.units {
        out.extend_from_slice(&(u.params.len() as u64).to_le_bytes());
        out.extend_from_slice(&(u.optim_state.len() as u64).to_le_bytes());
    }
    for u in &shard.units {
        push_f32s(&mut out, &u.params);
        push_f32s(&mut out, &u.optim_state);
    }
    out
}

fn shard_file_len(n_units: usize, values: usize) -> u64 {
    (8 + 4 + 4 + 4 + 16 * n_units + 4 * values) as u64
}

/// A little-endian reader that reports truncation against `path`.
struct Reader<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(RuntimeError::checkpoint(
                self.path,
                format!(
                    "truncated: needs {n} more bytes at offset {}, file has {}",
                    self.pos,
                    self.bytes.len()
                ),
            )),
        }
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self) -> Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| RuntimeError::checkpoint(self.path, "length overflows"))
    }
    fn f32s(&mut self, n: usize) -> Result<Vec<f32>> {
        let bytes = n
            .checked_mul(4)
            .ok_or_else(|| RuntimeError::checkpoint(self.path, "length overflows"))?;
        let b = self.take(bytes)?;
        Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
    fn magic(&mut self, want: &[u8; 8]) -> Result<()> {
        if self.take(8)? != want {
            return Err(RuntimeError::checkpoint(self.path, "bad magic: not a Shardline file"));
        }
        Ok(())
    }
    fn finish(&self) -> Result<()> {
        if self.pos != self.bytes.len() {
            return Err(RuntimeError::checkpoint(
                self.path,
                format!("{} trailing bytes", self.bytes.len() - self.pos),
            ));
        }
        Ok(())
    }
}

fn decode_shard(path: &Path, bytes: &[u8], rank: usize) -> Result<RankShard> {
    let mut r = Reader { path, bytes, pos: 0 };
    r.magic(SHARD_MAGIC)?;
    let version = r.u32()?;
    if version != FORMAT_VERSION {
        return Err(RuntimeError::checkpoint(
            path,
            format!("format version {version}, this build reads {FORMAT_VERSION}"),
        ));
    }
    let file_rank = r.u32()? as usize;
    if file_rank != rank {
        return Err(RuntimeError::checkpoint(
            path,
            format!("holds rank {file_rank}, expected rank {rank}"),
        ));
    }
    let n_units = r.u32()? as usize;
    let mut lens = Vec::with_capacity(n_units.min(1 << 16));
    for _ in 0..n_units {
        lens.push((r.len()?, r.len()?));
    }
    let mut units = Vec::with_capacity(lens.len());
    for (np, ns) in lens {
        units.push(UnitShard { params: r.f32s(np)?, optim_state: r.f32s(ns)? });
    }
    r.finish()?;
    Ok(RankShard { units })
}

fn encode_buffers(buffers: &[Vec<f32>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(BUFFERS_MAGIC);
    out.extend_from_slice(&(buffers.len() as u32).to_le_bytes());
    for b in buffers {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    }
    for b in buffers {
        push_f32s(&mut out, b);
    }
    out
}

fn decode_buffers(path: &Path, bytes: &[u8]) -> Result<Vec<Vec<f32>>> {
    let mut r = Reader { path, bytes, pos: 0 };
    r.magic(BUFFERS_MAGIC)?;
    let n = r.u32()? as usize;
    let mut lens = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        lens.push(r.len()?);
    }
    let out = lens.into_iter().map(|l| r.f32s(l)).collect::<Result<Vec<_>>>()?;
    r.finish()?;
    Ok(out)
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

/// The newest committed checkpoint under `root` (CKPT-1: temporary directories and
/// directories without a manifest are ignored). `None` if there is none or `root` does
/// not exist.
pub fn latest(root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    let root = root.as_ref();
    let rd = match fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(root, "cannot list", e)),
    };
    let mut best: Option<(u64, PathBuf)> = None;
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
        if !path.join(MANIFEST).is_file() {
            continue;
        }
        if best.as_ref().is_none_or(|(s, _)| step > *s) {
            best = Some((step, path));
        }
    }
    Ok(best.map(|(_, p)| p))
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
        let mpath = dir.join(MANIFEST);
        let bytes = fs::read(&mpath).map_err(|e| io_err(&mpath, "cannot read", e))?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| RuntimeError::checkpoint(&mpath, format!("invalid manifest: {e}")))?;
        if manifest.format_version != FORMAT_VERSION {
            return Err(RuntimeError::checkpoint(
                &mpath,
                format!(
                    "format version {}, this build reads {FORMAT_VERSION}",
                    manifest.format_version
                ),
            ));
        }
        let ck = Checkpoint { dir, manifest };
        ck.check_manifest_consistent()?;
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
        if &self.manifest.model != spec {
            return Err(RuntimeError::checkpoint(
                self.dir.join(MANIFEST),
                format!(
                    "holds model '{}' whose units, names or shapes differ from '{}'",
                    self.manifest.model.name, spec.name
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

/// Writes the consolidated model of the checkpoint at `dir` (a `step-N` directory or a root,
/// meaning its newest) to a safetensors file: every parameter and buffer under its stable
/// spec name and original shape (CKPT-4). Returns the number of tensors written.
pub fn export_safetensors(dir: impl AsRef<Path>, out: impl AsRef<Path>) -> Result<usize> {
    let ck = Checkpoint::open(dir)?;
    ck.export_safetensors(out)
}

impl Checkpoint {
    /// See [`export_safetensors`].
    pub fn export_safetensors(&self, out: impl AsRef<Path>) -> Result<usize> {
        let out = out.as_ref();
        let units = self.consolidate()?;
        let buffers = self.buffers()?;
        let m = &self.manifest;
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for ((u, spec), b) in units.iter().zip(&m.model.units).zip(&buffers) {
            let layout = FlatLayout::new(spec, 1)?;
            for (slot, view) in layout.params().iter().zip(layout.views(&u.params)) {
                let mut bytes = Vec::new();
                push_f32s(&mut bytes, view);
                tensors.push((slot.name.clone(), slot.shape.clone(), bytes));
            }
            let mut off = 0;
            for buf in &spec.buffers {
                let n = buf.numel();
                let mut bytes = Vec::new();
                push_f32s(&mut bytes, &b[off..off + n]);
                off += n;
                tensors.push((buf.name.clone(), buf.shape.clone(), bytes));
            }
        }
        let mut seen = HashSet::new();
        for (name, _, _) in &tensors {
            if !seen.insert(name.as_str()) {
                return Err(RuntimeError::checkpoint(
                    self.dir.join(MANIFEST),
                    format!("tensor name '{name}' appears twice; cannot export"),
                ));
            }
        }
        let views = tensors
            .iter()
            .map(|(n, shape, bytes)| {
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .map(|v| (n.clone(), v))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| RuntimeError::checkpoint(out, format!("safetensors: {e}")))?;
        let meta: HashMap<String, String> = [
            ("format".to_string(), "pt".to_string()),
            ("model".to_string(), m.model.name.clone()),
            ("step".to_string(), m.step.to_string()),
        ]
        .into_iter()
        .collect();
        safetensors::serialize_to_file(views, Some(meta), out)
            .map_err(|e| RuntimeError::checkpoint(out, format!("safetensors: {e}")))?;
        Ok(tensors.len())
    }
}

/// A human summary of the checkpoint at `dir` (a `step-N` directory or a root). Reads the
/// manifest and checks each file's size, without reading the data.
pub fn inspect(dir: impl AsRef<Path>) -> Result<String> {
    let ck = Checkpoint::open(dir)?;
    let m = &ck.manifest;
    let mut s = String::new();
    let _ = writeln!(s, "checkpoint {}", ck.dir.display());
    let _ = writeln!(
        s,
        "  format {}, step {}, world {}, stage {}",
        m.format_version, m.step, m.world, m.stage
    );
    let _ = writeln!(
        s,
        "  optimizer {} ({} state values per parameter)",
        m.optimizer.name(),
        m.state_len_per_param
    );
    let params: usize = m.units.iter().map(|u| u.numel).sum();
    let bufs: usize = m.model.units.iter().map(|u| u.buffer_numel()).sum();
    let _ = writeln!(
        s,
        "  model {}: {} units, {} parameters, {} buffer values",
        m.model.name,
        m.units.len(),
        params,
        bufs
    );
    let _ = writeln!(s, "  config hash {}", m.config_hash);
    let d = m.data_loader;
    let _ = writeln!(s, "  data loader: epoch {}, step {}, seed {}", d.epoch, d.step, d.seed);
    let _ = writeln!(s, "  units:");
    for u in &m.units {
        let _ = writeln!(
            s,
            "    {}: {} elements, padded {}, {} per rank",
            u.name,
            u.numel,
            u.padded_numel,
            u.padded_numel / m.world
        );
        for p in &u.params {
            let _ = writeln!(s, "      {} {:?} @ {}", p.name, p.shape, p.offset);
        }
        for b in &u.buffers {
            let _ = writeln!(s, "      {} {:?} (buffer)", b.name, b.shape);
        }
    }
    let _ = writeln!(s, "  files:");
    for f in m.files.iter().chain(std::iter::once(&m.buffers)) {
        let on_disk = fs::metadata(ck.dir.join(&f.file)).map(|md| md.len()).ok();
        let state = match on_disk {
            Some(n) if n == f.bytes => "ok".to_string(),
            Some(n) => format!("SIZE MISMATCH: {n} bytes on disk"),
            None => "MISSING".to_string(),
        };
        let _ = writeln!(
            s,
            "    {} {} crc32 {:08x} sha256 {}.. {}",
            f.file,
            format_bytes(f.bytes),
            f.crc32,
            &f.sha256[..f.sha256.len().min(16)],
            state
        );
    }
    if !m.extra.is_empty() {
        let _ = writeln!(s, "  extra:");
        for (k, v) in &m.extra {
            let _ = writeln!(s, "    {k} = {v}");
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamWConfig, SgdConfig};
    use shardline_models::UnitSpec;
    use std::sync::mpsc;
    use std::time::Duration;

    const DEADLINE: Duration = Duration::from_secs(30);

    fn p(name: &str, shape: &[usize]) -> ParamSpec {
        ParamSpec { name: name.into(), shape: shape.to_vec() }
    }

    /// Odd sizes, a unit with BatchNorm buffers, and an empty unit.
    fn spec() -> ModelSpec {
        ModelSpec {
            name: "test-mlp".into(),
            units: vec![
                UnitSpec {
                    name: "blocks.0".into(),
                    params: vec![p("blocks.0.fc.weight", &[5, 3]), p("blocks.0.fc.bias", &[5])],
                    buffers: vec![
                        p("blocks.0.bn.running_mean", &[5]),
                        p("blocks.0.bn.running_var", &[5]),
                    ],
                },
                UnitSpec { name: "act".into(), params: vec![], buffers: vec![] },
                UnitSpec {
                    name: "head".into(),
                    params: vec![p("head.weight", &[2, 5]), p("head.bias", &[2])],
                    buffers: vec![],
                },
            ],
        }
    }

    fn adamw() -> Optimizer {
        Optimizer::AdamW(AdamWConfig::default())
    }

    /// Unpadded flat params and state of every unit, with distinct values.
    fn model_state(spec: &ModelSpec, k: usize) -> Vec<ConsolidatedUnit> {
        spec.units
            .iter()
            .enumerate()
            .map(|(u, unit)| ConsolidatedUnit {
                params: (0..unit.numel())
                    .map(|i| u as f32 * 100.0 + i as f32 * 0.5 + 0.25)
                    .collect(),
                optim_state: (0..unit.numel() * k)
                    .map(|i| -(u as f32) * 10.0 - i as f32 * 0.125 - 1.0)
                    .collect(),
            })
            .collect()
    }

    fn shards_for(
        units: &[ConsolidatedUnit],
        spec: &ModelSpec,
        k: usize,
        world: usize,
    ) -> Vec<RankShard> {
        let mut out = vec![RankShard::default(); world];
        for (u, unit) in units.iter().zip(&spec.units) {
            let ps = shard::split(&u.params, unit.numel(), 1, world).unwrap();
            let ss = shard::split(&u.optim_state, unit.numel(), k, world).unwrap();
            for (r, (p, s)) in ps.into_iter().zip(ss).enumerate() {
                out[r].units.push(UnitShard { params: p, optim_state: s });
            }
        }
        out
    }

    fn buffers(spec: &ModelSpec) -> Vec<Vec<f32>> {
        spec.units.iter().map(|u| (0..u.buffer_numel()).map(|i| 1.0 + i as f32).collect()).collect()
    }

    fn meta(spec: &ModelSpec, world: usize, opt: Optimizer) -> CheckpointMeta {
        let mut extra = BTreeMap::new();
        extra.insert("rng".to_string(), serde_json::json!([1, 2, 3]));
        CheckpointMeta {
            world,
            stage: Stage::Zero3,
            config_hash: "cafe".into(),
            optimizer: opt,
            model: spec.clone(),
            data_loader: DataLoaderState { epoch: 2, step: 7, seed: 42 },
            extra,
        }
    }

    /// Every rank writes from its own thread, then one commit.
    fn save(root: &Path, step: u64, opt: Optimizer, shards: Vec<RankShard>) -> PathBuf {
        let spec = spec();
        let world = shards.len();
        let pending = PendingCheckpoint::begin(root, step).unwrap();
        let (tx, rx) = mpsc::channel();
        for (rank, shard) in shards.into_iter().enumerate() {
            let (pending, tx) = (pending.clone(), tx.clone());
            std::thread::spawn(move || {
                let _ = tx.send(pending.write_shard(rank, &shard));
            });
        }
        let entries = (0..world)
            .map(|_| rx.recv_timeout(DEADLINE).expect("rank writer timed out").unwrap())
            .collect();
        pending.commit(meta(&spec, world, opt), entries, &buffers(&spec)).unwrap()
    }

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
        // A second process joins the checkpoint the committer began.
        let pending = PendingCheckpoint::begin(tmp.path(), 8).unwrap();
        let joined = PendingCheckpoint::join(tmp.path(), 8).unwrap();
        assert_eq!(joined.tmp_dir(), pending.tmp_dir());
        assert!(PendingCheckpoint::join(tmp.path(), 9).is_err());
    }

    fn saved_once() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let spec = spec();
        let shards = shards_for(&model_state(&spec, 2), &spec, 2, 3);
        let dir = save(tmp.path(), 5, adamw(), shards);
        (tmp, dir)
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
        assert!(ck.check_model(&other).is_err());
    }

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

    /// CKPT-4.
    #[test]
    fn export_safetensors_equals_consolidated() {
        let (tmp, dir) = saved_once();
        let out = tmp.path().join("model.safetensors");
        let n = export_safetensors(tmp.path(), &out).unwrap();
        assert_eq!(n, 6);
        let bytes = fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let units = ck.consolidate().unwrap();
        let spec = spec();
        let mut seen = 0;
        for (u, unit) in units.iter().zip(&spec.units) {
            let mut off = 0;
            for param in &unit.params {
                let t = st.tensor(&param.name).unwrap();
                assert_eq!(t.shape(), param.shape.as_slice());
                let vals: Vec<f32> = t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                assert_eq!(vals, u.params[off..off + param.numel()], "{}", param.name);
                off += param.numel();
                seen += 1;
            }
        }
        let rm = st.tensor("blocks.0.bn.running_var").unwrap();
        assert_eq!(rm.shape(), &[5]);
        assert_eq!(&rm.data()[..4], &6.0f32.to_le_bytes());
        assert_eq!(seen + 2, st.len());
    }

    #[test]
    fn inspect_summarizes() {
        let (_tmp, dir) = saved_once();
        let text = inspect(&dir).unwrap();
        for want in [
            "step 5, world 3, stage 3",
            "adamw",
            "blocks.0.fc.weight [5, 3] @ 0",
            "blocks.0.bn.running_mean [5] (buffer)",
            "shard-00002.bin",
            "rng = [1,2,3]",
            "seed 42",
        ] {
            assert!(text.contains(want), "missing '{want}' in\n{text}");
        }
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
