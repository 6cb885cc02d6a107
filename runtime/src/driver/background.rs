//! Asynchronous checkpoints (`--async-checkpoint`, as torch DCP's `async_save`): at the step
//! boundary every rank copies what a checkpoint holds (its shard of the parameters and of the
//! optimizer state, and the replicated buffers; the manifest fields, step and loader
//! position included, are fixed then too), and a thread of this process writes the shards
//! and commits them with the same protocol as a synchronous save (CKPT-1, LAUNCH-4) while
//! the step loop goes on.
//!
//! Invariants:
//! - DRIVE-4: an asynchronous checkpoint of step N holds exactly the state after step N,
//!   whatever the steps run while it is written do to the ranks' state: a run resumed from
//!   it is bitwise the run resumed from the synchronous checkpoint of step N.
//! - DRIVE-5: at most one checkpoint is in flight: the next save waits for the previous one
//!   to commit, and the run returns (its summary or its stop) only after the last one
//!   committed. A background save that fails fails the run at the first step boundary
//!   after it ended, or at the wait.
//! - DRIVE-6: a crash while a checkpoint is written in the background leaves the previous
//!   committed checkpoint the newest one (the manifest is written only after every rank's
//!   shard is durable, CKPT-1), and a resumed run starts from it.

use crate::actors::RankSnapshot;
use crate::checkpoint::{FileEntry, PendingCheckpoint};
use crate::error::{Result, RuntimeError};
use crate::fault::{FaultHook, Phase};
use serde::Serialize;
use std::any::Any;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Called on the writing thread before a rank's shard of an asynchronous checkpoint is
/// written, with the rank and the step: tests slow the writer with it (DRIVE-4).
#[derive(Clone)]
pub struct ShardWriteHook(pub Arc<dyn Fn(usize, u64) + Send + Sync>);

impl std::fmt::Debug for ShardWriteHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShardWriteHook")
    }
}

/// What a background shard write calls besides writing.
#[derive(Clone, Default)]
pub struct WriteHooks {
    /// Before the write ([`crate::train::RunOptions::before_shard_write`]).
    pub before: Option<ShardWriteHook>,
    /// Once the shard is durable: an injected fault's point ([`Phase::Checkpoint`]).
    pub written: Option<FaultHook>,
}

impl WriteHooks {
    /// Writes `snap`'s shard into `pending`, calling the hooks around it.
    pub fn write(&self, pending: &PendingCheckpoint, snap: &RankSnapshot) -> Result<FileEntry> {
        if let Some(h) = &self.before {
            (h.0)(snap.rank, snap.step);
        }
        let entry = pending.write_shard(snap.rank, &snap.shard)?;
        if let Some(h) = &self.written {
            h(snap.rank, snap.step, Phase::Checkpoint);
        }
        Ok(entry)
    }
}

/// A checkpoint being written and committed by a thread of its own.
pub struct BackgroundSave {
    step: u64,
    thread: JoinHandle<Result<()>>,
    /// Whether a failing run waits for it: in one process, so that a restart never meets
    /// a commit still under way; launched, the process ends and its barriers fail with the
    /// aborted communicator, so nothing waits for them.
    join_on_failure: bool,
}

impl BackgroundSave {
    /// Runs `save` (write the shards, commit) on a thread named after `step`.
    pub fn start(
        step: u64,
        join_on_failure: bool,
        save: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Result<Self> {
        let thread = std::thread::Builder::new()
            .name(format!("checkpoint-{step}"))
            .spawn(save)
            .map_err(|e| RuntimeError::config(format!("checkpoint thread of step {step}: {e}")))?;
        Ok(BackgroundSave { step, thread, join_on_failure })
    }

    /// The step being saved.
    pub fn step(&self) -> u64 {
        self.step
    }

    fn finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Waits for the commit; a writer that panicked (an injected kill of a rank in one
    /// process) is an error naming the step.
    fn wait(self) -> Result<()> {
        let step = self.step;
        self.thread.join().unwrap_or_else(|p| {
            Err(RuntimeError::Failed(format!(
                "checkpoint of step {step} failed: its writer died: {}",
                panic_text(&*p)
            )))
        })
    }
}

/// The error of a rank whose shard writer panicked (an injected kill in one process).
pub(crate) fn died_writing(snap: &RankSnapshot, panic: &(dyn Any + Send)) -> RuntimeError {
    RuntimeError::Failed(format!(
        "rank {} died writing its shard of the checkpoint of step {}: {}",
        snap.rank,
        snap.step,
        panic_text(panic)
    ))
}

fn panic_text(p: &(dyn Any + Send)) -> &str {
    p.downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| p.downcast_ref::<&str>().copied())
        .unwrap_or("panic")
}

/// How long the step loop stood still for one checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CheckpointStall {
    /// The step saved.
    pub step: u64,
    /// At the step boundary: the whole save when synchronous; the snapshot and the hand-off
    /// to the writer when asynchronous.
    pub boundary_s: f64,
    /// Later, waiting for the asynchronous write to commit (at the next save or the run's
    /// end); 0 when synchronous.
    pub waited_s: f64,
}

impl CheckpointStall {
    /// All the time the loop stood still for it.
    pub fn blocked_s(&self) -> f64 {
        self.boundary_s + self.waited_s
    }
}

/// The loop's checkpoints: the one in flight (DRIVE-5) and what each cost the loop.
#[derive(Default)]
pub struct Saves {
    in_flight: Option<BackgroundSave>,
    stalls: Vec<CheckpointStall>,
}

impl Saves {
    /// A synchronous save of `step` that held the loop for `blocked`.
    pub fn done_in_place(&mut self, step: u64, blocked: Duration) {
        let s = blocked.as_secs_f64();
        self.stalls.push(CheckpointStall { step, boundary_s: s, waited_s: 0.0 });
    }

    /// A save now in flight, whose start held the loop for `blocked`. The previous one
    /// must have been waited for.
    pub fn started(&mut self, save: BackgroundSave, blocked: Duration) {
        assert!(self.in_flight.is_none(), "DRIVE-5: one checkpoint in flight at a time");
        let step = save.step();
        self.stalls.push(CheckpointStall {
            step,
            boundary_s: blocked.as_secs_f64(),
            waited_s: 0.0,
        });
        self.in_flight = Some(save);
    }

    /// At a step boundary: collects the save in flight if it has ended, so that its failure
    /// fails the run now; never waits.
    pub fn poll(&mut self) -> Result<()> {
        if self.in_flight.as_ref().is_some_and(BackgroundSave::finished) {
            return self.wait();
        }
        Ok(())
    }

    /// Waits for the save in flight, if any, charging the wait to it.
    pub fn wait(&mut self) -> Result<()> {
        let Some(save) = self.in_flight.take() else { return Ok(()) };
        let (t, step) = (Instant::now(), save.step());
        let r = save.wait();
        if let Some(s) = self.stalls.iter_mut().rev().find(|s| s.step == step) {
            s.waited_s += t.elapsed().as_secs_f64();
        }
        r
    }

    /// The run failed: waits for the save in flight where it must (see
    /// [`BackgroundSave::start`]); its own result no longer matters.
    pub fn abandon(&mut self) {
        if let Some(save) = self.in_flight.take() {
            if save.join_on_failure {
                let _ = save.wait();
            }
        }
    }

    /// What each checkpoint cost the loop, in step order.
    pub fn stalls(&self) -> &[CheckpointStall] {
        &self.stalls
    }
}
