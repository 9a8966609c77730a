//! Service CIDRs known to the datapath (issue #24 item 5): `SVC_CIDR4/6` hold the
//! Service CIDRs (`svc_cidr::RANGE`) and a host prefix per ClusterIP in use
//! (`svc_cidr::CLUSTER_IP`). The socket hooks consult them only when the destination is
//! no frontend: a ClusterIP on a port no Service uses is refused with ECONNREFUSED
//! (`svc_port_unused`, kube-proxy's nftables mode rejects), any other address inside a
//! Service CIDR with EPERM (`svc_cidr_unallocated`, nftables mode drops). Destinations
//! outside these prefixes (node, pod and host addresses) are never touched: no wildcard
//! entry exists (cilium#44430).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    MapData, MapError,
};
use proxy_common::{map_names, svc_cidr};

use crate::{
    dsr_trust::{normalize, Prefix},
    model::{v4_from_word, v4_word, v6_from_words, v6_words},
    pins::{Access, PinDir, PinError},
};

/// The shortest prefixes accepted as a Service CIDR from the API: everything inside one
/// that is no Service's address is dropped, so a ServiceCIDR object of `0.0.0.0/0` (or
/// any very wide one) would cut the node off. kube-apiserver's own
/// `--service-cluster-ip-range` allows at most a /12 (IPv4) and a /108 (IPv6) for its
/// allocator; these bounds are far wider and only refuse what cannot be meant.
pub const SHORTEST_RANGE_V4: u8 = 8;
pub const SHORTEST_RANGE_V6: u8 = 64;

/// Whether `(addr, len)` may be a Service CIDR (see [`SHORTEST_RANGE_V4`]).
pub fn check_range((addr, len): Prefix) -> Result<(), String> {
    let shortest = if addr.is_ipv4() {
        SHORTEST_RANGE_V4
    } else {
        SHORTEST_RANGE_V6
    };
    if len < shortest {
        return Err(format!(
            "is wider than /{shortest}: refused as a Service CIDR (everything inside it that is \
             no Service would be dropped)"
        ));
    }
    Ok(())
}

/// What `SVC_CIDR4/6` should hold: each range (`RANGE`), each ClusterIP as a host prefix
/// (`CLUSTER_IP`; wins over a range of the same prefix).
pub fn wanted<'a>(
    ranges: &[Prefix],
    cluster_ips: impl IntoIterator<Item = &'a IpAddr>,
) -> BTreeMap<Prefix, u8> {
    let mut out: BTreeMap<Prefix, u8> = ranges
        .iter()
        .map(|p| (normalize(*p), svc_cidr::RANGE))
        .collect();
    for a in cluster_ips {
        let host = match a {
            IpAddr::V4(_) => (*a, 32),
            IpAddr::V6(_) => (*a, 128),
        };
        out.insert(host, svc_cidr::CLUSTER_IP);
    }
    out
}

/// Makes `SVC_CIDR4/6` under `pins` hold exactly `want` (writes the wanted entries
/// first, then removes the others).
pub fn write(pins: &PinDir, want: &BTreeMap<Prefix, u8>) -> Result<(), PinError> {
    let mut t4: LpmTrie<MapData, u32, u8> = pins.typed(map_names::SVC_CIDR4, Access::ReadWrite)?;
    let mut t6: LpmTrie<MapData, [u32; 4], u8> =
        pins.typed(map_names::SVC_CIDR6, Access::ReadWrite)?;
    let err4 = |source: MapError| PinError::Map {
        path: pins.map_path(map_names::SVC_CIDR4),
        source,
    };
    let err6 = |source: MapError| PinError::Map {
        path: pins.map_path(map_names::SVC_CIDR6),
        source,
    };
    let have4: Vec<Key<u32>> = t4.keys().collect::<Result<_, _>>().map_err(err4)?;
    let have6: Vec<Key<[u32; 4]>> = t6.keys().collect::<Result<_, _>>().map_err(err6)?;
    for ((addr, len), v) in want {
        match addr {
            IpAddr::V4(a) => t4
                .insert(&Key::new(u32::from(*len), v4_word(*a)), *v, 0)
                .map_err(err4)?,
            IpAddr::V6(a) => t6
                .insert(&Key::new(u32::from(*len), v6_words(*a)), *v, 0)
                .map_err(err6)?,
        }
    }
    for k in have4 {
        let p = (IpAddr::V4(v4_from_word(k.data())), k.prefix_len() as u8);
        if !want.contains_key(&p) {
            t4.remove(&k).map_err(err4)?;
        }
    }
    for k in have6 {
        let p = (IpAddr::V6(v6_from_words(k.data())), k.prefix_len() as u8);
        if !want.contains_key(&p) {
            t6.remove(&k).map_err(err6)?;
        }
    }
    Ok(())
}

