//! Same layout, another build: this build's programs loaded against the pinned maps and
//! every pinned hook swapped to them (`BPF_LINK_UPDATE`, a clsact replace in place).

use std::{fs, io, os::fd::AsFd};

use aya::{
    programs::{
        tc::{SchedClassifierLink, TcError},
        CgroupSockAddr, SchedClassifier, TcAttachType, Xdp,
    },
    EbpfLoader,
};
use proxy_common::meta;
use tracing::info;

use super::rules::{crash_point, io_err, swap_pause};
use crate::{
    loader::{object_hash, LoadError, CLSACT_HANDLE, CLSACT_PRIORITY, EBPF_OBJECT},
    pins::{LinkPin, PinDir},
};

/// Same layout, another build: load this build's programs against the pinned maps and
/// swap every pinned hook to them.
pub(super) fn replace_programs(pins: &PinDir, pinned_hash: u32) -> Result<(), LoadError> {
    let hooks = pinned_hooks(pins)?;
    if hooks.is_empty() {
        return Ok(());
    }
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(pins.path())
        .load(EBPF_OBJECT)?;
    let log_id = swap_hooks(&mut ebpf, pins, &hooks, false, &mut || Ok(()))?;
    pins.write_meta(meta::OBJECT_HASH, object_hash())?;
    if let Some(id) = log_id {
        pins.write_meta(meta::LOG_PROGRAM_ID, id)?;
    }
    info!(
        hooks = hooks.len(),
        from_object = format!("{pinned_hash:08x}"),
        to_object = format!("{:08x}", object_hash()),
        "replaced the running programs with this build's (same map layout, no gap)"
    );
    Ok(())
}

/// One pinned hook under `links/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct PinnedHook {
    /// Its pin name.
    pin: String,
    /// The program it runs.
    program: &'static str,
    /// `Some((iface, ingress))` for a clsact record (a pinned program, not a link).
    clsact: Option<(String, bool)>,
}

/// Parses a pin name under `links/` ([`LinkPin::parse`]); `None` for a name this
/// project does not make.
#[cfg(test)]
pub(super) fn parse_hook(pin: &str) -> Option<PinnedHook> {
    LinkPin::parse(pin).map(|p| hook_of(pin.to_string(), p))
}

fn hook_of(pin: String, p: LinkPin) -> PinnedHook {
    PinnedHook {
        program: p.program(),
        clsact: match p {
            LinkPin::Tc {
                iface,
                ingress,
                clsact: true,
            } => Some((iface, ingress)),
            _ => None,
        },
        pin,
    }
}

/// The order hooks are swapped in: TC first (a flow's two directions change programs as
/// close together as possible); then the socket hooks' reverse programs (`recvmsg`,
/// `getpeername`) before the forward ones (`connect`, `sendmsg`): a new reverse program
/// finds both what the new forward programs write and, through the kept map of an older
/// layout (`rules::kept_maps`), what the old ones still write until their own swap, so no
/// reply in between shows its backend's address.
pub(super) fn swap_order(hooks: &mut [PinnedHook]) {
    let reverse = |pin: &str| pin.contains("recvmsg") || pin.contains("getpeer");
    hooks.sort_by_key(|h| (!h.pin.starts_with("tc-"), !reverse(&h.pin), h.pin.clone()));
}

/// The hooks pinned under `<pin>/links`, in swap order ([`swap_order`]).
pub(super) fn pinned_hooks(pins: &PinDir) -> Result<Vec<PinnedHook>, LoadError> {
    let mut hooks: Vec<PinnedHook> = pins
        .link_pins()
        .map_err(io_err("listing", &pins.links()))?
        .into_iter()
        .map(|(name, p)| hook_of(name, p))
        .collect();
    swap_order(&mut hooks);
    Ok(hooks)
}

