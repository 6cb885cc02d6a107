//! The verbs shim of the RDMA transport (feature `rdma`), on `sideway` (rdma-core loaded at
//! run time).
//!
//! Per lane and peer: one reliable-connected queue pair on the lane's completion queue,
//! brought up INIT -> RTR -> RTS with the peer's QPN, LID/GID, PSN and MTU read from the
//! store ([`ConnInfo`], [`conn_key`]); a receive ring of `slots + 1` slots registered for
//! remote writes, whose address and rkey the peer learns in the same record; a registered
//! staging buffer from which the writes leave. [`LinkProto`] decides every write
//! (chunks, credits, poison); [`super::wr`] turns each into a work request; the completion
//! loop of `exchange` polls the lane's CQ, feeds send completions to
//! [`LinkProto::handle_write_done`], receive completions (one per write with immediate) to
//! [`LinkProto::handle_imm`], reposts the receive, and hands delivered slot bytes to the
//! sinks. A failed completion fails its link for good (`Io`); the deadline fails the
//! waiting link with `Timeout`; the cancel flag returns `Cancelled` and fails the lane.
//! After both sides reach RTS each publishes a ready key, and no write leaves before the
//! peer's is seen, so a first write never meets a queue pair still in INIT.
//!
//! Sizing: a link receives at most `slots` chunks and `slots` credits it has not yet
//! processed, plus one poison, so `2 * slots + 2` receives stay posted; writes wait for a
//! free staging entry and send-queue slot (WR-4).
//!
//! **Not yet run on hardware.** This machine has no RDMA device: what ran here is device
//! discovery failing with `DeviceUnavailable`, the protocol core under simulation
//! (`proto`), and the work request bookkeeping (`wr`). The bring-up, registration,
//! posting and completion code below has been compiled and reviewed against the verbs
//! semantics, never executed; expect to debug it on the first machine with a NIC
//! (`SHARDLINE_RDMA_DEVICE`, `SHARDLINE_RDMA_GID_INDEX` pick the device and GID).
//! Device buffers (GPUDirect) are not handled: the transport moves host bytes only.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, GenericCompletionQueue, PollCompletionQueueError,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::proto::{LinkProto, ProtoConfig, Transmit};
pub use super::wr::ConnInfo;
use super::wr::{
    conn_key, psn_from, ready_key, wc_status_name, write_wr, SendQueue, SlotLayout, WrId, WrKind,
};
use crate::store::{Store, StoreError};
use crate::transport::{LaneLinks, Poison, RecvOp, SendOp, Tag, Transport, TransportError};

/// The setup error of a host without an RDMA device, with the cause reported by verbs.
pub fn device_unavailable(cause: &str) -> TransportError {
    TransportError::Setup(format!(
        "DeviceUnavailable: no RDMA device (ibv_get_device_list: {cause})"
    ))
}

/// Names of the RDMA devices on this host; `DeviceUnavailable` (as a setup error) when
/// there are none or rdma-core cannot list them (ENOSYS in a container without it).
pub fn devices() -> Result<Vec<String>, TransportError> {
    let list = DeviceList::new().map_err(|e| {
        let cause = match std::error::Error::source(&e) {
            Some(s) => s.to_string(),
            None => e.to_string(),
        };
        device_unavailable(&cause)
    })?;
    let names: Vec<String> = list.iter().map(|d| d.name()).collect();
    if names.is_empty() {
        return Err(device_unavailable("0 devices"));
    }
    Ok(names)
}

fn setup(what: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(format!("rdma: {what}"))
}

/// Settings of the RDMA transport.
#[derive(Clone, Debug)]
pub struct RdmaOptions {
    /// Device name (`mlx5_0`); the first device when `None`.
    pub device: Option<String>,
    /// Physical port, from 1.
    pub port: u8,
    /// GID index; on Ethernet (RoCE) the first RoCE v2 GID when `None`, else 0.
    pub gid_index: Option<u32>,
    /// Bytes of one receive slot (a multiple of 4 above the protocol header).
    pub slot_bytes: usize,
    /// Receive slots per link.
    pub slots: u32,
    /// Job name: namespaces the store keys.
    pub job: String,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            device: std::env::var("SHARDLINE_RDMA_DEVICE").ok().filter(|s| !s.is_empty()),
            port: 1,
            gid_index: std::env::var("SHARDLINE_RDMA_GID_INDEX")
                .ok()
                .and_then(|s| s.trim().parse().ok()),
            slot_bytes: 256 << 10,
            slots: 16,
            job: "default".into(),
        }
    }
}

