//! The exchange loop every RDMA shim runs, over what the shim does itself: posting the
//! protocol's writes, draining its completion queue, handing delivered pieces to sinks. The
//! verbs shim (`verbs.rs`) and the simulated fabric ([`super::fabric`]) share it, so that
//! what the fabric's tests exercise is the loop hardware runs.

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
            continue;
        }
        if let Some(e) = shim.peer_lost(p) {
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
