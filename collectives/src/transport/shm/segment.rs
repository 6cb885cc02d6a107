//! The layout of a shared-memory segment (one direction of one pair on one lane) and its
//! mapping: a header page (magic, geometry, the closed flags of both sides, the poison
//! record, the CMA and arena flags, the withdrawn descriptor), `head` and `tail` each on a
//! cache line of its own, a 64-byte header per slot (tag, message length, offset of the
//! piece, piece length, kind, descriptor address) and the page-aligned slot payloads.
//! How the two sides use it (SHM-1 to SHM-6) is the exchange's, in `links`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::MmapRaw;

use super::setup;
use crate::transport::{Poison, TransportError};

/// A word whose address each sender publishes so that the receiver can check that it may
/// read this process's memory.
pub(super) static PROBE_WORD: u64 = u64::from_le_bytes(*b"SHMPROBE");
pub(super) const SLOT_INLINE: u32 = 0;
pub(super) const SLOT_DESCRIPTOR: u32 = 1;
pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"SLSHM001");
pub(super) const OFF_MAGIC: usize = 0;
pub(super) const OFF_SLOTS: usize = 8;
pub(super) const OFF_SLOT_BYTES: usize = 12;
pub(super) const OFF_SENDER_CLOSED: usize = 64;
pub(super) const OFF_RECEIVER_CLOSED: usize = 68;
pub(super) const OFF_POISONED: usize = 72;
pub(super) const OFF_POISON_ORIGIN: usize = 76;
pub(super) const OFF_POISON_LEN: usize = 80;
pub(super) const OFF_PROBE_ADDR: usize = 88;
pub(super) const OFF_CMA_OK: usize = 96;
/// Set by the receiver once it mapped the sender's arena (SHM-6).
pub(super) const OFF_ARENA_OK: usize = 100;
/// Highest descriptor (its `head` count) the sender withdrew (SHM-5).
pub(super) const OFF_REVOKED: usize = 104;
pub(super) const OFF_POISON_REASON: usize = 128;
pub(super) const POISON_REASON_MAX: usize = 256;
pub(super) const OFF_HEAD: usize = 512;
pub(super) const OFF_TAIL: usize = 576;
pub(super) const OFF_SLOT_HEADERS: usize = 1024;
pub(super) const SLOT_HEADER_BYTES: usize = 64;
pub(super) const PAGE: usize = 4096;

/// Where the slot payloads start: after the slot headers, on a page boundary.
fn payload_base(slots: usize) -> usize {
    (OFF_SLOT_HEADERS + slots * SLOT_HEADER_BYTES).div_ceil(PAGE) * PAGE
}

/// Bytes of a segment of `slots` slots of `slot_bytes` bytes.
fn segment_bytes(slots: usize, slot_bytes: usize) -> usize {
    payload_base(slots) + slots * slot_bytes
}

/// One mapped segment (one direction of one pair on one lane).
pub(super) struct Segment {
    map: MmapRaw,
    pub(super) slots: usize,
    pub(super) slot_bytes: usize,
    /// Set on the creating (sending) side: the file to unlink on drop.
    path: Option<PathBuf>,
}

// SAFETY: the mapping is plain shared memory; all concurrent access to it goes through
// atomics or through slots owned by one side at a time (SHM-1).
unsafe impl Send for Segment {}

