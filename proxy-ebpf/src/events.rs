//! Datapath events for `proxyctl monitor` (`proxy_common::event`): a drop or a new
//! flow's translation, written to the `EVENTS` ring buffer while a monitor holds the
//! lease in `MONITOR[0]`. Off (no lease) costs a hook one array lookup and a branch
//! ([`on`]); everything else is in the `#[inline(never)]` emitters, reached only when on.

use aya_ebpf::{
    bindings::BPF_RB_NO_WAKEUP,
    helpers::{bpf_get_prandom_u32, generated::bpf_ktime_get_coarse_ns},
};
use core::{mem::size_of, ptr::write_volatile};
use proxy_common::{
    event::{event_kind, Event, EventTuple, MonitorCpu, LEASE_TICK_SLACK_NS},
    Reason,
};

use crate::{
    maps::{EVENTS, MONITOR, MONITOR_CPU},
    pkt::{
        family::PktFamily,
        state::{Chosen, Pkt},
    },
};

/// Whether a monitor holds a lease (maybe an expired one, which [`admit`] clears).
#[inline(always)]
pub fn on() -> bool {
    match MONITOR.get_ptr(0) {
        // SAFETY: the array's one entry.
        Some(c) => unsafe { (*c).lease_until_ns != 0 },
        None => false,
    }
}

/// `hook | kind << 8 | proto << 16 | reason << 24`: one register for the emitters.
#[inline(always)]
pub const fn meta(hook: u8, kind: u8, proto: u8, reason: Reason) -> u32 {
    hook as u32 | (kind as u32) << 8 | (proto as u32) << 16 | (reason as u32) << 24
}

/// The lease is fresh, the kind wanted, sampling and this CPU's token bucket let the
/// event through: this CPU's entry to count the event in, and the time. Counts what it
/// refuses.
///
/// The clock is CLOCK_MONOTONIC at the last tick (`bpf_ktime_get_coarse_ns`, a read of
/// the timekeeper's last update, not of the TSC), read once: the lease is seconds long
/// (and ended `LEASE_TICK_SLACK_NS` early, so never late),
/// the bucket's refill sums the same deltas either way, and it is the event's timestamp
/// (a tick early at most; the ring buffer keeps the order). Two `bpf_ktime_get_ns` calls
/// per event were about a third of an event's cost (docs/CHANGELOG.md, issue 28).
#[inline(always)]
fn admit(kind: u8) -> Option<(*mut MonitorCpu, u64)> {
    let ctl = MONITOR.get_ptr_mut(0)?;
    // SAFETY: the array's one entry; a field read.
    let lease = unsafe { (*ctl).lease_until_ns };
    if lease == 0 {
        return None;
    }
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    if now.saturating_add(LEASE_TICK_SLACK_NS) >= lease {
        // The monitor went away (exited or was killed): off for every hook until a
        // monitor writes a new lease (it rewrites it every second).
        // SAFETY: the array's entry.
        unsafe { write_volatile(&raw mut (*ctl).lease_until_ns, 0) };
        return None;
    }
    // SAFETY: the array's one entry, read only.
    let (types, sample, cost, burst) =
        unsafe { ((*ctl).types, (*ctl).sample, (*ctl).cost_ns, (*ctl).burst_ns) };
    if types & u32::from(kind) == 0 {
        return None;
    }
    let cpu_ptr = MONITOR_CPU.get_ptr_mut(0)?;
    // SAFETY: this CPU's entry; a program is not preempted on its CPU.
    let cpu = unsafe { &mut *cpu_ptr };
    // SAFETY: no preconditions.
    if sample > 1 && unsafe { bpf_get_prandom_u32() } % sample != 0 {
        cpu.sampled_out += 1;
        return None;
    }
    let credit = cpu
        .credit_ns
        .saturating_add(now.saturating_sub(cpu.last_ns))
        .min(burst);
    cpu.last_ns = now;
    if credit < cost {
        cpu.credit_ns = credit;
        cpu.lost_rate += 1;
        return None;
    }
    cpu.credit_ns = credit - cost;
    Some((cpu_ptr, now))
}

