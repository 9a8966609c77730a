//! One map's entries copied into another (converted, or insert-if-absent), and counted.

use std::{
    io,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
};

use crate::pins::{open_pinned, Access, PinDir};

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
    /// Changed layout where several old entries make one new one (`SVC4/6`: ABI 3's
    /// entry per backend slot into ABI 4's chunk of 24): `key` names the new entry an old
    /// one goes into (`None` drops it); `into` writes the old entry's part into that
    /// entry's value as the new map holds it so far (zeros when absent), `false` when it
    /// cannot.
    Merge {
        key: fn(&[u8]) -> Option<Vec<u8>>,
        into: fn(&[u8], &[u8], &mut [u8]) -> bool,
    },
}

/// Bytes of one value as lookup/update see it (per-CPU maps: one 8-byte-aligned slot
/// per possible CPU).
fn value_buf_len(info: &bpf_sys::MapInfo) -> io::Result<usize> {
    if info.per_cpu() {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        Ok((info.value_size as usize).div_ceil(8) * 8 * cpus)
    } else {
        Ok(info.value_size as usize)
    }
}

/// Map `name` of `pins`, read-write.
fn open(pins: &PinDir, name: &str) -> io::Result<OwnedFd> {
    open_pinned(&pins.map_path(name), Access::ReadWrite)
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
    /// Conntrack entries the new programs had made for a flow the old programs were
    /// already tracking, with another translation: overwritten by the old one.
    pub corrected: u64,
    /// Conntrack entries not copied because they had expired.
    pub expired: u64,
    /// Conntrack entries present in both with the same translation, into which the state
    /// the old programs added (a reply seen, a FIN or RST seen, a later packet) was
    /// merged.
    pub merged: u64,
}

/// Bytes at the end of a conntrack value (`Ct4Value`, `Ct6Value`) that are not its
/// translation: `flags`, `last_seen`, `packets`.
const CT_VALUE_STATE_BYTES: usize = 4 + 8 + 8;
const _: () = {
    use proxy_common::{Ct4Value, Ct6Value};
    use std::mem::{offset_of, size_of};
    assert!(size_of::<Ct4Value>() - CT_VALUE_STATE_BYTES == offset_of!(Ct4Value, flags));
    assert!(size_of::<Ct6Value>() - CT_VALUE_STATE_BYTES == offset_of!(Ct6Value, flags));
    assert!(offset_of!(Ct4Value, last_seen) == offset_of!(Ct4Value, flags) + 4);
    assert!(offset_of!(Ct6Value, last_seen) == offset_of!(Ct6Value, flags) + 4);
};

/// The conntrack maps, whose insert-if-absent copy corrects a conflicting translation.
fn is_conntrack(name: &str) -> bool {
    name == proxy_common::map_names::CT4 || name == proxy_common::map_names::CT6
}

/// What [`reconcile`] did to a conntrack entry present in both tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reconciled {
    /// Another translation: overwritten by the old one.
    Corrected,
    /// The same translation: the old entry's state merged in.
    Merged,
    /// Nothing to do.
    Same,
}

/// A conntrack entry (`key`, the old table's `value`) that `new` holds too ([`copy_map`]).
/// With another translation it is overwritten by the old one. With the same one, the
/// state only the old table has is merged in: the `SEEN_REPLY` and `CLOSING` flags and a
/// later `last_seen`. A flow a new program opens while other hooks still run old programs
/// has its entries in both tables (the resize's programs write both), and the old
/// programs on the other hooks update the old table's copies: its handshake's reply, seen
/// only there, would otherwise leave the new table's entries in the short SYN timeout.
fn reconcile(new: std::os::fd::BorrowedFd<'_>, key: &[u8], value: &[u8]) -> io::Result<Reconciled> {
    use proxy_common::ct_flags::{CLOSING, SEEN_REPLY};
    if value.len() <= CT_VALUE_STATE_BYTES {
        return Ok(Reconciled::Same);
    }
    let mut now = vec![0u8; value.len()];
    let n = value.len() - CT_VALUE_STATE_BYTES;
    if !bpf_sys::map_lookup(new, key, &mut now)? {
        return Ok(Reconciled::Same); // gone meanwhile (evicted): nothing to merge into
    }
    if now[..n] != value[..n] {
        bpf_sys::map_update(new, key, value, bpf_sys::ANY)?;
        return Ok(Reconciled::Corrected);
    }
    let u32_at = |b: &[u8]| u32::from_ne_bytes(b[n..n + 4].try_into().expect("4 bytes"));
    let u64_at = |b: &[u8]| u64::from_ne_bytes(b[n + 4..n + 12].try_into().expect("8 bytes"));
    let (flags, old_flags) = (u32_at(&now), u32_at(value));
    let merged_flags = flags | (old_flags & (SEEN_REPLY | CLOSING));
    let last_seen = u64_at(&now).max(u64_at(value));
    if merged_flags == flags && last_seen == u64_at(&now) {
        return Ok(Reconciled::Same);
    }
    now[n..n + 4].copy_from_slice(&merged_flags.to_ne_bytes());
    now[n + 4..n + 12].copy_from_slice(&last_seen.to_ne_bytes());
    // The datapath may refresh the entry meanwhile: at worst a `last_seen` or packet
    // count a few microseconds old is written back.
    bpf_sys::map_update(new, key, &now, bpf_sys::ANY)?;
    Ok(Reconciled::Merged)
}

