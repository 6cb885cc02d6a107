//! The ordering rules of a device, as a pure core: which enqueued operation is known to come
//! after which, and whether an access to a buffer is ordered after every earlier access that
//! conflicts with it. No thread, no clock: the simulated device feeds it every enqueue, event
//! and host wait, and refuses what it refuses.
//!
//! Each stream numbers its operations 1, 2, ...; a vector clock (one entry per stream) says,
//! for each stream, up to which of its operations is known to have completed before a point.
//! An operation enqueued on stream `s` inherits what `s` knows: its own earlier operations,
//! the events `s` waited for, and whatever the host had waited for when it enqueued
//! (CUDA's rules: a host that synchronised on an event orders everything it enqueues after).
//!
//! Invariants:
//! - HAZ-1: an operation may read a buffer only if the buffer's last write is ordered before
//!   it, and write or free it only if the last write and every read since are; an access
//!   that is not is refused, naming the buffer, the stream and the conflicting operation.
//! - HAZ-2: the decision depends only on the order of enqueues, event records, event waits
//!   and host waits, never on when the work runs: a missing dependency is caught in every
//!   run, not only in the runs where the timing exposes it.
//! - HAZ-3: a freed buffer is never accessed again: any later access is refused as a use
//!   after free.

use std::collections::HashMap;
use std::fmt;

/// A stream's index on its device (the host is not a stream).
pub type StreamId = usize;

/// For each stream, the number of its operations known to have completed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VectorClock(Vec<u64>);

impl VectorClock {
    /// Operations of `stream` known to have completed.
    pub fn get(&self, stream: StreamId) -> u64 {
        self.0.get(stream).copied().unwrap_or(0)
    }

    fn set(&mut self, stream: StreamId, n: u64) {
        if self.0.len() <= stream {
            self.0.resize(stream + 1, 0);
        }
        self.0[stream] = n;
    }

    /// Takes in everything `other` knows.
    pub fn join(&mut self, other: &VectorClock) {
        for (s, &n) in other.0.iter().enumerate() {
            if n > self.get(s) {
                self.set(s, n);
            }
        }
    }

    /// Each stream's count, in stream order.
    pub fn entries(&self) -> &[u64] {
        &self.0
    }
}

/// One access's place: the operation `seq` of `stream`, and its name for reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    /// Stream of the operation.
    pub stream: StreamId,
    /// Its number on that stream (from 1).
    pub seq: u64,
    /// The operation, as reports name it.
    pub op: String,
}

/// How an operation touches a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Reads it.
    Read,
    /// Writes it.
    Write,
    /// Frees it.
    Free,
}

/// An access the ordering rules refuse (HAZ-1, HAZ-3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hazard {
    /// The buffer's label.
    pub buffer: String,
    /// The stream of the refused operation.
    pub stream: String,
    /// The refused operation.
    pub op: String,
    /// How it touched the buffer.
    pub access: Use,
    /// What it was not ordered after (or, for a use after free, the free).
    pub conflict: String,
    /// Whether the buffer had been freed.
    pub after_free: bool,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = match self.access {
            Use::Read => "reads",
            Use::Write => "writes",
            Use::Free => "frees",
        };
        if self.after_free {
            write!(
                f,
                "use after free: {} on stream '{}' {verb} buffer '{}', freed by {}",
                self.op, self.stream, self.buffer, self.conflict
            )
        } else {
            write!(
                f,
                "unordered access: {} on stream '{}' {verb} buffer '{}' before {} is known to be done (no event orders them)",
                self.op, self.stream, self.buffer, self.conflict
            )
        }
    }
}

#[derive(Default)]
struct BufferState {
    label: String,
    last_write: Option<Access>,
    /// Reads since the last write, the latest per stream.
    reads: Vec<Access>,
    freed: Option<Access>,
}

/// The ordering state of one device: its streams' clocks, the host's, and each buffer's
/// accesses.
#[derive(Default)]
pub struct Ordering {
    streams: Vec<(String, u64, VectorClock)>,
    host: VectorClock,
    buffers: HashMap<u64, BufferState>,
}

