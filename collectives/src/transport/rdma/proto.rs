//! The RDMA link protocol as a deterministic state machine: no verbs calls, no clock, no
//! I/O. The verbs shim (`verbs.rs`, feature `rdma`) feeds it completions and carries out the
//! writes it hands out; the tests below drive two of them through an in-memory network with
//! explicit latency, loss and reordering.
//!
//! ## Wire model
//! Each side of a link owns `slots` receive slots of `slot_bytes` bytes, registered once
//! (plus one slot reserved for a poison message). A message is cut into chunks of at most one
//! slot; the first chunk starts with a [`HEADER_BYTES`] header (the [`Tag`], the payload
//! length). Chunk number `seq` always goes into the peer's slot `seq % slots` by an RDMA write
//! with immediate; the immediate ([`Imm`]) says what arrived:
//!
//! | bits 31..30 | bits 29..0 | meaning |
//! |---|---|---|
//! | 0 | chunk sequence number | a continuation chunk |
//! | 1 | chunk sequence number | the first chunk of a message (slot starts with a header) |
//! | 2 | chunks consumed so far (cumulative) | credits: slots released by the receiver |
//! | 3 | reason length in bytes | poison: the reason is in the poison slot |
//!
//! Sequence numbers and credit counts wrap at 2^30. Credits are cumulative, so a late or
//! reordered credit message is harmless: the newest count wins.
//!
//! ## Invariants (cited by the tests)
//! - RDMA-1: a sender never has more than `slots` chunks unreleased by the receiver, so it
//!   never writes into a slot whose data has not been delivered.
//! - RDMA-2: a receiver delivers each message's bytes exactly once, in order of offset, in
//!   pieces that are 4-byte multiples at 4-byte-aligned offsets (TR-2), whatever the order in
//!   which chunk completions arrive.
//! - RDMA-3: an immediate of a chunk outside the receive window, a duplicate chunk, or a
//!   continuation chunk with no message open is `Corrupt`; nothing of it is delivered.
//! - RDMA-4: a lost chunk or credit never hangs: the caller's deadline moves the link to
//!   `Timeout { peer }`; a completion error moves it to `Io`; a failed link returns the same
//!   error from every later call.
//! - RDMA-5: a header whose tag or length differs from the expected receive fails the link
//!   with `TagMismatch` / `LengthMismatch` before any of its bytes reach the sink.
//! - RDMA-6: a poison message fails the peer's pending and later receives with `Poisoned`,
//!   and the shim ends a wait on any other peer with it as well.
//! - RDMA-7: an exchange waits for its data writes to complete, not for credits or poison:
//!   a credit to a peer that has finished and closed its endpoint cannot fail an exchange
//!   that no longer needs that peer (the failure stays on the link, for its next use).

use std::collections::VecDeque;
use std::ops::Range;

use crate::transport::{Poison, Tag, TransportError};

/// Bytes of the header at the start of a message's first chunk: the tag, the payload
/// length (`u64`), 8 reserved bytes (keeps the payload 16-byte aligned in the slot).
pub const HEADER_BYTES: usize = Tag::WIRE_BYTES + 16;

/// Sequence numbers and credit counts live modulo this.
pub const SEQ_MODULUS: u32 = 1 << 30;
const SEQ_MASK: u32 = SEQ_MODULUS - 1;

/// The meaning of a 32-bit immediate (see the table in the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Imm {
    /// A chunk of payload; `first` when the slot starts with a header.
    Data {
        /// Whether the chunk starts a message.
        first: bool,
        /// Chunk sequence number (mod 2^30).
        seq: u32,
    },
    /// Cumulative count of chunks the sender of this immediate has consumed (mod 2^30).
    Credit {
        /// Chunks consumed so far.
        consumed: u32,
    },
    /// A poison message of `len` bytes of UTF-8 reason in the poison slot.
    Poison {
        /// Reason length.
        len: u32,
    },
}

impl Imm {
    /// The 32-bit immediate value.
    pub fn encode(self) -> u32 {
        match self {
            Imm::Data { first: false, seq } => seq & SEQ_MASK,
            Imm::Data { first: true, seq } => (1 << 30) | (seq & SEQ_MASK),
            Imm::Credit { consumed } => (2 << 30) | (consumed & SEQ_MASK),
            Imm::Poison { len } => (3 << 30) | (len & SEQ_MASK),
        }
    }

    /// Decodes an immediate written by [`Imm::encode`]. Every 32-bit value decodes; whether
    /// it makes sense is the state machine's check (RDMA-3).
    pub fn decode(v: u32) -> Imm {
        let payload = v & SEQ_MASK;
        match v >> 30 {
            0 => Imm::Data { first: false, seq: payload },
            1 => Imm::Data { first: true, seq: payload },
            2 => Imm::Credit { consumed: payload },
            _ => Imm::Poison { len: payload },
        }
    }
}

