//! What `proxyctl` read from the maps, as plain data: every view (services, backends,
//! conntrack, stats, explain) is a pure function of a [`Snapshot`], so it is unit-tested
//! without a kernel. `ctl::maps` fills one from the pinned maps.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, SocketAddr},
};

use proxy_common::{backend_flags, ct_flags, scope, svc_flags, Reason};

use crate::{
    model::{Backend, Frontend, Proto},
    store::{Dump, FrontendValue},
};

/// The maps' contents at one moment (not atomic across maps: a dump taken while the agent
/// writes may show a slot the count does not reach yet; views report such gaps).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// `SVC4/6`, `BACKEND4/6`, `REVNAT4/6`, in the writer's own model.
    pub services: Dump,
    /// `BACKEND_CONNS` summed over CPUs: backend id -> connections (selections).
    pub conns: BTreeMap<u32, u64>,
    /// `STATS` summed over CPUs, in `Reason` order.
    pub stats: Vec<(Reason, u64)>,
    /// `XDP_STATS` summed over CPUs, in `Reason` order (empty when not pinned).
    pub xdp_stats: Vec<(Reason, u64)>,
    /// `META[ACCELERATION]`: the XDP mode the agent installed (`proxy_common::acceleration`).
    pub acceleration: u32,
    /// `SOCK_LB[MODE]`: which sockets the socket hooks translate (`proxy_common::socket_lb`;
    /// `ALL` when not pinned).
    pub socket_lb: u64,
    /// Pod cgroups in `SOCK_LB_BYPASS` (per-pod bypass, `--socket-lb-bypass-selector`).
    pub socket_lb_bypassed: usize,
    /// `NODE_ADDRS4/6`; `None` when those maps are not pinned.
    pub node_addrs: Option<BTreeSet<IpAddr>>,
    /// `SRC_RANGE4/6`: service id -> allowed source prefixes.
    pub src_ranges: BTreeMap<u32, Vec<Cidr>>,
    /// `CT4/6` entries; `None` when those maps are not pinned.
    pub flows: Option<Vec<CtEntry>>,
    /// `AFFINITY` entries; `None` when the map is not pinned.
    pub affinity: Option<Vec<AffinityEntry>>,
    /// What `explain --from` looked up for one flow; `None` without `--from`.
    pub flow: Option<FlowFacts>,
    /// `CLOCK_MONOTONIC` when the snapshot was taken (the clock of `bpf_ktime_get_ns`).
    pub now_ns: u64,
    /// Optional maps that are not pinned (a datapath without the TC part).
    pub missing_maps: BTreeSet<&'static str>,
    /// Entries that could not be decoded (an unknown protocol number, say), skipped.
    pub warnings: Vec<String>,
}

/// The map entries one flow's backend depends on (`proxyctl explain --from`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowFacts {
    /// The client: the source address and port of the flow's packets.
    pub from: SocketAddr,
    /// The flow's original-direction `CT4/6` entry (client -> the destination asked
    /// about), if the flow is tracked.
    pub tracked: Option<CtEntry>,
    /// `MAGLEV` tables of the frontends loaded that have `svc_flags::MAGLEV`, by service
    /// id: the whole table (`table_size` slots). A table with a missing chunk, or chunks
    /// of two sizes, is left out (the datapath then falls back to random).
    pub maglev: BTreeMap<u32, Vec<u16>>,
}

/// An address prefix (`loadBalancerSourceRanges`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// Who an `AFFINITY` entry is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum AffinityClient {
    /// A network namespace (socket hooks), by its cookie.
    Netns(u64),
    /// A source address (TC).
    Addr(IpAddr),
}

/// One `AFFINITY` entry: a client's backend for one service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffinityEntry {
    pub client: AffinityClient,
    pub service_id: u32,
    pub backend_id: u32,
    pub slot: u16,
    pub last_used_ns: u64,
}

/// One `CT4/CT6` entry: one direction of a TC-translated flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtEntry {
    pub proto: u8,
    /// 0: original (client -> frontend), 1: reply.
    pub dir: u8,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// New destination for packets of this direction (`dnat_addr`), if any.
    pub dnat: Option<SocketAddr>,
    /// New source for packets of this direction (`snat_addr`), if any.
    pub snat: Option<SocketAddr>,
    pub service_id: u32,
    pub backend_id: u32,
    /// `proxy_common::ct_flags`.
    pub flags: u32,
    pub last_seen_ns: u64,
    pub packets: u64,
}

impl CtEntry {
    /// The key of the other direction's entry, as the datapath writes it: the reply comes
    /// from the new destination and goes to the new source.
    pub fn reply_key(&self) -> (u8, SocketAddr, SocketAddr) {
        (
            self.proto,
            self.dnat.unwrap_or(self.dst),
            self.snat.unwrap_or(self.src),
        )
    }
}

/// What a frontend is, from its flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    ClusterIP,
    NodePort,
    ExternalIP,
    LoadBalancer,
}

impl Kind {
    /// The kind named by `svc_flags` (no kind bit: a cluster IP).
    pub fn of(flags: u16) -> Self {
        if flags & svc_flags::NODE_PORT != 0 {
            Kind::NodePort
        } else if flags & svc_flags::LOAD_BALANCER != 0 {
            Kind::LoadBalancer
        } else if flags & svc_flags::EXTERNAL_IP != 0 {
            Kind::ExternalIP
        } else {
            Kind::ClusterIP
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::ClusterIP => "ClusterIP",
            Kind::NodePort => "NodePort",
            Kind::ExternalIP => "ExternalIP",
            Kind::LoadBalancer => "LoadBalancer",
        }
    }

