//! `proxyctl conntrack`: the flows the TC datapath translated (`CT4/CT6`), both
//! directions of each flow next to each other, with what each direction rewrites, the
//! Service and backend, packets, flags and age (from `last_seen`, a
//! `bpf_ktime_get_ns()` value, against `CLOCK_MONOTONIC` now).

use std::net::IpAddr;

use proxy_common::{ct_flags, ct_timeouts, proto};
use serde::Serialize;

use super::{
    schema::SCHEMA,
    snapshot::{ct_backend_gen, ct_flag_names, CtEntry, Snapshot},
    table::Table,
};
use crate::model::Proto;

/// The `conntrack` JSON document.
#[derive(Debug, Serialize)]
pub struct ConntrackDoc {
    pub schema: u32,
    /// False when `CT4`/`CT6` are not pinned (a datapath without its TC part).
    pub available: bool,
    pub flows: Vec<FlowView>,
}

/// One direction of one flow.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FlowView {
    /// `ipv4` or `ipv6`.
    pub family: &'static str,
    pub protocol: String,
    /// `original` (client -> frontend) or `reply`.
    pub direction: &'static str,
    /// The packet's source as it arrives (`address:port`).
    pub source: String,
    /// The packet's destination as it arrives.
    pub destination: String,
    /// The new destination written into packets of this direction, if any.
    pub rewrite_destination: Option<String>,
    /// The new source written into packets of this direction, if any.
    pub rewrite_source: Option<String>,
    pub service_id: u32,
    pub service: Option<String>,
    pub backend_id: u32,
    pub backend: Option<String>,
    pub flags: Vec<String>,
    pub flags_raw: u32,
    /// The `BACKEND_GEN` generation at which the packet path last found this UDP flow's
    /// backend (0: not checked yet); looked up again when `BACKEND_GEN[0]` differs.
    pub backend_gen: u32,
    pub packets: u64,
    pub last_seen_ns: u64,
    pub age_seconds: f64,
    /// The idle timeout that applies (`proxy_common::ct_timeouts`, from protocol and flags).
    pub timeout_seconds: u64,
    /// Idle longer than its timeout: the datapath treats it as gone.
    pub expired: bool,
}

/// Idle timeout of an entry in nanoseconds.
pub fn timeout_ns(e: &CtEntry) -> u64 {
    if e.proto != proto::TCP {
        ct_timeouts::UDP
    } else if e.flags & ct_flags::CLOSING != 0 {
        ct_timeouts::TCP_CLOSING
    } else if e.flags & ct_flags::SEEN_REPLY != 0 {
        ct_timeouts::TCP_ESTABLISHED
    } else {
        ct_timeouts::TCP_SYN
    }
}

/// An age in whole units, floored: `7s`, `2m05s`, `3h04m`, `2d03h`.
pub fn format_age(ns: u64) -> String {
    let s = ns / 1_000_000_000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86400, (s % 86400) / 3600),
    }
}

fn proto_name(p: u8) -> String {
    Proto::from_number(p).map_or_else(|| format!("proto-{p}"), |p| p.as_str().to_string())
}

fn touches(e: &CtEntry, addr: IpAddr) -> bool {
    [Some(e.src), Some(e.dst), e.dnat, e.snat]
        .iter()
        .flatten()
        .any(|a| a.ip() == addr)
}

pub(crate) fn flow_view(s: &Snapshot, e: &CtEntry) -> FlowView {
    let age = s.now_ns.saturating_sub(e.last_seen_ns);
    let timeout = timeout_ns(e);
    FlowView {
        family: if e.src.is_ipv4() { "ipv4" } else { "ipv6" },
        protocol: proto_name(e.proto),
        direction: if e.dir == 0 { "original" } else { "reply" },
        source: e.src.to_string(),
        destination: e.dst.to_string(),
        rewrite_destination: e.dnat.map(|a| a.to_string()),
        rewrite_source: e.snat.map(|a| a.to_string()),
        service_id: e.service_id,
        service: s.service_name(e.service_id).map(str::to_string),
        backend_id: e.backend_id,
        backend: s.backend(e.backend_id).map(|(b, _)| b.addr.to_string()),
        flags: ct_flag_names(e.flags),
        flags_raw: e.flags,
        backend_gen: ct_backend_gen(e.flags),
        packets: e.packets,
        last_seen_ns: e.last_seen_ns,
        age_seconds: age as f64 / 1e9,
        timeout_seconds: timeout / 1_000_000_000,
        expired: age > timeout,
    }
}

