//! `cargo xtask bench-report`: the tables of docs/benchmarks.md that quote the datapath
//! bench's committed run (docs/bench/results.json), generated from that JSON so that the
//! page and the data cannot diverge. Each table sits between the markers
//! `<!-- bench-report:NAME -->` and `<!-- bench-report:end -->`; the generator replaces
//! what is between them, and the test below fails when the page differs from what the
//! committed JSON gives (a table edited by hand, or a JSON committed without
//! `cargo xtask bench-report`).

use std::path::Path;

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use super::report::thousands;

/// The page, and the run its generated tables quote (paths from the workspace root).
pub const DOC: &str = "docs/benchmarks.md";
pub const RESULTS: &str = "docs/bench/results.json";

/// The scale of the headline table.
const HEADLINE_SERVICES: u64 = 10_000;

/// A generated table: its marker name and its renderer.
type Render = fn(&Run) -> Result<String>;
const BLOCKS: [(&str, Render); 5] = [
    ("headline", headline),
    ("tcp-latency", tcp_latency),
    ("udp-latency", udp_latency),
    ("program", program),
    ("change", change),
];

fn begin(name: &str) -> String {
    format!(
        "<!-- bench-report:{name} (generated from {RESULTS} by `cargo xtask bench-report`) -->\n"
    )
}
const END: &str = "<!-- bench-report:end -->";

/// `cargo xtask bench-report`: rewrites the generated tables of [`DOC`] from [`RESULTS`].
pub fn main(root: &Path) -> Result<()> {
    let doc_path = root.join(DOC);
    let doc = std::fs::read_to_string(&doc_path).with_context(|| format!("reading {DOC}"))?;
    let json = read_json(&root.join(RESULTS))?;
    let new = regenerate(&doc, &json)?;
    if new == doc {
        println!("{DOC}: the generated tables already match {RESULTS}");
    } else {
        std::fs::write(&doc_path, &new).with_context(|| format!("writing {DOC}"))?;
        println!("{DOC}: the generated tables rewritten from {RESULTS}");
    }
    // The packet-rate tables are written by hand (their path column is prose): checked.
    let pps = read_json(&root.join(PPS_RESULTS))?;
    let diffs = check_pps_tables(&new, &pps)?;
    if !diffs.is_empty() {
        bail!(
            "{DOC}: the packet-rate tables differ from {PPS_RESULTS}:\n{}",
            diffs.join("\n")
        );
    }
    println!("{DOC}: the packet-rate tables match {PPS_RESULTS}");
    Ok(())
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// `doc` with every generated table replaced by the one `json` gives. Every block must be
/// there (a page without one is an error naming it).
pub fn regenerate(doc: &str, json: &Value) -> Result<String> {
    let run = Run(json);
    let mut out = doc.to_string();
    for (name, render) in BLOCKS {
        let open = begin(name);
        let Some(start) = out.find(&open) else {
            bail!("{DOC}: no `{}` marker", open.trim_end());
        };
        let body_at = start + open.len();
        let Some(len) = out[body_at..].find(END) else {
            bail!("{DOC}: the `{name}` block has no `{END}`");
        };
        let body = render(&run).with_context(|| format!("table `{name}`"))?;
        out.replace_range(body_at..body_at + len, &body);
    }
    Ok(out)
}

/// The run's JSON (`results.json` of `cargo xtask bench`).
struct Run<'a>(&'a Value);

/// One mode at one scale.
struct Cell<'a>(&'a Value);

impl<'a> Run<'a> {
    fn scales(&self) -> Vec<u64> {
        self.0["scales"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["services"].as_u64())
            .collect()
    }

    fn cell(&self, services: u64, mode: &str) -> Result<Cell<'a>> {
        self.0["scales"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["services"].as_u64() == Some(services))
            .and_then(|s| s["modes"].as_array())
            .into_iter()
            .flatten()
            .find(|m| m["mode"].as_str() == Some(mode))
            .map(Cell)
            .with_context(|| format!("no mode {mode} at {services} services"))
    }

    fn program_limit(&self) -> f64 {
        self.0["meta"]["config"]["program_limit_secs"]
            .as_f64()
            .unwrap_or(300.0)
    }
}

