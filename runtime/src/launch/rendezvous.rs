//! A worker's rendezvous: the store, the job's configuration check (LAUNCH-1), the topology
//! and the transports (LAUNCH-2), ending in the rank's communicator.

use super::env::{StoreAt, WorkerEnv};
use crate::checkpoint;
use crate::error::{Result, RuntimeError};
use crate::train::TrainConfig;
use shardline_collectives::transport::select::{open_for_job, Selection, TransportChoice};
use shardline_collectives::transport::tcp::TcpOptions;
use shardline_collectives::transport::Transport;
use shardline_collectives::{
    blocked, CommOptions, Communicator, ReplicatedStore, Store, TcpStoreClient, TcpStoreServer,
    Topology, TorchStoreClient,
};
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

/// How long a worker waits for the store and for the other ranks to publish at start-up.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(60);
/// The local address this host uses to reach `rdzv`: what peers on other nodes connect to.
fn local_ip_towards(rdzv: &str) -> Result<std::net::IpAddr> {
    let target: SocketAddr = rdzv
        .to_socket_addrs()
        .map_err(|e| RuntimeError::config(format!("cannot resolve store address {rdzv}: {e}")))?
        .next()
        .ok_or_else(|| RuntimeError::config(format!("store address {rdzv} resolves to nothing")))?;
    let bind: SocketAddr =
        if target.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
    // A connected UDP socket sends nothing; it only asks the kernel for the route.
    let sock = UdpSocket::bind(bind)
        .and_then(|s| s.connect(target).map(|_| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| RuntimeError::config(format!("no route to the store at {rdzv}: {e}")))?;
    Ok(sock.ip())
}

pub(super) fn store_err(
    what: &str,
) -> impl Fn(shardline_collectives::StoreError) -> RuntimeError + '_ {
    move |e| RuntimeError::Failed(format!("rendezvous failed ({what}): {e}"))
}

/// What a worker publishes about itself at start-up.
#[derive(serde::Serialize, serde::Deserialize)]
struct Hello {
    node: String,
    config_hash: String,
    /// SHA-256 of the job and its token (LAUNCH-12): a store that checks no token (torch's)
    /// still keeps ranks of another job or token out.
    token_digest: String,
}

fn token_digest(env: &WorkerEnv) -> String {
    checkpoint::sha256_hex(format!("shardline-token\0{}", env.token).as_bytes())
}

/// A worker's connection to its job: the store (and the server, when hosted here), the
/// topology and the communicator.
pub(super) struct Joined {
    pub(super) _server: Option<TcpStoreServer>,
    pub(super) store: Arc<dyn Store>,
    pub(super) topology: Topology,
    pub(super) comm: Communicator,
    /// The transports chosen (LAUNCH-2).
    pub(super) selection: Selection,
}

/// Where a Slurm job's store is when no variable names it (SLURM-1), for the errors.
const SLURM_RULE: &str = "without SHARDLINE_RDZV or MASTER_ADDR/MASTER_PORT a Slurm job's store \
     is on the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST) at port 15000 + the \
     last four digits of SLURM_JOB_ID";

/// The store's address, or the first replica's when the agents replicate it (a list,
/// LAUNCH-14): the route towards it is this host's address for the other nodes.
fn first_store_addr(rdzv: &str) -> &str {
    rdzv.split(',').next().unwrap_or(rdzv)
}

/// Fails at once, saying so, when the store's host name does not resolve here.
fn check_resolves(env: &WorkerEnv) -> Result<()> {
    let first = first_store_addr(&env.rdzv);
    let why = match first.to_socket_addrs().map(|mut addrs| addrs.next()) {
        Ok(Some(_)) => return Ok(()),
        Ok(None) => "it resolves to no address".to_string(),
        Err(e) => e.to_string(),
    };
    let hint = match env.source {
        "slurm" => format!(
            "; {SLURM_RULE}: that host name must resolve on every node (DNS or /etc/hosts), \
             or set SHARDLINE_RDZV=HOST:PORT"
        ),
        _ => String::new(),
    };
    Err(RuntimeError::config(format!("cannot resolve the store address {}: {why}{hint}", env.rdzv)))
}

