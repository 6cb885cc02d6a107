//! Per-rank memory accounting against an optional cap, like a GPU's memory.
//!
//! Every buffer the engine allocates is registered with the rank's [`MemoryTracker`] under a
//! [`Category`]; the returned [`Allocation`] is an RAII guard that gives the bytes back when
//! dropped. An allocation that would exceed the cap is refused with
//! [`RuntimeError::OutOfMemory`], naming what was being allocated and the current breakdown.
//!
//! # Invariants
//!
//! - **MEM-1**: `current(cat)` is the sum of the live allocations of `cat`; the total is the
//!   sum over categories.
//! - **MEM-2**: with a cap, the total in use never exceeds it: a refused allocation changes
//!   nothing.
//! - **MEM-3**: peaks are monotone until `reset_peaks` and are never below the current value;
//!   the total peak is the peak of the total, not the sum of per-category peaks.
//! - **MEM-4**: a [`RankMeter`] registers what layers allocate on the computing thread
//!   (`shardline_models::meter`): tensors as [`Category::Activations`], kernels' scratch as
//!   [`Category::Scratch`]; a charge the cap refuses is kept, and [`RankMeter::check`]
//!   returns it as the OutOfMemory it is, naming the category.
//! - **MEM-5**: the buffers the communicator's pool keeps between uses, and each lane's
//!   staging, are registered as [`Category::CommBuffers`] ([`HeldBytes`]) as they change;
//!   past the cap the pool frees a buffer instead of keeping it.
//! - **MEM-6**: an allocation the cap would refuse first frees idle cached memory (the
//!   pool's kept buffers, [`MemoryTracker::set_reclaim`]); it is refused only if it still
//!   does not fit.
//!
//! ```
//! use shardline_runtime::memory::{Category, MemoryTracker};
//! let mem = MemoryTracker::new(0, Some(1024));
//! let a = mem.alloc(Category::ShardParams, 800, "blocks.0").unwrap();
//! assert!(mem.alloc(Category::GatheredUnits, 400, "blocks.1").is_err());
//! drop(a);
//! assert_eq!(mem.total(), 0);
//! assert_eq!(mem.peak_total(), 800);
//! ```

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::error::{Result, RuntimeError};
use shardline_models::meter::Use;

/// Number of [`Category`] values.
pub const N_CATEGORIES: usize = 9;

/// What a tracked buffer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Category {
    /// Full (unsharded) parameters kept between steps (stages 0-2).
    FullParams,
    /// This rank's parameter shards.
    ShardParams,
    /// Gradients (full or shard).
    Grads,
    /// Optimizer state (full or shard).
    OptimizerState,
    /// Units gathered for compute at stage 3 (including prefetched ones).
    GatheredUnits,
    /// Stage 3's secondary pieces, held between a unit's forward and its later uses in the
    /// step (`--reshard-after-forward`, HPZ-2).
    SecondaryShards,
    /// Saved activations and temporaries of forward/backward.
    Activations,
    /// Staging buffers of collectives.
    CommBuffers,
    /// Kernels' scratch: GEMM packing and transposed copies, im2col columns (charged by the
    /// layers' meter, [`RankMeter`]).
    Scratch,
}

impl Category {
    /// All categories in display order.
    pub const ALL: [Category; N_CATEGORIES] = [
        Category::FullParams,
        Category::ShardParams,
        Category::Grads,
        Category::OptimizerState,
        Category::GatheredUnits,
        Category::SecondaryShards,
        Category::Activations,
        Category::CommBuffers,
        Category::Scratch,
    ];

