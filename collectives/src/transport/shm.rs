//! Shared-memory transport: ranks are processes on one node.
//!
//! For every lane and every ordered pair of ranks (src -> dst) the sender creates a segment,
//! a file in `/dev/shm` mapped by both sides, and publishes its name through the store. The
//! receiver maps it and unlinks the file at once, so nothing is left behind once both sides
//! hold the mapping (the sender unlinks too on drop, for a receiver that never came).
//!
//! A segment holds a single-producer single-consumer ring of slots. `head` (slots published,
//! written by the sender) and `tail` (slots consumed, written by the receiver) are atomics in
//! the segment, each on its own cache line. A slot carries a header (tag, message length,
//! offset of the piece in the message, piece length) and a 4 KiB-aligned payload. Big messages
//! stream through the ring: the receiver reduces or copies out of one slot while the sender
//! fills the next. The segment header also carries the `closed` flags of both sides and the
//! poison record the sender writes when its lane fails.
//!
//! Invariants, besides the transport's TR-1..TR-5:
//! - SHM-1: a slot is written only by the sender and only while `head - tail < slots`; it is
//!   read only by the receiver and only while `tail < head`. `head` is published with Release
//!   after the slot is written, `tail` with Release after the slot is consumed, and each side
//!   reads the other's counter with Acquire, so a slot is never read and written at once.
//! - SHM-2: every field a peer writes is validated before use (geometry on open; piece
//!   offset and length on receive): a corrupt segment gives `Corrupt`, never an out-of-bounds
//!   access.
//! - SHM-3: a waiting rank checks, every [`LIVENESS_PERIOD`], the closed flags of the peers it
//!   waits on and whether their processes are alive, and reports `PeerLost` — but only once no
//!   data that the peer published before leaving remains to be read.
//! - SHM-4: a message to a receiver that proved it can read the sender's memory
//!   (cross-memory attach, `process_vm_readv`, probed on open) travels as a descriptor
//!   (address and length) in one slot when it is at least `cma_copy_min` bytes and the
//!   receiver copies it ([`SendOp::copied`](super::SendOp::copied)), or at least `cma_min`
//!   bytes whatever the receiver does with it. A receiver whose sink is
//!   [`Sink::Copy`](super::Sink::Copy) reads straight from the sender's buffer into its
//!   destination: one copy instead of two (TR-6); any other sink
//!   gets the bytes through a cache-sized scratch. It then releases the slot. The sender's
//!   exchange completes only once that slot is released, so the buffer is never read after
//!   `exchange` returns (TR-5). Smaller messages, or receivers without the permission, go
//!   inline through the slots.
//! - SHM-6: where both processes allocate through [`crate::arena::SharedArena`], a receiver
//!   maps the sender's arena (read-only, opened through `/proc/<pid>/fd`) and tells it so in
//!   the segment. A message of at least `arena_min` bytes that lies in the sender's arena then
//!   goes by descriptor whether it is copied or reduced, and the receiver reads it where it
//!   lies: a reduction adds the sender's bytes in one pass, a copy is one memcpy. The same
//!   release and withdrawal rules as SHM-4 and SHM-5 apply.
//! - SHM-5: a sender whose exchange fails (deadline, cancel, a lost peer) while a descriptor
//!   it offered is not yet released revokes it (`revoked`, SeqCst) before returning, after
//!   which its buffer may be freed or reused. A receiver checks `revoked` after copying a
//!   descriptor message and before releasing its slot; a revoked message is discarded and
//!   the receive fails (with the sender's poison when there is one), so bytes read from
//!   memory the sender gave back are never delivered as data.
//! - SHM-7: an idle exchange spins before it yields only while the node's ranks do not
//!   outnumber its cores ([`default_spin`]); on an oversubscribed node it yields at once.
//!
//! The segment's layout and mapping live in `segment`, the exchange over a lane's segments
//! in `links`; this file opens them (names, store keys, the permission probe, the arenas).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{LaneLinks, Transport, TransportError};
use crate::store::Store;

mod links;
mod segment;
use links::{cma_read, Peer, PeerArena, ShmLinks, CMA_CHUNK_BYTES};
use segment::{Segment, OFF_ARENA_OK, OFF_CMA_OK, OFF_PROBE_ADDR, PAGE, PROBE_WORD};

