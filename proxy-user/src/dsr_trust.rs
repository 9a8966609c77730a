//! Who may send a packet with the DSR option (`--forwarding-mode dsr|hybrid`): the
//! backend's node honours the option (replies to the client with the frontend as source)
//! only from the prefixes in `DSR_TRUSTED4/6`, which the agent writes here: every Node
//! object's `InternalIP`/`ExternalIP` address (/32, /128) and `--dsr-trusted-cidrs`.
//! Anyone else could otherwise make a node answer with a Service's address as source;
//! such packets are counted `tc_dsr_untrusted` and their option ignored.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    MapData, MapError,
};
use proxy_common::map_names;

use crate::{
    model::{v4_word, v6_words},
    pins::{Access, PinDir, PinError},
};

/// A prefix: the address with its host bits cleared, and its length.
pub type Prefix = (IpAddr, u8);

/// `addr/len` with the bits past `len` cleared (`len` capped at the family's width).
pub fn normalize((addr, len): Prefix) -> Prefix {
    match addr {
        IpAddr::V4(a) => {
            let len = len.min(32);
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            (IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask)), len)
        }
        IpAddr::V6(a) => {
            let len = len.min(128);
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            (IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask)), len)
        }
    }
}

/// The trusted prefixes: each node address as a host prefix, and `cidrs`.
pub fn trusted_prefixes<'a>(
    node_addrs: impl IntoIterator<Item = &'a IpAddr>,
    cidrs: &[Prefix],
) -> BTreeSet<Prefix> {
    let hosts = node_addrs.into_iter().map(|a| match a {
        IpAddr::V4(_) => (*a, 32),
        IpAddr::V6(_) => (*a, 128),
    });
    hosts.chain(cidrs.iter().copied()).map(normalize).collect()
}

/// Makes `DSR_TRUSTED4/6` under `pins` hold exactly `want` (adds the new prefixes
/// first, then removes the ones no longer wanted, so a node in both sets stays trusted
/// throughout).
pub fn write(pins: &PinDir, want: &BTreeSet<Prefix>) -> Result<(), PinError> {
    let mut t4: LpmTrie<MapData, u32, u8> =
        pins.typed(map_names::DSR_TRUSTED4, Access::ReadWrite)?;
    let mut t6: LpmTrie<MapData, [u32; 4], u8> =
        pins.typed(map_names::DSR_TRUSTED6, Access::ReadWrite)?;
    let err4 = |source: MapError| PinError::Map {
        path: pins.map_path(map_names::DSR_TRUSTED4),
        source,
    };
    let err6 = |source: MapError| PinError::Map {
        path: pins.map_path(map_names::DSR_TRUSTED6),
        source,
    };
    let have4: Vec<Key<u32>> = t4.keys().collect::<Result<_, _>>().map_err(err4)?;
    let have6: Vec<Key<[u32; 4]>> = t6.keys().collect::<Result<_, _>>().map_err(err6)?;
    for (addr, len) in want {
        match addr {
            IpAddr::V4(a) => t4
                .insert(&Key::new(u32::from(*len), v4_word(*a)), 1, 0)
                .map_err(err4)?,
            IpAddr::V6(a) => t6
                .insert(&Key::new(u32::from(*len), v6_words(*a)), 1, 0)
                .map_err(err6)?,
        }
    }
    for k in have4 {
        let p = (
            IpAddr::V4(crate::model::v4_from_word(k.data())),
            k.prefix_len() as u8,
        );
        if !want.contains(&p) {
            t4.remove(&k).map_err(err4)?;
        }
    }
    for k in have6 {
        let p = (
            IpAddr::V6(crate::model::v6_from_words(k.data())),
            k.prefix_len() as u8,
        );
        if !want.contains(&p) {
            t6.remove(&k).map_err(err6)?;
        }
    }
    Ok(())
}

/// What `DSR_TRUSTED4/6` under `pins` hold.
pub fn read(pins: &PinDir) -> Result<BTreeSet<Prefix>, PinError> {
    let t4: LpmTrie<MapData, u32, u8> = pins.typed(map_names::DSR_TRUSTED4, Access::ReadOnly)?;
    let t6: LpmTrie<MapData, [u32; 4], u8> =
        pins.typed(map_names::DSR_TRUSTED6, Access::ReadOnly)?;
    let mut out = BTreeSet::new();
    for k in t4.keys() {
        let k = k.map_err(|source| PinError::Map {
            path: pins.map_path(map_names::DSR_TRUSTED4),
            source,
        })?;
        out.insert((
            IpAddr::V4(crate::model::v4_from_word(k.data())),
            k.prefix_len() as u8,
        ));
    }
    for k in t6.keys() {
        let k = k.map_err(|source| PinError::Map {
            path: pins.map_path(map_names::DSR_TRUSTED6),
            source,
        })?;
        out.insert((
            IpAddr::V6(crate::model::v6_from_words(k.data())),
            k.prefix_len() as u8,
        ));
    }
    Ok(out)
}

/// The agent's writer of `DSR_TRUSTED4/6`: writes when the set changed.
#[derive(Debug)]
pub struct DsrTrust {
    cidrs: Vec<Prefix>,
    written: Option<BTreeSet<Prefix>>,
}

impl DsrTrust {
    pub fn new(cidrs: Vec<Prefix>) -> Self {
        Self {
            cidrs,
            written: None,
        }
    }

    /// Writes the node addresses and the configured prefixes if they differ from what
    /// was written last; returns the set written (`None`: unchanged).
    pub fn update<'a>(
        &mut self,
        pins: &PinDir,
        node_addrs: impl IntoIterator<Item = &'a IpAddr>,
    ) -> Result<Option<&BTreeSet<Prefix>>, PinError> {
        let want = trusted_prefixes(node_addrs, &self.cidrs);
        if self.written.as_ref() == Some(&want) {
            return Ok(None);
        }
        write(pins, &want)?;
        Ok(Some(self.written.insert(want)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn node_addresses_are_host_prefixes_and_cidrs_are_normalized() {
        let nodes = [ip("192.0.2.7"), ip("2001:db8::7"), ip("192.0.2.7")];
        let set = trusted_prefixes(
            &nodes,
            &[
                (ip("10.1.2.3"), 16),
                (ip("2001:db8:1::9"), 48),
                (ip("::"), 0),
            ],
        );
        let want: BTreeSet<Prefix> = [
            (ip("192.0.2.7"), 32),
            (ip("2001:db8::7"), 128),
            (ip("10.1.0.0"), 16),
            (ip("2001:db8:1::"), 48),
            (ip("::"), 0),
        ]
        .into_iter()
        .collect();
        assert_eq!(set, want);
        assert_eq!(normalize((ip("10.1.2.3"), 40)), (ip("10.1.2.3"), 32));
        assert_eq!(normalize((ip("10.1.2.3"), 0)), (ip("0.0.0.0"), 0));
    }
}
