//! The ABI-3 layout (release 5dac924), frozen: the map names and the key/value structs
//! of every map an entry conversion reads, and one conversion function per map into the
//! current `proxy_common` types, field by field. Today's layout is ABI 3 itself, so each
//! function is a field-for-field copy; when a struct of `proxy_common` changes, the
//! struct literal here stops compiling at exactly the field to fill (or, for a map that
//! went away, the arm in [`super::converter`] becomes a `Convert::Drop`).

use proxy_common as cur;

use super::copy::{Convert, ConvertFn};

/// The maps pinned by ABI 3.
pub const MAP_NAMES: [&str; 19] = [
    "SVC4",
    "SVC6",
    "BACKEND4",
    "BACKEND6",
    "REVNAT4",
    "REVNAT6",
    "SOCK_REVNAT4",
    "SOCK_REVNAT6",
    "STATS",
    "BACKEND_CONNS",
    "META",
    "CT4",
    "CT6",
    "NODE_ADDRS4",
    "NODE_ADDRS6",
    "NODE_CONFIG",
    "SRC_RANGE4",
    "SRC_RANGE6",
    "AFFINITY",
];

macro_rules! pod {
    ($($(#[$m:meta])* struct $name:ident { $($f:ident: $t:ty),* $(,)? })*) => {$(
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $name { $(pub $f: $t),* }
        // SAFETY: #[repr(C)], integer fields only, explicit padding (sizes checked in
        // the tests below against ABI 3's).
        unsafe impl bytemuck::Zeroable for $name {}
        unsafe impl bytemuck::Pod for $name {}
    )*};
}

pod! {
    struct Svc4Key { addr: u32, port: u16, slot: u16, proto: u8, scope: u8, _pad: [u8; 2] }
    struct Svc6Key { addr: [u32; 4], port: u16, slot: u16, proto: u8, scope: u8, _pad: [u8; 2] }
    struct SvcValue { backend_id: u32, service_id: u32, count: u16, flags: u16, affinity_timeout: u32 }
    struct Backend4 { addr: u32, port: u16, proto: u8, flags: u8 }
    struct Backend6 { addr: [u32; 4], port: u16, proto: u8, flags: u8 }
    struct RevNat4 { addr: u32, port: u16, proto: u8, scope: u8, name: [u8; 64] }
    struct RevNat6 { addr: [u32; 4], port: u16, proto: u8, scope: u8, name: [u8; 64] }
    struct Ct4Key { saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8, dir: u8, _pad: [u8; 2] }
    struct Ct6Key { saddr: [u32; 4], daddr: [u32; 4], sport: u16, dport: u16, proto: u8, dir: u8, _pad: [u8; 2] }
    struct Ct4Value {
        dnat_addr: u32, snat_addr: u32, dnat_port: u16, snat_port: u16, service_id: u32,
        backend_id: u32, flags: u32, last_seen: u64, packets: u64,
    }
    struct Ct6Value {
        dnat_addr: [u32; 4], snat_addr: [u32; 4], dnat_port: u16, snat_port: u16,
        service_id: u32, backend_id: u32, flags: u32, last_seen: u64, packets: u64,
    }
    struct AffinityKey { client: [u32; 4], service_id: u32, kind: u8, _pad: [u8; 3] }
    struct AffinityValue { backend_id: u32, slot: u16, _pad: u16, last_used_ns: u64 }
}

type Entry = Option<(Vec<u8>, Vec<u8>)>;

/// The conversion function of an ABI-3 map whose entries are structs, for
/// [`super::converter`]'s arms (and its `copy` test mode).
/// Why ABI 3's socket reverse-NAT entries are not converted: ABI 4 keeps them in each
/// socket's own storage, which user space can reach only through the socket. The ABI-3
/// maps themselves are kept instead (`rules::kept_maps`): pinned as
/// `SOCK_REVNAT4/6_V3`, read by the new `recvmsg`/`getpeername` programs for the sockets
/// the old programs translated, each entry moved into its socket's storage on first use.
pub const SOCK_REVNAT_KEPT: &str =
    "ABI 4 keeps socket reverse-NAT entries in each socket's storage (SK_STORAGE), which \
     user space cannot write: the ABI-3 map is kept as SOCK_REVNAT4/6_V3 instead, read by \
     the new recvmsg/getpeername programs";

pub fn convert(map: &str) -> Option<Convert> {
    let f: ConvertFn = match map {
        "SVC4" => {
            return Some(Convert::Merge {
                key: svc4_key,
                into: svc4_into,
            })
        }
        "SVC6" => {
            return Some(Convert::Merge {
                key: svc6_key,
                into: svc6_into,
            })
        }
        "BACKEND4" => backend4,
        "BACKEND6" => backend6,
        "REVNAT4" => revnat4,
        "REVNAT6" => revnat6,
        "CT4" => ct4,
        "CT6" => ct6,
        "AFFINITY" => affinity,
        // ABI 4 keeps these per socket (SK_STORAGE): a socket's storage can only be
        // reached through the socket, not from here; the old maps are kept (rules.rs).
        "SOCK_REVNAT4" | "SOCK_REVNAT6" => return Some(Convert::Drop(SOCK_REVNAT_KEPT)),
        _ => return None,
    };
    Some(Convert::With(f))
}

/// Reads an old struct from bytes (`None` on a size mismatch: never trust a short entry).
fn read<T: bytemuck::Pod>(b: &[u8]) -> Option<T> {
    (b.len() == size_of::<T>()).then(|| bytemuck::pod_read_unaligned(b))
}

fn out<K: bytemuck::Pod, V: bytemuck::Pod>(k: K, v: V) -> Entry {
    Some((
        bytemuck::bytes_of(&k).to_vec(),
        bytemuck::bytes_of(&v).to_vec(),
    ))
}

/// The ABI-4 chunk of ABI-3 slot `slot` (0: the frontend itself, in chunk 0).
fn chunk_of(slot: u16) -> u16 {
    if slot == 0 {
        0
    } else {
        cur::svc_chunk_of(slot).0
    }
}

/// The ABI-4 `SVC4` key an ABI-3 entry goes into: slot 0 and slots 1..=24 into the
/// frontend's entry (chunk 0), slot `s` into chunk `(s - 1) / 24`.
pub fn svc4_key(k: &[u8]) -> Option<Vec<u8>> {
    let k: Svc4Key = read(k)?;
    let chunk = chunk_of(k.slot);
    let key = cur::Svc4Key::new(k.addr, k.port, k.proto, k.scope, chunk);
    Some(bytemuck::bytes_of(&key).to_vec())
}

/// [`svc4_key`] for `SVC6`.
pub fn svc6_key(k: &[u8]) -> Option<Vec<u8>> {
    let k: Svc6Key = read(k)?;
    let chunk = chunk_of(k.slot);
    let key = cur::Svc6Key::new(k.addr, k.port, k.proto, k.scope, chunk);
    Some(bytemuck::bytes_of(&key).to_vec())
}

/// An ABI-3 `SVC4` entry written into its ABI-4 entry `out`: slot 0's fields into the
/// head, a slot's backend id into its place in the chunk.
pub fn svc4_into(k: &[u8], v: &[u8], out: &mut [u8]) -> bool {
    read::<Svc4Key>(k).is_some_and(|k| svc_into(k.slot, v, out))
}

/// [`svc4_into`] for `SVC6`.
pub fn svc6_into(k: &[u8], v: &[u8], out: &mut [u8]) -> bool {
    read::<Svc6Key>(k).is_some_and(|k| svc_into(k.slot, v, out))
}

fn svc_into(slot: u16, v: &[u8], out: &mut [u8]) -> bool {
    let (Some(o), Some(mut e)) = (read::<SvcValue>(v), read::<cur::SvcEntry>(out)) else {
        return false;
    };
    if slot == 0 {
        e.head = cur::SvcValue {
            service_id: o.service_id,
            count: o.count,
            flags: o.flags,
            affinity_timeout: o.affinity_timeout,
        };
    } else {
        let (chunk, i) = cur::svc_chunk_of(slot);
        e.backends[i] = o.backend_id;
        if chunk > 0 {
            e.head.service_id = o.service_id;
        }
    }
    out.copy_from_slice(bytemuck::bytes_of(&e));
    true
}

pub fn backend4(k: &[u8], v: &[u8]) -> Entry {
    let (id, b): (u32, Backend4) = (read(k)?, read(v)?);
    let value = cur::Backend4 {
        addr: b.addr,
        port: b.port,
        proto: b.proto,
        flags: b.flags,
    };
    out(id, value)
}

pub fn backend6(k: &[u8], v: &[u8]) -> Entry {
    let (id, b): (u32, Backend6) = (read(k)?, read(v)?);
    let value = cur::Backend6 {
        addr: b.addr,
        port: b.port,
        proto: b.proto,
        flags: b.flags,
    };
    out(id, value)
}

pub fn revnat4(k: &[u8], v: &[u8]) -> Entry {
    let (id, r): (u32, RevNat4) = (read(k)?, read(v)?);
    let value = cur::RevNat4 {
        addr: r.addr,
        port: r.port,
        proto: r.proto,
        scope: r.scope,
        name: r.name,
    };
    out(id, value)
}

pub fn revnat6(k: &[u8], v: &[u8]) -> Entry {
    let (id, r): (u32, RevNat6) = (read(k)?, read(v)?);
    let value = cur::RevNat6 {
        addr: r.addr,
        port: r.port,
        proto: r.proto,
        scope: r.scope,
        name: r.name,
    };
    out(id, value)
}

pub fn ct4(k: &[u8], v: &[u8]) -> Entry {
    let (k, v): (Ct4Key, Ct4Value) = (read(k)?, read(v)?);
    let key = cur::Ct4Key::new(k.saddr, k.daddr, k.sport, k.dport, k.proto, k.dir);
    let value = cur::Ct4Value {
        dnat_addr: v.dnat_addr,
        snat_addr: v.snat_addr,
        dnat_port: v.dnat_port,
        snat_port: v.snat_port,
        service_id: v.service_id,
        backend_id: v.backend_id,
        flags: v.flags,
        last_seen: v.last_seen,
        packets: v.packets,
    };
    out(key, value)
}

pub fn ct6(k: &[u8], v: &[u8]) -> Entry {
    let (k, v): (Ct6Key, Ct6Value) = (read(k)?, read(v)?);
    let key = cur::Ct6Key::new(k.saddr, k.daddr, k.sport, k.dport, k.proto, k.dir);
    let value = cur::Ct6Value {
        dnat_addr: v.dnat_addr,
        snat_addr: v.snat_addr,
        dnat_port: v.dnat_port,
        snat_port: v.snat_port,
        service_id: v.service_id,
        backend_id: v.backend_id,
        flags: v.flags,
        last_seen: v.last_seen,
        packets: v.packets,
    };
    out(key, value)
}

pub fn affinity(k: &[u8], v: &[u8]) -> Entry {
    let (k, v): (AffinityKey, AffinityValue) = (read(k)?, read(v)?);
    let key = cur::AffinityKey {
        client: k.client,
        service_id: k.service_id,
        kind: k.kind,
        _pad: [0; 3],
    };
    let value = cur::AffinityValue {
        backend_id: v.backend_id,
        slot: v.slot,
        _pad: 0,
        last_used_ns: v.last_used_ns,
    };
    out(key, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frozen structs keep ABI 3's sizes (proxy-common's layout test at 5dac924).
    #[test]
    fn abi3_sizes() {
        assert_eq!(size_of::<Svc4Key>(), 12);
        assert_eq!(size_of::<Svc6Key>(), 24);
        assert_eq!(size_of::<SvcValue>(), 16);
        assert_eq!(size_of::<Backend4>(), 8);
        assert_eq!(size_of::<Backend6>(), 20);
        assert_eq!(size_of::<RevNat4>(), 72);
        assert_eq!(size_of::<RevNat6>(), 84);
        assert_eq!(size_of::<Ct4Key>(), 16);
        assert_eq!(size_of::<Ct6Key>(), 40);
        assert_eq!(size_of::<Ct4Value>(), 40);
        assert_eq!(size_of::<Ct6Value>(), 64);
        assert_eq!(size_of::<AffinityKey>(), 24);
        assert_eq!(size_of::<AffinityValue>(), 16);
    }

    #[test]
    fn conversion_keeps_every_field_and_refuses_short_entries() {
        let k = Ct4Key {
            saddr: 1,
            daddr: 2,
            sport: 3,
            dport: 4,
            proto: 6,
            dir: 1,
            _pad: [0; 2],
        };
        let v = Ct4Value {
            dnat_addr: 5,
            snat_addr: 6,
            dnat_port: 7,
            snat_port: 8,
            service_id: 9,
            backend_id: 10,
            flags: 11,
            last_seen: 12,
            packets: 13,
        };
        let (nk, nv) = ct4(bytemuck::bytes_of(&k), bytemuck::bytes_of(&v)).expect("converted");
        let nk: cur::Ct4Key = bytemuck::pod_read_unaligned(&nk);
        let nv: cur::Ct4Value = bytemuck::pod_read_unaligned(&nv);
        assert_eq!(nk, cur::Ct4Key::new(1, 2, 3, 4, 6, 1));
        assert_eq!(
            (nv.dnat_addr, nv.snat_port, nv.backend_id, nv.flags),
            (5, 8, 10, 11)
        );
        assert_eq!((nv.last_seen, nv.packets), (12, 13));
        assert_eq!(ct4(&[0; 15], bytemuck::bytes_of(&v)), None);
    }

    /// ABI 3's entry per slot merges into ABI 4's chunks: slot 0's fields and slots
    /// 1..=24 into the frontend's entry, slot 25 into chunk 1, whatever the order.
    #[test]
    fn service_slots_merge_into_chunks() {
        let key = |slot| Svc4Key {
            addr: 0x0a60_000a,
            port: 80u16.to_be(),
            slot,
            proto: 6,
            scope: 0,
            _pad: [0; 2],
        };
        let val = |backend_id, count| SvcValue {
            backend_id,
            service_id: 7,
            count,
            flags: 1,
            affinity_timeout: 30,
        };
        let mut entries: std::collections::BTreeMap<Vec<u8>, Vec<u8>> = Default::default();
        let mut old = vec![(key(0), val(0, 25))];
        old.extend((1..=25).map(|s| (key(s), val(100 + u32::from(s), 0))));
        old.reverse(); // slots before their frontend
        for (k, v) in old {
            let nk = svc4_key(bytemuck::bytes_of(&k)).expect("key");
            let e = entries
                .entry(nk)
                .or_insert_with(|| vec![0; size_of::<cur::SvcEntry>()]);
            assert!(svc4_into(bytemuck::bytes_of(&k), bytemuck::bytes_of(&v), e));
        }
        assert_eq!(entries.len(), 2, "the frontend's entry and chunk 1");
        let get = |chunk| {
            let k = cur::Svc4Key::new(0x0a60_000a, 80u16.to_be(), 6, 0, chunk);
            let v = &entries[bytemuck::bytes_of(&k)];
            bytemuck::pod_read_unaligned::<cur::SvcEntry>(v)
        };
        let front = get(0);
        assert_eq!(
            (front.head.service_id, front.head.count, front.head.flags),
            (7, 25, 1)
        );
        assert_eq!(front.head.affinity_timeout, 30);
        let want: Vec<u32> = (101..=124).collect();
        assert_eq!(front.backends.to_vec(), want);
        let more = get(1);
        assert_eq!((more.head.service_id, more.head.count), (7, 0));
        assert_eq!(&more.backends[..2], &[125, 0]);
        assert!(
            !svc4_into(&[0; 12], &[0; 8], &mut [0; 108]),
            "a short entry"
        );
    }
}
