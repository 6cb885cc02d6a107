//! A strict simulated accelerator. Device buffers are allocations of their own that the host
//! reaches only through copies; each stream is a worker thread that runs its work later, in
//! order, after a seeded random delay, and only once the events it waits for have fired.
//! Every enqueue goes through the ordering rules ([`super::hazard`]): an access they refuse
//! poisons the buffer (NaN), fails the device, and is reported naming the buffer, the stream
//! and the operation it raced with. Memory has a capacity, as a GPU's has.
//!
//! Invariants:
//! - SIM-1: work on a stream runs in enqueue order, and an operation runs only after every
//!   operation its clock names (its stream's earlier work, the events it waited for, the
//!   host's waits) has run, whatever the delays.
//! - SIM-2: a refused access fails the device: the buffer is filled with NaN, every later
//!   call answers [`DeviceError::Failed`] with the first failure's message, and the work
//!   already enqueued is skipped (so that no wait hangs).
//! - SIM-3: bytes in use are the sum of the live allocations; an allocation past the capacity
//!   is refused and changes nothing.
//! - SIM-4: with [`SimOptions::ops_only`], host kernels are refused before anything is
//!   enqueued, naming the kernel, and only [`super::DeviceOp`]s run, as on a GPU (but for
//!   the host kernels [`SimOptions::host_kernels_allowed`] names).

use super::hazard::{Ordering, StreamId, Use, VectorClock};
use super::usage::Usage;
use super::{
    host_reference, Device, DeviceBuffer, DeviceError, DeviceOp, Download, Event, FallibleKernel,
    OpSpan, Reservation, Result,
};
use crossbeam::channel::{unbounded, Sender};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

static NEXT_DEVICE: AtomicU64 = AtomicU64::new(1);

/// How a simulated device behaves.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// Seeds every stream's delays.
    pub seed: u64,
    /// Longest delay before each operation, in microseconds (0: none).
    pub max_delay_us: u64,
    /// Device memory in bytes (`None`: unbounded).
    pub capacity: Option<u64>,
    /// How long a host wait may take before the device is failed as hung.
    pub timeout: Duration,
    /// Record every operation's span ([`Device::take_timeline`]).
    pub timeline: bool,
    /// Refuse host kernels ([`Device::launch`], [`Device::launch_fallible`]) as a GPU does:
    /// only [`Device::launch_op`] runs work (SIM-4).
    pub ops_only: bool,
    /// With `ops_only`, host kernels whose names begin with one of these still run: the
    /// work a test knows is not described as ops yet.
    pub host_kernels_allowed: Vec<String>,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            seed: 0,
            max_delay_us: 200,
            capacity: None,
            timeout: Duration::from_secs(60),
            timeline: false,
            ops_only: false,
            host_kernels_allowed: Vec::new(),
        }
    }
}

type Values = Arc<Mutex<Vec<f32>>>;
type Work = Box<dyn FnOnce() -> Result<()> + Send>;

struct Job {
    /// The operation's name, when the timeline is recorded.
    name: Option<Arc<str>>,
    seq: u64,
    clock: VectorClock,
    work: Work,
}

/// What the stream workers share with the device.
struct Shared {
    /// Operations run (or skipped after a failure) per stream.
    done: Mutex<Vec<u64>>,
    cv: Condvar,
    failed: Mutex<Option<String>>,
    /// The operations run, when recorded.
    timeline: Mutex<Vec<OpSpan>>,
}

impl Shared {
    fn fail(&self, msg: String) {
        let mut f = lock(&self.failed);
        if f.is_none() {
            tracing::error!("simulated device failed: {msg}");
            *f = Some(msg);
        }
    }

    fn failure(&self) -> Option<String> {
        lock(&self.failed).clone()
    }
}

struct State {
    ordering: Ordering,
    values: HashMap<u64, Values>,
    next_buffer: u64,
    senders: Vec<Sender<Job>>,
}

