//! The memory debugging mode's side of the allocator (`GMLAKE_CONF=debug:...`, see
//! [`crate::debug`]): guard pages, canary padding and the quarantine. `State::debug` is
//! `None` when the mode is off, and every hook in the hot path is one test of it.
//!
//! Guarded allocations live outside the arenas: each has its own reservation of
//! `front + n + 1` pages (`front` 1 with `guard_front`), its `n` pages mapped after the
//! front guard and the last page left unmapped. The block ends where the mapped pages end
//! (`ptr = mapped_end - rounded size`, so 512-byte aligned), and a write past its rounded size
//! faults. Its pages are its own (created for it, or recycled from earlier guarded ranges);
//! they count in reserved bytes as large-pool segments.
//!
//! A freed guarded range is unmapped only after events recorded on its streams at free time
//! complete (its kernels may still run), then its reservation stays (nothing mapped: any
//! access faults) while it is in the quarantine; it counts as active until it is unmapped. Freed arena blocks in quarantine stay live
//! in their arena (as pending frees, so they count as active) until they leave it.

use super::*;
use crate::debug::DebugConfig;

/// Spare pages kept for later guarded ranges (beyond this, freed pages go back at once).
const MAX_SPARE_PAGES: usize = 512;

/// What the allocation hook decided.
pub(super) enum DebugAlloc {
    /// Placed between guard pages: the pointer.
    Placed(DevicePtr),
    /// Served by the arenas, with this (padded) rounded size.
    Size(u64),
}

struct Guarded {
    ptr: DevicePtr,
    /// The reservation and the first mapped page.
    va: u64,
    va_len: u64,
    map_start: u64,
    pages: Vec<PhysHandle>,
    size: u64,
    requested: u64,
    stream: StreamId,
    extra: Vec<StreamId>,
}

enum Held {
    /// A freed arena block, still live in its arena.
    Block { ptr: DevicePtr, bytes: u64 },
    /// A freed guarded range: its events (empty while a capture deferred them), and whether
    /// its pages are unmapped yet.
    Range {
        g: Box<Guarded>,
        events: Vec<EventHandle>,
        deferred: bool,
        unmapped: bool,
    },
}

impl Held {
    fn bytes(&self) -> u64 {
        match self {
            Held::Block { bytes, .. } => *bytes,
            Held::Range { g, .. } => g.size,
        }
    }
}

pub(super) struct DebugState {
    cfg: DebugConfig,
    /// Smallest request given guard pages.
    guard_min: u64,
    /// Live guarded allocations by pointer.
    guarded: BTreeMap<DevicePtr, Guarded>,
    held: VecDeque<Held>,
    held_bytes: u64,
    /// Held ranges whose pages are still mapped.
    waiting: usize,
    spare: Vec<PhysHandle>,
    /// Pages held by the mode: mapped in guarded ranges, waiting to be unmapped, spare.
    pages: u64,
    canary_errors: u64,
}

impl DebugState {
    /// The mode's state, or `None` when it is off.
    pub(super) fn new(cfg: &DebugConfig, page: u64) -> Option<Box<DebugState>> {
        cfg.enabled().then(|| {
            Box::new(DebugState {
                cfg: cfg.clone(),
                guard_min: if cfg.guard_min == 0 {
                    page
                } else {
                    cfg.guard_min
                },
                guarded: BTreeMap::new(),
                held: VecDeque::new(),
                held_bytes: 0,
                waiting: 0,
                spare: Vec::new(),
                pages: 0,
                canary_errors: 0,
            })
        })
    }

    fn over_limit(&self) -> bool {
        let c = &self.cfg;
        !c.quarantine()
            || (c.quarantine_count > 0 && self.held.len() as u64 > c.quarantine_count)
            || (c.quarantine_bytes > 0 && self.held_bytes > c.quarantine_bytes)
    }

    fn containing(&self, ptr: DevicePtr) -> Option<(&DevicePtr, &Guarded)> {
        self.guarded
            .range(..=ptr)
            .next_back()
            .filter(|(&base, g)| ptr < base + g.size.max(1))
    }
}

