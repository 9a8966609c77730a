//! Which answer a request gets: its path routed to a kind (or `/version`, or one
//! object), its selectors and parameters read, then a list page, a watch to stream, or
//! an error `Status`.

use std::{collections::HashMap, sync::atomic::Ordering, time::Duration};

use serde_json::{json, Value};

use super::{
    http::{percent_decode, status, Request},
    list::list_page,
    selector::{parse_field_selector, parse_label_selector, Filter},
    store::{lock, Kind, Shared},
    watch::WatchRequest,
};

/// Watch length when the client sends no `timeoutSeconds` (the apiserver picks 30-60 min).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// What to answer.
pub(super) enum Reply {
    Json(u16, Value),
    /// A list page (200): written like `Json`, its first byte's time recorded.
    List(Kind, String),
    Watch(WatchRequest),
}

enum Route {
    Version,
    Collection(Kind, Option<String>),
    Object(Kind, Option<String>, String),
}

fn route(path: &str) -> Option<Route> {
    let segments: Vec<String> = path
        .trim_matches('/')
        .split('/')
        .map(percent_decode)
        .collect();
    let s: Vec<&str> = segments.iter().map(String::as_str).collect();
    let kind_of = |resource: &str| match resource {
        "services" => Some(Kind::Service),
        "nodes" => Some(Kind::Node),
        "pods" => Some(Kind::Pod),
        _ => None,
    };
    Some(match s[..] {
        ["version"] => Route::Version,
        ["api", "v1", "nodes"] => Route::Collection(Kind::Node, None),
        ["api", "v1", "nodes", name] => Route::Object(Kind::Node, None, name.to_owned()),
        ["api", "v1", "services"] => Route::Collection(Kind::Service, None),
        ["api", "v1", "pods"] => Route::Collection(Kind::Pod, None),
        ["api", "v1", "namespaces"] => Route::Collection(Kind::Namespace, None),
        ["api", "v1", "namespaces", name] => Route::Object(Kind::Namespace, None, name.to_owned()),
        ["api", "v1", "namespaces", ns, resource] => Route::Collection(
            kind_of(resource).filter(|k| k.namespaced())?,
            Some(ns.to_owned()),
        ),
        ["api", "v1", "namespaces", ns, resource, name] => Route::Object(
            kind_of(resource).filter(|k| k.namespaced())?,
            Some(ns.to_owned()),
            name.to_owned(),
        ),
        ["apis", "networking.k8s.io", "v1", "servicecidrs"] => {
            Route::Collection(Kind::ServiceCidr, None)
        }
        ["apis", "networking.k8s.io", "v1", "servicecidrs", name] => {
            Route::Object(Kind::ServiceCidr, None, name.to_owned())
        }
        ["apis", "discovery.k8s.io", "v1", "endpointslices"] => {
            Route::Collection(Kind::EndpointSlice, None)
        }
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices"] => {
            Route::Collection(Kind::EndpointSlice, Some(ns.to_owned()))
        }
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices", name] => {
            Route::Object(Kind::EndpointSlice, Some(ns.to_owned()), name.to_owned())
        }
        _ => return None,
    })
}

