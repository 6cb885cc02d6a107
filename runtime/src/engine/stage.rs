//! The ZeRO stage rules, one table per stage ([`StageRules`]): what a rank holds between
//! steps, what is gathered before a unit is used, how its gradients are reduced, what the
//! optimizer steps, and what is gathered after the update. The tables are data and
//! [`StageRules::update_unit`] a pure function of the slices it is given: no collectives, no
//! clock. The engine reads the rules wherever the stages differ, so the schedule itself has
//! no per-stage branches.
//!
//! | stage | params | grads | optimizer state | before use | reduction | steps | after update |
//! |---|---|---|---|---|---|---|---|
//! | 0 | full | full | full | resident | all-reduce | the whole unit, on every rank | nothing |
//! | 1 | full | full | shard | resident | reduce-scatter in place | the own range | all-gather |
//! | 2 | full | shard | shard | resident | reduce-scatter | the own range | all-gather |
//! | 3 | shard | shard | shard | gather (ENG-5) | reduce-scatter | the shard | nothing |

use std::ops::Range;

use crate::error::Result;
use crate::optim::{self, Optimizer};
use crate::shard::{FlatLayout, Stage};

/// How much of a unit's flat buffer a rank keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holding {
    /// The whole padded buffer.
    Full,
    /// This rank's shard only.
    Shard,
}

impl Holding {
    /// Elements a rank keeps of `unit`'s buffer.
    pub(crate) fn len(self, unit: &FlatLayout) -> usize {
        match self {
            Holding::Full => unit.padded_numel(),
            Holding::Shard => unit.shard_len(),
        }
    }
}

/// Where a unit's parameters come from for its forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BeforeUse {
    /// The full parameters the rank keeps.
    Resident,
    /// All-gathered from the shards before the use, freed after (the prefetch plan).
    Gather,
}

/// How a unit's gradients are reduced once its backward has produced them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GradReduce {
    /// All-reduce of the persistent full gradient buffer: every rank gets the whole sum.
    AllReduce,
    /// Reduce-scatter in place of the persistent full buffer: the own range holds the result.
    ReduceScatterInPlace,
    /// Reduce-scatter of a transient full gradient (freed when done) into the own shard.
    ReduceScatter,
}

/// Which part of a buffer a rule means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Region {
    /// All of the buffer the rank keeps.
    Whole,
    /// This rank's shard range of a full buffer.
    Own,
}

impl Region {
    fn of<'a>(self, buf: &'a [f32], own: &Range<usize>) -> &'a [f32] {
        match self {
            Region::Whole => buf,
            Region::Own => &buf[own.clone()],
        }
    }
    /// The elements [`Region::of`] takes of a buffer of `len`.
    fn range(self, len: usize, own: &Range<usize>) -> Range<usize> {
        match self {
            Region::Whole => 0..len,
            Region::Own => own.clone(),
        }
    }

    fn of_mut<'a>(self, buf: &'a mut [f32], own: &Range<usize>) -> &'a mut [f32] {
        match self {
            Region::Whole => buf,
            Region::Own => &mut buf[own.clone()],
        }
    }
}

/// One optimizer step's settings, the same for every unit of a step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Update<'a> {
    /// The optimizer.
    pub(crate) opt: &'a Optimizer,
    /// Learning rate.
    pub(crate) lr: f32,
    /// The optimizer's step count, 1-based (OPT-3).
    pub(crate) step: u64,
    /// Gradient scale (clipping); 1 leaves the gradients as they are.
    pub(crate) coef: f32,
}

/// One unit's update as ranges ([`StageRules::update_ranges`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UpdateRanges {
    /// The parameters stepped.
    pub(crate) params: Range<usize>,
    /// The gradients read (and scaled by clipping).
    pub(crate) grads: Range<usize>,
    /// `(start, end, decayed)` runs of the stepped range, relative to it.
    pub(crate) runs: Vec<(usize, usize, bool)>,
    /// The gradients the squared norm counts.
    pub(crate) norm: Range<usize>,
}