/// A simulated accelerator (SIM-1..3).
pub struct SimDevice {
    id: u64,
    opts: SimOptions,
    /// Bytes in use within the capacity (SIM-3, USAGE-1).
    usage: Arc<Usage>,
    shared: Arc<Shared>,
    state: Mutex<State>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A small seeded generator for the delays (splitmix64): reproducible per (seed, stream).
struct Delays(u64);

impl Delays {
    fn next(&mut self, max: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        if max == 0 {
            0
        } else {
            z % (max + 1)
        }
    }
}

impl SimDevice {
    /// A device with no stream yet.
    pub fn new(opts: SimOptions) -> Self {
        SimDevice {
            id: NEXT_DEVICE.fetch_add(1, AtomicOrdering::Relaxed),
            usage: Usage::new(opts.capacity),
            opts,
            shared: Arc::new(Shared {
                done: Mutex::new(Vec::new()),
                cv: Condvar::new(),
                failed: Mutex::new(None),
                timeline: Mutex::new(Vec::new()),
            }),
            state: Mutex::new(State {
                ordering: Ordering::new(),
                values: HashMap::new(),
                next_buffer: 1,
                senders: Vec::new(),
            }),
            workers: Mutex::new(Vec::new()),
        }
    }

    /// The first failure, if the device failed (SIM-2).
    pub fn failure(&self) -> Option<String> {
        self.shared.failure()
    }

    fn check_alive(&self) -> Result<()> {
        match self.shared.failure() {
            Some(m) => Err(DeviceError::Failed(m)),
            None => Ok(()),
        }
    }

    fn mine(&self, b: &DeviceBuffer) -> Result<()> {
        if b.device == self.id {
            Ok(())
        } else {
            Err(DeviceError::Invalid(format!("buffer '{}' belongs to another device", b.label())))
        }
    }

    /// Enqueues a host kernel (SIM-1, SIM-2): the body of `launch_fallible` and `launch_op`.
    fn run_kernel(
        &self,
        stream: StreamId,
        name: &str,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
        kernel: FallibleKernel,
    ) -> Result<()> {
        for r in reads {
            if writes.iter().any(|w| w.id == r.id) {
                return Err(DeviceError::Invalid(format!(
                    "{name}: buffer '{}' is both read and written (pass it as written)",
                    r.label()
                )));
            }
        }
        if writes.iter().enumerate().any(|(i, a)| writes[..i].iter().any(|b| a.id == b.id)) {
            return Err(DeviceError::Invalid(format!(
                "{name}: buffer '{}' is written twice (views of one allocation)",
                writes[0].label()
            )));
        }
        let mut uses: Vec<(&DeviceBuffer, Use)> = reads.iter().map(|b| (*b, Use::Read)).collect();
        uses.extend(writes.iter().map(|b| (*b, Use::Write)));
        let n_reads = reads.len();
        let ids: Vec<u64> = uses.iter().map(|(b, _)| b.id).collect();
        // DEVOP-2: a view's kernel sees its range only.
        let ranges: Vec<std::ops::Range<usize>> = uses.iter().map(|(b, _)| b.range()).collect();
        self.enqueue(stream, name, &uses, move |vals| {
            // Each allocation locked once (reads may be several views of one; writes never
            // share one with anything, checked above), in id order, so that two streams
            // never wait on each other's locks.
            let owner: Vec<usize> =
                ids.iter().map(|id| ids.iter().position(|x| x == id).unwrap_or(0)).collect();
            let mut order: Vec<usize> = (0..vals.len()).filter(|&i| owner[i] == i).collect();
            order.sort_by_key(|&i| ids[i]);
            let mut guards: Vec<Option<MutexGuard<'_, Vec<f32>>>> =
                (0..vals.len()).map(|_| None).collect();
            for i in order {
                guards[i] = Some(lock(&vals[i]));
            }
            let (rg, wg) = guards.split_at_mut(n_reads);
            let (rr, wr) = ranges.split_at(n_reads);
            let r: Vec<&[f32]> = rr
                .iter()
                .zip(&owner)
                .map(|(at, &o)| rg[o].as_deref().map_or(&[][..], |v| &v[at.clone()]))
                .collect();
            let mut w: Vec<&mut [f32]> = wg
                .iter_mut()
                .zip(wr)
                .map(|(g, at)| g.as_deref_mut().map_or(&mut [][..], |v| &mut v[at.clone()]))
                .collect();
            kernel(&r, &mut w)
        })
    }

