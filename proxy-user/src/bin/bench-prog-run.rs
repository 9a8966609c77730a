//! `BPF_PROG_RUN` ns per packet of the TC ingress and XDP programs, for `cargo xtask bench` (its
//! packet-rate part, `xtask/src/bench/pps.rs`, runs this as root and reads the JSON it
//! prints; a bin, not an example, so that it builds with the agent and without the
//! dev-dependencies). The object is loaded by the real loader on a per-run pin directory
//! and the maps are filled by the real writer, as in `tests/tc_packets.rs` (whose
//! loading and packet code this shares: `proxy_user::prog_run`).
//!
//! Cases, at 1 and 10,000 Services (each of 10 local endpoints; the measured frontend,
//! 10.96.0.10:53/UDP, written last but for the source-range LoadBalancer
//! 203.0.113.10:53/UDP of the back-to-back rows):
//! - `miss`: a packet to 10.96.0.11:53, not a frontend: passed untouched. `repeat` R
//!   in one call, the kernel's average per repetition.
//! - `frontend hit, new flow`: a new client port per call (frontend lookup, backend
//!   choice, conntrack entry created, DNAT). One repetition per call (a repetition runs
//!   on the same skb, which the first one has already rewritten), the median of the
//!   kernel's per-call figure over many calls.
//! - `conntrack hit`: the same flow again (conntrack lookup, DNAT), as above.
//! - `not IP`: the miss frame as ARP, `repeat` R: the program's entry and exit only, the
//!   floor under every other case.
//! - `miss, 1 per call`: the `miss` packet with one repetition per call: what the
//!   per-call figure adds (the timer's two clock reads) over `miss` with repeat.
//!
//! - `... (monitor on)`: the new-flow and conntrack-hit cases again with `proxyctl
//!   monitor`'s reporting on (issue 28; the plain rows are the cost when off).
//! - `new flow, monitor off (in turn)` / `on (in turn)`: new flows with reporting off
//!   and on alternating call by call, so that a busy machine's drift between two series
//!   is not taken for the cost of an event; `program_ns` is the median of each run's own
//!   run-time statistics.
//!   Each "on" call writes one event and the bench drains the ring buffer after each
//!   pair, as `proxyctl monitor`'s reader does (so the ring is never full and the rows
//!   measure the written event, not the lost path: the event count is checked), and
//!   the datapath submits without a wake-up (`BPF_RB_NO_WAKEUP`), as always.
//! - `source-range drop, monitor off / on (in turn, back to back)`: a refused new flow
//!   (loadBalancerSourceRanges) repeated `DROP_REPEAT` times in one call, one event per
//!   repetition when on, drained after each call: the cost of an event at a sustained
//!   rate. A per-call row pays the ring buffer's first touch after the syscall in its
//!   one event; here one repetition in `DROP_REPEAT` does.
//!
//! Two figures per case: `ns_per_packet`, `BPF_PROG_RUN`'s own duration (its timer
//! around the run: with one repetition per call that includes the timer's set-up), and
//! `program_ns`, the program alone: the kernel's run-time statistics
//! (`BPF_ENABLE_STATS`, what `bpftool prog` shows as `run_time_ns`/`run_cnt`) taken
//! around the case, time over runs. Those are counted around each run of the program
//! (two `sched_clock` reads, some tens of ns included), whatever the caller.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
};

use anyhow::{bail, Context as _, Result};
use aya::maps::{Array, MapData, RingBuf};
use proxy_common::{
    backend_flags,
    event::{event_kind, MonitorCtl},
    map_names, svc_flags,
};
use proxy_user::prog_run::{self as progrun, pkt::Pkt};
use proxy_user::{bpf, loader, model::Backend, BpfMaps, Frontend, Proto, ServiceEntry, Writer};

/// The kernel's run-time statistics of `prog` so far: (ns, runs).
fn run_stats(ebpf: &aya::Ebpf, prog: &str) -> Result<(u64, u64)> {
    let info = ebpf
        .program(prog)
        .with_context(|| format!("no program {prog}"))?
        .info()?;
    Ok((info.run_time().as_nanos() as u64, info.run_count()))
}

