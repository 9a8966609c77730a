//! `proxy-agent cleanup-kube-proxy` (the real binary) against kube-proxy's three modes,
//! each reproduced in fresh network namespaces next to other programs' rules: the
//! iptables mode for `iptables-legacy`, `iptables-nft`, `ip6tables-legacy` and
//! `ip6tables-nft`; the nftables mode (`table ip/ip6 kube-proxy`); the IPVS mode
//! (`kube-ipvs0`, virtual services, `KUBE-*` ipsets and the iptables rules matching them).
//! Each test checks that exactly kube-proxy's objects go and everything else is
//! byte-for-byte what it was (compared with a reference namespace that got only the other
//! programs' rules, or with a snapshot taken before kube-proxy's were added), that a second
//! run changes nothing, and that `--dry-run` lists the same removals and changes nothing.
//! The last test runs `proxy-agent run` with and without `--cleanup-kube-proxy`.
//!
//! Safety: every command, the cleanup included, runs through
//! `nsenter --net=/var/run/netns/NAME`; namespaces are deleted on drop (their tables,
//! ipsets, IPVS services and links with them); each test also checks that the host's
//! nftables ruleset and ipsets are unchanged.
//!
//! Kernel features: this machine's kernel has neither IPVS nor dummy links. The IPVS mode
//! is two tests: its ipsets, rules and a `kube-ipvs0` of another kind (left alone) on any
//! kernel, and its virtual services with the dummy `kube-ipvs0`, which reports itself
//! SKIPPED with the reason on a kernel without them (`cargo xtask test` counts it as
//! skipped, not passed); `EBPF_PROXY_TEST_REQUIRE_IPVS=1` turns that into a failure.
//!
//! IP plan (IPv4 / IPv6): services 10.96.0.0/16 / fd00:96::/112, pods 10.244.0.0/16 /
//! fd00:244::/56, load balancer 203.0.113.10 / 2001:db8:113::10, node 192.0.2.5 /
//! 2001:db8:2::5. Nothing is routed; no packet is sent.
//!
//! Over 600 lines: one suite (the cleanup's scenarios per kube-proxy mode). Each file under
//! `tests/` is a test binary of its own that links the whole crate, so a suite is split
//! into modules only when its scenarios stop sharing set-up (shared helpers live in
//! `tests/support/`).

mod support;

use std::{
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use support::{cgroup2_mount, http_get, require_root, unique, Netns, PinDir};

const AGENT: &str = env!("CARGO_BIN_EXE_proxy-agent");

// ---------------------------------------------------------------------------------------
// Running things inside a namespace

fn ns_exec(ns: &Netns, program: &str, args: &[&str], stdin: Option<&str>) -> Output {
    let netns = format!("--net={}", ns.path().display());
    let mut child = Command::new("nsenter")
        .arg(&netns)
        .arg(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("nsenter {program} {args:?}: {e} (run `cargo xtask setup`)"));
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes())
            .unwrap_or_else(|e| panic!("{program} stdin: {e}"));
    }
    child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{program} {args:?}: {e}"))
}

/// Runs `program args` in `ns` and returns stdout; panics with stderr on failure.
fn ns_run(ns: &Netns, program: &str, args: &[&str], stdin: Option<&str>) -> String {
    let out = ns_exec(ns, program, args, stdin);
    assert!(
        out.status.success(),
        "in {}: {program} {args:?} failed: {}\n{}",
        ns.name,
        String::from_utf8_lossy(&out.stderr),
        stdin.unwrap_or_default()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `proxy-agent cleanup-kube-proxy [--dry-run]` in `ns`; its stdout.
fn cleanup(ns: &Netns, dry_run: bool) -> String {
    let mut args = vec!["cleanup-kube-proxy"];
    if dry_run {
        args.push("--dry-run");
    }
    let out = ns_exec(ns, AGENT, &args, None);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "cleanup-kube-proxy {args:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "--- cleanup-kube-proxy {args:?} in {} ---\n{stdout}",
        ns.name
    );
    stdout
}

/// `iptables-restore --noflush` with one of the four tools.
fn restore(ns: &Netns, tool: &str, rules: &str) {
    ns_run(ns, &format!("{tool}-restore"), &["--noflush"], Some(rules));
}

/// The four iptables tools, with their family.
const TOOLS: [(&str, bool); 4] = [
    ("iptables-legacy", false),
    ("iptables-nft", false),
    ("ip6tables-legacy", true),
    ("ip6tables-nft", true),
];

// ---------------------------------------------------------------------------------------
// State snapshots

/// Everything the cleanup could touch in a namespace, normalized (no timestamps or
/// counters).
#[derive(Debug, PartialEq, Eq)]
struct State {
    iptables: String,
    nft: String,
    ipsets: String,
    links: String,
    ipvs: String,
}

impl State {
    fn of(ns: &Netns) -> Self {
        let mut iptables = String::new();
        for (tool, _) in TOOLS {
            // Without -t, -save prints only the tables that exist (legacy: those in
            // /proc/net/ip*_tables_names), so taking the snapshot creates nothing.
            iptables += &format!("## {tool}\n");
            iptables += &normalize(&ns_run(ns, &format!("{tool}-save"), &[], None));
        }
        let ipvs = if ipvs_available(ns) {
            ns_run(ns, "ipvsadm", &["-S", "-n"], None)
        } else {
            String::new()
        };
        Self {
            iptables,
            nft: normalize(&ns_run(ns, "nft", &["list", "ruleset"], None)),
            ipsets: ns_run(ns, "ipset", &["save"], None),
            links: ns_run(ns, "ip", &["-o", "addr", "show"], None)
                + &ns_run(ns, "ip", &["-o", "-d", "link", "show"], None),
            ipvs,
        }
    }
}

/// Drops `#` comment lines and zeroes `[packets:bytes]` and nft `packets N bytes M`
/// counters.
fn normalize(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with('#') {
            continue;
        }
        let words: Vec<String> = line
            .split(' ')
            .map(|w| {
                let counters = w.starts_with('[')
                    && w.ends_with(']')
                    && w[1..w.len() - 1]
                        .split(':')
                        .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
                if counters {
                    "[0:0]".to_string()
                } else {
                    w.to_string()
                }
            })
            .collect();
        let mut line = words.join(" ");
        for key in ["packets ", "bytes "] {
            let mut fixed = String::new();
            let mut rest = line.as_str();
            while let Some(i) = rest.find(key) {
                fixed += &rest[..i + key.len()];
                rest = &rest[i + key.len()..];
                let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
                if digits > 0 {
                    fixed.push('0');
                    rest = &rest[digits..];
                }
            }
            fixed += rest;
            line = fixed;
        }
        out += &line;
        out.push('\n');
    }
    out
}

