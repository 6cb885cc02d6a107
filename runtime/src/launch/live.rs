//! Live recovery in a launched worker (`shardline launch --live-recovery`): a failed peer is
//! replaced in place, and the survivors go on in their processes from the state they hold.
//!
//! Invariants:
//! - LIVE-4: a worker's communicators live in numbered *epochs* of its generation; epoch `e`
//!   of job `J` meets under the job name `J` (e = 0) or `JeN` (fresh store keys, links and
//!   segments). A survivor whose step failed keeps its engine's state (LIVE-1), drops the
//!   failed communicator and joins epoch `e + 1`; the agent starts a failed worker's
//!   replacement into the epoch after the one its predecessor last published. So every rank
//!   of the world meets again, the survivors without leaving their processes.
//! - LIVE-5: in the new epoch every rank tells every other its standing (replica set, step,
//!   clean or not, or none for a replacement) in one all-gather, and all derive the same
//!   plan (LIVE-2); each replica set's sender broadcasts its state over the set's lane
//!   `live:state`, so that state moves over the data transport and never through a file or
//!   the store. The run goes on after the plan's step, on the data of the step after it:
//!   the step in flight at the failure is run again with the same data. Without a plan the
//!   worker exits with [`EXIT_LIVE_FALLBACK`] and its agent restarts the group from the
//!   checkpoint, as without live recovery.
//! - LIVE-6: a worker recovers at most [`MAX_EPOCHS`] times, and only from a failure of
//!   its run after it stood at its start step, never from its configuration, a checkpoint,
//!   an interruption or its own memory cap.
//! - LIVE-7: membership: an elastic job's deciding agent that loses a node writes a
//!   [`Membership`] (the nodes left, from an epoch after every epoch a worker published).
//!   Before each epoch a worker reads it: it moves on to that epoch and takes its rank and
//!   world from its node's place among those nodes ([`place`]); a worker still meeting an
//!   older epoch gives that meeting up. So the survivors of a lost node go on in their
//!   processes, renumbered, with the state they hold (LIVE-8), and no restart is spent.
//! - LIVE-9: growth in memory: an elastic job's deciding agent that grows writes the grown
//!   [`Membership`] and then sends its workers the planned stop (SIGUSR1): the group stops
//!   together after a step (INT-1; its checkpoint is written as for any stop, the fallback)
//!   and, instead of exiting, every worker moves on to the membership's epoch with its state.
//!   The arriving node's agent starts its workers into that epoch with no state; they
//!   receive it from the peers holding it (LIVE-5), and the job goes on from that step.
//! - LIVE-10: a worker that hangs is out: its peers time out, move to the next epoch and
//!   report it to its node's agent once it has not come to that epoch's meeting within
//!   three collective timeouts; the agent SIGKILLs it if the epoch it published is older ([`is_late`])
//!   and replaces it as any failed worker (LIVE-4). A worker that stalls once its epoch's
//!   collectives run is found sooner, at half the timeout (LIVE-11, `live_scout`).
//! - LIVE-12: a fixed-size job's deciding agent does not count a silent node as lost at the
//!   heartbeat timeout: it awaits it in place for as long again as a cut-off agent keeps its
//!   workers (the agents' `QUORUM_LOST`). A node whose link comes back brings its workers to
//!   the others' next epoch; an agent started again there replaces its workers (LIVE-4).
//!   Only past that bound does the group restart from the checkpoint.
//! - LIVE-13: a worker meeting epoch `e` that waits for a rank whose worker published a later
//!   epoch gives the meeting up and goes on in that epoch with its state: a replacement
//!   started past the survivors' epoch (its predecessor was stopped after it had already
//!   published `e`, as a late report read after a partition can do) is met there.

use super::env::WorkerEnv;
use super::rendezvous::{connect, meet, store_err};
use crate::driver::KeptStates;
use crate::engine::live::{recovery_plan, LiveState, Standing};
use crate::engine::RankEngine;
use crate::error::{Result, RuntimeError};
use crate::train::{self, RunOptions, Summary, TrainConfig};
use shardline_collectives::{Communicator, Store};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The exit code of a worker whose live recovery found no plan (LIVE-5): its agent restarts
/// the group from the checkpoint instead of replacing the worker again.
pub const EXIT_LIVE_FALLBACK: i32 = 3;

