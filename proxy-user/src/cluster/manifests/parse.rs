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
pub(super) fn check_nesting(text: &str) -> Result<(), String> {
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
    pub metrics: &'a SourceCounters,
    pub proxy_name: Option<&'a str>,
    /// Hashes an object's text (the same for every scan of the directory).
    pub hasher: &'a foldhash::fast::RandomState,
}

/// One parsed object: its kind, key (namespace defaulted), the object (Services and
/// EndpointSlices already reduced, as the API reader does) and a hash of its JSON text.
pub(super) type ParsedObject = (Kind, ObjKey, Object, u64);

/// Parses every document of a file into [`ParsedObject`]s; documents of other kinds are
/// ignored, documents that do not decode are logged, counted and skipped.
///
/// JSON (what the API server and generators write) is read in place: each document and
/// each `List` item as a borrowed slice of the text (`&RawValue`), each item decoded on its
/// own straight into the fields the proxy reads (`cluster::api_decode`) and reduced, so
/// no tree of the file is built and only the reduced objects are kept. Text that is not
/// JSON is YAML: one document at a time as a tree, then each object as above.
pub(super) fn parse_file(
    path: &Path,
    text: &str,
    how: Decoding<'_>,
) -> Result<Vec<ParsedObject>, String> {
    let mut out = Vec::new();
    if let Some(docs) = json_documents(text) {
        for doc in docs {
            parse_object(path, doc.get(), how, &mut out);
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
            for item in &doc.items {
                parse_object(path, item, how, &mut out);
            }
        } else {
            parse_object(path, &doc.head, how, &mut out);
        }
    }
    Ok(out)
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
fn parse_object(path: &Path, text: &str, how: Decoding<'_>, out: &mut Vec<ParsedObject>) {
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
            // One thread: decoding a long List in parts on two threads measured slower
            // on a loaded 2-core node (malloc arenas, the datapath's load alongside).
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
        warn!(file = %path.display(), "skipping a {} without metadata.name in {}", kind.as_str(), path.display());
        how.metrics
            .skipped(SkipKind::Object(kind), SkipReason::NoName);
        return;
    }
    let hash = std::hash::BuildHasher::hash_one(how.hasher, text);
    match api_decode::object_in(kind, text, how.proxy_name, &namespace) {
        Ok(obj) => out.push((kind, key, obj, hash)),
        Err(e) => {
            warn!(file = %path.display(), object = %key, "skipping {} {key} in {}: {e}", kind.as_str(), path.display());
            how.metrics
                .skipped(SkipKind::Object(kind), SkipReason::DecodeError);
        }
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
