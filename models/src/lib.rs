//! # shardline-models
//!
//! Tensors, compute backends, layers as pure functions of `(params, input)`,
//! BatchNorm/SyncBatchNorm, the model zoo and data sets. Models never spawn a thread or an
//! actor; SyncBatchNorm reduces its statistics through a collectives lane it is handed.
#![deny(missing_docs)]

pub mod spec;
pub use spec::{ModelSpec, ParamSpec, UnitSpec};
