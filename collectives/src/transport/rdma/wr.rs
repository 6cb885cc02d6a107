//! The verbs shim's bookkeeping as plain data, compiled and tested on every build: where a
//! slot lives in a registered ring, how a [`Transmit`] of the protocol becomes an RDMA write
//! work request, how a work request id names its link and direction, which local bytes a
//! write with immediate filled, when the send queue and the staging buffer have room, and
//! the names of verbs completion statuses. `verbs.rs` (feature `rdma`) only copies these
//! values into verbs calls, so what can be checked without a device is checked here.
//!
//! Invariants (cited by the tests):
//! - WR-1: slot `s` of a ring starts at `s * slot_bytes` from the ring's base; the poison slot
//!   is the last one (`slots`), and nothing addresses past the ring.
//! - WR-2: a work request id decodes to the link (peer) and the direction it was encoded with,
//!   and an id that no shim encoded is refused rather than misrouted.
//! - WR-3: a data or poison transmit becomes one signalled RDMA write with immediate into the
//!   peer's slot it names, carrying exactly its bytes from a staging entry; a credit becomes a
//!   zero-byte write with immediate and no scatter/gather entry (a zero-length entry means
//!   2 GiB on some NICs). Immediates travel in network byte order.
//! - WR-4: the staging buffer entry of a write is reused only after that write completed
//!   locally (send completions of one RC queue pair arrive in posting order), and the send
//!   queue never holds more than its depth.
//! - WR-5: connection data round-trips through its store encoding; a wrong length or an
//!   out-of-range field is refused instead of bringing up a queue pair with garbage.

use std::collections::VecDeque;
use std::ops::Range;

use super::proto::{Imm, ProtoConfig, Transmit};

/// What one side of a link publishes in the store for its peer (WR-5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID (RoCE and routed InfiniBand).
    pub gid: [u8; 16],
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Virtual address of the receive slot ring.
    pub addr: u64,
    /// Remote key of the slot ring's memory region.
    pub rkey: u32,
    /// Active MTU of the port, as the verbs enum (1 = 256 B .. 5 = 4096 B).
    pub mtu: u8,
}

impl ConnInfo {
    /// Bytes on the store.
    pub const WIRE_BYTES: usize = 4 + 2 + 16 + 4 + 8 + 4 + 1;

    /// Little-endian encoding for the store.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::WIRE_BYTES);
        v.extend_from_slice(&self.qpn.to_le_bytes());
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.psn.to_le_bytes());
        v.extend_from_slice(&self.addr.to_le_bytes());
        v.extend_from_slice(&self.rkey.to_le_bytes());
        v.push(self.mtu);
        v
    }

    /// Decodes [`ConnInfo::encode`]'s bytes; a wrong length, a QPN or PSN over 24 bits or an
    /// MTU outside 1..=5 is refused (WR-5).
    pub fn decode(b: &[u8]) -> Result<Self, String> {
        if b.len() != Self::WIRE_BYTES {
            return Err(format!(
                "rdma connection data of {} bytes, want {}",
                b.len(),
                Self::WIRE_BYTES
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[6..22]);
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[26..34]);
        let c = ConnInfo {
            qpn: u32_at(0),
            lid: u16::from_le_bytes([b[4], b[5]]),
            gid,
            psn: u32_at(22),
            addr: u64::from_le_bytes(a),
            rkey: u32_at(34),
            mtu: b[38],
        };
        if c.qpn > 0xFF_FFFF || c.psn > 0xFF_FFFF || !(1..=5).contains(&c.mtu) {
            return Err(format!("rdma connection data out of range: {c:?}"));
        }
        Ok(c)
    }

    /// Whether the peer must be addressed through a global route header: RoCE (no LID) or a
    /// GID given on a subnet without LIDs.
    pub fn needs_grh(&self) -> bool {
        self.lid == 0
    }
}

