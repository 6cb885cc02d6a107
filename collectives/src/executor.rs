//! Runs a schedule over a lane's links: one `exchange` per step that moves messages, then
//! the step's local ops. Sinks copy or reduce incoming pieces straight into their element
//! range of the work buffer (or scratch), so no message is staged.
//!
//! - EXEC-1: before a step runs, its ranges are checked disjoint (ALGO-2) and inside the
//!   virtual array; the raw-pointer views below rely on that check, not on trust.
//! - EXEC-2: scratch is owned by the executor and reused across ops (grow-only), so steady
//!   state allocates no data buffers.
//! - EXEC-3: the op's input region (after the scratch) is only read: a receive or a local
//!   destination there is refused before any I/O. The output region (after the input) is
//!   written only by reducing receives with `out` and local copies (ALGO-5).

use crate::algo::{Action, LocalOp, Schedule};
use crate::reduce::{Combine, ReduceOp};
use crate::transport::{as_f32, LaneLinks, RecvOp, SendOp, Sink, Tag, TransportError};
use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

/// Per-lane executor state (scratch reused across ops).
#[derive(Default)]
pub struct Executor {
    scratch: Vec<f32>,
    /// Payload bytes handed to the links by every exchange so far (LANE-8).
    sent: u64,
}

/// Base pointers of the virtual array: `[0, buf_len)` in the work buffer, then scratch, then
/// the op's read-only input.
#[derive(Clone, Copy)]
struct Mem {
    buf: *mut f32,
    buf_len: usize,
    scratch: *mut f32,
    scratch_len: usize,
    input: *const f32,
    input_len: usize,
    output: *mut f32,
    output_len: usize,
}

impl Mem {
    /// Pointer to the start of `r` and its length. Panics if `r` straddles or leaves the
    /// array (EXEC-1).
    fn at(&self, r: &Range<usize>) -> (*mut f32, usize) {
        assert!(r.start <= r.end, "bad range {r:?}");
        if r.end <= self.buf_len {
            // SAFETY: r.start <= buf_len, so the offset stays inside (or one past) the buffer.
            (unsafe { self.buf.add(r.start) }, r.len())
        } else if r.end <= self.buf_len + self.scratch_len {
            assert!(r.start >= self.buf_len, "range {r:?} straddles buffer and scratch");
            // SAFETY: checked just above to lie inside scratch.
            (unsafe { self.scratch.add(r.start - self.buf_len) }, r.len())
        } else if r.end <= self.buf_len + self.scratch_len + self.input_len {
            let base = self.buf_len + self.scratch_len;
            assert!(r.start >= base, "range {r:?} straddles scratch and input");
            // SAFETY: checked just above to lie inside the input. The pointer is only ever
            // read through: `run` refuses receives and local destinations there (EXEC-3)
            // before using them.
            (unsafe { self.input.add(r.start - base) } as *mut f32, r.len())
        } else {
            let base = self.buf_len + self.scratch_len + self.input_len;
            assert!(
                r.start >= base && r.end <= base + self.output_len,
                "range {r:?} out of bounds"
            );
            // SAFETY: checked just above to lie inside the output.
            (unsafe { self.output.add(r.start - base) }, r.len())
        }
    }
}

struct SinkTarget {
    ptr: *mut f32,
    len: usize,
    action: Action,
    combine: Combine,
    /// With a receive's `out`: the range combined with the incoming elements (only read).
    acc: Option<*const f32>,
    /// With `acc`: the receive is large enough for non-temporal stores (MC-2).
    nt: bool,
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
        match (self.action, self.acc) {
            (Action::Copy, _) => dst.copy_from_slice(src),
            (Action::Reduce, None) => self.combine.apply(dst, src),
            (Action::Reduce, Some(acc)) => {
                // SAFETY: the accumulator range has this receive's length and is only read
                // during the step: no range written in it overlaps it (EXEC-1, ALGO-5).
                let acc = unsafe { std::slice::from_raw_parts(acc.add(start), src.len()) };
                match self.combine {
                    Combine::Op(ReduceOp::Sum | ReduceOp::Avg) if self.nt => {
                        crate::memcopy::add_nt(dst, acc, src)
                    }
                    c => c.apply_to(dst, acc, src),
                }
            }
        }
    }
}

/// The op's own regions of the virtual array a schedule addresses (the executor adds its
/// scratch between the work buffer and the input).
pub(crate) struct Regions<'a> {
    /// The work buffer, `sched.buf_len` elements.
    pub buf: &'a mut [f32],
    /// The op's input, `sched.input_len` elements, only read (EXEC-3).
    pub input: &'a [f32],
    /// The op's separate output, `sched.output_len` elements (ALGO-5).
    pub output: &'a mut [f32],
}

