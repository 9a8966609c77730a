//! The kernel interface in one leaf: every `bpf(2)` command the project issues, typed,
//! with the `union bpf_attr` member of each laid out as in `linux/bpf.h` and each errno
//! that means something other than failure mapped here, once:
//!
//! | command | function | errno mapped |
//! |---|---|---|
//! | `BPF_MAP_CREATE` | [`map_create`] (tests: a map of another size to pin) | |
//! | `BPF_PROG_QUERY` | [`prog_query`] (tests: the programs on a cgroup) | |
//! | `BPF_OBJ_GET` | [`obj_get`] | (callers name `ENOENT`/`EACCES` per object) |
//! | `BPF_OBJ_PIN` | [`obj_pin`] | |
//! | `BPF_OBJ_GET_INFO_BY_FD` | [`map_info`], [`link_info`], [`prog_run_stats`] | |
//! | `BPF_MAP_LOOKUP_ELEM` | [`map_lookup`] | `ENOENT` -> `Ok(false)` |
//! | `BPF_MAP_UPDATE_ELEM` | [`map_update`] | `EEXIST` with [`NOEXIST`] -> `Ok(false)` |
//! | `BPF_MAP_GET_NEXT_KEY` | [`map_next_key`] | `ENOENT` -> `Ok(false)` (the end) |
//! | `BPF_MAP_LOOKUP_BATCH` | [`map_lookup_batch`] | `ENOENT` -> [`BatchEnd::End`] |
//! | `BPF_MAP_UPDATE_BATCH` | [`map_update_batch`] | count applied kept with the error |
//! | `BPF_MAP_DELETE_BATCH` | [`map_delete_batch`] | count applied kept with the error |
//! | `BPF_LINK_UPDATE` | [`link_update`] | |
//! | `BPF_LINK_CREATE` | [`link_create_xdp`] | |
//! | `BPF_PROG_LOAD` | [`prog_load`] | |
//! | `BPF_PROG_TEST_RUN` | [`prog_test_run_live`] | |
//! | `BPF_PROG_GET_FD_BY_ID` | [`prog_get_fd_by_id`] | |
//! | `BPF_ENABLE_STATS` | [`enable_stats`] | |
//!
//! std and libc only: xtask uses it without linking aya (setup must build without the
//! eBPF toolchain). Nothing outside this crate calls `libc::syscall(SYS_bpf, ..)`.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

/// `enum bpf_cmd`.
mod cmd {
    pub const MAP_CREATE: libc::c_long = 0;
    pub const MAP_LOOKUP_ELEM: libc::c_long = 1;
    pub const MAP_UPDATE_ELEM: libc::c_long = 2;
    pub const MAP_GET_NEXT_KEY: libc::c_long = 4;
    pub const PROG_LOAD: libc::c_long = 5;
    pub const OBJ_PIN: libc::c_long = 6;
    pub const OBJ_GET: libc::c_long = 7;
    pub const PROG_TEST_RUN: libc::c_long = 10;
    pub const PROG_GET_FD_BY_ID: libc::c_long = 13;
    pub const OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    pub const PROG_QUERY: libc::c_long = 16;
    pub const MAP_LOOKUP_BATCH: libc::c_long = 24;
    pub const MAP_UPDATE_BATCH: libc::c_long = 26;
    pub const MAP_DELETE_BATCH: libc::c_long = 27;
    pub const LINK_CREATE: libc::c_long = 28;
    pub const LINK_UPDATE: libc::c_long = 29;
    pub const ENABLE_STATS: libc::c_long = 32;
}

/// `BPF_ANY`: create or replace.
pub const ANY: u64 = 0;
/// `BPF_NOEXIST`: create only.
pub const NOEXIST: u64 = 1;
/// `BPF_F_RDONLY`: the returned descriptor only allows lookups.
pub const F_RDONLY: u32 = 1 << 3;
/// The kernel-internal `ENOTSUPP` (not `EOPNOTSUPP`), which `bpf(2)` returns for a map
/// type without an operation (batch ops, `GET_NEXT_KEY` on socket storage).
pub const ENOTSUPP: i32 = 524;

