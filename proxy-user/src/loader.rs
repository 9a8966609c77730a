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
    fs, io,
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, MapData},
    programs::{
        links::FdLink,
        links::PinnedLink,
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
        CgroupAttachMode, CgroupSockAddr, Link as _, LinkOrder, ProgramError, SchedClassifier,
        TcAttachType, Xdp, XdpMode,
    },
    EbpfLoader,
};
use proxy_common::{acceleration, map_names, meta, ABI_VERSION};
use tracing::{debug, info, warn};

use crate::{
    cgroup,
    pins::{Access, PinDir},
};

pub use crate::pins::DEFAULT_PIN_PATH;

/// The eBPF object built by `build.rs` (empty when built with the stub switch).
pub(crate) static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

/// Where a layout migration builds the new maps, inside the pin directory (same bpffs
/// mount, so the pins can be renamed into place); see `migrate/`.
pub const MIGRATE_STAGING_DIR: &str = "migrate-staging";

/// A hash of this build's eBPF object (FNV-1a, folded to 32 bits; never 0, which means
/// "none"), recorded in `META[OBJECT_HASH]`: another build's programs are swapped in.
pub fn object_hash() -> u32 {
    static HASH: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *HASH.get_or_init(|| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in EBPF_OBJECT {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        match (h ^ (h >> 32)) as u32 {
            0 => 1,
            v => v,
        }
    })
}

/// The cgroup hooks, by program name (the function names in `proxy-ebpf/src/sock.rs`).
pub const SOCK_PROGRAMS: [&str; 8] = [
    "sock4_connect",
    "sock4_sendmsg",
    "sock4_recvmsg",
    "sock4_getpeer",
    "sock6_connect",
    "sock6_sendmsg",
    "sock6_recvmsg",
    "sock6_getpeer",
];

/// Priority (`tc` "pref") of the clsact filters this project attaches: 19280, `0x4b50`
/// (ASCII "KP"). Reserved for ebpf-proxy: a filter at this priority and [`CLSACT_HANDLE`]
/// on `clsact` ingress/egress is taken to be ours (replaced by a re-attach, deleted by
/// uninstall); filters at any other priority or handle are never touched. It runs before
/// filters added without a priority (the kernel starts those at 49152).
pub const CLSACT_PRIORITY: u16 = 0x4b50;

/// Handle of the clsact filters this project attaches (`tc` shows `handle 0x4b50`).
pub const CLSACT_HANDLE: TcHandle = TcHandle::new(0, 0x4b50);

/// Suffix of the pin that records a clsact filter (`links/tc-<iface>-<dir>-clsact`; not
/// `.clsact`: bpffs refuses names with a dot).
const CLSACT_SUFFIX: &str = "-clsact";

/// How the TC programs are attached to the interfaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TcAttachMode {
    /// TCX when the kernel is >= 6.6, clsact otherwise.
    #[default]
    Auto,
    /// TCX links (kernel >= 6.6), pinned as `links/tc-<iface>-<dir>`.
    Tcx,
    /// Netlink filters in the interface's clsact qdisc (added if missing), with the
    /// reserved priority/handle; recorded by the program pinned as
    /// `links/tc-<iface>-<dir>-clsact`.
    Clsact,
}

impl TcAttachMode {
    /// `Tcx` or `Clsact`: what `Auto` means on this kernel.
    pub fn resolve(self) -> Self {
        match self {
            Self::Auto if tcx_supported() => Self::Tcx,
            Self::Auto => Self::Clsact,
            other => other,
        }
    }
}

impl std::fmt::Display for TcAttachMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Tcx => "tcx",
            Self::Clsact => "clsact",
        })
    }
}

/// `--acceleration`: whether north-south traffic is handled at XDP, ahead of TC, on the
/// same interfaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Acceleration {
    /// TC only.
    #[default]
    Off,
    /// XDP in generic (skb) mode: works on every interface, after the skb is built.
    Generic,
    /// XDP in the driver (native mode); an interface whose driver cannot is an error.
    Native,
}

