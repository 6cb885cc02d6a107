//! # shardline-models
//!
//! Tensors, compute backends, layers as pure functions of `(params, input)`,
//! BatchNorm/SyncBatchNorm, the model zoo and data sets. Models never spawn a thread or an
//! actor; SyncBatchNorm reduces its statistics through a collectives lane it is handed.
#![deny(missing_docs)]

pub mod backend;
pub mod batchnorm;
pub mod conv;
pub mod data;
pub mod error;
pub mod lane;
pub mod layers;
pub mod loss;
pub mod model;
pub mod rng;
pub mod spec;
pub mod tensor;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
#[cfg(test)]
mod testutil;
pub mod zoo;

pub use backend::{gemm_gflops, Backend, Cpu};
pub use batchnorm::{BatchNorm, BnKind, CountingReducer, StatsReducer};
pub use conv::Conv2d;
pub use data::{Dataset, DistributedSampler};
pub use error::ModelError;
pub use lane::LaneReducer;
pub use layers::{Linear, MaxPool2d};
pub use loss::softmax_cross_entropy;
pub use model::{convert_sync_batchnorm, Ctx, Layer, Model, UnitSaved, WrapPolicy};
pub use spec::{ModelSpec, ParamSpec, UnitSpec};
pub use tensor::Tensor;
pub use zoo::{ConvNetBn, MlpBn, WideMlp};
