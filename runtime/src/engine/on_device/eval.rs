//! Evaluation on the device: each rank's share of the test set in forwards of at most the
//! training microbatch, in eval mode, through the same forward kernels and gathers as a
//! step (the plan's evaluation pass, ENG-5); a kernel scores each forward and the reduce
//! stream sums the scores over the group. The host waits once per forward, for the sums.

use shardline_models::{Dataset, Tensor};

use super::activations::{self, Act};
use super::{kernels, run_measured, CtxOf, DeviceEngine};
use crate::error::Result;
use crate::memory::Category;

impl DeviceEngine {
    /// Evaluates this rank's share of `test` (its `DistributedSampler::slice_range`) in
    /// forwards of at most `batch` samples; returns the global (correct, count, mean loss).
    /// Collective: every rank runs the same number of forwards (a rank whose share is one
    /// sample shorter runs an empty last one, which still takes its part in the gathers and
    /// the sums), as the host engine does.
    pub fn eval_set(&mut self, test: &Dataset, batch: usize) -> Result<(u64, u64, f32)> {
        let (world, rank) = (self.world, self.rank);
        crate::engine::eval_share(test, world, rank, batch, |x, y, n| self.eval(x, y, n))
    }

    /// One evaluation forward of this rank's slice `x`/`y` of `global_n` samples.
    fn eval(&mut self, x: Tensor, y: &Tensor, global_n: usize) -> Result<(u64, u64, f32)> {
        self.fit_shapes(&x)?;
        let ctx = CtxOf {
            training: false,
            sync_bn: false,
            stats: None,
            global_batch: global_n.max(1),
            seed: self.cfg.seed,
            step: self.step,
            first_sample: 0,
            backend: std::sync::Arc::clone(&self.backend),
        };
        let b = x.batch();
        let fp = if b > 0 { Some(self.footprint(b, y, &ctx)?) } else { None };
        let c = self.streams.compute;
        let sums = self.mem.alloc(Category::Scratch, 3, "evaluation sums")?;
        self.plan.begin_eval(&self.calls);
        let mut act = None;
        if b > 0 {
            let buf = self.mem.alloc(Category::Activations, x.numel(), "evaluation data")?;
            self.dev.upload(c, &activations::values(&x)?, &buf)?;
            act = Some(Act { buf, shape: x.shape().to_vec(), dtype: x.dtype() });
        }
        drop(x);
        for i in 0..self.calls.len() {
            match (act.take(), &fp) {
                (Some(a), Some(fp)) => {
                    let (out, nothing) = self.forward(i, a, (None, &fp.forward[i]), &ctx, false)?;
                    drop(nothing);
                    act = Some(out);
                }
                // An empty slice: the gathers still go out in every rank's order.
                _ => {
                    let g = self.acquire(i)?;
                    self.done_with(i, g);
                }
            }
        }
        match (act, fp) {
            (Some(out), Some(fp)) => self.score(out, y, global_n, &sums, &fp.loss)?,
            _ => {
                let zero = shardline_models::ops::Op::Fill { value: 0.0 };
                self.dev.launch_op(c, zero.arc(), &[], &[&sums])?
            }
        }
        // The sums over the group, on the reduce stream after the scores.
        let (r, e) = (self.streams.reduce, self.dev.record(c));
        self.dev.wait(r, &e);
        self.reduce_comm.all_reduce(r, &sums)?;
        let v = self.dev.download(r, &sums)?.wait(&*self.dev)?;
        self.mem.free(r, sums)?;
        Ok((v[0] as u64, v[1] as u64, v[2]))
    }

    /// The scoring kernel: correct count, sample count and loss share of `out` into `sums`
    /// (the output and the uploaded targets are freed once read).
    fn score(
        &mut self,
        out: Act,
        y: &Tensor,
        global_n: usize,
        sums: &shardline_collectives::device::DeviceBuffer,
        figures: &super::Figures,
    ) -> Result<()> {
        let c = self.streams.compute;
        if self.model_ops {
            // LOWDEV-1: a device that runs no host code scores on the host, from the logits
            // downloaded (one wait per evaluation forward, as the sums already cost).
            let logits = self.dev.download(c, &out.buf)?.wait(&*self.dev)?;
            let t = activations::values(y)?;
            let views = ((&logits[..], &out.shape[..], out.dtype), (&t[..], y.shape(), y.dtype()));
            let mut scores = [0.0f32; 3];
            kernels::eval_loss(&*self.model, self.rank, views, global_n, &mut scores)?;
            self.dev.upload(c, &scores, sums)?;
            return self.mem.free(c, out.buf);
        }
        let targets = self.mem.alloc(Category::Activations, y.numel(), "evaluation targets")?;
        self.dev.upload(c, &activations::values(y)?, &targets)?;
        let (y_shape, y_dtype) = (y.shape().to_vec(), y.dtype());
        let (reserved, keep, running) = self.reserve_for("evaluation loss", figures)?;
        let (model, rank, place) =
            (std::sync::Arc::clone(&self.model), self.rank, self.placement());
        let (shape, dtype) = (out.shape.clone(), out.dtype);
        self.dev.launch_fallible(
            c,
            "evaluation loss",
            &[&out.buf, &targets],
            &[sums],
            Box::new(move |r, w| {
                let views = ((r[0], &shape[..], dtype), (r[1], &y_shape[..], y_dtype));
                let (res, made) = run_measured(place, || {
                    kernels::eval_loss(&*model, rank, views, global_n, &mut *w[0])
                });
                res?;
                made.check(&reserved, "evaluation loss") // KMEM-3
            }),
        )?;
        drop((keep, running));
        self.mem.free(c, out.buf)?;
        self.mem.free(c, targets)?;
        Ok(())
    }
}
