//! What the stage machine (`stages`) needs from the hook it runs in, beyond reading and
//! writing the packet ([`PktAccess`]): its verdicts, forwarding, the REJECT answers, DSR
//! and where outcomes are counted. TC implements it in `crate::tc::hook`, XDP in
//! `crate::xdp`. The stages, the frontend lookup, the backend choice, conntrack and NAT
//! are one implementation, generic over this trait; what differs per hook is a method
//! here, never a test of which hook runs.

use aya_ebpf::EbpfContext;
use proxy_common::Reason;

use super::{
    family::{Pkt, PktAccess, PktFamily},
    verdict::{Step, Verdict},
};

/// A packet hook running the shared stage machine.
pub trait PktHook: PktAccess + EbpfContext {
    /// Hands the packet on unchanged by this hook (TC: `TC_ACT_OK`, to the stack; XDP:
    /// `XDP_PASS`, to the stack and so to TC).
    const PASS: i32;
    /// Drops the packet.
    const DROP: i32;
    /// The hook's `proxy_common::event::event_hook` at ingress (TC: `TC_INGRESS`, whose
    /// egress is the next one, `TC_EGRESS`; XDP: `XDP`).
    const EVENT_HOOK: u8;
    /// Counts an outcome in this hook's counters (TC: `STATS`, XDP: `XDP_STATS`).
    fn count(r: Reason);
    /// Whether this hook can forward a packet from `src` to `dst` itself. Asked before
    /// the packet or its flow is changed, so a packet the hook cannot forward is handed
    /// on untouched (XDP: a FIB result it cannot act on goes to TC, which then handles the
    /// packet whole). TC: always (it falls back to the stack itself). `now`: the
    /// packet's conntrack clock (XDP reuses a recent FIB answer).
    fn can_forward<F: PktFamily>(&self, src: F::Addr, dst: F::Addr, proto: u8, now: u64) -> bool;
    /// Forwards the translated packet by FIB lookup (after `can_forward`).
    fn forward<F: PktFamily>(&self, src: F::Addr, dst: F::Addr, proto: u8) -> i32;
    /// kube-proxy's REJECT for a frontend without endpoints: the verdict, or `None` when
    /// this hook leaves the answer to the next one (XDP leaves it to TC).
    fn reject<F: PktFamily>(&self, p: &Pkt<F::Addr>) -> Option<i32>;
    /// A packet the family's parser did not take (an IP packet that is not plain
    /// TCP/UDP). TC: on the backend's node a DSR packet (IPIP, IPv6-in-IPv6, an IPv6
    /// Destination Options header) is one, taken apart here; XDP hands everything on.
    fn unparsed<F: PktFamily>(&self, ingress: bool) -> Result<Verdict, Reason>;
    /// A parsed packet at ingress, before the stages. TC: counts an IPv4 DSR option that
    /// came without the outer header (not honoured); XDP: nothing.
    fn parsed<F: PktFamily>(&self, p: &Pkt<F::Addr>);
    /// Whether this hook can carry the packets of a DSR flow (the IP option makes the
    /// packet grow or shrink). TC: yes; XDP: no, it hands them on untouched.
    fn carries_dsr(&self) -> bool;
    /// Whether a new flow to `backend` on another node goes by DSR instead of SNAT;
    /// `None`: this hook cannot tell or carry it and hands the packet on untouched (XDP,
    /// when the forwarding mode asks for DSR).
    fn dsr_wanted<F: PktFamily>(&self, p: &Pkt<F::Addr>, backend: F::Addr) -> Option<bool>;
    /// The first packet of a new DSR flow, already DNATed: its step (TC adds the option).
    /// Asked only after [`Self::dsr_wanted`] said yes.
    fn dsr_first<F: PktFamily>(
        &self,
        p: &Pkt<F::Addr>,
        backend: F::Addr,
    ) -> Result<Step<F::Addr>, Reason>;
    /// A later packet of a DSR flow, already DNATed: its step (TC adds the option to a
    /// packet that needs it). Asked only where [`Self::carries_dsr`].
    // Returns the known-flow stage's own result type, so that stage's frame holds no
    // second copy of the step (the verifier's 512-byte limit on a call chain).
    fn dsr_again<F: PktFamily>(
        &self,
        p: &Pkt<F::Addr>,
        backend: F::Addr,
    ) -> Result<Option<Step<F::Addr>>, Reason>;
}
