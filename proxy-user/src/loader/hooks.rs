//! The hooks' pins under `links/`: which pin a hook has, clsact filters attached and
//! deleted by the reserved priority/handle, and [`uninstall`].

use std::{fs, io};

use aya::programs::{
    links::PinnedLink,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
    Link as _, ProgramError, SchedClassifier, TcAttachType,
};
use proxy_common::map_names;
use tracing::{debug, info};

use super::error::{io_err, LoadError};

use crate::pins::{LinkPin, PinDir};
pub use crate::pins::{MIGRATE_STAGING_DIR, SOCK_PROGRAMS, XDP_PIN_PREFIX};

/// What [`uninstall`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UninstallReport {
    pub links: Vec<String>,
    pub maps: Vec<String>,
}

/// Priority (`tc` "pref") of the clsact filters this project attaches: 19280, `0x4b50`
/// (ASCII "KP"). Reserved for ebpf-proxy: a filter at this priority and [`CLSACT_HANDLE`]
/// on `clsact` ingress/egress is taken to be ours (replaced by a re-attach, deleted by
/// uninstall); filters at any other priority or handle are never touched. It runs before
/// filters added without a priority (the kernel starts those at 49152).
pub const CLSACT_PRIORITY: u16 = 0x4b50;

/// Handle of the clsact filters this project attaches (`tc` shows `handle 0x4b50`).
pub const CLSACT_HANDLE: TcHandle = TcHandle::new(0, 0x4b50);

/// One attachment of a program, and the name of its pinned link under `links/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Hook {
    Sock(&'static str),
    Tc { iface: String, ingress: bool },
    Xdp { iface: String },
}

impl Hook {
    pub(super) fn program(&self) -> &'static str {
        self.link_pin(false).program()
    }

    /// Its pin under `links/` (TC hooks: the TCX link's, or with `clsact` the clsact
    /// record's).
    pub(super) fn link_pin(&self, clsact: bool) -> LinkPin {
        match self {
            Hook::Sock(name) => LinkPin::Sock(name),
            Hook::Tc { iface, ingress } => LinkPin::Tc {
                iface: iface.clone(),
                ingress: *ingress,
                clsact,
            },
            Hook::Xdp { iface } => LinkPin::Xdp {
                iface: iface.clone(),
            },
        }
    }

    /// The name of its pin under `links/` (TC hooks: the TCX link's).
    pub(super) fn pin_name(&self) -> String {
        self.link_pin(false).name()
    }

    /// The pin that exists for this hook under `links/`, if any.
    pub(super) fn existing_pin(&self, pins: &PinDir) -> Option<String> {
        let name = self.pin_name();
        if pins.link_path(&name).exists() {
            return Some(name);
        }
        let clsact = self.link_pin(true).name();
        (matches!(self, Hook::Tc { .. }) && pins.link_path(&clsact).exists()).then_some(clsact)
    }
}

/// Ingress or egress, as aya names it.
pub(super) fn tc_kind(ingress: bool) -> TcAttachType {
    if ingress {
        TcAttachType::Ingress
    } else {
        TcAttachType::Egress
    }
}

/// `tc-<iface>-<dir>-clsact` -> (iface, ingress).
pub(super) fn parse_clsact_pin(name: &str) -> Option<(String, bool)> {
    match LinkPin::parse(name)? {
        LinkPin::Tc {
            iface,
            ingress,
            clsact: true,
        } => Some((iface, ingress)),
        _ => None,
    }
}

pub(super) fn netlink_errno(e: &ProgramError) -> Option<i32> {
    match e {
        ProgramError::TcError(TcError::NetlinkError(e)) | ProgramError::NetlinkError(e) => {
            e.raw_os_error()
        }
        ProgramError::TcError(TcError::IoError(e)) => e.raw_os_error(),
        _ => None,
    }
}

/// Attaches the loaded `prog` as our clsact filter on `iface` (adding the qdisc if
/// missing) and leaves it attached after this process exits.
pub(super) fn attach_clsact(
    prog: &mut SchedClassifier,
    name: &'static str,
    iface: &str,
    ingress: bool,
) -> Result<(), LoadError> {
    let what = || format!("{name} to interface {iface} (clsact)");
    match tc::qdisc_add_clsact(iface) {
        Ok(()) => {}
        Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(e) => {
            return Err(LoadError::Attach {
                what: what(),
                source: e.into(),
            })
        }
    }
    let kind = tc_kind(ingress);
    let options = || {
        TcAttachOptions::Netlink(NlOptions {
            priority: CLSACT_PRIORITY,
            handle: CLSACT_HANDLE,
            classid: None,
        })
    };
    let link_id = match prog.attach_with_options(iface, kind, options()) {
        Ok(id) => id,
        Err(e) if netlink_errno(&e) == Some(libc::EEXIST) => {
            // Our priority/handle is taken: a filter of ours whose record was lost (the
            // pin directory removed by hand, say). Replace its program in place: no gap.
            debug!(iface, ?kind, "replacing our earlier clsact filter");
            let old =
                SchedClassifierLink::attached(iface, kind, CLSACT_PRIORITY, CLSACT_HANDLE, None)
                    .map_err(|e| LoadError::Attach {
                        what: what(),
                        source: TcError::IoError(e).into(),
                    })?;
            prog.attach_to_link(old)
                .map_err(|source| LoadError::Attach {
                    what: what(),
                    source,
                })?
        }
        Err(source) => {
            return Err(LoadError::Attach {
                what: what(),
                source,
            })
        }
    };
    let link = prog
        .take_link(link_id)
        .map_err(|source| LoadError::Program { name, source })?;
    // A netlink filter lives in the qdisc, not in a file descriptor; dropping aya's link
    // object would delete it. Forgetting it leaves the filter attached (the object holds
    // no fd or memory of its own: nothing leaks).
    std::mem::forget(link);
    Ok(())
}