/// The store key under which `from` publishes its end of the link to `to` on the
/// `generation`-th opening of `lane` in job `job`.
pub fn conn_key(job: &str, lane: &str, generation: u64, from: usize, to: usize) -> String {
    format!("rdma/{job}/{lane}/{generation}/{from}-{to}")
}

/// The store key saying that `from`'s queue pair to `to` is ready to send (RTS), published
/// after the transition and awaited by `to` before its first write.
pub fn ready_key(job: &str, lane: &str, generation: u64, from: usize, to: usize) -> String {
    format!("rdma/{job}/{lane}/{generation}/{from}-{to}/rts")
}

/// The byte layout of a link's receive ring (and of its staging buffer): `slots` data slots
/// and one poison slot, `slot_bytes` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLayout {
    slot_bytes: usize,
    slots: u32,
}

impl SlotLayout {
    /// The layout of a protocol configuration.
    pub fn new(cfg: ProtoConfig) -> Self {
        SlotLayout { slot_bytes: cfg.slot_bytes(), slots: cfg.slots() }
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Number of data slots; the poison slot has index `slots()`.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Bytes of the whole ring, poison slot included.
    pub fn ring_bytes(&self) -> usize {
        (self.slots as usize + 1) * self.slot_bytes
    }

    /// Offset of slot `slot` from the ring's base; `None` past the poison slot (WR-1).
    pub fn slot_offset(&self, slot: u32) -> Option<usize> {
        (slot <= self.slots).then(|| slot as usize * self.slot_bytes)
    }

    /// Address of slot `slot` in a ring registered at `base`.
    pub fn slot_addr(&self, base: u64, slot: u32) -> Option<u64> {
        self.slot_offset(slot).map(|o| base + o as u64)
    }

    /// The local bytes a write with immediate `imm` of `byte_len` bytes filled (WR-1): the
    /// start of the slot the immediate names (data: `seq % slots`, poison: the poison slot),
    /// nothing for credits. A length that does not fit its slot is refused.
    pub fn incoming(&self, imm: u32, byte_len: u32) -> Result<Range<usize>, String> {
        let len = byte_len as usize;
        let slot = match Imm::decode(imm) {
            Imm::Credit { .. } => {
                return match len {
                    0 => Ok(0..0),
                    n => Err(format!("credit carrying {n} bytes")),
                }
            }
            Imm::Data { seq, .. } => seq % self.slots,
            Imm::Poison { .. } => self.slots,
        };
        if len > self.slot_bytes {
            return Err(format!("write of {len} bytes into a {}-byte slot", self.slot_bytes));
        }
        let start = slot as usize * self.slot_bytes;
        Ok(start..start + len)
    }
}

/// The direction of a work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrKind {
    /// An RDMA write (with immediate) posted to the send queue.
    Write,
    /// A receive posted to consume the peer's immediates.
    Recv,
}

const KIND_BIT: u64 = 1 << 63;
const MAGIC: u64 = 0x5A << 55;
const MAGIC_MASK: u64 = 0xFF << 55;

/// What a 64-bit work request id carries: the link's peer and the direction (WR-2); the low
/// 32 bits count writes, for diagnostics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrId {
    /// Peer rank of the link (below 2^23).
    pub peer: usize,
    /// Direction.
    pub kind: WrKind,
    /// Sequence of the work request on its link (wraps).
    pub index: u32,
}

impl WrId {
    /// The 64-bit id.
    pub fn encode(self) -> u64 {
        let kind = match self.kind {
            WrKind::Write => 0,
            WrKind::Recv => KIND_BIT,
        };
        kind | MAGIC | ((self.peer as u64 & 0x7F_FFFF) << 32) | u64::from(self.index)
    }

