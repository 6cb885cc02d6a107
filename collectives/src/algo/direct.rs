//! Direct (latency-optimal): one step in which every rank sends to every peer. Reductions
//! land in scratch and are folded in rank order 0..W-1 on every rank (ALGO-3).

use super::{Action, LocalOp, RecvStep, Schedule, SendStep, Step};
use std::ops::Range;

/// Fold plan shared by all-reduce and reduce-scatter: `own` holds this rank's contribution;
/// peer p's contribution arrives in scratch segment p (`base + p*n`).
fn fold(rank: usize, world: usize, own: Range<usize>, base: usize, n: usize) -> Vec<LocalOp> {
    let seg = |p: usize| base + p * n..base + (p + 1) * n;
    let mut local = Vec::with_capacity(world + 1);
    if rank != 0 {
        local.push(LocalOp::Copy { src: own.clone(), dst: seg(rank) });
        local.push(LocalOp::Copy { src: seg(0), dst: own.clone() });
    }
    for p in 1..world {
        local.push(LocalOp::Reduce { src: seg(p), dst: own.clone() });
    }
    local
}

/// Direct all-reduce of `count` elements (scratch: `world * count`).
pub fn direct_all_reduce(rank: usize, world: usize, count: usize) -> Schedule {
    let mut s = Schedule { buf_len: count, scratch_len: world * count, ..Schedule::default() };
    if world <= 1 {
        s.scratch_len = 0;
        return s;
    }
    let peers = (0..world).filter(|&p| p != rank);
    let base = count;
    s.push(Step {
        sends: peers
            .clone()
            .map(|p| SendStep { peer: p, range: 0..count, action: Action::Copy })
            .collect(),
        recvs: peers
            .map(|p| RecvStep {
                peer: p,
                range: base + p * count..base + (p + 1) * count,
                action: Action::Copy,
            })
            .collect(),
        local: fold(rank, world, 0..count, base, count),
    });
    s
}

/// Direct reduce-scatter of a `world * n` work buffer: rank r folds slot r of every rank.
pub fn direct_reduce_scatter(rank: usize, world: usize, n: usize) -> Schedule {
    let len = world * n;
    let mut s = Schedule { buf_len: len, scratch_len: len, ..Schedule::default() };
    if world <= 1 {
        s.scratch_len = 0;
        return s;
    }
    let peers = (0..world).filter(|&p| p != rank);
    s.push(Step {
        sends: peers
            .clone()
            .map(|p| SendStep { peer: p, range: p * n..(p + 1) * n, action: Action::Copy })
            .collect(),
        recvs: peers
            .map(|p| RecvStep {
                peer: p,
                range: len + p * n..len + (p + 1) * n,
                action: Action::Copy,
            })
            .collect(),
        local: fold(rank, world, rank * n..(rank + 1) * n, len, n),
    });
    s
}

/// Direct all-gather over a `world * n` work buffer whose slot `rank` holds the input.
pub fn direct_all_gather(rank: usize, world: usize, n: usize) -> Schedule {
    let mut s = Schedule { buf_len: world * n, ..Schedule::default() };
    if world <= 1 {
        return s;
    }
    let peers = (0..world).filter(|&p| p != rank);
    s.push(Step {
        sends: peers
            .clone()
            .map(|p| SendStep { peer: p, range: rank * n..(rank + 1) * n, action: Action::Copy })
            .collect(),
        recvs: peers
            .map(|p| RecvStep { peer: p, range: p * n..(p + 1) * n, action: Action::Copy })
            .collect(),
        local: Vec::new(),
    });
    s
}

/// Direct all-gather that sends from the op's input (the read-only region after the work
/// buffer) instead of from the work buffer, and copies the input into its slot last: peers
/// read the shard where the caller left it, and no step waits for the own copy.
pub fn direct_all_gather_from_input(rank: usize, world: usize, n: usize) -> Schedule {
    let mut s = Schedule { buf_len: world * n, input_len: n, ..Schedule::default() };
    let input = world * n..(world + 1) * n;
    let peers = (0..world).filter(|&p| p != rank);
    s.push(Step {
        sends: peers
            .clone()
            .map(|p| SendStep { peer: p, range: input.clone(), action: Action::Copy })
            .collect(),
        recvs: peers
            .map(|p| RecvStep { peer: p, range: p * n..(p + 1) * n, action: Action::Copy })
            .collect(),
        local: vec![LocalOp::Copy { src: input, dst: rank * n..(rank + 1) * n }],
    });
    s
}

/// Direct broadcast: the root sends its buffer to every peer.
pub fn direct_broadcast(rank: usize, world: usize, root: usize, count: usize) -> Schedule {
    let mut s = Schedule { buf_len: count, ..Schedule::default() };
    if world <= 1 {
        return s;
    }
    let mut step = Step::default();
    if rank == root {
        step.sends = (0..world)
            .filter(|&p| p != root)
            .map(|p| SendStep { peer: p, range: 0..count, action: Action::Copy })
            .collect();
    } else {
        step.recvs.push(RecvStep { peer: root, range: 0..count, action: Action::Copy });
    }
    s.push(step);
    s
}
