//! Weights from a torch-named safetensors file (`shardline train --init-from FILE`): a
//! torch `state_dict` saved with `safetensors.torch.save_file`, or Shardline's own export.
//!
//! The match is strict, as torch's `load_state_dict(strict=True)`: every parameter and
//! buffer of the model must be in the file under its name, of its shape, and the file may
//! hold nothing else, except a tied parameter's torch alias ([`tied_aliases`]), which may be
//! absent (a file saved without the duplicate) or present and equal to the parameter.
//!
//! Element types: parameters and float buffers take f32, and also f64 (rounded to the
//! nearest f32, as torch's `copy_` rounds), bf16 and f16 (widened exactly); BatchNorm's
//! `num_batches_tracked` takes torch's int64 (or int32, or an f32 count, what exports
//! before CKPT-7 wrote). Anything else is a wrong type.
//!
//! # Invariants
//!
//! - **CKPT-8**: `--init-from` of an export starts training from exactly the exported values
//!   (bitwise, every parameter and buffer, at any world size and stage); a file that does
//!   not match is refused before any rank starts, naming every missing, unexpected, wrongly
//!   shaped and wrongly typed tensor (exit 2).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use safetensors::Dtype;
use shardline_models::module::{Loss, Saved};
use shardline_models::{CallBackward, ModelError, ModelSpec, Network, Tensor};
use shardline_models::{Ctx, InputGrad};

use super::torch::{is_counter, tied_aliases};
use crate::error::{Result, RuntimeError};

/// A model's starting values, per unit in its spec's order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TorchWeights {
    /// Each unit's flat parameters.
    pub params: Vec<Vec<f32>>,
    /// Each unit's flat buffers.
    pub buffers: Vec<Vec<f32>>,
}

/// What keeps a file from matching a model; every list is sorted by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Mismatch {
    /// The model's tensors the file lacks.
    pub missing: Vec<String>,
    /// The file's tensors the model does not have.
    pub unexpected: Vec<String>,
    /// (name, the file's shape, the model's shape).
    pub wrong_shape: Vec<(String, Vec<usize>, Vec<usize>)>,
    /// (name, the file's type, the types accepted).
    pub wrong_dtype: Vec<(String, Dtype, &'static str)>,
    /// Tied aliases whose values differ from their parameter's.
    pub untied: Vec<String>,
}

impl Mismatch {
    fn is_empty(&self) -> bool {
        self.missing.is_empty()
            && self.unexpected.is_empty()
            && self.wrong_shape.is_empty()
            && self.wrong_dtype.is_empty()
            && self.untied.is_empty()
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |v: &[String]| v.join(", ");
        if !self.missing.is_empty() {
            writeln!(f, "  missing ({}): {}", self.missing.len(), list(&self.missing))?;
        }
        if !self.unexpected.is_empty() {
            writeln!(f, "  unexpected ({}): {}", self.unexpected.len(), list(&self.unexpected))?;
        }
        if !self.wrong_shape.is_empty() {
            let v: Vec<String> = self
                .wrong_shape
                .iter()
                .map(|(n, got, want)| format!("{n} {got:?} (model {want:?})"))
                .collect();
            writeln!(f, "  wrong shape ({}): {}", v.len(), list(&v))?;
        }
        if !self.wrong_dtype.is_empty() {
            let v: Vec<String> = self
                .wrong_dtype
                .iter()
                .map(|(n, got, want)| format!("{n} {got:?} (want {want})"))
                .collect();
            writeln!(f, "  wrong dtype ({}): {}", v.len(), list(&v))?;
        }
        if !self.untied.is_empty() {
            writeln!(
                f,
                "  tied alias differs from its parameter ({}): {}",
                self.untied.len(),
                list(&self.untied)
            )?;
        }
        Ok(())
    }
}

const FLOATS: &str = "F32, F64, BF16 or F16";
const COUNTS: &str = "I64, I32 or F32";

