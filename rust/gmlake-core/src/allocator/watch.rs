//! The driver-share watch (`driver_share_notice`, `driver_share_upgrade`): whether the
//! allocator's driver calls take a large share of the job's wall time; said once, and acted
//! on by giving new memory larger pages.
//!
//! Why: a job whose allocations' lifetimes do not repeat (random sizes and lifetimes, no
//! steady state) reuses few stitched ranges, so every miss maps pages, and the driver
//! charges 20-35 µs a page for that (docs/benchmarks.md, "What a driver call costs in runs").
//! On an H100 and an H200 the random mixed pattern of bench/latency.cpp runs at about 3x
//! native's time at the defaults, most of it in those calls, and the random-lifetime stress
//! pattern 15-25x; larger pages bring both near native's time for some utilization
//! (`page_size:16MiB` and `64MiB` respectively; the notice suggests a page near the job's mean
//! large tensor). No first page serves both those jobs and the ones with a steady state
//! (docs/benchmarks.md, "The frontier of the random patterns"), and the rent-or-buy upgrade
//! counts pages, not time: a job whose calls take a quarter of its time for ten seconds has
//! shown which kind it is. So the watch measures, tells the user, and (with
//! `driver_share_upgrade`, the default) moves new memory to pages near the job's mean large
//! tensor through the page-size upgrade (`upgrade.rs`), the smaller pages draining as their
//! blocks die.
//!
//! What counts: the share of the wall time spent in driver calls in a window, in a window
//! whose maps were mostly of pages mapped again (stitched, or in place of replaced aliases),
//! not of new memory. A job's first steps create its memory, which any allocator pays for
//! (native's cudaMalloc too), and can take seconds; a job without a steady state keeps moving
//! the memory it holds.
//!
//! Invariants: the watch reads the clock only at a miss (never on a hit or a free); the
//! notice decides nothing (with `driver_share_upgrade:off` the allocator's choices are the
//! same with the watch on or off), and the upgrade is its only decision, made at the next
//! allocation (no capture under way), to a page larger than the current one, at most once in
//! two windows; a replay, whose simulated calls take no time, never triggers it. It tells at
//! most once per allocator, then a line per later upgrade.

use super::*;
use std::time::{Duration, Instant};

/// The wall time over which the share is measured. Long enough that one step of a training
/// job that maps its new shapes (a first step, a new largest sequence) does not make a
/// window by itself: such steps take tens to hundreds of milliseconds of driver time.
pub(crate) const DRIVER_SHARE_WINDOW: Duration = Duration::from_secs(5);

/// Windows in a row at or above the share before the notice: a job that keeps paying, not
/// one that paid once.
pub(crate) const DRIVER_SHARE_WINDOWS: u32 = 2;

/// What the watch has seen.
#[derive(Debug)]
pub(super) struct DriverShare {
    pub window: Duration,
    /// The current window's start: the time, and then the driver's nanoseconds
    /// (`DeviceStats::driver_ns`), pages mapped, pages mapped again (`State::remapped`) and
    /// stitches. Counters reset with the statistics read as 0 for the window they fall in.
    start: Option<(Instant, u64, u64, u64, u64)>,
    /// Windows in a row at or above the share.
    hot: u32,
    told: bool,
}

impl Default for DriverShare {
    fn default() -> Self {
        DriverShare {
            window: DRIVER_SHARE_WINDOW,
            start: None,
            hot: 0,
            told: false,
        }
    }
}

/// The share of `elapsed` that `spent` nanoseconds are.
fn share_of(spent: u64, elapsed: Duration) -> f64 {
    let e = elapsed.as_nanos().max(1) as f64;
    spent as f64 / e
}

