//! GB/s against N, one chart per dtype side by side, a line per (mode, provider) and the
//! copy ceiling dashed. Text is drawn with DejaVu Sans compiled into the binary, so PNGs
//! need no system font libraries.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::config::Dtype;
use crate::error::BenchError;
use crate::report::Run;
use crate::sweep::{Measurement, Plan};

/// The image format, from the file's extension.
#[derive(Clone, Copy)]
pub enum Format {
    Png,
    Svg,
}

impl Format {
    pub fn of(path: &Path) -> Option<Format> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "png" => Some(Format::Png),
            "svg" => Some(Format::Svg),
            _ => None,
        }
    }
}

const CHART_SIZE: (u32, u32) = (640, 480);

pub fn draw(path: &Path, run: &Run, plan: &Plan, results: &[Measurement]) -> Result<(), BenchError> {
    let failed = |reason: String| BenchError::Plot {
        path: path.to_path_buf(),
        reason,
    };
    register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| failed("the bundled font does not load".into()))?;
    let size = (CHART_SIZE.0 * plan.dtypes.len().max(1) as u32, CHART_SIZE.1);
    match Format::of(path) {
        Some(Format::Png) => {
            let root = BitMapBackend::new(path, size).into_drawing_area();
            draw_on(&root, run, plan, results)
                .and_then(|()| root.present().map_err(|e| e.to_string()))
                .map_err(failed)
        }
        Some(Format::Svg) => {
            let root = SVGBackend::new(path, size).into_drawing_area();
            draw_on(&root, run, plan, results)
                .and_then(|()| root.present().map_err(|e| e.to_string()))
                .map_err(failed)
        }
        None => Err(failed("the file name must end in .png or .svg".into())),
    }
}

fn draw_on<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    run: &Run,
    plan: &Plan,
    results: &[Measurement],
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((1, plan.dtypes.len().max(1)));
    for (panel, &dtype) in panels.iter().zip(&plan.dtypes) {
        chart(panel, run, plan, results, dtype).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn chart<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    run: &Run,
    plan: &Plan,
    results: &[Measurement],
    dtype: Dtype,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (n_min, n_max) = plan.ns.iter().fold((f64::MAX, 0.0f64), |(lo, hi), &n| {
        (lo.min(n as f64), hi.max(n as f64))
    });
    // A log axis needs a range of positive width, even for a single N.
    let (n_min, n_max) = (n_min / 1.2, n_max * 1.2);
    // Ticks at powers of two: the sizes people think in, and never crowded on a log axis.
    let ticks: Vec<f64> = (n_min.log2().ceil() as i32..=n_max.log2().floor() as i32)
        .map(|k| 2f64.powi(k))
        .collect();
    let fastest = results
        .iter()
        .filter_map(|m| run.speed(m).map(|s| s.0))
        .fold(run.copy.gbps, f64::max);

    let mut chart = ChartBuilder::on(area)
        .caption(format!("{dtype}, M = {}", plan.rows), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (n_min..n_max).log_scale().with_key_points(ticks),
            0.0..fastest * 1.1,
        )?;
    chart
        .configure_mesh()
        .max_light_lines(0)
        .x_desc("N")
        .y_desc("GB/s")
        .x_label_formatter(&|n| format!("{n:.0}"))
        .y_label_formatter(&|g| format!("{g:.0}"))
        .draw()?;

    let copy_style = ShapeStyle::from(&BLACK.mix(0.6)).stroke_width(1);
    chart
        .draw_series(DashedLineSeries::new(
            [(n_min, run.copy.gbps), (n_max, run.copy.gbps)],
            8,
            6,
            copy_style,
        ))?
        .label(format!("copy ({:.0} GB/s)", run.copy.gbps))
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], copy_style));

    let series = plan
        .modes
        .iter()
        .flat_map(|&mode| mode.providers().iter().map(move |&p| (mode, p)));
    for (index, (mode, provider)) in series.enumerate() {
        let color = Palette99::pick(index).to_rgba();
        let mut by_n: Vec<(f64, Option<f64>)> = results
            .iter()
            .filter(|m| (m.mode, m.dtype, m.provider) == (mode, dtype, provider))
            .map(|m| (m.n as f64, run.speed(m).map(|(gbps, _)| gbps)))
            .collect();
        by_n.sort_by(|a, b| a.0.total_cmp(&b.0));
        // A failed configuration breaks the line: no value is drawn where none was measured.
        for segment in by_n.split(|(_, gbps)| gbps.is_none()) {
            let line = segment.iter().filter_map(|&(n, gbps)| Some((n, gbps?)));
            chart.draw_series(LineSeries::new(line, color.stroke_width(2)))?;
        }
        let points = by_n.iter().filter_map(|&(n, gbps)| Some((n, gbps?)));
        chart
            .draw_series(points.map(|p| Circle::new(p, 3, color.filled())))?
            .label(format!("{mode} {provider}"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}
