//! The stage machine of the per-packet datapath, one implementation for both hooks (TC:
//! `crate::tc`, XDP: `crate::xdp`), generic over [`PktHook`] and the family:
//! 1. a reply of a known flow (`CT` entry in the reply direction) is reverse-translated;
//! 2. a packet of a known flow (original direction) follows its entry;
//! 3. otherwise a packet to a frontend (or to a node address on a NodePort) starts a flow:
//!    source ranges, the local-only twin under `externalTrafficPolicy: Local`, the backend
//!    choice (`choose`: affinity, Maglev or equal weight), SNAT or DSR for a remote
//!    backend, both conntrack entries, DNAT; a frontend without endpoints gets the hook's
//!    REJECT answer;
//! 4. a destination that is no frontend but lies in a Service CIDR (`SVC_CIDR4/6`): a
//!    ClusterIP on a port no Service uses gets the REJECT answer, an unallocated address
//!    DROP (kube-proxy's nftables mode); any other destination is not ours.
//!
//! What differs per hook is a [`PktHook`] method (forwarding, REJECT, DSR, counters);
//! each stage returns a [`Step`] and the outcome to count, applied in [`flow`].

use aya_ebpf::helpers::generated::bpf_ktime_get_coarse_ns;
use proxy_common::{
    backend_flags, ct_flags,
    event::{event_hook, event_kind},
    proto, scope, svc_cidr, svc_flags, Reason, SvcValue,
};

use super::{
    ct::{self, Chosen},
    family::{backend, Pkt, PktAccess, PktFamily},
    hook::PktHook,
    nat::rewrite,
    verdict::{Action, Step, Verdict},
};
use crate::{
    affinity, events, lb, maglev,
    maps::{count_backend, count_flow, counters_on, warn_allowed},
};

/// The stage machine: reply of a known flow, packet of a known flow, new flow. Shared by
/// TC (`tc_ingress`/`tc_egress`) and XDP (`xdp_ingress`, ingress only) through
/// [`PktHook`].
#[inline(never)]
pub(crate) fn flow<C: PktHook, F: PktFamily>(ctx: &C, ingress: bool) -> Result<Verdict, Reason> {
    // The entry always exists (a one-entry array); a failure here would be a loader bug.
    let scratch = F::scratch().ok_or(Reason::TcRewriteFailed)?;
    // SAFETY: this CPU's scratch entry; a program is not preempted on its CPU.
    let p = unsafe { &mut (*scratch).pkt };
    if !parse_into::<C, F>(ctx, p) {
        // An IPv6 DSR packet (a destination option before TCP/UDP) is one of these: TC
        // takes the option off; XDP hands it on.
        return ctx.unparsed::<F>(ingress);
    }
    let p = &*p;
    // The conntrack clock: CLOCK_MONOTONIC at the last tick, read without the TSC (the
    // entries' timeouts are seconds; a tick behind is nothing to them, and comparisons
    // saturate). One `bpf_ktime_get_ns` per packet was a visible share of the XDP
    // program's profile.
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    // On the backend's node: an IPv4 DSR option without the outer header is not
    // honoured, only counted (TC's `dsr`; the encapsulated one is unparsed above).
    if ingress {
        ctx.parsed::<F>(p);
    }
    let step = match reply_path::<C, F>(ctx, p, ingress, now)? {
        Some(s) => s,
        None if !ingress => Step::not_ours(),
        None => match known_path::<C, F>(ctx, p, now)? {
            Some(s) => s,
            None => match new_flow::<C, F>(ctx, p)? {
                Some(s) => s,
                None => {
                    // SAFETY: this CPU's scratch entry, a field apart from the packet.
                    let chosen = unsafe { &(*scratch).chosen };
                    commit_flow::<C, F>(ctx, p, chosen, now)?
                }
            },
        },
    };
    let code = match step.action {
        // `Reject` and `NoFrontend` never come back from `new_flow`.
        Action::Pass | Action::NoFrontend | Action::Reject => C::PASS,
        Action::Drop => C::DROP,
        Action::Verdict(v) => v,
        Action::Redirect(src, dst) => ctx.forward::<F>(src, dst, p.proto),
    };
    Ok(Verdict {
        code,
        reason: step.reason,
    })
}

