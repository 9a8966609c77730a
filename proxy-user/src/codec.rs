//! The one conversion between the map ABI (`proxy_common`'s key and value structs, in
//! network order where the datapath wants it) and the model (`model`, `store`). Used by
//! the store over the pinned maps (`bpf`) and by `proxyctl`'s readers (`ctl::maps`).

use std::net::{IpAddr, SocketAddr};

use aya::{maps::lpm_trie::Key as LpmKey, Pod};
use proxy_common::{
    map_names as names, Backend4, Backend6, NodeConfig, RevNat4, RevNat6, SrcRange4, SrcRange6,
    Svc4Key, Svc6Key, SvcEntry, SvcValue, NAME_LEN, SVC_CHUNK_SLOTS,
};

use crate::{
    model::{
        name_bytes, name_from_bytes, port_host, port_net, v4_from_word, v4_word, v6_from_words,
        v6_words, Backend, Family, Frontend, Proto,
    },
    store::{Dump, FrontendValue, Snat},
};

/// One address family's side of the map ABI (as the kernel's `lb::Family`): its map
/// names, key and value types, the fields the decoders read, and the projection of the
/// two-family values below (`SvcKey`, ...) onto it. What differs between the `*4` and
/// `*6` maps is here; the code over them (decoding here, the store in `bpf`, `proxyctl`'s
/// readers) is written once, generic over the family.
pub trait FamilyAbi: 'static {
    /// The family, in the model.
    const FAMILY: Family;
    const SVC: &'static str;
    const BACKEND: &'static str;
    const REVNAT: &'static str;
    const NODE_ADDRS: &'static str;
    const SRC_RANGE: &'static str;
    /// Bits of an address (the longest source-range prefix).
    const ADDR_BITS: u32;
    /// An address as the maps hold it (network order).
    type Addr: Pod + Copy + PartialEq;
    type SvcKey: Pod;
    type Backend: crate::pins::BackendEntry;
    type RevNat: Pod;
    type SrcRange: Pod;

    /// The address in the model.
    fn ip(a: Self::Addr) -> IpAddr;
    /// A `SVC` key's frontend fields and chunk.
    fn svc_fields(k: &Self::SvcKey) -> (Fields<Self::Addr>, u16);
    /// A `BACKEND` value's fields (`scope` holds `backend_flags`).
    fn backend_fields(b: &Self::Backend) -> Fields<Self::Addr>;
    /// A `REVNAT` value's frontend fields and Service name.
    fn revnat_fields(r: &Self::RevNat) -> (Fields<Self::Addr>, &[u8; NAME_LEN]);
    /// A `SRC_RANGE` key's service id and address.
    fn src_range_fields(r: &Self::SrcRange) -> (u32, Self::Addr);

    /// This family's key, `None` for the other family's.
    fn svc_key(k: SvcKey) -> Option<Self::SvcKey>;
    /// This family's value, `None` for the other family's.
    fn backend_value(v: BackendValue) -> Option<Self::Backend>;
    /// This family's value, `None` for the other family's.
    fn revnat_value(v: RevNatValue) -> Option<Self::RevNat>;
    /// This family's key, `None` for the other family's.
    fn node_addr_key(k: NodeAddrKey) -> Option<Self::Addr>;
    /// This family's key, `None` for the other family's.
    fn src_range_key(k: SrcRangeKey) -> Option<LpmKey<Self::SrcRange>>;
}

/// The fields an address-port entry of either family has (network order, as stored).
#[derive(Clone, Copy, Debug)]
pub struct Fields<A> {
    pub addr: A,
    pub port: u16,
    pub proto: u8,
    /// The scope of a frontend; a backend's `backend_flags`.
    pub scope: u8,
}

/// The IPv4 maps (`SVC4`, `BACKEND4`, ...).
#[derive(Clone, Copy, Debug)]
pub struct Ipv4;

/// The IPv6 maps (`SVC6`, `BACKEND6`, ...).
#[derive(Clone, Copy, Debug)]
pub struct Ipv6;

