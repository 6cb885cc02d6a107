//! [`StatsReducer`] over a collectives lane (the `stats` lane of a communicator).

use shardline_collectives::{CallOptions, Communicator, Lane, ReduceOp};

use crate::batchnorm::StatsReducer;
use crate::error::ModelError;

/// Name of the lane that carries SyncBatchNorm statistics, apart from the gather and reduce
/// lanes so that a large gather never delays a small, latency-bound statistics reduction.
pub const STATS_LANE: &str = "stats";

/// A [`StatsReducer`] over one lane of a communicator: forward statistics go through
/// `Lane::all_reduce_records` (one message per peer, rank-ordered fold, bitwise identical on
/// every rank), backward sums through `Lane::all_reduce` with `Sum`.
#[derive(Clone)]
pub struct LaneReducer {
    lane: Lane,
    world: usize,
}

impl LaneReducer {
    /// A reducer over a lane of a communicator of `world` ranks.
    pub fn new(lane: Lane, world: usize) -> Self {
        LaneReducer { lane, world }
    }

    /// A reducer over the communicator's [`STATS_LANE`].
    pub fn stats_lane(comm: &Communicator) -> Result<Self, ModelError> {
        let lane = comm.lane(STATS_LANE).map_err(|e| ModelError::Reduce(e.to_string()))?;
        Ok(LaneReducer { lane, world: comm.world() })
    }
}

impl StatsReducer for LaneReducer {
    fn world(&self) -> usize {
        self.world
    }
    fn reduce_records(
        &self,
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
    ) -> Result<Vec<f32>, ModelError> {
        // The statistics are needed at once: a blocking call skips the lane thread hand-off.
        self.lane
            .all_reduce_records_opts(buf, record_len, combine, &blocking())
            .wait()
            .map_err(|e| ModelError::Reduce(e.to_string()))
    }
    fn reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, ModelError> {
        self.lane
            .all_reduce_opts(buf, ReduceOp::Sum, &blocking())
            .wait()
            .map_err(|e| ModelError::Reduce(e.to_string()))
    }
}

fn blocking() -> CallOptions {
    let mut o = CallOptions::new();
    o.blocking(true);
    o
}