/// The hook's event id: `C::EVENT_HOOK` at ingress, TC's egress after it.
#[inline(always)]
fn event_hook<C: PktHook>(ingress: bool) -> u8 {
    if ingress || C::EVENT_HOOK != event_hook::TC_INGRESS {
        C::EVENT_HOOK
    } else {
        event_hook::TC_EGRESS
    }
}

/// Reports this packet's event to `proxyctl monitor`, after the stage machine (called by
/// the hooks only while a monitor holds the lease; out of the stage machine's call chain,
/// whose stack is close to the verifier's 512 bytes): a UDP flow found with its backend
/// gone (`after`: the old backend), then a new flow's outcome: a drop or REJECT answer,
/// or its translation (`after`: backend, SNAT address). Other outcomes (known flows,
/// replies, not ours, handed on to the next hook) are not events.
#[inline(never)]
pub(crate) fn report<C: PktHook, F: PktFamily>(r: &Result<Verdict, Reason>, ingress: bool) {
    let Some(scratch) = F::scratch() else { return };
    // SAFETY: this CPU's scratch entry; a program is not preempted on its CPU.
    let s = unsafe { &mut *scratch };
    let hook = event_hook::<C>(ingress);
    if s.mark.stale != 0 {
        s.mark.stale = 0;
        let old = Chosen {
            backend: s.mark.stale_backend,
            snat: (F::zero(), 0),
            service_id: 0,
            backend_id: s.mark.stale_id,
            flags: 0,
        };
        let meta = events::meta(
            hook,
            event_kind::TRANSLATE,
            s.pkt.proto,
            Reason::TcStaleBackend,
        );
        events::pkt::<F>(meta, &s.pkt, &old);
    }
    if s.mark.new_flow == 0 {
        return;
    }
    s.mark.new_flow = 0;
    let reason = match r {
        Ok(v) => match v.reason {
            Some(r) => r,
            None => return,
        },
        Err(r) => *r,
    };
    // Only a new flow's outcomes (a mark left by a packet just before a lease ended is
    // ignored for a known flow's reasons).
    let kind = match reason {
        Reason::TcNoBackend
        | Reason::TcSourceDenied
        | Reason::TcSnatFailed
        | Reason::TcNoLocalBackend
        | Reason::TcCtWriteFailed => event_kind::DROP,
        Reason::TcNewFlow | Reason::TcDsrEncap => event_kind::TRANSLATE,
        _ => return,
    };
    events::pkt::<F>(
        events::meta(hook, kind, s.pkt.proto, reason),
        &s.pkt,
        &s.chosen,
    );
}

/// Leaves the stale UDP backend of the flow entry `v` for [`report`]. In a frame of its
/// own, reading the entry itself: `known_path`'s frame stays as it was (its call chain
/// through DSR is at the verifier's 512-byte limit).
#[inline(never)]
fn mark_stale<F: PktFamily>(v: *const F::Val) {
    // SAFETY: a conntrack entry the caller just looked up, copied out.
    let (old, _) = F::ct_nat(unsafe { &*v });
    // SAFETY: as above.
    let backend_id = F::ct_backend_id(unsafe { &*v });
    if let Some(scratch) = F::scratch() {
        // SAFETY: this CPU's scratch entry.
        unsafe {
            (*scratch).mark.stale = 1;
            (*scratch).mark.stale_backend = old;
            (*scratch).mark.stale_id = backend_id;
        }
    }
}