impl State {
    /// Runs `f` with the debug state taken out of `self` (so that `f` may call the rest of
    /// the allocator, whose hooks then see the mode as off), and puts it back.
    fn with_debug<R>(
        &mut self,
        f: impl FnOnce(&mut State, &mut DebugState) -> Result<R>,
    ) -> Result<R> {
        let mut d = self.debug.take().expect("debug mode is on");
        let r = f(self, &mut d);
        self.debug = Some(d);
        r
    }

    /// The allocation hook: progresses the quarantine, then places the request between guard
    /// pages or pads it for canaries.
    pub(super) fn debug_allocate<D: Device>(
        &mut self,
        dev: &D,
        requested: u64,
        size: u64,
        stream: StreamId,
        pool: GraphPoolId,
    ) -> Result<DebugAlloc> {
        self.with_debug(|st, d| {
            st.debug_tick(dev, d)?;
            if d.cfg.guard
                && pool == GraphPoolId::DEFAULT
                && st.captures == 0
                && requested >= d.guard_min
            {
                return st.place_guarded(dev, d, requested, size, stream);
            }
            if d.cfg.canary {
                // At least the canary bytes after the request, over any rounding of its own.
                let padded = round_request(requested.saturating_add(d.cfg.canary_bytes))?;
                return Ok(DebugAlloc::Size(size.max(padded)));
            }
            Ok(DebugAlloc::Size(size))
        })
    }

    fn place_guarded<D: Device>(
        &mut self,
        dev: &D,
        d: &mut DebugState,
        requested: u64,
        size: u64,
        stream: StreamId,
    ) -> Result<DebugAlloc> {
        let page = self.page;
        let n = size.div_ceil(page);
        let front = d.cfg.guard_front as u64;
        let va_len = (front + n + 1) * page;
        let va = drv!(
            self,
            reserve_va,
            dev.reserve_va(va_len as usize, page as usize)
        )?;
        let map_start = va + front * page;
        let mut pages: Vec<PhysHandle> = Vec::with_capacity(n as usize);
        let mut result = Ok(());
        for i in 0..n {
            let h = match d.spare.pop() {
                Some(h) => h,
                None => match self.debug_create_page(dev, d, requested) {
                    Ok(h) => h,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                },
            };
            if let Err(e) = drv!(self, map, dev.map(map_start + i * page, page as usize, h)) {
                d.spare.push(h);
                result = Err(e.into());
                break;
            }
            pages.push(h);
        }
        if result.is_ok() {
            result = drv!(
                self,
                set_access,
                dev.set_access(map_start, (n * page) as usize)
            )
            .map_err(Error::from);
        }
        if let Err(e) = result {
            for (i, h) in pages.into_iter().enumerate() {
                let _ = drv!(
                    self,
                    unmap,
                    dev.unmap(map_start + i as u64 * page, page as usize)
                );
                d.spare.push(h);
            }
            let _ = drv!(self, free_va, dev.free_va(va, va_len as usize));
            return Err(e);
        }
        let ptr = map_start + n * page - size;
        d.guarded.insert(
            ptr,
            Guarded {
                ptr,
                va,
                va_len,
                map_start,
                pages,
                size,
                requested,
                stream,
                extra: Vec::new(),
            },
        );
        let kind = PoolKind::Large;
        let s = &mut self.stats;
        s.allocation.increase(kind, 1);
        s.allocated_bytes.increase(kind, size as i64);
        s.requested_bytes.increase(kind, requested as i64);
        s.active.increase(kind, 1);
        s.active_bytes.increase(kind, size as i64);
        self.trace(TraceAction::Alloc, ptr, size, stream);
        Ok(DebugAlloc::Placed(ptr))
    }

