//! [`Reason`]: every outcome of a datapath decision, the index into `STATS` / `XDP_STATS`.

/// Every outcome of a datapath decision: the index into the per-CPU `STATS` array.
/// Each non-success path in the kernel increments exactly one of these.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Destination rewritten from a frontend to a backend.
    Translated = 0,
    /// Destination is not a frontend: left alone.
    NoService = 1,
    /// The frontend exists with zero backends: the syscall fails with ECONNREFUSED.
    NoBackend = 2,
    /// Slot or backend entry missing (a writer bug or a racing delete): left alone.
    BackendMissing = 3,
    /// Socket protocol other than TCP/UDP: left alone.
    UnsupportedProto = 4,
    /// Reply source rewritten from a backend back to its frontend.
    RevTranslated = 5,
    /// No reverse-NAT entry for this socket and peer: left alone.
    RevNatMiss = 6,
    /// Reverse-NAT entry whose frontend is gone or reused: deleted, left alone.
    RevNatStale = 7,
    /// The reverse-NAT entry could not be written (map full is not possible: LRU).
    RevNatUpdateFailed = 8,
    /// `internalTrafficPolicy: Local` frontend with no endpoint on this node (kube-proxy
    /// drops): the syscall fails with EHOSTUNREACH at once instead of timing out.
    NoLocalBackend = 9,
    /// TC: a new flow to a frontend, DNATed (and SNATed when needed).
    TcNewFlow = 10,
    /// TC: a packet of a known flow, translated from its conntrack entry.
    TcFlow = 11,
    /// TC: a reply, reverse-translated from its conntrack entry.
    TcReply = 12,
    /// TC: a frontend with no endpoints: TCP answered with RST, UDP with ICMP port
    /// unreachable, other packets dropped.
    TcNoBackend = 13,
    /// TC: a source outside `loadBalancerSourceRanges`: dropped.
    TcSourceDenied = 14,
    /// TC: no free SNAT port or no SNAT address: dropped.
    TcSnatFailed = 15,
    /// TC: `externalTrafficPolicy: Local` with no local endpoint: dropped.
    TcNoLocalBackend = 16,
    /// TC: the FIB had no route for a translated packet; handed to the stack.
    TcFibMiss = 17,
    /// TC: an ICMP error about a NATed flow, translated for its backend or client.
    TcIcmpError = 18,
    /// `sessionAffinity: ClientIP`: the client's previous backend was chosen again.
    AffinityHit = 19,
    /// TC: a UDP flow whose backend is gone (no longer in the maps): balanced afresh,
    /// as kube-proxy's conntrack cleanup for removed UDP endpoints does.
    TcStaleBackend = 20,
    /// TC: an ICMP port unreachable not sent, over the rate limit (1,000/s per CPU after
    /// a burst of 50, the kernel's defaults for its own ICMP errors): dropped.
    TcRejectLimited = 21,
    /// TC: a new flow's conntrack entries could not be written (neither is kept): the
    /// packet is dropped rather than translated one way only.
    TcCtWriteFailed = 22,
    /// TC: a packet (or an ICMP error's quoted header) could not be rewritten, a helper
    /// refused half-way: the packet is dropped rather than sent half-translated.
    TcRewriteFailed = 23,
    /// XDP: a packet XDP leaves untouched to the stack and so to TC, which handles it
    /// whole: an IP fragment, an ICMP error (TC translates those about NATed flows), a
    /// frontend without endpoints (TC sends the REJECT answer), a FIB result XDP cannot
    /// forward by (no neighbour entry yet, no route, local delivery). Counted in
    /// `XDP_STATS` only.
    XdpToStack = 24,
    /// TC, DSR (`--forwarding-mode dsr|hybrid`), first node: a packet sent to a backend
    /// on another node with the DSR option carrying the frontend (client address kept,
    /// no SNAT; in an IPIP / IPv6-in-IPv6 header from this node): a new flow's first packet, every TCP SYN, every UDP datagram.
    TcDsrEncap = 25,
    /// TC, DSR, backend's node: a packet with the DSR option inside the IPIP /
    /// IPv6-in-IPv6 header of a cluster node: the reply entry recorded (backend -> client: source :=
    /// the frontend), the option (and outer header) removed, delivered.
    TcDsrDecap = 26,
    /// TC, DSR, backend's node: a backend's reply sent straight to the client with the
    /// frontend as source.
    TcDsrReply = 27,
    /// TC, DSR, first node: the option would make the packet exceed the route's MTU: a
    /// new flow is SNATed instead, a later datagram of a DSR flow goes without the
    /// option (the backend's node already knows the flow). Counted in addition to the
    /// packet's outcome.
    TcDsrTooBig = 28,
    /// TC, DSR, backend's node: a packet with the DSR option from a sender that is not a
    /// cluster node (`DSR_TRUSTED4/6`: the Node objects' addresses, `--dsr-trusted-cidrs`)
    /// or naming a frontend that is no NodePort on one of them nor this node's: the option
    /// is not honoured (no reply entry). Encapsulated: dropped (the outcome); without the
    /// outer header: nothing removed, the packet goes on as it is (counted in addition to
    /// the packet's outcome).
    TcDsrUntrusted = 29,
    /// A ClusterIP on a port no Service uses (the address is a `/32`, `/128` marker in
    /// `SVC_CIDR4/6`): the syscall fails with ECONNREFUSED, as kube-proxy's nftables
    /// mode rejects it; a packet of a new TCP/UDP flow at TC gets the REJECT answer (XDP
    /// hands it to TC).
    SvcPortUnused = 30,
    /// An address inside a Service CIDR (`SVC_CIDR4/6`, `--service-cluster-ip-range`)
    /// that no Service has: the syscall fails with EPERM at once, as kube-proxy's
    /// nftables mode drops it (a dropped locally sent packet fails with EPERM); TC and XDP
    /// drop such a TCP/UDP packet.
    SvcCidrUnallocated = 31,
}

