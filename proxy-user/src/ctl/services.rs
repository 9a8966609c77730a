//! `proxyctl services`: one row per frontend (its entry of `SVC4/6`, chunk 0) with its kind,
//! scope, Service name (from `REVNAT`), flags, and under it every backend slot with its backend's
//! address, state and connection count. Gaps (a slot or backend the count reaches but the
//! maps do not hold) are shown as `missing` and listed as problems.

use std::net::IpAddr;

use proxy_common::svc_flags;
use serde::Serialize;

use super::{
    snapshot::{backend_is_local, backend_state, scope_name, svc_flag_names, Kind, Snapshot},
    table::Table,
};
use crate::model::Frontend;

/// The `services` JSON document.
#[derive(Debug, Serialize)]
pub struct ServicesDoc {
    pub schema: u32,
    pub services: Vec<ServiceView>,
}

/// One frontend.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ServiceView {
    /// `address:port/proto`, with `/ext-local` for the external-local twin.
    pub frontend: String,
    pub address: IpAddr,
    pub port: u16,
    pub protocol: &'static str,
    /// `all` or `ext-local`.
    pub scope: String,
    pub kind: Kind,
    /// `namespace/name[:port]` from the `REVNAT` entry; null when none was written.
    pub service: Option<String>,
    pub service_id: u32,
    pub flags: Vec<String>,
    pub flags_raw: u16,
    /// 0 without session affinity.
    pub affinity_timeout_seconds: u32,
    pub source_ranges: Vec<String>,
    /// Slots `1..=backend_count` are in use.
    pub backend_count: u16,
    pub backends: Vec<SlotView>,
    /// Inconsistencies found in the maps (normally empty).
    pub problems: Vec<String>,
}

/// One backend slot of a frontend.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SlotView {
    pub slot: u16,
    /// 0 when the slot itself is missing.
    pub backend_id: u32,
    pub address: Option<IpAddr>,
    pub port: Option<u16>,
    /// `address:port` (`[v6]:port`).
    pub endpoint: Option<String>,
    /// `ready`, `terminating`, or `missing`.
    pub state: &'static str,
    pub local: bool,
    pub connections: u64,
}

/// Every frontend in the snapshot, in key order (v4 before v6; each twin after its
/// frontend).
pub fn build(s: &Snapshot) -> Vec<ServiceView> {
    s.services
        .frontends
        .keys()
        .filter_map(|fe| view(s, fe))
        .collect()
}

/// One frontend's view.
// Long: one frontend's view assembled field by field from the maps (slots, backends, flags,
// twin, counters) in the order proxyctl prints them.
pub fn view(s: &Snapshot, fe: &Frontend) -> Option<ServiceView> {
    let v = s.frontend(fe)?;
    let mut problems = Vec::new();
    let mut backends = Vec::with_capacity(usize::from(v.count));
    for slot in 1..=v.count {
        let Some(id) = s.slot(fe, slot) else {
            problems.push(format!("slot {slot} missing"));
            backends.push(SlotView {
                slot,
                backend_id: 0,
                address: None,
                port: None,
                endpoint: None,
                state: "missing",
                local: false,
                connections: 0,
            });
            continue;
        };
        match s.backend(id) {
            Some((b, _)) => backends.push(SlotView {
                slot,
                backend_id: id,
                address: Some(b.addr.ip()),
                port: Some(b.addr.port()),
                endpoint: Some(b.addr.to_string()),
                state: backend_state(b.flags),
                local: backend_is_local(b.flags),
                connections: s.conns_of(id),
            }),
            None => {
                problems.push(format!("slot {slot}: backend {id} missing"));
                backends.push(SlotView {
                    slot,
                    backend_id: id,
                    address: None,
                    port: None,
                    endpoint: None,
                    state: "missing",
                    local: false,
                    connections: s.conns_of(id),
                });
            }
        }
    }
    let service = match s.services.revnat.get(&v.service_id) {
        None => {
            problems.push(format!("no REVNAT entry for service id {}", v.service_id));
            None
        }
        Some((rfe, name)) => {
            if rfe != fe {
                problems.push(format!(
                    "REVNAT entry {} names {rfe}, not this frontend",
                    v.service_id
                ));
            }
            (!name.is_empty()).then(|| name.clone())
        }
    };
    let mut source_ranges = Vec::new();
    if v.flags & svc_flags::SOURCE_RANGES != 0 {
        match s.src_ranges.get(&v.service_id) {
            Some(r) => source_ranges = r.iter().map(ToString::to_string).collect(),
            None => problems.push(format!(
                "source-ranges flag set but no SRC_RANGE entry for service id {}",
                v.service_id
            )),
        }
    }
    Some(ServiceView {
        frontend: fe.to_string(),
        address: fe.addr,
        port: fe.port,
        protocol: fe.proto.as_str(),
        scope: scope_name(fe.scope),
        kind: Kind::of(v.flags),
        service,
        service_id: v.service_id,
        flags: svc_flag_names(v.flags),
        flags_raw: v.flags,
        affinity_timeout_seconds: v.affinity_timeout,
        source_ranges,
        backend_count: v.count,
        backends,
        problems,
    })
}

