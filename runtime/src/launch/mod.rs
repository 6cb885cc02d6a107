//! One process per rank: the worker side of `shardline train` when a launch environment is
//! present, and the per-node agent of `shardline launch`.
//!
//! A worker learns its place from the environment, in this order:
//! - `shardline launch`: `SHARDLINE_RANK`, `SHARDLINE_WORLD_SIZE`, `SHARDLINE_LOCAL_RANK`,
//!   `SHARDLINE_LOCAL_WORLD_SIZE`, `SHARDLINE_NODE_RANK`, `SHARDLINE_RDZV`, `SHARDLINE_TOKEN`,
//!   `SHARDLINE_JOB`; the agent of node 0 hosts the rendezvous store, or, when `SHARDLINE_RDZV`
//!   lists one address per node, every agent holds a replica of it (LAUNCH-14).
//! - torchrun style: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//!   `MASTER_PORT` (node from `GROUP_RANK` or `NODE_RANK`, else the host name). Under
//!   torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) the ranks meet in the torch `TCPStore`
//!   its agent serves at `MASTER_ADDR:MASTER_PORT`; elsewhere rank 0 hosts Shardline's store
//!   on `MASTER_PORT`.
//! - Slurm (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODEID` (local
//!   world from `SLURM_STEP_TASKS_PER_NODE`, `SLURM_TASKS_PER_NODE` or
//!   `SLURM_NTASKS_PER_NODE`), and the store at `SHARDLINE_RDZV`, else
//!   `MASTER_ADDR`:`MASTER_PORT` when both are set, else on the first host of
//!   `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`, `SLURM_NODELIST`) at port 15000 + the
//!   last four digits of `SLURM_JOB_ID` (SLURM-1 in `slurm.rs`), so `srun shardline train`
//!   needs only `SHARDLINE_TOKEN`.
//!
//! The token comes from `SHARDLINE_TOKEN` in every environment (required: Shardline's store
//! refuses connections without it, and ranks check each other's, LAUNCH-12).
//!
//! Invariants:
//! - LAUNCH-1: every rank of a job runs the same configuration: each publishes the hash of
//!   its configuration in the store, and a rank whose hash differs from rank 0's fails the
//!   start-up on every rank, naming it.
//! - LAUNCH-2: ranks that publish the same node id share a node (shared memory between them);
//!   ranks of different nodes talk over RDMA when every rank opens a device, else TCP
//!   (`--transport auto`, see `shardline_collectives::transport::select`; rank 0 says once
//!   why RDMA was not used). `--transport tcp|rdma|shm` carries every pair over one transport.
//! - LAUNCH-3: ranks run the same steps on the same data order in lockstep; rank 0 alone
//!   prints progress, the per-step log and the summary.
//! - LAUNCH-4: a checkpoint is committed by rank 0 only after every rank wrote its shard
//!   (a collective barrier), with the file entries every rank published in the store.
//! - LAUNCH-5: the agent reports a worker that dies (rank, exit code or signal), stops the
//!   others after a short grace period in which they may report their own errors, and exits
//!   non-zero; SIGINT and SIGTERM are forwarded to the workers.
//! - LAUNCH-6: with `--max-restarts N` a failure (a worker's exit or signal, a node's report,
//!   a node's silence) does not end the job: the deciding agent (node 0's; with replicas the
//!   leading one, LAUNCH-14) decides a new generation in the store (`agent/JOB/gen`: number,
//!   nodes, state, deciding node), every agent stops its workers and starts the new
//!   generation's, which resume from the newest checkpoint that verifies (`--resume`), up to
//!   N times. Only the deciding agent writes the generation, so the agents cannot disagree. A worker's exit code 2 (invalid input or configuration) ends the job
//!   without a restart: the next generation would fail the same way.
//! - LAUNCH-7: a generation's workers use the job name `JOBgN`: fresh store keys and shm
//!   segment names, so nothing of a dead generation is read by the next.
//! - LAUNCH-8: the plan's rank faults fire inside the worker processes in generation 0 only,
//!   and under live recovery in communicator epoch 0 only (LIVE-4: neither a replacement
//!   nor a survivor meets a fault again when it reruns the step); `kill` is a SIGKILL of
//!   the worker itself.
//! - LAUNCH-9: every fault, restart and recovery is logged by the agents with the time since
//!   start, the Unix time, the node, the rank and the step (rank 0 publishes its steps from
//!   a thread of its own, so the training thread never waits on the store for it).
//! - LAUNCH-10: `--nnodes MIN:MAX` is elastic: an agent heartbeats into the store; a node
//!   whose agent stays silent past `--heartbeat-timeout-s`, or does not answer a stop, leaves
//!   the next generation (ranks renumbered, the checkpoint resharded on load), down to MIN
//!   nodes. A node whose agent starts later or is back (a heartbeat seen moving) joins
//!   without waiting for a failure, once the running generation completed a step, up to
//!   MAX nodes (LAUNCH-15..LAUNCH-18 in `grow.rs`): the generation stops after a step and
//!   checkpoints it, and the next one resumes from that checkpoint resharded on load; a
//!   growth is no restart. An agent still waiting to join when the job ends exits 0. A
//!   fixed-size job instead waits for the missing node to come back before restarting.
//! - LAUNCH-11: under torchrun, the job's store keys and shm segments are named after
//!   `TORCHELASTIC_RUN_ID` (unless `SHARDLINE_JOB` is set) and the restart count
//!   (`TORCHELASTIC_RESTART_COUNT`, which is also the generation of LAUNCH-8): two jobs on one
//!   host, or two attempts of one job, share nothing.
//! - LAUNCH-12: every rank publishes a digest of `SHARDLINE_TOKEN` with its hello; a rank
//!   whose digest differs from this rank's fails the start-up, naming it. A store that checks
//!   no token (torch's) thus still keeps another job's ranks out.
//! - LAUNCH-13: on SIGTERM or SIGINT a worker still stops after a step with its group
//!   (INT-1), but no wait holds it past its grace (BLOCK-2): a rendezvous wait (the store,
//!   the other ranks' hellos, the links) ends the process at once, a collective of a step
//!   after 0.5 s, a checkpoint's barrier after 20 s; the process then exits with 128 + the
//!   signal, naming what it waited for. The agent's planned stop for a growth (SIGUSR1,
//!   INT-3) cuts no wait short.
//! - LAUNCH-14: with one `--rdzv` address per node the store survives the loss of any
//!   minority of the nodes, node 0 included: every agent serves a replica of it (a Raft log,
//!   `shardline_collectives::store::raft`, RSTORE-n), workers and agents talk to the leader
//!   through `ReplicatedStore`, which fails over within its deadline. Every agent starts as
//!   a follower; the one whose replica leads decides: the first generation when none is
//!   recorded, or takes over the running one when the agent that decided it no longer
//!   leads (its workers go on; a generation that was stopping fails at once). Every write
//!   of the generation record is a compare-and-set against the record as the writer last
//!   saw it, so two agents can never both start a generation; the one that loses follows.
//!   An agent whose replica heard from no majority for 6 s (a partition's minority side, or
//!   the survivor of a lost majority) stops its workers and exits 1, saying it lost the
//!   quorum; it looks between its store requests, each of which may wait 3 s for a leader.
//!   A replica's state lives in its agent's memory: an agent restarted while the store
//!   answers joins with an empty replica that votes only once it caught up (RSTORE-6); one
//!   restarted while no leader answers starts as a voter with an empty log, which can lose
//!   a commit that only its lost state and a dead node held. An agent that wrote to the store
//!   once and has had no write commit for 6 s counts as cut off too, whatever its replica
//!   says (a replica that stepped down may have heard no other leader to count from).
//! - LAUNCH-19: with replicas, an agent whose workers all finished stays (heartbeating, its
//!   replica serving) until the generation record says the job is done, for at most 10 s: the
//!   deciding agent records the end with a majority of the replicas, which the others'
//!   exits would take away, and it then could not finish.
/// Writes one line to stderr in a single write, so that it never interleaves with the
/// workers' lines.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let line = format!("{}\n", format_args!($($t)*));
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}

mod agent;
mod env;
mod grow;
mod live;
mod live_scout;
mod options;
mod rendezvous;
mod slurm;
mod store_link;
mod torchrun;
mod worker;

pub use agent::run_agent;
pub use env::{StoreAt, WorkerEnv};
pub use live::{epoch_job, epoch_key, EXIT_LIVE_FALLBACK, MAX_EPOCHS};
pub use options::{parse_nnodes, LaunchOptions};
pub use rendezvous::RENDEZVOUS_TIMEOUT;
pub use torchrun::record_error as record_torchrun_error;
pub use worker::{progress_key, run_worker, run_worker_planned, unix_ms};