/// Loads the programs the hooks need from `ebpf` and swaps each hook to its program
/// (`crash`: a migration's swap, with the `swap-first` crash point and the
/// `SWAP_PAUSE_ENV` pauses between hooks). Returns a loaded socket program's id
/// (for `META[LOG_PROGRAM_ID]`).
pub(super) fn swap_hooks(
    ebpf: &mut aya::Ebpf,
    pins: &PinDir,
    hooks: &[PinnedHook],
    crash: bool,
    before_swap: &mut dyn FnMut() -> Result<(), LoadError>,
) -> Result<Option<u32>, LoadError> {
    let mut log_id = None;
    // Load (verify) every program first: the swaps below then follow each other within
    // microseconds, and `before_swap` runs right before the first.
    for hook in hooks {
        let name = hook.program;
        let prog_err = |source| LoadError::Program { name, source };
        let program = ebpf.program_mut(name).ok_or(LoadError::Program {
            name,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?;
        if name.starts_with("tc_") {
            let prog: &mut SchedClassifier = program.try_into().map_err(prog_err)?;
            if prog.fd().is_err() {
                prog.load().map_err(prog_err)?;
            }
        } else if name.starts_with("xdp_") {
            let prog: &mut Xdp = program.try_into().map_err(prog_err)?;
            if prog.fd().is_err() {
                prog.load().map_err(prog_err)?;
            }
        } else {
            let prog: &mut CgroupSockAddr = program.try_into().map_err(prog_err)?;
            if prog.fd().is_err() {
                prog.load().map_err(prog_err)?;
            }
        }
    }
    before_swap()?;
    for (i, hook) in hooks.iter().enumerate() {
        let name = hook.program;
        let prog_err = |source| LoadError::Program { name, source };
        let program = ebpf.program_mut(name).ok_or(LoadError::Program {
            name,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?;
        let path = pins.link_path(&hook.pin);
        if let Some((iface, ingress)) = &hook.clsact {
            let prog: &mut SchedClassifier = program.try_into().map_err(prog_err)?;
            if prog.fd().is_err() {
                prog.load().map_err(prog_err)?;
            }
            replace_clsact(prog, iface, *ingress)?;
            // The record is the pinned program: re-pin the new one. A crash in between
            // leaves the filter without a record, which install re-creates by replacing
            // the filter in place (EEXIST path).
            match fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(io_err("unpinning", &path)(e))
                }
                _ => {}
            }
            prog.pin(&path).map_err(|source| LoadError::Pin {
                path: path.clone(),
                source,
            })?;
        } else {
            let fd = if hook.program.starts_with("tc_") {
                let prog: &mut SchedClassifier = program.try_into().map_err(prog_err)?;
                if prog.fd().is_err() {
                    prog.load().map_err(prog_err)?;
                }
                prog.fd().map_err(prog_err)?.as_fd().try_clone_to_owned()
            } else if hook.program.starts_with("xdp_") {
                let prog: &mut Xdp = program.try_into().map_err(prog_err)?;
                if prog.fd().is_err() {
                    prog.load().map_err(prog_err)?;
                }
                prog.fd().map_err(prog_err)?.as_fd().try_clone_to_owned()
            } else {
                let prog: &mut CgroupSockAddr = program.try_into().map_err(prog_err)?;
                if prog.fd().is_err() {
                    prog.load().map_err(prog_err)?;
                }
                if let Ok(info) = prog.info() {
                    log_id.get_or_insert(info.id());
                }
                prog.fd().map_err(prog_err)?.as_fd().try_clone_to_owned()
            }
            .map_err(io_err("duplicating a program fd for", &path))?;
            let link = pins
                .open_link(&hook.pin)
                .map_err(io_err("opening the pinned link", &path))?;
            bpf_sys::link_update(link.as_fd(), fd.as_fd())
                .map_err(io_err("BPF_LINK_UPDATE of", &path))?;
        }
        if i == 0 && crash {
            crash_point("swap-first")?;
        }
        if let Some(pause) = swap_pause().filter(|_| crash && i + 1 < hooks.len()) {
            info!(
                swapped = hook.pin.as_str(),
                pause_ms = pause.as_millis() as u64,
                "test hook: pausing the swap (old and new programs side by side)"
            );
            std::thread::sleep(pause);
        }
    }
    Ok(log_id)
}

/// Replaces the program of our clsact filter on `iface` in place (same priority and
/// handle: `RTM_NEWTFILTER` without `NLM_F_EXCL`, no gap).
pub(super) fn replace_clsact(
    prog: &mut SchedClassifier,
    iface: &str,
    ingress: bool,
) -> Result<(), LoadError> {
    let what = || format!("replacing the clsact filter on {iface}");
    let kind = if ingress {
        TcAttachType::Ingress
    } else {
        TcAttachType::Egress
    };
    let old = SchedClassifierLink::attached(iface, kind, CLSACT_PRIORITY, CLSACT_HANDLE, None)
        .map_err(|e| LoadError::Attach {
            what: what(),
            source: TcError::IoError(e).into(),
        })?;
    let id = prog
        .attach_to_link(old)
        .map_err(|source| LoadError::Attach {
            what: what(),
            source,
        })?;
    let link = prog.take_link(id).map_err(|source| LoadError::Attach {
        what: what(),
        source,
    })?;
    // Dropping aya's netlink link object would delete the filter (see the loader).
    std::mem::forget(link);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_pins_parse_to_their_programs() {
        let h = parse_hook("sock4_connect").expect("sock");
        assert_eq!((h.program, h.clsact), ("sock4_connect", None));
        let h = parse_hook("tc-eth0-ingress").expect("tcx");
        assert_eq!((h.program, h.clsact), ("tc_ingress", None));
        let h = parse_hook("tc-br-egress-egress-clsact").expect("clsact");
        assert_eq!(
            (h.program, h.clsact),
            ("tc_egress", Some(("br-egress".to_string(), false)))
        );
        assert_eq!(parse_hook("tc-eth0-sideways"), None);
        let h = parse_hook("xdp-eth0").expect("xdp");
        assert_eq!((h.program, h.clsact), ("xdp_ingress", None));
        assert_eq!(parse_hook("xdp-"), None);
        assert_eq!(parse_hook("SVC4"), None);
    }

    #[test]
    fn tc_then_reverse_socket_hooks_then_forward_ones() {
        let mut hooks: Vec<PinnedHook> = crate::loader::SOCK_PROGRAMS
            .iter()
            .chain(&["tc-eth0-egress", "xdp-eth0", "tc-eth0-ingress"])
            .map(|p| parse_hook(p).expect("hook"))
            .collect();
        swap_order(&mut hooks);
        let order: Vec<&str> = hooks.iter().map(|h| h.pin.as_str()).collect();
        assert_eq!(
            order,
            [
                "tc-eth0-egress",
                "tc-eth0-ingress",
                "sock4_getpeer",
                "sock4_recvmsg",
                "sock6_getpeer",
                "sock6_recvmsg",
                "sock4_connect",
                "sock4_sendmsg",
                "sock6_connect",
                "sock6_sendmsg",
                "xdp-eth0",
            ]
        );
    }
}
