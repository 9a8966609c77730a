//! The cgroup `sock_addr` hooks. Each is a shell around one worker that reads the
//! destination from the context, runs `lb::xlate_fwd`/`xlate_rev` and writes the result
//! back. The syscall always proceeds (return 1) except for a frontend with no backends,
//! which is refused with ECONNREFUSED, as kube-proxy's REJECT rule does, and, on a
//! frontend miss, a destination in `SVC_CIDR4/6`: a ClusterIP on a port no Service uses
//! is refused with ECONNREFUSED (kube-proxy's nftables mode rejects it), an address in a
//! Service CIDR that no Service has with EPERM (nftables mode drops it). Anything outside
//! those prefixes (node, pod, host addresses) is left alone.
//!
//! Context fields are read and written with 4-byte volatile accesses: the verifier
//! rejects narrower loads of `user_port` ("invalid bpf_context access") and LLVM would
//! otherwise merge or split them.

use aya_ebpf::maps::lpm_trie::Key as LpmKey;
use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_addr},
    helpers::{
        bpf_get_socket_cookie,
        generated::{
            bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_netns_cookie,
            bpf_set_retval,
        },
    },
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
    EbpfContext,
};
use aya_log_ebpf::warn;
use core::ptr::{read_volatile, write_volatile};
use proxy_common::{
    event::{event_hook, event_kind},
    proto, socket_lb, svc_cidr, Reason,
};

use crate::{
    events,
    lb::{xlate_fwd, xlate_rev, Fwd, V4, V6},
    maps::{count, SOCK_LB, SOCK_LB_BYPASS, SVC_CIDR4, SVC_CIDR6},
};

/// What the hook returns to the kernel.
const ALLOW: i32 = 1;
const REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;
const EPERM: i32 = 1;

/// `::ffff:0:0/96` as the third network-order word of `user_ip6`.
const V4_MAPPED_WORD: u32 = u32::from_be(0x0000_ffff);