impl Reason {
    /// Number of counters (size of `STATS`).
    pub const COUNT: u32 = 32;
    /// Every reason in index order.
    pub const ALL: [Reason; Self::COUNT as usize] = [
        Reason::Translated,
        Reason::NoService,
        Reason::NoBackend,
        Reason::BackendMissing,
        Reason::UnsupportedProto,
        Reason::RevTranslated,
        Reason::RevNatMiss,
        Reason::RevNatStale,
        Reason::RevNatUpdateFailed,
        Reason::NoLocalBackend,
        Reason::TcNewFlow,
        Reason::TcFlow,
        Reason::TcReply,
        Reason::TcNoBackend,
        Reason::TcSourceDenied,
        Reason::TcSnatFailed,
        Reason::TcNoLocalBackend,
        Reason::TcFibMiss,
        Reason::TcIcmpError,
        Reason::AffinityHit,
        Reason::TcStaleBackend,
        Reason::TcRejectLimited,
        Reason::TcCtWriteFailed,
        Reason::TcRewriteFailed,
        Reason::XdpToStack,
        Reason::TcDsrEncap,
        Reason::TcDsrDecap,
        Reason::TcDsrReply,
        Reason::TcDsrTooBig,
        Reason::TcDsrUntrusted,
        Reason::SvcPortUnused,
        Reason::SvcCidrUnallocated,
    ];

    /// A stable snake_case name, used in metrics and CLI output.
    pub const fn name(self) -> &'static str {
        match self {
            Reason::Translated => "translated",
            Reason::NoService => "no_service",
            Reason::NoBackend => "no_backend",
            Reason::BackendMissing => "backend_missing",
            Reason::UnsupportedProto => "unsupported_proto",
            Reason::RevTranslated => "rev_translated",
            Reason::RevNatMiss => "rev_nat_miss",
            Reason::RevNatStale => "rev_nat_stale",
            Reason::RevNatUpdateFailed => "rev_nat_update_failed",
            Reason::NoLocalBackend => "no_local_backend",
            Reason::TcNewFlow => "tc_new_flow",
            Reason::TcFlow => "tc_flow",
            Reason::TcReply => "tc_reply",
            Reason::TcNoBackend => "tc_no_backend",
            Reason::TcSourceDenied => "tc_source_denied",
            Reason::TcSnatFailed => "tc_snat_failed",
            Reason::TcNoLocalBackend => "tc_no_local_backend",
            Reason::TcFibMiss => "tc_fib_miss",
            Reason::TcIcmpError => "tc_icmp_error",
            Reason::AffinityHit => "affinity_hit",
            Reason::TcStaleBackend => "tc_stale_backend",
            Reason::TcRejectLimited => "tc_reject_limited",
            Reason::TcCtWriteFailed => "tc_ct_write_failed",
            Reason::TcRewriteFailed => "tc_rewrite_failed",
            Reason::XdpToStack => "xdp_to_stack",
            Reason::TcDsrEncap => "tc_dsr_encap",
            Reason::TcDsrDecap => "tc_dsr_decap",
            Reason::TcDsrReply => "tc_dsr_reply",
            Reason::TcDsrTooBig => "tc_dsr_too_big",
            Reason::TcDsrUntrusted => "tc_dsr_untrusted",
            Reason::SvcPortUnused => "svc_port_unused",
            Reason::SvcCidrUnallocated => "svc_cidr_unallocated",
        }
    }
}
