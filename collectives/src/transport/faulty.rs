//! A transport wrapper that injects link faults (delay, loss, corruption) between chosen pairs
//! of ranks, deterministically from a seed, for fault-injection tests and campaigns.
//!
//! Every rank of a group wraps its transport with the same [`LinkPlan`]. The wrapper frames
//! every message with a crc32 trailer that the receiving side verifies before handing a single
//! byte to the caller's sink, so a corrupted frame is reported as
//! [`TransportError::Corrupt`] and never used.
//!
//! Loss is modelled above a reliable transport: a frame the plan decides to lose costs the
//! sender a retransmission timeout (`rto * attempt`, linear back-off) and is sent again; after
//! `max_retries` consecutive losses the link is declared down and the exchange fails with
//! `PeerLost` naming the peer (the lane then poisons the others, LANE-3).
//!
//! - FAULTY-1: every decision (delay length, loss, corruption, corrupted bit) is a pure
//!   function of (seed, generation, lane, seq, step, sender, receiver, fault, attempt); the
//!   same plan on the same op sequence injects the same faults, whatever the timing.
//! - FAULTY-2: a corrupted frame is detected by the receiver's crc32 check and reported as
//!   `Corrupt { peer }` naming the sender; its bytes never reach the sink.
//! - FAULTY-3: a link fault applies to messages in both directions between its two ranks and
//!   to no other pair.
//! - FAULTY-4: with no fault on a link, the wrapper delivers exactly the bytes sent.

use super::{LaneLinks, Poison, RecvOp, SendOp, Sink, Tag, Transport, TransportError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a link fault does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LinkFaultKind {
    /// Every message waits `ms` plus a uniform jitter in `[-jitter_ms, jitter_ms]` (at least 0).
    Delay {
        /// Base delay in milliseconds.
        ms: u64,
        /// Jitter bound in milliseconds.
        jitter_ms: u64,
    },
    /// Each transmission is lost with probability `p` (then retransmitted).
    Drop {
        /// Loss probability in `[0, 1]`.
        p: f64,
    },
    /// Each message is corrupted (one bit flipped) with probability `p`.
    Corrupt {
        /// Corruption probability in `[0, 1]`.
        p: f64,
    },
}

/// A fault on the link between ranks `a` and `b` (both directions, FAULTY-3).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkFault {
    /// One end.
    pub a: usize,
    /// The other end.
    pub b: usize,
    /// What happens on it.
    pub kind: LinkFaultKind,
}

impl LinkFault {
    fn on(&self, x: usize, y: usize) -> bool {
        (self.a == x && self.b == y) || (self.a == y && self.b == x)
    }
}

/// What the wrapper did or saw, reported to the plan's observer.
#[derive(Clone, Debug, PartialEq)]
pub enum LinkEventKind {
    /// A message was held back this long.
    Delayed(Duration),
    /// A transmission was lost (the `attempt`-th, from 1).
    Dropped {
        /// Attempt number.
        attempt: u32,
    },
    /// A message got through after this many lost transmissions.
    Recovered {
        /// Lost transmissions before it.
        lost: u32,
    },
    /// Too many consecutive losses: the link was declared down.
    LinkDown {
        /// Lost transmissions.
        lost: u32,
    },
    /// The sender flipped a bit of a frame.
    Corrupted,
    /// The receiver's checksum caught a corrupted frame.
    CorruptDetected,
}

/// One observed link event.
#[derive(Clone, Debug)]
pub struct LinkEvent {
    /// What happened.
    pub kind: LinkEventKind,
    /// Sending rank.
    pub from: usize,
    /// Receiving rank.
    pub to: usize,
    /// Lane hash of the message's tag.
    pub lane: u32,
    /// Op sequence number on the lane.
    pub seq: u64,
    /// When.
    pub at: Instant,
}

/// Callback for link events (logging, counters, traces).
pub type LinkObserver = Arc<dyn Fn(&LinkEvent) + Send + Sync>;

