//! Reporting: snapshots and the invariant check.

use super::*;

impl State {
    pub(super) fn snapshot(&self) -> Snapshot {
        let mut segments = Vec::new();
        for a in &self.arenas {
            let page = a.page();
            let first = segments.len();
            let mut cur: Option<SegmentInfo> = None;
            let mut last_end = 0;
            for (addr, b) in a.blocks() {
                let state = match b.state {
                    ArenaState::Live => match self.live.get(&addr) {
                        Some(l) if l.pending => BlockState::ActivePendingFree,
                        _ => BlockState::ActiveAllocated,
                    },
                    ArenaState::FreeMapped { .. } | ArenaState::Quick { .. } => {
                        BlockState::Inactive
                    }
                    _ => {
                        if let Some(s) = cur.take() {
                            segments.push(s);
                        }
                        continue;
                    }
                };
                if cur.as_ref().is_some_and(|_| last_end != addr) {
                    segments.extend(cur.take());
                }
                last_end = addr + b.size;
                let seg = cur.get_or_insert_with(|| SegmentInfo {
                    address: addr,
                    total_size: 0,
                    allocated_size: 0,
                    active_size: 0,
                    requested_size: 0,
                    stream: a.key.stream,
                    pool: a.key.kind,
                    graph_pool: (a.key.graph_pool.0, a.key.graph_pool.1),
                    stitched: false,
                    pages: 0,
                    blocks: Vec::new(),
                });
                let lo = addr & !(page - 1);
                let hi = (addr + b.size).div_ceil(page) * page;
                let stitched = a.pages_in(lo, hi).any(|(_, p)| p.stitched);
                let requested = self.live.get(&addr).map_or(0, |l| l.requested);
                seg.total_size += b.size;
                if state != BlockState::Inactive {
                    seg.active_size += b.size;
                    seg.requested_size += requested;
                }
                if state == BlockState::ActiveAllocated {
                    seg.allocated_size += b.size;
                }
                seg.stitched |= stitched;
                seg.blocks.push(BlockInfo {
                    address: addr,
                    size: b.size,
                    requested_size: requested,
                    state,
                    stitched,
                });
            }
            segments.extend(cur.take());
            for s in &mut segments[first..] {
                s.pages = s.total_size / page;
            }
        }
        segments.sort_by_key(|s| s.address);
        Snapshot {
            segments,
            page_size: self.page,
            config: self.cfg.to_pairs(),
        }
    }

