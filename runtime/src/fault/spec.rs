//! Fault specs (`--fault SPEC`), their plan, and the plan's checks against a job.
//!
//! Invariants:
//! - FAULT-1: parsing is total: any string either parses to a spec or yields an error naming
//!   the offending part; nothing panics.

use crate::error::{Result, RuntimeError};
use serde::Serialize;
use shardline_collectives::transport::faulty::{LinkFault, LinkFaultKind};

/// A point of a training step where a rank fault can fire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// During the forward pass (after the first unit's forward).
    Forward,
    /// During the backward pass (after the first unit's gradients are handed to the reduce
    /// lane).
    Backward,
    /// While waiting for the gradient reductions.
    Reduce,
    /// While writing a checkpoint (after this rank's shard file is written, before commit).
    Checkpoint,
    /// After this rank's updates, before the all-reduce of the step's loss and norm where
    /// that comes after them (stages 0 and 3 without clipping; under live recovery after the
    /// step committed, LIVE-1); elsewhere after both.
    Update,
}

impl Phase {
    /// Name as in a spec.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Reduce => "reduce",
            Phase::Checkpoint => "checkpoint",
            Phase::Update => "update",
        }
    }

    /// Every phase, in step order.
    pub const ALL: [Phase; 5] =
        [Phase::Forward, Phase::Backward, Phase::Reduce, Phase::Update, Phase::Checkpoint];
}

/// One fault of a plan.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultSpec {
    /// Kill a rank's actor thread at a step and phase.
    Kill {
        /// Rank.
        rank: usize,
        /// Step (1-based: the S-th optimizer step).
        step: u64,
        /// Where in the step.
        phase: Phase,
    },
    /// Make a rank sleep at the start of a step.
    Stall {
        /// Rank.
        rank: usize,
        /// Step (1-based).
        step: u64,
        /// How long.
        secs: f64,
    },
    /// Make a rank slower at every step from one on: it sleeps at the start of each forward
    /// pass (a throttled or shared device, a straggler rather than a one-off stall).
    Slow {
        /// Rank.
        rank: usize,
        /// First slowed step (1-based).
        step: u64,
        /// Sleep per step, in milliseconds.
        ms: u64,
    },
    /// Cut a node off (namespace tests of the launcher only).
    Partition {
        /// Node index.
        node: usize,
        /// Step (1-based).
        step: u64,
        /// How long.
        secs: f64,
    },
    /// A link fault.
    Link(LinkFault),
}

