//! The manifests-directory source: Services, EndpointSlices and Nodes as YAML (or JSON)
//! files, several documents per file, `kind: List` included; the directory is read again
//! when inotify reports a file written, renamed or deleted in it (`watch.rs`), and at
//! every poll, and only files whose size or modification time changed are read again.
//!
//! The first scan yields one [`Update::Snapshot`] per kind (the initial lists); later
//! scans yield the difference as `Apply`/`Delete`; [`spawn`] sends each scan's updates as
//! one [`Update::Batch`]. The objects of the files read are decoded on the node's CPUs
//! (`parse.rs`). A file that does not parse is logged
//! and counted, and the objects it held before stay as they were; a document that does
//! not decode is skipped alone.

use std::{
    collections::BTreeMap,
    fs, io,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::counters::SourceCounters;
use super::skips::{SkipKind, SkipReason};
use super::{Kind, ObjKey, Object, Update};
use crate::fasthash::HashMap;

#[cfg(test)]
mod parallel_tests;
mod parse;
#[cfg(test)]
mod tests;
mod watch;
mod yaml;

use parse::{check_nesting, parse_file, parse_files, read_text, Decoding, Found};
pub use parse::{decode, MAX_MANIFEST_BYTES, MAX_NESTING};

#[derive(Debug)]
struct FileState {
    stamp: (SystemTime, u64),
    /// Each object's kind, key and a hash of its JSON: changes are detected without
    /// keeping the objects (at 10,000 Services copies would be most of the agent's
    /// memory); a file is parsed again when one of its objects is needed.
    objects: Vec<(Kind, ObjKey, u64)>,
}

/// Objects parsed during one scan, by kind, key and hash.
type Parsed = HashMap<(Kind, ObjKey, u64), Object>;

/// The directory's state between scans.
#[derive(Debug)]
pub struct ManifestsDir {
    dir: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    /// What the agent was told, by kind and key (a hash of the JSON, to detect changes).
    current: HashMap<(Kind, ObjKey), u64>,
    /// When each Service was first read, for those without `creationTimestamp`: their
    /// creation time (`cluster::conflicts`), so a Service added later counts as newer
    /// than the ones already served, as in a cluster. Kept while the Service exists.
    first_read: HashMap<ObjKey, SystemTime>,
    scanned: bool,
    metrics: SourceCounters,
    /// `--service-proxy-name`: Services and EndpointSlices are reduced as they are read,
    /// through its label selection.
    proxy_name: Option<String>,
    /// Hashes each object's text, to detect changes.
    hasher: foldhash::fast::RandomState,
    /// Threads the objects of the files read are decoded on (the node's CPUs, at most
    /// [`MAX_PARSE_THREADS`]).
    threads: usize,
    /// The most threads a batch of the last scan was decoded on (logged).
    last_threads: usize,
}

/// The shortest time between two scans when changes keep coming.
const MIN_SCAN_GAP: Duration = Duration::from_millis(10);

/// The most threads a scan decodes objects on.
const MAX_PARSE_THREADS: usize = 8;

/// Files read are decoded together until their text passes this size (then the next
/// ones): the files' texts are held at once only up to it (or the largest file).
const BATCH_BYTES: usize = 64 << 20;

/// A file to decode: its path, stamp and text.
type ToParse = (PathBuf, (SystemTime, u64), String);

impl ManifestsDir {
    pub fn new(dir: impl Into<PathBuf>, metrics: SourceCounters) -> Self {
        Self {
            dir: dir.into(),
            files: BTreeMap::new(),
            current: HashMap::default(),
            first_read: HashMap::default(),
            scanned: false,
            metrics,
            proxy_name: None,
            hasher: foldhash::fast::RandomState::default(),
            threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get().min(MAX_PARSE_THREADS)),
            last_threads: 0,
        }
    }

    /// Decodes on `threads` threads (at least one).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// The agent's `--service-proxy-name` (the objects are reduced as they are read).
    pub fn with_proxy_name(mut self, proxy_name: Option<String>) -> Self {
        self.proxy_name = proxy_name;
        self
    }

    fn decoding(&self) -> Decoding<'_> {
        Decoding {
            proxy_name: self.proxy_name.as_deref(),
            hasher: &self.hasher,
        }
    }

    /// Reads what changed and returns the updates for the agent.
    pub fn scan(&mut self) -> io::Result<Vec<Update>> {
        let started = std::time::Instant::now();
        self.last_threads = 0;
        let mut seen = Vec::new();
        let mut changed = false;
        let mut parsed: Parsed = HashMap::default();
        // In the paths' order: what is logged, and which of two definitions is read
        // first, does not depend on the directory's order.
        let mut paths = fs::read_dir(&self.dir)?
            .map(|e| e.map(|e| e.path()))
            .collect::<io::Result<Vec<_>>>()?;
        paths.sort();
        let mut batch: Vec<ToParse> = Vec::new();
        let mut batch_bytes = 0;
        for path in paths {
            let is_manifest = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
            if !is_manifest {
                continue;
            }
            let Some((stamp, text)) = self.read_if_changed(&path, &mut seen)? else {
                continue;
            };
            changed = true;
            batch_bytes += text.len();
            batch.push((path, stamp, text));
            if batch_bytes >= BATCH_BYTES {
                self.parse_batch(std::mem::take(&mut batch), &mut parsed);
                batch_bytes = 0;
            }
        }
        self.parse_batch(batch, &mut parsed);
        let parsed_ms = started.elapsed().as_secs_f64() * 1e3;
        let before = self.files.len();
        self.files.retain(|p, _| seen.binary_search(p).is_ok());
        changed |= self.files.len() != before;
        // Nothing was read again and nothing went away: nothing to diff (the common case,
        // every poll; rebuilding the union of thousands of objects would cost a core).
        if self.scanned && !changed {
            return Ok(Vec::new());
        }

        // The union of every file's objects (by reference: kind, key, hash, file).
        let mut desired: HashMap<(Kind, &ObjKey), (u64, &PathBuf)> = HashMap::default();
        for (path, f) in &self.files {
            for (kind, key, hash) in &f.objects {
                if desired.insert((*kind, key), (*hash, path)).is_some() {
                    warn!(file = %path.display(), "{} {key} defined twice; the one in {} wins", kind.as_str(), path.display());
                }
            }
        }
        // The objects to send: all at the first scan, else the new and changed ones.
        let first = !self.scanned;
        let mut wanted: Vec<(Kind, ObjKey, u64, &PathBuf)> = desired
            .iter()
            .filter(|((kind, key), (hash, _))| {
                first || self.current.get(&(*kind, (*key).clone())) != Some(hash)
            })
            .map(|((kind, key), (hash, path))| (*kind, (*key).clone(), *hash, *path))
            .collect();
        wanted.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        // A definition that now wins from a file not read in this scan (another file
        // defining the same object went away): read that file again.
        for (kind, key, hash, path) in &wanted {
            if !parsed.contains_key(&(*kind, key.clone(), *hash)) {
                if let Ok(text) = fs::read_to_string(path) {
                    // Its skipped objects were reported when it was first read.
                    if let Ok(found) = parse_file(path, &text, self.decoding()) {
                        for f in found {
                            if let Found::Object((k, key, obj, h)) = f {
                                parsed.insert((k, key, h), obj);
                            }
                        }
                    }
                }
            }
        }
        let now = SystemTime::now();
        self.first_read
            .retain(|key, _| desired.contains_key(&(Kind::Service, key)));
        let first_read = &mut self.first_read;
        let mut take = |kind: Kind, key: &ObjKey, hash: u64| {
            let mut obj = parsed.remove(&(kind, key.clone(), hash))?;
            if let Object::ReducedService(r) = &mut obj {
                if let Ok(Some(svc)) = &mut r.info {
                    if svc.creation_timestamp.is_none() {
                        let read = *first_read.entry(key.clone()).or_insert(now);
                        svc.creation_timestamp = Some(unix_seconds(read));
                    }
                }
            }
            Some(obj)
        };
        let updates = if first {
            self.scanned = true;
            [
                Kind::Service,
                Kind::EndpointSlice,
                Kind::Node,
                Kind::Pod,
                Kind::Namespace,
            ]
            .into_iter()
            .map(|k| Update::Snapshot {
                kind: k,
                objects: wanted
                    .iter()
                    .filter(|(kind, ..)| *kind == k)
                    .filter_map(|(kind, key, hash, _)| take(*kind, key, *hash))
                    .collect(),
                relist: false,
            })
            .collect()
        } else {
            let mut ups = Vec::new();
            for (kind, key) in self.current.keys() {
                if !desired.contains_key(&(*kind, key)) {
                    ups.push(Update::Delete {
                        kind: *kind,
                        key: key.clone(),
                    });
                }
            }
            for (kind, key, hash, _) in &wanted {
                if let Some(obj) = take(*kind, key, *hash) {
                    ups.push(Update::Apply(obj));
                }
            }
            ups
        };
        self.current = desired
            .iter()
            .map(|((k, key), (h, _))| ((*k, (*key).clone()), *h))
            .collect();
        let took_ms = started.elapsed().as_secs_f64() * 1e3;
        let (files, objects) = (self.files.len(), self.current.len());
        if first {
            info!(
                files,
                objects,
                parsed_ms,
                threads = self.last_threads,
                took_ms,
                "manifests directory read"
            );
        } else {
            debug!(
                files,
                objects,
                changed = wanted.len(),
                parsed_ms,
                threads = self.last_threads,
                took_ms,
                "manifests directory read again"
            );
        }
        Ok(updates)
    }
}

