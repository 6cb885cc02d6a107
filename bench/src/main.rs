//! `shardline-bench`: Shardline's benchmarks. Each prints a table for people, writes JSON
//! (`--json FILE`) for machines and SVG plots (`--plot FILE.svg`), and quotes its figures as
//! ratios against the machine's limits or peers measured in the same run.

use clap::{Parser, Subcommand};

mod alloc;
mod campaign;
mod ckpt_stall;
mod collectives;
mod faults;
mod faults_live;
mod limits;
mod link_bytes;
mod machine_profile;
mod measured;
mod memory;
mod overlap;
mod precision;
mod quant_error;
mod report;
mod syncbn;

/// Large buffers come from a shared-memory arena, so that shm peers read them in place
/// (`shardline_collectives::arena`); every allocation is counted (`memory-measured`).
#[global_allocator]
static ALLOC: alloc::Counting<shardline_collectives::arena::SharedArena> =
    alloc::Counting(shardline_collectives::arena::SharedArena);

/// Builds the namespace nodes of `--nodes`; without root the error says what `--nodes` needs
/// and how to do without it, otherwise it is the net's own (a bad node count, a missing `tc`).
fn build_net(nodes: usize, rate: Option<u64>) -> anyhow::Result<shardline_tests::netns::Net> {
    use anyhow::Context;
    let net = shardline_tests::netns::Net::new("b", nodes, rate);
    if shardline_tests::netns::is_root() {
        return Ok(net?);
    }
    net.context(
        "--nodes builds one network namespace per node (ip netns, veth, bridge, tc) and needs \
         root: run it as root, or leave out --nodes for the one-process benchmark",
    )
}

