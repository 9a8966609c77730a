//! The frontend lookup rule, written once for every reader of the `SVC` maps: the socket
//! hooks (`proxy-ebpf/src/lb.rs`), the TC datapath (`proxy-ebpf/src/tc/`) and
//! `proxyctl explain` (over a snapshot of the maps).

/// Which frontend entry a destination `addr` (with the port and protocol the caller's
/// `svc` closes over) hits: the exact frontend `addr:port/proto`; else, when `addr` is one
/// of the node's addresses, the NodePort entry (keyed by the all-zero address `zero`), so
/// `<node address>:<nodePort>` is served as kube-proxy's KUBE-NODEPORTS rules serve it.
/// Returns the entry and the address its slots are keyed by. `is_node_addr` is asked only
/// when there is no exact frontend (a non-frontend costs one more lookup).
#[inline(always)]
pub fn frontend<A: Copy, V>(
    addr: A,
    zero: A,
    mut svc: impl FnMut(A) -> Option<V>,
    is_node_addr: impl FnOnce(A) -> bool,
) -> Option<(V, A)> {
    if let Some(v) = svc(addr) {
        return Some((v, addr));
    }
    if !is_node_addr(addr) {
        return None;
    }
    svc(zero).map(|v| (v, zero))
}

#[cfg(test)]
mod tests {
    use super::frontend;

    #[test]
    fn exact_frontend_first_then_the_node_port_entry_on_a_node_address() {
        // Frontends: 10.0.0.1 (exact) and the NodePort entry (0).
        let svc = |a: u32| matches!(a, 0 | 10).then_some(a * 100);
        let node = |a: u32| a == 10 || a == 20;
        assert_eq!(frontend(10, 0, svc, node), Some((1000, 10)), "exact wins");
        assert_eq!(
            frontend(20, 0, svc, node),
            Some((0, 0)),
            "node address: NodePort"
        );
        assert_eq!(frontend(30, 0, svc, node), None, "neither");
        let mut asked = false;
        frontend(10, 0, svc, |_| {
            asked = true;
            true
        });
        assert!(!asked, "an exact frontend costs no node-address lookup");
    }
}