/// 3. A packet of no known flow: the new flow's backend (`pick`) and its translation into
/// the scratch's `chosen` (`None`: the caller writes its entries, `commit_flow`), or the
/// step that refuses it, or the Service-CIDR rule when the destination is no frontend.
/// Frames in turn rather than one inside the other, and out of `flow`'s frame (the
/// verifier's 512-byte limit on a call chain's stack).
#[inline(never)]
fn new_flow<C: PktHook, F: PktFamily>(
    ctx: &C,
    p: &Pkt<F::Addr>,
) -> Result<Option<Step<F::Addr>>, Reason> {
    let scratch = F::scratch().ok_or(Reason::TcRewriteFailed)?;
    // SAFETY: this CPU's scratch entry, a field apart from the packet.
    let chosen = unsafe { &mut (*scratch).chosen };
    if events::on() {
        // SAFETY: this CPU's scratch entry, a field apart from the packet.
        unsafe { (*scratch).mark.new_flow = 1 };
    }
    let step = match pick::<F>(p, chosen) {
        // No frontend: the Service-CIDR rule.
        Err(s) if matches!(s.action, Action::NoFrontend) => outside_frontends::<F>(p),
        Err(s) => s,
        Ok(remote) => return Ok(translation::<C, F>(ctx, p, chosen, remote)),
    };
    // The REJECT answer is asked for here, not below `pick` (one frame less on its chain).
    Ok(Some(match step.action {
        Action::Reject => reject::<C, F>(ctx, p, step.reason.unwrap_or(Reason::TcNoBackend)),
        _ => step,
    }))
}

/// Parses in its own frame (every `load` keeps its own stack slot).
#[inline(never)]
fn parse_into<C: PktAccess, F: PktFamily>(ctx: &C, out: &mut Pkt<F::Addr>) -> bool {
    match F::parse(ctx) {
        Some(p) => {
            *out = p;
            true
        }
        None => false,
    }
}

/// 1. A reply of a known flow: source := the frontend, destination := the client if the
/// flow was SNATed.
#[inline(never)]
fn reply_path<C: PktHook, F: PktFamily>(
    ctx: &C,
    p: &Pkt<F::Addr>,
    ingress: bool,
    now: u64,
) -> Result<Option<Step<F::Addr>>, Reason> {
    // At ingress the replies to translate are those of SNATed flows, whose destination
    // port is a SNAT port: a packet to any other port is not looked up as a reply, which
    // saves a conntrack lookup per packet of a known flow (the original direction, to a
    // frontend's port). The reply of a flow that was not SNATed (to a local backend)
    // reaches its client through the egress hook, which looks every packet up.
    if ingress && !ct::may_be_snat_port(p.dport) {
        return Ok(None);
    }
    let rkey = F::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, 1);
    let Some(v) = F::ct_get(&rkey) else {
        return Ok(None);
    };
    // SAFETY: copied out.
    let (dnat, snat) = F::ct_nat(unsafe { &*v });
    // At ingress the reply is forwarded directly: its new source is a node address (the
    // stack would drop it as a martian) or a frontend, which the stack's reverse-path
    // check would refuse on the interface it came in on (a local backend's reply on its
    // pod interface, `--pod-interfaces`).
    let redirect = ingress;
    let reason = ct::reply_reason::<F>(v);
    let client = if F::is_zero(&dnat.0) {
        (p.daddr, p.dport)
    } else {
        dnat
    };
    if redirect && !ctx.can_forward::<F>(snat.0, client.0, p.proto, now) {
        return Ok(Some(Step::to_next_hook()));
    }
    if !ct::touch::<F>(v, p.proto, p.tcp_flags, true, now) {
        return Ok(None);
    }
    // Keep the original direction's entry alive and mark the reply seen.
    ct::refresh_orig::<F>(p, &client, &snat, now);
    rewrite::<F, _>(ctx, p, &(dnat, snat))?;
    if redirect {
        return Ok(Some(Step::redirect(snat.0, client.0, reason)));
    }
    Ok(Some(Step::pass(reason)))
}

