//! Writes through the API, as kubectl makes them: create (POST to the collection), update
//! (PUT), patch (PATCH: JSON merge patch, and strategic merge patch treated as a merge
//! patch, which it is for these kinds' fields except lists with merge keys, replaced
//! whole here), delete (DELETE, answered with the deleted object). Validation answers as
//! kube-apiserver does: 400 for a body that is not JSON, 404 for a missing object, 409
//! `AlreadyExists`, 415 for JSON patch, 422 `Invalid` for a kind, apiVersion, name or
//! namespace that does not match the path.

use serde_json::{json, Value};

use super::{
    http::{status, Request},
    store::{apply_locked, delete_locked, lock, Kind, Shared},
};

type Reply = (u16, Value);

fn not_found(kind: Kind, name: &str) -> Reply {
    let mut body = status(
        404,
        "NotFound",
        format!("{} \"{name}\" not found", kind.resource()),
    );
    body["details"] = json!({"name": name, "kind": kind.resource()});
    (404, body)
}

fn invalid(kind: Kind, name: &str, message: String) -> Reply {
    let mut body = status(
        422,
        "Invalid",
        format!("{} \"{name}\" is invalid: {message}", kind.name()),
    );
    body["details"] = json!({"name": name, "kind": kind.name()});
    (422, body)
}

fn body_json(request: &Request) -> Result<Value, Reply> {
    serde_json::from_slice(&request.body).map_err(|e| {
        (
            400,
            status(
                400,
                "BadRequest",
                format!("the body of the request was in an unknown format: {e}"),
            ),
        )
    })
}

/// Checks the object against the path it was sent to; fills in the namespace.
fn check(
    kind: Kind,
    namespace: &str,
    name: Option<&str>,
    obj: &mut Value,
) -> Result<String, Reply> {
    let obj_name = obj["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if !obj.is_object() || !obj["metadata"].is_object() {
        return Err(invalid(kind, "", "metadata: Required value".into()));
    }
    if obj_name.is_empty() {
        return Err(invalid(
            kind,
            "",
            "metadata.name: Required value: name or generateName is required".into(),
        ));
    }
    if let Some(name) = name {
        if name != obj_name {
            return Err((
                400,
                status(
                    400,
                    "BadRequest",
                    format!("the name of the object ({obj_name}) does not match the name on the URL ({name})"),
                ),
            ));
        }
    }
    match obj["kind"].as_str() {
        Some(k) if k == kind.name() => {}
        other => {
            return Err(invalid(
                kind,
                &obj_name,
                format!("kind: Invalid value: {other:?}: must be {}", kind.name()),
            ))
        }
    }
    match obj["apiVersion"].as_str() {
        Some(v) if v == kind.api_version() => {}
        other => {
            return Err(invalid(
                kind,
                &obj_name,
                format!(
                    "apiVersion: Invalid value: {other:?}: must be {}",
                    kind.api_version()
                ),
            ))
        }
    }
    if kind.namespaced() {
        match obj["metadata"]["namespace"].as_str() {
            None | Some("") => obj["metadata"]["namespace"] = namespace.into(),
            Some(ns) if ns == namespace => {}
            Some(ns) => {
                return Err((
                    400,
                    status(
                        400,
                        "BadRequest",
                        format!("the namespace of the provided object ({ns}) does not match the namespace sent on the request ({namespace})"),
                    ),
                ))
            }
        }
    }
    Ok(obj_name)
}

