//! Crafted packets for `BPF_PROG_TEST_RUN`: built with valid checksums, parsed checking
//! every checksum. Pure (std only): shared by the tests (`support::tc` re-exports it) and
//! `bench-prog-run`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;

/// A TCP or UDP packet, built and parsed (Ethernet + IPv4/IPv6 + L4, no options).
#[derive(Clone, Debug, PartialEq)]
pub struct Pkt {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub proto: u8,
    pub flags: u8,
    pub seq: u32,
    pub payload: Vec<u8>,
}

pub fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

pub fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

pub fn pseudo(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            p.extend(s.octets());
            p.extend(d.octets());
            p.extend([0, proto]);
            p.extend((len as u16).to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            p.extend(s.octets());
            p.extend(d.octets());
            p.extend((len as u32).to_be_bytes());
            p.extend([0, 0, 0, proto]);
        }
        _ => panic!("mixed families"),
    }
    p
}

impl Pkt {
    pub fn tcp(src: &str, dst: &str, flags: u8) -> Self {
        Self {
            src: src.parse().expect("src"),
            dst: dst.parse().expect("dst"),
            proto: TCP,
            flags,
            seq: 1000,
            payload: Vec::new(),
        }
    }

    pub fn udp(src: &str, dst: &str) -> Self {
        Self {
            proto: UDP,
            flags: 0,
            payload: b"query".to_vec(),
            ..Self::tcp(src, dst, 0)
        }
    }

    pub fn build(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend(self.src.port().to_be_bytes());
        l4.extend(self.dst.port().to_be_bytes());
        if self.proto == TCP {
            l4.extend(self.seq.to_be_bytes());
            l4.extend(0u32.to_be_bytes());
            l4.extend([5 << 4, self.flags]);
            l4.extend(64240u16.to_be_bytes());
            l4.extend([0, 0, 0, 0]);
        } else {
            l4.extend(((8 + self.payload.len()) as u16).to_be_bytes());
            l4.extend([0, 0]);
        }
        l4.extend(&self.payload);
        let csum_at = if self.proto == TCP { 16 } else { 6 };
        let mut all = pseudo(self.src.ip(), self.dst.ip(), self.proto, l4.len());
        all.extend(&l4);
        let mut c = fold(sum16(&all));
        if self.proto == UDP && c == 0 {
            // RFC 768: a computed zero is sent as all ones (zero means "no checksum").
            c = 0xffff;
        }
        l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
        let mut out = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
        match (self.src.ip(), self.dst.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                out.extend([0x08, 0x00]);
                let mut ip = vec![0x45, 0];
                ip.extend(((20 + l4.len()) as u16).to_be_bytes());
                ip.extend([0, 1, 0x40, 0, 64, self.proto, 0, 0]);
                ip.extend(s.octets());
                ip.extend(d.octets());
                let c = fold(sum16(&ip));
                ip[10..12].copy_from_slice(&c.to_be_bytes());
                out.extend(ip);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                out.extend([0x86, 0xdd]);
                out.extend([0x60, 0, 0, 0]);
                out.extend((l4.len() as u16).to_be_bytes());
                out.extend([self.proto, 64]);
                out.extend(s.octets());
                out.extend(d.octets());
            }
            _ => panic!("mixed families"),
        }
        out.extend(l4);
        out
    }

    /// Parses a frame, asserting that every checksum is right.
    pub fn parse(frame: &[u8]) -> Self {
        let (src_ip, dst_ip, proto, l4): (IpAddr, IpAddr, u8, &[u8]) = match [frame[12], frame[13]]
        {
            [0x08, 0x00] => {
                let ip = &frame[14..34];
                assert_eq!(fold(sum16(ip)), 0, "IPv4 header checksum");
                let s: [u8; 4] = ip[12..16].try_into().expect("4");
                let d: [u8; 4] = ip[16..20].try_into().expect("4");
                (
                    Ipv4Addr::from(s).into(),
                    Ipv4Addr::from(d).into(),
                    ip[9],
                    &frame[34..],
                )
            }
            [0x86, 0xdd] => {
                let ip = &frame[14..54];
                let s: [u8; 16] = ip[8..24].try_into().expect("16");
                let d: [u8; 16] = ip[24..40].try_into().expect("16");
                (
                    Ipv6Addr::from(s).into(),
                    Ipv6Addr::from(d).into(),
                    ip[6],
                    &frame[54..],
                )
            }
            other => panic!("ethertype {other:?}"),
        };
        let mut all = pseudo(src_ip, dst_ip, proto, l4.len());
        all.extend(l4);
        assert_eq!(fold(sum16(&all)), 0, "L4 checksum of {src_ip} -> {dst_ip}");
        let port = |o: usize| u16::from_be_bytes([l4[o], l4[o + 1]]);
        let (flags, seq, payload) = if proto == TCP {
            let off = usize::from(l4[12] >> 4) * 4;
            (
                l4[13],
                u32::from_be_bytes(l4[4..8].try_into().expect("4")),
                l4[off..].to_vec(),
            )
        } else {
            (0, 1000, l4[8..].to_vec())
        };
        Self {
            src: SocketAddr::new(src_ip, port(0)),
            dst: SocketAddr::new(dst_ip, port(2)),
            proto,
            flags,
            seq,
            payload,
        }
    }
}

