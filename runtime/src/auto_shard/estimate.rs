//! The candidates of a job and their figures: memory per rank as `--stage auto` estimates it
//! at each group size (AUTO-4), and one step's communication priced on a machine profile's
//! collectives (AUTO-5), inside nodes and across them as the group's ranks sit.
//!
//! What a step's communication is: per unit, the parameter all-gathers (stage 3: one per
//! call of the unit forward and one backward; stages 1 and 2: one after the update), the
//! gradient reduction (stage 0: an all-reduce over the world; stages 1-3: a reduce-scatter
//! over the shard group, then, under HSDP, the reduced shard's all-reduce over the replica
//! group, or its packed all-gather with an 8-bit cross-group reduction), each at the
//! profile's time for its bytes ([`Profile::collective_s`], and
//! [`Profile::hierarchical_s`] for a group spanning nodes). Lane time, not exposed time:
//! how much of it compute hides is `shardline plan`'s simulator's to say, and it models
//! neither groups nor 8-bit wires. Not priced: the loss all-reduce and SyncBN statistics
//! (the same for every candidate), a unit kept between uses, and microbatches beyond the
//! first.

use super::{choose, Candidate};
use crate::engine::{GatherDtype, PrecisionDtype, ShardGroup};
use crate::error::{Result, RuntimeError};
use crate::memory::format_bytes;
use crate::plan::profile::Profile;
use crate::shard::{ShardedModelLayout, Stage};
use crate::train::{StageChoice, TrainConfig};
use shardline_models::{Dataset, Network};

/// Nodes and ranks per node of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nodes {
    /// Nodes.
    pub nodes: usize,
    /// Ranks on each.
    pub per_node: usize,
}

impl Nodes {
    /// The placement of `cfg`'s world: `cfg.ranks_per_node` ranks per node (a launched job
    /// sets it), else one node; nodes of unequal size are refused.
    pub fn of(cfg: &TrainConfig) -> Result<Nodes> {
        let per = cfg.ranks_per_node.unwrap_or(cfg.world).clamp(1, cfg.world.max(1));
        if !cfg.world.is_multiple_of(per) {
            return Err(RuntimeError::config(format!(
                "--stage auto --profile prices nodes of equal size: {} ranks do not split into \
                 nodes of {per}",
                cfg.world
            )));
        }
        Ok(Nodes { nodes: cfg.world / per, per_node: per })
    }

    fn world(&self) -> usize {
        self.nodes * self.per_node
    }
}

/// A profile's collectives over the transports inside and across nodes.
pub struct Pricer<'a> {
    /// The profile.
    pub profile: &'a Profile,
    /// Transport inside a node.
    pub intra: &'a str,
    /// Transport across nodes.
    pub inter: &'a str,
    /// Where the ranks sit.
    pub at: Nodes,
}

impl Pricer<'_> {
    /// Seconds of `op` on `bytes` over a shard group of `g` consecutive ranks; `None` when
    /// the group neither fits a node evenly nor covers whole nodes.
    pub fn group_s(&self, op: &str, g: usize, bytes: u64) -> Result<Option<f64>> {
        let per = self.at.per_node;
        Ok(if per.is_multiple_of(g) {
            Some(self.profile.collective_s(op, self.intra, g, bytes)?)
        } else if g.is_multiple_of(per) {
            Some(self.profile.hierarchical_s(
                op,
                (self.intra, self.inter),
                (g / per, per),
                bytes,
            )?)
        } else {
            None
        })
    }

    /// Seconds of `op` on `bytes` over a replica group of groups of `g` (ranks `r % g`
    /// apart by `g`): one rank per node when a group covers whole nodes, else `per_node / g`
    /// on every node.
    pub fn replica_s(&self, op: &str, g: usize, bytes: u64) -> Result<Option<f64>> {
        let (per, replicas) = (self.at.per_node, self.at.world() / g.max(1));
        Ok(if replicas <= 1 {
            Some(0.0)
        } else if g.is_multiple_of(per) {
            Some(self.profile.collective_s(op, self.inter, replicas, bytes)?)
        } else if per.is_multiple_of(g) {
            let pair = (self.intra, self.inter);
            Some(self.profile.hierarchical_s(op, pair, (self.at.nodes, per / g), bytes)?)
        } else {
            None
        })
    }
}

