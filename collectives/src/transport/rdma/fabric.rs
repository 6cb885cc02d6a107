//! The RDMA transport over a simulated fabric, in process: everything the verbs shim does
//! except the verbs calls. Each lane's links run the same protocol ([`super::proto`]), the
//! same work-request mapping, slot layout and send-queue accounting ([`super::wr`]) and the
//! same exchange loop as `verbs.rs`; where the shim would call `ibv_post_send` and
//! `ibv_poll_cq`, a [`Fabric`] places the bytes in the peer's ring and queues the work
//! completions. So the collectives conformance grid runs over the RDMA protocol on every
//! build, with what real fabrics do to it:
//! - receive completions **reordered** within a seeded window (the protocol must deliver in
//!   order anyway, RDMA-2);
//! - a write **lost** on a chosen link (no completion on either side: the deadline must end
//!   the wait, RDMA-4);
//! - a write **completing with an error** status (the link fails with `Io`, RDMA-4);
//! - an endpoint **closed** (the peer is reported lost, TR-4, as an async QP event would).
//!
//! Connection data goes through the store as on hardware: rank 0 of each lane opening creates
//! the fabric and publishes its name; the others look it up.
//!
//! Path to GPU-direct: the rings and staging buffers are the only memory the NIC touches.
//! With GPU memory registered (`ibv_reg_dmabuf_mr` on a CUDA allocation exported as a
//! dma-buf, or nvidia-peermem) the same [`super::wr::SlotLayout`] addresses device memory;
//! the protocol and this loop stay as they are, and the sink becomes a device copy.
//!
//! Invariants:
//! - FAB-1: the sender's write completions arrive in posting order (as a reliable-connected
//!   queue pair gives them); the receiver's may arrive in any order within the window.
//! - FAB-2: a write's bytes are in the receiver's ring before its completion is queued, and
//!   a write outside the ring completes with a remote access error instead of landing.

use super::proto::{LinkProto, ProtoConfig, Transmit};
use super::wr::{imm_from_wire, wc_status_name, write_wr, SendQueue, SlotLayout, WrId, WrKind};
use crate::store::Store;
use crate::transport::{LaneLinks, Poison, RecvOp, SendOp, Tag, Transport, TransportError};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

/// `ibv_wc_status` values the fabric reports.
const WC_REM_ACCESS_ERR: u32 = 10;
const WC_RETRY_EXC_ERR: u32 = 12;

/// A fault on one directed link: the `nth` write (from 0) from `from` to `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkFault {
    /// Writing rank.
    pub from: usize,
    /// Receiving rank.
    pub to: usize,
    /// Which write.
    pub nth: u64,
}

/// How the simulated fabric behaves.
#[derive(Clone, Debug)]
pub struct FabricOptions {
    /// Seeds the reordering.
    pub seed: u64,
    /// Receive completions may overtake up to this many earlier ones (0: in order).
    pub reorder: usize,
    /// A write that vanishes: no completion on either side.
    pub lose: Option<LinkFault>,
    /// A write that completes with an error status at the sender.
    pub fail: Option<LinkFault>,
    /// Bytes per ring slot.
    pub slot_bytes: usize,
    /// Slots per ring.
    pub slots: u32,
    /// Work requests a send queue holds.
    pub sq_depth: usize,
}

impl Default for FabricOptions {
    fn default() -> Self {
        FabricOptions {
            seed: 1,
            reorder: 4,
            lose: None,
            fail: None,
            slot_bytes: 64 << 10,
            slots: 16,
            sq_depth: 64,
        }
    }
}

/// A work completion as `ibv_poll_cq` returns it.
#[derive(Clone, Debug)]
struct Wc {
    wr_id: u64,
    status: u32,
    byte_len: u32,
    imm_wire: u32,
}

/// The fabric of one lane opening: every rank's receive rings and completion queue.
pub struct Fabric {
    world: usize,
    opts: FabricOptions,
    /// Ring of the link (to, from) at `to * world + from`.
    rings: Vec<Mutex<Vec<u8>>>,
    cqs: Vec<Mutex<VecDeque<Wc>>>,
    /// Writes posted per directed link (from, to), at `from * world + to`.
    posted: Vec<AtomicU64>,
    closed: Vec<AtomicBool>,
    rng: Mutex<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

static FABRICS: Mutex<Option<HashMap<String, Weak<Fabric>>>> = Mutex::new(None);
static NEXT_FABRIC: AtomicU64 = AtomicU64::new(0);

impl Fabric {
    fn new(world: usize, opts: FabricOptions) -> Self {
        let layout = SlotLayout::new(proto_config(&opts));
        Fabric {
            world,
            rings: (0..world * world).map(|_| Mutex::new(vec![0; layout.ring_bytes()])).collect(),
            cqs: (0..world).map(|_| Mutex::new(VecDeque::new())).collect(),
            posted: (0..world * world).map(|_| AtomicU64::new(0)).collect(),
            closed: (0..world).map(|_| AtomicBool::new(false)).collect(),
            rng: Mutex::new(opts.seed),
            opts,
        }
    }

