//! SyncBN with gradient accumulation (`--sync-bn --grad-accum N`) against a numeric
//! reference built here from the model's own calls, without the engine: one rank that runs,
//! per step, microbatch k over the union of every rank's microbatch k (BatchNorm over that
//! union is SyncBN over microbatch k), accumulates the gradients and steps once (ACC-5).
//! Two references with the wrong semantics are the controls: statistics over the whole
//! step's batch, and running statistics updated once per step.

mod common;
use common::*;
use shardline_models::{CallBackward, Cpu, Ctx, DistributedSampler, InputGrad, ModelSpec};
use shardline_runtime::train::{self, SyncBnMode, TrainConfig};

/// Why not zero: SyncBN merges the ranks' (count, mean, M2) with Chan's formula where the
/// reference sums the union in one pass, and gradients are summed per rank and then
/// reduced. The accumulation tests' bounds (`grad_accum.rs`). Observed over the grid
/// (the test prints them): loss relative 1.2e-7, parameters 1.2e-7, running statistics
/// 6e-8 (`num_batches_tracked` is exact).
const LOSS_REL_TOL: f32 = 2e-6;
const PARAM_ABS_TOL: f32 = 2e-6;
const BUFFER_ABS_TOL: f32 = 2e-6;

/// What the reference gets wrong on purpose (the controls).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Semantics {
    /// Torch's: statistics per microbatch over every rank, running statistics updated once
    /// per microbatch.
    Torch,
    /// Batch statistics over the whole step's batch (one forward of every microbatch).
    WholeStep,
    /// Statistics per microbatch, but the running statistics keep only the last
    /// microbatch's update, as if they were updated once per step.
    RunningOncePerStep,
}

/// Losses, final parameters and final buffers of a run.
struct Trajectory {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    buffers: Vec<Vec<f32>>,
}

/// The reference: `cfg`'s job (its world's sampler, model, optimizer and learning rates)
/// run on one rank, microbatch by microbatch over the unions of the ranks' microbatches.
fn reference(cfg: &TrainConfig, n: usize, semantics: Semantics) -> Trajectory {
    let plan = train::plan(cfg).expect("plan");
    let (model, data) = (plan.model, plan.train);
    let spec = model.spec();
    let calls = model.calls();
    let units = spec.units.len();
    let sampler =
        DistributedSampler::new(data.len(), cfg.world, cfg.batch_size, cfg.seed, true).unwrap();
    let mut params: Vec<Vec<f32>> =
        (0..units).map(|u| model.init_params(u, cfg.seed).unwrap()).collect();
    let mut buffers: Vec<Vec<f32>> = (0..units).map(|u| model.init_buffers(u).unwrap()).collect();
    let k = plan.optimizer.state_len_per_param();
    let mut opt_state: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len() * k]).collect();
    let backend = Cpu::new();
    let mut losses = Vec::new();
    for step in 0..cfg.steps.expect("steps") {
        let (epoch, index) = (step / plan.steps_per_epoch, (step % plan.steps_per_epoch) as usize);
        let slices: Vec<(usize, Vec<usize>)> =
            (0..cfg.world).map(|r| sampler.rank_batches(epoch, r)[index].clone()).collect();
        let global = slices[0].0;
        // Microbatch k of every rank (ACC-1: slice_range of each rank's slice), as one batch.
        let groups: Vec<Vec<usize>> = if semantics == Semantics::WholeStep {
            vec![slices.iter().flat_map(|(_, idx)| idx.iter().copied()).collect()]
        } else {
            (0..n)
                .map(|m| {
                    slices
                        .iter()
                        .flat_map(|(_, idx)| {
                            idx[DistributedSampler::slice_range(idx.len(), n, m)].iter().copied()
                        })
                        .collect()
                })
                .collect()
        };
        let before_step = buffers.clone();
        let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        let mut loss = 0.0f32;
        for group in &groups {
            if semantics == Semantics::RunningOncePerStep {
                buffers = before_step.clone();
            }
            let (mut x, y) = data.batch_tensors(group);
            let ctx = Ctx { seed: cfg.seed, step: step + 1, ..Ctx::new(&backend, true, global) };
            let mut saved = Vec::with_capacity(calls.len());
            for (c, &u) in calls.iter().enumerate() {
                let (out, s) = model.forward_call(c, &params[u], &mut buffers[u], x, &ctx).unwrap();
                saved.push(s);
                x = out;
            }
            let (l, mut g) = model.loss().forward_backward(&x, &y, global).unwrap();
            loss += l;
            for (c, &u) in calls.iter().enumerate().rev() {
                let b = CallBackward {
                    params: &params[u],
                    saved: saved.pop().unwrap(),
                    grad_output: g,
                    grads_out: &mut grads[u],
                    input_grad: c > 0,
                };
                let ig: InputGrad = model.backward_call(c, b, &ctx).unwrap();
                match ig.finish(&backend, &params[u]).unwrap() {
                    Some(t) => g = t,
                    None => break,
                }
            }
        }
        let lr = plan.engine.lr.lr_at(step);
        for u in 0..units {
            plan.optimizer
                .step(lr, step + 1, &mut params[u], &grads[u], &mut opt_state[u])
                .unwrap();
        }
        losses.push(loss);
    }
    Trajectory { losses, params, buffers }
}