/// Shardline benchmarks.
#[derive(Parser, Debug)]
#[command(name = "shardline-bench", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// nccl-tests-style collectives table: time, algbw, busbw, #wrong per op and size.
    ///
    /// Example: shardline-bench collectives --transport local,shm,tcp --world 2,4 --json c.json --plot c.svg
    Collectives(collectives::Args),
    /// The small-batch experiment: per-rank BN vs SyncBN vs one rank holding the whole batch,
    /// mean test accuracy over seeds with its standard error, and SyncBN's step-time overhead.
    ///
    /// Example: shardline-bench syncbn --world 8 --per-rank 2 --json syncbn.json
    ///
    /// Example: shardline-bench syncbn --model resnet-bn --dataset idx:models/data/fashion-mnist --width 8 --steps 500 --seeds 5 --study-only
    Syncbn(syncbn::Args),
    /// Per-rank memory peak vs theoretical model state, per ZeRO stage and world; a model
    /// that fails at stage 0 under a cap and trains at stage 3.
    ///
    /// Example: shardline-bench memory --world 1,2,4 --params 2M --json memory.json
    Memory(memory::Args),
    /// The peak the runtime accounts against the peak a counting allocator measures, per
    /// rank (one process each), for each model, world size and ZeRO stage.
    ///
    /// Example: shardline-bench memory-measured --models mlp-bn,gpt --world 1,2 --json mem.json
    MemoryMeasured(measured::Args),
    /// One rank of `memory-measured` (started by it, in a torchrun-style environment).
    #[command(hide = true)]
    MemoryRank(measured::RankArgs),
    /// Stage 3 overlap: compute, communication, step and exposed communication time per
    /// prefetch depth under a per-link bandwidth limit; SVG timeline of one step per rank.
    ///
    /// Example: shardline-bench overlap --world 2 --json overlap.json --timeline overlap.svg
    Overlap(overlap::Args),
    /// Mixed precision: loss curves of bf16 against f32 over several seeds (is bf16 within
    /// f32's seed-to-seed spread?), bytes sent per step, conversion and step time.
    ///
    /// Example: shardline-bench precision --models mlp-bn,gpt --steps 200 --json p.json
    Precision(precision::Args),
    /// Per parameter tensor of gpt, the error a quantized gather (--gather-dtype int8|fp8)
    /// makes, at initialisation and after f32 training.
    ///
    /// Example: shardline-bench quant-error --steps 300 --world 2 --json q.json
    QuantError(quant_error::Args),
    /// How long the step loop stands still per checkpoint, synchronous against
    /// `--async-checkpoint`, the same job both ways in alternating rounds.
    ///
    /// Example: shardline-bench ckpt-stall --model wide-mlp --params 8000000 --rounds 3 --json stall.json
    CkptStall(ckpt_stall::Args),
    /// Randomised, seeded fault campaign over short supervised runs: detection, hangs, torn
    /// checkpoints, runs equal to the clean run, detection and recovery times. With --live,
    /// over launched jobs on namespace nodes, each fault with and without --live-recovery:
    /// hangs, lost data, steps run again, recovery times, final checkpoints equal to the
    /// clean run's.
    ///
    /// Example: shardline-bench faults --trials 100 --json faults.json
    ///
    /// Example: shardline-bench faults --live --trials 100 --json live.json --logs live-logs
    Faults(faults::Args),
    /// One trial of the fault campaign (started by `faults`).
    #[command(hide = true)]
    FaultsTrial(faults::TrialArgs),
    /// The machine profile of `shardline plan --profile`: collectives rows from
    /// `collectives --json` files, square GEMM probes, the products of `shardline plan
    /// --json` files each at its own shape (--products), fresh allocations by size, the
    /// memory bandwidth, the GELU and the optimizers' update (no training step).
    ///
    /// Example: shardline-bench machine-profile --collectives c.json,ag.json --out profile.json
    MachineProfile(machine_profile::Args),
    /// One rank of a multi-process collectives run (started by `collectives`).
    #[command(hide = true)]
    CollectivesWorker(collectives::WorkerArgs),
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    // Warnings of the collectives reach stderr (`SHARDLINE_LOG` as for `shardline`). The
    // benchmarks choose the configurations the trainer warns about (per-rank BatchNorm is
    // what `syncbn` compares against) and the fault campaign injects failures on purpose, so
    // those log errors only.
    let quiet = matches!(cli.cmd, Cmd::Faults(_) | Cmd::FaultsTrial(_));
    let default = if quiet { "error" } else { "warn,shardline_runtime::train=error" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHARDLINE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let res = match cli.cmd {
        Cmd::Collectives(a) => collectives::run(a),
        Cmd::MachineProfile(a) => machine_profile::run(a),
        Cmd::CollectivesWorker(a) => collectives::worker(a),
        Cmd::Syncbn(a) => syncbn::run(a),
        Cmd::Faults(a) => faults::run(a),
        Cmd::FaultsTrial(a) => faults::trial(a),
        Cmd::Memory(a) => memory::run(a),
        Cmd::MemoryMeasured(a) => measured::run(a),
        Cmd::MemoryRank(a) => measured::rank(a),
        Cmd::Overlap(a) => overlap::run(a),
        Cmd::Precision(a) => precision::run(a),
        Cmd::QuantError(a) => quant_error::run(a),
        Cmd::CkptStall(a) => ckpt_stall::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        let usage = e.downcast_ref::<report::Usage>().is_some();
        std::process::exit(if usage { 2 } else { 1 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overlap(args: &[&str]) -> overlap::Args {
        let argv = ["shardline-bench", "overlap"].iter().chain(args);
        match Cli::try_parse_from(argv).expect("flags parse").cmd {
            Cmd::Overlap(a) => a,
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn overlap_busbw_sizes_default_list_and_skip() {
        assert_eq!(overlap(&[]).busbw_sizes, vec![1 << 20, 16 << 20, 64 << 20]);
        assert_eq!(overlap(&["--busbw-sizes", "4K,2M"]).busbw_sizes, vec![4096, 2 << 20]);
        assert!(overlap(&["--busbw-sizes"]).busbw_sizes.is_empty());
        assert!(Cli::try_parse_from(["shardline-bench", "overlap", "--busbw-sizes", "x"]).is_err());
    }
}
