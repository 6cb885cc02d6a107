//! Hybrid transport: shared memory to the ranks of this node, TCP to the ranks of other nodes.
//!
//! The [`Topology`] says which ranks share a node. The intra-node part is a transport over
//! the node's ranks only (local indices `0..local_world`, see TOPO-2); the inter-node part is
//! a transport over the whole world, of which only links to other nodes carry traffic.
//!
//! Invariants, besides the transport's TR-1..TR-5:
//! - HYB-1: a message to or from a rank of this node travels over the intra-node part, any
//!   other over the inter-node part; errors name global ranks whichever part raised them.
//! - HYB-2: an exchange that mixes peers of both kinds (a flat ring across nodes) progresses
//!   both parts concurrently, so no wait of one part can block the other's progress (no
//!   deadlock between ranks that see the two parts in different orders). A failure of one
//!   part cancels the other at once, and the failure, not the cancellation, is reported.
//! - HYB-3: bytes received over the inter-node part of a mixed exchange reach their sink
//!   only after the whole exchange succeeded, in one piece at offset 0 (TR-2 holds: the
//!   staging buffers are 4-byte aligned).
//! - HYB-4: every send adds its payload bytes to this process's count of the part it travels
//!   over ([`sent_bytes`]: inside the node, across nodes) as the exchange hands it over, so
//!   the traffic of each kind of link is measured where it is routed, not derived. Sends
//!   across nodes on a lane named `gather` or `KIND:gather` (the parameter gathers, in a
//!   sub-group or not) are also counted apart ([`sent_gather_bytes_across`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::shm::ShmTransport;
use super::tcp::{TcpOptions, TcpTransport};
use super::{LaneLinks, Poison, RecvOp, SendOp, Sink, Tag, Transport, TransportError};
use crate::store::Store;
use crate::topology::Topology;

/// How often the helper of a mixed exchange looks at the caller's cancel flag.
const CANCEL_POLL: Duration = Duration::from_millis(1);

/// Payload bytes this process's hybrid transports handed to their parts (HYB-4).
static SENT_INTRA: AtomicU64 = AtomicU64::new(0);
static SENT_INTER: AtomicU64 = AtomicU64::new(0);
static SENT_INTER_GATHER: AtomicU64 = AtomicU64::new(0);

/// Payload bytes every hybrid transport of this process has sent so far: (inside the node,
/// across nodes) (HYB-4). A launched worker runs one rank: its own.
pub fn sent_bytes() -> (u64, u64) {
    (SENT_INTRA.load(Ordering::Relaxed), SENT_INTER.load(Ordering::Relaxed))
}

/// Payload bytes every hybrid transport of this process has sent across nodes on gather
/// lanes (`gather`, `KIND:gather`) so far: a part of [`sent_bytes`]'s second figure (HYB-4).
pub fn sent_gather_bytes_across() -> u64 {
    SENT_INTER_GATHER.load(Ordering::Relaxed)
}

/// Whether a lane carries parameter gathers: `gather`, or a sub-group's `KIND:gather`.
fn is_gather_lane(lane: &str) -> bool {
    lane.rsplit(':').next() == Some("gather")
}

/// Which part carries the traffic with a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// Same node: index among the node's ranks.
    Intra(usize),
    /// Another node: global rank.
    Inter,
}

/// The hybrid transport (see the module docs).
pub struct HybridTransport {
    rank: usize,
    world: usize,
    routes: Arc<Vec<Route>>,
    /// Global rank of each local index of this node.
    node_ranks: Arc<Vec<usize>>,
    intra: Option<Arc<dyn Transport>>,
    inter: Option<Arc<dyn Transport>>,
}

impl HybridTransport {
    /// Shared memory inside the node (store keys and segment names under `"{job}-n{node}"`)
    /// and TCP across nodes with `tcp` (its job is set to `job`). Parts that would have no
    /// peer are not created: one node has no TCP links, a node of one rank no shm links.
    pub fn new(
        rank: usize,
        topology: &Topology,
        store: Arc<dyn Store>,
        job: &str,
        mut tcp: TcpOptions,
    ) -> Result<Self, TransportError> {
        let world = topology.world();
        if rank >= world {
            return Err(TransportError::Setup(format!("rank {rank} out of world {world}")));
        }
        let node = topology.node_of(rank);
        let intra: Option<Arc<dyn Transport>> = if topology.local_world(rank) > 1 {
            Some(Arc::new(ShmTransport::new(
                topology.local_rank(rank),
                topology.local_world(rank),
                Arc::clone(&store),
                &format!("{job}-n{node}"),
            )?))
        } else {
            None
        };
        let inter: Option<Arc<dyn Transport>> = if topology.nodes() > 1 {
            tcp.job(job);
            Some(Arc::new(TcpTransport::new(rank, world, store, tcp)?))
        } else {
            None
        };
        Self::from_parts(rank, topology, intra, inter)
    }

