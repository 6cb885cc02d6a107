//! The agents' side of a growth (LAUNCH-15..LAUNCH-18, decided in `launch/grow.rs`): the
//! deciding agent writes the running generation's record as growing, waits until every other
//! agent of it said it is ready (from then on a worker that stops on SIGUSR1 does as asked),
//! sends SIGUSR1 to its own workers (a planned stop: the group stops together after a step
//! and checkpoints it, INT-1, and no wait is cut short, INT-3, as SIGTERM's watchdog would
//! after 0.5 s in a collective, losing that step's checkpoint), waits until every agent's
//! workers stopped, and starts the next generation,
//! which resumes from that checkpoint resharded on load. Growth reshards through the
//! checkpoint, never from the peers' memory, and counts no restart.

use super::{signal_all, Agent, Outcome, Worker, SIGNAL_STOP_WAIT};
use crate::checkpoint;
use crate::error::Result;
use crate::launch::grow::{decide, Decision, Keep, View};
use crate::launch::store_link::{agent_key, GenState, Generation, Got, Heartbeats};
use std::time::{Duration, Instant};

/// How the running generation's stop for a growth ended.
pub(super) enum Stopped {
    /// Every worker stopped; the newest committed checkpoint is of this step, if one is.
    AtStep(Option<u64>),
    /// This node's workers finished training instead.
    Finished,
    /// A failure during the stop: the restart path takes over.
    Failed(String),
    /// Another agent wrote the generation record first (LAUNCH-14).
    Follow,
}

/// A worker that exited as a planned stop asks (INT-3): 128 + SIGUSR1 after its step, or the
/// signal itself before its handler was installed; a worker that was sent no signal and
/// learned the stop from its group (INT-1) exits as for SIGTERM, 128 + SIGTERM.
pub(super) fn stopped_as_asked(st: std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    let code = st.code();
    code == Some(128 + libc::SIGUSR1)
        || code == Some(128 + libc::SIGTERM)
        || st.signal() == Some(libc::SIGUSR1)
}

/// `node 1`, or `nodes [1, 2]`.
pub(super) fn who_joined(nodes: &[usize]) -> String {
    match nodes {
        [n] => format!("node {n}"),
        _ => format!("nodes {nodes:?}"),
    }
}

