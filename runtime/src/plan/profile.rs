//! A machine profile: what `shardline plan` knows of the machine it predicts for, built from
//! microbenchmarks only (`shardline-bench machine-profile`): the collectives' times per op,
//! transport, world and size (`shardline-bench collectives --json` rows), the GEMM rate at a
//! few sizes, the memory bandwidth of one thread and the exact GELU's time per element.
//! Never from the training runs a plan predicts.
//!
//! A collective of `bytes` costs, per (op, transport, world), the measured time at the
//! nearest measured sizes with a straight line between them: on each segment a latency plus
//! bytes over a bandwidth (below the smallest size its time, above the largest the last
//! segment's bandwidth). A matrix product probed at its own shape and form (`products`: the
//! shapes a model makes, timed through the layers' entry points) costs the probe's rate;
//! any other product the square GEMM probes' rate, interpolated in the logarithm of its size
//! ([`GemmBy`]): a published profile, which has no such probes, prices every product at its
//! published GEMM efficiency that way. Fresh tensors cost a time per byte by their size
//! (`alloc`: allocate, first touch and free, over writing the same bytes into a buffer in
//! use), interpolated in the logarithm of the size; none without the probe.
//!
//! A profile may instead come from published figures (`published` says so, and every figure
//! carries its `source`): a collective row is then a formula, not a measurement. It holds
//! for worlds from `world` to `world_max` and costs a ring's: `steps` latencies plus the
//! bytes each rank moves over a bus bandwidth, as nccl-tests defines busbw (all-reduce
//! `2(n-1)/n` of the buffer, reduce-scatter and all-gather `(n-1)/n`). A job over several
//! nodes runs the executor's hierarchical schedule (`algo::hier`, what `Algorithm::Auto`
//! picks on a uniform multi-node topology): a ring inside each node, a ring across nodes
//! among ranks of the same local rank on `1/ranks_per_node` of the buffer, each priced on
//! its own transport ([`Profile::hierarchical_s`]).
//!
//! Invariants:
//! - PLAN-1: a collective's cost is the measured time at every measured size, grows with the
//!   bytes, and is never below the smallest size's (the latency); a GEMM's rate at a probed
//!   size is the probe's.
//! - PLAN-12: a product whose shape and form were probed costs its flops at the probe's rate,
//!   whatever the square probes say; an allocation's extra time per byte is the probe's at a
//!   probed size, between its neighbours' otherwise, the end rows' beyond, and zero without
//!   an allocation probe.
//! - PLAN-8: a formula row's all-reduce costs twice its reduce-scatter's bandwidth term, a
//!   ring's; the hierarchical cost is the sum of its phases on their transports, and equals
//!   the one-node cost when there is one node.

use std::path::Path;

use serde::{Deserialize, Serialize};
use shardline_models::nn::products::Product;

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
    /// Whole-buffer bytes (the all-gather's output, the reduce-scatter's input); 0 in a
    /// formula row.
    #[serde(default)]
    pub bytes: u64,
    /// Median time of the slowest rank, microseconds; 0 in a formula row.
    #[serde(default)]
    pub time_us: f64,
    /// A formula row: the ring's cost at every world from `world` to this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_max: Option<usize>,
    /// A formula row: bus bandwidth, GB/s (nccl-tests' busbw).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busbw_gbps: Option<f64>,
    /// A formula row: latency of each of the ring's steps, microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_latency_us: Option<f64>,
    /// Where the figures come from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

impl CollectiveRow {
    /// Seconds of a formula row's ring over `world` ranks moving `bytes` (PLAN-8); `None`
    /// for a measured row.
    fn formula_s(&self, world: usize, bytes: u64) -> Option<f64> {
        let bw = self.busbw_gbps? * 1e9;
        let n = world as f64;
        let (factor, steps) = match self.op.as_str() {
            "all-reduce" => (2.0 * (n - 1.0) / n, 2.0 * (n - 1.0)),
            _ => ((n - 1.0) / n, n - 1.0),
        };
        Some(steps * self.step_latency_us.unwrap_or(0.0) * 1e-6 + bytes as f64 * factor / bw)
    }
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
    /// Best rate, GFLOP/s, one thread (one device in a published profile).
    pub gflops: f64,
    /// Where the rate comes from (a published profile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// A product of a model's, timed at its own shape and form through the entry point the
/// layers call (`nn::Gemm`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProductRow {
    /// The product.
    #[serde(flatten)]
    pub product: Product,
    /// Best rate, GFLOP/s, one thread.
    pub gflops: f64,
}

