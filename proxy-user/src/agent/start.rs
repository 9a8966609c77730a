//! How the agent comes up ([`super::run`]): on a fresh node (nothing pinned) the sources
//! start first and the maps sized to demand are made at what the first lists need
//! ([`fresh`], [`first_lists`]); on pinned maps (a restart, an upgrade) the datapath is
//! adopted first and the lists read meanwhile ([`on_pins`]). Both start from the sizes
//! of [`start_sizes`].

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{
    install_options, metrics,
    metrics::{Health, Metrics},
    new_metrics, new_syncer, open_datapath, serve_http, source,
    sync::{SyncOutcome, Syncer},
    AgentOptions, Datapath, NodeAddresses, NodePortSelection,
};
use crate::{cluster::Update, loader, pins::PinDir, BpfMaps, Writer};

/// A manifests directory read while the datapath loads ([`source::read_manifests`]).
type Manifests = Option<mpsc::Receiver<Update>>;

/// What the start hands on: the datapath, the metrics, the sources' channel, and on a
/// fresh node its syncer with the first sync written ([`fresh`]).
pub(super) struct Started {
    pub datapath: Datapath,
    pub metrics: Arc<Metrics>,
    pub rx: mpsc::Receiver<Update>,
    pub first: Option<FirstSync>,
}

/// A fresh node's syncer over the maps it made, the node's addresses written, and the
/// outcome of its first sync (`None`: not run, the lists were not in).
pub(super) struct FirstSync {
    pub syncer: Syncer<BpfMaps>,
    pub node_addresses: NodeAddresses,
    pub outcome: Option<SyncOutcome>,
}

/// What either way of coming up starts from ([`fresh`], [`on_pins`]).
pub(super) struct Start {
    pub metrics: Metrics,
    pub health: Arc<Health>,
    pub manifests: Manifests,
    pub interfaces: Vec<String>,
    pub node_addrs: Vec<std::net::IpAddr>,
    /// The maps' sizes at this start ([`start_sizes`]).
    pub sizes: loader::Sizes,
}

/// A fresh node: metrics and health first (/livez answers while the lists are read),
/// then the lists, then the maps at the first sync's sizes, then the programs loaded,
/// verified and attached on a blocking thread WHILE the first sync writes the maps
/// ([`first_sync_while_loading`]).
pub(super) async fn fresh(opts: &AgentOptions, s: Start) -> anyhow::Result<Started> {
    let Start {
        metrics,
        health,
        manifests,
        interfaces,
        node_addrs,
        sizes: start,
    } = s;
    let health = &health;
    let metrics = new_metrics(opts, &node_addrs, metrics);
    serve_http(opts, &metrics, health).await?;
    let mut rx = source::start_source(opts, &metrics, manifests).await?;
    let mut first = new_syncer(
        opts,
        Writer::new(crate::store::MemStore::default()),
        metrics.clone(),
    );
    let sizes = first_lists(opts, &mut first, &mut rx, start).await;
    let (datapath, first) =
        first_sync_while_loading(opts, first, interfaces, node_addrs, sizes, &metrics).await?;
    Ok(Started {
        datapath,
        metrics,
        rx,
        first: Some(first),
    })
}

