//! A communicator's buffer pool: callers `take` a buffer, hand it to an op, get it back from
//! the op's `Work` and `give` it back, so that no data buffer is allocated in steady state.
//!
//! - POOL-1: buffers are kept by size class (the power of two at or below their capacity),
//!   so `take(len)` reuses a buffer only if its capacity is at least `len`.
//! - POOL-2: the pool is bounded (buffers per class and total bytes); extra buffers given
//!   back are freed.
//! - POOL-3: `take(len)` prefers a kept buffer at least `len` long (truncated, nothing
//!   written) to one that must grow (its new tail zero-filled).

use crate::config;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

const CLASSES: usize = usize::BITS as usize;

/// Size-classed, bounded pool of `Vec<f32>`.
pub struct BufferPool {
    classes: Mutex<Vec<Vec<Vec<f32>>>>,
    bytes: AtomicU64,
    allocations: AtomicU64,
    max_bytes: u64,
    per_class: usize,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("bytes", &self.bytes.load(Ordering::Relaxed))
            .field("allocations", &self.allocations.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for BufferPool {
    fn default() -> Self {
        Self::new(config::POOL_MAX_BYTES.get(), config::POOL_PER_CLASS.get() as usize)
    }
}

impl BufferPool {
    /// A pool keeping at most `max_bytes` in total and `per_class` buffers per size class.
    pub fn new(max_bytes: u64, per_class: usize) -> Self {
        BufferPool {
            classes: Mutex::new(vec![Vec::new(); CLASSES]),
            bytes: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            max_bytes,
            per_class,
        }
    }

    /// A buffer of exactly `len` elements. Its contents are unspecified (a reused buffer keeps
    /// old data; only a newly grown tail is zeroed): write before you read.
    pub fn take(&self, len: usize) -> Vec<f32> {
        let class = len.max(1).next_power_of_two().trailing_zeros() as usize;
        let found = {
            let mut classes = self.classes.lock().unwrap_or_else(|e| e.into_inner());
            // The class at `len`'s power of two or one above (POOL-1). A buffer already at
            // least `len` long comes first (POOL-3): growing a shorter one zero-fills the
            // tail, a pass over memory the caller is about to overwrite anyway.
            let range = class.saturating_sub(1)..(class + 2).min(CLASSES);
            let long = range
                .clone()
                .find_map(|c| classes[c].iter().position(|v| v.len() >= len).map(|i| (c, i)));
            let fits = || {
                range.clone().find_map(|c| {
                    classes[c].iter().position(|v| v.capacity() >= len).map(|i| (c, i))
                })
            };
            long.or_else(fits).map(|(c, i)| classes[c].swap_remove(i))
        };
        match found {
            Some(mut v) => {
                self.bytes.fetch_sub((v.capacity() * 4) as u64, Ordering::Relaxed);
                if v.len() >= len {
                    v.truncate(len);
                } else {
                    v.resize(len, 0.0);
                }
                v
            }
            None => {
                self.allocations.fetch_add(1, Ordering::Relaxed);
                let mut v = Vec::with_capacity(len.max(1).next_power_of_two());
                v.resize(len, 0.0);
                v
            }
        }
    }

    /// Returns a buffer to the pool (freed instead when the pool is full, POOL-2).
    pub fn give(&self, v: Vec<f32>) {
        let cap = v.capacity();
        if cap == 0 {
            return;
        }
        let class = (usize::BITS - 1 - cap.leading_zeros()) as usize;
        let bytes = (cap * 4) as u64;
        if self.bytes.load(Ordering::Relaxed) + bytes > self.max_bytes {
            return;
        }
        let mut classes = self.classes.lock().unwrap_or_else(|e| e.into_inner());
        if classes[class].len() < self.per_class {
            classes[class].push(v);
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Buffers allocated by `take` so far (misses); flat in steady state.
    pub fn allocations(&self) -> u64 {
        self.allocations.load(Ordering::Relaxed)
    }

    /// Bytes currently held by the pool.
    pub fn held_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_and_bounds_pool_1_2() {
        let p = BufferPool::new(1 << 20, 2);
        let a = p.take(1000);
        assert_eq!(a.len(), 1000);
        let cap = a.capacity();
        p.give(a);
        let b = p.take(900);
        assert_eq!(b.len(), 900);
        assert_eq!(b.capacity(), cap);
        assert_eq!(p.allocations(), 1);
        p.give(b);
        for _ in 0..4 {
            p.give(vec![0.0; 1024]);
        }
        assert!(p.held_bytes() <= 2 * 1024 * 4);
        let big = vec![0.0f32; 1 << 20];
        p.give(big);
        assert!(p.held_bytes() <= 1 << 20);
    }

    #[test]
    fn a_long_enough_buffer_comes_before_one_that_must_grow_pool_3() {
        let p = BufferPool::new(1 << 30, 4);
        // Same capacity class, different lengths; the short one is listed first.
        let mut long = Vec::with_capacity(1 << 20);
        long.resize(1_000_000, 7.0f32);
        let mut short = Vec::with_capacity(1 << 20);
        short.resize(800_000, 5.0f32);
        p.give(short);
        p.give(long);
        let b = p.take(1_000_000);
        // The long one, untouched: no zero-filled tail.
        assert_eq!(b.len(), 1_000_000);
        assert!(b.iter().all(|&x| x == 7.0));
        // Only the short one is left: it grows, its new tail zeroed.
        let c = p.take(900_000);
        assert!(c[..800_000].iter().all(|&x| x == 5.0) && c[800_000..].iter().all(|&x| x == 0.0));
        assert_eq!(p.allocations(), 0);
    }
}