/// A Service's creation time from the time it was first `read` (whole seconds, as the
/// API server stamps `metadata.creationTimestamp`).
fn unix_seconds(read: SystemTime) -> i64 {
    read.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl ManifestsDir {
    /// A manifest's text if it changed since it was last read (its size or modification
    /// time) and can be used; `None` if it did not change, is not a file, or cannot be
    /// used (then it is reported: [`Self::bad_file`]). Files still there go to `seen`.
    fn read_if_changed(
        &mut self,
        path: &Path,
        seen: &mut Vec<PathBuf>,
    ) -> io::Result<Option<((SystemTime, u64), String)>> {
        // Follows links; a link that leads nowhere (dangling, a loop) is reported.
        let meta = match fs::metadata(path) {
            Ok(m) => m,
            Err(e) => {
                let Ok(link) = fs::symlink_metadata(path) else {
                    return Ok(None); // removed meanwhile
                };
                if !link.file_type().is_symlink() {
                    return Ok(None);
                }
                seen.push(path.to_path_buf());
                let stamp = (link.modified()?, link.len());
                let target = fs::read_link(path).unwrap_or_default();
                let cause = format!("the link to {} cannot be followed: {e}", target.display());
                self.bad_file(path, stamp, SkipReason::BrokenLink, &cause);
                return Ok(None);
            }
        };
        if !meta.is_file() {
            return Ok(None);
        }
        seen.push(path.to_path_buf());
        let stamp = (meta.modified()?, meta.len());
        if self.files.get(path).is_some_and(|f| f.stamp == stamp) {
            return Ok(None);
        }
        if meta.len() > MAX_MANIFEST_BYTES {
            let cause = format!(
                "{} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have",
                meta.len()
            );
            self.bad_file(path, stamp, SkipReason::TooLarge, &cause);
            return Ok(None);
        }
        let text = match read_text(path) {
            Ok(t) => t,
            Err(e) => {
                self.bad_file(path, stamp, SkipReason::ReadError, &e.to_string());
                return Ok(None);
            }
        };
        if let Err(cause) = check_nesting(&text) {
            self.bad_file(path, stamp, SkipReason::TooDeep, &cause);
            return Ok(None);
        }
        Ok(Some((stamp, text)))
    }

    /// Parses the files read (their objects decoded on [`Self::threads`] threads), then,
    /// in the files' order, keeps each one's objects and reports what was skipped; a
    /// file that does not parse is reported and keeps its previous objects.
    fn parse_batch(&mut self, batch: Vec<ToParse>, parsed: &mut Parsed) {
        if batch.is_empty() {
            return;
        }
        let files: Vec<(&Path, &str)> = batch
            .iter()
            .map(|(p, _, t)| (p.as_path(), t.as_str()))
            .collect();
        let (results, threads) = parse_files(&files, self.decoding(), self.threads);
        drop(files);
        self.last_threads = self.last_threads.max(threads);
        for ((path, stamp, text), result) in batch.into_iter().zip(results) {
            drop(text);
            let found = match result {
                Ok(found) => found,
                Err(e) => {
                    self.bad_file(&path, stamp, SkipReason::ParseError, &e);
                    continue;
                }
            };
            let mut index = Vec::with_capacity(found.len());
            for f in found {
                match f {
                    Found::Object((kind, key, obj, hash)) => {
                        index.push((kind, key.clone(), hash));
                        parsed.insert((kind, key, hash), obj);
                    }
                    Found::Skipped(skip) => skip.report(&path, &self.metrics),
                }
            }
            self.files.insert(
                path,
                FileState {
                    stamp,
                    objects: index,
                },
            );
        }
    }

    /// A file that cannot be used: named, logged and counted once per change of it (its
    /// size and modification time, or the link's), and the objects it held before stay
    /// (a half-saved file must not delete Services).
    fn bad_file(&mut self, path: &Path, stamp: (SystemTime, u64), skip: SkipReason, cause: &str) {
        let reason = skip.label();
        if self.files.get(path).is_some_and(|f| f.stamp == stamp) {
            return;
        }
        let what = if matches!(skip, SkipReason::ParseError) {
            "does not parse"
        } else {
            "skipped"
        };
        warn!(file = %path.display(), reason, "manifest {} {what}, keeping its previous objects: {cause}", path.display());
        self.metrics.skipped(SkipKind::File, skip);
        match self.files.get_mut(path) {
            Some(f) => f.stamp = stamp,
            None => {
                self.files.insert(
                    path.to_path_buf(),
                    FileState {
                        stamp,
                        objects: Vec::new(),
                    },
                );
            }
        }
    }
}

/// Reads the directory when it changes (inotify) and at least every `interval`, and sends
/// what changed, until the receiver goes. Runs on a thread of its own: reading and parsing
/// files (a pathological one included) never takes a thread of the async runtime, which
/// serves health and metrics.
pub fn spawn(
    mut dir: ManifestsDir,
    interval: Duration,
    tx: mpsc::Sender<Update>,
) -> io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("manifests".into())
        .spawn(move || {
            // The directory itself unreadable: reported once per new error.
            let mut dir_error: Option<String> = None;
            let dir_path = dir.dir.clone();
            let mut watch = watch::DirWatch::new(&dir_path);
            loop {
                let started = std::time::Instant::now();
                match dir.scan() {
                    Ok(mut updates) => {
                        dir_error = None;
                        // One scan's changes in one update: the agent syncs them together.
                        let batch = match updates.len() {
                            0 => None,
                            1 => updates.pop(),
                            _ => Some(Update::Batch(updates)),
                        };
                        if batch.is_some_and(|u| tx.blocking_send(u).is_err()) {
                            return;
                        }
                    }
                    Err(e) => {
                        if dir_error.as_deref() != Some(&e.to_string()) {
                            warn!(dir = %dir.dir.display(), "scanning the manifests directory: {e}");
                            dir.metrics.skipped(SkipKind::File, SkipReason::ReadError);
                            dir_error = Some(e.to_string());
                        }
                    }
                }
                if tx.is_closed() {
                    return;
                }
                // A change read at once; a stream of them at most one scan per
                // `MIN_SCAN_GAP` (the files unchanged since are not read again anyway).
                std::thread::sleep(MIN_SCAN_GAP.saturating_sub(started.elapsed()));
                watch.wait(&dir_path, interval.saturating_sub(started.elapsed()));
            }
        })
}
