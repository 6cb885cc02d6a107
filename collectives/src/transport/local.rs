//! The `local` transport: ranks are threads of one process sharing an in-memory fabric.
//!
//! Zero-copy: a sender posts a descriptor (tag, pointer, length) into the mailbox of its
//! (lane, src, dst) link; the receiver checks the tag and hands the sender's memory to its
//! sink directly (one piece), then acks by emptying the slot. The sender's `exchange` returns
//! only once every send is acked, or after revoking the unacked ones (TR-5).
//!
//! - LOCAL-1: a mailbox holds at most one message; the receiver reads the sender's memory
//!   only while holding the slot lock and the slot is full, and the sender revokes a message
//!   (on error) under the same lock, so the memory is never read after `exchange` returns.
//! - LOCAL-2: waiting spins for `spin` first, then yields, then sleeps briefly: never a busy
//!   loop for long (W=8 ranks share 2 cores in tests).
//! - LOCAL-3: dropping a rank's lane endpoint marks it closed; a peer waiting on it gets
//!   `PeerLost` (TR-4).
//! - LOCAL-4: a timeout names a rank that has not entered the op when the awaited peer has
//!   (it is only waiting further down the chain), so every rank names the one that is late.
//! - LOCAL-5: with a link rate R ([`LocalFabric::with_link_rate`]), a message of n bytes
//!   posted on the directed link src -> dst at time t is not read before
//!   `max(t, the link's previous message's delivery) + n / R`: each link delivers at most R
//!   bytes per second, shared by every lane on it. Waiting for a delivery time sleeps (it
//!   never spins). Without a rate nothing is timed and messages are read as soon as posted.

use super::{LaneLinks, Poison, RecvOp, SendOp, Tag, Transport, TransportError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Clone, Copy)]
struct Desc {
    tag: Tag,
    ptr: *const u8,
    len: usize,
    /// Delivery time under a link rate (LOCAL-5).
    ready_at: Option<Instant>,
}

// SAFETY: the pointer is only dereferenced under LOCAL-1 (while the sender keeps the memory
// borrowed inside `exchange`); moving the descriptor between threads is what it is for.
unsafe impl Send for Desc {}

#[derive(Default)]
struct Mailbox {
    full: AtomicBool,
    slot: Mutex<Option<Desc>>,
}

struct LaneFabric {
    world: usize,
    /// Indexed `src * world + dst`.
    boxes: Vec<Mailbox>,
    closed: Vec<AtomicBool>,
    poisoned: Vec<AtomicBool>,
    poison: Vec<Mutex<Option<Poison>>>,
    /// Per rank: 1 + the highest op sequence number it has entered an exchange for
    /// (LOCAL-4).
    entered: Vec<AtomicU64>,
}

