//! Which filesystem a path is on (`statfs`): the pin path must be on bpffs, the hooks'
//! cgroup on cgroup2. A leaf: used by the loader, `cgroup.rs` and `proxyctl`.

use std::{ffi::CString, io, os::unix::ffi::OsStrExt as _, path::Path};

/// `BPF_FS_MAGIC` (`include/uapi/linux/magic.h`): `statfs.f_type` of a bpffs mount.
pub const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The filesystem magic of `path` (statfs `f_type`).
pub fn magic(path: &Path) -> io::Result<i64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statfs on a NUL-terminated path into a zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast, reason = "f_type's width differs by target")]
    Ok(st.f_type as i64)
}
