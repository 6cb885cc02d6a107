//! The per-node agent of `shardline launch`: starts and watches the workers of each
//! generation, forwards signals, restarts or ends the job (LAUNCH-5, LAUNCH-6, LAUNCH-10),
//! and grows an elastic job when a node arrives (LAUNCH-15..LAUNCH-18). The deciding agent's
//! loop is here; `start.rs` starts an agent, `follow.rs` is the loop of the others, and
//! `growing.rs` stops a generation for the growth that `launch/grow.rs` decides.

mod follow;
mod growing;
mod live;
mod start;

pub use start::run_agent;

use super::options::LaunchOptions;
use super::rendezvous::RENDEZVOUS_TIMEOUT;
use super::store_link::{agent_key, GenState, Generation, Got, Heartbeats, Joined, StoreLink};
use super::worker::{progress_key, unix_ms};
use crate::error::{Result, RuntimeError};
use shardline_collectives::ReplicaServer;
use std::time::{Duration, Instant};

/// How long workers get to finish their step and checkpoint it after a forwarded SIGINT or
/// SIGTERM (INT-1), unless a second signal arrives.
const SIGNAL_STOP_WAIT: Duration = Duration::from_secs(120);

/// The signal last received by the agent (0: none).
fn received() -> i32 {
    crate::interrupt::requested().unwrap_or(0)
}

fn random_token() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_ok();
    if !ok {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b.copy_from_slice(&(t ^ ((std::process::id() as u128) << 64)).to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// How a worker ended, in words: `exit code 3`, `signal 9 (SIGKILL)`.
fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => {
            let name = nix::sys::signal::Signal::try_from(s).map(|s| s.as_str()).unwrap_or("?");
            format!("signal {s} ({name})")
        }
        _ => "an unknown status".into(),
    }
}

struct Worker {
    /// The rank it was started as (a live membership may renumber it since, LIVE-7).
    rank: usize,
    /// Its index on this node.
    local: usize,
    /// The live epoch it was started into (LIVE-4; 0 for a worker started with its group),
    /// and whether it was stopped for being late to a later one (LIVE-10).
    epoch: u64,
    stopped_late: bool,
    child: std::process::Child,
    status: Option<std::process::ExitStatus>,
}

fn signal_all(workers: &[Worker], sig: nix::sys::signal::Signal) {
    for w in workers.iter().filter(|w| w.status.is_none()) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(w.child.id() as i32), sig);
    }
}

/// How often an agent writes its heartbeat key.
const HEARTBEAT_EVERY: Duration = Duration::from_millis(200);
/// How often an agent reads the store (generation, reports, heartbeats, progress).
const POLL_EVERY: Duration = Duration::from_millis(100);
/// How often an agent polls the store once a failure is under way (stop, abort, restart):
/// every hand-off of that path waits at most this long.
const FAST_POLL: Duration = Duration::from_millis(20);
/// Bound of one store request of an agent (and of its reconnection attempts).
pub(super) const STORE_REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
/// An agent that has not reached the store for this long gives up on its job.
const STORE_LOST: Duration = Duration::from_secs(60);
/// After this long without reaching the store, a node's agent says what it waits for.
const WAITING_NOTE_AFTER: Duration = Duration::from_secs(3);
/// How long node 0's agent keeps the store up after success for the other nodes' reports.
const END_WAIT: Duration = Duration::from_secs(10);
/// LAUNCH-14: an agent whose store replica heard from no majority this long (three of its
/// longest election timeouts, so that an election among the others is not mistaken for a
/// partition) stops its workers and exits.
pub(super) const QUORUM_LOST: Duration = Duration::from_secs(6);
/// How long a request of an agent to the replicated store may take, failover included: a
/// little more than one election.
const REPLICATED_REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// How long an agent starting with replicas asks whether the store already runs.
const JOIN_PROBE: Duration = Duration::from_secs(2);

/// What an agent does next (LAUNCH-14: with replicas, it decides while its replica leads).
enum Next {
    /// Runs the generations another agent decides, from this one with these workers.
    Follow(Option<Generation>, Vec<Worker>),
    /// Decides the generations, from the start or taking over this one with these workers.
    Lead(Option<(Generation, Vec<Worker>)>),
    /// Exits with this code.
    Exit(i32),
}

