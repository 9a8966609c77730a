//! The rules against kube-proxy's own output (goldens) and its naming.

use super::*;

#[test]
fn chain_names_match_the_seed_article_and_kube_proxy() {
    // The seed article: Service default/nginx-service, one unnamed TCP port. An
    // unnamed port adds nothing to the name (ServicePortName.String() appends
    // ":port" only for a named port), and the protocol is lower-case.
    assert_eq!(
        service_chain("default/nginx-service", "tcp"),
        "KUBE-SVC-V2OKYYMBY3REGZOG"
    );
    // Its three KUBE-SEP chains and the endpoints of `kubectl get endpoints`.
    for (ep, sep) in [
        ("192.168.104.146:80", "KUBE-SEP-X7WBOA4PTAJA3GNK"),
        ("192.168.104.147:80", "KUBE-SEP-I53TFYWHN2OKR6FH"),
        ("192.168.238.78:80", "KUBE-SEP-WU6475GP2VYJZBGF"),
    ] {
        assert_eq!(endpoint_chain("default/nginx-service", "tcp", ep), sep);
    }
    // Wrong inputs give other names: a trailing ':' (pre-1.9 kube-proxy) or "TCP".
    assert_ne!(
        service_chain("default/nginx-service:", "tcp"),
        "KUBE-SVC-V2OKYYMBY3REGZOG"
    );
    assert_ne!(
        service_chain("default/nginx-service", "TCP"),
        "KUBE-SVC-V2OKYYMBY3REGZOG"
    );
    // Names every cluster has.
    assert_eq!(
        service_chain("default/kubernetes:https", "tcp"),
        "KUBE-SVC-NPX46M4PTMTKRN6Y"
    );
    assert_eq!(
        service_chain("kube-system/kube-dns:dns", "udp"),
        "KUBE-SVC-TCOU7JCQXEZGVUNU"
    );
    assert_eq!(
        service_chain("kube-system/kube-dns:dns-tcp", "tcp"),
        "KUBE-SVC-ERIFXISQEP7F7OF4"
    );
}

#[test]
fn probabilities_print_as_iptables_lists_them() {
    // The article's listing: 0.33333333349 and 0.50000000000.
    assert_eq!(listed_probability(3), "0.33333333349");
    assert_eq!(listed_probability(2), "0.50000000000");
    assert_eq!(listed_probability(4), "0.25000000000");
}

#[test]
fn comments_are_quoted_like_iptables_save() {
    assert_eq!(save_string("plain-word_1"), "plain-word_1");
    assert_eq!(save_string("default/web"), "\"default/web\"");
    assert_eq!(save_string("a \"b\""), "\"a \\\"b\\\"\"");
}

fn article() -> ServicePort {
    ServicePort {
        name: "default/nginx-service".into(),
        proto: Proto::Tcp,
        kind: Kind::ClusterIP,
        address: "10.96.0.100".parse().unwrap_or(IpAddr::from([0, 0, 0, 0])),
        port: 80,
        cluster_endpoints: [
            "192.168.238.78:80",
            "192.168.104.147:80",
            "192.168.104.146:80",
        ]
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect(),
        local_endpoints: Vec::new(),
        internal_local: false,
        external_local: false,
        affinity: None,
        source_ranges: Vec::new(),
    }
}

