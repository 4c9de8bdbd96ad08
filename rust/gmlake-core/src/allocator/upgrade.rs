//! The page-size upgrade (`page_upgrade_at`, `page_upgrade_size`, `page_upgrade_remap`).
//!
//! The driver charges per page, so large jobs want large pages; small ones lose utilization
//! with them (a partly used page is held whole). The job's scale is not known before its
//! first page, so the allocator learns it: it starts with the first page size, and once it
//! holds `page_upgrade_at` bytes and has since mapped again `page_upgrade_remap` (2) times
//! what it holds (`upgrade_due`) it moves to the next *generation*. From then on:
//! - new arenas are of the new generation (`ArenaKey::gen`) and map pages of the new size;
//!   every allocation goes to them;
//! - arenas of the old generation only free: each block freed there gives its whole free
//!   pages back to the device (unmapped behind an event on the arena's stream, and
//!   released, as garbage collection does: `drain_old`), with every alias of them;
//! - pages move only within a generation (`State::pool_may_give`), so that one range never
//!   maps pages of two sizes.
//!
//! The old generation thus drains into the new one as its blocks die: after a few steps of
//! a training job, everything it holds is in large pages. The driver-share watch
//! (`watch.rs`) may ask for further generations (`upgrade_to`) in a job whose driver calls
//! keep taking a large share of its time: each old page keeps its generation (hence its
//! size) in `PageBook::old` until released, so generations of several sizes may drain at
//! once; pages move only within the current one. The replay's model of this
//! (`gmlake replay --upgrade-pages`, two allocators side by side) kept every bundled trace
//! at 0.97 utilization or above with a threshold of 1-2 GiB (docs/design.md).
//!
//! Invariants (checked by `verify`): an arena's pages are of its generation's size
//! (`PageBook::gen_page`, one entry a generation, the last the current page); the pages of
//! older generations are the ones in `PageBook::old`, each with its generation; spares are of
//! the current size.

use super::*;

/// An automatic upgrade's page is at most this fraction of the mean large live block.
/// A page partly used at each end of a block is held whole: with blocks of mean size m and
/// pages of p, the pages at the edges of free space hold up to p / (2m) of the live bytes
/// idle. The replay of the bundled traces measured the loss at a twentieth to a fortieth
/// of the page-to-mean ratio, where blocks pack against each other: 0.3-0.4 points at
/// p = m / 11 to m / 15 (ZeRO-3 R, 8 MiB pages for blocks of 89-123 MiB), 0.4-1.6 points at
/// p = m / 3 (DDP, FSDP2, ZeRO-3 LR with 8 MiB pages for blocks of 24-32 MiB; 1-3 points on
/// the GPU), the loss that made twice the page the fixed choice before.
pub(super) const AUTO_PAGE_SHARE: u64 = 10;

/// An automatic upgrade's page is at most this many first pages (8 MiB over 2 MiB). A
/// larger handle costs more per call (`bench/vmm_submap_probe.cu`: a 16 MiB handle's life
/// costs about twice a 2 MiB one's), so each doubling saves less time than calls, and the
/// replay's cost model, which charges every handle alike, overstates it. 8 MiB is the size
/// measured on the GPU for the large jobs (ZeRO-3 R: the allocator's time a step 97 -> 24
/// ms, docs/design.md); 16 MiB cost ZeRO-3 R a further 0.5-0.7 points in the replay.
pub(super) const AUTO_PAGE_MAX: u64 = 4;

/// The page an automatic upgrade (`page_upgrade_size` 0) moves to from pages of `page`: the
/// largest power-of-two multiple of `page`, from twice to `AUTO_PAGE_MAX` times it, that
/// stays within `1 / AUTO_PAGE_SHARE` of the mean size of the large pool's live blocks
/// when they were at their highest (`large_peak`: bytes, blocks). Jobs of large tensors
/// (ZeRO-3 R's 100 MiB blocks) get few handles a step; jobs of many mid-sized tensors (DDP's
/// and FSDP2's 25 MiB) keep twice the page, and their utilization.
pub(super) fn auto_page(page: u64, large_peak: (u64, u64)) -> u64 {
    let (bytes, blocks) = large_peak;
    let fit = bytes.checked_div(blocks).unwrap_or(0) / AUTO_PAGE_SHARE;
    let mut p = 2 * page;
    while p * 2 <= fit && p * 2 <= AUTO_PAGE_MAX * page {
        p *= 2;
    }
    p
}

