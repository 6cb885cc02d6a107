//! A global allocator whose large blocks live in one shared-memory file per process, so that
//! the shm transport of a peer on the same node can map them and read a message where it
//! lies: a reduction then reads the sender's buffer and adds it in one pass, and a copy is a
//! plain memcpy, instead of a copy into the slot ring (or through the kernel) first.
//!
//! Install it in a binary with
//! `#[global_allocator] static A: shardline_collectives::arena::SharedArena = SharedArena;`.
//! Blocks of at least [`MIN_BLOCK`] bytes come from a `memfd` mapped `MAP_SHARED`; everything
//! else, and everything once the arena cannot be set up or is full, comes from the system
//! allocator. Without it installed the transport works as before (slots, cross-memory attach).
//!
//! Why by hand: an allocator that serves Rust's own `Vec`s (whose memory the global
//! allocator must free) from a shareable mapping is what makes single-pass cross-process
//! reductions possible without changing the buffer type; no crate offers one.
//!
//! The arena reserves [`ARENA_BYTES`] of address space and file size; pages exist only once
//! touched. Blocks are powers of two; freed blocks are kept per size class for reuse, with
//! their pages while fewer than [`RETAIN_MAX`] bytes are kept that way (as a pool's buffers
//! would be), else with their pages given back to the system (`MADV_REMOVE`). Only when a
//! class's list is full is a block's address range left unused.
//!
//! Invariants:
//! - ARENA-1: a block handed out lies inside `[base, base + ARENA_BYTES)`, is page aligned,
//!   and no two live blocks overlap; `dealloc` sends every pointer back to the allocator that
//!   gave it (arena by address range, system otherwise).
//! - ARENA-2: `alloc_zeroed` returns zeros from the arena too (fresh pages are zero; reused
//!   blocks are cleared).
//! - ARENA-3: no heap allocation happens inside the allocator (fixed arrays, a const Mutex).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI32, AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Address space and file size reserved for the arena (pages are only used once touched).
pub const ARENA_BYTES: usize = 64 << 30;
/// Smallest block served from the arena; smaller ones come from the system allocator.
pub const MIN_BLOCK: usize = 1 << 20;
const MIN_SHIFT: u32 = 20;
const CLASSES: usize = 37 - MIN_SHIFT as usize; // up to 64 GiB blocks
/// Freed blocks listed per class. A training step can free far more than 32 blocks of one
/// size (a small transformer's saved activations: about ten 2 MiB tensors per block); a
/// block past the list loses its pages, and the next step faults fresh ones in.
const KEEP_PER_CLASS: usize = 256;
/// Most bytes of freed blocks whose pages are kept for reuse; past it a freed block's pages
/// go back to the system (its address range stays on the list and is reused).
pub const RETAIN_MAX: usize = 512 << 20;

const UNINIT: u8 = 0;
const INITIALIZING: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static BASE: AtomicUsize = AtomicUsize::new(0);
static FD: AtomicI32 = AtomicI32::new(-1);

struct Free {
    bump: usize,
    /// Bytes of listed blocks that still hold their pages.
    retained: usize,
    /// Per class: (offset, pages kept) of freed blocks.
    lists: [[(usize, bool); KEEP_PER_CLASS]; CLASSES],
    lens: [usize; CLASSES],
}

static FREE: Mutex<Free> = Mutex::new(Free {
    bump: 0,
    retained: 0,
    lists: [[(0, false); KEEP_PER_CLASS]; CLASSES],
    lens: [0; CLASSES],
});

/// The process's arena: its memfd, base address and size, once set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// File descriptor of the memfd (a peer opens `/proc/<pid>/fd/<fd>`).
    pub fd: i32,
    /// Address of the mapping in this process.
    pub base: usize,
    /// Bytes mapped.
    pub len: usize,
}

