//! The reproduced rules against the seed article's chain names and kube-proxy's
//! golden tests.

use std::net::Ipv4Addr;

use super::{
    jump_rules_restore,
    names::{ext_chain, sep_chain, svc_chain},
    stale_chains, Rules,
};
use crate::bench::plan::{self, Port, Proto, Service, NAMESPACE};

/// The seed article's `default/nginx-service` (unnamed port 80, three pods), with
/// the chain names kube-proxy gave it there.
fn nginx() -> Service {
    Service {
        name: "nginx-service".into(),
        vip: Ipv4Addr::new(10, 96, 0, 100),
        ports: vec![Port {
            name: "",
            proto: Proto::Tcp,
            port: 80,
            target_port: 80,
            node_port: None,
        }],
        endpoints: vec![
            Ipv4Addr::new(192, 168, 104, 146),
            Ipv4Addr::new(192, 168, 104, 147),
            Ipv4Addr::new(192, 168, 238, 78),
        ],
        remote: false,
    }
}

#[test]
fn chain_names_match_the_seed_article() {
    // The article's namespace is "default"; ours is fixed, so hash by hand too.
    assert_eq!(
        format!(
            "KUBE-SVC-{}",
            kube_rules::hash::chain_hash_string("default/nginx-servicetcp", 16)
        ),
        "KUBE-SVC-V2OKYYMBY3REGZOG"
    );
    for (ep, want) in [
        ("192.168.104.146:80", "KUBE-SEP-X7WBOA4PTAJA3GNK"),
        ("192.168.104.147:80", "KUBE-SEP-I53TFYWHN2OKR6FH"),
        ("192.168.238.78:80", "KUBE-SEP-WU6475GP2VYJZBGF"),
    ] {
        let text = format!("default/nginx-servicetcp{ep}");
        assert_eq!(
            format!(
                "KUBE-SEP-{}",
                kube_rules::hash::chain_hash_string(&text, 16)
            ),
            want
        );
    }
    // kube-proxy's golden tests: ns1/svc1, port p80.
    assert_eq!(
        format!(
            "KUBE-SVC-{}",
            kube_rules::hash::chain_hash_string("ns1/svc1:p80tcp", 16)
        ),
        "KUBE-SVC-XPGD46QRK7WJZT7O"
    );
    assert_eq!(
        format!(
            "KUBE-SEP-{}",
            kube_rules::hash::chain_hash_string("ns1/svc1:p80tcp10.180.0.1:80", 16)
        ),
        "KUBE-SEP-SXIVWICOYRO3J4NJ"
    );
    let s = nginx();
    assert_eq!(
        s.port_name(&s.ports[0]),
        format!("{NAMESPACE}/nginx-service")
    );
}

#[test]
fn full_sync_has_kube_proxys_structure() {
    let s = nginx();
    let rules = Rules {
        large_cluster: false,
    }
    .full(std::slice::from_ref(&s));
    let svc = svc_chain(&s, &s.ports[0]);
    let seps: Vec<String> = s
        .endpoints
        .iter()
        .map(|e| sep_chain(&s, &s.ports[0], &format!("{e}:80")))
        .collect();
    let want = format!(
        r#"*filter
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
*nat
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:{svc} - [0:0]
:{s0} - [0:0]
:{s1} - [0:0]
:{s2} - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -m comment --comment "bench/nginx-service cluster IP" -m tcp -p tcp -d 10.96.0.100 --dport 80 -j {svc}
-A {svc} -m comment --comment "bench/nginx-service cluster IP" -m tcp -p tcp -d 10.96.0.100 --dport 80 ! -s 10.224.0.0/12 -j KUBE-MARK-MASQ
-A {svc} -m comment --comment "bench/nginx-service -> 192.168.104.146:80" -m statistic --mode random --probability 0.3333333333 -j {s0}
-A {s0} -m comment --comment bench/nginx-service -s 192.168.104.146 -j KUBE-MARK-MASQ
-A {s0} -m comment --comment bench/nginx-service -m tcp -p tcp -j DNAT --to-destination 192.168.104.146:80
-A {svc} -m comment --comment "bench/nginx-service -> 192.168.104.147:80" -m statistic --mode random --probability 0.5000000000 -j {s1}
-A {s1} -m comment --comment bench/nginx-service -s 192.168.104.147 -j KUBE-MARK-MASQ
-A {s1} -m comment --comment bench/nginx-service -m tcp -p tcp -j DNAT --to-destination 192.168.104.147:80
-A {svc} -m comment --comment "bench/nginx-service -> 192.168.238.78:80" -j {s2}
-A {s2} -m comment --comment bench/nginx-service -s 192.168.238.78 -j KUBE-MARK-MASQ
-A {s2} -m comment --comment bench/nginx-service -m tcp -p tcp -j DNAT --to-destination 192.168.238.78:80
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
COMMIT
"#,
        s0 = seps[0],
        s1 = seps[1],
        s2 = seps[2],
    );
    assert_eq!(rules, want);
}

