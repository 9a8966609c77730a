//! The bench's results: `results.json` (every figure, per round), `results.md` (tables
//! of ratios to `direct` and to `iptables-legacy`) and PNG plots drawn with plotters
//! (bitmap backend; text with the DejaVu Sans font file from `fonts-dejavu-core`).

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};

use super::{
    modes::{AgentFigures, Timing},
    stats::{self, Latency},
};

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Results {
    pub meta: Meta,
    pub modes: Vec<ModeInfo>,
    pub scales: Vec<ScaleResult>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Meta {
    pub command: String,
    pub quick: bool,
    pub started_unix: u64,
    pub duration_seconds: f64,
    pub machine: BTreeMap<String, String>,
    pub tools: BTreeMap<String, String>,
    pub config: BTreeMap<String, serde_json::Value>,
    pub finished: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ModeInfo {
    pub name: String,
    pub description: String,
    pub available: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ScaleResult {
    pub services: usize,
    pub endpoints_per_service: usize,
    pub modes: Vec<ModeScale>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    Unavailable,
    GaveUp,
    Failed,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ModeScale {
    pub mode: String,
    pub status: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub program: Option<Timing>,
    pub rounds: Vec<RoundResult>,
    pub changes: Vec<ChangeResult>,
    pub summary: Summary,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentFigures>,
    /// The agent's CPU use at rest (nothing changing), watched right after programming,
    /// percent of one core: the cost of following the manifests directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_idle_cpu_percent: Option<f64>,
}

impl ModeScale {
    pub fn new(mode: &str, status: Status, reason: Option<String>) -> Self {
        Self {
            mode: mode.into(),
            status,
            reason,
            program: None,
            rounds: Vec::new(),
            changes: Vec::new(),
            summary: Summary::default(),
            agent: None,
            agent_idle_cpu_percent: None,
        }
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct RoundResult {
    pub round: usize,
    pub tcp: Option<Latency>,
    pub tcp_errors: u64,
    pub udp: Option<Latency>,
    pub udp_errors: u64,
    pub connections_per_second: Option<f64>,
    pub cps_errors: u64,
    pub bulk_gbit_per_second: Option<f64>,
    /// Distinct endpoints that answered the TCP exchanges (10 expected).
    pub endpoints_answered: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ChangeResult {
    pub round: usize,
    /// The programming command(s) (kube-proxy modes) or the manifest write (ours).
    pub command: Option<Timing>,
    /// From just before the change to the first connection answered by the new endpoint.
    pub visible_ms: Option<f64>,
    /// The agent's own `network_programming_duration_seconds` for this change.
    pub agent_reported_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    /// All rounds' TCP samples pooled.
    pub tcp: Option<Latency>,
    pub udp: Option<Latency>,
    /// Medians over rounds.
    pub connections_per_second: Option<f64>,
    pub bulk_gbit_per_second: Option<f64>,
    pub program_seconds: Option<f64>,
    pub change_command_ms: Option<f64>,
    pub change_visible_ms: Option<f64>,
    pub change_agent_reported_ms: Option<f64>,
    pub errors: u64,
}

impl Results {
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        let json = serde_json::to_string_pretty(self)?;
        std::fs::write(dir.join("results.json"), json)?;
        std::fs::write(dir.join("results.md"), self.markdown())?;
        Ok(())
    }

    fn mode_names(&self) -> Vec<&str> {
        self.modes.iter().map(|m| m.name.as_str()).collect()
    }

    fn get<'a>(&self, scale: &'a ScaleResult, mode: &str) -> Option<&'a ModeScale> {
        scale.modes.iter().find(|m| m.mode == mode)
    }

    /// The Markdown report.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "# ebpf-proxy benchmark results\n");
        let _ = writeln!(md, "Command: `{}`  ", self.meta.command);
        let m = &self.meta.machine;
        let _ = writeln!(
            md,
            "Machine: {} CPUs ({}), kernel {}, {} MiB; run took {:.0} s{}.\n",
            m.get("nproc").map_or("?", String::as_str),
            m.get("cpu").map_or("?", String::as_str),
            m.get("kernel").map_or("?", String::as_str),
            m.get("mem_mib").map_or("?", String::as_str),
            self.meta.duration_seconds,
            if self.meta.finished {
                ""
            } else {
                " (unfinished)"
            }
        );
        let _ = writeln!(md, "Modes:\n");
        for mode in &self.modes {
            let _ = writeln!(
                md,
                "- `{}`: {}{}",
                mode.name,
                mode.description,
                mode.reason
                    .as_ref()
                    .map(|r| format!(" **Not measured: {r}**"))
                    .unwrap_or_default()
            );
        }
        md.push('\n');
        for scale in &self.scales {
            self.scale_table(&mut md, scale);
        }
        self.across_scales(&mut md);
        md
    }

    fn scale_table(&self, md: &mut String, scale: &ScaleResult) {
        let _ = writeln!(
            md,
            "## {} service{} ({} endpoints each)\n",
            thousands(scale.services),
            if scale.services == 1 { "" } else { "s" },
            scale.endpoints_per_service
        );
        let direct = self.get(scale, "direct").map(|m| &m.summary);
        let legacy = self.get(scale, "iptables-legacy").map(|m| &m.summary);
        type Pick = fn(&Summary) -> Option<f64>;
        let tcp50: Pick = |s| s.tcp.as_ref().map(|l| l.p50_us);
        let tcp99: Pick = |s| s.tcp.as_ref().map(|l| l.p99_us);
        let udp50: Pick = |s| s.udp.as_ref().map(|l| l.p50_us);
        let udp99: Pick = |s| s.udp.as_ref().map(|l| l.p99_us);
        let cps: Pick = |s| s.connections_per_second;
        let bulk: Pick = |s| s.bulk_gbit_per_second;
        let program: Pick = |s| s.program_seconds;
        let change: Pick = |s| s.change_visible_ms;
        let vs =
            |base: Option<&Summary>, s: &Summary, f: Pick| x(stats::ratio(f(s), base.and_then(f)));
        // Datapath: absolute figures and ratios to direct.
        let _ = writeln!(
            md,
            "Datapath (ratios to `direct`, the pod-IP exchange without any proxy):\n\n\
             | mode | TCP connect+request p50 µs | × direct | TCP p99 µs | × direct | UDP p50 µs | × direct | UDP p99 µs | × direct | conn/s | × direct | bulk Gbit/s | × direct |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        let mut control = String::new();
        let _ = writeln!(
            control,
            "Against kube-proxy's default (ratios to `iptables-legacy`), and the control plane:\n\n\
             | mode | TCP p50 × iptables-legacy | UDP p50 × iptables-legacy | conn/s × iptables-legacy | program all N (s) | × iptables-legacy | 1 endpoint change, visible (ms) | × iptables-legacy | its command (ms) |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for name in self.mode_names() {
            let Some(ms) = self.get(scale, name) else {
                continue;
            };
            if ms.status != Status::Ok {
                let why = match ms.status {
                    Status::Unavailable => "not available".to_string(),
                    Status::GaveUp => format!("gave up: {}", ms.reason.clone().unwrap_or_default()),
                    Status::Failed => format!("failed: {}", ms.reason.clone().unwrap_or_default()),
                    Status::Ok => String::new(),
                }
                .replace('|', "/")
                .lines()
                .next()
                .unwrap_or("")
                .chars()
                .take(200)
                .collect::<String>();
                let _ = writeln!(md, "| {name} | {why} |||||||||||| ");
                let _ = writeln!(control, "| {name} | {why} |||||||| ");
                continue;
            }
            let s = &ms.summary;
            let _ = writeln!(
                md,
                "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                num(tcp50(s), 1),
                vs(direct, s, tcp50),
                num(tcp99(s), 1),
                vs(direct, s, tcp99),
                num(udp50(s), 1),
                vs(direct, s, udp50),
                num(udp99(s), 1),
                vs(direct, s, udp99),
                num(cps(s), 0),
                vs(direct, s, cps),
                num(bulk(s), 1),
                vs(direct, s, bulk),
            );
            let _ = writeln!(
                control,
                "| {name} | {} | {} | {} | {} | {} | {} | {} | {} |",
                vs(legacy, s, tcp50),
                vs(legacy, s, udp50),
                vs(legacy, s, cps),
                num(program(s), 3),
                vs(legacy, s, program),
                num(change(s), 1),
                vs(legacy, s, change),
                num(s.change_command_ms, 1),
            );
        }
        md.push('\n');
        md.push_str(&control);
        let notes: Vec<String> = scale
            .modes
            .iter()
            .filter_map(|m| {
                let a = m.agent.as_ref()?;
                Some(format!(
                    "`{}`: agent RSS {} MiB after programming; its own sync took {} s; it reported {} ms per endpoint change; at rest it used {} % of a core.",
                    m.mode,
                    num(a.rss_mib, 1),
                    num(a.sync_seconds, 3),
                    num(m.summary.change_agent_reported_ms, 1),
                    num(m.agent_idle_cpu_percent, 0)
                ))
            })
            .chain(scale.modes.iter().filter(|m| m.summary.errors > 0).map(|m| {
                format!("`{}`: {} failed exchanges", m.mode, m.summary.errors)
            }))
            .collect();
        if !notes.is_empty() {
            md.push('\n');
            for n in notes {
                let _ = writeln!(md, "{n}  ");
            }
        }
        md.push('\n');
    }

    fn across_scales(&self, md: &mut String) {
        if self.scales.len() < 2 {
            return;
        }
        let header: Vec<String> = self.scales.iter().map(|s| thousands(s.services)).collect();
        type Column = fn(&ModeScale) -> Option<f64>;
        let tables: [(&str, Column, bool); 4] = [
            (
                "TCP connect+request p50, × direct",
                |m| m.summary.tcp.as_ref().map(|l| l.p50_us),
                true,
            ),
            (
                "UDP request/response p50, × direct",
                |m| m.summary.udp.as_ref().map(|l| l.p50_us),
                true,
            ),
            (
                "Programming all N services from nothing (s)",
                |m| m.summary.program_seconds,
                false,
            ),
            (
                "One endpoint change, until visible through traffic (ms)",
                |m| m.summary.change_visible_ms,
                false,
            ),
        ];
        for (title, f, ratio) in tables {
            let _ = writeln!(md, "## {title}, by number of services\n");
            let _ = writeln!(md, "| mode | {} |", header.join(" | "));
            let _ = writeln!(md, "|---|{}", "---:|".repeat(header.len()));
            for name in self.mode_names() {
                if ratio && name == "direct" {
                    continue;
                }
                let cells: Vec<String> = self
                    .scales
                    .iter()
                    .map(|scale| {
                        let Some(ms) = self.get(scale, name) else {
                            return String::new();
                        };
                        match ms.status {
                            Status::Ok => {}
                            Status::Unavailable => return "n/a".into(),
                            Status::GaveUp => return "gave up".into(),
                            Status::Failed => return "failed".into(),
                        }
                        if ratio {
                            let base = self.get(scale, "direct").and_then(f);
                            x(stats::ratio(f(ms), base))
                        } else {
                            num(f(ms), if title.contains("(s)") { 3 } else { 1 })
                        }
                    })
                    .collect();
                let _ = writeln!(md, "| {name} | {} |", cells.join(" | "));
            }
            md.push('\n');
        }
    }
}

fn num(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.decimals$}"),
        _ => "–".into(),
    }
}

fn x(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.2}×"),
        _ => "–".into(),
    }
}

