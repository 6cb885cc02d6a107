//! `shardline train --device sim`: a job of the device engine on simulated accelerators, one
//! per rank thread, with a line per step and an optional JSON log. A testing device: it
//! checks that every access is ordered by the streams and events, and its timings include
//! its seeded delays, so they measure the simulation, not a GPU.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use shardline_collectives::device::SimOptions;

use super::{run_on_devices_with, DeviceKind, DeviceOptions, DeviceRun, Offload};
use crate::error::{Result, RuntimeError};
use crate::memory::{Category, MemorySnapshot};
use crate::train::TrainConfig;

/// How `--device sim` runs.
#[derive(Clone, Debug, Default)]
pub struct SimTrainOptions {
    /// Seeds the streams' delays (rank r: seed + r).
    pub seed: u64,
    /// Longest delay before each device operation, in microseconds.
    pub max_delay_us: u64,
    /// Each device's memory (`--device-memory`); unbounded when unset.
    pub capacity: Option<u64>,
    /// `--offload`.
    pub offload: Offload,
    /// One JSON object per step.
    pub log_json: Option<PathBuf>,
    /// A Chrome trace of every rank's streams and host waits.
    pub trace: Option<PathBuf>,
    /// Gathers and reductions on one stream and communicator.
    pub one_comm: bool,
    /// Print a line per step.
    pub progress: bool,
}

/// Human bytes (KiB, MiB).
fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// Trains `cfg` with the device engine on simulated devices, printing what runs where.
pub fn train_on_sim(cfg: &TrainConfig, o: &SimTrainOptions) -> Result<DeviceRun> {
    let log = match &o.log_json {
        Some(p) => Some(
            std::fs::File::create(p)
                .map_err(|e| RuntimeError::config(format!("--log-json {}: {e}", p.display())))?,
        ),
        None => None,
    };
    println!(
        "device: sim (a simulated accelerator for testing; kernels run on the CPU, delays \
         seeded {} up to {} us) x {} ranks, memory {}, offload {}",
        o.seed,
        o.max_delay_us,
        cfg.world,
        o.capacity.map_or("unbounded".to_string(), bytes),
        o.offload.name()
    );
    println!(
        "streams per rank: {}; the host waits once per step (the loss)",
        if o.one_comm {
            "compute, gather (gathers and reductions, one communicator), offload"
        } else {
            "compute, gather, reduce (each with its own communicator), offload"
        }
    );
    let kind = DeviceKind::Sim(SimOptions {
        seed: o.seed,
        max_delay_us: o.max_delay_us,
        capacity: o.capacity,
        timeout: Duration::from_secs(cfg.timeout_s.max(1) * 2),
        // Every operation's span, for the overlap figure (and --trace).
        timeline: true,
    });
    let log = Mutex::new(log);
    let progress = o.progress;
    let on_step = move |step: u64, s: &super::DeviceStepStats| {
        if progress {
            println!(
                "step {step:>5}  loss {:.4}  grad-norm {:.4}  device {} (peak {})  {:.1} ms",
                s.loss,
                s.grad_norm,
                bytes(s.device_bytes),
                bytes(s.device_peak),
                s.step_time.as_secs_f64() * 1e3
            );
        }
        if let Some(f) = log.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            let v = serde_json::json!({
                "step": step, "loss": s.loss, "grad_norm": s.grad_norm,
                "step_time_s": s.step_time.as_secs_f64(), "device_bytes": s.device_bytes,
                "device_peak_bytes": s.device_peak, "host_syncs": s.host_syncs,
                "device_memory_peak": peaks_by_category(&s.memory),
            });
            let _ = writeln!(f, "{v}");
        }
    };
    let opts =
        DeviceOptions { offload: o.offload, one_comm: o.one_comm, ..DeviceOptions::default() };
    let run = run_on_devices_with(cfg, kind, opts, on_step)?;
    if let Some(p) = &o.trace {
        let text = serde_json::to_string(&super::chrome_trace(&run.timelines)).unwrap_or_default();
        std::fs::write(p, text)
            .map_err(|e| RuntimeError::Failed(format!("writing --trace {}: {e}", p.display())))?;
    }
    if let Some(t) = run.timelines.first() {
        let o = super::overlap(t);
        println!(
            "rank 0 streams: compute busy {:.1} ms, gather+reduce busy {:.1} ms, {:.0}% of it \
             while compute ran (simulated timing)",
            o.compute_s * 1e3,
            o.comm_s * 1e3,
            o.hidden_fraction() * 100.0
        );
    }
    if let Some(s) = run.steps.last() {
        let parts: Vec<String> = Category::ALL
            .iter()
            .filter(|c| s.memory.peak(**c) > 0)
            .map(|c| format!("{} {}", c.label(), bytes(s.memory.peak(*c))))
            .collect();
        println!(
            "rank 0 device memory, peaks by category: {}; peak of the total {}",
            parts.join(", "),
            bytes(s.memory.peak_total)
        );
    }
    let last = run.steps.last().map_or(f32::NAN, |s| s.loss);
    println!(
        "done: {} steps, final loss {last:.4}, device peak {} (largest rank)",
        run.steps.len(),
        bytes(run.peak_device_bytes)
    );
    Ok(run)
}

/// Peak device bytes per category, keyed as the host engine's summary keys them.
fn peaks_by_category(m: &MemorySnapshot) -> serde_json::Value {
    Category::ALL.iter().map(|c| (c.key().to_string(), serde_json::json!(m.peak(*c)))).collect()
}
