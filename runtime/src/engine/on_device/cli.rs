//! `shardline train --device sim` (and `--device cuda --model-ops`): a job of the device
//! engine on one device per rank thread, run by the one training loop. The simulated
//! accelerator is a testing device: it checks that every access is ordered by the streams
//! and events, and its timings include its seeded delays, so they measure the simulation,
//! not a GPU. On GPUs (feature `cuda`) rank `r` opens GPU `r`, its gathers and reductions
//! go over NCCL, and the model runs as ops (LOWDEV-1): a GPU runs no host code.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardline_collectives::device::{OpSpan, SimDevice, SimOptions};

use super::{DeviceEngine, DeviceOptions, DeviceWorlds, Offload, Overlap};
use crate::driver::local::Built;
use crate::driver::{AbortHook, Job};
use crate::engine::{Driven, EngineConfig};
use crate::error::{Result, RuntimeError};
use crate::telemetry::Trace;
use crate::train::{RunOptions, Summary, TrainConfig};

/// How `--device sim` (or `--device cuda --model-ops`) runs.
#[derive(Clone, Debug, Default)]
pub struct DeviceTrainOptions {
    /// The ranks' devices are GPUs (rank r on GPU r, NCCL) instead of simulated ones.
    pub cuda: bool,
    /// Seeds the streams' delays (rank r: seed + r).
    pub seed: u64,
    /// Longest delay before each device operation, in microseconds.
    pub max_delay_us: u64,
    /// Each device's memory (`--device-memory`); unbounded when unset.
    pub capacity: Option<u64>,
    /// `--offload`.
    pub offload: Offload,
    /// A Chrome trace of every rank's streams and host waits.
    pub trace: Option<PathBuf>,
    /// Gathers and reductions on one stream and communicator.
    pub one_comm: bool,
    /// The model's calls and loss as device ops, on devices that refuse other host code
    /// (evaluation's scoring excepted; LOWDEV-1).
    pub model_ops: bool,
}

/// Human bytes (KiB, MiB).
fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// Trains `cfg` with the device engine on simulated devices, one per rank thread, through
/// the one training loop ([`crate::driver`]): resume, checkpoints, evaluation, logs and the
/// summary as on the host engine. Prints what runs where, and after the run the streams'
/// overlap and (with a trace) writes every rank's streams.
pub fn train_on_devices(
    cfg: TrainConfig,
    opts: RunOptions,
    o: &DeviceTrainOptions,
) -> Result<Summary> {
    let speak = !opts.quiet;
    if o.cuda && !o.model_ops {
        return Err(RuntimeError::config("the device engine on GPUs needs --model-ops"));
    }
    if speak && o.cuda {
        println!(
            "device: cuda, rank r on GPU r (CudaDevice: streams, events, device memory; no host \
             code), x {} ranks, gathers and reductions over NCCL; memory figures below are \
             device memory",
            cfg.world
        );
    } else if speak {
        println!(
            "device: sim (a simulated accelerator for testing; kernels run on the CPU, delays \
             seeded {} up to {} us) x {} ranks, memory {}, offload {}; memory figures below \
             are device memory",
            o.seed,
            o.max_delay_us,
            cfg.world,
            o.capacity.map_or("unbounded".to_string(), bytes),
            o.offload.name()
        );
        println!(
            "streams per rank: {}; the host waits once per step (the loss){}",
            if o.one_comm {
                "compute, gather (gathers and reductions, one communicator), offload"
            } else {
                "compute, gather, reduce (each with its own communicator), offload"
            },
            if o.model_ops {
                "; the model's calls and loss run as device ops (--model-ops)"
            } else {
                ""
            }
        );
    }
    let sinks: Vec<Arc<Mutex<Vec<OpSpan>>>> = (0..cfg.world).map(|_| Arc::default()).collect();
    let overlaps: Arc<Mutex<Vec<Arc<Mutex<Overlap>>>>> = Arc::default();
    let (sim, trace) = (o.clone(), o.trace.is_some());
    let (sinks2, overlaps2) = (sinks.clone(), Arc::clone(&overlaps));
    let build = move |job: &Job, ecfg: EngineConfig, _: &RunOptions| -> Result<Built> {
        let world = job.cfg.world;
        let timeout = Duration::from_secs(job.cfg.timeout_s.max(1));
        let worlds = DeviceWorlds::new(world, timeout);
        let dopts = DeviceOptions {
            offload: sim.offload,
            one_comm: sim.one_comm,
            model_ops: sim.model_ops,
            ..Default::default()
        };
        let (mut engines, mut trackers) = (Vec::new(), Vec::new());
        if sim.cuda {
            for e in cuda_engines(world, &worlds, (job, &ecfg, dopts), sim.capacity)? {
                trackers.push(e.memory().clone());
                lock(&overlaps2).push(e.overlap_handle());
                engines.push(Box::new(e) as Box<dyn Driven>);
            }
        }
        for (rank, sink) in sinks2.iter().enumerate().filter(|_| !sim.cuda) {
            let dev = Arc::new(SimDevice::new(SimOptions {
                seed: sim.seed.wrapping_add(rank as u64),
                max_delay_us: sim.max_delay_us,
                capacity: sim.capacity,
                // A host wait outlasts the collectives' own timeout.
                timeout: timeout * 2,
                // Every operation's span, for the overlap figures (and --trace).
                timeline: true,
                // SIM-4: with model ops, host code is refused, except what --offload runs on
                // the host by design.
                ops_only: sim.model_ops,
                host_kernels_allowed: ["host update", "copy "].map(String::from).to_vec(),
            }));
            let model = Arc::clone(&job.model);
            let mut e = DeviceEngine::new(rank, dev, &worlds, model, ecfg.clone(), dopts)?;
            if trace {
                e.set_trace_sink(Arc::clone(sink));
            }
            lock(&overlaps2).push(e.overlap_handle());
            trackers.push(e.memory().clone());
            engines.push(Box::new(e) as Box<dyn Driven>);
        }
        let abort: AbortHook = Arc::new(move |why: &str| worlds.abort(why));
        Ok(Built {
            engines,
            comms: Vec::new(),
            abort: Some(abort),
            trackers,
            trace: Trace::disabled(),
        })
    };
    // --trace here is the streams' trace, written below.
    let run = RunOptions { trace: None, ..opts };
    let summary = crate::driver::local::run_built(cfg, run, crate::train::plan, build)?;
    if let Some(p) = &o.trace {
        let spans: Vec<Vec<OpSpan>> = sinks.iter().map(|s| std::mem::take(&mut *lock(s))).collect();
        let text = serde_json::to_string(&super::chrome_trace(&spans)).unwrap_or_default();
        std::fs::write(p, text)
            .map_err(|e| RuntimeError::Failed(format!("writing --trace {}: {e}", p.display())))?;
    }
    if let (true, Some(rank0)) = (speak, lock(&overlaps).first()) {
        let o = *lock(rank0);
        println!(
            "rank 0 streams: compute busy {:.1} ms, gather+reduce busy {:.1} ms, {:.0}% of it \
             while compute ran (simulated timing)",
            o.compute_s * 1e3,
            o.comm_s * 1e3,
            o.hidden_fraction() * 100.0
        );
    }
    Ok(summary)
}

