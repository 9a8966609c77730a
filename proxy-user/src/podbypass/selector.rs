//! `--socket-lb-bypass-selector`: which pods' sockets the socket hooks leave alone, by
//! the labels of the pod or of its namespace.

use std::collections::BTreeMap;

/// The selector's default: Istio's ambient mode, whose node proxy (ztunnel) must see the
/// ClusterIP of what a pod sends (istio#49149). Istio sets the label on the namespace
/// (`kubectl label namespace X istio.io/dataplane-mode=ambient`) or on the pod, and a pod
/// labelled `istio.io/dataplane-mode=none` stays out of an ambient namespace.
pub const DEFAULT: &str = "istio.io/dataplane-mode=ambient";

/// One term of an equality-based label selector (Kubernetes' syntax).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Term {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
}

impl Term {
    fn key(&self) -> &str {
        match self {
            Term::Equals(k, _) | Term::NotEquals(k, _) | Term::Exists(k) | Term::NotExists(k) => k,
        }
    }

    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Term::Equals(k, v) => labels.get(k) == Some(v),
            Term::NotEquals(k, v) => labels.get(k) != Some(v),
            Term::Exists(k) => labels.contains_key(k),
            Term::NotExists(k) => !labels.contains_key(k),
        }
    }
}

/// The parsed selector: every term must match (`a=b,c` is `a=b` and `c` present).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BypassSelector {
    terms: Vec<Term>,
}

impl BypassSelector {
    /// `key=value`, `key==value`, `key!=value`, `key`, `!key`, joined by commas. `""` or
    /// `none`: no bypass (`Ok(None)`). An error names the term and why.
    pub fn parse(text: &str) -> Result<Option<Self>, String> {
        let text = text.trim();
        if text.is_empty() || text == "none" {
            return Ok(None);
        }
        let mut terms = Vec::new();
        for raw in text.split(',') {
            let t = raw.trim();
            let term = if let Some((k, v)) = t.split_once("!=") {
                Term::NotEquals(key(k, t)?, value(v, t)?)
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                Term::Equals(key(k, t)?, value(v, t)?)
            } else if let Some(k) = t.strip_prefix('!') {
                Term::NotExists(key(k, t)?)
            } else {
                Term::Exists(key(t, t)?)
            };
            terms.push(term);
        }
        if terms
            .iter()
            .all(|t| matches!(t, Term::NotEquals(..) | Term::NotExists(_)))
        {
            return Err(format!(
                "{text:?} selects every pod without the label (at least one term must require a label)"
            ));
        }
        Ok(Some(Self { terms }))
    }

    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.terms.iter().all(|t| t.matches(labels))
    }

    /// Whether a pod with `pod` labels, in a namespace with `namespace` labels (`None`:
    /// not known), bypasses socket LB: its own labels match; or it carries none of the
    /// selector's keys (a pod's own label on a key overrides its namespace's, as Istio's
    /// `istio.io/dataplane-mode=none` does) and its namespace's labels match.
    pub fn bypasses(
        &self,
        pod: &BTreeMap<String, String>,
        namespace: Option<&BTreeMap<String, String>>,
    ) -> bool {
        if self.matches(pod) {
            return true;
        }
        if self.terms.iter().any(|t| pod.contains_key(t.key())) {
            return false;
        }
        namespace.is_some_and(|l| self.matches(l))
    }
}

fn key(k: &str, term: &str) -> Result<String, String> {
    let k = k.trim();
    let (prefix, name) = k.rsplit_once('/').unwrap_or(("", k));
    let ok_name = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    let ok_prefix = prefix.len() <= 253
        && prefix
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'));
    if !ok_name || !ok_prefix || (k.contains('/') && prefix.is_empty()) {
        return Err(format!("{term:?}: {k:?} is not a label key"));
    }
    Ok(k.to_string())
}

fn value(v: &str, term: &str) -> Result<String, String> {
    let v = v.trim();
    let ok = v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !ok {
        return Err(format!("{term:?}: {v:?} is not a label value"));
    }
    Ok(v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn default_follows_istio_ambient_pod_and_namespace_labels() {
        let s = BypassSelector::parse(DEFAULT)
            .expect("parses")
            .expect("some");
        let ambient = labels(&[("istio.io/dataplane-mode", "ambient")]);
        let none = labels(&[("istio.io/dataplane-mode", "none")]);
        let plain = labels(&[("app", "web")]);
        assert!(s.bypasses(&ambient, None));
        assert!(s.bypasses(&plain, Some(&ambient)), "namespace label");
        assert!(!s.bypasses(&none, Some(&ambient)), "the pod opts out");
        assert!(!s.bypasses(&plain, Some(&plain)));
        assert!(!s.bypasses(&plain, None));
    }

    #[test]
    fn parses_terms_and_refuses_bad_ones_naming_them() {
        assert_eq!(BypassSelector::parse("").expect("ok"), None);
        assert_eq!(BypassSelector::parse("none").expect("ok"), None);
        let s = BypassSelector::parse("mesh==yes, example.com/x,!skip")
            .expect("ok")
            .expect("some");
        assert!(s.bypasses(&labels(&[("mesh", "yes"), ("example.com/x", "")]), None));
        assert!(!s.bypasses(
            &labels(&[("mesh", "yes"), ("example.com/x", ""), ("skip", "1")]),
            None
        ));
        for bad in ["a=b c", "/x", "a=b,=c", "A_/x=1", "!a"] {
            let e = BypassSelector::parse(bad).expect_err(bad);
            assert!(e.contains('"'), "{bad}: {e}");
        }
    }
}
