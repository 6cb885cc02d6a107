//! Choosing the checkpoint that `--resume` loads: the newest committed one that verifies.
//!
//! [`newest_verified`] walks the committed checkpoints newest to oldest. One that does not
//! verify is passed over, with the reason, and the walk goes on; one that verifies but was
//! written for another run stops it with an error. Every rank of a job runs this same
//! function over the same files before any rank writes a new checkpoint (the first write
//! follows a step, and a step needs every rank), so every rank, in one process or in its
//! own, chooses the same checkpoint without asking the others.
//!
//! # Invariants
//!
//! - **CKPT-5**: resume loads the newest committed checkpoint whose manifest parses and
//!   agrees with itself and whose files all verify (present, and size, CRC32 and SHA-256 as
//!   the manifest says, CKPT-2); each newer one is skipped, and reported with the error that
//!   names its damaged file. Damage is the only reason to skip: a checkpoint of another
//!   configuration (config hash), another model or another format version is refused, even
//!   when a newer one was skipped and even when its own files are damaged, because it means
//!   the directory belongs to another run or build, not that a file broke. When checkpoints
//!   exist and none verifies, resume is refused naming every one and why
//!   ([`RuntimeError::NoVerifiedCheckpoint`]); when there is none, the run starts fresh.
//!   The manifest carries no checksum of its own: a damaged manifest is caught when it does
//!   not parse, disagrees with itself or with the files, and a damaged config hash reads as
//!   another configuration.
//! - **CKPT-6**: a resumed run moves each checkpoint it skipped aside before its first step,
//!   `step-N` to `damaged-step-N` beside it (kept for inspection, no longer a committed
//!   checkpoint), so that the run can commit step N again and [`latest`](super::latest)
//!   never names a checkpoint older than the damaged one's replacement. Only the process
//!   that speaks for the job moves them (every process of a launched job selects, CKPT-5);
//!   a rank that selects while they move sees them damaged or gone, and chooses the same.

use std::path::{Path, PathBuf};

use shardline_models::ModelSpec;

use super::read::{committed, OpenError};
use super::Checkpoint;
use crate::error::{Result, RuntimeError};

/// A committed checkpoint that resume passed over, and why (CKPT-5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// The checkpoint directory (`step-N`).
    pub dir: PathBuf,
    /// Why it does not verify: the damaged file, then what is wrong with it.
    pub reason: String,
}

impl Skipped {
    fn new(dir: PathBuf, e: &RuntimeError) -> Self {
        let reason = match e {
            RuntimeError::Checkpoint { file, detail } => format!("{}: {detail}", file.display()),
            other => other.to_string(),
        };
        Skipped { dir, reason }
    }
}

/// What resume loads: the newest checkpoint that verifies, and the newer ones it skipped.
#[derive(Debug)]
pub struct Resumable {
    /// The checkpoint to load, opened and verified.
    pub checkpoint: Checkpoint,
    /// The newer checkpoints that do not verify, newest first.
    pub skipped: Vec<Skipped>,
}

/// The newest committed checkpoint under `root` that verifies and was written by a run of
/// configuration hash `config_hash` and model `model` (CKPT-5). `Ok(None)` when `root` holds
/// no committed checkpoint. Errors: a checkpoint of another configuration, model or format
/// version ([`RuntimeError::Checkpoint`] naming its manifest), checkpoints none of which
/// verifies ([`RuntimeError::NoVerifiedCheckpoint`]), and `root` that cannot be listed.
/// Reads every file of each checkpoint it tries.
pub fn newest_verified(
    root: impl AsRef<Path>,
    config_hash: &str,
    model: &ModelSpec,
) -> Result<Option<Resumable>> {
    let root = root.as_ref();
    let all = committed(root)?;
    if all.is_empty() {
        return Ok(None);
    }
    let mut skipped = Vec::new();
    for (_, dir) in all {
        let ck = match Checkpoint::open_dir(dir.clone()) {
            Ok(ck) => ck,
            Err(OpenError::Damaged(e)) => {
                skipped.push(Skipped::new(dir, &e));
                continue;
            }
            Err(OpenError::Format(e)) => return Err(e),
        };
        // Another run's checkpoint is refused before its files are read (CKPT-5).
        ck.check_config_hash(config_hash)?;
        ck.check_model(model)?;
        match ck.verify() {
            Ok(()) => return Ok(Some(Resumable { checkpoint: ck, skipped })),
            Err(e) => skipped.push(Skipped::new(dir, &e)),
        }
    }
    Err(RuntimeError::NoVerifiedCheckpoint { root: root.to_path_buf(), skipped })
}

/// Prefix of a checkpoint directory moved aside because it does not verify (CKPT-6).
const DAMAGED_PREFIX: &str = "damaged-";