/// Writes the [`FamilyAbi`] impl of one family: the same text for both, but for the names.
macro_rules! family_abi {
    ($fam:ident, $family:ident, $bits:expr, $addr:ty, $from:path,
     $svc:ident, $svck:ty, $backend:ident, $backendv:ty, $revnat:ident, $revnatv:ty,
     $node:ident, $srcrange:ident, $srcrangek:ty) => {
        impl FamilyAbi for $fam {
            const FAMILY: Family = Family::$family;
            const SVC: &'static str = names::$svc;
            const BACKEND: &'static str = names::$backend;
            const REVNAT: &'static str = names::$revnat;
            const NODE_ADDRS: &'static str = names::$node;
            const SRC_RANGE: &'static str = names::$srcrange;
            const ADDR_BITS: u32 = $bits;
            type Addr = $addr;
            type SvcKey = $svck;
            type Backend = $backendv;
            type RevNat = $revnatv;
            type SrcRange = $srcrangek;

            fn ip(a: $addr) -> IpAddr {
                IpAddr::from($from(a))
            }
            fn svc_fields(k: &$svck) -> (Fields<$addr>, u16) {
                let f = Fields {
                    addr: k.addr,
                    port: k.port,
                    proto: k.proto,
                    scope: k.scope,
                };
                (f, k.chunk)
            }
            fn backend_fields(b: &$backendv) -> Fields<$addr> {
                Fields {
                    addr: b.addr,
                    port: b.port,
                    proto: b.proto,
                    scope: b.flags,
                }
            }
            fn revnat_fields(r: &$revnatv) -> (Fields<$addr>, &[u8; NAME_LEN]) {
                let f = Fields {
                    addr: r.addr,
                    port: r.port,
                    proto: r.proto,
                    scope: r.scope,
                };
                (f, &r.name)
            }
            fn src_range_fields(r: &$srcrangek) -> (u32, $addr) {
                (r.service_id, r.addr)
            }
            fn svc_key(k: SvcKey) -> Option<$svck> {
                match k {
                    SvcKey::$family(k) => Some(k),
                    _ => None,
                }
            }
            fn backend_value(v: BackendValue) -> Option<$backendv> {
                match v {
                    BackendValue::$family(v) => Some(v),
                    _ => None,
                }
            }
            fn revnat_value(v: RevNatValue) -> Option<$revnatv> {
                match v {
                    RevNatValue::$family(v) => Some(v),
                    _ => None,
                }
            }
            fn node_addr_key(k: NodeAddrKey) -> Option<$addr> {
                match k {
                    NodeAddrKey::$family(k) => Some(k),
                    _ => None,
                }
            }
            fn src_range_key(k: SrcRangeKey) -> Option<LpmKey<$srcrangek>> {
                match k {
                    SrcRangeKey::$family(k) => Some(k),
                    _ => None,
                }
            }
        }
    };
}

family_abi!(
    Ipv4,
    V4,
    32,
    u32,
    v4_from_word,
    SVC4,
    Svc4Key,
    BACKEND4,
    Backend4,
    REVNAT4,
    RevNat4,
    NODE_ADDRS4,
    SRC_RANGE4,
    SrcRange4
);
family_abi!(
    Ipv6,
    V6,
    128,
    [u32; 4],
    v6_from_words,
    SVC6,
    Svc6Key,
    BACKEND6,
    Backend6,
    REVNAT6,
    RevNat6,
    NODE_ADDRS6,
    SRC_RANGE6,
    SrcRange6
);

/// A `SVC4`/`SVC6` key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SvcKey {
    V4(Svc4Key),
    V6(Svc6Key),
}

/// The `SVC` key of `fe`'s chunk `chunk` (0: the frontend itself).
pub fn svc_key(fe: &Frontend, chunk: u16) -> SvcKey {
    let (port, proto) = (port_net(fe.port), fe.proto.number());
    match fe.addr {
        IpAddr::V4(a) => SvcKey::V4(Svc4Key::new(v4_word(a), port, proto, fe.scope, chunk)),
        IpAddr::V6(a) => SvcKey::V6(Svc6Key::new(v6_words(a), port, proto, fe.scope, chunk)),
    }
}