/// Map types the project tells apart (`enum bpf_map_type`).
pub mod map_type {
    pub const HASH: u32 = 1;
    pub const ARRAY: u32 = 2;
    pub const PERCPU_HASH: u32 = 5;
    pub const PERCPU_ARRAY: u32 = 6;
    pub const LRU_PERCPU_HASH: u32 = 10;
    pub const SK_STORAGE: u32 = 24;
    pub const RINGBUF: u32 = 27;
}

/// Link types (`enum bpf_link_type`).
pub mod link_type {
    pub const CGROUP: u32 = 3;
}

/// `bpf_attr` as bytes: every command's member is well under 160 bytes; the rest stays
/// zero, as the kernel requires of every byte past the command's fields.
#[repr(C, align(8))]
#[derive(Clone)]
struct Attr([u8; 160]);

impl Attr {
    fn new() -> Self {
        Self([0; 160])
    }
    fn u32(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, off: usize, v: u64) -> &mut Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn ptr<T>(&mut self, off: usize, p: *const T) -> &mut Self {
        self.u64(off, p as u64)
    }
    fn bytes(&mut self, off: usize, v: &[u8]) -> &mut Self {
        self.0[off..off + v.len()].copy_from_slice(v);
        self
    }
    fn get_u32(&self, off: usize) -> u32 {
        u32::from_ne_bytes(self.0[off..off + 4].try_into().expect("4 bytes"))
    }
    /// The one `bpf(2)` call site.
    fn sys(&mut self, cmd: libc::c_long) -> io::Result<libc::c_long> {
        // SAFETY: a zero-padded attr of the size passed; every pointer in it points into
        // buffers the calling function keeps alive (and sized as the command needs)
        // across the call; the kernel writes back at most the attr itself.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                self.0.as_mut_ptr(),
                self.0.len() as libc::c_uint,
            )
        };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    }
    /// [`Self::sys`] for a command that returns a new descriptor.
    fn sys_fd(&mut self, cmd: libc::c_long) -> io::Result<OwnedFd> {
        let fd = self.sys(cmd)?;
        let fd = i32::try_from(fd).map_err(|_| io::Error::other("fd out of range"))?;
        // SAFETY: the kernel returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

fn fd_u32(fd: BorrowedFd<'_>) -> u32 {
    fd.as_raw_fd() as u32
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

// ---- objects -------------------------------------------------------------------------

/// `BPF_OBJ_GET`: a descriptor of the object pinned at `path`; `flags` 0 or
/// [`F_RDONLY`] (maps only: links refuse it).
pub fn obj_get(path: &Path, flags: u32) -> io::Result<OwnedFd> {
    let c = c_path(path)?;
    Attr::new()
        .ptr(0, c.as_ptr())
        .u32(12, flags)
        .sys_fd(cmd::OBJ_GET)
}

/// `BPF_OBJ_PIN`: pins the object `fd` (also) at `path`.
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c = c_path(path)?;
    Attr::new()
        .ptr(0, c.as_ptr())
        .u32(8, fd_u32(fd))
        .sys(cmd::OBJ_PIN)
        .map(drop)
}

/// `BPF_OBJ_GET_INFO_BY_FD` into `buf` (a prefix of `struct bpf_*_info`).
fn obj_info(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<()> {
    Attr::new()
        .u32(0, fd_u32(fd))
        .u32(4, buf.len() as u32)
        .ptr(8, buf.as_mut_ptr())
        .sys(cmd::OBJ_GET_INFO_BY_FD)
        .map(drop)
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

/// `struct bpf_map_info`'s first fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapInfo {
    pub map_type: u32,
    pub id: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub map_flags: u32,
}

impl MapInfo {
    /// Whether values are per possible CPU.
    pub fn per_cpu(&self) -> bool {
        matches!(
            self.map_type,
            map_type::PERCPU_HASH | map_type::PERCPU_ARRAY | map_type::LRU_PERCPU_HASH
        )
    }
}

/// `BPF_OBJ_GET_INFO_BY_FD` for a map.
pub fn map_info(fd: BorrowedFd<'_>) -> io::Result<MapInfo> {
    let mut b = [0u8; 128];
    obj_info(fd, &mut b)?;
    Ok(MapInfo {
        map_type: u32_at(&b, 0),
        id: u32_at(&b, 4),
        key_size: u32_at(&b, 8),
        value_size: u32_at(&b, 12),
        max_entries: u32_at(&b, 16),
        map_flags: u32_at(&b, 20),
    })
}

/// `struct bpf_link_info`: type, id, prog_id, and for a cgroup link its cgroup id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkInfo {
    pub link_type: u32,
    pub id: u32,
    pub prog_id: u32,
    /// `cgroup.cgroup_id` (the union at offset 16), when `link_type` is
    /// [`link_type::CGROUP`]; else the union's first 8 bytes.
    pub cgroup_id: u64,
}

/// `BPF_OBJ_GET_INFO_BY_FD` for a link.
pub fn link_info(fd: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    let mut b = [0u8; 64];
    obj_info(fd, &mut b)?;
    Ok(LinkInfo {
        link_type: u32_at(&b, 0),
        id: u32_at(&b, 4),
        prog_id: u32_at(&b, 8),
        cgroup_id: u64_at(&b, 16),
    })
}

/// `struct bpf_prog_info`: `run_time_ns` and `run_cnt` (kernel >= 5.1).
const PROG_INFO_RUN_TIME_NS: usize = 192;
const PROG_INFO_RUN_CNT: usize = 200;
const PROG_INFO_LEN: usize = 208;

/// `BPF_OBJ_GET_INFO_BY_FD` for a program: (`run_time_ns`, `run_cnt`), counted while
/// [`enable_stats`] is held.
pub fn prog_run_stats(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    let mut b = [0u8; PROG_INFO_LEN];
    obj_info(fd, &mut b)?;
    Ok((
        u64_at(&b, PROG_INFO_RUN_TIME_NS),
        u64_at(&b, PROG_INFO_RUN_CNT),
    ))
}

/// `BPF_PROG_GET_FD_BY_ID`.
pub fn prog_get_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    Attr::new().u32(0, id).sys_fd(cmd::PROG_GET_FD_BY_ID)
}