    /// Traffic to this kind of address arrives from outside the node (TC path).
    pub fn is_external(self) -> bool {
        self != Kind::ClusterIP
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `Svc*Key::scope` as a word.
pub fn scope_name(s: u8) -> String {
    match s {
        scope::ALL => "all".into(),
        scope::EXTERNAL_LOCAL => "ext-local".into(),
        other => format!("scope-{other}"),
    }
}

/// Every set frontend flag as a stable word (JSON `flags`); unknown bits as `bitN`.
pub fn svc_flag_names(flags: u16) -> Vec<String> {
    const NAMES: [(u16, &str); 8] = [
        (svc_flags::AFFINITY, "affinity"),
        (svc_flags::LOCAL_ONLY, "local-only"),
        (svc_flags::NODE_PORT, "node-port"),
        (svc_flags::EXTERNAL_IP, "external-ip"),
        (svc_flags::LOAD_BALANCER, "load-balancer"),
        (svc_flags::ETP_LOCAL, "etp-local"),
        (svc_flags::SOURCE_RANGES, "source-ranges"),
        // External flows at TC choose by Maglev (else random).
        (svc_flags::MAGLEV, "maglev"),
    ];
    (0..16)
        .map(|bit| 1u16 << bit)
        .filter(|b| flags & b != 0)
        .map(|b| match NAMES.iter().find(|(v, _)| *v == b) {
            Some((_, n)) => (*n).to_string(),
            None => format!("bit{}", b.trailing_zeros()),
        })
        .collect()
}

/// Every set conntrack flag as a word (the backend generation in bits 8..31 is not a
/// flag: see [`ct_backend_gen`]).
pub fn ct_flag_names(flags: u32) -> Vec<String> {
    const NAMES: [(u32, &str); 4] = [
        (ct_flags::SNAT, "snat"),
        (ct_flags::CLOSING, "closing"),
        (ct_flags::SEEN_REPLY, "seen-reply"),
        (ct_flags::DSR, "dsr"),
    ];
    (0..ct_flags::GEN_SHIFT)
        .map(|bit| 1u32 << bit)
        .filter(|b| flags & b != 0)
        .map(|b| match NAMES.iter().find(|(v, _)| *v == b) {
            Some((_, n)) => (*n).to_string(),
            None => format!("bit{}", b.trailing_zeros()),
        })
        .collect()
}

/// The `BACKEND_GEN` generation at which the packet path last found a UDP flow's backend
/// (0: not checked yet).
pub fn ct_backend_gen(flags: u32) -> u32 {
    flags >> ct_flags::GEN_SHIFT
}

/// `ready` or `terminating`, from `backend_flags`.
pub fn backend_state(flags: u8) -> &'static str {
    if flags & backend_flags::TERMINATING != 0 {
        "terminating"
    } else {
        "ready"
    }
}

/// The endpoint runs on this node.
pub fn backend_is_local(flags: u8) -> bool {
    flags & backend_flags::LOCAL != 0
}

impl Snapshot {
    /// Slot 0 of `fe`.
    pub fn frontend(&self, fe: &Frontend) -> Option<&FrontendValue> {
        self.services.frontends.get(fe)
    }

    /// The backend id in slot `slot` (>= 1) of `fe`.
    pub fn slot(&self, fe: &Frontend, slot: u16) -> Option<u32> {
        self.services.slots.get(&(*fe, slot)).copied()
    }

    /// A backend and its protocol.
    pub fn backend(&self, id: u32) -> Option<&(Backend, Proto)> {
        self.services.backends.get(&id)
    }

    /// The Service name stored with a service id (`namespace/name:port`), if any.
    pub fn service_name(&self, service_id: u32) -> Option<&str> {
        self.services
            .revnat
            .get(&service_id)
            .map(|(_, n)| n.as_str())
            .filter(|n| !n.is_empty())
    }

    /// Connections counted for a backend id.
    pub fn conns_of(&self, id: u32) -> u64 {
        self.conns.get(&id).copied().unwrap_or(0)
    }

    /// For every backend id, the frontends with a live slot (`1..=count`) naming it, in
    /// one pass over the slots.
    pub fn backend_users(&self) -> BTreeMap<u32, Vec<Frontend>> {
        let mut out: BTreeMap<u32, Vec<Frontend>> = BTreeMap::new();
        for ((fe, slot), id) in &self.services.slots {
            let live = self
                .frontend(fe)
                .is_some_and(|v| *slot >= 1 && *slot <= v.count);
            if live {
                let users = out.entry(*id).or_default();
                if users.last() != Some(fe) {
                    users.push(*fe);
                }
            }
        }
        out
    }

    /// The value of one outcome counter.
    pub fn counter(&self, reason: Reason) -> u64 {
        self.stats
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, v)| *v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_names_include_the_lb_algorithm() {
        assert_eq!(
            svc_flag_names(svc_flags::NODE_PORT | svc_flags::MAGLEV),
            ["node-port", "maglev"]
        );
        assert_eq!(svc_flag_names(1 << 15), ["bit15"]);
    }
}