/// The program's own ns per run over what `f` ran.
fn program_ns(ebpf: &aya::Ebpf, prog: &str, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let (t0, n0) = run_stats(ebpf, prog)?;
    f()?;
    let (t1, n1) = run_stats(ebpf, prog)?;
    if n1 <= n0 {
        bail!("{prog}: the kernel counted no run (BPF_ENABLE_STATS off?)");
    }
    Ok((t1 - t0) as f64 / (n1 - n0) as f64)
}

/// `proxyctl monitor`'s side of the maps: the lease in `MONITOR`, the `EVENTS` reader.
struct Monitoring {
    ctl: Array<MapData, MonitorCtl>,
    ring: RingBuf<MapData>,
    events: u64,
}

impl Monitoring {
    fn on(dir: &proxy_user::pins::PinDir) -> Result<Self> {
        let rw = proxy_user::pins::Access::ReadWrite;
        let ctl: Array<MapData, MonitorCtl> = dir.typed(map_names::MONITOR, rw)?;
        let ring: RingBuf<MapData> = dir.typed(map_names::EVENTS, rw)?;
        let mut m = Self {
            ctl,
            ring,
            events: 0,
        };
        m.set(true)?;
        Ok(m)
    }

    /// A lease (every event type, a rate no run here reaches) or none.
    fn set(&mut self, on: bool) -> Result<()> {
        let ctl = if on {
            MonitorCtl {
                lease_until_ns: proxy_user::ctl::maps::monotonic_ns() + 3_600_000_000_000,
                cost_ns: 1,
                burst_ns: 1 << 40,
                types: u32::from(event_kind::DROP | event_kind::TRANSLATE),
                sample: 1,
            }
        } else {
            MonitorCtl::default()
        };
        self.ctl.set(0, ctl, 0)?;
        Ok(())
    }

    fn drain(&mut self) {
        while self.ring.next().is_some() {
            self.events += 1;
        }
    }

    fn off(mut self) -> Result<()> {
        self.ctl.set(0, MonitorCtl::default(), 0)?;
        Ok(())
    }
}

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
/// Repetitions of a drop per call in the back-to-back case: fewer events than the ring
/// buffer holds (`event::RINGBUF_BYTES` / 104 bytes a record), drained after each call.
const DROP_REPEAT: u32 = 1000;

