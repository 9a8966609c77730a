//! The packet-rate part of `cargo xtask bench` (issue 15, item 4): small UDP packets
//! through the node, per datapath, in packets per second. Two forms, each its own table:
//!
//! ```text
//!  client ns                   node ns (the mode's rules / programs)        pods ns = "node 2"
//!  eth0 <----- veth -----> cli0 (NAPI inline, CPU 0)   pods0 <-- veth --> eth0 (XDP_DROP sink)
//!  generator (CPU 0)            ip_forward, DNAT per mode                   rx counted
//! ```
//!
//! - **Remote backend** (the main table): the frames go to a **NodePort** on the node's
//!   address (10.224.0.1:30053 UDP, eTP=Cluster) whose endpoints are declared on another
//!   node: the pods namespace stands for the backend's node, its `eth0` for that node's
//!   NIC. Every service mode DNATs and SNATs (masquerade) and sends the frame out of
//!   `pods0`; with `--acceleration native` our XDP program does both and sends the frame
//!   with `XDP_REDIRECT` after a FIB lookup, without entering the stack: what Cilium's and
//!   Katran's figures measure. Baselines: `direct` (the frames go to the pod IP, the
//!   stack routes them: plain forwarding) and `xdp-fwd` (plain XDP forwarding: a 60-
//!   instruction XDP program on `cli0`, loaded with raw `bpf(2)`, doing what the kernel's
//!   `samples/bpf/xdp_fwd` does: `bpf_fib_lookup`, TTL decrement, MAC rewrite,
//!   `bpf_redirect`; no NAT). Debian's `xdp-bench` 1.3.1 (`redirect`, `tx`) fails to load
//!   here like `xdp-trafficgen`: its objects hold the `xdp_redirect_map_err` tracepoint
//!   program that kernel 6.18 no longer has.
//! - **Local backend** (the second table): one flow to the ClusterIP from a pod's
//!   address, endpoints on this node: XDP DNATs and passes the frame to the stack
//!   (`XDP_PASS`), which routes it.
//! - **veth and XDP_REDIRECT**: a frame redirected into a veth (`ndo_xdp_xmit`) is put on
//!   the *peer's* ring, and the kernel accepts it only when the peer has NAPI: an XDP
//!   program attached to the peer, or GRO on it (`veth_xdp_xmit` returns `-ENXIO`
//!   otherwise and the frame is dropped). Here
//!   both receiving sides qualify: `cli0` (the generator redirects into the client's
//!   `eth0`, whose peer it is) has GRO on or the mode's XDP program, and the pod's `eth0`
//!   (peer of `pods0`, where the node redirects) has the sink. No XDP program is needed
//!   on the egress veth itself (`pods0`). The dropped frames are not in `ethtool -S`
//!   (the `xdp:xdp_devmap_xmit` tracepoint shows them).
//! - **Verdicts**: every round reads `cli0`'s XDP counters (`ethtool -S`:
//!   `rx_queue_0_xdp_redirect`, `_xdp_tx`, `_xdp_packets`) and the node's IP forwarding
//!   count (`/proc/net/snmp` `ForwDatagrams`), so the table says which path each mode
//!   took (XDP_REDIRECT, XDP_PASS then the stack, stack forwarding, or TC's redirect,
//!   which skips IP forwarding); for our XDP modes the agent's own `XDP_STATS` counters
//!   (`proxyctl stats`) are read too.
//! - **Generator**: our own in-kernel sender, the method of `xdp-trafficgen`:
//!   `BPF_PROG_RUN` with `BPF_F_TEST_XDP_LIVE_FRAMES` of a small XDP program
//!   that redirects the frame out of the client's `eth0`; the kernel sends `repeat`
//!   copies of one 60-byte frame (64 on a wire with the FCS) in batches of 64 without
//!   leaving the syscall, so one core offers several times what one core can forward.
//!   `xdp-trafficgen` 1.3.1 (Debian's) itself cannot run here: its object holds a
//!   tracepoint program for `xdp_redirect_map_err`, which kernel 6.18 no longer has, so
//!   libbpf refuses the whole object. `trafgen` (AF_PACKET) pays an skb per packet on the
//!   sending side and would be the bottleneck.
//! - **Pinning** (2 CPUs): the generator thread is pinned to CPU 0. By default the
//!   node's work runs *inline* on that same CPU: veth needs a NAPI on `cli0` for XDP
//!   frames (GRO on gives it one), and the NAPI runs in the softirq of the CPU that
//!   scheduled it, right after each batch of 64 frames the generator sends; everything
//!   the node does to a packet (XDP, GRO, TC, netfilter, routing, `pods0` transmit) and
//!   the pod's sink run there. The run is self-clocked (offered = received), and the
//!   figure is one core's rate for the generator plus the path: the generator's share
//!   (building nothing, one redirect per frame) is the same for every mode. RPS is off
//!   (veth default); CPU 1 is left to the rest of the machine. `--pps-threaded-napi`
//!   moves `cli0`'s NAPI to a kernel thread of its own (`/sys/class/net/cli0/threaded`)
//!   pinned to CPU 1 with SCHED_FIFO (as a softirq would, it preempts whatever runs
//!   there), the generator alone on CPU 0: the "node on its own core" setup. On this
//!   Firecracker VM that setup measures the cross-CPU wake-ups instead (each batch wakes
//!   the thread; the veth ring holds 256 frames, and most overflow): 0.05-0.08 Mpps for
//!   every mode, so it is not the default.
//! - **Receiver**: a 2-instruction `XDP_DROP` program on the pod's `eth0` (native veth
//!   XDP); the received count is the veth's `rx_queue_0_xdp_drops` (`ethtool -S`) over a
//!   fixed interval after a warm-up. The node has static neighbour entries for the pod
//!   addresses (the sink would drop ARP).
//! - **One flow**: one 5-tuple per mode, so every mode is in its steady state: a
//!   conntrack hit per packet (iptables, nftables, our TC and XDP); the first-packet
//!   costs are what the `BPF_PROG_RUN` part measures. For the same reason `xdp` and
//!   `xdp-maglev` differ only in how the flow's first packet chose its backend.
//! - **Modes** are the datapath bench's own (same rules, same agent, `modes/`):
//!   `direct`, `xdp-fwd` (remote form only), `iptables-legacy`, `nftables` (kube-proxy's
//!   rules in the node namespace: NodePort `KUBE-NODEPORTS`/`KUBE-EXT-*` and
//!   `service-nodeports`/`external-*` for the remote form, ClusterIP for the local one),
//!   `tc` (the agent in the node namespace with its TC programs on `cli0`), `xdp` (the
//!   same with `--acceleration native`), `xdp-maglev` (and `--lb-algorithm maglev`;
//!   remote form only: Maglev is for external frontends). Rounds interleave the modes.