impl Cell<'_> {
    fn ok(&self) -> bool {
        self.0["status"].as_str() == Some("ok")
    }
    fn gave_up(&self) -> bool {
        self.0["status"].as_str() == Some("gave_up")
    }
    /// Gave up at this very scale (its reason names it), not at a smaller one.
    fn gave_up_at(&self, services: u64) -> bool {
        self.gave_up()
            && self.0["reason"].as_str().is_some_and(|r| {
                r.starts_with(&format!(
                    "programming {} services",
                    thousands(services as usize)
                ))
            })
    }

    fn get(&self, path: &[&str]) -> Option<f64> {
        let mut v = &self.0["summary"];
        for p in path {
            v = &v[*p];
        }
        v.as_f64()
    }
}

/// `a / b`, as the page writes ratios.
fn ratio(a: Option<f64>, b: Option<f64>) -> Option<String> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(format!("{:.2}×", a / b)),
        _ => None,
    }
}

/// The headline's columns: (title, mode, ours).
const HEADLINE_MODES: [(&str, &str, bool); 5] = [
    ("ebpf-proxy socket hooks", "socket", true),
    ("ebpf-proxy TC", "tc", true),
    ("kube-proxy iptables (legacy)", "iptables-legacy", false),
    ("kube-proxy nftables", "nftables", false),
    ("kube-proxy iptables (nft backend)", "iptables-nft", false),
];

// Long: the page's headline: one text template filled from the run's results.
fn headline(run: &Run) -> Result<String> {
    let n = HEADLINE_SERVICES;
    let direct = run.cell(n, "direct")?;
    let secs = run.0["meta"]["duration_seconds"]
        .as_f64()
        .context("meta.duration_seconds")?;
    let mut s = format!(
        "One full run of `cargo xtask bench` (all modes, all scales, {} s):\n\n|",
        thousands(secs.round() as usize)
    );
    for (title, _, _) in HEADLINE_MODES {
        s += &format!(" | {title}");
    }
    s += " |\n|---|";
    s += &"---:|".repeat(HEADLINE_MODES.len());
    s += "\n";
    // `value = ratio`, the ratio bold for ours, "× direct" in the first column.
    let fmt = |first: bool, ours: bool, value: Option<String>, r: Option<String>| {
        let r = r.map(|r| if first { format!("{r} direct") } else { r });
        match (value, r) {
            (Some(v), Some(r)) if ours => format!("{v} = **{r}**"),
            (Some(v), Some(r)) => format!("{v} = {r}"),
            (None, Some(r)) if ours => format!("**{r}**"),
            (None, Some(r)) => r,
            _ => "–".into(),
        }
    };
    type Row = (
        &'static str,
        fn(&Cell, &Cell) -> (Option<String>, Option<String>),
    );
    let rows: [Row; 4] = [
        ("TCP connect + request/response, p50", |c, d| {
            let v = c.get(&["tcp", "p50_us"]);
            (
                v.map(|v| format!("{v:.1} µs")),
                ratio(v, d.get(&["tcp", "p50_us"])),
            )
        }),
        ("UDP request/response (new socket), p50", |c, d| {
            let v = c.get(&["udp", "p50_us"]);
            (
                v.map(|v| format!("{v:.1} µs")),
                ratio(v, d.get(&["udp", "p50_us"])),
            )
        }),
        ("connections/s, 2 clients", |c, d| {
            let v = c.get(&["connections_per_second"]);
            (
                v.map(|v| thousands(v.round() as usize)),
                ratio(v, d.get(&["connections_per_second"])),
            )
        }),
        ("bulk TCP, one stream", |c, d| {
            let v = c.get(&["bulk_gbit_per_second"]);
            (None, ratio(v, d.get(&["bulk_gbit_per_second"])))
        }),
    ];
    for (i, (title, f)) in rows.iter().enumerate() {
        s += &format!("| {title} |");
        for (col, (_, mode, ours)) in HEADLINE_MODES.iter().enumerate() {
            let c = run.cell(n, mode)?;
            let text = if c.ok() {
                let (v, r) = f(&c, &direct);
                fmt(col == 0, *ours, v, r)
            } else if c.gave_up() && i == 0 {
                format!("gave up: rules not loaded in {:.0} s", run.program_limit())
            } else {
                "–".into()
            };
            s += &format!(" {text} |");
        }
        s += "\n";
    }
    s += &format!(
        "| program all {} services from nothing |",
        thousands(n as usize)
    );
    for (_, mode, ours) in HEADLINE_MODES {
        let c = run.cell(n, mode)?;
        let text = match c.get(&["program_seconds"]) {
            Some(v) if c.ok() => {
                let v = if v < 10.0 {
                    format!("{v:.1} s")
                } else {
                    format!("{v:.0} s")
                };
                if ours {
                    format!("**{v}**")
                } else {
                    v
                }
            }
            _ if c.gave_up() => format!("> {:.0} s", run.program_limit()),
            _ => "–".into(),
        };
        s += &format!(" {text} |");
    }
    s += "\n| one endpoint change, until traffic reaches the new endpoint |";
    for (_, mode, ours) in HEADLINE_MODES {
        let c = run.cell(n, mode)?;
        let text = match c.get(&["change_visible_ms"]) {
            Some(v) if c.ok() => {
                let v = format!("{} ms", thousands(v.round() as usize));
                if ours {
                    format!("**{v}**")
                } else {
                    v
                }
            }
            _ => "–".into(),
        };
        s += &format!(" {text} |");
    }
    s += "\n";
    Ok(s)
}

