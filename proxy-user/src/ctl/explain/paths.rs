//! Which path serves which traffic to a matched Service port (socket hooks, TC, XDP), its
//! backends with the chance of each, and the Service port the frontend belongs to.

use std::net::SocketAddr;

use proxy_common::svc_flags;

use super::{ChoiceView, Kind, PathView, ServiceView, Snapshot};
use crate::ctl::iptables::ServicePort;

pub(super) fn outcome(v: &ServiceView) -> &'static str {
    if v.backend_count > 0 {
        "translated"
    } else if v.flags_raw & svc_flags::LOCAL_ONLY != 0 {
        "dropped"
    } else {
        "rejected"
    }
}

pub(super) fn choices(v: &ServiceView) -> Vec<ChoiceView> {
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
pub(super) fn which_backend(n: u16) -> String {
    if n == 1 {
        "its only backend".into()
    } else {
        format!("one of {n} backends, picked at random with equal weight")
    }
}

/// Appended for UDP frontends: what a connected socket sees when its backend leaves.
pub(super) const UDP_CONNECTED_NOTE: &str =
    "; a connected UDP socket keeps its backend: when that \
     backend leaves, the agent destroys the socket (counted in \
     ebpf_proxy_stale_udp_sockets_destroyed_total) and the application's next recv() fails \
     with ECONNABORTED (a send() with EDESTADDRREQ): it must reconnect (kube-proxy instead \
     flushes the conntrack entries and the same socket is re-balanced)";

/// Who the socket hooks translate for this frontend's protocol under `--socket-lb`
/// (`None`: nobody, `off`).
fn socket_lb_traffic(mode: u64, protocol: &str) -> Option<&'static str> {
    use proxy_common::socket_lb;
    match mode {
        socket_lb::OFF => None,
        socket_lb::TCP if protocol == "tcp" => Some(
            "pods and processes on this node (cgroup socket hooks; --socket-lb tcp: TCP from \
             everyone, UDP only from the host's network namespace)",
        ),
        socket_lb::TCP | socket_lb::HOST_ONLY => Some(
            "processes in the host's network namespace (cgroup socket hooks; pods' sockets \
             are left to the per-packet path on their interface)",
        ),
        _ => Some("pods and processes on this node (cgroup socket hooks)"),
    }
}

/// The per-packet path of pods' traffic the socket hooks leave alone (`--socket-lb` other
/// than `all`): TC on the pods' host-side veths.
pub(super) fn pod_tc_path(v: &ServiceView, s: &Snapshot, protocol: &str) -> PathView {
    use proxy_common::socket_lb;
    let bypassed = format!(
        "sockets of the {} pod(s) in SOCK_LB_BYPASS (--socket-lb-bypass-selector)",
        s.socket_lb_bypassed
    );
    let which = match s.socket_lb {
        socket_lb::TCP if protocol == "tcp" => bypassed,
        socket_lb::ALL => bypassed,
        socket_lb::TCP => format!("pods' UDP (--socket-lb tcp) and {bypassed}"),
        _ => "every pod's socket".to_string(),
    };
    let mut p = tc_path(
        v,
        false,
        &format!(
            "packets pods send that no socket hook translated ({which}): TC on the pods' \
             host-side veths (--pod-interfaces)"
        ),
    );
    if protocol == "udp" && p.outcome == "translated" {
        p.detail.push_str(
            "; the application keeps the frontend as its peer, and a flow whose backend \
             left is balanced afresh on its next datagram (no socket is destroyed)",
        );
    }
    p
}

/// `peer`: the address the application asked for (a node address for a NodePort).
/// `None` when `--socket-lb off`.
pub(super) fn socket_path(
    v: &ServiceView,
    family: &str,
    peer: SocketAddr,
    socket_lb: u64,
) -> Option<PathView> {
    let traffic = socket_lb_traffic(socket_lb, v.protocol)?;
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
    Some(PathView {
        path: "socket",
        traffic: traffic.into(),
        frontend: v.frontend.clone(),
        outcome: outcome(v),
        detail,
        backends: choices(v),
    })
}

/// Traffic from outside under `--acceleration`: the XDP program on the node's interfaces
/// runs the TC stages first; what it cannot do it hands to TC.
pub(super) fn xdp_path(mut p: PathView, accel: u32) -> PathView {
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

pub(super) fn tc_path(v: &ServiceView, local_policy: bool, traffic: &str) -> PathView {
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

pub(super) fn endpoints(v: &ServiceView) -> Vec<SocketAddr> {
    v.backends
        .iter()
        .filter_map(|b| Some(SocketAddr::new(b.address?, b.port?)))
        .collect()
}

pub(super) fn service_port(
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
