//! kube-proxy's `REJECT` for a frontend without endpoints, built in place at TC ingress:
//! a TCP SYN is answered with a RST (`tcp_rst`), a UDP datagram with an ICMP port
//! unreachable (`udp4`/`udp6`, `icmp-port-unreachable`).
//!
//! The datagram is turned into the error and sent back out of the interface it came in
//! on, MAC addresses swapped: a new IP header from the frontend to the client, the ICMP
//! header (IPv4: type 3 code 3; IPv6: type 1 code 4), then the quoted start of the
//! datagram (its IP header and the 8-byte UDP header, which is all the client's stack
//! needs to find the socket and report `ECONNREFUSED`). The packet is resized with
//! `bpf_skb_change_tail`; every checksum is computed whole with `bpf_csum_diff`.
//!
//! At most 1,000 errors a second per CPU after a burst of 50, the kernel's defaults for
//! the ICMP errors it sends itself; beyond that the datagram is dropped
//! (`tc_reject_limited`).
//!
//! IPv4 datagrams with IP options are dropped instead (the quote would not fit the fixed
//! layout), as are datagrams the kernel will not resize (GSO). The caller has counted
//! the packet (`TcNoBackend`).

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    helpers::{
        bpf_ktime_get_ns,
        generated::{bpf_csum_diff, bpf_redirect, bpf_skb_change_tail},
    },
    programs::TcContext,
};
use proxy_common::Reason;

use crate::{
    maps::{count, UNREACH_BUCKET},
    pkt::family::{Pkt, PktFamily},
};

/// Answers the UDP datagram at `ctx` with an ICMP (v4) or ICMPv6 port unreachable.
#[inline(always)]
pub fn udp<F: PktFamily>(ctx: &TcContext) -> i32 {
    if F::V6 {
        udp6(ctx)
    } else {
        udp4(ctx)
    }
}
const ETH_HLEN: usize = 14;
const TTL: u8 = 64;

/// IPv4 header, ICMP header, quoted IPv4 header and UDP header.
const V4_LEN: usize = 20 + 8 + 20 + 8;
/// IPv6 header, ICMPv6 header, quoted IPv6 header and UDP header.
const V6_LEN: usize = 40 + 8 + 40 + 8;

#[repr(C, align(4))]
struct Buf<const N: usize>([u8; N]);

/// One's-complement sum of `len` bytes at `p` (a multiple of 4) added to `seed`.
#[inline(always)]
fn sum(p: *const u8, len: u32, seed: u32) -> Option<u32> {
    // SAFETY: `p` points at `len` readable bytes on the stack (the helper only reads).
    let r = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, p as *mut u32, len, seed) };
    if r < 0 {
        None
    } else {
        Some(r as u32)
    }
}

/// Folds a 32-bit sum into the 16-bit checksum, to be stored as is (byte order kept).
#[inline(always)]
fn fold(s: u32) -> [u8; 2] {
    let mut s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    (!(s as u16)).to_ne_bytes()
}

/// The kernel's own limits for the ICMP errors it sends (`net.ipv4.icmp_msgs_per_sec`,
/// `icmp_msgs_burst`), here per CPU: a flood of datagrams with forged sources to a
/// frontend without endpoints is not answered at line rate.
const RATE_PER_S: u64 = 1000;
const BURST: u64 = 50;
/// Credit one error costs, in nanoseconds of refill.
const COST_NS: u64 = 1_000_000_000 / RATE_PER_S;

/// Takes one error's worth of credit, or counts the refusal. Called before `udp4`/`udp6`
/// (not from them: their frames are large, and the verifier counts the whole call chain's
/// stack).
#[inline(never)]
pub fn allowed() -> bool {
    let Some(b) = UNREACH_BUCKET.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: this CPU's entry; the program is not preempted on its CPU.
    let b = unsafe { &mut *b };
    let refill = if b.last_ns == 0 {
        BURST * COST_NS
    } else {
        now.saturating_sub(b.last_ns)
    };
    b.last_ns = now;
    b.credit_ns = (b.credit_ns + refill).min(BURST * COST_NS);
    if b.credit_ns < COST_NS {
        count(Reason::TcRejectLimited);
        return false;
    }
    b.credit_ns -= COST_NS;
    true
}

/// Sends a packet rewritten into an answer back to its sender: swaps the Ethernet
/// addresses and redirects it to the egress of the interface it arrived on. Shared by
/// the TCP RST and the ICMP errors.
#[inline(always)]
pub fn bounce(ctx: &TcContext) -> i32 {
    let Ok(macs) = ctx.load::<[u8; 12]>(0) else {
        return TC_ACT_SHOT as i32;
    };
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    if ctx.store(0, &swapped, 0).is_err() {
        return TC_ACT_SHOT as i32;
    }
    // SAFETY: the context's skb; redirect to its own interface's egress.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper.
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}

/// Resizes the packet to `len`, writes `frame` after the Ethernet header and sends it back.
#[inline(always)]
fn send_back<T>(ctx: &TcContext, frame: &T, len: usize) -> i32 {
    // SAFETY: the context's own skb.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, len as u32, 0) } != 0 {
        return TC_ACT_SHOT as i32;
    }
    if ctx.store(ETH_HLEN, frame, 0).is_err() {
        return TC_ACT_SHOT as i32;
    }
    bounce(ctx)
}