impl State {
    /// At a miss: closes the window when it is over, and after `DRIVER_SHARE_WINDOWS` windows
    /// in a row at or above `driver_share_notice` whose maps were mostly of pages mapped
    /// again, tells (once) and, with `driver_share_upgrade`, asks for pages twice as large
    /// (`share_upgrade`, made at the next allocation), up to the page near the job's mean
    /// large tensor. The windows then count anew, so a further doubling waits for two more
    /// windows at the new page: the job ends at the smallest page that brings its share
    /// under the threshold, or at that cap. O(1).
    pub(super) fn watch_driver_share(&mut self) {
        let Some(threshold) = self.cfg.driver_share_notice else {
            return;
        };
        let may_act = self.cfg.driver_share_upgrade && self.pages_may_grow;
        if self.watch.told && !may_act {
            return;
        }
        let now = Instant::now();
        let maps = self.stats.driver_calls.map;
        let stitches = self.stats.stitches;
        let mark = (now, self.stats.driver_ns, maps, self.remapped, stitches);
        let Some((t0, ns0, maps0, remapped0, stitches0)) = self.watch.start else {
            self.watch.start = Some(mark);
            return;
        };
        let elapsed = now.duration_since(t0);
        if elapsed < self.watch.window {
            return;
        }
        self.watch.start = Some(mark);
        let share = share_of(self.stats.driver_ns.saturating_sub(ns0), elapsed);
        let mapped = maps.saturating_sub(maps0);
        let moved = self.remapped.saturating_sub(remapped0);
        self.watch.hot = if share >= threshold && mapped > 0 && 2 * moved >= mapped {
            self.watch.hot + 1
        } else {
            0
        };
        if self.watch.hot < DRIVER_SHARE_WINDOWS {
            return;
        }
        self.watch.hot = 0;
        let large = (
            self.stats.active_bytes.pool(PoolKind::Large).current.max(0) as u64,
            self.stats.active.pool(PoolKind::Large).current.max(0) as u64,
        );
        // Up by doubling, to the page near the mean large tensor at most: the smallest page
        // that brings the share under the threshold, found two windows a step.
        let fit = fit_page(large);
        let next = fit.min(2 * self.page);
        let act = may_act && next > self.page && self.share_upgrade.is_none();
        if act {
            self.share_upgrade = Some(next);
            self.stats.driver_share_upgrades += 1;
        }
        let seen = Seen {
            share,
            threshold,
            window: elapsed,
            maps: mapped,
            stitches: stitches.saturating_sub(stitches0),
            page: self.page,
        };
        let text = if !self.watch.told {
            self.watch.told = true;
            self.stats.driver_share_notices = 1;
            if act {
                notice_text(&seen, next, Some(fit))
            } else {
                notice_text(&seen, fit.max(2 * self.page), None)
            }
        } else if act {
            upgrade_text(&seen, next)
        } else {
            return;
        };
        tracing::warn!("{text}");
        self.notices.push(text);
        self.notice_flag.store(true, Ordering::Release);
    }
}

/// What a window showed: its share of driver time and the threshold, its length, the pages
/// mapped and the stitches in it, and the page size then.
struct Seen {
    share: f64,
    threshold: f64,
    window: Duration,
    maps: u64,
    stitches: u64,
    page: u64,
}

impl Seen {
    /// "61% of the last 5.2 s of this process (1234 pages of 2 MiB mapped, 56 stitches)".
    fn figures(&self) -> String {
        let span = match self.window.as_secs_f64() {
            s if s < 1.0 => format!("{:.0} ms", s * 1e3),
            s => format!("{s:.1} s"),
        };
        format!(
            "{:.0}% of the last {span} of this process ({} pages of {} MiB mapped, {} stitches)",
            self.share * 100.0,
            self.maps,
            self.page >> 20,
            self.stitches
        )
    }
}

/// The largest power of two at most the mean size of the large live blocks (bytes, blocks),
/// within 8-128 MiB (16 MiB when none lives): the page the watch moves to, or suggests.
/// Measured on an H200 (docs/benchmarks.md): the random mixed pattern (large blocks of about
/// 9 MiB) runs at 1.16x native's time with 8 MiB pages and 1.13x with 16 MiB, for a point of
/// utilization; the stress pattern at 1.3x expandable segments' step with 64 MiB pages, 0.92
/// utilization. A page near a job's typical tensor moves a tensor in one or a few handles;
/// much larger, and a partly used page holds a whole tensor's worth idle.
fn fit_page(large: (u64, u64)) -> u64 {
    const MIB: u64 = 1 << 20;
    let mean = large.0.checked_div(large.1).unwrap_or(0);
    let fit = match mean {
        0 => 16 * MIB,
        m => 1u64 << (63 - m.leading_zeros()),
    };
    fit.clamp(8 * MIB, 128 * MIB)
}

