//! The allocator: one per device, one short lock.
//!
//! Requests are rounded to 512 bytes and served from the arena of their (stream, pool kind,
//! graph pool). The hot path is a best fit among the arena's free mapped blocks: no driver
//! call. Otherwise the request is placed on unmapped virtual space (after the free mapped
//! block before it, whose pages are reused), and the missing pages are *stitched*: taken
//! from free mapped blocks anywhere they may come from, before the device is asked for new
//! memory (`defragLevel` changes that order). A page taken from a block is mapped at its new
//! address at once; its old mapping is retired and unmapped only after an event recorded on
//! the old block's stream completes, so kernels still reading the old address are safe.
//!
//! Stream rules, as PyTorch's: a block freed on stream S is reused on S at once; a block
//! used on other streams (record_stream) is freed only once events recorded on those
//! streams at free time complete; pages of free blocks of another stream are stitched only
//! once a fence event recorded on that stream after their free has completed. Pages of a
//! live CUDA graph pool are never taken (a replay still uses their addresses).

use crate::arena::{Arena, ArenaKey, BlockState as ArenaState, Page};
use crate::config::{Config, StitchStrategy};
use crate::device::{Device, DeviceError, DevicePtr, EventHandle, PhysHandle, StreamId};
use crate::error::{Error, OomInfo, Result};
use crate::ipc::{Imports, SharedPages};
use crate::stats::{BlockInfo, BlockState, DeviceStats, PoolKind, SegmentInfo, Snapshot};
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::{BTreeMap, VecDeque};

/// Allocation granularity of blocks (PyTorch's kMinBlockSize).
pub const BLOCK_ROUND: u64 = 512;
/// Largest request accepted (a sanity bound far above any GPU's memory).
pub const MAX_REQUEST: u64 = 1 << 50;

/// A CUDA graph memory pool id, as PyTorch's `MempoolId_t`; (0, 0) is the default pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphPoolId(pub u64, pub u64);

impl GraphPoolId {
    pub const DEFAULT: GraphPoolId = GraphPoolId(0, 0);
}

/// What `cacheInfo` reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheInfo {
    /// Bytes in free mapped blocks.
    pub cached_free_bytes: u64,
    /// The largest free mapped block.
    pub largest_free_block: u64,
}

/// A live allocation, as `getBaseAllocation` and snapshots need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocationInfo {
    pub ptr: DevicePtr,
    pub size: u64,
    pub requested: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub graph_pool: GraphPoolId,
}

/// History events, in PyTorch's TraceEntry actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceAction {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentMap,
    SegmentUnmap,
    SegmentAlloc,
    SegmentFree,
    Oom,
}

