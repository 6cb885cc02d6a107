//! What each piece of a step's compute costs on a profiled machine: matrix products counted
//! from the model's parameter shapes (a 2-D parameter `[a, b]` is one `rows x a x b` product
//! forward, and two backward: its gradient and the input's), `gpt`'s attention from its
//! configuration and its exact GELU at the profiled time per element, optimizer updates as
//! memory traffic.
//!
//! Elementwise work (norms, softmaxes, residual adds, copies, lookups) is charged as memory
//! traffic when the caller gives each call's tensor bytes (one microbatch run once, ACTEST-2:
//! shapes, not timings): every byte a call makes, less its matrix products' outputs, is
//! written once and read once at the profiled memory bandwidth. Convolutions are not counted:
//! a model with a parameter of more than two dimensions has no compute estimate
//! ([`CallCosts::of`] says so).
//!
//! Invariants:
//! - PLAN-2: compute costs scale with the rows of a microbatch and the ranks sharing a node's
//!   cores: twice the rows or twice the ranks per core cost twice the time; the first call
//!   computes no input gradient.
//! - PLAN-7: a call's elementwise charge is its tensor traffic less its matrix products'
//!   outputs, twice over the memory bandwidth, never negative.

use shardline_models::nn::GptConfig;
use shardline_models::{ModelSpec, UnitSpec};

use super::profile::Profile;
use crate::optim::Optimizer;

/// The compute of one call of the forward pass, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallCost {
    /// Its forward.
    pub forward_s: f64,
    /// Its backward up to the unit's gradients (what goes before the reduction's hand-off).
    pub grads_s: f64,
    /// Its input gradient (after the hand-off, ENG-9; none for the first call).
    pub input_grad_s: f64,
}

/// A step's compute costs on one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct CallCosts {
    /// Per call of the forward pass.
    pub calls: Vec<CallCost>,
    /// Per unit, its optimizer update.
    pub update_s: Vec<f64>,
}

/// How a job's ranks use the machine.
#[derive(Clone, Copy, Debug)]
pub struct Share {
    /// Ranks on one node (they share its cores).
    pub ranks_per_node: usize,
    /// Compute threads per rank.
    pub threads: usize,
}

impl Share {
    /// How much slower each rank computes than one thread alone: the profile's shared GEMM
    /// probe at ranks x threads, else ranks x threads over cores, at least 1 (PLAN-2).
    pub fn slowdown(&self, profile: &Profile) -> f64 {
        profile.sharing_slowdown(self.ranks_per_node * self.threads)
    }
}

/// Bytes an update reads and writes per element stepped: parameter, gradient and each
/// optimizer state value read, parameter and state written.
fn update_bytes_per_elem(opt: &Optimizer) -> f64 {
    let k = opt.state_len_per_param() as f64;
    4.0 * (2.0 + k + 1.0 + k)
}

