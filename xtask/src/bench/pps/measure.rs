//! One measured round: the generator (`BPF_PROG_RUN` live frames from the client's
//! namespace, pinned to its CPU) runs while the pod's received count, the node's path
//! counters and our agent's XDP counters are read over the interval.

use std::{
    os::fd::OwnedFd,
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Result};

use super::{
    counters::xdp_drops,
    frames::{ifindex, GENERATOR_CPU},
    results::{PathCounts, PpsConfig, PpsRound},
    setup::{has_xdp, xdp_stats, Prepared},
    xdp_progs::{generator_program, load_xdp, test_run_live},
};
use crate::bench::{
    client,
    modes::Ctx,
    plan::NODE_PORT,
    topo::{Netns, NetnsGuard, Stack},
};

/// Frames per `BPF_PROG_RUN` call of the generator.
const REPEAT: u32 = 16_384;

/// One round: the generator runs, the pod's count (and the node's path counters, and
/// our agent's XDP counters) are read over the interval.
pub(super) fn measure(ctx: &Ctx, stack: &Stack, p: &Prepared, cfg: &PpsConfig) -> Result<PpsRound> {
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
        let xdp: Option<std::collections::BTreeMap<String, u64>> = match (&p.pins, stats0) {
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
        if forwarding && has_xdp(p.mode.name()) {
            let to_stack = xdp.as_ref().and_then(|x| x.get("xdp_to_stack").copied());
            if let Some(why) = not_all_at_xdp(&path, to_stack) {
                bail!(
                    "{} did not forward every frame at XDP: {why} ({})",
                    p.mode.name(),
                    path.verdict(received, true)
                );
            }
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

/// How far veth's per-queue counters can disagree when read while frames flow: veth counts
/// a frame in `xdp_packets` when its program runs and in `xdp_redirect` when the redirect is
/// flushed at the end of the NAPI poll, so two reads straddle at most one poll's budget
/// (64 frames). Seen in CI: 1 frame of 393,217 with `xdp_to_stack` 0 and nothing
/// IP-forwarded. The exact counters below have no such allowance.
const VETH_READ_SKEW: u64 = 64;

/// Why not every frame `cli0` took in a round left by XDP (`XDP_REDIRECT`, `XDP_TX` or
/// `XDP_DROP`): frames IP-forwarded by the node's stack, or counted `xdp_to_stack` by our XDP
/// program (`to_stack`, from `XDP_STATS`) — both exact, any one fails the round — or more
/// frames passed to the stack by veth's counters (taken minus those verdicts) than a read
/// can straddle ([`VETH_READ_SKEW`]; the only check for `xdp-fwd`, which counts nothing
/// itself); `None` when every frame did.
pub(super) fn not_all_at_xdp(path: &PathCounts, to_stack: Option<u64>) -> Option<String> {
    let left = path.xdp_redirect + path.xdp_tx + path.xdp_drops;
    let passed = path.xdp_packets.saturating_sub(left);
    let mut why = Vec::new();
    if path.xdp_packets == 0 {
        why.push("cli0 took no frame through XDP".to_string());
    }
    if passed > VETH_READ_SKEW {
        why.push(format!(
            "{passed} of {} frames passed to the stack (redirect {}, tx {}, drop {})",
            path.xdp_packets, path.xdp_redirect, path.xdp_tx, path.xdp_drops
        ));
    }
    if path.ip_forwarded > 0 {
        why.push(format!("{} IP-forwarded by the stack", path.ip_forwarded));
    }
    if let Some(n) = to_stack.filter(|n| *n > 0) {
        why.push(format!("{n} counted xdp_to_stack"));
    }
    (!why.is_empty()).then(|| why.join(", "))
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

fn generator(
    ns: &Path,
    frame: &[u8],
    stop: &AtomicBool,
    sent: &AtomicU64,
    ready: &std::sync::mpsc::Sender<Result<(), String>>,
) -> Result<()> {
    let _ns = NetnsGuard::enter(ns);
    client::pin(GENERATOR_CPU);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_counts_as_xdp_only_when_every_frame_left_by_xdp() {
        let all = PathCounts {
            xdp_packets: 1000,
            xdp_redirect: 990,
            xdp_tx: 10,
            xdp_drops: 0,
            ip_forwarded: 0,
        };
        assert_eq!(not_all_at_xdp(&all, Some(0)), None);
        assert_eq!(not_all_at_xdp(&all, None), None);
        let one_passed = PathCounts {
            xdp_redirect: 989,
            ip_forwarded: 1,
            ..all
        };
        let why = not_all_at_xdp(&one_passed, None).expect("one frame IP-forwarded");
        assert!(why.contains("1 IP-forwarded"), "{why}");
        // A read straddling one NAPI poll is not a frame passed; more than that is.
        let skew = PathCounts {
            xdp_redirect: 989,
            ..all
        };
        assert_eq!(not_all_at_xdp(&skew, Some(0)), None);
        let passed = PathCounts {
            xdp_redirect: 990 - VETH_READ_SKEW - 1,
            ..all
        };
        let why = not_all_at_xdp(&passed, None).expect("frames passed");
        assert!(why.contains("65 of 1000 frames passed"), "{why}");
        let why = not_all_at_xdp(&all, Some(3)).expect("to stack");
        assert!(why.contains("3 counted xdp_to_stack"), "{why}");
        let none = PathCounts::default();
        assert!(not_all_at_xdp(&none, None).is_some());
    }
}
