//! NumPy `.npy` arrays: samples `x` of shape `[N, ...]` and integer labels `y` of shape `[N]`.
//!
//! The format is read with the `npyz` crate (versions 1 to 3, either byte order, the header's
//! Python dict literal) rather than a parser of our own: it is the maintained successor of
//! `npy-rs` and reads headers alone, without pulling in `ndarray` as `ndarray-npy` would.
//! What is checked here: C order (a Fortran-order array is refused, not transposed), a plain
//! numeric dtype (`x`: f4, f8, u1-u8, i1-i8; `y`: u1-u8, i1-i8), a data part exactly as long
//! as the shape says, as many labels as samples, labels in `0..2^32`. Values of `x` are
//! divided by a scale; a sample has `x`'s shape without its first axis (`[1]` for a 1-D `x`);
//! `classes` is the largest label + 1.

use super::{Dataset, SampleKind};
use crate::error::ModelError;
use npyz::{DType, NpyFile, NpyHeader, Order, TypeChar};
use std::path::Path;

fn data_err(name: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Data { source_name: name.to_string(), msg: msg.into() }
}

/// An array's header, its dtype's kind and size, and its data bytes (checked to be as long
/// as the shape says).
fn open<'a>(
    bytes: &'a [u8],
    name: &str,
) -> Result<(NpyHeader, TypeChar, u64, &'a [u8]), ModelError> {
    if bytes.is_empty() {
        return Err(data_err(name, "empty file"));
    }
    let mut rest = bytes;
    let header = NpyHeader::from_reader(&mut rest)
        .map_err(|e| data_err(name, format!("not a readable .npy file: {e}")))?;
    if header.order() == Order::Fortran {
        return Err(data_err(name, "fortran_order is True: only C-order arrays are read"));
    }
    let DType::Plain(ts) = header.dtype() else {
        return Err(data_err(
            name,
            format!("dtype {}: only plain numeric arrays are read", header.dtype().descr()),
        ));
    };
    let item = ts.num_bytes().unwrap_or(0) as u64;
    let shape = header.shape().to_vec();
    let expected = shape.iter().try_fold(item, |a, &d| a.checked_mul(d));
    let Some(expected) = expected else {
        return Err(data_err(name, format!("shape {shape:?} overflows")));
    };
    let actual = rest.len() as u64;
    if actual != expected {
        let what = if actual < expected { "truncated: " } else { "" };
        return Err(data_err(
            name,
            format!(
                "{what}shape {shape:?} of dtype {ts} needs {expected} bytes of data, the file has {actual}"
            ),
        ));
    }
    Ok((header, ts.type_char(), ts.size_field(), rest))
}

fn read<T: npyz::Deserialize>(h: NpyHeader, data: &[u8], name: &str) -> Result<Vec<T>, ModelError> {
    NpyFile::with_header(h, data).into_vec::<T>().map_err(|e| data_err(name, e.to_string()))
}

/// The shape and values of a numeric array, as f32.
pub fn floats(bytes: &[u8], name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
    let (h, kind, size, data) = open(bytes, name)?;
    let shape = h.shape().iter().map(|&d| d as usize).collect();
    let descr = h.dtype().descr().replace('\'', "");
    let v: Vec<f32> = match (kind, size) {
        (TypeChar::Float, 4) => read::<f32>(h, data, name)?,
        (TypeChar::Float, 8) => read::<f64>(h, data, name)?.into_iter().map(|v| v as f32).collect(),
        (TypeChar::Uint, 1) => read::<u8>(h, data, name)?.into_iter().map(f32::from).collect(),
        (TypeChar::Uint, 2) => read::<u16>(h, data, name)?.into_iter().map(f32::from).collect(),
        (TypeChar::Uint, 4) => read::<u32>(h, data, name)?.into_iter().map(|v| v as f32).collect(),
        (TypeChar::Uint, 8) => read::<u64>(h, data, name)?.into_iter().map(|v| v as f32).collect(),
        (TypeChar::Int, 1) => read::<i8>(h, data, name)?.into_iter().map(f32::from).collect(),
        (TypeChar::Int, 2) => read::<i16>(h, data, name)?.into_iter().map(f32::from).collect(),
        (TypeChar::Int, 4) => read::<i32>(h, data, name)?.into_iter().map(|v| v as f32).collect(),
        (TypeChar::Int, 8) => read::<i64>(h, data, name)?.into_iter().map(|v| v as f32).collect(),
        _ => return Err(data_err(name, format!("dtype {descr}: samples must be numbers"))),
    };
    Ok((shape, v))
}

