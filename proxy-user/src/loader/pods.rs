//! TC on pod interfaces (`--pod-interfaces`): the same two programs as on the node's
//! interfaces (`tc_ingress`, `tc_egress`: the shared stage machine), attached to the host
//! side of a pod's veth as it appears and detached when it goes. Loaded once per agent
//! (sharing the pinned maps) and kept, so attaching one more interface costs two
//! attachments and two pins, no verification.
//!
//! On the host side of a pod's veth, ingress is what the pod sends (pod -> ClusterIP /
//! external / LoadBalancer IP / NodePort: a new flow is DNATed, its packets follow their
//! conntrack entry) and egress what it receives (replies reverse-translated to the
//! frontend). The pins are the node hooks' (`links/tc-<iface>-<dir>`, or the clsact
//! record), so `proxy-agent uninstall` removes them like the others.

use std::path::PathBuf;

use aya::programs::{links::FdLink, tc::TcAttachOptions, LinkOrder, SchedClassifier};
use proxy_common::prog_names;
use tracing::debug;

use super::{
    hooks::{attach_clsact, remove_pin, tc_kind, Hook},
    LoadError, TcAttachMode,
};
use crate::pins::PinDir;

/// The two TC programs, loaded against the pinned maps, ready to attach to pod interfaces.
pub struct PodTc {
    ebpf: aya::Ebpf,
    pins: PinDir,
    mode: TcAttachMode,
    /// The ids of the maps sized to demand (the first of each kind: `CT4`, `SVC4`,
    /// `BACKEND4`, ...) these programs were loaded against: an online
    /// resize replaces them (and swaps the pinned hooks), so programs for a later
    /// interface are loaded again against the new ones.
    ct_id: [Option<u32>; 9],
}

impl PodTc {
    /// Loads `tc_ingress` and `tc_egress` against the maps pinned in `pins` (which
    /// [`super::install`] made): their sizes are the pinned ones.
    pub fn load(pins: &PinDir, mode: TcAttachMode) -> Result<Self, LoadError> {
        let pins = pins.clone();
        let sizes = super::Sizes::pinned_or(&pins, super::Sizes::compiled());
        super::object::bump_memlock_rlimit();
        let mut ebpf = super::load_object_sizes(&pins, &sizes)?;
        for name in [prog_names::TC_INGRESS, prog_names::TC_EGRESS] {
            let prog = program(&mut ebpf, name)?;
            prog.load()
                .map_err(|source| LoadError::Program { name, source })?;
        }
        let mode = mode.resolve();
        if mode == TcAttachMode::Tcx && !super::tcx_supported() {
            return Err(LoadError::TcxUnsupported);
        }
        let ct_id = ct_map_id(&pins);
        Ok(Self {
            ebpf,
            pins,
            mode,
            ct_id,
        })
    }

    /// Whether both of `iface`'s hooks are pinned (attached by this or an earlier agent).
    pub fn attached(&self, iface: &str) -> bool {
        [true, false].into_iter().all(|ingress| {
            Hook::Tc {
                iface: iface.into(),
                ingress,
            }
            .existing_pin(&self.pins)
            .is_some()
        })
    }

    /// Attaches both programs to `iface` (in this process's network namespace) and pins
    /// the attachments; a hook already pinned is kept. Ingress last: a flow is started
    /// only once its replies can be translated. On error nothing of this call stays.
    pub fn attach(&mut self, iface: &str) -> Result<(), LoadError> {
        if ct_map_id(&self.pins) != self.ct_id {
            // The conntrack tables (or service-side maps) were resized since: the hooks pinned
            // meanwhile run the resize's programs; an interface attached now gets
            // programs of the new maps.
            *self = Self::load(&self.pins, self.mode)?;
        }
        let mut made = Vec::new();
        for ingress in [false, true] {
            let hook = Hook::Tc {
                iface: iface.into(),
                ingress,
            };
            if hook.existing_pin(&self.pins).is_some() {
                continue;
            }
            match self.attach_one(&hook, iface, ingress) {
                Ok(pin) => made.push(pin),
                Err(e) => {
                    for pin in &made {
                        let _ = remove_pin(&self.pins, pin);
                    }
                    return Err(e);
                }
            }
        }
        debug!(iface, "pod interface attached");
        Ok(())
    }

    fn attach_one(&mut self, hook: &Hook, iface: &str, ingress: bool) -> Result<String, LoadError> {
        let name = hook.program();
        let prog = program(&mut self.ebpf, name)?;
        let pin_err = |path: PathBuf| move |source| LoadError::Pin { path, source };
        if self.mode == TcAttachMode::Clsact {
            attach_clsact(prog, name, iface, ingress)?;
            let pin = hook.link_pin(true).name();
            let path = self.pins.link_path(&pin);
            if let Err(e) = prog.pin(&path).map_err(pin_err(path)) {
                let _ = super::hooks::detach_clsact(iface, ingress);
                return Err(e);
            }
            return Ok(pin);
        }
        let tcx = TcAttachOptions::TcxOrder(LinkOrder::default());
        let link_id = prog
            .attach_with_options(iface, tc_kind(ingress), tcx)
            .map_err(|source| LoadError::Attach {
                what: format!("{name} to pod interface {iface}"),
                source,
            })?;
        let link = prog
            .take_link(link_id)
            .map_err(|source| LoadError::Program { name, source })?;
        let fd_link: FdLink = link.try_into().map_err(|source| LoadError::Link {
            path: PathBuf::from(iface),
            source,
        })?;
        let pin = hook.pin_name();
        let path = self.pins.link_path(&pin);
        fd_link.pin(&path).map_err(pin_err(path))?;
        Ok(pin)
    }

    /// Detaches and unpins `iface`'s hooks (an interface that is gone took its
    /// attachments with it: only the pins are left to remove). Returns how many pins were
    /// removed.
    pub fn detach(&self, iface: &str) -> Result<usize, LoadError> {
        let mut removed = 0;
        for ingress in [true, false] {
            let hook = Hook::Tc {
                iface: iface.into(),
                ingress,
            };
            if let Some(pin) = hook.existing_pin(&self.pins) {
                remove_pin(&self.pins, &pin)?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// The interfaces with a TC pin under `links/` (node and pod ones).
    pub fn pinned_interfaces(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.pins.links()) else {
            return Vec::new();
        };
        let mut out: Vec<String> = entries
            .flatten()
            .filter_map(
                |e| match crate::pins::LinkPin::parse(&e.file_name().to_string_lossy())? {
                    crate::pins::LinkPin::Tc { iface, .. } => Some(iface),
                    _ => None,
                },
            )
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

fn program<'a>(
    ebpf: &'a mut aya::Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, LoadError> {
    let program = ebpf.program_mut(name).ok_or(LoadError::Program {
        name,
        source: aya::programs::ProgramError::UnexpectedProgramType,
    })?;
    program
        .try_into()
        .map_err(|source| LoadError::Program { name, source })
}

/// The ids of the pinned `CT4` and `SVC4` (`None`: not pinned): both are replaced by
/// an online resize.
fn ct_map_id(pins: &PinDir) -> [Option<u32>; 9] {
    super::SizedMap::ALL.map(|kind| pins.map_info(kind.maps()[0]).ok().map(|i| i.id))
}
