//! Wakes the manifests thread when the directory changes (inotify), so a file written is
//! read at once instead of at the next poll; the poll stays, as the fallback and for
//! what inotify does not report (a symlink made in place, a file system without it).
//!
//! Only completed changes wake it: a file closed after writing (`IN_CLOSE_WRITE`), one
//! renamed in or out (`IN_MOVED_TO`/`IN_MOVED_FROM`: an atomic replace, or a ConfigMap
//! volume's `..data` swap) and one deleted. A file being created or written
//! (`IN_CREATE`, `IN_MODIFY`) does not: reading it half-written would count a bad file.

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    os::unix::ffi::OsStrExt,
    path::Path,
    time::Duration,
};

use tracing::warn;

/// What wakes the thread.
const EVENTS: u32 = libc::IN_CLOSE_WRITE
    | libc::IN_MOVED_TO
    | libc::IN_MOVED_FROM
    | libc::IN_DELETE
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF;

/// The watch of one directory; without one (inotify unavailable, the directory missing),
/// [`DirWatch::wait`] sleeps the whole timeout, as the poll did, and tries again after.
#[derive(Debug)]
pub(super) struct DirWatch {
    fd: Option<OwnedFd>,
    /// The watch is in place (dropped when the directory goes: made again later).
    watching: bool,
    /// The failure last logged (each new one once).
    last_error: Option<String>,
}

impl DirWatch {
    pub(super) fn new(dir: &Path) -> Self {
        let mut w = Self {
            fd: None,
            watching: false,
            last_error: None,
        };
        w.ensure(dir);
        w
    }

    /// Whether a change is watched for now (tests).
    #[cfg(test)]
    pub(super) fn is_watching(&self) -> bool {
        self.watching
    }

    /// Makes the inotify instance and the directory's watch if they are not there.
    fn ensure(&mut self, dir: &Path) {
        if self.watching {
            return;
        }
        if let Err(e) = self.add(dir) {
            let e = e.to_string();
            if self.last_error.as_ref() != Some(&e) {
                warn!(dir = %dir.display(), error = %e,
                    "manifests directory: no inotify watch, changes are seen at the next poll");
                self.last_error = Some(e);
            }
        }
    }

    fn add(&mut self, dir: &Path) -> io::Result<()> {
        if self.fd.is_none() {
            // SAFETY: no pointer arguments; the result is checked.
            let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: a new descriptor, owned from here on.
            self.fd = Some(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let fd = self.fd.as_ref().map_or(-1, AsRawFd::as_raw_fd);
        let path = CString::new(dir.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: `path` is a NUL-terminated string that outlives the call.
        if unsafe { libc::inotify_add_watch(fd, path.as_ptr(), EVENTS | libc::IN_ONLYDIR) } < 0 {
            return Err(io::Error::last_os_error());
        }
        self.watching = true;
        self.last_error = None;
        Ok(())
    }

    /// Waits until the directory changes or `timeout` passes; returns whether a change
    /// woke it. Every event queued is read (one scan covers them all).
    pub(super) fn wait(&mut self, dir: &Path, timeout: Duration) -> bool {
        self.ensure(dir);
        let Some(fd) = self.fd.as_ref().filter(|_| self.watching) else {
            std::thread::sleep(timeout);
            return false;
        };
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd for the duration of the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ready <= 0 {
            return false;
        }
        let fd = fd.as_raw_fd();
        self.drain(fd)
    }

    /// Reads the queued events; the watch is gone when the directory was removed or
    /// moved (`IN_IGNORED`): made again at the next wait.
    fn drain(&mut self, fd: i32) -> bool {
        let mut buf = [0u8; 4096];
        let mut any = false;
        loop {
            // SAFETY: `buf` is writable for its whole length.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            let Ok(n) = usize::try_from(n) else {
                return any; // EAGAIN: all read
            };
            if n == 0 {
                return any;
            }
            let mut at = 0;
            while at + std::mem::size_of::<libc::inotify_event>() <= n {
                // SAFETY: the kernel writes whole events; read unaligned from the buffer.
                let ev: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
                if ev.mask & libc::IN_IGNORED != 0 {
                    self.watching = false;
                }
                any = true;
                at += std::mem::size_of::<libc::inotify_event>() + ev.len as usize;
            }
        }
    }
}
