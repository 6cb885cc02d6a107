//! Export of a checkpoint's consolidated model to safetensors, and a human summary of a
//! checkpoint ([`inspect`]).
//!
//! # Invariants
//!
//! - **CKPT-4**: the export holds every parameter and buffer once, under its stable spec
//!   name, in its original shape, equal to the consolidated flat buffer (and, as torch's
//!   `state_dict` does, a tied parameter once more under its torch alias, CKPT-7).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use super::torch::{tied_aliases, torch_bytes, torch_dtype};
use super::{Checkpoint, MANIFEST};
use crate::engine::PrecisionDtype;
use crate::error::{Result, RuntimeError};
use crate::memory::format_bytes;
use crate::shard::FlatLayout;

/// Writes the consolidated model of the checkpoint at `dir` (a `step-N` directory or a root,
/// meaning its newest) to a safetensors file: every parameter and buffer under its stable
/// spec name and original shape (CKPT-4), in torch's types and with torch's aliases of tied
/// parameters (CKPT-7), floats as the f32 masters. Returns the number of tensors written.
pub fn export_safetensors(dir: impl AsRef<Path>, out: impl AsRef<Path>) -> Result<usize> {
    export_safetensors_as(dir, out, PrecisionDtype::F32)
}

/// [`export_safetensors`] with the floats in `float` (`checkpoint export --dtype`): in bf16
/// each master rounded to the nearest bf16, the batch counters int64 still (CKPT-9).
pub fn export_safetensors_as(
    dir: impl AsRef<Path>,
    out: impl AsRef<Path>,
    float: PrecisionDtype,
) -> Result<usize> {
    Checkpoint::open(dir)?.export_safetensors_as(out, float)
}

impl Checkpoint {
    /// See [`export_safetensors`].
    pub fn export_safetensors(&self, out: impl AsRef<Path>) -> Result<usize> {
        self.export_safetensors_as(out, PrecisionDtype::F32)
    }

    /// See [`export_safetensors_as`].
    pub fn export_safetensors_as(
        &self,
        out: impl AsRef<Path>,
        float: PrecisionDtype,
    ) -> Result<usize> {
        let out = out.as_ref();
        let units = self.consolidate()?;
        let buffers = self.buffers()?;
        let m = self.manifest();
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for ((u, spec), b) in units.iter().zip(&m.model.units).zip(&buffers) {
            let layout = FlatLayout::new(spec, 1)?;
            for (slot, view) in layout.params().iter().zip(layout.views(&u.params)) {
                let bytes = torch_bytes(&slot.name, view, float);
                tensors.push((slot.name.clone(), slot.shape.clone(), bytes));
            }
            let mut off = 0;
            for buf in &spec.buffers {
                let n = buf.numel();
                let bytes = torch_bytes(&buf.name, &b[off..off + n], float);
                off += n;
                tensors.push((buf.name.clone(), buf.shape.clone(), bytes));
            }
        }
        for (alias, source) in tied_aliases(&m.model.name) {
            if let Some((_, shape, bytes)) = tensors.iter().find(|(n, _, _)| n == source) {
                let t = (alias.to_string(), shape.clone(), bytes.clone());
                tensors.push(t);
            }
        }
        let mut seen = HashSet::new();
        for (name, _, _) in &tensors {
            if !seen.insert(name.as_str()) {
                return Err(RuntimeError::checkpoint(
                    self.dir().join(MANIFEST),
                    format!("tensor name '{name}' appears twice; cannot export"),
                ));
            }
        }
        let views = tensors
            .iter()
            .map(|(n, shape, bytes)| {
                safetensors::tensor::TensorView::new(torch_dtype(n, float), shape.clone(), bytes)
                    .map(|v| (n.clone(), v))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| RuntimeError::checkpoint(out, format!("safetensors: {e}")))?;
        let meta: HashMap<String, String> = [
            ("format".to_string(), "pt".to_string()),
            ("model".to_string(), m.model.name.clone()),
            ("step".to_string(), m.step.to_string()),
            ("dtype".to_string(), float.name().to_string()),
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
    let m = ck.manifest();
    let mut s = String::new();
    let _ = writeln!(s, "checkpoint {}", ck.dir().display());
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
        let on_disk = fs::metadata(ck.dir().join(&f.file)).map(|md| md.len()).ok();
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
    use crate::checkpoint::fixtures::{saved_once, spec};

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

    /// CKPT-9: the bf16 export holds the same names and shapes, every float the f32
    /// export's value rounded to the nearest bf16 (within 2^-8 relative), in half the bytes.
    #[test]
    fn bf16_export_rounds_the_f32_export_ckpt_9() {
        let (tmp, _dir) = saved_once();
        let (f32_out, bf16_out) = (tmp.path().join("f32.st"), tmp.path().join("bf16.st"));
        export_safetensors(tmp.path(), &f32_out).unwrap();
        let n = export_safetensors_as(tmp.path(), &bf16_out, PrecisionDtype::Bf16).unwrap();
        let (a, b) = (fs::read(&f32_out).unwrap(), fs::read(&bf16_out).unwrap());
        let (a, b) = (
            safetensors::SafeTensors::deserialize(&a).unwrap(),
            safetensors::SafeTensors::deserialize(&b).unwrap(),
        );
        assert_eq!(n, a.len());
        let mut rounded = 0;
        for (name, t) in a.tensors() {
            let h = b.tensor(&name).unwrap();
            assert_eq!(h.shape(), t.shape(), "{name}");
            if t.dtype() != safetensors::Dtype::F32 {
                assert_eq!((h.dtype(), h.data()), (t.dtype(), t.data()), "{name}: not a float");
                continue;
            }
            assert_eq!(h.dtype(), safetensors::Dtype::BF16, "{name}");
            assert_eq!(h.data().len() * 2, t.data().len(), "{name}: half the bytes");
            for (x, y) in t.data().chunks_exact(4).zip(h.data().chunks_exact(2)) {
                let x = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                let y = f32::from_bits(u32::from(u16::from_le_bytes([y[0], y[1]])) << 16);
                assert!((x - y).abs() <= x.abs() * 2f32.powi(-8), "{name}: {x} -> {y}");
                rounded += usize::from(x != y);
            }
        }
        assert!(rounded > 0, "some values need rounding to bf16");
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
}
