//! `proxyctl explain ADDRESS:PORT[/PROTO]`: how the datapath handles traffic to one
//! destination. Which frontend matches (the exact address, or a NodePort on address 0
//! when ADDRESS is one of the node's addresses in `NODE_ADDRS4/6`, and the ext-local twin
//! used for external traffic under `externalTrafficPolicy: Local`), which path serves
//! which traffic (socket hooks at connect()/sendmsg() for pods and processes on the node;
//! TC on the node's interfaces for packets to NodePorts, external IPs and load-balancer
//! IPs arriving from outside), the backends with the chance of each, and next to it the
//! iptables rules kube-proxy would have written for the same Service port.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use proxy_common::{scope, svc_flags};
use serde::Serialize;

use super::{
    iptables::{self, Rules, ServicePort},
    services::{self, ServiceView},
    snapshot::{Kind, Snapshot},
    table::Table,
};
use crate::model::{Frontend, Proto};

/// A destination to explain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Query {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Proto,
    /// The query was a v4-mapped IPv6 address (`[::ffff:a.b.c.d]:p`), looked up as IPv4
    /// like the datapath does.
    pub mapped: bool,
}

/// Parses `ADDRESS:PORT[/PROTO]` (`[v6]:PORT[/PROTO]`); the protocol defaults to tcp.
pub fn parse_query(s: &str) -> Result<Query, String> {
    let usage =
        || format!("{s:?}: expected ADDRESS:PORT[/PROTO], e.g. 10.96.0.10:53/udp or [fd00::10]:80");
    let (dest, proto) = match s.rsplit_once('/') {
        Some((d, p)) => (d, p.parse::<Proto>().map_err(|e| format!("{s:?}: {e}"))?),
        None => (s, Proto::Tcp),
    };
    let sa: SocketAddr = dest.parse().map_err(|_| usage())?;
    if sa.port() == 0 {
        return Err(format!("{s:?}: port 0 is never a service port"));
    }
    let (addr, mapped) = match sa.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => (IpAddr::V4(v4), true),
            None => (IpAddr::V6(v6), false),
        },
        v4 => (v4, false),
    };
    Ok(Query {
        addr,
        port: sa.port(),
        proto,
        mapped,
    })
}

impl Query {
    /// `address:port/proto`.
    pub fn destination(&self) -> String {
        format!("{}/{}", SocketAddr::new(self.addr, self.port), self.proto)
    }

    fn frontend(&self, addr: IpAddr, sc: u8) -> Frontend {
        Frontend::new(addr, self.port, self.proto).with_scope(sc)
    }

    fn any_addr(&self) -> IpAddr {
        match self.addr {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        }
    }
}

/// The `explain` JSON document.
#[derive(Debug, Serialize)]
pub struct ExplainDoc {
    pub schema: u32,
    pub query: QueryView,
    /// A frontend matches: traffic to the destination is translated (or refused).
    pub matched: bool,
    /// The Service port's name, when the matching frontend has one.
    pub service: Option<String>,
    pub kind: Option<Kind>,
    /// The address is one of the node's (`NODE_ADDRS4/6`); null if those maps are not
    /// pinned.
    pub node_address: Option<bool>,
    /// The match is a NodePort frontend found through a node address.
    pub via_node_port: bool,
    /// Who sends such traffic, which hook sees it, and what happens.
    pub paths: Vec<PathView>,
    /// The frontends involved, as `proxyctl services` shows them.
    pub frontends: Vec<ServiceView>,
    /// What kube-proxy in iptables mode would have written (null without a Service name,
    /// or when nothing matched).
    pub iptables: Option<Rules>,
    pub notes: Vec<String>,
}

/// The destination asked about.
#[derive(Debug, Serialize)]
pub struct QueryView {
    pub destination: String,
    pub address: IpAddr,
    pub port: u16,
    pub protocol: &'static str,
}

/// One way traffic reaches the destination.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PathView {
    /// `socket` (cgroup connect/sendmsg hooks), `tc` (node interfaces) or `xdp` (node
    /// interfaces under `--acceleration`, ahead of TC).
    pub path: &'static str,
    /// Who sends this traffic.
    pub traffic: String,
    /// The frontend entry this path looks up.
    pub frontend: String,
    /// `translated`, `rejected` (no backend: ECONNREFUSED, kube-proxy's REJECT) or
    /// `dropped` (Local policy without a local backend: EHOSTUNREACH, kube-proxy's DROP).
    pub outcome: &'static str,
    pub detail: String,
    pub backends: Vec<ChoiceView>,
}

