//! Connection tracking of the packet path (`CT4`/`CT6`): entry lifetimes, refreshes, the
//! two entries of a new flow, and the SNAT port allocator. Independent of the packet
//! context (only [`Pkt`] and the family's maps).
//!
//! A flow has two entries: the original direction (client -> frontend: rewrite to the
//! backend, and to the SNAT address and port when SNATed) and the reply direction
//! (backend -> client or SNAT address: rewrite to the frontend, and back to the client).

use core::ffi::c_void;

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns, generated::bpf_loop};
use proxy_common::{ct_flags, ct_timeouts, Reason};

use super::family::{backend, Pkt, PktFamily};
use crate::maps::BACKEND_GEN;

const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;
/// First and number of SNAT ports (the kernel's default ephemeral range).
pub const SNAT_PORT_MIN: u32 = 32768;
pub const SNAT_PORT_SPAN: u32 = 28232;
/// Whether `port` (network order) is in the SNAT range, so that a packet to it may be
/// the reply of a SNATed flow.
#[inline(always)]
pub fn may_be_snat_port(port: u16) -> bool {
    u32::from(u16::from_be(port)).wrapping_sub(SNAT_PORT_MIN) < SNAT_PORT_SPAN
}

/// Random probes before the scan.
const SNAT_TRIES: u32 = 4;

pub use super::state::Chosen;

/// How long an entry lives after its last packet (`ct_timeouts::idle`, the rule the
/// agent's occupancy sampling shares).
#[inline(always)]
fn timeout(proto: u8, flags: u32) -> u64 {
    ct_timeouts::idle(proto, flags)
}

/// Whether an entry last seen at `last_seen` has expired at `now`.
#[inline(always)]
fn expired(proto: u8, flags: u32, last_seen: u64, now: u64) -> bool {
    now.saturating_sub(last_seen) > timeout(proto, flags)
}

/// The flow's backend id still names the backend it was translated to.
#[inline(always)]
fn backend_is<F: PktFamily>(v: *mut F::Val, dnat: (F::Addr, u16)) -> bool {
    // SAFETY: a live map value.
    let id = F::ct_backend_id(unsafe { &*v });
    matches!(backend::<F>(id), Some((a, port, _)) if a == dnat.0 && port == dnat.1)
}

/// Whether the flow's backend is still there, looked up only when a backend may have
/// gone since the entry last found it: the entry keeps the `BACKEND_GEN` generation of
/// its last successful check (`ct_flags::GEN_SHIFT`), and the agent bumps the
/// generation after deleting backends. An array read instead of a hash lookup for
/// almost every packet. The generation is read before the backend, so a bump racing
/// with the check leaves the older generation in the entry and the next packet checks
/// again.
#[inline(always)]
pub fn backend_still_there<F: PktFamily>(v: *mut F::Val, dnat: (F::Addr, u16)) -> bool {
    let gen = BACKEND_GEN.get(0).copied().unwrap_or(0);
    let (flags, _, _) = F::ct_meta(v);
    // SAFETY: a pointer into a live map value.
    let f = unsafe { *flags };
    if gen != 0 && f >> ct_flags::GEN_SHIFT == gen {
        return true;
    }
    if !backend_is::<F>(v, dnat) {
        return false;
    }
    // SAFETY: as above.
    unsafe { *flags = (f & ct_flags::FLAGS_MASK) | (gen << ct_flags::GEN_SHIFT) };
    true
}

/// Marks a packet on an entry: refreshes it, counts it, notes FIN/RST. Returns false if
/// the entry had expired (and should be replaced).
#[inline(always)]
pub fn touch<F: PktFamily>(
    v: *mut F::Val,
    proto: u8,
    tcp_flags: u8,
    reply: bool,
    now: u64,
) -> bool {
    let (flags, last_seen, packets) = F::ct_meta(v);
    // SAFETY: pointers into a live map value.
    unsafe {
        let mut f = *flags;
        if expired(proto, f, *last_seen, now) {
            return false;
        }
        if tcp_flags & (TCP_FIN | TCP_RST) != 0 {
            f |= ct_flags::CLOSING;
        }
        if reply {
            f |= ct_flags::SEEN_REPLY;
        }
        *flags = f;
        *last_seen = now;
        *packets += 1;
    }
    true
}

