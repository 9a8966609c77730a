//! Reading one manifest file: size and nesting checked before parsing, YAML/JSON
//! documents (`kind: List` included) decoded into typed objects, Services and
//! EndpointSlices reduced at once.

use std::{borrow::Cow, fs, io, path::Path};

use serde::Deserialize;
use serde_json::{value::RawValue, Value};
use tracing::{debug, warn};

use crate::cluster::{
    api_decode,
    counters::SourceCounters,
    skips::{SkipKind, SkipReason},
    Kind, ObjKey, Object,
};

/// The largest manifest file read (a bigger one is reported as `too_large`): 20,000
/// Services with 10 endpoints each take about 40 MiB of YAML.
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// The deepest nesting of YAML/JSON collections accepted (a deeper file is reported as
/// `too_deep` before it is parsed). A Service or EndpointSlice nests about 8 levels.
pub const MAX_NESTING: usize = 64;

/// The file as UTF-8 text (YAML and JSON must be).
pub(super) fn read_text(path: &Path) -> io::Result<String> {
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
///
/// Quotes end at the end of their line; a `#` after a blank (or at a line's start) starts
/// a comment. The bytes between the ones that matter (in a quote: its closing quote, a
/// backslash, a newline) are skipped by a table lookup each: a 40 MiB manifest is checked
/// at memory speed (it was 13 % of a 50,000-Service read byte by byte).
pub(super) fn check_nesting(text: &str) -> Result<(), String> {
    let b = text.as_bytes();
    let mut depth = 0usize;
    let too_deep = |line: usize| {
        Err(format!(
            "collections nested more than {MAX_NESTING} deep (line {line})"
        ))
    };
    let (mut line, mut i) = (1usize, 0usize);
    while i < b.len() {
        let dashes = compact_dashes(b, i);
        if dashes > MAX_NESTING || depth + dashes > MAX_NESTING {
            return too_deep(line);
        }
        // The rest of the line.
        let line_start = i;
        loop {
            i = next_of(b, i, OUTSIDE);
            let Some(&c) = b.get(i) else {
                return Ok(());
            };
            match c {
                b'\n' => break,
                b'#' => {
                    let prev = if i == line_start { b' ' } else { b[i - 1] };
                    if prev == b' ' || prev == b'\t' {
                        i = next_of(b, i, NEWLINE);
                        break;
                    }
                    i += 1;
                }
                b'"' => i = after_double_quoted(b, i),
                b'\'' => {
                    i = next_of(b, i + 1, IN_SINGLE);
                    if b.get(i) == Some(&b'\'') {
                        i += 1;
                    }
                }
                b'[' | b'{' => {
                    depth += 1;
                    if depth > MAX_NESTING {
                        return too_deep(line);
                    }
                    i += 1;
                }
                _ => {
                    // `]` or `}`
                    depth = depth.saturating_sub(1);
                    i += 1;
                }
            }
        }
        // At a newline (or the text's end).
        line += 1;
        i += 1;
    }
    Ok(())
}

/// The compact block sequences at the start of the line at `at` (`- - - x`: three).
fn compact_dashes(b: &[u8], mut at: usize) -> usize {
    let blank = |at: usize| {
        b[at..]
            .iter()
            .take_while(|&&c| c == b' ' || c == b'\t')
            .count()
    };
    at += blank(at);
    let mut dashes = 0usize;
    while b.get(at) == Some(&b'-') && matches!(b.get(at + 1), Some(b' ' | b'\t')) {
        dashes += 1;
        at += 1 + blank(at + 1);
    }
    dashes
}

/// Where the double-quoted string opened at `open` ends: after its closing quote, or at
/// its line's end (a newline, or the text's end). A backslash makes the next byte text,
/// but a newline still ends the line (and the quote).
fn after_double_quoted(b: &[u8], open: usize) -> usize {
    let mut i = open;
    loop {
        i = next_of(b, i + 1, IN_DOUBLE);
        match b.get(i) {
            Some(b'\\') => {
                i += 1;
                if matches!(b.get(i), None | Some(b'\n')) {
                    return i;
                }
            }
            Some(b'"') => return i + 1,
            _ => return i,
        }
    }
}

/// The first byte at or after `from` of `class` ([`NESTING_BYTES`]), or the text's end.
fn next_of(b: &[u8], from: usize, class: u8) -> usize {
    b[from..]
        .iter()
        .position(|&c| NESTING_BYTES[usize::from(c)] & class != 0)
        .map_or(b.len(), |p| from + p)
}

/// The bytes [`check_nesting`] stops at, by where it is: outside quotes, in a
/// double-quoted string, in a single-quoted one; a newline everywhere.
const NEWLINE: u8 = 1;
const OUTSIDE: u8 = 2 | NEWLINE;
const IN_DOUBLE: u8 = 4 | NEWLINE;
const IN_SINGLE: u8 = 8 | NEWLINE;
static NESTING_BYTES: [u8; 256] = {
    let mut t = [0u8; 256];
    t[b'\n' as usize] = NEWLINE;
    t[b'#' as usize] = 2;
    t[b'[' as usize] = 2;
    t[b'{' as usize] = 2;
    t[b']' as usize] = 2;
    t[b'}' as usize] = 2;
    t[b'"' as usize] = 2 | 4;
    t[b'\'' as usize] = 2 | 8;
    t[b'\\' as usize] = 4;
    t
};

/// The rule [`check_nesting`] implements, byte by byte as it was first written: the
/// reference its tests compare it with.
#[cfg(test)]
pub(super) fn check_nesting_by_bytes(text: &str) -> Result<(), String> {
    let mut depth = 0usize;
    let too_deep = |line: usize| {
        Err(format!(
            "collections nested more than {MAX_NESTING} deep (line {line})"
        ))
    };
    // Bytes, not chars: every byte looked for is ASCII, and no byte of a multi-byte
    // UTF-8 character is (a large file is checked at memory speed).
    for (line, l) in (1usize..).zip(text.as_bytes().split(|&b| b == b'\n')) {
        // Compact block sequences: `- - - x` is three levels on one line.
        let blank = |r: &[u8]| r.iter().take_while(|&&b| b == b' ' || b == b'\t').count();
        let mut rest = &l[blank(l)..];
        let mut dashes = 0usize;
        while let [b'-', b' ' | b'\t', r @ ..] = rest {
            dashes += 1;
            rest = &r[blank(r)..];
        }
        if dashes > MAX_NESTING || depth + dashes > MAX_NESTING {
            return too_deep(line);
        }
        let mut quote: Option<u8> = None;
        let mut prev = b' ';
        let mut bytes = l.iter().copied();
        while let Some(c) = bytes.next() {
            match quote {
                Some(b'"') if c == b'\\' => {
                    bytes.next();
                }
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None => match c {
                    b'#' if prev == b' ' || prev == b'\t' => break,
                    b'"' | b'\'' => quote = Some(c),
                    b'[' | b'{' => {
                        depth += 1;
                        if depth > MAX_NESTING {
                            return too_deep(line);
                        }
                    }
                    b']' | b'}' => depth = depth.saturating_sub(1),
                    _ => {}
                },
            }
            prev = c;
        }
    }
    Ok(())
}

/// How a file's objects are decoded: for the agent named `proxy_name` (the label
/// selection Services and EndpointSlices go through as they are reduced).
#[derive(Clone, Copy)]
pub(super) struct Decoding<'a> {
    pub proxy_name: Option<&'a str>,
    /// Hashes an object's text (the same for every scan of the directory).
    pub hasher: &'a foldhash::fast::RandomState,
}

