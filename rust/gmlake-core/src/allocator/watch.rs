//! The driver-share watch (`driver_share_notice`): whether the allocator's driver calls take
//! a large share of the job's wall time, said once.
//!
//! Why: a job whose allocations' lifetimes do not repeat (random sizes and lifetimes, no
//! steady state) reuses few stitched ranges, so every miss maps pages, and the driver
//! charges 20-35 µs a page for that (docs/benchmarks.md, "What a driver call costs in runs").
//! On an H100 and an H200 the random mixed pattern of bench/latency.cpp runs at about 3x
//! native's time at the defaults, most of it in those calls, and the random-lifetime stress
//! pattern 15-25x; larger pages bring both near native's time for some utilization
//! (`page_size:16MiB` and `64MiB` respectively; the notice suggests a page near the job's mean
//! large tensor). No default serves both those jobs and the ones with a steady
//! state (docs/benchmarks.md, "The frontier of the random patterns"), so the allocator does
//! not switch on its own: it measures, and tells the user which setting trades what.
//!
//! What counts: the share of the wall time spent in driver calls in a window, in a window
//! whose maps were mostly of pages mapped again (stitched, or in place of replaced aliases),
//! not of new memory. A job's first steps create its memory, which any allocator pays for
//! (native's cudaMalloc too), and can take seconds; a job without a steady state keeps moving
//! the memory it holds.
//!
//! Invariants: the watch reads the clock only at a miss (never on a hit or a free); it
//! decides nothing (a notice is a message, the allocator's choices are the same with the
//! watch off, so replays and tests are unchanged by it); it tells at most once per
//! allocator.

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
    /// Host nanoseconds of every driver call so far (not reset with the statistics).
    pub ns: u64,
    pub window: Duration,
    /// The current window's start: the time, and then `ns`, pages mapped, pages mapped again
    /// (`State::remapped`) and stitches.
    start: Option<(Instant, u64, u64, u64, u64)>,
    /// Windows in a row at or above the share.
    hot: u32,
    told: bool,
}

