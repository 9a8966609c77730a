//! `cargo xtask bench --api`: the control plane over the Kubernetes API, the path every
//! cluster uses. The fake kube-apiserver of `proxy-testbed` (paged lists like
//! kube-apiserver's, watches with bookmarks) runs in this process on 127.0.0.1; the real
//! `proxy-agent run --kubeconfig` runs in this machine's network namespace with
//! `--interfaces none --cleanup-kube-proxy=false`, its own bpffs pin directory and its own
//! empty child cgroup (no process joins it: no traffic goes through the bench's hooks).
//!
//! Per N (Services x 10 endpoints, one TCP port each):
//! - **program**: the objects are in the apiserver before the agent starts; timed from the
//!   first byte of the first list page (Services or EndpointSlices, whichever is first) to
//!   the agent's `programmed_frontends` gauge reaching N (the gauge is set after the sync's
//!   map writes), and from the process start to `/healthz` 200;
//! - **memory and CPU**: VmRSS and VmHWM once programmed, CPU time over an idle window;
//! - **changes**: `changes` single endpoint changes, one at a time, spaced past the
//!   agent's minimum sync interval: the agent's `network_programming_duration_seconds`
//!   for each (from its histogram's sum, when exactly one observation was added), and the
//!   time from the apiserver accepting the write to the agent reporting it written;
//! - **restart**: SIGTERM, then a new agent on the same pins: time to healthy and the map
//!   writes of its first sync (the `ops` of its `sync` debug log line);
//! - **side by side** (N within the datapath bench's address plan): the manifests path
//!   (the same agent with `--manifests`), and kube-proxy's iptables (legacy and nft
//!   backends) and nftables rule loads at the same N, through the datapath bench's modes.
//!
//! `--nodes K`: K agents against one apiserver holding `churn_services` Services; after all
//! are healthy, endpoint changes at `churn_rate` per second for `churn_secs`, each adding a
//! fresh endpoint address to one Service, so every agent's `programmed_backends` gauge
//! rises by one per change written. A poller thread per agent reads its `/metrics`; a
//! change is "on all K agents" at the first poll of the last agent that shows it. Reported:
//! p50/p90/p99 of apiserver-accepted -> written on all K, and watch bytes per change (all
//! K watches together, bookmarks included).
//!
//!
//! Layout: this file runs the parts and saves the results; `results.rs` what a run does
//! and records; `objects.rs` the address plan, the objects and the loaded apiserver;
//! `agent.rs` one agent process and the run's directories; `scale.rs` one N (program,
//! rest, single changes, restart, side by side); `nodes.rs` the K agents; `report.rs`
//! the tables and the plot.

mod agent;
mod nodes;
mod objects;
mod report;
mod results;
mod scale;
mod traffic;

use std::{
    collections::BTreeMap,
    fs,
    path::Path,
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Result;

use super::{log, modes::Ctx, report::thousands};
use nodes::nodes;
use report::{markdown, svg};
pub use results::ApiConfig;
use results::{ApiResults, ApiScale, NodesRun};
use scale::one_scale;

pub fn run(cfg: &ApiConfig, ctx: &Ctx, out_dir: &Path) -> Result<()> {
    let start = Instant::now();
    let mut results = ApiResults {
        config: Some(cfg.clone()),
        machine: super::machine(),
        started_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        ..ApiResults::default()
    };
    let mut gave_up = BTreeMap::new();
    for &n in &cfg.scales {
        log(start, format!("== API: {} services ==", thousands(n)));
        let mut scale = ApiScale {
            services: n,
            ..ApiScale::default()
        };
        if let Err(e) = one_scale(cfg, ctx, n, &mut scale, &mut gave_up, start) {
            log(start, format!("  failed: {e:#}"));
            scale.errors.push(format!("{e:#}"));
        }
        results.scales.push(scale);
        save(&results, out_dir)?;
    }
    for &k in &cfg.nodes {
        log(
            start,
            format!(
                "== API: {k} agents, {} services, {} changes/s ==",
                thousands(cfg.churn_services),
                cfg.churn_rate
            ),
        );
        let mut run = NodesRun {
            agents: k,
            services: cfg.churn_services,
            rate_per_sec: cfg.churn_rate,
            poll_ms: cfg.poll_ms.max(k as u64 / 3),
            ..NodesRun::default()
        };
        if let Err(e) = nodes(cfg, ctx, k, &mut run, start) {
            log(start, format!("  failed: {e:#}"));
            run.errors.push(format!("{e:#}"));
        }
        if run.missing > 0 {
            // A change that never reached every agent within the bound is an error, not
            // only a count: the agents did not do what the run measures.
            let e = format!(
                "{} of {} changes never reached all {k} agents within 60 s",
                run.missing, run.changes
            );
            log(start, format!("  {e}"));
            run.errors.push(e);
        }
        results.nodes.push(run);
        save(&results, out_dir)?;
    }
    let md = markdown(&results);
    println!("{md}");
    log(start, format!("results in {}", out_dir.display()));
    // `--quick` runs inside `cargo xtask test`: no thresholds, but a part that failed
    // (the bench rotting, or the agent not doing what it measures) fails the test.
    let failed: Vec<&String> = results
        .scales
        .iter()
        .flat_map(|s| &s.errors)
        .chain(results.nodes.iter().flat_map(|r| &r.errors))
        .collect();
    if cfg.quick && !failed.is_empty() {
        anyhow::bail!("the quick API bench had errors: {failed:?}");
    }
    Ok(())
}

fn save(results: &ApiResults, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)?;
    fs::write(
        dir.join("api-results.json"),
        serde_json::to_string_pretty(results)?,
    )?;
    fs::write(dir.join("api-results.md"), markdown(results))?;
    fs::write(dir.join("api-scaling.svg"), svg(results))?;
    Ok(())
}