impl TraceAction {
    /// The action string of PyTorch's snapshots.
    pub fn torch_name(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::Oom => "oom",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    pub action: TraceAction,
    pub addr: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
}

struct LiveBlock {
    arena: u32,
    size: u64,
    requested: u64,
    stream: StreamId,
    /// Other streams that used the block (record_stream).
    extra: Vec<StreamId>,
    /// Freed, waiting for events on `extra`.
    pending: bool,
}

struct PendingFree {
    ptr: DevicePtr,
    /// Empty while a graph capture prevented recording them.
    events: Vec<EventHandle>,
}

/// (arena, first page address, pages) of a retired range.
type RetiredRange = (u32, u64, u64);

/// Retired ranges of arenas of one stream, unmapped once `event` completes.
struct RetiredBatch {
    event: EventHandle,
    ranges: Vec<RetiredRange>,
    /// Handles to release after the unmap (garbage collection); empty for stitches, whose
    /// pages live on at their new address.
    release: Vec<PhysHandle>,
}

#[derive(Default)]
struct Fence {
    pending: Option<(EventHandle, u64)>,
    /// Every free on the stream stamped at or before this has completed on the GPU.
    completed: u64,
}

struct State {
    cfg: Config,
    page: u64,
    total: u64,
    chunk_size: u64,
    limit: Option<u64>,
    arenas: Vec<Arena>,
    arena_of: FxHashMap<ArenaKey, u32>,
    last_arena: Option<(ArenaKey, u32)>,
    /// chunk start -> (end, arena)
    chunk_owner: BTreeMap<u64, (u64, u32)>,
    live: FxHashMap<DevicePtr, LiveBlock>,
    pending: VecDeque<PendingFree>,
    retired: VecDeque<RetiredBatch>,
    event_pool: Vec<EventHandle>,
    fences: FxHashMap<StreamId, Fence>,
    /// Created pages mapped nowhere (left over when a request failed half way).
    spare: Vec<PhysHandle>,
    physical_pages: u64,
    released_pools: FxHashSet<GraphPoolId>,
    captures: u32,
    now: u64,
    stats: DeviceStats,
    history_cap: usize,
    history: VecDeque<TraceEvent>,
}

/// The allocator for one device. `Send + Sync`; every operation takes one lock briefly.
pub struct Allocator<D: Device> {
    device: D,
    state: Mutex<State>,
    /// Ranges imported from other processes. Lock order: `state` before `imports`.
    imports: Mutex<Imports>,
}

macro_rules! drv {
    ($st:expr, $kind:ident, $call:expr) => {{
        $st.stats.driver_calls.$kind += 1;
        $call
    }};
}

fn round_request(size: u64) -> Result<u64> {
    if size > MAX_REQUEST {
        return Err(Error::SizeOverflow(size));
    }
    Ok(size.div_ceil(BLOCK_ROUND) * BLOCK_ROUND)
}

impl<D: Device> Allocator<D> {
    /// An allocator over `device`. Fails if the configuration does not fit the device
    /// (page size not a multiple of the granularity) or the device cannot be queried.
    pub fn new(device: D, config: Config) -> Result<Self> {
        let gran = device.granularity()? as u64;
        if gran == 0 || !gran.is_power_of_two() {
            return Err(Error::Device(DeviceError::InvalidArgument(format!(
                "granularity {gran} is not a power of two"
            ))));
        }
        let page = if config.page_size == 0 {
            gran
        } else {
            config.page_size
        };
        if page % gran != 0 {
            return Err(Error::InvalidConfig {
                key: "page_size".into(),
                value: page.to_string(),
                reason: format!("not a multiple of the device granularity {gran}"),
            });
        }
        let total = device.total_memory()? as u64;
        let chunk_size = total.div_ceil(page).max(64) * page;
        let mut state = State {
            cfg: config,
            page,
            total,
            chunk_size,
            limit: None,
            arenas: Vec::new(),
            arena_of: FxHashMap::default(),
            last_arena: None,
            chunk_owner: BTreeMap::new(),
            live: FxHashMap::default(),
            pending: VecDeque::new(),
            retired: VecDeque::new(),
            event_pool: Vec::new(),
            fences: FxHashMap::default(),
            spare: Vec::new(),
            physical_pages: 0,
            released_pools: FxHashSet::default(),
            captures: 0,
            now: 0,
            stats: DeviceStats {
                max_split_size: i64::MAX,
                ..DeviceStats::default()
            },
            history_cap: 0,
            history: VecDeque::new(),
        };
        state.update_limit();
        tracing::debug!(page, total, "gmlake allocator created");
        Ok(Allocator {
            device,
            state: Mutex::new(state),
            imports: Mutex::new(Imports::default()),
        })
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    pub fn config(&self) -> Config {
        self.state.lock().cfg.clone()
    }

    /// The physical page size in bytes.
    pub fn page_size(&self) -> u64 {
        self.state.lock().page
    }

    /// Allocates `size` bytes for use on `stream` in the default pool. 0 bytes gives a null
    /// pointer, as PyTorch does.
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<DevicePtr> {
        self.allocate_in(size, stream, GraphPoolId::DEFAULT)
    }

    /// Allocates into a CUDA graph pool (`GraphPoolId::DEFAULT` for the default pool).
    pub fn allocate_in(&self, size: u64, stream: StreamId, pool: GraphPoolId) -> Result<DevicePtr> {
        if size == 0 {
            return Ok(0);
        }
        let rounded = round_request(size)?;
        self.state
            .lock()
            .allocate(&self.device, size, rounded, stream, pool)
    }

    /// Makes [ptr, ptr + size) a live allocation again, as if `allocate_in(requested, stream,
    /// pool)` had returned `ptr`: CUDA graph trees restore a pool to a checkpoint this way.
    /// The range must be free and mapped in the arena of (stream, pool kind of `size`, pool);
    /// otherwise `Error::InvalidState` says why. No driver call.
    pub fn allocate_at(
        &self,
        ptr: DevicePtr,
        size: u64,
        requested: u64,
        stream: StreamId,
        pool: GraphPoolId,
    ) -> Result<()> {
        let size = round_request(size)?;
        if size == 0 || !ptr.is_multiple_of(BLOCK_ROUND) {
            return Err(Error::InvalidState(format!(
                "cannot re-create {size} bytes at {ptr:#x}: empty or unaligned"
            )));
        }
        self.state
            .lock()
            .allocate_at(ptr, size, requested, stream, pool)
    }

    /// Frees a pointer from `allocate`. Freeing null is a no-op.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        self.state.lock().free(&self.device, ptr)
    }

    /// Marks a live allocation as used on `stream` too: its memory is reused only after the
    /// work queued on `stream` before the free has completed.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        let mut st = self.state.lock();
        match st.live.get_mut(&ptr) {
            Some(b) if !b.pending => {
                if b.stream != stream && !b.extra.contains(&stream) {
                    b.extra.push(stream);
                }
                Ok(())
            }
            Some(_) => Err(Error::DoubleFree(ptr)),
            None => Err(Error::UnknownPointer(ptr)),
        }
    }

    /// Returns every cached page to the device (after waiting for the device), and frees
    /// virtual ranges that hold nothing. Live allocations and live graph pools are kept.
    pub fn empty_cache(&self) -> Result<()> {
        let mut st = self.state.lock();
        if st.captures > 0 {
            return Ok(());
        }
        st.release_cached(&self.device)
    }

