//! Ring (bandwidth-optimal: each element crosses each link 2(W-1)/W times for all-reduce)
//! and the pipelined chain for broadcast.

use super::{Action, RecvStep, Schedule, SendStep, Step};
use std::ops::Range;

/// Splits `range` into `parts` contiguous chunks whose sizes differ by at most one (the
/// first `len % parts` chunks are one longer).
pub fn split(range: Range<usize>, parts: usize) -> Vec<Range<usize>> {
    let len = range.len();
    let parts = parts.max(1);
    let (base, extra) = (len / parts, len % parts);
    let mut out = Vec::with_capacity(parts);
    let mut start = range.start;
    for i in 0..parts {
        let n = base + usize::from(i < extra);
        out.push(start..start + n);
        start += n;
    }
    out
}

/// Appends a ring reduce-scatter over `ring` (global ranks in ring order) where this rank
/// sits at `pos`: at the end position `i` holds `chunks[i]` reduced over the ring.
pub(crate) fn rs_steps(s: &mut Schedule, ring: &[usize], pos: usize, chunks: &[Range<usize>]) {
    let m = ring.len();
    debug_assert_eq!(chunks.len(), m);
    let (right, left) = (ring[(pos + 1) % m], ring[(pos + m - 1) % m]);
    for step in 0..m.saturating_sub(1) {
        let send = (pos + 2 * m - step - 1) % m;
        let recv = (pos + 2 * m - step - 2) % m;
        s.push(Step {
            sends: vec![SendStep {
                peer: right,
                range: chunks[send].clone(),
                action: Action::Reduce,
            }],
            recvs: vec![RecvStep::new(left, chunks[recv].clone(), Action::Reduce)],
            local: Vec::new(),
        });
    }
}

/// Appends a ring all-gather: position `i` starts holding `chunks[i]`; at the end everyone
/// holds every chunk.
pub(crate) fn ag_steps(s: &mut Schedule, ring: &[usize], pos: usize, chunks: &[Range<usize>]) {
    let m = ring.len();
    debug_assert_eq!(chunks.len(), m);
    let (right, left) = (ring[(pos + 1) % m], ring[(pos + m - 1) % m]);
    for step in 0..m.saturating_sub(1) {
        let send = (pos + m - step) % m;
        let recv = (pos + 2 * m - step - 1) % m;
        s.push(Step {
            sends: vec![SendStep {
                peer: right,
                range: chunks[send].clone(),
                action: Action::Copy,
            }],
            recvs: vec![RecvStep::new(left, chunks[recv].clone(), Action::Copy)],
            local: Vec::new(),
        });
    }
}

/// Ring all-reduce of `count` elements over ranks `0..world`.
pub fn ring_all_reduce(rank: usize, world: usize, count: usize) -> Schedule {
    let ring: Vec<usize> = (0..world).collect();
    let chunks = split(0..count, world);
    let mut s = Schedule { buf_len: count, ..Schedule::default() };
    rs_steps(&mut s, &ring, rank, &chunks);
    ag_steps(&mut s, &ring, rank, &chunks);
    s
}

/// Ring reduce-scatter, then one direct all-gather step: rank r sends its reduced chunk to
/// every peer at once. The same result as [`ring_all_reduce`] (the reduction is the ring's);
/// for transports where W-1 ring hand-offs cost more than one step with W-1 messages
/// (processes on shared cores).
pub fn ring_all_reduce_direct_gather(rank: usize, world: usize, count: usize) -> Schedule {
    let ring: Vec<usize> = (0..world).collect();
    let chunks = split(0..count, world);
    let mut s = Schedule { buf_len: count, ..Schedule::default() };
    rs_steps(&mut s, &ring, rank, &chunks);
    if world > 1 {
        let peers = (0..world).filter(|&p| p != rank);
        s.push(Step {
            sends: peers
                .clone()
                .map(|p| SendStep { peer: p, range: chunks[rank].clone(), action: Action::Copy })
                .collect(),
            recvs: peers.map(|p| RecvStep::new(p, chunks[p].clone(), Action::Copy)).collect(),
            local: Vec::new(),
        });
    }
    s
}

/// Ring reduce-scatter of a work buffer of `world * n` elements: rank r ends with slot r
/// (`[r*n, (r+1)*n)`) reduced (ALGO-4).
pub fn ring_reduce_scatter(rank: usize, world: usize, n: usize) -> Schedule {
    let ring: Vec<usize> = (0..world).collect();
    let chunks: Vec<_> = (0..world).map(|i| i * n..(i + 1) * n).collect();
    let mut s = Schedule { buf_len: world * n, ..Schedule::default() };
    rs_steps(&mut s, &ring, rank, &chunks);
    s
}

/// Ring all-gather over a work buffer of `world * n` elements whose slot r holds rank r's
/// input (ALGO-4).
pub fn ring_all_gather(rank: usize, world: usize, n: usize) -> Schedule {
    let ring: Vec<usize> = (0..world).collect();
    let chunks: Vec<_> = (0..world).map(|i| i * n..(i + 1) * n).collect();
    let mut s = Schedule { buf_len: world * n, ..Schedule::default() };
    ag_steps(&mut s, &ring, rank, &chunks);
    s
}

/// Pipelined chain broadcast: ranks root, root+1, ... pass `pieces` pieces along; a rank
/// forwards piece k while it receives piece k+1.
pub fn chain_broadcast(
    rank: usize,
    world: usize,
    root: usize,
    count: usize,
    pieces: usize,
) -> Schedule {
    let mut s = Schedule { buf_len: count, ..Schedule::default() };
    if world <= 1 {
        return s;
    }
    let chunks = split(0..count, pieces.max(1));
    let k = chunks.len();
    let pos = (rank + world - root) % world;
    let next = (rank + 1) % world;
    let prev = (rank + world - 1) % world;
    for t in 0..k + world - 2 {
        let mut step = Step::default();
        if pos + 1 < world && t >= pos && t - pos < k {
            step.sends.push(SendStep {
                peer: next,
                range: chunks[t - pos].clone(),
                action: Action::Copy,
            });
        }
        if pos >= 1 && t + 1 >= pos && t + 1 - pos < k {
            step.recvs.push(RecvStep::new(prev, chunks[t + 1 - pos].clone(), Action::Copy));
        }
        s.push(step);
    }
    s
}
