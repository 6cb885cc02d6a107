//! Collectives between devices of one process (simulated, or the host as a device), with NCCL's semantics: a call is enqueued on a
//! stream and runs when the stream reaches it; every rank must issue the same collectives in
//! the same order (kind, element count, root), and a group (`group_start` .. `group_end`)
//! is one call made of several. The ranks meet in a [`SimWorld`], which checks each call
//! against the other ranks' call at the same place and reports a desync naming the ranks
//! and both calls, instead of the hang or the garbage a real NCCL would give.
//!
//! Invariants:
//! - SCOMM-1: the n-th call of every rank is compared with the n-th call of every other
//!   rank that has issued one, when it is issued; a difference fails the issuing call and
//!   every later one, naming both ranks and both calls.
//! - SCOMM-2: results equal the naive reduction: all-reduce sums every rank's buffer
//!   elementwise in rank order, all-gather concatenates in rank order, reduce-scatter gives
//!   rank r the r-th block of the sum, broadcast copies the root's buffer; the in-place
//!   forms read and write the own block of one buffer (NCCL's in-place convention).
//! - SCOMM-3: a rank whose peers never arrive fails after the world's timeout, naming the
//!   missing ranks, instead of waiting forever.

use super::{Device, DeviceBuffer, DeviceError, FallibleKernel, HostOnce, Result, StreamId};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One collective as the ranks must agree on it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    AllReduce { len: usize },
    AllGather { len: usize },
    ReduceScatter { len: usize },
    Broadcast { len: usize, root: usize },
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::AllReduce { len } => write!(f, "all_reduce({len} elements)"),
            Op::AllGather { len } => write!(f, "all_gather({len} elements per rank)"),
            Op::ReduceScatter { len } => write!(f, "reduce_scatter({len} elements per rank)"),
            Op::Broadcast { len, root } => write!(f, "broadcast({len} elements from rank {root})"),
        }
    }
}

fn describe(ops: &[Op]) -> String {
    match ops {
        [one] => one.to_string(),
        many => {
            let v: Vec<String> = many.iter().map(Op::to_string).collect();
            format!("group[{}]", v.join(", "))
        }
    }
}

#[derive(Default)]
struct Meeting {
    /// Each rank's inputs to this call, one per op of the call.
    inputs: HashMap<usize, Vec<Vec<f32>>>,
    /// Ranks that have taken their result.
    left: usize,
}

struct Table {
    /// Each rank's calls so far, described.
    calls: Vec<Vec<String>>,
    meetings: HashMap<usize, Meeting>,
    desync: Option<String>,
    /// Why the world was aborted ([`SimWorld::abort`]).
    aborted: Option<String>,
}