/// The shape and values of an integer array of labels, each checked to fit a `u32`.
pub fn labels(bytes: &[u8], name: &str) -> Result<(Vec<usize>, Vec<u32>), ModelError> {
    let (h, kind, size, data) = open(bytes, name)?;
    let shape = h.shape().iter().map(|&d| d as usize).collect();
    let descr = h.dtype().descr().replace('\'', "");
    let wide: Vec<i128> = match (kind, size) {
        (TypeChar::Uint, 1) => read::<u8>(h, data, name)?.into_iter().map(i128::from).collect(),
        (TypeChar::Uint, 2) => read::<u16>(h, data, name)?.into_iter().map(i128::from).collect(),
        (TypeChar::Uint, 4) => read::<u32>(h, data, name)?.into_iter().map(i128::from).collect(),
        (TypeChar::Uint, 8) => read::<u64>(h, data, name)?.into_iter().map(i128::from).collect(),
        (TypeChar::Int, 1) => read::<i8>(h, data, name)?.into_iter().map(i128::from).collect(),
        (TypeChar::Int, 2) => read::<i16>(h, data, name)?.into_iter().map(i128::from).collect(),
        (TypeChar::Int, 4) => read::<i32>(h, data, name)?.into_iter().map(i128::from).collect(),
        (TypeChar::Int, 8) => read::<i64>(h, data, name)?.into_iter().map(i128::from).collect(),
        _ => return Err(data_err(name, format!("dtype {descr}: labels must be integers"))),
    };
    let y = wide
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            u32::try_from(l).map_err(|_| {
                let why = if l < 0 { "is negative" } else { "does not fit 32 bits" };
                data_err(name, format!("label {l} at index {i} {why}"))
            })
        })
        .collect::<Result<_, _>>()?;
    Ok((shape, y))
}

impl Dataset {
    /// The data set of an `.npy` array of samples and one of labels (see the module doc);
    /// values are divided by `scale`; the names are the files', for errors.
    pub fn from_npy_bytes(
        x: &[u8],
        x_name: &str,
        y: &[u8],
        y_name: &str,
        scale: f32,
    ) -> Result<Dataset, ModelError> {
        let (xs, xv) = floats(x, x_name)?;
        let (ys, y) = labels(y, y_name)?;
        let Some((&n, rest)) = xs.split_first() else {
            return Err(data_err(x_name, "a 0-dimensional array: samples need shape [N, ...]"));
        };
        if ys.len() != 1 {
            return Err(data_err(y_name, format!("shape {ys:?}: labels need shape [N]")));
        }
        if ys[0] != n {
            return Err(data_err(
                y_name,
                format!("{} labels for the {n} samples of {x_name} (shape {xs:?})", ys[0]),
            ));
        }
        if n == 0 {
            return Err(data_err(x_name, "no samples"));
        }
        let sample_shape = if rest.is_empty() { vec![1] } else { rest.to_vec() };
        if sample_shape.contains(&0) {
            return Err(data_err(x_name, format!("shape {xs:?}: empty samples")));
        }
        let x: Vec<f32> = xv.into_iter().map(|v| v / scale).collect();
        // DATA-7: the first value that is no finite number, by sample and position.
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            let per: usize = sample_shape.iter().product();
            return Err(data_err(
                x_name,
                format!(
                    "sample {}, value {}: {} is not a finite number (after dividing by {scale})",
                    i / per,
                    i % per,
                    x[i]
                ),
            ));
        }
        let classes = y.iter().max().map_or(0, |&m| m as usize + 1);
        Ok(Dataset { x, y, sample_shape, classes, kind: SampleKind::Features })
    }
}

/// Reads the `.npy` files `x` and `y` (see [`Dataset::from_npy_bytes`]).
pub fn load(x: &Path, y: &Path, scale: f32) -> Result<Dataset, ModelError> {
    let (xb, yb) = (super::idx::read_file(x)?, super::idx::read_file(y)?);
    Dataset::from_npy_bytes(&xb, &x.display().to_string(), &yb, &y.display().to_string(), scale)
}

