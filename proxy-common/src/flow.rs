//! The per-flow maps' keys and values: conntrack (`CT4/6`), session affinity
//! (`AFFINITY`), the sockets' reverse NAT (`SOCK_REVNAT4/6`).

use crate::limits;

/// `CT4` key: a flow's 5-tuple as it appears on the wire in one direction.
/// `dir` 0: the original direction (client -> frontend, before DNAT); 1: the reply
/// direction (backend -> client or node SNAT address, before reverse NAT).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ct4Key {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}

/// `CT6` key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ct6Key {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}

/// `CT4` value: how to rewrite a packet of this direction. A zero address means "leave
/// it". Original direction: destination := the backend, source := the node's SNAT
/// address and port (eTP=Cluster to a remote backend). Reply direction: source := the
/// frontend, destination := the client (when the flow was SNATed).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ct4Value {
    pub dnat_addr: u32,
    pub snat_addr: u32,
    pub dnat_port: u16,
    pub snat_port: u16,
    pub service_id: u32,
    pub backend_id: u32,
    /// `ct_flags`.
    pub flags: u32,
    /// `bpf_ktime_get_ns()` of the last packet.
    pub last_seen: u64,
    /// Packets seen in this direction.
    pub packets: u64,
}

/// `CT6` value (see [`Ct4Value`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ct6Value {
    pub dnat_addr: [u32; 4],
    pub snat_addr: [u32; 4],
    pub dnat_port: u16,
    pub snat_port: u16,
    pub service_id: u32,
    pub backend_id: u32,
    pub flags: u32,
    pub last_seen: u64,
    pub packets: u64,
}

/// `AffinityKey::kind`: what identifies the client.
pub mod affinity_kind {
    /// The client's network namespace cookie (socket hooks: the source address is not
    /// known at `connect()`; one pod, one namespace).
    pub const NETNS: u8 = 0;
    /// An IPv4 source address (TC), in `client[0]`.
    pub const V4: u8 = 4;
    /// An IPv6 source address (TC).
    pub const V6: u8 = 6;
}

/// `AFFINITY` key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    /// The client: a namespace cookie in words 0-1 (native order), or its address.
    pub client: [u32; 4],
    pub service_id: u32,
    /// One of [`affinity_kind`].
    pub kind: u8,
    pub _pad: [u8; 3],
}

/// `AFFINITY` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    pub backend_id: u32,
    /// The slot the backend had: a hit is used only while that slot still names it.
    pub slot: u16,
    pub _pad: u16,
    /// `bpf_ktime_get_ns` of the last selection through this entry.
    pub last_used_ns: u64,
}

/// One reverse entry of a socket: the frontend it asked for when it was sent to this
/// IPv4 backend. `backend_port == 0`: an empty entry (no backend has port 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat4Entry {
    pub backend_addr: u32,
    pub backend_port: u16,
    /// The frontend's port.
    pub port: u16,
    /// The frontend's address.
    pub addr: u32,
    pub service_id: u32,
}

/// `SOCK_REVNAT4` value (socket-local storage): the socket's reverse entries, the oldest
/// replaced first (`next`, taken modulo [`limits::SOCK_REVNAT_SLOTS`], is where the next
/// new backend goes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat4 {
    pub next: u32,
    pub entries: [SockRevNat4Entry; limits::SOCK_REVNAT_SLOTS],
}

/// One reverse entry of a socket for an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat6Entry {
    pub backend_addr: [u32; 4],
    /// The frontend's address.
    pub addr: [u32; 4],
    pub backend_port: u16,
    /// The frontend's port.
    pub port: u16,
    pub service_id: u32,
}

/// `SOCK_REVNAT6` value (socket-local storage).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat6 {
    pub next: u32,
    pub entries: [SockRevNat6Entry; limits::SOCK_REVNAT_SLOTS],
}

impl Ct4Key {
    /// The key of direction `dir` (0 original, 1 reply) of a flow.
    pub const fn new(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8, dir: u8) -> Self {
        Self {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            dir,
            _pad: [0; 2],
        }
    }
}

impl Ct6Key {
    /// The key of direction `dir` (0 original, 1 reply) of a flow.
    pub const fn new(
        saddr: [u32; 4],
        daddr: [u32; 4],
        sport: u16,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Self {
        Self {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            dir,
            _pad: [0; 2],
        }
    }
}

/// `SOCK_REVNAT4_V3` key: the previous layout's (ABI 3) node-wide socket reverse-NAT
/// entry, `{socket cookie, backend}`. After an ABI 3 -> 4 upgrade the pinned ABI-3
/// `SOCK_REVNAT4` map lives on under this name: the `recvmsg`/`getpeername` programs read
/// it when a socket's own storage has no entry (a request the old `sendmsg` program
/// translated), move the entry into the socket's storage and delete it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat4V3Key {
    pub cookie: u64,
    pub addr: u32,
    pub port: u16,
    pub _pad: u16,
}

/// `SOCK_REVNAT6_V3` key (ABI 3's `SOCK_REVNAT6` key).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat6V3Key {
    pub cookie: u64,
    pub addr: [u32; 4],
    pub port: u16,
    pub _pad: [u8; 6],
}

/// `SOCK_REVNAT4_V3` value (ABI 3's `SOCK_REVNAT4` value): the frontend asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat4V3 {
    pub addr: u32,
    pub port: u16,
    pub _pad: u16,
    pub service_id: u32,
}

/// `SOCK_REVNAT6_V3` value (ABI 3's `SOCK_REVNAT6` value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat6V3 {
    pub addr: [u32; 4],
    pub port: u16,
    pub _pad: u16,
    pub service_id: u32,
}
