//! # shardline-models
//!
//! Tensors, compute backends, layers as pure functions of `(params, input)`,
//! BatchNorm/SyncBatchNorm, transformer kernels ([`nn`]), the model zoo, data sets and text
//! corpora for language models ([`text`]).
//! Models never spawn a thread or an actor; SyncBatchNorm reduces its statistics through the
//! [`StatsReducer`] it is handed (the runtime's, on its `stats` lane), whose failures are
//! typed ([`StatsError`]). The crate depends on no transport.
//!
//! ```
//! use shardline_models::{convert_sync_batchnorm, Cpu, Ctx, Dataset, MlpBn, softmax_cross_entropy};
//!
//! let data = Dataset::digits(false)?;
//! let mut model = MlpBn::digits().build();
//! convert_sync_batchnorm(&mut model); // with one rank (no reducer) it is plain BatchNorm
//! let spec = model.spec(); // names, shapes, units
//! assert_eq!(spec.units[0].params[0].name, "blocks.0.linear.weight");
//! let params: Vec<Vec<f32>> = (0..model.num_units()).map(|u| model.init_params(u, 0)).collect::<Result<_, _>>()?;
//! let mut buffers: Vec<Vec<f32>> = (0..model.num_units()).map(|u| model.init_buffers(u)).collect::<Result<_, _>>()?;
//! let (x, y) = data.batch(&[0, 1, 2, 3]);
//! let be = Cpu::new();
//! let ctx = Ctx::new(&be, true, 4);
//! let (loss, grads) = model.loss_and_grads(&params, &mut buffers, x, &y, &ctx)?;
//! assert!(loss > 0.0 && grads.len() == model.num_units());
//! # Ok::<(), shardline_models::ModelError>(())
//! ```
#![deny(missing_docs)]

pub mod backend;
pub mod batchnorm;
pub mod config;
pub mod conv;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod error;
#[cfg(any(test, feature = "test-utils"))]
pub mod failing_backend;
pub mod layers;
pub mod loss;
pub mod lower;
pub mod meter;
pub mod model;
pub mod module;
pub mod network;
pub mod nn;
pub mod ops;
pub mod placement;
pub mod rng;
pub mod spec;
pub mod tensor;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
#[cfg(test)]
mod testutil;
pub mod text;
pub mod zoo;

pub use backend::{gemm_gflops, Backend, Cpu, GemmShape};
pub use batchnorm::{BatchNorm, BnKind, StatsReducer};
pub use conv::Conv2d;
pub use data::{Dataset, DistributedSampler, RankBatches, SampleKind};
pub use error::{ModelError, StatsError, StatsFailure, StatsOp};
pub use layers::{Linear, MaxPool2d};
pub use loss::softmax_cross_entropy;
pub use model::{
    convert_sync_batchnorm, Ctx, InputGrad, Layer, Model, UnitBackward, UnitSaved, WrapPolicy,
};
pub use network::{CallBackward, ModuleNet, Network};
pub use placement::Placement;
pub use spec::{ModelSpec, ParamSpec, UnitSpec};
pub use tensor::{DType, Tensor};
pub use zoo::{ConvNetBn, MlpBn, WideMlp};
