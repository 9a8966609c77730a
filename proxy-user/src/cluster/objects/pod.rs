//! Pods and Namespaces as the socket-LB bypass (`crate::podbypass`) reads them: reduced
//! right after decoding to their key, uid, labels and the few fields it needs.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::cluster::ObjKey;

/// A Pod as the bypass reads it: nothing but its key, uid, labels and whether it has
/// finished (its cgroup is gone).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    pub key: ObjKey,
    pub uid: String,
    pub labels: BTreeMap<String, String>,
    /// `status.phase` is `Succeeded` or `Failed`.
    pub finished: bool,
    /// `spec.nodeName` (the API watch selects this node's; a manifests directory may
    /// hold any node's).
    pub node: Option<String>,
    /// `spec.hostNetwork`: its sockets are in the host's network namespace, whose traffic
    /// has no pod interface to be translated on, so it is never bypassed.
    pub host_network: bool,
}

/// A Namespace as the bypass reads it: its name (the key's name) and labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceInfo {
    pub key: ObjKey,
    pub labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Item {
    #[serde(default)]
    metadata: ItemMeta,
    spec: Option<ItemSpec>,
    status: Option<ItemStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ItemSpec {
    #[serde(default)]
    host_network: bool,
    node_name: Option<String>,
}

#[derive(Deserialize, Default)]
struct ItemMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    labels: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct ItemStatus {
    phase: Option<String>,
}

/// A Pod from its JSON: only metadata's name, namespace, uid, labels and `status.phase`
/// are decoded (the spec, annotations and the rest are skipped unread).
pub fn decode_pod(json: &str) -> Result<PodInfo, serde_json::Error> {
    let item: Item = serde_json::from_str(json)?;
    let m = item.metadata;
    let uid = m
        .uid
        .filter(|u| !u.is_empty())
        .ok_or_else(|| <serde_json::Error as serde::de::Error>::custom("metadata.uid missing"))?;
    let phase = item.status.and_then(|s| s.phase);
    Ok(PodInfo {
        key: ObjKey::new(m.namespace.unwrap_or_default(), m.name.unwrap_or_default()),
        uid,
        labels: m.labels.unwrap_or_default(),
        finished: matches!(phase.as_deref(), Some("Succeeded" | "Failed")),
        host_network: item.spec.as_ref().is_some_and(|s| s.host_network),
        node: item.spec.and_then(|s| s.node_name),
    })
}

/// A Namespace from its JSON: its name and labels.
pub fn decode_namespace(json: &str) -> Result<NamespaceInfo, serde_json::Error> {
    let item: Item = serde_json::from_str(json)?;
    Ok(NamespaceInfo {
        key: ObjKey::new("", item.metadata.name.unwrap_or_default()),
        labels: item.metadata.labels.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_decoded_to_its_key_uid_labels_phase_and_host_network() {
        let p = decode_pod(
            r#"{"metadata": {"name": "p", "namespace": "n", "uid": "u-1",
                "labels": {"a": "b"}, "annotations": {"big": "x"}},
                "spec": {"hostNetwork": true, "containers": []},
                "status": {"phase": "Succeeded", "qosClass": "BestEffort"}}"#,
        )
        .expect("decodes");
        assert_eq!(p.key, ObjKey::new("n", "p"));
        assert_eq!(p.uid, "u-1");
        assert_eq!(p.labels.get("a").map(String::as_str), Some("b"));
        assert!(p.finished && p.host_network);
        let running = decode_pod(
            r#"{"metadata": {"name": "p", "uid": "u"}, "status": {"phase": "Running"}}"#,
        )
        .expect("decodes");
        assert!(!running.finished && !running.host_network);
        let e = decode_pod(r#"{"metadata": {"name": "p"}}"#).expect_err("no uid");
        assert!(e.to_string().contains("metadata.uid"), "{e}");
        let ns = decode_namespace(r#"{"metadata": {"name": "mesh", "labels": {"k": "v"}}}"#)
            .expect("decodes");
        assert_eq!(ns.key.name.as_ref() as &str, "mesh");
        assert_eq!(ns.labels.len(), 1);
    }
}