/// How a candidate's collectives are sent.
#[derive(Clone, Copy, Debug)]
pub struct Wire {
    /// Parameters gathered in bf16.
    pub bf16_params: bool,
    /// Gradients reduced in bf16.
    pub bf16_grads: bool,
    /// 8-bit gathers.
    pub gather: Option<GatherDtype>,
    /// 8-bit cross-group reduction.
    pub cross: Option<GatherDtype>,
    /// Values per scale of the 8-bit wires.
    pub block: usize,
}

/// One step's communication, seconds, of `stage` with shard groups of `g` (`layout`: the
/// model's layout in a world of `g`; `world`: in the whole world, for stage 0) and `uses[u]`
/// calls of unit `u` per forward pass; `None` when the group cannot be priced.
pub fn comm_s(
    price: &Pricer,
    (layout, world): (&ShardedModelLayout, &ShardedModelLayout),
    uses: &[usize],
    stage: Stage,
    wire: Wire,
) -> Result<Option<f64>> {
    let g = layout.world();
    let half = |bytes: u64, bf16: bool| if bf16 { bytes.div_ceil(2) } else { bytes };
    let mut total = 0.0;
    if stage == Stage::Zero0 {
        for u in world.units() {
            let bytes = half(u.padded_numel() as u64 * 4, wire.bf16_grads);
            let Some(s) = price.group_s("all-reduce", world.world(), bytes)? else {
                return Ok(None);
            };
            total += s;
        }
        return Ok(Some(total));
    }
    let packed = |n: usize| shardline_collectives::quant::words(n, wire.block) as u64 * 4;
    for (i, u) in layout.units().iter().enumerate() {
        let gathers = if stage == Stage::Zero3 { 2 * uses.get(i).copied().unwrap_or(1) } else { 1 };
        let gather_bytes = match wire.gather {
            Some(_) => packed(u.shard_len()) * g as u64,
            None => half(u.padded_numel() as u64 * 4, wire.bf16_params),
        };
        let reduce_bytes = half(u.padded_numel() as u64 * 4, wire.bf16_grads);
        let replicas = (price.at.world() / g.max(1)) as u64;
        let cross = match wire.cross {
            Some(_) => price.replica_s("all-gather", g, packed(u.shard_len()) * replicas)?,
            None => price.replica_s("all-reduce", g, u.shard_len() as u64 * 4)?,
        };
        let (Some(ag), Some(rs), Some(x)) = (
            price.group_s("all-gather", g, gather_bytes)?,
            price.group_s("reduce-scatter", g, reduce_bytes)?,
            cross,
        ) else {
            return Ok(None);
        };
        total += gathers as f64 * ag + rs + x;
    }
    Ok(Some(total))
}

/// The group sizes considered over `at`: every divisor of the world, largest first.
pub fn group_sizes(at: Nodes) -> Vec<usize> {
    let w = at.world();
    (1..=w).rev().filter(|g| w.is_multiple_of(*g)).collect()
}