/// `BPF_ENABLE_STATS(BPF_STATS_RUN_TIME)`: run-time statistics are collected for every
/// program while the returned descriptor is open.
pub fn enable_stats() -> io::Result<OwnedFd> {
    const BPF_STATS_RUN_TIME: u32 = 0;
    Attr::new()
        .u32(0, BPF_STATS_RUN_TIME)
        .sys_fd(cmd::ENABLE_STATS)
}

/// `BPF_MAP_CREATE` of a map without BTF.
pub fn map_create(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
) -> io::Result<OwnedFd> {
    Attr::new()
        .u32(0, map_type)
        .u32(4, key_size)
        .u32(8, value_size)
        .u32(12, max_entries)
        .u32(16, map_flags)
        .sys_fd(cmd::MAP_CREATE)
}

/// `BPF_PROG_QUERY`: the ids of the programs attached to `target` (a cgroup directory)
/// for `attach_type`, up to `max` of them.
pub fn prog_query(target: BorrowedFd<'_>, attach_type: u32, max: usize) -> io::Result<Vec<u32>> {
    let mut ids = vec![0u32; max];
    let mut a = Attr::new();
    a.u32(0, fd_u32(target))
        .u32(4, attach_type)
        .ptr(16, ids.as_mut_ptr())
        .u32(24, max as u32);
    a.sys(cmd::PROG_QUERY)?;
    ids.truncate(a.get_u32(24) as usize);
    Ok(ids)
}

