//! `shardline plan --search`: every configuration of one model and global batch that the
//! engine can run, predicted, those over the per-rank memory cap dropped, the rest ranked by
//! predicted throughput.
//!
//! A configuration is a placement (nodes x ranks per node, from the worlds the caller
//! gives), a stage (0-3), a prefetch depth (0-2, at stage 3 only: the other stages gather
//! nothing ahead), a recompute choice (none, units) and a number of microbatches that divides
//! each rank's share of the global batch (`--grad-accum`, ACC-1). The global batch never
//! changes, so the fastest step is the highest throughput.
//!
//! Invariant:
//! - PLAN-10: every configuration enumerated keeps the global batch (world x microbatch x
//!   microbatches), and the ranking holds only those within the cap, fastest first (ties:
//!   the smaller peak first).

use serde::Serialize;

use crate::engine::Recompute;
use crate::error::Result;
use crate::shard::Stage;
use crate::train::{StageChoice, TrainConfig};

use super::profile::Profile;
use super::{ActivationSource, Placement, Prediction};

/// One configuration of a job.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Choice {
    /// Nodes.
    pub nodes: usize,
    /// Ranks per node.
    pub ranks_per_node: usize,
    /// ZeRO stage.
    pub stage: u8,
    /// Units gathered ahead (stage 3).
    pub prefetch: usize,
    /// `none` or `units`.
    pub recompute: String,
    /// Microbatches per step.
    pub grad_accum: usize,
}

impl Choice {
    /// Ranks in all.
    pub fn world(&self) -> usize {
        self.nodes * self.ranks_per_node
    }
}

/// A configuration and what the plan predicts for it.
#[derive(Clone, Debug, Serialize)]
pub struct Ranked {
    /// The configuration.
    pub choice: Choice,
    /// Peak bytes per rank (the bound, PLAN-6).
    pub peak_bytes: u64,
    /// Predicted steady step, seconds.
    pub step_s: f64,
    /// Compute on the rank's thread.
    pub compute_s: f64,
    /// Communication the rank waited for.
    pub exposed_s: f64,
    /// Samples per second of the whole job.
    pub samples_per_s: f64,
    /// Tokens per second (`gpt`).
    pub tokens_per_s: Option<f64>,
    /// Where the activations came from.
    pub activations_from: String,
}

/// Every configuration of `batch` samples over `worlds` (PLAN-10): stages 0-3, prefetch
/// 0-2 at stage 3, recompute none and units, each microbatch count dividing a rank's
/// share; a world that does not divide the batch is skipped.
pub fn enumerate(worlds: &[(usize, usize)], batch: usize) -> Vec<Choice> {
    let mut out = Vec::new();
    for &(nodes, per_node) in worlds {
        let world = nodes * per_node;
        if world == 0 || !batch.is_multiple_of(world) {
            continue;
        }
        let share = batch / world;
        for stage in 0..=3u8 {
            let prefetches: &[usize] = if stage == 3 { &[0, 1, 2] } else { &[1] };
            for &prefetch in prefetches {
                for recompute in ["none", "units"] {
                    for accum in (1..=share).filter(|a| share.is_multiple_of(*a)) {
                        out.push(Choice {
                            nodes,
                            ranks_per_node: per_node,
                            stage,
                            prefetch,
                            recompute: recompute.into(),
                            grad_accum: accum,
                        });
                    }
                }
            }
        }
    }
    out
}

/// The configurations within `cap` bytes per rank, fastest first, ties by the smaller peak
/// (PLAN-10).
pub fn rank(mut all: Vec<Ranked>, cap: Option<u64>) -> Vec<Ranked> {
    all.retain(|r| cap.is_none_or(|c| r.peak_bytes <= c));
    all.sort_by(|a, b| {
        b.samples_per_s.total_cmp(&a.samples_per_s).then(a.peak_bytes.cmp(&b.peak_bytes))
    });
    all
}

/// `base` set to `choice`.
pub fn config_of(base: &TrainConfig, c: &Choice) -> Result<TrainConfig> {
    Ok(TrainConfig {
        world: c.world(),
        stage: StageChoice::Fixed(Stage::from_index(c.stage)?),
        prefetch: c.prefetch,
        recompute: if c.recompute == "units" { Recompute::Units } else { Recompute::None },
        grad_accum: c.grad_accum,
        // Each stage's own default (stages 0 and 1 refuse an explicit policy).
        accum_reduce: None,
        ..base.clone()
    })
}

