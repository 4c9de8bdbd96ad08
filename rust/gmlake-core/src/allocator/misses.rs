//! Why a miss stitched (`Allocator::set_miss_log`): for each allocation that found no kept
//! window it could take, what the best window would have cost. A diagnostic for the steady
//! state's driver calls (`gmlake replay --misses`): where the replay's remaining maps come
//! from, and who holds the pages that kept them from a reuse. Off by default; when on, a miss
//! pays for one more scan. Reading never changes a decision (the scan is `&self`).

use super::*;

/// One allocation that found no kept window it could take, and stitched (or created) a new
/// range instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissRecord {
    /// The allocator's clock at the miss (a tick per allocation and per free; orders
    /// misses; not reset).
    pub stamp: u64,
    pub stream: StreamId,
    /// The request, rounded as served.
    pub size: u64,
    /// Pages a new range would map (the placement's), the alternative a window is weighed
    /// against.
    pub fresh_pages: u64,
    /// The most busy pages a kept window may have and still be taken (a quarter of its
    /// pages, and fewer than half of `fresh_pages`; none under `replace_min_pages`).
    pub max_busy: u64,
    /// The kept window with the fewest busy pages, however many, that a scan from where the
    /// miss's scan stopped finds; `None` when none of the size is kept.
    pub best: Option<MissWindow>,
}

/// The best kept window at a miss, and what holds its busy pages where they are active.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MissWindow {
    pub start: u64,
    /// Its aliases (pages it would take back or replace).
    pub lent_pages: u64,
    /// Those whose page is not free for this stream where it is active (each would be
    /// unmapped and refilled).
    pub busy: u64,
    /// The busy pages, by what holds them: a live block of the same stream, of another
    /// stream; a free block of another stream that may not give to this one yet (no fence
    /// or wait since its free); anything else (a page active inside the window itself, a
    /// block being retired, a free block of a live graph pool or of the old page generation).
    pub held_live_same_stream: u64,
    pub held_live_other_stream: u64,
    pub held_free_unfenced: u64,
    pub held_other: u64,
}

impl State {
    /// The record of a miss of `size` bytes in arena `aid` whose scans (in `view`) took no
    /// window: the best window a scan with no bound on busy pages finds, and its busy pages
    /// by holder. O(one reuse scan).
    pub(super) fn describe_miss(
        &self,
        aid: u32,
        size: u64,
        fresh_pages: u64,
        max_busy: u64,
        view: pages::ReuseView,
    ) -> MissRecord {
        let arena = &self.arenas[aid as usize];
        let stream = arena.key.stream;
        let best = self.find_reuse(aid, size, u64::MAX, view).0.map(|r| {
            let mut w = MissWindow {
                start: r.start,
                lent_pages: (r.lent.len() + r.replace.len()) as u64,
                busy: r.replace.len() as u64,
                ..MissWindow::default()
            };
            for &va in &r.replace {
                let holder = arena
                    .lent_at(va)
                    .and_then(|h| self.book.home.get(&h))
                    .filter(|&&(x, hva)| !(x == aid && hva >= r.start && hva < r.start + size))
                    .and_then(|&(x, hva)| {
                        let a = &self.arenas[x as usize];
                        let (addr, b) = a.block_containing(hva)?;
                        // A page only partly in a free block is held by the live block that
                        // shares it.
                        let last = hva + a.page() - 1;
                        let state = if matches!(b.state, ArenaState::FreeMapped { .. })
                            && last >= addr + b.size
                        {
                            a.block_containing(last)?.1.state
                        } else {
                            b.state
                        };
                        Some((a.key.stream, state, self.pool_may_give(a)))
                    });
                match holder {
                    Some((s, ArenaState::Live, _)) if s == stream => w.held_live_same_stream += 1,
                    Some((_, ArenaState::Live, _)) => w.held_live_other_stream += 1,
                    // Its stream's fence, not its pool, keeps it from this stream.
                    Some((s, ArenaState::FreeMapped { .. }, true)) if s != stream => {
                        w.held_free_unfenced += 1
                    }
                    _ => w.held_other += 1,
                }
            }
            w
        });
        MissRecord {
            stamp: self.now,
            stream,
            size,
            fresh_pages,
            max_busy,
            best,
        }
    }

    /// Keeps `rec` if the miss log is on (the oldest go beyond its capacity).
    pub(super) fn log_miss(&mut self, rec: MissRecord) {
        if self.miss_log_cap == 0 {
            return;
        }
        if self.miss_log.len() == self.miss_log_cap {
            self.miss_log.pop_front();
        }
        self.miss_log.push_back(rec);
    }
}
