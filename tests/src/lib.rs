//! Shared helpers for Shardline's multi-process and multi-node integration tests, and the
//! test harness that `shardline-bench` shares with them (this crate is not published):
//!
//! - [`netns`]: nodes as network namespaces, shaped links, cleanup on drop and on signals;
//!   the NETNS-n invariants, among them when a namespace test may skip (NETNS-8).
//! - [`process`]: child processes in process groups of their own, every wait with a deadline.
//! - [`launch`]: `shardline launch` agents on namespace nodes, for the tests.
//! - [`skip`]: a skipped test says why where `cargo test` shows it, and in a skip log.
//! - [`error`]: the harness's error type, [`HarnessError`].
//!
//! The rank side ([`RankConfig`], [`run_grid`], [`Outcome`]) is used by the
//! `shardline-test-rank` binary; the launcher side ([`Group`]) by the tests, which spawn one
//! such process per rank around a `TcpStoreServer` of their own.
//!
//! Invariants (cited by the tests):
//! - MP-1: every child process is killed and reaped when its [`Group`] is dropped, and every
//!   wait on a child has a deadline, so a failing test never leaves ranks behind or hangs.
//! - MP-2: a rank checks its results against a naive reference computed from deterministic
//!   inputs that every rank regenerates, never against another rank's output.

pub mod error;
pub mod launch;
pub mod netns;
pub mod process;
pub mod skip;

pub use error::HarnessError;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use shardline_collectives::testing::{check_close, input, naive_reduce};
use shardline_collectives::{Algorithm, CallOptions, CollectiveError, Communicator, ReduceOp};

/// Environment variable names through which the launcher configures a rank process.
pub mod env {
    /// This rank.
    pub const RANK: &str = "SHARDLINE_TEST_RANK";
    /// Number of ranks.
    pub const WORLD: &str = "SHARDLINE_TEST_WORLD";
    /// `shm` or `tcp`.
    pub const TRANSPORT: &str = "SHARDLINE_TEST_TRANSPORT";
    /// Address of the rendezvous store server.
    pub const STORE: &str = "SHARDLINE_TEST_STORE";
    /// Job token for the store.
    pub const TOKEN: &str = "SHARDLINE_TEST_TOKEN";
    /// Job name (store keys, shm segment names).
    pub const JOB: &str = "SHARDLINE_TEST_JOB";
    /// `grid`, `loop`, `hang` or `bench`.
    pub const SCENARIO: &str = "SHARDLINE_TEST_SCENARIO";
    /// The rank a failure scenario singles out.
    pub const VICTIM: &str = "SHARDLINE_TEST_VICTIM";
    /// Deadline of every op, in milliseconds.
    pub const TIMEOUT_MS: &str = "SHARDLINE_TEST_TIMEOUT_MS";
    /// In `bench`, the all-reduce size in bytes.
    pub const BENCH_BYTES: &str = "SHARDLINE_TEST_BENCH_BYTES";
    /// In `bench`, timed iterations.
    pub const BENCH_ITERS: &str = "SHARDLINE_TEST_BENCH_ITERS";
    /// In `loop`, the victim exits (code 3) this many ms after its first op completed.
    pub const DIE_AFTER_MS: &str = "SHARDLINE_TEST_DIE_AFTER_MS";
}

/// Configuration of one rank process, read from the environment (see [`env`](mod@env)).
#[derive(Clone, Debug)]
pub struct RankConfig {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// `shm` or `tcp`.
    pub transport: String,
    /// Store server address.
    pub store: String,
    /// Job token.
    pub token: String,
    /// Job name.
    pub job: String,
    /// Scenario to run.
    pub scenario: String,
    /// Rank singled out by failure scenarios.
    pub victim: Option<usize>,
    /// Deadline of every op.
    pub timeout: Duration,
    /// See [`env::DIE_AFTER_MS`].
    pub die_after: Option<Duration>,
}

