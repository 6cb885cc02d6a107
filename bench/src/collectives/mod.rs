//! `shardline-bench collectives`: an nccl-tests-style table per op and size.
//!
//! Conventions (BENCH.md, nccl-tests): `bytes` is the whole buffer (the all-reduce buffer, the
//! reduce-scatter input, the all-gather output), f32; `algbw = bytes / time`;
//! `busbw = algbw x factor`, factor 2(W-1)/W for all-reduce, (W-1)/W for reduce-scatter and
//! all-gather, 1 for broadcast; time is the slowest rank's (per iteration, max over ranks),
//! median over iterations. Every row is checked against a reference (`#wrong`).
//!
//! For `shm` and `tcp` the benchmark starts W worker processes itself (the same binary with a
//! hidden `collectives-worker` subcommand) around a TCP rendezvous store with a fresh token.
//!
//! `--nodes N` (root) measures across N network-namespace nodes instead
//! ([`shardline_tests::netns`]): `--nproc-per-node` workers per node, shared memory inside a
//! node and TCP across (the hybrid transport, hierarchical algorithms), each node's link
//! shaped to `--link-rate`. Rank 0 hosts the store on node 0's address. Besides busbw, each
//! row gives the inter-node busbw (algbw times the op's factor over the N nodes: what one node
//! link carries per second, equal to busbw with one process per node) and its fraction of the
//! link rate (`of-limit`).
//!
//! The worker processes are `procs`'s.

use crate::limits::{self, MemLimits};
use crate::report::{self, human_bytes, Series};
use anyhow::bail;
use serde::{Deserialize, Serialize};
use shardline_collectives::{local_group, Communicator, ReduceOp};
use std::path::PathBuf;
use std::time::{Duration, Instant};

mod procs;

use procs::run_processes;
pub use procs::{run_on_net, worker, WorkerArgs};

/// Which collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Op {
    /// All-reduce (sum).
    AllReduce,
    /// Reduce-scatter (sum).
    ReduceScatter,
    /// All-gather.
    AllGather,
    /// Broadcast from rank 0.
    Broadcast,
}

impl Op {
    const ALL: [Op; 4] = [Op::AllReduce, Op::ReduceScatter, Op::AllGather, Op::Broadcast];

    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all-reduce",
            Op::ReduceScatter => "reduce-scatter",
            Op::AllGather => "all-gather",
            Op::Broadcast => "broadcast",
        }
    }

    fn busbw_factor(self, w: usize) -> f64 {
        let w = w as f64;
        match self {
            Op::AllReduce => 2.0 * (w - 1.0) / w,
            Op::ReduceScatter | Op::AllGather => (w - 1.0) / w,
            Op::Broadcast => 1.0,
        }
    }

    /// Bytes each rank must at least read + write in memory for this op with our algorithms
    /// (per element of the whole buffer), used for the "fraction of the machine's limit" column:
    /// ring reduce-scatter reads two operands and writes one for (W-1)/W of the buffer;
    /// all-gather reads and writes (W-1)/W of the buffer; all-reduce is both.
    fn min_traffic_bytes(self, bytes: f64, w: usize) -> f64 {
        let f = (w as f64 - 1.0) / w as f64;
        match self {
            Op::ReduceScatter => 3.0 * f * bytes,
            Op::AllGather => 2.0 * f * bytes,
            Op::AllReduce => 5.0 * f * bytes,
            Op::Broadcast => 2.0 * bytes,
        }
    }
}

/// Transport to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TransportKind {
    /// Ranks as threads in this process.
    Local,
    /// Processes on this node over shared memory.
    Shm,
    /// Processes over loopback TCP.
    Tcp,
}

impl TransportKind {
    fn name(self) -> &'static str {
        match self {
            TransportKind::Local => "local",
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
        }
    }
}