/// The FLAGS cell: behaviour flags (the kind has its own column), with their values.
pub fn flags_cell(v: &ServiceView) -> String {
    let kind_bits = svc_flags::NODE_PORT | svc_flags::EXTERNAL_IP | svc_flags::LOAD_BALANCER;
    let mut out = Vec::new();
    for name in svc_flag_names(v.flags_raw & !kind_bits) {
        match name.as_str() {
            "affinity" => out.push(format!("affinity={}s", v.affinity_timeout_seconds)),
            "source-ranges" if !v.source_ranges.is_empty() => {
                out.push(format!("source-ranges={}", v.source_ranges.join(",")))
            }
            _ => out.push(name),
        }
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(",")
    }
}

/// What happens to a connection when there is no backend.
pub fn no_backend_cell(v: &ServiceView) -> &'static str {
    if v.flags_raw & svc_flags::LOCAL_ONLY != 0 {
        "(none: host unreachable)"
    } else {
        "(none: refused)"
    }
}

fn state_cell(b: &SlotView, wide: bool) -> String {
    if !wide && b.local {
        format!("{},local", b.state)
    } else {
        b.state.to_string()
    }
}

/// The `table` / `wide` text.
// Long: the services table: one row layout, column by column.
pub fn render(views: &[ServiceView], wide: bool) -> String {
    if views.is_empty() {
        return "no frontends programmed\n".into();
    }
    let mut t = if wide {
        Table::new(&[
            "FRONTEND", "KIND", "SERVICE", "SVC-ID", "BACKENDS", "FLAGS", "SLOT", "ID", "BACKEND",
            "STATE", "LOCAL", "CONNS",
        ])
    } else {
        Table::new(&[
            "FRONTEND", "KIND", "SERVICE", "BACKENDS", "FLAGS", "SLOT", "ID", "BACKEND", "STATE",
            "CONNS",
        ])
    };
    let mut problems = Vec::new();
    for v in views {
        let flags = if wide {
            format!("{:#x} {}", v.flags_raw, flags_cell(v))
        } else {
            flags_cell(v)
        };
        let head: Vec<String> = if wide {
            vec![
                v.frontend.clone(),
                v.kind.to_string(),
                v.service.clone().unwrap_or_else(|| "-".into()),
                v.service_id.to_string(),
                v.backend_count.to_string(),
                flags,
            ]
        } else {
            vec![
                v.frontend.clone(),
                v.kind.to_string(),
                v.service.clone().unwrap_or_else(|| "-".into()),
                v.backend_count.to_string(),
                flags,
            ]
        };
        let blank = vec![String::new(); head.len()];
        if v.backends.is_empty() {
            let mut row = head.clone();
            row.extend([
                "-".into(),
                "-".into(),
                no_backend_cell(v).into(),
                "-".into(),
            ]);
            if wide {
                row.push("-".into());
            }
            row.push("-".into());
            t.row(row);
        }
        for (i, b) in v.backends.iter().enumerate() {
            let mut row = if i == 0 { head.clone() } else { blank.clone() };
            row.push(b.slot.to_string());
            row.push(if b.backend_id == 0 {
                "-".into()
            } else {
                b.backend_id.to_string()
            });
            row.push(b.endpoint.clone().unwrap_or_else(|| "-".into()));
            row.push(state_cell(b, wide));
            if wide {
                row.push(if b.local { "yes" } else { "no" }.into());
            }
            row.push(b.connections.to_string());
            t.row(row);
        }
        for p in &v.problems {
            problems.push(format!("{}: {p}", v.frontend));
        }
    }
    let mut out = t.render("");
    if !problems.is_empty() {
        out.push_str("\nproblems:\n");
        for p in problems {
            out.push_str(&format!("  {p}\n"));
        }
    }
    out
}
