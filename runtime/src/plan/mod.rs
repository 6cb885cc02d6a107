//! `shardline plan`: a job's memory per rank and step time, predicted by running the
//! engine's own schedule on a simulated clock.
//!
//! Nothing here describes the schedule a second time. The job's plan is `train::plan`'s (the
//! model, stage, prefetch and reduce budgets the engine gets); the layout is the engine's
//! [`ShardedModelLayout`], what a rank keeps the stage's rules; a step is the engine's walk
//! (ENG-12) with its gather plan and reductions (`sim`), on costs from a machine profile
//! (`profile`, `cost`). Activations and kernel scratch are those of one microbatch run once
//! on this host (`activations::activation_peaks`, ACTEST-1): shapes, not timings; a `gpt`
//! too large for that has them counted from its shape instead (`act_model`, PLAN-9).
//! `search` ranks the configurations of one model and global batch by predicted speed.
//!
//! What is modelled: parameters, gradients (kept and transient), optimizer state, gathered
//! units (the prefetch plan and its budget, the gather carried into the next step),
//! activations and scratch; compute as matrix products (each at its own probed shape and
//! form where the profile has it, PLAN-12, else the square probes' rate), elementwise work
//! as memory traffic (PLAN-7), fresh tensors at the profiled allocation cost, `gpt`'s GELU
//! at its profiled time per element and updates at the memory bandwidth, ranks of a node
//! sharing its cores; each collective at its
//! profiled time on its lane, one op at a time, overlapped with compute as the walk orders
//! it; the buffer pool's kept buffers by its own rules (`pool::Shelves`); on a measured
//! (CPU) profile, the lanes' busy time as CPU time taken from the ranks' compute where no
//! idle core absorbs it (PLAN-14). What is not: convolutions (no step time for conv
//! models), SyncBatchNorm's statistics messages, the lanes' staging buffers, bf16 and
//! quantized gathers, the lanes' own slowdown while the ranks compute (a collective costs
//! its time measured alone), and ranks that differ.
//!
//! Invariants:
//! - PLAN-15: a prediction with a one-microbatch run reused from [`Probes`] equals the one
//!   that makes its own run; configurations of one world, microbatch and recompute choice
//!   share one run.
//! - PLAN-5: the predicted parameters (full or shard), optimizer state and gathered units,
//!   and the gradients at stages 0 and 1, are the peaks the engine's tracker measures for
//!   the same job (the pool's buffers by its own rules, POOL-1..3); the gradients in flight
//!   at stages 2 and 3 depend on when reductions complete, and lie between the floor (each
//!   done when the clock says) and the bound (each done only when waited for, PLAN-6).

pub mod act_model;
pub mod cost;
pub mod profile;
pub mod search;
pub mod sim;

use serde::Serialize;

use crate::error::{Result, RuntimeError};
use crate::memory::Category;
use crate::shard::ShardedModelLayout;
use crate::train::{JobPlan, TrainConfig};
use cost::{CallCosts, Share};
use profile::Profile;
use sim::{CommCosts, SimRank, SimStep};

/// Where a job's ranks run.
#[derive(Clone, Debug)]
pub struct Placement {
    /// Nodes.
    pub nodes: usize,
    /// Ranks per node.
    pub ranks_per_node: usize,
    /// The transport the profile's collectives are read for (`local`: threads of one
    /// process); `INTRA/INTER` prices the executor's hierarchical schedule across nodes.
    pub transport: String,
}

/// Where a prediction's activations come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationSource {
    /// One microbatch run on this host (ACTEST-1).
    Probe,
    /// Counted from `gpt`'s shape (PLAN-9).
    Counted,
    /// Counted for a `gpt` whose probe would need more than [`PROBE_LIMIT_BYTES`] of host
    /// memory, else the probe.
    Auto,
}

/// The most host memory the one-microbatch run may take under [`ActivationSource::Auto`].
pub const PROBE_LIMIT_BYTES: u64 = 1 << 30;

