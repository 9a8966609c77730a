//! The ABI shared by the kernel programs (`proxy-ebpf`) and user space (`proxy-user`).
//!
//! Every type here is a map key or value. Rules (after aya's `integration-common`):
//! `#[repr(C)]`, explicit `_pad` fields so no type has implicit padding, integer flags
//! instead of `bool`, addresses and ports in network byte order exactly as the kernel
//! hands them to a `bpf_sock_addr` program (so no byte swapping happens in the datapath).
//! User-space trait impls (bytemuck, `aya::Pod`) live behind the `user` feature.
//!
//! The maps, each with its key, value and purpose, are listed once, in
//! `docs/ARCHITECTURE.md` ("Maps"); [`map_names::ALL`] names every pinned one, and
//! `proxy-user/tests/docs_agree.rs` checks that the two and `proxy-ebpf/src/maps.rs`
//! agree. The model follows cilium's `lb4_*`/`lb6_*` maps: a frontend's slot 0 holds its
//! backend count and service id, slots `1..=count` name backend ids, backends are shared
//! by id.
#![no_std]

pub mod event;
pub mod lookup;
pub mod maglev;

mod flow;
mod reason;
mod service;

pub use flow::{
    affinity_kind, AffinityKey, AffinityValue, Ct4Key, Ct4Value, Ct6Key, Ct6Value, SockRevNat4,
    SockRevNat4Entry, SockRevNat4V3, SockRevNat4V3Key, SockRevNat6, SockRevNat6Entry,
    SockRevNat6V3, SockRevNat6V3Key,
};
pub use reason::Reason;
pub use service::{
    svc_chunk_of, Backend4, Backend6, MaglevChunk, MaglevKey, RevNat4, RevNat6, SrcRange4,
    SrcRange6, Svc4Key, Svc6Key, SvcEntry, SvcValue, NAME_LEN, SVC_CHUNK_SLOTS,
};

/// Bumped whenever a key, value or map definition changes incompatibly. The loader stores
/// it in the `META` map; pins of an older version are migrated (`proxy-user/src/migrate`).
/// 4: `SOCK_REVNAT4/6` became per-socket storage (`SK_STORAGE`) instead of a node-wide LRU;
/// `BACKEND4/6` arrays; `SVC4/6` entries hold a chunk of 24 backend slots ([`SvcEntry`]).
pub const ABI_VERSION: u32 = 4;

