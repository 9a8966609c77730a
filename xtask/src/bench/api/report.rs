//! The `--api` results as Markdown tables and an SVG plot (programming time and memory
//! against N, log-log).

use super::results::{ApiResults, ApiScale, Dist};
use crate::bench::report;

/// One plotted line: label, colour, points (N, value), panel.
type Line<'a> = (&'a str, &'a str, Vec<(f64, f64)>, usize);

fn f(v: Option<f64>, decimals: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.decimals$}"))
}

// Long: the results page: one markdown template filled from the results.
pub fn markdown(r: &ApiResults) -> String {
    let mut md = String::from("## Control plane over the API (`cargo xtask bench --api`)\n\n");
    if let Some(c) = &r.config {
        md += &format!(
            "{} run; bench (and fake apiserver) built {}; {} single changes per N; machine: {} CPUs, {} MiB.\n\n",
            if c.quick { "Quick" } else { "Full" },
            if c.optimized { "with optimizations" } else { "without optimizations (list pages are served slower)" },
            c.changes,
            r.machine.get("nproc").map_or("?", String::as_str),
            r.machine.get("mem_mib").map_or("?", String::as_str),
        );
    }
    md += "| Services x 10 | service map ceiling (`--service-map-entries`) | first list byte -> all frontends (s) | programming after the list: last list page -> all frontends (s) | start -> /healthz 200 (s) | list pages | VmRSS (MiB) | VmHWM (MiB) | BPF maps (MiB) | whole node: VmRSS + maps (MiB) | CPU at rest (%) | change, agent p50 / p99 (ms) | change, SLI (kubeproxy_network_programming_duration_seconds) p50 / p99 (ms) | change, accepted -> written p50 / p99 (ms) | change, accepted -> in traffic p50 / p99 (ms) | restart on pins -> healthy (s) | restart, first / last list page -> healthy (s) | map writes on restart |\n";
    md +=
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for s in &r.scales {
        let d = |d: &Option<Dist>| {
            d.as_ref().map_or("-".into(), |d| {
                format!("{:.2} / {:.2} (n={})", d.p50_ms, d.p99_ms, d.count)
            })
        };
        md += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} |\n",
            report::thousands(s.services),
            s.service_map_entries
                .map_or("-".into(), |e| report::thousands(e as usize)),
            f(s.list_to_programmed_secs, 3),
            f(s.after_list_to_programmed_secs, 3),
            f(s.start_to_healthy_secs, 2),
            s.list_pages,
            f(s.rss_mib, 1),
            f(s.hwm_mib, 1),
            f(s.map_memory_mib, 1),
            f(s.rss_mib.zip(s.map_memory_mib).map(|(a, b)| a + b), 1),
            f(s.idle_cpu_percent, 2),
            d(&s.change_agent),
            d(&s.change_sli),
            d(&s.change_visible),
            d(&s.change_traffic),
            f(s.restart_to_healthy_secs, 2),
            f(s.restart_list_to_healthy_secs, 2),
            f(s.restart_last_page_to_healthy_secs, 2),
            s.restart_map_writes.map_or("-".into(), |w| w.to_string()),
        );
    }
    let names: Vec<String> = {
        let mut v: Vec<String> = r
            .scales
            .iter()
            .flat_map(|s| s.side_by_side.keys().cloned())
            .collect();
        v.sort();
        v.dedup();
        v
    };
    if !names.is_empty() {
        md += "\n### Programming N Services from nothing, side by side (s)\n\n| Services x 10 | API (first list byte -> all frontends) |";
        for n in &names {
            md += &format!(" {n} |");
        }
        md += " VmRSS API / manifests (MiB) | manifests VmHWM (MiB, peak / steady) |\n|---:|---:|";
        md += &"---:|".repeat(names.len() + 2);
        md += "\n";
        for s in &r.scales {
            md += &format!(
                "| {} | {} |",
                report::thousands(s.services),
                f(s.list_to_programmed_secs, 3)
            );
            let bound = r.config.as_ref().map_or(0.0, |c| c.side_limit_secs);
            for n in &names {
                md += &match s.side_by_side.get(n) {
                    Some(Some(secs)) => format!(" {secs:.3} |"),
                    Some(None) => format!(" > {bound:.0} |"),
                    None => " - |".into(),
                };
            }
            md += &format!(" {} / {} |", f(s.rss_mib, 1), f(s.manifests_rss_mib, 1));
            md += &match (s.manifests_hwm_mib, s.manifests_rss_mib) {
                (Some(hwm), Some(rss)) if rss > 0.0 => format!(" {hwm:.1} ({:.2}x) |\n", hwm / rss),
                (hwm, _) => format!(" {} |\n", f(hwm, 1)),
            };
        }
        let rules: Vec<&String> = names
            .iter()
            .filter(|n| {
                r.scales
                    .iter()
                    .any(|s| s.side_by_side_kernel_mib.contains_key(*n))
            })
            .collect();
        md += "\n### Node memory at N, side by side (MiB)\n\nThis agent: VmRSS + BPF map memory charged (`ebpf_proxy_map_memory_bytes`). kube-proxy: the kernel memory of its rules, charged to a fresh memory cgroup by the commands that loaded them; kube-proxy's own process (not run here) is not included.\n\n| Services x 10 | this agent, API: VmRSS + maps = whole node |";
        for n in &rules {
            md += &format!(" kube-proxy {n}: rules |");
        }
        md += "\n|---:|---:|";
        md += &"---:|".repeat(rules.len());
        md += "\n";
        for s in &r.scales {
            md += &format!(
                "| {} | {} + {} = {} |",
                report::thousands(s.services),
                f(s.rss_mib, 1),
                f(s.map_memory_mib, 1),
                f(s.rss_mib.zip(s.map_memory_mib).map(|(a, b)| a + b), 1)
            );
            for n in &rules {
                md += &match s.side_by_side_kernel_mib.get(*n) {
                    Some(mib) => format!(" {mib:.1} |"),
                    None => " - |".into(),
                };
            }
            md += "\n";
        }
    }
    if !r.nodes.is_empty() {
        md += "\n### Cluster-wide network programming latency (`--nodes K`)\n\n| agents | Services x 10 | changes (rate/s) | accepted -> written on all agents p50 / p90 / p99 (ms) | missing | watch bytes per change (all agents) | VmRSS per agent (MiB) | poll interval (ms) |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        for n in &r.nodes {
            md += &format!(
                "| {} | {} | {} ({}) | {} | {} | {} | {} | {} |\n",
                n.agents,
                report::thousands(n.services),
                n.changes,
                n.rate_per_sec,
                n.cluster.as_ref().map_or("-".into(), |d| format!(
                    "{:.1} / {:.1} / {:.1}",
                    d.p50_ms, d.p90_ms, d.p99_ms
                )),
                n.missing,
                f(n.watch_bytes_per_change, 0),
                f(n.rss_mib_per_agent, 0),
                n.poll_ms
            );
        }
    }
    let errors: Vec<String> = r
        .scales
        .iter()
        .flat_map(|s| {
            s.errors.iter().map(move |e| {
                let e = e.lines().take(2).collect::<Vec<_>>().join(" ");
                format!("- {}: {e}", report::thousands(s.services))
            })
        })
        .chain(r.nodes.iter().flat_map(|n| {
            n.errors
                .iter()
                .map(move |e| format!("- {} agents: {e}", n.agents))
        }))
        .collect();
    if !errors.is_empty() {
        md += "\nNotes and errors:\n\n";
        md += &errors.join("\n");
        md += "\n";
    }
    md
}

