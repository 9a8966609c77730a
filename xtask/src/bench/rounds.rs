//! One mode within a round: the safety check before anything is programmed, the traffic
//! check after, its datapath workload, its endpoint change, and the medians over rounds.

use std::{net::SocketAddrV4, time::Duration};

use anyhow::{bail, Context as _, Result};

use super::{
    client::{self, Client, Outcome, Spec, Task},
    modes::{Ctx, Mode},
    plan::{self, Service, BULK_PORT, DNS_PORT, HTTP_PORT},
    report::{ChangeResult, ModeScale, RoundResult},
    stats, topo, Config,
};

/// One mode's state within one scale: its result so far and the samples its rounds
/// gathered (kept by `run`, filled here).
pub(super) struct Running {
    pub(super) idx: usize,
    pub(super) result: ModeScale,
    pub(super) tcp_samples: Vec<u64>,
    pub(super) udp_samples: Vec<u64>,
    pub(super) swapped: bool,
    pub(super) change_spent: Duration,
    pub(super) changes_stopped: bool,
}

/// Before anything is programmed, a ClusterIP must be unreachable from the client
/// namespace: nothing there routes the service CIDR out of the bench's namespaces.
pub(super) fn safety_check(ctx: &Ctx, mode: &dyn Mode) -> Result<(), String> {
    let stack = mode.stack().ok_or("no stack")?;
    let spec = Spec {
        netns: stack.client.path(),
        cgroup: mode.client_cgroup(ctx),
        tasks: vec![Task::ExpectUnreachable {
            target: SocketAddrV4::new(plan::TARGET_VIP, HTTP_PORT),
        }],
    };
    let out = Client::run(&ctx.exe, &spec).map_err(|e| format!("{e:#}"))?;
    match out.first() {
        Some(o) if o.ok == 1 => Ok(()),
        Some(o) => Err(format!(
            "safety check: {}",
            o.first_error.clone().unwrap_or_default()
        )),
        None => Err("safety check: no result".into()),
    }
}

fn check_targets(targets: &[SocketAddrV4]) -> Result<()> {
    for t in targets {
        if !topo::is_bench_address(&std::net::SocketAddr::V4(*t)) {
            bail!("refusing to send to {t}: not an address of the bench's namespaces");
        }
    }
    Ok(())
}

/// 30 exchanges through the mode: all answered, by the target's endpoints only.
pub(super) fn verify(ctx: &Ctx, mode: &dyn Mode, swapped: bool) -> Result<()> {
    let stack = mode.stack().context("no stack")?;
    let endpoints = plan::target_endpoints(swapped);
    let targets = mode.targets(HTTP_PORT, &endpoints);
    check_targets(&targets)?;
    let out = Client::run(
        &ctx.exe,
        &Spec {
            netns: stack.client.path(),
            cgroup: mode.client_cgroup(ctx),
            tasks: vec![Task::TcpLatency {
                targets,
                warmup: 0,
                count: 30,
                max_secs: 10.0,
            }],
        },
    )?;
    let o = out.first().context("no result")?;
    if o.errors > 0 {
        bail!(
            "{} of 30 exchanges failed: {}",
            o.errors,
            o.first_error.clone().unwrap_or_default()
        );
    }
    let allowed: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
    if let Some(bad) = o.answers.keys().find(|a| !allowed.contains(a)) {
        bail!("answered by {bad}, not one of the target's endpoints");
    }
    Ok(())
}

fn gbit(o: &Outcome) -> Option<f64> {
    (o.errors == 0 && o.secs > 0.0).then(|| o.bytes as f64 * 8.0 / o.secs / 1e9)
}