impl State {
    /// Whether the upgrade is to happen now: the allocator holds `page_upgrade_at` bytes,
    /// no graph capture is under way, and since it first held them it has mapped again
    /// (stitched, or replaced aliases of) `page_upgrade_remap` times the memory it holds.
    /// Rent or buy: a job that keeps re-mapping pays per step what the upgrade costs once
    /// (unmapping and releasing what it holds, then creating and mapping it again: about
    /// twice re-mapping it), so the upgrade is bought once as much has been paid; a job whose
    /// steps repeat with no driver call never pays, and keeps its small pages. In the replay
    /// (docs/design.md) this kept gpt-ckpt, MoE and ZeRO offload at their defaults, where an
    /// upgrade at once cost them up to 0.6 points and added driver calls to drain the first
    /// generation; at 2 rather than 1 the short random runs (the stress trace, the random
    /// mixed pattern) do not switch late and pay for it, and the others switch where they did.
    pub(super) fn upgrade_due(&mut self) -> bool {
        let Some((at, _)) = self.upgrade else {
            return false;
        };
        if self.book.bytes < at || self.captures > 0 {
            return false;
        }
        let mark = *self.remap_mark.get_or_insert(self.remapped);
        // Pages are of the first size until the upgrade.
        let paid = (self.remapped - mark) as f64 * self.page as f64;
        paid >= self.cfg.page_upgrade_remap * self.book.bytes as f64
    }

    /// Moves to the next page generation by the rent-or-buy rule: new memory gets
    /// `page_upgrade_size` pages (0: `auto_page`). Called with no graph capture under way.
    pub(super) fn upgrade_pages<D: Device>(&mut self, dev: &D) -> Result<()> {
        let Some((_, page)) = self.upgrade.take() else {
            return Ok(());
        };
        let page = match page {
            0 => auto_page(self.page, self.large_peak),
            p => p,
        };
        self.upgrade_to(dev, page)
    }

    /// Moves to the next page generation, of `page` bytes a page: the spare pages and the
    /// free pages of every older generation go back to the device, and the pages still in use
    /// there as their blocks are freed. Called with no graph capture under way (events are
    /// recorded). Generations may follow one another (the rent-or-buy upgrade, then the
    /// driver-share watch's, `watch.rs`): each old page keeps its generation, hence its size,
    /// until it is released.
    pub(super) fn upgrade_to<D: Device>(&mut self, dev: &D, page: u64) -> Result<()> {
        // Every page held now and of no older generation is of the current one: active
        // (`home`), spare, or waiting for release (the `PageBook` invariant).
        let gen = self.gen;
        let current = self
            .book
            .home
            .keys()
            .chain(self.book.spare.iter())
            .chain(self.retired.iter().flat_map(|b| b.release.iter()))
            .copied()
            .collect::<Vec<_>>();
        for h in current {
            self.book.old.entry(h).or_insert(gen);
        }
        tracing::info!(
            from = self.page,
            to = page,
            held = self.book.bytes,
            large_peak = ?self.large_peak,
            "gmlake: page-size upgrade"
        );
        self.page = page;
        self.book.gen_page.push(page);
        self.gen += 1;
        self.last_arena = None;
        self.stats.page_upgrades += 1;
        // Spares may still be mapped by aliases: released after those are unmapped.
        let mut batch = RetiredBatch {
            release: std::mem::take(&mut self.book.spare),
            ..RetiredBatch::default()
        };
        self.retire_aliases(&mut batch);
        self.record_retired(dev, batch)?;
        self.drain_old(dev)
    }

    /// Gives the whole free pages of the arenas of older generations back to the device
    /// (behind an event on each arena's stream, with their aliases), and releases what
    /// earlier drains retired once their events have completed. Live CUDA graph pools keep
    /// theirs; during a capture (no events) it waits for a later call.
    pub(super) fn drain_old<D: Device>(&mut self, dev: &D) -> Result<()> {
        if self.captures > 0 {
            self.drain_due = true;
            return Ok(());
        }
        self.drain_due = false;
        self.process_retired(dev, false)?;
        let mut batch = RetiredBatch::default();
        for aid in 0..self.arenas.len() as u32 {
            let a = &self.arenas[aid as usize];
            if a.key.gen == self.gen || !self.pool_released(a) {
                continue;
            }
            self.flush_arena(aid)?;
            while let Some((start, handles)) = self.take_largest_free(aid, Take::Retire) {
                self.stats.pages_drained += handles.len() as u64;
                self.retire_pages(&mut batch, aid, start, handles);
            }
        }
        self.retire_aliases(&mut batch);
        self.record_retired(dev, batch)
    }
}

#[cfg(test)]
mod tests {
    use super::auto_page;

    const MIB: u64 = 1 << 20;

    /// Twice the page when nothing large has lived (or blocks are small), four times at most,
    /// and the mean, not the sum, of the live blocks decides.
    #[test]
    fn auto_page_is_a_tenth_of_the_mean_block_within_two_to_four_pages() {
        let page = 2 * MIB;
        assert_eq!(auto_page(page, (0, 0)), 4 * MIB);
        assert_eq!(auto_page(page, (100 * 25 * MIB, 100)), 4 * MIB);
        assert_eq!(auto_page(page, (79 * MIB, 1)), 4 * MIB);
        assert_eq!(auto_page(page, (10 * 80 * MIB, 10)), 8 * MIB);
        assert_eq!(auto_page(page, (4 * 1024 * MIB, 2)), 8 * MIB);
        assert_eq!(auto_page(64 * MIB, (1 << 40, 1)), 256 * MIB);
    }
}