/// The RDMA transport of one rank.
pub struct RdmaTransport {
    rank: usize,
    world: usize,
    device: String,
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    lid: u16,
    gid: Gid,
    gid_index: u32,
    mtu: Mtu,
    store: Arc<dyn Store>,
    opts: RdmaOptions,
    cfg: ProtoConfig,
    opens: Mutex<HashMap<String, u64>>,
}

fn mtu_code(m: Mtu) -> u8 {
    match m {
        Mtu::Mtu256 => 1,
        Mtu::Mtu512 => 2,
        Mtu::Mtu1024 => 3,
        Mtu::Mtu2048 => 4,
        Mtu::Mtu4096 => 5,
    }
}

fn mtu_of(code: u8) -> Mtu {
    match code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

fn random_seed() -> [u8; 4] {
    use std::io::Read;
    let mut b = [0u8; 4];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        b = (t ^ std::process::id().rotate_left(16)).to_le_bytes();
    }
    b
}

impl RdmaTransport {
    /// Opens the first RDMA device (or `device` by name). On a host without one this is
    /// `Setup("DeviceUnavailable: no RDMA device (...)")`, and the launcher falls back to tcp.
    pub fn open(
        rank: usize,
        world: usize,
        store: Arc<dyn Store>,
        device: Option<&str>,
        timeout: Duration,
    ) -> Result<Self, TransportError> {
        let _ = timeout;
        let mut opts = RdmaOptions::default();
        if let Some(d) = device {
            opts.device = Some(d.to_string());
        }
        Self::with_options(rank, world, store, opts)
    }

    /// Opens the device of `opts`, queries its port and allocates the protection domain.
    pub fn with_options(
        rank: usize,
        world: usize,
        store: Arc<dyn Store>,
        opts: RdmaOptions,
    ) -> Result<Self, TransportError> {
        if rank >= world {
            return Err(setup(format!("rank {rank} out of world {world}")));
        }
        let cfg = ProtoConfig::new(opts.slot_bytes, opts.slots).ok_or_else(|| {
            setup(format!("slots of {} bytes x {} are not usable", opts.slot_bytes, opts.slots))
        })?;
        let names = devices()?;
        let want = match &opts.device {
            Some(want) => names.iter().find(|n| *n == want).cloned().ok_or_else(|| {
                device_unavailable(&format!("no device named {want} in {names:?}"))
            })?,
            None => names[0].clone(),
        };
        let list = DeviceList::new().map_err(|e| device_unavailable(&e.to_string()))?;
        let dev = list
            .iter()
            .find(|d| d.name() == want)
            .ok_or_else(|| device_unavailable(&format!("{want} disappeared")))?;
        let ctx = dev.open().map_err(|e| setup(format!("opening {want}: {e}")))?;
        let port = ctx
            .query_port(opts.port)
            .map_err(|e| setup(format!("{want} port {}: {e}", opts.port)))?;
        let ethernet = matches!(port.link_layer(), LinkLayer::Ethernet);
        let gid_index = match opts.gid_index {
            Some(i) => i,
            None if ethernet => {
                // RoCE v2 is routable; v1 GIDs and empty entries are skipped.
                let v2 = sideway::ibverbs::address::GidType::RoceV2 as u32;
                (0..port.gid_tbl_len().max(0) as u32)
                    .find(|&i| {
                        ctx.query_gid_type(opts.port, i).is_ok_and(|t| t == v2)
                            && ctx.query_gid(opts.port, i).is_ok_and(|g| !g.is_zero())
                    })
                    .unwrap_or(0)
            }
            None => 0,
        };
        let gid = ctx
            .query_gid(opts.port, gid_index)
            .map_err(|e| setup(format!("{want} GID {gid_index}: {e}")))?;
        let pd = ctx.alloc_pd().map_err(|e| setup(format!("{want}: ibv_alloc_pd: {e}")))?;
        Ok(RdmaTransport {
            rank,
            world,
            device: want,
            ctx,
            pd,
            lid: if ethernet { 0 } else { port.lid() },
            gid,
            gid_index,
            mtu: port.active_mtu(),
            store,
            opts,
            cfg,
            opens: Mutex::new(HashMap::new()),
        })
    }

