//! The benchmark's worker processes: one rank each, spawned on this host (`shm`, `tcp`) or
//! inside network-namespace nodes (`--nodes`), each printing its results as one JSON line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use shardline_collectives::transport::hybrid::HybridTransport;
use shardline_collectives::transport::shm::ShmTransport;
use shardline_collectives::transport::tcp::{TcpOptions, TcpTransport};
use shardline_collectives::{
    CommOptions, Communicator, Store, TcpStoreClient, TcpStoreServer, Topology,
};
use shardline_tests::{netns, process};

use super::{combine, run_rank, Args, Op, RankResult, Row, TransportKind};
use crate::report;

/// Hidden worker entry: one rank of a multi-process run.
#[derive(clap::Args, Clone, Debug)]
pub struct WorkerArgs {
    /// This rank.
    #[arg(long)]
    pub rank: usize,
    /// Number of ranks.
    #[arg(long)]
    pub world: usize,
    /// Rendezvous store address.
    #[arg(long)]
    pub store: String,
    /// Transport.
    #[arg(long, value_enum)]
    pub transport: TransportKind,
    /// The benchmark's options, as JSON.
    #[arg(long)]
    pub spec: String,
    /// Node of every rank, comma-separated (namespace nodes: hybrid transport, this rank
    /// listening on --advertise).
    #[arg(long, value_delimiter = ',')]
    pub node_of: Option<Vec<usize>>,
    /// This rank's address as the other nodes reach it.
    #[arg(long)]
    pub advertise: Option<String>,
}