/// Algorithm to force (`--algo`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum AlgoArg {
    /// The communicator's choice by size, topology and transport.
    #[default]
    Auto,
    /// Pipelined ring (chain for broadcast).
    Ring,
    /// Every rank to every rank in one step.
    Direct,
    /// Intra-node, then inter-node, then intra-node (several nodes).
    Hierarchical,
}

impl AlgoArg {
    fn algorithm(self) -> shardline_collectives::Algorithm {
        use shardline_collectives::Algorithm;
        match self {
            AlgoArg::Auto => Algorithm::Auto,
            AlgoArg::Ring => Algorithm::Ring,
            AlgoArg::Direct => Algorithm::Direct,
            AlgoArg::Hierarchical => Algorithm::Hierarchical,
        }
    }
}

/// Options of `shardline-bench collectives`.
#[derive(clap::Args, Clone, Debug, Serialize, Deserialize)]
pub struct Args {
    /// Which ops: all, or one of all-reduce, reduce-scatter, all-gather, broadcast.
    #[arg(long, default_value = "all", value_parser = parse_ops)]
    pub op: OpSet,
    /// Transports, comma-separated: local, shm, tcp.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "local")]
    pub transport: Vec<TransportKind>,
    /// Number of ranks (comma-separated list allowed: --world 2,4).
    #[arg(long, value_delimiter = ',', default_value = "2")]
    pub world: Vec<usize>,
    /// Algorithm for every op: auto (by size, topology and transport), ring, direct, or
    /// hierarchical (with --nodes).
    #[arg(long, value_enum, default_value = "auto")]
    #[serde(default)]
    pub algo: AlgoArg,
    /// Smallest buffer size (nccl-tests `bytes`), e.g. 4K.
    #[arg(long, default_value = "4K", value_parser = report::parse_bytes)]
    pub min_bytes: u64,
    /// Largest buffer size, e.g. 64M. Sizes double from min to max.
    #[arg(long, default_value = "64M", value_parser = report::parse_bytes)]
    pub max_bytes: u64,
    /// Timed iterations per size (default: from 200 for small sizes down to 20 at 64 MiB).
    #[arg(long)]
    pub iters: Option<usize>,
    /// Check every result against the reference (on by default; `--check false` to skip).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub check: bool,
    /// Per-op timeout in seconds.
    #[arg(long, default_value_t = 60)]
    pub timeout_s: u64,
    /// Run reduce-scatter and all-gather in place (nccl-tests' in-place columns: the shard
    /// lies in its slot of the whole buffer, so no separate input or output is copied).
    /// All-reduce and broadcast are in place either way.
    #[arg(long)]
    #[serde(default)]
    pub in_place: bool,
    /// Write the rows as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw busbw vs size per transport into this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Skip measuring the machine's memory and socket limits.
    #[arg(long)]
    pub no_limits: bool,
    /// Measure across this many network-namespace nodes (needs root; ignores --transport and
    /// --world).
    #[arg(long)]
    pub nodes: Option<usize>,
    /// Worker processes per node with --nodes.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Shape every node's link to this rate with --nodes (e.g. 1gbit, 500mbit); default
    /// unshaped veth.
    #[arg(long, value_parser = shardline_collectives::config::parse_rate)]
    pub link_rate: Option<u64>,
}

/// A set of ops parsed from `--op`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OpSet(pub Vec<Op>);

fn parse_ops(s: &str) -> Result<OpSet, String> {
    if s == "all" {
        return Ok(OpSet(Op::ALL.to_vec()));
    }
    let mut v = Vec::new();
    for part in s.split(',') {
        let op = Op::ALL.into_iter().find(|o| o.name() == part).ok_or_else(|| {
            format!("unknown op '{part}' (all, all-reduce, reduce-scatter, all-gather, broadcast)")
        })?;
        v.push(op);
    }
    Ok(OpSet(v))
}

