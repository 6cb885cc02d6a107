//! Fault plans and their injection (ARCHITECTURE.md, "Faults").
//!
//! A plan is a list of [`FaultSpec`]s parsed from `--fault SPEC` flags plus a seed
//! (`--fault-seed`). The [`FaultInjector`] carries a plan through a job and its restarts:
//!
//! - `kill:rank=R:step=S[:phase=forward|backward|reduce|checkpoint]`: the rank's actor thread
//!   panics at that point of step S (for `checkpoint`: while writing the checkpoint taken after
//!   step S, after its own shard file is written), so its mailbox is dropped and the
//!   coordinator has to notice the death.
//! - `stall:rank=R:step=S:secs=T`: the rank sleeps T seconds at the start of step S's forward
//!   pass: a slow rank, not a dead one.
//! - `delay:link=A-B:ms=M[:jitter=J]`, `drop:link=A-B:p=P`, `corrupt:link=A-B:p=P`: link
//!   faults applied by the [`FaultyTransport`] wrapper on every rank's transport.
//! - `partition:node=N:step=S:secs=T`: parsed and validated here; cutting a node off needs
//!   separate network namespaces, so it is executed only by the launcher's namespace tests.
//!   `shardline train` (one process) refuses to run a plan containing one.
//!
//! Invariants:
//! - FAULT-1: parsing is total: any string either parses to a spec or yields an error naming
//!   the offending part; nothing panics.
//! - FAULT-2: each rank fault (kill, stall) fires at most once per job, across restarts, so a
//!   restarted group replays the lost steps without meeting the same fault again.
//! - FAULT-3: every injection, detection, restart and recovery is logged (tracing, with time
//!   since the job began, rank and step), recorded on the trace's control row and counted in
//!   metrics.
//! - FAULT-5: a config file's `[faults]` table (`specs`, `seed`) gives the plan unless the
//!   command line says otherwise: `--fault` flags replace its specs, `--fault-seed` its seed.
//! - FAULT-4: link fault decisions are a function of the seed, the restart generation and the
//!   op (FAULTY-1 in the collectives crate): the same plan and seed inject the same faults.

use crate::error::{Result, RuntimeError};
use crate::telemetry::{Row, Trace};
use serde::Serialize;
use shardline_collectives::transport::faulty::{
    FaultyTransport, LinkEvent, LinkEventKind, LinkFault, LinkFaultKind, LinkPlan,
};
use shardline_collectives::transport::local::{LocalFabric, LocalTransport};
use shardline_collectives::transport::Transport;
use shardline_collectives::{CommOptions, Communicator, Topology};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A point of a training step where a rank fault can fire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// During the forward pass (after the first unit's forward).
    Forward,
    /// During the backward pass (after the first unit's gradients are handed to the reduce
    /// lane).
    Backward,
    /// While waiting for the gradient reductions.
    Reduce,
    /// While writing a checkpoint (after this rank's shard file is written, before commit).
    Checkpoint,
}

impl Phase {
    /// Name as in a spec.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Reduce => "reduce",
            Phase::Checkpoint => "checkpoint",
        }
    }

    /// Every phase, in step order.
    pub const ALL: [Phase; 4] = [Phase::Forward, Phase::Backward, Phase::Reduce, Phase::Checkpoint];
}

/// One fault of a plan.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultSpec {
    /// Kill a rank's actor thread at a step and phase.
    Kill {
        /// Rank.
        rank: usize,
        /// Step (1-based: the S-th optimizer step).
        step: u64,
        /// Where in the step.
        phase: Phase,
    },
    /// Make a rank sleep at the start of a step.
    Stall {
        /// Rank.
        rank: usize,
        /// Step (1-based).
        step: u64,
        /// How long.
        secs: f64,
    },
    /// Cut a node off (namespace tests of the launcher only).
    Partition {
        /// Node index.
        node: usize,
        /// Step (1-based).
        step: u64,
        /// How long.
        secs: f64,
    },
    /// A link fault.
    Link(LinkFault),
}

