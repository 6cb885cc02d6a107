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

/// Ops issued with `CallOptions::blocking` whose payload is at most this many bytes run on the
/// issuing thread when their lane is idle (nothing queued or running), instead of being handed to the lane's progress thread:
/// a latency-bound op then pays no thread hand-off on issue nor on completion (LANE-6).
/// 0 disables it. Such an op's `issue` call returns once the op is complete.
pub const INLINE_BYTES: Tunable = Tunable {
    env: "SHARDLINE_INLINE_BYTES",
    default: 64 * 1024,
    doc: "run ops up to this size on the caller when the lane is idle (bytes), 0 = never",
};

/// Piece size of the pipelined broadcast chain and of all-gathers sent in pieces
/// (`LaneLinks::prefers_pieced_gather`), in bytes.
pub const PIPELINE_BYTES: Tunable = Tunable {
    env: "SHARDLINE_PIPELINE_BYTES",
    default: 1 << 20,
    doc: "broadcast chain and pieced all-gather piece (bytes)",
};

/// Most bytes a [`crate::pool::BufferPool`] keeps in total.
pub const POOL_MAX_BYTES: Tunable =
    Tunable { env: "SHARDLINE_POOL_MAX_BYTES", default: 1 << 30, doc: "buffer pool cap (bytes)" };

/// Most buffers a pool keeps per size class.
pub const POOL_PER_CLASS: Tunable =
    Tunable { env: "SHARDLINE_POOL_PER_CLASS", default: 16, doc: "buffers kept per pool class" };

/// Artificial bandwidth of each directed link of the local transport, in bytes per second;
/// 0 means unlimited (the default). The value may also be written as [`parse_rate`] reads
/// it (`1gbit`, `200MB/s`). Used to make communication comparable to compute on a machine
/// where threads exchange memory far faster than a network would.
pub const LINK_RATE: Tunable = Tunable {
    env: "SHARDLINE_LINK_RATE",
    default: 0,
    doc: "local transport: bytes/s per link, 0 = unlimited (also 1gbit, 200MB/s)",
};

/// Time slice each lane thread asks the Linux scheduler for, in microseconds (0: the
/// scheduler's default). On EEVDF kernels (6.12+) a thread with a shorter slice preempts a
/// running one when it wakes; with the default slice a lane thread woken while every core
/// runs compute waited 2-4 ms to start an op (stage 3 traces, 2 ranks on the 2-core
/// machine), which showed as exposed communication. Older kernels ignore the request.
pub const LANE_SLICE_US: Tunable = Tunable {
    env: "SHARDLINE_LANE_SLICE_US",
    default: 100,
    doc: "lane threads' requested scheduler slice (us), 0 = default",
};

/// Every tunable, for `--help` style listings.
pub const ALL: &[Tunable] = &[
    TIMEOUT_MS,
    SPIN_US,
    SMALL_BYTES,
    INLINE_BYTES,
    PIPELINE_BYTES,
    POOL_MAX_BYTES,
    POOL_PER_CLASS,
    LINK_RATE,
    LANE_SLICE_US,
];

/// The collectives' environment variables with their defaults, one per line (for a
/// program's `--help`).
pub fn env_help() -> String {
    let mut out = String::new();
    for t in ALL {
        out.push_str(&format!("  {:<26} {} (default {})\n", t.env, t.doc, t.default));
    }
    out.push_str(&format!(
        "  {:<26} TCP congestion control of the tcp links; empty or `system`: the system's \
         (default {})\n",
        crate::transport::tcp::CONGESTION_ENV,
        crate::transport::tcp::DEFAULT_CONGESTION
    ));
    out.push_str(&format!(
        "  {:<26} shm: spin before yielding (us) (default {} while the node's ranks do not \
         outnumber its cores, else 0)\n",
        "SHARDLINE_SHM_SPIN_US",
        crate::transport::shm::DEFAULT_SPIN.as_micros()
    ));
    out.push_str(&format!(
        "  {:<26} tcp: spin of exchanges up to {} KiB before sleeping (us) (default {} while \
         the ranks do not outnumber the cores, else 0)\n",
        crate::transport::tcp::SPIN_ENV,
        crate::transport::tcp::SPIN_MAX_BYTES >> 10,
        crate::transport::tcp::DEFAULT_SPIN.as_micros()
    ));
    out
}

/// [`LINK_RATE`] from the environment: `None` when unset, 0 or unreadable (unlimited).
pub fn link_rate_from_env() -> Option<u64> {
    let v = std::env::var(LINK_RATE.env).ok()?;
    parse_rate(&v).ok().filter(|r| *r > 0)
}

/// Reads a data rate in bytes per second: a number with an optional unit, decimal prefixes
/// (k, M, G, T = 10^3..10^12) or binary ones (Ki, Mi, Gi), bytes (`B`, `B/s`) or bits
/// (`bit`, `bit/s`, `bps`, divided by 8). A bare number is bytes per second.
///
/// ```
/// use shardline_collectives::config::parse_rate;
/// assert_eq!(parse_rate("1gbit"), Ok(125_000_000));
/// assert_eq!(parse_rate("200MB/s"), Ok(200_000_000));
/// assert_eq!(parse_rate("1.5GiB/s"), Ok(1_610_612_736));
/// assert_eq!(parse_rate("4096"), Ok(4096));
/// assert!(parse_rate("fast").is_err());
/// ```
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num.parse().map_err(|_| format!("'{s}' is not a rate (e.g. 1gbit, 200MB/s)"))?;
    let unit = unit.trim();
    let unit = unit.strip_suffix("/s").or_else(|| unit.strip_suffix("ps")).unwrap_or(unit);
    let lower = unit.to_ascii_lowercase();
    let (scale, rest) = if let Some(r) = lower.strip_prefix("ki") {
        (1024f64, r)
    } else if let Some(r) = lower.strip_prefix("mi") {
        (1024f64 * 1024.0, r)
    } else if let Some(r) = lower.strip_prefix("gi") {
        (1024f64 * 1024.0 * 1024.0, r)
    } else if let Some(r) = lower.strip_prefix('k') {
        (1e3, r)
    } else if let Some(r) = lower.strip_prefix('m') {
        (1e6, r)
    } else if let Some(r) = lower.strip_prefix('g') {
        (1e9, r)
    } else if let Some(r) = lower.strip_prefix('t') {
        (1e12, r)
    } else {
        (1.0, lower.as_str())
    };
    // `b` alone follows the usual convention of its case: `B` bytes, `b` bits.
    let per = match rest {
        "" | "byte" | "bytes" => 1.0,
        "bit" | "bits" => 0.125,
        "b" if unit.ends_with('B') => 1.0,
        "b" => 0.125,
        _ => return Err(format!("'{s}': unknown unit (use B/s, bit/s, with k, M, G, Ki, Mi, Gi)")),
    };
    let v = x * scale * per;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err(format!("'{s}' is out of range"));
    }
    Ok(v.round() as u64)
}

/// `now + d`, saturating far in the future (a timeout of `Duration::MAX` means "no limit"
/// and must not overflow `Instant`).
pub fn deadline_after(d: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(100 * 365 * 24 * 3600))
}
