//! The device's side of the engine's pure cores: stage 3's gathers for the prefetch plan
//! ([`DeviceGathers`], a [`GatherIo`]) and the reductions in flight for the reduction core
//! ([`DeviceReduction`], an [`InFlight`]). A gather is an all-gather enqueued on the gather
//! stream; waiting for it makes the compute stream wait for its event, never the host.

use std::sync::Arc;

use shardline_collectives::device::{Device, DeviceBuffer, DeviceComm, Event};

use super::memory::DeviceMemory;
use super::offload::{lock, Held};
use super::Streams;
use crate::engine::prefetch::GatherIo;
use crate::engine::reduction::InFlight;
use crate::error::{Result, RuntimeError};
use crate::memory::Category;
use crate::shard::ShardedModelLayout;

/// A unit's gather in flight: the buffer it fills and the event after it.
pub(crate) struct PendingGather {
    full: DeviceBuffer,
    done: Event,
}

/// Stage 3's gathers on the gather stream, for [`crate::engine::prefetch::GatherPlan`].
pub(crate) struct DeviceGathers<'a> {
    pub(crate) dev: &'a Arc<dyn Device>,
    pub(crate) mem: &'a DeviceMemory,
    pub(crate) streams: &'a Streams,
    pub(crate) comm: &'a mut dyn DeviceComm,
    pub(crate) layout: &'a ShardedModelLayout,
    /// This rank's parameter shards (on the device, or offloaded).
    pub(crate) shards: &'a [Held],
    /// Per unit, the event after which its shard holds the current parameters.
    pub(crate) ready: &'a [Option<Event>],
    pub(crate) labels: &'a [String],
    /// The negative control `InjectedBug::skip_gather_wait` (DEV-3).
    pub(crate) skip_wait: bool,
}

impl GatherIo for DeviceGathers<'_> {
    type Pending = PendingGather;
    type Full = DeviceBuffer;
    type Error = RuntimeError;

    fn issue(&mut self, unit: usize) -> Result<PendingGather> {
        let l = self.layout.unit(unit);
        let label = format!("{} (gathered)", self.labels[unit]);
        let full = self.mem.alloc(Category::GatheredUnits, l.padded_numel(), &label)?;
        // The shard's last update ran on the compute (or offload) stream.
        let g = self.streams.gather;
        if let Some(e) = &self.ready[unit] {
            self.dev.wait(g, e);
        }
        match &self.shards[unit] {
            Held::Device(shard) => self.comm.all_gather(g, shard, &full)?,
            Held::Host(host) => {
                // OFFL-1: the shard copied to the device on the gather stream, as it runs.
                let label = format!("{} shard (from host)", self.labels[unit]);
                let shard = self.mem.alloc(Category::CommBuffers, l.shard_len(), &label)?;
                let host = std::sync::Arc::clone(host);
                self.dev.launch(
                    g,
                    &format!("copy {label}"),
                    &[],
                    &[&shard],
                    Box::new(move |_, w| w[0].copy_from_slice(&lock(&host))),
                )?;
                self.comm.all_gather(g, &shard, &full)?;
                self.mem.free(g, shard)?;
            }
        }
        let done = self.dev.record(self.streams.gather);
        Ok(PendingGather { full, done })
    }

    fn wait(&mut self, _unit: usize, p: PendingGather) -> Result<DeviceBuffer> {
        // DEV-2: the compute stream waits for the gather's event; the host goes on.
        if !self.skip_wait {
            self.dev.wait(self.streams.compute, &p.done);
        }
        Ok(p.full)
    }

    fn release(&mut self, full: DeviceBuffer) {
        // Stream-ordered: after the kernels that read it. A failed device reports its
        // failure at the next call that can return it.
        let _ = self.mem.free(self.streams.compute, full);
    }
}

/// A unit's reduction in flight on the reduce stream: done when its event has fired.
pub(crate) struct DeviceReduction {
    pub(crate) dev: Arc<dyn Device>,
    pub(crate) done: Event,
}

impl InFlight for DeviceReduction {
    fn is_done(&self) -> bool {
        self.dev.query(&self.done)
    }
}