impl Acceleration {
    /// Its `META[ACCELERATION]` value.
    pub fn meta(self) -> u32 {
        match self {
            Self::Off => acceleration::OFF,
            Self::Generic => acceleration::GENERIC,
            Self::Native => acceleration::NATIVE,
        }
    }

    /// From `META[ACCELERATION]` (unknown values read as off).
    pub fn from_meta(v: u32) -> Self {
        match v {
            acceleration::GENERIC => Self::Generic,
            acceleration::NATIVE => Self::Native,
            _ => Self::Off,
        }
    }

    fn xdp_mode(self) -> XdpMode {
        match self {
            Self::Native => XdpMode::Driver,
            _ => XdpMode::Skb,
        }
    }
}

impl std::fmt::Display for Acceleration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Generic => "generic",
            Self::Native => "native",
        })
    }
}

fn tcx_supported() -> bool {
    aya::util::KernelVersion::current().is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 6, 0))
}

/// Loading or removing the datapath failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "{path} is not on a bpf filesystem: mount one with `mount -t bpf bpf /sys/fs/bpf` \
             (or run `cargo xtask setup`)"
    )]
    NotBpffs { path: PathBuf },
    #[error(
        "this binary was built without the eBPF object (bpf-linker was missing): \
             run `cargo xtask build`"
    )]
    NoObject,
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Open(#[from] crate::pins::PinError),
    #[error("loading the eBPF object: {0}")]
    Ebpf(#[from] aya::EbpfError),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("attaching {what}: {source}")]
    Attach {
        what: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error(
        "conntrack size {flows} flows is out of range ({}..={} flows per address family)",
        proxy_common::limits::CT_FLOWS_MIN,
        proxy_common::limits::CT_FLOWS_MAX
    )]
    ConntrackSize { flows: u32 },
    #[error(
        "TC attach mode tcx needs kernel >= 6.6: use `--tc-attach auto` or `--tc-attach clsact`"
    )]
    TcxUnsupported,
    #[error(
        "native XDP (driver mode) is not available on interface {iface}: {source}; \
         use `--acceleration generic` (or `off`)"
    )]
    XdpNative {
        iface: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("pinned link {path}: {source}")]
    Link {
        path: PathBuf,
        #[source]
        source: aya::programs::links::LinkError,
    },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> LoadError {
    let path = path.to_owned();
    move |source| LoadError::Io { what, path, source }
}

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
    /// How the TC programs are attached (hooks already pinned are adopted whatever the
    /// mode they were attached with).
    pub tc_attach: TcAttachMode,
    /// XDP ahead of TC on the same interfaces (`--acceleration`). Pinned XDP links are
    /// adopted when they were attached in this mode, re-attached when the mode changed,
    /// removed when it is `off`.
    pub acceleration: Acceleration,
}

/// Default conntrack size in flows per family (`--conntrack-max`).
pub const DEFAULT_CONNTRACK_FLOWS: u32 = proxy_common::limits::MAX_CT / 2;

/// Map entries for `flows` conntrack flows, checked against the accepted range.
pub fn conntrack_entries(flows: u32) -> Result<u32, LoadError> {
    use proxy_common::limits::{CT_FLOWS_MAX, CT_FLOWS_MIN};
    if !(CT_FLOWS_MIN..=CT_FLOWS_MAX).contains(&flows) {
        return Err(LoadError::ConntrackSize { flows });
    }
    Ok(flows * 2)
}

/// `max_entries` of the pinned map at `path`, if there is one.
fn pinned_max_entries(path: &Path) -> Option<u32> {
    let map = aya::maps::MapData::from_pin(path).ok()?;
    map.info().ok().map(|i| i.max_entries())
}

