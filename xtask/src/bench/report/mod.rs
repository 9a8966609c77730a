//! The bench's results: `results.json` (every figure, per round), `results.md` (tables
//! of ratios to `direct` and to `iptables-legacy`) and PNG plots drawn with plotters
//! (bitmap backend; text with the DejaVu Sans font file from `fonts-dejavu-core`).

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::{
    modes::{AgentFigures, Timing},
    stats::{self, Latency},
};

mod plot;

#[cfg(test)]
use plot::short;

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

/// What a `--quick` run (inside `cargo xtask test`) requires: no recorded error at all,
/// `errors` being every error a run recorded (the datapath part's, the packet-rate
/// part's). No thresholds on the figures: the quick run checks that every mode works.
pub fn quick_verdict(errors: &[String]) -> Result<()> {
    if errors.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "the quick bench recorded {} error(s):\n  {}",
        errors.len(),
        errors.join("\n  ")
    )
}

impl Results {
    /// Every error the run recorded, one line each: a mode that failed (programming or
    /// its check) or gave up, a round that failed or had failed exchanges, an endpoint
    /// change that failed, a mode whose set-up failed. A mode this machine's kernel cannot
    /// run (no IPVS: its reason starts with `modes::KERNEL_LACKS`) is not one.
    pub fn errors(&self) -> Vec<String> {
        let mut out = Vec::new();
        for m in &self.modes {
            let why = m.reason.as_deref().unwrap_or("");
            if !m.available && !why.starts_with(super::modes::KERNEL_LACKS) {
                out.push(format!("{}: could not be set up: {why}", m.name));
            }
        }
        for s in &self.scales {
            for m in &s.modes {
                let at = format!("{} services, {}", thousands(s.services), m.mode);
                let why = m.reason.as_deref().unwrap_or("");
                match m.status {
                    Status::Failed => out.push(format!("{at}: failed: {why}")),
                    Status::GaveUp => out.push(format!("{at}: gave up: {why}")),
                    Status::Ok | Status::Unavailable => {}
                }
                for r in &m.rounds {
                    let failed = r.tcp_errors + r.udp_errors + r.cps_errors;
                    if r.first_error.is_some() || failed > 0 {
                        out.push(format!(
                            "{at}: round {}: {failed} failed exchanges (tcp {}, udp {}, connections {}){}",
                            r.round + 1,
                            r.tcp_errors,
                            r.udp_errors,
                            r.cps_errors,
                            r.first_error
                                .as_ref()
                                .map(|e| format!(": {e}"))
                                .unwrap_or_default()
                        ));
                    }
                }
                for c in &m.changes {
                    if let Some(e) = &c.error {
                        out.push(format!("{at}: endpoint change {}: {e}", c.round + 1));
                    }
                }
            }
        }
        out
    }
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

    fn one_mode(m: ModeScale) -> Results {
        Results {
            scales: vec![ScaleResult {
                services: 1000,
                endpoints_per_service: 10,
                modes: vec![m],
            }],
            ..Results::default()
        }
    }

    /// Any recorded error of any mode fails `--quick`; an unavailable mode does not.
    #[test]
    fn any_recorded_error_fails_the_quick_run() {
        let good = || {
            let mut m = ModeScale::new("socket", Status::Ok, None);
            m.rounds.push(RoundResult::default());
            m.changes.push(ChangeResult::default());
            m
        };
        assert!(quick_verdict(&one_mode(good()).errors()).is_ok());
        let off = ModeScale::new("ipvs", Status::Unavailable, Some("no IPVS".into()));
        assert!(quick_verdict(&one_mode(off).errors()).is_ok());
        // Set up: a kernel without IPVS is not an error, a mode that failed otherwise is.
        let info = |name: &str, reason: String| ModeInfo {
            name: name.into(),
            description: String::new(),
            available: false,
            reason: Some(reason),
        };
        let mut r = one_mode(good());
        r.modes.push(info(
            "ipvs",
            format!("{}IPVS", super::super::modes::KERNEL_LACKS),
        ));
        assert!(quick_verdict(&r.errors()).is_ok());
        r.modes.push(info(
            "socket",
            "starting the bench client: No such file".into(),
        ));
        let err = quick_verdict(&r.errors()).expect_err("a mode that failed to set up");
        assert!(
            err.to_string().contains("socket: could not be set up"),
            "{err}"
        );

        let mut round = good();
        round.rounds[0].first_error = Some("connect: timed out".into());
        let mut exchanges = good();
        exchanges.rounds[0].udp_errors = 3;
        let mut change = good();
        change.changes[0].error = Some("new endpoint never answered".into());
        let failed = ModeScale::new("tc", Status::Failed, Some("check failed".into()));
        let gave_up = ModeScale::new("nftables", Status::GaveUp, Some("over 60 s".into()));
        for (m, want) in [
            (round, "round 1: 0 failed exchanges"),
            (exchanges, "udp 3"),
            (change, "endpoint change 1: new endpoint never answered"),
            (failed, "tc: failed: check failed"),
            (gave_up, "nftables: gave up: over 60 s"),
        ] {
            let err = quick_verdict(&one_mode(m).errors()).expect_err(want);
            assert!(err.to_string().contains(want), "{want} not in {err}");
        }
    }
}
