//! What `shardline train` runs: on threads under the supervisor, as one launched rank, or on
//! the device engine.

use super::*;

/// The `shardline train` command that runs `c` of the searched job (the placement as
/// threads of one process, or `launch` across nodes, is the caller's).
pub(crate) fn train_command(
    a: &PlanArgs,
    cfg: &TrainConfig,
    c: &shardline_runtime::plan::search::Choice,
) -> String {
    let mut v = vec![
        "shardline train".to_string(),
        format!("--model {}", cfg.model),
        format!("--dataset {}", cfg.dataset),
    ];
    let s = &a.size;
    let sizes = [
        ("--n-layer", s.n_layer),
        ("--n-head", s.n_head),
        ("--n-embd", s.n_embd),
        ("--block-size", s.block_size),
        ("--vocab-size", s.vocab_size),
        ("--width", s.width),
        ("--hidden", s.hidden),
        ("--depth", s.depth),
    ];
    v.extend(sizes.iter().filter_map(|(f, x)| x.map(|x| format!("{f} {x}"))));
    if cfg.model == "wide-mlp" {
        v.push(format!("--params {}", s.params));
    }
    if cfg.dataset == "synthetic" {
        v.push(format!("--input-dim {} --classes {}", s.input_dim, s.classes));
    }
    v.push(format!("--batch-size {} --optimizer {}", cfg.batch_size, cfg.optimizer));
    if let Some(c) = cfg.clip_grad_norm {
        v.push(format!("--clip-grad-norm {c}"));
    }
    v.push(format!("--sync-bn {}", format!("{:?}", a.sync_bn).to_lowercase()));
    if cfg.threads != 1 {
        v.push(format!("--threads {}", cfg.threads));
    }
    v.push(format!(
        "--world {} --stage {} --prefetch {} --recompute {} --grad-accum {}",
        c.world(),
        c.stage,
        c.prefetch,
        c.recompute,
        c.grad_accum
    ));
    v.join(" ")
}

/// `train --device sim` (or `--device cuda --model-ops`): the device engine on simulated
/// devices (or GPUs), through the same training loop (checkpoints, resume, evaluation, logs,
/// summary); the flags it does not honour are refused by name.
pub(crate) fn sim_train(a: &TrainArgs, cfg: &TrainConfig) -> i32 {
    let cuda = a.device == DeviceKind::Cuda;
    let device = if cuda { "--device cuda --model-ops" } else { "--device sim" };
    // The engine's host-side work (shape probes) runs on the CPU backend.
    let cfg = &TrainConfig { device: Device::Cpu, ..cfg.clone() };
    let refused = [
        (cuda && a.offload != OffloadArg::None, "--offload"),
        (cuda && a.trace.is_some(), "--trace"),
        (!a.faults.is_empty(), "--fault"),
        (a.dump_on_failure.is_some(), "--dump-on-failure"),
        (a.metrics_addr.is_some(), "--metrics-addr"),
        (!cfg.shard_group.is_world(), "--shard-group"),
        (!a.reshard_after_forward.is_world(), "--reshard-after-forward"),
        (cfg.profile.is_some(), "--profile"),
    ];
    if let Some((_, flag)) = refused.iter().find(|r| r.0) {
        eprintln!("error: {flag} is not supported with {device}");
        return 2;
    }
    if std::env::var_os("WORLD_SIZE").is_some() {
        eprintln!("error: {device} runs its ranks as threads of one process, not launched");
        return 2;
    }
    // Every built-in model lowers to device ops but gpt's dropout while training; an unknown
    // model name is the configuration check's to name.
    if let Some(d) = cfg.dropout.filter(|d| a.model_ops && cfg.model == "gpt" && *d != 0.0) {
        eprintln!(
            "error: --model-ops: gpt's dropout while training does not lower to device ops \
             (got --dropout {d}); use --dropout 0, or run without --model-ops"
        );
        return 2;
    }
    let o = shardline_runtime::engine::on_device::DeviceTrainOptions {
        cuda: a.device == DeviceKind::Cuda,
        seed: a.sim_seed,
        max_delay_us: a.sim_delay_us,
        capacity: a.device_memory,
        offload: match a.offload {
            OffloadArg::None => Offload::None,
            OffloadArg::Optimizer => Offload::Optimizer,
            OffloadArg::Params => Offload::Params,
        },
        trace: a.trace.clone(),
        one_comm: a.sim_one_comm,
        model_ops: a.model_ops,
    };
    let opts = run_options(a);
    if let Err(e) = shardline_runtime::interrupt::install(true) {
        eprintln!("error: {e}");
        return 1;
    }
    match shardline_runtime::engine::on_device::train_on_devices(cfg.clone(), opts, &o) {
        Ok(summary) => {
            if let Some(p) = &a.summary_json {
                let text = serde_json::to_string_pretty(&summary).unwrap_or_default();
                if let Err(e) = std::fs::write(p, text) {
                    eprintln!("error: writing {}: {e}", p.display());
                    return 1;
                }
            }
            0
        }
        Err(e @ RuntimeError::Interrupted { .. }) => {
            eprintln!("{e}");
            exit_for(&e)
        }
        Err(e) => {
            eprintln!("error: {e}");
            exit_for(&e)
        }
    }
}