/// Every rank's engine, rank `r` on GPU `r`, its gathers and reductions over NCCL (the ids
/// through a store of this build: the ranks are threads of this process). The ranks join
/// their communicators at once, each on its own thread, as NCCL's rendezvous needs.
#[cfg(feature = "cuda")]
fn cuda_engines(
    world: usize,
    worlds: &DeviceWorlds,
    (job, ecfg, dopts): (&Job, &EngineConfig, DeviceOptions),
    capacity: Option<u64>,
) -> Result<Vec<DeviceEngine>> {
    use shardline_models::cuda::CudaDevice;
    let gpus = crate::engine::cuda_devices()?;
    if world > gpus {
        return Err(RuntimeError::config(format!(
            "--device cuda --model-ops runs one rank per GPU: --world {world} with {gpus} visible"
        )));
    }
    let store: Arc<dyn shardline_collectives::store::Store> =
        Arc::new(shardline_collectives::store::MemStore::new());
    let timeout = Duration::from_secs(job.cfg.timeout_s.max(1));
    let one = |rank: usize| -> Result<DeviceEngine> {
        let dev = Arc::new(CudaDevice::open(rank, capacity)?);
        let store = Arc::clone(&store);
        let comms =
            super::run::nccl_comms(Arc::clone(&dev), rank, world, store, timeout, ecfg.sync_bn)?;
        let model = Arc::clone(&job.model);
        DeviceEngine::new(rank, dev, worlds, model, ecfg.clone(), dopts)?.with_comms(comms)
    };
    std::thread::scope(|s| {
        let joins: Vec<_> = (0..world).map(|rank| s.spawn(move || one(rank))).collect();
        joins
            .into_iter()
            .map(|j| {
                j.join().unwrap_or_else(|_| Err(RuntimeError::Failed("a rank panicked".into())))
            })
            .collect()
    })
}

/// Without the `cuda` feature there is no GPU device.
#[cfg(not(feature = "cuda"))]
fn cuda_engines(
    _: usize,
    _: &DeviceWorlds,
    _: (&Job, &EngineConfig, DeviceOptions),
    _: Option<u64>,
) -> Result<Vec<DeviceEngine>> {
    Err(RuntimeError::DeviceUnavailable("a build without the `cuda` feature".into()))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
