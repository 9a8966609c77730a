//! The report's charts (`results.png` and friends): one panel per figure, a line per
//! mode across scales, drawn with plotters.

use std::path::Path;

use anyhow::{Context as _, Result};

use super::{thousands, ModeScale, Results, Status};

pub(super) const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Colours per mode (stable across plots).
pub(super) fn colour(mode: &str) -> plotters::style::RGBColor {
    use plotters::style::RGBColor;
    match mode {
        "direct" => RGBColor(90, 90, 90),
        "socket" => RGBColor(0, 140, 60),
        "tc" => RGBColor(0, 170, 170),
        "pod" => RGBColor(0, 100, 140),
        "iptables-legacy" => RGBColor(200, 30, 30),
        "iptables-nft" => RGBColor(240, 130, 0),
        "nftables" => RGBColor(40, 80, 200),
        "ipvs" => RGBColor(150, 60, 170),
        _ => RGBColor(0, 0, 0),
    }
}

pub(super) struct Series {
    mode: String,
    points: Vec<(f64, f64)>,
    dashed: bool,
}

pub(super) struct Panel {
    title: String,
    y_label: String,
    series: Vec<Series>,
    log_y: bool,
}

impl Results {
    fn series(&self, f: impl Fn(&ModeScale) -> Option<f64>, dashed: bool) -> Vec<Series> {
        self.mode_names()
            .into_iter()
            .map(|name| Series {
                mode: name.to_string(),
                points: self
                    .scales
                    .iter()
                    .filter_map(|s| {
                        let m = self.get(s, name)?;
                        (m.status == Status::Ok)
                            .then(|| f(m))
                            .flatten()
                            .filter(|v| v.is_finite() && *v > 0.0)
                            .map(|v| (s.services as f64, v))
                    })
                    .collect(),
                dashed,
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    }

    /// Draws the PNGs into `dir`: latency.png, throughput.png, control-plane.png.
    pub fn plot(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
        let font = FONT_PATHS
            .iter()
            .find_map(|p| std::fs::read(p).ok())
            .context("no DejaVuSans.ttf (apt-get install fonts-dejavu-core): plots skipped")?;
        // plotters keeps the font for the process: leak one copy, once per run.
        let font: &'static [u8] = Box::leak(font.into_boxed_slice());
        plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, font)
            .map_err(|_| anyhow::anyhow!("the font file does not load"))?;
        let mut tcp = self.series(|m| m.summary.tcp.as_ref().map(|l| l.p50_us), false);
        tcp.extend(self.series(|m| m.summary.tcp.as_ref().map(|l| l.p99_us), true));
        let mut udp = self.series(|m| m.summary.udp.as_ref().map(|l| l.p50_us), false);
        udp.extend(self.series(|m| m.summary.udp.as_ref().map(|l| l.p99_us), true));
        let files = [
            (
                "latency.png",
                vec![
                    Panel {
                        title: "TCP connect + request/response (solid p50, dashed p99)".into(),
                        y_label: "latency (µs)".into(),
                        series: tcp,
                        log_y: true,
                    },
                    Panel {
                        title: "UDP request/response, new socket each (solid p50, dashed p99)"
                            .into(),
                        y_label: "latency (µs)".into(),
                        series: udp,
                        log_y: true,
                    },
                ],
            ),
            (
                "throughput.png",
                vec![
                    Panel {
                        title: "Connections per second (2 parallel clients)".into(),
                        y_label: "connections/s".into(),
                        series: self.series(|m| m.summary.connections_per_second, false),
                        log_y: false,
                    },
                    Panel {
                        title: "One TCP stream".into(),
                        y_label: "Gbit/s".into(),
                        series: self.series(|m| m.summary.bulk_gbit_per_second, false),
                        log_y: false,
                    },
                ],
            ),
            (
                "control-plane.png",
                vec![
                    Panel {
                        title: "Programming all N services from nothing".into(),
                        y_label: "seconds".into(),
                        series: self.series(|m| m.summary.program_seconds, false),
                        log_y: true,
                    },
                    Panel {
                        title: "One endpoint change, until visible through traffic".into(),
                        y_label: "milliseconds".into(),
                        series: self.series(|m| m.summary.change_visible_ms, false),
                        log_y: true,
                    },
                ],
            ),
        ];
        let mut written = Vec::new();
        for (file, panels) in files {
            let path = dir.join(file);
            draw(
                &path,
                &panels,
                self.scales.iter().map(|s| s.services).max().unwrap_or(1),
            )
            .with_context(|| format!("drawing {}", path.display()))?;
            written.push(path);
        }
        Ok(written)
    }
}

// Long: one chart drawn in plotting order (axes, series, legend).
pub(super) fn draw(path: &Path, panels: &[Panel], max_services: usize) -> Result<()> {
    use plotters::prelude::*;
    let root = BitMapBackend::new(path, (1600, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((1, panels.len()));
    let x_max = (max_services as f64 * 2.0).max(10.0);
    for (area, panel) in areas.iter().zip(panels) {
        let (lo, hi) = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
        let (lo, hi) = if lo > hi { (1.0, 10.0) } else { (lo, hi) };
        let values: Vec<f64> = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .collect();
        let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
        let mut chart = ChartBuilder::on(area);
        chart
            .caption(&panel.title, ("sans-serif", 22))
            .margin(18)
            .x_label_area_size(50)
            .y_label_area_size(80);
        let x_range = (0.5f64..x_max).log_scale();
        let x_desc = "number of services (log scale)";
        // A log axis only when the values span more than a factor of 30 (a narrower
        // log range gets too few labels to read).
        if panel.log_y && hi / lo > 30.0 {
            let mut c = chart.build_cartesian_2d(x_range, ((lo / 1.5)..(hi * 1.5)).log_scale())?;
            c.configure_mesh()
                .x_desc(x_desc)
                .y_desc(&panel.y_label)
                .y_labels(12)
                .x_label_formatter(&|v| thousands(v.round() as usize))
                .y_label_formatter(&|v| short(*v))
                .label_style(("sans-serif", 16))
                .axis_desc_style(("sans-serif", 18))
                .draw()?;
            for s in &panel.series {
                let col = colour(&s.mode);
                let style = ShapeStyle::from(&col).stroke_width(3);
                if s.dashed {
                    c.draw_series(DashedLineSeries::new(s.points.clone(), 8, 6, style))?;
                } else {
                    c.draw_series(LineSeries::new(s.points.clone(), style))?
                        .label(s.mode.clone())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 24, y)], col.stroke_width(3))
                        });
                }
                c.draw_series(s.points.iter().map(|p| Circle::new(*p, 4, col.filled())))?;
            }
            c.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 16))
                .position(SeriesLabelPosition::UpperLeft)
                .draw()?;
        } else {
            let mut c = chart.build_cartesian_2d(x_range, 0f64..(hi * 1.15))?;
            c.configure_mesh()
                .x_desc(x_desc)
                .y_desc(&panel.y_label)
                .x_label_formatter(&|v| thousands(v.round() as usize))
                .y_label_formatter(&|v| short(*v))
                .label_style(("sans-serif", 16))
                .axis_desc_style(("sans-serif", 18))
                .draw()?;
            for s in &panel.series {
                let col = colour(&s.mode);
                let style = ShapeStyle::from(&col).stroke_width(3);
                if s.dashed {
                    c.draw_series(DashedLineSeries::new(s.points.clone(), 8, 6, style))?;
                } else {
                    c.draw_series(LineSeries::new(s.points.clone(), style))?
                        .label(s.mode.clone())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 24, y)], col.stroke_width(3))
                        });
                }
                c.draw_series(s.points.iter().map(|p| Circle::new(*p, 4, col.filled())))?;
            }
            c.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 16))
                .position(if mean < hi * 1.15 / 2.0 {
                    SeriesLabelPosition::UpperLeft
                } else {
                    SeriesLabelPosition::LowerLeft
                })
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}

/// Axis numbers: 0.001, 0.5, 12, 1,500, 25k.
pub(super) fn short(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{}k", thousands((v / 1000.0).round() as usize))
    } else if v >= 10.0 {
        thousands(v.round() as usize)
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}
