//! The nanoGPT decoder (`shardline_models::nn::gpt`) against PyTorch's reference vectors
//! (GPT-4): every case directory (`config.json`, `weights.safetensors` in float32,
//! `expected.safetensors` in float64) under `$SHARDLINE_GPT_VECTORS` when it is set, else
//! under `tests/fixtures/gpt/` (see its README). A directory with no case is a failure, not
//! a skip.
//!
//! Checked per case, in `f64` and in `f32`: the parameter names and shapes against the
//! weights file's (GPT-1), the loss, the logits and the gradient of every parameter; then
//! `adamw.steps` AdamW steps with torch's update on the same batch: the loss before every
//! step and the weights after the last. `f64` agrees with torch's float64 to `1e-9`; `f32`
//! within ten times the error of torch's own float32 run as `config.json` records it
//! (`torch_f32`), and the AdamW weights within `1e-5` wherever the float64 gradient is at
//! least `1e-6` in magnitude (elsewhere Adam's normalised step turns rounding into a step
//! of either sign, for torch's float32 run too).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use num_traits::Float;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use shardline_models::nn::{Erf, Gemm, GptConfig, RowExp};
use shardline_models::ParamSpec;

/// `f64` against torch's float64: relative to `max(1, |want|)`.
const F64_TOL: f64 = 1e-9;
/// `f32` against torch's float64, as a multiple of torch float32's own error.
const F32_FACTOR: f64 = 10.0;
/// The `f32` losses of the AdamW steps, relative.
const F32_LOSS_TOL: f64 = 1e-6;
/// The `f32` weights after the AdamW steps, absolute.
const F32_ADAMW_TOL: f64 = 1e-5;
/// Elements whose float64 gradient is smaller in magnitude are not compared after AdamW.
const TINY_GRAD: f64 = 1e-6;

/// One case directory, loaded.
struct Case {
    name: String,
    cfg: GptConfig,
    json: Value,
    tokens: Vec<Vec<u32>>,
    targets: Vec<Vec<u32>>,
    specs: Vec<ParamSpec>,
    /// The float32 weights, flat in the decoder's order.
    weights: Vec<f32>,
    /// `expected.safetensors`: name -> (shape, values).
    expected: BTreeMap<String, (Vec<usize>, Vec<f64>)>,
}

impl Case {
    fn f64_field(&self, path: &[&str]) -> f64 {
        let mut v = &self.json;
        for p in path {
            v = &v[p];
        }
        v.as_f64()
            .unwrap_or_else(|| panic!("case {}: config.json has no number {path:?}", self.name))
    }

    fn expected(&self, name: &str) -> &[f64] {
        match self.expected.get(name) {
            Some((_, v)) => v,
            None => panic!("case {}: expected.safetensors has no {name}", self.name),
        }
    }

    /// The expected values of `prefix.<name>` for every parameter, flat in the decoder's order.
    fn expected_flat(&self, prefix: &str) -> Vec<f64> {
        let mut out = Vec::new();
        for s in &self.specs {
            let name = format!("{prefix}.{}", s.name);
            let (shape, v) = &self.expected[&name];
            assert_eq!(shape, &s.shape, "case {}: shape of {name}", self.name);
            out.extend_from_slice(v);
        }
        out
    }
}

fn root() -> PathBuf {
    match std::env::var_os("SHARDLINE_GPT_VECTORS") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt"),
    }
}

/// Every case directory under the root (or the root itself when it is one), sorted.
fn case_dirs() -> Vec<PathBuf> {
    let root = root();
    if root.join("config.json").is_file() {
        return vec![root];
    }
    let entries = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("GPT reference vectors: cannot read {}: {e}", root.display()));
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("config.json").is_file())
        .collect();
    dirs.sort();
    assert!(
        !dirs.is_empty(),
        "GPT reference vectors: no case (a directory with config.json) under {}",
        root.display()
    );
    dirs
}

