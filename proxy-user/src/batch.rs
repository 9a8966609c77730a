//! Batched map operations over `bpf(2)`: `BPF_MAP_UPDATE_BATCH`, `BPF_MAP_DELETE_BATCH`
//! and `BPF_MAP_LOOKUP_BATCH` (kernel >= 5.6). aya 0.14 has no batch API, so this is a
//! small typed layer over the calls in `bpf_sys` (the one `bpf(2)` leaf).
//!
//! The kernel applies a batch element by element, in order, and stops at the first
//! element that fails: `count` then says how many were applied. Callers fall back to
//! one-element calls for the rest (see `store::write_batch`), which also covers map types
//! without batch support (`ENOTSUPP`, `EINVAL`) and kernels that fail batches into
//! `BPF_F_NO_PREALLOC` hash maps with `ENOMEM`.

use std::{io, os::fd::BorrowedFd};

use aya::Pod;

/// The kernel-internal `ENOTSUPP` (not `EOPNOTSUPP`), which `bpf(2)` returns for a map
/// type without the batch operation.
pub const ENOTSUPP: i32 = bpf_sys::ENOTSUPP;

/// Elements per lookup call at most (grown when one hash bucket holds more).
const LOOKUP_CHUNK: u32 = 4096;

/// Bytes of keys and values one lookup call is given room for at most: a map of large
/// values (a `MAGLEV` chunk is 8 KiB) read 4,096 at a time took a zeroed 32 MiB buffer
/// even when empty, the agent's peak memory at start (its adoption reads every map).
const LOOKUP_CHUNK_BYTES: usize = 1 << 20;

/// Elements per lookup call for entries of `entry_bytes`: [`LOOKUP_CHUNK`], fewer for
/// large entries ([`LOOKUP_CHUNK_BYTES`]), at least one.
fn lookup_chunk(entry_bytes: usize) -> u32 {
    let fit = LOOKUP_CHUNK_BYTES / entry_bytes.max(1);
    u32::try_from(fit).map_or(LOOKUP_CHUNK, |n| n.clamp(1, LOOKUP_CHUNK))
}

/// A batch call that did not apply every element: `done` were applied (in order), then
/// the kernel returned `error`.
#[derive(Debug)]
pub struct BatchError {
    pub done: usize,
    pub error: io::Error,
}

impl BatchError {
    /// The errno, if any.
    pub fn errno(&self) -> Option<i32> {
        self.error.raw_os_error()
    }
}

/// How many elements a failed call applied. The kernel writes `count` back only once it
/// has started on the elements (and then it is below the input, since it stopped at a
/// failing one); an early refusal (`EPERM`, `EINVAL`, `ENOTSUPP`, ...) leaves the input.
fn done_on_error(attr_count: u32, input: usize) -> usize {
    let n = attr_count as usize;
    if n >= input {
        0
    } else {
        n
    }
}

/// `BPF_MAP_UPDATE_BATCH` of `keys[i] = values[i]` (flag `BPF_ANY`).
pub fn update<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), BatchError> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    if keys.is_empty() {
        return Ok(());
    }
    bpf_sys::map_update_batch(fd, keys, values).map_err(|f| BatchError {
        done: done_on_error(f.count, keys.len()),
        error: f.error,
    })
}

/// `BPF_MAP_DELETE_BATCH` of `keys`. A key that is absent stops the kernel's batch with
/// `ENOENT`: it is skipped and the batch resumes after it (deleting an absent key is no
/// error here, as for the writer's one-element deletes).
pub fn delete<K: Pod>(fd: BorrowedFd<'_>, keys: &[K]) -> Result<(), BatchError> {
    let mut start = 0;
    while start < keys.len() {
        let rest = &keys[start..];
        match bpf_sys::map_delete_batch(fd, rest) {
            Ok(count) => {
                start += count as usize;
                if count == 0 {
                    break;
                }
            }
            Err(f)
                if f.error.raw_os_error() == Some(libc::ENOENT)
                    && (f.count as usize) < rest.len() =>
            {
                start += f.count as usize + 1
            }
            Err(f) => {
                return Err(BatchError {
                    done: start + done_on_error(f.count, rest.len()),
                    error: f.error,
                })
            }
        }
    }
    Ok(())
}