/// Default number of slots per ring (env `SHARDLINE_SHM_SLOTS`).
pub const DEFAULT_SLOTS: usize = 8;
/// Default payload bytes per slot (env `SHARDLINE_SHM_SLOT_BYTES`, rounded to 4 KiB).
pub const DEFAULT_SLOT_BYTES: usize = 256 << 10;
/// How often a waiting rank checks that its peers are still there (SHM-3).
pub const LIVENESS_PERIOD: Duration = Duration::from_millis(2);
/// Default time an idle exchange spins before it yields the core while the node's ranks do
/// not outnumber its cores (SHM-7; env `SHARDLINE_SHM_SPIN_US` sets it whatever the count).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(30);

/// SHM-7: the spin an exchange among `local_world` processes starts with when the environment
/// sets none: [`DEFAULT_SPIN`] while each process can have a core of its own (this process's
/// CPU set and quota, `available_parallelism`), none once they outnumber the cores. A spinner
/// on an oversubscribed node holds the core that the peer it waits for needs: 4 KiB
/// all-reduce at W=4 over shm on 2 cores took 101 us with a 30 us spin and 7 us yielding at
/// once, while W=2 took 1.2 us against 1.6 (`bench/RESULTS.md`).
pub fn default_spin(local_world: usize) -> Duration {
    super::spin_if_ranks_have_cores(local_world, DEFAULT_SPIN)
}
/// Default smallest message sent by descriptor whatever the receiver does with it (SHM-4);
/// env `SHARDLINE_SHM_CMA_MIN_BYTES`. 0 (the default) keeps reduced messages inline:
/// measured on 2 cores, streaming them through the slots, where the sender's copy overlaps
/// the receiver's reduction, was as fast or faster than the receiver reading everything
/// alone.
pub const DEFAULT_CMA_MIN_BYTES: usize = 0;
/// Default smallest copied message sent by descriptor (SHM-4); env
/// `SHARDLINE_SHM_CMA_COPY_MIN_BYTES`, 0 disables. The receiver then reads the sender's
/// buffer straight into its destination, one copy instead of the two of the slot ring.
pub const DEFAULT_CMA_COPY_MIN_BYTES: usize = 256 << 10;
/// Default smallest message read in place from the sender's arena (SHM-6); env
/// `SHARDLINE_SHM_ARENA_MIN_BYTES`, 0 disables.
pub const DEFAULT_ARENA_MIN_BYTES: usize = 256 << 10;
/// Messages read in place from a peer's arena (SHM-6), for tests and diagnostics.
pub static ARENA_READS: AtomicU64 = AtomicU64::new(0);

static SEGMENT_COUNTER: AtomicU64 = AtomicU64::new(0);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

fn setup(what: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(what.to_string())
}

