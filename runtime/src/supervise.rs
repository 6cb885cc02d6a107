//! Supervision of `shardline train`: run the job; on a failure (a dead rank, a timeout, a
//! corrupt frame, a lost link) the coordinator has already aborted every communicator, so the
//! supervisor restarts the whole rank group from the last committed checkpoint (or from
//! scratch without one), up to `--max-restarts` times.
//!
//! - SUP-1: a restarted run resumes from a committed checkpoint only, so it ends where a clean
//!   run with the same world ends, bitwise (resume is bitwise, RESUME tests).
//! - SUP-2: a failure is never swallowed: past `max_restarts` the job's error is returned, and
//!   every failure of every attempt is kept in [`Supervised::failures`].
//! - SUP-3: each fault's detection and recovery times are in [`Supervised::faults`] and in
//!   the `--log-json` file (`"event": "fault"` lines).

use crate::error::{Result, RuntimeError};
use crate::fault::{FaultInjector, FaultRecord};
use crate::train::{self, RunOptions, Summary, TrainConfig};
use serde::Serialize;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

/// The outcome of a supervised job.
#[derive(Debug)]
pub struct Supervised {
    /// The last attempt's result.
    pub result: Result<Summary>,
    /// Restarts performed.
    pub restarts: u32,
    /// Every attempt's failure, in order.
    pub failures: Vec<String>,
    /// What happened to each fault.
    pub faults: Vec<FaultRecord>,
    /// Wall time of the whole job, restarts included.
    pub wall_s: f64,
}

/// The fault part of a summary, as printed and written to JSON.
#[derive(Clone, Debug, Serialize)]
pub struct FaultSummary {
    /// Restarts performed.
    pub restarts: u32,
    /// Failures seen.
    pub failures: Vec<String>,
    /// Per fault: detection and recovery.
    pub faults: Vec<FaultRecord>,
}

impl Supervised {
    /// The fault part of the summary.
    pub fn fault_summary(&self) -> FaultSummary {
        FaultSummary {
            restarts: self.restarts,
            failures: self.failures.clone(),
            faults: self.faults.clone(),
        }
    }

    /// Prints the faults, their detection and recovery times.
    pub fn print(&self) {
        if self.faults.is_empty() && self.restarts == 0 {
            return;
        }
        println!("faults:");
        for f in &self.faults {
            let det = f.detection_s.map_or("not detected (tolerated)".to_string(), |d| {
                format!("detected in {:.3} s", d)
            });
            let rec = f.recovery_s.map_or(String::new(), |r| format!(", recovered in {r:.3} s"));
            println!("  {:<40} rank {} step {}: {det}{rec}", f.fault, f.rank, f.step);
        }
        println!("  restarts          {}", self.restarts);
    }
}

fn append_log(path: &std::path::Path, v: &serde_json::Value) {
    let line = format!("{v}\n");
    let r = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = r {
        tracing::warn!("cannot append to --log-json {}: {e}", path.display());
    }
}

/// Runs `cfg` under supervision with the faults of `injector` (none: a plain run with
/// restarts). `max_restarts = 0` fails on the first failure.
pub fn run_supervised(
    cfg: TrainConfig,
    opts: RunOptions,
    injector: Option<Arc<FaultInjector>>,
    max_restarts: u32,
) -> Supervised {
    let started = Instant::now();
    if let Some(inj) = &injector {
        if let Err(e) = inj.plan().validate(cfg.world) {
            return Supervised {
                result: Err(e),
                restarts: 0,
                failures: vec![],
                faults: vec![],
                wall_s: 0.0,
            };
        }
    }
    let mut opts = opts;
    opts.faults = injector.clone().or(opts.faults);
    let inj = opts.faults.clone();
    let mut failures = Vec::new();
    let mut restarts = 0u32;
    let result = loop {
        let r = train::run(cfg.clone(), opts.clone());
        match r {
            Ok(s) => break Ok(s),
            // A usage error would fail again; a stop asked for by a signal is no failure.
            Err(e) if is_usage(&e) || matches!(e, RuntimeError::Interrupted { .. }) => {
                break Err(e)
            }
            Err(e) => {
                failures.push(e.to_string());
                if restarts >= max_restarts {
                    if let Some(i) = &inj {
                        i.gave_up();
                    }
                    break Err(e);
                }
                restarts += 1;
                // SUP-1: from the last committed checkpoint, else from scratch.
                let from = match &opts.checkpoint_dir {
                    Some(dir) => match crate::checkpoint::latest(dir) {
                        Ok(Some(latest)) => crate::checkpoint::Checkpoint::open(&latest)
                            .map(|c| c.manifest().step)
                            .unwrap_or(0),
                        _ => 0,
                    },
                    None => 0,
                };
                opts.resume = opts.checkpoint_dir.is_some();
                opts.stop_after = None;
                if !opts.quiet {
                    println!("restart {restarts}/{max_restarts} after: {e}");
                }
                if let Some(i) = &inj {
                    i.restarting(u64::from(restarts), from);
                }
            }
        }
    };
    let faults = inj.as_ref().map(|i| i.records()).unwrap_or_default();
    if let Some(p) = &opts.log_json {
        for f in &faults {
            let mut v = serde_json::to_value(f).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("event".into(), "fault".into());
            }
            append_log(p, &v);
        }
        if restarts > 0 || !failures.is_empty() {
            append_log(
                p,
                &serde_json::json!({"event": "supervision", "restarts": restarts, "failures": failures}),
            );
        }
    }
    Supervised { result, restarts, failures, faults, wall_s: started.elapsed().as_secs_f64() }
}

/// Usage errors (bad flags, a mismatched checkpoint) are not retried.
fn is_usage(e: &RuntimeError) -> bool {
    matches!(
        e,
        RuntimeError::Config(_)
            | RuntimeError::Checkpoint { .. }
            | RuntimeError::NoVerifiedCheckpoint { .. }
    )
}
