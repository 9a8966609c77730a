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
//!    conntrack table stays one while the hooks change programs); socket storage
//!    (`SOCK_REVNAT4/6`) is always shared, as user space cannot copy it, and a map an
//!    older layout keeps under another name is pinned there as it is
//!    ([`rules::kept_maps`]: ABI 3's socket reverse-NAT LRUs become `SOCK_REVNAT4/6_V3`,
//!    which the new `recvmsg`/`getpeername` read for sockets the old programs translated);
//! 2. `filled`: every entry of the other maps is copied from the old ones
//!    ([`converter`]: a conversion function, or bytes; what cannot be converted is named
//!    and counted in the log);
//! 3. `swapping` .. `swapped`: the new programs are loaded against the staging maps, the
//!    entries the old programs wrote meanwhile are copied (insert-if-absent), and every
//!    hook is swapped to the new programs;
//! 4. `recopied`: the flows the old programs created until the swap are copied again
//!    (insert-if-absent: conntrack, affinity);
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
//! **Another size ([`prepare_sized`]).** The maps sized to demand ([`SizedMap`]: `CT4/6`,
//! `SVC4/6`, `BACKEND4/6`, `BACKEND_CONNS`, `REVNAT4/6`, `AFFINITY`, `MAGLEV`,
//! `SVC_COUNTERS`, `BACKEND_COUNTERS`; one [`Sizes`] table) whose pinned `max_entries` is
//! not the wanted one (`--conntrack-max`, `--service-map-entries`, a start size,
//! `--metrics-per-service` turned on) take the same staged migration at the same ABI: the
//! staging maps are created at the new sizes, so the resized maps are copied (not
//! shared), the others shared; the same marker and crash recovery. A shrink below the
//! entries in use is refused (warning, that kind's size kept). The copies around the swap
//! are insert-if-absent, except that a conntrack entry the new programs made with another
//! translation than the old table's is overwritten by the old one ([`copy_map`]). While
//! the agent runs, [`resize_conntrack`] takes the same path for `CT4/6` alone
//! (`crate::ctsize` decides when), every other map shared, and [`resize_maps`] for the
//! service-side kinds that need it, all in ONE migration (the writer, before a sync whose
//! writes would pass their high-water mark, or between syncs for the kinds long under
//! their low-water mark, shrunk: it writes nothing meanwhile, then reopens its handles);
//! one at a time.
//!
//! **No flow lost around a conntrack resize.** The copies alone leave two windows: a flow
//! the old programs open after the copy before the swap, whose next packet a new program
//! handles before the copy after it (a TCP handshake's ACK balanced again: another backend
//! or SNAT port, a reset), and the hooks swapped one after another (a reply on a swapped
//! hook whose flow an unswapped one just opened). So the running `CT4/6` are pinned in the
//! staging directory as `CT4_PREV/CT6_PREV` and the new programs are loaded with the
//! `CT_FALLBACK` global set: a miss in the new table is looked up in the old one and the
//! entry found is moved into the new table. After the renames (the old tables get no more
//! writes once every hook is swapped, and the copy after the swap has carried them over)
//! the hooks are swapped once more, to programs loaded without the fallback against fresh
//! 1-entry `CT*_PREV`, which releases the old tables' memory. A crash at any step leaves
//! programs whose maps are complete (the fallback covers what a copy had not reached);
//! the next start resumes, and that last swap is part of every resumed resize.
//!
//! **A failed online resize** ([`resize_conntrack`], [`resize_service`], [`resize_maps`]:
//! a map the kernel would not allocate, a program load refused) is settled at once by the
//! running agent, as a start would: rolled back before any hook was swapped (the resize
//! returns the error), finished after (the resize is done: it returns the maps resized);
//! a staging directory left behind would refuse every later resize until a restart.
//!
//! Test hooks: `EBPF_PROXY_MIGRATE_CRASH_AT=<step>` makes the process `abort()` right
//! after that step ([`STEPS`]); `EBPF_PROXY_MIGRATE_FAIL_AT=<step>` makes the process's
//! first migration fail there with an error ([`FAIL_ENV`]); `EBPF_PROXY_MIGRATE_FORCE=1` runs the full staged
//! migration instead of the program swap when the layout is the same but the build
//! differs (so that the migration can be tested before a layout change exists;
//! `EBPF_PROXY_MIGRATE_FORCE=copy` converts every map through its [`v3`] function, as if
//! every layout had changed, sharing only what user space cannot copy: socket storage
//! and the kept maps); `EBPF_PROXY_MIGRATE_SWAP_PAUSE_MS=<ms>` pauses a migration's swap
//! after each hook but the last ([`SWAP_PAUSE_ENV`]: old and new programs side by side on
//! the hooks, for a test of the flows that cross them).

