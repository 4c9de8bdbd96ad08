//! The `--plot` chart: an SVG with one panel per replayed (trace, device), showing active
//! memory and reserved memory (ours and native) over the trace's events.

use crate::series::Point;
use plotters::prelude::*;
use std::path::Path;

/// Points recorded per replay for the chart.
pub const SERIES_POINTS: usize = 2000;

/// One panel of the chart.
pub struct Panel<'a> {
    pub title: String,
    pub points: &'a [Point],
    /// Added to the native series (segments reserved before the trace began).
    pub native_offset: u64,
    /// Our reserved memory was measured (not `--trace-only`).
    pub ours: bool,
    /// The simulated device's size, drawn when the user chose it.
    pub capacity: Option<u64>,
}

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

/// A labelled line of the chart: (event, GiB) points.
type Line<'a> = (&'a str, RGBColor, Vec<(u64, f64)>);
const PANEL_HEIGHT: u32 = 360;
const WIDTH: u32 = 1100;

/// Writes the chart to `path` as SVG.
pub fn write_svg(path: &Path, panels: &[Panel]) -> Result<(), String> {
    let height = PANEL_HEIGHT * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        draw_panel(area, panel).map_err(|e| e.to_string())?;
    }
    root.present()
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The native allocator's reserved bytes at a point.
fn native_bytes(panel: &Panel, p: &Point) -> u64 {
    (p.native.max(0) as u64).saturating_add(panel.native_offset)
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let data_top = panel
        .points
        .iter()
        .map(|p| p.active.max(p.reserved).max(native_bytes(panel, p)))
        .max()
        .unwrap_or(0);
    // The capacity is drawn when it is within reach of the data; far above it, it would
    // flatten every curve.
    let capacity = panel
        .capacity
        .filter(|&c| c as f64 <= 2.0 * data_top as f64);
    let top_bytes = data_top.max(capacity.unwrap_or(0)).max(1 << 20);
    let (unit, scale) = if top_bytes >= 1 << 30 {
        ("GiB", GIB)
    } else {
        ("MiB", MIB)
    };
    let gib = |b: u64| b as f64 / scale;
    let native = |p: &Point| gib(native_bytes(panel, p));
    let last_event = panel.points.last().map_or(1, |p| p.event.max(1));
    let top = gib(top_bytes) * 1.08;

    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0u64..last_event, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("event")
        .y_desc(unit)
        .y_label_formatter(&|y| format!("{y:.2}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;

    let native_color = RGBColor(214, 39, 40);
    let ours_color = RGBColor(31, 119, 180);
    let active_color = RGBColor(44, 160, 44);
    let mut lines: Vec<Line> = vec![(
        "native reserved",
        native_color,
        panel.points.iter().map(|p| (p.event, native(p))).collect(),
    )];
    if panel.ours {
        let reserved = panel.points.iter().map(|p| (p.event, gib(p.reserved)));
        lines.push(("gmlake reserved", ours_color, reserved.collect()));
    }
    let active = panel.points.iter().map(|p| (p.event, gib(p.active)));
    lines.push(("active (trace)", active_color, active.collect()));
    for (label, color, points) in lines {
        let style = color.stroke_width(2);
        chart
            .draw_series(LineSeries::new(points, style))?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
    }
    if let Some(cap) = capacity {
        let c = gib(cap);
        chart
            .draw_series(DashedLineSeries::new(
                [(0, c), (last_event, c)],
                8,
                5,
                BLACK.stroke_width(1),
            ))?
            .label("capacity")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_an_svg_with_every_series() {
        let points: Vec<Point> = (0..50u64)
            .map(|i| Point {
                event: i * 10,
                active: i << 26,
                reserved: (i + 2) << 26,
                native: ((i + 5) << 26) as i64,
            })
            .collect();
        let dir = std::env::temp_dir().join(format!("gmlake-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("chart.svg");
        let panels = [
            Panel {
                title: "a.pickle device 0".into(),
                points: &points,
                native_offset: 0,
                ours: true,
                capacity: Some(4 << 30),
            },
            Panel {
                title: "empty".into(),
                points: &[],
                native_offset: 0,
                ours: false,
                capacity: None,
            },
        ];
        write_svg(&path, &panels).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(100)]);
        for label in [
            "native reserved",
            "gmlake reserved",
            "active (trace)",
            "capacity",
        ] {
            assert!(svg.contains(label), "no {label}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
