//! The packet-rate part's Markdown: its two tables, the targets, the `BPF_PROG_RUN`
//! table.

use super::results::{Form, PpsResults, PpsTable};

impl PpsResults {
    pub fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "## Packet rate: 64-byte UDP, one flow, client ns -> node ns -> pod ns\n"
        );
        for p in &self.pinning {
            let _ = writeln!(s, "- {p}");
        }
        for t in &self.tables {
            s.push_str(&t.markdown());
        }
        if let Some(p) = &self.prog_run {
            s.push_str(&prog_run_markdown(p));
        }
        if let Some(e) = &self.prog_run_error {
            let _ = writeln!(s, "\nBPF_PROG_RUN part failed: {e}");
        }
        s
    }
}

impl PpsTable {
    // Long: the pps page: one markdown template filled from the results.
    fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let remote = self.form == Form::Remote;
        let _ = writeln!(s, "\n### {}\n", self.title);
        let _ = writeln!(
            s,
            "| mode | Mpps received (median) | × plain forwarding |{} × iptables-legacy | × our TC | program on cli0, ns/packet (live) | path taken (cli0's XDP counters, node's IP forwarding) | offered (Mpps) | rounds |\n|---|---:|---:|{}---:|---:|---:|---|---:|---:|",
            if remote { " × plain XDP forwarding (next hop fixed) |" } else { "" },
            if remote { "---:|" } else { "" }
        );
        let r = |v: Option<f64>| v.map_or("–".into(), |r| format!("{r:.2}×"));
        for m in &self.modes {
            if !m.available {
                let _ = writeln!(
                    s,
                    "| {} | {} | – |{} – | – | – | – | – | 0 |",
                    m.mode,
                    m.reason.as_deref().unwrap_or("not available"),
                    if remote { " – |" } else { "" }
                );
                continue;
            }
            let f = |v: Option<f64>, d: usize| v.map_or("–".into(), |v| format!("{v:.d$}"));
            let mut path = m.verdict.clone().unwrap_or_else(|| "–".into());
            if let Some(x) = m
                .rounds
                .iter()
                .rev()
                .find(|r| r.error.is_none())
                .and_then(|r| r.xdp_stats.as_ref().map(|x| (x, r.received)))
            {
                let counts: Vec<String> = x.0.iter().map(|(k, v)| format!("{k} +{v}")).collect();
                let _ = write!(
                    path,
                    "; XDP_STATS {} (pod received {})",
                    if counts.is_empty() {
                        "unchanged".into()
                    } else {
                        counts.join(", ")
                    },
                    x.1
                );
            }
            if let Some(flags) = &m.frontend_flags {
                let _ = write!(path, "; backend choice: {flags}");
            }
            let _ = writeln!(
                s,
                "| {} | {} | {} |{} {} | {} | {} | {} | {} | {} |",
                m.mode,
                f(m.mpps, 3),
                r(m.ratio_to_direct),
                if remote {
                    format!(" {} |", r(m.ratio_to_xdp_fwd))
                } else {
                    String::new()
                },
                r(m.ratio_to_iptables),
                r(m.ratio_to_tc),
                f(m.program_ns, 0),
                path,
                f(m.offered_mpps, 2),
                m.rounds.iter().filter(|r| r.error.is_none()).count()
            );
        }
        if remote {
            let xdp = self.modes.iter().find(|m| m.mode == "xdp");
            let target = |what: &str, got: Option<f64>, want: f64| {
                got.map_or(format!("- {what}: not measured\n"), |g| {
                    format!(
                        "- {what}: {g:.2}× (target >= {want}×): {}\n",
                        if g >= want { "met" } else { "missed" }
                    )
                })
            };
            let _ = writeln!(s, "\nIssue 15's targets (our XDP, random):\n");
            s.push_str(&target(
                "XDP vs iptables-legacy",
                xdp.and_then(|m| m.ratio_to_iptables),
                4.0,
            ));
            s.push_str(&target(
                "XDP vs our TC",
                xdp.and_then(|m| m.ratio_to_tc),
                2.0,
            ));
            s.push_str(&target(
                "XDP vs plain XDP forwarding (next hop fixed)",
                xdp.and_then(|m| m.ratio_to_xdp_fwd),
                0.8,
            ));
        }
        s
    }
}

fn prog_run_markdown(v: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let repeat = v.get("repeat").and_then(|r| r.as_u64()).unwrap_or(0);
    let _ = writeln!(
        s,
        "\n### BPF_PROG_RUN, ns per packet (repeat {repeat}, median of {} runs)\n",
        v.get("runs").and_then(|r| r.as_u64()).unwrap_or(0)
    );
    let _ = writeln!(
        s,
        "| program | case | services | ns/packet (BPF_PROG_RUN) | ns/packet (program alone) | verdict |\n|---|---|---:|---:|---:|---:|"
    );
    for r in v
        .get("results")
        .and_then(|r| r.as_array())
        .into_iter()
        .flatten()
    {
        let g = |k: &str| r.get(k).cloned().unwrap_or_default();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            g("program").as_str().unwrap_or(""),
            g("case").as_str().unwrap_or(""),
            crate::bench::report::thousands(g("services").as_u64().unwrap_or(0) as usize),
            g("ns_per_packet")
                .as_f64()
                .map_or("–".into(), |n| format!("{n:.1}")),
            g("program_ns")
                .as_f64()
                .map_or("–".into(), |n| format!("{n:.1}")),
            g("verdict")
        );
    }
    if let Some(missing) = v.get("not_measured").and_then(|m| m.as_str()) {
        let _ = writeln!(s, "\n{missing}");
    }
    s
}