/// Where the ranks of one simulated job meet.
pub struct SimWorld {
    size: usize,
    timeout: Duration,
    table: Mutex<Table>,
    cv: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SimWorld {
    /// A world of `size` ranks whose waits give up after `timeout` (SCOMM-3).
    pub fn new(size: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(SimWorld {
            size,
            timeout,
            table: Mutex::new(Table {
                calls: vec![Vec::new(); size],
                meetings: HashMap::new(),
                desync: None,
                aborted: None,
            }),
            cv: Condvar::new(),
        })
    }

    /// Ranks in the world.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Fails every pending and later call of every rank with `why` (a rank failed, and its
    /// peers should not wait for it until the timeout).
    pub fn abort(&self, why: &str) {
        let mut t = lock(&self.table);
        if t.aborted.is_none() {
            t.aborted = Some(why.to_string());
        }
        self.cv.notify_all();
    }

    /// Records rank `rank`'s next call and checks it against the others' (SCOMM-1).
    fn issue(&self, rank: usize, what: String) -> Result<usize> {
        let mut t = lock(&self.table);
        if let Some(d) = &t.desync {
            return Err(DeviceError::Desync(d.clone()));
        }
        if let Some(a) = &t.aborted {
            return Err(DeviceError::Failed(a.clone()));
        }
        let n = t.calls[rank].len();
        for (other, calls) in t.calls.iter().enumerate() {
            if other == rank {
                continue;
            }
            if let Some(theirs) = calls.get(n) {
                if *theirs != what {
                    let msg = format!(
                        "call {n}: rank {rank} issued {what}, rank {other} issued {theirs}"
                    );
                    t.desync = Some(msg.clone());
                    self.cv.notify_all();
                    return Err(DeviceError::Desync(msg));
                }
            }
        }
        t.calls[rank].push(what);
        Ok(n)
    }

    /// A call made by the host thread itself rather than enqueued on a stream (a kernel's
    /// own collective, as SyncBatchNorm's statistics are): rank `rank` issues call `what`
    /// (checked as every call is, SCOMM-1), brings `values` and gets every rank's, in rank
    /// order (SCOMM-3's timeout holds).
    pub fn exchange(&self, rank: usize, what: &str, values: Vec<f32>) -> Result<Vec<Vec<f32>>> {
        let n = self.issue(rank, what.to_string())?;
        let all = self.meet(n, rank, vec![values])?;
        Ok(all.into_iter().map(|mut v| v.pop().unwrap_or_default()).collect())
    }

    /// Rank `rank` brings its inputs to call `n` and waits for every rank's (SCOMM-3).
    fn meet(&self, n: usize, rank: usize, inputs: Vec<Vec<f32>>) -> Result<Vec<Vec<Vec<f32>>>> {
        let deadline = Instant::now() + self.timeout;
        let mut t = lock(&self.table);
        t.meetings.entry(n).or_default().inputs.insert(rank, inputs);
        self.cv.notify_all();
        loop {
            if let Some(d) = &t.desync {
                return Err(DeviceError::Desync(d.clone()));
            }
            if let Some(a) = &t.aborted {
                return Err(DeviceError::Failed(a.clone()));
            }
            let m = &t.meetings[&n];
            if m.inputs.len() == self.size {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<usize> =
                    (0..self.size).filter(|r| !m.inputs.contains_key(r)).collect();
                return Err(DeviceError::Failed(format!(
                    "rank {rank} waited {:?} in collective call {n} for ranks {missing:?}",
                    self.timeout
                )));
            }
            t = self.cv.wait_timeout(t, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        let m = t.meetings.get_mut(&n).expect("present");
        let all: Vec<Vec<Vec<f32>>> = (0..self.size).map(|r| m.inputs[&r].clone()).collect();
        m.left += 1;
        if m.left == self.size {
            t.meetings.remove(&n);
        }
        Ok(all)
    }
}

/// One rank's communicator on its device (simulated, or the host as a device: the same
/// semantics, so that the two give bitwise-equal results).
pub struct SimComm {
    rank: usize,
    world: Arc<SimWorld>,
    device: Arc<dyn Device>,
    /// Ops of an open group, with their buffers' places in `group_bufs`.
    group: Option<Vec<(Op, usize, usize)>>,
}

impl SimComm {
    /// Rank `rank` of `world`, on `device`.
    pub fn new(rank: usize, world: Arc<SimWorld>, device: Arc<dyn Device>) -> Self {
        SimComm { rank, world, device, group: None }
    }

    /// Ranks in the world.
    pub fn size(&self) -> usize {
        self.world.size
    }

    fn check(&self, what: &str, ok: bool) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(DeviceError::Invalid(format!("rank {}: {what}", self.rank)))
        }
    }

    /// Sums `buf` over the ranks, in place, on `stream`.
    pub fn all_reduce(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()> {
        self.call(stream, vec![(Op::AllReduce { len: buf.len() }, buf, buf)])
    }

    /// Concatenates every rank's `send` into `recv` (`world` times as long), on `stream`.
    pub fn all_gather(
        &mut self,
        stream: StreamId,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
    ) -> Result<()> {
        self.check(
            "all_gather: recv must be world x send",
            recv.len() == send.len() * self.size(),
        )?;
        self.call(stream, vec![(Op::AllGather { len: send.len() }, send, recv)])
    }

    /// Rank r gets the r-th block of the sum of every rank's `send`, on `stream`.
    pub fn reduce_scatter(
        &mut self,
        stream: StreamId,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
    ) -> Result<()> {
        self.check(
            "reduce_scatter: send must be world x recv",
            send.len() == recv.len() * self.size(),
        )?;
        self.call(stream, vec![(Op::ReduceScatter { len: recv.len() }, send, recv)])
    }

    /// All-gather in place: `buf` (`world` blocks) holds this rank's block at its rank's
    /// place, and every rank's afterwards (NCCL's in-place form).
    pub fn all_gather_in_place(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()> {
        self.check(
            "all_gather_in_place: length not a multiple of the world",
            buf.len().is_multiple_of(self.size()),
        )?;
        self.call(stream, vec![(Op::AllGather { len: buf.len() / self.size() }, buf, buf)])
    }

    /// Reduce-scatter in place: rank r's block of `buf` (`world` blocks) receives the r-th
    /// block of the sum; the other blocks keep their values (NCCL's in-place form).
    pub fn reduce_scatter_in_place(&mut self, stream: StreamId, buf: &DeviceBuffer) -> Result<()> {
        self.check(
            "reduce_scatter_in_place: length not a multiple of the world",
            buf.len().is_multiple_of(self.size()),
        )?;
        self.call(stream, vec![(Op::ReduceScatter { len: buf.len() / self.size() }, buf, buf)])
    }

    /// Copies `root`'s `buf` into every rank's, on `stream`.
    pub fn broadcast(&mut self, stream: StreamId, buf: &DeviceBuffer, root: usize) -> Result<()> {
        self.check("broadcast: root outside the world", root < self.size())?;
        self.call(stream, vec![(Op::Broadcast { len: buf.len(), root }, buf, buf)])
    }

    /// Opens a group: the calls until [`SimComm::group_end`] form one call.
    pub fn group_start(&mut self) {
        self.group.get_or_insert_with(Vec::new);
    }

    /// Issues the group opened by [`SimComm::group_start`] on `stream`, given the buffers of
    /// its calls in order as (send, recv) pairs.
    pub fn group_end(
        &mut self,
        stream: StreamId,
        bufs: &[(&DeviceBuffer, &DeviceBuffer)],
    ) -> Result<()> {
        let ops = self.group.take().unwrap_or_default();
        self.check(
            "group_end: one (send, recv) pair per call of the group",
            ops.len() == bufs.len(),
        )?;
        let calls = ops.into_iter().zip(bufs).map(|((op, _, _), (s, r))| (op, *s, *r)).collect();
        self.call(stream, calls)
    }

    fn call(
        &mut self,
        stream: StreamId,
        calls: Vec<(Op, &DeviceBuffer, &DeviceBuffer)>,
    ) -> Result<()> {
        if let Some(g) = &mut self.group {
            // Inside a group: remember the call; group_end issues it with the buffers.
            for (op, _, _) in calls {
                g.push((op, 0, 0));
            }
            return Ok(());
        }
        let ops: Vec<Op> = calls.iter().map(|c| c.0.clone()).collect();
        let n = self.world.issue(self.rank, describe(&ops))?;
        // Reads: each send that is not also its recv; writes: each recv.
        let mut reads: Vec<&DeviceBuffer> = Vec::new();
        let mut writes: Vec<&DeviceBuffer> = Vec::new();
        let mut places = Vec::new();
        for (_, s, r) in &calls {
            let si = if s.id == r.id {
                None
            } else {
                reads.push(s);
                Some(reads.len() - 1)
            };
            writes.push(r);
            places.push((si, writes.len() - 1));
        }
        let world = Arc::clone(&self.world);
        let (rank, size) = (self.rank, self.size());
        let name = format!("{} (call {n})", describe(&ops));
        let body: FallibleKernel = Box::new(move |r, w| {
            let inputs: Vec<Vec<f32>> = places
                .iter()
                .map(|&(si, wi)| match si {
                    Some(i) => r[i].to_vec(),
                    None => w[wi].to_vec(),
                })
                .collect();
            let all = world.meet(n, rank, inputs)?;
            for (k, op) in ops.iter().enumerate() {
                let in_place = places[k].0.is_none();
                let out = &mut *w[places[k].1];
                let input = |q: usize| &all[q][k];
                // SCOMM-2: the naive reductions, in rank order.
                match *op {
                    Op::AllReduce { .. } => {
                        out.iter_mut().for_each(|x| *x = 0.0);
                        for q in 0..size {
                            out.iter_mut().zip(input(q)).for_each(|(o, x)| *o += x);
                        }
                    }
                    Op::AllGather { len } => {
                        for q in 0..size {
                            // In place, rank q's block lies at its place in its buffer.
                            let from = if in_place { q * len } else { 0 };
                            out[q * len..(q + 1) * len]
                                .copy_from_slice(&input(q)[from..from + len]);
                        }
                    }
                    Op::ReduceScatter { len } => {
                        let at = if in_place { rank * len } else { 0 };
                        let out = &mut out[at..at + len];
                        out.iter_mut().for_each(|x| *x = 0.0);
                        for q in 0..size {
                            let block = &input(q)[rank * len..(rank + 1) * len];
                            out.iter_mut().zip(block).for_each(|(o, x)| *o += x);
                        }
                    }
                    Op::Broadcast { root, .. } => out.copy_from_slice(input(root)),
                }
            }
            Ok(())
        });
        let call = HostOnce::arc(name, body);
        self.device.launch_op(stream, call, &reads, &writes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{SimDevice, SimOptions};

    /// Runs `body(rank, comm, device, stream)` on `world` threads; each thread returns its
    /// result (thread joins bounded by the world's timeout through the device's waits).
    fn ranks<T: Send + 'static>(
        world: usize,
        timeout: Duration,
        body: impl Fn(usize, &mut SimComm, &SimDevice, StreamId) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let w = SimWorld::new(world, timeout);
        let body = Arc::new(body);
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (w, body) = (Arc::clone(&w), Arc::clone(&body));
                std::thread::spawn(move || {
                    let dev = Arc::new(SimDevice::new(SimOptions {
                        seed: r as u64 * 7 + 1,
                        max_delay_us: 300,
                        // The host's waits outlast the world's, so that a missing rank is
                        // reported by the collective (SCOMM-3), not by a host timeout.
                        timeout: timeout * 4 + Duration::from_secs(1),
                        ..SimOptions::default()
                    }));
                    let s = dev.stream("reduce");
                    let mut c = SimComm::new(r, w, Arc::clone(&dev) as Arc<dyn Device>);
                    body(r, &mut c, &dev, s)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    #[test]
    fn collectives_equal_the_naive_reductions_scomm_2() {
        let out = ranks(3, Duration::from_secs(20), |r, c, d, s| {
            let vals: Vec<f32> = (0..6).map(|i| (r * 10 + i) as f32).collect();
            let a = d.alloc(6, "a").unwrap();
            d.upload(s, &vals, &a).unwrap();
            c.all_reduce(s, &a).unwrap();
            let g = d.alloc(18, "g").unwrap();
            let src = d.alloc(6, "src").unwrap();
            d.upload(s, &vals, &src).unwrap();
            c.all_gather(s, &src, &g).unwrap();
            let big = d.alloc(6, "big").unwrap();
            d.upload(s, &vals, &big).unwrap();
            let rs = d.alloc(2, "rs").unwrap();
            c.reduce_scatter(s, &big, &rs).unwrap();
            let b = d.alloc(6, "b").unwrap();
            d.upload(s, &vals, &b).unwrap();
            c.broadcast(s, &b, 2).unwrap();
            [&a, &g, &rs, &b].map(|x| d.download(s, x).unwrap().wait(d).unwrap())
        });
        let v = |r: usize| (0..6).map(move |i| (r * 10 + i) as f32);
        let sum: Vec<f32> = (0..6).map(|i| (0..3).map(|r| (r * 10 + i) as f32).sum()).collect();
        let gathered: Vec<f32> = (0..3).flat_map(v).collect();
        for (r, [a, g, rs, b]) in out.into_iter().enumerate() {
            assert_eq!(a, sum, "all_reduce, rank {r}");
            assert_eq!(g, gathered, "all_gather, rank {r}");
            assert_eq!(rs, sum[2 * r..2 * r + 2].to_vec(), "reduce_scatter, rank {r}");
            assert_eq!(b, v(2).collect::<Vec<_>>(), "broadcast, rank {r}");
        }
    }

    /// SCOMM-2 in place: the all-gather fills the other ranks' blocks, the reduce-scatter
    /// writes the own block's sum and leaves the others.
    #[test]
    fn in_place_forms_equal_the_naive_reductions_scomm_2() {
        let out = ranks(2, Duration::from_secs(20), |r, c, d, s| {
            let vals: Vec<f32> = (0..4).map(|i| (r * 10 + i) as f32).collect();
            let g = d.alloc(4, "g").unwrap();
            d.upload(s, &vals, &g).unwrap();
            c.all_gather_in_place(s, &g).unwrap();
            let rs = d.alloc(4, "rs").unwrap();
            d.upload(s, &vals, &rs).unwrap();
            c.reduce_scatter_in_place(s, &rs).unwrap();
            [&g, &rs].map(|x| d.download(s, x).unwrap().wait(d).unwrap())
        });
        // Rank 0 holds 0..4, rank 1 holds 10..14.
        assert_eq!(out[0][0], vec![0.0, 1.0, 12.0, 13.0]);
        assert_eq!(out[1][0], vec![0.0, 1.0, 12.0, 13.0]);
        assert_eq!(out[0][1], vec![10.0, 12.0, 2.0, 3.0]);
        assert_eq!(out[1][1], vec![10.0, 11.0, 14.0, 16.0]);
    }

    #[test]
    fn ranks_that_issue_different_calls_are_named_scomm_1() {
        // Rank 1 gathers where ranks 0 and 2 reduce: every rank learns of the desync by name.
        let out = ranks(3, Duration::from_secs(10), |r, c, d, s| {
            let a = d.alloc(4, "a").unwrap();
            let g = d.alloc(12, "g").unwrap();
            let issued = if r == 1 { c.all_gather(s, &a, &g) } else { c.all_reduce(s, &a) };
            match issued {
                Err(e) => e.to_string(),
                Ok(()) => {
                    let e = d.record(s);
                    d.synchronize(&e).map(|_| String::new()).unwrap_or_else(|e| e.to_string())
                }
            }
        });
        for (r, msg) in out.iter().enumerate() {
            assert!(msg.contains("desync"), "rank {r}: {msg}");
            assert!(
                msg.contains("rank 1") && msg.contains("all_gather(4 elements per rank)"),
                "{msg}"
            );
            assert!(msg.contains("all_reduce(4 elements)"), "rank {r}: {msg}");
        }
    }

    #[test]
    fn groups_match_as_one_call_and_a_missing_rank_is_named_scomm_3() {
        // A group of two all-reduces on every rank: one call, both results right.
        let out = ranks(2, Duration::from_secs(10), |r, c, d, s| {
            let a = d.alloc(2, "a").unwrap();
            let b = d.alloc(3, "b").unwrap();
            d.upload(s, &[r as f32 + 1.0; 2], &a).unwrap();
            d.upload(s, &[10.0 * (r as f32 + 1.0); 3], &b).unwrap();
            c.group_start();
            c.all_reduce(s, &a).unwrap();
            c.all_reduce(s, &b).unwrap();
            c.group_end(s, &[(&a, &a), (&b, &b)]).unwrap();
            (
                d.download(s, &a).unwrap().wait(d).unwrap(),
                d.download(s, &b).unwrap().wait(d).unwrap(),
            )
        });
        for (a, b) in out {
            assert_eq!((a, b), (vec![3.0; 2], vec![30.0; 3]));
        }
        // SCOMM-3: rank 1 never calls; rank 0 fails within the timeout, naming rank 1.
        let out = ranks(2, Duration::from_millis(500), |r, c, d, s| {
            if r == 1 {
                return String::new();
            }
            let a = d.alloc(2, "a").unwrap();
            c.all_reduce(s, &a).unwrap();
            let e = d.record(s);
            d.synchronize(&e).err().map(|e| e.to_string()).unwrap_or_default()
        });
        assert!(out[0].contains("for ranks [1]"), "{}", out[0]);
    }
}