/// An ICMP(v6) error from `router` to `to` quoting the first bytes of `inner` (its IP
/// header and 8 bytes of L4), with valid checksums.
pub fn icmp_error(router: IpAddr, to: IpAddr, kind: u8, inner: &Pkt) -> Vec<u8> {
    let frame = inner.build();
    let quoted_len = if inner.src.is_ipv4() { 20 + 8 } else { 40 + 8 };
    let quoted = &frame[14..14 + quoted_len];
    let mut icmp = vec![kind, 4, 0, 0, 0, 0, 0x05, 0xdc];
    icmp.extend(quoted);
    let mut out = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
    match (router, to) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let c = fold(sum16(&icmp));
            icmp[2..4].copy_from_slice(&c.to_be_bytes());
            out.extend([0x08, 0x00]);
            let mut ip = vec![0x45, 0];
            ip.extend(((20 + icmp.len()) as u16).to_be_bytes());
            ip.extend([0, 1, 0, 0, 64, 1, 0, 0]);
            ip.extend(s.octets());
            ip.extend(d.octets());
            let c = fold(sum16(&ip));
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            out.extend(ip);
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut all = pseudo(router, to, 58, icmp.len());
            all.extend(&icmp);
            let c = fold(sum16(&all));
            icmp[2..4].copy_from_slice(&c.to_be_bytes());
            out.extend([0x86, 0xdd, 0x60, 0, 0, 0]);
            out.extend((icmp.len() as u16).to_be_bytes());
            out.extend([58, 64]);
            out.extend(s.octets());
            out.extend(d.octets());
        }
        _ => panic!("mixed families"),
    }
    out.extend(icmp);
    out
}

/// Parses an ICMP(v6) error, checking the outer, ICMP and inner IPv4 header checksums:
/// (outer source, outer destination, inner source, inner destination).
pub fn parse_icmp_error(frame: &[u8]) -> (IpAddr, IpAddr, SocketAddr, SocketAddr) {
    let v4 = frame[12..14] == [0x08, 0x00];
    let (outer_src, outer_dst, icmp): (IpAddr, IpAddr, &[u8]) = if v4 {
        let ip = &frame[14..34];
        assert_eq!(fold(sum16(ip)), 0, "outer IPv4 checksum");
        let s: [u8; 4] = ip[12..16].try_into().expect("4");
        let d: [u8; 4] = ip[16..20].try_into().expect("4");
        (
            Ipv4Addr::from(s).into(),
            Ipv4Addr::from(d).into(),
            &frame[34..],
        )
    } else {
        let s: [u8; 16] = frame[22..38].try_into().expect("16");
        let d: [u8; 16] = frame[38..54].try_into().expect("16");
        (
            Ipv6Addr::from(s).into(),
            Ipv6Addr::from(d).into(),
            &frame[54..],
        )
    };
    if v4 {
        assert_eq!(fold(sum16(icmp)), 0, "ICMP checksum");
        let inner = &icmp[8..28];
        assert_eq!(fold(sum16(inner)), 0, "inner IPv4 header checksum");
        let s: [u8; 4] = inner[12..16].try_into().expect("4");
        let d: [u8; 4] = inner[16..20].try_into().expect("4");
        let l4 = &icmp[28..];
        let port = |o: usize| u16::from_be_bytes([l4[o], l4[o + 1]]);
        (
            outer_src,
            outer_dst,
            SocketAddr::new(Ipv4Addr::from(s).into(), port(0)),
            SocketAddr::new(Ipv4Addr::from(d).into(), port(2)),
        )
    } else {
        let mut all = pseudo(outer_src, outer_dst, 58, icmp.len());
        all.extend(icmp);
        assert_eq!(fold(sum16(&all)), 0, "ICMPv6 checksum");
        let inner = &icmp[8..];
        let s: [u8; 16] = inner[8..24].try_into().expect("16");
        let d: [u8; 16] = inner[24..40].try_into().expect("16");
        let port = |o: usize| u16::from_be_bytes([inner[40 + o], inner[41 + o]]);
        (
            outer_src,
            outer_dst,
            SocketAddr::new(Ipv6Addr::from(s).into(), port(0)),
            SocketAddr::new(Ipv6Addr::from(d).into(), port(2)),
        )
    }
}
