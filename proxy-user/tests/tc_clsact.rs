//! TC attach mode `clsact` (netlink filters in a clsact qdisc, the fallback to TCX on
//! kernels < 6.6), forced on this kernel: `proxy-agent install --tc-attach clsact` inside a
//! test-made namespace with veth pairs attaches exactly one filter of ours per hook, a
//! second install adopts it, a lost record is re-attached in place, uninstall deletes the
//! filters (also when an interface has vanished) and removes the pin directory, and
//! nobody else's filter is touched. Needs root. The traffic through clsact-attached
//! programs is in `tc_datapath.rs`.

mod support;

use std::{
    process::Command,
    time::{Duration, Instant},
};

use support::{
    tc::{
        bpf_filters, clsact_pin, our_one_filter, pinned_program_id, program_loaded, tc_filters,
        tcx_programs, UninstallIn,
    },
    unique, Netns, TestEnv,
};

/// `proxy-agent ARGS... --pin-path P [--cgroup C]` inside `ns`; its stdout.
fn agent_cmd(env: &TestEnv, ns: &Netns, args: &[&str]) -> String {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", ns.path().display()))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_proxy-agent"))
        .args(args)
        .args(["--pin-path", env.pins.path.to_str().expect("utf-8")]);
    if args[0] == "install" {
        cmd.args(["--cgroup", env.cgroup.path.to_str().expect("utf-8")]);
    }
    let out = cmd.output().expect("run proxy-agent");
    assert!(
        out.status.success(),
        "proxy-agent {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn install(env: &TestEnv, ns: &Netns, mode: &str) -> String {
    agent_cmd(
        env,
        ns,
        &["install", "--interfaces", "ca0,cb0", "--tc-attach", mode],
    )
}

/// Our filter on each (interface, direction), asserting there is exactly one bpf filter
/// there, ours, that no program is attached with TCX, and that the pinned record names the
/// program the filter runs.
fn our_filters(env: &TestEnv, ns: &Netns, ifaces: &[&str]) -> Vec<u32> {
    let mut ids = Vec::new();
    for iface in ifaces {
        for ingress in [true, false] {
            let id = our_one_filter(ns, iface, ingress);
            assert_eq!(
                tcx_programs(ns, iface, ingress),
                Vec::<u32>::new(),
                "{iface}: mode clsact attaches nothing with TCX"
            );
            assert_eq!(
                pinned_program_id(&clsact_pin(&env.pins.path, iface, ingress)),
                id,
                "{iface} ingress={ingress}: the pinned record is the filter's program"
            );
            ids.push(id);
        }
    }
    ids
}

/// The foreign u32 filters on ca0 (both directions) are untouched.
fn foreign_filters_intact(ns: &Netns) {
    for ingress in [true, false] {
        let f = tc_filters(ns, "ca0", ingress);
        assert!(
            f.iter().any(|f| f.kind == "u32" && f.pref == 49152),
            "ca0 ingress={ingress}: someone else's filter must stay: {f:#?}"
        );
    }
}

#[test]
fn clsact_attach_adopt_reattach_and_uninstall() {
    let env = TestEnv::outside_cgroup();
    let ns = Netns::new(unique("ebp-cls-"));
    let _cleanup = UninstallIn::new(&ns, &env.pins.path);
    for (a, b) in [("ca0", "ca1"), ("cb0", "cb1")] {
        ns.ip(&["link", "add", a, "type", "veth", "peer", "name", b]);
        ns.ip(&["link", "set", a, "up"]);
        ns.ip(&["link", "set", b, "up"]);
    }
    // ca0 already has a clsact qdisc with someone else's filters (a lower priority than
    // ours); cb0 has no qdisc (install adds it).
    let tc = |args: &[&str]| {
        let mut all = vec!["-n", ns.name.as_str()];
        all.extend_from_slice(args);
        support::run("tc", &all);
    };
    tc(&["qdisc", "add", "dev", "ca0", "clsact"]);
    for dir in ["ingress", "egress"] {
        tc(&[
            "filter", "add", "dev", "ca0", dir, "pref", "49152", "protocol", "all", "u32", "match",
            "u32", "0", "0",
        ]);
    }

    // First install: 8 socket hooks and 4 clsact hooks, each recorded by a pinned program.
    let out = install(&env, &ns, "clsact");
    assert!(out.contains("attached 12 hook(s), adopted 0"), "{out}");
    let links = env.pins.path.join("links");
    for iface in ["ca0", "cb0"] {
        for dir in ["ingress", "egress"] {
            assert!(links.join(format!("tc-{iface}-{dir}-clsact")).exists());
            assert!(!links.join(format!("tc-{iface}-{dir}")).exists());
        }
    }
    let first = our_filters(&env, &ns, &["ca0", "cb0"]);
    assert_eq!(
        first[0], first[2],
        "one tc_ingress program for every interface"
    );
    foreign_filters_intact(&ns);

    // Second install (clsact, then auto, which means TCX on this kernel): everything is
    // adopted, nothing reloaded, no second filter, nothing attached with TCX.
    for mode in ["clsact", "auto"] {
        let out = install(&env, &ns, mode);
        assert!(
            out.contains("attached 0 hook(s), adopted 12"),
            "{mode}: {out}"
        );
        assert_eq!(our_filters(&env, &ns, &["ca0", "cb0"]), first, "{mode}");
    }

    // The record of one hook is lost while its filter stays: the next install attaches a
    // new program in place of our old filter (same priority/handle, still one filter).
    std::fs::remove_file(clsact_pin(&env.pins.path, "cb0", true)).expect("rm pin");
    let out = install(&env, &ns, "clsact");
    assert!(out.contains("attached 1 hook(s), adopted 11"), "{out}");
    let again = our_filters(&env, &ns, &["ca0", "cb0"]);
    assert_ne!(
        again[2], first[2],
        "cb0 ingress runs the newly loaded program"
    );
    assert_eq!(
        [again[0], again[1], again[3]],
        [first[0], first[1], first[3]]
    );
    foreign_filters_intact(&ns);

    // Uninstall, with cb0 gone meanwhile (its filters went with it): our filters on ca0
    // are deleted, the foreign ones stay, every pin and the pin directory are removed, and
    // the programs are unloaded.
    ns.ip(&["link", "del", "cb0"]);
    let out = agent_cmd(&env, &ns, &["uninstall"]);
    assert!(out.contains("removed 12 link(s)"), "{out}");
    assert!(!env.pins.path.exists(), "pin directory removed");
    for ingress in [true, false] {
        assert_eq!(
            bpf_filters(&ns, "ca0", ingress),
            Vec::new(),
            "no filter of ours left"
        );
    }
    foreign_filters_intact(&ns);
    let start = Instant::now();
    let mut ids = first.clone();
    ids.extend(again);
    while ids.iter().any(|id| program_loaded(*id)) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "TC programs still loaded after uninstall: {ids:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