/// The link faults of a group and how to draw them.
#[derive(Clone)]
pub struct LinkPlan {
    /// The faults.
    pub faults: Vec<LinkFault>,
    /// Seed of every decision (FAULTY-1).
    pub seed: u64,
    /// Mixed into every decision, so that a restarted job (next generation) draws afresh.
    pub generation: u64,
    /// Consecutive losses before the link is declared down.
    pub max_retries: u32,
    /// Retransmission timeout of the first retry.
    pub rto: Duration,
    /// Called on every event.
    pub observer: Option<LinkObserver>,
}

impl std::fmt::Debug for LinkPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkPlan")
            .field("faults", &self.faults)
            .field("seed", &self.seed)
            .field("generation", &self.generation)
            .finish()
    }
}

impl LinkPlan {
    /// A plan with defaults: 8 retries, 2 ms first retransmission timeout, no observer.
    pub fn new(faults: Vec<LinkFault>, seed: u64) -> Self {
        LinkPlan {
            faults,
            seed,
            generation: 0,
            max_retries: 8,
            rto: Duration::from_millis(2),
            observer: None,
        }
    }

    fn observe(&self, kind: LinkEventKind, from: usize, to: usize, tag: &Tag) {
        if let Some(o) = &self.observer {
            o(&LinkEvent { kind, from, to, lane: tag.lane, seq: tag.seq, at: Instant::now() });
        }
    }

    /// A 64-bit draw for one decision (FAULTY-1).
    fn draw(&self, tag: &Tag, from: usize, to: usize, fault: usize, attempt: u32) -> u64 {
        let mut h = splitmix(self.seed ^ splitmix(self.generation));
        for v in [
            u64::from(tag.lane),
            tag.seq,
            u64::from(tag.step),
            from as u64,
            to as u64,
            fault as u64,
            u64::from(attempt),
        ] {
            h = splitmix(h ^ v);
        }
        h
    }

