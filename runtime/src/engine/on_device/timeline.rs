//! What the streams did: the overlap of communication with compute, measured on the
//! device's timeline, and a Chrome trace of it (one process per rank, one row per stream,
//! and a `host` row with the host's waits).
//!
//! Invariant:
//! - TLINE-1: busy times are the measures of the unions of a stream group's spans, so
//!   overlapping spans count once; the hidden communication is the measure of the
//!   intersection of the communication and compute unions, never more than either.

use std::time::Instant;

use shardline_collectives::device::OpSpan;

/// Seconds of one group's busy time and of its overlap with another's.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Overlap {
    /// Time the compute stream was busy.
    pub compute_s: f64,
    /// Time the gather or reduce streams were busy.
    pub comm_s: f64,
    /// Communication time during which compute was busy too.
    pub hidden_s: f64,
}

impl Overlap {
    /// The fraction of communication time hidden behind compute (0 with none).
    pub fn hidden_fraction(&self) -> f64 {
        if self.comm_s > 0.0 {
            self.hidden_s / self.comm_s
        } else {
            0.0
        }
    }
}

/// The union of intervals, sorted and disjoint.
fn union(mut v: Vec<(Instant, Instant)>) -> Vec<(Instant, Instant)> {
    v.sort();
    let mut out: Vec<(Instant, Instant)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn measure(v: &[(Instant, Instant)]) -> f64 {
    v.iter().map(|(a, b)| (*b - *a).as_secs_f64()).sum()
}

/// The overlap of the gather and reduce streams with the compute stream in `spans` (one
/// rank's), TLINE-1.
pub fn overlap(spans: &[OpSpan]) -> Overlap {
    let of = |pred: &dyn Fn(&str) -> bool| {
        union(spans.iter().filter(|s| pred(&s.stream)).map(|s| (s.start, s.end)).collect())
    };
    let compute = of(&|s| s == "compute");
    let comm = of(&|s| s == "gather" || s == "reduce");
    // Two sorted disjoint lists: walk both.
    let (mut i, mut j, mut hidden) = (0, 0, 0.0);
    while i < compute.len() && j < comm.len() {
        let (a, b) = (compute[i].0.max(comm[j].0), compute[i].1.min(comm[j].1));
        if a < b {
            hidden += (b - a).as_secs_f64();
        }
        if compute[i].1 < comm[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    Overlap { compute_s: measure(&compute), comm_s: measure(&comm), hidden_s: hidden }
}

/// A Chrome trace (`chrome://tracing`, Perfetto) of every rank's timeline.
pub fn chrome_trace(ranks: &[Vec<OpSpan>]) -> serde_json::Value {
    let t0 = ranks.iter().flatten().map(|s| s.start).min();
    let mut events = Vec::new();
    for (rank, spans) in ranks.iter().enumerate() {
        for s in spans {
            let us = |t: Instant| t0.map_or(0.0, |t0| (t - t0).as_secs_f64() * 1e6);
            events.push(serde_json::json!({
                "name": s.op, "ph": "X", "pid": rank, "tid": s.stream,
                "ts": us(s.start), "dur": us(s.end) - us(s.start),
            }));
        }
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn span(stream: &str, t0: Instant, a: u64, b: u64) -> OpSpan {
        OpSpan {
            stream: stream.into(),
            op: "op".into(),
            start: t0 + Duration::from_millis(a),
            end: t0 + Duration::from_millis(b),
        }
    }

    /// TLINE-1: overlapping spans count once; the hidden time is the intersection.
    #[test]
    fn overlap_is_the_measure_of_the_intersection_tline_1() {
        let t0 = Instant::now();
        let spans = [
            span("compute", t0, 0, 10),
            span("compute", t0, 5, 12), // overlaps the first: busy 0..12
            span("compute", t0, 20, 30),
            span("gather", t0, 8, 15),  // 8..12 hidden
            span("reduce", t0, 14, 25), // 20..25 hidden; gather and reduce: 8..25
            span("host", t0, 0, 40),    // not a stream group
        ];
        let o = overlap(&spans);
        let ms = |v: f64| (v * 1e3).round() as u64;
        assert_eq!((ms(o.compute_s), ms(o.comm_s), ms(o.hidden_s)), (22, 17, 9));
        assert!(o.hidden_s <= o.comm_s.min(o.compute_s));
        assert!((o.hidden_fraction() - 9.0 / 17.0).abs() < 1e-9);
        assert_eq!(overlap(&[]).hidden_fraction(), 0.0);
        let trace = chrome_trace(&[spans.to_vec()]);
        assert_eq!(trace["traceEvents"].as_array().map(Vec::len), Some(6));
    }
}
