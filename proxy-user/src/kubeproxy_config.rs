//! kube-proxy's own configuration file (`--config`): a `KubeProxyConfiguration` of
//! `kubeproxy.config.k8s.io/v1alpha1`, as kubeadm writes it into the `kube-proxy`
//! ConfigMap (`config.conf`), decoded strictly (an unknown or repeated field is an error
//! naming it, as kube-proxy's strict decoder says) from YAML or JSON.
//!
//! Field names follow `staging/src/k8s.io/kube-proxy/config/v1alpha1/types.go` of
//! Kubernetes (the v1.34 line). Every field is either applied with kube-proxy's meaning
//! ([`KubeProxyConfiguration::resolve`]) or, when set to something other than its empty
//! or default value, named in [`Resolved::ignored`] with the reason: the agent logs them
//! in one line at start and counts them in `ebpf_proxy_config_fields_ignored`.
//!
//! Precedence (kube-proxy's `cmd/kube-proxy/app/options.go`): with `--config`, the file
//! replaces kube-proxy's other command-line flags, except `--hostname-override` and
//! `-v`, which win over the file. The project's own flags (`--conntrack-max`,
//! `--sync-interval`, ...) given on the command line or in their environment variable
//! win over the file.

use std::{collections::BTreeMap, net::IpAddr, net::SocketAddr, path::PathBuf, time::Duration};

use serde::Deserialize;

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// A Go `time.Duration` as `metav1.Duration` writes it (`1h0m0s`, `250ms`, `0s`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GoDuration(pub Duration);

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_go_duration(&s)
            .map(GoDuration)
            .map_err(serde::de::Error::custom)
    }
}