    /// Short human label used in breakdowns and errors.
    pub fn label(self) -> &'static str {
        match self {
            Category::FullParams => "params",
            Category::ShardParams => "shard params",
            Category::Grads => "grads",
            Category::OptimizerState => "optimizer state",
            Category::GatheredUnits => "gathered unit",
            Category::SecondaryShards => "secondary shards",
            Category::Activations => "activations",
            Category::CommBuffers => "comm buffers",
            Category::Scratch => "scratch",
        }
    }

    /// Stable snake_case key (metrics labels, JSON).
    pub fn key(self) -> &'static str {
        match self {
            Category::FullParams => "full_params",
            Category::ShardParams => "shard_params",
            Category::Grads => "grads",
            Category::OptimizerState => "optimizer_state",
            Category::GatheredUnits => "gathered_units",
            Category::SecondaryShards => "secondary_shards",
            Category::Activations => "activations",
            Category::CommBuffers => "comm_buffers",
            Category::Scratch => "scratch",
        }
    }

    fn idx(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The memory this process may use: the host's physical memory (`MemTotal` of
/// `/proc/meminfo`), or its control group's limit when that is lower (a Slurm job step or a
/// container is killed at its limit, not at the host's). `None` where neither can be read
/// (not Linux). A rank that needs more than this cannot run here, whatever the overcommit
/// setting lets it allocate.
pub fn host_memory_bytes() -> Option<u64> {
    let read = |p: &std::path::Path| std::fs::read_to_string(p).ok();
    let total = read("/proc/meminfo".as_ref()).and_then(|t| {
        let line = t.lines().find(|l| l.starts_with("MemTotal:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
    });
    let limit = read("/proc/self/cgroup".as_ref()).and_then(|c| cgroup_memory_limit(&c, read));
    match (total, limit) {
        (Some(t), Some(l)) => Some(t.min(l)),
        (t, l) => t.or(l),
    }
}

/// The memory limit of the control group that `/proc/self/cgroup` (`proc_cgroup`) names,
/// read through `read`: cgroup v2's `memory.max` (`0::/path`) or v1's
/// `memory.limit_in_bytes` (`N:memory:/path`). `None` when there is none ("max", or v1's
/// page-rounded `i64::MAX`).
fn cgroup_memory_limit(
    proc_cgroup: &str,
    read: impl Fn(&std::path::Path) -> Option<String>,
) -> Option<u64> {
    let root = std::path::Path::new("/sys/fs/cgroup");
    let file = proc_cgroup.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let rel = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            Some(root.join("memory").join(rel).join("memory.limit_in_bytes"))
        } else if controllers.is_empty() {
            Some(root.join(rel).join("memory.max"))
        } else {
            None
        }
    })?;
    let v: u64 = read(&file)?.trim().parse().ok()?;
    // v1 writes "no limit" as i64::MAX rounded down to a page.
    (v < 1 << 62).then_some(v)
}

/// Formats a byte count with binary units and one decimal: `12.0 MiB`, `512 B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

#[derive(Debug, Default)]
struct Counters {
    current: [u64; N_CATEGORIES],
    peak: [u64; N_CATEGORIES],
    total: u64,
    peak_total: u64,
}

#[derive(Debug)]
struct Inner {
    rank: usize,
    cap: Option<u64>,
    counters: Mutex<Counters>,
    /// Frees idle cached memory (the buffer pool's kept buffers) when an allocation would
    /// exceed the cap (MEM-6).
    reclaim: Mutex<Option<Reclaim>>,
}

/// What frees idle cached memory (MEM-6).
#[derive(Clone)]
struct Reclaim(Arc<dyn Fn() + Send + Sync>);

impl fmt::Debug for Reclaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Reclaim")
    }
}

/// One rank's memory tracker. Cloning gives another handle to the same counters.
#[derive(Clone, Debug)]
pub struct MemoryTracker {
    inner: Arc<Inner>,
}

/// A point-in-time copy of a tracker's counters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemorySnapshot {
    /// The rank.
    pub rank: usize,
    /// The cap, if any.
    pub cap: Option<u64>,
    /// Bytes in use per category, in [`Category::ALL`] order.
    pub current: [u64; N_CATEGORIES],
    /// Peak bytes per category, in [`Category::ALL`] order.
    pub peak: [u64; N_CATEGORIES],
    /// Bytes in use in total.
    pub total: u64,
    /// Peak of the total.
    pub peak_total: u64,
}

impl MemorySnapshot {
    /// Bytes in use for `cat`.
    pub fn current(&self, cat: Category) -> u64 {
        self.current[cat.idx()]
    }
    /// Peak bytes for `cat`.
    pub fn peak(&self, cat: Category) -> u64 {
        self.peak[cat.idx()]
    }
}

impl MemoryTracker {
    /// A tracker for `rank`, with an optional cap in bytes.
    pub fn new(rank: usize, cap: Option<u64>) -> Self {
        MemoryTracker {
            inner: Arc::new(Inner {
                rank,
                cap,
                counters: Mutex::new(Counters::default()),
                reclaim: Mutex::new(None),
            }),
        }
    }

    /// The rank this tracker counts for.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The cap, if any.
    pub fn cap(&self) -> Option<u64> {
        self.inner.cap
    }