/// FNV-1a, for short stable names of lanes in segment file names.
fn fnv1a(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// The shared-memory transport (see the module docs).
pub struct ShmTransport {
    rank: usize,
    world: usize,
    store: Arc<dyn Store>,
    job: String,
    /// How many times each lane was opened here: part of the store keys, so that reopening
    /// a lane never picks up the segment names of an earlier opening.
    opens: Mutex<HashMap<String, u64>>,
    pids: Mutex<Vec<Option<i32>>>,
    slots: usize,
    slot_bytes: usize,
    spin: Duration,
    cma_min: usize,
    cma_copy_min: usize,
    arena_min: usize,
    /// This process's arena, when the shared allocator is installed (SHM-6).
    own_arena: Option<crate::arena::Region>,
    /// Peers' arenas mapped here, by rank (mapped once, shared by every lane).
    peer_arenas: Mutex<Vec<Option<Arc<PeerArena>>>>,
}

impl ShmTransport {
    /// Creates this rank's transport and publishes its pid under the job's keys.
    /// `job` names the job in the store keys and segment names (unique per job).
    pub fn new(
        rank: usize,
        world: usize,
        store: Arc<dyn Store>,
        job: &str,
    ) -> Result<Self, TransportError> {
        if rank >= world {
            return Err(setup(format!("rank {rank} out of world {world}")));
        }
        let slots = env_usize("SHARDLINE_SHM_SLOTS", DEFAULT_SLOTS).clamp(2, 1024);
        let slot_bytes = env_usize("SHARDLINE_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES)
            .clamp(PAGE, 64 << 20)
            .div_ceil(PAGE)
            * PAGE;
        store
            .set(&format!("shm/{job}/pid/{rank}"), std::process::id().to_string().as_bytes())
            .map_err(|e| setup(format!("publishing pid: {e}")))?;
        // SHM-6: publish the arena when the shared allocator serves this process (a large
        // allocation then lands in it).
        let own_arena = {
            let probe: Vec<u8> = Vec::with_capacity(crate::arena::MIN_BLOCK);
            crate::arena::contains(probe.as_ptr(), crate::arena::MIN_BLOCK)
                .then(crate::arena::region)
                .flatten()
        };
        let arena_value = match own_arena {
            Some(r) => format!("{} {} {}", r.fd, r.base, r.len),
            None => "none".to_owned(),
        };
        store
            .set(&format!("shm/{job}/arena/{rank}"), arena_value.as_bytes())
            .map_err(|e| setup(format!("publishing the arena: {e}")))?;
        Ok(ShmTransport {
            rank,
            world,
            store,
            job: job.to_owned(),
            opens: Mutex::new(HashMap::new()),
            pids: Mutex::new(vec![None; world]),
            slots,
            slot_bytes,
            spin: Duration::from_micros(env_usize(
                "SHARDLINE_SHM_SPIN_US",
                default_spin(world).as_micros() as usize,
            ) as u64),
            cma_min: env_usize("SHARDLINE_SHM_CMA_MIN_BYTES", DEFAULT_CMA_MIN_BYTES),
            cma_copy_min: env_usize("SHARDLINE_SHM_CMA_COPY_MIN_BYTES", DEFAULT_CMA_COPY_MIN_BYTES),
            arena_min: env_usize("SHARDLINE_SHM_ARENA_MIN_BYTES", DEFAULT_ARENA_MIN_BYTES),
            own_arena,
            peer_arenas: Mutex::new(vec![None; world]),
        })
    }

    /// Smallest message sent by descriptor (SHM-4); 0 sends everything inline. Applies to
    /// lanes opened afterwards. Default [`DEFAULT_CMA_MIN_BYTES`].
    pub fn set_cma_min_bytes(&mut self, bytes: usize) -> &mut Self {
        self.cma_min = bytes;
        self
    }

    /// Smallest copied message sent by descriptor (SHM-4); 0 sends copied messages inline
    /// (unless `cma_min` says otherwise). Applies to lanes opened afterwards. Default
    /// [`DEFAULT_CMA_COPY_MIN_BYTES`].
    pub fn set_cma_copy_min_bytes(&mut self, bytes: usize) -> &mut Self {
        self.cma_copy_min = bytes;
        self
    }

    /// The peer's arena mapped here (SHM-6), mapping it on first use; `None` when the peer
    /// has none or it cannot be mapped (the transport then works without it).
    fn peer_arena(
        &self,
        peer: usize,
        pid: i32,
        deadline: Instant,
    ) -> Result<Option<Arc<PeerArena>>, TransportError> {
        if self.arena_min == 0 {
            return Ok(None);
        }
        if let Some(a) = &self.peer_arenas.lock().unwrap_or_else(|e| e.into_inner())[peer] {
            return Ok(Some(Arc::clone(a)));
        }
        let v = self.get_from(peer, &format!("shm/{}/arena/{peer}", self.job), deadline)?;
        let text = String::from_utf8_lossy(&v);
        let nums: Vec<usize> = text.split(' ').filter_map(|x| x.parse().ok()).collect();
        let &[fd, base, len] = nums.as_slice() else { return Ok(None) };
        let Ok(fd) = i32::try_from(fd) else { return Ok(None) };
        let Some(a) = PeerArena::map(pid, fd, base, len).map(Arc::new) else {
            return Ok(None);
        };
        self.peer_arenas.lock().unwrap_or_else(|e| e.into_inner())[peer] = Some(Arc::clone(&a));
        Ok(Some(a))
    }

    /// What `peer` published under `key`, waiting until `deadline` (a late peer is a
    /// `Timeout` naming it).
    fn get_from(
        &self,
        peer: usize,
        key: &str,
        deadline: Instant,
    ) -> Result<Vec<u8>, TransportError> {
        self.store.get(key, deadline.saturating_duration_since(Instant::now())).map_err(|e| match e
        {
            crate::store::StoreError::Timeout { .. } => TransportError::Timeout { peer },
            e => setup(e),
        })
    }

    fn peer_pid(&self, peer: usize, deadline: Instant) -> Result<i32, TransportError> {
        if let Some(pid) = self.pids.lock().unwrap_or_else(|e| e.into_inner())[peer] {
            return Ok(pid);
        }
        let v = self.get_from(peer, &format!("shm/{}/pid/{peer}", self.job), deadline)?;
        let pid = std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse::<i32>().ok())
            .ok_or_else(|| setup(format!("rank {peer} published a bad pid")))?;
        self.pids.lock().unwrap_or_else(|e| e.into_inner())[peer] = Some(pid);
        Ok(pid)
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn open_lane(
        &self,
        lane: &str,
        deadline: Instant,
    ) -> Result<Box<dyn LaneLinks>, TransportError> {
        let generation = {
            let mut opens = self.opens.lock().unwrap_or_else(|e| e.into_inner());
            let g = opens.entry(lane.to_owned()).or_insert(0);
            *g += 1;
            *g
        };
        let me = self.rank;
        let safe_job: String = self
            .job
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .take(32)
            .collect();
        let key =
            |src: usize, dst: usize| format!("shm/{}/{lane}/{generation}/{src}->{dst}", self.job);
        let mut outs: Vec<Option<Segment>> = (0..self.world).map(|_| None).collect();
        for (p, out) in outs.iter_mut().enumerate() {
            if p == me {
                continue;
            }
            // The pid and a process-wide counter keep names of transports in one process apart.
            let name = format!(
                "shardline-{safe_job}-{:08x}-{generation}-{me}-{p}-{}-{}",
                fnv1a(lane),
                std::process::id(),
                SEGMENT_COUNTER.fetch_add(1, Ordering::Relaxed)
            );
            let path = PathBuf::from("/dev/shm").join(&name);
            // A leftover of a killed run with the same pid would block create_new.
            let _ = std::fs::remove_file(&path);
            let seg = Segment::create(path.clone(), self.slots, self.slot_bytes)?;
            self.store
                .set(&key(me, p), path.to_string_lossy().as_bytes())
                .map_err(|e| setup(format!("publishing segment: {e}")))?;
            *out = Some(seg);
        }
        let mut peers = Vec::with_capacity(self.world);
        for (p, out) in outs.into_iter().enumerate() {
            let Some(out) = out else {
                peers.push(None);
                continue;
            };
            let pid = self.peer_pid(p, deadline)?;
            let name = self.get_from(p, &key(p, me), deadline)?;
            let name = String::from_utf8(name).map_err(|_| setup("bad segment name"))?;
            let inn = Segment::open(&name)?;
            // SHM-4: tell the sender whether this rank may read its memory.
            let probe = inn.u64_at(OFF_PROBE_ADDR).load(Ordering::Relaxed);
            let mut word = [0u8; 8];
            if (self.cma_min > 0 || self.cma_copy_min > 0)
                && cma_read(pid, probe, &mut word).ok() == Some(8)
                && u64::from_le_bytes(word) == PROBE_WORD
            {
                inn.u32_at(OFF_CMA_OK).store(1, Ordering::Release);
            }
            let arena = self.peer_arena(p, pid, deadline)?;
            if arena.is_some() {
                inn.u32_at(OFF_ARENA_OK).store(1, Ordering::Release);
            }
            peers.push(Some(Peer { out, inn, pid, out_head: 0, in_tail: 0, arena }));
        }
        Ok(Box::new(ShmLinks {
            rank: me,
            peers,
            spin: self.spin,
            cma_min: if self.cma_min == 0 { usize::MAX } else { self.cma_min },
            cma_copy_min: if self.cma_copy_min == 0 { usize::MAX } else { self.cma_copy_min },
            arena_min: if self.arena_min == 0 { usize::MAX } else { self.arena_min },
            own_arena: self.own_arena.is_some(),
            scratch: vec![0u32; CMA_CHUNK_BYTES / 4],
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{suite, RecvOp, SendOp};
    use std::sync::atomic::AtomicBool;

    fn make(rank: usize, world: usize, store: Arc<dyn Store>) -> Box<dyn Transport> {
        Box::new(ShmTransport::new(rank, world, store, "unit").unwrap())
    }

    /// SHM-7: spin while every rank has a core, yield at once past that.
    #[test]
    fn spin_only_while_ranks_have_cores() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(default_spin(1), DEFAULT_SPIN);
        assert_eq!(default_spin(cores), DEFAULT_SPIN);
        assert_eq!(default_spin(cores + 1), Duration::ZERO);
    }

    /// TR-1, TR-2, TR-5; SHM-1: sizes around the slot and chunk boundaries arrive complete and
    /// in order through the one-writer, one-reader slot rings.
    #[test]
    fn shm_all_to_all_w2_w3() {
        suite::all_to_all(&make, 2);
        suite::all_to_all(&make, 3);
    }

    fn make_cma(rank: usize, world: usize, store: Arc<dyn Store>) -> Box<dyn Transport> {
        let mut t = ShmTransport::new(rank, world, store, "unit").unwrap();
        t.set_cma_min_bytes(128 << 10);
        Box::new(t)
    }

    /// TR-1, TR-2, TR-5 with large messages sent by descriptor (SHM-4).
    #[test]
    fn shm_descriptor_all_to_all_w2_w3() {
        suite::all_to_all(&make_cma, 2);
        suite::all_to_all(&make_cma, 3);
        suite::failures(&make_cma);
    }

    /// SHM-5: a sender that gives up on a descriptor message (here: its deadline passes
    /// before the receiver comes) withdraws it; the receiver that reads it afterwards fails
    /// instead of delivering whatever the sender's memory holds by then.
    #[test]
    fn withdrawn_descriptor_is_never_delivered_shm_5() {
        use crate::transport::Sink;
        let res = suite::run(&make, 2, |rank, links| {
            let len = 1 << 20;
            let never = AtomicBool::new(false);
            if rank == 0 {
                // Let the receiver finish opening (its permission probe) first.
                std::thread::sleep(Duration::from_millis(100));
                let mut data = vec![7u8; len];
                let r = links.exchange(
                    suite::tag(0),
                    &[SendOp { peer: 1, data: &data, copied: true }],
                    &mut [],
                    Instant::now() + Duration::from_millis(200),
                    &never,
                );
                // The buffer is reused at once, as a caller may after a failed exchange.
                data.iter_mut().for_each(|b| *b = 0xEE);
                drop(data);
                (r.is_err(), None)
            } else {
                std::thread::sleep(Duration::from_millis(600));
                let mut got = vec![0u8; len];
                let r = links.exchange(
                    suite::tag(0),
                    &[],
                    &mut [RecvOp { peer: 0, len, sink: Sink::Copy(&mut got) }],
                    Instant::now() + Duration::from_secs(5),
                    &never,
                );
                (false, Some(r))
            }
        });
        let (sender_failed, _) = &res[0];
        let recv = res[1].1.clone().expect("receiver result");
        if !sender_failed {
            // Without cross-memory attach the message went inline and was complete. Written
            // to the stderr handle: libtest hides a passing test's `println!`.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED withdrawn_descriptor_is_never_delivered_shm_5: the message did not go \
                 by descriptor here (no cross-memory attach)"
            );
            return;
        }
        assert!(
            matches!(recv, Err(TransportError::PeerLost { peer: 0, .. })),
            "a withdrawn message must fail the receive: {recv:?}"
        );
    }

    #[test]
    fn shm_mismatches() {
        suite::mismatches(&make);
    }

    /// TR-3, TR-4
    #[test]
    fn shm_failures() {
        suite::failures(&make);
    }

    fn group(w: usize) -> Vec<crate::Communicator> {
        crate::testing::group_over(w, &|r, store| {
            Arc::new(ShmTransport::new(r, w, store, "grid").expect("shm transport"))
        })
    }

    /// The core's conformance grid, ranks as threads over shm.
    #[test]
    fn shm_conformance_grid() {
        crate::testing::conformance_grid(&group, &crate::testing::GridConfig::default());
    }

    /// A quick probe of raw link latency and bandwidth (not a test of timing):
    /// `cargo test -p shardline-collectives --lib probe -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn shm_probe_exchange() {
        suite::probe(&make, "shm");
    }
}
