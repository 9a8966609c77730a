//! The per-packet datapath at TC on node interfaces, for traffic no socket hook saw:
//! NodePort, externalIPs and LoadBalancer addresses reached from outside the node, and
//! ClusterIP traffic routed through it.
//!
//! Ingress, per packet (IPv4 and IPv6, TCP and UDP):
//! 1. a reply of a known flow (`CT` entry in the reply direction) is reverse-translated:
//!    source := the frontend, destination := the client when the flow was SNATed;
//! 2. a packet of a known flow (original direction) follows its entry: the same backend
//!    for the life of the flow, whatever happens to the backend set;
//! 3. otherwise a packet to a frontend (or to a node address on a NodePort) starts a
//!    flow: source ranges checked, the local-only twin used under
//!    `externalTrafficPolicy: Local`, a backend chosen with equal weight, DNAT, SNAT to the
//!    node's address when the backend is on another node, both conntrack entries written;
//!    a frontend without endpoints answers a TCP SYN with RST and a UDP datagram with
//!    ICMP port unreachable (`unreach`), as kube-proxy's REJECT does.
//!
//! Packets whose source became one of the node's own addresses (SNATed flows, and replies
//! restored to a node-address frontend) are forwarded with a FIB lookup and redirect,
//! because the stack would drop them as martians. Egress only reverse-translates replies
//! of flows to local backends on their way back to the client.
//!
//! Checksums are updated incrementally: the IPv4 header with `l3_csum_replace`, L4 with
//! `l4_csum_replace` (`BPF_F_PSEUDO_HDR` for addresses, `BPF_F_MARK_MANGLED_0` for UDP).

//!
//! Layout: this file holds the two program shells and the stage machine (reply, known
//! flow, new flow); `family` the per-family packet layout and maps (on `lb::Family`, over
//! the `PktAccess` trait), `ct` conntrack and the SNAT port allocator, `nat` rewriting and
//! the FIB redirect, `icmp` ICMP errors about NATed flows, `unreach` the REJECT answers,
//! `dsr` direct server return (instead of SNAT, `--forwarding-mode dsr|hybrid`).
//! The frontend lookup is `lb::frontend`, the rule the socket hooks and `proxyctl
//! explain` use too. Each stage returns the outcome to count; the shells count it, so a
//! failure (a conntrack entry not written, a rewrite a helper refused) is counted and the
//! packet dropped, never passed on silently.

mod ct;
mod dsr;
mod family;
pub(crate) mod hook;
mod icmp;
mod nat;
pub(crate) mod state;
mod unreach;

pub use state::Scratch;

pub(crate) use nat::fib_params;

pub(crate) use self::{
    family::{csum_add, PktAccess, PktFamily},
    hook::PktHook,
};

use aya_ebpf::{
    helpers::generated::bpf_ktime_get_coarse_ns, macros::classifier, programs::TcContext,
};
use proxy_common::{backend_flags, ct_flags, proto, scope, svc_flags, Reason, SvcValue};

use self::{
    ct::Chosen,
    family::{backend, is_node_addr, Pkt},
    nat::rewrite,
};
use crate::{
    affinity,
    lb::{self, V4, V6},
    maglev,
    maps::{count, count_backend},
};

pub(crate) const ETH_P_IP: u16 = 0x0800;
pub(crate) const ETH_P_IPV6: u16 = 0x86dd;

#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    shell(&ctx, true)
}

#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    shell(&ctx, false)
}

/// What the worker decided for a packet: the verdict, and the outcome to count (`None`
/// for a packet that is not ours: not IP, not TCP/UDP/ICMP, no flow, no frontend).
pub struct Verdict {
    pub(crate) code: i32,
    pub(crate) reason: Option<Reason>,
}

impl Verdict {
    pub(crate) fn new(code: i32, reason: Reason) -> Self {
        Self {
            code,
            reason: Some(reason),
        }
    }

    pub(crate) fn pass<C: PktHook>() -> Self {
        Self {
            code: C::PASS,
            reason: None,
        }
    }
}