impl Ordering {
    /// A device with no stream and no buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a stream named `name`; returns its id.
    pub fn add_stream(&mut self, name: &str) -> StreamId {
        self.streams.push((name.to_owned(), 0, VectorClock::default()));
        self.streams.len() - 1
    }

    /// The name of `stream`.
    pub fn stream_name(&self, stream: StreamId) -> &str {
        &self.streams[stream].0
    }

    /// Registers buffer `id` under `label` (a fresh allocation: no access yet).
    pub fn add_buffer(&mut self, id: u64, label: &str) {
        self.buffers.insert(id, BufferState { label: label.to_owned(), ..Default::default() });
    }

    /// The label of buffer `id`.
    pub fn label(&self, id: u64) -> Option<&str> {
        self.buffers.get(&id).map(|b| b.label.as_str())
    }

    /// Enqueues operation `op` on `stream`, touching `uses` (buffer id, how), and returns its
    /// clock: what is known done before it, itself included. Refuses the first access that
    /// the rules forbid (HAZ-1, HAZ-3); a refused operation changes nothing.
    pub fn enqueue(
        &mut self,
        stream: StreamId,
        op: &str,
        uses: &[(u64, Use)],
    ) -> Result<VectorClock, Hazard> {
        let seq = self.streams[stream].1 + 1;
        let mut vc = self.streams[stream].2.clone();
        vc.join(&self.host);
        vc.set(stream, seq);
        let access = Access { stream, seq, op: op.to_owned() };
        for &(id, how) in uses {
            self.check(&vc, &access, id, how)?;
        }
        for &(id, how) in uses {
            let b = self.buffers.get_mut(&id).expect("checked above");
            match how {
                Use::Read => {
                    b.reads.retain(|r| r.stream != stream);
                    b.reads.push(access.clone());
                }
                Use::Write => {
                    b.reads.clear();
                    b.last_write = Some(access.clone());
                }
                Use::Free => b.freed = Some(access.clone()),
            }
        }
        let s = &mut self.streams[stream];
        s.1 = seq;
        s.2 = vc.clone();
        Ok(vc)
    }

    fn describe(&self, a: &Access) -> String {
        format!("{} (operation {} of stream '{}')", a.op, a.seq, self.stream_name(a.stream))
    }

    fn check(&self, vc: &VectorClock, me: &Access, id: u64, how: Use) -> Result<(), Hazard> {
        let hazard = |b: &BufferState, conflict: &Access, after_free: bool| Hazard {
            buffer: b.label.clone(),
            stream: self.stream_name(me.stream).to_owned(),
            op: me.op.clone(),
            access: how,
            conflict: self.describe(conflict),
            after_free,
        };
        let Some(b) = self.buffers.get(&id) else {
            return Err(Hazard {
                buffer: format!("#{id}"),
                stream: self.stream_name(me.stream).to_owned(),
                op: me.op.clone(),
                access: how,
                conflict: "no allocation".into(),
                after_free: true,
            });
        };
        if let Some(f) = &b.freed {
            return Err(hazard(b, f, true));
        }
        let ordered = |a: &Access| vc.get(a.stream) >= a.seq;
        if let Some(w) = b.last_write.as_ref().filter(|w| !ordered(w)) {
            return Err(hazard(b, w, false));
        }
        if how != Use::Read {
            if let Some(r) = b.reads.iter().find(|r| !ordered(r)) {
                return Err(hazard(b, r, false));
            }
        }
        Ok(())
    }

    /// What `stream` knows now: an event recorded on it carries this.
    pub fn record(&self, stream: StreamId) -> VectorClock {
        let mut vc = self.streams[stream].2.clone();
        vc.join(&self.host);
        vc
    }

    /// `stream` waits for an event carrying `event`: its later operations come after it.
    pub fn wait(&mut self, stream: StreamId, event: &VectorClock) {
        self.streams[stream].2.join(event);
    }

    /// The host waited for an event carrying `event`: whatever it enqueues later comes after.
    pub fn host_waited(&mut self, event: &VectorClock) {
        self.host.join(event);
    }

