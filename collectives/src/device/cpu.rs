//! The host as a device: every call runs at once, in the caller's thread, so streams and
//! events order nothing that is not already ordered. It is the reference the simulated
//! device is compared with, and what `--device cpu` means.
//!
//! Invariants:
//! - CPUDEV-1: every operation has run when its call returns: an event has fired as soon as
//!   it is recorded, and a download's values are there at once.

use super::hazard::StreamId;
use super::usage::Usage;
use super::{
    Device, DeviceBuffer, DeviceError, Download, Event, FallibleKernel, Reservation, Result,
    VectorClock,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

static NEXT_CPU: AtomicU64 = AtomicU64::new(1 << 40);

/// The synchronous host device (CPUDEV-1).
pub struct CpuDevice {
    id: u64,
    state: Mutex<State>,
    /// Bytes in use, unbounded (USAGE-1).
    usage: Arc<Usage>,
}

#[derive(Default)]
struct State {
    values: HashMap<u64, Vec<f32>>,
    next_buffer: u64,
    streams: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Default for CpuDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuDevice {
    /// A host device with no allocation.
    pub fn new() -> Self {
        CpuDevice {
            id: NEXT_CPU.fetch_add(1, Ordering::Relaxed),
            state: Mutex::new(State { next_buffer: 1, ..State::default() }),
            usage: Usage::new(None),
        }
    }

    fn values<'a>(
        &self,
        st: &'a mut MutexGuard<'_, State>,
        b: &DeviceBuffer,
    ) -> Result<&'a mut Vec<f32>> {
        if b.device != self.id {
            return Err(DeviceError::Invalid(format!(
                "buffer '{}' belongs to another device",
                b.label()
            )));
        }
        st.values
            .get_mut(&b.id)
            .ok_or_else(|| DeviceError::Invalid(format!("buffer '{}' was freed", b.label())))
    }
}

impl Device for CpuDevice {
    fn id(&self) -> u64 {
        self.id
    }

    fn stream(&self, _name: &str) -> StreamId {
        let mut st = lock(&self.state);
        st.streams += 1;
        st.streams - 1
    }

    fn alloc(&self, len: usize, label: &str) -> Result<DeviceBuffer> {
        let mut st = lock(&self.state);
        let id = st.next_buffer;
        st.next_buffer += 1;
        self.usage.take(len as u64 * 4, label)?;
        st.values.insert(id, vec![0.0; len]);
        Ok(DeviceBuffer::new(id, self.id, len, label))
    }

    fn free(&self, _stream: StreamId, buf: DeviceBuffer) -> Result<()> {
        buf.whole("free")?;
        let mut st = lock(&self.state);
        self.values(&mut st, &buf)?;
        st.values.remove(&buf.id);
        self.usage.give(buf.len() as u64 * 4);
        Ok(())
    }

    fn upload(&self, _stream: StreamId, src: &[f32], dst: &DeviceBuffer) -> Result<()> {
        dst.whole("upload")?;
        let mut st = lock(&self.state);
        let v = self.values(&mut st, dst)?;
        if v.len() != src.len() {
            return Err(DeviceError::Invalid(format!(
                "upload of {} elements into '{}' of {}",
                src.len(),
                dst.label(),
                v.len()
            )));
        }
        v.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, stream: StreamId, src: &DeviceBuffer) -> Result<Download> {
        src.whole("download")?;
        let mut st = lock(&self.state);
        let v = self.values(&mut st, src)?.clone();
        drop(st);
        Ok(Download {
            event: self.record(stream),
            data: Arc::new(Mutex::new(Some(v))),
            finish: None,
        })
    }

    fn copy(&self, stream: StreamId, src: &DeviceBuffer, dst: &DeviceBuffer) -> Result<()> {
        src.whole("copy")?;
        let v = {
            let mut st = lock(&self.state);
            self.values(&mut st, src)?.clone()
        };
        self.upload(stream, &v, dst)
    }

