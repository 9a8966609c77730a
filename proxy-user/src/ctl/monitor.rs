//! `proxyctl monitor`: the datapath's drops and new flows as they happen, read from the
//! `EVENTS` ring buffer (`proxy_common::event`).
//!
//! **Turning reporting on and off.** The hooks report only while `MONITOR[0]` holds a
//! lease in the future (`lease_until_ns`, CLOCK_MONOTONIC); a monitor writes `now +
//! LEASE_NS` (3 s) when it starts and every second after, and 0 when it exits normally.
//! Killed (SIGKILL, OOM), it writes nothing: the lease runs out within 3 s and the first
//! hook that sees it expired clears it, so reporting cannot be left on by a monitor that
//! died. A lease was chosen over a reference count (which a killed monitor would leak) and
//! over tying reporting to an open descriptor (the kernel does not tell a BPF program
//! whether the ring buffer has a reader). A ring buffer has one consumer position, so one
//! monitor reads at a time: it holds an exclusive `flock` on the pin directory (released
//! by the kernel when the process dies, killed or not); a second one is refused.
//!
//! **Writes.** `MONITOR` (the lease) and `EVENTS` (the consumer position, which reading
//! advances) are opened read-write; every other map read-only, as the other commands do.

use std::{
    io::{self, Write},
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, OwnedFd},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use aya::maps::{Array, MapData, PerCpuArray, RingBuf};
use proxy_common::{
    event::{event_kind, Event, MonitorCpu, MonitorCtl, DEFAULT_BURST, DEFAULT_RATE, LEASE_NS},
    map_names as names, Reason,
};
use serde::Serialize;

pub use super::monitor_view::{header, render, rfc3339_utc, view, EventView, Names, Summary};
use super::{
    error::{Error, Result},
    maps::monotonic_ns,
    services, Maps,
};
use crate::{
    model::Proto,
    pins::{Access, PinDir},
};

/// `--type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EventType {
    /// Drops and refusals only.
    Drop,
    /// New flows' translations (and stale UDP backends) only.
    Translate,
    /// Both.
    All,
}

impl EventType {
    /// The `MonitorCtl::types` bits.
    pub fn bits(self) -> u32 {
        match self {
            EventType::Drop => u32::from(event_kind::DROP),
            EventType::Translate => u32::from(event_kind::TRANSLATE),
            EventType::All => u32::from(event_kind::DROP | event_kind::TRANSLATE),
        }
    }
}

/// What `monitor` shows, and how much the datapath may send.
#[derive(Clone, Debug, clap::Args)]
pub struct MonitorArgs {
    /// Which events.
    #[arg(long = "type", value_enum, default_value_t = EventType::All)]
    pub kind: EventType,
    /// Only events of this Service (`namespace/name`, or `namespace/name:port`).
    #[arg(long)]
    pub service: Option<String>,
    /// Only events with this address anywhere (source, destination, before or after).
    #[arg(long, value_parser = super::conntrack::parse_addr)]
    pub addr: Option<IpAddr>,
    /// Only events with this port anywhere.
    #[arg(long)]
    pub port: Option<u16>,
    /// Only this protocol (`tcp`, `udp`, `sctp`).
    #[arg(long, value_parser = parse_proto)]
    pub protocol: Option<u8>,
    /// Only this outcome (a `proxyctl stats` reason name, e.g. `tc_source_denied`).
    #[arg(long, value_parser = parse_reason)]
    pub reason: Option<Reason>,
    /// Events per second per CPU the datapath may send (a token bucket); the rest are
    /// counted as lost.
    #[arg(long, default_value_t = DEFAULT_RATE, value_parser = clap::value_parser!(u32).range(1..))]
    pub rate: u32,
    /// Events a CPU may send at once above the rate.
    #[arg(long, default_value_t = DEFAULT_BURST, value_parser = clap::value_parser!(u32).range(1..))]
    pub burst: u32,
    /// Report one in N events, chosen at random (1: every one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub sample: u32,
    /// Stop after this many events shown.
    #[arg(long)]
    pub count: Option<u64>,
    /// Stop after this long (`30s`, `2m`).
    #[arg(long, value_parser = super::watch::parse_interval)]
    pub duration: Option<Duration>,
}

/// `--protocol`.
pub fn parse_proto(s: &str) -> std::result::Result<u8, String> {
    match s.to_ascii_lowercase().as_str() {
        "tcp" => Ok(Proto::Tcp.number()),
        "udp" => Ok(Proto::Udp.number()),
        "sctp" => Ok(Proto::Sctp.number()),
        _ => Err(format!("{s:?} is not a protocol: tcp, udp or sctp")),
    }
}

