//! Upgrades of a running datapath without a gap in service ([`install`]: this module's
//! [`prepare`], then [`loader::install`](crate::loader::install), which adopts the pins).
//!
//! **Same layout, another build.** `META[OBJECT_HASH]` records a hash of the eBPF object
//! whose programs run. A new agent whose object differs loads its programs against the
//! pinned maps and swaps every pinned hook to them: `BPF_LINK_UPDATE` for cgroup and TCX
//! links (an atomic pointer swap in the kernel), a netlink replace at the same
//! priority/handle for clsact filters. Restarting the same build finds the same hash and
//! adopts without loading anything.
//!
//! **Another layout (ABI N-1 -> N).** Pins whose `META[ABI_VERSION]` is in
//! [`OLDEST_ABI`]`..ABI_VERSION` are migrated in the staging directory
//! `<pin>/`[`STAGING_DIR`] (inside the pin directory: same bpffs mount, so `rename(2)`
//! moves a pin atomically):
//!
//! 1. `staged`: the new object's maps are created (pinned) in the staging directory;
//!    a map whose type, key/value sizes and flags did not change and that needs no
//!    conversion is replaced there by the old map itself (shared by both builds, so the
//!    conntrack table stays one while the hooks change programs);
//! 2. `filled`: every entry of the other maps is copied from the old ones
//!    ([`converter`]: a conversion function, or bytes; what cannot be converted is named
//!    and counted in the log);
//! 3. `swapping` .. `swapped`: the new programs are loaded against the staging maps, the
//!    entries the old programs wrote meanwhile are copied (insert-if-absent), and every
//!    hook is swapped to the new programs;
//! 4. `recopied`: the flows the old programs created until the swap are copied again
//!    (insert-if-absent: conntrack, affinity, socket reverse NAT);
//! 5. `renaming` .. `meta`: the staged pins are renamed over the old ones, `META` last;
//!    maps that no longer exist are unpinned and the staging directory removed.
//!
//! The marker, a directory `<staging>/abi<N>-<step>` renamed from step to step (bpffs
//! holds no regular files), says where a migration stood. A start that finds it rolls
//! back while no hook runs a new program (`staged`, `filled`: the staging directory is
//! removed; the old programs never stopped serving) and resumes from `swapping` on (the
//! new maps are complete; the swap, copies and renames are idempotent). At every point
//! either the old or the new programs serve every hook, each with a complete map set.
//!
//! Test hooks: `EBPF_PROXY_MIGRATE_CRASH_AT=<step>` makes the process `abort()` right
//! after that step ([`STEPS`]); `EBPF_PROXY_MIGRATE_FORCE=1` runs the full staged
//! migration instead of the program swap when the layout is the same but the build
//! differs (so that the migration can be tested before a layout change exists;
//! `EBPF_PROXY_MIGRATE_FORCE=copy` shares nothing and converts every map through its
//! [`v3`] function, as if every layout had changed).

mod sys;
pub mod v3;

use std::{
    fs, io,
    os::fd::{AsFd, BorrowedFd},
    path::{Path, PathBuf},
};

use aya::{
    programs::{
        tc::{SchedClassifierLink, TcError},
        CgroupSockAddr, SchedClassifier, TcAttachType, Xdp,
    },
    EbpfLoader,
};
use proxy_common::{map_names, meta, Reason, ABI_VERSION};
use tracing::{info, warn};

use crate::{
    bpf,
    loader::{self, LoadError, CLSACT_HANDLE, CLSACT_PRIORITY, EBPF_OBJECT, SOCK_PROGRAMS},
};

/// The staging directory inside the pin directory.
pub use crate::loader::{object_hash, MIGRATE_STAGING_DIR as STAGING_DIR};
/// The oldest `META` ABI this build migrates from (one release back: 3).
pub const OLDEST_ABI: u32 = 3;
/// Test hook: abort right after the named step.
pub const CRASH_ENV: &str = "EBPF_PROXY_MIGRATE_CRASH_AT";
/// Test hook: migrate through the staging directory even at the same ABI.
pub const FORCE_ENV: &str = "EBPF_PROXY_MIGRATE_FORCE";

