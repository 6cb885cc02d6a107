//! An SVG picture of a Chrome trace (`train --trace`, `plan --trace`): one lane per rank and
//! row, each complete event a box at its place in time, so that a measured step and a
//! simulated one can be set side by side.
//!
//! Lanes are the trace's (pid, tid) pairs in order, named by its `process_name` and
//! `thread_name` metadata where it has them. Boxes are coloured by row (compute, gather,
//! reduce, stats, control); a `wait ...` span, communication the rank waited for, is red.
//!
//! Invariant:
//! - SVG-1: every complete event inside the window is one box, at its start and of its
//!   length on the window's scale, in its lane; events outside are left out.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::Value;

const WIDTH: f64 = 1200.0;
const LABEL: f64 = 140.0;
const LANE: f64 = 22.0;
const TOP: f64 = 30.0;

fn colour(tid: u64, name: &str) -> &'static str {
    if name.starts_with("wait ") {
        return "#d62728";
    }
    match tid {
        0 => "#1f77b4",
        1 => "#2ca02c",
        2 => "#ff7f0e",
        3 => "#9467bd",
        _ => "#7f7f7f",
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A complete event: lane, name, start and length in microseconds.
struct Span {
    lane: (u64, u64),
    name: String,
    ts: f64,
    dur: f64,
}

/// The SVG of `trace`'s complete events between `window` (microseconds; the whole trace
/// without one), titled `title` (SVG-1); an error names what the document lacks.
pub fn render(trace: &Value, window: Option<(f64, f64)>, title: &str) -> Result<String, String> {
    let events =
        trace["traceEvents"].as_array().ok_or("not a Chrome trace: no traceEvents array")?;
    let mut names: BTreeMap<(u64, Option<u64>), String> = BTreeMap::new();
    let mut spans = Vec::new();
    for e in events {
        let pid = e["pid"].as_u64().unwrap_or(0);
        let tid = e["tid"].as_u64();
        match e["ph"].as_str() {
            Some("M") => {
                let n = e["args"]["name"].as_str().unwrap_or_default().to_string();
                let key = if e["name"] == "process_name" { (pid, None) } else { (pid, tid) };
                names.insert(key, n);
            }
            Some("X") => spans.push(Span {
                lane: (pid, tid.unwrap_or(0)),
                name: e["name"].as_str().unwrap_or_default().to_string(),
                ts: e["ts"].as_f64().ok_or("an X event without ts")?,
                dur: e["dur"].as_f64().unwrap_or(0.0),
            }),
            _ => {}
        }
    }
    let (t0, t1) = window.unwrap_or_else(|| {
        let a = spans.iter().map(|s| s.ts).fold(f64::INFINITY, f64::min);
        let b = spans.iter().map(|s| s.ts + s.dur).fold(f64::NEG_INFINITY, f64::max);
        if a.is_finite() {
            (a, b)
        } else {
            (0.0, 1.0)
        }
    });
    spans.retain(|s| s.ts >= t0 && s.ts + s.dur <= t1);
    let mut lanes: Vec<(u64, u64)> = spans.iter().map(|s| s.lane).collect();
    lanes.sort_unstable();
    lanes.dedup();
    let scale = (WIDTH - LABEL) / (t1 - t0).max(1e-9);
    let height = TOP + LANE * lanes.len() as f64 + 20.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ =
        writeln!(svg, r#"<text x="4" y="16">{} ({:.3} ms)</text>"#, escape(title), (t1 - t0) / 1e3);
    for (i, &(pid, tid)) in lanes.iter().enumerate() {
        let y = TOP + LANE * i as f64;
        let process = names.get(&(pid, None)).cloned().unwrap_or(format!("rank {pid}"));
        let row = names.get(&(pid, Some(tid))).cloned().unwrap_or(format!("row {tid}"));
        let label = escape(&format!("{process} {row}"));
        let _ = writeln!(svg, r#"<text x="4" y="{:.1}">{label}</text>"#, y + 15.0);
    }
    for s in &spans {
        let i = lanes.binary_search(&s.lane).unwrap_or(0);
        let (x, w) = (LABEL + (s.ts - t0) * scale, (s.dur * scale).max(0.5));
        let y = TOP + LANE * i as f64 + 2.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{x:.2}" y="{y:.1}" width="{w:.2}" height="{:.1}" fill="{}"><title>{} {:.1} us</title></rect>"#,
            LANE - 4.0,
            colour(s.lane.1, &s.name),
            escape(&s.name),
            s.dur
        );
    }
    svg.push_str("</svg>\n");
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> Value {
        serde_json::json!({"traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "gather"}},
            {"ph": "X", "name": "forward h.0", "pid": 0, "tid": 0, "ts": 0.0, "dur": 100.0},
            {"ph": "X", "name": "all-gather h.1", "pid": 0, "tid": 1, "ts": 50.0, "dur": 100.0},
            {"ph": "X", "name": "wait all-gather h.1", "pid": 0, "tid": 0, "ts": 100.0, "dur": 50.0},
            {"ph": "X", "name": "forward h.1", "pid": 0, "tid": 0, "ts": 300.0, "dur": 100.0},
        ]})
    }

    /// SVG-1: each event in the window is one box at its place in its lane; the window
    /// leaves the rest out; a document without events is refused.
    #[test]
    fn every_event_in_the_window_is_one_box_svg_1() {
        let svg = render(&doc(), None, "step").unwrap();
        assert_eq!(svg.matches("<rect").count(), 4);
        assert!(svg.contains("rank 0 gather") && svg.contains("rank 0 row 0"), "{svg}");
        // 400 us over 1060 px: the gather starts at 50 us, 132.5 px after the labels.
        assert!(svg.contains(r#"<rect x="272.50" y="54.0" width="265.00""#), "{svg}");
        assert!(svg.contains("#d62728"), "a wait is red");
        let part = render(&doc(), Some((0.0, 200.0)), "first").unwrap();
        assert_eq!(part.matches("<rect").count(), 3);
        assert!(!part.contains("forward h.1"));
        assert!(render(&serde_json::json!({}), None, "x").is_err());
    }
}