/// Refreshes the original-direction entry of a flow whose reply was seen.
#[inline(never)]
pub fn refresh_orig<F: PktFamily>(
    p: &Pkt<F::Addr>,
    client: &(F::Addr, u16),
    front: &(F::Addr, u16),
    now: u64,
) {
    let okey = F::ct_key(client.0, front.0, client.1, front.1, p.proto, 0);
    if let Some(o) = F::ct_get(&okey) {
        touch::<F>(o, p.proto, p.tcp_flags, true, now);
    }
}

/// Writes both entries of a new flow. On failure neither is left behind (a flow without
/// its reply entry would be translated one way only).
#[inline(never)]
pub fn put_flow<F: PktFamily>(
    p: &Pkt<F::Addr>,
    c: &Chosen<F::Addr>,
    now: u64,
) -> Result<(), Reason> {
    put_orig::<F>(p, c, now)?;
    if put_reply::<F>(p, c, now).is_err() {
        F::ct_del(&F::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, 0));
        return Err(Reason::TcCtWriteFailed);
    }
    Ok(())
}

/// The original-direction entry of a new flow (own frame: keys and values are large).
#[inline(never)]
fn put_orig<F: PktFamily>(p: &Pkt<F::Addr>, c: &Chosen<F::Addr>, now: u64) -> Result<(), Reason> {
    let val = F::ct_val(c.backend, c.snat, c.service_id, c.backend_id, c.flags, now);
    F::ct_put(
        &F::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, 0),
        &val,
    )
    .map_err(|()| Reason::TcCtWriteFailed)
}

/// The reply-direction entry of a new flow: restores the frontend the client used, and
/// the client itself when the flow was SNATed.
#[inline(never)]
fn put_reply<F: PktFamily>(p: &Pkt<F::Addr>, c: &Chosen<F::Addr>, now: u64) -> Result<(), ()> {
    let (reply_to, client) = if c.flags & ct_flags::SNAT != 0 {
        (c.snat, (p.saddr, p.sport))
    } else {
        ((p.saddr, p.sport), (F::zero(), 0))
    };
    let val = F::ct_val(
        client,
        (p.daddr, p.dport),
        c.service_id,
        c.backend_id,
        c.flags,
        now,
    );
    let key = F::ct_key(c.backend.0, reply_to.0, c.backend.1, reply_to.1, p.proto, 1);
    F::ct_put(&key, &val)
}

/// A free SNAT source port towards `backend:bport` from `addr`, if any port of the range
/// is free: a few random probes (the common case, a sparse range), then a scan of the
/// whole range from a random start with `bpf_loop` (one verifier-checked callback, so the
/// scan costs no verifier budget per port). A port is free when no reply-direction entry
/// holds it, or when the flow that holds it has expired (`port_free`): expired flows are
/// reclaimed, not left to the LRU. `None` only when every port is held by a live flow.
/// (Netfilter's `nf_nat_l4proto_unique_tuple` gives up after 128+64+32+16 probes and
/// cilium's `snat_v4_new_mapping` after 32: both can refuse with ports free.)
#[inline(never)]
pub fn snat_port<F: PktFamily>(
    baddr: F::Addr,
    bport: u16,
    addr: F::Addr,
    proto: u8,
) -> Option<u16> {
    let mut scan = PortScan {
        baddr,
        addr,
        // SAFETY: no preconditions.
        now: unsafe { bpf_ktime_get_ns() },
        // SAFETY: no preconditions.
        start: unsafe { bpf_get_prandom_u32() } % SNAT_PORT_SPAN,
        found: 0,
        bport,
        proto,
    };
    let mut i = 0;
    while i < SNAT_TRIES {
        // SAFETY: no preconditions.
        let r = unsafe { bpf_get_prandom_u32() };
        let port = ((SNAT_PORT_MIN + r % SNAT_PORT_SPAN) as u16).to_be();
        if port_free::<F>(&scan, port) {
            return Some(port);
        }
        i += 1;
    }
    // SAFETY: the callback is a BPF subprogram taking this stack context.
    let ret = unsafe {
        bpf_loop(
            SNAT_PORT_SPAN,
            scan_port::<F> as *const () as *mut c_void,
            &raw mut scan as *mut c_void,
            0,
        )
    };
    if ret < 0 || scan.found == 0 {
        return None;
    }
    Some(scan.found as u16)
}