/// Opens `--device` before anything starts: a host without a GPU (or a build without the
/// feature) is a usage error with exit code 2, naming what is missing.
pub(crate) fn check_device(device: DeviceKind) -> Result<Device, String> {
    let d = match device {
        // The simulated device's kernels run on the CPU backend.
        DeviceKind::Cpu | DeviceKind::Sim => Device::Cpu,
        DeviceKind::Cuda => Device::Cuda(0),
    };
    shardline_runtime::engine::open_backend(d, 1).map_err(|e| format!("--device {d}: {e}"))?;
    Ok(d)
}

/// `shardline train` as one rank of a multi-process job, when a launch environment is set
/// (`shardline launch`, torchrun or Slurm variables); returns the exit code.
pub(crate) fn worker_mode(
    a: &TrainArgs,
    cfg: &TrainConfig,
    opts: &RunOptions,
    env: shardline_runtime::launch::WorkerEnv,
) -> i32 {
    use shardline_runtime::launch::run_worker;
    let mut opts = opts.clone();
    opts.progress = opts.progress && env.rank == 0;
    // The job runs the launcher's world; a --world that says otherwise is a mistake worth
    // naming once (rank 0), not a reason to stop a job every rank of which agrees.
    if a.world_given && a.world != env.world && env.rank == 0 {
        eprintln!(
            "warning: --world {} is not used: the {} launch environment sets the world to {}",
            a.world, env.source, env.world
        );
    }
    // The agent forwards SIGINT/SIGTERM: stop with the group after a step, checkpoint it.
    // LAUNCH-13: a wait that outlasts its grace after the signal ends the worker.
    let installed = shardline_runtime::interrupt::install(false).and_then(|_| {
        shardline_runtime::interrupt::watch_waits(format!("shardline: rank {}", env.rank))
    });
    // INT-3: `shardline launch`'s agent stops its workers with SIGUSR1 to grow the job.
    let installed = installed.and_then(|_| match env.source {
        "shardline" => shardline_runtime::interrupt::install_planned_stop(),
        _ => Ok(()),
    });
    if let Err(e) = installed {
        eprintln!("error: rank {}: {e}", env.rank);
        return 1;
    }
    match run_worker(cfg.clone(), opts, &env) {
        Ok(summary) => {
            if let (Some(p), 0) = (&a.summary_json, env.rank) {
                let text = serde_json::to_string_pretty(&summary).unwrap_or_default();
                if let Err(e) = std::fs::write(p, text) {
                    eprintln!("error: writing {}: {e}", p.display());
                    return 1;
                }
            }
            0
        }
        Err(e) => {
            // One write, so that the lines of ranks sharing a terminal never interleave.
            use std::io::Write;
            let interrupted = matches!(e, RuntimeError::Interrupted { .. });
            // A failure after a stop was asked (a peer that stopped first closed the store or a
            // link) is the stop's doing: reported, and ended, as the stop.
            let stopped = shardline_runtime::interrupt::requested().filter(|_| !interrupted);
            let line = match stopped {
                Some(sig) => format!(
                    "rank {}: stopped by {}; meanwhile: {e}\n",
                    env.rank,
                    shardline_runtime::interrupt::signal_name(sig)
                ),
                None if interrupted => format!("rank {}: {e}\n", env.rank),
                None => format!("error: rank {}: {e}\n", env.rank),
            };
            let _ = std::io::stderr().write_all(line.as_bytes());
            if env.source == "torchrun" {
                shardline_runtime::launch::record_torchrun_error(line.trim_end());
            }
            stopped.map_or_else(|| exit_for(&e), |sig| 128 + sig)
        }
    }
}