/// Runs the worker and counts its outcome. A failure drops the packet (it may be
/// half-rewritten, or its flow half-recorded).
#[inline(always)]
fn shell(ctx: &TcContext, ingress: bool) -> i32 {
    match try_tc(ctx, ingress) {
        Ok(v) => {
            if let Some(r) = v.reason {
                count(r);
            }
            v.code
        }
        Err(r) => {
            count(r);
            <TcContext as PktHook>::DROP
        }
    }
}

#[inline(always)]
fn try_tc(ctx: &TcContext, ingress: bool) -> Result<Verdict, Reason> {
    let Ok(eth_proto) = PktAccess::load::<u16>(ctx, 12) else {
        return Ok(Verdict::pass::<TcContext>());
    };
    match u16::from_be(eth_proto) {
        ETH_P_IP => match ingress.then(|| icmp::icmp4(ctx)).flatten() {
            Some(r) => r.map(|code| Verdict::new(code, Reason::TcIcmpError)),
            None => flow::<TcContext, V4>(ctx, ingress),
        },
        ETH_P_IPV6 => match ingress.then(|| icmp::icmp6(ctx)).flatten() {
            Some(r) => r.map(|code| Verdict::new(code, Reason::TcIcmpError)),
            None => flow::<TcContext, V6>(ctx, ingress),
        },
        _ => Ok(Verdict::pass::<TcContext>()),
    }
}

/// What to do with a packet after translation, and the outcome to count. Returned up to
/// [`flow`], so the FIB redirect's frame is not stacked on top of the path that chose it
/// (the verifier limits the stack of a whole call chain to 512 bytes: "combined stack
/// size ... Too large").
struct Step<A> {
    action: Action<A>,
    reason: Option<Reason>,
}

enum Action<A> {
    /// The hook's "hand on" verdict (`PktHook::PASS`).
    Pass,
    /// The hook's drop verdict.
    Drop,
    /// A verdict a helper chose (the REJECT answers).
    Verdict(i32),
    /// Forward by FIB lookup from `src` to `dst`.
    Redirect(A, A),
}

impl<A> Step<A> {
    fn pass(reason: Reason) -> Self {
        Self {
            action: Action::Pass,
            reason: Some(reason),
        }
    }

    fn drop(reason: Reason) -> Self {
        Self {
            action: Action::Drop,
            reason: Some(reason),
        }
    }

    /// Not ours: handed on, not counted.
    fn not_ours() -> Self {
        Self {
            action: Action::Pass,
            reason: None,
        }
    }

    /// Left untouched to the next hook (XDP: to TC), which handles it whole.
    fn to_next_hook() -> Self {
        Self::pass(Reason::XdpToStack)
    }

    fn redirect(src: A, dst: A, reason: Reason) -> Self {
        Self {
            action: Action::Redirect(src, dst),
            reason: Some(reason),
        }
    }
}