/// Entries in map `name` of `pins`. For an array (`BACKEND4/6`, indexed by a dense id)
/// the entries a copy into another array needs room for: its highest index whose entry
/// is not all zero, plus one (a free id's entry is zero and not copied).
pub(super) fn count_entries(pins: &PinDir, name: &str) -> io::Result<u64> {
    let fd = open(pins, name)?;
    let info = bpf_sys::map_info(fd.as_fd())?;
    if info.map_type == bpf_sys::map_type::ARRAY {
        return Ok(highest_in_use(fd.as_fd(), &info)?.map_or(0, |i| u64::from(i) + 1));
    }
    let mut key = vec![0u8; info.key_size as usize];
    let mut next = key.clone();
    let mut n = 0u64;
    let mut have = false;
    while bpf_sys::map_next_key(fd.as_fd(), have.then_some(&key[..]), &mut next)? {
        n += 1;
        std::mem::swap(&mut key, &mut next);
        have = true;
        if n > u64::from(info.max_entries) * 2 + 16 {
            break;
        }
    }
    Ok(n)
}

/// The highest key in use of a map keyed by `u32` (`BACKEND4/6`): of a hash map, its
/// highest key; of an array, its highest index whose entry is not all zero. `None`:
/// nothing in use.
pub(super) fn highest_in_use(
    fd: std::os::fd::BorrowedFd<'_>,
    info: &bpf_sys::MapInfo,
) -> io::Result<Option<u32>> {
    if info.key_size != 4 || info.per_cpu() {
        return Ok(None);
    }
    let array = info.map_type == bpf_sys::map_type::ARRAY;
    // By batch lookups (an array's walk key by key costs two syscalls for every index:
    // a million at 262,144 entries per map); the walk where the kernel has none.
    let vs = info.value_size as usize;
    let mut highest = None;
    let batched = crate::batch::lookup_each(fd, 4, vs, |k, v| {
        if !array || v.iter().any(|b| *b != 0) {
            let key = u32::from_ne_bytes(k.try_into().expect("4 bytes"));
            highest = highest.max(Some(key));
        }
    });
    if batched.is_ok() {
        return Ok(highest);
    }
    let (mut key, mut next) = ([0u8; 4], [0u8; 4]);
    let mut value = vec![0u8; info.value_size as usize];
    let (mut have, mut highest, mut steps) = (false, None, 0u64);
    while bpf_sys::map_next_key(fd, have.then_some(&key[..]), &mut next)? {
        key = next;
        have = true;
        steps += 1;
        if steps > u64::from(info.max_entries) * 2 + 16 {
            break;
        }
        if array && (!bpf_sys::map_lookup(fd, &key, &mut value)? || value.iter().all(|b| *b == 0)) {
            continue;
        }
        highest = highest.max(Some(u32::from_ne_bytes(key)));
    }
    Ok(highest)
}

/// `sizes` with room in the backend arrays (`BACKEND4/6`, indexed by id) for every id
/// the pinned backend maps hold, of either family (one id space): an upgrade from hash
/// maps (whose ids may pass their size: the other family's ids count too), or a size
/// asked below the highest id, takes the next power of two above it.
pub(super) fn backend_room(pins: &PinDir, sizes: super::Sizes) -> super::Sizes {
    let kind = super::SizedMap::Backend;
    let mut need = 0u64;
    for name in kind.maps() {
        let Ok(fd) = open(pins, name) else {
            continue;
        };
        let highest = bpf_sys::map_info(fd.as_fd()).and_then(|i| highest_in_use(fd.as_fd(), &i));
        if let Ok(Some(h)) = highest {
            need = need.max(u64::from(h) + 1);
        }
    }
    if need <= u64::from(sizes.get(kind)) {
        return sizes;
    }
    let to = u32::try_from(need.next_power_of_two()).unwrap_or(u32::MAX);
    tracing::info!(
        highest_id = need - 1,
        entries = to,
        "the backend arrays are made large enough for every backend id in use"
    );
    sizes.with(kind, to)
}

