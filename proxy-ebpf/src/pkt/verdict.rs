//! What the stages decide: [`Verdict`], a packet's verdict and the outcome to count, and
//! [`Step`], what a stage asks its caller to do with the packet. A leaf: the stages
//! (`stages`), the hooks (`crate::tc`, `crate::xdp`) and DSR (`crate::tc::dsr`) all
//! build these, and it imports none of them.

use proxy_common::Reason;

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

    /// Not ours: handed on with `code` (the hook's "pass"), not counted.
    pub(crate) fn not_ours(code: i32) -> Self {
        Self { code, reason: None }
    }
}

/// What to do with a packet after translation, and the outcome to count. Returned up to
/// the stage machine (`stages::flow`), so the FIB redirect's frame is not stacked on top
/// of the path that chose it (the verifier limits the stack of a whole call chain to 512 bytes: "combined stack
/// size ... Too large").
pub(crate) struct Step<A> {
    pub(crate) action: Action<A>,
    pub(crate) reason: Option<Reason>,
}

pub(crate) enum Action<A> {
    /// The hook's "hand on" verdict (`PktHook::PASS`).
    Pass,
    /// The hook's drop verdict.
    Drop,
    /// A verdict a helper chose (the REJECT answers).
    Verdict(i32),
    /// Forward by FIB lookup from `src` to `dst`.
    Redirect(A, A),
    /// The destination is no frontend: the stage machine goes on with the Service-CIDR
    /// rule (`stages::outside_frontends`); handed on if it comes back.
    NoFrontend,
    /// kube-proxy's REJECT is due (the step's reason says why): the stage machine asks the
    /// hook for its answer (`stages::reject`).
    Reject,
}

impl<A> Step<A> {
    pub(crate) fn pass(reason: Reason) -> Self {
        Self {
            action: Action::Pass,
            reason: Some(reason),
        }
    }

    pub(crate) fn drop(reason: Reason) -> Self {
        Self {
            action: Action::Drop,
            reason: Some(reason),
        }
    }

    /// The REJECT answer is due, counted as `reason` (see [`Action::Reject`]).
    pub(crate) fn reject(reason: Reason) -> Self {
        Self {
            action: Action::Reject,
            reason: Some(reason),
        }
    }

    /// No frontend at the destination (see [`Action::NoFrontend`]); not counted.
    pub(crate) fn no_frontend() -> Self {
        Self {
            action: Action::NoFrontend,
            reason: None,
        }
    }

    /// Not ours: handed on, not counted.
    pub(crate) fn not_ours() -> Self {
        Self {
            action: Action::Pass,
            reason: None,
        }
    }

    /// Left untouched to the next hook (XDP: to TC), which handles it whole.
    pub(crate) fn to_next_hook() -> Self {
        Self::pass(Reason::XdpToStack)
    }

    pub(crate) fn redirect(src: A, dst: A, reason: Reason) -> Self {
        Self {
            action: Action::Redirect(src, dst),
            reason: Some(reason),
        }
    }
}
