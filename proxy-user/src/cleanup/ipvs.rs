//! IPVS: kube-proxy's virtual services and its `kube-ipvs0` dummy link.

use std::{fmt, fs, net::IpAddr};

use super::ipset::IpSets;
use kube_rules::ipvs::{ipv6_set_name, IPVS_LINK, NODE_PORT_SETS, SERVICE_ADDRESS_SETS};

use super::{run, skip_or_fail, CleanupError, CleanupOptions, Item, Report};

/// A network interface with its kind and addresses (`ip -j -d addr show`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Link {
    pub name: String,
    /// `linkinfo.info_kind` (`dummy`, `veth`, ...), empty for plain devices.
    pub kind: String,
    pub addrs: Vec<IpAddr>,
}

/// Parses `ip -j -d addr show`.
pub fn parse_links(json: &str) -> Result<Vec<Link>, String> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let list = v.as_array().ok_or("not a JSON list")?;
    Ok(list
        .iter()
        .map(|l| Link {
            name: l["ifname"].as_str().unwrap_or_default().to_string(),
            kind: l["linkinfo"]["info_kind"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            addrs: l["addr_info"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|i| i["local"].as_str()?.parse().ok())
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect())
}

pub(super) fn read_links(report: &mut Report) -> Option<Vec<Link>> {
    let scope = "ip";
    match run(scope, "ip", &["-j", "-d", "addr", "show"], None) {
        Ok(json) => match parse_links(&json) {
            Ok(links) => Some(links),
            Err(detail) => {
                report.errors.push(CleanupError::Unreadable {
                    scope: scope.into(),
                    detail: format!("`ip -j -d addr show`: {detail}"),
                });
                None
            }
        },
        Err(e) => {
            skip_or_fail(report, e, IPVS_LINK);
            None
        }
    }
}

/// One IPVS virtual service (fwmark services are never kube-proxy's and not listed).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct VirtualService {
    /// `tcp`, `udp` or `sctp`.
    pub proto: String,
    pub addr: IpAddr,
    pub port: u16,
}

impl VirtualService {
    /// `10.96.0.1:443` or `[fd00::1]:443`, as ipvsadm takes it.
    pub fn endpoint(&self) -> String {
        match self.addr {
            IpAddr::V4(a) => format!("{a}:{}", self.port),
            IpAddr::V6(a) => format!("[{a}]:{}", self.port),
        }
    }

    pub(super) fn proto_flag(&self) -> &'static str {
        match self.proto.as_str() {
            "udp" => "-u",
            "sctp" => "--sctp-service",
            _ => "-t",
        }
    }
}

impl fmt::Display for VirtualService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.proto.to_uppercase(), self.endpoint())
    }
}

/// Parses `ipvsadm -Sn`: the `-A` lines of TCP, UDP and SCTP services.
pub fn parse_ipvsadm_save(text: &str) -> Vec<VirtualService> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "-A").then_some(())?;
            let proto = match w.next()? {
                "-t" | "--tcp-service" => "tcp",
                "-u" | "--udp-service" => "udp",
                "--sctp-service" => "sctp",
                _ => return None,
            };
            let (addr, port) = w.next()?.rsplit_once(':')?;
            let addr = addr.trim_start_matches('[').trim_end_matches(']');
            Some(VirtualService {
                proto: proto.to_string(),
                addr: addr.parse().ok()?,
                port: port.parse().ok()?,
            })
        })
        .collect()
}

