//! The model's calls as device ops ([`DeviceOptions::model_ops`](super::DeviceOptions)):
//! each call's lowered [`Program`] (the modules' own lowering, `shardline_models::lower`)
//! interpreted on the compute stream, so that a device which runs no host code (a GPU, or
//! the simulated device with `ops_only`) trains the model end to end: forward, loss,
//! backward, with the engine's gathers, reductions and updates already ops.
//!
//! Each value is allocated in device memory (charged as activations, DMEM-1) when an op
//! first writes it and freed, stream-ordered, after the op that uses it last; what the
//! backward reads of the forward (the program's saved values) travels to the backward in
//! the call's slot, as device buffers. A checkpointed call (RECOMP-1) keeps its input alone
//! and runs its forward ops again before its backward's.
//!
//! Invariant:
//! - LOWDEV-1: with model ops, a step enqueues no host kernel: on a simulated device that
//!   refuses all host code it trains bitwise as the cpu device running the modules' host
//!   code (`runtime/tests/on_device.rs`), at every stage, with accumulation and
//!   recomputation; every value it allocates is freed by the end of the step.

use std::collections::HashMap;
use std::sync::Arc;

use shardline_collectives::device::{DeviceBuffer, DeviceComm};
use shardline_models::lower::{Buf, Exec, LowerCtx, Program, Step};
use shardline_models::ops::Op;
use shardline_models::{DType, Tensor};

use super::activations::{self, Act};
use super::memory::Reserved;
use super::{CtxOf, DeviceEngine, DeviceReduction, Kept, Reductions, Slot};
use crate::engine::walk::HandOff;
use crate::error::{Result, RuntimeError};
use crate::memory::Category;

/// What a lowered forward leaves for its backward: its saved values (device buffers), or
/// with a checkpoint its input alone.
struct OpsSaved {
    vals: HashMap<Buf, DeviceBuffer>,
    checkpoint: bool,
}

/// Where an interpreted program's buffers are: the values made so far, the unit's
/// parameters and (in the backward) its gradients.
struct Frame<'a> {
    vals: HashMap<Buf, DeviceBuffer>,
    params: &'a DeviceBuffer,
    /// The unit's buffers (a scratch copy when a checkpointed forward runs again).
    buffers: &'a DeviceBuffer,
    grads: Option<&'a DeviceBuffer>,
}

impl DeviceEngine {
    /// The program of call `call` on an input of `shape`, lowered once per shape and mode.
    fn program(&mut self, call: usize, shape: &[usize], training: bool) -> Result<Arc<Program>> {
        let key = (call, shape.to_vec(), training);
        // SyncBatchNorm reduces over the ranks where the job syncs and has several.
        let world = if self.stats_comm.is_some() { self.world } else { 1 };
        let ctx = LowerCtx { training, sync_bn: self.cfg.sync_bn, world };
        if let Some(p) = self.programs.get(&key) {
            return Ok(Arc::clone(p));
        }
        let what = format!("call {call} ({})", self.labels[self.calls[call]]);
        let p = self
            .model
            .lower_call(call, shape, &ctx)
            .map_err(|e| RuntimeError::config(format!("--model-ops: {what}: {e}")))?;
        let unit = self.layout.unit(self.calls[call]).numel();
        let buffers = self.buffers[self.calls[call]].len();
        p.check((unit, buffers), shape.iter().product())
            .map_err(|e| RuntimeError::config(format!("{what}: {e}")))?;
        let p = Arc::new(p);
        self.programs.insert(key, Arc::clone(&p));
        Ok(p)
    }

    /// Enqueues `steps` over `f`: each value allocated when first written, and after each
    /// op the buffers it used last freed unless `keep` says otherwise.
    fn run_steps(
        &self,
        prog: &Program,
        steps: &[Step],
        f: &mut Frame<'_>,
        keep: &dyn Fn(Buf) -> bool,
    ) -> Result<()> {
        let view = |b: &DeviceBuffer, at: usize, len: usize| b.view(at..at + len);
        let last = Program::last_uses(steps, &|b| {
            keep(b) || matches!(b, Buf::Params { .. } | Buf::Grads { .. } | Buf::Buffers { .. })
        });
        for (s, done) in steps.iter().zip(last) {
            for w in &s.writes {
                if matches!(w, Buf::Fwd(_) | Buf::Bwd(_)) {
                    let len = prog.len_of(*w).unwrap_or(0);
                    let label = format!("{} output {w:?}", s.exec.label());
                    f.vals.insert(*w, self.mem.alloc(Category::Activations, len, &label)?);
                }
            }
            // The parameters' and gradients' views (DEVOP-2), then every buffer by reference.
            let all: Vec<Buf> = s.reads.iter().chain(&s.writes).copied().collect();
            let mut views = HashMap::new();
            for b in &all {
                let v = match *b {
                    Buf::Params { at, len } => view(f.params, at, len)?,
                    Buf::Buffers { at, len } => view(f.buffers, at, len)?,
                    Buf::Grads { at, len } => {
                        let g = f.grads.ok_or_else(|| RuntimeError::config("no gradients"))?;
                        view(g, at, len)?
                    }
                    _ => continue,
                };
                views.insert(*b, v);
            }
            let get = |b: &Buf| -> Result<&DeviceBuffer> {
                views.get(b).or_else(|| f.vals.get(b)).ok_or_else(|| {
                    RuntimeError::config(format!("{}: {b:?} is not on the device", s.exec.label()))
                })
            };
            let r = s.reads.iter().map(get).collect::<Result<Vec<_>>>()?;
            let w = s.writes.iter().map(get).collect::<Result<Vec<_>>>()?;
            let cs = self.streams.compute;
            match &s.exec {
                Exec::Op(op) => self.dev.launch_op(cs, op.clone().arc(), &r, &w)?,
                // SyncBatchNorm's statistics, on the compute stream as the kernel needs them.
                Exec::AllGather { .. } => self.stats_comm()?.all_gather(cs, r[0], w[0])?,
                Exec::AllReduce => {
                    self.dev.launch_op(cs, Op::Copy.arc(), &r, &w)?;
                    self.stats_comm()?.all_reduce(cs, w[0])?
                }
            }
            for b in done {
                if let Some(buf) = f.vals.remove(&b) {
                    self.mem.free(self.streams.compute, buf)?;
                }
            }
        }
        Ok(())
    }

