//! What the packet-rate part records: its configuration, rounds, per-mode figures and
//! tables (serialized to `pps-results.json`).

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::counters::{ip_forwarded, veth_stats};
use crate::bench::topo::Netns;

#[derive(Clone, Debug, Serialize)]
pub struct PpsConfig {
    pub quick: bool,
    pub rounds: usize,
    /// Measured interval per round, after the warm-up.
    pub secs: f64,
    pub warmup_secs: f64,
    /// cli0's NAPI in its own SCHED_FIFO thread on CPU 1 (else inline: on the
    /// generator's CPU, right after each batch it sends).
    pub threaded_napi: bool,
}

impl PpsConfig {
    pub fn new(quick: bool, rounds: Option<usize>, threaded_napi: bool) -> Self {
        let mut c = if quick {
            // 12 modes in two tables: about 10 s of rounds.
            Self {
                quick,
                rounds: 1,
                secs: 0.6,
                warmup_secs: 0.2,
                threaded_napi,
            }
        } else {
            Self {
                quick,
                rounds: 5,
                secs: 3.0,
                warmup_secs: 0.5,
                threaded_napi,
            }
        };
        if let Some(r) = rounds {
            c.rounds = r.max(1);
        }
        c
    }
}

/// Which table: the NodePort to a backend on another node, or the ClusterIP to one on
/// this node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Form {
    #[default]
    Remote,
    Local,
}

impl Form {
    pub(super) fn title(self) -> &'static str {
        match self {
            Form::Remote => "remote backend: NodePort 10.224.0.1:30053/UDP (eTP=Cluster) -> a pod on another node (DNAT + SNAT, out of pods0)",
            Form::Local => "local backend: ClusterIP 10.96.0.10:53/UDP from a pod -> a pod on this node (DNAT, routed by the stack)",
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PpsRound {
    pub round: usize,
    pub secs: f64,
    pub received: u64,
    pub mpps: f64,
    /// What the generator sent in the same interval.
    pub offered_mpps: f64,
    /// `cli0`'s XDP counters and the node's IP forwarding over the interval.
    pub path: PathCounts,
    /// The agent's `XDP_STATS` over the interval (reason -> count), our XDP modes only.
    pub xdp_stats: Option<std::collections::BTreeMap<String, u64>>,
    pub error: Option<String>,
}

/// Deltas of the node's counters over one round.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct PathCounts {
    /// Frames `cli0`'s NAPI took (`rx_queue_0_xdp_packets`: counted with or without
    /// an XDP program).
    pub xdp_packets: u64,
    pub xdp_redirect: u64,
    pub xdp_tx: u64,
    pub xdp_drops: u64,
    /// The node's `Ip: ForwDatagrams` (`/proc/net/snmp`): the stack's IP forwarding.
    pub ip_forwarded: u64,
}

impl PathCounts {
    pub(super) fn read(node: &Netns) -> Result<Self> {
        let s = veth_stats(node, "cli0")?;
        let get = |k: &str| s.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
        Ok(Self {
            xdp_packets: get("rx_queue_0_xdp_packets"),
            xdp_redirect: get("rx_queue_0_xdp_redirect"),
            xdp_tx: get("rx_queue_0_xdp_tx"),
            xdp_drops: get("rx_queue_0_xdp_drops"),
            ip_forwarded: ip_forwarded(node)?,
        })
    }

    pub(super) fn since(self, b: Self) -> Self {
        Self {
            xdp_packets: self.xdp_packets.saturating_sub(b.xdp_packets),
            xdp_redirect: self.xdp_redirect.saturating_sub(b.xdp_redirect),
            xdp_tx: self.xdp_tx.saturating_sub(b.xdp_tx),
            xdp_drops: self.xdp_drops.saturating_sub(b.xdp_drops),
            ip_forwarded: self.ip_forwarded.saturating_sub(b.ip_forwarded),
        }
    }

