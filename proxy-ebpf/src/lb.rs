//! Frontend lookup, equal-weight backend selection and the reverse path, written once over
//! [`Family`] and instantiated for IPv4 ([`V4`]) and IPv6 ([`V6`]) (cilium's `lb4_*`/`lb6_*`,
//! without the copy). Addresses and ports stay in network byte order throughout.

use aya_ebpf::bindings::bpf_sock;
use proxy_common::{
    affinity_kind, limits::SOCK_REVNAT_SLOTS, scope, svc_chunk_of, svc_flags, Reason,
    SockRevNat4Entry, SockRevNat4V3Key, SockRevNat6Entry, SockRevNat6V3Key, Svc4Key, Svc6Key,
    SvcEntry, SvcValue, SVC_CHUNK_SLOTS,
};

use core::ptr::{read_volatile, write_volatile};

use crate::affinity;
use crate::maps::{
    count_backend, BACKEND4, BACKEND6, NODE_ADDRS4, NODE_ADDRS6, SOCK_REVNAT4, SOCK_REVNAT4_V3,
    SOCK_REVNAT6, SOCK_REVNAT6_V3, SVC4, SVC6,
};

/// One address family's maps.
pub trait Family {
    type Addr: Copy + PartialEq;

    /// The frontend `addr:port/proto` (its `SVC` entry's frontend fields).
    fn svc(addr: Self::Addr, port: u16, proto: u8) -> Option<SvcValue>;
    /// The all-zero address: NodePort frontends are keyed by it.
    fn zero() -> Self::Addr;
    /// One of the node's addresses (`NODE_ADDRS`): NodePorts answer on it.
    fn is_node_addr(a: Self::Addr) -> bool;
    /// The backend's address and port.
    fn backend(id: u32) -> Option<(Self::Addr, u16)>;
    /// The socket's reverse table (`SOCK_REVNAT4/6`, socket-local storage), made empty
    /// first with `create`.
    fn rev_table(sk: *mut bpf_sock, create: bool) -> Option<RevTable<Self::Entry>>;
    /// One reverse entry: `backend -> (frontend, service id)`.
    type Entry: RevEntry<Addr = Self::Addr>;
    /// The frontend `addr:port/proto` in `scope` (`scope::ALL` or the external-local
    /// twin, which only the TC path reads).
    fn svc_in(addr: Self::Addr, port: u16, proto: u8, scope: u8) -> Option<SvcValue>;
    /// The backend id backend slot `slot` (`1..=count`) of frontend `addr:port/proto` in
    /// `scope` names: read from the `SVC` entry of the slot's chunk (the frontend's own
    /// entry for slots `1..=24`).
    fn slot_backend(addr: Self::Addr, port: u16, proto: u8, scope: u8, slot: u16) -> Option<u32>;
    /// The backend's address, port and `backend_flags`.
    fn backend_entry(id: u32) -> Option<(Self::Addr, u16, u8)>;
    /// The previous layout's reverse entry of the socket `cookie` for `backend`
    /// (`SOCK_REVNAT4/6_V3`: what the ABI-3 `sendmsg`/`connect` recorded before an
    /// upgrade), `(frontend addr, port, service id)`.
    fn v3_get(cookie: u64, backend: (Self::Addr, u16)) -> Option<(Self::Addr, u16, u32)>;
    /// Deletes that entry (moved into the socket's storage, or stale).
    fn v3_del(cookie: u64, backend: (Self::Addr, u16));
}

/// A socket's reverse entries for one family: `[next, entries...]` in its storage.
pub struct RevTable<E> {
    next: *mut u32,
    entries: *mut [E; SOCK_REVNAT_SLOTS],
}

/// One family's reverse entry (`SockRevNat4Entry`, `SockRevNat6Entry`).
pub trait RevEntry {
    type Addr: Copy + PartialEq;
    /// The backend, `None` for an empty entry.
    fn backend(&self) -> Option<(Self::Addr, u16)>;
    /// `(frontend addr, port, service id)`.
    fn front(&self) -> (Self::Addr, u16, u32);
    /// Writes the frontend, then the backend; the backend port (the "in use" mark, an
    /// entry is matched on it) is written last, cleared first.
    fn set(&mut self, backend: (Self::Addr, u16), front: (Self::Addr, u16), id: u32);
    fn clear(&mut self);
}

impl RevEntry for SockRevNat4Entry {
    type Addr = u32;

    #[inline(always)]
    fn backend(&self) -> Option<(u32, u16)> {
        // SAFETY: plain integer fields of a live storage value.
        let port = unsafe { read_volatile(&self.backend_port) };
        (port != 0).then(|| (self.backend_addr, port))
    }

