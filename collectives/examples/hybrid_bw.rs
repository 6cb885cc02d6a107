//! busbw of all-reduce over the hybrid transport, one process per rank.
//!
//! Environment: `RANK`, `WORLD_SIZE`, `NODE` (ranks with equal labels share memory),
//! `STORE` (`HOST:PORT`, rank 0 hosts it), `TOKEN`, optional `MIB` (default 64) and `ITERS`
//! (default 5). Rank 0 prints the median time and busbw (factor 2(W-1)/W, GB/s = 1e9 B/s).
//!
//! ```text
//! RANK=0 WORLD_SIZE=2 NODE=a STORE=127.0.0.1:29600 TOKEN=t cargo run --release -p shardline-collectives --example hybrid_bw &
//! RANK=1 WORLD_SIZE=2 NODE=a STORE=127.0.0.1:29600 TOKEN=t cargo run --release -p shardline-collectives --example hybrid_bw
//! ```

use shardline_collectives::transport::hybrid::HybridTransport;
use shardline_collectives::transport::tcp::TcpOptions;
use shardline_collectives::transport::Transport;
use shardline_collectives::{
    CommOptions, Communicator, ReduceOp, Store, TcpStoreClient, TcpStoreServer, Topology,
};
use std::net::{SocketAddr, UdpSocket};

/// Large buffers in the shared arena, as in the `shardline` binary (shm peers read in place).
#[global_allocator]
static ALLOC: shardline_collectives::arena::SharedArena = shardline_collectives::arena::SharedArena;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn var(k: &str) -> anyhow::Result<String> {
    std::env::var(k).map_err(|_| anyhow::anyhow!("set {k}"))
}

fn main() -> anyhow::Result<()> {
    let rank: usize = var("RANK")?.parse()?;
    let world: usize = var("WORLD_SIZE")?.parse()?;
    let (node, store_addr, token) = (var("NODE")?, var("STORE")?, var("TOKEN")?);
    let mib: usize = std::env::var("MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let iters: usize = std::env::var("ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let port: u16 = store_addr.rsplit_once(':').map(|(_, p)| p.parse()).transpose()?.unwrap_or(0);
    let _server =
        (rank == 0).then(|| TcpStoreServer::bind(("0.0.0.0", port), &token)).transpose()?;
    let store: Arc<dyn Store> =
        Arc::new(TcpStoreClient::connect(store_addr.as_str(), &token, Duration::from_secs(30))?);
    store.set(&format!("bw/node/{rank}"), node.as_bytes())?;
    let mut labels = Vec::new();
    for r in 0..world {
        labels
            .push(String::from_utf8(store.get(&format!("bw/node/{r}"), Duration::from_secs(30))?)?);
    }
    let ids: Vec<usize> =
        labels.iter().map(|l| labels.iter().position(|m| m == l).unwrap_or(0)).collect();
    let topo = Topology::from_nodes(ids);
    let target: SocketAddr = store_addr.parse()?;
    let udp = UdpSocket::bind("0.0.0.0:0")?;
    udp.connect(target)?;
    let mut tcp = TcpOptions::default();
    tcp.bind(SocketAddr::from(([0, 0, 0, 0], 0))).advertise(udp.local_addr()?.ip().to_string());
    let t = HybridTransport::new(rank, &topo, Arc::clone(&store), "bw", tcp)?;
    let mut o = CommOptions::new();
    o.timeout(Duration::from_secs(120));
    let comm = Communicator::new(Arc::new(t) as Arc<dyn Transport>, topo.clone(), o)?;
    let lane = comm.lane("bw")?;
    let n = mib * (1 << 20) / 4;
    let wait = Duration::from_secs(300);
    let mut times = Vec::new();
    let mut buf = vec![1.0f32; n];
    for i in 0..=iters {
        lane.barrier().wait_timeout(wait)?;
        let t0 = Instant::now();
        buf = lane.all_reduce(buf, ReduceOp::Avg).wait_timeout(wait)?;
        let dt = t0.elapsed().as_secs_f64();
        // The slowest rank's time, as nccl-tests reports it.
        let slow = lane.all_reduce(vec![dt as f32], ReduceOp::Max).wait_timeout(wait)?[0] as f64;
        if i > 0 {
            times.push(slow);
        }
    }
    anyhow::ensure!(buf.iter().all(|&x| x == 1.0), "wrong all-reduce result");
    times.sort_by(|a, b| a.total_cmp(b));
    let med = times[times.len() / 2];
    let bytes = (n * 4) as f64;
    let busbw = bytes / med * 2.0 * (world - 1) as f64 / world as f64 / 1e9;
    if rank == 0 {
        println!(
            "all_reduce {mib} MiB world {world} nodes {} : median {:.1} ms (min {:.1}, max {:.1}), busbw {busbw:.2} GB/s, #wrong 0",
            topo.nodes(),
            med * 1e3,
            times[0] * 1e3,
            times[times.len() - 1] * 1e3
        );
    }
    Ok(())
}