/// A table of one figure per mode and scale: `title` in the corner, `rows` of
/// (label, mode), `cell` the figure of an `ok` mode.
fn per_scale(
    run: &Run,
    title: &str,
    rows: &[(&str, &str)],
    cell: &dyn Fn(&Cell, u64) -> Result<Option<String>>,
    gave_up: &dyn Fn(&Cell, u64) -> String,
) -> Result<String> {
    let scales = run.scales();
    let mut s = format!("| {title} |");
    for n in &scales {
        s += &format!(" {} |", thousands(*n as usize));
    }
    s += "\n|---|";
    s += &"---:|".repeat(scales.len());
    s += "\n";
    for (label, mode) in rows {
        s += &format!("| {label} |");
        for n in &scales {
            let c = run.cell(*n, mode)?;
            let text = if c.ok() {
                cell(&c, *n)?.unwrap_or_else(|| "–".into())
            } else if c.gave_up() {
                gave_up(&c, *n)
            } else {
                "–".into()
            };
            s += &format!(" {text} |");
        }
        s += "\n";
    }
    Ok(s)
}

const LATENCY_ROWS: [(&str, &str); 5] = [
    ("socket (ours)", "socket"),
    ("tc (ours)", "tc"),
    ("iptables-legacy", "iptables-legacy"),
    ("iptables-nft", "iptables-nft"),
    ("nftables", "nftables"),
];

fn latency(run: &Run, title: &str, proto: &'static str) -> Result<String> {
    per_scale(
        run,
        title,
        &LATENCY_ROWS,
        &|c, n| {
            let d = run.cell(n, "direct")?;
            Ok(ratio(c.get(&[proto, "p50_us"]), d.get(&[proto, "p50_us"])))
        },
        &|_, _| "gave up".into(),
    )
}

fn tcp_latency(run: &Run) -> Result<String> {
    latency(run, "TCP connect+request p50, × direct", "tcp")
}

fn udp_latency(run: &Run) -> Result<String> {
    latency(run, "UDP request/response p50, × direct", "udp")
}

fn program(run: &Run) -> Result<String> {
    per_scale(
        run,
        "program all N services from nothing (s)",
        &[
            (
                "socket (ours: manifest written -> all frontends in the maps)",
                "socket",
            ),
            ("tc (ours, same agent in the node namespace)", "tc"),
            (
                "iptables-legacy (`iptables-restore --noflush`)",
                "iptables-legacy",
            ),
            (
                "iptables-nft (`iptables-nft-restore --noflush`)",
                "iptables-nft",
            ),
            ("nftables (`nft -f`)", "nftables"),
        ],
        &|c, _| {
            Ok(c.get(&["program_seconds"]).map(|v| {
                if v < 10.0 {
                    format!("{v:.3}")
                } else {
                    format!("{v:.1}")
                }
            }))
        },
        &|c, n| {
            // Over the bound at this scale, or not attempted after giving up at a smaller one.
            if c.gave_up_at(n) {
                format!("> {:.0}", run.program_limit())
            } else {
                "not run".into()
            }
        },
    )
}

