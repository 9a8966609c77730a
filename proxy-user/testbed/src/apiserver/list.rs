//! List pages (see the module documentation of `apiserver`): which snapshot a request
//! reads (`resourceVersion`, `resourceVersionMatch`, `continue`), the snapshot rebuilt
//! from the current objects and the history, paged by `limit` with continue tokens.

use std::{
    collections::{BTreeMap, HashMap},
    ops::Bound,
    sync::Arc,
};

use serde_json::Value;

use super::{
    selector::Filter,
    store::{Kind, Store},
};

/// One page of a list.
pub(super) struct Page {
    /// The snapshot it was served from.
    pub(super) rv: u64,
    /// Each item as JSON text.
    pub(super) items: Vec<Arc<str>>,
    pub(super) continue_token: Option<String>,
}

/// A continue token: the snapshot's resourceVersion and the last key served, hex-encoded
/// (opaque to clients, as kube-apiserver's base64 JSON is).
fn encode_continue(rv: u64, namespace: &str, name: &str) -> String {
    format!("{rv}\n{namespace}\n{name}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_continue(token: &str) -> Option<(u64, String, String)> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let mut parts = text.splitn(3, '\n');
    let rv = parts.next()?.parse().ok()?;
    Some((rv, parts.next()?.to_owned(), parts.next()?.to_owned()))
}

/// An error answer: code, reason, message.
pub(super) type ListError = (u16, &'static str, String);

fn too_large(rv: u64, current: u64) -> ListError {
    (
        504,
        "Timeout",
        format!("Too large resource version: {rv}, current: {current}"),
    )
}

/// The message kube-apiserver sends with the 410 for a compacted continue token.
const CONTINUE_EXPIRED: &str = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.";

/// Which snapshot a list request reads (`at`), from which key on (`after`, exclusive,
/// namespace and name), and whether `limit` applies.
type ListStart = (u64, Option<(String, String)>, bool);

/// The [`ListStart`] of a list request.
fn list_start(store: &Store, params: &HashMap<String, String>) -> Result<ListStart, ListError> {
    let param = |name: &str| params.get(name).map(String::as_str).unwrap_or_default();
    let (rv_param, rv_match, token) = (
        param("resourceVersion"),
        param("resourceVersionMatch"),
        param("continue"),
    );
    let parse_rv = |rv: &str| {
        rv.parse::<u64>()
            .map_err(|_| (400, "BadRequest", format!("invalid resource version: {rv}")))
    };
    if !token.is_empty() {
        if !rv_param.is_empty() {
            return Err((
                400,
                "BadRequest",
                "specifying resource version is not allowed when using continue".into(),
            ));
        }
        let Some((rv, namespace, name)) = decode_continue(token) else {
            return Err((400, "BadRequest", "continue key is not valid".into()));
        };
        if rv < store.oldest_rv {
            return Err((410, "Expired", CONTINUE_EXPIRED.into()));
        }
        return Ok((rv, Some((namespace, name)), true));
    }
    Ok(match (rv_param, rv_match) {
        ("", "") => (store.rv, None, true),
        ("", _) => {
            return Err((
                400,
                "BadRequest",
                "resourceVersionMatch is forbidden unless resourceVersion is provided".into(),
            ))
        }
        // Any version: kube-apiserver serves it from its watch cache, whole.
        ("0", "" | "NotOlderThan") => (store.rv, None, false),
        (rv, "" | "NotOlderThan") => {
            let rv = parse_rv(rv)?;
            if rv > store.rv {
                return Err(too_large(rv, store.rv));
            }
            (store.rv, None, true)
        }
        (rv, "Exact") => {
            let rv = parse_rv(rv)?;
            if rv > store.rv {
                return Err(too_large(rv, store.rv));
            }
            if rv < store.oldest_rv {
                return Err((
                    410,
                    "Expired",
                    format!("too old resource version: {rv} ({})", store.oldest_rv),
                ));
            }
            (rv, None, true)
        }
        (_, other) => {
            return Err((
                400,
                "BadRequest",
                format!("unsupported resourceVersionMatch: {other}"),
            ))
        }
    })
}

/// The page a list request gets (see the module documentation for the semantics).
// Long: one paged list as kube-apiserver answers it (selectors, limit, continue token,
// resourceVersion semantics); the steps share the page state.
pub(super) fn list_page(
    store: &Store,
    kind: Kind,
    filter: &Filter,
    params: &HashMap<String, String>,
) -> Result<Page, ListError> {
    let param = |name: &str| params.get(name).map(String::as_str).unwrap_or_default();
    let limit = match param("limit") {
        "" => None,
        l => match l.parse::<usize>() {
            Ok(0) => None,
            Ok(l) => Some(l),
            Err(_) => return Err((400, "BadRequest", format!("invalid limit: {l}"))),
        },
    };
    let (at, after, paged) = list_start(store, params)?;
    let limit = limit.filter(|_| paged);

    // The snapshot at `at`: the current objects, with every key written after `at` put
    // back to its state before its first write after `at` (None: it did not exist).
    let mut overrides: BTreeMap<(&str, &str), Option<&Value>> = BTreeMap::new();
    let first_after = store.history.partition_point(|c| c.rv <= at);
    for change in store.history[first_after..].iter().rev() {
        if change.kind != kind {
            continue;
        }
        let Some(obj) = change.after.as_ref().or(change.before.as_ref()) else {
            continue;
        };
        let meta = &obj["metadata"];
        let key = (
            meta["namespace"].as_str().unwrap_or_default(),
            meta["name"].as_str().unwrap_or_default(),
        );
        overrides.insert(key, change.before.as_ref());
    }
    let start = match &after {
        Some((namespace, name)) => Bound::Excluded((kind, namespace.clone(), name.clone())),
        None => Bound::Included((kind, String::new(), String::new())),
    };
    let mut current = store
        .objects
        .range((start.clone(), Bound::Unbounded))
        .take_while(|((k, _, _), _)| *k == kind)
        // `encoded` has the same keys as `objects`.
        .zip(store.encoded.range((start, Bound::Unbounded)))
        .map(|(((_, ns, name), v), (_, text))| ((ns.as_str(), name.as_str()), Some(v), Some(text)))
        .peekable();
    let after_key = after
        .as_ref()
        .map(|(ns, name)| (ns.as_str(), name.as_str()));
    let mut older = overrides
        .iter()
        .filter(|(key, _)| after_key.is_none_or(|a| **key > a))
        .map(|(key, v)| (*key, *v, None))
        .peekable();
    let mut items = Vec::new();
    let mut last = None;
    loop {
        // The next key of the snapshot, from whichever side has the smaller one (an
        // override wins over the current state of the same key).
        let next = match (current.peek(), older.peek()) {
            (None, None) => break,
            (Some(c), Some(o)) if c.0 == o.0 => {
                current.next();
                older.next()
            }
            (Some(c), Some(o)) if o.0 < c.0 => older.next(),
            (Some(_), _) => current.next(),
            (None, Some(_)) => older.next(),
        };
        let Some((key, Some(obj), current)) = next else {
            continue;
        };
        if !filter.matches(obj) {
            continue;
        }
        if limit.is_some_and(|l| items.len() >= l) {
            // More remain: the token resumes after the last key served.
            let (ns, name) = last.unwrap_or(key);
            return Ok(Page {
                rv: at,
                items,
                continue_token: Some(encode_continue(at, ns, name)),
            });
        }
        let text = match current {
            Some(text) => Arc::clone(text),
            // An older state of the object (a snapshot before later writes).
            None => Arc::from(obj.to_string()),
        };
        items.push(text);
        last = Some(key);
    }
    Ok(Page {
        rv: at,
        items,
        continue_token: None,
    })
}