/// A backend a path may pick.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ChoiceView {
    pub slot: u16,
    pub backend_id: u32,
    pub endpoint: Option<String>,
    pub state: &'static str,
    pub local: bool,
    /// 1/n: each slot is equally likely.
    pub probability: f64,
    pub connections: u64,
}

fn outcome(v: &ServiceView) -> &'static str {
    if v.backend_count > 0 {
        "translated"
    } else if v.flags_raw & svc_flags::LOCAL_ONLY != 0 {
        "dropped"
    } else {
        "rejected"
    }
}

fn choices(v: &ServiceView) -> Vec<ChoiceView> {
    let n = v.backends.len().max(1) as f64;
    v.backends
        .iter()
        .map(|b| ChoiceView {
            slot: b.slot,
            backend_id: b.backend_id,
            endpoint: b.endpoint.clone(),
            state: b.state,
            local: b.local,
            probability: 1.0 / n,
            connections: b.connections,
        })
        .collect()
}

/// "its only backend" or "one of n backends, picked at random with equal weight".
fn which_backend(n: u16) -> String {
    if n == 1 {
        "its only backend".into()
    } else {
        format!("one of {n} backends, picked at random with equal weight")
    }
}

/// Appended for UDP frontends: what a connected socket sees when its backend leaves.
const UDP_CONNECTED_NOTE: &str = "; a connected UDP socket keeps its backend: when that \
     backend leaves, the agent destroys the socket (counted in \
     ebpf_proxy_stale_udp_sockets_destroyed_total) and the application's next recv() fails \
     with ECONNABORTED (a send() with EDESTADDRREQ): it must reconnect (kube-proxy instead \
     flushes the conntrack entries and the same socket is re-balanced)";

/// `peer`: the address the application asked for (a node address for a NodePort).
fn socket_path(v: &ServiceView, family: &str, peer: SocketAddr) -> PathView {
    let n = v.backend_count;
    let detail = match outcome(v) {
        "translated" => format!(
            "connect{family}/sendmsg{family} rewrite the destination at connect() (TCP, connected UDP) \
             or at each sendmsg() (unconnected UDP) to {}; recvmsg{family}/getpeername{family} \
             show {} as the peer{}",
            which_backend(n),
            peer,
            if v.protocol == "udp" { UDP_CONNECTED_NOTE } else { "" }
        ),
        "dropped" => "endpoints exist, but none on this node (Local traffic policy): \
                      connect()/sendmsg() fail at once with EHOSTUNREACH (kube-proxy: DROP, the \
                      client would time out)"
            .into(),
        _ => "no usable endpoint anywhere (whatever the traffic policy): connect()/sendmsg() \
              fail with ECONNREFUSED (kube-proxy: REJECT)"
            .into(),
    };
    PathView {
        path: "socket",
        traffic: "pods and processes on this node (cgroup socket hooks)".into(),
        frontend: v.frontend.clone(),
        outcome: outcome(v),
        detail,
        backends: choices(v),
    }
}

/// Traffic from outside under `--acceleration`: the XDP program on the node's interfaces
/// runs the TC stages first; what it cannot do it hands to TC.
fn xdp_path(mut p: PathView, accel: u32) -> PathView {
    let mode = if accel == proxy_common::acceleration::NATIVE {
        "native"
    } else {
        "generic"
    };
    p.path = "xdp";
    p.traffic = format!(
        "packets arriving from outside the node (XDP, {mode} mode, on the node's interfaces, \
         ahead of TC)"
    );
    let tail = if p.outcome == "rejected" {
        "; XDP hands these packets to TC untouched, which sends the REJECT answer"
    } else {
        "; IP fragments, ICMP errors and packets XDP cannot forward (no neighbour entry yet) \
         go on to TC untouched, which handles them the same way"
    };
    p.detail.push_str(tail);
    p
}

