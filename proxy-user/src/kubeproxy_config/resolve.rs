//! [`KubeProxyConfiguration::resolve`]: each field of the file applied in the agent's
//! terms ([`Resolved`]) or named with the reason it does not apply ([`Ignored`]).

use std::{net::IpAddr, net::SocketAddr, path::PathBuf, time::Duration};

use super::{DetectLocal, KubeProxyConfiguration, Winkernel};

/// A field of the file that the agent does not apply, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ignored {
    /// The field's JSON path (`iptables.masqueradeBit`).
    pub field: String,
    pub why: &'static str,
}

/// What the file sets, in the agent's terms. `None`: the file leaves it to the agent's
/// default (or to the flag).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Resolved {
    pub node_name: Option<String>,
    pub metrics_addr: Option<SocketAddr>,
    pub healthz_addr: Option<SocketAddr>,
    pub kubeconfig: Option<PathBuf>,
    pub conntrack_flows: Option<u32>,
    pub sync_interval: Option<Duration>,
    pub min_sync_interval: Option<Duration>,
    pub oom_score_adj: Option<i32>,
    /// NodePorts on 127.0.0.1 (`iptables.localhostNodePorts`, and `nodePortAddresses`
    /// including loopback when set, as kube-proxy's iptables mode; never in nftables mode).
    pub localhost_nodeports: Option<bool>,
    /// `nodePortAddresses` (checked: CIDRs or `primary`), when set and not empty.
    pub nodeport_addresses: Option<Vec<String>>,
    pub verbosity: u32,
    pub ignored: Vec<Ignored>,
}

/// Why a field does not apply: each is shown at start next to the field.
mod why {
    pub const MODE: &str =
        "this is the eBPF datapath (socket hooks and TC), there is no iptables/ipvs/nftables mode";
    pub const MASQ_BIT: &str =
        "no fwmark is used: the datapath translates in eBPF, not with iptables marks";
    pub const MASQ_ALL: &str = "traffic from pods and the node is translated at connect() by the socket hooks and is never masqueraded";
    pub const OTHER_MODE: &str = "a setting of a proxy mode this agent does not run";
    pub const WINDOWS: &str = "Windows only";
    pub const DETECT_LOCAL: &str = "not needed: the socket hooks translate at connect() inside the pod, so no packet has to be told apart as pod traffic to decide on masquerading";
    pub const CT_TIMEOUT: &str = "the datapath's flow timeouts are fixed (proxy-common ct_timeouts, after kube-proxy's defaults); the kernel's nf_conntrack is not used for Services";
    pub const TCP_BE_LIBERAL: &str = "the kernel's nf_conntrack is not used for Services";
    pub const QPS: &str = "no client-side rate limit: the agent only lists and watches (one request per resource per relist)";
    pub const CONTENT_TYPE: &str = "the agent reads JSON only";
    pub const CONFIG_SYNC: &str =
        "watches are not resynced from a cache; the full re-diff of the maps runs every syncPeriod";
    pub const HIDDEN_METRICS: &str = "the agent has no hidden (deprecated) metrics";
    pub const PROFILING: &str = "no /debug/pprof handler";
    pub const FEATURE_GATE: &str = "kube-proxy feature gates do not apply to this agent";
    pub const LOG_FORMAT: &str =
        "the agent logs in its own text format; set RUST_LOG for finer control";
    pub const PORT_RANGE: &str = "unused by kube-proxy too (the userspace proxy is gone)";
    pub const BIND_ADDRESS: &str = "the agent takes the node's addresses from its interfaces and Node object; only the address family of bindAddress is used (for the default bind addresses)";
}