    fn lock(&self) -> MutexGuard<'_, Counters> {
        // A panic while holding the lock cannot leave the counters half-updated (every
        // update is a few integer stores), so a poisoned lock is still usable.
        self.inner.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `bytes` of `cat` for `what` (e.g. `blocks.3`). Refused with
    /// [`RuntimeError::OutOfMemory`] if it would exceed the cap (MEM-2).
    pub fn alloc(&self, cat: Category, bytes: u64, what: &str) -> Result<Allocation> {
        // MEM-6: before refusing, idle cached memory is freed, as a caching allocator frees
        // its cache on an out-of-memory; outside the counters' lock, since freeing updates
        // them.
        if let (Some(cap), Some(reclaim)) = (self.inner.cap, self.reclaimer()) {
            if self.lock().total.saturating_add(bytes) > cap {
                reclaim();
            }
        }
        let mut c = self.lock();
        let new_total = c.total.saturating_add(bytes);
        if let Some(cap) = self.inner.cap {
            if new_total > cap {
                let breakdown = breakdown_of(&c.current, c.total);
                return Err(RuntimeError::OutOfMemory {
                    rank: self.inner.rank,
                    category: cat,
                    what: what.to_string(),
                    requested: bytes,
                    cap,
                    in_use: c.total,
                    breakdown,
                });
            }
        }
        let i = cat.idx();
        c.current[i] += bytes;
        c.peak[i] = c.peak[i].max(c.current[i]);
        c.total = new_total;
        c.peak_total = c.peak_total.max(new_total);
        Ok(Allocation { tracker: self.clone(), cat, bytes })
    }

    /// Sets what frees idle cached memory before an allocation is refused (MEM-6).
    /// `None` removes it (the owner of what it frees is going away).
    pub fn set_reclaim(&self, reclaim: Option<Arc<dyn Fn() + Send + Sync>>) {
        *self.inner.reclaim.lock().unwrap_or_else(|e| e.into_inner()) = reclaim.map(Reclaim);
    }

    fn reclaimer(&self) -> Option<Arc<dyn Fn() + Send + Sync>> {
        self.inner.reclaim.lock().unwrap_or_else(|e| e.into_inner()).clone().map(|r| r.0)
    }

    /// Registers `count` f32 values (4 bytes each).
    pub fn alloc_f32(&self, cat: Category, count: usize, what: &str) -> Result<Allocation> {
        self.alloc(cat, count as u64 * 4, what)
    }

    /// Bytes that can still be allocated under the cap (`None`: no cap). Useful to bound a
    /// prefetch depth by what is left.
    pub fn available(&self) -> Option<u64> {
        let total = self.lock().total;
        self.inner.cap.map(|c| c.saturating_sub(total))
    }

    fn free(&self, cat: Category, bytes: u64) {
        let mut c = self.lock();
        let i = cat.idx();
        c.current[i] = c.current[i].saturating_sub(bytes);
        c.total = c.total.saturating_sub(bytes);
    }

    /// Bytes in use for `cat`.
    pub fn current(&self, cat: Category) -> u64 {
        self.lock().current[cat.idx()]
    }
    /// Peak bytes for `cat` since creation or the last [`reset_peaks`](Self::reset_peaks).
    pub fn peak(&self, cat: Category) -> u64 {
        self.lock().peak[cat.idx()]
    }
    /// Bytes in use in total.
    pub fn total(&self) -> u64 {
        self.lock().total
    }
    /// Peak of the total.
    pub fn peak_total(&self) -> u64 {
        self.lock().peak_total
    }
    /// Sets every peak to the current value (e.g. at the start of a measured step).
    pub fn reset_peaks(&self) {
        let mut c = self.lock();
        c.peak = c.current;
        c.peak_total = c.total;
    }
    /// A copy of all counters.
    pub fn snapshot(&self) -> MemorySnapshot {
        let c = self.lock();
        MemorySnapshot {
            rank: self.inner.rank,
            cap: self.inner.cap,
            current: c.current,
            peak: c.peak,
            total: c.total,
            peak_total: c.peak_total,
        }
    }
    /// Human breakdown of what is in use: `params 40.1 MiB, grads 10.0 MiB, total 50.1 MiB`.
    pub fn breakdown(&self) -> String {
        let c = self.lock();
        breakdown_of(&c.current, c.total)
    }
}

fn breakdown_of(current: &[u64; N_CATEGORIES], total: u64) -> String {
    let mut parts: Vec<String> = Category::ALL
        .iter()
        .filter(|c| current[c.idx()] > 0)
        .map(|c| format!("{} {}", c.label(), format_bytes(current[c.idx()])))
        .collect();
    parts.push(format!("total {}", format_bytes(total)));
    parts.join(", ")
}

