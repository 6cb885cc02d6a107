//! Stragglers: a rank slower than the others step after step, seen long before any
//! collective times out (the slow creep toward a watchdog's timeout). Every step, each
//! rank's busy time (the time it was not waiting for communication, up to the step's loss
//! reduction) travels with that reduction, so every rank, in this process or another, reads
//! the same list; [`Stragglers`] is the pure core that judges it, so every process reaches
//! the same verdict at the same step.
//!
//! Busy time is the signal because a slow rank makes the others wait: their time goes to
//! exposed communication, while the slow rank's own time is work (or whatever slows it).
//! A rank is compared with the median of the *other* ranks, so that with two ranks the slow
//! one is measured against the fast one rather than against a median it pulls up itself.
//!
//! Invariants:
//! - STRAG-1: a rank is flagged when, for `steps` consecutive steps, its busy time is at
//!   least `factor` times the median of the other ranks' and exceeds it by at least
//!   `min_excess_s`; it is reported once, at the step its streak reaches `steps`, and again
//!   only after a step within the bound has ended the streak.
//! - STRAG-2: with fewer than two ranks' figures nothing is flagged, and a step without
//!   figures (an engine that does not measure them) changes no streak.

/// When a rank counts as a straggler.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StragglerPolicy {
    /// Busy time at least this many times the other ranks' median.
    pub factor: f64,
    /// For this many consecutive steps.
    pub steps: u32,
    /// And at least this much more than that median, in seconds: below it the difference is
    /// the scheduling noise of ranks that share cores, not a slow rank.
    pub min_excess_s: f64,
}

impl Default for StragglerPolicy {
    fn default() -> Self {
        StragglerPolicy { factor: 3.0, steps: 5, min_excess_s: 0.005 }
    }
}

/// A rank newly flagged (STRAG-1).
#[derive(Clone, Debug, PartialEq)]
pub struct Straggler {
    /// The rank.
    pub rank: usize,
    /// Its busy seconds in the step that flagged it.
    pub busy_s: f64,
    /// The other ranks' median busy seconds in that step.
    pub others_median_s: f64,
    /// Consecutive steps over the bound.
    pub steps: u32,
}

impl Straggler {
    /// How many times the others' median its busy time was.
    pub fn ratio(&self) -> f64 {
        if self.others_median_s > 0.0 {
            self.busy_s / self.others_median_s
        } else {
            f64::INFINITY
        }
    }
}

impl std::fmt::Display for Straggler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} is a straggler: busy {:.1} ms a step against the other ranks' median \
             {:.1} ms ({:.1}x) for {} steps in a row",
            self.rank,
            self.busy_s * 1e3,
            self.others_median_s * 1e3,
            self.ratio(),
            self.steps
        )
    }
}

/// Each rank's streak of steps over the bound (STRAG-1, STRAG-2).
#[derive(Clone, Debug)]
pub struct Stragglers {
    policy: StragglerPolicy,
    streak: Vec<u32>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl Stragglers {
    /// A detector with `policy`.
    pub fn new(policy: StragglerPolicy) -> Self {
        Stragglers { policy, streak: Vec::new() }
    }

    /// Reads one step's busy seconds per rank; returns the ranks flagged at this step.
    pub fn observe(&mut self, busy_s: &[f32]) -> Vec<Straggler> {
        if busy_s.len() < 2 {
            return Vec::new(); // STRAG-2
        }
        self.streak.resize(busy_s.len(), 0);
        let p = self.policy;
        let mut out = Vec::new();
        for (r, &b) in busy_s.iter().enumerate() {
            let others: Vec<f64> = busy_s
                .iter()
                .enumerate()
                .filter(|(q, _)| *q != r)
                .map(|(_, &x)| f64::from(x))
                .collect();
            let (b, m) = (f64::from(b), median(others));
            if b >= p.factor * m && b - m >= p.min_excess_s {
                self.streak[r] += 1;
                if self.streak[r] == p.steps {
                    out.push(Straggler { rank: r, busy_s: b, others_median_s: m, steps: p.steps });
                }
            } else {
                self.streak[r] = 0;
            }
        }
        out
    }

    /// The ranks flagged now (streak at least `steps`).
    pub fn flagged(&self) -> Vec<usize> {
        let n = self.policy.steps.max(1);
        (0..self.streak.len()).filter(|&r| self.streak[r] >= n).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy() -> StragglerPolicy {
        StragglerPolicy { factor: 3.0, steps: 3, min_excess_s: 0.005 }
    }

    #[test]
    fn a_rank_slow_for_n_steps_is_flagged_once_strag_1() {
        let mut d = Stragglers::new(policy());
        let slow = [0.010, 0.040, 0.011];
        assert!(d.observe(&slow).is_empty());
        assert!(d.observe(&slow).is_empty());
        let f = d.observe(&slow);
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].rank, f[0].steps), (1, 3));
        assert!((f[0].ratio() - 0.040 / 0.0105).abs() < 1e-3, "{}", f[0]);
        assert!(f[0].to_string().contains("rank 1 is a straggler"), "{}", f[0]);
        assert_eq!(d.flagged(), vec![1]);
        assert!(d.observe(&slow).is_empty(), "reported once");
        // A step within the bound ends the streak; a new one is reported again.
        assert!(d.observe(&[0.010, 0.012, 0.011]).is_empty());
        assert!(d.flagged().is_empty());
        for _ in 0..2 {
            assert!(d.observe(&slow).is_empty());
        }
        assert_eq!(d.observe(&slow).len(), 1);
    }

    #[test]
    fn two_ranks_compare_with_each_other_and_noise_is_not_a_straggler_strag_1() {
        let mut d = Stragglers::new(policy());
        // With two ranks the slow one is measured against the other, not a median it lifts.
        let flags: Vec<_> = (0..3).flat_map(|_| d.observe(&[0.002, 0.030])).collect();
        assert_eq!(flags.iter().map(|f| f.rank).collect::<Vec<_>>(), vec![1]);
        // 4x but 1.5 ms over: scheduling noise, not a straggler.
        let mut d = Stragglers::new(policy());
        assert!((0..10).all(|_| d.observe(&[0.0005, 0.002]).is_empty()));
    }

    #[test]
    fn one_rank_or_no_figures_flag_nothing_strag_2() {
        let mut d = Stragglers::new(StragglerPolicy { steps: 1, ..policy() });
        assert!(d.observe(&[1.0]).is_empty());
        assert!(d.observe(&[]).is_empty());
        assert!(d.observe(&[0.001, 1.0]).len() == 1);
        assert!(d.observe(&[]).is_empty());
        assert_eq!(d.flagged(), vec![1], "a step without figures changes no streak");
    }

    proptest! {
        /// STRAG-1: ranks within `factor` of the others are never flagged, however long.
        #[test]
        fn ranks_within_the_factor_are_never_flagged(
            busy in prop::collection::vec(prop::collection::vec(0.01f32..0.029, 2..8), 1..20),
        ) {
            let mut d = Stragglers::new(StragglerPolicy { steps: 1, ..policy() });
            for step in &busy {
                prop_assert!(d.observe(step).is_empty());
            }
        }
    }
}
