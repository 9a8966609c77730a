//! Why an object was not used, as `objects_skipped_total{kind, reason}` counts it: the
//! kinds and the causes, each with its metric label in one place.

use super::{objects::Skip, Kind};

/// The `kind` label of a skipped object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipKind {
    /// A Service, EndpointSlice or Node.
    Object(Kind),
    /// A file of the manifests directory.
    File,
}

impl SkipKind {
    pub const SERVICE: SkipKind = SkipKind::Object(Kind::Service);
    pub const ENDPOINT_SLICE: SkipKind = SkipKind::Object(Kind::EndpointSlice);

    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            SkipKind::Object(kind) => kind.as_str(),
            SkipKind::File => "file",
        }
    }
}

/// The `reason` label of a skipped object (or of a part of it left out).
#[derive(Clone, Copy, Debug)]
pub enum SkipReason<'a> {
    /// The object itself is unusable ([`Skip`] names the cause).
    Object(&'a Skip),
    /// The lb-algorithm annotation names no known algorithm (the default is used).
    LbAlgorithmUnknown,
    /// An externalIP outside `--external-ip-cidrs` (not programmed).
    ExternalIpNotAllowed,
    /// An SCTP port (not programmed).
    SctpNotSupported,
    /// An EndpointSlice whose Service is not (yet) known.
    ServiceMissing,
    /// A frontend another Service owns.
    FrontendConflict,
    /// A frontend the writer refused by its content; the label is the writer's
    /// (`WriteError::reason`).
    Refused(&'static str),
    /// A manifests file that could not be read.
    ReadError,
    /// An object that does not decode at all (the API's or a manifest's).
    DecodeError,
    /// A manifest document without `metadata.name`.
    NoName,
    /// A manifests file behind a broken symbolic link.
    BrokenLink,
    /// A manifests file over `MAX_MANIFEST_BYTES`.
    TooLarge,
    /// A manifests file nested deeper than `MAX_NESTING`.
    TooDeep,
    /// A manifests file that is not YAML/JSON.
    ParseError,
}

impl SkipReason<'_> {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            SkipReason::Object(skip) => skip.label(),
            SkipReason::LbAlgorithmUnknown => "lb_algorithm_unknown",
            SkipReason::ExternalIpNotAllowed => "external_ip_not_allowed",
            SkipReason::SctpNotSupported => "sctp_not_supported",
            SkipReason::ServiceMissing => "service_missing",
            SkipReason::FrontendConflict => "frontend_conflict",
            SkipReason::Refused(reason) => reason,
            SkipReason::ReadError => "read_error",
            SkipReason::DecodeError => "decode_error",
            SkipReason::NoName => "no_name",
            SkipReason::BrokenLink => "broken_link",
            SkipReason::TooLarge => "too_large",
            SkipReason::TooDeep => "too_deep",
            SkipReason::ParseError => "parse_error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_metric_labels() {
        assert_eq!(SkipKind::SERVICE.label(), "Service");
        assert_eq!(SkipKind::ENDPOINT_SLICE.label(), "EndpointSlice");
        assert_eq!(SkipKind::Object(Kind::Node).label(), "Node");
        assert_eq!(SkipKind::File.label(), "file");
        let skip = Skip::NoName;
        assert_eq!(SkipReason::Object(&skip).label(), "no_name");
        assert_eq!(SkipReason::Refused("map_full").label(), "map_full");
        assert_eq!(SkipReason::SctpNotSupported.label(), "sctp_not_supported");
        assert_eq!(SkipReason::DecodeError.label(), "decode_error");
        assert_eq!(SkipReason::TooDeep.label(), "too_deep");
    }
}
