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

mod precedence;
mod resolve;
#[cfg(test)]
mod tests;

use std::{collections::BTreeMap, time::Duration};

use serde::Deserialize;

pub use precedence::{apply, AgentSettings, Applied, KubeProxyFlags};
pub use resolve::{apply_oom_score_adj, verbosity_filter, Ignored, Resolved};

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
}
