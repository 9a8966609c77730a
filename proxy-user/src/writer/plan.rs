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
            Op::DelSlot { slot: 0, .. } => 0,
            Op::DelSlot { .. } | Op::DelMaglev { .. } => 1,
            Op::DelSrcRange { .. } => 2,
            Op::DelRevNat { .. } => 3,
            _ => 4,
        };
    }
    5 + match op {
        Op::PutBackend { .. } => 0,
        Op::PutRevNat { .. } => 1,
        Op::PutSrcRange { .. } => 2,
        Op::PutSlot { .. } => 3,
        Op::PutMaglev { .. } => 4,
        Op::PutFrontend { .. } => 5,
        Op::DelSlot { .. } | Op::DelMaglev { .. } => 6,
        Op::DelSrcRange { .. } => 7,
        _ => 8,
    }
}