    /// Builds the hybrid from its parts: `intra` over this node's ranks (rank = local rank,
    /// world = local world), `inter` over the whole world. A part may be `None` only when no
    /// peer would use it.
    pub fn from_parts(
        rank: usize,
        topology: &Topology,
        intra: Option<Arc<dyn Transport>>,
        inter: Option<Arc<dyn Transport>>,
    ) -> Result<Self, TransportError> {
        let world = topology.world();
        if rank >= world {
            return Err(TransportError::Setup(format!("rank {rank} out of world {world}")));
        }
        let node = topology.node_of(rank);
        let node_ranks: Vec<usize> = topology.ranks_on_node(node).to_vec();
        let routes: Vec<Route> = (0..world)
            .map(|p| match node_ranks.iter().position(|&q| q == p) {
                Some(i) => Route::Intra(i),
                None => Route::Inter,
            })
            .collect();
        let bad = |what: String| Err(TransportError::Setup(what));
        match &intra {
            Some(t) if t.world() != node_ranks.len() || t.rank() != topology.local_rank(rank) => {
                return bad(format!(
                    "intra-node part is rank {} of {}, expected {} of {}",
                    t.rank(),
                    t.world(),
                    topology.local_rank(rank),
                    node_ranks.len()
                ));
            }
            None if node_ranks.len() > 1 => {
                return bad("no intra-node part for a shared node".into())
            }
            _ => {}
        }
        match &inter {
            Some(t) if t.world() != world || t.rank() != rank => {
                return bad(format!(
                    "inter-node part is rank {} of {}, expected {rank} of {world}",
                    t.rank(),
                    t.world()
                ));
            }
            None if topology.nodes() > 1 => {
                return bad("no inter-node part for several nodes".into())
            }
            _ => {}
        }
        Ok(HybridTransport {
            rank,
            world,
            routes: Arc::new(routes),
            node_ranks: Arc::new(node_ranks),
            intra,
            inter,
        })
    }
}

impl Transport for HybridTransport {
    fn name(&self) -> &'static str {
        "hybrid"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn open_lane(
        &self,
        lane: &str,
        deadline: Instant,
    ) -> Result<Box<dyn LaneLinks>, TransportError> {
        // Every rank opens the parts in the same order (intra first), and the intra part only
        // waits for ranks of the same node, so opening never waits in a cycle.
        let node_ranks = Arc::clone(&self.node_ranks);
        let intra = match &self.intra {
            Some(t) => Some(t.open_lane(lane, deadline).map_err(|e| to_global(e, &node_ranks))?),
            None => None,
        };
        let inter = match &self.inter {
            Some(t) => Some(t.open_lane(lane, deadline)?),
            None => None,
        };
        Ok(Box::new(HybridLinks {
            routes: Arc::clone(&self.routes),
            node_ranks,
            intra,
            inter,
            gather: is_gather_lane(lane),
        }))
    }
}

/// Rewrites the peer of an intra-node error from local index to global rank (HYB-1).
fn to_global(e: TransportError, node_ranks: &[usize]) -> TransportError {
    let g = |p: usize| node_ranks.get(p).copied().unwrap_or(p);
    match e {
        TransportError::Timeout { peer } => TransportError::Timeout { peer: g(peer) },
        TransportError::PeerLost { peer, detail } => {
            TransportError::PeerLost { peer: g(peer), detail }
        }
        TransportError::TagMismatch { peer, expected, got } => {
            TransportError::TagMismatch { peer: g(peer), expected, got }
        }
        TransportError::LengthMismatch { peer, expected, got } => {
            TransportError::LengthMismatch { peer: g(peer), expected, got }
        }
        TransportError::Corrupt { peer, detail } => {
            TransportError::Corrupt { peer: g(peer), detail }
        }
        TransportError::Io { peer, detail } => TransportError::Io { peer: g(peer), detail },
        other => other,
    }
}