pub(super) fn join_job(cfg: &TrainConfig, env: &WorkerEnv) -> Result<Joined> {
    let (server, store) = connect(cfg, env)?;
    meet(cfg, env, server, store, &|_, _| false)?
        .ok_or_else(|| RuntimeError::Failed("rendezvous cancelled".into()))
}

/// The job's store: served here when this process hosts it (and the server), else a client.
pub(super) fn connect(
    cfg: &TrainConfig,
    env: &WorkerEnv,
) -> Result<(Option<TcpStoreServer>, Arc<dyn Store>)> {
    // LAUNCH-13: nothing is kept by waiting out a stop here, so a signal ends these waits
    // at once.
    let _grace = blocked::with_grace(Duration::ZERO);
    let server = if env.store == StoreAt::Host {
        let port = env.rdzv.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()).ok_or_else(
            || RuntimeError::config(format!("store address {} has no port", env.rdzv)),
        )?;
        let hint = match env.source {
            "slurm" => format!(
                "; {SLURM_RULE} (another job whose id ends in the same four digits, or another \
                 step of this job, may hold the port): set SHARDLINE_RDZV=HOST:PORT to choose \
                 another"
            ),
            _ => String::new(),
        };
        Some(TcpStoreServer::bind(("0.0.0.0", port), &env.token).map_err(|e| {
            RuntimeError::Failed(format!("rendezvous failed (hosting the store): {e}{hint}"))
        })?)
    } else {
        None
    };
    check_resolves(env)?;
    let store: Arc<dyn Store> = {
        let _b = blocked::on(format!("the rendezvous store at {} ({})", env.rdzv, env.source));
        // Once connected, a request the store does not answer fails within the collective
        // timeout like a collective would (a partitioned rank then reports it instead of
        // waiting out the rendezvous deadline in a checkpoint's store write).
        let request_timeout = Duration::from_secs(cfg.timeout_s.max(1));
        match env.store {
            StoreAt::TorchAgent => {
                let c = TorchStoreClient::connect(env.rdzv.as_str(), RENDEZVOUS_TIMEOUT)
                    .map_err(store_err("connecting to torchrun's agent store"))?;
                Arc::new(c)
            }
            // LAUNCH-14: the agents replicate the store; any majority of them serves it.
            StoreAt::Connect if env.rdzv.contains(',') => {
                let addrs = env.rdzv.split(',').map(str::to_owned).collect();
                let c = ReplicatedStore::new(addrs, &env.token, request_timeout)
                    .map_err(store_err("connecting"))?;
                Arc::new(c)
            }
            StoreAt::Host | StoreAt::Connect => {
                let mut c =
                    TcpStoreClient::connect(env.rdzv.as_str(), &env.token, RENDEZVOUS_TIMEOUT)
                        .map_err(store_err("connecting"))?;
                c.set_request_timeout(request_timeout);
                Arc::new(c)
            }
        }
    };
    Ok((server, store))
}

/// How often a rendezvous that can be cancelled looks whether it is.
const CANCEL_POLL: Duration = Duration::from_millis(100);