/// The predicted peak of one memory category on each rank.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct MemoryRow {
    /// `Category::key`.
    pub category: String,
    /// Bytes, with every reduction done only when waited for (PLAN-6): the most the reduce
    /// budget lets a rank hold.
    pub bytes: u64,
    /// Bytes with every reduction done when the clock says (the profile's costs, or free
    /// communication without one): the least.
    pub floor: u64,
}

/// The predicted step.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct StepRow {
    /// The simulated step, steady state (the third step).
    pub step_s: f64,
    /// Compute on the rank's thread.
    pub compute_s: f64,
    /// The gather lane's busy time.
    pub gather_s: f64,
    /// The reduce lane's busy time.
    pub reduce_s: f64,
    /// Time the rank waited for communication.
    pub exposed_s: f64,
    /// The compute of the calls by what it is (products, elementwise, allocations).
    pub compute_parts: cost::Parts,
    /// The optimizer updates' compute.
    pub update_s: f64,
    /// The rank's own copies issuing before-use gathers (PLAN-16).
    pub gather_issue_s: f64,
    /// The fraction of the products' flops priced at their own shape and form (PLAN-12);
    /// the rest at the square probes' rate.
    pub products_probed: f64,
    /// Samples per second of the whole job.
    pub samples_per_s: f64,
    /// Tokens per second (`gpt`).
    pub tokens_per_s: Option<f64>,
}

/// What `shardline plan` predicts for a job.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    /// Model name.
    pub model: String,
    /// Trainable parameters.
    pub params: usize,
    /// Units.
    pub units: usize,
    /// Ranks.
    pub world: usize,
    /// The stage.
    pub stage: u8,
    /// Prefetch depth and its byte budget.
    pub prefetch: usize,
    /// The prefetch budget.
    pub prefetch_budget_bytes: u64,
    /// Microbatches per step.
    pub grad_accum: usize,
    /// `--recompute`.
    pub recompute: String,
    /// Samples per rank and microbatch.
    pub microbatch: usize,
    /// `probe` (one microbatch run on this host) or `counted` (`gpt`'s shape, PLAN-9).
    pub activations_from: String,
    /// The profile's words when its figures are published ones, not measured here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub published: Option<String>,
    /// Per category, each rank's peak.
    pub memory: Vec<MemoryRow>,
    /// The peak of the state, gathered units, gradients in flight and the pool's buffers
    /// together (the bound, PLAN-6), plus the activations' and scratch's peaks.
    pub peak_bytes: u64,
    /// The step, with a profile and a model whose compute is counted.
    pub step: Option<StepRow>,
    /// The steady step's spans on rank 0, in the engine's trace rows (`--trace`).
    #[serde(skip)]
    pub timeline: Vec<crate::telemetry::Event>,
    /// Why there is no step prediction.
    pub no_step: Option<String>,
    /// The distinct matrix products of one microbatch (PROD-1), for
    /// `shardline-bench machine-profile --products` to probe; empty when counted.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub products: Vec<shardline_models::nn::products::Product>,
}

impl Prediction {
    /// The predicted peak of `cat` (the bound, PLAN-6).
    pub fn bytes(&self, cat: Category) -> u64 {
        self.memory.iter().find(|r| r.category == cat.key()).map_or(0, |r| r.bytes)
    }

    /// The predicted floor of `cat`'s peak.
    pub fn floor(&self, cat: Category) -> u64 {
        self.memory.iter().find(|r| r.category == cat.key()).map_or(0, |r| r.floor)
    }
}

/// Predicts `cfg`'s memory per rank and, with a profile, its step time, for ranks placed as
/// `at` says.
pub fn predict(cfg: &TrainConfig, at: &Placement, profile: Option<&Profile>) -> Result<Prediction> {
    let job = crate::train::plan(cfg)?;
    predict_job(cfg, &job, at, profile)
}

/// [`predict`] for a job already planned.
pub fn predict_job(
    cfg: &TrainConfig,
    job: &JobPlan,
    at: &Placement,
    profile: Option<&Profile>,
) -> Result<Prediction> {
    predict_from(cfg, job, at, profile, ActivationSource::Auto)
}