/// One parsed object: its kind, key (namespace defaulted), the object (Services and
/// EndpointSlices already reduced, as the API reader does) and a hash of its JSON text.
pub(super) type ParsedObject = (Kind, ObjKey, Object, u64);

/// What decoding a document found: an object, or one that is skipped (the scan logs and
/// counts it, in the file's order, whichever thread decoded it).
pub(super) enum Found {
    Object(ParsedObject),
    Skipped(Skipped),
}

/// An object skipped: its kind, key (if it has a name), why, and the message naming it
/// and its file.
pub(super) struct Skipped {
    pub kind: Kind,
    pub key: Option<ObjKey>,
    pub reason: SkipReason<'static>,
    pub message: String,
}

impl Skipped {
    /// Logged and counted (`objects_skipped_total{kind,reason}`).
    pub(super) fn report(&self, path: &Path, metrics: &SourceCounters) {
        match &self.key {
            Some(key) => warn!(file = %path.display(), object = %key, "{}", self.message),
            None => warn!(file = %path.display(), "{}", self.message),
        }
        metrics.skipped(SkipKind::Object(self.kind), self.reason);
    }
}

/// Parses every document of a file, on this thread (the scan decodes the files it reads
/// on several: [`parse_files`]); documents of other kinds are ignored, documents that do
/// not decode are returned as [`Found::Skipped`].
pub(super) fn parse_file(path: &Path, text: &str, how: Decoding<'_>) -> Result<Vec<Found>, String> {
    let units = units(text)?
        .into_iter()
        .map(|text| Unit { file: 0, text })
        .collect::<Vec<_>>();
    Ok(decode_range(&units, &[path], how)
        .into_iter()
        .map(|(_, f)| f)
        .collect())
}