    /// Enqueues `work` on `stream` after checking `uses` against the ordering rules; a
    /// refused access poisons the buffer and fails the device (SIM-2).
    fn enqueue(
        &self,
        stream: StreamId,
        op: &str,
        uses: &[(&DeviceBuffer, Use)],
        work: impl FnOnce(&[Values]) -> Result<()> + Send + 'static,
    ) -> Result<()> {
        self.check_alive()?;
        for (b, _) in uses {
            self.mine(b)?;
        }
        let mut st = lock(&self.state);
        let ids: Vec<(u64, Use)> = uses.iter().map(|(b, u)| (b.id, *u)).collect();
        let clock = match st.ordering.enqueue(stream, op, &ids) {
            Ok(c) => c,
            Err(h) => {
                for (b, _) in uses {
                    if b.label() == h.buffer {
                        if let Some(v) = st.values.get(&b.id) {
                            lock(v).iter_mut().for_each(|x| *x = f32::NAN);
                        }
                    }
                }
                self.shared.fail(h.to_string());
                return Err(DeviceError::Hazard(h));
            }
        };
        let values: Vec<Values> =
            uses.iter().map(|(b, _)| st.values.get(&b.id).cloned().unwrap_or_default()).collect();
        let seq = clock.get(stream);
        let name = self.opts.timeline.then(|| Arc::from(op));
        let job = Job { name, seq, clock, work: Box::new(move || work(&values)) };
        st.senders[stream]
            .send(job)
            .map_err(|_| DeviceError::Failed("a stream worker is gone".into()))
    }

    fn spawn_worker(&self, stream: StreamId, name: &str) -> Sender<Job> {
        let (tx, rx) = unbounded::<Job>();
        let shared = Arc::clone(&self.shared);
        let mut delays = Delays(self.opts.seed ^ (stream as u64).wrapping_mul(0x5851_F42D));
        let max = self.opts.max_delay_us;
        let timeout = self.opts.timeout;
        let stream_name = name.to_string();
        let h = std::thread::Builder::new()
            .name(format!("sim-{name}"))
            .spawn(move || {
                for job in rx {
                    let d = delays.next(max);
                    if d > 0 {
                        std::thread::sleep(Duration::from_micros(d));
                    }
                    // SIM-1: wait until every operation the clock names has run.
                    let deadline = Instant::now() + timeout;
                    let mut done = lock(&shared.done);
                    loop {
                        let ready =
                            job.clock.entries().iter().enumerate().all(|(s, &n)| {
                                s == stream || done.get(s).copied().unwrap_or(0) >= n
                            });
                        if ready {
                            break;
                        }
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            drop(done);
                            shared
                                .fail(format!("stream '{stream}' waited {timeout:?} for an event"));
                            done = lock(&shared.done);
                            break;
                        }
                        done =
                            shared.cv.wait_timeout(done, left).unwrap_or_else(|e| e.into_inner()).0;
                    }
                    drop(done);
                    // SIM-2: after a failure, work is skipped but still counted as done.
                    if shared.failure().is_none() {
                        let start = Instant::now();
                        if let Err(e) = (job.work)() {
                            shared.fail(e.to_string());
                        }
                        if let Some(op) = job.name {
                            lock(&shared.timeline).push(OpSpan {
                                stream: stream_name.clone(),
                                op: op.to_string(),
                                start,
                                end: Instant::now(),
                            });
                        }
                    }
                    let mut done = lock(&shared.done);
                    if done.len() <= stream {
                        done.resize(stream + 1, 0);
                    }
                    done[stream] = job.seq;
                    shared.cv.notify_all();
                }
            })
            .expect("spawn a simulated stream");
        lock(&self.workers).push(h);
        tx
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        lock(&self.state).senders.clear();
        for h in lock(&self.workers).drain(..) {
            let _ = h.join();
        }
    }
}

impl Device for SimDevice {
    fn id(&self) -> u64 {
        self.id
    }

    fn stream(&self, name: &str) -> StreamId {
        let mut st = lock(&self.state);
        let s = st.ordering.add_stream(name);
        drop(st);
        let tx = self.spawn_worker(s, name);
        let mut st = lock(&self.state);
        st.senders.push(tx);
        {
            let mut done = lock(&self.shared.done);
            if done.len() <= s {
                done.resize(s + 1, 0);
            }
        }
        s
    }

    fn alloc(&self, len: usize, label: &str) -> Result<DeviceBuffer> {
        self.check_alive()?;
        let mut st = lock(&self.state);
        // SIM-3.
        self.usage.take(len as u64 * 4, label)?;
        let id = st.next_buffer;
        st.next_buffer += 1;
        st.ordering.add_buffer(id, label);
        st.values.insert(id, Arc::new(Mutex::new(vec![0.0; len])));
        Ok(DeviceBuffer::new(id, self.id, len, label))
    }