    fn launch_fallible(
        &self,
        _stream: StreamId,
        name: &str,
        reads: &[&DeviceBuffer],
        writes: &[&DeviceBuffer],
        kernel: FallibleKernel,
    ) -> Result<()> {
        let mut st = lock(&self.state);
        for b in reads.iter().chain(writes) {
            self.values(&mut st, b)?;
        }
        if reads.iter().any(|r| writes.iter().any(|w| w.id == r.id)) {
            return Err(DeviceError::Invalid(format!("{name}: a buffer is both read and written")));
        }
        if writes.iter().enumerate().any(|(i, a)| writes[..i].iter().any(|b| a.id == b.id)) {
            return Err(DeviceError::Invalid(format!("{name}: a buffer is written twice")));
        }
        // Reads are copies, so that the written buffers can be borrowed mutably at once;
        // a view's kernel sees its range only (DEVOP-2).
        let r: Vec<Vec<f32>> = reads.iter().map(|b| st.values[&b.id][b.range()].to_vec()).collect();
        let mut taken: Vec<Vec<f32>> =
            writes.iter().map(|b| st.values.remove(&b.id).unwrap_or_default()).collect();
        let ran = {
            let rs: Vec<&[f32]> = r.iter().map(|v| v.as_slice()).collect();
            let mut ws: Vec<&mut [f32]> =
                taken.iter_mut().zip(writes).map(|(v, b)| &mut v[b.range()]).collect();
            kernel(&rs, &mut ws)
        };
        for (b, v) in writes.iter().zip(taken) {
            st.values.insert(b.id, v);
        }
        ran
    }

    fn reserve(&self, bytes: u64, label: &str) -> Result<Reservation> {
        self.usage.reserve(bytes, label)
    }

    fn record(&self, stream: StreamId) -> Event {
        Event { device: self.id, stream, seq: 0, clock: VectorClock::default(), native: None }
    }

    fn wait(&self, _stream: StreamId, _event: &Event) {}

    fn query(&self, _event: &Event) -> bool {
        true
    }

    fn synchronize(&self, _event: &Event) -> Result<()> {
        Ok(())
    }

    fn in_use(&self) -> u64 {
        self.usage.in_use()
    }

    fn peak(&self) -> u64 {
        self.usage.peak()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{SimDevice, SimOptions};

    /// The same program on the host device and on the simulated one (with its waits).
    fn program(d: &dyn Device) -> Vec<f32> {
        let (g, c) = (d.stream("gather"), d.stream("compute"));
        let a = d.alloc(32, "a").unwrap();
        let b = d.alloc(32, "b").unwrap();
        let src: Vec<f32> = (0..32).map(|i| i as f32 * 0.5).collect();
        d.upload(g, &src, &a).unwrap();
        d.wait(c, &d.record(g));
        d.launch(
            c,
            "axpy",
            &[&a],
            &[&b],
            Box::new(|r, w| w[0].iter_mut().zip(r[0]).for_each(|(o, x)| *o = 3.0 * x + 1.0)),
        )
        .unwrap();
        let out = d.download(c, &b).unwrap().wait(d).unwrap();
        d.free(c, a).unwrap();
        d.free(c, b).unwrap();
        out
    }

    #[test]
    fn the_host_runs_at_once_and_agrees_with_the_sim_cpudev_1() {
        let cpu = CpuDevice::new();
        let s = cpu.stream("s");
        let b = cpu.alloc(4, "b").unwrap();
        cpu.upload(s, &[1.0, 2.0, 3.0, 4.0], &b).unwrap();
        // CPUDEV-1: the event has fired at once, and the values are there.
        assert!(cpu.query(&cpu.record(s)));
        assert_eq!(cpu.download(s, &b).unwrap().wait(&cpu).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(cpu.in_use(), 16);
        cpu.free(s, b).unwrap();
        assert_eq!(cpu.in_use(), 0);
        let reference = program(&cpu);
        for seed in 0..5 {
            let sim = SimDevice::new(SimOptions { seed, ..SimOptions::default() });
            assert_eq!(program(&sim), reference, "seed {seed}: bitwise equal to the host");
        }
    }
}
