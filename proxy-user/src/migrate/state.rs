//! Another layout: the staged migration's marker and steps, resumed or rolled back after
//! a crash (the module doc of `migrate` has the steps).

use std::{fs, io, os::fd::AsFd};

use aya::EbpfLoader;
use proxy_common::{map_names, meta, ABI_VERSION};
use tracing::{info, warn};

use super::{
    copy::{copy_map, count_entries, Convert, CopyCount},
    hooks::{pinned_hooks, swap_hooks},
    rules::{
        converter, crash_point, force_mode, io_err, kept_as, kept_maps, Force, DATAPATH_WRITTEN,
        PREVIOUS_CT,
    },
    v3, SizedMap, Sizes,
};
use crate::{
    loader::{object_hash, LoadError, CT_FALLBACK_GLOBAL, EBPF_OBJECT},
    pins::{Access, PinDir},
};

/// Whether the staging directory holds a replaced conntrack table
/// (`Migration::keep_previous_conntrack`): the staged programs then need the fallback.
fn previous_conntrack_kept(staging: &PinDir) -> bool {
    PREVIOUS_CT
        .iter()
        .any(|(prev, _)| staging.max_entries(prev).is_some_and(|n| n > 1))
}

/// The new object loaded against the staging directory's maps, with the conntrack
/// fallback (`loader::CT_FALLBACK_GLOBAL`) on for a conntrack resize.
fn load_staged(staging: &PinDir, fallback: bool) -> Result<aya::Ebpf, LoadError> {
    let mut loader = EbpfLoader::new();
    loader.default_map_pin_directory(staging.path());
    if fallback {
        loader.override_global(CT_FALLBACK_GLOBAL, &1u8, true);
    }
    Ok(loader.load(EBPF_OBJECT)?)
}

/// The migration's marker: `<staging>/abi<from>-<state>`.
pub(super) fn read_marker(staging: &PinDir) -> Option<(u32, String)> {
    let entries = fs::read_dir(staging.path()).ok()?;
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

pub(super) fn set_marker(staging: &PinDir, from: u32, state: &str) -> Result<(), LoadError> {
    let new = staging.path().join(format!("abi{from}-{state}"));
    match read_marker(staging) {
        Some((abi, old)) => {
            let old = staging.path().join(format!("abi{abi}-{old}"));
            fs::rename(&old, &new).map_err(io_err("moving the migration marker to", &new))
        }
        None => fs::create_dir(&new).map_err(io_err("creating the migration marker", &new)),
    }
}

/// How an interrupted migration was settled ([`resume_or_roll_back`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Settled {
    /// No hook ran a new program: the staging directory removed, the old maps serve.
    RolledBack,
    /// Resumed and finished: the new maps serve.
    Finished,
}

/// A start found the staging directory: roll back or resume.
pub(super) fn resume_or_roll_back(pins: &PinDir) -> Result<Settled, LoadError> {
    let staging = pins.staging();
    let marker = read_marker(&staging);
    match marker.as_ref().map(|(a, s)| (*a, s.as_str())) {
        None | Some((_, "staged" | "filled")) => {
            warn!(
                state = ?marker,
                "an interrupted layout migration had not swapped any hook: rolling back \
                 (the old programs kept serving)"
            );
            fs::remove_dir_all(staging.path()).map_err(io_err("removing", staging.path()))?;
            Ok(Settled::RolledBack)
        }
        Some((from, state)) => {
            warn!(
                from_abi = from,
                state, "resuming an interrupted layout migration"
            );
            let mut m = Migration::new(pins, from);
            m.run_from(state, None)?;
            Ok(Settled::Finished)
        }
    }
}

