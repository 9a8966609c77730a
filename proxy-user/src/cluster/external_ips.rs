//! `--external-ip-cidrs`: which `spec.externalIPs` are programmed. Anyone who may create
//! a Service can otherwise claim any address with an externalIP (CVE-2020-8554); with a
//! list of prefixes only externalIPs inside one of them are kept (kube-proxy programs
//! every externalIP; the admission webhook `DenyServiceExternalIPs` is its answer).

use std::net::IpAddr;

use super::objects::{cidr_contains, ServiceInfo};

/// The policy: `None` allows every externalIP, `Some(prefixes)` only those inside one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExternalIpPolicy {
    allowed: Option<Vec<(IpAddr, u8)>>,
}

impl ExternalIpPolicy {
    pub fn new(allowed: Option<Vec<(IpAddr, u8)>>) -> Self {
        Self { allowed }
    }

    /// Whether `ip` may be programmed as an externalIP.
    pub fn allows(&self, ip: IpAddr) -> bool {
        self.allowed
            .as_ref()
            .is_none_or(|cidrs| cidrs.iter().any(|c| cidr_contains(*c, ip)))
    }

    /// Removes the externalIPs the policy refuses from `svc`; returns them.
    pub fn apply(&self, svc: &mut ServiceInfo) -> Vec<IpAddr> {
        let mut refused = Vec::new();
        svc.external_ips.retain(|ip| {
            let ok = self.allows(*ip);
            if !ok {
                refused.push(*ip);
            }
            ok
        });
        refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::objects::parse_cidr;

    #[test]
    fn only_externalips_inside_the_prefixes_are_allowed() {
        let any = ExternalIpPolicy::default();
        assert!(any.allows("198.51.100.5".parse().expect("ip")));
        let p = ExternalIpPolicy::new(Some(vec![
            parse_cidr("203.0.113.0/24").expect("cidr"),
            parse_cidr("2001:db8::/32").expect("cidr"),
        ]));
        assert!(p.allows("203.0.113.5".parse().expect("ip")));
        assert!(p.allows("2001:db8::5".parse().expect("ip")));
        assert!(!p.allows("198.51.100.5".parse().expect("ip")));
        let none = ExternalIpPolicy::new(Some(Vec::new()));
        assert!(!none.allows("203.0.113.5".parse().expect("ip")));
    }
}