/// Kernel memory of one pinned map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapMemory {
    /// Its name (`proxy_common::map_names`).
    pub name: &'static str,
    /// Its `max_entries`.
    pub max_entries: u32,
    /// The `memlock:` figure of its fdinfo: the kernel's own count of the map's memory
    /// (`bpf_map_memory_usage`). Preallocated maps (the LRU tables, arrays) hold all of
    /// it from creation; `BPF_F_NO_PREALLOC` hash maps grow with their entries. It is
    /// charged to the memory cgroup of the process that created the map, for as long as
    /// the map exists (pinned: until `uninstall`).
    pub bytes: u64,
}

/// The memory of every map pinned under `pin_path` (maps that are not there are left
/// out), read from the kernel: `/proc/self/fdinfo/<fd>`'s `memlock:` line.
pub fn map_memory(pin_path: &Path) -> Vec<MapMemory> {
    use std::os::fd::{AsFd, AsRawFd};
    map_names::ALL
        .iter()
        .filter_map(|&name| {
            let map = MapData::from_pin(pin_path.join(name)).ok()?;
            let max_entries = map.info().ok()?.max_entries();
            let fd = map.fd().as_fd().as_raw_fd();
            let fdinfo = fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
            let bytes = fdinfo_memlock(&fdinfo)?;
            Some(MapMemory {
                name,
                max_entries,
                bytes,
            })
        })
        .collect()
}

/// The `memlock:` value of a BPF map's fdinfo.
fn fdinfo_memlock(fdinfo: &str) -> Option<u64> {
    fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("memlock:"))
        .and_then(|v| v.trim().parse().ok())
}

/// One attachment of a program, and the name of its pinned link under `links/`.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Hook {
    Sock(&'static str),
    Tc { iface: String, ingress: bool },
    Xdp { iface: String },
}

/// Prefix of the pinned XDP links (`links/xdp-<iface>`).
pub(crate) const XDP_PIN_PREFIX: &str = "xdp-";

impl Hook {
    fn program(&self) -> &'static str {
        match self {
            Hook::Sock(name) => name,
            Hook::Tc { ingress: true, .. } => "tc_ingress",
            Hook::Tc { ingress: false, .. } => "tc_egress",
            Hook::Xdp { .. } => "xdp_ingress",
        }
    }

    /// The name of its pin under `links/` (TC hooks: the TCX link's; the clsact record
    /// adds [`CLSACT_SUFFIX`]).
    fn pin_name(&self) -> String {
        match self {
            Hook::Sock(name) => name.to_string(),
            Hook::Tc { iface, ingress } => {
                format!("tc-{iface}-{}", if *ingress { "ingress" } else { "egress" })
            }
            Hook::Xdp { iface } => format!("{XDP_PIN_PREFIX}{iface}"),
        }
    }

    /// The pin that exists for this hook under `links`, if any.
    fn existing_pin(&self, links: &Path) -> Option<String> {
        let name = self.pin_name();
        let clsact = format!("{name}{CLSACT_SUFFIX}");
        if links.join(&name).exists() {
            Some(name)
        } else if matches!(self, Hook::Tc { .. }) && links.join(&clsact).exists() {
            Some(clsact)
        } else {
            None
        }
    }
}

/// Ingress or egress, as aya names it.
fn tc_kind(ingress: bool) -> TcAttachType {
    if ingress {
        TcAttachType::Ingress
    } else {
        TcAttachType::Egress
    }
}

/// `tc-<iface>-<dir>-clsact` -> (iface, ingress).
fn parse_clsact_pin(name: &str) -> Option<(&str, bool)> {
    let rest = name.strip_prefix("tc-")?.strip_suffix(CLSACT_SUFFIX)?;
    if let Some(iface) = rest.strip_suffix("-ingress") {
        Some((iface, true))
    } else {
        rest.strip_suffix("-egress").map(|iface| (iface, false))
    }
}

