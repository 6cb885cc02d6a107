//! `--stage auto` over (stage, shard group, wire dtypes) candidates: which one a job runs.
//!
//! Without a machine profile `--stage auto` chooses the stage alone, as it always has: the
//! lowest whose estimated memory per rank (model state and one microbatch's measured
//! activations) fits `--device-memory`. With `--profile` it also chooses the shard group
//! (HSDP, `--shard-group`) and, with `--allow-lossy-comm`, 8-bit gathers and an 8-bit
//! reduction across shard groups: each candidate's memory is the stage's estimate in a world
//! of the group's size (HSDP-2), its communication the profile's time for the collectives
//! of one step ([`estimate`]), and the choice the least communication within the cap.
//!
//! The pure core is [`choose`]: from the candidates' figures, the cap and whether lossy
//! wires are allowed, to the index of the one the job runs. Without `--profile` nothing is
//! priced and `train::choose_stage` keeps today's rule.
//!
//! Invariants:
//! - AUTO-1: a lossy candidate (a gather or cross-group reduction in 8 bits the user did not
//!   ask for) is chosen only when lossy communication is allowed.
//! - AUTO-2: the chosen candidate's memory is within the cap; when none is, none is chosen.
//! - AUTO-3: the choice has the least predicted communication, to the nanosecond, among the
//!   eligible (lossless unless allowed, within the cap); ties (candidates that send the same
//!   bytes over other group shapes price alike but for rounding) go to less memory, then the
//!   lower stage, then the larger group, then the lossless wire.
//! - AUTO-4: a candidate's memory at group size `g` is the estimate of a world of `g`: a rank
//!   holds the shards of its index in its group (HSDP-2).
//! - AUTO-5: on one node no candidate's price reads the transport across nodes, and a shard
//!   group inside a node gathers and reduce-scatters on the transport inside nodes only.

pub mod estimate;

use serde::Serialize;

use crate::engine::GatherDtype;
use crate::memory::format_bytes;
use crate::shard::Stage;

/// One (stage, shard group, wire) configuration and its figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// ZeRO stage.
    pub stage: Stage,
    /// Ranks of a shard group (the world: plain sharding).
    pub group: usize,
    /// Whether the group is the ranks of one node (printed as `node`).
    pub is_node: bool,
    /// 8-bit parameter gathers.
    pub gather: Option<GatherDtype>,
    /// 8-bit reduction across shard groups.
    pub cross: Option<GatherDtype>,
    /// Whether it uses an 8-bit wire the user did not ask for (AUTO-1).
    pub lossy: bool,
    /// Estimated peak bytes per rank.
    pub memory: u64,
    /// Predicted communication of one step, seconds.
    pub comm_s: f64,
}

impl Candidate {
    /// `stage 3, group node (2 ranks), gathers int8, cross-group reduce f32`.
    pub fn label(&self, world: usize) -> String {
        let group = match (self.group == world, self.is_node) {
            (true, _) => format!("world ({world} ranks)"),
            (false, true) => format!("node ({} ranks)", self.group),
            (false, false) => format!("{} ranks", self.group),
        };
        let gather = self.gather.map_or("f32", |d| d.name());
        let mut s = format!("stage {}, group {group}, gathers {gather}", self.stage.index());
        if self.group < world && self.stage != Stage::Zero0 {
            s.push_str(&format!(", cross-group reduce {}", self.cross.map_or("f32", |d| d.name())));
        }
        s
    }

    /// The line `--stage auto` prints for it.
    pub fn line(&self, world: usize, cap: Option<u64>) -> String {
        let over = match cap {
            Some(c) if self.memory > c => " (over the cap)",
            _ => "",
        };
        let lossy = if self.lossy { " [lossy]" } else { "" };
        format!(
            "  {}: ~{} per rank, communication ~{:.1} us per step{over}{lossy}",
            self.label(world),
            format_bytes(self.memory),
            self.comm_s * 1e6
        )
    }
}

