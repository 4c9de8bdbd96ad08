//! Stream synchronisation: fences, pending frees (record_stream), retired ranges waiting
//! to be unmapped, and the event pool.

use super::*;

pub(super) struct PendingFree {
    pub ptr: DevicePtr,
    /// Empty while a graph capture prevented recording them.
    pub events: Vec<EventHandle>,
}

/// (arena, first page address, pages) of a retired range.
type RetiredRange = (u32, u64, u64);

/// Retired ranges (still mapped on the device), unmapped once every event, one recorded on
/// each stream that may still use them, completes.
#[derive(Default)]
pub(super) struct RetiredBatch {
    pub events: Vec<EventHandle>,
    pub ranges: Vec<RetiredRange>,
    /// Handles to release after the unmap (garbage collection); empty for evicted aliases,
    /// whose pages live on elsewhere.
    pub release: Vec<PhysHandle>,
}

#[derive(Default)]
pub(super) struct Fence {
    pub pending: Option<(EventHandle, u64)>,
    /// Every free on the stream stamped at or before this has completed on the GPU.
    pub completed: u64,
}

impl State {
    /// Completes fences whose events are done and records new ones on streams whose free
    /// blocks are not yet fenced. True when some fence completed (what `stream` may take
    /// changed).
    pub(super) fn refresh_fences<D: Device>(&mut self, dev: &D, stream: StreamId) -> Result<bool> {
        let mut advanced = false;
        let mut streams: Vec<(StreamId, u64)> = Vec::new();
        for a in &self.arenas {
            if a.key.stream != stream && a.stealable_pages > 0 && self.pool_may_give(a) {
                match streams.iter_mut().find(|s| s.0 == a.key.stream) {
                    Some(s) => s.1 = s.1.max(a.last_free),
                    None => streams.push((a.key.stream, a.last_free)),
                }
            }
        }
        for (s, last_free) in streams {
            let fence = self.fences.entry(s).or_default();
            if fence.completed >= last_free {
                continue;
            }
            if let Some((e, stamp)) = fence.pending {
                if drv!(self, query_event, dev.query_event(e))? {
                    let f = self.fences.entry(s).or_default();
                    f.completed = stamp;
                    f.pending = None;
                    advanced = true;
                    self.event_pool.push(e);
                }
            }
            let f = self.fences.entry(s).or_default();
            if f.pending.is_none() && f.completed < last_free {
                let e = self.get_event(dev)?;
                drv!(self, record_event, dev.record_event(e, s))?;
                let f = self.fences.entry(s).or_default();
                f.pending = Some((e, self.now));
                // A device whose events complete at once (or already idle) fences now.
                if drv!(self, query_event, dev.query_event(e))? {
                    let f = self.fences.entry(s).or_default();
                    f.completed = self.now;
                    f.pending = None;
                    advanced = true;
                    self.event_pool.push(e);
                }
            }
        }
        Ok(advanced)
    }

    /// An event from the pool, or a new one.
    pub(super) fn get_event<D: Device>(&mut self, dev: &D) -> Result<EventHandle> {
        match self.event_pool.pop() {
            Some(e) => Ok(e),
            None => Ok(drv!(self, create_event, dev.create_event())?),
        }
    }

    /// Queues a retired batch behind an event recorded now on the stream of every arena it
    /// has a range in.
    pub(super) fn record_retired<D: Device>(&mut self, dev: &D, mut b: RetiredBatch) -> Result<()> {
        if b.ranges.is_empty() && b.release.is_empty() {
            return Ok(());
        }
        let mut streams: Vec<StreamId> = b
            .ranges
            .iter()
            .map(|r| self.arenas[r.0 as usize].key.stream)
            .collect();
        streams.sort_unstable();
        streams.dedup();
        for s in streams {
            let e = self.get_event(dev)?;
            b.events.push(e);
            drv!(self, record_event, dev.record_event(e, s))?;
        }
        self.retired.push_back(b);
        Ok(())
    }

