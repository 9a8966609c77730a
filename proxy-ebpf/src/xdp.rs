//! The north-south datapath at XDP (`--acceleration native|generic`), on the same node
//! interfaces as TC and ahead of it: NodePort, externalIP and LoadBalancer frontends
//! reached from outside the node, and the replies of their flows coming back from remote
//! backends.
//!
//! It runs the shared stage machine (`pkt::stages::flow`: reply, known flow, new flow; the one
//! frontend lookup, backend choice, conntrack and NAT), through [`PktHook`] for the XDP
//! context: direct packet access with bounds checks, incremental checksums computed in
//! the program (XDP has no checksum helpers), forwarding by `bpf_fib_lookup` then
//! `XDP_TX` (out of the interface it came in on) or `bpf_redirect` (`XDP_REDIRECT`).
//!
//! Whatever XDP cannot do is left untouched to the stack, where TC handles it whole
//! (counted `xdp_to_stack`): IP fragments, ICMP errors (TC translates those about NATed
//! flows), a frontend without endpoints (TC builds the REJECT answer), and a packet to
//! be forwarded whose FIB lookup does not give a neighbour XDP can send to (no neighbour
//! entry yet: TC's `bpf_redirect_neigh` resolves it). The FIB is asked before the packet
//! or its flow is changed, so a packet handed on is handed on untouched. A translated
//! packet that needs no forwarding (DNAT to a backend on this node, no SNAT) is passed to
//! the stack already translated, which routes it to the pod; TC ingress then finds
//! neither a flow nor a frontend in it and lets it be. Replies of local backends leave
//! through TC egress as before (XDP is ingress only). Both hooks share the conntrack
//! tables, so a flow can start at one and continue at the other.
//!
//! Outcomes are counted in `XDP_STATS` (the same `Reason`s as `STATS`).

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, xdp_action, BPF_FIB_LKUP_RET_SUCCESS, BPF_F_MARK_MANGLED_0,
    },
    helpers::generated::{bpf_fib_lookup, bpf_redirect},
    macros::xdp,
    programs::XdpContext,
    EbpfContext,
};
use proxy_common::Reason;

use crate::{
    events,
    lb::{V4, V6},
    maps::{count_xdp, FIB},
    pkt::{
        family::{csum_add, Pkt, PktAccess, PktFamily, ETH_P_IP, ETH_P_IPV6},
        hook::PktHook,
        nat::fib_params,
        stages::{flow, report},
        state::FibHop,
        verdict::{Step, Verdict},
    },
    tc::dsr,
};

const ETH_HLEN: usize = 14;
/// The deepest byte the stage machine touches is in the first L4 header after at most
/// 60 bytes of IPv4 header: a bound on every offset, which the verifier needs to accept
/// an offset read from a map (the parsed packet lives in per-CPU scratch).
const MAX_OFF: usize = 256;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_ICMPV6: u8 = 58;

#[xdp]
pub fn xdp_ingress(ctx: XdpContext) -> u32 {
    match try_xdp(&ctx) {
        Ok(v) => {
            if let Some(r) = v.reason {
                count_xdp(r);
            }
            v.code as u32
        }
        Err(r) => {
            count_xdp(r);
            xdp_action::XDP_DROP
        }
    }
}

#[inline(always)]
fn try_xdp(ctx: &XdpContext) -> Result<Verdict, Reason> {
    let Ok(eth_proto) = PktAccess::load::<u16>(ctx, 12) else {
        return Ok(Verdict::not_ours(XdpContext::PASS));
    };
    match u16::from_be(eth_proto) {
        ETH_P_IP => {
            if for_tc4(ctx) {
                return Ok(Verdict::new(XdpContext::PASS, Reason::XdpToStack));
            }
            let r = flow::<XdpContext, V4>(ctx, true);
            if events::on() {
                report::<XdpContext, V4>(&r, true);
            }
            r
        }
        ETH_P_IPV6 => {
            if for_tc6(ctx) {
                return Ok(Verdict::new(XdpContext::PASS, Reason::XdpToStack));
            }
            let r = flow::<XdpContext, V6>(ctx, true);
            if events::on() {
                report::<XdpContext, V6>(&r, true);
            }
            r
        }
        _ => Ok(Verdict::not_ours(XdpContext::PASS)),
    }
}