/// The rules of one ZeRO stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StageRules {
    /// The stage.
    pub(crate) stage: Stage,
    /// Parameters kept between steps.
    pub(crate) params: Holding,
    /// The persistent gradient buffer (a full one is also what backward writes and the
    /// collective reduces in place; with a shard, backward writes a transient full buffer).
    pub(crate) grads: Holding,
    /// Optimizer state kept.
    pub(crate) optim_state: Holding,
    /// Where forward and backward find a unit's parameters.
    pub(crate) before_use: BeforeUse,
    /// How a unit's gradients are reduced.
    pub(crate) reduce: GradReduce,
    /// The part of the kept parameters the optimizer steps.
    pub(crate) step_params: Region,
    /// The part of the kept gradients the optimizer reads.
    pub(crate) step_grads: Region,
    /// Every rank steps the whole replicated unit (stage 0); the squared norm then counts
    /// only the own range, so that each element is counted once over the group.
    pub(crate) replicated_update: bool,
    /// This rank's own reduced gradient slice: what its norm counts.
    pub(crate) own_grads: Region,
    /// The updated parameters are all-gathered after the step (the own range was stepped).
    pub(crate) gather_after_update: bool,
}

const ZERO0: StageRules = StageRules {
    stage: Stage::Zero0,
    params: Holding::Full,
    grads: Holding::Full,
    optim_state: Holding::Full,
    before_use: BeforeUse::Resident,
    reduce: GradReduce::AllReduce,
    step_params: Region::Whole,
    step_grads: Region::Whole,
    replicated_update: true,
    own_grads: Region::Own,
    gather_after_update: false,
};

const ZERO1: StageRules = StageRules {
    stage: Stage::Zero1,
    optim_state: Holding::Shard,
    reduce: GradReduce::ReduceScatterInPlace,
    step_params: Region::Own,
    step_grads: Region::Own,
    replicated_update: false,
    gather_after_update: true,
    ..ZERO0
};

const ZERO2: StageRules = StageRules {
    stage: Stage::Zero2,
    grads: Holding::Shard,
    reduce: GradReduce::ReduceScatter,
    step_grads: Region::Whole,
    own_grads: Region::Whole,
    ..ZERO1
};

const ZERO3: StageRules = StageRules {
    stage: Stage::Zero3,
    params: Holding::Shard,
    before_use: BeforeUse::Gather,
    step_params: Region::Whole,
    gather_after_update: false,
    ..ZERO2
};