impl<'a> Regions<'a> {
    /// A work buffer alone: no separate input or output.
    pub fn work(buf: &'a mut [f32]) -> Self {
        Regions { buf, input: &[], output: &mut [] }
    }
}

/// The op's identity and bounds on the wire: every exchange of its steps gets `tag` (with
/// the step number filled in), `deadline` and `cancel`.
#[derive(Clone, Copy)]
pub(crate) struct WireCtx<'a> {
    /// The op's tag; the executor fills in the step.
    pub tag: Tag,
    /// When the op must have finished.
    pub deadline: Instant,
    /// Set when the lane is aborted.
    pub cancel: &'a AtomicBool,
}

impl Executor {
    /// Payload bytes this executor has handed to its links, every send of every step of
    /// every op so far (LANE-8).
    pub fn sent_bytes(&self) -> u64 {
        self.sent
    }

    /// Grows the scratch to `len` values ahead of a run (so that its size can be reported
    /// before the op uses it).
    pub(crate) fn reserve_scratch(&mut self, len: usize) {
        if self.scratch.len() < len {
            self.scratch.resize(len, 0.0);
        }
    }

    /// Heap bytes of the scratch.
    pub(crate) fn scratch_bytes(&self) -> usize {
        self.scratch.capacity() * 4
    }

    /// Runs `sched` over the op's `regions`. Message tags are `wire.tag` with the step number
    /// filled in.
    pub(crate) fn run(
        &mut self,
        links: &mut dyn LaneLinks,
        sched: &Schedule,
        regions: Regions<'_>,
        combine: Combine,
        wire: WireCtx<'_>,
    ) -> Result<(), TransportError> {
        let Regions { buf, input, output } = regions;
        let WireCtx { tag, deadline, cancel } = wire;
        assert_eq!(buf.len(), sched.buf_len, "work buffer does not match its schedule");
        assert_eq!(input.len(), sched.input_len, "input does not match its schedule");
        assert_eq!(output.len(), sched.output_len, "output does not match its schedule");
        if self.scratch.len() < sched.scratch_len {
            self.scratch.resize(sched.scratch_len, 0.0);
        }
        let mem = Mem {
            buf: buf.as_mut_ptr(),
            buf_len: buf.len(),
            scratch: self.scratch.as_mut_ptr(),
            scratch_len: sched.scratch_len,
            input: input.as_ptr(),
            input_len: sched.input_len,
            output: output.as_mut_ptr(),
            output_len: sched.output_len,
        };
        for (i, step) in sched.steps.iter().enumerate() {
            if !step.is_local() {
                // EXEC-1: the full per-step check (rank-independent parts).
                crate::algo::check_step_ranges(step, sched.regions())
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
                        (r.action == Action::Reduce).then(|| {
                            let (ptr, len) = mem.at(r.written());
                            let acc = r.out.as_ref().map(|_| mem.at(&r.range).0 as *const f32);
                            let nt = crate::memcopy::wants_nt(len * 4);
                            SinkTarget { ptr, len, action: r.action, combine, acc, nt }
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
                // Counted as handed over: a failed exchange may have sent part of it.
                self.sent += sends.iter().map(|s| s.data.len() as u64).sum::<u64>();
                links.exchange(t, &sends, &mut recvs, deadline, cancel)?;
            }
            for l in &step.local {
                let (LocalOp::Copy { src, dst } | LocalOp::Reduce { src, dst }) = l;
                let (end, read_end, out_end) = sched.regions();
                assert!(
                    src.len() == dst.len()
                        && (src.end <= dst.start || dst.end <= src.start)
                        && (dst.end <= end
                            || (matches!(l, LocalOp::Copy { .. })
                                && dst.start >= read_end
                                && dst.end <= out_end)),
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
                    LocalOp::Copy { .. } => crate::memcopy::copy(d, s),
                    LocalOp::Reduce { .. } => combine.apply(d, s),
                }
            }
        }
        Ok(())
    }
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
            recvs: vec![RecvStep::new(1, recv, action)],
            local: Vec::new(),
        }
    }

    #[test]
    fn sinks_reduce_pieces_into_their_range() {
        let sched = Schedule {
            buf_len: 6,
            steps: vec![step(0..2, 2..6, Action::Reduce)],
            ..Schedule::default()
        };
        let mut buf = vec![1.0, 1.0, 1.0, 2.0, 3.0, 4.0];
        run_canned(&sched, &mut buf, &[], vec![10.0, 20.0, 30.0, 40.0]).unwrap();
        assert_eq!(buf, vec![1.0, 1.0, 11.0, 22.0, 33.0, 44.0]);
    }