/// RAII registration of a tracked buffer; frees its bytes on drop.
#[derive(Debug)]
#[must_use = "dropping an Allocation frees its bytes at once"]
pub struct Allocation {
    tracker: MemoryTracker,
    cat: Category,
    bytes: u64,
}

impl Allocation {
    /// Bytes registered.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// Category.
    pub fn category(&self) -> Category {
        self.cat
    }

    /// Changes the registered size (a buffer that grows or shrinks in place). Growing is
    /// checked against the cap like a new allocation of the difference; on refusal the
    /// allocation keeps its old size.
    pub fn resize(&mut self, new_bytes: u64, what: &str) -> Result<()> {
        if new_bytes > self.bytes {
            let extra = self.tracker.alloc(self.cat, new_bytes - self.bytes, what)?;
            // The extra bytes now belong to this allocation.
            std::mem::forget(extra);
        } else {
            self.tracker.free(self.cat, self.bytes - new_bytes);
        }
        self.bytes = new_bytes;
        Ok(())
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.tracker.free(self.cat, self.bytes);
    }
}

/// Communication memory whose size the communicator reports as it changes, registered as
/// [`Category::CommBuffers`]: what the buffer pool keeps between uses (past the cap the pool
/// frees the buffer instead), and a lane's staging (MEM-5).
#[derive(Debug)]
pub struct HeldBytes {
    held: Mutex<Allocation>,
    what: String,
}

impl HeldBytes {
    /// An account of nothing yet for `what`, registering with `mem`.
    pub fn new(mem: &MemoryTracker, what: &str) -> Result<Arc<Self>> {
        let held = mem.alloc(Category::CommBuffers, 0, what)?;
        Ok(Arc::new(HeldBytes { held: Mutex::new(held), what: what.to_string() }))
    }
}

impl shardline_collectives::pool::PoolAccount for HeldBytes {
    fn held(&self, bytes: u64) -> bool {
        let mut a = self.held.lock().unwrap_or_else(|e| e.into_inner());
        a.resize(bytes, &self.what).is_ok()
    }
}

/// The tracker as the meter of the layers a rank runs (MEM-4): every tensor and kernel
/// scratch they allocate while it is installed is registered, for as long as it lives.
#[derive(Debug)]
pub struct RankMeter {
    mem: MemoryTracker,
    refused: Mutex<Option<RuntimeError>>,
}

impl RankMeter {
    /// A meter registering with `mem`.
    pub fn new(mem: MemoryTracker) -> Arc<Self> {
        Arc::new(RankMeter { mem, refused: Mutex::new(None) })
    }