/// Every entry (only those touching `addr`, if given), each original direction followed
/// by its reply, then replies whose original is gone.
pub fn build(s: &Snapshot, addr: Option<IpAddr>) -> ConntrackDoc {
    let Some(flows) = &s.flows else {
        return ConntrackDoc {
            schema: SCHEMA,
            available: false,
            flows: Vec::new(),
        };
    };
    let key = |e: &CtEntry| (e.proto, e.src, e.dst);
    let mut originals: Vec<&CtEntry> = flows.iter().filter(|e| e.dir == 0).collect();
    let mut replies: Vec<&CtEntry> = flows.iter().filter(|e| e.dir != 0).collect();
    originals.sort_by_key(|e| key(e));
    replies.sort_by_key(|e| key(e));
    let mut used = vec![false; replies.len()];
    let mut ordered: Vec<&CtEntry> = Vec::with_capacity(flows.len());
    for o in originals {
        ordered.push(o);
        let want = o.reply_key();
        if let Ok(i) = replies.binary_search_by_key(&want, |e| key(e)) {
            if !used[i] {
                used[i] = true;
                ordered.push(replies[i]);
            }
        }
    }
    ordered.extend(
        replies
            .iter()
            .zip(&used)
            .filter(|(_, u)| !**u)
            .map(|(e, _)| *e),
    );
    let flows = ordered
        .into_iter()
        .filter(|e| addr.is_none_or(|a| touches(e, a)))
        .map(|e| flow_view(s, e))
        .collect();
    ConntrackDoc {
        schema: SCHEMA,
        available: true,
        flows,
    }
}

fn rewrite_cell(f: &FlowView) -> String {
    let mut parts = Vec::new();
    if let Some(d) = &f.rewrite_destination {
        parts.push(format!("dst->{d}"));
    }
    if let Some(s) = &f.rewrite_source {
        parts.push(format!("src->{s}"));
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(" ")
    }
}

/// The `table` / `wide` text.
pub fn render(doc: &ConntrackDoc, wide: bool) -> String {
    if !doc.available {
        return "no conntrack maps pinned (CT4/CT6): this datapath has no TC part, \
                and socket-level translation keeps no per-flow state\n"
            .into();
    }
    if doc.flows.is_empty() {
        return "no flows\n".into();
    }
    let mut t = if wide {
        Table::new(&[
            "PROTO",
            "DIR",
            "SOURCE",
            "DESTINATION",
            "REWRITE",
            "SERVICE",
            "SVC-ID",
            "BACKEND",
            "PACKETS",
            "AGE",
            "TIMEOUT",
            "FLAGS",
        ])
    } else {
        Table::new(&[
            "PROTO",
            "DIR",
            "SOURCE",
            "DESTINATION",
            "REWRITE",
            "SERVICE",
            "PACKETS",
            "AGE",
            "FLAGS",
        ])
    };
    for f in &doc.flows {
        let age_ns = (f.age_seconds * 1e9) as u64;
        let mut row = vec![
            f.protocol.clone(),
            if f.direction == "original" {
                "orig"
            } else {
                "reply"
            }
            .into(),
            f.source.clone(),
            f.destination.clone(),
            rewrite_cell(f),
            f.service.clone().unwrap_or_else(|| "-".into()),
        ];
        if wide {
            row.push(f.service_id.to_string());
            row.push(match &f.backend {
                Some(b) => format!("{b} ({})", f.backend_id),
                None if f.backend_id == 0 => "-".into(),
                None => format!("? ({})", f.backend_id),
            });
        }
        row.push(f.packets.to_string());
        row.push(format_age(age_ns));
        if wide {
            row.push(if f.expired {
                "expired".into()
            } else {
                format_age(f.timeout_seconds * 1_000_000_000)
            });
        }
        row.push(if f.flags.is_empty() {
            "-".into()
        } else {
            f.flags.join(",")
        });
        t.row(row);
    }
    t.render("")
}

/// Whether an address parses; used by the CLI for `--addr`.
pub fn parse_addr(s: &str) -> Result<IpAddr, String> {
    s.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .map_err(|e| format!("{s:?} is not an IP address: {e}"))
}
