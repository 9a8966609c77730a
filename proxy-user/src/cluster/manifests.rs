//! The manifests-directory source: Services, EndpointSlices and Nodes as YAML (or JSON)
//! files, several documents per file, `kind: List` included; the directory is polled and
//! only files whose size or modification time changed are read again.
//!
//! The first scan yields one [`Update::Snapshot`] per kind (the initial lists); later
//! scans yield the difference as `Apply`/`Delete`. A file that does not parse is logged
//! and counted, and the objects it held before stay as they were; a document that does
//! not decode is skipped alone.

use std::{
    collections::{BTreeMap, HashMap},
    fs, io,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use serde::Deserialize as _;
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::counters::SourceCounters;
use super::{Kind, ObjKey, Object, Update};

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
    scanned: bool,
    metrics: SourceCounters,
}

impl ManifestsDir {
    pub fn new(dir: impl Into<PathBuf>, metrics: SourceCounters) -> Self {
        Self {
            dir: dir.into(),
            files: BTreeMap::new(),
            current: HashMap::new(),
            scanned: false,
            metrics,
        }
    }

    /// Reads what changed and returns the updates for the agent.
    pub fn scan(&mut self) -> io::Result<Vec<Update>> {
        let mut seen = Vec::new();
        let mut changed = false;
        let mut parsed: Parsed = HashMap::new();
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            let path = entry.path();
            let is_manifest = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
            if !is_manifest {
                continue;
            }
            // Follows links; a link that leads nowhere (dangling, a loop) is reported.
            let meta = match fs::metadata(&path) {
                Ok(m) => m,
                Err(e) => {
                    let Ok(link) = fs::symlink_metadata(&path) else {
                        continue; // removed meanwhile
                    };
                    if !link.file_type().is_symlink() {
                        continue;
                    }
                    seen.push(path.clone());
                    let stamp = (link.modified()?, link.len());
                    let target = fs::read_link(&path).unwrap_or_default();
                    let cause = format!("the link to {} cannot be followed: {e}", target.display());
                    self.bad_file(&path, stamp, "broken_link", &cause);
                    continue;
                }
            };
            if !meta.is_file() {
                continue;
            }
            seen.push(path.clone());
            let stamp = (meta.modified()?, meta.len());
            if self.files.get(&path).is_some_and(|f| f.stamp == stamp) {
                continue;
            }
            if meta.len() > MAX_MANIFEST_BYTES {
                let cause = format!(
                    "{} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have",
                    meta.len()
                );
                self.bad_file(&path, stamp, "too_large", &cause);
                continue;
            }
            let text = match read_text(&path) {
                Ok(t) => t,
                Err(e) => {
                    self.bad_file(&path, stamp, "read_error", &e.to_string());
                    continue;
                }
            };
            if let Err(cause) = check_nesting(&text) {
                self.bad_file(&path, stamp, "too_deep", &cause);
                continue;
            }
            changed = true;
            match parse_file(&path, &text, &self.metrics) {
                Ok(objects) => {
                    let mut index = Vec::with_capacity(objects.len());
                    for (kind, key, obj, hash) in objects {
                        index.push((kind, key.clone(), hash));
                        parsed.insert((kind, key, hash), obj);
                    }
                    self.files.insert(
                        path,
                        FileState {
                            stamp,
                            objects: index,
                        },
                    );
                }
                Err(e) => self.bad_file(&path, stamp, "parse_error", &e),
            }
        }
        let before = self.files.len();
        self.files.retain(|p, _| seen.contains(p));
        changed |= self.files.len() != before;
        // Nothing was read again and nothing went away: nothing to diff (the common case,
        // every poll; rebuilding the union of thousands of objects would cost a core).
        if self.scanned && !changed {
            return Ok(Vec::new());
        }

        // The union of every file's objects (by reference: kind, key, hash, file).
        let mut desired: HashMap<(Kind, &ObjKey), (u64, &PathBuf)> = HashMap::new();
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
                    if let Ok(objects) = parse_file(path, &text, &self.metrics) {
                        for (k, key, obj, h) in objects {
                            parsed.insert((k, key, h), obj);
                        }
                    }
                }
            }
        }
        let mut take =
            |kind: Kind, key: &ObjKey, hash: u64| parsed.remove(&(kind, key.clone(), hash));
        let updates = if first {
            self.scanned = true;
            [Kind::Service, Kind::EndpointSlice, Kind::Node]
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
        Ok(updates)
    }
}

