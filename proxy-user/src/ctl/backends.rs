//! `proxyctl backends`: every `BACKEND4/6` entry with its flags, how many frontends
//! reach it through a live slot, and its connection count (`BACKEND_CONNS`).

use std::net::IpAddr;

use serde::Serialize;

use super::{
    snapshot::{backend_is_local, backend_state, Snapshot},
    table::Table,
};

/// The `backends` JSON document.
#[derive(Debug, Serialize)]
pub struct BackendsDoc {
    pub schema: u32,
    pub backends: Vec<BackendView>,
}

/// One backend id.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct BackendView {
    pub id: u32,
    pub address: IpAddr,
    pub port: u16,
    pub endpoint: String,
    pub protocol: &'static str,
    /// `ready` or `terminating`.
    pub state: &'static str,
    pub local: bool,
    pub flags_raw: u8,
    /// Number of frontends with a live slot naming this backend (0: an orphan).
    pub frontends: usize,
    /// Those frontends (`address:port/proto[/ext-local]`).
    pub used_by: Vec<String>,
    pub connections: u64,
}

/// Every backend, by id.
pub fn build(s: &Snapshot) -> Vec<BackendView> {
    let users = s.backend_users();
    s.services
        .backends
        .iter()
        .map(|(id, (b, proto))| {
            let used_by: Vec<String> = users
                .get(id)
                .map(|fes| fes.iter().map(ToString::to_string).collect())
                .unwrap_or_default();
            BackendView {
                id: *id,
                address: b.addr.ip(),
                port: b.addr.port(),
                endpoint: b.addr.to_string(),
                protocol: proto.as_str(),
                state: backend_state(b.flags),
                local: backend_is_local(b.flags),
                flags_raw: b.flags,
                frontends: used_by.len(),
                used_by,
                connections: s.conns_of(*id),
            }
        })
        .collect()
}

/// The `table` / `wide` text.
pub fn render(views: &[BackendView], wide: bool) -> String {
    if views.is_empty() {
        return "no backends programmed\n".into();
    }
    let mut t = if wide {
        Table::new(&[
            "ID",
            "BACKEND",
            "PROTO",
            "STATE",
            "LOCAL",
            "FLAGS",
            "FRONTENDS",
            "CONNS",
            "USED-BY",
        ])
    } else {
        Table::new(&["ID", "BACKEND", "PROTO", "STATE", "FRONTENDS", "CONNS"])
    };
    for v in views {
        let state = if !wide && v.local {
            format!("{},local", v.state)
        } else {
            v.state.to_string()
        };
        let mut row = vec![
            v.id.to_string(),
            v.endpoint.clone(),
            v.protocol.to_string(),
            state,
        ];
        if wide {
            row.push(if v.local { "yes" } else { "no" }.into());
            row.push(format!("{:#x}", v.flags_raw));
        }
        row.push(v.frontends.to_string());
        row.push(v.connections.to_string());
        if wide {
            row.push(if v.used_by.is_empty() {
                "-".into()
            } else {
                v.used_by.join(",")
            });
        }
        t.row(row);
    }
    t.render("")
}