fn read_tensors(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids(case: &str, v: &Value, what: &str) -> Vec<Vec<u32>> {
    serde_json::from_value(v[what].clone())
        .unwrap_or_else(|e| panic!("case {case}: config.json {what}: {e}"))
}

fn load(dir: &Path) -> Case {
    let name = dir.file_name().map_or("?".into(), |n| n.to_string_lossy().into_owned());
    let text = std::fs::read_to_string(dir.join("config.json"))
        .unwrap_or_else(|e| panic!("case {name}: config.json: {e}"));
    let json: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("case {name}: config.json: {e}"));
    let cfg: GptConfig = serde_json::from_value(json["model"].clone())
        .unwrap_or_else(|e| panic!("case {name}: config.json model: {e}"));
    let specs = cfg.param_specs();

    let bytes = read_tensors(&dir.join("weights.safetensors"));
    let st = SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("case {name}: {e}"));
    // GPT-1: the file torch wrote holds exactly the decoder's parameters, with their shapes.
    let in_file: HashSet<&str> = st.names().into_iter().collect();
    let ours: HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(in_file, ours, "case {name}: parameter names of weights.safetensors");
    let mut tensors: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for s in &specs {
        let t = st.tensor(&s.name).unwrap();
        assert_eq!(t.dtype(), Dtype::F32, "case {name}: dtype of {}", s.name);
        assert_eq!(t.shape(), &s.shape[..], "case {name}: shape of {}", s.name);
        let v = t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()));
        tensors.insert(s.name.clone(), v.collect());
    }
    let weights = cfg.flatten(|n| tensors.get(n).map(Vec::as_slice)).unwrap();

    let bytes = read_tensors(&dir.join("expected.safetensors"));
    let st = SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("case {name}: {e}"));
    let mut expected = BTreeMap::new();
    for (n, t) in st.tensors() {
        assert_eq!(t.dtype(), Dtype::F64, "case {name}: dtype of expected {n}");
        let v = t.data().chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap()));
        expected.insert(n, (t.shape().to_vec(), v.collect()));
    }
    let tokens = ids(&name, &json, "tokens");
    let targets = ids(&name, &json, "targets");
    Case { name, cfg, json, tokens, targets, specs, weights, expected }
}

fn cases() -> Vec<Case> {
    case_dirs().iter().map(|d| load(d)).collect()
}

/// The largest absolute difference of `got` from `want`, and, when some element exceeds
/// `tol(want)`, a line naming the worst one (and how many exceed). `skip(i)` leaves element
/// `i` out.
fn compare(
    what: &str,
    got: &[f64],
    want: &[f64],
    tol: impl Fn(f64) -> f64,
    skip: impl Fn(usize) -> bool,
) -> (f64, Option<String>) {
    if got.len() != want.len() {
        let line = format!("{what}: {} values, expected {}", got.len(), want.len());
        return (f64::INFINITY, Some(line));
    }
    let (mut max_err, mut bad, mut worst) = (0.0f64, 0usize, None::<(f64, usize)>);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if skip(i) {
            continue;
        }
        let err = (g - w).abs();
        let err = if err.is_nan() { f64::INFINITY } else { err };
        max_err = max_err.max(err);
        let excess = err / tol(w);
        if excess > 1.0 {
            bad += 1;
            if worst.is_none_or(|(x, _)| excess > x) {
                worst = Some((excess, i));
            }
        }
    }
    let line = worst.map(|(_, i)| {
        format!(
            "{what}[{i}]: got {:e}, want {:e}, |diff| {:e} > tolerance {:e} ({bad} elements out)",
            got[i],
            want[i],
            (got[i] - want[i]).abs(),
            tol(want[i])
        )
    });
    (max_err, line)
}

/// Compares a flat buffer tensor by tensor, naming the tensor and its element on failure;
/// returns the largest difference.
fn compare_params(
    case: &Case,
    label: &str,
    got: &[f64],
    want: &[f64],
    tol: impl Fn(f64) -> f64 + Copy,
    skip: impl Fn(usize) -> bool + Copy,
    failures: &mut Vec<String>,
) -> f64 {
    let mut at = 0;
    let mut max_err = 0.0f64;
    for s in &case.specs {
        let n = s.numel();
        let what = format!("case {}: {label}.{}", case.name, s.name);
        let r = at..at + n;
        let (err, line) = compare(&what, &got[r.clone()], &want[r], tol, |i| skip(at + i));
        max_err = max_err.max(err);
        failures.extend(line);
        at += n;
    }
    max_err
}

fn widen<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64().unwrap()).collect()
}

fn params_as<T: Float>(w: &[f32]) -> Vec<T> {
    w.iter().map(|&x| T::from(x).unwrap()).collect()
}