    fn unit(&self, tag: &Tag, from: usize, to: usize, fault: usize, attempt: u32) -> f64 {
        (self.draw(tag, from, to, fault, attempt) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Wraps any transport with a [`LinkPlan`].
pub struct FaultyTransport {
    inner: Arc<dyn Transport>,
    plan: Arc<LinkPlan>,
}

impl FaultyTransport {
    /// Wraps `inner`; every rank of the group must use the same plan.
    pub fn new(inner: Arc<dyn Transport>, plan: Arc<LinkPlan>) -> Self {
        FaultyTransport { inner, plan }
    }
}

impl Transport for FaultyTransport {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    fn open_lane(
        &self,
        lane: &str,
        deadline: Instant,
    ) -> Result<Box<dyn LaneLinks>, TransportError> {
        let inner = self.inner.open_lane(lane, deadline)?;
        Ok(Box::new(FaultyLinks { inner, rank: self.inner.rank(), plan: self.plan.clone() }))
    }
}

/// A sink owned by the wrapper (it buffers a frame until its crc is checked).
type BoxSink<'a> = Box<dyn FnMut(usize, &[u8]) + 'a>;

struct FaultyLinks {
    inner: Box<dyn LaneLinks>,
    rank: usize,
    plan: Arc<LinkPlan>,
}

/// Sleeps until `until`, or the deadline, or the cancel flag, whichever comes first.
fn hold(until: Instant, deadline: Instant, cancel: &AtomicBool) -> Result<(), TransportError> {
    let end = until.min(deadline);
    loop {
        if cancel.load(Ordering::Acquire) {
            return Err(TransportError::Cancelled);
        }
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        std::thread::sleep((end - now).min(Duration::from_millis(5)));
    }
}

impl LaneLinks for FaultyLinks {
    fn staging_bytes(&self) -> usize {
        self.inner.staging_bytes()
    }

    fn exchange(
        &mut self,
        tag: Tag,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError> {
        let (me, plan) = (self.rank, &*self.plan);
        let mut wait = Duration::ZERO;
        let mut corrupt = vec![false; sends.len()];
        for (si, s) in sends.iter().enumerate() {
            for (fi, f) in plan.faults.iter().enumerate() {
                if !f.on(me, s.peer) {
                    continue;
                }
                match f.kind {
                    LinkFaultKind::Delay { ms, jitter_ms } => {
                        let span = 2 * jitter_ms + 1;
                        let j =
                            (plan.draw(&tag, me, s.peer, fi, 0) % span) as i64 - jitter_ms as i64;
                        let d = Duration::from_millis((ms as i64 + j).max(0) as u64);
                        plan.observe(LinkEventKind::Delayed(d), me, s.peer, &tag);
                        wait = wait.max(d);
                    }
                    LinkFaultKind::Drop { p } => {
                        let mut lost = 0u32;
                        while plan.unit(&tag, me, s.peer, fi, lost) < p {
                            lost += 1;
                            plan.observe(
                                LinkEventKind::Dropped { attempt: lost },
                                me,
                                s.peer,
                                &tag,
                            );
                            if lost > plan.max_retries {
                                plan.observe(LinkEventKind::LinkDown { lost }, me, s.peer, &tag);
                                return Err(TransportError::PeerLost {
                                    peer: s.peer,
                                    detail: format!(
                                        "link {me}-{}: {lost} consecutive transmissions lost",
                                        s.peer
                                    ),
                                });
                            }
                            wait += plan.rto * lost;
                        }
                        if lost > 0 {
                            plan.observe(LinkEventKind::Recovered { lost }, me, s.peer, &tag);
                        }
                    }
                    LinkFaultKind::Corrupt { p } => {
                        if plan.unit(&tag, me, s.peer, fi, 0) < p {
                            corrupt[si] = true;
                        }
                    }
                }
            }
        }
        if wait > Duration::ZERO {
            hold(Instant::now() + wait, deadline, cancel)?;
        }
        // Frames: payload then its crc32; a corrupted frame flips one payload bit after the
        // crc was taken (or a crc bit when the payload is empty).
        let frames: Vec<Vec<u8>> = sends
            .iter()
            .zip(&corrupt)
            .map(|(s, &bad)| {
                let mut f = Vec::with_capacity(s.data.len() + 4);
                f.extend_from_slice(s.data);
                f.extend_from_slice(&crc32fast::hash(s.data).to_le_bytes());
                if bad {
                    let h = plan.draw(&tag, me, s.peer, usize::MAX, 0);
                    let at = (h % f.len() as u64) as usize;
                    let at = if s.data.is_empty() { at } else { at % s.data.len() };
                    f[at] ^= 1 << (h >> 61);
                    plan.observe(LinkEventKind::Corrupted, me, s.peer, &tag);
                }
                f
            })
            .collect();
        let wrapped: Vec<SendOp<'_>> = sends
            .iter()
            .zip(&frames)
            .map(|(s, f)| SendOp { peer: s.peer, data: f, copied: false })
            .collect();
        // Receive into 4-byte-aligned words so that the caller's sink sees aligned pieces (TR-2).
        let mut bufs: Vec<Vec<u32>> = recvs.iter().map(|r| vec![0u32; r.len / 4 + 1]).collect();
        {
            let mut sinks: Vec<BoxSink<'_>> = bufs
                .iter_mut()
                .map(|b| {
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(b.as_mut_slice());
                    Box::new(move |off: usize, piece: &[u8]| {
                        if let Some(dst) = bytes.get_mut(off..off + piece.len()) {
                            dst.copy_from_slice(piece);
                        }
                    }) as BoxSink<'_>
                })
                .collect();
            let mut inner_recvs: Vec<RecvOp<'_>> = recvs
                .iter()
                .zip(sinks.iter_mut())
                .map(|(r, s)| RecvOp { peer: r.peer, len: r.len + 4, sink: Sink::Fn(&mut **s) })
                .collect();
            self.inner.exchange(tag, &wrapped, &mut inner_recvs, deadline, cancel)?;
        }
        // FAULTY-2: verify every frame before any byte reaches a caller's sink.
        for (r, b) in recvs.iter().zip(&bufs) {
            let bytes: &[u8] = bytemuck::cast_slice(b.as_slice());
            let got = u32::from_le_bytes([
                bytes[r.len],
                bytes[r.len + 1],
                bytes[r.len + 2],
                bytes[r.len + 3],
            ]);
            let want = crc32fast::hash(&bytes[..r.len]);
            if got != want {
                plan.observe(LinkEventKind::CorruptDetected, r.peer, me, &tag);
                return Err(TransportError::Corrupt {
                    peer: r.peer,
                    detail: format!(
                        "crc32 {want:08x} of {} bytes (lane op seq {}, step {}) does not match the frame's {got:08x}",
                        r.len, tag.seq, tag.step
                    ),
                });
            }
        }
        for (r, b) in recvs.iter_mut().zip(&bufs) {
            let bytes: &[u8] = bytemuck::cast_slice(b.as_slice());
            if r.len > 0 {
                r.sink.put(0, &bytes[..r.len]);
            }
        }
        Ok(())
    }

    fn poison(&mut self, poison: &Poison) {
        self.inner.poison(poison);
    }

    // The wrapped transport's schedule preferences, so that faults hit the schedules it runs
    // in production.
    fn prefers_direct_gather(&self) -> bool {
        self.inner.prefers_direct_gather()
    }

    fn prefers_pieced_gather(&self) -> bool {
        self.inner.prefers_pieced_gather()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::local::{LocalFabric, LocalTransport};

    fn pair(plan: LinkPlan) -> Vec<Box<dyn LaneLinks>> {
        let fabric = LocalFabric::new(2);
        let plan = Arc::new(plan);
        let ts: Vec<FaultyTransport> = (0..2)
            .map(|r| {
                FaultyTransport::new(
                    Arc::new(LocalTransport::new(fabric.clone(), r, Duration::ZERO)),
                    plan.clone(),
                )
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        std::thread::scope(|s| {
            let hs: Vec<_> =
                ts.iter().map(|t| s.spawn(move || t.open_lane("x", deadline).unwrap())).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Rank 0 sends `msg` to rank 1; returns rank 1's result and bytes.
    fn send_one(
        links: &mut [Box<dyn LaneLinks>],
        seq: u64,
        msg: &[u8],
    ) -> (Result<(), TransportError>, Result<(), TransportError>, Vec<u8>) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let cancel = AtomicBool::new(false);
        let tag = Tag { seq, ..Tag::default() };
        let (l0, l1) = links.split_at_mut(1);
        let mut got = vec![0u8; msg.len()];
        let (r0, r1) = std::thread::scope(|s| {
            let c = &cancel;
            let h = s.spawn(move || {
                l0[0].exchange(
                    tag,
                    &[SendOp { peer: 1, data: msg, copied: false }],
                    &mut [],
                    deadline,
                    c,
                )
            });
            let mut sink = |off: usize, p: &[u8]| got[off..off + p.len()].copy_from_slice(p);
            let r1 = l1[0].exchange(
                tag,
                &[],
                &mut [RecvOp { peer: 0, len: msg.len(), sink: Sink::Fn(&mut sink) }],
                deadline,
                c,
            );
            (h.join().unwrap(), r1)
        });
        (r0, r1, got)
    }

    #[test]
    fn clean_link_delivers_exact_bytes() {
        // FAULTY-4
        let mut l = pair(LinkPlan::new(vec![], 1));
        let msg: Vec<u8> = (0..64u8).collect();
        let (a, b, got) = send_one(&mut l, 0, &msg);
        assert_eq!((a, b), (Ok(()), Ok(())));
        assert_eq!(got, msg);
    }

    #[test]
    fn corruption_is_detected_and_never_delivered() {
        // FAULTY-2: p = 1 corrupts every frame; the sink must stay untouched.
        let f = LinkFault { a: 0, b: 1, kind: LinkFaultKind::Corrupt { p: 1.0 } };
        let mut l = pair(LinkPlan::new(vec![f], 7));
        let msg = vec![0xAAu8; 64];
        let (a, b, got) = send_one(&mut l, 0, &msg);
        assert_eq!(a, Ok(()));
        assert!(matches!(b, Err(TransportError::Corrupt { peer: 0, .. })), "{b:?}");
        assert_eq!(got, vec![0u8; 64]);
    }

    #[test]
    fn faults_on_another_pair_do_not_apply() {
        // FAULTY-3
        let f = LinkFault { a: 0, b: 2, kind: LinkFaultKind::Corrupt { p: 1.0 } };
        let mut l = pair(LinkPlan::new(vec![f], 7));
        let (a, b, got) = send_one(&mut l, 0, &[1, 2, 3, 4]);
        assert_eq!((a, b), (Ok(()), Ok(())));
        assert_eq!(got, vec![1, 2, 3, 4]);
    }

    #[test]
    fn losses_are_retransmitted_or_reported() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let mut plan =
            LinkPlan::new(vec![LinkFault { a: 1, b: 0, kind: LinkFaultKind::Drop { p: 0.5 } }], 3);
        plan.rto = Duration::from_micros(100);
        plan.observer =
            Some(Arc::new(move |e: &LinkEvent| s2.lock().unwrap().push(e.kind.clone())));
        let mut l = pair(plan);
        for seq in 0..40 {
            let msg = vec![seq as u8; 8];
            let (a, b, got) = send_one(&mut l, seq, &msg);
            assert_eq!((a, b), (Ok(()), Ok(())));
            assert_eq!(got, msg);
        }
        let seen = seen.lock().unwrap();
        let drops = seen.iter().filter(|k| matches!(k, LinkEventKind::Dropped { .. })).count();
        let recovered =
            seen.iter().filter(|k| matches!(k, LinkEventKind::Recovered { .. })).count();
        // 40 messages at p = 0.5 lose some and recover every one of those.
        assert!(drops > 0 && recovered > 0, "{drops} {recovered}");
        // p = 1 loses everything: the link is reported down naming the peer.
        let mut plan =
            LinkPlan::new(vec![LinkFault { a: 0, b: 1, kind: LinkFaultKind::Drop { p: 1.0 } }], 3);
        plan.rto = Duration::from_micros(100);
        let mut l = pair(plan);
        let deadline = Instant::now() + Duration::from_secs(20);
        let r = l[0].exchange(
            Tag::default(),
            &[SendOp { peer: 1, data: &[0; 4], copied: false }],
            &mut [],
            deadline,
            &AtomicBool::new(false),
        );
        assert!(matches!(r, Err(TransportError::PeerLost { peer: 1, .. })), "{r:?}");
    }

    #[test]
    fn decisions_depend_only_on_seed_and_op() {
        // FAULTY-1, and the runtime's FAULT-4 that rests on it.
        let p = LinkPlan::new(vec![], 42);
        let t = Tag { lane: 9, seq: 3, step: 1, ..Tag::default() };
        assert_eq!(p.draw(&t, 0, 1, 0, 0), p.draw(&t, 0, 1, 0, 0));
        assert_ne!(p.draw(&t, 0, 1, 0, 0), p.draw(&t, 1, 0, 0, 0));
        let mut q = p.clone();
        q.generation = 1;
        assert_ne!(p.draw(&t, 0, 1, 0, 0), q.draw(&t, 0, 1, 0, 0));
    }
}
