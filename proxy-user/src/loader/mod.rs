//! Loading, attaching, pinning, adopting and removing the datapath.
//!
//! Layout under the pin directory (default `/sys/fs/bpf/ebpf-proxy`):
//! - one file per map (`SVC4`, `BACKEND4`, ... see `proxy_common::map_names`);
//! - `links/<program>`: one pinned link per cgroup hook, which keeps the hook attached
//!   while no agent runs;
//! - `links/tc-<iface>-ingress`, `links/tc-<iface>-egress`: the pinned TCX link of each TC
//!   hook (attach mode `tcx`, the default on kernels >= 6.6);
//! - `links/tc-<iface>-ingress-clsact`, `links/tc-<iface>-egress-clsact`: in attach mode
//!   `clsact` (kernels < 6.6, or forced), the TC program is a netlink filter in the
//!   interface's clsact qdisc, which is no BPF link and cannot be pinned: the loaded
//!   *program* is pinned there instead, as the record that the filter exists. The filter
//!   always has the priority [`CLSACT_PRIORITY`] and handle [`CLSACT_HANDLE`], reserved for
//!   this project, so that re-attaching replaces our own filter in place and detaching
//!   never touches anyone else's. See [`TcAttachMode`].
//!
//! - `links/xdp-<iface>`: the pinned XDP link of an interface under `--acceleration
//!   native|generic` (a BPF link: kernel >= 5.9), next to its TC hooks.
//!
//! A second [`install`] adopts: hooks whose link (or clsact record) is pinned are left
//! exactly as they are (no reload, no gap in service); only missing ones are loaded and
//! attached, sharing the pinned maps. [`uninstall`] detaches and unpins everything; a
//! clsact filter is found by interface name, so uninstall runs in the network namespace of
//! those interfaces (an interface that is gone is skipped: its filters went with it).

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::programs::{
    links::FdLink, tc::TcAttachOptions, CgroupAttachMode, CgroupSockAddr, LinkOrder,
    SchedClassifier, Xdp,
};
use proxy_common::{map_names, meta};
use tracing::{debug, info, warn};

use crate::{
    cgroup,
    pins::{Access, PinDir},
};

pub use crate::pins::DEFAULT_PIN_PATH;

mod error;
mod hooks;
mod memory;
mod modes;
mod object;
mod pods;
mod sized;

use error::io_err;
pub use error::LoadError;

pub(crate) use hooks::XDP_PIN_PREFIX;
use hooks::{attach_clsact, remove_pin, tc_kind, Hook};
pub use hooks::{
    uninstall, UninstallReport, CLSACT_HANDLE, CLSACT_PRIORITY, MIGRATE_STAGING_DIR, SOCK_PROGRAMS,
};
pub use memory::{
    conntrack_entries, map_memory, service_entries, service_start_entries, MapMemory,
    DEFAULT_CONNTRACK_FLOWS, DEFAULT_SERVICE_ENTRIES, SERVICE_START_ENTRIES,
};
use modes::tcx_supported;
pub use modes::{Acceleration, TcAttachMode};
pub(crate) use object::EBPF_OBJECT;
use object::{bump_memlock_rlimit, write_meta};
pub use object::{
    load_object, load_object_sized, load_object_sizes, load_object_with, object_hash,
    spawn_kernel_logger, CT_FALLBACK_GLOBAL, FIB_HOP_TTL_GLOBAL,
};
pub use pods::PodTc;
pub use sized::{grown, shrunk, start_sizes, SizedMap, Sizes};

/// Where to install.
#[derive(Clone, Debug)]
pub struct InstallOptions {
    /// bpffs directory for the pins.
    pub pin_path: PathBuf,
    /// cgroup v2 directory the socket hooks attach to; `None`: the root of the host's
    /// cgroup2 mount.
    pub cgroup: Option<PathBuf>,
    /// Interfaces (in the caller's network namespace) for the TC programs, ingress and
    /// egress.
    pub interfaces: Vec<String>,
    /// Size of each conntrack table (CT4, CT6) in flows; a flow takes two entries. Used
    /// when the tables are created: pinned tables keep the size they were made with.
    pub conntrack_flows: u32,
    /// `max_entries` of each service map (`SVC4`, `SVC6`: a frontend takes one entry
    /// plus one per backend slot). Used when the maps are created: pinned maps keep
    /// theirs.
    pub service_entries: u32,
    /// `max_entries` of the other maps sized to demand ([`SizedMap`]: backends, reverse
    /// NAT, affinity, Maglev, per-Service counters) when they are created, and what a
    /// pinned one is resized to at the start (`migrate::install`); its conntrack and
    /// service entries are not used (`conntrack_flows`, `service_entries` above). `None`:
    /// created at their compiled sizes, pinned ones kept.
    pub map_sizes: Option<Sizes>,
    /// How the TC programs are attached (hooks already pinned are adopted whatever the
    /// mode they were attached with).
    pub tc_attach: TcAttachMode,
    /// XDP ahead of TC on the same interfaces (`--acceleration`). Pinned XDP links are
    /// adopted when they were attached in this mode, re-attached when the mode changed,
    /// removed when it is `off`.
    pub acceleration: Acceleration,
}

