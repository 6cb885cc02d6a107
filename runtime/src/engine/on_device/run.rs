//! Steps of the device engine in one process, for tests and benchmarks: one thread per
//! rank, each with its own device (the host as a device, or a simulated accelerator), the
//! ranks meeting in the communicators' worlds, and every step's device figures returned
//! (memory by category, timelines), which the training loop does not report. The job's plan
//! (data, model, stage, optimizer) is the host engine's ([`crate::train::plan`]), and each
//! rank reads the same batches as there. `train --device sim` runs the engine under the
//! training loop instead ([`super::train_on_devices`]): checkpoints, evaluation, logs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use shardline_collectives::device::{
    CpuDevice, Device, FailWhen, FailingDevice, OpSpan, SimDevice, SimOptions,
};
use shardline_models::{DistributedSampler, RankBatches};

use super::{DeviceEngine, DeviceOptions, DeviceStepStats, DeviceWorlds};

use crate::error::{Result, RuntimeError};
use crate::train::{self, TrainConfig};

/// The device each rank runs on.
#[derive(Clone, Debug)]
pub enum DeviceKind {
    /// The host as a device: every call runs at once (the reference).
    Cpu,
    /// A simulated accelerator; rank `r`'s delays are seeded with `seed + r`.
    Sim(SimOptions),
    /// Simulated accelerators, one rank's made to fail ([`FailingDevice`]).
    Failing(FaultSpec),
    /// Rank `r` on GPU `r` (a [`shardline_models::cuda::CudaDevice`]), its gathers and
    /// reductions over NCCL (each its own communicator, the ids through an in-process
    /// store). The device refuses host code: run it with [`DeviceOptions::model_ops`].
    #[cfg(feature = "cuda")]
    Cuda,
}

/// Which rank's device fails, and where: a fault-injection job.
#[derive(Clone, Debug)]
pub struct FaultSpec {
    /// The simulated devices.
    pub sim: SimOptions,
    /// The rank whose device fails.
    pub rank: usize,
    /// Its fallible call that fails (1-based; 0: none).
    pub at: u64,
    /// At the call, or when its work runs.
    pub when: FailWhen,
    /// The failing rank's fallible calls, counted over the job (set when its thread ends).
    pub calls: Arc<AtomicU64>,
}

/// Rank `rank`'s simulated device of options `o`.
fn sim(o: &SimOptions, rank: usize, timeout: Duration) -> Arc<dyn Device> {
    Arc::new(SimDevice::new(SimOptions {
        seed: o.seed.wrapping_add(rank as u64),
        timeout: o.timeout.max(timeout * 2),
        ..o.clone()
    }))
}

/// What a job of the device engine gives back.
#[derive(Clone, Debug, Default)]
pub struct DeviceRun {
    /// Per step, rank 0's figures.
    pub steps: Vec<DeviceStepStats>,
    /// Final full parameters per unit (unpadded).
    pub final_params: Vec<Vec<f32>>,
    /// Final buffers per unit.
    pub final_buffers: Vec<Vec<f32>>,
    /// Most device bytes any rank held at the end of a step.
    pub max_device_bytes: u64,
    /// Most device bytes any rank held at once.
    pub peak_device_bytes: u64,
    /// Per rank, what its streams and its host did (empty unless the device records its
    /// timeline, [`SimOptions::timeline`]).
    pub timelines: Vec<Vec<OpSpan>>,
}

/// Trains `cfg` on devices of `kind` with `cfg.world` rank threads; the first rank error is
/// the job's error, and it aborts the others' collectives so that none waits for it.
pub fn run_on_devices(
    cfg: &TrainConfig,
    kind: DeviceKind,
    opts: DeviceOptions,
) -> Result<DeviceRun> {
    run_on_devices_with(cfg, kind, opts, |_, _| {})
}