// ---- one element, raw bytes ----------------------------------------------------------

fn elem(fd: BorrowedFd<'_>, key: u64, value: u64, flags: u64) -> Attr {
    let mut a = Attr::new();
    a.u32(0, fd_u32(fd))
        .u64(8, key)
        .u64(16, value)
        .u64(24, flags);
    a
}

/// `BPF_MAP_LOOKUP_ELEM` into `value` (the map's value size; per-CPU maps: one 8-byte
/// aligned slot per possible CPU); `false` when the key is absent.
pub fn map_lookup(fd: BorrowedFd<'_>, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let mut a = elem(fd, key.as_ptr() as u64, value.as_mut_ptr() as u64, 0);
    match a.sys(cmd::MAP_LOOKUP_ELEM) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_UPDATE_ELEM` with `flags` ([`ANY`], [`NOEXIST`]); with [`NOEXIST`],
/// `Ok(false)` when the key is there already.
pub fn map_update(fd: BorrowedFd<'_>, key: &[u8], value: &[u8], flags: u64) -> io::Result<bool> {
    let mut a = elem(fd, key.as_ptr() as u64, value.as_ptr() as u64, flags);
    match a.sys(cmd::MAP_UPDATE_ELEM) {
        Ok(_) => Ok(true),
        Err(e) if flags == NOEXIST && e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_GET_NEXT_KEY`: the key after `key` (the first with `None`) into `next`;
/// `false` at the end.
pub fn map_next_key(fd: BorrowedFd<'_>, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let k = key.map_or(0, |k| k.as_ptr() as u64);
    let mut a = elem(fd, k, next.as_mut_ptr() as u64, 0);
    match a.sys(cmd::MAP_GET_NEXT_KEY) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

// ---- batches ------------------------------------------------------------------------

/// `union bpf_attr`'s `batch` member: in_batch 0, out_batch 8, keys 16, values 24,
/// count 32, map_fd 36, elem_flags 40, flags 48.
fn batch_attr(fd: BorrowedFd<'_>, keys: u64, values: u64, count: u32) -> Attr {
    let mut a = Attr::new();
    a.u64(16, keys)
        .u64(24, values)
        .u32(32, count)
        .u32(36, fd_u32(fd));
    a
}

/// A batch call that failed: the kernel's `count` after the call (how far it got; equal
/// to the input when it refused before starting) and the error.
#[derive(Debug)]
pub struct BatchFailed {
    pub count: u32,
    pub error: io::Error,
}

/// `BPF_MAP_UPDATE_BATCH` of `keys[i] = values[i]` (`BPF_ANY`). `K` and `V` must be the
/// map's key and value layouts (the caller's typed map checks the sizes).
pub fn map_update_batch<K: Copy, V: Copy>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), BatchFailed> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    let count = u32::try_from(keys.len()).map_err(|_| BatchFailed {
        count: 0,
        error: io::Error::from_raw_os_error(libc::E2BIG),
    })?;
    let mut a = batch_attr(fd, keys.as_ptr() as u64, values.as_ptr() as u64, count);
    a.sys(cmd::MAP_UPDATE_BATCH)
        .map(drop)
        .map_err(|error| BatchFailed {
            count: a.get_u32(32),
            error,
        })
}

/// `BPF_MAP_UPDATE_BATCH` of `count` keys and values laid out back to back in raw bytes
/// (a caller that knows the layouts only by their sizes, as the map-cost bench).
pub fn map_update_batch_raw(
    fd: BorrowedFd<'_>,
    keys: &[u8],
    values: &[u8],
    count: u32,
) -> Result<(), BatchFailed> {
    let mut a = batch_attr(fd, keys.as_ptr() as u64, values.as_ptr() as u64, count);
    a.sys(cmd::MAP_UPDATE_BATCH)
        .map(drop)
        .map_err(|error| BatchFailed {
            count: a.get_u32(32),
            error,
        })
}