    /// A default tag and a deadline 10 s away.
    fn wire(cancel: &AtomicBool) -> WireCtx<'_> {
        WireCtx {
            tag: Tag::default(),
            deadline: Instant::now() + std::time::Duration::from_secs(10),
            cancel,
        }
    }

    /// Runs `sched` over `buf` and `input` with links that deliver `payload` to every
    /// receive.
    fn run_canned(
        sched: &Schedule,
        buf: &mut [f32],
        input: &[f32],
        payload: Vec<f32>,
    ) -> Result<(), TransportError> {
        Executor::default().run(
            &mut Canned(payload),
            sched,
            Regions { buf, input, output: &mut [] },
            Combine::Op(ReduceOp::Sum),
            wire(&AtomicBool::new(false)),
        )
    }

    /// EXEC-3: a receive into the read-only input region is refused before any I/O, and a
    /// send from it reads the input.
    #[test]
    fn input_region_is_read_only_exec_3() {
        let bad = Schedule {
            buf_len: 2,
            input_len: 2,
            steps: vec![step(0..2, 2..4, Action::Copy)],
            ..Schedule::default()
        };
        let mut buf = vec![0.0; 2];
        let r = run_canned(&bad, &mut buf, &[5.0, 6.0], vec![1.0, 2.0]);
        assert!(matches!(r, Err(TransportError::Setup(_))), "{r:?}");
        // Sending from the input and receiving into the buffer is fine.
        let good = Schedule {
            buf_len: 2,
            input_len: 2,
            steps: vec![step(2..4, 0..2, Action::Copy)],
            ..Schedule::default()
        };
        run_canned(&good, &mut buf, &[5.0, 6.0], vec![1.0, 2.0]).unwrap();
        assert_eq!(buf, vec![1.0, 2.0]);
    }

    /// ALGO-5: a reducing receive with `out` writes `range (op) incoming` into the output
    /// region and leaves `range` as it was; `out` on a copy, over the input, or over what the
    /// step sends is refused before any I/O.
    #[test]
    fn reduces_into_the_output_region_algo_5() {
        let with_out = |action: Action, out: std::ops::Range<usize>| Schedule {
            buf_len: 4,
            input_len: 1,
            output_len: 2,
            steps: vec![Step {
                sends: vec![SendStep { peer: 1, range: 0..2, action }],
                recvs: vec![RecvStep { out: Some(out), ..RecvStep::new(1, 2..4, action) }],
                local: Vec::new(),
            }],
            ..Schedule::default()
        };
        let run = |sched: &Schedule, buf: &mut [f32], output: &mut [f32]| {
            Executor::default().run(
                &mut Canned(vec![10.0, 20.0]),
                sched,
                Regions { buf, input: &[7.0], output },
                Combine::Op(ReduceOp::Sum),
                wire(&AtomicBool::new(false)),
            )
        };
        let mut buf = vec![1.0, 2.0, 3.0, 4.0];
        let mut output = vec![f32::NAN; 2];
        run(&with_out(Action::Reduce, 5..7), &mut buf, &mut output).unwrap();
        assert_eq!(output, vec![13.0, 24.0]);
        assert_eq!(buf, vec![1.0, 2.0, 3.0, 4.0]);
        for bad in [
            with_out(Action::Copy, 5..7),
            with_out(Action::Reduce, 4..6),
            with_out(Action::Reduce, 0..2),
            with_out(Action::Reduce, 2..4),
        ] {
            let mut output = vec![f32::NAN; 2];
            let r = run(&bad, &mut buf, &mut output);
            assert!(matches!(r, Err(TransportError::Setup(_))), "{:?}: {r:?}", bad.steps[0]);
            assert!(output.iter().all(|x| x.is_nan()));
        }
    }

    /// EXEC-1: overlapping send and receive ranges are refused before any I/O.
    #[test]
    fn overlapping_ranges_are_refused_exec_1() {
        let sched = Schedule {
            buf_len: 4,
            steps: vec![step(0..3, 2..4, Action::Copy)],
            ..Schedule::default()
        };
        let mut buf = vec![0.0; 4];
        let r = run_canned(&sched, &mut buf, &[], vec![1.0, 2.0]);
        assert!(matches!(r, Err(TransportError::Setup(_))), "{r:?}");
        assert_eq!(buf, vec![0.0; 4]);
    }
}
