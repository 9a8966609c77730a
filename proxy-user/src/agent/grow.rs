//! Conntrack grown online while the agent runs ([`crate::ctsize`]): sampled, and grown by
//! the staged migration off the async runtime; also grown at once when the new-flow rate
//! would fill the tables before the next sample (the rate trigger).

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use tracing::{info, warn};

use super::metrics::{self, Metrics};
use crate::{ctsize, loader, pins::PinDir};

/// Conntrack grown online ([`crate::ctsize`]): every check interval both tables'
/// live entries are counted (gauges), and past the high-water mark both are grown x2
/// toward `ceiling_flows` by the staged migration, on the blocking pool (the servers and
/// the sync loop go on meanwhile); long under the low-water mark, halved. Every rate
/// interval the new-flow rate is read from the outcome counters, and a table that would
/// pass the high-water mark within the lead time grows at once to the size the rate
/// needs ([`ctsize::rate_grown`]). A resize loads new programs, whose kernel log records
/// go to a new ring buffer: the kernel logger follows them.
pub(super) async fn grow_conntrack(
    pin_path: PathBuf,
    metrics: Arc<Metrics>,
    ceiling_flows: u32,
    start_flows: u32,
    kernel_logs: Option<tokio::task::JoinHandle<()>>,
) {
    let mut g = Grower::new(pin_path, metrics, ceiling_flows, start_flows, kernel_logs);
    let mut every = tokio::time::interval(ctsize::check_interval());
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let rate_every = ctsize::rate_interval();
    let mut fast = tokio::time::interval(rate_every.unwrap_or(Duration::from_secs(3600)));
    fast.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first sample at once: the rate trigger's estimate starts from it.
    loop {
        tokio::select! {
            _ = every.tick() => g.on_sample().await,
            _ = fast.tick(), if rate_every.is_some() => {
                g.on_rate(rate_every.unwrap_or(ctsize::RATE_INTERVAL)).await;
            }
        }
    }
}

/// The sampling loop's state.
struct Grower {
    pin_path: PathBuf,
    metrics: Arc<Metrics>,
    ceiling_flows: u32,
    /// Ceiling and floor (the start size) in entries.
    ceiling: u32,
    floor: u32,
    shrink_after: u32,
    /// Samples in a row under the low-water mark.
    low: u32,
    /// The previous sample's fullest table (live entries), for the projection.
    previous: Option<u64>,
    kernel_logs: Option<tokio::task::JoinHandle<()>>,
    /// Online resizes seen (the writer grows the service maps too: its new programs log
    /// to a new buffer as well).
    resizes_seen: u64,
    /// The possible CPUs (length of a per-CPU counter).
    ncpus: usize,
    /// The last reading of [`ctsize::inserted`] and when it was taken.
    inserted: Option<(u64, Instant)>,
    /// The last sample's fullest table and the reading of [`ctsize::inserted`] at it:
    /// the estimate of the live entries since is the one plus what was inserted since.
    at_sample: Option<(u64, u64)>,
    /// The highest rate (entries a second) read since the low-water streak began: a
    /// shrink must hold it.
    streak_peak: u64,
    /// How long the last resize took (the rate trigger's lead).
    last_resize: Duration,
}

impl Grower {
    fn new(
        pin_path: PathBuf,
        metrics: Arc<Metrics>,
        ceiling_flows: u32,
        start_flows: u32,
        kernel_logs: Option<tokio::task::JoinHandle<()>>,
    ) -> Self {
        Self {
            pin_path,
            metrics,
            ceiling_flows,
            ceiling: ceiling_flows.saturating_mul(2),
            floor: start_flows.min(ceiling_flows).saturating_mul(2),
            shrink_after: ctsize::shrink_after(),
            low: 0,
            previous: None,
            kernel_logs,
            resizes_seen: crate::migrate::online_resizes(),
            ncpus: aya::util::nr_cpus().map_or(1, |n| n.max(1)),
            inserted: None,
            at_sample: None,
            streak_peak: 0,
            last_resize: Duration::ZERO,
        }
    }

    fn pins(&self) -> PinDir {
        PinDir::new(&self.pin_path)
    }

    /// Entries inserted so far (`None`: the counters could not be read).
    fn read_inserted(&self) -> Option<u64> {
        ctsize::inserted(&self.pins(), self.ncpus).ok()
    }

    /// The rate trigger: the rate since the last reading, the live entries estimated, a
    /// growth at once when the tables would pass the high-water mark within the lead.
    async fn on_rate(&mut self, interval: Duration) {
        let Some(now) = self.read_inserted() else {
            return;
        };
        let at = Instant::now();
        let Some((before, then)) = self.inserted.replace((now, at)) else {
            return;
        };
        let rate = ctsize::rate(before, now, at - then);
        self.streak_peak = self.streak_peak.max(rate);
        let Some(entries) = self.pins().max_entries(proxy_common::map_names::CT4) else {
            return;
        };
        let estimated = match self.at_sample {
            Some((live, base)) => live.saturating_add(now.saturating_sub(base)),
            None => 0,
        }
        .min(u64::from(entries));
        let lead = ctsize::lead(self.last_resize, interval);
        let Some(to) = ctsize::rate_grown(entries, estimated, rate, lead, self.ceiling) else {
            return;
        };
        info!(
            from_flows = entries / 2,
            to_flows = to / 2,
            ceiling_flows = self.ceiling_flows,
            new_entries_per_second = rate,
            estimated_entries = estimated,
            lead_ms = lead.as_millis() as u64,
            "conntrack new-flow rate would pass its high-water mark: growing the tables online"
        );
        self.low = 0;
        self.streak_peak = 0;
        self.resize(entries, to).await;
    }