/// `BPF_MAP_DELETE_BATCH` of `keys`: `Ok(count deleted)` or the failure (an absent key
/// stops the kernel's batch with `ENOENT`, `count` then says where).
pub fn map_delete_batch<K: Copy>(fd: BorrowedFd<'_>, keys: &[K]) -> Result<u32, BatchFailed> {
    let count = u32::try_from(keys.len()).unwrap_or(u32::MAX);
    let mut a = batch_attr(fd, keys.as_ptr() as u64, 0, count);
    match a.sys(cmd::MAP_DELETE_BATCH) {
        Ok(_) => Ok(a.get_u32(32)),
        Err(error) => Err(BatchFailed {
            count: a.get_u32(32),
            error,
        }),
    }
}

/// How a batch lookup ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchEnd {
    /// More entries follow: call again with the token written to `token_out`.
    More,
    /// The end of the map (`ENOENT`): these were the last entries.
    End,
}

/// Every entry of a hash or array map read by `BPF_MAP_LOOKUP_BATCH`, `chunk` entries per
/// call into fixed buffers (a bucket with more entries than a chunk doubles the chunk, up
/// to 65,536): `each` gets every call's keys and values, `got` of each, back to back in
/// raw bytes of `key_size` and `value_size`. Returns the entries read.
pub fn map_walk_batch(
    fd: BorrowedFd<'_>,
    key_size: usize,
    value_size: usize,
    mut chunk: u32,
    mut each: impl FnMut(&[u8], &[u8], u32),
) -> io::Result<u64> {
    let mut keys = vec![0u8; chunk as usize * key_size];
    let mut values = vec![0u8; chunk as usize * value_size];
    let token_len = key_size.max(8);
    let (mut token_in, mut token_out) = (vec![0u8; token_len], vec![0u8; token_len]);
    let (mut read, mut first) = (0u64, true);
    loop {
        let r = map_lookup_batch(
            fd,
            (!first).then_some(&token_in[..]),
            &mut token_out,
            &mut keys,
            &mut values,
            chunk,
        );
        let (got, end) = match r {
            Ok(r) => r,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && chunk < (1 << 16) => {
                chunk *= 2;
                keys.resize(chunk as usize * key_size, 0);
                values.resize(chunk as usize * value_size, 0);
                continue;
            }
            Err(e) => return Err(e),
        };
        each(&keys, &values, got);
        read += u64::from(got);
        if end == BatchEnd::End {
            return Ok(read);
        }
        first = false;
        token_in.copy_from_slice(&token_out);
    }
}

/// `BPF_MAP_LOOKUP_BATCH` of up to `count` entries into `keys` and `values` (raw, at
/// least `count` keys and values long), from the position `token_in` (`None`: the start),
/// writing the next position to `token_out` (both the larger of the key size and 8).
/// `Ok((entries read, end))`.
pub fn map_lookup_batch(
    fd: BorrowedFd<'_>,
    token_in: Option<&[u8]>,
    token_out: &mut [u8],
    keys: &mut [u8],
    values: &mut [u8],
    count: u32,
) -> io::Result<(u32, BatchEnd)> {
    let mut a = batch_attr(
        fd,
        keys.as_mut_ptr() as u64,
        values.as_mut_ptr() as u64,
        count,
    );
    a.u64(0, token_in.map_or(0, |t| t.as_ptr() as u64))
        .ptr(8, token_out.as_mut_ptr());
    let r = a.sys(cmd::MAP_LOOKUP_BATCH);
    let got = a.get_u32(32).min(count);
    match r {
        Ok(_) => Ok((got, BatchEnd::More)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok((got, BatchEnd::End)),
        Err(e) => Err(e),
    }
}

// ---- links and programs -------------------------------------------------------------

/// `BPF_LINK_UPDATE`: the link runs `prog` from now on (one atomic pointer swap in the
/// kernel: no packet or syscall sees no program).
pub fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    Attr::new()
        .u32(0, fd_u32(link))
        .u32(4, fd_u32(prog))
        .sys(cmd::LINK_UPDATE)
        .map(drop)
}