/// The job's candidates and their figures; `act`: one microbatch's activations and scratch
/// per rank. Candidates `train::validate` refuses are left out, and so are groups the
/// profile cannot price, each said in the returned lines.
pub fn candidates(
    model: &dyn Network,
    cfg: &TrainConfig,
    act: u64,
    price: &Pricer,
) -> Result<(Vec<Candidate>, Vec<String>)> {
    let spec = model.spec();
    let calls = model.calls();
    let uses: Vec<usize> =
        (0..spec.units.len()).map(|u| calls.iter().filter(|c| **c == u).count()).collect();
    let world = ShardedModelLayout::new(&spec, cfg.world)?;
    let groups: Vec<usize> = match cfg.shard_group {
        ShardGroup::Auto => group_sizes(price.at),
        fixed => vec![fixed
            .size(&shardline_collectives::Topology::uniform(price.at.nodes, price.at.per_node))?],
    };
    let lossy_gather = cfg.allow_lossy_comm && cfg.gather_dtype.is_none();
    let gathers: Vec<Option<GatherDtype>> = match cfg.gather_dtype {
        Some(d) => vec![Some(d)],
        // 8-bit gathers dequantize into f32 parameters (QGATHER-1); int8 alone: fp8 sends
        // the same bytes.
        None if lossy_gather && cfg.param_dtype == PrecisionDtype::F32 => {
            vec![None, Some(GatherDtype::Int8)]
        }
        None => vec![None],
    };
    let (mut out, mut lines) = (Vec::new(), Vec::new());
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for &g in &groups {
            // HSDP-4: stage 0 replicates whatever the group.
            if stage == Stage::Zero0 && g != cfg.world && groups.contains(&cfg.world) {
                continue;
            }
            let crosses: Vec<Option<GatherDtype>> = match cfg.cross_node_reduce_dtype {
                Some(d) => vec![Some(d)],
                None if cfg.allow_lossy_comm && g < cfg.world && stage != Stage::Zero0 => {
                    vec![None, Some(GatherDtype::Int8)]
                }
                None => vec![None],
            };
            for &gather in &gathers {
                for &cross in &crosses {
                    let c = TrainConfig {
                        stage: StageChoice::Fixed(stage),
                        shard_group: group_of(g, cfg.world, price.at),
                        gather_dtype: gather,
                        cross_node_reduce_dtype: cross,
                        profile: None,
                        allow_lossy_comm: false,
                        ..cfg.clone()
                    };
                    if crate::train::validate(&c).is_err() {
                        continue;
                    }
                    // AUTO-4: a rank holds the shards of a world of `g`.
                    let at_g = TrainConfig { world: g, ..c.clone() };
                    let memory = crate::train::stage_estimates(model, &at_g)?
                        .into_iter()
                        .find(|(s, _)| *s == stage)
                        .map_or(0, |(_, b)| b)
                        + act;
                    let layout = ShardedModelLayout::new(&spec, g)?;
                    let prec = c.precision();
                    let wire = Wire {
                        bf16_params: prec.param_dtype == PrecisionDtype::Bf16,
                        bf16_grads: prec.bf16_grads(),
                        gather,
                        cross,
                        block: cfg.gather_block,
                    };
                    let comm = comm_s(price, (&layout, &world), &uses, stage, wire)
                        .map_err(|e| RuntimeError::config(format!("--profile: {e}")))?;
                    let Some(comm_s) = comm else {
                        lines.push(format!(
                            "  groups of {g} ranks: not priced (neither inside a node of {} nor \
                             whole nodes)",
                            price.at.per_node
                        ));
                        continue;
                    };
                    out.push(Candidate {
                        stage,
                        group: g,
                        is_node: matches!(c.shard_group, ShardGroup::Node),
                        gather,
                        cross,
                        lossy: gather != cfg.gather_dtype || cross != cfg.cross_node_reduce_dtype,
                        memory,
                        comm_s,
                    });
                }
            }
        }
    }
    lines.dedup();
    Ok((out, lines))
}

/// `g` ranks as a `--shard-group`: the world, a node's ranks, or a count.
fn group_of(g: usize, world: usize, at: Nodes) -> ShardGroup {
    if g == world {
        ShardGroup::World
    } else if g == at.per_node {
        ShardGroup::Node
    } else {
        ShardGroup::Ranks(g)
    }
}

/// What `--stage auto --profile` chose.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// The stage.
    pub stage: Stage,
    /// The shard group.
    pub shard_group: ShardGroup,
    /// 8-bit gathers.
    pub gather_dtype: Option<GatherDtype>,
    /// 8-bit cross-group reduction.
    pub cross_node_reduce_dtype: Option<GatherDtype>,
}

impl Resolved {
    /// `cfg` with the choice made (a fixed stage, group and wires).
    pub fn apply(&self, cfg: &TrainConfig) -> TrainConfig {
        TrainConfig {
            stage: StageChoice::Fixed(self.stage),
            shard_group: self.shard_group,
            gather_dtype: self.gather_dtype,
            cross_node_reduce_dtype: self.cross_node_reduce_dtype,
            ..cfg.clone()
        }
    }
}