mod copy;
mod hooks;
mod preshare;
mod rules;
mod state;
pub mod v3;

use proxy_common::{map_names, meta, Reason, ABI_VERSION};
use tracing::{info, warn};

pub use crate::loader::{SizedMap, Sizes};
use crate::{
    loader::{self, LoadError, EBPF_OBJECT},
    pins::{Access, PinDir},
};

/// The staging directory inside the pin directory.
pub use crate::loader::{object_hash, MIGRATE_STAGING_DIR as STAGING_DIR};

pub use copy::{copy_map, Convert, ConvertFn, CopyCount};
use hooks::replace_programs;
use state::{migrate, resume_or_roll_back, Settled};

use rules::force_mode;
pub use rules::{converter, CRASH_ENV, FAIL_ENV, FORCE_ENV, OLDEST_ABI, STEPS, SWAP_PAUSE_ENV};

/// [`loader::install`] after [`prepare`]: what `proxy-agent run` and `install` call, so a
/// node's pinned datapath is upgraded (or an interrupted upgrade finished) before it is
/// adopted.
pub fn install(opts: &loader::InstallOptions) -> Result<loader::InstallReport, LoadError> {
    let pins = PinDir::new(&opts.pin_path);
    // Without sizes for the other maps: their pinned sizes are kept.
    let sizes = opts
        .map_sizes
        .unwrap_or_else(|| Sizes::pinned_or(&pins, Sizes::compiled()))
        .with(
            SizedMap::Conntrack,
            loader::conntrack_entries(opts.conntrack_flows)?,
        )
        .with(
            SizedMap::Service,
            loader::service_entries(opts.service_entries)?,
        );
    let resized = prepare_sized(&pins, Some(sizes))?;
    let mut report = loader::install(opts)?;
    report.resized = resized;
    Ok(report)
}

/// A pinned map whose `max_entries` is not the wanted one: `(map, pinned, wanted)`.
/// A shrink below the entries in use is not a resize: it is refused with a warning and
/// the pinned size kept in `sizes` (copying would drop entries: flows evicted, frontends
/// lost); the other kinds are still resized.
fn resizes(pins: &PinDir, sizes: &mut Sizes) -> Result<Vec<loader::MapResize>, LoadError> {
    let mut out = Vec::new();
    'kinds: for kind in SizedMap::ALL {
        let wanted = sizes.get(kind);
        let mut of_kind = Vec::new();
        for &name in kind.maps() {
            let Some(pinned) = pins.max_entries(name) else {
                continue;
            };
            if pinned == wanted {
                continue;
            }
            if wanted < pinned {
                // Conntrack: its live flows (expired entries are not copied).
                let used = if kind == SizedMap::Conntrack {
                    crate::ctsize::live_entries(pins, name)
                } else {
                    copy::count_entries(pins, name)
                };
                let used = used.map_err(|source| LoadError::Io {
                    what: "counting the entries of",
                    path: pins.map_path(name),
                    source,
                })?;
                if used > u64::from(wanted) {
                    warn!(
                        map = name,
                        pinned_entries = pinned,
                        wanted_entries = wanted,
                        entries_in_use = used,
                        ceiling = kind.ceiling_name(),
                        "not shrinking the pinned map: it holds more entries than the new \
                         size (they would be lost); keeping its size"
                    );
                    if let Some(first) = pins.max_entries(kind.maps()[0]) {
                        sizes.set(kind, first);
                    }
                    continue 'kinds;
                }
            }
            of_kind.push(loader::MapResize {
                map: name,
                from: pinned,
                to: wanted,
            });
        }
        out.extend(of_kind);
    }
    Ok(out)
}