    /// The device in use.
    pub fn device(&self) -> &str {
        &self.device
    }

    fn wait_key(
        &self,
        key: &str,
        peer: usize,
        deadline: Instant,
    ) -> Result<Vec<u8>, TransportError> {
        self.store.get(key, deadline.saturating_duration_since(Instant::now())).map_err(|e| match e
        {
            StoreError::Timeout { .. } => TransportError::Timeout { peer },
            e => setup(format!("store: {e}")),
        })
    }

    /// Creates the link to `peer` up to INIT with its receives posted.
    fn new_link(
        &self,
        peer: usize,
        cq: &Arc<BasicCompletionQueue>,
    ) -> Result<(Link, ConnInfo), TransportError> {
        let layout = SlotLayout::new(self.cfg);
        let slots = self.cfg.slots();
        let recv_depth = 2 * slots + 2;
        let send_depth = slots + 2;
        let g = GenericCompletionQueue::from(Arc::clone(cq));
        let mut qp = self
            .pd
            .create_qp_builder()
            .setup_send_cq(g.clone())
            .setup_recv_cq(g)
            .setup_max_send_wr(send_depth)
            .setup_max_recv_wr(recv_depth)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .build()
            .map_err(|e| setup(format!("ibv_create_qp to rank {peer}: {e}")))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.opts.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        qp.modify(&attr).map_err(|e| setup(format!("QP to rank {peer} -> INIT: {e}")))?;
        let ring = Region::new(layout.ring_bytes())?;
        let staging = Region::new(layout.ring_bytes())?;
        // SAFETY: both regions are live allocations of their length that outlive their
        // registrations (Link drops the memory regions before the buffers).
        let ring_mr = unsafe {
            self.pd.reg_mr(
                ring.ptr as usize,
                ring.len,
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
            )
        }
        .map_err(|e| setup(format!("registering the receive ring: {e}")))?;
        let staging_mr =
            unsafe { self.pd.reg_mr(staging.ptr as usize, staging.len, AccessFlags::LocalWrite) }
                .map_err(|e| setup(format!("registering the staging buffer: {e}")))?;
        let mine = ConnInfo {
            qpn: qp.qp_number(),
            lid: self.lid,
            gid: self.gid.raw,
            psn: psn_from(random_seed()),
            addr: ring.ptr as u64,
            rkey: ring_mr.rkey(),
            mtu: mtu_code(self.mtu),
        };
        let mut link = Link {
            peer,
            qp,
            _ring_mr: ring_mr,
            staging_mr,
            ring,
            staging,
            proto: LinkProto::new(peer, self.cfg),
            sq: SendQueue::new(send_depth as usize, slots),
            remote: (0, 0),
            layout,
        };
        for _ in 0..recv_depth {
            link.post_recv()?;
        }
        Ok((link, mine))
    }

