//! Frontend lookup, equal-weight backend selection and the reverse path, written once over
//! [`Family`] and instantiated for IPv4 ([`V4`]) and IPv6 ([`V6`]) (cilium's `lb4_*`/`lb6_*`,
//! without the copy). Addresses and ports stay in network byte order throughout.

use proxy_common::{
    affinity_kind, scope, svc_flags, Reason, SockRevNat4, SockRevNat4Key, SockRevNat6,
    SockRevNat6Key, Svc4Key, Svc6Key, SvcValue,
};

use crate::affinity;
use crate::maps::{
    count_backend, BACKEND4, BACKEND6, NODE_ADDRS4, NODE_ADDRS6, SOCK_REVNAT4, SOCK_REVNAT6, SVC4,
    SVC6,
};

/// One address family's maps.
pub trait Family {
    type Addr: Copy + PartialEq;

    /// The `SVC` entry for `slot` of frontend `addr:port/proto`.
    fn svc(addr: Self::Addr, port: u16, proto: u8, slot: u16) -> Option<SvcValue>;
    /// The all-zero address: NodePort frontends are keyed by it.
    fn zero() -> Self::Addr;
    /// One of the node's addresses (`NODE_ADDRS`): NodePorts answer on it.
    fn is_node_addr(a: Self::Addr) -> bool;
    /// The backend's address and port.
    fn backend(id: u32) -> Option<(Self::Addr, u16)>;
    /// The frontend `(addr, port, service_id)` this socket asked for when it went to
    /// `backend`.
    fn rev_get(cookie: u64, addr: Self::Addr, port: u16) -> Option<(Self::Addr, u16, u32)>;
    /// Records (or refreshes) the reverse entry.
    fn rev_put(
        cookie: u64,
        backend: (Self::Addr, u16),
        front: (Self::Addr, u16),
        id: u32,
    ) -> Result<(), i32>;
    /// Deletes a stale reverse entry.
    fn rev_del(cookie: u64, addr: Self::Addr, port: u16);
    /// The `SVC` entry for `slot` of frontend `addr:port/proto` in `scope` (`scope::ALL`
    /// or the external-local twin, which only the TC path reads).
    fn svc_in(addr: Self::Addr, port: u16, proto: u8, scope: u8, slot: u16) -> Option<SvcValue>;
    /// The backend's address, port and `backend_flags`.
    fn backend_entry(id: u32) -> Option<(Self::Addr, u16, u8)>;
}

pub struct V4;
pub struct V6;

impl Family for V4 {
    type Addr = u32;

    #[inline(always)]
    fn svc(addr: u32, port: u16, proto: u8, slot: u16) -> Option<SvcValue> {
        // SAFETY: the value is copied out at once.
        unsafe {
            SVC4.get(&Svc4Key::new(addr, port, proto, scope::ALL, slot))
                .copied()
        }
    }

    #[inline(always)]
    fn zero() -> u32 {
        0
    }

    #[inline(always)]
    fn is_node_addr(a: u32) -> bool {
        // SAFETY: presence check only.
        unsafe { NODE_ADDRS4.get(&a).is_some() }
    }

    #[inline(always)]
    fn backend(id: u32) -> Option<(u32, u16)> {
        // SAFETY: copied out at once.
        unsafe { BACKEND4.get(&id).map(|b| (b.addr, b.port)) }
    }

    #[inline(always)]
    fn rev_get(cookie: u64, addr: u32, port: u16) -> Option<(u32, u16, u32)> {
        let key = SockRevNat4Key {
            cookie,
            addr,
            port,
            _pad: 0,
        };
        // SAFETY: copied out at once.
        unsafe {
            SOCK_REVNAT4
                .get(&key)
                .map(|v| (v.addr, v.port, v.service_id))
        }
    }

    #[inline(always)]
    fn rev_put(cookie: u64, b: (u32, u16), f: (u32, u16), id: u32) -> Result<(), i32> {
        let key = SockRevNat4Key {
            cookie,
            addr: b.0,
            port: b.1,
            _pad: 0,
        };
        let val = SockRevNat4 {
            addr: f.0,
            port: f.1,
            _pad: 0,
            service_id: id,
        };
        SOCK_REVNAT4.insert(&key, &val, 0)
    }

    #[inline(always)]
    fn rev_del(cookie: u64, addr: u32, port: u16) {
        let _ = SOCK_REVNAT4.remove(&SockRevNat4Key {
            cookie,
            addr,
            port,
            _pad: 0,
        });
    }

    #[inline(always)]
    fn svc_in(addr: u32, port: u16, proto: u8, scope: u8, slot: u16) -> Option<SvcValue> {
        // SAFETY: copied out at once.
        unsafe {
            SVC4.get(&Svc4Key::new(addr, port, proto, scope, slot))
                .copied()
        }
    }

    #[inline(always)]
    fn backend_entry(id: u32) -> Option<(u32, u16, u8)> {
        // SAFETY: copied out at once.
        unsafe { BACKEND4.get(&id).map(|b| (b.addr, b.port, b.flags)) }
    }
}

impl Family for V6 {
    type Addr = [u32; 4];

    #[inline(always)]
    fn svc(addr: [u32; 4], port: u16, proto: u8, slot: u16) -> Option<SvcValue> {
        // SAFETY: copied out at once.
        unsafe {
            SVC6.get(&Svc6Key::new(addr, port, proto, scope::ALL, slot))
                .copied()
        }
    }

    #[inline(always)]
    fn zero() -> [u32; 4] {
        [0; 4]
    }

    #[inline(always)]
    fn is_node_addr(a: [u32; 4]) -> bool {
        // SAFETY: presence check only.
        unsafe { NODE_ADDRS6.get(&a).is_some() }
    }