/// Why `vs` is kube-proxy's, or `None` when it is not (see the module documentation).
pub fn ipvs_owner(
    vs: &VirtualService,
    ipvs_link_addrs: &[IpAddr],
    sets: &IpSets,
    local_addrs: &[IpAddr],
) -> Option<String> {
    if ipvs_link_addrs.contains(&vs.addr) {
        return Some(format!("address on {IPVS_LINK}"));
    }
    let entry = format!("{},{}:{}", vs.addr, vs.proto, vs.port);
    for base in SERVICE_ADDRESS_SETS {
        for name in [base.to_string(), ipv6_set_name(base)] {
            if sets
                .sets
                .get(&name)
                .is_some_and(|(_, entries)| entries.contains(&entry))
            {
                return Some(format!("in ipset {name}"));
            }
        }
    }
    if local_addrs.contains(&vs.addr) {
        for (base, proto) in NODE_PORT_SETS {
            if *proto != vs.proto {
                continue;
            }
            for name in [base.to_string(), ipv6_set_name(base)] {
                let port = vs.port.to_string();
                if sets
                    .sets
                    .get(&name)
                    .is_some_and(|(_, entries)| entries.contains(&port))
                {
                    return Some(format!("NodePort on a node address, port in ipset {name}"));
                }
            }
        }
    }
    None
}

pub(super) fn read_ipvs(report: &mut Report) -> Option<Vec<VirtualService>> {
    // Without the module loaded there is nothing, and ipvsadm would try to load it.
    if fs::metadata("/proc/net/ip_vs").is_err() {
        report
            .notes
            .push("ipvs: IPVS is not loaded in this kernel (no /proc/net/ip_vs): no virtual services to check".into());
        return None;
    }
    match run("ipvs", "ipvsadm", &["-S", "-n"], None) {
        Ok(text) => Some(parse_ipvsadm_save(&text)),
        Err(e) => {
            skip_or_fail(report, e, "IPVS virtual services");
            None
        }
    }
}

/// Removes kube-proxy's virtual services; false if one could not be removed.
pub(super) fn clean_ipvs(
    services: Option<Vec<VirtualService>>,
    links: Option<&Vec<Link>>,
    sets: Option<&IpSets>,
    opts: &CleanupOptions,
    report: &mut Report,
) -> bool {
    let Some(services) = services else {
        return true;
    };
    let empty = IpSets::default();
    let sets = sets.unwrap_or(&empty);
    let links = links.map(Vec::as_slice).unwrap_or_default();
    let ipvs_addrs: Vec<IpAddr> = links
        .iter()
        .filter(|l| l.name == IPVS_LINK)
        .flat_map(|l| l.addrs.iter().copied())
        .collect();
    let local_addrs: Vec<IpAddr> = links
        .iter()
        .filter(|l| l.name != IPVS_LINK)
        .flat_map(|l| l.addrs.iter().copied())
        .collect();
    let mut ok = true;
    let mut others = 0;
    for vs in &services {
        let Some(why) = ipvs_owner(vs, &ipvs_addrs, sets, &local_addrs) else {
            others += 1;
            continue;
        };
        if !opts.dry_run {
            if let Err(e) = run(
                "ipvs",
                "ipvsadm",
                &["-D", vs.proto_flag(), &vs.endpoint()],
                None,
            ) {
                report.errors.push(e);
                ok = false;
                continue;
            }
        }
        report
            .removed
            .push(Item::new("ipvs", format!("virtual service {vs} ({why})")));
    }
    if others > 0 {
        report.notes.push(format!(
            "ipvs: {others} virtual service(s) not kube-proxy's left as they are"
        ));
    }
    ok
}

pub(super) fn clean_link(links: Option<&Vec<Link>>, opts: &CleanupOptions, report: &mut Report) {
    let Some(link) = links.and_then(|l| l.iter().find(|l| l.name == IPVS_LINK)) else {
        return;
    };
    if link.kind != "dummy" {
        let kind = if link.kind.is_empty() {
            "device"
        } else {
            link.kind.as_str()
        };
        report.kept.push(Item::new(
            "link",
            format!("{IPVS_LINK} is of kind {kind}, not the dummy kube-proxy creates"),
        ));
        return;
    }
    if !opts.dry_run {
        if let Err(e) = run("link", "ip", &["link", "del", IPVS_LINK], None) {
            report.errors.push(e);
            return;
        }
    }
    report.removed.push(Item::new(
        "link",
        format!("{IPVS_LINK} (dummy, {} address(es))", link.addrs.len()),
    ));
}