/// What [`install`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstallReport {
    /// Hooks found pinned and left running (their link names under `links/`).
    pub adopted: Vec<String>,
    /// Hooks loaded and attached now.
    pub attached: Vec<String>,
    /// The cgroup the new hooks were attached to.
    pub cgroup: Option<PathBuf>,
    /// `max_entries` of each conntrack table: the pinned one's when adopted.
    pub conntrack_entries: u32,
    /// `max_entries` of each service map: the pinned one's when adopted.
    pub service_entries: u32,
    /// Pinned maps resized online before the install (`migrate::prepare_sized`).
    pub resized: Vec<MapResize>,
}

/// One pinned map resized online: its name and `max_entries` before and after.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapResize {
    pub map: &'static str,
    pub from: u32,
    pub to: u32,
}

/// The `max_entries` `map` (and its other-family twin) will have: the pinned one's when
/// it is pinned (with a warning when `wanted` differs: `migrate::prepare_sized` resizes
/// pinned maps before this, except a shrink below the entries in use), else `wanted`.
fn size_in_use(pins: &PinDir, map: &str, wanted: u32, what: &str, why: &str) -> u32 {
    let Some(pinned) = pins.max_entries(map) else {
        return wanted;
    };
    if pinned != wanted {
        warn!(
            map,
            pinned_entries = pinned,
            wanted_entries = wanted,
            "the pinned {what} keep their size ({why})"
        );
    }
    pinned
}

/// Loads and attaches whatever is not already pinned, and pins it: the pin directory
/// checked ([`open_pin_dir`]), the tables' sizes, the hooks wanted ([`wanted_hooks`]) and
/// those already pinned adopted, then the object loaded and each missing hook attached
/// and pinned ([`Attaching`]), every pin this call made removed again if one fails.
pub fn install(opts: &InstallOptions) -> Result<InstallReport, LoadError> {
    let pin_path = &opts.pin_path;
    let pins = open_pin_dir(pin_path)?;
    let mut report = InstallReport::default();
    let sizes = table_sizes(&pins, opts, &mut report)?;
    drop_other_xdp(&pins, opts.acceleration)?;
    let missing: Vec<Hook> = wanted_hooks(opts)
        .into_iter()
        .filter(|hook| match hook.existing_pin(&pins) {
            Some(name) => {
                report.adopted.push(name);
                false
            }
            None => true,
        })
        .collect();
    // Adopted socket hooks: the cgroup they are attached to, for the stale-socket
    // cleanup (`sockdestroy`), from the kernel's record of the link.
    report.cgroup = adopted_cgroup(&pins, &report.adopted, opts.cgroup.as_ref());
    if missing.is_empty() {
        pins.write_meta(meta::ACCELERATION, opts.acceleration.meta())?;
        info!(pin_path = %pin_path.display(), "adopted the pinned datapath");
        return Ok(report);
    }
    if EBPF_OBJECT.is_empty() {
        return Err(LoadError::NoObject);
    }
    let tc_mode = opts.tc_attach.resolve();
    if tc_mode == TcAttachMode::Tcx
        && missing.iter().any(|h| matches!(h, Hook::Tc { .. }))
        && !tcx_supported()
    {
        return Err(LoadError::TcxUnsupported);
    }
    bump_memlock_rlimit();
    let cgroup_dir = match &opts.cgroup {
        Some(dir) => dir.clone(),
        None => cgroup::cgroup2_mount()
            .map_err(io_err("finding cgroup2", Path::new("/proc/self/mountinfo")))?,
    };
    cgroup::check_cgroup2_dir(&cgroup_dir).map_err(io_err("checking", &cgroup_dir))?;

    let mut ebpf = load_object_sizes(&pins, &sizes)?;
    let mut att = Attaching {
        ebpf: &mut ebpf,
        pins: &pins,
        cgroup_dir: &cgroup_dir,
        tc_mode,
        acceleration: opts.acceleration,
        made: Vec::new(),
        log_program_id: None,
    };
    if let Err(e) = missing.iter().try_for_each(|hook| att.attach(hook)) {
        // Leave no half-installed hook set behind from this call.
        for pin in &att.made {
            if let Err(e) = remove_pin(&pins, pin) {
                warn!(pin, "rolling back: {e}");
            }
        }
        return Err(e);
    }
    let (made, log_program_id) = (att.made, att.log_program_id);
    if let Some(id) = log_program_id {
        let _ = write_meta(&mut ebpf, meta::LOG_PROGRAM_ID, id);
    }
    write_meta(&mut ebpf, meta::ACCELERATION, opts.acceleration.meta())?;
    if report.cgroup.is_none() || missing.iter().any(|h| matches!(h, Hook::Sock(_))) {
        report.cgroup = Some(cgroup_dir);
    }
    report.attached = made;
    info!(
        pin_path = %pin_path.display(),
        attached = report.attached.len(),
        adopted = report.adopted.len(),
        "datapath installed"
    );
    Ok(report)
}