/// `--reason`: a `Reason`'s name.
pub fn parse_reason(s: &str) -> std::result::Result<Reason, String> {
    Reason::ALL
        .into_iter()
        .find(|r| r.name() == s)
        .ok_or_else(|| format!("{s:?} is not a reason; `proxyctl stats` lists them"))
}

/// Whether an event passes the command line's filters.
pub fn matches(v: &EventView, e: &Event, a: &MonitorArgs) -> bool {
    if let Some(r) = a.reason {
        if e.reason != r as u32 {
            return false;
        }
    }
    if a.protocol.is_some_and(|p| p != e.proto) {
        return false;
    }
    let ends = [
        v.source.as_deref(),
        Some(v.destination.as_str()),
        v.new_source.as_deref(),
        Some(v.new_destination.as_str()),
    ];
    let ends: Vec<SocketAddr> = ends
        .into_iter()
        .flatten()
        .filter_map(|s| s.parse().ok())
        .collect();
    if a.addr.is_some_and(|x| !ends.iter().any(|s| s.ip() == x)) {
        return false;
    }
    if a.port.is_some_and(|x| !ends.iter().any(|s| s.port() == x)) {
        return false;
    }
    if let Some(want) = &a.service {
        let Some(have) = &v.service else { return false };
        let base = have.split(':').next().unwrap_or(have);
        if have != want && base != want {
            return false;
        }
    }
    true
}

fn realtime_ns() -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// The maps `monitor` writes: the lease and the ring buffer it consumes.
struct Control {
    ctl: Array<MapData, MonitorCtl>,
    cpu: PerCpuArray<MapData, MonitorCpu>,
    ring: RingBuf<MapData>,
    want: MonitorCtl,
    /// The exclusive lock on the pin directory (one reader of the ring buffer).
    _lock: OwnedFd,
}

fn map_err<'a>(
    pins: &'a PinDir,
    name: &'static str,
) -> impl Fn(crate::pins::PinError) -> Error + 'a {
    move |e| match e {
        crate::pins::PinError::Missing { .. } => Error::Usage(format!(
            "{name} is not pinned in {}: the running datapath is older than monitor \
             (upgrade proxy-agent)",
            pins.path().display()
        )),
        crate::pins::PinError::Permission { path } => Error::Permission { path },
        crate::pins::PinError::Open { path, source } => Error::Open { path, source },
        other => Error::Usage(format!("{name}: {other}")),
    }
}

impl Control {
    fn open(pins: &PinDir, a: &MonitorArgs) -> Result<Self> {
        let dir = std::fs::File::open(pins.path()).map_err(|source| Error::Open {
            path: pins.path().to_path_buf(),
            source,
        })?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(Error::Busy(format!(
                "another proxyctl monitor reads the events of {} (the ring buffer has one \
                 reader); stop it first",
                pins.path().display()
            )));
        }
        let rw = Access::ReadWrite;
        let ctl = pins
            .typed::<Array<MapData, MonitorCtl>>(names::MONITOR, rw)
            .map_err(map_err(pins, names::MONITOR))?;
        let cpu = pins
            .typed::<PerCpuArray<MapData, MonitorCpu>>(names::MONITOR_CPU, Access::ReadOnly)
            .map_err(map_err(pins, names::MONITOR_CPU))?;
        let ring = pins
            .typed::<RingBuf<MapData>>(names::EVENTS, rw)
            .map_err(map_err(pins, names::EVENTS))?;
        let cost_ns = 1_000_000_000 / u64::from(a.rate);
        let want = MonitorCtl {
            lease_until_ns: 0,
            cost_ns,
            burst_ns: cost_ns * u64::from(a.burst),
            types: a.kind.bits(),
            sample: a.sample,
        };
        Ok(Self {
            ctl,
            cpu,
            ring,
            want,
            _lock: dir.into(),
        })
    }

    /// Writes the lease: on for `LEASE_NS` from now.
    fn renew(&mut self) -> Result<()> {
        let v = MonitorCtl {
            lease_until_ns: monotonic_ns() + LEASE_NS,
            ..self.want
        };
        self.ctl.set(0, v, 0).map_err(|source| Error::Read {
            map: names::MONITOR,
            source,
        })
    }

    /// Turns reporting off (a normal exit; this monitor is the only reader).
    fn off(&mut self) {
        let _ = self.ctl.set(0, MonitorCtl::default(), 0);
    }

    fn counts(&self, s: &mut Summary) {
        if let Ok(v) = self.cpu.get(&0, 0) {
            s.emitted = v.iter().map(|c| c.emitted).sum();
            s.lost_rate_limit = v.iter().map(|c| c.lost_rate).sum();
            s.lost_ring_full = v.iter().map(|c| c.lost_full).sum();
            s.sampled_out = v.iter().map(|c| c.sampled_out).sum();
        }
    }
}

