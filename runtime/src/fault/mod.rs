//! Fault plans and their injection (ARCHITECTURE.md, "Faults").
//!
//! A plan is a list of [`FaultSpec`]s parsed from `--fault SPEC` flags plus a seed
//! (`--fault-seed`). The [`FaultInjector`] carries a plan through a job and its restarts:
//!
//! - `kill:rank=R:step=S[:phase=forward|backward|reduce|update|checkpoint]`: the rank's actor thread
//!   panics at that point of step S (for `checkpoint`: while writing the checkpoint taken after
//!   step S, after its own shard file is written), so its mailbox is dropped and the
//!   coordinator has to notice the death.
//! - `stall:rank=R:step=S:secs=T`: the rank sleeps T seconds at the start of step S's forward
//!   pass: a slow rank, not a dead one.
//! - `slow:rank=R:step=S:ms=M`: the rank sleeps M milliseconds at the start of every forward
//!   pass from step S on: a straggler (a condition, recorded once when it begins).
//! - `delay:link=A-B:ms=M[:jitter=J]`, `drop:link=A-B:p=P`, `corrupt:link=A-B:p=P`: link
//!   faults applied by the
//!   [`FaultyTransport`](shardline_collectives::transport::faulty::FaultyTransport) wrapper on
//!   every rank's transport.
//! - `partition:node=N:step=S:secs=T`: parsed and validated here; cutting a node off needs
//!   separate network namespaces, so it is executed only by the launcher's namespace tests.
//!   `shardline train` (one process) refuses to run a plan containing one.
//!
//! One concept per file, each with the invariants it implements: `spec` parses and validates
//! specs and plans (FAULT-1), `injector` carries a plan through a job (FAULT-2, FAULT-3,
//! FAULT-4), `config` reads the `[faults]` table of a config file (FAULT-5).

mod config;
mod injector;
mod spec;

pub use config::FaultsConfig;
pub use injector::{FaultEvent, FaultHook, FaultInjector, FaultRecord};
pub use spec::{FaultPlan, FaultSpec, Phase};
