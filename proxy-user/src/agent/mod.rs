//! The agent (`proxy-agent run`): installs or adopts the datapath, starts a source
//! (Kubernetes watches or a manifests directory), serves metrics and health, and runs the
//! rate-limited sync loop until told to stop (on a fresh node the source starts first
//! and the maps are made at its first lists' needs: [`run`]). Stopping leaves the
//! datapath pinned and serving; the next agent adopts it.

mod bypass;
mod caps;
pub mod cli;
mod ct_cleanup;
mod grow;
pub mod healthcheck;
pub mod http;
pub mod kubeproxy_metrics;
pub mod metrics;
mod node_addresses;
pub mod per_service;
pub mod schedule;
pub mod shrink;
mod source;
mod start;
pub mod sync;

use std::{
    future::Future,
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::{
    cluster::{kube_source, objects::NodeInfo, Kind, Update},
    loader,
    pins::PinDir,
    Writer,
};
use metrics::{Endpoints, Health, Metrics};
pub use node_addresses::{NodeAddresses, NodePortSelection};
use schedule::{Backoff, Schedule};
pub use start::FIRST_LISTS_WAIT;
use sync::{SyncOutcome, Syncer};

/// Everything `proxy-agent run` takes.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    pub kubeconfig: Option<PathBuf>,
    pub manifests: Option<PathBuf>,
    pub node_name: String,
    pub cgroup: Option<PathBuf>,
    pub pin_path: PathBuf,
    pub proxy_name: Option<String>,
    pub metrics_addr: SocketAddr,
    /// `--metrics-per-service` with `--metrics-per-service-max-series` (`None`: off).
    pub metrics_per_service: Option<usize>,
    pub healthz_addr: SocketAddr,
    /// Shortest time between two syncs (changes arriving meanwhile are coalesced).
    pub min_sync_interval: Duration,
    /// Period of the full re-diff; health turns 503 after twice this without a sync.
    pub sync_interval: Duration,
    /// How often the manifests directory is polled (besides its inotify watch).
    pub manifests_poll: Duration,
    /// `--api-idle-timeout`: an API request or watch silent this long is retried.
    pub api_idle_timeout: Duration,
    /// Remove kube-proxy's leftovers once the first sync has written the maps.
    pub cleanup_kube_proxy: bool,
    /// Interfaces for the TC datapath: `None` for none, `Some(empty)` for the node's
    /// interfaces found automatically, or the given names.
    pub interfaces: Option<Vec<String>>,
    /// `--pod-interfaces`: the host side of pods' veths (TC attached as they appear).
    pub pod_interfaces: crate::podif::Patterns,
    /// `--socket-lb`: which sockets the socket hooks translate (`SOCK_LB`).
    pub socket_lb: crate::socklb::SocketLb,
    /// `--socket-lb-bypass-selector` (`None`: no bypass from labels).
    pub socket_lb_bypass: Option<crate::podbypass::BypassSelector>,
    /// The ceiling of the conntrack tables in flows per address family
    /// (`--conntrack-max`): they grow online up to it ([`crate::ctsize`]).
    pub conntrack_flows: u32,
    /// The size new conntrack tables start at, in flows per family (`--conntrack-start`;
    /// at most `conntrack_flows`).
    pub conntrack_start: u32,
    /// The ceiling of `SVC4`/`SVC6`'s `max_entries` (`--service-map-entries`): they
    /// are made at [`loader::SERVICE_START_ENTRIES`] (or kept at their pinned size) and
    /// the writer grows them online up to it.
    pub service_entries: u32,
    /// `--external-ip-cidrs`: prefixes `spec.externalIPs` must be in (`None`: any).
    pub external_ip_cidrs: Option<Vec<(std::net::IpAddr, u8)>>,
    /// How the TC programs are attached (`auto`: TCX on kernels >= 6.6, clsact otherwise).
    pub tc_attach: loader::TcAttachMode,
    /// `--lb-algorithm`: external traffic of Services without the annotation.
    pub lb_algorithm: crate::cluster::lb_algorithm::LbAlgorithm,
    /// `--maglev-table-size` and `--maglev-seed`.
    pub maglev: crate::maglev::Params,
    /// `--forwarding-mode`: SNAT or DSR for external traffic to a backend on another
    /// node (written to `FWD_MODE`).
    pub forwarding_mode: crate::ForwardingMode,
    /// `--acceleration`: XDP ahead of TC on the same interfaces.
    pub acceleration: loader::Acceleration,
    /// `--dsr-trusted-cidrs`: senders whose DSR option is honoured besides the Node
    /// objects' addresses (`DSR_TRUSTED4/6`).
    pub dsr_trusted_cidrs: Vec<(std::net::IpAddr, u8)>,
    /// kube-proxy settings (`--config` fields, kube-proxy flags) not applied, named at
    /// start and in `ebpf_proxy_config_fields_ignored`.
    pub config_fields_ignored: Vec<String>,
    /// NodePorts on `127.0.0.1` for the node's own processes (kube-proxy's iptables mode
    /// `localhostNodePorts`): 127.0.0.1 is written among the node addresses.
    pub localhost_nodeports: bool,
    /// kube-proxy's `nodePortAddresses` (`--nodeport-addresses`): CIDRs or `primary`;
    /// NodePorts answer only on the node addresses they select (`None`: on all).
    pub nodeport_addresses: Option<Vec<String>>,
    /// `--service-cluster-ip-range`: the Service CIDRs (`SVC_CIDR4/6`, with every
    /// Service's cluster IPs): a socket-hook miss inside them is refused.
    pub service_cidrs: Vec<(std::net::IpAddr, u8)>,
}