/// An IPv4 fragment or ICMP error: TC's.
#[inline(never)]
fn for_tc4(ctx: &XdpContext) -> bool {
    let Ok(vihl) = ctx.load::<u8>(ETH_HLEN) else {
        return false;
    };
    if vihl >> 4 != 4 {
        return false;
    }
    let Ok(frags) = ctx.load::<u16>(ETH_HLEN + 6) else {
        return false;
    };
    if u16::from_be(frags) & 0x3fff != 0 {
        return true;
    }
    if ctx.load::<u8>(ETH_HLEN + 9) != Ok(IPPROTO_ICMP) {
        return false;
    }
    let icmp = ETH_HLEN + usize::from(vihl & 0x0f) * 4;
    // Destination unreachable (fragmentation needed included), time exceeded.
    matches!(ctx.load::<u8>(icmp), Ok(3 | 11))
}

/// An IPv6 fragment or ICMPv6 error: TC's.
#[inline(never)]
fn for_tc6(ctx: &XdpContext) -> bool {
    match ctx.load::<u8>(ETH_HLEN + 6) {
        Ok(IPPROTO_FRAGMENT) => true,
        // Destination unreachable, packet too big, time exceeded.
        Ok(IPPROTO_ICMPV6) => matches!(ctx.load::<u8>(ETH_HLEN + 40), Ok(1..=3)),
        _ => false,
    }
}

/// The address of `size_of::<T>()` bytes at `off` in the packet, bounds-checked.
#[inline(always)]
fn at<T>(ctx: &XdpContext, off: usize) -> Result<*mut T, ()> {
    if off > MAX_OFF {
        return Err(());
    }
    // Volatile reads of the context fields in every function that uses them: LLVM would
    // otherwise pass the loaded (zero-extended) values into a non-inlined callee, which
    // the verifier refuses ("pointer arithmetic on pkt_end prohibited").
    // SAFETY: the program's context.
    let (start, end) = unsafe {
        (
            core::ptr::read_volatile(&raw const (*ctx.ctx).data) as usize,
            core::ptr::read_volatile(&raw const (*ctx.ctx).data_end) as usize,
        )
    };
    // At least 2 bytes checked: for a 1-byte read LLVM turns `p + 1 > end` into
    // `p >= end`, from which the verifier derives no readable range. Every byte read
    // alone is inside a header, never a packet's last.
    let need = if core::mem::size_of::<T>() < 2 {
        2
    } else {
        core::mem::size_of::<T>()
    };
    if start + off + need > end {
        return Err(());
    }
    Ok((start + off) as *mut T)
}

#[inline(always)]
fn fold(mut s: u32) -> u16 {
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// RFC 1624 incremental update of the checksum `old`: `from` replaced by `to` (`size` 4
/// or 2 bytes), or, with `size` 0, the 32-bit difference `to` folded in (what
/// `bpf_csum_diff` returns), as the kernel's `l3/l4_csum_replace` do. The values are in
/// the packet's byte order, which one's-complement sums do not depend on.
#[inline(always)]
fn replaced(old: u16, from: u64, to: u64, size: u64) -> u16 {
    let mut s = u32::from(!old);
    match size {
        4 => {
            s = csum_add(s, !(from as u32));
            s = csum_add(s, to as u32);
        }
        2 => {
            s = csum_add(s, u32::from(!(from as u16)));
            s = csum_add(s, u32::from(to as u16));
        }
        _ => s = csum_add(s, to as u32),
    }
    !fold(s)
}

impl PktAccess for XdpContext {
    const DIRECT: bool = true;

    #[inline(always)]
    fn load<T>(&self, off: usize) -> Result<T, ()> {
        let p = at::<T>(self, off)?;
        // SAFETY: in bounds (checked); packet bytes may be unaligned.
        Ok(unsafe { core::ptr::read_unaligned(p) })
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T) -> Result<(), ()> {
        let p = at::<T>(self, off)?;
        // A non-overlapping copy (a map value or the stack into the packet): LLVM expands
        // it into loads and stores. `write_unaligned(p, read(v))` became a call of the
        // BPF target's byte-at-a-time `memmove` for the 12 bytes of MAC addresses.
        // SAFETY: in bounds (checked); XDP packet data is writable and `v` is not in it.
        unsafe {
            core::ptr::copy_nonoverlapping(
                (v as *const T).cast::<u8>(),
                p.cast::<u8>(),
                core::mem::size_of::<T>(),
            )
        };
        Ok(())
    }

    #[inline(always)]
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, size: u64) -> Result<(), ()> {
        let p = at::<u16>(self, off)?;
        // SAFETY: in bounds (checked).
        unsafe {
            let old = core::ptr::read_unaligned(p);
            core::ptr::write_unaligned(p, replaced(old, from, to, size));
        }
        Ok(())
    }

    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), ()> {
        let p = at::<u16>(self, off)?;
        let mangled_0 = flags & u64::from(BPF_F_MARK_MANGLED_0) != 0;
        // SAFETY: in bounds (checked).
        unsafe {
            let old = core::ptr::read_unaligned(p);
            // UDP over IPv4 without a checksum keeps none.
            if mangled_0 && old == 0 {
                return Ok(());
            }
            let mut new = replaced(old, from, to, flags & 0xf);
            if mangled_0 && new == 0 {
                new = 0xffff;
            }
            core::ptr::write_unaligned(p, new);
        }
        Ok(())
    }
}