// Long: the request router: one match over kube-apiserver's paths and verbs, each arm one
// call.
pub(super) fn handle(shared: &Shared, request: &Request) -> Reply {
    let (path, query) = request
        .target
        .split_once('?')
        .unwrap_or((request.target.as_str(), ""));
    if request.method == "GET" {
        if let Some(document) = super::write::discovery(path) {
            return Reply::Json(200, document);
        }
    }
    let Some(route) = route(path) else {
        return Reply::Json(
            404,
            status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
    };
    if request.method != "GET" {
        let (code, body) = match route {
            Route::Collection(kind, namespace) => {
                super::write::write(shared, request, kind, namespace, None)
            }
            Route::Object(kind, namespace, name) => {
                super::write::write(shared, request, kind, namespace, Some(name))
            }
            Route::Version => (
                405,
                status(
                    405,
                    "MethodNotAllowed",
                    format!("{} /version", request.method),
                ),
            ),
        };
        return Reply::Json(code, body);
    }
    let params: HashMap<String, String> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect();
    let param = |name: &str| params.get(name).map(String::as_str).unwrap_or_default();

    let (kind, namespace) = match route {
        Route::Version => {
            return Reply::Json(
                200,
                json!({
                    "major": "1", "minor": "33", "gitVersion": "v1.33.0-fake",
                    "gitCommit": "0000000000000000000000000000000000000000",
                    "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z",
                    "goVersion": "go1.24.0", "compiler": "gc", "platform": "linux/amd64",
                }),
            )
        }
        Route::Object(kind, namespace, name) => {
            let key = (kind, namespace.unwrap_or_default(), name);
            return match lock(&shared.store).objects.get(&key) {
                Some(obj) => Reply::Json(200, obj.clone()),
                None => {
                    let mut not_found = status(
                        404,
                        "NotFound",
                        format!("{} \"{}\" not found", kind.resource(), key.2),
                    );
                    not_found["details"] = json!({"name": key.2, "kind": kind.resource()});
                    Reply::Json(404, not_found)
                }
            };
        }
        Route::Collection(kind, namespace) => (kind, namespace),
    };

    let labels = match parse_label_selector(param("labelSelector")) {
        Ok(labels) => labels,
        Err(e) => return Reply::Json(400, status(400, "BadRequest", e)),
    };
    let fields = match parse_field_selector(param("fieldSelector"), kind) {
        Ok(fields) => fields,
        Err(e) => return Reply::Json(400, status(400, "BadRequest", e)),
    };
    let filter = Filter {
        namespace,
        labels,
        fields,
    };

    if matches!(param("watch"), "true" | "1") {
        let since = match param("resourceVersion") {
            "" | "0" => None,
            rv => match rv.parse::<u64>() {
                Ok(rv) => Some(rv),
                Err(_) => {
                    return Reply::Json(
                        400,
                        status(400, "BadRequest", format!("invalid resource version: {rv}")),
                    )
                }
            },
        };
        let timeout = match param("timeoutSeconds").parse::<u64>() {
            Ok(secs) if secs > 0 => Duration::from_secs(secs),
            _ => DEFAULT_WATCH_TIMEOUT,
        };
        let initial_events = param("sendInitialEvents") == "true";
        if initial_events && param("resourceVersionMatch") != "NotOlderThan" {
            // kube-apiserver's validation of a watch-list request.
            return Reply::Json(
                422,
                status(
                    422,
                    "Invalid",
                    "sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless resourceVersionMatch is set to NotOlderThan",
                ),
            );
        }
        return Reply::Watch(WatchRequest {
            kind,
            filter,
            // With sendInitialEvents the initial state is sent whatever the version.
            since: if initial_events { None } else { since },
            bookmarks: param("allowWatchBookmarks") == "true",
            initial_events_end: initial_events,
            timeout,
        });
    }

    let mut store = lock(&shared.store);
    let page = match list_page(&store, kind, &filter, &params) {
        Ok(page) => page,
        Err((code, reason, message)) => return Reply::Json(code, status(code, reason, message)),
    };
    let mut metadata = json!({"resourceVersion": page.rv.to_string()});
    if let Some(token) = &page.continue_token {
        metadata["continue"] = token.clone().into();
        if shared
            .compact_after_pages
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            store.expire();
        }
    }
    let mut body = format!(
        r#"{{"kind":"{}List","apiVersion":"{}","metadata":{metadata},"items":["#,
        kind.name(),
        kind.api_version()
    );
    body.reserve(page.items.iter().map(|i| i.len() + 1).sum());
    for (i, item) in page.items.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(item);
    }
    body.push_str("]}");
    Reply::List(kind, body)
}