/// Creates and pins the maps [`install`] would (at the same sizes, in the same checked
/// pin directory) without loading any program: a fresh node's agent writes its first
/// sync into them while [`install`] (which then finds them pinned and shares them)
/// loads, verifies and attaches the programs on another thread (`agent::start`).
/// Pinned maps are kept as they are. Returns whether the maps the service writer reads
/// back (`MapStore::dump`) were all made now, so hold nothing.
pub fn make_maps(opts: &InstallOptions) -> Result<bool, LoadError> {
    let pins = open_pin_dir(&opts.pin_path)?;
    if EBPF_OBJECT.is_empty() {
        return Err(LoadError::NoObject);
    }
    let empty = WRITER_MAPS.iter().all(|name| !pins.map_path(name).exists());
    bump_memlock_rlimit();
    let sizes = table_sizes(&pins, opts, &mut InstallReport::default())?;
    load_object_sizes(&pins, &sizes)?;
    Ok(empty)
}

/// The maps the service writer reads back when it adopts them (`MapStore::dump`).
const WRITER_MAPS: &[&str] = &[
    map_names::SVC4,
    map_names::SVC6,
    map_names::BACKEND4,
    map_names::BACKEND6,
    map_names::REVNAT4,
    map_names::REVNAT6,
    map_names::SRC_RANGE4,
    map_names::SRC_RANGE6,
    map_names::NODE_ADDRS4,
    map_names::NODE_ADDRS6,
    map_names::NODE_CONFIG,
    map_names::MAGLEV,
    map_names::META,
];

/// The sizes the maps sized to demand are created with (map entries), and those the
/// pinned conntrack tables and service maps have, in `report`.
fn table_sizes(
    pins: &PinDir,
    opts: &InstallOptions,
    report: &mut InstallReport,
) -> Result<Sizes, LoadError> {
    let ct_entries = conntrack_entries(opts.conntrack_flows)?;
    report.conntrack_entries = size_in_use(
        pins,
        map_names::CT4,
        ct_entries,
        "conntrack tables",
        "not resized at start: a shrink below the flows tracked would drop them",
    );
    let svc_entries = service_entries(opts.service_entries)?;
    report.service_entries = size_in_use(
        pins,
        map_names::SVC4,
        svc_entries,
        "service maps",
        "not resized at start: a shrink below the entries in use would drop them",
    );
    Ok(opts
        .map_sizes
        .unwrap_or_default()
        .with(SizedMap::Conntrack, ct_entries)
        .with(SizedMap::Service, svc_entries))
}

