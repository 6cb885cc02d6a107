//! One unit's forward and backward on this rank: its parameters (resident, or gathered by
//! the prefetch plan), the model's kernels, the compute spans, and the hand-off of its
//! gradients to their reduction.
//!
//! Invariant:
//! - ENG-9: a unit's gradients go to their reduction as soon as they are complete; where the
//!   unit starts with a linear layer its input gradient is computed afterwards (an
//!   `input grad` span), overlapping the reduction, and the first unit's input gradient (the
//!   data's) is never computed. Gradients and results are bitwise unchanged (MODEL-4).

use std::time::Instant;

use shardline_models::{Backend, CallBackward, Ctx, StatsReducer, Tensor};

use super::prefetch::Gathered;
use super::recompute::{Checkpoint, Recording, Replay};
use super::reduction::{ReduceWork, Reductions};
use super::stage::BeforeUse;
use super::walk::HandOff;
use super::{RankEngine, StepState};
use crate::error::Result;
use crate::memory::Category;
use crate::telemetry::Row;

/// How a pass runs its units.
#[derive(Clone, Copy)]
pub(crate) struct PassCtx<'r> {
    /// Training: batch statistics, compute timed and traced, activations counted. Otherwise
    /// evaluation with the running statistics.
    pub(crate) training: bool,
    /// Treat every BatchNorm as SyncBatchNorm.
    pub(crate) sync_bn: bool,
    /// The statistics reducer (the engine's stats lane; none on one rank).
    pub(crate) reducer: Option<&'r dyn StatsReducer>,
    /// Samples in the global batch.
    pub(crate) global_batch: usize,
    /// The run's seed (dropout masks).
    pub(crate) seed: u64,
    /// The step being computed, 1-based.
    pub(crate) step: u64,
    /// Global index of this rank's first sample (of the microbatch).
    pub(crate) first_sample: usize,
}

impl<'r> PassCtx<'r> {
    fn ctx<'a>(&self, backend: &'a dyn Backend, overwrite_grads: bool) -> Ctx<'a>
    where
        'r: 'a,
    {
        Ctx {
            training: self.training,
            sync_bn: self.sync_bn,
            reducer: self.reducer,
            global_batch: self.global_batch,
            backend,
            overwrite_grads,
            seed: self.seed,
            step: self.step,
            first_sample: self.first_sample,
        }
    }
}

/// What a call's training forward keeps for its backward.
pub(crate) enum Kept {
    /// What its layers saved.
    State(shardline_models::module::Saved),
    /// Its input alone, for the backward to re-run the forward (RECOMP-1).
    Input(Checkpoint),
}

/// What a training forward leaves for the unit's backward. Its tensors are registered as
/// activations by the rank's meter for as long as they are held (ENG-3, MEM-4).
pub(crate) type Saved = Kept;

/// Microbatch `index` of a step's `count` (ACC-1).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Micro {
    pub(crate) index: usize,
    pub(crate) count: usize,
}

impl RankEngine {
    /// Stage 3: the gathered parameters of use `i` of the pass (ENG-5); the other stages use
    /// the parameters they keep, in bf16 a copy rounded for this use (PREC-2).
    fn gathered(&mut self, i: usize, st: &mut StepState) -> Result<Option<Gathered>> {
        if self.rules.before_use != BeforeUse::Gather {
            return self.rounded_resident(self.plan.unit_at(i));
        }
        let (plan, mut io) = self.gathers(&mut st.clock);
        plan.acquire(i, &mut io).map(Some)
    }

    /// After use `i`: the rank keeps or drops its secondary piece (HPZ-2), then the plan
    /// keeps or frees the gathered parameters (ENG-5).
    fn done_with(
        &mut self,
        i: usize,
        gathered: Option<Gathered>,
        st: &mut StepState,
    ) -> Result<()> {
        if self.rules.before_use != BeforeUse::Gather {
            if let Some(copy) = gathered {
                copy.give_back(self.comm.pool());
            }
            return Ok(());
        }
        if let Some(g) = gathered {
            self.piece_after_use(i, &g.full)?;
            let (plan, mut io) = self.gathers(&mut st.clock);
            plan.done_with(i, g, &mut io);
        }
        Ok(())
    }