fn tc_path(v: &ServiceView, local_policy: bool, traffic: &str) -> PathView {
    let n = v.backend_count;
    // An empty ext-local twin drops only with LOCAL_ONLY (endpoints elsewhere); without
    // it there is no endpoint anywhere and TC rejects, as kube-proxy does.
    let outcome = if n > 0 {
        "translated"
    } else if local_policy && v.flags_raw & svc_flags::LOCAL_ONLY != 0 {
        "dropped"
    } else {
        "rejected"
    };
    let detail = match outcome {
        "translated" => {
            let mut d = format!(
                "the first packet of a flow is DNATed to {}, the flow is kept in CT{} (both \
                 directions) so its packets keep that backend, replies are translated back",
                which_backend(n),
                if v.address.is_ipv4() { "4" } else { "6" },
            );
            if local_policy {
                d.push_str("; externalTrafficPolicy Local: this node's backends only, client address kept");
            } else {
                d.push_str("; flows to a backend on another node are source-NATed to the node");
            }
            d
        }
        "dropped" => "endpoints exist, but none on this node (externalTrafficPolicy Local): dropped (kube-proxy: DROP)".into(),
        _ => "no backend: a TCP SYN is answered with RST, a UDP datagram with ICMP port unreachable, other packets are dropped (kube-proxy: REJECT)".into(),
    };
    PathView {
        path: "tc",
        traffic: traffic.into(),
        frontend: v.frontend.clone(),
        outcome,
        detail,
        backends: choices(v),
    }
}

fn endpoints(v: &ServiceView) -> Vec<SocketAddr> {
    v.backends
        .iter()
        .filter_map(|b| Some(SocketAddr::new(b.address?, b.port?)))
        .collect()
}

fn service_port(
    primary: &ServiceView,
    twin: Option<&ServiceView>,
    s: &Snapshot,
) -> Option<ServicePort> {
    let name = primary.service.clone()?;
    let flags = primary.flags_raw;
    let kind = primary.kind;
    let mut sp = ServicePort {
        name,
        proto: primary.protocol.parse().ok()?,
        kind,
        address: primary.address,
        port: primary.port,
        cluster_endpoints: Vec::new(),
        local_endpoints: Vec::new(),
        internal_local: false,
        external_local: false,
        affinity: (flags & svc_flags::AFFINITY != 0).then_some(primary.affinity_timeout_seconds),
        source_ranges: if flags & svc_flags::SOURCE_RANGES != 0 {
            s.src_ranges
                .get(&primary.service_id)
                .cloned()
                .unwrap_or_default()
        } else {
            Vec::new()
        },
    };
    if kind == Kind::ClusterIP {
        if flags & svc_flags::LOCAL_ONLY != 0 {
            sp.internal_local = true;
            sp.local_endpoints = endpoints(primary);
        } else {
            sp.cluster_endpoints = endpoints(primary);
        }
    } else {
        sp.cluster_endpoints = endpoints(primary);
        if flags & svc_flags::ETP_LOCAL != 0 {
            sp.external_local = true;
            sp.local_endpoints = twin.map(endpoints).unwrap_or_default();
        }
    }
    Some(sp)
}

