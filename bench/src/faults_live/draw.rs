//! The faults of the live-recovery campaign and their seeded draw (LIVEB-1): a pure function
//! of the campaign's seed and the trial's number, so that both runs of a trial, and a rerun
//! of the campaign, meet the same fault.

use crate::campaign::Rng;
use serde::Serialize;

/// What a trial does to the job.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A worker SIGKILLs itself at a step and phase (`--fault kill:...`).
    Kill,
    /// A worker sleeps at the start of a step for longer than `--timeout`, so that its
    /// peers' collectives time out (`--fault stall:...`).
    Stall,
    /// A node's link goes down for longer than `--timeout` and comes back.
    Partition,
    /// Node 0's agent (the store's first leader) is SIGKILLed with its worker and started
    /// again 0.5-2 s later: a fixed-size job waits for its nodes (LAUNCH-10).
    #[value(name = "node0-loss")]
    #[serde(rename = "node0-loss")]
    Node0Loss,
    /// Another node's agent is SIGKILLed with its worker and started again 0.5-2 s later.
    NodeReturn,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Kill => "kill",
            Kind::Stall => "stall",
            Kind::Partition => "partition",
            Kind::Node0Loss => "node0-loss",
            Kind::NodeReturn => "node-return",
        }
    }

    /// How often the draw picks it: kills twice as often as the rest (they are the cases
    /// whose final checkpoint must equal the clean run's).
    fn weight(self) -> u64 {
        match self {
            Kind::Kill => 2,
            _ => 1,
        }
    }
}

/// The sharding a trial's job runs with (world 4, one worker per node).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Setting {
    /// `--stage 0`: every rank holds the whole state.
    Stage0,
    /// `--shard-group 2 --stage 3`: two shard groups of two ranks (HSDP 2x2).
    Hsdp,
}

impl Setting {
    pub fn name(self) -> &'static str {
        match self {
            Setting::Stage0 => "stage0",
            Setting::Hsdp => "hsdp",
        }
    }

    /// The `train` flags of the setting.
    pub fn train_flags(self) -> &'static [&'static str] {
        match self {
            Setting::Stage0 => &["--stage", "0"],
            Setting::Hsdp => &["--stage", "3", "--shard-group", "2"],
        }
    }
}

/// How the fault is made.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "by", rename_all = "kebab-case")]
pub enum Action {
    /// A worker's own `--fault` spec.
    Worker { spec: String },
    /// The harness takes `node`'s link down once the step log shows `step`, for `secs`.
    Partition { node: usize, step: u64, secs: f64 },
    /// The harness SIGKILLs `node`'s agent and its worker once the step log shows `step`,
    /// and starts the agent again `secs` later.
    KillNode { node: usize, step: u64, secs: f64 },
}

impl Action {
    /// One line naming the fault (a `--fault` spec where there is one).
    pub fn describe(&self) -> String {
        match self {
            Action::Worker { spec } => spec.clone(),
            Action::Partition { node, step, secs } => {
                format!("partition:node={node}:step={step}:secs={secs:.2}")
            }
            Action::KillNode { node, step, secs } => {
                format!("agent-kill:node={node}:step={step}:back-after={secs:.2}")
            }
        }
    }
}

/// A trial's draw.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Drawn {
    pub setting: Setting,
    pub kind: Kind,
    pub action: Action,
}

/// The job's shape the draw needs.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub nodes: usize,
    pub steps: u64,
    pub checkpoint_every: u64,
    pub timeout_s: u64,
}

