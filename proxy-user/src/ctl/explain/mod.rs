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
    iptables::{self, Rules},
    schema::SCHEMA,
    services::{self, ServiceView},
    snapshot::{Kind, Snapshot},
    table::Table,
};
use crate::model::{Frontend, Proto};

mod flow;
mod paths;
mod render;

pub use flow::FlowChoiceView;

use paths::{pod_tc_path, service_port, socket_path, tc_path, xdp_path};
pub use render::render;

/// A destination to explain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Query {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Proto,
    /// The query was a v4-mapped IPv6 address (`[::ffff:a.b.c.d]:p`), looked up as IPv4
    /// like the datapath does.
    pub mapped: bool,
    /// `--from CLIENT:PORT`: explain one flow from this client (its conntrack entry, the
    /// backend a new flow would get at TC/XDP).
    pub from: Option<SocketAddr>,
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
        from: None,
    })
}

/// Parses `--from CLIENT:PORT` (`[v6]:PORT`): a client address and source port.
pub fn parse_client(s: &str) -> Result<SocketAddr, String> {
    let sa: SocketAddr = s.parse().map_err(|_| {
        format!("{s:?}: expected CLIENT:PORT, e.g. 198.51.100.7:40000 or [2001:db8::7]:40000")
    })?;
    if sa.port() == 0 {
        return Err(format!("{s:?}: a flow's source port is never 0"));
    }
    Ok(match sa.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), sa.port()),
            None => sa,
        },
        IpAddr::V4(_) => sa,
    })
}