impl Default for DriverShare {
    fn default() -> Self {
        DriverShare {
            ns: 0,
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
    /// again, queues the notice (once). O(1).
    pub(super) fn watch_driver_share(&mut self) {
        let Some(threshold) = self.cfg.driver_share_notice else {
            return;
        };
        if self.watch.told {
            return;
        }
        let now = Instant::now();
        let maps = self.stats.driver_calls.map;
        let stitches = self.stats.stitches;
        let mark = (now, self.watch.ns, maps, self.remapped, stitches);
        let Some((t0, ns0, maps0, remapped0, stitches0)) = self.watch.start else {
            self.watch.start = Some(mark);
            return;
        };
        let elapsed = now.duration_since(t0);
        if elapsed < self.watch.window {
            return;
        }
        let share = share_of(self.watch.ns - ns0, elapsed);
        let mapped = maps.saturating_sub(maps0);
        let moved = self.remapped.saturating_sub(remapped0);
        self.watch.hot = if share >= threshold && mapped > 0 && 2 * moved >= mapped {
            self.watch.hot + 1
        } else {
            0
        };
        if self.watch.hot >= DRIVER_SHARE_WINDOWS {
            self.watch.told = true;
            self.stats.driver_share_notices = 1;
            let large = (
                self.stats.active_bytes.pool(PoolKind::Large).current.max(0) as u64,
                self.stats.active.pool(PoolKind::Large).current.max(0) as u64,
            );
            let text = notice_text(
                share,
                threshold,
                elapsed,
                mapped,
                stitches.saturating_sub(stitches0),
                self.page,
                suggested_page(large, self.page),
            );
            tracing::warn!("{text}");
            self.notices.push(text);
            self.notice_flag.store(true, Ordering::Release);
        }
        self.watch.start = Some(mark);
    }
}

/// The page the notice suggests for a job whose large live blocks are now (bytes, blocks):
/// the largest power of two at most their mean size, from 8 to 128 MiB, and larger than the
/// page held now. Measured on an H200 (docs/benchmarks.md): the random mixed pattern (large
/// blocks of about 9 MiB) runs at 1.16x native's time with 8 MiB pages and 1.13x with 16 MiB,
/// for a point of utilization; the stress pattern (about 80 MiB) at 1.3x expandable
/// segments' step with 64 MiB pages, 0.92 utilization. A page near a job's typical tensor
/// moves a tensor in one or a few handles; much larger, and a partly used page holds a whole
/// tensor's worth idle.
fn suggested_page(large: (u64, u64), page: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    let mean = large.0.checked_div(large.1).unwrap_or(0);
    let fit = match mean {
        0 => 16 * MIB,
        m => 1u64 << (63 - m.leading_zeros()),
    };
    fit.clamp(8 * MIB, 128 * MIB).max(2 * page)
}

/// The notice: what was measured (the last window's share, pages mapped and stitches), why it
/// happens, and the settings that trade (with the measured figures they rest on).
fn notice_text(
    share: f64,
    threshold: f64,
    window: Duration,
    maps: u64,
    stitches: u64,
    page: u64,
    suggest: u64,
) -> String {
    let span = match window.as_secs_f64() {
        s if s < 1.0 => format!("{:.0} ms", s * 1e3),
        s => format!("{s:.1} s"),
    };
    format!(
        "CUDA driver calls took {:.0}% of the last {span} of this process ({maps} pages of \
         {} MiB mapped, {stitches} stitches), and {:.0}% or more in the window before. \
         The job's allocations do not repeat from step to step, so stitched ranges are seldom \
         reused and each miss maps pages (20-35 us a page). Larger pages make far fewer calls \
         for some utilization: GMLAKE_CONF=page_size:{}MiB, near this job's mean large tensor \
         (or util_target:0.96, \
         new memory first while utilization stays at 0.96); `gmlake replay \
         --suggest-page-size` on a recorded trace of the job picks a page for it. \
         docs/pytorch.md, \"Jobs with and without a steady state\"; driver_share_notice:off \
         silences this.",
        share * 100.0,
        page >> 20,
        threshold * 100.0,
        suggest >> 20,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The suggested page follows the job's mean large tensor, within 8-128 MiB, and is
    /// always larger than the page held.
    #[test]
    fn the_suggested_page_is_near_the_mean_large_tensor() {
        const MIB: u64 = 1 << 20;
        let two = 2 * MIB;
        assert_eq!(suggested_page((10_000 * 9 * MIB, 10_000), two), 8 * MIB);
        assert_eq!(suggested_page((370 * 82 * MIB, 370), two), 64 * MIB);
        assert_eq!(suggested_page((4 << 30, 2), two), 128 * MIB);
        assert_eq!(suggested_page((100 * MIB, 100), two), 8 * MIB);
        assert_eq!(suggested_page((0, 0), two), 16 * MIB);
        assert_eq!(suggested_page((370 * 82 * MIB, 370), 64 * MIB), 128 * MIB);
    }

    #[test]
    fn the_share_is_the_spent_part_of_the_window() {
        assert_eq!(share_of(250_000_000, Duration::from_secs(1)), 0.25);
        assert_eq!(share_of(0, Duration::ZERO), 0.0);
    }

    /// The notice names what it measured and the settings it suggests, so that a user can
    /// act on it without the docs.
    #[test]
    fn the_notice_names_the_figures_and_the_settings() {
        let t = notice_text(
            0.61,
            0.25,
            Duration::from_millis(5_200),
            1234,
            56,
            2 << 20,
            16 << 20,
        );
        let short = notice_text(0.5, 0.25, Duration::from_millis(20), 1, 1, 2 << 20, 8 << 20);
        assert!(short.contains("last 20 ms"), "{short}");
        for part in [
            "61%",
            "last 5.2 s",
            "25% or more",
            "1234 pages of 2 MiB",
            "56 stitches",
            "page_size:16MiB, near this job's mean large tensor",
            "util_target:0.96",
            "--suggest-page-size",
            "driver_share_notice:off",
        ] {
            assert!(t.contains(part), "{part:?} missing from {t}");
        }
    }
}