    /// One occupancy sample: gauges, then a growth past the high-water mark or a shrink
    /// long under the low-water one.
    async fn on_sample(&mut self) {
        self.follow_resizes();
        let base = self.read_inserted();
        let p = self.pins();
        let started = Instant::now();
        let sample = match tokio::task::spawn_blocking(move || ctsize::sample(&p)).await {
            Ok(Ok(Some(s))) => s,
            Ok(Ok(None)) => return, // no conntrack tables (no TC datapath)
            Ok(Err(e)) => {
                warn!(error = %e, "counting the conntrack tables' entries failed");
                return;
            }
            Err(e) => {
                warn!(error = %e, "the conntrack sampling task failed");
                return;
            }
        };
        self.at_sample = base.map(|b| (sample.fullest(), b));
        self.gauges(&sample, started);
        let expected =
            ctsize::projected(sample.fullest(), self.previous.unwrap_or(sample.fullest()));
        self.previous = Some(sample.fullest());
        let to = if let Some(to) = ctsize::grown(sample.entries, expected, self.ceiling) {
            self.low = 0;
            info!(
                from_flows = sample.entries / 2,
                to_flows = to / 2,
                ceiling_flows = self.ceiling_flows,
                live_entries = ?sample.live,
                expected_entries = expected,
                "conntrack past its high-water mark: growing the tables online"
            );
            to
        } else if ctsize::under_low_water(sample.entries, sample.fullest(), self.floor) {
            if self.low == 0 {
                self.streak_peak = 0;
            }
            self.low += 1;
            if self.low < self.shrink_after {
                return;
            }
            self.low = 0;
            let to = ctsize::shrunk(sample.entries, self.floor);
            if !ctsize::holds_rate(to, self.streak_peak) {
                info!(
                    flows = sample.entries / 2,
                    to_flows = to / 2,
                    new_entries_per_second = self.streak_peak,
                    "conntrack long under its low-water mark, but the new-flow rate needs \
                     its size: kept"
                );
                return;
            }
            info!(
                from_flows = sample.entries / 2,
                to_flows = to / 2,
                start_flows = self.floor / 2,
                live_entries = ?sample.live,
                samples = self.shrink_after,
                "conntrack long under its low-water mark: shrinking the tables online"
            );
            to
        } else {
            self.low = 0;
            return;
        };
        self.resize(sample.entries, to).await;
    }

    /// A new kernel logger when another resize (the writer's) loaded new programs.
    fn follow_resizes(&mut self) {
        let now = crate::migrate::online_resizes();
        if now != self.resizes_seen {
            self.resizes_seen = now;
            if let Some(h) = self.kernel_logs.take() {
                h.abort();
            }
            self.kernel_logs = loader::spawn_kernel_logger(&self.pin_path);
        }
    }

    fn gauges(&self, sample: &ctsize::Occupancy, started: Instant) {
        for (family, live) in ["ipv4", "ipv6"].into_iter().zip(sample.live) {
            self.metrics
                .conntrack_live_entries
                .get_or_create(&metrics::FamilyLabel {
                    family: family.to_string(),
                })
                .set(i64::try_from(live).unwrap_or(i64::MAX));
        }
        self.metrics
            .conntrack_capacity
            .set(i64::from(sample.entries / 2));
        tracing::debug!(
            entries = sample.entries,
            live = ?sample.live,
            total = ?sample.total,
            elapsed_us = started.elapsed().as_micros() as u64,
            "conntrack occupancy sampled"
        );
    }

    /// Both tables resized from `from` to `to` entries by the staged migration, on the
    /// blocking pool; counted, the gauges and the kernel logger updated.
    async fn resize(&mut self, from: u32, to: u32) {
        let started = Instant::now();
        let p = self.pins();
        let pins = self.pins();
        let done = tokio::task::spawn_blocking(move || crate::migrate::resize_conntrack(&p, to));
        match done.await {
            Ok(Ok(resized)) => {
                self.last_resize = started.elapsed();
                self.metrics.count_resizes(&resized);
                let now = pins.max_entries(proxy_common::map_names::CT4).unwrap_or(0);
                self.metrics.conntrack_capacity.set(i64::from(now / 2));
                info!(
                    flows = now / 2,
                    elapsed_ms = self.last_resize.as_millis() as u64,
                    "{}",
                    if to > from {
                        "conntrack tables grown online"
                    } else {
                        "conntrack tables shrunk online"
                    }
                );
                if !resized.is_empty() {
                    // The tables' memory as it is now (not at the next 10 s refresh).
                    let path = self.pin_path.clone();
                    if let Ok(maps) =
                        tokio::task::spawn_blocking(move || loader::map_memory(&path)).await
                    {
                        self.metrics.set_map_memory(&maps);
                    }
                    if let Some(h) = self.kernel_logs.take() {
                        h.abort();
                    }
                    self.kernel_logs = loader::spawn_kernel_logger(&self.pin_path);
                    self.resizes_seen = crate::migrate::online_resizes();
                }
            }
            Ok(Err(e)) => {
                warn!(error = %e, "resizing the conntrack tables failed; kept their size");
                self.metrics
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
