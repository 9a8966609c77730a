//! Packet rewriting (DNAT/SNAT and their reverse, checksums updated incrementally) and
//! forwarding by FIB lookup. `rewrite` works over any [`PktAccess`] context; the FIB
//! redirect is TC's.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK,
    },
    helpers::generated::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
    EbpfContext,
};
use proxy_common::Reason;

use super::family::{csum_add, Pkt, PktAccess, PktFamily, ETH_HLEN};
use crate::maps::{count, FIB};

/// Rewrites a packet: destination := `dnat`, source := `snat` (zero addresses: leave
/// that end alone), ports included. A failure may leave the packet half-rewritten: the
/// caller drops it.
// Not inlined: each path would otherwise carry two copies of its address buffers.
#[inline(never)]
pub fn rewrite<F: PktFamily, C: PktAccess>(
    ctx: &C,
    p: &Pkt<F::Addr>,
    nat: &((F::Addr, u16), (F::Addr, u16)),
) -> Result<(), Reason> {
    if C::DIRECT {
        return rewrite_direct::<F, C>(ctx, p, nat);
    }
    let (dnat, snat) = *nat;
    let fail = |()| Reason::TcRewriteFailed;
    if !F::is_zero(&dnat.0) {
        F::set_addr(ctx, p, false, p.daddr, dnat.0).map_err(fail)?;
        if dnat.1 != p.dport {
            ctx.l4_csum_replace(
                p.csum_off(),
                u64::from(p.dport),
                u64::from(dnat.1),
                2 | p.l4_flags(),
            )
            .map_err(fail)?;
            ctx.store(p.l4 + 2, &dnat.1).map_err(fail)?;
        }
    }
    if !F::is_zero(&snat.0) {
        F::set_addr(ctx, p, true, p.saddr, snat.0).map_err(fail)?;
        if snat.1 != p.sport {
            ctx.l4_csum_replace(
                p.csum_off(),
                u64::from(p.sport),
                u64::from(snat.1),
                2 | p.l4_flags(),
            )
            .map_err(fail)?;
            ctx.store(p.l4, &snat.1).map_err(fail)?;
        }
    }
    Ok(())
}

/// [`rewrite`] where the program computes the checksums (`PktAccess::DIRECT`, XDP): the
/// changes are summed first (the addresses count in the IPv4 header and in the L4
/// pseudo-header, the ports in L4), then each checksum is updated once and the fields
/// stored: two checksum updates and up to four stores, where field by field took six
/// updates.
#[inline(always)]
fn rewrite_direct<F: PktFamily, C: PktAccess>(
    ctx: &C,
    p: &Pkt<F::Addr>,
    nat: &((F::Addr, u16), (F::Addr, u16)),
) -> Result<(), Reason> {
    let (dnat, snat) = *nat;
    let fail = |()| Reason::TcRewriteFailed;
    let port = |old: u16, new: u16| csum_add(u32::from(!old), u32::from(new));
    let (new_dst, new_src) = (!F::is_zero(&dnat.0), !F::is_zero(&snat.0));
    if !new_dst && !new_src {
        return Ok(());
    }
    let mut l3 = 0u32;
    let mut l4 = 0u32;
    if new_dst {
        l3 = F::addr_delta(p.daddr, dnat.0);
        if dnat.1 != p.dport {
            l4 = port(p.dport, dnat.1);
        }
    }
    if new_src {
        l3 = csum_add(l3, F::addr_delta(p.saddr, snat.0));
        if snat.1 != p.sport {
            l4 = csum_add(l4, port(p.sport, snat.1));
        }
    }
    // Size 0: the sum folded in as it is (what `bpf_csum_diff` would return).
    ctx.l4_csum_replace(p.csum_off(), 0, u64::from(csum_add(l4, l3)), p.l4_flags())
        .map_err(fail)?;
    if !F::V6 {
        ctx.l3_csum_replace(ETH_HLEN + 10, 0, u64::from(l3), 0)
            .map_err(fail)?;
    }
    if new_dst {
        ctx.store(F::addr_off(false), &dnat.0).map_err(fail)?;
        if dnat.1 != p.dport {
            ctx.store(p.l4 + 2, &dnat.1).map_err(fail)?;
        }
    }
    if new_src {
        ctx.store(F::addr_off(true), &snat.0).map_err(fail)?;
        if snat.1 != p.sport {
            ctx.store(p.l4, &snat.1).map_err(fail)?;
        }
    }
    Ok(())
}

// `fib_params` clears the argument as sixteen aligned 4-byte words.
const _: () =
    assert!(core::mem::size_of::<FibParams>() == 64 && core::mem::align_of::<FibParams>() == 4);

/// This CPU's `bpf_fib_lookup` argument (`maps::FIB`), all zero. Cleared with sixteen
/// 4-byte stores: a zeroed struct on the stack (`mem::zeroed()`) compiled to a call of
/// the BPF target's byte-at-a-time `memset`, a 64-iteration loop per packet and the
/// largest single item of the XDP program's profile. Volatile, so LLVM does not fold the
/// stores back into that call.
#[inline(always)]
pub fn fib_params() -> Option<*mut FibParams> {
    let p = FIB.get_ptr_mut(0)?;
    // SAFETY: this CPU's entry (a program is not preempted on its CPU); sixteen aligned
    // words inside its 64 bytes; all-zero bytes are a valid `bpf_fib_lookup`.
    unsafe {
        let params = &raw mut (*p).params;
        let w = params as *mut u32;
        macro_rules! clear {
            ($($i:literal)*) => { $(w.add($i).write_volatile(0);)* };
        }
        clear!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        Some(params)
    }
}

/// Forwards a packet by FIB lookup and redirect (needed when its source is now one of
/// the node's addresses: the stack would drop it as a martian). Falls back to the stack,
/// counting `tc_fib_miss` (in addition to the packet's outcome, which its path chose).
// Separate BPF functions keep each frame under the verifier's 512-byte stack limit
// ("Looks like the BPF stack limit is exceeded" when everything is inlined).
#[inline(never)]
pub fn fib_redirect<F: PktFamily>(ctx: &TcContext, src: F::Addr, dst: F::Addr, proto: u8) -> i32 {
    let Some(params) = fib_params() else {
        return TC_ACT_OK as i32;
    };
    // SAFETY: this CPU's entry, cleared above.
    let params = unsafe { &mut *params };
    params.family = F::FAMILY;
    params.l4_protocol = proto;
    // SAFETY: the context's skb.
    params.ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
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
    if ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        if ctx.store(0, &params.dmac, 0).is_err() || ctx.store(6, &params.smac, 0).is_err() {
            return TC_ACT_OK as i32;
        }
        // SAFETY: plain helper.
        return unsafe { bpf_redirect(params.ifindex, 0) } as i32;
    }
    if ret == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        // SAFETY: the kernel resolves the neighbour itself.
        return unsafe { bpf_redirect_neigh(params.ifindex, core::ptr::null_mut(), 0, 0) } as i32;
    }
    count(Reason::TcFibMiss);
    TC_ACT_OK as i32
}