/// Map names, as they appear in the object file, under the pin directory and in bpftool.
pub mod map_names {
    /// Frontends and their backend slots, IPv4.
    pub const SVC4: &str = "SVC4";
    /// Frontends and their backend slots, IPv6.
    pub const SVC6: &str = "SVC6";
    /// Backend id -> IPv4 backend.
    pub const BACKEND4: &str = "BACKEND4";
    /// Backend id -> IPv6 backend.
    pub const BACKEND6: &str = "BACKEND6";
    /// Service id -> IPv4 frontend.
    pub const REVNAT4: &str = "REVNAT4";
    /// Service id -> IPv6 frontend.
    pub const REVNAT6: &str = "REVNAT6";
    /// Per socket: IPv4 backend -> frontend (socket-local storage).
    pub const SOCK_REVNAT4: &str = "SOCK_REVNAT4";
    /// Per socket: IPv6 backend -> frontend (socket-local storage).
    pub const SOCK_REVNAT6: &str = "SOCK_REVNAT6";
    /// ABI 3's node-wide `{socket cookie, IPv4 backend}` -> frontend LRU, kept after an
    /// upgrade from ABI 3 for the sockets it translated (read, moved into the socket's
    /// storage and deleted by `recvmsg`/`getpeername`); a 1-entry empty map otherwise.
    pub const SOCK_REVNAT4_V3: &str = "SOCK_REVNAT4_V3";
    /// ABI 3's `{socket cookie, IPv6 backend}` -> frontend LRU, kept likewise.
    pub const SOCK_REVNAT6_V3: &str = "SOCK_REVNAT6_V3";
    /// Per-CPU outcome counters indexed by `Reason`.
    pub const STATS: &str = "STATS";
    /// Per-CPU selections per backend id.
    pub const BACKEND_CONNS: &str = "BACKEND_CONNS";
    /// `[ABI_VERSION]`, written by the loader.
    pub const META: &str = "META";
    /// TC connection tracking, IPv4 (LRU).
    pub const CT4: &str = "CT4";
    /// TC connection tracking, IPv6 (LRU).
    pub const CT6: &str = "CT6";
    /// The conntrack table a resize replaces, IPv4: looked up on a `CT4` miss by the
    /// programs of a resize until every entry is in the new table; a 1-entry empty map
    /// otherwise.
    pub const CT4_PREV: &str = "CT4_PREV";
    /// The conntrack table a resize replaces, IPv6 (see `CT4_PREV`).
    pub const CT6_PREV: &str = "CT6_PREV";
    /// The node's own IPv4 addresses (NodePort frontends answer on them).
    pub const NODE_ADDRS4: &str = "NODE_ADDRS4";
    /// The node's own IPv6 addresses.
    pub const NODE_ADDRS6: &str = "NODE_ADDRS6";
    /// `[NodeConfig]`: SNAT addresses, written by the agent.
    pub const NODE_CONFIG: &str = "NODE_CONFIG";
    /// `loadBalancerSourceRanges` allow-lists, IPv4 (LPM trie keyed by service id + prefix).
    pub const SRC_RANGE4: &str = "SRC_RANGE4";
    /// `loadBalancerSourceRanges` allow-lists, IPv6.
    pub const SRC_RANGE6: &str = "SRC_RANGE6";
    /// `sessionAffinity: ClientIP`: client + service id -> backend (LRU).
    pub const AFFINITY: &str = "AFFINITY";
    /// Per-CPU outcome counters of the XDP hook, indexed by `Reason` like `STATS`.
    pub const XDP_STATS: &str = "XDP_STATS";
    /// Maglev lookup tables: `{service id, chunk}` -> a chunk of backend slots.
    pub const MAGLEV: &str = "MAGLEV";
    /// `[forwarding mode]` (`fwd_mode`): SNAT or DSR for external traffic to a backend on
    /// another node, written by the agent (`--forwarding-mode`).
    pub const FWD_MODE: &str = "FWD_MODE";
    /// `[generation]`: bumped by the agent after it deletes backends, so the packet path
    /// re-checks a UDP flow's backend only when one may have gone (`ct_flags::GEN_SHIFT`).
    pub const BACKEND_GEN: &str = "BACKEND_GEN";
    /// DSR (`--forwarding-mode dsr|hybrid`): the IPv4 prefixes whose packets' DSR option is
    /// honoured (LPM trie: the cluster's node addresses as /32, `--dsr-trusted-cidrs`).
    pub const DSR_TRUSTED4: &str = "DSR_TRUSTED4";
    /// The IPv6 counterpart of `DSR_TRUSTED4` (/128 per node address).
    pub const DSR_TRUSTED6: &str = "DSR_TRUSTED6";
    /// The IPv4 Service CIDRs (LPM trie, value `svc_cidr::RANGE`) and the ClusterIPs in use
    /// (/32, value `svc_cidr::CLUSTER_IP`): a socket-hook miss inside them is refused.
    pub const SVC_CIDR4: &str = "SVC_CIDR4";
    /// The IPv6 counterpart of `SVC_CIDR4` (/128 per ClusterIP).
    pub const SVC_CIDR6: &str = "SVC_CIDR6";
    /// Datapath events (`proxyctl monitor`): a ring buffer of `event::Event`.
    pub const EVENTS: &str = "EVENTS";
    /// `[event::MonitorCtl]`: the monitor's lease, event types, rate and sampling.
    pub const MONITOR: &str = "MONITOR";
    /// Per CPU `[event::MonitorCpu]`: the events' token bucket and emitted/lost counts.
    pub const MONITOR_CPU: &str = "MONITOR_CPU";