/// The steps [`CRASH_ENV`] can name, in order. `swap-first` and `rename-first` stop
/// after the first hook swapped / the first map renamed (half-done states).
pub const STEPS: [&str; 7] = [
    "staged",
    "filled",
    "swap-first",
    "swapped",
    "recopied",
    "rename-first",
    "meta",
];

/// Maps the datapath itself writes: copied again, insert-if-absent, around the swap.
/// (Not `SOCK_REVNAT4/6`: from ABI 4 on they live in each socket's storage.)
const DATAPATH_WRITTEN: [&str; 3] = [map_names::CT4, map_names::CT6, map_names::AFFINITY];

/// A function converting one entry (key, value bytes of the old layout) to the new
/// layout; `None` drops it (counted as not converted).
pub type ConvertFn = fn(&[u8], &[u8]) -> Option<(Vec<u8>, Vec<u8>)>;

/// How the entries of one map move from an older ABI.
#[derive(Clone, Copy)]
pub enum Convert {
    /// Same layout: copied byte for byte (the sizes are checked).
    Bytes,
    /// Changed layout: each entry through this function.
    With(ConvertFn),
    /// Cannot be converted (the reason is logged with the count).
    Drop(&'static str),
}

/// The conversion of map `map` from ABI `from` to this build's layout. **Every map
/// whose key or value changed since `from` needs an arm here** (a function over the
/// old structs of [`v3`]); maps without one are copied as bytes when their sizes still
/// match, and dropped (named and counted in the log) when they do not.
pub fn converter(from: u32, map: &str) -> Convert {
    if force_mode() == Some(Force::Copy) {
        // Test hook: every map as if its layout had changed.
        return v3::convert(map).unwrap_or(Convert::Bytes);
    }
    match (from, map) {
        // ABI 3 -> 4: one arm per map whose key or value changed, through the frozen
        // ABI-3 structs (v3.rs). `STATS` grew (24 reasons) with the same key and value:
        // copied as bytes into the larger array (a different size is never shared).
        (3, map_names::SOCK_REVNAT4 | map_names::SOCK_REVNAT6) => {
            Convert::Drop(v3::SOCK_REVNAT_GONE)
        }
        _ => Convert::Bytes,
    }
}

/// [`FORCE_ENV`]: `1` migrates through the staging directory (sharing the maps whose
/// layout is unchanged), `copy` also copies every map through its conversion function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Force {
    Staged,
    Copy,
}