/// The pin directory at `path` (where `--pin-path` becomes a [`PinDir`]), checked to be on
/// a bpffs, with its `links/` directory; pins of another ABI are refused (the new
/// programs would misread them).
fn open_pin_dir(path: &Path) -> Result<PinDir, LoadError> {
    let parent = path.parent().unwrap_or(Path::new("/"));
    let on_bpffs = crate::fs::magic(if path.exists() { path } else { parent })
        .map_err(io_err("checking", parent))?;
    if on_bpffs != crate::fs::BPF_FS_MAGIC {
        return Err(LoadError::NotBpffs {
            path: path.to_path_buf(),
        });
    }
    let pins = PinDir::new(path);
    fs::create_dir_all(pins.links()).map_err(io_err("creating", path))?;
    if pins.has_maps() {
        pins.check_abi(Access::ReadWrite)?;
    }
    Ok(pins)
}

/// Every hook `opts` asks for: the socket hooks, TC both ways on each interface, and XDP
/// there under `--acceleration`.
fn wanted_hooks(opts: &InstallOptions) -> Vec<Hook> {
    let mut hooks: Vec<Hook> = SOCK_PROGRAMS.iter().map(|p| Hook::Sock(p)).collect();
    for iface in &opts.interfaces {
        for ingress in [true, false] {
            hooks.push(Hook::Tc {
                iface: iface.clone(),
                ingress,
            });
        }
        if opts.acceleration != Acceleration::Off {
            hooks.push(Hook::Xdp {
                iface: iface.clone(),
            });
        }
    }
    hooks
}

/// The missing hooks being attached: the loaded object, and what this call made (pin
/// names, for the rollback and the report).
struct Attaching<'a> {
    ebpf: &'a mut aya::Ebpf,
    pins: &'a PinDir,
    cgroup_dir: &'a Path,
    tc_mode: TcAttachMode,
    acceleration: Acceleration,
    made: Vec<String>,
    /// The first socket program's id (its aya-log ring buffer is the one read).
    log_program_id: Option<u32>,
}