/// Explains `q` from what the snapshot holds (pure; see `Maps::snapshot_for` for the
/// lookups that fill a snapshot for one query).
pub fn explain(s: &Snapshot, q: &Query) -> ExplainDoc {
    let node_address = s.node_addrs.as_ref().map(|a| a.contains(&q.addr));
    let exact_twin = services::view(s, &q.frontend(q.addr, scope::EXTERNAL_LOCAL));
    let any = q.any_addr();
    let node_port = if q.addr == any {
        None
    } else {
        services::view(s, &q.frontend(any, scope::ALL))
    };
    let node_port_twin = services::view(s, &q.frontend(any, scope::EXTERNAL_LOCAL));
    let mut notes = Vec::new();
    if q.mapped {
        notes.push(format!(
            "::ffff:{} is a v4-mapped address: a dual-stack socket connecting to it goes \
             through the v6 hooks, which look it up in the v4 maps",
            q.addr
        ));
    }
    // A v4-mapped destination goes through the v6 hooks (which use the v4 maps).
    let family = if q.addr.is_ipv4() && !q.mapped {
        "4"
    } else {
        "6"
    };
    // Which entry the destination hits: the datapaths' one rule
    // (`proxy_common::lookup::frontend`), over the snapshot.
    let hit = proxy_common::lookup::frontend(
        q.addr,
        any,
        |a| services::view(s, &q.frontend(a, scope::ALL)),
        |_| node_address == Some(true),
    );
    let (primary, twin, via_node_port) = match hit {
        Some((e, key)) if key == q.addr => {
            if let Some(np) = node_port.as_ref().filter(|_| node_address == Some(true)) {
                notes.push(format!(
                    "{} is also a node address and port {}/{} a NodePort ({}); the exact \
                     frontend above is the one looked up first",
                    q.addr,
                    q.port,
                    q.proto,
                    np.service.as_deref().unwrap_or("no name")
                ));
            }
            (e, exact_twin, false)
        }
        Some((np, _)) => (np, node_port_twin, true),
        None => {
            return unmatched(s, q, node_address, node_port, notes);
        }
    };

    let kind = primary.kind;
    let mut paths = Vec::new();
    if kind != Kind::NodePort || via_node_port {
        paths.push(socket_path(
            &primary,
            family,
            SocketAddr::new(q.addr, q.port),
        ));
    }
    if kind.is_external() {
        let etp_local = primary.flags_raw & svc_flags::ETP_LOCAL != 0;
        let from_outside = "packets arriving from outside the node (TC on the node's interfaces)";
        match (&twin, etp_local) {
            (Some(t), true) => paths.push(tc_path(t, true, from_outside)),
            (None, true) => {
                notes.push(format!(
                    "{} has the etp-local flag but no ext-local twin entry: TC drops external \
                     traffic to it (tc_no_local_backend)",
                    primary.frontend
                ));
                let mut p = tc_path(&primary, true, from_outside);
                p.outcome = "dropped";
                p.detail = "externalTrafficPolicy Local without a local-only twin: dropped".into();
                p.backends.clear();
                paths.push(p);
            }
            _ => paths.push(tc_path(&primary, false, from_outside)),
        }
        if kind == Kind::NodePort {
            notes.push(format!(
                "a NodePort frontend has address {any}: TC and the socket hooks match it on \
                 every node address (NODE_ADDRS{}) after the exact address missed",
                if q.addr.is_ipv4() { "4" } else { "6" }
            ));
        }
    } else {
        paths.push(tc_path(
            &primary,
            false,
            "packets routed through this node to the cluster IP (TC on the node's interfaces)",
        ));
    }
    // Under `--acceleration` the packet path starts at XDP (the same stages as TC).
    if s.acceleration != proxy_common::acceleration::OFF {
        paths = paths
            .into_iter()
            .map(|p| {
                if p.path == "tc" {
                    xdp_path(p, s.acceleration)
                } else {
                    p
                }
            })
            .collect();
    }
    if primary.flags_raw & svc_flags::AFFINITY != 0 {
        notes.push(format!(
            "sessionAffinity ClientIP ({}s): a client (its network namespace at the socket \
             hooks, its source address at TC) goes back to the backend it used last while it \
             reconnects within that time (`proxyctl affinity` lists them)",
            primary.affinity_timeout_seconds
        ));
    }
    if primary.flags_raw & svc_flags::MAGLEV != 0 {
        notes.push(
            "lb-algorithm maglev: at TC a new flow from outside gets the backend the \
             frontend's Maglev table (MAGLEV) gives the hash of its 5-tuple, the same on \
             every node with the same --maglev-table-size and --maglev-seed; the socket \
             hooks (pods, the node) stay random"
                .to_string(),
        );
    }
    if primary.flags_raw & svc_flags::SOURCE_RANGES != 0 {
        notes.push(format!(
            "loadBalancerSourceRanges: only sources in {} are accepted from outside",
            if primary.source_ranges.is_empty() {
                "(none found in SRC_RANGE)".to_string()
            } else {
                primary.source_ranges.join(", ")
            }
        ));
    }
    for v in std::iter::once(&primary).chain(twin.as_ref()) {
        for p in &v.problems {
            notes.push(format!("{}: {p}", v.frontend));
        }
    }
    let iptables = service_port(&primary, twin.as_ref(), s).map(|sp| iptables::rules(&sp));
    if iptables.is_none() {
        notes.push(
            "the frontend has no Service name in REVNAT, so kube-proxy's chain names \
             (hashes of namespace/name:port) cannot be computed"
                .into(),
        );
    }
    let mut frontends = vec![primary.clone()];
    frontends.extend(twin);
    ExplainDoc {
        schema: super::SCHEMA,
        query: query_view(q),
        matched: true,
        service: primary.service.clone(),
        kind: Some(kind),
        node_address,
        via_node_port,
        paths,
        frontends,
        iptables,
        notes,
    }
}