/// Runs one worker process: builds the transport, measures, prints its results as one JSON line.
pub fn worker(wa: WorkerArgs) -> anyhow::Result<()> {
    let token = std::env::var("SHARDLINE_TOKEN").context("SHARDLINE_TOKEN not set")?;
    let (args, ops, sizes): (Args, Vec<Op>, Vec<u64>) = serde_json::from_str(&wa.spec)?;
    let addr: std::net::SocketAddr = wa.store.parse().context("bad --store address")?;
    // On namespace nodes rank 0 hosts the store: the launching process is outside them.
    let _server = match (&wa.node_of, wa.rank) {
        (Some(_), 0) => Some(TcpStoreServer::bind(addr, &token)?),
        _ => None,
    };
    let store: Arc<dyn Store> =
        Arc::new(TcpStoreClient::connect(addr, &token, Duration::from_secs(30))?);
    let mut topology = Topology::single_node(wa.world);
    let transport: Arc<dyn shardline_collectives::transport::Transport> = match wa.transport {
        _ if wa.node_of.is_some() => {
            let node_of = wa.node_of.clone().unwrap_or_default();
            if node_of.len() != wa.world {
                bail!("--node-of names {} ranks, the world is {}", node_of.len(), wa.world);
            }
            topology = Topology::from_nodes(node_of);
            let mut tcp = TcpOptions::default();
            tcp.bind(std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
            if let Some(a) = &wa.advertise {
                tcp.advertise(a.clone());
            }
            Arc::new(HybridTransport::new(wa.rank, &topology, store, "benchnodes", tcp)?)
        }
        TransportKind::Shm => {
            Arc::new(ShmTransport::new(wa.rank, wa.world, store, &format!("bench{}", addr.port()))?)
        }
        TransportKind::Tcp => {
            Arc::new(TcpTransport::new(wa.rank, wa.world, store, TcpOptions::default())?)
        }
        TransportKind::Local => bail!("the local transport runs in one process"),
    };
    let mut copts = CommOptions::new();
    copts.timeout(Duration::from_secs(args.timeout_s));
    let comm = Communicator::new(transport, topology, copts)?;
    let res = run_rank(&comm, &ops, &sizes, &args)?;
    println!("RESULT {}", serde_json::to_string(&res)?);
    Ok(())
}

pub(super) fn run_processes(
    kind: TransportKind,
    w: usize,
    ops: &[Op],
    sizes: &[u64],
    args: &Args,
) -> anyhow::Result<Vec<Row>> {
    let token = format!(
        "{:016x}",
        std::process::id() as u64 ^ Instant::now().elapsed().as_nanos() as u64 ^ 0x5eed_5eed
    );
    let server = TcpStoreServer::bind("127.0.0.1:0", &token)?;
    let addr = server.addr();
    let spec = serde_json::to_string(&(args, ops, sizes))?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for r in 0..w {
        let child = std::process::Command::new(&exe)
            .args(["collectives-worker", "--rank", &r.to_string(), "--world", &w.to_string()])
            .args(["--store", &addr.to_string(), "--transport", kind.name(), "--spec", &spec])
            .env("SHARDLINE_TOKEN", &token)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("spawning a worker")?;
        children.push(child);
    }
    // Each worker's stdout is drained by its own thread while it runs: a result larger than
    // the pipe's buffer would otherwise block the worker and never let it exit.
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let out = c.stdout.take();
            std::thread::spawn(move || {
                let mut text = String::new();
                if let Some(mut o) = out {
                    let _ = std::io::Read::read_to_string(&mut o, &mut text);
                }
                text
            })
        })
        .collect();
    // Deadline for the whole run: generous, but never forever.
    let deadline = Instant::now() + Duration::from_secs(args.timeout_s * 4 + 600);
    let mut per_rank = Vec::new();
    let mut failure = None;
    let mut statuses = Vec::with_capacity(w);
    for (r, child) in children.iter_mut().enumerate() {
        loop {
            match child.try_wait()? {
                Some(st) => {
                    statuses.push(Some(st));
                    break;
                }
                None if Instant::now() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    failure.get_or_insert_with(|| format!("rank {r} did not finish in time"));
                    statuses.push(None);
                    break;
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    for (r, (st, reader)) in statuses.into_iter().zip(readers).enumerate() {
        let text = reader.join().unwrap_or_default();
        match st {
            Some(st) if st.success() => {}
            Some(st) => {
                failure.get_or_insert_with(|| format!("rank {r} exited with {st}"));
                continue;
            }
            None => continue,
        }
        match text.lines().find_map(|l| l.strip_prefix("RESULT ")) {
            Some(json) => per_rank.push(serde_json::from_str::<Vec<RankResult>>(json)?),
            None => {
                failure.get_or_insert_with(|| format!("rank {r} printed no result"));
            }
        }
    }
    if let Some(f) = failure {
        bail!("{} benchmark at world {w} failed: {f}", kind.name());
    }
    Ok(combine(kind, w, &per_rank, args.in_place))
}

/// Measures `ops` at `sizes` across the nodes of `net`, `nproc` worker processes per node
/// (the same binary's `collectives-worker` inside each namespace). Rows are labelled
/// `nodes NxP`; `frac_of_limit` is the inter-node busbw over the link rate when shaped.
pub fn run_on_net(
    net: &netns::Net,
    nproc: usize,
    ops: &[Op],
    sizes: &[u64],
    args: &Args,
) -> anyhow::Result<Vec<Row>> {
    let (n, w) = (net.nodes(), net.nodes() * nproc);
    report::check_flags(nproc > 0, || "--nproc-per-node must be at least 1".into())?;
    let token = format!("{:016x}", std::process::id() as u64 ^ 0x6e6f_6465_7331 ^ w as u64);
    // Namespaces are fresh, so any port is free on node 0's address.
    let store = format!("{}:29650", net.addr(0));
    let node_of: Vec<String> = (0..w).map(|r| (r / nproc).to_string()).collect();
    let spec = serde_json::to_string(&(args, ops, sizes))?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for r in 0..w {
        let mut cmd = net.command(r / nproc, &exe);
        cmd.args(["collectives-worker", "--rank", &r.to_string(), "--world", &w.to_string()])
            .args(["--store", &store, "--transport", "tcp", "--spec", &spec])
            .args(["--node-of", &node_of.join(","), "--advertise", &net.addr(r / nproc)])
            .env("SHARDLINE_TOKEN", &token);
        children.push(process::Child::spawn(cmd, &format!("collectives worker {r}"))?);
    }
    let deadline = Instant::now() + Duration::from_secs(args.timeout_s * 4 + 600);
    let outs = process::wait_all(children, deadline)?;
    let mut per_rank = Vec::new();
    for (r, out) in outs.iter().enumerate() {
        let text = String::from_utf8_lossy(&out.stdout);
        let json = text
            .lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .ok_or_else(|| anyhow::anyhow!("rank {r} printed no result"))?;
        per_rank.push(serde_json::from_str::<Vec<RankResult>>(json)?);
    }
    let mut rows = combine(TransportKind::Tcp, w, &per_rank, args.in_place);
    for row in &mut rows {
        row.transport = format!("nodes {n}x{nproc}");
        let op = Op::ALL.into_iter().find(|o| o.name() == row.op).unwrap_or(Op::AllReduce);
        let inter = row.algbw_gbps * op.busbw_factor(n);
        row.frac_of_limit = net.rate().map(|rate| inter * 1e9 / rate as f64);
    }
    Ok(rows)
}