/// IPv4: the datagram at `ctx` becomes an ICMP port unreachable back to its sender.
#[inline(never)]
pub fn udp4(ctx: &TcContext) -> i32 {
    let Ok(quote) = ctx.load::<[u8; 28]>(ETH_HLEN) else {
        return TC_ACT_SHOT as i32;
    };
    if quote[0] != 0x45 {
        return TC_ACT_SHOT as i32;
    }
    let mut b = Buf([0u8; V4_LEN]);
    let f = &mut b.0;
    f[0] = 0x45;
    f[2..4].copy_from_slice(&(V4_LEN as u16).to_be_bytes());
    f[8] = TTL;
    f[9] = 1; // ICMP
    f[12..16].copy_from_slice(&quote[16..20]);
    f[16..20].copy_from_slice(&quote[12..16]);
    f[20] = 3; // destination unreachable
    f[21] = 3; // port unreachable
    f[28..56].copy_from_slice(&quote);
    let (Some(ip), Some(icmp)) = (
        sum(f.as_ptr(), 20, 0),
        sum(f[20..].as_ptr(), (V4_LEN - 20) as u32, 0),
    ) else {
        return TC_ACT_SHOT as i32;
    };
    f[10..12].copy_from_slice(&fold(ip));
    f[22..24].copy_from_slice(&fold(icmp));
    send_back(ctx, &b, ETH_HLEN + V4_LEN)
}

/// IPv6: the datagram at `ctx` becomes an ICMPv6 port unreachable back to its sender.
#[inline(never)]
pub fn udp6(ctx: &TcContext) -> i32 {
    let Ok(quote) = ctx.load::<[u8; 48]>(ETH_HLEN) else {
        return TC_ACT_SHOT as i32;
    };
    let mut b = Buf([0u8; V6_LEN]);
    let f = &mut b.0;
    f[0] = 0x60;
    f[4..6].copy_from_slice(&((V6_LEN - 40) as u16).to_be_bytes());
    f[6] = 58; // ICMPv6
    f[7] = TTL;
    f[8..24].copy_from_slice(&quote[24..40]);
    f[24..40].copy_from_slice(&quote[8..24]);
    f[40] = 1; // destination unreachable
    f[41] = 4; // port unreachable
    f[48..96].copy_from_slice(&quote);
    // Pseudo-header: both addresses, the upper-layer length and the next header.
    let mut rest = Buf([0u8; 8]);
    rest.0[2..4].copy_from_slice(&((V6_LEN - 40) as u16).to_be_bytes());
    rest.0[7] = 58;
    let Some(s) = sum(f[8..].as_ptr(), 32, 0)
        .and_then(|s| sum(rest.0.as_ptr(), 8, s))
        .and_then(|s| sum(f[40..].as_ptr(), (V6_LEN - 40) as u32, s))
    else {
        return TC_ACT_SHOT as i32;
    };
    f[42..44].copy_from_slice(&fold(s));
    send_back(ctx, &b, ETH_HLEN + V6_LEN)
}

const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// Answers a SYN to a frontend without endpoints with a RST (kube-proxy's REJECT), sent
/// back out of the interface it came in on: swap MACs, addresses and ports, RST|ACK with
/// ack = seq + 1.
#[inline(never)]
pub fn tcp_rst<F: PktFamily>(ctx: &TcContext, p: &Pkt<F::Addr>) -> i32 {
    let Ok(seq) = ctx.load::<u32>(p.l4 + 4) else {
        return TC_ACT_SHOT as i32;
    };
    let Ok(old_ack) = ctx.load::<u32>(p.l4 + 8) else {
        return TC_ACT_SHOT as i32;
    };
    let ack = (u32::from_be(seq).wrapping_add(1)).to_be();
    let Ok(old_word) = ctx.load::<u16>(p.l4 + 12) else {
        return TC_ACT_SHOT as i32;
    };
    // Keep the data offset, set flags to RST|ACK.
    let new_word = ((u16::from_be(old_word) & 0xff00) | u16::from(TCP_RST | TCP_ACK)).to_be();
    let csum = p.csum_off();
    // Addresses: swapping keeps the pseudo-header sum; store both.
    let ok = F::set_addr(ctx, p, true, p.saddr, p.daddr).is_ok()
        && F::set_addr(ctx, p, false, p.daddr, p.saddr).is_ok()
        && ctx.store(p.l4, &p.dport, 0).is_ok()
        && ctx.store(p.l4 + 2, &p.sport, 0).is_ok()
        && ctx.l4_csum_replace(csum, u64::from(seq), 0, 4).is_ok()
        && ctx.store(p.l4 + 4, &0u32, 0).is_ok()
        && ctx
            .l4_csum_replace(csum, u64::from(old_ack), u64::from(ack), 4)
            .is_ok()
        && ctx.store(p.l4 + 8, &ack, 0).is_ok()
        && ctx
            .l4_csum_replace(csum, u64::from(old_word), u64::from(new_word), 2)
            .is_ok()
        && ctx.store(p.l4 + 12, &new_word, 0).is_ok();
    if !ok {
        return TC_ACT_SHOT as i32;
    }
    bounce(ctx)
}