/// 2. A packet of a known flow follows its entry (same backend for the flow's life).
#[inline(never)]
fn known_path<C: PktHook, F: PktFamily>(
    ctx: &C,
    p: &Pkt<F::Addr>,
    now: u64,
) -> Result<Option<Step<F::Addr>>, Reason> {
    let okey = F::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, 0);
    let Some(v) = F::ct_get(&okey) else {
        return Ok(None);
    };
    // SAFETY: copied out.
    let (dnat, snat) = F::ct_nat(unsafe { &*v });
    // A UDP flow whose backend is gone starts over (kube-proxy deletes the UDP conntrack
    // entries of removed endpoints). TCP keeps its backend: a removed endpoint may still
    // be draining its connections. Counted in addition to the new flow's outcome. The
    // lookup is made only when backends were deleted since this flow's last check.
    if p.proto == proto::UDP && !ct::backend_still_there::<F>(v, dnat) {
        C::count(Reason::TcStaleBackend);
        if events::on() {
            mark_stale::<F>(v);
        }
        return Ok(None);
    }
    // A DSR flow's packets may need the option (TC only): XDP hands them on untouched.
    let dsr = ct::is_dsr::<F>(v);
    if dsr && !ctx.carries_dsr() {
        return Ok(Some(Step::to_next_hook()));
    }
    let redirect = !F::is_zero(&snat.0);
    if redirect && !ctx.can_forward::<F>(snat.0, dnat.0, p.proto, now) {
        return Ok(Some(Step::to_next_hook()));
    }
    if !ct::touch::<F>(v, p.proto, p.tcp_flags, false, now) {
        return Ok(None);
    }
    rewrite::<F, _>(ctx, p, &(dnat, snat))?;
    if counters_on() {
        count_packet::<F>(v);
    }
    if dsr {
        return ctx.dsr_again::<F>(p, dnat.0);
    }
    if !redirect {
        return Ok(Some(Step::pass(Reason::TcFlow)));
    }
    Ok(Some(Step::redirect(snat.0, dnat.0, Reason::TcFlow)))
}

/// A known flow's packet in its frontend's and backend's counters
/// (`--metrics-per-service`), read from the flow entry `v` in a frame of its own.
#[inline(never)]
fn count_packet<F: PktFamily>(v: *const F::Val) {
    // SAFETY: a conntrack entry the caller just looked up.
    let (sid, bid) = unsafe { (F::ct_service_id(&*v), F::ct_backend_id(&*v)) };
    count_flow(sid, bid, 0, 1);
}

/// The frontend a packet's destination hits (`lb::frontend`, the one lookup rule), in a
/// frame of its own.
#[inline(never)]
fn frontend<F: PktFamily>(p: &Pkt<F::Addr>) -> Option<(SvcValue, F::Addr)> {
    lb::frontend::<F>(p.daddr, p.dport, p.proto)
}

/// 3. A new flow to a frontend (or to a node address on a NodePort)? `Ok(remote)`: a
/// backend was chosen into `out` (`remote`: on another node, for the whole Service);
/// `Err(step)`: no frontend, or refused.
#[inline(never)]
fn pick<F: PktFamily>(p: &Pkt<F::Addr>, out: &mut Chosen<F::Addr>) -> Result<bool, Step<F::Addr>> {
    let Some((mut front, fe_addr)) = frontend::<F>(p) else {
        return Err(Step::no_frontend());
    };
    // Named by a refusal's event (`report`); a chosen flow overwrites both.
    out.service_id = front.service_id;
    out.backend_id = 0;
    if front.flags & svc_flags::SOURCE_RANGES != 0 && !F::source_allowed(front.service_id, p.saddr)
    {
        return Err(Step::drop(Reason::TcSourceDenied));
    }
    let mut slot_scope = scope::ALL;
    // The local-only twin. While a policy change is being written the flag and the twin
    // can disagree for a moment; without a twin the frontend's own entry serves.
    if front.flags & svc_flags::ETP_LOCAL != 0 {
        if let Some(local) = F::svc_in(fe_addr, p.dport, p.proto, scope::EXTERNAL_LOCAL) {
            // Endpoints elsewhere but none here: DROP. A twin without LOCAL_ONLY and
            // without backends means no endpoint anywhere: REJECT below, like any
            // Service without endpoints (kube-proxy: `!hasEndpoints` -> REJECT).
            if local.count == 0 && local.flags & svc_flags::LOCAL_ONLY != 0 {
                return Err(Step::drop(Reason::TcNoLocalBackend));
            }
            front = local;
            slot_scope = scope::EXTERNAL_LOCAL;
        }
    }
    if front.count == 0 {
        return Err(Step::reject(Reason::TcNoBackend));
    }
    let preferred = maglev_slot::<F>(p, &front);
    let backend_id = choose::<F>(p, &front, fe_addr, slot_scope, preferred);
    if backend_id == 0 {
        return Err(Step::pass(Reason::BackendMissing));
    }
    let Some((baddr, bport, bflags)) = backend::<F>(backend_id) else {
        return Err(Step::pass(Reason::BackendMissing));
    };

    *out = Chosen {
        backend: (baddr, bport),
        snat: (F::zero(), 0),
        service_id: front.service_id,
        backend_id,
        flags: 0,
    };
    Ok(bflags & backend_flags::LOCAL == 0 && slot_scope == scope::ALL)
}