/// Before `install` reads `META`: finishes or rolls back an interrupted migration,
/// migrates an older layout, or swaps the programs of another build in.
pub fn prepare(pins: &PinDir) -> Result<(), LoadError> {
    prepare_sized(pins, None).map(drop)
}

/// An interrupted migration (a crash in a resize or an upgrade) finished or rolled back
/// now, before a start reads the pinned sizes ([`prepare_sized`] settles it too, but
/// after the caller took its sizes from the maps of before the resume: a finished shrink
/// or growth would then be resized back, and again by the running agent).
pub fn settle_interrupted(pins: &PinDir) -> Result<(), LoadError> {
    if EBPF_OBJECT.is_empty() || !pins.staging().path().exists() {
        return Ok(());
    }
    resume_or_roll_back(pins).map(drop)
}

/// [`prepare`], and pinned maps whose size is not `sizes` (a changed `--conntrack-max`
/// or `--service-map-entries`) resized online: the staged migration at the same ABI
/// into maps of the new sizes (entries copied, insert-if-absent around the program
/// swap), with the same marker and crash recovery as a layout migration. Returns the
/// maps resized (none when a crashed resize was only finished or rolled back).
pub fn prepare_sized(
    pins: &PinDir,
    sizes: Option<Sizes>,
) -> Result<Vec<loader::MapResize>, LoadError> {
    if EBPF_OBJECT.is_empty() {
        return Ok(Vec::new());
    }
    if pins.staging().path().exists() {
        resume_or_roll_back(pins)?;
    }
    if !pins.has_maps() {
        return Ok(Vec::new());
    }
    let found = pins.abi_version(Access::ReadOnly)?;
    if found != ABI_VERSION {
        if (OLDEST_ABI..ABI_VERSION).contains(&found) {
            return migrate(pins, found, sizes).map(|()| Vec::new());
        }
        // Refused by install with a clear error.
        return Ok(Vec::new());
    }
    if let Some(mut sizes) = sizes {
        let resized = resizes(pins, &mut sizes)?;
        if !resized.is_empty() {
            for r in &resized {
                info!(
                    map = r.map,
                    pinned_entries = r.from,
                    wanted_entries = r.to,
                    "resizing the pinned map online (staged migration: copied, programs \
                     swapped, copied again)"
                );
            }
            migrate(pins, found, Some(sizes))?;
            return Ok(resized);
        }
    }
    let pinned_hash = pins.read_meta(meta::OBJECT_HASH, Access::ReadOnly)?;
    if pinned_hash == object_hash() {
        return Ok(Vec::new());
    }
    if let Some(mode) = force_mode() {
        warn!(
            ?mode,
            "{FORCE_ENV}: migrating through the staging directory at the same ABI"
        );
        return migrate(pins, found, sizes).map(|()| Vec::new());
    }
    if let Some((map, pinned)) = type_changed(pins)? {
        info!(
            map,
            pinned_type = pinned,
            "a pinned map is of another type than this build's (backends: hash maps before \
             they were arrays): migrating through the staging directory (its entries are \
             copied)"
        );
        return migrate(pins, found, sizes).map(|()| Vec::new());
    }
    if let Some((map, pinned)) = counters_grew(pins)? {
        info!(
            map,
            pinned,
            wanted = Reason::COUNT,
            "this build counts more outcomes than the pinned counter array holds: \
             migrating through the staging directory (the counters are copied)"
        );
        return migrate(pins, found, sizes).map(|()| Vec::new());
    }
    replace_programs(pins, pinned_hash).map(|()| Vec::new())
}

/// Online conntrack growth while the agent runs (`crate::ctsize`): `CT4`/`CT6` resized
/// to `entries` each by the staged migration at this ABI, every other map shared (the
/// service maps keep their pinned size, so the writer's map fds stay the maps in use).
/// The datapath-written maps are copied, insert-if-absent, before and after the program
/// swap; the same marker and crash recovery as at a start. Returns the maps resized
/// (none when they already have that size; a shrink below the flows tracked is refused
/// with a warning, as at a start). Refused while another migration is under way (its
/// staging directory exists: the next start finishes or rolls it back).
pub fn resize_conntrack(pins: &PinDir, entries: u32) -> Result<Vec<loader::MapResize>, LoadError> {
    resize_online(pins, &[(SizedMap::Conntrack, entries)])
}