    /// Caps reserved memory at `fraction` of the device (PyTorch's setMemoryFraction).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::InvalidConfig {
                key: "memory_fraction".into(),
                value: fraction.to_string(),
                reason: "expected a fraction in (0, 1]".into(),
            });
        }
        let mut st = self.state.lock();
        st.cfg.memory_fraction = Some(fraction);
        st.update_limit();
        Ok(())
    }

    pub fn memory_fraction(&self) -> Option<f64> {
        self.state.lock().cfg.memory_fraction
    }

    /// Caps reserved memory at `bytes` (None: no cap besides the memory fraction).
    pub fn set_limit(&self, bytes: Option<u64>) {
        let mut st = self.state.lock();
        st.cfg.limit_bytes = bytes;
        st.update_limit();
    }

    /// The cap on reserved bytes now in force.
    pub fn limit(&self) -> Option<u64> {
        self.state.lock().limit
    }

    /// A graph capture begins allocating into a private pool: until the matching end, no
    /// event is recorded or queried and nothing is stitched (as PyTorch's allocator, which
    /// defers event work while captures are underway).
    pub fn begin_allocate_to_pool(&self, pool: GraphPoolId) {
        let mut st = self.state.lock();
        st.captures += 1;
        st.released_pools.remove(&pool);
    }

    pub fn end_allocate_to_pool(&self, _pool: GraphPoolId) {
        let mut st = self.state.lock();
        st.captures = st.captures.saturating_sub(1);
    }

    /// The graph pool is gone: its free pages may be stitched anywhere and are returned
    /// by `empty_cache`.
    pub fn release_pool(&self, pool: GraphPoolId) -> Result<()> {
        if pool == GraphPoolId::DEFAULT {
            return Err(Error::InvalidState(
                "the default pool cannot be released".into(),
            ));
        }
        self.state.lock().released_pools.insert(pool);
        Ok(())
    }

    /// Statistics, with the derived fields (cached and retired bytes) filled in.
    pub fn stats(&self) -> DeviceStats {
        let st = self.state.lock();
        let mut s = st.stats.clone();
        s.cached_bytes = st.arenas.iter().map(|a| a.free_mapped_bytes).sum();
        s.retired_bytes = st
            .retired
            .iter()
            .flat_map(|b| b.ranges.iter())
            .map(|r| r.2 * st.page)
            .sum();
        s.pending_frees = st.pending.len() as u64;
        let imp = self.imports.lock();
        s.ipc_imported_bytes = imp.bytes();
        s.ipc_imports = imp.len() as u64;
        s
    }

    pub fn reset_peak_stats(&self) {
        self.state.lock().stats.reset_peak();
    }

    pub fn reset_accumulated_stats(&self) {
        self.state.lock().stats.reset_accumulated();
    }

    /// Physical bytes held now (reserved).
    pub fn reserved_bytes(&self) -> u64 {
        let st = self.state.lock();
        st.physical_pages * st.page
    }

    pub fn cache_info(&self) -> CacheInfo {
        let st = self.state.lock();
        CacheInfo {
            cached_free_bytes: st.arenas.iter().map(|a| a.free_mapped_bytes).sum(),
            largest_free_block: st
                .arenas
                .iter()
                .map(Arena::largest_free_mapped)
                .max()
                .unwrap_or(0),
        }
    }

    /// The live allocation containing `ptr` (interior pointers included).
    pub fn allocation(&self, ptr: DevicePtr) -> Option<AllocationInfo> {
        let st = self.state.lock();
        let (base, _) = st.live_containing(ptr)?;
        let b = st.live.get(&base)?;
        let key = st.arenas[b.arena as usize].key;
        Some(AllocationInfo {
            ptr: base,
            size: b.size,
            requested: b.requested,
            stream: b.stream,
            pool: key.kind,
            graph_pool: key.graph_pool,
        })
    }

    /// Physical pages under a live allocation: (virtual page address, handle), in order.
    pub fn pages_of(&self, ptr: DevicePtr) -> Option<Vec<(DevicePtr, PhysHandle)>> {
        let st = self.state.lock();
        let b = st.live.get(&ptr)?;
        let a = &st.arenas[b.arena as usize];
        let lo = ptr & !(st.page - 1);
        let hi = (ptr + b.size).div_ceil(st.page) * st.page;
        Some(a.pages.range(lo..hi).map(|(&v, p)| (v, p.handle)).collect())
    }

    /// The pages under the live allocation containing `ptr`, for sharing with another process
    /// (see [`crate::ipc`]): every page the block touches, in address order, and the offset of
    /// `ptr` from the first. The block stays this process's; the caller exports the pages.
    pub fn share(&self, ptr: DevicePtr) -> Result<SharedPages> {
        let mut st = self.state.lock();
        let (base, size) = st.live_containing(ptr).ok_or(Error::UnknownPointer(ptr))?;
        let page = st.page;
        let aid = st.live.get(&base).ok_or(Error::UnknownPointer(ptr))?.arena;
        let lo = base & !(page - 1);
        let hi = (base + size.max(1)).div_ceil(page) * page;
        let handles: Vec<PhysHandle> = st.arenas[aid as usize]
            .pages
            .range(lo..hi)
            .map(|(_, p)| p.handle)
            .collect();
        if handles.len() as u64 != (hi - lo) / page {
            return Err(Error::InvalidState(format!(
                "allocation {base:#x} of {size} bytes has {} of its {} pages mapped",
                handles.len(),
                (hi - lo) / page
            )));
        }
        st.stats.ipc_shares += 1;
        Ok(SharedPages {
            base: lo,
            offset: ptr - lo,
            page_size: page,
            handles,
        })
    }

    /// Maps pages imported from another process (`handles`, in order, each `page_size`
    /// bytes; ownership passes to the allocator, also on failure) into a new range with
    /// access for this device and its peers, and returns its address.
    pub fn import_pages(&self, handles: Vec<PhysHandle>, page_size: u64) -> Result<DevicePtr> {
        self.imports.lock().map(&self.device, handles, page_size)
    }

    /// Unmaps a range made by [`Allocator::import_pages`] and releases its pages, after
    /// waiting for the device's work (which may still read the range), as PyTorch does when it
    /// closes an imported expandable segment. Fails during a CUDA graph capture.
    pub fn close_imported(&self, ptr: DevicePtr) -> Result<()> {
        if self.state.lock().captures > 0 {
            return Err(Error::InvalidState(format!(
                "cannot close the imported range {ptr:#x} while a CUDA graph is captured"
            )));
        }
        if !self.imports.lock().contains(ptr) {
            return Err(Error::UnknownPointer(ptr));
        }
        self.device.synchronize()?;
        self.imports.lock().close(&self.device, ptr)
    }

    /// Grants access again on every range mapped now (blocks, retired aliases, imports), with
    /// the device's current access list: after a peer was added to it (`enablePeerAccess`),
    /// ranges mapped before must be granted anew. Holds the lock throughout, so no range
    /// changes meanwhile.
    pub fn regrant_access(&self) -> Result<()> {
        let st = self.state.lock();
        let page = st.page;
        for a in &st.arenas {
            for (start, len) in a.mapped_runs() {
                drv_plain(&self.device, start, len)?;
            }
        }
        for b in &st.retired {
            for &(_, start, n) in &b.ranges {
                drv_plain(&self.device, start, n * page)?;
            }
        }
        let imp = self.imports.lock();
        for (start, len) in imp.ranges() {
            drv_plain(&self.device, start, len)?;
        }
        Ok(())
    }

    /// Keeps up to `capacity` history events (0 turns history off and drops it).
    pub fn set_history(&self, capacity: usize) {
        let mut st = self.state.lock();
        st.history_cap = capacity;
        while st.history.len() > capacity {
            st.history.pop_front();
        }
    }

    /// Takes the history recorded since the last call.
    pub fn take_history(&self) -> Vec<TraceEvent> {
        self.state.lock().history.drain(..).collect()
    }

    /// Segments (maximal mapped runs) and their blocks.
    pub fn snapshot(&self) -> Snapshot {
        self.state.lock().snapshot()
    }

    /// Checks every invariant of the arenas and that the statistics equal a recount.
    /// For tests and debugging: O(size of the allocator).
    pub fn verify(&self) -> std::result::Result<(), String> {
        self.state.lock().verify()
    }
}

