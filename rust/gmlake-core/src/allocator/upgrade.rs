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
//! a training job, everything it holds is in large pages. The replay's model of this
//! (`gmlake replay --upgrade-pages`, two allocators side by side) kept every bundled trace
//! at 0.97 utilization or above with a threshold of 1-2 GiB (docs/design.md).
//!
//! Invariants (checked by `verify`): an arena's pages are of its generation's size; the
//! pages of the old generation are the ones in `PageBook::old`; spares are of the current
//! size.

use super::*;

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

    /// Moves to the next page generation: new memory gets `page_upgrade_size` pages. The
    /// spare pages and the free pages of the old generation go back to the device. Called
    /// with no graph capture under way (events are recorded).
    pub(super) fn upgrade_pages<D: Device>(&mut self, dev: &D) -> Result<()> {
        let Some((_, page)) = self.upgrade.take() else {
            return Ok(());
        };
        // Every page held now is of the old size: active (`home`), spare, or waiting for
        // release (the `PageBook` invariant).
        let mut old: FxHashSet<PhysHandle> = self.book.home.keys().copied().collect();
        old.extend(self.book.spare.iter().copied());
        old.extend(self.retired.iter().flat_map(|b| b.release.iter().copied()));
        tracing::info!(
            from = self.page,
            to = page,
            held = self.book.bytes,
            "gmlake: page-size upgrade"
        );
        self.book.old = old;
        self.book.old_page = self.page;
        self.page = page;
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