    #[inline(always)]
    fn front(&self) -> (u32, u16, u32) {
        (self.addr, self.port, self.service_id)
    }

    #[inline(always)]
    fn set(&mut self, b: (u32, u16), f: (u32, u16), id: u32) {
        // SAFETY: as above; volatile keeps the order.
        unsafe {
            write_volatile(&mut self.backend_port, 0);
            write_volatile(&mut self.addr, f.0);
            write_volatile(&mut self.port, f.1);
            write_volatile(&mut self.service_id, id);
            write_volatile(&mut self.backend_addr, b.0);
            write_volatile(&mut self.backend_port, b.1);
        }
    }

    #[inline(always)]
    fn clear(&mut self) {
        // SAFETY: as above.
        unsafe { write_volatile(&mut self.backend_port, 0) };
    }
}

impl RevEntry for SockRevNat6Entry {
    type Addr = [u32; 4];

    #[inline(always)]
    fn backend(&self) -> Option<([u32; 4], u16)> {
        // SAFETY: plain integer fields of a live storage value.
        let port = unsafe { read_volatile(&self.backend_port) };
        (port != 0).then(|| (self.backend_addr, port))
    }

    #[inline(always)]
    fn front(&self) -> ([u32; 4], u16, u32) {
        (self.addr, self.port, self.service_id)
    }

    #[inline(always)]
    fn set(&mut self, b: ([u32; 4], u16), f: ([u32; 4], u16), id: u32) {
        // SAFETY: as above; volatile keeps the order.
        unsafe {
            write_volatile(&mut self.backend_port, 0);
            write_volatile(&mut self.addr, f.0);
            write_volatile(&mut self.port, f.1);
            write_volatile(&mut self.service_id, id);
            write_volatile(&mut self.backend_addr, b.0);
            write_volatile(&mut self.backend_port, b.1);
        }
    }

    #[inline(always)]
    fn clear(&mut self) {
        // SAFETY: as above.
        unsafe { write_volatile(&mut self.backend_port, 0) };
    }
}

impl<E: RevEntry> RevTable<E> {
    /// The entry for `backend`, if the socket has one.
    #[inline(always)]
    fn find(&self, backend: (E::Addr, u16)) -> Option<&mut E> {
        for i in 0..SOCK_REVNAT_SLOTS {
            // SAFETY: `entries` points into the socket's live storage value; `i` is in
            // bounds.
            let e = unsafe { &mut (*self.entries)[i] };
            if e.backend() == Some(backend) {
                return Some(e);
            }
        }
        None
    }

    /// The frontend this socket asked for when it went to `backend`.
    #[inline(always)]
    fn get(&self, backend: (E::Addr, u16)) -> Option<(E::Addr, u16, u32)> {
        self.find(backend).map(|e| e.front())
    }

    /// Records `backend -> front`: rewrites the backend's entry only if it changed (a UDP
    /// socket sending many datagrams to one backend writes once), else replaces the
    /// socket's own oldest entry.
    #[inline(always)]
    fn put(&self, backend: (E::Addr, u16), front: (E::Addr, u16), id: u32) {
        if let Some(e) = self.find(backend) {
            if e.front() != (front.0, front.1, id) {
                e.set(backend, front, id);
            }
            return;
        }
        // SAFETY: `next` points into the live storage value. Two threads sending on one
        // socket at once may pick the same entry: the later write wins.
        let n = unsafe { read_volatile(self.next) };
        unsafe { write_volatile(self.next, n.wrapping_add(1)) };
        let i = n as usize & (SOCK_REVNAT_SLOTS - 1);
        // SAFETY: in bounds (mask).
        let e = unsafe { &mut (*self.entries)[i] };
        e.set(backend, front, id);
    }

    /// Forgets `backend`'s entry.
    #[inline(always)]
    fn del(&self, backend: (E::Addr, u16)) {
        if let Some(e) = self.find(backend) {
            e.clear();
        }
    }
}

pub struct V4;
pub struct V6;

impl Family for V4 {
    type Addr = u32;

    #[inline(always)]
    fn svc(addr: u32, port: u16, proto: u8) -> Option<SvcValue> {
        Self::svc_in(addr, port, proto, scope::ALL)
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
        // An array: a free id's entry (protocol 0) is no backend.
        BACKEND4
            .get(id)
            .filter(|b| b.in_use())
            .map(|b| (b.addr, b.port))
    }

    type Entry = SockRevNat4Entry;