/// What the host shows of the things the tests create (read-only: nft and ipset lists).
#[derive(Debug, PartialEq, Eq)]
struct HostWitness {
    nft: String,
    ipsets: String,
}

impl HostWitness {
    fn take() -> Self {
        let read = |program: &str, args: &[&str]| {
            let out = Command::new(program)
                .args(args)
                .output()
                .unwrap_or_else(|e| panic!("{program}: {e}"));
            assert!(
                out.status.success(),
                "{program} {args:?} on the host failed"
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        Self {
            nft: normalize(&read("nft", &["list", "ruleset"])),
            ipsets: read("ipset", &["list", "-n"]),
        }
    }
}

fn ipvs_available(ns: &Netns) -> bool {
    ns_exec(ns, "test", &["-e", "/proc/net/ip_vs"], None)
        .status
        .success()
}

fn require_full_kernel() -> bool {
    std::env::var("EBPF_PROXY_TEST_REQUIRE_IPVS").is_ok_and(|v| v == "1")
}

// ---------------------------------------------------------------------------------------
// Fixtures

/// Placeholders of the fixtures and their IPv4 / IPv6 values.
const PLAN: &[(&str, &str, &str)] = &[
    ("{HOST}", "32", "128"),
    ("{DNS}", "10.96.0.10", "fd00:96::a"),
    ("{WEB}", "10.96.0.20", "fd00:96::14"),
    ("{EMPTY}", "10.96.0.50", "fd00:96::32"),
    ("{SVCNET}", "10.96.0.0/16", "fd00:96::/112"),
    ("{LB}", "203.0.113.10", "2001:db8:113::10"),
    ("{LBSRC}", "198.51.100.0/24", "2001:db8:51::/64"),
    ("{PODS}", "10.244.0.0/16", "fd00:244::/56"),
    ("{EP1P}", "10.244.1.2", "[fd00:244:1::2]"),
    ("{EP2P}", "10.244.2.2", "[fd00:244:2::2]"),
    ("{EP3P}", "10.244.1.3", "[fd00:244:1::3]"),
    ("{EP4P}", "10.244.2.4", "[fd00:244:2::4]"),
    ("{EP1}", "10.244.1.2", "fd00:244:1::2"),
    ("{EP2}", "10.244.2.2", "fd00:244:2::2"),
    ("{EP3}", "10.244.1.3", "fd00:244:1::3"),
    ("{EP4}", "10.244.2.4", "fd00:244:2::4"),
    // Endpoint addresses in nftables chain names: kube-proxy writes `:` as `.`.
    ("{EP1DOT}", "10.244.1.2", "fd00.244.1..2"),
    ("{EP2DOT}", "10.244.2.2", "fd00.244.2..2"),
    ("{EP3DOT}", "10.244.1.3", "fd00.244.1..3"),
    ("{NODE}", "192.0.2.5", "2001:db8:2::5"),
    ("{LOOP}", "127.0.0.0/8", "::1/128"),
    ("{DOCKERNET}", "172.17.0.0/16", "fd00:172:17::/64"),
    ("{FAM}", "ip", "ip6"),
    ("{ATYPE}", "ipv4_addr", "ipv6_addr"),
    ("{SETFAM}", "inet", "inet6"),
];

fn family(template: &str, v6: bool) -> String {
    PLAN.iter().fold(template.to_string(), |s, (key, v4, v6v)| {
        s.replace(key, if v6 { v6v } else { v4 })
    })
}

/// kube-proxy's iptables mode as it writes it with `iptables-restore --noflush` (chains
/// declared, rules appended) and `iptables -I` (the jumps from the built-in chains,
/// prepended): ClusterIP with two endpoints, NodePort, LoadBalancer with source ranges,
/// a service without endpoints, an `externalTrafficPolicy: Local` one.
const KUBE_IPTABLES: &str = r#"*mangle
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:KUBE-PROXY-CANARY - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-I INPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-I INPUT 1 -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-I INPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-I FORWARD 1 -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-I OUTPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-I OUTPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-NODEPORTS -p tcp -m comment --comment "default/local:http health check node port" -m tcp --dport 32000 -j ACCEPT
-A KUBE-SERVICES -d {EMPTY}/{HOST} -p tcp -m comment --comment "default/empty:http has no endpoints" -m tcp --dport 80 -j REJECT
-A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "default/empty:http has no endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30050 -j REJECT
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-PROXY-FIREWALL -d {LB}/{HOST} -p tcp -m comment --comment "default/web:http traffic not accepted by KUBE-FW-LOLE4ISW44XBNF3G" -m tcp --dport 80 -j DROP
COMMIT
*nat
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-MARK-DROP - [0:0]
:KUBE-SVC-TCOU7JCQXEZGVUNU - [0:0]
:KUBE-SEP-IT2ZTR26TO4XFPTO - [0:0]
:KUBE-SEP-YIL6JZP7A3QYXJU2 - [0:0]
:KUBE-SVC-LOLE4ISW44XBNF3G - [0:0]
:KUBE-EXT-LOLE4ISW44XBNF3G - [0:0]
:KUBE-FW-LOLE4ISW44XBNF3G - [0:0]
:KUBE-SEP-ZXMNUKOKXUTL2MK2 - [0:0]
:KUBE-SVL-QN5HIEVYUPDP6UNK - [0:0]
:KUBE-EXT-QN5HIEVYUPDP6UNK - [0:0]
:KUBE-SEP-5OJB2KTY2QIQ7IS2 - [0:0]
-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I POSTROUTING 1 -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-MARK-DROP -j MARK --or-mark 0x8000
-A KUBE-SERVICES -d {DNS}/{HOST} -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-SVC-TCOU7JCQXEZGVUNU
-A KUBE-SERVICES -d {WEB}/{HOST} -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-LOLE4ISW44XBNF3G
-A KUBE-SERVICES -d {LB}/{HOST} -p tcp -m comment --comment "default/web:http loadbalancer IP" -m tcp --dport 80 -j KUBE-FW-LOLE4ISW44XBNF3G
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j KUBE-EXT-LOLE4ISW44XBNF3G
-A KUBE-NODEPORTS -p tcp -m comment --comment "default/local:http" -m tcp --dport 30081 -j KUBE-EXT-QN5HIEVYUPDP6UNK
-A KUBE-SVC-TCOU7JCQXEZGVUNU ! -s {PODS} -d {DNS}/{HOST} -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-MARK-MASQ
-A KUBE-SVC-TCOU7JCQXEZGVUNU -m comment --comment "kube-system/kube-dns:dns -> {EP1P}:53" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-IT2ZTR26TO4XFPTO
-A KUBE-SVC-TCOU7JCQXEZGVUNU -m comment --comment "kube-system/kube-dns:dns -> {EP2P}:53" -j KUBE-SEP-YIL6JZP7A3QYXJU2
-A KUBE-SEP-IT2ZTR26TO4XFPTO -s {EP1}/{HOST} -m comment --comment "kube-system/kube-dns:dns" -j KUBE-MARK-MASQ
-A KUBE-SEP-IT2ZTR26TO4XFPTO -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp -j DNAT --to-destination {EP1P}:53
-A KUBE-SEP-YIL6JZP7A3QYXJU2 -s {EP2}/{HOST} -m comment --comment "kube-system/kube-dns:dns" -j KUBE-MARK-MASQ
-A KUBE-SEP-YIL6JZP7A3QYXJU2 -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp -j DNAT --to-destination {EP2P}:53
-A KUBE-SVC-LOLE4ISW44XBNF3G ! -s {PODS} -d {WEB}/{HOST} -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-LOLE4ISW44XBNF3G -m comment --comment "default/web:http -> {EP3P}:8080" -j KUBE-SEP-ZXMNUKOKXUTL2MK2
-A KUBE-EXT-LOLE4ISW44XBNF3G -m comment --comment "masquerade traffic for default/web:http external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-LOLE4ISW44XBNF3G -j KUBE-SVC-LOLE4ISW44XBNF3G
-A KUBE-FW-LOLE4ISW44XBNF3G -s {LBSRC} -m comment --comment "default/web:http loadbalancer IP" -j KUBE-EXT-LOLE4ISW44XBNF3G
-A KUBE-FW-LOLE4ISW44XBNF3G -m comment --comment "other traffic to default/web:http will be dropped by KUBE-PROXY-FIREWALL"
-A KUBE-SEP-ZXMNUKOKXUTL2MK2 -s {EP3}/{HOST} -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-ZXMNUKOKXUTL2MK2 -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination {EP3P}:8080
-A KUBE-EXT-QN5HIEVYUPDP6UNK -m comment --comment "masquerade LOCAL traffic for default/local:http external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-EXT-QN5HIEVYUPDP6UNK -j KUBE-SVL-QN5HIEVYUPDP6UNK
-A KUBE-SVL-QN5HIEVYUPDP6UNK -m comment --comment "default/local:http -> {EP4P}:8080" -j KUBE-SEP-5OJB2KTY2QIQ7IS2
-A KUBE-SEP-5OJB2KTY2QIQ7IS2 -s {EP4}/{HOST} -m comment --comment "default/local:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-5OJB2KTY2QIQ7IS2 -p tcp -m comment --comment "default/local:http" -m tcp -j DNAT --to-destination {EP4P}:8080
COMMIT
"#;

/// Other programs' rules written before kube-proxy's: Docker's chains, kubelet's
/// `KUBE-FIREWALL` and `KUBE-KUBELET-CANARY` (which stay), a site's own rules.
const OTHER_IPTABLES_BEFORE: &str = r#"*mangle
:KUBE-KUBELET-CANARY - [0:0]
-A PREROUTING -i eth9 -m comment --comment "site: mark uplink" -j MARK --set-xmark 0x100/0x100
COMMIT
*filter
:KUBE-FIREWALL - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:DOCKER - [0:0]
:DOCKER-USER - [0:0]
-A INPUT -j KUBE-FIREWALL
-A INPUT -p tcp -m tcp --dport 22 -m comment --comment "site: ssh" -j ACCEPT
-A FORWARD -j DOCKER-USER
-A FORWARD -o docker0 -j DOCKER
-A OUTPUT -j KUBE-FIREWALL
-A DOCKER-USER -j RETURN
-A KUBE-FIREWALL -m comment --comment "kubernetes firewall for dropping marked packets" -m mark --mark 0x8000/0x8000 -j DROP
COMMIT
*nat
:KUBE-KUBELET-CANARY - [0:0]
:DOCKER - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
-A OUTPUT ! -d {LOOP} -m addrtype --dst-type LOCAL -j DOCKER
-A POSTROUTING -s {DOCKERNET} ! -o docker0 -j MASQUERADE
-A DOCKER -i docker0 -j RETURN
COMMIT
"#;

/// Other programs' rules written after kube-proxy's (appended behind its jumps).
const OTHER_IPTABLES_AFTER: &str = r#"*nat
-A POSTROUTING -o eth0 -m comment --comment "site: masquerade uplink" -j MASQUERADE
-A PREROUTING -p tcp -m tcp --dport 8080 -m comment --comment "site: redirect" -j REDIRECT --to-ports 80
COMMIT
*filter
-A FORWARD -i eth0 -m comment --comment "site: after kube-proxy" -j ACCEPT
COMMIT
"#;

/// kube-proxy's nftables mode (after `pkg/proxy/nftables`): base chains, the service
/// and endpoint chains, the sets and verdict maps that tie them.
const KUBE_NFT: &str = r#"table {FAM} kube-proxy {
	comment "rules for kube-proxy"
	set cluster-ips { type {ATYPE}; comment "Active ClusterIPs"; }
	set nodeport-ips { type {ATYPE}; comment "IPs that accept NodePort traffic"; }
	map no-endpoint-services { type {ATYPE} . inet_proto . inet_service : verdict; comment "vmap to drop or reject packets to services with no endpoints"; }
	map no-endpoint-nodeports { type inet_proto . inet_service : verdict; comment "vmap to drop or reject packets to service nodeports with no endpoints"; }
	map firewall-ips { type {ATYPE} . inet_proto . inet_service : verdict; comment "destinations that are subject to LoadBalancerSourceRanges"; }
	map service-ips { type {ATYPE} . inet_proto . inet_service : verdict; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic"; }
	map service-nodeports { type inet_proto . inet_service : verdict; comment "NodePort traffic"; }
	chain filter-prerouting { type filter hook prerouting priority -110; policy accept; ct state new jump firewall-check; }
	chain filter-input { type filter hook input priority -110; policy accept; ct state new jump nodeport-endpoints-check; ct state new jump service-endpoints-check; }
	chain filter-forward { type filter hook forward priority -110; policy accept; ct state new jump service-endpoints-check; ct state new jump cluster-ips-check; }
	chain filter-output { type filter hook output priority -110; policy accept; ct state new jump service-endpoints-check; ct state new jump firewall-check; }
	chain filter-output-post-dnat { type filter hook output priority -90; policy accept; ct state new jump cluster-ips-check; }
	chain nat-prerouting { type nat hook prerouting priority -100; policy accept; jump services; }
	chain nat-output { type nat hook output priority -100; policy accept; jump services; }
	chain nat-postrouting { type nat hook postrouting priority 100; policy accept; jump masquerading; }
	chain cluster-ips-check { {FAM} daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"; {FAM} daddr {SVCNET} drop comment "Drop traffic to unallocated ClusterIPs"; }
	chain firewall-check { {FAM} daddr . meta l4proto . th dport vmap @firewall-ips; }
	chain mark-for-masquerade { meta mark set meta mark | 0x4000; }
	chain masquerading { meta mark & 0x4000 == 0 return; meta mark set meta mark ^ 0x4000; masquerade fully-random; }
	chain nodeport-endpoints-check { {FAM} daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports; }
	chain service-endpoints-check { {FAM} daddr . meta l4proto . th dport vmap @no-endpoint-services; }
	chain services { {FAM} daddr . meta l4proto . th dport vmap @service-ips; {FAM} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports; }
	chain endpoint-IT2ZTR26-kube-system/kube-dns/udp/dns__{EP1DOT}/53 { {FAM} saddr {EP1} jump mark-for-masquerade; meta l4proto udp dnat to {EP1P}:53; }
	chain endpoint-YIL6JZP7-kube-system/kube-dns/udp/dns__{EP2DOT}/53 { {FAM} saddr {EP2} jump mark-for-masquerade; meta l4proto udp dnat to {EP2P}:53; }
	chain service-TCOU7JCQ-kube-system/kube-dns/udp/dns { {FAM} daddr {DNS} udp dport 53 {FAM} saddr != {PODS} jump mark-for-masquerade; numgen random mod 2 vmap { 0 : goto endpoint-IT2ZTR26-kube-system/kube-dns/udp/dns__{EP1DOT}/53, 1 : goto endpoint-YIL6JZP7-kube-system/kube-dns/udp/dns__{EP2DOT}/53 }; }
	chain endpoint-ZXMNUKOK-default/web/tcp/http__{EP3DOT}/8080 { {FAM} saddr {EP3} jump mark-for-masquerade; meta l4proto tcp dnat to {EP3P}:8080; }
	chain service-LOLE4ISW-default/web/tcp/http { {FAM} daddr {WEB} tcp dport 80 {FAM} saddr != {PODS} jump mark-for-masquerade; numgen random mod 1 vmap { 0 : goto endpoint-ZXMNUKOK-default/web/tcp/http__{EP3DOT}/8080 }; }
	chain external-LOLE4ISW-default/web/tcp/http { jump mark-for-masquerade; goto service-LOLE4ISW-default/web/tcp/http; }
}
add element {FAM} kube-proxy cluster-ips { {DNS}, {WEB} }
add element {FAM} kube-proxy nodeport-ips { {NODE} }
add element {FAM} kube-proxy no-endpoint-services { {EMPTY} . tcp . 80 : drop }
add element {FAM} kube-proxy service-ips { {DNS} . udp . 53 : goto service-TCOU7JCQ-kube-system/kube-dns/udp/dns, {WEB} . tcp . 80 : goto service-LOLE4ISW-default/web/tcp/http }
add element {FAM} kube-proxy service-nodeports { tcp . 30080 : goto external-LOLE4ISW-default/web/tcp/http }
"#;

/// Another program's nftables, before kube-proxy's: its own chain even named kube-proxy.
const OTHER_NFT_BEFORE: &str = r#"table inet other {
	comment "another program's firewall"
	set trusted { type ipv4_addr; flags interval; elements = { 192.0.2.0/24 } }
	chain input { type filter hook input priority 0; policy accept; ip saddr @trusted tcp dport 22 accept; }
	chain kube-proxy { counter; }
}
"#;

/// ... and after: a table whose name only starts like kube-proxy's.
const OTHER_NFT_AFTER: &str = r#"table ip6 kube-proxy-audit {
	chain audit { type filter hook output priority 10; policy accept; meta l4proto tcp counter; }
}
"#;

/// The chains declared per table in an iptables-restore fixture, and how many jumps
/// (`-I`) it prepends to built-in chains.
fn declared(fixture: &str) -> Vec<(String, Vec<String>, usize)> {
    let mut out: Vec<(String, Vec<String>, usize)> = Vec::new();
    for line in fixture.lines() {
        if let Some(table) = line.strip_prefix('*') {
            out.push((table.to_string(), Vec::new(), 0));
        } else if let Some(decl) = line.strip_prefix(':') {
            let chain = decl.split_whitespace().next().expect("chain name");
            out.last_mut().expect("a table").1.push(chain.to_string());
        } else if line.starts_with("-I ") {
            out.last_mut().expect("a table").2 += 1;
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Tests

#[test]
fn iptables_mode_is_removed_for_all_four_backends_and_nothing_else() {
    require_root();
    let host = HostWitness::take();
    let test = Netns::new(unique("kpc-ipt-"));
    let reference = Netns::new(unique("kpc-ipt-ref-"));
    for (tool, v6) in TOOLS {
        for ns in [&test, &reference] {
            restore(ns, tool, &family(OTHER_IPTABLES_BEFORE, v6));
        }
        restore(&test, tool, &family(KUBE_IPTABLES, v6));
        for ns in [&test, &reference] {
            restore(ns, tool, &family(OTHER_IPTABLES_AFTER, v6));
        }
    }
    let expected = State::of(&reference);
    let loaded = State::of(&test);
    assert_ne!(loaded, expected, "kube-proxy's rules did not load");
    for (tool, _) in TOOLS {
        let section = loaded
            .iptables
            .split("## ")
            .find(|s| s.starts_with(tool))
            .expect("tool section");
        assert!(
            section.contains(":KUBE-SVC-TCOU7JCQXEZGVUNU - [0:0]"),
            "{tool} lacks kube-proxy's chains:\n{section}"
        );
    }
    assert_eq!(HostWitness::take(), host, "the host's tables changed");

    // Dry run: lists everything, changes nothing.
    let dry = cleanup(&test, true);
    assert_eq!(State::of(&test), loaded, "--dry-run changed something");
    let decl = declared(KUBE_IPTABLES);
    for (tool, _) in TOOLS {
        for (table, chains, jumps) in &decl {
            let scope = format!("{tool} {table}: ");
            for chain in chains {
                let line = format!("would remove: {scope}chain {chain} (");
                assert!(dry.contains(&line), "missing `{line}` in:\n{dry}");
            }
            let listed = dry
                .lines()
                .filter(|l| l.starts_with(&format!("would remove: {scope}rule -A ")))
                .count();
            assert_eq!(listed, *jumps, "{scope}jump rules in:\n{dry}");
        }
    }
    for kubelets in ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "DOCKER"] {
        assert!(
            !dry.contains(&format!("chain {kubelets} "))
                && !dry.contains(&format!("-j {kubelets}\n")),
            "{kubelets} must stay:\n{dry}"
        );
    }

    // The real run: the namespace is now exactly the reference.
    let real = cleanup(&test, false);
    assert_eq!(dry.replace("would remove", "removed"), real);
    let after = State::of(&test);
    assert_eq!(
        after.iptables, expected.iptables,
        "iptables differ from the reference"
    );
    assert_eq!(
        after.nft, expected.nft,
        "nft ruleset differs from the reference"
    );
    assert!(real.contains("summary: "), "{real}");
    assert!(!real.contains("error:"), "{real}");

    // Idempotent.
    let again = cleanup(&test, false);
    assert!(again.contains("nothing of kube-proxy's found"), "{again}");
    assert!(
        again.contains("summary: 0 removed, 0 kept, 0 error(s)"),
        "{again}"
    );
    assert_eq!(State::of(&test), after);
    assert_eq!(HostWitness::take(), host, "the host's tables changed");
}

#[test]
fn a_kube_proxy_chain_that_another_rule_still_needs_is_kept() {
    require_root();
    let test = Netns::new(unique("kpc-keep-"));
    // A CNI hostport chain reusing kube-proxy's masquerade mark chain.
    restore(
        &test,
        "iptables-nft",
        "*nat\n:CNI-HOSTPORT-MASQ - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-SERVICES - [0:0]\n\
         -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n\
         -A CNI-HOSTPORT-MASQ -m mark --mark 0x2000/0x2000 -j KUBE-MARK-MASQ\n\
         -A POSTROUTING -j CNI-HOSTPORT-MASQ\n\
         -I PREROUTING 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A KUBE-SERVICES -d 10.96.0.1/32 -j KUBE-MARK-MASQ\nCOMMIT\n",
    );
    let out = cleanup(&test, false);
    assert!(
        out.contains("removed: iptables-nft nat: chain KUBE-SERVICES (1 rule(s))"),
        "{out}"
    );
    assert!(
        out.contains("kept: iptables-nft nat: chain KUBE-MARK-MASQ: still referenced by `-A CNI-HOSTPORT-MASQ"),
        "{out}"
    );
    let nat = ns_run(&test, "iptables-nft-save", &["-t", "nat"], None);
    assert!(
        nat.contains("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000"),
        "{nat}"
    );
    assert!(!nat.contains("KUBE-SERVICES"), "{nat}");
}

#[test]
fn nftables_mode_tables_are_removed_and_nothing_else() {
    require_root();
    let host = HostWitness::take();
    let test = Netns::new(unique("kpc-nft-"));
    let reference = Netns::new(unique("kpc-nft-ref-"));
    for ns in [&test, &reference] {
        ns_run(ns, "nft", &["-f", "-"], Some(OTHER_NFT_BEFORE));
    }
    for v6 in [false, true] {
        ns_run(&test, "nft", &["-f", "-"], Some(&family(KUBE_NFT, v6)));
    }
    for ns in [&test, &reference] {
        ns_run(ns, "nft", &["-f", "-"], Some(OTHER_NFT_AFTER));
    }
    let expected = State::of(&reference);
    let loaded = State::of(&test);
    assert!(
        loaded.nft.contains("table ip6 kube-proxy {"),
        "{}",
        loaded.nft
    );
    assert!(
        loaded
            .nft
            .contains("chain endpoint-IT2ZTR26-kube-system/kube-dns/udp/dns__fd00.244.1..2/53"),
        "{}",
        loaded.nft
    );
    assert_eq!(HostWitness::take(), host, "the host's ruleset changed");

    let dry = cleanup(&test, true);
    assert_eq!(State::of(&test), loaded, "--dry-run changed something");
    assert!(
        dry.contains("would remove: nft: table ip kube-proxy (21 chains)"),
        "{dry}"
    );
    assert!(
        dry.contains("would remove: nft: table ip6 kube-proxy (21 chains)"),
        "{dry}"
    );
    assert_eq!(dry.matches("would remove:").count(), 2, "{dry}");

    let real = cleanup(&test, false);
    assert_eq!(dry.replace("would remove", "removed"), real);
    assert_eq!(State::of(&test), expected, "differs from the reference");

    let again = cleanup(&test, false);
    assert!(again.contains("nothing of kube-proxy's found"), "{again}");
    assert_eq!(State::of(&test), expected);
    assert_eq!(HostWitness::take(), host, "the host's ruleset changed");
}

/// kube-proxy's IPVS-mode ipsets: `(name, create options, entries)`.
const KUBE_IPSETS: &[(&str, &str, &[&str])] = &[
    (
        "KUBE-CLUSTER-IP",
        "hash:ip,port family inet",
        &["10.96.0.10,udp:53", "10.96.0.20,tcp:80"],
    ),
    (
        "KUBE-LOOP-BACK",
        "hash:ip,port,ip family inet",
        &["10.244.1.2,udp:53,10.244.1.2"],
    ),
    (
        "KUBE-NODE-PORT-TCP",
        "bitmap:port range 0-65535",
        &["30080"],
    ),
    ("KUBE-NODE-PORT-LOCAL-TCP", "bitmap:port range 0-65535", &[]),
    (
        "KUBE-HEALTH-CHECK-NODE-PORT",
        "bitmap:port range 0-65535",
        &[],
    ),
    ("KUBE-LOAD-BALANCER", "hash:ip,port family inet", &[]),
    ("KUBE-LOAD-BALANCER-FW", "hash:ip,port family inet", &[]),
    (
        "KUBE-IPVS-IPS",
        "hash:ip family inet",
        &["10.96.0.10", "10.96.0.20"],
    ),
    (
        "KUBE-6-CLUSTER-IP",
        "hash:ip,port family inet6",
        &["fd00:96::a,udp:53"],
    ),
    // IPv6 names are cut to 31 characters.
    (
        "KUBE-6-LOAD-BALANCER-SOURCE-CID",
        "hash:ip,port,net family inet6",
        &[],
    ),
];

/// kube-proxy's IPVS-mode iptables rules (after `pkg/proxy/ipvs`), for IPv4.
const KUBE_IPVS_IPTABLES_V4: &str = r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:KUBE-MARK-MASQ - [0:0]
-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I POSTROUTING 1 -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-SERVICES ! -s 10.244.0.0/16 -m comment --comment "Kubernetes service cluster ip + port for masquerade purpose" -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m comment --comment "Kubernetes service lb portal" -m set --match-set KUBE-LOAD-BALANCER dst,dst -j KUBE-LOAD-BALANCER
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ
-A KUBE-POSTROUTING -m comment --comment "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose" -m set --match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-NODE-PORT -p tcp -m comment --comment "Kubernetes nodeport TCP port for masquerade purpose" -m set --match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
COMMIT
*filter
:KUBE-FORWARD - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SOURCE-RANGES-FIREWALL - [0:0]
:KUBE-IPVS-FILTER - [0:0]
:KUBE-IPVS-OUT-FILTER - [0:0]
-I INPUT 1 -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-FILTER
-I INPUT 1 -m comment --comment "kube-proxy firewall rules" -j KUBE-PROXY-FIREWALL
-I INPUT 1 -m comment --comment "kubernetes health check rules" -j KUBE-NODE-PORT
-I FORWARD 1 -m comment --comment "kube-proxy firewall rules" -j KUBE-PROXY-FIREWALL
-I FORWARD 1 -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-I OUTPUT 1 -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-OUT-FILTER
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-NODE-PORT -m comment --comment "Kubernetes health check node port" -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j ACCEPT
-A KUBE-PROXY-FIREWALL -m comment --comment "Kubernetes service load balancer ip + port for load balancer with sourceRange" -m set --match-set KUBE-LOAD-BALANCER-FW dst,dst -j KUBE-SOURCE-RANGES-FIREWALL
-A KUBE-SOURCE-RANGES-FIREWALL -j DROP
-A KUBE-IPVS-FILTER -m set --match-set KUBE-LOAD-BALANCER dst,dst -j RETURN
-A KUBE-IPVS-FILTER -m set --match-set KUBE-CLUSTER-IP dst,dst -j RETURN
-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst -j REJECT
COMMIT
"#;

/// ... and for IPv6 (ip6tables-nft).
const KUBE_IPVS_IPTABLES_V6: &str = r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES ! -s fd00:244::/56 -m comment --comment "Kubernetes service cluster ip + port for masquerade purpose" -m set --match-set KUBE-6-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m set --match-set KUBE-6-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
COMMIT
"#;

/// What this kernel lacks of the IPVS mode's kernel parts (IPVS, dummy links), if
/// anything, looked at in a namespace of its own.
fn missing_ipvs_kernel_parts() -> Option<String> {
    let probe = Netns::new(unique("kpc-probe-"));
    // IPVS is per namespace: load the module if there is one (allowed), then look.
    let _ = Command::new("modprobe").arg("ip_vs").output();
    let ipvs = ipvs_available(&probe);
    let dummy = dummy_available(&probe);
    let lacks: Vec<&str> = [
        (!ipvs).then_some("IPVS (CONFIG_IP_VS)"),
        (!dummy).then_some("dummy links (CONFIG_DUMMY)"),
    ]
    .into_iter()
    .flatten()
    .collect();
    (!lacks.is_empty()).then(|| format!("this kernel lacks {}", lacks.join(" and ")))
}

fn dummy_available(ns: &Netns) -> bool {
    let ok = ns_exec(
        ns,
        "ip",
        &["link", "add", "kpc-probe", "type", "dummy"],
        None,
    )
    .status
    .success();
    if ok {
        ns_run(ns, "ip", &["link", "del", "kpc-probe"], None);
    }
    ok
}

/// The IPVS mode's ipsets, iptables rules and `kube-ipvs0` address link go, everything
/// else stays. Runs on any kernel: without IPVS virtual services, and with `kube-ipvs0`
/// of another kind than dummy (left alone by design, checked); the virtual services and
/// the dummy link are the next test's.
#[test]
fn ipvs_mode_is_removed_and_other_services_sets_and_links_stay() {
    require_root();
    ipvs_mode_case(false);
}

/// The same with what needs the kernel's IPVS and dummy links: kube-proxy's virtual
/// services go, another program's stay, and the dummy `kube-ipvs0` goes. On a kernel
/// without them this test is reported SKIPPED (with the reason) and counted as skipped
/// by `cargo xtask test`, never as passed; `EBPF_PROXY_TEST_REQUIRE_IPVS=1` makes it fail.
#[test]
fn ipvs_mode_virtual_services_and_the_dummy_link_are_removed() {
    require_root();
    if let Some(missing) = missing_ipvs_kernel_parts() {
        assert!(!require_full_kernel(), "{missing}");
        support::skipped(
            "ipvs_mode_virtual_services_and_the_dummy_link_are_removed",
            &missing,
        );
        return;
    }
    ipvs_mode_case(true);
}

/// `full`: with IPVS virtual services and a dummy `kube-ipvs0` (the kernel has both).
fn ipvs_mode_case(full: bool) {
    let host = HostWitness::take();
    let test = Netns::new(unique("kpc-ipvs-"));
    let kernel_ipvs = ipvs_available(&test);
    let (ipvs, dummy) = (full, full);

    // Another program's state: a node address, a trusted-networks ipset and the
    // iptables rule using it, a kube-router-style KUBE-* set, an LVS service.
    ns_run(
        &test,
        "ip",
        &["link", "add", "uplink0", "type", "ifb"],
        None,
    );
    ns_run(
        &test,
        "ip",
        &["addr", "add", "192.0.2.5/24", "dev", "uplink0"],
        None,
    );
    ns_run(&test, "ip", &["link", "set", "uplink0", "up"], None);
    ns_run(
        &test,
        "ipset",
        &["create", "trusted-nets", "hash:net", "family", "inet"],
        None,
    );
    ns_run(
        &test,
        "ipset",
        &["add", "trusted-nets", "198.51.100.0/24"],
        None,
    );
    ns_run(
        &test,
        "ipset",
        &["create", "KUBE-DST-5ADHM5OHB27QSUOV", "hash:ip"],
        None,
    );
    ns_run(
        &test,
        "ipset",
        &["add", "KUBE-DST-5ADHM5OHB27QSUOV", "10.244.1.2"],
        None,
    );
    restore(
        &test,
        "iptables-legacy",
        "*filter\n-A INPUT -m set --match-set trusted-nets src -m comment --comment \"site: trusted\" -j ACCEPT\nCOMMIT\n\
         *nat\n-A POSTROUTING -o uplink0 -m comment --comment \"site: masquerade\" -j MASQUERADE\nCOMMIT\n",
    );
    // iptables-nft creates a built-in chain with the first rule that needs it, and the
    // cleanup leaves built-in chains in place (empty, they are no-ops): the other program
    // here uses the same built-in chains as kube-proxy so that "as before" is exact.
    restore(
        &test,
        "ip6tables-nft",
        "*nat\n-A POSTROUTING -o uplink0 -m comment --comment \"site: masquerade\" -j MASQUERADE\n\
         -A PREROUTING -p tcp -m tcp --dport 8080 -m comment --comment \"site: redirect\" -j REDIRECT --to-ports 80\n\
         -A OUTPUT -p tcp -m tcp --dport 8080 -m comment --comment \"site: redirect\" -j REDIRECT --to-ports 80\nCOMMIT\n",
    );
    if ipvs {
        for args in [
            &["-A", "-t", "192.0.2.80:80", "-s", "wlc"][..],
            &["-a", "-t", "192.0.2.80:80", "-r", "192.0.2.81:80", "-m"],
            // On a node address but not a NodePort kube-proxy knows.
            &["-A", "-t", "192.0.2.5:8443", "-s", "rr"],
        ] {
            ns_run(&test, "ipvsadm", args, None);
        }
    }
    let before = State::of(&test);

    // kube-proxy's IPVS mode.
    for (name, create, entries) in KUBE_IPSETS {
        let mut args = vec!["create", *name];
        args.extend(create.split_whitespace());
        ns_run(&test, "ipset", &args, None);
        for entry in *entries {
            ns_run(&test, "ipset", &["add", name, entry], None);
        }
    }
    restore(&test, "iptables-legacy", KUBE_IPVS_IPTABLES_V4);
    restore(&test, "ip6tables-nft", KUBE_IPVS_IPTABLES_V6);
    let kind = if dummy { "dummy" } else { "ifb" };
    ns_run(
        &test,
        "ip",
        &["link", "add", "kube-ipvs0", "type", kind],
        None,
    );
    for addr in ["10.96.0.10/32", "10.96.0.20/32"] {
        ns_run(
            &test,
            "ip",
            &["addr", "add", addr, "dev", "kube-ipvs0"],
            None,
        );
    }
    ns_run(
        &test,
        "ip",
        &[
            "-6",
            "addr",
            "add",
            "fd00:96::a/128",
            "dev",
            "kube-ipvs0",
            "nodad",
        ],
        None,
    );
    if ipvs {
        for args in [
            &["-A", "-u", "10.96.0.10:53", "-s", "rr"][..],
            &["-a", "-u", "10.96.0.10:53", "-r", "10.244.1.2:53", "-m"],
            &["-A", "-t", "10.96.0.20:80", "-s", "rr"],
            &["-A", "-u", "[fd00:96::a]:53", "-s", "rr"],
            // NodePort on the node address.
            &["-A", "-t", "192.0.2.5:30080", "-s", "rr"],
        ] {
            ns_run(&test, "ipvsadm", args, None);
        }
    }
    let loaded = State::of(&test);
    assert_ne!(loaded, before);
    assert!(
        loaded.ipsets.contains("create KUBE-CLUSTER-IP"),
        "{}",
        loaded.ipsets
    );
    // ipsets (and IPVS) belong to the namespace: the host sees none of them.
    assert_eq!(
        HostWitness::take(),
        host,
        "the host's ipsets or ruleset changed"
    );

    let dry = cleanup(&test, true);
    assert_eq!(State::of(&test), loaded, "--dry-run changed something");
    for (name, _, _) in KUBE_IPSETS {
        assert!(
            dry.contains(&format!("would remove: ipset: {name}\n")),
            "{name}:\n{dry}"
        );
    }
    assert!(
        dry.contains("note: ipset KUBE-DST-5ADHM5OHB27QSUOV: not one of kube-proxy's sets, left"),
        "{dry}"
    );
    assert!(!dry.contains("trusted-nets"), "{dry}");
    for chain in [
        "KUBE-IPVS-FILTER",
        "KUBE-SOURCE-RANGES-FIREWALL",
        "KUBE-LOAD-BALANCER",
    ] {
        assert!(dry.contains(&format!("chain {chain} (")), "{chain}:\n{dry}");
    }
    assert!(
        dry.contains("would remove: ip6tables-nft nat: chain KUBE-SERVICES (2 rule(s))"),
        "{dry}"
    );
    if dummy {
        assert!(
            dry.contains("would remove: link: kube-ipvs0 (dummy, 3 address(es))"),
            "{dry}"
        );
    } else {
        assert!(
            dry.contains("kept: link: kube-ipvs0 is of kind ifb, not the dummy kube-proxy creates"),
            "{dry}"
        );
    }
    if ipvs {
        for vs in [
            "UDP 10.96.0.10:53 (address on kube-ipvs0)",
            "TCP 10.96.0.20:80 (address on kube-ipvs0)",
            "UDP [fd00:96::a]:53 (address on kube-ipvs0)",
            "TCP 192.0.2.5:30080 (NodePort on a node address, port in ipset KUBE-NODE-PORT-TCP)",
        ] {
            assert!(
                dry.contains(&format!("would remove: ipvs: virtual service {vs}")),
                "{vs}:\n{dry}"
            );
        }
        assert!(
            dry.contains("ipvs: 2 virtual service(s) not kube-proxy's left as they are"),
            "{dry}"
        );
    } else if !kernel_ipvs {
        assert!(dry.contains("note: ipvs: IPVS is not loaded"), "{dry}");
    }

    let real = cleanup(&test, false);
    assert_eq!(dry.replace("would remove", "removed"), real);
    assert!(!real.contains("error:"), "{real}");
    if !dummy {
        // Left alone by design; remove it by hand to compare the rest.
        ns_run(&test, "ip", &["link", "del", "kube-ipvs0"], None);
    }
    assert_eq!(
        State::of(&test),
        before,
        "differs from the state before kube-proxy"
    );

    let again = cleanup(&test, false);
    assert!(again.contains("nothing of kube-proxy's found"), "{again}");
    assert_eq!(State::of(&test), before);
    assert_eq!(
        HostWitness::take(),
        host,
        "the host's ipsets or ruleset changed"
    );
}

// ---------------------------------------------------------------------------------------
// proxy-agent run --cleanup-kube-proxy

/// An empty child cgroup for the agent's hooks (no process in it), removed on drop.
struct EmptyCgroup {
    path: PathBuf,
}

impl EmptyCgroup {
    fn new() -> Self {
        let path = cgroup2_mount().join(unique("ebpf-proxy-test-kpc-"));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Self { path }
    }
}

impl Drop for EmptyCgroup {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.path);
    }
}

/// `proxy-agent run` inside a namespace, SIGTERMed on drop.
struct Agent {
    child: std::process::Child,
    log: PathBuf,
}

impl Agent {
    fn start(ns: &Netns, manifests: &Path, pins: &Path, cgroup: &Path, cleanup: bool) -> Self {
        let log = std::env::temp_dir().join(unique("kpc-agent-log-"));
        let file = fs::File::create(&log).expect("agent log file");
        let child = Command::new("nsenter")
            .arg(format!("--net={}", ns.path().display()))
            .arg(AGENT)
            .arg("run")
            .args(["--manifests", manifests.to_str().expect("utf-8")])
            .args(["--pin-path", pins.to_str().expect("utf-8")])
            .args(["--cgroup", cgroup.to_str().expect("utf-8")])
            .args(["--node-name", "node-a"])
            .args(["--healthz-addr", "127.0.0.1:10256"])
            .args(["--metrics-addr", "127.0.0.1:10249"])
            .args(["--min-sync-interval", "10ms", "--manifests-poll", "20ms"])
            .arg(format!("--cleanup-kube-proxy={cleanup}"))
            .args(["--interfaces", "none"])
            .env("RUST_LOG", "info")
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .spawn()
            .expect("start proxy-agent");
        Self { child, log }
    }