/// The prefixes `SVC_CIDR4/6` under `pins` hold.
pub fn read(pins: &PinDir) -> Result<BTreeSet<Prefix>, PinError> {
    let t4: LpmTrie<MapData, u32, u8> = pins.typed(map_names::SVC_CIDR4, Access::ReadOnly)?;
    let t6: LpmTrie<MapData, [u32; 4], u8> = pins.typed(map_names::SVC_CIDR6, Access::ReadOnly)?;
    let mut out = BTreeSet::new();
    for k in t4.keys() {
        let k = k.map_err(|source| PinError::Map {
            path: pins.map_path(map_names::SVC_CIDR4),
            source,
        })?;
        out.insert((IpAddr::V4(v4_from_word(k.data())), k.prefix_len() as u8));
    }
    for k in t6.keys() {
        let k = k.map_err(|source| PinError::Map {
            path: pins.map_path(map_names::SVC_CIDR6),
            source,
        })?;
        out.insert((IpAddr::V6(v6_from_words(k.data())), k.prefix_len() as u8));
    }
    Ok(out)
}

/// The agent's writer of `SVC_CIDR4/6`: the ranges (`--service-cluster-ip-range` and the
/// API's `ServiceCIDR` objects) and every Service's cluster IPs, written when they
/// changed. Without any range nothing is written (the maps stay or become empty: no
/// destination is refused).
#[derive(Debug)]
pub struct SvcCidrs {
    ranges: Vec<Prefix>,
    written: Option<BTreeMap<Prefix, u8>>,
}

impl SvcCidrs {
    pub fn new(ranges: Vec<Prefix>) -> Self {
        Self {
            ranges,
            written: None,
        }
    }

    /// Writes the flag's ranges, `api_ranges` (the `ServiceCIDR` objects') and
    /// `cluster_ips` if they differ from what was written last; returns the number of
    /// entries written (`None`: unchanged, or no range now nor before).
    pub fn update<'a>(
        &mut self,
        pins: &PinDir,
        api_ranges: impl IntoIterator<Item = &'a Prefix>,
        cluster_ips: impl IntoIterator<Item = &'a IpAddr>,
    ) -> Result<Option<usize>, PinError> {
        let mut ranges = self.ranges.clone();
        ranges.extend(api_ranges);
        if ranges.is_empty() && self.written.as_ref().is_none_or(BTreeMap::is_empty) {
            return Ok(None);
        }
        let want = if ranges.is_empty() {
            BTreeMap::new()
        } else {
            wanted(&ranges, cluster_ips)
        };
        if self.written.as_ref() == Some(&want) {
            return Ok(None);
        }
        write(pins, &want)?;
        Ok(Some(self.written.insert(want).len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_ip_marker_wins_over_a_range_and_ranges_are_normalized() {
        let ranges = [
            ("10.96.1.7".parse().expect("ip"), 16),
            ("10.96.0.10".parse().expect("ip"), 32),
        ];
        let vip: IpAddr = "10.96.0.10".parse().expect("ip");
        let w = wanted(&ranges, [&vip]);
        assert_eq!(
            w.into_iter().collect::<Vec<_>>(),
            vec![
                (("10.96.0.0".parse().expect("ip"), 16), svc_cidr::RANGE),
                ((vip, 32), svc_cidr::CLUSTER_IP),
            ]
        );
    }
}