/// The stage machine: reply of a known flow, packet of a known flow, new flow. Shared by
/// TC (`tc_ingress`/`tc_egress`) and XDP (`xdp_ingress`, ingress only) through
/// [`PktHook`].
#[inline(never)]
pub(crate) fn flow<C: PktHook, F: PktFamily>(ctx: &C, ingress: bool) -> Result<Verdict, Reason> {
    // The entry always exists (a one-entry array); a failure here would be a loader bug.
    let scratch = F::scratch().ok_or(Reason::TcRewriteFailed)?;
    // SAFETY: this CPU's scratch entry; a TC program is not preempted on its CPU.
    let p = unsafe { &mut (*scratch).pkt };
    if !parse_into::<C, F>(ctx, p) {
        // An IPv6 DSR packet (a destination option before TCP/UDP) is one of these: TC
        // takes the option off; XDP hands it on.
        return match ctx.tc() {
            Some(tc) => dsr::unparsed::<F>(tc, ingress),
            None => Ok(Verdict::pass::<C>()),
        };
    }
    let p = &*p;
    // The conntrack clock: CLOCK_MONOTONIC at the last tick, read without the TSC (the
    // entries' timeouts are seconds; a tick behind is nothing to them, and comparisons
    // saturate). One `bpf_ktime_get_ns` per packet was a visible share of the XDP
    // program's profile.
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    // On the backend's node: an IPv4 DSR option without the outer header is not
    // honoured, only counted (`dsr`; the encapsulated one is unparsed above).
    if let Some(tc) = ctx.tc().filter(|_| ingress) {
        dsr::unencapsulated::<F>(tc, p);
    }
    let step = match reply_path::<C, F>(ctx, p, ingress, now)? {
        Some(s) => s,
        None if !ingress => Step::not_ours(),
        None => match known_path::<C, F>(ctx, p, now)? {
            Some(s) => s,
            None => {
                // SAFETY: this CPU's scratch entry, a field apart from the packet.
                let chosen = unsafe { &mut (*scratch).chosen };
                match pick::<C, F>(ctx, p, chosen, now) {
                    Some(s) => s,
                    None => commit_flow::<C, F>(ctx, p, chosen, now)?,
                }
            }
        },
    };
    let code = match step.action {
        Action::Pass => C::PASS,
        Action::Drop => C::DROP,
        Action::Verdict(v) => v,
        Action::Redirect(src, dst) => ctx.forward::<F>(src, dst, p.proto),
    };
    Ok(Verdict {
        code,
        reason: step.reason,
    })
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
    // At ingress the new source may be one of the node's addresses: forward it directly.
    let redirect = ingress && (!F::is_zero(&dnat.0) || is_node_addr::<F>(snat.0));
    let reason = dsr::reply_reason::<F>(v);
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
        return Ok(None);
    }
    // A DSR flow's packets may need the option (TC only): XDP hands them on untouched.
    let dsr = dsr::is_dsr::<F>(v);
    if dsr && ctx.tc().is_none() {
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
    if let Some(tc) = ctx.tc().filter(|_| dsr) {
        return dsr::again::<F>(tc, p, dnat.0).map(Some);
    }
    if !redirect {
        return Ok(Some(Step::pass(Reason::TcFlow)));
    }
    Ok(Some(Step::redirect(snat.0, dnat.0, Reason::TcFlow)))
}

/// The frontend a packet's destination hits (`lb::frontend`, the one lookup rule), in a
/// frame of its own.
#[inline(never)]
fn frontend<F: PktFamily>(p: &Pkt<F::Addr>) -> Option<(SvcValue, F::Addr)> {
    lb::frontend::<F>(p.daddr, p.dport, p.proto)
}

