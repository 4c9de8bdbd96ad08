//! An arena: the virtual address space of one (stream, pool kind, graph pool), carved into
//! blocks at 512-byte granularity and backed by physical pages mapped one page at a time.
//!
//! The arena is pure bookkeeping; the allocator makes the device calls it implies.
//!
//! Invariants (checked by `check` in tests):
//! - I1 the blocks of a chunk partition it: sorted, adjacent, no gaps, no overlaps.
//! - I2 a `Live` or `FreeMapped` block has every page it touches mapped (in `pages`).
//! - I3 a `FreeUnmapped`, `Lent` or `Retired` block starts and ends on page boundaries and
//!   none of its pages is in `pages`. Every page of a `Lent` block is in `lent` (an alias:
//!   mapped here on the device, its physical page active elsewhere), and `lent` holds
//!   nothing else. A `Retired` range is still mapped on the device until its event completes
//!   and the allocator unmaps it; `FreeUnmapped` has nothing mapped.
//! - I4 two adjacent free blocks of the same state never both exist (`FreeMapped`,
//!   `FreeUnmapped` and `Lent` are coalesced), so a `FreeMapped` block's neighbours are live,
//!   lent, retired, unmapped or a chunk edge, and its pages that it does not share with a
//!   live neighbour ("interior" pages) can be taken.
//! - I5 every free or lent block is in exactly the indexes of its state; the counters equal
//!   sums over the indexes. A `Quick` block's size is listed (`quick_sizes`, once) so that a
//!   flush reaches it.
//!
//! Consequently every maximal run of mapped blocks starts and ends on page boundaries.

use crate::aliasmap::AliasMap;
use crate::blockmap::BlockMap;
use crate::deferred::DeferredSet;
use crate::device::PhysHandle;
use crate::fitindex::FitIndex;
use crate::freeruns::FreeRuns;
use crate::keys::ArenaKey;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

/// Live, free mapped and quick blocks: the blocks whose pages are mapped, which make runs.
fn is_mapped(s: BlockState) -> bool {
    matches!(
        s,
        BlockState::Live | BlockState::FreeMapped { .. } | BlockState::Quick { .. }
    )
}

/// Collects the free mapped blocks of `blocks` (one way along a run) until the first live
/// block or the run's end; whether a live block ended it.
fn free_until_live(
    blocks: impl Iterator<Item = (u64, Block)>,
    frees: &mut Vec<(u64, u64)>,
) -> bool {
    for (addr, b) in blocks {
        match b.state {
            BlockState::Live => return true,
            s if is_free_mapped(s) => frees.push((addr, b.size)),
            _ => return false,
        }
    }
    false
}

/// Free blocks whose pages are mapped (quick ones included).
fn is_free_mapped(s: BlockState) -> bool {
    matches!(s, BlockState::FreeMapped { .. } | BlockState::Quick { .. })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    Live,
    /// Free, every page mapped; `freed` orders frees (for LRU and stream fences).
    FreeMapped {
        freed: u64,
    },
    /// Free, no page mapped; `ext` is its size plus the size of the `FreeMapped` block right
    /// before it, i.e. the largest request that can be placed here (starting at that block,
    /// whose pages are reused).
    FreeUnmapped {
        ext: u64,
    },
    /// Pages given to a stitch elsewhere, still mapped here (aliases, in `lent`): the range
    /// becomes usable again with no driver call once its pages are free where they are
    /// active (a *reuse* of this mapping). `since`: the latest free of what these
    /// addresses held before they were lent (work queued up to then may still use them, so
    /// unmapping them waits for it); it also orders lent blocks for eviction.
    Lent {
        since: u64,
    },
    /// Being unmapped: still mapped on the device until the allocator's event completes.
    Retired,
    /// Free and mapped, parked uncoalesced in the quick list of its exact size so the next
    /// request of that size takes it in O(1). Counted as free mapped; never next to the
    /// tree's indexes. Any miss flushes the quick lists (coalescing them) first.
    Quick {
        freed: u64,
    },
}

/// What pages taken from a free mapped block become.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Take {
    /// `Lent` (still mapped here, reusable later with no driver call), stamped with the
    /// block's last free (at most this `now`).
    Lend(u64),
    /// `Retired`: the caller unmaps them once its event completes, then calls `unretire`.
    Retire,
    /// Unmapped free space at once: the caller unmaps them before releasing its lock.
    Unmap,
}

/// How many blocks the quick lists of one arena hold before they are flushed.
const QUICK_CAPACITY: usize = 256;

/// How many sizes' (empty) quick lists a flush keeps for reuse.
const QUICK_SIZES_KEPT: usize = 1024;

/// The quick list of one size: its blocks, lowest address first out.
#[derive(Default)]
struct QuickList {
    heap: BinaryHeap<Reverse<u64>>,
    /// In `quick_sizes` (so a flush drains it).
    listed: bool,
}

/// Walks an arena's regions that hold lent blocks (`Arena::lent_regions_from`).
pub(crate) struct LentRegions<'a> {
    arena: &'a Arena,
    /// The next region is that of the first lent block at or after this address: the end of
    /// the region returned last.
    from: u64,
}

