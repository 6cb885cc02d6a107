//! What each piece of a step's compute costs on a profiled machine, split into matrix
//! products, elementwise work and fresh allocations ([`Parts`], each in `plan --json`).
//!
//! Matrix products: with one microbatch run once (ACTEST-2, PROD-1: shapes, not timings),
//! the products each call ran, each at its own shape and form ([`Profile::product_s`],
//! PLAN-12); otherwise (a `gpt` counted from its shape) counted from the model's parameter
//! shapes (a 2-D parameter `[a, b]` is one `rows x a x b` product forward, and two backward:
//! its gradient and the input's) and `gpt`'s attention from its configuration, at the square
//! probes' rate. `gpt`'s exact GELU costs the profiled time per element; optimizer updates
//! cost the profile's timed update per parameter, or their memory traffic without one.
//!
//! Elementwise work (norms, softmaxes, residual adds, copies, lookups) is charged as memory
//! traffic when the caller gives each call's tensor bytes: every byte a call makes, less its
//! matrix products' outputs, is written once and read once at the profiled memory bandwidth.
//! Each tensor made is also a fresh allocation, at the profile's time per byte for its size
//! ([`Profile::alloc_s`]). Convolutions are not counted: a model with a parameter of more
//! than two dimensions has no compute estimate ([`CallCosts::of`] says so).
//!
//! Invariants:
//! - PLAN-2: compute costs scale with the rows of a microbatch and the ranks sharing a node's
//!   cores: twice the rows or twice the ranks per core cost twice the time; the first call
//!   computes no input gradient.
//! - PLAN-7: a call's elementwise charge is its tensor traffic less its matrix products'
//!   outputs, twice over the memory bandwidth, never negative.
//! - PLAN-14: the lanes' CPU time ([`lanes_extra_s`]) is zero while the node's idle cores
//!   absorb the lanes' busy time over the compute, never negative, grows with the lanes'
//!   time, and with every core computing adds each rank's share of all its node's lanes'
//!   time: ranks x lanes over the cores computing.
//! - PLAN-17: an update costs each parameter it steps at the profile's timed update for its
//!   optimizer's state size; a profile without one charges its memory traffic.
//! - PLAN-13: with the calls' recorded work, a call's products cost the sum of each
//!   product's own time (PLAN-12) and its allocations the sum of each tensor's; a piece's
//!   total is the sum of its parts.

use shardline_models::nn::GptConfig;
use shardline_models::{ModelSpec, UnitSpec};

use serde::Serialize;

use super::profile::Profile;
use crate::activations::{Made, MicrobatchMemory};
use crate::optim::Optimizer;
use shardline_models::nn::products::Product;

/// A piece of compute by what it is, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Parts {
    /// Matrix products.
    pub products_s: f64,
    /// Elementwise work: memory traffic (PLAN-7) and `gpt`'s GELU.
    pub elementwise_s: f64,
    /// Fresh allocations (PLAN-12).
    pub alloc_s: f64,
    /// The lanes' copies and reductions on the same cores, charged to this compute
    /// (PLAN-14).
    pub lanes_s: f64,
}

impl Parts {
    /// All of it (PLAN-13).
    pub fn total(&self) -> f64 {
        self.products_s + self.elementwise_s + self.alloc_s + self.lanes_s
    }

    /// Each part plus `other`'s.
    pub fn add(&mut self, other: &Parts) {
        self.products_s += other.products_s;
        self.elementwise_s += other.elementwise_s;
        self.alloc_s += other.alloc_s;
        self.lanes_s += other.lanes_s;
    }

    /// These parts with the lanes' CPU time added at `f - 1` times their total (PLAN-14).
    pub fn stretched(&self, f: f64) -> Parts {
        Parts { lanes_s: self.lanes_s + self.total() * (f - 1.0), ..*self }
    }
}

/// The extra compute time of each rank when its node's lanes copy and reduce on the cores
/// its ranks compute on (PLAN-14): every lane's busy time, `lanes_s` per rank and step, is
/// taken as CPU time (a CPU transport's ops copy and reduce on a lane thread); the cores no
/// rank computes on absorb up to their idle time over the step's compute, `compute_s`, and
/// the rest is taken from the ranks' compute, spread over the cores computing.
pub fn lanes_extra_s(cores: usize, share: Share, compute_s: f64, lanes_s: f64) -> f64 {
    let computing = (share.ranks_per_node * share.threads).max(1) as f64;
    let cores = cores.max(1) as f64;
    let idle = (cores - computing).max(0.0);
    let stolen = (share.ranks_per_node as f64 * lanes_s - idle * compute_s).max(0.0);
    stolen / computing.min(cores)
}