/// RFC 7386: objects merge key by key, `null` deletes, anything else replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(patch) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let Some(target) = target.as_object_mut() else {
        return;
    };
    for (key, value) in patch {
        // Strategic merge patch directives ($patch, $setElementOrder/..., $retainKeys).
        if key.starts_with('$') {
            continue;
        }
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Serves a write to a collection (`name` None: POST) or an object.
// Long: kube-apiserver's write verbs (create, update, patch, delete) in one dispatch, each
// arm a few lines.
pub(super) fn write(
    shared: &Shared,
    request: &Request,
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
) -> Reply {
    let namespace = namespace.unwrap_or_default();
    let ns_key = if kind.namespaced() {
        namespace.clone()
    } else {
        String::new()
    };
    match (request.method.as_str(), name) {
        ("POST", None) => {
            let mut obj = match body_json(request) {
                Ok(obj) => obj,
                Err(reply) => return reply,
            };
            let name = match check(kind, &namespace, None, &mut obj) {
                Ok(name) => name,
                Err(reply) => return reply,
            };
            let mut store = lock(&shared.store);
            let key = (kind, ns_key, name.clone());
            if store.objects.contains_key(&key) {
                let mut body = status(
                    409,
                    "AlreadyExists",
                    format!("{} \"{name}\" already exists", kind.resource()),
                );
                body["details"] = json!({"name": name, "kind": kind.resource()});
                return (409, body);
            }
            if let Some(meta) = obj["metadata"].as_object_mut() {
                // Server-set fields are the server's.
                meta.remove("resourceVersion");
                meta.remove("uid");
                meta.remove("creationTimestamp");
            }
            apply_locked(&mut store, obj);
            (201, store.objects[&key].clone())
        }
        ("PUT", Some(name)) => {
            let mut obj = match body_json(request) {
                Ok(obj) => obj,
                Err(reply) => return reply,
            };
            if let Err(reply) = check(kind, &namespace, Some(&name), &mut obj) {
                return reply;
            }
            let mut store = lock(&shared.store);
            let key = (kind, ns_key, name.clone());
            let Some(current) = store.objects.get(&key) else {
                return not_found(kind, &name);
            };
            let sent_rv = obj["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default();
            if !sent_rv.is_empty() && sent_rv != current["metadata"]["resourceVersion"] {
                let mut body = status(
                    409,
                    "Conflict",
                    format!("Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again", kind.resource()),
                );
                body["details"] = json!({"name": name, "kind": kind.resource()});
                return (409, body);
            }
            apply_locked(&mut store, obj);
            (200, store.objects[&key].clone())
        }
        ("PATCH", Some(name)) => {
            let content_type = request
                .content_type
                .split(';')
                .next()
                .unwrap_or_default()
                .trim();
            if !matches!(
                content_type,
                "application/merge-patch+json" | "application/strategic-merge-patch+json"
            ) {
                return (
                    415,
                    status(
                        415,
                        "UnsupportedMediaType",
                        format!("the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (the fake apiserver does not serve {content_type:?})"),
                    ),
                );
            }
            let patch = match body_json(request) {
                Ok(patch) => patch,
                Err(reply) => return reply,
            };
            let mut store = lock(&shared.store);
            let key = (kind, ns_key, name.clone());
            let Some(mut obj) = store.objects.get(&key).cloned() else {
                return not_found(kind, &name);
            };
            merge_patch(&mut obj, &patch);
            if let Err(reply) = check(kind, &namespace, Some(&name), &mut obj) {
                return reply;
            }
            apply_locked(&mut store, obj);
            (200, store.objects[&key].clone())
        }
        ("DELETE", Some(name)) => {
            let mut store = lock(&shared.store);
            match delete_locked(&mut store, &(kind, ns_key, name.clone())) {
                Some(last) => (200, last),
                None => not_found(kind, &name),
            }
        }
        (method, _) => (
            405,
            status(
                405,
                "MethodNotAllowed",
                format!("the fake apiserver does not serve {method} here"),
            ),
        ),
    }
}

/// Discovery documents for `/api`, `/apis`, `/api/v1` and `/apis/discovery.k8s.io/v1`
/// (the legacy, non-aggregated form, which kubectl falls back to), and the little of
/// `/openapi/v3` kubectl reads before a create or patch.
pub(super) fn discovery(path: &str) -> Option<Value> {
    let verbs = json!(["create", "delete", "get", "list", "patch", "update", "watch"]);
    let resource = |name: &str, kind: &str, namespaced: bool, short: &[&str]| {
        json!({"name": name, "singularName": kind.to_ascii_lowercase(), "namespaced": namespaced,
               "kind": kind, "verbs": verbs, "shortNames": short})
    };
    let group = json!({"name": "discovery.k8s.io",
        "versions": [{"groupVersion": "discovery.k8s.io/v1", "version": "v1"}],
        "preferredVersion": {"groupVersion": "discovery.k8s.io/v1", "version": "v1"}});
    let networking = json!({"name": "networking.k8s.io",
        "versions": [{"groupVersion": "networking.k8s.io/v1", "version": "v1"}],
        "preferredVersion": {"groupVersion": "networking.k8s.io/v1", "version": "v1"}});
    let patch_op = |group: &str, kind: &str| {
        json!({"patch": {
            "x-kubernetes-group-version-kind": {"group": group, "version": "v1", "kind": kind},
            "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
            "responses": {}
        }})
    };
    let openapi = |paths: Value| json!({"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.33.0-fake"}, "paths": paths});
    Some(match path.trim_end_matches('/') {
        // OpenAPI v3, only as far as kubectl reads it to learn that the server validates
        // fields itself (`fieldValidation` on each kind's PATCH), so that it needs no
        // schema to validate on its side. The parameter is accepted and not enforced.
        "/openapi/v3" => json!({"paths": {
            "api/v1": {"serverRelativeURL": "/openapi/v3/api/v1"},
            "apis/discovery.k8s.io/v1": {"serverRelativeURL": "/openapi/v3/apis/discovery.k8s.io/v1"},
            "apis/networking.k8s.io/v1": {"serverRelativeURL": "/openapi/v3/apis/networking.k8s.io/v1"},
        }}),
        "/openapi/v3/apis/networking.k8s.io/v1" => openapi(json!({
            "/apis/networking.k8s.io/v1/servicecidrs/{name}":
                patch_op("networking.k8s.io", "ServiceCIDR"),
        })),
        "/openapi/v3/api/v1" => openapi(json!({
            "/api/v1/namespaces/{namespace}/services/{name}": patch_op("", "Service"),
            "/api/v1/nodes/{name}": patch_op("", "Node"),
            "/api/v1/namespaces/{namespace}/pods/{name}": patch_op("", "Pod"),
            "/api/v1/namespaces/{name}": patch_op("", "Namespace"),
        })),
        "/openapi/v3/apis/discovery.k8s.io/v1" => openapi(json!({
            "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{name}":
                patch_op("discovery.k8s.io", "EndpointSlice"),
        })),
        "/api" => json!({"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}),
        "/apis" => {
            json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group, networking]})
        }
        "/apis/discovery.k8s.io" => {
            let mut g = group;
            g["kind"] = "APIGroup".into();
            g["apiVersion"] = "v1".into();
            g
        }
        "/api/v1" => json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": [
            resource("services", "Service", true, &["svc"]),
            resource("nodes", "Node", false, &["no"]),
            resource("pods", "Pod", true, &["po"]),
            resource("namespaces", "Namespace", false, &["ns"]),
        ]}),
        "/apis/networking.k8s.io" => {
            let mut g = networking;
            g["kind"] = "APIGroup".into();
            g["apiVersion"] = "v1".into();
            g
        }
        "/apis/networking.k8s.io/v1" => json!({"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": "networking.k8s.io/v1", "resources": [
            resource("servicecidrs", "ServiceCIDR", false, &[]),
        ]}),
        "/apis/discovery.k8s.io/v1" => json!({"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": "discovery.k8s.io/v1", "resources": [
            resource("endpointslices", "EndpointSlice", true, &[]),
        ]}),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut target = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge_patch(
            &mut target,
            &json!({"a": "z", "c": {"f": null}, "l": [3], "$patch": "x"}),
        );
        assert_eq!(target, json!({"a": "z", "c": {"d": "e"}, "l": [3]}));
    }
}