/// Every entry of a map, by `BPF_MAP_LOOKUP_BATCH` in chunks of at most a mebibyte,
/// handed to `each` as raw key and value bytes (`value_size` bytes each; per-CPU maps:
/// the per-CPU values, 8-byte aligned, one after the other) as each chunk arrives: only
/// one chunk is held, whatever the map's size (a `BACKEND6` array of 2,097,152 entries
/// read whole was 56 MiB of buffers, twice over once converted). `Err` when the map type
/// has no batch lookup (`ENOTSUPP`, `EINVAL`) or a call fails, possibly after some
/// entries were handed over: the caller then starts again key by key.
pub fn lookup_each(
    fd: BorrowedFd<'_>,
    key_size: usize,
    value_size: usize,
    mut each: impl FnMut(&[u8], &[u8]),
) -> io::Result<()> {
    let mut chunk = lookup_chunk(key_size + value_size);
    let mut keys = Vec::new();
    let mut values = Vec::new();
    // Batch tokens: an opaque position (a bucket index for hash maps, a key for arrays).
    let token_len = key_size.max(8);
    let mut token_in = vec![0u8; token_len];
    let mut token_out = vec![0u8; token_len];
    let mut first = true;
    loop {
        let n = chunk as usize;
        keys.resize(n * key_size, 0);
        values.resize(n * value_size, 0);
        let r = bpf_sys::map_lookup_batch(
            fd,
            (!first).then_some(&token_in[..]),
            &mut token_out,
            &mut keys,
            &mut values,
            chunk,
        );
        match r {
            Ok((got, end)) => {
                for i in 0..got as usize {
                    each(
                        &keys[i * key_size..(i + 1) * key_size],
                        &values[i * value_size..(i + 1) * value_size],
                    );
                }
                if end == bpf_sys::BatchEnd::End {
                    return Ok(());
                }
                first = false;
                token_in.copy_from_slice(&token_out);
            }
            // One bucket holds more entries than fit: a bigger chunk.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && chunk < (1 << 20) => {
                chunk *= 2;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Every entry of a map as raw keys and values, one after the other ([`lookup_each`]).
pub fn lookup_raw(
    fd: BorrowedFd<'_>,
    key_size: usize,
    value_size: usize,
) -> io::Result<(Vec<u8>, Vec<u8>, usize)> {
    let (mut keys, mut values, mut total) = (Vec::new(), Vec::new(), 0usize);
    lookup_each(fd, key_size, value_size, |k, v| {
        keys.extend_from_slice(k);
        values.extend_from_slice(v);
        total += 1;
    })?;
    Ok((keys, values, total))
}

/// Every entry of a map whose keys and values are `K` and `V` for which `keep` holds,
/// by batch lookups ([`lookup_each`]: the entries left out are never held).
pub fn lookup_where<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    mut keep: impl FnMut(&K, &V) -> bool,
) -> io::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    lookup_each(
        fd,
        std::mem::size_of::<K>(),
        std::mem::size_of::<V>(),
        |k, v| {
            let (k, v) = (read_pod::<K>(k), read_pod::<V>(v));
            if keep(&k, &v) {
                out.push((k, v));
            }
        },
    )?;
    Ok(out)
}

/// Every entry of a map whose keys and values are `K` and `V`, by batch lookups.
pub fn lookup<K: Pod, V: Pod>(fd: BorrowedFd<'_>) -> io::Result<Vec<(K, V)>> {
    lookup_where(fd, |_, _| true)
}

/// Every key of a per-CPU map with `u64` values, and the sum of its per-CPU values.
pub fn lookup_percpu_sum<K: Pod>(fd: BorrowedFd<'_>, ncpus: usize) -> io::Result<Vec<(K, u64)>> {
    let mut out = Vec::new();
    lookup_each(fd, std::mem::size_of::<K>(), 8 * ncpus, |k, v| {
        let sum = (0..ncpus).map(|c| read_pod::<u64>(&v[c * 8..])).sum();
        out.push((read_pod(k), sum));
    })?;
    Ok(out)
}

fn read_pod<T: Pod>(bytes: &[u8]) -> T {
    assert!(bytes.len() >= std::mem::size_of::<T>());
    // SAFETY: `T: Pod` (any bytes are a valid T) and the slice holds at least
    // size_of::<T>() bytes; read_unaligned copes with the byte buffer's alignment.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_call_gets_room_for_at_most_a_mebibyte() {
        // Small entries: the most per call.
        assert_eq!(lookup_chunk(4 + 16), LOOKUP_CHUNK);
        // A MAGLEV chunk (8-byte key, 4,032-byte value): 259 per call, 1 MiB, not 16.5.
        let maglev = 8 + std::mem::size_of::<proxy_common::MaglevChunk>();
        assert_eq!(maglev, 4040);
        assert_eq!(lookup_chunk(maglev), 259);
        assert!(lookup_chunk(maglev) as usize * maglev <= LOOKUP_CHUNK_BYTES);
        // Larger than the room: one at a time.
        assert_eq!(lookup_chunk(LOOKUP_CHUNK_BYTES * 2), 1);
        assert_eq!(lookup_chunk(0), LOOKUP_CHUNK);
    }
}
