//! `shardline plan`: its memory prediction against what the engine's tracker measures, over
//! a grid of small jobs run here (PLAN-5: models mlp-bn and gpt, worlds 1-4 as threads,
//! stages 0-3, prefetch 0-2 at stage 3), and the command's help, usage errors and JSON.

mod common;
use common::{run_ok, shardline};

use shardline_runtime::memory::Category;
use shardline_runtime::plan::{predict, Placement};
use shardline_runtime::shard::Stage;
use shardline_runtime::train::{RunOptions, StageChoice, TrainConfig};

fn job(model: &str, world: usize, stage: Stage, prefetch: usize) -> TrainConfig {
    let mut c = TrainConfig {
        world,
        stage: StageChoice::Fixed(stage),
        model: model.into(),
        steps: Some(2),
        batch_size: 24,
        prefetch,
        ..TrainConfig::default()
    };
    if model == "gpt" {
        c.dataset = "text".into();
        c.n_layer = Some(2);
        c.n_head = Some(2);
        c.n_embd = Some(32);
        c.block_size = Some(16);
        c.optimizer = "adamw".into();
        c.lr = 1e-3;
    }
    c
}

/// The categories whose peak is decided by the layout, the stage's rules and the pool's.
const EXACT: [Category; 4] = [
    Category::FullParams,
    Category::ShardParams,
    Category::OptimizerState,
    Category::GatheredUnits,
];

/// PLAN-5: every job's predicted parameters, optimizer state and gathered units, and its
/// gradients where the stage keeps them whole (stages 0 and 1), are the peaks rank 0's
/// tracker measured. The gradients in flight at stages 2 and 3 peak as the reductions
/// complete: between the prediction's floor and its bound (PLAN-6). The errors of the
/// gradients' bound, the communication buffers and the activations are printed.
#[test]
fn predicted_state_memory_is_what_the_engine_measures_plan_5() {
    let mut jobs = Vec::new();
    for model in ["mlp-bn", "gpt"] {
        for world in 1..=4 {
            for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
                jobs.push(job(model, world, stage, 1));
            }
            for prefetch in 0..=2 {
                jobs.push(job(model, world, Stage::Zero3, prefetch));
            }
        }
    }
    let mut misses = Vec::new();
    println!("model   world stage prefetch  grads (bound/meas err)  comm buffers (pred/meas err)  activations (pred/meas err)");
    for cfg in jobs {
        let at = Placement { nodes: 1, ranks_per_node: cfg.world, transport: "local".into() };
        let p = predict(&cfg, &at, None).unwrap();
        let opts = RunOptions { quiet: true, skip_final_params: true, ..RunOptions::default() };
        // Under the helpers' deadline: the ranks wait on each other.
        let s = run_ok(cfg.clone(), opts);
        let measured = |c: Category| {
            s.peak_by_category[0].iter().find(|(k, _)| k == c.key()).map_or(0, |(_, b)| *b)
        };
        let whole_grads = p.stage <= 1;
        let name = format!(
            "{} world {} stage {} prefetch {}",
            cfg.model, cfg.world, p.stage, cfg.prefetch
        );
        for c in EXACT.into_iter().chain(whole_grads.then_some(Category::Grads)) {
            if p.bytes(c) != measured(c) || p.floor(c) != p.bytes(c) {
                misses.push(format!(
                    "{name}: {} predicted {}..{} measured {}",
                    c.key(),
                    p.floor(c),
                    p.bytes(c),
                    measured(c)
                ));
            }
        }
        let g = Category::Grads;
        if !(p.floor(g)..=p.bytes(g)).contains(&measured(g)) {
            misses.push(format!(
                "{name}: grads measured {} outside {}..={}",
                measured(g),
                p.floor(g),
                p.bytes(g)
            ));
        }
        let e = |c: Category| {
            let (a, b) = (p.bytes(c), measured(c));
            format!("{a}/{b} {:+.1}%", (a as f64 - b as f64) / b.max(1) as f64 * 100.0)
        };
        println!(
            "{:<7} {:>5} {:>5} {:>8}  {:>22}  {:>28}  {:>26}",
            cfg.model,
            cfg.world,
            p.stage,
            cfg.prefetch,
            e(Category::Grads),
            e(Category::CommBuffers),
            e(Category::Activations)
        );
    }
    assert!(misses.is_empty(), "{} misses:\n{}", misses.len(), misses.join("\n"));
}

/// A profile of made-up but self-consistent figures, for the command's shape only (no
/// figure here is compared with a measurement).
fn tiny_profile(dir: &std::path::Path) -> String {
    let mut rows = Vec::new();
    for op in ["all-gather", "reduce-scatter", "all-reduce"] {
        for world in [2, 4] {
            for (bytes, us) in [(4096, 10.0), (1 << 20, 300.0)] {
                rows.push(serde_json::json!({
                    "op": op, "world": world, "transport": "local", "bytes": bytes, "time_us": us
                }));
            }
        }
    }
    let p = serde_json::json!({
        "note": "test", "cores": 2, "memory_gbps": 5.0, "gelu_ns": 1.0,
        "gemm": [{"m": 64, "n": 64, "k": 64, "gflops": 20.0}],
        "collectives": rows,
    });
    let path = dir.join("profile.json");
    std::fs::write(&path, p.to_string()).unwrap();
    path.display().to_string()
}