#[test]
fn the_article_service_golden() {
    let r = rules(&article());
    assert_eq!(
        r.render(""),
        r#"*nat
-A KUBE-SERVICES -d 10.96.0.100/32 -p tcp -m comment --comment "default/nginx-service cluster IP" -m tcp --dport 80 -j KUBE-SVC-V2OKYYMBY3REGZOG
-A KUBE-SVC-V2OKYYMBY3REGZOG -m comment --comment "default/nginx-service -> 192.168.104.146:80" -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-X7WBOA4PTAJA3GNK
-A KUBE-SVC-V2OKYYMBY3REGZOG -m comment --comment "default/nginx-service -> 192.168.104.147:80" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-I53TFYWHN2OKR6FH
-A KUBE-SVC-V2OKYYMBY3REGZOG -m comment --comment "default/nginx-service -> 192.168.238.78:80" -j KUBE-SEP-WU6475GP2VYJZBGF
-A KUBE-SEP-X7WBOA4PTAJA3GNK -s 192.168.104.146/32 -m comment --comment "default/nginx-service" -j KUBE-MARK-MASQ
-A KUBE-SEP-X7WBOA4PTAJA3GNK -p tcp -m comment --comment "default/nginx-service" -m tcp -j DNAT --to-destination 192.168.104.146:80
-A KUBE-SEP-I53TFYWHN2OKR6FH -s 192.168.104.147/32 -m comment --comment "default/nginx-service" -j KUBE-MARK-MASQ
-A KUBE-SEP-I53TFYWHN2OKR6FH -p tcp -m comment --comment "default/nginx-service" -m tcp -j DNAT --to-destination 192.168.104.147:80
-A KUBE-SEP-WU6475GP2VYJZBGF -s 192.168.238.78/32 -m comment --comment "default/nginx-service" -j KUBE-MARK-MASQ
-A KUBE-SEP-WU6475GP2VYJZBGF -p tcp -m comment --comment "default/nginx-service" -m tcp -j DNAT --to-destination 192.168.238.78:80
"#
    );
}

#[test]
fn no_endpoints_reject_and_local_drop() {
    let mut sp = article();
    sp.cluster_endpoints.clear();
    assert_eq!(
        rules(&sp).render(""),
        "*filter\n-A KUBE-SERVICES -d 10.96.0.100/32 -p tcp -m comment --comment \
         \"default/nginx-service has no endpoints\" -m tcp --dport 80 -j REJECT \
         --reject-with icmp-port-unreachable\n"
    );
    sp.internal_local = true;
    assert_eq!(
        rules(&sp).render(""),
        "*filter\n-A KUBE-SERVICES -d 10.96.0.100/32 -p tcp -m comment --comment \
         \"default/nginx-service has no local endpoints\" -m tcp --dport 80 -j DROP\n"
    );
}

#[test]
fn affinity_nodeport_with_local_policy_and_ipv6() {
    let ep = |s: &str| s.parse::<SocketAddr>().ok();
    let sp = ServicePort {
        name: "default/web:http".into(),
        proto: Proto::Tcp,
        kind: Kind::NodePort,
        address: IpAddr::from([0, 0, 0, 0]),
        port: 30080,
        cluster_endpoints: [ep("10.244.2.7:8080"), ep("10.244.1.5:8080")]
            .into_iter()
            .flatten()
            .collect(),
        local_endpoints: ep("10.244.1.5:8080").into_iter().collect(),
        internal_local: false,
        external_local: true,
        affinity: Some(10800),
        source_ranges: Vec::new(),
    };
    let svc = service_chain("default/web:http", "tcp");
    let svl = local_chain("default/web:http", "tcp");
    let ext = external_chain("default/web:http", "tcp");
    let sep1 = endpoint_chain("default/web:http", "tcp", "10.244.1.5:8080");
    let sep2 = endpoint_chain("default/web:http", "tcp", "10.244.2.7:8080");
    let want = format!(
        r#"*nat
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j {ext}
-A {ext} -m comment --comment "masquerade LOCAL traffic for default/web:http external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A {ext} -m comment --comment "route LOCAL traffic for default/web:http external destinations" -m addrtype --src-type LOCAL -j {svc}
-A {ext} -j {svl}
-A {svc} -m comment --comment "default/web:http -> 10.244.1.5:8080" -m recent --rcheck --seconds 10800 --reap --name {sep1} --mask 255.255.255.255 --rsource -j {sep1}
-A {svc} -m comment --comment "default/web:http -> 10.244.2.7:8080" -m recent --rcheck --seconds 10800 --reap --name {sep2} --mask 255.255.255.255 --rsource -j {sep2}
-A {svc} -m comment --comment "default/web:http -> 10.244.1.5:8080" -m statistic --mode random --probability 0.50000000000 -j {sep1}
-A {svc} -m comment --comment "default/web:http -> 10.244.2.7:8080" -j {sep2}
-A {svl} -m comment --comment "default/web:http -> 10.244.1.5:8080" -m recent --rcheck --seconds 10800 --reap --name {sep1} --mask 255.255.255.255 --rsource -j {sep1}
-A {svl} -m comment --comment "default/web:http -> 10.244.1.5:8080" -j {sep1}
-A {sep1} -s 10.244.1.5/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A {sep1} -p tcp -m comment --comment "default/web:http" -m recent --set --name {sep1} --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.1.5:8080
-A {sep2} -s 10.244.2.7/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A {sep2} -p tcp -m comment --comment "default/web:http" -m recent --set --name {sep2} --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.2.7:8080
"#
    );
    assert_eq!(rules(&sp).render(""), want);

    let v6 = ServicePort {
        name: "default/web6".into(),
        proto: Proto::Udp,
        kind: Kind::ClusterIP,
        address: "fd00:96::10".parse().unwrap_or(IpAddr::from([0u8; 16])),
        port: 53,
        cluster_endpoints: ep("[fd00:244::5]:5353").into_iter().collect(),
        local_endpoints: Vec::new(),
        internal_local: false,
        external_local: false,
        affinity: None,
        source_ranges: Vec::new(),
    };
    let r = rules(&v6);
    assert!(r.ipv6);
    let svc6 = service_chain("default/web6", "udp");
    let sep6 = endpoint_chain("default/web6", "udp", "[fd00:244::5]:5353");
    assert_eq!(
        r.render(""),
        format!(
            r#"*nat
-A KUBE-SERVICES -d fd00:96::10/128 -p udp -m comment --comment "default/web6 cluster IP" -m udp --dport 53 -j {svc6}
-A {svc6} -m comment --comment "default/web6 -> [fd00:244::5]:5353" -j {sep6}
-A {sep6} -s fd00:244::5/128 -m comment --comment "default/web6" -j KUBE-MARK-MASQ
-A {sep6} -p udp -m comment --comment "default/web6" -m udp -j DNAT --to-destination [fd00:244::5]:5353
"#
        )
    );
}

