//! `shardline plan` and `shardline timeline`: their flags and what they run.

use super::*;

/// `shardline plan`.
#[derive(Args, Debug)]
pub(crate) struct PlanArgs {
    /// Model: mlp-bn, convnet-bn, wide-mlp, resnet-bn or gpt (sized by the flags below, as
    /// `train` sizes them).
    #[arg(long, default_value = "mlp-bn")]
    pub(crate) model: String,
    /// Data set, as `train --dataset` (it gives the samples' shape and classes) [default:
    /// text for gpt, else digits].
    #[arg(long)]
    pub(crate) dataset: Option<String>,
    /// Ranks: R (one node), or NxR (N nodes of R ranks); with --search a comma list of
    /// them, each searched (e.g. 1x8,4x8,16x8).
    #[arg(long, default_value = "4", value_parser = parse_worlds)]
    pub(crate) world: Worlds,
    /// Machine profile for the step time: a file (shardline-bench machine-profile), or a
    /// profile shipped in the binary by name: h100-8x-ib (H100 SXM 80GB nodes of 8 on
    /// NVLink, 8x 400G InfiniBand each; from published figures, not measured here, each
    /// figure with its source).
    #[arg(long, value_name = "FILE|NAME")]
    pub(crate) profile: Option<String>,
    /// The profile's transport for the collectives; INTRA/INTER prices the executor's
    /// hierarchical schedule across nodes [default: the profile's own (h100-8x-ib: nvlink,
    /// nvlink/ib across nodes), else local on one node (threads of one process), tcp
    /// across nodes].
    #[arg(long)]
    pub(crate) transport: Option<String>,
    /// Activations and scratch: probe (one microbatch run on this host), counted (gpt's,
    /// from its shape; scratch not modelled) or auto (counted for a gpt whose probe would
    /// need more than 1 GiB here, else probe).
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) activations: ActivationsArg,
    /// Search: predict every configuration of this model and global batch (stages 0-3,
    /// prefetch 0-2 at stage 3, recompute none and units, every --grad-accum dividing a
    /// rank's share, each --world), drop those over --memory-cap, and print the fastest
    /// (--top) with their memory and step, and the `shardline train` command of the best.
    /// Needs --profile; ignores --stage, --prefetch, --recompute, --grad-accum and
    /// --accum-reduce (each stage's default).
    #[arg(long)]
    pub(crate) search: bool,
    /// With --search: most bytes per rank (e.g. 64MiB, 80GB) [default: the profile's
    /// device memory when it gives one, else no cap].
    #[arg(long, value_parser = parse_bytes)]
    pub(crate) memory_cap: Option<u64>,
    /// With --search: configurations printed.
    #[arg(long, default_value_t = 10)]
    pub(crate) top: usize,
    /// ZeRO stage, 0-3.
    #[arg(long, default_value = "3")]
    pub(crate) stage: String,
    /// Units gathered ahead of use at stage 3.
    #[arg(long, default_value_t = 1)]
    pub(crate) prefetch: usize,
    /// Byte budget for gathered units in flight [default: (prefetch+1) x the largest unit].
    #[arg(long, value_parser = parse_bytes)]
    pub(crate) prefetch_budget: Option<u64>,
    /// Global batch size.
    #[arg(long, default_value_t = 64)]
    pub(crate) batch_size: usize,
    /// Microbatches per step.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub(crate) grad_accum: usize,
    /// With --grad-accum at stages 2 and 3: each or last [default: each].
    #[arg(long, value_enum)]
    pub(crate) accum_reduce: Option<AccumReduceArg>,
    /// Activation recomputation: none or units.
    #[arg(long, value_enum, default_value = "none")]
    pub(crate) recompute: RecomputeArg,
    /// Optimizer: sgd (momentum) or adamw.
    #[arg(long, default_value = "sgd")]
    pub(crate) optimizer: String,
    /// Clip the global gradient norm (the updates then wait for every reduction).
    #[arg(long)]
    pub(crate) clip_grad_norm: Option<f64>,
    /// SyncBatchNorm: on, off or auto (as train).
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) sync_bn: OnOffAuto,
    /// Compute threads per rank.
    #[arg(long, default_value_t = 1)]
    pub(crate) threads: usize,
    #[command(flatten)]
    pub(crate) size: ModelArgs,
    /// Print the prediction as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// Write the simulated steady step of rank 0 as a Chrome trace (the rows and span names
    /// of `train --trace`: forward, backward, input grad, update, wait on the compute row;
    /// all-gather and reduce on their lanes); needs --profile.
    #[arg(long, value_name = "FILE")]
    pub(crate) trace: Option<PathBuf>,
    /// Write the same step as an SVG timeline (`shardline timeline` draws a measured trace
    /// the same way); needs --profile.
    #[arg(long, value_name = "FILE")]
    pub(crate) svg: Option<PathBuf>,
}