/// `plan --help` says what is modelled and what is not.
#[test]
fn plan_help_says_what_is_modelled_and_what_is_not() {
    let o = shardline(&["plan", "--help"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    for s in [
        "Modelled:",
        "Not modelled:",
        "--profile",
        "--world",
        "--prefetch",
        "--json",
        "--search",
        "--memory-cap",
        "h100-8x-ib",
        "from published figures, not measured here",
    ] {
        assert!(o.stdout.contains(s), "plan --help lacks {s}: {}", o.stdout);
    }
}

/// Bad input exits 2 and names the flag.
#[test]
fn plan_bad_input_exits_2_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let profile = tiny_profile(dir.path());
    let missing = dir.path().join("none.json").display().to_string();
    let cases: &[(&[&str], &str)] = &[
        (&["--stage", "7"], "--stage"),
        (&["--world", "2x0"], "--world"),
        (&["--profile", &missing], "--profile"),
        (&["--grad-accum", "0"], "--grad-accum"),
        (&["--world", "3", "--profile", &profile], "--profile"),
        (&["--world", "2", "--profile", &profile, "--transport", "tcp"], "--transport"),
        (&["--world", "2,4"], "--world"),
        (&["--search"], "--profile"),
        (&["--search", "--profile", &profile, "--memory-cap", "12XB"], "--memory-cap"),
        (&["--profile", "no-such-profile"], "--profile"),
        (&["--model", "mlp-bn", "--activations", "counted", "--world", "1"], "--activations"),
        (&["--model", "gpt", "--vocab-size", "10", "--world", "1"], "--vocab-size"),
    ];
    for (args, flag) in cases {
        let mut all = vec!["plan"];
        all.extend_from_slice(args);
        let o = shardline(&all);
        assert_eq!(o.code, Some(2), "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains(flag), "{args:?} does not name {flag}: {}", o.stderr);
    }
}

/// `plan --json` with a profile gives every state category and a step whose time is its
/// compute plus its exposed communication (PLAN-4); without a profile, memory only.
#[test]
fn plan_json_gives_memory_and_the_step_plan_4() {
    let dir = tempfile::tempdir().unwrap();
    let profile = tiny_profile(dir.path());
    let args = ["plan", "--model", "gpt", "--n-layer", "2", "--n-embd", "32", "--n-head", "2"];
    let mut with = args.to_vec();
    with.extend(["--block-size", "16", "--world", "2", "--profile", &profile, "--json"]);
    let o = shardline(&with);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    let step = &v["step"];
    let (t, c, e) =
        (step["step_s"].as_f64(), step["compute_s"].as_f64(), step["exposed_s"].as_f64());
    let (t, c, e) = (t.unwrap(), c.unwrap(), e.unwrap());
    assert!(c > 0.0 && (t - c - e).abs() < 1e-9, "{step}");
    assert!(step["tokens_per_s"].as_f64().unwrap() > 0.0);
    // The compute's parts, the updates and the gathers' issue add up to it (PLAN-13,
    // PLAN-16), and the products to probe are listed.
    let parts = &step["compute_parts"];
    let sum: f64 = ["products_s", "elementwise_s", "alloc_s", "lanes_s"]
        .iter()
        .map(|k| parts[k].as_f64().unwrap())
        .sum::<f64>()
        + step["update_s"].as_f64().unwrap()
        + step["gather_issue_s"].as_f64().unwrap();
    assert!((sum - c).abs() < 1e-9 * c.max(1.0), "{step}");
    assert!(v["products"].as_array().is_some_and(|p| !p.is_empty()), "{v}");
    let cats: Vec<&str> =
        v["memory"].as_array().unwrap().iter().map(|r| r["category"].as_str().unwrap()).collect();
    for k in ["shard_params", "grads", "optimizer_state", "gathered_units", "activations"] {
        assert!(cats.contains(&k), "{cats:?}");
    }
    let o = shardline(&args);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(o.stdout.contains("step: not predicted (no --profile given)"), "{}", o.stdout);
}

/// PLAN-10: `plan --search` ranks at least ten configurations, each within the cap and
/// keeping the global batch, fastest first, and gives the `train` command of the best;
/// a tighter cap leaves fewer.
#[test]
fn plan_search_ranks_configurations_within_the_cap_plan_10() {
    let args = [
        "plan",
        "--model",
        "gpt",
        "--n-layer",
        "2",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--block-size",
        "16",
        "--batch-size",
        "8",
        "--world",
        "1,2",
        "--profile",
        "h100-8x-ib",
        "--search",
        "--json",
    ];
    let run = |cap: &str| {
        let mut a = args.to_vec();
        a.extend(["--memory-cap", cap]);
        let o = shardline(&a);
        assert_eq!(o.code, Some(0), "{}", o.stderr);
        serde_json::from_str::<serde_json::Value>(&o.stdout).unwrap()
    };
    let v = run("64MiB");
    let ranked = v["search"]["ranked"].as_array().unwrap();
    assert!(ranked.len() >= 10, "{}", ranked.len());
    let speeds: Vec<f64> = ranked.iter().map(|r| r["samples_per_s"].as_f64().unwrap()).collect();
    assert!(speeds.windows(2).all(|w| w[0] >= w[1]), "{speeds:?}");
    for r in ranked {
        let c = &r["choice"];
        let world = c["nodes"].as_u64().unwrap() * c["ranks_per_node"].as_u64().unwrap();
        assert_eq!(8 % (world * c["grad_accum"].as_u64().unwrap()), 0, "{c}");
        assert!(r["peak_bytes"].as_u64().unwrap() <= 64 << 20);
    }
    let best = v["best_command"].as_str().unwrap();
    let c = &ranked[0]["choice"];
    let world = c["nodes"].as_u64().unwrap() * c["ranks_per_node"].as_u64().unwrap();
    assert!(best.starts_with("shardline train --model gpt --dataset text --n-layer 2"), "{best}");
    assert!(best.contains(&format!("--world {world} --stage {}", c["stage"])), "{best}");
    let smallest = ranked.iter().map(|r| r["peak_bytes"].as_u64().unwrap()).min().unwrap();
    let tight = run(&smallest.to_string());
    let left = tight["search"]["ranked"].as_array().unwrap().len();
    assert!(left >= 1 && left < ranked.len(), "{left}");
}

/// PLAN-9: a 13B-parameter gpt over 128 ranks is predicted from published figures without
/// running it here: its activations counted, the profile's words carried.
#[test]
fn plan_at_scale_counts_activations_plan_9() {
    let o = shardline(&[
        "plan",
        "--model",
        "gpt",
        "--n-layer",
        "40",
        "--n-head",
        "40",
        "--n-embd",
        "5120",
        "--block-size",
        "2048",
        "--vocab-size",
        "50304",
        "--batch-size",
        "1024",
        "--world",
        "16x8",
        "--recompute",
        "units",
        "--grad-accum",
        "8",
        "--optimizer",
        "adamw",
        "--profile",
        "h100-8x-ib",
        "--json",
    ]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["activations_from"], "counted");
    assert!(v["published"].as_str().unwrap().contains("not measured here"));
    assert!(v["params"].as_u64().unwrap() > 12_000_000_000);
    assert!(v["step"]["tokens_per_s"].as_f64().unwrap() > 0.0);
}

/// `plan --trace` writes the simulated step as `train --trace` writes a measured one (a
/// Chrome trace: rank 0's compute, gather and reduce rows), and `shardline timeline` draws
/// either as SVG; bad input exits 2 naming the file or the flag.
#[test]
fn plan_trace_and_timeline_draw_the_simulated_step() {
    let dir = tempfile::tempdir().unwrap();
    let profile = tiny_profile(dir.path());
    let (trace, svg) = (dir.path().join("t.json"), dir.path().join("t.svg"));
    let (t, s) = (trace.display().to_string(), svg.display().to_string());
    let o = shardline(&[
        "plan",
        "--model",
        "gpt",
        "--n-layer",
        "2",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--block-size",
        "16",
        "--world",
        "2",
        "--profile",
        &profile,
        "--trace",
        &t,
        "--svg",
        &s,
    ]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let evs = v["traceEvents"].as_array().unwrap();
    let named = |p: &str, tid: u64| {
        evs.iter().any(|e| {
            e["ph"] == "X" && e["tid"] == tid && e["name"].as_str().unwrap().starts_with(p)
        })
    };
    assert!(named("forward transformer.h.0", 0) && named("backward", 0), "{v}");
    assert!(named("all-gather", 1) && named("reduce", 2), "{v}");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<rect"));
    let out = dir.path().join("again.svg").display().to_string();
    let o = shardline(&["timeline", &t, "--out", &out, "--window-ms", "0:1000"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(std::fs::read_to_string(&out).unwrap().contains("rank 0 compute"));
    let missing = dir.path().join("none.json").display().to_string();
    let o = shardline(&["timeline", &missing, "--out", &out]);
    assert_eq!(o.code, Some(2));
    assert!(o.stderr.contains("none.json"), "{}", o.stderr);
    let o = shardline(&["timeline", &t, "--out", &out, "--window-ms", "5:1"]);
    assert_eq!(o.code, Some(2));
    assert!(o.stderr.contains("--window-ms"), "{}", o.stderr);
    let o = shardline(&["plan", "--trace", &t]);
    assert_eq!(o.code, Some(2));
    assert!(o.stderr.contains("--profile"), "{}", o.stderr);
}