impl KubeProxyConfiguration {
    /// The file in the agent's terms; `cpus` sizes `conntrack.maxPerCore`.
    // Long: one arm per KubeProxyConfiguration field, in the order of upstream's type: the
    // field table of docs/kube-proxy.md as code.
    pub fn resolve(&self, cpus: u32) -> Result<Resolved, String> {
        let mut r = Resolved::default();
        let mut ignore = |field: &str, why: &'static str| {
            r.ignored.push(Ignored {
                field: field.to_string(),
                why,
            })
        };
        let v6 = match self.bind_address.trim() {
            "" => false,
            a => {
                let ip: IpAddr = a
                    .parse()
                    .map_err(|_| format!("bindAddress {a:?} is not an IP address"))?;
                if !ip.is_unspecified() {
                    ignore("bindAddress", why::BIND_ADDRESS);
                }
                ip.is_ipv6()
            }
        };
        let hostname = self.hostname_override.trim();
        let node_name = (!hostname.is_empty()).then(|| hostname.to_lowercase());
        let metrics_addr = bind_address(
            "metricsBindAddress",
            &self.metrics_bind_address,
            10249,
            if v6 { "::1" } else { "127.0.0.1" },
        )?;
        let healthz_addr = bind_address(
            "healthzBindAddress",
            &self.healthz_bind_address,
            10256,
            if v6 { "::" } else { "0.0.0.0" },
        )?;
        let kubeconfig = (!self.client_connection.kubeconfig.is_empty())
            .then(|| PathBuf::from(&self.client_connection.kubeconfig));
        if self.client_connection.qps != 0.0 {
            ignore("clientConnection.qps", why::QPS);
        }
        if self.client_connection.burst != 0 {
            ignore("clientConnection.burst", why::QPS);
        }
        if !self.client_connection.content_type.is_empty() {
            ignore("clientConnection.contentType", why::CONTENT_TYPE);
        }
        if !self.client_connection.accept_content_types.is_empty() {
            ignore("clientConnection.acceptContentTypes", why::CONTENT_TYPE);
        }
        // conntrack.maxPerCore x CPUs, at least conntrack.min; 0 leaves the limit as it
        // is (kube-proxy: "0 to leave the limit as-is and ignore min").
        let conntrack_flows = match self.conntrack.max_per_core {
            None => None,
            Some(n) if n < 0 => return Err(format!("conntrack.maxPerCore {n} is negative")),
            Some(0) => None,
            Some(per_core) => {
                let min = self.conntrack.min.unwrap_or(0);
                if min < 0 {
                    return Err(format!("conntrack.min {min} is negative"));
                }
                let want = (per_core as u64 * u64::from(cpus.max(1))).max(min as u64);
                Some(u32::try_from(want).map_err(|_| {
                    format!("conntrack.maxPerCore x {cpus} CPUs = {want} is too large")
                })?)
            }
        };
        if self
            .conntrack
            .tcp_established_timeout
            .is_some_and(|d| !d.0.is_zero())
        {
            ignore("conntrack.tcpEstablishedTimeout", why::CT_TIMEOUT);
        }
        if self
            .conntrack
            .tcp_close_wait_timeout
            .is_some_and(|d| !d.0.is_zero())
        {
            ignore("conntrack.tcpCloseWaitTimeout", why::CT_TIMEOUT);
        }
        if !self.conntrack.udp_timeout.0.is_zero() {
            ignore("conntrack.udpTimeout", why::CT_TIMEOUT);
        }
        if !self.conntrack.udp_stream_timeout.0.is_zero() {
            ignore("conntrack.udpStreamTimeout", why::CT_TIMEOUT);
        }
        if self.conntrack.tcp_be_liberal {
            ignore("conntrack.tcpBeLiberal", why::TCP_BE_LIBERAL);
        }
        // The sync periods of the mode kube-proxy would run (iptables when unset).
        let (sync, min_sync) = match self.mode.as_str() {
            "ipvs" => (self.ipvs.sync_period, self.ipvs.min_sync_period),
            "nftables" => (self.nftables.sync_period, self.nftables.min_sync_period),
            _ => (self.iptables.sync_period, self.iptables.min_sync_period),
        };
        let sync_interval = (!sync.0.is_zero()).then_some(sync.0);
        let min_sync_interval = (!min_sync.0.is_zero()).then_some(min_sync.0);
        if !self.mode.is_empty() {
            ignore("mode", why::MODE);
        }
        if self.iptables.masquerade_bit.is_some() {
            ignore("iptables.masqueradeBit", why::MASQ_BIT);
        }
        if self.iptables.masquerade_all {
            ignore("iptables.masqueradeAll", why::MASQ_ALL);
        }
        // kube-proxy's iptables mode serves NodePorts on 127.0.0.1 unless
        // localhostNodePorts is false or nodePortAddresses leaves loopback out; the
        // nftables mode never does.
        let mut localhost_nodeports = self.iptables.localhost_node_ports;
        if self.mode == "nftables" {
            localhost_nodeports = Some(false);
        }
        if self.iptables.snat_node_internal_ip.is_some() {
            ignore("iptables.snatNodeInternalIP", why::OTHER_MODE);
        }
        if self.nftables.masquerade_bit.is_some() {
            ignore("nftables.masqueradeBit", why::MASQ_BIT);
        }
        if self.nftables.masquerade_all {
            ignore("nftables.masqueradeAll", why::MASQ_ALL);
        }
        let ipvs = &self.ipvs;
        if self.mode != "ipvs"
            && (!ipvs.sync_period.0.is_zero() || !ipvs.min_sync_period.0.is_zero())
        {
            ignore("ipvs.syncPeriod", why::OTHER_MODE);
        }
        for (set, field) in [
            (!ipvs.scheduler.is_empty(), "ipvs.scheduler"),
            (
                ipvs.exclude_cidrs.as_ref().is_some_and(|c| !c.is_empty()),
                "ipvs.excludeCIDRs",
            ),
            (ipvs.strict_arp, "ipvs.strictARP"),
            (!ipvs.tcp_timeout.0.is_zero(), "ipvs.tcpTimeout"),
            (!ipvs.tcp_fin_timeout.0.is_zero(), "ipvs.tcpFinTimeout"),
            (!ipvs.udp_timeout.0.is_zero(), "ipvs.udpTimeout"),
        ] {
            if set {
                ignore(field, why::OTHER_MODE);
            }
        }
        if self.winkernel != Winkernel::default() || self.windows_run_as_service {
            ignore("winkernel", why::WINDOWS);
        }
        if !self.detect_local_mode.is_empty() {
            ignore("detectLocalMode", why::DETECT_LOCAL);
        }
        if self.detect_local != DetectLocal::default() {
            ignore("detectLocal", why::DETECT_LOCAL);
        }
        if !self.cluster_cidr.is_empty() {
            for c in self.cluster_cidr.split(',') {
                let c = c.trim();
                if !c.contains('/') || crate::cluster::objects::parse_cidr(c).is_none() {
                    return Err(format!("clusterCIDR {c:?} is not a CIDR"));
                }
            }
            ignore("clusterCIDR", why::DETECT_LOCAL);
        }
        if let Some(addrs) = self.node_port_addresses.as_ref().filter(|a| !a.is_empty()) {
            let mut loopback = false;
            for a in addrs {
                let a = a.trim();
                if a == "primary" {
                    continue;
                }
                let cidr = a
                    .contains('/')
                    .then(|| crate::cluster::objects::parse_cidr(a))
                    .flatten()
                    .ok_or_else(|| {
                        format!("nodePortAddresses {a:?} is neither a CIDR nor \"primary\"")
                    })?;
                loopback |= crate::cluster::objects::cidr_contains(
                    cidr,
                    std::net::Ipv4Addr::LOCALHOST.into(),
                );
            }
            if !loopback {
                localhost_nodeports = Some(false);
            }
            r.nodeport_addresses = Some(addrs.iter().map(|a| a.trim().to_string()).collect());
        }
        if !self.config_sync_period.0.is_zero() {
            ignore("configSyncPeriod", why::CONFIG_SYNC);
        }
        if !self.show_hidden_metrics_for_version.is_empty() {
            ignore("showHiddenMetricsForVersion", why::HIDDEN_METRICS);
        }
        if self.enable_profiling {
            ignore("enableProfiling", why::PROFILING);
        }
        for gate in self.feature_gates.iter().flat_map(|g| g.keys()) {
            ignore(&format!("featureGates.{gate}"), why::FEATURE_GATE);
        }
        if !self.logging.format.is_empty() && self.logging.format != "text" {
            ignore("logging.format", why::LOG_FORMAT);
        }
        if self.logging.vmodule.as_ref().is_some_and(|v| !v.is_empty()) {
            ignore("logging.vmodule", why::LOG_FORMAT);
        }
        if !self.port_range.is_empty() {
            ignore("portRange", why::PORT_RANGE);
        }
        if let Some(adj) = self.oom_score_adj {
            if !(-1000..=1000).contains(&adj) {
                return Err(format!("oomScoreAdj {adj} is outside [-1000, 1000]"));
            }
        }
        r.node_name = node_name;
        r.metrics_addr = metrics_addr;
        r.healthz_addr = healthz_addr;
        r.kubeconfig = kubeconfig;
        r.conntrack_flows = conntrack_flows;
        r.sync_interval = sync_interval;
        r.min_sync_interval = min_sync_interval;
        r.oom_score_adj = self.oom_score_adj;
        r.localhost_nodeports = localhost_nodeports;
        r.verbosity = self.logging.verbosity;
        Ok(r)
    }
}