/// Runs `monitor` until `--count`, `--duration`, SIGINT or SIGTERM.
// Long: the monitor's loop (lease, poll, decode, filter, print, summary) over one ring
// buffer and its counters.
pub fn run(
    pins: &PinDir,
    maps: &Maps,
    a: &MonitorArgs,
    json: bool,
    wide: bool,
    out: &mut dyn Write,
) -> Result<()> {
    let mut c = Control::open(pins, a)?;
    let snapshot = |maps: &Maps| -> Result<Names> {
        let s = maps.snapshot()?;
        Ok(Names::new(&services::build(&s)))
    };
    let mut names = snapshot(maps)?;
    let mut names_at = Instant::now();
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let start = Instant::now();
    let mut summary = Summary::default();
    let before = {
        let mut s = Summary::default();
        c.counts(&mut s);
        s
    };
    c.renew()?;
    let mut renewed = Instant::now();
    if !json {
        out.write_all(header(wide).as_bytes())?;
        out.flush()?;
    }
    let r = (|| -> Result<()> {
        loop {
            if STOP.load(Ordering::Relaxed)
                || a.duration.is_some_and(|d| start.elapsed() >= d)
                || a.count.is_some_and(|n| summary.shown >= n)
            {
                return Ok(());
            }
            if renewed.elapsed() >= Duration::from_secs(1) {
                c.renew()?;
                renewed = Instant::now();
            }
            let mut pfd = libc::pollfd {
                fd: c.ring.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd we own; EINTR (a signal) just loops. The datapath does not
            // wake the reader (a wake-up per event cost about 10 us): read every 100 ms.
            unsafe { libc::poll(&mut pfd, 1, 100) };
            let offset = realtime_ns() - i128::from(monotonic_ns());
            let mut events = Vec::new();
            while let Some(item) = c.ring.next() {
                if item.len() >= size_of::<Event>() {
                    // SAFETY: `Event` is plain old data and the record is at least its size.
                    events.push(unsafe { item.as_ptr().cast::<Event>().read_unaligned() });
                }
            }
            for e in events {
                summary.received += 1;
                let mut v = view(&e, &names, offset);
                if v.service.is_none() && names_at.elapsed() >= Duration::from_secs(2) {
                    // A Service created since: read the names again (at most every 2 s).
                    names = snapshot(maps)?;
                    names_at = Instant::now();
                    v = view(&e, &names, offset);
                }
                if !matches(&v, &e, a) {
                    continue;
                }
                summary.shown += 1;
                if json {
                    serde_json::to_writer(&mut *out, &v).map_err(io::Error::from)?;
                    out.write_all(b"\n")?;
                } else {
                    out.write_all(render(&v, wide).as_bytes())?;
                }
                if a.count.is_some_and(|n| summary.shown >= n) {
                    break;
                }
            }
            out.flush()?;
        }
    })();
    c.off();
    c.counts(&mut summary);
    summary.emitted -= before.emitted.min(summary.emitted);
    summary.lost_rate_limit -= before.lost_rate_limit.min(summary.lost_rate_limit);
    summary.lost_ring_full -= before.lost_ring_full.min(summary.lost_ring_full);
    summary.sampled_out -= before.sampled_out.min(summary.sampled_out);
    r?;
    if json {
        #[derive(Serialize)]
        struct Line<'a> {
            summary: &'a Summary,
        }
        serde_json::to_writer(&mut *out, &Line { summary: &summary }).map_err(io::Error::from)?;
        out.write_all(b"\n")?;
    } else {
        writeln!(
            out,
            "# {} shown, {} received; datapath: {} emitted, {} lost to the rate limit, {} lost \
             to a full ring buffer, {} sampled out",
            summary.shown,
            summary.received,
            summary.emitted,
            summary.lost_rate_limit,
            summary.lost_ring_full,
            summary.sampled_out
        )?;
    }
    out.flush()?;
    Ok(())
}