/// The more informative of two outcomes of a mixed exchange (HYB-2): a real failure beats
/// a cancellation, which is what a failure of the other part causes.
fn first_failure(
    a: Result<(), TransportError>,
    b: Result<(), TransportError>,
) -> Result<(), TransportError> {
    match (a, b) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(TransportError::Cancelled), Err(e)) | (Err(e), _) | (Ok(()), Err(e)) => Err(e),
    }
}

struct HybridLinks {
    routes: Arc<Vec<Route>>,
    node_ranks: Arc<Vec<usize>>,
    intra: Option<Box<dyn LaneLinks>>,
    inter: Option<Box<dyn LaneLinks>>,
    /// A gather lane: its sends across nodes are also counted apart (HYB-4).
    gather: bool,
}

fn no_part(peer: usize) -> TransportError {
    TransportError::Setup(format!("no link to rank {peer}"))
}

/// One receive from another node in a mixed step: (peer, len, its destination when it is
/// a plain copy, else a staging buffer).
type InterPart<'a> = (usize, usize, Option<&'a mut [u8]>, Vec<u32>);

impl LaneLinks for HybridLinks {
    fn staging_bytes(&self) -> usize {
        [&self.intra, &self.inter]
            .iter()
            .filter_map(|l| l.as_ref())
            .map(|l| l.staging_bytes())
            .sum()
    }