/// Most epochs a worker goes through (LIVE-6).
pub const MAX_EPOCHS: u64 = 64;

/// The job name of epoch `epoch` of job `job` (LIVE-4).
pub fn epoch_job(job: &str, epoch: u64) -> String {
    match epoch {
        0 => job.to_string(),
        e => format!("{job}e{e}"),
    }
}

/// The store key where worker `local` of node `node` of job `job` publishes the epoch it
/// joins (LIVE-4): named by its place, which no renumbering changes (LIVE-7).
pub fn epoch_key(job: &str, node: usize, local: usize) -> String {
    format!("launch/{job}/live/epoch/{node}/{local}")
}

/// What a worker carries from one epoch into the next.
pub(super) struct LiveRun {
    /// This rank's state from the failed epoch; `None` for a replacement.
    pub(super) kept: Option<LiveState>,
    /// Whether this epoch begins with a recovery (LIVE-5).
    pub(super) recover: bool,
    /// Where the failed run leaves the state.
    pub(super) slot: KeptStates,
    /// When the failure (or the stop for a growth) was seen, and which, for the report.
    pub(super) failed_at: Option<(Instant, &'static str)>,
}

/// The store key where the workers report to node `node`'s agent a worker of its that did
/// not come to an epoch's meeting in time: `LOCAL EPOCH` (LIVE-10).
pub fn lag_key(job: &str, node: usize) -> String {
    format!("launch/{job}/live/late/{node}")
}

/// LIVE-10: whether a worker that published epoch `published` is behind a report `text`
/// (`LOCAL EPOCH`) about worker `local`: it is still in an older epoch than the meeting.
pub fn is_late(text: &str, local: usize, published: u64) -> bool {
    let mut it = text.split_whitespace().map(|t| t.parse::<u64>().ok());
    matches!((it.next(), it.next()), (Some(Some(l)), Some(Some(e))) if l == local as u64 && published < e)
}

/// LIVE-7: the deciding agent's membership record: from epoch `epoch` on, the job runs on
/// `nodes` (in rank order), each with the same number of workers.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Membership {
    /// The first epoch of this membership.
    pub epoch: u64,
    /// The nodes, in the order their ranks are numbered.
    pub nodes: Vec<usize>,
}

/// The store key of job `job`'s membership record (LIVE-7).
pub fn membership_key(job: &str) -> String {
    format!("launch/{job}/live/members")
}

/// The membership in the store now, if the deciding agent wrote one.
pub fn read_membership(store: &dyn Store, job: &str) -> Option<Membership> {
    let v = store.get(&membership_key(job), Duration::ZERO).ok()?;
    serde_json::from_slice(&v).ok()
}

/// LIVE-7: the rank and world of worker `local` of node `node` when the job runs on `nodes`
/// with `per_node` workers each; `None` when the node is not among them.
pub fn place(
    nodes: &[usize],
    node: usize,
    local: usize,
    per_node: usize,
) -> Option<(usize, usize)> {
    let pos = nodes.iter().position(|&n| n == node)?;
    Some((pos * per_node + local, nodes.len() * per_node))
}

/// LIVE-13: the later epoch an awaited worker published (`published`, its epoch key's
/// value if set) than the meeting's `epoch`, if it did.
fn moved_on(published: Option<Vec<u8>>, epoch: u64) -> Option<u64> {
    let e = std::str::from_utf8(&published?).ok()?.parse::<u64>().ok()?;
    (e > epoch).then_some(e)
}

/// The node of rank `r` with `per_node` workers a node, on `nodes` in rank order (LIVE-7),
/// or numbered in order without a membership record.
fn node_of(nodes: Option<&[usize]>, r: usize, per_node: usize) -> usize {
    nodes.map_or(r / per_node, |n| n.get(r / per_node).copied().unwrap_or(usize::MAX))
}

