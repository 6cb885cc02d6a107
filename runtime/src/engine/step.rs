//! One training step of a rank: [`RankEngine::train_step`] walks the step's work (ENG-12)
//! through [`EngineStep`], which runs each use's kernels on the rank's slice and hands the
//! reductions and updates to [`StepIo`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline_collectives::{CallOptions, ReduceOp};
use shardline_models::{DistributedSampler, StatsReducer, Tensor};

use super::pass::{Micro, PassCtx, Saved};
use super::reduction::{self, ReduceIo, ReduceWork, Reductions, StepIo};
use super::stats::StatsLane;
use super::walk::{walk_step, HandOff, StepWork, Walk};
use super::{accum, RankEngine, StepState, StepStats};
use crate::error::{Result, RuntimeError};
use crate::fault::Phase;
use crate::optim;
use crate::telemetry::Row;

impl RankEngine {
    /// One training step on this rank's slice `x`/`y` of a global batch of `global_batch`
    /// samples. Every rank of the group must call it with its own slice (possibly empty).
    pub fn train_step(&mut self, x: Tensor, y: &Tensor, global_batch: usize) -> Result<StepStats> {
        let _meter = self.install_meter();
        let t_step = Instant::now();
        if self.commit_after_sums {
            self.buffers_at_step.0.clone_from(&self.state.buffers);
            self.buffers_at_step.1 = true;
        }
        let sent0 = (self.gather.bytes_sent(), self.reduce_bytes(), self.replica_bytes());
        let hpz0 = self.hpz_bytes();
        self.cast.set(Duration::ZERO);
        let n = self.layout.units().len();
        // ENG-8: without clipping each unit steps as soon as its reduction is in.
        // LIVE-1: stages 1 and 2 gather the updated parameters after the updates, so their
        // commit is the loss all-reduce before the updates, as clipping orders them.
        let commit_by_sums = self.commit_after_sums && self.rules.gather_after_update;
        let early = self.cfg.clip_grad_norm.is_none() && !commit_by_sums;
        // The schedule is 0-based (`lr_at(0)` is the first step's rate); the optimizer's step
        // count is 1-based (OPT-3).
        let st = StepState {
            unit_sq: vec![0.0; n],
            norms_when_reduced: !early,
            lr: self.cfg.lr.lr_at(self.step),
            coef: 1.0,
            ..StepState::default()
        };
        let stats = Arc::clone(&self.stats);
        stats.begin_step();
        let reducer = (self.world > 1).then_some(&*stats as &dyn StatsReducer);
        let first_sample =
            DistributedSampler::slice_range(global_batch, self.world, self.rank).start;
        let micro = accum::microbatches(x.batch(), self.cfg.grad_accum);
        self.plan.begin_step(&self.calls, micro.len());
        let calls = self.calls.clone();
        let mut walk = Walk::of(&calls, n, micro.len(), self.rules, &self.cfg);
        walk.clip |= commit_by_sums;
        walk.commit = self.commit_after_sums && !walk.clip;
        let pass = PassCtx {
            training: true,
            sync_bn: self.cfg.sync_bn,
            reducer,
            global_batch,
            seed: self.cfg.seed,
            step: self.step + 1,
            first_sample,
        };
        let mut work = EngineStep {
            eng: self,
            st,
            data: Some((x, y.clone())),
            micro,
            pass,
            x: None,
            y: None,
            saved: Vec::with_capacity(calls.len()),
            grad: None,
            local_loss: 0.0,
            stats: &stats,
            stats_messages: 0,
            sums: (0.0, 0.0, false, Vec::new()),
            t_step,
            updates_begun: false,
            update_point_passed: false,
        };
        walk_step(&walk, &mut work)?;
        let EngineStep { mut st, stats_messages, sums: (loss, total_sq, stop, rank_busy), .. } =
            work;
        self.updating = false;
        self.buffers_at_step.1 = false;
        self.meter.check()?;
        Ok(StepStats {
            loss,
            lr: st.lr,
            step_time: t_step.elapsed(),
            compute_time: st.compute,
            comm_exposed: st.clock.exposed,
            comm_time: st.clock.comm_time(t_step),
            peak_bytes: self.mem.peak_total(),
            stats_messages,
            grad_norm: total_sq.sqrt(),
            stop,
            gather_bytes: self.gather.bytes_sent() - sent0.0,
            reduce_bytes: self.reduce_bytes() - sent0.1,
            replica_bytes: self.replica_bytes() - sent0.2,
            hpz_bytes: self.hpz_bytes() - hpz0,
            cast_time: self.cast.get(),
            rank_busy_s: rank_busy,
        })
    }
}

/// The engine's [`StepWork`]: the walk's uses run the model's kernels on this rank's slice,
/// its reductions and updates go through [`StepIo`] (ENG-12).
struct EngineStep<'e, 'r> {
    eng: &'e mut RankEngine,
    st: StepState,
    /// The rank's slice, until the last microbatch is cut from it.
    data: Option<(Tensor, Tensor)>,
    /// The microbatches' sample ranges in the slice (ACC-1).
    micro: Vec<std::ops::Range<usize>>,
    /// The step's pass; `first_sample` is the slice's, each microbatch's is set from it.
    pass: PassCtx<'r>,
    /// The current microbatch's activation flowing forward, and its labels.
    x: Option<Tensor>,
    y: Option<Tensor>,
    /// What each call of the microbatch kept for its backward.
    saved: Vec<Saved>,
    /// The gradient flowing backward.
    grad: Option<Tensor>,
    /// This rank's share of the loss so far (ACC-1).
    local_loss: f32,
    stats: &'r StatsLane,
    stats_messages: usize,
    /// The step's (loss, squared norm, stop) over the group, and every rank's busy seconds.
    sums: (f32, f64, bool, Vec<f32>),
    /// When the step began.
    t_step: Instant,
    /// Whether the updates have begun.
    updates_begun: bool,
    /// Whether the [`Phase::Update`] fault point was passed (after the updates, before the
    /// loss all-reduce where that follows them).
    update_point_passed: bool,
}