    fn exchange(
        &mut self,
        tag: Tag,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError> {
        let route = |p: usize| self.routes.get(p).copied().ok_or_else(|| no_part(p));
        let mut intra_sends = Vec::new();
        let mut inter_sends = Vec::new();
        for s in sends {
            match route(s.peer)? {
                Route::Intra(i) => {
                    intra_sends.push(SendOp { peer: i, data: s.data, copied: s.copied })
                }
                Route::Inter => {
                    inter_sends.push(SendOp { peer: s.peer, data: s.data, copied: s.copied })
                }
            }
        }
        let mut intra_recvs = Vec::new();
        let mut inter_recvs = Vec::new();
        for r in recvs.iter_mut() {
            match route(r.peer)? {
                Route::Intra(i) => {
                    intra_recvs.push(RecvOp { peer: i, len: r.len, sink: r.sink.reborrow() })
                }
                Route::Inter => inter_recvs.push(r),
            }
        }
        let bytes = |v: &[SendOp<'_>]| v.iter().map(|s| s.data.len() as u64).sum::<u64>();
        SENT_INTRA.fetch_add(bytes(&intra_sends), Ordering::Relaxed);
        SENT_INTER.fetch_add(bytes(&inter_sends), Ordering::Relaxed);
        if self.gather {
            SENT_INTER_GATHER.fetch_add(bytes(&inter_sends), Ordering::Relaxed);
        }
        let uses_intra = !intra_sends.is_empty() || !intra_recvs.is_empty();
        let uses_inter = !inter_sends.is_empty() || !inter_recvs.is_empty();
        let node_ranks = Arc::clone(&self.node_ranks);
        let first_remote = inter_sends
            .first()
            .map(|s| s.peer)
            .or_else(|| inter_recvs.first().map(|r| r.peer))
            .unwrap_or(0);
        if uses_intra && !uses_inter {
            let links = self.intra.as_mut().ok_or_else(|| no_part(node_ranks[0]))?;
            return links
                .exchange(tag, &intra_sends, &mut intra_recvs, deadline, cancel)
                .map_err(|e| to_global(e, &node_ranks));
        }
        if !uses_intra {
            if !uses_inter {
                return Ok(());
            }
            let links = self.inter.as_mut().ok_or_else(|| no_part(first_remote))?;
            let mut rs: Vec<RecvOp<'_>> = inter_recvs
                .into_iter()
                .map(|r| RecvOp { peer: r.peer, len: r.len, sink: r.sink.reborrow() })
                .collect();
            return links.exchange(tag, &inter_sends, &mut rs, deadline, cancel);
        }
        // HYB-2: mixed step. The inter part runs on a scoped thread into staging buffers
        // (the caller's sinks need not be Send); the intra part runs here with the real sinks.
        let intra = self.intra.as_mut().ok_or_else(|| no_part(node_ranks[0]))?;
        let inter = self.inter.as_mut().ok_or_else(|| no_part(first_remote))?;
        // Copy receives from other nodes land in their destination straight from the inter
        // transport (TR-6); reductions are staged here and handed to their sinks at the end.
        let mut inter_parts: Vec<InterPart<'_>> = Vec::new();
        let mut staged_sinks = Vec::new();
        for r in inter_recvs {
            match std::mem::replace(&mut r.sink, Sink::Copy(&mut [])) {
                Sink::Copy(dst) => inter_parts.push((r.peer, r.len, Some(dst), Vec::new())),
                Sink::Fn(f) => {
                    inter_parts.push((r.peer, r.len, None, vec![0u32; r.len.div_ceil(4)]));
                    staged_sinks.push(f);
                }
            }
        }
        let stop = AtomicBool::new(false);
        let finished = AtomicBool::new(false);
        let (intra_res, inter_res) = std::thread::scope(|s| {
            let (stop, finished) = (&stop, &finished);
            let watcher = s.spawn(move || {
                while !finished.load(Ordering::Acquire) {
                    if cancel.load(Ordering::Relaxed) {
                        stop.store(true, Ordering::Release);
                        break;
                    }
                    std::thread::park_timeout(CANCEL_POLL);
                }
            });
            let inter_parts = &mut inter_parts;
            let inter_sends = &inter_sends;
            let remote = s.spawn(move || {
                let mut rs: Vec<RecvOp<'_>> = inter_parts
                    .iter_mut()
                    .map(|(peer, len, dst, buf)| {
                        let sink = match dst {
                            Some(d) => Sink::Copy(d),
                            None => Sink::Copy(
                                &mut bytemuck::cast_slice_mut::<u32, u8>(buf.as_mut_slice())
                                    [..*len],
                            ),
                        };
                        RecvOp { peer: *peer, len: *len, sink }
                    })
                    .collect();
                let r = inter.exchange(tag, inter_sends, &mut rs, deadline, stop);
                if r.is_err() {
                    stop.store(true, Ordering::Release);
                }
                r
            });
            let local = intra
                .exchange(tag, &intra_sends, &mut intra_recvs, deadline, stop)
                .map_err(|e| to_global(e, &node_ranks));
            if local.is_err() {
                stop.store(true, Ordering::Release);
            }
            let remote = remote.join().unwrap_or_else(|_| {
                Err(TransportError::Setup("inter-node exchange panicked".into()))
            });
            finished.store(true, Ordering::Release);
            watcher.thread().unpark();
            let _ = watcher.join();
            (local, remote)
        });
        if cancel.load(Ordering::Relaxed) && (intra_res.is_err() || inter_res.is_err()) {
            return Err(TransportError::Cancelled);
        }
        first_failure(intra_res, inter_res)?;
        let staged = inter_parts.iter().filter(|(_, _, dst, _)| dst.is_none());
        for (f, (_, len, _, buf)) in staged_sinks.into_iter().zip(staged) {
            let bytes: &[u8] = bytemuck::cast_slice(buf.as_slice());
            f(0, &bytes[..*len]);
        }
        Ok(())
    }

    fn poison(&mut self, poison: &Poison) {
        if let Some(l) = self.intra.as_mut() {
            l.poison(poison);
        }
        if let Some(l) = self.inter.as_mut() {
            l.poison(poison);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HYB-2: the failure of one part, not the cancellation it causes in the other, is
    /// reported.
    #[test]
    fn failure_beats_the_cancellation_it_caused() {
        let lost = || TransportError::PeerLost { peer: 3, detail: "eof".into() };
        assert_eq!(first_failure(Err(TransportError::Cancelled), Err(lost())), Err(lost()));
        assert_eq!(first_failure(Err(lost()), Err(TransportError::Cancelled)), Err(lost()));
        assert_eq!(first_failure(Ok(()), Err(lost())), Err(lost()));
        assert_eq!(first_failure(Ok(()), Ok(())), Ok(()));
    }

    /// HYB-1: intra-node errors name global ranks.
    #[test]
    fn intra_errors_name_global_ranks() {
        let e = to_global(TransportError::Timeout { peer: 1 }, &[4, 6, 9]);
        assert_eq!(e, TransportError::Timeout { peer: 6 });
        let e = to_global(TransportError::Io { peer: 2, detail: "x".into() }, &[4, 6, 9]);
        assert_eq!(e, TransportError::Io { peer: 9, detail: "x".into() });
    }
}