/// `50000` -> `50,000`.
pub fn thousands(n: usize) -> String {
    let s = n.to_string();
    let head = match s.len() % 3 {
        0 => 3.min(s.len()),
        r => r,
    };
    let mut out = s[..head].to_string();
    for group in s.as_bytes()[head..].chunks(3) {
        out.push(',');
        out.push_str(std::str::from_utf8(group).unwrap_or(""));
    }
    out
}

// ---------------------------------------------------------------------------------

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Colours per mode (stable across plots).
fn colour(mode: &str) -> plotters::style::RGBColor {
    use plotters::style::RGBColor;
    match mode {
        "direct" => RGBColor(90, 90, 90),
        "socket" => RGBColor(0, 140, 60),
        "tc" => RGBColor(0, 170, 170),
        "iptables-legacy" => RGBColor(200, 30, 30),
        "iptables-nft" => RGBColor(240, 130, 0),
        "nftables" => RGBColor(40, 80, 200),
        "ipvs" => RGBColor(150, 60, 170),
        _ => RGBColor(0, 0, 0),
    }
}

struct Series {
    mode: String,
    points: Vec<(f64, f64)>,
    dashed: bool,
}

struct Panel {
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

fn draw(path: &Path, panels: &[Panel], max_services: usize) -> Result<()> {
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
fn short(v: f64) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well() {
        assert_eq!(thousands(50_000), "50,000");
        assert_eq!(thousands(1), "1");
        assert_eq!(thousands(1_000_000), "1,000,000");
        assert_eq!(short(0.25), "0.25");
        assert_eq!(short(2.0), "2.0");
        assert_eq!(short(1500.0), "1,500");
        assert_eq!(short(25_000.0), "25k");
        assert_eq!(x(Some(1.234)), "1.23×");
        assert_eq!(num(None, 1), "–");
    }
}