/// Runs the agent until `shutdown` completes: the steps of the module doc, in order.
/// On a fresh node (nothing pinned) the sources start first and the maps sized to demand
/// are made at what the first lists need ([`start::fresh`]); on pinned maps (a restart,
/// an upgrade) the datapath is adopted first and the lists read meanwhile.
pub async fn run(opts: AgentOptions, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    cli::raise_open_file_limit();
    let metrics = Metrics::new();
    // A manifests directory is read while the datapath loads (another thread; at tens of
    // thousands of Services the read takes as long as the load or longer).
    let manifests = source::read_manifests(&opts, &metrics)?;
    let (interfaces, node_addrs) = node_interfaces(&opts)?;
    let start = start::start_sizes(&opts)?;
    let health = Arc::new(Health::new(opts.sync_interval * 2));
    // The socket-LB bypass reads the pinned maps when its source starts: with it, the
    // maps are made first.
    let fresh = PinDir::new(&opts.pin_path)
        .max_entries(proxy_common::map_names::SVC4)
        .is_none()
        && !bypass::bypass_on(&opts);
    let begin = start::Start {
        metrics,
        health: health.clone(),
        manifests,
        interfaces,
        node_addrs,
        sizes: start,
    };
    let start::Started {
        datapath,
        metrics,
        rx,
        first,
    } = if fresh {
        start::fresh(&opts, begin).await?
    } else {
        start::on_pins(&opts, begin).await?
    };
    if fresh {
        record_datapath(&opts, &datapath, &metrics);
    }
    let kernel_logs = loader::spawn_kernel_logger(&opts.pin_path);
    if !opts.pod_interfaces.is_empty() {
        crate::podif::spawn(
            opts.pin_path.clone(),
            opts.tc_attach,
            opts.pod_interfaces.clone(),
            metrics.clone(),
        )?;
    }
    let grow = tokio::spawn(grow::grow_conntrack(
        opts.pin_path.clone(),
        metrics.clone(),
        opts.conntrack_flows,
        opts.conntrack_start,
        kernel_logs,
    ));
    let (syncer, node_addresses, first_sync) =
        start::syncer(&opts, first, datapath.node_addrs, metrics).await?;
    if opts.cleanup_kube_proxy {
        tokio::spawn(cleanup_kube_proxy_when_synced(health.clone()));
    }
    sync_loop(
        syncer,
        rx,
        &opts,
        &health,
        Served {
            node_addresses,
            hooked_cgroup: datapath.installed.cgroup,
            first_sync,
        },
        shutdown,
    )
    .await;
    grow.abort();
    info!("stopping; the datapath stays pinned and keeps serving");
    Ok(())
}

/// What [`open_datapath`] found and installed.
struct Datapath {
    installed: loader::InstallReport,
    /// The node's addresses (NodePorts at the socket hooks, and on TC).
    node_addrs: Vec<std::net::IpAddr>,
}

/// The interfaces the TC datapath attaches to and the node's addresses.
fn node_interfaces(opts: &AgentOptions) -> anyhow::Result<(Vec<String>, Vec<std::net::IpAddr>)> {
    // The node's addresses serve NodePorts at the socket hooks too (pods and the node's
    // own processes connecting to `<node address>:<nodePort>`): found even without TC,
    // from the interfaces `auto` would pick.
    let all = crate::node::interface_addresses().context("listing the node's addresses")?;
    Ok(match &opts.interfaces {
        None => (Vec::new(), crate::node::node_interfaces(&all, &[]).1),
        Some(wanted) => crate::node::node_interfaces(&all, wanted),
    })
}

