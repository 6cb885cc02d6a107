//! The device engine's step as the one walk of a step orders it ([`walk_step`], ENG-12): the
//! same forwards, loss, backwards, hand-offs to reductions, budget waits, updates and stage
//! 1/2 gathers as the host engine and `shardline plan` walk, each enqueued here as device
//! work. No step loop of its own: what this file decides is only how each use runs on the
//! streams.

use std::ops::Range;
use std::sync::Arc;

use shardline_collectives::device::DeviceBuffer;
use shardline_models::Tensor;

use super::activations::{self, Act};
use super::kernel_memory::{Figures, Footprint};
use super::memory::Reserved;
use super::offload::Offload;
use super::reduce::StepIo;
use super::{CtxOf, DeviceEngine, DeviceReduction, Kept, Slot};
use crate::engine::pass::Micro;
use crate::engine::reduction::{ReduceIo, Reduction, Reductions};
use crate::engine::walk::{HandOff, StepWork};
use crate::error::{Result, RuntimeError};
use crate::memory::Category;

/// One step on the device, as the walk drives it.
pub(super) struct DeviceStep<'e> {
    pub(super) eng: &'e mut DeviceEngine,
    /// The rank's slice until the passes end.
    pub(super) data: Option<(Tensor, Tensor)>,
    /// Each microbatch's rows of the slice (ACC-1).
    pub(super) micro: Vec<Range<usize>>,
    pub(super) global_batch: usize,
    pub(super) first_sample: usize,
    /// The step's learning rate.
    pub(super) lr: f32,
    /// Per unit, a transient gradient buffer awaiting a later call or microbatch.
    pub(super) partial: Vec<Option<Option<DeviceBuffer>>>,
    /// The microbatch in flight: its kernels' context and figures, its targets, the
    /// activation or gradient between two uses, what each call saved and its reservation.
    pub(super) mb: Option<(CtxOf, Footprint)>,
    pub(super) targets: Option<Tensor>,
    pub(super) act: Option<Act>,
    pub(super) saved: Vec<Arc<Slot<Kept>>>,
    pub(super) held: Vec<Reserved>,
}

impl DeviceStep<'_> {
    fn io(&mut self) -> StepIo<'_> {
        let clip = self.eng.cfg.clip_grad_norm;
        StepIo { eng: self.eng, lr: self.lr, clip }
    }

    fn taken<T>(v: &mut Option<T>, what: &str) -> Result<T> {
        v.take().ok_or_else(|| RuntimeError::config(format!("device step: no {what}")))
    }

    fn current(&self) -> Result<&(CtxOf, Footprint)> {
        self.mb.as_ref().ok_or_else(|| RuntimeError::config("device step: no microbatch"))
    }

    /// Starts microbatch `mb`: its rows uploaded (DACT-1), its kernels' figures (KMEM-1).
    fn begin_microbatch(&mut self, mb: Micro) -> Result<()> {
        let (x, y) = self.data.as_ref().ok_or_else(|| RuntimeError::config("step data"))?;
        let r = self.micro[mb.index].clone();
        let (xk, yk) = if mb.count == 1 {
            (x.clone(), y.clone())
        } else {
            (x.rows(r.start, r.end)?, y.rows(r.start, r.end)?)
        };
        let e = &mut *self.eng;
        let ctx = e.ctx_of(self.global_batch, self.first_sample + r.start);
        let label = format!("data (microbatch {})", mb.index);
        let buf = e.mem.alloc(Category::Activations, xk.numel(), &label)?;
        e.dev.upload(e.streams.compute, &activations::values(&xk)?, &buf)?;
        self.act = Some(Act { buf, shape: xk.shape().to_vec(), dtype: xk.dtype() });
        let nc = e.calls.len();
        // KMEM-1 probes the host kernels; ops allocate what they make (LOWDEV-1).
        let fp = if e.model_ops {
            let none = vec![Figures::default(); nc];
            Footprint { forward: none.clone(), backward: none, loss: Figures::default() }
        } else {
            e.footprint(xk.batch(), &yk, &ctx)?
        };
        self.saved = (0..nc).map(|_| Slot::new(None)).collect();
        self.held.clear();
        self.targets = Some(yk);
        self.mb = Some((ctx, fp));
        Ok(())
    }
}