/// Forward and backward in `T`: logits (`logits_tol` of the expected value), loss
/// (`loss_tol`, relative) and gradients (`grad_tol`) against the expected float64 values;
/// returns (max logits error, max gradient error).
fn check_forward_backward<T: Erf + Gemm + RowExp + Default>(
    case: &Case,
    label: &str,
    logits_tol: impl Fn(f64) -> f64 + Copy,
    grad_tol: impl Fn(f64) -> f64 + Copy,
    loss_tol: f64,
    failures: &mut Vec<String>,
) -> (f64, f64) {
    let cfg = &case.cfg;
    let params: Vec<T> = params_as(&case.weights);
    let (logits, _) = cfg.forward(&params, &case.tokens).unwrap();
    let want = case.expected("logits");
    let what = format!("case {}: {label} logits", case.name);
    let (logits_err, line) = compare(&what, &widen(&logits), want, logits_tol, |_| false);
    failures.extend(line);
    let (loss, grads) = cfg.loss_and_grads(&params, &case.tokens, &case.targets).unwrap();
    let want_loss = case.f64_field(&["loss"]);
    let loss = loss.to_f64().unwrap();
    if (loss - want_loss).abs() > loss_tol * want_loss.abs() {
        failures.push(format!("case {}: {label} loss {loss:e}, want {want_loss:e}", case.name));
    }
    let want = case.expected_flat("grad");
    let grad_err = compare_params(
        case,
        &format!("{label} grad"),
        &widen(&grads),
        &want,
        grad_tol,
        |_| false,
        failures,
    );
    (logits_err, grad_err)
}