use std::{
    io,
    net::Ipv4Addr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde::{Deserialize, Serialize};

use super::{
    log,
    modes::{self, Ctx, Mode, Timing},
    plan::{self, Service, CLIENT_IP, DNS_PORT, NODE_CLIENT_SIDE, NODE_PORT, TARGET_VIP},
    progstats, stats,
    topo::{self, ns_run, Netns, NetnsGuard, Stack},
};

/// The generator's CPU and the node's.
const GENERATOR_CPU: usize = 0;
const NODE_CPU: usize = 1;
/// Frames per `BPF_PROG_RUN` call of the generator.
const REPEAT: u32 = 16_384;
/// The generator's source port.
const SRC_PORT: u16 = 40_000;
/// Ethernet frame length without FCS: a 64-byte frame on a wire.
const FRAME_LEN: usize = 60;

#[derive(Clone, Debug, Serialize)]
pub struct PpsConfig {
    pub quick: bool,
    pub rounds: usize,
    /// Measured interval per round, after the warm-up.
    pub secs: f64,
    pub warmup_secs: f64,
    /// cli0's NAPI in its own SCHED_FIFO thread on CPU 1 (else inline: on the
    /// generator's CPU, right after each batch it sends).
    pub threaded_napi: bool,
}

impl PpsConfig {
    pub fn new(quick: bool, rounds: Option<usize>, threaded_napi: bool) -> Self {
        let mut c = if quick {
            // 12 modes in two tables: about 10 s of rounds.
            Self {
                quick,
                rounds: 1,
                secs: 0.6,
                warmup_secs: 0.2,
                threaded_napi,
            }
        } else {
            Self {
                quick,
                rounds: 5,
                secs: 3.0,
                warmup_secs: 0.5,
                threaded_napi,
            }
        };
        if let Some(r) = rounds {
            c.rounds = r.max(1);
        }
        c
    }
}

/// Which table: the NodePort to a backend on another node, or the ClusterIP to one on
/// this node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Form {
    #[default]
    Remote,
    Local,
}

impl Form {
    fn title(self) -> &'static str {
        match self {
            Form::Remote => "remote backend: NodePort 10.224.0.1:30053/UDP (eTP=Cluster) -> a pod on another node (DNAT + SNAT, out of pods0)",
            Form::Local => "local backend: ClusterIP 10.96.0.10:53/UDP from a pod -> a pod on this node (DNAT, routed by the stack)",
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PpsRound {
    pub round: usize,
    pub secs: f64,
    pub received: u64,
    pub mpps: f64,
    /// What the generator sent in the same interval.
    pub offered_mpps: f64,
    /// `cli0`'s XDP counters and the node's IP forwarding over the interval.
    pub path: PathCounts,
    /// The agent's `XDP_STATS` over the interval (reason -> count), our XDP modes only.
    pub xdp_stats: Option<std::collections::BTreeMap<String, u64>>,
    pub error: Option<String>,
}

/// Deltas of the node's counters over one round.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct PathCounts {
    /// Frames `cli0`'s NAPI took (`rx_queue_0_xdp_packets`: counted with or without
    /// an XDP program).
    pub xdp_packets: u64,
    pub xdp_redirect: u64,
    pub xdp_tx: u64,
    pub xdp_drops: u64,
    /// The node's `Ip: ForwDatagrams` (`/proc/net/snmp`): the stack's IP forwarding.
    pub ip_forwarded: u64,
}

impl PathCounts {
    fn read(node: &Netns) -> Result<Self> {
        let s = veth_stats(node, "cli0")?;
        let get = |k: &str| s.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
        Ok(Self {
            xdp_packets: get("rx_queue_0_xdp_packets"),
            xdp_redirect: get("rx_queue_0_xdp_redirect"),
            xdp_tx: get("rx_queue_0_xdp_tx"),
            xdp_drops: get("rx_queue_0_xdp_drops"),
            ip_forwarded: ip_forwarded(node)?,
        })
    }

    fn since(self, b: Self) -> Self {
        Self {
            xdp_packets: self.xdp_packets.saturating_sub(b.xdp_packets),
            xdp_redirect: self.xdp_redirect.saturating_sub(b.xdp_redirect),
            xdp_tx: self.xdp_tx.saturating_sub(b.xdp_tx),
            xdp_drops: self.xdp_drops.saturating_sub(b.xdp_drops),
            ip_forwarded: self.ip_forwarded.saturating_sub(b.ip_forwarded),
        }
    }