/// [`predict_job`] with the activations from `source`.
pub fn predict_from(
    cfg: &TrainConfig,
    job: &JobPlan,
    at: &Placement,
    profile: Option<&Profile>,
    source: ActivationSource,
) -> Result<Prediction> {
    predict_probed(cfg, job, at, profile, source, &mut Probes::default())
}

/// One-microbatch runs already made (ACTEST-1), by what decides them: the world (the model
/// a world builds), the microbatch and the recompute choice. A search predicts many
/// configurations that differ only in what the run does not see (stage, prefetch), and
/// runs each once (PLAN-15).
#[derive(Default)]
pub struct Probes {
    runs: std::collections::HashMap<
        (usize, usize, &'static str),
        crate::activations::MicrobatchMemory,
    >,
    /// Runs made, the rest were reused.
    pub made: usize,
}

/// [`predict_from`] reusing the one-microbatch runs in `probes`, and keeping those it makes.
pub fn predict_probed(
    cfg: &TrainConfig,
    job: &JobPlan,
    at: &Placement,
    profile: Option<&Profile>,
    source: ActivationSource,
    probes: &mut Probes,
) -> Result<Prediction> {
    let spec = job.model.spec();
    let layout = ShardedModelLayout::new(&spec, cfg.world)?;
    let calls = job.model.calls();
    let engine = &job.engine;
    let n = layout.units().len();
    let microbatch = crate::activations::microbatch(cfg);
    // One microbatch run once: activations, scratch, each call's tensor traffic (ACTEST-2);
    // or, for a gpt, counted from its shape (PLAN-9).
    let counted = |g: &shardline_models::nn::GptConfig| crate::activations::MicrobatchMemory {
        activations: act_model::gpt_activations(g, microbatch, engine.recompute),
        scratch: 0,
        traffic: act_model::gpt_traffic(g, microbatch),
        work: vec![],
    };
    let (once, activations_from) = match (source, &job.gpt) {
        (ActivationSource::Counted, None) => {
            return Err(flag_error("--activations counted", "only gpt's are counted"))
        }
        (ActivationSource::Counted, Some(g)) => (counted(g), "counted"),
        (ActivationSource::Auto, Some(g))
            // The probe holds parameters and gradients, and the microbatch's activations.
            if 8 * spec.numel() as u64 + counted(g).activations > PROBE_LIMIT_BYTES =>
        {
            (counted(g), "counted")
        }
        _ => {
            let key = (cfg.world, microbatch, engine.recompute.name());
            let once = match probes.runs.get(&key) {
                Some(once) => once.clone(),
                None => {
                    let once = crate::activations::activation_peaks(&*job.model, &job.train, cfg)?;
                    probes.made += 1;
                    probes.runs.entry(key).or_insert(once).clone()
                }
            };
            (once, "probe")
        }
    };
    // Compute and communication costs, when the profile and the model allow.
    let (mut costs, comm, no_step) = match profile {
        None => (None, None, Some("no --profile given".to_string())),
        Some(p) => match costs_of(cfg, job, (&layout, &calls, &once), at, p)? {
            Ok((c, m)) => (Some(c), Some(m), None),
            Err(why) => (None, None, Some(why)),
        },
    };
    let zero = CallCosts {
        calls: vec![cost::CallCost::default(); calls.len()],
        update_s: vec![0.0; n],
        flops: (0.0, 0.0),
    };
    let free = CommCosts { gather_s: vec![0.0; n], reduce_s: vec![0.0; n], ..Default::default() };
    let comm_or_free = comm.as_ref().unwrap_or(&free);
    // The first step starts without a carried gather (ENG-6); the third is steady.
    let run = |costs: &CallCosts| {
        let mut rank = SimRank::new(&layout, &calls, engine, costs, comm_or_free);
        let mut steps: Vec<SimStep> = (0..2).map(|_| rank.step()).collect();
        let t2 = rank.now();
        steps.push(rank.step());
        (steps, rank.timeline_since(t2), rank.memory().clone())
    };
    let (mut steps, mut timeline, mut floor) = run(costs.as_ref().unwrap_or(&zero));
    // PLAN-14: a CPU profile's lanes copy and reduce on the cores the ranks compute on; the
    // steady step's lanes' time, less what idle cores absorb, is charged to the compute and
    // the step simulated again (the lanes' time does not depend on the compute).
    let cpu_lanes = profile.filter(|p| p.published.is_none());
    if let (Some(p), Some(c)) = (cpu_lanes, costs.as_mut()) {
        let s = steps[2];
        let share = Share { ranks_per_node: at.ranks_per_node, threads: cfg.threads };
        let calls_s = s.compute_s - s.update_s - s.issue_s;
        let extra = cost::lanes_extra_s(p.cores, share, s.compute_s, s.gather_s + s.reduce_s);
        if extra > 0.0 && calls_s > 0.0 {
            *c = c.stretched(1.0 + extra / calls_s);
            (steps, timeline, floor) = run(c);
        }
    }
    // Memory: the same steps with every reduction late (PLAN-6).
    let mut late = SimRank::new(&layout, &calls, engine, &zero, &free).late_reductions();
    for _ in 0..3 {
        late.step();
    }
    let (act, scratch) = (once.activations, once.scratch);
    let mem = late.memory();
    let mut memory: Vec<MemoryRow> = [
        Category::FullParams,
        Category::ShardParams,
        Category::Grads,
        Category::OptimizerState,
        Category::GatheredUnits,
        Category::CommBuffers,
    ]
    .into_iter()
    .map(|c| MemoryRow { category: c.key().into(), bytes: mem.peak(c), floor: floor.peak(c) })
    .collect();
    let row = |c: Category, b| MemoryRow { category: c.key().into(), bytes: b, floor: b };
    memory.push(row(Category::Activations, act));
    memory.push(row(Category::Scratch, scratch));
    let step = costs.as_ref().map(|_| {
        let s = steps[2];
        let samples = cfg.batch_size as f64 / s.step_s.max(1e-12);
        StepRow {
            step_s: s.step_s,
            compute_s: s.compute_s,
            gather_s: s.gather_s,
            reduce_s: s.reduce_s,
            exposed_s: s.exposed_s,
            compute_parts: s.parts,
            update_s: s.update_s,
            gather_issue_s: s.issue_s,
            products_probed: costs.as_ref().map_or(0.0, |c| {
                if c.flops.0 > 0.0 {
                    c.flops.1 / c.flops.0
                } else {
                    0.0
                }
            }),
            samples_per_s: samples,
            tokens_per_s: job.gpt.as_ref().map(|g| samples * g.block_size as f64),
        }
    });
    Ok(Prediction {
        model: spec.name.clone(),
        params: spec.numel(),
        units: n,
        world: cfg.world,
        stage: job.stage.index(),
        prefetch: engine.prefetch,
        prefetch_budget_bytes: engine.prefetch_budget_bytes,
        grad_accum: engine.grad_accum,
        recompute: engine.recompute.name().into(),
        microbatch,
        activations_from: activations_from.into(),
        published: profile.and_then(|p| p.published.clone()),
        memory,
        peak_bytes: mem.peak_total() + act + scratch,
        step,
        no_step,
        timeline,
        products: distinct_products(&once),
    })
}

/// The distinct products of every call's forward, backward and input gradient.
fn distinct_products(
    once: &crate::activations::MicrobatchMemory,
) -> Vec<shardline_models::nn::products::Product> {
    let mut v: Vec<_> = once
        .work
        .iter()
        .flat_map(|w| [&w.forward, &w.backward, &w.input_grad])
        .flat_map(|m| m.products.iter().copied())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The step's compute and collective costs on `p`; the reason when the job has what is not
/// modelled; an error naming `--profile` when the profile lacks a collective the job runs.
fn costs_of(
    cfg: &TrainConfig,
    job: &JobPlan,
    (layout, calls, once): (&ShardedModelLayout, &[usize], &crate::activations::MicrobatchMemory),
    at: &Placement,
    p: &Profile,
) -> Result<std::result::Result<(CallCosts, CommCosts), String>> {
    if cfg.param_dtype != crate::engine::PrecisionDtype::F32 || cfg.gather_dtype.is_some() {
        return Ok(Err("bf16 and quantized gathers are not modelled".into()));
    }
    let spec = job.model.spec();
    let engine = &job.engine;
    let rules = crate::engine::sim_api::StageRules::of(engine.stage);
    let microbatch = crate::activations::microbatch(cfg);
    let rows = match &job.gpt {
        Some(g) => microbatch * g.block_size,
        None => microbatch,
    };
    // Each rank steps the whole unit at stage 0, its shard otherwise.
    let stepped: Vec<usize> = layout
        .units()
        .iter()
        .map(|l| if rules.replicated_update { l.padded_numel() } else { l.shard_len() })
        .collect();
    let share = Share { ranks_per_node: at.ranks_per_node, threads: cfg.threads };
    let gpt = job.gpt.as_ref().map(|g| (g, microbatch));
    let compute = match CallCosts::of(
        (&spec, calls),
        gpt,
        rows,
        (&stepped, &engine.optimizer),
        Some(once),
        p,
        share,
    ) {
        Ok(c) => c,
        Err(why) => return Ok(Err(why)),
    };
    let w = cfg.world;
    let t = at.transport.as_str();
    let coll = |op: &str, bytes: u64| {
        match t.split_once('/') {
            Some(pair) => p.hierarchical_s(op, pair, (at.nodes, at.ranks_per_node), bytes),
            None => p.collective_s(op, t, w, bytes),
        }
        .map_err(|e| flag_error("--profile", e))
    };
    let reduce_op = match rules.reduce {
        crate::engine::sim_api::GradReduce::AllReduce => "all-reduce",
        _ => "reduce-scatter",
    };
    // The loss all-reduce: loss, norm, stop and one busy time per rank (STRAG-1).
    let loss_bytes = (3 + w as u64) * 4;
    let mut comm = CommCosts { loss_s: coll("all-reduce", loss_bytes)?, ..CommCosts::default() };
    for l in layout.units() {
        let bytes = l.padded_numel() as u64 * 4;
        comm.gather_s.push(coll("all-gather", bytes)?);
        comm.reduce_s.push(coll(reduce_op, bytes)?);
        // PLAN-16: the shard read and written once, as PLAN-7 charges traffic.
        comm.issue_s.push(2.0 * l.shard_len() as f64 * 4.0 / (p.memory_gbps * 1e9));
    }
    Ok(Ok((compute, comm)))
}

impl Prediction {
    /// The table `shardline plan` prints.
    pub fn lines(&self) -> Vec<String> {
        use crate::memory::format_bytes;
        let mut v = vec![
            format!(
                "shardline plan: {} ({} params, {} units), world {}, stage {}, prefetch {} (budget {}), microbatch {} x {}, recompute {}",
                self.model,
                self.params,
                self.units,
                self.world,
                self.stage,
                self.prefetch,
                format_bytes(self.prefetch_budget_bytes),
                self.microbatch,
                self.grad_accum,
                self.recompute
            ),
        ];
        if let Some(words) = &self.published {
            v.push(format!("  profile: {words}"));
        }
        if self.activations_from == "counted" {
            v.push("  activations counted from gpt's shape (too large to run here); kernels' scratch not modelled".into());
        }
        v.push("  memory per rank (peak by category):".into());
        for r in self.memory.iter().filter(|r| r.bytes > 0) {
            // Gradients in flight: the bound, and the floor when the clock gives less (PLAN-6).
            let floor = if r.floor != r.bytes {
                format!("  (at least {})", format_bytes(r.floor))
            } else {
                String::new()
            };
            v.push(format!("    {:<16} {:>12}{floor}", r.category, format_bytes(r.bytes)));
        }
        v.push(format!("    {:<16} {:>12}", "peak (about)", format_bytes(self.peak_bytes)));
        match (&self.step, &self.no_step) {
            (Some(s), _) => {
                let ms = |x: f64| format!("{:.2} ms", x * 1e3);
                v.push("  step (simulated, steady state):".into());
                v.push(format!("    {:<16} {:>12}", "step", ms(s.step_s)));
                v.push(format!("    {:<16} {:>12}", "compute", ms(s.compute_s)));
                let p = &s.compute_parts;
                let probed =
                    format!("  ({:.0}% of flops at their own shape)", s.products_probed * 1e2);
                v.push(format!("      {:<14} {:>12}{probed}", "products", ms(p.products_s)));
                v.push(format!("      {:<14} {:>12}", "elementwise", ms(p.elementwise_s)));
                v.push(format!("      {:<14} {:>12}", "allocations", ms(p.alloc_s)));
                v.push(format!("      {:<14} {:>12}", "lanes' CPU", ms(p.lanes_s)));
                v.push(format!("      {:<14} {:>12}", "updates", ms(s.update_s)));
                v.push(format!("      {:<14} {:>12}", "gather issue", ms(s.gather_issue_s)));
                v.push(format!("    {:<16} {:>12}", "gather lane", ms(s.gather_s)));
                v.push(format!("    {:<16} {:>12}", "reduce lane", ms(s.reduce_s)));
                v.push(format!("    {:<16} {:>12}", "exposed comm", ms(s.exposed_s)));
                v.push(format!("    {:<16} {:>12.1}", "samples/s", s.samples_per_s));
                if let Some(t) = s.tokens_per_s {
                    v.push(format!("    {:<16} {:>12.0}", "tokens/s", t));
                }
            }
            (None, Some(why)) => v.push(format!("  step: not predicted ({why})")),
            (None, None) => {}
        }
        v
    }
}

/// A usage error naming its flag.
pub fn flag_error(flag: &str, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::config(format!("{flag}: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Recompute;
    use crate::shard::Stage;
    use crate::train::StageChoice;
    use profile::GemmRow;

    /// PLAN-15: a reused run predicts what a fresh one does; stages of one world share a
    /// run, another recompute choice makes its own.
    #[test]
    fn reused_runs_predict_what_fresh_ones_do_plan_15() {
        let p = Profile {
            note: String::new(),
            cores: 1,
            memory_gbps: 10.0,
            gemm: vec![GemmRow { m: 64, n: 64, k: 64, gflops: 1.0, source: None }],
            gemm_shared: vec![],
            gelu_ns: 1.0,
            products: vec![],
            alloc: vec![],
            updates: vec![],
            collectives: vec![],
            published: None,
            transports_default: None,
            device_memory: None,
            gemm_by: Default::default(),
            sources: vec![],
        };
        let at = Placement { nodes: 1, ranks_per_node: 1, transport: "local".into() };
        let cfg = |stage, recompute| TrainConfig {
            model: "gpt".into(),
            dataset: "text".into(),
            world: 1,
            batch_size: 2,
            n_layer: Some(2),
            n_head: Some(2),
            n_embd: Some(16),
            block_size: Some(8),
            stage: StageChoice::Fixed(stage),
            recompute,
            ..TrainConfig::default()
        };
        let mut probes = Probes::default();
        let source = ActivationSource::Probe;
        for (stage, recompute) in [
            (Stage::Zero0, Recompute::None),
            (Stage::Zero1, Recompute::None),
            (Stage::Zero0, Recompute::Units),
        ] {
            let c = cfg(stage, recompute);
            let job = crate::train::plan(&c).unwrap();
            let reused = predict_probed(&c, &job, &at, Some(&p), source, &mut probes).unwrap();
            let fresh = predict_from(&c, &job, &at, Some(&p), source).unwrap();
            let json = |p: &Prediction| serde_json::to_value(p).unwrap();
            assert_eq!(json(&reused), json(&fresh), "{stage:?} {recompute:?}");
            assert!(reused.step.is_some());
        }
        assert_eq!(probes.made, 2, "stages 0 and 1 share a run; units makes its own");
    }
}