    fn random(&self, bound: usize) -> usize {
        let mut s = lock(&self.rng);
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % (bound as u64 + 1)) as usize
    }

    /// Carries out one RDMA write with immediate from `from` to `to` (FAB-1, FAB-2).
    fn write(&self, from: usize, to: usize, wr: &super::wr::WriteWr, bytes: &[u8]) {
        let nth = self.posted[from * self.world + to].fetch_add(1, Ordering::Relaxed);
        let here = LinkFault { from, to, nth };
        let done = |status| Wc { wr_id: wr.wr_id, status, byte_len: 0, imm_wire: 0 };
        if self.opts.lose == Some(here) {
            return;
        }
        if self.opts.fail == Some(here) || self.closed[to].load(Ordering::Relaxed) {
            lock(&self.cqs[from]).push_back(done(WC_RETRY_EXC_ERR));
            return;
        }
        let ring_id = wr.rkey as usize;
        let off = wr.remote_addr as usize;
        if ring_id != to * self.world + from {
            lock(&self.cqs[from]).push_back(done(WC_REM_ACCESS_ERR));
            return;
        }
        {
            let mut ring = lock(&self.rings[ring_id]);
            let Some(dst) = ring.get_mut(off..off + bytes.len()) else {
                drop(ring);
                lock(&self.cqs[from]).push_back(done(WC_REM_ACCESS_ERR));
                return;
            };
            dst.copy_from_slice(bytes);
        }
        let recv = Wc {
            wr_id: WrId { peer: from, kind: WrKind::Recv, index: 0 }.encode(),
            status: 0,
            byte_len: bytes.len() as u32,
            imm_wire: wr.imm_wire,
        };
        {
            let mut cq = lock(&self.cqs[to]);
            let back = self.random(self.opts.reorder.min(cq.len()));
            let at = cq.len() - back;
            cq.insert(at, recv);
        }
        lock(&self.cqs[from]).push_back(done(0));
    }
}

fn proto_config(opts: &FabricOptions) -> ProtoConfig {
    ProtoConfig::new(opts.slot_bytes, opts.slots).expect("fabric slot sizes")
}

/// One rank's RDMA transport over a simulated fabric.
pub struct FabricTransport {
    rank: usize,
    world: usize,
    store: Arc<dyn Store>,
    opts: FabricOptions,
    opens: Mutex<HashMap<String, u64>>,
}

impl FabricTransport {
    /// Rank `rank` of `world`, meeting its peers through `store`.
    pub fn new(rank: usize, world: usize, store: Arc<dyn Store>, opts: FabricOptions) -> Self {
        FabricTransport { rank, world, store, opts, opens: Mutex::new(HashMap::new()) }
    }
}

impl Transport for FabricTransport {
    fn name(&self) -> &'static str {
        "rdma-sim"
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
        let generation = {
            let mut opens = lock(&self.opens);
            let g = opens.entry(lane.to_owned()).or_insert(0);
            *g += 1;
            *g
        };
        let key = format!("rdma-sim/{lane}/{generation}");
        let setup = |e: String| TransportError::Setup(format!("rdma-sim: {e}"));
        let fabric = if self.rank == 0 {
            let f = Arc::new(Fabric::new(self.world, self.opts.clone()));
            let name =
                format!("{}-{}", std::process::id(), NEXT_FABRIC.fetch_add(1, Ordering::Relaxed));
            lock(&FABRICS)
                .get_or_insert_with(HashMap::new)
                .insert(name.clone(), Arc::downgrade(&f));
            self.store.set(&key, name.as_bytes()).map_err(|e| setup(e.to_string()))?;
            f
        } else {
            let left = deadline.saturating_duration_since(Instant::now());
            let name =
                self.store.get(&key, left).map_err(|_| TransportError::Timeout { peer: 0 })?;
            let name = String::from_utf8_lossy(&name).into_owned();
            lock(&FABRICS)
                .as_ref()
                .and_then(|m| m.get(&name))
                .and_then(Weak::upgrade)
                .ok_or_else(|| setup(format!("no fabric '{name}' in this process")))?
        };
        let cfg = proto_config(&self.opts);
        let layout = SlotLayout::new(cfg);
        let links = (0..self.world)
            .map(|p| {
                (p != self.rank).then(|| Link {
                    peer: p,
                    proto: LinkProto::new(p, cfg),
                    // One staging entry per slot, as the shim sizes it.
                    sq: SendQueue::new(self.opts.sq_depth, cfg.slots()),
                    layout,
                    remote: (0, (p * self.world + self.rank) as u32),
                })
            })
            .collect();
        Ok(Box::new(FabricLinks { rank: self.rank, fabric, links, failed: None }))
    }
}

