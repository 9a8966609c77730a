//! Statistics over measured samples: nearest-rank percentiles, medians, ratios.

use serde::{Deserialize, Serialize};

/// The nearest-rank `p`-th percentile (0 < p <= 100) of `sorted` (ascending): the
/// smallest sample such that at least p % of the samples are less than or equal to it.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() || !(p > 0.0 && p <= 100.0) {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The median (mean of the two middle values for an even count).
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// A latency distribution, in microseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Latency {
    pub count: usize,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

impl Latency {
    /// Summarises samples given in nanoseconds; `None` without samples.
    pub fn from_ns(samples_ns: &[u64]) -> Option<Self> {
        if samples_ns.is_empty() {
            return None;
        }
        let mut us: Vec<f64> = samples_ns.iter().map(|n| *n as f64 / 1e3).collect();
        us.sort_by(f64::total_cmp);
        let p = |q| percentile(&us, q).unwrap_or(f64::NAN);
        Some(Self {
            count: us.len(),
            p50_us: p(50.0),
            p90_us: p(90.0),
            p99_us: p(99.0),
            mean_us: us.iter().sum::<f64>() / us.len() as f64,
            min_us: us[0],
            max_us: us[us.len() - 1],
        })
    }
}

/// `value / base`, when both are positive numbers.
pub fn ratio(value: Option<f64>, base: Option<f64>) -> Option<f64> {
    match (value, base) {
        (Some(v), Some(b)) if v.is_finite() && b.is_finite() && b > 0.0 && v >= 0.0 => Some(v / b),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.5), Some(1.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&v, 0.0), None);
        // Ten samples: p99 is the largest, p90 the ninth.
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&ten, 99.0), Some(10.0));
        assert_eq!(percentile(&ten, 90.0), Some(9.0));
    }

    #[test]
    fn medians_and_ratios() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[f64::NAN, 5.0]), Some(5.0));
        assert_eq!(median(&[]), None);
        assert_eq!(ratio(Some(3.0), Some(2.0)), Some(1.5));
        assert_eq!(ratio(Some(3.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(2.0)), None);
    }

    #[test]
    fn latency_summary_from_nanoseconds() {
        let ns: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let l = Latency::from_ns(&ns).expect("samples");
        assert_eq!(l.count, 1000);
        assert_eq!(l.p50_us, 500.0);
        assert_eq!(l.p99_us, 990.0);
        assert_eq!(l.min_us, 1.0);
        assert_eq!(l.max_us, 1000.0);
        assert!((l.mean_us - 500.5).abs() < 1e-9);
        assert!(Latency::from_ns(&[]).is_none());
    }
}
