//! Algorithms as pure schedules: which element range goes to which peer at which step, and
//! what the receiver does with it. No I/O here; [`crate::executor`] runs a schedule over a
//! lane's links, and the tests below run it over in-memory buffers.
//!
//! A schedule addresses one virtual array: `[0, buf_len)` is the op's work buffer,
//! `[buf_len, buf_len + scratch_len)` is executor scratch, the `input_len` elements after
//! that are the op's input buffer, read-only (sends and local sources only), and the
//! `output_len` elements after those the op's separate output (ALGO-5).
//!
//! Invariants (checked by [`Schedule::validate`] and the simulations in the tests):
//! - ALGO-1: in every step a rank sends at most one message to and receives at most one
//!   message from each peer, and every send is matched by the peer's receive of equal length
//!   in the same step (so ranks never wait on each other in a cycle).
//! - ALGO-2: within a step, the ranges a rank sends, the ranges it receives into, and each
//!   other's receive ranges are pairwise disjoint (the executor reads and writes them
//!   concurrently).
//! - ALGO-3: every contribution is reduced in an order fixed by (world, count, algorithm),
//!   so results are bitwise identical across runs; all-reduce results are also bitwise
//!   identical on every rank (Direct folds in rank order 0..W-1 on every rank; Ring and
//!   Hierarchical reduce each chunk on one rank and copy it).
//! - ALGO-4: shard order follows global rank: after reduce-scatter rank r holds slot r, and
//!   all-gather puts rank r's input in slot r, whatever the algorithm.
//! - ALGO-5: the op's separate output, after the input, is written only by receives that
//!   reduce into it ([`RecvStep::out`]: `range (op) incoming` goes there, and `range` is only
//!   read in that step) and by local copies; the combined operands keep the order of a
//!   reduction into `range`, so results are bitwise those of reducing in place and copying.

mod direct;
mod hier;
mod ring;

pub use direct::{
    direct_all_gather, direct_all_gather_from_input, direct_all_reduce, direct_broadcast,
    direct_reduce_scatter,
};
pub use hier::{hier_all_gather, hier_all_reduce, hier_reduce_scatter};
pub use ring::{
    chain_broadcast, ring_all_gather, ring_all_reduce, ring_all_reduce_direct_gather,
    ring_reduce_scatter, split,
};

use std::ops::Range;

/// Algorithm choice for one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Direct below the communicator's `small_bytes`, else Hierarchical on a multi-node
    /// uniform topology, else Ring; an all-gather whose transport prefers it
    /// (`LaneLinks::prefers_direct_gather`: shared memory) is Direct at every size.
    #[default]
    Auto,
    /// Bandwidth-optimal ring (reduce-scatter then all-gather); pipelined chain for broadcast.
    Ring,
    /// Every rank sends to every peer in one step (latency-optimal for small messages).
    Direct,
    /// Intra-node reduce-scatter, inter-node exchange among equal local ranks, intra-node
    /// all-gather. Falls back to Ring on a non-uniform topology.
    Hierarchical,
}

impl Algorithm {
    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::Ring => "ring",
            Algorithm::Direct => "direct",
            Algorithm::Hierarchical => "hierarchical",
        }
    }

    pub(crate) fn code(self) -> u32 {
        match self {
            Algorithm::Auto => 0,
            Algorithm::Ring => 1,
            Algorithm::Direct => 2,
            Algorithm::Hierarchical => 3,
        }
    }

    pub(crate) fn from_code(c: u32) -> Option<Self> {
        Some(match c {
            0 => Algorithm::Auto,
            1 => Algorithm::Ring,
            2 => Algorithm::Direct,
            3 => Algorithm::Hierarchical,
            _ => return None,
        })
    }
}

/// What a receiver does with incoming elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Overwrite the range.
    Copy,
    /// Reduce into the range with the op's reduction.
    Reduce,
}

