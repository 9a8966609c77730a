//! Strict decoding, each field applied or named, and kube-proxy's precedence.

use std::{path::PathBuf, time::Duration};

use super::*;

/// kubeadm's `config.conf` as it renders it into the `kube-proxy` ConfigMap
/// (`kubeadm init` with the default KubeProxyConfiguration and a podSubnet).
pub const KUBEADM: &str = include_str!("../../tests/data/kubeadm-kube-proxy-config.conf");

#[test]
fn kubeadms_config_decodes_and_names_nothing_but_the_cluster_cidr() {
    let c = KubeProxyConfiguration::parse(KUBEADM).expect("kubeadm's config");
    let r = c.resolve(4).expect("resolves");
    assert_eq!(r.metrics_addr, Some("127.0.0.1:10249".parse().expect("ok")));
    assert_eq!(r.healthz_addr, Some("0.0.0.0:10256".parse().expect("ok")));
    assert_eq!(
        r.kubeconfig,
        Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(r.node_name, None);
    assert_eq!(r.conntrack_flows, None);
    assert_eq!(r.sync_interval, None);
    assert_eq!(r.min_sync_interval, None);
    let fields: Vec<_> = r.ignored.iter().map(|i| i.field.as_str()).collect();
    assert_eq!(fields, ["clusterCIDR"]);
}

#[test]
fn an_unknown_field_is_an_error_naming_it() {
    let bad = KUBEADM.replace("  maxPerCore: null", "  maxPerCore: null\n  maxPerCpu: 3");
    let e = KubeProxyConfiguration::parse(&bad).expect_err("an error");
    assert!(e.contains("maxPerCpu"), "{e}");
    let bad = KUBEADM.replace("mode: \"\"", "mode: \"\"\nudpIdleTimeout: 250ms");
    let e = KubeProxyConfiguration::parse(&bad).expect_err("an error");
    assert!(e.contains("udpIdleTimeout"), "{e}");
    let json = r#"{"apiVersion":"kubeproxy.config.k8s.io/v1alpha1","kind":"KubeProxyConfiguration","bogus":1}"#;
    let e = KubeProxyConfiguration::parse(json).expect_err("an error");
    assert!(e.contains("bogus"), "{e}");
}

#[test]
fn a_repeated_field_is_an_error() {
    let bad = format!("{KUBEADM}\nmode: ipvs\n");
    let e = KubeProxyConfiguration::parse(&bad).expect_err("an error");
    assert!(e.contains("mode"), "{e}");
}

#[test]
fn wrong_api_version_or_kind_is_refused() {
    let e = KubeProxyConfiguration::parse(
        "apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeProxyConfiguration\n",
    )
    .expect_err("an error");
    assert!(e.contains("v1beta1"), "{e}");
    let e = KubeProxyConfiguration::parse(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
    )
    .expect_err("an error");
    assert!(e.contains("KubeletConfiguration"), "{e}");
}

#[test]
fn json_decodes_too() {
    let json = r#"{"apiVersion":"kubeproxy.config.k8s.io/v1alpha1","kind":"KubeProxyConfiguration",
        "metricsBindAddress":"0.0.0.0:10249","conntrack":{"maxPerCore":1000,"min":5000},
        "iptables":{"syncPeriod":"1m0s","minSyncPeriod":"250ms"},"hostnameOverride":"Node-A"}"#;
    let r = KubeProxyConfiguration::parse(json)
        .expect("ok")
        .resolve(2)
        .expect("ok");
    assert_eq!(r.metrics_addr, Some("0.0.0.0:10249".parse().expect("ok")));
    assert_eq!(r.conntrack_flows, Some(5000), "min wins over 1000 x 2");
    assert_eq!(r.sync_interval, Some(Duration::from_secs(60)));
    assert_eq!(r.min_sync_interval, Some(Duration::from_millis(250)));
    assert_eq!(
        r.node_name.as_deref(),
        Some("node-a"),
        "lowercased as kube-proxy"
    );
}

#[test]
fn conntrack_size_is_max_per_core_times_cpus_at_least_min() {
    let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
    c.conntrack.max_per_core = Some(32768);
    c.conntrack.min = Some(131072);
    assert_eq!(c.resolve(8).expect("ok").conntrack_flows, Some(262144));
    assert_eq!(c.resolve(2).expect("ok").conntrack_flows, Some(131072));
    c.conntrack.max_per_core = Some(0);
    assert_eq!(c.resolve(8).expect("ok").conntrack_flows, None, "0: as-is");
    c.conntrack.max_per_core = Some(-1);
    assert!(c.resolve(8).expect_err("an error").contains("maxPerCore"));
}

#[test]
fn the_sync_periods_of_the_configured_mode_apply_and_mode_is_named() {
    let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
    c.mode = "nftables".into();
    c.nftables.sync_period = GoDuration(Duration::from_secs(45));
    c.iptables.sync_period = GoDuration(Duration::from_secs(10));
    let r = c.resolve(1).expect("ok");
    assert_eq!(r.sync_interval, Some(Duration::from_secs(45)));
    let m = r
        .ignored
        .iter()
        .find(|i| i.field == "mode")
        .expect("mode named");
    assert!(m.why.contains("eBPF"));
}

