//! The structure rules of issue 25, checked on the source tree (no build, no privileges):
//! 1. one `bpf(2)` leaf: `SYS_bpf` appears only in `proxy-user/bpf-sys`;
//! 2. `PinDir` is the way to a pinned object: no function of `proxy-user` takes a pin
//!    directory as a bare `&Path` (a parameter named `pin_path`, `pins` or `pin_dir`;
//!    xtask links no `proxy-user` and hands pin directories to the binaries'
//!    `--pin-path` as paths);
//! 3. named imports: no `use super::*;` outside test modules;
//! 4. no non-test file over 600 lines;
//! 5. no non-test function over 80 lines without a stated reason: a `// Long: why`
//!    comment among the lines right above it (its doc comment and attributes).
//!
//! "Non-test" is a file's text before its first top-level `#[cfg(test)]`, in every crate
//! of the workspace, `tests.rs` files and `tests/` folders excluded.

use std::{
    fs,
    path::{Path, PathBuf},
};

const MAX_FILE_LINES: usize = 600;
const MAX_FN_LINES: usize = 80;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace")
        .to_path_buf()
}

/// Every non-test source file: (path relative to the workspace, its non-test text).
fn sources() -> Vec<(String, String)> {
    let root = root();
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = [
        "proxy-common/src",
        "proxy-ebpf/src",
        "proxy-user/src",
        "proxy-user/bpf-sys/src",
        "proxy-user/kube-rules/src",
        "proxy-user/testbed/src",
        "xtask/src",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if name != "tests" && name != "testdata" {
                    stack.push(path);
                }
            } else if name.ends_with(".rs") && name != "tests.rs" {
                let text = fs::read_to_string(&path).expect("read");
                let cut = text
                    .lines()
                    .position(|l| l.starts_with("#[cfg(test)]"))
                    .unwrap_or(usize::MAX);
                let body: Vec<&str> = text.lines().take(cut).collect();
                let rel = path
                    .strip_prefix(&root)
                    .expect("inside")
                    .display()
                    .to_string();
                out.push((rel, body.join("\n")));
            }
        }
    }
    assert!(out.len() > 100, "the walk found the sources: {}", out.len());
    out
}

/// Each line with its string, char and comment contents blanked (so braces inside them
/// are not counted), `//` comments kept apart.
fn code_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_str = false;
    let mut in_block = 0usize;
    for line in text.lines() {
        let chars: Vec<char> = line.chars().collect();
        let mut code = String::new();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            if in_block > 0 {
                if c == '*' && chars.get(i + 1) == Some(&'/') {
                    in_block -= 1;
                    i += 1;
                } else if c == '/' && chars.get(i + 1) == Some(&'*') {
                    in_block += 1;
                    i += 1;
                }
            } else if in_str {
                if c == '\\' {
                    i += 1;
                } else if c == '"' {
                    in_str = false;
                }
            } else if c == '/' && chars.get(i + 1) == Some(&'/') {
                break;
            } else if c == '/' && chars.get(i + 1) == Some(&'*') {
                in_block += 1;
                i += 1;
            } else if c == '"' {
                in_str = true;
            } else if c == '\'' {
                // A char literal ('x', '\n', '\u{..}'); a lifetime ('a) is left alone.
                if chars.get(i + 1) == Some(&'\\') {
                    while i + 1 < chars.len() && chars[i + 1] != '\'' {
                        i += 1;
                    }
                    i += 1;
                } else if chars.get(i + 2) == Some(&'\'') {
                    i += 2;
                } else {
                    code.push(c);
                }
            } else {
                code.push(c);
            }
            i += 1;
        }
        out.push(code);
    }
    out
}

