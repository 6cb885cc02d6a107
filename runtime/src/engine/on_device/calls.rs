//! Enqueuing a call's kernels on the compute stream: a forward, the loss, a backward. Each
//! allocates its outputs in device memory, reserves what its kernel makes (KMEM-2),
//! launches the kernel body of `kernels` measured (KMEM-3), and frees its inputs
//! stream-ordered; a forward hands what it saves to its backward through a [`Slot`].

use std::sync::Arc;

use shardline_collectives::device::{DeviceBuffer, DeviceError};
use shardline_models::{DType, Tensor};

use super::activations::{self, Act};
use super::kernel_memory::{run_measured, Figures, Footprint, ProbeJob};
use super::memory::Reserved;
use super::{kernels, CtxOf, DeviceEngine, Reductions, Slot};
use super::{DeviceReduction, Kept};
use crate::engine::walk::HandOff;
use crate::error::Result;
use crate::memory::Category;

impl DeviceEngine {
    /// Use `i`'s forward kernel: reads its input from device memory and writes its output
    /// there (returned; the input is freed once read); what its layers save goes to `saved`,
    /// and its bytes stay reserved on the device (returned, KMEM-2) until its backward is
    /// enqueued. With `checkpoint` (RECOMP-1, as the walk decides) the call keeps its input
    /// and the statistics it received.
    pub(super) fn forward(
        &mut self,
        i: usize,
        input: Act,
        (saved, figures): (Option<&Arc<Slot<Kept>>>, &Figures),
        c: &CtxOf,
        checkpoint: bool,
    ) -> Result<(Act, Reserved)> {
        if self.model_ops {
            return self.forward_ops(i, input, saved, c, checkpoint);
        }
        let u = self.plan.unit_at(i);
        // Use `i` of the step: the microbatch's forward runs calls 0..nc (ACC-1).
        let nc = self.calls.len();
        let call = i % (2 * nc);
        let gathered = self.acquire(i)?;
        let numel = self.layout.unit(u).numel();
        let what = format!("forward {}", self.labels[u]);
        let (shape, dtype) = self.probed()?.output(call, input.shape[0]);
        let label = format!("{what} (output)");
        let out = self.mem.alloc(Category::Activations, shape.iter().product(), &label)?;
        // KMEM-2: what the kernel keeps, and what it makes while it runs.
        let (reserved, keep, running) = self.reserve_for(&what, figures)?;
        let k = kernels::Call {
            model: Arc::clone(&self.model),
            call,
            rank: self.rank,
            name: what.clone(),
        };
        let (saved, c, place) = (saved.cloned(), c.clone(), self.placement());
        let (in_shape, in_dtype) = (input.shape.clone(), input.dtype);
        let p = match &gathered {
            Some(g) => g,
            None => self.resident(u)?,
        };
        self.dev.launch_fallible(
            self.streams.compute,
            &what,
            &[p, &input.buf],
            &[&self.buffers[u], &out],
            Box::new(move |r, w| {
                let [buffers, out] = w else { unreachable!("two written buffers") };
                let (kept, made) = run_measured(place, || {
                    let x = (r[1], &in_shape[..], in_dtype);
                    let kept = k.forward(&r[0][..numel], buffers, x, out, &c, checkpoint)?;
                    // Evaluation keeps nothing: dropped here, inside the kernel.
                    Ok::<_, DeviceError>(saved.as_ref().map(|_| kept))
                });
                if let (Some(slot), Some(kept)) = (&saved, kept?) {
                    slot.put(kept);
                }
                made.check(&reserved, &k.name) // KMEM-3
            }),
        )?;
        drop(running);
        self.mem.free(self.streams.compute, input.buf)?;
        self.done_with(i, gathered);
        Ok((Act { buf: out, shape, dtype }, keep))
    }

    /// Where this rank's kernels compute (TENSOR-4).
    pub(super) fn placement(&self) -> shardline_models::Placement {
        shardline_models::Placement::Device(self.dev.id())
    }