    /// `--metrics-per-service`: `[0]` = 1 while the agent wants the per-Service and
    /// per-backend counters (`SVC_COUNTERS`, `BACKEND_COUNTERS`); 0: the datapath does not
    /// touch them (one branch per packet).
    pub const COUNTERS_ON: &str = "COUNTERS_ON";
    /// Per CPU, service id (one frontend) -> `FlowCounts` (connections, packets).
    pub const SVC_COUNTERS: &str = "SVC_COUNTERS";
    /// Per CPU, backend id -> `FlowCounts` (connections, packets).
    pub const BACKEND_COUNTERS: &str = "BACKEND_COUNTERS";

    /// `--socket-lb`: `[socket_lb::MODE] = mode`, `[socket_lb::HOST_NETNS] = the host's
    /// network namespace cookie` (array of two `u64`).
    pub const SOCK_LB: &str = "SOCK_LB";
    /// cgroup ids whose sockets the socket hooks leave alone (per-pod bypass of socket
    /// LB): their traffic takes the per-packet path on the pod's interface.
    pub const SOCK_LB_BYPASS: &str = "SOCK_LB_BYPASS";

    /// Every pinned map.
    pub const ALL: [&str; 39] = [
        SVC4,
        SVC6,
        BACKEND4,
        BACKEND6,
        REVNAT4,
        REVNAT6,
        SOCK_REVNAT4,
        SOCK_REVNAT6,
        STATS,
        BACKEND_CONNS,
        META,
        CT4,
        CT6,
        CT4_PREV,
        CT6_PREV,
        NODE_ADDRS4,
        NODE_ADDRS6,
        NODE_CONFIG,
        SRC_RANGE4,
        SRC_RANGE6,
        AFFINITY,
        XDP_STATS,
        MAGLEV,
        FWD_MODE,
        BACKEND_GEN,
        SOCK_REVNAT4_V3,
        SOCK_REVNAT6_V3,
        DSR_TRUSTED4,
        DSR_TRUSTED6,
        SVC_CIDR4,
        SVC_CIDR6,
        SOCK_LB,
        SOCK_LB_BYPASS,
        EVENTS,
        MONITOR,
        MONITOR_CPU,
        COUNTERS_ON,
        SVC_COUNTERS,
        BACKEND_COUNTERS,
    ];
}

/// Program names: the function names of the `#[cgroup_sock_addr]`, `#[classifier]` and
/// `#[xdp]` programs in `proxy-ebpf` (a loader test checks the object's programs equal
/// [`prog_names::ALL`]), the names the loader finds them by and the cgroup links' pin names.
pub mod prog_names {
    /// `cgroup/connect4`: IPv4 `connect(2)` to a frontend picks a backend.
    pub const SOCK4_CONNECT: &str = "sock4_connect";
    /// `cgroup/sendmsg4`: unconnected IPv4 UDP `sendmsg(2)` to a frontend.
    pub const SOCK4_SENDMSG: &str = "sock4_sendmsg";
    /// `cgroup/recvmsg4`: the reply's source back to the frontend, IPv4.
    pub const SOCK4_RECVMSG: &str = "sock4_recvmsg";
    /// `cgroup/getpeername4`: `getpeername(2)` reports the frontend, IPv4.
    pub const SOCK4_GETPEER: &str = "sock4_getpeer";
    /// `cgroup/connect6`: IPv6 `connect(2)`.
    pub const SOCK6_CONNECT: &str = "sock6_connect";
    /// `cgroup/sendmsg6`: unconnected IPv6 UDP `sendmsg(2)`.
    pub const SOCK6_SENDMSG: &str = "sock6_sendmsg";
    /// `cgroup/recvmsg6`: the reply's source back to the frontend, IPv6.
    pub const SOCK6_RECVMSG: &str = "sock6_recvmsg";
    /// `cgroup/getpeername6`: `getpeername(2)` reports the frontend, IPv6.
    pub const SOCK6_GETPEER: &str = "sock6_getpeer";
    /// The TC program on an interface's ingress.
    pub const TC_INGRESS: &str = "tc_ingress";
    /// The TC program on an interface's egress.
    pub const TC_EGRESS: &str = "tc_egress";
    /// The XDP program (`--acceleration`).
    pub const XDP_INGRESS: &str = "xdp_ingress";