    fn free(&self, stream: StreamId, buf: DeviceBuffer) -> Result<()> {
        buf.whole("free")?;
        self.enqueue(stream, &format!("free {}", buf.label()), &[(&buf, Use::Free)], |_| Ok(()))?;
        let mut st = lock(&self.state);
        st.values.remove(&buf.id);
        self.usage.give(buf.len() as u64 * 4);
        Ok(())
    }

    fn upload(&self, stream: StreamId, src: &[f32], dst: &DeviceBuffer) -> Result<()> {
        dst.whole("upload")?;
        if src.len() != dst.len() {
            return Err(DeviceError::Invalid(format!(
                "upload of {} elements into '{}' of {}",
                src.len(),
                dst.label(),
                dst.len()
            )));
        }
        let data = src.to_vec();
        self.enqueue(stream, &format!("upload {}", dst.label()), &[(dst, Use::Write)], move |v| {
            lock(&v[0]).copy_from_slice(&data);
            Ok(())
        })
    }

    fn download(&self, stream: StreamId, src: &DeviceBuffer) -> Result<Download> {
        src.whole("download")?;
        let data = Arc::new(Mutex::new(None));
        let out = Arc::clone(&data);
        self.enqueue(
            stream,
            &format!("download {}", src.label()),
            &[(src, Use::Read)],
            move |v| {
                *lock(&out) = Some(lock(&v[0]).clone());
                Ok(())
            },
        )?;
        Ok(Download { event: self.record(stream), data, finish: None })
    }

    fn copy(&self, stream: StreamId, src: &DeviceBuffer, dst: &DeviceBuffer) -> Result<()> {
        src.whole("copy")?;
        dst.whole("copy")?;
        if src.len() != dst.len() {
            return Err(DeviceError::Invalid(format!(
                "copy of '{}' ({}) into '{}' ({})",
                src.label(),
                src.len(),
                dst.label(),
                dst.len()
            )));
        }
        self.launch_fallible(
            stream,
            &format!("copy {} -> {}", src.label(), dst.label()),
            &[src],
            &[dst],
            Box::new(|r, w| {
                w[0].copy_from_slice(r[0]);
                Ok(())
            }),
        )
    }

    /// Enqueues a kernel that may fail (the communicator's collectives).
    fn launch_fallible(
        &self,
        stream: StreamId,
        name: &str,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
        kernel: FallibleKernel,
    ) -> Result<()> {
        let allowed = self.opts.host_kernels_allowed.iter().any(|p| name.starts_with(p.as_str()));
        if self.opts.ops_only && !allowed {
            // SIM-4: what a GPU answers to host code.
            return Err(DeviceError::Invalid(format!(
                "kernel '{name}' is host code: this device runs only ops (DeviceOp)"
            )));
        }
        self.run_kernel(stream, name, reads, writes, kernel)
    }

    fn launch_op(
        &self,
        stream: StreamId,
        op: Arc<dyn DeviceOp>,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
    ) -> Result<()> {
        let (name, kernel) = host_reference(op, reads, writes)?;
        self.run_kernel(stream, &name, reads, writes, kernel)
    }

    fn reserve(&self, bytes: u64, label: &str) -> Result<Reservation> {
        self.check_alive()?;
        self.usage.reserve(bytes, label)
    }

    fn record(&self, stream: StreamId) -> Event {
        let st = lock(&self.state);
        let clock = st.ordering.record(stream);
        Event { device: self.id, stream, seq: clock.get(stream), clock, native: None }
    }

    fn wait(&self, stream: StreamId, event: &Event) {
        lock(&self.state).ordering.wait(stream, &event.clock);
    }

    fn query(&self, event: &Event) -> bool {
        lock(&self.shared.done).get(event.stream).copied().unwrap_or(0) >= event.seq
    }

