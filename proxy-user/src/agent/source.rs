//! The agent's source of objects: a manifests directory (read from before the datapath
//! loads) or the Kubernetes API; its updates arrive on one channel for the syncer.

use anyhow::Context as _;
use tokio::sync::mpsc;
use tracing::info;

use super::{bypass, metrics::Metrics, AgentOptions};
use crate::cluster::{kube_source, manifests, Update};

/// `--manifests`: starts reading the directory (its thread polls it from now on); the
/// updates wait on the returned channel for [`start_source`].
pub(super) fn read_manifests(
    opts: &AgentOptions,
    metrics: &Metrics,
) -> anyhow::Result<Option<mpsc::Receiver<Update>>> {
    let Some(dir) = &opts.manifests else {
        return Ok(None);
    };
    info!(dir = %dir.display(), node = %opts.node_name, "source: manifests directory");
    let (tx, rx) = mpsc::channel(4096);
    let source = manifests::ManifestsDir::new(dir, metrics.source.clone())
        .with_proxy_name(opts.proxy_name.clone());
    manifests::spawn(source, opts.manifests_poll, tx).context("starting the manifests thread")?;
    Ok(Some(rx))
}

/// Starts the source (the manifests directory's updates from [`read_manifests`], or the
/// Kubernetes API); its updates arrive on the returned channel.
pub(super) async fn start_source(
    opts: &AgentOptions,
    metrics: &Metrics,
    manifests: Option<mpsc::Receiver<Update>>,
) -> anyhow::Result<mpsc::Receiver<Update>> {
    if let Some(mut from_dir) = manifests {
        let Some(b) = bypass::bypass_options(opts, &metrics.source)? else {
            return Ok(from_dir);
        };
        // Pods and Namespaces to the socket-LB bypass (which needs the pinned maps, so
        // it starts here), the rest on to the syncer.
        let (tx, rx) = mpsc::channel(4096);
        let tx = crate::podbypass::start_manifests(b, tx)?;
        tokio::spawn(async move {
            while let Some(u) = from_dir.recv().await {
                if tx.send(u).await.is_err() {
                    return;
                }
            }
        });
        return Ok(rx);
    }
    let (tx, rx) = mpsc::channel(4096);
    let mut config = kube_source::config(opts.kubeconfig.as_deref()).await?;
    // A list or watch that hangs (the server stopped answering) fails after this
    // long instead of never (kube's default: no read timeout).
    config.read_timeout = Some(opts.api_idle_timeout);
    let host = kube_source::host(&config);
    let client = kube_source::client_from(config)?;
    info!(node = %opts.node_name, %host, "source: Kubernetes API");
    if let Some(b) = bypass::bypass_options(opts, &metrics.source)? {
        crate::podbypass::start(b, &client, &host, opts.api_idle_timeout)?;
    }
    kube_source::spawn(
        client,
        &host,
        opts.proxy_name.as_deref(),
        &opts.node_name,
        tx,
        metrics.source.clone(),
        kube_source::WatchOptions {
            all_nodes: opts.forwarding_mode != crate::ForwardingMode::Snat,
            idle_timeout: opts.api_idle_timeout,
        },
    );
    Ok(rx)
}
