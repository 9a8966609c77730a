//! Terminating connected UDP sockets whose backend went away.
//!
//! The socket hooks rewrite a UDP socket's destination once, at `connect()`; a connected
//! socket keeps sending to that backend until the application reconnects. When a backend
//! leaves (a DNS pod deleted, say) its clients would then send into the void - the socket
//! LB form of kube-proxy's stale UDP conntrack problem, which kube-proxy solves by
//! deleting conntrack entries. This module does what `ss -K` does: in every network
//! namespace used by a process of the hooked cgroup tree (only those sockets can have
//! been rewritten), it lists the UDP sockets connected to the removed backends over
//! `NETLINK_SOCK_DIAG` and destroys each (`SOCK_DESTROY`, `CONFIG_INET_DIAG_DESTROY`).
//! The socket is disconnected with `ECONNABORTED` pending: the application's next
//! `recv` fails with it (a `send` with `EDESTADDRREQ`), it reconnects, and the hooks pick
//! a live backend.

use std::{
    collections::BTreeSet,
    fs,
    io::{self, Read as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::{
        fd::{AsFd as _, AsRawFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
};

use crate::pins::PinDir;

const NETLINK_SOCK_DIAG: i32 = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_DUMP: u16 = 0x300;
/// `TCP_ESTABLISHED`: how sock_diag reports a connected UDP socket.
const STATE_ESTABLISHED: u8 = 1;
const NLMSG_HDRLEN: usize = 16;
/// `struct inet_diag_sockid`.
const SOCKID_LEN: usize = 48;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 4 + 4 + SOCKID_LEN;
/// `struct inet_diag_msg`.
const MSG_LEN: usize = 4 + SOCKID_LEN + 20;

/// What one cleanup did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Network namespaces looked into.
    pub namespaces: usize,
    /// Sockets destroyed.
    pub destroyed: usize,
    /// Namespaces or sockets that could not be handled, with the cause.
    pub errors: Vec<String>,
}

/// Destroys the UDP sockets connected to any of `backends` in the network namespaces of
/// the processes in the cgroup tree `cgroup` (a cgroup v2 directory).
pub fn destroy_udp_to(cgroup: &Path, backends: &[SocketAddr]) -> Report {
    let mut report = Report::default();
    if backends.is_empty() {
        return report;
    }
    let namespaces = match namespaces_of(cgroup) {
        Ok(n) => n,
        Err(e) => {
            report.errors.push(format!(
                "listing the processes of {}: {e}",
                cgroup.display()
            ));
            return report;
        }
    };
    let backends = backends.to_vec();
    // setns() changes the calling thread: a thread of its own, gone afterwards.
    let joined = std::thread::spawn(move || {
        let mut r = Report::default();
        for ns in namespaces {
            r.namespaces += 1;
            match in_namespace(&ns, &backends) {
                Ok(n) => r.destroyed += n,
                Err(e) => r.errors.push(format!("{}: {e}", ns.display())),
            }
        }
        r
    })
    .join();
    match joined {
        Ok(r) => r,
        Err(_) => {
            report
                .errors
                .push("the socket cleanup thread panicked".into());
            report
        }
    }
}

/// One `ns/net` path per distinct network namespace of the tree's threads.
fn namespaces_of(cgroup: &Path) -> io::Result<Vec<PathBuf>> {
    let mut pids = BTreeSet::new();
    collect_pids(cgroup, &mut pids)?;
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for pid in pids {
        let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
            continue; // exited meanwhile
        };
        for t in tasks.flatten() {
            let ns = t.path().join("ns/net");
            if let Ok(m) = fs::metadata(&ns) {
                if seen.insert((m.dev(), m.ino())) {
                    out.push(ns);
                }
            }
        }
    }
    Ok(out)
}

fn collect_pids(dir: &Path, pids: &mut BTreeSet<u32>) -> io::Result<()> {
    let mut text = String::new();
    fs::File::open(dir.join("cgroup.procs"))?.read_to_string(&mut text)?;
    pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    for e in fs::read_dir(dir)?.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            // A child that vanished meanwhile is not an error.
            let _ = collect_pids(&e.path(), pids);
        }
    }
    Ok(())
}

