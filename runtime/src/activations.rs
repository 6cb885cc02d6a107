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
//! Invariants:
//! - ACTEST-1: the estimate is the peak of what the run registers as activations and
//!   scratch; it grows with the microbatch, and `--recompute units` gives less than `none`
//!   on a model of several units.

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

/// The peaks of activations and of scratch apart, of the same run as [`activation_peak`]
/// (`shardline plan` reports them as the engine's tracker does, by category).
pub fn activation_peaks(
    model: &dyn Network,
    train: &Dataset,
    cfg: &TrainConfig,
) -> Result<(u64, u64)> {
    let mem = activation_run(model, train, cfg)?;
    Ok((mem.peak(Category::Activations), mem.peak(Category::Scratch)))
}

/// Runs one microbatch's forward and backward with a meter installed; returns its tracker.
fn activation_run(
    model: &dyn Network,
    train: &Dataset,
    cfg: &TrainConfig,
) -> Result<MemoryTracker> {
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
    let m = |e| RuntimeError::from_model(e);
    {
        let _installed = shardline_models::meter::install(meter.clone() as _);
        let (x, y) = train.batch_tensors(&idx);
        let mut x = x;
        // Per call: what its layers saved, or its input alone.
        let mut kept: Vec<(Option<shardline_models::module::Saved>, Option<Tensor>)> = Vec::new();
        for (c, &u) in calls.iter().enumerate() {
            let checkpoint = cfg.recompute == Recompute::Units && c + 1 < calls.len();
            let input = checkpoint.then(|| x.clone());
            let (out, saved) =
                model.forward_call(c, &params[u], &mut buffers[u], x, &ctx).map_err(m)?;
            kept.push(if checkpoint { (None, input) } else { (Some(saved), None) });
            x = out;
        }
        let (_, mut grad) = model.loss().forward_backward(&x, &y, b).map_err(m)?;
        drop(x);
        for c in (0..calls.len()).rev() {
            let u = calls[c];
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
        }
    }
    meter.check()?;
    Ok(mem)
}