/// 3. A new flow to a frontend (or to a node address on a NodePort)? `None`: a backend
/// was chosen into `out`; `Some(step)`: not ours, or refused.
#[inline(never)]
fn pick<C: PktHook, F: PktFamily>(
    ctx: &C,
    p: &Pkt<F::Addr>,
    out: &mut Chosen<F::Addr>,
    now: u64,
) -> Option<Step<F::Addr>> {
    let Some((mut front, fe_addr)) = frontend::<F>(p) else {
        return Some(Step::not_ours());
    };
    if front.flags & svc_flags::SOURCE_RANGES != 0 && !F::source_allowed(front.service_id, p.saddr)
    {
        return Some(Step::drop(Reason::TcSourceDenied));
    }
    let mut slot_scope = scope::ALL;
    // The local-only twin. While a policy change is being written the flag and the twin
    // can disagree for a moment; without a twin the frontend's own entry serves.
    if front.flags & svc_flags::ETP_LOCAL != 0 {
        if let Some(local) = F::svc_in(fe_addr, p.dport, p.proto, scope::EXTERNAL_LOCAL, 0) {
            // Endpoints elsewhere but none here: DROP. A twin without LOCAL_ONLY and
            // without backends means no endpoint anywhere: REJECT below, like any
            // Service without endpoints (kube-proxy: `!hasEndpoints` -> REJECT).
            if local.count == 0 && local.flags & svc_flags::LOCAL_ONLY != 0 {
                return Some(Step::drop(Reason::TcNoLocalBackend));
            }
            front = local;
            slot_scope = scope::EXTERNAL_LOCAL;
        }
    }
    if front.count == 0 {
        return Some(reject::<C, F>(ctx, p));
    }
    let Some(backend_id) = choose::<F>(p, &front, fe_addr, slot_scope) else {
        return Some(Step::pass(Reason::BackendMissing));
    };
    let Some((baddr, bport, bflags)) = backend::<F>(backend_id) else {
        return Some(Step::pass(Reason::BackendMissing));
    };

    // SNAT when the backend is on another node, unless the client address must be kept.
    let mut snat = (F::zero(), 0u16);
    let mut flags = 0;
    let remote = bflags & backend_flags::LOCAL == 0 && slot_scope == scope::ALL;
    // DSR instead of SNAT (`--forwarding-mode`): the option is added at TC; XDP hands
    // such a new flow on before anything is written.
    let dsr = remote
        && match ctx.tc() {
            Some(tc) => dsr::wanted::<F>(tc, p, baddr),
            None if dsr::asked::<F>(p) => return Some(Step::to_next_hook()),
            None => false,
        };
    if dsr {
        flags = ct_flags::DSR;
    } else if remote {
        let addr = F::snat_addr();
        if F::is_zero(&addr) {
            return Some(Step::drop(Reason::TcSnatFailed));
        }
        // Before a port is taken: a hook that cannot forward hands the packet on.
        if !ctx.can_forward::<F>(addr, baddr, p.proto, now) {
            return Some(Step::to_next_hook());
        }
        let Some(port) = ct::snat_port::<F>(baddr, bport, addr, p.proto) else {
            if crate::maps::warn_allowed() {
                F::warn_ports_full(ctx, baddr, bport);
            }
            return Some(Step::drop(Reason::TcSnatFailed));
        };
        snat = (addr, port);
        flags = ct_flags::SNAT;
    }

    *out = Chosen {
        backend: (baddr, bport),
        snat,
        service_id: front.service_id,
        backend_id,
        flags,
    };
    None
}

/// A frontend without endpoints: kube-proxy's REJECT (TCP SYN: RST; UDP: ICMP port
/// unreachable, rate-limited), other packets dropped; or handed on to the hook that
/// answers (XDP leaves it to TC).
#[inline(never)]
fn reject<C: PktHook, F: PktFamily>(ctx: &C, p: &Pkt<F::Addr>) -> Step<F::Addr> {
    match ctx.reject::<F>(p) {
        Some(code) => Step {
            action: Action::Verdict(code),
            reason: Some(Reason::TcNoBackend),
        },
        None => Step::to_next_hook(),
    }
}

/// The backend for a new flow: the client's previous one under session affinity (the
/// client is its source address), else, for a frontend with `svc_flags::MAGLEV`, the slot
/// its Maglev table gives the flow's 5-tuple (the same on every node), else one at random
/// with equal weight. The one place an external flow's backend is chosen.
#[inline(never)]
fn choose<F: PktFamily>(
    p: &Pkt<F::Addr>,
    front: &SvcValue,
    fe_addr: F::Addr,
    sc: u8,
) -> Option<u32> {
    let slot_backend = |s: u16| F::svc_in(fe_addr, p.dport, p.proto, sc, s).map(|e| e.backend_id);
    let client = || {
        let (addr, kind) = F::client(p.saddr);
        affinity::key(front, addr, kind)
    };
    let preferred = if front.flags & svc_flags::MAGLEV != 0 {
        let hash = proxy_common::maglev::flow_hash(
            F::client(p.saddr).0,
            F::client(p.daddr).0,
            p.sport,
            p.dport,
            p.proto,
        );
        maglev::slot(front.service_id, front.count, hash)
    } else {
        0
    };
    affinity::choose(front, client, slot_backend, preferred)
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
    rewrite::<F, _>(ctx, p, &(c.backend, c.snat))?;
    if let Some(tc) = ctx.tc().filter(|_| c.flags & ct_flags::DSR != 0) {
        return dsr::first::<F>(tc, p, c.backend.0);
    }
    if c.flags & ct_flags::SNAT != 0 {
        return Ok(Step::redirect(c.snat.0, c.backend.0, Reason::TcNewFlow));
    }
    Ok(Step::pass(Reason::TcNewFlow))
}
