//! A device rank's state in and out: its checkpoint shard, a checkpoint's load, the full
//! parameters and the buffers. Each waits for the streams' work before it reads (a host
//! synchronisation outside the step, DEV-1) and orders what it writes before the next
//! step's kernels with the units' events.
//!
//! A rank's checkpoint shard is the host engine's ([`RankShard`]): the same files resume
//! on either engine, at any world size the loader reshards to.

use super::offload::{lock, Held};
use super::DeviceEngine;
use crate::checkpoint::{RankShard, UnitShard};
use crate::engine::stage::{BeforeUse, Holding};
use crate::error::{Result, RuntimeError};
use crate::memory::Category;

impl DeviceEngine {
    /// Every unit's full parameters (unpadded), gathered at stage 3 (collective: every rank
    /// calls it).
    pub fn full_params(&mut self) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        let s = self.streams.gather;
        for u in 0..self.layout.units().len() {
            if let Some(e) = &self.ready[u] {
                self.dev.wait(s, e);
            }
            let l = self.layout.unit(u);
            let mut v = match (&self.params[u], self.rules.before_use) {
                (Held::Device(p), BeforeUse::Gather) => {
                    let full = self.mem.alloc(
                        Category::GatheredUnits,
                        l.padded_numel(),
                        "full parameters",
                    )?;
                    self.gather_comm.all_gather(s, p, &full)?;
                    let v = self.dev.download(s, &full)?.wait(&*self.dev)?;
                    self.mem.free(s, full)?;
                    v
                }
                (Held::Device(p), BeforeUse::Resident) => {
                    self.dev.download(s, p)?.wait(&*self.dev)?
                }
                (Held::Host(h), _) => {
                    // The host update must have run before the host reads its result.
                    if let Some(e) = &self.ready[u] {
                        self.dev.synchronize(e)?;
                    }
                    let shard =
                        self.mem.alloc(Category::CommBuffers, l.shard_len(), "parameter shard")?;
                    self.dev.upload(s, &lock(h), &shard)?;
                    let full = self.mem.alloc(
                        Category::GatheredUnits,
                        l.padded_numel(),
                        "full parameters",
                    )?;
                    self.gather_comm.all_gather(s, &shard, &full)?;
                    let v = self.dev.download(s, &full)?.wait(&*self.dev)?;
                    self.mem.free(s, full)?;
                    self.mem.free(s, shard)?;
                    v
                }
            };
            v.truncate(l.numel());
            out.push(v);
        }
        Ok(out)
    }

    /// Every unit's buffers (BatchNorm running statistics).
    pub fn buffers(&self) -> Result<Vec<Vec<f32>>> {
        let s = self.streams.compute;
        let d = &*self.dev;
        self.buffers.iter().map(|b| Ok(d.download(s, b)?.wait(d)?)).collect()
    }

    /// Makes the compute stream wait for every other stream's work, so that what it
    /// enqueues next sees every update, gather and reduction.
    fn quiesce(&self) {
        let c = self.streams.compute;
        for s in [self.streams.gather, self.streams.reduce, self.streams.offload] {
            let e = self.dev.record(s);
            self.dev.wait(c, &e);
        }
    }

    /// The values of `h`, read once the work before it is done.
    fn read_held(&self, h: &Held) -> Result<Vec<f32>> {
        let (c, d) = (self.streams.compute, &*self.dev);
        match h {
            Held::Device(b) => Ok(d.download(c, b)?.wait(d)?),
            Held::Host(v) => {
                d.synchronize(&d.record(c))?;
                Ok(lock(v).clone())
            }
        }
    }

    /// Writes `v` into `h` on the compute stream (a host value once the work before is done).
    fn write_held(&self, h: &Held, v: &[f32]) -> Result<()> {
        let (c, d) = (self.streams.compute, &*self.dev);
        match h {
            Held::Device(b) => d.upload(c, v, b)?,
            Held::Host(x) => {
                d.synchronize(&d.record(c))?;
                *lock(x) = v.to_vec();
            }
        }
        Ok(())
    }

    /// Every rank's `shard` all-gathered into `full_len` values on the host (collective).
    fn gather_to_host(&mut self, shard: &[f32], full_len: usize) -> Result<Vec<f32>> {
        let s = self.streams.gather;
        let a = self.mem.alloc(Category::CommBuffers, shard.len(), "checkpoint shard")?;
        self.dev.upload(s, shard, &a)?;
        let full = self.mem.alloc(Category::CommBuffers, full_len, "checkpoint, gathered")?;
        self.gather_comm.all_gather(s, &a, &full)?;
        let v = self.dev.download(s, &full)?.wait(&*self.dev)?;
        self.mem.free(s, a)?;
        self.mem.free(s, full)?;
        Ok(v)
    }

    /// This rank's checkpoint content: its parameter and optimizer-state slices per unit, as
    /// the host engine writes them.
    pub fn shard_state(&mut self) -> Result<RankShard> {
        self.quiesce();
        let k = self.cfg.optimizer.state_len_per_param();
        let mut units = Vec::with_capacity(self.params.len());
        for u in 0..self.params.len() {
            let r = self.layout.unit(u).shard_range(self.rank);
            let p = self.read_held(&self.params[u])?;
            let st = self.read_held(&self.optim_state[u])?;
            units.push(UnitShard {
                params: match self.rules.params {
                    Holding::Full => p[r.clone()].to_vec(),
                    Holding::Shard => p,
                },
                optim_state: match self.rules.optim_state {
                    Holding::Full => st[r.start * k..r.end * k].to_vec(),
                    Holding::Shard => st,
                },
            });
        }
        Ok(RankShard { units })
    }

    /// Restores a checkpoint's state (written for this world size, or resharded by the
    /// loader), the replicated buffers and the step count. Stages that keep full copies
    /// all-gather the slices. Collective.
    pub fn load_state(&mut self, shard: &RankShard, buffers: &[Vec<f32>], step: u64) -> Result<()> {
        self.discard_gathers()?;
        self.quiesce();
        let k = self.cfg.optimizer.state_len_per_param();
        if shard.units.len() != self.params.len() || buffers.len() != self.buffers.len() {
            return Err(RuntimeError::config(
                "checkpoint has another number of units than the model",
            ));
        }
        for (u, us) in shard.units.iter().enumerate() {
            let l = self.layout.unit(u);
            let (shard_len, padded) = (l.shard_len(), l.padded_numel());
            let bad = |what: &str| {
                RuntimeError::config(format!(
                    "checkpoint {what} of unit {} has the wrong size",
                    l.name()
                ))
            };
            if us.params.len() != shard_len || us.optim_state.len() != shard_len * k {
                return Err(bad("shard"));
            }
            if buffers[u].len() != self.buffers[u].len() {
                return Err(bad("buffers"));
            }
            let params = match self.rules.params {
                Holding::Full => self.gather_to_host(&us.params, padded)?,
                Holding::Shard => us.params.clone(),
            };
            let state = match self.rules.optim_state {
                Holding::Full => self.gather_to_host(&us.optim_state, padded * k)?,
                Holding::Shard => us.optim_state.clone(),
            };
            self.quiesce();
            self.write_held(&self.params[u], &params)?;
            self.write_held(&self.optim_state[u], &state)?;
            self.dev.upload(self.streams.compute, &buffers[u], &self.buffers[u])?;
            self.ready[u] = Some(self.dev.record(self.streams.compute));
        }
        self.step = step;
        Ok(())
    }

    /// Frees the gathers queued for the next pass (ENG-6): after a load the parameters they
    /// carry are stale, and at the end nothing uses them.
    pub(super) fn discard_gathers(&mut self) -> Result<()> {
        let (plan, mut io) = self.gathers();
        plan.discard_with(&mut io)
    }
}
