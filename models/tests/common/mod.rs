//! A [`StatsReducer`] over a real collectives lane, for the tests that run SyncBatchNorm over
//! `local_group` lanes. The models crate depends on no transport: the runtime's reducer
//! (`shardline_runtime::engine`, the stats lane) is the production one; this adapter makes the
//! same calls (a blocking record reduction forward, a blocking sum backward).
#![allow(dead_code)]

use shardline_collectives::{CallOptions, Communicator, Lane, ReduceOp};
use shardline_models::{StatsError, StatsFailure, StatsOp, StatsReducer};

/// The lane the runtime reduces statistics on.
pub const STATS_LANE: &str = "stats";

/// A reducer over one communicator's [`STATS_LANE`].
pub struct LaneReducer {
    lane: Lane,
    rank: usize,
    world: usize,
}

impl LaneReducer {
    /// Opens the communicator's stats lane.
    pub fn stats_lane(comm: &Communicator) -> Result<Self, shardline_collectives::CollectiveError> {
        Ok(LaneReducer { lane: comm.lane(STATS_LANE)?, rank: comm.rank(), world: comm.world() })
    }

    fn error(&self, op: StatsOp, e: shardline_collectives::CollectiveError) -> StatsError {
        StatsError::new(self.rank, self.lane.name(), op, StatsFailure::Collective(Box::new(e)))
    }
}

fn blocking() -> CallOptions {
    let mut o = CallOptions::new();
    o.blocking(true);
    o
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
    ) -> Result<Vec<f32>, StatsError> {
        self.lane
            .all_reduce_records_opts(buf, record_len, combine, &blocking())
            .wait()
            .map_err(|e| self.error(StatsOp::Forward, e))
    }
    fn reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, StatsError> {
        self.lane
            .all_reduce_opts(buf, ReduceOp::Sum, &blocking())
            .wait()
            .map_err(|e| self.error(StatsOp::Backward, e))
    }
}
