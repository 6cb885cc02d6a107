//! A machine profile: what `shardline plan` knows of the machine it predicts for, built from
//! microbenchmarks only (`shardline-bench machine-profile`): the collectives' times per op,
//! transport, world and size (`shardline-bench collectives --json` rows), the GEMM rate at a
//! few sizes, the memory bandwidth of one thread and the exact GELU's time per element.
//! Never from the training runs a plan predicts.
//!
//! A collective of `bytes` costs, per (op, transport, world), the measured time at the
//! nearest measured sizes with a straight line between them: on each segment a latency plus
//! bytes over a bandwidth (below the smallest size its time, above the largest the last
//! segment's bandwidth). The GEMM rate is interpolated in the logarithm of the product's
//! smallest dimension.
//!
//! Invariants:
//! - PLAN-1: a collective's cost is the measured time at every measured size, grows with the
//!   bytes, and is never below the smallest size's (the latency); a GEMM's rate at a probed
//!   size is the probe's.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Result, RuntimeError};

/// One measured collective (a row of `shardline-bench collectives --json`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CollectiveRow {
    /// `all-reduce`, `reduce-scatter`, `all-gather` or `broadcast`.
    pub op: String,
    /// Ranks.
    pub world: usize,
    /// `local`, `shm` or `tcp`.
    pub transport: String,
    /// Whole-buffer bytes (the all-gather's output, the reduce-scatter's input).
    pub bytes: u64,
    /// Median time of the slowest rank, microseconds.
    pub time_us: f64,
}

/// One GEMM probe: `m x n x k` products.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GemmRow {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Best rate, GFLOP/s, one thread.
    pub gflops: f64,
}

/// The GEMM probe run on several threads at once.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SharedGemm {
    /// Threads multiplying at once.
    pub threads: usize,
    /// Square size of the products.
    pub size: usize,
    /// Rate of each thread (the mean over them), GFLOP/s.
    pub gflops_per_thread: f64,
}

/// What `shardline plan` knows of a machine.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Profile {
    /// Free text: the host and how the profile was made.
    pub note: String,
    /// Cores the machine gave its benchmarks (ranks of one node share them).
    pub cores: usize,
    /// Single-thread memory bandwidth, GB/s, counting bytes read + written.
    pub memory_gbps: f64,
    /// GEMM probes, one thread.
    pub gemm: Vec<GemmRow>,
    /// GEMM rate per thread with 1, 2, ... threads multiplying at once (ranks of a node
    /// share its cores, and the machine's other work shares them too); empty: not probed.
    #[serde(default)]
    pub gemm_shared: Vec<SharedGemm>,
    /// The exact GELU's forward keeping its derivative, nanoseconds per element (0: not
    /// probed).
    #[serde(default)]
    pub gelu_ns: f64,
    /// Collectives measured.
    pub collectives: Vec<CollectiveRow>,
}

impl Profile {
    /// Reads a profile file; a file that does not parse names itself.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| RuntimeError::config(format!("--profile {}: {e}", path.display())))?;
        let p: Profile = serde_json::from_str(&text).map_err(|e| {
            RuntimeError::config(format!(
                "--profile {}: not a machine profile: {e}",
                path.display()
            ))
        })?;
        if p.gemm.is_empty() || p.memory_gbps <= 0.0 || p.cores == 0 {
            return Err(RuntimeError::config(format!(
                "--profile {}: needs GEMM probes, a memory bandwidth and a core count",
                path.display()
            )));
        }
        Ok(p)
    }

    /// How much slower each of `threads` threads multiplies than one alone: the shared
    /// probe's ratio where it was run at that count, else threads over cores (at least 1).
    pub fn sharing_slowdown(&self, threads: usize) -> f64 {
        let rate = |t: usize| {
            self.gemm_shared.iter().find(|g| g.threads == t).map(|g| g.gflops_per_thread)
        };
        match (rate(1), rate(threads)) {
            (Some(one), Some(t)) if t > 0.0 => (one / t).max(1.0),
            _ => (threads as f64 / self.cores.max(1) as f64).max(1.0),
        }
    }

    /// The transports measured at `world`.
    pub fn transports(&self, world: usize) -> Vec<String> {
        let mut t: Vec<String> = self
            .collectives
            .iter()
            .filter(|r| r.world == world)
            .map(|r| r.transport.clone())
            .collect();
        t.sort();
        t.dedup();
        t
    }

    /// Seconds of one `op` of `bytes` over `transport` at `world` (PLAN-1); an error names
    /// what the profile lacks. At world 1 a collective moves nothing: free.
    pub fn collective_s(&self, op: &str, transport: &str, world: usize, bytes: u64) -> Result<f64> {
        if world <= 1 {
            return Ok(0.0);
        }
        let mut pts: Vec<(f64, f64)> = self
            .collectives
            .iter()
            .filter(|r| r.op == op && r.transport == transport && r.world == world)
            .map(|r| (r.bytes as f64, r.time_us * 1e-6))
            .collect();
        if pts.is_empty() {
            return Err(RuntimeError::config(format!(
                "the profile has no {op} over {transport} at world {world} (it measured: {})",
                self.measured()
            )));
        }
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(piecewise(&pts, bytes as f64))
    }

    /// (op, transport, world) triples measured, for messages.
    fn measured(&self) -> String {
        let mut v: Vec<String> = self
            .collectives
            .iter()
            .map(|r| format!("{} {} w{}", r.op, r.transport, r.world))
            .collect();
        v.sort();
        v.dedup();
        v.join(", ")
    }

    /// GFLOP/s of an `m x n x k` product on one thread (PLAN-1), interpolated in the log of
    /// the smallest dimension between the probes'.
    pub fn gemm_gflops(&self, m: usize, n: usize, k: usize) -> f64 {
        let size = |r: &GemmRow| (r.m.min(r.n).min(r.k).max(1) as f64).ln();
        let mut pts: Vec<(f64, f64)> = self.gemm.iter().map(|r| (size(r), r.gflops)).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let x = (m.min(n).min(k).max(1) as f64).ln();
        match (pts.first(), pts.last()) {
            (Some(&(x0, r0)), _) if x <= x0 => r0,
            (_, Some(&(x1, r1))) if x >= x1 => r1,
            _ => {
                let j = pts.iter().position(|p| p.0 >= x).unwrap_or(pts.len() - 1);
                let ((xa, ra), (xb, rb)) = (pts[j - 1], pts[j]);
                ra + (rb - ra) * (x - xa) / (xb - xa)
            }
        }
    }
}