/// Deletes our clsact filter (reserved priority/handle) from `iface`. An interface or
/// filter that is gone is fine (Ok(false)).
pub(super) fn detach_clsact(iface: &str, ingress: bool) -> Result<bool, LoadError> {
    let kind = tc_kind(ingress);
    let link =
        match SchedClassifierLink::attached(iface, kind, CLSACT_PRIORITY, CLSACT_HANDLE, None) {
            Ok(link) => link,
            // No such interface (here): its qdisc and filters went with it.
            Err(e)
                if e.raw_os_error() == Some(libc::ENODEV)
                    || e.kind() == io::ErrorKind::NotFound =>
            {
                return Ok(false)
            }
            Err(e) => {
                return Err(LoadError::Attach {
                    what: format!("finding interface {iface}"),
                    source: TcError::IoError(e).into(),
                })
            }
        };
    match link.detach() {
        Ok(()) => Ok(true),
        // No filter (ENOENT) or no clsact qdisc any more (EINVAL: no such chain).
        Err(e)
            if matches!(
                netlink_errno(&e),
                Some(libc::ENOENT | libc::EINVAL | libc::ENODEV)
            ) =>
        {
            debug!(iface, ?kind, "nothing to detach: {e}");
            Ok(false)
        }
        Err(source) => Err(LoadError::Attach {
            what: format!("detaching the clsact filter from {iface} ({kind:?})"),
            source,
        }),
    }
}

/// Detaches every hook and removes every pin this project made under `pin_path`.
/// Files it does not know are left alone (and reported as an error). Clsact filters are
/// deleted from the interfaces of this thread's network namespace (see the module doc).
pub fn uninstall(pins: &PinDir) -> Result<UninstallReport, LoadError> {
    let pin_path = pins.path();
    let mut report = UninstallReport::default();
    if !pin_path.exists() {
        return Ok(report);
    }
    let links = pins.links();
    let mut names: Vec<String> = SOCK_PROGRAMS.iter().map(|n| n.to_string()).collect();
    if let Ok(entries) = fs::read_dir(&links) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with("tc-") || n.starts_with(XDP_PIN_PREFIX) {
                names.push(n);
            }
        }
    }
    for name in names {
        if !links.join(&name).exists() {
            continue;
        }
        remove_pin(pins, &name)?;
        report.links.push(name);
    }
    // A migration interrupted by a crash leaves its staging directory (migrate/).
    match fs::remove_dir_all(pins.staging().path()) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err("removing the staging directory in", pin_path)(e));
        }
        _ => {}
    }
    if links.exists() {
        fs::remove_dir(&links).map_err(io_err("removing (unknown files left?)", &links))?;
    }
    for name in map_names::ALL {
        let path = pins.map_path(name);
        if path.exists() {
            fs::remove_file(&path).map_err(io_err("unpinning", &path))?;
            report.maps.push(name.to_string());
        }
    }
    fs::remove_dir(pin_path).map_err(io_err("removing (unknown files left?)", pin_path))?;
    info!(pin_path = %pin_path.display(), links = report.links.len(), maps = report.maps.len(), "datapath removed");
    Ok(report)
}

/// Detaches the hook pinned as `links/<name>` and removes the pin. A clsact record
/// (`tc-<iface>-<dir>-clsact`) is a pinned program: its filter is deleted by the reserved
/// priority/handle (in this thread's network namespace), then the pin removed (the pin may
/// already be missing). Any other pin is a BPF link: unpinning it detaches the hook.
pub(super) fn remove_pin(pins: &PinDir, name: &str) -> Result<(), LoadError> {
    let path = pins.link_path(name);
    if let Some((iface, ingress)) = parse_clsact_pin(name) {
        let iface = iface.as_str();
        if !detach_clsact(iface, ingress)? {
            debug!(iface, ingress, "no clsact filter of ours to detach");
        }
        return match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("unpinning", &path)(e)),
            _ => Ok(()),
        };
    }
    let link = PinnedLink::from_pin(&path).map_err(|source| LoadError::Link {
        path: path.clone(),
        source,
    })?;
    // Unpinning drops the last reference once the returned fd closes: detached.
    drop(link.unpin().map_err(io_err("unpinning", &path))?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clsact_pin_names_parse_back() {
        for (iface, ingress) in [("eth0", true), ("eth0", false), ("br-ex-egress", true)] {
            let hook = Hook::Tc {
                iface: iface.into(),
                ingress,
            };
            let pin = hook.link_pin(true).name();
            assert!(!pin.contains('.'), "bpffs refuses dots: {pin}");
            assert_eq!(parse_clsact_pin(&pin), Some((iface.to_string(), ingress)));
            // A TCX link's pin is never taken for a clsact record.
            assert_eq!(parse_clsact_pin(&hook.pin_name()), None);
        }
        assert_eq!(parse_clsact_pin("sock4_connect"), None);
        assert_eq!(parse_clsact_pin("tc-eth0-sideways-clsact"), None);
    }
}