/// Decoding goes to several threads only past this many bytes of objects: below, the
/// threads' start costs more than they save.
const PARALLEL_MIN_BYTES: usize = 1 << 20;

/// Parses the files of one scan: their documents split into objects on this thread, the
/// objects decoded on up to `threads` threads (contiguous runs of about equal size), the
/// results per file in the files' and the objects' order, whatever `threads` is.
///
/// JSON (what the API server and generators write) is read in place: each document and
/// each `List` item as a borrowed slice of the text (`&RawValue`), each item decoded on
/// its own straight into the fields the proxy reads (`cluster::api_decode`) and reduced,
/// so no tree of the file is built and only the reduced objects are kept. Text that is
/// not JSON is YAML: one document at a time as a tree, each object turned into JSON text,
/// then decoded as above. `Err`: the file does not parse (its objects are not used).
/// Also returns how many threads decoded.
pub(super) fn parse_files(
    files: &[(&Path, &str)],
    how: Decoding<'_>,
    threads: usize,
) -> (Vec<Result<Vec<Found>, String>>, usize) {
    let mut out: Vec<Result<Vec<Found>, String>> = Vec::with_capacity(files.len());
    let mut all = Vec::new();
    for (i, (_, text)) in files.iter().enumerate() {
        match units(text) {
            Ok(us) => {
                all.extend(us.into_iter().map(|text| Unit {
                    file: i as u32,
                    text,
                }));
                out.push(Ok(Vec::new()));
            }
            Err(e) => out.push(Err(e)),
        }
    }
    let paths: Vec<&Path> = files.iter().map(|(p, _)| *p).collect();
    let (found, used) = decode_units(&all, &paths, how, threads);
    for (file, found) in found {
        if let Ok(v) = &mut out[file as usize] {
            v.push(found);
        }
    }
    (out, used)
}

/// One object's JSON text to decode (a document, or a `List`'s item), and its file.
struct Unit<'a> {
    file: u32,
    text: Cow<'a, str>,
}

/// Documents up to this size that may be `List`s are split into their items by the
/// worker that decodes them; a larger one here, so that its items spread over threads.
const SPLIT_LIST_BYTES: usize = 64 << 10;

/// The objects of a file to decode, in order: its documents, a large `List`'s items one
/// by one. `Err`: the file is neither JSON nor YAML (YAML's error names the document).
fn units(text: &str) -> Result<Vec<Cow<'_, str>>, String> {
    let mut out = Vec::new();
    // A large file of one JSON document (a generated List): its kind and items read in
    // one pass over the text, not a second one to split the documents first.
    let one = text.trim_matches(|c| matches!(c, ' ' | '\t' | '\n' | '\r'));
    if one.len() > SPLIT_LIST_BYTES && one.starts_with('{') {
        if let Ok(head) = serde_json::from_str::<Head>(one) {
            if is_list(&string(head.kind).unwrap_or_default()) {
                out.extend(head.items.0.iter().map(|i| Cow::Borrowed(i.get())));
            } else {
                out.push(Cow::Borrowed(one));
            }
            return Ok(out);
        }
    }
    if let Some(docs) = json_documents(text) {
        for doc in docs {
            let list = (doc.get().len() > SPLIT_LIST_BYTES)
                .then(|| serde_json::from_str::<Head>(doc.get()).ok())
                .flatten()
                .filter(|h| is_list(&string(h.kind).unwrap_or_default()));
            match list {
                Some(head) => out.extend(head.items.0.iter().map(|i| Cow::Borrowed(i.get()))),
                None => out.push(Cow::Borrowed(doc.get())),
            }
        }
        return Ok(out);
    }
    // One document at a time, a List's items one at a time: a large file as trees at once
    // would be most of the agent's peak memory.
    for doc in super::yaml::documents(text) {
        let Some(doc) = doc? else {
            continue;
        };
        let kind = serde_json::from_str::<Head>(&doc.head)
            .ok()
            .and_then(|h| string(h.kind))
            .unwrap_or_default();
        if is_list(&kind) {
            out.extend(doc.items.into_iter().map(Cow::Owned));
        } else {
            out.push(Cow::Owned(doc.head));
        }
    }
    Ok(out)
}