    /// KMEM-2: reserves a kernel's figures when it is enqueued: its saved bytes (kept by the
    /// caller until the backward is enqueued) and the rest of its peak (dropped by the
    /// caller right after the enqueue). Returns what the kernel may make: the figures with
    /// the workspace's scratch.
    pub(super) fn reserve_for(
        &self,
        what: &str,
        f: &Figures,
    ) -> Result<(Figures, Reserved, Reserved)> {
        let acts = Category::Activations;
        let saved = if self.bug.under_reserve { f.saved.saturating_sub(4) } else { f.saved };
        let keep = self.mem.reserve(acts, saved, &format!("{what} (saved for backward)"))?;
        let rest = f.peak.saturating_sub(f.saved);
        let running = self.mem.reserve(acts, rest, &format!("{what} (tensors while it runs)"))?;
        let scratch = self.workspace.as_ref().map_or(0, |w| w.0);
        Ok((Figures { saved, scratch, ..*f }, keep, running))
    }

    /// The kernels' figures for microbatches of `batch` samples, in `ctx`'s mode, probed
    /// the first time that size comes (KMEM-1); the scratch workspace grows to what they
    /// need (KMEM-2).
    pub(super) fn footprint(
        &mut self,
        batch: usize,
        targets: &Tensor,
        ctx: &CtxOf,
    ) -> Result<Footprint> {
        let key = (batch, ctx.training);
        if !self.footprints.contains_key(&key) {
            let job = ProbeJob {
                model: &self.model,
                shapes: self.probed()?,
                targets,
                recompute: self.cfg.recompute,
                seed: self.cfg.seed,
                device: self.placement(),
                ctx: CtxOf { stats: None, ..ctx.clone() },
            };
            let fp = Footprint::probe(&job, batch)?;
            let need = fp.scratch();
            if self.workspace.as_ref().is_none_or(|w| w.0 < need) {
                self.workspace = None;
                let r = self.mem.reserve(Category::Scratch, need, "kernels' scratch workspace")?;
                self.workspace = Some((need, r));
            }
            self.footprints.insert(key, fp);
        }
        Ok(self.footprints[&key].clone())
    }

    /// The loss kernel: the rank's share of the loss into `self.loss`, and the gradient of
    /// the output (returned, in device memory; the output and the targets, uploaded, are
    /// freed once read).
    pub(super) fn loss_kernel(
        &mut self,
        out: Act,
        y: Tensor,
        (global_batch, micro): (usize, usize),
        figures: &Figures,
    ) -> Result<Act> {
        if self.model_ops {
            return self.loss_ops(out, y, (global_batch, micro));
        }
        // TENSOR-4: the kernel reads the targets from device memory, as it reads the data.
        let label = format!("targets (microbatch {micro})");
        let targets = self.mem.alloc(Category::Activations, y.numel(), &label)?;
        self.dev.upload(self.streams.compute, &activations::values(&y)?, &targets)?;
        let (y_shape, y_dtype) = (y.shape().to_vec(), y.dtype());
        drop(y);
        let grad = self.mem.alloc(Category::Activations, out.buf.len(), "loss gradient")?;
        let (reserved, keep, running) = self.reserve_for("loss", figures)?;
        let (model, rank, place) = (Arc::clone(&self.model), self.rank, self.placement());
        let (shape, dtype) = (out.shape.clone(), out.dtype);
        self.dev.launch_fallible(
            self.streams.compute,
            "loss",
            &[&out.buf, &targets],
            &[&self.loss, &grad],
            Box::new(move |r, w| {
                let [l, g] = w else { unreachable!("two written buffers") };
                let ((), made) = {
                    let views = ((r[0], &shape[..], dtype), (r[1], &y_shape[..], y_dtype));
                    let (res, made) = run_measured(place, || {
                        kernels::loss(&*model, rank, views, (global_batch, micro), &mut l[0], g)
                    });
                    (res?, made)
                };
                made.check(&reserved, "loss") // KMEM-3
            }),
        )?;
        drop((keep, running));
        self.mem.free(self.streams.compute, out.buf)?;
        self.mem.free(self.streams.compute, targets)?;
        Ok(Act { buf: grad, shape: out.shape, dtype: DType::F32 })
    }

