//! Helpers shared by the runtime's integration tests.
#![allow(dead_code)]

use shardline_runtime::shard::Stage;
use shardline_runtime::train::{self, RunOptions, StageChoice, Summary, SyncBnMode, TrainConfig};
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Every run in these tests ends well within this; a hang fails the test instead.
pub const RUN_DEADLINE: Duration = Duration::from_secs(120);

/// A small mlp-bn on digits: two hidden blocks of 32, SGD with momentum, SyncBN on.
pub fn small_cfg(world: usize, stage: u8, steps: u64, batch: usize) -> TrainConfig {
    TrainConfig {
        world,
        stage: StageChoice::Fixed(Stage::from_index(stage).expect("stage 0..3")),
        model: "mlp-bn".into(),
        dataset: "digits".into(),
        steps: Some(steps),
        batch_size: batch,
        lr: 0.05,
        hidden: Some(32),
        depth: Some(2),
        sync_bn: SyncBnMode::On,
        prefetch: 1,
        seed: 7,
        timeout_s: 30,
        ..TrainConfig::default()
    }
}

/// Options for a quiet run with no outputs.
pub fn quiet() -> RunOptions {
    RunOptions { quiet: true, progress: false, ..RunOptions::default() }
}

/// `train::run` on its own thread with a deadline.
pub fn run_with_deadline(cfg: TrainConfig, opts: RunOptions) -> shardline_runtime::Result<Summary> {
    let (tx, rx) = mpsc::channel();
    let what = format!("world {} stage {:?} model {}", cfg.world, cfg.stage, cfg.model);
    std::thread::spawn(move || {
        let _ = tx.send(train::run(cfg, opts));
    });
    match rx.recv_timeout(RUN_DEADLINE) {
        Ok(r) => r,
        Err(e) => panic!("training run ({what}) did not finish within {RUN_DEADLINE:?}: {e}"),
    }
}

/// Whether a run gathered its final parameters (`RunOptions::skip_final_params` unset).
pub fn has_final_params(s: &Summary) -> bool {
    !s.final_params.is_empty() && s.final_params.iter().all(|u| !u.is_empty())
}

/// `run_with_deadline`, expecting success.
pub fn run_ok(cfg: TrainConfig, opts: RunOptions) -> Summary {
    let what = format!("world {} stage {:?}", cfg.world, cfg.stage);
    run_with_deadline(cfg, opts).unwrap_or_else(|e| panic!("run ({what}) failed: {e}"))
}

/// Largest absolute elementwise difference between two per-unit parameter lists.
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    // An empty list (a run that skipped gathering its final parameters) would compare
    // equal to anything.
    assert!(!a.is_empty() && !b.is_empty(), "no parameters to compare");
    assert_eq!(a.len(), b.len(), "unit count");
    let mut m = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len(), "unit length");
        for (p, q) in x.iter().zip(y) {
            m = m.max((p - q).abs());
        }
    }
    m
}

/// Bitwise equality of per-unit f32 lists (NaN-safe, -0.0 != 0.0).
pub fn bits_eq(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    assert!(!a.is_empty() && !b.is_empty(), "no parameters to compare");
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// Bitwise equality of two loss curves.
pub fn losses_bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

/// Every process these tests start is killed after this.
pub const PROCESS_DEADLINE: Duration = Duration::from_secs(60);

/// What a `shardline` process left: its exit code and output.
pub struct Out {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `shardline ARGS` with a deadline; kills it and fails the test if it overruns.
pub fn shardline(args: &[&str]) -> Out {
    let mut child = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start shardline");
    let mut so = child.stdout.take().expect("stdout pipe");
    let mut se = child.stderr.take().expect("stderr pipe");
    let ro = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let re = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for shardline") {
            break st;
        }
        if t0.elapsed() > PROCESS_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("shardline {args:?} did not exit within {PROCESS_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Out {
        code: status.code(),
        stdout: ro.join().unwrap_or_default(),
        stderr: re.join().unwrap_or_default(),
    }
}

/// The largest relative difference between two loss curves of the same length.
pub fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "loss curve length");
    a.iter().zip(b).map(|(x, y)| ((x - y) / y).abs()).fold(0.0, f32::max)
}

/// A narrow gpt (2 blocks, 2 heads, width 16, context 16) with SGD on the bundled text.
pub fn gpt_cfg(world: usize, stage: u8, batch: usize) -> TrainConfig {
    TrainConfig {
        model: "gpt".into(),
        dataset: "text".into(),
        n_layer: Some(2),
        n_head: Some(2),
        n_embd: Some(16),
        block_size: Some(16),
        optimizer: "sgd".into(),
        lr: 0.3,
        cosine: false,
        sync_bn: SyncBnMode::Auto,
        ..small_cfg(world, stage, 5, batch)
    }
}

/// Waits for a child up to the deadline; kills it past that, so the test fails, not hangs.
pub fn finish(mut c: std::process::Child, deadline: Instant) -> std::process::Output {
    loop {
        if c.try_wait().expect("waiting").is_some() {
            return c.wait_with_output().expect("output");
        }
        if Instant::now() >= deadline {
            let _ = c.kill();
            let out = c.wait_with_output().expect("output");
            panic!("agent hung:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A port free on loopback now (for a test's rendezvous store).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The number of lines in `path` (0 while it does not exist).
pub fn line_count(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |s| s.lines().count())
}

/// Waits until the run's `--log-json` file `log` holds `steps` lines, then sends the child
/// SIGINT and waits for it to end. Fails the test if the run ends before the signal or
/// overruns a deadline (PROCESS_DEADLINE for the steps, twice that in all).
pub fn interrupt_after_steps(
    child: &mut std::process::Child,
    log: &std::path::Path,
    steps: usize,
) -> std::process::ExitStatus {
    let t0 = Instant::now();
    while line_count(log) < steps {
        assert!(t0.elapsed() < PROCESS_DEADLINE, "no {steps} steps logged in time");
        assert!(child.try_wait().expect("poll").is_none(), "run ended before the signal");
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("send SIGINT");
    loop {
        if let Some(st) = child.try_wait().expect("poll") {
            return st;
        }
        if t0.elapsed() > 2 * PROCESS_DEADLINE {
            let _ = child.kill();
            panic!("the run did not stop after SIGINT");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
