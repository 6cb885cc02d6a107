//! Transformer building blocks as pure kernels: forward and backward over row-major slices.
//!
//! A token stream is a `[rows, dim]` buffer, row-major, batch and time flattened into rows;
//! a kernel works row by row and never needs to know how the rows were made. Kernels keep no
//! state between calls and do no I/O: parameters come as a view into the caller's flat
//! buffer (laid out as the kernel's [`ParamSpec`](crate::ParamSpec)s, PyTorch's names),
//! outputs and gradients go into buffers the caller owns, and what backward needs from
//! forward is returned as a small value (per-row statistics), so that a layer can wrap a
//! kernel without copying.
//!
//! The kernels are generic over [`num_traits::Float`] (with [`Gemm`] where they multiply
//! matrices): the same code trains in `f32` and is checked in `f64`, where a central finite
//! difference is accurate enough to catch a single wrong gradient element (an `f32`
//! difference is not).
//!
//! - [`norm`]: LayerNorm and RMSNorm.
//! - [`activation`]: GELU (exact and tanh), SiLU.
//! - [`embedding`]: token embedding lookup.
//! - [`dropout`]: dropout whose mask depends on the element's place in the global batch.
//! - [`attention`]: causal multi-head self-attention with a blocked softmax, and nanoGPT's
//!   q/k/v split and head merge.
//! - [`attn_dropout`]: dropout of the attention probabilities, keyed by (sample, head,
//!   query, key), redrawn by the backward.
//! - [`exp`]: `exp` over rows for the softmaxes, vectorised in `f32`.
//! - [`gemm`]: the matrix products of the kernels (`f32` and `f64`) through the `gemm` crate.
//! - [`linear`]: fully connected kernel, `y = x W^T + b`.
//! - [`cross_entropy`]: token-level cross-entropy of logits against targets.
//! - [`gpt`]: a nanoGPT decoder built from the kernels above, with nanoGPT's parameter names.
//!
//! Invariants:
//! - `NN-1`: every backward is the exact derivative of its forward: each input and parameter
//!   gradient element agrees with an `f64` central finite difference of
//!   `L = sum(y * r)` (random `r`) to `1e-8`, and the same check fails when one element of
//!   the analytic gradient is off by ten times that.
//! - `NN-2`: the `f32` instance of a kernel computes what the `f64` instance computes, to
//!   `f32` rounding (forward and backward): there is no separate `f32` path.
//! - `NN-3`: parameter gradients are ADDED into the caller's gradient buffer (as
//!   `LAYER-1`); outputs and input gradients are written, overwriting what the buffer held.
//! - `NN-4`: a buffer whose length does not fit the kernel's shape is a
//!   [`ModelError::Shape`], returned before anything is written.

pub mod activation;
pub mod attention;
pub mod attn_dropout;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod exp;
pub mod gemm;
pub mod gpt;
#[cfg(test)]
pub(crate) mod gradcheck;
pub mod linear;
pub mod norm;
pub mod products;
pub mod transpose;

pub use activation::{Activation, Erf};
pub use cross_entropy::{cross_entropy_backward, cross_entropy_forward, CrossEntropySaved};
pub use embedding::Embedding;
pub use exp::RowExp;
pub use gemm::Gemm;
pub use gpt::{GptConfig, GptSaved};
pub use linear::Linear;
pub use norm::{LayerNorm, LayerNormSaved, RmsNorm, RmsNormSaved};
pub use transpose::Transpose;

use num_traits::Float;

use crate::error::ModelError;
use crate::layers::check_len;

/// `v` in the float type `T` (exact for the `f64` constants of the kernels; rounded for
/// `f32`).
pub(crate) fn lit<T: Float>(v: f64) -> T {
    T::from(v).expect("every f64 constant of the kernels converts to f32 and f64")
}

/// Rows of a `[rows, dim]` buffer of `len` values: `dim` must be positive and divide `len`.
pub(crate) fn rows(what: &str, len: usize, dim: usize) -> Result<usize, ModelError> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(ModelError::shape(what, format!("[rows, {dim}] with dim > 0"), len));
    }
    Ok(len / dim)
}

/// Checks that every buffer in `bufs` has `want` values (NN-4).
pub(crate) fn same_len(bufs: &[(&str, usize)], want: usize) -> Result<(), ModelError> {
    bufs.iter().try_for_each(|&(what, got)| check_len(what, got, want))
}
