//! The map listings agree: `proxy_common::map_names::ALL` (what the loader pins, what
//! `proxyctl` and the uninstall know), the maps declared in `proxy-ebpf/src/maps.rs`, and
//! the "Maps" table of `docs/ARCHITECTURE.md`. Unprivileged: reads source files only.

use std::{collections::BTreeSet, fs, path::Path};

use proxy_common::map_names;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
}

fn read(rel: &str) -> String {
    fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn all() -> BTreeSet<String> {
    map_names::ALL.iter().map(|s| s.to_string()).collect()
}

/// `NAME` of every `static NAME: ...` right after a `#[map]`/`#[btf_map]` attribute: those
/// pinned by name, and the others (per-CPU scratch and the like).
fn declared(src: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut pinned, mut unpinned) = (BTreeSet::new(), BTreeSet::new());
    let lines: Vec<&str> = src.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim();
        if t != "#[map]" && t != "#[btf_map]" {
            continue;
        }
        let decl: String = lines[i + 1..]
            .iter()
            .take_while(|l| !l.trim().is_empty() && !l.trim_start().starts_with("///"))
            .map(|l| l.trim())
            .collect::<Vec<_>>()
            .join(" ");
        let name = decl
            .split("static ")
            .nth(1)
            .and_then(|r| r.split(':').next())
            .unwrap_or_else(|| panic!("no static after line {}: {decl}", i + 1))
            .trim()
            .to_string();
        // Pinned by name: `X::pinned(..)`, or the socket storage, whose hand-declared
        // BTF type carries the pinning.
        if decl.contains("::pinned(") || decl.contains(": SkStorage<") {
            pinned.insert(name);
        } else {
            unpinned.insert(name);
        }
    }
    (pinned, unpinned)
}

#[test]
fn every_pinned_map_in_maps_rs_is_in_map_names_all() {
    let src = read("proxy-ebpf/src/maps.rs");
    let (pinned, _) = declared(&src);
    assert_eq!(
        pinned,
        all(),
        "maps pinned in proxy-ebpf/src/maps.rs vs proxy_common::map_names::ALL"
    );
}

#[test]
fn the_architecture_map_table_lists_every_pinned_map() {
    let doc = read("docs/ARCHITECTURE.md");
    let table = doc
        .split("\n## Maps")
        .nth(1)
        .expect("a Maps section in docs/ARCHITECTURE.md");
    let mut listed = BTreeSet::new();
    let rows = table
        .lines()
        .skip(1)
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'));
    for row in rows.skip(2) {
        // The names are the backticked words before any remark in parentheses: `SVC4`,
        // `SVC6`; `NODE_ADDRS4/6` names two.
        let cell = row.split('|').nth(1).unwrap_or("");
        let first = cell.split(" (").next().unwrap_or("");
        for part in first.split('`').skip(1).step_by(2) {
            match part.strip_suffix("4/6") {
                Some(stem) => {
                    listed.insert(format!("{stem}4"));
                    listed.insert(format!("{stem}6"));
                }
                None => {
                    listed.insert(part.to_string());
                }
            }
        }
    }
    assert_eq!(
        listed,
        all(),
        "the Maps table of docs/ARCHITECTURE.md vs proxy_common::map_names::ALL"
    );
}