    /// Forgets buffer `id` once its free has run (its id is not reused).
    pub fn forget(&mut self, id: u64) {
        if let Some(b) = self.buffers.get_mut(&id) {
            b.last_write = None;
            b.reads.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_streams() -> (Ordering, StreamId, StreamId) {
        let mut o = Ordering::new();
        let a = o.add_stream("compute");
        let b = o.add_stream("gather");
        o.add_buffer(1, "unit0.params");
        (o, a, b)
    }

    #[test]
    fn a_read_on_another_stream_needs_an_event_haz_1() {
        // HAZ-1: gather writes, compute reads without waiting: refused, naming both.
        let (mut o, compute, gather) = two_streams();
        o.enqueue(gather, "all_gather", &[(1, Use::Write)]).unwrap();
        let e = o.enqueue(compute, "matmul", &[(1, Use::Read)]).unwrap_err();
        assert_eq!((e.buffer.as_str(), e.stream.as_str()), ("unit0.params", "compute"));
        assert!(e.conflict.contains("all_gather") && e.conflict.contains("gather"), "{e}");
        assert!(e.to_string().contains("unordered access"), "{e}");
        // With the event wait it is allowed.
        let ev = o.record(gather);
        o.wait(compute, &ev);
        o.enqueue(compute, "matmul", &[(1, Use::Read)]).unwrap();
    }

    #[test]
    fn a_write_must_follow_every_read_haz_1() {
        // HAZ-1: compute reads; gather overwrites without waiting for it (a buffer reused
        // before its reader is done, FSDP's record_stream class of bug).
        let (mut o, compute, gather) = two_streams();
        o.enqueue(compute, "init", &[(1, Use::Write)]).unwrap();
        o.enqueue(compute, "matmul", &[(1, Use::Read)]).unwrap();
        let ev0 = o.record(compute);
        let e = o.enqueue(gather, "all_gather", &[(1, Use::Write)]).unwrap_err();
        assert!(e.conflict.contains("init"), "the last write comes first: {e}");
        o.wait(gather, &ev0);
        o.enqueue(gather, "all_gather", &[(1, Use::Write)]).unwrap();
        // Two reads on two streams need no order between them.
        let ev = o.record(gather);
        o.wait(compute, &ev);
        o.enqueue(compute, "matmul", &[(1, Use::Read)]).unwrap();
        let ev = o.record(gather);
        o.add_stream("reduce");
        o.wait(2, &ev);
        o.enqueue(2, "copy", &[(1, Use::Read)]).unwrap();
        // But a write on gather must now wait for both readers.
        let e = o.enqueue(gather, "all_gather", &[(1, Use::Write)]).unwrap_err();
        assert!(e.conflict.contains("matmul") || e.conflict.contains("copy"), "{e}");
    }

    #[test]
    fn order_comes_from_enqueues_and_waits_only_haz_2() {
        // HAZ-2: the same sequence gives the same verdict; the host's wait orders what it
        // enqueues later on any stream.
        for _ in 0..3 {
            let (mut o, compute, gather) = two_streams();
            let vc = o.enqueue(gather, "all_gather", &[(1, Use::Write)]).unwrap();
            assert_eq!(vc.get(gather), 1);
            assert!(o.enqueue(compute, "matmul", &[(1, Use::Read)]).is_err());
            o.host_waited(&o.record(gather));
            o.enqueue(compute, "matmul", &[(1, Use::Read)]).unwrap();
        }
        // A refused operation changes nothing: the stream's count did not move.
        let (mut o, compute, gather) = two_streams();
        o.enqueue(gather, "w", &[(1, Use::Write)]).unwrap();
        assert!(o.enqueue(compute, "r", &[(1, Use::Read)]).is_err());
        assert_eq!(o.record(compute).get(compute), 0);
    }

    #[test]
    fn a_freed_buffer_is_never_touched_again_haz_3() {
        let (mut o, compute, _) = two_streams();
        o.enqueue(compute, "init", &[(1, Use::Write)]).unwrap();
        o.enqueue(compute, "free", &[(1, Use::Free)]).unwrap();
        let e = o.enqueue(compute, "matmul", &[(1, Use::Read)]).unwrap_err();
        assert!(e.after_free && e.to_string().contains("use after free"), "{e}");
        assert!(o.enqueue(compute, "x", &[(7, Use::Read)]).is_err(), "unknown buffer");
    }
}
