//! `proxyctl stats`: every `Reason` counter of `STATS` summed over CPUs, each with what it
//! means, and the connections counted per backend (`BACKEND_CONNS`).

use serde::Serialize;

use proxy_common::Reason;

use super::{schema::SCHEMA, snapshot::Snapshot, table::Table};

/// One line on what a counter counts (every variant, so a new `Reason` must be described
/// here before this compiles).
pub fn meaning(r: Reason) -> &'static str {
    match r {
        Reason::Translated => "destination rewritten from a frontend to one of its backends",
        Reason::NoService => "destination is not a frontend: left alone",
        Reason::NoBackend => {
            "frontend without backends: connect()/sendmsg() failed with ECONNREFUSED"
        }
        Reason::BackendMissing => {
            "slot or backend entry missing (racing delete or writer bug): left alone"
        }
        Reason::UnsupportedProto => "socket protocol other than TCP/UDP: left alone",
        Reason::RevTranslated => {
            "reply source (recvmsg) or peer (getpeername) shown as the frontend again"
        }
        Reason::RevNatMiss => "no reverse-NAT entry for this socket and peer: left alone",
        Reason::RevNatStale => "reverse-NAT entry of a frontend that is gone or reused: deleted",
        Reason::RevNatUpdateFailed => "the socket's reverse-NAT entry could not be written",
        Reason::NoLocalBackend => {
            "Local traffic policy, no endpoint on this node: failed with EHOSTUNREACH"
        }
        Reason::TcNewFlow => {
            "TC: new flow to a frontend, DNATed (SNATed when the backend is remote)"
        }
        Reason::TcFlow => "TC: packet of a known flow, translated from its conntrack entry",
        Reason::TcReply => "TC: reply reverse-translated from its conntrack entry",
        Reason::TcNoBackend => {
            "TC: frontend without endpoints: TCP answered with RST, UDP with ICMP port \
             unreachable, others dropped"
        }
        Reason::TcSourceDenied => "TC: source outside loadBalancerSourceRanges: dropped",
        Reason::TcSnatFailed => "TC: no SNAT address or free SNAT port: dropped",
        Reason::TcNoLocalBackend => {
            "TC: externalTrafficPolicy Local, no endpoint on this node: dropped"
        }
        Reason::TcFibMiss => "TC: no FIB route for a translated packet: handed to the stack",
        Reason::TcIcmpError => {
            "TC: ICMP error about a NATed flow, translated for its backend or client"
        }
        Reason::AffinityHit => "sessionAffinity ClientIP: the client's previous backend again",
        Reason::TcStaleBackend => "TC: UDP flow whose backend is gone: balanced afresh",
        Reason::TcRejectLimited => {
            "TC: ICMP port unreachable over the rate limit (1000/s per CPU): dropped"
        }
        Reason::TcCtWriteFailed => "TC: a new flow's conntrack entries not written: dropped",
        Reason::TcRewriteFailed => "TC: a packet rewrite refused half-way: dropped",
        Reason::XdpToStack => {
            "XDP: left untouched to the stack and TC (fragment, ICMP error, REJECT answer, \
             FIB result XDP cannot forward by)"
        }
        Reason::TcDsrEncap => {
            "TC DSR, first node: sent to a remote backend with the frontend in the DSR \
             option (client address kept, no SNAT)"
        }
        Reason::TcDsrDecap => {
            "TC DSR, backend's node: DSR option read (reply entry recorded) and removed"
        }
        Reason::TcDsrReply => {
            "TC DSR, backend's node: reply sent straight to the client from the frontend"
        }
        Reason::TcDsrTooBig => {
            "TC DSR: the option would exceed the route's MTU: new flow SNATed, later \
             datagram sent without it"
        }
        Reason::TcDsrUntrusted => {
            "TC DSR, backend's node: DSR option from a sender that is not a cluster node: \
             not honoured"
        }
        Reason::SvcPortUnused => {
            "ClusterIP on a port no Service uses: connect()/sendmsg() failed with \
             ECONNREFUSED; TC: REJECT (RST, ICMP port unreachable)"
        }
        Reason::SvcCidrUnallocated => {
            "address in a Service CIDR that no Service has: connect()/sendmsg() failed with \
             EPERM; TC/XDP: dropped"
        }
    }
}

/// The `stats` JSON document.
#[derive(Debug, Serialize)]
pub struct StatsDoc {
    pub schema: u32,
    pub counters: Vec<CounterView>,
    /// The XDP hook's counters (`XDP_STATS`), the same reasons; empty when not pinned.
    pub xdp_counters: Vec<CounterView>,
    /// `off`, `generic` or `native` (`--acceleration`).
    pub acceleration: &'static str,
    pub backends: Vec<BackendConnsView>,
}

/// One outcome counter.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct CounterView {
    pub reason: &'static str,
    pub count: u64,
    pub meaning: &'static str,
}

/// Connections counted for one backend id.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct BackendConnsView {
    pub id: u32,
    /// `address:port`, null when the id has counters but no `BACKEND` entry any more.
    pub endpoint: Option<String>,
    pub connections: u64,
}

/// The counters and per-backend connections of a snapshot.
pub fn build(s: &Snapshot) -> StatsDoc {
    let counters = Reason::ALL
        .iter()
        .map(|r| CounterView {
            reason: r.name(),
            count: s.counter(*r),
            meaning: meaning(*r),
        })
        .collect();
    let mut ids: Vec<u32> = s.conns.keys().copied().collect();
    ids.extend(s.services.backends.keys().copied());
    ids.sort_unstable();
    ids.dedup();
    let backends = ids
        .into_iter()
        .map(|id| BackendConnsView {
            id,
            endpoint: s.backend(id).map(|(b, _)| b.addr.to_string()),
            connections: s.conns_of(id),
        })
        .collect();
    let xdp_counters = s
        .xdp_stats
        .iter()
        .map(|(r, count)| CounterView {
            reason: r.name(),
            count: *count,
            meaning: meaning(*r),
        })
        .collect();
    StatsDoc {
        schema: SCHEMA,
        counters,
        xdp_counters,
        acceleration: match s.acceleration {
            proxy_common::acceleration::NATIVE => "native",
            proxy_common::acceleration::GENERIC => "generic",
            _ => "off",
        },
        backends,
    }
}

/// The `table` / `wide` text (`wide` adds nothing: every column fits).
pub fn render(doc: &StatsDoc) -> String {
    let mut t = Table::new(&["COUNTER", "COUNT", "MEANING"]);
    for c in &doc.counters {
        t.row(vec![c.reason.into(), c.count.to_string(), c.meaning.into()]);
    }
    let mut out = t.render("");
    out.push('\n');
    // The XDP counters when XDP runs or ran (only the non-zero ones: the same reasons).
    if doc.acceleration != "off" || doc.xdp_counters.iter().any(|c| c.count > 0) {
        let mut x = Table::new(&["XDP COUNTER", "COUNT"]);
        for c in doc.xdp_counters.iter().filter(|c| c.count > 0) {
            x.row(vec![c.reason.into(), c.count.to_string()]);
        }
        out.push_str(&format!("acceleration: {}\n", doc.acceleration));
        out.push_str(&x.render(""));
        out.push('\n');
    }
    if doc.backends.is_empty() {
        out.push_str("no backends\n");
        return out;
    }
    let mut b = Table::new(&["BACKEND", "ID", "CONNS"]);
    for v in &doc.backends {
        b.row(vec![
            v.endpoint.clone().unwrap_or_else(|| "(deleted)".into()),
            v.id.to_string(),
            v.connections.to_string(),
        ]);
    }
    out.push_str(&b.render(""));
    out
}