/// The measured cost at `x` on the line through the points around it (sorted by size): each
/// segment a latency plus bytes over a bandwidth; flat below the first point, the last
/// segment's slope beyond the last.
fn piecewise(pts: &[(f64, f64)], x: f64) -> f64 {
    let (x0, t0) = pts[0];
    if x <= x0 || pts.len() == 1 {
        return if pts.len() == 1 { t0 * (x / x0).max(1.0) } else { t0 };
    }
    let j = pts.iter().position(|p| p.0 >= x).unwrap_or(pts.len() - 1);
    let ((xa, ta), (xb, tb)) = (pts[j - 1], pts[j]);
    // A slower small size than a larger one (noise) never makes a cost fall with bytes.
    let slope = ((tb - ta) / (xb - xa)).max(0.0);
    (ta + slope * (x - xa)).max(t0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Profile {
        let row = |bytes, us| CollectiveRow {
            op: "all-gather".into(),
            world: 2,
            transport: "local".into(),
            bytes,
            time_us: us,
        };
        Profile {
            note: String::new(),
            cores: 2,
            memory_gbps: 10.0,
            gelu_ns: 0.0,
            gemm_shared: vec![],
            gemm: vec![
                GemmRow { m: 32, n: 32, k: 32, gflops: 10.0 },
                GemmRow { m: 256, n: 256, k: 256, gflops: 40.0 },
            ],
            collectives: vec![row(4096, 20.0), row(1 << 20, 200.0), row(1 << 22, 500.0)],
        }
    }

    /// PLAN-1: measured sizes cost what was measured, costs grow with the bytes, small ones
    /// cost the latency, world 1 is free, and a missing op is named.
    #[test]
    fn collective_costs_follow_the_measurements_plan_1() {
        let p = profile();
        let c = |b| p.collective_s("all-gather", "local", 2, b).unwrap();
        assert!((c(1 << 20) - 200e-6).abs() < 1e-12);
        assert!((c(4096) - 20e-6).abs() < 1e-12);
        assert!((c(16) - 20e-6).abs() < 1e-12, "below the smallest: the latency");
        let sizes = [16u64, 4096, 100_000, 1 << 20, 3 << 20, 1 << 22, 1 << 24];
        assert!(sizes.windows(2).all(|w| c(w[0]) <= c(w[1])));
        assert!(c(1 << 24) > c(1 << 22), "extrapolated with the last bandwidth");
        assert_eq!(p.collective_s("all-gather", "local", 1, 1 << 20).unwrap(), 0.0);
        let e = p.collective_s("reduce-scatter", "local", 2, 4096).unwrap_err().to_string();
        assert!(e.contains("reduce-scatter") && e.contains("all-gather local w2"), "{e}");
    }

    /// PLAN-2: threads sharing the machine slow each other down by the shared probe's
    /// ratio where it ran at that count, by threads over cores where it did not.
    #[test]
    fn sharing_slows_by_the_shared_probe_plan_2() {
        let mut p = profile();
        assert_eq!(p.sharing_slowdown(1), 1.0);
        assert_eq!(p.sharing_slowdown(4), 2.0, "4 threads on 2 cores, no probe");
        let g = |threads, gflops_per_thread| SharedGemm { threads, size: 64, gflops_per_thread };
        p.gemm_shared = vec![g(1, 40.0), g(2, 30.0), g(4, 10.0)];
        assert_eq!(p.sharing_slowdown(2), 40.0 / 30.0);
        assert_eq!(p.sharing_slowdown(4), 4.0);
        assert_eq!(p.sharing_slowdown(3), 1.5, "not probed at 3: threads over cores");
    }

    /// PLAN-1: a probed size's rate is the probe's; between probes it lies between them.
    #[test]
    fn gemm_rates_interpolate_between_probes_plan_1() {
        let p = profile();
        assert_eq!(p.gemm_gflops(32, 64, 32), 10.0);
        assert_eq!(p.gemm_gflops(256, 1024, 512), 40.0);
        assert_eq!(p.gemm_gflops(8, 8, 8), 10.0);
        let mid = p.gemm_gflops(90, 90, 90);
        assert!(mid > 10.0 && mid < 40.0, "{mid}");
    }
}