/// GPT-4: logits, loss and every parameter's gradient, in f64 and f32, for every case.
#[test]
fn gpt_forward_and_backward_match_torch_gpt_4() {
    let mut failures = Vec::new();
    for case in cases() {
        let f64_tol = |w: f64| F64_TOL * w.abs().max(1.0);
        let (l64, g64) =
            check_forward_backward::<f64>(&case, "f64", f64_tol, f64_tol, F64_TOL, &mut failures);
        let torch_logits = case.f64_field(&["torch_f32", "logits_max_abs_err"]);
        let torch_grads = case.f64_field(&["torch_f32", "grad_max_abs_err"]);
        // Absolute, as torch's own figures are; the loss as the AdamW losses.
        let (l32, g32) = check_forward_backward::<f32>(
            &case,
            "f32",
            |_| F32_FACTOR * torch_logits,
            |_| F32_FACTOR * torch_grads,
            F32_LOSS_TOL,
            &mut failures,
        );
        println!(
            "case {}: f64 logits {l64:.2e}, grads {g64:.2e}; f32 logits {l32:.2e} (torch f32 \
             {torch_logits:.2e}), grads {g32:.2e} (torch f32 {torch_grads:.2e})",
            case.name
        );
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// torch's AdamW, one step over every tensor (`torch.optim.AdamW`, single-tensor path):
/// decay `p *= 1 - lr * wd` where `decays(spec)`, then `m = lerp(m, g, 1 - b1)`,
/// `v = b2 v + (1 - b2) g^2`, `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`.
struct AdamW<T> {
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    step: i32,
    m: Vec<T>,
    v: Vec<T>,
}

impl<T: Float> AdamW<T> {
    fn new(case: &Case, n: usize) -> Self {
        let f = |k: &str| case.f64_field(&["adamw", k]);
        let betas = &case.json["adamw"]["betas"];
        AdamW {
            lr: f("lr"),
            betas: (betas[0].as_f64().unwrap(), betas[1].as_f64().unwrap()),
            eps: f("eps"),
            weight_decay: f("weight_decay"),
            step: 0,
            m: vec![T::zero(); n],
            v: vec![T::zero(); n],
        }
    }

    fn step(
        &mut self,
        specs: &[ParamSpec],
        decays: impl Fn(&ParamSpec) -> bool,
        p: &mut [T],
        g: &[T],
    ) {
        self.step += 1;
        let c = |x: f64| T::from(x).unwrap();
        let (b1, b2) = self.betas;
        let bc1 = 1.0 - b1.powi(self.step);
        let bc2_sqrt = c((1.0 - b2.powi(self.step)).sqrt());
        let step_size = c(self.lr / bc1);
        let decay = c(1.0 - self.lr * self.weight_decay);
        let (one_b1, b2t, one_b2, eps) = (c(1.0 - b1), c(b2), c(1.0 - b2), c(self.eps));
        let mut at = 0;
        for s in specs {
            let r = at..at + s.numel();
            at = r.end;
            let d = decays(s);
            for i in r {
                if d {
                    p[i] = p[i] * decay;
                }
                self.m[i] = self.m[i] + one_b1 * (g[i] - self.m[i]);
                self.v[i] = self.v[i] * b2t + one_b2 * g[i] * g[i];
                let denom = self.v[i].sqrt() / bc2_sqrt + eps;
                p[i] = p[i] - step_size * self.m[i] / denom;
            }
        }
    }
}

/// `adamw.steps` steps on the case's batch in `T`: the loss before each step and the
/// weights after the last.
fn run_adamw<T: Erf + Gemm + RowExp + Default>(
    case: &Case,
    decays: impl Fn(&ParamSpec) -> bool + Copy,
) -> (Vec<f64>, Vec<f64>) {
    let steps = case.f64_field(&["adamw", "steps"]) as usize;
    let mut p: Vec<T> = params_as(&case.weights);
    let mut opt = AdamW::<T>::new(case, p.len());
    let mut losses = Vec::with_capacity(steps);
    for _ in 0..steps {
        let (loss, g) = case.cfg.loss_and_grads(&p, &case.tokens, &case.targets).unwrap();
        losses.push(loss.to_f64().unwrap());
        opt.step(&case.specs, decays, &mut p, &g);
    }
    (losses, widen(&p))
}

/// Torch's grouping: weight decay on tensors of 2 or more dimensions only.
fn matrices(s: &ParamSpec) -> bool {
    s.shape.len() >= 2
}

/// The AdamW checks of one run: the losses (relative `loss_tol`), then the weights (absolute
/// `weight_tol`) where the float64 gradient is at least `TINY_GRAD`; returns the largest
/// weight difference and the largest relative loss difference.
fn check_adamw(
    case: &Case,
    label: &str,
    (losses, weights): (Vec<f64>, Vec<f64>),
    loss_tol: f64,
    weight_tol: f64,
    failures: &mut Vec<String>,
) -> (f64, f64) {
    let want: Vec<f64> = serde_json::from_value(case.json["adamw"]["losses"].clone()).unwrap();
    if losses.len() != want.len() {
        failures.push(format!(
            "case {}: {} AdamW losses, {} recorded",
            case.name,
            losses.len(),
            want.len()
        ));
    }
    let mut loss_err = 0.0f64;
    for (i, (l, w)) in losses.iter().zip(&want).enumerate() {
        loss_err = loss_err.max((l - w).abs() / w.abs());
        if (l - w).abs() > loss_tol * w.abs() {
            failures.push(format!(
                "case {}: {label} AdamW loss before step {}: {l:e}, want {w:e}",
                case.name,
                i + 1
            ));
        }
    }
    let grad = case.expected_flat("grad");
    let want = case.expected_flat("adamw");
    let skip = |i: usize| grad[i].abs() < TINY_GRAD;
    let label = format!("{label} adamw");
    let weight_err = compare_params(case, &label, &weights, &want, |_| weight_tol, skip, failures);
    (weight_err, loss_err)
}

/// GPT-4: the AdamW steps in f32 (and f64) follow torch's, for every case.
#[test]
fn gpt_adamw_steps_match_torch_gpt_4() {
    let mut failures = Vec::new();
    for case in cases() {
        let (e32, loss32) = check_adamw(
            &case,
            "f32",
            run_adamw::<f32>(&case, matrices),
            F32_LOSS_TOL,
            F32_ADAMW_TOL,
            &mut failures,
        );
        let (e64, loss64) = check_adamw(
            &case,
            "f64",
            run_adamw::<f64>(&case, matrices),
            F64_TOL,
            F64_TOL,
            &mut failures,
        );
        let skipped = case.expected_flat("grad").iter().filter(|g| g.abs() < TINY_GRAD).count();
        println!(
            "case {}: AdamW losses max relative diff f32 {loss32:.2e}, f64 {loss64:.2e}; weights \
             max |diff| f32 {e32:.2e}, f64 {e64:.2e} ({skipped} of {} elements with |grad| < \
             {TINY_GRAD:e} not compared)",
            case.name,
            case.weights.len()
        );
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// The AdamW weight check is sharp enough to see the decay groups: decaying every tensor
/// (biases and LayerNorm gains too) fails it in every case.
#[test]
fn gpt_adamw_check_fails_when_every_tensor_decays_gpt_4() {
    for case in cases() {
        let mut failures = Vec::new();
        check_adamw(
            &case,
            "f32",
            run_adamw::<f32>(&case, |_| true),
            F32_LOSS_TOL,
            F32_ADAMW_TOL,
            &mut failures,
        );
        let undecayed = case.specs.iter().filter(|s| !matrices(s)).map(|s| format!(".{}", s.name));
        let undecayed: Vec<String> = undecayed.collect();
        assert!(
            failures.iter().any(|f| undecayed.iter().any(|n| f.contains(n.as_str()))),
            "case {}: decaying biases and LayerNorm gains went unnoticed; failures: {failures:?}",
            case.name
        );
    }
}
