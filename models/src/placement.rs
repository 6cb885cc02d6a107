//! Where tensors live, and where the current thread computes.
//!
//! A thread computes on the host unless a device's kernel is running on it: the runtime's
//! device engine [`enter`]s the device's placement for the span of each kernel, as CUDA
//! code runs under a current device. Tensors are placed where they are made
//! ([`crate::Tensor`]), and their values are reached only where they are placed
//! (TENSOR-4): host code cannot read what a kernel saved for backward, and a kernel cannot
//! read host memory it was not handed through a copy.
//!
//! Invariants:
//! - PLACE-1: [`current`] is [`Placement::Host`] on a thread that has not entered a device.
//! - PLACE-2: [`enter`] returns a guard that restores the placement entered before it, so
//!   a kernel run inline by the host device leaves the host's placement as it was.

use std::cell::Cell;

/// Where a tensor's values live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Placement {
    /// Host memory, computed on by the CPU backend.
    #[default]
    Host,
    /// A device's memory (its number, `Device::id` in the collectives crate), made and read
    /// by that device's kernels; its bytes count as the device's memory.
    Device(u64),
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Host => f.write_str("the host"),
            Placement::Device(d) => write!(f, "device {d}"),
        }
    }
}

thread_local! {
    static CURRENT: Cell<Placement> = const { Cell::new(Placement::Host) };
}

/// Where this thread computes now (PLACE-1).
pub fn current() -> Placement {
    CURRENT.with(Cell::get)
}

/// Restores the placement entered before it when dropped (PLACE-2).
#[must_use = "the placement is left when the guard is dropped"]
pub struct Entered {
    previous: Placement,
}

impl Drop for Entered {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.previous));
    }
}

/// Computes at `p` on this thread until the guard is dropped.
pub fn enter(p: Placement) -> Entered {
    Entered { previous: CURRENT.with(|c| c.replace(p)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_compute_on_the_host_until_they_enter_a_device_place_1_place_2() {
        assert_eq!(current(), Placement::Host, "PLACE-1");
        {
            let _a = enter(Placement::Device(3));
            assert_eq!(current(), Placement::Device(3));
            {
                let _b = enter(Placement::Device(4));
                assert_eq!(current(), Placement::Device(4));
            }
            assert_eq!(current(), Placement::Device(3), "PLACE-2: the outer one is back");
            let other = std::thread::spawn(current).join().unwrap();
            assert_eq!(other, Placement::Host, "PLACE-1: per thread");
        }
        assert_eq!(current(), Placement::Host);
    }
}