/// LIVEB-1: trial `trial`'s fault, from the campaign `seed`, `kinds` and `settings` alone.
pub fn draw(seed: u64, trial: usize, kinds: &[Kind], settings: &[Setting], s: Shape) -> Drawn {
    let mut r = Rng(seed ^ 0x11FE_u64.wrapping_mul(trial as u64 + 1));
    let setting = settings[r.below(settings.len() as u64) as usize];
    let total: u64 = kinds.iter().map(|k| k.weight()).sum();
    let mut pick = r.below(total);
    let kind = *kinds
        .iter()
        .find(|k| {
            let hit = pick < k.weight();
            pick = pick.saturating_sub(k.weight());
            hit
        })
        .unwrap_or(&kinds[0]);
    let n = s.nodes as u64;
    // Mid-run: never the first steps (the job still starting) nor the last two.
    let step = 3 + r.below(s.steps.saturating_sub(5).max(1));
    let timeout = s.timeout_s as f64;
    let action = match kind {
        Kind::Kill => {
            let rank = r.below(n);
            let phases = ["forward", "backward", "reduce", "update", "checkpoint"];
            // A checkpoint kill needs a step that writes one before the last.
            let saving = (s.steps - 1) / s.checkpoint_every.max(1);
            let phase = phases[r.below(if saving > 0 { 5 } else { 4 }) as usize];
            let step = match phase {
                "checkpoint" => s.checkpoint_every * (1 + r.below(saving)),
                _ => step,
            };
            Action::Worker { spec: format!("kill:rank={rank}:step={step}:phase={phase}") }
        }
        Kind::Stall => {
            let rank = r.below(n);
            let secs = timeout * (1.5 + r.unit());
            Action::Worker { spec: format!("stall:rank={rank}:step={step}:secs={secs:.2}") }
        }
        Kind::Partition => {
            let secs = timeout + 1.0 + 2.0 * r.unit();
            Action::Partition { node: r.below(n) as usize, step, secs }
        }
        Kind::Node0Loss => Action::KillNode { node: 0, step, secs: 0.5 + 1.5 * r.unit() },
        Kind::NodeReturn => {
            let node = 1 + r.below(n - 1) as usize;
            Action::KillNode { node, step, secs: 0.5 + 1.5 * r.unit() }
        }
    };
    Drawn { setting, kind, action }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_runtime::fault::FaultSpec;

    const ALL: [Kind; 5] =
        [Kind::Kill, Kind::Stall, Kind::Partition, Kind::Node0Loss, Kind::NodeReturn];
    const SHAPE: Shape = Shape { nodes: 4, steps: 50, checkpoint_every: 20, timeout_s: 2 };

    #[test]
    fn a_trial_draws_the_same_fault_every_time_liveb_1() {
        let settings = [Setting::Stage0, Setting::Hsdp];
        for t in 0..200 {
            let a = draw(7, t, &ALL, &settings, SHAPE);
            assert_eq!(a, draw(7, t, &ALL, &settings, SHAPE), "trial {t}");
        }
        let seq = |seed| (0..50).map(|t| draw(seed, t, &ALL, &settings, SHAPE)).collect();
        let (a, b): (Vec<Drawn>, Vec<Drawn>) = (seq(7), seq(8));
        assert_ne!(a, b, "another seed draws other faults");
    }

    #[test]
    fn draws_stay_inside_the_job_and_parse_as_fault_specs_liveb_1() {
        let settings = [Setting::Stage0, Setting::Hsdp];
        let mut kinds_seen = Vec::new();
        for t in 0..400 {
            let d = draw(3, t, &ALL, &settings, SHAPE);
            kinds_seen.push(d.kind);
            match &d.action {
                Action::Worker { spec } => match FaultSpec::parse(spec).expect(spec) {
                    FaultSpec::Kill { rank, step, .. } => {
                        assert!(rank < 4 && (3..SHAPE.steps - 1).contains(&step), "{spec}");
                        if spec.ends_with("phase=checkpoint") {
                            assert!(step % SHAPE.checkpoint_every == 0, "{spec}");
                        }
                    }
                    FaultSpec::Stall { rank, secs, .. } => {
                        assert!(rank < 4 && secs > SHAPE.timeout_s as f64, "{spec}")
                    }
                    other => panic!("{spec} parsed as {other:?}"),
                },
                Action::Partition { node, step, secs } => {
                    assert!(*node < 4 && *step < SHAPE.steps - 1);
                    assert!(*secs > SHAPE.timeout_s as f64, "a partition outlasts the timeout");
                }
                Action::KillNode { node, step, .. } => {
                    assert_eq!(*node == 0, d.kind == Kind::Node0Loss);
                    assert!(*node < 4 && *step < SHAPE.steps - 1);
                }
            }
        }
        for k in ALL {
            assert!(kinds_seen.contains(&k), "{k:?} never drawn");
        }
        let only = draw(3, 0, &[Kind::Stall], &[Setting::Hsdp], SHAPE);
        assert_eq!((only.kind, only.setting), (Kind::Stall, Setting::Hsdp));
    }
}
