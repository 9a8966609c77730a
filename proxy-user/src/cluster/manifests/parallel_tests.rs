//! Objects decoded on several threads give exactly what one thread gives: the same
//! objects in the same order, the same files refused, the same skipped objects named in
//! the same order.

use std::{
    fs,
    path::{Path, PathBuf},
};

use super::parse::{parse_files, Decoding, Found};
use super::{ManifestsDir, SourceCounters, Update};

/// A Service as JSON; `port` is raw JSON (a string there does not decode). With its
/// creation time (one without is stamped with the time it is read).
fn svc(name: &str, i: usize, port: &str) -> String {
    format!(
        r#"{{"kind":"Service","metadata":{{"name":"{name}","namespace":"ns{}","creationTimestamp":"2026-01-01T00:00:00Z"}},"spec":{{"clusterIP":"10.96.{}.{}","ports":[{{"port":{port}}}]}}}}"#,
        i % 3,
        i / 250,
        i % 250 + 1
    )
}

fn slice(name: &str, i: usize) -> String {
    format!(
        r#"{{"kind":"EndpointSlice","metadata":{{"name":"{name}-x","namespace":"ns{}","labels":{{"kubernetes.io/service-name":"{name}"}}}},"addressType":"IPv4","ports":[{{"port":80}}],"endpoints":[{{"addresses":["10.1.{}.{}"]}}]}}"#,
        i % 3,
        i / 250,
        i % 250 + 1
    )
}