impl CallCosts {
    /// The costs of `calls` (the unit of each call) of a model of `spec`, on microbatches of
    /// `rows` rows (samples, or tokens for `gpt`, whose configuration and samples per
    /// microbatch `gpt` gives), each rank stepping `stepped[u]` elements of unit `u` with
    /// `opt`; the reason when the model has layers this does not count.
    #[allow(clippy::too_many_arguments)]
    pub fn of(
        (spec, calls): (&ModelSpec, &[usize]),
        gpt: Option<(&GptConfig, usize)>,
        rows: usize,
        (stepped, opt): (&[usize], &Optimizer),
        traffic: Option<&[(u64, u64)]>,
        profile: &Profile,
        share: Share,
    ) -> std::result::Result<Self, String> {
        let slow = share.slowdown(profile);
        let gemm = |m: usize, n: usize, k: usize| {
            if m * n * k == 0 {
                return 0.0;
            }
            2.0 * (m * n * k) as f64 / (profile.gemm_gflops(m, n, k) * 1e9) * slow
        };
        let mut out = Vec::with_capacity(calls.len());
        for (c, &u) in calls.iter().enumerate() {
            let unit = &spec.units[u];
            if let Some(p) = unit.params.iter().find(|p| p.shape.len() > 2) {
                return Err(format!(
                    "{} has {} of shape {:?}: convolutions are not counted",
                    spec.name, p.name, p.shape
                ));
            }
            // A unit called again later (a tied root) runs its matrices in its last call.
            let last = !calls[c + 1..].contains(&u);
            let mut cost = CallCost::default();
            if last {
                cost = matrices(unit, rows, c > 0, &gemm);
            }
            if let Some((g, batch)) = gpt {
                if unit.params.iter().any(|p| p.name.ends_with("attn.c_attn.weight")) {
                    // Causal: half of each T x T product; forward QK^T and PV, backward the
                    // scores again, dV, dP, dQ and dK.
                    let (t, cdim) = (g.block_size, g.n_embd);
                    let half = (batch * t * t * cdim) as f64;
                    let blk = t.min(64);
                    let rate = profile.gemm_gflops(blk, blk, cdim / g.n_head.max(1)) * 1e9;
                    cost.forward_s += 2.0 * half / rate * slow;
                    cost.grads_s += 5.0 * half / rate * slow;
                }
                if let Some(fc) = unit.params.iter().find(|p| p.name.ends_with("mlp.c_fc.weight")) {
                    // The exact GELU over the MLP's hidden rows, its derivative kept for
                    // backward (whose product with the gradient is not counted).
                    cost.forward_s += (rows * fc.shape[0]) as f64 * profile.gelu_ns * 1e-9 * slow;
                }
            }
            if let Some(&(fwd, bwd)) = traffic.and_then(|t| t.get(c)) {
                // PLAN-7: the matrix products' outputs are their own cost.
                let (mf, mb) = if last { matrix_outputs(unit, rows) } else { (0, 0) };
                let per_byte = 2.0 / (profile.memory_gbps * 1e9) * slow;
                cost.forward_s += fwd.saturating_sub(mf) as f64 * per_byte;
                cost.grads_s += bwd.saturating_sub(mb) as f64 * per_byte;
            }
            out.push(cost);
        }
        let per = update_bytes_per_elem(opt);
        let update_s =
            stepped.iter().map(|&n| n as f64 * per / (profile.memory_gbps * 1e9) * slow).collect();
        Ok(CallCosts { calls: out, update_s })
    }
}

/// Bytes of the outputs of one call's matrix products on `rows` rows: forward, each
/// `[a, b]` parameter's `rows x a`; backward, each input gradient's `rows x b`.
fn matrix_outputs(unit: &UnitSpec, rows: usize) -> (u64, u64) {
    unit.params.iter().fold((0, 0), |(f, b), p| match p.shape[..] {
        [a, k] => (f + (rows * a * 4) as u64, b + (rows * k * 4) as u64),
        _ => (f, b),
    })
}