    fn logs(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `/healthz` in `ns` answers 200.
    fn wait_healthy(&mut self, ns: &Netns) {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("proxy-agent exited with {status}:\n{}", self.logs());
            }
            let healthy = {
                let _inside = ns.enter();
                matches!(http_get(10256, "/healthz"), Ok((200, _)))
            };
            if healthy {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("proxy-agent not healthy after 30 s:\n{}", self.logs());
    }

    fn wait_for_log(&mut self, needle: &str) {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            if self.logs().contains(needle) {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("proxy-agent exited with {status}:\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "no `{needle}` in the agent's log after 30 s:\n{}",
            self.logs()
        );
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling our own child by pid (nsenter execs the agent).
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let start = Instant::now();
            while self.child.try_wait().ok().flatten().is_none() {
                if start.elapsed() > Duration::from_secs(5) {
                    let _ = self.child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- proxy-agent log ---\n{}", self.logs());
        }
        let _ = fs::remove_file(&self.log);
    }
}

#[test]
fn agent_run_removes_kube_proxy_after_its_first_sync_unless_told_not_to() {
    require_root();
    let host = HostWitness::take();
    let manifests = std::env::temp_dir().join(unique("kpc-manifests-"));
    fs::create_dir(&manifests).expect("manifests dir");
    fs::write(
        manifests.join("web.yaml"),
        support::manifests::service("web", "10.96.0.20", 80)
            + "---\n"
            + &support::manifests::slice(
                "web-1",
                "web",
                8080,
                &[support::manifests::ready("10.244.1.3")],
            ),
    )
    .expect("write manifests");
    let reference = Netns::new(unique("kpc-agent-ref-"));
    restore(
        &reference,
        "iptables-nft",
        &family(OTHER_IPTABLES_BEFORE, false),
    );
    let expected = State::of(&reference);

    for enabled in [true, false] {
        let test = Netns::new(unique("kpc-agent-"));
        restore(&test, "iptables-nft", &family(OTHER_IPTABLES_BEFORE, false));
        restore(&test, "iptables-nft", &family(KUBE_IPTABLES, false));
        ns_run(&test, "nft", &["-f", "-"], Some(&family(KUBE_NFT, false)));
        let loaded = State::of(&test);

        let cgroup = EmptyCgroup::new();
        let pins = PinDir::new();
        let mut agent = Agent::start(&test, &manifests, &pins.path, &cgroup.path, enabled);
        agent.wait_healthy(&test);
        if enabled {
            agent.wait_for_log("kube-proxy cleanup finished");
            let logs = agent.logs();
            assert!(logs.contains("removed kube-proxy leftover"), "{logs}");
            assert!(!logs.contains("kube-proxy cleanup step failed"), "{logs}");
            assert_eq!(
                State::of(&test),
                expected,
                "the agent left kube-proxy's rules"
            );
        } else {
            std::thread::sleep(Duration::from_secs(1));
            let logs = agent.logs();
            assert!(!logs.contains("kube-proxy cleanup"), "{logs}");
            assert_eq!(State::of(&test), loaded, "cleanup ran although turned off");
        }
        drop(agent);
    }
    let _ = fs::remove_dir_all(&manifests);
    assert_eq!(HostWitness::take(), host, "the host's tables changed");
}