    #[inline(always)]
    fn backend(id: u32) -> Option<([u32; 4], u16)> {
        // SAFETY: copied out at once.
        unsafe { BACKEND6.get(&id).map(|b| (b.addr, b.port)) }
    }

    #[inline(always)]
    fn rev_get(cookie: u64, addr: [u32; 4], port: u16) -> Option<([u32; 4], u16, u32)> {
        let key = SockRevNat6Key {
            cookie,
            addr,
            port,
            _pad: [0; 6],
        };
        // SAFETY: copied out at once.
        unsafe {
            SOCK_REVNAT6
                .get(&key)
                .map(|v| (v.addr, v.port, v.service_id))
        }
    }

    #[inline(always)]
    fn rev_put(cookie: u64, b: ([u32; 4], u16), f: ([u32; 4], u16), id: u32) -> Result<(), i32> {
        let key = SockRevNat6Key {
            cookie,
            addr: b.0,
            port: b.1,
            _pad: [0; 6],
        };
        let val = SockRevNat6 {
            addr: f.0,
            port: f.1,
            _pad: 0,
            service_id: id,
        };
        SOCK_REVNAT6.insert(&key, &val, 0)
    }

    #[inline(always)]
    fn rev_del(cookie: u64, addr: [u32; 4], port: u16) {
        let _ = SOCK_REVNAT6.remove(&SockRevNat6Key {
            cookie,
            addr,
            port,
            _pad: [0; 6],
        });
    }

    #[inline(always)]
    fn svc_in(addr: [u32; 4], port: u16, proto: u8, scope: u8, slot: u16) -> Option<SvcValue> {
        // SAFETY: copied out at once.
        unsafe {
            SVC6.get(&Svc6Key::new(addr, port, proto, scope, slot))
                .copied()
        }
    }

    #[inline(always)]
    fn backend_entry(id: u32) -> Option<([u32; 4], u16, u8)> {
        // SAFETY: copied out at once.
        unsafe { BACKEND6.get(&id).map(|b| (b.addr, b.port, b.flags)) }
    }
}

/// The frontend `addr:port/proto` is, and the address its slots are keyed by: the one
/// lookup rule of every datapath (`proxy_common::lookup::frontend`: the exact frontend,
/// else for one of the node's addresses the NodePort entry), over this family's maps.
#[inline(always)]
pub fn frontend<F: Family>(addr: F::Addr, port: u16, proto: u8) -> Option<(SvcValue, F::Addr)> {
    proxy_common::lookup::frontend(
        addr,
        F::zero(),
        |a| F::svc(a, port, proto, 0),
        F::is_node_addr,
    )
}

/// The outcome of the forward path when the destination was a frontend.
pub struct Fwd<A> {
    pub addr: A,
    pub port: u16,
}

/// Forward translation: frontend -> one of its backends, chosen with equal weight
/// (slot = 1 + random % count: one lookup where iptables walks a statistic chain).
/// `Ok(None)`: not a frontend. `Err(NoBackend | NoLocalBackend)`: the caller must refuse
/// the syscall. `netns()` identifies the client for session affinity (called only for a
/// frontend that has it).
#[inline(always)]
pub fn xlate_fwd<F: Family>(
    addr: F::Addr,
    port: u16,
    proto: u8,
    cookie: u64,
    netns: impl Fn() -> u64,
) -> Result<Option<Fwd<F::Addr>>, Reason> {
    let Some((front, key_addr)) = frontend::<F>(addr, port, proto) else {
        return Ok(None);
    };
    if front.count == 0 {
        return Err(if front.flags & svc_flags::LOCAL_ONLY != 0 {
            Reason::NoLocalBackend
        } else {
            Reason::NoBackend
        });
    }
    let slot_backend = |s: u16| F::svc(key_addr, port, proto, s).map(|e| e.backend_id);
    let client = || {
        let n = netns();
        affinity::key(
            &front,
            [n as u32, (n >> 32) as u32, 0, 0],
            affinity_kind::NETNS,
        )
    };
    let backend_id =
        affinity::choose(&front, client, slot_backend).ok_or(Reason::BackendMissing)?;
    let (baddr, bport) = F::backend(backend_id).ok_or(Reason::BackendMissing)?;
    count_backend(backend_id);

    // Remember the frontend for recvmsg/getpeername; write only when it changed (a UDP
    // socket sending many datagrams to the same backend writes once).
    let fresh = match F::rev_get(cookie, baddr, bport) {
        Some((a, p, id)) => !(a == addr && p == port && id == front.service_id),
        None => true,
    };
    if fresh && F::rev_put(cookie, (baddr, bport), (addr, port), front.service_id).is_err() {
        crate::maps::count(Reason::RevNatUpdateFailed);
    }
    Ok(Some(Fwd {
        addr: baddr,
        port: bport,
    }))
}

/// Reverse translation for `recvmsg` (a reply's source) and `getpeername` (a connected
/// socket's peer): backend -> the frontend this socket asked for, if that frontend still
/// exists with the same service id. `Ok(None)`: nothing to do.
#[inline(always)]
pub fn xlate_rev<F: Family>(
    addr: F::Addr,
    port: u16,
    proto: u8,
    cookie: u64,
) -> Result<Option<Fwd<F::Addr>>, Reason> {
    let Some((faddr, fport, id)) = F::rev_get(cookie, addr, port) else {
        return Err(Reason::RevNatMiss);
    };
    match frontend::<F>(faddr, fport, proto) {
        Some((front, _)) if front.service_id == id => Ok(Some(Fwd {
            addr: faddr,
            port: fport,
        })),
        _ => {
            F::rev_del(cookie, addr, port);
            Err(Reason::RevNatStale)
        }
    }
}