    /// The cgroup socket hooks, in the order the loader attaches them.
    pub const SOCK: [&str; 8] = [
        SOCK4_CONNECT,
        SOCK4_SENDMSG,
        SOCK4_RECVMSG,
        SOCK4_GETPEER,
        SOCK6_CONNECT,
        SOCK6_SENDMSG,
        SOCK6_RECVMSG,
        SOCK6_GETPEER,
    ];

    /// The TC programs.
    pub const TC: [&str; 2] = [TC_INGRESS, TC_EGRESS];

    /// Every program of the eBPF object.
    pub const ALL: [&str; 11] = [
        SOCK4_CONNECT,
        SOCK4_SENDMSG,
        SOCK4_RECVMSG,
        SOCK4_GETPEER,
        SOCK6_CONNECT,
        SOCK6_SENDMSG,
        SOCK6_RECVMSG,
        SOCK6_GETPEER,
        TC_INGRESS,
        TC_EGRESS,
        XDP_INGRESS,
    ];
}

pub mod limits;

/// Values in `SVC_CIDR4/6`: what a destination that is no frontend falls in (the longest
/// prefix wins, so a ClusterIP marker beats its range).
pub mod svc_cidr {
    /// Inside a Service CIDR, no Service has the address: refused with EPERM (drop).
    pub const RANGE: u8 = 1;
    /// A ClusterIP some Service has, on another port: refused with ECONNREFUSED (reject).
    pub const CLUSTER_IP: u8 = 2;
}

/// TC connection-tracking timeouts (nanoseconds), after kube-proxy's conntrack settings.
pub mod ct_timeouts {
    const S: u64 = 1_000_000_000;
    /// A TCP flow that has seen its handshake's first packet only.
    pub const TCP_SYN: u64 = 60 * S;
    /// An established TCP flow (kube-proxy sets nf_conntrack_tcp_timeout_established
    /// to 24 h).
    pub const TCP_ESTABLISHED: u64 = 24 * 3600 * S;
    /// After a FIN or RST: closing flows go quickly.
    pub const TCP_CLOSING: u64 = 10 * S;
    /// UDP (and other) flows: idle time.
    pub const UDP: u64 = 60 * S;

    /// How long an entry of protocol `proto` with `CtValue::flags` `flags` lives after its
    /// last packet: the one rule the datapath expires entries by and the agent's
    /// occupancy sampling (`ctsize`) counts live ones by.
    #[inline(always)]
    pub fn idle(proto: u8, flags: u32) -> u64 {
        if proto != crate::proto::TCP {
            UDP
        } else if flags & crate::ct_flags::CLOSING != 0 {
            TCP_CLOSING
        } else if flags & crate::ct_flags::SEEN_REPLY != 0 {
            TCP_ESTABLISHED
        } else {
            TCP_SYN
        }
    }
}

/// `CtValue::flags`.
pub mod ct_flags {
    /// This entry belongs to a flow that was source-NATed to the node.
    pub const SNAT: u32 = 1 << 0;
    /// A FIN or RST was seen: the flow times out after `TCP_CLOSING`.
    pub const CLOSING: u32 = 1 << 1;
    /// A packet of the reply direction was seen (TCP: the handshake completed).
    pub const SEEN_REPLY: u32 = 1 << 2;
    /// Direct server return: on the first node, a flow sent to a backend on another node
    /// with the DSR option instead of SNAT; on the backend's node, the reply entry
    /// learnt from that option (the reply leaves with the frontend as source).
    pub const DSR: u32 = 1 << 3;
    /// Bits 8..31 of an original-direction entry: the `BACKEND_GEN` generation at which
    /// the packet path last found the flow's backend still in `BACKEND{4,6}` (UDP only;
    /// 0: never checked). While it equals the map's generation the per-packet backend
    /// lookup is skipped; the agent bumps the generation after deleting backends.
    pub const GEN_SHIFT: u32 = 8;
    /// The generation bits (see [`GEN_SHIFT`]).
    pub const GEN_MASK: u32 = !0 << GEN_SHIFT;
    /// The flag bits proper (everything but the generation).
    pub const FLAGS_MASK: u32 = !GEN_MASK;
}