/// The matrix products of one call of `unit` on `rows` rows: each 2-D parameter forward, its
/// gradient and (`input_grad`) the input's; a unit whose first parameter is a matrix computes
/// that input gradient after the hand-off (ENG-9).
fn matrices(
    unit: &UnitSpec,
    rows: usize,
    input_grad: bool,
    gemm: &impl Fn(usize, usize, usize) -> f64,
) -> CallCost {
    let mut cost = CallCost::default();
    for (j, p) in unit.params.iter().enumerate() {
        let [a, b] = p.shape[..] else { continue };
        let t = gemm(rows, a, b);
        cost.forward_s += t;
        cost.grads_s += t;
        // The input gradient of the unit's first matrix is its input's, computed after the
        // hand-off; the others' lie inside the unit's backward.
        match (j, input_grad) {
            (0, true) => cost.input_grad_s += t,
            (0, false) => {}
            _ => cost.grads_s += t,
        }
    }
    cost
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::SgdConfig;
    use crate::plan::profile::GemmRow;
    use shardline_models::ParamSpec;

    fn spec() -> ModelSpec {
        let unit = |name: &str, a, b| UnitSpec {
            name: name.into(),
            params: vec![
                ParamSpec { name: format!("{name}.weight"), shape: vec![a, b] },
                ParamSpec { name: format!("{name}.bias"), shape: vec![a] },
            ],
            buffers: vec![],
        };
        ModelSpec { name: "two".into(), units: vec![unit("fc0", 32, 16), unit("fc1", 8, 32)] }
    }

    fn profile(cores: usize) -> Profile {
        Profile {
            note: String::new(),
            cores,
            memory_gbps: 10.0,
            gelu_ns: 0.0,
            gemm_shared: vec![],
            gemm: vec![GemmRow { m: 64, n: 64, k: 64, gflops: 1.0, source: None }],
            collectives: vec![],
            published: None,
            transports_default: None,
            device_memory: None,
            gemm_by: Default::default(),
            sources: vec![],
        }
    }

    /// PLAN-2: rows and ranks per core scale the time; the first call has no input gradient;
    /// a 4-D parameter is refused by name.
    #[test]
    fn costs_scale_with_rows_and_sharing_plan_2() {
        let opt = Optimizer::Sgd(SgdConfig::default());
        let one = Share { ranks_per_node: 1, threads: 1 };
        let c = |rows, share, cores| {
            let updates = (&[1, 1][..], &opt);
            let p = profile(cores);
            CallCosts::of((&spec(), &[0, 1]), None, rows, updates, None, &p, share).unwrap()
        };
        let base = c(10, one, 1);
        assert!((base.calls[0].forward_s - 2.0 * 10.0 * 32.0 * 16.0 / 1e9).abs() < 1e-15);
        assert_eq!(base.calls[0].input_grad_s, 0.0, "the data's gradient is never computed");
        assert!(base.calls[1].input_grad_s > 0.0);
        let double = c(20, one, 1);
        assert!((double.calls[1].grads_s - 2.0 * base.calls[1].grads_s).abs() < 1e-15);
        let shared = c(10, Share { ranks_per_node: 2, threads: 1 }, 1);
        assert!((shared.calls[1].forward_s - 2.0 * base.calls[1].forward_s).abs() < 1e-15);
        assert_eq!(c(10, Share { ranks_per_node: 2, threads: 1 }, 2), base);
        let mut conv = spec();
        conv.units[0].params[0].shape = vec![8, 3, 3, 3];
        let e = CallCosts::of((&conv, &[0, 1]), None, 10, (&[1, 1], &opt), None, &profile(1), one);
        assert!(e.unwrap_err().contains("fc0.weight"));
    }

    /// PLAN-7: a call's tensor traffic, less its products' outputs, costs twice its bytes over
    /// the memory bandwidth; traffic below the outputs costs nothing.
    #[test]
    fn elementwise_work_costs_its_traffic_plan_7() {
        let opt = Optimizer::Sgd(SgdConfig::default());
        let one = Share { ranks_per_node: 1, threads: 1 };
        let (p, updates) = (profile(1), (&[1, 1][..], &opt));
        let c = |t: Option<&[(u64, u64)]>| {
            CallCosts::of((&spec(), &[0, 1]), None, 10, updates, t, &p, one).unwrap()
        };
        let base = c(None);
        // Call 0 (fc0, [32, 16]) on 10 rows: outputs 10 x 32 forward, 10 x 16 backward.
        let (out_f, out_b) = (10 * 32 * 4, 10 * 16 * 4);
        let with = c(Some(&[(out_f + 1000, out_b + 500), (0, 0)]));
        let per_byte = 2.0 / 10e9;
        let df = with.calls[0].forward_s - base.calls[0].forward_s;
        let db = with.calls[0].grads_s - base.calls[0].grads_s;
        assert!((df - 1000.0 * per_byte).abs() < 1e-15, "{df}");
        assert!((db - 500.0 * per_byte).abs() < 1e-15, "{db}");
        assert_eq!(with.calls[1], base.calls[1], "no traffic below the outputs");
    }
}