    fn synchronize(&self, event: &Event) -> Result<()> {
        if event.device != self.id {
            return Err(DeviceError::Invalid("an event of another device".into()));
        }
        let deadline = Instant::now() + self.opts.timeout;
        let mut done = lock(&self.shared.done);
        while done.get(event.stream).copied().unwrap_or(0) < event.seq {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(done);
                let msg = format!("the host waited {:?} for an event", self.opts.timeout);
                self.shared.fail(msg.clone());
                return Err(DeviceError::Failed(msg));
            }
            done = self.shared.cv.wait_timeout(done, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        drop(done);
        lock(&self.state).ordering.host_waited(&event.clock);
        self.check_alive()
    }

    fn in_use(&self) -> u64 {
        self.usage.in_use()
    }

    fn peak(&self) -> u64 {
        self.usage.peak()
    }

    fn take_timeline(&self) -> Vec<OpSpan> {
        std::mem::take(&mut *lock(&self.shared.timeline))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(seed: u64) -> SimDevice {
        SimDevice::new(SimOptions { seed, max_delay_us: 300, ..SimOptions::default() })
    }

    #[test]
    fn a_view_is_its_range_only_and_whole_allocation_calls_refuse_it_devop_2() {
        let cpu = crate::device::CpuDevice::new();
        for d in [&dev(3) as &dyn Device, &cpu] {
            let s = d.stream("s");
            let a = d.alloc(6, "a").unwrap();
            let b = d.alloc(3, "b").unwrap();
            d.upload(s, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &a).unwrap();
            let (mid, tail) = (a.view(1..4).unwrap(), b.view(1..3).unwrap());
            assert_eq!((mid.range(), mid.len(), mid.is_view()), (1..4, 3, true));
            // A view of a view keeps counting from the allocation.
            assert_eq!(mid.view(1..3).unwrap().range(), 2..4);
            assert!(a.view(4..7).is_err(), "past the end");
            d.launch(
                s,
                "copy a view into a view",
                &[&mid.view(0..2).unwrap()],
                &[&tail],
                Box::new(|r, w| w[0].copy_from_slice(r[0])),
            )
            .unwrap();
            d.launch(
                s,
                "double",
                &[],
                &[&mid],
                Box::new(|_, w| w[0].iter_mut().for_each(|x| *x *= 2.0)),
            )
            .unwrap();
            let got = |x: &DeviceBuffer| d.download(s, x).unwrap().wait(d).unwrap();
            assert_eq!(got(&a), vec![1.0, 4.0, 6.0, 8.0, 5.0, 6.0], "only 1..4 doubled");
            assert_eq!(got(&b), vec![0.0, 2.0, 3.0]);
            for e in [
                d.download(s, &mid).err(),
                d.upload(s, &[0.0; 3], &mid).err(),
                d.copy(s, &mid, &b).err(),
                d.free(s, a.view(0..6).unwrap()).err(),
            ] {
                assert!(
                    matches!(e, Some(DeviceError::Invalid(m)) if m.contains("whole allocations"))
                );
            }
            // Two reads of one allocation (an op's a and b from one buffer).
            d.launch(
                s,
                "add two views",
                &[&a.view(0..3).unwrap(), &a.view(3..6).unwrap()],
                &[&b],
                Box::new(|r, w| {
                    w[0].iter_mut().zip(r[0].iter().zip(r[1])).for_each(|(o, (x, y))| *o = x + y)
                }),
            )
            .unwrap();
            assert_eq!(got(&b), vec![9.0, 9.0, 12.0]);
            let two = (a.view(0..2).unwrap(), a.view(2..4).unwrap());
            let e = d.launch(s, "two views", &[], &[&two.0, &two.1], Box::new(|_, _| {}));
            assert!(matches!(e, Err(DeviceError::Invalid(m)) if m.contains("written twice")));
        }
    }

    #[test]
    fn events_order_streams_whatever_the_delays_sim_1() {
        // SIM-1: a producer stream writes, the consumer waits on its event and doubles; over
        // twenty delay seeds the host always reads the doubled values.
        for seed in 0..20 {
            let d = dev(seed);
            let (p, c) = (d.stream("gather"), d.stream("compute"));
            let a = d.alloc(64, "unit.params").unwrap();
            let b = d.alloc(64, "unit.out").unwrap();
            let src: Vec<f32> = (0..64).map(|i| i as f32).collect();
            d.upload(p, &src, &a).unwrap();
            let e = d.record(p);
            d.wait(c, &e);
            d.launch(
                c,
                "double",
                &[&a],
                &[&b],
                Box::new(|r, w| w[0].iter_mut().zip(r[0]).for_each(|(o, x)| *o = 2.0 * x)),
            )
            .unwrap();
            let got = d.download(c, &b).unwrap().wait(&d).unwrap();
            assert_eq!(got, src.iter().map(|x| 2.0 * x).collect::<Vec<_>>(), "seed {seed}");
        }
    }

    #[test]
    fn a_missing_wait_poisons_and_fails_loudly_sim_2() {
        // SIM-2: the consumer forgets the event wait (the gather->compute dependency): the
        // launch is refused naming buffer and stream, the buffer is poisoned, and every later
        // call fails with the first message.
        let d = dev(3);
        let (p, c) = (d.stream("gather"), d.stream("compute"));
        let a = d.alloc(8, "blocks.0 gathered").unwrap();
        let b = d.alloc(8, "out").unwrap();
        d.upload(p, &[1.0; 8], &a).unwrap();
        let e = d
            .launch(c, "matmul", &[&a], &[&b], Box::new(|_, _| {}))
            .expect_err("unordered read refused");
        let msg = e.to_string();
        assert!(msg.contains("blocks.0 gathered") && msg.contains("'compute'"), "{msg}");
        assert!(matches!(e, DeviceError::Hazard(_)));
        assert!(d.failure().is_some_and(|f| f.contains("blocks.0 gathered")));
        assert!(matches!(d.alloc(1, "x"), Err(DeviceError::Failed(_))));
        let ev = d.record(p);
        assert!(matches!(d.synchronize(&ev), Err(DeviceError::Failed(_))), "no hang, a failure");
        // The poison is there: the buffer's values are NaN (read past the failed device).
        let st = lock(&d.state);
        assert!(lock(&st.values[&a.id]).iter().all(|x| x.is_nan()));
    }

    #[test]
    fn a_buffer_reused_before_its_reader_is_done_is_caught_sim_2() {
        // FSDP's record_stream class of bug: the reduce stream reads a gradient buffer, and
        // compute writes the next unit's gradient into it without waiting for the reduction.
        let d = dev(5);
        let (c, r) = (d.stream("compute"), d.stream("reduce"));
        let g = d.alloc(16, "grad buffer").unwrap();
        let out = d.alloc(16, "reduced").unwrap();
        d.upload(c, &[1.0; 16], &g).unwrap();
        d.wait(r, &d.record(c));
        d.copy(r, &g, &out).unwrap();
        let e = d.upload(c, &[2.0; 16], &g).expect_err("write before the read is done");
        assert!(e.to_string().contains("grad buffer") && e.to_string().contains("reduce"), "{e}");
    }

    /// SIM-1 on the timeline: every operation is recorded once, named, on its stream, and
    /// one that waited for an event started after the operation before the event ended.
    #[test]
    fn the_timeline_shows_event_order_sim_1() {
        let d = SimDevice::new(SimOptions {
            timeline: true,
            max_delay_us: 300,
            ..SimOptions::default()
        });
        let (a, b) = (d.stream("a"), d.stream("b"));
        let buf = d.alloc(4, "x").unwrap();
        d.launch(a, "first", &[], &[&buf], Box::new(|_, w| w[0][0] = 1.0)).unwrap();
        let e = d.record(a);
        d.wait(b, &e);
        d.launch(b, "second", &[&buf], &[], Box::new(|_, _| {})).unwrap();
        d.synchronize(&d.record(b)).unwrap();
        let t = d.take_timeline();
        let names: Vec<_> = t.iter().map(|s| (s.stream.as_str(), s.op.as_str())).collect();
        assert_eq!(names, [("a", "first"), ("b", "second")]);
        assert!(t[1].start >= t[0].end);
        assert!(d.take_timeline().is_empty(), "taken once");
    }

    #[test]
    fn capacity_bounds_allocations_and_frees_give_back_sim_3() {
        let d = SimDevice::new(SimOptions { capacity: Some(1000), ..SimOptions::default() });
        let s = d.stream("compute");
        let a = d.alloc(200, "a").unwrap(); // 800 bytes
        let e = d.alloc(100, "b").expect_err("800 + 400 > 1000");
        assert!(e.to_string().contains("'b'") && e.to_string().contains("800 of 1000"), "{e}");
        assert_eq!(d.in_use(), 800, "a refused allocation changes nothing");
        d.free(s, a).unwrap();
        assert_eq!(d.in_use(), 0);
        let b = d.alloc(250, "b").unwrap();
        assert_eq!(d.in_use(), 1000);
        assert_eq!(d.peak(), 1000, "the peak counts what was in use at once");
        // A freed buffer is gone for good (HAZ-3 through the device).
        let c2 = d.alloc(0, "c").unwrap();
        d.free(s, c2).unwrap();
        let ev = d.record(s);
        d.synchronize(&ev).unwrap();
        drop(b);
    }
}
