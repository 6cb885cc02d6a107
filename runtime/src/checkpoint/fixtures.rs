//! Fixtures shared by the checkpoint tests: a small model spec with odd sizes, buffers and an
//! empty unit; distinct model states; a save by concurrent rank writers and one commit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use shardline_models::{ModelSpec, ParamSpec, UnitSpec};

use super::{
    CheckpointMeta, ConsolidatedUnit, DataLoaderState, PendingCheckpoint, RankShard, UnitShard,
};
use crate::optim::{AdamWConfig, Optimizer};
use crate::shard::{self, Stage};

const DEADLINE: Duration = Duration::from_secs(30);

fn p(name: &str, shape: &[usize]) -> ParamSpec {
    ParamSpec { name: name.into(), shape: shape.to_vec() }
}

/// Odd sizes, a unit with BatchNorm buffers, and an empty unit.
pub(super) fn spec() -> ModelSpec {
    ModelSpec {
        name: "test-mlp".into(),
        units: vec![
            UnitSpec {
                name: "blocks.0".into(),
                params: vec![p("blocks.0.fc.weight", &[5, 3]), p("blocks.0.fc.bias", &[5])],
                buffers: vec![
                    p("blocks.0.bn.running_mean", &[5]),
                    p("blocks.0.bn.running_var", &[5]),
                ],
            },
            UnitSpec { name: "act".into(), params: vec![], buffers: vec![] },
            UnitSpec {
                name: "head".into(),
                params: vec![p("head.weight", &[2, 5]), p("head.bias", &[2])],
                buffers: vec![],
            },
        ],
    }
}

pub(super) fn adamw() -> Optimizer {
    Optimizer::AdamW(AdamWConfig::default())
}

/// Unpadded flat params and state of every unit, with distinct values.
pub(super) fn model_state(spec: &ModelSpec, k: usize) -> Vec<ConsolidatedUnit> {
    spec.units
        .iter()
        .enumerate()
        .map(|(u, unit)| ConsolidatedUnit {
            params: (0..unit.numel()).map(|i| u as f32 * 100.0 + i as f32 * 0.5 + 0.25).collect(),
            optim_state: (0..unit.numel() * k)
                .map(|i| -(u as f32) * 10.0 - i as f32 * 0.125 - 1.0)
                .collect(),
        })
        .collect()
}

pub(super) fn shards_for(
    units: &[ConsolidatedUnit],
    spec: &ModelSpec,
    k: usize,
    world: usize,
) -> Vec<RankShard> {
    let mut out = vec![RankShard::default(); world];
    for (u, unit) in units.iter().zip(&spec.units) {
        let ps = shard::split(&u.params, unit.numel(), 1, world).unwrap();
        let ss = shard::split(&u.optim_state, unit.numel(), k, world).unwrap();
        for (r, (p, s)) in ps.into_iter().zip(ss).enumerate() {
            out[r].units.push(UnitShard { params: p, optim_state: s });
        }
    }
    out
}

pub(super) fn buffers(spec: &ModelSpec) -> Vec<Vec<f32>> {
    spec.units.iter().map(|u| (0..u.buffer_numel()).map(|i| 1.0 + i as f32).collect()).collect()
}

pub(super) fn meta(spec: &ModelSpec, world: usize, opt: Optimizer) -> CheckpointMeta {
    let mut extra = BTreeMap::new();
    extra.insert("rng".to_string(), serde_json::json!([1, 2, 3]));
    CheckpointMeta {
        world,
        stage: Stage::Zero3,
        config_hash: "cafe".into(),
        optimizer: opt,
        model: spec.clone(),
        data_loader: DataLoaderState { epoch: 2, step: 7, seed: 42 },
        extra,
    }
}

/// Every rank writes from its own thread, then one commit.
pub(super) fn save(root: &Path, step: u64, opt: Optimizer, shards: Vec<RankShard>) -> PathBuf {
    let spec = spec();
    let world = shards.len();
    let pending = PendingCheckpoint::begin(root, step).unwrap();
    let (tx, rx) = mpsc::channel();
    for (rank, shard) in shards.into_iter().enumerate() {
        let (pending, tx) = (pending.clone(), tx.clone());
        std::thread::spawn(move || {
            let _ = tx.send(pending.write_shard(rank, &shard));
        });
    }
    let entries = (0..world)
        .map(|_| rx.recv_timeout(DEADLINE).expect("rank writer timed out").unwrap())
        .collect();
    pending.commit(meta(&spec, world, opt), entries, &buffers(&spec)).unwrap()
}

/// One checkpoint of 3 ranks with AdamW state at step 5: its root and its directory.
pub(super) fn saved_once() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec();
    let shards = shards_for(&model_state(&spec, 2), &spec, 2, 3);
    let dir = save(tmp.path(), 5, adamw(), shards);
    (tmp, dir)
}
