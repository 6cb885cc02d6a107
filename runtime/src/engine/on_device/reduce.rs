//! The end of a unit's step on the device: its reduction enqueued on the reduce stream
//! after its backward, the compute stream waiting for it, the unit's update as a kernel (or,
//! offloaded, a host function on the offload stream), and the loss and squared norms summed
//! over the group on the reduce stream. The reduction core (`Reductions`) decides when.

use std::sync::Arc;

use shardline_collectives::device::{DeviceBuffer, DeviceOp};
use shardline_models::ops::{store_f64, AdamWStep, Op, SgdStep};

use super::io::DeviceReduction;
use super::offload::{lock, Held};
use super::{kernel_error, DeviceEngine};
use crate::engine::reduction::{ReduceIo, Reduction, Reductions};
use crate::engine::stage::{GradReduce, Update};
use crate::error::{Result, RuntimeError};
use crate::memory::Category;
use crate::optim::Optimizer;

impl DeviceEngine {
    /// Unit `u`'s reduction on the reduce stream, after its backward (DEV-2), as its stage
    /// says; a transient gradient is freed on the reduce stream once read.
    pub(super) fn issue_reduction(
        &mut self,
        reds: &mut Reductions<DeviceReduction>,
        u: usize,
        transient: Option<DeviceBuffer>,
        add: bool,
    ) -> Result<()> {
        let (s, dev, mem) = (&self.streams, &self.dev, &self.mem);
        let computed = dev.record(s.compute);
        dev.wait(s.reduce, &computed);
        let comm = &mut self.reduce_comm;
        if self.bug.desync_rank.take_if(|r| *r == self.rank).is_some() {
            comm.all_reduce(s.reduce, &self.loss)?;
        }
        let mut unreduced = 0;
        match (self.rules.reduce, transient) {
            (GradReduce::AllReduce, None) => comm.all_reduce(s.reduce, &self.grads[u])?,
            (GradReduce::ReduceScatterInPlace, None) => {
                comm.reduce_scatter_in_place(s.reduce, &self.grads[u])?
            }
            (GradReduce::ReduceScatter, Some(full)) => {
                unreduced = full.len() as u64 * 4;
                if add {
                    // ACC-3: the result adds to the earlier microbatches' in the shard.
                    let label = format!("{} (reduce-scatter output)", self.labels[u]);
                    let out = mem.alloc(Category::CommBuffers, self.grads[u].len(), &label)?;
                    comm.reduce_scatter(s.reduce, &full, &out)?;
                    let add = Op::Axpy { alpha: 1.0 }.arc();
                    dev.launch_op(s.reduce, add, &[&out], &[&self.grads[u]])?;
                    mem.free(s.reduce, out)?;
                } else {
                    comm.reduce_scatter(s.reduce, &full, &self.grads[u])?;
                }
                let on = if self.bug.free_grads_on_compute { s.compute } else { s.reduce };
                mem.free(on, full)?;
            }
            (how, _) => {
                return Err(RuntimeError::config(format!(
                    "unit {u}: reduction {how:?} with the wrong gradient buffer"
                )))
            }
        }
        let done = dev.record(s.reduce);
        self.reduced[u] = Some(done.clone());
        reds.issue(u, unreduced, DeviceReduction { dev: Arc::clone(dev), done });
        Ok(())
    }

    /// The loss and the squared norms summed over the group on the reduce stream; the
    /// compute stream (and the offload stream) wait for the sums (clipping reads them).
    pub(super) fn enqueue_loss_and_norm(&mut self, n: usize) -> Result<()> {
        let s = &self.streams;
        // ENG-1: the norms summed in unit order; INT-1: the wish travels with the loss.
        let stop = if self.stop_requested { 1.0 } else { 0.0 };
        let sums = Op::NormSums { units: n, stop }.arc();
        self.dev.launch_op(s.compute, sums, &[&self.loss, &self.sq], &[&self.sums])?;
        let e = self.dev.record(s.compute);
        self.dev.wait(s.reduce, &e);
        self.reduce_comm.all_reduce(s.reduce, &self.sums)?;
        let summed = self.dev.record(s.reduce);
        self.dev.wait(s.compute, &summed);
        self.dev.wait(s.offload, &summed);
        Ok(())
    }
}

/// The reduction core's I/O on the device: finishing a reduction makes the compute stream
/// wait for its event; an update is a kernel on the compute stream.
pub(super) struct StepIo<'a> {
    pub(super) eng: &'a mut DeviceEngine,
    pub(super) lr: f32,
    /// Gradient clipping's maximum norm: norms are taken as reductions finish, and updates
    /// read the summed norm on the device.
    pub(super) clip: Option<f64>,
}