impl FaultSpec {
    /// Short kind name: kill, stall, partition, delay, drop, corrupt.
    pub fn kind(&self) -> &'static str {
        match self {
            FaultSpec::Kill { .. } => "kill",
            FaultSpec::Stall { .. } => "stall",
            FaultSpec::Partition { .. } => "partition",
            FaultSpec::Link(l) => match l.kind {
                LinkFaultKind::Delay { .. } => "delay",
                LinkFaultKind::Drop { .. } => "drop",
                LinkFaultKind::Corrupt { .. } => "corrupt",
            },
        }
    }

    /// The spec in its command-line form.
    pub fn to_spec(&self) -> String {
        match self {
            FaultSpec::Kill { rank, step, phase } => {
                format!("kill:rank={rank}:step={step}:phase={}", phase.name())
            }
            FaultSpec::Stall { rank, step, secs } => {
                format!("stall:rank={rank}:step={step}:secs={secs}")
            }
            FaultSpec::Partition { node, step, secs } => {
                format!("partition:node={node}:step={step}:secs={secs}")
            }
            FaultSpec::Link(l) => match l.kind {
                LinkFaultKind::Delay { ms, jitter_ms } => {
                    format!("delay:link={}-{}:ms={ms}:jitter={jitter_ms}", l.a, l.b)
                }
                LinkFaultKind::Drop { p } => format!("drop:link={}-{}:p={p}", l.a, l.b),
                LinkFaultKind::Corrupt { p } => format!("corrupt:link={}-{}:p={p}", l.a, l.b),
            },
        }
    }

    /// Parses one `--fault` spec (FAULT-1).
    ///
    /// ```
    /// use shardline_runtime::fault::{FaultSpec, Phase};
    /// let f = FaultSpec::parse("kill:rank=1:step=3:phase=backward").unwrap();
    /// assert_eq!(f, FaultSpec::Kill { rank: 1, step: 3, phase: Phase::Backward });
    /// assert!(FaultSpec::parse("kill:rank=1").is_err());
    /// ```
    pub fn parse(spec: &str) -> std::result::Result<FaultSpec, String> {
        let err = |m: String| format!("bad --fault '{spec}': {m}");
        let mut parts = spec.trim().split(':');
        let kind = parts.next().unwrap_or_default();
        let mut kv: Vec<(&str, &str)> = Vec::new();
        for p in parts {
            let (k, v) = p.split_once('=').ok_or_else(|| err(format!("'{p}' is not key=value")))?;
            if kv.iter().any(|(k2, _)| *k2 == k) {
                return Err(err(format!("'{k}' given twice")));
            }
            kv.push((k, v));
        }
        let allowed: &[&str] = match kind {
            "kill" => &["rank", "step", "phase"],
            "stall" => &["rank", "step", "secs"],
            "partition" => &["node", "step", "secs"],
            "delay" => &["link", "ms", "jitter"],
            "drop" | "corrupt" => &["link", "p"],
            other => {
                return Err(err(format!(
                    "unknown fault kind '{other}' (choose kill, stall, delay, drop, corrupt or partition)"
                )))
            }
        };
        if let Some((k, _)) = kv.iter().find(|(k, _)| !allowed.contains(k)) {
            return Err(err(format!("'{kind}' takes {}, not '{k}'", allowed.join(", "))));
        }
        let get = |k: &str| kv.iter().find(|(k2, _)| *k2 == k).map(|(_, v)| *v);
        let need = |k: &str| get(k).ok_or_else(|| err(format!("missing {k}=")));
        let int = |k: &str| -> std::result::Result<u64, String> {
            need(k)?.parse::<u64>().map_err(|_| err(format!("{k} must be a whole number")))
        };
        let secs = |k: &str| -> std::result::Result<f64, String> {
            let v: f64 =
                need(k)?.parse().map_err(|_| err(format!("{k} must be a number of seconds")))?;
            if v.is_finite() && (0.0..=86_400.0).contains(&v) {
                Ok(v)
            } else {
                Err(err(format!("{k} must be between 0 and 86400")))
            }
        };
        let step = || -> std::result::Result<u64, String> {
            let s = int("step")?;
            if s == 0 {
                return Err(err("step counts from 1".into()));
            }
            Ok(s)
        };
        let link = || -> std::result::Result<(usize, usize), String> {
            let v = need("link")?;
            let (a, b) = v.split_once('-').ok_or_else(|| err("link must be A-B".into()))?;
            let a: usize = a.parse().map_err(|_| err("link must be A-B (ranks)".into()))?;
            let b: usize = b.parse().map_err(|_| err("link must be A-B (ranks)".into()))?;
            if a == b {
                return Err(err("a link joins two different ranks".into()));
            }
            Ok((a, b))
        };
        let prob = || -> std::result::Result<f64, String> {
            let p: f64 = need("p")?.parse().map_err(|_| err("p must be a number".into()))?;
            if (0.0..=1.0).contains(&p) {
                Ok(p)
            } else {
                Err(err("p must be between 0 and 1".into()))
            }
        };
        let usize_of = |k: &str| -> std::result::Result<usize, String> {
            usize::try_from(int(k)?).map_err(|_| err(format!("{k} is too large")))
        };
        Ok(match kind {
            "kill" => {
                let phase = match get("phase").unwrap_or("forward") {
                    "forward" => Phase::Forward,
                    "backward" => Phase::Backward,
                    "reduce" => Phase::Reduce,
                    "checkpoint" => Phase::Checkpoint,
                    other => {
                        return Err(err(format!(
                        "unknown phase '{other}' (choose forward, backward, reduce or checkpoint)"
                    )))
                    }
                };
                FaultSpec::Kill { rank: usize_of("rank")?, step: step()?, phase }
            }
            "stall" => {
                FaultSpec::Stall { rank: usize_of("rank")?, step: step()?, secs: secs("secs")? }
            }
            "partition" => {
                FaultSpec::Partition { node: usize_of("node")?, step: step()?, secs: secs("secs")? }
            }
            "delay" => {
                let (a, b) = link()?;
                let ms = int("ms")?;
                let jitter_ms = if get("jitter").is_some() { int("jitter")? } else { 0 };
                if ms > 600_000 || jitter_ms > 600_000 {
                    return Err(err("ms and jitter must be at most 600000".into()));
                }
                FaultSpec::Link(LinkFault { a, b, kind: LinkFaultKind::Delay { ms, jitter_ms } })
            }
            "drop" => {
                let (a, b) = link()?;
                FaultSpec::Link(LinkFault { a, b, kind: LinkFaultKind::Drop { p: prob()? } })
            }
            _ => {
                let (a, b) = link()?;
                FaultSpec::Link(LinkFault { a, b, kind: LinkFaultKind::Corrupt { p: prob()? } })
            }
        })
    }
}

