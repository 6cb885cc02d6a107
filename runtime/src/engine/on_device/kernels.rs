//! The bodies of the compute stream's model kernels (a call's forward and backward, the
//! loss), as functions of the kernel's buffers. The engine enqueues them; the probe of
//! `kernel_memory` runs the same functions on host buffers to learn what they make, so the
//! figures it reserves are those of this code, not an estimate of it.

use std::sync::Arc;

use shardline_collectives::device::DeviceError;
use shardline_models::{CallBackward, DType, Network};

use super::activations;
use super::{kernel_error, CtxOf};
use crate::engine::pass::Kept;
use crate::engine::recompute::{Checkpoint, Recording, Replay};

/// Which kernel: the model, the call, the rank, the kernel's name (errors name it).
#[derive(Clone)]
pub(super) struct Call {
    pub(super) model: Arc<dyn Network>,
    pub(super) call: usize,
    pub(super) rank: usize,
    pub(super) name: String,
}

/// A device activation as a kernel sees it: its values, shape and element type.
pub(super) type ActView<'a> = (&'a [f32], &'a [usize], DType);

impl Call {
    fn err(&self, e: impl std::fmt::Display) -> DeviceError {
        kernel_error(self.rank, &self.name, e)
    }

    /// The call's forward: `input` to `out`, with the unit's `params` and `buffers`
    /// (updated: BatchNorm's running statistics). Returns what backward needs: what the
    /// layers saved, or with `checkpoint` the input alone and the statistics received
    /// (RECOMP-1).
    pub(super) fn forward(
        &self,
        params: &[f32],
        buffers: &mut [f32],
        input: ActView<'_>,
        out: &mut [f32],
        c: &CtxOf,
        checkpoint: bool,
    ) -> Result<Kept, DeviceError> {
        let x = activations::read(input.0, input.1, input.2).map_err(|e| self.err(e))?;
        let model = &*self.model;
        if !checkpoint {
            let (y, s) = model
                .forward_call(self.call, params, buffers, x, &c.ctx(false))
                .map_err(|e| self.err(e))?;
            activations::write(&y, out)?;
            return Ok(Kept::State(s));
        }
        let input = x.clone();
        let recording = c.ctx(false).reducer.map(Recording::new);
        // What the layers save is dropped here; backward recomputes it.
        let y = {
            let mut ctx = c.ctx(false);
            if let Some(rec) = &recording {
                ctx.reducer = Some(rec);
            }
            model.forward_call(self.call, params, buffers, x, &ctx).map_err(|e| self.err(e))?.0
        };
        let received = recording.map(Recording::into_received).unwrap_or_default();
        activations::write(&y, out)?;
        Ok(Kept::Input(Checkpoint { input, received }))
    }

    /// The call's backward: the parameter gradients into `grads` (its first `numel`
    /// elements; the padding cleared on the first use), the input gradient into
    /// `input_grad` (none for call 0). A checkpointed call's forward runs again first, on a
    /// scratch copy of `buffers`, with the statistics replayed (RECOMP-1..3).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward(
        &self,
        params: &[f32],
        buffers: &[f32],
        grad_out: ActView<'_>,
        kept: Kept,
        (grads, numel, first_use): (&mut [f32], usize, bool),
        input_grad: Option<&mut [f32]>,
        world: usize,
        c: &CtxOf,
    ) -> Result<(), DeviceError> {
        let model = &*self.model;
        let grad_output =
            activations::read(grad_out.0, grad_out.1, grad_out.2).map_err(|e| self.err(e))?;
        let saved = match kept {
            Kept::State(s) => s,
            Kept::Input(cp) => {
                let replay = Replay::new(self.rank, world, cp.received);
                let mut ctx = c.ctx(false);
                if ctx.reducer.is_some() {
                    ctx.reducer = Some(&replay);
                }
                let mut scratch = buffers.to_vec();
                model
                    .forward_call(self.call, params, &mut scratch, cp.input, &ctx)
                    .map_err(|e| self.err(e))?
                    .1
            }
        };
        // The first call writes the gradients; only the padding needs clearing.
        if first_use {
            grads[numel..].fill(0.0);
        }
        let ctx = c.ctx(first_use);
        let b = CallBackward {
            params,
            saved,
            grad_output,
            grads_out: &mut grads[..numel],
            input_grad: self.call > 0,
        };
        let ig = model.backward_call(self.call, b, &ctx).map_err(|e| self.err(e))?;
        match (ig.finish(&*c.backend, params).map_err(|e| self.err(e))?, input_grad) {
            (Some(gx), Some(out)) => activations::write(&gx, out),
            (None, None) => Ok(()),
            _ => Err(self.err("an input gradient where none was due")),
        }
    }
}

/// The loss kernel's body: the rank's share of the loss of `logits` against `targets`
/// (added to `*loss` after the first microbatch, ACC-1) and the gradient of the logits.
pub(super) fn loss(
    model: &dyn Network,
    rank: usize,
    (logits, targets): (ActView<'_>, ActView<'_>),
    (global_batch, micro): (usize, usize),
    loss: &mut f32,
    grad: &mut [f32],
) -> Result<(), DeviceError> {
    let err = |e| kernel_error(rank, "loss", e);
    let x = activations::read(logits.0, logits.1, logits.2).map_err(err)?;
    let y = activations::read(targets.0, targets.1, targets.2).map_err(err)?;
    let (l, g) = model.loss().forward_backward(&x, &y, global_batch).map_err(err)?;
    *loss = if micro == 0 { l } else { *loss + l };
    activations::write(&g, grad)
}

/// The evaluation's loss kernel: this rank's correct count, sample count and share of the
/// loss of `logits` against `targets` (the loss over `global_n` samples), into `out[0..3]`.
pub(super) fn eval_loss(
    model: &dyn Network,
    rank: usize,
    (logits, targets): (ActView<'_>, ActView<'_>),
    global_n: usize,
    out: &mut [f32],
) -> Result<(), DeviceError> {
    let err = |e| kernel_error(rank, "evaluation loss", e);
    let x = activations::read(logits.0, logits.1, logits.2).map_err(err)?;
    let y = activations::read(targets.0, targets.1, targets.2).map_err(err)?;
    let loss_fn = model.loss();
    let local = y.batch() as u64;
    let (correct, count) = loss_fn.correct(&x, &y).map_err(err)?.unwrap_or((0, local));
    let (loss, _) = loss_fn.forward_backward(&x, &y, global_n.max(y.batch())).map_err(err)?;
    out[..3].copy_from_slice(&[correct as f32, count as f32, loss]);
    Ok(())
}
