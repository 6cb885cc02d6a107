//! SyncBatchNorm statistics on devices: each BatchNorm's forward records and backward sums
//! are reduced by the kernel that needs them, on the compute stream (as torch's
//! SyncBatchNorm runs its collective on the current stream), over a communicator of their
//! own (the `stats` world), so they never queue behind a gather or a reduction. Records are
//! combined, and sums added, in rank order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use shardline_collectives::device::SimWorld;
use shardline_models::{StatsError, StatsFailure, StatsOp, StatsReducer};

/// One rank's statistics reducer on the `stats` world.
pub(crate) struct DeviceStats {
    pub(crate) rank: usize,
    pub(crate) world: Arc<SimWorld>,
    /// Messages so far.
    pub(crate) messages: AtomicUsize,
}

impl DeviceStats {
    fn exchange(&self, op: StatsOp, buf: Vec<f32>) -> Result<Vec<Vec<f32>>, StatsError> {
        self.messages.fetch_add(1, Ordering::Relaxed);
        let what = format!("stats {op} ({} values)", buf.len());
        self.world.exchange(self.rank, &what, buf).map_err(|e| {
            StatsError::new(self.rank, "stats", op, StatsFailure::Collective(Box::new(e)))
        })
    }
}

impl StatsReducer for DeviceStats {
    fn world(&self) -> usize {
        self.world.size()
    }

    fn reduce_records(
        &self,
        buf: Vec<f32>,
        _record_len: usize,
        combine: fn(&mut [f32], &[f32]),
    ) -> Result<Vec<f32>, StatsError> {
        let mut all = self.exchange(StatsOp::Forward, buf)?.into_iter();
        let mut acc = all.next().unwrap_or_default();
        for other in all {
            combine(&mut acc, &other);
        }
        Ok(acc)
    }

    fn reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, StatsError> {
        let mut all = self.exchange(StatsOp::Backward, buf)?.into_iter();
        let mut acc = all.next().unwrap_or_default();
        for other in all {
            acc.iter_mut().zip(&other).for_each(|(a, b)| *a += b);
        }
        Ok(acc)
    }
}
