//! Whether the deciding agent grows an elastic job (`--nnodes MIN:MAX`) without waiting for
//! a failure: a pure decision over what that agent sees (the running generation, the nodes
//! whose agents heartbeat, MAX, the checkpoint directory, the steps the generation did).
//!
//! A growth stops the running workers at a step boundary (SIGUSR1, a planned stop: the group
//! stops together after a step and checkpoints it, INT-1, INT-3), and the next generation, with the joining
//! nodes and its ranks renumbered, resumes from that checkpoint resharded on load (CKPT-3),
//! as a restart does. Growth reshards through the checkpoint on disk, never from the peers'
//! memory. It is not a failure: it uses none of `--max-restarts`.
//!
//! Invariants:
//! - LAUNCH-15: a growth stays within MAX: only nodes `0..MAX` join, so a grown generation
//!   has at most MAX nodes; a generation of MAX nodes is kept.
//! - LAUNCH-16: a growth never drops a node: the grown generation holds every node of the
//!   running one and every node outside it whose agent heartbeats, ascending.
//! - LAUNCH-17: no growth while the running generation is stopping (a failure's stop or a
//!   growth under way), nor without a checkpoint directory (the next generation could not
//!   resume from the step the running one stopped at).
//! - LAUNCH-18: at most one growth per completed step: the running generation grows only
//!   once it completed at least one step since it started, so every generation moves the
//!   job forward however often nodes arrive.

/// What the deciding agent sees when it considers a growth.
#[derive(Clone, Debug)]
pub(super) struct View<'a> {
    /// Nodes of the running generation, ascending.
    pub(super) running: &'a [usize],
    /// The running generation is stopping (a failure, or a growth already under way).
    pub(super) stopping: bool,
    /// Nodes whose agents' heartbeats are fresh.
    pub(super) fresh: &'a [usize],
    /// The most nodes of the job (`--nnodes MIN:MAX`).
    pub(super) max_nodes: usize,
    /// The workers write checkpoints (`--checkpoint-dir`).
    pub(super) checkpoint_dir: bool,
    /// Steps the running generation completed since it started (at least).
    pub(super) steps_done: u64,
}

/// Why the running generation is kept as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Keep {
    /// No node outside the running generation heartbeats.
    NoneWaiting,
    /// The running generation has MAX nodes (LAUNCH-15).
    Full,
    /// The running generation is stopping (LAUNCH-17).
    Stopping,
    /// No checkpoint to resume from (LAUNCH-17).
    NoCheckpointDir,
    /// The running generation has not completed a step yet (LAUNCH-18).
    NoStepYet,
}

/// The decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Decision {
    Keep(Keep),
    /// Stop the running generation at a step boundary and start one on `nodes`, which adds
    /// `joining` to the running nodes.
    Grow {
        nodes: Vec<usize>,
        joining: Vec<usize>,
    },
}