/// Sets the arena up if it is not yet (idempotent, thread-safe); `None` when it cannot be.
pub fn ensure() -> Option<Region> {
    loop {
        match STATE.load(Ordering::Acquire) {
            READY => {
                return Some(Region {
                    fd: FD.load(Ordering::Relaxed),
                    base: BASE.load(Ordering::Relaxed),
                    len: ARENA_BYTES,
                })
            }
            FAILED => return None,
            UNINIT => {
                if STATE
                    .compare_exchange(UNINIT, INITIALIZING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let ok = setup();
                    STATE.store(if ok { READY } else { FAILED }, Ordering::Release);
                }
            }
            _ => std::hint::spin_loop(),
        }
    }
}

/// The arena, if it was set up (never sets it up).
pub fn region() -> Option<Region> {
    (STATE.load(Ordering::Acquire) == READY).then(|| Region {
        fd: FD.load(Ordering::Relaxed),
        base: BASE.load(Ordering::Relaxed),
        len: ARENA_BYTES,
    })
}

/// Whether `[ptr, ptr + len)` lies inside this process's arena.
pub fn contains(ptr: *const u8, len: usize) -> bool {
    region().is_some_and(|r| {
        let p = ptr as usize;
        p >= r.base && p.checked_add(len).is_some_and(|end| end <= r.base + r.len)
    })
}

fn setup() -> bool {
    // SAFETY: plain system calls on values we own; every result is checked. No allocation
    // (ARENA-3): the name is a C string literal.
    unsafe {
        let fd = libc::memfd_create(c"shardline-arena".as_ptr(), libc::MFD_CLOEXEC);
        if fd < 0 {
            return false;
        }
        if libc::ftruncate(fd, ARENA_BYTES as libc::off_t) != 0 {
            libc::close(fd);
            return false;
        }
        let p = libc::mmap(
            std::ptr::null_mut(),
            ARENA_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            fd,
            0,
        );
        if p == libc::MAP_FAILED {
            libc::close(fd);
            return false;
        }
        FD.store(fd, Ordering::Relaxed);
        BASE.store(p as usize, Ordering::Relaxed);
    }
    true
}

fn class_of(size: usize) -> Option<usize> {
    let shift = size.max(MIN_BLOCK).next_power_of_two().trailing_zeros();
    let c = (shift - MIN_SHIFT) as usize;
    (c < CLASSES).then_some(c)
}

/// Takes a block of `class`; returns (pointer, fresh) where fresh blocks are untouched.
fn take(class: usize) -> Option<(*mut u8, bool)> {
    let base = ensure()?.base;
    let bytes = MIN_BLOCK << class;
    let mut f = FREE.lock().unwrap_or_else(|e| e.into_inner());
    if f.lens[class] > 0 {
        f.lens[class] -= 1;
        let (off, kept) = f.lists[class][f.lens[class]];
        if kept {
            f.retained -= bytes;
        }
        // A block whose pages were given back reads as zeros, like a fresh one.
        return Some(((base + off) as *mut u8, !kept));
    }
    let off = f.bump;
    if off + bytes > ARENA_BYTES {
        return None;
    }
    f.bump += bytes;
    Some(((base + off) as *mut u8, true))
}

fn give_back(ptr: *mut u8, class: usize) {
    let base = BASE.load(Ordering::Relaxed);
    let bytes = MIN_BLOCK << class;
    let mut f = FREE.lock().unwrap_or_else(|e| e.into_inner());
    let listed = f.lens[class] < KEEP_PER_CLASS;
    let keep_pages = listed && f.retained + bytes <= RETAIN_MAX;
    if listed {
        let n = f.lens[class];
        f.lists[class][n] = (ptr as usize - base, keep_pages);
        f.lens[class] += 1;
    }
    if keep_pages {
        f.retained += bytes;
        return;
    }
    // Give the pages back. A listed block is zero when handed out again; an unlisted one
    // (its class's list is full) leaves its address range unused, which the arena's address
    // space affords.
    // SAFETY: the block lies inside our own shared mapping (ARENA-1) and nobody uses it any
    // more (it was just freed); the lock keeps `take` from handing it out before the pages
    // are gone.
    unsafe {
        libc::madvise(ptr.cast(), bytes, libc::MADV_REMOVE);
    }
}

