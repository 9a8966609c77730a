//! `--pod-interfaces`: which interfaces are the host side of a pod's veth (glob patterns
//! on the name), and the watcher that attaches the TC programs to them as they appear
//! and detaches them when they go ([`loader::PodTc`]).
//!
//! The watcher listens to the kernel's link events on a `NETLINK_ROUTE` socket
//! (`RTMGRP_LINK`) joined *before* it dumps the existing links, so an interface made
//! meanwhile is seen either in the dump or as an event. A CNI creates the veth pair in the
//! node's namespace (the event arrives here), moves the peer into the pod, then sets
//! addresses and routes and returns; the pod's containers start after that. Attaching
//! takes two TCX links (about a millisecond), far inside that window: the pod's first
//! packet is handled (`tests/pod_path.rs` measures it).

use std::{
    collections::HashMap,
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::PathBuf,
    sync::Arc,
};

use tracing::{info, warn};

use crate::loader;

/// The default `--pod-interfaces`: the host-side veth names of the common CNIs (Calico
/// `cali*`, Cilium `lxc*`, flannel/bridge/kindnet/ptp `veth*`, GKE `gke*`, AWS VPC CNI
/// `eni*`, Azure `azv*`). Cilium's own `cilium_*` devices, bridges (`cni0`, `docker0`),
/// tunnels (`flannel.1`, `vxlan.calico`) are not pods' and match none of them.
pub const DEFAULT_POD_INTERFACES: &str = "lxc*,cali*,veth*,gke*,eni*,azv*";

/// Glob patterns on interface names (`*` any run, `?` one character).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Patterns(Vec<String>);

impl Patterns {
    /// `none` (or an empty string): no pod interfaces; otherwise comma-separated globs.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() || s == "none" {
            return Ok(Self(Vec::new()));
        }
        let mut out = Vec::new();
        for p in s.split(',').map(str::trim) {
            if p.is_empty() {
                return Err(format!("--pod-interfaces {s:?}: an empty pattern"));
            }
            // IFNAMSIZ - 1 characters of a name; `/`, whitespace and `:` are never in one.
            if p.len() > 15 || p.chars().any(|c| c == '/' || c == ':' || c.is_whitespace()) {
                return Err(format!(
                    "--pod-interfaces pattern {p:?}: not an interface name pattern (at most \
                     15 characters, no '/', ':' or spaces)"
                ));
            }
            if p == "*" {
                return Err(
                    "--pod-interfaces pattern \"*\" would take every interface (the node's \
                     own ones and loopback too)"
                        .into(),
                );
            }
            out.push(p.to_string());
        }
        Ok(Self(out))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `name` is a pod interface.
    pub fn matches(&self, name: &str) -> bool {
        self.0.iter().any(|p| glob(p.as_bytes(), name.as_bytes()))
    }
}

impl std::fmt::Display for Patterns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        f.write_str(&self.0.join(","))
    }
}

/// `*` and `?` glob match, iterative (backtracks to the last `*`).
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// A link event or dump entry: its index, name, and whether it was deleted.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LinkMsg {
    pub index: i32,
    pub name: String,
    pub deleted: bool,
}

const IFLA_IFNAME: u16 = 3;
const NLMSG_HDRLEN: usize = 16;
const IFINFO_LEN: usize = 16;