    /// SyncBatchNorm's communicator (present where the job syncs over several ranks).
    fn stats_comm(&self) -> Result<std::sync::MutexGuard<'_, Box<dyn DeviceComm>>> {
        let g = self.stats_comm.as_ref().ok_or_else(|| {
            RuntimeError::config("a statistics collective without a statistics communicator")
        })?;
        Ok(g.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The program's constants, uploaded into `vals`.
    fn upload_consts(&self, prog: &Program, vals: &mut HashMap<Buf, DeviceBuffer>) -> Result<()> {
        for (i, c) in prog.consts.iter().enumerate() {
            let b = self.mem.alloc(Category::Activations, c.len(), "constant")?;
            self.dev.upload(self.streams.compute, c, &b)?;
            vals.insert(Buf::Const(i), b);
        }
        Ok(())
    }

    /// Frees every buffer left in `vals`.
    fn free_all(&self, vals: HashMap<Buf, DeviceBuffer>) -> Result<()> {
        for (_, b) in vals {
            self.mem.free(self.streams.compute, b)?;
        }
        Ok(())
    }

    /// [`DeviceEngine::forward`] as the call's forward ops; what the backward reads goes to
    /// `saved` (none in evaluation; the input alone with `checkpoint`).
    pub(super) fn forward_ops(
        &mut self,
        i: usize,
        input: Act,
        saved: Option<&Arc<Slot<Kept>>>,
        c: &CtxOf,
        checkpoint: bool,
    ) -> Result<(Act, Reserved)> {
        let u = self.plan.unit_at(i);
        let call = i % (2 * self.calls.len());
        let prog = self.program(call, &input.shape, c.training)?;
        let gathered = self.acquire(i)?;
        let p = match &gathered {
            Some(g) => g,
            None => self.resident(u)?,
        };
        let buffers = &self.buffers[u];
        let mut f = Frame { vals: HashMap::new(), params: p, buffers, grads: None };
        f.vals.insert(Buf::Input, input.buf);
        self.upload_consts(&prog, &mut f.vals)?;
        let kept = prog.saved();
        let out = Buf::Fwd(prog.output.0);
        let keep = |b: Buf| match (saved.is_some(), checkpoint) {
            _ if b == out => true,
            (true, false) => kept.contains(&b),
            (true, true) => b == Buf::Input,
            (false, _) => false,
        };
        self.run_steps(&prog, &prog.forward, &mut f, &keep)?;
        let output = f.vals.remove(&out).ok_or_else(|| RuntimeError::config("no output"))?;
        let (keep_vals, free): (HashMap<_, _>, HashMap<_, _>) =
            f.vals.into_iter().partition(|(b, _)| keep(*b));
        self.free_all(free)?;
        match saved {
            Some(slot) => slot.put(Kept::State(Box::new(OpsSaved { vals: keep_vals, checkpoint }))),
            None => self.free_all(keep_vals)?,
        }
        self.done_with(i, gathered);
        let none = self.mem.reserve(Category::Activations, 0, "model ops")?;
        Ok((Act { buf: output, shape: prog.output.1.clone(), dtype: DType::F32 }, none))
    }

    /// [`DeviceEngine::backward`] as the call's backward ops (a checkpointed call's forward
    /// ops first).
    pub(super) fn backward_ops(
        &mut self,
        i: usize,
        (grad_out, c): (Act, &CtxOf),
        saved: &Arc<Slot<Kept>>,
        hand: HandOff,
        reds: &mut Reductions<DeviceReduction>,
        partial: &mut [Option<Option<DeviceBuffer>>],
    ) -> Result<Option<Act>> {
        let u = self.plan.unit_at(i);
        let nc = self.calls.len();
        let call = 2 * nc - 1 - i % (2 * nc);
        let input_shape = self.probed()?.input(call, grad_out.shape[0]).0;
        let prog = self.program(call, &input_shape, c.training)?;
        let what = format!("backward {}", self.labels[u]);
        let Kept::State(s) = saved.take(&what)? else {
            return Err(RuntimeError::config(format!("{what}: a host call's saved state")));
        };
        let s = s
            .downcast::<OpsSaved>()
            .map_err(|_| RuntimeError::config(format!("{what}: another call's saved state")))?;
        let gathered = self.acquire(i)?;
        let (first_use, transient) = match partial[u].take() {
            Some(t) => (false, t),
            None if self.rules.transient_grads() => {
                let padded = self.layout.unit(u).padded_numel();
                let label = format!("{} grads (unreduced)", self.labels[u]);
                (true, Some(self.mem.alloc(Category::Grads, padded, &label)?))
            }
            None => (true, None),
        };
        let p = match &gathered {
            Some(g) => g,
            None => self.resident(u)?,
        };
        let g = transient.as_ref().unwrap_or(&self.grads[u]);
        // RECOMP-1: a checkpointed forward runs again on a scratch copy of the buffers (the
        // first run updated the running statistics).
        let scratch = match s.checkpoint && !self.buffers[u].is_empty() {
            true => {
                let what = "buffers (recomputed forward)";
                let b = self.mem.alloc(Category::Activations, self.buffers[u].len(), what)?;
                let cs = self.streams.compute;
                self.dev.launch_op(cs, Op::Copy.arc(), &[&self.buffers[u]], &[&b])?;
                Some(b)
            }
            false => None,
        };
        let buffers = scratch.as_ref().unwrap_or(&self.buffers[u]);
        let mut f = Frame { vals: s.vals, params: p, buffers, grads: Some(g) };
        if s.checkpoint {
            // The forward again, keeping what the backward reads.
            self.upload_consts(&prog, &mut f.vals)?;
            let kept = prog.saved();
            self.run_steps(&prog, &prog.forward, &mut f, &|b| kept.contains(&b))?;
            if let Some(o) = f.vals.remove(&Buf::Fwd(prog.output.0)) {
                self.mem.free(self.streams.compute, o)?;
            }
        }
        // NET-1: the unit's first backward call writes its gradients (the padding too).
        if first_use {
            self.dev.launch_op(self.streams.compute, Op::Fill { value: 0.0 }.arc(), &[], &[g])?;
        }
        f.vals.insert(Buf::GradOut, grad_out.buf);
        let ig = prog.input_grad.map(Buf::Bwd);
        self.run_steps(&prog, &prog.backward, &mut f, &|b| Some(b) == ig)?;
        let input_grad = match (call > 0, ig) {
            (true, Some(b)) => {
                let buf = f.vals.remove(&b).ok_or_else(|| RuntimeError::config("no dx"))?;
                Some(Act { buf, shape: input_shape, dtype: DType::F32 })
            }
            (false, _) => None,
            (true, None) => {
                return Err(RuntimeError::config(format!("{what}: no input gradient lowered")))
            }
        };
        self.free_all(f.vals)?;
        if let Some(b) = scratch {
            self.mem.free(self.streams.compute, b)?;
        }
        if hand.reduce {
            self.issue_reduction(reds, u, transient, hand.add)?;
        } else {
            partial[u] = Some(transient);
        }
        self.done_with(i, gathered);
        Ok(input_grad)
    }

    /// [`DeviceEngine::loss_kernel`] as the loss's op ([`shardline_models::Loss::lower`]);
    /// the microbatches' shares are added on the device (ACC-1).
    pub(super) fn loss_ops(
        &mut self,
        out: Act,
        y: Tensor,
        (global_batch, micro): (usize, usize),
    ) -> Result<Act> {
        let op = self
            .model
            .loss()
            .lower(&out.shape, global_batch)
            .map_err(|e| RuntimeError::config(format!("--model-ops: the loss: {e}")))?;
        let label = format!("targets (microbatch {micro})");
        let targets = self.mem.alloc(Category::Activations, y.numel(), &label)?;
        self.dev.upload(self.streams.compute, &activations::values(&y)?, &targets)?;
        let grad = self.mem.alloc(Category::Activations, out.buf.len(), "loss gradient")?;
        let share = self.mem.alloc(Category::Activations, 1, "loss share")?;
        let cs = self.streams.compute;
        self.dev.launch_op(cs, op.arc(), &[&out.buf, &targets], &[&share, &grad])?;
        let add = if micro == 0 { Op::Copy } else { Op::Axpy { alpha: 1.0 } };
        self.dev.launch_op(cs, add.arc(), &[&share], &[&self.loss])?;
        for b in [out.buf, targets, share] {
            self.mem.free(cs, b)?;
        }
        Ok(Act { buf: grad, shape: out.shape, dtype: DType::F32 })
    }
}