/// A fresh node's maps made at `sizes` (pinned, empty: milliseconds; the first sync's
/// desired state built meanwhile), then its programs
/// loaded (verified: 0.1-0.2 s) and attached on a blocking thread while the first sync
/// writes every frontend into the maps here. A program attached during the writes sees
/// each frontend whole or not at all: the writer's order (`writer` module doc: backends,
/// reverse NAT, further slot chunks, then the frontends' entries in their own phase) is
/// what every later sync relies on too, and a frontend not yet written is what the node
/// had before (no translation). `/healthz` turns 200 only after both (the sync's
/// follow-up runs in the sync loop, after this returns). The writer's ceilings are set
/// only then: the first sync needs no growth (`first_sync_sizes`), and none may swap
/// the programs while they load.
async fn first_sync_while_loading(
    opts: &AgentOptions,
    mut first: Syncer<crate::store::MemStore>,
    interfaces: Vec<String>,
    node_addrs: Vec<std::net::IpAddr>,
    sizes: loader::Sizes,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(Datapath, FirstSync)> {
    let began = Instant::now();
    let install = install_options(opts, &interfaces, &sizes);
    let making = tokio::task::spawn_blocking(move || loader::make_maps(&install));
    // Meanwhile the first sync's desired state (claims, owners, write order: no map
    // needed; 0.1 s at 50,000 Services), over no programmed frontend: what maps just
    // made hold.
    let prepared = first.prepare(Instant::now());
    let empty = making
        .await
        .context("the map-making task failed")?
        .with_context(|| {
            format!(
                "making the maps at {}{}",
                opts.pin_path.display(),
                super::caps::missing_hint()
            )
        })?;
    let made = began.elapsed();
    // Off the runtime: the servers keep answering and the sources keep reading.
    let o = opts.clone();
    let addrs = node_addrs.clone();
    let loading = tokio::task::spawn_blocking(move || open_datapath(&o, interfaces, addrs, &sizes));
    let writer = if empty {
        fresh_writer(opts)?
    } else {
        // Maps left by an agent that stopped before making them all: read back.
        adopt_maps(opts, metrics).await?
    };
    let (writer, node_addresses) = write_node_addresses(opts, node_addrs, writer)?;
    let mut syncer = first.with_writer(writer);
    let writing = Instant::now();
    let outcome = prepared.map(|p| {
        if !empty {
            // Maps read back: their frontends decide owners; built again over them.
            syncer.requeue(p);
            return syncer.sync(Instant::now());
        }
        syncer.sync_prepared(p, Instant::now())
    });
    let written = writing.elapsed();
    let datapath = loading.await.context("the install task failed")??;
    syncer.writer_mut().set_svc_ceiling(opts.service_entries);
    info!(
        maps_ms = made.as_millis() as u64,
        first_sync_ms = written.as_millis() as u64,
        programs_waited_ms = (began.elapsed() - made - written).as_millis() as u64,
        total_ms = began.elapsed().as_millis() as u64,
        "fresh node: maps made, first sync written while the programs loaded"
    );
    Ok((
        datapath,
        FirstSync {
            syncer,
            node_addresses,
            outcome,
        },
    ))
}

/// Pinned maps: the datapath adopted first, then metrics and health (reading a large
/// pinned state back takes seconds, and /livez must answer meanwhile; /healthz says 503
/// until the first sync), then the sources.
pub(super) async fn on_pins(opts: &AgentOptions, s: Start) -> anyhow::Result<Started> {
    let Start {
        metrics,
        health,
        manifests,
        interfaces,
        node_addrs,
        sizes,
    } = s;
    let health = &health;
    let datapath = open_datapath(opts, interfaces, node_addrs, &sizes)?;
    let metrics = new_metrics(opts, &datapath.node_addrs, metrics);
    super::record_datapath(opts, &datapath, &metrics);
    serve_http(opts, &metrics, health).await?;
    // The sources start before the pinned maps are read back: the lists (seconds at
    // tens of thousands of Services) arrive and are decoded while adoption runs on
    // another thread, and wait in the channel for the syncer (which writes nothing
    // before every initial list is in).
    let rx = source::start_source(opts, &metrics, manifests).await?;
    Ok(Started {
        datapath,
        metrics,
        rx,
        first: None,
    })
}

/// How long a fresh node's agent waits for its first lists before it makes the maps at
/// their start sizes anyway (then the first sync grows them online).
pub const FIRST_LISTS_WAIT: Duration = Duration::from_secs(5);

/// The sizes the maps sized to demand start at on this node: conntrack's within its
/// flags (in flows: `InstallOptions::conntrack_flows`), the service maps' and the
/// others' ([`service_start_sizes`]).
pub(super) fn start_sizes(opts: &AgentOptions) -> anyhow::Result<loader::Sizes> {
    // Both bounds checked before anything is made (the ceiling is only created when the
    // tables grow to it).
    loader::conntrack_entries(opts.conntrack_flows).context("--conntrack-max")?;
    loader::conntrack_entries(opts.conntrack_start).context("--conntrack-start")?;
    // A migration a crash interrupted is settled first: the sizes below are the maps'
    // after it.
    crate::migrate::settle_interrupted(&crate::pins::PinDir::new(&opts.pin_path))
        .context("settling an interrupted migration")?;
    // The conntrack size at this start: the pinned one (grown online) within
    // [--conntrack-start, --conntrack-max], else the nearest bound.
    let conntrack_flows = crate::ctsize::start_flows(
        crate::pins::PinDir::new(&opts.pin_path).max_entries(proxy_common::map_names::CT4),
        opts.conntrack_start,
        opts.conntrack_flows,
    );
    // The service-side maps likewise: the ceiling checked, the maps made small (or kept at
    // their pinned size up to their ceilings); the writer grows them online.
    let (service_entries, map_sizes) = service_start_sizes(opts)?;
    Ok(map_sizes
        .with(loader::SizedMap::Conntrack, conntrack_flows)
        .with(loader::SizedMap::Service, service_entries))
}

/// A fresh node: takes the sources' updates into `first` until every initial list is
/// in (at most [`FIRST_LISTS_WAIT`]) and returns the sizes its first sync needs
/// (`start` where it needs no more: what the writer would grow them to at that sync).
/// Lists not in by then (or a source that stopped): `start`, and the first sync grows
/// the maps online.
async fn first_lists(
    opts: &AgentOptions,
    first: &mut Syncer<crate::store::MemStore>,
    rx: &mut mpsc::Receiver<Update>,
    start: loader::Sizes,
) -> loader::Sizes {
    let began = Instant::now();
    let deadline = tokio::time::Instant::now() + FIRST_LISTS_WAIT;
    while !first.ready() {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(u)) => {
                let now = Instant::now();
                first.handle(u, now);
                while let Ok(u) = rx.try_recv() {
                    first.handle(u, now);
                }
            }
            Ok(None) | Err(_) => {
                warn!(
                    waited_ms = began.elapsed().as_millis() as u64,
                    "the first lists are not in: the maps are made at their start sizes (the first sync grows them)"
                );
                return start;
            }
        }
    }
    let ceilings = loader::Sizes::compiled().with(loader::SizedMap::Service, opts.service_entries);
    let sizing = Instant::now();
    let sizes = first.first_sync_sizes(start, &ceilings, opts.maglev);
    info!(
        services = first.index().service_count(),
        waited_ms = began.elapsed().as_millis() as u64,
        sizing_ms = sizing.elapsed().as_millis() as u64,
        sizes = %crate::store::describe_sizes(&sizes.changed_from(&start)),
        "fresh node: the maps are made at the first sync's sizes"
    );
    sizes
}

