//! The manifests source over real files in a temporary directory.

use super::*;

fn write(dir: &Path, name: &str, text: &str) {
    fs::write(dir.join(name), text).expect("write");
    // Make sure the stamp changes even within the same mtime tick.
}

fn names(updates: &[Update]) -> Vec<String> {
    updates
        .iter()
        .map(|u| match u {
            Update::Snapshot { kind, objects, .. } => format!(
                "snapshot {} [{}]",
                kind.as_str(),
                objects
                    .iter()
                    .map(|o| o.key().to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
            Update::Apply(o) => format!("apply {} {}", o.kind().as_str(), o.key()),
            Update::Delete { kind, key } => format!("delete {} {key}", kind.as_str()),
            Update::Batch(us) => format!("batch [{}]", names(us).join(", ")),
        })
        .collect()
}

const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{name: http, port: 80}]\n";
const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.0.0.1]}]\n";

#[test]
fn first_scan_snapshots_then_diffs() {
    let tmp = tempdir();
    let metrics = SourceCounters::default();
    write(&tmp, "web.yaml", &format!("{SVC}---\n{SLICE}"));
    write(&tmp, "notes.txt", "not a manifest");
    let mut dir = ManifestsDir::new(&tmp, metrics.clone());
    assert_eq!(
        names(&dir.scan().expect("scan")),
        [
            "snapshot Service [default/web]",
            "snapshot EndpointSlice [default/web-1]",
            "snapshot Node []",
            "snapshot Pod []",
            "snapshot Namespace []"
        ]
    );
    assert!(dir.scan().expect("scan").is_empty(), "nothing changed");

    // Change the slice, add a second service in a new file as a List.
    write(
        &tmp,
        "web.yaml",
        &format!("{SVC}---\n{}", SLICE.replace("10.0.0.1", "10.0.0.2")),
    );
    write(
        &tmp,
        "more.json",
        r#"{"kind":"List","items":[{"apiVersion":"v1","kind":"Service","metadata":{"name":"dns","namespace":"kube-system"},"spec":{"clusterIP":"10.96.0.53","ports":[{"port":53,"protocol":"UDP"}]}}]}"#,
    );
    bump(&tmp.join("web.yaml"));
    let mut got = names(&dir.scan().expect("scan"));
    got.sort();
    assert_eq!(
        got,
        [
            "apply EndpointSlice default/web-1",
            "apply Service kube-system/dns"
        ]
    );

    // A broken file keeps its objects; fixing it later works.
    write(&tmp, "web.yaml", "kind: Service\nmetadata: [broken\n");
    bump(&tmp.join("web.yaml"));
    assert!(dir.scan().expect("scan").is_empty());
    assert_eq!(metrics.skipped_count("file", "parse_error"), 1);

    // Deleting the file deletes its objects.
    fs::remove_file(tmp.join("web.yaml")).expect("rm");
    let mut got = names(&dir.scan().expect("scan"));
    got.sort();
    assert_eq!(
        got,
        [
            "delete EndpointSlice default/web-1",
            "delete Service default/web"
        ]
    );
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn a_document_that_does_not_decode_is_skipped_alone() {
    let tmp = tempdir();
    let metrics = SourceCounters::default();
    let bad =
        "apiVersion: v1\nkind: Service\nmetadata: {name: bad}\nspec:\n  ports: [{port: eighty}]\n";
    write(&tmp, "mixed.yaml", &format!("{bad}---\n{SVC}"));
    let mut dir = ManifestsDir::new(&tmp, metrics.clone());
    let ups = names(&dir.scan().expect("scan"));
    assert_eq!(ups[0], "snapshot Service [default/web]");
    assert_eq!(metrics.skipped_count("Service", "decode_error"), 1);
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn a_definition_that_wins_again_is_read_back_from_its_file() {
    let tmp = tempdir();
    let metrics = SourceCounters::default();
    // b.yaml sorts after a.yaml, so its definition wins.
    write(&tmp, "a.yaml", SVC);
    write(&tmp, "b.yaml", &SVC.replace("10.96.0.10", "10.96.0.11"));
    let mut dir = ManifestsDir::new(&tmp, metrics);
    let first = dir.scan().expect("scan");
    let Update::Snapshot { objects, .. } = &first[0] else {
        panic!("snapshot first");
    };
    let ip = |o: &Object| match o {
        Object::ReducedService(r) => r.info.clone().ok().flatten().map(|s| s.cluster_ips[0]),
        _ => None,
    };
    assert_eq!(ip(&objects[0]), Some("10.96.0.11".parse().expect("ip")));
    // b.yaml goes: a.yaml's definition (not read again by mtime) is sent.
    fs::remove_file(tmp.join("b.yaml")).expect("rm");
    let ups = dir.scan().expect("scan");
    assert_eq!(names(&ups), ["apply Service default/web"]);
    let Update::Apply(obj) = &ups[0] else {
        panic!("apply");
    };
    assert_eq!(ip(obj), Some("10.96.0.10".parse().expect("ip")));
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn each_bad_file_is_reported_once_per_change() {
    let tmp = tempdir();
    let metrics = SourceCounters::default();
    write(&tmp, "good.yaml", SVC);
    fs::write(
        tmp.join("latin1.yaml"),
        b"kind: Service\nmetadata: {name: caf\xe9}\n",
    )
    .expect("write");
    std::os::unix::fs::symlink(tmp.join("missing.yaml"), tmp.join("dangling.yaml"))
        .expect("symlink");
    std::os::unix::fs::symlink(tmp.join("loop-b.yaml"), tmp.join("loop-a.yaml")).expect("symlink");
    std::os::unix::fs::symlink(tmp.join("loop-a.yaml"), tmp.join("loop-b.yaml")).expect("symlink");
    let mut dir = ManifestsDir::new(&tmp, metrics.clone());
    let first = names(&dir.scan().expect("scan"));
    assert_eq!(first[0], "snapshot Service [default/web]");
    for _ in 0..20 {
        assert!(dir.scan().expect("scan").is_empty());
    }
    assert_eq!(
        metrics.skipped_count("file", "read_error"),
        1,
        "invalid UTF-8"
    );
    assert_eq!(
        metrics.skipped_count("file", "broken_link"),
        3,
        "the dangling link and both links of the loop"
    );
    // A change of the bad file is reported again, once.
    fs::write(
        tmp.join("latin1.yaml"),
        b"kind: Service\nmetadata: {name: \xff}\n",
    )
    .expect("write");
    bump(&tmp.join("latin1.yaml"));
    for _ in 0..5 {
        assert!(dir.scan().expect("scan").is_empty());
    }
    assert_eq!(metrics.skipped_count("file", "read_error"), 2);
    // The dangling link's target appears: its objects are read.
    fs::write(
        tmp.join("target.txt"),
        SVC.replace("name: web", "name: linked")
            .replace("10.96.0.10", "10.96.0.12"),
    )
    .expect("write");
    fs::remove_file(tmp.join("dangling.yaml")).expect("rm");
    std::os::unix::fs::symlink(tmp.join("target.txt"), tmp.join("dangling.yaml")).expect("symlink");
    assert_eq!(
        names(&dir.scan().expect("scan")),
        ["apply Service default/linked"]
    );
    assert_eq!(metrics.skipped_count("file", "broken_link"), 3);
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn a_file_nested_too_deep_is_refused_before_parsing() {
    let tmp = tempdir();
    let metrics = SourceCounters::default();
    write(&tmp, "good.yaml", SVC);
    // 196 KiB nested 100,000 levels, as in the report.
    let deep = format!(
        "kind: Service\nspec: {}{}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    write(&tmp, "deep.yaml", &deep);
    let compact = format!("kind: Service\nspec:\n{}x\n", "- ".repeat(100_000));
    write(&tmp, "compact.yaml", &compact);
    let mut dir = ManifestsDir::new(&tmp, metrics.clone());
    let start = std::time::Instant::now();
    let first = names(&dir.scan().expect("scan"));
    let took = start.elapsed();
    assert_eq!(first[0], "snapshot Service [default/web]");
    assert_eq!(metrics.skipped_count("file", "too_deep"), 2);
    eprintln!("scan with the two deep files: {took:?}");
    // Refused before parsing: the scan stays short. Measured 39 ms (debug build) on the
    // 2-core machine while five other builds and tests ran; 2 s is 50 times that.
    assert!(took < Duration::from_secs(2), "{took:?}");
    // Brackets inside quotes and comments are text.
    let quoted = format!(
        "{SVC}metadata2: '{}' # {}\n",
        "[".repeat(200),
        "{".repeat(200)
    );
    assert_eq!(check_nesting(&quoted), Ok(()));
    assert!(check_nesting(&format!("a: {}", "[".repeat(MAX_NESTING + 1))).is_err());
    assert_eq!(
        check_nesting(&format!("a: {}", "[".repeat(MAX_NESTING))),
        Ok(())
    );
    fs::remove_dir_all(&tmp).expect("cleanup");
}

/// The table-driven nesting check gives the byte-by-byte rule's answer (refused or
/// not, and the line named) on texts made of the bytes that matter: quotes and escapes
/// (one at a line's end too), comments after blanks or not, compact sequences, CRLF, deep
/// brackets around the limit; and on real manifests.
#[test]
fn the_nesting_check_agrees_with_the_byte_by_byte_rule() {
    use super::parse::check_nesting_by_bytes;
    let alphabet: &[&str] = &[
        "[",
        "[",
        "[",
        "{",
        "]",
        "}",
        "\"",
        "'",
        "\\",
        "#",
        " ",
        "\t",
        "\n",
        "\r\n",
        "- ",
        "-",
        "a",
        "é",
        "[[[[[[[[",
        "]]]]]]]]",
        "- - - - - - - - ",
    ];
    // xorshift64*: the same texts every run.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut rand = |n: usize| {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    };
    let (mut refused, mut accepted) = (0, 0);
    for _ in 0..20_000 {
        // Most texts start near the limit, so that what follows decides.
        let mut text = "[".repeat(rand(MAX_NESTING + 8));
        let len = rand(120);
        text.extend((0..len).map(|_| alphabet[rand(alphabet.len())]));
        let want = check_nesting_by_bytes(&text);
        assert_eq!(check_nesting(&text), want, "{text:?}");
        match want {
            Ok(()) => accepted += 1,
            Err(_) => refused += 1,
        }
    }
    assert!(
        refused > 2_000 && accepted > 2_000,
        "{refused} / {accepted}"
    );
    for text in [
        SVC.to_string(),
        SLICE.to_string(),
        format!("a: \"x\\\n{}", "[".repeat(MAX_NESTING + 1)),
        format!("a: '{}'\n{}", "[".repeat(70), "{".repeat(MAX_NESTING)),
        format!("a: b#{}\n", "[".repeat(70)),
        format!("# {}\n- {}", "[".repeat(70), "[".repeat(MAX_NESTING)),
        format!("{}x", "- ".repeat(MAX_NESTING + 1)),
        String::new(),
        "\\".into(),
        "\"\\".into(),
    ] {
        assert_eq!(
            check_nesting(&text),
            check_nesting_by_bytes(&text),
            "{text:?}"
        );
    }
}

fn tempdir() -> PathBuf {
    let p = std::env::temp_dir().join(format!(
        "ebpf-proxy-manifests-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    fs::create_dir_all(&p).expect("mkdir");
    p
}

/// Moves the mtime forward so a rewrite within the same clock tick is seen.
fn bump(path: &Path) {
    let f = fs::File::options().append(true).open(path).expect("open");
    let later = SystemTime::now() + Duration::from_secs(5);
    f.set_modified(later).expect("set mtime");
}

/// The creation time of the Services in `updates`, by name (Unix seconds).
fn created(updates: &[Update]) -> Vec<(String, Option<i64>)> {
    let svc = |o: &Object| match o {
        Object::ReducedService(r) => Some((
            o.key().to_string(),
            r.info
                .as_ref()
                .ok()
                .and_then(Option::as_ref)
                .and_then(|s| s.creation_timestamp),
        )),
        _ => None,
    };
    updates
        .iter()
        .flat_map(|u| match u {
            Update::Snapshot { objects, .. } => objects.iter().filter_map(svc).collect(),
            Update::Apply(o) => svc(o).into_iter().collect(),
            Update::Delete { .. } => Vec::new(),
            Update::Batch(us) => created(us),
        })
        .collect()
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[test]
fn a_service_without_creation_time_gets_the_time_it_was_first_read() {
    let tmp = tempdir();
    let stamped = "apiVersion: v1\nkind: Service\nmetadata: {name: old, creationTimestamp: \"2026-01-01T00:00:00Z\"}\nspec:\n  clusterIP: 10.96.0.11\n  ports: [{port: 80}]\n";
    write(&tmp, "web.yaml", &format!("{SVC}---\n{stamped}"));
    let mut dir = ManifestsDir::new(&tmp, SourceCounters::default());
    let before = unix_now();
    let got = created(&dir.scan().expect("scan"));
    let after = unix_now();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].0, "default/old");
    assert_eq!(got[0].1, Some(1_767_225_600), "its own time is kept");
    assert_eq!(got[1].0, "default/web");
    let t = got[1].1.expect("web is stamped");
    assert!((before..=after).contains(&t), "{before} <= {t} <= {after}");

    // A change of web keeps the time it was first read (made distinct here, as the
    // scans run within one second).
    let first = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
    dir.first_read.insert(ObjKey::new("default", "web"), first);
    write(
        &tmp,
        "web.yaml",
        &format!("{}---\n{stamped}", SVC.replace("port: 80", "port: 81")),
    );
    bump(&tmp.join("web.yaml"));
    assert_eq!(
        created(&dir.scan().expect("scan")),
        [("default/web".to_string(), Some(1_000))]
    );

    // Gone, then back: a new Service, read now.
    write(&tmp, "web.yaml", stamped);
    bump(&tmp.join("web.yaml"));
    dir.scan().expect("scan");
    assert!(dir.first_read.is_empty(), "{:?}", dir.first_read);
    write(&tmp, "web.yaml", SVC);
    let later = tmp.join("web.yaml");
    bump(&later);
    let f = fs::File::options().append(true).open(&later).expect("open");
    f.set_modified(SystemTime::now() + Duration::from_secs(10))
        .expect("mtime");
    let got = created(&dir.scan().expect("scan"));
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].1.is_some_and(|t| t >= before), "{got:?}");
    fs::remove_dir_all(&tmp).ok();
}

/// Every object of the first scan's snapshots, as the syncer gets them: reduced.
fn reduced(updates: &[Update]) -> Vec<String> {
    updates
        .iter()
        .flat_map(|u| match u {
            Update::Snapshot { objects, .. } => objects.iter().collect::<Vec<_>>(),
            _ => Vec::new(),
        })
        .map(|o| match o {
            Object::ReducedService(r) => format!("{} {:?}", r.key, r.info),
            Object::ReducedSlice(r) => format!("{} {:?}", r.key, r.info),
            other => format!("not reduced: {other:?}"),
        })
        .collect()
}

#[test]
fn json_and_yaml_give_the_same_reduced_objects() {
    // The same List (a Service without namespace, its slice) as YAML and as JSON: the
    // JSON is read in place, the YAML as a tree; both reduce to the same objects, in the
    // namespace `default`.
    let json = r#"{"apiVersion":"v1","kind":"List","items":[
        {"apiVersion":"v1","kind":"Service","metadata":{"name":"web","creationTimestamp":"2026-01-01T00:00:00Z"},
         "spec":{"clusterIP":"10.96.0.10","ports":[{"name":"http","port":80}]}},
        {"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
         "metadata":{"name":"web-1","labels":{"kubernetes.io/service-name":"web"}},
         "addressType":"IPv4","ports":[{"name":"http","port":8080}],
         "endpoints":[{"addresses":["10.0.0.1"],"conditions":{"ready":true}}]}]}"#;
    let value: serde_json::Value = serde_json::from_str(json).expect("json");
    let yaml = serde_yaml::to_string(&value).expect("yaml");
    let mut got = Vec::new();
    for (name, text) in [("a.json", json), ("a.yaml", yaml.as_str())] {
        let tmp = tempdir();
        write(&tmp, name, text);
        let mut dir = ManifestsDir::new(&tmp, SourceCounters::default());
        got.push(reduced(&dir.scan().expect("scan")));
        fs::remove_dir_all(&tmp).expect("cleanup");
    }
    assert_eq!(got[0].len(), 2, "{:?}", got[0]);
    assert!(
        got[0][0].starts_with("default/web Ok(Some("),
        "{:?}",
        got[0]
    );
    assert!(
        got[0][1].starts_with("default/web-1 Ok(Some("),
        "{:?}",
        got[0]
    );
    assert_eq!(got[0], got[1]);
}

#[test]
fn a_bad_item_of_a_json_list_is_named_and_skipped_alone() {
    let tmp = tempdir();
    let metrics = SourceCounters::default();
    // Item 2 does not decode (a port that is not a number), item 3 has no name, item 4 is
    // of another kind, item 5 is not an object: the others are read.
    let items = [
        r#"{"kind":"Service","metadata":{"name":"a","namespace":"ns"},"spec":{"clusterIP":"10.96.0.1","ports":[{"port":80}]}}"#,
        r#"{"kind":"Service","metadata":{"name":"bad","namespace":"ns"},"spec":{"ports":[{"port":"eighty"}]}}"#,
        r#"{"kind":"Service","metadata":{"namespace":"ns"},"spec":{"ports":[{"port":80}]}}"#,
        r#"{"kind":"ConfigMap","metadata":{"name":"c"}}"#,
        r#"42"#,
        r#"{"kind":"ServiceList","items":[{"kind":"Service","metadata":{"name":"d"},"spec":{"clusterIP":"10.96.0.4","ports":[{"port":80}]}}]}"#,
    ];
    write(
        &tmp,
        "l.json",
        &format!(r#"{{"kind":"List","items":[{}]}}"#, items.join(",")),
    );
    let mut dir = ManifestsDir::new(&tmp, metrics.clone());
    let ups = names(&dir.scan().expect("scan"));
    assert_eq!(ups[0], "snapshot Service [default/d ns/a]");
    assert_eq!(metrics.skipped_count("Service", "decode_error"), 1);
    assert_eq!(metrics.skipped_count("Service", "no_name"), 1);

    // Broken JSON (cut short, as a half-written file) is a parse error of the file, which
    // keeps its objects.
    let text = fs::read_to_string(tmp.join("l.json")).expect("read");
    write(&tmp, "l.json", &text[..text.len() / 2]);
    bump(&tmp.join("l.json"));
    assert!(dir.scan().expect("scan").is_empty());
    assert_eq!(metrics.skipped_count("file", "parse_error"), 1);
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn json_documents_one_after_another_and_yaml_in_a_json_file_are_read() {
    let tmp = tempdir();
    let svc = |name: &str, ip: &str| {
        format!(
            r#"{{"kind":"Service","metadata":{{"name":"{name}"}},"spec":{{"clusterIP":"{ip}","ports":[{{"port":80}}]}}}}"#
        )
    };
    write(
        &tmp,
        "two.json",
        &format!("{}\n{}\n", svc("a", "10.96.0.1"), svc("b", "10.96.0.2")),
    );
    // Not JSON throughout (a YAML document marker): read as YAML, as before.
    write(
        &tmp,
        "yaml.json",
        &format!(
            "{}\n---\n{}\n",
            svc("c", "10.96.0.3"),
            svc("d", "10.96.0.4")
        ),
    );
    let mut dir = ManifestsDir::new(&tmp, SourceCounters::default());
    let ups = names(&dir.scan().expect("scan"));
    assert_eq!(
        ups[0],
        "snapshot Service [default/a default/b default/c default/d]"
    );
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn services_are_reduced_for_the_agents_proxy_name() {
    // kube-proxy's rule: without --service-proxy-name a Service labelled with a proxy
    // name is not served; with it, only those labelled with that name are.
    let tmp = tempdir();
    let labelled = r#"{"kind":"Service","metadata":{"name":"mine","labels":{"service.kubernetes.io/service-proxy-name":"ebpf"}},"spec":{"clusterIP":"10.96.0.1","ports":[{"port":80}]}}"#;
    let plain = r#"{"kind":"Service","metadata":{"name":"plain"},"spec":{"clusterIP":"10.96.0.2","ports":[{"port":80}]}}"#;
    write(&tmp, "s.json", &format!("{labelled}\n{plain}"));
    let served = |proxy_name: Option<&str>| {
        let mut dir = ManifestsDir::new(&tmp, SourceCounters::default())
            .with_proxy_name(proxy_name.map(str::to_string));
        reduced(&dir.scan().expect("scan"))
            .into_iter()
            .filter(|r| r.contains("Ok(Some("))
            .map(|r| r.split(' ').next().unwrap_or_default().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(served(None), ["default/plain"]);
    assert_eq!(served(Some("ebpf")), ["default/mine"]);
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn a_long_list_is_read_whole_and_in_order() {
    // 6,000 items: every Service is there; the object defined twice in the file is its
    // last definition; a bad item is counted and the items after it are read.
    let tmp = tempdir();
    let metrics = SourceCounters::default();
    let svc = |name: &str, ip: &str, port: &str| {
        format!(
            r#"{{"kind":"Service","metadata":{{"name":"{name}"}},"spec":{{"clusterIP":"{ip}","ports":[{{"port":{port}}}]}}}}"#
        )
    };
    let mut items: Vec<String> = (0..6_000)
        .map(|i| {
            svc(
                &format!("s{i}"),
                &format!("10.96.{}.{}", i / 250, i % 250 + 1),
                "80",
            )
        })
        .collect();
    items[0] = svc("twice", "10.97.0.1", "80");
    items[5_999] = svc("twice", "10.97.0.2", "80");
    items[5_000] = svc("bad", "10.97.0.3", r#""eighty""#);
    write(
        &tmp,
        "l.json",
        &format!(r#"{{"kind":"List","items":[{}]}}"#, items.join(",\n")),
    );
    let mut dir = ManifestsDir::new(&tmp, metrics.clone());
    let ups = dir.scan().expect("scan");
    let Update::Snapshot { objects, .. } = &ups[0] else {
        panic!("snapshot first");
    };
    assert_eq!(
        objects.len(),
        5_998,
        "s1..s5998 but s5000 (5,997), and twice"
    );
    let twice = objects
        .iter()
        .find(|o| o.key().name.as_ref() == "twice")
        .expect("twice");
    let Object::ReducedService(r) = twice else {
        panic!("reduced");
    };
    let ip = r.info.clone().ok().flatten().map(|s| s.cluster_ips[0]);
    assert_eq!(ip, Some("10.97.0.2".parse().expect("ip")));
    assert_eq!(metrics.skipped_count("Service", "decode_error"), 1);
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn yaml_lists_and_documents_that_are_not_objects() {
    // A YAML List whose items come before its kind, a List of another kind's items, a
    // document that is a sequence, one that is a scalar, an empty one: only the List's
    // objects are read, and a Service with an `items` field is still a Service.
    let tmp = tempdir();
    let text = "apiVersion: v1\nitems:\n- kind: Service\n  metadata: {name: a}\n  spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n- {kind: Service, metadata: {name: b, namespace: ns}, spec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}}\nkind: List\n---\nkind: ConfigMapList\nitems: [{kind: Service, metadata: {name: c}}]\n---\n- kind: Service\n---\njust text\n---\n---\nkind: Service\nmetadata: {name: d}\nitems: 3\nspec: {clusterIP: 10.96.0.4, ports: [{port: 80}]}\n";
    write(&tmp, "l.yaml", text);
    let mut dir = ManifestsDir::new(&tmp, SourceCounters::default());
    let ups = names(&dir.scan().expect("scan"));
    assert_eq!(ups[0], "snapshot Service [default/a default/d ns/b]");
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn the_changes_of_one_read_arrive_as_one_update() {
    // The directory's thread sends what one scan found as one batch: the agent takes a
    // file's Services and slices in together, with no sync of half of them.
    let tmp = tempdir();
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let dir = ManifestsDir::new(&tmp, SourceCounters::default());
    let thread = spawn(dir, Duration::from_millis(10), tx).expect("spawn");
    let first = rx.blocking_recv().expect("the first read");
    assert_eq!(
        names(&[first]),
        ["batch [snapshot Service [], snapshot EndpointSlice [], snapshot Node [], snapshot Pod [], snapshot Namespace []]"]
    );
    fs::write(tmp.join("a.tmp"), format!("{SVC}---\n{SLICE}")).expect("write");
    fs::rename(tmp.join("a.tmp"), tmp.join("a.yaml")).expect("rename");
    let next = rx.blocking_recv().expect("the change");
    assert_eq!(
        names(&[next]),
        ["batch [apply Service default/web, apply EndpointSlice default/web-1]"]
    );
    drop(rx);
    thread.join().expect("the thread ends with the receiver");
    fs::remove_dir_all(&tmp).expect("cleanup");
}

/// The next update, or `None` once `within` has passed.
fn recv_within(rx: &mut tokio::sync::mpsc::Receiver<Update>, within: Duration) -> Option<Update> {
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        match rx.try_recv() {
            Ok(u) => return Some(u),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("the manifests thread ended: {e}"),
        }
    }
    None
}

#[test]
fn a_file_written_renamed_or_deleted_is_read_at_once_not_at_the_next_poll() {
    // A poll of an hour: every change below can only arrive through the directory's
    // inotify watch, within a bound far under the poll (and loose under CI's load).
    let tmp = tempdir();
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let dir = ManifestsDir::new(&tmp, SourceCounters::default());
    let thread = spawn(dir, Duration::from_secs(3600), tx).expect("spawn");
    let within = Duration::from_secs(10);
    recv_within(&mut rx, within).expect("the first read");
    // Written in place: read once it is closed.
    fs::write(tmp.join("a.yaml"), SVC).expect("write");
    let u = recv_within(&mut rx, within).expect("a file written in place is read at once");
    assert_eq!(names(&[u]), ["apply Service default/web"]);
    // Renamed in (an atomic replace).
    fs::write(tmp.join("b.tmp"), SLICE).expect("write");
    fs::rename(tmp.join("b.tmp"), tmp.join("b.yaml")).expect("rename");
    let u = recv_within(&mut rx, within).expect("a file renamed in is read at once");
    assert_eq!(names(&[u]), ["apply EndpointSlice default/web-1"]);
    // Deleted.
    fs::remove_file(tmp.join("a.yaml")).expect("remove");
    let u = recv_within(&mut rx, within).expect("a file deleted is seen at once");
    assert_eq!(names(&[u]), ["delete Service default/web"]);
    drop(rx);
    // The thread ends at its next wake-up; make one.
    fs::write(tmp.join("c.yaml"), "").expect("write");
    thread.join().expect("the thread ends with the receiver");
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn a_directory_removed_and_made_again_is_watched_again() {
    let tmp = tempdir();
    let mut w = watch::DirWatch::new(&tmp);
    assert!(w.is_watching(), "inotify watch of {}", tmp.display());
    fs::remove_dir_all(&tmp).expect("remove");
    assert!(
        w.wait(&tmp, Duration::from_secs(10)),
        "the removal wakes the wait"
    );
    assert!(!w.is_watching(), "the watch went with the directory");
    fs::create_dir(&tmp).expect("make again");
    // The next wait makes the watch again; a file written then wakes it.
    assert!(!w.wait(&tmp, Duration::from_millis(1)));
    assert!(w.is_watching());
    fs::write(tmp.join("a.yaml"), SVC).expect("write");
    assert!(
        w.wait(&tmp, Duration::from_secs(10)),
        "a file written in the new directory"
    );
    fs::remove_dir_all(&tmp).expect("cleanup");
}

#[test]
fn a_configmap_volumes_data_swap_is_read_at_once() {
    // kubelet's atomic writer: the files are symlinks through `..data`, itself a symlink
    // to a timestamped directory; an update writes a new directory and renames a new
    // `..data` link over the old one (`IN_MOVED_TO` on the watched directory).
    use std::os::unix::fs::symlink;
    let tmp = tempdir();
    fs::create_dir(tmp.join("..2026_12_05_1")).expect("dir");
    fs::write(tmp.join("..2026_12_05_1/web.yaml"), SVC).expect("write");
    symlink("..2026_12_05_1", tmp.join("..data")).expect("..data");
    symlink("..data/web.yaml", tmp.join("web.yaml")).expect("web.yaml");
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let dir = ManifestsDir::new(&tmp, SourceCounters::default());
    let thread = spawn(dir, Duration::from_secs(3600), tx).expect("spawn");
    let within = Duration::from_secs(10);
    let first = recv_within(&mut rx, within).expect("the first read");
    assert!(names(&[first])[0].contains("snapshot Service [default/web]"));
    fs::create_dir(tmp.join("..2026_12_05_2")).expect("dir");
    fs::write(
        tmp.join("..2026_12_05_2/web.yaml"),
        SVC.replace("10.96.0.10", "10.96.0.11"),
    )
    .expect("write");
    symlink("..2026_12_05_2", tmp.join("..data_tmp")).expect("..data_tmp");
    fs::rename(tmp.join("..data_tmp"), tmp.join("..data")).expect("swap ..data");
    let u = recv_within(&mut rx, within).expect("the swap is read at once");
    assert_eq!(names(&[u]), ["apply Service default/web"]);
    drop(rx);
    fs::write(tmp.join("wake.yaml"), "").expect("write");
    thread.join().expect("the thread ends with the receiver");
    fs::remove_dir_all(&tmp).expect("cleanup");
}
