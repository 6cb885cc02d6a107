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
//! The same run records, per call, the tensors its forward and its backward make and the
//! matrix products they run (`shardline plan` charges the bytes as elementwise work's memory
//! traffic and as fresh allocations, and prices each product by its shape and form).
//!
//! Invariants:
//! - ACTEST-1: the estimate is the peak of what the run registers as activations and
//!   scratch; it grows with the microbatch, and `--recompute units` gives less than `none`
//!   on a model of several units.
//! - ACTEST-2: a call's traffic is the bytes of every tensor made while it ran, freed or
//!   not: twice the rows make twice the traffic. A checkpointed call's backward counts
//!   neither the tensors nor the products of its forward run again (the plan charges that
//!   forward once more, RECOMP-1).

use shardline_models::nn::products::{self, Product};
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
    /// made (ACTEST-2).
    pub traffic: Vec<(u64, u64)>,
    /// Per call, what its forward and its backward ran, in more detail; empty when counted
    /// from a shape rather than run.
    pub work: Vec<CallWork>,
}

/// What one call made and ran in one microbatch (ACTEST-2).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CallWork {
    /// Its forward.
    pub forward: Made,
    /// Its backward up to the unit's gradients.
    pub backward: Made,
    /// Its input gradient, finished after the reduction's hand-off (ENG-9).
    pub input_grad: Made,
}

/// The tensors a piece of a call made and the products it ran.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Made {
    /// Bytes of each tensor made, in order.
    pub tensors: Vec<u64>,
    /// Its matrix products, in order (PROD-1).
    pub products: Vec<Product>,
}

/// The peaks of activations and of scratch apart, and each call's tensor traffic, of the
/// same run as [`activation_peak`] (`shardline plan` reports them as the engine's tracker
/// does, by category).
pub fn activation_peaks(
    model: &dyn Network,
    train: &Dataset,
    cfg: &TrainConfig,
) -> Result<MicrobatchMemory> {
    let (mem, work) = activation_traffic(model, train, cfg)?;
    let bytes = |w: &Made| w.tensors.iter().sum::<u64>();
    Ok(MicrobatchMemory {
        activations: mem.peak(Category::Activations),
        scratch: mem.peak(Category::Scratch),
        traffic: work
            .iter()
            .map(|w| (bytes(&w.forward), bytes(&w.backward) + bytes(&w.input_grad)))
            .collect(),
        work,
    })
}

/// The rank's meter, also listing the bytes of every tensor made (ACTEST-2).
struct Counting {
    inner: std::sync::Arc<RankMeter>,
    made: std::sync::Mutex<Vec<u64>>,
}

impl Counting {
    /// The tensors made since the last call.
    fn take(&self) -> Vec<u64> {
        std::mem::take(&mut *self.made.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl shardline_models::meter::Meter for Counting {
    fn charge(
        &self,
        bytes: u64,
        what: shardline_models::meter::Use,
    ) -> Option<shardline_models::meter::Charge> {
        if what == shardline_models::meter::Use::Tensor {
            self.made.lock().unwrap_or_else(|e| e.into_inner()).push(bytes);
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
/// and what each call made and ran.
fn activation_traffic(
    model: &dyn Network,
    train: &Dataset,
    cfg: &TrainConfig,
) -> Result<(MemoryTracker, Vec<CallWork>)> {
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
    let counting = std::sync::Arc::new(Counting { inner: meter.clone(), made: Default::default() });
    let mut work = vec![CallWork::default(); calls.len()];
    // What the calls ran since the last look.
    let look = |recording: products::Recording| Made {
        tensors: counting.take(),
        products: recording.finish(),
    };
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
            counting.take();
            let recording = products::record();
            let (out, saved) =
                model.forward_call(c, &params[u], &mut buffers[u], x, &ctx).map_err(m)?;
            work[c].forward = look(recording);
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
                    // The forward again: charged as the forward once more, not here.
                    let mut scratch = buffers[u].clone();
                    let again = products::record();
                    let s = model.forward_call(c, &params[u], &mut scratch, input, &ctx);
                    drop(look(again));
                    s.map_err(m)?.1
                }
                (None, None) => unreachable!("a checkpointed call keeps its input"),
            };
            counting.take();
            let recording = products::record();
            let b = CallBackward {
                params: &params[u],
                saved,
                grad_output: grad,
                grads_out: &mut grads[u],
                input_grad: c > 0,
            };
            let ig = model.backward_call(c, b, &ctx).map_err(m)?;
            work[c].backward = look(recording);
            let recording = products::record();
            grad = ig.finish(&be, &params[u]).map_err(m)?.unwrap_or_default();
            work[c].input_grad = look(recording);
        }
    }
    meter.check()?;
    Ok((mem, work))
}