    /// Decodes [`WrId::encode`]'s id; `None` for an id no shim posted.
    pub fn decode(v: u64) -> Option<WrId> {
        if v & MAGIC_MASK != MAGIC {
            return None;
        }
        let kind = if v & KIND_BIT != 0 { WrKind::Recv } else { WrKind::Write };
        Some(WrId { peer: ((v >> 32) & 0x7F_FFFF) as usize, kind, index: v as u32 })
    }
}

/// An immediate as the verbs calls take and return it (`__be32`).
pub fn imm_to_wire(imm: u32) -> u32 {
    imm.to_be()
}

/// The immediate of a completion, back in host order.
pub fn imm_from_wire(wire: u32) -> u32 {
    u32::from_be(wire)
}

/// One RDMA write with immediate, as the shim posts it (WR-3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteWr {
    /// Work request id ([`WrId`]).
    pub wr_id: u64,
    /// Destination address in the peer's ring.
    pub remote_addr: u64,
    /// The peer ring's remote key.
    pub rkey: u32,
    /// The immediate, in wire order.
    pub imm_wire: u32,
    /// The staging entry holding the bytes and their length; `None` for a zero-byte write.
    pub local: Option<(u32, u32)>,
}

/// Maps a transmit of the protocol to its work request (WR-3). `staging` is the staging
/// entry the bytes were (or will be) copied to, required for writes with bytes; `remote` is
/// the peer ring's base address and key.
pub fn write_wr(
    t: &Transmit,
    layout: &SlotLayout,
    remote: (u64, u32),
    id: WrId,
    staging: Option<u32>,
) -> Result<WriteWr, String> {
    let (base, rkey) = remote;
    match t {
        Transmit::ImmOnly { imm } => Ok(WriteWr {
            wr_id: id.encode(),
            remote_addr: base,
            rkey,
            imm_wire: imm_to_wire(*imm),
            local: None,
        }),
        Transmit::Write { slot, imm, bytes } => {
            if bytes.len() > layout.slot_bytes {
                return Err(format!("{} bytes for a {}-byte slot", bytes.len(), layout.slot_bytes));
            }
            let remote_addr = layout
                .slot_addr(base, *slot)
                .ok_or_else(|| format!("slot {slot} outside a ring of {}", layout.slots))?;
            let local = if bytes.is_empty() {
                None
            } else {
                let e = staging.ok_or("a write with bytes needs a staging entry")?;
                Some((e, bytes.len() as u32))
            };
            Ok(WriteWr {
                wr_id: id.encode(),
                remote_addr,
                rkey,
                imm_wire: imm_to_wire(*imm),
                local,
            })
        }
    }
}

/// The send queue of one link and its staging buffer (WR-4): `depth` work requests at most,
/// `entries` staging entries for data writes handed out in ring order, and one more entry
/// (index `entries`) reserved for the poison message.
#[derive(Debug)]
pub struct SendQueue {
    depth: usize,
    entries: u32,
    next: u32,
    used: u32,
    posted: VecDeque<Option<u32>>,
    writes: u32,
}

impl SendQueue {
    /// A queue of `depth` work requests over `entries` data staging entries.
    pub fn new(depth: usize, entries: u32) -> Self {
        SendQueue { depth, entries, next: 0, used: 0, posted: VecDeque::new(), writes: 0 }
    }

    /// The staging entry of the poison message.
    pub fn poison_entry(&self) -> u32 {
        self.entries
    }

    /// Whether any transmit (a data write with bytes included) may be posted now.
    pub fn can_post(&self) -> bool {
        self.posted.len() < self.depth && self.used < self.entries
    }

    /// Whether a write without a data staging entry (credit, poison) may be posted now.
    pub fn can_post_unstaged(&self) -> bool {
        self.posted.len() < self.depth
    }

