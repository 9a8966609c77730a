//! ICMP errors about NATed flows, translated so PMTU discovery and error reporting work
//! through the TC datapath (ingress only).
//!
//! An error arrives at the node about a packet the node sent on a flow's behalf:
//! - about a reply we restored (inner: frontend -> client), sent by a router towards the
//!   frontend address: it is for the backend. The original-direction entry, looked up
//!   with the inner tuple reversed, gives the backend (and the SNAT address the backend
//!   saw as client): inner source := backend, inner destination := SNAT address if any,
//!   outer destination := backend;
//! - about a packet we SNATed towards a remote backend (inner: SNAT address -> backend),
//!   sent towards the SNAT address: it is for the client. The reply-direction entry,
//!   looked up with the inner tuple reversed, gives the client and the frontend: inner
//!   source := client, inner destination := frontend, outer destination := client.
//!
//! Checksums: the outer IPv4 header's; the ICMP checksum over every inner byte changed
//! (and, for ICMPv6, its pseudo-header's outer destination); the inner IPv4 header's.

use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, TC_ACT_OK},
    helpers::generated::bpf_csum_diff,
    programs::TcContext,
};
use proxy_common::{proto, Ct4Key, Ct6Key, Reason};

use crate::maps::{ct4_get, ct6_get};

const ETH_HLEN: usize = 14;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;

/// IPv4: `Some(Ok(verdict))` when the packet was an ICMP error about one of our flows,
/// translated; `Some(Err(_))` when its rewrite failed half-way (the caller drops it);
/// `None`: not ours. The caller counts the outcome.
#[inline(never)]
pub fn icmp4(ctx: &TcContext) -> Option<Result<i32, Reason>> {
    let vihl: u8 = ctx.load(ETH_HLEN).ok()?;
    if ctx.load::<u8>(ETH_HLEN + 9).ok()? != IPPROTO_ICMP {
        return None;
    }
    let icmp = ETH_HLEN + usize::from(vihl & 0x0f) * 4;
    let kind: u8 = ctx.load(icmp).ok()?;
    // Destination unreachable (incl. fragmentation needed), time exceeded.
    if kind != 3 && kind != 11 {
        return None;
    }
    let inner = icmp + 8;
    let ivihl: u8 = ctx.load(inner).ok()?;
    let iproto: u8 = ctx.load(inner + 9).ok()?;
    if iproto != proto::TCP && iproto != proto::UDP {
        return None;
    }
    let il4 = inner + usize::from(ivihl & 0x0f) * 4;
    let isrc: u32 = ctx.load(inner + 12).ok()?;
    let idst: u32 = ctx.load(inner + 16).ok()?;
    let isport: u16 = ctx.load(il4).ok()?;
    let idport: u16 = ctx.load(il4 + 2).ok()?;

    // Inner reversed = the tuple the peer of the inner packet sends on.
    let (new_src, new_dst, outer_to) =
        if let Some(v) = ct4_get(&Ct4Key::new(idst, isrc, idport, isport, iproto, 0)) {
            // SAFETY: copied out of a live entry.
            let v = unsafe { *v };
            // An error about our reply: for the backend.
            let dst = if v.snat_addr != 0 {
                (v.snat_addr, v.snat_port)
            } else {
                (idst, idport)
            };
            ((v.dnat_addr, v.dnat_port), dst, v.dnat_addr)
        } else if let Some(v) = ct4_get(&Ct4Key::new(idst, isrc, idport, isport, iproto, 1)) {
            // SAFETY: copied out of a live entry.
            let v = unsafe { *v };
            if v.dnat_addr == 0 {
                return None;
            }
            // An error about a packet we SNATed: for the client.
            (
                (v.dnat_addr, v.dnat_port),
                (v.snat_addr, v.snat_port),
                v.dnat_addr,
            )
        } else {
            return None;
        };
    let icsum = icmp + 2;
    let odst: u32 = ctx.load(ETH_HLEN + 16).ok()?;
    let done = (|| {
        rewrite_inner4(ctx, inner, icsum, 12, isrc, new_src.0)?;
        rewrite_inner4(ctx, inner, icsum, 16, idst, new_dst.0)?;
        port(ctx, icsum, il4, isport, new_src.1)?;
        port(ctx, icsum, il4 + 2, idport, new_dst.1)?;
        ctx.l3_csum_replace(ETH_HLEN + 10, u64::from(odst), u64::from(outer_to), 4)
            .ok()?;
        ctx.store(ETH_HLEN + 16, &outer_to, 0).ok()
    })();
    Some(
        done.map(|()| TC_ACT_OK as i32)
            .ok_or(Reason::TcRewriteFailed),
    )
}

