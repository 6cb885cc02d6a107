//! A device that fails on purpose: any device wrapped so that its `n`-th fallible call
//! fails, as a GPU fails (an illegal address, an ECC error, a lost device). The failure
//! comes either at the call itself ([`FailWhen::AtCall`]) or from the enqueued work when the
//! stream reaches it ([`FailWhen::WhenRun`], the asynchronous kind a CUDA error usually is,
//! reported by a later synchronisation). Fault-injection tests run the engine on it to show
//! that every device error comes back as an error, never a panic or a hang.
//!
//! Invariants:
//! - FAILDEV-1: calls before the `n`-th pass through unchanged; from the `n`-th on, every
//!   fallible call answers [`DeviceError::Failed`] naming the injected failure (a device
//!   that failed stays failed).
//! - FAILDEV-2: with [`FailWhen::WhenRun`], the `n`-th call, if it enqueues work, is
//!   enqueued as work that fails when run, so the error reaches the host through the
//!   device's own failure path (a later wait or download).

use super::hazard::StreamId;
use super::{
    Device, DeviceBuffer, DeviceError, DeviceOp, Download, Event, FallibleKernel, HostOnce, OpSpan,
    Reservation, Result,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// When the injected failure shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailWhen {
    /// The `n`-th call returns the error.
    AtCall,
    /// The `n`-th call's work fails when its stream runs it (a call that enqueues nothing
    /// fails at once).
    WhenRun,
}

/// A device whose `n`-th fallible call (1-based) fails (FAILDEV-1).
pub struct FailingDevice {
    inner: Arc<dyn Device>,
    at: u64,
    when: FailWhen,
    calls: AtomicU64,
    failed: Mutex<Option<String>>,
}

impl FailingDevice {
    /// `inner`, failing at its `at`-th fallible call (0: never; then it only counts them).
    pub fn new(inner: Arc<dyn Device>, at: u64, when: FailWhen) -> Self {
        FailingDevice { inner, at, when, calls: AtomicU64::new(0), failed: Mutex::new(None) }
    }

    /// Fallible calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Counts a call that enqueues nothing: `Err` when it fails (in either mode).
    fn count_now(&self, what: &str) -> Result<()> {
        match self.count(what)? {
            true => Err(DeviceError::Failed(format!(
                "injected device failure at call {} ({what})",
                self.at
            ))),
            false => Ok(()),
        }
    }

    /// Counts a call: `Ok(true)` when this is the one to fail asynchronously, `Err` when
    /// it fails now.
    fn count(&self, what: &str) -> Result<bool> {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = &*failed {
            return Err(DeviceError::Failed(m.clone()));
        }
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        if n != self.at {
            return Ok(false);
        }
        let m = format!("injected device failure at call {n} ({what})");
        *failed = Some(m.clone());
        match self.when {
            FailWhen::AtCall => Err(DeviceError::Failed(m)),
            FailWhen::WhenRun => Ok(true),
        }
    }

    fn failing_kernel(&self, n: &str) -> FallibleKernel {
        let m = format!("injected device failure at call {} ({n}), when run", self.at);
        Box::new(move |_, _| Err(DeviceError::Failed(m)))
    }
}

