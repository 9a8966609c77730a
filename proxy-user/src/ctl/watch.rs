//! `proxyctl watch`: a `top`-like view, refreshed every interval, of the connections per
//! backend and the outcome counters, with the change since the previous frame and the
//! rate (change / measured time between the two reads).

use std::{fmt::Write as _, time::Duration};

use proxy_common::Reason;
use serde::Serialize;

use super::{schema::SCHEMA, snapshot::Snapshot, table::Table};

/// One refresh (also one line of `-o json` output: one JSON object per frame).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FrameView {
    pub schema: u32,
    /// 1-based frame number.
    pub frame: u64,
    /// Seconds since the previous frame's read; null in the first frame.
    pub elapsed_seconds: Option<f64>,
    pub backends: Vec<BackendRate>,
    pub counters: Vec<CounterRate>,
}

/// Connections of one backend.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BackendRate {
    pub id: u32,
    pub endpoint: Option<String>,
    pub connections: u64,
    /// Change since the previous frame (null in the first frame).
    pub delta: Option<u64>,
    /// `delta / elapsed_seconds`.
    pub rate: Option<f64>,
}

/// One outcome counter.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CounterRate {
    pub reason: &'static str,
    pub count: u64,
    pub delta: Option<u64>,
    pub rate: Option<f64>,
}

/// A frame from the current read and, after the first, the previous one.
pub fn frame(n: u64, prev: Option<(&Snapshot, Duration)>, cur: &Snapshot) -> FrameView {
    let secs = prev.map(|(_, d)| d.as_secs_f64());
    let change = |before: Option<u64>, now: u64| -> (Option<u64>, Option<f64>) {
        match (prev, secs) {
            (Some(_), Some(s)) => {
                // A counter that went down was reset (backend id reused): count from 0.
                let d = now.checked_sub(before.unwrap_or(0)).unwrap_or(now);
                (Some(d), Some(if s > 0.0 { d as f64 / s } else { 0.0 }))
            }
            _ => (None, None),
        }
    };
    let mut ids: Vec<u32> = cur.conns.keys().copied().collect();
    ids.extend(cur.services.backends.keys().copied());
    ids.sort_unstable();
    ids.dedup();
    let mut backends: Vec<BackendRate> = ids
        .into_iter()
        .map(|id| {
            let now = cur.conns_of(id);
            let (delta, rate) = change(prev.map(|(p, _)| p.conns_of(id)), now);
            BackendRate {
                id,
                endpoint: cur.backend(id).map(|(b, _)| b.addr.to_string()),
                connections: now,
                delta,
                rate,
            }
        })
        .collect();
    // Busiest first, like top.
    backends.sort_by(|a, b| {
        b.delta
            .cmp(&a.delta)
            .then(b.connections.cmp(&a.connections))
            .then(a.id.cmp(&b.id))
    });
    let counters = Reason::ALL
        .iter()
        .map(|r| {
            let now = cur.counter(*r);
            let (delta, rate) = change(prev.map(|(p, _)| p.counter(*r)), now);
            CounterRate {
                reason: r.name(),
                count: now,
                delta,
                rate,
            }
        })
        .collect();
    FrameView {
        schema: SCHEMA,
        frame: n,
        elapsed_seconds: secs,
        backends,
        counters,
    }
}

/// `1s`, `250ms`, `1.5s`.
pub fn format_interval(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d < Duration::from_secs(1) && Duration::from_millis(d.as_millis() as u64) == d {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

/// Parses `500ms`, `1s`, `2m`, or a plain number of seconds.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a duration like 500ms, 1s or 2m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s or m)")),
    };
    if !(secs > 0.0 && secs.is_finite()) {
        return Err(format!("{s:?}: the interval must be positive"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn delta_cell(d: Option<u64>) -> String {
    d.map_or_else(|| "-".into(), |d| format!("+{d}"))
}

fn rate_cell(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.1}"))
}

/// One frame as text. `total` is the number of frames asked for, if any.
pub fn render(f: &FrameView, interval: Duration, total: Option<u64>) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "proxyctl watch: every {}, frame {}",
        format_interval(interval),
        f.frame
    );
    match total {
        Some(t) => {
            let _ = writeln!(out, " of {t}");
        }
        None => out.push_str(" (Ctrl-C to stop)\n"),
    }
    out.push('\n');
    if f.backends.is_empty() {
        out.push_str("no backends\n");
    } else {
        let mut t = Table::new(&["BACKEND", "ID", "CONNS", "DELTA", "RATE/S"]);
        for b in &f.backends {
            t.row(vec![
                b.endpoint.clone().unwrap_or_else(|| "(deleted)".into()),
                b.id.to_string(),
                b.connections.to_string(),
                delta_cell(b.delta),
                rate_cell(b.rate),
            ]);
        }
        out.push_str(&t.render(""));
    }
    out.push('\n');
    let mut t = Table::new(&["COUNTER", "COUNT", "DELTA", "RATE/S"]);
    for c in &f.counters {
        t.row(vec![
            c.reason.into(),
            c.count.to_string(),
            delta_cell(c.delta),
            rate_cell(c.rate),
        ]);
    }
    out.push_str(&t.render(""));
    out
}