impl StageRules {
    /// The rules of `stage`.
    pub(crate) fn of(stage: Stage) -> &'static StageRules {
        match stage {
            Stage::Zero0 => &ZERO0,
            Stage::Zero1 => &ZERO1,
            Stage::Zero2 => &ZERO2,
            Stage::Zero3 => &ZERO3,
        }
    }

    /// Whether a unit's full gradients live in a transient buffer until their reduction is
    /// done, counted against the reduce budget (ENG-7).
    pub(crate) fn transient_grads(&self) -> bool {
        self.grads == Holding::Shard
    }

    /// This rank's reduced gradient slice of a unit whose kept gradients are `grads` and
    /// whose own range is `own`.
    pub(crate) fn own_grads<'a>(&self, grads: &'a [f32], own: &Range<usize>) -> &'a [f32] {
        self.own_grads.of(grads, own)
    }

    /// [`StageRules::update_unit`] as ranges of the buffers a rank keeps of a unit (`params`
    /// and `grads` elements long), for a device to run as ops: the stepped parameters and
    /// the gradients read (also what clipping scales), the runs of the stepped range with
    /// and without weight decay (relative to it, as `optim::Groups` splits it), and the
    /// gradients the squared norm counts.
    pub(crate) fn update_ranges(
        &self,
        own: &Range<usize>,
        no_decay: &[Range<usize>],
        (params, grads): (usize, usize),
    ) -> UpdateRanges {
        let p = self.step_params.range(params, own);
        let offset = match (self.params, self.step_params) {
            (Holding::Full, Region::Whole) => 0,
            _ => own.start,
        };
        let g = self.step_grads.range(grads, own);
        let runs = optim::decay_runs(offset, p.len(), no_decay);
        let norm =
            if self.replicated_update { self.own_grads.range(grads, own) } else { g.clone() };
        UpdateRanges { params: p, grads: g, runs, norm }
    }

    /// One unit's optimizer update on this rank: scales the gradients it reads by
    /// `update.coef` (unless 1), steps the parameters the stage steps, and returns the squared
    /// norm of the rank's own gradient slice after scaling, taken in the update's pass where
    /// the update reads just that slice (OPT-4). `params`, `grads` and `state` are what the
    /// rank keeps of the unit, `own` its shard range, `no_decay` the unit's elements that get
    /// no weight decay (OPT-5).
    pub(crate) fn update_unit(
        &self,
        update: &Update<'_>,
        own: &Range<usize>,
        no_decay: &[Range<usize>],
        params: &mut [f32],
        grads: &mut [f32],
        state: &mut [f32],
    ) -> Result<f64> {
        let Update { opt, lr, step, coef } = *update;
        let p = self.step_params.of_mut(params, own);
        let g = self.step_grads.of_mut(grads, own);
        if coef != 1.0 {
            optim::scale(g, coef);
        }
        // Where the stepped slice starts in the unit: the whole unit, or this rank's shard
        // (kept alone, or cut from the full buffer).
        let offset = match (self.params, self.step_params) {
            (Holding::Full, Region::Whole) => 0,
            _ => own.start,
        };
        let groups = optim::Groups { offset, no_decay };
        if self.replicated_update {
            opt.step_groups(lr, step, (p, g, state), groups, false)?;
            Ok(optim::sq_norm(self.own_grads(grads, own)))
        } else {
            opt.step_groups(lr, step, (p, g, state), groups, true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::GradReduction;
    use shardline_models::ParamSpec;

    /// The tables say what the stage predicates of [`Stage`] say.
    #[test]
    fn the_tables_agree_with_the_stage_predicates() {
        for stage in Stage::ALL {
            let r = StageRules::of(stage);
            assert_eq!(r.stage, stage);
            assert_eq!(r.params == Holding::Full, stage.keeps_full_params(), "{stage:?}");
            assert_eq!(r.before_use == BeforeUse::Gather, stage.gathers_params_per_unit());
            assert_eq!(r.grads == Holding::Full, stage.keeps_full_grads(), "{stage:?}");
            assert_eq!(r.transient_grads(), stage.grads_sharded(), "{stage:?}");
            assert_eq!(r.optim_state == Holding::Shard, stage.optimizer_sharded(), "{stage:?}");
            assert_eq!(r.gather_after_update, stage.all_gathers_after_step(), "{stage:?}");
            assert_eq!(
                r.reduce == GradReduce::AllReduce,
                stage.grad_reduction() == GradReduction::AllReduce,
                "{stage:?}"
            );
            // Only a full gradient buffer is reduced in place; a full parameter copy is
            // all-gathered after the update exactly when only the own range was stepped.
            assert_eq!(r.reduce == GradReduce::ReduceScatter, r.grads == Holding::Shard);
            assert_eq!(
                r.gather_after_update,
                r.params == Holding::Full && r.step_params == Region::Own
            );
        }
    }

    /// Every stage steps each element of a unit exactly as stage 0 does (bitwise: the
    /// optimizer is elementwise), and the ranks' squared norms add up to the whole gradient's
    /// (each element counted once over the group; ENG-2's norm). With a no-decay range that
    /// crosses shard boundaries too: each rank places its slice in the unit (OPT-5).
    #[test]
    fn every_stage_updates_its_range_as_stage_zero_and_counts_each_element_once() {
        let world = 3;
        let spec = [ParamSpec { name: "w".into(), shape: vec![10] }];
        let unit = FlatLayout::from_params("u", &spec, world).unwrap();
        let n = unit.padded_numel();
        let p0: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
        let g0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).sin()).collect();
        let opt =
            Optimizer::AdamW(crate::optim::AdamWConfig { weight_decay: 0.5, ..Default::default() });
        let k = opt.state_len_per_param();
        let (lr, coef) = (0.01, 0.5);
        for no_decay in [vec![], vec![3..7, 9..10]] {
            // Stage 0 on one rank: the reference update.
            let update = Update { opt: &opt, lr, step: 1, coef };
            let (mut want_p, mut want_g, mut st) = (p0.clone(), g0.clone(), vec![0.0; n * k]);
            let full_sq = ZERO0
                .update_unit(&update, &(0..n), &no_decay, &mut want_p, &mut want_g, &mut st)
                .unwrap();
            for stage in Stage::ALL {
                let r = StageRules::of(stage);
                let mut sq = 0.0;
                for rank in 0..world {
                    let own = unit.shard_range(rank);
                    let keep = |h: Holding, v: &[f32]| match h {
                        Holding::Full => v.to_vec(),
                        Holding::Shard => v[own.clone()].to_vec(),
                    };
                    let (mut p, mut g) = (keep(r.params, &p0), keep(r.grads, &g0));
                    let mut st = vec![0.0; r.optim_state.len(&unit) * k];
                    sq += r.update_unit(&update, &own, &no_decay, &mut p, &mut g, &mut st).unwrap();
                    let mine = if r.params == Holding::Full { &p[own.clone()] } else { &p[..] };
                    assert!(
                        mine.iter()
                            .zip(&want_p[own.clone()])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{stage:?} rank {rank} no-decay {no_decay:?}"
                    );
                }
                assert!((sq - full_sq).abs() <= 1e-12 * full_sq, "{stage:?}: {sq} vs {full_sq}");
            }
        }
    }
}
