//! The machine's limits, measured in the same run as the benchmark that quotes them
//! (BENCH.md: every claim is a ratio taken in one run).

use serde::Serialize;
use std::time::Instant;

/// Memory bandwidth figures in GB/s (1e9 B/s), medians of several passes.
#[derive(Clone, Debug, Serialize)]
pub struct MemLimits {
    /// Single-thread memcpy, counting bytes read + bytes written.
    pub memcpy_1t_gbps: f64,
    /// memcpy on every core (each thread its own buffers), total.
    pub memcpy_all_gbps: f64,
    /// Single-thread c = a + b, counting 12 bytes per f32 element.
    pub add_1t_gbps: f64,
    /// c = a + b on every core, total.
    pub add_all_gbps: f64,
    /// Threads used for the "all" figures.
    pub threads: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Bytes moved per second of one memcpy pass (read + write) over `n` f32s.
fn memcpy_pass(src: &[f32], dst: &mut [f32]) -> f64 {
    let t = Instant::now();
    dst.copy_from_slice(src);
    std::hint::black_box(&dst);
    (src.len() * 8) as f64 / t.elapsed().as_secs_f64()
}

fn add_pass(a: &[f32], b: &[f32], c: &mut [f32]) -> f64 {
    let t = Instant::now();
    for ((c, a), b) in c.iter_mut().zip(a).zip(b) {
        *c = *a + *b;
    }
    std::hint::black_box(&c);
    (a.len() * 12) as f64 / t.elapsed().as_secs_f64()
}

/// Last-level cache size in bytes from sysfs (0 when unknown).
fn llc_bytes() -> usize {
    let mut best = 0;
    for i in 0..8 {
        let base = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
        let Ok(size) = std::fs::read_to_string(format!("{base}/size")) else { break };
        let size = size.trim();
        let (num, mult) = match size.strip_suffix('K') {
            Some(n) => (n, 1 << 10),
            None => match size.strip_suffix('M') {
                Some(n) => (n, 1 << 20),
                None => (size, 1),
            },
        };
        best = best.max(num.parse::<usize>().unwrap_or(0) * mult);
    }
    best
}

/// Each of `threads` threads runs `passes` passes over its own buffers of `elems` f32s. The
/// threads rotate through enough buffer sets that all of them together hold more than twice
/// the last-level cache, so that every pass reads and writes memory, not cache (a machine
/// with a large shared cache would otherwise report cache bandwidth as its limit).
fn run_threads(threads: usize, elems: usize, passes: usize, add: bool) -> f64 {
    let set_bytes = elems * 4 * 3;
    let sets = (2 * llc_bytes()).div_ceil(set_bytes * threads).clamp(1, 8);
    let results: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    let mut bufs: Vec<[Vec<f32>; 3]> = (0..sets)
                        .map(|_| [vec![1.0f32; elems], vec![2.0f32; elems], vec![0.0f32; elems]])
                        .collect();
                    let mut rates = Vec::with_capacity(passes);
                    for p in 0..passes {
                        let [a, b, c] = &mut bufs[p % sets];
                        rates.push(if add { add_pass(a, b, c) } else { memcpy_pass(a, c) });
                    }
                    median(rates)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0.0)).collect()
    });
    results.iter().sum::<f64>() / 1e9
}

/// Measures memcpy and a+b->c bandwidth with buffers far larger than cache (64 MiB each,
/// rotated through more than twice the last-level cache; see `run_threads`).
pub fn measure_mem() -> MemLimits {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let elems = 16 << 20; // 64 MiB of f32 per buffer
    let passes = 7;
    MemLimits {
        memcpy_1t_gbps: run_threads(1, elems, passes, false),
        memcpy_all_gbps: run_threads(threads, elems, passes, false),
        add_1t_gbps: run_threads(1, elems, passes, true),
        add_all_gbps: run_threads(threads, elems, passes, true),
        threads,
    }
}

/// Writes `total` bytes (a multiple of 1 MiB) in 1 MiB writes.
fn send_mib(s: &mut impl std::io::Write, total: usize) -> std::io::Result<()> {
    let buf = vec![7u8; 1 << 20];
    for _ in 0..(total >> 20) {
        s.write_all(&buf)?;
    }
    Ok(())
}

/// Reads until `total` bytes came or the peer closed.
fn drain(s: &mut impl std::io::Read, total: usize) -> std::io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0;
    while got < total {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        got += n;
    }
    Ok(())
}

/// Loopback TCP throughput of one stream in GB/s (the limit for the tcp transport), measured
/// with 256 MiB of 1 MiB writes, with the transport's congestion control.
pub fn measure_tcp_loopback() -> std::io::Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let total: usize = 256 << 20;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        drain(&mut s, total)?;
        s.write_all(&[1])?;
        Ok(())
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    // The same congestion control as the transport's links: the limit of what they can get.
    shardline_collectives::transport::tcp::set_congestion((&s).into());
    let t = Instant::now();
    send_mib(&mut s, total)?;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    let secs = t.elapsed().as_secs_f64();
    reader.join().map_err(|_| std::io::Error::other("reader thread panicked"))??;
    Ok(total as f64 / secs / 1e9)
}

/// Loopback TCP throughput in each direction, in GB/s, when both ends of one connection
/// send 128 MiB at once (1 MiB writes) while reading what the other sends: what one pair of
/// ranks exchanging at the same time (a W=2 step) can get from the kernel on this machine.
pub fn measure_tcp_loopback_both_ways() -> std::io::Result<f64> {
    let total: usize = 128 << 20;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    // Each end: a writer thread sends `total` bytes while this thread reads `total`.
    fn both_ways(s: std::net::TcpStream, total: usize) -> std::io::Result<()> {
        s.set_nodelay(true)?;
        shardline_collectives::transport::tcp::set_congestion((&s).into());
        let mut w = s.try_clone()?;
        let writer = std::thread::spawn(move || send_mib(&mut w, total));
        let mut r = s;
        drain(&mut r, total)?;
        writer.join().map_err(|_| std::io::Error::other("writer thread panicked"))??;
        Ok(())
    }
    let t = Instant::now();
    let other = std::thread::spawn(move || -> std::io::Result<()> {
        let (s, _) = listener.accept()?;
        both_ways(s, total)
    });
    both_ways(std::net::TcpStream::connect(addr)?, total)?;
    other.join().map_err(|_| std::io::Error::other("peer thread panicked"))??;
    Ok(total as f64 / t.elapsed().as_secs_f64() / 1e9)
}
