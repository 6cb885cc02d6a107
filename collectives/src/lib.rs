//! # shardline-collectives
//!
//! The communication library under Shardline: it knows bytes, ranks and buffers, nothing of
//! models. Layers, bottom up:
//!
//! - [`transport`]: point-to-point links (`local` threads, `shm` processes on one node,
//!   `tcp` any hosts) behind one small trait; they know nothing of algorithms.
//! - [`store`]: the rendezvous key-value store through which ranks exchange addresses.
//! - [`algo`]: pure schedules (ring, direct, hierarchical) checked without I/O.
//! - [`Communicator`] and [`Lane`]: ops issued in order on a lane's own progress thread,
//!   returning [`Work`] handles that hand the owned buffers back.
//! - [`blocked`]: what this process's threads wait for now (a watchdog names it on a stop).
//!
//! ```
//! use shardline_collectives::{local_group, ReduceOp};
//! let comms = local_group(2).unwrap();
//! let handles: Vec<_> = comms
//!     .into_iter()
//!     .map(|comm| {
//!         std::thread::spawn(move || {
//!             let lane = comm.lane("grads").unwrap();
//!             let buf = vec![comm.rank() as f32 + 1.0; 4];
//!             lane.all_reduce(buf, ReduceOp::Sum).wait().unwrap() // bounded by the op deadline
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), vec![3.0; 4]);
//! }
//! ```
#![deny(missing_docs)]

pub mod algo;
pub mod arena;
pub mod bf16;
pub mod blocked;
pub mod communicator;
pub mod config;
pub mod device;
pub mod error;
pub mod executor;
pub mod fingerprint;
pub mod lane;
pub mod memcopy;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod pool;
pub mod quant;
pub mod recent;
pub mod reduce;
pub mod store;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
pub mod topology;
pub mod transport;
pub mod work;

pub use algo::Algorithm;
pub use communicator::{local_group, local_group_with_topology, CommOptions, Communicator};
pub use error::CollectiveError;
pub use lane::{CallOptions, Lane};
pub use pool::BufferPool;
pub use reduce::ReduceOp;
pub use store::{
    MemStore, ReplicaServer, ReplicatedStore, Store, StoreError, TcpStoreClient, TcpStoreServer,
    TorchStoreClient,
};
pub use topology::Topology;
pub use work::Work;