/// One measured row.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    /// Op name.
    pub op: String,
    /// Ranks.
    pub world: usize,
    /// Transport name.
    pub transport: String,
    /// Whole-buffer bytes (nccl-tests convention).
    pub bytes: u64,
    /// f32 elements of the whole buffer.
    pub count: u64,
    /// Median over iterations of the slowest rank's time, microseconds.
    pub time_us: f64,
    /// Fastest iteration, microseconds.
    pub min_us: f64,
    /// Slowest iteration, microseconds.
    pub max_us: f64,
    /// bytes / time in GB/s.
    #[serde(rename = "algbw_GBps")]
    pub algbw_gbps: f64,
    /// algbw x factor in GB/s.
    #[serde(rename = "busbw_GBps")]
    pub busbw_gbps: f64,
    /// Elements differing from the reference (summed over ranks); -1 when not checked.
    pub wrong: i64,
    /// busbw as a fraction of what the op's minimal memory traffic allows at the bandwidth
    /// measured in the same run (local/shm) or of loopback TCP throughput (tcp).
    pub frac_of_limit: Option<f64>,
    /// Reduce-scatter / all-gather run in place (`--in-place`).
    #[serde(default)]
    pub in_place: bool,
}

fn sizes(args: &Args) -> Vec<u64> {
    let mut v = Vec::new();
    let mut b = args.min_bytes.max(4);
    while b <= args.max_bytes {
        v.push(b);
        b *= 2;
    }
    v
}

fn iters_for(bytes: u64, explicit: Option<usize>) -> (usize, usize) {
    let n = explicit.unwrap_or_else(|| ((256u64 << 20) / bytes.max(1)).clamp(20, 200) as usize);
    (n.max(1), (n / 10).max(3))
}

/// Deterministic input element that every rank can regenerate: small integers, so sums over
/// up to 16 ranks are exact in f32 and the check can demand bitwise equality.
fn input_value(rank: usize, i: usize) -> f32 {
    (((rank * 7 + i * 13) % 17) as f32) - 8.0
}