/// An entry's backend ids: `backends` (at most [`SVC_CHUNK_SLOTS`]), then zeros.
fn chunk_backends(backends: &[u32]) -> [u32; SVC_CHUNK_SLOTS] {
    let mut out = [0; SVC_CHUNK_SLOTS];
    let n = backends.len().min(SVC_CHUNK_SLOTS);
    out[..n].copy_from_slice(&backends[..n]);
    out
}

/// The frontend's entry (chunk 0): its fields and the backend ids of slots `1..=24`.
pub fn frontend_value(v: &FrontendValue, backends: &[u32]) -> SvcEntry {
    SvcEntry {
        head: SvcValue {
            service_id: v.service_id,
            count: v.count,
            flags: v.flags,
            affinity_timeout: v.affinity_timeout,
        },
        backends: chunk_backends(backends),
    }
}

/// The entry of a further chunk (`>= 1`): the service id (for dumps) and its ids.
pub fn chunk_value(service_id: u32, backends: &[u32]) -> SvcEntry {
    SvcEntry {
        head: SvcValue {
            service_id,
            ..SvcValue::default()
        },
        backends: chunk_backends(backends),
    }
}

/// The frontend's fields, read back.
pub fn decode_frontend_value(v: &SvcValue) -> FrontendValue {
    FrontendValue {
        service_id: v.service_id,
        count: v.count,
        flags: v.flags,
        affinity_timeout: v.affinity_timeout,
    }
}

/// The frontend of a stored address, port, protocol and scope; `None` for an unknown
/// protocol.
fn decode_frontend<F: FamilyAbi>(f: &Fields<F::Addr>) -> Option<Frontend> {
    let proto = Proto::from_number(f.proto)?;
    Some(Frontend::new(F::ip(f.addr), port_host(f.port), proto).with_scope(f.scope))
}

/// The frontend and chunk of a `SVC4`/`SVC6` key; `None` for an unknown protocol.
pub fn decode_svc<F: FamilyAbi>(k: &F::SvcKey) -> Option<(Frontend, u16)> {
    let (f, chunk) = F::svc_fields(k);
    Some((decode_frontend::<F>(&f)?, chunk))
}

/// The protocol number a `SVC` key holds (for the error naming an unknown one).
pub fn svc_proto<F: FamilyAbi>(k: &F::SvcKey) -> u8 {
    F::svc_fields(k).0.proto
}

/// [`put_svc`] into vectors (built into the dump's maps in bulk).
pub fn push_svc(
    frontends: &mut Vec<(Frontend, crate::store::FrontendValue)>,
    slots: &mut Vec<((Frontend, u16), u32)>,
    fe: Frontend,
    chunk: u16,
    v: &SvcEntry,
) {
    if chunk == 0 {
        frontends.push((fe, decode_frontend_value(&v.head)));
    }
    slots.extend(crate::store::chunk_slots(chunk, &v.backends).map(|(slot, id)| ((fe, slot), id)));
}

/// Puts one `SVC` entry read back into a dump: chunk 0 as the frontend and its slots,
/// the others as their slots.
pub fn put_svc(d: &mut Dump, fe: Frontend, chunk: u16, v: &SvcEntry) {
    if chunk == 0 {
        d.frontends.insert(fe, decode_frontend_value(&v.head));
    }
    d.set_chunk(fe, chunk, &v.backends);
}

/// A `BACKEND4`/`BACKEND6` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendValue {
    V4(Backend4),
    V6(Backend6),
}

pub fn backend_value(b: &Backend, proto: Proto) -> BackendValue {
    match b.addr {
        SocketAddr::V4(a) => BackendValue::V4(Backend4 {
            addr: v4_word(*a.ip()),
            port: port_net(a.port()),
            proto: proto.number(),
            flags: b.flags,
        }),
        SocketAddr::V6(a) => BackendValue::V6(Backend6 {
            addr: v6_words(*a.ip()),
            port: port_net(a.port()),
            proto: proto.number(),
            flags: b.flags,
        }),
    }
}