/// Installs or adopts the datapath (programs, maps, attachments; the maps sized to
/// demand made at `sizes`, or kept at their pinned sizes) and writes the forwarding
/// mode.
fn open_datapath(
    opts: &AgentOptions,
    interfaces: Vec<String>,
    node_addrs: Vec<std::net::IpAddr>,
    sizes: &loader::Sizes,
) -> anyhow::Result<Datapath> {
    let installed = crate::migrate::install(&install_options(opts, &interfaces, sizes))
        .with_context(|| {
            format!(
                "installing the datapath at {}{}",
                opts.pin_path.display(),
                caps::missing_hint()
            )
        })?;
    info!(
        attached = installed.attached.len(),
        adopted = installed.adopted.len(),
        cgroup = ?installed.cgroup,
        conntrack_flows = installed.conntrack_entries / 2,
        service_map_entries = installed.service_entries,
        "datapath ready"
    );
    if !interfaces.is_empty() {
        info!(?interfaces, addresses = ?node_addrs, acceleration = %opts.acceleration, "TC datapath on the node's interfaces");
    }
    crate::fwd::set(&PinDir::new(&opts.pin_path), opts.forwarding_mode)
        .context("writing the forwarding mode (FWD_MODE)")?;
    let host_netns = crate::socklb::own_netns_cookie()
        .context("reading this network namespace's cookie (SO_NETNS_COOKIE)")?;
    crate::socklb::set(&opts.pin_path, opts.socket_lb, host_netns)
        .context("writing the socket LB mode (SOCK_LB)")?;
    if opts.socket_lb != crate::socklb::SocketLb::All && opts.pod_interfaces.is_empty() {
        warn!(
            socket_lb = opts.socket_lb.name(),
            "--socket-lb leaves pods' sockets (some or all) to the per-packet path, but no \
             --pod-interfaces are set: those pods' Service traffic is not translated"
        );
    }
    info!(
        socket_lb = opts.socket_lb.name(),
        "socket hooks: which sockets they translate (the others go per packet on their pod's interface)"
    );
    info!(
        mode = opts.forwarding_mode.name(),
        "forwarding mode for external traffic to backends on other nodes"
    );
    Ok(Datapath {
        installed,
        node_addrs,
    })
}

/// What [`open_datapath`] installs: the maps sized to demand at `sizes` (conntrack's in
/// flows).
fn install_options(
    opts: &AgentOptions,
    interfaces: &[String],
    sizes: &loader::Sizes,
) -> loader::InstallOptions {
    loader::InstallOptions {
        pin_path: opts.pin_path.clone(),
        cgroup: opts.cgroup.clone(),
        interfaces: interfaces.to_vec(),
        conntrack_flows: sizes.get(loader::SizedMap::Conntrack),
        service_entries: sizes.get(loader::SizedMap::Service),
        map_sizes: Some(*sizes),
        tc_attach: opts.tc_attach,
        acceleration: opts.acceleration,
    }
}

/// The metrics registry, with what is known before the datapath (families, ignored
/// settings).
fn new_metrics(
    opts: &AgentOptions,
    node_addrs: &[std::net::IpAddr],
    mut metrics: Metrics,
) -> Arc<Metrics> {
    metrics.kube_proxy.set_families(
        node_addrs.iter().any(|a| a.is_ipv4()),
        node_addrs.iter().any(|a| a.is_ipv6()),
    );
    metrics.kube_proxy.set_ignored(&opts.config_fields_ignored);
    Arc::new(metrics)
}

/// What the datapath's install tells the metrics (table sizes, resizes, map memory,
/// per-Service counters); map memory is refreshed every 10 s from then on.
fn record_datapath(opts: &AgentOptions, datapath: &Datapath, metrics: &Arc<Metrics>) {
    let installed = &datapath.installed;
    metrics.conntrack_max.set(i64::from(opts.conntrack_flows));
    metrics
        .conntrack_capacity
        .set(i64::from(installed.conntrack_entries / 2));
    metrics
        .service_map_entries
        .set(i64::from(installed.service_entries));
    metrics.count_resizes(&installed.resized);
    let map_memory = loader::map_memory(&opts.pin_path);
    info!(
        total_bytes = map_memory.iter().map(|m| m.bytes).sum::<u64>(),
        maps = %map_memory
            .iter()
            .map(|m| format!("{}={}", m.name, m.bytes))
            .collect::<Vec<_>>()
            .join(" "),
        "BPF map memory (charged to the memory cgroup of the agent that created the maps)"
    );
    metrics.set_map_memory(&map_memory);
    if let Some(ps) = per_service::start(
        &crate::pins::PinDir::new(&opts.pin_path),
        opts.metrics_per_service,
    ) {
        let _ = metrics.per_service.set(ps);
    }
    tokio::spawn(grow::refresh_map_memory(
        opts.pin_path.clone(),
        metrics.clone(),
    ));
}

