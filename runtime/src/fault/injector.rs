//! The injector: a plan carried through one job and its restarts, with the job's fault
//! records and log, the engine's hook, and the link faults of in-process groups.
//!
//! Invariants:
//! - FAULT-2: each rank fault (kill, stall) fires at most once per job, across restarts, so a
//!   restarted group replays the lost steps without meeting the same fault again.
//! - FAULT-3: every injection, detection, restart and recovery is logged (tracing, with time
//!   since the job began, rank and step), recorded on the trace's control row and counted in
//!   metrics.
//! - FAULT-4: link fault decisions are a function of the seed, the restart generation and the
//!   op (FAULTY-1 in the collectives crate): the same plan and seed inject the same faults.

use super::{FaultPlan, FaultSpec, Phase};
use crate::error::Result;
use crate::telemetry::{Row, Trace};
use serde::Serialize;
use shardline_collectives::transport::faulty::{
    FaultyTransport, LinkEvent, LinkEventKind, LinkPlan,
};
use shardline_collectives::transport::local::{LocalFabric, LocalTransport};
use shardline_collectives::transport::Transport;
use shardline_collectives::{CommOptions, Communicator, Topology};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What happened to one injected fault.
#[derive(Clone, Debug, Serialize)]
pub struct FaultRecord {
    /// The spec, in command-line form.
    pub fault: String,
    /// Kind (kill, stall, delay, drop, corrupt).
    pub kind: String,
    /// Rank it hit (for link faults, the sender).
    pub rank: usize,
    /// Step it hit (for link faults, the step being run when it was seen).
    pub step: u64,
    /// Seconds since the job began when it was injected.
    pub injected_at_s: f64,
    /// Whether the job noticed it as a failure.
    pub detected: bool,
    /// Injection to the coordinator's abort, seconds.
    pub detection_s: Option<f64>,
    /// Detection to the restarted group having redone every step completed before the
    /// failure (at least one step after the restart), seconds.
    pub recovery_s: Option<f64>,
    /// The failure the job reported.
    pub error: Option<String>,
}

/// One entry of the job's fault log.
#[derive(Clone, Debug, Serialize)]
pub struct FaultEvent {
    /// Seconds since the job began.
    pub t_s: f64,
    /// injected, detected, restart, recovered, link.
    pub event: String,
    /// Rank concerned.
    pub rank: Option<usize>,
    /// Step concerned.
    pub step: u64,
    /// Free text.
    pub detail: String,
}

struct Pending {
    record: usize,
    detected_at: Option<Instant>,
    /// Steps completed when the failure was detected.
    resume_to: u64,
    restarted: bool,
}

/// Engine hook: called with (rank, step, phase).
pub type FaultHook = Arc<dyn Fn(usize, u64, Phase) + Send + Sync>;

/// A plan being carried through one job and its restarts (see the module docs).
pub struct FaultInjector {
    plan: FaultPlan,
    fired: Vec<AtomicBool>,
    origin: Instant,
    generation: AtomicU64,
    progress: AtomicU64,
    records: Mutex<Vec<FaultRecord>>,
    events: Mutex<Vec<FaultEvent>>,
    pending: Mutex<Option<Pending>>,
    trace: Mutex<Option<Trace>>,
}

impl std::fmt::Debug for FaultInjector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultInjector").field("plan", &self.plan).finish()
    }
}

impl FaultInjector {
    /// An injector for `plan`; the job's clock starts now.
    pub fn new(plan: FaultPlan) -> Arc<Self> {
        let fired = plan.faults.iter().map(|_| AtomicBool::new(false)).collect();
        Arc::new(FaultInjector {
            plan,
            fired,
            origin: Instant::now(),
            generation: AtomicU64::new(0),
            progress: AtomicU64::new(0),
            records: Mutex::default(),
            events: Mutex::default(),
            pending: Mutex::default(),
            trace: Mutex::default(),
        })
    }

    /// The plan.
    pub fn plan(&self) -> &FaultPlan {
        &self.plan
    }