/// Seconds as whole nanoseconds: the resolution at which predictions are compared.
fn ns(s: f64) -> u64 {
    (s * 1e9).round() as u64
}

/// The candidate a job runs (AUTO-1..3): among those lossless (or any, with `lossy_ok`) and
/// within `cap`, the least predicted communication; ties: less memory, lower stage, larger
/// group, lossless.
pub fn choose(cands: &[Candidate], cap: Option<u64>, lossy_ok: bool) -> Option<usize> {
    let eligible = |c: &&Candidate| (lossy_ok || !c.lossy) && cap.is_none_or(|m| c.memory <= m);
    cands
        .iter()
        .enumerate()
        .filter(|(_, c)| eligible(c))
        .min_by(|(_, a), (_, b)| {
            ns(a.comm_s)
                .cmp(&ns(b.comm_s))
                .then(a.memory.cmp(&b.memory))
                .then(a.stage.cmp(&b.stage))
                .then(b.group.cmp(&a.group))
                .then(a.lossy.cmp(&b.lossy))
        })
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(stage: u8, group: usize, lossy: bool, memory: u64, comm: f64) -> Candidate {
        Candidate {
            stage: Stage::from_index(stage).unwrap(),
            group,
            is_node: false,
            gather: lossy.then_some(GatherDtype::Int8),
            cross: None,
            lossy,
            memory,
            comm_s: comm,
        }
    }

    /// AUTO-1: the fastest candidate is lossy; without the opt-in the lossless one is chosen.
    #[test]
    fn lossy_only_with_the_opt_in_auto_1() {
        let c = vec![cand(3, 4, false, 100, 2.0), cand(3, 4, true, 100, 1.0)];
        assert_eq!(choose(&c, None, false), Some(0));
        assert_eq!(choose(&c, None, true), Some(1));
        // Only lossy candidates: nothing without the opt-in.
        assert_eq!(choose(&c[1..], None, false), None);
    }

    /// AUTO-2: over the cap is never chosen, however fast; none within it, none chosen.
    #[test]
    fn never_over_the_cap_auto_2() {
        let c = vec![
            cand(0, 4, false, 900, 0.1),
            cand(3, 2, false, 500, 0.5),
            cand(3, 4, false, 300, 1.0),
        ];
        assert_eq!(choose(&c, Some(1000), false), Some(0));
        assert_eq!(choose(&c, Some(600), false), Some(1));
        assert_eq!(choose(&c, Some(300), false), Some(2));
        assert_eq!(choose(&c, Some(299), false), None);
        for cap in [299, 300, 500, 600, 900, 1000] {
            if let Some(i) = choose(&c, Some(cap), true) {
                assert!(c[i].memory <= cap, "cap {cap}: {:?}", c[i]);
            }
        }
    }

    /// AUTO-3: least communication first; ties by memory, then stage, then the larger group.
    #[test]
    fn least_communication_then_memory_stage_group_auto_3() {
        let c = vec![
            cand(2, 4, false, 700, 1.0),
            cand(3, 2, false, 600, 1.0),
            cand(3, 4, false, 400, 3.0),
        ];
        assert_eq!(choose(&c, None, false), Some(1), "equal time: the smaller memory");
        let tie = vec![cand(3, 2, false, 500, 1.0), cand(3, 4, false, 500, 1.0)];
        assert_eq!(choose(&tie, None, false), Some(1), "equal time and memory: the larger group");
        let stages = vec![cand(3, 4, false, 500, 1.0), cand(2, 4, false, 500, 1.0)];
        assert_eq!(choose(&stages, None, false), Some(1), "then the lower stage");
        // Below a nanosecond apart is a tie: the smaller memory wins.
        let close = vec![cand(2, 2, false, 600, 1e-5), cand(2, 4, false, 500, 1e-5 + 1e-13)];
        assert_eq!(choose(&close, None, false), Some(1), "a tie to the nanosecond");
    }
}
