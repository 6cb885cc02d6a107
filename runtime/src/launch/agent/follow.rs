//! The agent of a node that does not decide (LAUNCH-6): it runs the generations the deciding
//! agent writes in the store, reports its workers' failures and stops, says when it is ready
//! for a growth (LAUNCH-15..LAUNCH-18), and with replicas takes over the decisions once its
//! replica leads (LAUNCH-14).

use super::{Agent, Next, Worker, END_WAIT, FAST_POLL, POLL_EVERY, STORE_LOST, WAITING_NOTE_AFTER};
use crate::error::{Result, RuntimeError};
use crate::launch::rendezvous::RENDEZVOUS_TIMEOUT;
use crate::launch::store_link::{agent_key, GenState, Generation, Got};
use std::time::{Duration, Instant};

impl Agent<'_> {
    /// Any other node's agent: runs the generations the deciding agent decides (LAUNCH-6),
    /// from `cur` with `workers`; with replicas it decides once its replica leads, and stops
    /// once its replica lost the quorum (LAUNCH-14).
    pub(super) fn follow(&mut self, cur: Option<Generation>, workers: Vec<Worker>) -> Result<Next> {
        let me = self.o.node_rank;
        let mut cur = cur;
        let mut workers = workers;
        let mut reported = false;
        let mut stopped_sent = false;
        let mut last_poll: Option<Instant> = None;
        let start = Instant::now();
        let mut told_waiting = false;
        // The deciding agent stops this generation to grow it: this node said it is ready,
        // and its workers stopping on SIGTERM do as asked (LAUNCH-15..LAUNCH-18).
        let mut growing = false;
        loop {
            self.heartbeat();
            if self.forward_signals(&workers) {
                let gen = cur.as_ref().map_or(0, |g| g.gen);
                self.stop(&mut workers, gen);
                return Ok(Next::Exit(128 + self.forwarded));
            }
            let gen = cur.as_ref().map_or(0, |g| g.gen);
            if let (Some(g), false) = (cur.as_ref(), growing) {
                if g.state == GenState::Run {
                    self.replace_failed(&mut workers, g);
                }
            }
            let failed = self.poll_workers(&mut workers, gen, growing);
            if !failed.is_empty() && !reported {
                let key = agent_key(&self.job, &format!("fail/{gen}/{me}"));
                reported = self.link.set(&key, failed.join("; ").as_bytes());
            }
            let all_exited = !workers.is_empty() && workers.iter().all(|w| w.status.is_some());
            if all_exited {
                if workers.iter().all(|w| w.status.is_some_and(|s| s.success())) {
                    let key = agent_key(&self.job, &format!("end/{gen}/{me}"));
                    self.link.set(&key, b"ok");
                    self.linger_until_done(gen);
                    return Ok(Next::Exit(0));
                }
                if !reported && !growing {
                    let key = agent_key(&self.job, &format!("fail/{gen}/{me}"));
                    reported = self.link.set(&key, b"workers stopped");
                }
                if !stopped_sent {
                    let key = agent_key(&self.job, &format!("stopped/{gen}/{me}"));
                    stopped_sent = self.link.set(&key, b"stopped");
                }
            }
            // Once this node's workers failed or stopped, node 0's next decision is awaited
            // closely.
            let every = if reported || all_exited { FAST_POLL } else { POLL_EVERY };
            if last_poll.is_none_or(|t| t.elapsed() >= every) {
                last_poll = Some(Instant::now());
                if let Some(code) = self.stop_without_quorum(&mut workers, gen) {
                    return Ok(Next::Exit(code));
                }
                let got = self.link.get(&agent_key(&self.job, "gen"));
                if matches!(got, Got::Unreachable)
                    && !told_waiting
                    && self.link.last_ok.elapsed() >= WAITING_NOTE_AFTER
                {
                    // Node 0 may simply start later; say what is awaited instead of silence.
                    told_waiting = true;
                    let whose = if self.replica.is_some() {
                        "a majority of the store's replicas"
                    } else {
                        "node 0's store"
                    };
                    self.log(format_args!(
                        "waiting for {whose} at {} ({}); giving up after {:?}",
                        self.rdzv,
                        self.link.last_err.as_deref().unwrap_or("no answer"),
                        STORE_LOST
                    ));
                }
                match got {
                    Got::Unreachable if self.link.last_ok.elapsed() >= STORE_LOST => {
                        self.log(format_args!(
                            "the store at {} is unreachable for {:?}: giving up",
                            self.rdzv, STORE_LOST
                        ));
                        self.stop(&mut workers, gen);
                        return Ok(Next::Exit(1));
                    }
                    // LAUNCH-14: no generation yet and this node's replica leads: it decides.
                    Got::Unset if self.leads() => return Ok(Next::Lead(None)),
                    Got::Unset if start.elapsed() >= RENDEZVOUS_TIMEOUT => {
                        return Err(RuntimeError::config(format!(
                            "node 0's agent published no generation within {RENDEZVOUS_TIMEOUT:?}"
                        )));
                    }
                    Got::Value(v) => {
                        let g: Generation = serde_json::from_slice(&v).map_err(|e| {
                            RuntimeError::config(format!(
                                "the store holds a bad generation record: {e}"
                            ))
                        })?;
                        self.gen_seen = Some(v);
                        // LAUNCH-14: the agent that decided this generation no longer leads
                        // the store and this node's replica does: this agent takes over.
                        let running =
                            matches!(g.state, GenState::Run | GenState::Stop | GenState::Grow);
                        let same = cur.as_ref().is_some_and(|c| c.gen == g.gen);
                        if running && g.by != me && same && self.leads() {
                            return Ok(Next::Lead(Some((g, workers))));
                        }
                        if !workers.is_empty() {
                            self.poll_progress(gen);
                        }
                        let newer = cur.as_ref().is_none_or(|c| g.gen > c.gen);
                        match g.state {
                            GenState::Abort => {
                                self.log(format_args!(
                                    "node {} ended the job after a failure",
                                    g.by
                                ));
                                self.stop(&mut workers, gen);
                                let key = agent_key(&self.job, &format!("end/{}/{me}", g.gen));
                                self.link.set(&key, b"aborted");
                                return Ok(Next::Exit(1));
                            }
                            GenState::Done if workers.is_empty() || all_exited => {
                                if workers.is_empty() {
                                    self.log(format_args!(
                                        "the job finished before this node joined it"
                                    ));
                                }
                                // The deciding agent keeps the store up until it reads this.
                                let key = agent_key(&self.job, &format!("end/{}/{me}", g.gen));
                                self.link.set(&key, b"ok");
                                return Ok(Next::Exit(0));
                            }
                            GenState::Run if newer => {
                                if workers.iter().any(|w| w.status.is_none()) {
                                    self.stop(&mut workers, gen);
                                }
                                workers.clear();
                                reported = false;
                                stopped_sent = false;
                                growing = false;
                                self.progress = 0;
                                if g.grew.is_some() {
                                    self.log_join(&g);
                                }
                                if g.nodes.contains(&me) {
                                    if g.gen > 0 && g.grew.is_none() {
                                        self.log(format_args!(
                                            "restarting with generation {} on node(s) {:?}",
                                            g.gen, g.nodes
                                        ));
                                    }
                                    workers = self.spawn(&g)?;
                                } else {
                                    self.log(format_args!(
                                        "not in generation {} (node(s) {:?}): waiting to join, once it completed a step",
                                        g.gen, g.nodes
                                    ));
                                }
                                cur = Some(g);
                            }
                            // LIVE-7: the deciding agent went on live without a lost node.
                            GenState::Run
                                if cur
                                    .as_ref()
                                    .is_some_and(|c| c.gen == g.gen && c.nodes != g.nodes) =>
                            {
                                if !g.nodes.contains(&me) {
                                    self.log(format_args!(
                                        "counted as lost: generation {} goes on live on node(s) {:?}",
                                        g.gen, g.nodes
                                    ));
                                    self.stop(&mut workers, gen);
                                    workers.clear();
                                } else if workers.is_empty() {
                                    // LIVE-9: the job grew in memory to this node.
                                    workers = self.spawn_into_live(&g)?;
                                }
                                cur = Some(g);
                            }
                            GenState::Grow
                                if !growing && cur.as_ref().is_some_and(|c| c.gen == g.gen) =>
                            {
                                // Ready only once the deciding agent can read it: it sends the
                                // stop after every node's agent said so.
                                let key = agent_key(&self.job, &format!("ready/{gen}/{me}"));
                                growing = self.link.set(&key, b"ready");
                            }
                            GenState::Stop if cur.as_ref().is_some_and(|c| c.gen == g.gen) => {
                                if workers.iter().any(|w| w.status.is_none()) {
                                    self.stop(&mut workers, gen);
                                }
                                if !stopped_sent {
                                    let key = agent_key(&self.job, &format!("stopped/{gen}/{me}"));
                                    stopped_sent = self.link.set(&key, b"stopped");
                                }
                            }
                            _ => {}
                        }
                    }
                    _ => {}
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// LAUNCH-19: with replicas, after this node's workers of generation `gen` all finished,
    /// stays (heartbeating, its replica serving) until the record says that generation ended
    /// or another began, for at most [`END_WAIT`]: the deciding agent writes the end with a
    /// majority of the replicas, which this node's exit could take away.
    fn linger_until_done(&mut self, gen: u64) {
        if self.replica.is_none() {
            return;
        }
        let since = Instant::now();
        while since.elapsed() < END_WAIT {
            self.heartbeat();
            if let Got::Value(v) = self.link.get(&agent_key(&self.job, "gen")) {
                if ended(&v, gen) {
                    return;
                }
            }
            if self.quorum_lost().is_some() {
                return;
            }
            std::thread::sleep(FAST_POLL);
        }
    }
}

/// LAUNCH-19: whether the generation record `record` says generation `gen` is over: it
/// ended (done or aborted) or another one began.
fn ended(record: &[u8], gen: u64) -> bool {
    serde_json::from_slice::<Generation>(record)
        .is_ok_and(|g| g.gen != gen || matches!(g.state, GenState::Done | GenState::Abort))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_follower_lingers_until_its_generation_is_recorded_over_launch_19() {
        let rec = |gen: u64, state: GenState| {
            let g = Generation { gen, nodes: vec![0, 1], state, by: 0, restarts: 0, grew: None };
            serde_json::to_vec(&g).unwrap()
        };
        assert!(!ended(&rec(2, GenState::Run), 2), "still running: it stays");
        assert!(ended(&rec(2, GenState::Done), 2));
        assert!(ended(&rec(2, GenState::Abort), 2));
        assert!(ended(&rec(3, GenState::Run), 2), "another generation began");
        assert!(!ended(b"not json", 2), "an unreadable record is no end");
    }
}