/// Binds and serves /metrics and /healthz + /livez.
async fn serve_http(
    opts: &AgentOptions,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
) -> anyhow::Result<()> {
    let m = metrics::spawn(
        opts.metrics_addr,
        Endpoints::Metrics,
        metrics.clone(),
        health.clone(),
    )
    .await
    .with_context(|| format!("binding the metrics address {}", opts.metrics_addr))?;
    let h = metrics::spawn(
        opts.healthz_addr,
        Endpoints::Health,
        metrics.clone(),
        health.clone(),
    )
    .await
    .with_context(|| format!("binding the health address {}", opts.healthz_addr))?;
    info!(metrics = %m, healthz = %h, "serving /metrics, /healthz and /livez");
    Ok(())
}

/// The syncer for this node, watching Services, EndpointSlices and Nodes.
fn new_syncer<S: crate::MapStore>(
    opts: &AgentOptions,
    writer: Writer<S>,
    metrics: Arc<Metrics>,
) -> Syncer<S> {
    let node = NodeInfo {
        name: opts.node_name.clone(),
        ..NodeInfo::default()
    };
    Syncer::new(
        writer,
        node,
        opts.proxy_name.clone(),
        if opts.manifests.is_some() {
            &[Kind::Service, Kind::EndpointSlice, Kind::Node][..]
        } else {
            &kube_source::KINDS[..]
        }
        .iter()
        .copied(),
        metrics,
    )
    .with_external_ip_cidrs(opts.external_ip_cidrs.clone())
    .with_lb_algorithm(opts.lb_algorithm)
}

/// `--cleanup-kube-proxy`: waits for the first successful sync (from then on the hooks
/// serve new connections) and removes kube-proxy's leftovers once; never fatal. Without a
/// sync (no API server, say) nothing of kube-proxy's is touched.
async fn cleanup_kube_proxy_when_synced(health: Arc<Health>) {
    while health.check().is_err() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let opts = crate::cleanup::CleanupOptions::default();
    match tokio::task::spawn_blocking(move || crate::cleanup::cleanup_kube_proxy(&opts)).await {
        Ok(report) => report.log(),
        Err(e) => warn!(error = %e, "the kube-proxy cleanup task failed"),
    }
}

