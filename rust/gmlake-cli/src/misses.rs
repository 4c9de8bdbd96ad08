//! The second half's misses (`gmlake replay --misses`): allocations that found no kept window
//! they could take, so that they mapped a new range, and why (the allocator's miss log,
//! `Allocator::set_miss_log`). The steady state's driver calls of a periodic job are these
//! misses' maps; whether a kept window of the size existed, how many of its pages were busy
//! against how many a reuse may replace, and what held them (live blocks of the same stream,
//! of another, free blocks of another stream not yet fenced) say which remedy applies,
//! without the probes each investigation used to add by hand.

use gmlake_core::MissRecord;

/// How many misses the report lists one by one.
pub const LISTED: usize = 20;

/// One miss as the report lists it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Miss {
    /// The trace event (the allocation).
    pub event: usize,
    pub stream: u64,
    pub size: u64,
    pub fresh_pages: u64,
    pub max_busy: u64,
    /// The best kept window's busy pages and their holders (none: no kept window of the
    /// size): `[busy, live same stream, live other stream, free not yet fenced, other]`.
    pub best_busy: Option<[u64; 5]>,
}

/// The misses of the replay's second half, summed, with the first [`LISTED`] of them.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Misses {
    pub count: u64,
    /// Misses where a kept window of the size existed (its busy pages exceeded what a reuse
    /// may replace).
    pub with_window: u64,
    /// Pages new ranges would map at those misses (the placement's `fresh_pages`).
    pub fresh_pages: u64,
    /// Busy pages of the best windows, and by holder.
    pub busy: u64,
    pub held_live_same_stream: u64,
    pub held_live_other_stream: u64,
    pub held_free_unfenced: u64,
    pub held_other: u64,
    pub first: Vec<Miss>,
}

impl Misses {
    /// The summary of `(event, record)` pairs.
    pub fn of(records: &[(usize, MissRecord)]) -> Misses {
        let mut m = Misses::default();
        for (event, r) in records {
            m.count += 1;
            m.fresh_pages += r.fresh_pages;
            let best_busy = r.best.as_ref().map(|w| {
                [
                    w.busy,
                    w.held_live_same_stream,
                    w.held_live_other_stream,
                    w.held_free_unfenced,
                    w.held_other,
                ]
            });
            if let Some([busy, same, other, unfenced, rest]) = best_busy {
                m.with_window += 1;
                m.busy += busy;
                m.held_live_same_stream += same;
                m.held_live_other_stream += other;
                m.held_free_unfenced += unfenced;
                m.held_other += rest;
            }
            if m.first.len() < LISTED {
                m.first.push(Miss {
                    event: *event,
                    stream: r.stream,
                    size: r.size,
                    fresh_pages: r.fresh_pages,
                    max_busy: r.max_busy,
                    best_busy,
                });
            }
        }
        m
    }

    /// One sentence for the table's notes.
    pub fn line(&self) -> String {
        if self.count == 0 {
            return "in the second half no allocation had to map a new range for want of a \
                    kept window"
                .to_string();
        }
        let pct = |x: u64| {
            if self.busy == 0 {
                0.0
            } else {
                100.0 * x as f64 / self.busy as f64
            }
        };
        format!(
            "in the second half {} allocations took no kept window ({} new pages by their \
             placements); {} had a kept window of the size, whose best had {} busy pages in \
             all, held by live blocks of the same stream {:.0}%, of other streams {:.0}%, by \
             other streams' free blocks not yet fenced {:.0}%, other {:.0}%",
            self.count,
            self.fresh_pages,
            self.with_window,
            self.busy,
            pct(self.held_live_same_stream),
            pct(self.held_live_other_stream),
            pct(self.held_free_unfenced),
            pct(self.held_other),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gmlake_core::MissWindow;

    fn rec(size: u64, best: Option<(u64, u64, u64)>) -> MissRecord {
        MissRecord {
            stamp: 0,
            stream: 7,
            size,
            fresh_pages: 4,
            max_busy: 1,
            best: best.map(|(busy, same, other)| MissWindow {
                start: 0,
                lent_pages: 8,
                busy,
                held_live_same_stream: same,
                held_live_other_stream: other,
                ..MissWindow::default()
            }),
        }
    }

    /// Sums and shares: a miss with no window counts as a miss only; percentages are of the
    /// busy pages; the list keeps the first [`LISTED`].
    #[test]
    fn misses_sum_their_windows_busy_pages_by_holder() {
        let mut recs = vec![(10, rec(1, Some((3, 3, 0)))), (11, rec(2, None))];
        recs.push((12, rec(3, Some((1, 0, 1)))));
        recs.extend((0..30).map(|i| (100 + i, rec(4, None))));
        let m = Misses::of(&recs);
        assert_eq!((m.count, m.with_window, m.fresh_pages), (33, 2, 132));
        assert_eq!(
            (m.busy, m.held_live_same_stream, m.held_live_other_stream),
            (4, 3, 1)
        );
        assert_eq!(m.first.len(), LISTED);
        assert_eq!(m.first[0].best_busy, Some([3, 3, 0, 0, 0]));
        assert_eq!((m.first[1].event, m.first[1].best_busy), (11, None));
        let line = m.line();
        assert!(
            line.contains("33 allocations") && line.contains("same stream 75%"),
            "{line}"
        );
        assert!(line.contains("of other streams 25%"), "{line}");
        assert!(Misses::of(&[]).line().contains("no allocation"));
    }
}
