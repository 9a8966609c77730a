//! kube-proxy's precedence between its command-line flags, its `--config` file and this
//! agent's own settings (`cmd/kube-proxy/app/options.go`).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use super::{Conntrack, Ignored, KubeProxyConfiguration};

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
    /// NodePorts on 127.0.0.1, when kube-proxy's configuration decides it.
    pub localhost_nodeports: Option<bool>,
    /// kube-proxy's `nodePortAddresses`, when set.
    pub nodeport_addresses: Option<Vec<String>>,
}

/// kube-proxy's configuration applied to `s` with kube-proxy's precedence
/// (`cmd/kube-proxy/app/options.go`): with a file (`file`, read from `flags.config`),
/// the file replaces kube-proxy's flags but `--hostname-override` and `-v`; without
/// one, kube-proxy's flags apply. The agent's own settings given explicitly win over
/// both.
// Long: one line per kube-proxy flag, in the order of cmd/kube-proxy/app/options.go.
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
        localhost_nodeports: r.localhost_nodeports,
        nodeport_addresses: r.nodeport_addresses,
    })
}
