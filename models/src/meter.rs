//! Metering of the memory that layers allocate, charged to whoever runs them.
//!
//! A rank's accountant (the runtime's memory tracker) installs a [`Meter`] on the thread that
//! computes ([`install`]). From then on every tensor's storage made on that thread is charged
//! when it is allocated and given back when it is freed, on whatever thread that happens, as a
//! GPU's caching allocator counts every block; so are the scratch buffers that kernels keep
//! (`Scratch`): the GEMM's transposed copies and the `gemm` crate's per-thread packing slab,
//! and im2col columns. Layers need no bookkeeping of their own, and what they save for
//! backward is counted exactly as long as it is held.
//!
//! Tensor constructors cannot fail, so a meter that refuses a charge (a memory cap) keeps the
//! refusal for its owner to report at the next check: the tensor is made, uncharged.
//!
//! Invariants:
//! - METER-1: with a meter installed, the bytes charged and not given back equal the bytes
//!   of the live tensor storages made on that thread (a copy made by a write to shared
//!   values, TENSOR-3, is a new storage), plus the kept scratch; with none installed nothing
//!   is charged.
//! - METER-2: [`install`] returns a guard that restores the meter installed before it.
//! - METER-3: a kept scratch buffer is charged once per meter at its current capacity: it
//!   is charged again, at the new size, when it grows or when another meter is installed.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{Arc, Weak};

/// What a charge is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// A tensor's values: activations, what layers save, gradients flowing back.
    Tensor,
    /// A kernel's scratch (GEMM packing and transposed copies, im2col columns).
    Scratch,
}

/// A charge: dropping it gives the bytes back.
pub type Charge = Box<dyn Any + Send + Sync>;

/// An accountant that layers' allocations are charged to.
pub trait Meter: Send + Sync {
    /// Charges `bytes` for `what`; `None` when refused (the meter keeps the refusal).
    fn charge(&self, bytes: u64, what: Use) -> Option<Charge>;
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<dyn Meter>>> = const { RefCell::new(None) };
}

/// Restores the previously installed meter when dropped (METER-2).
#[must_use = "the meter is uninstalled when the guard is dropped"]
pub struct Installed {
    previous: Option<Arc<dyn Meter>>,
}

impl Drop for Installed {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// Charges this thread's allocations to `meter` until the guard is dropped.
pub fn install(meter: Arc<dyn Meter>) -> Installed {
    let previous = CURRENT.with(|c| c.borrow_mut().replace(meter));
    Installed { previous }
}

fn current() -> Option<Arc<dyn Meter>> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Whether this thread has a meter installed.
pub fn installed() -> bool {
    CURRENT.with(|c| c.borrow().is_some())
}

/// A kept buffer's charge: its size, the meter it was charged to (a weak reference keeps the
/// meter's address from being reused by another), the charge.
pub(crate) type Kept = (usize, Weak<dyn Meter>, Charge);

/// Charges `bytes` to this thread's meter, if one is installed.
pub fn charge(bytes: usize, what: Use) -> Option<Charge> {
    let m = CURRENT.with(|c| c.borrow().clone())?;
    m.charge(bytes as u64, what)
}

/// Values with their charge: the storage of a tensor (METER-1), and what kernels save for
/// backward outside tensors (attention's q, k, v, output and log-sum-exps).
#[derive(Debug)]
pub(crate) struct Metered<T> {
    pub(crate) values: Vec<T>,
    /// Held for its drop, which gives the bytes back.
    _charge: Option<ChargeCell>,
}

/// A charge, opaque to `Debug`.
struct ChargeCell {
    _held: Charge,
}

impl std::fmt::Debug for ChargeCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Charge")
    }
}

impl<T> Metered<T> {
    pub(crate) fn new(values: Vec<T>) -> Self {
        let bytes = values.len() * std::mem::size_of::<T>();
        let charge = if bytes > 0 {
            charge(bytes, Use::Tensor).map(|c| ChargeCell { _held: c })
        } else {
            None
        };
        Metered { values, _charge: charge }
    }

    pub(crate) fn into_values(self) -> Vec<T> {
        self.values
    }
}

impl<T> std::ops::Deref for Metered<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.values
    }
}

impl<T> std::ops::DerefMut for Metered<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.values
    }
}

/// A copy is a new storage, charged anew (a write to shared values, TENSOR-3).
impl<T: Clone> Clone for Metered<T> {
    fn clone(&self) -> Self {
        Metered::new(self.values.clone())
    }
}

impl<T: PartialEq> PartialEq for Metered<T> {
    fn eq(&self, other: &Self) -> bool {
        self.values == other.values
    }
}

/// A scratch buffer a kernel keeps between calls (one per thread), charged at its capacity to
/// the meter installed when it was last used (METER-3).
pub(crate) struct Scratch<T> {
    values: Vec<T>,
    charged: Option<Kept>,
}

impl<T: Clone + Default> Scratch<T> {
    pub(crate) const fn new() -> Self {
        Scratch { values: Vec::new(), charged: None }
    }