/// Moves the skipped checkpoint `dir` (`step-N`) aside to `damaged-step-N` in the same
/// directory, or `damaged-step-N.K` with the first free K when that name is taken (CKPT-6).
/// Returns the new path.
pub fn set_aside(dir: &Path) -> Result<PathBuf> {
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| RuntimeError::checkpoint(dir, "not a checkpoint directory name"))?;
    let parent = dir.parent().unwrap_or(Path::new(""));
    let base = format!("{DAMAGED_PREFIX}{name}");
    let mut to = parent.join(&base);
    let mut k = 0u32;
    while to.exists() {
        k += 1;
        to = parent.join(format!("{base}.{k}"));
    }
    std::fs::rename(dir, &to).map_err(|e| {
        RuntimeError::checkpoint(dir, format!("cannot move it aside to {}: {e}", to.display()))
    })?;
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::fixtures::{adamw, model_state, save, shards_for, spec};
    use crate::checkpoint::{shard_file_name, BUFFERS_FILE, MANIFEST};
    use std::fs;

    /// Checkpoints of 3 ranks at steps 2, 4 and 6 under one root: the root and the three
    /// directories, oldest first.
    fn three() -> (tempfile::TempDir, Vec<PathBuf>) {
        let tmp = tempfile::tempdir().unwrap();
        let spec = spec();
        let dirs = [2u64, 4, 6]
            .iter()
            .map(|&step| {
                let units = model_state(&spec, 2);
                save(tmp.path(), step, adamw(), shards_for(&units, &spec, 2, 3))
            })
            .collect();
        (tmp, dirs)
    }

    fn flip_byte(file: &Path) {
        let mut bytes = fs::read(file).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x04;
        fs::write(file, &bytes).unwrap();
    }

    /// Rewrites one field of a checkpoint's manifest (the manifest has no checksum).
    fn edit_manifest(dir: &Path, key: &str, value: serde_json::Value) {
        let path = dir.join(MANIFEST);
        let mut m: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        m[key] = value;
        fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    }

    fn select(root: &Path) -> Result<Option<Resumable>> {
        newest_verified(root, "cafe", &spec())
    }

    fn chosen(root: &Path) -> (PathBuf, Vec<Skipped>) {
        let r = select(root).unwrap().expect("a checkpoint to resume from");
        (r.checkpoint.dir().to_path_buf(), r.skipped)
    }

    /// CKPT-5: with nothing damaged the newest is chosen and nothing skipped; with no
    /// committed checkpoint (none, a missing root, only a crash leftover) there is none.
    #[test]
    fn newest_when_all_verify_none_when_empty_ckpt_5() {
        let (tmp, dirs) = three();
        let (dir, skipped) = chosen(tmp.path());
        assert_eq!(dir, dirs[2]);
        assert!(skipped.is_empty());

        let empty = tempfile::tempdir().unwrap();
        assert!(select(empty.path()).unwrap().is_none());
        assert!(select(&empty.path().join("missing")).unwrap().is_none());
        fs::create_dir(empty.path().join(".tmp-step-00000003")).unwrap();
        fs::create_dir(empty.path().join("step-00000003")).unwrap();
        assert!(select(empty.path()).unwrap().is_none());
    }

    /// CKPT-5: a flipped byte in a shard of the newest skips it, naming the file; the one
    /// before is chosen and verified.
    #[test]
    fn corrupted_newest_is_skipped_naming_the_file_ckpt_5() {
        let (tmp, dirs) = three();
        let shard = dirs[2].join(shard_file_name(1));
        flip_byte(&shard);
        let (dir, skipped) = chosen(tmp.path());
        assert_eq!(dir, dirs[1]);
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].dir, dirs[2]);
        let why = &skipped[0].reason;
        assert!(why.starts_with(&shard.display().to_string()), "{why}");
        assert!(why.contains("corrupted"), "{why}");
    }

    /// CKPT-5: every kind of damage is skipped: a truncated shard, a missing buffers file, a
    /// manifest that does not parse, a manifest that disagrees with itself.
    #[test]
    fn every_kind_of_damage_is_skipped_newest_first_ckpt_5() {
        let (tmp, dirs) = three();
        let shard = dirs[2].join(shard_file_name(0));
        let len = fs::metadata(&shard).unwrap().len();
        fs::File::options().write(true).open(&shard).unwrap().set_len(len - 1).unwrap();
        fs::remove_file(dirs[1].join(BUFFERS_FILE)).unwrap();
        let (dir, skipped) = chosen(tmp.path());
        assert_eq!(dir, dirs[0]);
        let got: Vec<&Path> = skipped.iter().map(|s| s.dir.as_path()).collect();
        assert_eq!(got, [dirs[2].as_path(), dirs[1].as_path()]);
        assert!(skipped[0].reason.contains("truncated"), "{}", skipped[0].reason);
        let why = &skipped[1].reason;
        assert!(why.starts_with(&dirs[1].join(BUFFERS_FILE).display().to_string()), "{why}");

        fs::write(dirs[0].join(MANIFEST), b"{\"format_version\": 1, \"step\": ").unwrap();
        let err = select(tmp.path()).unwrap_err();
        let RuntimeError::NoVerifiedCheckpoint { skipped, .. } = &err else {
            panic!("expected no verified checkpoint, got {err}");
        };
        assert!(skipped[2].reason.contains("invalid manifest"), "{}", skipped[2].reason);

        // A manifest that parses but whose shard list disagrees with its world.
        let (tmp, dirs) = three();
        edit_manifest(&dirs[2], "world", serde_json::json!(2));
        let (dir, skipped) = chosen(tmp.path());
        assert_eq!(dir, dirs[1]);
        assert!(skipped[0].reason.contains(MANIFEST), "{}", skipped[0].reason);
    }

    /// CKPT-5: when none verifies, the error names every checkpoint, newest first, and why.
    #[test]
    fn none_verifies_names_each_ckpt_5() {
        let (tmp, dirs) = three();
        for d in &dirs {
            flip_byte(&d.join(shard_file_name(2)));
        }
        let err = select(tmp.path()).unwrap_err();
        let RuntimeError::NoVerifiedCheckpoint { root, skipped } = &err else {
            panic!("expected no verified checkpoint, got {err}");
        };
        assert_eq!(root, tmp.path());
        let got: Vec<&PathBuf> = skipped.iter().map(|s| &s.dir).collect();
        assert_eq!(got, [&dirs[2], &dirs[1], &dirs[0]]);
        let text = err.to_string();
        for d in &dirs {
            let file = d.join(shard_file_name(2)).display().to_string();
            assert!(text.contains(&format!("{}: {file}: corrupted", d.display())), "{text}");
        }
    }

    /// CKPT-5: another configuration or model is refused, not skipped: as the newest, behind
    /// a skipped newer one, and with damaged files of its own.
    #[test]
    fn another_configuration_or_model_is_refused_not_skipped_ckpt_5() {
        let (tmp, dirs) = three();
        let err = newest_verified(tmp.path(), "beef", &spec()).unwrap_err().to_string();
        assert!(err.contains(&dirs[2].join(MANIFEST).display().to_string()), "{err}");
        assert!(err.contains("config hash"), "{err}");
        let mut other = spec();
        other.units[0].params[1].shape = vec![6];
        let err = newest_verified(tmp.path(), "cafe", &other).unwrap_err().to_string();
        assert!(err.contains("holds another model") && err.contains("[6] here"), "{err}");

        // The newest is damaged and skipped; the next is another run's: refused.
        flip_byte(&dirs[2].join(shard_file_name(0)));
        edit_manifest(&dirs[1], "config_hash", serde_json::json!("beef"));
        let err = select(tmp.path()).unwrap_err().to_string();
        assert!(err.contains(&dirs[1].join(MANIFEST).display().to_string()), "{err}");
        assert!(err.contains("config hash beef"), "{err}");

        // Another run's checkpoint with a damaged file is refused for the configuration.
        flip_byte(&dirs[1].join(shard_file_name(1)));
        let err = select(tmp.path()).unwrap_err().to_string();
        assert!(err.contains("config hash beef"), "{err}");
    }

    /// CKPT-5: a manifest of another format version is refused, not skipped.
    #[test]
    fn another_format_version_is_refused_ckpt_5() {
        let (tmp, dirs) = three();
        edit_manifest(&dirs[2], "format_version", serde_json::json!(2));
        edit_manifest(&dirs[2], "units", serde_json::json!("a field of another format"));
        let err = select(tmp.path()).unwrap_err().to_string();
        assert!(err.contains("format version 2"), "{err}");
    }

    /// CKPT-5: every rank selects alone; over the same files all choose the same checkpoint.
    #[test]
    fn ranks_selecting_alone_agree_ckpt_5() {
        let (tmp, dirs) = three();
        flip_byte(&dirs[2].join(BUFFERS_FILE));
        let root = tmp.path().to_path_buf();
        let picks: Vec<(PathBuf, Vec<Skipped>)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4).map(|_| s.spawn(|| chosen(&root))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for p in &picks {
            assert_eq!(p, &picks[0]);
        }
        assert_eq!(picks[0].0, dirs[1]);
    }

    /// CKPT-6: a skipped checkpoint moved aside is no longer committed, the one resumed from
    /// is the newest again, the same step can be committed anew, and a second damaged copy
    /// of a step gets a name of its own.
    #[test]
    fn skipped_checkpoint_moved_aside_ckpt_6() {
        let (tmp, dirs) = three();
        flip_byte(&dirs[2].join(shard_file_name(1)));
        let (_, skipped) = chosen(tmp.path());
        let moved = set_aside(&skipped[0].dir).unwrap();
        assert_eq!(moved, tmp.path().join("damaged-step-00000006"));
        assert!(moved.join(shard_file_name(1)).is_file() && !dirs[2].exists());
        assert_eq!(crate::checkpoint::latest(tmp.path()).unwrap(), Some(dirs[1].clone()));
        let (dir, skipped) = chosen(tmp.path());
        assert_eq!((dir, skipped.len()), (dirs[1].clone(), 0));

        let spec = spec();
        let again = save(tmp.path(), 6, adamw(), shards_for(&model_state(&spec, 2), &spec, 2, 3));
        assert_eq!(again, dirs[2]);
        flip_byte(&again.join(BUFFERS_FILE));
        let moved = set_aside(&again).unwrap();
        assert_eq!(moved, tmp.path().join("damaged-step-00000006.1"));
    }
}
