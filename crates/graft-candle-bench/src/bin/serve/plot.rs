//! The pictures: the inter-token latency distribution of each mode and the throughput over
//! the trace, as SVG (plotters).

use std::path::Path;

use plotters::prelude::*;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const COLORS: [RGBColor; 3] = [
    RGBColor(200, 80, 40),
    RGBColor(40, 100, 200),
    RGBColor(40, 160, 80),
];

/// The cumulative distribution of each mode's inter-token latencies (ms, log scale).
pub(crate) fn itl(path: &Path, modes: &[(&str, Vec<f64>)]) -> Result<()> {
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let ms: Vec<Vec<f64>> = modes
        .iter()
        .map(|(_, s)| {
            let mut v: Vec<f64> = s.iter().map(|x| (x * 1e3).max(1e-3)).collect();
            v.sort_by(f64::total_cmp);
            v
        })
        .collect();
    let lo = ms
        .iter()
        .filter_map(|v| v.first())
        .copied()
        .fold(f64::INFINITY, f64::min);
    let hi = ms
        .iter()
        .filter_map(|v| v.last())
        .copied()
        .fold(0.0, f64::max);
    let (lo, hi) = if lo < hi { (lo, hi) } else { (1e-3, 1.0) };
    let mut chart = ChartBuilder::on(&root)
        .caption("inter-token latency (cumulative)", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("milliseconds")
        .y_desc("fraction of tokens")
        .draw()?;
    for (((name, _), v), color) in modes.iter().zip(&ms).zip(COLORS) {
        let n = v.len().max(1) as f64;
        chart
            .draw_series(LineSeries::new(
                v.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)),
                color.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Tokens per second of each mode in one-second windows over the trace.
pub(crate) fn throughput(path: &Path, modes: &[(&str, Vec<f64>)]) -> Result<()> {
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let series: Vec<Vec<(f64, f64)>> = modes
        .iter()
        .map(|(_, times)| {
            let end = times.iter().copied().fold(0.0, f64::max).ceil() as usize + 1;
            let mut per_second = vec![0.0; end];
            for &t in times {
                per_second[t as usize] += 1.0;
            }
            per_second
                .into_iter()
                .enumerate()
                .map(|(s, n)| (s as f64 + 0.5, n))
                .collect()
        })
        .collect();
    let x_max = series.iter().flatten().map(|p| p.0).fold(1.0, f64::max) + 0.5;
    let y_max = series.iter().flatten().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("throughput over the trace", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("seconds since the first arrival")
        .y_desc("tokens per second")
        .draw()?;
    for (((name, _), points), color) in modes.iter().zip(series).zip(COLORS) {
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    root.present()?;
    Ok(())
}