impl ReduceIo<DeviceReduction> for StepIo<'_> {
    type Error = RuntimeError;

    fn finish(&mut self, r: Reduction<DeviceReduction>) -> Result<()> {
        let e = &mut *self.eng;
        e.dev.wait(e.streams.compute, &r.work.done);
        if self.clip.is_some() {
            // ENG-8 with clipping: the own reduced slice's squared norm, as it comes in.
            let u = r.unit;
            let own = e.layout.unit(u).shard_range(e.rank);
            let g = &e.grads[u];
            let own_grads = g.view(e.rules.update_ranges(&own, &[], (0, g.len())).norm)?;
            let slot = e.sq.view(2 * u..2 * u + 2)?;
            e.dev.launch_op(e.streams.compute, Op::SumSquares.arc(), &[&own_grads], &[&slot])?;
        }
        Ok(())
    }

    fn update(&mut self, u: usize) -> Result<()> {
        let e = &mut *self.eng;
        let own = e.layout.unit(u).shard_range(e.rank);
        let (rules, opt, lr, step, clip) = (e.rules, e.cfg.optimizer, self.lr, e.step, self.clip);
        let no_decay = e.no_decay[u].clone();
        let rank = e.rank;
        let (p, st) = (&e.params[u], &e.optim_state[u]);
        // With clipping the update reads the summed norm (`sums`), and its own norm is not
        // the one reported (that was taken before scaling).
        let (own_h, no_decay_h) = (own.clone(), no_decay.clone());
        let step_unit = move |p: &mut [f32],
                              g: &mut [f32],
                              st: &mut [f32],
                              sums: Option<&[f32]>,
                              sq: &mut [f32],
                              name: &str| {
            let coef = match (clip, sums) {
                (Some(max), Some(s)) => crate::optim::clip_coef(f64::from(s[1]), max),
                _ => 1.0,
            };
            let update = Update { opt: &opt, lr, step, coef };
            let norm = rules
                .update_unit(&update, &own_h, &no_decay_h, p, g, st)
                .map_err(|e| kernel_error(rank, name, e))?;
            if clip.is_none() {
                store_f64(norm, &mut sq[2 * u..2 * u + 2]);
            }
            Ok(())
        };
        let (Held::Device(p), Held::Device(st)) = (p, st) else {
            // OFFL-1: the same update as a host function on the offload stream, after the
            // unit's reduction: the gradient shard copied to the host, the state there, the
            // parameters written back to the device or kept on the host.
            let name = format!("host update {}", e.labels[u]);
            if let Some(done) = &e.reduced[u] {
                e.dev.wait(e.streams.offload, done);
            }
            let (host_p, host_st) = (p.on_host(), st.on_host());
            let mut writes = vec![&e.sq];
            writes.extend(p.on_device());
            let mut reads = vec![&e.grads[u]];
            reads.extend(clip.map(|_| &e.sums));
            let what = name.clone();
            e.dev.launch_fallible(
                e.streams.offload,
                &what,
                &reads,
                &writes,
                Box::new(move |r, w| {
                    let mut g = r[0].to_vec();
                    let sums = r.get(1).copied();
                    let mut st = lock(host_st.as_ref().expect("offloaded state"));
                    let (sq, rest) = w.split_first_mut().expect("the norms buffer");
                    match &host_p {
                        Some(hp) => step_unit(&mut lock(hp), &mut g, &mut st, sums, sq, &name),
                        None => step_unit(&mut *rest[0], &mut g, &mut st, sums, sq, &name),
                    }
                }),
            )?;
            e.ready[u] = Some(e.dev.record(e.streams.offload));
            return Ok(());
        };
        // The update as ops (what `update_unit` does, element for element): the gradients
        // scaled by the clipping coefficient, each run of the stepped range stepped with or
        // without weight decay, the own gradients' squared norm into the unit's slot.
        let ranges = rules.update_ranges(&own, &no_decay, (p.len(), e.grads[u].len()));
        let (s, k) = (e.streams.compute, opt.state_len_per_param());
        let (g, ps) = (e.grads[u].view(ranges.grads.clone())?, p.view(ranges.params.clone())?);
        if let Some(max_norm) = clip {
            e.dev.launch_op(s, Op::ClipScale { max_norm }.arc(), &[&e.sums], &[&g])?;
        }
        for &(a, b, decayed) in &ranges.runs {
            let op = step_op(&opt, lr, step, decayed);
            let (pv, sv) = (ps.view(a..b)?, st.view(a * k..b * k)?);
            e.dev.launch_op(s, op, &[&g.view(a..b)?], &[&pv, &sv])?;
        }
        if clip.is_none() {
            let norm = e.grads[u].view(ranges.norm)?;
            let slot = e.sq.view(2 * u..2 * u + 2)?;
            e.dev.launch_op(s, Op::SumSquares.arc(), &[&norm], &[&slot])?;
        }
        e.ready[u] = Some(e.dev.record(s));
        Ok(())
    }
}

/// The op of one run of a unit's update: the optimizer at `step`, with its weight decay or,
/// for a run of no-decay elements, without (OPT-5), per element as `optim` steps.
fn step_op(opt: &Optimizer, lr: f32, step: u64, decayed: bool) -> std::sync::Arc<dyn DeviceOp> {
    match opt {
        Optimizer::Sgd(c) => Op::Sgd(SgdStep {
            lr,
            momentum: c.momentum,
            dampening: c.dampening,
            weight_decay: if decayed { c.weight_decay } else { 0.0 },
            nesterov: c.nesterov,
            step,
        }),
        Optimizer::AdamW(c) => Op::AdamW(AdamWStep {
            lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: if decayed { c.weight_decay } else { 0.0 },
            step,
        }),
    }
    .arc()
}