/// One round of one mode's datapath workload, in a fresh client process.
pub(super) fn datapath_round(
    ctx: &Ctx,
    cfg: &Config,
    mode: &dyn Mode,
    endpoints: &[std::net::Ipv4Addr],
    round: usize,
) -> Result<(RoundResult, Vec<u64>, Vec<u64>)> {
    let stack = mode.stack().context("no stack")?;
    let http = mode.targets(HTTP_PORT, endpoints);
    let dns = mode.targets(DNS_PORT, endpoints);
    let bulk = mode.targets(BULK_PORT, endpoints);
    check_targets(&http)?;
    check_targets(&dns)?;
    check_targets(&bulk)?;
    let spec = Spec {
        netns: stack.client.path(),
        cgroup: mode.client_cgroup(ctx),
        tasks: vec![
            Task::TcpLatency {
                targets: http.clone(),
                warmup: cfg.warmup,
                count: cfg.tcp_count,
                max_secs: cfg.latency_max_secs,
            },
            Task::UdpLatency {
                targets: dns,
                warmup: cfg.warmup,
                count: cfg.udp_count,
                max_secs: cfg.latency_max_secs,
            },
            Task::Cps {
                targets: http,
                threads: cfg.cps_threads,
                secs: cfg.cps_secs,
            },
            Task::Bulk {
                target: bulk[0],
                secs: cfg.bulk_secs,
            },
        ],
    };
    let out = Client::run(&ctx.exe, &spec)?;
    let [tcp, udp, cps, bulk] = <[Outcome; 4]>::try_from(out)
        .map_err(|o| anyhow::anyhow!("expected 4 results, got {}", o.len()))?;
    let first_error = [&tcp, &udp, &cps, &bulk]
        .iter()
        .find_map(|o| o.first_error.clone());
    let res = RoundResult {
        round,
        tcp: stats::Latency::from_ns(&tcp.samples_ns),
        tcp_errors: tcp.errors,
        udp: stats::Latency::from_ns(&udp.samples_ns),
        udp_errors: udp.errors,
        connections_per_second: (cps.secs > 0.0).then(|| cps.ok as f64 / cps.secs),
        cps_errors: cps.errors,
        bulk_gbit_per_second: gbit(&bulk),
        endpoints_answered: tcp.answers.len(),
        first_error,
    };
    Ok((res, tcp.samples_ns, udp.samples_ns))
}

/// Replaces one of the target's endpoints (10 <-> 11) and times it until a connection
/// reaches the new endpoint, watched by a client that is already running.
pub(super) fn endpoint_change(
    ctx: &Ctx,
    cfg: &Config,
    mode: &mut dyn Mode,
    services: &mut [Service],
    swapped: bool,
) -> Result<ChangeResult> {
    let stack = mode.stack().context("no stack")?;
    let old = plan::target(swapped);
    let new = plan::target(!swapped);
    let expect = plan::target_endpoint(if swapped {
        plan::ENDPOINTS
    } else {
        plan::ENDPOINTS + 1
    });
    let targets = mode.targets(HTTP_PORT, &new.endpoints);
    check_targets(&targets)?;
    let watcher = Client::start(
        &ctx.exe,
        &Spec {
            netns: stack.client.path(),
            cgroup: mode.client_cgroup(ctx),
            tasks: vec![Task::WaitFor {
                targets,
                expect: expect.to_string(),
                max_secs: cfg.change_limit_secs + 5.0,
            }],
        },
    )?;
    let last = services.len() - 1;
    services[last] = new;
    let t0 = client::monotonic_ns();
    let command = mode.change(
        ctx,
        services,
        &old,
        Duration::from_secs_f64(cfg.change_limit_secs),
    );
    let command = match command {
        Ok(Some(t)) => t,
        Ok(None) => {
            services[last] = old;
            bail!(
                "the change did not finish within {:.0} s",
                cfg.change_limit_secs
            )
        }
        Err(e) => {
            services[last] = old;
            return Err(e);
        }
    };
    let out = watcher.finish()?;
    let o = out.first().context("no result")?;
    let seen = o.seen(&expect.to_string())?;
    Ok(ChangeResult {
        round: 0,
        command: Some(command),
        visible_ms: Some(seen.saturating_sub(t0) as f64 / 1e6),
        agent_reported_ms: mode.change_reported().map(|s| s * 1e3),
        error: None,
    })
}

pub(super) fn summarise(r: &mut Running) {
    let s = &mut r.result.summary;
    s.tcp = stats::Latency::from_ns(&r.tcp_samples);
    s.udp = stats::Latency::from_ns(&r.udp_samples);
    let rounds = &r.result.rounds;
    let med = |f: fn(&RoundResult) -> Option<f64>| {
        stats::median(&rounds.iter().filter_map(f).collect::<Vec<_>>())
    };
    s.connections_per_second = med(|r| r.connections_per_second);
    s.bulk_gbit_per_second = med(|r| r.bulk_gbit_per_second);
    s.errors = rounds
        .iter()
        .map(|r| r.tcp_errors + r.udp_errors + r.cps_errors)
        .sum();
    let ch = &r.result.changes;
    let cmed = |f: fn(&ChangeResult) -> Option<f64>| {
        stats::median(&ch.iter().filter_map(f).collect::<Vec<_>>())
    };
    s.change_visible_ms = cmed(|c| c.visible_ms);
    s.change_command_ms = cmed(|c| c.command.as_ref().map(|t| t.seconds * 1e3));
    s.change_agent_reported_ms = cmed(|c| c.agent_reported_ms);
}