/// Changes one inner IPv4 address, keeping the inner header checksum and the ICMP
/// checksum (which covers both) right.
#[inline(always)]
fn rewrite_inner4(
    ctx: &TcContext,
    inner: usize,
    icsum: usize,
    off: usize,
    old: u32,
    new: u32,
) -> Option<()> {
    if old == new {
        return Some(());
    }
    let c_old: u16 = ctx.load(inner + 10).ok()?;
    ctx.l3_csum_replace(inner + 10, u64::from(old), u64::from(new), 4)
        .ok()?;
    let c_new: u16 = ctx.load(inner + 10).ok()?;
    ctx.l4_csum_replace(icsum, u64::from(old), u64::from(new), 4)
        .ok()?;
    ctx.l4_csum_replace(icsum, u64::from(c_old), u64::from(c_new), 2)
        .ok()?;
    ctx.store(inner + off, &new, 0).ok()
}

/// Changes one inner port, keeping the ICMP checksum right.
#[inline(always)]
fn port(ctx: &TcContext, icsum: usize, off: usize, old: u16, new: u16) -> Option<()> {
    if old == new {
        return Some(());
    }
    ctx.l4_csum_replace(icsum, u64::from(old), u64::from(new), 2)
        .ok()?;
    ctx.store(off, &new, 0).ok()
}

/// IPv6 (ICMPv6 right after the fixed header): destination unreachable, packet too big,
/// time exceeded.
/// Same contract as [`icmp4`].
#[inline(never)]
pub fn icmp6(ctx: &TcContext) -> Option<Result<i32, Reason>> {
    if ctx.load::<u8>(ETH_HLEN + 6).ok()? != IPPROTO_ICMPV6 {
        return None;
    }
    let icmp = ETH_HLEN + 40;
    let kind: u8 = ctx.load(icmp).ok()?;
    if !(1..=3).contains(&kind) {
        return None;
    }
    let inner = icmp + 8;
    let iproto: u8 = ctx.load(inner + 6).ok()?;
    if iproto != proto::TCP && iproto != proto::UDP {
        return None;
    }
    let il4 = inner + 40;
    let isrc: [u32; 4] = ctx.load(inner + 8).ok()?;
    let idst: [u32; 4] = ctx.load(inner + 24).ok()?;
    let isport: u16 = ctx.load(il4).ok()?;
    let idport: u16 = ctx.load(il4 + 2).ok()?;
    let (new_src, new_dst, outer_to) =
        if let Some(v) = ct6_get(&Ct6Key::new(idst, isrc, idport, isport, iproto, 0)) {
            // SAFETY: copied out of a live entry.
            let v = unsafe { *v };
            let dst = if !zero6(&v.snat_addr) {
                (v.snat_addr, v.snat_port)
            } else {
                (idst, idport)
            };
            ((v.dnat_addr, v.dnat_port), dst, v.dnat_addr)
        } else if let Some(v) = ct6_get(&Ct6Key::new(idst, isrc, idport, isport, iproto, 1)) {
            // SAFETY: copied out of a live entry.
            let v = unsafe { *v };
            if zero6(&v.dnat_addr) {
                return None;
            }
            (
                (v.dnat_addr, v.dnat_port),
                (v.snat_addr, v.snat_port),
                v.dnat_addr,
            )
        } else {
            return None;
        };
    let icsum = icmp + 2;
    let odst: [u32; 4] = ctx.load(ETH_HLEN + 24).ok()?;
    let done = (|| {
        addr6(ctx, icsum, inner + 8, isrc, new_src.0, 0)?;
        addr6(ctx, icsum, inner + 24, idst, new_dst.0, 0)?;
        port(ctx, icsum, il4, isport, new_src.1)?;
        port(ctx, icsum, il4 + 2, idport, new_dst.1)?;
        addr6(
            ctx,
            icsum,
            ETH_HLEN + 24,
            odst,
            outer_to,
            u64::from(BPF_F_PSEUDO_HDR),
        )
    })();
    Some(
        done.map(|()| TC_ACT_OK as i32)
            .ok_or(Reason::TcRewriteFailed),
    )
}

fn zero6(a: &[u32; 4]) -> bool {
    (a[0] | a[1] | a[2] | a[3]) == 0
}

/// Changes 16 address bytes at `off`, folding the difference into the ICMPv6 checksum
/// (`BPF_F_PSEUDO_HDR` for the outer destination, which its pseudo-header covers).
#[inline(always)]
fn addr6(
    ctx: &TcContext,
    icsum: usize,
    off: usize,
    old: [u32; 4],
    new: [u32; 4],
    flags: u64,
) -> Option<()> {
    if zero6(&[
        old[0] ^ new[0],
        old[1] ^ new[1],
        old[2] ^ new[2],
        old[3] ^ new[3],
    ]) {
        return Some(());
    }
    let mut from = old;
    let mut to = new;
    // SAFETY: two 16-byte stack buffers.
    let diff = unsafe { bpf_csum_diff(from.as_mut_ptr(), 16, to.as_mut_ptr(), 16, 0) };
    if diff < 0 {
        return None;
    }
    ctx.l4_csum_replace(icsum, 0, diff as u64, flags).ok()?;
    ctx.store(off, &new, 0).ok()
}