/// The notice: what was measured, why it happens, and what the allocator does about it
/// (`cap` given: new memory in `page` pages from now, doubling up to `cap` while the share
/// holds) or suggests (`page`).
fn notice_text(seen: &Seen, page: u64, cap: Option<u64>) -> String {
    let what = if let Some(cap) = cap {
        format!(
            "gmlake now gives new memory pages of {} MiB, and gives the smaller ones back as \
             their blocks are freed: fewer calls for some utilization. While the calls keep \
             that share it doubles the page, up to {} MiB, near this job's mean large tensor \
             (driver_share_upgrade:off keeps the page; util_target:0.96, new memory first while \
             utilization stays at 0.96, is the other trade)",
            page >> 20,
            cap >> 20
        )
    } else {
        format!(
            "Larger pages make far fewer calls for some utilization: \
             GMLAKE_CONF=page_size:{}MiB, near this job's mean large tensor (or \
             util_target:0.96, new memory first while utilization stays at 0.96)",
            page >> 20
        )
    };
    format!(
        "CUDA driver calls took {}, and {:.0}% or more in the window before. The job's \
         allocations do not repeat from step to step, so stitched ranges are seldom reused and \
         each miss maps pages (20-35 us a page). {what}; `gmlake replay --suggest-page-size` \
         on a recorded trace of the job picks a page for it. docs/pytorch.md, \"Jobs with and \
         without a steady state\"; driver_share_notice:off silences this.",
        seen.figures(),
        seen.threshold * 100.0,
    )
}

/// A later upgrade's line: the pages were still too small for the job.
fn upgrade_text(seen: &Seen, page: u64) -> String {
    format!(
        "CUDA driver calls still took {} with the pages given after the notice: new memory now \
         gets pages of {} MiB (driver_share_upgrade:off keeps the page).",
        seen.figures(),
        page >> 20
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The page follows the job's mean large tensor, within 8-128 MiB.
    #[test]
    fn the_page_is_near_the_mean_large_tensor() {
        assert_eq!(fit_page((10_000 * 9 * MIB, 10_000)), 8 * MIB);
        assert_eq!(fit_page((370 * 82 * MIB, 370)), 64 * MIB);
        assert_eq!(fit_page((4 << 30, 2)), 128 * MIB);
        assert_eq!(fit_page((100 * MIB, 100)), 8 * MIB);
        assert_eq!(fit_page((0, 0)), 16 * MIB);
    }

    #[test]
    fn the_share_is_the_spent_part_of_the_window() {
        assert_eq!(share_of(250_000_000, Duration::from_secs(1)), 0.25);
        assert_eq!(share_of(0, Duration::ZERO), 0.0);
    }

    /// Every one of `parts` is in `text`.
    fn assert_mentions(text: &str, parts: &[&str]) {
        for part in parts {
            assert!(text.contains(part), "{part:?} missing from {text}");
        }
    }

    fn seen(window: Duration) -> Seen {
        Seen {
            share: 0.61,
            threshold: 0.25,
            window,
            maps: 1234,
            stitches: 56,
            page: 2 * MIB,
        }
    }

    /// The notice names what it measured and what it does or suggests, so that a user can
    /// act on it without the docs.
    #[test]
    fn the_notice_names_the_figures_and_the_settings() {
        let s = seen(Duration::from_millis(5_200));
        let told = notice_text(&s, 16 * MIB, None);
        assert_mentions(
            &told,
            &[
                "61% of the last 5.2 s",
                "1234 pages of 2 MiB mapped, 56 stitches",
                "25% or more",
                "page_size:16MiB, near this job's mean large tensor",
                "util_target:0.96",
                "--suggest-page-size",
                "driver_share_notice:off",
            ],
        );
        let acted = notice_text(&s, 4 * MIB, Some(16 * MIB));
        assert_mentions(
            &acted,
            &[
                "now gives new memory pages of 4 MiB",
                "up to 16 MiB, near this job's mean large tensor",
                "driver_share_upgrade:off",
                "util_target:0.96",
            ],
        );
        assert!(!acted.contains("GMLAKE_CONF=page_size"), "{acted}");
        let again = upgrade_text(&seen(Duration::from_millis(20)), 32 * MIB);
        assert!(
            again.contains("last 20 ms") && again.contains("pages of 32 MiB"),
            "{again}"
        );
    }
}