/// The cgroup v2 directory the cgroup link pinned as `link` in `pins` is attached to: the kernel's
/// own record (`bpf_link_info.cgroup.cgroup_id`, which is the directory's inode number on
/// cgroup2), so an agent that adopted the hooks after a restart knows where they are
/// whatever its `--cgroup` says now. `candidates` are tried first; otherwise the tree
/// under `mount` is searched.
pub fn hooked_cgroup(
    pins: &PinDir,
    link: &str,
    mount: &Path,
    candidates: &[PathBuf],
) -> io::Result<PathBuf> {
    let id = link_cgroup_id(pins, link)?;
    let matches = |p: &Path| fs::metadata(p).is_ok_and(|m| m.is_dir() && m.ino() == id);
    if let Some(c) = candidates.iter().find(|c| matches(c)) {
        return Ok(c.clone());
    }
    let mut stack = vec![mount.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if matches(&dir) {
            return Ok(dir);
        }
        if let Ok(entries) = fs::read_dir(&dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(e.path());
                }
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "the cgroup (id {id}) of the link pinned at {} is not under {} (removed?)",
            pins.link_path(link).display(),
            mount.display()
        ),
    ))
}

/// `cgroup_id` of a pinned `BPF_LINK_TYPE_CGROUP` link.
fn link_cgroup_id(pins: &PinDir, link: &str) -> io::Result<u64> {
    let fd = pins.open_link(link)?;
    let info = bpf_sys::link_info(fd.as_fd())?;
    if info.link_type != bpf_sys::link_type::CGROUP {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is not a cgroup link (link type {})",
                pins.link_path(link).display(),
                info.link_type
            ),
        ));
    }
    Ok(info.cgroup_id)
}

fn in_namespace(ns: &Path, backends: &[SocketAddr]) -> io::Result<usize> {
    let f = fs::File::open(ns)?;
    // SAFETY: a valid namespace fd; affects this (dedicated) thread only.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let sock = diag_socket()?;
    let mut destroyed = 0;
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        for id in connected_to(&sock, family, backends)? {
            destroy(&sock, family, &id)?;
            destroyed += 1;
        }
    }
    Ok(destroyed)
}

fn diag_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A netlink message: header, then an `inet_diag_req_v2`.
fn request(kind: u16, flags: u16, family: u8, states: u32, id: &[u8; SOCKID_LEN]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + REQ_LEN;
    let mut m = Vec::with_capacity(len);
    m.extend((len as u32).to_ne_bytes());
    m.extend(kind.to_ne_bytes());
    m.extend((flags | NLM_F_REQUEST).to_ne_bytes());
    m.extend(1u32.to_ne_bytes()); // seq
    m.extend(0u32.to_ne_bytes()); // port id: the kernel
    m.extend([family, libc::IPPROTO_UDP as u8, 0, 0]);
    m.extend(states.to_ne_bytes());
    m.extend(id);
    m
}

