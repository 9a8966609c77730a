//! What the writer programs: frontends (a service address, port and protocol) and the
//! backends behind each, in user-space types, plus their conversion to the map ABI.

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    str::FromStr,
};

use proxy_common::proto;

/// L4 protocol of a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    /// The IP protocol number used in the maps.
    pub const fn number(self) -> u8 {
        match self {
            Proto::Tcp => proto::TCP,
            Proto::Udp => proto::UDP,
            Proto::Sctp => proto::SCTP,
        }
    }

    /// The protocol for an IP protocol number.
    pub const fn from_number(n: u8) -> Option<Self> {
        match n {
            proto::TCP => Some(Proto::Tcp),
            proto::UDP => Some(Proto::Udp),
            proto::SCTP => Some(Proto::Sctp),
            _ => None,
        }
    }

    /// Lower-case name as in `10.96.0.10:80/tcp`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Proto {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Proto::Tcp),
            "udp" => Ok(Proto::Udp),
            "sctp" => Ok(Proto::Sctp),
            other => Err(format!(
                "unknown protocol {other:?} (expected tcp, udp or sctp)"
            )),
        }
    }
}

/// Address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(addr: &IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

/// A service address as the datapath matches it: `{vip, port, proto}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Proto,
    /// `proxy_common::scope`: 0 for every client, `EXTERNAL_LOCAL` for the local-only
    /// twin of an `externalTrafficPolicy: Local` frontend.
    pub scope: u8,
}

impl Frontend {
    pub fn new(addr: impl Into<IpAddr>, port: u16, proto: Proto) -> Self {
        Self {
            addr: addr.into(),
            port,
            proto,
            scope: proxy_common::scope::ALL,
        }
    }

    /// The same frontend in another scope.
    pub fn with_scope(self, scope: u8) -> Self {
        Self { scope, ..self }
    }

    pub fn family(&self) -> Family {
        Family::of(&self.addr)
    }

    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(self.addr, self.port)
    }
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.socket_addr(), self.proto)?;
        if self.scope == proxy_common::scope::EXTERNAL_LOCAL {
            f.write_str("/ext-local")?;
        }
        Ok(())
    }
}

/// One endpoint behind a frontend. Its identity in the `BACKEND` maps is
/// `{addr, port, proto, flags}`: a change of flags (say, to terminating) is a new backend
/// id, so a backend entry never changes while a slot points at it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub addr: SocketAddr,
    /// `proxy_common::backend_flags`.
    pub flags: u8,
}

impl Backend {
    pub fn new(addr: SocketAddr) -> Self {
        Self { addr, flags: 0 }
    }

    pub fn family(&self) -> Family {
        Family::of(&self.addr.ip())
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.addr)?;
        if self.flags & proxy_common::backend_flags::TERMINATING != 0 {
            f.write_str(" (terminating)")?;
        }
        Ok(())
    }
}

/// A frontend and everything the maps hold for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceEntry {
    pub frontend: Frontend,
    /// Equal-weight backends; order is the preferred slot order for new entries.
    pub backends: Vec<Backend>,
    /// `proxy_common::svc_flags`.
    pub flags: u16,
    /// Session affinity timeout in seconds (0: none).
    pub affinity_timeout: u32,
    /// The Service port it comes from (`namespace/name:port`), for the CLI; may be empty.
    pub name: String,
    /// Allowed sources `(address, prefix length)` when `svc_flags::SOURCE_RANGES` is set.
    pub source_ranges: Vec<(IpAddr, u8)>,
}

impl ServiceEntry {
    pub fn new(frontend: Frontend, backends: impl IntoIterator<Item = SocketAddr>) -> Self {
        Self {
            frontend,
            backends: backends.into_iter().map(Backend::new).collect(),
            flags: 0,
            affinity_timeout: 0,
            name: String::new(),
            source_ranges: Vec::new(),
        }
    }
}

/// A name as the `REVNAT` maps store it: truncated to `NAME_LEN` bytes (on a character
/// boundary), NUL-padded.
pub fn name_bytes(name: &str) -> [u8; proxy_common::NAME_LEN] {
    let mut out = [0u8; proxy_common::NAME_LEN];
    let mut end = name.len().min(out.len());
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    out[..end].copy_from_slice(&name.as_bytes()[..end]);
    out
}

/// Whether two names are stored alike in the `REVNAT` maps (the same first `NAME_LEN`
/// bytes): a name read back from the maps is the truncated one, so a longer name that
/// starts with it needs no write.
pub fn same_stored_name(a: &str, b: &str) -> bool {
    a == b || name_bytes(a) == name_bytes(b)
}

pub fn name_from_bytes(b: &[u8]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The 4 bytes of an IPv4 address as the kernel stores `user_ip4` (network order).
pub fn v4_word(a: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(a.octets())
}

pub fn v4_from_word(w: u32) -> Ipv4Addr {
    Ipv4Addr::from(w.to_ne_bytes())
}

/// An IPv6 address as four network-order words (`user_ip6`).
pub fn v6_words(a: Ipv6Addr) -> [u32; 4] {
    let o = a.octets();
    std::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

pub fn v6_from_words(w: [u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (i, word) in w.iter().enumerate() {
        o[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

/// A port as the maps store it (network order in a `u16`).
pub fn port_net(port: u16) -> u16 {
    port.to_be()
}

pub fn port_host(net: u16) -> u16 {
    u16::from_be(net)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_words_round_trip_and_match_memory_order() {
        let a = Ipv4Addr::new(10, 96, 0, 1);
        assert_eq!(v4_word(a).to_ne_bytes(), [10, 96, 0, 1]);
        assert_eq!(v4_from_word(v4_word(a)), a);
        let b: Ipv6Addr = "fd00:96::1".parse().unwrap_or(Ipv6Addr::LOCALHOST);
        assert_eq!(v6_from_words(v6_words(b)), b);
        assert_eq!(v6_words(b)[0].to_ne_bytes(), [0xfd, 0, 0, 0x96]);
        assert_eq!(port_net(80).to_ne_bytes(), [0, 80]);
        assert_eq!(port_host(port_net(8080)), 8080);
    }

    #[test]
    fn proto_parses_and_prints() {
        assert_eq!("TCP".parse::<Proto>(), Ok(Proto::Tcp));
        assert!("icmp".parse::<Proto>().is_err());
        assert_eq!(Proto::from_number(17), Some(Proto::Udp));
        assert_eq!(
            Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 53, Proto::Udp).to_string(),
            "10.96.0.10:53/udp"
        );
    }
}