impl RankConfig {
    /// Reads the configuration; errors name the missing or malformed variable.
    pub fn from_env() -> Result<Self, String> {
        let var = |k: &str| std::env::var(k).map_err(|_| format!("{k} is not set"));
        let num = |k: &str| -> Result<u64, String> {
            var(k)?.trim().parse::<u64>().map_err(|e| format!("{k}: {e}"))
        };
        let opt = |k: &str| -> Result<Option<u64>, String> {
            match std::env::var(k) {
                Ok(v) => v.trim().parse::<u64>().map(Some).map_err(|e| format!("{k}: {e}")),
                Err(_) => Ok(None),
            }
        };
        let cfg = RankConfig {
            rank: num(env::RANK)? as usize,
            world: num(env::WORLD)? as usize,
            transport: var(env::TRANSPORT)?,
            store: var(env::STORE)?,
            token: var(env::TOKEN)?,
            job: var(env::JOB)?,
            scenario: var(env::SCENARIO)?,
            victim: opt(env::VICTIM)?.map(|v| v as usize),
            timeout: Duration::from_millis(opt(env::TIMEOUT_MS)?.unwrap_or(30_000)),
            die_after: opt(env::DIE_AFTER_MS)?.map(Duration::from_millis),
        };
        if cfg.rank >= cfg.world {
            return Err(format!("rank {} out of world {}", cfg.rank, cfg.world));
        }
        Ok(cfg)
    }
}

/// The JSON line a rank prints: once when ready (`ready`), once at the end (`done`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Outcome {
    /// The reporting rank.
    pub rank: usize,
    /// The first op completed (failure scenarios wait for this before striking).
    pub ready: bool,
    /// Final line.
    pub done: bool,
    /// The scenario passed on this rank.
    pub ok: bool,
    /// Cases checked.
    pub cases: usize,
    /// Hash of the results that must be identical on every rank (all-reduce, all-gather,
    /// broadcast), so the launcher can compare ranks.
    pub checksum: u64,
    /// Variant name of the error, if the scenario ended with one.
    pub error_kind: Option<String>,
    /// Rank the error names (lost or late peer).
    pub error_rank: Option<usize>,
    /// Error text.
    pub error: Option<String>,
    /// `bench`: mean time of one op, in microseconds.
    pub time_us: f64,
}

impl Outcome {
    /// Fills the error fields from a collective error.
    pub fn with_error(mut self, e: &CollectiveError) -> Self {
        let (kind, rank) = match e {
            CollectiveError::PeerLost { rank, .. } => ("PeerLost", Some(*rank)),
            CollectiveError::Timeout { peer, .. } => ("Timeout", Some(*peer)),
            CollectiveError::Mismatch { peer, .. } => ("Mismatch", Some(*peer)),
            CollectiveError::PeerFailed { .. } => ("PeerFailed", None),
            CollectiveError::Aborted { .. } => ("Aborted", None),
            _ => ("Other", None),
        };
        self.error_kind = Some(kind.to_owned());
        self.error_rank = rank;
        self.error = Some(e.to_string());
        self
    }
}

fn fnv(h: u64, xs: &[f32]) -> u64 {
    xs.iter().fold(h, |h, x| (h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3))
}