impl ManifestsDir {
    /// A file that cannot be used: named, logged and counted once per change of it (its
    /// size and modification time, or the link's), and the objects it held before stay
    /// (a half-saved file must not delete Services).
    fn bad_file(&mut self, path: &Path, stamp: (SystemTime, u64), reason: &str, cause: &str) {
        if self.files.get(path).is_some_and(|f| f.stamp == stamp) {
            return;
        }
        let what = if reason == "parse_error" {
            "does not parse"
        } else {
            "skipped"
        };
        warn!(file = %path.display(), reason, "manifest {} {what}, keeping its previous objects: {cause}", path.display());
        self.metrics.skipped("file", reason);
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

/// The largest manifest file read (a bigger one is reported as `too_large`): 20,000
/// Services with 10 endpoints each take about 40 MiB of YAML.
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// The deepest nesting of YAML/JSON collections accepted (a deeper file is reported as
/// `too_deep` before it is parsed). A Service or EndpointSlice nests about 8 levels.
pub const MAX_NESTING: usize = 64;

/// The file as UTF-8 text (YAML and JSON must be).
fn read_text(path: &Path) -> io::Result<String> {
    let bytes = fs::read(path)?;
    String::from_utf8(bytes).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not UTF-8 (byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

/// Refuses, in one linear pass and before any parser sees it, a text nesting collections
/// deeper than [`MAX_NESTING`]: flow collections (`[`, `{`, outside quotes and comments)
/// and compact block sequences on one line (`- - - x`). The YAML parser takes seconds on
/// a few hundred KiB nested 100,000 deep.
fn check_nesting(text: &str) -> Result<(), String> {
    let mut depth = 0usize;
    let too_deep = |line: usize| {
        Err(format!(
            "collections nested more than {MAX_NESTING} deep (line {line})"
        ))
    };
    for (line, l) in (1usize..).zip(text.split('\n')) {
        // Compact block sequences: `- - - x` is three levels on one line.
        let mut rest = l.trim_start_matches([' ', '\t']);
        let mut dashes = 0usize;
        while let Some(r) = rest.strip_prefix("- ").or_else(|| rest.strip_prefix("-\t")) {
            dashes += 1;
            rest = r.trim_start_matches([' ', '\t']);
        }
        if dashes > MAX_NESTING || depth + dashes > MAX_NESTING {
            return too_deep(line);
        }
        let mut quote: Option<char> = None;
        let mut prev = ' ';
        let mut chars = l.chars();
        while let Some(c) = chars.next() {
            match quote {
                Some('"') if c == '\\' => {
                    chars.next();
                }
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None => match c {
                    '#' if prev == ' ' || prev == '\t' => break,
                    '"' | '\'' => quote = Some(c),
                    '[' | '{' => {
                        depth += 1;
                        if depth > MAX_NESTING {
                            return too_deep(line);
                        }
                    }
                    ']' | '}' => depth = depth.saturating_sub(1),
                    _ => {}
                },
            }
            prev = c;
        }
    }
    Ok(())
}

/// Parses every document of a file into `(kind, key, json, hash of the json)`; documents of other kinds
/// are ignored, documents that do not decode are logged, counted and skipped.
fn parse_file(
    path: &Path,
    text: &str,
    metrics: &SourceCounters,
) -> Result<Vec<(Kind, ObjKey, Object, u64)>, String> {
    // One document at a time: all of a large file's documents as JSON at once would be
    // most of the agent's peak memory.
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let yaml =
            serde_yaml::Value::deserialize(doc).map_err(|e| format!("document {}: {e}", i + 1))?;
        if yaml.is_null() {
            continue;
        }
        let json = serde_json::to_value(&yaml).map_err(|e| format!("document {}: {e}", i + 1))?;
        drop(yaml);
        parse_doc(path, json, metrics, &mut out);
    }
    Ok(out)
}

/// One document (a `List`'s items in order) into `out`.
fn parse_doc(
    path: &Path,
    doc: Value,
    metrics: &SourceCounters,
    out: &mut Vec<(Kind, ObjKey, Object, u64)>,
) {
    let mut stack: Vec<Value> = vec![doc];
    while let Some(doc) = stack.pop() {
        let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("");
        let kind = match kind {
            "Service" => Kind::Service,
            "EndpointSlice" => Kind::EndpointSlice,
            "Node" => Kind::Node,
            "List" | "ServiceList" | "EndpointSliceList" | "NodeList" => {
                if let Some(Value::Array(items)) = doc.get("items").cloned() {
                    stack.extend(items.into_iter().rev());
                }
                continue;
            }
            other => {
                debug!(file = %path.display(), kind = other, "ignoring a document of another kind");
                continue;
            }
        };
        let meta = doc.get("metadata");
        let name = meta
            .and_then(|m| m.get("name"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let namespace = match kind {
            Kind::Node => "",
            _ => meta
                .and_then(|m| m.get("namespace"))
                .and_then(Value::as_str)
                .unwrap_or("default"),
        };
        let key = ObjKey::new(namespace, name);
        let (namespace, unnamed) = (namespace.to_string(), name.is_empty());
        let mut doc = doc;
        if kind != Kind::Node {
            doc["metadata"]["namespace"] = Value::from(namespace);
        }
        if unnamed {
            warn!(file = %path.display(), "skipping a {} without metadata.name in {}", kind.as_str(), path.display());
            metrics.skipped(kind.as_str(), "no_name");
            continue;
        }
        let hash = {
            use std::hash::{Hash as _, Hasher as _};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            doc.to_string().hash(&mut h);
            h.finish()
        };
        match decode(kind, doc) {
            Ok(obj) => out.push((kind, key, obj, hash)),
            Err(e) => {
                warn!(file = %path.display(), object = %key, "skipping {} {key} in {}: {e}", kind.as_str(), path.display());
                metrics.skipped(kind.as_str(), "decode_error");
            }
        }
    }
}

/// Decodes a JSON object into the typed object of its kind.
pub fn decode(kind: Kind, v: Value) -> Result<Object, serde_json::Error> {
    Ok(match kind {
        Kind::Service => Object::Service(Box::new(serde_json::from_value(v)?)),
        Kind::EndpointSlice => Object::Slice(Box::new(serde_json::from_value(v)?)),
        Kind::Node => Object::Node(Box::new(serde_json::from_value(v)?)),
    })
}

/// Polls the directory every `interval` and sends what changed, until the receiver goes.
/// Runs on a thread of its own: reading and parsing files (a pathological one included)
/// never takes a thread of the async runtime, which serves health and metrics.
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
            loop {
                let started = std::time::Instant::now();
                match dir.scan() {
                    Ok(updates) => {
                        dir_error = None;
                        for u in updates {
                            if tx.blocking_send(u).is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        if dir_error.as_deref() != Some(&e.to_string()) {
                            warn!(dir = %dir.dir.display(), "scanning the manifests directory: {e}");
                            dir.metrics.skipped("file", "read_error");
                            dir_error = Some(e.to_string());
                        }
                    }
                }
                if tx.is_closed() {
                    return;
                }
                std::thread::sleep(interval.saturating_sub(started.elapsed()));
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        fs::write(dir.join(name), text).expect("write");
        // Make sure the stamp changes even within the same mtime tick.
    }

    fn names(updates: &[Update]) -> Vec<String> {
        updates
            .iter()
            .map(|u| match u {
                Update::Snapshot { kind, objects, .. } => format!(
                    "snapshot {} [{}]",
                    kind.as_str(),
                    objects
                        .iter()
                        .map(|o| o.key().to_string())
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
                Update::Apply(o) => format!("apply {} {}", o.kind().as_str(), o.key()),
                Update::Delete { kind, key } => format!("delete {} {key}", kind.as_str()),
            })
            .collect()
    }

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{name: http, port: 80}]\n";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.0.0.1]}]\n";

    #[test]
    fn first_scan_snapshots_then_diffs() {
        let tmp = tempdir();
        let metrics = SourceCounters::default();
        write(&tmp, "web.yaml", &format!("{SVC}---\n{SLICE}"));
        write(&tmp, "notes.txt", "not a manifest");
        let mut dir = ManifestsDir::new(&tmp, metrics.clone());
        assert_eq!(
            names(&dir.scan().expect("scan")),
            [
                "snapshot Service [default/web]",
                "snapshot EndpointSlice [default/web-1]",
                "snapshot Node []"
            ]
        );
        assert!(dir.scan().expect("scan").is_empty(), "nothing changed");

        // Change the slice, add a second service in a new file as a List.
        write(
            &tmp,
            "web.yaml",
            &format!("{SVC}---\n{}", SLICE.replace("10.0.0.1", "10.0.0.2")),
        );
        write(
            &tmp,
            "more.json",
            r#"{"kind":"List","items":[{"apiVersion":"v1","kind":"Service","metadata":{"name":"dns","namespace":"kube-system"},"spec":{"clusterIP":"10.96.0.53","ports":[{"port":53,"protocol":"UDP"}]}}]}"#,
        );
        bump(&tmp.join("web.yaml"));
        let mut got = names(&dir.scan().expect("scan"));
        got.sort();
        assert_eq!(
            got,
            [
                "apply EndpointSlice default/web-1",
                "apply Service kube-system/dns"
            ]
        );

        // A broken file keeps its objects; fixing it later works.
        write(&tmp, "web.yaml", "kind: Service\nmetadata: [broken\n");
        bump(&tmp.join("web.yaml"));
        assert!(dir.scan().expect("scan").is_empty());
        assert_eq!(metrics.skipped_count("file", "parse_error"), 1);

        // Deleting the file deletes its objects.
        fs::remove_file(tmp.join("web.yaml")).expect("rm");
        let mut got = names(&dir.scan().expect("scan"));
        got.sort();
        assert_eq!(
            got,
            [
                "delete EndpointSlice default/web-1",
                "delete Service default/web"
            ]
        );
        fs::remove_dir_all(&tmp).expect("cleanup");
    }

    #[test]
    fn a_document_that_does_not_decode_is_skipped_alone() {
        let tmp = tempdir();
        let metrics = SourceCounters::default();
        let bad = "apiVersion: v1\nkind: Service\nmetadata: {name: bad}\nspec:\n  ports: [{port: eighty}]\n";
        write(&tmp, "mixed.yaml", &format!("{bad}---\n{SVC}"));
        let mut dir = ManifestsDir::new(&tmp, metrics.clone());
        let ups = names(&dir.scan().expect("scan"));
        assert_eq!(ups[0], "snapshot Service [default/web]");
        assert_eq!(metrics.skipped_count("Service", "decode_error"), 1);
        fs::remove_dir_all(&tmp).expect("cleanup");
    }

    #[test]
    fn a_definition_that_wins_again_is_read_back_from_its_file() {
        let tmp = tempdir();
        let metrics = SourceCounters::default();
        // b.yaml sorts after a.yaml, so its definition wins.
        write(&tmp, "a.yaml", SVC);
        write(&tmp, "b.yaml", &SVC.replace("10.96.0.10", "10.96.0.11"));
        let mut dir = ManifestsDir::new(&tmp, metrics);
        let first = dir.scan().expect("scan");
        let Update::Snapshot { objects, .. } = &first[0] else {
            panic!("snapshot first");
        };
        let Object::Service(svc) = &objects[0] else {
            panic!("a Service");
        };
        let ip = |s: &k8s_openapi::api::core::v1::Service| {
            s.spec.as_ref().and_then(|s| s.cluster_ip.clone())
        };
        assert_eq!(ip(svc).as_deref(), Some("10.96.0.11"));
        // b.yaml goes: a.yaml's definition (not read again by mtime) is sent.
        fs::remove_file(tmp.join("b.yaml")).expect("rm");
        let ups = dir.scan().expect("scan");
        assert_eq!(names(&ups), ["apply Service default/web"]);
        let Update::Apply(Object::Service(svc)) = &ups[0] else {
            panic!("apply");
        };
        assert_eq!(ip(svc).as_deref(), Some("10.96.0.10"));
        fs::remove_dir_all(&tmp).expect("cleanup");
    }

    #[test]
    fn each_bad_file_is_reported_once_per_change() {
        let tmp = tempdir();
        let metrics = SourceCounters::default();
        write(&tmp, "good.yaml", SVC);
        fs::write(
            tmp.join("latin1.yaml"),
            b"kind: Service\nmetadata: {name: caf\xe9}\n",
        )
        .expect("write");
        std::os::unix::fs::symlink(tmp.join("missing.yaml"), tmp.join("dangling.yaml"))
            .expect("symlink");
        std::os::unix::fs::symlink(tmp.join("loop-b.yaml"), tmp.join("loop-a.yaml"))
            .expect("symlink");
        std::os::unix::fs::symlink(tmp.join("loop-a.yaml"), tmp.join("loop-b.yaml"))
            .expect("symlink");
        let mut dir = ManifestsDir::new(&tmp, metrics.clone());
        let first = names(&dir.scan().expect("scan"));
        assert_eq!(first[0], "snapshot Service [default/web]");
        for _ in 0..20 {
            assert!(dir.scan().expect("scan").is_empty());
        }
        assert_eq!(
            metrics.skipped_count("file", "read_error"),
            1,
            "invalid UTF-8"
        );
        assert_eq!(
            metrics.skipped_count("file", "broken_link"),
            3,
            "the dangling link and both links of the loop"
        );
        // A change of the bad file is reported again, once.
        fs::write(
            tmp.join("latin1.yaml"),
            b"kind: Service\nmetadata: {name: \xff}\n",
        )
        .expect("write");
        bump(&tmp.join("latin1.yaml"));
        for _ in 0..5 {
            assert!(dir.scan().expect("scan").is_empty());
        }
        assert_eq!(metrics.skipped_count("file", "read_error"), 2);
        // The dangling link's target appears: its objects are read.
        fs::write(
            tmp.join("target.txt"),
            SVC.replace("name: web", "name: linked")
                .replace("10.96.0.10", "10.96.0.12"),
        )
        .expect("write");
        fs::remove_file(tmp.join("dangling.yaml")).expect("rm");
        std::os::unix::fs::symlink(tmp.join("target.txt"), tmp.join("dangling.yaml"))
            .expect("symlink");
        assert_eq!(
            names(&dir.scan().expect("scan")),
            ["apply Service default/linked"]
        );
        assert_eq!(metrics.skipped_count("file", "broken_link"), 3);
        fs::remove_dir_all(&tmp).expect("cleanup");
    }

    #[test]
    fn a_file_nested_too_deep_is_refused_before_parsing() {
        let tmp = tempdir();
        let metrics = SourceCounters::default();
        write(&tmp, "good.yaml", SVC);
        // 196 KiB nested 100,000 levels, as in the report.
        let deep = format!(
            "kind: Service\nspec: {}{}\n",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        write(&tmp, "deep.yaml", &deep);
        let compact = format!("kind: Service\nspec:\n{}x\n", "- ".repeat(100_000));
        write(&tmp, "compact.yaml", &compact);
        let mut dir = ManifestsDir::new(&tmp, metrics.clone());
        let start = std::time::Instant::now();
        let first = names(&dir.scan().expect("scan"));
        let took = start.elapsed();
        assert_eq!(first[0], "snapshot Service [default/web]");
        assert_eq!(metrics.skipped_count("file", "too_deep"), 2);
        assert!(took < Duration::from_secs(2), "{took:?}");
        // Brackets inside quotes and comments are text.
        let quoted = format!(
            "{SVC}metadata2: '{}' # {}\n",
            "[".repeat(200),
            "{".repeat(200)
        );
        assert_eq!(check_nesting(&quoted), Ok(()));
        assert!(check_nesting(&format!("a: {}", "[".repeat(MAX_NESTING + 1))).is_err());
        assert_eq!(
            check_nesting(&format!("a: {}", "[".repeat(MAX_NESTING))),
            Ok(())
        );
        fs::remove_dir_all(&tmp).expect("cleanup");
    }

    fn tempdir() -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "ebpf-proxy-manifests-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        fs::create_dir_all(&p).expect("mkdir");
        p
    }

    /// Moves the mtime forward so a rewrite within the same clock tick is seen.
    fn bump(path: &Path) {
        let f = fs::File::options().append(true).open(path).expect("open");
        let later = SystemTime::now() + Duration::from_secs(5);
        f.set_modified(later).expect("set mtime");
    }
}