/// Parses Go's duration syntax: a sequence of decimal numbers with units `ns`, `us`,
/// `µs`, `ms`, `s`, `m`, `h` (`1h0m0s`, `1.5s`, `2h22m`), or `0`. Negative durations
/// are refused (no field here takes one).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    if t.is_empty() {
        return Err("empty duration".into());
    }
    if t.starts_with('-') {
        return Err(format!("{s:?}: a negative duration"));
    }
    let mut rest = t.strip_prefix('+').unwrap_or(t);
    let mut total = 0f64;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("{s:?}: missing a unit (ns, us, ms, s, m, h)"))?;
        let (num, tail) = rest.split_at(num_end);
        let n: f64 = num
            .parse()
            .map_err(|_| format!("{s:?}: {num:?} is not a number"))?;
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_end);
        let secs = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => {
                return Err(format!(
                    "{s:?}: unknown unit {unit:?} (ns, us, ms, s, m, h)"
                ))
            }
        };
        total += n * secs;
        rest = next;
    }
    Ok(Duration::from_secs_f64(total))
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientConnection {
    #[serde(default)]
    pub kubeconfig: String,
    #[serde(default)]
    pub accept_content_types: String,
    #[serde(default)]
    pub content_type: String,
    #[serde(default)]
    pub qps: f64,
    #[serde(default)]
    pub burst: i64,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LogFormatOptions {
    #[serde(default)]
    pub split_stream: Option<bool>,
    /// A `resource.Quantity` (`"0"`, `64Ki`, or a number).
    #[serde(default)]
    pub info_buffer_size: Option<serde_yaml::Value>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LogOptions {
    #[serde(default)]
    pub json: Option<LogFormatOptions>,
    #[serde(default)]
    pub text: Option<LogFormatOptions>,
}

/// component-base's `LoggingConfiguration`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Logging {
    #[serde(default)]
    pub format: String,
    /// A duration (`5s`) or nanoseconds as a number.
    #[serde(default)]
    pub flush_frequency: Option<serde_yaml::Value>,
    #[serde(default)]
    pub verbosity: u32,
    #[serde(default)]
    pub vmodule: Option<Vec<serde_yaml::Value>>,
    #[serde(default)]
    pub options: Option<LogOptions>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct IpTables {
    #[serde(default)]
    pub masquerade_bit: Option<i32>,
    #[serde(default)]
    pub masquerade_all: bool,
    #[serde(default)]
    pub localhost_node_ports: Option<bool>,
    #[serde(default, rename = "snatNodeInternalIP")]
    pub snat_node_internal_ip: Option<bool>,
    #[serde(default)]
    pub sync_period: GoDuration,
    #[serde(default)]
    pub min_sync_period: GoDuration,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Ipvs {
    #[serde(default)]
    pub sync_period: GoDuration,
    #[serde(default)]
    pub min_sync_period: GoDuration,
    #[serde(default)]
    pub scheduler: String,
    #[serde(default, rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(default, rename = "strictARP")]
    pub strict_arp: bool,
    #[serde(default)]
    pub tcp_timeout: GoDuration,
    #[serde(default)]
    pub tcp_fin_timeout: GoDuration,
    #[serde(default)]
    pub udp_timeout: GoDuration,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NfTables {
    #[serde(default)]
    pub masquerade_bit: Option<i32>,
    #[serde(default)]
    pub masquerade_all: bool,
    #[serde(default)]
    pub sync_period: GoDuration,
    #[serde(default)]
    pub min_sync_period: GoDuration,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Conntrack {
    #[serde(default)]
    pub max_per_core: Option<i32>,
    #[serde(default)]
    pub min: Option<i32>,
    #[serde(default)]
    pub tcp_established_timeout: Option<GoDuration>,
    #[serde(default)]
    pub tcp_close_wait_timeout: Option<GoDuration>,
    #[serde(default)]
    pub tcp_be_liberal: bool,
    #[serde(default)]
    pub udp_timeout: GoDuration,
    #[serde(default)]
    pub udp_stream_timeout: GoDuration,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Winkernel {
    #[serde(default)]
    pub network_name: String,
    #[serde(default)]
    pub source_vip: String,
    #[serde(default, rename = "enableDSR")]
    pub enable_dsr: bool,
    #[serde(default)]
    pub root_hns_endpoint_name: String,
    #[serde(default)]
    pub forward_health_check_vip: bool,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DetectLocal {
    #[serde(default)]
    pub bridge_interface: String,
    #[serde(default)]
    pub interface_name_prefix: String,
}

/// `kubeproxy.config.k8s.io/v1alpha1` `KubeProxyConfiguration`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub feature_gates: Option<BTreeMap<String, bool>>,
    #[serde(default)]
    pub client_connection: ClientConnection,
    #[serde(default)]
    pub logging: Logging,
    #[serde(default)]
    pub hostname_override: String,
    #[serde(default)]
    pub bind_address: String,
    #[serde(default)]
    pub healthz_bind_address: String,
    #[serde(default)]
    pub metrics_bind_address: String,
    #[serde(default)]
    pub bind_address_hard_fail: bool,
    #[serde(default)]
    pub enable_profiling: bool,
    #[serde(default)]
    pub show_hidden_metrics_for_version: String,
    #[serde(default)]
    pub mode: String,
    #[serde(default)]
    pub iptables: IpTables,
    #[serde(default)]
    pub ipvs: Ipvs,
    #[serde(default)]
    pub nftables: NfTables,
    #[serde(default)]
    pub winkernel: Winkernel,
    #[serde(default)]
    pub detect_local_mode: String,
    #[serde(default)]
    pub detect_local: DetectLocal,
    #[serde(default, rename = "clusterCIDR")]
    pub cluster_cidr: String,
    #[serde(default)]
    pub node_port_addresses: Option<Vec<String>>,
    #[serde(default)]
    pub oom_score_adj: Option<i32>,
    #[serde(default)]
    pub conntrack: Conntrack,
    #[serde(default)]
    pub config_sync_period: GoDuration,
    #[serde(default)]
    pub port_range: String,
    #[serde(default)]
    pub windows_run_as_service: bool,
}

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
    pub const NODEPORT_ADDRESSES: &str =
        "not implemented yet: NodePorts answer on every node address (issue #24 item 3)";
    pub const LOCALHOST_NODEPORTS: &str =
        "not implemented yet: NodePorts are not served on 127.0.0.1 (issue #24 item 4)";
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
    /// Decodes `data` (YAML or JSON) strictly.
    pub fn parse(data: &str) -> Result<Self, String> {
        let c: Self = serde_yaml::from_str(data).map_err(|e| {
            // A bad value's error names the value, not the field: show the line it is on.
            let msg = e.to_string();
            let value = msg.split('"').nth(1).filter(|v| !v.is_empty());
            match value.and_then(|v| data.lines().find(|l| l.contains(v))) {
                Some(line) => format!("{msg} (at `{}`)", line.trim()),
                None => msg,
            }
        })?;
        if c.api_version != API_VERSION {
            return Err(format!(
                "apiVersion {:?}: expected {API_VERSION:?}",
                c.api_version
            ));
        }
        if c.kind != KIND {
            return Err(format!("kind {:?}: expected {KIND:?}", c.kind));
        }
        Ok(c)
    }

    /// Reads and decodes `path`; the error names the file.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let data = std::fs::read_to_string(path)
            .map_err(|e| format!("reading the kube-proxy config {}: {e}", path.display()))?;
        Self::parse(&data).map_err(|e| format!("the kube-proxy config {}: {e}", path.display()))
    }

    /// The file in the agent's terms; `cpus` sizes `conntrack.maxPerCore`.
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
        if self.iptables.localhost_node_ports.is_some() {
            ignore("iptables.localhostNodePorts", why::LOCALHOST_NODEPORTS);
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
        if self
            .node_port_addresses
            .as_ref()
            .is_some_and(|a| !a.is_empty())
        {
            ignore("nodePortAddresses", why::NODEPORT_ADDRESSES);
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
        r.verbosity = self.logging.verbosity;
        Ok(r)
    }
}

/// kube-proxy's command-line flags, as given (`None`: not given).
#[derive(Clone, Debug, Default)]
pub struct KubeProxyFlags {
    pub config: Option<PathBuf>,
    pub hostname_override: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub nodeport_addresses: Option<Vec<String>>,
    pub cluster_cidr: Option<String>,
    pub conntrack_max_per_core: Option<i32>,
    pub conntrack_min: Option<i32>,
    pub proxy_mode: Option<String>,
    pub verbosity: Option<u32>,
}

/// The agent's settings kube-proxy's configuration can change, with whether each was
/// given explicitly (command line or `PROXY_*` environment variable): those win.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentSettings {
    pub node_name: Option<String>,
    /// `--node-name` was given on the command line (`$NODE_NAME` is not).
    pub node_name_on_command_line: bool,
    pub metrics_addr: (SocketAddr, bool),
    pub healthz_addr: (SocketAddr, bool),
    pub kubeconfig: Option<PathBuf>,
    pub conntrack_flows: (u32, bool),
    pub sync_interval: (Duration, bool),
    pub min_sync_interval: (Duration, bool),
}

/// What [`apply`] decided besides the settings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Applied {
    pub verbosity: u32,
    pub ignored: Vec<Ignored>,
    /// kube-proxy flags given together with `--config`, which replaces them.
    pub shadowed: Vec<&'static str>,
    pub oom_score_adj: Option<i32>,
}

/// kube-proxy's configuration applied to `s` with kube-proxy's precedence
/// (`cmd/kube-proxy/app/options.go`): with a file (`file`, read from `flags.config`),
/// the file replaces kube-proxy's flags but `--hostname-override` and `-v`; without
/// one, kube-proxy's flags apply. The agent's own settings given explicitly win over
/// both.
pub fn apply(
    flags: &KubeProxyFlags,
    file: Option<KubeProxyConfiguration>,
    s: &mut AgentSettings,
    cpus: u32,
) -> Result<Applied, String> {
    let mut shadowed = Vec::new();
    let from_file = file.is_some();
    let c = match file {
        Some(c) => {
            for (given, flag) in [
                (
                    flags.metrics_bind_address.is_some(),
                    "--metrics-bind-address",
                ),
                (
                    flags.healthz_bind_address.is_some(),
                    "--healthz-bind-address",
                ),
                (flags.nodeport_addresses.is_some(), "--nodeport-addresses"),
                (flags.cluster_cidr.is_some(), "--cluster-cidr"),
                (
                    flags.conntrack_max_per_core.is_some(),
                    "--conntrack-max-per-core",
                ),
                (flags.conntrack_min.is_some(), "--conntrack-min"),
                (flags.proxy_mode.is_some(), "--proxy-mode"),
            ] {
                if given {
                    shadowed.push(flag);
                }
            }
            c
        }
        // Without a file, kube-proxy's flags fill the same structure.
        None => KubeProxyConfiguration {
            metrics_bind_address: flags.metrics_bind_address.clone().unwrap_or_default(),
            healthz_bind_address: flags.healthz_bind_address.clone().unwrap_or_default(),
            node_port_addresses: flags.nodeport_addresses.clone(),
            cluster_cidr: flags.cluster_cidr.clone().unwrap_or_default(),
            mode: flags.proxy_mode.clone().unwrap_or_default(),
            conntrack: Conntrack {
                // kube-proxy's default per core when only the minimum is given.
                max_per_core: flags
                    .conntrack_max_per_core
                    .or(flags.conntrack_min.map(|_| 32768)),
                min: flags.conntrack_min,
                ..Conntrack::default()
            },
            ..KubeProxyConfiguration::default()
        },
    };
    let r = c.resolve(cpus)?;
    // --hostname-override wins over everything; then --node-name given on the command
    // line; then the file's hostnameOverride; then $NODE_NAME and the hostname.
    if let Some(h) = &flags.hostname_override {
        let h = h.trim();
        if h.is_empty() {
            return Err("empty --hostname-override is invalid".into());
        }
        s.node_name = Some(h.to_lowercase());
    } else if !s.node_name_on_command_line {
        if let Some(n) = r.node_name {
            s.node_name = Some(n);
        }
    }
    let set =
        |(value, explicit): &mut (SocketAddr, bool), from: Option<SocketAddr>, applies: bool| {
            if let (false, true, Some(a)) = (*explicit, applies, from) {
                *value = a;
            }
        };
    set(
        &mut s.metrics_addr,
        r.metrics_addr,
        from_file || flags.metrics_bind_address.is_some(),
    );
    set(
        &mut s.healthz_addr,
        r.healthz_addr,
        from_file || flags.healthz_bind_address.is_some(),
    );
    if let Some(k) = r.kubeconfig {
        s.kubeconfig = Some(k);
    }
    if let (false, Some(n)) = (s.conntrack_flows.1, r.conntrack_flows) {
        s.conntrack_flows.0 = n;
    }
    if let (false, Some(d)) = (s.sync_interval.1, r.sync_interval) {
        s.sync_interval.0 = d;
    }
    if let (false, Some(d)) = (s.min_sync_interval.1, r.min_sync_interval) {
        s.min_sync_interval.0 = d;
    }
    Ok(Applied {
        verbosity: flags.verbosity.unwrap_or(r.verbosity),
        ignored: r.ignored,
        shadowed,
        oom_score_adj: r.oom_score_adj,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// kubeadm's `config.conf` as it renders it into the `kube-proxy` ConfigMap
    /// (`kubeadm init` with the default KubeProxyConfiguration and a podSubnet).
    pub const KUBEADM: &str = include_str!("../tests/data/kubeadm-kube-proxy-config.conf");

    #[test]
    fn kubeadms_config_decodes_and_names_nothing_but_the_cluster_cidr() {
        let c = KubeProxyConfiguration::parse(KUBEADM).expect("kubeadm's config");
        let r = c.resolve(4).expect("resolves");
        assert_eq!(r.metrics_addr, Some("127.0.0.1:10249".parse().expect("ok")));
        assert_eq!(r.healthz_addr, Some("0.0.0.0:10256".parse().expect("ok")));
        assert_eq!(
            r.kubeconfig,
            Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        assert_eq!(r.node_name, None);
        assert_eq!(r.conntrack_flows, None);
        assert_eq!(r.sync_interval, None);
        assert_eq!(r.min_sync_interval, None);
        let fields: Vec<_> = r.ignored.iter().map(|i| i.field.as_str()).collect();
        assert_eq!(fields, ["clusterCIDR"]);
    }

    #[test]
    fn an_unknown_field_is_an_error_naming_it() {
        let bad = KUBEADM.replace("  maxPerCore: null", "  maxPerCore: null\n  maxPerCpu: 3");
        let e = KubeProxyConfiguration::parse(&bad).expect_err("an error");
        assert!(e.contains("maxPerCpu"), "{e}");
        let bad = KUBEADM.replace("mode: \"\"", "mode: \"\"\nudpIdleTimeout: 250ms");
        let e = KubeProxyConfiguration::parse(&bad).expect_err("an error");
        assert!(e.contains("udpIdleTimeout"), "{e}");
        let json = r#"{"apiVersion":"kubeproxy.config.k8s.io/v1alpha1","kind":"KubeProxyConfiguration","bogus":1}"#;
        let e = KubeProxyConfiguration::parse(json).expect_err("an error");
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn a_repeated_field_is_an_error() {
        let bad = format!("{KUBEADM}\nmode: ipvs\n");
        let e = KubeProxyConfiguration::parse(&bad).expect_err("an error");
        assert!(e.contains("mode"), "{e}");
    }

    #[test]
    fn wrong_api_version_or_kind_is_refused() {
        let e = KubeProxyConfiguration::parse(
            "apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeProxyConfiguration\n",
        )
        .expect_err("an error");
        assert!(e.contains("v1beta1"), "{e}");
        let e = KubeProxyConfiguration::parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
        )
        .expect_err("an error");
        assert!(e.contains("KubeletConfiguration"), "{e}");
    }

    #[test]
    fn json_decodes_too() {
        let json = r#"{"apiVersion":"kubeproxy.config.k8s.io/v1alpha1","kind":"KubeProxyConfiguration",
            "metricsBindAddress":"0.0.0.0:10249","conntrack":{"maxPerCore":1000,"min":5000},
            "iptables":{"syncPeriod":"1m0s","minSyncPeriod":"250ms"},"hostnameOverride":"Node-A"}"#;
        let r = KubeProxyConfiguration::parse(json)
            .expect("ok")
            .resolve(2)
            .expect("ok");
        assert_eq!(r.metrics_addr, Some("0.0.0.0:10249".parse().expect("ok")));
        assert_eq!(r.conntrack_flows, Some(5000), "min wins over 1000 x 2");
        assert_eq!(r.sync_interval, Some(Duration::from_secs(60)));
        assert_eq!(r.min_sync_interval, Some(Duration::from_millis(250)));
        assert_eq!(
            r.node_name.as_deref(),
            Some("node-a"),
            "lowercased as kube-proxy"
        );
    }

    #[test]
    fn conntrack_size_is_max_per_core_times_cpus_at_least_min() {
        let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
        c.conntrack.max_per_core = Some(32768);
        c.conntrack.min = Some(131072);
        assert_eq!(c.resolve(8).expect("ok").conntrack_flows, Some(262144));
        assert_eq!(c.resolve(2).expect("ok").conntrack_flows, Some(131072));
        c.conntrack.max_per_core = Some(0);
        assert_eq!(c.resolve(8).expect("ok").conntrack_flows, None, "0: as-is");
        c.conntrack.max_per_core = Some(-1);
        assert!(c.resolve(8).expect_err("an error").contains("maxPerCore"));
    }

    #[test]
    fn the_sync_periods_of_the_configured_mode_apply_and_mode_is_named() {
        let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
        c.mode = "nftables".into();
        c.nftables.sync_period = GoDuration(Duration::from_secs(45));
        c.iptables.sync_period = GoDuration(Duration::from_secs(10));
        let r = c.resolve(1).expect("ok");
        assert_eq!(r.sync_interval, Some(Duration::from_secs(45)));
        let m = r
            .ignored
            .iter()
            .find(|i| i.field == "mode")
            .expect("mode named");
        assert!(m.why.contains("eBPF"));
    }

    #[test]
    fn not_applicable_settings_are_named_with_the_reason() {
        let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
        c.iptables.masquerade_bit = Some(14);
        c.conntrack.tcp_established_timeout = Some(GoDuration(Duration::from_secs(86400)));
        c.node_port_addresses = Some(vec!["primary".into()]);
        c.feature_gates = Some([("KubeProxyDrainingTerminatingNodes".to_string(), true)].into());
        let r = c.resolve(1).expect("ok");
        let fields: Vec<_> = r.ignored.iter().map(|i| i.field.as_str()).collect();
        for f in [
            "iptables.masqueradeBit",
            "conntrack.tcpEstablishedTimeout",
            "nodePortAddresses",
            "featureGates.KubeProxyDrainingTerminatingNodes",
        ] {
            assert!(fields.contains(&f), "{f} not named in {fields:?}");
        }
    }

    #[test]
    fn bad_values_are_errors_naming_the_field() {
        let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
        c.metrics_bind_address = "localhost:x".into();
        assert!(c
            .resolve(1)
            .expect_err("an error")
            .contains("metricsBindAddress"));
        let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
        c.cluster_cidr = "10.0.0.0/33".into();
        assert!(c.resolve(1).expect_err("an error").contains("clusterCIDR"));
        let bad = KUBEADM.replace("configSyncPeriod: 0s", "configSyncPeriod: 5 minutes");
        let e = KubeProxyConfiguration::parse(&bad).expect_err("an error");
        assert!(e.contains("configSyncPeriod"), "{e}");
    }

    #[test]
    fn an_ip_alone_gets_kube_proxys_default_port_and_ipv6_bind_address_picks_ipv6_defaults() {
        let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
        c.healthz_bind_address = "10.1.2.3".into();
        c.bind_address = "::".into();
        let r = c.resolve(1).expect("ok");
        assert_eq!(r.healthz_addr, Some("10.1.2.3:10256".parse().expect("ok")));
        assert_eq!(r.metrics_addr, Some("[::1]:10249".parse().expect("ok")));
    }

    fn settings() -> AgentSettings {
        AgentSettings {
            node_name: Some("from-env".into()),
            node_name_on_command_line: false,
            metrics_addr: ("127.0.0.1:10249".parse().expect("addr"), false),
            healthz_addr: ("0.0.0.0:10256".parse().expect("addr"), false),
            kubeconfig: None,
            conntrack_flows: (131072, false),
            sync_interval: (Duration::from_secs(30), false),
            min_sync_interval: (Duration::from_millis(10), false),
        }
    }

    fn file(yaml: &str) -> Option<KubeProxyConfiguration> {
        Some(
            KubeProxyConfiguration::parse(&format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{yaml}"
            ))
            .expect("a config"),
        )
    }

    #[test]
    fn with_a_file_kube_proxys_other_flags_are_replaced_and_named() {
        let flags = KubeProxyFlags {
            metrics_bind_address: Some("0.0.0.0:9999".into()),
            conntrack_max_per_core: Some(1),
            ..KubeProxyFlags::default()
        };
        let mut s = settings();
        let a = apply(
            &flags,
            file("metricsBindAddress: 127.0.0.2:10249\nconntrack:\n  maxPerCore: 100000\n"),
            &mut s,
            2,
        )
        .expect("applies");
        assert_eq!(s.metrics_addr.0, "127.0.0.2:10249".parse().expect("addr"));
        assert_eq!(s.conntrack_flows.0, 200000);
        assert_eq!(
            a.shadowed,
            ["--metrics-bind-address", "--conntrack-max-per-core"]
        );
    }

    #[test]
    fn hostname_override_and_v_win_over_the_file() {
        let flags = KubeProxyFlags {
            hostname_override: Some("Node-B".into()),
            verbosity: Some(4),
            ..KubeProxyFlags::default()
        };
        let mut s = settings();
        let a = apply(
            &flags,
            file("hostnameOverride: node-a\nlogging:\n  verbosity: 2\n"),
            &mut s,
            1,
        )
        .expect("applies");
        assert_eq!(s.node_name.as_deref(), Some("node-b"));
        assert_eq!(a.verbosity, 4);
        // Without the flags, the file's.
        let mut s = settings();
        let a = apply(
            &KubeProxyFlags::default(),
            file("hostnameOverride: node-a\nlogging:\n  verbosity: 2\n"),
            &mut s,
            1,
        )
        .expect("applies");
        assert_eq!(
            s.node_name.as_deref(),
            Some("node-a"),
            "the file over $NODE_NAME"
        );
        assert_eq!(a.verbosity, 2);
        let empty = KubeProxyFlags {
            hostname_override: Some(" ".into()),
            ..KubeProxyFlags::default()
        };
        assert!(apply(&empty, None, &mut settings(), 1).is_err());
    }

    #[test]
    fn the_agents_own_explicit_settings_win_over_the_file() {
        let mut s = settings();
        s.conntrack_flows = (5000, true);
        s.sync_interval = (Duration::from_secs(5), true);
        s.metrics_addr = ("127.0.0.1:1".parse().expect("addr"), true);
        s.node_name_on_command_line = true;
        apply(
            &KubeProxyFlags::default(),
            file("hostnameOverride: node-a\nmetricsBindAddress: 0.0.0.0:10249\nconntrack:\n  maxPerCore: 100000\niptables:\n  syncPeriod: 1m0s\n  minSyncPeriod: 2s\n"),
            &mut s,
            4,
        )
        .expect("applies");
        assert_eq!(s.conntrack_flows.0, 5000);
        assert_eq!(s.sync_interval.0, Duration::from_secs(5));
        assert_eq!(s.metrics_addr.0, "127.0.0.1:1".parse().expect("addr"));
        assert_eq!(
            s.node_name.as_deref(),
            Some("from-env"),
            "--node-name on the command line"
        );
        assert_eq!(
            s.min_sync_interval.0,
            Duration::from_secs(2),
            "not explicit: the file's"
        );
    }

    #[test]
    fn without_a_file_kube_proxys_flags_apply() {
        let flags = KubeProxyFlags {
            healthz_bind_address: Some("127.0.0.1".into()),
            conntrack_min: Some(1_000_000),
            cluster_cidr: Some("10.244.0.0/16".into()),
            proxy_mode: Some("ipvs".into()),
            ..KubeProxyFlags::default()
        };
        let mut s = settings();
        let a = apply(&flags, None, &mut s, 2).expect("applies");
        assert_eq!(s.healthz_addr.0, "127.0.0.1:10256".parse().expect("addr"));
        assert_eq!(
            s.metrics_addr.0,
            "127.0.0.1:10249".parse().expect("addr"),
            "untouched"
        );
        assert_eq!(s.conntrack_flows.0, 1_000_000, "min over 32768 x 2");
        let fields: Vec<_> = a.ignored.iter().map(|i| i.field.as_str()).collect();
        assert_eq!(fields, ["mode", "clusterCIDR"]);
        assert!(a.shadowed.is_empty());
        let bad = KubeProxyFlags {
            cluster_cidr: Some("10.244.0.0".into()),
            ..KubeProxyFlags::default()
        };
        assert!(apply(&bad, None, &mut settings(), 1)
            .expect_err("not a CIDR")
            .contains("clusterCIDR"));
    }

    #[test]
    fn go_durations() {
        for (s, d) in [
            ("0s", Duration::ZERO),
            ("0", Duration::ZERO),
            ("1h0m0s", Duration::from_secs(3600)),
            ("15m0s", Duration::from_secs(900)),
            ("250ms", Duration::from_millis(250)),
            ("1.5s", Duration::from_millis(1500)),
            ("2h22m", Duration::from_secs(2 * 3600 + 22 * 60)),
        ] {
            assert_eq!(parse_go_duration(s), Ok(d), "{s}");
        }
        for s in ["", "5", "5 s", "-1s", "1d"] {
            assert!(parse_go_duration(s).is_err(), "{s}");
        }
    }
}
