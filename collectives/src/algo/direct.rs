//! Direct (latency-optimal): one step in which every rank sends to every peer. Reductions
//! land in scratch and are folded in rank order 0..W-1 on every rank (ALGO-3).

use super::{split, Action, LocalOp, RecvStep, Schedule, SendStep, Step};
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
            .map(|p| RecvStep::new(p, base + p * count..base + (p + 1) * count, Action::Copy))
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
            .map(|p| RecvStep::new(p, len + p * n..len + (p + 1) * n, Action::Copy))
            .collect(),
        local: fold(rank, world, rank * n..(rank + 1) * n, len, n),
    });
    s
}

/// Direct all-gather over a `world * n` work buffer whose slot `rank` holds the input, in
/// `pieces` steps: step j sends piece j of the own slot to every peer and receives piece j of
/// every peer's slot. Several pieces keep each piece in the cache while it goes to every peer
/// (one read of the shard from memory instead of one per peer); one piece is one step.
pub fn direct_all_gather(rank: usize, world: usize, n: usize, pieces: usize) -> Schedule {
    direct_all_gather_steps(rank, world, n, pieces, false)
}

/// [`direct_all_gather`] sending from the op's input (the read-only region after the work
/// buffer) instead of from the work buffer: peers read the shard where the caller left it,
/// and each piece is copied into the own slot right after it went out, while the sends have
/// just read it into the cache. The wire traffic is [`direct_all_gather`]'s with the same
/// `pieces`, so ranks may mix the two forms in one op.
pub fn direct_all_gather_from_input(
    rank: usize,
    world: usize,
    n: usize,
    pieces: usize,
) -> Schedule {
    direct_all_gather_steps(rank, world, n, pieces, true)
}

fn direct_all_gather_steps(
    rank: usize,
    world: usize,
    n: usize,
    pieces: usize,
    from_input: bool,
) -> Schedule {
    let input_len = if from_input { n } else { 0 };
    let mut s = Schedule { buf_len: world * n, input_len, ..Schedule::default() };
    // The own piece: in the input region (after the work buffer) or in the own slot.
    let base = if from_input { world * n } else { rank * n };
    for p in split(0..n, pieces.clamp(1, n.max(1))) {
        let src = base + p.start..base + p.end;
        let local = if from_input {
            vec![LocalOp::Copy { src: src.clone(), dst: rank * n + p.start..rank * n + p.end }]
        } else {
            Vec::new()
        };
        if world <= 1 {
            if !local.is_empty() {
                s.push(Step { local, ..Step::default() });
            }
            continue;
        }
        let peers = (0..world).filter(|&q| q != rank);
        s.push(Step {
            sends: peers
                .clone()
                .map(|q| SendStep { peer: q, range: src.clone(), action: Action::Copy })
                .collect(),
            recvs: peers
                .map(|q| RecvStep::new(q, q * n + p.start..q * n + p.end, Action::Copy))
                .collect(),
            local,
        });
    }
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
        step.recvs.push(RecvStep::new(root, 0..count, Action::Copy));
    }
    s.push(step);
    s
}