impl Query {
    /// The query with `--from`: refused when the client's family is not the
    /// destination's (no packet carries both).
    pub fn with_from(self, from: Option<SocketAddr>) -> Result<Self, String> {
        if let Some(f) = from {
            if f.is_ipv4() != self.addr.is_ipv4() {
                return Err(format!(
                    "--from {f}: an {} client cannot send to {} (an {} destination)",
                    if f.is_ipv4() { "IPv4" } else { "IPv6" },
                    self.destination(),
                    if self.addr.is_ipv4() { "IPv4" } else { "IPv6" },
                ));
            }
        }
        Ok(Self { from, ..self })
    }
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
    /// `--from`: the backend of that one flow from outside (null without `--from`, or
    /// when nothing matched).
    pub flow: Option<FlowChoiceView>,
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

/// Explains `q` from what the snapshot holds (pure; see `Maps::snapshot_for` for the
/// lookups that fill a snapshot for one query): which frontend matches, the paths that
/// serve it, notes on its flags, kube-proxy's rules for it and, with `--from`, the flow.
pub fn explain(s: &Snapshot, q: &Query) -> ExplainDoc {
    let node_address = s.node_addrs.as_ref().map(|a| a.contains(&q.addr));
    let mut notes = Vec::new();
    if q.mapped {
        notes.push(format!(
            "::ffff:{} is a v4-mapped address: a dual-stack socket connecting to it goes \
             through the v6 hooks, which look it up in the v4 maps",
            q.addr
        ));
    }
    // The NodePort on this port (the destination may be a node address).
    let node_port = if q.addr == q.any_addr() {
        None
    } else {
        services::view(s, &q.frontend(q.any_addr(), scope::ALL))
    };
    let Some(Matched {
        primary,
        twin,
        via_node_port,
    }) = match_frontend(s, q, node_address, node_port.as_ref(), &mut notes)
    else {
        return unmatched(s, q, node_address, node_port, notes);
    };
    let (paths, tc_view) = serving_paths(s, q, &primary, twin.as_ref(), via_node_port, &mut notes);
    flag_notes(&primary, twin.as_ref(), &mut notes);
    let iptables = service_port(&primary, twin.as_ref(), s).map(|sp| iptables::rules(&sp));
    if iptables.is_none() {
        notes.push(
            "the frontend has no Service name in REVNAT, so kube-proxy's chain names \
             (hashes of namespace/name:port) cannot be computed"
                .into(),
        );
    }
    let flow = s.flow.as_ref().filter(|_| q.from.is_some()).map(|f| {
        let path = paths
            .iter()
            .find(|p| p.path == "tc" || p.path == "xdp")
            .map_or("tc", |p| p.path);
        flow::choice(s, f, tc_view, path, q)
    });
    let kind = primary.kind;
    let service = primary.service.clone();
    let mut frontends = vec![primary];
    frontends.extend(twin);
    ExplainDoc {
        schema: SCHEMA,
        query: query_view(q),
        matched: true,
        service,
        kind: Some(kind),
        node_address,
        via_node_port,
        paths,
        frontends,
        iptables,
        flow,
        notes,
    }
}

/// The frontend a destination hits, with its ext-local twin.
struct Matched {
    primary: ServiceView,
    twin: Option<ServiceView>,
    /// Found as a NodePort through a node address.
    via_node_port: bool,
}

/// Which entry the destination hits: the datapaths' one rule
/// (`proxy_common::lookup::frontend`), over the snapshot; `None`: no entry.
fn match_frontend(
    s: &Snapshot,
    q: &Query,
    node_address: Option<bool>,
    node_port: Option<&ServiceView>,
    notes: &mut Vec<String>,
) -> Option<Matched> {
    let exact_twin = services::view(s, &q.frontend(q.addr, scope::EXTERNAL_LOCAL));
    let any = q.any_addr();
    let node_port_twin = services::view(s, &q.frontend(any, scope::EXTERNAL_LOCAL));
    let hit = proxy_common::lookup::frontend(
        q.addr,
        any,
        |a| services::view(s, &q.frontend(a, scope::ALL)),
        |_| node_address == Some(true),
    );
    match hit {
        Some((e, key)) if key == q.addr => {
            if let Some(np) = node_port.filter(|_| node_address == Some(true)) {
                notes.push(format!(
                    "{} is also a node address and port {}/{} a NodePort ({}); the exact \
                     frontend above is the one looked up first",
                    q.addr,
                    q.port,
                    q.proto,
                    np.service.as_deref().unwrap_or("no name")
                ));
            }
            Some(Matched {
                primary: e,
                twin: exact_twin,
                via_node_port: false,
            })
        }
        Some((np, _)) => Some(Matched {
            primary: np,
            twin: node_port_twin,
            via_node_port: true,
        }),
        None => None,
    }
}

/// The paths that serve the destination (socket hooks, TC or XDP), and the frontend the
/// packet path uses (`None`: it drops), for `--from`.
fn serving_paths<'a>(
    s: &Snapshot,
    q: &Query,
    primary: &'a ServiceView,
    twin: Option<&'a ServiceView>,
    via_node_port: bool,
    notes: &mut Vec<String>,
) -> (Vec<PathView>, Option<&'a ServiceView>) {
    // A v4-mapped destination goes through the v6 hooks (which use the v4 maps).
    let family = if q.addr.is_ipv4() && !q.mapped {
        "4"
    } else {
        "6"
    };
    let kind = primary.kind;
    let mut paths = Vec::new();
    let mut tc_view = Some(primary);
    let from_pods = kind != Kind::NodePort || via_node_port;
    if from_pods {
        if let Some(p) = socket_path(
            primary,
            family,
            SocketAddr::new(q.addr, q.port),
            s.socket_lb,
        ) {
            paths.push(p);
        }
    }
    if kind.is_external() {
        let etp_local = primary.flags_raw & svc_flags::ETP_LOCAL != 0;
        tc_view = match (twin, etp_local) {
            (Some(t), true) => Some(t),
            (None, true) => None,
            _ => Some(primary),
        };
        paths.push(external_tc_path(primary, twin, etp_local, notes));
        if kind == Kind::NodePort {
            notes.push(format!(
                "a NodePort frontend has address {}: TC and the socket hooks match it on \
                 every node address (NODE_ADDRS{}) after the exact address missed",
                q.any_addr(),
                if q.addr.is_ipv4() { "4" } else { "6" }
            ));
        }
    } else {
        paths.push(tc_path(
            primary,
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
    // Pods' traffic the socket hooks leave alone (`--socket-lb` other than `all`, or pods
    // bypassed by label): TC on their host-side veths (`--pod-interfaces`), never XDP
    // (added after the mapping above).
    if from_pods && (s.socket_lb != proxy_common::socket_lb::ALL || s.socket_lb_bypassed > 0) {
        paths.push(pod_tc_path(primary, s, primary.protocol));
    }
    (paths, tc_view)
}

/// The TC path of an external destination: through the ext-local twin under
/// `externalTrafficPolicy: Local`, dropped when that twin is missing.
fn external_tc_path(
    primary: &ServiceView,
    twin: Option<&ServiceView>,
    etp_local: bool,
    notes: &mut Vec<String>,
) -> PathView {
    let from_outside = "packets arriving from outside the node (TC on the node's interfaces)";
    match (twin, etp_local) {
        (Some(t), true) => tc_path(t, true, from_outside),
        (None, true) => {
            notes.push(format!(
                "{} has the etp-local flag but no ext-local twin entry: TC drops external \
                 traffic to it (tc_no_local_backend)",
                primary.frontend
            ));
            let mut p = tc_path(primary, true, from_outside);
            p.outcome = "dropped";
            p.detail = "externalTrafficPolicy Local without a local-only twin: dropped".into();
            p.backends.clear();
            p
        }
        _ => tc_path(primary, false, from_outside),
    }
}

/// Notes on the frontend's flags (session affinity, Maglev, source ranges) and the
/// problems found in it and its twin.
fn flag_notes(primary: &ServiceView, twin: Option<&ServiceView>, notes: &mut Vec<String>) {
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
             every node with the same --maglev-table-size, --maglev-seed and --maglev-fill; the socket \
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
    for v in std::iter::once(primary).chain(twin) {
        for p in &v.problems {
            notes.push(format!("{}: {p}", v.frontend));
        }
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
        schema: SCHEMA,
        query: query_view(q),
        matched: false,
        service: None,
        kind: None,
        node_address,
        via_node_port: false,
        paths: Vec::new(),
        frontends: Vec::new(),
        iptables: None,
        flow: None,
        notes,
    }
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
