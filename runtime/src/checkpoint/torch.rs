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
//! - **CKPT-9**: `checkpoint export --dtype bf16` writes every float tensor as BF16, each
//!   value the f32 master rounded to the nearest bf16 (ties to even, `half::bf16::from_f32`,
//!   so within 2^-8 of it, relative), and `num_batches_tracked` as int64 still: the
//!   `state_dict` of the torch module after `.bfloat16()`. The default (`f32`) writes the
//!   masters bitwise (CKPT-4).

use safetensors::Dtype;

use crate::engine::PrecisionDtype;

/// The element type torch gives the tensor `name` of a `state_dict` whose floats are
/// `float`: int64 for BatchNorm's batch counter, `float` for the rest (CKPT-9).
pub fn torch_dtype(name: &str, float: PrecisionDtype) -> Dtype {
    match (is_counter(name), float) {
        (true, _) => Dtype::I64,
        (false, PrecisionDtype::F32) => Dtype::F32,
        (false, PrecisionDtype::Bf16) => Dtype::BF16,
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
/// becomes the int64 of the same value; a float in bf16 is rounded to nearest even (CKPT-9).
pub fn torch_bytes(name: &str, vals: &[f32], float: PrecisionDtype) -> Vec<u8> {
    match (is_counter(name), float) {
        (true, _) => vals.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect(),
        (false, PrecisionDtype::F32) => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        (false, PrecisionDtype::Bf16) => {
            vals.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F32: PrecisionDtype = PrecisionDtype::F32;
    const BF16: PrecisionDtype = PrecisionDtype::Bf16;

    /// CKPT-7: only the batch counter changes type, and it keeps its value.
    #[test]
    fn ckpt_7_the_counter_is_int64_and_the_rest_f32() {
        assert_eq!(torch_dtype("layer1.0.bn1.num_batches_tracked", F32), Dtype::I64);
        assert_eq!(torch_dtype("bn1.num_batches_tracked", F32), Dtype::I64);
        assert_eq!(torch_dtype("bn1.running_var", F32), Dtype::F32);
        assert_eq!(torch_dtype("x.num_batches_tracked_not", F32), Dtype::F32);
        let count = torch_bytes("bn1.num_batches_tracked", &[37.0], F32);
        assert_eq!(count, 37i64.to_le_bytes().to_vec());
        assert_eq!(torch_bytes("fc.bias", &[1.5], F32), 1.5f32.to_le_bytes().to_vec());
        assert_eq!(tied_aliases("gpt"), &[("lm_head.weight", "transformer.wte.weight")]);
        assert!(tied_aliases("resnet-bn").is_empty());
    }

    /// CKPT-9: in bf16 the floats round to nearest, ties to even, and the counter stays an
    /// int64 of the same value.
    #[test]
    fn ckpt_9_bf16_rounds_the_floats_and_keeps_the_counter() {
        assert_eq!(torch_dtype("bn1.running_var", BF16), Dtype::BF16);
        assert_eq!(torch_dtype("bn1.num_batches_tracked", BF16), Dtype::I64);
        let count = torch_bytes("bn1.num_batches_tracked", &[37.0], BF16);
        assert_eq!(count, 37i64.to_le_bytes().to_vec());
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even 1.0 (0x3f80);
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: to the even 0x3f82.
        // Just above a tie rounds up; 1.5 is exact.
        let vals = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            1.0 + 2f32.powi(-8) + 2f32.powi(-20),
            1.5,
        ];
        let want: Vec<u8> =
            [0x3f80u16, 0x3f82, 0x3f81, 0x3fc0].iter().flat_map(|h| h.to_le_bytes()).collect();
        assert_eq!(torch_bytes("fc.weight", &vals, BF16), want);
    }
}
