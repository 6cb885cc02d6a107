//! A communicator's buffer pool: callers `take` a buffer, hand it to an op, get it back from
//! the op's `Work` and `give` it back, so that no data buffer is allocated in steady state.
//!
//! - POOL-1: buffers are kept by size class (the power of two at or below their capacity),
//!   so `take(len)` reuses a buffer only if its capacity is at least `len`.
//! - POOL-2: the pool is bounded (buffers per class and total bytes); extra buffers given
//!   back are freed.
//! - POOL-3: `take(len)` prefers a kept buffer at least `len` long (truncated, nothing
//!   written) to one that must grow (its new tail zero-filled).
//! - POOL-4: a new buffer has exactly the capacity asked for, and with an accountant set
//!   ([`BufferPool::set_account`]) every change of the bytes held is reported to it; a
//!   buffer given back that the accountant refuses to keep is freed.

use crate::config;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Told what a pool holds, e.g. a memory accountant with a cap.
pub trait PoolAccount: Send + Sync {
    /// The pool now holds `bytes` (or would, after keeping a buffer given back); `false`
    /// refuses a growth, and the buffer is freed instead (POOL-4).
    fn held(&self, bytes: u64) -> bool;
}

const CLASSES: usize = usize::BITS as usize;

/// Size-classed, bounded pool of `Vec<f32>`.
pub struct BufferPool {
    classes: Mutex<Vec<Vec<Vec<f32>>>>,
    bytes: AtomicU64,
    allocations: AtomicU64,
    max_bytes: u64,
    per_class: usize,
    account: Mutex<Option<Arc<dyn PoolAccount>>>,
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
            account: Mutex::new(None),
        }
    }

    /// Reports the bytes held to `account` from now on, starting with what is held now
    /// (POOL-4).
    pub fn set_account(&self, account: Arc<dyn PoolAccount>) {
        let mut classes = self.classes.lock().unwrap_or_else(|e| e.into_inner());
        if !account.held(self.bytes.load(Ordering::Relaxed)) {
            // What is held cannot be kept: free it.
            classes.iter_mut().for_each(Vec::clear);
            self.bytes.store(0, Ordering::Relaxed);
            account.held(0);
        }
        *self.account.lock().unwrap_or_else(|e| e.into_inner()) = Some(account);
    }

    /// Frees every kept buffer (reported to the account: nothing held).
    pub fn clear(&self) {
        let mut classes = self.classes.lock().unwrap_or_else(|e| e.into_inner());
        classes.iter_mut().for_each(Vec::clear);
        self.bytes.store(0, Ordering::Relaxed);
        drop(classes);
        if let Some(a) = self.account() {
            a.held(0);
        }
    }

    fn account(&self) -> Option<Arc<dyn PoolAccount>> {
        self.account.lock().unwrap_or_else(|e| e.into_inner()).clone()
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
            let found = long.or_else(fits).map(|(c, i)| classes[c].swap_remove(i));
            if let Some(v) = &found {
                let held = self.bytes.fetch_sub((v.capacity() * 4) as u64, Ordering::Relaxed)
                    - (v.capacity() * 4) as u64;
                if let Some(a) = self.account() {
                    a.held(held);
                }
            }
            found
        };
        match found {
            Some(mut v) => {
                if v.len() >= len {
                    v.truncate(len);
                } else {
                    v.resize(len, 0.0);
                }
                v
            }
            None => {
                self.allocations.fetch_add(1, Ordering::Relaxed);
                // Exactly `len`: what the caller registers is what the heap holds (POOL-4).
                let mut v = Vec::with_capacity(len.max(1));
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
            let held = self.bytes.load(Ordering::Relaxed) + bytes;
            if let Some(a) = self.account() {
                if !a.held(held) {
                    return;
                }
            }
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

    /// Records what it is told; keeps at most `cap` bytes.
    struct Told(Mutex<Vec<u64>>, u64);
    impl PoolAccount for Told {
        fn held(&self, bytes: u64) -> bool {
            self.0.lock().unwrap().push(bytes);
            bytes <= self.1
        }
    }

    #[test]
    fn the_accountant_is_told_every_change_and_may_refuse_pool_4() {
        // POOL-4
        let pool = BufferPool::new(1 << 20, 8);
        let a = pool.take(100);
        assert_eq!(a.capacity(), 100, "exactly the capacity asked for");
        pool.give(a);
        let told = Arc::new(Told(Mutex::new(Vec::new()), 600));
        pool.set_account(Arc::clone(&told) as _);
        assert_eq!(*told.0.lock().unwrap(), vec![400], "what is held when set");
        let b = pool.take(100);
        let c = pool.take(50);
        pool.give(b);
        pool.give(c); // 400 + 200 = 600: kept
        let d = pool.take(200);
        pool.give(d); // 600 + 800 > 600: refused, freed
        assert_eq!(*told.0.lock().unwrap(), vec![400, 0, 400, 600, 1400]);
        assert_eq!(pool.held_bytes(), 600);
    }

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
        // At most two per class: the 1000-value buffer (class 512) and two of 1024.
        assert!(p.held_bytes() <= (1000 + 2 * 1024) * 4);
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
