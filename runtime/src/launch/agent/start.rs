//! Starting one node's agent: its options checked, the store hosted (node 0) or its replica
//! served (LAUNCH-14), the job's name derived from what every node was given.

use super::{checkpoint_dir_of, random_token, Agent, Next, JOIN_PROBE, REPLICATED_REQUEST_TIMEOUT};
use crate::checkpoint;
use crate::error::{Result, RuntimeError};
use crate::launch::options::LaunchOptions;
use crate::launch::store_link::StoreLink;
use shardline_collectives::{ReplicaServer, ReplicatedStore, TcpStoreServer};
use std::time::{Duration, Instant};

/// Runs the agent of one node (LAUNCH-5, LAUNCH-6): hosts the store on node 0, starts the
/// workers of each generation, watches them and the other agents. Returns the process exit
/// code: 0 when training finished.
pub fn run_agent(o: &LaunchOptions) -> Result<i32> {
    if o.nproc_per_node == 0 || o.nnodes == 0 || o.node_rank >= o.nnodes {
        return Err(RuntimeError::config(format!(
            "--nproc-per-node {} --nnodes {} --node-rank {}: need at least one process and node, and node rank < nodes",
            o.nproc_per_node, o.nnodes, o.node_rank
        )));
    }
    if o.min_nodes == 0 || o.min_nodes > o.nnodes {
        return Err(RuntimeError::config(format!(
            "--nnodes {}:{}: need 1 <= MIN <= MAX",
            o.min_nodes, o.nnodes
        )));
    }
    if o.worker_args.first().map(String::as_str) != Some("train") {
        return Err(RuntimeError::config("launch runs `train ...` after `--`"));
    }
    let checkpoint_dir = checkpoint_dir_of(&o.worker_args);
    // LAUNCH-17: an elastic job grows, and any job restarts, through a checkpoint.
    if (o.max_restarts > 0 || o.min_nodes < o.nnodes) && checkpoint_dir.is_none() {
        return Err(RuntimeError::config(
            "--max-restarts and elastic --nnodes restart and grow from checkpoints: give --checkpoint-dir to train",
        ));
    }
    let token = match o.token.clone().or_else(|| std::env::var("SHARDLINE_TOKEN").ok()) {
        Some(t) if !t.is_empty() => t,
        _ if o.nnodes > 1 => return Err(RuntimeError::config(
            "several nodes need a job token: --token or SHARDLINE_TOKEN (the same on every node)",
        )),
        _ => random_token(),
    };
    let rdzv = match (&o.rdzv, o.nnodes) {
        (Some(r), _) => r.clone(),
        (None, 1) => "127.0.0.1:0".into(),
        (None, _) => {
            return Err(RuntimeError::config(
                "several nodes need --rdzv HOST:PORT (node 0's address)",
            ))
        }
    };
    // LAUNCH-14: one address per node replicates the store across the agents.
    let replicas: Vec<String> = rdzv.split(',').map(|a| a.trim().to_owned()).collect();
    if replicas.len() > 1 && replicas.len() != o.nnodes {
        return Err(RuntimeError::config(format!(
            "--rdzv {rdzv}: {} addresses for --nnodes {}; give one HOST:PORT (node 0's store) or one per node (a replicated store)",
            replicas.len(),
            o.nnodes
        )));
    }
    let port_of = |a: &str| {
        a.rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .ok_or_else(|| RuntimeError::config(format!("--rdzv {a}: expected HOST:PORT")))
    };
    let mut replica = None;
    let (server, rdzv) = if replicas.len() > 1 {
        for a in &replicas {
            port_of(a)?;
        }
        let port = port_of(&replicas[o.node_rank])?;
        let seed = std::process::id() as u64 ^ (o.node_rank as u64) << 32;
        // RSTORE-6: a store that already answers is a running job this agent rejoins (it was
        // restarted): its empty replica votes only once it caught up.
        let probe = ReplicatedStore::new(replicas.clone(), &token, JOIN_PROBE)
            .map_err(|e| RuntimeError::config(format!("--rdzv {rdzv}: {e}")))?;
        let joining = matches!(
            shardline_collectives::Store::get(&probe, "agent/probe", Duration::ZERO),
            Ok(_) | Err(shardline_collectives::StoreError::Timeout { .. })
        );
        if joining {
            say!(
                "shardline launch: node {}: the store already runs: this node's replica joins it and votes once it caught up",
                o.node_rank
            );
        }
        let r =
            ReplicaServer::start(o.node_rank, &replicas, ("0.0.0.0", port), &token, seed, joining)
                .map_err(|e| {
                    RuntimeError::config(format!(
                        "hosting this node's store replica on port {port}: {e}"
                    ))
                })?;
        replica = Some(r);
        (None, replicas.join(","))
    } else if o.node_rank == 0 {
        let port = port_of(&rdzv)?;
        // An address given by the user is reached through whatever interface it names.
        let bind = if o.rdzv.is_some() { "0.0.0.0" } else { "127.0.0.1" };
        let server = TcpStoreServer::bind((bind, port), &token)
            .map_err(|e| RuntimeError::config(format!("hosting the store on port {port}: {e}")))?;
        let host = rdzv.rsplit_once(':').map(|(h, _)| h.to_owned()).unwrap_or_default();
        let actual = format!("{host}:{}", server.addr().port());
        (Some(server), actual)
    } else {
        (None, rdzv)
    };
    // One job name for every node: derived from what every node was given.
    let job = format!("l{}", &checkpoint::config_hash(&(rdzv.as_str(), token.as_str()))?[..10]);
    // The agent forwards signals itself; its workers' own handlers stop them (INT-1).
    crate::interrupt::install(false)?;
    let exe = std::env::current_exe()
        .map_err(|e| RuntimeError::config(format!("cannot find the shardline binary: {e}")))?;
    let replicated = match replica {
        Some(_) => Some(
            ReplicatedStore::new(replicas.clone(), &token, REPLICATED_REQUEST_TIMEOUT)
                .map_err(|e| RuntimeError::config(format!("--rdzv {rdzv}: {e}")))?,
        ),
        None => None,
    };
    let link = StoreLink {
        addr: rdzv.clone(),
        token: token.clone(),
        client: None,
        replicated,
        last_ok: Instant::now(),
        last_write: None,
        last_err: None,
    };
    let mut agent = Agent {
        o,
        exe,
        rdzv,
        token,
        job,
        link,
        t0: Instant::now(),
        beats: 0,
        last_beat: None,
        forwarded: 0,
        progress: 0,
        replica,
        gen_seen: None,
        checkpoint_dir,
        told_no_checkpoint: false,
        replaced: 0,
    };
    // With a single store node 0's agent decides; with replicas every agent starts as a
    // follower and the one whose replica leads decides (LAUNCH-14).
    let mut next = if o.node_rank == 0 && agent.replica.is_none() {
        Next::Lead(None)
    } else {
        Next::Follow(None, Vec::new())
    };
    let code = loop {
        next = match next {
            Next::Lead(adopt) => agent.coordinate(adopt)?,
            Next::Follow(cur, workers) => agent.follow(cur, workers)?,
            Next::Exit(code) => break code,
        };
    };
    drop(server);
    if code > 128 {
        say!(
            "shardline launch: node {} stopped by {}",
            o.node_rank,
            crate::interrupt::signal_name(code - 128)
        );
    } else if code != 0 {
        say!("shardline launch: node {} failed", o.node_rank);
    }
    Ok(code)
}