/// A reduced conformance grid for one rank of a multi-process group: every op x ReduceOp
/// x counts {0, 1, W-1, 997, 2^20+3} x {Ring, Direct, Auto}, checked against the naive
/// reference (MP-2), plus a repeated all-reduce that must be bitwise identical.
/// Returns (cases, checksum of the rank-independent results).
pub fn run_grid(comm: &Communicator, wait: Duration) -> Result<(usize, u64), String> {
    let (rank, world) = (comm.rank(), comm.world());
    let lane = comm.lane("grid").map_err(|e| format!("lane: {e}"))?;
    let mut cases = 0;
    let mut sum = 0xcbf2_9ce4_8422_2325u64;
    let mut counts = vec![0usize, 1, world - 1, 997, (1 << 20) + 3];
    counts.sort_unstable();
    counts.dedup();
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
    for (a, algo) in [Algorithm::Ring, Algorithm::Direct, Algorithm::Auto].into_iter().enumerate() {
        let mut o = CallOptions::new();
        o.algorithm(algo);
        for (c, &count) in counts.iter().enumerate() {
            let seed = (a * 100 + c) as u64 * 1000;
            let ctx = |what: &str| format!("{what} count={count} algo={algo:?} rank={rank}");
            for (k, &op) in ops.iter().enumerate() {
                let ins: Vec<Vec<f32>> =
                    (0..world).map(|r| input(seed + k as u64, r, count)).collect();
                let got = lane
                    .all_reduce_opts(ins[rank].clone(), op, &o)
                    .wait_timeout(wait)
                    .map_err(|e| format!("{}: {e}", ctx("all_reduce")))?;
                check_close(&got, &naive_reduce(&ins, op), op, world)
                    .map_err(|e| format!("{} {op:?}: {e}", ctx("all_reduce")))?;
                sum = fnv(sum, &got);
                cases += 1;

                let ins: Vec<Vec<f32>> =
                    (0..world).map(|r| input(seed + 10 + k as u64, r, world * count)).collect();
                let want = naive_reduce(&ins, op);
                let (_, got) = lane
                    .reduce_scatter_opts(ins[rank].clone(), vec![0.0; count], op, &o)
                    .wait_timeout(wait)
                    .map_err(|e| format!("{}: {e}", ctx("reduce_scatter")))?;
                check_close(&got, &want[rank * count..(rank + 1) * count], op, world)
                    .map_err(|e| format!("{} {op:?}: {e}", ctx("reduce_scatter")))?;
                cases += 1;
                let got = lane
                    .reduce_scatter_in_place_opts(ins[rank].clone(), op, &o)
                    .wait_timeout(wait)
                    .map_err(|e| format!("{}: {e}", ctx("reduce_scatter_in_place")))?;
                check_close(
                    &got[rank * count..(rank + 1) * count],
                    &want[rank * count..(rank + 1) * count],
                    op,
                    world,
                )
                .map_err(|e| format!("{} {op:?}: {e}", ctx("reduce_scatter_in_place")))?;
                cases += 1;
            }
            let shards: Vec<Vec<f32>> = (0..world).map(|r| input(seed + 20, r, count)).collect();
            let (_, got) = lane
                .all_gather_opts(shards[rank].clone(), vec![0.0; world * count], &o)
                .wait_timeout(wait)
                .map_err(|e| format!("{}: {e}", ctx("all_gather")))?;
            if got != shards.concat() {
                return Err(format!("{}: wrong result", ctx("all_gather")));
            }
            sum = fnv(sum, &got);
            cases += 1;
            // In place, odd ranks out of place (the forms mix: same wire traffic).
            let got = if rank % 2 == 1 {
                let w = lane.all_gather_opts(shards[rank].clone(), vec![0.0; world * count], &o);
                w.wait_timeout(wait).map(|(_, full)| full)
            } else {
                let mut buf = vec![f32::NAN; world * count];
                buf[rank * count..(rank + 1) * count].copy_from_slice(&shards[rank]);
                lane.all_gather_in_place_opts(buf, &o).wait_timeout(wait)
            };
            let got = got.map_err(|e| format!("{}: {e}", ctx("all_gather_in_place")))?;
            if got.iter().map(|x| x.to_bits()).ne(shards.concat().iter().map(|x| x.to_bits())) {
                return Err(format!("{}: wrong result", ctx("all_gather_in_place")));
            }
            cases += 1;
            for root in [0, world - 1] {
                let src = input(seed + 30 + root as u64, root, count);
                let buf = if rank == root { src.clone() } else { vec![f32::NAN; count] };
                let got = lane
                    .broadcast_opts(buf, root, &o)
                    .wait_timeout(wait)
                    .map_err(|e| format!("{}: {e}", ctx("broadcast")))?;
                if got.iter().map(|x| x.to_bits()).ne(src.iter().map(|x| x.to_bits())) {
                    return Err(format!("{}: wrong result from root {root}", ctx("broadcast")));
                }
                sum = fnv(sum, &got);
                cases += 1;
            }
            lane.barrier_opts(&o)
                .wait_timeout(wait)
                .map_err(|e| format!("{}: {e}", ctx("barrier")))?;
            cases += 1;
        }
    }
    // Determinism: the same all-reduce twice gives bitwise-equal results.
    let x = input(99, rank, 100_003);
    let a =
        lane.all_reduce(x.clone(), ReduceOp::Sum).wait_timeout(wait).map_err(|e| e.to_string())?;
    let b = lane.all_reduce(x, ReduceOp::Sum).wait_timeout(wait).map_err(|e| e.to_string())?;
    if a.iter().map(|x| x.to_bits()).ne(b.iter().map(|x| x.to_bits())) {
        return Err("repeated all_reduce differs".into());
    }
    sum = fnv(sum, &a);
    Ok((cases + 2, sum))
}