#[test]
fn load_balancer_with_source_ranges() {
    let sp = ServicePort {
        name: "default/lb".into(),
        proto: Proto::Tcp,
        kind: Kind::LoadBalancer,
        address: IpAddr::from([192, 0, 2, 10]),
        port: 443,
        cluster_endpoints: "10.244.1.9:8443".parse().into_iter().collect(),
        local_endpoints: Vec::new(),
        internal_local: false,
        external_local: false,
        affinity: None,
        source_ranges: vec![Cidr {
            addr: IpAddr::from([203, 0, 113, 0]),
            len: 24,
        }],
    };
    let h = port_proto_hash("default/lb", "tcp");
    let sep = endpoint_chain("default/lb", "tcp", "10.244.1.9:8443");
    assert_eq!(
        rules(&sp).render(""),
        format!(
            r#"*nat
-A KUBE-SERVICES -d 192.0.2.10/32 -p tcp -m comment --comment "default/lb loadbalancer IP" -m tcp --dport 443 -j KUBE-FW-{h}
-A KUBE-EXT-{h} -m comment --comment "masquerade traffic for default/lb external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-{h} -j KUBE-SVC-{h}
-A KUBE-FW-{h} -s 203.0.113.0/24 -m comment --comment "default/lb loadbalancer IP" -j KUBE-EXT-{h}
-A KUBE-FW-{h} -m comment --comment "other traffic to default/lb will be dropped by KUBE-PROXY-FIREWALL"
-A KUBE-SVC-{h} -m comment --comment "default/lb -> 10.244.1.9:8443" -j {sep}
-A {sep} -s 10.244.1.9/32 -m comment --comment "default/lb" -j KUBE-MARK-MASQ
-A {sep} -p tcp -m comment --comment "default/lb" -m tcp -j DNAT --to-destination 10.244.1.9:8443
*filter
-A KUBE-PROXY-FIREWALL -d 192.0.2.10/32 -p tcp -m comment --comment "default/lb traffic not accepted by KUBE-FW-{h}" -m tcp --dport 443 -j DROP
"#
        )
    );
}
