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

mod frames;
mod report;
mod results;
mod setup;
mod xdp_progs;

use frames::*;
pub use results::*;
use setup::*;
use xdp_progs::*;

/// The generator's CPU and the node's.
const GENERATOR_CPU: usize = 0;
const NODE_CPU: usize = 1;
/// Frames per `BPF_PROG_RUN` call of the generator.
const REPEAT: u32 = 16_384;
/// The generator's source port.
const SRC_PORT: u16 = 40_000;
/// Ethernet frame length without FCS: a 64-byte frame on a wire.
const FRAME_LEN: usize = 60;

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
