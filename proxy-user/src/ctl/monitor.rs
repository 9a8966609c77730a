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
    collections::BTreeMap,
    io::{self, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, OwnedFd},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use aya::maps::{Array, MapData, PerCpuArray, RingBuf};
use proxy_common::{
    event::{
        event_hook, event_kind, Event, MonitorCpu, MonitorCtl, DEFAULT_BURST, DEFAULT_RATE,
        LEASE_NS,
    },
    map_names as names, Reason,
};
use serde::Serialize;

use super::{
    error::{Error, Result},
    maps::monotonic_ns,
    services,
    stats::meaning,
    Maps,
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

/// One event as `monitor` shows it (`-o json`: one object per line).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EventView {
    /// UTC, RFC 3339 with nanoseconds.
    pub time: String,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of the event.
    pub ts_ns: u64,
    /// `connect`, `sendmsg`, `tc_ingress`, `tc_egress`, `xdp`.
    pub hook: &'static str,
    /// `drop` or `translate`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub reason: &'static str,
    pub meaning: &'static str,
    /// `ipv4` or `ipv6`.
    pub family: &'static str,
    pub protocol: String,
    /// The source as it came; null at the socket hooks (not bound yet).
    pub source: Option<String>,
    /// The destination as it came (the frontend).
    pub destination: String,
    /// The source as it left (the SNAT address when SNATed); null at the socket hooks.
    pub new_source: Option<String>,
    /// The destination as it left (the backend); equal to `destination` for a drop.
    pub new_destination: String,
    /// `namespace/name[:port]`, from the service id or else the frontend address.
    pub service: Option<String>,
    /// 0 when the hook did not know it.
    pub service_id: u32,
    /// 0 when none was chosen.
    pub backend_id: u32,
}

/// The monitor's own line at the end (`-o json`: `{"summary": ...}`).
#[derive(Clone, Debug, Serialize, PartialEq, Eq, Default)]
pub struct Summary {
    /// Events read from the ring buffer.
    pub received: u64,
    /// Events shown (after the filters).
    pub shown: u64,
    /// Summed over CPUs since the maps were created: written, lost to the rate limit,
    /// lost to a full ring buffer, skipped by sampling.
    pub emitted: u64,
    pub lost_rate_limit: u64,
    pub lost_ring_full: u64,
    pub sampled_out: u64,
}

/// Service names from the snapshot: by id, and by frontend `(address, port, protocol)`.
#[derive(Debug, Default)]
pub struct Names {
    by_id: BTreeMap<u32, String>,
    by_frontend: BTreeMap<(IpAddr, u16, String), (u32, String)>,
}

impl Names {
    /// From the frontends `proxyctl services` shows.
    pub fn new(views: &[services::ServiceView]) -> Self {
        let mut n = Names::default();
        for v in views {
            let Some(name) = &v.service else { continue };
            n.by_id.insert(v.service_id, name.clone());
            n.by_frontend.insert(
                (v.address, v.port, v.protocol.to_string()),
                (v.service_id, name.clone()),
            );
        }
        n
    }

    fn resolve(&self, id: u32, dst: SocketAddr, proto: &str) -> (u32, Option<String>) {
        if id != 0 {
            if let Some(n) = self.by_id.get(&id) {
                return (id, Some(n.clone()));
            }
        }
        match self
            .by_frontend
            .get(&(dst.ip(), dst.port(), proto.to_string()))
        {
            Some((id, n)) => (*id, Some(n.clone())),
            None => (id, None),
        }
    }
}

fn addr(family: u8, w: &[u32; 4]) -> IpAddr {
    if family == 4 {
        IpAddr::V4(Ipv4Addr::from(u32::from_be(w[0])))
    } else {
        let mut b = [0u8; 16];
        for (i, word) in w.iter().enumerate() {
            b[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(b))
    }
}

fn sock(family: u8, w: &[u32; 4], port_be: u16) -> SocketAddr {
    SocketAddr::new(addr(family, w), u16::from_be(port_be))
}

/// An event as shown; `wall_minus_mono_ns` turns its monotonic stamp into UTC.
pub fn view(e: &Event, names: &Names, wall_minus_mono_ns: i128) -> EventView {
    let reason = Reason::ALL
        .get(e.reason as usize)
        .copied()
        .unwrap_or(Reason::NoService);
    let known = (e.reason as usize) < Reason::ALL.len();
    let protocol = Proto::from_number(e.proto)
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| e.proto.to_string());
    let sock_hook = matches!(e.hook, event_hook::CONNECT | event_hook::SENDMSG);
    let dst = sock(e.family, &e.before.daddr, e.before.dport);
    let (service_id, service) = names.resolve(e.service_id, dst, &protocol);
    EventView {
        time: rfc3339_utc(i128::from(e.ts_ns) + wall_minus_mono_ns),
        ts_ns: e.ts_ns,
        hook: event_hook::name(e.hook),
        kind: if e.kind == event_kind::DROP {
            "drop"
        } else {
            "translate"
        },
        reason: if known { reason.name() } else { "unknown" },
        meaning: if known {
            meaning(reason)
        } else {
            "a reason this proxyctl does not know (a newer datapath)"
        },
        family: if e.family == 4 { "ipv4" } else { "ipv6" },
        protocol,
        source: (!sock_hook).then(|| sock(e.family, &e.before.saddr, e.before.sport).to_string()),
        destination: dst.to_string(),
        new_source: (!sock_hook).then(|| sock(e.family, &e.after.saddr, e.after.sport).to_string()),
        new_destination: sock(e.family, &e.after.daddr, e.after.dport).to_string(),
        service,
        service_id,
        backend_id: e.backend_id,
    }
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

/// The header of the table and wide output.
pub fn header(wide: bool) -> String {
    let mut s = format!(
        "{:<30}  {:<10}  {:<9}  {:<22}  {:<5}  {:<45}  {:<45}  {}",
        "TIME", "HOOK", "TYPE", "REASON", "PROTO", "FLOW", "TRANSLATED", "SERVICE"
    );
    if wide {
        s.push_str("  SVC-ID  BACKEND-ID  MEANING");
    }
    s.push('\n');
    s
}

/// One table (or wide) line.
pub fn render(v: &EventView, wide: bool) -> String {
    let flow = format!(
        "{} -> {}",
        v.source.as_deref().unwrap_or("-"),
        v.destination
    );
    let xlated = if v.kind == "drop" {
        "-".to_string()
    } else {
        format!(
            "{} -> {}",
            v.new_source.as_deref().unwrap_or("-"),
            v.new_destination
        )
    };
    let mut s = format!(
        "{:<30}  {:<10}  {:<9}  {:<22}  {:<5}  {:<45}  {:<45}  {}",
        v.time,
        v.hook,
        v.kind,
        v.reason,
        v.protocol,
        flow,
        xlated,
        v.service.as_deref().unwrap_or("-")
    );
    if wide {
        s.push_str(&format!(
            "  {:<6}  {:<10}  {}",
            v.service_id, v.backend_id, v.meaning
        ));
    }
    s.push('\n');
    s
}

/// UTC time of `ns` since the epoch, RFC 3339 with nanoseconds.
pub fn rfc3339_utc(ns: i128) -> String {
    let secs = ns.div_euclid(1_000_000_000) as i64;
    let nanos = ns.rem_euclid(1_000_000_000) as u32;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{nanos:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
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