    /// The first charge the cap refused since the last check, as an error (MEM-4).
    pub fn check(&self) -> Result<()> {
        match self.refused.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl shardline_models::meter::Meter for RankMeter {
    fn charge(&self, bytes: u64, what: Use) -> Option<shardline_models::meter::Charge> {
        let (cat, label) = match what {
            Use::Tensor => (Category::Activations, "a layer's tensor"),
            Use::Scratch => (Category::Scratch, "a kernel's scratch"),
        };
        match self.mem.alloc(cat, bytes, label) {
            Ok(a) => Some(Box::new(a)),
            Err(e) => {
                self.refused.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1024 * 1024;

    /// The control group's memory limit is found under v1 and v2, and "no limit" or an
    /// unreadable file reads as none.
    #[test]
    fn the_cgroup_memory_limit_is_read_under_v1_and_v2() {
        let files = |path: &'static str, value: &'static str| {
            move |p: &std::path::Path| (p == std::path::Path::new(path)).then(|| value.to_string())
        };
        let v2 = "0::/slurm/uid_0/job_7/step_0\n";
        let f = files("/sys/fs/cgroup/slurm/uid_0/job_7/step_0/memory.max", "4294967296\n");
        assert_eq!(cgroup_memory_limit(v2, f), Some(4 << 30));
        let f = files("/sys/fs/cgroup/slurm/uid_0/job_7/step_0/memory.max", "max\n");
        assert_eq!(cgroup_memory_limit(v2, f), None);
        let v1 = "9:name=systemd:/\n4:memory:/process_api/ab\n1:cpu:/\n0::/\n";
        let f = files("/sys/fs/cgroup/memory/process_api/ab/memory.limit_in_bytes", "1073741824");
        assert_eq!(cgroup_memory_limit(v1, f), Some(1 << 30));
        let f = files(
            "/sys/fs/cgroup/memory/process_api/ab/memory.limit_in_bytes",
            "9223372036854771712",
        );
        assert_eq!(cgroup_memory_limit(v1, f), None);
        // Unreadable: no limit known.
        assert_eq!(cgroup_memory_limit(v2, |_: &std::path::Path| None), None);
        // This machine: some figure, never zero.
        assert!(host_memory_bytes().is_none_or(|b| b > 0));
    }

    #[test]
    fn layers_tensors_are_registered_and_a_refusal_is_reported_mem_4() {
        // MEM-4
        use shardline_models::{meter, Tensor};
        let mem = MemoryTracker::new(0, Some(4096));
        let m = RankMeter::new(mem.clone());
        let g = meter::install(Arc::clone(&m) as _);
        let t = Tensor::zeros(&[256]);
        assert_eq!(mem.current(Category::Activations), 1024);
        let big = Tensor::zeros(&[2048]);
        assert_eq!(mem.current(Category::Activations), 1024, "refused: not registered");
        match m.check() {
            Err(RuntimeError::OutOfMemory { category, requested, .. }) => {
                assert_eq!((category, requested), (Category::Activations, 8192));
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert!(m.check().is_ok(), "reported once");
        drop((t, big, g));
        assert_eq!(mem.current(Category::Activations), 0);
    }

    #[test]
    fn an_allocation_first_frees_the_pools_idle_buffers_mem_6() {
        // MEM-6
        use shardline_collectives::BufferPool;
        let mem = MemoryTracker::new(0, Some(10_000));
        let pool = Arc::new(BufferPool::new(1 << 20, 8));
        pool.set_account(HeldBytes::new(&mem, "buffer pool").unwrap() as _);
        let p2 = Arc::clone(&pool);
        mem.set_reclaim(Some(Arc::new(move || p2.clear())));
        pool.give(vec![0.0; 2000]); // 8000 bytes kept
        assert_eq!(mem.current(Category::CommBuffers), 8000);
        let a = mem.alloc(Category::Activations, 5000, "needs the room").expect("reclaimed");
        assert_eq!((pool.held_bytes(), mem.current(Category::CommBuffers)), (0, 0));
        assert!(mem.alloc(Category::Activations, 6000, "too much").is_err(), "still refused");
        drop(a);
        mem.set_reclaim(None);
    }

    #[test]
    fn the_pool_keeps_only_what_the_cap_allows_mem_5() {
        // MEM-5
        use shardline_collectives::BufferPool;
        let mem = MemoryTracker::new(0, Some(10_000));
        let pool = BufferPool::new(1 << 20, 8);
        pool.set_account(HeldBytes::new(&mem, "buffer pool").unwrap() as _);
        let a = pool.take(1000);
        let b = pool.take(1500);
        pool.give(a);
        assert_eq!(mem.current(Category::CommBuffers), 4000);
        pool.give(b); // 4000 + 6000 = 10000: kept
        assert_eq!(mem.current(Category::CommBuffers), 10_000);
        let c = pool.take(1000);
        assert_eq!(mem.current(Category::CommBuffers), 6000, "taken: no longer the pool's");
        let extra = mem.alloc(Category::Grads, 1000, "held elsewhere").unwrap();
        pool.give(c); // 6000 + 4000 + 1000 > 10000: freed instead
        assert_eq!(mem.current(Category::CommBuffers), 6000);
        assert_eq!(pool.held_bytes(), 6000);
        drop(extra);
    }

    #[test]
    fn format_bytes_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1024), "1.0 KiB");
        assert_eq!(format_bytes(12 * MIB), "12.0 MiB");
        assert_eq!(format_bytes(40 * MIB + MIB / 10 + 1), "40.1 MiB");
        assert_eq!(format_bytes(3 * 1024 * MIB), "3.0 GiB");
    }

    /// MEM-2: the OOM error names what, the cap and the breakdown; nothing changes.
    #[test]
    fn oom_names_allocation_and_breakdown() {
        let mem = MemoryTracker::new(2, Some(64 * MIB));
        let _p = mem.alloc(Category::FullParams, 40 * MIB, "params").unwrap();
        let _g = mem.alloc(Category::Grads, 20 * MIB, "grads").unwrap();
        let err = mem.alloc(Category::GatheredUnits, 12 * MIB, "blocks.3").unwrap_err();
        let msg = err.to_string();
        assert_eq!(
            msg,
            "rank 2: allocating 12.0 MiB for gathered unit blocks.3 would exceed the 64.0 MiB \
             cap; in use: params 40.0 MiB, grads 20.0 MiB, total 60.0 MiB"
        );
        assert!(matches!(
            err,
            RuntimeError::OutOfMemory { requested, in_use, .. } if requested == 12 * MIB && in_use == 60 * MIB
        ));
        assert_eq!(mem.total(), 60 * MIB);
        assert_eq!(mem.current(Category::GatheredUnits), 0);
        // Exactly at the cap is allowed.
        let _a = mem.alloc(Category::Activations, 4 * MIB, "act").unwrap();
        assert_eq!(mem.total(), 64 * MIB);
        assert!(mem.alloc(Category::CommBuffers, 1, "one byte").is_err());
    }

    /// MEM-3: the total peak is the peak of the sum, not the sum of peaks.
    #[test]
    fn peaks_and_reset() {
        let mem = MemoryTracker::new(0, None);
        {
            let _a = mem.alloc(Category::GatheredUnits, 100, "u0").unwrap();
        }
        let b = mem.alloc(Category::Activations, 70, "act").unwrap();
        assert_eq!(mem.peak(Category::GatheredUnits), 100);
        assert_eq!(mem.peak(Category::Activations), 70);
        assert_eq!(mem.peak_total(), 100);
        mem.reset_peaks();
        assert_eq!(mem.peak(Category::GatheredUnits), 0);
        assert_eq!(mem.peak_total(), 70);
        drop(b);
        let s = mem.snapshot();
        assert_eq!(s.total, 0);
        assert_eq!(s.peak(Category::Activations), 70);
    }

    #[test]
    fn resize_and_available() {
        let mem = MemoryTracker::new(1, Some(100));
        let mut a = mem.alloc(Category::Activations, 10, "act").unwrap();
        assert_eq!(mem.available(), Some(90));
        a.resize(60, "act").unwrap();
        assert_eq!((a.bytes(), mem.total()), (60, 60));
        let err = a.resize(101, "act").unwrap_err();
        assert!(err.to_string().contains("allocating 41 B for activations act"), "{err}");
        assert_eq!((a.bytes(), mem.total()), (60, 60));
        a.resize(5, "act").unwrap();
        assert_eq!((mem.total(), mem.peak_total()), (5, 60));
        drop(a);
        assert_eq!(mem.total(), 0);
        assert_eq!(MemoryTracker::new(0, None).available(), None);
    }

    #[test]
    fn handles_share_counters_across_threads() {
        let mem = MemoryTracker::new(0, None);
        let m2 = mem.clone();
        let h = std::thread::spawn(move || m2.alloc_f32(Category::CommBuffers, 10, "bucket"));
        let a = h.join().expect("thread panicked").unwrap();
        assert_eq!(mem.current(Category::CommBuffers), 40);
        drop(a);
        assert_eq!(mem.total(), 0);
    }

    proptest! {
        /// MEM-1, MEM-2, MEM-3 against a naive model of the counters.
        #[test]
        fn matches_naive_model(ops in proptest::collection::vec((0usize..7, 0u64..500, any::<bool>()), 0..60),
                               cap in proptest::option::of(200u64..3000)) {
            let mem = MemoryTracker::new(0, cap);
            let mut live: Vec<Allocation> = Vec::new();
            let mut naive: Vec<(usize, u64)> = Vec::new();
            let mut naive_peak_total = 0;
            for (cat, bytes, free) in ops {
                if free && !live.is_empty() {
                    drop(live.remove(0));
                    naive.remove(0);
                } else {
                    let total: u64 = naive.iter().map(|x| x.1).sum();
                    let r = mem.alloc(Category::ALL[cat], bytes, "x");
                    if cap.is_some_and(|c| total + bytes > c) {
                        prop_assert!(r.is_err());
                    } else {
                        live.push(r.unwrap());
                        naive.push((cat, bytes));
                    }
                }
                let total: u64 = naive.iter().map(|x| x.1).sum();
                naive_peak_total = naive_peak_total.max(total);
                prop_assert_eq!(mem.total(), total);
                for c in Category::ALL {
                    let cur: u64 = naive.iter().filter(|x| x.0 == c.idx()).map(|x| x.1).sum();
                    prop_assert_eq!(mem.current(c), cur);
                    prop_assert!(mem.peak(c) >= cur);
                }
                prop_assert_eq!(mem.peak_total(), naive_peak_total);
                if let Some(c) = cap { prop_assert!(mem.total() <= c); }
            }
        }
    }
}