/// Parses the link messages in one netlink datagram; `Err` on an `NLMSG_ERROR` with an
/// error code; `done` when the dump ended (`NLMSG_DONE`).
pub(crate) fn parse_links(buf: &[u8], out: &mut Vec<LinkMsg>) -> Result<bool, io::Error> {
    let mut off = 0;
    let mut done = false;
    while off + NLMSG_HDRLEN <= buf.len() {
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().expect("4")) as usize;
        let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().expect("2"));
        if len < NLMSG_HDRLEN || off + len > buf.len() {
            break;
        }
        let body = &buf[off + NLMSG_HDRLEN..off + len];
        match ty {
            t if t == libc::NLMSG_DONE as u16 => done = true,
            t if t == libc::NLMSG_ERROR as u16 => {
                let code = body
                    .get(..4)
                    .map(|b| i32::from_ne_bytes(b.try_into().expect("4")))
                    .unwrap_or(0);
                if code != 0 {
                    return Err(io::Error::from_raw_os_error(-code));
                }
            }
            t if (t == libc::RTM_NEWLINK || t == libc::RTM_DELLINK) && body.len() >= IFINFO_LEN => {
                let index = i32::from_ne_bytes(body[4..8].try_into().expect("4"));
                let mut a = IFINFO_LEN;
                while a + 4 <= body.len() {
                    let alen = u16::from_ne_bytes(body[a..a + 2].try_into().expect("2"));
                    let aty = u16::from_ne_bytes(body[a + 2..a + 4].try_into().expect("2"));
                    let alen = alen as usize;
                    if alen < 4 || a + alen > body.len() {
                        break;
                    }
                    if aty & 0x3fff == IFLA_IFNAME {
                        let v = &body[a + 4..a + alen];
                        let v = v.split(|&c| c == 0).next().unwrap_or(&[]);
                        out.push(LinkMsg {
                            index,
                            name: String::from_utf8_lossy(v).into_owned(),
                            deleted: t == libc::RTM_DELLINK,
                        });
                        break;
                    }
                    a += (alen + 3) & !3;
                }
            }
            _ => {}
        }
        off += (len + 3) & !3;
    }
    Ok(done)
}

/// A `NETLINK_ROUTE` socket joined to `RTMGRP_LINK`.
struct LinkSocket(OwnedFd);

