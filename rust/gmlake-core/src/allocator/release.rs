//! Returning memory: empty_cache, autoGC, and evicting kept aliases.

use super::*;

impl State {
    /// After a stitch: if more than autoGC bytes sit in free mapped blocks, retire the
    /// largest cached ranges (and every alias of their pages) for release until below the
    /// threshold.
    pub(super) fn maybe_auto_gc<D: Device>(&mut self, dev: &D) -> Result<()> {
        let Some(limit) = self.cfg.auto_gc_bytes else {
            return Ok(());
        };
        let cached = |s: &State| s.arenas.iter().map(|a| a.free_mapped_bytes).sum::<u64>();
        let mut batch = RetiredBatch::default();
        while cached(self) > limit {
            self.settle_arenas();
            let Some((src, addr, _)) = self.largest_source(
                self.arenas
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.stealable_pages > 0 && self.pool_may_give(a)),
                &|_, _| false,
            ) else {
                break;
            };
            let (start, handles) =
                self.with_arena(src, |a| a.take_pages(addr, u64::MAX, Take::Retire));
            if handles.is_empty() {
                break;
            }
            self.retire_pages(&mut batch, src, start, handles);
        }
        self.retire_aliases(&mut batch);
        self.record_retired(dev, batch)
    }

    /// Puts `handles`, just taken with `Take::Retire` from arena `aid` at `start`, into
    /// `batch` for unmapping and release.
    pub(super) fn retire_pages(
        &mut self,
        batch: &mut RetiredBatch,
        aid: u32,
        start: u64,
        handles: Vec<PhysHandle>,
    ) {
        let a = &self.arenas[aid as usize];
        let (kind, page) = (a.key.kind, a.page());
        self.move_pages(kind, PoolKind::Large, handles.len() as u64, page);
        for h in &handles {
            self.book.home.remove(h);
        }
        batch.ranges.push((aid, start, handles.len() as u64));
        batch.release.extend(handles);
    }

    /// A page is released only once every mapping of it is gone: retires, into `batch`,
    /// every alias of the pages it releases.
    pub(super) fn retire_aliases(&mut self, batch: &mut RetiredBatch) {
        if batch.release.is_empty() {
            return;
        }
        // A set: a page listed twice must not have its aliases retired twice.
        let doomed: FxHashSet<PhysHandle> = batch.release.iter().copied().collect();
        for aid in 0..self.arenas.len() as u32 {
            let a = &self.arenas[aid as usize];
            if a.lent_pages() == 0 {
                continue;
            }
            // In address order, as the ranges to unmap always were.
            let mut aliases: Vec<(u64, PhysHandle)> = a.lent_of(&doomed).collect();
            aliases.sort_unstable();
            for (va, _) in aliases {
                self.with_arena(aid, |a| a.retire_lent(va, 1));
                batch.ranges.push((aid, va, 1));
            }
        }
    }

    /// Pages of aliases that may be kept: `max_aliases` times the pages held, and at least
    /// `alias_floor` bytes of them; 0 keeps none. The floor is what small jobs meet: one of
    /// 2.5 GiB whose shapes vary (FSDP2 on two GPUs, `tests/traces/fsdp2-2rank-rank0.pickle.gz`)
    /// evicted aliases at every step under an 8 GiB floor and stitched the same windows
    /// again, 180 unmaps and maps a step on the GPU; under 128 GiB it keeps them all (replay
    /// of the whole 300-step run: 64% fewer driver calls in its second half, same
    /// utilization).
    fn alias_cap(&self) -> u64 {
        if self.cfg.max_aliases <= 0.0 {
            return 0;
        }
        let by_ratio = (self.book.physical as f64 * self.cfg.max_aliases) as u64;
        // In pages of the current size (after a page-size upgrade, the old generation's
        // aliases count as pages too: they drain with it).
        by_ratio.max(self.cfg.alias_floor / self.page)
    }

    /// Unmaps the oldest kept aliases (behind an event on their stream: a kernel queued
    /// before the page was lent may still use the old address) while more are kept than
    /// `alias_cap` allows.
    pub(super) fn enforce_alias_limit<D: Device>(&mut self, dev: &D) -> Result<()> {
        let lent: u64 = self.arenas.iter().map(Arena::lent_pages).sum();
        let cap = self.alias_cap();
        if lent <= cap {
            return Ok(());
        }
        let mut excess = lent - cap;
        let mut batch = RetiredBatch::default();
        while excess > 0 {
            let oldest = self
                .arenas
                .iter()
                .enumerate()
                .filter_map(|(i, a)| a.oldest_lent().map(|(t, addr, n)| (t, i as u32, addr, n)))
                .min();
            let Some((_, aid, addr, n)) = oldest else {
                break;
            };
            let k = n.min(excess);
            let got = self.with_arena(aid, |a| a.retire_lent(addr, k));
            if got.is_empty() {
                break;
            }
            let page = self.arenas[aid as usize].page();
            let gone: Vec<(u32, u64, PhysHandle)> = got
                .iter()
                .enumerate()
                .map(|(i, &h)| (aid, addr + i as u64 * page, h))
                .collect();
            self.forget_primaries(&gone);
            batch.ranges.push((aid, addr, k));
            self.stats.alias_evictions += k;
            excess -= k;
        }
        self.record_retired(dev, batch)
    }

    /// Whether some lent block still maps `h`. O(arenas).
    pub(super) fn is_aliased(&self, h: PhysHandle) -> bool {
        self.arenas.iter().any(|a| a.aliases(h))
    }

    /// Takes every whole free page of the free mapped block of arena `aid` with the most of
    /// them (`take`: retired or unmapped there): (first page address, handles); None when
    /// no free block holds a whole page.
    pub(super) fn take_largest_free(
        &mut self,
        aid: u32,
        take: Take,
    ) -> Option<(u64, Vec<PhysHandle>)> {
        // Each take changes the arena's index of blocks by interior pages.
        self.arenas[aid as usize].settle();
        let (_, addr) = self.arenas[aid as usize].largest()?;
        let (start, handles) = self.with_arena(aid, |a| a.take_pages(addr, u64::MAX, take));
        (!handles.is_empty()).then_some((start, handles))
    }

    /// empty_cache: after waiting for the device, every alias is unmapped, every free page
    /// goes back to the device and empty virtual chunks are freed.
    pub(super) fn release_cached<D: Device>(&mut self, dev: &D) -> Result<()> {
        self.synchronize_all(dev)?;
        self.flush_quick()?;
        for aid in 0..self.arenas.len() as u32 {
            let page = self.arenas[aid as usize].page();
            let aliases = self.with_arena(aid, Arena::drain_lent);
            for &(va, _) in &aliases {
                drv!(self, unmap, dev.unmap(va, page as usize))?;
            }
            let gone: Vec<(u32, u64, PhysHandle)> =
                aliases.into_iter().map(|(va, h)| (aid, va, h)).collect();
            self.forget_primaries(&gone);
        }
        for h in std::mem::take(&mut self.book.spare) {
            self.release_page(dev, h)?;
        }
        for aid in 0..self.arenas.len() as u32 {
            if !self.pool_released(&self.arenas[aid as usize]) {
                continue;
            }
            let key = self.arenas[aid as usize].key;
            let page = self.arenas[aid as usize].page();
            while let Some((start, handles)) = self.take_largest_free(aid, Take::Unmap) {
                let n = handles.len() as u64;
                self.move_pages(key.kind, PoolKind::Large, n, page);
                for (i, h) in handles.into_iter().enumerate() {
                    drv!(
                        self,
                        unmap,
                        dev.unmap(start + i as u64 * page, page as usize)
                    )?;
                    self.book.home.remove(&h);
                    self.release_page(dev, h)?;
                }
                self.trace(TraceAction::SegmentUnmap, start, n * page, key.stream);
            }
            for (start, len) in self.arenas[aid as usize].drain_empty_chunks() {
                drv!(self, free_va, dev.free_va(start, len as usize))?;
                self.chunk_owner.remove(&start);
            }
        }
        Ok(())
    }
}
