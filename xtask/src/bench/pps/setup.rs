//! Getting one mode ready for the packet-rate rounds: its one Service programmed, the
//! pod's sink, the neighbours, `xdp-fwd`'s program, the NAPI thread; and reading our
//! agent's frontend flags and XDP counters.

use std::{
    net::Ipv4Addr,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{bail, Context as _, Result};

use super::{
    frames::{
        ifindex, mac, napi_threads, parse_mac, set_affinity, set_fifo, udp_frame, GENERATOR_CPU,
        NODE_CPU, SRC_PORT,
    },
    results::Form,
    xdp_progs::{attach_xdp, exit, fixed_forward_program, load_xdp, mov_imm, XDP_DROP},
};
use crate::bench::{
    modes::{Ctx, Mode},
    plan::{self, CLIENT_IP, DNS_PORT, NODE_CLIENT_SIDE, NODE_PORT, TARGET_VIP},
    topo::{ns_run, Netns, NetnsGuard},
};

/// Whether the mode has an XDP program on `cli0` (ours or `xdp-fwd`'s).
pub(super) fn has_xdp(mode: &str) -> bool {
    matches!(mode, "xdp" | "xdp-maglev" | "xdp-fwd")
}

/// What [`prepare`] made.
pub(super) struct Ready {
    pub(super) sink: OwnedFd,
    pub(super) fwd: Option<OwnedFd>,
    pub(super) dst: Ipv4Addr,
    pub(super) dport: u16,
    pub(super) frame: Vec<u8>,
    pub(super) pinned: String,
}

/// Sets the mode up with the form's one service programmed, then the sink, the
/// neighbours, `xdp-fwd`'s program and the NAPI thread.
// Long: the set-up of one mode in the order the kernel needs it (program, service, sink,
// neighbours, xdp-fwd, NAPI thread).
pub(super) fn prepare(ctx: &Ctx, mode: &mut dyn Mode, form: Form, threaded: bool) -> Result<Ready> {
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
        // The next hop fixed: the pods' interface, its MAC and the pod's.
        let smac = parse_mac(&mac(&stack.node, "pods0")?)?;
        let dmac = parse_mac(&pod_mac)?;
        let _ns = NetnsGuard::enter(&stack.node.path());
        let out = ifindex("pods0")?;
        let ifindex = ifindex("cli0")?;
        let prog = load_xdp(&fixed_forward_program(out, smac, dmac), "pps_fwd")?;
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
pub(super) fn frontend_flags(ctx: &Ctx, pins: &Path) -> Option<String> {
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
pub(super) fn xdp_stats(ctx: &Ctx, pins: &Path) -> Result<std::collections::BTreeMap<String, u64>> {
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
pub(super) fn thread_napi(node: &Netns) -> Result<String> {
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

/// One mode, programmed and prepared: the sink attached, NAPI threaded and pinned.
pub(super) struct Prepared {
    pub(super) mode: Box<dyn Mode>,
    pub(super) pins: Option<PathBuf>,
    pub(super) _sink: OwnedFd,
    /// `xdp-fwd`'s program on cli0 (its link).
    pub(super) _fwd: Option<OwnedFd>,
    pub(super) dst: Ipv4Addr,
    pub(super) dport: u16,
    pub(super) frame: Vec<u8>,
}