/// Files of every form: one large JSON List (its items split over the threads), small
/// JSON Lists, JSON documents one after another, YAML with several documents and a YAML
/// List; bad items (not decoding, without a name) spread over them, and a file that
/// parses as neither JSON nor YAML.
fn files() -> Vec<(String, String)> {
    let mut files = Vec::new();
    let big: Vec<String> = (0..8_000)
        .flat_map(|i| {
            let name = format!("big{i}");
            let s = match i % 997 {
                5 => svc(&name, i, r#""eighty""#),
                6 => svc("", i, "80"),
                _ => svc(&name, i, "80"),
            };
            [s, slice(&name, i)]
        })
        .collect();
    files.push((
        "a-big.json".to_string(),
        format!(r#"{{"kind":"List","items":[{}]}}"#, big.join(",\n")),
    ));
    for f in 0..30 {
        let items: Vec<String> = (0..40)
            .map(|j| {
                let (i, name) = (f * 40 + j, format!("s{f}-{j}"));
                if j == 7 {
                    svc(&name, i, r#""eighty""#)
                } else {
                    svc(&name, i, "80")
                }
            })
            .collect();
        let text = match f % 3 {
            0 => format!(r#"{{"kind":"List","items":[{}]}}"#, items.join(",")),
            1 => items.join("\n"),
            _ => items
                .iter()
                .map(|s| format!("---\n{s}\n"))
                .collect::<String>(),
        };
        let ext = if f % 3 == 2 { "yaml" } else { "json" };
        files.push((format!("f{f:02}.{ext}"), text));
    }
    files.push((
        "g-list.yaml".to_string(),
        "kind: List\nitems:\n- {kind: Service, metadata: {name: y, creationTimestamp: 2026-01-01T00:00:00Z}, spec: {clusterIP: 10.96.9.9, ports: [{port: 80}]}}\n- {kind: Service, metadata: {namespace: x}, spec: {ports: [{port: 80}]}}\n".to_string(),
    ));
    files.push(("h-bad.yaml".to_string(), "kind: [Service\n".to_string()));
    files
}

/// What parsing found, as text: each file's objects (kind, key, hash, the reduced
/// object) and skipped objects (kind, key, reason, message) in order, or its error.
fn found(threads: usize, hasher: &foldhash::fast::RandomState) -> (Vec<String>, usize) {
    let files = files();
    let paths: Vec<PathBuf> = files.iter().map(|(n, _)| PathBuf::from(n)).collect();
    let texts: Vec<(&Path, &str)> = paths
        .iter()
        .zip(&files)
        .map(|(p, (_, t))| (p.as_path(), t.as_str()))
        .collect();
    let how = Decoding {
        proxy_name: None,
        hasher,
    };
    let (results, used) = parse_files(&texts, how, threads);
    let mut out = Vec::new();
    for (path, r) in paths.iter().zip(results) {
        match r {
            Err(e) => out.push(format!("{}: error {e}", path.display())),
            Ok(found) => out.extend(found.into_iter().map(|f| match f {
                Found::Object((kind, key, obj, hash)) => {
                    format!(
                        "{}: {} {key} {hash:x} {obj:?}",
                        path.display(),
                        kind.as_str()
                    )
                }
                Found::Skipped(s) => format!(
                    "{}: skipped {} {} {} {}",
                    path.display(),
                    s.kind.as_str(),
                    s.key.map_or("-".to_string(), |k| k.to_string()),
                    s.reason.label(),
                    s.message
                ),
            })),
        }
    }
    (out, used)
}

#[test]
fn objects_decoded_on_several_threads_are_the_ones_one_thread_decodes() {
    let hasher = foldhash::fast::RandomState::default();
    let (one, used) = found(1, &hasher);
    assert_eq!(used, 1);
    // The large List's 16,000 items, 30 x 40 from the small files, the YAML List's 2, the
    // bad file's error.
    assert_eq!(one.len(), 16_000 + 1_200 + 2 + 1);
    let skipped: Vec<&String> = one.iter().filter(|l| l.contains(": skipped ")).collect();
    // 18 bad items in the large List (i % 997 is 5 or 6: 5, 6, 1002, 1003, ..., 7982), one
    // per small file, the YAML List's unnamed one.
    assert_eq!(skipped.len(), 18 + 30 + 1, "{skipped:#?}");
    assert!(
        skipped[0].starts_with("a-big.json: skipped Service ns2/big5 decode_error"),
        "{}",
        skipped[0]
    );
    assert!(one
        .last()
        .is_some_and(|l| l.starts_with("h-bad.yaml: error ")));
    for threads in [2, 3, 8] {
        let (many, used) = found(threads, &hasher);
        assert_eq!(used, threads, "the objects went to {threads} threads");
        let diff = one.iter().zip(&many).position(|(a, b)| a != b);
        assert!(
            many == one,
            "{threads} threads decoded something else than one: {} against {} lines, first difference {:?}",
            many.len(),
            one.len(),
            diff.map(|i| (&one[i], &many[i]))
        );
    }
}

#[test]
fn a_directory_scanned_on_several_threads_gives_the_same_updates_and_counts() {
    let mut got = Vec::new();
    for threads in [1, 2] {
        let tmp = std::env::temp_dir().join(format!(
            "ebpf-proxy-manifests-par-{}-{threads}",
            std::process::id()
        ));
        fs::create_dir_all(&tmp).expect("mkdir");
        for (name, text) in files() {
            fs::write(tmp.join(name), text).expect("write");
        }
        let metrics = SourceCounters::default();
        let mut dir = ManifestsDir::new(&tmp, metrics.clone()).with_threads(threads);
        let ups = dir.scan().expect("scan");
        let text: Vec<String> = ups
            .iter()
            .flat_map(|u| match u {
                Update::Snapshot { objects, .. } => objects.iter().collect::<Vec<_>>(),
                _ => Vec::new(),
            })
            .map(|o| format!("{o:?}"))
            .collect();
        let counts = [
            metrics.skipped_count("Service", "decode_error"),
            metrics.skipped_count("Service", "no_name"),
            metrics.skipped_count("file", "parse_error"),
        ];
        assert_eq!(dir.last_threads, threads);
        got.push((text, counts));
        fs::remove_dir_all(&tmp).expect("cleanup");
    }
    assert_eq!(got[0].0.len(), 16_000 - 18 + 1_200 - 30 + 1);
    assert_eq!(got[0].1, [9 + 30, 9 + 1, 1]);
    let diff = got[0].0.iter().zip(&got[1].0).position(|(a, b)| a != b);
    assert!(
        got[0] == got[1],
        "two threads gave other updates or counts: {:?} against {:?}, first difference {:?}",
        got[1].1,
        got[0].1,
        diff.map(|i| (&got[0].0[i], &got[1].0[i]))
    );
}