/// Migrates the pinned maps of ABI `from` to this build's layout (see the module doc).
/// The maps sized to demand are created at `sizes` when given (a resize), else at the
/// pinned maps' sizes.
pub(super) fn migrate(pins: &PinDir, from: u32, sizes: Option<Sizes>) -> Result<(), LoadError> {
    let started = std::time::Instant::now();
    let mut m = Migration::new(pins, from);
    fs::create_dir(m.staging.path()).map_err(io_err("creating", m.staging.path()))?;
    set_marker(&m.staging, from, "staged")?;
    // Unless resized, each map keeps its pinned size (a map this layout adds: compiled).
    let sizes = sizes.unwrap_or_else(|| Sizes::pinned_or(pins, Sizes::compiled()));
    let sizes = super::copy::backend_room(pins, sizes);
    let pre_shared = super::preshare::pre_share(&m.pins, &m.staging, from, &sizes)?;
    let mut loader = EbpfLoader::new();
    loader.default_map_pin_directory(m.staging.path());
    for kind in SizedMap::ALL {
        for map in kind.maps() {
            loader.map_max_entries(map, sizes.get(kind));
        }
    }
    let mut ebpf = loader.load(EBPF_OBJECT)?;
    let shared = m.share_unchanged()?;
    let fallback = m.keep_previous_conntrack()?;
    info!(
        pre_shared,
        shared_after_load = shared,
        "staged layout loaded (maps shared after the load cost a second load)"
    );
    if shared > 0 || fallback {
        // Load again: the programs must reference the shared maps (and, for a conntrack
        // resize, look a miss up in the tables being replaced).
        drop(ebpf);
        ebpf = load_staged(&m.staging, fallback)?;
    }
    crash_point("staged")?;
    m.copy_all(false)?;
    set_marker(&m.staging, from, "filled")?;
    crash_point("filled")?;
    m.run_from("filled", Some(&mut ebpf))?;
    info!(
        from_abi = from,
        to_abi = ABI_VERSION,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "layout migration done"
    );
    Ok(())
}

pub(super) struct Migration {
    pins: PinDir,
    staging: PinDir,
    from: u32,
}

impl Migration {
    fn new(pins: &PinDir, from: u32) -> Self {
        Self {
            pins: pins.clone(),
            staging: pins.staging(),
            from,
        }
    }

