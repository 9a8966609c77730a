//! One N (see the module documentation of `api`): programming from nothing, memory and
//! CPU at rest, single endpoint changes, the restart on the pins, and the same N through
//! the other paths side by side.

use std::{
    collections::BTreeMap,
    fs,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{
    agent::{ApiAgent, Place},
    objects::{base_endpoints, fresh, loaded_apiserver, slice_obj, ENDPOINTS},
    results::{ApiConfig, ApiScale, Dist},
    traffic,
};
use crate::bench::{
    log,
    modes::{self, metric, Ctx, Mode},
    plan, report, topo,
};

/// Spacing of the single changes: past the agent's `--min-sync-interval` (10 ms by
/// default, 50 ms before), so each change is synced on its own.
const CHANGE_SPACING: Duration = Duration::from_millis(60);

// Long: one scale's measured sequence (list, start, first sync, single changes, restart,
// memory); the steps share the agent and the clock, and the order is the measurement.
pub(super) fn one_scale(
    cfg: &ApiConfig,
    ctx: &Ctx,
    n: usize,
    scale: &mut ApiScale,
    gave_up: &mut BTreeMap<String, String>,
    start: Instant,
) -> Result<()> {
    let limit = Duration::from_secs_f64(cfg.program_limit_secs);
    let t = Instant::now();
    let api = loaded_apiserver(n);
    log(
        start,
        format!("  apiserver loaded in {:.1} s", t.elapsed().as_secs_f64()),
    );
    let mut place = Place::new()?;
    let (pins, cgroup) = place.agent(0)?;
    let kubeconfig = place.kubeconfig(&api);
    let log_path = place.dir.0.join("agent-0.log");
    api.clear_requests();
    let mut agent = ApiAgent::start(&ctx.bin_dir, &kubeconfig, &pins, &cgroup, &log_path, n)?;
    scale.service_map_entries = Some(super::agent::service_map_entries(n));
    let spawned = agent.started;
    let healthy = agent.wait_healthy(limit)?;
    scale.start_to_healthy_secs = Some(healthy.as_secs_f64());
    let programmed = agent
        .wait_metric(
            "ebpf_proxy_programmed_frontends",
            |v| v >= n as f64,
            limit.saturating_sub(healthy),
        )?
        .context("not all frontends programmed in the bound")?;
    let first_list = ["Service", "EndpointSlice"]
        .iter()
        .filter_map(|k| api.list_times(k).first().copied())
        .min()
        .context("no list was served")?;
    scale.list_pages = api.list_times("Service").len() + api.list_times("EndpointSlice").len();
    scale.list_to_programmed_secs = Some(programmed.duration_since(first_list).as_secs_f64());
    // Every initial list the agent waits for before its first sync, complete.
    let last_page = ["Service", "EndpointSlice", "Node", "ServiceCIDR"]
        .iter()
        .flat_map(|k| api.list_end_times(k))
        .filter(|t| *t <= programmed)
        .max()
        .context("no list page was written in full")?;
    scale.after_list_to_programmed_secs = Some(
        programmed
            .saturating_duration_since(last_page)
            .as_secs_f64(),
    );
    scale.start_to_programmed_secs = Some(programmed.duration_since(spawned).as_secs_f64());
    log(
        start,
        format!(
            "  healthy after {:.2} s; first list byte -> {n} frontends {:.3} s, last list page -> {n} frontends {:.3} s ({} pages)",
            healthy.as_secs_f64(),
            scale.list_to_programmed_secs.unwrap_or_default(),
            scale.after_list_to_programmed_secs.unwrap_or_default(),
            scale.list_pages
        ),
    );

    // At rest.
    std::thread::sleep(Duration::from_millis(500));
    let cpu0 = agent.cpu_seconds();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(cfg.idle_secs));
    let cpu1 = agent.cpu_seconds();
    if let (Some(a), Some(b)) = (cpu0, cpu1) {
        scale.idle_cpu_percent = Some((b - a) / t.elapsed().as_secs_f64() * 100.0);
    }
    (scale.rss_mib, scale.hwm_mib) = agent.memory_mib();
    scale.map_memory_mib = agent.metrics_text().ok().and_then(|m| {
        let bytes: Vec<f64> = m
            .lines()
            .filter(|l| l.starts_with("ebpf_proxy_map_memory_bytes{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        (!bytes.is_empty()).then(|| bytes.iter().sum::<f64>() / (1024.0 * 1024.0))
    });
    log(
        start,
        format!(
            "  VmRSS {:.1} MiB, VmHWM {:.1} MiB, BPF maps {:.1} MiB (whole node: VmRSS + maps {:.1} MiB), CPU at rest {:.2} %",
            scale.rss_mib.unwrap_or_default(),
            scale.hwm_mib.unwrap_or_default(),
            scale.map_memory_mib.unwrap_or_default(),
            scale.rss_mib.unwrap_or_default() + scale.map_memory_mib.unwrap_or_default(),
            scale.idle_cpu_percent.unwrap_or_default()
        ),
    );

    // Single endpoint changes.
    let name = "ebpf_proxy_network_programming_duration_seconds";
    // kube-proxy's SLI metric, IPv4 slices (the bench's).
    let sli = |m: &str, part: &str| {
        metric(
            m,
            &format!("kubeproxy_network_programming_duration_seconds_{part}{{ip_family=\"IPv4\"}}"),
        )
        .unwrap_or(0.0)
    };
    let (mut agent_secs, mut visible_secs, mut sli_secs) = (Vec::new(), Vec::new(), Vec::new());
    for j in 0..cfg.changes {
        topo::check_interrupt()?;
        let i = (j * 7919 + n / 2) % n;
        let mut eps = base_endpoints(i);
        eps[j % ENDPOINTS] = fresh(j);
        let m = agent.metrics_text()?;
        let (sum0, count0) = (
            metric(&m, &format!("{name}_sum")).unwrap_or(0.0),
            metric(&m, &format!("{name}_count")).unwrap_or(0.0),
        );
        let (sli_sum0, sli_count0) = (sli(&m, "sum"), sli(&m, "count"));
        api.apply(slice_obj(i, &eps));
        let accepted = Instant::now();
        let Some(seen) = agent.wait_metric(
            &format!("{name}_count"),
            |c| c > count0,
            Duration::from_secs(30),
        )?
        else {
            scale
                .errors
                .push(format!("change {j} not reported in 30 s"));
            continue;
        };
        visible_secs.push(seen.duration_since(accepted).as_secs_f64());
        let m = agent.metrics_text()?;
        let (sum1, count1) = (
            metric(&m, &format!("{name}_sum")).unwrap_or(0.0),
            metric(&m, &format!("{name}_count")).unwrap_or(0.0),
        );
        if count1 == count0 + 1.0 {
            agent_secs.push(sum1 - sum0);
        } else {
            scale.changes_unattributed += 1;
        }
        if sli(&m, "count") == sli_count0 + 1.0 {
            sli_secs.push(sli(&m, "sum") - sli_sum0);
        }
        std::thread::sleep(CHANGE_SPACING);
    }
    scale.change_agent = Dist::from_secs(&agent_secs);
    scale.change_sli = Dist::from_secs(&sli_secs);
    if let Some(d) = &scale.change_sli {
        log(
            start,
            format!(
                "  {} changes: kubeproxy_network_programming_duration_seconds (trigger time -> written) p50 {:.2} ms p99 {:.2} ms",
                d.count, d.p50_ms, d.p99_ms
            ),
        );
    }
    scale.change_visible = Dist::from_secs(&visible_secs);
    if let (Some(a), Some(v)) = (&scale.change_agent, &scale.change_visible) {
        log(
            start,
            format!(
                "  {} changes: agent p50 {:.2} ms p99 {:.2} ms; accepted -> written p50 {:.2} ms p99 {:.2} ms",
                v.count, a.p50_ms, a.p99_ms, v.p50_ms, v.p99_ms
            ),
        );
    }

    // The same kind of change, seen in traffic (the probe Service).
    let secs = traffic::traffic_changes(ctx, &api, &cgroup, cfg.changes, CHANGE_SPACING, 30.0)
        .context("endpoint changes in traffic")?;
    scale.change_traffic = Dist::from_secs(&secs);
    if let Some(t) = &scale.change_traffic {
        log(
            start,
            format!(
                "  {} changes in traffic: accepted -> first connection to the new endpoint p50 {:.2} ms p99 {:.2} ms",
                t.count, t.p50_ms, t.p99_ms
            ),
        );
    }

    // Restart on the pins.
    agent.stop();
    if std::env::var_os("BENCH_AGENT_LOG").is_some() {
        // The first agent's log (the restart starts a fresh one), kept for its timestamps.
        let keep = std::env::temp_dir().join(format!("bench-api-agent-{n}-first.log"));
        if fs::copy(&log_path, &keep).is_ok() {
            log(
                start,
                format!("  first agent's log kept at {}", keep.display()),
            );
        }
    }
    api.clear_requests();
    agent.restart()?;
    let healthy = agent.wait_healthy(limit)?;
    let healthy_at = Instant::now();
    scale.restart_to_healthy_secs = Some(healthy.as_secs_f64());
    scale.restart_map_writes = agent.first_sync_ops();
    let pages: Vec<Instant> = ["Service", "EndpointSlice"]
        .iter()
        .flat_map(|k| api.list_times(k))
        .filter(|t| *t <= healthy_at)
        .collect();
    let since = |t: Option<&Instant>| t.map(|t| healthy_at.duration_since(*t).as_secs_f64());
    scale.restart_list_to_healthy_secs = since(pages.iter().min());
    scale.restart_last_page_to_healthy_secs = since(pages.iter().max());
    scale.restart_hwm_mib = agent.memory_mib().1;
    log(
        start,
        format!(
            "  restart on the pins: healthy after {:.2} s ({:.2} s after the first list page, {:.2} s after the last), {:?} map writes, VmHWM {:.1} MiB",
            healthy.as_secs_f64(),
            scale.restart_list_to_healthy_secs.unwrap_or_default(),
            scale.restart_last_page_to_healthy_secs.unwrap_or_default(),
            scale.restart_map_writes,
            scale.restart_hwm_mib.unwrap_or_default()
        ),
    );
    if std::env::var_os("BENCH_AGENT_LOG").is_some() {
        // The restarted agent's log, kept for its timestamps (the run's directory goes).
        let keep = std::env::temp_dir().join(format!("bench-api-agent-{n}.log"));
        if fs::copy(&log_path, &keep).is_ok() {
            log(start, format!("  agent log kept at {}", keep.display()));
        }
    }
    drop(agent);
    drop(api);

    if cfg.side_by_side {
        let side_limit = Duration::from_secs_f64(cfg.side_limit_secs);
        side_by_side(ctx, n, scale, side_limit, gave_up, start);
    }
    Ok(())
}

/// The manifests path and kube-proxy's rule loads at the same N (within the datapath
/// bench's address plan).
fn side_by_side(
    ctx: &Ctx,
    n: usize,
    scale: &mut ApiScale,
    limit: Duration,
    gave_up: &mut BTreeMap<String, String>,
    start: Instant,
) {
    if n > plan::MAX_SERVICES {
        scale.errors.push(format!(
            "side by side: {} services exceed the datapath bench's address plan ({})",
            report::thousands(n),
            report::thousands(plan::MAX_SERVICES)
        ));
        return;
    }
    let services = plan::services(n, false);
    let mut others: Vec<Box<dyn Mode>> = vec![
        Box::new(modes::Socket::default()),
        Box::new(modes::Iptables::new(modes::IptablesVariant::Legacy)),
        Box::new(modes::Iptables::new(modes::IptablesVariant::Nft)),
        Box::new(modes::Nftables::default()),
    ];
    for mode in &mut others {
        let label = match mode.name() {
            "socket" => "manifests".to_string(),
            other => other.to_string(),
        };
        if let Some(why) = gave_up.get(&label) {
            scale.errors.push(format!("{label}: not run ({why})"));
            continue;
        }
        if let Err(why) = mode.setup(ctx) {
            scale.errors.push(format!("{label}: not available: {why}"));
            continue;
        }
        let memcg = rules_memcg(&label, scale);
        let charged_before = memcg.as_ref().and_then(|cg| cg.usage().ok());
        mode.charge_rules_to(memcg.clone());
        match mode.program(ctx, &services, limit) {
            Ok(t) => {
                let secs = t.map(|t| t.seconds);
                log(start, format!("  {label}: {secs:?} s"));
                if secs.is_none() {
                    gave_up.insert(
                        label.clone(),
                        format!(
                            "over the {:.0} s bound at {}",
                            limit.as_secs_f64(),
                            report::thousands(n)
                        ),
                    );
                }
                scale.side_by_side.insert(label.clone(), secs);
                if label == "manifests" {
                    manifests_memory(mode.agent().unwrap_or_default(), scale, start);
                } else if let (Some(_), Some(mib)) = (secs, charged_mib(&memcg, charged_before)) {
                    log(
                        start,
                        format!("  {label}: the rules' kernel memory {mib:.1} MiB"),
                    );
                    scale.side_by_side_kernel_mib.insert(label.clone(), mib);
                }
            }
            Err(e) => scale.errors.push(format!("{label}: {e:#}")),
        }
        mode.charge_rules_to(None);
        if let Err(e) = mode.clear(ctx) {
            scale.errors.push(format!("{label}: clear: {e:#}"));
        }
        // After the clear: the rules' memory is freed (what is left moves to the parent).
        drop(memcg);
    }
}

/// The manifests agent's memory once programmed: VmRSS and its peak, VmHWM (target:
/// peak <= 2x steady).
fn manifests_memory(figures: modes::AgentFigures, scale: &mut ApiScale, start: Instant) {
    scale.manifests_rss_mib = figures.rss_mib;
    scale.manifests_hwm_mib = figures.hwm_mib;
    if let (Some(rss), Some(hwm)) = (figures.rss_mib, figures.hwm_mib) {
        log(
            start,
            format!(
                "  manifests: VmRSS {rss:.1} MiB, VmHWM {hwm:.1} MiB (peak / steady {:.2})",
                hwm / rss
            ),
        );
    }
}

/// kube-proxy's rules are kernel memory, charged to the memory cgroup of the command that
/// loads them: a fresh one per kube-proxy mode (none for the manifests agent, whose maps
/// the agent reports itself).
fn rules_memcg(label: &str, scale: &mut ApiScale) -> Option<std::sync::Arc<modes::MemCgroup>> {
    if label == "manifests" {
        return None;
    }
    match modes::MemCgroup::new("ebpf-proxy-bench-rules-", None) {
        Ok(cg) => Some(std::sync::Arc::new(cg)),
        Err(e) => {
            scale
                .errors
                .push(format!("{label}: no memory cgroup for the rules: {e}"));
            None
        }
    }
}

/// MiB charged to `memcg` since it read `before`.
fn charged_mib(
    memcg: &Option<std::sync::Arc<modes::MemCgroup>>,
    before: Option<u64>,
) -> Option<f64> {
    let after = memcg.as_ref()?.usage().ok()?;
    Some(after.saturating_sub(before?) as f64 / f64::from(1u32 << 20))
}
