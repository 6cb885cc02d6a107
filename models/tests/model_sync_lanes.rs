//! A residual model with SyncBatchNorm over real collectives lanes (`local_group`), with
//! uneven and empty per-rank batches, against the same model in one process (BN-1, LOSS-1,
//! MODEL-2).

use std::time::Duration;

mod common;

use common::LaneReducer;
use shardline_collectives::{local_group_with_topology, CommOptions, Topology};
use shardline_models::testing::CountingReducer;
use shardline_models::{convert_sync_batchnorm, ConvNetBn, Cpu, Ctx, Model, Tensor};

fn init(m: &Model) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let p = (0..m.num_units()).map(|u| m.init_params(u, 11).expect("params")).collect();
    let b = (0..m.num_units()).map(|u| m.init_buffers(u).expect("buffers")).collect();
    (p, b)
}

#[test]
fn residual_syncbn_over_lanes_equals_one_process() {
    let sizes = [2usize, 0, 3];
    let total: usize = sizes.iter().sum();
    let mut model =
        ConvNetBn { input: [1, 6, 6], widths: vec![3, 4], classes: 3 }.build().expect("model");
    let x: Vec<f32> = (0..total * 36).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let labels: Vec<u32> = (0..total as u32).map(|i| i % 3).collect();
    let be = Cpu::new();
    let (params, buffers) = init(&model);
    let mut want_buf = buffers.clone();
    let input = Tensor::new(vec![total, 1, 6, 6], x.clone()).expect("input");
    let (want_loss, want_grads) = model
        .loss_and_grads(&params, &mut want_buf, input, &labels, &Ctx::new(&be, true, total))
        .expect("reference");
    convert_sync_batchnorm(&mut model);

    let mut opts = CommOptions::new();
    opts.timeout(Duration::from_secs(30));
    let comms = local_group_with_topology(Topology::single_node(sizes.len()), opts).expect("group");
    let starts: Vec<usize> = sizes
        .iter()
        .scan(0, |s, &n| {
            *s += n;
            Some(*s - n)
        })
        .collect();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, comm)| {
                let (model, params, buffers, x, labels, starts, be) =
                    (&model, &params, &buffers, &x, &labels, &starts, &be);
                s.spawn(move || {
                    let lane = LaneReducer::stats_lane(comm).expect("stats lane");
                    let counter = CountingReducer::new(&lane);
                    let (a, n) = (starts[r], sizes[r]);
                    let xr = Tensor::new(vec![n, 1, 6, 6], x[a * 36..(a + n) * 36].to_vec())
                        .expect("slice");
                    let mut b = buffers.clone();
                    let ctx = Ctx::new(be, true, total).with_reducer(&counter);
                    let (loss, grads) = model
                        .loss_and_grads(params, &mut b, xr, &labels[a..a + n], &ctx)
                        .expect("step");
                    (loss, grads, b, counter.messages())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let loss: f32 = results.iter().map(|r| r.0).sum();
    assert!((loss - want_loss).abs() < 1e-5, "{loss} vs {want_loss}");
    for (u, want_unit) in want_grads.iter().enumerate() {
        for (i, &w) in want_unit.iter().enumerate() {
            let g: f32 = results.iter().map(|r| r.1[u][i]).sum();
            assert!((g - w).abs() < 1e-4 + 1e-3 * w.abs(), "unit {u} param {i}: {g} vs {w}");
        }
    }
    for r in &results {
        for (a, b) in r.2.iter().flatten().zip(want_buf.iter().flatten()) {
            assert!((a - b).abs() < 1e-5, "running statistics differ: {a} vs {b}");
        }
        // 5 BN groups (stem, block0 bn1, block0 bn2, block1 bn1, block1 bn2 + downsample.bn) x 2
        assert_eq!(r.3, 10);
    }
}
