//! torch's `state_dict` conventions, which the safetensors export writes and `--init-from`
//! reads: the element type torch gives each tensor, and the names under which torch lists a
//! tied parameter more than once.
//!
//! Shardline keeps every parameter and buffer as f32 in its flat buffers; torch keeps
//! BatchNorm's `num_batches_tracked` as an int64 scalar. nanoGPT ties `lm_head.weight` to
//! `transformer.wte.weight`: its `state_dict()` holds both keys (one tensor), so a strict
//! `load_state_dict` wants both.
//!
//! # Invariants
//!
//! - **CKPT-7**: the export is a torch `state_dict`: every parameter and buffer under its spec
//!   name and shape, as f32 except `num_batches_tracked` as int64 (the same count), and each
//!   tied parameter also under every torch alias of it ([`tied_aliases`]), so that
//!   `model.load_state_dict(safetensors.torch.load_file(f))` of the equivalent torch module
//!   loads it strictly, with no renaming.

use safetensors::Dtype;

/// The element type torch gives the tensor `name` of a `state_dict`: int64 for BatchNorm's
/// batch counter, f32 for the rest (Shardline trains in f32).
pub fn torch_dtype(name: &str) -> Dtype {
    if is_counter(name) {
        Dtype::I64
    } else {
        Dtype::F32
    }
}

/// Whether `name` is BatchNorm's batch counter (an integer in torch, an f32 here: exact up
/// to 2^24 steps).
pub fn is_counter(name: &str) -> bool {
    name == "num_batches_tracked" || name.ends_with(".num_batches_tracked")
}

/// The torch aliases of model `model`'s tied parameters: (alias, the spec name it shares
/// its tensor with). `gpt`: nanoGPT's `lm_head.weight` is `transformer.wte.weight`.
pub fn tied_aliases(model: &str) -> &'static [(&'static str, &'static str)] {
    match model {
        "gpt" => &[("lm_head.weight", "transformer.wte.weight")],
        _ => &[],
    }
}

/// Little-endian bytes of `vals` as torch's type for `name` ([`torch_dtype`]): an f32 count
/// becomes the int64 of the same value.
pub fn torch_bytes(name: &str, vals: &[f32]) -> Vec<u8> {
    if is_counter(name) {
        vals.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect()
    } else {
        vals.iter().flat_map(|v| v.to_le_bytes()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CKPT-7: only the batch counter changes type, and it keeps its value.
    #[test]
    fn ckpt_7_the_counter_is_int64_and_the_rest_f32() {
        assert_eq!(torch_dtype("layer1.0.bn1.num_batches_tracked"), Dtype::I64);
        assert_eq!(torch_dtype("bn1.num_batches_tracked"), Dtype::I64);
        assert_eq!(torch_dtype("bn1.running_var"), Dtype::F32);
        assert_eq!(torch_dtype("x.num_batches_tracked_not"), Dtype::F32);
        assert_eq!(torch_bytes("bn1.num_batches_tracked", &[37.0]), 37i64.to_le_bytes().to_vec());
        assert_eq!(torch_bytes("fc.bias", &[1.5]), 1.5f32.to_le_bytes().to_vec());
        assert_eq!(tied_aliases("gpt"), &[("lm_head.weight", "transformer.wte.weight")]);
        assert!(tied_aliases("resnet-bn").is_empty());
    }
}
