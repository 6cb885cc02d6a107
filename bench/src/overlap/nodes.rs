//! `overlap --nodes`: the same comparison across network-namespace nodes.

use super::*;

/// The check on prefetch 1 over a shaped network.
#[derive(Serialize, Debug, Clone)]
pub struct NetGoal {
    /// The communication time the check uses, ms: the larger of the collectives' time in
    /// flight and the wire time (both are lower bounds of what the step's communication
    /// needs; in flight reads low when a peer's bytes cross before this rank's op begins).
    pub comm_ms: f64,
    /// Step time over max(compute, comm_ms).
    pub step_over_max: f64,
    /// comm_ms over compute.
    pub comm_over_compute: f64,
    /// Whether the two are comparable (ratio within [0.5, 2]), the check's premise.
    pub comparable: bool,
    /// step_over_max <= 1.15.
    pub met: bool,
}

pub(crate) fn net_goal(r: &Row) -> NetGoal {
    let comm_ms = r.comm_ms.max(r.wire_ms.unwrap_or(0.0));
    let step_over_max = r.step_ms / r.compute_ms.max(comm_ms).max(1e-9);
    let comm_over_compute = comm_ms / r.compute_ms.max(1e-9);
    NetGoal {
        comm_ms,
        step_over_max,
        comm_over_compute,
        comparable: (0.5..=2.0).contains(&comm_over_compute),
        met: step_over_max <= 1.15,
    }
}

/// The report of `--nodes`.
#[derive(Serialize, Debug)]
pub struct NetReport {
    /// Nodes (namespaces).
    pub nodes: usize,
    /// Worker processes per node.
    pub nproc_per_node: usize,
    /// Model description.
    pub model: String,
    /// Global batch.
    pub batch_size: usize,
    /// tc tbf rate of every node link (each direction), bytes/s.
    pub link_rate: u64,
    /// Per prefetch depth.
    pub rows: Vec<Row>,
    /// The check on prefetch 1.
    pub goal: Option<NetGoal>,
    /// busbw rows over the shaped links (`frac_of_limit`: inter-node busbw / link rate).
    pub busbw: Vec<crate::collectives::Row>,
}

/// Rank 0's median step and exposed times (ms) and bytes sent per step from its
/// `--log-json`.
pub(crate) fn rank0_log(path: &Path, warmup: u64) -> anyhow::Result<(f64, f64, f64)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut steps = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let f = |k: &str| v[k].as_f64().ok_or_else(|| anyhow::anyhow!("log line without {k}: {v}"));
        // Under --shard-group the replica lane's bytes too (0 without groups).
        let sent =
            f("gather_bytes")? + f("reduce_bytes")? + v["replica_bytes"].as_f64().unwrap_or(0.0);
        steps.push((f("step_time_s")? * 1e3, f("comm_exposed_s")? * 1e3, sent));
    }
    let counted: Vec<_> = steps.into_iter().skip(warmup as usize).collect();
    Ok((
        median(counted.iter().map(|s| s.0).collect()),
        median(counted.iter().map(|s| s.1).collect()),
        median(counted.iter().map(|s| s.2).collect()),
    ))
}

pub(crate) fn run_nodes(a: &Args, nodes: usize) -> anyhow::Result<()> {
    let rate = a.link_rate.ok_or_else(|| {
        report::Usage(
            "--nodes needs --link-rate (the tc rate of every node link, e.g. 1gbit)".into(),
        )
    })?;
    report::check_flags(nodes >= 2 && a.nproc_per_node > 0, || {
        "--nodes needs at least 2 nodes and --nproc-per-node at least 1".into()
    })?;
    report::check_flags(a.warmup > 0, || {
        "--warmup must be at least 1 with --nodes (the first step has no start mark)".into()
    })?;
    let world = nodes * a.nproc_per_node;
    let bin = shardline_bin()?;
    let tmp = std::env::temp_dir().join(format!("shardline-overlap-nodes-{}", std::process::id()));
    let dir = a.keep_dir.clone().unwrap_or_else(|| tmp.clone());
    std::fs::create_dir_all(&dir)?;
    let res = run_nodes_in(a, nodes, world, rate, &bin, &dir);
    if a.keep_dir.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    res
}

