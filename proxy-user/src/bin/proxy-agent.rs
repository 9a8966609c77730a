//! `proxy-agent`: installs the eBPF datapath and keeps its maps in step with the cluster.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use proxy_user::{
    agent::{
        self,
        cli::{
            init_tracing, limit_malloc_arenas, node_name, parse_cidrs, parse_duration,
            parse_table_size, with_run_subcommand, CidrList,
        },
        AgentOptions,
    },
    cleanup,
    cluster::lb_algorithm::LbAlgorithm,
    loader,
    podbypass::BypassSelector,
    podif::{Patterns, DEFAULT_POD_INTERFACES},
    socklb::SocketLb,
    Acceleration, ForwardingMode, TcAttachMode, DEFAULT_PIN_PATH,
};

#[derive(Parser)]
#[command(
    name = "proxy-agent",
    version,
    about = "eBPF replacement for kube-proxy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent: keep the maps in step with Services and EndpointSlices.
    Run(Box<RunArgs>),
    /// Load and attach the socket hooks (or adopt pinned ones) and exit; the datapath
    /// keeps running from its pins.
    Install {
        /// bpffs directory for maps and links.
        #[arg(long, env = "PROXY_PIN_PATH", default_value = DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// cgroup v2 directory to attach the socket hooks to (default: the root of the
        /// host's cgroup2 mount).
        #[arg(long, env = "PROXY_CGROUP")]
        cgroup: Option<PathBuf>,
        /// Interfaces for the TC datapath (comma-separated; none by default here).
        #[arg(long, env = "PROXY_INTERFACES", value_delimiter = ',')]
        interfaces: Vec<String>,
        /// Conntrack table size in flows per address family (see `run --help`).
        #[arg(long, env = "PROXY_CONNTRACK_MAX", default_value_t = loader::DEFAULT_CONNTRACK_FLOWS)]
        conntrack_max: u32,
        /// Size of each service map in entries (see `run --help`).
        #[arg(long, env = "PROXY_SERVICE_MAP_ENTRIES", default_value_t = loader::DEFAULT_SERVICE_ENTRIES)]
        service_map_entries: u32,
        /// How the TC programs are attached: `auto` (TCX on kernels >= 6.6, clsact
        /// otherwise), `tcx` or `clsact`.
        #[arg(long, env = "PROXY_TC_ATTACH", value_enum, default_value_t = TcAttachMode::Auto)]
        tc_attach: TcAttachMode,
        /// XDP ahead of TC on the interfaces (see `run --help`).
        #[arg(long, env = "PROXY_ACCELERATION", value_enum, default_value_t = Acceleration::Off)]
        acceleration: Acceleration,
    },
    /// Remove what kube-proxy left in this network namespace (its iptables chains and
    /// the jumps into them, its nftables tables, IPVS services, kube-ipvs0, ipsets) and
    /// nothing else. Exits non-zero if a step failed (the others still run).
    CleanupKubeProxy {
        /// Print what would be removed; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Detach every hook and remove every pin under the pin path. Run it in the network
    /// namespace of the TC interfaces: clsact filters are found by interface name.
    Uninstall {
        #[arg(long, env = "PROXY_PIN_PATH", default_value = DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
    },
    /// Maglev disruption (for `cargo xtask bench`): over `--flows` sample flows, the
    /// fraction that change backend when one of N backends leaves and when one is added,
    /// one JSON line per N. Pure computation, the agent's own table code.
    #[command(hide = true)]
    MaglevDisruption {
        #[arg(long, default_value_t = proxy_common::limits::MAGLEV_TABLE_DEFAULT, value_parser = parse_table_size)]
        table_size: u32,
        #[arg(long, default_value = proxy_user::maglev::DEFAULT_SEED)]
        seed: String,
        #[arg(long, default_value_t = 100_000)]
        flows: usize,
        #[arg(long, value_delimiter = ',', default_value = "10,100")]
        backends: Vec<usize>,
        #[arg(long, value_enum, default_value_t = proxy_user::maglev::Fill::Population)]
        fill: proxy_user::maglev::Fill,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// kubeconfig file (default: in-cluster config, then $KUBECONFIG / ~/.kube/config).
    #[arg(long, env = "PROXY_KUBECONFIG", conflicts_with = "manifests")]
    kubeconfig: Option<PathBuf>,
    /// Read Services, EndpointSlices and Nodes from YAML/JSON files in this directory
    /// (multi-document, followed for changes) instead of a cluster.
    #[arg(long, env = "PROXY_MANIFESTS")]
    manifests: Option<PathBuf>,
    /// This node's name (internalTrafficPolicy: Local, topology). Default: $NODE_NAME,
    /// then the hostname.
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// cgroup v2 directory for the socket hooks (default: the host's cgroup2 root).
    #[arg(long, env = "PROXY_CGROUP")]
    cgroup: Option<PathBuf>,
    /// bpffs directory for maps and links.
    #[arg(long, env = "PROXY_PIN_PATH", default_value = DEFAULT_PIN_PATH)]
    pin_path: PathBuf,
    /// Serve only Services labelled service.kubernetes.io/service-proxy-name=<NAME>.
    #[arg(long, env = "PROXY_SERVICE_PROXY_NAME")]
    service_proxy_name: Option<String>,
    /// Address for /metrics. Loopback only by default, as kube-proxy's
    /// `--metrics-bind-address`; `0.0.0.0:10249` to let Prometheus scrape it from outside.
    #[arg(long, env = "PROXY_METRICS_ADDR", default_value = "127.0.0.1:10249")]
    metrics_addr: SocketAddr,
    /// Per-Service and per-backend counters in /metrics (connections and packets per
    /// Service port and per backend): opt-in because of their cardinality. Off, the
    /// datapath counts nothing more (one branch on `COUNTERS_ON`).
    #[arg(long, env = "PROXY_METRICS_PER_SERVICE")]
    metrics_per_service: bool,
    /// The most series `--metrics-per-service` adds to /metrics (two per Service port,
    /// then two per backend, lowest ids first); the rest are left out and counted in
    /// `ebpf_proxy_per_service_series_dropped`.
    #[arg(
        long,
        env = "PROXY_METRICS_PER_SERVICE_MAX_SERIES",
        default_value_t = 60_000
    )]
    metrics_per_service_max_series: usize,
    /// Address for /healthz and /livez (every address: load balancers probe it).
    #[arg(long, env = "PROXY_HEALTHZ_ADDR", default_value = "0.0.0.0:10256")]
    healthz_addr: SocketAddr,
    /// Shortest time between two syncs; changes arriving meanwhile are written together.
    #[arg(long, env = "PROXY_MIN_SYNC_INTERVAL", default_value = "10ms", value_parser = parse_duration)]
    min_sync_interval: Duration,
    /// Period of the full re-diff of desired state against the maps.
    #[arg(long, env = "PROXY_SYNC_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    sync_interval: Duration,
    /// Once the first sync has written the maps, remove kube-proxy's leftovers
    /// (`cleanup-kube-proxy`); a failure is logged, never fatal. Set to false while
    /// kube-proxy still runs on the node.
    #[arg(long, env = "PROXY_CLEANUP_KUBE_PROXY", default_value_t = true,
          action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    cleanup_kube_proxy: bool,
    /// Interfaces for the TC datapath (NodePort, externalIPs, LoadBalancer IPs from
    /// outside): `auto` (the node's interfaces that carry its addresses: every interface
    /// with a global address, not loopback, not a veth, bridge or tunnel), `none`, or a
    /// comma-separated list. Use `none` when running it by hand on a workstation.
    #[arg(long, env = "PROXY_INTERFACES", default_value = "auto")]
    interfaces: String,
    /// The host side of pods' veths, where the TC programs run for what pods send
    /// (ClusterIP, externalIPs, LoadBalancer IPs, NodePorts per packet, with conntrack):
    /// comma-separated glob patterns (`*`, `?`) on interface names, attached as the
    /// interfaces appear (netlink link events) and detached when they go; `none`; or
    /// `auto`: the common CNIs' names `lxc*,cali*,veth*,gke*,eni*,azv*`, but nothing when
    /// `--interfaces none` (an agent run by hand on a workstation touches no interface).
    #[arg(long, env = "PROXY_POD_INTERFACES", default_value = "auto")]
    pod_interfaces: String,
    /// Which sockets the socket hooks translate at connect()/sendmsg(): `all`, `tcp` (TCP
    /// everywhere, UDP only in the host's network namespace: a pod's UDP, a connected
    /// socket too, is translated per packet on its interface, so it follows a backend
    /// change and is never destroyed), `host-only` (pods go per packet), `off`; or `auto`:
    /// `tcp` when `--pod-interfaces` names any, else `all`. Sockets of a cgroup in
    /// `SOCK_LB_BYPASS` are never translated (per-pod bypass).
    #[arg(long, env = "PROXY_SOCKET_LB", default_value = "auto")]
    socket_lb: String,
    /// Pods whose sockets the socket hooks leave alone, by a label selector (`k=v`,
    /// `k!=v`, `k`, `!k`, comma-joined, all must hold) on the pod's labels or, when the
    /// pod has none of its keys, its namespace's; `none` for no bypass. Read from the API
    /// (this node's Pods and the Namespaces) when socket LB takes pods' sockets (`all`,
    /// `tcp`) and `--pod-interfaces` are set: such a pod's traffic goes per packet on its
    /// interface, where a mesh sees the ClusterIP. The default is Istio ambient's label.
    #[arg(
        long,
        env = "PROXY_SOCKET_LB_BYPASS_SELECTOR",
        default_value = proxy_user::podbypass::selector::DEFAULT
    )]
    socket_lb_bypass_selector: String,
    /// The ceiling of the TC datapath's conntrack tables, in flows per address family
    /// (each flow takes two entries): they start at `--conntrack-start` and the running
    /// agent grows them online (staged migration) up to this: at once to the size the
    /// new-flow rate needs when, at that rate (read every 250 ms), they would pass 75 %
    /// before a resize could end; x2 when their live entries (sampled every 10 s) pass it.
    /// LRU: when full, the least recently used flows are evicted. A start with a value
    /// below the pinned size shrinks the tables to it, unless they track more (warning).
    #[arg(long, env = "PROXY_CONNTRACK_MAX", default_value_t = loader::DEFAULT_CONNTRACK_FLOWS)]
    conntrack_max: u32,
    /// The size new conntrack tables start at, in flows per address family (at most
    /// `--conntrack-max`); pinned tables smaller than it are grown to it at the start,
    /// tables grown online keep their size across restarts.
    #[arg(long, env = "PROXY_CONNTRACK_START", default_value_t = proxy_user::ctsize::DEFAULT_START_FLOWS)]
    conntrack_start: u32,
    /// Size of each service map (SVC4, SVC6) in entries: a frontend (a Service's port on
    /// one of its addresses: ClusterIP, NodePort, externalIP, LoadBalancer IP) takes one
    /// entry plus one per endpoint. The default, 1,048,576, holds 50,000 Services x 10
    /// endpoints twice; a write beyond it fails with `map_full` (that frontend's change
    /// is rolled back, the others are written). A start with another value resizes the
    /// pinned maps online (staged migration: entries copied, programs swapped); a shrink
    /// below the entries in use keeps the pinned size, with a warning.
    #[arg(long, env = "PROXY_SERVICE_MAP_ENTRIES", default_value_t = loader::DEFAULT_SERVICE_ENTRIES)]
    service_map_entries: u32,
    /// How the TC programs are attached: `auto` (TCX links on kernels >= 6.6, clsact
    /// netlink filters otherwise), `tcx` or `clsact`. Hooks already pinned are adopted
    /// whatever mode attached them.
    #[arg(long, env = "PROXY_TC_ATTACH", value_enum, default_value_t = TcAttachMode::Auto)]
    tc_attach: TcAttachMode,
    /// How the TC path forwards external traffic (NodePort, externalIPs, LoadBalancer
    /// IPs; externalTrafficPolicy Cluster) to a backend on another node: `snat` (source
    /// NAT to this node, replies come back through it), `dsr` (direct server return for
    /// TCP and UDP: the backend's node learns the client and the frontend from an IPv4
    /// option or an IPv6 destination option and replies straight to the client) or
    /// `hybrid` (DSR for
    /// TCP, SNAT for UDP). Every node must run the same mode: a node in `snat` mode
    /// ignores the option.
    #[arg(long, env = "PROXY_FORWARDING_MODE", value_enum, default_value_t = ForwardingMode::Snat)]
    forwarding_mode: ForwardingMode,
    /// DSR: senders whose DSR option this node honours besides the Node objects'
    /// InternalIP/ExternalIP addresses (comma-separated CIDRs): the node network when the
    /// source is `--manifests` without every Node, or nodes that send from other
    /// addresses. From anyone else the option is ignored and counted (`tc_dsr_untrusted`).
    #[arg(long, env = "PROXY_DSR_TRUSTED_CIDRS", value_parser = parse_cidrs)]
    dsr_trusted_cidrs: Option<CidrList>,
    /// The Service CIDRs (comma-separated, kube-apiserver's `--service-cluster-ip-range`):
    /// a connection to a ClusterIP on a port no Service uses fails with ECONNREFUSED
    /// (`svc_port_unused`), to an address inside them that no Service has with EPERM
    /// (`svc_cidr_unallocated`), as kube-proxy's nftables mode rejects and drops them; such
    /// packets arriving at TC/XDP get the REJECT answer or are dropped. Addresses outside
    /// them are never touched. Added to the API's `ServiceCIDR` objects when the source is
    /// the API; unset and none there: neither is refused.
    #[arg(long, env = "PROXY_SERVICE_CLUSTER_IP_RANGE", value_parser = parse_cidrs)]
    service_cluster_ip_range: Option<CidrList>,
    /// North-south acceleration: the XDP program ahead of TC on the same interfaces
    /// handles NodePort / LoadBalancer IP / externalIP traffic from outside and the
    /// replies of its flows (same lookup, conntrack and NAT as TC; what it cannot do goes
    /// on to TC). `native`: in the driver (an interface whose driver has no native XDP is
    /// an error naming it); `generic`: skb mode, any interface; `off`: TC only.
    #[arg(long, env = "PROXY_ACCELERATION", value_enum, default_value_t = Acceleration::Off)]
    acceleration: Acceleration,
    /// Program `spec.externalIPs` only inside these prefixes (comma-separated CIDRs, or
    /// `none` for no externalIPs at all); others are logged, counted and left out.
    /// Default: every externalIP, as kube-proxy does. Anyone who can create a Service
    /// can otherwise claim any address with an externalIP (CVE-2020-8554).
    #[arg(long, env = "PROXY_EXTERNAL_IP_CIDRS", value_parser = parse_cidrs)]
    external_ip_cidrs: Option<CidrList>,
    /// How often the manifests directory is checked for changes besides inotify, which
    /// reports a file written, renamed or deleted at once.
    #[arg(long, env = "PROXY_MANIFESTS_POLL", default_value = "100ms", value_parser = parse_duration)]
    manifests_poll: Duration,
    /// An API request or watch that receives nothing (no answer, no event, no bookmark:
    /// kube-apiserver sends one about every minute) for this long is abandoned and
    /// retried (a watch resumes from its last resourceVersion).
    #[arg(long, env = "PROXY_API_IDLE_TIMEOUT", default_value = "90s", value_parser = parse_duration)]
    api_idle_timeout: Duration,
    /// How the TC path chooses a backend for a new flow from outside the node (NodePort,
    /// externalIPs, LoadBalancer IPs) of a Service without the annotation
    /// `ebpf-proxy.io/lb-algorithm: maglev|random`: `random`, or `maglev` (consistent
    /// hashing of the 5-tuple: every node picks the same backend, a backend change moves
    /// about 1/N of new flows). Traffic from pods and the node (socket hooks) stays random.
    #[arg(long, env = "PROXY_LB_ALGORITHM", default_value = "random",
          value_parser = |s: &str| s.parse::<LbAlgorithm>())]
    lb_algorithm: LbAlgorithm,
    /// Entries of each Maglev table: a prime in 251..=131071 (e.g. 251, 1021, 4093, 16381,
    /// 65521, 131071), larger than 100 x the largest backend count of a Maglev Service.
    /// 2 bytes per entry (36 KiB per frontend at 16381). Every node must use the same.
    #[arg(long, env = "PROXY_MAGLEV_TABLE_SIZE", default_value_t = proxy_common::limits::MAGLEV_TABLE_DEFAULT,
          value_parser = parse_table_size)]
    maglev_table_size: u32,
    /// Seed of the Maglev permutations (any text): every node of the cluster must use the
    /// same, so that they all pick the same backend for a flow.
    #[arg(long, env = "PROXY_MAGLEV_SEED", default_value = proxy_user::maglev::DEFAULT_SEED)]
    maglev_seed: String,
    /// How the Maglev tables are filled: `population` (Maglev's own: even shares, one
    /// backend of N leaving moves ~1/N of new flows at large tables, 2.3/N at N = 100 and
    /// M = 16381) or `bounded` (rendezvous hashing with bounded loads: ~1.1/N moves, each
    /// backend within 5 % of an even share). Every node must use the same.
    #[arg(long, env = "PROXY_MAGLEV_FILL", value_enum, default_value_t = proxy_user::maglev::Fill::Population)]
    maglev_fill: proxy_user::maglev::Fill,
    /// kube-proxy's configuration file (a `KubeProxyConfiguration`,
    /// kubeproxy.config.k8s.io/v1alpha1, YAML or JSON, as in kubeadm's `kube-proxy`
    /// ConfigMap), decoded strictly. As in kube-proxy, it replaces the kube-proxy flags
    /// below except `--hostname-override` and `-v`; this agent's own flags given on the
    /// command line or in their environment variable win over it. Fields that do not
    /// apply are named at start (docs/kube-proxy.md).
    #[arg(long, help_heading = "kube-proxy compatibility")]
    config: Option<PathBuf>,
    /// kube-proxy's name for this node (wins over `--config` and `--node-name`).
    #[arg(long, help_heading = "kube-proxy compatibility")]
    hostname_override: Option<String>,
    /// kube-proxy's `--metrics-bind-address` (`ip:port`, or an IP for port 10249).
    #[arg(
        long,
        help_heading = "kube-proxy compatibility",
        conflicts_with = "metrics_addr"
    )]
    metrics_bind_address: Option<String>,
    /// kube-proxy's `--healthz-bind-address` (`ip:port`, or an IP for port 10256).
    #[arg(
        long,
        help_heading = "kube-proxy compatibility",
        conflicts_with = "healthz_addr"
    )]
    healthz_bind_address: Option<String>,
    /// kube-proxy's `--nodeport-addresses` (CIDRs or `primary`): NodePorts answer only on
    /// the node addresses it selects (127.0.0.1 only when it includes loopback).
    #[arg(long, help_heading = "kube-proxy compatibility", value_delimiter = ',')]
    nodeport_addresses: Option<Vec<String>>,
    /// kube-proxy's `--cluster-cidr` (checked and named at start: not needed here).
    #[arg(long, help_heading = "kube-proxy compatibility")]
    cluster_cidr: Option<String>,
    /// kube-proxy's `--conntrack-max-per-core`: conntrack size = this x CPUs, at least
    /// `--conntrack-min` (0: keep the agent's size).
    #[arg(
        long,
        help_heading = "kube-proxy compatibility",
        conflicts_with = "conntrack_max"
    )]
    conntrack_max_per_core: Option<i32>,
    /// kube-proxy's `--conntrack-min`.
    #[arg(
        long,
        help_heading = "kube-proxy compatibility",
        conflicts_with = "conntrack_max"
    )]
    conntrack_min: Option<i32>,
    /// kube-proxy's `--proxy-mode` (accepted and named at start: this is the eBPF datapath).
    #[arg(long, help_heading = "kube-proxy compatibility")]
    proxy_mode: Option<String>,
    /// kube-proxy's log verbosity (`-v=4`: debug, 5 and up: trace); RUST_LOG wins.
    #[arg(
        short = 'v',
        long = "v",
        value_name = "N",
        help_heading = "kube-proxy compatibility"
    )]
    verbosity: Option<u32>,
}

