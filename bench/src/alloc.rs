//! A counting global allocator over another one: the bytes this process holds from the heap now, and the most
//! it held since the last [`reset_peak`]. `shardline-bench memory-measured` runs one process
//! per rank, so the process's count is the rank's, whatever thread (rank, lanes, runtime)
//! allocated or freed a buffer. It measures the peak independently of the runtime's
//! `MemoryTracker`, which counts only what the engine registers.
//!
//! Written by hand because it is a dozen lines over the inner allocator: the crates that do this count
//! totals or per-thread figures, not a resettable process peak.
//!
//! Counts requested sizes (`Layout::size`), as the tracker counts requested bytes: neither
//! sees the allocator's rounding nor memory mapped outside the heap (thread stacks,
//! shared-memory rings).
//!
//! Invariants:
//! - ALLOC-1: `live` is the sum of the sizes of the blocks allocated and not yet freed
//!   (a `realloc` counts as the difference); `peak >= live` always, and right after
//!   [`reset_peak`] `peak == live`.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// The allocator `A`, counted.
pub struct Counting<A>(pub A);

fn grew(by: u64) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

fn shrank(by: u64) {
    LIVE.fetch_sub(by, Relaxed);
}

// SAFETY: every call forwards to `A` with the caller's arguments; the counters are atomics
// and never affect what is returned.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { self.0.dealloc(ptr, layout) };
        shrank(layout.size() as u64);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            let old = layout.size() as u64;
            let new = new_size as u64;
            if new >= old {
                grew(new - old);
            } else {
                shrank(old - new);
            }
        }
        p
    }
}

/// Heap bytes held now.
pub fn live() -> u64 {
    LIVE.load(Relaxed)
}

/// The most heap bytes held at once since the last [`reset_peak`] (or the start).
pub fn peak() -> u64 {
    PEAK.load(Relaxed)
}

/// Starts a new peak from what is held now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Relaxed), Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_and_peak_follow_allocations_alloc_1() {
        // ALLOC-1. Other test threads allocate too, so compare with margins far below the
        // 64 MiB moved here.
        const M: usize = 64 << 20;
        reset_peak();
        let before = live();
        let v = vec![1u8; M];
        assert!(live() >= before + M as u64 - (8 << 20), "live counts the block");
        assert!(peak() >= live(), "peak >= live");
        drop(v);
        assert!(live() < before + (8 << 20), "freeing gives the bytes back");
        assert!(peak() >= before + M as u64 - (8 << 20), "the peak remembers the block");
        reset_peak();
        let p = peak();
        assert!(p < before + (8 << 20), "after a reset the peak starts from what is held");
        // realloc counts the difference.
        let mut w: Vec<u8> = Vec::with_capacity(M / 2);
        w.reserve_exact(M);
        assert!(peak() >= p + M as u64 - (8 << 20));
        drop(w);
    }
}