/// A search for a SNAT port towards `baddr:bport` from `addr`: on the stack, where
/// `bpf_loop` wants its context.
#[repr(C)]
struct PortScan<A> {
    baddr: A,
    addr: A,
    now: u64,
    /// Offset of the first port scanned.
    start: u32,
    /// `0x1_0000 | port` (network order) once a free port is found.
    found: u32,
    bport: u16,
    proto: u8,
}

/// One step of the scan: port `SNAT_PORT_MIN + (start + i) % SNAT_PORT_SPAN`. Returns 1
/// (stop) at the first free port.
#[inline(never)]
extern "C" fn scan_port<F: PktFamily>(i: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the caller's `PortScan<F::Addr>`.
    let s = unsafe { &mut *(ctx as *mut PortScan<F::Addr>) };
    let off = (s.start + i as u32) % SNAT_PORT_SPAN;
    let port = ((SNAT_PORT_MIN + off) as u16).to_be();
    if port_free::<F>(s, port) {
        s.found = 0x1_0000 | u32::from(port);
        return 1;
    }
    0
}

/// Whether SNAT port `port` (network order) of search `s` is free: no reply-direction
/// entry holds it, or that entry has expired and so has its flow's original-direction
/// entry (a UDP flow whose backend never answers refreshes only the latter), or that
/// entry no longer uses this port.
#[inline(never)]
fn port_free<F: PktFamily>(s: &PortScan<F::Addr>, port: u16) -> bool {
    let Some(v) = F::ct_get(&F::ct_key(s.baddr, s.addr, s.bport, port, s.proto, 1)) else {
        return true;
    };
    let (flags, last_seen, _) = F::ct_meta(v);
    // SAFETY: fields of a live map value.
    if !expired(s.proto, unsafe { *flags }, unsafe { *last_seen }, s.now) {
        return false;
    }
    // The reply entry of a SNATed flow: `dnat` is the client, `snat` the frontend.
    // SAFETY: copied out of a live map value.
    let (client, front) = F::ct_nat(unsafe { &*v });
    if F::is_zero(&client.0) {
        return true;
    }
    let okey = F::ct_key(client.0, front.0, client.1, front.1, s.proto, 0);
    let Some(o) = F::ct_get(&okey) else {
        return true;
    };
    let (oflags, olast, _) = F::ct_meta(o);
    // SAFETY: copied out of a live map value.
    let (_, osnat) = F::ct_nat(unsafe { &*o });
    // SAFETY: fields of a live map value.
    expired(s.proto, unsafe { *oflags }, unsafe { *olast }, s.now)
        || osnat.0 != s.addr
        || osnat.1 != port
}

/// Whether an entry (either direction) is of a DSR flow.
#[inline(always)]
pub fn is_dsr<F: PktFamily>(v: *mut F::Val) -> bool {
    let (flags, _, _) = F::ct_meta(v);
    // SAFETY: a field of a live map value.
    unsafe { *flags & ct_flags::DSR != 0 }
}

/// The outcome of a reply: `tc_dsr_reply` for a DSR flow's reply leaving the backend's
/// node, `tc_reply` otherwise.
#[inline(always)]
pub fn reply_reason<F: PktFamily>(v: *mut F::Val) -> Reason {
    if is_dsr::<F>(v) {
        Reason::TcDsrReply
    } else {
        Reason::TcReply
    }
}
