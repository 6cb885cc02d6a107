//! `shardline-bench machine-profile`: the machine profile `shardline plan --profile` reads,
//! from microbenchmarks only: the rows of one or more `shardline-bench collectives --json`
//! files, a GEMM probe of the CPU backend on one thread at a few square sizes, and the
//! single-thread memory bandwidth (`limits::measure_mem`). Nothing here runs a training
//! step.

use anyhow::Context;
use serde::Deserialize;
use shardline_models::{gemm_gflops, Cpu};
use shardline_runtime::plan::profile::{CollectiveRow, GemmRow, Profile};
use std::path::PathBuf;

/// Options of `shardline-bench machine-profile`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// `shardline-bench collectives --json` files to read the collectives from (rows run in
    /// place are kept for all-gathers, which the engine runs in place; rows not in place for
    /// the other ops).
    #[arg(long, value_delimiter = ',', required = true)]
    pub collectives: Vec<PathBuf>,
    /// Square GEMM sizes to probe.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128,256,512")]
    pub gemm: Vec<usize>,
    /// Timed repetitions per GEMM size (the best is kept).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Where to write the profile.
    #[arg(long)]
    pub out: PathBuf,
}

/// The part of a collectives row the profile needs.
#[derive(Deserialize)]
struct Row {
    op: String,
    world: usize,
    transport: String,
    bytes: u64,
    time_us: f64,
    #[serde(default)]
    in_place: bool,
}

#[derive(Deserialize)]
struct File {
    rows: Vec<Row>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut collectives = Vec::new();
    for path in &a.collectives {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let f: File = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a collectives --json file", path.display()))?;
        // The engine gathers in place and reduce-scatters into a separate shard.
        let keep = |r: &Row| (r.op == "all-gather") == r.in_place;
        collectives.extend(f.rows.into_iter().filter(keep).map(|r| CollectiveRow {
            op: r.op,
            world: r.world,
            transport: r.transport,
            bytes: r.bytes,
            time_us: r.time_us,
        }));
    }
    anyhow::ensure!(!collectives.is_empty(), "no usable collectives rows in --collectives");
    let be = Cpu::new();
    let mut gemm = Vec::new();
    for &s in &a.gemm {
        let gflops = gemm_gflops(&be, s, s, s, a.reps)?;
        println!("gemm {s}x{s}x{s}: {gflops:.2} GFLOP/s");
        gemm.push(GemmRow { m: s, n: s, k: s, gflops });
    }
    let mem = crate::limits::measure_mem();
    println!("memory: {:.2} GB/s (one thread, read + write)", mem.memcpy_1t_gbps);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let p = Profile {
        note: format!(
            "shardline-bench machine-profile: {} collectives rows from {}; gemm probe sizes {:?}; {cores} cores",
            collectives.len(),
            a.collectives.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
            a.gemm
        ),
        cores,
        memory_gbps: mem.memcpy_1t_gbps,
        gemm,
        collectives,
    };
    std::fs::write(&a.out, serde_json::to_string_pretty(&p)?)
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!("wrote {}", a.out.display());
    Ok(())
}
