//! The step timeline drawn as an image, a row per stream.

use super::*;

pub(crate) fn color_of(e: &Ev) -> RGBColor {
    match e.row {
        0 if e.name.starts_with("wait") => RGBColor(214, 39, 40),
        0 if e.name.starts_with("forward") => RGBColor(31, 119, 180),
        0 if e.name.starts_with("backward") => RGBColor(44, 160, 44),
        0 => RGBColor(148, 103, 189),
        1 => RGBColor(255, 127, 14),
        2 => RGBColor(23, 190, 207),
        _ => RGBColor(127, 127, 127),
    }
}

pub(crate) const ROWS: [&str; 4] = ["compute", "gather", "reduce", "stats"];

/// Draws one step per rank: a lane of rectangles per (rank, row), time in ms on x.
pub(crate) fn draw_timeline(
    path: &Path,
    title: &str,
    events: &[Ev],
    step: usize,
) -> anyhow::Result<()> {
    let (lo, hi) = step_window(events, step)?;
    let ranks = events.iter().map(|e| e.rank).max().map_or(0, |r| r + 1);
    let lanes = ranks * ROWS.len();
    let span_ms = ((hi - lo) / 1e3).max(1e-3);
    let height = 120 + 34 * lanes as u32;
    let root = SVGBackend::new(path, (1200, height)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing the timeline: {e}");
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(130)
        // The right fifth stays empty for the legend.
        .build_cartesian_2d(0.0..span_ms * 1.25, 0.0..lanes as f64)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_desc("ms since the step began")
        .draw()
        .map_err(|e| err(&e))?;
    // Lane i (top to bottom) occupies y in [lanes-1-i, lanes-i]; its label goes in the left
    // margin at the lane's middle.
    for i in 0..lanes {
        let (_, py) = chart.backend_coord(&(0.0, (lanes - i) as f64 - 0.5));
        let label = format!("rank {} {}", i / ROWS.len(), ROWS[i % ROWS.len()]);
        root.draw(&Text::new(label, (14, py - 7), ("sans-serif", 14).into_font()))
            .map_err(|e| err(&e))?;
    }
    let mut rects = Vec::new();
    for e in events.iter().filter(|e| e.end > lo && e.start < hi && e.row < ROWS.len()) {
        let lane = e.rank * ROWS.len() + e.row;
        let y1 = (lanes - lane) as f64 - 0.12;
        let y0 = (lanes - lane - 1) as f64 + 0.12;
        let x0 = (e.start.max(lo) - lo) / 1e3;
        let x1 = ((e.end.min(hi) - lo) / 1e3).max(x0 + span_ms * 1e-4);
        rects.push(Rectangle::new([(x0, y0), (x1, y1)], color_of(e).filled()));
        // A thin white edge keeps back-to-back ops on a lane apart.
        rects.push(Rectangle::new([(x0, y0), (x1, y1)], WHITE.stroke_width(1)));
    }
    chart.draw_series(rects).map_err(|e| err(&e))?;
    for k in 1..ranks {
        let y = (lanes - k * ROWS.len()) as f64;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, y), (span_ms, y)],
                BLACK.stroke_width(1),
            )))
            .map_err(|e| err(&e))?;
    }
    let legend = [
        ("forward", RGBColor(31, 119, 180)),
        ("backward", RGBColor(44, 160, 44)),
        ("optimizer", RGBColor(148, 103, 189)),
        ("blocked wait", RGBColor(214, 39, 40)),
        ("all-gather", RGBColor(255, 127, 14)),
        ("reduce-scatter / all-reduce", RGBColor(23, 190, 207)),
        ("SyncBN stats", RGBColor(127, 127, 127)),
    ];
    for (name, c) in legend {
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
