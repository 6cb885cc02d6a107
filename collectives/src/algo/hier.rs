//! Hierarchical schedules for a uniform multi-node topology: intra-node reduce-scatter,
//! inter-node ring among ranks of equal local rank (a "rail"), intra-node all-gather.
//! Slots follow global rank (ALGO-4), whatever the placement of ranks on nodes.

use super::ring::{
    ag_steps, ring_all_gather, ring_all_reduce, ring_reduce_scatter, rs_steps, split,
};
use super::Schedule;
use crate::topology::Topology;

struct Layout {
    intra: Vec<usize>,
    rail: Vec<usize>,
    local: usize,
    node: usize,
}

fn layout(rank: usize, topo: &Topology) -> Option<Layout> {
    if !topo.is_uniform() || topo.nodes() < 2 {
        return None;
    }
    let node = topo.node_of(rank);
    let local = topo.local_rank(rank);
    let rail = (0..topo.nodes()).map(|k| topo.ranks_on_node(k)[local]).collect();
    Some(Layout { intra: topo.ranks_on_node(node).to_vec(), rail, local, node })
}

/// Hierarchical all-reduce of `count` elements; Ring when the topology does not allow it.
pub fn hier_all_reduce(rank: usize, topo: &Topology, count: usize) -> Schedule {
    let Some(l) = layout(rank, topo) else {
        return ring_all_reduce(rank, topo.world(), count);
    };
    let mut s = Schedule { buf_len: count, ..Schedule::default() };
    let chunks = split(0..count, l.intra.len());
    rs_steps(&mut s, &l.intra, l.local, &chunks);
    let sub = split(chunks[l.local].clone(), l.rail.len());
    rs_steps(&mut s, &l.rail, l.node, &sub);
    ag_steps(&mut s, &l.rail, l.node, &sub);
    ag_steps(&mut s, &l.intra, l.local, &chunks);
    s
}

/// Hierarchical reduce-scatter of a `world * n` work buffer; rank r ends with slot r.
pub fn hier_reduce_scatter(rank: usize, topo: &Topology, n: usize) -> Schedule {
    let Some(l) = layout(rank, topo) else {
        return ring_reduce_scatter(rank, topo.world(), n);
    };
    let slot = |g: usize| g * n..(g + 1) * n;
    let mut s = Schedule { buf_len: topo.world() * n, ..Schedule::default() };
    // Within the node, local rank j collects the node's partial sums of every slot owned by
    // a rank with local rank j (one ring per node block keeps one message per peer per step).
    for k in 0..topo.nodes() {
        let chunks: Vec<_> = topo.ranks_on_node(k).iter().map(|&g| slot(g)).collect();
        rs_steps(&mut s, &l.intra, l.local, &chunks);
    }
    let chunks: Vec<_> = l.rail.iter().map(|&g| slot(g)).collect();
    rs_steps(&mut s, &l.rail, l.node, &chunks);
    s
}

/// Hierarchical all-gather over a `world * n` work buffer whose slot `rank` holds the input.
pub fn hier_all_gather(rank: usize, topo: &Topology, n: usize) -> Schedule {
    let Some(l) = layout(rank, topo) else {
        return ring_all_gather(rank, topo.world(), n);
    };
    let slot = |g: usize| g * n..(g + 1) * n;
    let mut s = Schedule { buf_len: topo.world() * n, ..Schedule::default() };
    let chunks: Vec<_> = l.rail.iter().map(|&g| slot(g)).collect();
    ag_steps(&mut s, &l.rail, l.node, &chunks);
    for k in 0..topo.nodes() {
        let chunks: Vec<_> = topo.ranks_on_node(k).iter().map(|&g| slot(g)).collect();
        ag_steps(&mut s, &l.intra, l.local, &chunks);
    }
    s
}