impl LaneFabric {
    fn new(world: usize) -> Self {
        LaneFabric {
            world,
            boxes: (0..world * world).map(|_| Mailbox::default()).collect(),
            closed: (0..world).map(|_| AtomicBool::new(false)).collect(),
            poisoned: (0..world).map(|_| AtomicBool::new(false)).collect(),
            poison: (0..world).map(|_| Mutex::new(None)).collect(),
            entered: (0..world).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn mailbox(&self, src: usize, dst: usize) -> &Mailbox {
        &self.boxes[src * self.world + dst]
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Per directed link, when everything posted on it so far is delivered (LOCAL-5).
struct RateLimit {
    world: usize,
    bytes_per_s: f64,
    /// Indexed `src * world + dst`; `None` until the first message.
    free_at: Vec<Mutex<Option<Instant>>>,
}

impl RateLimit {
    /// Books `len` bytes on src -> dst; returns when they are delivered.
    fn reserve(&self, src: usize, dst: usize, len: usize) -> Instant {
        let now = Instant::now();
        let mut free = lock(&self.free_at[src * self.world + dst]);
        let start = free.map_or(now, |t| t.max(now));
        let ready = start + Duration::from_secs_f64(len as f64 / self.bytes_per_s);
        *free = Some(ready);
        ready
    }
}

/// Sleeps towards `t`, waking a little early: thread sleeps overshoot by tens of
/// microseconds, and the last stretch is cheaper to yield through than to oversleep.
fn sleep_towards(t: Instant, deadline: Instant) {
    let now = Instant::now();
    let until = t.min(deadline);
    if until <= now {
        return;
    }
    let left = until - now;
    if left > Duration::from_micros(200) {
        // Wake at least every 5 ms to see cancellation and poison.
        std::thread::sleep((left - Duration::from_micros(100)).min(Duration::from_millis(5)));
    } else {
        std::thread::yield_now();
    }
}

/// The in-process fabric shared by the ranks of one local group.
pub struct LocalFabric {
    world: usize,
    lanes: Mutex<HashMap<String, Arc<LaneFabric>>>,
    rate: Option<Arc<RateLimit>>,
}

impl LocalFabric {
    /// A fabric for `world` ranks, links unlimited.
    pub fn new(world: usize) -> Arc<Self> {
        Self::with_link_rate(world, None)
    }

    /// A fabric for `world` ranks whose directed links each deliver at most `bytes_per_s`
    /// bytes per second (LOCAL-5); `None` or 0: unlimited.
    pub fn with_link_rate(world: usize, bytes_per_s: Option<u64>) -> Arc<Self> {
        let rate = bytes_per_s.filter(|r| *r > 0).map(|r| {
            Arc::new(RateLimit {
                world,
                bytes_per_s: r as f64,
                free_at: (0..world * world).map(|_| Mutex::new(None)).collect(),
            })
        });
        Arc::new(LocalFabric { world, lanes: Mutex::new(HashMap::new()), rate })
    }

    /// The per-link rate limit in bytes per second, if any.
    pub fn link_rate(&self) -> Option<u64> {
        self.rate.as_ref().map(|r| r.bytes_per_s as u64)
    }
}

/// One rank's handle on a [`LocalFabric`].
pub struct LocalTransport {
    fabric: Arc<LocalFabric>,
    rank: usize,
    spin: Duration,
}

impl LocalTransport {
    /// Rank `rank`'s transport on `fabric`; waiters spin for `spin` before yielding (LOCAL-2).
    pub fn new(fabric: Arc<LocalFabric>, rank: usize, spin: Duration) -> Self {
        assert!(rank < fabric.world, "rank {rank} outside world {}", fabric.world);
        LocalTransport { fabric, rank, spin }
    }
}

impl Transport for LocalTransport {
    fn name(&self) -> &'static str {
        "local"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.fabric.world
    }

    fn open_lane(
        &self,
        lane: &str,
        _deadline: Instant,
    ) -> Result<Box<dyn LaneLinks>, TransportError> {
        // Mailboxes exist as soon as any rank opens the lane, so nobody has to wait here; a
        // peer that never opens shows up as a timeout of the first exchange.
        let fabric = lock(&self.fabric.lanes)
            .entry(lane.to_string())
            .or_insert_with(|| Arc::new(LaneFabric::new(self.fabric.world)))
            .clone();
        if fabric.closed[self.rank].load(Ordering::Acquire) {
            return Err(TransportError::Setup(format!(
                "lane '{lane}' was already closed by rank {}",
                self.rank
            )));
        }
        Ok(Box::new(LocalLinks {
            fabric,
            me: self.rank,
            spin: self.spin,
            rate: self.fabric.rate.clone(),
        }))
    }
}

struct LocalLinks {
    fabric: Arc<LaneFabric>,
    me: usize,
    spin: Duration,
    rate: Option<Arc<RateLimit>>,
}

/// What a receive attempt found.
enum Recv {
    Done,
    /// Nothing posted yet.
    Empty,
    /// Posted, deliverable at this time (LOCAL-5).
    NotBefore(Instant),
}

impl Drop for LocalLinks {
    fn drop(&mut self) {
        self.fabric.closed[self.me].store(true, Ordering::Release);
    }
}

/// Waiting policy (LOCAL-2).
struct Backoff {
    start: Instant,
    spin: Duration,
    sleeps: u32,
}

impl Backoff {
    fn new(spin: Duration) -> Self {
        Backoff { start: Instant::now(), spin, sleeps: 0 }
    }

    fn wait(&mut self) {
        let waited = self.start.elapsed();
        if waited < self.spin {
            for _ in 0..32 {
                std::hint::spin_loop();
            }
        } else if waited < self.spin + Duration::from_micros(500) {
            std::thread::yield_now();
        } else {
            self.sleeps = (self.sleeps + 1).min(6);
            std::thread::sleep(Duration::from_micros(10 << self.sleeps));
        }
    }
}

#[derive(PartialEq)]
enum SendState {
    Waiting,
    Posted,
    Done,
}

impl LocalLinks {
    fn check_poison(&self) -> Result<(), TransportError> {
        if self.fabric.poisoned[self.me].load(Ordering::Acquire) {
            if let Some(p) = lock(&self.fabric.poison[self.me]).clone() {
                return Err(TransportError::Poisoned(p));
            }
        }
        Ok(())
    }

    /// The error for a closed peer: its poison when it left one (a failing rank poisons
    /// before it closes, so having seen `closed` makes the poison visible), else `PeerLost`.
    fn lost(&self, peer: usize) -> TransportError {
        match self.check_poison() {
            Err(e) => e,
            Ok(()) => TransportError::PeerLost { peer, detail: "lane endpoint closed".into() },
        }
    }

    /// LOCAL-4: the rank to blame for a timeout. The peer we wait on may itself be waiting
    /// inside the same op; then the rank that has not entered the op is the one that did
    /// not arrive.
    fn missing(&self, tag: Tag, waited_on: usize) -> usize {
        let entered = |r: usize| self.fabric.entered[r].load(Ordering::Acquire) > tag.seq;
        if !entered(waited_on) {
            return waited_on;
        }
        (0..self.fabric.world).find(|&r| r != self.me && !entered(r)).unwrap_or(waited_on)
    }

    fn revoke(&self, sends: &[SendOp<'_>], states: &[SendState]) {
        for (s, st) in sends.iter().zip(states) {
            if *st == SendState::Posted {
                let mb = self.fabric.mailbox(self.me, s.peer);
                let mut slot = lock(&mb.slot);
                if slot.take().is_some() {
                    mb.full.store(false, Ordering::Release);
                }
            }
        }
    }

    fn try_recv(&self, tag: Tag, r: &mut RecvOp<'_>) -> Result<Recv, TransportError> {
        let mb = self.fabric.mailbox(r.peer, self.me);
        if !mb.full.load(Ordering::Acquire) {
            if self.fabric.closed[r.peer].load(Ordering::Acquire)
                && !mb.full.load(Ordering::Acquire)
            {
                return Err(self.lost(r.peer));
            }
            return Ok(Recv::Empty);
        }
        let mut slot = lock(&mb.slot);
        let Some(d) = *slot else { return Ok(Recv::Empty) };
        if d.tag != tag {
            return Err(TransportError::TagMismatch { peer: r.peer, expected: tag, got: d.tag });
        }
        if d.len != r.len {
            return Err(TransportError::LengthMismatch {
                peer: r.peer,
                expected: r.len,
                got: d.len,
            });
        }
        if let Some(t) = d.ready_at {
            if Instant::now() < t {
                return Ok(Recv::NotBefore(t));
            }
        }
        if d.len > 0 {
            // SAFETY: LOCAL-1: the slot is full and locked, so the sender is still inside its
            // exchange holding `d.len` readable bytes at `d.ptr`, and cannot revoke them
            // before we release the lock. The sender's buffer is aligned for f32 (TR-2).
            let piece = unsafe { std::slice::from_raw_parts(d.ptr, d.len) };
            r.sink.put(0, piece);
        }
        *slot = None;
        mb.full.store(false, Ordering::Release);
        Ok(Recv::Done)
    }
}

impl LaneLinks for LocalLinks {
    fn exchange(
        &mut self,
        tag: Tag,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError> {
        self.check_poison()?;
        self.fabric.entered[self.me].fetch_max(tag.seq + 1, Ordering::AcqRel);
        let mut sstate: Vec<SendState> = sends.iter().map(|_| SendState::Waiting).collect();
        let mut sready: Vec<Option<Instant>> = vec![None; sends.len()];
        let mut rdone: Vec<bool> = vec![false; recvs.len()];
        let mut backoff = Backoff::new(self.spin);
        loop {
            let mut pending = false;
            let mut late_peer = None;
            // LOCAL-5: the earliest delivery time among posted receives and sends, and
            // whether some receive still waits for its sender to post.
            let mut recv_wake: Option<Instant> = None;
            let mut send_wake: Option<Instant> = None;
            let mut recv_unposted = false;
            // Sends: post each when no earlier send to the same peer is in flight (TR-1).
            for i in 0..sends.len() {
                let s = &sends[i];
                let mb = self.fabric.mailbox(self.me, s.peer);
                if sstate[i] == SendState::Waiting
                    && !sends[..i]
                        .iter()
                        .zip(&sstate)
                        .any(|(p, st)| p.peer == s.peer && *st != SendState::Done)
                {
                    if self.fabric.closed[s.peer].load(Ordering::Acquire) {
                        self.revoke(sends, &sstate);
                        return Err(self.lost(s.peer));
                    }
                    let ready_at = match &self.rate {
                        Some(rate) if !s.data.is_empty() => {
                            Some(rate.reserve(self.me, s.peer, s.data.len()))
                        }
                        _ => None,
                    };
                    sready[i] = ready_at;
                    let mut slot = lock(&mb.slot);
                    *slot = Some(Desc { tag, ptr: s.data.as_ptr(), len: s.data.len(), ready_at });
                    mb.full.store(true, Ordering::Release);
                    sstate[i] = SendState::Posted;
                }
                if sstate[i] == SendState::Posted {
                    if !mb.full.load(Ordering::Acquire) {
                        sstate[i] = SendState::Done;
                    } else if self.fabric.closed[s.peer].load(Ordering::Acquire) {
                        self.revoke(sends, &sstate);
                        return Err(self.lost(s.peer));
                    }
                }
                if sstate[i] != SendState::Done {
                    pending = true;
                    late_peer.get_or_insert(s.peer);
                    if let (SendState::Posted, Some(t)) = (&sstate[i], sready[i]) {
                        send_wake = Some(send_wake.map_or(t, |w| w.min(t)));
                    }
                }
            }
            for i in 0..recvs.len() {
                if rdone[i]
                    || recvs[..i].iter().zip(&rdone).any(|(p, d)| p.peer == recvs[i].peer && !*d)
                {
                    continue;
                }
                match self.try_recv(tag, &mut recvs[i]) {
                    Ok(Recv::Done) => rdone[i] = true,
                    Ok(Recv::Empty) => recv_unposted = true,
                    Ok(Recv::NotBefore(t)) => {
                        recv_wake = Some(recv_wake.map_or(t, |w| w.min(t)));
                    }
                    Err(e) => {
                        self.revoke(sends, &sstate);
                        return Err(e);
                    }
                }
                if !rdone[i] {
                    pending = true;
                    late_peer.get_or_insert(recvs[i].peer);
                }
            }
            if !pending && rdone.iter().all(|d| *d) {
                return Ok(());
            }
            let failure = if cancel.load(Ordering::Acquire) {
                Some(TransportError::Cancelled)
            } else if let Err(e) = self.check_poison() {
                Some(e)
            } else if Instant::now() >= deadline {
                Some(TransportError::Timeout {
                    peer: self.missing(tag, late_peer.unwrap_or(self.me)),
                })
            } else {
                None
            };
            if let Some(e) = failure {
                self.revoke(sends, &sstate);
                return Err(e);
            }
            // LOCAL-5: sleep until a delivery when nothing else can happen before it. A
            // receive whose sender has not posted yet must be read promptly once posted (the
            // sender waits for it), so it keeps the ordinary backoff.
            let wake = match (recv_wake, send_wake) {
                _ if recv_unposted => None,
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            match wake {
                Some(t) if t > Instant::now() => {
                    sleep_towards(t, deadline);
                    backoff = Backoff::new(self.spin);
                }
                _ => backoff.wait(),
            }
        }
    }

    fn poison(&mut self, poison: &Poison) {
        for p in 0..self.fabric.world {
            if p == self.me {
                continue;
            }
            let mut slot = lock(&self.fabric.poison[p]);
            if slot.is_none() {
                *slot = Some(poison.clone());
                self.fabric.poisoned[p].store(true, Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Sink;

    fn tag(step: u32) -> Tag {
        Tag { lane: 1, seq: 0, kind: 1, count: 2, root: u32::MAX, step }
    }

    #[test]
    fn exchange_moves_bytes_and_detects_mismatch() {
        let fabric = LocalFabric::new(2);
        let t0 = LocalTransport::new(fabric.clone(), 0, Duration::from_micros(10));
        let t1 = LocalTransport::new(fabric, 1, Duration::from_micros(10));
        let dl = Instant::now() + Duration::from_secs(10);
        let mut l0 = t0.open_lane("x", dl).unwrap();
        let mut l1 = t1.open_lane("x", dl).unwrap();
        let h = std::thread::spawn(move || {
            let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
            let never = AtomicBool::new(false);
            l1.exchange(
                tag(0),
                &[SendOp { peer: 0, data: &data, copied: false }],
                &mut [],
                dl,
                &never,
            )
            .unwrap();
            let r = l1.exchange(
                tag(1),
                &[SendOp { peer: 0, data: &data, copied: false }],
                &mut [],
                dl,
                &never,
            );
            (l1, r)
        });
        let mut got = Vec::new();
        let mut sink = |_off: usize, p: &[u8]| got.extend_from_slice(p);
        let never = AtomicBool::new(false);
        l0.exchange(
            tag(0),
            &[],
            &mut [RecvOp { peer: 1, len: 8, sink: Sink::Fn(&mut sink) }],
            dl,
            &never,
        )
        .unwrap();
        assert_eq!(got, vec![1, 2, 3, 4, 5, 6, 7, 8]);
        let mut sink2 = |_off: usize, _p: &[u8]| {};
        let e = l0.exchange(
            tag(2),
            &[],
            &mut [RecvOp { peer: 1, len: 8, sink: Sink::Fn(&mut sink2) }],
            dl,
            &never,
        );
        assert!(matches!(e, Err(TransportError::TagMismatch { peer: 1, .. })));
        l0.poison(&Poison { origin: 0, reason: "x".into() });
        let (_l1, r) = h.join().unwrap();
        assert!(matches!(r, Err(TransportError::Poisoned(_))), "{r:?}");
        drop(l0);
        let mut l1 = _l1;
        let mut sink3 = |_off: usize, _p: &[u8]| {};
        let e = l1.exchange(
            tag(3),
            &[],
            &mut [RecvOp { peer: 0, len: 0, sink: Sink::Fn(&mut sink3) }],
            dl,
            &never,
        );
        // Poison is sticky on the lane; a fresh lane reports the closed peer (LOCAL-3).
        assert!(matches!(e, Err(TransportError::Poisoned(_))));
    }

    /// Sends `bytes` from rank 1 to rank 0 on each of `lanes` lanes at once (a thread per
    /// lane and side); returns the elapsed time and whether every byte arrived intact.
    fn timed_transfer(rate: Option<u64>, lanes: usize, bytes: usize) -> (Duration, bool) {
        let fabric = LocalFabric::with_link_rate(2, rate);
        let dl = Instant::now() + Duration::from_secs(30);
        let t0 = LocalTransport::new(fabric.clone(), 0, Duration::ZERO);
        let t1 = LocalTransport::new(fabric, 1, Duration::ZERO);
        let start = Instant::now();
        let mut threads = Vec::new();
        for l in 0..lanes {
            let name = format!("lane{l}");
            let mut rx = t0.open_lane(&name, dl).unwrap();
            let mut tx = t1.open_lane(&name, dl).unwrap();
            threads.push(std::thread::spawn(move || {
                let data: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
                let never = AtomicBool::new(false);
                tx.exchange(
                    tag(0),
                    &[SendOp { peer: 0, data: &data, copied: false }],
                    &mut [],
                    dl,
                    &never,
                )
                .is_ok()
            }));
            threads.push(std::thread::spawn(move || {
                let mut got = Vec::with_capacity(bytes);
                let mut sink = |_off: usize, p: &[u8]| got.extend_from_slice(p);
                let never = AtomicBool::new(false);
                let r = rx.exchange(
                    tag(0),
                    &[],
                    &mut [RecvOp { peer: 1, len: bytes, sink: Sink::Fn(&mut sink) }],
                    dl,
                    &never,
                );
                r.is_ok() && got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8)
            }));
        }
        let ok = threads.into_iter().all(|t| t.join().unwrap());
        (start.elapsed(), ok)
    }

    /// LOCAL-5: a limited link takes at least (about) bytes / rate, and lanes share it. Only
    /// a lower bound is checked (with slack for clock granularity); it fails only if the
    /// limiter lets bytes through faster than the rate.
    #[test]
    fn link_rate_limits_each_link_and_lanes_share_it() {
        let (bytes, rate) = (4 << 20, 100_000_000u64);
        let (free, ok) = timed_transfer(None, 1, bytes);
        assert!(ok);
        let (one, ok) = timed_transfer(Some(rate), 1, bytes);
        assert!(ok);
        let (two, ok) = timed_transfer(Some(rate), 2, bytes);
        assert!(ok);
        let need = |b: usize| Duration::from_secs_f64(0.8 * b as f64 / rate as f64);
        eprintln!("4 MiB: unlimited {free:?}, at 100 MB/s {one:?}, two lanes {two:?}");
        assert!(one >= need(bytes), "{one:?} < {:?}", need(bytes));
        assert!(two >= need(2 * bytes), "{two:?} < {:?}", need(2 * bytes));
    }
}