    /// INIT -> RTR -> RTS towards the peer's published end.
    fn connect(
        &self,
        link: &mut Link,
        mine: &ConnInfo,
        theirs: &ConnInfo,
    ) -> Result<(), TransportError> {
        let peer = link.peer;
        let mtu = mtu_code(self.mtu).min(theirs.mtu);
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_of(mtu))
            .setup_dest_qp_num(theirs.qpn)
            .setup_rq_psn(theirs.psn)
            .setup_max_dest_read_atomic(0)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(theirs.lid).setup_port(self.opts.port).setup_service_level(0);
        if theirs.needs_grh() || self.lid == 0 {
            ah.setup_grh_dest_gid(&Gid { raw: theirs.gid })
                .setup_grh_src_gid_index(self.gid_index as u8)
                .setup_grh_hop_limit(64);
        }
        attr.setup_address_vector(&ah);
        link.qp.modify(&attr).map_err(|e| setup(format!("QP to rank {peer} -> RTR: {e}")))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(mine.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(0);
        link.qp.modify(&attr).map_err(|e| setup(format!("QP to rank {peer} -> RTS: {e}")))?;
        link.remote = (theirs.addr, theirs.rkey);
        Ok(())
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
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
            let mut opens = self.opens.lock().unwrap_or_else(|e| e.into_inner());
            let g = opens.entry(lane.to_owned()).or_insert(0);
            *g += 1;
            *g
        };
        let job = &self.opts.job;
        let peers = self.world - 1;
        let per_link = 3 * self.cfg.slots() + 4;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(per_link * peers.max(1) as u32)
            .build()
            .map_err(|e| setup(format!("ibv_create_cq: {e}")))?;
        let mut links: Vec<Option<Link>> = (0..self.world).map(|_| None).collect();
        let mut mine: Vec<Option<ConnInfo>> = vec![None; self.world];
        for p in (0..self.world).filter(|&p| p != self.rank) {
            let (link, info) = self.new_link(p, &cq)?;
            self.store
                .set(&conn_key(job, lane, generation, self.rank, p), &info.encode())
                .map_err(|e| setup(format!("publishing connection data: {e}")))?;
            links[p] = Some(link);
            mine[p] = Some(info);
        }
        for p in (0..self.world).filter(|&p| p != self.rank) {
            let v = self.wait_key(&conn_key(job, lane, generation, p, self.rank), p, deadline)?;
            let theirs = ConnInfo::decode(&v)
                .map_err(|e| setup(format!("rank {p} published bad data: {e}")))?;
            let (Some(link), Some(info)) = (links[p].as_mut(), mine[p].as_ref()) else {
                return Err(setup("link missing after creation"));
            };
            self.connect(link, info, &theirs)?;
            self.store
                .set(&ready_key(job, lane, generation, self.rank, p), b"1")
                .map_err(|e| setup(format!("publishing readiness: {e}")))?;
        }
        for p in (0..self.world).filter(|&p| p != self.rank) {
            self.wait_key(&ready_key(job, lane, generation, p, self.rank), p, deadline)?;
        }
        Ok(Box::new(RdmaLinks { links, cq, failed: None }))
    }
}

/// A page-aligned, zeroed host buffer the NIC reads or writes; accessed only through raw
/// pointers, since the NIC writes it behind the compiler's back.
struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned by its link and only touched by the thread driving the link.
unsafe impl Send for Region {}

impl Region {
    fn new(len: usize) -> Result<Self, TransportError> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| setup(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(setup(format!("out of memory for a {len}-byte buffer")));
        }
        Ok(Region { ptr, len: len.max(1) })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.len, 4096) {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.ptr, layout) };
        }
    }
}

/// One rank's link to one peer on one lane. Field order is drop order: the queue pair goes
/// first, then the registrations, then the memory they covered.
struct Link {
    peer: usize,
    qp: BasicQueuePair,
    /// Kept alive for the peer's writes; never read here.
    _ring_mr: Arc<MemoryRegion>,
    staging_mr: Arc<MemoryRegion>,
    ring: Region,
    staging: Region,
    proto: LinkProto,
    sq: SendQueue,
    /// The peer's ring: address and rkey.
    remote: (u64, u32),
    layout: SlotLayout,
}

impl Link {
    fn post_recv(&mut self) -> Result<(), TransportError> {
        let id = WrId { peer: self.peer, kind: WrKind::Recv, index: 0 }.encode();
        let mut guard = self.qp.start_post_recv();
        // No scatter entry: writes with immediate land where the writer says, and the
        // receive only carries the immediate.
        let _ = guard.construct_wr(id);
        guard.post().map_err(|e| self.proto.handle_completion_error(&format!("ibv_post_recv: {e}")))
    }