/// What a search found: every configuration predicted, those within the cap ranked.
#[derive(Clone, Debug, Serialize)]
pub struct Search {
    /// Configurations predicted.
    pub evaluated: usize,
    /// Configurations train's own checks refused.
    pub refused: usize,
    /// Why the first of them was refused.
    pub first_refusal: Option<String>,
    /// The per-rank cap, bytes.
    pub cap_bytes: Option<u64>,
    /// Within the cap, fastest first.
    pub ranked: Vec<Ranked>,
}

/// Predicts every configuration of `base` over `worlds` and ranks those within `cap`;
/// `transport` gives the profile's transport of a placement.
pub fn search(
    base: &TrainConfig,
    worlds: &[(usize, usize)],
    profile: &Profile,
    cap: Option<u64>,
    transport: &dyn Fn(usize) -> String,
    source: ActivationSource,
) -> Result<Search> {
    let choices = enumerate(worlds, base.batch_size);
    let mut all = Vec::with_capacity(choices.len());
    let (mut refused, mut first_refusal) = (0, None);
    let mut probes = super::Probes::default();
    for c in &choices {
        let cfg = config_of(base, c)?;
        let at = Placement {
            nodes: c.nodes,
            ranks_per_node: c.ranks_per_node,
            transport: transport(c.nodes),
        };
        // A configuration train's own checks refuse (a microbatch too small for BatchNorm,
        // say) is not a candidate; it is counted, and the first reason kept.
        let predicted = crate::train::plan(&cfg).and_then(|job| {
            super::predict_probed(&cfg, &job, &at, Some(profile), source, &mut probes)
        });
        let p: Prediction = match predicted {
            Ok(p) => p,
            Err(e) => {
                refused += 1;
                first_refusal.get_or_insert(e);
                continue;
            }
        };
        let Some(s) = p.step else {
            return Err(super::flag_error(
                "--search",
                format!("no step time to rank by: {}", p.no_step.unwrap_or_default()),
            ));
        };
        all.push(Ranked {
            choice: c.clone(),
            peak_bytes: p.peak_bytes,
            step_s: s.step_s,
            compute_s: s.compute_s,
            exposed_s: s.exposed_s,
            samples_per_s: s.samples_per_s,
            tokens_per_s: s.tokens_per_s,
            activations_from: p.activations_from,
        });
    }
    match (all.is_empty(), first_refusal) {
        (true, Some(e)) => Err(e),
        (_, why) => Ok(Search {
            evaluated: all.len(),
            refused,
            first_refusal: why.map(|e| e.to_string()),
            cap_bytes: cap,
            ranked: rank(all, cap),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PLAN-10: every configuration keeps the global batch; prefetch varies only at stage 3;
    /// a world that does not divide the batch is skipped.
    #[test]
    fn every_configuration_keeps_the_global_batch_plan_10() {
        let all = enumerate(&[(1, 2), (1, 3), (2, 2)], 16);
        assert!(all.iter().all(|c| c.world() != 3), "3 does not divide 16");
        for c in &all {
            let micro = 16 / c.world() / c.grad_accum;
            assert_eq!(c.world() * micro * c.grad_accum, 16, "{c:?}");
            assert!(c.stage == 3 || c.prefetch == 1, "{c:?}");
        }
        // World 2: 8 each, accum 1, 2, 4, 8; (3 stages + 3 prefetches) x 2 recomputes.
        assert_eq!(all.iter().filter(|c| c.world() == 2).count(), 4 * 6 * 2);
        assert_eq!(all.iter().filter(|c| c.nodes == 2).count(), 3 * 6 * 2);
    }

    fn ranked(samples_per_s: f64, peak_bytes: u64) -> Ranked {
        Ranked {
            choice: enumerate(&[(1, 1)], 1)[0].clone(),
            peak_bytes,
            step_s: 1.0 / samples_per_s,
            compute_s: 0.0,
            exposed_s: 0.0,
            samples_per_s,
            tokens_per_s: None,
            activations_from: "probe".into(),
        }
    }

    /// PLAN-10: over the cap is dropped; fastest first; equal speed, the smaller peak first.
    #[test]
    fn the_ranking_is_fastest_first_within_the_cap_plan_10() {
        let all = vec![ranked(10.0, 500), ranked(30.0, 900), ranked(20.0, 300), ranked(20.0, 100)];
        let r = rank(all.clone(), Some(600));
        let got: Vec<(f64, u64)> = r.iter().map(|r| (r.samples_per_s, r.peak_bytes)).collect();
        assert_eq!(got, vec![(20.0, 100), (20.0, 300), (10.0, 500)]);
        assert_eq!(rank(all, None)[0].samples_per_s, 30.0);
    }
}