fn query_view(q: &Query) -> QueryView {
    QueryView {
        destination: q.destination(),
        address: q.addr,
        port: q.port,
        protocol: q.proto.as_str(),
    }
}

fn unmatched(
    s: &Snapshot,
    q: &Query,
    node_address: Option<bool>,
    node_port: Option<ServiceView>,
    mut notes: Vec<String>,
) -> ExplainDoc {
    if let Some(np) = &node_port {
        let name = np.service.as_deref().unwrap_or("no name");
        match &s.node_addrs {
            None => notes.push(format!(
                "port {}/{} is a NodePort ({name}), but the node's addresses are not pinned \
                 (NODE_ADDRS4/6), so whether {} is one of them is unknown",
                q.port, q.proto, q.addr
            )),
            Some(addrs) => {
                let list: Vec<String> = addrs
                    .iter()
                    .filter(|a| a.is_ipv4() == q.addr.is_ipv4())
                    .map(ToString::to_string)
                    .collect();
                notes.push(format!(
                    "port {}/{} is a NodePort ({name}), but {} is not one of this node's \
                     addresses ({})",
                    q.port,
                    q.proto,
                    q.addr,
                    if list.is_empty() {
                        "none recorded".to_string()
                    } else {
                        list.join(", ")
                    }
                ));
            }
        }
    }
    let same_addr: Vec<String> = s
        .services
        .frontends
        .keys()
        .filter(|fe| fe.addr == q.addr && fe.scope == scope::ALL)
        .map(|fe| {
            let name = s
                .frontend(fe)
                .and_then(|v| s.service_name(v.service_id))
                .unwrap_or("no name");
            format!("{}/{} ({name})", fe.port, fe.proto)
        })
        .collect();
    if !same_addr.is_empty() {
        notes.push(format!(
            "{} is a service address, but only for {}",
            q.addr,
            same_addr.join(", ")
        ));
    }
    ExplainDoc {
        schema: super::SCHEMA,
        query: query_view(q),
        matched: false,
        service: None,
        kind: None,
        node_address,
        via_node_port: false,
        paths: Vec::new(),
        frontends: Vec::new(),
        iptables: None,
        notes,
    }
}

fn fraction(n: usize) -> String {
    if n == 1 {
        "1".into()
    } else {
        format!("1/{n}")
    }
}

/// kube-proxy's rule walk next to ebpf-proxy's lookups, for the path that translates
/// (TC's under a NodePort, the socket hooks' otherwise).
fn comparison(doc: &ExplainDoc) -> String {
    let primary = &doc.frontends[0];
    let translated = |p: &&PathView| p.outcome == "translated";
    let tc_first = primary.kind == Kind::NodePort;
    let Some(p) = doc
        .paths
        .iter()
        .filter(translated)
        .find(|p| !tc_first || p.path == "tc")
        .or_else(|| doc.paths.iter().find(translated))
    else {
        return String::new();
    };
    let n = p.backends.len();
    let walk = if primary.kind == Kind::NodePort {
        "walks all of KUBE-SERVICES (the node-port jump is its last rule), then KUBE-NODEPORTS \
         rule by rule to this port's rule"
    } else {
        "walks KUBE-SERVICES rule by rule to this Service's rule"
    };
    let pick = if n == 1 {
        "then jumps to the only endpoint".to_string()
    } else {
        format!(
            "then the statistic rules in order (1/{n}, then 1/{} of the rest, ..., the last \
             takes what is left): 1/{n} each",
            n - 1
        )
    };
    let fe = |v: &ServiceView| format!("{{{}, {}, {}}}", v.address, v.port, v.protocol);
    let mut lookups = if doc.via_node_port {
        format!(
            "{{{}, {}, {}}} misses, {} is in NODE_ADDRS{}, {} matches",
            doc.query.address,
            doc.query.port,
            doc.query.protocol,
            doc.query.address,
            if doc.query.address.is_ipv4() {
                "4"
            } else {
                "6"
            },
            fe(primary)
        )
    } else {
        format!("one hash lookup of {} (slot 0)", fe(primary))
    };
    if p.frontend != primary.frontend {
        lookups.push_str(", its ext-local twin holds the slots");
    }
    let slot = if n == 1 {
        "slot 1".to_string()
    } else {
        format!("slot = 1 + random % {n}")
    };
    format!(
        "  kube-proxy: every new connection {walk}, {pick}.\n  ebpf-proxy: {lookups}; {slot}; \
         then the slot and the backend: a few hash lookups, whatever the number of services.\n"
    )
}

