//! RDMA transport (InfiniBand / RoCE): reliable-connected queue pairs per peer, a
//! pre-registered slot ring per link, RDMA write with immediate and credit-based flow control.
//!
//! The protocol logic lives in [`proto`], a pure state machine compiled and tested on every
//! build; the verbs shim (`verbs`, feature `rdma`) only posts the writes the state machine
//! hands out and feeds it the completions. The shim loads libibverbs at run time, so a binary
//! built with the feature still starts where rdma-core is missing, and opening the transport
//! there fails with a `DeviceUnavailable` setup error. What the shim computes rather than
//! asks of verbs (slot addresses, the work request of each transmit, send-queue and staging
//! room) lives in [`wr`], also compiled and tested on every build. [`fabric`] runs all of it
//! but the verbs calls over a simulated fabric in process, so that the conformance grid runs
//! over the RDMA protocol on every build.

mod exchange;
pub mod fabric;
pub mod proto;
#[cfg(feature = "rdma")]
pub mod verbs;
pub mod wr;