/// Fresh allocations of one size: what making a tensor costs beyond its bytes' traffic.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct AllocRow {
    /// Bytes of each allocation.
    pub bytes: u64,
    /// Allocating, touching every page and freeing, less writing as many bytes into a buffer
    /// already in use, nanoseconds per byte (best pass).
    pub ns_per_byte: f64,
}

/// The optimizer's update timed on this machine (PLAN-17).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct UpdateRow {
    /// Optimizer state words per parameter: 0 plain SGD, 1 SGD with momentum, 2 AdamW.
    pub state_words: usize,
    /// One step with the gradients' squared norm taken on the way
    /// (`Optimizer::step_sq_norm`, a sharded stage's update), nanoseconds per parameter (best
    /// pass).
    pub ns_per_elem: f64,
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
    /// Products probed at their own shape and form (PLAN-12); empty: every product at the
    /// square probes' rate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub products: Vec<ProductRow>,
    /// Fresh allocations by size (PLAN-12); empty: not charged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alloc: Vec<AllocRow>,
    /// Optimizer updates timed by state size (PLAN-17); empty: charged as memory traffic.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub updates: Vec<UpdateRow>,
    /// Collectives measured, or formula rows.
    pub collectives: Vec<CollectiveRow>,
    /// Set when the figures are published ones, not measured here: the words
    /// "from published figures, not measured here" and what the profile describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published: Option<String>,
    /// The transport inside a node and the one across nodes (`plan`'s default
    /// `--transport`: the first on one node, `INTRA/INTER` on several).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transports_default: Option<(String, String)>,
    /// Memory of one rank's device, bytes, with its source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<Figure>,
    /// How a product meets the GEMM probes: `smallest` (its smallest dimension, as a
    /// CPU's cache blocking sees it; the default) or `volume` (the cube root of
    /// `m x n x k`, as a GPU's rate grows with the work it is given).
    #[serde(default, skip_serializing_if = "GemmBy::is_smallest")]
    pub gemm_by: GemmBy,
    /// Where the memory bandwidth, the core count and the GELU figure come from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<String>,
}

/// How a product's size is read against the GEMM probes.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GemmBy {
    /// Its smallest dimension.
    #[default]
    Smallest,
    /// The cube root of `m x n x k`.
    Volume,
}

impl GemmBy {
    fn is_smallest(&self) -> bool {
        *self == GemmBy::Smallest
    }

    /// The size of an `m x n x k` product.
    fn size(self, m: usize, n: usize, k: usize) -> f64 {
        match self {
            GemmBy::Smallest => m.min(n).min(k).max(1) as f64,
            GemmBy::Volume => ((m.max(1) * n.max(1)) as f64 * k.max(1) as f64).cbrt(),
        }
    }
}

/// A published figure and where it comes from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Figure {
    /// The value.
    pub value: f64,
    /// Its source.
    pub source: String,
}

/// The profiles shipped in the binary: `--profile NAME`.
pub const SHIPPED: &[(&str, &str)] =
    &[("h100-8x-ib", include_str!("../../profiles/h100-8x-ib.json"))];

impl Profile {
    /// A shipped profile by name, else a profile file; one that does not parse names
    /// itself.
    pub fn load_named(name: &str) -> Result<Self> {
        match SHIPPED.iter().find(|s| s.0 == name) {
            Some((_, text)) => Self::parse(text, Path::new(name)),
            None => Self::load(Path::new(name)),
        }
    }

