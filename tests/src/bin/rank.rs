//! `shardline-test-rank`: one rank of a multi-process test. Configured through the
//! environment (see `shardline_tests::env`), it builds its transport (shm or tcp) over the
//! launcher's TCP store, a `Communicator`, runs one scenario and prints JSON lines
//! (`shardline_tests::Outcome`): a `ready` line once its first op completed and a final
//! `done` line. Exit code 0 when the scenario passed on this rank, 1 otherwise.
//!
//! Scenarios:
//! - `grid`: the reduced conformance grid against the naive reference.
//! - `loop`: all-reduces of 1 MiB until an op fails (the launcher kills a rank meanwhile, or
//!   the victim exits by itself after `SHARDLINE_TEST_DIE_AFTER_MS`); reports the error.
//! - `bench`: timed all-reduces of `SHARDLINE_TEST_BENCH_BYTES` (a quick probe, not the
//!   benchmark).
//! - `hang`: one all-reduce that the victim never joins (it sleeps); the others report the
//!   error they get.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use shardline_collectives::transport::shm::ShmTransport;
use shardline_collectives::transport::tcp::{TcpOptions, TcpTransport};
use shardline_collectives::transport::Transport;
use shardline_collectives::{CommOptions, Communicator, ReduceOp, Store, TcpStoreClient, Topology};
use shardline_tests::{run_grid, Outcome, RankConfig};

/// Large buffers come from a shared-memory arena, so that shm peers read them in place
/// (`shardline_collectives::arena`).
#[global_allocator]
static ALLOC: shardline_collectives::arena::SharedArena = shardline_collectives::arena::SharedArena;

fn emit(o: &Outcome) {
    // One line per outcome; the launcher parses them as they come.
    match serde_json::to_string(o) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("cannot encode outcome: {e}"),
    }
}

fn build(cfg: &RankConfig) -> anyhow::Result<Communicator> {
    let store: Arc<dyn Store> =
        Arc::new(TcpStoreClient::connect(cfg.store.as_str(), &cfg.token, Duration::from_secs(30))?);
    let transport: Arc<dyn Transport> = match cfg.transport.as_str() {
        "shm" => Arc::new(ShmTransport::new(cfg.rank, cfg.world, store, &cfg.job)?),
        "tcp" => {
            let mut o = TcpOptions::default();
            o.job(&cfg.job);
            Arc::new(TcpTransport::new(cfg.rank, cfg.world, store, o)?)
        }
        t => return Err(anyhow!("unknown transport '{t}'")),
    };
    let mut o = CommOptions::new();
    o.timeout(cfg.timeout);
    Ok(Communicator::new(transport, Topology::single_node(cfg.world), o)?)
}

fn run(cfg: &RankConfig) -> anyhow::Result<Outcome> {
    let comm = build(cfg).context("building the communicator")?;
    let base = Outcome { rank: cfg.rank, done: true, ..Default::default() };
    let wait = cfg.timeout + Duration::from_secs(5);
    match cfg.scenario.as_str() {
        "grid" => {
            emit(&Outcome { rank: cfg.rank, ready: true, ..Default::default() });
            match run_grid(&comm, wait) {
                Ok((cases, checksum)) => Ok(Outcome { ok: true, cases, checksum, ..base }),
                Err(e) => Ok(Outcome { error: Some(e), ..base }),
            }
        }
        "loop" => {
            let lane = comm.lane("loop")?;
            let mut buf = vec![1.0f32; 1 << 18];
            let start = Instant::now();
            let mut n = 0usize;
            loop {
                match lane.all_reduce(buf, ReduceOp::Max).wait_timeout(wait) {
                    Ok(b) => buf = b,
                    Err(e) => return Ok(Outcome { cases: n, ..base }.with_error(&e)),
                }
                n += 1;
                if n == 1 {
                    emit(&Outcome { rank: cfg.rank, ready: true, ..Default::default() });
                    if let (Some(after), Some(v)) = (cfg.die_after, cfg.victim) {
                        if v == cfg.rank {
                            std::thread::spawn(move || {
                                std::thread::sleep(after);
                                // Leaves in the middle of whatever op is running.
                                std::process::exit(3);
                            });
                        }
                    }
                }
                if start.elapsed() > cfg.timeout * 2 {
                    return Ok(Outcome {
                        cases: n,
                        error: Some("no failure observed".into()),
                        ..base
                    });
                }
            }
        }
        "hang" => {
            let lane = comm.lane("hang")?;
            let x = lane.all_reduce(vec![1.0; 16], ReduceOp::Sum).wait_timeout(wait)?;
            emit(&Outcome { rank: cfg.rank, ready: true, ..Default::default() });
            if Some(cfg.rank) == cfg.victim {
                // Never joins the next op; the launcher kills this process.
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            match lane.all_reduce(x, ReduceOp::Sum).wait_timeout(wait) {
                Ok(_) => {
                    Ok(Outcome { error: Some("op completed without the victim".into()), ..base })
                }
                Err(e) => Ok(Outcome { ok: true, ..base }.with_error(&e)),
            }
        }
        "bench" => {
            let var = |k: &str, d: usize| {
                std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(d)
            };
            let bytes = var(shardline_tests::env::BENCH_BYTES, 1 << 20);
            let iters = var(shardline_tests::env::BENCH_ITERS, 20).max(1);
            let lane = comm.lane("bench")?;
            let mut buf = vec![1.0f32; bytes / 4];
            for _ in 0..3 {
                buf = lane.all_reduce(buf, ReduceOp::Max).wait_timeout(wait)?;
            }
            let t = Instant::now();
            for _ in 0..iters {
                buf = lane.all_reduce(buf, ReduceOp::Max).wait_timeout(wait)?;
            }
            let time_us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
            let ok = buf.iter().all(|&x| x == 1.0);
            Ok(Outcome { ok, cases: iters, time_us, ..base })
        }
        s => Err(anyhow!("unknown scenario '{s}'")),
    }
}

fn main() {
    let cfg = match RankConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("shardline-test-rank: {e}");
            std::process::exit(2);
        }
    };
    let outcome = match run(&cfg) {
        Ok(o) => o,
        Err(e) => Outcome {
            rank: cfg.rank,
            done: true,
            error: Some(format!("{e:#}")),
            ..Default::default()
        },
    };
    emit(&outcome);
    std::process::exit(if outcome.ok { 0 } else { 1 });
}