/// `set_access` of a whole mapped run.
fn drv_plain<D: Device>(dev: &D, start: u64, len: u64) -> Result<()> {
    dev.set_access(start, len as usize).map_err(Error::from)
}

impl<D: Device> Drop for Allocator<D> {
    fn drop(&mut self) {
        let imports: Vec<DevicePtr> = self.imports.get_mut().ranges().map(|r| r.0).collect();
        for addr in imports {
            let _ = self.imports.get_mut().close(&self.device, addr);
        }
        let st = self.state.get_mut();
        // Live allocations leak with their pages; everything cached goes back.
        if st.captures == 0 {
            let _ = st.release_cached(&self.device);
        }
        for e in st.event_pool.drain(..) {
            let _ = self.device.destroy_event(e);
        }
    }
}

impl State {
    fn update_limit(&mut self) {
        let frac = self
            .cfg
            .memory_fraction
            .map(|f| ((self.total as f64 * f) as u64 / self.page) * self.page);
        self.limit = match (frac, self.cfg.limit_bytes) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    fn trace(&mut self, action: TraceAction, addr: u64, size: u64, stream: StreamId) {
        if self.history_cap > 0 {
            if self.history.len() == self.history_cap {
                self.history.pop_front();
            }
            self.history.push_back(TraceEvent {
                action,
                addr,
                size,
                stream,
            });
        }
    }

    fn arena_id(&mut self, key: ArenaKey) -> u32 {
        if let Some((k, id)) = self.last_arena {
            if k == key {
                return id;
            }
        }
        let id = match self.arena_of.get(&key) {
            Some(&id) => id,
            None => {
                let id = self.arenas.len() as u32;
                let lru = self.cfg.stitch_strategy == StitchStrategy::Lru;
                self.arenas.push(Arena::new(key, self.page, lru));
                self.arena_of.insert(key, id);
                id
            }
        };
        self.last_arena = Some((key, id));
        id
    }

    fn live_containing(&self, ptr: u64) -> Option<(u64, u64)> {
        let (_, &(end, aid)) = self.chunk_owner.range(..=ptr).next_back()?;
        if ptr >= end {
            return None;
        }
        self.arenas[aid as usize].live_containing(ptr)
    }

    /// Runs an arena operation and carries its change of free mapped blocks into the stats.
    fn with_arena<R>(&mut self, aid: u32, f: impl FnOnce(&mut Arena) -> R) -> R {
        let a = &mut self.arenas[aid as usize];
        let (c0, b0) = (a.free_mapped_count as i64, a.free_mapped_bytes as i64);
        let r = f(a);
        let (c1, b1) = (a.free_mapped_count as i64, a.free_mapped_bytes as i64);
        let kind = a.key.kind;
        self.stats.inactive_split.adjust(kind, c1 - c0);
        self.stats.inactive_split_bytes.adjust(kind, b1 - b0);
        r
    }

    fn allocate<D: Device>(
        &mut self,
        dev: &D,
        requested: u64,
        size: u64,
        stream: StreamId,
        pool: GraphPoolId,
    ) -> Result<DevicePtr> {
        if !self.pending.is_empty() && self.captures == 0 {
            self.process_pending(dev, false)?;
        }
        let kind = if size <= self.cfg.small_size {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        let aid = self.arena_id(ArenaKey {
            stream,
            kind,
            graph_pool: pool,
        });
        self.now += 1;
        let now = self.now;
        let reuse = self.cfg.reuse_limit;
        let addr = match self.with_arena(aid, |a| a.take_quick(size)) {
            Some(addr) => addr,
            None => {
                // Not the exact size of a quick block: best fit over coalesced blocks.
                self.with_arena(aid, Arena::flush_quick);
                match self.arenas[aid as usize].find_hit(size, reuse) {
                    Some(addr) => {
                        self.with_arena(aid, |a| a.carve(addr, size, now));
                        addr
                    }
                    None => self.allocate_slow(dev, requested, size, aid)?,
                }
            }
        };
        self.record_alloc(aid, addr, size, requested, stream, kind);
        Ok(addr)
    }

    fn allocate_at(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        requested: u64,
        stream: StreamId,
        pool: GraphPoolId,
    ) -> Result<()> {
        let kind = if size <= self.cfg.small_size {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        let key = ArenaKey {
            stream,
            kind,
            graph_pool: pool,
        };
        let Some(&aid) = self.arena_of.get(&key) else {
            return Err(Error::InvalidState(format!(
                "cannot re-create block at {ptr:#x}: no memory of stream {stream:#x} in pool {pool:?}"
            )));
        };
        self.with_arena(aid, Arena::flush_quick);
        let fits = match self.arenas[aid as usize].block_containing(ptr) {
            Some((start, b)) => match b.state {
                ArenaState::FreeMapped { .. } if ptr + size <= start + b.size => None,
                ArenaState::FreeMapped { .. } => Some("it runs past the free block there"),
                ArenaState::Live => Some("it is allocated"),
                _ => Some("its memory is not mapped any more"),
            },
            None => Some("it is not in this pool's memory"),
        };
        if let Some(why) = fits {
            return Err(Error::InvalidState(format!(
                "cannot re-create block at {ptr:#x} of {size} bytes: {why}"
            )));
        }
        self.now += 1;
        let now = self.now;
        self.with_arena(aid, |a| a.carve(ptr, size, now));
        self.record_alloc(aid, ptr, size, requested, stream, kind);
        Ok(())
    }

    fn record_alloc(
        &mut self,
        aid: u32,
        addr: DevicePtr,
        size: u64,
        requested: u64,
        stream: StreamId,
        kind: PoolKind,
    ) {
        self.live.insert(
            addr,
            LiveBlock {
                arena: aid,
                size,
                requested,
                stream,
                extra: Vec::new(),
                pending: false,
            },
        );
        let s = &mut self.stats;
        s.allocation.increase(kind, 1);
        s.allocated_bytes.increase(kind, size as i64);
        s.requested_bytes.increase(kind, requested as i64);
        s.active.increase(kind, 1);
        s.active_bytes.increase(kind, size as i64);
        self.trace(TraceAction::Alloc, addr, size, stream);
    }

    fn allocate_slow<D: Device>(
        &mut self,
        dev: &D,
        requested: u64,
        size: u64,
        aid: u32,
    ) -> Result<DevicePtr> {
        self.flush_quick();
        if self.captures == 0 {
            self.process_retired(dev, false)?;
        }
        for attempt in 0..3 {
            let placement = match self.arenas[aid as usize].find_placement(size) {
                Some(p) => p,
                None => {
                    self.grow_arena(dev, aid, size)?;
                    match self.arenas[aid as usize].find_placement(size) {
                        Some(p) => p,
                        None => {
                            return Err(Error::InvalidState(
                                "a new virtual range does not fit the request".into(),
                            ))
                        }
                    }
                }
            };
            let exclude = placement.neighbours;
            match self.acquire_pages(dev, placement.map_pages, aid, size, attempt, exclude)? {
                Some(pages) => {
                    self.map_pages(dev, aid, placement.map_start, pages)?;
                    let now = self.now;
                    self.with_arena(aid, |a| a.carve(placement.start, size, now));
                    return Ok(placement.start);
                }
                None if self.captures > 0 => break,
                None => {
                    self.stats.num_alloc_retries += 1;
                    self.synchronize_all(dev)?;
                    if attempt == 1 || !self.cfg.may_stitch(size) || self.cfg.defrag_level >= 2 {
                        self.release_cached(dev)?;
                    }
                }
            }
        }
        // Declaring OOM: pages created on the way go back to the device.
        for h in std::mem::take(&mut self.spare) {
            self.release_page(dev, h)?;
        }
        self.stats.num_ooms += 1;
        let stream = self.arenas[aid as usize].key.stream;
        let device_free = dev.free_memory().unwrap_or(0) as u64;
        self.trace(TraceAction::Oom, device_free, requested, stream);
        let cached: u64 = self.arenas.iter().map(|a| a.free_mapped_bytes).sum();
        tracing::info!(requested, "gmlake: out of memory");
        Err(Error::OutOfMemory(Box::new(OomInfo {
            requested,
            device_free,
            device_total: self.total,
            reserved: self.physical_pages * self.page,
            allocated: self.stats.allocated_bytes.aggregate().current as u64,
            cached_free: cached,
            limit: self.limit,
            stitches: self.stats.stitches,
        })))
    }

    /// Coalesces every arena's quick blocks, so that misses see all free memory.
    fn flush_quick(&mut self) {
        for aid in 0..self.arenas.len() as u32 {
            self.with_arena(aid, Arena::flush_quick);
        }
    }

    fn grow_arena<D: Device>(&mut self, dev: &D, aid: u32, size: u64) -> Result<()> {
        let len = self.chunk_size.max(size.div_ceil(self.page) * self.page);
        let va = drv!(
            self,
            reserve_va,
            dev.reserve_va(len as usize, self.page as usize)
        )?;
        self.arenas[aid as usize].add_chunk(va, len);
        self.chunk_owner.insert(va, (va + len, aid));
        Ok(())
    }

    /// Finds `n` pages for arena `aid`: spare pages, then stitching and new memory in the
    /// order `defragLevel` says. `None` when they cannot all be had now; nothing is lost
    /// then (pages created on the way are kept as spares).
    fn acquire_pages<D: Device>(
        &mut self,
        dev: &D,
        n: u64,
        aid: u32,
        size: u64,
        attempt: usize,
        exclude: [Option<u64>; 2],
    ) -> Result<Option<Vec<(PhysHandle, bool)>>> {
        let mut out: Vec<(PhysHandle, bool)> = Vec::with_capacity(n as usize);
        while (out.len() as u64) < n {
            match self.spare.pop() {
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
        let steal_first = stitch && level == 0;
        let mut avail = if steal_first {
            self.stealable_for(dev, aid, need, exclude)?
        } else {
            0
        };
        let mut steal = need.min(avail);
        // Do not create pages for a request the limit cannot satisfy anyway.
        if let Some(limit) = self.limit {
            let creatable = (limit / self.page).saturating_sub(self.physical_pages);
            let later = if stitch && !steal_first {
                self.stealable_for(dev, aid, need, exclude)?
            } else {
                0
            };
            if steal + creatable + later < need {
                self.spare.extend(out.into_iter().map(|p| p.0));
                return Ok(None);
            }
        }
        let created = match self.create_pages(dev, need - steal) {
            Ok(c) => c,
            Err(e) => {
                self.spare.extend(out.into_iter().map(|p| p.0));
                return Err(e);
            }
        };
        let short = need - steal - created.len() as u64;
        if short > 0 && stitch {
            if !steal_first {
                avail = self.stealable_for(dev, aid, short, exclude)?;
            }
            steal += short.min(avail.saturating_sub(steal));
        }
        if steal + (created.len() as u64) < need {
            self.spare.extend(out.into_iter().map(|p| p.0));
            self.spare.extend(created);
            return Ok(None);
        }
        out.extend(created.into_iter().map(|h| (h, false)));
        if steal > 0 {
            let stolen = self.stitch_pages(dev, steal, aid, exclude)?;
            out.extend(stolen.into_iter().map(|h| (h, true)));
        }
        Ok(Some(out))
    }

    /// Creates up to `n` pages, stopping at the limit or when the device is full.
    fn create_pages<D: Device>(&mut self, dev: &D, n: u64) -> Result<Vec<PhysHandle>> {
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            if self
                .limit
                .is_some_and(|l| (self.physical_pages + 1) * self.page > l)
            {
                break;
            }
            match drv!(
                self,
                create_physical,
                dev.create_physical(self.page as usize)
            ) {
                Ok(h) => {
                    self.physical_pages += 1;
                    self.stats.num_device_alloc += 1;
                    self.stats
                        .reserved_bytes
                        .increase(PoolKind::Large, self.page as i64);
                    self.stats.segment.increase(PoolKind::Large, 1);
                    out.push(h);
                }
                Err(DeviceError::OutOfMemory) => break,
                Err(e) => {
                    self.spare.extend(out);
                    return Err(e.into());
                }
            }
        }
        Ok(out)
    }

    fn release_page<D: Device>(&mut self, dev: &D, h: PhysHandle) -> Result<()> {
        drv!(self, release_physical, dev.release_physical(h))?;
        self.physical_pages -= 1;
        self.stats.num_device_free += 1;
        self.stats
            .reserved_bytes
            .decrease(PoolKind::Large, self.page as i64);
        self.stats.segment.decrease(PoolKind::Large, 1);
        Ok(())
    }

    /// Pages that arena `aid` may take from free mapped blocks: same stream at once, other
    /// streams once fenced, never from a live graph pool. Refreshes fences of other streams
    /// only when the same stream cannot cover `want`.
    fn stealable_for<D: Device>(
        &mut self,
        dev: &D,
        aid: u32,
        want: u64,
        exclude: [Option<u64>; 2],
    ) -> Result<u64> {
        let target = self.arenas[aid as usize].key;
        let a = &self.arenas[aid as usize];
        let excluded: u64 = exclude
            .iter()
            .flatten()
            .map(|&x| a.block(x).map_or(0, |b| a.interior(x, b.size).1))
            .sum();
        let same: u64 = self
            .arenas
            .iter()
            .filter(|a| a.key.stream == target.stream && self.pool_may_give(a))
            .map(|a| a.stealable_pages)
            .sum::<u64>()
            - excluded;
        if same >= want {
            return Ok(same);
        }
        self.refresh_fences(dev, target.stream)?;
        Ok(same
            + self
                .arenas
                .iter()
                .filter(|a| a.key.stream != target.stream && self.may_give(a, target.stream))
                .map(|a| a.stealable_pages)
                .sum::<u64>())
    }

    fn pool_may_give(&self, a: &Arena) -> bool {
        a.key.graph_pool == GraphPoolId::DEFAULT || self.released_pools.contains(&a.key.graph_pool)
    }

    fn may_give(&self, a: &Arena, stream: StreamId) -> bool {
        self.pool_may_give(a)
            && (a.key.stream == stream
                || self
                    .fences
                    .get(&a.key.stream)
                    .is_some_and(|f| f.completed >= a.last_free))
    }

    /// Completes fences whose events are done and records new ones on streams whose free
    /// blocks are not yet fenced.
    fn refresh_fences<D: Device>(&mut self, dev: &D, stream: StreamId) -> Result<()> {
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
                    self.event_pool.push(e);
                }
            }
        }
        Ok(())
    }

    fn get_event<D: Device>(&mut self, dev: &D) -> Result<EventHandle> {
        match self.event_pool.pop() {
            Some(e) => Ok(e),
            None => Ok(drv!(self, create_event, dev.create_event())?),
        }
    }

    /// Chooses the next block to take pages from, by strategy: (arena, block, pages there).
    fn choose_source(
        &self,
        aid: u32,
        need: u64,
        exclude: [Option<u64>; 2],
    ) -> Option<(u32, u64, u64)> {
        let target = self.arenas[aid as usize].key.stream;
        let skip = |i: usize, addr: u64| i == aid as usize && exclude.contains(&Some(addr));
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

    fn largest_source<'a>(
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
    /// available). Their old ranges are retired behind one event per source stream.
    fn stitch_pages<D: Device>(
        &mut self,
        dev: &D,
        k: u64,
        aid: u32,
        exclude: [Option<u64>; 2],
    ) -> Result<Vec<PhysHandle>> {
        let target_kind = self.arenas[aid as usize].key.kind;
        let mut got: Vec<PhysHandle> = Vec::with_capacity(k as usize);
        let mut batches = Vec::new();
        while (got.len() as u64) < k {
            let Some((src, addr, _)) = self.choose_source(aid, k - got.len() as u64, exclude)
            else {
                break;
            };
            let want = k - got.len() as u64;
            let (taken, handles) =
                self.retire_pages(&mut batches, src, addr, want, target_kind, false);
            if taken == 0 {
                break;
            }
            got.extend(handles);
        }
        self.record_retired(dev, batches)?;
        self.stats.stitches += 1;
        self.stats.pages_stitched += got.len() as u64;
        if (got.len() as u64) < k {
            // Not reached when stealable_for counted right; keep the pages and report.
            self.spare.extend(got);
            return Err(Error::InvalidState(
                "stitch found fewer free pages than counted".into(),
            ));
        }
        self.maybe_auto_gc(dev)?;
        Ok(got)
    }

    /// After a stitch: if more than autoGC bytes sit in free mapped blocks, retire the
    /// largest cached ranges for release until below the threshold.
    fn maybe_auto_gc<D: Device>(&mut self, dev: &D) -> Result<()> {
        let Some(limit) = self.cfg.auto_gc_bytes else {
            return Ok(());
        };
        let cached = |s: &State| s.arenas.iter().map(|a| a.free_mapped_bytes).sum::<u64>();
        let mut batches = Vec::new();
        while cached(self) > limit {
            let Some((src, addr, _)) = self.largest_source(
                self.arenas
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.stealable_pages > 0 && self.pool_may_give(a)),
                &|_, _| false,
            ) else {
                break;
            };
            let (taken, _) =
                self.retire_pages(&mut batches, src, addr, u64::MAX, PoolKind::Large, true);
            if taken == 0 {
                break;
            }
        }
        self.record_retired(dev, batches)
    }

    /// Moves the count of `n` pages from pool `from` to pool `to` (pages mapped nowhere
    /// count as large).
    fn move_pages(&mut self, from: PoolKind, to: PoolKind, n: u64) {
        self.stats
            .reserved_bytes
            .transfer(from, to, (n * self.page) as i64);
        self.stats.segment.transfer(from, to, n as i64);
    }

    /// Takes up to `max` interior pages of the free mapped block at `addr` of arena `src`
    /// into a retired range, added to the batch of the arena's stream, counting the pages in
    /// pool `to`. With `release` the pages are released once the range is unmapped (and kept
    /// in the batch); otherwise they are returned, for mapping elsewhere. Returns the number
    /// of pages taken too.
    fn retire_pages(
        &mut self,
        batches: &mut Vec<(StreamId, RetiredBatch)>,
        src: u32,
        addr: u64,
        max: u64,
        to: PoolKind,
        release: bool,
    ) -> (u64, Vec<PhysHandle>) {
        let (start, handles) = self.with_arena(src, |a| a.take_pages(addr, max, true));
        if handles.is_empty() {
            return (0, handles);
        }
        let key = self.arenas[src as usize].key;
        let n = handles.len() as u64;
        self.move_pages(key.kind, to, n);
        let i = match batches.iter().position(|b| b.0 == key.stream) {
            Some(i) => i,
            None => {
                batches.push((
                    key.stream,
                    RetiredBatch {
                        event: EventHandle(0),
                        ranges: Vec::new(),
                        release: Vec::new(),
                    },
                ));
                batches.len() - 1
            }
        };
        batches[i].1.ranges.push((src, start, n));
        if release {
            batches[i].1.release.extend(handles);
            (n, Vec::new())
        } else {
            (n, handles)
        }
    }

    /// Queues retired batches behind an event recorded now on each one's stream.
    fn record_retired<D: Device>(
        &mut self,
        dev: &D,
        batches: Vec<(StreamId, RetiredBatch)>,
    ) -> Result<()> {
        for (stream, mut b) in batches {
            b.event = self.get_event(dev)?;
            drv!(self, record_event, dev.record_event(b.event, stream))?;
            self.retired.push_back(b);
        }
        Ok(())
    }

    /// Maps `pages` at `start` in arena `aid` and grants access with one call.
    fn map_pages<D: Device>(
        &mut self,
        dev: &D,
        aid: u32,
        start: u64,
        pages: Vec<(PhysHandle, bool)>,
    ) -> Result<()> {
        if pages.is_empty() {
            return Ok(());
        }
        let p = self.page;
        let kind = self.arenas[aid as usize].key.kind;
        let n = pages.len() as u64;
        for (i, &(h, stitched)) in pages.iter().enumerate() {
            let va = start + i as u64 * p;
            if let Err(e) = drv!(self, map, dev.map(va, p as usize, h)) {
                self.unmap_failed_range(dev, aid, start, i as u64, &pages);
                return Err(e.into());
            }
            self.arenas[aid as usize].pages.insert(
                va,
                Page {
                    handle: h,
                    stitched,
                },
            );
        }
        if let Err(e) = drv!(self, set_access, dev.set_access(start, (n * p) as usize)) {
            self.unmap_failed_range(dev, aid, start, n, &pages);
            return Err(e.into());
        }
        // Pages are counted in the large pool while they are mapped nowhere.
        self.move_pages(PoolKind::Large, kind, n);
        let stream = self.arenas[aid as usize].key.stream;
        self.trace(TraceAction::SegmentMap, start, n * p, stream);
        Ok(())
    }

    /// Undoes the first `mapped` maps of a failed `map_pages`; the pages become spares.
    fn unmap_failed_range<D: Device>(
        &mut self,
        dev: &D,
        aid: u32,
        start: u64,
        mapped: u64,
        pages: &[(PhysHandle, bool)],
    ) {
        for i in 0..mapped {
            let va = start + i * self.page;
            let _ = drv!(self, unmap, dev.unmap(va, self.page as usize));
            self.arenas[aid as usize].pages.remove(&va);
        }
        self.spare.extend(pages.iter().map(|p| p.0));
    }

    fn free<D: Device>(&mut self, dev: &D, ptr: DevicePtr) -> Result<()> {
        let Some(b) = self.live.get(&ptr) else {
            return Err(
                if self.live_containing(ptr).is_some()
                    || self
                        .chunk_owner
                        .range(..=ptr)
                        .next_back()
                        .is_none_or(|(_, c)| ptr >= c.0)
                {
                    Error::UnknownPointer(ptr)
                } else {
                    Error::DoubleFree(ptr)
                },
            );
        };
        if b.pending {
            return Err(Error::DoubleFree(ptr));
        }
        let (size, requested, stream) = (b.size, b.requested, b.stream);
        let used_elsewhere = !b.extra.is_empty();
        let kind = self.arenas[b.arena as usize].key.kind;
        let s = &mut self.stats;
        s.allocation.decrease(kind, 1);
        s.allocated_bytes.decrease(kind, size as i64);
        s.requested_bytes.decrease(kind, requested as i64);
        self.trace(TraceAction::FreeRequested, ptr, size, stream);
        if !used_elsewhere {
            self.finish_free(ptr);
            return Ok(());
        }
        // Events are recorded now, or after the capture that forbids them.
        let events = if self.captures == 0 {
            self.record_on_extra_streams(dev, ptr)?
        } else {
            Vec::new()
        };
        if let Some(b) = self.live.get_mut(&ptr) {
            b.pending = true;
        }
        self.pending.push_back(PendingFree { ptr, events });
        Ok(())
    }

    /// Records a pooled event on each other stream that used the live block at `ptr`.
    fn record_on_extra_streams<D: Device>(
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

    fn finish_free(&mut self, ptr: DevicePtr) {
        let Some(b) = self.live.remove(&ptr) else {
            return;
        };
        self.now += 1;
        let now = self.now;
        let kind = self.arenas[b.arena as usize].key.kind;
        self.with_arena(b.arena, |a| a.release(ptr, now));
        self.stats.active.decrease(kind, 1);
        self.stats.active_bytes.decrease(kind, b.size as i64);
        self.trace(TraceAction::FreeCompleted, ptr, b.size, b.stream);
    }

    /// Completes pending frees whose events are done, in order (all of them if `all`,
    /// after a device synchronisation).
    fn process_pending<D: Device>(&mut self, dev: &D, all: bool) -> Result<()> {
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
            self.finish_free(p.ptr);
        }
        Ok(())
    }

    /// Unmaps retired ranges whose events are done (all of them if `all`).
    fn process_retired<D: Device>(&mut self, dev: &D, all: bool) -> Result<()> {
        while let Some(b) = self.retired.front() {
            let e = b.event;
            if !all && !drv!(self, query_event, dev.query_event(e))? {
                break;
            }
            let b = self.retired.pop_front().expect("front exists");
            for &(aid, start, n) in &b.ranges {
                for i in 0..n {
                    drv!(
                        self,
                        unmap,
                        dev.unmap(start + i * self.page, self.page as usize)
                    )?;
                }
                self.with_arena(aid, |a| a.unretire(start));
            }
            for h in b.release {
                self.release_page(dev, h)?;
            }
            self.event_pool.push(b.event);
        }
        Ok(())
    }

    /// Waits for the device; then every fence, pending free and retired range completes.
    fn synchronize_all<D: Device>(&mut self, dev: &D) -> Result<()> {
        if self.captures > 0 {
            return Ok(());
        }
        drv!(self, synchronize, dev.synchronize())?;
        self.stats.num_sync_all_streams += 1;
        let now = self.now;
        let mut freed = Vec::new();
        for f in self.fences.values_mut() {
            if let Some((e, _)) = f.pending.take() {
                freed.push(e);
            }
            f.completed = now;
        }
        self.event_pool.extend(freed);
        self.process_pending(dev, true)?;
        self.process_retired(dev, true)
    }

    /// empty_cache: every free page back to the device, empty virtual chunks freed.
    fn release_cached<D: Device>(&mut self, dev: &D) -> Result<()> {
        self.synchronize_all(dev)?;
        self.flush_quick();
        for h in std::mem::take(&mut self.spare) {
            self.release_page(dev, h)?;
        }
        for aid in 0..self.arenas.len() as u32 {
            if !self.pool_may_give(&self.arenas[aid as usize]) {
                continue;
            }
            let key = self.arenas[aid as usize].key;
            while let Some((_, addr)) = self.arenas[aid as usize].largest() {
                let (start, handles) =
                    self.with_arena(aid, |a| a.take_pages(addr, u64::MAX, false));
                let n = handles.len() as u64;
                self.move_pages(key.kind, PoolKind::Large, n);
                for (i, h) in handles.into_iter().enumerate() {
                    drv!(
                        self,
                        unmap,
                        dev.unmap(start + i as u64 * self.page, self.page as usize)
                    )?;
                    self.release_page(dev, h)?;
                }
                self.trace(TraceAction::SegmentUnmap, start, n * self.page, key.stream);
            }
            for (start, len) in self.arenas[aid as usize].drain_empty_chunks() {
                drv!(self, free_va, dev.free_va(start, len as usize))?;
                self.chunk_owner.remove(&start);
            }
        }
        Ok(())
    }

    fn snapshot(&self) -> Snapshot {
        let mut segments = Vec::new();
        for a in &self.arenas {
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
                let lo = addr & !(self.page - 1);
                let hi = (addr + b.size).div_ceil(self.page) * self.page;
                let stitched = a.pages.range(lo..hi).any(|(_, p)| p.stitched);
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
        }
        for s in &mut segments {
            s.pages = s.total_size / self.page;
        }
        segments.sort_by_key(|s| s.address);
        Snapshot {
            segments,
            page_size: self.page,
            config: self.cfg.to_pairs(),
        }
    }

    fn verify(&self) -> std::result::Result<(), String> {
        let mut mapped = 0u64;
        let mut handles = FxHashSet::default();
        let (mut alloc, mut alloc_bytes) = ([0i64; 3], [0i64; 3]);
        let (mut inactive, mut inactive_bytes) = ([0i64; 3], [0i64; 3]);
        for a in &self.arenas {
            a.check()?;
            mapped += a.pages.len() as u64;
            for p in a.pages.values() {
                if !handles.insert(p.handle) {
                    return Err(format!("handle {:?} mapped twice as active", p.handle));
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
        // Pages: mapped actively, waiting for release after GC, or spare. Stitched pages'
        // retired ranges are aliases of actively mapped ones.
        if mapped + gc + self.spare.len() as u64 != self.physical_pages {
            return Err(format!(
                "pages: {mapped} mapped + {gc} gc + {} spare != {} created ({retired} retired)",
                self.spare.len(),
                self.physical_pages
            ));
        }
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
        if cur(&s.reserved_bytes, 0) != (self.physical_pages * self.page) as i64
            || cur(&s.segment, 0) != self.physical_pages as i64
        {
            return Err("reserved stats differ from pages held".into());
        }
        let active_count = self.live.len() as i64;
        if cur(&s.active, 0) != active_count {
            return Err("active stats differ from recount".into());
        }
        Ok(())
    }
}