/// Runs every (op, size) on one rank; returns this rank's per-iteration times and wrong counts.
/// Every rank runs this in lockstep.
fn run_rank(
    comm: &Communicator,
    ops: &[Op],
    sizes: &[u64],
    args: &Args,
) -> anyhow::Result<Vec<RankResult>> {
    let lane = comm.lane("bench")?;
    let mut blocking = shardline_collectives::CallOptions::new();
    blocking.blocking(true).algorithm(args.algo.algorithm());
    let timeout = Duration::from_secs(args.timeout_s);
    let w = comm.world();
    let r = comm.rank();
    let mut out = Vec::new();
    for &op in ops {
        for &bytes in sizes {
            let total = (bytes / 4) as usize;
            // Buffers: reduce-scatter input / all-gather output are `total`; per-rank shard total/W.
            let shard = total / w;
            let (n_iters, n_warm) = iters_for(bytes, args.iters);
            let mut times = Vec::with_capacity(n_iters);
            let mut wrong = 0i64;
            let mut a: Vec<f32> = Vec::new();
            let mut b: Vec<f32> = Vec::new();
            // Fresh inputs, and NaN where a result goes, so that a check never passes on an
            // older result.
            let refill = |a: &mut Vec<f32>, b: &mut Vec<f32>| match op {
                Op::AllReduce | Op::Broadcast => {
                    a.clear();
                    a.extend((0..total).map(|i| input_value(r, i)));
                }
                Op::ReduceScatter => {
                    a.clear();
                    a.extend((0..shard * w).map(|i| input_value(r, i)));
                    if !args.in_place {
                        b.clear();
                        b.resize(shard, f32::NAN);
                    }
                }
                Op::AllGather if args.in_place => {
                    // The whole buffer, the own shard in its slot and NaN elsewhere.
                    a.clear();
                    a.resize(shard * w, f32::NAN);
                    for (i, x) in a[r * shard..(r + 1) * shard].iter_mut().enumerate() {
                        *x = input_value(r, i);
                    }
                }
                Op::AllGather => {
                    a.clear();
                    a.extend((0..shard).map(|i| input_value(r, i)));
                    b.clear();
                    b.resize(shard * w, f32::NAN);
                }
            };
            // Each op is waited for at once (as nccl-tests and MPI measure): issued with
            // `blocking`, a small op on the idle lane runs on this thread (LANE-6).
            let run = |a: &mut Vec<f32>, b: &mut Vec<f32>| -> anyhow::Result<()> {
                match op {
                    Op::AllReduce => {
                        *a = lane
                            .all_reduce_opts(std::mem::take(a), ReduceOp::Sum, &blocking)
                            .wait_timeout(timeout)?;
                    }
                    Op::Broadcast => {
                        *a = lane
                            .broadcast_opts(std::mem::take(a), 0, &blocking)
                            .wait_timeout(timeout)?;
                    }
                    Op::ReduceScatter if args.in_place => {
                        *a = lane
                            .reduce_scatter_in_place_opts(
                                std::mem::take(a),
                                ReduceOp::Sum,
                                &blocking,
                            )
                            .wait_timeout(timeout)?;
                    }
                    Op::AllGather if args.in_place => {
                        *a = lane
                            .all_gather_in_place_opts(std::mem::take(a), &blocking)
                            .wait_timeout(timeout)?;
                    }
                    Op::ReduceScatter => {
                        let (x, y) = lane
                            .reduce_scatter_opts(
                                std::mem::take(a),
                                std::mem::take(b),
                                ReduceOp::Sum,
                                &blocking,
                            )
                            .wait_timeout(timeout)?;
                        (*a, *b) = (x, y);
                    }
                    Op::AllGather => {
                        let (x, y) = lane
                            .all_gather_opts(std::mem::take(a), std::mem::take(b), &blocking)
                            .wait_timeout(timeout)?;
                        (*a, *b) = (x, y);
                    }
                }
                Ok(())
            };
            // The result: the whole buffer for all-reduce, broadcast and an in-place
            // all-gather; the own shard for reduce-scatter; the output otherwise.
            let result = |a: &[f32], b: &[f32]| -> i64 {
                let out: &[f32] = match op {
                    Op::ReduceScatter if args.in_place => &a[r * shard..(r + 1) * shard],
                    Op::ReduceScatter => b,
                    Op::AllGather if !args.in_place => b,
                    _ => a,
                };
                count_wrong(op, r, w, total, shard, out)
            };
            // As the peers' benchmarks and nccl-tests measure: the result is checked in an
            // untimed pass before the timed loop and another after it, each from fresh
            // inputs; the warm-up and timed iterations run back to back on the same
            // buffers, with no refill between them (a refill would change what is in the
            // cache when the op starts: fresh inputs, outputs dirty with NaN).
            refill(&mut a, &mut b);
            run(&mut a, &mut b)?;
            if args.check {
                wrong += result(&a, &b);
            }
            for it in 0..(n_warm + n_iters) {
                lane.barrier_opts(&blocking).wait_timeout(timeout)?;
                let t0 = Instant::now();
                run(&mut a, &mut b)?;
                let dt = t0.elapsed().as_secs_f64();
                if it >= n_warm {
                    times.push(dt);
                }
            }
            if args.check {
                refill(&mut a, &mut b);
                run(&mut a, &mut b)?;
                wrong += result(&a, &b);
            }
            out.push(RankResult { op, bytes, times, wrong });
        }
    }
    Ok(out)
}

fn count_wrong(op: Op, r: usize, w: usize, total: usize, shard: usize, out: &[f32]) -> i64 {
    let sum_at = |i: usize| (0..w).map(|q| input_value(q, i)).sum::<f32>();
    let bad = match op {
        Op::AllReduce => (0..total).filter(|&i| out[i] != sum_at(i)).count(),
        Op::Broadcast => (0..total).filter(|&i| out[i] != input_value(0, i)).count(),
        Op::ReduceScatter => (0..shard).filter(|&i| out[i] != sum_at(r * shard + i)).count(),
        Op::AllGather => (0..shard * w)
            .filter(|&i| out[i] != input_value(i / shard.max(1), i % shard.max(1)))
            .count(),
    };
    bad as i64
}

