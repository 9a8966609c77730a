//! The whole comparison ([`run`]): every scale, every mode programmed from nothing, then
//! the rounds of datapath workloads and endpoint changes (the method is in the module
//! doc of `bench`).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};

use super::{
    first_line, log, machine, maglev,
    modes::{self, Ctx, Mode},
    plan::{self, Service},
    pps,
    report::{self, ChangeResult, ModeInfo, ModeScale, Results, RoundResult, ScaleResult, Status},
    rounds::{datapath_round, endpoint_change, safety_check, summarise, verify, Running},
    tools, topo, Args, Config,
};

/// Per mode, across scales.
struct ModeState {
    mode: Box<dyn Mode>,
    available: bool,
    /// Set once the mode gave up or failed: larger scales are not attempted.
    gave_up: Option<String>,
    /// The previous scale's programming time (for the linear prediction).
    last_program: Option<(usize, f64)>,
}

/// A mode at one scale before its rounds: out of them (unavailable, given up, failed:
/// its result as it stands) or in them.
enum Prepared {
    Out(ModeScale),
    Running(ModeScale),
}

/// The comparison, as the module doc of `bench` describes it: the packet-rate run alone
/// with `--pps`; else the Maglev disruption, the run's metadata, every mode set up, then
/// per scale: each mode programmed, checked and measured at rest, the rounds (datapath
/// workloads, then endpoint changes), the results written, the modes cleared; last the
/// plots and the packet-rate run.
pub(super) fn run(args: &Args) -> Result<()> {
    let cfg = Config::new(args)?;
    let start = Instant::now();
    let root = crate::workspace_root();
    let out_dir = args
        .out
        .clone()
        .unwrap_or_else(|| root.join("target/bench"));
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let bench = super::Bench::new()?;
    let ctx = &bench.ctx;
    let pps_cfg = pps::PpsConfig::new(cfg.quick, args.rounds, args.pps_threaded_napi);
    if args.pps {
        let r = pps::run(ctx, &pps_cfg, args.modes.as_deref(), &out_dir, start)?;
        log(
            start,
            format!("done: {}", out_dir.join("pps-results.json").display()),
        );
        println!("{}", r.markdown());
        return verdict(&cfg, start, r.errors());
    }

    // Maglev disruption: pure computation, seconds (also with --quick).
    match maglev::run(&ctx.bin_dir, &out_dir) {
        Ok((_, md)) => log(start, format!("Maglev disruption (maglev.md):\n{md}")),
        Err(e) => log(start, format!("Maglev disruption not measured: {e:#}")),
    }

    let mut results = Results::default();
    record_meta(&mut results, &cfg, &root)?;
    let mut states = set_up_modes(ctx, args, &mut results, start)?;

    let last_scale = cfg.scales.len() - 1;
    for (si, &n) in cfg.scales.iter().enumerate() {
        let scale = run_scale(ctx, &cfg, &mut states, n, start)?;
        results.scales.push(scale);
        results.meta.duration_seconds = start.elapsed().as_secs_f64();
        results.write(&out_dir)?;
        for st in states.iter_mut() {
            st.mode.pause(false);
        }
        if si < last_scale {
            clear_modes(ctx, &mut states, start);
        }
    }

    write_final(&mut results, &out_dir, start)?;
    // Stop everything (agents, namespaces, cgroup) before saying we're done.
    drop(states);
    let pps = if args.no_pps {
        None
    } else {
        Some(pps::run(
            ctx,
            &pps_cfg,
            args.modes.as_deref(),
            &out_dir,
            start,
        )?)
    };
    drop(bench);
    log(
        start,
        format!(
            "done: {} and {}",
            out_dir.join("results.json").display(),
            out_dir.join("results.md").display()
        ),
    );
    println!("{}", results.markdown());
    let mut errors = results.errors();
    if let Some(p) = pps {
        println!("{}", p.markdown());
        errors.extend(p.errors());
    }
    verdict(&cfg, start, errors)
}