    /// Reads a profile file; a file that does not parse names itself.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            let names: Vec<&str> = SHIPPED.iter().map(|s| s.0).collect();
            RuntimeError::config(format!(
                "--profile {}: {e} (a file, or one of {})",
                path.display(),
                names.join(", ")
            ))
        })?;
        Self::parse(&text, path)
    }

    fn parse(text: &str, path: &Path) -> Result<Self> {
        let p: Profile = serde_json::from_str(text).map_err(|e| {
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
        if let Some(r) = p.collectives.iter().find(|r| {
            let formula = r.busbw_gbps.is_some();
            (formula && (r.busbw_gbps <= Some(0.0) || r.world_max < Some(r.world)))
                || (!formula && (r.bytes == 0 || r.time_us <= 0.0))
        }) {
            return Err(RuntimeError::config(format!(
                "--profile {}: the {} row over {} at world {} needs bytes and time_us, or \
                 busbw_gbps above 0 and world_max at least world",
                path.display(),
                r.op,
                r.transport,
                r.world
            )));
        }
        Ok(p)
    }

    /// Seconds of `op` on `bytes` over `nodes` nodes of `per_node` ranks: one node's ring
    /// on `intra`; across nodes the executor's hierarchical schedule (PLAN-8): the ring in
    /// each node on `intra` and the ring among the ranks of one local rank on `inter`, over
    /// `1/per_node` of the buffer.
    pub fn hierarchical_s(
        &self,
        op: &str,
        (intra, inter): (&str, &str),
        (nodes, per_node): (usize, usize),
        bytes: u64,
    ) -> Result<f64> {
        if nodes <= 1 {
            return self.collective_s(op, intra, per_node, bytes);
        }
        let part = bytes / per_node.max(1) as u64;
        let inside = |op| self.collective_s(op, intra, per_node, bytes);
        let across = |op| self.collective_s(op, inter, nodes, part);
        Ok(match op {
            "all-reduce" => {
                inside("reduce-scatter")? + across("all-reduce")? + inside("all-gather")?
            }
            "reduce-scatter" => inside("reduce-scatter")? + across("reduce-scatter")?,
            _ => across("all-gather")? + inside("all-gather")?,
        })
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
            .filter(|r| r.world == world || (r.world..=r.world_max.unwrap_or(0)).contains(&world))
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
        let formula = self.collectives.iter().find(|r| {
            r.op == op
                && r.transport == transport
                && (r.world..=r.world_max.unwrap_or(0)).contains(&world)
        });
        if let Some(s) = formula.and_then(|r| r.formula_s(world, bytes)) {
            return Ok(s);
        }
        let mut pts: Vec<(f64, f64)> = self
            .collectives
            .iter()
            .filter(|r| r.op == op && r.transport == transport && r.world == world)
            .filter(|r| r.busbw_gbps.is_none())
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
            .map(|r| match r.world_max {
                Some(m) => format!("{} {} w{}-{m}", r.op, r.transport, r.world),
                None => format!("{} {} w{}", r.op, r.transport, r.world),
            })
            .collect();
        v.sort();
        v.dedup();
        v.join(", ")
    }

    /// Seconds of one product on one thread, and whether its shape and form were probed
    /// (PLAN-12); else at [`Profile::gemm_gflops`].
    pub fn product_s(&self, p: &Product) -> (f64, bool) {
        if p.m * p.n * p.k == 0 {
            return (0.0, true);
        }
        match self.products.iter().find(|r| r.product == *p && r.gflops > 0.0) {
            Some(r) => (p.flops() / (r.gflops * 1e9), true),
            None => (p.flops() / (self.gemm_gflops(p.m, p.n, p.k) * 1e9), false),
        }
    }

    /// Extra seconds of making a fresh tensor of `bytes` (PLAN-12): the probe's time per byte
    /// interpolated in the log of the size; 0 without the probe.
    pub fn alloc_s(&self, bytes: u64) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        let pts = self.alloc.iter().map(|r| ((r.bytes.max(1) as f64).ln(), r.ns_per_byte));
        let ns = interpolate(pts.collect(), (bytes as f64).ln()).unwrap_or(0.0);
        ns.max(0.0) * bytes as f64 * 1e-9
    }

    /// Seconds per parameter of an update keeping `state_words` words of optimizer state
    /// (PLAN-17), when the profile timed one.
    pub fn update_s_per_elem(&self, state_words: usize) -> Option<f64> {
        let row = self.updates.iter().find(|r| r.state_words == state_words)?;
        Some(row.ns_per_elem * 1e-9)
    }

    /// GFLOP/s of an `m x n x k` product on one thread (PLAN-1), interpolated in the log of
    /// its size ([`GemmBy`]) between the probes'.
    pub fn gemm_gflops(&self, m: usize, n: usize, k: usize) -> f64 {
        let by = self.gemm_by;
        let pts = self.gemm.iter().map(|r| (by.size(r.m, r.n, r.k).ln(), r.gflops)).collect();
        interpolate(pts, by.size(m, n, k).ln()).expect("a profile has at least one GEMM probe")
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

/// The value at `x` of the piecewise-linear curve through `pts` (x, value), held flat past
/// its ends; `None` without points.
fn interpolate(mut pts: Vec<(f64, f64)>, x: f64) -> Option<f64> {
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (&(x0, r0), &(x1, r1)) = (pts.first()?, pts.last()?);
    if x <= x0 {
        return Some(r0);
    }
    if x >= x1 {
        return Some(r1);
    }
    let j = pts.iter().position(|p| p.0 >= x).unwrap_or(pts.len() - 1);
    let ((xa, ra), (xb, rb)) = (pts[j - 1], pts[j]);
    Some(ra + (rb - ra) * (x - xa) / (xb - xa))
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
            world_max: None,
            busbw_gbps: None,
            step_latency_us: None,
            source: None,
        };
        Profile {
            note: String::new(),
            cores: 2,
            memory_gbps: 10.0,
            gelu_ns: 0.0,
            gemm_shared: vec![],
            gemm: vec![
                GemmRow { m: 32, n: 32, k: 32, gflops: 10.0, source: None },
                GemmRow { m: 256, n: 256, k: 256, gflops: 40.0, source: None },
            ],
            collectives: vec![row(4096, 20.0), row(1 << 20, 200.0), row(1 << 22, 500.0)],
            published: None,
            transports_default: None,
            device_memory: None,
            gemm_by: GemmBy::Smallest,
            sources: vec![],
            products: vec![],
            alloc: vec![],
            updates: vec![],
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
        // By volume, a thin product of much work meets the large probe.
        let mut v = profile();
        v.gemm_by = GemmBy::Volume;
        assert_eq!(p.gemm_gflops(32, 4096, 4096), 10.0);
        assert_eq!(v.gemm_gflops(32, 4096, 4096), 40.0);
        assert_eq!(v.gemm_gflops(256, 256, 256), 40.0);
    }

    /// PLAN-12: a probed product costs its flops at its own rate, another form or shape the
    /// square probes'; allocations interpolate by size, are flat beyond the probes and free
    /// without them; a profile without either still loads.
    #[test]
    fn products_and_allocations_at_their_probes_plan_12() {
        use shardline_models::nn::products::Form;
        let mut p = profile();
        let thin = Product { m: 1024, n: 128, k: 512, form: Form::Nt, accumulate: false };
        p.products.push(ProductRow { product: thin, gflops: 5.0 });
        let (t, probed) = p.product_s(&thin);
        assert!(probed && (t - thin.flops() / 5e9).abs() < 1e-15, "{t}");
        let nn = Product { form: Form::Nn, ..thin };
        let (t, probed) = p.product_s(&nn);
        let square = p.gemm_gflops(1024, 128, 512) * 1e9;
        assert!(!probed && (t - nn.flops() / square).abs() < 1e-15, "the square probes' rate");
        assert_eq!(p.alloc_s(1 << 20), 0.0, "no allocation probe: free");
        p.alloc = vec![
            AllocRow { bytes: 4096, ns_per_byte: 0.5 },
            AllocRow { bytes: 1 << 20, ns_per_byte: 0.1 },
        ];
        assert!((p.alloc_s(4096) - 4096.0 * 0.5e-9).abs() < 1e-15);
        assert!((p.alloc_s(1 << 24) - (1u64 << 24) as f64 * 0.1e-9).abs() < 1e-12);
        assert!((p.alloc_s(16) - 16.0 * 0.5e-9).abs() < 1e-15);
        let mid = p.alloc_s(1 << 16) / (1u64 << 16) as f64 * 1e9;
        assert!(mid > 0.1 && mid < 0.5, "{mid}");
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(Profile::parse(&text, Path::new("x")).unwrap(), p);
        let old = serde_json::to_string(&profile()).unwrap();
        assert!(!old.contains("products") && !old.contains("alloc"));
        assert!(Profile::parse(&old, Path::new("x")).unwrap().products.is_empty());
    }

    fn formula(op: &str, transport: &str, worlds: (usize, usize), gbps: f64) -> CollectiveRow {
        CollectiveRow {
            op: op.into(),
            world: worlds.0,
            transport: transport.into(),
            bytes: 0,
            time_us: 0.0,
            world_max: Some(worlds.1),
            busbw_gbps: Some(gbps),
            step_latency_us: Some(10.0),
            source: Some("test".into()),
        }
    }

    /// PLAN-8: a formula row's ring costs; the hierarchical schedule's phases add up, and
    /// one node is the ring inside it.
    #[test]
    fn formula_rows_cost_a_ring_and_nodes_add_phases_plan_8() {
        let mut p = profile();
        for op in ["all-reduce", "reduce-scatter", "all-gather"] {
            p.collectives.push(formula(op, "nv", (2, 8), 100.0));
            p.collectives.push(formula(op, "ib", (2, 128), 10.0));
        }
        let c = |op, t, w, b| p.collective_s(op, t, w, b).unwrap();
        let gb = 1u64 << 30;
        let rs = c("reduce-scatter", "nv", 8, gb);
        assert!((rs - (7.0 * 10e-6 + gb as f64 * 7.0 / 8.0 / 100e9)).abs() < 1e-12, "{rs}");
        let ar = c("all-reduce", "nv", 8, gb);
        assert!((ar - 2.0 * rs).abs() < 1e-12, "a ring all-reduce is twice its reduce-scatter");
        assert!(p.collective_s("all-reduce", "nv", 9, gb).is_err(), "beyond world_max");
        let h = |op, nodes| p.hierarchical_s(op, ("nv", "ib"), (nodes, 8), gb).unwrap();
        assert_eq!(h("all-reduce", 1), ar);
        let across = c("all-reduce", "ib", 4, gb / 8);
        assert!((h("all-reduce", 4) - (ar + across)).abs() < 1e-12);
        let ag = c("all-gather", "nv", 8, gb) + c("all-gather", "ib", 4, gb / 8);
        assert!((h("all-gather", 4) - ag).abs() < 1e-12);
        assert_eq!(p.transports(64), vec!["ib".to_string()]);
    }

    /// The shipped profile parses, is marked as published, and every figure has a source.
    #[test]
    fn the_shipped_profile_cites_every_figure_plan_8() {
        let p = Profile::load_named("h100-8x-ib").unwrap();
        assert!(p
            .published
            .as_deref()
            .unwrap()
            .contains("from published figures, not measured here"));
        assert!(p.collectives.iter().all(|r| r.source.as_deref().is_some_and(|s| !s.is_empty())));
        assert!(p.gemm.iter().all(|r| r.source.is_some()));
        assert!(p.device_memory.as_ref().is_some_and(|m| !m.source.is_empty()));
        let t = p.hierarchical_s("all-reduce", ("nvlink", "ib"), (128, 8), 1 << 30).unwrap();
        assert!(t > p.collective_s("all-reduce", "nvlink", 8, 1 << 30).unwrap());
        let e = Profile::load_named("no-such-profile").unwrap_err().to_string();
        assert!(e.contains("--profile no-such-profile") && e.contains("h100-8x-ib"), "{e}");
    }
}