impl FaultSpec {
    /// Short kind name: kill, stall, slow, partition, delay, drop, corrupt.
    pub fn kind(&self) -> &'static str {
        match self {
            FaultSpec::Kill { .. } => "kill",
            FaultSpec::Stall { .. } => "stall",
            FaultSpec::Slow { .. } => "slow",
            FaultSpec::Partition { .. } => "partition",
            FaultSpec::Link(l) => match l.kind {
                LinkFaultKind::Delay { .. } => "delay",
                LinkFaultKind::Drop { .. } => "drop",
                LinkFaultKind::Corrupt { .. } => "corrupt",
            },
        }
    }

    /// The spec in its command-line form.
    pub fn to_spec(&self) -> String {
        match self {
            FaultSpec::Kill { rank, step, phase } => {
                format!("kill:rank={rank}:step={step}:phase={}", phase.name())
            }
            FaultSpec::Stall { rank, step, secs } => {
                format!("stall:rank={rank}:step={step}:secs={secs}")
            }
            FaultSpec::Slow { rank, step, ms } => format!("slow:rank={rank}:step={step}:ms={ms}"),
            FaultSpec::Partition { node, step, secs } => {
                format!("partition:node={node}:step={step}:secs={secs}")
            }
            FaultSpec::Link(l) => match l.kind {
                LinkFaultKind::Delay { ms, jitter_ms } => {
                    format!("delay:link={}-{}:ms={ms}:jitter={jitter_ms}", l.a, l.b)
                }
                LinkFaultKind::Drop { p } => format!("drop:link={}-{}:p={p}", l.a, l.b),
                LinkFaultKind::Corrupt { p } => format!("corrupt:link={}-{}:p={p}", l.a, l.b),
            },
        }
    }

    /// Parses one `--fault` spec (FAULT-1).
    ///
    /// ```
    /// use shardline_runtime::fault::{FaultSpec, Phase};
    /// let f = FaultSpec::parse("kill:rank=1:step=3:phase=backward").unwrap();
    /// assert_eq!(f, FaultSpec::Kill { rank: 1, step: 3, phase: Phase::Backward });
    /// assert!(FaultSpec::parse("kill:rank=1").is_err());
    /// ```
    pub fn parse(spec: &str) -> std::result::Result<FaultSpec, String> {
        let err = |m: String| format!("bad --fault '{spec}': {m}");
        let mut parts = spec.trim().split(':');
        let kind = parts.next().unwrap_or_default();
        let mut kv: Vec<(&str, &str)> = Vec::new();
        for p in parts {
            let (k, v) = p.split_once('=').ok_or_else(|| err(format!("'{p}' is not key=value")))?;
            if kv.iter().any(|(k2, _)| *k2 == k) {
                return Err(err(format!("'{k}' given twice")));
            }
            kv.push((k, v));
        }
        let allowed: &[&str] = match kind {
            "kill" => &["rank", "step", "phase"],
            "stall" => &["rank", "step", "secs"],
            "slow" => &["rank", "step", "ms"],
            "partition" => &["node", "step", "secs"],
            "delay" => &["link", "ms", "jitter"],
            "drop" | "corrupt" => &["link", "p"],
            other => {
                return Err(err(format!(
                    "unknown fault kind '{other}' (choose kill, stall, slow, delay, drop, corrupt or partition)"
                )))
            }
        };
        if let Some((k, _)) = kv.iter().find(|(k, _)| !allowed.contains(k)) {
            return Err(err(format!("'{kind}' takes {}, not '{k}'", allowed.join(", "))));
        }
        let get = |k: &str| kv.iter().find(|(k2, _)| *k2 == k).map(|(_, v)| *v);
        let need = |k: &str| get(k).ok_or_else(|| err(format!("missing {k}=")));
        let int = |k: &str| -> std::result::Result<u64, String> {
            need(k)?.parse::<u64>().map_err(|_| err(format!("{k} must be a whole number")))
        };
        let secs = |k: &str| -> std::result::Result<f64, String> {
            let v: f64 =
                need(k)?.parse().map_err(|_| err(format!("{k} must be a number of seconds")))?;
            if v.is_finite() && (0.0..=86_400.0).contains(&v) {
                Ok(v)
            } else {
                Err(err(format!("{k} must be between 0 and 86400")))
            }
        };
        let step = || -> std::result::Result<u64, String> {
            let s = int("step")?;
            if s == 0 {
                return Err(err("step counts from 1".into()));
            }
            Ok(s)
        };
        let link = || -> std::result::Result<(usize, usize), String> {
            let v = need("link")?;
            let (a, b) = v.split_once('-').ok_or_else(|| err("link must be A-B".into()))?;
            let a: usize = a.parse().map_err(|_| err("link must be A-B (ranks)".into()))?;
            let b: usize = b.parse().map_err(|_| err("link must be A-B (ranks)".into()))?;
            if a == b {
                return Err(err("a link joins two different ranks".into()));
            }
            Ok((a, b))
        };
        let prob = || -> std::result::Result<f64, String> {
            let p: f64 = need("p")?.parse().map_err(|_| err("p must be a number".into()))?;
            if (0.0..=1.0).contains(&p) {
                Ok(p)
            } else {
                Err(err("p must be between 0 and 1".into()))
            }
        };
        let usize_of = |k: &str| -> std::result::Result<usize, String> {
            usize::try_from(int(k)?).map_err(|_| err(format!("{k} is too large")))
        };
        Ok(match kind {
            "kill" => {
                let phase = match get("phase").unwrap_or("forward") {
                    "forward" => Phase::Forward,
                    "backward" => Phase::Backward,
                    "reduce" => Phase::Reduce,
                    "checkpoint" => Phase::Checkpoint,
                    "update" => Phase::Update,
                    other => {
                        return Err(err(format!(
                        "unknown phase '{other}' (choose forward, backward, reduce, update or checkpoint)"
                    )))
                    }
                };
                FaultSpec::Kill { rank: usize_of("rank")?, step: step()?, phase }
            }
            "stall" => {
                FaultSpec::Stall { rank: usize_of("rank")?, step: step()?, secs: secs("secs")? }
            }
            "slow" => {
                let ms = int("ms")?;
                if ms > 600_000 {
                    return Err(err("ms must be at most 600000".into()));
                }
                FaultSpec::Slow { rank: usize_of("rank")?, step: step()?, ms }
            }
            "partition" => {
                FaultSpec::Partition { node: usize_of("node")?, step: step()?, secs: secs("secs")? }
            }
            "delay" => {
                let (a, b) = link()?;
                let ms = int("ms")?;
                let jitter_ms = if get("jitter").is_some() { int("jitter")? } else { 0 };
                if ms > 600_000 || jitter_ms > 600_000 {
                    return Err(err("ms and jitter must be at most 600000".into()));
                }
                FaultSpec::Link(LinkFault { a, b, kind: LinkFaultKind::Delay { ms, jitter_ms } })
            }
            "drop" => {
                let (a, b) = link()?;
                FaultSpec::Link(LinkFault { a, b, kind: LinkFaultKind::Drop { p: prob()? } })
            }
            _ => {
                let (a, b) = link()?;
                FaultSpec::Link(LinkFault { a, b, kind: LinkFaultKind::Corrupt { p: prob()? } })
            }
        })
    }
}