    /// Use `i` of the pass: its unit's forward on `x`. Training also returns what the call
    /// keeps for its backward; a checkpointed call keeps only its input and the statistics
    /// it received (RECOMP-1), as the step's walk says (`checkpoint`). A tensor the cap
    /// refused fails the call here (MEM-4).
    pub(super) fn forward_unit(
        &mut self,
        i: usize,
        x: Tensor,
        pass: PassCtx<'_>,
        checkpoint: bool,
        st: &mut StepState,
    ) -> Result<(Tensor, Saved)> {
        let u = self.plan.unit_at(i);
        let nc = self.calls.len();
        // The plan's uses run forward then backward, once per microbatch (ACC-1).
        let call = i % (2 * nc);
        let checkpoint = pass.training && checkpoint;
        let gathered = self.gathered(i, st)?;
        let numel = self.layout.unit(u).numel();
        let t0 = Instant::now();
        let params: &[f32] = match &gathered {
            Some(g) => &g.full[..numel],
            None => &self.state.params[u][..numel],
        };
        let buffers = &mut self.state.buffers[u];
        let (y, kept) = if checkpoint {
            let input = x.clone();
            let recording = pass.reducer.map(Recording::new);
            let y = {
                let mut ctx = pass.ctx(&*self.backend, false);
                if let Some(r) = &recording {
                    ctx.reducer = Some(r);
                }
                // What the layers save is dropped here; backward recomputes it.
                self.model.forward_call(call, params, buffers, x, &ctx)?.0
            };
            let received = recording.map(Recording::into_received).unwrap_or_default();
            (y, Kept::Input(Checkpoint { input, received }))
        } else {
            let ctx = pass.ctx(&*self.backend, false);
            let (y, saved) = self.model.forward_call(call, params, buffers, x, &ctx)?;
            (y, Kept::State(saved))
        };
        if pass.training {
            let t1 = Instant::now();
            st.compute += t1 - t0;
            let label = &self.labels[u];
            self.trace.record(self.rank, Row::Compute, format!("forward {label}"), t0, t1);
        }
        self.done_with(i, gathered, st)?;
        self.meter.check()?;
        Ok((y, kept))
    }

    /// A checkpointed call's forward again, in backward (RECOMP-1): the same parameters,
    /// input and context, the statistics replayed and the running statistics updated in a
    /// scratch copy (RECOMP-2); returns what its layers saved.
    fn recompute_call(
        &self,
        (call, u): (usize, usize),
        params: &[f32],
        cp: Checkpoint,
        pass: PassCtx<'_>,
        st: &mut StepState,
    ) -> Result<shardline_models::module::Saved> {
        let t0 = Instant::now();
        let replay = Replay::new(self.rank, self.world, cp.received);
        let mut ctx = pass.ctx(&*self.backend, false);
        if ctx.reducer.is_some() {
            ctx.reducer = Some(&replay);
        }
        let mut scratch = self.state.buffers[u].clone();
        // The output is not needed again: the first forward's went on to the next call.
        let (_, saved) = self.model.forward_call(call, params, &mut scratch, cp.input, &ctx)?;
        let label = &self.labels[u];
        let t1 = Instant::now();
        st.compute += t1 - t0;
        self.trace.record(self.rank, Row::Compute, format!("recompute {label}"), t0, t1);
        self.meter.check()?;
        Ok(saved)
    }