    pub(super) fn verify(&self) -> std::result::Result<(), String> {
        let mut mapped = 0u64;
        let mut handles = FxHashSet::default();
        let (mut alloc, mut alloc_bytes) = ([0i64; 3], [0i64; 3]);
        let (mut inactive, mut inactive_bytes) = ([0i64; 3], [0i64; 3]);
        // Pages and their bytes by the pool of the arena where they are active (mapped
        // nowhere: large).
        let mut pool_pages = [0i64; 3];
        let mut pool_bytes = [0i64; 3];
        for (aid, a) in self.arenas.iter().enumerate() {
            a.check()?;
            a.check_free_runs()?;
            // The upgrades: an arena maps pages of its generation (of its size), and only those.
            let gen = a.key.gen;
            let of_gen = |h: PhysHandle| self.book.old.get(&h).copied().unwrap_or(self.gen) == gen;
            let gen_page = self.book.gen_page.get(gen as usize).copied().unwrap_or(0);
            if gen > self.gen || a.page() != gen_page {
                return Err(format!(
                    "arena {aid} of generation {gen} maps {} byte pages, its generation's are {gen_page} (current generation {})",
                    a.page(),
                    self.gen
                ));
            }
            if let Some((va, h)) = a.lent_matching(|h| !of_gen(h)).first() {
                return Err(format!(
                    "arena {aid} of generation {} keeps an alias at {va:#x} of page {h:?} of another generation",
                    a.key.gen
                ));
            }
            mapped += a.active_pages();
            pool_pages[a.key.kind as usize] += a.active_pages() as i64;
            pool_bytes[a.key.kind as usize] += (a.active_pages() * a.page()) as i64;
            for (va, p) in a.pages_in(0, u64::MAX) {
                if !handles.insert(p.handle) {
                    return Err(format!("handle {:?} mapped twice as active", p.handle));
                }
                if !of_gen(p.handle) {
                    return Err(format!(
                        "page {:?} at {va:#x} in arena {aid} is not of the arena's generation",
                        p.handle
                    ));
                }
                if self.book.home.get(&p.handle) != Some(&(aid as u32, va)) {
                    return Err(format!(
                        "page {:?} active at {va:#x} in arena {aid}, home says {:?}",
                        p.handle,
                        self.book.home.get(&p.handle)
                    ));
                }
            }
            let k = a.key.kind as usize;
            inactive[k] += a.free_mapped_count as i64;
            inactive_bytes[k] += a.free_mapped_bytes as i64;
        }
        for (ptr, b) in &self.live {
            let a = &self.arenas[b.arena as usize];
            match a.block(*ptr) {
                Some(blk) if blk.state == ArenaState::Live && blk.size == b.size => {}
                _ => return Err(format!("live pointer {ptr:#x} is not a live block")),
            }
            if !b.pending {
                let k = a.key.kind as usize;
                alloc[k] += 1;
                alloc_bytes[k] += b.size as i64;
            }
        }
        let retired: u64 = self
            .retired
            .iter()
            .flat_map(|b| b.ranges.iter())
            .map(|r| r.2)
            .sum();
        let gc: u64 = self.retired.iter().map(|b| b.release.len() as u64).sum();
        if self.book.home.len() as u64 != mapped {
            return Err(format!(
                "{} pages have a home, {mapped} are active",
                self.book.home.len()
            ));
        }
        // Aliases map created pages only: active, spare or waiting for release.
        let created: FxHashSet<PhysHandle> = handles
            .iter()
            .copied()
            .chain(self.book.spare.iter().copied())
            .chain(self.retired.iter().flat_map(|b| b.release.iter().copied()))
            .collect();
        if let Some(h) = self
            .arenas
            .iter()
            .flat_map(Arena::aliased_handles)
            .find(|h| !created.contains(h))
        {
            return Err(format!("an alias maps page {h:?}, which is not held"));
        }
        // Pages: mapped actively, waiting for release after GC, or spare. Stitched pages'
        // retired ranges are aliases of actively mapped ones.
        if mapped + gc + self.book.spare.len() as u64 != self.book.physical {
            return Err(format!(
                "pages: {mapped} mapped + {gc} gc + {} spare != {} created ({retired} retired)",
                self.book.spare.len(),
                self.book.physical
            ));
        }
        // Bytes: each page held at its size; the old generation's pages are held ones.
        if let Some(h) = self
            .book
            .spare
            .iter()
            .find(|h| self.book.old.contains_key(h))
        {
            return Err(format!("spare page {h:?} is of an old page size"));
        }
        if let Some((h, g)) = self
            .book
            .old
            .iter()
            .find(|&(h, &g)| !created.contains(h) || g >= self.gen)
        {
            return Err(format!(
                "page {h:?} of old generation {g} is not held, or not old (generation {})",
                self.gen
            ));
        }
        if self.book.gen_page.len() != self.gen as usize + 1
            || self.book.gen_page.last() != Some(&self.page)
        {
            return Err(format!(
                "page sizes by generation {:?}: not one a generation up to {} ending with {}",
                self.book.gen_page, self.gen, self.page
            ));
        }
        let unmapped: Vec<PhysHandle> = self
            .book
            .spare
            .iter()
            .copied()
            .chain(self.retired.iter().flat_map(|b| b.release.iter().copied()))
            .collect();
        let unmapped_bytes: u64 = unmapped.iter().map(|&h| self.page_bytes(h)).sum();
        let held_bytes: u64 = pool_bytes.iter().sum::<i64>() as u64 + unmapped_bytes;
        if held_bytes != self.book.bytes {
            return Err(format!(
                "pages held sum to {held_bytes} bytes, the book says {}",
                self.book.bytes
            ));
        }
        pool_bytes[PoolKind::Large as usize] += unmapped_bytes as i64;
        // Debug mode: guarded allocations and their pages live outside the arenas.
        self.debug_verify()?;
        let (guarded, guarded_bytes, held_ranges, debug_pages) = self.debug_counts();
        alloc[2] += guarded;
        alloc_bytes[2] += guarded_bytes;
        let s = &self.stats;
        let cur = |a: &crate::stats::StatArray, i: usize| a.0[i].current;
        for i in 1..3 {
            if cur(&s.allocation, i) != alloc[i] || cur(&s.allocated_bytes, i) != alloc_bytes[i] {
                return Err(format!("allocation stats differ from recount in pool {i}"));
            }
            if cur(&s.inactive_split, i) != inactive[i]
                || cur(&s.inactive_split_bytes, i) != inactive_bytes[i]
            {
                return Err(format!(
                    "inactive_split stats differ from recount in pool {i}"
                ));
            }
        }
        if cur(&s.reserved_bytes, 0) != (self.book.bytes + debug_pages * self.page) as i64
            || cur(&s.segment, 0) != (self.book.physical + debug_pages) as i64
        {
            return Err("reserved stats differ from pages held".into());
        }
        pool_pages[PoolKind::Large as usize] +=
            self.book.physical as i64 - mapped as i64 + debug_pages as i64;
        pool_bytes[PoolKind::Large as usize] += (debug_pages * self.page) as i64;
        for (i, &pages) in pool_pages.iter().enumerate().skip(1) {
            if cur(&s.segment, i) != pages || cur(&s.reserved_bytes, i) != pool_bytes[i] {
                return Err(format!(
                    "reserved stats of pool {i} ({} pages) differ from the pages active there ({pages})",
                    cur(&s.segment, i)
                ));
            }
        }
        let active_count = self.live.len() as i64 + guarded + held_ranges;
        if cur(&s.active, 0) != active_count {
            return Err("active stats differ from recount".into());
        }
        Ok(())
    }
}