/// Resolves `--stage auto` with `--profile` (AUTO-1..5): the candidates, a line each, and the
/// choice; `None` without a profile (`train::choose_stage` decides, as before).
pub fn resolve(
    model: &dyn Network,
    cfg: &TrainConfig,
    train: &Dataset,
) -> Result<Option<(Resolved, Vec<String>)>> {
    let (StageChoice::Auto, Some(name)) = (cfg.stage, cfg.profile.as_deref()) else {
        return Ok(None);
    };
    let profile = Profile::load_named(name)?;
    let Some((intra, inter)) = profile.transports_default.clone() else {
        return Err(RuntimeError::config(format!(
            "--profile {name}: has no transports_default (the transports inside and across \
             nodes) to price the shard groups on"
        )));
    };
    let at = Nodes::of(cfg)?;
    let price = Pricer { profile: &profile, intra: &intra, inter: &inter, at };
    let act = crate::activations::activation_peak(model, train, cfg)?;
    let (cands, notes) = candidates(model, cfg, act, &price)?;
    let mut lines = vec![format!(
        "  activations and scratch: ~{} per rank (one microbatch of {} samples run once, --recompute {})",
        format_bytes(act),
        crate::activations::microbatch(cfg),
        cfg.recompute.name()
    )];
    lines.push(format!(
        "  {} node(s) of {} ranks; communication per step priced on {name} ({intra} inside nodes, {inter} across){}",
        at.nodes,
        at.per_node,
        if cfg.allow_lossy_comm { "; 8-bit wires allowed (--allow-lossy-comm)" } else { "" }
    ));
    lines.extend(notes);
    lines.extend(cands.iter().map(|c| c.line(cfg.world, cfg.device_memory)));
    let cap = cfg.device_memory.map(|c| format!(" within {}", format_bytes(c))).unwrap_or_default();
    match choose(&cands, cfg.device_memory, cfg.allow_lossy_comm) {
        Some(i) => {
            let c = &cands[i];
            lines.push(format!(
                "  chose {} (the least communication{cap}{})",
                c.label(cfg.world),
                if cfg.allow_lossy_comm { "" } else { ", lossless" }
            ));
            let r = Resolved {
                stage: c.stage,
                shard_group: group_of(c.group, cfg.world, at),
                gather_dtype: c.gather,
                cross_node_reduce_dtype: c.cross,
            };
            Ok(Some((r, lines)))
        }
        None => Err(RuntimeError::config(format!(
            "no stage and shard group fits --device-memory {}:\n{}",
            format_bytes(cfg.device_memory.unwrap_or(0)),
            lines.join("\n")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{build_model, stage_estimates};

    /// A profile of ring formulas: `shm` inside nodes at `intra` GB/s, `tcp` across at
    /// `inter` GB/s (no rows across without it).
    fn profile(intra: f64, inter: Option<f64>) -> Profile {
        let rows = |t: &str, gbps: f64| {
            ["all-gather", "reduce-scatter", "all-reduce"].map(|op| {
                serde_json::json!({"op": op, "world": 2, "world_max": 64, "transport": t,
                    "busbw_gbps": gbps, "step_latency_us": 0.0})
            })
        };
        let mut collectives: Vec<serde_json::Value> = rows("shm", intra).to_vec();
        if let Some(x) = inter {
            collectives.extend(rows("tcp", x));
        }
        serde_json::from_value(serde_json::json!({
            "note": "test", "cores": 4, "memory_gbps": 10.0,
            "gemm": [{"m": 64, "n": 64, "k": 64, "gflops": 10.0}],
            "collectives": collectives, "transports_default": ["shm", "tcp"],
        }))
        .expect("profile")
    }

    fn job(world: usize) -> (TrainConfig, shardline_models::Model) {
        let cfg = TrainConfig {
            world,
            stage: StageChoice::Auto,
            shard_group: ShardGroup::Auto,
            // Units many and small enough that model state outweighs the transient buffers
            // (gathered units, gradients in flight).
            hidden: Some(256),
            depth: Some(16),
            optimizer: "adamw".into(),
            profile: Some("test".into()),
            ..TrainConfig::default()
        };
        let model = build_model(&cfg, &[64], 10).expect("model");
        (cfg, model)
    }

    fn pricer(p: &Profile, nodes: usize, per_node: usize) -> Pricer<'_> {
        Pricer { profile: p, intra: "shm", inter: "tcp", at: Nodes { nodes, per_node } }
    }

    /// AUTO-4: every candidate's memory is its stage's estimate in a world of its group.
    #[test]
    fn memory_at_a_group_is_the_estimate_of_a_world_of_its_size_auto_4() {
        let (cfg, model) = job(4);
        let p = profile(10.0, Some(0.125));
        let (cands, _) = candidates(&model, &cfg, 1000, &pricer(&p, 2, 2)).unwrap();
        assert!(cands.iter().any(|c| c.group == 2 && c.stage == Stage::Zero3), "{cands:?}");
        for c in &cands {
            let at_g = TrainConfig { world: c.group, ..cfg.clone() };
            let est = stage_estimates(&model, &at_g).unwrap();
            let want = est.iter().find(|(s, _)| *s == c.stage).unwrap().1 + 1000;
            assert_eq!(c.memory, want, "{c:?}");
        }
        // Sharding over fewer ranks holds more.
        let mem = |g| cands.iter().find(|c| c.stage == Stage::Zero3 && c.group == g).unwrap();
        assert!(mem(2).memory > mem(4).memory);
    }

    /// AUTO-5: on one node a profile with no transport across nodes prices every candidate;
    /// on two it is needed; a group inside a node costs the same whatever the link across.
    #[test]
    fn one_node_never_reads_the_link_across_auto_5() {
        let (cfg, model) = job(4);
        let intra_only = profile(10.0, None);
        let (cands, notes) = candidates(&model, &cfg, 0, &pricer(&intra_only, 1, 4)).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        // Stage 0 over the world; stages 1-3 over groups of 4, 2 and 1.
        assert_eq!(cands.len(), 1 + 3 * 3, "{cands:?}");
        assert!(candidates(&model, &cfg, 0, &pricer(&intra_only, 2, 2)).is_err());
        let (slow, fast) = (profile(10.0, Some(0.1)), profile(10.0, Some(100.0)));
        for op in ["all-gather", "reduce-scatter"] {
            let a = pricer(&slow, 2, 2).group_s(op, 2, 1 << 20).unwrap();
            let b = pricer(&fast, 2, 2).group_s(op, 2, 1 << 20).unwrap();
            assert_eq!(a, b, "{op}");
        }
        let a = pricer(&slow, 2, 2).group_s("all-gather", 4, 1 << 20).unwrap();
        let b = pricer(&fast, 2, 2).group_s("all-gather", 4, 1 << 20).unwrap();
        assert!(a > b, "a group over both nodes pays the link across");
    }

    /// AUTO-1..3 on a job's figures: two nodes of four ranks on a slow link across; the node
    /// group at stage 3 when it fits (below it, stage 2 over the world would be as cheap, but
    /// holds more), full shard when only that fits, 8-bit wires only with the opt-in.
    #[test]
    fn a_slow_link_prefers_the_node_group_when_it_fits() {
        let (cfg, model) = job(8);
        let cfg = TrainConfig { allow_lossy_comm: true, ..cfg };
        let p = profile(10.0, Some(0.125));
        let (cands, _) = candidates(&model, &cfg, 0, &pricer(&p, 2, 4)).unwrap();
        let find = |s: Stage, g: usize| {
            cands.iter().find(|c| c.stage == s && c.group == g && !c.lossy).unwrap().clone()
        };
        let (node3, world3) = (find(Stage::Zero3, 4), find(Stage::Zero3, 8));
        assert!(node3.is_node && node3.comm_s < world3.comm_s, "{node3:?} {world3:?}");
        let pick = |cap: u64, lossy: bool| cands[choose(&cands, Some(cap), lossy).unwrap()].clone();
        assert_eq!(pick(node3.memory, false), node3);
        assert_eq!(pick(node3.memory - 1, false), world3);
        // Lossy candidates are listed, and chosen only with the opt-in.
        assert!(cands.iter().any(|c| c.lossy));
        assert!(!pick(u64::MAX, false).lossy);
        let fast = pick(node3.memory, true);
        assert!(fast.lossy && fast.comm_s < node3.comm_s, "{fast:?}");
    }
}
