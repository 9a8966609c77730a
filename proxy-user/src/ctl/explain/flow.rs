//! `proxyctl explain --from CLIENT:PORT`: the backend of one flow from outside the node, as
//! the packet path (TC, or XDP ahead of it) decides it. A tracked flow keeps the backend
//! of its conntrack entry; a new flow to a Maglev frontend gets the slot the frontend's
//! table gives the hash of its 5-tuple (`proxy_common::maglev::flow_hash`, the datapath's
//! own function, so the answer is the datapath's, on every node with the same table
//! size and seed); any other new flow gets one backend at random with equal weight.

use std::net::IpAddr;

use proxy_common::svc_flags;
use serde::Serialize;

use super::{paths, Query, ServiceView, Snapshot};
use crate::{
    ctl::{
        conntrack,
        services::SlotView,
        snapshot::{CtEntry, FlowFacts},
    },
    model::{v4_word, v6_words},
};

/// The `flow` object of `explain --from`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FlowChoiceView {
    /// The client, `address:port`.
    pub client: String,
    /// The path that chooses the flow's backend: `tc` or `xdp`.
    pub path: &'static str,
    /// `conntrack` (a tracked flow keeps its backend), `maglev` (a new flow: the Maglev
    /// table's slot for its hash), `random` (a new flow: equal weight) or `none` (not
    /// translated: rejected or dropped).
    pub by: &'static str,
    /// The backend the flow goes to (null for `random` and `none`).
    pub backend_id: Option<u32>,
    pub endpoint: Option<String>,
    pub slot: Option<u16>,
    /// Maglev: the flow's hash and its index in the table.
    pub hash: Option<u32>,
    pub table_index: Option<u32>,
    pub detail: String,
}

fn words(a: IpAddr) -> [u32; 4] {
    match a {
        IpAddr::V4(v) => [v4_word(v), 0, 0, 0],
        IpAddr::V6(v) => v6_words(v),
    }
}

/// The flow's backend. `view`: the frontend the packet path uses for traffic from
/// outside (the ext-local twin under eTP=Local), `None` when that traffic is dropped.
// Long: the backend choice explained in the order the datapath makes it (affinity, Maglev,
// random, twin), one paragraph each.
pub(super) fn choice(
    s: &Snapshot,
    f: &FlowFacts,
    view: Option<&ServiceView>,
    path: &'static str,
    q: &Query,
) -> FlowChoiceView {
    let mut out = FlowChoiceView {
        client: f.from.to_string(),
        path,
        by: "none",
        backend_id: None,
        endpoint: None,
        slot: None,
        hash: None,
        table_index: None,
        detail: String::new(),
    };
    let mut notes = Vec::new();
    if let Some(e) = &f.tracked {
        match tracked(s, e) {
            Ok(detail) => {
                out.by = "conntrack";
                out.backend_id = Some(e.backend_id);
                out.endpoint = e.dnat.map(|a| a.to_string());
                out.slot = view.and_then(|v| {
                    v.backends
                        .iter()
                        .find(|b| b.backend_id == e.backend_id)
                        .map(|b| b.slot)
                });
                out.detail = detail;
                return out;
            }
            Err(why) => notes.push(why),
        }
    }
    let Some(v) = view.filter(|v| v.backend_count > 0) else {
        out.detail = match view {
            Some(v) if paths::outcome(v) == "rejected" => {
                "no usable endpoint: the packet is rejected (TCP RST, ICMP port unreachable)".into()
            }
            _ => "no endpoint on this node under externalTrafficPolicy Local: dropped".into(),
        };
        return finish(out, notes);
    };
    let n = v.backend_count;
    if v.flags_raw & svc_flags::MAGLEV != 0 {
        match f.maglev.get(&v.service_id).filter(|t| !t.is_empty()) {
            Some(table) => {
                let hash = proxy_common::maglev::flow_hash(
                    words(f.from.ip()),
                    words(q.addr),
                    f.from.port().to_be(),
                    q.port.to_be(),
                    q.proto.number(),
                );
                let index = crate::maglev::index(hash, table.len() as u32);
                let slot = table[index];
                out.hash = Some(hash);
                out.table_index = Some(index as u32);
                match v.backends.iter().find(|b| b.slot == slot && slot <= n) {
                    Some(b) => {
                        maglev_pick(&mut out, b, table.len());
                        return finish(out, notes);
                    }
                    None => notes.push(format!(
                        "the Maglev table's entry {index} names slot {slot}, which the \
                         frontend does not have: the datapath falls back to random"
                    )),
                }
            }
            None => notes.push(
                "no usable Maglev table for this frontend in MAGLEV (missing, or being \
                 replaced): the datapath falls back to random"
                    .into(),
            ),
        }
    }
    out.by = "random";
    out.detail = format!(
        "a new flow gets {}: nothing about the client decides it (1/{n} each)",
        paths::which_backend(n)
    );
    if v.flags_raw & svc_flags::AFFINITY != 0 {
        notes.push(
            "sessionAffinity ClientIP: while this client's address has an AFFINITY entry \
             (proxyctl affinity), it goes back to that backend"
                .into(),
        );
    }
    finish(out, notes)
}

fn maglev_pick(out: &mut FlowChoiceView, b: &SlotView, m: usize) {
    out.by = "maglev";
    out.backend_id = Some(b.backend_id);
    out.endpoint = b.endpoint.clone();
    out.slot = Some(b.slot);
    out.detail = format!(
        "a new flow gets the backend of slot {} ({}): entry {} of the frontend's Maglev \
         table (M = {m}) for the flow's hash {:#010x}, the same on every node with the same \
         --maglev-table-size, --maglev-seed and --maglev-fill; conntrack then keeps it",
        b.slot,
        b.endpoint.as_deref().unwrap_or("?"),
        out.table_index.unwrap_or(0),
        out.hash.unwrap_or(0),
    );
}

fn finish(mut out: FlowChoiceView, notes: Vec<String>) -> FlowChoiceView {
    for n in notes {
        out.detail.push_str("; ");
        out.detail.push_str(&n);
    }
    out
}

/// A tracked flow's entry, if the packet path still follows it (`Err`: why not).
fn tracked(s: &Snapshot, e: &CtEntry) -> Result<String, String> {
    let age = s.now_ns.saturating_sub(e.last_seen_ns);
    let timeout = conntrack::timeout_ns(e);
    if age > timeout {
        return Err(format!(
            "its conntrack entry expired ({}s idle, timeout {}s): the next packet is a new flow",
            age / 1_000_000_000,
            timeout / 1_000_000_000
        ));
    }
    // The datapath's own check (UDP): the entry's backend id still names its backend.
    let live =
        e.dnat.is_some() && s.services.backends.get(&e.backend_id).map(|(b, _)| b.addr) == e.dnat;
    if e.proto == proxy_common::proto::UDP && !live {
        return Err(format!(
            "its conntrack entry names backend {}, which is gone from BACKEND{}: the next \
             datagram is balanced afresh (tc_stale_backend)",
            e.backend_id,
            if e.src.is_ipv4() { "4" } else { "6" }
        ));
    }
    let mut d = format!(
        "tracked in CT{} ({} packets, last {}s ago, idle timeout {}s): its packets keep \
         backend {}",
        if e.src.is_ipv4() { "4" } else { "6" },
        e.packets,
        age / 1_000_000_000,
        timeout / 1_000_000_000,
        e.dnat
            .map_or_else(|| e.backend_id.to_string(), |a| a.to_string()),
    );
    if !live {
        d.push_str(" (gone from the backend maps: a TCP flow keeps it while the endpoint drains)");
    }
    Ok(d)
}
