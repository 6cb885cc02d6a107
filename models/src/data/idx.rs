//! IDX files, the format of MNIST and Fashion-MNIST, plain or gzipped.
//!
//! An IDX file is a magic `0x00 0x00 TYPE NDIM`, NDIM big-endian `u32` dimensions, then the
//! values in C order: images are `0x00000803` (unsigned bytes `[n, rows, cols]`), labels
//! `0x00000801` (unsigned bytes `[n]`). A file that starts with the gzip magic (`1f 8b`) is
//! decompressed first, whatever its name. Pixels are divided by 255 (into [0, 1]) and samples
//! get the shape `[1, rows, cols]`; `classes` is the largest label + 1.
//!
//! A directory holds `train-images-idx3-ubyte` and `train-labels-idx1-ubyte` and, when it has
//! a test split, `t10k-images-idx3-ubyte` and `t10k-labels-idx1-ubyte`, each plain or with
//! `.gz` appended. Parsing is over bytes ([`Dataset::from_idx_bytes`]); [`load_dir`] only
//! finds and reads the files.

use super::{Dataset, SampleKind};
use crate::error::ModelError;
use std::borrow::Cow;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Magic of an IDX file of unsigned-byte images `[n, rows, cols]`.
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic of an IDX file of unsigned-byte labels `[n]`.
pub const LABELS_MAGIC: u32 = 0x0000_0801;
/// The first two bytes of a gzip stream.
pub const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

fn data_err(name: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Data { source_name: name.to_string(), msg: msg.into() }
}

/// `bytes` decompressed when they start with the gzip magic, else as they are.
pub fn gunzip<'a>(bytes: &'a [u8], name: &str) -> Result<Cow<'a, [u8]>, ModelError> {
    if !bytes.starts_with(&GZIP_MAGIC) {
        return Ok(Cow::Borrowed(bytes));
    }
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes)
        .read_to_end(&mut out)
        .map_err(|e| data_err(name, format!("gzip: {e} (a truncated or damaged .gz file)")))?;
    Ok(Cow::Owned(out))
}

/// The dimensions and the data bytes of an (uncompressed) IDX file whose magic must be
/// `magic`; the data must be exactly as long as the dimensions say.
pub fn parse<'a>(
    bytes: &'a [u8],
    magic: u32,
    name: &str,
) -> Result<(Vec<usize>, &'a [u8]), ModelError> {
    let what = if magic == IMAGES_MAGIC { "images" } else { "labels" };
    if bytes.is_empty() {
        return Err(data_err(name, "empty file"));
    }
    let Some(head) = bytes.first_chunk::<4>() else {
        return Err(data_err(
            name,
            format!("truncated: {} bytes, an IDX header needs at least 4", bytes.len()),
        ));
    };
    let got = u32::from_be_bytes(*head);
    if got != magic {
        return Err(data_err(
            name,
            format!("wrong magic {got:#010x}, expected {magic:#010x} (an IDX file of {what})"),
        ));
    }
    let ndim = usize::from(head[3]);
    let header = 4 + 4 * ndim;
    if bytes.len() < header {
        return Err(data_err(
            name,
            format!(
                "truncated: the header of {ndim} dimensions needs {header} bytes, the file has {}",
                bytes.len()
            ),
        ));
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let dims_text = dims.iter().map(usize::to_string).collect::<Vec<_>>().join(" x ");
    let expected = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| data_err(name, format!("dimensions {dims_text} overflow")))?;
    let actual = bytes.len() - header;
    if actual < expected {
        return Err(data_err(
            name,
            format!(
                "truncated: the header says {dims_text} = {expected} bytes of data, the file has {actual}"
            ),
        ));
    }
    if actual > expected {
        return Err(data_err(
            name,
            format!("{actual} bytes of data after the header, which says {dims_text} = {expected}"),
        ));
    }
    Ok((dims, &bytes[header..]))
}

impl Dataset {
    /// The data set of an IDX images file and its IDX labels file (either may be gzipped);
    /// the names are the files', for errors.
    pub fn from_idx_bytes(
        images: &[u8],
        images_name: &str,
        labels: &[u8],
        labels_name: &str,
    ) -> Result<Dataset, ModelError> {
        let images = gunzip(images, images_name)?;
        let labels = gunzip(labels, labels_name)?;
        let (dims, pixels) = parse(&images, IMAGES_MAGIC, images_name)?;
        let (ldims, y) = parse(&labels, LABELS_MAGIC, labels_name)?;
        let (n, rows, cols) = (dims[0], dims[1], dims[2]);
        if ldims[0] != n {
            return Err(data_err(
                labels_name,
                format!("{} labels for the {n} images of {images_name}", ldims[0]),
            ));
        }
        if n == 0 {
            return Err(data_err(images_name, "no samples"));
        }
        let x = pixels.iter().map(|&p| f32::from(p) / 255.0).collect();
        let y: Vec<u32> = y.iter().map(|&l| u32::from(l)).collect();
        let classes = y.iter().max().map_or(0, |&m| m as usize + 1);
        Ok(Dataset { x, y, sample_shape: vec![1, rows, cols], classes, kind: SampleKind::Features })
    }
}