/// A fault plan: specs plus the seed of every random decision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    /// The faults.
    pub faults: Vec<FaultSpec>,
    /// `--fault-seed`.
    pub seed: u64,
}

impl FaultPlan {
    /// Parses every `--fault` flag.
    pub fn parse(specs: &[String], seed: u64) -> std::result::Result<FaultPlan, String> {
        let faults =
            specs.iter().map(|s| FaultSpec::parse(s)).collect::<std::result::Result<_, _>>()?;
        Ok(FaultPlan { faults, seed })
    }

    /// Checks the plan against a one-process job of `world` ranks.
    pub fn validate(&self, world: usize) -> Result<()> {
        for f in &self.faults {
            let bad =
                |m: String| Err(RuntimeError::config(format!("--fault {}: {m}", f.to_spec())));
            match f {
                FaultSpec::Kill { rank, .. }
                | FaultSpec::Stall { rank, .. }
                | FaultSpec::Slow { rank, .. }
                    if *rank >= world =>
                {
                    return bad(format!("rank {rank} does not exist in a world of {world}"))
                }
                FaultSpec::Link(l) if l.a >= world || l.b >= world => {
                    return bad(format!("link {}-{} leaves a world of {world}", l.a, l.b))
                }
                FaultSpec::Partition { .. } => {
                    return bad(
                        "partition needs one process per node in network namespaces \
                                (shardline launch); shardline train runs every rank in one process"
                            .into(),
                    )
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Checks the plan for a worker process of `shardline launch` in a world of `world`
    /// ranks: rank faults are injected by the worker itself (LAUNCH-8 in the launch module),
    /// partitions by the namespace harness that cuts the node's link; link faults need the
    /// in-process transports of `shardline train` and are refused.
    pub fn validate_launched(&self, world: usize) -> Result<()> {
        for f in &self.faults {
            let bad =
                |m: String| Err(RuntimeError::config(format!("--fault {}: {m}", f.to_spec())));
            match f {
                FaultSpec::Kill { rank, .. }
                | FaultSpec::Stall { rank, .. }
                | FaultSpec::Slow { rank, .. }
                    if *rank >= world =>
                {
                    return bad(format!("rank {rank} does not exist in a world of {world}"))
                }
                FaultSpec::Link(_) => {
                    return bad(
                        "link faults are injected by `shardline train` (one process) only".into()
                    )
                }
                _ => {}
            }
        }
        Ok(())
    }

    pub(super) fn link_faults(&self) -> Vec<LinkFault> {
        self.faults
            .iter()
            .filter_map(|f| if let FaultSpec::Link(l) = f { Some(*l) } else { None })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_kind_parses_and_prints_back() {
        for s in [
            "kill:rank=1:step=3:phase=backward",
            "kill:rank=0:step=1:phase=checkpoint",
            "stall:rank=2:step=5:secs=1.5",
            "partition:node=1:step=4:secs=2",
            "delay:link=0-1:ms=5:jitter=2",
            "drop:link=1-2:p=0.1",
            "corrupt:link=0-3:p=1",
        ] {
            let f = FaultSpec::parse(s).unwrap();
            assert_eq!(FaultSpec::parse(&f.to_spec()).unwrap(), f, "{s}");
        }
        assert_eq!(
            FaultSpec::parse("kill:rank=1:step=3").unwrap(),
            FaultSpec::Kill { rank: 1, step: 3, phase: Phase::Forward }
        );
    }

    #[test]
    fn malformed_specs_name_the_problem() {
        for (s, want) in [
            ("kill", "missing rank"),
            ("kill:rank=1", "missing step"),
            ("kill:rank=x:step=1", "rank must be a whole number"),
            ("kill:rank=1:step=0", "step counts from 1"),
            ("kill:rank=1:step=1:phase=lunch", "unknown phase"),
            ("explode:rank=1", "unknown fault kind"),
            ("drop:link=1-1:p=0.5", "two different ranks"),
            ("drop:link=0-1:p=2", "between 0 and 1"),
            ("corrupt:link=0:p=0.5", "A-B"),
            ("stall:rank=0:step=1:secs=-1", "between 0 and 86400"),
            ("delay:link=0-1", "missing ms"),
            ("delay:link=0-1:ms=1:ms=2", "given twice"),
            ("kill:rank=1:step=2:secs=3", "not 'secs'"),
            ("kill:rank1", "not key=value"),
        ] {
            let e = FaultSpec::parse(s).unwrap_err();
            assert!(e.contains(want), "{s}: {e}");
        }
    }

    #[test]
    fn plans_are_checked_against_the_world() {
        let p = FaultPlan::parse(&["kill:rank=4:step=1".into()], 0).unwrap();
        assert!(p.validate(4).unwrap_err().to_string().contains("rank 4 does not exist"));
        assert!(p.validate(5).is_ok());
        let p = FaultPlan::parse(&["partition:node=1:step=1:secs=1".into()], 0).unwrap();
        assert!(p.validate(4).unwrap_err().to_string().contains("shardline launch"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        // FAULT-1: arbitrary text never panics the parser.
        #[test]
        fn parser_is_total(s in ".{0,60}") {
            let _ = FaultSpec::parse(&s);
        }

        #[test]
        fn parser_is_total_on_near_misses(
            kind in prop::sample::select(vec!["kill", "stall", "slow", "delay", "drop", "corrupt", "partition"]),
            parts in prop::collection::vec("(rank|step|phase|link|ms|p|secs|jitter|node)=[-0-9a-z.]{0,6}", 0..5),
        ) {
            let _ = FaultSpec::parse(&format!("{kind}:{}", parts.join(":")));
        }
    }
}