/// `BACKEND_GEN[0]`: the next generation after `g`, in the 24 bits a conntrack entry
/// keeps (`ct_flags::GEN_SHIFT`), never 0 (0 means "not checked" in an entry).
pub const fn next_backend_gen(g: u32) -> u32 {
    let n = g.wrapping_add(1) & (ct_flags::GEN_MASK >> ct_flags::GEN_SHIFT);
    if n == 0 {
        1
    } else {
        n
    }
}

/// `FWD_MODE[0]`: how the TC path forwards external traffic (eTP=Cluster) to a backend
/// on another node (`--forwarding-mode`).
pub mod fwd_mode {
    /// Source NAT to the node's address: replies come back through this node.
    pub const SNAT: u32 = 0;
    /// Direct server return for TCP and UDP: the backend's node learns the client and the
    /// frontend from an IPv4 option (IPv6: a destination option) and replies straight to
    /// the client.
    pub const DSR: u32 = 1;
    /// DSR for TCP, SNAT for UDP (as Cilium's `hybrid`).
    pub const HYBRID: u32 = 2;
}

/// The DSR option (after Cilium's `dsr_opt_v4`/`dsr_opt_v6`). IPv4: 8 bytes right after
/// the 20-byte header, `[type, length, frontend port (2), frontend address (4)]`, network
/// order.
pub mod dsr_opt {
    /// Option type: the copied bit (so fragments keep it) | number 26, Cilium's value.
    pub const TYPE4: u8 = 0x9a;
    /// Option length in bytes (the IPv4 header grows from 20 to 28: IHL 7).
    pub const LEN4: u8 = 8;
    /// IPv6: the option in a Destination Options header of 24 bytes after the 40-byte
    /// header, `[next header, 2, TYPE6, LEN6, frontend address (16), port (2), 0, 0]`
    /// (Cilium's `dsr_opt_v6`). Type 0x1b: the two high bits 0, "skip if unknown".
    pub const TYPE6: u8 = 0x1b;
    /// Option data length: address, port and 2 bytes of zero.
    pub const LEN6: u8 = 20;
}

/// IP protocol numbers as they appear in `bpf_sock_addr.protocol` and in IP headers.
pub mod proto {
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// SCTP.
    pub const SCTP: u8 = 132;
}

/// Frontend flags (slot 0 of `SvcValue::flags`).
pub mod svc_flags {
    /// `sessionAffinity: ClientIP`: the hooks and TC follow the client's `AFFINITY` entry for
    /// `affinity_timeout` seconds after its last connection.
    pub const AFFINITY: u16 = 1 << 0;
    /// The slots hold only node-local endpoints because of a Local traffic policy
    /// (`internalTrafficPolicy` for a ClusterIP, `externalTrafficPolicy` for the
    /// external scope); zero of them means "drop", not "reject".
    pub const LOCAL_ONLY: u16 = 1 << 1;
    /// A NodePort frontend (address 0: any of the node's addresses).
    pub const NODE_PORT: u16 = 1 << 2;
    /// A `spec.externalIPs` frontend.
    pub const EXTERNAL_IP: u16 = 1 << 3;
    /// A `status.loadBalancer.ingress[].ip` frontend.
    pub const LOAD_BALANCER: u16 = 1 << 4;
    /// `externalTrafficPolicy: Local`: traffic from outside the node uses the
    /// `scope::EXTERNAL_LOCAL` entry of the same frontend (local endpoints, client address
    /// preserved).
    pub const ETP_LOCAL: u16 = 1 << 5;
    /// `loadBalancerSourceRanges`: only sources in `SRC_RANGE4/6` for this service id.
    pub const SOURCE_RANGES: u16 = 1 << 6;
    /// Maglev consistent hashing for new TC flows: the backend slot comes from this
    /// frontend's `MAGLEV` table (by its service id), indexed by a hash of the flow's
    /// 5-tuple, so every node picks the same backend for the same flow. Set only once the
    /// table is written; a missing or inconsistent table falls back to random.
    pub const MAGLEV: u16 = 1 << 7;
}

