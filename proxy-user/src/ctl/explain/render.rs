//! The explanation as text: the paths, the backends, and kube-proxy's rules beside them.

use super::{services, ExplainDoc, Kind, PathView, ServiceView, Table};

pub(super) fn fraction(n: usize) -> String {
    if n == 1 {
        "1".into()
    } else {
        format!("1/{n}")
    }
}

/// kube-proxy's rule walk next to ebpf-proxy's lookups, for the path that translates
/// (TC's under a NodePort, the socket hooks' otherwise).
pub(super) fn comparison(doc: &ExplainDoc) -> String {
    let primary = &doc.frontends[0];
    let translated = |p: &&PathView| p.outcome == "translated";
    let tc_first = primary.kind == Kind::NodePort;
    let Some(p) = doc
        .paths
        .iter()
        .filter(translated)
        .find(|p| !tc_first || p.path == "tc")
        .or_else(|| doc.paths.iter().find(translated))
    else {
        return String::new();
    };
    let n = p.backends.len();
    let walk = if primary.kind == Kind::NodePort {
        "walks all of KUBE-SERVICES (the node-port jump is its last rule), then KUBE-NODEPORTS \
         rule by rule to this port's rule"
    } else {
        "walks KUBE-SERVICES rule by rule to this Service's rule"
    };
    let pick = if n == 1 {
        "then jumps to the only endpoint".to_string()
    } else {
        format!(
            "then the statistic rules in order (1/{n}, then 1/{} of the rest, ..., the last \
             takes what is left): 1/{n} each",
            n - 1
        )
    };
    let fe = |v: &ServiceView| format!("{{{}, {}, {}}}", v.address, v.port, v.protocol);
    let mut lookups = if doc.via_node_port {
        format!(
            "{{{}, {}, {}}} misses, {} is in NODE_ADDRS{}, {} matches",
            doc.query.address,
            doc.query.port,
            doc.query.protocol,
            doc.query.address,
            if doc.query.address.is_ipv4() {
                "4"
            } else {
                "6"
            },
            fe(primary)
        )
    } else {
        format!(
            "one hash lookup of {} (the frontend's entry, with slots 1..=24)",
            fe(primary)
        )
    };
    if p.frontend != primary.frontend {
        lookups.push_str(", its ext-local twin holds the slots");
    }
    let slot = if n == 1 {
        "slot 1".to_string()
    } else {
        format!("slot = 1 + random % {n}")
    };
    format!(
        "  kube-proxy: every new connection {walk}, {pick}.\n  ebpf-proxy: {lookups}; {slot}; \
         then the slot's backend id (in that entry up to slot 24) and the backend: a few \
         lookups, whatever the number of services.\n"
    )
}

/// The `table` / `wide` text (`wide` adds service ids and backend ids to the rows).
// Long: the explain text: one template, section by section.
pub fn render(doc: &ExplainDoc, wide: bool) -> String {
    let mut out = String::new();
    let dest = &doc.query.destination;
    if !doc.matched {
        out.push_str(&format!(
            "{dest}: not a service. No frontend matches, so traffic to it is not translated \
             (the socket hooks count it as no_service and leave it alone).\n"
        ));
        for n in &doc.notes {
            out.push_str(&format!("  note: {n}\n"));
        }
        return out;
    }
    let primary = &doc.frontends[0];
    out.push_str(&format!(
        "{dest}: Service {}, {}",
        doc.service.as_deref().unwrap_or("(no name)"),
        primary.kind
    ));
    if doc.via_node_port {
        out.push_str(&format!(
            " (node port {} on this node's address {})",
            doc.query.port, doc.query.address
        ));
    }
    out.push('\n');
    let mut fes = Table::new(if wide {
        &["FRONTEND", "KIND", "SVC-ID", "BACKENDS", "FLAGS"][..]
    } else {
        &["FRONTEND", "KIND", "BACKENDS", "FLAGS"][..]
    });
    for v in &doc.frontends {
        let mut row = vec![v.frontend.clone(), v.kind.to_string()];
        if wide {
            row.push(v.service_id.to_string());
        }
        row.push(v.backend_count.to_string());
        row.push(services::flags_cell(v));
        fes.row(row);
    }
    out.push_str(&fes.render("  "));

    let mut shown: Vec<&str> = Vec::new();
    for p in &doc.paths {
        out.push_str(&format!(
            "\n{} -> {} via {}: {}\n  {}\n",
            p.traffic.split(" (").next().unwrap_or(&p.traffic),
            p.frontend,
            if p.path == "socket" {
                "the socket hooks"
            } else {
                "TC"
            },
            p.outcome,
            p.detail
        ));
        if p.backends.is_empty() {
            continue;
        }
        if shown.contains(&p.frontend.as_str()) {
            out.push_str("  (the same slots as above)\n");
            continue;
        }
        shown.push(&p.frontend);
        let mut t = Table::new(&["SLOT", "ID", "BACKEND", "STATE", "CHANCE", "CONNS"]);
        let n = p.backends.len();
        for b in &p.backends {
            t.row(vec![
                b.slot.to_string(),
                if b.backend_id == 0 {
                    "-".into()
                } else {
                    b.backend_id.to_string()
                },
                b.endpoint.clone().unwrap_or_else(|| "-".into()),
                if b.local {
                    format!("{},local", b.state)
                } else {
                    b.state.to_string()
                },
                fraction(n),
                b.connections.to_string(),
            ]);
        }
        out.push_str(&t.render("  "));
    }

    if let Some(f) = &doc.flow {
        out.push_str(&format!(
            "\nThe flow from {} (from outside, at {}): {}{}\n  {}\n",
            f.client,
            f.path.to_uppercase(),
            f.by,
            f.endpoint
                .as_deref()
                .map_or_else(String::new, |e| format!(" -> {e}")),
            f.detail
        ));
    }
    if let Some(rules) = &doc.iptables {
        out.push_str(&format!(
            "\nkube-proxy (iptables mode) would have written ({}-save):\n",
            if rules.ipv6 { "ip6tables" } else { "iptables" }
        ));
        out.push_str(&rules.render("  "));
        out.push_str(&comparison(doc));
    }
    if !doc.notes.is_empty() {
        out.push('\n');
        for n in &doc.notes {
            out.push_str(&format!("note: {n}\n"));
        }
    }
    out
}