/// The results marked finished, written, and plotted (a plot that fails is a warning).
fn write_final(results: &mut Results, out_dir: &std::path::Path, start: Instant) -> Result<()> {
    results.meta.finished = true;
    results.meta.duration_seconds = start.elapsed().as_secs_f64();
    results.write(out_dir)?;
    match results.plot(out_dir) {
        Ok(files) => {
            for f in files {
                log(start, format!("plot {}", f.display()));
            }
        }
        Err(e) => log(start, format!("warning: {e:#}")),
    }
    Ok(())
}

/// The run's metadata: the command, the machine, the revision, the tools, the config.
fn record_meta(results: &mut Results, cfg: &Config, root: &std::path::Path) -> Result<()> {
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
            .current_dir(root)
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
    if let serde_json::Value::Object(o) = serde_json::to_value(cfg)? {
        results.meta.config = o.into_iter().collect();
    }
    Ok(())
}

/// Every mode (or those `--modes` names) set up and safety-checked; one that cannot be is
/// recorded as unavailable, with the reason. Fails when none is available.
fn set_up_modes(
    ctx: &Ctx,
    args: &Args,
    results: &mut Results,
    start: Instant,
) -> Result<Vec<ModeState>> {
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
            .setup(ctx)
            .and_then(|()| safety_check(ctx, mode.as_ref()));
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
    Ok(states)
}

/// One scale: every mode prepared ([`prepare_mode`]), then the rounds, each a datapath
/// workload per mode (in a rotating order) and an endpoint change per mode; the modes'
/// results summarised, in the modes' order.
fn run_scale(
    ctx: &Ctx,
    cfg: &Config,
    states: &mut [ModeState],
    n: usize,
    start: Instant,
) -> Result<ScaleResult> {
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
        match prepare_mode(ctx, cfg, st, n, &services, start) {
            Prepared::Out(ms) => scale.modes.push(ms),
            Prepared::Running(ms) => running.push(Running {
                idx,
                result: ms,
                tcp_samples: Vec::new(),
                udp_samples: Vec::new(),
                swapped: false,
                change_spent: Duration::ZERO,
                changes_stopped: !st.mode.programs(),
            }),
        }
    }
    for round in 0..cfg.rounds {
        let k = running.len();
        let order: Vec<usize> = (0..k).map(|i| (i + round) % k.max(1)).collect();
        for &ri in &order {
            topo::check_interrupt()?;
            // The mode's own agent runs during its workload, as on a node: it grows the
            // conntrack tables as new flows fill them (a stopped agent cannot, and a
            // resize stopped half-way stays so through the round). The other modes'
            // agents stay stopped.
            let idx = running[ri].idx;
            states[idx].mode.pause(false);
            datapath_workload(ctx, cfg, &mut running[ri], states, round, start);
            states[idx].mode.pause(true);
        }
        for &ri in &order {
            topo::check_interrupt()?;
            change_round(
                ctx,
                cfg,
                &mut running[ri],
                states,
                &mut services,
                round,
                start,
            );
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
    Ok(scale)
}

/// One mode at one scale before the rounds: unavailable or given up earlier (out);
/// programmed (unless the linear prediction from the last scale is over the bound);
/// checked to answer; its control plane measured at rest, then paused.
fn prepare_mode(
    ctx: &Ctx,
    cfg: &Config,
    st: &mut ModeState,
    n: usize,
    services: &[Service],
    start: Instant,
) -> Prepared {
    let name = st.mode.name();
    if !st.available {
        return Prepared::Out(ModeScale::new(name, Status::Unavailable, None));
    }
    if let Some(why) = &st.gave_up {
        return Prepared::Out(ModeScale::new(name, Status::GaveUp, Some(why.clone())));
    }
    let mut ms = ModeScale::new(name, Status::Ok, None);
    if st.mode.programs() {
        if let Some(out) = program_mode(ctx, cfg, st, n, services, start, &mut ms) {
            return Prepared::Out(out);
        }
    }
    // A short check that the target answers through this mode.
    if let Err(e) = verify(ctx, st.mode.as_ref(), false) {
        let why = format!("{e:#}");
        log(start, format!("  {name} failed its check: {why}"));
        st.gave_up = Some(format!("failed at {} services", report::thousands(n)));
        let _ = st.mode.clear(ctx);
        return Prepared::Out(ModeScale::new(name, Status::Failed, Some(why)));
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
    Prepared::Running(ms)
}

/// Programs `n` services into a mode, recording the time in `ms`. `Some`: the mode
/// gives up (predicted or measured over the bound) or failed, with its result.
fn program_mode(
    ctx: &Ctx,
    cfg: &Config,
    st: &mut ModeState,
    n: usize,
    services: &[Service],
    start: Instant,
    ms: &mut ModeScale,
) -> Option<ModeScale> {
    let name = st.mode.name();
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
            return Some(ModeScale::new(name, Status::GaveUp, Some(why)));
        }
    }
    log(
        start,
        format!("  {name}: programming {} services", report::thousands(n)),
    );
    let limit = Duration::from_secs_f64(cfg.program_limit_secs);
    match st.mode.program(ctx, services, limit) {
        Ok(Some(t)) => {
            log(start, format!("  {name}: programmed in {:.3} s", t.seconds));
            st.last_program = Some((n, t.seconds));
            ms.summary.program_seconds = Some(t.seconds);
            ms.program = Some(t);
            ms.agent = st.mode.agent();
            None
        }
        Ok(None) => {
            let why = format!(
                "programming {} services did not finish within {:.0} s",
                report::thousands(n),
                cfg.program_limit_secs
            );
            log(start, format!("  {name} gives up: {why}"));
            st.gave_up = Some(why.clone());
            if let Err(e) = st.mode.clear(ctx) {
                log(start, format!("  {name}: clearing after giving up: {e:#}"));
            }
            Some(ModeScale::new(name, Status::GaveUp, Some(why)))
        }
        Err(e) => {
            let why = format!("{e:#}");
            log(start, format!("  {name} failed: {why}"));
            st.gave_up = Some(format!("failed at {} services", report::thousands(n)));
            let _ = st.mode.clear(ctx);
            Some(ModeScale::new(name, Status::Failed, Some(why)))
        }
    }
}