/// Applies updates as they come and syncs on the schedule of [`Schedule`]: at most
/// every `min_sync_interval`, fully every `sync_interval`, retrying failed writes with
/// backoff.
// Long: one select loop; a sync's follow-up (shrinker, health checks, node addresses,
// stale UDP flows, schedule) shares the loop's state.
pub async fn sync_loop<S: crate::MapStore>(
    mut syncer: Syncer<S>,
    mut rx: mpsc::Receiver<Update>,
    opts: &AgentOptions,
    health: &Health,
    served: Served,
    shutdown: impl Future<Output = ()>,
) {
    let Served {
        mut node_addresses,
        hooked_cgroup,
        first_sync,
    } = served;
    tokio::pin!(shutdown);
    let mut schedule = Schedule::new(
        opts.min_sync_interval,
        opts.sync_interval,
        Backoff::new(Duration::from_millis(500), Duration::from_secs(30)),
        Instant::now(),
    );
    let mut health_checks = healthcheck::HealthChecks::default();
    let mut stale_udp = ct_cleanup::StaleUdp::new(crate::pins::PinDir::new(&opts.pin_path));
    let mut sources_open = true;
    let mut shrinker = shrink::Shrinker::new(shrink::shrink_after());
    let mut shrink_every = tokio::time::interval(shrink::check_interval(shrink::shrink_after()));
    shrink_every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The last sync written (a fresh node's first is written before the loop:
    // `start::fresh`), followed up before anything else.
    let mut synced = first_sync;
    loop {
        if let Some(out) = synced.take() {
            if out.ops > 0 {
                shrinker.after_sync(syncer.writer());
            }
            after_sync(
                &mut syncer,
                &out,
                health,
                &mut health_checks,
                &mut node_addresses,
                hooked_cgroup.as_deref(),
            )
            .await;
            stale_udp.after_sync(&syncer, &out);
            if let Some(delay) = schedule.synced(Instant::now(), out.failed > 0) {
                warn!(
                    failed = out.failed,
                    retry_in_ms = delay.as_millis() as u64,
                    "sync incomplete; retrying"
                );
            }
        }
        let now = Instant::now();
        if schedule.take_resync(now) {
            syncer.request_full(now);
        }
        let pending = syncer.ready() && syncer.pending();
        let wake = schedule.wake_at(pending, now);
        tokio::select! {
            _ = &mut shutdown => return,
            // Between syncs: the service-side maps long under their low-water mark shrunk.
            _ = shrink_every.tick() => shrink::check(&mut shrinker, &mut syncer),
            u = rx.recv(), if sources_open => match u {
                Some(u) => {
                    let now = Instant::now();
                    syncer.handle(u, now);
                    // Coalesce whatever else is already queued.
                    while let Ok(u) = rx.try_recv() {
                        syncer.handle(u, now);
                    }
                }
                None => {
                    warn!("every source stopped; keeping the maps as they are");
                    sources_open = false;
                }
            },
            _ = tokio::time::sleep_until(wake.into()) => {
                let now = Instant::now();
                if schedule.next_sync(pending, now).is_none_or(|due| due > now) {
                    continue; // woken for the periodic resync, handled above
                }
                // Followed up at the top of the loop.
                synced = Some(syncer.sync(now));
            },
        }
    }
}

/// What the sync loop writes besides the syncer's maps, and a sync written before it.
pub struct Served {
    /// The node's addresses (NodePorts, SNAT, DSR trust, Service CIDRs).
    pub node_addresses: NodeAddresses,
    /// The cgroup the socket hooks are attached to (stale UDP sockets destroyed in it).
    pub hooked_cgroup: Option<PathBuf>,
    /// The outcome of a sync written before the loop (a fresh node's first, written while
    /// its programs loaded: [`start::fresh`]), followed up first.
    pub first_sync: Option<SyncOutcome>,
}

/// What follows every sync: health-check node ports, node health, stale UDP sockets,
/// the node's addresses, memory, and health's timestamp.
async fn after_sync<S: crate::MapStore>(
    syncer: &mut Syncer<S>,
    out: &SyncOutcome,
    health: &Health,
    health_checks: &mut healthcheck::HealthChecks,
    node_addresses: &mut NodeAddresses,
    hooked_cgroup: Option<&std::path::Path>,
) {
    health_checks
        .update(syncer.index().health_check_ports())
        .await;
    health.set_node_deleting(syncer.index().node.deleting);
    let gone = syncer.writer_mut().take_released_udp();
    if let (false, Some(cgroup)) = (gone.is_empty(), hooked_cgroup.map(PathBuf::from)) {
        let metrics = syncer.metrics().clone();
        tokio::task::spawn_blocking(move || {
            let r = crate::sockdestroy::destroy_udp_to(&cgroup, &gone);
            metrics.stale_udp_sockets.inc_by(r.destroyed as u64);
            info!(backends = ?gone, namespaces = r.namespaces, destroyed = r.destroyed,
                  "connected UDP sockets to removed backends destroyed");
            for e in r.errors {
                warn!("destroying stale UDP sockets: {e}");
            }
        });
    }
    let from_node = syncer.index().node.addresses.clone();
    if let Err(e) = node_addresses.update(syncer.writer_mut(), &from_node) {
        warn!(error = %e, "writing the node's addresses failed; kept the previous ones");
        syncer.metrics().map_write_error("node_addresses");
    }
    if let Err(e) = node_addresses.update_dsr_trust(syncer.index()) {
        warn!(error = %e, "writing the DSR trusted senders failed; kept the previous ones");
        syncer.metrics().map_write_error("dsr_trusted");
    }
    if let Err(e) = node_addresses.update_service_cidrs(syncer.index()) {
        warn!(error = %e, "writing the Service CIDRs failed; kept the previous ones");
        syncer.metrics().map_write_error("service_cidrs");
    }
    per_service::relabel(syncer, out);
    let counts = syncer.writer_mut().take_write_counts();
    syncer.metrics().record_map_writes(&counts);
    if out.full || out.ops > 1000 {
        release_freed_memory();
    }
    if out.failed == 0 {
        health.mark_synced();
    } else {
        health.mark_failed(out.failed);
    }
}

/// Hands the heap's free pages back to the kernel after a large sync (the initial one, a
/// relist, the periodic full re-diff): parsing thousands of objects leaves most of the
/// peak free but still resident, about half the agent's RSS at 10,000 Services.
pub(crate) fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: glibc's malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}