fn force_mode() -> Option<Force> {
    match std::env::var(FORCE_ENV).ok()?.as_str() {
        "1" => Some(Force::Staged),
        "copy" => Some(Force::Copy),
        _ => None,
    }
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> LoadError {
    let path = path.to_owned();
    move |source| LoadError::Io { what, path, source }
}

fn crash_point(step: &str) {
    if std::env::var(CRASH_ENV).is_ok_and(|s| s == step) {
        eprintln!("{CRASH_ENV}={step}: aborting (test hook)");
        std::process::abort();
    }
}

/// [`loader::install`] after [`prepare`]: what `proxy-agent run` and `install` call, so a
/// node's pinned datapath is upgraded (or an interrupted upgrade finished) before it is
/// adopted.
pub fn install(opts: &loader::InstallOptions) -> Result<loader::InstallReport, LoadError> {
    prepare(&opts.pin_path)?;
    loader::install(opts)
}

/// Before `install` reads `META`: finishes or rolls back an interrupted migration,
/// migrates an older layout, or swaps the programs of another build in.
pub fn prepare(pin_path: &Path) -> Result<(), LoadError> {
    if EBPF_OBJECT.is_empty() {
        return Ok(());
    }
    let staging = pin_path.join(STAGING_DIR);
    if staging.exists() {
        resume_or_roll_back(pin_path)?;
    }
    if !pin_path.join(map_names::META).exists() {
        return Ok(());
    }
    let found = bpf::read_abi_version(pin_path)?;
    if found != ABI_VERSION {
        if (OLDEST_ABI..ABI_VERSION).contains(&found) {
            return migrate(pin_path, found);
        }
        // Refused by install with a clear error.
        return Ok(());
    }
    let pinned_hash = bpf::read_meta(pin_path, meta::OBJECT_HASH)?;
    if pinned_hash == object_hash() {
        return Ok(());
    }
    if let Some(mode) = force_mode() {
        warn!(
            ?mode,
            "{FORCE_ENV}: migrating through the staging directory at the same ABI"
        );
        return migrate(pin_path, found);
    }
    if let Some((map, pinned)) = counters_grew(pin_path)? {
        info!(
            map,
            pinned,
            wanted = Reason::COUNT,
            "this build counts more outcomes than the pinned counter array holds: \
             migrating through the staging directory (the counters are copied)"
        );
        return migrate(pin_path, found);
    }
    replace_programs(pin_path, pinned_hash)
}

/// A pinned outcome-counter array (`STATS`, `XDP_STATS`: one entry per [`Reason`]) smaller
/// than this build's `Reason::COUNT`: new reasons are added within an ABI (a new counter
/// is not a layout change for the other maps), but a program swap keeps the pinned
/// array, where the new reasons' counts would be lost and readers would fail. Such pins
/// take the staged migration, which copies the counters into arrays of the new size.
fn counters_grew(pin_path: &Path) -> Result<Option<(&'static str, u32)>, LoadError> {
    for name in [map_names::STATS, map_names::XDP_STATS] {
        let path = pin_path.join(name);
        if !path.exists() {
            continue;
        }
        let fd = sys::obj_get(&path).map_err(io_err("opening", &path))?;
        let entries = sys::map_info(fd.as_fd())
            .map_err(io_err("reading the map info of", &path))?
            .max_entries;
        if entries < Reason::COUNT {
            return Ok(Some((name, entries)));
        }
    }
    Ok(None)
}

/// Same layout, another build: load this build's programs against the pinned maps and
/// swap every pinned hook to them.
fn replace_programs(pin_path: &Path, pinned_hash: u32) -> Result<(), LoadError> {
    let hooks = pinned_hooks(pin_path)?;
    if hooks.is_empty() {
        return Ok(());
    }
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(pin_path)
        .load(EBPF_OBJECT)?;
    let log_id = swap_hooks(&mut ebpf, pin_path, &hooks, false, &mut || Ok(()))?;
    let meta_fd = sys::obj_get(&pin_path.join(map_names::META))
        .map_err(io_err("opening", &pin_path.join(map_names::META)))?;
    write_meta(meta_fd.as_fd(), meta::OBJECT_HASH, object_hash(), pin_path)?;
    if let Some(id) = log_id {
        write_meta(meta_fd.as_fd(), meta::LOG_PROGRAM_ID, id, pin_path)?;
    }
    info!(
        hooks = hooks.len(),
        from_object = format!("{pinned_hash:08x}"),
        to_object = format!("{:08x}", object_hash()),
        "replaced the running programs with this build's (same map layout, no gap)"
    );
    Ok(())
}

fn write_meta(fd: BorrowedFd<'_>, index: u32, value: u32, dir: &Path) -> Result<(), LoadError> {
    sys::update(fd, &index.to_ne_bytes(), &value.to_ne_bytes(), sys::ANY)
        .map(drop)
        .map_err(io_err("writing META in", dir))
}

/// One pinned hook under `links/`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PinnedHook {
    /// Its pin name.
    pin: String,
    /// The program it runs.
    program: &'static str,
    /// `Some((iface, ingress))` for a clsact record (a pinned program, not a link).
    clsact: Option<(String, bool)>,
}

