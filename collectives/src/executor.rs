//! Runs a schedule over a lane's links: one `exchange` per step that moves messages, then
//! the step's local ops. Sinks copy or reduce incoming pieces straight into their element
//! range of the work buffer (or scratch), so no message is staged.
//!
//! - EXEC-1: before a step runs, its ranges are checked disjoint (ALGO-2) and inside the
//!   virtual array; the raw-pointer views below rely on that check, not on trust.
//! - EXEC-2: scratch is owned by the executor and reused across ops (grow-only), so steady
//!   state allocates no data buffers.

use crate::algo::{Action, LocalOp, Schedule};
use crate::reduce::Combine;
use crate::transport::{as_f32, LaneLinks, RecvOp, SendOp, Sink, Tag, TransportError};
use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

/// Per-lane executor state (scratch reused across ops).
#[derive(Default)]
pub struct Executor {
    scratch: Vec<f32>,
}

/// Base pointers of the virtual array: `[0, buf_len)` in the work buffer, the rest in scratch.
#[derive(Clone, Copy)]
struct Mem {
    buf: *mut f32,
    buf_len: usize,
    scratch: *mut f32,
    scratch_len: usize,
}

impl Mem {
    /// Pointer to the start of `r` and its length. Panics if `r` straddles or leaves the
    /// array (EXEC-1).
    fn at(&self, r: &Range<usize>) -> (*mut f32, usize) {
        assert!(r.start <= r.end, "bad range {r:?}");
        if r.end <= self.buf_len {
            // SAFETY: r.start <= buf_len, so the offset stays inside (or one past) the buffer.
            (unsafe { self.buf.add(r.start) }, r.len())
        } else {
            assert!(
                r.start >= self.buf_len && r.end <= self.buf_len + self.scratch_len,
                "range {r:?} out of bounds"
            );
            // SAFETY: checked just above to lie inside scratch.
            (unsafe { self.scratch.add(r.start - self.buf_len) }, r.len())
        }
    }
}

struct SinkTarget {
    ptr: *mut f32,
    len: usize,
    action: Action,
    combine: Combine,
}

impl SinkTarget {
    fn put(&mut self, offset: usize, piece: &[u8]) {
        let src = as_f32(piece);
        let start = offset / 4;
        // TR-2 makes this hold for a correct transport; a broken one must not write out of
        // bounds, hence a real assert.
        assert!(
            offset.is_multiple_of(4) && start + src.len() <= self.len,
            "transport delivered a piece out of range"
        );
        // SAFETY: [ptr, ptr+len) is this receive's range, disjoint from every other range
        // touched during the exchange (EXEC-1), and the bounds were checked above.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), src.len()) };
        match self.action {
            Action::Copy => dst.copy_from_slice(src),
            Action::Reduce => self.combine.apply(dst, src),
        }
    }
}

impl Executor {
    /// Runs `sched` over `buf` (length `sched.buf_len`). Message tags are `tag` with the step
    /// number filled in.
    // The step inputs (links, schedule, buffer, combine) and the op's identity (tag,
    // deadline, cancel) are all distinct; bundling them would only add a throwaway struct.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &mut self,
        links: &mut dyn LaneLinks,
        sched: &Schedule,
        buf: &mut [f32],
        combine: Combine,
        tag: Tag,
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError> {
        assert_eq!(buf.len(), sched.buf_len, "work buffer does not match its schedule");
        if self.scratch.len() < sched.scratch_len {
            self.scratch.resize(sched.scratch_len, 0.0);
        }
        let mem = Mem {
            buf: buf.as_mut_ptr(),
            buf_len: buf.len(),
            scratch: self.scratch.as_mut_ptr(),
            scratch_len: sched.scratch_len,
        };
        for (i, step) in sched.steps.iter().enumerate() {
            if !step.is_local() {
                // EXEC-1: the full per-step check (rank-independent parts).
                sched_step_check(step)
                    .map_err(|e| TransportError::Setup(format!("invalid schedule: {e}")))?;
                let sends: Vec<SendOp<'_>> = step
                    .sends
                    .iter()
                    .map(|s| {
                        let (p, n) = mem.at(&s.range);
                        // SAFETY: sends only read; no receive range overlaps them (EXEC-1).
                        let data = unsafe { std::slice::from_raw_parts(p as *const f32, n) };
                        SendOp {
                            peer: s.peer,
                            data: bytemuck::cast_slice(data),
                            copied: s.action == Action::Copy,
                        }
                    })
                    .collect();
                // Plain copies get their destination bytes (a transport may write them in
                // place, TR-6); reductions go through a sink that combines each piece.
                let mut targets: Vec<Option<SinkTarget>> = step
                    .recvs
                    .iter()
                    .map(|r| {
                        let (ptr, len) = mem.at(&r.range);
                        (r.action == Action::Reduce).then_some(SinkTarget {
                            ptr,
                            len,
                            action: r.action,
                            combine,
                        })
                    })
                    .collect();
                let mut sinks: Vec<_> = targets
                    .iter_mut()
                    .map(|t| t.as_mut().map(|t| move |off: usize, piece: &[u8]| t.put(off, piece)))
                    .collect();
                let mut recvs: Vec<RecvOp<'_>> = step
                    .recvs
                    .iter()
                    .zip(sinks.iter_mut())
                    .map(|(r, s)| {
                        let sink = match s {
                            Some(f) => Sink::Fn(f),
                            None => {
                                let (p, n) = mem.at(&r.range);
                                // SAFETY: the range lies inside the array (Mem::at) and is
                                // disjoint from every other receive and every send of this
                                // step (EXEC-1), so this is the only live view of it.
                                Sink::Copy(unsafe {
                                    std::slice::from_raw_parts_mut(p as *mut u8, n * 4)
                                })
                            }
                        };
                        RecvOp { peer: r.peer, len: r.range.len() * 4, sink }
                    })
                    .collect();
                let t = Tag { step: i as u32, ..tag };
                links.exchange(t, &sends, &mut recvs, deadline, cancel)?;
            }
            for l in &step.local {
                let (LocalOp::Copy { src, dst } | LocalOp::Reduce { src, dst }) = l;
                assert!(
                    src.len() == dst.len() && (src.end <= dst.start || dst.end <= src.start),
                    "bad local op {l:?}"
                );
                let (sp, n) = mem.at(src);
                let (dp, _) = mem.at(dst);
                // SAFETY: both ranges are inside the array and disjoint (asserted above).
                let (s, d) = unsafe {
                    (
                        std::slice::from_raw_parts(sp as *const f32, n),
                        std::slice::from_raw_parts_mut(dp, n),
                    )
                };
                match l {
                    LocalOp::Copy { .. } => d.copy_from_slice(s),
                    LocalOp::Reduce { .. } => combine.apply(d, s),
                }
            }
        }
        Ok(())
    }
}