    /// The path the frames took, from the counters, as a share of what the pod received.
    /// `xdp`: whether the mode has an XDP program on `cli0` (veth counts
    /// `xdp_packets` for every frame its NAPI takes, program or not).
    pub(super) fn verdict(&self, received: u64, xdp: bool) -> String {
        let pct = |n: u64| (n as f64 * 100.0 / received.max(1) as f64).min(999.0);
        let fwd = pct(self.ip_forwarded);
        if !xdp {
            if fwd >= 50.0 {
                format!("no XDP; stack forwarding ({fwd:.0}% IP-forwarded)")
            } else {
                format!("no XDP; not IP-forwarded ({fwd:.0}%): TC redirect")
            }
        } else if pct(self.xdp_redirect) >= 50.0 {
            format!(
                "XDP_REDIRECT ({:.0}%, {fwd:.0}% IP-forwarded)",
                pct(self.xdp_redirect)
            )
        } else if pct(self.xdp_tx) >= 50.0 {
            format!("XDP_TX ({:.0}%)", pct(self.xdp_tx))
        } else {
            format!("XDP_PASS, then the stack ({fwd:.0}% IP-forwarded)")
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PpsMode {
    pub mode: String,
    pub describe: String,
    pub available: bool,
    pub reason: Option<String>,
    pub rounds: Vec<PpsRound>,
    /// Median over rounds, Mpps received by the pod.
    pub mpps: Option<f64>,
    pub offered_mpps: Option<f64>,
    /// `mpps` / direct's (plain stack forwarding).
    pub ratio_to_direct: Option<f64>,
    /// `mpps` / xdp-fwd's (plain XDP forwarding, next hop fixed; remote form).
    pub ratio_to_xdp_fwd: Option<f64>,
    /// `mpps` / iptables-legacy's.
    pub ratio_to_iptables: Option<f64>,
    /// `mpps` / our TC's.
    pub ratio_to_tc: Option<f64>,
    /// The path the frames took (the last good round's counters).
    pub verdict: Option<String>,
    /// What the agent's maps say about the frontend (`maglev` flag), our modes only.
    pub frontend_flags: Option<String>,
    /// The cli0 ingress program's own ns per packet under the flood (the kernel's
    /// run-time statistics over one extra round, not counted in `mpps`), with the
    /// program and its runs: modes with a program (ours, `xdp-fwd`).
    pub program_ns: Option<f64>,
    pub program: Option<String>,
    pub program_runs: Option<u64>,
    pub program_error: Option<String>,
    /// Setting the mode up failed (not "unavailable here": that is `reason` alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PpsTable {
    pub form: Form,
    pub title: String,
    pub modes: Vec<PpsMode>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PpsResults {
    pub config: serde_json::Value,
    pub machine: std::collections::BTreeMap<String, String>,
    pub pinning: Vec<String>,
    /// The remote-backend table first, then the local one.
    pub tables: Vec<PpsTable>,
    /// `BPF_PROG_RUN` ns per packet (`bench-prog-run`'s JSON), when it ran.
    pub prog_run: Option<serde_json::Value>,
    pub prog_run_error: Option<String>,
    pub duration_seconds: f64,
}

impl PpsResults {
    /// Every error the packet-rate part recorded, one line each: a mode whose set-up
    /// failed, a failed round, a failed program profile, a failed `BPF_PROG_RUN` part.
    /// A mode unavailable on this machine (no native XDP, say) is not one.
    pub fn errors(&self) -> Vec<String> {
        let mut out = Vec::new();
        for t in &self.tables {
            for m in &t.modes {
                let at = format!("packet rate, {}, {}", t.title, m.mode);
                if let Some(e) = &m.error {
                    out.push(format!("{at}: set-up failed: {e}"));
                }
                for r in &m.rounds {
                    if let Some(e) = &r.error {
                        out.push(format!("{at}: round {}: {e}", r.round + 1));
                    }
                }
                if let Some(e) = &m.program_error {
                    out.push(format!("{at}: program profile: {e}"));
                }
            }
        }
        if let Some(e) = &self.prog_run_error {
            out.push(format!("BPF_PROG_RUN part: {e}"));
        }
        out
    }
}
