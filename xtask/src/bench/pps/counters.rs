//! The kernel's counters, read from inside a namespace: a veth's `ethtool -S`, its
//! rx queues' `xdp_drops`, and `/proc/net/snmp`'s IP forwarding count.

use anyhow::{bail, Context as _, Result};

use crate::bench::topo::{ns_run, Netns};

/// `ethtool -S` of a veth: (name, value) pairs.
pub(super) fn veth_stats(ns: &Netns, dev: &str) -> Result<Vec<(String, u64)>> {
    let out = ns_run(ns, "ethtool", &["-S", dev], "")?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let (k, v) = l.trim().split_once(':')?;
            Some((k.trim().to_string(), v.trim().parse().ok()?))
        })
        .collect())
}

/// `ethtool -S`: the sum of the rx queues' `xdp_drops`.
pub(super) fn xdp_drops(ns: &Netns, dev: &str) -> Result<u64> {
    let mut total = None;
    for (k, v) in veth_stats(ns, dev)? {
        if k.starts_with("rx_queue_") && k.ends_with("_xdp_drops") {
            *total.get_or_insert(0u64) += v;
        }
    }
    total.with_context(|| format!("ethtool -S {dev}: no rx_queue_*_xdp_drops"))
}

/// The namespace's `Ip: ForwDatagrams` (`/proc/net/snmp`, read from inside it).
pub(super) fn ip_forwarded(ns: &Netns) -> Result<u64> {
    let out = ns_run(ns, "cat", &["/proc/net/snmp"], "")?;
    let mut ip = out.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (ip.next(), ip.next());
    let (Some(names), Some(values)) = (names, values) else {
        bail!("/proc/net/snmp: no Ip lines");
    };
    let i = names
        .split_whitespace()
        .position(|n| n == "ForwDatagrams")
        .context("/proc/net/snmp: no ForwDatagrams")?;
    values
        .split_whitespace()
        .nth(i)
        .and_then(|v| v.parse().ok())
        .context("/proc/net/snmp: ForwDatagrams value")
}