    #[inline(always)]
    fn rev_table(sk: *mut bpf_sock, create: bool) -> Option<RevTable<SockRevNat4Entry>> {
        let v = SOCK_REVNAT4.get(sk, create)?;
        // SAFETY: a live storage value of this type.
        Some(unsafe {
            RevTable {
                next: &raw mut (*v).next,
                entries: &raw mut (*v).entries,
            }
        })
    }

    #[inline(always)]
    fn svc_in(addr: u32, port: u16, proto: u8, scope: u8) -> Option<SvcValue> {
        // SAFETY: the frontend's fields are copied out at once.
        unsafe {
            SVC4.get(&Svc4Key::new(addr, port, proto, scope, 0))
                .map(|e| e.head)
        }
    }

    #[inline(always)]
    fn slot_backend(addr: u32, port: u16, proto: u8, scope: u8, slot: u16) -> Option<u32> {
        let (chunk, i) = svc_chunk_of(slot);
        // SAFETY: one id read out of a live map value.
        let e = unsafe { SVC4.get(&Svc4Key::new(addr, port, proto, scope, chunk)) }?;
        chunk_backend(e, i)
    }

    #[inline(always)]
    fn backend_entry(id: u32) -> Option<(u32, u16, u8)> {
        // An array: a free id's entry (protocol 0) is no backend.
        BACKEND4
            .get(id)
            .filter(|b| b.in_use())
            .map(|b| (b.addr, b.port, b.flags))
    }

    #[inline(always)]
    fn v3_get(cookie: u64, b: (u32, u16)) -> Option<(u32, u16, u32)> {
        let key = SockRevNat4V3Key {
            cookie,
            addr: b.0,
            port: b.1,
            _pad: 0,
        };
        // SAFETY: copied out at once.
        unsafe {
            SOCK_REVNAT4_V3
                .get(&key)
                .map(|v| (v.addr, v.port, v.service_id))
        }
    }

    #[inline(always)]
    fn v3_del(cookie: u64, b: (u32, u16)) {
        let _ = SOCK_REVNAT4_V3.remove(&SockRevNat4V3Key {
            cookie,
            addr: b.0,
            port: b.1,
            _pad: 0,
        });
    }
}

impl Family for V6 {
    type Addr = [u32; 4];

    #[inline(always)]
    fn svc(addr: [u32; 4], port: u16, proto: u8) -> Option<SvcValue> {
        Self::svc_in(addr, port, proto, scope::ALL)
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
        // An array: a free id's entry (protocol 0) is no backend.
        BACKEND6
            .get(id)
            .filter(|b| b.in_use())
            .map(|b| (b.addr, b.port))
    }

    type Entry = SockRevNat6Entry;

    #[inline(always)]
    fn rev_table(sk: *mut bpf_sock, create: bool) -> Option<RevTable<SockRevNat6Entry>> {
        let v = SOCK_REVNAT6.get(sk, create)?;
        // SAFETY: a live storage value of this type.
        Some(unsafe {
            RevTable {
                next: &raw mut (*v).next,
                entries: &raw mut (*v).entries,
            }
        })
    }

    #[inline(always)]
    fn svc_in(addr: [u32; 4], port: u16, proto: u8, scope: u8) -> Option<SvcValue> {
        // SAFETY: the frontend's fields are copied out at once.
        unsafe {
            SVC6.get(&Svc6Key::new(addr, port, proto, scope, 0))
                .map(|e| e.head)
        }
    }

    #[inline(always)]
    fn slot_backend(addr: [u32; 4], port: u16, proto: u8, scope: u8, slot: u16) -> Option<u32> {
        let (chunk, i) = svc_chunk_of(slot);
        // SAFETY: one id read out of a live map value.
        let e = unsafe { SVC6.get(&Svc6Key::new(addr, port, proto, scope, chunk)) }?;
        chunk_backend(e, i)
    }

    #[inline(always)]
    fn backend_entry(id: u32) -> Option<([u32; 4], u16, u8)> {
        // An array: a free id's entry (protocol 0) is no backend.
        BACKEND6
            .get(id)
            .filter(|b| b.in_use())
            .map(|b| (b.addr, b.port, b.flags))
    }

    #[inline(always)]
    fn v3_get(cookie: u64, b: ([u32; 4], u16)) -> Option<([u32; 4], u16, u32)> {
        let key = SockRevNat6V3Key {
            cookie,
            addr: b.0,
            port: b.1,
            _pad: [0; 6],
        };
        // SAFETY: copied out at once.
        unsafe {
            SOCK_REVNAT6_V3
                .get(&key)
                .map(|v| (v.addr, v.port, v.service_id))
        }
    }

