//! What one `--api` run does ([`ApiConfig`]) and what it records: the figures per N
//! ([`ApiScale`]), per `--nodes K` run ([`NodesRun`]), as distributions ([`Dist`]).

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::bench::stats;

/// What one `--api` run does.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApiConfig {
    pub quick: bool,
    pub scales: Vec<usize>,
    pub changes: usize,
    pub idle_secs: f64,
    pub side_by_side: bool,
    pub nodes: Vec<usize>,
    pub churn_services: usize,
    pub churn_rate: f64,
    pub churn_secs: f64,
    /// The poller interval with a few agents; with K agents max(this, K / 3) ms, so the
    /// pollers do not load the two CPUs more than the agents.
    pub poll_ms: u64,
    pub program_limit_secs: f64,
    /// The bound for the side-by-side modes; a mode over it is not run at larger N.
    pub side_limit_secs: f64,
    /// Whether this bench (and so the fake apiserver serving the lists) was built with
    /// optimizations (`cargo run --release -p xtask`); unoptimized, the apiserver's JSON
    /// encoding slows the list pages down at large N.
    pub optimized: bool,
}

impl ApiConfig {
    pub fn new(
        quick: bool,
        scales: Option<Vec<usize>>,
        nodes: Option<Vec<usize>>,
        side_by_side: bool,
    ) -> Result<Self> {
        let scales = scales.unwrap_or_else(|| {
            if quick {
                vec![1000]
            } else {
                vec![1000, 10_000, 50_000, 100_000]
            }
        });
        if scales.iter().any(|n| *n == 0 || *n > 400_000) {
            bail!("--services: each between 1 and 400,000 with --api");
        }
        let nodes = nodes.unwrap_or_else(|| if quick { vec![2] } else { vec![1, 10, 30] });
        if nodes.iter().any(|k| *k > 64) {
            bail!("--nodes: at most 64 agents");
        }
        Ok(Self {
            quick,
            scales,
            changes: if quick { 20 } else { 200 },
            idle_secs: if quick { 1.0 } else { 5.0 },
            side_by_side,
            nodes,
            churn_services: if quick { 1000 } else { 10_000 },
            churn_rate: if quick { 20.0 } else { 50.0 },
            churn_secs: if quick { 2.0 } else { 10.0 },
            poll_ms: 5,
            program_limit_secs: if quick { 60.0 } else { 600.0 },
            side_limit_secs: if quick { 60.0 } else { 120.0 },
            optimized: !cfg!(debug_assertions),
        })
    }
}

/// A distribution in milliseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Dist {
    pub count: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Dist {
    pub(super) fn from_secs(samples: &[f64]) -> Option<Self> {
        let mut ms: Vec<f64> = samples.iter().map(|s| s * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let p = |q| stats::percentile(&ms, q);
        Some(Self {
            count: ms.len(),
            p50_ms: p(50.0)?,
            p90_ms: p(90.0)?,
            p99_ms: p(99.0)?,
            max_ms: *ms.last()?,
        })
    }
}

/// One scale's figures.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ApiScale {
    pub services: usize,
    /// The agent's `--service-map-entries` (its default unless N needs more).
    #[serde(default)]
    pub service_map_entries: Option<u32>,
    /// First list byte -> all frontends in the maps (s).
    pub list_to_programmed_secs: Option<f64>,
    /// Programming after the list: the last byte of the last initial list page (of the
    /// kinds the agent waits for) written -> all frontends in the maps (s).
    #[serde(default)]
    pub after_list_to_programmed_secs: Option<f64>,
    /// Process start -> `/healthz` 200 (s).
    pub start_to_healthy_secs: Option<f64>,
    /// Process start -> all frontends in the maps (s).
    pub start_to_programmed_secs: Option<f64>,
    /// List pages served (Services + EndpointSlices).
    pub list_pages: usize,
    pub rss_mib: Option<f64>,
    pub hwm_mib: Option<f64>,
    /// The BPF maps' memory once programmed (MiB): the sum of the agent's
    /// `ebpf_proxy_map_memory_bytes` (fdinfo `memlock`, refreshed every 10 s), charged to
    /// the memory cgroup of the agent that created the maps.
    #[serde(default)]
    pub map_memory_mib: Option<f64>,
    /// CPU used at rest, as a share of one CPU (%).
    pub idle_cpu_percent: Option<f64>,
    /// The agent's `network_programming_duration_seconds` per change.
    pub change_agent: Option<Dist>,
    /// kube-proxy's SLI as the agent measures it per change:
    /// `kubeproxy_network_programming_duration_seconds`, from the EndpointSlice's
    /// `last-change-trigger-time` (stamped by the apiserver when it accepted the write, as
    /// the EndpointSlice controller would) to the maps written.
    #[serde(default)]
    pub change_sli: Option<Dist>,
    /// Apiserver accepted -> the first connection reaching the new endpoint (the probe
    /// Service, `traffic.rs`).
    #[serde(default)]
    pub change_traffic: Option<Dist>,
    /// Apiserver accepted -> the agent reports the change written.
    pub change_visible: Option<Dist>,
    /// Changes whose own observation could not be told apart (a periodic resync between).
    pub changes_unattributed: usize,
    pub restart_to_healthy_secs: Option<f64>,
    /// Restart: the first list page served to the new agent -> `/healthz` 200 (s).
    #[serde(default)]
    pub restart_list_to_healthy_secs: Option<f64>,
    /// Restart: the last list page served to the new agent -> `/healthz` 200 (s): the
    /// agent's own work once the lists have arrived.
    #[serde(default)]
    pub restart_last_page_to_healthy_secs: Option<f64>,
    /// The restarted agent's VmHWM once healthy (MiB): its lists are read while it
    /// adopts the pins, so both are held at once.
    #[serde(default)]
    pub restart_hwm_mib: Option<f64>,
    /// Map writes of the first sync after the restart (0 = adopted as pinned).
    pub restart_map_writes: Option<u64>,
    /// The same N through the other paths: mode name -> programming seconds (None: did
    /// not finish in the bound, or not run).
    pub side_by_side: BTreeMap<String, Option<f64>>,
    /// The manifests agent's VmRSS at the same N.
    pub manifests_rss_mib: Option<f64>,
    /// The manifests agent's VmHWM then (its peak from the start, MiB; target <= 2x
    /// its VmRSS).
    #[serde(default)]
    pub manifests_hwm_mib: Option<f64>,
    /// kube-proxy's modes at the same N: mode name -> the kernel memory of its rules
    /// (MiB; charged to a fresh memory cgroup by the commands that loaded them).
    #[serde(default)]
    pub side_by_side_kernel_mib: BTreeMap<String, f64>,
    pub errors: Vec<String>,
}

/// One `--nodes K` run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NodesRun {
    pub agents: usize,
    pub services: usize,
    pub changes: usize,
    pub rate_per_sec: f64,
    /// Apiserver accepted -> written on all K agents.
    pub cluster: Option<Dist>,
    /// Changes not seen on every agent within the bound.
    pub missing: usize,
    pub watch_bytes_per_change: Option<f64>,
    pub poll_ms: u64,
    /// All K agents healthy after start (s).
    pub start_to_all_healthy_secs: Option<f64>,
    pub rss_mib_per_agent: Option<f64>,
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ApiResults {
    pub config: Option<ApiConfig>,
    pub machine: BTreeMap<String, String>,
    pub started_unix: u64,
    pub scales: Vec<ApiScale>,
    pub nodes: Vec<NodesRun>,
}