/// Decodes `units` on up to `threads` threads (this one included), each a contiguous run
/// of about equal bytes; the results in the units' order, each with its file, and how
/// many threads decoded.
fn decode_units(
    units: &[Unit<'_>],
    paths: &[&Path],
    how: Decoding<'_>,
    threads: usize,
) -> (Vec<(u32, Found)>, usize) {
    let bytes: usize = units.iter().map(|u| u.text.len()).sum();
    let workers = if bytes < PARALLEL_MIN_BYTES {
        1
    } else {
        threads.clamp(1, units.len().max(1))
    };
    if workers == 1 {
        return (decode_range(units, paths, how), 1);
    }
    let parts = split(units, bytes, workers);
    let out = std::thread::scope(|s| {
        let others: Vec<_> = parts[1..]
            .iter()
            .map(|part| {
                let run = move || decode_range(part, paths, how);
                (
                    part,
                    std::thread::Builder::new()
                        .name("manifests-parse".into())
                        .spawn_scoped(s, run),
                )
            })
            .collect();
        let mut out = decode_range(parts[0], paths, how);
        for (part, worker) in others {
            match worker {
                Ok(h) => out.extend(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))),
                // No thread to be had: decoded here.
                Err(_) => out.extend(decode_range(part, paths, how)),
            }
        }
        out
    });
    (out, parts.len())
}

/// `units` (of `bytes` bytes of text) in `workers` contiguous runs of about equal bytes.
fn split<'u, 'a>(units: &'u [Unit<'a>], bytes: usize, workers: usize) -> Vec<&'u [Unit<'a>]> {
    let mut parts = Vec::with_capacity(workers);
    let (mut start, mut sum) = (0, 0);
    for (i, u) in units.iter().enumerate() {
        sum += u.text.len();
        if parts.len() + 1 < workers && sum * workers >= bytes * (parts.len() + 1) {
            parts.push(&units[start..=i]);
            start = i + 1;
        }
    }
    parts.push(&units[start..]);
    parts
}

/// Decodes `units` on this thread, in order.
fn decode_range(units: &[Unit<'_>], paths: &[&Path], how: Decoding<'_>) -> Vec<(u32, Found)> {
    let mut out = Vec::with_capacity(units.len());
    let mut found = Vec::new();
    for u in units {
        parse_object(paths[u.file as usize], &u.text, how, &mut found);
        out.extend(found.drain(..).map(|f| (u.file, f)));
    }
    out
}

/// The kinds of document whose `items` are objects.
fn is_list(kind: &str) -> bool {
    matches!(
        kind,
        "List" | "ServiceList" | "EndpointSliceList" | "NodeList" | "PodList" | "NamespaceList"
    )
}

/// The file's JSON documents (one or more values, whitespace between), borrowed from the
/// text; `None` if it is not JSON throughout (then it is read as YAML, which also names
/// the error of a file that is neither).
fn json_documents(text: &str) -> Option<Vec<&RawValue>> {
    let first = text.trim_start().as_bytes().first()?;
    if !matches!(first, b'{' | b'[') {
        return None;
    }
    serde_json::Deserializer::from_str(text)
        .into_iter::<&RawValue>()
        .collect::<Result<Vec<_>, _>>()
        .ok()
}

/// The fields of a document read before decoding it, each still raw so that a field of
/// an unexpected type is read as absent (as the YAML tree's lookups did), not an error.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow)]
    kind: Option<&'a RawValue>,
    #[serde(borrow)]
    metadata: Option<&'a RawValue>,
    #[serde(borrow, default)]
    items: Items<'a>,
}

/// A document's `items`: each item's raw text if it is an array, else none (as the YAML
/// tree's lookup read it). Read in the same pass as the rest of the document.
#[derive(Default)]
struct Items<'a>(Vec<&'a RawValue>);