    /// Records a posted write; `staged` takes the next data staging entry, returned with the
    /// write's index. `None` when there is no room (the caller checks first).
    pub fn push(&mut self, staged: bool) -> Option<(u32, Option<u32>)> {
        if self.posted.len() >= self.depth || (staged && self.used >= self.entries) {
            return None;
        }
        let entry = staged.then(|| {
            let e = self.next;
            self.next = (self.next + 1) % self.entries;
            self.used += 1;
            e
        });
        self.posted.push_back(entry);
        let index = self.writes;
        self.writes = self.writes.wrapping_add(1);
        Some((index, entry))
    }

    /// Records a posted write outside the data entries (the poison entry, or no bytes).
    pub fn push_unstaged(&mut self) -> Option<u32> {
        self.push(false).map(|(i, _)| i)
    }

    /// The oldest posted write completed; `false` when none was outstanding.
    pub fn complete(&mut self) -> bool {
        match self.posted.pop_front() {
            Some(Some(_)) => {
                self.used -= 1;
                true
            }
            Some(None) => true,
            None => false,
        }
    }

    /// Writes posted and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.posted.len()
    }
}

/// The name of a verbs work completion status (`ibv_wc_status`), for error messages; never
/// panics on a value it does not know.
pub fn wc_status_name(status: u32) -> String {
    const NAMES: [&str; 23] = [
        "IBV_WC_SUCCESS",
        "IBV_WC_LOC_LEN_ERR",
        "IBV_WC_LOC_QP_OP_ERR",
        "IBV_WC_LOC_EEC_OP_ERR",
        "IBV_WC_LOC_PROT_ERR",
        "IBV_WC_WR_FLUSH_ERR",
        "IBV_WC_MW_BIND_ERR",
        "IBV_WC_BAD_RESP_ERR",
        "IBV_WC_LOC_ACCESS_ERR",
        "IBV_WC_REM_INV_REQ_ERR",
        "IBV_WC_REM_ACCESS_ERR",
        "IBV_WC_REM_OP_ERR",
        "IBV_WC_RETRY_EXC_ERR",
        "IBV_WC_RNR_RETRY_EXC_ERR",
        "IBV_WC_LOC_RDD_VIOL_ERR",
        "IBV_WC_REM_INV_RD_REQ_ERR",
        "IBV_WC_REM_ABORT_ERR",
        "IBV_WC_INV_EECN_ERR",
        "IBV_WC_INV_EEC_STATE_ERR",
        "IBV_WC_FATAL_ERR",
        "IBV_WC_RESP_TIMEOUT_ERR",
        "IBV_WC_GENERAL_ERR",
        "IBV_WC_TM_ERR",
    ];
    match NAMES.get(status as usize) {
        Some(n) => (*n).to_string(),
        None => format!("ibv_wc_status {status}"),
    }
}

