//! What the model kernels make beyond their buffers, as device memory: what a call's
//! forward saves for its backward, the tensors each kernel makes while it runs, and the
//! kernels' scratch (GEMM packing, im2col columns).
//!
//! A GPU's caching allocator hands a kernel its memory when the host enqueues it, so the
//! device's peak and its capacity see the host's order, whatever the streams' timing. The
//! engine does the same: the sizes come from a probe that runs the same kernel bodies
//! (`kernels`) once on the host for each microbatch size ([`Footprint::probe`]), and each
//! kernel's bytes are reserved on the device when it is enqueued ([`super::DeviceMemory`]
//! charges them by category). When the kernel runs it is measured ([`run_measured`]): the
//! tensors it makes are placed on the device (TENSOR-4) and counted, and a kernel that
//! makes other than what was reserved fails, naming itself and both figures.
//!
//! Invariants:
//! - KMEM-1: a kernel's figures are measured on the tensors its body makes on its thread:
//!   `saved` is the bytes still held when it returns (what forward keeps for backward),
//!   `peak` the most held at once while it runs, `scratch` the kernels' kept scratch.
//! - KMEM-2: a forward's saved bytes are reserved from its enqueue until its backward has
//!   been enqueued; each kernel's peak from its enqueue to just after it (freed
//!   stream-ordered, as a buffer is); the scratch once, as a workspace kept while the
//!   engine lives and grown when a new microbatch size needs more.
//! - KMEM-3: a kernel whose run makes other than its reservation (saved bytes not equal,
//!   peak or scratch above it) fails, naming the kernel and both figures.

use std::sync::{Arc, Mutex, MutexGuard};

use shardline_collectives::device::DeviceError;
use shardline_models::meter::{self, Charge, Meter, Use};
use shardline_models::placement::{self, Placement};
use shardline_models::{DType, Network, Tensor};

use super::activations::{self, Shapes};
use super::kernels::{self, Call};
use super::CtxOf;
use crate::engine::recompute::Recompute;

/// What one kernel made (KMEM-1), in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Figures {
    /// Held when it returned.
    pub(crate) saved: u64,
    /// Most held at once while it ran.
    pub(crate) peak: u64,
    /// The kernels' kept scratch while it ran.
    pub(crate) scratch: u64,
}

impl Figures {
    /// KMEM-3: `self`, measured, against `reserved`.
    pub(crate) fn check(&self, reserved: &Figures, name: &str) -> Result<(), DeviceError> {
        let over = |what: &str, got: u64, want: u64| {
            DeviceError::Failed(format!(
                "kernel '{name}' made {got} bytes of {what} where {want} were reserved for it \
                 (probed for this microbatch size)"
            ))
        };
        if self.saved != reserved.saved {
            return Err(over("saved tensors", self.saved, reserved.saved));
        }
        if self.peak > reserved.peak {
            return Err(over("tensors at once", self.peak, reserved.peak));
        }
        if self.scratch > reserved.scratch {
            return Err(over("scratch", self.scratch, reserved.scratch));
        }
        Ok(())
    }
}

#[derive(Default)]
struct Counts {
    live: u64,
    peak: u64,
    scratch: u64,
}

/// A meter that counts (KMEM-1): installed for one kernel's run.
#[derive(Default)]
struct Measure(Arc<Mutex<Counts>>);

fn lock(m: &Mutex<Counts>) -> MutexGuard<'_, Counts> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A counted tensor: its bytes leave the count when it is dropped, on any thread.
struct Counted(Arc<Mutex<Counts>>, u64);

impl Drop for Counted {
    fn drop(&mut self) {
        let mut c = lock(&self.0);
        c.live = c.live.saturating_sub(self.1);
    }
}

impl Meter for Measure {
    fn charge(&self, bytes: u64, what: Use) -> Option<Charge> {
        let mut c = lock(&self.0);
        match what {
            Use::Tensor => {
                c.live += bytes;
                c.peak = c.peak.max(c.live);
                Some(Box::new(Counted(Arc::clone(&self.0), bytes)))
            }
            Use::Scratch => {
                c.scratch = c.scratch.max(bytes);
                Some(Box::new(()))
            }
        }
    }
}

/// Runs `f` as a kernel of device `device` (placement entered, TENSOR-4) and measures what
/// it makes (KMEM-1).
pub(crate) fn run_measured<R>(device: Placement, f: impl FnOnce() -> R) -> (R, Figures) {
    let m = Arc::new(Measure::default());
    let counts = Arc::clone(&m.0);
    let out = {
        let _on = placement::enter(device);
        let _meter = meter::install(m);
        f()
    };
    let c = lock(&counts);
    (out, Figures { saved: c.live, peak: c.peak, scratch: c.scratch })
}

/// Per call, its forward's and backward's figures for one microbatch size, and the loss
/// kernel's.
#[derive(Clone, Debug, Default)]
pub(crate) struct Footprint {
    /// Per call of the forward pass.
    pub(crate) forward: Vec<Figures>,
    /// Per call (not per use): its backward.
    pub(crate) backward: Vec<Figures>,
    pub(crate) loss: Figures,
}

/// What the probe runs a pass with.
pub(crate) struct ProbeJob<'a> {
    pub(crate) model: &'a Arc<dyn Network>,
    pub(crate) shapes: &'a Shapes,
    /// The rank's targets (the probe takes `batch` rows of them).
    pub(crate) targets: &'a Tensor,
    pub(crate) recompute: Recompute,
    pub(crate) seed: u64,
    /// Where the probe's tensors are placed: the rank's device (TENSOR-4).
    pub(crate) device: Placement,
    /// The kernels' context, with no statistics reducer (the probe runs alone).
    pub(crate) ctx: CtxOf,
}