/// One outgoing message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendStep {
    /// Destination rank.
    pub peer: usize,
    /// Elements sent (virtual array).
    pub range: Range<usize>,
    /// What the receiver does with them (its matching [`RecvStep::action`]; ALGO-1). A
    /// transport may move a copied message differently from a reduced one.
    pub action: Action,
}

/// One incoming message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvStep {
    /// Source rank.
    pub peer: usize,
    /// Elements written (virtual array).
    pub range: Range<usize>,
    /// Copy or reduce.
    pub action: Action,
    /// `Reduce` only: where `range (op) incoming` is written instead of back into `range`,
    /// which this step then only reads (ALGO-5). An out-of-place reduce-scatter's last step
    /// puts the rank's result straight into its output this way, saving the copy.
    pub out: Option<Range<usize>>,
}

impl RecvStep {
    /// A receive into `range`.
    pub fn new(peer: usize, range: Range<usize>, action: Action) -> Self {
        RecvStep { peer, range, action, out: None }
    }

    /// The elements this receive writes.
    pub fn written(&self) -> &Range<usize> {
        self.out.as_ref().unwrap_or(&self.range)
    }
}

/// Local work done after a step's messages have all arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalOp {
    /// `dst = src`.
    Copy {
        /// Source range.
        src: Range<usize>,
        /// Destination range (same length, disjoint).
        dst: Range<usize>,
    },
    /// `dst = dst (op) src`.
    Reduce {
        /// Source range.
        src: Range<usize>,
        /// Destination range (same length, disjoint).
        dst: Range<usize>,
    },
}

/// One step: messages exchanged concurrently, then local ops in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Messages sent.
    pub sends: Vec<SendStep>,
    /// Messages received.
    pub recvs: Vec<RecvStep>,
    /// Local ops run after the exchange.
    pub local: Vec<LocalOp>,
}

impl Step {
    /// True when the step moves no message.
    pub fn is_local(&self) -> bool {
        self.sends.is_empty() && self.recvs.is_empty()
    }
}

/// A rank's full schedule for one op.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Length of the work buffer.
    pub buf_len: usize,
    /// Scratch elements needed after the work buffer.
    pub scratch_len: usize,
    /// Elements of the op's separate input, after the scratch (read-only; 0: none).
    pub input_len: usize,
    /// Elements of the op's separate output, after the input (ALGO-5; 0: none).
    pub output_len: usize,
    /// Steps in order. Step numbers (message tags) are indexes into this list and agree
    /// across ranks.
    pub steps: Vec<Step>,
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end && !a.is_empty() && !b.is_empty()
}

impl Schedule {
    /// Checks the per-rank parts of ALGO-1 and ALGO-2 and that every range lies inside the
    /// virtual array. Returns a description of the first violation.
    pub fn validate(&self, rank: usize, world: usize) -> Result<(), String> {
        for (i, s) in self.steps.iter().enumerate() {
            for x in &s.sends {
                if x.peer >= world || x.peer == rank {
                    return Err(format!("step {i}: bad send {x:?}"));
                }
            }
            for x in &s.recvs {
                if x.peer >= world || x.peer == rank {
                    return Err(format!("step {i}: bad recv {x:?}"));
                }
            }
            for (a, x) in s.sends.iter().enumerate() {
                if s.sends[a + 1..].iter().any(|y| y.peer == x.peer) {
                    return Err(format!("step {i}: two sends to rank {}", x.peer));
                }
            }
            for (a, x) in s.recvs.iter().enumerate() {
                if s.recvs[a + 1..].iter().any(|y| y.peer == x.peer) {
                    return Err(format!("step {i}: two recvs from rank {}", x.peer));
                }
            }
            check_step_ranges(s, self.regions()).map_err(|e| format!("step {i}: {e}"))?;
            for l in &s.local {
                let (LocalOp::Copy { src, dst } | LocalOp::Reduce { src, dst }) = l;
                let (end, read_end, out_end) = self.regions();
                let dst_ok = dst.end <= end
                    || (matches!(l, LocalOp::Copy { .. })
                        && dst.start >= read_end
                        && dst.end <= out_end);
                if src.len() != dst.len() || overlaps(src, dst) || src.end > read_end || !dst_ok {
                    return Err(format!("step {i}: bad local op {l:?}"));
                }
            }
        }
        Ok(())
    }