/// Parses a pin name under `links/`; `None` for a name this project does not make.
fn parse_hook(pin: &str) -> Option<PinnedHook> {
    if let Some(p) = SOCK_PROGRAMS.iter().find(|p| **p == pin) {
        return Some(PinnedHook {
            pin: pin.into(),
            program: p,
            clsact: None,
        });
    }
    if let Some(iface) = pin.strip_prefix(loader::XDP_PIN_PREFIX) {
        return (!iface.is_empty()).then(|| PinnedHook {
            pin: pin.into(),
            program: "xdp_ingress",
            clsact: None,
        });
    }
    let rest = pin.strip_prefix("tc-")?;
    let (rest, clsact) = match rest.strip_suffix("-clsact") {
        Some(r) => (r, true),
        None => (rest, false),
    };
    let (iface, ingress) = if let Some(i) = rest.strip_suffix("-ingress") {
        (i, true)
    } else {
        (rest.strip_suffix("-egress")?, false)
    };
    Some(PinnedHook {
        pin: pin.into(),
        program: if ingress { "tc_ingress" } else { "tc_egress" },
        clsact: clsact.then(|| (iface.to_string(), ingress)),
    })
}

/// The hooks pinned under `<pin>/links`, TC first (so the two directions of a flow
/// change programs as close together as possible).
fn pinned_hooks(pin_path: &Path) -> Result<Vec<PinnedHook>, LoadError> {
    let links = pin_path.join("links");
    let mut hooks = Vec::new();
    match fs::read_dir(&links) {
        Ok(entries) => {
            for e in entries {
                let e = e.map_err(io_err("listing", &links))?;
                if let Some(h) = parse_hook(&e.file_name().to_string_lossy()) {
                    hooks.push(h);
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("listing", &links)(e)),
    }
    hooks.sort_by_key(|h| (!h.pin.starts_with("tc-"), h.pin.clone()));
    Ok(hooks)
}

/// Loads the programs the hooks need from `ebpf` and swaps each hook to its program
/// (`crash` enables the `swap-first` crash point). Returns a loaded socket program's id
/// (for `META[LOG_PROGRAM_ID]`).
fn swap_hooks(
    ebpf: &mut aya::Ebpf,
    pin_path: &Path,
    hooks: &[PinnedHook],
    crash: bool,
    before_swap: &mut dyn FnMut() -> Result<(), LoadError>,
) -> Result<Option<u32>, LoadError> {
    let links = pin_path.join("links");
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
        let path = links.join(&hook.pin);
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
            let link = sys::obj_get(&path).map_err(io_err("opening the pinned link", &path))?;
            sys::link_update(link.as_fd(), fd.as_fd())
                .map_err(io_err("BPF_LINK_UPDATE of", &path))?;
        }
        if i == 0 && crash {
            crash_point("swap-first");
        }
    }
    Ok(log_id)
}

/// Replaces the program of our clsact filter on `iface` in place (same priority and
/// handle: `RTM_NEWTFILTER` without `NLM_F_EXCL`, no gap).
fn replace_clsact(prog: &mut SchedClassifier, iface: &str, ingress: bool) -> Result<(), LoadError> {
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

/// The migration's marker: `<staging>/abi<from>-<state>`.
fn read_marker(staging: &Path) -> Option<(u32, String)> {
    let entries = fs::read_dir(staging).ok()?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(rest) = name.strip_prefix("abi") {
            if let Some((abi, state)) = rest.split_once('-') {
                if let Ok(abi) = abi.parse() {
                    return Some((abi, state.to_string()));
                }
            }
        }
    }
    None
}