/// The `table` / `wide` text (`wide` adds service ids and backend ids to the rows).
pub fn render(doc: &ExplainDoc, wide: bool) -> String {
    let mut out = String::new();
    let dest = &doc.query.destination;
    if !doc.matched {
        out.push_str(&format!(
            "{dest}: not a service. No frontend matches, so traffic to it is not translated \
             (the socket hooks count it as no_service and leave it alone).\n"
        ));
        for n in &doc.notes {
            out.push_str(&format!("  note: {n}\n"));
        }
        return out;
    }
    let primary = &doc.frontends[0];
    out.push_str(&format!(
        "{dest}: Service {}, {}",
        doc.service.as_deref().unwrap_or("(no name)"),
        primary.kind
    ));
    if doc.via_node_port {
        out.push_str(&format!(
            " (node port {} on this node's address {})",
            doc.query.port, doc.query.address
        ));
    }
    out.push('\n');
    let mut fes = Table::new(if wide {
        &["FRONTEND", "KIND", "SVC-ID", "BACKENDS", "FLAGS"][..]
    } else {
        &["FRONTEND", "KIND", "BACKENDS", "FLAGS"][..]
    });
    for v in &doc.frontends {
        let mut row = vec![v.frontend.clone(), v.kind.to_string()];
        if wide {
            row.push(v.service_id.to_string());
        }
        row.push(v.backend_count.to_string());
        row.push(services::flags_cell(v));
        fes.row(row);
    }
    out.push_str(&fes.render("  "));

    let mut shown: Vec<&str> = Vec::new();
    for p in &doc.paths {
        out.push_str(&format!(
            "\n{} -> {} via {}: {}\n  {}\n",
            p.traffic.split(" (").next().unwrap_or(&p.traffic),
            p.frontend,
            if p.path == "socket" {
                "the socket hooks"
            } else {
                "TC"
            },
            p.outcome,
            p.detail
        ));
        if p.backends.is_empty() {
            continue;
        }
        if shown.contains(&p.frontend.as_str()) {
            out.push_str("  (the same slots as above)\n");
            continue;
        }
        shown.push(&p.frontend);
        let mut t = Table::new(&["SLOT", "ID", "BACKEND", "STATE", "CHANCE", "CONNS"]);
        let n = p.backends.len();
        for b in &p.backends {
            t.row(vec![
                b.slot.to_string(),
                if b.backend_id == 0 {
                    "-".into()
                } else {
                    b.backend_id.to_string()
                },
                b.endpoint.clone().unwrap_or_else(|| "-".into()),
                if b.local {
                    format!("{},local", b.state)
                } else {
                    b.state.to_string()
                },
                fraction(n),
                b.connections.to_string(),
            ]);
        }
        out.push_str(&t.render("  "));
    }

    if let Some(rules) = &doc.iptables {
        out.push_str(&format!(
            "\nkube-proxy (iptables mode) would have written ({}-save):\n",
            if rules.ipv6 { "ip6tables" } else { "iptables" }
        ));
        out.push_str(&rules.render("  "));
        out.push_str(&comparison(doc));
    }
    if !doc.notes.is_empty() {
        out.push('\n');
        for n in &doc.notes {
            out.push_str(&format!("note: {n}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_parse() {
        let q = parse_query("10.96.0.10:53/udp").expect("v4");
        assert_eq!(
            (q.addr.to_string(), q.port, q.proto),
            ("10.96.0.10".into(), 53, Proto::Udp)
        );
        let q = parse_query("[fd00::10]:80").expect("v6");
        assert_eq!(
            (q.addr.to_string(), q.port, q.proto),
            ("fd00::10".into(), 80, Proto::Tcp)
        );
        let q = parse_query("[::ffff:10.96.0.100]:80/TCP").expect("mapped");
        assert_eq!(q.addr.to_string(), "10.96.0.100");
        assert!(q.mapped);
        assert!(parse_query("10.96.0.10").is_err());
        assert!(parse_query("10.96.0.10:0").is_err());
        assert!(parse_query("10.96.0.10:53/icmp").is_err());
        assert!(parse_query("fd00::10:80").is_err());
    }
}