fn change(run: &Run) -> Result<String> {
    per_scale(
        run,
        "one endpoint change, until visible through traffic (ms)",
        &[
            ("socket (ours)", "socket"),
            ("tc (ours)", "tc"),
            (
                "iptables-legacy (partial `iptables-restore --noflush`)",
                "iptables-legacy",
            ),
            (
                "iptables-nft (partial `iptables-nft-restore --noflush`)",
                "iptables-nft",
            ),
            ("nftables (one `nft -f` transaction)", "nftables"),
        ],
        &|c, _| {
            Ok(c.get(&["change_visible_ms"]).map(|v| {
                if v < 1000.0 {
                    format!("{v:.1}")
                } else {
                    thousands(v.round() as usize)
                }
            }))
        },
        &|_, _| "–".into(),
    )
}

/// The packet-rate run the page quotes, and the header its two tables start with.
pub const PPS_RESULTS: &str = "docs/bench-pps/pps-results.json";
const PPS_HEADER: &str = "| mode | Mpps received (median of 5; min-max) |";

/// Checks the packet-rate tables of the page (the remote and the local form, in that
/// order: the rows whose header starts with [`PPS_HEADER`]) against `json`: per mode, the
/// median and the rounds' min-max (3 decimals), and every `× ...` column (2 decimals);
/// returns the differences.
pub fn check_pps_tables(doc: &str, json: &Value) -> Result<Vec<String>> {
    let mut diffs = Vec::new();
    let tables: Vec<&Value> = json["tables"].as_array().into_iter().flatten().collect();
    let mut starts = doc.match_indices(PPS_HEADER).map(|(i, _)| i);
    for (t, form) in tables.iter().zip(["remote", "local"]) {
        if t["form"].as_str() != Some(form) {
            bail!("{PPS_RESULTS}: tables out of order ({form} expected)");
        }
        let start = starts
            .next()
            .with_context(|| format!("{DOC}: no {form} packet-rate table ({PPS_HEADER})"))?;
        let mut lines = doc[start..].lines().take_while(|l| l.starts_with('|'));
        let header: Vec<String> = cells(lines.next().unwrap_or(""));
        lines.next(); // |---|
        let mut seen = 0;
        for line in lines {
            let row = cells(line);
            let mode = row[0].split_whitespace().next().unwrap_or("").to_string();
            let Some(m) = t["modes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|m| m["mode"].as_str() == Some(&mode))
            else {
                diffs.push(format!("{form}: mode {mode} is not in {PPS_RESULTS}"));
                continue;
            };
            seen += 1;
            let mpps: Vec<f64> = m["rounds"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r["mpps"].as_f64())
                .collect();
            let (lo, hi) = mpps
                .iter()
                .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
            let want = format!(
                "{:.3} ({lo:.3}-{hi:.3})",
                m["mpps"].as_f64().unwrap_or(f64::NAN)
            );
            if row.get(1) != Some(&want) {
                diffs.push(format!("{form} {mode}: Mpps {:?}, JSON {want}", row.get(1)));
            }
            for (col, title) in header.iter().enumerate() {
                let key = match title.as_str() {
                    "× plain forwarding" => "ratio_to_direct",
                    "× plain XDP forwarding" => "ratio_to_xdp_fwd",
                    "× iptables-legacy" => "ratio_to_iptables",
                    "× our TC" => "ratio_to_tc",
                    _ => continue,
                };
                let want = m[key].as_f64().map(|r| format!("{r:.2}×"));
                let got = row.get(col).cloned();
                if got != want {
                    diffs.push(format!("{form} {mode}: {title} {got:?}, JSON {want:?}"));
                }
            }
        }
        if seen == 0 {
            diffs.push(format!("{form}: no row"));
        }
    }
    Ok(diffs)
}

/// A markdown row's cells, trimmed, without bold markers.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner
        .split('|')
        .map(|c| c.trim().replace("**", ""))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }

    /// Every generated table of docs/benchmarks.md is what docs/bench/results.json gives
    /// (regenerate with `cargo xtask bench-report` after committing a new run).
    #[test]
    fn the_benchmark_pages_tables_equal_the_committed_json() {
        let doc = std::fs::read_to_string(root().join(DOC)).expect("docs/benchmarks.md");
        let json = read_json(&root().join(RESULTS)).expect("results.json");
        let new = regenerate(&doc, &json).expect("every block present");
        if new != doc {
            let (a, b): (Vec<&str>, Vec<&str>) = (doc.lines().collect(), new.lines().collect());
            let diff: Vec<String> = a
                .iter()
                .zip(&b)
                .filter(|(x, y)| x != y)
                .take(5)
                .map(|(x, y)| format!("page: {x}\njson: {y}"))
                .collect();
            panic!(
                "{DOC} differs from {RESULTS} (run `cargo xtask bench-report`):\n{}",
                diff.join("\n")
            );
        }
    }

    /// The generator itself: the headline's figures from a JSON with known values, in
    /// the page's rounding.
    #[test]
    fn headline_figures_are_the_jsons_in_the_pages_rounding() {
        let mode = |name: &str, status: &str, tcp: f64, cps: f64, prog: f64, change: f64| {
            serde_json::json!({"mode": name, "status": status, "summary": {
                "tcp": {"p50_us": tcp}, "udp": {"p50_us": tcp / 4.0},
                "connections_per_second": cps, "bulk_gbit_per_second": 17.0,
                "program_seconds": prog, "change_visible_ms": change}})
        };
        let json = serde_json::json!({
            "meta": {"duration_seconds": 1100.6, "config": {"program_limit_secs": 300.0}},
            "scales": [{"services": 10000, "modes": [
                mode("direct", "ok", 74.0, 13416.0, 0.0, 0.0),
                mode("socket", "ok", 75.1, 13395.2, 2.2256, 128.08),
                mode("tc", "ok", 81.75, 12170.9, 2.23, 138.2),
                mode("iptables-legacy", "ok", 114.672, 8558.4, 4.5529, 1239.29),
                mode("nftables", "ok", 86.53, 11699.4, 90.4, 479.94),
                {"mode": "iptables-nft", "status": "gave_up", "summary": {}},
            ]}]
        });
        let t = headline(&Run(&json)).expect("table");
        assert!(
            t.starts_with("One full run of `cargo xtask bench` (all modes, all scales, 1,101 s):"),
            "{t}"
        );
        assert!(t.contains("| TCP connect + request/response, p50 | 75.1 µs = **1.01× direct** | 81.8 µs = **1.10×** | 114.7 µs = 1.55× | 86.5 µs = 1.17× | gave up: rules not loaded in 300 s |"), "{t}");
        assert!(t.contains("| connections/s, 2 clients | 13,395 = **1.00× direct** | 12,171 = **0.91×** | 8,558 = 0.64× | 11,699 = 0.87× | – |"), "{t}");
        assert!(t.contains("| program all 10,000 services from nothing | **2.2 s** | **2.2 s** | 4.6 s | 90 s | > 300 s |"), "{t}");
        assert!(t.contains("| one endpoint change, until traffic reaches the new endpoint | **128 ms** | **138 ms** | 1,239 ms | 480 ms | – |"), "{t}");
    }

    /// The packet-rate tables quote docs/bench-pps/pps-results.json: every median, min-max
    /// and ratio as the JSON gives it.
    #[test]
    fn the_packet_rate_tables_equal_the_committed_json() {
        let doc = std::fs::read_to_string(root().join(DOC)).expect("docs/benchmarks.md");
        let json = read_json(&root().join(PPS_RESULTS)).expect("pps-results.json");
        let diffs = check_pps_tables(&doc, &json).expect("both tables");
        assert!(
            diffs.is_empty(),
            "{DOC} vs {PPS_RESULTS}:\n{}",
            diffs.join("\n")
        );
    }

    #[test]
    fn a_packet_rate_row_that_differs_is_reported() {
        let json = serde_json::json!({"tables": [
            {"form": "remote", "modes": [{"mode": "xdp", "mpps": 0.348, "ratio_to_tc": 1.82,
              "rounds": [{"mpps": 0.332}, {"mpps": 0.394}, {"mpps": 0.348}]}]},
        ]});
        let doc = format!("{PPS_HEADER} × our TC |\n|---|---:|---:|\n| **xdp** (ours) | **0.348** (0.332-0.394) | **1.82×** |\n");
        assert!(check_pps_tables(&doc, &json).expect("table").is_empty());
        let doc = doc.replace("1.82×", "1.49×");
        let diffs = check_pps_tables(&doc, &json).expect("table");
        assert_eq!(diffs.len(), 1, "{diffs:?}");
        assert!(diffs[0].contains("× our TC"), "{diffs:?}");
    }

    #[test]
    fn a_page_without_a_block_is_an_error_naming_it() {
        let json = serde_json::json!({});
        let e = regenerate("no markers here", &json).expect_err("missing block");
        assert!(e.to_string().contains("bench-report:headline"), "{e}");
    }
}