impl CallCosts {
    /// These costs with the lanes' CPU time charged to the calls' compute at `f - 1` times
    /// each piece (PLAN-14); the updates, which run when the lanes have no reduction left,
    /// as they were.
    pub fn stretched(&self, f: f64) -> CallCosts {
        let calls = self
            .calls
            .iter()
            .map(|c| CallCost {
                forward: c.forward.stretched(f),
                grads: c.grads.stretched(f),
                input_grad: c.input_grad.stretched(f),
            })
            .collect();
        CallCosts { calls, ..self.clone() }
    }
}

/// The compute of one call of the forward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallCost {
    /// Its forward.
    pub forward: Parts,
    /// Its backward up to the unit's gradients (what goes before the reduction's hand-off).
    pub grads: Parts,
    /// Its input gradient (after the hand-off, ENG-9; none for the first call).
    pub input_grad: Parts,
}

impl CallCost {
    /// Seconds of its forward.
    pub fn forward_s(&self) -> f64 {
        self.forward.total()
    }

    /// Seconds of its backward up to the unit's gradients.
    pub fn grads_s(&self) -> f64 {
        self.grads.total()
    }

    /// Seconds of its input gradient.
    pub fn input_grad_s(&self) -> f64 {
        self.input_grad.total()
    }
}

/// A step's compute costs on one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct CallCosts {
    /// Per call of the forward pass.
    pub calls: Vec<CallCost>,
    /// Per unit, its optimizer update.
    pub update_s: Vec<f64>,
    /// Flops of one microbatch's products, and of those priced at their own probe
    /// (PLAN-12).
    pub flops: (f64, f64),
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
        once: Option<&MicrobatchMemory>,
        profile: &Profile,
        share: Share,
    ) -> std::result::Result<Self, String> {
        let slow = share.slowdown(profile);
        let mut flops = (0.0, 0.0);
        let gemm = |m: usize, n: usize, k: usize| {
            if m * n * k == 0 {
                return 0.0;
            }
            2.0 * (m * n * k) as f64 / (profile.gemm_gflops(m, n, k) * 1e9) * slow
        };
        let traffic = once.map(|o| &o.traffic[..]);
        // The recorded work, when there is one per call (a run, not a count).
        let work = once.map(|o| &o.work[..]).filter(|w| w.len() == calls.len());
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
            if let Some(w) = work.map(|w| &w[c]) {
                // PLAN-13: each product at its own shape and form, each tensor made fresh.
                let mut piece = |made: &Made, parts: &mut Parts| {
                    for p in &made.products {
                        let (t, probed) = profile.product_s(p);
                        parts.products_s += t * slow;
                        flops.0 += p.flops();
                        if probed {
                            flops.1 += p.flops();
                        }
                    }
                    parts.alloc_s +=
                        made.tensors.iter().map(|&b| profile.alloc_s(b)).sum::<f64>() * slow;
                };
                piece(&w.forward, &mut cost.forward);
                piece(&w.backward, &mut cost.grads);
                piece(&w.input_grad, &mut cost.input_grad);
            } else if last {
                cost = matrices(unit, rows, c > 0, &gemm);
            }
            if let Some((g, batch)) = gpt {
                if work.is_none()
                    && unit.params.iter().any(|p| p.name.ends_with("attn.c_attn.weight"))
                {
                    // Causal: half of each T x T product; forward QK^T and PV, backward the
                    // scores again, dV, dP, dQ and dK.
                    let (t, cdim) = (g.block_size, g.n_embd);
                    let half = (batch * t * t * cdim) as f64;
                    let blk = t.min(64);
                    let rate = profile.gemm_gflops(blk, blk, cdim / g.n_head.max(1)) * 1e9;
                    cost.forward.products_s += 2.0 * half / rate * slow;
                    cost.grads.products_s += 5.0 * half / rate * slow;
                }
                if let Some(fc) = unit.params.iter().find(|p| p.name.ends_with("mlp.c_fc.weight")) {
                    // The exact GELU over the MLP's hidden rows, its derivative kept for
                    // backward (whose product with the gradient is not counted).
                    cost.forward.elementwise_s +=
                        (rows * fc.shape[0]) as f64 * profile.gelu_ns * 1e-9 * slow;
                }
            }
            if let Some(&(fwd, bwd)) = traffic.and_then(|t| t.get(c)) {
                // PLAN-7: the matrix products' outputs are their own cost.
                let (mf, mb) = match work.map(|w| &w[c]) {
                    Some(w) => (
                        written(&w.forward.products),
                        written(&w.backward.products) + written(&w.input_grad.products),
                    ),
                    None if last => matrix_outputs(unit, rows),
                    None => (0, 0),
                };
                let per_byte = 2.0 / (profile.memory_gbps * 1e9) * slow;
                cost.forward.elementwise_s += fwd.saturating_sub(mf) as f64 * per_byte;
                cost.grads.elementwise_s += bwd.saturating_sub(mb) as f64 * per_byte;
            }
            out.push(cost);
        }
        // PLAN-17: the update's own probe where the profile has one, else its traffic.
        let per_elem = profile
            .update_s_per_elem(opt.state_len_per_param())
            .unwrap_or(update_bytes_per_elem(opt) / (profile.memory_gbps * 1e9));
        let update_s = stepped.iter().map(|&n| n as f64 * per_elem * slow).collect();
        Ok(CallCosts { calls: out, update_s, flops })
    }
}

