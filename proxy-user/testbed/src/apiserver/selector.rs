//! Label and field selectors (`labelSelector`, `fieldSelector`) parsed into a [`Filter`],
//! what a list or watch request selects.

use serde_json::Value;

#[derive(Debug)]
pub(super) enum LabelRequirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl LabelRequirement {
    fn matches(&self, labels: Option<&serde_json::Map<String, Value>>) -> bool {
        let get = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        match self {
            Self::Exists(key) => get(key).is_some(),
            Self::NotExists(key) => get(key).is_none(),
            Self::Equals(key, value) => get(key) == Some(value.as_str()),
            Self::NotEquals(key, value) => get(key) != Some(value.as_str()),
            Self::In(key, values) => get(key).is_some_and(|v| values.iter().any(|x| x == v)),
            Self::NotIn(key, values) => !get(key).is_some_and(|v| values.iter().any(|x| x == v)),
        }
    }
}

#[derive(Debug)]
enum Field {
    Name,
    Namespace,
    /// A Pod's `spec.nodeName` (what kubelet and node agents watch their pods by).
    NodeName,
}

#[derive(Debug)]
pub(super) struct FieldRequirement {
    field: Field,
    value: String,
    negated: bool,
}

/// What a list or watch request selects.
#[derive(Debug, Default)]
pub(super) struct Filter {
    /// From a namespaced path.
    pub(super) namespace: Option<String>,
    pub(super) labels: Vec<LabelRequirement>,
    pub(super) fields: Vec<FieldRequirement>,
}

impl Filter {
    pub(super) fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        let name = meta["name"].as_str().unwrap_or_default();
        let namespace = meta["namespace"].as_str().unwrap_or_default();
        if self.namespace.as_deref().is_some_and(|ns| ns != namespace) {
            return false;
        }
        let labels = meta["labels"].as_object();
        self.labels.iter().all(|r| r.matches(labels))
            && self.fields.iter().all(|r| {
                let actual = match r.field {
                    Field::Name => name,
                    Field::Namespace => namespace,
                    Field::NodeName => obj["spec"]["nodeName"].as_str().unwrap_or_default(),
                };
                (actual == r.value) != r.negated
            })
    }
}

/// Splits on commas outside parentheses (`a in (x,y),b` is two terms).
fn split_terms(selector: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn valid_label_key(key: &str) -> bool {
    !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_label_value(value: &str) -> bool {
    value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

pub(super) fn parse_label_selector(selector: &str) -> Result<Vec<LabelRequirement>, String> {
    let mut requirements = Vec::new();
    for term in split_terms(selector) {
        let bad = || format!("unable to parse requirement: invalid label selector term {term:?}");
        let requirement = if let Some(key) = term.strip_prefix('!') {
            LabelRequirement::NotExists(key.trim().to_owned())
        } else if let Some((key, value)) = term.split_once("!=") {
            LabelRequirement::NotEquals(key.trim().to_owned(), value.trim().to_owned())
        } else if let Some((key, value)) = term.split_once("==") {
            LabelRequirement::Equals(key.trim().to_owned(), value.trim().to_owned())
        } else if let Some((key, value)) = term.split_once('=') {
            LabelRequirement::Equals(key.trim().to_owned(), value.trim().to_owned())
        } else if let Some((head, rest)) = term.split_once('(') {
            let values: Vec<String> = rest
                .strip_suffix(')')
                .ok_or_else(bad)?
                .split(',')
                .map(|v| v.trim().to_owned())
                .collect();
            match head.split_whitespace().collect::<Vec<_>>()[..] {
                [key, "in"] => LabelRequirement::In(key.to_owned(), values),
                [key, "notin"] => LabelRequirement::NotIn(key.to_owned(), values),
                _ => return Err(bad()),
            }
        } else {
            LabelRequirement::Exists(term.to_owned())
        };
        let (key, values): (&str, Vec<&str>) = match &requirement {
            LabelRequirement::Exists(k) | LabelRequirement::NotExists(k) => (k, vec![]),
            LabelRequirement::Equals(k, v) | LabelRequirement::NotEquals(k, v) => (k, vec![v]),
            LabelRequirement::In(k, vs) | LabelRequirement::NotIn(k, vs) => {
                (k, vs.iter().map(String::as_str).collect())
            }
        };
        if !valid_label_key(key) || !values.iter().all(|v| valid_label_value(v)) {
            return Err(bad());
        }
        requirements.push(requirement);
    }
    Ok(requirements)
}

/// kube-apiserver's field selectors per kind: `metadata.name` and `metadata.namespace`
/// for all, `spec.nodeName` for Pods only (others get 400 "field label not supported").
pub(super) fn parse_field_selector(
    selector: &str,
    kind: super::store::Kind,
) -> Result<Vec<FieldRequirement>, String> {
    let mut requirements = Vec::new();
    for term in split_terms(selector) {
        let (path, value, negated) = if let Some((p, v)) = term.split_once("!=") {
            (p, v, true)
        } else if let Some((p, v)) = term.split_once("==") {
            (p, v, false)
        } else if let Some((p, v)) = term.split_once('=') {
            (p, v, false)
        } else {
            return Err(format!("invalid field selector term {term:?}"));
        };
        let field = match path.trim() {
            "metadata.name" => Field::Name,
            "metadata.namespace" => Field::Namespace,
            "spec.nodeName" if kind == super::store::Kind::Pod => Field::NodeName,
            other => {
                return Err(format!(
                    "field label not supported: {other} (the fake apiserver knows metadata.name and metadata.namespace, and spec.nodeName for pods)"
                ))
            }
        };
        requirements.push(FieldRequirement {
            field,
            value: value.trim().to_owned(),
            negated,
        });
    }
    Ok(requirements)
}
