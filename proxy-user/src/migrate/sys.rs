//! The few `bpf(2)` commands the upgrade needs on raw bytes, which aya 0.14 keeps private
//! or typed: object get, map info, key iteration, lookup and update on byte buffers, and
//! `BPF_LINK_UPDATE`.

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    os::unix::ffi::OsStrExt,
    path::Path,
};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;

/// `BPF_ANY`: create or replace.
pub const ANY: u64 = 0;
/// `BPF_NOEXIST`: create only.
pub const NOEXIST: u64 = 1;

/// Map types the copy needs to tell apart (`enum bpf_map_type`).
pub mod map_type {
    pub const ARRAY: u32 = 2;
    pub const PERCPU_HASH: u32 = 5;
    pub const PERCPU_ARRAY: u32 = 6;
    pub const LRU_PERCPU_HASH: u32 = 10;
    pub const SK_STORAGE: u32 = 24;
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a #[repr(C)] prefix of `union bpf_attr` for `cmd`, zero-padded by
    // construction; the kernel reads (and for some commands writes) at most its size.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

#[repr(C)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// `BPF_OBJ_GET`: an fd for the object pinned at `path`.
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `BPF_OBJ_PIN`: pins the object `fd` (also) at `path`.
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// What the copy needs of `struct bpf_map_info`.
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
    /// Bytes of one value as lookup/update see it (per-CPU maps: one 8-byte-aligned slot
    /// per possible CPU).
    pub fn value_buf_len(&self) -> io::Result<usize> {
        let per_cpu = matches!(
            self.map_type,
            map_type::PERCPU_HASH | map_type::PERCPU_ARRAY | map_type::LRU_PERCPU_HASH
        );
        if per_cpu {
            let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
            Ok((self.value_size as usize).div_ceil(8) * 8 * cpus)
        } else {
            Ok(self.value_size as usize)
        }
    }
}

/// `BPF_OBJ_GET_INFO_BY_FD` for a map.
pub fn map_info(fd: BorrowedFd<'_>) -> io::Result<MapInfo> {
    let mut info = [0u32; 32];
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: std::mem::size_of_val(&info) as u32,
        info: info.as_mut_ptr() as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(MapInfo {
        map_type: info[0],
        id: info[1],
        key_size: info[2],
        value_size: info[3],
        max_entries: info[4],
        map_flags: info[5],
    })
}

#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `BPF_MAP_GET_NEXT_KEY`: the key after `key` (the first with `None`) into `next`;
/// `false` at the end.
pub fn next_key(fd: BorrowedFd<'_>, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let mut attr = ElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.map_or(0, |k| k.as_ptr() as u64),
        value: next.as_mut_ptr() as u64,
        flags: 0,
    };
    match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_LOOKUP_ELEM` into `value`; `false` when the key is absent.
pub fn lookup(fd: BorrowedFd<'_>, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let mut attr = ElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_mut_ptr() as u64,
        flags: 0,
    };
    match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_UPDATE_ELEM`; with [`NOEXIST`], `Ok(false)` when the key is there already.
pub fn update(fd: BorrowedFd<'_>, key: &[u8], value: &[u8], flags: u64) -> io::Result<bool> {
    let mut attr = ElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_ptr() as u64,
        flags,
    };
    match bpf(BPF_MAP_UPDATE_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if flags == NOEXIST && e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(e),
    }
}

#[repr(C)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// `BPF_LINK_UPDATE`: the link runs `prog` from now on (one atomic pointer swap in the
/// kernel: no packet or syscall sees no program).
pub fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkUpdateAttr {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}
