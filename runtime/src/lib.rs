//! # shardline-runtime
//!
//! The actor runtime and sharding engine of Shardline (see ARCHITECTURE.md, "runtime").
//! Its building blocks, bottom up:
//!
//! - [`shard`]: flat parameters, padding, shard ranges, resharding and the ZeRO stage rules
//!   ([`Stage`]), with the theoretical per-rank model-state estimate.
//! - [`optim`]: SGD (momentum) and AdamW over shard slices, gradient-norm clipping;
//!   [`schedule`]: learning-rate warmup + cosine.
//! - [`memory`]: per-rank memory accounting by category against an optional cap.
//! - [`checkpoint`]: sharded, atomic, reshardable checkpoints; safetensors export.
//! - [`error`]: the crate's error type, [`RuntimeError`].
//!
//! On these build [`engine`] (the per-rank schedule of each stage: pure stage, prefetch and
//! reduction cores under a thin shell), [`actors`] (`RankActor`, `Coordinator`), [`driver`]
//! (the one training loop, for ranks in one process and launched ranks alike), [`launch`]
//! (worker environment, rendezvous and the node agent), [`fault`], telemetry, [`sample`]
//! (text from a `gpt` checkpoint) and the `shardline` CLI. ARCHITECTURE.md maps every concept to its file.
//!
//! ```
//! use shardline_models::{ModelSpec, ParamSpec, UnitSpec};
//! use shardline_runtime::shard::{ShardedModelLayout, Stage};
//! let unit = UnitSpec {
//!     name: "fc".into(),
//!     params: vec![
//!         ParamSpec { name: "fc.weight".into(), shape: vec![3, 3] },
//!         ParamSpec { name: "fc.bias".into(), shape: vec![3] },
//!     ],
//!     buffers: vec![],
//! };
//! let spec = ModelSpec { name: "tiny".into(), units: vec![unit] };
//! let layout = ShardedModelLayout::new(&spec, 5).unwrap();
//! assert_eq!(layout.unit(0).padded_numel(), 15);
//! assert_eq!(layout.unit(0).shard_range(4), 12..15);
//! assert!(!Stage::Zero3.keeps_full_params());
//! ```
#![deny(missing_docs)]

pub mod activations;
pub mod actors;
pub mod auto_shard;
pub mod checkpoint;
pub mod config_file;
pub mod dataset;
pub mod doctor;
pub mod driver;
pub mod engine;
pub mod error;
pub mod eval;
pub mod fault;
pub mod interrupt;
pub mod launch;
pub mod memory;
pub mod optim;
pub mod plan;
pub mod sample;
pub mod schedule;
pub mod shard;
pub mod straggler;
pub mod supervise;
pub mod telemetry;
pub mod timeline_svg;
pub mod train;

pub use error::{Result, RuntimeError};
pub use memory::{Allocation, Category, MemoryTracker};
pub use optim::Optimizer;
pub use schedule::LrSchedule;
pub use shard::{FlatLayout, ShardedModelLayout, Stage};