/// Online service-map growth while the agent runs: `SVC4`/`SVC6` resized to `entries`
/// each ([`resize_maps`]).
pub fn resize_service(pins: &PinDir, entries: u32) -> Result<Vec<loader::MapResize>, LoadError> {
    resize_online(pins, &[(SizedMap::Service, entries)])
}

/// Online growth of maps sized to demand while the agent runs (the writer, before a sync
/// whose writes would pass their high-water mark: `crate::writer`), or shrink (the
/// agent's writer task between syncs, kinds long under their low-water mark:
/// `agent::shrink`): every kind of
/// `to` resized to its entries in ONE staged migration, like [`resize_conntrack`], every
/// other map shared (conntrack keeps its pinned size unless named). The caller is the
/// service-side maps' only writer and writes nothing meanwhile, so the copy before the
/// swap carries every frontend and backend (the datapath-written maps are copied again
/// after the swap); then it reopens its handles on the new maps. Same refusals and crash
/// recovery as [`resize_conntrack`].
pub fn resize_maps(
    pins: &PinDir,
    to: &[(SizedMap, u32)],
) -> Result<Vec<loader::MapResize>, LoadError> {
    resize_online(pins, to)
}

/// One online resize at a time (conntrack's sampler and the writer both resize; each
/// migration uses the one staging directory).
static ONLINE_RESIZE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Online resizes done by this process: whoever follows the programs (the kernel
/// logger) sees a change here.
static ONLINE_RESIZES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many online resizes ([`resize_conntrack`], [`resize_maps`]) loaded new programs
/// so far.
pub fn online_resizes() -> u64 {
    ONLINE_RESIZES.load(std::sync::atomic::Ordering::Acquire)
}

/// What an online resize does, for its log lines and errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Online {
    Conntrack,
    Grow,
    Shrink,
    Resize,
}

impl Online {
    /// The kinds of `to` against their pinned sizes: conntrack alone, every other kind
    /// larger (grown), every one smaller (shrunk), or some of each.
    fn of(pins: &PinDir, to: &[(SizedMap, u32)]) -> Self {
        if to.iter().all(|(k, _)| *k == SizedMap::Conntrack) {
            return Online::Conntrack;
        }
        let pinned = |k: SizedMap| pins.max_entries(k.maps()[0]).unwrap_or(0);
        if to.iter().all(|&(k, n)| n >= pinned(k)) {
            Online::Grow
        } else if to.iter().all(|&(k, n)| n <= pinned(k)) {
            Online::Shrink
        } else {
            Online::Resize
        }
    }

    fn what(self) -> &'static str {
        match self {
            Online::Conntrack => "resizing conntrack",
            Online::Grow => "growing the service maps",
            Online::Shrink => "shrinking the service maps",
            Online::Resize => "resizing the service maps",
        }
    }

    fn busy(self) -> &'static str {
        match self {
            Online::Conntrack => "resizing conntrack: another migration is under way in",
            Online::Grow => "growing the service maps: another migration is under way in",
            Online::Shrink => "shrinking the service maps: another migration is under way in",
            Online::Resize => "resizing the service maps: another migration is under way in",
        }
    }

    fn other_abi(self) -> &'static str {
        match self {
            Online::Conntrack => "resizing conntrack: the pinned maps are of another ABI in",
            Online::Grow => "growing the service maps: the pinned maps are of another ABI in",
            Online::Shrink => "shrinking the service maps: the pinned maps are of another ABI in",
            Online::Resize => "resizing the service maps: the pinned maps are of another ABI in",
        }
    }
}

