//! The part of Maglev consistent hashing that the datapath and user space must compute the
//! same way: the flow hash that indexes a table, and where a table index lives in the
//! `MAGLEV` map. Written once here, used by `proxy-ebpf/src/tc/` for new flows and by
//! `proxy-user` (`maglev.rs`: the table population; `proxyctl explain`; the tests that
//! check the kernel and user space agree).
//!
//! The hash is the Linux kernel's `jhash2` (Bob Jenkins' lookup3) over the flow's 5-tuple
//! as it appears in the packet, with a fixed initial value: deterministic, the same on
//! every node (not `bpf_get_prandom_u32`, not the skb hash, which depends on the receiving
//! NIC's RSS key), so two nodes that got one flow (ECMP, a rehash after a node failure)
//! index the same table entry.

use crate::limits::MAGLEV_CHUNK_SLOTS;

/// jhash's initial value (`JHASH_INITVAL`).
const INITVAL: u32 = 0xdead_beef;

#[inline(always)]
fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(4);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(6);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(8);
    *b = b.wrapping_add(*a);
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(16);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(19);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(4);
    *b = b.wrapping_add(*a);
}

#[inline(always)]
fn final_mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(14));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(11));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(25));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(16));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(4));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(14));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(24));
}

/// `jhash2(words, 10, 0)`.
#[inline(always)]
fn jhash10(k: &[u32; 10]) -> u32 {
    let init = INITVAL.wrapping_add(10 << 2);
    let (mut a, mut b, mut c) = (init, init, init);
    let mut i = 0;
    while i < 9 {
        a = a.wrapping_add(k[i]);
        b = b.wrapping_add(k[i + 1]);
        c = c.wrapping_add(k[i + 2]);
        mix(&mut a, &mut b, &mut c);
        i += 3;
    }
    a = a.wrapping_add(k[9]);
    final_mix(&mut a, &mut b, &mut c);
    c
}

/// The hash of a flow's 5-tuple as the maps and packets hold it: addresses as four
/// network-order words (an IPv4 address in the first word, the others zero), ports in
/// network order, the IP protocol number.
#[inline(always)]
pub fn flow_hash(saddr: [u32; 4], daddr: [u32; 4], sport: u16, dport: u16, proto: u8) -> u32 {
    let ports = (u32::from(sport) << 16) | u32::from(dport);
    jhash10(&[
        saddr[0],
        saddr[1],
        saddr[2],
        saddr[3],
        daddr[0],
        daddr[1],
        daddr[2],
        daddr[3],
        ports,
        u32::from(proto),
    ])
}

/// Where entry `index` of a table lives: `(chunk, offset in the chunk)`.
#[inline(always)]
pub fn locate(index: u32) -> (u32, usize) {
    let n = MAGLEV_CHUNK_SLOTS as u32;
    (index / n, (index % n) as usize)
}

/// Chunks a table of `table_size` entries takes.
pub const fn chunks(table_size: u32) -> u32 {
    table_size.div_ceil(MAGLEV_CHUNK_SLOTS as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_hash_is_deterministic_and_sees_every_field() {
        let h0 = flow_hash([0; 4], [0; 4], 0, 0, 0);
        assert_eq!(h0, flow_hash([0; 4], [0; 4], 0, 0, 0));
        assert_ne!(h0, flow_hash([0; 4], [0; 4], 0, 0, 17));
        assert_ne!(h0, flow_hash([0, 0, 0, 1], [0; 4], 0, 0, 0));
        assert_ne!(h0, flow_hash([0; 4], [0, 0, 0, 1], 0, 0, 0));
        let a = flow_hash(
            [0x0100_000a, 0, 0, 0],
            [0x0200_000a, 0, 0, 0],
            0x1f90,
            0x5000,
            6,
        );
        let b = flow_hash(
            [0x0100_000a, 0, 0, 0],
            [0x0200_000a, 0, 0, 0],
            0x1f91,
            0x5000,
            6,
        );
        assert_ne!(a, b);
        assert_ne!(a, h0);
    }

    #[test]
    fn chunks_cover_tables() {
        assert_eq!(chunks(16381), 9);
        assert_eq!(chunks(251), 1);
        assert_eq!(locate(2012), (1, 0));
        assert_eq!(locate(2011), (0, 2011));
    }
}
