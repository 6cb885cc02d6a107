//! Data sets that `--dataset` names by a file or a directory, and Fashion-MNIST:
//!
//! | name | reads | test split |
//! |---|---|---|
//! | `idx:DIR` | `DIR/train-{images-idx3,labels-idx1}-ubyte[.gz]` ([`super::idx`]) | `DIR/t10k-...` when there, else held out |
//! | `csv:PATH` | one CSV file, `label,v0,v1,...` ([`super::csv`]) | held out |
//! | `npy:X,Y` | samples `X.npy` `[N, ...]`, labels `Y.npy` `[N]` ([`super::npy`]) | held out |
//! | `fashion-mnist` | the installed full set, else the bundled subset ([`super::fashion`]) | its t10k split |
//!
//! "Held out" is [`Dataset::split`] with [`HELD_OUT_FRACTION`] and [`SPLIT_SEED`], as for
//! the digits: stratified and seeded (DATA-3). A `--data-scale` divides the values of CSV and
//! `.npy` files (IDX pixels are always divided by 255). `classes` follows DATA-5.

use super::{fashion, idx, npy, Dataset};
use crate::error::ModelError;
use std::path::{Path, PathBuf};

/// Share of a single file's samples held out for testing.
pub const HELD_OUT_FRACTION: f64 = 0.2;
/// Seed of the held-out split (the digits' too).
pub const SPLIT_SEED: u64 = 1234;

/// A data set read from files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileData {
    /// `idx:DIR`.
    Idx(PathBuf),
    /// `csv:PATH`.
    Csv(PathBuf),
    /// `npy:X,Y`.
    Npy(PathBuf, PathBuf),
    /// `fashion-mnist`, from the installed directory when there.
    FashionMnist(PathBuf),
}

/// What [`FileData::load`] read.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// Training split.
    pub train: Dataset,
    /// Test split.
    pub test: Dataset,
    /// Where the samples came from and how the test split was made, for the job's header.
    pub origin: String,
}

impl FileData {
    /// The file data set `name` names; `None` for a name of another kind (`digits`, `text`,
    /// ...), an error for a malformed one.
    pub fn parse(name: &str) -> Option<Result<FileData, String>> {
        let path = |p: &str, what: &str| {
            if p.is_empty() {
                Err(format!("--dataset {name}: give {what}"))
            } else {
                Ok(PathBuf::from(p))
            }
        };
        if name == "fashion-mnist" {
            return Some(Ok(FileData::FashionMnist(PathBuf::from(fashion::INSTALLED_DIR))));
        }
        if let Some(p) = name.strip_prefix("idx:") {
            return Some(path(p, "a directory: idx:DIR").map(FileData::Idx));
        }
        if let Some(p) = name.strip_prefix("csv:") {
            return Some(path(p, "a file: csv:PATH").map(FileData::Csv));
        }
        let p = name.strip_prefix("npy:")?;
        Some(match p.split_once(',') {
            Some((x, y)) if !x.is_empty() && !y.is_empty() => {
                Ok(FileData::Npy(PathBuf::from(x), PathBuf::from(y)))
            }
            _ => Err(format!(
                "--dataset {name}: give the samples and the labels files: npy:X.npy,Y.npy"
            )),
        })
    }

    /// Whether `--data-scale` applies (CSV and `.npy` values).
    pub fn takes_scale(&self) -> bool {
        matches!(self, FileData::Csv(_) | FileData::Npy(..))
    }

    /// Reads the files; values of CSV and `.npy` files are divided by `scale`. Samples keep
    /// their shape in the files (see [`Dataset::shaped_for`] for a model's).
    pub fn load(&self, scale: f32) -> Result<Loaded, ModelError> {
        let held_out = |d: Dataset, what: String| {
            let (train, test) = d.split(HELD_OUT_FRACTION, SPLIT_SEED);
            let origin = format!(
                "{what}; {:.0}% held out for testing (stratified, seed {SPLIT_SEED})",
                HELD_OUT_FRACTION * 100.0
            );
            Loaded { train, test, origin }
        };
        let loaded = match self {
            FileData::Idx(dir) => match idx::load_dir(dir)? {
                (train, Some(test)) => {
                    Loaded { train, test, origin: format!("{} with its t10k split", dir.display()) }
                }
                (train, None) => held_out(train, format!("{} (no t10k files)", dir.display())),
            },
            FileData::Csv(path) => {
                let text = read_text(path)?;
                let d = Dataset::from_csv_rows(&text, &path.display().to_string(), scale)?;
                held_out(d, path.display().to_string())
            }
            FileData::Npy(x, y) => {
                held_out(npy::load(x, y, scale)?, format!("{} and {}", x.display(), y.display()))
            }
            FileData::FashionMnist(dir) => {
                let (train, test, origin) = fashion::load(dir)?;
                return Ok(Loaded { train, test, origin: origin.to_string() });
            }
        };
        Ok(same_classes(loaded))
    }
}

/// DATA-5: both splits carry the larger of their label counts.
fn same_classes(mut l: Loaded) -> Loaded {
    let classes = l.train.classes.max(l.test.classes);
    l.train.classes = classes;
    l.test.classes = classes;
    l
}

fn read_text(path: &Path) -> Result<String, ModelError> {
    let bytes = idx::read_file(path)?;
    String::from_utf8(bytes).map_err(|e| ModelError::Data {
        source_name: path.display().to_string(),
        msg: format!("not UTF-8 text: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_into_sources() {
        let p = |s: &str| FileData::parse(s);
        assert_eq!(p("digits"), None);
        assert_eq!(p("text:foo"), None);
        assert_eq!(p("idx:/d"), Some(Ok(FileData::Idx("/d".into()))));
        assert_eq!(p("csv:a.csv"), Some(Ok(FileData::Csv("a.csv".into()))));
        assert_eq!(p("npy:x.npy,y.npy"), Some(Ok(FileData::Npy("x.npy".into(), "y.npy".into()))));
        assert!(matches!(p("fashion-mnist"), Some(Ok(FileData::FashionMnist(_)))));
        for bad in ["idx:", "csv:", "npy:x.npy", "npy:,y.npy", "npy:x.npy,"] {
            let e = p(bad).unwrap().unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn single_files_hold_out_a_seeded_stratified_split_data_5() {
        let dir = std::env::temp_dir().join(format!("shardline-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.csv");
        let rows: String = (0..50).map(|i| format!("{},{},{}\n", i % 5, i, 2 * i)).collect();
        std::fs::write(&path, rows).unwrap();
        let src = FileData::Csv(path.clone());
        let a = src.load(2.0).unwrap();
        assert_eq!((a.train.len(), a.test.len()), (40, 10));
        assert_eq!((a.train.classes, a.test.classes), (5, 5));
        assert!(a.origin.contains("20% held out"), "{}", a.origin);
        let b = src.load(2.0).unwrap();
        assert_eq!((a.train, a.test), (b.train, b.test), "DATA-3");
        // An IDX directory whose test split lacks the top class still has the train's classes.
        idx::write_dir(&dir.join("idx"), (12, 2), (2, 2), 4, false).unwrap();
        let l = FileData::Idx(dir.join("idx")).load(1.0).unwrap();
        assert_eq!((l.train.classes, l.test.classes), (4, 4));
        let e = FileData::Csv(dir.join("absent.csv")).load(1.0).unwrap_err().to_string();
        assert!(e.contains("absent.csv") && e.contains("cannot read"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
