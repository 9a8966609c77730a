//! `cargo xtask bench`: the eBPF datapath and control plane against kube-proxy's
//! iptables (legacy and nft backends), nftables and IPVS modes, side by side, at 1 to
//! 50,000 services, in one run. Methodology (also in docs/benchmarks.md):
//!
//! - **World.** Every mode gets its own stack of namespaces (client pod -> node ->
//!   pods, `topo.rs`); kube-proxy's rules are loaded inside that node namespace, exactly
//!   as kube-proxy writes them (`iptables.rs`, `nftables.rs`, `ipvs.rs`); our socket
//!   mode runs the real `proxy-agent run --manifests` with its hooks on a child cgroup
//!   that only the socket mode's clients join. `direct` sends to the pod IPs (the
//!   physical limit).
//! - **Services.** N services with 10 endpoints each; only the last one (the target,
//!   last in every chain and map) gets traffic; its 10 endpoints are real servers.
//! - **Scales** one after the other (1, 1,000, 10,000, 50,000 by default). For each:
//!   every mode programs N services from nothing (timed, bounded); then `rounds` rounds,
//!   each running every mode's datapath workload (a fresh client process: TCP latency,
//!   UDP latency, connections per second, bulk stream) in an order rotated per round so
//!   drift hits all modes alike, then every mode's endpoint change (one endpoint of the
//!   target replaced, timed until a connection reaches the new endpoint). A mode that
//!   does not finish programming in the time bound, or that even linear growth from the
//!   previous scale predicts will not, gives up at that scale and larger ones.
//! - **Figures.** Latency percentiles pool all rounds' samples; throughputs and change
//!   times are medians over rounds. `results.json` has every round's figures.

mod api;
mod client;
mod iptables;
mod ipvs;
mod maglev;
mod modes;
mod nftables;
mod plan;
mod pps;
mod progstats;
mod report;
mod stats;
mod topo;

use std::{
    collections::BTreeMap,
    net::SocketAddrV4,
    path::PathBuf,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context as _, Result};
use clap::Subcommand;

use client::{Client, Outcome, Spec, Task};
use modes::{Ctx, Mode};
use plan::{Service, BULK_PORT, DNS_PORT, HTTP_PORT};
use report::{ChangeResult, ModeInfo, ModeScale, Results, RoundResult, ScaleResult, Status};

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    /// 1 and 1,000 services, fewer and shorter rounds (under 2 minutes; for CI).
    #[arg(long)]
    quick: bool,
    /// Numbers of services to measure, comma-separated (default 1,1000,10000,50000).
    #[arg(long, value_delimiter = ',')]
    services: Option<Vec<usize>>,
    /// Output directory (default target/bench).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Rounds per scale (default 5, 2 with --quick).
    #[arg(long)]
    rounds: Option<usize>,
    /// Only these modes, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    modes: Option<Vec<String>>,
    /// The control plane over the Kubernetes API instead (`api.rs`): programming from the
    /// paged API list, single changes, restart on pins, memory; side by side with the
    /// manifests path and kube-proxy's rule loads. Scales from --services (default
    /// 1,000, 10,000, 50,000, 100,000; --quick 1,000).
    #[arg(long)]
    api: bool,
    /// With --api: numbers of agents for the cluster-wide latency under churn,
    /// comma-separated (default 1,10,30; --quick 2; 0 skips it).
    #[arg(long, value_delimiter = ',')]
    nodes: Option<Vec<usize>>,
    /// With --api: skip the manifests / iptables / nftables programming at the same N.
    #[arg(long)]
    no_side_by_side: bool,
    /// Only the packet-rate part (`pps.rs`: 64-byte UDP through the node per datapath,
    /// and `BPF_PROG_RUN` ns per packet); --modes and --rounds apply to it.
    #[arg(long, conflicts_with_all = ["api", "no_pps"])]
    pps: bool,
    /// Packet-rate part: run the node's NAPI on cli0 in its own SCHED_FIFO kernel thread
    /// on CPU 1 (default: inline on the generator's CPU, see pps.rs).
    #[arg(long)]
    pps_threaded_napi: bool,
    /// Skip the packet-rate part (it runs after the datapath part otherwise).
    #[arg(long)]
    no_pps: bool,
    /// Redraw results.md and the plots from an earlier run's results.json (into --out,
    /// or beside it), without measuring.
    #[arg(long, value_name = "RESULTS_JSON")]
    replot: Option<PathBuf>,
    #[command(subcommand)]
    internal: Option<Internal>,
}

