//! `--call-times`: how long each allocation and free the replay asks of the allocator takes,
//! as a distribution. The replay's `cpu_us_per_event` is a mean over everything, misses and
//! their driver bookkeeping included; the median of the calls is the hit path's cost, the
//! figure to watch when the hit path changes (docs/benchmarks.md: a cache-hot allocation on
//! the GPU machine's host costs about what the same job's allocations cost under PyTorch).
//! Two clock readings a call; the allocator's decisions do not change.

use serde::Serialize;
use std::time::Instant;

/// Durations of the replay's calls, ns, in call order.
#[derive(Clone, Debug, Default)]
pub struct CallTimes {
    pub alloc: Vec<u64>,
    pub free: Vec<u64>,
}

/// Runs `f`, adding how long it took (ns) to `into` when there is one.
pub fn timed<T>(into: Option<&mut Vec<u64>>, f: impl FnOnce() -> T) -> T {
    match into {
        None => f(),
        Some(v) => {
            let t0 = Instant::now();
            let r = f();
            v.push(u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX));
            r
        }
    }
}

/// A distribution of call durations (ns); percentiles by nearest rank.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Distribution {
    pub count: usize,
    pub mean_ns: f64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

impl Distribution {
    /// None for no samples.
    pub fn of(samples: &[u64]) -> Option<Distribution> {
        let mut s = samples.to_vec();
        s.sort_unstable();
        let n = s.len();
        let max = *s.last()?;
        // Nearest rank: the smallest sample with at least q of them at or below it.
        let rank = |q: f64| s[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        Some(Distribution {
            count: n,
            mean_ns: s.iter().map(|&x| x as f64).sum::<f64>() / n as f64,
            p50_ns: rank(0.5),
            p90_ns: rank(0.9),
            p99_ns: rank(0.99),
            max_ns: max,
        })
    }

    fn line(&self) -> String {
        format!(
            "p50 {} ns, p90 {}, p99 {}, mean {:.0}, max {} ({} calls)",
            self.p50_ns, self.p90_ns, self.p99_ns, self.mean_ns, self.max_ns, self.count
        )
    }
}

/// `--call-times` in a row: allocations' and frees' distributions (null: none made).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CallTimesRow {
    pub alloc: Option<Distribution>,
    pub free: Option<Distribution>,
}

impl CallTimesRow {
    pub fn of(t: &CallTimes) -> CallTimesRow {
        CallTimesRow {
            alloc: Distribution::of(&t.alloc),
            free: Distribution::of(&t.free),
        }
    }

    /// The table's note.
    pub fn line(&self) -> String {
        let part = |d: &Option<Distribution>| d.map_or("none".to_string(), |d| d.line());
        format!(
            "allocator calls: allocations {}; frees {}",
            part(&self.alloc),
            part(&self.free)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let s: Vec<u64> = (1..=100).rev().collect();
        let d = Distribution::of(&s).unwrap();
        assert_eq!(
            (d.count, d.p50_ns, d.p90_ns, d.p99_ns, d.max_ns),
            (100, 50, 90, 99, 100)
        );
        assert_eq!(d.mean_ns, 50.5);
        let one = Distribution::of(&[7]).unwrap();
        assert_eq!((one.p50_ns, one.p99_ns, one.max_ns), (7, 7, 7));
        assert_eq!(Distribution::of(&[]), None);
    }

    #[test]
    fn timed_records_only_when_asked() {
        let mut v = Vec::new();
        assert_eq!(timed(Some(&mut v), || 3), 3);
        assert_eq!(timed(None, || 4), 4);
        assert_eq!(v.len(), 1);
        let row = CallTimesRow::of(&CallTimes {
            alloc: vec![10, 30, 20],
            free: Vec::new(),
        });
        assert_eq!(row.alloc.unwrap().p50_ns, 20);
        assert!(row.line().contains("frees none"), "{}", row.line());
    }
}