/// `Svc4Key::scope` / `Svc6Key::scope`.
pub mod scope {
    /// The frontend for every client: cluster-wide (or iTP-local) endpoints.
    pub const ALL: u8 = 0;
    /// For traffic from outside the node to a frontend with `ETP_LOCAL`.
    pub const EXTERNAL_LOCAL: u8 = 1;
}

/// Backend flags.
pub mod backend_flags {
    /// The endpoint is terminating (it is only in a slot as serving fallback).
    pub const TERMINATING: u8 = 1 << 0;
    /// The endpoint runs on this node (TC: no SNAT needed for it).
    pub const LOCAL: u8 = 1 << 1;
}

/// `SVC_COUNTERS` / `BACKEND_COUNTERS` value (per CPU, `--metrics-per-service`): what one
/// frontend (service id) or backend (backend id) was used for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowCounts {
    /// Backend selections: new flows at TC/XDP, `connect()` translations, unconnected UDP
    /// datagrams translated at `sendmsg()` (what `BACKEND_CONNS` counts).
    pub conns: u64,
    /// Packets of the client's direction translated per packet (TC/XDP), the first one
    /// included. Traffic of a socket translated at `connect()` is not seen per packet.
    pub packets: u64,
}

/// `META` indices.
pub mod meta {
    /// The `ABI_VERSION` the pinned maps were created with.
    pub const ABI_VERSION: u32 = 0;
    /// Kernel id of a loaded hook program, so a later agent can read the programs'
    /// aya-log records (`EbpfLogger::init_from_id`).
    pub const LOG_PROGRAM_ID: u32 = 1;
    /// A hash of the eBPF object whose programs run (0: unknown, pins of an older
    /// build): a new build with another hash swaps its programs in (`migrate.rs`).
    pub const OBJECT_HASH: u32 = 2;
    /// The XDP acceleration the agent installed (`acceleration::*`), for `proxyctl`.
    pub const ACCELERATION: u32 = 3;
}

/// `SOCK_LB`: which sockets the socket hooks translate (`--socket-lb`).
pub mod socket_lb {
    /// Index of the mode in `SOCK_LB`.
    pub const MODE: u32 = 0;
    /// Index of the host's network namespace cookie in `SOCK_LB` (0: unknown).
    pub const HOST_NETNS: u32 = 1;
    /// Every socket (also what an empty, new map means).
    pub const ALL: u64 = 0;
    /// TCP everywhere; UDP only in the host's network namespace (pods' UDP goes per
    /// packet on their interface).
    pub const TCP: u64 = 1;
    /// Only sockets in the host's network namespace.
    pub const HOST_ONLY: u64 = 2;
    /// None.
    pub const OFF: u64 = 3;
    /// The key in `SOCK_LB_BYPASS` (no cgroup has id 0) whose value is the set of cgroup
    /// levels (bit `l`: level `l`, 0 the hierarchy's root) at which bypassed pod cgroups
    /// sit: the hooks look each such ancestor of the caller's cgroup up, so a pod's
    /// containers, in child cgroups made after the pod's, are covered as they appear.
    pub const BYPASS_LEVELS: u64 = 0;
    /// The deepest cgroup level [`BYPASS_LEVELS`] can name (its value is a `u8`).
    pub const BYPASS_MAX_LEVEL: u32 = 7;
}

/// `META[ACCELERATION]`: where the node's north-south traffic is handled first.
pub mod acceleration {
    /// No XDP hook: TC handles it (also what pins of an older build read as).
    pub const OFF: u32 = 0;
    /// XDP in generic (skb) mode, ahead of TC.
    pub const GENERIC: u32 = 1;
    /// XDP in the driver (native mode), ahead of TC.
    pub const NATIVE: u32 = 2;
}

/// `NODE_CONFIG[0]`: addresses the TC path source-NATs to (the node's primary address
/// per family; zero: no SNAT possible for that family).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NodeConfig {
    pub snat4: u32,
    pub snat6: [u32; 4],
}