fn set_marker(staging: &Path, from: u32, state: &str) -> Result<(), LoadError> {
    let new = staging.join(format!("abi{from}-{state}"));
    match read_marker(staging) {
        Some((abi, old)) => {
            let old = staging.join(format!("abi{abi}-{old}"));
            fs::rename(&old, &new).map_err(io_err("moving the migration marker to", &new))
        }
        None => fs::create_dir(&new).map_err(io_err("creating the migration marker", &new)),
    }
}

/// A start found the staging directory: roll back or resume.
fn resume_or_roll_back(pin_path: &Path) -> Result<(), LoadError> {
    let staging = pin_path.join(STAGING_DIR);
    let marker = read_marker(&staging);
    match marker.as_ref().map(|(a, s)| (*a, s.as_str())) {
        None | Some((_, "staged" | "filled")) => {
            warn!(
                state = ?marker,
                "an interrupted layout migration had not swapped any hook: rolling back \
                 (the old programs kept serving)"
            );
            fs::remove_dir_all(&staging).map_err(io_err("removing", &staging))
        }
        Some((from, state)) => {
            warn!(
                from_abi = from,
                state, "resuming an interrupted layout migration"
            );
            let mut m = Migration::new(pin_path, from);
            m.run_from(state, None)
        }
    }
}

/// Migrates the pinned maps of ABI `from` to this build's layout (see the module doc).
fn migrate(pin_path: &Path, from: u32) -> Result<(), LoadError> {
    let started = std::time::Instant::now();
    let mut m = Migration::new(pin_path, from);
    fs::create_dir(&m.staging).map_err(io_err("creating", &m.staging))?;
    set_marker(&m.staging, from, "staged")?;
    let ct_entries = map_info_at(&pin_path.join(map_names::CT4))
        .map(|i| i.max_entries)
        .unwrap_or(crate::loader::DEFAULT_CONNTRACK_FLOWS * 2);
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(&m.staging)
        .map_max_entries(map_names::CT4, ct_entries)
        .map_max_entries(map_names::CT6, ct_entries)
        .load(EBPF_OBJECT)?;
    if m.share_unchanged()? > 0 {
        // Load again: the programs must reference the shared maps.
        drop(ebpf);
        ebpf = EbpfLoader::new()
            .default_map_pin_directory(&m.staging)
            .load(EBPF_OBJECT)?;
    }
    crash_point("staged");
    m.copy_all(false)?;
    set_marker(&m.staging, from, "filled")?;
    crash_point("filled");
    m.run_from("filled", Some(&mut ebpf))?;
    info!(
        from_abi = from,
        to_abi = ABI_VERSION,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "layout migration done"
    );
    Ok(())
}

fn map_info_at(path: &Path) -> io::Result<sys::MapInfo> {
    let fd = sys::obj_get(path)?;
    sys::map_info(fd.as_fd())
}

/// What one map's copy did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyCount {
    /// Entries written to the new map.
    pub copied: u64,
    /// Entries skipped because the new map had them already (insert-if-absent).
    pub present: u64,
    /// Entries that could not be converted.
    pub dropped: u64,
}

struct Migration {
    pin_path: PathBuf,
    staging: PathBuf,
    from: u32,
}

impl Migration {
    fn new(pin_path: &Path, from: u32) -> Self {
        Self {
            pin_path: pin_path.to_owned(),
            staging: pin_path.join(STAGING_DIR),
            from,
        }
    }

