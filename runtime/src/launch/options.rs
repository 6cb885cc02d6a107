//! What `shardline launch` is asked to do on one node.

use shardline_collectives::transport::select::TransportChoice;
use std::time::Duration;

/// What `shardline launch` is asked to run on this node.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// Worker processes on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Store address `HOST:PORT`; node 0 listens on its port. Required for several nodes.
    pub rdzv: Option<String>,
    /// Job token; required for several nodes (else generated).
    pub token: Option<String>,
    /// Arguments of each worker (`train ...`).
    pub worker_args: Vec<String>,
    /// How long the other workers may take to exit on their own after one died (LAUNCH-5).
    pub grace: Duration,
    /// Fewest nodes the job may shrink to (`--nnodes MIN:MAX`, LAUNCH-10); `nnodes` is the
    /// most. Equal to `nnodes` for a fixed-size job.
    pub min_nodes: usize,
    /// Restarts of the worker group after a failure (`--max-restarts`, LAUNCH-6).
    pub max_restarts: u32,
    /// Node 0's agent counts an agent whose heartbeat stayed still this long as lost.
    pub heartbeat_timeout: Duration,
    /// Transport of the workers (`--transport`, passed as `SHARDLINE_TRANSPORT`).
    pub transport: TransportChoice,
    /// How long an elastic job's deciding agent waits at start-up for the most nodes before
    /// it starts with those there (at least MIN); the others join later (LAUNCH-15).
    pub join_wait: Duration,
    /// `--live-recovery`: a failed worker is replaced in place and its peers go on from the
    /// state they hold (LIVE-4..6); `--max-restarts` bounds the replacements per node.
    pub live_recovery: bool,
}

impl LaunchOptions {
    /// Options for one node of a fixed-size job without restarts.
    pub fn new(nproc_per_node: usize, worker_args: Vec<String>) -> Self {
        LaunchOptions {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            rdzv: None,
            token: None,
            worker_args,
            grace: Duration::from_secs(2),
            min_nodes: 1,
            max_restarts: 0,
            heartbeat_timeout: Duration::from_secs(3),
            transport: TransportChoice::Auto,
            join_wait: Duration::from_secs(10),
            live_recovery: false,
        }
    }
}

/// Parses `--nnodes`: `N` (fixed) or `MIN:MAX` (elastic); returns `(min, max)`.
pub fn parse_nnodes(s: &str) -> std::result::Result<(usize, usize), String> {
    let num = |t: &str| {
        t.trim().parse::<usize>().map_err(|_| format!("--nnodes '{s}': expected N or MIN:MAX"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => {
            let n = num(s)?;
            (n, n)
        }
    };
    if min == 0 || min > max {
        return Err(format!("--nnodes '{s}': need 1 <= MIN <= MAX"));
    }
    Ok((min, max))
}