/// How one generation ended for the deciding agent.
enum Outcome {
    Done,
    Failed(String),
    /// Nodes join (LAUNCH-15..LAUNCH-18): the next generation runs on `nodes`; `seen` is
    /// when the deciding agent first saw a node waiting outside the running generation.
    Grow {
        nodes: Vec<usize>,
        joining: Vec<usize>,
        seen: Instant,
    },
}

/// One node's agent.
struct Agent<'a> {
    o: &'a LaunchOptions,
    exe: std::path::PathBuf,
    rdzv: String,
    token: String,
    job: String,
    link: StoreLink,
    t0: Instant,
    beats: u64,
    last_beat: Option<Instant>,
    forwarded: i32,
    /// Last step rank 0 reported, per generation's job.
    progress: u64,
    /// This node's replica of the store, when the agents replicate it (LAUNCH-14).
    replica: Option<ReplicaServer>,
    /// The generation record as this agent last read or wrote it: what its next write
    /// expects to replace (LAUNCH-14).
    gen_seen: Option<Vec<u8>>,
    /// The workers' `--checkpoint-dir`, as the agent reads it from their arguments.
    checkpoint_dir: Option<std::path::PathBuf>,
    /// Whether this agent said that a node waits for want of a checkpoint directory.
    told_no_checkpoint: bool,
    /// Workers this agent replaced in place (LIVE-4), at most `--max-restarts`.
    replaced: u32,
}

/// The value of `--checkpoint-dir` in a worker's arguments (`--checkpoint-dir D` or
/// `--checkpoint-dir=D`).
fn checkpoint_dir_of(args: &[String]) -> Option<std::path::PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--checkpoint-dir" {
            return it.next().map(std::path::PathBuf::from);
        }
        if let Some(d) = a.strip_prefix("--checkpoint-dir=") {
            return Some(d.into());
        }
    }
    None
}