impl PktHook for XdpContext {
    const PASS: i32 = xdp_action::XDP_PASS as i32;
    const DROP: i32 = xdp_action::XDP_DROP as i32;
    const EVENT_HOOK: u8 = proxy_common::event::event_hook::XDP;

    #[inline(always)]
    fn count(r: Reason) {
        count_xdp(r);
    }

    #[inline(always)]
    fn can_forward<F: PktFamily>(&self, src: F::Addr, dst: F::Addr, proto: u8, now: u64) -> bool {
        fib_check::<F>(self, src, dst, proto, now)
    }

    #[inline(always)]
    fn forward<F: PktFamily>(&self, _src: F::Addr, _dst: F::Addr, _proto: u8) -> i32 {
        send(self)
    }

    /// TC answers (it can resize the packet and has its rate limit).
    #[inline(always)]
    fn reject<F: PktFamily>(&self, _p: &Pkt<F::Addr>) -> Option<i32> {
        None
    }

    /// Not plain TCP/UDP (a DSR packet among them): TC's.
    #[inline(always)]
    fn unparsed<F: PktFamily>(&self, _ingress: bool) -> Result<Verdict, Reason> {
        Ok(Verdict::not_ours(Self::PASS))
    }

    /// An IPv4 DSR option without the outer header is TC's to count.
    #[inline(always)]
    fn parsed<F: PktFamily>(&self, _p: &Pkt<F::Addr>) {}

    /// DSR's option changes the packet's length: TC adds and removes it.
    #[inline(always)]
    fn carries_dsr(&self) -> bool {
        false
    }

    /// A new flow the forwarding mode would send by DSR is handed on to TC untouched.
    #[inline(always)]
    fn dsr_wanted<F: PktFamily>(&self, p: &Pkt<F::Addr>, _backend: F::Addr) -> Option<bool> {
        if dsr::asked::<F>(p) {
            None
        } else {
            Some(false)
        }
    }

    /// Never asked ([`Self::dsr_wanted`] never says yes here); would hand the packet on.
    #[inline(always)]
    fn dsr_first<F: PktFamily>(
        &self,
        _p: &Pkt<F::Addr>,
        _backend: F::Addr,
    ) -> Result<Step<F::Addr>, Reason> {
        Ok(Step::to_next_hook())
    }

    /// Never asked: a DSR flow's packets are handed on before ([`Self::carries_dsr`]).
    #[inline(always)]
    fn dsr_again<F: PktFamily>(
        &self,
        _p: &Pkt<F::Addr>,
        _backend: F::Addr,
    ) -> Result<Option<Step<F::Addr>>, Reason> {
        Ok(Some(Step::to_next_hook()))
    }
}

/// How long a FIB answer is reused for packets with the same interface, source and
/// destination (`FIB_HOP4/6`): a route or neighbour change (a MAC address replaced, a
/// route removed) is followed within this time, as the kernel's own neighbour entries
/// are trusted for seconds. The conntrack clock ticks with the kernel's (a few ms).
///
/// A global in `.rodata` rather than a constant so that a test can load the object with
/// another value (`EbpfLoader::override_global`, `loader::load_object_with`) and check the cache
/// without racing the clock; the agent never sets it (100 ms).
#[no_mangle]
static FIB_HOP_TTL_NS: u64 = 100_000_000;

