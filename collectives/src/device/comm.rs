//! What a device engine asks of its communicator: NCCL's calls, enqueued on a stream of the
//! device whose buffers they move. [`super::SimComm`] answers it between devices of one
//! process (simulated, or the host as a device); the NCCL communicator of the models crate's
//! CUDA device (feature `cuda`) answers it between GPUs.
//!
//! Every rank must issue the same calls in the same order, as NCCL requires; the simulated
//! communicator reports a difference by rank and call (SCOMM-1).

use super::{DeviceBuffer, Result, StreamId};

/// Collectives over device buffers, each enqueued on `stream` and run when the stream
/// reaches it.
pub trait DeviceComm: Send {
    /// Ranks in the communicator.
    fn size(&self) -> usize;
    /// Sums `buf` over the ranks, in place.
    fn all_reduce(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()>;
    /// Concatenates every rank's `send` into `recv` (`size` times as long), in rank order.
    fn all_gather(
        &mut self,
        stream: StreamId,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
    ) -> Result<()>;
    /// Rank r gets the r-th block of the sum of every rank's `send` in `recv`.
    fn reduce_scatter(
        &mut self,
        stream: StreamId,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
    ) -> Result<()>;
    /// All-gather in place: this rank's block of `buf` at its rank's place, every rank's
    /// afterwards (NCCL's in-place form).
    fn all_gather_in_place(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()>;
    /// Reduce-scatter in place: this rank's block of `buf` receives its block of the sum.
    fn reduce_scatter_in_place(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()>;
    /// Copies `root`'s `buf` into every rank's.
    fn broadcast(&mut self, stream: StreamId, buf: &DeviceBuffer, root: usize) -> Result<()>;
}

impl DeviceComm for super::SimComm {
    fn size(&self) -> usize {
        super::SimComm::size(self)
    }
    fn all_reduce(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()> {
        super::SimComm::all_reduce(self, stream, buf)
    }
    fn all_gather(
        &mut self,
        stream: StreamId,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
    ) -> Result<()> {
        super::SimComm::all_gather(self, stream, send, recv)
    }
    fn reduce_scatter(
        &mut self,
        stream: StreamId,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
    ) -> Result<()> {
        super::SimComm::reduce_scatter(self, stream, send, recv)
    }
    fn all_gather_in_place(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()> {
        super::SimComm::all_gather_in_place(self, stream, buf)
    }
    fn reduce_scatter_in_place(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()> {
        super::SimComm::reduce_scatter_in_place(self, stream, buf)
    }
    fn broadcast(&mut self, stream: StreamId, buf: &DeviceBuffer, root: usize) -> Result<()> {
        super::SimComm::broadcast(self, stream, buf, root)
    }
}
