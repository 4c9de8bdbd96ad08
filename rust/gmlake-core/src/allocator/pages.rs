//! Page sourcing: spare pages, new pages, stitching pages taken from cached free blocks,
//! reusing kept mappings, and mapping them. `PageBook` owns the accounting of physical pages.

use super::*;

/// Every physical page the allocator created and has not released.
///
/// Invariant (checked by `verify`): each page is in exactly one of: active in one arena at
/// one address (`home` says where, and that arena's page table says the same), spare, or in
/// a retired batch waiting for release; `physical` counts them all and `bytes` sums their
/// sizes. Any page may also be mapped, inactive, at the addresses of lent blocks (aliases)
/// of arenas of its generation, but nothing else. Spares are of the current page size.
#[derive(Default)]
pub(super) struct PageBook {
    pub physical: u64,
    pub bytes: u64,
    /// Pages of the generations before the current one (the page-size upgrades), each with
    /// its generation, until released; every other page is of the current generation.
    pub old: FxHashMap<PhysHandle, u8>,
    /// The page size of each generation so far (`gen_page[g]`; the last is the current one).
    pub gen_page: Vec<u64>,
    /// Created pages mapped nowhere actively (left over when a request failed half way).
    pub spare: Vec<PhysHandle>,
    /// Active page -> (arena, virtual address).
    pub home: FxHashMap<PhysHandle, (u32, u64)>,
    /// Page -> where it was first mapped, while that mapping lives (active or as an alias).
    /// A page active elsewhere is *stitched* there (`Page::stitched`).
    pub primary: FxHashMap<PhysHandle, (u32, u64)>,
}

/// Free blocks of the target arena that start in [lo, hi) give no pages: the request being
/// served covers them. `acquire_pages` first moves `lo` back to the start of the free block
/// that contains it: a kept window's first lent page, once taken back, joins the free block
/// before it, which then starts before the window and would give that very page.
pub(super) type Exclude = (u64, u64);

/// Which pages of other streams' free blocks a kept-window scan counts as free
/// (`State::gives_freed_until`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum ReuseView {
    /// Those of arenas that may give as a whole (`State::may_give`).
    Now,
    /// Also those of blocks whose own free is behind a completed fence or a wait
    /// (`reuse_fenced_blocks`).
    FencedBlocks,
    /// All of them, as after `wait_for_streams`.
    AfterWait,
}

/// A range that a miss can take with no driver call: free mapped blocks and lent pages
/// whose physical pages are free where they are active.
pub(super) struct Reuse {
    pub start: u64,
    /// Lent pages to take back: (address here, handle).
    pub lent: Vec<(u64, PhysHandle)>,
    /// Lent pages whose physical page is busy elsewhere: unmapped, and refilled.
    pub replace: Vec<u64>,
}

/// How a miss polls its stream's pending fence before it gives up a kept window whose busy
/// aliases that fence protects: `REUSE_FENCE_POLLS` queries, `REUSE_FENCE_POLL_GAP` apart (a
/// millisecond or two in all, with the sleep's granularity). The host runs ahead of the GPU,
/// so the fence recorded at the miss is usually pending; the window's alternative, a new
/// range, maps every page of it (25-35 µs a page on a busy H100: `crate::cost`) and lays
/// memory out differently from then on (on the concatenation job one such refusal cost 2% of
/// its peak). The bound keeps a stream that is far behind from stalling the host. A count,
/// not a deadline: polling until a deadline made as many queries as the host could fit in
/// it, so a replay with busy side streams counted a different number of event queries, and
/// estimated a different driver time, from run to run (ZeRO-3 LR: 16,961-22,821 queries, the
/// same maps).
pub(super) const REUSE_FENCE_POLLS: u32 = 20;
pub(super) const REUSE_FENCE_POLL_GAP: std::time::Duration = std::time::Duration::from_micros(50);

/// Lent pages a miss examines at most when looking for a range to reuse: bounds the cost of
/// a miss when many aliases are kept and few are free (random lifetimes); periodic jobs
/// find their ranges well within it. A scan that runs out resumes, at the next miss, where
/// it stopped (`Arena::reuse_cursor`), so that over a few misses every kept range is looked
/// at: restarting at the lowest address each time saw the same few thousand pages, mostly
/// busy, and missed the windows that random lifetimes free elsewhere.
pub(super) const MAX_REUSE_CHECKS: u64 = 4_096;

impl State {
    /// Finds `n` pages for arena `aid`: spare pages, then stitching and new memory in the
    /// order `defragLevel` says. `None` when they cannot all be had now; nothing is lent
    /// then (pages created on the way are kept as spares).
    pub(super) fn acquire_pages<D: Device>(
        &mut self,
        dev: &D,
        n: u64,
        aid: u32,
        size: u64,
        attempt: usize,
        exclude: Exclude,
    ) -> Result<Option<Vec<(PhysHandle, bool)>>> {
        // Its queries search the arena's blocks by address.
        self.arenas[aid as usize].settle_blocks();
        let exclude = (
            self.arenas[aid as usize]
                .free_mapped_start(exclude.0)
                .unwrap_or(exclude.0),
            exclude.1,
        );
        let mut out: Vec<(PhysHandle, bool)> = Vec::with_capacity(n as usize);
        while (out.len() as u64) < n {
            match self.book.spare.pop() {
                Some(h) => out.push((h, false)),
                None => break,
            }
        }
        let need = n - out.len() as u64;
        if need == 0 {
            return Ok(Some(out));
        }
        let level = self.cfg.defrag_level;
        let stitch =
            self.captures == 0 && self.cfg.may_stitch(size) && (level <= 1 || attempt >= 1);
        // `util_target`: new memory first while what is held stays within active / target
        // (creating costs a call per page once; stitching costs a map per page on every
        // miss, and leaves the free space more fragmented, so more misses follow).
        let within_budget = self.cfg.util_target.is_some_and(|t| {
            let active = self.stats.active_bytes.aggregate().current.max(0) as u64 + size;
            (self.book.bytes + need * self.page) as f64 <= active as f64 / t
        });
        let steal_first = stitch && level == 0 && !within_budget;
        let mut avail = if steal_first {
            self.stealable_for(dev, aid, need, exclude)?
        } else {
            0
        };
        let mut steal = need.min(avail);
        // Do not create pages for a request the limit cannot satisfy anyway.
        if let Some(limit) = self.limit {
            let creatable = limit.saturating_sub(self.book.bytes) / self.page;
            let later = if stitch && !steal_first {
                self.stealable_for(dev, aid, need, exclude)?
            } else {
                0
            };
            if steal + creatable + later < need {
                self.book.spare.extend(out.into_iter().map(|p| p.0));
                return Ok(None);
            }
        }
        if need > steal {
            self.release_retired_before_growth(dev, need - steal)?;
        }
        let created = match self.create_pages(dev, need - steal) {
            Ok(c) => c,
            Err(e) => {
                self.book.spare.extend(out.into_iter().map(|p| p.0));
                return Err(e);
            }
        };
        if !created.is_empty() {
            let unfenced = self.unfenced_pages(aid);
            self.stats.pages_created_unfenced += unfenced.min(created.len() as u64);
        }
        let short = need - steal - created.len() as u64;
        if short > 0 && stitch {
            if !steal_first {
                avail = self.stealable_for(dev, aid, short, exclude)?;
            }
            steal += short.min(avail.saturating_sub(steal));
        }
        if steal + (created.len() as u64) < need {
            self.book.spare.extend(out.into_iter().map(|p| p.0));
            self.book.spare.extend(created);
            return Ok(None);
        }
        out.extend(created.into_iter().map(|h| (h, false)));
        if steal > 0 {
            let stolen = self.stitch_pages(dev, steal, aid, exclude)?;
            out.extend(stolen.into_iter().map(|h| (h, true)));
        }
        Ok(Some(out))
    }