/// 3b. The chosen backend's translation: SNAT when it is on another node (unless the
/// client address must be kept), or DSR instead (`--forwarding-mode`: the option is added
/// at TC; XDP hands such a new flow on before anything is written), or SNAT for a hairpin;
/// written into `out`. `Some(step)`: handed on or refused. (Five arguments at most, the
/// return slot included, for a BPF call: the clock is read again here.)
#[inline(never)]
fn translation<C: PktHook, F: PktFamily>(
    ctx: &C,
    p: &Pkt<F::Addr>,
    out: &mut Chosen<F::Addr>,
    remote: bool,
) -> Option<Step<F::Addr>> {
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let (baddr, bport) = out.backend;
    let mut snat = (F::zero(), 0u16);
    let mut flags = 0;
    let dsr = remote
        && match ctx.dsr_wanted::<F>(p, baddr) {
            Some(wanted) => wanted,
            None => return Some(Step::to_next_hook()),
        };
    if dsr {
        flags = ct_flags::DSR;
    } else if remote || hairpin::<F>(p, baddr) {
        let addr = F::snat_addr();
        if F::is_zero(&addr) {
            return Some(Step::drop(Reason::TcSnatFailed));
        }
        // Before a port is taken: a hook that cannot forward hands the packet on.
        if !ctx.can_forward::<F>(addr, baddr, p.proto, now) {
            return Some(Step::to_next_hook());
        }
        let Some(port) = ct::snat_port::<F>(baddr, bport, addr, p.proto) else {
            if warn_allowed() {
                F::warn_ports_full(ctx, baddr, bport);
            }
            return Some(Step::drop(Reason::TcSnatFailed));
        };
        snat = (addr, port);
        flags = ct_flags::SNAT;
    }
    out.snat = snat;
    out.flags = flags;
    None
}

/// Hairpin: a pod reaching its own Service, balanced to itself (seen on the pod's
/// interface, `--pod-interfaces`; such a backend is local, so never DSR). Its own address
/// as the source would be a martian to it: the flow is SNATed to the node's address, as
/// kube-proxy masquerades hairpin traffic. A frame of its own (the verifier's 512-byte
/// limit on the call chain through `pick`).
#[inline(never)]
fn hairpin<F: PktFamily>(p: &Pkt<F::Addr>, backend: F::Addr) -> bool {
    p.saddr == backend
}