    /// Ends of the writable part (work buffer and scratch), of the read-only input and of
    /// the output, in the virtual array.
    pub(crate) fn regions(&self) -> (usize, usize, usize) {
        let end = self.buf_len + self.scratch_len;
        let read_end = end + self.input_len;
        (end, read_end, read_end + self.output_len)
    }

    pub(crate) fn push(&mut self, step: Step) {
        self.steps.push(step);
    }
}

/// A reduce-scatter schedule (`rs`, any algorithm) for an out-of-place reduce-scatter whose
/// `n`-element result slot `rank` goes to the output region: where the last step receives
/// that slot's final reduction (ring, hierarchical), the receive writes `own (op) incoming`
/// into the output instead of back into the slot (ALGO-5; the same operands in the same
/// order, so bitwise the same result, with one pass over the slot less); otherwise (direct
/// folds, world 1) a local copy of the slot into the output ends the schedule. The wire
/// traffic is `rs`'s, so ranks may mix the two forms in one op.
pub fn reduce_scatter_into(mut rs: Schedule, rank: usize, n: usize) -> Schedule {
    let own = rank * n..(rank + 1) * n;
    let (_, read_end, _) = rs.regions();
    let out = read_end..read_end + n;
    rs.output_len = n;
    let copy = LocalOp::Copy { src: own.clone(), dst: out.clone() };
    let Some(last) = rs.steps.last_mut() else {
        rs.push(Step { local: vec![copy], ..Step::default() });
        return rs;
    };
    let final_recv = last
        .recvs
        .iter_mut()
        .filter(|_| n > 0)
        .find(|r| r.range == own && r.action == Action::Reduce);
    match final_recv {
        Some(recv) if last.local.is_empty() => recv.out = Some(out),
        // After the step's own local ops (a direct fold), so the step count stays `rs`'s.
        _ => last.local.push(copy),
    }
    rs
}

/// The range rules of one step (ALGO-2, ALGO-5, and every range inside its region), given
/// [`Schedule::regions`]: sends read the writable part or the input; a receive writes the
/// writable part, or with `out` reads `range` there or in the input and writes `out` in the
/// writable part or the output; what a step writes is disjoint from everything else it
/// touches. Shared by [`Schedule::validate`] and the executor (EXEC-1, EXEC-3).
pub(crate) fn check_step_ranges(
    step: &Step,
    (end, read_end, out_end): (usize, usize, usize),
) -> Result<(), String> {
    let ordered = |r: &Range<usize>| r.start <= r.end;
    for x in &step.sends {
        if !ordered(&x.range) || x.range.end > read_end {
            return Err(format!("bad send {x:?}"));
        }
    }
    for x in &step.recvs {
        let placed = match &x.out {
            None => ordered(&x.range) && x.range.end <= end,
            Some(o) => {
                x.action == Action::Reduce
                    && ordered(&x.range)
                    && ordered(o)
                    && o.len() == x.range.len()
                    && x.range.end <= read_end
                    && (o.end <= end || (o.start >= read_end && o.end <= out_end))
            }
        };
        if !placed {
            return Err(format!("bad recv {x:?} (a receive may not write the read-only input)"));
        }
    }
    for (a, x) in step.recvs.iter().enumerate() {
        let w = x.written();
        if step.recvs[a + 1..].iter().any(|y| overlaps(w, y.written()))
            || step.sends.iter().any(|y| overlaps(w, &y.range))
            || step.recvs.iter().any(|y| y.out.is_some() && overlaps(w, &y.range))
        {
            return Err(format!("recv {x:?} overlaps"));
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod sim;