/// A fault plan: specs plus the seed of every random decision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    /// The faults.
    pub faults: Vec<FaultSpec>,
    /// `--fault-seed`.
    pub seed: u64,
}

impl FaultPlan {
    /// Parses every `--fault` flag.
    pub fn parse(specs: &[String], seed: u64) -> std::result::Result<FaultPlan, String> {
        let faults =
            specs.iter().map(|s| FaultSpec::parse(s)).collect::<std::result::Result<_, _>>()?;
        Ok(FaultPlan { faults, seed })
    }

    /// Checks the plan against a one-process job of `world` ranks.
    pub fn validate(&self, world: usize) -> Result<()> {
        for f in &self.faults {
            let bad =
                |m: String| Err(RuntimeError::config(format!("--fault {}: {m}", f.to_spec())));
            match f {
                FaultSpec::Kill { rank, .. } | FaultSpec::Stall { rank, .. } if *rank >= world => {
                    return bad(format!("rank {rank} does not exist in a world of {world}"))
                }
                FaultSpec::Link(l) if l.a >= world || l.b >= world => {
                    return bad(format!("link {}-{} leaves a world of {world}", l.a, l.b))
                }
                FaultSpec::Partition { .. } => {
                    return bad(
                        "partition needs one process per node in network namespaces \
                                (shardline launch); shardline train runs every rank in one process"
                            .into(),
                    )
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Checks the plan for a worker process of `shardline launch` in a world of `world`
    /// ranks: rank faults are injected by the worker itself (LAUNCH-8 in the launch module),
    /// partitions by the namespace harness that cuts the node's link; link faults need the
    /// in-process transports of `shardline train` and are refused.
    pub fn validate_launched(&self, world: usize) -> Result<()> {
        for f in &self.faults {
            let bad =
                |m: String| Err(RuntimeError::config(format!("--fault {}: {m}", f.to_spec())));
            match f {
                FaultSpec::Kill { rank, .. } | FaultSpec::Stall { rank, .. } if *rank >= world => {
                    return bad(format!("rank {rank} does not exist in a world of {world}"))
                }
                FaultSpec::Link(_) => {
                    return bad(
                        "link faults are injected by `shardline train` (one process) only".into()
                    )
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn link_faults(&self) -> Vec<LinkFault> {
        self.faults
            .iter()
            .filter_map(|f| if let FaultSpec::Link(l) = f { Some(*l) } else { None })
            .collect()
    }
}

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

/// The `[faults]` table of a `shardline train --config FILE` TOML file (FAULT-5):
///
/// ```toml
/// [faults]
/// specs = ["kill:rank=1:step=3", "delay:link=0-1:ms=5"]
/// seed = 7
/// ```
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsConfig {
    /// Fault specs, as `--fault` takes them.
    #[serde(default)]
    pub specs: Vec<String>,
    /// Seed of every random fault decision, as `--fault-seed`.
    pub seed: Option<u64>,
}

/// A config file: only `[faults]` is read from it so far; anything else is refused rather
/// than silently ignored.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    faults: FaultsConfig,
}

impl FaultsConfig {
    /// Parses the `[faults]` table out of a config file's text (a file without one gives an
    /// empty table).
    pub fn from_toml(text: &str) -> std::result::Result<Self, String> {
        toml::from_str::<ConfigFile>(text).map(|c| c.faults).map_err(|e| e.to_string())
    }

    /// Reads `path`; errors name the file.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            RuntimeError::config(format!("cannot read --config {}: {e}", path.display()))
        })?;
        Self::from_toml(&text)
            .map_err(|e| RuntimeError::config(format!("--config {}: {e}", path.display())))
    }

    /// The plan: flags override the file (FAULT-5): `--fault` flags, when any is given,
    /// replace the file's specs; `--fault-seed`, when given, replaces its seed; the seed
    /// defaults to 0.
    pub fn plan(
        &self,
        flag_specs: &[String],
        flag_seed: Option<u64>,
    ) -> std::result::Result<FaultPlan, String> {
        let specs = if flag_specs.is_empty() { &self.specs } else { flag_specs };
        FaultPlan::parse(specs, flag_seed.or(self.seed).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_kind_parses_and_prints_back() {
        for s in [
            "kill:rank=1:step=3:phase=backward",
            "kill:rank=0:step=1:phase=checkpoint",
            "stall:rank=2:step=5:secs=1.5",
            "partition:node=1:step=4:secs=2",
            "delay:link=0-1:ms=5:jitter=2",
            "drop:link=1-2:p=0.1",
            "corrupt:link=0-3:p=1",
        ] {
            let f = FaultSpec::parse(s).unwrap();
            assert_eq!(FaultSpec::parse(&f.to_spec()).unwrap(), f, "{s}");
        }
        assert_eq!(
            FaultSpec::parse("kill:rank=1:step=3").unwrap(),
            FaultSpec::Kill { rank: 1, step: 3, phase: Phase::Forward }
        );
    }

    #[test]
    fn malformed_specs_name_the_problem() {
        for (s, want) in [
            ("kill", "missing rank"),
            ("kill:rank=1", "missing step"),
            ("kill:rank=x:step=1", "rank must be a whole number"),
            ("kill:rank=1:step=0", "step counts from 1"),
            ("kill:rank=1:step=1:phase=lunch", "unknown phase"),
            ("explode:rank=1", "unknown fault kind"),
            ("drop:link=1-1:p=0.5", "two different ranks"),
            ("drop:link=0-1:p=2", "between 0 and 1"),
            ("corrupt:link=0:p=0.5", "A-B"),
            ("stall:rank=0:step=1:secs=-1", "between 0 and 86400"),
            ("delay:link=0-1", "missing ms"),
            ("delay:link=0-1:ms=1:ms=2", "given twice"),
            ("kill:rank=1:step=2:secs=3", "not 'secs'"),
            ("kill:rank1", "not key=value"),
        ] {
            let e = FaultSpec::parse(s).unwrap_err();
            assert!(e.contains(want), "{s}: {e}");
        }
    }

    #[test]
    fn plans_are_checked_against_the_world() {
        let p = FaultPlan::parse(&["kill:rank=4:step=1".into()], 0).unwrap();
        assert!(p.validate(4).unwrap_err().to_string().contains("rank 4 does not exist"));
        assert!(p.validate(5).is_ok());
        let p = FaultPlan::parse(&["partition:node=1:step=1:secs=1".into()], 0).unwrap();
        assert!(p.validate(4).unwrap_err().to_string().contains("shardline launch"));
    }

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

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        // FAULT-1: arbitrary text never panics the parser.
        #[test]
        fn parser_is_total(s in ".{0,60}") {
            let _ = FaultSpec::parse(&s);
        }

        #[test]
        fn parser_is_total_on_near_misses(
            kind in prop::sample::select(vec!["kill", "stall", "delay", "drop", "corrupt", "partition"]),
            parts in prop::collection::vec("(rank|step|phase|link|ms|p|secs|jitter|node)=[-0-9a-z.]{0,6}", 0..5),
        ) {
            let _ = FaultSpec::parse(&format!("{kind}:{}", parts.join(":")));
        }
    }

    /// FAULT-5: the `[faults]` table of a TOML file, and flags over file values.
    #[test]
    fn config_file_faults_and_flag_override() {
        let text =
            "[faults]\nspecs = [\"kill:rank=1:step=3\", \"delay:link=0-1:ms=5\"]\nseed = 7\n";
        let c = FaultsConfig::from_toml(text).expect("parses");
        assert_eq!(c.specs, vec!["kill:rank=1:step=3".to_string(), "delay:link=0-1:ms=5".into()]);
        assert_eq!(c.seed, Some(7));
        let p = c.plan(&[], None).expect("plan from the file");
        assert_eq!(p.seed, 7);
        assert_eq!(p.faults[0], FaultSpec::Kill { rank: 1, step: 3, phase: Phase::Forward });
        assert_eq!(p.faults[1].kind(), "delay");
        // Flags replace the file's specs and seed, each on its own.
        let flags = vec!["stall:rank=0:step=2:secs=1".to_string()];
        let p = c.plan(&flags, None).expect("flag specs");
        assert_eq!(p.faults, vec![FaultSpec::Stall { rank: 0, step: 2, secs: 1.0 }]);
        assert_eq!(p.seed, 7);
        let p = c.plan(&[], Some(3)).expect("flag seed");
        assert_eq!((p.faults.len(), p.seed), (2, 3));
        // No table, an empty one, unknown keys, bad specs and bad TOML.
        assert_eq!(FaultsConfig::from_toml("").expect("empty"), FaultsConfig::default());
        assert_eq!(
            FaultsConfig::from_toml("[faults]\n").expect("empty").plan(&[], None).expect("p").seed,
            0
        );
        assert!(FaultsConfig::from_toml("[faults]\nspec = []\n").is_err());
        assert!(FaultsConfig::from_toml("[other]\nx = 1\n").is_err());
        assert!(FaultsConfig::from_toml("[faults]\nseed = \"seven\"\n").is_err());
        assert!(FaultsConfig::from_toml("[faults\n").is_err());
        let bad = FaultsConfig::from_toml("[faults]\nspecs = [\"kill:rank=1\"]\n").expect("toml");
        assert!(bad.plan(&[], None).unwrap_err().contains("missing step="));
        // The file is named in read errors.
        let e = FaultsConfig::load(std::path::Path::new("/nonexistent/faults.toml")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/faults.toml"));
    }
}