impl Agent<'_> {
    /// The deciding agent, between its polls of a running generation: whether a node waits
    /// outside it and the job grows now (LAUNCH-15..LAUNCH-18). `waiting_since` keeps when a
    /// waiting node was first seen, for the join's log.
    pub(super) fn consider_growth(
        &mut self,
        g: &Generation,
        beats: &Heartbeats,
        steps_done: u64,
        waiting_since: &mut Option<Instant>,
    ) -> Option<Outcome> {
        let o = self.o;
        // A node joins only on a heartbeat seen moving: a key left by a dead agent never does.
        let fresh: Vec<usize> = (0..o.nnodes)
            .filter(|&n| n == o.node_rank || beats.moving(n, o.heartbeat_timeout))
            .collect();
        if fresh.iter().any(|n| !g.nodes.contains(n)) {
            waiting_since.get_or_insert_with(Instant::now);
        } else {
            *waiting_since = None;
        }
        let view = View {
            running: &g.nodes,
            stopping: g.state != GenState::Run,
            fresh: &fresh,
            max_nodes: o.nnodes,
            checkpoint_dir: self.checkpoint_dir.is_some(),
            steps_done,
        };
        match decide(&view) {
            Decision::Grow { nodes, joining } => {
                let seen = waiting_since.unwrap_or_else(Instant::now);
                Some(Outcome::Grow { nodes, joining, seen })
            }
            Decision::Keep(Keep::NoCheckpointDir) => {
                if !self.told_no_checkpoint {
                    self.told_no_checkpoint = true;
                    self.log(format_args!(
                        "a node waits to join, but without --checkpoint-dir the job cannot grow without losing steps: it stays on node(s) {:?}",
                        g.nodes
                    ));
                }
                None
            }
            Decision::Keep(_) => None,
        }
    }

    /// Stops the running generation `g` at a step boundary for a growth (see the module docs).
    pub(super) fn stop_to_grow(
        &mut self,
        g: &mut Generation,
        workers: &mut [Worker],
        beats: &mut Heartbeats,
        started: Instant,
    ) -> Result<Stopped> {
        let me = self.o.node_rank;
        g.state = GenState::Grow;
        if !self.publish(g)? {
            return Ok(Stopped::Follow);
        }
        // Every other agent of the generation says it is ready before any worker is asked to
        // stop: a worker that stops with its group then never reads as a failure.
        let until = Instant::now() + self.o.grace + self.o.heartbeat_timeout;
        let mut pending: Vec<usize> = g.nodes.iter().copied().filter(|&n| n != me).collect();
        while !pending.is_empty() {
            self.heartbeat();
            if let Some(f) = self.poll_workers(workers, g.gen, false).into_iter().next() {
                return Ok(Stopped::Failed(f));
            }
            let mut still = Vec::new();
            for n in pending {
                let fail = agent_key(&self.job, &format!("fail/{}/{n}", g.gen));
                if let Got::Value(v) = self.link.get(&fail) {
                    let what = String::from_utf8_lossy(&v);
                    return Ok(Stopped::Failed(format!("node {n} reports: {what}")));
                }
                let ready = agent_key(&self.job, &format!("ready/{}/{n}", g.gen));
                if !matches!(self.link.get(&ready), Got::Value(_)) {
                    still.push(n);
                }
            }
            pending = still;
            if pending.is_empty() {
                break;
            }
            if Instant::now() >= until {
                return Ok(Stopped::Failed(format!(
                    "node(s) {pending:?} did not answer the stop for a growth within {:.1} s (generation {})",
                    (self.o.grace + self.o.heartbeat_timeout).as_secs_f64(),
                    g.gen
                )));
            }
            beats.poll(&mut self.link, &self.job);
            std::thread::sleep(super::FAST_POLL);
        }
        self.log(format_args!(
            "stopping generation {} at a step boundary to grow (SIGUSR1 to its workers, which checkpoint that step)",
            g.gen
        ));
        signal_all(workers, nix::sys::signal::Signal::SIGUSR1);
        let until = Instant::now() + SIGNAL_STOP_WAIT;
        let mut failed = None;
        while workers.iter().any(|w| w.status.is_none()) && Instant::now() < until {
            self.heartbeat();
            self.forward_signals(workers);
            if let Some(f) = self.poll_workers(workers, g.gen, true).into_iter().next() {
                failed.get_or_insert(f);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let left: Vec<usize> =
            workers.iter().filter(|w| w.status.is_none()).map(|w| w.rank).collect();
        if !left.is_empty() {
            signal_all(workers, nix::sys::signal::Signal::SIGKILL);
            for w in workers.iter_mut().filter(|w| w.status.is_none()) {
                w.status = w.child.wait().ok();
            }
            return Ok(Stopped::Failed(format!(
                "rank(s) {left:?} did not stop within {SIGNAL_STOP_WAIT:?} of the SIGUSR1 for a growth"
            )));
        }
        if let Some(f) = failed {
            return Ok(Stopped::Failed(f));
        }
        if super::received() != 0 {
            // The user's signal came during the stop: the failure path ends the job for it.
            return Ok(Stopped::Failed("interrupted while stopping to grow".into()));
        }
        if workers.iter().all(|w| w.status.is_some_and(|s| s.success())) {
            return Ok(Stopped::Finished);
        }
        let alive = self.wait_stopped(g, beats, started);
        let gone: Vec<usize> = g.nodes.iter().copied().filter(|n| !alive.contains(n)).collect();
        if !gone.is_empty() {
            return Ok(Stopped::Failed(format!(
                "node(s) {gone:?} did not stop for a growth (generation {})",
                g.gen
            )));
        }
        for &n in g.nodes.iter().filter(|&&n| n != me) {
            let fail = agent_key(&self.job, &format!("fail/{}/{n}", g.gen));
            if let Got::Value(v) = self.link.get(&fail) {
                let what = String::from_utf8_lossy(&v);
                return Ok(Stopped::Failed(format!("node {n} reports: {what}")));
            }
        }
        let step = self
            .checkpoint_dir
            .as_ref()
            .and_then(|d| checkpoint::committed(d).ok())
            .and_then(|c| c.first().map(|(s, _)| *s));
        // A stop that wrote no checkpoint of the last step rank 0 published (a worker ended
        // by another cause meanwhile) loses steps: say so rather than grow as if none were.
        self.poll_progress(g.gen);
        if step.unwrap_or(0) < self.progress {
            self.log(format_args!(
                "generation {} stopped without a checkpoint of step {} (newest: {}): the steps after it run again",
                g.gen,
                self.progress,
                step.map_or("none".to_string(), |s| format!("step {s}"))
            ));
        }
        Ok(Stopped::AtStep(step))
    }

    /// Every agent logs a generation that grew the job (LAUNCH-9's line format).
    pub(super) fn log_join(&self, g: &Generation) {
        let Some(j) = &g.grew else { return };
        let at = j.step.map_or("the newest checkpoint".to_string(), |s| format!("step {s}"));
        let verb = if j.nodes.len() == 1 { "joins" } else { "join" };
        self.log(format_args!(
            "{} {verb} at {at}: generation {} on nodes {:?} (world {}), a planned growth: no restart counted",
            who_joined(&j.nodes),
            g.gen,
            g.nodes,
            g.nodes.len() * self.o.nproc_per_node
        ));
    }
}
