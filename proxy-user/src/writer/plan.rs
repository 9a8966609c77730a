//! [`Plan`]: map operations in order, each with its undo; the phases of a batched sync.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::store::{Group, Op, Snat};

/// Map operations in order, each with the operation that undoes it.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub(super) ops: Vec<Op>,
    pub(super) undo: Vec<Op>,
}

impl Plan {
    /// An empty plan with room for `n` ops.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            ops: Vec::with_capacity(n),
            undo: Vec::with_capacity(n),
        }
    }

    /// Room for `n` more ops.
    pub fn reserve(&mut self, n: usize) {
        self.ops.reserve(n);
        self.undo.reserve(n);
    }

    /// Adds `op`, undone by `undo`.
    pub fn push(&mut self, op: Op, undo: Op) {
        self.ops.push(op);
        self.undo.push(undo);
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The operations, in order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// The operations, consumed.
    pub fn into_ops(self) -> Vec<Op> {
        self.ops
    }

    pub(super) fn pairs(self) -> impl Iterator<Item = (Op, Op)> {
        self.ops.into_iter().zip(self.undo)
    }

    /// The ops split by [`Op::group`] (each group in order), with their undo ops.
    pub(super) fn by_group(self) -> Vec<(Vec<Op>, Vec<Op>)> {
        // One group (a batched sync's phase is mostly one map of one family): the
        // vectors as they are, not copied op by op (a million ops at 50,000 Services).
        if let Some(first) = self.ops.first().map(Op::group) {
            if self.ops.iter().all(|op| op.group() == first) {
                return vec![(self.ops, self.undo)];
            }
        }
        if self.ops.is_empty() {
            return Vec::new();
        }
        let mut groups: BTreeMap<Group, (Vec<Op>, Vec<Op>)> = BTreeMap::new();
        for (op, undo) in self.pairs() {
            let g = groups.entry(op.group()).or_default();
            g.0.push(op);
            g.1.push(undo);
        }
        groups.into_values().collect()
    }
}

/// The node-address ops that turn `have` (addresses, SNAT config) into `want`: new
/// addresses first, then the SNAT addresses (the first of each family in `want` that is
/// not a loopback address: `127.0.0.1` is there for localhost NodePorts only), then
/// the addresses that left.
pub fn node_address_ops(have: &BTreeSet<IpAddr>, have_snat: Snat, want: &[IpAddr]) -> Plan {
    node_address_ops_snat_from(have, have_snat, want, want)
}

/// [`node_address_ops`] with the SNAT addresses taken from `snat_from` (every node
/// address) rather than from `want` (the NodePort addresses, `--nodeport-addresses`).
pub fn node_address_ops_snat_from(
    have: &BTreeSet<IpAddr>,
    have_snat: Snat,
    want: &[IpAddr],
    snat_from: &[IpAddr],
) -> Plan {
    let mut plan = Plan::default();
    let mut seen = BTreeSet::new();
    for a in want {
        if seen.insert(*a) && !have.contains(a) {
            plan.push(Op::PutNodeAddr { addr: *a }, Op::DelNodeAddr { addr: *a });
        }
    }
    let snat = Snat {
        v4: snat_from.iter().find_map(|a| match a {
            IpAddr::V4(v) if !v.is_loopback() => Some(*v),
            _ => None,
        }),
        v6: snat_from.iter().find_map(|a| match a {
            IpAddr::V6(v) if !v.is_loopback() => Some(*v),
            _ => None,
        }),
    };
    if snat != have_snat {
        plan.push(
            Op::PutNodeConfig { snat },
            Op::PutNodeConfig { snat: have_snat },
        );
    }
    for a in have {
        if !seen.contains(a) {
            plan.push(Op::DelNodeAddr { addr: *a }, Op::PutNodeAddr { addr: *a });
        }
    }
    plan
}

/// Phases of a batched sync: removals, then updates (see the module doc).
pub(super) const PHASES: usize = 14;

pub(super) fn phase(op: &Op, removal: bool) -> usize {
    if removal {
        return match op {
            Op::DelChunk { chunk: 0, .. } => 0,
            Op::DelChunk { .. } | Op::DelMaglev { .. } => 1,
            Op::DelSrcRange { .. } => 2,
            Op::DelRevNat { .. } => 3,
            _ => 4,
        };
    }
    5 + match op {
        Op::PutBackend { .. } => 0,
        Op::PutRevNat { .. } => 1,
        Op::PutSrcRange { .. } => 2,
        Op::PutChunk { trim: false, .. } => 3,
        Op::PutMaglev { late: false, .. } => 4,
        Op::PutFrontend { .. } => 5,
        Op::DelChunk { .. }
        | Op::DelMaglev { .. }
        | Op::PutChunk { trim: true, .. }
        | Op::PutMaglev { late: true, .. } => 6,
        Op::DelSrcRange { .. } => 7,
        _ => 8,
    }
}

/// Reserves in a batched round's `phases` the room `frontends` new frontends with
/// `backends` backends in all take: one `BACKEND` write per backend (at most), one
/// reverse-NAT entry and one frontend entry per frontend, and the further slot chunks of
/// those with more than 24 backends (a few; the phases [`phase`] gives those ops).
pub(super) fn reserve_new(phases: &mut [Plan], frontends: usize, backends: usize) {
    for (at, n) in [(5, backends), (6, frontends), (10, frontends)] {
        phases[at].reserve(n);
    }
}