#[cfg(feature = "user")]
mod user {
    use super::{
        event, AffinityKey, AffinityValue, Backend4, Backend6, Ct4Key, Ct4Value, Ct6Key, Ct6Value,
        FlowCounts, MaglevChunk, MaglevKey, NodeConfig, RevNat4, RevNat6, SockRevNat4,
        SockRevNat4Entry, SockRevNat4V3, SockRevNat4V3Key, SockRevNat6, SockRevNat6Entry,
        SockRevNat6V3, SockRevNat6V3Key, SrcRange4, SrcRange6, Svc4Key, Svc6Key, SvcEntry,
        SvcValue,
    };

    macro_rules! pod {
        ($($t:ty),* $(,)?) => {$(
            // SAFETY: #[repr(C)], only integer fields, explicit padding: checked by the
            // layout tests below (size == sum of field sizes).
            unsafe impl bytemuck::Zeroable for $t {}
            unsafe impl bytemuck::Pod for $t {}
            unsafe impl aya::Pod for $t {}
        )*};
    }

    pod!(
        Svc4Key,
        Svc6Key,
        SvcValue,
        SvcEntry,
        Backend4,
        Backend6,
        RevNat4,
        RevNat6,
        SockRevNat4Entry,
        SockRevNat6Entry,
        SockRevNat4,
        SockRevNat6,
        SockRevNat4V3Key,
        SockRevNat6V3Key,
        SockRevNat4V3,
        SockRevNat6V3,
        Ct4Key,
        Ct6Key,
        Ct4Value,
        Ct6Value,
        NodeConfig,
        SrcRange4,
        SrcRange6,
        AffinityKey,
        AffinityValue,
        MaglevKey,
        MaglevChunk,
        event::Event,
        event::MonitorCtl,
        event::MonitorCpu,
        FlowCounts,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    /// The backend generation counts up in the 24 bits an entry keeps and never comes
    /// back to 0 (an entry's "not checked yet"), and it leaves the flag bits alone.
    #[test]
    fn the_backend_generation_wraps_past_zero_in_24_bits() {
        assert_eq!(next_backend_gen(0), 1);
        assert_eq!(next_backend_gen(41), 42);
        let max = ct_flags::GEN_MASK >> ct_flags::GEN_SHIFT;
        assert_eq!(max, (1 << 24) - 1);
        assert_eq!(next_backend_gen(max), 1);
        assert_eq!(ct_flags::FLAGS_MASK & ct_flags::DSR, ct_flags::DSR);
        assert_eq!(ct_flags::FLAGS_MASK & (max << ct_flags::GEN_SHIFT), 0);
    }

    /// Size equals the sum of the field sizes: no implicit padding anywhere, which the
    /// kernel needs (hash keys are compared byte by byte, padding would be garbage).
    macro_rules! assert_layout {
        ($t:ty, size $size:expr, align $align:expr, fields [$($f:ty),*]) => {
            assert_eq!(size_of::<$t>(), $size, stringify!($t));
            assert_eq!(align_of::<$t>(), $align, stringify!($t));
            assert_eq!(0 $(+ size_of::<$f>())*, $size, concat!(stringify!($t), " has implicit padding"));
        };
    }

    #[test]
    fn abi_sizes_and_no_implicit_padding() {
        assert_layout!(Svc4Key, size 12, align 4, fields [u32, u16, u16, u8, u8, [u8; 2]]);
        assert_layout!(Svc6Key, size 24, align 4, fields [[u32; 4], u16, u16, u8, u8, [u8; 2]]);
        assert_layout!(SvcValue, size 12, align 4, fields [u32, u16, u16, u32]);
        assert_layout!(SvcEntry, size 108, align 4, fields [SvcValue, [u32; SVC_CHUNK_SLOTS]]);
        assert_layout!(Backend4, size 8, align 4, fields [u32, u16, u8, u8]);
        assert_layout!(Backend6, size 20, align 4, fields [[u32; 4], u16, u8, u8]);
        assert_layout!(RevNat4, size 72, align 4, fields [u32, u16, u8, u8, [u8; NAME_LEN]]);
        assert_layout!(RevNat6, size 84, align 4, fields [[u32; 4], u16, u8, u8, [u8; NAME_LEN]]);
        assert_layout!(SockRevNat4Entry, size 16, align 4, fields [u32, u16, u16, u32, u32]);
        assert_layout!(SockRevNat6Entry, size 40, align 4, fields [[u32; 4], [u32; 4], u16, u16, u32]);
        assert_layout!(SockRevNat4, size 132, align 4, fields [u32, [SockRevNat4Entry; limits::SOCK_REVNAT_SLOTS]]);
        assert_layout!(SockRevNat6, size 324, align 4, fields [u32, [SockRevNat6Entry; limits::SOCK_REVNAT_SLOTS]]);
        // ABI 3's socket reverse-NAT layout (frozen: the pinned map is read as it is).
        assert_layout!(SockRevNat4V3Key, size 16, align 8, fields [u64, u32, u16, u16]);
        assert_layout!(SockRevNat6V3Key, size 32, align 8, fields [u64, [u32; 4], u16, [u8; 6]]);
        assert_layout!(SockRevNat4V3, size 12, align 4, fields [u32, u16, u16, u32]);
        assert_layout!(SockRevNat6V3, size 24, align 4, fields [[u32; 4], u16, u16, u32]);
        assert_layout!(Ct4Key, size 16, align 4, fields [u32, u32, u16, u16, u8, u8, [u8; 2]]);
        assert_layout!(Ct6Key, size 40, align 4, fields [[u32; 4], [u32; 4], u16, u16, u8, u8, [u8; 2]]);
        assert_layout!(Ct4Value, size 40, align 8, fields [u32, u32, u16, u16, u32, u32, u32, u64, u64]);
        assert_layout!(Ct6Value, size 64, align 8, fields [[u32; 4], [u32; 4], u16, u16, u32, u32, u32, u64, u64]);
        assert_layout!(NodeConfig, size 20, align 4, fields [u32, [u32; 4]]);
        assert_layout!(AffinityKey, size 24, align 4, fields [[u32; 4], u32, u8, [u8; 3]]);
        assert_layout!(AffinityValue, size 16, align 8, fields [u32, u16, u16, u64]);
        assert_layout!(SrcRange4, size 8, align 4, fields [u32, u32]);
        assert_layout!(SrcRange6, size 20, align 4, fields [u32, [u32; 4]]);
        assert_layout!(MaglevKey, size 8, align 4, fields [u32, u32]);
        assert_layout!(event::Event, size 96, align 8, fields [u64, u32, u32, u32, u8, u8, u8, u8, event::EventTuple, event::EventTuple]);
        assert_layout!(event::EventTuple, size 36, align 4, fields [[u32; 4], [u32; 4], u16, u16]);
        assert_layout!(event::MonitorCtl, size 32, align 8, fields [u64, u64, u64, u32, u32]);
        assert_layout!(event::MonitorCpu, size 48, align 8, fields [u64, u64, u64, u64, u64, u64]);
        assert_layout!(FlowCounts, size 16, align 8, fields [u64, u64]);
        assert_layout!(MaglevChunk, size 4032, align 4, fields [u32, u32, [u16; limits::MAGLEV_CHUNK_SLOTS]]);
    }

    #[test]
    fn field_offsets_are_fixed() {
        assert_eq!(core::mem::offset_of!(Svc4Key, port), 4);
        assert_eq!(core::mem::offset_of!(Svc4Key, chunk), 6);
        assert_eq!(core::mem::offset_of!(Svc4Key, proto), 8);
        assert_eq!(core::mem::offset_of!(Svc6Key, port), 16);
        assert_eq!(core::mem::offset_of!(SvcValue, count), 4);
        assert_eq!(core::mem::offset_of!(SockRevNat6Entry, backend_port), 32);
    }

    #[test]
    fn reasons_are_dense_and_named_uniquely() {
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(*r as u32, i as u32);
            for other in &Reason::ALL[i + 1..] {
                assert_ne!(r.name(), other.name());
            }
        }
    }
}