/// 4. A destination that is no frontend: inside the Service CIDRs (`SVC_CIDR4/6`, empty
/// unless the agent knows them), a ClusterIP on a port no Service uses is rejected
/// (`svc_port_unused`) and an unallocated address dropped (`svc_cidr_unallocated`), as
/// kube-proxy's nftables mode does; anything else (node, pod, host addresses) is not
/// ours and passes untouched: there is no wildcard entry (cilium#44430).
#[inline(never)]
fn outside_frontends<F: PktFamily>(p: &Pkt<F::Addr>) -> Step<F::Addr> {
    match F::svc_cidr(p.daddr) {
        Some(svc_cidr::CLUSTER_IP) => Step::reject(Reason::SvcPortUnused),
        Some(svc_cidr::RANGE) => Step::drop(Reason::SvcCidrUnallocated),
        _ => Step::not_ours(),
    }
}

/// kube-proxy's REJECT (a frontend without endpoints, a ClusterIP's unused port): TCP
/// SYN: RST; UDP: ICMP port unreachable, rate-limited; other packets dropped; or handed
/// on to the hook that answers (XDP leaves it to TC). `reason`: the outcome counted.
#[inline(always)]
fn reject<C: PktHook, F: PktFamily>(ctx: &C, p: &Pkt<F::Addr>, reason: Reason) -> Step<F::Addr> {
    match ctx.reject::<F>(p) {
        Some(code) => Step {
            action: Action::Verdict(code),
            reason: Some(reason),
        },
        None => Step::to_next_hook(),
    }
}

/// The backend for a new flow: the client's previous one under session affinity (the
/// client is its source address), else, for a frontend with `svc_flags::MAGLEV`, the slot
/// its Maglev table gives the flow's 5-tuple (the same on every node), else one at random
/// with equal weight. The one place an external flow's backend is chosen. `preferred`:
/// the Maglev slot ([`maglev_slot`], asked by the caller: one frame less on this chain).
/// Returns the backend id, 0 for none (never an id: a plain return value keeps this call
/// within BPF's five arguments).
#[inline(never)]
fn choose<F: PktFamily>(
    p: &Pkt<F::Addr>,
    front: &SvcValue,
    fe_addr: F::Addr,
    sc: u8,
    preferred: u16,
) -> u32 {
    let slot_backend = |s: u16| F::slot_backend(fe_addr, p.dport, p.proto, sc, s);
    let client = || {
        let (addr, kind) = F::client(p.saddr);
        affinity::key(front, addr, kind)
    };
    affinity::choose(front, client, slot_backend, preferred).unwrap_or(0)
}

/// For a frontend with `svc_flags::MAGLEV`, the slot its Maglev table gives the flow's
/// 5-tuple (0: none, or not Maglev).
#[inline(always)]
fn maglev_slot<F: PktFamily>(p: &Pkt<F::Addr>, front: &SvcValue) -> u16 {
    if front.flags & svc_flags::MAGLEV == 0 {
        return 0;
    }
    let hash = proxy_common::maglev::flow_hash(
        F::client(p.saddr).0,
        F::client(p.daddr).0,
        p.sport,
        p.dport,
        p.proto,
    );
    maglev::slot(front.service_id, front.count, hash)
}

/// Writes both conntrack entries of a new flow and translates its first packet:
/// original direction (client -> frontend) and reply direction (backend -> client or
/// the SNAT address), which restores the frontend the client used.
#[inline(never)]
fn commit_flow<C: PktHook, F: PktFamily>(
    ctx: &C,
    p: &Pkt<F::Addr>,
    c: &Chosen<F::Addr>,
    now: u64,
) -> Result<Step<F::Addr>, Reason> {
    ct::put_flow::<F>(p, c, now)?;
    count_backend(c.backend_id);
    if counters_on() {
        count_flow(c.service_id, c.backend_id, 1, 1);
    }
    rewrite::<F, _>(ctx, p, &(c.backend, c.snat))?;
    if c.flags & ct_flags::DSR != 0 {
        return ctx.dsr_first::<F>(p, c.backend.0);
    }
    if c.flags & ct_flags::SNAT != 0 {
        return Ok(Step::redirect(c.snat.0, c.backend.0, Reason::TcNewFlow));
    }
    Ok(Step::pass(Reason::TcNewFlow))
}
