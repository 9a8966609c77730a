//! `--nodes K`: K agents against one apiserver, endpoint churn at a fixed rate, a poller
//! per agent, and each change's latency until it is written on all K.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{
    agent::{ApiAgent, Place},
    objects::{base_endpoints, fresh, loaded_apiserver, slice_obj, ENDPOINTS},
    results::{ApiConfig, Dist, NodesRun},
};
use crate::bench::{
    log,
    modes::{metric, Ctx},
    stats, topo,
};

/// One poller's samples: when the agent's backends gauge took each new value.
type Samples = Arc<Mutex<Vec<(Instant, f64)>>>;

/// `--nodes K` (see the module documentation).
// Long: one measured sequence (start K agents, change, poll every agent's gauge, stop); the
// steps share the timing state.
pub(super) fn nodes(
    cfg: &ApiConfig,
    ctx: &Ctx,
    k: usize,
    run: &mut NodesRun,
    start: Instant,
) -> Result<()> {
    let n = cfg.churn_services;
    let limit = Duration::from_secs_f64(cfg.program_limit_secs);
    let api = loaded_apiserver(n);
    let mut place = Place::new()?;
    let kubeconfig = place.kubeconfig(&api);
    let mut agents = Vec::new();
    let t = Instant::now();
    for a in 0..k {
        let (pins, cgroup) = place.agent(a)?;
        let log_path = place.dir.0.join(format!("agent-{a}.log"));
        agents.push(ApiAgent::start(
            &ctx.bin_dir,
            &kubeconfig,
            &pins,
            &cgroup,
            &log_path,
            n,
        )?);
    }
    for agent in &mut agents {
        agent.wait_healthy(limit)?;
    }
    let want = (n * ENDPOINTS) as f64;
    for agent in &mut agents {
        agent
            .wait_metric("ebpf_proxy_programmed_backends", |v| v >= want, limit)?
            .context("backends not all programmed")?;
    }
    run.start_to_all_healthy_secs = Some(t.elapsed().as_secs_f64());
    let rss: Vec<f64> = agents.iter().filter_map(|a| a.memory_mib().0).collect();
    run.rss_mib_per_agent = stats::median(&rss);
    log(
        start,
        format!(
            "  {k} agents programmed in {:.1} s, VmRSS {:.0} MiB each",
            t.elapsed().as_secs_f64(),
            run.rss_mib_per_agent.unwrap_or_default()
        ),
    );

    // Pollers: per agent, when its backends gauge first reached each value.
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Vec<Samples> = (0..k).map(|_| Arc::new(Mutex::new(Vec::new()))).collect();
    let mut threads = Vec::new();
    for (agent, seen) in agents.iter().zip(&seen) {
        let (port, stop, seen, poll) = (
            agent.metrics,
            stop.clone(),
            seen.clone(),
            Duration::from_millis(cfg.poll_ms.max(k as u64 / 3)),
        );
        threads.push(std::thread::spawn(move || {
            let mut last = -1.0;
            while !stop.load(Ordering::Relaxed) {
                if let Ok((200, body)) = topo::http_get(port, "/metrics") {
                    if let Some(v) = metric(&body, "ebpf_proxy_programmed_backends") {
                        if v != last {
                            last = v;
                            if let Ok(mut s) = seen.lock() {
                                s.push((Instant::now(), v));
                            }
                        }
                    }
                }
                std::thread::sleep(poll);
            }
        }));
    }

    let changes = (cfg.churn_rate * cfg.churn_secs).round() as usize;
    run.changes = changes;
    let bytes0 = api.watch_bytes();
    let spacing = Duration::from_secs_f64(1.0 / cfg.churn_rate);
    let mut accepted = Vec::with_capacity(changes);
    let churn_start = Instant::now();
    for j in 0..changes {
        let due = churn_start + spacing * j as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        // A fresh 11th endpoint: every agent's distinct backends rise by one.
        let i = (j * 7919 + 1) % n;
        let mut eps = base_endpoints(i);
        eps.push(fresh(j));
        api.apply(slice_obj(i, &eps));
        accepted.push(Instant::now());
    }
    // Wait until every agent has every change (or the bound).
    let target = want + changes as f64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline
        && !seen.iter().all(|s| {
            s.lock()
                .map(|v| v.last().is_some_and(|(_, b)| *b >= target))
                .unwrap_or(false)
        })
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Let the last bookmarks of the churn window pass before counting bytes.
    let bytes = api.watch_bytes() - bytes0;
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    run.watch_bytes_per_change = Some(bytes as f64 / changes.max(1) as f64);

    // Change j is on an agent from its first sample with backends >= want + j + 1 (a
    // change may also have re-used an address of an earlier one: none here, all fresh).
    let mut latencies = Vec::new();
    for (j, at) in accepted.iter().enumerate() {
        let need = want + (j + 1) as f64;
        let mut worst: Option<Instant> = None;
        let mut everywhere = true;
        for s in &seen {
            let s = s.lock().map(|v| v.clone()).unwrap_or_default();
            match s.iter().find(|(_, b)| *b >= need) {
                Some((t, _)) => worst = Some(worst.map_or(*t, |w| w.max(*t))),
                None => everywhere = false,
            }
        }
        match worst {
            Some(w) if everywhere => latencies.push(w.saturating_duration_since(*at).as_secs_f64()),
            _ => run.missing += 1,
        }
    }
    run.cluster = Dist::from_secs(&latencies);
    if let Some(d) = &run.cluster {
        log(
            start,
            format!(
                "  {changes} changes: accepted -> on all {k}: p50 {:.1} ms p90 {:.1} ms p99 {:.1} ms; {:.0} watch bytes per change",
                d.p50_ms,
                d.p90_ms,
                d.p99_ms,
                run.watch_bytes_per_change.unwrap_or_default()
            ),
        );
    }
    drop(agents);
    Ok(())
}