/// One rank's measurements of one (op, size).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankResult {
    op: Op,
    bytes: u64,
    times: Vec<f64>,
    wrong: i64,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return f64::NAN;
    }
    s[s.len() / 2]
}

/// Combines every rank's results: per iteration the slowest rank's time.
fn combine(
    transport: TransportKind,
    w: usize,
    per_rank: &[Vec<RankResult>],
    in_place: bool,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for (k, first) in per_rank[0].iter().enumerate() {
        let n = first.times.len();
        let slowest: Vec<f64> =
            (0..n).map(|i| per_rank.iter().map(|rr| rr[k].times[i]).fold(0.0, f64::max)).collect();
        let t = median(&slowest);
        let algbw = first.bytes as f64 / t / 1e9;
        rows.push(Row {
            op: first.op.name().to_string(),
            world: w,
            transport: transport.name().to_string(),
            bytes: first.bytes,
            count: first.bytes / 4,
            time_us: t * 1e6,
            min_us: slowest.iter().cloned().fold(f64::MAX, f64::min) * 1e6,
            max_us: slowest.iter().cloned().fold(0.0, f64::max) * 1e6,
            algbw_gbps: algbw,
            busbw_gbps: algbw * first.op.busbw_factor(w),
            wrong: per_rank.iter().map(|rr| rr[k].wrong).sum(),
            frac_of_limit: None,
            in_place,
        });
    }
    rows
}

fn run_local(w: usize, ops: &[Op], sizes: &[u64], args: &Args) -> anyhow::Result<Vec<Row>> {
    let comms = local_group(w)?;
    let results: Vec<anyhow::Result<Vec<RankResult>>> = std::thread::scope(|s| {
        let hs: Vec<_> =
            comms.iter().map(|c| s.spawn(move || run_rank(c, ops, sizes, args))).collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("rank thread panicked"))))
            .collect()
    });
    let per_rank: Vec<Vec<RankResult>> = results.into_iter().collect::<anyhow::Result<_>>()?;
    Ok(combine(TransportKind::Local, w, &per_rank, args.in_place))
}

impl Args {
    /// The options `overlap --nodes` measures busbw with: all-reduce, reduce-scatter and
    /// all-gather, checked, `iters` timed iterations.
    pub fn for_nodes(nodes: usize, nproc: usize, rate: u64, iters: usize) -> Args {
        Args {
            op: OpSet(vec![Op::AllReduce, Op::ReduceScatter, Op::AllGather]),
            transport: vec![TransportKind::Tcp],
            world: vec![nodes * nproc],
            algo: AlgoArg::Auto,
            min_bytes: 4,
            max_bytes: 4,
            iters: Some(iters),
            check: true,
            timeout_s: 120,
            in_place: false,
            json: None,
            plot: None,
            no_limits: true,
            nodes: Some(nodes),
            nproc_per_node: nproc,
            link_rate: Some(rate),
        }
    }
}

/// Prints rows as the table of [`run`].
pub fn print_table(rows: &[Row]) {
    print_header();
    rows.iter().for_each(print_row);
}

fn print_header() {
    println!(
        "{:>15} {:>12} {:>11} {:>10} {:>10} {:>10} {:>7} {:>8}",
        "op", "bytes", "count", "time(us)", "algbw", "busbw", "#wrong", "of-limit"
    );
}

fn print_row(row: &Row) {
    println!(
        "{:>15} {:>12} {:>11} {:>10.1} {:>10.3} {:>10.3} {:>7} {:>8}",
        row.op,
        row.bytes,
        row.count,
        row.time_us,
        row.algbw_gbps,
        row.busbw_gbps,
        row.wrong,
        row.frac_of_limit.map(|f| format!("{f:.2}")).unwrap_or_else(|| "-".into())
    );
}