#[derive(Subcommand)]
enum Internal {
    /// The load generator process (reads its spec on stdin).
    #[command(hide = true)]
    Client,
}

/// What one run does, with its bounds.
#[derive(Debug, Clone, serde::Serialize)]
struct Config {
    quick: bool,
    scales: Vec<usize>,
    rounds: usize,
    warmup: usize,
    tcp_count: usize,
    udp_count: usize,
    latency_max_secs: f64,
    cps_threads: usize,
    cps_secs: f64,
    bulk_secs: f64,
    program_limit_secs: f64,
    change_limit_secs: f64,
    /// Endpoint changes stop for a mode at a scale once they took this long in total.
    change_budget_secs: f64,
    /// How long the control planes are watched at rest after programming.
    idle_secs: f64,
    /// A paused control plane runs this long again before an endpoint change.
    settle_secs: f64,
}

impl Config {
    fn new(args: &Args) -> Result<Self> {
        let quick = args.quick;
        let scales = args.services.clone().unwrap_or_else(|| {
            if quick {
                vec![1, 1000]
            } else {
                vec![1, 1000, 10_000, 50_000]
            }
        });
        if scales.is_empty() || scales.iter().any(|n| *n == 0 || *n > plan::MAX_SERVICES) {
            bail!(
                "--services: each between 1 and {} (the address plan's limit)",
                plan::MAX_SERVICES
            );
        }
        let mut cfg = if quick {
            Config {
                quick,
                scales,
                rounds: 2,
                warmup: 20,
                tcp_count: 300,
                udp_count: 300,
                latency_max_secs: 3.0,
                cps_threads: 2,
                cps_secs: 0.4,
                bulk_secs: 0.4,
                program_limit_secs: 60.0,
                change_limit_secs: 20.0,
                change_budget_secs: 20.0,
                idle_secs: 1.0,
                settle_secs: 0.3,
            }
        } else {
            Config {
                quick,
                scales,
                rounds: 5,
                warmup: 50,
                tcp_count: 2000,
                udp_count: 2000,
                latency_max_secs: 8.0,
                cps_threads: 2,
                cps_secs: 1.5,
                bulk_secs: 1.5,
                program_limit_secs: 300.0,
                change_limit_secs: 120.0,
                change_budget_secs: 90.0,
                idle_secs: 3.0,
                settle_secs: 0.5,
            }
        };
        if let Some(r) = args.rounds {
            cfg.rounds = r.max(1);
        }
        Ok(cfg)
    }
}

pub fn main(args: Args) -> Result<()> {
    if let Some(Internal::Client) = args.internal {
        return client::main();
    }
    if let Some(json) = &args.replot {
        return replot(json, args.out.as_deref());
    }
    if !crate::setup::is_root() {
        bail!("the bench needs root (network namespaces, a cgroup, BPF, iptables): sudo -E cargo xtask bench");
    }
    crate::setup::ensure()?;
    crate::build()?;
    if args.api {
        return run_api(&args);
    }
    run(&args)
}

fn run_api(args: &Args) -> Result<()> {
    let nodes = args
        .nodes
        .clone()
        .map(|v| v.into_iter().filter(|k| *k > 0).collect());
    let cfg = api::ApiConfig::new(
        args.quick,
        args.services.clone(),
        nodes,
        !args.no_side_by_side,
    )?;
    let root = crate::workspace_root();
    let out_dir = args
        .out
        .clone()
        .unwrap_or_else(|| root.join("target/bench-api"));
    topo::ensure_bpffs();
    topo::install_interrupt_handler();
    let cgroup = topo::BenchCgroup::new()?;
    let manifests = topo::TempDir::new("ebpf-proxy-bench-manifests-")?;
    let ctx = Ctx {
        exe: std::env::current_exe().context("the xtask binary")?,
        bin_dir: crate::release_dir(),
        cgroup: cgroup.path.clone(),
        pin_path: PathBuf::from("/sys/fs/bpf").join(topo::unique("ebpf-proxy-bench-")),
        manifests: manifests.0.clone(),
    };
    api::run(&cfg, &ctx, &out_dir)
}

