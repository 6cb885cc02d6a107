//! A lane reports its staging heap to an account before the op that grows it (LANE-9).

use shardline_collectives::pool::PoolAccount;
use shardline_collectives::testing::run_ranks;
use shardline_collectives::{local_group, Algorithm, CallOptions, ReduceOp};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(60);

/// Records every figure it is told.
#[derive(Default)]
struct Told(Mutex<Vec<u64>>);
impl PoolAccount for Told {
    fn held(&self, bytes: u64) -> bool {
        self.0.lock().unwrap().push(bytes);
        true
    }
}

#[test]
fn staging_is_reported_before_the_op_that_grows_it_lane_9() {
    let out = run_ranks(local_group(3).unwrap(), DEADLINE, |comm| {
        let lane = comm.lane("r").unwrap();
        let told = Arc::new(Told::default());
        lane.set_account(Arc::clone(&told) as _);
        let at_open = told.0.lock().unwrap().clone();
        // A direct all-reduce receives every peer's values into scratch (world x count).
        let mut direct = CallOptions::new();
        direct.algorithm(Algorithm::Direct);
        for n in [300usize, 30_000, 3_000] {
            lane.all_reduce_opts(vec![1.0f32; n], ReduceOp::Sum, &direct)
                .wait_timeout(DEADLINE)
                .unwrap();
        }
        let told = told.0.lock().unwrap().clone();
        (at_open, told)
    });
    for (rank, (at_open, told)) in out.into_iter().enumerate() {
        assert_eq!(at_open.len(), 1, "rank {rank}: told once when set");
        assert!(told.windows(2).all(|w| w[1] > w[0]), "rank {rank}: only growth is told: {told:?}");
        let last = *told.last().unwrap();
        // The 30,000-value op needs three times its values as scratch, and the smaller op
        // after it grows nothing.
        assert!(last >= 3 * 30_000 * 4, "rank {rank}: {told:?}");
        assert!(told.len() <= 3, "rank {rank}: {told:?}");
    }
}