/// Bytes of the outputs that `products` write rather than add into.
fn written(products: &[Product]) -> u64 {
    products.iter().filter(|p| !p.accumulate).map(|p| (p.m * p.n * 4) as u64).sum()
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
        cost.forward.products_s += t;
        cost.grads.products_s += t;
        // The input gradient of the unit's first matrix is its input's, computed after the
        // hand-off; the others' lie inside the unit's backward.
        match (j, input_grad) {
            (0, true) => cost.input_grad.products_s += t,
            (0, false) => {}
            _ => cost.grads.products_s += t,
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
            products: vec![],
            alloc: vec![],
            updates: vec![],
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
        assert!((base.calls[0].forward_s() - 2.0 * 10.0 * 32.0 * 16.0 / 1e9).abs() < 1e-15);
        assert_eq!(base.calls[0].input_grad_s(), 0.0, "the data's gradient is never computed");
        assert!(base.calls[1].input_grad_s() > 0.0);
        let double = c(20, one, 1);
        assert!((double.calls[1].grads_s() - 2.0 * base.calls[1].grads_s()).abs() < 1e-15);
        let shared = c(10, Share { ranks_per_node: 2, threads: 1 }, 1);
        assert!((shared.calls[1].forward_s() - 2.0 * base.calls[1].forward_s()).abs() < 1e-15);
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
            let once = t.map(|t| MicrobatchMemory { traffic: t.to_vec(), ..Default::default() });
            CallCosts::of((&spec(), &[0, 1]), None, 10, updates, once.as_ref(), &p, one).unwrap()
        };
        let base = c(None);
        // Call 0 (fc0, [32, 16]) on 10 rows: outputs 10 x 32 forward, 10 x 16 backward.
        let (out_f, out_b) = (10 * 32 * 4, 10 * 16 * 4);
        let with = c(Some(&[(out_f + 1000, out_b + 500), (0, 0)]));
        let per_byte = 2.0 / 10e9;
        let df = with.calls[0].forward_s() - base.calls[0].forward_s();
        let db = with.calls[0].grads_s() - base.calls[0].grads_s();
        assert!((df - 1000.0 * per_byte).abs() < 1e-15, "{df}");
        assert!((db - 500.0 * per_byte).abs() < 1e-15, "{db}");
        assert_eq!(with.calls[1], base.calls[1], "no traffic below the outputs");
    }

    /// PLAN-13: with the calls' recorded work, each product costs its own time and each
    /// tensor made its allocation, in the piece that made it; the pieces' totals are their
    /// parts' sums.
    #[test]
    fn recorded_work_is_priced_piece_by_piece_plan_13() {
        use crate::activations::CallWork;
        use crate::plan::profile::{AllocRow, ProductRow};
        use shardline_models::nn::products::Form;
        let opt = Optimizer::Sgd(SgdConfig::default());
        let one = Share { ranks_per_node: 1, threads: 1 };
        let mut p = profile(1);
        let fwd = Product { m: 10, n: 32, k: 16, form: Form::Nt, accumulate: false };
        let dw = Product { m: 32, n: 16, k: 10, form: Form::Tn, accumulate: true };
        p.products.push(ProductRow { product: fwd, gflops: 0.5 });
        p.alloc.push(AllocRow { bytes: 1280, ns_per_byte: 2.0 });
        let made = |tensors: Vec<u64>, products| Made { tensors, products };
        let w = CallWork {
            forward: made(vec![1280], vec![fwd]),
            backward: made(vec![], vec![dw]),
            input_grad: made(vec![640], vec![]),
        };
        let once = MicrobatchMemory {
            traffic: vec![(1280, 640), (0, 0)],
            work: vec![w, CallWork::default()],
            ..Default::default()
        };
        let updates = (&[1, 1][..], &opt);
        let c = CallCosts::of((&spec(), &[0, 1]), None, 10, updates, Some(&once), &p, one);
        let c = c.unwrap();
        let f = c.calls[0].forward;
        assert!((f.products_s - fwd.flops() / 0.5e9).abs() < 1e-15, "the probe's rate");
        assert!((f.alloc_s - 1280.0 * 2e-9).abs() < 1e-15);
        assert_eq!(f.elementwise_s, 0.0, "the traffic is the product's output");
        let g = c.calls[0].grads;
        assert!((g.products_s - dw.flops() / 1e9).abs() < 1e-15, "unprobed: the square rate");
        assert!((g.elementwise_s - 640.0 * 2.0 / 10e9).abs() < 1e-15, "an added output");
        assert!((c.calls[0].input_grad.alloc_s - 640.0 * 2e-9).abs() < 1e-15);
        assert_eq!(c.calls[0].forward_s(), f.products_s + f.elementwise_s + f.alloc_s);
        assert_eq!(c.calls[1].forward_s(), 0.0, "recorded nothing: costs nothing");
        assert_eq!(c.flops, (fwd.flops() + dw.flops(), fwd.flops()));
    }

    /// PLAN-17: a timed update prices each stepped parameter at its rate, for the state size
    /// it was timed with; another state size, or no timing, falls back to the traffic.
    #[test]
    fn a_timed_update_costs_its_rate_per_parameter_plan_17() {
        use crate::optim::AdamWConfig;
        use crate::plan::profile::UpdateRow;
        let one = Share { ranks_per_node: 1, threads: 1 };
        let stepped = [1000usize, 3000];
        let c = |p: &Profile, opt: &Optimizer| {
            CallCosts::of((&spec(), &[0, 1]), None, 10, (&stepped, opt), None, p, one).unwrap()
        };
        let (sgd, adamw) =
            (Optimizer::Sgd(SgdConfig::default()), Optimizer::AdamW(AdamWConfig::default()));
        let mut timed = profile(1);
        timed.updates.push(UpdateRow { state_words: 2, ns_per_elem: 3.0 });
        let got = c(&timed, &adamw).update_s;
        assert!((got[0] - 1000.0 * 3e-9).abs() < 1e-15 && (got[1] - 3000.0 * 3e-9).abs() < 1e-15);
        // SGD keeps no state: not the timed row, the traffic.
        assert_eq!(c(&timed, &sgd).update_s, c(&profile(1), &sgd).update_s);
        let traffic = update_bytes_per_elem(&adamw) / 10e9;
        assert!((c(&profile(1), &adamw).update_s[0] - 1000.0 * traffic).abs() < 1e-15);
    }

    /// PLAN-14: idle cores absorb the lanes; with every core computing each rank pays its
    /// node's lanes over the cores; more lanes' time costs more; stretched costs keep their
    /// other parts and add the rest as the lanes' part.
    #[test]
    fn lanes_take_cpu_from_compute_when_cores_are_busy_plan_14() {
        let share = |ranks| Share { ranks_per_node: ranks, threads: 1 };
        assert_eq!(lanes_extra_s(4, share(2), 10.0, 3.0), 0.0, "2 idle cores absorb 2 x 3");
        assert_eq!(lanes_extra_s(4, share(1), 1.0, 0.0), 0.0);
        assert_eq!(lanes_extra_s(2, share(2), 10.0, 3.0), 3.0, "2 ranks x 3 over 2 cores");
        assert_eq!(lanes_extra_s(2, share(4), 10.0, 3.0), 6.0, "4 ranks x 3 over 2 cores");
        assert_eq!(lanes_extra_s(3, share(2), 1.0, 3.0), 2.5, "(2 x 3 - 1) over 2 cores");
        assert!(lanes_extra_s(2, share(2), 10.0, 4.0) > lanes_extra_s(2, share(2), 10.0, 3.0));
        let p = Parts { products_s: 2.0, elementwise_s: 1.0, alloc_s: 1.0, lanes_s: 0.0 };
        let s = p.stretched(1.5);
        assert_eq!((s.products_s, s.elementwise_s, s.alloc_s), (2.0, 1.0, 1.0));
        assert_eq!(s.lanes_s, 2.0);
        assert_eq!(s.total(), 6.0);
    }
}
