//! Looking at the TC hooks of interfaces inside a test namespace: the filters `tc` lists in
//! a clsact qdisc, the programs attached with TCX, the programs pinned under `links/`; and
//! a guard that uninstalls a pin directory from inside the namespace that holds its
//! interfaces (clsact filters are found by interface name); and crafted packets for
//! `BPF_PROG_TEST_RUN` (built with valid checksums, parsed checking every checksum).

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
};

use aya::programs::{SchedClassifier, TcAttachType};
use proxy_user::loader;

use super::{Netns, NetnsGuard};

/// One filter line of `tc filter show` that names a handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcFilter {
    /// `pref` (priority).
    pub pref: u16,
    /// `bpf`, `u32`, ...
    pub kind: String,
    /// `handle` (bpf filters), as tc prints it (`0x4b50`).
    pub handle: Option<String>,
    /// The program id (bpf filters).
    pub id: Option<u32>,
    /// The program name (bpf filters).
    pub name: Option<String>,
    pub line: String,
}

/// `tc filter show dev IFACE ingress|egress`, run inside `ns`: every filter line that
/// names a handle (bpf: `handle`, u32: `fh`).
pub fn tc_filters(ns: &Netns, iface: &str, ingress: bool) -> Vec<TcFilter> {
    let dir = if ingress { "ingress" } else { "egress" };
    let out = Command::new("nsenter")
        .arg(format!("--net={}", ns.path().display()))
        .args(["--", "tc", "filter", "show", "dev", iface, dir])
        .output()
        .expect("run tc");
    assert!(
        out.status.success(),
        "tc filter show dev {iface} {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("filter ") && (l.contains(" handle ") || l.contains(" fh ")))
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |key: &str| {
                words
                    .iter()
                    .position(|w| *w == key)
                    .and_then(|i| words.get(i + 1))
                    .map(|w| w.to_string())
            };
            let pref: u16 = after("pref").and_then(|p| p.parse().ok()).expect("pref");
            let kind = after(&pref.to_string()).unwrap_or_default();
            TcFilter {
                pref,
                kind,
                handle: after("handle"),
                id: after("id").and_then(|i| i.parse().ok()),
                name: after("name"),
                line: line.to_string(),
            }
        })
        .collect()
}

/// The bpf filters among [`tc_filters`].
pub fn bpf_filters(ns: &Netns, iface: &str, ingress: bool) -> Vec<TcFilter> {
    tc_filters(ns, iface, ingress)
        .into_iter()
        .filter(|f| f.kind == "bpf")
        .collect()
}

/// Asserts that `iface` has exactly one bpf filter on `ingress`/egress, ours (reserved
/// priority and handle, our program's name), and returns its program id.
pub fn our_one_filter(ns: &Netns, iface: &str, ingress: bool) -> u32 {
    let filters = bpf_filters(ns, iface, ingress);
    let [f] = filters.as_slice() else {
        panic!("{iface} ingress={ingress}: want exactly one bpf filter, got {filters:#?}");
    };
    let want_name = if ingress { "tc_ingress" } else { "tc_egress" };
    assert_eq!(f.pref, loader::CLSACT_PRIORITY, "{f:?}");
    assert_eq!(
        f.handle.as_deref(),
        Some(format!("{:#x}", u32::from(loader::CLSACT_HANDLE)).as_str()),
        "{f:?}"
    );
    assert_eq!(f.name.as_deref(), Some(want_name), "{f:?}");
    assert!(f.line.contains("direct-action"), "{f:?}");
    f.id.expect("program id")
}

/// Programs attached to `iface` with TCX (ids), queried inside `ns`.
pub fn tcx_programs(ns: &Netns, iface: &str, ingress: bool) -> Vec<u32> {
    let _g = ns.enter();
    let kind = if ingress {
        TcAttachType::Ingress
    } else {
        TcAttachType::Egress
    };
    let (_, progs) = SchedClassifier::query_tcx(iface, kind)
        .unwrap_or_else(|e| panic!("query TCX on {iface}: {e}"));
    progs.iter().map(|p| p.id()).collect()
}

/// The id of the program pinned at `path`.
pub fn pinned_program_id(path: &Path) -> u32 {
    let prog = SchedClassifier::from_pin(path)
        .unwrap_or_else(|e| panic!("program pinned at {}: {e}", path.display()));
    prog.info().expect("program info").id()
}

/// `links/tc-<iface>-<dir>-clsact` under `pins`.
pub fn clsact_pin(pins: &Path, iface: &str, ingress: bool) -> PathBuf {
    let dir = if ingress { "ingress" } else { "egress" };
    pins.join("links").join(format!("tc-{iface}-{dir}-clsact"))
}

/// Whether a program with this id is still loaded in the kernel.
pub fn program_loaded(id: u32) -> bool {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .any(|p| p.id() == id)
}

/// Uninstalls `pins` from inside `ns` on drop if it is still there, so that a failing test
/// detaches its clsact filters in its own namespace (never in the host's). Declare it
/// after the namespace so it drops first.
pub struct UninstallIn {
    pub ns: PathBuf,
    pub pins: PathBuf,
}

impl UninstallIn {
    pub fn new(ns: &Netns, pins: &Path) -> Self {
        Self {
            ns: ns.path(),
            pins: pins.to_path_buf(),
        }
    }
}

impl Drop for UninstallIn {
    fn drop(&mut self) {
        if self.pins.exists() {
            let _g = NetnsGuard::enter(&self.ns);
            if let Err(e) = loader::uninstall(&self.pins) {
                eprintln!("cleanup of {}: {e}", self.pins.display());
            }
        }
    }
}

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