/// [`run_on_devices`], calling `on_step(step, figures)` with rank 0's figures after each
/// step (1-based), from rank 0's thread.
pub fn run_on_devices_with(
    cfg: &TrainConfig,
    kind: DeviceKind,
    opts: DeviceOptions,
    on_step: impl Fn(u64, &DeviceStepStats) + Send + Sync + 'static,
) -> Result<DeviceRun> {
    let on_step = Arc::new(on_step);
    let plan = train::plan(cfg)?;
    let world = cfg.world;
    let timeout = Duration::from_secs(cfg.timeout_s.max(1));
    let worlds = DeviceWorlds::new(world, timeout);
    let sampler = DistributedSampler::new(plan.train.len(), world, cfg.batch_size, cfg.seed, true)
        .map_err(RuntimeError::from_model)?;
    let data = Arc::new(plan.train);
    let (tx, rx) = mpsc::channel();
    #[cfg(feature = "cuda")]
    let store: Arc<dyn shardline_collectives::store::Store> =
        Arc::new(shardline_collectives::store::MemStore::new());
    for rank in 0..world {
        let mut counted = None;
        #[cfg(feature = "cuda")]
        let mut cuda = None;
        let dev: Arc<dyn Device> = match &kind {
            DeviceKind::Cpu => Arc::new(CpuDevice::new()),
            DeviceKind::Sim(o) => sim(o, rank, timeout),
            DeviceKind::Failing(f) if f.rank == rank => {
                let d = Arc::new(FailingDevice::new(sim(&f.sim, rank, timeout), f.at, f.when));
                counted = Some((Arc::clone(&d), Arc::clone(&f.calls)));
                d
            }
            DeviceKind::Failing(f) => sim(&f.sim, rank, timeout),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => {
                let d = Arc::new(shardline_models::cuda::CudaDevice::open(rank, None)?);
                cuda = Some(Arc::clone(&d));
                d
            }
        };
        #[cfg(feature = "cuda")]
        let store = Arc::clone(&store);
        let (worlds, model, ecfg) = (worlds.clone(), Arc::clone(&plan.model), plan.engine.clone());
        let (data, sampler, tx) = (Arc::clone(&data), sampler.clone(), tx.clone());
        let (total, per_epoch) = (plan.total_steps, plan.steps_per_epoch);
        let on_step = Arc::clone(&on_step);
        std::thread::spawn(move || {
            let r = (|| {
                #[cfg(feature = "cuda")]
                let sync_bn = ecfg.sync_bn;
                let mut eng = DeviceEngine::new(rank, dev, &worlds, model, ecfg, opts)?;
                #[cfg(feature = "cuda")]
                if let Some(d) = cuda {
                    eng = eng.with_comms(nccl_comms(d, rank, world, store, timeout, sync_bn)?)?;
                }
                let mut batches = RankBatches::default();
                let mut steps = Vec::new();
                let (mut most, mut timeline) = (0, Vec::new());
                for done in 0..total {
                    let (epoch, index) = (done / per_epoch, (done % per_epoch) as usize);
                    let (global, idx) =
                        batches.get(&sampler, epoch, rank, index).ok_or_else(|| {
                            RuntimeError::config(format!("epoch {epoch} has no batch {index}"))
                        })?;
                    let (x, y) = data.batch_tensors(idx);
                    let s = eng.train_step(x, &y, *global)?;
                    timeline.append(&mut eng.take_timeline());
                    most = most.max(s.device_bytes);
                    if rank == 0 {
                        on_step(done + 1, &s);
                    }
                    steps.push(s);
                }
                let final_params = eng.full_params()?;
                let final_buffers = eng.buffers()?;
                let peak = steps.last().map_or(0, |s: &DeviceStepStats| s.device_peak);
                Ok(DeviceRun {
                    steps,
                    final_params,
                    final_buffers,
                    max_device_bytes: most,
                    peak_device_bytes: peak,
                    timelines: if timeline.iter().any(|s| s.stream != "host") {
                        vec![timeline]
                    } else {
                        Vec::new()
                    },
                })
            })();
            if let Err(e) = &r {
                worlds.abort(&format!("rank {rank} failed: {e}"));
            }
            if let Some((d, calls)) = counted {
                calls.store(d.calls(), Ordering::Relaxed);
            }
            let _ = tx.send((rank, r));
        });
    }
    drop(tx);
    let mut runs: Vec<Option<DeviceRun>> = vec![None; world];
    let mut first_err = None;
    // Every rank's collectives give up after the timeout, and its host waits after twice
    // that: each thread answers within this bound.
    let deadline = timeout * 4 + Duration::from_secs(10);
    for _ in 0..world {
        let (rank, r) = rx.recv_timeout(deadline).map_err(|_| {
            RuntimeError::Failed(format!("a rank did not finish within {deadline:?}"))
        })?;
        match r {
            Ok(run) => runs[rank] = Some(run),
            Err(e) if first_err.is_none() => first_err = Some((rank, e)),
            Err(_) => {}
        }
    }
    if let Some((rank, e)) = first_err {
        return Err(match e {
            RuntimeError::Config(_) => e,
            other => RuntimeError::Failed(format!("rank {rank}: {other}")),
        });
    }
    let most = runs.iter().flatten().map(|r| r.max_device_bytes).max().unwrap_or(0);
    let peak = runs.iter().flatten().map(|r| r.peak_device_bytes).max().unwrap_or(0);
    let timelines: Vec<Vec<OpSpan>> =
        runs.iter_mut().flatten().flat_map(|r| std::mem::take(&mut r.timelines)).collect();
    let mut run = runs[0].take().unwrap_or_default();
    run.max_device_bytes = most;
    run.peak_device_bytes = peak;
    run.timelines = timelines;
    Ok(run)
}

/// Rank `rank`'s NCCL communicators on `dev`: one for the gathers, one for the reductions,
/// and with SyncBatchNorm over several ranks one for the statistics.
#[cfg(feature = "cuda")]
pub(super) fn nccl_comms(
    dev: Arc<shardline_models::cuda::CudaDevice>,
    rank: usize,
    world: usize,
    store: Arc<dyn shardline_collectives::store::Store>,
    timeout: Duration,
    sync_bn: bool,
) -> Result<super::Comms> {
    use shardline_collectives::device::DeviceComm;
    use shardline_models::cuda::NcclComm;
    let comm = |key: &str| -> Result<Box<dyn DeviceComm>> {
        let c = NcclComm::new(Arc::clone(&dev), rank, world, Arc::clone(&store), key, timeout)?;
        Ok(Box::new(c))
    };
    let stats = (sync_bn && world > 1).then(|| comm("stats")).transpose()?;
    Ok(super::Comms { gather: comm("gather")?, reduce: comm("reduce")?, stats })
}