    /// Maps whose layout did not change (same type, key and value sizes, flags and size;
    /// no conversion) are not copied but shared: the old map is pinned in the staging
    /// directory in place of the new one, so old and new programs see the same entries
    /// (conntrack above all) while the hooks change programs. Returns how many.
    fn share_unchanged(&self) -> Result<usize, LoadError> {
        if force_mode() == Some(Force::Copy) {
            return Ok(0);
        }
        let mut shared = Vec::new();
        for name in self.staged_maps()? {
            if name == map_names::META || !matches!(converter(self.from, &name), Convert::Bytes) {
                continue;
            }
            let (old, new) = (self.pin_path.join(&name), self.staging.join(&name));
            let Ok(old_fd) = sys::obj_get(&old) else {
                continue;
            };
            let oi = sys::map_info(old_fd.as_fd()).map_err(io_err("reading", &old))?;
            let ni = map_info_at(&new).map_err(io_err("reading", &new))?;
            let sized_at_load = name == map_names::CT4 || name == map_names::CT6;
            let same = oi.map_type == ni.map_type
                && oi.key_size == ni.key_size
                && oi.value_size == ni.value_size
                && oi.map_flags == ni.map_flags
                && (oi.max_entries == ni.max_entries || sized_at_load);
            if same {
                fs::remove_file(&new).map_err(io_err("unpinning", &new))?;
                sys::obj_pin(old_fd.as_fd(), &new).map_err(io_err("pinning", &new))?;
                shared.push(name);
            }
        }
        info!(
            ?shared,
            "maps of an unchanged layout are shared, not copied"
        );
        Ok(shared.len())
    }

    /// The maps staged (pinned) in the staging directory: the new layout's set.
    fn staged_maps(&self) -> Result<Vec<String>, LoadError> {
        let mut names = Vec::new();
        for e in fs::read_dir(&self.staging).map_err(io_err("listing", &self.staging))? {
            let e = e.map_err(io_err("listing", &self.staging))?;
            if e.file_type().is_ok_and(|t| t.is_file()) {
                names.push(e.file_name().to_string_lossy().into_owned());
            }
        }
        names.sort();
        Ok(names)
    }

    /// Copies every old map into its staged counterpart (`only_datapath`: just the maps
    /// the programs write, insert-if-absent). `META` is never copied: the new one is
    /// written here.
    fn copy_all(&mut self, only_datapath: bool) -> Result<(), LoadError> {
        let staged = self.staged_maps()?;
        let mut total = CopyCount::default();
        for name in &staged {
            if name == map_names::META {
                continue;
            }
            if only_datapath && !DATAPATH_WRITTEN.contains(&name.as_str()) {
                continue;
            }
            let old = self.pin_path.join(name);
            if !old.exists() {
                if !only_datapath {
                    info!(map = %name, "new map in this layout: starts empty");
                }
                continue;
            }
            let shared = match (map_info_at(&old), map_info_at(&self.staging.join(name))) {
                (Ok(a), Ok(b)) => a.id == b.id,
                _ => false,
            };
            if shared {
                continue;
            }
            let conv = converter(self.from, name);
            let count = copy_map(&old, &self.staging.join(name), conv, only_datapath)
                .map_err(io_err("copying the entries of", &old))?;
            if count.dropped > 0 {
                let why = match conv {
                    Convert::Drop(why) => why,
                    Convert::With(_) => "the converter refused them",
                    Convert::Bytes => "the layout changed and no converter exists",
                };
                warn!(map = %name, entries = count.dropped, why, "entries not converted");
            }
            tracing::debug!(map = %name, ?count, only_datapath, "copied");
            total.copied += count.copied;
            total.present += count.present;
            total.dropped += count.dropped;
        }
        if !only_datapath {
            // Maps of the old layout that this one no longer has.
            for name in self.old_only_maps() {
                let entries = count_entries(&self.pin_path.join(&name)).unwrap_or(0);
                warn!(
                    map = %name,
                    entries,
                    "not converted: this layout has no such map (removed after the swap)"
                );
                total.dropped += entries;
            }
            let meta_path = self.staging.join(map_names::META);
            let meta = sys::obj_get(&meta_path).map_err(io_err("opening", &meta_path))?;
            write_meta(meta.as_fd(), meta::ABI_VERSION, ABI_VERSION, &self.staging)?;
            write_meta(
                meta.as_fd(),
                meta::OBJECT_HASH,
                object_hash(),
                &self.staging,
            )?;
        }
        info!(
            from_abi = self.from,
            copied = total.copied,
            already_present = total.present,
            not_converted = total.dropped,
            pass = if only_datapath {
                "datapath-written"
            } else {
                "full"
            },
            "copied the pinned maps into the new layout"
        );
        Ok(())
    }