    /// Use `i`'s backward kernel (call `2 nc - 1 - i`): the unit's gradients into its
    /// gradient buffer, the input gradient into `act`; the unit's reduction is enqueued as
    /// soon as its last call is done (ENG-9's first half; NET-1).
    pub(super) fn backward(
        &mut self,
        i: usize,
        (grad_out, c): (Act, &CtxOf),
        (saved, figures): (&Arc<Slot<Kept>>, &Figures),
        hand: HandOff,
        reds: &mut Reductions<DeviceReduction>,
        partial: &mut [Option<Option<DeviceBuffer>>],
    ) -> Result<Option<Act>> {
        if self.model_ops {
            return self.backward_ops(i, (grad_out, c), saved, hand, reds, partial);
        }
        let u = self.plan.unit_at(i);
        let nc = self.calls.len();
        let call = 2 * nc - 1 - i % (2 * nc);
        // NET-1, ACC-2, ACC-3, as the walk hands them on: reduced after the unit's last call
        // of the microbatch the stage reduces after, adding to an earlier one's result.
        let (last_use, add) = (hand.reduce, hand.add);
        let gathered = self.acquire(i)?;
        let l = self.layout.unit(u);
        let (numel, padded) = (l.numel(), l.padded_numel());
        // A transient full gradient (stages 2 and 3) lives until its reduce-scatter is done;
        // stages 0 and 1 write the kept full buffer.
        let (first_use, transient) = match partial[u].take() {
            Some(t) => (false, t),
            None if self.rules.transient_grads() => {
                let what = format!("{} grads (unreduced)", self.labels[u]);
                (true, Some(self.mem.alloc(Category::Grads, padded, &what)?))
            }
            None => (true, None),
        };
        let what = format!("backward {}", self.labels[u]);
        // The input gradient (none for call 0, whose input is data), in device memory.
        let input_grad = if call > 0 {
            let (shape, _) = self.probed()?.input(call, grad_out.shape[0]);
            let label = format!("{what} (input gradient)");
            Some(Act {
                buf: self.mem.alloc(Category::Activations, shape.iter().product(), &label)?,
                shape,
                dtype: DType::F32,
            })
        } else {
            None
        };
        // KMEM-2: what the kernel makes while it runs (a backward saves nothing).
        let (reserved, keep, running) = self.reserve_for(&what, figures)?;
        let k = kernels::Call {
            model: Arc::clone(&self.model),
            call,
            rank: self.rank,
            name: what.clone(),
        };
        let (saved, c, place, world) = (saved.clone(), c.clone(), self.placement(), self.world);
        let (gshape, gdtype) = (grad_out.shape.clone(), grad_out.dtype);
        let p = match &gathered {
            Some(g) => g,
            None => self.resident(u)?,
        };
        let g = transient.as_ref().unwrap_or(&self.grads[u]);
        self.dev.launch_fallible(
            self.streams.compute,
            &what,
            // The buffers: a checkpointed call's forward runs again on a scratch copy.
            &[p, &self.buffers[u], &grad_out.buf],
            &std::iter::once(g).chain(input_grad.as_ref().map(|a| &a.buf)).collect::<Vec<_>>(),
            Box::new(move |r, w| {
                let (grads, rest) = w.split_first_mut().expect("the gradient buffer");
                let kept = saved.take(&k.name)?;
                let (res, made) = run_measured(place, || {
                    k.backward(
                        &r[0][..numel],
                        r[1],
                        (r[2], &gshape[..], gdtype),
                        kept,
                        (grads, numel, first_use),
                        rest.first_mut().map(|g| &mut **g),
                        world,
                        &c,
                    )
                });
                res?;
                made.check(&reserved, &k.name) // KMEM-3
            }),
        )?;
        drop((keep, running));
        self.mem.free(self.streams.compute, grad_out.buf)?;
        if last_use {
            self.issue_reduction(reds, u, transient, add)?;
        } else {
            partial[u] = Some(transient);
        }
        self.done_with(i, gathered);
        Ok(input_grad)
    }
}
