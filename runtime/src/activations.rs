//! The activation memory of one training microbatch, measured before the job starts by
//! running that microbatch once on this thread, for `--stage auto`.
//!
//! Tensor sizes depend on shapes, never on values, so one forward and backward of a
//! microbatch of the per-rank size, on the first samples of the training set, registers
//! exactly the tensors and kernel scratch a rank's step registers (MEM-4) — whatever the
//! model is, with no per-layer formula to keep in step with the layers. The recompute choice
//! is honoured: with `units` every call but the last keeps only its input, and backward
//! re-runs its forward first (RECOMP-1).
//!
//! The same run counts, per call, the bytes of the tensors its forward and its backward make
//! (`shardline plan` charges them as elementwise work's memory traffic).
//!
//! Invariants:
//! - ACTEST-1: the estimate is the peak of what the run registers as activations and
//!   scratch; it grows with the microbatch, and `--recompute units` gives less than `none`
//!   on a model of several units.
//! - ACTEST-2: a call's traffic is the bytes of every tensor made while it ran, freed or
//!   not: twice the rows make twice the traffic.

use shardline_models::{CallBackward, Cpu, Ctx, Dataset, Network, Tensor};

use crate::engine::Recompute;
use crate::error::{Result, RuntimeError};
use crate::memory::{Category, MemoryTracker, RankMeter};
use crate::train::TrainConfig;

/// Samples per rank in one microbatch of `cfg`.
pub fn microbatch(cfg: &TrainConfig) -> usize {
    (cfg.batch_size / cfg.world.max(1) / cfg.grad_accum.max(1)).max(1)
}

/// Peak bytes of activations and scratch of one microbatch's forward and backward (ACTEST-1).
pub fn activation_peak(model: &dyn Network, train: &Dataset, cfg: &TrainConfig) -> Result<u64> {
    // Only activations and scratch were registered: their peak together.
    Ok(activation_run(model, train, cfg)?.peak_total())
}

/// One microbatch's memory as [`activation_peaks`] measures it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MicrobatchMemory {
    /// Peak bytes of activations.
    pub activations: u64,
    /// Peak bytes of kernels' scratch.
    pub scratch: u64,
    /// Per call of the forward pass, the bytes of the tensors its forward and its backward
    /// (with a recomputed forward) made (ACTEST-2).
    pub traffic: Vec<(u64, u64)>,
}

/// The peaks of activations and of scratch apart, and each call's tensor traffic, of the
/// same run as [`activation_peak`] (`shardline plan` reports them as the engine's tracker
/// does, by category).
pub fn activation_peaks(
    model: &dyn Network,
    train: &Dataset,
    cfg: &TrainConfig,
) -> Result<MicrobatchMemory> {
    let (mem, traffic) = activation_traffic(model, train, cfg)?;
    Ok(MicrobatchMemory {
        activations: mem.peak(Category::Activations),
        scratch: mem.peak(Category::Scratch),
        traffic,
    })
}

/// The rank's meter, also counting the bytes of every tensor made (ACTEST-2).
struct Counting {
    inner: std::sync::Arc<RankMeter>,
    made: std::sync::atomic::AtomicU64,
}

impl Counting {
    fn made(&self) -> u64 {
        self.made.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl shardline_models::meter::Meter for Counting {
    fn charge(
        &self,
        bytes: u64,
        what: shardline_models::meter::Use,
    ) -> Option<shardline_models::meter::Charge> {
        if what == shardline_models::meter::Use::Tensor {
            self.made.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        }
        self.inner.charge(bytes, what)
    }
}

fn activation_run(
    model: &dyn Network,
    train: &Dataset,
    cfg: &TrainConfig,
) -> Result<MemoryTracker> {
    Ok(activation_traffic(model, train, cfg)?.0)
}

/// Runs one microbatch's forward and backward with a meter installed; returns its tracker
/// and each call's traffic.
fn activation_traffic(
    model: &dyn Network,
    train: &Dataset,
    cfg: &TrainConfig,
) -> Result<(MemoryTracker, Vec<(u64, u64)>)> {
    let b = microbatch(cfg).min(train.len());
    let idx: Vec<usize> = (0..b).collect();
    let n = model.spec().units.len();
    let params: Vec<Vec<f32>> = (0..n)
        .map(|u| model.init_params(u, cfg.seed))
        .collect::<std::result::Result<_, _>>()
        .map_err(RuntimeError::from_model)?;
    let mut buffers: Vec<Vec<f32>> = (0..n)
        .map(|u| model.init_buffers(u))
        .collect::<std::result::Result<_, _>>()
        .map_err(RuntimeError::from_model)?;
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let calls = model.calls();
    let be = Cpu::new();
    let ctx = Ctx::new(&be, true, b);
    let mem = MemoryTracker::new(0, None);
    let meter = RankMeter::new(mem.clone());
    let counting = std::sync::Arc::new(Counting { inner: meter.clone(), made: 0.into() });
    let mut traffic = vec![(0u64, 0u64); calls.len()];
    let m = |e| RuntimeError::from_model(e);
    {
        let _installed = shardline_models::meter::install(counting.clone() as _);
        let (x, y) = train.batch_tensors(&idx);
        let mut x = x;
        // Per call: what its layers saved, or its input alone.
        let mut kept: Vec<(Option<shardline_models::module::Saved>, Option<Tensor>)> = Vec::new();
        for (c, &u) in calls.iter().enumerate() {
            let checkpoint = cfg.recompute == Recompute::Units && c + 1 < calls.len();
            let input = checkpoint.then(|| x.clone());
            let made = counting.made();
            let (out, saved) =
                model.forward_call(c, &params[u], &mut buffers[u], x, &ctx).map_err(m)?;
            traffic[c].0 = counting.made() - made;
            kept.push(if checkpoint { (None, input) } else { (Some(saved), None) });
            x = out;
        }
        let (_, mut grad) = model.loss().forward_backward(&x, &y, b).map_err(m)?;
        drop(x);
        for c in (0..calls.len()).rev() {
            let u = calls[c];
            let made = counting.made();
            let (saved, input) = kept.pop().expect("one entry per call");
            let saved = match (saved, input) {
                (Some(s), _) => s,
                (None, Some(input)) => {
                    let mut scratch = buffers[u].clone();
                    model.forward_call(c, &params[u], &mut scratch, input, &ctx).map_err(m)?.1
                }
                (None, None) => unreachable!("a checkpointed call keeps its input"),
            };
            let b = CallBackward {
                params: &params[u],
                saved,
                grad_output: grad,
                grads_out: &mut grads[u],
                input_grad: c > 0,
            };
            let ig = model.backward_call(c, b, &ctx).map_err(m)?;
            grad = ig.finish(&be, &params[u]).map_err(m)?.unwrap_or_default();
            traffic[c].1 = counting.made() - made;
        }
    }
    meter.check()?;
    Ok((mem, traffic))
}
