//! The exchange loop every RDMA shim runs, over what the shim does itself: posting the
//! protocol's writes, draining its completion queue, handing delivered pieces to sinks. The
//! verbs shim (`verbs.rs`) and the simulated fabric ([`super::fabric`]) share it, so that
//! what the fabric's tests exercise is the loop hardware runs.
//!
//! Invariant:
//! - RDMA-8: a peer seen gone fails the exchange only after one more pass over the links
//!   and the completion queue moved nothing. A peer's writes complete before it can close
//!   (FAB-2, RDMA-7), but its last ones may land after this rank's pass drained the queue
//!   and before the loss was seen; the pass after the loss delivers them.

use super::proto::LinkProto;
use crate::transport::{RecvOp, SendOp, Tag, TransportError};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What a shim does for the loop.
pub(crate) trait Shim {
    /// Ranks (links indexed by peer).
    fn world(&self) -> usize;
    /// The protocol of the link to `p`; `None` for this rank.
    fn proto(&self, p: usize) -> Option<&LinkProto>;
    /// The protocol of the link to `p`, or a setup error when there is none.
    fn proto_mut(&mut self, p: usize) -> Result<&mut LinkProto, TransportError>;
    /// Hands the pieces the protocol releases from `p` to the front receives' sinks.
    fn deliver(
        &mut self,
        p: usize,
        pending: &mut VecDeque<usize>,
        recvs: &mut [RecvOp<'_>],
    ) -> Result<bool, TransportError>;
    /// Posts what the protocol allows to `p`.
    fn transmit(&mut self, p: usize) -> Result<bool, TransportError>;
    /// Drains the completion queue into the protocols.
    fn poll_cq(&mut self) -> Result<bool, TransportError>;
    /// What the shim knows of `p` being gone (an asynchronous event), if anything.
    fn peer_lost(&self, _p: usize) -> Option<TransportError> {
        None
    }
    /// The error that failed the lane for good.
    fn failed(&mut self) -> &mut Option<TransportError>;
}

/// One exchange over `shim` (TR-1..4, RDMA-6, RDMA-7); `spins` idle polls before backing off.
pub(crate) fn exchange(
    shim: &mut impl Shim,
    tag: Tag,
    sends: &[SendOp<'_>],
    recvs: &mut [RecvOp<'_>],
    deadline: Instant,
    cancel: &AtomicBool,
    spins: u32,
) -> Result<(), TransportError> {
    if let Some(e) = shim.failed() {
        return Err(e.clone());
    }
    let world = shim.world();
    let mut pending: Vec<VecDeque<usize>> = vec![VecDeque::new(); world];
    let mut active = vec![false; world];
    for s in sends {
        shim.proto_mut(s.peer)?.queue_send(tag, s.data)?;
        active[s.peer] = true;
    }
    for (i, r) in recvs.iter().enumerate() {
        shim.proto_mut(r.peer)?.expect_recv(tag, r.len)?;
        pending[r.peer].push_back(i);
        active[r.peer] = true;
    }
    let mut idle = 0u32;
    // RDMA-8: whether a loss was seen since the last pass that moved something.
    let mut lost_seen = false;
    loop {
        let mut moved = false;
        for (p, queue) in pending.iter_mut().enumerate() {
            // A failed link the exchange does not use stays failed and silent (RDMA-7).
            let Some(l) = shim.proto(p) else { continue };
            if !active[p] && l.error().is_some() {
                continue;
            }
            moved |= shim.deliver(p, queue, recvs)?;
            moved |= shim.transmit(p)?;
        }
        moved |= shim.poll_cq()?;
        let used = |p: &usize| active[*p];
        if let Some(e) = (0..world).filter(used).find_map(|p| shim.proto(p)?.error().cloned()) {
            return Err(e);
        }
        let busy = |l: &LinkProto| l.sends_pending() || l.recvs_pending();
        let Some(p) = (0..world).filter(used).find(|&p| shim.proto(p).is_some_and(busy)) else {
            return Ok(());
        };
        if moved {
            idle = 0;
            lost_seen = false;
            continue;
        }
        if let Some(e) = shim.peer_lost(p) {
            if !lost_seen {
                lost_seen = true; // RDMA-8: drain what landed before the loss was seen
                continue;
            }
            return fail_for_good(shim, e);
        }
        // RDMA-6: a poison from any peer ends the wait, not only from those waited on.
        let poison = (0..world).find_map(|q| shim.proto(q)?.poisoned().cloned());
        if let Some(poison) = poison {
            return fail_for_good(shim, TransportError::Poisoned(poison));
        }
        if cancel.load(Ordering::Relaxed) {
            return fail_for_good(shim, TransportError::Cancelled);
        }
        if Instant::now() >= deadline {
            return Err(shim.proto_mut(p)?.handle_deadline());
        }
        // Busy polling keeps latency low; after a while idle, back off a little.
        idle += 1;
        if idle > spins {
            std::thread::sleep(Duration::from_micros(50));
        } else {
            std::hint::spin_loop();
        }
    }
}

fn fail_for_good(shim: &mut impl Shim, e: TransportError) -> Result<(), TransportError> {
    *shim.failed() = Some(e.clone());
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::proto::{ProtoConfig, Transmit};
    use crate::transport::Sink;

    /// Rank 0 of two, receiving from rank 1 whose write lands in the completion queue only
    /// at the `lands_at`-th poll (never when `None`); rank 1 is gone from the start, as when
    /// it finished right after its write and closed its endpoint.
    struct Late {
        rx: LinkProto,
        write: Option<(u32, Vec<u8>)>,
        polls: usize,
        lands_at: Option<usize>,
        failed: Option<TransportError>,
    }

    impl Late {
        fn new(tag: Tag, lands_at: Option<usize>) -> Self {
            let cfg = ProtoConfig::new(256, 4).unwrap();
            let mut tx = LinkProto::new(0, cfg);
            tx.queue_send(tag, &[]).unwrap();
            let Some(Transmit::Write { imm, bytes, .. }) = tx.poll_transmit() else {
                panic!("no write for the message")
            };
            let rx = LinkProto::new(1, cfg);
            Late { rx, write: Some((imm, bytes)), polls: 0, lands_at, failed: None }
        }
    }

    impl Shim for Late {
        fn world(&self) -> usize {
            2
        }
        fn proto(&self, p: usize) -> Option<&LinkProto> {
            (p == 1).then_some(&self.rx)
        }
        fn proto_mut(&mut self, p: usize) -> Result<&mut LinkProto, TransportError> {
            if p == 1 {
                Ok(&mut self.rx)
            } else {
                Err(TransportError::Setup(format!("no link to {p}")))
            }
        }
        fn deliver(
            &mut self,
            _p: usize,
            pending: &mut VecDeque<usize>,
            _recvs: &mut [RecvOp<'_>],
        ) -> Result<bool, TransportError> {
            let mut moved = false;
            while let Some(d) = self.rx.poll_deliver()? {
                moved = true;
                if d.done {
                    pending.pop_front();
                }
            }
            Ok(moved)
        }
        fn transmit(&mut self, _p: usize) -> Result<bool, TransportError> {
            Ok(false) // credits only: nothing the exchange waits for (RDMA-7)
        }
        fn poll_cq(&mut self) -> Result<bool, TransportError> {
            self.polls += 1;
            if Some(self.polls) != self.lands_at {
                return Ok(false);
            }
            let (imm, bytes) = self.write.take().expect("one write");
            self.rx.handle_imm(imm, &bytes)?;
            Ok(true)
        }
        fn peer_lost(&self, p: usize) -> Option<TransportError> {
            Some(TransportError::PeerLost { peer: p, detail: "closed".into() })
        }
        fn failed(&mut self) -> &mut Option<TransportError> {
            &mut self.failed
        }
    }

    fn barrier_recv(shim: &mut Late, tag: Tag) -> Result<(), TransportError> {
        let mut sink = |_: usize, _: &[u8]| {};
        let mut recvs = [RecvOp { peer: 1, len: 0, sink: Sink::Fn(&mut sink) }];
        let deadline = Instant::now() + Duration::from_secs(10);
        exchange(shim, tag, &[], &mut recvs, deadline, &AtomicBool::new(false), 0)
    }

    /// RDMA-8: the peer's last write, landing after a pass found the queue empty and before
    /// its loss was seen, is delivered, and the exchange succeeds; a write that never lands
    /// fails it with the loss after one more pass, not at the deadline.
    #[test]
    fn a_write_landing_before_the_peer_closed_is_delivered_rdma_8() {
        let tag = Tag { lane: 1, seq: 251, kind: 1, count: 0, root: u32::MAX, step: 0 };
        let mut shim = Late::new(tag, Some(2));
        barrier_recv(&mut shim, tag).expect("the write that landed is delivered");
        // The pass that saw the loss polled it in (2), the next delivered it (3).
        assert_eq!(shim.polls, 3);

        let mut never = Late::new(tag, None);
        let t0 = Instant::now();
        let e = barrier_recv(&mut never, tag).unwrap_err();
        assert!(matches!(e, TransportError::PeerLost { peer: 1, .. }), "{e:?}");
        assert_eq!(never.polls, 2, "one pass more, then the loss");
        assert!(t0.elapsed() < Duration::from_secs(5), "not at the deadline");
        assert!(never.failed.is_some(), "the lane fails for good");
    }
}