impl Footprint {
    /// Runs one microbatch of `batch` samples through every kernel body on host buffers,
    /// with the initial parameters and zero data, and measures each (KMEM-1); kernels made
    /// the same way on the device make the same tensors. In training mode (`job.ctx`) that
    /// is the forwards, the loss and the backwards; in evaluation the forwards, which keep
    /// nothing, and the evaluation's loss kernel.
    pub(crate) fn probe(job: &ProbeJob<'_>, batch: usize) -> Result<Footprint, DeviceError> {
        let model = job.model;
        let training = job.ctx.training;
        let calls = model.calls();
        let nc = calls.len();
        let fail = |e: String| DeviceError::Failed(format!("probing kernels' memory: {e}"));
        let units = model.spec().units.len();
        let params: Vec<Vec<f32>> = (0..units)
            .map(|u| model.init_params(u, job.seed))
            .collect::<Result<_, _>>()
            .map_err(|e| fail(e.to_string()))?;
        let mut buffers: Vec<Vec<f32>> = (0..units)
            .map(|u| model.init_buffers(u))
            .collect::<Result<_, _>>()
            .map_err(|e| fail(e.to_string()))?;
        let len = |(s, _): &(Vec<usize>, DType)| s.iter().product::<usize>();
        let call_of = |c: usize| Call {
            model: Arc::clone(model),
            call: c,
            rank: 0,
            name: format!("probe call {c}"),
        };
        let mut fp = Footprint::default();
        let (in_shape, _) = job.shapes.input(0, batch);
        let mut act = vec![0.0; in_shape.iter().product()];
        let mut kept = Vec::with_capacity(nc);
        for (c, &u) in calls.iter().enumerate() {
            let (s_in, d_in) = job.shapes.input(c, batch);
            let mut out = vec![0.0; len(&job.shapes.output(c, batch))];
            let checkpoint = training && job.recompute.checkpoints(c, nc);
            let k = call_of(c);
            let (r, f) = run_measured(job.device, || {
                let x = (&act[..], &s_in[..], d_in);
                let kept =
                    k.forward(&params[u], &mut buffers[u], x, &mut out, &job.ctx, checkpoint)?;
                Ok::<_, DeviceError>(training.then_some(kept))
            });
            kept.push(r?);
            fp.forward.push(f);
            act = out;
        }
        let (s_out, d_out) = job.shapes.output(nc - 1, batch);
        let y =
            job.targets.rows(0, batch.min(job.targets.batch())).map_err(|e| fail(e.to_string()))?;
        let targets = activations::values(&y)?;
        let views = ((&act[..], &s_out[..], d_out), (&targets[..], y.shape(), y.dtype()));
        if !training {
            let mut sums = [0.0; 3];
            let (r, f) = run_measured(job.device, || {
                kernels::eval_loss(&**model, 0, views, job.ctx.global_batch, &mut sums)
            });
            r?;
            fp.loss = f;
            return Ok(fp);
        }
        let mut grad = vec![0.0; act.len()];
        let mut loss = 0.0;
        let (r, f) = run_measured(job.device, || {
            kernels::loss(&**model, 0, views, (batch, 0), &mut loss, &mut grad)
        });
        r?;
        fp.loss = f;
        fp.backward = vec![Figures::default(); nc];
        for c in (0..nc).rev() {
            let u = calls[c];
            let numel = params[u].len();
            let mut grads = vec![0.0; numel];
            let (s_g, _) = job.shapes.output(c, batch);
            let mut input_grad = (c > 0).then(|| vec![0.0; len(&job.shapes.input(c, batch))]);
            let k = call_of(c);
            let kc = kept[c].take().ok_or_else(|| fail(format!("call {c} saved nothing")))?;
            let (r, f) = run_measured(job.device, || {
                k.backward(
                    &params[u],
                    &buffers[u],
                    (&grad, &s_g, DType::F32),
                    kc,
                    (&mut grads, numel, true),
                    input_grad.as_deref_mut(),
                    1,
                    &job.ctx,
                )
            });
            r?;
            fp.backward[c] = f;
            grad = input_grad.unwrap_or_default();
        }
        Ok(fp)
    }

    /// The most scratch any of its kernels kept.
    pub(crate) fn scratch(&self) -> u64 {
        self.forward
            .iter()
            .chain(&self.backward)
            .chain([&self.loss])
            .map(|f| f.scratch)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// KMEM-1: a kernel's figures are what it made: the most held at once, what it still
    /// held on return; its tensors are placed on the device; what was made before it is
    /// not counted. KMEM-3's comparison names the figure that differs.
    #[test]
    fn a_kernel_is_measured_by_what_it_makes_and_keeps_kmem_1() {
        let before = Tensor::zeros(&[1000]);
        let dev = Placement::Device(9);
        let (kept, f) = run_measured(dev, || {
            let a = Tensor::zeros(&[100]); // 400 bytes
            let b = Tensor::zeros(&[50]); // 200: 600 at once
            drop(a);
            let c = Tensor::zeros(&[25]); // 300 held
            drop(before);
            (b, c)
        });
        assert_eq!((f.saved, f.peak), (300, 600));
        assert_eq!(kept.0.placement(), dev);
        drop(kept);
        f.check(&f, "k").unwrap();
        f.check(&Figures { peak: 700, ..f }, "k").unwrap();
        let e = f.check(&Figures { saved: 296, ..f }, "k").unwrap_err().to_string();
        assert!(e.contains("kernel 'k'") && e.contains("300 bytes of saved tensors"), "{e}");
        assert!(f.check(&Figures { peak: 599, ..f }, "k").is_err());
        assert!(f.check(&Figures { scratch: f.scratch + 1, ..f }, "k").is_ok());
    }
}
