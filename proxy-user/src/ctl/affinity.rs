//! `proxyctl affinity`: which client is held to which backend under
//! `sessionAffinity: ClientIP` (`AFFINITY`), and for how much longer. A client is a
//! network namespace (the socket hooks: one pod, one namespace; the node's own processes
//! share the host's) or a source address (TC).

use serde::Serialize;

use super::{
    conntrack::format_age,
    schema::SCHEMA,
    snapshot::{AffinityClient, AffinityEntry, Snapshot},
    table::Table,
};

/// The `affinity` JSON document.
#[derive(Debug, Serialize)]
pub struct AffinityDoc {
    pub schema: u32,
    /// False when `AFFINITY` is not pinned.
    pub available: bool,
    pub entries: Vec<AffinityView>,
}

/// One client held to one backend.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct AffinityView {
    /// `netns:<cookie>` or an address.
    pub client: String,
    pub service_id: u32,
    pub service: Option<String>,
    pub backend_id: u32,
    pub backend: Option<String>,
    pub slot: u16,
    pub idle_seconds: f64,
    /// The Service's `timeoutSeconds` (none when no frontend with that id has affinity).
    pub timeout_seconds: Option<u32>,
    /// Idle longer than the timeout, or its Service no longer has affinity: the next
    /// connection is balanced afresh.
    pub expired: bool,
}

fn client(c: &AffinityClient) -> String {
    match c {
        AffinityClient::Netns(cookie) => format!("netns:{cookie}"),
        AffinityClient::Addr(a) => a.to_string(),
    }
}

/// The affinity timeout of service `id`, from its frontends (seconds).
fn timeout_of(s: &Snapshot, id: u32) -> Option<u32> {
    s.services
        .frontends
        .values()
        .find(|v| v.service_id == id && v.affinity_timeout != 0)
        .map(|v| v.affinity_timeout)
}

fn view(s: &Snapshot, e: &AffinityEntry) -> AffinityView {
    let idle = s.now_ns.saturating_sub(e.last_used_ns);
    let timeout = timeout_of(s, e.service_id);
    AffinityView {
        client: client(&e.client),
        service_id: e.service_id,
        service: s.service_name(e.service_id).map(str::to_string),
        backend_id: e.backend_id,
        backend: s.backend(e.backend_id).map(|(b, _)| b.addr.to_string()),
        slot: e.slot,
        idle_seconds: idle as f64 / 1e9,
        timeout_seconds: timeout,
        expired: timeout.is_none_or(|t| idle > u64::from(t) * 1_000_000_000),
    }
}

/// Every entry, by service then client.
pub fn build(s: &Snapshot) -> AffinityDoc {
    let Some(entries) = &s.affinity else {
        return AffinityDoc {
            schema: SCHEMA,
            available: false,
            entries: Vec::new(),
        };
    };
    let mut sorted: Vec<&AffinityEntry> = entries.iter().collect();
    sorted.sort_by_key(|e| (e.service_id, e.client));
    AffinityDoc {
        schema: SCHEMA,
        available: true,
        entries: sorted.into_iter().map(|e| view(s, e)).collect(),
    }
}

/// The `table` / `wide` text.
pub fn render(doc: &AffinityDoc, wide: bool) -> String {
    if !doc.available {
        return "no AFFINITY map pinned: this datapath predates session affinity\n".into();
    }
    if doc.entries.is_empty() {
        return "no clients held (no Service with sessionAffinity: ClientIP was used)\n".into();
    }
    let mut head = vec!["CLIENT", "SERVICE", "BACKEND", "IDLE", "TIMEOUT"];
    if wide {
        head.extend(["SVC-ID", "BACKEND-ID", "SLOT"]);
    }
    head.push("STATE");
    let mut t = Table::new(&head);
    for e in &doc.entries {
        let mut row = vec![
            e.client.clone(),
            e.service.clone().unwrap_or_else(|| "-".into()),
            e.backend
                .clone()
                .unwrap_or_else(|| format!("? ({})", e.backend_id)),
            format_age((e.idle_seconds * 1e9) as u64),
            e.timeout_seconds
                .map_or_else(|| "-".into(), |t| format!("{t}s")),
        ];
        if wide {
            row.push(e.service_id.to_string());
            row.push(e.backend_id.to_string());
            row.push(e.slot.to_string());
        }
        row.push(if e.expired { "expired" } else { "held" }.into());
        t.row(row);
    }
    t.render("")
}
