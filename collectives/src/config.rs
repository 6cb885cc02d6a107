//! Tunables of the crate: each has a default, an environment variable that overrides it, and
//! a doc line. Per-call choices live in [`crate::lane::CallOptions`]; per-communicator ones
//! in [`crate::communicator::CommOptions`], whose defaults come from here.

/// A tunable integer.
#[derive(Clone, Copy, Debug)]
pub struct Tunable {
    /// Environment variable that overrides the default.
    pub env: &'static str,
    /// Default value.
    pub default: u64,
    /// What it controls.
    pub doc: &'static str,
}

impl Tunable {
    /// The value from the environment when set and parseable, else the default.
    pub fn get(&self) -> u64 {
        std::env::var(self.env).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(self.default)
    }
}

/// Default deadline of every op, in milliseconds.
pub const TIMEOUT_MS: Tunable =
    Tunable { env: "SHARDLINE_TIMEOUT_MS", default: 60_000, doc: "default per-op deadline (ms)" };

/// How long a waiter busy-spins before it starts yielding (then, after 500 us, sleeping), in
/// microseconds. Measured on the 2-core reference machine (`tests/spin_probe.rs`, 4 KiB
/// all-reduce, median of 2000, two runs under different background load): W=2: 8.9-9.2 us
/// at 0, 4.8-19 us at 5, 5-52 us at 20, 5-117 us at 50; W=4: 21-22 us at 0, 33-43 us at 5,
/// 83-106 us at 20, 620 us at 200. With two threads per rank the cores are oversubscribed,
/// and a busy spinner then only delays the peer it waits for, while polling with
/// `yield_now` already avoids thread wake-ups. 0 is never far from the best and never
/// collapses; raise it on machines with a free core per thread.
pub const SPIN_US: Tunable =
    Tunable { env: "SHARDLINE_SPIN_US", default: 0, doc: "busy-spin time before yielding (us)" };

/// `Algorithm::Auto` uses Direct at or below this many bytes per rank buffer, else Ring (or
/// Hierarchical on a multi-node topology).
pub const SMALL_BYTES: Tunable = Tunable {
    env: "SHARDLINE_SMALL_BYTES",
    default: 64 * 1024,
    doc: "Auto: direct at or below (bytes)",
};

/// Piece size of the pipelined broadcast chain, in bytes.
pub const PIPELINE_BYTES: Tunable = Tunable {
    env: "SHARDLINE_PIPELINE_BYTES",
    default: 1 << 20,
    doc: "broadcast chain piece (bytes)",
};

/// Most bytes a [`crate::pool::BufferPool`] keeps in total.
pub const POOL_MAX_BYTES: Tunable =
    Tunable { env: "SHARDLINE_POOL_MAX_BYTES", default: 1 << 30, doc: "buffer pool cap (bytes)" };

/// Most buffers a pool keeps per size class.
pub const POOL_PER_CLASS: Tunable =
    Tunable { env: "SHARDLINE_POOL_PER_CLASS", default: 16, doc: "buffers kept per pool class" };

/// Every tunable, for `--help` style listings.
pub const ALL: &[Tunable] =
    &[TIMEOUT_MS, SPIN_US, SMALL_BYTES, PIPELINE_BYTES, POOL_MAX_BYTES, POOL_PER_CLASS];

/// `now + d`, saturating far in the future (a timeout of `Duration::MAX` means "no limit"
/// and must not overflow `Instant`).
pub fn deadline_after(d: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(100 * 365 * 24 * 3600))
}