fn seq_diff(a: u32, b: u32) -> u32 {
    a.wrapping_sub(b) & SEQ_MASK
}

/// Sizes of a link's slot ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProtoConfig {
    slot_bytes: usize,
    slots: u32,
}

impl ProtoConfig {
    /// `slots` receive slots of `slot_bytes` bytes each. `slot_bytes` must be a multiple of 4
    /// larger than the header, and `slots` between 1 and 2^20.
    ///
    /// ```
    /// use shardline_collectives::transport::rdma::proto::ProtoConfig;
    /// let cfg = ProtoConfig::new(64 * 1024, 16).unwrap();
    /// assert_eq!(cfg.slots(), 16);
    /// assert!(ProtoConfig::new(30, 16).is_none());
    /// ```
    pub fn new(slot_bytes: usize, slots: u32) -> Option<Self> {
        let ok = slot_bytes & 3 == 0
            && slot_bytes > HEADER_BYTES
            && slot_bytes <= u32::MAX as usize
            && (1..=1 << 20).contains(&slots);
        ok.then_some(ProtoConfig { slot_bytes, slots })
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Number of data slots (the poison slot comes on top, at index `slots`).
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Released slots the receiver accumulates before it sends a credit message (half the
    /// ring, at least one): fewer messages without ever stalling the sender on a full ring.
    pub fn credit_batch(&self) -> u32 {
        (self.slots / 2).max(1)
    }
}

/// A write the shim must post to the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transmit {
    /// RDMA write of `bytes` into the peer's slot `slot`, with immediate `imm`.
    Write {
        /// Destination slot (`slots` is the poison slot).
        slot: u32,
        /// Immediate value.
        imm: u32,
        /// Bytes to write (at most one slot).
        bytes: Vec<u8>,
    },
    /// A zero-byte write with immediate `imm` (credits).
    ImmOnly {
        /// Immediate value.
        imm: u32,
    },
}

/// Bytes the shim must hand to the sink of the front receive: `range` of local slot `slot`,
/// at `offset` in the message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deliver {
    /// Local slot holding the bytes.
    pub slot: u32,
    /// Byte range inside the slot.
    pub range: Range<usize>,
    /// Offset of these bytes in the message.
    pub offset: usize,
    /// Whether this piece completes the front receive.
    pub done: bool,
}

struct OutMsg {
    tag: Tag,
    data: Vec<u8>,
    sent: usize,
    header_sent: bool,
}

#[derive(Clone, Copy)]
struct Arrival {
    seq: u32,
    len: usize,
    header: Option<(Tag, u64)>,
}

struct Expect {
    tag: Tag,
    len: usize,
    got: usize,
}

/// One rank's protocol state for the link to one peer (both directions).
pub struct LinkProto {
    cfg: ProtoConfig,
    peer: usize,
    failed: Option<TransportError>,
    // sending half
    out: VecDeque<OutMsg>,
    next_seq: u32,
    peer_consumed: u32,
    writes_posted: u64,
    writes_done: u64,
    /// Whether each posted write not yet completed carries data, oldest first (completions
    /// come in posting order on a reliable connection).
    posted_data: VecDeque<bool>,
    /// A credit or poison write failed: the peer takes no more writes, but what it wrote
    /// before can still be delivered (RDMA-7).
    send_failed: Option<TransportError>,
    poison_out: Option<Poison>,
    // receiving half
    arrived: Vec<Option<Arrival>>,
    consumed: u32,
    credit_sent: u32,
    credit_due: bool,
    expects: VecDeque<Expect>,
    open_msg: bool,
    poison_in: Option<Poison>,
}

impl LinkProto {
    /// A fresh link to `peer`.
    pub fn new(peer: usize, cfg: ProtoConfig) -> Self {
        LinkProto {
            cfg,
            peer,
            failed: None,
            out: VecDeque::new(),
            next_seq: 0,
            peer_consumed: 0,
            writes_posted: 0,
            writes_done: 0,
            posted_data: VecDeque::new(),
            send_failed: None,
            poison_out: None,
            arrived: vec![None; cfg.slots as usize],
            consumed: 0,
            credit_sent: 0,
            credit_due: false,
            expects: VecDeque::new(),
            open_msg: false,
            poison_in: None,
        }
    }

    /// The peer of this link.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The error that failed the link, if any: a failed data write, a receive-side error,
    /// or a failed credit write once this side has data to send again (RDMA-7).
    pub fn error(&self) -> Option<&TransportError> {
        self.failed.as_ref().or_else(|| self.send_failed.as_ref().filter(|_| self.sends_pending()))
    }

    fn fail(&mut self, e: TransportError) -> TransportError {
        self.failed.get_or_insert(e).clone()
    }