fn send(sock: &OwnedFd, msg: &[u8]) -> io::Result<()> {
    // SAFETY: sending our buffer on our socket (to the kernel: no address needed).
    let n = unsafe { libc::send(sock.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn recv(sock: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: receiving into our buffer.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_ne_bytes([b[o], b[o + 1]])
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// The destination in an `inet_diag_sockid` (v4-mapped IPv6 addresses as IPv4).
fn destination(family: u8, id: &[u8]) -> SocketAddr {
    let port = u16::from_be_bytes([id[2], id[3]]);
    let dst: [u8; 16] = id[20..36].try_into().unwrap_or([0; 16]);
    let ip = if family == libc::AF_INET as u8 {
        IpAddr::V4(Ipv4Addr::new(dst[0], dst[1], dst[2], dst[3]))
    } else {
        let v6 = Ipv6Addr::from(dst);
        v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
    };
    SocketAddr::new(ip, port)
}

/// The socket ids of the connected UDP sockets of `family` whose peer is a backend.
fn connected_to(
    sock: &OwnedFd,
    family: u8,
    backends: &[SocketAddr],
) -> io::Result<Vec<[u8; SOCKID_LEN]>> {
    send(
        sock,
        &request(
            SOCK_DIAG_BY_FAMILY,
            NLM_F_DUMP,
            family,
            1 << STATE_ESTABLISHED,
            &[0; SOCKID_LEN],
        ),
    )?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = recv(sock, &mut buf)?;
        let mut off = 0;
        while off + NLMSG_HDRLEN <= n {
            let len = u32_at(&buf, off) as usize;
            let kind = u16_at(&buf, off + 4);
            if len < NLMSG_HDRLEN || off + len > n {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "truncated sock_diag message",
                ));
            }
            match kind {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let errno = -(u32_at(&buf, off + NLMSG_HDRLEN) as i32);
                    return Err(io::Error::from_raw_os_error(errno));
                }
                SOCK_DIAG_BY_FAMILY if len >= NLMSG_HDRLEN + MSG_LEN => {
                    let msg = &buf[off + NLMSG_HDRLEN..off + len];
                    let id: [u8; SOCKID_LEN] = msg[4..4 + SOCKID_LEN]
                        .try_into()
                        .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
                    if msg[1] == STATE_ESTABLISHED && backends.contains(&destination(msg[0], &id)) {
                        out.push(id);
                    }
                }
                _ => {}
            }
            // Messages are 4-byte aligned.
            off += (len + 3) & !3;
        }
    }
}

fn destroy(sock: &OwnedFd, family: u8, id: &[u8; SOCKID_LEN]) -> io::Result<()> {
    send(sock, &request(SOCK_DESTROY, NLM_F_ACK, family, !0, id))?;
    let mut buf = [0u8; 512];
    let n = recv(sock, &mut buf)?;
    if n >= NLMSG_HDRLEN + 4 && u16_at(&buf, 4) == NLMSG_ERROR {
        let errno = -(u32_at(&buf, NLMSG_HDRLEN) as i32);
        // 0: done; ENOENT: closed meanwhile.
        if errno != 0 && errno != libc::ENOENT {
            return Err(io::Error::from_raw_os_error(errno));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_ids_decode_v4_v6_and_v4_mapped_destinations() {
        let mut id = [0u8; SOCKID_LEN];
        id[2..4].copy_from_slice(&53u16.to_be_bytes());
        id[20..24].copy_from_slice(&[10, 0, 0, 7]);
        assert_eq!(
            destination(libc::AF_INET as u8, &id),
            "10.0.0.7:53".parse().expect("sa")
        );
        let v6: Ipv6Addr = "fd00::7".parse().expect("v6");
        id[20..36].copy_from_slice(&v6.octets());
        assert_eq!(
            destination(libc::AF_INET6 as u8, &id),
            "[fd00::7]:53".parse().expect("sa")
        );
        let mapped = Ipv4Addr::new(10, 0, 0, 7).to_ipv6_mapped();
        id[20..36].copy_from_slice(&mapped.octets());
        assert_eq!(
            destination(libc::AF_INET6 as u8, &id),
            "10.0.0.7:53".parse().expect("sa")
        );
        // Requests: header length covers the inet_diag_req_v2.
        let r = request(SOCK_DESTROY, NLM_F_ACK, 2, !0, &id);
        assert_eq!(r.len(), NLMSG_HDRLEN + REQ_LEN);
        assert_eq!(u32_at(&r, 0) as usize, r.len());
    }
}