/// One mode's datapath workload of one round, recorded (an error as the round's).
fn datapath_workload(
    ctx: &Ctx,
    cfg: &Config,
    r: &mut Running,
    states: &[ModeState],
    round: usize,
    start: Instant,
) {
    let st = &states[r.idx];
    let endpoints = plan::target_endpoints(r.swapped);
    match datapath_round(ctx, cfg, st.mode.as_ref(), &endpoints, round) {
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

/// One mode's endpoint change of one round (the mode unpaused for it), recorded; an
/// error, or the change budget spent, stops the mode's changes at this scale.
fn change_round(
    ctx: &Ctx,
    cfg: &Config,
    r: &mut Running,
    states: &mut [ModeState],
    services: &mut [Service],
    round: usize,
    start: Instant,
) {
    if r.changes_stopped {
        return;
    }
    let st = &mut states[r.idx];
    let t = Instant::now();
    st.mode.pause(false);
    std::thread::sleep(Duration::from_secs_f64(cfg.settle_secs));
    let outcome = endpoint_change(ctx, cfg, st.mode.as_mut(), services, r.swapped);
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

/// Every mode still in the run cleared before the next scale; one that cannot be gives
/// up.
fn clear_modes(ctx: &Ctx, states: &mut [ModeState], start: Instant) {
    for st in states
        .iter_mut()
        .filter(|s| s.available && s.gave_up.is_none())
    {
        let t = Instant::now();
        if let Err(e) = st.mode.clear(ctx) {
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

/// Lists the run's recorded errors; with `--quick` (inside `cargo xtask test`) any of
/// them fails the run (`report::quick_verdict`).
fn verdict(cfg: &Config, start: Instant, errors: Vec<String>) -> Result<()> {
    for e in &errors {
        log(start, format!("error recorded: {e}"));
    }
    if cfg.quick {
        report::quick_verdict(&errors)?;
    }
    Ok(())
}