struct Link {
    peer: usize,
    proto: LinkProto,
    sq: SendQueue,
    layout: SlotLayout,
    /// The peer's ring: base address (0 in the fabric) and key (its ring's index).
    remote: (u64, u32),
}

struct FabricLinks {
    rank: usize,
    fabric: Arc<Fabric>,
    links: Vec<Option<Link>>,
    failed: Option<TransportError>,
}

impl Drop for FabricLinks {
    fn drop(&mut self) {
        // Release: this rank's writes (FAB-2) are visible to whoever sees it closed.
        self.fabric.closed[self.rank].store(true, Ordering::Release);
    }
}

impl FabricLinks {
    fn link(&mut self, p: usize) -> Result<&mut Link, TransportError> {
        self.links
            .get_mut(p)
            .and_then(|l| l.as_mut())
            .ok_or_else(|| TransportError::Setup(format!("rdma-sim: no link to rank {p}")))
    }

    /// Posts what the protocol allows while the send queue has room (WR-3, WR-4).
    fn transmit(&mut self, p: usize) -> Result<bool, TransportError> {
        let (me, fabric) = (self.rank, Arc::clone(&self.fabric));
        let link = self.link(p)?;
        let mut moved = false;
        while link.sq.can_post() {
            let Some(t) = link.proto.poll_transmit() else { break };
            post(link, me, &fabric, t)?;
            moved = true;
        }
        Ok(moved)
    }

    /// Drains this rank's completion queue into the links' protocols.
    fn poll_cq(&mut self) -> Result<bool, TransportError> {
        let wcs: Vec<Wc> = lock(&self.fabric.cqs[self.rank]).drain(..).collect();
        let fabric = Arc::clone(&self.fabric);
        let me = self.rank;
        for wc in &wcs {
            let id = WrId::decode(wc.wr_id).ok_or_else(|| {
                TransportError::Setup(format!("completion of unknown work request {:#x}", wc.wr_id))
            })?;
            let link = self.link(id.peer)?;
            if wc.status != 0 {
                // A failed data write fails the link; a failed credit stops its writes only.
                // Either way the exchange fails only if it needs this peer (RDMA-7).
                link.sq.complete();
                link.proto.handle_write_error(&format!("{} on a write", wc_status_name(wc.status)));
                continue;
            }
            if link.proto.error().is_some() {
                continue;
            }
            match id.kind {
                WrKind::Write => {
                    link.sq.complete();
                    link.proto.handle_write_done();
                }
                WrKind::Recv => {
                    let imm = imm_from_wire(wc.imm_wire);
                    let range = link.layout.incoming(imm, wc.byte_len).map_err(|e| {
                        link.proto.handle_completion_error(&format!(
                            "rank {} wrote out of bounds: {e}",
                            link.peer
                        ))
                    })?;
                    let ring = lock(&fabric.rings[me * fabric.world + id.peer]);
                    link.proto.handle_imm(imm, &ring[range])?;
                }
            }
        }
        Ok(!wcs.is_empty())
    }

