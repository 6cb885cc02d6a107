//! CSV data sets: one sample per line, `label,v0,v1,...`.
//!
//! A first line whose first field is not an unsigned integer is a header and is skipped
//! (the bundled digits file has one; a file of numbers alone has none); every other
//! non-blank line is one sample. Values are divided by a scale (digits: 16). Every row must
//! have as many values as the first; a file with no sample is an error.

use super::{Dataset, SampleKind};
use crate::error::ModelError;

impl Dataset {
    /// Parses CSV `text` whose samples have `sample_shape` (as many values per row as the
    /// shape holds); values are divided by `scale`; `classes` is the largest label + 1.
    pub fn from_csv(
        text: &str,
        source_name: &str,
        sample_shape: Vec<usize>,
        scale: f32,
    ) -> Result<Self, ModelError> {
        let numel: usize = sample_shape.iter().product();
        let (x, y, _) = parse(text, source_name, Some(numel), scale)?;
        Ok(labelled(x, y, sample_shape))
    }

    /// Parses CSV `text` whose samples are flat vectors, as many values as the first row has
    /// (`sample_shape = [values]`); values are divided by `scale`.
    pub fn from_csv_rows(text: &str, source_name: &str, scale: f32) -> Result<Self, ModelError> {
        let (x, y, numel) = parse(text, source_name, None, scale)?;
        Ok(labelled(x, y, vec![numel]))
    }
}

fn labelled(x: Vec<f32>, y: Vec<u32>, sample_shape: Vec<usize>) -> Dataset {
    let classes = y.iter().max().map_or(0, |&m| m as usize + 1);
    Dataset { x, y, sample_shape, classes, kind: SampleKind::Features }
}

/// Rows of `text`: (values, labels, values per row); `numel` fixes the values per row, else
/// the first row does.
fn parse(
    text: &str,
    source_name: &str,
    mut numel: Option<usize>,
    scale: f32,
) -> Result<(Vec<f32>, Vec<u32>, usize), ModelError> {
    let err = |msg: String| ModelError::Data { source_name: source_name.to_string(), msg };
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for (ln, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let mut fields = line.split(',');
        let first = fields.next().unwrap_or("").trim();
        let label: u32 = match first.parse() {
            Ok(l) => l,
            // A header names its columns; a later line that does not start with a label is
            // a broken row.
            Err(_) if ln == 0 => continue,
            Err(e) => return Err(err(format!("line {}: label {first:?}: {e}", ln + 1))),
        };
        let before = x.len();
        for f in fields {
            let v: f32 =
                f.trim().parse().map_err(|e| err(format!("line {}: value {f:?}: {e}", ln + 1)))?;
            // DATA-7: "nan" and "inf" parse as floats but are no data.
            if !(v / scale).is_finite() {
                return Err(err(format!(
                    "line {}: value {f:?} is not a finite number (after dividing by {scale})",
                    ln + 1
                )));
            }
            x.push(v / scale);
        }
        let got = x.len() - before;
        match numel {
            Some(n) if got != n => {
                return Err(err(format!("line {}: {got} values, expected {n}", ln + 1)))
            }
            Some(_) => {}
            None if got == 0 => return Err(err(format!("line {}: a label but no values", ln + 1))),
            None => numel = Some(got),
        }
        y.push(label);
    }
    match numel {
        Some(n) if !y.is_empty() => Ok((x, y, n)),
        _ => Err(err("no samples (an empty file, or a header alone)".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_with_or_without_a_header_parse_alike() {
        let body = "2,0,5,10\n0,10,10,0\n\n1,5,0,5\n";
        let plain = Dataset::from_csv_rows(body, "t.csv", 10.0).unwrap();
        let headed =
            Dataset::from_csv_rows(&format!("label,a,b,c\n{body}"), "t.csv", 10.0).unwrap();
        assert_eq!(plain, headed);
        assert_eq!((plain.len(), plain.sample_shape.clone(), plain.classes), (3, vec![3], 3));
        assert_eq!(plain.y, vec![2, 0, 1]);
        assert_eq!(plain.x, vec![0.0, 0.5, 1.0, 1.0, 1.0, 0.0, 0.5, 0.0, 0.5]);
        let shaped = Dataset::from_csv(body, "t.csv", vec![1, 1, 3], 10.0).unwrap();
        assert_eq!((shaped.x, shaped.sample_shape), (plain.x, vec![1, 1, 3]));
    }

    #[test]
    fn bad_csv_is_a_clear_error() {
        let e = Dataset::from_csv("label,a,b\n1,2\n", "t.csv", vec![2], 1.0).unwrap_err();
        assert!(e.to_string().contains("t.csv") && e.to_string().contains("line 2"), "{e}");
        assert!(Dataset::from_csv("h\nx,1,2\n", "t.csv", vec![2], 1.0).is_err());
        // Rows that disagree in length, a negative label, a bad value, nothing at all.
        for (text, needle) in [
            ("1,2,3\n0,1\n", "line 2: 1 values, expected 2"),
            ("1,2\n-1,3\n", "line 2: label \"-1\""),
            ("1,2\n0,abc\n", "line 2: value \"abc\""),
            ("", "no samples"),
            ("label,a\n", "no samples"),
            ("3\n", "line 1: a label but no values"),
            // DATA-7.
            ("1,2\n0,nan\n", "line 2: value \"nan\" is not a finite number"),
            ("1,-inf\n", "line 1: value \"-inf\" is not a finite number"),
        ] {
            let e = Dataset::from_csv_rows(text, "bad.csv", 1.0).unwrap_err().to_string();
            assert!(e.contains("bad.csv") && e.contains(needle), "{text:?}: {e}");
        }
        // DATA-7 after the scale: finite in the file, infinite once divided.
        let e = Dataset::from_csv_rows("1,3e38\n", "big.csv", 0.001).unwrap_err().to_string();
        assert!(
            e.contains("value \"3e38\" is not a finite number (after dividing by 0.001)"),
            "{e}"
        );
    }
}