/// kube-proxy's configuration (its file or its flags) applied to `args`
/// (`kubeproxy_config::apply`, kube-proxy's precedence).
fn apply_kube_proxy(
    args: &mut RunArgs,
    m: &clap::ArgMatches,
) -> Result<proxy_user::kubeproxy_config::Applied> {
    use clap::parser::ValueSource;
    use proxy_user::kubeproxy_config::{self as kp, KubeProxyConfiguration};
    let explicit = |id: &str| {
        matches!(
            m.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    };
    let flags = kp::KubeProxyFlags {
        config: args.config.clone(),
        hostname_override: args.hostname_override.clone(),
        metrics_bind_address: args.metrics_bind_address.clone(),
        healthz_bind_address: args.healthz_bind_address.clone(),
        nodeport_addresses: args.nodeport_addresses.clone(),
        cluster_cidr: args.cluster_cidr.clone(),
        conntrack_max_per_core: args.conntrack_max_per_core,
        conntrack_min: args.conntrack_min,
        proxy_mode: args.proxy_mode.clone(),
        verbosity: args.verbosity,
    };
    let file = match &args.config {
        Some(path) => Some(KubeProxyConfiguration::load(path).map_err(|e| anyhow::anyhow!(e))?),
        None => None,
    };
    let mut s = kp::AgentSettings {
        node_name: args.node_name.clone(),
        node_name_on_command_line: m.value_source("node_name") == Some(ValueSource::CommandLine),
        metrics_addr: (args.metrics_addr, explicit("metrics_addr")),
        healthz_addr: (args.healthz_addr, explicit("healthz_addr")),
        kubeconfig: args.kubeconfig.clone(),
        conntrack_flows: (args.conntrack_max, explicit("conntrack_max")),
        sync_interval: (args.sync_interval, explicit("sync_interval")),
        min_sync_interval: (args.min_sync_interval, explicit("min_sync_interval")),
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let applied = kp::apply(&flags, file, &mut s, cpus).map_err(|e| match &args.config {
        Some(p) => anyhow::anyhow!("the kube-proxy config {}: {e}", p.display()),
        None => anyhow::anyhow!("kube-proxy flags: {e}"),
    })?;
    args.node_name = s.node_name;
    args.metrics_addr = s.metrics_addr.0;
    args.healthz_addr = s.healthz_addr.0;
    args.kubeconfig = s.kubeconfig;
    args.conntrack_max = s.conntrack_flows.0;
    args.sync_interval = s.sync_interval.0;
    args.min_sync_interval = s.min_sync_interval.0;
    if let Some(adj) = applied.oom_score_adj {
        kp::apply_oom_score_adj(adj).with_context(|| format!("setting oomScoreAdj {adj}"))?;
    }
    Ok(applied)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

// Long: the flags mapped to AgentOptions, one field per flag in the order of the flags, and
// the subcommands dispatched.
fn main() -> Result<()> {
    use clap::{CommandFactory as _, FromArgMatches as _};
    limit_malloc_arenas();
    let matches =
        Cli::command().get_matches_from(with_run_subcommand(std::env::args_os().collect()));
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if !matches!(cli.command, Command::Run(_)) {
        init_tracing("info");
    }
    match cli.command {
        Command::Run(args) => {
            let mut args = *args;
            let run_matches = matches
                .subcommand_matches("run")
                .expect("the run subcommand's matches");
            let proxy_user::kubeproxy_config::Applied {
                verbosity,
                ignored,
                shadowed,
                localhost_nodeports,
                nodeport_addresses,
                ..
            } = match apply_kube_proxy(&mut args, run_matches) {
                Ok(r) => r,
                Err(e) => {
                    init_tracing("info");
                    return Err(e);
                }
            };
            init_tracing(proxy_user::kubeproxy_config::verbosity_filter(verbosity));
            if let Some(path) = &args.config {
                tracing::info!(config = %path.display(), "kube-proxy configuration read");
            }
            if !shadowed.is_empty() {
                tracing::warn!(flags = ?shadowed, "kube-proxy flags ignored: --config replaces them, as in kube-proxy");
            }
            if !ignored.is_empty() {
                tracing::warn!(
                    fields = %ignored
                        .iter()
                        .map(|i| format!("{} ({})", i.field, i.why))
                        .collect::<Vec<_>>()
                        .join("; "),
                    "kube-proxy settings not applied"
                );
            }
            let pod_interfaces = match args.pod_interfaces.as_str() {
                "auto" if args.interfaces == "none" => Patterns::default(),
                "auto" => Patterns::parse(DEFAULT_POD_INTERFACES).map_err(anyhow::Error::msg)?,
                list => Patterns::parse(list).map_err(anyhow::Error::msg)?,
            };
            let opts = AgentOptions {
                kubeconfig: args.kubeconfig,
                manifests: args.manifests,
                node_name: node_name(args.node_name),
                cgroup: args.cgroup,
                pin_path: args.pin_path,
                proxy_name: args.service_proxy_name,
                metrics_addr: args.metrics_addr,
                metrics_per_service: args
                    .metrics_per_service
                    .then_some(args.metrics_per_service_max_series),
                healthz_addr: args.healthz_addr,
                min_sync_interval: args.min_sync_interval,
                sync_interval: args.sync_interval,
                manifests_poll: args.manifests_poll,
                api_idle_timeout: args.api_idle_timeout,
                cleanup_kube_proxy: args.cleanup_kube_proxy,
                interfaces: match args.interfaces.as_str() {
                    "none" | "" => None,
                    "auto" => Some(Vec::new()),
                    list => Some(list.split(',').map(|s| s.trim().to_string()).collect()),
                },
                pod_interfaces: pod_interfaces.clone(),
                socket_lb: match args.socket_lb.as_str() {
                    "auto" if pod_interfaces.is_empty() => SocketLb::All,
                    "auto" => SocketLb::Tcp,
                    other => {
                        <SocketLb as clap::ValueEnum>::from_str(other, false).map_err(|_| {
                            anyhow::anyhow!(
                                "--socket-lb {other:?}: expected auto, all, tcp, host-only or off"
                            )
                        })?
                    }
                },
                socket_lb_bypass: BypassSelector::parse(&args.socket_lb_bypass_selector)
                    .map_err(|e| anyhow::anyhow!("--socket-lb-bypass-selector {e}"))?,
                conntrack_flows: args.conntrack_max,
                conntrack_start: args.conntrack_start,
                service_entries: args.service_map_entries,
                external_ip_cidrs: args.external_ip_cidrs.map(|c| c.0),
                tc_attach: args.tc_attach,
                lb_algorithm: args.lb_algorithm,
                maglev: proxy_user::maglev::Params::new(args.maglev_table_size, &args.maglev_seed)
                    .map_err(|e| anyhow::anyhow!(e))?
                    .with_fill(args.maglev_fill),
                forwarding_mode: args.forwarding_mode,
                acceleration: args.acceleration,
                dsr_trusted_cidrs: args.dsr_trusted_cidrs.map(|c| c.0).unwrap_or_default(),
                config_fields_ignored: ignored.into_iter().map(|i| i.field).collect(),
                // kube-proxy's default (iptables mode, nodePortAddresses unset).
                localhost_nodeports: localhost_nodeports.unwrap_or(true),
                nodeport_addresses,
                service_cidrs: args
                    .service_cluster_ip_range
                    .map(|c| c.0)
                    .unwrap_or_default(),
            };
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(agent::run(opts, shutdown_signal()))?;
        }
        Command::Install {
            pin_path,
            cgroup,
            interfaces,
            conntrack_max,
            service_map_entries,
            tc_attach,
            acceleration,
        } => {
            let r = proxy_user::migrate::install(&loader::InstallOptions {
                pin_path: pin_path.clone(),
                cgroup,
                interfaces,
                conntrack_flows: conntrack_max,
                service_entries: service_map_entries,
                map_sizes: None,
                tc_attach,
                acceleration,
            })
            .with_context(|| format!("installing the datapath at {}", pin_path.display()))?;
            println!(
                "attached {} hook(s), adopted {} pinned hook(s) at {}",
                r.attached.len(),
                r.adopted.len(),
                pin_path.display()
            );
        }
        Command::CleanupKubeProxy { dry_run } => {
            let report = cleanup::cleanup_kube_proxy(&cleanup::CleanupOptions { dry_run });
            print!("{report}");
            if !report.errors.is_empty() {
                anyhow::bail!(
                    "{} step(s) of the kube-proxy cleanup failed (see above)",
                    report.errors.len()
                );
            }
        }
        Command::MaglevDisruption {
            table_size,
            seed,
            flows,
            backends,
            fill,
        } => {
            let params = proxy_user::maglev::Params::new(table_size, &seed)
                .map_err(|e| anyhow::anyhow!(e))?
                .with_fill(fill);
            for line in proxy_user::maglev::disruption_lines(params, flows, &backends) {
                println!("{line}");
            }
        }
        Command::Uninstall { pin_path } => {
            let r = loader::uninstall(&proxy_user::pins::PinDir::new(&pin_path))
                .with_context(|| format!("removing the datapath at {}", pin_path.display()))?;
            println!(
                "removed {} link(s) and {} map(s) from {}",
                r.links.len(),
                r.maps.len(),
                pin_path.display()
            );
        }
    }
    Ok(())
}