/// The `--nodes` mode of [`run`]: builds the namespaces, measures, checks.
fn run_nodes(args: &Args, nodes: usize) -> anyhow::Result<Vec<Row>> {
    let ops = args.op.0.clone();
    let w = (nodes * args.nproc_per_node).max(1) as u64;
    let sz: Vec<u64> = sizes(args).iter().map(|&b| (b / (4 * w)).max(1) * 4 * w).collect();
    let net = crate::build_net(nodes, args.link_rate)?;
    println!(
        "\n# {nodes} namespace nodes x {} processes, link {}",
        args.nproc_per_node,
        args.link_rate
            .map(|r| format!(
                "{}/s ({:.3} GB/s; of-limit = inter-node busbw / link)",
                human_bytes(r as f64),
                r as f64 / 1e9
            ))
            .unwrap_or_else(|| "unshaped veth".into())
    );
    print_header();
    let rows = run_on_net(&net, args.nproc_per_node, &ops, &sz, args)?;
    rows.iter().for_each(print_row);
    Ok(rows)
}

/// Runs the benchmark, prints the table, writes JSON/SVG.
pub fn run(args: Args) -> anyhow::Result<()> {
    report::check_flags(!args.world.contains(&0), || "--world must be at least 1".into())?;
    report::check_flags(args.min_bytes <= args.max_bytes, || {
        format!("--min-bytes ({}) is larger than --max-bytes ({})", args.min_bytes, args.max_bytes)
    })?;
    report::check_flags(!sizes(&args).is_empty(), || {
        format!(
            "no size to measure: sizes start at --min-bytes ({}, at least 4) and double up to \
             --max-bytes ({})",
            args.min_bytes, args.max_bytes
        )
    })?;
    report::check_flags(args.iters != Some(0), || "--iters must be at least 1".into())?;
    let ops = args.op.0.clone();
    if let Some(nodes) = args.nodes {
        let rows = run_nodes(&args, nodes)?;
        return finish(&args, &ops, &rows, None, None, None);
    }
    let all_sizes = sizes(&args);
    let mem: Option<MemLimits> = (!args.no_limits).then(limits::measure_mem);
    let tcp_limit = if !args.no_limits && args.transport.contains(&TransportKind::Tcp) {
        limits::measure_tcp_loopback().ok()
    } else {
        None
    };
    if let Some(m) = &mem {
        println!(
            "# machine: memcpy {:.1} GB/s (1 thread), {:.1} GB/s ({} threads); a+b->c {:.1} / {:.1} GB/s",
            m.memcpy_1t_gbps, m.memcpy_all_gbps, m.threads, m.add_1t_gbps, m.add_all_gbps
        );
    }
    let tcp_both =
        if tcp_limit.is_some() { limits::measure_tcp_loopback_both_ways().ok() } else { None };
    match (tcp_limit, tcp_both) {
        (Some(t), Some(b)) => println!(
            "# machine: loopback TCP {t:.2} GB/s (one stream), {b:.2} GB/s each way (both ends \
             sending at once)"
        ),
        (Some(t), None) => println!("# machine: loopback TCP {t:.2} GB/s (one stream)"),
        _ => {}
    }
    if args.transport.contains(&TransportKind::Tcp) {
        let cc = shardline_collectives::transport::tcp::congestion();
        println!(
            "# tcp links: congestion control {} ({}), system default {}",
            cc.as_deref().unwrap_or("of the system"),
            shardline_collectives::transport::tcp::CONGESTION_ENV,
            std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "unknown".into())
        );
    }
    let mut rows = Vec::new();
    for &kind in &args.transport {
        for &w in &args.world {
            // Buffers must split evenly for reduce-scatter / all-gather: round sizes to W*4 bytes.
            let sz: Vec<u64> =
                all_sizes.iter().map(|&b| (b / (4 * w as u64)).max(1) * 4 * w as u64).collect();
            let place = if args.in_place { ", in place" } else { "" };
            match args.algo {
                AlgoArg::Auto => println!("\n# transport {} world {w}{place}", kind.name()),
                a => println!("\n# transport {} world {w} algorithm {a:?}{place}", kind.name()),
            }
            print_header();
            let mut part = match kind {
                TransportKind::Local => run_local(w, &ops, &sz, &args)?,
                _ => run_processes(kind, w, &ops, &sz, &args)?,
            };
            for row in &mut part {
                let op = Op::ALL.into_iter().find(|o| o.name() == row.op).unwrap_or(Op::AllReduce);
                row.frac_of_limit = match (kind, &mem, tcp_limit) {
                    (TransportKind::Tcp, _, Some(t)) => Some(row.busbw_gbps / t),
                    (TransportKind::Tcp, _, None) => None,
                    (_, Some(m), _) => {
                        // Ranks as threads share the machine's cores: the limit is the
                        // all-core bandwidth divided among W ranks' traffic.
                        let bw = m.add_all_gbps.max(m.memcpy_all_gbps) * 1e9;
                        let traffic = op.min_traffic_bytes(row.bytes as f64, w) * w as f64;
                        let t_min = traffic / bw;
                        let busbw_max = row.bytes as f64 / t_min / 1e9 * op.busbw_factor(w);
                        // At world 1 an all-gather or reduce-scatter moves nothing between
                        // ranks (busbw factor 0): no fraction to give.
                        (busbw_max > 0.0).then(|| row.busbw_gbps / busbw_max)
                    }
                    _ => None,
                };
                print_row(row);
            }
            rows.extend(part);
        }
    }
    finish(&args, &ops, &rows, mem.as_ref(), tcp_limit, tcp_both)
}

