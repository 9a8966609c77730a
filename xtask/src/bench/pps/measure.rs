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