#[test]
fn large_cluster_mode_drops_endpoint_comments_and_partial_sync_keeps_services_whole() {
    let services = plan::services(120, false);
    let r = Rules::for_services(&services);
    assert!(r.large_cluster, "1,209 endpoints > 1,000");
    let full = r.full(&services);
    assert!(!full.contains(" -> "), "no per-endpoint comments");
    assert_eq!(
        full.lines()
            .filter(|l| l.starts_with("-A KUBE-SERVICES"))
            .count(),
        119 + 3 + 1,
        "one rule per service port and the NodePorts rule"
    );
    // The target is last in KUBE-SERVICES (before the NodePorts rule).
    let last_svc = full
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES"))
        .nth(119)
        .expect("rule");
    assert!(last_svc.contains("-d 10.96.0.10 --dport 80"), "{last_svc}");
    // Ten endpoints: probabilities 1/10 .. 1/2, then the unconditional jump.
    let target = plan::target(false);
    let svc = svc_chain(&target, &target.ports[0]);
    let probs: Vec<&str> = full
        .lines()
        .filter(|l| l.starts_with(&format!("-A {svc} ")) && l.contains("KUBE-SEP-"))
        .map(|l| {
            l.split("--probability ")
                .nth(1)
                .map_or("last", |p| p.split(' ').next().unwrap_or(""))
        })
        .collect();
    assert_eq!(
        probs,
        [
            "0.1000000000",
            "0.1111111111",
            "0.1250000000",
            "0.1428571429",
            "0.1666666667",
            "0.2000000000",
            "0.2500000000",
            "0.3333333333",
            "0.5000000000",
            "last"
        ]
    );

    let swapped = plan::services(120, true);
    let old = sep_chain(&target, &target.ports[0], "10.224.1.10:80");
    let partial = r.partial(&swapped, &swapped[119], std::slice::from_ref(&old));
    assert_eq!(
        partial
            .lines()
            .filter(|l| l.starts_with("-A KUBE-SERVICES"))
            .count(),
        123,
        "KUBE-SERVICES is rewritten whole"
    );
    let declared: Vec<&str> = partial
        .lines()
        .filter(|l| l.starts_with(":KUBE-SVC-"))
        .collect();
    assert_eq!(declared.len(), 3, "only the changed service's chains");
    assert!(partial.contains("10.224.1.11:80"));
    assert!(!partial.contains("10.224.1.10:80"));
    assert!(partial.contains(&format!("-X {old}\n")));
    // Stale chains come from iptables-save output.
    let save = format!(":KUBE-SERVICES - [0:0]\n:{old} - [0:0]\n:{svc} - [0:0]\n");
    assert_eq!(stale_chains(&save, &swapped), vec![old]);
}

/// kube-proxy's NodePort rules for eTP=Cluster (its golden test's `ns2b/svc2b`
/// shape): KUBE-NODEPORTS jumps to KUBE-EXT, which marks for masquerade and goes to
/// the service chain.
#[test]
fn a_node_port_gets_kube_proxys_external_chain() {
    let s = plan::remote_target();
    let text = Rules::for_services(std::slice::from_ref(&s)).full(std::slice::from_ref(&s));
    let ext = ext_chain(&s, &s.ports[0]);
    let svc = svc_chain(&s, &s.ports[0]);
    assert!(
        ext.starts_with("KUBE-EXT-") && ext[9..] == svc[9..],
        "{ext} {svc}"
    );
    for line in [
        format!(":{ext} - [0:0]"),
        format!("-A KUBE-NODEPORTS -m comment --comment bench/target:dns -m udp -p udp --dport 30053 -j {ext}"),
        format!("-A {ext} -m comment --comment \"masquerade traffic for bench/target:dns external destinations\" -j KUBE-MARK-MASQ"),
        format!("-A {ext} -j {svc}"),
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
    }
    // No NodePort rule for a ClusterIP-only service.
    let plain = plan::services(1, false);
    assert!(!Rules::for_services(&plain)
        .full(&plain)
        .contains("KUBE-EXT-"));
}

#[test]
fn jump_rules_cover_the_built_in_chains() {
    let text = jump_rules_restore();
    assert!(text.contains(
        "-I PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
    ));
    assert!(text.contains(
        "-I POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING"
    ));
    assert_eq!(text.matches("COMMIT").count(), 2);
    assert!(text.contains("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n"));
}