/// Runs this worker under live recovery: epoch after epoch until the run ends (LIVE-4,
/// LIVE-6, LIVE-7). `run_epoch` runs one epoch on a joined communicator.
pub(super) fn run_live(
    cfg: TrainConfig,
    opts: RunOptions,
    env: &WorkerEnv,
    plan: train::JobPlan,
    run_epoch: impl Fn(
        TrainConfig,
        RunOptions,
        &WorkerEnv,
        train::JobPlan,
        super::rendezvous::Joined,
        &mut LiveRun,
    ) -> Result<Summary>,
) -> Result<Summary> {
    let replacement = env.live_epoch.is_some();
    let mut epoch = env.live_epoch.unwrap_or(0);
    let mut live =
        LiveRun { kept: None, recover: replacement, slot: Arc::default(), failed_at: None };
    let node: usize = env.node.parse().map_err(|_| {
        RuntimeError::config(format!("live recovery needs a numbered node, not '{}'", env.node))
    })?;
    let (_server, store) = connect(&cfg, env)?;
    let mut planned = (cfg.world, plan);
    loop {
        // LIVE-7: a newer membership moves this worker on to its first epoch.
        let members = read_membership(&*store, &env.job);
        if let Some(m) = &members {
            epoch = epoch.max(m.epoch);
        }
        let mut here = env.clone();
        here.epoch = epoch;
        let mut cfg = cfg.clone();
        if let Some(m) = &members {
            let (rank, world) =
                place(&m.nodes, node, env.local_rank, env.local_world).ok_or_else(|| {
                    RuntimeError::Failed(format!(
                        "node {node} is no longer in the job (its nodes are now {:?})",
                        m.nodes
                    ))
                })?;
            (here.rank, here.world, cfg.world) = (rank, world, world);
        }
        if planned.0 != cfg.world {
            planned = (cfg.world, train::plan(&cfg)?);
        }
        store
            .set(&epoch_key(&env.job, node, env.local_rank), epoch.to_string().as_bytes())
            .map_err(store_err("publishing the epoch"))?;
        // LIVE-10: a rank that does not come to the meeting within three collective timeouts
        // is reported to its node's agent, which stops it if it is still in an older epoch. A
        // rank that only stalled comes sooner: its own collective fails once it runs again.
        let nodes = members.as_ref().map(|m| m.nodes.clone());
        let late = Duration::from_secs(3 * cfg.timeout_s.max(1));
        let reported = std::cell::Cell::new(None::<usize>);
        let moved = std::cell::Cell::new(None::<u64>);
        let newer = |r: usize, waited: Duration| {
            let (node, local) =
                (node_of(nodes.as_deref(), r, env.local_world), r % env.local_world);
            if waited >= late && reported.get() != Some(r) {
                reported.set(Some(r));
                let text = format!("{local} {epoch}");
                let _ = store.set(&lag_key(&env.job, node), text.as_bytes());
            }
            if read_membership(&*store, &env.job).is_some_and(|m| m.epoch > epoch) {
                return true;
            }
            // LIVE-13: the awaited rank's worker stands in a later epoch (a replacement
            // started there): this meeting cannot complete; everyone goes on to that one.
            let later =
                moved_on(store.get(&epoch_key(&env.job, node, local), Duration::ZERO).ok(), epoch);
            moved.set(later);
            later.is_some()
        };
        let Some(joined) = meet(&cfg, &here, None, Arc::clone(&store), &newer)? else {
            if let Some(e) = moved.get() {
                say!(
                    "shardline worker: node {node} worker {}: a rank awaited in epoch {epoch} stands in epoch {e}: going on there",
                    env.local_rank
                );
                epoch = e;
            } else {
                say!(
                    "shardline worker: node {node} worker {}: the job's membership moved on while epoch {epoch} met",
                    env.local_rank
                );
            }
            continue;
        };
        let mut o = opts.clone();
        if live.recover {
            // The state comes from the peers, not from a checkpoint (LIVE-5).
            o.resume = false;
        }
        let comm = joined.comm.clone();
        // LIVE-11: a stalled peer is stopped at half the timeout, not waited for.
        let locate_nodes = nodes.clone();
        let per_node = env.local_world;
        let scout = super::live_scout::Scout::start(
            comm.clone(),
            Arc::clone(&store),
            super::live_scout::ScoutJob {
                job: env.job.clone(),
                epoch,
                rank: here.rank,
                world: here.world,
                bound: Duration::from_secs(cfg.timeout_s.max(1)) / 2,
                locate: Box::new(move |r| {
                    (node_of(locate_nodes.as_deref(), r, per_node), r % per_node)
                }),
            },
        );
        let result = run_epoch(cfg, o, &here, planned.1.clone(), joined, &mut live);
        drop(scout);
        let e = match result {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        comm.abort(&format!("rank {} failed: {e}", here.rank));
        drop(comm);
        let kept = live.slot.lock().ok().and_then(|mut s| s.pop());
        // LIVE-9: the agent's planned stop (SIGUSR1) under live recovery is a growth: the
        // group stopped together after a step and moves on to the grown membership.
        let planned = matches!(e, RuntimeError::Interrupted { signal, .. } if signal == libc::SIGUSR1)
            && crate::interrupt::requested() == Some(libc::SIGUSR1);
        if planned {
            crate::interrupt::clear_planned();
        }
        let recoverable = planned
            || !matches!(
                e,
                RuntimeError::Config(_)
                    | RuntimeError::Interrupted { .. }
                    | RuntimeError::NoVerifiedCheckpoint { .. }
                    | RuntimeError::DeviceUnavailable(_)
                    | RuntimeError::OutOfMemory { .. }
                    | RuntimeError::LiveRecoveryImpossible(_)
            ) && crate::interrupt::requested().is_none();
        let Some(kept) = kept.filter(|_| recoverable && epoch + 1 < MAX_EPOCHS) else {
            return Err(e);
        };
        let why = match planned {
            true => "stopped after a step for the job to grow".to_string(),
            false => e.to_string(),
        };
        say!(
            "shardline worker: rank {}: live recovery: {why}; joining epoch {} with the state of step {} ({}) unix_ms={}",
            here.rank,
            epoch + 1,
            kept.step,
            if kept.clean { "clean" } else { "caught mid-update" },
            super::worker::unix_ms()
        );
        live = LiveRun {
            kept: Some(kept),
            recover: true,
            slot: Arc::default(),
            failed_at: Some((Instant::now(), if planned { "the stop" } else { "the failure" })),
        };
        epoch += 1;
    }
}

/// LIVE-5 on a fresh `engine` of the new epoch: installs this rank's kept state, agrees on
/// the plan, and takes the newest state from its replica set's sender. Returns the step the
/// run goes on after.
pub(super) fn recover(
    engine: &mut RankEngine,
    comm: &Communicator,
    kept: Option<&LiveState>,
    failed_at: Option<(Instant, &'static str)>,
) -> Result<u64> {
    let (rank, world) = (comm.rank(), comm.world());
    let t0 = Instant::now();
    // Every rank's standing, exact in f32: the set, whether it holds state, the step in
    // 2^20 parts, and whether it is clean.
    let held = kept.map(|k| (k.step, k.clean));
    let step = held.map_or(0, |h| h.0);
    let mine = vec![
        engine.replica_set() as f32,
        held.is_some() as u8 as f32,
        (step >> 20) as f32,
        (step & 0xF_FFFF) as f32,
        held.is_some_and(|h| h.1) as u8 as f32,
    ];
    let lane = comm.lane("live")?;
    let (_, all) = lane.all_gather(mine, vec![0.0; 5 * world]).wait()?;
    let standings: Vec<Standing> = all
        .chunks(5)
        .map(|c| Standing {
            set: c[0] as usize,
            held: (c[1] > 0.0).then(|| (((c[2] as u64) << 20) | c[3] as u64, c[4] > 0.0)),
        })
        .collect();
    let plan = recovery_plan(&standings).map_err(RuntimeError::LiveRecoveryImpossible)?;
    if let Some(k) = kept {
        engine.install_live_state(k)?;
    }
    let (sender, members) =
        plan.set_of(rank).ok_or_else(|| RuntimeError::config("live recovery: rank in no set"))?;
    let root = members.iter().position(|&r| r == *sender).unwrap_or(0);
    let set_comm = match members.len() == world {
        true => comm.clone(),
        false => comm.subgroup("live", members)?,
    };
    let bytes = engine.adopt_from(&set_comm.lane("state")?, root, plan.step)?;
    let since = failed_at.map_or(String::new(), |(t, what)| {
        format!(", {:.3} s after {what} was seen", t.elapsed().as_secs_f64())
    });
    say!(
        "shardline worker: rank {rank}: live recovery: resuming after step {} with rank {sender}'s state ({:.1} MiB over the transport in {:.3} s{since}) unix_ms={}",
        plan.step,
        bytes as f64 / (1u64 << 20) as f64,
        t0.elapsed().as_secs_f64(),
        super::worker::unix_ms()
    );
    Ok(plan.step)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(extra: &[(&str, &str)]) -> Result<WorkerEnv> {
        let mut m: HashMap<String, String> = [
            ("SHARDLINE_RANK", "1"),
            ("SHARDLINE_WORLD_SIZE", "2"),
            ("SHARDLINE_LOCAL_RANK", "1"),
            ("SHARDLINE_LOCAL_WORLD_SIZE", "2"),
            ("SHARDLINE_NODE_RANK", "0"),
            ("SHARDLINE_RDZV", "127.0.0.1:1"),
            ("SHARDLINE_TOKEN", "t"),
            ("SHARDLINE_JOB", "jg0"),
        ]
        .iter()
        .chain(extra)
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        m.retain(|_, v| !v.is_empty());
        WorkerEnv::from_vars(&|k| m.get(k).cloned()).map(|e| e.expect("a launch environment"))
    }

    #[test]
    fn each_epoch_meets_under_a_name_of_its_own_and_a_replacement_joins_the_named_one_live_4() {
        let e = env(&[]).unwrap();
        assert!(!e.live && e.live_epoch.is_none());
        assert_eq!(e.meeting(), "jg0");
        let mut e = env(&[("SHARDLINE_LIVE", "1"), ("SHARDLINE_LIVE_EPOCH", "3")]).unwrap();
        assert!(e.live);
        assert_eq!((e.live_epoch, e.epoch), (Some(3), 0));
        e.epoch = 3;
        assert_eq!(e.meeting(), "jg0e3");
        assert_ne!(epoch_job("j", 1), epoch_job("j", 2));
        assert_eq!(epoch_key("jg0", 1, 0), "launch/jg0/live/epoch/1/0");
        assert_eq!(lag_key("jg0", 1), "launch/jg0/live/late/1");
        let bad = env(&[("SHARDLINE_LIVE", "1"), ("SHARDLINE_LIVE_EPOCH", "x")]).unwrap_err();
        assert!(bad.to_string().contains("SHARDLINE_LIVE_EPOCH"), "{bad}");
    }

    #[test]
    fn a_meeting_is_given_up_for_a_later_epoch_an_awaited_worker_published_live_13() {
        assert_eq!(moved_on(Some(b"2".to_vec()), 1), Some(2));
        assert_eq!(moved_on(Some(b"1".to_vec()), 1), None, "the same epoch: it comes");
        assert_eq!(moved_on(Some(b"0".to_vec()), 1), None, "a predecessor's older one");
        assert_eq!(moved_on(None, 1), None);
        assert_eq!(moved_on(Some(b"x".to_vec()), 1), None);
    }

    #[test]
    fn a_worker_is_late_only_while_it_published_an_older_epoch_live_10() {
        assert!(is_late("1 3", 1, 2));
        assert!(!is_late("1 3", 1, 3), "it reached the meeting's epoch");
        assert!(!is_late("1 3", 0, 0), "another worker");
        assert!(!is_late("garbage", 1, 0));
    }

    #[test]
    fn a_membership_numbers_ranks_by_the_nodes_place_live_7() {
        // Node 0 lost from [0, 1, 2]: node 1's workers become ranks 0 and 1.
        assert_eq!(place(&[1, 2], 1, 1, 2), Some((1, 4)));
        assert_eq!(place(&[1, 2], 2, 0, 2), Some((2, 4)));
        assert_eq!(place(&[1, 2], 0, 0, 2), None, "a node left out has no rank");
        // An arriving node takes its place in the order given.
        assert_eq!(place(&[0, 2, 1], 1, 0, 1), Some((2, 3)));
    }
}