    /// The first `len` values (grown, zero-filled, when shorter), charged to this thread's
    /// meter.
    pub(crate) fn get(&mut self, len: usize) -> &mut [T] {
        if self.values.len() < len {
            self.values.resize(len, T::default());
        }
        let bytes = self.values.capacity() * std::mem::size_of::<T>();
        keep_charged(&mut self.charged, bytes, Use::Scratch);
        &mut self.values[..len]
    }
}

/// Keeps `charged` a charge of `bytes` to this thread's current meter (METER-3); a kept
/// buffer outside any meter keeps its last charge.
pub(crate) fn keep_charged(charged: &mut Option<Kept>, bytes: usize, what: Use) {
    let Some(m) = current() else { return };
    if matches!(charged, Some((b, w, _)) if *b == bytes && Weak::ptr_eq(w, &Arc::downgrade(&m))) {
        return;
    }
    // Give the old charge back before taking the new one, so a grown buffer is not counted
    // twice.
    *charged = None;
    if let Some(c) = m.charge(bytes as u64, what) {
        *charged = Some((bytes, Arc::downgrade(&m), c));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tensor;
    use std::sync::atomic::{AtomicI64, Ordering};

    /// Counts charged bytes; refuses past `cap`.
    struct Count {
        live: Arc<AtomicI64>,
        cap: i64,
    }
    struct Given(Arc<AtomicI64>, i64);
    impl Drop for Given {
        fn drop(&mut self) {
            self.0.fetch_sub(self.1, Ordering::SeqCst);
        }
    }
    impl Meter for Count {
        fn charge(&self, bytes: u64, _: Use) -> Option<Charge> {
            let b = bytes as i64;
            if self.live.load(Ordering::SeqCst) + b > self.cap {
                return None;
            }
            self.live.fetch_add(b, Ordering::SeqCst);
            Some(Box::new(Given(Arc::clone(&self.live), b)))
        }
    }

    fn count(cap: i64) -> (Arc<AtomicI64>, Arc<dyn Meter>) {
        let live = Arc::new(AtomicI64::new(0));
        (Arc::clone(&live), Arc::new(Count { live, cap }))
    }

    #[test]
    fn tensors_are_charged_while_alive_meter_1() {
        // METER-1
        let (live, m) = count(i64::MAX);
        let before = Tensor::zeros(&[100]);
        let g = install(m);
        assert_eq!(live.load(Ordering::SeqCst), 0, "a tensor made before is not charged");
        let a = Tensor::zeros(&[10, 10]);
        assert_eq!(live.load(Ordering::SeqCst), 400);
        let mut b = a.clone();
        assert_eq!(live.load(Ordering::SeqCst), 400, "a clone shares the storage");
        b.as_f32_mut().unwrap()[0] = 1.0;
        assert_eq!(live.load(Ordering::SeqCst), 800, "a write to shared values copies");
        let ids = Tensor::from_u32(vec![3], vec![1, 2, 3]).unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 812);
        // Freed on another thread: still given back.
        std::thread::spawn(move || drop((a, ids))).join().unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 400);
        let v = b.into_f32().unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 0, "values taken out leave the meter");
        drop(g);
        let _after = Tensor::new(vec![100], v).unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 0, "no meter, no charge");
        drop(before);
    }

    #[test]
    fn install_restores_the_previous_meter_meter_2() {
        // METER-2
        let (outer_live, outer) = count(i64::MAX);
        let (inner_live, inner) = count(i64::MAX);
        let g1 = install(outer);
        {
            let _g2 = install(inner);
            let _t = Tensor::zeros(&[4]);
            assert_eq!(inner_live.load(Ordering::SeqCst), 16);
        }
        let t = Tensor::zeros(&[2]);
        assert_eq!(outer_live.load(Ordering::SeqCst), 8);
        drop(g1);
        drop(t);
        // A refused charge leaves the tensor uncharged.
        let (live, small) = count(10);
        let _g = install(small);
        let _big = Tensor::zeros(&[100]);
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn scratch_is_charged_at_its_capacity_per_meter_meter_3() {
        // METER-3
        let (live1, m1) = count(i64::MAX);
        let mut s: Scratch<f32> = Scratch::new();
        {
            let _g = install(m1);
            s.get(10);
            let c = live1.load(Ordering::SeqCst);
            assert!(c >= 40, "{c}");
            s.get(5);
            assert_eq!(live1.load(Ordering::SeqCst), c, "no growth, no new charge");
            s.get(1000);
            assert!(live1.load(Ordering::SeqCst) >= 4000, "charged at the new size");
            assert!(live1.load(Ordering::SeqCst) < 4000 + c + 1, "the old charge was given back");
        }
        let (live2, m2) = count(i64::MAX);
        let _g = install(m2);
        s.get(1);
        assert!(live2.load(Ordering::SeqCst) >= 4000, "charged again to a new meter");
        drop(s);
        assert_eq!(live2.load(Ordering::SeqCst), 0);
        assert_eq!(live1.load(Ordering::SeqCst), 0, "the first meter's charge was given back");
    }
}