    /// Posts one transmit of the protocol (WR-3); the caller checked for room.
    fn post(&mut self, t: Transmit) -> Result<(), TransportError> {
        let poison = matches!(&t, Transmit::Write { slot, .. } if *slot == self.layout.slots());
        let staged = matches!(&t, Transmit::Write { bytes, .. } if !bytes.is_empty()) && !poison;
        let (index, entry) = if poison {
            let i = self.sq.push_unstaged().ok_or_else(|| setup("send queue full"))?;
            (i, Some(self.sq.poison_entry()))
        } else {
            self.sq.push(staged).ok_or_else(|| setup("send queue full"))?
        };
        let id = WrId { peer: self.peer, kind: WrKind::Write, index };
        let wr = write_wr(&t, &self.layout, self.remote, id, entry)
            .map_err(|e| setup(format!("work request: {e}")))?;
        let mut sge = None;
        if let (Transmit::Write { bytes, .. }, Some((e, len))) = (&t, wr.local) {
            let off = self.layout.slot_offset(e).ok_or_else(|| setup("staging entry"))?;
            // SAFETY: the entry lies inside the staging buffer (WR-1) and no posted write
            // uses it (WR-4).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    self.staging.ptr.add(off),
                    bytes.len(),
                )
            };
            sge = Some((self.staging.ptr as u64 + off as u64, len));
        }
        let lkey = self.staging_mr.lkey();
        let mut guard = self.qp.start_post_send();
        let h = guard.construct_wr(wr.wr_id, WorkRequestFlags::Signaled).setup_write_imm(
            wr.rkey,
            wr.remote_addr,
            wr.imm_wire,
        );
        if let Some((addr, len)) = sge {
            // SAFETY: the staging buffer is registered (lkey) and outlives the queue pair.
            unsafe { h.setup_sge(lkey, addr, len) };
        }
        guard.post().map_err(|e| self.proto.handle_completion_error(&format!("ibv_post_send: {e}")))
    }

    /// Posts what the protocol allows while the send queue and staging have room.
    fn transmit(&mut self) -> Result<bool, TransportError> {
        let mut moved = false;
        while self.sq.can_post() {
            let Some(t) = self.proto.poll_transmit() else { break };
            self.post(t)?;
            moved = true;
        }
        Ok(moved)
    }
}

/// A completion copied out of the CQ, so that links can be borrowed mutably while handling it.
struct Wc {
    wr_id: u64,
    status: u32,
    vendor: u32,
    byte_len: u32,
    imm: u32,
}

/// One rank's RDMA links on one lane.
struct RdmaLinks {
    links: Vec<Option<Link>>,
    cq: Arc<BasicCompletionQueue>,
    failed: Option<TransportError>,
}

impl RdmaLinks {
    fn link(&mut self, p: usize) -> Result<&mut Link, TransportError> {
        self.links
            .get_mut(p)
            .and_then(|l| l.as_mut())
            .ok_or_else(|| TransportError::Setup(format!("rdma: no link to rank {p}")))
    }