/// Meets the other ranks of `env.world` in `store` under `env.meeting()` and opens the
/// transports; `None` as soon as `cancel(rank, waited)` says so while waiting for `rank`
/// (live recovery's membership moved on, LIVE-7; it may also report a rank that is late,
/// LIVE-10).
pub(super) fn meet(
    cfg: &TrainConfig,
    env: &WorkerEnv,
    server: Option<TcpStoreServer>,
    store: Arc<dyn Store>,
    cancel: &dyn Fn(usize, Duration) -> bool,
) -> Result<Option<Joined>> {
    let _grace = blocked::with_grace(Duration::ZERO);
    let meeting = env.meeting();
    let key = |r: usize| format!("launch/{meeting}/hello/{r}");
    let mine = Hello {
        node: env.node.clone(),
        config_hash: checkpoint::config_hash(cfg)?,
        token_digest: token_digest(env),
    };
    let text = serde_json::to_vec(&mine)
        .map_err(|e| RuntimeError::config(format!("encoding hello: {e}")))?;
    store.set(&key(env.rank), &text).map_err(store_err("publishing"))?;
    let mut hellos = Vec::with_capacity(env.world);
    for r in 0..env.world {
        let _b = blocked::on(format!(
            "rank {r} of {} to join in the store at {} (rendezvous)",
            env.world, env.rdzv
        ));
        let since = std::time::Instant::now();
        let until = since + RENDEZVOUS_TIMEOUT;
        let v = loop {
            let left = until.saturating_duration_since(std::time::Instant::now());
            match store.get(&key(r), left.min(CANCEL_POLL)) {
                Ok(v) => break v,
                Err(shardline_collectives::StoreError::Timeout { .. }) => {
                    if left.is_zero() {
                        return Err(RuntimeError::Failed(format!(
                            "rendezvous failed (waiting for ranks): store: key '{}' not set \
                             within {RENDEZVOUS_TIMEOUT:?}",
                            key(r)
                        )));
                    }
                    if cancel(r, since.elapsed()) {
                        return Ok(None);
                    }
                }
                Err(e) => return Err(store_err("waiting for ranks")(e)),
            }
        };
        let h: Hello = serde_json::from_slice(&v)
            .map_err(|e| RuntimeError::config(format!("rank {r} published a bad hello: {e}")))?;
        hellos.push(h);
    }
    // LAUNCH-12.
    let strangers: Vec<usize> =
        (0..env.world).filter(|&r| hellos[r].token_digest != mine.token_digest).collect();
    if !strangers.is_empty() {
        return Err(RuntimeError::config(format!(
            "rank(s) {strangers:?} joined with another SHARDLINE_TOKEN than rank {} \
             (every rank of a job needs the same token)",
            env.rank
        )));
    }
    // LAUNCH-1.
    let differ: Vec<usize> =
        (1..env.world).filter(|&r| hellos[r].config_hash != hellos[0].config_hash).collect();
    if !differ.is_empty() {
        return Err(RuntimeError::config(format!(
            "configuration mismatch: rank(s) {differ:?} run another configuration than rank 0 \
             (same flags on every rank required)"
        )));
    }
    // LAUNCH-2: node labels numbered in order of first appearance by rank.
    let mut ids: HashMap<&str, usize> = HashMap::new();
    let node_of: Vec<usize> = hellos
        .iter()
        .map(|h| {
            let n = ids.len();
            *ids.entry(h.node.as_str()).or_insert(n)
        })
        .collect();
    let topology = Topology::from_nodes(node_of);
    let mut tcp = TcpOptions::default();
    tcp.bind(SocketAddr::from(([0, 0, 0, 0], 0)))
        .advertise(local_ip_towards(first_store_addr(&env.rdzv))?.to_string());
    let choice = TransportChoice::from_env()
        .map_err(|e| RuntimeError::config(format!("SHARDLINE_TRANSPORT: {e}")))?;
    let links = blocked::on(format!("links with the other ranks (rendezvous via {})", env.rdzv));
    let (transport, selection) = open_for_job(
        choice,
        env.rank,
        &topology,
        Arc::clone(&store),
        &meeting,
        tcp,
        RENDEZVOUS_TIMEOUT,
    )
    .map_err(|e| RuntimeError::Failed(format!("rank {}: transport setup failed: {e}", env.rank)))?;
    drop(links);
    if env.rank == 0 {
        for note in &selection.notes {
            say!("shardline: {note}");
        }
    }
    let mut copts = CommOptions::new();
    copts.timeout(Duration::from_secs(cfg.timeout_s));
    let comm = Communicator::new(transport as Arc<dyn Transport>, topology.clone(), copts)?;
    Ok(Some(Joined { _server: server, store, topology, comm, selection }))
}
