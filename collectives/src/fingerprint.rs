//! Op fingerprints. Every message carries a [`Tag`] built from the op (lane hash, sequence
//! number, kind, count, root) plus the schedule step, so ranks that issue different ops at
//! the same point of a lane detect it on the first message instead of exchanging wrong data.
//!
//! - FP-1: two ops get equal tags (step aside) only if they agree on lane, seq, kind,
//!   reduction, resolved algorithm, count and root, i.e. only if their schedules agree.
//! - FP-2: a mismatch found on one rank reaches every rank as `Mismatch` naming both ops: the
//!   finder poisons its peers with a reason that [`parse_reason`] turns back into a mismatch.

use crate::algo::Algorithm;
use crate::reduce::ReduceOp;
use crate::transport::Tag;

/// Op kind codes (low byte of `Tag::kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum OpKind {
    /// all_reduce.
    AllReduce = 1,
    /// reduce_scatter.
    ReduceScatter = 2,
    /// all_gather.
    AllGather = 3,
    /// broadcast.
    Broadcast = 4,
    /// barrier.
    Barrier = 5,
    /// all_reduce_records.
    AllReduceRecords = 6,
}

impl OpKind {
    /// Name as in the API.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
            OpKind::AllReduceRecords => "all_reduce_records",
        }
    }

    /// The kind of a code (`None` for an unknown code).
    pub fn from_code(c: u32) -> Option<Self> {
        Some(match c {
            1 => OpKind::AllReduce,
            2 => OpKind::ReduceScatter,
            3 => OpKind::AllGather,
            4 => OpKind::Broadcast,
            5 => OpKind::Barrier,
            6 => OpKind::AllReduceRecords,
            _ => return None,
        })
    }
}

/// FNV-1a hash of a lane name.
pub fn lane_hash(name: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// Builds the tag of step 0 of an op (FP-1). `root` carries the record length for
/// `AllReduceRecords`.
pub fn op_tag(
    lane: u32,
    seq: u64,
    kind: OpKind,
    op: Option<ReduceOp>,
    algo: Algorithm,
    count: usize,
    root: Option<usize>,
) -> Tag {
    let op_code = op.map_or(0xff, |o| o.code());
    Tag {
        lane,
        seq,
        kind: kind as u32 | (op_code << 8) | (algo.code() << 16),
        count: count as u64,
        root: root.map_or(u32::MAX, |r| r as u32),
        step: 0,
    }
}

/// Describes the op a tag belongs to, e.g. `all_reduce(count=100, seq=3, op=sum, algo=ring)`.
pub fn describe(tag: &Tag) -> String {
    let kind = OpKind::from_code(tag.kind & 0xff).map_or("unknown_op", |k| k.name());
    let mut s = format!("{kind}(count={}, seq={}", tag.count, tag.seq);
    if let Some(op) = ReduceOp::from_code((tag.kind >> 8) & 0xff) {
        s.push_str(&format!(", op={}", op.name()));
    }
    if tag.root != u32::MAX {
        let field =
            if tag.kind & 0xff == OpKind::AllReduceRecords as u32 { "record_len" } else { "root" };
        s.push_str(&format!(", {field}={}", tag.root));
    }
    if let Some(a) = Algorithm::from_code((tag.kind >> 16) & 0xff) {
        s.push_str(&format!(", algo={}", a.name()));
    }
    s.push(')');
    s
}

/// Like [`describe`], adding the step when the ops agree and only the steps differ.
pub fn describe_pair(ours: &Tag, theirs: &Tag) -> (String, String) {
    let (a, b) = (describe(ours), describe(theirs));
    if a == b {
        (format!("{a} step {}", ours.step), format!("{b} step {}", theirs.step))
    } else {
        (a, b)
    }
}

/// A failure forwarded to peers through `Poison::reason`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The poisoning rank issued `ours`, rank `peer` issued `theirs`.
    Mismatch {
        /// Disagreeing rank.
        peer: usize,
        /// The poisoning rank's op.
        ours: String,
        /// The peer's op.
        theirs: String,
    },
    /// The poisoning rank timed out waiting for `peer`.
    Timeout {
        /// Rank that did not arrive.
        peer: usize,
    },
    /// The poisoning rank lost `peer`.
    Lost {
        /// Lost rank.
        peer: usize,
        /// What was observed.
        detail: String,
    },
    /// Anything else (abort, transport errors), forwarded as text.
    Other(String),
}

/// Encodes a reason for `Poison::reason` (readable as it stands, parseable by [`parse_reason`]).
pub fn format_reason(r: &Reason) -> String {
    match r {
        Reason::Mismatch { peer, ours, theirs } => format!("mismatch[{peer}]: {ours} | {theirs}"),
        Reason::Timeout { peer } => format!("timeout[{peer}]: timed out waiting for rank {peer}"),
        Reason::Lost { peer, detail } => format!("lost[{peer}]: {detail}"),
        Reason::Other(s) => s.clone(),
    }
}

/// Inverse of [`format_reason`]; unknown text becomes `Other`.
pub fn parse_reason(s: &str) -> Reason {
    let tagged = |prefix: &str| -> Option<(usize, &str)> {
        let rest = s.strip_prefix(prefix)?.strip_prefix('[')?;
        let (num, rest) = rest.split_once("]: ")?;
        Some((num.parse().ok()?, rest))
    };
    if let Some((peer, rest)) = tagged("mismatch") {
        if let Some((ours, theirs)) = rest.split_once(" | ") {
            return Reason::Mismatch { peer, ours: ours.to_string(), theirs: theirs.to_string() };
        }
    }
    if let Some((peer, _)) = tagged("timeout") {
        return Reason::Timeout { peer };
    }
    if let Some((peer, detail)) = tagged("lost") {
        return Reason::Lost { peer, detail: detail.to_string() };
    }
    Reason::Other(s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_names_op_fp_1() {
        let t = op_tag(
            lane_hash("g"),
            3,
            OpKind::AllReduce,
            Some(ReduceOp::Sum),
            Algorithm::Ring,
            100,
            None,
        );
        assert_eq!(describe(&t), "all_reduce(count=100, seq=3, op=sum, algo=ring)");
        let u = op_tag(
            lane_hash("g"),
            3,
            OpKind::AllReduce,
            Some(ReduceOp::Max),
            Algorithm::Ring,
            100,
            None,
        );
        assert_ne!(t, u);
        let b = op_tag(1, 0, OpKind::Broadcast, None, Algorithm::Direct, 4, Some(2));
        assert_eq!(describe(&b), "broadcast(count=4, seq=0, root=2, algo=direct)");
    }

    #[test]
    fn reasons_round_trip_fp_2() {
        for r in [
            Reason::Mismatch {
                peer: 3,
                ours: "all_reduce(count=1, seq=0)".into(),
                theirs: "barrier(count=0, seq=0)".into(),
            },
            Reason::Timeout { peer: 2 },
            Reason::Lost { peer: 1, detail: "endpoint closed".into() },
            Reason::Other("aborted: bye".into()),
        ] {
            assert_eq!(parse_reason(&format_reason(&r)), r);
        }
    }
}