fn replot(json: &std::path::Path, out: Option<&std::path::Path>) -> Result<()> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let results: Results =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))?;
    let dir = out
        .map(std::path::Path::to_path_buf)
        .or_else(|| json.parent().map(std::path::Path::to_path_buf))
        .unwrap_or_default();
    results.write(&dir)?;
    for f in results.plot(&dir)? {
        eprintln!("plot {}", f.display());
    }
    Ok(())
}

fn log(start: Instant, msg: impl AsRef<str>) {
    eprintln!("[{:>6.1}s] {}", start.elapsed().as_secs_f64(), msg.as_ref());
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").trim().to_string()
}

fn machine() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    let cmd = |p: &str, a: &[&str]| {
        std::process::Command::new(p)
            .args(a)
            .output()
            .map(|o| first_line(&String::from_utf8_lossy(&o.stdout)))
            .unwrap_or_default()
    };
    m.insert("nproc".into(), cmd("nproc", &[]));
    m.insert("kernel".into(), cmd("uname", &["-r"]));
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    m.insert("cpu".into(), cpu);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kib| (kib / 1024).to_string())
        .unwrap_or_default();
    m.insert("mem_mib".into(), mem);
    m
}

fn tools() -> BTreeMap<String, String> {
    let mut t = BTreeMap::new();
    for (name, prog, args) in [
        ("iptables-legacy", "iptables-legacy", &["--version"][..]),
        ("iptables-nft", "iptables-nft", &["--version"][..]),
        ("nft", "nft", &["--version"][..]),
        ("ipvsadm", "ipvsadm", &["--version"][..]),
    ] {
        let v = std::process::Command::new(prog)
            .args(args)
            .output()
            .map(|o| {
                let mut s = String::from_utf8_lossy(&o.stdout).to_string();
                s.push_str(&String::from_utf8_lossy(&o.stderr));
                first_line(&s)
            })
            .unwrap_or_else(|e| format!("not found: {e}"));
        t.insert(name.to_string(), v);
    }
    t
}

/// Per mode, across scales.
struct ModeState {
    mode: Box<dyn Mode>,
    available: bool,
    /// Set once the mode gave up or failed: larger scales are not attempted.
    gave_up: Option<String>,
    /// The previous scale's programming time (for the linear prediction).
    last_program: Option<(usize, f64)>,
}

/// Per mode, within one scale.
struct Running {
    idx: usize,
    result: ModeScale,
    tcp_samples: Vec<u64>,
    udp_samples: Vec<u64>,
    swapped: bool,
    change_spent: Duration,
    changes_stopped: bool,
}

