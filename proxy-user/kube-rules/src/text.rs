//! The text of kube-proxy's iptables rules: how it writes a probability and a comment,
//! and how `iptables-save` prints them back.

/// kube-proxy's `computeProbability`: `%0.10f` of 1/n, as written to `iptables-restore`.
pub fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
}

/// The probability of rule `i` of `n` (1/(n-i)) as `iptables-save` prints it back:
/// written as [`probability`], stored as `lround(p * 2^31)`, printed `%.11f`
/// (`0.3333333333` comes back as `0.33333333349`, the value in `iptables -L` listings).
pub fn listed_probability(n_left: usize) -> String {
    let written: f64 = probability(n_left).parse().unwrap_or(0.0);
    let stored = (written * 2_147_483_648.0).round();
    format!("{:.11}", stored / 2_147_483_648.0)
}

/// A comment match as kube-proxy writes it to `iptables-restore`: quoted only when the
/// text holds a space.
pub fn comment(text: &str) -> String {
    if text.contains(' ') {
        format!("-m comment --comment \"{text}\"")
    } else {
        format!("-m comment --comment {text}")
    }
}

/// A comment argument as `iptables-save` quotes it (`xtables_save_string`): bare when it
/// is only `[A-Za-z0-9_-]`, else in double quotes with `"`, `\` and `'` escaped.
pub fn save_string(s: &str) -> String {
    let bare = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        return s.to_string();
    }
    let mut out = String::from("\"");
    for c in s.chars() {
        if matches!(c, '"' | '\\' | '\'') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_as_written_and_as_listed() {
        // The seed article's three endpoints: 1/3 then 1/2.
        assert_eq!(probability(3), "0.3333333333");
        assert_eq!(probability(2), "0.5000000000");
        assert_eq!(listed_probability(3), "0.33333333349");
        assert_eq!(listed_probability(2), "0.50000000000");
    }

    #[test]
    fn comments_are_quoted_like_kube_proxy_and_iptables_save() {
        assert_eq!(comment("ns/svc:http"), "-m comment --comment ns/svc:http");
        assert_eq!(
            comment("ns/svc:http cluster IP"),
            "-m comment --comment \"ns/svc:http cluster IP\""
        );
        assert_eq!(save_string("KUBE-SVC"), "KUBE-SVC");
        assert_eq!(save_string("ns/svc"), "\"ns/svc\"");
        assert_eq!(save_string("a\"b"), "\"a\\\"b\"");
    }
}