/// Two log-log panels: programming time and VmRSS against N.
// Long: one SVG drawing: axes, series and labels in drawing order.
pub fn svg(r: &ApiResults) -> String {
    let mut series: Vec<Line> = Vec::new();
    let pts = |f: &dyn Fn(&ApiScale) -> Option<f64>| -> Vec<(f64, f64)> {
        r.scales
            .iter()
            .filter_map(|s| Some((s.services as f64, f(s)?)))
            .filter(|(_, v)| *v > 0.0)
            .collect()
    };
    series.push((
        "API (list -> frontends)",
        "#d62728",
        pts(&|s| s.list_to_programmed_secs),
        0,
    ));
    series.push((
        "API (last list page -> frontends)",
        "#e377c2",
        pts(&|s| s.after_list_to_programmed_secs),
        0,
    ));
    for (name, colour) in [
        ("manifests", "#ff7f0e"),
        ("iptables-legacy", "#8c564b"),
        ("iptables-nft", "#1f77b4"),
        ("nftables", "#2ca02c"),
    ] {
        series.push((
            name,
            colour,
            pts(&|s| s.side_by_side.get(name).copied().flatten()),
            0,
        ));
    }
    series.push(("API VmRSS", "#d62728", pts(&|s| s.rss_mib), 1));
    series.push(("API VmHWM", "#9467bd", pts(&|s| s.hwm_mib), 1));
    series.push((
        "manifests VmRSS",
        "#ff7f0e",
        pts(&|s| s.manifests_rss_mib),
        1,
    ));
    let (w, h, pw) = (1200.0, 520.0, 560.0);
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="13"><rect width="100%" height="100%" fill="white"/>"#
    );
    for (panel, title, unit) in [
        (
            0,
            "Programming N Services x 10 endpoints from nothing",
            "seconds",
        ),
        (1, "Agent memory after programming", "MiB"),
    ] {
        let ox = 20.0 + panel as f64 * (pw + 40.0);
        let (left, top, pwid, phei) = (ox + 60.0, 40.0, pw - 80.0, h - 120.0);
        let data: Vec<&Line> = series
            .iter()
            .filter(|s| s.3 == panel && !s.2.is_empty())
            .collect();
        let xs: Vec<f64> = data.iter().flat_map(|s| s.2.iter().map(|p| p.0)).collect();
        let ys: Vec<f64> = data.iter().flat_map(|s| s.2.iter().map(|p| p.1)).collect();
        let range = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::MAX, f64::min);
            let hi = v.iter().copied().fold(f64::MIN, f64::max);
            if lo > hi {
                (0.0, 1.0)
            } else {
                ((lo.log10() - 0.2).floor(), (hi.log10() + 0.2).ceil())
            }
        };
        let (x0, x1) = range(&xs);
        let (y0, y1) = range(&ys);
        let px = |x: f64| left + (x.log10() - x0) / (x1 - x0).max(1e-9) * pwid;
        let py = |y: f64| top + phei - (y.log10() - y0) / (y1 - y0).max(1e-9) * phei;
        out += &format!(
            r##"<text x="{}" y="22" font-size="15" font-weight="bold">{title}</text><rect x="{left}" y="{top}" width="{pwid}" height="{phei}" fill="none" stroke="#888"/>"##,
            ox + 10.0
        );
        for e in (x0 as i32)..=(x1 as i32) {
            let x = px(10f64.powi(e));
            out += &format!(
                r##"<line x1="{x}" y1="{top}" x2="{x}" y2="{}" stroke="#eee"/><text x="{x}" y="{}" text-anchor="middle">{}</text>"##,
                top + phei,
                top + phei + 18.0,
                report::thousands(10usize.pow(e.max(0) as u32))
            );
        }
        for e in (y0 as i32)..=(y1 as i32) {
            let y = py(10f64.powi(e));
            out += &format!(
                r##"<line x1="{left}" y1="{y}" x2="{}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                left + pwid,
                left - 6.0,
                y + 4.0,
                10f64.powi(e)
            );
        }
        out += &format!(
            r#"<text x="{}" y="{}" text-anchor="middle">Services (log scale)</text><text x="{}" y="{}" transform="rotate(-90 {} {})" text-anchor="middle">{unit} (log scale)</text>"#,
            left + pwid / 2.0,
            top + phei + 40.0,
            ox + 14.0,
            top + phei / 2.0,
            ox + 14.0,
            top + phei / 2.0
        );
        for (li, (label, colour, points, _)) in data.iter().enumerate() {
            let path: Vec<String> = points
                .iter()
                .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
                .collect();
            out += &format!(
                r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2.5"/>"#,
                path.join(" ")
            );
            for (x, y) in points {
                out += &format!(
                    r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{colour}"/>"#,
                    px(*x),
                    py(*y)
                );
            }
            let ly = h - 50.0 + (li / 2) as f64 * 18.0;
            let lx = left + (li % 2) as f64 * 240.0;
            out += &format!(
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="3"/><text x="{}" y="{}">{label}</text>"#,
                lx + 24.0,
                lx + 30.0,
                ly + 4.0
            );
        }
    }
    out += "</svg>\n";
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_and_plot_render() {
        let r = ApiResults {
            scales: vec![ApiScale {
                services: 1000,
                service_map_entries: Some(1 << 20),
                list_to_programmed_secs: Some(0.2),
                after_list_to_programmed_secs: Some(0.05),
                rss_mib: Some(30.0),
                change_agent: Dist::from_secs(&[0.001, 0.002, 0.003]),
                ..ApiScale::default()
            }],
            ..ApiResults::default()
        };
        let md = markdown(&r);
        assert!(md.contains("| 1,000 | 1,048,576 | 0.200 | 0.050 |"), "{md}");
        assert!(md.contains("2.00 / 3.00 (n=3)"), "{md}");
        assert!(svg(&r).contains("<polyline"));
    }
}
