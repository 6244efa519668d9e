//! GB/s against N, one chart per (mode, dtype, M): the passes in rows, the types and row
//! counts side by side; a line per provider of ours, the peers' beside them (thinner, with
//! triangles, as the Triton tutorial's plot shows Triton beside Torch) where their JSON was
//! given, and the copy ceiling dashed. Text is drawn with DejaVu Sans compiled into the
//! binary, so PNGs need no system font libraries.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::config::{Dtype, Mode, Norm};
use crate::error::BenchError;
use crate::peers::PeerRun;
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

/// One line of a chart: its label, its colour's index in the palette, and (N, GB/s) in N
/// order, None where that N has no time.
type Line = (String, usize, Vec<(f64, Option<f64>)>);

/// The peers' colours come after those of ours (one per `Provider`), so that a provider has
/// one colour in every chart.
const FIRST_PEER_COLOR: usize = 3;

/// What the charts draw from.
struct Figure<'a> {
    run: &'a Run,
    plan: &'a Plan,
    results: &'a [Measurement],
    peers: Option<&'a PeerRun>,
}

pub fn draw(
    path: &Path,
    run: &Run,
    plan: &Plan,
    results: &[Measurement],
    peers: Option<&PeerRun>,
) -> Result<(), BenchError> {
    let failed = |reason: String| BenchError::Plot {
        path: path.to_path_buf(),
        reason,
    };
    register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| failed("the bundled font does not load".into()))?;
    let figure = Figure {
        run,
        plan,
        results,
        peers,
    };
    let columns = (plan.dtypes.len() * plan.rows.len()).max(1) as u32;
    let size = (
        CHART_SIZE.0 * columns,
        CHART_SIZE.1 * plan.modes.len().max(1) as u32,
    );
    match Format::of(path) {
        Some(Format::Png) => {
            let root = BitMapBackend::new(path, size).into_drawing_area();
            figure
                .draw_on(&root)
                .and_then(|()| root.present().map_err(|e| e.to_string()))
                .map_err(failed)
        }
        Some(Format::Svg) => {
            let root = SVGBackend::new(path, size).into_drawing_area();
            figure
                .draw_on(&root)
                .and_then(|()| root.present().map_err(|e| e.to_string()))
                .map_err(failed)
        }
        None => Err(failed("the file name must end in .png or .svg".into())),
    }
}

impl Figure<'_> {
    fn draw_on<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let plan = self.plan;
        let charts = plan.modes.iter().flat_map(|&mode| {
            plan.dtypes
                .iter()
                .flat_map(move |&dtype| plan.rows.iter().map(move |&rows| (mode, dtype, rows)))
        });
        let columns = (plan.dtypes.len() * plan.rows.len()).max(1);
        let panels = root.split_evenly((plan.modes.len().max(1), columns));
        for (panel, key) in panels.iter().zip(charts) {
            self.chart(panel, key).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn chart<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        (mode, dtype, rows): (Mode, Dtype, usize),
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        let (run, plan, results) = (self.run, self.plan, self.results);
        let (n_min, n_max) = plan.ns.iter().fold((f64::MAX, 0.0f64), |(lo, hi), &n| {
            (lo.min(n as f64), hi.max(n as f64))
        });
        // A log axis needs a range of positive width, even for a single N.
        let (n_min, n_max) = (n_min / 1.2, n_max * 1.2);
        // Ticks at powers of two: the sizes people think in, and never crowded on a log axis.
        let ticks: Vec<f64> = (n_min.log2().ceil() as i32..=n_max.log2().floor() as i32)
            .map(|k| 2f64.powi(k))
            .collect();
        let ours: Vec<Line> = mode
            .providers()
            .iter()
            .map(|&provider| {
                let mut by_n: Vec<(f64, Option<f64>)> = results
                    .iter()
                    .filter(|m| (m.mode, m.dtype, m.provider, m.rows) == (mode, dtype, provider, rows))
                    .map(|m| (m.n as f64, run.speed(m).map(|(gbps, _)| gbps)))
                    .collect();
                by_n.sort_by(|a, b| a.0.total_cmp(&b.0));
                (provider.to_string(), provider as usize, by_n)
            })
            .collect();
        let theirs: Vec<Line> = self
            .peers
            .map(|peers| {
                let in_mode = peers.providers(Some(mode));
                let all = peers.providers(None);
                all.into_iter()
                    .enumerate()
                    .filter(|(_, peer)| in_mode.contains(peer))
                    .map(|(place, peer)| {
                        let by_n = plan
                            .ns
                            .iter()
                            .map(|&n| {
                                let timed = peers.find(mode, dtype, peer, rows, n).and_then(|r| r.timed());
                                (n as f64, timed.map(|(_, gbps)| gbps))
                            })
                            .collect();
                        (peer.to_string(), FIRST_PEER_COLOR + place, by_n)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let fastest = ours
            .iter()
            .chain(&theirs)
            .flat_map(|(_, _, by_n)| by_n.iter().filter_map(|&(_, gbps)| gbps))
            .fold(run.copy.gbps, f64::max);

        let pass = match mode {
            Mode::Fwd => "forward",
            Mode::Bwd => "backward",
        };
        let norm = match run.norm {
            Norm::Layer => "LayerNorm",
            Norm::Rms => "RMSNorm",
        };
        let residual = match (run.residual, run.f32_stream) {
            (true, true) => " + residual (f32 stream)",
            (true, false) => " + residual",
            _ => "",
        };
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{norm}{residual} {pass}, {dtype}, M = {rows}"),
                ("sans-serif", 22),
            )
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

        // Ours thick with dots, the peers thin with triangles.
        for (index, (label, color, by_n)) in ours.iter().chain(&theirs).enumerate() {
            let peer = index >= ours.len();
            let color = Palette99::pick(*color).to_rgba();
            let style = color.stroke_width(if peer { 1 } else { 2 });
            // A configuration not timed breaks the line: nothing is drawn where no value is.
            for segment in by_n.split(|(_, gbps)| gbps.is_none()) {
                let line = segment.iter().filter_map(|&(n, gbps)| Some((n, gbps?)));
                chart.draw_series(LineSeries::new(line, style))?;
            }
            let points = by_n.iter().filter_map(|&(n, gbps)| Some((n, gbps?)));
            let drawn = if peer {
                chart.draw_series(points.map(|p| TriangleMarker::new(p, 4, color.filled())))?
            } else {
                chart.draw_series(points.map(|p| Circle::new(p, 3, color.filled())))?
            };
            drawn
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        Ok(())
    }
}