    /// Pages retired by a drain (the page-size upgrade's, garbage collection's) are held
    /// until the work queued before their event is done. Creating pages meanwhile holds both:
    /// on the GPU a job that switched page sizes in the middle of a step grew its new
    /// generation while the old one's freed pages waited, and its peak rose by a quarter
    /// (kv_infer: 3.54 GB active, 4.51 GB reserved). So creating `n` pages that would raise
    /// the peak reserved waits for the retired ranges that hold pages, and releases them
    /// first: the host waits for the device (only while something retired is pending, and
    /// only at a new peak), as native's allocator synchronizes before it frees its cache.
    /// The peak is the statistic's, so after `reset_peak_memory_stats` any growth with
    /// something pending waits once: a wait, never a wrong release.
    pub(super) fn release_retired_before_growth<D: Device>(
        &mut self,
        dev: &D,
        n: u64,
    ) -> Result<()> {
        if self.captures > 0 || !self.retired_holds_pages() {
            return Ok(());
        }
        let peak = self.stats.reserved_bytes.aggregate().peak.max(0) as u64;
        if self.book.bytes + n * self.page <= peak {
            return Ok(());
        }
        // Completed ones first: no wait where the device is done already.
        self.process_retired(dev, false)?;
        if !self.retired_holds_pages() {
            return Ok(());
        }
        self.stats.retired_waits += 1;
        self.complete_retired(dev)
    }