fn run(args: &Args) -> Result<()> {
    let cfg = Config::new(args)?;
    let start = Instant::now();
    let root = crate::workspace_root();
    let out_dir = args
        .out
        .clone()
        .unwrap_or_else(|| root.join("target/bench"));
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    topo::ensure_bpffs();
    topo::install_interrupt_handler();
    let cgroup = topo::BenchCgroup::new()?;
    let manifests = topo::TempDir::new("ebpf-proxy-bench-manifests-")?;
    let ctx = Ctx {
        exe: std::env::current_exe().context("the xtask binary")?,
        bin_dir: crate::release_dir(),
        cgroup: cgroup.path.clone(),
        pin_path: PathBuf::from("/sys/fs/bpf").join(topo::unique("ebpf-proxy-bench-")),
        manifests: manifests.0.clone(),
    };
    let pps_cfg = pps::PpsConfig::new(cfg.quick, args.rounds, args.pps_threaded_napi);
    if args.pps {
        let r = pps::run(&ctx, &pps_cfg, args.modes.as_deref(), &out_dir, start)?;
        log(
            start,
            format!("done: {}", out_dir.join("pps-results.json").display()),
        );
        println!("{}", r.markdown());
        return Ok(());
    }

    // Maglev disruption: pure computation, seconds (also with --quick).
    match maglev::run(&ctx.bin_dir, &out_dir) {
        Ok((_, md)) => log(start, format!("Maglev disruption (maglev.md):\n{md}")),
        Err(e) => log(start, format!("Maglev disruption not measured: {e:#}")),
    }

    let mut results = Results::default();
    results.meta.command = std::iter::once("cargo xtask bench".to_string())
        .chain(std::env::args().skip(2))
        .collect::<Vec<_>>()
        .join(" ");
    results.meta.quick = cfg.quick;
    results.meta.started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    results.meta.machine = machine();
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(&root)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
            .unwrap_or_default()
    };
    results.meta.machine.insert(
        "revision".into(),
        format!(
            "{} ({} files changed in the work tree)",
            first_line(&git(&["rev-parse", "--short", "HEAD"])),
            git(&["status", "--porcelain"]).lines().count()
        ),
    );
    results.meta.tools = tools();
    if let serde_json::Value::Object(o) = serde_json::to_value(&cfg)? {
        results.meta.config = o.into_iter().collect();
    }

    let all = modes::all();
    if let Some(only) = &args.modes {
        let names: Vec<&str> = all.iter().map(|m| m.name()).collect();
        if let Some(bad) = only.iter().find(|m| !names.contains(&m.as_str())) {
            bail!("--modes: no mode {bad:?} (modes: {})", names.join(", "));
        }
    }
    let mut states: Vec<ModeState> = Vec::new();
    for mut mode in all {
        if let Some(only) = &args.modes {
            if !only.iter().any(|m| m == mode.name()) {
                continue;
            }
        }
        log(start, format!("setting up {}", mode.name()));
        let setup = mode
            .setup(&ctx)
            .and_then(|()| safety_check(&ctx, mode.as_ref()));
        let (available, reason) = match setup {
            Ok(()) => (true, None),
            Err(r) => {
                log(start, format!("  {} not available: {r}", mode.name()));
                (false, Some(r))
            }
        };
        results.modes.push(ModeInfo {
            name: mode.name().into(),
            description: mode.describe().into(),
            available,
            reason,
        });
        states.push(ModeState {
            mode,
            available,
            gave_up: None,
            last_program: None,
        });
    }
    if !states.iter().any(|s| s.available) {
        bail!("no mode is available");
    }

    let last_scale = cfg.scales.len() - 1;
    for (si, &n) in cfg.scales.iter().enumerate() {
        log(start, format!("== {} services ==", report::thousands(n)));
        let mut services = plan::services(n, false);
        let mut running: Vec<Running> = Vec::new();
        let mut scale = ScaleResult {
            services: n,
            endpoints_per_service: plan::ENDPOINTS,
            modes: Vec::new(),
        };
        for (idx, st) in states.iter_mut().enumerate() {
            topo::check_interrupt()?;
            let name = st.mode.name();
            if !st.available {
                scale
                    .modes
                    .push(ModeScale::new(name, Status::Unavailable, None));
                continue;
            }
            if let Some(why) = &st.gave_up {
                scale
                    .modes
                    .push(ModeScale::new(name, Status::GaveUp, Some(why.clone())));
                continue;
            }
            let mut ms = ModeScale::new(name, Status::Ok, None);
            if st.mode.programs() {
                // Extrapolate only from a time that fixed costs (process start, polling)
                // do not dominate.
                if let Some((prev_n, prev_s)) = st.last_program.filter(|(_, s)| *s >= 1.0) {
                    let predicted = prev_s * n as f64 / prev_n as f64;
                    if predicted > cfg.program_limit_secs {
                        let why = format!(
                            "programming {} services took {prev_s:.1} s; even linear growth predicts {predicted:.0} s at {}, over the {:.0} s bound",
                            report::thousands(prev_n),
                            report::thousands(n),
                            cfg.program_limit_secs
                        );
                        log(start, format!("  {name} gives up: {why}"));
                        st.gave_up = Some(why.clone());
                        scale
                            .modes
                            .push(ModeScale::new(name, Status::GaveUp, Some(why)));
                        continue;
                    }
                }
                log(
                    start,
                    format!("  {name}: programming {} services", report::thousands(n)),
                );
                let limit = Duration::from_secs_f64(cfg.program_limit_secs);
                match st.mode.program(&ctx, &services, limit) {
                    Ok(Some(t)) => {
                        log(start, format!("  {name}: programmed in {:.3} s", t.seconds));
                        st.last_program = Some((n, t.seconds));
                        ms.summary.program_seconds = Some(t.seconds);
                        ms.program = Some(t);
                        ms.agent = st.mode.agent();
                    }
                    Ok(None) => {
                        let why = format!(
                            "programming {} services did not finish within {:.0} s",
                            report::thousands(n),
                            cfg.program_limit_secs
                        );
                        log(start, format!("  {name} gives up: {why}"));
                        st.gave_up = Some(why.clone());
                        if let Err(e) = st.mode.clear(&ctx) {
                            log(start, format!("  {name}: clearing after giving up: {e:#}"));
                        }
                        scale
                            .modes
                            .push(ModeScale::new(name, Status::GaveUp, Some(why)));
                        continue;
                    }
                    Err(e) => {
                        let why = format!("{e:#}");
                        log(start, format!("  {name} failed: {why}"));
                        st.gave_up = Some(format!("failed at {} services", report::thousands(n)));
                        let _ = st.mode.clear(&ctx);
                        scale
                            .modes
                            .push(ModeScale::new(name, Status::Failed, Some(why)));
                        continue;
                    }
                }
            }
            // A short check that the target answers through this mode.
            if let Err(e) = verify(&ctx, st.mode.as_ref(), false) {
                let why = format!("{e:#}");
                log(start, format!("  {name} failed its check: {why}"));
                st.gave_up = Some(format!("failed at {} services", report::thousands(n)));
                let _ = st.mode.clear(&ctx);
                scale
                    .modes
                    .push(ModeScale::new(name, Status::Failed, Some(why)));
                continue;
            }
            // Its control plane at rest (nothing changes), then paused: the next modes
            // program, and all modes' rounds run, without it competing for the CPUs.
            if let Some(before) = st.mode.cpu_seconds() {
                let t = Instant::now();
                std::thread::sleep(Duration::from_secs_f64(cfg.idle_secs));
                if let Some(after) = st.mode.cpu_seconds() {
                    let pct = 100.0 * (after - before) / t.elapsed().as_secs_f64();
                    log(
                        start,
                        format!("  {name}: control plane at rest uses {pct:.0} % of a core"),
                    );
                    ms.agent_idle_cpu_percent = Some(pct);
                }
            }
            st.mode.pause(true);
            running.push(Running {
                idx,
                result: ms,
                tcp_samples: Vec::new(),
                udp_samples: Vec::new(),
                swapped: false,
                change_spent: Duration::ZERO,
                changes_stopped: !st.mode.programs(),
            });
        }

        for round in 0..cfg.rounds {
            let k = running.len();
            let order: Vec<usize> = (0..k).map(|i| (i + round) % k.max(1)).collect();
            for &ri in &order {
                topo::check_interrupt()?;
                let r = &mut running[ri];
                let st = &states[r.idx];
                let endpoints = plan::target_endpoints(r.swapped);
                match datapath_round(&ctx, &cfg, st.mode.as_ref(), &endpoints, round) {
                    Ok((res, tcp, udp)) => {
                        log(
                            start,
                            format!(
                                "  round {}/{} {:<16} tcp p50 {:>8.1} µs  udp p50 {:>8.1} µs  {:>7.0} conn/s  {:>6.2} Gbit/s{}",
                                round + 1,
                                cfg.rounds,
                                st.mode.name(),
                                res.tcp.as_ref().map_or(f64::NAN, |l| l.p50_us),
                                res.udp.as_ref().map_or(f64::NAN, |l| l.p50_us),
                                res.connections_per_second.unwrap_or(f64::NAN),
                                res.bulk_gbit_per_second.unwrap_or(f64::NAN),
                                res.first_error.as_ref().map(|e| format!("  (error: {e})")).unwrap_or_default()
                            ),
                        );
                        r.tcp_samples.extend(tcp);
                        r.udp_samples.extend(udp);
                        r.result.rounds.push(res);
                    }
                    Err(e) => {
                        log(
                            start,
                            format!("  round {} {}: {e:#}", round + 1, st.mode.name()),
                        );
                        r.result.rounds.push(RoundResult {
                            round,
                            first_error: Some(format!("{e:#}")),
                            ..RoundResult::default()
                        });
                    }
                }
            }
            for &ri in &order {
                topo::check_interrupt()?;
                let r = &mut running[ri];
                if r.changes_stopped {
                    continue;
                }
                let st = &mut states[r.idx];
                let t = Instant::now();
                st.mode.pause(false);
                std::thread::sleep(Duration::from_secs_f64(cfg.settle_secs));
                let outcome =
                    endpoint_change(&ctx, &cfg, st.mode.as_mut(), &mut services, r.swapped);
                st.mode.pause(true);
                r.change_spent += t.elapsed();
                let mut ch = ChangeResult {
                    round,
                    ..ChangeResult::default()
                };
                match outcome {
                    Ok(c) => {
                        r.swapped = !r.swapped;
                        log(
                            start,
                            format!(
                                "  change {}/{} {:<16} visible after {:>9.1} ms (command {:>9.1} ms{})",
                                round + 1,
                                cfg.rounds,
                                st.mode.name(),
                                c.visible_ms.unwrap_or(f64::NAN),
                                c.command.as_ref().map_or(f64::NAN, |t| t.seconds * 1e3),
                                c.agent_reported_ms
                                    .map(|a| format!(", agent reports {a:.1} ms"))
                                    .unwrap_or_default()
                            ),
                        );
                        ch = ChangeResult { round, ..c };
                    }
                    Err(e) => {
                        log(
                            start,
                            format!("  change {} {}: {e:#}", round + 1, st.mode.name()),
                        );
                        ch.error = Some(format!("{e:#}"));
                        // The rules' state is unknown now: no more changes at this scale.
                        r.changes_stopped = true;
                    }
                }
                r.result.changes.push(ch);
                if r.change_spent.as_secs_f64() > cfg.change_budget_secs {
                    log(
                        start,
                        format!(
                            "  {}: endpoint changes stop at this scale (budget spent)",
                            st.mode.name()
                        ),
                    );
                    r.changes_stopped = true;
                }
            }
        }
        // Summaries; the mode's result joins the scale in the modes' order.
        for mut r in running {
            summarise(&mut r);
            let pos = scale
                .modes
                .iter()
                .position(|m| {
                    let mi = states.iter().position(|s| s.mode.name() == m.mode);
                    mi.is_some_and(|mi| mi > r.idx)
                })
                .unwrap_or(scale.modes.len());
            scale.modes.insert(pos, r.result);
        }
        results.scales.push(scale);
        results.meta.duration_seconds = start.elapsed().as_secs_f64();
        results.write(&out_dir)?;

        for st in states.iter_mut() {
            st.mode.pause(false);
        }
        if si < last_scale {
            for st in states
                .iter_mut()
                .filter(|s| s.available && s.gave_up.is_none())
            {
                let t = Instant::now();
                if let Err(e) = st.mode.clear(&ctx) {
                    log(start, format!("  {}: clearing: {e:#}", st.mode.name()));
                    st.gave_up = Some(format!("could not clear its rules: {e:#}"));
                } else if t.elapsed() > Duration::from_secs(1) {
                    log(
                        start,
                        format!(
                            "  {}: cleared in {:.1} s",
                            st.mode.name(),
                            t.elapsed().as_secs_f64()
                        ),
                    );
                }
            }
        }
    }

    results.meta.finished = true;
    results.meta.duration_seconds = start.elapsed().as_secs_f64();
    results.write(&out_dir)?;
    match results.plot(&out_dir) {
        Ok(files) => {
            for f in files {
                log(start, format!("plot {}", f.display()));
            }
        }
        Err(e) => log(start, format!("warning: {e:#}")),
    }
    // Stop everything (agents, namespaces, cgroup) before saying we're done.
    drop(states);
    let pps = if args.no_pps {
        None
    } else {
        Some(pps::run(
            &ctx,
            &pps_cfg,
            args.modes.as_deref(),
            &out_dir,
            start,
        )?)
    };
    drop(cgroup);
    drop(manifests);
    log(
        start,
        format!(
            "done: {} and {}",
            out_dir.join("results.json").display(),
            out_dir.join("results.md").display()
        ),
    );
    println!("{}", results.markdown());
    if let Some(p) = pps {
        println!("{}", p.markdown());
    }
    Ok(())
}

/// Before anything is programmed, a ClusterIP must be unreachable from the client
/// namespace: nothing there routes the service CIDR out of the bench's namespaces.
fn safety_check(ctx: &Ctx, mode: &dyn Mode) -> Result<(), String> {
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
fn verify(ctx: &Ctx, mode: &dyn Mode, swapped: bool) -> Result<()> {
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
fn datapath_round(
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
fn endpoint_change(
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
    let Some(seen) = o.seen_at_ns else {
        bail!(
            "{expect} never answered ({} exchanges{})",
            o.ok,
            o.first_error
                .as_ref()
                .map(|e| format!(", error: {e}"))
                .unwrap_or_default()
        );
    };
    Ok(ChangeResult {
        round: 0,
        command: Some(command),
        visible_ms: Some(seen.saturating_sub(t0) as f64 / 1e6),
        agent_reported_ms: mode.change_reported().map(|s| s * 1e3),
        error: None,
    })
}

fn summarise(r: &mut Running) {
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