/// `shardline timeline`.
#[derive(Args, Debug)]
pub(crate) struct TimelineArgs {
    /// A Chrome trace: `train --trace FILE` or `plan --trace FILE`.
    pub(crate) trace: PathBuf,
    /// The SVG file to write.
    #[arg(long, value_name = "FILE")]
    pub(crate) out: PathBuf,
    /// Only the spans inside START:END, milliseconds from the trace's origin (e.g. one
    /// step) [default: the whole trace].
    #[arg(long, value_name = "START:END", value_parser = parse_window)]
    pub(crate) window_ms: Option<(f64, f64)>,
}

/// `--window-ms START:END`, START below END.
pub(crate) fn parse_window(s: &str) -> Result<(f64, f64), String> {
    let bad = || format!("'{s}' is not START:END in milliseconds with START < END (try 120:180)");
    let (a, b) = s.split_once(':').ok_or_else(bad)?;
    let (a, b): (f64, f64) =
        (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
    if a.is_finite() && b.is_finite() && a < b {
        Ok((a, b))
    } else {
        Err(bad())
    }
}

/// `shardline timeline`: the SVG of a Chrome trace.
pub(crate) fn timeline_cmd(a: &TimelineArgs) -> i32 {
    let doc =
        std::fs::read(&a.trace).map_err(|e| format!("{}: {e}", a.trace.display())).and_then(|b| {
            serde_json::from_slice::<serde_json::Value>(&b)
                .map_err(|e| format!("{}: not JSON: {e}", a.trace.display()))
        });
    let window = a.window_ms.map(|(x, y)| (x * 1e3, y * 1e3));
    let title = a.trace.display().to_string();
    let svg = doc.and_then(|d| {
        shardline_runtime::timeline_svg::render(&d, window, &title)
            .map_err(|e| format!("{}: {e}", a.trace.display()))
    });
    match svg {
        Ok(svg) => match std::fs::write(&a.out, svg) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("error: --out {}: {e}", a.out.display());
                1
            }
        },
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

/// `plan --world`: (nodes, ranks per node) of each placement.
#[derive(Clone, Debug)]
pub(crate) struct Worlds(Vec<(usize, usize)>);

/// `--world R`, `NxR`, or a comma list of them.
pub(crate) fn parse_worlds(s: &str) -> Result<Worlds, String> {
    s.split(',').map(parse_world).collect::<Result<_, _>>().map(Worlds)
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum ActivationsArg {
    Probe,
    Counted,
    Auto,
}

/// `--world R` or `NxR`.
pub(crate) fn parse_world(s: &str) -> Result<(usize, usize), String> {
    let parse = |t: &str| match t.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("'{s}' is not R or NxR with positive counts (try 4 or 2x4)")),
    };
    match s.split_once(['x', 'X']) {
        Some((n, r)) => Ok((parse(n)?, parse(r)?)),
        None => Ok((1, parse(s)?)),
    }
}

