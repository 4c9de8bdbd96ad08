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

/// Calls this long or longer are counted apart (`slow_count`, `slow_ms`): on the replay's
/// simulated device a hit of the cache takes a few hundred ns and a miss (a scan for a kept
/// window, a stitch) several µs, so the split is about hits against misses.
const SLOW_NS: u64 = 1000;

/// A distribution of call durations (ns); percentiles by nearest rank.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Distribution {
    pub count: usize,
    pub mean_ns: f64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    /// The calls' time in all, ms: what a change of the allocator's time is read from.
    pub total_ms: f64,
    /// The calls of `SLOW_NS` (1 µs) or more and their time, ms.
    pub slow_count: usize,
    pub slow_ms: f64,
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
        let total: f64 = s.iter().map(|&x| x as f64).sum();
        let slow_from = s.partition_point(|&x| x < SLOW_NS);
        let slow: f64 = s[slow_from..].iter().map(|&x| x as f64).sum();
        Some(Distribution {
            count: n,
            mean_ns: total / n as f64,
            p50_ns: rank(0.5),
            p90_ns: rank(0.9),
            p99_ns: rank(0.99),
            max_ns: max,
            total_ms: total / 1e6,
            slow_count: n - slow_from,
            slow_ms: slow / 1e6,
        })
    }

    fn line(&self) -> String {
        format!(
            "p50 {} ns, p90 {}, p99 {}, mean {:.0}, max {} ({} calls, {:.1} ms; {} of {} µs or \
             more, {:.1} ms)",
            self.p50_ns,
            self.p90_ns,
            self.p99_ns,
            self.mean_ns,
            self.max_ns,
            self.count,
            self.total_ms,
            self.slow_count,
            SLOW_NS / 1000,
            self.slow_ms
        )
    }
}

/// `--call-times` in a row: allocations' and frees' distributions (null: none made), over
/// all the calls and over the second half of them (in call order): a job's steady state,
/// where its warm-up's misses are behind it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CallTimesRow {
    pub alloc: Option<Distribution>,
    pub free: Option<Distribution>,
    pub alloc_second_half: Option<Distribution>,
    pub free_second_half: Option<Distribution>,
}

impl CallTimesRow {
    pub fn of(t: &CallTimes) -> CallTimesRow {
        let second_half = |v: &[u64]| Distribution::of(&v[v.len() / 2..]);
        CallTimesRow {
            alloc: Distribution::of(&t.alloc),
            free: Distribution::of(&t.free),
            alloc_second_half: second_half(&t.alloc),
            free_second_half: second_half(&t.free),
        }
    }

    /// The table's note.
    pub fn line(&self) -> String {
        let part = |d: &Option<Distribution>| d.map_or("none".to_string(), |d| d.line());
        format!(
            "allocator calls: allocations {}; frees {}; the second half of the calls: \
             allocations {}; frees {}",
            part(&self.alloc),
            part(&self.free),
            part(&self.alloc_second_half),
            part(&self.free_second_half)
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
        assert_eq!(d.total_ms, 5050.0 / 1e6);
        assert_eq!((d.slow_count, d.slow_ms), (0, 0.0));
        let mixed = Distribution::of(&[200, 5000, 300, 1000]).unwrap();
        assert_eq!(
            (mixed.slow_count, mixed.slow_ms, mixed.total_ms),
            (2, 6000.0 / 1e6, 6500.0 / 1e6),
            "1 µs and more is slow"
        );
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
            alloc: vec![10, 30, 20, 40],
            free: Vec::new(),
        });
        assert_eq!(row.alloc.unwrap().p50_ns, 20);
        let half = row.alloc_second_half.unwrap();
        assert_eq!(
            (half.count, half.p50_ns, half.max_ns),
            (2, 20, 40),
            "calls 3 and 4"
        );
        assert!(row.free_second_half.is_none());
        assert!(row.line().contains("frees none"), "{}", row.line());
    }
}
