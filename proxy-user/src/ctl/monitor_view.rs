//! `proxyctl monitor`'s view of one event: the names (Services, reasons, hooks), the
//! row it prints (table, wide) and the JSON line it writes.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use proxy_common::{
    event::{event_hook, event_kind, Event},
    Reason,
};
use serde::Serialize;

use super::{services, stats::meaning};
use crate::model::Proto;

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
