//! The SVG chart: lateness distribution per rate (redisched vs due-at and vs the
//! producer's clock, and BullMQ) on top,
//! dispatch and ingest throughput over time (bridge beside its ceiling) below.

use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde_json::Value;

type Line = (String, Vec<(f64, f64)>);

fn points(value: &Value) -> Vec<(f64, f64)> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| Some((p.get(0)?.as_f64()?, p.get(1)?.as_f64()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// Draws what `report` holds (missing scenarios leave their panel empty).
pub(super) fn draw(report: &Value, path: &Path) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    }
    let mut lateness: Vec<Line> = Vec::new();
    for rate in report["precision"]["rates"]
        .as_array()
        .into_iter()
        .flatten()
    {
        lateness.push((
            format!("redisched {}/s, vs due-at", rate["rate_per_s"]),
            points(&rate["cdf"]),
        ));
        lateness.push((
            format!("redisched {}/s, vs producer clock", rate["rate_per_s"]),
            points(&rate["cdf_producer_clock"]),
        ));
    }
    for rate in report["peer"]["rates"].as_array().into_iter().flatten() {
        lateness.push((
            format!("BullMQ {}/s", rate["rate_per_s"]),
            points(&rate["cdf"]),
        ));
    }
    let dispatch = vec![
        (
            "bridge: published + confirmed + released".to_string(),
            points(&report["dispatch"]["bridge"]["series"]),
        ),
        (
            "ceiling: lapin confirmed publish".to_string(),
            points(&report["dispatch"]["ceiling"]["series"]),
        ),
    ];
    let ingest = vec![
        (
            "bridge: applied + acked".to_string(),
            points(&report["ingest"]["bridge"]["series"]),
        ),
        (
            "ceiling: consume + ack each".to_string(),
            points(&report["ingest"]["ceiling"]["series"]),
        ),
    ];

    let root = SVGBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(450);
    let (left, right) = bottom.split_horizontally(600);
    // The tail beyond p99.9 would squash the rest; the table has the max.
    let x_max = lateness
        .iter()
        .filter_map(|(_, pts)| {
            pts.iter()
                .rev()
                .find(|(_, f)| *f <= 0.999)
                .map(|(ms, _)| *ms)
        })
        .fold(1.0f64, f64::max)
        * 1.1;
    panel(
        &top,
        "Lateness distribution (arrival - due), up to p99.9",
        "lateness (ms)",
        "fraction of jobs",
        &lateness,
        x_max,
        Some(1.0),
    )?;
    let x_dispatch = max_x(&dispatch);
    panel(
        &left,
        "Dispatch throughput",
        "seconds",
        "jobs/s",
        &dispatch,
        x_dispatch,
        None,
    )?;
    let x_ingest = max_x(&ingest);
    panel(
        &right,
        "Ingest throughput",
        "seconds",
        "commands/s",
        &ingest,
        x_ingest,
        None,
    )?;
    root.present()
        .with_context(|| format!("write {}", path.display()))?;
    Ok(())
}

fn max_x(lines: &[Line]) -> f64 {
    lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(x, _)| *x))
        .fold(1.0, f64::max)
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    lines: &[Line],
    x_max: f64,
    y_max: Option<f64>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let y_max = y_max.unwrap_or_else(|| {
        lines
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
            .fold(1.0, f64::max)
            * 1.1
    });
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(|e| anyhow::anyhow!("chart: {e:?}"))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| anyhow::anyhow!("chart: {e:?}"))?;
    for (i, (label, pts)) in lines.iter().enumerate() {
        if pts.is_empty() {
            continue;
        }
        let color = Palette99::pick(i).to_rgba();
        let clipped: Vec<(f64, f64)> = pts.iter().copied().filter(|(x, _)| *x <= x_max).collect();
        chart
            .draw_series(LineSeries::new(clipped, color.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("chart: {e:?}"))?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    if lines.iter().any(|(_, p)| !p.is_empty()) {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow::anyhow!("chart: {e:?}"))?;
    }
    Ok(())
}
