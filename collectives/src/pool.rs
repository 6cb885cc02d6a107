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

/// What the pool's rules read of a buffer: its length and its capacity, in elements.
pub trait Shelved {
    /// Elements in use.
    fn shelved_len(&self) -> usize;
    /// Elements allocated.
    fn shelved_capacity(&self) -> usize;
}

impl Shelved for Vec<f32> {
    fn shelved_len(&self) -> usize {
        self.len()
    }
    fn shelved_capacity(&self) -> usize {
        self.capacity()
    }
}

/// The pool's pure core: the kept buffers by size class, their bytes, and the rules that pick
/// one for a `take` (POOL-1, POOL-3) and keep one given back (POOL-2), over anything with a
/// length and a capacity. [`BufferPool`] runs it over its buffers; `shardline plan` over
/// sizes alone, so that it predicts the buffers the engine gets.
#[derive(Debug)]
pub struct Shelves<B> {
    classes: Vec<Vec<B>>,
    bytes: u64,
    max_bytes: u64,
    per_class: usize,
}

impl<B: Shelved> Shelves<B> {
    /// Shelves keeping at most `max_bytes` in total and `per_class` buffers per size class.
    pub fn new(max_bytes: u64, per_class: usize) -> Self {
        Shelves {
            classes: (0..CLASSES).map(|_| Vec::new()).collect(),
            bytes: 0,
            max_bytes,
            per_class,
        }
    }

    /// Bytes kept.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Drops every kept buffer.
    pub fn clear(&mut self) {
        self.classes.iter_mut().for_each(Vec::clear);
        self.bytes = 0;
    }

    /// The kept buffer `take(len)` reuses, removed from the shelves: from the class at
    /// `len`'s power of two or one either side (POOL-1), one already at least `len` long
    /// before one that must grow (POOL-3); `None` when none fits.
    pub fn take(&mut self, len: usize) -> Option<B> {
        let class = len.max(1).next_power_of_two().trailing_zeros() as usize;
        let range = class.saturating_sub(1)..(class + 2).min(CLASSES);
        let classes = &self.classes;
        let long = range
            .clone()
            .find_map(|c| classes[c].iter().position(|v| v.shelved_len() >= len).map(|i| (c, i)));
        let fits = || {
            range.clone().find_map(|c| {
                classes[c].iter().position(|v| v.shelved_capacity() >= len).map(|i| (c, i))
            })
        };
        let (c, i) = long.or_else(fits)?;
        let v = self.classes[c].swap_remove(i);
        self.bytes -= (v.shelved_capacity() * 4) as u64;
        Some(v)
    }

    /// Keeps `v` unless it would pass the byte bound or its class is full (POOL-2), or
    /// `admit`, told the bytes that would be kept, refuses (POOL-4); returns it when not
    /// kept.
    pub fn give(&mut self, v: B, admit: impl FnOnce(u64) -> bool) -> Option<B> {
        let cap = v.shelved_capacity();
        if cap == 0 {
            return Some(v);
        }
        let class = (usize::BITS - 1 - cap.leading_zeros()) as usize;
        let bytes = (cap * 4) as u64;
        if self.bytes + bytes > self.max_bytes || self.classes[class].len() >= self.per_class {
            return Some(v);
        }
        if !admit(self.bytes + bytes) {
            return Some(v);
        }
        self.classes[class].push(v);
        self.bytes += bytes;
        None
    }
}

/// Size-classed, bounded pool of `Vec<f32>`.
pub struct BufferPool {
    shelves: Mutex<Shelves<Vec<f32>>>,
    /// The shelves' bytes, readable without the lock.
    bytes: AtomicU64,
    allocations: AtomicU64,
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
            shelves: Mutex::new(Shelves::new(max_bytes, per_class)),
            bytes: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            account: Mutex::new(None),
        }
    }

    fn shelves(&self) -> std::sync::MutexGuard<'_, Shelves<Vec<f32>>> {
        self.shelves.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reports the bytes held to `account` from now on, starting with what is held now
    /// (POOL-4).
    pub fn set_account(&self, account: Arc<dyn PoolAccount>) {
        let mut shelves = self.shelves();
        if !account.held(shelves.bytes()) {
            // What is held cannot be kept: free it.
            shelves.clear();
            self.bytes.store(0, Ordering::Relaxed);
            account.held(0);
        }
        *self.account.lock().unwrap_or_else(|e| e.into_inner()) = Some(account);
    }

    /// Frees every kept buffer (reported to the account: nothing held).
    pub fn clear(&self) {
        let mut shelves = self.shelves();
        shelves.clear();
        self.bytes.store(0, Ordering::Relaxed);
        drop(shelves);
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
        let found = {
            let mut shelves = self.shelves();
            let found = shelves.take(len);
            if found.is_some() {
                let held = shelves.bytes();
                self.bytes.store(held, Ordering::Relaxed);
                if let Some(a) = self.account() {
                    a.held(held);
                }
            }
            found
        };
        match found {
            Some(mut v) => {
                // A long one is truncated, nothing written; a short one grows (POOL-3).
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
        let account = self.account();
        let mut shelves = self.shelves();
        let admit = |held| account.as_ref().is_none_or(|a| a.held(held));
        // A buffer not kept is dropped here, freed.
        drop(shelves.give(v, admit));
        self.bytes.store(shelves.bytes(), Ordering::Relaxed);
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
