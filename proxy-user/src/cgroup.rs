//! Finding the cgroup v2 hierarchy the socket hooks attach to.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

/// The mount point of the cgroup v2 hierarchy, from `/proc/self/mountinfo`.
/// (`/sys/fs/cgroup` on most nodes, `/sys/fs/cgroup/unified` on hybrid systems.)
pub fn cgroup2_mount() -> io::Result<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo")?;
    parse_cgroup2_mount(&info).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no cgroup2 mount in /proc/self/mountinfo (mount -t cgroup2 none /sys/fs/cgroup)",
        )
    })
}

/// Parses mountinfo lines: `id parent maj:min root mountpoint opts [optional...] - fstype src super`.
fn parse_cgroup2_mount(info: &str) -> Option<PathBuf> {
    info.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        let mountpoint = left.split_whitespace().nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(unescape(mountpoint)))
    })
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Checks that `path` is a directory of a cgroup v2 hierarchy.
pub fn check_cgroup2_dir(path: &Path) -> io::Result<()> {
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    let magic = crate::fs::magic(path)
        .map_err(|e| io::Error::new(e.kind(), format!("cgroup {}: {e}", path.display())))?;
    if magic != CGROUP2_SUPER_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a cgroup v2 directory", path.display()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_in_hybrid_and_unified_layouts() {
        let hybrid = "\
25 1 0:23 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/unified rw,nosuid,nodev shared:4 - cgroup2 cgroup2 rw
27 25 0:25 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
";
        assert_eq!(
            parse_cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified =
            "30 1 0:26 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            parse_cgroup2_mount(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(
            parse_cgroup2_mount("1 0 0:1 / / rw - ext4 /dev/vda rw\n"),
            None
        );
        let escaped = "30 1 0:26 / /mnt/my\\040cg rw - cgroup2 none rw\n";
        assert_eq!(
            parse_cgroup2_mount(escaped),
            Some(PathBuf::from("/mnt/my cg"))
        );
    }
}