/// A 24-bit initial packet sequence number from `seed` bytes (the shim passes random ones).
pub fn psn_from(seed: [u8; 4]) -> u32 {
    u32::from_le_bytes(seed) & 0xFF_FFFF
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::proto::LinkProto;
    use crate::transport::Tag;

    fn layout() -> SlotLayout {
        SlotLayout::new(ProtoConfig::new(256, 4).unwrap())
    }

    #[test]
    fn slot_addresses_stay_inside_the_ring() {
        // WR-1
        let l = layout();
        assert_eq!(l.ring_bytes(), 5 * 256);
        assert_eq!(l.slot_offset(0), Some(0));
        assert_eq!(l.slot_offset(3), Some(768));
        assert_eq!(l.slot_offset(4), Some(1024), "the poison slot is the last");
        assert_eq!(l.slot_offset(5), None);
        assert_eq!(l.slot_addr(0x1000, 2), Some(0x1000 + 512));
        for s in 0..=l.slots() {
            let o = l.slot_offset(s).unwrap();
            assert!(o + l.slot_bytes() <= l.ring_bytes());
        }
    }

    #[test]
    fn incoming_bytes_are_located_from_the_immediate() {
        // WR-1: data chunk seq 6 lands in slot 2, poison in slot 4, credits nowhere.
        let l = layout();
        let data = Imm::Data { first: true, seq: 6 }.encode();
        assert_eq!(l.incoming(data, 100), Ok(512..612));
        assert_eq!(l.incoming(Imm::Poison { len: 20 }.encode(), 20), Ok(1024..1044));
        assert_eq!(l.incoming(Imm::Credit { consumed: 9 }.encode(), 0), Ok(0..0));
        assert!(l.incoming(Imm::Credit { consumed: 9 }.encode(), 4).is_err());
        assert!(l.incoming(data, 257).is_err(), "longer than a slot");
        assert_eq!(l.incoming(data, 256), Ok(512..768));
    }

    #[test]
    fn work_request_ids_round_trip_and_refuse_strangers() {
        // WR-2
        for peer in [0usize, 1, 7, 4095, (1 << 23) - 1] {
            for kind in [WrKind::Write, WrKind::Recv] {
                for index in [0u32, 1, u32::MAX] {
                    let id = WrId { peer, kind, index };
                    assert_eq!(WrId::decode(id.encode()), Some(id));
                }
            }
        }
        assert_eq!(WrId::decode(0), None);
        assert_eq!(WrId::decode(u64::MAX), None);
        assert_eq!(WrId::decode(42), None);
    }

    #[test]
    fn immediates_travel_big_endian() {
        // WR-3
        let imm = Imm::Data { first: true, seq: 0x0012_3456 }.encode();
        let wire = imm_to_wire(imm);
        assert_eq!(wire.to_ne_bytes(), imm.to_be_bytes());
        assert_eq!(imm_from_wire(wire), imm);
    }

    fn tag() -> Tag {
        Tag { lane: 1, seq: 2, kind: 3, count: 4, root: u32::MAX, step: 0 }
    }

    #[test]
    fn transmits_of_a_message_map_to_writes_into_the_named_slots() {
        // WR-3: every transmit of a real protocol run becomes one work request whose target
        // is base + slot * slot_bytes and whose local part is exactly the transmit's bytes.
        let cfg = ProtoConfig::new(256, 4).unwrap();
        let l = SlotLayout::new(cfg);
        let mut p = LinkProto::new(1, cfg);
        p.queue_send(tag(), &[7u8; 256 * 3]).unwrap();
        let mut sq = SendQueue::new(8, cfg.slots());
        let base = 0x7f00_0000_0000u64;
        let mut n = 0u32;
        while sq.can_post() {
            let Some(t) = p.poll_transmit() else { break };
            let (index, entry) = sq.push(true).unwrap();
            let id = WrId { peer: 1, kind: WrKind::Write, index };
            let wr = write_wr(&t, &l, (base, 99), id, entry).unwrap();
            let Transmit::Write { slot, imm, bytes } = &t else { panic!("data expected") };
            assert_eq!(*slot, n % 4);
            assert_eq!(wr.remote_addr, base + u64::from(*slot) * 256);
            assert_eq!(wr.rkey, 99);
            assert_eq!(imm_from_wire(wr.imm_wire), *imm);
            assert_eq!(wr.local, Some((n % 4, bytes.len() as u32)));
            assert_eq!(WrId::decode(wr.wr_id), Some(id));
            n += 1;
        }
        assert_eq!(n, 4, "three slots of payload plus the header take four chunks");
    }

    #[test]
    fn credits_are_zero_byte_writes_without_a_gather_entry() {
        // WR-3
        let l = layout();
        let t = Transmit::ImmOnly { imm: Imm::Credit { consumed: 5 }.encode() };
        let id = WrId { peer: 2, kind: WrKind::Write, index: 0 };
        let wr = write_wr(&t, &l, (0x2000, 7), id, None).unwrap();
        assert_eq!(wr.local, None);
        assert_eq!(wr.remote_addr, 0x2000);
        assert_eq!(imm_from_wire(wr.imm_wire), Imm::Credit { consumed: 5 }.encode());
        let poison =
            Transmit::Write { slot: 4, imm: Imm::Poison { len: 12 }.encode(), bytes: vec![1; 12] };
        let wr = write_wr(&poison, &l, (0x2000, 7), id, Some(4)).unwrap();
        assert_eq!(wr.remote_addr, 0x2000 + 1024);
        assert_eq!(wr.local, Some((4, 12)));
        let bad = Transmit::Write { slot: 5, imm: 0, bytes: vec![0; 4] };
        assert!(write_wr(&bad, &l, (0, 0), id, Some(0)).is_err());
        let unstaged = Transmit::Write { slot: 0, imm: 0, bytes: vec![0; 4] };
        assert!(write_wr(&unstaged, &l, (0, 0), id, None).is_err());
    }

    #[test]
    fn staging_entries_are_reused_only_after_completion() {
        // WR-4
        let mut sq = SendQueue::new(4, 2);
        assert_eq!(sq.push(true), Some((0, Some(0))));
        assert_eq!(sq.push(false), Some((1, None)));
        assert_eq!(sq.push(true), Some((2, Some(1))));
        assert!(!sq.can_post(), "both data entries in use");
        assert!(sq.can_post_unstaged());
        assert_eq!(sq.push(true), None);
        assert_eq!(sq.push_unstaged(), Some(3));
        assert!(!sq.can_post_unstaged(), "queue depth reached");
        assert!(sq.complete()); // entry 0
        assert!(sq.can_post());
        assert_eq!(sq.push(true), Some((4, Some(0))), "entry 0 comes back first");
        assert!(!sq.can_post(), "depth full again");
        assert!(sq.complete()); // the credit
        assert!(!sq.can_post(), "entries 1 and 0 still in flight");
        assert!(sq.complete()); // entry 1
        assert_eq!(sq.push(true), Some((5, Some(1))));
        while sq.complete() {}
        assert_eq!(sq.outstanding(), 0);
        assert!(!sq.complete());
        assert_eq!(sq.poison_entry(), 2);
    }

    #[test]
    fn connection_data_round_trips_and_rejects_bad_values() {
        // WR-5
        let c = ConnInfo {
            qpn: 0x12_3456,
            lid: 7,
            gid: [9; 16],
            psn: 0xAB_CDEF,
            addr: 1 << 40,
            rkey: 42,
            mtu: 5,
        };
        let b = c.encode();
        assert_eq!(b.len(), ConnInfo::WIRE_BYTES);
        assert_eq!(ConnInfo::decode(&b), Ok(c));
        assert!(ConnInfo::decode(&b[1..]).is_err());
        let mut bad = b.clone();
        bad[3] = 1; // qpn over 24 bits
        assert!(ConnInfo::decode(&bad).is_err());
        let mut bad = b.clone();
        bad[38] = 0;
        assert!(ConnInfo::decode(&bad).is_err(), "mtu 0");
        assert!(!c.needs_grh());
        assert!(ConnInfo { lid: 0, ..c }.needs_grh());
        assert_ne!(conn_key("j", "l", 1, 0, 1), conn_key("j", "l", 1, 1, 0));
        assert_ne!(conn_key("j", "l", 1, 0, 1), conn_key("j", "l", 2, 0, 1));
        assert_ne!(conn_key("j", "l", 1, 0, 1), ready_key("j", "l", 1, 0, 1));
    }

    #[test]
    fn status_names_never_panic() {
        assert_eq!(wc_status_name(0), "IBV_WC_SUCCESS");
        assert_eq!(wc_status_name(12), "IBV_WC_RETRY_EXC_ERR");
        assert_eq!(wc_status_name(5), "IBV_WC_WR_FLUSH_ERR");
        assert_eq!(wc_status_name(999), "ibv_wc_status 999");
        assert_eq!(psn_from([0xFF; 4]), 0xFF_FFFF);
    }
}
