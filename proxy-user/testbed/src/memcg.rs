//! A fresh child memory cgroup ([`MemCgroup`]) below the calling process's own, for
//! measuring what a process charges: its pages, and the kernel memory it allocates with
//! accounting on (BPF maps, x_tables and nf_tables rules), which stays charged there after
//! the process exits for as long as the kernel objects live. Used by the memory-limit test
//! (the DaemonSet's limit against the real agent) and by `cargo xtask bench --api` (the
//! kernel memory of kube-proxy's rules, side by side with the agent's maps).
//!
//! The memory controller: cgroup v2 when the unified hierarchy has it, else the v1 memory
//! controller (the hybrid-mode machines this project runs on: the unified hierarchy at
//! /sys/fs/cgroup/unified has no memory controller); both charge kernel memory by the same
//! memcg code. Both are found from /proc/self/mountinfo and /proc/self/cgroup.

use std::{
    fs, io,
    os::{fd::AsRawFd, unix::process::CommandExt as _},
    path::PathBuf,
    process::Command,
};

/// A child memory cgroup, removed on drop (what is still charged to it then, such as
/// pinned maps or loaded rules, the kernel moves to the parent).
pub struct MemCgroup {
    pub path: PathBuf,
    /// cgroup v2 (else the v1 memory controller).
    pub v2: bool,
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, what)
}

impl MemCgroup {
    /// A new child cgroup named `unique(prefix)`, with `limit` bytes as its limit when
    /// given (no swap).
    pub fn new(prefix: &str, limit: Option<u64>) -> io::Result<Self> {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
        let own = fs::read_to_string("/proc/self/cgroup")?;
        // mountinfo: "id parent major:minor root mountpoint opts - fstype source superopts".
        let mounts: Vec<(String, String, String)> = mountinfo
            .lines()
            .filter_map(|l| {
                let (left, right) = l.split_once(" - ")?;
                let mount_point = left.split_whitespace().nth(4)?.to_string();
                let mut r = right.split_whitespace();
                let fstype = r.next()?.to_string();
                let superopts = r.nth(1).unwrap_or("").to_string();
                Some((mount_point, fstype, superopts))
            })
            .collect();
        let v2_mount = mounts
            .iter()
            .find(|(_, t, _)| t == "cgroup2")
            .map(|(m, _, _)| PathBuf::from(m));
        let v2_controllers = v2_mount
            .as_ref()
            .and_then(|m| fs::read_to_string(m.join("cgroup.controllers")).ok())
            .unwrap_or_default();
        let (parent, v2) = if v2_controllers.split_whitespace().any(|c| c == "memory") {
            let mount = v2_mount.ok_or_else(|| invalid("no cgroup2 mount".into()))?;
            let rel = own
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .ok_or_else(|| invalid("no 0:: line in /proc/self/cgroup".into()))?;
            (mount.join(rel.trim_start_matches('/')), true)
        } else {
            let mount = mounts
                .iter()
                .find(|(_, t, o)| t == "cgroup" && o.split(',').any(|x| x == "memory"))
                .map(|(m, _, _)| PathBuf::from(m))
                .ok_or_else(|| {
                    invalid(format!(
                        "no memory controller: the cgroup2 hierarchy at {v2_mount:?} has \
                         controllers {:?} and no cgroup v1 memory hierarchy is mounted",
                        v2_controllers.trim()
                    ))
                })?;
            let rel = own
                .lines()
                .find_map(|l| {
                    let mut f = l.splitn(3, ':');
                    let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
                    ctrl.split(',').any(|c| c == "memory").then_some(path)
                })
                .ok_or_else(|| invalid("no memory line in /proc/self/cgroup".into()))?;
            (mount.join(rel.trim_start_matches('/')), false)
        };
        if v2 {
            // The child's memory files exist only if the parent delegates the controller
            // (refused when the parent holds processes: then memory.max below says so).
            let _ = fs::write(parent.join("cgroup.subtree_control"), "+memory");
        }
        let path = parent.join(crate::unique(prefix));
        fs::create_dir(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        let cg = Self { path, v2 };
        if let Some(limit) = limit {
            if v2 {
                cg.write("memory.max", &limit.to_string())?;
                cg.write("memory.swap.max", "0")?;
            } else {
                cg.write("memory.limit_in_bytes", &limit.to_string())?;
                // No swap on the machine; if there were, memsw would keep it from hiding
                // memory (may be missing without swap accounting).
                let _ = fs::write(
                    cg.path.join("memory.memsw.limit_in_bytes"),
                    limit.to_string(),
                );
            }
        }
        Ok(cg)
    }

    pub fn write(&self, file: &str, value: &str) -> io::Result<()> {
        let p = self.path.join(file);
        fs::write(&p, value).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))
    }

    pub fn read(&self, file: &str) -> io::Result<String> {
        let p = self.path.join(file);
        fs::read_to_string(&p)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))
    }

    pub fn read_u64(&self, file: &str) -> io::Result<u64> {
        self.read(file)?
            .trim()
            .parse()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{file}: {e}")))
    }

    /// The limit in bytes.
    pub fn limit(&self) -> io::Result<u64> {
        self.read_u64(if self.v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        })
    }

    /// Bytes charged now.
    pub fn usage(&self) -> io::Result<u64> {
        self.read_u64(if self.v2 {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        })
    }

    /// Highest usage since the last [`Self::reset_peak`] (v2 without a resettable
    /// `memory.peak`: since creation).
    pub fn peak(&self) -> io::Result<u64> {
        self.read_u64(if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        })
    }

    pub fn reset_peak(&self) {
        let file = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        // v2: writing resets it for the writer's fd only (6.12+): harmless, v1: resets.
        let _ = fs::write(self.path.join(file), "0");
    }

    /// OOM kills in this cgroup (`memory.events` / `memory.oom_control`).
    pub fn oom_kills(&self) -> io::Result<u64> {
        let text = self.read(if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        })?;
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0))
    }

    /// The cgroup's memory events, for a failure message.
    pub fn events(&self) -> String {
        if self.v2 {
            self.read("memory.events").unwrap_or_default()
        } else {
            format!(
                "{}failcnt {}",
                self.read("memory.oom_control").unwrap_or_default(),
                self.read("memory.failcnt").unwrap_or_default().trim()
            )
        }
    }

    /// Moves the calling process into this cgroup: what it allocates from now on (its
    /// pages, the kernel objects it creates) is charged here.
    pub fn enter(&self) -> io::Result<()> {
        self.write("cgroup.procs", &std::process::id().to_string())
    }

    /// Moves the calling process back to the cgroup this one was made in (before drop:
    /// a cgroup with a process in it cannot be removed).
    pub fn leave(&self) -> io::Result<()> {
        let parent = self
            .path
            .parent()
            .ok_or_else(|| invalid("no parent".into()))?;
        let procs = parent.join("cgroup.procs");
        fs::write(&procs, std::process::id().to_string())
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", procs.display())))
    }

    /// `cmd`'s process is moved into this cgroup between fork and exec, so that
    /// everything it allocates, from its first page, is charged here.
    pub fn enter_before_exec(&self, cmd: &mut Command) -> io::Result<()> {
        let procs = fs::OpenOptions::new()
            .write(true)
            .open(self.path.join("cgroup.procs"))?;
        // SAFETY: between fork and exec only write(2) on an fd opened before the fork
        // ("0" = the calling process), which is async-signal-safe. The fd is moved into
        // the closure, so it stays open until the command is dropped.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir(&self.path) {
            eprintln!("removing {}: {e}", self.path.display());
        }
    }
}