/// The staged migration at this ABI into the pinned sizes with the kinds of `to` changed.
/// A migration that fails and is then finished by [`settle_failed`] (it failed after a
/// hook was swapped) is a resize done: `Ok`, counted as one; rolled back (or not
/// settled), the error.
fn resize_online(
    pins: &PinDir,
    to: &[(SizedMap, u32)],
) -> Result<Vec<loader::MapResize>, LoadError> {
    if EBPF_OBJECT.is_empty() || !pins.has_maps() {
        return Ok(Vec::new());
    }
    let _one = ONLINE_RESIZE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let online = Online::of(pins, to);
    let staging = pins.staging();
    if staging.path().exists() {
        return Err(LoadError::Io {
            what: online.busy(),
            path: staging.path().to_path_buf(),
            source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        });
    }
    let found = pins.abi_version(Access::ReadOnly)?;
    if found != ABI_VERSION {
        return Err(LoadError::Io {
            what: online.other_abi(),
            path: pins.path().to_path_buf(),
            source: std::io::Error::from(std::io::ErrorKind::InvalidData),
        });
    }
    let mut sizes = Sizes::pinned_or(pins, Sizes::compiled());
    for (kind, entries) in to {
        sizes.set(*kind, *entries);
    }
    let resized = resizes(pins, &mut sizes)?;
    if resized.is_empty() {
        return Ok(resized);
    }
    for r in &resized {
        info!(
            map = r.map,
            pinned_entries = r.from,
            wanted_entries = r.to,
            "resizing the pinned map online while serving (staged migration: copied, \
             programs swapped, copied again)"
        );
    }
    if let Err(e) = migrate(pins, ABI_VERSION, Some(sizes)) {
        if settle_failed(pins, online.what(), &e) != Some(Settled::Finished) {
            return Err(e);
        }
        info!(
            error = %e,
            "{}: the migration failed after a hook was swapped and was finished: the \
             maps are resized",
            online.what()
        );
    }
    ONLINE_RESIZES.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    Ok(resized)
}

/// A failed online resize (a map the kernel would not allocate, a program load refused)
/// is rolled back at once, or finished when it failed after a hook was swapped, as the
/// next start would do: left as it was, its staging directory would refuse every later
/// resize until a restart. The programs may have changed: whoever follows them is told
/// (a roll-back counts here; a finished resize is counted by the caller as a resize).
/// Returns how it was settled (`None`: nothing to settle, or settling failed too).
fn settle_failed(pins: &PinDir, what: &'static str, error: &LoadError) -> Option<Settled> {
    if !pins.staging().path().exists() {
        return None;
    }
    warn!(%error, "{what} failed: rolling the resize back (or finishing it) now");
    match resume_or_roll_back(pins) {
        Ok(Settled::RolledBack) => {
            ONLINE_RESIZES.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            Some(Settled::RolledBack)
        }
        Ok(Settled::Finished) => Some(Settled::Finished),
        Err(e) => {
            warn!(
                error = %e,
                "{what}: settling the failed resize failed too; the next start will"
            );
            ONLINE_RESIZES.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            None
        }
    }
}

/// A pinned outcome-counter array (`STATS`, `XDP_STATS`: one entry per [`Reason`]) smaller
/// than this build's `Reason::COUNT`: new reasons are added within an ABI (a new counter
/// is not a layout change for the other maps), but a program swap keeps the pinned
/// array, where the new reasons' counts would be lost and readers would fail. Such pins
/// take the staged migration, which copies the counters into arrays of the new size.
fn counters_grew(pins: &PinDir) -> Result<Option<(&'static str, u32)>, LoadError> {
    for name in [map_names::STATS, map_names::XDP_STATS] {
        if !pins.map_path(name).exists() {
            continue;
        }
        let entries = pins.map_info(name)?.max_entries;
        if entries < Reason::COUNT {
            return Ok(Some((name, entries)));
        }
    }
    Ok(None)
}

/// The maps this build made arrays within ABI 4 (`BACKEND4/6`, hash maps before): pins
/// of such a map as another type (an earlier build of this ABI) take the staged
/// migration, which copies the entries into arrays; a program swap would keep the hash
/// maps, which the writer no longer opens. `(map, its pinned type)`.
fn type_changed(pins: &PinDir) -> Result<Option<(&'static str, u32)>, LoadError> {
    for name in [map_names::BACKEND4, map_names::BACKEND6] {
        if !pins.map_path(name).exists() {
            continue;
        }
        let t = pins.map_info(name)?.map_type;
        if t != bpf_sys::map_type::ARRAY {
            return Ok(Some((name, t)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

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
