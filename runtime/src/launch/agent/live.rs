//! The agents' side of live recovery (`--live-recovery`, LIVE-4, LIVE-7..10 in
//! `launch/live.rs`): replacing a failed worker in place, stopping a worker its peers report
//! late, and the deciding agent's live membership when a node is lost or arrives.

use super::{describe, growing, received, signal_all, Agent, Worker};
use crate::error::{Result, RuntimeError};
use crate::launch::store_link::{Generation, Got};
use std::time::Duration;

impl Agent<'_> {
    /// LIVE-9: starts this node's workers into the live membership's epoch of a running
    /// generation that grew to this node.
    pub(super) fn spawn_into_live(&mut self, g: &Generation) -> Result<Vec<Worker>> {
        let key = crate::launch::live::membership_key(&self.gen_job(g.gen));
        let m: crate::launch::live::Membership = match self.link.get(&key) {
            Got::Value(v) => serde_json::from_slice(&v)
                .map_err(|e| RuntimeError::config(format!("a bad membership record: {e}")))?,
            _ => return Err(RuntimeError::config("a live growth without a membership record")),
        };
        self.log(format_args!(
            "joining generation {} live at epoch {} (node(s) {:?})",
            g.gen, m.epoch, m.nodes
        ));
        self.spawn_with(g, Some(m.epoch))
    }

    /// LIVE-7: under `--live-recovery` an elastic job that lost node `lost` goes on without
    /// it while at least MIN nodes are left: the membership of the nodes left is written from
    /// the epoch after every epoch a worker of `g` published, and so is the generation's node
    /// list; the workers left move on in their processes. False when it does not (not live,
    /// not elastic, too few nodes left, or the record was lost to another agent): the caller
    /// restarts the generation as without live recovery.
    pub(super) fn shrink_live(
        &mut self,
        g: &mut Generation,
        lost: usize,
        quiet: Duration,
    ) -> Result<bool> {
        let o = self.o;
        if !o.live_recovery || o.min_nodes >= o.nnodes {
            return Ok(false);
        }
        let nodes: Vec<usize> = g.nodes.iter().copied().filter(|&n| n != lost).collect();
        if nodes.len() < o.min_nodes {
            return Ok(false);
        }
        let Some(epoch) = self.move_membership(g, nodes)? else { return Ok(false) };
        self.log(format_args!(
            "fault: node {lost} lost: no heartbeat for {:.1} s during step {} (generation {}): the job goes on live on node(s) {:?} (epoch {}, world {})",
            quiet.as_secs_f64(),
            self.progress + 1,
            g.gen,
            g.nodes,
            epoch,
            g.nodes.len() * o.nproc_per_node
        ));
        Ok(true)
    }

    /// LIVE-12: whether the deciding agent of a fixed-size job under live recovery goes on
    /// awaiting node `n`, silent for `quiet`, instead of counting it as lost: until the
    /// heartbeat timeout it is not silent; after it, for as long again as a cut-off agent
    /// keeps its workers ([`super::QUORUM_LOST`]), since its workers, or its agent started
    /// again, can still meet the others' next epoch. `silent` lists the nodes awaited and
    /// since when their heartbeats are still.
    pub(super) fn await_silent(
        &mut self,
        n: usize,
        quiet: Duration,
        silent: &mut Vec<(usize, std::time::Instant)>,
    ) -> bool {
        let o = self.o;
        let at = silent.iter().position(|(s, _)| *s == n);
        if quiet < o.heartbeat_timeout {
            if let Some(i) = at {
                let (_, since) = silent.swap_remove(i);
                self.log(format_args!(
                    "node {n} is back after {:.1} s silent: it recovers in place (live recovery)",
                    since.elapsed().as_secs_f64()
                ));
            }
            return true;
        }
        let awaited =
            awaits_silent(o.live_recovery, o.min_nodes < o.nnodes, quiet, o.heartbeat_timeout);
        if awaited && at.is_none() {
            // Since its heartbeat went still.
            let since = std::time::Instant::now().checked_sub(quiet);
            silent.push((n, since.unwrap_or_else(std::time::Instant::now)));
            self.log(format_args!(
                "node {n} silent for {:.1} s during step {}: awaited in place for up to {:.1} s more (live recovery), then counted as lost",
                quiet.as_secs_f64(),
                self.progress + 1,
                (o.heartbeat_timeout + super::QUORUM_LOST - quiet).as_secs_f64()
            ));
        }
        awaited
    }

    /// LIVE-9: grows generation `g` to `nodes` in memory: writes the membership from the
    /// epoch after every epoch a worker published, the generation's node list (the arriving
    /// agents start their workers into that epoch), then the planned stop to this node's
    /// workers. False when the records could not be written (another agent wrote first, or
    /// the store did not answer): the caller follows.
    pub(super) fn grow_live(
        &mut self,
        g: &mut Generation,
        nodes: Vec<usize>,
        joining: &[usize],
        workers: &[Worker],
    ) -> Result<bool> {
        let Some(epoch) = self.move_membership(g, nodes)? else { return Ok(false) };
        self.log(format_args!(
            "{} in generation {}: the job grows live to node(s) {:?} (epoch {epoch}, world {}); SIGUSR1 to this node's workers: the group stops after a step and goes on with the new node(s)",
            growing::who_joined(joining),
            g.gen,
            g.nodes,
            g.nodes.len() * self.o.nproc_per_node
        ));
        signal_all(workers, nix::sys::signal::Signal::SIGUSR1);
        Ok(true)
    }

    /// Writes the membership of `nodes` from the epoch after every epoch a worker of `g`
    /// published (LIVE-7), then `g` on those nodes; the membership's epoch, or `None` (`g`
    /// unchanged) when either write did not happen.
    fn move_membership(&mut self, g: &mut Generation, nodes: Vec<usize>) -> Result<Option<u64>> {
        let epoch = self.last_epoch(g) + 1;
        let m = crate::launch::live::Membership { epoch, nodes: nodes.clone() };
        let text = serde_json::to_vec(&m)
            .map_err(|e| RuntimeError::config(format!("encoding membership: {e}")))?;
        let job = self.gen_job(g.gen);
        if !self.link.set(&crate::launch::live::membership_key(&job), &text) {
            return Ok(None);
        }
        let before = std::mem::replace(&mut g.nodes, nodes);
        if !self.publish(g)? {
            g.nodes = before;
            return Ok(None);
        }
        Ok(Some(epoch))
    }

    /// LIVE-4: under live recovery, the epoch after the one this node's worker `local` of
    /// `g` last published, when it published one: the agent lost it (it restarted) while
    /// the generation runs on.
    pub(super) fn returning_epoch(&mut self, g: &Generation, local: usize) -> Option<u64> {
        if !self.o.live_recovery {
            return None;
        }
        let key = crate::launch::live::epoch_key(&self.gen_job(g.gen), self.o.node_rank, local);
        match self.link.get(&key) {
            Got::Value(v) => {
                let e = std::str::from_utf8(&v).ok().and_then(|t| t.parse::<u64>().ok())?;
                Some(e + 1)
            }
            _ => None,
        }
    }

    /// The newest epoch any worker of `g` published (LIVE-4).
    fn last_epoch(&mut self, g: &Generation) -> u64 {
        let job = self.gen_job(g.gen);
        let mut last = 0u64;
        for &n in &g.nodes {
            for l in 0..self.o.nproc_per_node {
                if let Got::Value(v) = self.link.get(&crate::launch::live::epoch_key(&job, n, l)) {
                    let e = std::str::from_utf8(&v).ok().and_then(|t| t.parse::<u64>().ok());
                    last = last.max(e.unwrap_or(0));
                }
            }
        }
        last
    }

    /// LIVE-10: SIGKILLs a worker of this node that its peers report late to an epoch's
    /// meeting while the epoch it published is older: it hangs, and is replaced as a failed
    /// worker.
    fn stop_late(&mut self, workers: &mut [Worker], g: &Generation) {
        let job = self.gen_job(g.gen);
        let me = self.o.node_rank;
        let Got::Value(v) = self.link.get(&crate::launch::live::lag_key(&job, me)) else { return };
        let text = String::from_utf8_lossy(&v).into_owned();
        for w in workers.iter_mut().filter(|w| w.status.is_none() && !w.stopped_late) {
            let published = match self.link.get(&crate::launch::live::epoch_key(&job, me, w.local))
            {
                Got::Value(e) => std::str::from_utf8(&e).ok().and_then(|t| t.parse().ok()),
                _ => Some(0),
            };
            // A replacement has not published yet: it stands in the epoch it was started into.
            let published = published.map(|p: u64| p.max(w.epoch));
            if published.is_some_and(|p| crate::launch::live::is_late(&text, w.local, p)) {
                w.stopped_late = true;
                self.log(format_args!(
                    "fault: rank {} (node {me} worker {}) did not come to its peers' next epoch in time ({text}): stopped, to be replaced",
                    w.rank, w.local
                ));
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(w.child.id() as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }

    /// LIVE-4: under `--live-recovery`, starts a replacement for each worker of `g` that
    /// failed (not one that exited 0, 2 or [`EXIT_LIVE_FALLBACK`]) while replacements are
    /// left, into the epoch after the one its predecessor published. The failures it does
    /// not replace are left for [`Agent::poll_workers`].
    pub(super) fn replace_failed(&mut self, workers: &mut [Worker], g: &Generation) {
        // A stop that was asked for is not a failure to recover from.
        if !self.o.live_recovery || self.forwarded != 0 || received() != 0 {
            return;
        }
        self.stop_late(workers, g);
        for w in workers.iter_mut().filter(|w| w.status.is_none()) {
            let st = match w.child.try_wait() {
                Ok(Some(st)) => st,
                _ => continue,
            };
            let code = st.code();
            if st.success()
                || code == Some(2)
                || code == Some(crate::launch::live::EXIT_LIVE_FALLBACK)
                || self.replaced >= self.o.max_restarts
            {
                // The child keeps its reaped status: `poll_workers` reports it.
                continue;
            }
            let key =
                crate::launch::live::epoch_key(&self.gen_job(g.gen), self.o.node_rank, w.local);
            let last = match self.link.get(&key) {
                Got::Value(v) => {
                    std::str::from_utf8(&v).ok().and_then(|t| t.parse::<u64>().ok()).unwrap_or(0)
                }
                _ => 0,
            };
            self.poll_progress(g.gen);
            match self.spawn_rank(g, w.local, Some(last + 1)) {
                Ok(child) => {
                    self.replaced += 1;
                    self.log(format_args!(
                        "fault: rank {} exited with {} during step {} (generation {}): replaced in place, epoch {} (live recovery, {}/{})",
                        w.rank,
                        describe(st),
                        self.progress + 1,
                        g.gen,
                        last + 1,
                        self.replaced,
                        self.o.max_restarts
                    ));
                    w.child = child;
                    (w.epoch, w.stopped_late) = (last + 1, false);
                }
                Err(e) => self.log(format_args!("cannot replace rank {}: {e}", w.rank)),
            }
        }
    }
}

/// LIVE-12: whether a node silent for `quiet` is still awaited in place: under live
/// recovery, in a fixed-size job, up to the heartbeat timeout plus [`super::QUORUM_LOST`].
/// An elastic job goes on without it instead (LIVE-7), and without live recovery the group
/// restarts.
pub(super) fn awaits_silent(
    live: bool,
    elastic: bool,
    quiet: Duration,
    heartbeat: Duration,
) -> bool {
    live && !elastic && quiet < heartbeat + super::QUORUM_LOST
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_node_is_awaited_in_place_only_live_and_fixed_size_live_12() {
        let (hb, s) = (Duration::from_secs(1), Duration::from_secs(1));
        assert!(awaits_silent(true, false, hb + s, hb));
        assert!(!awaits_silent(true, false, hb + super::super::QUORUM_LOST, hb), "bounded");
        assert!(!awaits_silent(false, false, hb + s, hb), "not live: the group restarts");
        assert!(!awaits_silent(true, true, hb + s, hb), "elastic: the job goes on without it");
    }
}
