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
//!   stack routes them: plain forwarding) and `xdp-fwd` (plain XDP forwarding, next hop
//!   fixed: a 27-instruction XDP program on `cli0`, loaded with raw `bpf(2)`: TTL
//!   decrement, MAC rewrite to the pod's next hop written into the program at load,
//!   `bpf_redirect`; no FIB lookup, no NAT. Our XDP path caches its FIB answers
//!   (`FIB_HOP4`, 100 ms), so a baseline that asked the FIB for every packet, as the
//!   kernel's `samples/bpf/xdp_fwd` does, would not be a ceiling). Debian's `xdp-bench` 1.3.1 (`redirect`, `tx`) fails to load
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
//!
//! Layout: this file runs the rounds of each form; `entries.rs` the modes of each table
//! (with `xdp-fwd`); `setup.rs` one mode made ready; `measure.rs` one measured round and
//! the generator; `counters.rs` the kernel's counters it reads; `profile.rs` the live
//! program profile; `frames.rs` the frame and interfaces; `xdp_progs.rs` its own
//! raw-`bpf(2)` XDP programs; `results.rs` what it records; `report.rs` its tables.

mod counters;
mod entries;
mod frames;
mod measure;
mod profile;
mod report;
mod results;
mod setup;
mod xdp_progs;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{log, modes::Ctx, stats, topo};
use entries::{pps_modes, Entry};
use frames::{GENERATOR_CPU, NODE_CPU};
use measure::measure;
use profile::profile;
pub use results::PpsConfig;
use results::{Form, PpsMode, PpsResults, PpsRound, PpsTable};
use setup::{frontend_flags, has_xdp, prepare, Prepared};

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

// Long: one form's measured sequence per mode (prepare, warm up, rounds, counters checked);
// the order is the measurement.
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
                log(start, format!("  {name} failed to set up: {e:#}"));
                entry.reason = Some(format!("{e:#}"));
                entry.error = Some(format!("{e:#}"));
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