/// [`FIB_HOP_TTL_NS`], read from the map the loader filled (not folded at compile time).
#[inline(always)]
fn fib_hop_ttl_ns() -> u64 {
    // SAFETY: a plain read of a static.
    unsafe { core::ptr::read_volatile(&raw const FIB_HOP_TTL_NS) }
}

/// FIB lookup for a packet from `src` to `dst` arriving on this interface; on success
/// the egress interface and MAC addresses stay in this CPU's `FIB` entry for [`send`].
/// False for anything else (no neighbour entry, no route, local delivery, forwarding
/// disabled): the caller hands the packet to TC untouched. A success is cached for
/// [`FIB_HOP_TTL_NS`] (failures are not: the next packet asks again).
#[inline(never)]
fn fib_check<F: PktFamily>(
    ctx: &XdpContext,
    src: F::Addr,
    dst: F::Addr,
    proto: u8,
    now: u64,
) -> bool {
    let ifindex = ctx.ingress_ifindex() as u32;
    if let Some(hop) = F::fib_hop(ifindex, src, dst) {
        // SAFETY: this CPU's value of a live entry.
        let hop = unsafe { &*hop };
        if now.wrapping_sub(hop.stamp) < fib_hop_ttl_ns() {
            let Some(fib) = FIB.get_ptr_mut(0) else {
                return false;
            };
            // SAFETY: this CPU's entry; `send` reads only these three fields.
            unsafe {
                (*fib).params.ifindex = hop.ifindex;
                copy_mac(&raw mut (*fib).params.smac, &hop.smac);
                copy_mac(&raw mut (*fib).params.dmac, &hop.dmac);
            }
            return true;
        }
    }
    let Some(params) = fib_params() else {
        return false;
    };
    // SAFETY: this CPU's entry, cleared by `fib_params`.
    let params = unsafe { &mut *params };
    params.family = F::FAMILY;
    params.l4_protocol = proto;
    params.ifindex = ifindex;
    F::fib_set(params, src, dst);
    // SAFETY: valid ctx and params.
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            params as *mut FibParams,
            core::mem::size_of::<FibParams>() as i32,
            0,
        )
    };
    if ret != i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        return false;
    }
    let mut hop = FibHop {
        stamp: now,
        ifindex: params.ifindex,
        smac: [0; 6],
        dmac: [0; 6],
    };
    // SAFETY: 6-byte arrays, both 2-byte aligned.
    unsafe {
        copy_mac(&raw mut hop.smac, &params.smac);
        copy_mac(&raw mut hop.dmac, &params.dmac);
    }
    F::fib_hop_put(ifindex, src, dst, &hop);
    true
}

/// Copies a MAC address as three 16-bit words: an array assignment compiles, on the BPF
/// target, to a call of the byte-at-a-time `memmove` it links in
/// (`loader::object::tests::no_byte_loop_calls_on_the_known_flow_path`).
///
/// # Safety
/// Both point to 6 valid bytes aligned to 2 (MAC fields of `bpf_fib_lookup` and
/// `FibHop`).
#[inline(always)]
unsafe fn copy_mac(dst: *mut [u8; 6], src: *const [u8; 6]) {
    let (d, s) = (dst.cast::<u16>(), src.cast::<u16>());
    for i in 0..3 {
        // SAFETY: as the caller promises; volatile so that LLVM keeps three word copies.
        unsafe { d.add(i).write_volatile(s.add(i).read_volatile()) };
    }
}

/// Sends the translated packet where [`fib_check`] found: `XDP_TX` back out of the
/// interface it came in on, `XDP_REDIRECT` to another.
#[inline(never)]
fn send(ctx: &XdpContext) -> i32 {
    let Some(fib) = FIB.get_ptr(0) else {
        return xdp_action::XDP_DROP as i32;
    };
    // SAFETY: this CPU's entry, written by `fib_check` for this packet.
    let params = unsafe { &(*fib).params };
    if ctx.store(0, &params.dmac).is_err() || ctx.store(6, &params.smac).is_err() {
        return xdp_action::XDP_DROP as i32;
    }
    if params.ifindex as usize == ctx.ingress_ifindex() {
        return xdp_action::XDP_TX as i32;
    }
    // SAFETY: plain helper.
    unsafe { bpf_redirect(params.ifindex, 0) as i32 }
}