impl Agent<'_> {
    /// LAUNCH-9: every fault and recovery line carries the time since start, the Unix time
    /// (comparable with the workers' lines), the node and what is known of rank and step.
    fn log(&self, msg: std::fmt::Arguments<'_>) {
        say!(
            "shardline launch: [node {} t={:.3}s unix_ms={}] {msg}",
            self.o.node_rank,
            self.t0.elapsed().as_secs_f64(),
            unix_ms()
        );
    }

    fn gen_job(&self, gen: u64) -> String {
        format!("{}g{gen}", self.job)
    }

    fn heartbeat(&mut self) {
        if self.last_beat.is_some_and(|t| t.elapsed() < HEARTBEAT_EVERY) {
            return;
        }
        self.beats += 1;
        let key = agent_key(&self.job, &format!("hb/{}", self.o.node_rank));
        let v = self.beats.to_string();
        self.link.set(&key, v.as_bytes());
        self.last_beat = Some(Instant::now());
    }

    fn poll_progress(&mut self, gen: u64) {
        if let Got::Value(v) = self.link.get(&progress_key(&self.gen_job(gen))) {
            if let Some(s) = std::str::from_utf8(&v).ok().and_then(|t| t.parse::<u64>().ok()) {
                self.progress = self.progress.max(s);
            }
        }
    }

    /// Forwards a newly received SIGINT/SIGTERM; true once one was received.
    fn forward_signals(&mut self, workers: &[Worker]) -> bool {
        let sig = received();
        if sig != 0 && sig != self.forwarded {
            self.forwarded = sig;
            if let Ok(s) = nix::sys::signal::Signal::try_from(sig) {
                say!("shardline launch: forwarding {s} to the workers");
                signal_all(workers, s);
            }
        }
        sig != 0
    }

    fn spawn(&mut self, g: &Generation) -> Result<Vec<Worker>> {
        self.spawn_with(g, None)
    }

    /// This node's workers of `g`; into live epoch `epoch` when given (LIVE-9).
    fn spawn_with(&mut self, g: &Generation, epoch: Option<u64>) -> Result<Vec<Worker>> {
        use nix::sys::signal::Signal;
        let o = self.o;
        let pos = self.position(g)?;
        let world = g.nodes.len() * o.nproc_per_node;
        let mut workers: Vec<Worker> = Vec::with_capacity(o.nproc_per_node);
        for local in 0..o.nproc_per_node {
            let rank = pos * o.nproc_per_node + local;
            // LIVE-4: an agent that comes back to a running live generation starts its
            // workers as replacements of those it lost, into the epoch after theirs.
            let epoch = epoch.or_else(|| self.returning_epoch(g, local));
            match self.spawn_rank(g, local, epoch) {
                Ok(child) => workers.push(Worker {
                    rank,
                    local,
                    epoch: epoch.unwrap_or(0),
                    stopped_late: false,
                    child,
                    status: None,
                }),
                Err(e) => {
                    signal_all(&workers, Signal::SIGKILL);
                    for w in &mut workers {
                        let _ = w.child.wait();
                    }
                    return Err(RuntimeError::config(format!("starting rank {rank}: {e}")));
                }
            }
        }
        say!(
            "shardline launch: node {}/{}: ranks {}..{} of {world} started (store {}, generation {})",
            o.node_rank,
            o.nnodes,
            pos * o.nproc_per_node,
            (pos + 1) * o.nproc_per_node - 1,
            self.rdzv,
            g.gen
        );
        Ok(workers)
    }

    /// This node's place among the nodes of `g`.
    fn position(&self, g: &Generation) -> Result<usize> {
        let me = self.o.node_rank;
        g.nodes.iter().position(|&n| n == me).ok_or_else(|| {
            RuntimeError::config(format!("node {me} is not in generation {}", g.gen))
        })
    }

    /// Starts local worker `local` of generation `g`; a replacement (LIVE-4) joins
    /// communicator epoch `epoch`.
    fn spawn_rank(
        &self,
        g: &Generation,
        local: usize,
        epoch: Option<u64>,
    ) -> Result<std::process::Child> {
        use nix::sys::signal::Signal;
        use std::os::unix::process::CommandExt;
        let o = self.o;
        let pos = self.position(g)?;
        let world = g.nodes.len() * o.nproc_per_node;
        let mut args = o.worker_args.clone();
        // LAUNCH-6: a restarted group goes on from the newest checkpoint that verifies.
        if g.gen > 0 && !args.iter().any(|a| a == "--resume") {
            args.push("--resume".into());
        }
        let rank = pos * o.nproc_per_node + local;
        let mut cmd = std::process::Command::new(&self.exe);
        cmd.args(&args)
            .env("SHARDLINE_RANK", rank.to_string())
            .env("SHARDLINE_WORLD_SIZE", world.to_string())
            .env("SHARDLINE_LOCAL_RANK", local.to_string())
            .env("SHARDLINE_LOCAL_WORLD_SIZE", o.nproc_per_node.to_string())
            .env("SHARDLINE_NODE_RANK", o.node_rank.to_string())
            .env("SHARDLINE_RDZV", &self.rdzv)
            .env("SHARDLINE_TOKEN", &self.token)
            .env("SHARDLINE_JOB", self.gen_job(g.gen))
            .env("SHARDLINE_GENERATION", g.gen.to_string())
            .env("SHARDLINE_TRANSPORT", o.transport.to_string());
        if o.live_recovery {
            cmd.env("SHARDLINE_LIVE", "1");
        }
        if let Some(e) = epoch {
            cmd.env("SHARDLINE_LIVE_EPOCH", e.to_string());
        }
        // SAFETY: prctl is async-signal-safe; a worker must not outlive a killed agent.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
            });
        }
        cmd.spawn().map_err(|e| RuntimeError::config(format!("starting rank {rank}: {e}")))
    }

    /// Reaps exited workers; logs and returns the failures seen now (LAUNCH-5). While the
    /// generation stops to grow, a worker that stopped after a step as the planned stop asks
    /// (INT-3, `growing::stopped_as_asked`) did as asked.
    fn poll_workers(&mut self, workers: &mut [Worker], gen: u64, to_grow: bool) -> Vec<String> {
        let mut bad: Vec<(usize, String)> = Vec::new();
        for w in workers.iter_mut().filter(|w| w.status.is_none()) {
            match w.child.try_wait() {
                Ok(Some(st)) => {
                    w.status = Some(st);
                    let as_asked = to_grow && growing::stopped_as_asked(st);
                    if !st.success() && !as_asked {
                        bad.push((w.rank, format!("exited with {}", describe(st))));
                    }
                }
                Ok(None) => {}
                Err(e) => bad.push((w.rank, format!("cannot be waited for: {e}"))),
            }
        }
        if bad.is_empty() {
            return Vec::new();
        }
        // The step in the line is where rank 0 stood: read it now, not at the last poll.
        self.poll_progress(gen);
        let step = self.progress + 1;
        let failed: Vec<String> = bad
            .into_iter()
            .map(|(rank, what)| format!("rank {rank} {what} during step {step} (generation {gen})"))
            .collect();
        for f in &failed {
            self.log(format_args!("fault: {f}"));
        }
        failed
    }

    /// Gives the workers `grace` to exit on their own (and report their errors), then kills
    /// the rest and reaps them all.
    fn stop(&mut self, workers: &mut [Worker], gen: u64) {
        // After a forwarded SIGINT/SIGTERM the workers are finishing a step and writing its
        // checkpoint: give them time for that, unless the user signals again.
        let asked = self.forwarded != 0;
        let wait = if asked { self.o.grace.max(SIGNAL_STOP_WAIT) } else { self.o.grace };
        let until = Instant::now() + wait;
        while workers.iter().any(|w| w.status.is_none())
            && Instant::now() < until
            && !(asked && crate::interrupt::count() >= 2)
        {
            self.heartbeat();
            self.poll_workers(workers, gen, false);
            std::thread::sleep(Duration::from_millis(20));
        }
        let left: Vec<usize> =
            workers.iter().filter(|w| w.status.is_none()).map(|w| w.rank).collect();
        if !left.is_empty() {
            say!("shardline launch: stopping ranks {left:?}");
            signal_all(workers, nix::sys::signal::Signal::SIGKILL);
            for w in workers.iter_mut().filter(|w| w.status.is_none()) {
                w.status = w.child.wait().ok();
            }
        }
    }

    /// Writes the generation record; with replicas only if it still holds what this agent
    /// last saw (LAUNCH-14), so that two agents can never both start a generation. False when
    /// another agent wrote it since, or this node lost the quorum: the caller follows.
    fn publish(&mut self, g: &Generation) -> Result<bool> {
        let text = serde_json::to_vec(g)
            .map_err(|e| RuntimeError::config(format!("encoding generation: {e}")))?;
        let key = agent_key(&self.job, "gen");
        let deadline = Instant::now() + STORE_LOST;
        loop {
            let expected = self.gen_seen.clone();
            match self.link.compare_set(&key, expected.as_deref(), &text) {
                Some(true) => {
                    self.gen_seen = Some(text);
                    return Ok(true);
                }
                Some(false) => {
                    self.log(format_args!(
                        "another agent wrote generation record first: following it"
                    ));
                    return Ok(false);
                }
                None => {}
            }
            if self.quorum_lost().is_some() {
                return Ok(false);
            }
            if Instant::now() >= deadline {
                return Err(RuntimeError::config("the deciding agent cannot reach the store"));
            }
            std::thread::sleep(POLL_EVERY);
        }
    }

    /// LAUNCH-14: whether this node's replica leads the store.
    fn leads(&self) -> bool {
        self.replica.as_ref().is_some_and(|r| r.status().leads)
    }

    /// LAUNCH-14: why this node's replica counts as cut off from a majority, if it does.
    fn quorum_lost(&self) -> Option<String> {
        let st = self.replica.as_ref()?.status();
        let wrote = self.link.last_write.map(|t| t.elapsed());
        let (quiet, limit) = match (st.out_of_contact, wrote) {
            // A write of this agent's that committed since proves contact with a majority:
            // its replica may lag behind it (a link just back, an election it caused).
            (Some(t), w) => (w.map_or(t, |w| t.min(w)), QUORUM_LOST),
            // Its replica heard no other leader (it led, then stepped down): the writes say.
            (None, Some(w)) => (w, QUORUM_LOST),
            // Never in contact: the other agents may still be starting.
            (None, None) => (self.t0.elapsed(), RENDEZVOUS_TIMEOUT),
        };
        (quiet >= limit).then(|| {
            format!(
                "lost the quorum: this node's store replica has heard from no majority of the {} replicas for {:.1} s (a partition, or most nodes lost)",
                self.o.nnodes,
                quiet.as_secs_f64()
            )
        })
    }

    /// LAUNCH-14: stops this node's workers and returns the exit code once the quorum is lost.
    fn stop_without_quorum(&mut self, workers: &mut [Worker], gen: u64) -> Option<i32> {
        let why = self.quorum_lost()?;
        self.log(format_args!("{why}: stopping this node's workers"));
        self.stop(workers, gen);
        Some(1)
    }

    /// Why a generation taken over fails at once, if it does: it was stopping, this node
    /// is not in it, or its workers here failed.
    fn takeover_failure(&self, g: &Generation, workers: &[Worker]) -> Option<String> {
        let me = self.o.node_rank;
        if matches!(g.state, GenState::Stop | GenState::Grow) {
            return Some(format!(
                "generation {} was stopping when node {}'s agent stopped leading",
                g.gen, g.by
            ));
        }
        if !g.nodes.contains(&me) || workers.is_empty() {
            return Some(format!("node {me} leads the store and rejoins the job"));
        }
        workers
            .iter()
            .filter_map(|w| w.status.filter(|s| !s.success()).map(|s| (w.rank, s)))
            .next()
            .map(|(rank, s)| {
                format!("rank {rank} exited with {} (generation {})", describe(s), g.gen)
            })
    }

    /// Node 0: which nodes start the job. A fixed-size job takes them all (its workers'
    /// rendezvous waits for them); an elastic one waits a while for the most nodes and goes
    /// with those whose agents showed up, if at least the fewest.
    fn initial_nodes(&mut self, beats: &mut Heartbeats) -> Result<Vec<usize>> {
        let o = self.o;
        if o.min_nodes >= o.nnodes {
            return Ok((0..o.nnodes).collect());
        }
        let start = Instant::now();
        loop {
            self.heartbeat();
            beats.poll(&mut self.link, &self.job);
            let up: Vec<usize> = (0..o.nnodes)
                .filter(|&n| n == o.node_rank || beats.fresh(n, o.heartbeat_timeout))
                .collect();
            if up.len() == o.nnodes || (start.elapsed() >= o.join_wait && up.len() >= o.min_nodes) {
                return Ok(up);
            }
            if start.elapsed() >= RENDEZVOUS_TIMEOUT {
                return Err(RuntimeError::config(format!(
                    "only node(s) {up:?} joined within {RENDEZVOUS_TIMEOUT:?}; --nnodes needs at least {}",
                    o.min_nodes
                )));
            }
            std::thread::sleep(POLL_EVERY);
        }
    }

    /// The deciding agent (LAUNCH-6, LAUNCH-10): node 0's with a single store; with replicas
    /// the one whose replica leads (LAUNCH-14), from the start, or taking over the running
    /// generation `adopt` with this node's workers.
    fn coordinate(&mut self, adopt: Option<(Generation, Vec<Worker>)>) -> Result<Next> {
        let o = self.o;
        let me = o.node_rank;
        let mut beats = Heartbeats::new(o.nnodes);
        let mut restarts = 0u32;
        // (step to pass, when the failure was detected)
        let mut recovering: Option<(u64, Instant)> = None;
        // (nodes that joined, when their arrival was seen) until the grown generation steps.
        let mut training_again: Option<(Vec<usize>, Instant)> = None;
        // A generation taken over, with this node's workers and why it fails at once.
        let mut adopted: Option<(Vec<Worker>, Option<String>)> = None;
        let mut g = match adopt {
            Some((g, workers)) => {
                restarts = g.restarts;
                let why = self.takeover_failure(&g, &workers);
                self.log(format_args!(
                    "this node's store replica leads: its agent takes over generation {} from node {}",
                    g.gen, g.by
                ));
                adopted = Some((workers, why));
                g
            }
            None => {
                let nodes = self.initial_nodes(&mut beats)?;
                Generation { gen: 0, nodes, state: GenState::Run, by: me, restarts: 0, grew: None }
            }
        };
        loop {
            let (mut workers, mut fail_now) = match adopted.take() {
                Some((workers, why)) => {
                    g.by = me;
                    // A running generation is claimed as it is; a failing one by its stop.
                    if why.is_none() && !self.publish(&g)? {
                        return Ok(Next::Follow(Some(g), workers));
                    }
                    (workers, why)
                }
                None => {
                    if !self.publish(&g)? {
                        return Ok(Next::Follow(None, Vec::new()));
                    }
                    self.progress = 0;
                    (self.spawn(&g)?, None)
                }
            };
            let started = Instant::now();
            let mut last_poll: Option<Instant> = None;
            let mut interrupted = false;
            // LAUNCH-18: the first step rank 0 published in this generation.
            let mut first_step: Option<u64> = None;
            // When a node was first seen waiting outside this generation.
            let mut waiting_since: Option<Instant> = None;
            // LIVE-12: the silent nodes awaited in place, and since when.
            let mut silent: Vec<(usize, Instant)> = Vec::new();
            let outcome = loop {
                if let Some(why) = fail_now.take() {
                    break Outcome::Failed(why);
                }
                self.heartbeat();
                interrupted |= self.forward_signals(&workers);
                self.replace_failed(&mut workers, &g);
                let failed = self.poll_workers(&mut workers, g.gen, false);
                if let Some(f) = failed.into_iter().next() {
                    break Outcome::Failed(f);
                }
                if workers.iter().all(|w| w.status.is_some_and(|s| s.success())) {
                    break Outcome::Done;
                }
                if last_poll.is_none_or(|t| t.elapsed() >= POLL_EVERY) {
                    last_poll = Some(Instant::now());
                    self.poll_progress(g.gen);
                    if let Some((joining, at)) = &training_again {
                        if self.progress > 0 {
                            self.log(format_args!(
                                "{} in generation {}: training again (step {} done), {:.3} s after the arrival was seen",
                                growing::who_joined(joining),
                                g.gen,
                                self.progress,
                                at.elapsed().as_secs_f64()
                            ));
                            training_again = None;
                        }
                    }
                    if let Some((target, at)) = recovering {
                        if self.progress >= target {
                            self.log(format_args!(
                                "recovered: generation {} passed step {target} again, {:.3} s after the failure was detected",
                                g.gen,
                                at.elapsed().as_secs_f64()
                            ));
                            recovering = None;
                        }
                    }
                    if self.replica.is_some() {
                        if let Some(code) = self.stop_without_quorum(&mut workers, g.gen) {
                            return Ok(Next::Exit(code));
                        }
                        // LAUNCH-14: another agent took the record over: this one follows.
                        if let Got::Value(v) = self.link.get(&agent_key(&self.job, "gen")) {
                            if self.gen_seen.as_deref() != Some(&v[..]) {
                                self.log(format_args!(
                                    "another agent decides now: node {me} follows"
                                ));
                                self.gen_seen = Some(v);
                                return Ok(Next::Follow(Some(g), workers));
                            }
                        }
                    }
                    beats.poll(&mut self.link, &self.job);
                    let mut lost = None;
                    let others: Vec<usize> = g.nodes.iter().copied().filter(|&n| n != me).collect();
                    for n in others {
                        let key = agent_key(&self.job, &format!("fail/{}/{n}", g.gen));
                        if let Got::Value(v) = self.link.get(&key) {
                            lost =
                                Some(format!("node {n} reports: {}", String::from_utf8_lossy(&v)));
                            break;
                        }
                        let quiet = beats.silent(n, started);
                        if quiet >= o.heartbeat_timeout && self.shrink_live(&mut g, n, quiet)? {
                            continue;
                        }
                        if self.await_silent(n, quiet, &mut silent) {
                            continue;
                        }
                        if quiet >= o.heartbeat_timeout {
                            lost = Some(format!(
                                "node {n} lost: no heartbeat for {:.1} s during step {} (generation {})",
                                quiet.as_secs_f64(),
                                self.progress + 1,
                                g.gen
                            ));
                            break;
                        }
                    }
                    if let Some(why) = lost {
                        self.log(format_args!("fault: {why}"));
                        break Outcome::Failed(why);
                    }
                    if self.progress > 0 {
                        first_step.get_or_insert(self.progress);
                    }
                    let steps_done = first_step.map_or(0, |f| self.progress - f + 1);
                    if let Some(grow) =
                        self.consider_growth(&g, &beats, steps_done, &mut waiting_since)
                    {
                        // LIVE-9: under live recovery the job grows in memory.
                        match grow {
                            Outcome::Grow { nodes, joining, .. } if o.live_recovery => {
                                if !self.grow_live(&mut g, nodes, &joining, &workers)? {
                                    return Ok(Next::Follow(Some(g), workers));
                                }
                                first_step = None;
                            }
                            grow => break grow,
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            // A failure's reason; none once training finished.
            let why = match outcome {
                Outcome::Grow { nodes, joining, seen } => {
                    match self.stop_to_grow(&mut g, &mut workers, &mut beats, started)? {
                        growing::Stopped::AtStep(step) => {
                            let next = Generation {
                                gen: g.gen + 1,
                                nodes,
                                state: GenState::Run,
                                by: me,
                                restarts,
                                grew: Some(Joined { nodes: joining.clone(), step }),
                            };
                            self.log_join(&next);
                            training_again = Some((joining, seen));
                            g = next;
                            continue;
                        }
                        growing::Stopped::Finished => None,
                        growing::Stopped::Failed(why) => {
                            self.log(format_args!("fault: {why}"));
                            Some(why)
                        }
                        growing::Stopped::Follow => return Ok(Next::Follow(Some(g), workers)),
                    }
                }
                Outcome::Done => None,
                Outcome::Failed(why) => Some(why),
            };
            let Some(why) = why else {
                if let Some((target, at)) = recovering {
                    // Finished before the next poll: the group passed the step all the same.
                    self.log(format_args!(
                        "recovered: generation {} passed step {target} again and finished, {:.3} s after the failure was detected",
                        g.gen,
                        at.elapsed().as_secs_f64()
                    ));
                }
                g.state = GenState::Done;
                if !self.publish(&g)? {
                    return Ok(Next::Follow(Some(g), workers));
                }
                self.wait_for_ends(&g, &mut beats);
                if restarts > 0 {
                    self.log(format_args!("finished after {restarts} restart(s)"));
                }
                return Ok(Next::Exit(0));
            };
            let detected = Instant::now();
            let failed_step = self.progress + 1;
            g.state = GenState::Stop;
            if !self.publish(&g)? {
                return Ok(Next::Follow(Some(g), workers));
            }
            self.stop(&mut workers, g.gen);
            let alive = self.wait_stopped(&g, &mut beats, started);
            interrupted |= received() != 0;
            let give_up = |reason: String,
                           agent: &mut Self,
                           g: &mut Generation,
                           beats: &mut Heartbeats|
             -> Result<i32> {
                g.state = GenState::Abort;
                // Lost to another agent, the record says what that one decided.
                agent.publish(g)?;
                agent.log(format_args!("giving up: {reason} (last failure: {why})"));
                // The others learn of the end through this store: keep it up until they did.
                agent.wait_for_ends(g, beats);
                Ok(1)
            };
            if interrupted {
                let sig = received();
                give_up(
                    format!("stopped by {}", crate::interrupt::signal_name(sig)),
                    self,
                    &mut g,
                    &mut beats,
                )?;
                // As a shell reports a process ended by the signal.
                return Ok(Next::Exit(128 + sig));
            }
            // A worker's exit code 2 is invalid input (flags, configuration, no checkpoint
            // that verifies): a new generation would fail the same way.
            if workers.iter().any(|w| w.status.and_then(|s| s.code()) == Some(2)) {
                return give_up(
                    "a worker exited with code 2 (invalid input or configuration): a restart would fail the same way".into(),
                    self,
                    &mut g,
                    &mut beats,
                )
                .map(Next::Exit);
            }
            if restarts >= o.max_restarts {
                return give_up(
                    format!("{restarts} restart(s) of --max-restarts {} used", o.max_restarts),
                    self,
                    &mut g,
                    &mut beats,
                )
                .map(Next::Exit);
            }
            let next: Vec<usize> = if o.min_nodes >= o.nnodes {
                (0..o.nnodes).collect()
            } else {
                // LAUNCH-10: lost nodes leave; a node whose agent is back rejoins.
                (0..o.nnodes)
                    .filter(|&n| {
                        n == me
                            || alive.contains(&n)
                            || (!g.nodes.contains(&n) && beats.fresh(n, o.heartbeat_timeout))
                    })
                    .collect()
            };
            // A fixed-size job needs every node back (a partition heals, an agent restarts):
            // starting without them would only burn a restart.
            let missing: Vec<usize> = next.iter().copied().filter(|n| !alive.contains(n)).collect();
            if o.min_nodes >= o.nnodes && !missing.is_empty() {
                self.log(format_args!("waiting for node(s) {missing:?} to come back"));
                let until = Instant::now() + RENDEZVOUS_TIMEOUT;
                while Instant::now() < until
                    && !missing.iter().all(|&n| beats.fresh(n, o.heartbeat_timeout))
                {
                    self.heartbeat();
                    beats.poll(&mut self.link, &self.job);
                    std::thread::sleep(POLL_EVERY);
                }
            }
            if next.len() < o.min_nodes {
                return give_up(
                    format!("{} node(s) left, --nnodes needs at least {}", next.len(), o.min_nodes),
                    self,
                    &mut g,
                    &mut beats,
                )
                .map(Next::Exit);
            }
            restarts += 1;
            recovering = Some((failed_step, detected));
            self.log(format_args!(
                "restart {restarts}/{}: generation {} on node(s) {next:?} (world {}) resumes from the last checkpoint; the failure was at step {failed_step}",
                o.max_restarts,
                g.gen + 1,
                next.len() * o.nproc_per_node
            ));
            g = Generation {
                gen: g.gen + 1,
                nodes: next,
                state: GenState::Run,
                by: me,
                restarts,
                grew: None,
            };
        }
    }

    /// Node 0, after publishing a stop: the nodes of `g` whose agents stopped their workers,
    /// waiting at most the grace period plus the heartbeat timeout; a node whose heartbeat
    /// stays still that long is lost.
    fn wait_stopped(
        &mut self,
        g: &Generation,
        beats: &mut Heartbeats,
        started: Instant,
    ) -> Vec<usize> {
        let me = self.o.node_rank;
        let until = Instant::now() + self.o.grace + self.o.heartbeat_timeout;
        let mut alive = vec![me];
        let mut pending: Vec<usize> = g.nodes.iter().copied().filter(|&n| n != me).collect();
        while !pending.is_empty() && Instant::now() < until {
            self.heartbeat();
            beats.poll(&mut self.link, &self.job);
            let mut still = Vec::new();
            for n in pending {
                let key = agent_key(&self.job, &format!("stopped/{}/{n}", g.gen));
                match self.link.get(&key) {
                    Got::Value(_) => alive.push(n),
                    _ if beats.silent(n, started) >= self.o.heartbeat_timeout => {
                        self.log(format_args!("node {n} did not answer the stop: counted as lost"));
                    }
                    _ => still.push(n),
                }
            }
            pending = still;
            if !pending.is_empty() {
                std::thread::sleep(FAST_POLL);
            }
        }
        for n in pending {
            self.log(format_args!("node {n} did not stop in time: counted as lost"));
        }
        alive.sort_unstable();
        alive
    }

    /// Node 0 after success: keeps the store up until the other nodes' workers are done, and
    /// until the agents waiting to join learned that the job ended.
    fn wait_for_ends(&mut self, g: &Generation, beats: &mut Heartbeats) {
        let o = self.o;
        let me = o.node_rank;
        let since = Instant::now();
        let mut pending: Vec<usize> = (0..o.nnodes)
            .filter(|&n| n != me && (g.nodes.contains(&n) || beats.moving(n, o.heartbeat_timeout)))
            .collect();
        while !pending.is_empty() && since.elapsed() < END_WAIT {
            beats.poll(&mut self.link, &self.job);
            let job = self.job.clone();
            pending.retain(|&n| {
                let key = agent_key(&job, &format!("end/{}/{n}", g.gen));
                !matches!(self.link.get(&key), Got::Value(_))
                    && beats.silent(n, since) < self.o.heartbeat_timeout
            });
            if !pending.is_empty() {
                std::thread::sleep(FAST_POLL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_checkpoint_dir_is_read_in_both_spellings() {
        let got = |a: &[&str]| checkpoint_dir_of(&args(a));
        assert_eq!(got(&["train", "--checkpoint-dir", "ck", "--steps", "5"]), Some("ck".into()));
        assert_eq!(got(&["train", "--checkpoint-dir=d/e"]), Some("d/e".into()));
        assert_eq!(got(&["train", "--checkpoint-every", "3"]), None);
        assert_eq!(got(&["train", "--checkpoint-dir"]), None);
    }

    #[test]
    fn only_a_planned_stop_reads_as_asked_during_a_growth() {
        use std::os::unix::process::ExitStatusExt;
        let exited = |code: i32| std::process::ExitStatus::from_raw(code << 8);
        let killed = |sig: i32| std::process::ExitStatus::from_raw(sig);
        assert!(growing::stopped_as_asked(exited(128 + libc::SIGUSR1)));
        assert!(growing::stopped_as_asked(killed(libc::SIGUSR1)));
        // A rank that learned the stop from its group (INT-1).
        assert!(growing::stopped_as_asked(exited(128 + libc::SIGTERM)));
        assert!(!growing::stopped_as_asked(killed(libc::SIGTERM)));
        assert!(!growing::stopped_as_asked(killed(libc::SIGKILL)));
        assert!(!growing::stopped_as_asked(exited(1)));
        assert_eq!(growing::who_joined(&[1]), "node 1");
        assert_eq!(growing::who_joined(&[1, 2]), "nodes [1, 2]");
    }
}