/// The size of the service maps at this start (`--service-map-entries` checked: the
/// pinned size up to it, else `loader::SERVICE_START_ENTRIES`) and of the other maps
/// sized to demand (`loader::start_sizes`: made at their floors or kept at their pinned
/// size up to their ceilings; the per-Service counters at their ceiling only with
/// `--metrics-per-service`). The writer grows them online.
fn service_start_sizes(opts: &AgentOptions) -> anyhow::Result<(u32, loader::Sizes)> {
    loader::service_entries(opts.service_entries).context("--service-map-entries")?;
    let pins = crate::pins::PinDir::new(&opts.pin_path);
    let service_entries = loader::service_start_entries(
        pins.max_entries(proxy_common::map_names::SVC4),
        opts.service_entries,
    );
    let sizes = loader::start_sizes(&pins, opts.metrics_per_service.is_some());
    Ok((service_entries, sizes))
}

/// The syncer the sync loop runs: a fresh node's, its first sync written already (while
/// the programs loaded: [`fresh`]), with that sync's outcome; else one over the pinned
/// maps, read back now.
pub(super) async fn syncer(
    opts: &AgentOptions,
    first: Option<FirstSync>,
    node_addrs: Vec<std::net::IpAddr>,
    metrics: Arc<Metrics>,
) -> anyhow::Result<(Syncer<BpfMaps>, NodeAddresses, Option<SyncOutcome>)> {
    if let Some(first) = first {
        return Ok((first.syncer, first.node_addresses, first.outcome));
    }
    let writer = adopt_maps(opts, &metrics).await?;
    let (writer, node_addresses) = write_node_addresses(opts, node_addrs, writer)?;
    Ok((new_syncer(opts, writer, metrics), node_addresses, None))
}

/// Reads the pinned maps back (off the runtime: the servers keep answering meanwhile)
/// and counts the repairs adoption made.
async fn adopt_maps(opts: &AgentOptions, metrics: &Metrics) -> anyhow::Result<Writer<BpfMaps>> {
    let maps = BpfMaps::open(&opts.pin_path)?;
    // Off the runtime: the servers above keep answering while the maps are read back.
    let maglev = opts.maglev;
    let (mut writer, adopted) = tokio::task::spawn_blocking(move || {
        Writer::adopt_with(maps, crate::writer::BATCH_MIN_FRONTENDS, maglev)
    })
    .await
    .context("the adoption task failed")?
    .context("reading the pinned maps back")?;
    writer.set_svc_ceiling(opts.service_entries);
    info!(
        frontends = adopted.frontends,
        backends = adopted.backends,
        orphans_deleted = adopted.orphans_deleted,
        repairs = ?adopted.repairs,
        "adopted the maps' contents"
    );
    for (kind, n) in &adopted.repairs {
        metrics
            .adoption_repairs
            .get_or_create(&metrics::KindLabel {
                kind: kind.label().to_string(),
            })
            .inc_by(*n as u64);
    }
    Ok(writer)
}

/// The writer over maps this agent has just made (nothing to read back: a fresh node,
/// [`loader::make_maps`]); its ceilings are set once the programs serve
/// ([`start::fresh`]).
fn fresh_writer(opts: &AgentOptions) -> anyhow::Result<Writer<BpfMaps>> {
    let mut writer = Writer::new(BpfMaps::open(&opts.pin_path)?);
    writer.set_maglev_params(opts.maglev);
    Ok(writer)
}

/// Writes the node's addresses (and the DSR trusted senders', Service CIDRs' and
/// NodePort selection's settings) through `writer`.
fn write_node_addresses(
    opts: &AgentOptions,
    node_addrs: Vec<std::net::IpAddr>,
    mut writer: Writer<BpfMaps>,
) -> anyhow::Result<(Writer<BpfMaps>, NodeAddresses)> {
    let mut node_addresses = NodeAddresses::new(node_addrs, opts.localhost_nodeports)
        .with_dsr_trust(&PinDir::new(&opts.pin_path), opts.dsr_trusted_cidrs.clone())
        .with_service_cidrs(&PinDir::new(&opts.pin_path), opts.service_cidrs.clone())
        .with_selection(
            opts.nodeport_addresses
                .as_deref()
                .map(NodePortSelection::parse)
                .transpose()
                .map_err(|e| anyhow::anyhow!(e))?,
        );
    node_addresses
        .update(&mut writer, &[])
        .context("writing the node's addresses")?;
    Ok((writer, node_addresses))
}