#[cgroup_sock_addr(connect4)]
pub fn sock4_connect(ctx: SockAddrContext) -> i32 {
    fwd4(&ctx, event_hook::CONNECT)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sock4_sendmsg(ctx: SockAddrContext) -> i32 {
    fwd4(&ctx, event_hook::SENDMSG)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn sock4_recvmsg(ctx: SockAddrContext) -> i32 {
    rev4(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername4)]
pub fn sock4_getpeer(ctx: SockAddrContext) -> i32 {
    rev4(&ctx);
    ALLOW
}

#[cgroup_sock_addr(connect6)]
pub fn sock6_connect(ctx: SockAddrContext) -> i32 {
    fwd6(&ctx, event_hook::CONNECT)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sock6_sendmsg(ctx: SockAddrContext) -> i32 {
    fwd6(&ctx, event_hook::SENDMSG)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn sock6_recvmsg(ctx: SockAddrContext) -> i32 {
    rev6(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn sock6_getpeer(ctx: SockAddrContext) -> i32 {
    rev6(&ctx);
    ALLOW
}

/// The socket's L4 protocol, if it is one we balance.
#[inline(always)]
fn l4_proto(sa: *mut bpf_sock_addr) -> Option<u8> {
    // SAFETY: ctx pointer from the kernel; 4-byte field.
    let p = unsafe { read_volatile(&raw const (*sa).protocol) };
    match p as u8 {
        proto::TCP | proto::UDP => Some(p as u8),
        _ => None,
    }
}

/// The socket (for its local storage: the reverse entries).
#[inline(always)]
fn sk(sa: *mut bpf_sock_addr) -> *mut bpf_sock {
    // SAFETY: ctx pointer from the kernel; `sk` is an 8-byte pointer field the verifier
    // types as a (non-null) socket.
    unsafe { read_volatile(&raw const (*sa).__bindgen_anon_1.sk) }
}

/// The socket's cookie: the previous layout's (ABI 3) reverse entries are keyed by it
/// (`SOCK_REVNAT4/6_V3`, read only when the socket's storage has no entry).
#[inline(always)]
fn cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: valid for sock_addr programs.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

/// The client's network namespace, for session affinity (one pod, one namespace).
#[inline(always)]
fn netns(ctx: &SockAddrContext) -> u64 {
    // SAFETY: valid for sock_addr programs (kernel >= 5.8).
    unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }
}

/// Whether the socket hooks translate this socket (`--socket-lb`): never one whose
/// cgroup, or an ancestor of it at a level in `SOCK_LB_BYPASS[BYPASS_LEVELS]` (a pod's
/// cgroup above its containers'), is in `SOCK_LB_BYPASS` (checked first); then by mode:
/// every socket, TCP ones and any in the host's network namespace, only those in the
/// host's, or none. A socket left alone reaches the frontend itself, translated per
/// packet on its pod's interface.
#[inline(always)]
fn socket_lb_applies(ctx: &SockAddrContext, proto: u8) -> bool {
    if bypassed() {
        return false;
    }
    let mode = SOCK_LB
        .get(socket_lb::MODE)
        .copied()
        .unwrap_or(socket_lb::ALL);
    match mode {
        socket_lb::ALL => true,
        socket_lb::OFF => false,
        _ if mode == socket_lb::TCP && proto == proto::TCP => true,
        _ => {
            let host = SOCK_LB.get(socket_lb::HOST_NETNS).copied().unwrap_or(0);
            host != 0 && netns(ctx) == host
        }
    }
}

/// Whether the caller's cgroup or one of its ancestors at the levels the agent names is
/// in `SOCK_LB_BYPASS`. Cost: one lookup when no pod is bypassed (no levels), plus one
/// helper call and one lookup per named level (one or two on a kubelet node).
#[inline(never)]
fn bypassed() -> bool {
    // SAFETY: no preconditions (cgroup programs).
    let cgroup = unsafe { bpf_get_current_cgroup_id() };
    // SAFETY: reads of map values copied out at once.
    if unsafe { SOCK_LB_BYPASS.get(&cgroup) }.is_some() {
        return true;
    }
    let Some(&levels) = (unsafe { SOCK_LB_BYPASS.get(&socket_lb::BYPASS_LEVELS) }) else {
        return false;
    };
    let mut level = 0u32;
    while level <= socket_lb::BYPASS_MAX_LEVEL {
        if levels & (1 << level) != 0 {
            // SAFETY: no preconditions (cgroup programs run in process context); 0 when
            // the caller's cgroup is shallower than `level`.
            let id = unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
            if id != 0 && unsafe { SOCK_LB_BYPASS.get(&id) }.is_some() {
                return true;
            }
        }
        level += 1;
    }
    false
}

#[inline(always)]
fn read_port(sa: *mut bpf_sock_addr) -> u16 {
    // SAFETY: 4-byte access; the network-order port is in the low 16 bits.
    unsafe { read_volatile(&raw const (*sa).user_port) as u16 }
}

#[inline(always)]
fn write_port(sa: *mut bpf_sock_addr, port: u16) {
    // SAFETY: 4-byte access.
    unsafe { write_volatile(&raw mut (*sa).user_port, u32::from(port)) }
}

#[inline(always)]
fn read_ip6(sa: *mut bpf_sock_addr) -> [u32; 4] {
    // SAFETY: four 4-byte accesses (the verifier allows no wider one).
    unsafe {
        [
            read_volatile(&raw const (*sa).user_ip6[0]),
            read_volatile(&raw const (*sa).user_ip6[1]),
            read_volatile(&raw const (*sa).user_ip6[2]),
            read_volatile(&raw const (*sa).user_ip6[3]),
        ]
    }
}

#[inline(always)]
fn write_ip6(sa: *mut bpf_sock_addr, a: [u32; 4]) {
    // SAFETY: four 4-byte accesses.
    unsafe {
        write_volatile(&raw mut (*sa).user_ip6[0], a[0]);
        write_volatile(&raw mut (*sa).user_ip6[1], a[1]);
        write_volatile(&raw mut (*sa).user_ip6[2], a[2]);
        write_volatile(&raw mut (*sa).user_ip6[3], a[3]);
    }
}

#[inline(always)]
fn is_v4_mapped(a: &[u32; 4]) -> bool {
    a[0] == 0 && a[1] == 0 && a[2] == V4_MAPPED_WORD
}

/// What an IPv4 destination that is no frontend falls in (`svc_cidr::*`), if anything.
#[inline(always)]
fn svc_cidr4(a: u32) -> Option<u8> {
    SVC_CIDR4.get(&LpmKey::new(32, a)).copied()
}

/// The IPv6 counterpart of `svc_cidr4`.
#[inline(always)]
fn svc_cidr6(a: [u32; 4]) -> Option<u8> {
    SVC_CIDR6.get(&LpmKey::new(128, a)).copied()
}

/// The destination a socket hook was asked for, and which hook: its events'
/// `before` (`proxyctl monitor`).
struct Asked<A> {
    hook: u8,
    proto: u8,
    addr: A,
    port: u16,
}

impl<A> Asked<A> {
    /// Reports a drop or translation when a monitor holds the lease.
    #[inline(always)]
    fn report(&self, kind: u8, reason: Reason, to: Option<&Fwd<A>>) {
        if events::on() {
            let meta = events::meta(self.hook, kind, self.proto, reason);
            match to {
                Some(to) => events::sock(meta, &self.addr, self.port, &to.addr, to.port),
                None => events::sock(meta, &self.addr, self.port, &self.addr, self.port),
            }
        }
    }
}

/// Maps a forward result to the hook's return value, counting (and reporting) the
/// outcome.
#[inline(always)]
fn fwd_verdict<A: Copy>(
    ctx: &SockAddrContext,
    asked: &Asked<A>,
    r: Result<Option<Fwd<A>>, Reason>,
    write: impl FnOnce(Fwd<A>),
    in_svc_cidr: impl FnOnce() -> Option<u8>,
) -> i32 {
    match r {
        Ok(Some(to)) => {
            asked.report(event_kind::TRANSLATE, Reason::Translated, Some(&to));
            write(to);
            count(Reason::Translated);
            ALLOW
        }
        Ok(None) => {
            // No frontend: only a destination inside the Service CIDRs is refused.
            let (reason, errno) = match in_svc_cidr() {
                Some(svc_cidr::CLUSTER_IP) => (Reason::SvcPortUnused, ECONNREFUSED),
                Some(svc_cidr::RANGE) => (Reason::SvcCidrUnallocated, EPERM),
                _ => {
                    count(Reason::NoService);
                    return ALLOW;
                }
            };
            count(reason);
            asked.report(event_kind::DROP, reason, None);
            // SAFETY: cgroup hook; sets the syscall's error.
            unsafe { bpf_set_retval(-errno) };
            REJECT
        }
        Err(reason @ (Reason::NoBackend | Reason::NoLocalBackend)) => {
            count(reason);
            asked.report(event_kind::DROP, reason, None);
            // No endpoints at all: kube-proxy REJECTs (connection refused). Endpoints
            // only on other nodes under a Local policy: kube-proxy DROPs; failing fast
            // with "no route to host" beats a connect() that hangs.
            let errno = if reason == Reason::NoBackend {
                ECONNREFUSED
            } else {
                EHOSTUNREACH
            };
            // SAFETY: cgroup hook; makes connect()/sendmsg() return -errno instead of
            // the default -EPERM for a rejected call.
            unsafe { bpf_set_retval(-errno) };
            REJECT
        }
        Err(other) => {
            count(other);
            if other == Reason::BackendMissing {
                // Rare: the writer's update order makes this a bug or a racing delete.
                warn!(
                    ctx,
                    "frontend slot or backend entry missing; connection left alone"
                );
            }
            ALLOW
        }
    }
}

/// Maps a reverse result, counting the outcome.
#[inline(always)]
fn rev_apply<A>(r: Result<Option<Fwd<A>>, Reason>, write: impl FnOnce(Fwd<A>)) {
    match r {
        Ok(Some(front)) => {
            write(front);
            count(Reason::RevTranslated);
        }
        Ok(None) => {}
        Err(reason) => count(reason),
    }
}

#[inline(always)]
fn fwd4(ctx: &SockAddrContext, hook: u8) -> i32 {
    let sa = ctx.sock_addr;
    let Some(proto) = l4_proto(sa) else {
        count(Reason::UnsupportedProto);
        return ALLOW;
    };
    if !socket_lb_applies(ctx, proto) {
        return ALLOW;
    }
    // SAFETY: 4-byte ctx field.
    let addr = unsafe { read_volatile(&raw const (*sa).user_ip4) };
    let port = read_port(sa);
    let r = xlate_fwd::<V4>(addr, port, proto, sk(sa), || netns(ctx));
    let asked = Asked {
        hook,
        proto,
        addr,
        port,
    };
    fwd_verdict(
        ctx,
        &asked,
        r,
        |to| {
            // SAFETY: 4-byte ctx field.
            unsafe { write_volatile(&raw mut (*sa).user_ip4, to.addr) };
            write_port(sa, to.port);
        },
        || svc_cidr4(addr),
    )
}

#[inline(always)]
fn rev4(ctx: &SockAddrContext) {
    let sa = ctx.sock_addr;
    let Some(proto) = l4_proto(sa) else { return };
    // SAFETY: 4-byte ctx field.
    let addr = unsafe { read_volatile(&raw const (*sa).user_ip4) };
    let r = xlate_rev::<V4>(addr, read_port(sa), proto, sk(sa), || cookie(ctx));
    rev_apply(r, |front| {
        // SAFETY: 4-byte ctx field.
        unsafe { write_volatile(&raw mut (*sa).user_ip4, front.addr) };
        write_port(sa, front.port);
    })
}

/// IPv6 sockets; a v4-mapped destination (`::ffff:a.b.c.d` on a dual-stack socket)
/// takes the IPv4 maps and is written back v4-mapped.
#[inline(always)]
fn fwd6(ctx: &SockAddrContext, hook: u8) -> i32 {
    let sa = ctx.sock_addr;
    let Some(proto) = l4_proto(sa) else {
        count(Reason::UnsupportedProto);
        return ALLOW;
    };
    if !socket_lb_applies(ctx, proto) {
        return ALLOW;
    }
    let addr = read_ip6(sa);
    let port = read_port(sa);
    let sk = sk(sa);
    if is_v4_mapped(&addr) {
        let r = xlate_fwd::<V4>(addr[3], port, proto, sk, || netns(ctx));
        let asked = Asked {
            hook,
            proto,
            addr: addr[3],
            port,
        };
        return fwd_verdict(
            ctx,
            &asked,
            r,
            |to| {
                write_ip6(sa, [0, 0, V4_MAPPED_WORD, to.addr]);
                write_port(sa, to.port);
            },
            || svc_cidr4(addr[3]),
        );
    }
    let r = xlate_fwd::<V6>(addr, port, proto, sk, || netns(ctx));
    let asked = Asked {
        hook,
        proto,
        addr,
        port,
    };
    fwd_verdict(
        ctx,
        &asked,
        r,
        |to| {
            write_ip6(sa, to.addr);
            write_port(sa, to.port);
        },
        || svc_cidr6(addr),
    )
}

#[inline(always)]
fn rev6(ctx: &SockAddrContext) {
    let sa = ctx.sock_addr;
    let Some(proto) = l4_proto(sa) else { return };
    let addr = read_ip6(sa);
    let port = read_port(sa);
    let sk = sk(sa);
    if is_v4_mapped(&addr) {
        let r = xlate_rev::<V4>(addr[3], port, proto, sk, || cookie(ctx));
        return rev_apply(r, |front| {
            write_ip6(sa, [0, 0, V4_MAPPED_WORD, front.addr]);
            write_port(sa, front.port);
        });
    }
    let r = xlate_rev::<V6>(addr, port, proto, sk, || cookie(ctx));
    rev_apply(r, |front| {
        write_ip6(sa, front.addr);
        write_port(sa, front.port);
    })
}