/// The values of one tensor as f32, or `None` for a type `name` does not take.
fn to_f32(name: &str, dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    fn le<const N: usize>(data: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        data.chunks_exact(N).map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            a
        })
    }
    Some(match (is_counter(name), dtype) {
        (_, Dtype::F32) => le::<4>(data).map(f32::from_le_bytes).collect(),
        (true, Dtype::I64) => le::<8>(data).map(|b| i64::from_le_bytes(b) as f32).collect(),
        (true, Dtype::I32) => le::<4>(data).map(|b| i32::from_le_bytes(b) as f32).collect(),
        (false, Dtype::F64) => le::<8>(data).map(|b| f64::from_le_bytes(b) as f32).collect(),
        (false, Dtype::BF16) => {
            le::<2>(data).map(|b| f32::from_bits((u16::from_le_bytes(b) as u32) << 16)).collect()
        }
        (false, Dtype::F16) => {
            le::<2>(data).map(|b| half::f16::from_le_bytes(b).to_f32()).collect()
        }
        _ => return None,
    })
}

/// One tensor of a file: name, element type, shape, little-endian data.
pub type FileTensor<'a> = (String, Dtype, Vec<usize>, &'a [u8]);

/// Matches a file's tensors against `spec` (CKPT-8): the starting values per unit, or every
/// way they do not match. Pure: no I/O.
pub fn match_torch_weights(
    spec: &ModelSpec,
    tensors: &[FileTensor<'_>],
) -> std::result::Result<TorchWeights, Mismatch> {
    // name -> (unit, is a buffer, offset, shape)
    let mut want: BTreeMap<&str, (usize, bool, usize, &[usize])> = BTreeMap::new();
    let mut out = TorchWeights::default();
    for (u, unit) in spec.units.iter().enumerate() {
        for (buffers, list) in [(false, &unit.params), (true, &unit.buffers)] {
            let mut off = 0;
            for p in list {
                want.insert(p.name.as_str(), (u, buffers, off, p.shape.as_slice()));
                off += p.numel();
            }
            let v = if buffers { &mut out.buffers } else { &mut out.params };
            v.push(vec![0.0; off]);
        }
    }
    let aliases: HashMap<&str, &str> = tied_aliases(&spec.name).iter().copied().collect();
    let mut bad = Mismatch::default();
    let mut found: HashMap<&str, Vec<f32>> = HashMap::new();
    // Names the file holds, matched or not: a wrong one is listed as wrong, not missing.
    let mut present = std::collections::HashSet::new();
    let mut alias_values = Vec::new();
    for (name, dtype, shape, data) in tensors {
        let target = want
            .get(name.as_str())
            .or_else(|| aliases.get(name.as_str()).and_then(|source| want.get(source)));
        let Some(&(u, buffers, off, want_shape)) = target else {
            bad.unexpected.push(name.clone());
            continue;
        };
        present.insert(name.as_str());
        if shape.as_slice() != want_shape {
            bad.wrong_shape.push((name.clone(), shape.clone(), want_shape.to_vec()));
            continue;
        }
        let Some(vals) = to_f32(name, *dtype, data) else {
            let accepted = if is_counter(name) { COUNTS } else { FLOATS };
            bad.wrong_dtype.push((name.clone(), *dtype, accepted));
            continue;
        };
        if let Some(source) = aliases.get(name.as_str()) {
            alias_values.push((name.clone(), *source, vals));
            continue;
        }
        let v = if buffers { &mut out.buffers[u] } else { &mut out.params[u] };
        v[off..off + vals.len()].copy_from_slice(&vals);
        found.insert(want.get_key_value(name.as_str()).map_or("", |(k, _)| k), vals);
    }
    bad.missing = want.keys().filter(|n| !present.contains(*n)).map(|n| n.to_string()).collect();
    // A missing source is reported missing above; a present one must equal its alias.
    for (alias, source, vals) in alias_values {
        let same = |a: &[f32]| a.iter().zip(&vals).all(|(x, y)| x.to_bits() == y.to_bits());
        if found.get(source).is_some_and(|s| !same(s)) {
            bad.untied.push(alias);
        }
    }
    bad.unexpected.sort();
    bad.wrong_shape.sort();
    bad.wrong_dtype.sort_by(|a, b| a.0.cmp(&b.0));
    if bad.is_empty() {
        Ok(out)
    } else {
        Err(bad)
    }
}

/// Reads `path` and matches it against `spec` (CKPT-8); any failure is a configuration
/// error (exit 2) naming the file.
pub fn load_torch_weights(path: &Path, spec: &ModelSpec) -> Result<TorchWeights> {
    let what = format!("--init-from {}", path.display());
    let bytes = std::fs::read(path).map_err(|e| RuntimeError::config(format!("{what}: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| RuntimeError::config(format!("{what}: not a safetensors file: {e}")))?;
    let tensors: Vec<FileTensor<'_>> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data()))
        .collect();
    match_torch_weights(spec, &tensors).map_err(|m| {
        RuntimeError::config(format!(
            "{what} does not match the model {} (strict, as torch's load_state_dict):\n{}",
            spec.name,
            m.to_string().trim_end()
        ))
    })
}

/// A network that starts from given values instead of its own initialisation: everything
/// else is the inner network's.
#[derive(Debug)]
pub struct Initialized {
    inner: Arc<dyn Network>,
    weights: TorchWeights,
}

impl Initialized {
    /// `inner` started from `weights` (as [`match_torch_weights`] returns them for its spec).
    pub fn new(inner: Arc<dyn Network>, weights: TorchWeights) -> Self {
        Initialized { inner, weights }
    }
}

fn unit_values(
    v: &[Vec<f32>],
    unit: usize,
    what: &str,
) -> std::result::Result<Vec<f32>, ModelError> {
    v.get(unit)
        .cloned()
        .ok_or_else(|| ModelError::Config(format!("--init-from: no {what} of unit {unit}")))
}

impl Network for Initialized {
    fn spec(&self) -> ModelSpec {
        self.inner.spec()
    }
    fn calls(&self) -> Vec<usize> {
        self.inner.calls()
    }
    fn init_params(&self, unit: usize, _seed: u64) -> std::result::Result<Vec<f32>, ModelError> {
        unit_values(&self.weights.params, unit, "parameters")
    }
    fn init_buffers(&self, unit: usize) -> std::result::Result<Vec<f32>, ModelError> {
        unit_values(&self.weights.buffers, unit, "buffers")
    }
    fn forward_call(
        &self,
        call: usize,
        params: &[f32],
        buffers: &mut [f32],
        x: Tensor,
        ctx: &Ctx,
    ) -> std::result::Result<(Tensor, Saved), ModelError> {
        self.inner.forward_call(call, params, buffers, x, ctx)
    }
    fn backward_call(
        &self,
        call: usize,
        b: CallBackward<'_>,
        ctx: &Ctx,
    ) -> std::result::Result<InputGrad, ModelError> {
        self.inner.backward_call(call, b, ctx)
    }
    fn loss(&self) -> &dyn Loss {
        self.inner.loss()
    }
    fn has_local_batchnorm(&self) -> bool {
        self.inner.has_local_batchnorm()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_models::{ParamSpec, UnitSpec};

    fn p(name: &str, shape: &[usize]) -> ParamSpec {
        ParamSpec { name: name.into(), shape: shape.to_vec() }
    }

    fn spec(name: &str) -> ModelSpec {
        ModelSpec {
            name: name.into(),
            units: vec![
                UnitSpec {
                    name: "transformer".into(),
                    params: vec![p("transformer.wte.weight", &[2, 2]), p("b", &[1])],
                    buffers: vec![p("bn.running_mean", &[2]), p("bn.num_batches_tracked", &[])],
                },
                UnitSpec {
                    name: "head".into(),
                    params: vec![p("fc.weight", &[3])],
                    buffers: vec![],
                },
            ],
        }
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// CKPT-8: every value lands where the spec puts it; the alias may be absent or equal.
    #[test]
    fn ckpt_8_values_land_by_name_in_any_file_order() {
        let (wte, rm, fc) = (f32s(&[1., 2., 3., 4.]), f32s(&[6., 7.]), f32s(&[8., 9., 10.]));
        let nbt = 3i64.to_le_bytes();
        let b64 = 5.0f64.to_le_bytes();
        let mut t: Vec<FileTensor<'_>> = vec![
            ("fc.weight".into(), Dtype::F32, vec![3], &fc),
            ("bn.num_batches_tracked".into(), Dtype::I64, vec![], &nbt),
            ("b".into(), Dtype::F64, vec![1], &b64),
            ("bn.running_mean".into(), Dtype::F32, vec![2], &rm),
            ("transformer.wte.weight".into(), Dtype::F32, vec![2, 2], &wte),
        ];
        let want = TorchWeights {
            params: vec![vec![1., 2., 3., 4., 5.], vec![8., 9., 10.]],
            buffers: vec![vec![6., 7., 3.], vec![]],
        };
        assert_eq!(match_torch_weights(&spec("gpt"), &t).unwrap(), want);
        t.push(("lm_head.weight".into(), Dtype::F32, vec![2, 2], &wte));
        assert_eq!(match_torch_weights(&spec("gpt"), &t).unwrap(), want);
        // Another model has no such alias.
        let e = match_torch_weights(&spec("resnet-bn"), &t).unwrap_err();
        assert_eq!(e.unexpected, vec!["lm_head.weight".to_string()]);
    }

    /// CKPT-8: every kind of mismatch is listed, all at once.
    #[test]
    fn ckpt_8_every_mismatch_is_listed() {
        let wte = f32s(&[1., 2., 3., 4.]);
        let other = f32s(&[1., 2., 3., 5.]);
        let short = f32s(&[1., 2.]);
        let nbt = 3i64.to_le_bytes();
        let t: Vec<FileTensor<'_>> = vec![
            ("transformer.wte.weight".into(), Dtype::F32, vec![2, 2], &wte),
            ("lm_head.weight".into(), Dtype::F32, vec![2, 2], &other),
            ("bn.running_mean".into(), Dtype::I64, vec![2], &wte),
            ("bn.num_batches_tracked".into(), Dtype::BOOL, vec![], &nbt),
            ("fc.weight".into(), Dtype::F32, vec![2], &short),
            ("extra.weight".into(), Dtype::F32, vec![2], &short),
        ];
        let e = match_torch_weights(&spec("gpt"), &t).unwrap_err();
        assert_eq!(e.missing, vec!["b"]);
        assert_eq!(e.unexpected, vec!["extra.weight"]);
        assert_eq!(e.wrong_shape, vec![("fc.weight".to_string(), vec![2], vec![3])]);
        let dt: Vec<_> = e.wrong_dtype.iter().map(|(n, d, _)| (n.as_str(), *d)).collect();
        assert_eq!(
            dt,
            vec![("bn.num_batches_tracked", Dtype::BOOL), ("bn.running_mean", Dtype::I64)]
        );
        assert_eq!(e.untied, vec!["lm_head.weight"]);
        let text = e.to_string();
        for want in [
            "missing (1): b",
            "unexpected (1): extra.weight",
            "fc.weight [2] (model [3])",
            "want I64, I32 or F32",
            "tied alias differs",
        ] {
            assert!(text.contains(want), "{want:?} not in\n{text}");
        }
    }

    #[test]
    fn half_and_bf16_widen_exactly() {
        let bf = [0x80u8, 0x3f]; // bf16 1.0
        let h = half::f16::from_f32(-2.5).to_le_bytes();
        assert_eq!(to_f32("w", Dtype::BF16, &bf), Some(vec![1.0]));
        assert_eq!(to_f32("w", Dtype::F16, &h), Some(vec![-2.5]));
        assert_eq!(to_f32("w", Dtype::I64, &[0; 8]), None);
    }
}