fn in_arena(ptr: *mut u8) -> bool {
    let base = BASE.load(Ordering::Relaxed);
    base != 0 && (ptr as usize) >= base && (ptr as usize) < base + ARENA_BYTES
}

/// The allocator (see the module documentation).
#[derive(Clone, Copy, Debug, Default)]
pub struct SharedArena;

// SAFETY: blocks come either from the system allocator (delegated as is) or from the arena
// (ARENA-1: page aligned, inside the mapping, never handed out twice while live); `dealloc`
// and `realloc` route by address, so each pointer returns to the allocator that made it.
unsafe impl GlobalAlloc for SharedArena {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= MIN_BLOCK && layout.align() <= 4096 {
            if let Some((p, _)) = class_of(layout.size()).and_then(take) {
                return p;
            }
        }
        // SAFETY: the caller's layout contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= MIN_BLOCK && layout.align() <= 4096 {
            if let Some((p, fresh)) = class_of(layout.size()).and_then(take) {
                if !fresh {
                    // SAFETY: the block holds at least layout.size() bytes (ARENA-2).
                    unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                }
                return p;
            }
        }
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if in_arena(ptr) {
            if let Some(c) = class_of(layout.size()) {
                give_back(ptr, c);
            }
            return;
        }
        // SAFETY: not an arena pointer, so the system allocator made it with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if in_arena(ptr) && new_size >= MIN_BLOCK && class_of(layout.size()) == class_of(new_size) {
            // The block already holds new_size bytes.
            return ptr;
        }
        if !in_arena(ptr) && new_size < MIN_BLOCK {
            // SAFETY: a system block staying a system block.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // Moving between the two allocators (or arena classes): allocate, copy, free.
        // SAFETY: new_size is non-zero and the alignment is the old one (GlobalAlloc's
        // realloc contract); the copy covers the bytes both blocks hold.
        unsafe {
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            let new = self.alloc(new_layout);
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(n: usize) -> Layout {
        Layout::from_size_align(n, 4).unwrap()
    }

    /// ARENA-1, ARENA-2: big blocks come from the arena, are distinct while live, reused
    /// after free, zeroed on request; small ones come from the system.
    #[test]
    fn blocks_route_by_size_and_come_back_arena_1_2() {
        let a = SharedArena;
        if ensure().is_none() {
            println!("skipped: no memfd here");
            return;
        }
        // SAFETY: every pointer is used within its layout and freed with it.
        unsafe {
            let small = a.alloc(layout(1000));
            assert!(!small.is_null() && !contains(small, 1000));
            a.dealloc(small, layout(1000));

            let p = a.alloc(layout(3 << 20));
            let q = a.alloc(layout(3 << 20));
            assert!(contains(p, 3 << 20) && contains(q, 3 << 20));
            assert_eq!(p as usize % 4096, 0);
            assert!((p as usize).abs_diff(q as usize) >= 4 << 20, "blocks overlap");
            std::ptr::write_bytes(p, 0xAB, 3 << 20);
            a.dealloc(p, layout(3 << 20));
            // The freed block comes back, cleared when zeroed memory is asked for.
            let z = a.alloc_zeroed(layout(3 << 20));
            assert!(contains(z, 3 << 20));
            assert!(std::slice::from_raw_parts(z, 3 << 20).iter().all(|&b| b == 0));
            // Growing inside the class keeps the block; growing past it moves the bytes.
            *z = 9;
            let g = a.realloc(z, layout(3 << 20), 4 << 20);
            assert_eq!(g, z);
            let h = a.realloc(g, layout(4 << 20), 5 << 20);
            assert_eq!(*h, 9);
            // From the system into the arena and back.
            let s = a.alloc(layout(64));
            *s = 5;
            let big = a.realloc(s, layout(64), 2 << 20);
            assert!(contains(big, 2 << 20) && *big == 5);
            let back = a.realloc(big, layout(2 << 20), 100);
            assert!(!contains(back, 100) && *back == 5);
            a.dealloc(back, layout(100));
            a.dealloc(h, layout(5 << 20));
            a.dealloc(q, layout(3 << 20));
        }
    }
}