    /// Old pins (maps of the previous layouts) that this build has no more
    /// (`map_names::ALL` is this build's set).
    fn old_only_maps(&self) -> Vec<String> {
        v3::MAP_NAMES
            .iter()
            .filter(|n| !map_names::ALL.contains(n))
            .filter(|n| self.pin_path.join(n).is_file())
            .map(|n| n.to_string())
            .collect()
    }

    /// Runs the migration on from the state `state` (a marker's), with the new object
    /// already loaded against the staging maps when given.
    fn run_from(&mut self, state: &str, ebpf: Option<&mut aya::Ebpf>) -> Result<(), LoadError> {
        let from = self.from;
        let order = [
            "filled", "swapping", "swapped", "recopied", "renaming", "meta",
        ];
        let at = order.iter().position(|s| *s == state).ok_or_else(|| {
            io_err("reading the migration marker in", &self.staging)(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unknown migration state {state:?}"),
            ))
        })?;
        if at <= 1 {
            let mut loaded;
            let ebpf = match ebpf {
                Some(e) => e,
                None => {
                    // Resuming: the staged maps are all still in the staging directory.
                    loaded = EbpfLoader::new()
                        .default_map_pin_directory(&self.staging)
                        .load(EBPF_OBJECT)?;
                    &mut loaded
                }
            };
            let hooks = pinned_hooks(&self.pin_path)?;
            // Right before the swap (programs loaded): the flows opened since the full
            // copy, to narrow the window in which the old programs write alone.
            let pin_path = self.pin_path.clone();
            let log_id = swap_hooks(ebpf, &pin_path, &hooks, true, &mut || {
                self.copy_all(true)?;
                set_marker(&self.staging, from, "swapping")
            })?;
            if let Some(id) = log_id {
                let meta_path = self.staging.join(map_names::META);
                let meta = sys::obj_get(&meta_path).map_err(io_err("opening", &meta_path))?;
                write_meta(meta.as_fd(), meta::LOG_PROGRAM_ID, id, &self.staging)?;
            }
            info!(
                hooks = hooks.len(),
                "swapped every hook to the new programs"
            );
            set_marker(&self.staging, from, "swapped")?;
            crash_point("swapped");
        }
        if at <= 2 {
            // What the old programs wrote until the swap.
            self.copy_all(true)?;
            set_marker(&self.staging, from, "recopied")?;
            crash_point("recopied");
        }
        if at <= 4 {
            set_marker(&self.staging, from, "renaming")?;
            let staged = self.staged_maps()?;
            let mut first = true;
            for name in staged.iter().filter(|n| *n != map_names::META) {
                self.move_pin(name)?;
                if first {
                    crash_point("rename-first");
                    first = false;
                }
            }
            // META last: until here the pin directory still reads as the old ABI.
            if staged.iter().any(|n| n == map_names::META) {
                self.move_pin(map_names::META)?;
            }
            set_marker(&self.staging, from, "meta")?;
            crash_point("meta");
        }
        for name in self.old_only_maps() {
            let path = self.pin_path.join(&name);
            fs::remove_file(&path).map_err(io_err("unpinning", &path))?;
            info!(map = %name, "removed the old layout's map");
        }
        fs::remove_dir_all(&self.staging).map_err(io_err("removing", &self.staging))?;
        Ok(())
    }

    /// `rename(2)` of a staged pin over the old one (atomic; the old map goes when its
    /// last program does).
    fn move_pin(&self, name: &str) -> Result<(), LoadError> {
        let to = self.pin_path.join(name);
        fs::rename(self.staging.join(name), &to).map_err(io_err("moving the staged pin to", &to))
    }
}