    #[inline(always)]
    fn v3_del(cookie: u64, b: ([u32; 4], u16)) {
        let _ = SOCK_REVNAT6_V3.remove(&SockRevNat6V3Key {
            cookie,
            addr: b.0,
            port: b.1,
            _pad: [0; 6],
        });
    }
}

/// The backend id at index `i` (`< SVC_CHUNK_SLOTS`, from `svc_chunk_of`) of the chunk
/// entry `e`. LLVM knows the bound (a remainder) and would drop the bounds check the
/// verifier needs (as in `maglev::slot`): a volatile reload keeps it.
#[inline(always)]
fn chunk_backend(e: &SvcEntry, i: usize) -> Option<u32> {
    // SAFETY: a read of a local.
    let i = unsafe { read_volatile(&i) };
    if i >= SVC_CHUNK_SLOTS {
        return None;
    }
    e.backend_at(i)
}

/// The frontend `addr:port/proto` is, and the address its slots are keyed by: the one
/// lookup rule of every datapath (`proxy_common::lookup::frontend`: the exact frontend,
/// else for one of the node's addresses the NodePort entry), over this family's maps.
#[inline(always)]
pub fn frontend<F: Family>(addr: F::Addr, port: u16, proto: u8) -> Option<(SvcValue, F::Addr)> {
    proxy_common::lookup::frontend(addr, F::zero(), |a| F::svc(a, port, proto), F::is_node_addr)
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
    sk: *mut bpf_sock,
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
    let slot_backend = |s: u16| F::slot_backend(key_addr, port, proto, scope::ALL, s);
    let client = || {
        let n = netns();
        affinity::key(
            &front,
            [n as u32, (n >> 32) as u32, 0, 0],
            affinity_kind::NETNS,
        )
    };
    let backend_id =
        affinity::choose(&front, client, slot_backend, 0).ok_or(Reason::BackendMissing)?;
    let (baddr, bport) = F::backend(backend_id).ok_or(Reason::BackendMissing)?;
    count_backend(backend_id);
    if crate::maps::counters_on() {
        crate::maps::count_flow(front.service_id, backend_id, 1, 0);
    }

    // Remember the frontend for recvmsg/getpeername, in the socket's own storage.
    match F::rev_table(sk, true) {
        Some(t) => t.put((baddr, bport), (addr, port), front.service_id),
        None => crate::maps::count(Reason::RevNatUpdateFailed),
    }
    Ok(Some(Fwd {
        addr: baddr,
        port: bport,
    }))
}

/// Reverse translation for `recvmsg` (a reply's source) and `getpeername` (a connected
/// socket's peer): backend -> the frontend this socket asked for, if that frontend still
/// exists with the same service id. `Ok(None)`: nothing to do.
///
/// A socket whose storage has no entry for `addr:port` may have been translated by the
/// previous layout's programs before an upgrade (ABI 3 kept the entries node-wide, keyed
/// by socket cookie): its entry is then read from `SOCK_REVNAT4/6_V3`, moved into the
/// socket's storage (so the next call finds it there) and deleted. `cookie()` is called
/// only then.
#[inline(always)]
pub fn xlate_rev<F: Family>(
    addr: F::Addr,
    port: u16,
    proto: u8,
    sk: *mut bpf_sock,
    cookie: impl Fn() -> u64,
) -> Result<Option<Fwd<F::Addr>>, Reason> {
    let backend = (addr, port);
    let table = F::rev_table(sk, false);
    let own = match &table {
        Some(t) => t.get(backend),
        None => None,
    };
    let (faddr, fport, id) = match own {
        Some(e) => e,
        None => {
            let c = cookie();
            let Some((faddr, fport, id)) = F::v3_get(c, backend) else {
                return Err(Reason::RevNatMiss);
            };
            let live =
                matches!(frontend::<F>(faddr, fport, proto), Some((f, _)) if f.service_id == id);
            if !live {
                F::v3_del(c, backend);
                return Err(Reason::RevNatStale);
            }
            // Into the socket's own storage; the old entry goes once it is there.
            match F::rev_table(sk, true) {
                Some(t) => {
                    t.put(backend, (faddr, fport), id);
                    F::v3_del(c, backend);
                }
                None => crate::maps::count(Reason::RevNatUpdateFailed),
            }
            return Ok(Some(Fwd {
                addr: faddr,
                port: fport,
            }));
        }
    };
    match frontend::<F>(faddr, fport, proto) {
        Some((front, _)) if front.service_id == id => Ok(Some(Fwd {
            addr: faddr,
            port: fport,
        })),
        _ => {
            if let Some(t) = table {
                t.del(backend);
            }
            Err(Reason::RevNatStale)
        }
    }
}