/// `BPF_PROG_TYPE_XDP` and its attach type `BPF_XDP`.
pub const PROG_TYPE_XDP: u32 = 6;
pub const ATTACH_XDP: u32 = 37;
/// `XDP_FLAGS_DRV_MODE`.
pub const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// `BPF_LINK_CREATE` of an XDP link of `prog` on `ifindex` (of the calling thread's
/// namespace) with `flags`; detached when the descriptor closes.
pub fn link_create_xdp(prog: BorrowedFd<'_>, ifindex: u32, flags: u32) -> io::Result<OwnedFd> {
    Attr::new()
        .u32(0, fd_u32(prog))
        .u32(4, ifindex)
        .u32(8, ATTACH_XDP)
        .u32(12, flags)
        .sys_fd(cmd::LINK_CREATE)
}

/// A program to load with [`prog_load`].
pub struct ProgLoad<'a> {
    pub prog_type: u32,
    /// The instructions, 8 bytes each.
    pub insns: &'a [u8],
    /// NUL-terminated.
    pub license: &'a [u8],
    /// Up to 15 bytes are used.
    pub name: &'a str,
    pub expected_attach_type: u32,
}

/// `BPF_PROG_LOAD`; with `log`, the verifier's log (level 1) is written into it.
pub fn prog_load(p: &ProgLoad<'_>, log: Option<&mut [u8]>) -> io::Result<OwnedFd> {
    assert_eq!(p.insns.len() % 8, 0, "8-byte instructions");
    assert_eq!(p.license.last(), Some(&0), "NUL-terminated license");
    let mut a = Attr::new();
    a.u32(0, p.prog_type)
        .u32(4, (p.insns.len() / 8) as u32)
        .ptr(8, p.insns.as_ptr())
        .ptr(16, p.license.as_ptr())
        .u32(68, p.expected_attach_type);
    if let Some(log) = log {
        a.u32(24, 1)
            .u32(28, log.len() as u32)
            .ptr(32, log.as_mut_ptr());
    }
    let n = p.name.as_bytes();
    a.bytes(48, &n[..n.len().min(15)]);
    a.sys_fd(cmd::PROG_LOAD)
}

/// `BPF_F_TEST_XDP_LIVE_FRAMES`.
const F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;

/// `BPF_PROG_TEST_RUN` of an XDP program in live-frames mode: `repeat` copies of
/// `frame` really transmitted (batch size 64).
pub fn prog_test_run_live(prog: BorrowedFd<'_>, frame: &[u8], repeat: u32) -> io::Result<()> {
    Attr::new()
        .u32(0, fd_u32(prog))
        .u32(8, frame.len() as u32)
        .ptr(16, frame.as_ptr())
        .u32(32, repeat)
        .u32(64, F_TEST_XDP_LIVE_FRAMES)
        .u32(72, 64)
        .sys(cmd::PROG_TEST_RUN)
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attr_fields_land_where_linux_bpf_h_puts_them() {
        let mut a = Attr::new();
        a.u32(32, 7).u64(8, 0x0102_0304_0506_0708);
        assert_eq!(a.get_u32(32), 7);
        assert_eq!(u64_at(&a.0, 8), 0x0102_0304_0506_0708);
        assert!(a.0[..8].iter().all(|b| *b == 0));
    }

    #[test]
    fn a_missing_pin_is_enoent() {
        let e = obj_get(Path::new("/nonexistent-bpf-sys-test/x"), 0).expect_err("no such pin");
        assert!(matches!(
            e.raw_os_error(),
            Some(libc::ENOENT) | Some(libc::EPERM) | Some(libc::EACCES)
        ));
    }
}