/// Whether entries of a map of `old`'s type are copied as bytes into one of `new`'s: the
/// same type, or a hash map into an array of the same key and value (`BACKEND4/6`, hash
/// maps before they were arrays: the key is the index).
fn same_layout(old: &bpf_sys::MapInfo, new: &bpf_sys::MapInfo) -> bool {
    let types = old.map_type == new.map_type
        || (old.map_type == bpf_sys::map_type::HASH
            && new.map_type == bpf_sys::map_type::ARRAY
            && old.key_size == 4);
    types && old.key_size == new.key_size && old.value_size == new.value_size
}

/// Writes one old entry into the new map through `conv`: whether it was written (false:
/// present, insert-if-absent), `None` when it is dropped (not converted).
fn write_entry(
    new_fd: &OwnedFd,
    ni: &bpf_sys::MapInfo,
    conv: Convert,
    (key, value): (&[u8], &[u8]),
    flags: u64,
    same_shape: bool,
) -> io::Result<Option<bool>> {
    Ok(match conv {
        Convert::Bytes if same_shape => {
            Some(bpf_sys::map_update(new_fd.as_fd(), key, value, flags)?)
        }
        Convert::Bytes | Convert::Drop(_) => None,
        Convert::With(f) => match f(key, value) {
            Some((k, v)) => Some(bpf_sys::map_update(new_fd.as_fd(), &k, &v, flags)?),
            None => None,
        },
        Convert::Merge { key: to, into } => {
            merge_into(new_fd.as_fd(), ni, (key, value), to, into)?.then_some(true)
        }
    })
}

/// One old entry merged into the new map's entry `to(key)` ([`Convert::Merge`]): read
/// (zeros when absent), `into`, written back. False: dropped.
fn merge_into(
    new: BorrowedFd<'_>,
    ni: &bpf_sys::MapInfo,
    (key, value): (&[u8], &[u8]),
    to: fn(&[u8]) -> Option<Vec<u8>>,
    into: fn(&[u8], &[u8], &mut [u8]) -> bool,
) -> io::Result<bool> {
    let Some(nk) = to(key) else {
        return Ok(false);
    };
    if nk.len() != ni.key_size as usize {
        return Ok(false);
    }
    let mut nv = vec![0u8; ni.value_size as usize];
    if !bpf_sys::map_lookup(new, &nk, &mut nv)? {
        nv.fill(0);
    }
    if !into(key, value, &mut nv) {
        return Ok(false);
    }
    bpf_sys::map_update(new, &nk, &nv, bpf_sys::ANY)
}

/// [`copy_map`] into an array (`BACKEND4/6`: a resize, or hash maps of an earlier build)
/// by batch calls: every entry read by `BPF_MAP_LOOKUP_BATCH`, the all-zero ones of an
/// array dropped (free ids), written by `BPF_MAP_UPDATE_BATCH` in chunks; a walk key by
/// key costs two syscalls for every index of an array. `None`: not such a copy, or the
/// kernel has no batch lookup for the old map (the walk then copies).
fn batched_into_array(
    old: &OwnedFd,
    new: &OwnedFd,
    (oi, ni): (&bpf_sys::MapInfo, &bpf_sys::MapInfo),
    conv: Convert,
    only_absent: bool,
) -> io::Result<Option<CopyCount>> {
    let eligible = !only_absent
        && matches!(conv, Convert::Bytes)
        && same_layout(oi, ni)
        && ni.map_type == bpf_sys::map_type::ARRAY
        && !oi.per_cpu();
    if !eligible {
        return Ok(None);
    }
    let (ks, vs) = (oi.key_size as usize, oi.value_size as usize);
    // Written as read, 4,096 entries at a time: only a chunk of each side is held (an
    // array of millions of mostly free ids is not read whole first). A failed read falls
    // back to the walk, which writes again what was written here (the same values).
    const CHUNK: usize = 4096;
    let (mut k, mut v) = (
        Vec::with_capacity(CHUNK * ks),
        Vec::with_capacity(CHUNK * vs),
    );
    let (mut copied, mut failed) = (0u64, None);
    let mut flush = |k: &mut Vec<u8>, v: &mut Vec<u8>, failed: &mut Option<io::Error>| {
        if k.is_empty() || failed.is_some() {
            return;
        }
        let count = u32::try_from(k.len() / ks).unwrap_or(u32::MAX);
        match bpf_sys::map_update_batch_raw(new.as_fd(), k, v, count) {
            Ok(_) => copied += u64::from(count),
            Err(e) => *failed = Some(e.error),
        }
        k.clear();
        v.clear();
    };
    let read = crate::batch::lookup_each(old.as_fd(), ks, vs, |key, value| {
        if oi.map_type == bpf_sys::map_type::ARRAY && value.iter().all(|b| *b == 0) {
            return;
        }
        k.extend_from_slice(key);
        v.extend_from_slice(value);
        if k.len() >= CHUNK * ks {
            flush(&mut k, &mut v, &mut failed);
        }
    });
    if read.is_err() {
        return Ok(None);
    }
    flush(&mut k, &mut v, &mut failed);
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(Some(CopyCount {
        copied,
        ..CopyCount::default()
    }))
}