    /// Creates up to `n` pages, stopping at the limit or when the device is full.
    pub(super) fn create_pages<D: Device>(&mut self, dev: &D, n: u64) -> Result<Vec<PhysHandle>> {
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            if self.limit.is_some_and(|l| self.book.bytes + self.page > l) {
                break;
            }
            match drv!(
                self,
                create_physical,
                dev.create_physical(self.page as usize)
            ) {
                Ok(h) => {
                    self.book.physical += 1;
                    self.book.bytes += self.page;
                    self.stats.num_device_alloc += 1;
                    self.stats
                        .reserved_bytes
                        .increase(PoolKind::Large, self.page as i64);
                    self.stats.segment.increase(PoolKind::Large, 1);
                    out.push(h);
                }
                Err(DeviceError::OutOfMemory) => break,
                Err(e) => {
                    self.book.spare.extend(out);
                    return Err(e.into());
                }
            }
        }
        Ok(out)
    }

    /// Gives a page back to the device. It must be mapped nowhere: neither active nor as an
    /// alias.
    pub(super) fn release_page<D: Device>(&mut self, dev: &D, h: PhysHandle) -> Result<()> {
        drv!(self, release_physical, dev.release_physical(h))?;
        let size = self.page_bytes(h);
        self.book.old.remove(&h);
        self.book.primary.remove(&h);
        self.book.physical -= 1;
        self.book.bytes -= size;
        self.stats.num_device_free += 1;
        self.stats
            .reserved_bytes
            .decrease(PoolKind::Large, size as i64);
        self.stats.segment.decrease(PoolKind::Large, 1);
        Ok(())
    }

    /// Pages that arena `aid` may take from free mapped blocks: same stream at once, other
    /// streams once fenced, never from a live graph pool. Refreshes fences of other streams
    /// only when the same stream cannot cover `want`.
    pub(super) fn stealable_for<D: Device>(
        &mut self,
        dev: &D,
        aid: u32,
        want: u64,
        exclude: Exclude,
    ) -> Result<u64> {
        let target = self.arenas[aid as usize].key;
        let excluded = self.arenas[aid as usize].free_interior_in(exclude.0, exclude.1);
        let same: u64 = self
            .arenas
            .iter()
            .filter(|a| a.key.stream == target.stream && self.pool_may_give(a))
            .map(|a| a.stealable_pages)
            .sum::<u64>()
            .saturating_sub(excluded);
        if same >= want {
            return Ok(same);
        }
        self.refresh_fences(dev, target.stream)?;
        let fenced = |st: &State| -> u64 {
            st.arenas
                .iter()
                .filter(|a| a.key.stream != target.stream && st.may_give(a, target.stream))
                .map(|a| a.stealable_pages)
                .sum()
        };
        let mut other = fenced(self);
        if same + other < want && self.cfg.cross_stream_wait && self.captures == 0 {
            self.wait_for_streams(dev, target.stream)?;
            other = fenced(self);
        }
        Ok(same + other)
    }

    /// `wait_to_reuse` (with `cross_stream_wait`), for a miss of `size` bytes in arena `aid`
    /// that found no kept window to reuse and would map `fresh` pages: whether the stitch to
    /// come will wait on the device for other streams (the pages it may take at once, this
    /// stream's and those of fenced streams, after refreshing the fences as `stealable_for`
    /// does, fall short of `fresh`) and a kept window would be reusable after that wait with
    /// no busy page: that window, to take once `wait_for_streams` has made the wait (which
    /// fences exactly the arenas it counted as giving). The stitch would otherwise take those
    /// same free pages into a new range (a
    /// map and an access grant each, an unmap later), where after the wait the window is
    /// taken as it is. Only where the stitch waits anyway: a wait the stitch would not make
    /// orders this stream behind the others' queued work (FSDP2's prefetching all-gathers
    /// behind its compute), and a first version that waited for any such window made FSDP2's
    /// replay 2.8 times as costly in driver time.
    pub(super) fn window_after_wait<D: Device>(
        &mut self,
        dev: &D,
        aid: u32,
        size: u64,
        fresh: u64,
    ) -> Result<Option<Reuse>> {
        let stream = self.arenas[aid as usize].key.stream;
        if !(self.cfg.cross_stream_wait && self.cfg.wait_to_reuse) {
            return Ok(None);
        }
        // As `stealable_for`: this stream's pages first, with no refresh and no wait.
        let takeable = |st: &State| -> u64 {
            st.arenas
                .iter()
                .filter(|a| st.may_give(a, stream))
                .map(|a| a.stealable_pages)
                .sum::<u64>()
                + st.book.spare.len() as u64
        };
        if takeable(self) >= fresh {
            return Ok(None);
        }
        self.refresh_fences(dev, stream)?;
        if takeable(self) >= fresh || !self.has_unfenced_pages(stream) {
            return Ok(None);
        }
        Ok(self.find_reuse(aid, size, 0, ReuseView::AfterWait).0)
    }

    /// `reuse_fenced_blocks`, for a miss of `size` bytes in arena `aid` whose scan (already
    /// counting the pages of other streams' free blocks whose own free is behind a completed
    /// fence, `ReuseView::FencedBlocks`) found no kept window with at most `max_busy` busy
    /// pages: brings the other streams' fences up to date (`refresh_fences`: an event query,
    /// and a record where none is pending; no wait) and, if a fence completed, scans again.
    /// Safe as `may_give` is: the fence's event was recorded on the block's stream after the
    /// block was freed there, and it has completed, so no queued work of that stream still
    /// uses the block. Only after a failed scan, and only where such pages exist: the refresh
    /// is two event calls a stream.
    pub(super) fn reuse_fenced_blocks<D: Device>(
        &mut self,
        dev: &D,
        aid: u32,
        size: u64,
        max_busy: u64,
    ) -> Result<Option<Reuse>> {
        let stream = self.arenas[aid as usize].key.stream;
        if self.arenas[aid as usize].lent_pages() == 0 || !self.has_unfenced_pages(stream) {
            return Ok(None);
        }
        // A refresh that completed no fence leaves the scan's answer as it was.
        if !self.refresh_fences(dev, stream)? {
            return Ok(None);
        }
        let (found, cursor) = self.find_reuse(aid, size, max_busy, ReuseView::FencedBlocks);
        self.arenas[aid as usize].reuse_cursor = cursor;
        if found.is_some() {
            self.stats.reuses_fenced_blocks += 1;
        }
        Ok(found)
    }

    /// `cross_stream_wait`: makes `stream` wait on the device for an event recorded now on
    /// every other stream whose free pages it may not take yet, so that it may: its later work
    /// runs after theirs (`waited`). A device without the call, or a failed call, leaves
    /// things as they were: the miss creates memory instead.
    pub(super) fn wait_for_streams<D: Device>(&mut self, dev: &D, stream: StreamId) -> Result<()> {
        let mut others: Vec<StreamId> = self
            .unfenced_arenas(stream)
            .filter(|a| a.stealable_pages > 0)
            .map(|a| a.key.stream)
            .collect();
        others.sort_unstable();
        others.dedup();
        for other in others {
            let e = self.get_event(dev)?;
            let waited = drv!(self, record_event, dev.record_event(e, other))
                .and_then(|()| drv!(self, stream_wait, dev.stream_wait_event(stream, e)));
            // The wait keeps the record it saw: the event may be recorded again at once.
            self.event_pool.push(e);
            match waited {
                Ok(()) => {
                    let now = self.now;
                    let w = self.waited.entry((stream, other)).or_insert(0);
                    *w = (*w).max(now);
                }
                Err(err) => {
                    self.stats.stream_waits_failed += 1;
                    tracing::debug!("gmlake: no cross-stream wait: {err}");
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Arenas of other streams whose free pages `stream` may not take yet: their fences are
    /// pending and `stream` has not waited for them since their last free.
    pub(super) fn unfenced_arenas(&self, stream: StreamId) -> impl Iterator<Item = &Arena> + '_ {
        self.arenas.iter().filter(move |a| {
            a.key.stream != stream && self.pool_may_give(a) && !self.may_give(a, stream)
        })
    }

    /// Whether some other stream's free blocks hold pages that `stream` may not take yet (a
    /// wait for those streams would give it more). O(arenas).
    pub(super) fn has_unfenced_pages(&self, stream: StreamId) -> bool {
        self.unfenced_arenas(stream).any(|a| a.stealable_pages > 0)
    }

    /// Takeable pages of other streams' free blocks that arena `aid` may not take yet. For
    /// statistics; O(arenas).
    fn unfenced_pages(&self, aid: u32) -> u64 {
        let stream = self.arenas[aid as usize].key.stream;
        self.unfenced_arenas(stream)
            .map(|a| a.stealable_pages)
            .sum()
    }

    /// Pages of this arena may be taken: it is of the current page generation (new ranges
    /// are, and one range maps pages of one size) and no live CUDA graph pool.
    pub(super) fn pool_may_give(&self, a: &Arena) -> bool {
        a.key.gen == self.gen && self.pool_released(a)
    }

    /// The arena is no live CUDA graph pool: its free pages may go back to the device.
    pub(super) fn pool_released(&self, a: &Arena) -> bool {
        a.key.graph_pool == GraphPoolId::DEFAULT || self.released_pools.contains(&a.key.graph_pool)
    }

    /// The size of page `h`, held now.
    pub(super) fn page_bytes(&self, h: PhysHandle) -> u64 {
        match self.book.old.get(&h) {
            Some(&g) => self.book.gen_page[g as usize],
            None => self.page,
        }
    }

    /// Pages of this arena may be taken for `stream`: same stream, or fenced since its last
    /// free, or `stream` waits (on the device) for the arena's stream since its last free.
    pub(super) fn may_give(&self, a: &Arena, stream: StreamId) -> bool {
        self.gives_freed_until(a, stream, ReuseView::Now).is_some()
    }

    /// The latest free stamp of stream `other` whose pages `stream` may take: every free of
    /// `other` stamped at or before it is behind a completed fence of `other`, or behind a
    /// wait of `stream` for `other`; `None` where `other` has no fence and `stream` never
    /// waited for it.
    fn covered_until(&self, other: StreamId, stream: StreamId) -> Option<u64> {
        let fenced = self.fences.get(&other).map(|f| f.completed);
        let waited = self.waited.get(&(stream, other)).copied();
        fenced.max(waited)
    }

    /// How a kept-window scan (`find_reuse`) decides that another stream's free block may
    /// give its pages to `stream`: the free blocks of arena `a` freed at or before the stamp
    /// returned may (`u64::MAX`: all of them; `None`: none).
    /// - `ReuseView::Now`: all of them where the arena may give as a whole (`may_give` is
    ///   this view);
    /// - `ReuseView::FencedBlocks` (`reuse_fenced_blocks`): also those whose own free is
    ///   covered (`covered_until`), where the arena's last free is not;
    /// - `ReuseView::AfterWait`: all of them, as if `stream` had waited for every other
    ///   stream (`wait_for_streams` makes every arena of the current generation that is no
    ///   live graph pool give).
    fn gives_freed_until(&self, a: &Arena, stream: StreamId, view: ReuseView) -> Option<u64> {
        if !self.pool_may_give(a) {
            return None;
        }
        if view == ReuseView::AfterWait || a.key.stream == stream {
            return Some(u64::MAX);
        }
        let covered = self.covered_until(a.key.stream, stream)?;
        if a.last_free <= covered {
            Some(u64::MAX)
        } else {
            (view == ReuseView::FencedBlocks).then_some(covered)
        }
    }

    /// Applies every arena's deferred index changes (`Arena::settle`): before the queries of
    /// blocks by interior pages that choose where pages come from.
    pub(super) fn settle_arenas(&mut self) {
        for a in &mut self.arenas {
            a.settle();
        }
    }

    /// Chooses the next block to take pages from, by strategy: (arena, block, pages there).
    /// The arenas are settled (`settle_arenas`). With `stitch_tails_last`, blocks right after
    /// a live block (a run's tail) are chosen only when no other block will do.
    pub(super) fn choose_source(
        &self,
        aid: u32,
        need: u64,
        exclude: Exclude,
    ) -> Option<(u32, u64, u64)> {
        if self.cfg.stitch_tails_last {
            if let Some(found) = self.choose_source_among(aid, need, exclude, true) {
                return Some(found);
            }
        }
        self.choose_source_among(aid, need, exclude, false)
    }

    /// `choose_source`, passing over tails when `spare_tails`.
    fn choose_source_among(
        &self,
        aid: u32,
        need: u64,
        exclude: Exclude,
        spare_tails: bool,
    ) -> Option<(u32, u64, u64)> {
        let target = self.arenas[aid as usize].key.stream;
        let skip = |i: usize, addr: u64| {
            (i == aid as usize && addr >= exclude.0 && addr < exclude.1)
                || (spare_tails && self.arenas[i].after_live(addr))
        };
        let candidates = self
            .arenas
            .iter()
            .enumerate()
            .filter(|(_, a)| a.stealable_pages > 0 && self.may_give(a, target));
        let mut best: Option<(u64, u32, u64, u64)> = None; // (rank, arena, addr, pages)
        let better =
            |best: &Option<(u64, u32, u64, u64)>, rank: u64| best.is_none_or(|b| rank < b.0);
        match self.cfg.stitch_strategy {
            StitchStrategy::BestFit => {
                // Smallest block covering the whole need...
                for (i, a) in candidates.clone() {
                    let mut from = need;
                    while let Some((p, addr)) = a.smallest_with(from) {
                        if !skip(i, addr) {
                            if better(&best, p) {
                                best = Some((p, i as u32, addr, p));
                            }
                            break;
                        }
                        from = p + 1;
                    }
                }
                if best.is_some() {
                    return best.map(|b| (b.1, b.2, b.3));
                }
                // ...else the largest, so the stitch has as few pieces as possible.
                self.largest_source(candidates, &skip)
            }
            StitchStrategy::LargestFirst => self.largest_source(candidates, &skip),
            StitchStrategy::Lru => {
                for (i, a) in candidates.clone() {
                    if !a.tracks_age() {
                        continue;
                    }
                    if let Some((freed, addr)) = a.oldest() {
                        let addr = if skip(i, addr) {
                            continue;
                        } else {
                            addr
                        };
                        let b = a.block(addr).map_or(0, |b| b.size);
                        let p = a.interior(addr, b).1;
                        if better(&best, freed) {
                            best = Some((freed, i as u32, addr, p));
                        }
                    }
                }
                best.map(|b| (b.1, b.2, b.3))
                    .or_else(|| self.largest_source(candidates, &skip))
            }
        }
    }

    pub(super) fn largest_source<'a>(
        &self,
        candidates: impl Iterator<Item = (usize, &'a Arena)>,
        skip: &impl Fn(usize, u64) -> bool,
    ) -> Option<(u32, u64, u64)> {
        let mut best: Option<(u64, u32, u64)> = None;
        for (i, a) in candidates {
            // The excluded block may be the largest: look at the next one then.
            let mut it = a.largest();
            while let Some((p, addr)) = it {
                if !skip(i, addr) {
                    if best.is_none_or(|b| p > b.0) {
                        best = Some((p, i as u32, addr));
                    }
                    break;
                }
                it = a.largest_below(p, addr);
            }
        }
        best.map(|b| (b.1, b.2, b.0))
    }

    /// Takes `k` pages from free mapped blocks for arena `aid` (the caller checked they are
    /// available). Their old ranges stay mapped as lent blocks, for later reuse.
    pub(super) fn stitch_pages<D: Device>(
        &mut self,
        dev: &D,
        k: u64,
        aid: u32,
        exclude: Exclude,
    ) -> Result<Vec<PhysHandle>> {
        let mut got: Vec<PhysHandle> = Vec::with_capacity(k as usize);
        while (got.len() as u64) < k {
            self.settle_arenas();
            let Some((src, addr, _)) = self.choose_source(aid, k - got.len() as u64, exclude)
            else {
                break;
            };
            let want = k - got.len() as u64;
            // Counted as mapped nowhere (large) until `map_pages` maps them in the target arena
            // and moves their count to its pool (counting them in the target here counted them
            // twice there when the pools differ).
            let handles = self.lend_pages(src, addr, want, PoolKind::Large);
            if handles.is_empty() {
                break;
            }
            got.extend(handles);
        }
        self.stats.stitches += 1;
        self.stats.pages_stitched += got.len() as u64;
        self.remapped += got.len() as u64;
        if (got.len() as u64) < k {
            // Not reached when stealable_for counted right; keep the pages and report.
            self.book.spare.extend(got);
            return Err(Error::InvalidState(
                "stitch found fewer free pages than counted".into(),
            ));
        }
        self.enforce_alias_limit(dev)?;
        self.maybe_auto_gc(dev)?;
        Ok(got)
    }

    /// Whether page `h` may be taken back, with no driver call, for arena `aid` (serving
    /// `stream`): it is active at an interior page of a free mapped block of an arena that
    /// may give to `stream`, outside `avoid` (the region being reused, which it would cut).
    /// `view`: which other streams' free blocks count as free (`gives_freed_until`).
    /// `last` remembers the block it last looked up, (arena, block start, block end, free
    /// mapped), valid while the arenas do not change (one scan): the pages of a kept window
    /// were stitched together, so they are mostly active in one block elsewhere, and
    /// consecutive calls skip the search for it; `&mut None` for a single lookup.
    fn reusable(
        &self,
        h: PhysHandle,
        aid: u32,
        stream: StreamId,
        avoid: (u64, u64),
        view: ReuseView,
        last: &mut Option<(u32, u64, u64, bool)>,
    ) -> bool {
        let Some(&(x, va)) = self.book.home.get(&h) else {
            return false;
        };
        if x == aid && va >= avoid.0 && va < avoid.1 {
            return false;
        }
        let a = &self.arenas[x as usize];
        let Some(until) = self.gives_freed_until(a, stream, view) else {
            return false;
        };
        let free = match *last {
            Some((lx, lo, hi, free)) if lx == x && va >= lo && va < hi => free,
            _ => match a.block_containing(va) {
                Some((addr, b)) => {
                    let free =
                        matches!(b.state, ArenaState::FreeMapped { freed } if freed <= until);
                    *last = Some((x, addr, addr + b.size, free));
                    free
                }
                None => {
                    *last = None;
                    false
                }
            },
        };
        // As `Arena::page_is_free`: the whole page lies in the free mapped block.
        free && last.is_some_and(|(_, _, hi, _)| va + a.page() <= hi)
    }

    /// The range of arena `aid` that `size` bytes should take among its kept mappings: a
    /// window of free mapped blocks and lent pages. Lent pages whose physical page is free
    /// where it is active are taken back with no driver call; lent pages whose page is in
    /// use elsewhere (*busy*) can be replaced: the alias unmapped and another page mapped
    /// there. The window with the fewest busy pages wins (then the fewest pages to move),
    /// if it has at most `max_busy`. O(lent blocks and pages of the arena), bounded by
    /// `MAX_REUSE_CHECKS` (`reuse_checks`); the scan starts at the arena's `reuse_cursor`
    /// and wraps around. With `max_busy` 0, only regions that meet a clean span as long as
    /// `size` (`long_clean_spans`) have their pages classified; the others are walked for
    /// the cursor alone; with no such span at all the scan walks nothing. Also returns where
    /// the next scan should start: the cursor moves only when the bound cut this scan short,
    /// so it stays where it was after a scan that examined nothing.
    ///
    /// `view`: which pages of other streams' free blocks count as free (`gives_freed_until`);
    /// `ReuseView::AfterWait` counts those `stream` may not take yet as if it had waited for
    /// their streams (`wait_for_streams`), to learn whether a wait would make a window
    /// reusable.
    pub(super) fn find_reuse(
        &self,
        aid: u32,
        size: u64,
        max_busy: u64,
        view: ReuseView,
    ) -> (Option<Reuse>, u64) {
        let (found, cursor, walked) = self.find_reuse_with(aid, size, max_busy, view, true);
        if self.check_clean_spans && max_busy == 0 {
            // Tests: the scan that classifies every page must find the same window; and the
            // same cursor, unless the clean spans showed that there was nothing to walk.
            let (full, full_cursor, _) = self.find_reuse_with(aid, size, max_busy, view, false);
            let start = |f: &Option<Reuse>| f.as_ref().map(|r| r.start);
            assert_eq!(
                start(&full),
                start(&found),
                "the clean spans changed a choice for {size} bytes (arena {aid})"
            );
            if walked {
                assert_eq!(
                    full_cursor, cursor,
                    "the clean spans moved the cursor elsewhere"
                );
            }
        }
        (found, cursor)
    }

    /// `find_reuse`; `may_skip`: whether the regions that meet no long enough clean span may
    /// be walked without classifying their pages, and the walk skipped where there is no
    /// such span (false only to check that this changes no choice). Also says whether the
    /// regions were walked.
    fn find_reuse_with(
        &self,
        aid: u32,
        size: u64,
        max_busy: u64,
        view: ReuseView,
        may_skip: bool,
    ) -> (Option<Reuse>, u64, bool) {
        let arena = &self.arenas[aid as usize];
        let stream = arena.key.stream;
        let page = arena.page();
        // Which lent pages are reusable: looked up page by page (the page's home block), or,
        // when the pages that can be free are fewer than the aliases to classify, read from
        // the set of those pages' handles, built once for the scan (on the concatenation
        // trace this took the scans' time down 3x). Both give the same answer: a page is
        // reusable iff it is an interior page of a free mapped block of an arena that may
        // give to `stream` (the scan avoids no range).
        let giving: Vec<(&Arena, u64)> = self
            .arenas
            .iter()
            .filter(|a| a.stealable_pages > 0)
            .filter_map(|a| Some((a, self.gives_freed_until(a, stream, view)?)))
            .collect();
        let free_count: u64 = giving.iter().map(|(a, _)| a.stealable_pages).sum();
        let free_pages: Option<FxHashSet<PhysHandle>> =
            (free_count <= arena.lent_pages()).then(|| {
                let mut set = FxHashSet::default();
                set.reserve(free_count as usize);
                for &(a, until) in &giving {
                    a.free_interior_handles(until, &mut set);
                }
                set
            });
        // (busy, moved, start) of the best window so far.
        let mut best: Option<(u64, u64, u64)> = None;
        let cursor = arena.reuse_cursor;
        // A miss that may take no busy alias (a window under `replace_min_pages`) can only
        // take a clean window, one in a clean span around the aliases of free pages. The
        // scan below classifies the pages of the regions that meet a clean span as long as
        // the request, and only walks the others to move the cursor as a full scan would
        // (so that no window and no cursor changes); with no such span it walks nothing. A
        // miss with no clean window classified up to 4,096 aliases for nothing, 50-70 µs,
        // three quarters of the core's time on the concatenation trace. (Ranking clean
        // windows over the whole arena instead was tried: docs/design.md.)
        let long_spans = free_pages
            .as_ref()
            .filter(|_| may_skip && max_busy == 0)
            .map(|set| long_clean_spans(arena, set, size));
        // No clean window anywhere: nothing to walk, and the cursor stays (the scan examined
        // nothing). Walking the regions only to move the cursor, as every such miss did, was
        // two thirds of the misses' time on the concatenation trace (a walk of thousands of
        // kept pages' blocks each, mostly cache misses), where most misses have no clean span
        // as long as the request (docs/design.md, "A miss with no clean span walks nothing").
        if long_spans.as_ref().is_some_and(Vec::is_empty) {
            return (None, cursor, false);
        }
        // Regions holding lent blocks, in address order from the cursor, then from the
        // lowest address up to the cursor.
        let mut next_cursor = cursor;
        let mut wrapped = cursor == 0;
        let mut regions = arena.lent_regions_from(cursor);
        let mut checked = 0u64;
        // Buffers reused region after region.
        let mut region: Vec<(u64, crate::arena::Block)> = Vec::new();
        let mut units: Vec<(u64, u64, u8)> = Vec::new(); // (addr, len, 0 free/1 reusable/2 busy)
        loop {
            let laddr = match regions.next_into(&mut region) {
                Some(a) if !(wrapped && a >= cursor && cursor > 0) => a,
                _ if !wrapped => {
                    wrapped = true;
                    regions = arena.lent_regions_from(0);
                    continue;
                }
                _ => break,
            };
            if checked > self.reuse_checks {
                next_cursor = laddr;
                break;
            }
            checked += region.len() as u64;
            let (Some(&(rstart, _)), Some(&(last, lb))) = (region.first(), region.last()) else {
                break;
            };
            let rend = last + lb.size;
            if rend - rstart < size {
                continue;
            }
            // Every page of a lent block is an alias (I3): the bound counts them all, whether
            // the region is classified or only walked.
            checked += region
                .iter()
                .filter(|(_, b)| !matches!(b.state, ArenaState::FreeMapped { .. }))
                .map(|(_, b)| b.size / page)
                .sum::<u64>();
            let meets_a_span = |spans: &Vec<(u64, u64)>| {
                let i = spans.partition_point(|&(_, e)| e <= rstart);
                spans.get(i).is_some_and(|&(s, _)| s < rend)
            };
            if long_spans.as_ref().is_some_and(|v| !meets_a_span(v)) {
                continue;
            }
            // Units: free mapped blocks (cost 0), lent pages: reusable (0) or busy (1).
            units.clear();
            let mut last = None;
            for &(addr, b) in &region {
                if matches!(b.state, ArenaState::FreeMapped { .. }) {
                    units.push((addr, b.size, 0));
                    continue;
                }
                for (va, h) in arena.lent_in(addr, addr + b.size) {
                    let reusable = match &free_pages {
                        Some(set) => {
                            let r = set.contains(&h);
                            debug_assert_eq!(
                                r,
                                self.reusable(h, aid, stream, (0, 0), view, &mut None),
                                "the free-page set disagrees with the lookup for {h:?}"
                            );
                            r
                        }
                        None => self.reusable(h, aid, stream, (0, 0), view, &mut last),
                    };
                    let kind = if reusable { 1 } else { 2 };
                    units.push((va, page, kind));
                }
            }
            // Windows start at each unit; two pointers keep the busy and moved counts.
            let (mut j, mut busy, mut moved) = (0usize, 0u64, 0u64);
            for i in 0..units.len() {
                let ws = units[i].0;
                if rend - ws < size {
                    break;
                }
                while j < units.len() && units[j].0 < ws + size {
                    match units[j].2 {
                        1 => moved += 1,
                        2 => busy += 1,
                        _ => {}
                    }
                    j += 1;
                }
                let better = best.is_none_or(|b| (busy, moved) < (b.0, b.1));
                if moved + busy > 0 && busy <= max_busy && better {
                    best = Some((busy, moved, ws));
                }
                match units[i].2 {
                    1 => moved -= 1,
                    2 => busy -= 1,
                    _ => {}
                }
            }
            if best.is_some_and(|b| b.0 == 0) {
                break;
            }
        }
        let Some((_, _, start)) = best else {
            return (None, next_cursor, true);
        };
        // The window's lent pages, classified again with the exact window: a page active
        // inside the window cannot be taken from there, so its alias is replaced.
        let end = start + size;
        let mut r = Reuse {
            start,
            lent: Vec::new(),
            replace: Vec::new(),
        };
        let mut taken: FxHashSet<PhysHandle> = FxHashSet::default();
        for va in (start & !(page - 1)..end).step_by(page as usize) {
            if let Some(h) = arena.lent_at(va) {
                if taken.insert(h) && self.reusable(h, aid, stream, (start, end), view, &mut None) {
                    r.lent.push((va, h));
                } else {
                    r.replace.push(va);
                }
            }
        }
        (Some(r), next_cursor, true)
    }

    /// Makes the window of `r` mapped free space of arena `aid`: takes its reusable lent
    /// pages back from where they are active (no driver call), and replaces its busy aliases
    /// (unmap, then map a page found as for a stitch). False, with nothing changed, when a
    /// busy alias may still be used by queued work (its stream's fence has not passed the
    /// time it was lent); false too when no page can be had for a replaced alias (the window
    /// is then left partly unmapped, which is a valid state).
    pub(super) fn apply_reuse<D: Device>(
        &mut self,
        dev: &D,
        aid: u32,
        r: &Reuse,
        size: u64,
    ) -> Result<bool> {
        let stream = self.arenas[aid as usize].key.stream;
        if !r.replace.is_empty() {
            let since = r
                .replace
                .iter()
                .filter_map(|&va| self.arenas[aid as usize].lent_since(va))
                .max()
                .unwrap_or(0);
            if !self.own_stream_done_since(dev, stream, since)?
                && !self.await_own_fence(dev, stream, since)?
            {
                self.stats.reuses_unfenced += 1;
                return Ok(false);
            }
        }
        let now = self.now;
        let kind = self.arenas[aid as usize].key.kind;
        for &(va, h) in &r.lent {
            let Some(&(x, hva)) = self.book.home.get(&h) else {
                return Err(Error::InvalidState(format!(
                    "reuse of page {h:?} that is active nowhere"
                )));
            };
            if self.with_arena(x, |a| a.lend_page_at(hva, now)) != Some(h) {
                return Err(Error::InvalidState(format!(
                    "reuse of page {h:?}: not free at {hva:#x}"
                )));
            }
            let xkind = self.arenas[x as usize].key.kind;
            self.move_pages(xkind, kind, 1, self.arenas[x as usize].page());
            let stitched = self.book.primary.get(&h) != Some(&(aid, va));
            self.with_arena(aid, |a| a.claim_lent(va, now, stitched));
            self.book.home.insert(h, (aid, va));
        }
        self.stats.stitch_reuses += 1;
        self.stats.pages_reused += r.lent.len() as u64;
        if r.replace.is_empty() {
            return Ok(true);
        }
        let page = self.arenas[aid as usize].page();
        let mut gone = Vec::with_capacity(r.replace.len());
        for &va in &r.replace {
            if let Some(h) = self.with_arena(aid, |a| a.unmap_lent_page(va)) {
                drv!(self, unmap, dev.unmap(va, page as usize))?;
                gone.push((aid, va, h));
            }
        }
        self.forget_primaries(&gone);
        self.stats.aliases_replaced += gone.len() as u64;
        self.remapped += gone.len() as u64;
        let n = r.replace.len() as u64;
        let Some(mut pages) =
            self.acquire_pages(dev, n, aid, size, 0, (r.start, r.start + size))?
        else {
            return Ok(false);
        };
        // Mapped run by run of consecutive addresses, each granted access with one call.
        let mut runs: Vec<(u64, usize)> = Vec::new(); // (first page, pages)
        for &va in &r.replace {
            match runs.last_mut() {
                Some((s, k)) if *s + *k as u64 * page == va => *k += 1,
                _ => runs.push((va, 1)),
            }
        }
        for (va, k) in runs.into_iter().rev() {
            let run = pages.split_off(pages.len() - k);
            self.map_pages(dev, aid, va, run)?;
        }
        Ok(true)
    }

    /// Moves the count of `n` pages of `page` bytes from pool `from` to pool `to` (pages
    /// mapped nowhere count as large).
    pub(super) fn move_pages(&mut self, from: PoolKind, to: PoolKind, n: u64, page: u64) {
        self.stats
            .reserved_bytes
            .transfer(from, to, (n * page) as i64);
        self.stats.segment.transfer(from, to, n as i64);
    }

    /// Takes up to `max` interior pages of the free mapped block at `addr` of arena `src`
    /// for mapping elsewhere, counting them in pool `to`. Their range here becomes lent: it
    /// stays mapped, for a later reuse.
    pub(super) fn lend_pages(
        &mut self,
        src: u32,
        addr: u64,
        max: u64,
        to: PoolKind,
    ) -> Vec<PhysHandle> {
        let now = self.now;
        let (_, handles) = self.with_arena(src, |a| a.take_pages(addr, max, Take::Lend(now)));
        let kind = self.arenas[src as usize].key.kind;
        let page = self.arenas[src as usize].page();
        self.move_pages(kind, to, handles.len() as u64, page);
        for h in &handles {
            self.book.home.remove(h);
        }
        handles
    }

    /// Maps `pages` at `start` in arena `aid` and grants access with one call.
    pub(super) fn map_pages<D: Device>(
        &mut self,
        dev: &D,
        aid: u32,
        start: u64,
        pages: Vec<(PhysHandle, bool)>,
    ) -> Result<()> {
        if pages.is_empty() {
            return Ok(());
        }
        let p = self.arenas[aid as usize].page();
        let kind = self.arenas[aid as usize].key.kind;
        let n = pages.len() as u64;
        for (i, &(h, stitched)) in pages.iter().enumerate() {
            let va = start + i as u64 * p;
            if let Err(e) = drv!(self, map, dev.map(va, p as usize, h)) {
                self.unmap_failed_range(dev, aid, start, i as u64, &pages);
                return Err(e.into());
            }
            self.arenas[aid as usize].insert_page(
                va,
                Page {
                    handle: h,
                    stitched,
                },
            );
            self.book.home.insert(h, (aid, va));
            if !stitched {
                self.book.primary.insert(h, (aid, va));
            }
        }
        if let Err(e) = drv!(self, set_access, dev.set_access(start, (n * p) as usize)) {
            self.unmap_failed_range(dev, aid, start, n, &pages);
            return Err(e.into());
        }
        // Pages are counted in the large pool while they are mapped nowhere.
        self.move_pages(PoolKind::Large, kind, n, p);
        let stream = self.arenas[aid as usize].key.stream;
        self.trace(TraceAction::SegmentMap, start, n * p, stream);
        Ok(())
    }

    /// Undoes the first `mapped` maps of a failed `map_pages`; the pages become spares.
    pub(super) fn unmap_failed_range<D: Device>(
        &mut self,
        dev: &D,
        aid: u32,
        start: u64,
        mapped: u64,
        pages: &[(PhysHandle, bool)],
    ) {
        let page = self.arenas[aid as usize].page();
        for i in 0..mapped {
            let va = start + i * page;
            let _ = drv!(self, unmap, dev.unmap(va, page as usize));
            if let Some(p) = self.arenas[aid as usize].remove_page(va) {
                self.book.home.remove(&p.handle);
            }
        }
        self.book.spare.extend(pages.iter().map(|p| p.0));
    }

    /// Kept aliases at (arena, va) of `handles` are going away: a page whose first mapping
    /// was one of them is, from now on, first mapped where it is active.
    pub(super) fn forget_primaries(&mut self, gone: &[(u32, u64, PhysHandle)]) {
        for &(aid, va, h) in gone {
            if self.book.primary.get(&h) == Some(&(aid, va)) {
                match self.book.home.get(&h).copied() {
                    Some((x, hva)) => {
                        self.book.primary.insert(h, (x, hva));
                        self.arenas[x as usize].set_stitched(hva, false);
                    }
                    None => {
                        self.book.primary.remove(&h);
                    }
                }
            }
        }
    }
}

/// The clean spans of `arena` at least `size` bytes long (`Arena::clean_spans`), in address
/// order, given the handles of the free pages that may be taken back (`free`). A kept window
/// of `size` bytes with no busy alias lies in one of them: a region of the scan that meets
/// none holds no such window. (A span may reach past the region that holds it, so it may
/// name a region wrongly only the safe way: the scan then classifies it.) Costs O(free
/// pages + runs of their aliases), not O(aliases).
fn long_clean_spans(arena: &Arena, free: &FxHashSet<PhysHandle>, size: u64) -> Vec<(u64, u64)> {
    let mut clean: Vec<u64> = arena.lent_of(free.iter()).map(|(va, _)| va).collect();
    clean.sort_unstable();
    clean.dedup();
    let mut spans = arena.clean_spans(&clean);
    spans.retain(|&(s, e)| e - s >= size);
    spans
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimDevice;

    const P: u64 = 2 << 20;

    /// A miss that may take no busy alias and has no clean window (every kept range's pages
    /// busy) walks nothing and leaves the scan's cursor where it was, where a scan that
    /// walked would have moved it; a scan that may replace busy aliases walks and moves it;
    /// a clean window is seen wherever it lies, and only where it is long enough.
    #[test]
    fn a_miss_without_a_clean_window_walks_nothing_and_leaves_the_cursor() {
        let dev = std::sync::Arc::new(SimDevice::new(1 << 40));
        let a = Allocator::new(dev.clone(), Config::default()).unwrap();
        a.set_reuse_scan_limit(2);
        // Stream 0: six free two-page blocks, kept apart by live one-page blocks.
        let blocks: Vec<u64> = (0..6)
            .map(|_| {
                let b = a.allocate(2 * P, 0).unwrap();
                a.allocate(P, 0).unwrap();
                b
            })
            .collect();
        for &b in &blocks {
            a.free(b).unwrap();
        }
        // Stream 1 stitches each of them whole: stream 0's blocks become kept ranges whose
        // pages are live over there (busy).
        let stitched: Vec<u64> = (0..6).map(|_| a.allocate(2 * P, 1).unwrap()).collect();
        let last = *blocks.last().unwrap();
        let clean = |st: &State, size| {
            let aid = st.arena_at(last).unwrap();
            let mut free = FxHashSet::default();
            for x in &st.arenas {
                x.free_interior_handles(u64::MAX, &mut free);
            }
            !long_clean_spans(&st.arenas[aid as usize], &free, size).is_empty()
        };
        let holder = {
            let mut st = a.state.lock();
            st.flush_quick().unwrap();
            st.settle_arenas();
            let aid = st.arena_at(last).unwrap();
            for &b in &blocks {
                assert!(st.arenas[aid as usize].lent_at(b).is_some(), "{b:#x} lent");
            }
            assert!(!clean(&st, 2 * P), "every kept range is busy");
            // No clean span: nothing is walked, the cursor stays, from wherever it was.
            for from in [0, blocks[3]] {
                st.arenas[aid as usize].reuse_cursor = from;
                let (found, cursor) = st.find_reuse(aid, 2 * P, 0, ReuseView::Now);
                assert!(found.is_none());
                assert_eq!(
                    cursor, from,
                    "a scan that examined nothing moved the cursor"
                );
            }
            // A scan that may replace a busy alias (but not two) walks: the scan's bound
            // (two pages) stops it after the first range, and the cursor moves to the
            // second, with no window found.
            st.arenas[aid as usize].reuse_cursor = 0;
            let (found, cursor) = st.find_reuse(aid, 2 * P, 1, ReuseView::Now);
            assert!(found.is_none());
            assert_eq!(cursor, blocks[1]);
            let h = st.arenas[aid as usize].lent_at(last).unwrap();
            let (_, va) = st.book.home[&h];
            *stitched
                .iter()
                .find(|&&q| va >= q && va < q + 2 * P)
                .unwrap()
        };
        // Free the stitched block holding the last kept range's pages: that range is clean,
        // two pages long between live blocks.
        a.free(holder).unwrap();
        let mut st = a.state.lock();
        st.flush_quick().unwrap();
        st.settle_arenas();
        assert!(clean(&st, 2 * P));
        assert!(clean(&st, P + 4096));
        assert!(!clean(&st, 2 * P + 512), "longer than the span");
        st.verify().unwrap();
    }

    /// A kept window that starts at a lent page right after a free mapped block (a tail),
    /// with a busy alias further on to replace. Taking the first page back joins it to the
    /// free block before the window, which then starts before the window; the page that
    /// refills the busy alias must not be taken from that block, whose only interior page is
    /// the window's own. (No window the scan ranks first starts there today, since the one
    /// starting at the tail costs no more; a ranking that skips it hit this in the
    /// concatenation trace: the window's page lent away under the new block.)
    #[test]
    fn a_replaced_alias_is_not_refilled_from_the_window_itself() {
        let a = Allocator::new(SimDevice::new(1 << 40), Config::default()).unwrap();
        let first = a.allocate(2 * P, 0).unwrap();
        let lent = a.allocate(5 * P, 0).unwrap();
        assert_eq!(lent, first + 2 * P);
        a.free(first).unwrap();
        let size = 2 * P - 0x2c000;
        assert_eq!(a.allocate(size, 0).unwrap(), first, "a tail after it");
        a.free(lent).unwrap();
        // Stream 1 stitches the five pages: their range is lent in stream 0's arena. Its
        // first page is then free again over there, its second busy.
        let q = a.allocate(5 * P, 1).unwrap();
        a.free(q).unwrap();
        let r1 = a.allocate(P, 1).unwrap();
        let r2 = a.allocate(P, 1).unwrap();
        assert_eq!((r1, r2), (q, q + P));
        a.free(r1).unwrap();

        let dev = a.device();
        let mut st = a.state.lock();
        st.flush_quick().unwrap();
        st.settle_arenas();
        let aid = st.arena_at(first).unwrap();
        let home = st.arenas[aid as usize]
            .lent_at(lent)
            .expect("the first page is lent");
        let r = Reuse {
            start: lent,
            lent: vec![(lent, home)],
            replace: vec![lent + P],
        };
        assert!(st.apply_reuse(dev, aid, &r, size).unwrap());
        let now = st.now;
        st.with_arena(aid, |ar| ar.carve(lent, size, now));
        st.verify().unwrap();
    }
}