struct Pins(PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        if self.0.exists() && loader::uninstall(&proxy_user::pins::PinDir::new(&self.0)).is_err() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn entry(vip: Ipv4Addr, port: u16, proto: Proto, backends: Vec<SocketAddr>) -> ServiceEntry {
    ServiceEntry {
        backends: backends
            .into_iter()
            .map(|addr| Backend {
                addr,
                flags: backend_flags::LOCAL,
            })
            .collect(),
        ..ServiceEntry::new(Frontend::new(vip, port, proto), [])
    }
}

fn median(mut v: Vec<u32>) -> f64 {
    v.sort_unstable();
    f64::from(v[v.len() / 2])
}

// Long: the measured sequence in the order of the printed table (load, fill, each case off
// and on, cleanup); the steps share the loaded object and the pins.
fn main() -> Result<()> {
    // SAFETY: plain getter.
    if unsafe { libc::geteuid() } != 0 {
        bail!("prog_run needs root (BPF)");
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let (calls, repeat, runs) = if quick {
        (300, 20_000, 3)
    } else {
        (3000, 200_000, 5)
    };
    if !std::path::Path::new("/sys/fs/bpf").is_dir() {
        bail!("/sys/fs/bpf is missing (cargo xtask setup mounts it)");
    }
    // Run-time statistics for every program while this fd is open (closed at exit).
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("BPF_ENABLE_STATS (kernel 5.8+)")?;
    let mut results = Vec::new();
    for services in [1usize, 10_000] {
        let pins = Pins(PathBuf::from("/sys/fs/bpf").join(format!(
            "ebpf-proxy-progrun-{}-{services}",
            std::process::id()
        )));
        let ebpf = progrun::load_tc(
            &proxy_user::pins::PinDir::new(&pins.0),
            loader::DEFAULT_CONNTRACK_FLOWS,
        )?;
        bpf::set_node_addresses(
            &proxy_user::pins::PinDir::new(&pins.0),
            &["192.0.2.1".parse()?],
        )?;
        let mut writer = Writer::new(BpfMaps::open(&pins.0)?);
        for i in 0..services - 1 {
            let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 97, 0, 0)) + i as u32);
            let base = u32::from(Ipv4Addr::new(10, 228, 0, 0)) + 10 * i as u32;
            let backends = (0..10)
                .map(|e| SocketAddr::from((Ipv4Addr::from(base + e), 80)))
                .collect();
            writer
                .upsert(&entry(vip, 80, Proto::Tcp, backends))
                .with_context(|| format!("filler {i}"))?;
        }
        let target: Vec<SocketAddr> = (1..=10)
            .map(|e| SocketAddr::from((Ipv4Addr::new(10, 224, 1, e), 53)))
            .collect();
        writer.upsert(&entry(
            Ipv4Addr::new(10, 96, 0, 10),
            53,
            Proto::Udp,
            target.clone(),
        ))?;
        // A LoadBalancer whose loadBalancerSourceRanges leave the bench's drop client
        // out: every packet from it a refused new flow (a drop event, the packet
        // untouched, so that one call can repeat it).
        let mut lb = entry(
            Ipv4Addr::new(203, 0, 113, 10),
            53,
            Proto::Udp,
            target.clone(),
        );
        lb.flags |= svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES;
        lb.source_ranges = vec![("198.51.100.0".parse()?, 24)];
        writer.upsert(&lb)?;

        // TC ingress and XDP (`--acceleration`) on the same maps: each passes a packet for
        // a local backend to the stack (`TC_ACT_OK`, `XDP_PASS`) after DNAT; each its own
        // client ports, so that its new flows are new.
        for (prog, pass, drop, first_port) in [
            (
                proxy_common::prog_names::TC_INGRESS,
                TC_ACT_OK,
                TC_ACT_SHOT,
                10_000u32,
            ),
            (progrun::XDP_PROGRAM, XDP_PASS, XDP_DROP, 30_000),
        ] {
            let mut record = |case: &str, ns: f64, own: f64, verdict: u32, how: &str| {
                results.push(serde_json::json!({
                    "program": prog,
                    "case": case,
                    "services": services,
                    "ns_per_packet": ns,
                    "program_ns": own,
                    "verdict": verdict,
                    "how": how,
                }));
            };
            // Miss, with repeat.
            let miss = Pkt::udp("198.51.100.7:5000", "10.96.0.11:53").build();
            let mut v = Vec::new();
            let mut verdict = 0;
            let own = program_ns(&ebpf, prog, || {
                for _ in 0..runs {
                    let r = progrun::run_classifier(&ebpf, prog, &miss, repeat)?;
                    if r.out != miss {
                        bail!("a miss was rewritten");
                    }
                    verdict = r.verdict;
                    v.push(r.duration_ns);
                }
                Ok(())
            })?;
            record(
                "miss (not a frontend)",
                median(v),
                own,
                verdict,
                &format!("repeat {repeat}, median of {runs} calls"),
            );
            // Not IP (the frame above as ARP): the program's entry and exit, the floor
            // every other case pays.
            let mut not_ip = miss.clone();
            not_ip[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
            let mut v = Vec::new();
            let own = program_ns(&ebpf, prog, || {
                for _ in 0..runs {
                    let r = progrun::run_classifier(&ebpf, prog, &not_ip, repeat)?;
                    verdict = r.verdict;
                    v.push(r.duration_ns);
                }
                Ok(())
            })?;
            record(
                "not IP (the floor)",
                median(v),
                own,
                verdict,
                &format!("repeat {repeat}, median of {runs} calls"),
            );
            // Miss, one per call.
            let mut v = Vec::new();
            let own = program_ns(&ebpf, prog, || {
                v = (0..calls)
                    .map(|_| progrun::run_classifier(&ebpf, prog, &miss, 1).map(|r| r.duration_ns))
                    .collect::<Result<_>>()?;
                Ok(())
            })?;
            record(
                "miss, 1 per call (timing baseline)",
                median(v),
                own,
                verdict,
                &format!("median of {calls} calls"),
            );
            // New flows: a new client port per call.
            let mut v = Vec::new();
            let own = program_ns(&ebpf, prog, || {
                for i in 0..calls {
                    let p = Pkt::udp(&format!("198.51.100.7:{}", first_port + i), "10.96.0.10:53");
                    let r = progrun::run_classifier(&ebpf, prog, &p.build(), 1)?;
                    let out = Pkt::parse(&r.out);
                    if r.verdict != pass || !target.contains(&out.dst) {
                        bail!("new flow {i}: verdict {} to {}", r.verdict, out.dst);
                    }
                    verdict = r.verdict;
                    v.push(r.duration_ns);
                }
                Ok(())
            })?;
            record(
                "frontend hit, new flow",
                median(v),
                own,
                verdict,
                &format!("median of {calls} calls, one new flow each"),
            );
            // Conntrack hits: the first flow again.
            let p = Pkt::udp(&format!("198.51.100.7:{first_port}"), "10.96.0.10:53").build();
            let mut v = Vec::new();
            let mut first = None;
            let own = program_ns(&ebpf, prog, || {
                for _ in 0..calls {
                    let r = progrun::run_classifier(&ebpf, prog, &p, 1)?;
                    let dst = Pkt::parse(&r.out).dst;
                    if *first.get_or_insert(dst) != dst {
                        bail!("conntrack hit went to {dst}, the flow was at {first:?}");
                    }
                    verdict = r.verdict;
                    v.push(r.duration_ns);
                }
                Ok(())
            })?;
            record(
                "conntrack hit",
                median(v),
                own,
                verdict,
                &format!("median of {calls} calls, the same flow"),
            );
            // The same two cases with `proxyctl monitor`'s reporting on (issue 28: the rows
            // above are the cost when off): a lease in MONITOR, every event type, a rate
            // no run here reaches, the ring buffer drained after each call (outside the
            // measured run). A new flow writes one event; a conntrack hit none (known
            // flows are no events), so it pays the lease check and the report call only.
            let mut mon = Monitoring::on(&proxy_user::pins::PinDir::new(&pins.0))?;
            let mut v = Vec::new();
            let base = first_port + calls;
            let own = program_ns(&ebpf, prog, || {
                for i in 0..calls {
                    let p = Pkt::udp(&format!("198.51.100.7:{}", base + i), "10.96.0.10:53");
                    let r = progrun::run_classifier(&ebpf, prog, &p.build(), 1)?;
                    if r.verdict != pass {
                        bail!("new flow {i} (monitor on): verdict {}", r.verdict);
                    }
                    mon.drain();
                    v.push(r.duration_ns);
                }
                Ok(())
            })?;
            if mon.events != u64::from(calls) {
                bail!("{prog}: {} events for {calls} new flows", mon.events);
            }
            record(
                "frontend hit, new flow (monitor on)",
                median(v),
                own,
                pass,
                &format!("median of {calls} calls, one new flow and one event each"),
            );
            let mut v = Vec::new();
            let own = program_ns(&ebpf, prog, || {
                for _ in 0..calls {
                    let r = progrun::run_classifier(&ebpf, prog, &p, 1)?;
                    mon.drain();
                    v.push(r.duration_ns);
                }
                Ok(())
            })?;
            if mon.events != u64::from(calls) {
                bail!("{prog}: a conntrack hit wrote an event");
            }
            record(
                "conntrack hit (monitor on)",
                median(v),
                own,
                pass,
                &format!("median of {calls} calls, the same flow, no event"),
            );
            // New flows with reporting off and on in turn, call by call (the lease
            // written between calls, outside the measured runs): the cost of an event
            // without the drift of a busy machine between two separate series.
            let (mut off, mut on) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
            let base = base + calls;
            for i in 0..calls {
                for (lease, v, port) in [
                    (false, &mut off, base + 2 * i),
                    (true, &mut on, base + 2 * i + 1),
                ] {
                    mon.set(lease)?;
                    let p = Pkt::udp(&format!("198.51.100.7:{port}"), "10.96.0.10:53");
                    let (t0, _) = run_stats(&ebpf, prog)?;
                    let r = progrun::run_classifier(&ebpf, prog, &p.build(), 1)?;
                    let (t1, _) = run_stats(&ebpf, prog)?;
                    if r.verdict != pass {
                        bail!("new flow {i} (in turn): verdict {}", r.verdict);
                    }
                    v.0.push(r.duration_ns);
                    v.1.push(u32::try_from(t1 - t0).unwrap_or(u32::MAX));
                }
                mon.drain();
            }
            if mon.events != 2 * u64::from(calls) {
                bail!(
                    "{prog}: {} events for {calls} new flows in turn",
                    mon.events
                );
            }
            for (case, (ns, own)) in [
                ("new flow, monitor off (in turn)", off),
                ("new flow, monitor on (in turn)", on),
            ] {
                let how = format!(
                    "median of {calls} calls, off and on alternating; one event per call, the ring buffer drained after each pair (never full: every event read), no wake-up; program_ns: the median of each run's own run-time statistics"
                );
                record(case, median(ns), median(own), pass, &how);
            }
            // Events back to back: a refused new flow (source range) repeated
            // DROP_REPEAT times in one call, one event each, off and on in turn; the
            // ring drained after each call. The per-call rows above pay the ring
            // buffer's first touch after the syscall (its pages, its lock's line) in every
            // event; here only the first of DROP_REPEAT does: the cost of an event at a
            // sustained rate.
            let denied = Pkt::udp("192.0.2.50:40000", "203.0.113.10:53").build();
            let (mut off, mut on) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
            let before = mon.events;
            for _ in 0..calls / 10 {
                for (lease, v) in [(false, &mut off), (true, &mut on)] {
                    mon.set(lease)?;
                    let (t0, n0) = run_stats(&ebpf, prog)?;
                    let r = progrun::run_classifier(&ebpf, prog, &denied, DROP_REPEAT)?;
                    let (t1, n1) = run_stats(&ebpf, prog)?;
                    if r.verdict != drop || n1 - n0 != u64::from(DROP_REPEAT) {
                        bail!("source-range drop: verdict {}, {} runs", r.verdict, n1 - n0);
                    }
                    v.0.push(r.duration_ns);
                    v.1.push(u32::try_from((t1 - t0) / u64::from(DROP_REPEAT)).unwrap_or(u32::MAX));
                    mon.drain();
                }
            }
            if mon.events - before != u64::from(calls / 10 * DROP_REPEAT) {
                bail!(
                    "{prog}: {} events for {} refused flows back to back",
                    mon.events - before,
                    calls / 10 * DROP_REPEAT
                );
            }
            for (case, (ns, own)) in [
                (
                    "source-range drop, monitor off (in turn, back to back)",
                    off,
                ),
                ("source-range drop, monitor on (in turn, back to back)", on),
            ] {
                let how = format!(
                    "repeat {DROP_REPEAT} (one event each when on), median of {} calls, off and on alternating, the ring buffer drained after each call (never full: every event read), no wake-up",
                    calls / 10
                );
                record(case, median(ns), median(own), drop, &how);
            }
            mon.off()?;
        }
        drop(writer);
        drop(ebpf);
        drop(pins);
    }
    println!(
        "{}",
        serde_json::json!({
            "repeat": repeat,
            "runs": runs,
            "calls": calls,
            "results": results,
        })
    );
    Ok(())
}