#[test]
fn not_applicable_settings_are_named_with_the_reason() {
    let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
    c.iptables.masquerade_bit = Some(14);
    c.conntrack.tcp_established_timeout = Some(GoDuration(Duration::from_secs(86400)));
    c.feature_gates = Some([("KubeProxyDrainingTerminatingNodes".to_string(), true)].into());
    let r = c.resolve(1).expect("ok");
    let fields: Vec<_> = r.ignored.iter().map(|i| i.field.as_str()).collect();
    for f in [
        "iptables.masqueradeBit",
        "conntrack.tcpEstablishedTimeout",
        "featureGates.KubeProxyDrainingTerminatingNodes",
    ] {
        assert!(fields.contains(&f), "{f} not named in {fields:?}");
    }
}

#[test]
fn bad_values_are_errors_naming_the_field() {
    let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
    c.metrics_bind_address = "localhost:x".into();
    assert!(c
        .resolve(1)
        .expect_err("an error")
        .contains("metricsBindAddress"));
    let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
    c.cluster_cidr = "10.0.0.0/33".into();
    assert!(c.resolve(1).expect_err("an error").contains("clusterCIDR"));
    let bad = KUBEADM.replace("configSyncPeriod: 0s", "configSyncPeriod: 5 minutes");
    let e = KubeProxyConfiguration::parse(&bad).expect_err("an error");
    assert!(e.contains("configSyncPeriod"), "{e}");
}

#[test]
fn an_ip_alone_gets_kube_proxys_default_port_and_ipv6_bind_address_picks_ipv6_defaults() {
    let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
    c.healthz_bind_address = "10.1.2.3".into();
    c.bind_address = "::".into();
    let r = c.resolve(1).expect("ok");
    assert_eq!(r.healthz_addr, Some("10.1.2.3:10256".parse().expect("ok")));
    assert_eq!(r.metrics_addr, Some("[::1]:10249".parse().expect("ok")));
}

fn settings() -> AgentSettings {
    AgentSettings {
        node_name: Some("from-env".into()),
        node_name_on_command_line: false,
        metrics_addr: ("127.0.0.1:10249".parse().expect("addr"), false),
        healthz_addr: ("0.0.0.0:10256".parse().expect("addr"), false),
        kubeconfig: None,
        conntrack_flows: (131072, false),
        sync_interval: (Duration::from_secs(30), false),
        min_sync_interval: (Duration::from_millis(10), false),
    }
}

fn file(yaml: &str) -> Option<KubeProxyConfiguration> {
    Some(
        KubeProxyConfiguration::parse(&format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{yaml}"
        ))
        .expect("a config"),
    )
}

#[test]
fn with_a_file_kube_proxys_other_flags_are_replaced_and_named() {
    let flags = KubeProxyFlags {
        metrics_bind_address: Some("0.0.0.0:9999".into()),
        conntrack_max_per_core: Some(1),
        ..KubeProxyFlags::default()
    };
    let mut s = settings();
    let a = apply(
        &flags,
        file("metricsBindAddress: 127.0.0.2:10249\nconntrack:\n  maxPerCore: 100000\n"),
        &mut s,
        2,
    )
    .expect("applies");
    assert_eq!(s.metrics_addr.0, "127.0.0.2:10249".parse().expect("addr"));
    assert_eq!(s.conntrack_flows.0, 200000);
    assert_eq!(
        a.shadowed,
        ["--metrics-bind-address", "--conntrack-max-per-core"]
    );
}

#[test]
fn hostname_override_and_v_win_over_the_file() {
    let flags = KubeProxyFlags {
        hostname_override: Some("Node-B".into()),
        verbosity: Some(4),
        ..KubeProxyFlags::default()
    };
    let mut s = settings();
    let a = apply(
        &flags,
        file("hostnameOverride: node-a\nlogging:\n  verbosity: 2\n"),
        &mut s,
        1,
    )
    .expect("applies");
    assert_eq!(s.node_name.as_deref(), Some("node-b"));
    assert_eq!(a.verbosity, 4);
    // Without the flags, the file's.
    let mut s = settings();
    let a = apply(
        &KubeProxyFlags::default(),
        file("hostnameOverride: node-a\nlogging:\n  verbosity: 2\n"),
        &mut s,
        1,
    )
    .expect("applies");
    assert_eq!(
        s.node_name.as_deref(),
        Some("node-a"),
        "the file over $NODE_NAME"
    );
    assert_eq!(a.verbosity, 2);
    let empty = KubeProxyFlags {
        hostname_override: Some(" ".into()),
        ..KubeProxyFlags::default()
    };
    assert!(apply(&empty, None, &mut settings(), 1).is_err());
}