    /// Records a pooled event on each other stream that used the live block at `ptr`.
    pub(super) fn record_on_extra_streams<D: Device>(
        &mut self,
        dev: &D,
        ptr: DevicePtr,
    ) -> Result<Vec<EventHandle>> {
        let streams = self
            .live
            .get(&ptr)
            .map(|b| b.extra.clone())
            .unwrap_or_default();
        let mut events = Vec::with_capacity(streams.len());
        for s in streams {
            let e = self.get_event(dev)?;
            drv!(self, record_event, dev.record_event(e, s))?;
            events.push(e);
        }
        Ok(events)
    }

    /// Completes pending frees whose events are done, in order (all of them if `all`,
    /// after a device synchronisation).
    pub(super) fn process_pending<D: Device>(&mut self, dev: &D, all: bool) -> Result<()> {
        while let Some(p) = self.pending.front_mut() {
            if p.events.is_empty() && !all {
                // Deferred by a capture: record the events now.
                let ptr = p.ptr;
                let events = self.record_on_extra_streams(dev, ptr)?;
                if let Some(p) = self.pending.front_mut() {
                    p.events = events;
                }
            }
            if !all {
                let n = self.pending.front().map_or(0, |p| p.events.len());
                for i in 0..n {
                    let e = self.pending[0].events[i];
                    if !drv!(self, query_event, dev.query_event(e))? {
                        return Ok(());
                    }
                }
            }
            let p = self.pending.pop_front().expect("front exists");
            self.event_pool.extend(p.events);
            self.finish_free(p.ptr)?;
        }
        Ok(())
    }

    /// Unmaps retired ranges whose events are done (all of them if `all`).
    pub(super) fn process_retired<D: Device>(&mut self, dev: &D, all: bool) -> Result<()> {
        while let Some(b) = self.retired.front() {
            if !all {
                let events = b.events.clone();
                let mut done = true;
                for e in events {
                    if !drv!(self, query_event, dev.query_event(e))? {
                        done = false;
                        break;
                    }
                }
                if !done {
                    break;
                }
            }
            let b = self.retired.pop_front().expect("front exists");
            for &(aid, start, n) in &b.ranges {
                let page = self.arenas[aid as usize].page();
                for i in 0..n {
                    drv!(self, unmap, dev.unmap(start + i * page, page as usize))?;
                }
                self.with_arena(aid, |a| a.unretire(start));
            }
            for h in b.release {
                self.release_page(dev, h)?;
            }
            self.event_pool.extend(b.events);
        }
        Ok(())
    }

    /// Waits for the allocator's own work, not the device's: an event recorded now on the
    /// stream of every arena holding free or lent memory and of every pending free's block,
    /// and the events of pending frees and retired ranges, each waited for (`Device::wait_event`). Then those streams' fences,
    /// every pending free and every retired range complete. Streams that hold none of the
    /// allocator's free memory (a side stream running a long kernel, a collective waiting for
    /// a peer) are not waited for, where `cuCtxSynchronize` waited for them with the lock held.
    pub(super) fn synchronize_all<D: Device>(&mut self, dev: &D) -> Result<()> {
        if self.captures > 0 {
            return Ok(());
        }
        // Pending frees whose events a capture deferred: record them now.
        for i in 0..self.pending.len() {
            if self.pending[i].events.is_empty() {
                let ptr = self.pending[i].ptr;
                let events = self.record_on_extra_streams(dev, ptr)?;
                self.pending[i].events = events;
            }
        }
        let mut streams: Vec<StreamId> = self
            .arenas
            .iter()
            .filter(|a| a.free_mapped_bytes > 0 || a.stealable_pages > 0 || a.lent_pages() > 0)
            .map(|a| a.key.stream)
            .collect();
        // A pending free becomes a free block of its own stream below.
        streams.extend(
            self.pending
                .iter()
                .filter_map(|p| self.live.get(&p.ptr).map(|b| b.stream)),
        );
        streams.sort_unstable();
        streams.dedup();
        let mut fresh = Vec::with_capacity(streams.len());
        for &s in &streams {
            let e = self.get_event(dev)?;
            fresh.push(e);
            if let Err(err) = drv!(self, record_event, dev.record_event(e, s)) {
                self.event_pool.extend(fresh);
                return Err(err.into());
            }
        }
        let waits: Vec<EventHandle> = fresh
            .iter()
            .copied()
            .chain(self.pending.iter().flat_map(|p| p.events.iter().copied()))
            .collect();
        let mut waited = Ok(());
        for e in waits {
            if let Err(err) = drv!(self, synchronize, dev.wait_event(e)) {
                waited = Err(err);
                break;
            }
        }
        self.event_pool.extend(fresh);
        waited?;
        self.stats.num_sync_all_streams += 1;
        let now = self.now;
        let mut freed = Vec::new();
        for s in streams {
            let f = self.fences.entry(s).or_default();
            if let Some((e, _)) = f.pending.take() {
                freed.push(e);
            }
            f.completed = now;
        }
        self.event_pool.extend(freed);
        self.process_pending(dev, true)?;
        self.complete_retired(dev)
    }