    /// The path the frames took, from the counters, as a share of what the pod received.
    /// `xdp`: whether the mode has an XDP program on `cli0` (veth counts
    /// `xdp_packets` for every frame its NAPI takes, program or not).
    fn verdict(&self, received: u64, xdp: bool) -> String {
        let pct = |n: u64| (n as f64 * 100.0 / received.max(1) as f64).min(999.0);
        let fwd = pct(self.ip_forwarded);
        if !xdp {
            if fwd >= 50.0 {
                format!("no XDP; stack forwarding ({fwd:.0}% IP-forwarded)")
            } else {
                format!("no XDP; not IP-forwarded ({fwd:.0}%): TC redirect")
            }
        } else if pct(self.xdp_redirect) >= 50.0 {
            format!(
                "XDP_REDIRECT ({:.0}%, {fwd:.0}% IP-forwarded)",
                pct(self.xdp_redirect)
            )
        } else if pct(self.xdp_tx) >= 50.0 {
            format!("XDP_TX ({:.0}%)", pct(self.xdp_tx))
        } else {
            format!("XDP_PASS, then the stack ({fwd:.0}% IP-forwarded)")
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PpsMode {
    pub mode: String,
    pub describe: String,
    pub available: bool,
    pub reason: Option<String>,
    pub rounds: Vec<PpsRound>,
    /// Median over rounds, Mpps received by the pod.
    pub mpps: Option<f64>,
    pub offered_mpps: Option<f64>,
    /// `mpps` / direct's (plain stack forwarding).
    pub ratio_to_direct: Option<f64>,
    /// `mpps` / xdp-fwd's (plain XDP forwarding; remote form).
    pub ratio_to_xdp_fwd: Option<f64>,
    /// `mpps` / iptables-legacy's.
    pub ratio_to_iptables: Option<f64>,
    /// `mpps` / our TC's.
    pub ratio_to_tc: Option<f64>,
    /// The path the frames took (the last good round's counters).
    pub verdict: Option<String>,
    /// What the agent's maps say about the frontend (`maglev` flag), our modes only.
    pub frontend_flags: Option<String>,
    /// The cli0 ingress program's own ns per packet under the flood (the kernel's
    /// run-time statistics over one extra round, not counted in `mpps`), with the
    /// program and its runs: modes with a program (ours, `xdp-fwd`).
    pub program_ns: Option<f64>,
    pub program: Option<String>,
    pub program_runs: Option<u64>,
    pub program_error: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PpsTable {
    pub form: Form,
    pub title: String,
    pub modes: Vec<PpsMode>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PpsResults {
    pub config: serde_json::Value,
    pub machine: std::collections::BTreeMap<String, String>,
    pub pinning: Vec<String>,
    /// The remote-backend table first, then the local one.
    pub tables: Vec<PpsTable>,
    /// `BPF_PROG_RUN` ns per packet (`bench-prog-run`'s JSON), when it ran.
    pub prog_run: Option<serde_json::Value>,
    pub prog_run_error: Option<String>,
    pub duration_seconds: f64,
}

/// Whether this build's agent has `--acceleration` (XDP).
fn agent_has_xdp(ctx: &Ctx) -> bool {
    Command::new(ctx.bin_dir.join("proxy-agent"))
        .args(["run", "--help"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("--acceleration"))
        .unwrap_or(false)
}

/// Plain XDP forwarding: `direct`'s stack, with [`fib_forward_program`] attached to
/// `cli0` by [`prepare`]; the frames go to the pod IP.
#[derive(Default)]
struct XdpFwd(modes::Direct);

impl Mode for XdpFwd {
    fn name(&self) -> &'static str {
        "xdp-fwd"
    }
    fn describe(&self) -> &'static str {
        "plain XDP forwarding to the pod IP (bpf_fib_lookup, TTL, MACs, bpf_redirect; no NAT): the XDP limit"
    }
    fn setup(&mut self, ctx: &Ctx) -> Result<(), String> {
        self.0.setup(ctx)
    }
    fn stack(&self) -> Option<&Stack> {
        self.0.stack()
    }
    fn targets(&self, port: u16, endpoints: &[Ipv4Addr]) -> Vec<std::net::SocketAddrV4> {
        self.0.targets(port, endpoints)
    }
    fn programs(&self) -> bool {
        false
    }
    fn program(&mut self, ctx: &Ctx, s: &[Service], l: Duration) -> Result<Option<Timing>> {
        self.0.program(ctx, s, l)
    }
    fn change(
        &mut self,
        ctx: &Ctx,
        s: &[Service],
        old: &Service,
        l: Duration,
    ) -> Result<Option<Timing>> {
        self.0.change(ctx, s, old, l)
    }
    fn clear(&mut self, ctx: &Ctx) -> Result<()> {
        self.0.clear(ctx)
    }
}

/// One entry of a table: the mode, our agent's pin directory (for its counters), and
/// why it cannot run in this build, if so.
struct Entry {
    mode: Box<dyn Mode>,
    pins: Option<PathBuf>,
    unavailable: Option<String>,
}

/// The modes of one form, in the table's order.
fn pps_modes(ctx: &Ctx, form: Form) -> Vec<Entry> {
    let has_xdp = agent_has_xdp(ctx);
    let plain = |mode: Box<dyn Mode>| Entry {
        mode,
        pins: None,
        unavailable: None,
    };
    let ours = |s: modes::Socket, xdp: bool| Entry {
        pins: Some(s.pin_path(ctx)),
        unavailable: (xdp && !has_xdp).then(|| {
            "not available in this build (proxy-agent run has no --acceleration)".to_string()
        }),
        mode: Box::new(s),
    };
    let mut v = vec![plain(Box::<modes::Direct>::default())];
    if form == Form::Remote {
        v.push(plain(Box::<XdpFwd>::default()));
    }
    v.push(plain(Box::new(modes::Iptables::new(
        modes::IptablesVariant::Legacy,
    ))));
    v.push(plain(Box::<modes::Nftables>::default()));
    v.push(ours(modes::Socket::tc(), false));
    v.push(ours(modes::Socket::xdp(), true));
    if form == Form::Remote {
        v.push(ours(modes::Socket::xdp_maglev(), true));
    }
    v
}

/// One mode, programmed and prepared: the sink attached, NAPI threaded and pinned.
struct Prepared {
    mode: Box<dyn Mode>,
    pins: Option<PathBuf>,
    _sink: OwnedFd,
    /// `xdp-fwd`'s program on cli0 (its link).
    _fwd: Option<OwnedFd>,
    dst: Ipv4Addr,
    dport: u16,
    frame: Vec<u8>,
}

pub fn run(
    ctx: &Ctx,
    cfg: &PpsConfig,
    only: Option<&[String]>,
    out_dir: &Path,
    start: Instant,
) -> Result<PpsResults> {
    let t0 = Instant::now();
    let mut results = PpsResults {
        config: serde_json::to_value(cfg)?,
        machine: super::machine(),
        ..PpsResults::default()
    };
    if !cfg.threaded_napi {
        results.pinning.push(format!(
            "generator thread pinned to CPU {GENERATOR_CPU}; the node's receive, forwarding and the pod's sink run in the softirq of that same CPU, right after each batch of 64 frames the generator sends (self-clocked: offered = received); RPS off; CPU {NODE_CPU} is left to the rest of the machine"
        ));
    } else if super::client::cpus() < 2 {
        results
            .pinning
            .push("one CPU only: generator and node share it".into());
    } else {
        results.pinning.push(format!(
            "generator thread on CPU {GENERATOR_CPU}; cli0's threaded-NAPI kthread (the node's forwarding and the pod's sink) on CPU {NODE_CPU}, SCHED_FIFO; RPS off"
        ));
    }
    for form in [Form::Remote, Form::Local] {
        let table = run_form(ctx, cfg, form, only, start)?;
        results.tables.push(table);
    }
    log(start, "== BPF_PROG_RUN ns per packet ==");
    match prog_run(cfg.quick) {
        Ok(v) => results.prog_run = Some(v),
        Err(e) => {
            log(start, format!("  BPF_PROG_RUN part failed: {e:#}"));
            results.prog_run_error = Some(format!("{e:#}"));
        }
    }
    results.duration_seconds = t0.elapsed().as_secs_f64();
    std::fs::write(
        out_dir.join("pps-results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    std::fs::write(out_dir.join("pps-results.md"), results.markdown())?;
    Ok(results)
}

fn run_form(
    ctx: &Ctx,
    cfg: &PpsConfig,
    form: Form,
    only: Option<&[String]>,
    start: Instant,
) -> Result<PpsTable> {
    let mut table = PpsTable {
        form,
        title: form.title().into(),
        modes: Vec::new(),
    };
    log(
        start,
        format!(
            "== packet rate (64-byte UDP, one flow), {} ==",
            form.title()
        ),
    );
    let mut prepared: Vec<(usize, Prepared)> = Vec::new();
    for Entry {
        mut mode,
        pins,
        unavailable,
    } in pps_modes(ctx, form)
    {
        topo::check_interrupt()?;
        let name = mode.name();
        if only.is_some_and(|o| !o.iter().any(|m| m == name)) {
            continue;
        }
        let mut entry = PpsMode {
            mode: name.into(),
            describe: mode.describe().into(),
            ..PpsMode::default()
        };
        if let Some(why) = unavailable {
            log(start, format!("  {name}: {why}"));
            entry.reason = Some(why);
            table.modes.push(entry);
            continue;
        }
        match prepare(ctx, mode.as_mut(), form, cfg.threaded_napi) {
            Ok(p) => {
                log(start, format!("  {name}: ready ({})", p.pinned));
                entry.available = true;
                entry.frontend_flags = pins.as_deref().and_then(|p| frontend_flags(ctx, p));
                table.modes.push(entry);
                prepared.push((
                    table.modes.len() - 1,
                    Prepared {
                        mode,
                        pins,
                        _sink: p.sink,
                        _fwd: p.fwd,
                        dst: p.dst,
                        dport: p.dport,
                        frame: p.frame,
                    },
                ));
            }
            Err(e) => {
                log(start, format!("  {name} not available: {e:#}"));
                entry.reason = Some(format!("{e:#}"));
                table.modes.push(entry);
            }
        }
    }
    for p in prepared.iter_mut() {
        p.1.mode.pause(true);
    }
    for round in 0..cfg.rounds {
        let k = prepared.len();
        for i in 0..k {
            topo::check_interrupt()?;
            let (idx, p) = &prepared[(i + round) % k];
            let stack = p.mode.stack().context("no stack")?;
            let r = measure(ctx, stack, p, cfg).unwrap_or_else(|e| PpsRound {
                error: Some(format!("{e:#}")),
                ..PpsRound::default()
            });
            log(
                start,
                format!(
                    "  round {}/{} {:<16} {:>6.3} Mpps received (offered {:.3}, to {}:{}; {}){}",
                    round + 1,
                    cfg.rounds,
                    p.mode.name(),
                    r.mpps,
                    r.offered_mpps,
                    p.dst,
                    p.dport,
                    r.path.verdict(r.received, has_xdp(p.mode.name())),
                    r.error
                        .as_ref()
                        .map(|e| format!("  (error: {e})"))
                        .unwrap_or_default()
                ),
            );
            table.modes[*idx].rounds.push(PpsRound { round, ..r });
        }
    }
    profile(ctx, cfg, &prepared, &mut table, start);
    drop(prepared);
    for m in table.modes.iter_mut() {
        let ok: Vec<&PpsRound> = m.rounds.iter().filter(|r| r.error.is_none()).collect();
        m.mpps = stats::median(&ok.iter().map(|r| r.mpps).collect::<Vec<_>>());
        m.offered_mpps = stats::median(&ok.iter().map(|r| r.offered_mpps).collect::<Vec<_>>());
        m.verdict = ok
            .last()
            .map(|r| r.path.verdict(r.received, has_xdp(&m.mode)));
    }
    let of = |name: &str| {
        table
            .modes
            .iter()
            .find(|m| m.mode == name)
            .and_then(|m| m.mpps)
    };
    let (direct, fwd, ipt, tc) = (of("direct"), of("xdp-fwd"), of("iptables-legacy"), of("tc"));
    for m in table.modes.iter_mut() {
        m.ratio_to_direct = stats::ratio(m.mpps, direct);
        m.ratio_to_xdp_fwd = stats::ratio(m.mpps, fwd);
        m.ratio_to_iptables = stats::ratio(m.mpps, ipt);
        m.ratio_to_tc = stats::ratio(m.mpps, tc);
    }
    Ok(table)
}

/// The program that handles the frames on `cli0`'s ingress, if the mode has one: our
/// agent's (from its pinned link: XDP when it has XDP, else TC) or `xdp-fwd`'s.
fn cli0_program(p: &Prepared) -> Option<Result<(String, u32)>> {
    if let Some(fwd) = &p._fwd {
        return Some(
            progstats::link_prog_id(fwd)
                .map(|id| ("xdp-fwd's program".to_string(), id))
                .map_err(Into::into),
        );
    }
    let pins = p.pins.as_ref()?;
    let link = if has_xdp(p.mode.name()) {
        "xdp-cli0"
    } else {
        "tc-cli0-ingress"
    };
    let path = pins.join("links").join(link);
    Some(
        progstats::linked_prog_id(&path)
            .map(|id| (format!("the agent's links/{link}"), id))
            .map_err(Into::into),
    )
}

/// One more round per mode with a program on `cli0`, with the kernel's run-time
/// statistics on (`BPF_ENABLE_STATS`): the program's own ns per packet under the
/// flood. Apart from the measured rounds, because the statistics add two clock reads
/// to every program run (the generator's and the sink's too).
fn profile(
    ctx: &Ctx,
    cfg: &PpsConfig,
    prepared: &[(usize, Prepared)],
    table: &mut PpsTable,
    start: Instant,
) {
    for (idx, p) in prepared {
        let Some(prog) = cli0_program(p) else {
            continue;
        };
        let m = &mut table.modes[*idx];
        let r = (|| -> Result<(f64, u64, String)> {
            let (what, id) = prog?;
            let stack = p.mode.stack().context("no stack")?;
            let _on = progstats::enable().context("BPF_ENABLE_STATS")?;
            let before = progstats::run_stats(id)?;
            measure(ctx, stack, p, cfg)?;
            let after = progstats::run_stats(id)?;
            let (ns, runs) = progstats::per_run(before, after)
                .with_context(|| format!("{what} (id {id}) did not run"))?;
            Ok((ns, runs, format!("{what} (id {id})")))
        })();
        match r {
            Ok((ns, runs, what)) => {
                log(
                    start,
                    format!(
                        "  {:<16} program: {ns:.0} ns per packet over {runs} runs ({what})",
                        p.mode.name()
                    ),
                );
                m.program_ns = Some(ns);
                m.program_runs = Some(runs);
                m.program = Some(what);
            }
            Err(e) => {
                log(start, format!("  {} program: {e:#}", p.mode.name()));
                m.program_error = Some(format!("{e:#}"));
            }
        }
    }
}

/// Whether the mode has an XDP program on `cli0` (ours or `xdp-fwd`'s).
fn has_xdp(mode: &str) -> bool {
    matches!(mode, "xdp" | "xdp-maglev" | "xdp-fwd")
}

/// What [`prepare`] made.
struct Ready {
    sink: OwnedFd,
    fwd: Option<OwnedFd>,
    dst: Ipv4Addr,
    dport: u16,
    frame: Vec<u8>,
    pinned: String,
}

/// Sets the mode up with the form's one service programmed, then the sink, the
/// neighbours, `xdp-fwd`'s program and the NAPI thread.
fn prepare(ctx: &Ctx, mode: &mut dyn Mode, form: Form, threaded: bool) -> Result<Ready> {
    mode.setup(ctx).map_err(|e| anyhow::anyhow!(e))?;
    if mode.programs() {
        let services = match form {
            Form::Remote => vec![plan::remote_target()],
            Form::Local => plan::services(1, false),
        };
        mode.program(ctx, &services, Duration::from_secs(60))?
            .context("programming one service took more than 60 s")?;
    }
    let stack = mode.stack().context("no stack")?;
    let endpoints = plan::target_endpoints(false);
    let (dst, dport) = if form == Form::Remote && mode.programs() {
        (NODE_CLIENT_SIDE, NODE_PORT)
    } else {
        let dst = *mode
            .targets(DNS_PORT, &endpoints)
            .first()
            .context("no target")?
            .ip();
        (dst, DNS_PORT)
    };
    if !(dst == TARGET_VIP || dst == NODE_CLIENT_SIDE || endpoints.contains(&dst)) {
        bail!("refusing to send to {dst}: not the bench's ClusterIP, NodePort or pod");
    }
    // The node resolves the pods' addresses statically: the sink drops ARP.
    let pod_mac = mac(stack.pods(), "eth0")?;
    for i in 1..=plan::TARGET_ADDRESSES {
        let ip = plan::target_endpoint(i).to_string();
        ns_run(
            &stack.node,
            "ip",
            &[
                "neigh",
                "replace",
                &ip,
                "lladdr",
                &pod_mac,
                "dev",
                "pods0",
                "nud",
                "permanent",
            ],
            "",
        )?;
    }
    let sink = {
        let _ns = NetnsGuard::enter(&stack.pods().path());
        let ifindex = ifindex("eth0")?;
        let prog = load_xdp(&[mov_imm(0, XDP_DROP), exit()], "pps_sink")?;
        attach_xdp(&prog, ifindex).context("attaching the XDP_DROP sink to the pod's eth0")?
    };
    // NAPI on cli0 (veth has one with GRO on or with XDP), in its own thread, pinned.
    ns_run(&stack.node, "ethtool", &["-K", "cli0", "gro", "on"], "")?;
    let fwd = if mode.name() == "xdp-fwd" {
        let _ns = NetnsGuard::enter(&stack.node.path());
        let ifindex = ifindex("cli0")?;
        let prog = load_xdp(&fib_forward_program(), "pps_fwd")?;
        Some(attach_xdp(&prog, ifindex).context("attaching xdp-fwd to the node's cli0")?)
    } else {
        None
    };
    let pinned = if threaded {
        thread_napi(&stack.node)?
    } else {
        format!("NAPI inline on CPU {GENERATOR_CPU}")
    };
    let frame = udp_frame(
        &mac(&stack.client, "eth0")?,
        &mac(&stack.node, "cli0")?,
        CLIENT_IP,
        dst,
        SRC_PORT,
        dport,
    )?;
    Ok(Ready {
        sink,
        fwd,
        dst,
        dport,
        frame,
        pinned,
    })
}

/// `proxyctl services`: whether the agent's NodePort/ClusterIP frontend carries the
/// `maglev` flag (what `--lb-algorithm maglev` must have written).
fn frontend_flags(ctx: &Ctx, pins: &Path) -> Option<String> {
    let out = Command::new(ctx.bin_dir.join("proxyctl"))
        .arg("--pin-path")
        .arg(pins)
        .args(["-o", "json", "services"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    Some(if text.contains("\"maglev\"") {
        "maglev".into()
    } else {
        "random".into()
    })
}

/// The agent's `XDP_STATS` (`proxyctl stats`): reason -> count.
fn xdp_stats(ctx: &Ctx, pins: &Path) -> Result<std::collections::BTreeMap<String, u64>> {
    let out = Command::new(ctx.bin_dir.join("proxyctl"))
        .arg("--pin-path")
        .arg(pins)
        .args(["-o", "json", "stats"])
        .output()
        .context("proxyctl stats")?;
    if !out.status.success() {
        bail!(
            "proxyctl stats: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("proxyctl stats")?;
    Ok(v["xdp_counters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| Some((c["reason"].as_str()?.to_string(), c["count"].as_u64()?)))
        .collect())
}

/// cli0's NAPI in a kernel thread of its own, pinned to [`NODE_CPU`], SCHED_FIFO.
fn thread_napi(node: &Netns) -> Result<String> {
    let before = napi_threads("cli0");
    let set = Command::new("ip")
        .args(["netns", "exec", &node.name, "sh", "-c"])
        .arg("echo 1 > /sys/class/net/cli0/threaded")
        .status()
        .context("ip netns exec")?;
    if !set.success() {
        bail!("could not make cli0's NAPI threaded");
    }
    let mut pinned = Vec::new();
    for _ in 0..50 {
        pinned = napi_threads("cli0")
            .into_iter()
            .filter(|p| !before.contains(p))
            .collect();
        if !pinned.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if pinned.is_empty() {
        bail!("no napi/cli0-* kernel thread appeared");
    }
    for pid in &pinned {
        set_affinity(*pid, NODE_CPU).with_context(|| format!("pinning napi thread {pid}"))?;
        set_fifo(*pid).with_context(|| format!("making napi thread {pid} SCHED_FIFO"))?;
    }
    Ok(format!(
        "napi thread {pinned:?} on CPU {NODE_CPU}, SCHED_FIFO"
    ))
}

/// One round: the generator runs, the pod's count (and the node's path counters, and
/// our agent's XDP counters) are read over the interval.
fn measure(ctx: &Ctx, stack: &Stack, p: &Prepared, cfg: &PpsConfig) -> Result<PpsRound> {
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::channel::<Result<(), String>>();
    let gen = {
        let (stop, sent, frame) = (stop.clone(), sent.clone(), p.frame.clone());
        let ns = stack.client.path();
        std::thread::spawn(move || generator(&ns, &frame, &stop, &sent, &tx))
    };
    let xdp_modes =
        p.mode.name().starts_with("xdp-") && p.mode.name() != "xdp-fwd" || p.mode.name() == "xdp";
    let result = (|| -> Result<PpsRound> {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => bail!("generator: {e}"),
            Err(_) => bail!("generator did not start"),
        }
        std::thread::sleep(Duration::from_secs_f64(cfg.warmup_secs));
        let stats0 = match (&p.pins, xdp_modes) {
            (Some(pins), true) => Some(xdp_stats(ctx, pins)?),
            _ => None,
        };
        let path0 = PathCounts::read(&stack.node)?;
        let (c0, s0, t0) = sample(stack.pods(), &sent)?;
        std::thread::sleep(Duration::from_secs_f64(cfg.secs));
        let (c1, s1, t1) = sample(stack.pods(), &sent)?;
        let path = PathCounts::read(&stack.node)?.since(path0);
        let xdp = match (&p.pins, stats0) {
            (Some(pins), Some(before)) => {
                let after = xdp_stats(ctx, pins)?;
                Some(
                    after
                        .into_iter()
                        .map(|(k, v)| {
                            let d = v.saturating_sub(before.get(&k).copied().unwrap_or(0));
                            (k, d)
                        })
                        .filter(|(_, d)| *d > 0)
                        .collect(),
                )
            }
            _ => None,
        };
        let secs = t1.duration_since(t0).as_secs_f64();
        let received = c1.saturating_sub(c0);
        if received == 0 {
            bail!("the pod received nothing");
        }
        // The remote form's XDP modes are there to measure XDP forwarding: a figure of
        // frames that took another path is not reported as theirs.
        let forwarding = p.dport == NODE_PORT || p.mode.name() == "xdp-fwd";
        if forwarding && has_xdp(p.mode.name()) && (path.xdp_redirect + path.xdp_tx) * 2 < received
        {
            bail!(
                "{} did not forward at XDP: {} (redirect {}, tx {} of {received})",
                p.mode.name(),
                path.verdict(received, true),
                path.xdp_redirect,
                path.xdp_tx
            );
        }
        Ok(PpsRound {
            round: 0,
            secs,
            received,
            mpps: received as f64 / secs / 1e6,
            offered_mpps: s1.saturating_sub(s0) as f64 / secs / 1e6,
            path,
            xdp_stats: xdp,
            error: None,
        })
    })();
    stop.store(true, Ordering::Relaxed);
    let gen_result = gen.join();
    match gen_result {
        Ok(Err(e)) if result.is_ok() => Err(e.context("generator")),
        _ => result,
    }
}

/// The pod's received count, the generator's sent count, and when (the middle of the
/// counter read).
fn sample(pods: &Netns, sent: &AtomicU64) -> Result<(u64, u64, Instant)> {
    let a = Instant::now();
    let s0 = sent.load(Ordering::Relaxed);
    let c = xdp_drops(pods, "eth0")?;
    let s1 = sent.load(Ordering::Relaxed);
    let b = Instant::now();
    Ok((c, (s0 + s1) / 2, a + (b - a) / 2))
}

/// `ethtool -S` of a veth: (name, value) pairs.
fn veth_stats(ns: &Netns, dev: &str) -> Result<Vec<(String, u64)>> {
    let out = ns_run(ns, "ethtool", &["-S", dev], "")?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let (k, v) = l.trim().split_once(':')?;
            Some((k.trim().to_string(), v.trim().parse().ok()?))
        })
        .collect())
}

/// `ethtool -S`: the sum of the rx queues' `xdp_drops`.
fn xdp_drops(ns: &Netns, dev: &str) -> Result<u64> {
    let mut total = None;
    for (k, v) in veth_stats(ns, dev)? {
        if k.starts_with("rx_queue_") && k.ends_with("_xdp_drops") {
            *total.get_or_insert(0u64) += v;
        }
    }
    total.with_context(|| format!("ethtool -S {dev}: no rx_queue_*_xdp_drops"))
}

/// The namespace's `Ip: ForwDatagrams` (`/proc/net/snmp`, read from inside it).
fn ip_forwarded(ns: &Netns) -> Result<u64> {
    let out = ns_run(ns, "cat", &["/proc/net/snmp"], "")?;
    let mut ip = out.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (ip.next(), ip.next());
    let (Some(names), Some(values)) = (names, values) else {
        bail!("/proc/net/snmp: no Ip lines");
    };
    let i = names
        .split_whitespace()
        .position(|n| n == "ForwDatagrams")
        .context("/proc/net/snmp: no ForwDatagrams")?;
    values
        .split_whitespace()
        .nth(i)
        .and_then(|v| v.parse().ok())
        .context("/proc/net/snmp: ForwDatagrams value")
}

fn generator(
    ns: &Path,
    frame: &[u8],
    stop: &AtomicBool,
    sent: &AtomicU64,
    ready: &std::sync::mpsc::Sender<Result<(), String>>,
) -> Result<()> {
    let _ns = NetnsGuard::enter(ns);
    super::client::pin(GENERATOR_CPU);
    let setup = (|| -> Result<OwnedFd> {
        let ifindex = ifindex("eth0")?;
        load_xdp(&generator_program(frame, ifindex)?, "pps_gen")
    })();
    let prog = match setup {
        Ok(p) => {
            let _ = ready.send(Ok(()));
            p
        }
        Err(e) => {
            let _ = ready.send(Err(format!("{e:#}")));
            return Err(e);
        }
    };
    while !stop.load(Ordering::Relaxed) {
        test_run_live(&prog, frame, REPEAT)?;
        sent.fetch_add(u64::from(REPEAT), Ordering::Relaxed);
    }
    Ok(())
}

// ----- frames, interfaces -----------------------------------------------------------

fn link_json(ns: &Netns, dev: &str) -> Result<serde_json::Value> {
    let out = ns_run(ns, "ip", &["-j", "link", "show", dev], "")?;
    let v: serde_json::Value = serde_json::from_str(&out).context("ip -j link")?;
    v.get(0).cloned().context("ip -j link: empty")
}

fn mac(ns: &Netns, dev: &str) -> Result<String> {
    link_json(ns, dev)?
        .get("address")
        .and_then(|a| a.as_str())
        .map(str::to_string)
        .with_context(|| format!("no MAC address for {dev}"))
}

fn ifindex(dev: &str) -> Result<u32> {
    let name = std::ffi::CString::new(dev)?;
    // SAFETY: a valid C string.
    let i = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if i == 0 {
        bail!("no interface {dev}: {}", io::Error::last_os_error());
    }
    Ok(i)
}

fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let b: Vec<u8> = s
        .split(':')
        .map(|h| u8::from_str_radix(h, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("MAC {s}"))?;
    b.try_into()
        .map_err(|_| anyhow::anyhow!("MAC {s}: not 6 bytes"))
}

fn csum_fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn csum_add(data: &[u8], mut sum: u32) -> u32 {
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        sum += u32::from(w);
    }
    sum
}

/// An Ethernet + IPv4 + UDP frame of [`FRAME_LEN`] bytes with valid checksums.
pub fn udp_frame(
    src_mac: &str,
    dst_mac: &str,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
) -> Result<Vec<u8>> {
    let mut f = vec![0u8; FRAME_LEN];
    f[0..6].copy_from_slice(&parse_mac(dst_mac)?);
    f[6..12].copy_from_slice(&parse_mac(src_mac)?);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip_len = FRAME_LEN - 14;
    let udp_len = ip_len - 20;
    {
        let ip = &mut f[14..34];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
        ip[6] = 0x40; // DF
        ip[8] = 64;
        ip[9] = 17;
        ip[12..16].copy_from_slice(&src.octets());
        ip[16..20].copy_from_slice(&dst.octets());
        let c = csum_fold(csum_add(ip, 0));
        ip[10..12].copy_from_slice(&c.to_be_bytes());
    }
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    f[36..38].copy_from_slice(&dport.to_be_bytes());
    f[38..40].copy_from_slice(&(udp_len as u16).to_be_bytes());
    for (i, b) in f[42..].iter_mut().enumerate() {
        *b = b'a' + (i % 26) as u8;
    }
    let mut pseudo = Vec::with_capacity(12);
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&[0, 17]);
    pseudo.extend_from_slice(&(udp_len as u16).to_be_bytes());
    let mut c = csum_fold(csum_add(&f[34..], csum_add(&pseudo, 0)));
    if c == 0 {
        c = 0xffff;
    }
    f[40..42].copy_from_slice(&c.to_be_bytes());
    Ok(f)
}

/// `napi/<dev>-<id>` kernel threads (every namespace's).
fn napi_threads(dev: &str) -> Vec<i32> {
    let prefix = format!("napi/{dev}-");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        comm.trim().starts_with(&prefix).then_some(pid)
    })
    .collect()
}

/// `SCHED_FIFO` for the NAPI thread: it takes its CPU as soon as it has packets, as a
/// softirq would (under `SCHED_OTHER` it waits for its turn behind whatever else runs
/// on that CPU, while the veth ring of 256 frames overflows).
fn set_fifo(pid: i32) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 50 };
    // SAFETY: a valid sched_param for a pid we checked is a napi kthread.
    if unsafe { libc::sched_setscheduler(pid, libc::SCHED_FIFO, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn set_affinity(pid: i32, cpu: usize) -> io::Result<()> {
    let cpu = cpu % super::client::cpus();
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

// ----- raw bpf(2): small XDP programs, no object file ------------------------------

const BPF_PROG_LOAD: i64 = 5;
const BPF_PROG_TEST_RUN: i64 = 10;
const BPF_LINK_CREATE: i64 = 28;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;
const BPF_FUNC_REDIRECT: i32 = 23;
const BPF_FUNC_FIB_LOOKUP: i32 = 69;
const XDP_DROP: i32 = 1;
const XDP_PASS: i32 = 2;

/// `bpf_attr` as bytes (its largest member is well under 160 bytes; the rest is zero).
#[repr(C, align(8))]
struct Attr([u8; 160]);

impl Attr {
    fn new() -> Self {
        Self([0; 160])
    }
    fn u32(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, off: usize, v: u64) -> &mut Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn sys(&mut self, cmd: i64) -> io::Result<i64> {
        // SAFETY: bpf(2) with a zero-padded attr of the size we pass; every pointer in
        // it points into live buffers of the caller.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                self.0.as_mut_ptr(),
                self.0.len() as libc::c_uint,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(rc)
    }
}

type Insn = [u8; 8];

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    let mut i = [0u8; 8];
    i[0] = code;
    i[1] = (src << 4) | (dst & 0xf);
    i[2..4].copy_from_slice(&off.to_le_bytes());
    i[4..8].copy_from_slice(&imm.to_le_bytes());
    i
}
fn mov_imm(dst: u8, imm: i32) -> Insn {
    insn(0xb7, dst, 0, 0, imm) // BPF_ALU64 | BPF_MOV | BPF_K
}
fn call(helper: i32) -> Insn {
    insn(0x85, 0, 0, 0, helper) // BPF_JMP | BPF_CALL
}
fn exit() -> Insn {
    insn(0x95, 0, 0, 0, 0) // BPF_JMP | BPF_EXIT
}

/// `xdp-fwd`'s program: plain XDP forwarding as the kernel's `samples/bpf/xdp_fwd_kern.c`
/// does it, for IPv4: `bpf_fib_lookup` of the packet's addresses from the interface it
/// came in on; on success, the TTL decremented (incremental checksum update), the MAC
/// addresses rewritten to the FIB's next hop and `bpf_redirect` to the FIB's interface;
/// anything else `XDP_PASS`. No NAT, no conntrack: the XDP ceiling of this path.
fn fib_forward_program() -> Vec<Insn> {
    /// Jump target: the `XDP_PASS` exit at the end.
    const PASS: bool = true;
    // `bpf_fib_lookup` params at r10-64 (64 bytes): family @0, l4_protocol @1,
    // ifindex @8, ipv4_src @16, ipv4_dst @32, smac @52, dmac @58.
    const P: i16 = -64;
    let mut p: Vec<(Insn, bool)> = Vec::new();
    let bounds = [
        insn(0x61, 2, 6, 0, 0),  // r2 = data
        insn(0x61, 3, 6, 4, 0),  // r3 = data_end
        insn(0xbf, 4, 2, 0, 0),  // r4 = r2
        insn(0x07, 4, 0, 0, 34), // r4 += 14 + 20
    ];
    p.push((insn(0xbf, 6, 1, 0, 0), false)); // r6 = ctx
    p.extend(bounds.map(|x| (x, false)));
    p.push((insn(0x2d, 4, 3, 0, 0), PASS)); // if r4 > r3: pass
    p.push((insn(0x69, 4, 2, 12, 0), false)); // r4 = eth proto (u16)
    p.push((insn(0x55, 4, 0, 0, 0x0008), PASS)); // != htons(ETH_P_IP): pass
    let mut fill = vec![];
    for k in 0..8 {
        fill.push(insn(0x7a, 10, 0, P + 8 * k, 0)); // *(u64 *)(r10 - 64 + 8k) = 0
    }
    fill.extend([
        insn(0x72, 10, 0, P, 2),      // family = AF_INET
        insn(0x71, 4, 2, 23, 0),      // r4 = ip->protocol
        insn(0x73, 10, 4, P + 1, 0),  // l4_protocol
        insn(0x61, 4, 6, 12, 0),      // r4 = ctx->ingress_ifindex
        insn(0x63, 10, 4, P + 8, 0),  // ifindex
        insn(0x61, 4, 2, 26, 0),      // r4 = ip->saddr
        insn(0x63, 10, 4, P + 16, 0), // ipv4_src
        insn(0x61, 4, 2, 30, 0),      // r4 = ip->daddr
        insn(0x63, 10, 4, P + 32, 0), // ipv4_dst
        insn(0xbf, 1, 6, 0, 0),       // r1 = ctx
        insn(0xbf, 2, 10, 0, 0),      // r2 = r10
        insn(0x07, 2, 0, 0, i32::from(P)),
        mov_imm(3, 64),
        mov_imm(4, 0),
        call(BPF_FUNC_FIB_LOOKUP),
    ]);
    p.extend(fill.into_iter().map(|x| (x, false)));
    p.push((insn(0x55, 0, 0, 0, 0), PASS)); // not BPF_FIB_LKUP_RET_SUCCESS: pass
    p.extend(bounds.map(|x| (x, false)));
    p.push((insn(0x2d, 4, 3, 0, 0), PASS));
    let mut out = vec![
        // ip_decrease_ttl(): check += htons(0x0100) with end-around carry, --ttl.
        insn(0x69, 4, 2, 24, 0),     // r4 = ip->check (as stored)
        insn(0x07, 4, 0, 0, 1),      // + htons(0x0100) on a little-endian machine
        insn(0xa5, 4, 0, 1, 0xffff), // if r4 < 0xffff: skip the carry
        insn(0x07, 4, 0, 0, 1),      // + 1
        insn(0x6b, 2, 4, 24, 0),     // ip->check = r4
        insn(0x71, 4, 2, 22, 0),     // r4 = ip->ttl
        insn(0x07, 4, 0, 0, -1),     // - 1
        insn(0x73, 2, 4, 22, 0),     // ip->ttl = r4
    ];
    // Ethernet destination = the FIB's dmac, source = its smac (2-byte aligned reads).
    for (from, to) in [(58, 0), (60, 2), (62, 4), (52, 6), (54, 8), (56, 10)] {
        out.push(insn(0x69, 4, 10, P + from, 0));
        out.push(insn(0x6b, 2, 4, to, 0));
    }
    out.extend([
        insn(0x61, 1, 10, P + 8, 0), // r1 = params.ifindex (the egress interface)
        mov_imm(2, 0),
        call(BPF_FUNC_REDIRECT),
        exit(),
    ]);
    p.extend(out.into_iter().map(|x| (x, false)));
    let pass_at = p.len();
    p.push((mov_imm(0, XDP_PASS), false));
    p.push((exit(), false));
    p.iter()
        .enumerate()
        .map(|(at, (x, to_pass))| {
            let mut x = *x;
            if *to_pass {
                let off = (pass_at as i64 - at as i64 - 1) as i16;
                x[2..4].copy_from_slice(&off.to_le_bytes());
            }
            x
        })
        .collect()
}

/// The generator's XDP program: writes the whole frame (the pages of live frames are
/// recycled as they come back, with whatever the path wrote into them: the node's MAC
/// rewrite, TTL, DNAT), then `bpf_redirect(ifindex of eth0)`.
fn generator_program(frame: &[u8], ifindex: u32) -> Result<Vec<Insn>> {
    if !frame.len().is_multiple_of(4) {
        bail!("frame length {} is not a multiple of 4", frame.len());
    }
    let words = frame.len() / 4;
    let mut p = vec![
        insn(0x61, 2, 1, 0, 0),                  // r2 = ctx->data
        insn(0x61, 3, 1, 4, 0),                  // r3 = ctx->data_end
        insn(0xbf, 4, 2, 0, 0),                  // r4 = r2
        insn(0x07, 4, 0, 0, frame.len() as i32), // r4 += len
        // if r4 > r3: skip the stores and the redirect (to the XDP_ABORTED exit)
        insn(0x2d, 4, 3, (words + 4) as i16, 0),
    ];
    for (i, w) in frame.chunks(4).enumerate() {
        let imm = i32::from_ne_bytes([w[0], w[1], w[2], w[3]]);
        p.push(insn(0x62, 2, 0, (i * 4) as i16, imm)); // *(u32 *)(r2 + 4i) = imm
    }
    p.extend([
        mov_imm(1, ifindex as i32),
        mov_imm(2, 0),
        call(BPF_FUNC_REDIRECT),
        exit(),
        mov_imm(0, 0),
        exit(),
    ]);
    Ok(p)
}

fn load_xdp(insns: &[Insn], name: &str) -> Result<OwnedFd> {
    let code: Vec<u8> = insns.iter().flatten().copied().collect();
    let license = b"GPL\0";
    let mut log = vec![0u8; 1 << 20];
    let mut attr = Attr::new();
    attr.u32(0, BPF_PROG_TYPE_XDP)
        .u32(4, insns.len() as u32)
        .u64(8, code.as_ptr() as u64)
        .u64(16, license.as_ptr() as u64)
        .u32(24, 1)
        .u32(28, log.len() as u32)
        .u64(32, log.as_mut_ptr() as u64)
        .u32(68, BPF_XDP);
    let n = name.as_bytes();
    attr.0[48..48 + n.len().min(15)].copy_from_slice(&n[..n.len().min(15)]);
    // Without a log first (a verbose log that does not fit fails the load with ENOSPC
    // even when the program is fine); on failure again with one, for the message.
    let quiet = {
        let mut a = Attr(attr.0);
        a.u32(24, 0).u32(28, 0).u64(32, 0);
        a.sys(BPF_PROG_LOAD)
    };
    let fd = match quiet {
        Ok(fd) => fd,
        Err(_) => attr.sys(BPF_PROG_LOAD).map_err(|e| {
            let end = log.iter().position(|b| *b == 0).unwrap_or(0);
            anyhow::anyhow!(
                "loading XDP program {name}: {e}: {}",
                String::from_utf8_lossy(&log[..end])
            )
        })?,
    };
    // SAFETY: a new fd the kernel gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A native-mode XDP link on `ifindex` of the calling thread's namespace; detached when
/// the fd closes (also when the process dies).
fn attach_xdp(prog: &OwnedFd, ifindex: u32) -> Result<OwnedFd> {
    let mut attr = Attr::new();
    attr.u32(0, prog.as_raw_fd() as u32)
        .u32(4, ifindex)
        .u32(8, BPF_XDP)
        .u32(12, XDP_FLAGS_DRV_MODE);
    let fd = attr.sys(BPF_LINK_CREATE).context("BPF_LINK_CREATE")?;
    // SAFETY: a new fd the kernel gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `repeat` copies of `frame` through `prog` in live-frames mode (really transmitted).
fn test_run_live(prog: &OwnedFd, frame: &[u8], repeat: u32) -> Result<()> {
    let mut attr = Attr::new();
    attr.u32(0, prog.as_raw_fd() as u32)
        .u32(8, frame.len() as u32)
        .u64(16, frame.as_ptr() as u64)
        .u32(32, repeat)
        .u32(64, BPF_F_TEST_XDP_LIVE_FRAMES)
        .u32(72, 64);
    attr.sys(BPF_PROG_TEST_RUN)
        .context("BPF_PROG_RUN (live frames)")?;
    Ok(())
}

// ----- BPF_PROG_RUN ns per packet ---------------------------------------------------

/// Runs `bench-prog-run` (built with the agent: the TC programs loaded with the real
/// loader, maps filled by the real writer) and returns its JSON.
fn prog_run(quick: bool) -> Result<serde_json::Value> {
    let bin: PathBuf = crate::release_dir().join("bench-prog-run");
    let mut cmd = Command::new(&bin);
    if quick {
        cmd.arg("--quick");
    }
    let out = topo::run_bounded(&mut cmd, "", Duration::from_secs(300))?
        .context("bench-prog-run took more than 300 s")?;
    serde_json::from_str(&out).with_context(|| format!("bench-prog-run's output: {out}"))
}

// ----- report -------------------------------------------------------------------------

impl PpsResults {
    pub fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "## Packet rate: 64-byte UDP, one flow, client ns -> node ns -> pod ns\n"
        );
        for p in &self.pinning {
            let _ = writeln!(s, "- {p}");
        }
        for t in &self.tables {
            s.push_str(&t.markdown());
        }
        if let Some(p) = &self.prog_run {
            s.push_str(&prog_run_markdown(p));
        }
        if let Some(e) = &self.prog_run_error {
            let _ = writeln!(s, "\nBPF_PROG_RUN part failed: {e}");
        }
        s
    }
}

impl PpsTable {
    fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let remote = self.form == Form::Remote;
        let _ = writeln!(s, "\n### {}\n", self.title);
        let _ = writeln!(
            s,
            "| mode | Mpps received (median) | × plain forwarding |{} × iptables-legacy | × our TC | program on cli0, ns/packet (live) | path taken (cli0's XDP counters, node's IP forwarding) | offered (Mpps) | rounds |\n|---|---:|---:|{}---:|---:|---:|---|---:|---:|",
            if remote { " × plain XDP forwarding |" } else { "" },
            if remote { "---:|" } else { "" }
        );
        let r = |v: Option<f64>| v.map_or("–".into(), |r| format!("{r:.2}×"));
        for m in &self.modes {
            if !m.available {
                let _ = writeln!(
                    s,
                    "| {} | {} | – |{} – | – | – | – | – | 0 |",
                    m.mode,
                    m.reason.as_deref().unwrap_or("not available"),
                    if remote { " – |" } else { "" }
                );
                continue;
            }
            let f = |v: Option<f64>, d: usize| v.map_or("–".into(), |v| format!("{v:.d$}"));
            let mut path = m.verdict.clone().unwrap_or_else(|| "–".into());
            if let Some(x) = m
                .rounds
                .iter()
                .rev()
                .find(|r| r.error.is_none())
                .and_then(|r| r.xdp_stats.as_ref().map(|x| (x, r.received)))
            {
                let counts: Vec<String> = x.0.iter().map(|(k, v)| format!("{k} +{v}")).collect();
                let _ = write!(
                    path,
                    "; XDP_STATS {} (pod received {})",
                    if counts.is_empty() {
                        "unchanged".into()
                    } else {
                        counts.join(", ")
                    },
                    x.1
                );
            }
            if let Some(flags) = &m.frontend_flags {
                let _ = write!(path, "; backend choice: {flags}");
            }
            let _ = writeln!(
                s,
                "| {} | {} | {} |{} {} | {} | {} | {} | {} | {} |",
                m.mode,
                f(m.mpps, 3),
                r(m.ratio_to_direct),
                if remote {
                    format!(" {} |", r(m.ratio_to_xdp_fwd))
                } else {
                    String::new()
                },
                r(m.ratio_to_iptables),
                r(m.ratio_to_tc),
                f(m.program_ns, 0),
                path,
                f(m.offered_mpps, 2),
                m.rounds.iter().filter(|r| r.error.is_none()).count()
            );
        }
        if remote {
            let xdp = self.modes.iter().find(|m| m.mode == "xdp");
            let target = |what: &str, got: Option<f64>, want: f64| {
                got.map_or(format!("- {what}: not measured\n"), |g| {
                    format!(
                        "- {what}: {g:.2}× (target >= {want}×): {}\n",
                        if g >= want { "met" } else { "missed" }
                    )
                })
            };
            let _ = writeln!(s, "\nIssue 15's targets (our XDP, random):\n");
            s.push_str(&target(
                "XDP vs iptables-legacy",
                xdp.and_then(|m| m.ratio_to_iptables),
                4.0,
            ));
            s.push_str(&target(
                "XDP vs our TC",
                xdp.and_then(|m| m.ratio_to_tc),
                2.0,
            ));
            s.push_str(&target(
                "XDP vs plain XDP forwarding",
                xdp.and_then(|m| m.ratio_to_xdp_fwd),
                0.8,
            ));
        }
        s
    }
}

fn prog_run_markdown(v: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let repeat = v.get("repeat").and_then(|r| r.as_u64()).unwrap_or(0);
    let _ = writeln!(
        s,
        "\n### BPF_PROG_RUN, ns per packet (repeat {repeat}, median of {} runs)\n",
        v.get("runs").and_then(|r| r.as_u64()).unwrap_or(0)
    );
    let _ = writeln!(
        s,
        "| program | case | services | ns/packet (BPF_PROG_RUN) | ns/packet (program alone) | verdict |\n|---|---|---:|---:|---:|---:|"
    );
    for r in v
        .get("results")
        .and_then(|r| r.as_array())
        .into_iter()
        .flatten()
    {
        let g = |k: &str| r.get(k).cloned().unwrap_or_default();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            g("program").as_str().unwrap_or(""),
            g("case").as_str().unwrap_or(""),
            super::report::thousands(g("services").as_u64().unwrap_or(0) as usize),
            g("ns_per_packet")
                .as_f64()
                .map_or("–".into(), |n| format!("{n:.1}")),
            g("program_ns")
                .as_f64()
                .map_or("–".into(), |n| format!("{n:.1}")),
            g("verdict")
        );
    }
    if let Some(missing) = v.get("not_measured").and_then(|m| m.as_str()) {
        let _ = writeln!(s, "\n{missing}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_is_64_bytes_on_the_wire_with_valid_checksums() {
        let f = udp_frame(
            "02:00:00:00:00:01",
            "02:00:00:00:00:02",
            CLIENT_IP,
            TARGET_VIP,
            SRC_PORT,
            DNS_PORT,
        )
        .expect("frame");
        assert_eq!(f.len() + 4, 64);
        assert_eq!(&f[0..6], &[2, 0, 0, 0, 0, 2]);
        // A header with its checksum sums to 0xffff.
        assert_eq!(csum_fold(csum_add(&f[14..34], 0)), 0);
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&f[26..34]);
        pseudo.extend_from_slice(&[0, 17, 0, 26]);
        assert_eq!(csum_fold(csum_add(&f[34..], csum_add(&pseudo, 0))), 0);
        assert_eq!(u16::from_be_bytes([f[36], f[37]]), 53);
    }
}