    /// Maps whose layout did not change (same type, key and value sizes, flags and size;
    /// no conversion) are not copied but shared: the old map is pinned in the staging
    /// directory in place of the new one, so old and new programs see the same entries
    /// (conntrack above all) while the hooks change programs. Socket storage
    /// (`SK_STORAGE`) is shared even when every other map is copied (`copy` test mode):
    /// user space cannot copy it (an entry is reached only through its socket). The maps
    /// an older layout keeps under another name ([`kept_maps`]) are pinned there as they
    /// are. Returns how many.
    fn share_unchanged(&self) -> Result<usize, LoadError> {
        let copy_every = force_mode() == Some(Force::Copy);
        let mut shared = Vec::new();
        let kept = kept_maps(self.from);
        for (name, from_pin) in kept {
            let (old, new) = (self.pins.map_path(from_pin), self.staging.map_path(name));
            if !new.exists() {
                continue;
            }
            let Ok(old_fd) = self.pins.open_fd(from_pin, Access::ReadWrite) else {
                continue; // nothing to keep: the staged map starts empty
            };
            let oi = bpf_sys::map_info(old_fd.as_fd()).map_err(io_err("reading", &old))?;
            let ni = self.staging.map_info(name)?;
            if oi.id == ni.id {
                continue; // shared before the load (`pre_share`)
            }
            if (oi.map_type, oi.key_size, oi.value_size)
                != (ni.map_type, ni.key_size, ni.value_size)
            {
                warn!(
                    map = name,
                    from = from_pin,
                    "the older map to keep has another layout: not kept (starts empty)"
                );
                continue;
            }
            fs::remove_file(&new).map_err(io_err("unpinning", &new))?;
            self.staging
                .pin_map(name, old_fd.as_fd())
                .map_err(io_err("pinning", &new))?;
            info!(map = name, from = from_pin, "kept the older layout's map");
            shared.push(name.to_string());
        }
        for name in self.staged_maps()? {
            if name == map_names::META || kept.iter().any(|(k, _)| *k == name) {
                continue;
            }
            let (old, new) = (self.pins.map_path(&name), self.staging.map_path(&name));
            let Ok(old_fd) = self.pins.open_fd(&name, Access::ReadWrite) else {
                continue;
            };
            let oi = bpf_sys::map_info(old_fd.as_fd()).map_err(io_err("reading", &old))?;
            let ni = self.staging.map_info(&name)?;
            if oi.id == ni.id {
                continue; // shared before the load (`pre_share`)
            }
            // Socket storage and the events' ring buffer (`EVENTS`) have no keys to copy.
            let storage = matches!(
                ni.map_type,
                bpf_sys::map_type::SK_STORAGE | bpf_sys::map_type::RINGBUF
            );
            if !storage && (copy_every || !matches!(converter(self.from, &name), Convert::Bytes)) {
                continue;
            }
            // A map of another size (a resize: `--conntrack-max`, `--service-map-entries`)
            // is copied into the new one.
            let same = oi.map_type == ni.map_type
                && oi.key_size == ni.key_size
                && oi.value_size == ni.value_size
                && oi.map_flags == ni.map_flags
                && oi.max_entries == ni.max_entries;
            if same {
                fs::remove_file(&new).map_err(io_err("unpinning", &new))?;
                self.staging
                    .pin_map(&name, old_fd.as_fd())
                    .map_err(io_err("pinning", &new))?;
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
        let dir = self.staging.path();
        for e in fs::read_dir(dir).map_err(io_err("listing", dir))? {
            let e = e.map_err(io_err("listing", dir))?;
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
    // Long: one pass over every map of the layout: share, copy, convert or create, each arm
    // a few lines over the same staging state.
    fn copy_all(&mut self, only_datapath: bool) -> Result<(), LoadError> {
        let staged = self.staged_maps()?;
        let mut total = CopyCount::default();
        for name in &staged {
            if name == map_names::META || PREVIOUS_CT.iter().any(|(p, _)| p == name) {
                continue;
            }
            if only_datapath && !DATAPATH_WRITTEN.contains(&name.as_str()) {
                continue;
            }
            if kept_maps(self.from).iter().any(|(k, _)| k == name) {
                continue; // an older map itself, or empty (share_unchanged)
            }
            if let Some(as_name) = kept_as(self.from, name) {
                if !only_datapath {
                    info!(map = %name, kept_as = as_name, "not converted: kept as it is");
                }
                continue;
            }
            let old = self.pins.map_path(name);
            if !old.exists() {
                if !only_datapath {
                    info!(map = %name, "new map in this layout: starts empty");
                }
                continue;
            }
            let old_info = self.pins.map_info(name);
            let shared = match (&old_info, self.staging.map_info(name)) {
                (Ok(a), Ok(b)) => a.id == b.id,
                _ => false,
            };
            if shared {
                continue;
            }
            if old_info
                .as_ref()
                .is_ok_and(|i| i.map_type == bpf_sys::map_type::RINGBUF)
            {
                // `EVENTS`: records in flight to a monitor, no entries (the new ring buffer
                // starts empty when the old one could not be shared).
                continue;
            }
            if old_info.is_ok_and(|i| i.map_type == bpf_sys::map_type::SK_STORAGE) {
                // Not iterable from user space (the kernel refuses GET_NEXT_KEY): a
                // socket storage of another layout cannot be carried over from here.
                if !only_datapath {
                    warn!(
                        map = %name,
                        "not converted: socket storage of another layout (user space \
                         reaches an entry only through its socket)"
                    );
                }
                continue;
            }
            let conv = converter(self.from, name);
            let count = copy_map(&self.pins, &self.staging, name, conv, only_datapath)
                .map_err(io_err("copying the entries of", &old))?;
            if count.dropped > 0 {
                let why = match conv {
                    Convert::Drop(why) => why,
                    Convert::With(_) | Convert::Merge { .. } => "the converter refused them",
                    Convert::Bytes => "the layout changed and no converter exists",
                };
                warn!(map = %name, entries = count.dropped, why, "entries not converted");
            }
            tracing::debug!(map = %name, ?count, only_datapath, "copied");
            total.copied += count.copied;
            total.present += count.present;
            total.dropped += count.dropped;
            total.corrected += count.corrected;
            total.merged += count.merged;
            total.expired += count.expired;
        }
        if !only_datapath {
            // Maps of the old layout that this one no longer has.
            for name in self.old_only_maps() {
                let entries = count_entries(&self.pins, &name).unwrap_or(0);
                warn!(
                    map = %name,
                    entries,
                    "not converted: this layout has no such map (removed after the swap)"
                );
                total.dropped += entries;
            }
            self.staging.write_meta(meta::ABI_VERSION, ABI_VERSION)?;
            self.staging.write_meta(meta::OBJECT_HASH, object_hash())?;
            // The acceleration mode `install` recorded (for `proxyctl`): a resize while
            // the agent runs is not followed by an install that would write it again.
            if let Ok(mode) = self.pins.read_meta(meta::ACCELERATION, Access::ReadOnly) {
                self.staging.write_meta(meta::ACCELERATION, mode)?;
            }
        }
        info!(
            from_abi = self.from,
            copied = total.copied,
            already_present = total.present,
            not_converted = total.dropped,
            conntrack_corrected = total.corrected,
            conntrack_state_merged = total.merged,
            conntrack_expired_not_copied = total.expired,
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
            .filter(|n| self.pins.map_path(n).is_file())
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
            io_err("reading the migration marker in", self.staging.path())(io::Error::new(
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
                    loaded = load_staged(&self.staging, previous_conntrack_kept(&self.staging))?;
                    &mut loaded
                }
            };
            let hooks = pinned_hooks(&self.pins)?;
            // Right before the swap (programs loaded): the flows opened since the full
            // copy, to narrow the window in which the old programs write alone.
            let pins = self.pins.clone();
            let log_id = swap_hooks(ebpf, &pins, &hooks, true, &mut || {
                self.copy_all(true)?;
                set_marker(&self.staging, from, "swapping")
            })?;
            if let Some(id) = log_id {
                self.staging.write_meta(meta::LOG_PROGRAM_ID, id)?;
            }
            info!(
                hooks = hooks.len(),
                "swapped every hook to the new programs"
            );
            set_marker(&self.staging, from, "swapped")?;
            crash_point("swapped")?;
        }
        if at <= 2 {
            // What the old programs wrote until the swap.
            self.copy_all(true)?;
            set_marker(&self.staging, from, "recopied")?;
            crash_point("recopied")?;
        }
        if at <= 4 {
            set_marker(&self.staging, from, "renaming")?;
            let staged = self.staged_maps()?;
            let mut first = true;
            for name in staged.iter().filter(|n| *n != map_names::META) {
                self.move_pin(name)?;
                if first {
                    crash_point("rename-first")?;
                    first = false;
                }
            }
            // META last: until here the pin directory still reads as the old ABI.
            if staged.iter().any(|n| n == map_names::META) {
                self.move_pin(map_names::META)?;
            }
            set_marker(&self.staging, from, "meta")?;
            crash_point("meta")?;
        }
        self.retire_previous_conntrack()?;
        for name in self.old_only_maps() {
            let path = self.pins.map_path(&name);
            fs::remove_file(&path).map_err(io_err("unpinning", &path))?;
            info!(map = %name, "removed the old layout's map");
        }
        let dir = self.staging.path();
        fs::remove_dir_all(dir).map_err(io_err("removing", dir))?;
        Ok(())
    }

    /// A conntrack resize: the running `CT4`/`CT6` are pinned in the staging directory as
    /// `CT4_PREV`/`CT6_PREV` (in place of the 1-entry maps staged there), which the new
    /// programs (loaded with the fallback on) look a miss up in, moving the entry found
    /// into the new table. So a flow the old programs opened after the last copy before
    /// the swap, or a packet a new program handles before the copy after it, finds its
    /// entry (same backend, SNAT port) instead of being balanced again. Only a table
    /// copied into another of the same layout (a resize) is kept so. Returns whether one
    /// was.
    fn keep_previous_conntrack(&self) -> Result<bool, LoadError> {
        let mut kept = false;
        for (prev, ct) in PREVIOUS_CT {
            let (Ok(oi), Ok(ni)) = (self.pins.map_info(ct), self.staging.map_info(ct)) else {
                continue;
            };
            let resized = oi.id != ni.id
                && (oi.map_type, oi.key_size, oi.value_size, oi.map_flags)
                    == (ni.map_type, ni.key_size, ni.value_size, ni.map_flags);
            let staged_prev = self.staging.map_path(prev);
            if !resized || !staged_prev.exists() {
                continue;
            }
            let old_fd = self.pins.open_fd(ct, Access::ReadWrite)?;
            fs::remove_file(&staged_prev).map_err(io_err("unpinning", &staged_prev))?;
            self.staging
                .pin_map(prev, old_fd.as_fd())
                .map_err(io_err("pinning", &staged_prev))?;
            info!(
                map = ct,
                kept_as = prev,
                "the conntrack table being replaced stays readable by the new programs \
                 until the resize ends (a miss is looked up there)"
            );
            kept = true;
        }
        Ok(kept)
    }

    /// After a conntrack resize (its tables renamed into place): every entry of the
    /// replaced tables has been copied into the new ones (the copy after the swap; since
    /// the swap only the new tables are written), so the hooks are swapped to programs
    /// loaded without the fallback, against fresh 1-entry `CT4_PREV`/`CT6_PREV`, and the
    /// replaced tables' memory goes with the last program that held them. Nothing to do
    /// unless a replaced table is pinned there (a resize's, not a layout migration's), or
    /// a `CT*_PREV` pin is missing (a crash after they were unpinned here).
    fn retire_previous_conntrack(&self) -> Result<(), LoadError> {
        let sizes = PREVIOUS_CT.map(|(prev, _)| (prev, self.pins.max_entries(prev)));
        if sizes.iter().all(|(_, n)| *n == Some(1)) {
            return Ok(());
        }
        let kept: Vec<&str> = sizes
            .iter()
            .filter(|(_, n)| n.is_some_and(|n| n > 1))
            .map(|(prev, _)| *prev)
            .collect();
        for prev in &kept {
            let path = self.pins.map_path(prev);
            fs::remove_file(&path).map_err(io_err("unpinning", &path))?;
        }
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(self.pins.path())
            .load(EBPF_OBJECT)?;
        let hooks = pinned_hooks(&self.pins)?;
        let log_id = swap_hooks(&mut ebpf, &self.pins, &hooks, false, &mut || Ok(()))?;
        if let Some(id) = log_id {
            self.pins.write_meta(meta::LOG_PROGRAM_ID, id)?;
        }
        info!(
            ?kept,
            hooks = hooks.len(),
            "the replaced conntrack tables are released (programs without the fallback \
             swapped in)"
        );
        Ok(())
    }

    /// `rename(2)` of a staged pin over the old one (atomic; the old map goes when its
    /// last program does).
    fn move_pin(&self, name: &str) -> Result<(), LoadError> {
        let to = self.pins.map_path(name);
        fs::rename(self.staging.map_path(name), &to)
            .map_err(io_err("moving the staged pin to", &to))
    }
}