    fn check(&self) -> Result<(), TransportError> {
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Queues a message (copied: the caller's buffer is free at once, TR-5).
    pub fn queue_send(&mut self, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        self.check()?;
        if let Some(e) = &self.send_failed {
            return Err(e.clone());
        }
        self.out.push_back(OutMsg { tag, data: data.to_vec(), sent: 0, header_sent: false });
        Ok(())
    }

    /// Queues an expected receive of `len` bytes tagged `tag`.
    pub fn expect_recv(&mut self, tag: Tag, len: usize) -> Result<(), TransportError> {
        self.check()?;
        if let Some(p) = &self.poison_in {
            return Err(TransportError::Poisoned(p.clone()));
        }
        self.expects.push_back(Expect { tag, len, got: 0 });
        Ok(())
    }

    /// Queues a poison message to the peer (sent ahead of anything else, once).
    pub fn queue_poison(&mut self, poison: &Poison) {
        if self.poison_out.is_none() {
            self.poison_out = Some(poison.clone());
        }
    }

    /// Chunks written to the peer and not yet released by it.
    pub fn in_flight(&self) -> u32 {
        seq_diff(self.next_seq, self.peer_consumed)
    }

    /// Whether sends are still queued or their data writes not yet completed locally
    /// (RDMA-7: credit and poison writes are not waited for).
    pub fn sends_pending(&self) -> bool {
        !self.out.is_empty() || self.posted_data.iter().any(|&d| d)
    }

    /// The poison the peer sent, if it sent one: a wait on any other peer ends with it too
    /// (RDMA-6), since the job has failed.
    pub fn poisoned(&self) -> Option<&Poison> {
        self.poison_in.as_ref()
    }

    /// Whether expected receives are still incomplete.
    pub fn recvs_pending(&self) -> bool {
        !self.expects.is_empty()
    }

    /// Hands out the next write to post, if any is allowed now: poison first, then credits,
    /// then data chunks while the peer has free slots (RDMA-1).
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        if self.send_failed.is_some() {
            return None;
        }
        if let Some(p) = self.poison_out.take() {
            let mut bytes = p.reason.into_bytes();
            bytes.truncate(self.cfg.slot_bytes - 8);
            let mut msg = (p.origin as u64).to_le_bytes().to_vec();
            msg.extend_from_slice(&bytes);
            self.writes_posted += 1;
            self.posted_data.push_back(false);
            return Some(Transmit::Write {
                slot: self.cfg.slots,
                imm: Imm::Poison { len: msg.len() as u32 }.encode(),
                bytes: msg,
            });
        }
        if self.failed.is_some() {
            return None;
        }
        let unreturned = seq_diff(self.consumed, self.credit_sent);
        if unreturned > 0 && (unreturned >= self.cfg.credit_batch() || self.credit_due) {
            self.credit_sent = self.consumed;
            self.credit_due = false;
            self.writes_posted += 1;
            self.posted_data.push_back(false);
            return Some(Transmit::ImmOnly {
                imm: Imm::Credit { consumed: self.consumed }.encode(),
            });
        }
        if self.in_flight() >= self.cfg.slots {
            return None;
        }
        let slot_bytes = self.cfg.slot_bytes;
        let msg = self.out.front_mut()?;
        let first = !msg.header_sent;
        let room = if first { slot_bytes - HEADER_BYTES } else { slot_bytes };
        let n = room.min(msg.data.len() - msg.sent);
        let mut bytes = Vec::with_capacity(n + if first { HEADER_BYTES } else { 0 });
        if first {
            bytes.extend_from_slice(&msg.tag.encode());
            bytes.extend_from_slice(&(msg.data.len() as u64).to_le_bytes());
            bytes.extend_from_slice(&[0u8; 8]);
            msg.header_sent = true;
        }
        bytes.extend_from_slice(&msg.data[msg.sent..msg.sent + n]);
        msg.sent += n;
        if msg.sent == msg.data.len() {
            self.out.pop_front();
        }
        let seq = self.next_seq;
        self.next_seq = (self.next_seq + 1) & SEQ_MASK;
        self.writes_posted += 1;
        self.posted_data.push_back(true);
        Some(Transmit::Write {
            slot: seq % self.cfg.slots,
            imm: Imm::Data { first, seq }.encode(),
            bytes,
        })
    }

    /// One of this side's writes completed successfully at the local queue pair.
    pub fn handle_write_done(&mut self) {
        self.writes_done = (self.writes_done + 1).min(self.writes_posted);
        self.posted_data.pop_front();
    }

    /// The oldest posted write completed with an error. A data write fails the link for good
    /// (RDMA-4); a credit or poison write stops this side's writes only, so that what the
    /// peer wrote before it left can still be delivered (RDMA-7). Returns whether the link
    /// failed.
    pub fn handle_write_error(&mut self, detail: &str) -> bool {
        self.writes_done = (self.writes_done + 1).min(self.writes_posted);
        let data = self.posted_data.pop_front().unwrap_or(true);
        let e = TransportError::Io { peer: self.peer, detail: detail.to_string() };
        if data {
            self.fail(e);
        } else {
            self.send_failed.get_or_insert(e);
        }
        data
    }

    /// A work completion failed (either direction): the link is failed for good (RDMA-4).
    pub fn handle_completion_error(&mut self, detail: &str) -> TransportError {
        self.fail(TransportError::Io { peer: self.peer, detail: detail.to_string() })
    }

    /// The caller's deadline passed with this link still busy (RDMA-4).
    pub fn handle_deadline(&mut self) -> TransportError {
        self.fail(TransportError::Timeout { peer: self.peer })
    }

    /// A write with immediate from the peer arrived; `written` is what it wrote into the
    /// slot the immediate names (empty for credits).
    pub fn handle_imm(&mut self, imm: u32, written: &[u8]) -> Result<(), TransportError> {
        self.check()?;
        match Imm::decode(imm) {
            Imm::Credit { consumed } => {
                // Cumulative counts: only one ahead of what we know, and not past what we
                // sent, is news; an older one arrived late and is ignored.
                let ahead = seq_diff(consumed, self.peer_consumed);
                let sent = self.in_flight();
                if ahead > sent {
                    if seq_diff(self.peer_consumed, consumed) <= self.cfg.slots * 2 {
                        return Ok(());
                    }
                    return Err(
                        self.corrupt(format!("credit {consumed} beyond {sent} chunks sent"))
                    );
                }
                self.peer_consumed = consumed;
                Ok(())
            }
            Imm::Poison { len } => {
                let len = len as usize;
                if len < 8 || written.len() < len {
                    return Err(self.corrupt(format!("poison of {len} bytes")));
                }
                let mut o = [0u8; 8];
                o.copy_from_slice(&written[..8]);
                let poison = Poison {
                    origin: u64::from_le_bytes(o) as usize,
                    reason: String::from_utf8_lossy(&written[8..len]).into_owned(),
                };
                self.poison_in = Some(poison.clone());
                if !self.expects.is_empty() {
                    return Err(self.fail(TransportError::Poisoned(poison)));
                }
                Ok(())
            }
            Imm::Data { first, seq } => {
                let ahead = seq_diff(seq, self.consumed);
                if ahead >= self.cfg.slots {
                    return Err(self.corrupt(format!(
                        "chunk {seq} outside the window [{}, +{})",
                        self.consumed, self.cfg.slots
                    )));
                }
                let slot = (seq % self.cfg.slots) as usize;
                if self.arrived[slot].is_some() {
                    return Err(self.corrupt(format!("chunk {seq} arrived twice")));
                }
                if written.len() > self.cfg.slot_bytes || written.len() & 3 != 0 {
                    return Err(self.corrupt(format!("chunk of {} bytes", written.len())));
                }
                let header = if first {
                    if written.len() < HEADER_BYTES {
                        return Err(self.corrupt("first chunk shorter than its header".into()));
                    }
                    let mut t = [0u8; Tag::WIRE_BYTES];
                    t.copy_from_slice(&written[..Tag::WIRE_BYTES]);
                    let mut l = [0u8; 8];
                    l.copy_from_slice(&written[Tag::WIRE_BYTES..Tag::WIRE_BYTES + 8]);
                    Some((Tag::decode(&t), u64::from_le_bytes(l)))
                } else {
                    None
                };
                self.arrived[slot] = Some(Arrival { seq, len: written.len(), header });
                Ok(())
            }
        }
    }

    fn corrupt(&mut self, detail: String) -> TransportError {
        self.fail(TransportError::Corrupt { peer: self.peer, detail })
    }

    /// The next piece for the front receive, if its chunk has arrived (RDMA-2). The shim
    /// copies the piece out of the slot before it polls again: the slot is released (and
    /// counted for credits) by this call.
    pub fn poll_deliver(&mut self) -> Result<Option<Deliver>, TransportError> {
        self.check()?;
        if let Some(p) = &self.poison_in {
            if !self.expects.is_empty() {
                let p = p.clone();
                return Err(self.fail(TransportError::Poisoned(p)));
            }
        }
        let Some(exp) = self.expects.front() else { return Ok(None) };
        let (exp_tag, exp_len, got) = (exp.tag, exp.len, exp.got);
        let slot = self.consumed % self.cfg.slots;
        let Some(arr) = self.arrived[slot as usize] else { return Ok(None) };
        debug_assert_eq!(arr.seq, self.consumed);
        let start = match arr.header {
            Some((tag, len)) => {
                if self.open_msg {
                    return Err(self.corrupt("a new message before the last one ended".into()));
                }
                if tag != exp_tag {
                    return Err(self.fail(TransportError::TagMismatch {
                        peer: self.peer,
                        expected: exp_tag,
                        got: tag,
                    }));
                }
                if len != exp_len as u64 {
                    return Err(self.fail(TransportError::LengthMismatch {
                        peer: self.peer,
                        expected: exp_len,
                        got: len as usize,
                    }));
                }
                HEADER_BYTES
            }
            None if self.open_msg => 0,
            None => return Err(self.corrupt("a continuation chunk with no message open".into())),
        };
        let n = arr.len - start;
        if got + n > exp_len {
            return Err(self.corrupt(format!("message runs past its {exp_len} bytes")));
        }
        self.arrived[slot as usize] = None;
        self.consumed = (self.consumed + 1) & SEQ_MASK;
        let done = got + n == exp_len;
        self.open_msg = !done;
        if done {
            self.expects.pop_front();
            self.credit_due = true;
        } else if let Some(e) = self.expects.front_mut() {
            e.got += n;
        }
        Ok(Some(Deliver { slot, range: start..arr.len, offset: got, done }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: deterministic latencies and losses.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn range(&mut self, lo: u64, hi: u64) -> u64 {
            lo + self.next() % (hi - lo + 1)
        }
    }

    enum Event {
        /// A write lands at side `to`.
        Arrive { to: usize, t: Transmit },
        /// The local completion of a write posted by side `at`.
        Done { at: usize },
    }

    /// Decides from a packet's number and content whether the network loses it.
    type DropRule = Box<dyn FnMut(u64, &Transmit) -> bool>;

    /// Two link endpoints (side 0 and side 1) joined by a network with per-packet latency in
    /// `[lat_lo, lat_hi]` virtual microseconds (a wide range reorders packets), and a rule
    /// that drops chosen packets. Slot memory is simulated, and RDMA-1 is checked on every
    /// arrival: a write must never land in a slot whose data is not yet delivered.
    struct Sim {
        cfg: ProtoConfig,
        side: [LinkProto; 2],
        mem: [Vec<Vec<u8>>; 2],
        occupied: [Vec<bool>; 2],
        now: u64,
        queue: Vec<(u64, u64, Event)>,
        order: u64,
        rng: Rng,
        lat: (u64, u64),
        drop: DropRule,
        packets: u64,
        max_in_flight: u32,
        received: [Vec<Vec<u8>>; 2],
    }

    // The two sides are indexed by number throughout: side s talks to side 1 - s.
    #[allow(clippy::needless_range_loop)]
    impl Sim {
        fn new(cfg: ProtoConfig, seed: u64, lat: (u64, u64)) -> Self {
            let mem = || vec![vec![0u8; cfg.slot_bytes()]; cfg.slots() as usize + 1];
            Sim {
                cfg,
                side: [LinkProto::new(1, cfg), LinkProto::new(0, cfg)],
                mem: [mem(), mem()],
                occupied: [vec![false; cfg.slots() as usize], vec![false; cfg.slots() as usize]],
                now: 0,
                queue: Vec::new(),
                order: 0,
                rng: Rng(seed),
                lat,
                drop: Box::new(|_, _| false),
                packets: 0,
                max_in_flight: 0,
                received: [Vec::new(), Vec::new()],
            }
        }

        fn schedule(&mut self, delay: u64, e: Event) {
            self.order += 1;
            self.queue.push((self.now + delay, self.order, e));
        }

        /// Sends every message of `msgs[s]` from side s and expects the other side's, then
        /// runs until both sides are idle or `deadline` (virtual) passes.
        fn exchange(
            &mut self,
            msgs: [&[Vec<u8>]; 2],
            deadline: u64,
        ) -> [Result<(), TransportError>; 2] {
            for s in 0..2 {
                for (i, m) in msgs[s].iter().enumerate() {
                    self.side[s].queue_send(tag(i), m).unwrap();
                }
                for (i, m) in msgs[1 - s].iter().enumerate() {
                    self.side[s].expect_recv(tag(i), m.len()).unwrap();
                    self.received[s].push(vec![0xAA; m.len()]);
                }
            }
            let mut res: [Option<Result<(), TransportError>>; 2] = [None, None];
            loop {
                for s in 0..2 {
                    if res[s].is_some() {
                        continue;
                    }
                    if let Err(e) = self.progress(s) {
                        res[s] = Some(Err(e));
                        continue;
                    }
                    if !self.side[s].sends_pending() && !self.side[s].recvs_pending() {
                        res[s] = Some(Ok(()));
                    }
                }
                // Credits still owed are flushed even after a side finished.
                for s in 0..2 {
                    if res[s].as_ref().is_some_and(|r| r.is_ok()) {
                        let _ = self.progress(s);
                    }
                }
                if res.iter().all(|r| r.is_some()) && self.queue.is_empty() {
                    break;
                }
                // next event
                let Some(i) =
                    (0..self.queue.len()).min_by_key(|&i| (self.queue[i].0, self.queue[i].1))
                else {
                    // Nothing in flight: whoever still waits hits the deadline.
                    self.now = self.now.max(deadline);
                    for s in 0..2 {
                        if res[s].is_none() {
                            res[s] = Some(Err(self.side[s].handle_deadline()));
                        }
                    }
                    break;
                };
                let (t, _, ev) = self.queue.swap_remove(i);
                if t > deadline {
                    self.now = deadline;
                    for s in 0..2 {
                        if res[s].is_none() {
                            res[s] = Some(Err(self.side[s].handle_deadline()));
                        }
                    }
                    break;
                }
                self.now = t;
                match ev {
                    Event::Done { at } => self.side[at].handle_write_done(),
                    Event::Arrive { to, t } => {
                        let r = self.arrive(to, t);
                        if let Err(e) = r {
                            if res[to].is_none() {
                                res[to] = Some(Err(e));
                            }
                        }
                    }
                }
            }
            res.map(|r| r.unwrap_or(Err(TransportError::Cancelled)))
        }

        fn arrive(&mut self, to: usize, t: Transmit) -> Result<(), TransportError> {
            match t {
                Transmit::ImmOnly { imm } => self.side[to].handle_imm(imm, &[]),
                Transmit::Write { slot, imm, bytes } => {
                    let s = slot as usize;
                    if s < self.cfg.slots() as usize {
                        assert!(!self.occupied[to][s], "RDMA-1: write into undelivered slot {s}");
                        self.occupied[to][s] = true;
                    }
                    self.mem[to][s][..bytes.len()].copy_from_slice(&bytes);
                    let written = self.mem[to][s][..bytes.len()].to_vec();
                    self.side[to].handle_imm(imm, &written)
                }
            }
        }

        fn progress(&mut self, s: usize) -> Result<(), TransportError> {
            while let Some(d) = self.side[s].poll_deliver()? {
                let idx = self.received[s].len() - self.side[s].expects.len() - usize::from(d.done);
                let piece = &self.mem[s][d.slot as usize][d.range.clone()];
                assert_eq!(d.offset % 4, 0, "TR-2: aligned offset");
                assert_eq!(piece.len() % 4, 0, "TR-2: 4-byte pieces");
                self.received[s][idx][d.offset..d.offset + piece.len()].copy_from_slice(piece);
                self.occupied[s][d.slot as usize] = false;
            }
            while let Some(t) = self.side[s].poll_transmit() {
                self.max_in_flight = self.max_in_flight.max(self.side[s].in_flight());
                let n = self.packets;
                self.packets += 1;
                let lat = self.rng.range(self.lat.0, self.lat.1);
                if (self.drop)(n, &t) {
                    continue; // lost: no arrival and no local completion
                }
                self.schedule(lat, Event::Arrive { to: 1 - s, t });
                let back = self.rng.range(self.lat.0, self.lat.1);
                self.schedule(lat + back, Event::Done { at: s });
            }
            Ok(())
        }
    }

    fn tag(i: usize) -> Tag {
        Tag { lane: 7, seq: i as u64, kind: 1, count: 0, root: u32::MAX, step: i as u32 }
    }

    fn payload(len: usize, salt: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt)).collect()
    }

    #[test]
    fn imm_encoding_round_trips() {
        // RDMA-3 (encoding half): every kind round trips, wrapping at 2^30.
        for imm in [
            Imm::Data { first: false, seq: 0 },
            Imm::Data { first: true, seq: SEQ_MASK },
            Imm::Credit { consumed: 12345 },
            Imm::Poison { len: 77 },
        ] {
            assert_eq!(Imm::decode(imm.encode()), imm);
        }
        assert_eq!(Imm::Data { first: false, seq: SEQ_MODULUS + 3 }.encode(), 3);
        assert_eq!(Imm::decode(0xC000_0005), Imm::Poison { len: 5 });
    }

    #[test]
    fn messages_of_every_size_arrive_whole_in_both_directions() {
        // RDMA-2 with a fixed latency: sizes around the header and slot boundaries.
        let cfg = ProtoConfig::new(256, 4).unwrap();
        let sizes = [0, 4, 256 - HEADER_BYTES, 256 - HEADER_BYTES + 4, 256, 512, 10 * 256 + 12];
        let a: Vec<Vec<u8>> = sizes.iter().map(|&n| payload(n, 1)).collect();
        let b: Vec<Vec<u8>> = sizes.iter().rev().map(|&n| payload(n, 2)).collect();
        let mut sim = Sim::new(cfg, 1, (5, 5));
        let r = sim.exchange([&a, &b], 1_000_000);
        assert_eq!(r, [Ok(()), Ok(())]);
        assert_eq!(sim.received[0], b);
        assert_eq!(sim.received[1], a);
    }

    #[test]
    fn credits_bound_the_chunks_in_flight() {
        // RDMA-1: with 2 slots, a 40-chunk message never has more than 2 chunks unreleased
        // (the simulator also asserts on every arrival that the slot was free).
        let cfg = ProtoConfig::new(64, 2).unwrap();
        let mut p = LinkProto::new(1, cfg);
        p.queue_send(tag(0), &payload(64 * 40, 3)).unwrap();
        let mut writes = 0;
        while let Some(t) = p.poll_transmit() {
            assert!(matches!(t, Transmit::Write { .. }));
            writes += 1;
        }
        assert_eq!(writes, 2, "the sender stops when the peer's slots are used up");
        // A credit for one chunk lets exactly one more out.
        p.handle_imm(Imm::Credit { consumed: 1 }.encode(), &[]).unwrap();
        assert!(p.poll_transmit().is_some());
        assert!(p.poll_transmit().is_none());

        let big = vec![payload(64 * 40, 3)];
        for seed in 0..8 {
            let mut sim = Sim::new(cfg, seed, (1, 40));
            let r = sim.exchange([&big, &big], 10_000_000);
            assert_eq!(r, [Ok(()), Ok(())], "seed {seed}");
            assert!(sim.max_in_flight <= 2, "seed {seed}: {} in flight", sim.max_in_flight);
            assert_eq!(sim.received[1], big);
        }
    }

    #[test]
    fn reordered_completions_still_deliver_in_order() {
        // RDMA-2: latencies from 1 to 200 reorder chunks and credits; every seed delivers
        // every byte once, in order.
        let cfg = ProtoConfig::new(128, 8).unwrap();
        for seed in 0..32u64 {
            let mut rng = Rng(seed ^ 0x55);
            let a: Vec<Vec<u8>> =
                (0..6).map(|i| payload(4 * rng.range(0, 300) as usize, i as u8)).collect();
            let b: Vec<Vec<u8>> =
                (0..4).map(|i| payload(4 * rng.range(0, 500) as usize, 100 + i as u8)).collect();
            let mut sim = Sim::new(cfg, seed, (1, 200));
            let r = sim.exchange([&a, &b], 100_000_000);
            assert_eq!(r, [Ok(()), Ok(())], "seed {seed}");
            assert_eq!(sim.received[0], b, "seed {seed}");
            assert_eq!(sim.received[1], a, "seed {seed}");
        }
    }

    #[test]
    fn a_lost_chunk_or_credit_ends_in_timeout_naming_the_peer() {
        // RDMA-4: drop the n-th packet for several n (chunks and credits alike); the waiting
        // side reports Timeout for its peer at the deadline, never hangs, and stays failed.
        let cfg = ProtoConfig::new(64, 2).unwrap();
        let a = vec![payload(64 * 6, 1)];
        let b = vec![payload(64 * 5, 2)];
        let mut timeouts = 0;
        for lost in 0..12u64 {
            let mut sim = Sim::new(cfg, lost, (1, 30));
            let was_credit = std::rc::Rc::new(std::cell::Cell::new(false));
            let flag = was_credit.clone();
            sim.drop = Box::new(move |n, t| {
                if n == lost {
                    flag.set(matches!(t, Transmit::ImmOnly { .. }));
                }
                n == lost
            });
            let r = sim.exchange([&a, &b], 1_000_000);
            if r.iter().all(|x| x.is_ok()) {
                // Only a credit may go missing unnoticed: a later cumulative credit covers it.
                assert!(was_credit.get(), "packet {lost}: a lost chunk went unnoticed");
                continue;
            }
            timeouts += 1;
            for (s, x) in r.iter().enumerate() {
                if let Err(e) = x {
                    assert_eq!(*e, TransportError::Timeout { peer: 1 - s }, "packet {lost}");
                    assert_eq!(sim.side[s].queue_send(tag(9), &[]), Err(e.clone()));
                }
            }
            assert!(sim.now <= 1_000_000);
        }
        assert!(timeouts >= 8, "only {timeouts} of 12 losses were detected");
    }

    #[test]
    fn completion_error_fails_the_link_for_good() {
        // RDMA-4: a failed work completion is an Io error on every later call.
        let cfg = ProtoConfig::new(64, 2).unwrap();
        let mut p = LinkProto::new(3, cfg);
        let e = p.handle_completion_error("IBV_WC_RETRY_EXC_ERR");
        assert_eq!(e, TransportError::Io { peer: 3, detail: "IBV_WC_RETRY_EXC_ERR".into() });
        assert_eq!(p.queue_send(tag(0), &[0; 4]), Err(e.clone()));
        assert_eq!(p.expect_recv(tag(0), 4), Err(e.clone()));
        assert_eq!(p.poll_deliver(), Err(e.clone()));
        assert_eq!(p.handle_imm(Imm::Credit { consumed: 0 }.encode(), &[]), Err(e));
        assert!(p.poll_transmit().is_none());
    }

    #[test]
    fn a_failed_credit_stops_writes_but_not_delivery_rdma_7() {
        // RDMA-7: the peer sent a whole message and left; our credit for it fails. The
        // message is still delivered, nothing waits on the credit, and only a later send to
        // that peer fails.
        let cfg = ProtoConfig::new(64, 2).unwrap();
        let (mut a, mut b) = (LinkProto::new(1, cfg), LinkProto::new(0, cfg));
        a.queue_send(tag(0), &[5u8; 8]).unwrap();
        let Some(Transmit::Write { imm, bytes, .. }) = a.poll_transmit() else { panic!() };
        a.handle_write_done();
        assert!(!a.sends_pending(), "the data write completed");
        b.expect_recv(tag(0), 8).unwrap();
        b.handle_imm(imm, &bytes).unwrap();
        let d = b.poll_deliver().unwrap().expect("delivered");
        assert!(d.done);
        // b's credit for it is posted and fails: the peer is gone.
        assert!(matches!(b.poll_transmit(), Some(Transmit::ImmOnly { .. })));
        assert!(!b.sends_pending(), "a credit is not waited for");
        assert!(!b.handle_write_error("IBV_WC_RETRY_EXC_ERR"), "a credit does not fail the link");
        assert_eq!(b.error(), None);
        assert!(b.poll_transmit().is_none(), "no more writes to that peer");
        let e = b.queue_send(tag(1), &[0; 4]).unwrap_err();
        assert!(matches!(e, TransportError::Io { peer: 0, .. }), "{e:?}");
        // A failed data write fails the link for good.
        let mut c = LinkProto::new(2, cfg);
        c.queue_send(tag(0), &[1u8; 8]).unwrap();
        assert!(c.poll_transmit().is_some());
        assert!(c.handle_write_error("IBV_WC_RETRY_EXC_ERR"));
        assert!(matches!(c.error(), Some(TransportError::Io { peer: 2, .. })));
    }

    #[test]
    fn out_of_window_duplicate_and_orphan_chunks_are_corrupt() {
        // RDMA-3
        let cfg = ProtoConfig::new(64, 4).unwrap();
        let chunk = vec![0u8; 16];
        let mut p = LinkProto::new(1, cfg);
        let e = p.handle_imm(Imm::Data { first: false, seq: 4 }.encode(), &chunk).unwrap_err();
        assert!(matches!(e, TransportError::Corrupt { peer: 1, .. }), "{e:?}");

        let mut p = LinkProto::new(1, cfg);
        p.handle_imm(Imm::Data { first: false, seq: 1 }.encode(), &chunk).unwrap();
        let e = p.handle_imm(Imm::Data { first: false, seq: 1 }.encode(), &chunk).unwrap_err();
        assert!(matches!(e, TransportError::Corrupt { .. }), "{e:?}");

        let mut p = LinkProto::new(1, cfg);
        p.expect_recv(tag(0), 16).unwrap();
        p.handle_imm(Imm::Data { first: false, seq: 0 }.encode(), &chunk).unwrap();
        let e = p.poll_deliver().unwrap_err();
        assert!(matches!(e, TransportError::Corrupt { .. }), "{e:?}");

        let mut p = LinkProto::new(1, cfg);
        let e = p.handle_imm(Imm::Credit { consumed: 3 }.encode(), &[]).unwrap_err();
        assert!(matches!(e, TransportError::Corrupt { .. }), "credit for nothing sent: {e:?}");
    }

    #[test]
    fn tag_or_length_mismatch_fails_before_delivery() {
        // RDMA-5
        let cfg = ProtoConfig::new(128, 4).unwrap();
        for (want_tag, want_len) in [(tag(1), 8), (tag(0), 12)] {
            let mut tx = LinkProto::new(1, cfg);
            tx.queue_send(tag(0), &payload(8, 0)).unwrap();
            let Some(Transmit::Write { imm, bytes, .. }) = tx.poll_transmit() else {
                panic!("no write")
            };
            let mut rx = LinkProto::new(0, cfg);
            rx.expect_recv(want_tag, want_len).unwrap();
            rx.handle_imm(imm, &bytes).unwrap();
            let e = rx.poll_deliver().unwrap_err();
            if want_tag != tag(0) {
                assert!(matches!(e, TransportError::TagMismatch { peer: 0, .. }), "{e:?}");
            } else {
                assert_eq!(e, TransportError::LengthMismatch { peer: 0, expected: 12, got: 8 });
            }
        }
    }

    #[test]
    fn poison_fails_the_peers_receives() {
        // RDMA-6: poison overtakes queued data and fails the pending receive.
        let cfg = ProtoConfig::new(128, 4).unwrap();
        let mut tx = LinkProto::new(1, cfg);
        tx.queue_send(tag(0), &payload(64, 0)).unwrap();
        tx.queue_poison(&Poison { origin: 0, reason: "rank 0: out of memory".into() });
        let Some(Transmit::Write { slot, imm, bytes }) = tx.poll_transmit() else {
            panic!("no write")
        };
        assert_eq!(slot, cfg.slots(), "poison goes to its own slot");
        let mut rx = LinkProto::new(0, cfg);
        rx.expect_recv(tag(0), 64).unwrap();
        let e = rx.handle_imm(imm, &bytes).unwrap_err();
        let want =
            TransportError::Poisoned(Poison { origin: 0, reason: "rank 0: out of memory".into() });
        assert_eq!(e, want);
        assert_eq!(rx.expect_recv(tag(1), 4), Err(want));
    }
}