impl LentRegions<'_> {
    /// The next region, as (addr, block) in address order, into `out` (cleared first);
    /// returns the address of its first lent block, or `None` when no region is left.
    pub fn next_into(&mut self, out: &mut Vec<(u64, Block)>) -> Option<u64> {
        out.clear();
        let &l = self.arena.lent_addrs.range(self.from..).next()?;
        let (start, chunk) = self.arena.region_start(l);
        let mut first_lent = None;
        let mut at = start;
        // Blocks tile a chunk: the next block starts where one ends, found by hash.
        while let Some(b) = self.arena.blocks.get(&at) {
            if b.chunk != chunk || !b.reusable() {
                break;
            }
            if first_lent.is_none() && matches!(b.state, BlockState::Lent { .. }) {
                first_lent = Some(at);
            }
            out.push((at, *b));
            at += b.size;
        }
        // `l` is in the region (I5: every lent start is a lent block), so the scan's end is
        // never taken for a region that ended early.
        debug_assert!(first_lent.is_some(), "lent block {l:#x} outside its region");
        self.from = at;
        first_lent
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Block {
    pub size: u64,
    pub state: BlockState,
    pub chunk: u32,
}

impl Block {
    /// Whether a reuse window may cover the block: free mapped, or lent.
    fn reusable(&self) -> bool {
        matches!(
            self.state,
            BlockState::FreeMapped { .. } | BlockState::Lent { .. }
        )
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Page {
    pub handle: PhysHandle,
    /// The page came here through a stitch (taken from another block).
    pub stitched: bool,
}

/// Where a request that no free mapped block fits will go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub start: u64,
    /// Free mapped blocks the placement covers: no page may be taken from them while it is
    /// pending.
    pub neighbours: [Option<u64>; 2],
    /// First page to map and number of pages (contiguous, page aligned).
    pub map_start: u64,
    pub map_pages: u64,
}

pub(crate) struct Arena {
    pub key: ArenaKey,
    page: u64,
    track_age: bool,
    /// (start, size) per chunk id; a freed chunk becomes (0, 0).
    chunks: Vec<(u64, u64)>,
    blocks: BlockMap,
    /// FreeMapped blocks by (size, addr): the hit path.
    free_mapped: FitIndex,
    /// FreeMapped blocks with interior pages, by (interior pages, addr): read only by misses
    /// that stitch and by memory returned, so its changes are deferred to then
    /// ([`Arena::settle`]).
    stealable: DeferredSet<(u64, u64)>,
    /// FreeMapped blocks with interior pages, by (freed, addr); kept only for LRU stitching.
    by_age: BTreeSet<(u64, u64)>,
    /// FreeUnmapped blocks by (ext, addr).
    unmapped: BTreeSet<(u64, u64)>,
    /// The addresses of FreeUnmapped blocks: few, and asked after every carve and free
    /// (whether the block after holds an `ext` to refresh) where a lookup in `blocks` cost
    /// a tree descent each time.
    unmapped_at: rustc_hash::FxHashSet<u64>,
    /// Active pages: va -> page. Private: the allocator reads it through accessors.
    pages: BTreeMap<u64, Page>,
    /// Aliases kept mapped in `Lent` blocks: va -> handle (active elsewhere, or spare), and
    /// handle -> its aliases here.
    lent: AliasMap,
    /// Lent blocks by (since, addr): oldest first, for eviction.
    lent_age: BTreeSet<(u64, u64)>,
    /// Lent blocks by address, for the reuse scan.
    lent_addrs: BTreeSet<u64>,
    /// size -> quick blocks of that size, lowest address first (as best fit would pick).
    quick: rustc_hash::FxHashMap<u64, QuickList>,
    /// The sizes whose list is `listed`, each once: a superset of the non-empty lists, what a
    /// flush drains.
    quick_sizes: Vec<u64>,
    quick_len: usize,
    /// The addresses a flush of the quick lists coalesces (kept to reuse its allocation).
    flush_buf: Vec<u64>,
    /// Bytes and count of free mapped blocks, quick ones included.
    pub free_mapped_bytes: u64,
    pub free_mapped_count: u64,
    pub stealable_pages: u64,
    pub live_blocks: u64,
    pub retired_blocks: u64,
    /// The `freed` stamp of the most recent free in this arena.
    pub last_free: u64,
    /// Where the allocator's bounded scan for a reusable window starts (a lent block
    /// address; the scan wraps around). Only a hint: any value is valid.
    pub reuse_cursor: u64,
    /// The free blocks of runs with no live block, for `inactive_split` (`freeruns.rs`).
    runs: FreeRuns,
}

impl Arena {
    pub fn new(key: ArenaKey, page: u64, track_age: bool) -> Arena {
        Arena {
            key,
            page,
            track_age,
            chunks: Vec::new(),
            blocks: BlockMap::default(),
            free_mapped: FitIndex::default(),
            stealable: DeferredSet::new(),
            by_age: BTreeSet::new(),
            unmapped: BTreeSet::new(),
            unmapped_at: rustc_hash::FxHashSet::default(),
            pages: BTreeMap::new(),
            lent: AliasMap::default(),
            lent_age: BTreeSet::new(),
            lent_addrs: BTreeSet::new(),
            quick: rustc_hash::FxHashMap::default(),
            quick_sizes: Vec::new(),
            quick_len: 0,
            flush_buf: Vec::new(),
            free_mapped_bytes: 0,
            free_mapped_count: 0,
            stealable_pages: 0,
            live_blocks: 0,
            retired_blocks: 0,
            last_free: 0,
            reuse_cursor: 0,
            runs: FreeRuns::default(),
        }
    }

    /// The size of the pages this arena maps (one size per arena: its generation's).
    pub fn page(&self) -> u64 {
        self.page
    }

    fn floor(&self, a: u64) -> u64 {
        a & !(self.page - 1)
    }

    fn ceil(&self, a: u64) -> u64 {
        (a + self.page - 1) & !(self.page - 1)
    }

    /// Whole pages of [addr, addr+size): (first page address, count).
    pub fn interior(&self, addr: u64, size: u64) -> (u64, u64) {
        let first = self.ceil(addr);
        let last = self.floor(addr + size);
        (
            first,
            if last > first {
                (last - first) / self.page
            } else {
                0
            },
        )
    }

    fn index_insert(&mut self, addr: u64, b: &Block) {
        self.runs.touch(addr);
        match b.state {
            BlockState::Quick { .. } => {
                self.free_mapped_bytes += b.size;
                self.free_mapped_count += 1;
            }
            BlockState::Live => self.live_blocks += 1,
            BlockState::Retired => self.retired_blocks += 1,
            BlockState::Lent { since } => {
                self.lent_age.insert((since, addr));
                self.lent_addrs.insert(addr);
            }
            BlockState::FreeUnmapped { ext } => {
                self.unmapped.insert((ext, addr));
                self.unmapped_at.insert(addr);
            }
            BlockState::FreeMapped { freed } => {
                self.free_mapped.insert((b.size, addr));
                self.free_mapped_bytes += b.size;
                self.free_mapped_count += 1;
                let (_, n) = self.interior(addr, b.size);
                if n > 0 {
                    self.stealable.insert((n, addr));
                    self.stealable_pages += n;
                    if self.track_age {
                        self.by_age.insert((freed, addr));
                    }
                }
            }
        }
    }

    fn index_remove(&mut self, addr: u64, b: &Block) {
        if is_free_mapped(b.state) {
            self.runs.remove_free(addr);
        } else {
            self.runs.touch(addr);
        }
        match b.state {
            BlockState::Quick { .. } => {
                self.free_mapped_bytes -= b.size;
                self.free_mapped_count -= 1;
            }
            BlockState::Live => self.live_blocks -= 1,
            BlockState::Retired => self.retired_blocks -= 1,
            BlockState::Lent { since } => {
                self.lent_age.remove(&(since, addr));
                self.lent_addrs.remove(&addr);
            }
            BlockState::FreeUnmapped { ext } => {
                self.unmapped.remove(&(ext, addr));
                self.unmapped_at.remove(&addr);
            }
            BlockState::FreeMapped { freed } => {
                self.free_mapped.remove(&(b.size, addr));
                self.free_mapped_bytes -= b.size;
                self.free_mapped_count -= 1;
                let (_, n) = self.interior(addr, b.size);
                if n > 0 {
                    self.stealable.remove((n, addr));
                    self.stealable_pages -= n;
                    if self.track_age {
                        self.by_age.remove(&(freed, addr));
                    }
                }
            }
        }
    }

    fn put(&mut self, addr: u64, b: Block) {
        self.index_insert(addr, &b);
        self.blocks.insert(addr, b);
    }

    fn take(&mut self, addr: u64) -> Option<Block> {
        let b = self.blocks.remove(&addr)?;
        self.index_remove(addr, &b);
        Some(b)
    }

    pub fn block(&self, addr: u64) -> Option<&Block> {
        self.blocks.get(&addr)
    }

    /// The block ending at `addr` in the same chunk.
    fn prev_of(&self, addr: u64, chunk: u32) -> Option<(u64, Block)> {
        let (a, &b) = self.blocks.ending_at(addr)?;
        (b.chunk == chunk).then_some((a, b))
    }

    fn next_of(&self, end: u64, chunk: u32) -> Option<Block> {
        self.blocks.get(&end).filter(|b| b.chunk == chunk).copied()
    }

    fn ext_of(&self, addr: u64, size: u64, chunk: u32) -> u64 {
        size + self.free_mapped_before(addr, chunk).map_or(0, |b| b.1)
    }

    fn free_mapped_before(&self, addr: u64, chunk: u32) -> Option<(u64, u64)> {
        self.prev_of(addr, chunk)
            .filter(|(_, p)| matches!(p.state, BlockState::FreeMapped { .. }))
            .map(|(a, p)| (a, p.size))
    }

    /// Recomputes the `ext` of an unmapped block at `addr` after its predecessor changed.
    fn refresh_ext(&mut self, addr: u64) {
        if !self.unmapped_at.contains(&addr) {
            return;
        }
        let Some(b) = self.blocks.get(&addr).copied() else {
            return;
        };
        if let BlockState::FreeUnmapped { ext } = b.state {
            let new = self.ext_of(addr, b.size, b.chunk);
            if new != ext {
                self.take(addr);
                self.put(
                    addr,
                    Block {
                        state: BlockState::FreeUnmapped { ext: new },
                        ..b
                    },
                );
            }
        }
    }

    /// Adds [addr, addr+size) as free mapped space (nothing is recorded there now),
    /// coalescing it with free mapped neighbours (I4).
    fn insert_free_mapped(&mut self, addr: u64, size: u64, freed: u64, chunk: u32) {
        self.free_mapped_at(addr, size, freed, chunk, false);
    }

    /// [`Arena::insert_free_mapped`], where `recorded` says that `blocks` still holds an
    /// entry at `addr` (out of every index: a quick block being flushed), to rewrite or drop.
    /// The hot path of every free: an entry that stays at its address (this one, or the
    /// free block before when they merge) is rewritten in place rather than removed and
    /// inserted, and the `ext` of the block after is refreshed only when that block may be
    /// unmapped space of this chunk (the only blocks whose `ext` counts this one).
    fn free_mapped_at(
        &mut self,
        mut addr: u64,
        mut size: u64,
        mut freed: u64,
        chunk: u32,
        recorded: bool,
    ) {
        let mut in_place = recorded;
        if let Some((pa, p)) = self.prev_of(addr, chunk) {
            if let BlockState::FreeMapped { freed: f } = p.state {
                if recorded {
                    self.blocks.remove(&addr);
                }
                self.index_remove(pa, &p);
                in_place = true;
                addr = pa;
                size += p.size;
                freed = freed.max(f);
            }
        }
        // Whether the block after the new free block may need its `ext` refreshed.
        let mut refresh = false;
        if let Some(n) = self.next_of(addr + size, chunk) {
            match n.state {
                BlockState::FreeMapped { freed: f } => {
                    self.take(addr + size);
                    size += n.size;
                    freed = freed.max(f);
                    refresh = true;
                }
                BlockState::FreeUnmapped { .. } => refresh = true,
                _ => {}
            }
        }
        let b = Block {
            size,
            state: BlockState::FreeMapped { freed },
            chunk,
        };
        if in_place && self.blocks.replace(addr, b) {
            self.index_insert(addr, &b);
        } else {
            self.put(addr, b);
        }
        if refresh {
            self.refresh_ext(addr + size);
        }
    }

    /// What is left of a free mapped block that `carve` cut: it stays free mapped where it
    /// is, between the new live block and a neighbour of the old block, which is not free
    /// mapped (I4), so there is nothing to coalesce (the caller refreshes the `ext` after).
    fn put_free_mapped_between(&mut self, addr: u64, size: u64, freed: u64, chunk: u32) {
        debug_assert!(
            self.prev_of(addr, chunk)
                .is_none_or(|(_, p)| !matches!(p.state, BlockState::FreeMapped { .. }))
                && self
                    .next_of(addr + size, chunk)
                    .is_none_or(|n| !matches!(n.state, BlockState::FreeMapped { .. })),
            "a carved free block had a free mapped neighbour (I4)"
        );
        let state = BlockState::FreeMapped { freed };
        self.put(addr, Block { size, state, chunk });
    }

    fn insert_free_unmapped(&mut self, mut addr: u64, mut size: u64, chunk: u32) {
        if let Some((pa, p)) = self.prev_of(addr, chunk) {
            if matches!(p.state, BlockState::FreeUnmapped { .. }) {
                self.take(pa);
                addr = pa;
                size += p.size;
            }
        }
        if let Some(n) = self.next_of(addr + size, chunk) {
            if matches!(n.state, BlockState::FreeUnmapped { .. }) {
                self.take(addr + size);
                size += n.size;
            }
        }
        let ext = self.ext_of(addr, size, chunk);
        self.put(
            addr,
            Block {
                size,
                state: BlockState::FreeUnmapped { ext },
                chunk,
            },
        );
    }

    /// Adds a reserved range of virtual addresses (page aligned) to the arena.
    pub fn add_chunk(&mut self, start: u64, size: u64) {
        let id = self.chunks.len() as u32;
        self.chunks.push((start, size));
        self.insert_free_unmapped(start, size, id);
    }

    /// Maximal runs of mapped pages as (start, bytes), each within one chunk (one
    /// reservation on the device). O(pages); for rare calls (granting a new peer access).
    pub fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let chunk_starts: BTreeSet<u64> = self
            .chunks
            .iter()
            .filter(|c| c.1 > 0)
            .map(|c| c.0)
            .collect();
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut vas: Vec<u64> = self.pages.keys().chain(self.lent.keys()).copied().collect();
        vas.sort_unstable();
        for va in vas {
            match out.last_mut() {
                Some((start, len)) if *start + *len == va && !chunk_starts.contains(&va) => {
                    *len += self.page
                }
                _ => out.push((va, self.page)),
            }
        }
        out
    }

    /// Chunks whose whole range is free and unmapped: removed from the arena and returned,
    /// for the caller to free on the device.
    pub fn drain_empty_chunks(&mut self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for id in 0..self.chunks.len() {
            let (start, size) = self.chunks[id];
            if size == 0 {
                continue;
            }
            let empty = matches!(self.blocks.get(&start),
                Some(b) if b.size == size && matches!(b.state, BlockState::FreeUnmapped { .. }));
            if empty {
                self.take(start);
                self.chunks[id] = (0, 0);
                out.push((start, size));
            }
        }
        out
    }

    /// The best-fitting free mapped block for `size` bytes (no driver call needed).
    pub fn find_hit(&self, size: u64, reuse_limit: f64) -> Option<u64> {
        let (bsize, addr) = self.free_mapped.first_at_least(size)?;
        (reuse_limit.is_infinite() || bsize as f64 <= size as f64 * reuse_limit).then_some(addr)
    }

    /// Where `size` bytes go when no free mapped block fits: the unmapped block that, with
    /// the free mapped block before it, fits best; placed at the start of that free mapped
    /// block, so its pages are reused and allocations stay packed.
    pub fn find_placement(&self, size: u64) -> Option<Placement> {
        let &(_, uaddr) = self.unmapped.range((size, 0)..).next()?;
        let u = self.blocks[&uaddr];
        let before = self.free_mapped_before(uaddr, u.chunk);
        let start = before.map_or(uaddr, |b| b.0);
        let end = (start + size).min(uaddr + u.size);
        let map_pages = if end > uaddr {
            (self.ceil(end) - uaddr) / self.page
        } else {
            0
        };
        Some(Placement {
            start,
            neighbours: [before.map(|b| b.0), None],
            map_start: uaddr,
            map_pages,
        })
    }

    /// Marks [start, start+size) live. The range must lie in free blocks (a hit, or a
    /// placement). Pages of unmapped blocks that it touches must be mapped by the caller
    /// (`find_placement` says which).
    pub fn carve(&mut self, start: u64, size: u64, now: u64) {
        let end = start + size;
        // Mostly a hit or a placement at a block's start: one probe, not an ordered search.
        let found = match self.blocks.get(&start) {
            Some(&b) => Some((start, b)),
            None => self.blocks.last_at_or_before(start).map(|(a, &b)| (a, b)),
        };
        let Some((mut addr, mut b)) = found else {
            return;
        };
        let chunk = b.chunk;
        let live = Block {
            size,
            state: BlockState::Live,
            chunk,
        };
        if start == addr {
            // A hit at the start of a free block (the common case): its entry is rewritten
            // in place rather than removed and inserted again.
            self.index_remove(addr, &b);
            self.blocks.replace(addr, live);
            self.index_insert(addr, &live);
        } else {
            self.take(addr);
            self.put(start, live);
        }
        if start > addr {
            match b.state {
                BlockState::FreeMapped { freed } => {
                    self.put_free_mapped_between(addr, start - addr, freed, chunk)
                }
                _ => {
                    let pf = self.floor(start).max(addr);
                    if pf > addr {
                        self.insert_free_unmapped(addr, pf - addr, chunk);
                    }
                    if start > pf {
                        self.insert_free_mapped(pf, start - pf, now, chunk);
                    }
                }
            }
        }
        loop {
            let bend = addr + b.size;
            if bend >= end {
                if bend > end {
                    match b.state {
                        BlockState::FreeMapped { freed } => {
                            self.put_free_mapped_between(end, bend - end, freed, chunk)
                        }
                        _ => {
                            let pe = self.ceil(end).min(bend);
                            if pe > end {
                                self.insert_free_mapped(end, pe - end, now, chunk);
                            }
                            if bend > pe {
                                self.insert_free_unmapped(pe, bend - pe, chunk);
                            }
                        }
                    }
                }
                self.refresh_ext(bend.max(end));
                break;
            }
            addr = bend;
            b = self.take(addr).expect("carve covers adjacent blocks");
        }
    }

    /// Frees a live block into the quick list of its size; returns its size.
    pub fn release(&mut self, addr: u64, now: u64) -> Option<u64> {
        let (size, state) = self.blocks.size_and_state(&addr)?;
        if *state != BlockState::Live {
            return None;
        }
        *state = BlockState::Quick { freed: now };
        self.runs.touch(addr);
        self.live_blocks -= 1;
        self.free_mapped_bytes += size;
        self.free_mapped_count += 1;
        let list = self.quick.entry(size).or_default();
        if !list.listed {
            list.listed = true;
            self.quick_sizes.push(size);
        }
        list.heap.push(Reverse(addr));
        self.quick_len += 1;
        self.last_free = now;
        Some(size)
    }

    /// The quick lists hold more than they should: the caller flushes them.
    pub fn quick_full(&self) -> bool {
        self.quick_len > QUICK_CAPACITY
    }

    /// The most recently freed quick block of exactly `size` bytes, made live again.
    pub fn take_quick(&mut self, size: u64) -> Option<u64> {
        let Reverse(addr) = self.quick.get_mut(&size)?.heap.pop()?;
        self.quick_len -= 1;
        *self.blocks.size_and_state(&addr)?.1 = BlockState::Live;
        self.runs.remove_free(addr);
        self.live_blocks += 1;
        self.free_mapped_bytes -= size;
        self.free_mapped_count -= 1;
        Some(addr)
    }

    /// Moves every quick block into the coalesced free mapped blocks.
    pub fn flush_quick(&mut self) {
        // A parked block's size is listed, so nothing listed means nothing parked. Sizes
        // listed whose blocks were all taken again are unlisted here too, so that the cap on
        // kept lists holds when misses find nothing parked.
        if self.quick_sizes.is_empty() {
            return;
        }
        // Drained in place, into a buffer kept from flush to flush: random sizes flush at
        // nearly every allocation, and a map taken whole was allocated again each time.
        let mut addrs = std::mem::take(&mut self.flush_buf);
        // The lists are emptied, not dropped: a periodic job frees the same sizes again, and
        // dropping them allocated a list anew at nearly every free. The sizes seen are
        // forgotten once there are many (random sizes).
        for size in self.quick_sizes.drain(..) {
            if let Some(list) = self.quick.get_mut(&size) {
                addrs.extend(list.heap.drain().map(|Reverse(a)| a));
                list.listed = false;
            }
        }
        if self.quick.len() > QUICK_SIZES_KEPT {
            self.quick.clear();
        }
        for &addr in &addrs {
            if let Some(b) = self.blocks.get(&addr).copied() {
                if let BlockState::Quick { freed } = b.state {
                    self.index_remove(addr, &b);
                    self.free_mapped_at(addr, b.size, freed, b.chunk, true);
                }
            }
        }
        addrs.clear();
        self.flush_buf = addrs;
        self.quick_len = 0;
    }

    /// Marks the active page at `va` stitched (first mapped elsewhere) or not.
    pub fn set_stitched(&mut self, va: u64, stitched: bool) {
        if let Some(p) = self.pages.get_mut(&va) {
            p.stitched = stitched;
        }
    }

    /// Takes up to `max_pages` interior pages from the top of the free mapped block at
    /// `addr`; what the taken range becomes is `mode`'s. Returns the first taken page address
    /// and the pages' handles in address order.
    pub fn take_pages(&mut self, addr: u64, max_pages: u64, mode: Take) -> (u64, Vec<PhysHandle>) {
        let Some(b) = self.blocks.get(&addr).copied() else {
            return (0, Vec::new());
        };
        if !matches!(b.state, BlockState::FreeMapped { .. }) {
            return (0, Vec::new());
        }
        let (first, n) = self.interior(addr, b.size);
        let k = n.min(max_pages);
        if k == 0 {
            return (0, Vec::new());
        }
        let s_start = first + (n - k) * self.page;
        let handles = self.take_range(addr, b, s_start, k, mode);
        (s_start, handles)
    }

    /// Lends the page at `va` (an interior page of a free mapped block) to a reuse elsewhere:
    /// it becomes `Lent` here, still mapped. Returns its handle, or None if the page is not
    /// an interior page of a free mapped block.
    pub fn lend_page_at(&mut self, va: u64, now: u64) -> Option<PhysHandle> {
        self.blocks.settle();
        let (addr, b) = self.block_containing(va)?;
        if !matches!(b.state, BlockState::FreeMapped { .. }) || va + self.page > addr + b.size {
            return None;
        }
        self.take_range(addr, b, va, 1, Take::Lend(now)).pop()
    }

    /// Whether the page at `va` is an interior page of a free mapped block (it may be lent).
    #[cfg(test)]
    pub fn page_is_free(&self, va: u64) -> bool {
        self.block_containing(va).is_some_and(|(addr, b)| {
            matches!(b.state, BlockState::FreeMapped { .. }) && va + self.page <= addr + b.size
        })
    }

    /// Takes the `k` pages at `s_start` out of the free mapped block (`addr`, `b`).
    fn take_range(
        &mut self,
        addr: u64,
        b: Block,
        s_start: u64,
        k: u64,
        mode: Take,
    ) -> Vec<PhysHandle> {
        let BlockState::FreeMapped { freed } = b.state else {
            return Vec::new();
        };
        let s_end = s_start + k * self.page;
        self.take(addr);
        if s_start > addr {
            self.insert_free_mapped(addr, s_start - addr, freed, b.chunk);
        }
        let bend = addr + b.size;
        if bend > s_end {
            self.insert_free_mapped(s_end, bend - s_end, freed, b.chunk);
        }
        let handles: Vec<PhysHandle> = (0..k)
            .filter_map(|i| self.pages.remove(&(s_start + i * self.page)))
            .map(|p| p.handle)
            .collect();
        match mode {
            Take::Retire => self.put(
                s_start,
                Block {
                    size: s_end - s_start,
                    state: BlockState::Retired,
                    chunk: b.chunk,
                },
            ),
            Take::Unmap => self.insert_free_unmapped(s_start, s_end - s_start, b.chunk),
            Take::Lend(now) => {
                for (i, &h) in handles.iter().enumerate() {
                    self.lent.insert(s_start + i as u64 * self.page, h);
                }
                // Stamped with the block's last free, not the lending: work queued before
                // that free is all that may still use these addresses.
                self.insert_lent(s_start, s_end - s_start, freed.min(now), b.chunk);
            }
        }
        self.refresh_ext(s_end);
        handles
    }

    fn insert_lent(&mut self, mut addr: u64, mut size: u64, mut since: u64, chunk: u32) {
        if let Some((pa, p)) = self.prev_of(addr, chunk) {
            if let BlockState::Lent { since: s } = p.state {
                self.take(pa);
                addr = pa;
                size += p.size;
                since = since.max(s);
            }
        }
        if let Some(n) = self.next_of(addr + size, chunk) {
            if let BlockState::Lent { since: s } = n.state {
                self.take(addr + size);
                size += n.size;
                since = since.max(s);
            }
        }
        self.put(
            addr,
            Block {
                size,
                state: BlockState::Lent { since },
                chunk,
            },
        );
    }

    /// Splits the page-aligned range [start, start + len) out of the lent block containing
    /// it; returns that block's (addr, block) before the split.
    fn split_lent(&mut self, start: u64, len: u64) -> Option<(u64, Block, u64)> {
        self.blocks.settle();
        let (addr, b) = self.block_containing(start)?;
        let BlockState::Lent { since } = b.state else {
            return None;
        };
        if start + len > addr + b.size {
            return None;
        }
        self.take(addr);
        if start > addr {
            self.put(
                addr,
                Block {
                    size: start - addr,
                    state: BlockState::Lent { since },
                    chunk: b.chunk,
                },
            );
        }
        let bend = addr + b.size;
        if bend > start + len {
            self.put(
                start + len,
                Block {
                    size: bend - start - len,
                    state: BlockState::Lent { since },
                    chunk: b.chunk,
                },
            );
        }
        Some((addr, b, since))
    }

    /// The lent page at `va` is active here again (its physical page was taken back from
    /// where it was active): it becomes free mapped space. The caller grants nothing: the
    /// alias kept its mapping and access.
    pub fn claim_lent(&mut self, va: u64, now: u64, stitched: bool) -> Option<PhysHandle> {
        let handle = *self.lent.get(&va)?;
        let (_, b, _) = self.split_lent(va, self.page)?;
        self.lent.remove(&va);
        self.pages.insert(va, Page { handle, stitched });
        self.insert_free_mapped(va, self.page, now, b.chunk);
        self.refresh_ext(va + self.page);
        Some(handle)
    }

    /// The lent pages [start, start + n pages) are to be unmapped: they become `Retired`
    /// (one block). Returns their handles.
    pub fn retire_lent(&mut self, start: u64, n: u64) -> Vec<PhysHandle> {
        let len = n * self.page;
        let Some((_, b, _)) = self.split_lent(start, len) else {
            return Vec::new();
        };
        self.put(
            start,
            Block {
                size: len,
                state: BlockState::Retired,
                chunk: b.chunk,
            },
        );
        (0..n)
            .filter_map(|i| self.lent.remove(&(start + i * self.page)))
            .collect()
    }

    /// The oldest lent block: (since, addr, pages).
    pub fn oldest_lent(&self) -> Option<(u64, u64, u64)> {
        let &(since, addr) = self.lent_age.iter().next()?;
        let b = self.blocks.get(&addr)?;
        Some((since, addr, b.size / self.page))
    }

    /// When the lent block holding `va` was lent (its latest lending, if merged).
    pub fn lent_since(&self, va: u64) -> Option<u64> {
        match self.block_containing(va)? {
            (
                _,
                Block {
                    state: BlockState::Lent { since },
                    ..
                },
            ) => Some(since),
            _ => None,
        }
    }

    /// Interior pages of the free mapped blocks that start in [lo, hi).
    pub fn free_interior_in(&self, lo: u64, hi: u64) -> u64 {
        self.blocks
            .range(lo..hi)
            .filter(|(_, b)| matches!(b.state, BlockState::FreeMapped { .. }))
            .map(|(&a, b)| self.interior(a, b.size).1)
            .sum()
    }

    /// The lent page at `va` is to be unmapped now (the caller unmaps it before releasing
    /// its lock): it becomes unmapped free space. Returns its handle.
    pub fn unmap_lent_page(&mut self, va: u64) -> Option<PhysHandle> {
        let (_, b, _) = self.split_lent(va, self.page)?;
        let h = self.lent.remove(&va)?;
        self.insert_free_unmapped(va, self.page, b.chunk);
        self.refresh_ext(va + self.page);
        Some(h)
    }

    /// Lent blocks as (addr, bytes), in address order.
    pub fn lent_blocks(&self) -> Vec<(u64, u64)> {
        self.lent_addrs
            .iter()
            .filter_map(|&a| self.blocks.get(&a).map(|b| (a, b.size)))
            .collect()
    }

    /// Number of lent pages (aliases) held.
    pub fn lent_pages(&self) -> u64 {
        self.lent.len() as u64
    }

    /// The handle lent at `va`.
    pub fn lent_at(&self, va: u64) -> Option<PhysHandle> {
        self.lent.get(&va).copied()
    }

    /// The aliases in [lo, hi), in address order: (va, handle).
    pub fn lent_in(&self, lo: u64, hi: u64) -> impl Iterator<Item = (u64, PhysHandle)> + '_ {
        self.lent.range(lo..hi).map(|(&v, &h)| (v, h))
    }

    /// Every (va, handle) alias whose handle satisfies `pred`. O(aliases).
    pub fn lent_matching(&self, pred: impl Fn(PhysHandle) -> bool) -> Vec<(u64, PhysHandle)> {
        self.lent
            .iter()
            .filter(|(_, &h)| pred(h))
            .map(|(&v, &h)| (v, h))
            .collect()
    }

    /// The aliases here of the pages in `handles` (va, handle), in no particular order.
    /// O(handles).
    pub fn lent_of<'a>(
        &'a self,
        handles: impl IntoIterator<Item = &'a PhysHandle> + 'a,
    ) -> impl Iterator<Item = (u64, PhysHandle)> + 'a {
        handles
            .into_iter()
            .flat_map(|&h| self.lent.of(h).iter().map(move |&va| (va, h)))
    }

    /// Whether a lent block here maps `h`. O(1).
    pub fn aliases(&self, h: PhysHandle) -> bool {
        !self.lent.of(h).is_empty()
    }

    /// The pages that lent blocks here map, each once. O(those pages).
    pub fn aliased_handles(&self) -> impl Iterator<Item = PhysHandle> + '_ {
        self.lent.handles()
    }

    /// The handles of the interior pages of this arena's free mapped blocks freed at or
    /// before `freed_until` (the pages a stitch or a reuse may take from here), added to
    /// `out`. O(those pages).
    pub fn free_interior_handles(
        &self,
        freed_until: u64,
        out: &mut rustc_hash::FxHashSet<PhysHandle>,
    ) {
        let all = freed_until >= self.last_free;
        for &(n, addr) in self.stealable.settled() {
            let old_enough = all
                || matches!(
                    self.blocks.get(&addr).map(|b| b.state),
                    Some(BlockState::FreeMapped { freed }) if freed <= freed_until
                );
            if !old_enough {
                continue;
            }
            let first = self.ceil(addr);
            out.extend(
                self.pages
                    .range(first..first + n * self.page)
                    .map(|(_, p)| p.handle),
            );
        }
    }

    /// The clean spans around the lent pages at `clean` (addresses of aliases here, sorted
    /// and without repeats): each maximal run of consecutive pages of `clean`, extended over
    /// the free mapped blocks before and after it, and joined to the next run where those
    /// meet, as (start, end) in address order. A reuse window with no busy alias covers such pages and free
    /// mapped blocks only, so it lies in one of these spans: a span shorter than a request
    /// holds no such window for it. The spans may be longer than the scan's regions (a run
    /// is not cut at a chunk boundary), never shorter. O(runs) block lookups, each a hash
    /// probe; the aliases, busy ones included, are not walked.
    pub fn clean_spans(&self, clean: &[u64]) -> Vec<(u64, u64)> {
        let page = self.page;
        let free_before = |mut s: u64| {
            while let Some((a, b)) = self.blocks.ending_at(s) {
                if !matches!(b.state, BlockState::FreeMapped { .. }) {
                    break;
                }
                s = a;
            }
            s
        };
        let free_after = |mut e: u64| {
            while let Some(b) = self.blocks.get(&e) {
                if !matches!(b.state, BlockState::FreeMapped { .. }) {
                    break;
                }
                e += b.size;
            }
            e
        };
        let mut spans: Vec<(u64, u64)> = Vec::new();
        let mut i = 0;
        while i < clean.len() {
            // The run of consecutive clean pages from clean[i].
            let s = clean[i];
            let mut e = s + page;
            i += 1;
            while i < clean.len() && clean[i] == e {
                e += page;
                i += 1;
            }
            let (s, e) = (free_before(s), free_after(e));
            match spans.last_mut() {
                // Joined where the free blocks between two runs meet.
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => spans.push((s, e)),
            }
        }
        spans
    }

    /// The regions (maximal runs of adjacent free mapped and lent blocks of one chunk) that
    /// hold a lent block, in address order, from the region of the first lent block at or
    /// after `from`. Each region is found from its first lent block at or after the end of
    /// the region before (one query of the ordered lent starts), then walked by hash from its
    /// start, so the blocks between regions are never visited: O(log n) a region, and the
    /// region's blocks.
    pub fn lent_regions_from(&self, from: u64) -> LentRegions<'_> {
        LentRegions { arena: self, from }
    }

    /// Where the region of lent block `l` starts, and its chunk: the free mapped and lent
    /// blocks right before it, by hash.
    fn region_start(&self, l: u64) -> (u64, u32) {
        let mut start = l;
        let chunk = self.blocks.get(&l).map_or(0, |b| b.chunk);
        while let Some((pa, p)) = self.blocks.ending_at(start) {
            if p.chunk != chunk || !p.reusable() {
                break;
            }
            start = pa;
        }
        (start, chunk)
    }

    /// Every lent alias: made unmapped free space (the caller unmaps them before releasing
    /// the lock). Returns (va, handle) of each.
    pub fn drain_lent(&mut self) -> Vec<(u64, PhysHandle)> {
        let blocks = self.lent_blocks();
        for (addr, _) in blocks {
            if let Some(b) = self.take(addr) {
                self.insert_free_unmapped(addr, b.size, b.chunk);
                self.refresh_ext(addr + b.size);
            }
        }
        self.lent.take_all()
    }

    /// Active pages in [lo, hi): (va, page).
    pub fn pages_in(&self, lo: u64, hi: u64) -> impl Iterator<Item = (u64, Page)> + '_ {
        self.pages.range(lo..hi).map(|(&v, &p)| (v, p))
    }

    /// Number of active pages.
    pub fn active_pages(&self) -> u64 {
        self.pages.len() as u64
    }

    /// Records a page mapped at `va` by the allocator.
    pub fn insert_page(&mut self, va: u64, page: Page) {
        self.pages.insert(va, page);
    }

    /// Forgets the page at `va` (a failed map undone).
    pub fn remove_page(&mut self, va: u64) -> Option<Page> {
        self.pages.remove(&va)
    }

    /// A retired range has been unmapped: it becomes free unmapped space.
    pub fn unretire(&mut self, addr: u64) {
        if let Some(b) = self.blocks.get(&addr).copied() {
            if b.state == BlockState::Retired {
                self.take(addr);
                self.insert_free_unmapped(addr, b.size, b.chunk);
                self.refresh_ext(addr + b.size);
            }
        }
    }

    /// Applies the deferred changes of the index of blocks by interior pages, which the
    /// queries below read (a miss that stitches, memory returned). The ordered block starts
    /// are settled by the queries that search them (`BlockMap::settle`); the reuse scan's
    /// regions are found through the lent starts and walked by hash, and do not.
    pub fn settle(&mut self) {
        self.stealable.settle();
    }

    /// Applies the logged changes of the ordered block starts, for a caller about to search
    /// them (`range` from any address: a placement's stitch; cheaper settled than merged).
    pub fn settle_blocks(&mut self) {
        self.blocks.settle();
    }

    /// Candidate blocks to take pages from, in the order a strategy wants them (the arena
    /// settled since its last change).
    /// Smallest block with at least `pages` interior pages.
    pub fn smallest_with(&self, pages: u64) -> Option<(u64, u64)> {
        self.stealable.settled().range((pages, 0)..).next().copied()
    }

    /// Block with the most interior pages.
    pub fn largest(&self) -> Option<(u64, u64)> {
        self.stealable.settled().iter().next_back().copied()
    }

    /// The next block below (pages, addr) in interior-page order.
    pub fn largest_below(&self, pages: u64, addr: u64) -> Option<(u64, u64)> {
        self.stealable
            .settled()
            .range(..(pages, addr))
            .next_back()
            .copied()
    }

    /// Least recently freed block with interior pages: (freed, addr).
    pub fn oldest(&self) -> Option<(u64, u64)> {
        self.by_age.iter().next().copied()
    }

    /// Whether LRU order is tracked.
    pub fn tracks_age(&self) -> bool {
        self.track_age
    }

    pub fn largest_free_mapped(&self) -> u64 {
        self.free_mapped.last().map_or(0, |e| e.0)
    }

    /// The block containing `ptr`: (start, block).
    pub fn block_containing(&self, ptr: u64) -> Option<(u64, Block)> {
        let (a, &b) = self.blocks.last_at_or_before(ptr)?;
        (ptr < a + b.size).then_some((a, b))
    }

    /// The start of the free mapped block containing `addr`, if one does.
    pub fn free_mapped_start(&self, addr: u64) -> Option<u64> {
        self.block_containing(addr)
            .filter(|(_, b)| matches!(b.state, BlockState::FreeMapped { .. }))
            .map(|(a, _)| a)
    }

    /// Whether the block at `addr` comes right after a live block: for a free block, the rest
    /// of a run after its last live block so far (a tail), where that block's successor
    /// (a cache one token longer, the next step's slightly larger tensor) goes as a hit.
    pub fn after_live(&self, addr: u64) -> bool {
        self.blocks
            .get(&addr)
            .and_then(|b| self.prev_of(addr, b.chunk))
            .is_some_and(|(_, p)| p.state == BlockState::Live)
    }

    /// The live block containing `ptr`: (base, size).
    pub fn live_containing(&self, ptr: u64) -> Option<(u64, u64)> {
        let (a, b) = self.blocks.last_at_or_before(ptr)?;
        (b.state == BlockState::Live && ptr < a + b.size).then_some((a, b.size))
    }

    pub fn blocks(&self) -> impl Iterator<Item = (u64, &Block)> + '_ {
        self.blocks.iter().map(|(&a, b)| (a, b))
    }

    /// (count, bytes) of the free mapped blocks in runs of mapped blocks with no live block
    /// (cached, not split: `inactive_split` leaves them out). O(blocks changed since the last
    /// call), or O(blocks) after many changes without one (`freeruns.rs`).
    pub fn whole_free_runs(&mut self) -> (u64, u64) {
        self.blocks.settle();
        let mut runs = std::mem::take(&mut self.runs);
        self.settle_runs(&mut runs);
        self.runs = runs;
        self.runs.totals()
    }

    /// Brings `runs` up to date: walks the runs around the touched blocks, or recounts.
    fn settle_runs(&self, runs: &mut FreeRuns) {
        runs.set_limit(self.blocks.len());
        if !runs.known() {
            runs.restart();
            for (addr, size) in self.recount_whole_free() {
                runs.set(addr, size, true);
            }
            return;
        }
        let mut frees = Vec::new();
        // The blocks the last walk visited: every free one among them has its status, so a
        // touched address inside needs no walk of its own (the touched addresses come in
        // order; without this, k touched blocks of one run, parked quick blocks freed in a
        // row, walked the run k times).
        let mut walked = (0u64, 0u64);
        for addr in runs.take_touched() {
            if (walked.0..walked.1).contains(&addr) {
                continue;
            }
            let Some((start, b)) = self.block_containing(addr) else {
                continue; // its chunk is gone
            };
            if is_mapped(b.state) {
                walked = self.settle_run(start, b, runs, &mut frees);
                continue;
            }
            // A breaker: the runs on either side may have lost or gained blocks.
            if let Some((pa, p)) = self.prev_of(start, b.chunk) {
                if is_mapped(p.state) {
                    self.settle_run(pa, p, runs, &mut frees);
                }
            }
            let end = start + b.size;
            if let Some(n) = self.next_of(end, b.chunk) {
                if is_mapped(n.state) {
                    walked = self.settle_run(end, n, runs, &mut frees);
                }
            }
        }
    }

    /// Sets the status of the free blocks of the run holding mapped block `b` at `start`,
    /// walking both ways to the first live block or the run's end (see `freeruns.rs` for why
    /// that suffices). Every free block it visits gets its run's status, whichever block the
    /// walk started from. Returns the span of the blocks visited, [lowest start, highest end).
    fn settle_run(
        &self,
        start: u64,
        b: Block,
        runs: &mut FreeRuns,
        frees: &mut Vec<(u64, u64)>,
    ) -> (u64, u64) {
        frees.clear();
        let mut live = b.state == BlockState::Live;
        if is_free_mapped(b.state) {
            frees.push((start, b.size));
        }
        let chunk = b.chunk;
        let before =
            std::iter::successors(self.prev_of(start, chunk), |&(a, _)| self.prev_of(a, chunk));
        let after = std::iter::successors(
            self.next_of(start + b.size, chunk)
                .map(|n| (start + b.size, n)),
            |&(a, n)| self.next_of(a + n.size, chunk).map(|m| (a + n.size, m)),
        );
        live |= free_until_live(before, frees);
        live |= free_until_live(after, frees);
        let mut span = (start, start + b.size);
        for &(addr, size) in frees.iter() {
            runs.set(addr, size, !live);
            span = (span.0.min(addr), span.1.max(addr + size));
        }
        span
    }

    /// The free mapped blocks in runs with no live block, counted from every block.
    fn recount_whole_free(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let (mut run, mut run_live, mut end) = (Vec::new(), false, u64::MAX);
        let mut close = |run: &mut Vec<(u64, u64)>, live: bool| {
            if !live {
                out.append(run);
            }
            run.clear();
        };
        for (addr, b) in self.blocks() {
            if !is_mapped(b.state) {
                end = u64::MAX; // the next mapped block starts a run
                continue;
            }
            if addr != end {
                close(&mut run, run_live);
                run_live = false;
            }
            if is_free_mapped(b.state) {
                run.push((addr, b.size));
            }
            run_live |= b.state == BlockState::Live;
            end = addr + b.size;
        }
        close(&mut run, run_live);
        out
    }

    /// The kept whole free blocks, once settled, are the recounted ones.
    pub fn check_free_runs(&self) -> Result<(), String> {
        let mut runs = self.runs.clone();
        self.settle_runs(&mut runs);
        let mut kept: Vec<(u64, u64)> = runs.blocks().collect();
        kept.sort_unstable();
        let counted = self.recount_whole_free();
        if kept != counted {
            return Err(format!(
                "free blocks of runs with no live block: kept {} ({} bytes), recounted {} ({} bytes)",
                kept.len(),
                runs.totals().1,
                counted.len(),
                counted.iter().map(|b| b.1).sum::<u64>()
            ));
        }
        Ok(())
    }

    /// Verifies the invariants above; returns a description of the first violation.
    pub fn check(&self) -> Result<(), String> {
        self.blocks.check()?;
        let mut fm = (0u64, 0u64, 0u64);
        // Free mapped blocks with interior pages: (pages, addr).
        let mut stealable = Vec::new();
        let (mut lent_pages, mut lent_blocks) = (0u64, 0usize);
        let mut unmapped_blocks = 0usize;
        for (id, &(start, size)) in self.chunks.iter().enumerate() {
            if size == 0 {
                continue;
            }
            let mut cursor = start;
            let mut prev_state: Option<BlockState> = None;
            for (&a, b) in self.blocks.range(start..start + size) {
                if a != cursor || b.chunk as usize != id {
                    return Err(format!(
                        "I1: gap or overlap at {a:#x} (expected {cursor:#x})"
                    ));
                }
                cursor = a + b.size;
                let (lo, hi) = (self.floor(a), self.ceil(a + b.size));
                let mapped = |p: u64| self.pages.contains_key(&p);
                match b.state {
                    BlockState::Live | BlockState::FreeMapped { .. } | BlockState::Quick { .. } => {
                        let mut p = lo;
                        while p < hi {
                            if !mapped(p) {
                                return Err(format!("I2: page {p:#x} of block {a:#x} unmapped"));
                            }
                            p += self.page;
                        }
                    }
                    BlockState::FreeUnmapped { .. }
                    | BlockState::Retired
                    | BlockState::Lent { .. } => {
                        if a % self.page != 0 || b.size % self.page != 0 {
                            return Err(format!("I3: unaligned unmapped block {a:#x}"));
                        }
                        if self.pages.range(a..a + b.size).next().is_some() {
                            return Err(format!("I3: unmapped block {a:#x} has pages"));
                        }
                        let aliases = self.lent.range(a..a + b.size).count() as u64;
                        let want = if matches!(b.state, BlockState::Lent { .. }) {
                            b.size / self.page
                        } else {
                            0
                        };
                        if aliases != want {
                            return Err(format!(
                                "I3: block {a:#x} has {aliases} lent pages, expected {want}"
                            ));
                        }
                        lent_pages += aliases;
                    }
                }
                let same = |x: Option<BlockState>, y: BlockState| {
                    matches!(
                        (x, y),
                        (
                            Some(BlockState::FreeMapped { .. }),
                            BlockState::FreeMapped { .. }
                        ) | (
                            Some(BlockState::FreeUnmapped { .. }),
                            BlockState::FreeUnmapped { .. }
                        ) | (Some(BlockState::Lent { .. }), BlockState::Lent { .. })
                    )
                };
                if same(prev_state, b.state) {
                    return Err(format!("I4: uncoalesced free blocks at {a:#x}"));
                }
                match b.state {
                    BlockState::Quick { .. } => {
                        if !self
                            .quick
                            .get(&b.size)
                            .is_some_and(|v| v.listed && v.heap.iter().any(|r| r.0 == a))
                        {
                            return Err(format!("I5: quick block {a:#x} not in its list"));
                        }
                        fm.0 += 1;
                        fm.1 += b.size;
                    }
                    BlockState::FreeMapped { .. } => {
                        if !self.free_mapped.contains(&(b.size, a)) {
                            return Err(format!("I5: {a:#x} missing from free_mapped"));
                        }
                        fm.0 += 1;
                        fm.1 += b.size;
                        let n = self.interior(a, b.size).1;
                        fm.2 += n;
                        if n > 0 {
                            stealable.push((n, a));
                        }
                    }
                    BlockState::FreeUnmapped { ext } => {
                        if ext != self.ext_of(a, b.size, b.chunk) {
                            return Err(format!("I5: stale ext at {a:#x}"));
                        }
                        if !self.unmapped.contains(&(ext, a)) || !self.unmapped_at.contains(&a) {
                            return Err(format!("I5: {a:#x} missing from unmapped"));
                        }
                        unmapped_blocks += 1;
                    }
                    BlockState::Lent { since } => {
                        if !self.lent_age.contains(&(since, a)) {
                            return Err(format!("I5: {a:#x} missing from lent_age"));
                        }
                        lent_blocks += 1;
                    }
                    _ => {}
                }
                prev_state = Some(b.state);
            }
            if cursor != start + size {
                return Err(format!("I1: chunk {start:#x} not fully covered"));
            }
        }
        if unmapped_blocks != self.unmapped.len() || unmapped_blocks != self.unmapped_at.len() {
            return Err(format!(
                "I5: {unmapped_blocks} unmapped blocks, {} and {} indexed",
                self.unmapped.len(),
                self.unmapped_at.len()
            ));
        }
        self.lent.check()?;
        if lent_pages != self.lent.len() as u64
            || lent_blocks != self.lent_age.len()
            || lent_blocks != self.lent_addrs.len()
        {
            return Err(format!(
                "I5: {} lent pages in {} blocks indexed, {lent_pages} in {lent_blocks} found",
                self.lent.len(),
                self.lent_age.len()
            ));
        }
        if fm
            != (
                self.free_mapped_count,
                self.free_mapped_bytes,
                self.stealable_pages,
            )
            || self.free_mapped.len() + self.quick_len != fm.0 as usize
        {
            return Err(format!(
                "I5: counters {:?} != recount {fm:?}",
                (
                    self.free_mapped_count,
                    self.free_mapped_bytes,
                    self.stealable_pages
                )
            ));
        }
        stealable.sort_unstable();
        let indexed = self.stealable.current();
        if !stealable.iter().eq(indexed.iter()) {
            return Err(format!(
                "I5: {} free mapped blocks with interior pages, {} indexed by them",
                stealable.len(),
                indexed.len()
            ));
        }
        // The quick lists: a size is listed exactly when its list says so, once, and every
        // parked block's list is listed (so a flush reaches it).
        let mut listed = self.quick_sizes.clone();
        listed.sort_unstable();
        if listed.windows(2).any(|w| w[0] == w[1]) {
            return Err("I5: a size listed twice in the quick lists".into());
        }
        for (size, list) in &self.quick {
            if list.listed != listed.binary_search(size).is_ok() {
                return Err(format!("I5: quick list of {size} bytes listed wrongly"));
            }
            if !list.heap.is_empty() && !list.listed {
                return Err(format!(
                    "I5: quick list of {size} bytes holds blocks, unlisted"
                ));
            }
        }
        if listed.iter().any(|s| !self.quick.contains_key(s)) {
            return Err("I5: a listed size has no quick list".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::GraphPoolId;
    use crate::stats::PoolKind;

    const P: u64 = 4096;
    const BASE: u64 = 0x10_0000;

    fn arena(track_age: bool) -> Arena {
        let key = ArenaKey {
            stream: 0,
            kind: PoolKind::Large,
            graph_pool: GraphPoolId::DEFAULT,
            gen: 0,
        };
        Arena::new(key, P, track_age)
    }

    /// Handle of the page at `va` in these tests: its page number.
    fn h(va: u64) -> PhysHandle {
        PhysHandle(va / P)
    }

    /// Places `size` bytes as the allocator does on a miss: maps the pages the placement asks
    /// for, then carves. Returns the block's address.
    fn place(a: &mut Arena, size: u64, now: u64) -> u64 {
        let pl = a.find_placement(size).expect("room for the placement");
        for i in 0..pl.map_pages {
            let va = pl.map_start + i * P;
            a.insert_page(
                va,
                Page {
                    handle: h(va),
                    stitched: false,
                },
            );
        }
        a.carve(pl.start, size, now);
        a.check().unwrap();
        pl.start
    }

    fn states(a: &Arena) -> Vec<(u64, u64, &'static str)> {
        a.blocks()
            .map(|(addr, b)| {
                let s = match b.state {
                    BlockState::Live => "live",
                    BlockState::FreeMapped { .. } => "free",
                    BlockState::FreeUnmapped { .. } => "unmapped",
                    BlockState::Lent { .. } => "lent",
                    BlockState::Retired => "retired",
                    BlockState::Quick { .. } => "quick",
                };
                ((addr - BASE) / 512, b.size / 512, s)
            })
            .collect()
    }

    /// Units of 512 bytes in these expectations: a page is 8.
    const U: u64 = P / 512;

    #[test]
    fn a_new_chunk_is_one_unmapped_block_and_drains_when_empty() {
        let mut a = arena(false);
        a.add_chunk(BASE, 8 * P);
        a.check().unwrap();
        assert_eq!(states(&a), vec![(0, 8 * U, "unmapped")]);
        assert_eq!(a.find_hit(512, f64::INFINITY), None);
        let pl = a.find_placement(3 * P).unwrap();
        assert_eq!(
            pl,
            Placement {
                start: BASE,
                neighbours: [None, None],
                map_start: BASE,
                map_pages: 3,
            }
        );
        assert_eq!(a.find_placement(9 * P), None, "larger than the chunk");
        assert_eq!(a.drain_empty_chunks(), vec![(BASE, 8 * P)]);
        assert_eq!(a.blocks().count(), 0);
        assert_eq!(a.drain_empty_chunks(), vec![], "drained once");
    }

    #[test]
    fn interior_counts_whole_pages_only() {
        let a = arena(false);
        assert_eq!(a.interior(BASE + P / 2, 3 * P), (BASE + P, 2));
        assert_eq!(a.interior(BASE, P / 2), (BASE, 0));
        assert_eq!(a.interior(BASE + 512, P), (BASE + P, 0));
        assert_eq!(a.interior(BASE, 2 * P), (BASE, 2));
    }

    #[test]
    fn a_placement_maps_whole_pages_and_leaves_the_tail_free_mapped() {
        let mut a = arena(false);
        a.add_chunk(BASE, 8 * P);
        let p = place(&mut a, P + P / 2, 1);
        assert_eq!(p, BASE);
        assert_eq!(
            states(&a),
            vec![
                (0, 3 * U / 2, "live"),
                (3 * U / 2, U / 2, "free"),
                (2 * U, 6 * U, "unmapped")
            ]
        );
        assert_eq!((a.live_blocks, a.free_mapped_count), (1, 1));
        assert_eq!(a.free_mapped_bytes, P / 2);
        assert_eq!(a.stealable_pages, 0, "the free half page is no whole page");
        assert_eq!(a.active_pages(), 2);
        assert_eq!(a.find_hit(P / 2, f64::INFINITY), Some(BASE + 3 * P / 2));
        // The next placement starts at the free mapped half page, reusing its page, and maps
        // only pages after it.
        let pl = a.find_placement(6 * P + P / 2).unwrap();
        assert_eq!(pl.start, BASE + 3 * P / 2);
        assert_eq!(pl.neighbours, [Some(BASE + 3 * P / 2), None]);
        assert_eq!((pl.map_start, pl.map_pages), (BASE + 2 * P, 6));
        assert_eq!(a.find_placement(6 * P + P / 2 + 512), None);
        assert_eq!(a.live_containing(BASE + 100), Some((BASE, P + P / 2)));
        assert_eq!(a.live_containing(BASE + 3 * P / 2), None, "free, not live");
        assert_eq!(
            a.block_containing(BASE + 5 * P).map(|(addr, _)| addr),
            Some(BASE + 2 * P)
        );
    }

    #[test]
    fn release_parks_a_block_in_the_quick_list_of_its_size() {
        let mut a = arena(false);
        a.add_chunk(BASE, 8 * P);
        let p = place(&mut a, 3000, 1);
        assert_eq!(a.release(p, 2), Some(3000));
        assert_eq!(a.release(p, 3), None, "not live any more");
        assert_eq!(a.release(BASE + 5 * P, 3), None, "no block there");
        a.check().unwrap();
        assert_eq!((a.live_blocks, a.last_free), (0, 2));
        assert_eq!(
            a.free_mapped_bytes, P,
            "the quick block and the rest of its page"
        );
        assert_eq!(a.take_quick(2048), None, "other sizes are not served");
        assert_eq!(a.take_quick(3000), Some(p));
        assert_eq!(a.take_quick(3000), None);
        assert_eq!(a.live_blocks, 1);
        a.check().unwrap();
    }

    #[test]
    fn quick_lists_are_kept_across_flushes_and_listed_once() {
        let mut a = arena(false);
        a.add_chunk(BASE, 8 * P);
        let p = place(&mut a, 3000, 1);
        // Freed and taken again and again with no flush in between (a loop of one size):
        // its size is listed for the next flush once, not once a free.
        for t in 2..1000 {
            assert_eq!(a.release(p, t), Some(3000));
            assert_eq!(a.take_quick(3000), Some(p));
        }
        assert_eq!(a.quick_sizes, vec![3000]);
        a.release(p, 1000);
        a.flush_quick();
        assert!(a.quick_sizes.is_empty());
        assert!(
            a.quick
                .get(&3000)
                .is_some_and(|l| l.heap.is_empty() && !l.listed),
            "the emptied list stays for the size's next free"
        );
        a.check().unwrap();
        let q = place(&mut a, 3000, 1001);
        assert_eq!(a.release(q, 1002), Some(3000));
        assert_eq!(a.quick_sizes, vec![3000]);
        a.check().unwrap();
        assert_eq!(a.take_quick(3000), Some(q));
        // Nothing parked, but the size still listed: a flush unlists it.
        a.flush_quick();
        assert!(a.quick_sizes.is_empty());
        a.check().unwrap();
        // Many sizes: the emptied lists are dropped past QUICK_SIZES_KEPT.
        let mut a = arena(false);
        a.add_chunk(BASE, 80_000 * P);
        let ps: Vec<u64> = (0..QUICK_SIZES_KEPT as u64 + 10)
            .map(|i| place(&mut a, 512 * (i + 1), i))
            .collect();
        for (i, &p) in ps.iter().enumerate() {
            a.release(p, 5000 + i as u64);
            if a.quick_full() {
                a.flush_quick();
            }
        }
        a.flush_quick();
        assert!(a.quick.len() <= QUICK_SIZES_KEPT);
        a.check().unwrap();
    }

    #[test]
    fn the_quick_lists_fill_and_flush_into_coalesced_blocks() {
        let mut a = arena(false);
        a.add_chunk(BASE, 1024 * P);
        let ps: Vec<u64> = (0..300).map(|i| place(&mut a, 2 * P, i)).collect();
        for (i, p) in ps.iter().enumerate() {
            assert_eq!(a.quick_full(), i > QUICK_CAPACITY, "after {i} frees");
            a.release(*p, 1000 + i as u64).unwrap();
        }
        assert!(a.quick_full());
        a.flush_quick();
        a.check().unwrap();
        assert!(!a.quick_full());
        // 300 blocks of 2 pages, adjacent: one free mapped block of 600 pages.
        assert_eq!(a.free_mapped_count, 1);
        assert_eq!(a.stealable_pages, 600);
        assert_eq!(a.find_hit(600 * P, f64::INFINITY), Some(BASE));
        a.settle();
        assert_eq!(a.largest(), Some((600, BASE)));
    }

    #[test]
    fn find_hit_takes_the_best_fit_within_the_reuse_limit() {
        let mut a = arena(false);
        a.add_chunk(BASE, 64 * P);
        let blocks: Vec<u64> = [4 * P, P, 2 * P, P]
            .iter()
            .map(|&s| place(&mut a, s, 1))
            .collect();
        // Free the 4-page and 2-page blocks; live 1-page blocks keep them apart.
        a.release(blocks[0], 2).unwrap();
        a.release(blocks[2], 3).unwrap();
        a.flush_quick();
        a.check().unwrap();
        assert_eq!(a.find_hit(P, f64::INFINITY), Some(blocks[2]), "best fit");
        assert_eq!(a.find_hit(3 * P, f64::INFINITY), Some(blocks[0]));
        assert_eq!(a.find_hit(P, 1.5), None, "2 pages for 1 exceeds 1.5x");
        assert_eq!(a.find_hit(P, 2.0), Some(blocks[2]));
        assert_eq!(a.largest_free_mapped(), 4 * P);
        a.settle();
        assert_eq!(a.smallest_with(2), Some((2, blocks[2])));
        assert_eq!(a.smallest_with(3), Some((4, blocks[0])));
        assert_eq!(a.largest_below(4, blocks[0]), Some((2, blocks[2])));
        assert_eq!(a.free_interior_in(BASE, BASE + 64 * P), 6);
    }

    #[test]
    fn lru_order_is_tracked_only_when_asked() {
        for track in [false, true] {
            let mut a = arena(track);
            a.add_chunk(BASE, 64 * P);
            let blocks: Vec<u64> = (0..4).map(|_| place(&mut a, 2 * P, 1)).collect();
            a.release(blocks[2], 5).unwrap();
            a.release(blocks[0], 7).unwrap();
            a.flush_quick();
            assert_eq!(a.tracks_age(), track);
            assert_eq!(a.oldest(), track.then_some((5, blocks[2])));
        }
    }

    /// A chunk of 8 pages: live page 0, free mapped pages 1-4 (stealable), live page 5, the
    /// rest unmapped. Returns (arena, address of the free block).
    fn with_free_block() -> (Arena, u64) {
        let mut a = arena(true);
        a.add_chunk(BASE, 8 * P);
        place(&mut a, P, 1);
        let f = place(&mut a, 4 * P, 1);
        place(&mut a, P, 1);
        a.release(f, 2).unwrap();
        a.flush_quick();
        a.check().unwrap();
        assert_eq!(a.stealable_pages, 4);
        (a, f)
    }

    #[test]
    fn region_walk_jumps_over_long_runs_of_live_blocks() {
        // Lent region, 40 live blocks, a free block with no lent page (not a region of the
        // walk), 40 live blocks, lent region: more live blocks in a row than the walk steps
        // over before it jumps through the lent index.
        let mut a = arena(true);
        a.add_chunk(BASE, 128 * P);
        place(&mut a, P, 1);
        let f1 = place(&mut a, 4 * P, 1);
        let run = |a: &mut Arena| {
            for _ in 0..40 {
                place(a, P, 1);
            }
        };
        run(&mut a);
        let f2 = place(&mut a, 2 * P, 1);
        run(&mut a);
        let f3 = place(&mut a, 4 * P, 1);
        place(&mut a, P, 1);
        for f in [f1, f2, f3] {
            a.release(f, 2).unwrap();
        }
        a.flush_quick();
        a.take_pages(f1, 2, Take::Lend(3));
        a.take_pages(f3, 4, Take::Lend(3));
        a.check().unwrap();
        let mut out = Vec::new();
        for from in [0, f1 + 2 * P, f1 + 3 * P] {
            let mut w = a.lent_regions_from(from);
            let mut got = Vec::new();
            while let Some(l) = w.next_into(&mut out) {
                got.push((l, out.iter().map(|r| r.0).collect::<Vec<_>>()));
            }
            let mut want = vec![(f3, vec![f3])];
            if from <= f1 + 2 * P {
                want.insert(0, (f1 + 2 * P, vec![f1, f1 + 2 * P]));
            }
            assert_eq!(got, want, "from {from:#x}");
        }
    }

    #[test]
    fn clean_spans_run_over_free_blocks_and_clean_pages_and_stop_at_a_busy_page() {
        // live | free 2P | lent 2P | live | unmapped
        let (mut a, f) = with_free_block();
        a.take_pages(f, 2, Take::Lend(5));
        assert_eq!(a.lent_pages(), 2);
        // Both lent pages clean: the span takes in the free block before them and ends at
        // the live block after them; given once although two pages start it.
        assert_eq!(a.clean_spans(&[f + 2 * P, f + 3 * P]), vec![(f, f + 4 * P)]);
        // The first lent page busy: the span is the second page alone.
        assert_eq!(a.clean_spans(&[f + 3 * P]), vec![(f + 3 * P, f + 4 * P)]);
        // The second busy: the free block and the first page.
        assert_eq!(a.clean_spans(&[f + 2 * P]), vec![(f, f + 3 * P)]);
        // Nothing clean: no span.
        assert_eq!(a.clean_spans(&[]), vec![]);
    }

    #[test]
    fn lent_pages_stay_mapped_and_come_back_with_no_driver_call() {
        let (mut a, f) = with_free_block();
        let (start, hs) = a.take_pages(f, 2, Take::Lend(5));
        assert_eq!(start, f + 2 * P, "taken from the top of the block");
        assert_eq!(hs, vec![h(f + 2 * P), h(f + 3 * P)]);
        a.check().unwrap();
        assert_eq!(
            states(&a),
            vec![
                (0, U, "live"),
                (U, 2 * U, "free"),
                (3 * U, 2 * U, "lent"),
                (5 * U, U, "live"),
                (6 * U, 2 * U, "unmapped")
            ]
        );
        assert_eq!(a.lent_pages(), 2);
        assert_eq!(a.stealable_pages, 2);
        // Stamped with the block's free (2), not the lending (5): only work queued before
        // the free may still use these addresses.
        assert_eq!(a.oldest_lent(), Some((2, f + 2 * P, 2)));
        assert_eq!(a.lent_since(f + 3 * P), Some(2));
        assert_eq!(a.lent_since(f), None, "free mapped, not lent");
        assert_eq!(a.lent_at(f + 3 * P), Some(h(f + 3 * P)));
        assert_eq!(a.lent_blocks(), vec![(f + 2 * P, 2 * P)]);
        // The regions a reuse may cover: the free block and the lent one, found from any
        // address up to the lent block (the walk starts at the region's first block, even
        // before `from`); none after it.
        let mut blocks = Vec::new();
        for from in [0, f, f + 2 * P] {
            let mut regions = a.lent_regions_from(from);
            assert_eq!(
                regions.next_into(&mut blocks),
                Some(f + 2 * P),
                "first lent block"
            );
            let region: Vec<u64> = blocks.iter().map(|r| r.0).collect();
            assert_eq!(region, vec![f, f + 2 * P], "from {from:#x}");
            assert_eq!(regions.next_into(&mut blocks), None);
        }
        assert_eq!(a.lent_regions_from(f + 3 * P).next_into(&mut blocks), None);
        assert!(blocks.is_empty());
        assert_eq!(
            a.lent_matching(|x| x == h(f + 2 * P)),
            vec![(f + 2 * P, h(f + 2 * P))]
        );
        assert_eq!(a.lent_in(f, f + 3 * P).count(), 1);
        // Taking the lower lent page back: free mapped again, coalesced with the free block.
        assert_eq!(a.claim_lent(f + 2 * P, 6, true), Some(h(f + 2 * P)));
        assert_eq!(a.claim_lent(f + 2 * P, 6, true), None, "not lent any more");
        a.check().unwrap();
        assert_eq!(
            states(&a)[1..3],
            [(U, 3 * U, "free"), (4 * U, U, "lent")],
            "{:?}",
            states(&a)
        );
        assert!(a.pages_in(f + 2 * P, f + 3 * P).all(|(_, p)| p.stitched));
        a.set_stitched(f + 2 * P, false);
        assert!(a.pages_in(f + 2 * P, f + 3 * P).all(|(_, p)| !p.stitched));
        // The last alias unmapped: unmapped free space (a live page keeps it apart from the
        // unmapped end of the chunk).
        assert_eq!(a.unmap_lent_page(f + 3 * P), Some(h(f + 3 * P)));
        a.check().unwrap();
        assert_eq!(a.lent_pages(), 0);
        assert_eq!(states(&a)[2], (4 * U, U, "unmapped"));
    }

    #[test]
    fn lend_page_at_takes_one_interior_page_of_a_free_block() {
        let (mut a, f) = with_free_block();
        assert!(a.page_is_free(f + P));
        assert!(!a.page_is_free(BASE), "live");
        assert_eq!(a.lend_page_at(BASE, 3), None);
        assert_eq!(a.lend_page_at(f + P, 3), Some(h(f + P)));
        assert!(!a.page_is_free(f + P));
        a.check().unwrap();
        assert_eq!(
            states(&a)[1..4],
            [(U, U, "free"), (2 * U, U, "lent"), (3 * U, 2 * U, "free")]
        );
        assert_eq!(a.stealable_pages, 3);
    }

    #[test]
    fn retired_pages_become_unmapped_space_once_unretired() {
        let (mut a, f) = with_free_block();
        let (start, hs) = a.take_pages(f, 10, Take::Retire);
        assert_eq!((start, hs.len()), (f, 4), "at most the block's pages");
        assert_eq!(a.retired_blocks, 1);
        a.check().unwrap();
        assert_eq!(states(&a)[1], (U, 4 * U, "retired"));
        assert_eq!(
            a.find_placement(4 * P).map(|p| p.start),
            None,
            "not placeable yet"
        );
        a.unretire(f);
        a.check().unwrap();
        assert_eq!(a.retired_blocks, 0);
        assert_eq!(states(&a)[1], (U, 4 * U, "unmapped"));
        assert_eq!(a.find_placement(4 * P).map(|p| p.start), Some(f));
        a.unretire(f); // not retired: nothing happens
        a.check().unwrap();
    }

    #[test]
    fn taking_pages_to_unmap_coalesces_with_unmapped_space() {
        let mut a = arena(false);
        a.add_chunk(BASE, 8 * P);
        place(&mut a, P, 1);
        let f = place(&mut a, 3 * P, 1);
        a.release(f, 2).unwrap();
        a.flush_quick();
        // Pages 1-3 free mapped, 4-7 unmapped: the unmapped block's ext includes them.
        let (start, hs) = a.take_pages(f, 2, Take::Unmap);
        assert_eq!((start, hs.len()), (f + P, 2));
        a.check().unwrap();
        assert_eq!(
            states(&a),
            vec![(0, U, "live"), (U, U, "free"), (2 * U, 6 * U, "unmapped")]
        );
        // The placement covering page 1 and the unmapped rest.
        let pl = a.find_placement(7 * P).unwrap();
        assert_eq!((pl.start, pl.map_start, pl.map_pages), (f, f + P, 6));
        assert_eq!(a.take_pages(BASE, 1, Take::Unmap), (0, vec![]), "live");
    }

    #[test]
    fn retire_lent_and_drain_lent_give_back_aliases() {
        let (mut a, f) = with_free_block();
        a.take_pages(f, 4, Take::Lend(3));
        assert_eq!(a.lent_pages(), 4);
        assert_eq!(a.retire_lent(f + P, 2), vec![h(f + P), h(f + 2 * P)]);
        a.check().unwrap();
        assert_eq!(
            states(&a)[1..4],
            [
                (U, U, "lent"),
                (2 * U, 2 * U, "retired"),
                (4 * U, U, "lent")
            ]
        );
        assert_eq!(a.retire_lent(f + P, 1), vec![], "not lent");
        let mut drained = a.drain_lent();
        drained.sort();
        assert_eq!(drained, vec![(f, h(f)), (f + 3 * P, h(f + 3 * P))]);
        a.check().unwrap();
        assert_eq!(a.lent_pages(), 0);
        assert!(a.lent_blocks().is_empty());
    }

    #[test]
    fn mapped_runs_split_at_chunk_boundaries() {
        let mut a = arena(false);
        a.add_chunk(BASE, 2 * P);
        a.add_chunk(BASE + 2 * P, 2 * P);
        a.add_chunk(BASE + 8 * P, 2 * P);
        place(&mut a, 2 * P, 1);
        place(&mut a, 2 * P, 1);
        place(&mut a, P, 1);
        assert_eq!(
            a.mapped_runs(),
            vec![(BASE, 2 * P), (BASE + 2 * P, 2 * P), (BASE + 8 * P, P)]
        );
    }

    #[test]
    fn free_blocks_of_touching_chunks_stay_apart() {
        // Chunk B starts where chunk A ends: the block before B's first block by address is
        // A's last, which coalescing must not take (blocks are found by their end now).
        let mut a = arena(false);
        a.add_chunk(BASE, 2 * P);
        a.add_chunk(BASE + 2 * P, 2 * P);
        let x = place(&mut a, 2 * P, 1);
        let y = place(&mut a, 2 * P, 1);
        assert_eq!((x, y), (BASE, BASE + 2 * P));
        a.release(x, 2);
        a.release(y, 3);
        a.flush_quick();
        a.check().unwrap();
        // (offset, size) in 512-byte units from BASE.
        let u = 2 * P / 512;
        assert_eq!(states(&a), vec![(0, u, "free"), (u, u, "free")]);
        // A carve across a block boundary, ending where the removed block ended, and the
        // coalescing after it: the map of ends stays right (`BlockMap::forget_end`).
        a.carve(BASE, P, 4);
        a.carve(BASE + P, P, 4);
        a.release(BASE, 5);
        a.release(BASE + P, 6);
        a.flush_quick();
        a.check().unwrap();
        assert_eq!(a.find_hit(2 * P, f64::INFINITY), Some(BASE));
    }

    #[test]
    fn check_finds_a_block_on_an_unmapped_page() {
        let mut a = arena(false);
        a.add_chunk(BASE, 4 * P);
        place(&mut a, 2 * P, 1);
        a.check().unwrap();
        let gone = a.remove_page(BASE + P).unwrap();
        assert_eq!(gone.handle, h(BASE + P));
        let e = a.check().unwrap_err();
        assert!(e.starts_with("I2"), "{e}");
        a.insert_page(BASE + P, gone);
        a.check().unwrap();
        // A page where the block is unmapped breaks I3.
        a.insert_page(
            BASE + 3 * P,
            Page {
                handle: h(BASE + 3 * P),
                stitched: false,
            },
        );
        let e = a.check().unwrap_err();
        assert!(e.starts_with("I3"), "{e}");
    }
}