impl<'r> EngineStep<'_, 'r> {
    fn pass(&self, mb: Micro) -> PassCtx<'r> {
        let r = &self.micro[mb.index];
        PassCtx { first_sample: self.pass.first_sample + r.start, ..self.pass }
    }
}

impl ReduceIo<ReduceWork> for EngineStep<'_, '_> {
    type Error = RuntimeError;

    fn finish(&mut self, r: reduction::Reduction<ReduceWork>) -> Result<()> {
        StepIo { eng: self.eng, st: &mut self.st }.finish(r)
    }

    fn update(&mut self, unit: usize) -> Result<()> {
        StepIo { eng: self.eng, st: &mut self.st }.update(unit)
    }
}

impl StepWork for EngineStep<'_, '_> {
    type Op = ReduceWork;

    fn forward(&mut self, i: usize, call: usize, mb: Micro, checkpoint: bool) -> Result<()> {
        if call == 0 {
            if mb.index == 0 {
                self.eng.fault_point(Phase::Forward);
            }
            let r = self.micro[mb.index].clone();
            let (x, y) = self.data.as_ref().ok_or_else(|| RuntimeError::config("data"))?;
            let (x, y) = if mb.count == 1 {
                (x.clone(), y.clone())
            } else {
                (x.rows(r.start, r.end)?, y.rows(r.start, r.end)?)
            };
            self.x = Some(x);
            self.y = Some(y);
        }
        let x = self.x.take().ok_or_else(|| RuntimeError::config("forward input"))?;
        let pass = self.pass(mb);
        let (y, s) = self.eng.forward_unit(i, x, pass, checkpoint, &mut self.st)?;
        self.saved.push(s);
        self.x = Some(y);
        Ok(())
    }

    fn loss(&mut self, _mb: Micro) -> Result<()> {
        let x = self.x.take().ok_or_else(|| RuntimeError::config("loss input"))?;
        let y = self.y.take().ok_or_else(|| RuntimeError::config("labels"))?;
        let t0 = Instant::now();
        let (local, grad) =
            self.eng.model.loss().forward_backward(&x, &y, self.pass.global_batch)?;
        self.st.compute += t0.elapsed();
        self.local_loss += local;
        self.grad = Some(grad);
        // The output (a language model's logits: batch x tokens x vocabulary) is not needed
        // in backward: freed before backward's peak (here, as `x` goes).
        Ok(())
    }

    fn backward(
        &mut self,
        i: usize,
        _call: usize,
        mb: Micro,
        hand: HandOff,
        reds: &mut Reductions<ReduceWork>,
    ) -> Result<()> {
        let s = self.saved.pop().ok_or_else(|| RuntimeError::config("saved activations"))?;
        let grad = self.grad.take().ok_or_else(|| RuntimeError::config("output gradient"))?;
        let pass = self.pass(mb);
        self.grad = Some(self.eng.backward_unit(i, s, grad, hand, pass, &mut self.st, reds)?);
        Ok(())
    }

    fn backward_done(&mut self, i: usize, mb: Micro) {
        if mb.index == 0 && i == self.eng.calls.len() {
            self.eng.fault_point(Phase::Backward);
        }
    }

    fn end_passes(&mut self) -> Result<()> {
        (self.grad, self.data) = (None, None);
        let (plan, mut io) = self.eng.gathers(&mut self.st.clock);
        plan.end_pass(&mut io);
        // HPZ-2: every unit's last use dropped its piece; none outlives the step.
        self.eng.pieces.clear();
        self.stats_messages = self.stats.end_step(&mut self.st.clock);
        self.eng.fault_point(Phase::Reduce);
        Ok(())
    }

    fn begin_updates(&mut self) -> Result<()> {
        self.updates_begun = true;
        self.eng.step += 1;
        self.eng.updating = true;
        if let Some(max) = self.eng.cfg.clip_grad_norm {
            self.st.coef = optim::clip_coef(self.sums.1, max);
        }
        Ok(())
    }

    fn loss_and_norm(&mut self) -> Result<()> {
        if self.updates_begun && !self.update_point_passed {
            self.update_point_passed = true;
            self.eng.fault_point(Phase::Update);
        }
        // STRAG-1: the time this rank was not waiting for communication so far.
        let busy = self.t_step.elapsed().saturating_sub(self.st.clock.exposed).as_secs_f32();
        self.sums = self.eng.reduce_loss_and_norm(self.local_loss, busy, &mut self.st)?;
        Ok(())
    }

    fn end_updates(&mut self) -> Result<()> {
        if !self.update_point_passed {
            // The figures were reduced before the updates (clipping, stages 1 and 2).
            self.update_point_passed = true;
            self.eng.fault_point(Phase::Update);
        }
        self.eng.trace_updates(&mut self.st);
        Ok(())
    }

    fn gather_updated(&mut self) -> Result<()> {
        self.eng.gather_updated(&mut self.st.clock)
    }

    fn commit(&mut self) -> Result<()> {
        let mut now = CallOptions::new();
        now.blocking(true);
        let w = self.eng.loss_lane.all_reduce_opts(vec![0.0], ReduceOp::Sum, &now);
        self.st.clock.wait(&self.eng.trace, self.eng.rank, w, Row::Reduce, "commit")?;
        Ok(())
    }

    fn committed(&mut self) {
        // LIVE-1: the kept state (own shard, or full at stage 0) is the new step's.
        self.eng.updating = false;
        self.eng.buffers_at_step.1 = false;
    }
}