/// Whether to grow the running generation now (LAUNCH-15..LAUNCH-18).
pub(super) fn decide(v: &View<'_>) -> Decision {
    if v.running.len() >= v.max_nodes {
        return Decision::Keep(Keep::Full);
    }
    let mut joining: Vec<usize> =
        v.fresh.iter().copied().filter(|n| *n < v.max_nodes && !v.running.contains(n)).collect();
    joining.sort_unstable();
    joining.dedup();
    if joining.is_empty() {
        return Decision::Keep(Keep::NoneWaiting);
    }
    if v.stopping {
        return Decision::Keep(Keep::Stopping);
    }
    if !v.checkpoint_dir {
        return Decision::Keep(Keep::NoCheckpointDir);
    }
    if v.steps_done == 0 {
        return Decision::Keep(Keep::NoStepYet);
    }
    let mut nodes: Vec<usize> = v.running.iter().copied().chain(joining.iter().copied()).collect();
    nodes.sort_unstable();
    nodes.dedup();
    Decision::Grow { nodes, joining }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(running: &'a [usize], fresh: &'a [usize]) -> View<'a> {
        View { running, stopping: false, fresh, max_nodes: 4, checkpoint_dir: true, steps_done: 1 }
    }

    fn grown(d: Decision) -> (Vec<usize>, Vec<usize>) {
        match d {
            Decision::Grow { nodes, joining } => (nodes, joining),
            Decision::Keep(k) => panic!("kept: {k:?}"),
        }
    }

    #[test]
    fn a_fresh_node_outside_the_generation_joins() {
        let (nodes, joining) = grown(decide(&view(&[0], &[0, 2])));
        assert_eq!(nodes, vec![0, 2]);
        assert_eq!(joining, vec![2]);
    }

    #[test]
    fn growth_stays_within_max_launch_15() {
        // Every node id below MAX may join; ids at or past MAX never do.
        let (nodes, joining) = grown(decide(&view(&[1], &[0, 1, 2, 3, 4, 9])));
        assert_eq!(nodes, vec![0, 1, 2, 3]);
        assert_eq!(joining, vec![0, 2, 3]);
        assert_eq!(decide(&view(&[0, 1, 2, 3], &[0, 1, 2, 3])), Decision::Keep(Keep::Full));
        assert_eq!(decide(&view(&[0], &[4, 7])), Decision::Keep(Keep::NoneWaiting));
        // All sizes and subsets: a grown generation never passes MAX.
        for max in 1..=4usize {
            for running_mask in 1u32..(1 << max) {
                for fresh_mask in 0u32..(1 << 6) {
                    let running: Vec<usize> =
                        (0..max).filter(|n| running_mask >> n & 1 == 1).collect();
                    let fresh: Vec<usize> = (0..6).filter(|n| fresh_mask >> n & 1 == 1).collect();
                    let v = View { max_nodes: max, ..view(&running, &fresh) };
                    if let Decision::Grow { nodes, .. } = decide(&v) {
                        assert!(nodes.len() <= max && nodes.iter().all(|&n| n < max), "{v:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn growth_keeps_every_running_node_launch_16() {
        // Node 1 runs but its heartbeat is not fresh (the failure path judges that): it stays.
        let (nodes, joining) = grown(decide(&view(&[0, 1], &[0, 3, 2, 2])));
        assert_eq!(nodes, vec![0, 1, 2, 3]);
        assert_eq!(joining, vec![2, 3]);
        for running_mask in 1u32..16 {
            for fresh_mask in 0u32..16 {
                let running: Vec<usize> = (0..4).filter(|n| running_mask >> n & 1 == 1).collect();
                let fresh: Vec<usize> = (0..4).filter(|n| fresh_mask >> n & 1 == 1).collect();
                if let Decision::Grow { nodes, joining } = decide(&view(&running, &fresh)) {
                    assert!(running.iter().all(|n| nodes.contains(n)), "{running:?} {fresh:?}");
                    assert!(joining.iter().all(|n| fresh.contains(n) && !running.contains(n)));
                    assert!(nodes.windows(2).all(|w| w[0] < w[1]), "{nodes:?}");
                    assert_eq!(nodes.len(), running.len() + joining.len());
                }
            }
        }
    }

    #[test]
    fn no_growth_while_stopping_or_without_checkpoints_launch_17() {
        let stopping = View { stopping: true, ..view(&[0], &[0, 1]) };
        assert_eq!(decide(&stopping), Decision::Keep(Keep::Stopping));
        let no_dir = View { checkpoint_dir: false, ..view(&[0], &[0, 1]) };
        assert_eq!(decide(&no_dir), Decision::Keep(Keep::NoCheckpointDir));
    }

    #[test]
    fn no_growth_before_the_generation_completed_a_step_launch_18() {
        let fresh_start = View { steps_done: 0, ..view(&[0], &[0, 1]) };
        assert_eq!(decide(&fresh_start), Decision::Keep(Keep::NoStepYet));
        let one_step = View { steps_done: 1, ..view(&[0], &[0, 1]) };
        assert_eq!(grown(decide(&one_step)).0, vec![0, 1]);
    }
}
