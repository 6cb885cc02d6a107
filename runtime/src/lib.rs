//! # shardline-runtime (in progress)
#![deny(missing_docs)]