impl LinkSocket {
    fn open() -> io::Result<Self> {
        // SAFETY: plain syscalls on a fresh descriptor.
        unsafe {
            let fd = libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            );
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let fd = OwnedFd::from_raw_fd(fd);
            // A burst of pods must not overflow it (ENOBUFS makes us dump again anyway).
            let size: libc::c_int = 4 << 20;
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                &size as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as u32,
            );
            let mut sa: libc::sockaddr_nl = std::mem::zeroed();
            sa.nl_family = libc::AF_NETLINK as u16;
            sa.nl_groups = libc::RTMGRP_LINK as u32;
            if libc::bind(
                fd.as_raw_fd(),
                &sa as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            ) < 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(Self(fd))
        }
    }

    /// Asks for every link (`RTM_GETLINK` dump); the answers arrive through `recv`.
    fn request_dump(&self) -> io::Result<()> {
        const LEN: usize = NLMSG_HDRLEN + IFINFO_LEN;
        let mut req = [0u8; LEN];
        req[0..4].copy_from_slice(&(LEN as u32).to_ne_bytes());
        req[4..6].copy_from_slice(&libc::RTM_GETLINK.to_ne_bytes());
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
        req[6..8].copy_from_slice(&flags.to_ne_bytes());
        req[8..12].copy_from_slice(&1u32.to_ne_bytes());
        req[NLMSG_HDRLEN] = libc::AF_UNSPEC as u8;
        // SAFETY: a valid buffer.
        let n = unsafe {
            libc::send(
                self.0.as_raw_fd(),
                req.as_ptr() as *const libc::c_void,
                req.len(),
                0,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: a valid buffer.
            let n = unsafe {
                libc::recv(
                    self.0.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                )
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Where the watcher reports (the agent's metrics: `ebpf_proxy_pod_interface_errors_total`
/// and `ebpf_proxy_pod_interfaces`).
pub trait Report: Send + Sync {
    /// An attach or detach that failed, by reason.
    fn error(&self, reason: &str);
    /// How many pod interfaces are attached now.
    fn attached(&self, interfaces: usize);
}

/// The watcher's state: the loaded programs and the pod interfaces seen (index -> name).
struct Watcher {
    tc: loader::PodTc,
    patterns: Patterns,
    seen: HashMap<i32, String>,
    report: Arc<dyn Report>,
}

impl Watcher {
    fn error(&self, reason: &str) {
        self.report.error(reason);
    }

    fn gauge(&self) {
        self.report.attached(self.seen.len());
    }

    fn attach(&mut self, index: i32, name: &str) {
        if let Some(old) = self.seen.get(&index).cloned() {
            if old == name {
                // Another event about a known interface (up, carrier, addresses):
                // re-attach only what is missing (a pin removed by hand).
                if self.tc.attached(name) {
                    return;
                }
            } else {
                // Renamed: the old name's pins go (and with them its attachments).
                self.detach(index, &old);
            }
        }
        if !self.patterns.matches(name) {
            return;
        }
        match self.tc.attach(name) {
            Ok(()) => {
                info!(iface = name, index, "pod interface: TC attached");
                self.seen.insert(index, name.to_string());
            }
            Err(e) => {
                // Gone again before we attached (ENODEV) is no failure.
                let cname = std::ffi::CString::new(name).unwrap_or_default();
                // SAFETY: a NUL-terminated name.
                if unsafe { libc::if_nametoindex(cname.as_ptr()) } == 0 {
                    return;
                }
                warn!(iface = name, "pod interface: attaching TC: {e}");
                self.error("attach");
            }
        }
        self.gauge();
    }

    fn detach(&mut self, index: i32, name: &str) {
        self.seen.remove(&index);
        match self.tc.detach(name) {
            Ok(n) if n > 0 => info!(iface = name, index, "pod interface gone: TC detached"),
            Ok(_) => {}
            Err(e) => {
                warn!(iface = name, "pod interface: detaching TC: {e}");
                self.error("detach");
            }
        }
        self.gauge();
    }

    /// A full dump: attach to every pod interface, detach pins of pod interfaces that no
    /// longer exist (gone while no agent ran).
    fn resync(&mut self, links: &[LinkMsg]) {
        let names: std::collections::HashSet<&str> =
            links.iter().map(|l| l.name.as_str()).collect();
        for iface in self.tc.pinned_interfaces() {
            if self.patterns.matches(&iface) && !names.contains(iface.as_str()) {
                let index = self
                    .seen
                    .iter()
                    .find(|(_, n)| **n == iface)
                    .map(|(i, _)| *i)
                    .unwrap_or(-1);
                self.detach(index, &iface);
            }
        }
        let gone: Vec<(i32, String)> = self
            .seen
            .iter()
            .filter(|(i, _)| !links.iter().any(|l| l.index == **i))
            .map(|(i, n)| (*i, n.clone()))
            .collect();
        for (i, n) in gone {
            self.detach(i, &n);
        }
        for l in links {
            self.attach(l.index, &l.name);
        }
    }

    fn handle(&mut self, msgs: Vec<LinkMsg>) {
        for m in msgs {
            if m.deleted {
                if self.seen.contains_key(&m.index) || self.patterns.matches(&m.name) {
                    self.detach(m.index, &m.name);
                }
            } else {
                self.attach(m.index, &m.name);
            }
        }
    }

    /// Dumps every link (events that arrive meanwhile are handled after the dump).
    fn dump(&mut self, sock: &LinkSocket, buf: &mut [u8]) -> io::Result<()> {
        sock.request_dump()?;
        let mut links = Vec::new();
        loop {
            let n = sock.recv(buf)?;
            if parse_links(&buf[..n], &mut links)? {
                break;
            }
        }
        // Events interleaved with the dump's answers are records of the same kind: the
        // links present are resynced, the deletions handled after.
        let (deleted, present): (Vec<LinkMsg>, Vec<LinkMsg>) =
            links.into_iter().partition(|l| l.deleted);
        self.resync(&present);
        self.handle(deleted);
        Ok(())
    }
}

/// Starts the watcher on a thread of its own in this process's network namespace: loads
/// the TC programs against the pinned maps, attaches to the pod interfaces there now,
/// then follows link events. Returns once the existing interfaces are attached.
pub fn spawn(
    pin_path: PathBuf,
    tc_attach: loader::TcAttachMode,
    patterns: Patterns,
    report: Arc<dyn Report>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let tc = loader::PodTc::load(&crate::pins::PinDir::new(&pin_path), tc_attach)
        .context("loading the TC programs for the pod interfaces")?;
    let sock = LinkSocket::open().context("opening a NETLINK_ROUTE socket for link events")?;
    let mut w = Watcher {
        tc,
        patterns,
        seen: HashMap::new(),
        report,
    };
    let mut buf = vec![0u8; 1 << 16];
    w.dump(&sock, &mut buf)
        .context("listing the interfaces (RTM_GETLINK)")?;
    info!(patterns = %w.patterns, attached = w.seen.len(), "pod interfaces: TC on the host side of pod veths, following link events");
    std::thread::Builder::new()
        .name("pod-interfaces".into())
        .spawn(move || loop {
            let n = match sock.recv(&mut buf) {
                Ok(n) => n,
                Err(e) => {
                    // ENOBUFS: events were lost; a dump brings us level again.
                    warn!("pod interfaces: link events: {e}; listing the interfaces again");
                    w.error("netlink");
                    if let Err(e) = w.dump(&sock, &mut buf) {
                        warn!("pod interfaces: listing the interfaces: {e}");
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                    continue;
                }
            };
            let mut msgs = Vec::new();
            if let Err(e) = parse_links(&buf[..n], &mut msgs) {
                warn!("pod interfaces: netlink error: {e}");
                w.error("netlink");
            }
            w.handle(msgs);
        })
        .context("starting the pod interface watcher thread")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_cni_names() {
        let p = Patterns::parse(DEFAULT_POD_INTERFACES).expect("default");
        for yes in [
            "lxc12ab",
            "cali1234567890a",
            "veth0a1b2c",
            "gke3f",
            "eni9d",
            "azv1",
        ] {
            assert!(p.matches(yes), "{yes}");
        }
        for no in [
            "eth0",
            "lo",
            "cni0",
            "cilium_host",
            "flannel.1",
            "docker0",
            "ens5",
        ] {
            assert!(!p.matches(no), "{no}");
        }
        let q = Patterns::parse("p?d*x, tap*").expect("globs");
        assert!(q.matches("pod1x") && q.matches("pxd-long-x") && q.matches("tap"));
        assert!(!q.matches("pod1") && !q.matches("pd1x"));
        assert!(Patterns::parse("none").expect("none").is_empty());
        assert!(Patterns::parse("*").is_err());
        assert!(Patterns::parse("a,,b").is_err());
        assert!(Patterns::parse("eth0/1").is_err());
        assert!(Patterns::parse("a-very-long-interface-name*").is_err());
    }

    #[test]
    fn parses_link_messages() {
        // RTM_NEWLINK for index 7 "lxcab" then NLMSG_DONE.
        let mut m = Vec::new();
        let name = b"lxcab\0";
        let attr_len = 4 + name.len();
        let len = NLMSG_HDRLEN + IFINFO_LEN + ((attr_len + 3) & !3);
        m.extend((len as u32).to_ne_bytes());
        m.extend(libc::RTM_NEWLINK.to_ne_bytes());
        m.extend([0u8; 10]);
        m.extend([0u8; 4]);
        m.extend(7i32.to_ne_bytes());
        m.extend([0u8; 8]);
        m.extend((attr_len as u16).to_ne_bytes());
        m.extend(IFLA_IFNAME.to_ne_bytes());
        m.extend(name);
        while m.len() < len {
            m.push(0);
        }
        m.extend((NLMSG_HDRLEN as u32 + 4).to_ne_bytes());
        m.extend((libc::NLMSG_DONE as u16).to_ne_bytes());
        m.extend([0u8; 14]);
        let mut out = Vec::new();
        assert!(parse_links(&m, &mut out).expect("parse"));
        assert_eq!(
            out,
            vec![LinkMsg {
                index: 7,
                name: "lxcab".into(),
                deleted: false
            }]
        );
    }
}