/// The engine's run of `cfg` with `n` microbatches.
fn engine(cfg: &TrainConfig, n: usize) -> Trajectory {
    let s = run_ok(TrainConfig { grad_accum: n, ..cfg.clone() }, quiet());
    assert!(s.sync_bn.0, "{}: SyncBN is on ({})", cfg.model, s.sync_bn.1);
    Trajectory { losses: s.losses, params: s.final_params, buffers: s.final_buffers }
}

/// The buffers of every unit split into running statistics and `num_batches_tracked`.
fn split_buffers(spec: &ModelSpec, buffers: &[Vec<f32>]) -> (Vec<f32>, Vec<f32>) {
    let (mut running, mut tracked) = (Vec::new(), Vec::new());
    for (unit, values) in spec.units.iter().zip(buffers) {
        let mut at = 0;
        for b in &unit.buffers {
            let len: usize = b.shape.iter().product();
            let to =
                if b.name.ends_with("num_batches_tracked") { &mut tracked } else { &mut running };
            to.extend_from_slice(&values[at..at + len]);
            at += len;
        }
    }
    (running, tracked)
}

/// How far `a` is from `b`: loss relative, parameters and running statistics absolute, and
/// whether `num_batches_tracked` agrees.
#[derive(Debug)]
struct Distance {
    loss: f32,
    params: f32,
    running: f32,
    tracked_equal: bool,
}

fn distance(spec: &ModelSpec, a: &Trajectory, b: &Trajectory) -> Distance {
    let ((ra, ta), (rb, tb)) = (split_buffers(spec, &a.buffers), split_buffers(spec, &b.buffers));
    Distance {
        loss: max_rel(&a.losses, &b.losses),
        params: max_abs_diff(&a.params, &b.params),
        running: max_abs_diff(&[ra], &[rb]),
        tracked_equal: ta == tb,
    }
}

impl Distance {
    fn within(&self) -> bool {
        self.loss <= LOSS_REL_TOL
            && self.params <= PARAM_ABS_TOL
            && self.running <= BUFFER_ABS_TOL
            && self.tracked_equal
    }
}

/// A job small enough for the grid: SyncBN on, a global batch of 36 (every rank's slice
/// cuts into 2 or 3 microbatches at worlds 2 and 3), three steps of SGD with momentum on
/// the cosine schedule (the reference takes optimizer and rates from the plan).
fn cfg(model: &str, world: usize, stage: u8) -> TrainConfig {
    let base = TrainConfig { sync_bn: SyncBnMode::On, ..small_cfg(world, stage, 3, 36) };
    match model {
        "convnet-bn" => TrainConfig { model: model.into(), hidden: Some(4), ..base },
        _ => base,
    }
}

/// ACC-5: with SyncBN, stages 0 and 3, worlds 2 and 3, N = 2 and 3, mlp-bn and convnet-bn
/// end where the one-rank reference over the unions of the ranks' microbatches ends:
/// losses, parameters, running statistics and `num_batches_tracked`. The references with
/// whole-step statistics or running statistics updated once per step do not.
#[test]
fn syncbn_microbatches_match_one_rank_over_the_unions_acc_5() {
    let mut worst = (0.0f32, 0.0f32, 0.0f32);
    for model in ["mlp-bn", "convnet-bn"] {
        let spec = train::plan(&cfg(model, 2, 0)).expect("plan").model.spec();
        for (world, n) in [(2usize, 2usize), (2, 3), (3, 2), (3, 3)] {
            let want = reference(&cfg(model, world, 0), n, Semantics::Torch);
            let (_, tracked) = split_buffers(&spec, &want.buffers);
            assert!(!tracked.is_empty(), "{model} has BatchNorm layers");
            assert!(
                tracked.iter().all(|&t| t == (3 * n) as f32),
                "{tracked:?}: one per microbatch"
            );
            for stage in [0u8, 3] {
                let got = engine(&cfg(model, world, stage), n);
                let d = distance(&spec, &got, &want);
                let what = format!("{model} world {world} stage {stage} grad-accum {n}");
                assert!(d.within(), "{what}: {d:?}");
                worst = (worst.0.max(d.loss), worst.1.max(d.params), worst.2.max(d.running));
            }
            // The controls: each wrong semantics is far outside the tolerances.
            if world == 2 && n == 2 {
                let got = engine(&cfg(model, world, 3), n);
                let whole = reference(&cfg(model, world, 0), n, Semantics::WholeStep);
                let whole = distance(&spec, &got, &whole);
                let once = reference(&cfg(model, world, 0), n, Semantics::RunningOncePerStep);
                let once = distance(&spec, &got, &once);
                eprintln!("{model} controls: whole step {whole:?}, running once per step {once:?}");
                assert!(
                    whole.params > 100.0 * PARAM_ABS_TOL,
                    "{model}: whole-step statistics moved the parameters only {:e}",
                    whole.params
                );
                assert!(
                    once.running > 100.0 * BUFFER_ABS_TOL && !once.tracked_equal,
                    "{model}: running statistics once per step: {once:?}"
                );
            }
        }
    }
    eprintln!(
        "syncbn grad-accum against the one-rank reference: worst loss {:e}, params {:e}, running statistics {:e}",
        worst.0, worst.1, worst.2
    );
}
