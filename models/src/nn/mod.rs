//! Transformer building blocks as pure, float-generic kernels.

pub mod attention;
