//! Fashion-MNIST (`--dataset fashion-mnist`): the full set where Debian's
//! `dataset-fashion-mnist` is installed (60,000 training and 10,000 test images under
//! [`INSTALLED_DIR`]), else the stratified subset bundled in `models/data/fashion-mnist/`
//! (4,000 and 1,000, 400 and 100 per class; its README gives the provenance and how the
//! images were drawn). The subset is compiled in (about 2.2 MB), so that the binary needs no
//! data files. Ten classes are declared: a label of 10 or more is an error (DATA-5).

use super::{idx, Dataset};
use crate::error::ModelError;
use std::path::{Path, PathBuf};

/// Where Debian's `dataset-fashion-mnist` installs the full set.
pub const INSTALLED_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Fashion-MNIST's classes (T-shirt/top, Trouser, ..., Ankle boot).
pub const CLASSES: usize = 10;

/// The bundled subset's files: (name, gzipped IDX bytes).
const BUNDLED: [(&str, &[u8]); 4] = [
    (
        "train-images-idx3-ubyte.gz",
        include_bytes!("../../data/fashion-mnist/train-images-idx3-ubyte.gz"),
    ),
    (
        "train-labels-idx1-ubyte.gz",
        include_bytes!("../../data/fashion-mnist/train-labels-idx1-ubyte.gz"),
    ),
    (
        "t10k-images-idx3-ubyte.gz",
        include_bytes!("../../data/fashion-mnist/t10k-images-idx3-ubyte.gz"),
    ),
    (
        "t10k-labels-idx1-ubyte.gz",
        include_bytes!("../../data/fashion-mnist/t10k-labels-idx1-ubyte.gz"),
    ),
];

/// Which Fashion-MNIST a run reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The full set in this directory.
    Installed(PathBuf),
    /// The subset compiled into the crate.
    Bundled,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Installed(dir) => write!(f, "the full set installed in {}", dir.display()),
            Origin::Bundled => write!(
                f,
                "the bundled subset (models/data/fashion-mnist; the full set: apt-get install dataset-fashion-mnist)"
            ),
        }
    }
}

/// The bundled subset: (train, test).
pub fn bundled() -> Result<(Dataset, Dataset), ModelError> {
    let split = |i: usize| {
        let ((iname, images), (lname, labels)) = (BUNDLED[i], BUNDLED[i + 1]);
        Dataset::from_idx_bytes(images, iname, labels, lname)
    };
    declare(split(0)?, split(2)?, "the bundled Fashion-MNIST")
}

/// Fashion-MNIST from `installed` when that directory exists (its four files must then
/// load: a damaged installation is an error naming the file, not a silent fallback), else
/// the bundled subset: (train, test, where they came from).
pub fn load(installed: &Path) -> Result<(Dataset, Dataset, Origin), ModelError> {
    if !installed.is_dir() {
        let (train, test) = bundled()?;
        return Ok((train, test, Origin::Bundled));
    }
    let files = idx::find(installed)?;
    let Some(test) = &files.test else {
        let stem = "t10k-images-idx3-ubyte";
        return Err(ModelError::Data {
            source_name: installed.join(stem).display().to_string(),
            msg: format!("missing file (neither {stem} nor {stem}.gz)"),
        });
    };
    let (train, test) = (idx::load_pair(&files.train)?, idx::load_pair(test)?);
    let (train, test) = declare(train, test, &installed.display().to_string())?;
    Ok((train, test, Origin::Installed(installed.to_path_buf())))
}

fn declare(
    mut train: Dataset,
    mut test: Dataset,
    name: &str,
) -> Result<(Dataset, Dataset), ModelError> {
    train.check_labels(CLASSES, name)?;
    test.check_labels(CLASSES, name)?;
    train.classes = CLASSES;
    test.classes = CLASSES;
    Ok((train, test))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_subset_is_stratified_28x28_in_0_1() {
        let (train, test) = bundled().unwrap();
        assert_eq!((train.len(), test.len()), (4000, 1000));
        assert_eq!(
            (train.sample_shape.clone(), train.classes, test.classes),
            (vec![1, 28, 28], 10, 10)
        );
        for c in 0..10u32 {
            assert_eq!(train.y.iter().filter(|&&y| y == c).count(), 400, "class {c}");
            assert_eq!(test.y.iter().filter(|&&y| y == c).count(), 100, "class {c}");
        }
        assert!(train.x.iter().all(|v| (0.0..=1.0).contains(v)));
        assert!(train.x.contains(&1.0) && train.x.contains(&0.0));
    }

    #[test]
    fn installed_directory_wins_and_a_missing_one_falls_back() {
        let base = std::env::temp_dir().join(format!("shardline-fashion-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (train, test, origin) = load(&base.join("absent")).unwrap();
        assert_eq!((train.len(), test.len(), origin), (4000, 1000, Origin::Bundled));
        idx::write_dir(&base, (20, 10), (28, 28), 10, true).unwrap();
        let (train, test, origin) = load(&base).unwrap();
        assert_eq!((train.len(), test.len()), (20, 10));
        assert_eq!(origin, Origin::Installed(base.clone()));
        // DATA-5: a label past the ten declared classes.
        idx::write_dir(&base, (20, 10), (28, 28), 11, true).unwrap();
        let e = load(&base).unwrap_err().to_string();
        assert!(e.contains("label 10") && e.contains("10 classes"), "{e}");
        let _ = std::fs::remove_dir_all(&base);
    }
}