/// Entries in the map pinned at `path`.
fn count_entries(path: &Path) -> io::Result<u64> {
    let fd = sys::obj_get(path)?;
    let info = sys::map_info(fd.as_fd())?;
    let mut key = vec![0u8; info.key_size as usize];
    let mut next = key.clone();
    let mut n = 0u64;
    let mut have = false;
    while sys::next_key(fd.as_fd(), have.then_some(&key[..]), &mut next)? {
        n += 1;
        std::mem::swap(&mut key, &mut next);
        have = true;
        if n > u64::from(info.max_entries) * 2 + 16 {
            break;
        }
    }
    Ok(n)
}

/// Copies the entries of the map pinned at `old` into the one pinned at `new`, through
/// `conv`. `only_absent`: insert-if-absent (hash maps), for the copies around the swap.
pub fn copy_map(old: &Path, new: &Path, conv: Convert, only_absent: bool) -> io::Result<CopyCount> {
    let old_fd = sys::obj_get(old)?;
    let new_fd = sys::obj_get(new)?;
    let oi = sys::map_info(old_fd.as_fd())?;
    let ni = sys::map_info(new_fd.as_fd())?;
    let mut count = CopyCount::default();
    let mut key = vec![0u8; oi.key_size as usize];
    let mut next = key.clone();
    let mut value = vec![0u8; oi.value_buf_len()?];
    let same_shape =
        oi.map_type == ni.map_type && oi.key_size == ni.key_size && oi.value_size == ni.value_size;
    let is_array =
        oi.map_type == sys::map_type::ARRAY || oi.map_type == sys::map_type::PERCPU_ARRAY;
    let flags = if only_absent && !is_array {
        sys::NOEXIST
    } else {
        sys::ANY
    };
    let mut have = false;
    // LRU maps restart a walk whose key was evicted: bound the walk.
    let limit = u64::from(oi.max_entries) * 2 + 16;
    let mut steps = 0u64;
    while sys::next_key(old_fd.as_fd(), have.then_some(&key[..]), &mut next)? {
        std::mem::swap(&mut key, &mut next);
        have = true;
        steps += 1;
        if steps > limit {
            break;
        }
        if !sys::lookup(old_fd.as_fd(), &key, &mut value)? {
            continue; // gone meanwhile
        }
        let written = match conv {
            Convert::Bytes if same_shape => sys::update(new_fd.as_fd(), &key, &value, flags)?,
            Convert::Bytes | Convert::Drop(_) => {
                count.dropped += 1;
                continue;
            }
            Convert::With(f) => match f(&key, &value) {
                Some((k, v)) => sys::update(new_fd.as_fd(), &k, &v, flags)?,
                None => {
                    count.dropped += 1;
                    continue;
                }
            },
        };
        if written {
            count.copied += 1;
        } else {
            count.present += 1;
        }
    }
    Ok(count)
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
    fn crash_steps_are_unique_and_bpffs_safe() {
        for (i, s) in STEPS.iter().enumerate() {
            assert!(!s.contains('.') && !s.contains('/'), "{s}");
            assert!(!STEPS[i + 1..].contains(s), "{s}");
        }
    }

    #[test]
    fn abi3_struct_maps_have_a_conversion_function() {
        // Counters, node addresses/config and source ranges hold plain integers; the other
        // ABI-3 maps hold structs and have a field-by-field conversion function.
        let plain = [
            "STATS",
            "BACKEND_CONNS",
            "NODE_ADDRS4",
            "NODE_ADDRS6",
            "NODE_CONFIG",
            "SRC_RANGE4",
            "SRC_RANGE6",
            "META",
        ];
        for name in v3::MAP_NAMES {
            assert_eq!(v3::convert(name).is_none(), plain.contains(&name), "{name}");
        }
        assert_ne!(object_hash(), 0);
    }
}
