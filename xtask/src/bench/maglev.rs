//! The Maglev part of `cargo xtask bench`: the fraction of 100,000 flows that change
//! backend when one of N backends leaves (N = 10, 100) and when one is added, against
//! the ideal 1/N. Pure computation by the agent's own table code (the hidden
//! `proxy-agent maglev-disruption`), at the default table size M = 16,381 and at the
//! largest, 131,071, with Maglev's population fill, and at 16,381 with the bounded
//! fill (`--maglev-fill bounded`); a few seconds, so `--quick` runs it too. Written to `maglev.md`
//! and `maglev.json` in the output directory.

use std::{path::Path, process::Command};

use anyhow::{bail, Context as _, Result};

/// One measured row.
#[derive(Debug, serde::Deserialize, serde::Serialize)]
pub struct Row {
    pub table_size: u32,
    /// `--maglev-fill`: `population` (Maglev's) or `bounded`.
    #[serde(default)]
    pub fill: String,
    pub backends: usize,
    pub flows: usize,
    pub moved_on_leave: f64,
    pub moved_on_add: f64,
    pub ideal: f64,
    pub seconds: f64,
}

/// Runs the computation with the release agent in `bin_dir`; returns the rows and the
/// Markdown table.
pub fn run(bin_dir: &Path, out_dir: &Path) -> Result<(Vec<Row>, String)> {
    let mut rows = Vec::new();
    for (m, fill) in [
        ("16381", "population"),
        ("131071", "population"),
        ("16381", "bounded"),
    ] {
        let out = Command::new(bin_dir.join("proxy-agent"))
            .args(["maglev-disruption", "--table-size", m, "--flows", "100000"])
            .args(["--backends", "10,100", "--fill", fill])
            .output()
            .context("running proxy-agent maglev-disruption")?;
        if !out.status.success() {
            bail!(
                "proxy-agent maglev-disruption failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            rows.push(serde_json::from_str::<Row>(line).with_context(|| format!("{line:?}"))?);
        }
    }
    let md = table(&rows);
    std::fs::write(out_dir.join("maglev.md"), &md).context("writing maglev.md")?;
    std::fs::write(
        out_dir.join("maglev.json"),
        serde_json::to_string_pretty(&rows)?,
    )
    .context("writing maglev.json")?;
    Ok((rows, md))
}

fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| fill | M | N | flows | moved when one leaves | x ideal | moved when one is added | x ideal (1/(N+1)) | target <= 1.2/N |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for r in rows {
        let ideal_add = 1.0 / (r.backends as f64 + 1.0);
        let ok = r.moved_on_leave <= 1.2 * r.ideal && r.moved_on_add <= 1.2 * r.ideal;
        s += &format!(
            "| {} | {} | {} | {} | {:.2}% | {:.2} | {:.2}% | {:.2} | {} |\n",
            r.fill,
            r.table_size,
            r.backends,
            r.flows,
            100.0 * r.moved_on_leave,
            r.moved_on_leave / r.ideal,
            100.0 * r.moved_on_add,
            r.moved_on_add / ideal_add,
            if ok { "met" } else { "not met" }
        );
    }
    s
}