/// A group of rank processes (MP-1: killed and reaped on drop).
pub struct Group {
    children: Vec<Option<Child>>,
    lines: mpsc::Receiver<(usize, String)>,
    /// Lines seen so far, per rank.
    pub seen: HashMap<usize, Vec<String>>,
}

impl Group {
    /// Spawns `world` processes of `exe`, rank `r` with the common `env` plus its rank.
    pub fn spawn(exe: &str, world: usize, env: &[(&str, String)]) -> std::io::Result<Group> {
        let (tx, rx) = mpsc::channel();
        let mut g = Group { children: Vec::new(), lines: rx, seen: HashMap::new() };
        for rank in 0..world {
            let mut cmd = Command::new(exe);
            cmd.env(env::RANK, rank.to_string())
                .env(env::WORLD, world.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn()?;
            if let Some(out) = child.stdout.take() {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(out).lines().map_while(Result::ok) {
                        if tx.send((rank, line)).is_err() {
                            break;
                        }
                    }
                });
            }
            g.children.push(Some(child));
        }
        Ok(g)
    }

    /// Kills rank `r` (SIGKILL) and reaps it.
    pub fn kill(&mut self, r: usize) {
        if let Some(mut c) = self.children.get_mut(r).and_then(Option::take) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn reap(&mut self) -> Vec<(usize, i32)> {
        let mut exited = Vec::new();
        for (r, slot) in self.children.iter_mut().enumerate() {
            if let Some(c) = slot {
                if let Ok(Some(st)) = c.try_wait() {
                    exited.push((r, st.code().unwrap_or(-1)));
                    *slot = None;
                }
            }
        }
        exited
    }

    /// Waits until `pred(rank, outcome)` held for every rank in `ranks` (on their JSON
    /// lines), reaping exited children meanwhile. Fails at `deadline` (MP-1).
    pub fn wait_for(
        &mut self,
        ranks: &[usize],
        deadline: Duration,
        pred: impl Fn(&Outcome) -> bool,
    ) -> Result<HashMap<usize, Outcome>, String> {
        let end = Instant::now() + deadline;
        let mut got: HashMap<usize, Outcome> = HashMap::new();
        // Exit code and time of each exited child.
        let mut exits: HashMap<usize, (i32, Instant)> = HashMap::new();
        loop {
            let now = Instant::now();
            for (r, code) in self.reap() {
                exits.insert(r, (code, now));
            }
            while let Ok((r, line)) = self.lines.try_recv() {
                self.seen.entry(r).or_default().push(line.clone());
                if let Ok(o) = serde_json::from_str::<Outcome>(&line) {
                    if pred(&o) {
                        got.insert(r, o);
                    }
                }
            }
            if ranks.iter().all(|r| got.contains_key(r)) {
                return Ok(got);
            }
            // A rank that exited without the awaited line will never print it (its pipe
            // gets a moment to drain first).
            for r in ranks {
                if let Some(&(code, at)) = exits.get(r) {
                    if !got.contains_key(r) && now.duration_since(at) > Duration::from_millis(500) {
                        return Err(format!(
                            "rank {r} exited with code {code} without the awaited line; seen {:?}",
                            self.seen
                        ));
                    }
                }
            }
            if Instant::now() >= end {
                return Err(format!(
                    "deadline passed waiting for ranks {ranks:?}; got {:?}; seen {:?}",
                    got.keys().collect::<Vec<_>>(),
                    self.seen
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        for r in 0..self.children.len() {
            self.kill(r);
        }
    }
}