/// `ip:port`, or an IP alone (kube-proxy appends its default port); empty: the default
/// on `default_ip`.
fn bind_address(
    field: &str,
    value: &str,
    port: u16,
    default_ip: &str,
) -> Result<Option<SocketAddr>, String> {
    let v = value.trim();
    if v.is_empty() {
        return Ok(Some(SocketAddr::new(
            default_ip.parse().expect("a literal address"),
            port,
        )));
    }
    if let Ok(a) = v.parse::<SocketAddr>() {
        return Ok(Some(a));
    }
    if let Ok(ip) = v.trim_matches(['[', ']']).parse::<IpAddr>() {
        return Ok(Some(SocketAddr::new(ip, port)));
    }
    Err(format!(
        "{field} {v:?} is not an address (like 0.0.0.0:{port} or [::]:{port})"
    ))
}

/// The tracing filter for kube-proxy's `-v` / `logging.verbosity`: klog levels 0-3 are
/// `info`, 4 (kube-proxy's debugging level) is `debug`, 5 and up `trace`.
pub fn verbosity_filter(v: u32) -> &'static str {
    match v {
        0..=3 => "info",
        4 => "debug",
        _ => "trace",
    }
}

/// Sets this process's `oom_score_adj` (`oomScoreAdj`, as kube-proxy does).
pub fn apply_oom_score_adj(adj: i32) -> std::io::Result<()> {
    std::fs::write("/proc/self/oom_score_adj", adj.to_string())
}
