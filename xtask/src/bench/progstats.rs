//! The kernel's run-time statistics of an attached program (`BPF_ENABLE_STATS`, what
//! `bpftool prog` prints as `run_time_ns` / `run_cnt`): the packet-rate part divides the
//! program's time by its runs over a measured interval, the program's own cost per
//! packet under the real flood (warm caches, the real path), which `BPF_PROG_RUN` of one
//! packet per call cannot give for a conntrack hit. The program is found from the
//! agent's pinned link (`<pins>/links/xdp-<iface>`, `links/tc-<iface>-ingress`), so
//! programs of the same name loaded by anything else on the machine are not counted.
//!
//! Raw `bpf(2)`: xtask does not link aya (setup must build without the eBPF toolchain).

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    path::Path,
};

const BPF_OBJ_GET: i64 = 7;
const BPF_PROG_GET_FD_BY_ID: i64 = 13;
const BPF_OBJ_GET_INFO_BY_FD: i64 = 15;
const BPF_ENABLE_STATS: i64 = 32;
const BPF_STATS_RUN_TIME: u32 = 0;
/// `struct bpf_prog_info`: `run_time_ns` and `run_cnt` (linux/bpf.h, kernel >= 5.1).
const PROG_INFO_RUN_TIME_NS: usize = 192;
const PROG_INFO_RUN_CNT: usize = 200;
const PROG_INFO_LEN: usize = 208;
/// `struct bpf_link_info`: `prog_id`.
const LINK_INFO_PROG_ID: usize = 8;
const LINK_INFO_LEN: usize = 64;

/// `bpf_attr` as bytes (its largest member is well under 160 bytes; the rest is zero):
/// this module's calls and the packet-rate bench's own programs (`pps/xdp_progs.rs`).
#[repr(C, align(8))]
#[derive(Clone)]
pub struct Attr([u8; 160]);

impl Attr {
    pub fn new() -> Self {
        Self([0; 160])
    }
    pub fn u32(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    pub fn u64(&mut self, off: usize, v: u64) -> &mut Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    pub fn bytes(&mut self, off: usize, v: &[u8]) -> &mut Self {
        self.0[off..off + v.len()].copy_from_slice(v);
        self
    }
    pub fn sys(&mut self, cmd: i64) -> io::Result<i64> {
        // SAFETY: bpf(2) with a zero-padded attr of the size we pass; every pointer in
        // it points into buffers the caller keeps alive across the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                self.0.as_mut_ptr(),
                self.0.len() as libc::c_uint,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(rc)
    }
}

fn owned(fd: i64) -> OwnedFd {
    // SAFETY: a new fd the kernel just returned to us.
    unsafe { OwnedFd::from_raw_fd(fd as RawFd) }
}

/// Run-time statistics are collected for every program while this is alive.
pub struct StatsOn(#[allow(dead_code)] OwnedFd);

pub fn enable() -> io::Result<StatsOn> {
    Attr::new()
        .u32(0, BPF_STATS_RUN_TIME)
        .sys(BPF_ENABLE_STATS)
        .map(|fd| StatsOn(owned(fd)))
}

fn info(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<()> {
    Attr::new()
        .u32(0, fd.as_raw_fd() as u32)
        .u32(4, buf.len() as u32)
        .u64(8, buf.as_mut_ptr() as u64)
        .sys(BPF_OBJ_GET_INFO_BY_FD)
        .map(|_| ())
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

/// The program id behind a pinned link.
pub fn linked_prog_id(link_pin: &Path) -> io::Result<u32> {
    let path = CString::new(link_pin.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let link = Attr::new()
        .u64(0, path.as_ptr() as u64)
        .sys(BPF_OBJ_GET)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", link_pin.display())))?;
    link_prog_id(&owned(link))
}

/// The program id behind a link we hold an fd of.
pub fn link_prog_id(link: &OwnedFd) -> io::Result<u32> {
    let mut buf = [0u8; LINK_INFO_LEN];
    info(link, &mut buf)?;
    Ok(u32::from_ne_bytes(
        buf[LINK_INFO_PROG_ID..LINK_INFO_PROG_ID + 4]
            .try_into()
            .expect("4 bytes"),
    ))
}

/// (ns, runs) of program `id` so far.
pub fn run_stats(id: u32) -> io::Result<(u64, u64)> {
    let prog = owned(Attr::new().u32(0, id).sys(BPF_PROG_GET_FD_BY_ID)?);
    let mut buf = [0u8; PROG_INFO_LEN];
    info(&prog, &mut buf)?;
    Ok((
        u64_at(&buf, PROG_INFO_RUN_TIME_NS),
        u64_at(&buf, PROG_INFO_RUN_CNT),
    ))
}

/// The program's ns per run between two `run_stats` readings, and the runs.
pub fn per_run(before: (u64, u64), after: (u64, u64)) -> Option<(f64, u64)> {
    let runs = after.1.checked_sub(before.1)?;
    (runs > 0).then(|| (after.0.saturating_sub(before.0) as f64 / runs as f64, runs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_run_divides_the_interval() {
        assert_eq!(per_run((1_000, 10), (4_000, 40)), Some((100.0, 30)));
        assert_eq!(per_run((1_000, 10), (1_000, 10)), None);
        assert_eq!(per_run((1_000, 10), (0, 5)), None);
    }
}