pub(crate) fn run_nodes_in(
    a: &Args,
    nodes: usize,
    world: usize,
    rate: u64,
    bin: &Path,
    dir: &Path,
) -> anyhow::Result<()> {
    let mut cfg0 = config(a, 0, None, 1);
    cfg0.world = world;
    let (train_set, _) = load_data(&cfg0, false)?;
    let model = build_model(&cfg0, &train_set.sample_shape, train_set.classes)?;
    let layout = ShardedModelLayout::new(&model.spec(), world)?;
    let w = world as u64;
    let model_desc = format!(
        "mlp-bn {}-{}x{}-{} ({} units, {:.1}M params, {})",
        a.input_dim,
        a.depth,
        a.hidden,
        a.classes,
        layout.units().len(),
        layout.padded_numel() as f64 / 1e6,
        cfg0.precision_label()
    );
    println!(
        "overlap over {nodes} namespace nodes x {} processes, links shaped to {}/s ({} Mbit/s) \
         each way: {model_desc}, global batch {}, stage 3",
        a.nproc_per_node,
        report::human_bytes(rate as f64),
        rate * 8 / 1_000_000,
        a.batch_size
    );
    let net = crate::build_net(nodes, Some(rate))?;
    let token = format!("overlap-{:x}", std::process::id());
    let mut rows = Vec::new();
    let mut timeline_events = None;
    for (i, &p) in a.prefetch.iter().enumerate() {
        // A fresh port per job: the previous job's store may still be in TIME_WAIT.
        let rdzv = format!("{}:{}", net.addr(0), 29700 + i);
        let mut agents = Vec::new();
        let tx_before = crate::link_bytes::nodes_tx_bytes(&net)?;
        for k in 0..nodes {
            let mut cmd = net.command(k, bin);
            cmd.args(["launch", "--nproc-per-node", &a.nproc_per_node.to_string()])
                .args(["--nnodes", &nodes.to_string(), "--node-rank", &k.to_string()])
                .args(["--rdzv", &rdzv, "--token", &token, "--"])
                .args(train_args(a, p, dir));
            agents.push(process::Child::spawn(cmd, &format!("launch on node {k}"))?);
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
        process::wait_all(agents, deadline).with_context(|| format!("the prefetch {p} job"))?;
        let across = crate::link_bytes::nodes_tx_bytes(&net)?.saturating_sub(tx_before);
        let events = load_rank_traces(dir, p, world)?;
        let per: Vec<Vec<[f64; 4]>> = (0..world).map(|r| rank_steps(&events, r)).collect();
        let mut row = combine_ranks(p, &per, a.warmup)?;
        let cpu: Vec<Vec<f64>> = (0..world).map(|r| rank_cpu_steps(&events, r)).collect();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if let Some((per_rank_cpu, floor)) = cpu_per_step(&cpu, a.warmup, cores) {
            row.cpu_ms = Some(per_rank_cpu);
            row.cpu_floor_ms = Some(floor);
        }
        let wire: Vec<Vec<f64>> = (0..world).map(|r| rank_wire_bytes(&events, r, world)).collect();
        if let Some((bytes, _)) = cpu_per_step(&wire, a.warmup, 1) {
            row.wire_bytes = Some(bytes);
            row.wire_ms = Some(bytes / rate as f64 * 1e3);
        }
        let (s0, e0, sent0) = rank0_log(&dir.join(format!("p{p}.jsonl")), a.warmup)?;
        row.rank0_log_step_ms = Some(s0);
        row.rank0_log_exposed_ms = Some(e0);
        row.rank0_sent_bytes = Some(sent0);
        row.inter_node_bytes = Some(across as f64 / (a.steps.max(1) * w) as f64);
        row.final_loss = Some(crate::link_bytes::final_loss(&dir.join(format!("p{p}.jsonl")))?);
        if p == a.timeline_prefetch {
            timeline_events = Some(events);
        }
        println!(
            "  prefetch {p}: step {:.1} ms, compute {:.1} ms, comm {:.1} ms, exposed {:.1} ms, \
             rank 0 sent {} per step (lane counters), {} per rank and step across nodes \
             (interfaces), final loss {:.4}",
            row.step_ms,
            row.compute_ms,
            row.comm_ms,
            row.exposed_ms,
            report::human_bytes(sent0),
            report::human_bytes(row.inter_node_bytes.unwrap_or(0.0)),
            row.final_loss.unwrap_or(f64::NAN)
        );
        rows.push(row);
    }
    println!(
        "medians over {} steps after {} warmup; step: slowest rank, the rest: mean over ranks \
         (from the workers' traces)",
        rows.first().map_or(0, |r| r.steps),
        a.warmup
    );
    println!(
        "{:>8} {:>11} {:>9} {:>9} {:>11} {:>10} {:>12} {:>13} {:>9} {:>8} {:>16} {:>9} {:>10}",
        "prefetch",
        "compute_ms",
        "comm_ms",
        "step_ms",
        "exposed_ms",
        "exposed_%",
        "comm/compute",
        "step/max(c,c)",
        "sent",
        "wire_ms",
        "step/max(c,wire)",
        "cpu_ms",
        "floor_ms"
    );
    let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |x| format!("{x:.1}"));
    for r in &rows {
        println!(
            "{:>8} {:>11.1} {:>9.1} {:>9.1} {:>11.1} {:>10.1} {:>12.2} {:>13.2} {:>9} {:>8} {:>16} {:>9} {:>10}",
            r.prefetch,
            r.compute_ms,
            r.comm_ms,
            r.step_ms,
            r.exposed_ms,
            r.exposed_pct,
            r.comm_over_compute,
            r.step_ms / r.compute_ms.max(r.comm_ms).max(1e-9),
            r.wire_bytes.map_or_else(|| "-".to_string(), report::human_bytes),
            opt(r.wire_ms),
            r.wire_ms.map_or_else(
                || "-".to_string(),
                |w| format!("{:.2}", r.step_ms / r.compute_ms.max(w).max(1e-9))
            ),
            opt(r.cpu_ms),
            opt(r.cpu_floor_ms)
        );
    }
    println!(
        "comm_ms: collectives in flight on a rank (their spans' union), which reads low on a \
         shaped link: a peer's bytes can cross it before this rank's op begins; sent: bytes one \
         rank sends per step (its collectives' sizes on the trace); wire_ms: those bytes at the \
         link rate alone, the least time they need"
    );
    println!(
        "cpu_ms: CPU time per step of one rank's process (every thread, user + system); \
         floor_ms: all ranks' CPU per step over this machine's {} cores, a lower bound on the \
         step while they share them",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let goal = rows.iter().find(|r| r.prefetch == 1).map(net_goal);
    if let Some(g) = &goal {
        println!(
            "check (prefetch 1: step <= 1.15 x max(compute, comm) where comm/compute is within \
             [0.5, 2]; comm = max(comm_ms, wire_ms) = {:.1} ms): {:.2}x -> {}{}",
            g.comm_ms,
            g.step_over_max,
            if g.met { "met" } else { "NOT met" },
            if g.comparable {
                String::new()
            } else {
                format!(" (comm/compute {:.2}: outside the check's premise)", g.comm_over_compute)
            }
        );
        let p1 = rows.iter().find(|r| r.prefetch == 1);
        if let (Some(floor), Some(r)) = (p1.and_then(|r| r.cpu_floor_ms), p1) {
            // Where the ranks' CPU alone nearly fills the allowed step, the check asks the
            // cores and the link to be busy together for most of it: say how much.
            let allowed = 1.15 * r.compute_ms.max(g.comm_ms);
            println!(
                "  the ranks' CPU per step puts a floor of {floor:.1} ms under the step on this \
                 machine's cores; 1.15x allows {allowed:.1} ms, so the cores would be busy \
                 {:.0}% of such a step",
                100.0 * floor / allowed
            );
        }
    }

    let mut busbw = Vec::new();
    if !a.busbw_sizes.is_empty() {
        let ops = [
            crate::collectives::Op::AllReduce,
            crate::collectives::Op::ReduceScatter,
            crate::collectives::Op::AllGather,
        ];
        let sizes: Vec<u64> = a.busbw_sizes.iter().map(|&b| (b / (4 * w)).max(1) * 4 * w).collect();
        let cargs =
            crate::collectives::Args::for_nodes(nodes, a.nproc_per_node, rate, a.busbw_iters);
        println!(
            "\nbusbw over the shaped links ({} per link = {:.3} GB/s; of-limit = inter-node \
             busbw / link rate)",
            report::human_bytes(rate as f64),
            rate as f64 / 1e9
        );
        busbw = crate::collectives::run_on_net(&net, a.nproc_per_node, &ops, &sizes, &cargs)?;
        crate::collectives::print_table(&busbw);
        let wrong: i64 = busbw.iter().map(|r| r.wrong.max(0)).sum();
        if wrong > 0 {
            anyhow::bail!("{wrong} wrong elements against the reference over the shaped links");
        }
        if let Some(r) = busbw
            .iter()
            .filter(|r| r.op == "all-reduce")
            .max_by_key(|r| r.bytes)
            .and_then(|r| r.frac_of_limit.map(|f| (r.bytes, f)))
        {
            println!(
                "check (inter-node all-reduce busbw >= 0.9 of the link rate at the largest size, {}): {:.2} -> {}",
                report::human_bytes(r.0 as f64),
                r.1,
                if r.1 >= 0.9 { "met" } else { "NOT met" }
            );
        }
    }
    drop(net);

    if let Some(svg) = &a.timeline {
        let mut events = timeline_events.ok_or_else(|| {
            anyhow::anyhow!("--timeline-prefetch {} was not among --prefetch", a.timeline_prefetch)
        })?;
        let step = a.steps.saturating_sub(2).max(2) as usize;
        align_ranks(&mut events, step);
        let title = format!(
            "stage 3, prefetch {}, {nodes} nodes x {}, step {step}: {model_desc}, link {}/s (tbf)",
            a.timeline_prefetch,
            a.nproc_per_node,
            report::human_bytes(rate as f64)
        );
        draw_timeline(svg, &title, &events, step)?;
        println!("timeline: {}", svg.display());
    }
    if let Some(p) = &a.json {
        report::write_json(
            p,
            &NetReport {
                nodes,
                nproc_per_node: a.nproc_per_node,
                model: model_desc,
                batch_size: a.batch_size,
                link_rate: rate,
                rows,
                goal,
                busbw,
            },
        )?;
    }
    Ok(())
}
