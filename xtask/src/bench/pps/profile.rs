//! The live program profile: one more round per mode with a program on `cli0`, with the
//! kernel's run-time statistics on, for the program's own ns per packet under the flood.

use std::time::Instant;

use anyhow::{Context as _, Result};

use super::{
    measure::measure,
    results::{PpsConfig, PpsTable},
    setup::{has_xdp, Prepared},
};
use crate::bench::{log, modes::Ctx, progstats};

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
pub(super) fn profile(
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
