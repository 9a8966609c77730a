//! Reading one manifest file: size and nesting checked before parsing, YAML/JSON
//! documents (`kind: List` included) decoded into typed objects.

use std::{fs, io, path::Path};

use serde::Deserialize as _;
use serde_json::Value;
use tracing::{debug, warn};

use crate::cluster::{
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
pub(super) fn parse_file(
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
pub(super) fn parse_doc(
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
            // For the socket-LB bypass (`crate::podbypass`), not the syncer.
            "Pod" => Kind::Pod,
            "Namespace" => Kind::Namespace,
            "List" | "ServiceList" | "EndpointSliceList" | "NodeList" | "PodList"
            | "NamespaceList" => {
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
            metrics.skipped(SkipKind::Object(kind), SkipReason::NoName);
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
                metrics.skipped(SkipKind::Object(kind), SkipReason::DecodeError);
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
        // Not read from a manifests directory (`--service-cluster-ip-range` is its
        // source); decoded as the API reader does, should a caller ask.
        Kind::ServiceCidr | Kind::Pod | Kind::Namespace => {
            crate::cluster::api_decode::object(kind, &v.to_string(), None)?
        }
    })
}