/// A `BACKEND4`/`BACKEND6` value read back; `None` for an unknown protocol.
pub fn decode_backend<F: FamilyAbi>(b: &F::Backend) -> Option<(Backend, Proto)> {
    let f = F::backend_fields(b);
    let proto = Proto::from_number(f.proto)?;
    let addr = SocketAddr::from((F::ip(f.addr), port_host(f.port)));
    Some((
        Backend {
            addr,
            flags: f.scope,
        },
        proto,
    ))
}

/// The protocol number a `BACKEND` value holds (for the error naming an unknown one).
pub fn backend_proto<F: FamilyAbi>(b: &F::Backend) -> u8 {
    F::backend_fields(b).proto
}

/// A `REVNAT4`/`REVNAT6` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RevNatValue {
    V4(RevNat4),
    V6(RevNat6),
}

pub fn revnat_value(fe: &Frontend, name: &str) -> RevNatValue {
    let (port, proto, scope, name) = (
        port_net(fe.port),
        fe.proto.number(),
        fe.scope,
        name_bytes(name),
    );
    match fe.addr {
        IpAddr::V4(a) => RevNatValue::V4(RevNat4 {
            addr: v4_word(a),
            port,
            proto,
            scope,
            name,
        }),
        IpAddr::V6(a) => RevNatValue::V6(RevNat6 {
            addr: v6_words(a),
            port,
            proto,
            scope,
            name,
        }),
    }
}

/// A `REVNAT4`/`REVNAT6` value read back: the frontend and the Service name; `None` for
/// an unknown protocol.
pub fn decode_revnat<F: FamilyAbi>(r: &F::RevNat) -> Option<(Frontend, String)> {
    let (f, name) = F::revnat_fields(r);
    Some((decode_frontend::<F>(&f)?, name_from_bytes(name)))
}

/// The protocol number a `REVNAT` value holds (for the error naming an unknown one).
pub fn revnat_proto<F: FamilyAbi>(r: &F::RevNat) -> u8 {
    F::revnat_fields(r).0.proto
}

/// A `SRC_RANGE4`/`SRC_RANGE6` key: the prefix length counts the 32 bits of the service
/// id first, then the address prefix.
#[derive(Clone, Copy)]
pub enum SrcRangeKey {
    V4(LpmKey<SrcRange4>),
    V6(LpmKey<SrcRange6>),
}

pub fn src_range_key(service_id: u32, addr: IpAddr, prefix: u8) -> SrcRangeKey {
    let len = 32 + u32::from(prefix);
    match addr {
        IpAddr::V4(a) => SrcRangeKey::V4(LpmKey::new(
            len,
            SrcRange4 {
                service_id,
                addr: v4_word(a),
            },
        )),
        IpAddr::V6(a) => SrcRangeKey::V6(LpmKey::new(
            len,
            SrcRange6 {
                service_id,
                addr: v6_words(a),
            },
        )),
    }
}

/// A `SRC_RANGE4`/`SRC_RANGE6` key read back: (service id, address, prefix length).
pub fn decode_src_range<F: FamilyAbi>(k: &LpmKey<F::SrcRange>) -> (u32, IpAddr, u8) {
    let (service_id, addr) = F::src_range_fields(&k.data());
    let len = k.prefix_len().saturating_sub(32).min(F::ADDR_BITS) as u8;
    (service_id, F::ip(addr), len)
}

/// A `NODE_ADDRS4`/`NODE_ADDRS6` key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeAddrKey {
    V4(u32),
    V6([u32; 4]),
}

pub fn node_addr_key(a: IpAddr) -> NodeAddrKey {
    match a {
        IpAddr::V4(a) => NodeAddrKey::V4(v4_word(a)),
        IpAddr::V6(a) => NodeAddrKey::V6(v6_words(a)),
    }
}

/// A `NODE_ADDRS4`/`NODE_ADDRS6` key read back.
pub fn decode_node_addr<F: FamilyAbi>(k: F::Addr) -> IpAddr {
    F::ip(k)
}