/// `shardline train`: checks the flags and the device, then runs on the device engine, as one
/// rank of a launched job, or on threads under the supervisor; returns the exit code.
pub(crate) fn train(a: TrainArgs) -> i32 {
    let device = match check_device(a.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let cfg = match to_config(&a).and_then(|c| {
        let mut c = TrainConfig { device, ..c };
        if let Some(path) = &a.config {
            let f = shardline_runtime::config_file::ConfigFile::load(path)
                .map_err(|e| e.to_string())?;
            f.model.apply(a.model.as_deref(), &mut c);
            if a.dataset.is_none() {
                c.dataset = default_dataset(Some(&c.model)).into();
            }
        }
        Ok(c)
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if a.device == DeviceKind::Sim || (a.device == DeviceKind::Cuda && a.model_ops) {
        std::process::exit(sim_train(&a, &cfg));
    }
    if a.offload != OffloadArg::None {
        eprintln!("error: --offload runs on the device engine: use it with --device sim");
        std::process::exit(2);
    }
    if a.model_ops {
        eprintln!("error: --model-ops runs on the device engine: use it with --device sim or cuda");
        std::process::exit(2);
    }
    if let Some(addr) = a.metrics_addr {
        if let Err(e) = shardline_runtime::telemetry::serve_prometheus(addr) {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
    let launched = match shardline_runtime::launch::WorkerEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let file = match &a.config {
        Some(path) => match shardline_runtime::fault::FaultsConfig::load(path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        },
        None => shardline_runtime::fault::FaultsConfig::default(),
    };
    let plan = match file.plan(&a.faults, a.fault_seed).and_then(|p| {
        match &launched {
            Some(env) => p.validate_launched(env.world),
            None => p.validate(cfg.world),
        }
        .map(|_| p)
        .map_err(|e| e.to_string())
    }) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let injector =
        (!plan.faults.is_empty()).then(|| shardline_runtime::fault::FaultInjector::new(plan));
    let mut opts = run_options(&a);
    if let Some(env) = launched {
        // The worker's rank faults fire in the process itself (LAUNCH-8); restarts
        // are the agent's (`launch --max-restarts`).
        opts.faults = injector;
        std::process::exit(worker_mode(&a, &cfg, &opts, env));
    }
    // Ctrl-C or a scheduler's SIGTERM: stop after the step in progress, checkpoint it.
    if let Err(e) = shardline_runtime::interrupt::install(true) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    let sup = shardline_runtime::supervise::run_supervised(cfg, opts, injector, a.max_restarts);
    sup.print();
    let faults = sup.fault_summary();
    match sup.result {
        Ok(summary) => {
            if let Some(p) = &a.summary_json {
                let mut v = serde_json::to_value(&summary).unwrap_or_default();
                if let Some(o) = v.as_object_mut() {
                    o.insert("faults".into(), serde_json::to_value(&faults).unwrap_or_default());
                }
                let text = serde_json::to_string_pretty(&v).unwrap_or_default();
                if let Err(e) = std::fs::write(p, text) {
                    eprintln!("error: writing {}: {e}", p.display());
                    std::process::exit(1);
                }
            }
            0
        }
        Err(e @ RuntimeError::Interrupted { .. }) => {
            eprintln!("{e}");
            exit_for(&e)
        }
        Err(e) => {
            eprintln!("error: {e}");
            exit_for(&e)
        }
    }
}