impl<'de: 'a, 'a> Deserialize<'de> for Items<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = Items<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Items<'a>, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<&'de RawValue>()? {
                    items.push(item);
                }
                Ok(Items(items))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Items<'a>, A::Error> {
                use serde::de::IgnoredAny;
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Items::default())
            }
            fn visit_bool<E>(self, _: bool) -> Result<Items<'a>, E> {
                Ok(Items::default())
            }
            fn visit_i64<E>(self, _: i64) -> Result<Items<'a>, E> {
                Ok(Items::default())
            }
            fn visit_u64<E>(self, _: u64) -> Result<Items<'a>, E> {
                Ok(Items::default())
            }
            fn visit_f64<E>(self, _: f64) -> Result<Items<'a>, E> {
                Ok(Items::default())
            }
            fn visit_str<E>(self, _: &str) -> Result<Items<'a>, E> {
                Ok(Items::default())
            }
            fn visit_unit<E>(self) -> Result<Items<'a>, E> {
                Ok(Items::default())
            }
        }
        d.deserialize_any(Visit(std::marker::PhantomData))
    }
}

#[derive(Deserialize, Default)]
struct HeadMeta<'a> {
    #[serde(borrow)]
    name: Option<&'a RawValue>,
    #[serde(borrow)]
    namespace: Option<&'a RawValue>,
}

/// A raw JSON string's value; `None` for anything else.
fn string(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
    raw.and_then(|r| serde_json::from_str::<Cow<str>>(r.get()).ok())
}

/// One document's JSON text (a `List`'s items in order) into `out`.
fn parse_object(path: &Path, text: &str, how: Decoding<'_>, out: &mut Vec<Found>) {
    let Ok(head) = serde_json::from_str::<Head>(text) else {
        debug!(file = %path.display(), "ignoring a document that is not an object");
        return;
    };
    let kind = string(head.kind).unwrap_or_default();
    let kind = match kind.as_ref() {
        "Service" => Kind::Service,
        "EndpointSlice" => Kind::EndpointSlice,
        "Node" => Kind::Node,
        // For the socket-LB bypass (`crate::podbypass`), not the syncer.
        "Pod" => Kind::Pod,
        "Namespace" => Kind::Namespace,
        list if is_list(list) => {
            for item in head.items.0 {
                parse_object(path, item.get(), how, out);
            }
            return;
        }
        other => {
            debug!(file = %path.display(), kind = other, "ignoring a document of another kind");
            return;
        }
    };
    let meta: HeadMeta = head
        .metadata
        .and_then(|m| serde_json::from_str(m.get()).ok())
        .unwrap_or_default();
    let name = string(meta.name).unwrap_or_default();
    let namespace = match kind {
        Kind::Node => Cow::Borrowed(""),
        _ => string(meta.namespace).unwrap_or(Cow::Borrowed("default")),
    };
    let key = ObjKey::new(&namespace, &name);
    if name.is_empty() {
        out.push(Found::Skipped(Skipped {
            kind,
            key: None,
            reason: SkipReason::NoName,
            message: format!(
                "skipping a {} without metadata.name in {}",
                kind.as_str(),
                path.display()
            ),
        }));
        return;
    }
    let hash = std::hash::BuildHasher::hash_one(how.hasher, text);
    match api_decode::object_in(kind, text, how.proxy_name, &namespace) {
        Ok(obj) => out.push(Found::Object((kind, key, obj, hash))),
        Err(e) => out.push(Found::Skipped(Skipped {
            kind,
            message: format!(
                "skipping {} {key} in {}: {e}",
                kind.as_str(),
                path.display()
            ),
            key: Some(key),
            reason: SkipReason::DecodeError,
        })),
    }
}

/// Decodes a JSON object into the typed object of its kind.
pub fn decode(kind: Kind, v: Value) -> Result<Object, serde_json::Error> {
    Ok(match kind {
        Kind::Service => Object::Service(Box::new(serde_json::from_value(v)?)),
        Kind::EndpointSlice => Object::Slice(Box::new(serde_json::from_value(v)?)),
        Kind::Node => Object::Node(Box::new(serde_json::from_value(v)?)),
        // Not read from a manifests directory (`--service-cluster-ip-range` is its
        // source); decoded as the API reader does, should a caller ask.
        Kind::ServiceCidr | Kind::Pod | Kind::Namespace => {
            crate::cluster::api_decode::object(kind, &v.to_string(), None)?
        }
    })
}