fn netlink_errno(e: &ProgramError) -> Option<i32> {
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
fn attach_clsact(
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
fn detach_clsact(iface: &str, ingress: bool) -> Result<bool, LoadError> {
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
}

/// What [`uninstall`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UninstallReport {
    pub links: Vec<String>,
    pub maps: Vec<String>,
}

fn link_dir(pin_path: &Path) -> PathBuf {
    pin_path.join("links")
}

/// Loads and attaches whatever is not already pinned, and pins it.
pub fn install(opts: &InstallOptions) -> Result<InstallReport, LoadError> {
    let pin_path = &opts.pin_path;
    let parent = pin_path.parent().unwrap_or(Path::new("/"));
    let on_bpffs = crate::fs::magic(if pin_path.exists() { pin_path } else { parent })
        .map_err(io_err("checking", parent))?;
    if on_bpffs != crate::fs::BPF_FS_MAGIC {
        return Err(LoadError::NotBpffs {
            path: pin_path.clone(),
        });
    }
    fs::create_dir_all(link_dir(pin_path)).map_err(io_err("creating", pin_path))?;

    // Maps of another ABI would be misread by the new programs: refuse.
    let pins = PinDir::new(pin_path);
    if pins.has_maps() {
        pins.check_abi(Access::ReadWrite)?;
    }

    let mut report = InstallReport::default();
    let ct_entries = conntrack_entries(opts.conntrack_flows)?;
    report.conntrack_entries = ct_entries;
    if let Some(pinned) = pinned_max_entries(&pin_path.join(map_names::CT4)) {
        if pinned != ct_entries {
            warn!(
                pinned_flows = pinned / 2,
                wanted_flows = ct_entries / 2,
                "the pinned conntrack tables keep their size (resizing would drop every \
                 tracked flow); `proxy-agent uninstall` and a restart apply the new size"
            );
        }
        report.conntrack_entries = pinned;
    }
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
    let links = link_dir(pin_path);
    drop_other_xdp(pin_path, &links, opts.acceleration)?;
    let missing: Vec<Hook> = hooks
        .into_iter()
        .filter(|hook| match hook.existing_pin(&links) {
            Some(name) => {
                report.adopted.push(name);
                false
            }
            None => true,
        })
        .collect();
    // Adopted socket hooks: the cgroup they are attached to, for the stale-socket
    // cleanup (`sockdestroy`), from the kernel's record of the link.
    report.cgroup = adopted_cgroup(&links, &report.adopted, opts.cgroup.as_ref());
    if missing.is_empty() {
        set_pinned_meta(pin_path, meta::ACCELERATION, opts.acceleration.meta())?;
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

    let mut ebpf = load_object(pin_path, ct_entries)?;

    // What this call made, for the rollback and the report: pin names.
    let mut made: Vec<String> = Vec::new();
    let mut log_program_id = None;
    let result = (|| {
        for hook in &missing {
            let name = hook.program();
            let prog_err = |source| LoadError::Program { name, source };
            let program = ebpf.program_mut(name).ok_or(LoadError::Program {
                name,
                source: aya::programs::ProgramError::UnexpectedProgramType,
            })?;
            let pin_err = |path: &Path| {
                let path = path.to_owned();
                move |source| LoadError::Pin { path, source }
            };
            match hook {
                Hook::Sock(_) => {
                    let cgroup_file = fs::File::open(&cgroup_dir)
                        .map_err(io_err("opening cgroup", &cgroup_dir))?;
                    let prog: &mut CgroupSockAddr = program.try_into().map_err(prog_err)?;
                    prog.load().map_err(prog_err)?;
                    if let Ok(info) = prog.info() {
                        log_program_id.get_or_insert(info.id());
                    }
                    // With BPF links (kernel >= 5.7) the kernel requires flags == 0
                    // (`Single`) and still lets other programs' links share the hook
                    // ("Invalid argument" otherwise).
                    let link_id = prog
                        .attach(cgroup_file, CgroupAttachMode::Single)
                        .map_err(prog_err)?;
                    let link = prog.take_link(link_id).map_err(prog_err)?;
                    let fd_link: FdLink = link.try_into().map_err(|source| LoadError::Link {
                        path: cgroup_dir.clone(),
                        source,
                    })?;
                    let path = links.join(hook.pin_name());
                    fd_link.pin(&path).map_err(pin_err(&path))?;
                    made.push(hook.pin_name());
                }
                Hook::Xdp { iface } => {
                    let prog: &mut Xdp = program.try_into().map_err(prog_err)?;
                    if prog.fd().is_err() {
                        prog.load().map_err(prog_err)?;
                    }
                    let mode = opts.acceleration;
                    let link_id = prog.attach(iface, mode.xdp_mode()).map_err(|source| {
                        if mode == Acceleration::Native {
                            LoadError::XdpNative {
                                iface: iface.clone(),
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
                    // A netlink attachment (kernels without XDP BPF links) cannot be
                    // pinned: refused here, detached when `link` drops.
                    let fd_link: FdLink = link.try_into().map_err(|source| LoadError::Link {
                        path: PathBuf::from(iface),
                        source,
                    })?;
                    let path = links.join(hook.pin_name());
                    fd_link.pin(&path).map_err(pin_err(&path))?;
                    made.push(hook.pin_name());
                }
                Hook::Tc { iface, ingress } => {
                    let prog: &mut SchedClassifier = program.try_into().map_err(prog_err)?;
                    // Loaded once, attached to every interface.
                    if prog.fd().is_err() {
                        prog.load().map_err(prog_err)?;
                    }
                    if tc_mode == TcAttachMode::Clsact {
                        let pin = format!("{}{CLSACT_SUFFIX}", hook.pin_name());
                        attach_clsact(prog, name, iface, *ingress)?;
                        // Recorded (for the rollback) before the pin exists: the filter
                        // is there already.
                        made.push(pin.clone());
                        let path = links.join(&pin);
                        prog.pin(&path).map_err(pin_err(&path))?;
                    } else {
                        let tcx = TcAttachOptions::TcxOrder(LinkOrder::default());
                        let link_id = prog
                            .attach_with_options(iface, tc_kind(*ingress), tcx)
                            .map_err(|source| LoadError::Attach {
                                what: format!("{name} to interface {iface}"),
                                source,
                            })?;
                        let link = prog.take_link(link_id).map_err(prog_err)?;
                        let fd_link: FdLink =
                            link.try_into().map_err(|source| LoadError::Link {
                                path: PathBuf::from(iface),
                                source,
                            })?;
                        let path = links.join(hook.pin_name());
                        fd_link.pin(&path).map_err(pin_err(&path))?;
                        made.push(hook.pin_name());
                    }
                }
            }
            debug!(hook = made.last().map(String::as_str), "attached");
        }
        Ok(())
    })();
    if let Err(e) = result {
        // Leave no half-installed hook set behind from this call.
        for pin in &made {
            if let Err(e) = remove_pin(&links, pin) {
                warn!(pin, "rolling back: {e}");
            }
        }
        return Err(e);
    }
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

/// The cgroup the first adopted socket hook's link is attached to; `wanted` (`--cgroup`)
/// and the cgroup2 root are tried first. `None` (with a warning) if it cannot be found.
fn adopted_cgroup(links: &Path, adopted: &[String], wanted: Option<&PathBuf>) -> Option<PathBuf> {
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
    match crate::sockdestroy::hooked_cgroup(&links.join(name), &mount, &candidates) {
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

/// Loads the eBPF object with its maps pinned (or reused) under `pin_path` and records
/// the ABI version; programs are not loaded into the kernel yet. For `install`, and for
/// tests that run a program with `BPF_PROG_TEST_RUN`.
///
/// `ct_entries` sizes the conntrack tables when they are created here (not when pinned).
pub fn load_object(pin_path: &Path, ct_entries: u32) -> Result<aya::Ebpf, LoadError> {
    if EBPF_OBJECT.is_empty() {
        return Err(LoadError::NoObject);
    }
    fs::create_dir_all(pin_path).map_err(io_err("creating", pin_path))?;
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(pin_path)
        .map_max_entries(map_names::CT4, ct_entries)
        .map_max_entries(map_names::CT6, ct_entries)
        .load(EBPF_OBJECT)?;
    write_meta(&mut ebpf, meta::ABI_VERSION, ABI_VERSION)?;
    write_meta(&mut ebpf, meta::OBJECT_HASH, object_hash())?;
    Ok(ebpf)
}

/// Removes the pinned XDP links that `acceleration` does not want kept: all of them when
/// it is `off`, all of them when they were attached in another mode (`META[ACCELERATION]`;
/// they are re-attached in the new one).
fn drop_other_xdp(
    pin_path: &Path,
    links: &Path,
    acceleration: Acceleration,
) -> Result<(), LoadError> {
    let pinned = PinDir::new(pin_path)
        .read_meta(meta::ACCELERATION, Access::ReadOnly)
        .map(Acceleration::from_meta)
        .unwrap_or(Acceleration::Off);
    if acceleration != Acceleration::Off && pinned == acceleration {
        return Ok(());
    }
    let Ok(entries) = fs::read_dir(links) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(XDP_PIN_PREFIX) {
            info!(link = name, from = %pinned, to = %acceleration, "XDP acceleration changed: detaching");
            remove_pin(links, &name)?;
        }
    }
    Ok(())
}

/// Writes one `META` entry of the pinned maps.
fn set_pinned_meta(pin_path: &Path, index: u32, value: u32) -> Result<(), LoadError> {
    let err = |source| LoadError::Map {
        name: map_names::META,
        source,
    };
    let data = MapData::from_pin(pin_path.join(map_names::META)).map_err(err)?;
    let mut meta: Array<MapData, u32> =
        Array::try_from(aya::maps::Map::Array(data)).map_err(err)?;
    meta.set(index, value, 0).map_err(err)
}

fn write_meta(ebpf: &mut aya::Ebpf, index: u32, value: u32) -> Result<(), LoadError> {
    let err = |source| LoadError::Map {
        name: map_names::META,
        source,
    };
    let map = ebpf.map_mut(map_names::META).ok_or_else(|| {
        err(aya::maps::MapError::InvalidName {
            name: map_names::META.into(),
        })
    })?;
    let mut meta: Array<&mut MapData, u32> = Array::try_from(map).map_err(err)?;
    meta.set(index, value, 0).map_err(err)
}

/// Forwards the kernel programs' aya-log records (rare warnings) to this process's
/// `log`/`tracing` output until the returned task is dropped. Works for adopted programs
/// too: it finds their ring buffer through the program id the loader recorded.
pub fn spawn_kernel_logger(pin_path: &Path) -> Option<tokio::task::JoinHandle<()>> {
    let id = PinDir::new(pin_path)
        .read_meta(meta::LOG_PROGRAM_ID, Access::ReadOnly)
        .ok()
        .filter(|id| *id != 0)?;
    let logger = match aya_log::EbpfLogger::init_from_id(id) {
        Ok(l) => l,
        Err(e) => {
            warn!(program_id = id, "kernel log records unavailable: {e}");
            return None;
        }
    };
    // SAFETY: the logger owns its ring buffer's fd for its whole life, and the AsyncFd
    // owns the logger.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    };
    let mut fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            warn!("kernel log records unavailable: {e}");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        loop {
            let Ok(mut guard) = fd.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    }))
}

/// Detaches every hook and removes every pin this project made under `pin_path`.
/// Files it does not know are left alone (and reported as an error). Clsact filters are
/// deleted from the interfaces of this thread's network namespace (see the module doc).
pub fn uninstall(pin_path: &Path) -> Result<UninstallReport, LoadError> {
    let mut report = UninstallReport::default();
    if !pin_path.exists() {
        return Ok(report);
    }
    let links = link_dir(pin_path);
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
        remove_pin(&links, &name)?;
        report.links.push(name);
    }
    // A migration interrupted by a crash leaves its staging directory (migrate/).
    match fs::remove_dir_all(pin_path.join(MIGRATE_STAGING_DIR)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err("removing the staging directory in", pin_path)(e));
        }
        _ => {}
    }
    if links.exists() {
        fs::remove_dir(&links).map_err(io_err("removing (unknown files left?)", &links))?;
    }
    for name in map_names::ALL {
        let path = pin_path.join(name);
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
fn remove_pin(links: &Path, name: &str) -> Result<(), LoadError> {
    let path = links.join(name);
    if let Some((iface, ingress)) = parse_clsact_pin(name) {
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

/// Raises RLIMIT_MEMLOCK for kernels that still charge BPF memory to it (< 5.11).
/// Newer kernels use memcg accounting; failing here is then harmless.
fn bump_memlock_rlimit() {
    let rlim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscall with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlim) } != 0 {
        warn!(
            error = %io::Error::last_os_error(),
            "could not raise RLIMIT_MEMLOCK (fine on kernels >= 5.11)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conntrack_size_is_two_entries_per_flow_within_range() {
        assert_eq!(
            conntrack_entries(DEFAULT_CONNTRACK_FLOWS).ok(),
            Some(1 << 18)
        );
        assert_eq!(conntrack_entries(64).ok(), Some(128));
        for bad in [0, 63, (1 << 23) + 1] {
            let err = conntrack_entries(bad).expect_err("out of range");
            assert_eq!(
                err.to_string(),
                format!(
                    "conntrack size {bad} flows is out of range (64..=8388608 flows per \
                     address family)"
                )
            );
        }
    }

    #[test]
    fn memlock_is_read_from_a_map_fdinfo() {
        // As the kernel prints it (kernel/bpf/syscall.c, bpf_map_show_fdinfo).
        let fdinfo = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\n\
                      map_type:\t9\nkey_size:\t16\nvalue_size:\t40\n\
                      max_entries:\t262144\nmap_flags:\t0x0\nmap_extra:\t0x0\n\
                      memlock:\t31458240\nmap_id:\t42\nfrozen:\t0\n";
        assert_eq!(fdinfo_memlock(fdinfo), Some(31_458_240));
        assert_eq!(fdinfo_memlock("pos:\t0\n"), None);
    }

    #[test]
    fn clsact_pin_names_parse_back() {
        for (iface, ingress) in [("eth0", true), ("eth0", false), ("br-ex-egress", true)] {
            let hook = Hook::Tc {
                iface: iface.into(),
                ingress,
            };
            let pin = format!("{}{CLSACT_SUFFIX}", hook.pin_name());
            assert!(!pin.contains('.'), "bpffs refuses dots: {pin}");
            assert_eq!(parse_clsact_pin(&pin), Some((iface, ingress)));
            // A TCX link's pin is never taken for a clsact record.
            assert_eq!(parse_clsact_pin(&hook.pin_name()), None);
        }
        assert_eq!(parse_clsact_pin("sock4_connect"), None);
        assert_eq!(parse_clsact_pin("tc-eth0-sideways-clsact"), None);
    }

    #[test]
    fn attach_mode_resolves_to_tcx_or_clsact() {
        assert_eq!(TcAttachMode::Tcx.resolve(), TcAttachMode::Tcx);
        assert_eq!(TcAttachMode::Clsact.resolve(), TcAttachMode::Clsact);
        let auto = TcAttachMode::Auto.resolve();
        assert_eq!(
            auto,
            if tcx_supported() {
                TcAttachMode::Tcx
            } else {
                TcAttachMode::Clsact
            }
        );
        assert_eq!(TcAttachMode::default(), TcAttachMode::Auto);
    }
}
