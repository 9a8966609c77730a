//! Conntrack grown online while the agent runs ([`crate::ctsize`]): sampled, and grown by
//! the staged migration off the async runtime.

use std::{path::PathBuf, sync::Arc, time::Instant};

use tracing::{info, warn};

use super::metrics::{self, Metrics};
use crate::loader;

/// Conntrack grown online ([`crate::ctsize`]): every check interval both tables'
/// live entries are counted (gauges), and past the high-water mark both are grown x2
/// toward `ceiling_flows` by the staged migration, on the blocking pool (the servers and
/// the sync loop go on meanwhile). A resize loads new programs, whose kernel log records
/// go to a new ring buffer: the kernel logger follows them.
// Long: one sampling loop (sample, gauges, decide, resize, follow the kernel logger);
// the steps share the previous sample and the logger's handle.
pub(super) async fn grow_conntrack(
    pin_path: PathBuf,
    metrics: Arc<Metrics>,
    ceiling_flows: u32,
    start_flows: u32,
    mut kernel_logs: Option<tokio::task::JoinHandle<()>>,
) {
    let ceiling = ceiling_flows.saturating_mul(2);
    let floor = start_flows.min(ceiling_flows).saturating_mul(2);
    let shrink_after = crate::ctsize::shrink_after();
    // Samples in a row under the low-water mark.
    let mut low = 0u32;
    let mut every = tokio::time::interval(crate::ctsize::check_interval());
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    // The previous sample's fullest table (live entries), for the projection.
    let mut previous = None;
    // Online resizes seen (the writer grows the service maps too: its new programs log
    // to a new buffer as well).
    let mut resizes_seen = crate::migrate::online_resizes();
    loop {
        every.tick().await;
        let resizes_now = crate::migrate::online_resizes();
        if resizes_now != resizes_seen {
            resizes_seen = resizes_now;
            if let Some(h) = kernel_logs.take() {
                h.abort();
            }
            kernel_logs = loader::spawn_kernel_logger(&pin_path);
        }
        let pins = crate::pins::PinDir::new(&pin_path);
        let p = pins.clone();
        let started = Instant::now();
        let sample = match tokio::task::spawn_blocking(move || crate::ctsize::sample(&p)).await {
            Ok(Ok(Some(s))) => s,
            Ok(Ok(None)) => continue, // no conntrack tables (no TC datapath)
            Ok(Err(e)) => {
                warn!(error = %e, "counting the conntrack tables' entries failed");
                continue;
            }
            Err(e) => {
                warn!(error = %e, "the conntrack sampling task failed");
                continue;
            }
        };
        for (family, live) in ["ipv4", "ipv6"].into_iter().zip(sample.live) {
            metrics
                .conntrack_live_entries
                .get_or_create(&metrics::FamilyLabel {
                    family: family.to_string(),
                })
                .set(i64::try_from(live).unwrap_or(i64::MAX));
        }
        metrics
            .conntrack_capacity
            .set(i64::from(sample.entries / 2));
        tracing::debug!(
            entries = sample.entries,
            live = ?sample.live,
            total = ?sample.total,
            elapsed_us = started.elapsed().as_micros() as u64,
            "conntrack occupancy sampled"
        );
        let expected =
            crate::ctsize::projected(sample.fullest(), previous.unwrap_or(sample.fullest()));
        previous = Some(sample.fullest());
        let to = if let Some(to) = crate::ctsize::grown(sample.entries, expected, ceiling) {
            low = 0;
            info!(
                from_flows = sample.entries / 2,
                to_flows = to / 2,
                ceiling_flows,
                live_entries = ?sample.live,
                expected_entries = expected,
                "conntrack past its high-water mark: growing the tables online"
            );
            to
        } else if crate::ctsize::under_low_water(sample.entries, sample.fullest(), floor) {
            low += 1;
            if low < shrink_after {
                continue;
            }
            low = 0;
            let to = crate::ctsize::shrunk(sample.entries, floor);
            info!(
                from_flows = sample.entries / 2,
                to_flows = to / 2,
                start_flows = floor / 2,
                live_entries = ?sample.live,
                samples = shrink_after,
                "conntrack long under its low-water mark: shrinking the tables online"
            );
            to
        } else {
            low = 0;
            continue;
        };
        let started = Instant::now();
        let p = pins.clone();
        match tokio::task::spawn_blocking(move || crate::migrate::resize_conntrack(&p, to)).await {
            Ok(Ok(resized)) => {
                metrics.count_resizes(&resized);
                let now = pins.max_entries(proxy_common::map_names::CT4).unwrap_or(0);
                metrics.conntrack_capacity.set(i64::from(now / 2));
                info!(
                    flows = now / 2,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "{}",
                    if to > sample.entries {
                        "conntrack tables grown online"
                    } else {
                        "conntrack tables shrunk online"
                    }
                );
                if !resized.is_empty() {
                    // The tables' memory as it is now (not at the next 10 s refresh).
                    let path = pin_path.clone();
                    if let Ok(maps) =
                        tokio::task::spawn_blocking(move || loader::map_memory(&path)).await
                    {
                        metrics.set_map_memory(&maps);
                    }
                    if let Some(h) = kernel_logs.take() {
                        h.abort();
                    }
                    kernel_logs = loader::spawn_kernel_logger(&pin_path);
                    resizes_seen = crate::migrate::online_resizes();
                }
            }
            Ok(Err(e)) => {
                warn!(error = %e, "resizing the conntrack tables failed; kept their size");
                metrics
                    .map_write_errors
                    .get_or_create(&metrics::ReasonLabel {
                        reason: "conntrack_resize".into(),
                    })
                    .inc();
            }
            Err(e) => warn!(error = %e, "the conntrack resize task failed"),
        }
    }
}

/// `map_memory_bytes` follows the maps without preallocation as they fill: read every
/// 10 s, and soon after a sync that wrote entries or grew maps (at most once a second, so
/// a stream of small syncs does not read it each time).
pub(super) async fn refresh_map_memory(pin_path: PathBuf, metrics: Arc<Metrics>) {
    let mut every = tokio::time::interval(std::time::Duration::from_secs(10));
    every.tick().await;
    loop {
        tokio::select! {
            _ = every.tick() => {}
            () = metrics.map_memory_changed.notified() => {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
        let path = pin_path.clone();
        if let Ok(maps) = tokio::task::spawn_blocking(move || loader::map_memory(&path)).await {
            metrics.set_map_memory(&maps);
        }
    }
}