/// `.npy` bytes of an array (format version 1, or 2 when `v2`), as NumPy writes them: the
/// magic, the version, the header length, the header dict padded with spaces to a multiple
/// of 64 bytes with a closing newline, then the data. For tests (feature `test-utils`).
#[cfg(any(test, feature = "test-utils"))]
pub fn encode(descr: &str, shape: &[usize], data: &[u8], v2: bool) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let prefix = if v2 { 12 } else { 10 };
    while (prefix + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY".to_vec();
    if v2 {
        out.extend([2, 0]);
        out.extend((dict.len() as u32).to_le_bytes());
    } else {
        out.extend([1, 0]);
        out.extend((dict.len() as u16).to_le_bytes());
    }
    out.extend(dict.as_bytes());
    out.extend_from_slice(data);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f4(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn samples_and_labels_parse_in_several_dtypes() {
        let x = encode("<f4", &[3, 1, 2], &f4(&[0.0, 2.0, 4.0, 6.0, 8.0, 10.0]), false);
        let y = encode("<i8", &[3], &[2i64, 0, 1].map(i64::to_le_bytes).concat(), false);
        let d = Dataset::from_npy_bytes(&x, "x.npy", &y, "y.npy", 2.0).unwrap();
        assert_eq!((d.len(), d.sample_shape.clone(), d.classes), (3, vec![1, 2], 3));
        assert_eq!((d.x.clone(), d.y.clone()), (vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0], vec![2, 0, 1]));
        // The same values as bytes, big-endian f8, and labels as u1 / big-endian i4, format v2.
        let xb = encode("|u1", &[3, 1, 2], &[0, 2, 4, 6, 8, 10], true);
        let be8: Vec<u8> =
            [0.0f64, 2.0, 4.0, 6.0, 8.0, 10.0].iter().flat_map(|v| v.to_be_bytes()).collect();
        let xd = encode(">f8", &[3, 1, 2], &be8, false);
        let yb = encode("|u1", &[3], &[2, 0, 1], true);
        let yi = encode(">i4", &[3], &[2i32, 0, 1].map(i32::to_be_bytes).concat(), false);
        for (x, y) in [(&xb, &yb), (&xd, &yi), (&x, &yb)] {
            assert_eq!(Dataset::from_npy_bytes(x, "x", y, "y", 2.0).unwrap(), d);
        }
        // A 1-D x: one value per sample.
        let x1 = encode("<f4", &[3], &f4(&[1.0, 2.0, 3.0]), false);
        assert_eq!(Dataset::from_npy_bytes(&x1, "x", &y, "y", 1.0).unwrap().sample_shape, vec![1]);
    }

    #[test]
    fn bad_arrays_say_what_is_wrong() {
        let x = encode("<f4", &[2, 2], &f4(&[1.0, 2.0, 3.0, 4.0]), false);
        let y = encode("|u1", &[2], &[0, 1], false);
        let err = |x: &[u8], y: &[u8]| {
            Dataset::from_npy_bytes(x, "x.npy", y, "y.npy", 1.0).unwrap_err().to_string()
        };
        for (e, needle) in [
            (err(&x[..x.len() - 3], &y), "x.npy: truncated: shape [2, 2] of dtype <f4 needs 16 bytes of data, the file has 13"),
            (err(&x, &encode("|u1", &[3], &[0, 1, 1], false)), "y.npy: 3 labels for the 2 samples of x.npy"),
            (err(&x, &encode("|i1", &[2], &[0, 0xff], false)), "y.npy: label -1 at index 1 is negative"),
            (err(&x, &encode("<f4", &[2], &f4(&[0.0, 1.0]), false)), "y.npy: dtype <f4: labels must be integers"),
            (err(&x, &encode("|u1", &[2, 1], &[0, 1], false)), "y.npy: shape [2, 1]: labels need shape [N]"),
            (err(&[], &y), "x.npy: empty file"),
            (err(b"P5 2 2 255\n....", &y), "x.npy: not a readable .npy file"),
            // DATA-7.
            (err(&encode("<f4", &[2, 2], &f4(&[1.0, 2.0, 3.0, f32::NAN]), false), &y), "x.npy: sample 1, value 1: NaN is not a finite number"),
            (err(&encode("<f4", &[2, 2], &f4(&[f32::NEG_INFINITY, 2.0, 3.0, 4.0]), false), &y), "x.npy: sample 0, value 0: -inf is not a finite number"),
        ] {
            assert!(e.contains(needle), "{e}\n  lacks: {needle}");
        }
        let mut fortran = x.clone();
        let at = fortran.windows(5).position(|w| w == b"False").unwrap();
        fortran[at..at + 5].copy_from_slice(b"True ");
        assert!(err(&fortran, &y).contains("fortran_order is True"));
    }
}