impl Segment {
    pub(super) fn create(
        path: PathBuf,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<Segment, TransportError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| setup(format!("create {}: {e}", path.display())))?;
        let len = segment_bytes(slots, slot_bytes);
        file.set_len(len as u64).map_err(|e| setup(format!("size {}: {e}", path.display())))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| setup(format!("mmap: {e}")))?;
        let seg = Segment { map, slots, slot_bytes, path: Some(path) };
        seg.u32_at(OFF_SLOTS).store(slots as u32, Ordering::Relaxed);
        seg.u32_at(OFF_SLOT_BYTES).store(slot_bytes as u32, Ordering::Relaxed);
        seg.u64_at(OFF_PROBE_ADDR).store(std::ptr::addr_of!(PROBE_WORD) as u64, Ordering::Relaxed);
        seg.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    pub(super) fn open(path: &str) -> Result<Segment, TransportError> {
        let file: File = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| setup(format!("open {path}: {e}")))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| setup(format!("mmap {path}: {e}")))?;
        // Both sides hold the mapping now: the name is no longer needed.
        let _ = std::fs::remove_file(path);
        // SHM-2: check the geometry before trusting any offset derived from it.
        if map.len() < OFF_SLOT_HEADERS {
            return Err(setup(format!("segment {path} too small")));
        }
        let mut seg = Segment { map, slots: 0, slot_bytes: 0, path: None };
        if seg.u64_at(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(setup(format!("segment {path} has a bad magic")));
        }
        let slots = seg.u32_at(OFF_SLOTS).load(Ordering::Relaxed) as usize;
        let slot_bytes = seg.u32_at(OFF_SLOT_BYTES).load(Ordering::Relaxed) as usize;
        if slots == 0
            || slots > 1024
            || slot_bytes == 0
            || !slot_bytes.is_multiple_of(PAGE)
            || seg.map.len() < segment_bytes(slots, slot_bytes)
        {
            return Err(setup(format!(
                "segment {path} has a bad geometry ({slots} x {slot_bytes})"
            )));
        }
        seg.slots = slots;
        seg.slot_bytes = slot_bytes;
        Ok(seg)
    }

    #[inline]
    pub(super) fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.map.len());
        // SAFETY: `off` is a constant 8-aligned offset inside the header (the mapping is page
        // aligned and at least OFF_SLOT_HEADERS long); the memory lives as long as `self`
        // and is only ever accessed atomically at this offset by both processes.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    #[inline]
    pub(super) fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.map.len());
        // SAFETY: as in `u64_at`, with 4-byte alignment.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) }
    }

    #[inline]
    pub(super) fn head(&self) -> &AtomicU64 {
        self.u64_at(OFF_HEAD)
    }

    #[inline]
    pub(super) fn tail(&self) -> &AtomicU64 {
        self.u64_at(OFF_TAIL)
    }

    #[inline]
    pub(super) fn slot_header_ptr(&self, slot: usize) -> *mut u8 {
        debug_assert!(slot < self.slots);
        // SAFETY: slot < slots, and the geometry was checked against the mapping length.
        unsafe { self.map.as_mut_ptr().add(OFF_SLOT_HEADERS + slot * SLOT_HEADER_BYTES) }
    }

    #[inline]
    pub(super) fn payload_ptr(&self, slot: usize) -> *mut u8 {
        debug_assert!(slot < self.slots);
        // SAFETY: as above; the payload area of slot `slot` spans `slot_bytes` bytes inside
        // the mapping.
        unsafe { self.map.as_mut_ptr().add(payload_base(self.slots) + slot * self.slot_bytes) }
    }

    /// Writes a poison record once (the first reason wins).
    pub(super) fn write_poison(&self, p: &Poison) {
        if self.u32_at(OFF_POISONED).load(Ordering::Acquire) != 0 {
            return;
        }
        let mut n = p.reason.len().min(POISON_REASON_MAX);
        while !p.reason.is_char_boundary(n) {
            n -= 1;
        }
        // SAFETY: the reason area [OFF_POISON_REASON, +POISON_REASON_MAX) is inside the
        // header and written only by the sender before it publishes `poisoned` (Release).
        unsafe {
            std::ptr::copy_nonoverlapping(
                p.reason.as_ptr(),
                self.map.as_mut_ptr().add(OFF_POISON_REASON),
                n,
            );
        }
        self.u32_at(OFF_POISON_ORIGIN).store(p.origin as u32, Ordering::Relaxed);
        self.u32_at(OFF_POISON_LEN).store(n as u32, Ordering::Relaxed);
        self.u32_at(OFF_POISONED).store(1, Ordering::Release);
    }

    pub(super) fn read_poison(&self) -> Option<Poison> {
        if self.u32_at(OFF_POISONED).load(Ordering::Acquire) == 0 {
            return None;
        }
        let origin = self.u32_at(OFF_POISON_ORIGIN).load(Ordering::Relaxed) as usize;
        let n =
            (self.u32_at(OFF_POISON_LEN).load(Ordering::Relaxed) as usize).min(POISON_REASON_MAX);
        let mut buf = vec![0u8; n];
        // SAFETY: n <= POISON_REASON_MAX keeps the read inside the header's reason area,
        // which the sender no longer writes once `poisoned` is set.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(OFF_POISON_REASON),
                buf.as_mut_ptr(),
                n,
            );
        }
        Some(Poison { origin, reason: String::from_utf8_lossy(&buf).into_owned() })
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SHM-2: a segment with a bad geometry is refused on open.
    #[test]
    fn shm_refuses_a_bad_segment() {
        let path = format!("/dev/shm/shardline-test-bad-{}", std::process::id());
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        assert!(matches!(Segment::open(&path), Err(TransportError::Setup(_))));
        assert!(!std::path::Path::new(&path).exists(), "receiver unlinks the segment");
    }
}
