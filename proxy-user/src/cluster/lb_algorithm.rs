//! The per-Service load-balancing algorithm for external (north-south) traffic at TC:
//! the agent's `--lb-algorithm` default, overridden by the Service annotation
//! `ebpf-proxy.io/lb-algorithm: maglev|random` (cilium's `service.cilium.io/lb-algorithm`
//! in this project's namespace). East-west traffic (the socket hooks) is random (or
//! session affinity) whatever the choice.

use std::{collections::BTreeMap, fmt, str::FromStr};

/// The annotation.
pub const ANNOTATION: &str = "ebpf-proxy.io/lb-algorithm";

/// How a new external flow's backend is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LbAlgorithm {
    /// Equal weight at random (and session affinity where asked).
    #[default]
    Random,
    /// Maglev consistent hashing of the flow's 5-tuple: every node picks the same backend.
    Maglev,
}

impl LbAlgorithm {
    pub const fn as_str(self) -> &'static str {
        match self {
            LbAlgorithm::Random => "random",
            LbAlgorithm::Maglev => "maglev",
        }
    }
}

impl fmt::Display for LbAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LbAlgorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "random" => Ok(LbAlgorithm::Random),
            "maglev" => Ok(LbAlgorithm::Maglev),
            _ => Err(format!(
                "unknown load-balancing algorithm {s:?} (expected random or maglev)"
            )),
        }
    }
}

/// The algorithm a Service's annotations ask for: `Ok(None)` without the annotation,
/// `Err(value)` for a value that is neither `random` nor `maglev` (the caller warns,
/// counts it and uses the default).
pub fn from_annotations(
    annotations: Option<&BTreeMap<String, String>>,
) -> Result<Option<LbAlgorithm>, String> {
    match annotations.and_then(|a| a.get(ANNOTATION)) {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| v.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotation_values() {
        let a = |v: &str| BTreeMap::from([(ANNOTATION.to_string(), v.to_string())]);
        assert_eq!(from_annotations(None), Ok(None));
        assert_eq!(from_annotations(Some(&BTreeMap::new())), Ok(None));
        assert_eq!(
            from_annotations(Some(&a("maglev"))),
            Ok(Some(LbAlgorithm::Maglev))
        );
        assert_eq!(
            from_annotations(Some(&a("Random"))),
            Ok(Some(LbAlgorithm::Random))
        );
        assert_eq!(
            from_annotations(Some(&a("ring-hash"))),
            Err("ring-hash".to_string())
        );
        assert!("x"
            .parse::<LbAlgorithm>()
            .expect_err("an error")
            .contains("random or maglev"));
    }
}
