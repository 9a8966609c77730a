//! `cargo xtask bench`: the eBPF datapath and control plane against kube-proxy's
//! iptables (legacy and nft backends), nftables and IPVS modes, side by side, at 1 to
//! 50,000 services, in one run. Methodology (also in docs/benchmarks.md):
//!
//! - **World.** Every mode gets its own stack of namespaces (client pod -> node ->
//!   pods, `topo.rs`); kube-proxy's rules are loaded inside that node namespace, exactly
//!   as kube-proxy writes them (`iptables/`, `nftables.rs`, `ipvs.rs`); our socket
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
pub mod headline;
mod iptables;
mod ipvs;
mod maglev;
mod modes;
mod nftables;
mod plan;
mod pps;
mod progstats;
mod report;
mod rounds;
mod run;
mod stats;
mod topo;

use std::{collections::BTreeMap, path::PathBuf, time::Instant};

use anyhow::{bail, Context as _, Result};
use clap::Subcommand;

use modes::Ctx;
use report::Results;
use run::run;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    /// 1 and 1,000 services, fewer and shorter rounds, the packet-rate part in 1 round (85 s
    /// measured on 2 cores; for CI): fails on any error any mode recorded.
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
    /// The control plane over the Kubernetes API instead (`api/`): programming from the
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
    /// Only the packet-rate part (`pps/`: 64-byte UDP through the node per datapath,
    /// and `BPF_PROG_RUN` ns per packet); --modes and --rounds apply to it.
    #[arg(long, conflicts_with_all = ["api", "no_pps"])]
    pps: bool,
    /// Packet-rate part: run the node's NAPI on cli0 in its own SCHED_FIFO kernel thread
    /// on CPU 1 (default: inline on the generator's CPU, see pps/).
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
    let bench = Bench::new()?;
    api::run(&cfg, &bench.ctx, &out_dir)
}

/// What every bench run sets up first: bpffs, the interrupt handler, the run's child
/// cgroup and manifests directory, and the modes' context over them (removed on drop).
struct Bench {
    ctx: Ctx,
    _cgroup: topo::BenchCgroup,
    _manifests: topo::TempDir,
}

impl Bench {
    fn new() -> Result<Self> {
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
        Ok(Self {
            ctx,
            _cgroup: cgroup,
            _manifests: manifests,
        })
    }
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