impl Device for FailingDevice {
    fn id(&self) -> u64 {
        self.inner.id()
    }
    fn stream(&self, name: &str) -> StreamId {
        self.inner.stream(name)
    }
    fn alloc(&self, len: usize, label: &str) -> Result<DeviceBuffer> {
        self.count_now(&format!("alloc '{label}'"))?;
        self.inner.alloc(len, label)
    }
    fn free(&self, stream: StreamId, buf: DeviceBuffer) -> Result<()> {
        if self.count(&format!("free '{}'", buf.label()))? {
            let k = self.failing_kernel("free");
            self.inner.launch_op(
                stream,
                HostOnce::arc("injected failure".into(), k),
                &[],
                &[&buf],
            )?;
        }
        self.inner.free(stream, buf)
    }
    fn upload(&self, stream: StreamId, src: &[f32], dst: &DeviceBuffer) -> Result<()> {
        if self.count(&format!("upload '{}'", dst.label()))? {
            let k = self.failing_kernel("upload");
            return self.inner.launch_op(
                stream,
                HostOnce::arc("injected failure".into(), k),
                &[],
                &[dst],
            );
        }
        self.inner.upload(stream, src, dst)
    }
    fn download(&self, stream: StreamId, src: &DeviceBuffer) -> Result<Download> {
        if self.count(&format!("download '{}'", src.label()))? {
            let k = self.failing_kernel("download");
            self.inner.launch_op(
                stream,
                HostOnce::arc("injected failure".into(), k),
                &[src],
                &[],
            )?;
        }
        self.inner.download(stream, src)
    }
    fn copy(&self, stream: StreamId, src: &DeviceBuffer, dst: &DeviceBuffer) -> Result<()> {
        if self.count(&format!("copy '{}'", src.label()))? {
            let k = self.failing_kernel("copy");
            return self.inner.launch_op(
                stream,
                HostOnce::arc("injected failure".into(), k),
                &[src],
                &[dst],
            );
        }
        self.inner.copy(stream, src, dst)
    }
    fn launch_fallible(
        &self,
        stream: StreamId,
        name: &str,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
        kernel: FallibleKernel,
    ) -> Result<()> {
        let kernel = if self.count(&format!("kernel '{name}'"))? {
            self.failing_kernel(name)
        } else {
            kernel
        };
        self.inner.launch_fallible(stream, name, reads, writes, kernel)
    }
    fn launch_op(
        &self,
        stream: StreamId,
        op: Arc<dyn DeviceOp>,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
    ) -> Result<()> {
        if self.count(&format!("op '{}'", op.name()))? {
            let k = self.failing_kernel(&op.name());
            return self.inner.launch_op(
                stream,
                HostOnce::arc("injected failure".into(), k),
                reads,
                writes,
            );
        }
        self.inner.launch_op(stream, op, reads, writes)
    }
    fn reserve(&self, bytes: u64, label: &str) -> Result<Reservation> {
        self.count_now(&format!("reserve '{label}'"))?;
        self.inner.reserve(bytes, label)
    }
    fn record(&self, stream: StreamId) -> Event {
        self.inner.record(stream)
    }
    fn wait(&self, stream: StreamId, event: &Event) {
        self.inner.wait(stream, event)
    }
    fn query(&self, event: &Event) -> bool {
        self.inner.query(event)
    }
    fn synchronize(&self, event: &Event) -> Result<()> {
        self.count_now("synchronize")?;
        self.inner.synchronize(event)
    }
    fn in_use(&self) -> u64 {
        self.inner.in_use()
    }
    fn peak(&self) -> u64 {
        self.inner.peak()
    }
    fn take_timeline(&self) -> Vec<OpSpan> {
        self.inner.take_timeline()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CpuDevice, SimDevice, SimOptions};

    #[test]
    fn the_nth_call_fails_and_the_device_stays_failed_faildev_1() {
        let d = FailingDevice::new(Arc::new(CpuDevice::new()), 3, FailWhen::AtCall);
        let s = d.stream("s");
        let a = d.alloc(4, "a").unwrap();
        d.upload(s, &[1.0; 4], &a).unwrap();
        let e = d.alloc(4, "b").unwrap_err();
        assert!(e.to_string().contains("injected device failure at call 3 (alloc 'b')"), "{e}");
        let later = d.download(s, &a).err().expect("FAILDEV-1: failed stays failed");
        assert!(later.to_string().contains("call 3"), "{later}");
    }

    #[test]
    fn a_failure_when_run_reaches_the_host_at_the_next_wait_faildev_2() {
        let sim: Arc<dyn Device> = Arc::new(SimDevice::new(SimOptions::default()));
        let d = FailingDevice::new(sim, 3, FailWhen::WhenRun);
        let s = d.stream("s");
        let a = d.alloc(4, "a").unwrap();
        d.upload(s, &[1.0; 4], &a).unwrap();
        // The third call is enqueued, and fails on the stream.
        d.launch(s, "scale", &[], &[&a], Box::new(|_, w| w[0].iter_mut().for_each(|x| *x *= 2.0)))
            .unwrap();
        let e = d.inner.download(s, &a).and_then(|dl| dl.wait(&*d.inner)).unwrap_err();
        assert!(e.to_string().contains("call 3 (scale), when run"), "{e}");
    }
}