    /// Drains the CQ into the links' protocols. `Ok(true)` when anything completed.
    fn poll_cq(&mut self) -> Result<bool, TransportError> {
        let mut wcs = Vec::new();
        match self.cq.start_poll() {
            Ok(poller) => {
                for wc in poller {
                    wcs.push(Wc {
                        wr_id: wc.wr_id(),
                        status: wc.status(),
                        vendor: wc.vendor_err(),
                        byte_len: wc.byte_len(),
                        imm: wc.imm_data(),
                    });
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(false),
            Err(e) => return Err(setup(format!("ibv_poll_cq: {e}"))),
        }
        for wc in &wcs {
            let id = WrId::decode(wc.wr_id).ok_or_else(|| {
                setup(format!("completion of unknown work request {:#x}", wc.wr_id))
            })?;
            let link = self.link(id.peer)?;
            if wc.status != 0 {
                let what = match id.kind {
                    WrKind::Write => "write",
                    WrKind::Recv => "receive",
                };
                // A failed data write or receive fails the link; a failed credit stops its writes
                // only. Either way the exchange fails only if it needs this peer (RDMA-7).
                let detail = format!(
                    "{} on a {what} (vendor error {:#x})",
                    wc_status_name(wc.status),
                    wc.vendor
                );
                match id.kind {
                    WrKind::Write => {
                        link.sq.complete();
                        link.proto.handle_write_error(&detail);
                    }
                    WrKind::Recv => {
                        link.proto.handle_completion_error(&detail);
                    }
                }
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
                    let imm = super::wr::imm_from_wire(wc.imm);
                    let range = match link.layout.incoming(imm, wc.byte_len) {
                        Ok(r) => r,
                        Err(e) => {
                            return Err(link.proto.handle_completion_error(&format!(
                                "rank {} wrote out of bounds: {e}",
                                link.peer
                            )))
                        }
                    };
                    // SAFETY: the range lies inside the ring (WR-1); the peer wrote it before
                    // this completion and writes the slot again only after it is released
                    // (RDMA-1), which happens in a later poll_deliver.
                    let written = unsafe {
                        std::slice::from_raw_parts(link.ring.ptr.add(range.start), range.len())
                    };
                    link.proto.handle_imm(imm, written)?;
                    link.post_recv()?;
                }
            }
        }
        Ok(!wcs.is_empty())
    }

    /// Hands every piece the protocol releases to its receive's sink.
    fn deliver(
        &mut self,
        p: usize,
        pending: &mut VecDeque<usize>,
        recvs: &mut [RecvOp<'_>],
    ) -> Result<bool, TransportError> {
        let link = self.link(p)?;
        let mut moved = false;
        while let Some(d) = link.proto.poll_deliver()? {
            moved = true;
            let idx = *pending
                .front()
                .ok_or_else(|| setup(format!("a delivery from rank {p} with no receive")))?;
            let off = link.layout.slot_offset(d.slot).ok_or_else(|| setup("slot"))?;
            if !d.range.is_empty() {
                // SAFETY: inside the ring (WR-1); the slot stays untouched by the peer until
                // its credit is sent, after this call (RDMA-1).
                let piece = unsafe {
                    std::slice::from_raw_parts(
                        link.ring.ptr.add(off + d.range.start),
                        d.range.len(),
                    )
                };
                recvs[idx].sink.put(d.offset, piece);
            }
            if d.done {
                pending.pop_front();
            }
        }
        Ok(moved)
    }
}

impl super::exchange::Shim for RdmaLinks {
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
        RdmaLinks::deliver(self, p, pending, recvs)
    }

    fn transmit(&mut self, p: usize) -> Result<bool, TransportError> {
        self.link(p)?.transmit()
    }

    fn poll_cq(&mut self) -> Result<bool, TransportError> {
        RdmaLinks::poll_cq(self)
    }

    fn failed(&mut self) -> &mut Option<TransportError> {
        &mut self.failed
    }
}

impl LaneLinks for RdmaLinks {
    fn exchange(
        &mut self,
        tag: Tag,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError> {
        super::exchange::exchange(self, tag, sends, recvs, deadline, cancel, 2048)
    }

    fn poison(&mut self, poison: &Poison) {
        for link in self.links.iter_mut().flatten() {
            link.proto.queue_poison(poison);
            if link.sq.can_post_unstaged() {
                if let Some(t) = link.proto.poll_transmit() {
                    let _ = link.post(t);
                }
            }
        }
        // Best effort: give the writes a moment to leave before the lane may be dropped.
        let end = Instant::now() + Duration::from_millis(100);
        while Instant::now() < end
            && self.links.iter().flatten().any(|l| l.sq.outstanding() > 0)
            && self.poll_cq().is_ok()
        {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemStore;

    #[test]
    fn mtu_codes_match_the_verbs_enum() {
        for m in [Mtu::Mtu256, Mtu::Mtu512, Mtu::Mtu1024, Mtu::Mtu2048, Mtu::Mtu4096] {
            assert_eq!(mtu_of(mtu_code(m)), m);
            assert_eq!(u32::from(mtu_code(m)), m as u32);
        }
    }

    #[test]
    fn without_a_device_opening_is_device_unavailable() {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        match RdmaTransport::open(0, 1, store, None, Duration::from_secs(1)) {
            Ok(t) => println!("RDMA device present: {}", t.device()),
            Err(TransportError::Setup(msg)) => {
                println!("{msg}");
                assert!(msg.starts_with("DeviceUnavailable: no RDMA device"), "{msg}");
            }
            Err(e) => panic!("expected a DeviceUnavailable setup error, got {e}"),
        }
    }
}