    fn deliver(
        &mut self,
        p: usize,
        pending: &mut VecDeque<usize>,
        recvs: &mut [RecvOp<'_>],
    ) -> Result<bool, TransportError> {
        let fabric = Arc::clone(&self.fabric);
        let me = self.rank;
        let link = self.link(p)?;
        let mut moved = false;
        while let Some(d) = link.proto.poll_deliver()? {
            moved = true;
            let idx = *pending.front().ok_or_else(|| {
                TransportError::Setup(format!("a delivery from rank {p} with no receive"))
            })?;
            let off = link
                .layout
                .slot_offset(d.slot)
                .ok_or_else(|| TransportError::Setup("slot".into()))?;
            if !d.range.is_empty() {
                let ring = lock(&fabric.rings[me * fabric.world + p]);
                recvs[idx].sink.put(d.offset, &ring[off + d.range.start..off + d.range.end]);
            }
            if d.done {
                pending.pop_front();
            }
        }
        Ok(moved)
    }
}

/// Posts one transmit: the work request as the shim builds it, carried out by the fabric.
fn post(link: &mut Link, me: usize, fabric: &Fabric, t: Transmit) -> Result<(), TransportError> {
    let poison = matches!(&t, Transmit::Write { slot, .. } if *slot == link.layout.slots());
    let staged = matches!(&t, Transmit::Write { bytes, .. } if !bytes.is_empty()) && !poison;
    let setup = |e: &str| TransportError::Setup(format!("rdma-sim: {e}"));
    let (index, entry) = if poison {
        let i = link.sq.push_unstaged().ok_or_else(|| setup("send queue full"))?;
        (i, Some(link.sq.poison_entry()))
    } else {
        link.sq.push(staged).ok_or_else(|| setup("send queue full"))?
    };
    let id = WrId { peer: link.peer, kind: WrKind::Write, index };
    let wr = write_wr(&t, &link.layout, link.remote, id, entry)
        .map_err(|e| setup(&format!("work request: {e}")))?;
    let bytes: &[u8] = match &t {
        Transmit::Write { bytes, .. } => bytes,
        Transmit::ImmOnly { .. } => &[],
    };
    fabric.write(me, link.peer, &wr, bytes);
    Ok(())
}

impl super::exchange::Shim for FabricLinks {
    fn world(&self) -> usize {
        self.links.len()
    }

    fn proto(&self, p: usize) -> Option<&LinkProto> {
        self.links.get(p)?.as_ref().map(|l| &l.proto)
    }

    fn proto_mut(&mut self, p: usize) -> Result<&mut LinkProto, TransportError> {
        self.link(p).map(|l| &mut l.proto)
    }

