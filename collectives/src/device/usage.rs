//! A device's memory count: bytes in use, the peak, the capacity. Allocations and the
//! memory kernels take while they run ([`Reservation`]) draw on the same count, as a GPU's
//! caching allocator serves both a program's buffers and the tensors its kernels make.
//! Public, so that a device of another crate (the CUDA device) keeps the same count.
//!
//! The count has a lock of its own, apart from a device's buffers and streams, because a
//! kernel reserves while it runs, on a stream's worker or (the host device) inside
//! `launch`, where the device's state is already held.
//!
//! Invariant:
//! - USAGE-1: bytes in use are the sum of the live allocations and reservations; a request
//!   past the capacity is refused and changes nothing; the peak is the most bytes in use at
//!   once, and a reservation gives its bytes back exactly once, when it is dropped.

use std::sync::{Arc, Mutex, MutexGuard};

use super::{DeviceError, Result};

#[derive(Default)]
struct Counts {
    in_use: u64,
    peak: u64,
}

/// Bytes in use and their peak, within an optional capacity (USAGE-1).
#[derive(Default)]
pub struct Usage {
    counts: Mutex<Counts>,
    capacity: Option<u64>,
}

impl Usage {
    /// A count within `capacity` bytes (`None`: unbounded).
    pub fn new(capacity: Option<u64>) -> Arc<Self> {
        Arc::new(Usage { counts: Mutex::default(), capacity })
    }

    fn counts(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `bytes` for `label`, or refuses past the capacity, changing nothing.
    pub fn take(&self, bytes: u64, label: &str) -> Result<()> {
        let mut c = self.counts();
        if let Some(cap) = self.capacity {
            if c.in_use + bytes > cap {
                return Err(DeviceError::OutOfMemory {
                    label: label.to_owned(),
                    bytes,
                    in_use: c.in_use,
                    capacity: cap,
                });
            }
        }
        c.in_use += bytes;
        c.peak = c.peak.max(c.in_use);
        Ok(())
    }

    /// Gives back `bytes` taken earlier.
    pub fn give(&self, bytes: u64) {
        let mut c = self.counts();
        c.in_use = c.in_use.saturating_sub(bytes);
    }

    /// Bytes in use.
    pub fn in_use(&self) -> u64 {
        self.counts().in_use
    }

    /// Most bytes in use at once.
    pub fn peak(&self) -> u64 {
        self.counts().peak
    }

    /// Takes `bytes` for a kernel's tensors, given back when the reservation is dropped.
    pub fn reserve(self: &Arc<Self>, bytes: u64, label: &str) -> Result<Reservation> {
        self.take(bytes, label)?;
        Ok(Reservation { usage: Arc::clone(self), bytes })
    }
}

/// Device memory a running kernel took for what it makes (what a layer saves for backward,
/// its temporaries): counted in use until dropped, on whatever thread drops it (USAGE-1).
pub struct Reservation {
    usage: Arc<Usage>,
    bytes: u64,
}

impl Reservation {
    /// Its size.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reservation({} bytes)", self.bytes)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.usage.give(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_the_count_and_give_back_once_usage_1() {
        let u = Usage::new(Some(1000));
        u.take(600, "a").unwrap();
        let r = u.reserve(300, "kernel").unwrap();
        assert_eq!((u.in_use(), r.bytes()), (900, 300));
        let e = u.reserve(200, "more").expect_err("900 + 200 > 1000");
        assert!(e.to_string().contains("'more'") && e.to_string().contains("900 of 1000"), "{e}");
        assert_eq!(u.in_use(), 900, "a refused request changes nothing");
        // Dropped on another thread, given back once.
        std::thread::spawn(move || drop(r)).join().unwrap();
        assert_eq!(u.in_use(), 600);
        u.give(600);
        assert_eq!((u.in_use(), u.peak()), (0, 900), "the peak is the most in use at once");
    }
}