/// An address as four network-order words (IPv4 in word 0).
#[inline(always)]
fn words<A>(a: &A) -> [u32; 4] {
    let p = core::ptr::from_ref(a);
    // SAFETY: `A` is `u32` or `[u32; 4]` (the families' address types), checked by size.
    unsafe {
        if size_of::<A>() == 4 {
            [*p.cast::<u32>(), 0, 0, 0]
        } else {
            *p.cast::<[u32; 4]>()
        }
    }
}

/// Writes a tuple field by field into the reserved record (no copy on the stack: the
/// verifier counts 512 bytes over the whole call chain).
#[inline(always)]
unsafe fn put<A>(t: *mut EventTuple, (s, sport, d, dport): (&A, u16, &A, u16)) {
    // SAFETY: `t` points into the reserved record.
    unsafe {
        (*t).saddr = words(s);
        (*t).sport = sport;
        (*t).daddr = words(d);
        (*t).dport = dport;
    }
}

/// Writes one event, if [`admit`]ted and there is room (else counted lost).
#[inline(always)]
fn emit<A>(meta: u32, before: (&A, u16, &A, u16), after: (&A, u16, &A, u16), ids: (u32, u32)) {
    let kind = (meta >> 8) as u8;
    let Some((cpu, now)) = admit(kind) else {
        return;
    };
    let Some(mut entry) = EVENTS.reserve::<Event>(0) else {
        // SAFETY: this CPU's entry.
        unsafe { (*cpu).lost_full += 1 };
        return;
    };
    let e = entry.as_mut_ptr();
    // SAFETY: the reserved record, `size_of::<Event>()` bytes, every field written.
    unsafe {
        (*e).ts_ns = now;
        (*e).reason = meta >> 24;
        (*e).service_id = ids.0;
        (*e).backend_id = ids.1;
        (*e).hook = meta as u8;
        (*e).kind = kind;
        (*e).family = if size_of::<A>() == 4 { 4 } else { 6 };
        (*e).proto = (meta >> 16) as u8;
        put(&raw mut (*e).before, before);
        put(&raw mut (*e).after, after);
    }
    // No wake-up of the reader: waking it (an irq_work per record) cost about 10 us a
    // new flow under BPF_PROG_RUN; `proxyctl monitor` polls every 100 ms instead.
    entry.submit(u64::from(BPF_RB_NO_WAKEUP));
    // SAFETY: this CPU's entry.
    unsafe { (*cpu).emitted += 1 };
}

/// A socket hook's event: `connect()`/`sendmsg()` to `dst`, sent to `to` (a drop: `to`
/// is `dst`). The source is not known yet (zero).
#[inline(never)]
pub fn sock<A>(meta: u32, dst: &A, dport: u16, to: &A, to_port: u16) {
    let zero = [0u32; 4];
    // SAFETY: `zero` is at least as large as `A` (`u32` or `[u32; 4]`).
    let z = unsafe { &*core::ptr::from_ref(&zero).cast::<A>() };
    emit(meta, (z, 0, dst, dport), (z, 0, to, to_port), (0, 0));
}

/// A packet hook's event for packet `p`: a drop (after = before), or a new flow's
/// translation to `c` (destination the backend, source the SNAT address when SNATed).
/// Inlined into its callers' own `#[inline(never)]` reporting frames (the TC call chain
/// is close to the verifier's 512 bytes).
#[inline(always)]
pub fn pkt<F: PktFamily>(meta: u32, p: &Pkt<F::Addr>, c: &Chosen<F::Addr>) {
    let drop = (meta >> 8) as u8 == event_kind::DROP;
    let (asrc, asport) = if drop || F::is_zero(&c.snat.0) {
        (&p.saddr, p.sport)
    } else {
        (&c.snat.0, c.snat.1)
    };
    let (adst, adport) = if drop {
        (&p.daddr, p.dport)
    } else {
        (&c.backend.0, c.backend.1)
    };
    emit(
        meta,
        (&p.saddr, p.sport, &p.daddr, p.dport),
        (asrc, asport, adst, adport),
        (c.service_id, c.backend_id),
    );
}