    /// A new page for a guarded range; on out-of-memory, cached memory is returned first.
    fn debug_create_page<D: Device>(
        &mut self,
        dev: &D,
        d: &mut DebugState,
        requested: u64,
    ) -> Result<PhysHandle> {
        for attempt in 0..2 {
            let within_limit = self
                .limit
                .is_none_or(|l| (self.book.physical + d.pages + 1) * self.page <= l);
            if within_limit {
                match drv!(
                    self,
                    create_physical,
                    dev.create_physical(self.page as usize)
                ) {
                    Ok(h) => {
                        d.pages += 1;
                        self.stats.num_device_alloc += 1;
                        self.stats
                            .reserved_bytes
                            .increase(PoolKind::Large, self.page as i64);
                        self.stats.segment.increase(PoolKind::Large, 1);
                        return Ok(h);
                    }
                    Err(DeviceError::OutOfMemory) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if attempt == 0 {
                self.stats.num_alloc_retries += 1;
                self.release_cached(dev)?;
            }
        }
        self.stats.num_ooms += 1;
        Err(Error::OutOfMemory(Box::new(OomInfo {
            requested,
            device_free: dev.free_memory().unwrap_or(0) as u64,
            device_total: self.total,
            reserved: (self.book.physical + d.pages) * self.page,
            allocated: self.stats.allocated_bytes.aggregate().current as u64,
            cached_free: self.arenas.iter().map(|a| a.free_mapped_bytes).sum(),
            limit: self.limit,
            stitches: self.stats.stitches,
        })))
    }

    fn debug_release_page<D: Device>(
        &mut self,
        dev: &D,
        d: &mut DebugState,
        h: PhysHandle,
    ) -> Result<()> {
        drv!(self, release_physical, dev.release_physical(h))?;
        d.pages -= 1;
        self.stats.num_device_free += 1;
        self.stats
            .reserved_bytes
            .decrease(PoolKind::Large, self.page as i64);
        self.stats.segment.decrease(PoolKind::Large, 1);
        Ok(())
    }

    /// The free hook: `Some` when `ptr` is a guarded allocation (freed here), else the
    /// quarantine progresses and the arenas free it.
    pub(super) fn debug_free<D: Device>(&mut self, dev: &D, ptr: DevicePtr) -> Option<Result<()>> {
        let guarded = self.debug.as_ref()?.guarded.contains_key(&ptr);
        let r = self.with_debug(|st, d| {
            if guarded {
                let g = d.guarded.remove(&ptr).expect("guarded");
                let kind = PoolKind::Large;
                let s = &mut st.stats;
                s.allocation.decrease(kind, 1);
                s.allocated_bytes.decrease(kind, g.size as i64);
                s.requested_bytes.decrease(kind, g.requested as i64);
                st.trace(TraceAction::FreeRequested, ptr, g.size, g.stream);
                let deferred = st.captures > 0;
                let mut events = Vec::new();
                if !deferred {
                    st.record_guarded_events(dev, &g, &mut events)?;
                }
                d.held_bytes += g.size;
                d.waiting += 1;
                d.held.push_back(Held::Range {
                    g: Box::new(g),
                    events,
                    deferred,
                    unmapped: false,
                });
            }
            Ok(())
        });
        guarded.then_some(r)
    }

    /// After every free: progresses the quarantine.
    pub(super) fn debug_after_free<D: Device>(&mut self, dev: &D) -> Result<()> {
        self.with_debug(|st, d| st.debug_tick(dev, d))
    }

    fn record_guarded_events<D: Device>(
        &mut self,
        dev: &D,
        g: &Guarded,
        events: &mut Vec<EventHandle>,
    ) -> Result<()> {
        for &s in std::iter::once(&g.stream).chain(g.extra.iter()) {
            let e = self.get_event(dev)?;
            events.push(e);
            drv!(self, record_event, dev.record_event(e, s))?;
        }
        Ok(())
    }

    /// The `finish_free` hook: holds a freed arena block in the quarantine (it stays live in
    /// its arena, marked pending). False when the block is to be freed now.
    pub(super) fn debug_hold(&mut self, ptr: DevicePtr) -> bool {
        let Some(d) = self.debug.as_mut() else {
            return false;
        };
        if !d.cfg.quarantine() {
            return false;
        }
        let Some(b) = self.live.get_mut(&ptr) else {
            return false;
        };
        // Graph pools are not held: CUDA graph trees re-create their freed blocks in place.
        if self.arenas[b.arena as usize].key.graph_pool != GraphPoolId::DEFAULT {
            return false;
        }
        b.pending = true;
        d.held_bytes += b.size;
        d.held.push_back(Held::Block { ptr, bytes: b.size });
        true
    }

    /// Lets the oldest held arena blocks go while the quarantine is over its bounds (up to
    /// the first guarded range, which needs the device).
    pub(super) fn debug_evict_blocks(&mut self) -> Result<()> {
        self.with_debug(|st, d| {
            while d.over_limit() {
                let Some(Held::Block { ptr, bytes }) = d.held.front() else {
                    break;
                };
                let (ptr, bytes) = (*ptr, *bytes);
                d.held.pop_front();
                d.held_bytes -= bytes;
                st.finish_free(ptr)?;
            }
            Ok(())
        })
    }

    /// Unmaps freed guarded ranges whose events completed, and lets the oldest held blocks
    /// go while the quarantine is over its bounds.
    fn debug_tick<D: Device>(&mut self, dev: &D, d: &mut DebugState) -> Result<()> {
        // Newest first: older ranges are mostly unmapped already, so the scan stops early.
        let mut left = d.waiting;
        let mut i = d.held.len();
        while left > 0 && i > 0 {
            i -= 1;
            {
                let Held::Range {
                    g,
                    events,
                    deferred,
                    unmapped: false,
                } = &mut d.held[i]
                else {
                    continue;
                };
                left -= 1;
                if *deferred {
                    if self.captures > 0 {
                        continue;
                    }
                    *deferred = false;
                    let g: &Guarded = g;
                    let mut ev = Vec::new();
                    self.record_guarded_events(dev, g, &mut ev)?;
                    if let Held::Range { events, .. } = &mut d.held[i] {
                        *events = ev;
                    }
                    continue;
                }
                let mut done = true;
                for &e in events.iter() {
                    if !drv!(self, query_event, dev.query_event(e))? {
                        done = false;
                        break;
                    }
                }
                if done {
                    self.unmap_guarded(dev, d, i)?;
                }
            }
        }
        while d.over_limit() {
            match d.held.front() {
                Some(Held::Block { .. }) => {
                    let Some(Held::Block { ptr, bytes }) = d.held.pop_front() else {
                        unreachable!()
                    };
                    d.held_bytes -= bytes;
                    // The debug state is taken out: `finish_free` frees it for real.
                    self.finish_free(ptr)?;
                }
                Some(Held::Range { unmapped: true, .. }) => {
                    let Some(Held::Range { g, .. }) = d.held.pop_front() else {
                        unreachable!()
                    };
                    d.held_bytes -= g.size;
                    // Its active bytes went when its pages were unmapped (`unmap_guarded`).
                    drv!(self, free_va, dev.free_va(g.va, g.va_len as usize))?;
                }
                _ => break,
            }
        }
        Ok(())
    }

    /// Unmaps the pages of held range `i` (its events completed); they become spare.
    fn unmap_guarded<D: Device>(&mut self, dev: &D, d: &mut DebugState, i: usize) -> Result<()> {
        let Held::Range {
            g,
            events,
            unmapped,
            ..
        } = &mut d.held[i]
        else {
            return Ok(());
        };
        let pages = std::mem::take(&mut g.pages);
        let map_start = g.map_start;
        self.event_pool.append(events);
        *unmapped = true;
        d.waiting -= 1;
        // Unmapped, the range holds no memory: it stops counting as active here (its pages may
        // be released below, and active bytes must stay within reserved), though its
        // reservation stays in the quarantine so that a late access faults.
        self.stats.active.decrease(PoolKind::Large, 1);
        self.stats
            .active_bytes
            .decrease(PoolKind::Large, g.size as i64);
        self.trace(TraceAction::FreeCompleted, g.ptr, g.size, g.stream);
        for (k, h) in pages.into_iter().enumerate() {
            drv!(
                self,
                unmap,
                dev.unmap(map_start + k as u64 * self.page, self.page as usize)
            )?;
            if d.spare.len() < MAX_SPARE_PAGES {
                d.spare.push(h);
            } else {
                self.debug_release_page(dev, d, h)?;
            }
        }
        Ok(())
    }

    /// Empties the quarantine (after waiting for the device) and returns the spare pages:
    /// on out-of-memory and `empty_cache`. True if anything was released.
    pub(super) fn debug_flush<D: Device>(&mut self, dev: &D, quarantine: bool) -> Result<bool> {
        if self.debug.is_none() {
            return Ok(false);
        }
        self.with_debug(|st, d| {
            let before = (d.held.len(), d.spare.len());
            if quarantine && !d.held.is_empty() {
                drv!(st, synchronize, dev.synchronize())?;
                for i in 0..d.held.len() {
                    if matches!(
                        d.held[i],
                        Held::Range {
                            unmapped: false,
                            ..
                        }
                    ) {
                        st.unmap_guarded(dev, d, i)?;
                    }
                }
                let cfg = d.cfg.clone();
                d.cfg.quarantine_count = 0;
                d.cfg.quarantine_bytes = 0;
                let r = st.debug_tick(dev, d);
                d.cfg = cfg;
                r?;
            }
            for h in std::mem::take(&mut d.spare) {
                st.debug_release_page(dev, d, h)?;
            }
            Ok((d.held.len(), d.spare.len()) != before)
        })
    }

    /// The `record_stream` hook for pointers that are not arena blocks.
    pub(super) fn debug_record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        let Some(g) = self.debug.as_mut().and_then(|d| d.guarded.get_mut(&ptr)) else {
            return Err(Error::UnknownPointer(ptr));
        };
        if g.stream != stream && !g.extra.contains(&stream) {
            g.extra.push(stream);
        }
        Ok(())
    }

    /// The guarded allocation containing `ptr`.
    pub(super) fn debug_allocation(&self, ptr: DevicePtr) -> Option<AllocationInfo> {
        let (&base, g) = self.debug.as_ref()?.containing(ptr)?;
        Some(AllocationInfo {
            ptr: base,
            size: g.size,
            requested: g.requested,
            stream: g.stream,
            pool: PoolKind::Large,
            graph_pool: GraphPoolId::DEFAULT,
        })
    }

    /// Fills the mode's statistics.
    pub(super) fn debug_stats(&self, s: &mut DeviceStats) {
        if let Some(d) = &self.debug {
            let guards = 1 + d.cfg.guard_front as u64;
            s.debug_guarded = d.guarded.len() as u64;
            s.debug_guard_bytes = d.guarded.len() as u64 * guards * self.page;
            s.debug_quarantine_blocks = d.held.len() as u64;
            s.debug_quarantine_bytes = d.held_bytes;
            s.debug_canary_errors = d.canary_errors;
            s.debug_pages = d.pages;
        }
    }

    /// Counts a damaged canary (found by the C++ layer).
    pub(super) fn debug_note_canary_error(&mut self) {
        if let Some(d) = self.debug.as_mut() {
            d.canary_errors += 1;
        }
    }

    /// For `verify`: (live guarded allocations, their bytes, held guarded ranges still
    /// mapped (active until unmapped), pages the mode holds).
    pub(super) fn debug_counts(&self) -> (i64, i64, i64, u64) {
        let Some(d) = &self.debug else {
            return (0, 0, 0, 0);
        };
        let ranges = d
            .held
            .iter()
            .filter(|h| {
                matches!(
                    h,
                    Held::Range {
                        unmapped: false,
                        ..
                    }
                )
            })
            .count() as i64;
        (
            d.guarded.len() as i64,
            d.guarded.values().map(|g| g.size as i64).sum(),
            ranges,
            d.pages,
        )
    }

    /// For `verify`: the mode's own rules.
    pub(super) fn debug_verify(&self) -> std::result::Result<(), String> {
        let Some(d) = &self.debug else {
            return Ok(());
        };
        let mut pages = d.spare.len() as u64;
        let mut held = 0;
        for h in &d.held {
            held += h.bytes();
            if let Held::Range { g, unmapped, .. } = h {
                pages += g.pages.len() as u64;
                if *unmapped != g.pages.is_empty() {
                    return Err("a held guarded range's pages disagree with its state".into());
                }
            }
        }
        if held != d.held_bytes {
            return Err(format!(
                "quarantine holds {held} bytes, counted {}",
                d.held_bytes
            ));
        }
        for (&ptr, g) in &d.guarded {
            pages += g.pages.len() as u64;
            let mapped_end = g.map_start + g.pages.len() as u64 * self.page;
            if ptr + g.size != mapped_end || !ptr.is_multiple_of(BLOCK_ROUND) {
                return Err(format!(
                    "guarded block {ptr:#x} does not end at its mapped end"
                ));
            }
            let front = d.cfg.guard_front as u64 * self.page;
            if g.map_start != g.va + front || mapped_end + self.page != g.va + g.va_len {
                return Err(format!("the guard pages of {ptr:#x} are misplaced"));
            }
        }
        if pages != d.pages {
            return Err(format!("debug pages: {pages} found, {} counted", d.pages));
        }
        Ok(())
    }
}