/// The images and labels files of one split of an IDX directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxPair {
    /// The images file.
    pub images: PathBuf,
    /// The labels file.
    pub labels: PathBuf,
}

/// The files of an IDX directory: the training split's, and the test split's when there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxFiles {
    /// `train-images-idx3-ubyte[.gz]`, `train-labels-idx1-ubyte[.gz]`.
    pub train: IdxPair,
    /// `t10k-images-idx3-ubyte[.gz]`, `t10k-labels-idx1-ubyte[.gz]`.
    pub test: Option<IdxPair>,
}

/// `dir/stem`, else `dir/stem.gz`, if either is there.
fn find_file(dir: &Path, stem: &str) -> Option<PathBuf> {
    [dir.join(stem), dir.join(format!("{stem}.gz"))].into_iter().find(|p| p.is_file())
}

/// Finds the files of the IDX directory `dir`; a missing training file, or a test split
/// with one file of the two, is an error naming what is missing.
pub fn find(dir: &Path) -> Result<IdxFiles, ModelError> {
    if !dir.is_dir() {
        return Err(data_err(&dir.display().to_string(), "not a directory"));
    }
    let pair = |split: &str| {
        let images = format!("{split}-images-idx3-ubyte");
        let labels = format!("{split}-labels-idx1-ubyte");
        (find_file(dir, &images), find_file(dir, &labels), images, labels)
    };
    let missing = |stem: &str| {
        data_err(
            &dir.join(stem).display().to_string(),
            format!("missing file (neither {stem} nor {stem}.gz in {})", dir.display()),
        )
    };
    let train = match pair("train") {
        (Some(images), Some(labels), _, _) => IdxPair { images, labels },
        (None, _, stem, _) | (_, None, _, stem) => return Err(missing(&stem)),
    };
    let test = match pair("t10k") {
        (Some(images), Some(labels), _, _) => Some(IdxPair { images, labels }),
        (None, None, _, _) => None,
        (None, Some(_), stem, _) | (Some(_), None, _, stem) => return Err(missing(&stem)),
    };
    Ok(IdxFiles { train, test })
}

/// Reads a whole data file; errors name it.
pub fn read_file(path: &Path) -> Result<Vec<u8>, ModelError> {
    std::fs::read(path)
        .map_err(|e| data_err(&path.display().to_string(), format!("cannot read: {e}")))
}

/// Loads one split's pair of files.
pub fn load_pair(p: &IdxPair) -> Result<Dataset, ModelError> {
    let (images, labels) = (read_file(&p.images)?, read_file(&p.labels)?);
    Dataset::from_idx_bytes(
        &images,
        &p.images.display().to_string(),
        &labels,
        &p.labels.display().to_string(),
    )
}

/// The training split of the IDX directory `dir`, and its test split when it has one.
pub fn load_dir(dir: &Path) -> Result<(Dataset, Option<Dataset>), ModelError> {
    let files = find(dir)?;
    let train = load_pair(&files.train)?;
    let test = files.test.as_ref().map(load_pair).transpose()?;
    Ok((train, test))
}

/// IDX bytes of given arrays, for tests (feature `test-utils`).
#[cfg(any(test, feature = "test-utils"))]
pub mod encode {
    use std::io::Write;

    /// An IDX file of `[n, rows, cols]` unsigned-byte images.
    pub fn images(n: usize, rows: usize, cols: usize, pixels: &[u8]) -> Vec<u8> {
        let mut out = super::IMAGES_MAGIC.to_be_bytes().to_vec();
        for d in [n, rows, cols] {
            out.extend((d as u32).to_be_bytes());
        }
        out.extend_from_slice(pixels);
        out
    }

    /// An IDX file of unsigned-byte labels.
    pub fn labels(y: &[u8]) -> Vec<u8> {
        let mut out = super::LABELS_MAGIC.to_be_bytes().to_vec();
        out.extend((y.len() as u32).to_be_bytes());
        out.extend_from_slice(y);
        out
    }

    /// `bytes` gzipped.
    pub fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        // Writes into a Vec cannot fail.
        e.write_all(bytes).expect("gzip into memory");
        e.finish().expect("gzip into memory")
    }
}