/// JSON, plot and the reference check of a finished run.
fn finish(
    args: &Args,
    ops: &[Op],
    rows: &[Row],
    mem: Option<&MemLimits>,
    tcp_limit: Option<f64>,
    tcp_both: Option<f64>,
) -> anyhow::Result<()> {
    if let Some(path) = &args.json {
        #[derive(Serialize)]
        struct Out<'a> {
            machine: Option<&'a MemLimits>,
            tcp_loopback_gbps: Option<f64>,
            tcp_loopback_both_ways_gbps: Option<f64>,
            link_rate: Option<u64>,
            rows: &'a [Row],
        }
        report::write_json(
            path,
            &Out {
                machine: mem,
                tcp_loopback_gbps: tcp_limit,
                tcp_loopback_both_ways_gbps: tcp_both,
                link_rate: args.link_rate,
                rows,
            },
        )?;
        println!("\nwrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        let mut series = Vec::new();
        let mut groups: Vec<(String, usize)> = Vec::new();
        for r in rows {
            if !groups.iter().any(|(t, w)| *t == r.transport && *w == r.world) {
                groups.push((r.transport.clone(), r.world));
            }
        }
        for (t, w) in &groups {
            for &op in ops {
                let pts: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| r.transport == *t && r.world == *w && r.op == op.name())
                    .map(|r| (r.bytes as f64, r.busbw_gbps))
                    .collect();
                if !pts.is_empty() {
                    series.push(Series { label: format!("{t} {} W={w}", op.name()), points: pts });
                }
            }
        }
        if let Some(rate) = args.link_rate.filter(|_| args.nodes.is_some()) {
            let (lo, hi) = rows.iter().fold((f64::MAX, 0.0f64), |(a, b), r| {
                (a.min(r.bytes as f64), b.max(r.bytes as f64))
            });
            if hi > 0.0 {
                let l = rate as f64 / 1e9;
                series.push(Series { label: "link rate".into(), points: vec![(lo, l), (hi, l)] });
            }
        }
        report::plot_lines(path, "busbw vs size", "bytes", "busbw (GB/s)", &series, true)?;
        println!("wrote {}", path.display());
    }
    let wrong: i64 = rows.iter().map(|r| r.wrong.max(0)).sum();
    if wrong > 0 {
        bail!("{wrong} wrong elements against the reference");
    }
    let _ = human_bytes;
    Ok(())
}