pub(crate) fn plan_cmd(a: &PlanArgs) -> i32 {
    use shardline_runtime::plan::{predict_from, profile::Profile, ActivationSource, Placement};
    let stage = match a.stage.parse::<u8>().ok().and_then(|n| Stage::from_index(n).ok()) {
        Some(s) => s,
        None => {
            eprintln!("error: --stage must be 0, 1, 2 or 3, not '{}'", a.stage);
            return 2;
        }
    };
    if a.world.0.len() > 1 && !a.search {
        eprintln!("error: --world: a list of worlds needs --search");
        return 2;
    }
    let (nodes, ranks) = a.world.0[0];
    let dataset = a.dataset.clone().unwrap_or_else(|| {
        if a.model == "gpt" {
            "text".into()
        } else {
            "digits".into()
        }
    });
    let cfg = TrainConfig {
        world: nodes * ranks,
        stage: StageChoice::Fixed(stage),
        model: a.model.clone(),
        dataset,
        steps: Some(1),
        batch_size: a.batch_size,
        optimizer: a.optimizer.clone(),
        clip_grad_norm: a.clip_grad_norm,
        sync_bn: match a.sync_bn {
            OnOffAuto::On => SyncBnMode::On,
            OnOffAuto::Off => SyncBnMode::Off,
            OnOffAuto::Auto => SyncBnMode::Auto,
        },
        grad_accum: a.grad_accum,
        accum_reduce: a.accum_reduce.map(|r| match r {
            AccumReduceArg::Each => AccumReduce::Each,
            AccumReduceArg::Last => AccumReduce::Last,
        }),
        recompute: match a.recompute {
            RecomputeArg::None => Recompute::None,
            RecomputeArg::Units => Recompute::Units,
        },
        prefetch: a.prefetch,
        prefetch_budget: a.prefetch_budget,
        threads: a.threads,
        ..TrainConfig::default()
    };
    let cfg = a.size.apply(cfg);
    let profile = match &a.profile {
        Some(p) => match Profile::load_named(p) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("error: {e}");
                return 2;
            }
        },
        None => None,
    };
    // The profile's own transports first, else threads of one process or tcp.
    let transport_for = |nodes: usize| -> String {
        if let Some(t) = &a.transport {
            return t.clone();
        }
        match profile.as_ref().and_then(|p| p.transports_default.clone()) {
            Some((intra, inter)) if nodes > 1 => format!("{intra}/{inter}"),
            Some((intra, _)) => intra,
            None if nodes > 1 => "tcp".into(),
            None => "local".into(),
        }
    };
    if let (Some(p), Some(t)) = (&profile, &a.transport) {
        let known = |t: &str, w: usize| w <= 1 || p.transports(w).iter().any(|x| x == t);
        let ok = a.world.0.iter().all(|&(n, r)| match t.split_once('/') {
            Some((intra, inter)) => known(intra, r) && known(inter, n),
            None => known(t, n * r),
        });
        if !ok {
            eprintln!(
                "error: --transport {t}: the profile has {:?} at world {}",
                p.transports(cfg.world),
                cfg.world
            );
            return 2;
        }
    }
    let source = match a.activations {
        ActivationsArg::Probe => ActivationSource::Probe,
        ActivationsArg::Counted => ActivationSource::Counted,
        ActivationsArg::Auto => ActivationSource::Auto,
    };
    if a.search {
        return search_cmd(a, &cfg, profile.as_ref(), &transport_for, source);
    }
    let at = Placement { nodes, ranks_per_node: ranks, transport: transport_for(nodes) };
    let job = match shardline_runtime::train::plan(&cfg) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("error: {e}");
            return exit_for(&e);
        }
    };
    if (a.trace.is_some() || a.svg.is_some()) && profile.is_none() {
        eprintln!("error: --trace and --svg draw the simulated step and need --profile");
        return 2;
    }
    let p = predict_from(&cfg, &job, &at, profile.as_ref(), source);
    if let Ok(p) = &p {
        let doc = shardline_runtime::telemetry::chrome_json(&p.timeline);
        let title = format!(
            "shardline plan: {} world {} stage {}, simulated step",
            p.model, p.world, p.stage
        );
        let files = [
            (a.trace.as_ref(), "--trace", serde_json::to_string(&doc).unwrap_or_default()),
            (
                a.svg.as_ref(),
                "--svg",
                shardline_runtime::timeline_svg::render(&doc, None, &title).unwrap_or_default(),
            ),
        ];
        for (path, flag, text) in files {
            if let Some(path) = path {
                if let Err(e) = std::fs::write(path, text) {
                    eprintln!("error: {flag} {}: {e}", path.display());
                    return 1;
                }
            }
        }
    }
    match p {
        Ok(p) if a.json => {
            println!("{}", serde_json::to_string_pretty(&p).unwrap_or_default());
            0
        }
        Ok(p) => {
            p.lines().iter().for_each(|l| println!("{l}"));
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            exit_for(&e)
        }
    }
}

