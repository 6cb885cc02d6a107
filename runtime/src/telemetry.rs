//! Telemetry: Chrome trace timelines (one row per rank and lane, opens in Perfetto) and the
//! Prometheus endpoint for the `metrics` facade.

use serde::Serialize;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The rows of a rank in the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Row {
    /// Forward/backward/optimizer compute.
    Compute = 0,
    /// Parameter all-gathers.
    Gather = 1,
    /// Gradient reductions.
    Reduce = 2,
    /// SyncBatchNorm statistics.
    Stats = 3,
    /// Checkpoints, faults and recoveries.
    Control = 4,
}

impl Row {
    fn name(self) -> &'static str {
        match self {
            Row::Compute => "compute",
            Row::Gather => "gather",
            Row::Reduce => "reduce",
            Row::Stats => "stats",
            Row::Control => "control",
        }
    }
}

/// One complete event.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// Label, e.g. `forward blocks.2`.
    pub name: String,
    /// Rank (trace process).
    pub rank: usize,
    /// Row (trace thread).
    pub row: Row,
    /// Start, microseconds since the trace began.
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
    /// This process's CPU time (every thread, user + system) when the event was recorded, in
    /// ms; only on marks from [`Trace::mark_cpu`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process_cpu_ms: Option<f64>,
    /// The whole buffer of a collective, in bytes; only on collective spans from
    /// [`Trace::record_op`] (tools derive the bytes a rank put on the wire from it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

/// A shared, append-only trace. Cheap to clone; recording is a mutex push.
#[derive(Clone)]
pub struct Trace {
    origin: Instant,
    events: Arc<Mutex<Vec<Event>>>,
    enabled: bool,
}

impl Trace {
    /// A trace that records.
    pub fn new() -> Self {
        Trace { origin: Instant::now(), events: Arc::default(), enabled: true }
    }

    /// A trace that drops everything (no cost beyond a branch).
    pub fn disabled() -> Self {
        Trace { origin: Instant::now(), events: Arc::default(), enabled: false }
    }

    /// Whether events are kept.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records an interval.
    pub fn record(
        &self,
        rank: usize,
        row: Row,
        name: impl Into<String>,
        start: Instant,
        end: Instant,
    ) {
        if self.enabled {
            self.push(rank, row, name.into(), (start, end), None, None);
        }
    }

    /// Records a collective's span with the size of its whole buffer (`bytes`).
    pub fn record_op(
        &self,
        rank: usize,
        row: Row,
        name: impl Into<String>,
        (start, end): (Instant, Instant),
        bytes: u64,
    ) {
        if self.enabled {
            self.push(rank, row, name.into(), (start, end), None, Some(bytes));
        }
    }

    /// Records an instant at `at` carrying this process's CPU time so far
    /// ([`process_cpu_ms`]): the difference between two marks is the CPU the whole process
    /// used in between, which tools set against the wall time and the machine's cores.
    pub fn mark_cpu(&self, rank: usize, row: Row, name: impl Into<String>, at: Instant) {
        if self.enabled {
            self.push(rank, row, name.into(), (at, at), process_cpu_ms(), None);
        }
    }

    fn push(
        &self,
        rank: usize,
        row: Row,
        name: String,
        (start, end): (Instant, Instant),
        process_cpu_ms: Option<f64>,
        bytes: Option<u64>,
    ) {
        let start_us = start.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        let dur_us = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        if let Ok(mut ev) = self.events.lock() {
            ev.push(Event { name, rank, row, start_us, dur_us, process_cpu_ms, bytes });
        }
    }

    /// A copy of the events so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// Writes the Chrome trace-event JSON (`{"traceEvents": [...]}`).
    pub fn write_chrome(&self, path: &Path) -> std::io::Result<()> {
        let doc = chrome_json(&self.events());
        std::fs::write(path, serde_json::to_vec(&doc).map_err(std::io::Error::other)?)
    }
}

/// The Chrome trace-event document of `events` (`{"traceEvents": [...]}`): a process per
/// rank, a thread per row, a complete event per span. `plan --trace` writes its simulated
/// step in the same form.
pub fn chrome_json(events: &[Event]) -> serde_json::Value {
    let mut out = Vec::with_capacity(events.len() + 16);
    let mut ranks: Vec<usize> = events.iter().map(|e| e.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for &r in &ranks {
        out.push(serde_json::json!({"ph": "M", "name": "process_name", "pid": r, "args": {"name": format!("rank {r}")}}));
        for row in [Row::Compute, Row::Gather, Row::Reduce, Row::Stats, Row::Control] {
            out.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": r, "tid": row as u32, "args": {"name": row.name()}}));
        }
    }
    for e in events {
        let mut v = serde_json::json!({
            "ph": "X", "name": e.name, "cat": e.row.name(), "pid": e.rank, "tid": e.row as u32,
            "ts": e.start_us, "dur": e.dur_us,
        });
        if let Some(cpu) = e.process_cpu_ms {
            v["args"] = serde_json::json!({ "process_cpu_ms": cpu });
        }
        if let Some(bytes) = e.bytes {
            v["args"] = serde_json::json!({ "bytes": bytes });
        }
        out.push(v);
    }
    serde_json::json!({"traceEvents": out, "displayTimeUnit": "ms"})
}

/// This process's CPU time so far (every thread, user + system), ms.
pub fn process_cpu_ms() -> Option<f64> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_PROCESS_CPUTIME_ID).ok()?;
    Some(t.tv_sec() as f64 * 1e3 + t.tv_nsec() as f64 / 1e6)
}

impl Default for Trace {
    fn default() -> Self {
        Trace::new()
    }
}

/// Serves the `metrics` facade's values for Prometheus at `http://ADDR/metrics`.
/// Call before starting any async runtime (the exporter runs its own thread).
pub fn serve_prometheus(addr: std::net::SocketAddr) -> Result<(), String> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chrome_trace_has_rows_and_events() {
        let t = Trace::new();
        let a = Instant::now();
        t.record(1, Row::Gather, "gather blocks.0", a, a + std::time::Duration::from_micros(50));
        t.record_op(0, Row::Reduce, "reduce-scatter head", (a, a), 4096);
        let dir = std::env::temp_dir().join(format!("trace-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.json");
        t.write_chrome(&p).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        let evs = v["traceEvents"].as_array().unwrap();
        assert!(evs.iter().any(|e| e["ph"] == "X"
            && e["tid"] == 1
            && e["pid"] == 1
            && e["dur"].as_f64().unwrap() > 49.0));
        assert!(evs.iter().any(|e| e["ph"] == "M" && e["args"]["name"] == "gather"));
        // A collective's size travels in its args; other spans carry none.
        let rs = evs.iter().find(|e| e["name"] == "reduce-scatter head").unwrap();
        assert_eq!(rs["args"]["bytes"], 4096);
        let g = evs.iter().find(|e| e["name"] == "gather blocks.0").unwrap();
        assert!(g["args"]["bytes"].is_null());
        std::fs::remove_dir_all(&dir).ok();
    }
}