/// Writes a small IDX directory of `n` training and `n_test` test images of `rows x cols`
/// (pixels and labels a fixed function of the index, `classes` labels, every file gzipped
/// when `gz`): fixtures for tests of the loaders and the CLI (feature `test-utils`).
#[cfg(any(test, feature = "test-utils"))]
pub fn write_dir(
    dir: &Path,
    (n, n_test): (usize, usize),
    (rows, cols): (usize, usize),
    classes: u8,
    gz: bool,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (split, count, offset) in [("train", n, 0usize), ("t10k", n_test, n)] {
        if count == 0 {
            continue;
        }
        let y: Vec<u8> = (0..count).map(|i| ((i + offset) % usize::from(classes)) as u8).collect();
        // Pixels that depend on the label, so that a model can learn something.
        let pixels: Vec<u8> = (0..count * rows * cols)
            .map(|k| {
                let (i, p) = (k / (rows * cols), k % (rows * cols));
                ((usize::from(y[i]) * 37 + p * 11 + i) % 256) as u8
            })
            .collect();
        let files = [
            (format!("{split}-images-idx3-ubyte"), encode::images(count, rows, cols, &pixels)),
            (format!("{split}-labels-idx1-ubyte"), encode::labels(&y)),
        ];
        for (name, bytes) in files {
            let (name, bytes) =
                if gz { (format!("{name}.gz"), encode::gzip(&bytes)) } else { (name, bytes) };
            std::fs::write(dir.join(name), bytes)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::encode::*;
    use super::*;

    fn tiny() -> (Vec<u8>, Vec<u8>) {
        (images(2, 2, 3, &[0, 51, 102, 153, 204, 255, 255, 0, 0, 0, 0, 255]), labels(&[4, 1]))
    }

    #[test]
    fn images_and_labels_parse_plain_or_gzipped() {
        let (img, lab) = tiny();
        let d = Dataset::from_idx_bytes(&img, "i", &lab, "l").unwrap();
        assert_eq!((d.len(), d.sample_shape.clone(), d.classes), (2, vec![1, 2, 3], 5));
        assert_eq!(d.y, vec![4, 1]);
        assert_eq!(&d.x[..6], &[0.0, 0.2, 0.4, 0.6, 0.8, 1.0]);
        assert_eq!(d.x[6], 1.0);
        let gz = Dataset::from_idx_bytes(&gzip(&img), "i.gz", &gzip(&lab), "l.gz").unwrap();
        assert_eq!(gz, d);
        // Mixed: one file gzipped, the other not.
        assert_eq!(Dataset::from_idx_bytes(&img, "i", &gzip(&lab), "l.gz").unwrap(), d);
    }

    #[test]
    fn truncated_and_foreign_files_say_what_is_wrong() {
        let (img, lab) = tiny();
        let err =
            |i: &[u8], l: &[u8]| Dataset::from_idx_bytes(i, "i", l, "l").unwrap_err().to_string();
        let e = err(&img[..img.len() - 5], &lab);
        assert!(
            e.contains("in i:") && e.contains("2 x 2 x 3 = 12 bytes of data, the file has 7"),
            "{e}"
        );
        // A truncated .gz stream is the gzip layer's error.
        let gz = gzip(&img);
        let e = err(&gz[..gz.len() / 2], &lab);
        assert!(e.contains("gzip"), "{e}");
        let e = err(&lab, &lab);
        assert!(e.contains("wrong magic 0x00000801, expected 0x00000803"), "{e}");
        let e = err(&img, &img);
        assert!(e.contains("in l:") && e.contains("expected 0x00000801"), "{e}");
        assert!(err(&[], &lab).contains("empty file"));
        assert!(
            err(&img[..6], &lab).contains("header of 3 dimensions needs 16 bytes, the file has 6")
        );
        let mut long = img.clone();
        long.push(0);
        assert!(err(&long, &lab).contains("13 bytes of data after the header"));
        // Three labels for two images.
        let e = err(&img, &labels(&[0, 1, 2]));
        assert!(e.contains("3 labels for the 2 images of i"), "{e}");
    }

    #[test]
    fn a_directory_loads_with_or_without_its_test_split() {
        let dir = std::env::temp_dir().join(format!("shardline-idx-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_dir(&dir, (12, 5), (4, 3), 3, true).unwrap();
        let (train, test) = load_dir(&dir).unwrap();
        let test = test.unwrap();
        assert_eq!((train.len(), test.len(), train.classes), (12, 5, 3));
        assert_eq!(train.sample_shape, vec![1, 4, 3]);
        std::fs::remove_file(dir.join("t10k-labels-idx1-ubyte.gz")).unwrap();
        let e = load_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("t10k-labels-idx1-ubyte") && e.contains("missing file"), "{e}");
        std::fs::remove_file(dir.join("t10k-images-idx3-ubyte.gz")).unwrap();
        assert!(load_dir(&dir).unwrap().1.is_none());
        std::fs::remove_file(dir.join("train-images-idx3-ubyte.gz")).unwrap();
        let e = load_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("train-images-idx3-ubyte") && e.contains("missing file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