/// `plan --search`: the ranking, and the `train` command of the best.
pub(crate) fn search_cmd(
    a: &PlanArgs,
    cfg: &TrainConfig,
    profile: Option<&shardline_runtime::plan::profile::Profile>,
    transport_for: &dyn Fn(usize) -> String,
    source: shardline_runtime::plan::ActivationSource,
) -> i32 {
    use shardline_runtime::memory::format_bytes;
    use shardline_runtime::plan::search;
    let Some(p) = profile else {
        eprintln!("error: --search ranks by step time and needs --profile");
        return 2;
    };
    let cap = a.memory_cap.or(p.device_memory.as_ref().map(|m| m.value as u64));
    let found = match search::search(cfg, &a.world.0, p, cap, transport_for, source) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e}");
            return exit_for(&e);
        }
    };
    let best = found.ranked.first().map(|b| train_command(a, cfg, &b.choice));
    if a.json {
        let v = serde_json::json!({ "search": found, "best_command": best });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return 0;
    }
    let cap_words = cap.map_or("no cap".to_string(), format_bytes);
    println!(
        "shardline plan --search: {} ({} samples per step), {} configurations, {} within {cap_words} per rank",
        cfg.model,
        cfg.batch_size,
        found.evaluated,
        found.ranked.len()
    );
    if let Some(words) = &p.published {
        println!("  profile: {words}");
    }
    if let Some(why) = &found.first_refusal {
        println!("  {} configurations refused by train's checks (the first: {why})", found.refused);
    }
    println!(
        "  {:>4} {:>7} {:>5} {:>8} {:>9} {:>5} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "rank",
        "world",
        "stage",
        "prefetch",
        "recompute",
        "accum",
        "peak",
        "step ms",
        "compute ms",
        "exposed ms",
        "samples/s",
        "tokens/s"
    );
    for (i, r) in found.ranked.iter().take(a.top).enumerate() {
        let c = &r.choice;
        println!(
            "  {:>4} {:>7} {:>5} {:>8} {:>9} {:>5} {:>10} {:>10.2} {:>10.2} {:>10.2} {:>12.1} {:>12}",
            i + 1,
            format!("{}x{}", c.nodes, c.ranks_per_node),
            c.stage,
            c.prefetch,
            c.recompute,
            c.grad_accum,
            format_bytes(r.peak_bytes),
            r.step_s * 1e3,
            r.compute_s * 1e3,
            r.exposed_s * 1e3,
            r.samples_per_s,
            r.tokens_per_s.map_or("-".into(), |t| format!("{t:.0}"))
        );
    }
    match best {
        Some(cmd) => println!("  best: {cmd}"),
        None => println!("  no configuration fits {cap_words} per rank"),
    }
    0
}