    fn t(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.origin).as_secs_f64()
    }

    /// Every fault record so far.
    pub fn records(&self) -> Vec<FaultRecord> {
        self.records.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// The fault log so far.
    pub fn events(&self) -> Vec<FaultEvent> {
        self.events.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Logs one event (FAULT-3).
    fn log(&self, event: &str, rank: Option<usize>, step: u64, detail: String) {
        let now = Instant::now();
        let t_s = self.t(now);
        match event {
            "injected" | "link" => {
                tracing::warn!(t_s, ?rank, step, "fault {event}: {detail}")
            }
            "detected" => tracing::error!(t_s, ?rank, step, "fault detected: {detail}"),
            _ => tracing::warn!(t_s, ?rank, step, "{event}: {detail}"),
        }
        metrics::counter!("shardline_fault_events_total", "event" => event.to_string())
            .increment(1);
        if let Ok(tr) = self.trace.lock() {
            if let Some(tr) = &*tr {
                tr.record(rank.unwrap_or(0), Row::Control, format!("{event}: {detail}"), now, now);
            }
        }
        if let Ok(mut ev) = self.events.lock() {
            ev.push(FaultEvent { t_s, event: event.into(), rank, step, detail });
        }
    }

    /// Records the events of this job (earlier attempts included) on `trace`'s control row,
    /// and later ones as they happen.
    pub fn attach_trace(&self, trace: &Trace) {
        if let Ok(mut t) = self.trace.lock() {
            for e in self.events() {
                let at = self.origin + Duration::from_secs_f64(e.t_s);
                trace.record(
                    e.rank.unwrap_or(0),
                    Row::Control,
                    format!("{}: {}", e.event, e.detail),
                    at,
                    at,
                );
            }
            *t = Some(trace.clone());
        }
    }

    fn add_record(&self, spec: String, kind: &str, rank: usize, step: u64, at: Instant) -> usize {
        let Ok(mut r) = self.records.lock() else { return 0 };
        r.push(FaultRecord {
            fault: spec,
            kind: kind.into(),
            rank,
            step,
            injected_at_s: self.t(at),
            detected: false,
            detection_s: None,
            recovery_s: None,
            error: None,
        });
        r.len() - 1
    }

    /// The hook the engine and the rank actor call at each phase of each step.
    pub fn hook(self: &Arc<Self>) -> FaultHook {
        let me = Arc::clone(self);
        Arc::new(move |rank, step, phase| me.at(rank, step, phase))
    }

    /// Fires the rank faults planned for this point (FAULT-2).
    pub fn at(&self, rank: usize, step: u64, phase: Phase) {
        for (i, f) in self.plan.faults.iter().enumerate() {
            match *f {
                FaultSpec::Kill { rank: r, step: s, phase: p }
                    if r == rank && s == step && p == phase =>
                {
                    if self.fired[i].swap(true, Ordering::AcqRel) {
                        continue;
                    }
                    let now = Instant::now();
                    let idx = self.add_record(f.to_spec(), "kill", rank, step, now);
                    self.set_pending(idx);
                    self.log(
                        "injected",
                        Some(rank),
                        step,
                        format!("kill rank {rank} ({})", phase.name()),
                    );
                    metrics::counter!("shardline_faults_injected_total", "kind" => "kill")
                        .increment(1);
                    // The actor thread dies here: its mailbox is dropped with it, and the
                    // coordinator learns of the death from the actor's drop (ACT-3).
                    panic!("fault injection: kill rank {rank} at step {step} ({})", phase.name());
                }
                FaultSpec::Stall { rank: r, step: s, secs }
                    if r == rank && s == step && phase == Phase::Forward =>
                {
                    if self.fired[i].swap(true, Ordering::AcqRel) {
                        continue;
                    }
                    let now = Instant::now();
                    let idx = self.add_record(f.to_spec(), "stall", rank, step, now);
                    self.set_pending(idx);
                    self.log(
                        "injected",
                        Some(rank),
                        step,
                        format!("stall rank {rank} for {secs} s"),
                    );
                    metrics::counter!("shardline_faults_injected_total", "kind" => "stall")
                        .increment(1);
                    std::thread::sleep(Duration::from_secs_f64(secs));
                    self.clear_pending_if(idx);
                }
                // A condition, not an event: every step from `s` on (recorded once).
                FaultSpec::Slow { rank: r, step: s, ms }
                    if r == rank && step >= s && phase == Phase::Forward =>
                {
                    if !self.fired[i].swap(true, Ordering::AcqRel) {
                        let now = Instant::now();
                        self.add_record(f.to_spec(), "slow", rank, step, now);
                        self.log(
                            "injected",
                            Some(rank),
                            step,
                            format!("slow rank {rank} by {ms} ms a step from step {s}"),
                        );
                        metrics::counter!("shardline_faults_injected_total", "kind" => "slow")
                            .increment(1);
                    }
                    std::thread::sleep(Duration::from_millis(ms));
                }
                _ => {}
            }
        }
    }

    fn set_pending(&self, record: usize) {
        if let Ok(mut p) = self.pending.lock() {
            if p.as_ref().is_none_or(|p| p.detected_at.is_none()) {
                *p = Some(Pending { record, detected_at: None, resume_to: 0, restarted: false });
            }
        }
    }

    /// A stall that ended without the job failing was tolerated: it needs no recovery.
    fn clear_pending_if(&self, record: usize) {
        if let Ok(mut p) = self.pending.lock() {
            if p.as_ref().is_some_and(|p| p.record == record && p.detected_at.is_none()) {
                *p = None;
            }
        }
    }

    /// A rank finished step `step` (called by the rank actor).
    pub fn step_done(&self, rank: usize, step: u64) {
        self.progress.fetch_max(step, Ordering::AcqRel);
        let Ok(mut p) = self.pending.lock() else { return };
        let Some(pend) = p.as_ref() else { return };
        let Some(det) = pend.detected_at else { return };
        if rank == 0 && pend.restarted && step >= pend.resume_to {
            let rec = pend.record;
            let secs = det.elapsed().as_secs_f64();
            *p = None;
            drop(p);
            if let Ok(mut r) = self.records.lock() {
                if let Some(r) = r.get_mut(rec) {
                    r.recovery_s = Some(secs);
                }
            }
            metrics::counter!("shardline_recoveries_total").increment(1);
            metrics::histogram!("shardline_fault_recovery_seconds").record(secs);
            self.log(
                "recovered",
                None,
                step,
                format!("back at step {step} {secs:.3} s after detection"),
            );
        }
    }

    /// The coordinator saw the job's first failure (called once per attempt).
    pub fn failure_detected(&self, rank: usize, error: &str) {
        let now = Instant::now();
        let done = self.progress.load(Ordering::Acquire);
        let step = done + 1;
        let mut idx = None;
        if let Ok(mut p) = self.pending.lock() {
            match p.as_mut() {
                Some(pend) if pend.detected_at.is_none() => {
                    pend.detected_at = Some(now);
                    pend.resume_to = done;
                    idx = Some(pend.record);
                }
                _ => {
                    // No planned fault is outstanding (a link fault or an unplanned failure).
                    let kind = self.link_kind_of(error);
                    let rec = self.add_record(
                        kind.map_or_else(|| "unplanned".to_string(), |k| format!("{k} (link)")),
                        kind.unwrap_or("unplanned"),
                        rank,
                        step,
                        self.link_injected_at().unwrap_or(now),
                    );
                    *p = Some(Pending {
                        record: rec,
                        detected_at: Some(now),
                        resume_to: done,
                        restarted: false,
                    });
                    idx = Some(rec);
                }
            }
        }
        if let Some(i) = idx {
            if let Ok(mut r) = self.records.lock() {
                if let Some(r) = r.get_mut(i) {
                    let d = (self.t(now) - r.injected_at_s).max(0.0);
                    r.detected = true;
                    r.detection_s = Some(d);
                    r.error = Some(error.to_string());
                    metrics::histogram!("shardline_fault_detection_seconds").record(d);
                }
            }
        }
        metrics::counter!("shardline_faults_detected_total").increment(1);
        self.log("detected", Some(rank), step, error.to_string());
    }

    fn link_kind_of(&self, error: &str) -> Option<&'static str> {
        if error.contains("corrupt frame") {
            Some("corrupt")
        } else if error.contains("consecutive transmissions lost") {
            Some("drop")
        } else {
            None
        }
    }

    fn link_injected_at(&self) -> Option<Instant> {
        self.events()
            .iter()
            .rev()
            .find(|e| e.event == "link")
            .map(|e| self.origin + Duration::from_secs_f64(e.t_s))
    }

    /// The supervisor restarts the group (attempt `generation`, from step `from`).
    pub fn restarting(&self, generation: u64, from: u64) {
        self.generation.store(generation, Ordering::Release);
        self.progress.store(from, Ordering::Release);
        if let Ok(mut p) = self.pending.lock() {
            if let Some(p) = p.as_mut() {
                p.restarted = true;
            }
        }
        metrics::counter!("shardline_restarts_total").increment(1);
        self.log("restart", None, from, format!("attempt {generation} resumes after step {from}"));
    }

    /// A job that failed for good: the outstanding fault is not recovered.
    pub fn gave_up(&self) {
        if let Ok(mut p) = self.pending.lock() {
            *p = None;
        }
    }

    /// Builds `world` communicators over the local transport, each wrapped with this plan's
    /// link faults when it has any (the current restart generation is mixed into every
    /// decision, FAULT-4).
    pub fn local_group(
        self: &Arc<Self>,
        topology: Topology,
        opts: CommOptions,
    ) -> Result<Vec<Communicator>> {
        let world = topology.world();
        let links = self.plan.link_faults();
        if links.is_empty() {
            return Ok(shardline_collectives::local_group_with_topology(topology, opts)?);
        }
        let mut plan = LinkPlan::new(links, self.plan.seed);
        plan.generation = self.generation.load(Ordering::Acquire);
        let me = Arc::clone(self);
        plan.observer = Some(Arc::new(move |e: &LinkEvent| me.link_event(e)));
        let plan = Arc::new(plan);
        let fabric = LocalFabric::new(world);
        (0..world)
            .map(|r| {
                let inner: Arc<dyn Transport> =
                    Arc::new(LocalTransport::new(fabric.clone(), r, opts.get_spin()));
                let t: Arc<dyn Transport> = Arc::new(FaultyTransport::new(inner, plan.clone()));
                Ok(Communicator::new(t, topology.clone(), opts.clone())?)
            })
            .collect()
    }

    fn link_event(&self, e: &LinkEvent) {
        let step = self.progress.load(Ordering::Acquire) + 1;
        let (kind, detail) = match &e.kind {
            LinkEventKind::Delayed(d) => {
                metrics::counter!("shardline_faults_injected_total", "kind" => "delay")
                    .increment(1);
                metrics::histogram!("shardline_link_delay_seconds").record(d.as_secs_f64());
                return;
            }
            LinkEventKind::Dropped { attempt } => {
                ("drop", format!("link {}-{}: transmission {attempt} lost", e.from, e.to))
            }
            LinkEventKind::Recovered { lost } => {
                metrics::counter!("shardline_link_retransmits_total").increment(u64::from(*lost));
                tracing::debug!(from = e.from, to = e.to, lost, "retransmitted");
                return;
            }
            LinkEventKind::LinkDown { lost } => {
                ("drop", format!("link {}-{} down after {lost} lost transmissions", e.from, e.to))
            }
            LinkEventKind::Corrupted => {
                ("corrupt", format!("link {}-{}: frame of op #{} corrupted", e.from, e.to, e.seq))
            }
            LinkEventKind::CorruptDetected => {
                metrics::counter!("shardline_corrupt_frames_detected_total").increment(1);
                ("corrupt", format!("rank {} caught a corrupted frame from rank {}", e.to, e.from))
            }
        };
        metrics::counter!("shardline_faults_injected_total", "kind" => kind).increment(1);
        if matches!(e.kind, LinkEventKind::Dropped { .. }) {
            // Losses may be many; they are counted, and logged at debug level only.
            tracing::debug!(step, "{detail}");
            return;
        }
        self.log("link", Some(e.from), step, detail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_faults_fire_once() {
        // FAULT-2: the stall fires at its step once, not again after a restart.
        let plan = FaultPlan::parse(&["stall:rank=1:step=2:secs=0".into()], 0).unwrap();
        let inj = FaultInjector::new(plan);
        inj.at(1, 2, Phase::Forward);
        inj.restarting(1, 0);
        inj.at(1, 2, Phase::Forward);
        assert_eq!(inj.records().len(), 1);
        assert_eq!(inj.events().iter().filter(|e| e.event == "injected").count(), 1);
    }
}