    fn deliver(
        &mut self,
        p: usize,
        pending: &mut VecDeque<usize>,
        recvs: &mut [RecvOp<'_>],
    ) -> Result<bool, TransportError> {
        FabricLinks::deliver(self, p, pending, recvs)
    }

    fn transmit(&mut self, p: usize) -> Result<bool, TransportError> {
        FabricLinks::transmit(self, p)
    }

    fn poll_cq(&mut self) -> Result<bool, TransportError> {
        FabricLinks::poll_cq(self)
    }

    fn peer_lost(&self, p: usize) -> Option<TransportError> {
        // TR-4: what an asynchronous queue-pair event reports on hardware.
        self.fabric.closed[p].load(Ordering::Acquire).then(|| TransportError::PeerLost {
            peer: p,
            detail: "its endpoint closed (simulated fabric)".into(),
        })
    }

    fn failed(&mut self) -> &mut Option<TransportError> {
        &mut self.failed
    }
}

impl LaneLinks for FabricLinks {
    fn exchange(
        &mut self,
        tag: Tag,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError> {
        super::exchange::exchange(self, tag, sends, recvs, deadline, cancel, 256)
    }

    fn poison(&mut self, poison: &Poison) {
        let (me, fabric) = (self.rank, Arc::clone(&self.fabric));
        for link in self.links.iter_mut().flatten() {
            link.proto.queue_poison(poison);
            if link.sq.can_post_unstaged() {
                if let Some(t) = link.proto.poll_transmit() {
                    let _ = post(link, me, &fabric, t);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::suite;
    use crate::transport::RecvOp;
    use crate::MemStore;
    use std::time::Duration;

    fn make(rank: usize, world: usize, store: Arc<dyn Store>) -> Box<dyn Transport> {
        // Small slots and rings, so that messages span many chunks and credits.
        let opts = FabricOptions { slot_bytes: 4096, slots: 8, reorder: 6, ..Default::default() };
        Box::new(FabricTransport::new(rank, world, store, opts))
    }

    /// TR-1, TR-2, TR-5 and RDMA-2 over reordered receive completions (FAB-1).
    #[test]
    fn rdma_sim_all_to_all_fab_1() {
        suite::all_to_all(&make, 2);
        suite::all_to_all(&make, 3);
    }

    /// RDMA-5 and the suite's mismatch cases.
    #[test]
    fn rdma_sim_mismatches() {
        suite::mismatches(&make);
    }

    /// TR-3, TR-4, RDMA-6.
    #[test]
    fn rdma_sim_failures() {
        suite::failures(&make);
    }

    fn faulty(world: usize, opts: FabricOptions) -> Vec<Box<dyn Transport>> {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        (0..world)
            .map(|r| {
                Box::new(FabricTransport::new(r, world, store.clone(), opts.clone()))
                    as Box<dyn Transport>
            })
            .collect()
    }

    /// Rank 0 sends `len` bytes to rank 1; returns each side's result.
    fn one_message(
        opts: FabricOptions,
        len: usize,
        wait: Duration,
    ) -> (Result<(), TransportError>, Result<Vec<u8>, TransportError>) {
        let ts = faulty(2, opts);
        let mut it = ts.into_iter();
        let (t0, t1) = (it.next().unwrap(), it.next().unwrap());
        let h = std::thread::spawn(move || {
            let mut l = t0.open_lane("l", Instant::now() + wait).unwrap();
            let data = vec![7u8; len];
            let r = l.exchange(
                suite::tag(0),
                &[SendOp { peer: 1, data: &data, copied: false }],
                &mut [],
                Instant::now() + wait,
                &AtomicBool::new(false),
            );
            std::thread::sleep(Duration::from_millis(100));
            r
        });
        let mut l = t1.open_lane("l", Instant::now() + wait).unwrap();
        let mut buf = vec![0u8; len];
        let r = l
            .exchange(
                suite::tag(0),
                &[],
                &mut [RecvOp { peer: 0, len, sink: crate::transport::Sink::Copy(&mut buf) }],
                Instant::now() + wait,
                &AtomicBool::new(false),
            )
            .map(|_| buf);
        (h.join().unwrap(), r)
    }

    /// RDMA-4: a lost write ends in `Timeout` at the deadline on the side that waits for it,
    /// a write that completes with an error in `Io` naming the status; neither hangs.
    #[test]
    fn lost_and_failed_writes_end_the_wait_rdma_4() {
        let w = Duration::from_millis(300);
        let lose = FabricOptions {
            lose: Some(LinkFault { from: 0, to: 1, nth: 2 }),
            slot_bytes: 1024,
            ..Default::default()
        };
        let (s, r) = one_message(lose, 8000, w);
        assert!(matches!(r, Err(TransportError::Timeout { peer: 0 })), "{r:?}");
        assert!(matches!(s, Err(TransportError::Timeout { peer: 1 })), "sender: {s:?}");
        let fail = FabricOptions {
            fail: Some(LinkFault { from: 0, to: 1, nth: 1 }),
            slot_bytes: 1024,
            ..Default::default()
        };
        let (s, _) = one_message(fail, 8000, w);
        match s {
            Err(TransportError::Io { peer: 1, detail }) => {
                assert!(detail.contains("RETRY_EXC") || detail.contains("12"), "{detail}")
            }
            other => panic!("expected Io from the failed write, got {other:?}"),
        }
        // Without faults the same message arrives whole.
        let (s, r) = one_message(FabricOptions { slot_bytes: 1024, ..Default::default() }, 8000, w);
        assert!(s.is_ok());
        assert_eq!(r.unwrap(), vec![7u8; 8000]);
    }

    /// FAB-2: a work request aimed outside the peer's ring completes with a remote access
    /// error; nothing lands.
    #[test]
    fn a_write_outside_the_ring_is_refused_fab_2() {
        let f = Fabric::new(2, FabricOptions { slot_bytes: 1024, slots: 2, ..Default::default() });
        let wr = super::super::wr::WriteWr {
            wr_id: WrId { peer: 1, kind: WrKind::Write, index: 0 }.encode(),
            remote_addr: 3 * 1024,
            rkey: 2, // ring (1, 0)
            imm_wire: 0,
            local: None,
        };
        f.write(0, 1, &wr, &[1u8; 1024]);
        let wc = lock(&f.cqs[0]).pop_front().unwrap();
        assert_eq!(wc.status, WC_REM_ACCESS_ERR);
        assert!(lock(&f.cqs[1]).is_empty(), "nothing reached the receiver");
        assert!(lock(&f.rings[2]).iter().all(|&b| b == 0));
    }

    /// The core's conformance grid, ranks as threads over the RDMA protocol on the fabric.
    #[test]
    fn rdma_sim_conformance_grid() {
        let group = |w: usize| {
            crate::testing::group_over(w, &|r, store| {
                let opts = FabricOptions { slot_bytes: 16 << 10, slots: 8, ..Default::default() };
                Arc::new(FabricTransport::new(r, w, store, opts))
            })
        };
        crate::testing::conformance_grid(&group, &crate::testing::GridConfig::default());
    }
}