    /// Whether a retired batch still holds pages to release (a drain's, garbage
    /// collection's), rather than aliases only.
    pub(super) fn retired_holds_pages(&self) -> bool {
        self.retired.iter().any(|b| !b.release.is_empty())
    }

    /// Waits for the event of every retired batch (the queue is processed in order, so
    /// those of batches holding aliases only too), then unmaps and releases them all.
    pub(super) fn complete_retired<D: Device>(&mut self, dev: &D) -> Result<()> {
        let waits: Vec<EventHandle> = self
            .retired
            .iter()
            .flat_map(|b| b.events.iter().copied())
            .collect();
        for e in waits {
            drv!(self, synchronize, dev.wait_event(e))?;
        }
        self.process_retired(dev, true)
    }

    /// After `own_stream_done_since` said no: polls `stream`'s pending fence, if it covers
    /// `since`, `REUSE_FENCE_POLLS` times, `REUSE_FENCE_POLL_GAP` apart. True if it
    /// completed; counted in `reuses_awaited`.
    pub(super) fn await_own_fence<D: Device>(
        &mut self,
        dev: &D,
        stream: StreamId,
        since: u64,
    ) -> Result<bool> {
        let Some((e, stamp)) = self.fences.get(&stream).and_then(|f| f.pending) else {
            return Ok(false);
        };
        if stamp < since || self.captures > 0 {
            return Ok(false);
        }
        for _ in 0..super::pages::REUSE_FENCE_POLLS {
            std::thread::sleep(super::pages::REUSE_FENCE_POLL_GAP);
            if drv!(self, query_event, dev.query_event(e))? {
                self.fence_completed(stream, e, stamp);
                self.stats.reuses_awaited += 1;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// `stream`'s fence event `e`, recorded at `stamp`, has completed: its work up to then is
    /// done, and the event goes back to the pool.
    fn fence_completed(&mut self, stream: StreamId, e: EventHandle, stamp: u64) {
        let f = self.fences.entry(stream).or_default();
        f.completed = f.completed.max(stamp);
        f.pending = None;
        self.event_pool.push(e);
    }

    /// Whether all work queued on `stream` up to stamp `since` has completed, by the
    /// stream's own fence (recorded now if none is pending, and queried).
    pub(super) fn own_stream_done_since<D: Device>(
        &mut self,
        dev: &D,
        stream: StreamId,
        since: u64,
    ) -> Result<bool> {
        let f = self.fences.entry(stream).or_default();
        if f.completed >= since {
            return Ok(true);
        }
        if let Some((e, stamp)) = f.pending {
            if drv!(self, query_event, dev.query_event(e))? {
                self.fence_completed(stream, e, stamp);
                if stamp >= since {
                    return Ok(true);
                }
            } else if stamp >= since {
                return Ok(false);
            }
        }
        if self
            .fences
            .get(&stream)
            .is_some_and(|f| f.pending.is_some())
        {
            return Ok(false);
        }
        let e = self.get_event(dev)?;
        drv!(self, record_event, dev.record_event(e, stream))?;
        let stamp = self.now;
        if drv!(self, query_event, dev.query_event(e))? {
            self.fence_completed(stream, e, stamp);
            return Ok(stamp >= since);
        }
        self.fences.entry(stream).or_default().pending = Some((e, stamp));
        Ok(false)
    }
}