impl ReduceIo<DeviceReduction> for DeviceStep<'_> {
    type Error = RuntimeError;

    fn finish(&mut self, r: Reduction<DeviceReduction>) -> Result<()> {
        self.io().finish(r)
    }

    fn update(&mut self, unit: usize) -> Result<()> {
        self.io().update(unit)
    }
}

impl StepWork for DeviceStep<'_> {
    type Op = DeviceReduction;

    fn forward(&mut self, i: usize, call: usize, mb: Micro, checkpoint: bool) -> Result<()> {
        if call == 0 {
            self.begin_microbatch(mb)?;
        }
        let input = Self::taken(&mut self.act, "activation")?;
        let (ctx, fp) = self.mb.take().ok_or_else(|| RuntimeError::config("microbatch"))?;
        let slot = Arc::clone(&self.saved[call]);
        let out = self.eng.forward(i, input, (Some(&slot), &fp.forward[call]), &ctx, checkpoint);
        self.mb = Some((ctx, fp));
        let (act, keep) = out?;
        self.act = Some(act);
        self.held.push(keep);
        Ok(())
    }

    fn loss(&mut self, mb: Micro) -> Result<()> {
        let out = Self::taken(&mut self.act, "output")?;
        let y = Self::taken(&mut self.targets, "targets")?;
        let figures = self.current()?.1.loss;
        let g = self.eng.loss_kernel(out, y, (self.global_batch, mb.index), &figures)?;
        self.act = Some(g);
        Ok(())
    }

    fn backward(
        &mut self,
        i: usize,
        call: usize,
        _: Micro,
        hand: HandOff,
        reds: &mut Reductions<DeviceReduction>,
    ) -> Result<()> {
        let g = Self::taken(&mut self.act, "output gradient")?;
        let (ctx, fp) = self.mb.take().ok_or_else(|| RuntimeError::config("microbatch"))?;
        let slot = Arc::clone(&self.saved[call]);
        let out = self.eng.backward(
            i,
            (g, &ctx),
            (&slot, &fp.backward[call]),
            hand,
            reds,
            &mut self.partial,
        );
        self.mb = Some((ctx, fp));
        self.act = out?;
        // KMEM-2: the call's saved tensors are given back once its backward is enqueued
        // (stream-ordered, as a free).
        self.held.pop();
        Ok(())
    }

    fn end_passes(&mut self) -> Result<()> {
        (self.data, self.mb, self.act) = (None, None, None);
        let (plan, mut io) = self.eng.gathers();
        plan.end_pass(&mut io);
        Ok(())
    }

    fn begin_updates(&mut self) -> Result<()> {
        self.eng.step += 1;
        Ok(())
    }

    fn loss_and_norm(&mut self) -> Result<()> {
        let e = &mut *self.eng;
        if e.cfg.clip_grad_norm.is_none() && e.offload != Offload::None {
            // The norms the host updates wrote are read on the compute stream.
            let done = e.dev.record(e.streams.offload);
            e.dev.wait(e.streams.compute, &done);
        }
        let n = e.layout.units().len();
        e.enqueue_loss_and_norm(n)
    }

    fn end_updates(&mut self) -> Result<()> {
        Ok(())
    }

    /// Stages 1 and 2: the updated parameters all-gathered in unit order, the same on every
    /// rank whatever order the updates ran in.
    fn gather_updated(&mut self) -> Result<()> {
        let e = &mut *self.eng;
        for u in 0..e.layout.units().len() {
            if let Some(done) = &e.ready[u] {
                e.dev.wait(e.streams.gather, done);
            }
            let p = e.params[u].on_device().ok_or_else(|| {
                RuntimeError::config("stages 1 and 2 keep their parameters on the device")
            })?;
            e.gather_comm.all_gather_in_place(e.streams.gather, p)?;
            e.ready[u] = Some(e.dev.record(e.streams.gather));
        }
        Ok(())
    }
}