#[test]
fn the_agents_own_explicit_settings_win_over_the_file() {
    let mut s = settings();
    s.conntrack_flows = (5000, true);
    s.sync_interval = (Duration::from_secs(5), true);
    s.metrics_addr = ("127.0.0.1:1".parse().expect("addr"), true);
    s.node_name_on_command_line = true;
    apply(
        &KubeProxyFlags::default(),
        file("hostnameOverride: node-a\nmetricsBindAddress: 0.0.0.0:10249\nconntrack:\n  maxPerCore: 100000\niptables:\n  syncPeriod: 1m0s\n  minSyncPeriod: 2s\n"),
        &mut s,
        4,
    )
    .expect("applies");
    assert_eq!(s.conntrack_flows.0, 5000);
    assert_eq!(s.sync_interval.0, Duration::from_secs(5));
    assert_eq!(s.metrics_addr.0, "127.0.0.1:1".parse().expect("addr"));
    assert_eq!(
        s.node_name.as_deref(),
        Some("from-env"),
        "--node-name on the command line"
    );
    assert_eq!(
        s.min_sync_interval.0,
        Duration::from_secs(2),
        "not explicit: the file's"
    );
}

#[test]
fn without_a_file_kube_proxys_flags_apply() {
    let flags = KubeProxyFlags {
        healthz_bind_address: Some("127.0.0.1".into()),
        conntrack_min: Some(1_000_000),
        cluster_cidr: Some("10.244.0.0/16".into()),
        proxy_mode: Some("ipvs".into()),
        ..KubeProxyFlags::default()
    };
    let mut s = settings();
    let a = apply(&flags, None, &mut s, 2).expect("applies");
    assert_eq!(s.healthz_addr.0, "127.0.0.1:10256".parse().expect("addr"));
    assert_eq!(
        s.metrics_addr.0,
        "127.0.0.1:10249".parse().expect("addr"),
        "untouched"
    );
    assert_eq!(s.conntrack_flows.0, 1_000_000, "min over 32768 x 2");
    let fields: Vec<_> = a.ignored.iter().map(|i| i.field.as_str()).collect();
    assert_eq!(fields, ["mode", "clusterCIDR"]);
    assert!(a.shadowed.is_empty());
    let bad = KubeProxyFlags {
        cluster_cidr: Some("10.244.0.0".into()),
        ..KubeProxyFlags::default()
    };
    assert!(apply(&bad, None, &mut settings(), 1)
        .expect_err("not a CIDR")
        .contains("clusterCIDR"));
}

#[test]
fn go_durations() {
    for (s, d) in [
        ("0s", Duration::ZERO),
        ("0", Duration::ZERO),
        ("1h0m0s", Duration::from_secs(3600)),
        ("15m0s", Duration::from_secs(900)),
        ("250ms", Duration::from_millis(250)),
        ("1.5s", Duration::from_millis(1500)),
        ("2h22m", Duration::from_secs(2 * 3600 + 22 * 60)),
    ] {
        assert_eq!(parse_go_duration(s), Ok(d), "{s}");
    }
    for s in ["", "5", "5 s", "-1s", "1d"] {
        assert!(parse_go_duration(s).is_err(), "{s}");
    }
}

#[test]
fn localhost_node_ports_follow_kube_proxys_iptables_mode() {
    let with = |edit: &dyn Fn(&mut KubeProxyConfiguration)| {
        let mut c = KubeProxyConfiguration::parse(KUBEADM).expect("ok");
        edit(&mut c);
        c.resolve(1).map(|r| r.localhost_nodeports)
    };
    // kubeadm's file (localhostNodePorts null, no nodePortAddresses): the default (on).
    assert_eq!(with(&|_| {}), Ok(None));
    assert_eq!(
        with(&|c| c.iptables.localhost_node_ports = Some(false)),
        Ok(Some(false))
    );
    let addrs = |a: &[&str]| {
        let a: Vec<String> = a.iter().map(|s| s.to_string()).collect();
        move |c: &mut KubeProxyConfiguration| c.node_port_addresses = Some(a.clone())
    };
    assert_eq!(with(&addrs(&["10.0.0.0/8", "127.0.0.0/8"])), Ok(None));
    assert_eq!(with(&addrs(&["0.0.0.0/0"])), Ok(None));
    assert_eq!(with(&addrs(&["10.0.0.0/8"])), Ok(Some(false)));
    assert_eq!(with(&addrs(&["primary"])), Ok(Some(false)));
    assert_eq!(with(&|c| c.mode = "nftables".into()), Ok(Some(false)));
    let err = with(&addrs(&["10.0.0.1"])).expect_err("not a CIDR");
    assert!(err.contains("nodePortAddresses \"10.0.0.1\""), "{err}");
    // The flag, without a file, the same.
    let flags = KubeProxyFlags {
        nodeport_addresses: Some(vec!["192.0.2.0/24".into()]),
        ..KubeProxyFlags::default()
    };
    let a = apply(&flags, None, &mut settings(), 1).expect("applies");
    assert_eq!(a.localhost_nodeports, Some(false));
    assert_eq!(a.nodeport_addresses, Some(vec!["192.0.2.0/24".to_string()]));
    assert!(a.ignored.is_empty(), "applied, not named: {:?}", a.ignored);
}
