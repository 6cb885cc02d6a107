//! A group of a transport's ranks as a transport of its own: the links of a sub-group
//! communicator ([`crate::Communicator::subgroup`]).
//!
//! A [`GroupTransport`] renumbers ranks (group index `i` is the parent's rank `members[i]`)
//! and opens the parent's lane `"{kind}:{lane}"` for its lane `lane`. The parent's contract
//! stands: every parent rank opens the same parent lanes, so every rank makes the groups of
//! the same kinds; the groups of one kind have disjoint members, and each uses only its
//! members' links of the shared parent lane.
//!
//! - GROUP-1: group index `i` sends to and receives from the parent's rank `members[i]`
//!   only; errors name peers by group index where the peer is a member (a non-member, such
//!   as the origin of a poison from another group of the kind, keeps its parent rank).
//! - GROUP-2: groups of one kind with disjoint members share the parent's lane without
//!   mixing their traffic: a parent link joins two members of one group only, and TR-1
//!   holds per link.
//! - GROUP-3: a failing member poisons every parent peer of the lane (the parent's
//!   `poison`), so the other groups of the kind fail with it rather than wait: a job stops
//!   as a whole.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use super::{LaneLinks, Poison, RecvOp, SendOp, Tag, Transport, TransportError};

/// The ranks `members` of `parent`, renumbered `0..members.len()` (GROUP-1).
pub struct GroupTransport {
    parent: Arc<dyn Transport>,
    kind: String,
    members: Arc<[usize]>,
    index: usize,
}

impl GroupTransport {
    /// The group `members` (parent ranks, distinct, including the parent's own rank) of
    /// kind `kind`. Fails on an empty group, a rank out of range or listed twice, or a group
    /// without this rank.
    pub fn new(
        parent: Arc<dyn Transport>,
        kind: &str,
        members: &[usize],
    ) -> Result<Self, TransportError> {
        let world = parent.world();
        let bad = |why: String| Err(TransportError::Setup(format!("group {kind:?}: {why}")));
        if kind.is_empty() || kind.contains(':') {
            return bad("a kind is a non-empty name without ':'".into());
        }
        if let Some(&r) = members.iter().find(|&&r| r >= world) {
            return bad(format!("rank {r} is outside the parent's {world} ranks"));
        }
        let mut sorted = members.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return bad(format!("members {members:?} list a rank twice"));
        }
        let Some(index) = members.iter().position(|&r| r == parent.rank()) else {
            return bad(format!("members {members:?} do not include rank {}", parent.rank()));
        };
        Ok(GroupTransport { parent, kind: kind.to_string(), members: members.into(), index })
    }

    /// The parent's rank of each group index.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// The parent's lane that carries this group's lane `lane`.
    pub fn parent_lane(kind: &str, lane: &str) -> String {
        format!("{kind}:{lane}")
    }
}

impl Transport for GroupTransport {
    fn name(&self) -> &'static str {
        self.parent.name()
    }

    fn rank(&self) -> usize {
        self.index
    }

    fn world(&self) -> usize {
        self.members.len()
    }

    fn open_lane(
        &self,
        lane: &str,
        deadline: Instant,
    ) -> Result<Box<dyn LaneLinks>, TransportError> {
        let inner = self.parent.open_lane(&Self::parent_lane(&self.kind, lane), deadline)?;
        Ok(Box::new(GroupLinks { inner, members: Arc::clone(&self.members) }))
    }
}

/// A group's links: the parent's links of its members, renumbered.
struct GroupLinks {
    inner: Box<dyn LaneLinks>,
    members: Arc<[usize]>,
}

impl GroupLinks {
    /// The group index of parent rank `p`, or `p` itself for a non-member (GROUP-1).
    fn index_of(&self, p: usize) -> usize {
        self.members.iter().position(|&r| r == p).unwrap_or(p)
    }

    fn renumber(&self, e: TransportError) -> TransportError {
        use TransportError as E;
        match e {
            E::Timeout { peer } => E::Timeout { peer: self.index_of(peer) },
            E::PeerLost { peer, detail } => E::PeerLost { peer: self.index_of(peer), detail },
            E::TagMismatch { peer, expected, got } => {
                E::TagMismatch { peer: self.index_of(peer), expected, got }
            }
            E::LengthMismatch { peer, expected, got } => {
                E::LengthMismatch { peer: self.index_of(peer), expected, got }
            }
            E::Poisoned(p) => E::Poisoned(Poison { origin: self.index_of(p.origin), ..p }),
            E::Corrupt { peer, detail } => E::Corrupt { peer: self.index_of(peer), detail },
            E::Io { peer, detail } => E::Io { peer: self.index_of(peer), detail },
            other => other,
        }
    }
}

impl LaneLinks for GroupLinks {
    fn exchange(
        &mut self,
        tag: Tag,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError> {
        let members = Arc::clone(&self.members);
        let sends: Vec<SendOp<'_>> = sends
            .iter()
            .map(|s| SendOp { peer: members[s.peer], data: s.data, copied: s.copied })
            .collect();
        let mut recvs: Vec<RecvOp<'_>> = recvs
            .iter_mut()
            .map(|r| RecvOp { peer: members[r.peer], len: r.len, sink: r.sink.reborrow() })
            .collect();
        self.inner.exchange(tag, &sends, &mut recvs, deadline, cancel).map_err(|e| self.renumber(e))
    }

    fn poison(&mut self, poison: &Poison) {
        // GROUP-3: the origin as the parent knows it.
        let origin = self.members.get(poison.origin).copied().unwrap_or(poison.origin);
        self.inner.poison(&Poison { origin, reason: poison.reason.clone() });
    }

    fn prefers_direct_gather(&self) -> bool {
        self.inner.prefers_direct_gather()
    }

    fn prefers_pieced_gather(&self) -> bool {
        self.inner.prefers_pieced_gather()
    }

    fn staging_bytes(&self) -> usize {
        self.inner.staging_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::local::{LocalFabric, LocalTransport};
    use std::time::Duration;

    fn parent(world: usize, rank: usize) -> Arc<dyn Transport> {
        Arc::new(LocalTransport::new(LocalFabric::new(world), rank, Duration::ZERO))
    }

    /// GROUP-1: a group is its members renumbered; a bad member list is refused.
    #[test]
    fn members_are_renumbered_and_checked_group_1() {
        let g = GroupTransport::new(parent(4, 3), "shard", &[1, 3]).unwrap();
        assert_eq!((g.rank(), g.world(), g.members()), (1, 2, &[1usize, 3][..]));
        for (members, why) in [
            (&[][..], "do not include"),
            (&[0, 1][..], "do not include rank 3"),
            (&[3, 4][..], "outside"),
            (&[3, 3][..], "twice"),
        ] {
            let e = GroupTransport::new(parent(4, 3), "shard", members).err().unwrap();
            assert!(e.to_string().contains(why), "{members:?}: {e}");
        }
        assert!(GroupTransport::new(parent(4, 3), "a:b", &[3]).is_err());
    }
}