/// `NODE_CONFIG[0]` (zero: no SNAT address for that family).
pub fn node_config(s: &Snat) -> NodeConfig {
    NodeConfig {
        snat4: s.v4.map_or(0, v4_word),
        snat6: s.v6.map_or([0; 4], v6_words),
    }
}

pub fn decode_node_config(c: &NodeConfig) -> Snat {
    Snat {
        v4: (c.snat4 != 0).then(|| v4_from_word(c.snat4)),
        v6: (c.snat6 != [0; 4]).then(|| v6_from_words(c.snat6)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_common::scope;

    fn fe(s: &str, port: u16, proto: Proto) -> Frontend {
        Frontend::new(s.parse::<IpAddr>().expect("ip"), port, proto)
    }

    #[test]
    fn svc_keys_are_network_order_and_decode_back() {
        let f = fe("10.96.0.10", 443, Proto::Tcp).with_scope(scope::EXTERNAL_LOCAL);
        let SvcKey::V4(k) = svc_key(&f, 3) else {
            panic!("a v4 key")
        };
        // The datapath compares against `user_ip4` / `user_port`: network byte order.
        assert_eq!(k.addr.to_ne_bytes(), [10, 96, 0, 10]);
        assert_eq!(k.port.to_ne_bytes(), 443u16.to_be_bytes());
        assert_eq!((k.chunk, k.proto, k.scope), (3, 6, scope::EXTERNAL_LOCAL));
        assert_eq!(decode_svc::<Ipv4>(&k).map(|(f, _)| f), Some(f));

        let f6 = fe("fd00:96::a", 53, Proto::Udp);
        let SvcKey::V6(k6) = svc_key(&f6, 0) else {
            panic!("a v6 key")
        };
        assert_eq!(k6.addr[0].to_ne_bytes(), [0xfd, 0, 0, 0x96]);
        assert_eq!(k6.addr[3].to_ne_bytes(), [0, 0, 0, 0x0a]);
        assert_eq!(decode_svc::<Ipv6>(&k6).map(|(f, _)| f), Some(f6));

        let mut bad = k;
        bad.proto = 1;
        assert_eq!(
            decode_svc::<Ipv4>(&bad).map(|(f, _)| f),
            None,
            "ICMP is no frontend protocol"
        );
    }

    #[test]
    fn chunked_slots_round_trip_into_a_dump() {
        let f = fe("10.96.0.10", 80, Proto::Tcp);
        let v = FrontendValue {
            service_id: 7,
            count: 26,
            flags: proxy_common::svc_flags::AFFINITY,
            affinity_timeout: 10800,
        };
        // Slots 1..=24 in the frontend's own entry, 25 and 26 in chunk 1.
        let ids: Vec<u32> = (100..126).collect();
        let raw = frontend_value(&v, &ids[..24]);
        assert_eq!(raw.backends[23], 123, "slot 24 is the entry's last");
        assert_eq!(decode_frontend_value(&raw.head), v);
        let more = chunk_value(7, &ids[24..]);
        assert_eq!((more.head.count, more.head.service_id), (0, 7));
        assert_eq!(&more.backends[..3], &[124, 125, 0], "zero past the count");
        let mut d = Dump::default();
        put_svc(&mut d, f, 0, &raw);
        put_svc(&mut d, f, 1, &more);
        assert_eq!(d.frontends.get(&f), Some(&v));
        let slots: Vec<(u16, u32)> = d.slots.iter().map(|((_, s), id)| (*s, *id)).collect();
        let want: Vec<(u16, u32)> = (1..=26).zip(100..126).collect();
        assert_eq!(
            slots, want,
            "slot n names ids[n - 1], across the chunk boundary"
        );
        // A chunk rewritten with fewer ids loses the rest of its slots.
        put_svc(&mut d, f, 1, &chunk_value(7, &[124]));
        assert_eq!(d.slots.len(), 25);
        assert_eq!(proxy_common::svc_chunk_of(25), (1, 0));
        assert_eq!(proxy_common::svc_chunk_of(24), (0, 23));
    }

    #[test]
    fn backends_round_trip_with_flags_and_protocol() {
        for (addr, proto) in [
            ("10.0.1.1:8080", Proto::Tcp),
            ("[fd00:10::1]:53", Proto::Udp),
            ("10.0.1.2:9", Proto::Sctp),
        ] {
            let b = Backend {
                addr: addr.parse().expect("addr"),
                flags: proxy_common::backend_flags::TERMINATING,
            };
            let back = match backend_value(&b, proto) {
                BackendValue::V4(v) => {
                    assert_eq!(v.port, port_net(b.addr.port()));
                    decode_backend::<Ipv4>(&v)
                }
                BackendValue::V6(v) => decode_backend::<Ipv6>(&v),
            };
            assert_eq!(back, Some((b, proto)), "{addr}");
        }
        let mut v =
            match backend_value(&Backend::new("10.0.1.1:80".parse().expect("a")), Proto::Tcp) {
                BackendValue::V4(v) => v,
                BackendValue::V6(_) => panic!("v4"),
            };
        v.proto = 0;
        assert_eq!(decode_backend::<Ipv4>(&v), None);
    }

    #[test]
    fn revnat_keeps_the_name_truncated_to_the_abi_length() {
        let f = fe("fd00:96::1", 80, Proto::Tcp).with_scope(scope::EXTERNAL_LOCAL);
        let RevNatValue::V6(r) = revnat_value(&f, "default/web:http") else {
            panic!("v6")
        };
        assert_eq!(
            decode_revnat::<Ipv6>(&r),
            Some((f, "default/web:http".into()))
        );
        let long = "n".repeat(proxy_common::NAME_LEN + 10);
        let f4 = fe("10.96.0.1", 80, Proto::Udp);
        let RevNatValue::V4(r4) = revnat_value(&f4, &long) else {
            panic!("v4")
        };
        let (back, name) = decode_revnat::<Ipv4>(&r4).expect("decodes");
        assert_eq!(back, f4);
        assert!(long.starts_with(&name) && name.len() < long.len(), "{name}");
    }

    #[test]
    fn source_ranges_count_the_service_id_in_the_prefix() {
        let SrcRangeKey::V4(k) = src_range_key(9, "192.0.2.0".parse().expect("ip"), 24) else {
            panic!("v4")
        };
        assert_eq!(k.prefix_len(), 32 + 24);
        assert_eq!(
            decode_src_range::<Ipv4>(&k),
            (9, "192.0.2.0".parse().expect("ip"), 24)
        );
        let SrcRangeKey::V6(k6) = src_range_key(9, "2001:db8::".parse().expect("ip"), 32) else {
            panic!("v6")
        };
        assert_eq!(k6.prefix_len(), 64);
        assert_eq!(
            decode_src_range::<Ipv6>(&k6),
            (9, "2001:db8::".parse().expect("ip"), 32)
        );
    }

    #[test]
    fn node_config_zero_means_no_snat_address() {
        let none = Snat::default();
        assert_eq!(node_config(&none), NodeConfig::default());
        assert_eq!(decode_node_config(&NodeConfig::default()), none);
        let s = Snat {
            v4: Some("192.0.2.10".parse().expect("ip")),
            v6: Some("2001:db8::10".parse().expect("ip")),
        };
        let raw = node_config(&s);
        assert_eq!(raw.snat4.to_ne_bytes(), [192, 0, 2, 10]);
        assert_eq!(decode_node_config(&raw), s);
        let a: IpAddr = "2001:db8::10".parse().expect("ip");
        match node_addr_key(a) {
            NodeAddrKey::V6(k) => assert_eq!(decode_node_addr::<Ipv6>(k), a),
            NodeAddrKey::V4(_) => panic!("v6"),
        }
        let a4: IpAddr = "192.0.2.10".parse().expect("ip");
        match node_addr_key(a4) {
            NodeAddrKey::V4(k) => assert_eq!(decode_node_addr::<Ipv4>(k), a4),
            NodeAddrKey::V6(_) => panic!("v4"),
        }
    }
}