    /// Use `i` of a training pass: its unit's backward from the output
    /// gradient `grad` and what the forward kept (re-running a checkpointed call's forward
    /// first, RECOMP-1), the gradients' reduction issued at once when the step's walk says
    /// (`hand`: ENG-9, NET-1, ACC-2, ACC-3), then the input gradient, which is returned.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward_unit(
        &mut self,
        i: usize,
        kept: Saved,
        grad: Tensor,
        hand: HandOff,
        pass: PassCtx<'_>,
        st: &mut StepState,
        reds: &mut Reductions<ReduceWork>,
    ) -> Result<Tensor> {
        let u = self.plan.unit_at(i);
        // Backward runs the forward's calls in reverse: use `i` is call `call`.
        let nc = self.calls.len();
        let call = 2 * nc - 1 - i % (2 * nc);
        let HandOff { reduce: last_use, add } = hand;
        // Backward prefetch: the previous units' gathers go out before computing.
        let gathered = self.gathered(i, st)?;
        let l = self.layout.unit(u);
        let (numel, padded) = (l.numel(), l.padded_numel());
        // A full persistent gradient buffer (stages 0 and 1) is what backward writes and the
        // collective reduces in place of a second copy; otherwise the unit's full gradient
        // is transient, held only until its reduce-scatter is done (ENG-7).
        let (first_use, (galloc, mut gfull)) = match self.partial_grads[u].take() {
            Some(g) => (false, g),
            None if self.rules.transient_grads() => {
                let what = format!("{} (unreduced)", self.labels[u]);
                // Taken before it is registered: never counted twice (MEM-5).
                // Its capacity: a kept buffer may be longer than asked for.
                let buf = self.comm.pool().take(padded);
                let a = self.mem.alloc_f32(Category::Grads, buf.capacity(), &what)?;
                (true, (Some(a), buf))
            }
            None => (true, (None, std::mem::take(&mut self.state.grads[u]))),
        };
        // The unit's first backward call writes the gradients (no zeroing pass over the
        // buffer first); only the padding, which no layer writes, is cleared.
        if first_use {
            gfull[numel..].fill(0.0);
        }
        // The kept shard's buffer receives the reduce-scatter's result (taken before the
        // parameters are borrowed).
        let kept_shard = (last_use && self.takes_kept_shard(add))
            .then(|| std::mem::take(&mut self.state.grads[u]));
        let params: &[f32] = match &gathered {
            Some(g) => &g.full[..numel],
            None => &self.state.params[u][..numel],
        };
        let saved = match kept {
            Kept::State(s) => s,
            Kept::Input(cp) => self.recompute_call((call, u), params, cp, pass, st)?,
        };
        let t0 = Instant::now();
        let ctx = pass.ctx(&*self.backend, first_use);
        // ENG-9: the first call's input gradient (of the data) is never computed; where a
        // unit starts with a linear layer its input gradient is computed after the unit's
        // gradients have gone to their reduction, which it then overlaps.
        let b = CallBackward {
            params,
            saved,
            grad_output: grad,
            grads_out: &mut gfull[..numel],
            input_grad: call > 0,
        };
        let input_grad = self.model.backward_call(call, b, &ctx)?;
        let t1 = Instant::now();
        st.compute += t1 - t0;
        let label = &self.labels[u];
        self.trace.record(self.rank, Row::Compute, format!("backward {label}"), t0, t1);
        if last_use {
            // Reduce as soon as the unit's gradients exist; do not wait (overlap).
            self.issue_reduction(reds, u, (gfull, galloc), add, kept_shard)?;
        } else {
            self.partial_grads[u] = Some((galloc, gfull));
        }
        let deferred = input_grad.is_deferred();
        let t0 = Instant::now();
        let grad = input_grad.finish(&*self.backend, params)?.unwrap_or_default();
        if deferred {
            let t1 = Instant::now();
            st.compute += t1 - t0;
            self.trace.record(self.rank, Row::Compute, format!("input grad {label}"), t0, t1);
        }
        self.done_with(i, gathered, st)?;
        self.meter.check()?;
        Ok(grad)
    }
}