/// How [`copy_map`] writes: its update flags, and whether it skips all-zero entries.
/// Insert-if-absent is for hash maps: an array has every entry (`BPF_NOEXIST` fails). An
/// array into an array: an all-zero entry (a free id's, or never written) is what the
/// new array holds already; not copying it also lets a shrunk array take the entries in
/// use (the highest below its size: `count_entries`).
fn write_mode(old: &bpf_sys::MapInfo, new: &bpf_sys::MapInfo, only_absent: bool) -> (u64, bool) {
    let array = |i: &bpf_sys::MapInfo| {
        i.map_type == bpf_sys::map_type::ARRAY || i.map_type == bpf_sys::map_type::PERCPU_ARRAY
    };
    let (old_array, new_array) = (array(old), array(new));
    let flags = if only_absent && !old_array && !new_array {
        bpf_sys::NOEXIST
    } else {
        bpf_sys::ANY
    };
    (flags, old_array && new_array)
}

/// Copies the entries of map `name` of `old` into map `name` of `new`, through `conv`.
/// `only_absent`: insert-if-absent (hash maps), for the copies around the swap. For
/// conntrack copied as bytes, an entry present in both with another translation (backend,
/// SNAT address/port, service, backend id) takes the old one: after the swap, a packet of
/// a flow the old programs opened after the last copy misses it in the new table and the
/// new programs open it again, possibly to another backend; the old table's entry is the
/// one the connection was established with (its 5-tuple cannot be a new flow's within
/// the copy's window). The state bytes (flags, timestamps, counters) do not count; an
/// entry with the same translation takes the old one's reply-seen and closing flags and
/// its later `last_seen` ([`reconcile`]).
pub fn copy_map(
    old: &PinDir,
    new: &PinDir,
    name: &str,
    conv: Convert,
    only_absent: bool,
) -> io::Result<CopyCount> {
    let old_fd = open(old, name)?;
    let new_fd = open(new, name)?;
    let oi = bpf_sys::map_info(old_fd.as_fd())?;
    let ni = bpf_sys::map_info(new_fd.as_fd())?;
    let mut count = CopyCount::default();
    let mut key = vec![0u8; oi.key_size as usize];
    let mut next = key.clone();
    let mut value = vec![0u8; value_buf_len(&oi)?];
    let same_shape = same_layout(&oi, &ni);
    if let Some(count) = batched_into_array(&old_fd, &new_fd, (&oi, &ni), conv, only_absent)? {
        return Ok(count);
    }
    let (flags, skip_zero) = write_mode(&oi, &ni, only_absent);
    // Expired conntrack entries are not carried over (the datapath treats them as
    // absent): a shrink copies the live flows only.
    let skip_expired = is_conntrack(name) && matches!(conv, Convert::Bytes) && same_shape;
    let now = crate::ctl::maps::monotonic_ns();
    let mut have = false;
    // LRU maps restart a walk whose key was evicted: bound the walk.
    let limit = u64::from(oi.max_entries) * 2 + 16;
    let mut steps = 0u64;
    while bpf_sys::map_next_key(old_fd.as_fd(), have.then_some(&key[..]), &mut next)? {
        std::mem::swap(&mut key, &mut next);
        have = true;
        steps += 1;
        if steps > limit {
            break;
        }
        if !bpf_sys::map_lookup(old_fd.as_fd(), &key, &mut value)? {
            continue; // gone meanwhile
        }
        if skip_zero && value.iter().all(|b| *b == 0) {
            continue;
        }
        if skip_expired && crate::ctsize::expired_entry(&key, &value, now) {
            count.expired += 1;
            continue;
        }
        let Some(written) = write_entry(&new_fd, &ni, conv, (&key, &value), flags, same_shape)?
        else {
            count.dropped += 1;
            continue;
        };
        if written {
            count.copied += 1;
        } else if only_absent && skip_expired {
            match reconcile(new_fd.as_fd(), &key, &value)? {
                Reconciled::Corrected => count.corrected += 1,
                Reconciled::Merged => count.merged += 1,
                Reconciled::Same => count.present += 1,
            }
        } else {
            count.present += 1;
        }
    }
    Ok(count)
}