/// Rank-independent part of ALGO-2 for one step: receive ranges disjoint from each other and
/// from send ranges.
fn sched_step_check(step: &crate::algo::Step) -> Result<(), String> {
    let overlap = |a: &Range<usize>, b: &Range<usize>| {
        !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
    };
    for (i, r) in step.recvs.iter().enumerate() {
        if step.recvs[i + 1..].iter().any(|x| overlap(&x.range, &r.range))
            || step.sends.iter().any(|x| overlap(&x.range, &r.range))
        {
            return Err(format!("receive range {:?} overlaps", r.range));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::{RecvStep, SendStep, Step};
    use crate::reduce::ReduceOp;
    use crate::transport::Poison;

    /// Links that deliver a fixed payload to every receive, in two pieces (TR-2).
    struct Canned(Vec<f32>);

    impl LaneLinks for Canned {
        fn exchange(
            &mut self,
            _tag: Tag,
            _sends: &[SendOp<'_>],
            recvs: &mut [RecvOp<'_>],
            _deadline: Instant,
            _cancel: &AtomicBool,
        ) -> Result<(), TransportError> {
            let bytes: &[u8] = bytemuck::cast_slice(&self.0);
            for r in recvs.iter_mut() {
                let half = (r.len / 8) * 4;
                r.sink.put(0, &bytes[..half]);
                r.sink.put(half, &bytes[half..r.len]);
            }
            Ok(())
        }

        fn poison(&mut self, _poison: &Poison) {}
    }

    fn step(send: std::ops::Range<usize>, recv: std::ops::Range<usize>, action: Action) -> Step {
        Step {
            sends: vec![SendStep { peer: 1, range: send, action }],
            recvs: vec![RecvStep { peer: 1, range: recv, action }],
            local: Vec::new(),
        }
    }

    #[test]
    fn sinks_reduce_pieces_into_their_range() {
        let sched =
            Schedule { buf_len: 6, scratch_len: 0, steps: vec![step(0..2, 2..6, Action::Reduce)] };
        let mut buf = vec![1.0, 1.0, 1.0, 2.0, 3.0, 4.0];
        let never = AtomicBool::new(false);
        let far = Instant::now() + std::time::Duration::from_secs(10);
        Executor::default()
            .run(
                &mut Canned(vec![10.0, 20.0, 30.0, 40.0]),
                &sched,
                &mut buf,
                Combine::Op(ReduceOp::Sum),
                Tag::default(),
                far,
                &never,
            )
            .unwrap();
        assert_eq!(buf, vec![1.0, 1.0, 11.0, 22.0, 33.0, 44.0]);
    }

    /// EXEC-1: overlapping send and receive ranges are refused before any I/O.
    #[test]
    fn overlapping_ranges_are_refused_exec_1() {
        let sched =
            Schedule { buf_len: 4, scratch_len: 0, steps: vec![step(0..3, 2..4, Action::Copy)] };
        let mut buf = vec![0.0; 4];
        let never = AtomicBool::new(false);
        let far = Instant::now() + std::time::Duration::from_secs(10);
        let r = Executor::default().run(
            &mut Canned(vec![1.0, 2.0]),
            &sched,
            &mut buf,
            Combine::Op(ReduceOp::Sum),
            Tag::default(),
            far,
            &never,
        );
        assert!(matches!(r, Err(TransportError::Setup(_))), "{r:?}");
        assert_eq!(buf, vec![0.0; 4]);
    }
}