impl Attaching<'_> {
    /// Loads `hook`'s program (once), attaches it and pins its link.
    fn attach(&mut self, hook: &Hook) -> Result<(), LoadError> {
        let name = hook.program();
        let program = self.ebpf.program_mut(name).ok_or(LoadError::Program {
            name,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?;
        let pinned = match hook {
            Hook::Sock(_) => {
                let prog: &mut CgroupSockAddr = program
                    .try_into()
                    .map_err(|source| LoadError::Program { name, source })?;
                Self::attach_sock(prog, name, self.cgroup_dir, &mut self.log_program_id)?
            }
            Hook::Xdp { iface } => {
                let prog: &mut Xdp = program
                    .try_into()
                    .map_err(|source| LoadError::Program { name, source })?;
                Self::attach_xdp(prog, name, iface, self.acceleration)?
            }
            Hook::Tc { iface, ingress } => {
                let prog: &mut SchedClassifier = program
                    .try_into()
                    .map_err(|source| LoadError::Program { name, source })?;
                // Loaded once, attached to every interface.
                if prog.fd().is_err() {
                    prog.load()
                        .map_err(|source| LoadError::Program { name, source })?;
                }
                if self.tc_mode == TcAttachMode::Clsact {
                    let pin = hook.link_pin(true).name();
                    attach_clsact(prog, name, iface, *ingress)?;
                    // Recorded (for the rollback) before the pin exists: the filter is
                    // there already.
                    self.made.push(pin.clone());
                    let path = self.pins.link_path(&pin);
                    prog.pin(&path)
                        .map_err(|source| LoadError::Pin { path, source })?;
                    debug!(hook = pin.as_str(), "attached");
                    return Ok(());
                }
                Self::attach_tcx(prog, name, iface, *ingress)?
            }
        };
        let path = self.pins.link_path(&hook.pin_name());
        pinned
            .pin(&path)
            .map_err(|source| LoadError::Pin { path, source })?;
        self.made.push(hook.pin_name());
        debug!(hook = self.made.last().map(String::as_str), "attached");
        Ok(())
    }

    /// A socket hook on `cgroup_dir` (its program id recorded for the kernel logger).
    fn attach_sock(
        prog: &mut CgroupSockAddr,
        name: &'static str,
        cgroup_dir: &Path,
        log_program_id: &mut Option<u32>,
    ) -> Result<FdLink, LoadError> {
        let prog_err = |source| LoadError::Program { name, source };
        let cgroup_file =
            fs::File::open(cgroup_dir).map_err(io_err("opening cgroup", cgroup_dir))?;
        prog.load().map_err(prog_err)?;
        if let Ok(info) = prog.info() {
            log_program_id.get_or_insert(info.id());
        }
        // With BPF links (kernel >= 5.7) the kernel requires flags == 0 (`Single`) and
        // still lets other programs' links share the hook ("Invalid argument" otherwise).
        let link_id = prog
            .attach(cgroup_file, CgroupAttachMode::Single)
            .map_err(prog_err)?;
        let link = prog.take_link(link_id).map_err(prog_err)?;
        link.try_into().map_err(|source| LoadError::Link {
            path: cgroup_dir.to_path_buf(),
            source,
        })
    }

    /// XDP on `iface` in the acceleration's mode (loaded once for every interface).
    fn attach_xdp(
        prog: &mut Xdp,
        name: &'static str,
        iface: &str,
        mode: Acceleration,
    ) -> Result<FdLink, LoadError> {
        let prog_err = |source| LoadError::Program { name, source };
        if prog.fd().is_err() {
            prog.load().map_err(prog_err)?;
        }
        let link_id = prog.attach(iface, mode.xdp_mode()).map_err(|source| {
            if mode == Acceleration::Native {
                LoadError::XdpNative {
                    iface: iface.to_string(),
                    source,
                }
            } else {
                LoadError::Attach {
                    what: format!("{name} to interface {iface} (generic XDP)"),
                    source,
                }
            }
        })?;
        let link = prog.take_link(link_id).map_err(prog_err)?;
        // A netlink attachment (kernels without XDP BPF links) cannot be pinned: refused
        // here, detached when `link` drops.
        link.try_into().map_err(|source| LoadError::Link {
            path: PathBuf::from(iface),
            source,
        })
    }

    /// TC on `iface` by a TCX link (the program already loaded).
    fn attach_tcx(
        prog: &mut SchedClassifier,
        name: &'static str,
        iface: &str,
        ingress: bool,
    ) -> Result<FdLink, LoadError> {
        let prog_err = |source| LoadError::Program { name, source };
        let tcx = TcAttachOptions::TcxOrder(LinkOrder::default());
        let link_id = prog
            .attach_with_options(iface, tc_kind(ingress), tcx)
            .map_err(|source| LoadError::Attach {
                what: format!("{name} to interface {iface}"),
                source,
            })?;
        let link = prog.take_link(link_id).map_err(prog_err)?;
        link.try_into().map_err(|source| LoadError::Link {
            path: PathBuf::from(iface),
            source,
        })
    }
}

/// The cgroup the first adopted socket hook's link is attached to; `wanted` (`--cgroup`)
/// and the cgroup2 root are tried first. `None` (with a warning) if it cannot be found.
fn adopted_cgroup(pins: &PinDir, adopted: &[String], wanted: Option<&PathBuf>) -> Option<PathBuf> {
    let name = adopted
        .iter()
        .find(|n| SOCK_PROGRAMS.contains(&n.as_str()))?;
    let mount = match cgroup::cgroup2_mount() {
        Ok(m) => m,
        Err(e) => {
            warn!("finding cgroup2 for the adopted hooks: {e}");
            return wanted.cloned();
        }
    };
    let candidates: Vec<PathBuf> = wanted.into_iter().cloned().chain([mount.clone()]).collect();
    match crate::sockdestroy::hooked_cgroup(pins, name, &mount, &candidates) {
        Ok(dir) => Some(dir),
        Err(e) => {
            warn!(
                link = name.as_str(),
                "the adopted hooks' cgroup: {e}; stale connected UDP sockets will not be destroyed"
            );
            None
        }
    }
}

/// Removes the pinned XDP links that `acceleration` does not want kept: all of them when
/// it is `off`, all of them when they were attached in another mode (`META[ACCELERATION]`;
/// they are re-attached in the new one).
fn drop_other_xdp(pins: &PinDir, acceleration: Acceleration) -> Result<(), LoadError> {
    let pinned = pins
        .read_meta(meta::ACCELERATION, Access::ReadOnly)
        .map(Acceleration::from_meta)
        .unwrap_or(Acceleration::Off);
    if acceleration != Acceleration::Off && pinned == acceleration {
        return Ok(());
    }
    let Ok(entries) = fs::read_dir(pins.links()) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(XDP_PIN_PREFIX) {
            info!(link = name, from = %pinned, to = %acceleration, "XDP acceleration changed: detaching");
            remove_pin(pins, &name)?;
        }
    }
    Ok(())
}