/// Functions longer than [`MAX_FN_LINES`] without a `// Long:` reason above them.
fn long_functions(rel: &str, text: &str) -> Vec<String> {
    let raw: Vec<&str> = text.lines().collect();
    let code = code_lines(text);
    let is_fn = |l: &str| {
        let t = l.trim_start();
        let t = t
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ")
            .trim_start_matches("pub ")
            .trim_start_matches("const ")
            .trim_start_matches("async ")
            .trim_start_matches("unsafe ")
            .trim_start_matches("extern \"C\" ");
        t.starts_with("fn ")
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < code.len() {
        if !is_fn(&code[i]) {
            i += 1;
            continue;
        }
        // The body: from the first `{` to its match (a `;` first: a declaration).
        let (mut depth, mut opened, mut end) = (0i64, false, None);
        'scan: for (j, l) in code.iter().enumerate().skip(i) {
            for c in l.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    ';' if !opened => break 'scan,
                    _ => {}
                }
                if opened && depth == 0 {
                    end = Some(j);
                    break 'scan;
                }
            }
        }
        let Some(end) = end else {
            i += 1;
            continue;
        };
        let len = end - i + 1;
        if len > MAX_FN_LINES {
            let mut k = i;
            let mut reason = false;
            while k > 0 {
                let above = raw[k - 1].trim_start();
                if !(above.starts_with("//") || above.starts_with("#[")) {
                    break;
                }
                reason |= above.starts_with("// Long:");
                k -= 1;
            }
            if !reason {
                let name = code[i].trim().split('(').next().unwrap_or("").to_string();
                out.push(format!("{rel}:{} {name}: {len} lines", i + 1));
            }
        }
        // Nested functions are counted with their parent only.
        i = end + 1;
    }
    out
}

#[test]
fn one_bpf_syscall_leaf() {
    let found: Vec<String> = sources()
        .into_iter()
        .filter(|(rel, text)| !rel.starts_with("proxy-user/bpf-sys/") && text.contains("SYS_bpf"))
        .map(|(rel, _)| rel)
        .collect();
    assert!(found.is_empty(), "bpf(2) called outside bpf-sys: {found:?}");
}

#[test]
fn pin_directories_travel_as_pindir() {
    let mut found = Vec::new();
    for (rel, text) in sources() {
        if !rel.starts_with("proxy-user/src/") {
            continue;
        }
        for (n, line) in code_lines(&text).iter().enumerate() {
            let squeezed: String = line.split_whitespace().collect::<Vec<_>>().join(" ");
            for name in ["pin_path", "pins", "pin_dir"] {
                for ty in ["&Path", "&std::path::Path"] {
                    if squeezed.contains(&format!("{name}: {ty}")) {
                        found.push(format!("{rel}:{}: {}", n + 1, line.trim()));
                    }
                }
            }
        }
    }
    assert!(found.is_empty(), "take &PinDir instead: {found:#?}");
}

#[test]
fn named_imports_outside_tests() {
    let found: Vec<String> = sources()
        .into_iter()
        .filter(|(_, text)| text.lines().any(|l| l.trim() == "use super::*;"))
        .map(|(rel, _)| rel)
        .collect();
    assert!(found.is_empty(), "`use super::*` outside tests: {found:?}");
}

#[test]
fn no_file_over_600_lines() {
    let found: Vec<String> = sources()
        .into_iter()
        .map(|(rel, text)| (rel, text.lines().count()))
        .filter(|(_, n)| *n > MAX_FILE_LINES)
        .map(|(rel, n)| format!("{rel}: {n}"))
        .collect();
    assert!(
        found.is_empty(),
        "non-test files over {MAX_FILE_LINES} lines: {found:#?}"
    );
}

#[test]
fn no_long_function_without_a_stated_reason() {
    let mut found = Vec::new();
    for (rel, text) in sources() {
        found.extend(long_functions(&rel, &text));
    }
    assert!(
        found.is_empty(),
        "functions over {MAX_FN_LINES} lines: split them into named steps, or state why \
         not in a `// Long:` comment above them: {found:#?}"
    );
}

/// The scanner itself: braces in strings, chars and comments do not count; a reason
/// above a long function is found; a short one passes.
#[test]
fn the_function_scanner_counts_what_it_should() {
    let body = |n: usize| "    let x = \"{\"; // }\n    let c = '{';\n".repeat(n);
    let long = format!("/// Doc.\nfn long() {{\n{}}}\n", body(50));
    assert_eq!(long_functions("x.rs", &long).len(), 1, "{long}");
    let reasoned = format!(
        "/// Doc.\n// Long: a table.\nfn long() {{\n{}}}\n",
        body(50)
    );
    assert!(long_functions("x.rs", &reasoned).is_empty());
    let short = format!("fn short<'a>(s: &'a str) {{\n{}}}\n", body(10));
    assert!(long_functions("x.rs", &short).is_empty());
}
