//! The allocator: one per device, one short lock.
//!
//! Requests are rounded to 512 bytes and served from the arena of their (stream, pool kind,
//! graph pool). The hot path is a best fit among the arena's free mapped blocks: no driver
//! call. Otherwise the request is placed on unmapped virtual space (after the free mapped
//! block before it, whose pages are reused), and the missing pages are *stitched*: taken
//! from free mapped blocks anywhere they may come from, before the device is asked for new
//! memory (`defragLevel` changes that order). A page taken from a block is mapped at its new
//! address at once; its old mapping is kept (the range becomes *lent*), so that when the
//! page is free again the old range can be used again with no driver call (a *reuse*):
//! periodic jobs find last step's ranges and make no driver call once warm. Aliases are
//! bounded (`max_aliases`); the oldest are unmapped, behind an event recorded on their
//! stream, when there are more.
//!
//! Module map: this file holds the API and the hot path (allocate, free); `pages` sources
//! pages (spare, new, stitched, reused) and owns their accounting (`PageBook`); `streams`
//! holds fences, pending frees, retired ranges and events; `release` returns memory
//! (empty_cache, autoGC, alias eviction); `report` holds snapshots and the invariant check;
//! `upgrade` holds the page-size upgrade (page generations, draining the old one); `misses`
//! logs, on request, why a miss took no kept window (a diagnostic); `watch` tells, once, when
//! driver calls take a large share of the job's time (`driver_share_notice`).
//!
//! Stream rules, as PyTorch's: a block freed on stream S is reused on S at once; a block
//! used on other streams (record_stream) is freed only once events recorded on those
//! streams at free time complete; pages of free blocks of another stream are stitched only
//! once a fence event recorded on that stream after their free has completed. Pages of a
//! live CUDA graph pool are never taken (a replay still uses their addresses).

use crate::arena::{Arena, BlockState as ArenaState, Page, Take};
use crate::config::{Config, StitchStrategy};
use crate::device::{Device, DeviceError, DevicePtr, EventHandle, PhysHandle, StreamId};
use crate::error::{Error, OomInfo, Result};
use crate::ipc::{Imports, SharedPages};
use crate::keys::ArenaKey;
pub use crate::keys::GraphPoolId;
use crate::stats::{BlockInfo, BlockState, DeviceStats, PoolKind, SegmentInfo, Snapshot};
pub use misses::{MissRecord, MissWindow};
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Allocation granularity of blocks (PyTorch's kMinBlockSize).
pub const BLOCK_ROUND: u64 = 512;
/// Largest request accepted (a sanity bound far above any GPU's memory).
pub const MAX_REQUEST: u64 = 1 << 50;

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

struct State {
    cfg: Config,
    /// The size of the pages new memory gets: the first page size, then, after the upgrade,
    /// `page_upgrade_size`. Arenas keep the size of their generation (`Arena::page`).
    page: u64,
    /// The current page generation (`ArenaKey::gen`): 0, one more at each upgrade.
    gen: u8,
    /// (bytes held that trigger it, page size after it, 0: chosen then) of the page-size
    /// upgrade still to come; None when off, in debug mode, or done.
    upgrade: Option<(u64, u64)>,
    /// A block was freed into an arena of an older generation: its free pages are to go
    /// back to the device (`drain_old`).
    drain_due: bool,
    /// Pages mapped again so far: stitched, or mapped in place of a replaced alias (not
    /// reset with the statistics).
    remapped: u64,
    /// `remapped` when the allocator first held `page_upgrade_at` bytes: the upgrade's
    /// rent-or-buy count starts there.
    remap_mark: Option<u64>,
    /// (bytes, blocks) of the large pool's live blocks when its active bytes were at their
    /// highest so far: the job's scale, from which an automatic upgrade (`page_upgrade_size`
    /// 0) chooses its page (`upgrade::auto_page`). Kept until the upgrade.
    large_peak: (u64, u64),
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
    /// (stream, other stream) -> stamp: `stream` waits on the device for the work `other` had
    /// queued at that stamp (`cross_stream_wait`), so `other`'s frees up to it are safe for
    /// `stream`'s later work.
    waited: FxHashMap<(StreamId, StreamId), u64>,
    /// Every physical page: how many, where each is active, spares.
    book: pages::PageBook,
    released_pools: FxHashSet<GraphPoolId>,
    captures: u32,
    now: u64,
    stats: DeviceStats,
    history_cap: usize,
    history: VecDeque<TraceEvent>,
    /// `set_miss_log`: the last `miss_log_cap` misses that took no kept window (0: off).
    miss_log_cap: usize,
    miss_log: VecDeque<misses::MissRecord>,
    /// The memory debugging mode; `None` when off (see `debug.rs`).
    debug: Option<Box<debug::DebugState>>,
    /// Lent pages one miss may examine for a reusable window (`pages::MAX_REUSE_CHECKS`;
    /// tests lower it to exercise the resumed scan).
    reuse_checks: u64,
    /// Tests: every miss that may take no busy alias also runs the scan that classifies every
    /// page, and panics if it chooses otherwise (`set_check_clean_spans`).
    check_clean_spans: bool,
    /// The driver-share watch (`watch.rs`) and the notices it queued, not yet taken; the
    /// flag (shared with the `Allocator`) says there are some, read without the lock.
    watch: watch::DriverShare,
    /// The page the watch asked for (`driver_share_upgrade`), made at the next allocation
    /// with no capture under way.
    share_upgrade: Option<u64>,
    /// Page-size upgrades may happen at all: `page_upgrade_at` is on and debug mode off.
    pages_may_grow: bool,
    notices: Vec<String>,
    notice_flag: Arc<AtomicBool>,
}

/// The allocator for one device. `Send + Sync`; every operation takes one lock briefly.
pub struct Allocator<D: Device> {
    device: D,
    state: Mutex<State>,
    /// Ranges imported from other processes. Lock order: `state` before `imports`.
    imports: Mutex<Imports>,
    /// Closed imports still mapped (`Imports::closing`), read without the lock so that
    /// allocator calls look at them only when there are some.
    imports_closing: AtomicUsize,
    /// Notices are queued (`take_notices`), read without the lock.
    notice_flag: Arc<AtomicBool>,
}

/// A driver call: counted by kind and timed (`driver_ns`, read by the driver-share watch;
/// two clock readings, tens of nanoseconds against a call's microseconds), and with
/// `host_timing` noted for the calling thread's slow-call figures (`crate::calltime`).
macro_rules! drv {
    ($st:expr, $kind:ident, $call:expr) => {{
        $st.stats.driver_calls.$kind += 1;
        let t0 = std::time::Instant::now();
        let r = $call;
        let ns = t0.elapsed().as_nanos() as u64;
        $st.stats.driver_ns += ns;
        if $st.cfg.host_timing {
            $crate::calltime::note_driver(stringify!($kind), ns);
        }
        r
    }};
}

mod debug;
mod misses;
mod pages;
mod release;
mod report;
mod streams;
mod upgrade;
mod watch;

use streams::{Fence, PendingFree, RetiredBatch};

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
        let upgrade = match config.page_upgrade_at {
            Some(_) if config.debug.enabled() => None,
            Some(at) => {
                // 0: chosen at the upgrade (`upgrade::auto_page`).
                let big = config.page_upgrade_size;
                if big != 0 && (big <= page || !big.is_multiple_of(gran)) {
                    return Err(Error::InvalidConfig {
                        key: "page_upgrade_size".into(),
                        value: big.to_string(),
                        reason: format!(
                            "not a multiple of the device granularity {gran} larger than the page size {page}"
                        ),
                    });
                }
                Some((at, big))
            }
            None => None,
        };
        let pages_may_grow = upgrade.is_some();
        let total = device.total_memory()? as u64;
        let chunk_size = total.div_ceil(page).max(64) * page;
        let debug = debug::DebugState::new(&config.debug, page);
        let mut state = State {
            cfg: config,
            page,
            gen: 0,
            upgrade,
            drain_due: false,
            remapped: 0,
            remap_mark: None,
            large_peak: (0, 0),
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
            waited: FxHashMap::default(),
            book: pages::PageBook {
                gen_page: vec![page],
                ..pages::PageBook::default()
            },
            released_pools: FxHashSet::default(),
            captures: 0,
            now: 0,
            stats: DeviceStats {
                max_split_size: i64::MAX,
                ..DeviceStats::default()
            },
            history_cap: 0,
            history: VecDeque::new(),
            miss_log_cap: 0,
            miss_log: VecDeque::new(),
            debug,
            reuse_checks: pages::MAX_REUSE_CHECKS,
            check_clean_spans: false,
            watch: watch::DriverShare::default(),
            share_upgrade: None,
            pages_may_grow,
            notices: Vec::new(),
            notice_flag: Arc::new(AtomicBool::new(false)),
        };
        let notice_flag = state.notice_flag.clone();
        state.update_limit();
        tracing::debug!(page, total, "gmlake allocator created");
        Ok(Allocator {
            device,
            state: Mutex::new(state),
            imports: Mutex::new(Imports::default()),
            imports_closing: AtomicUsize::new(0),
            notice_flag,
        })
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    pub fn config(&self) -> Config {
        self.state.lock().cfg.clone()
    }

    /// The size in bytes of the pages new memory gets (after a page-size upgrade, the larger
    /// one; memory mapped before keeps its pages).
    pub fn page_size(&self) -> u64 {
        self.state.lock().page
    }

    /// Allocates `size` bytes for use on `stream` in the default pool. 0 bytes gives a null
    /// pointer, as PyTorch does.
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<DevicePtr> {
        self.allocate_in(size, stream, GraphPoolId::DEFAULT)
    }

    /// The state's lock for an allocation or a free: the wait for it, when another thread
    /// held it, goes to the calling thread's slow-call figures (`crate::calltime`); an
    /// uncontended lock reads no clock.
    fn lock_timed(&self) -> parking_lot::MutexGuard<'_, State> {
        if let Some(st) = self.state.try_lock() {
            return st;
        }
        let t0 = std::time::Instant::now();
        let st = self.state.lock();
        crate::calltime::note_lock_wait(t0.elapsed().as_nanos() as u64);
        st
    }

    /// Allocates into a CUDA graph pool (`GraphPoolId::DEFAULT` for the default pool).
    pub fn allocate_in(&self, size: u64, stream: StreamId, pool: GraphPoolId) -> Result<DevicePtr> {
        if size == 0 {
            return Ok(0);
        }
        round_request(size)?;
        self.process_closed_imports();
        let mut st = self.lock_timed();
        let rounded = st.cfg.round_size(size);
        match st.allocate(&self.device, size, rounded, stream, pool) {
            // Debug mode: the quarantine and spare guard pages go back before giving up.
            Err(Error::OutOfMemory(_)) if st.debug_flush(&self.device, true)? => {
                st.allocate(&self.device, size, rounded, stream, pool)
            }
            r => r,
        }
    }

    /// As [`Allocator::allocate_in`], placing `rounded` bytes (at least `size`, rounded up to
    /// 512 bytes here) for a request of `size`: the caller applies its own rounding
    /// (PyTorch's `roundup_power2_divisions`, or whole pages for a pool that must not share
    /// pages between allocations). Statistics count `size` as requested, `rounded` as
    /// allocated.
    pub fn allocate_rounded(
        &self,
        size: u64,
        rounded: u64,
        stream: StreamId,
        pool: GraphPoolId,
    ) -> Result<DevicePtr> {
        if size == 0 {
            return Ok(0);
        }
        let rounded = round_request(rounded.max(size))?;
        self.lock_timed()
            .allocate(&self.device, size, rounded, stream, pool)
    }

    /// The streams a live allocation was recorded on (`record_stream`), besides its own;
    /// None for a pointer that is not a live allocation.
    pub fn stream_uses(&self, ptr: DevicePtr) -> Option<Vec<StreamId>> {
        let st = self.state.lock();
        st.live
            .get(&ptr)
            .filter(|b| !b.pending)
            .map(|b| b.extra.clone())
    }

    /// Forgets the streams a live allocation was recorded on (`record_stream`): a CUDA graph
    /// capture proved, from the graph's dependencies, that every use on those streams is
    /// ordered before any later work of the allocation's stream, so a free needs no event.
    pub fn clear_stream_uses(&self, ptr: DevicePtr) -> Result<()> {
        let mut st = self.state.lock();
        match st.live.get_mut(&ptr) {
            Some(b) if !b.pending => {
                b.extra.clear();
                Ok(())
            }
            Some(_) => Err(Error::DoubleFree(ptr)),
            None => Err(Error::UnknownPointer(ptr)),
        }
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
        self.process_closed_imports();
        let mut st = self.lock_timed();
        st.free(&self.device, ptr)?;
        if st.drain_due {
            st.drain_old(&self.device)?;
        }
        if st.debug.is_some() {
            st.debug_after_free(&self.device)?;
        }
        Ok(())
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
            None => st.debug_record_stream(ptr, stream),
        }
    }

    /// Returns every cached page to the device (after waiting for the device), and frees
    /// virtual ranges that hold nothing. Live allocations and live graph pools are kept.
    pub fn empty_cache(&self) -> Result<()> {
        self.process_closed_imports();
        let mut st = self.state.lock();
        if st.captures > 0 {
            return Ok(());
        }
        st.release_cached(&self.device)?;
        // Debug mode: the quarantine (pending frees just completed included) goes back too.
        if st.debug_flush(&self.device, true)? {
            st.release_cached(&self.device)?;
        }
        Ok(())
    }

    /// Caps reserved memory at `fraction` of the device (PyTorch's setMemoryFraction).
    /// 0 allows nothing to be reserved; 1 removes the cap (`memory_fraction()` is None again).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidConfig {
                key: "memory_fraction".into(),
                value: fraction.to_string(),
                reason: "expected a fraction in [0, 1]".into(),
            });
        }
        let mut st = self.state.lock();
        // As PyTorch: 1 removes the cap.
        st.cfg.memory_fraction = (fraction < 1.0).then_some(fraction);
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
    ///
    /// `inactive_split` (current) counts, as PyTorch's, only free blocks that share their
    /// segment (here: the run of mapped blocks) with an active block: a run that is free from
    /// end to end is cached memory, not a split one. The running counters (peak, allocated,
    /// freed) count every free mapped block.
    pub fn stats(&self) -> DeviceStats {
        self.process_closed_imports();
        let mut st = self.state.lock();
        let mut s = st.stats.clone();
        for a in &mut st.arenas {
            let (count, bytes) = a.whole_free_runs();
            let kind = a.key.kind;
            s.inactive_split.0[0].current -= count as i64;
            s.inactive_split.0[kind as usize].current -= count as i64;
            s.inactive_split_bytes.0[0].current -= bytes as i64;
            s.inactive_split_bytes.0[kind as usize].current -= bytes as i64;
        }
        s.cached_bytes = st.arenas.iter().map(|a| a.free_mapped_bytes).sum();
        s.retired_bytes = st
            .retired
            .iter()
            .flat_map(|b| b.ranges.iter())
            .map(|r| r.2 * st.arenas[r.0 as usize].page())
            .sum();
        s.aliased_bytes = st.arenas.iter().map(|a| a.lent_pages() * a.page()).sum();
        s.pending_frees = st.pending.len() as u64;
        let imp = self.imports.lock();
        s.ipc_imported_bytes = imp.bytes();
        s.ipc_imports = imp.len() as u64;
        st.debug_stats(&mut s);
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
        self.state.lock().book.bytes
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
        let Some((base, _)) = st.live_containing(ptr) else {
            return st.debug_allocation(ptr);
        };
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
        let page = a.page();
        let lo = ptr & !(page - 1);
        let hi = (ptr + b.size).div_ceil(page) * page;
        Some(a.pages_in(lo, hi).map(|(v, p)| (v, p.handle)).collect())
    }

    /// The pages under the live allocation containing `ptr`, for sharing with another process
    /// (see [`crate::ipc`]): every page the block touches, in address order, and the offset of
    /// `ptr` from the first. The block stays this process's; the caller exports the pages.
    pub fn share(&self, ptr: DevicePtr) -> Result<SharedPages> {
        let mut st = self.state.lock();
        let (base, size) = st.live_containing(ptr).ok_or(Error::UnknownPointer(ptr))?;
        let aid = st.live.get(&base).ok_or(Error::UnknownPointer(ptr))?.arena;
        let page = st.arenas[aid as usize].page();
        let lo = base & !(page - 1);
        let hi = (base + size.max(1)).div_ceil(page) * page;
        let handles: Vec<PhysHandle> = st.arenas[aid as usize]
            .pages_in(lo, hi)
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
        let mut imp = self.imports.lock();
        self.process_closing_locked(&mut imp);
        imp.map(&self.device, handles, page_size)
    }

    /// Closes a range made by [`Allocator::import_pages`], ordered on `stream` (the stream
    /// PyTorch's IPC deleter runs on, whose work it then waits for): an event is recorded
    /// there, and the range is unmapped and its pages released once that event has completed
    /// — at once if it already has, else by a later allocator call (allocate, free,
    /// `empty_cache`, `stats`, another import or close) or at shutdown. Nothing here waits for
    /// the GPU, so no lock and no caller's lock (Python's GIL in the deleter) is held across
    /// a wait, and work on other streams is never waited for. Fails during a CUDA graph
    /// capture.
    pub fn close_imported(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        if self.state.lock().captures > 0 {
            return Err(Error::InvalidState(format!(
                "cannot close the imported range {ptr:#x} while a CUDA graph is captured"
            )));
        }
        let mut imp = self.imports.lock();
        let r = imp.close(&self.device, ptr, stream);
        self.imports_closing.store(imp.closing(), Ordering::Release);
        r
    }

    /// Unmaps and releases closed imports whose events have completed (no waiting). Allocator
    /// calls do it; for callers that want the memory back without one.
    pub fn process_closed_imports(&self) {
        if self.imports_closing.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut imp = self.imports.lock();
        self.process_closing_locked(&mut imp);
    }

    fn process_closing_locked(&self, imp: &mut Imports) {
        if imp.closing() == 0 {
            return;
        }
        if let Err(e) = imp.process_closing(&self.device, false) {
            tracing::warn!("gmlake: releasing a closed IPC import failed: {e}");
        }
        self.imports_closing.store(imp.closing(), Ordering::Release);
    }

    /// Grants access again on every range mapped now (blocks, retired aliases, imports), with
    /// the device's current access list: after a peer was added to it (`enablePeerAccess`),
    /// ranges mapped before must be granted anew. Holds the lock throughout, so no range
    /// changes meanwhile.
    pub fn regrant_access(&self) -> Result<()> {
        let st = self.state.lock();
        for a in &st.arenas {
            for (start, len) in a.mapped_runs() {
                drv_plain(&self.device, start, len)?;
            }
        }
        for b in &st.retired {
            for &(aid, start, n) in &b.ranges {
                drv_plain(&self.device, start, n * st.arenas[aid as usize].page())?;
            }
        }
        let imp = self.imports.lock();
        for (start, len) in imp.ranges() {
            drv_plain(&self.device, start, len)?;
        }
        Ok(())
    }

    /// Whether notices are waiting (`take_notices`): one atomic load, no lock, so that a
    /// caller may ask after every allocation.
    pub fn has_notices(&self) -> bool {
        self.notice_flag.load(Ordering::Acquire)
    }

    /// The notices queued since the last call, oldest first: things the user should know and
    /// can act on, such as the driver-share watch's (`driver_share_notice`). The bridge to
    /// PyTorch prints them to stderr.
    pub fn take_notices(&self) -> Vec<String> {
        let mut st = self.state.lock();
        self.notice_flag.store(false, Ordering::Release);
        std::mem::take(&mut st.notices)
    }

    /// For tests: asks for a page-size upgrade to `page` bytes as the driver-share watch does
    /// (`driver_share_upgrade`), made at the next allocation with no capture under way. Only
    /// where upgrades may happen (`page_upgrade_at` on, no debug mode) and `page` is larger
    /// than the current page and a multiple of the granularity; returns whether it was asked.
    #[doc(hidden)]
    pub fn request_page_upgrade(&self, page: u64) -> bool {
        let gran = self.device.granularity().unwrap_or(0) as u64;
        let mut st = self.state.lock();
        let ok = st.pages_may_grow
            && page > st.page
            && gran != 0
            && page.is_multiple_of(gran)
            && st.share_upgrade.is_none();
        if ok {
            st.share_upgrade = Some(page);
        }
        ok
    }

    /// For tests: the driver-share watch's window (`watch::DRIVER_SHARE_WINDOW`, 5 s).
    #[doc(hidden)]
    pub fn set_driver_share_window(&self, window: std::time::Duration) {
        self.state.lock().watch.window = window;
    }

    /// Sets how many lent pages one miss may examine when it looks for a kept range to
    /// reuse (default 4,096). For tests, which lower it so that scans are cut short and
    /// resume where they stopped.
    #[doc(hidden)]
    pub fn set_reuse_scan_limit(&self, pages: u64) {
        self.state.lock().reuse_checks = pages;
    }

    /// For tests: makes every miss that may take no busy alias check that the scan that
    /// classifies every page chooses the same window (or none) and moves the cursor alike
    /// (a panic if not). Doubles the cost of such misses.
    #[doc(hidden)]
    pub fn set_check_clean_spans(&self, on: bool) {
        self.state.lock().check_clean_spans = on;
    }

    /// Keeps up to `capacity` history events (0 turns history off and drops it).
    pub fn set_history(&self, capacity: usize) {
        let mut st = self.state.lock();
        st.history_cap = capacity;
        while st.history.len() > capacity {
            st.history.pop_front();
        }
    }

    /// Debug mode: counts a damaged canary found by the layer that checks them (C++).
    pub fn debug_note_canary_error(&self) {
        self.state.lock().debug_note_canary_error();
    }

    /// Takes the history recorded since the last call.
    pub fn take_history(&self) -> Vec<TraceEvent> {
        self.state.lock().history.drain(..).collect()
    }

    /// Keeps the last `capacity` misses that took no kept window, each with the best window
    /// and what holds its busy pages (`MissRecord`; 0 turns the log off and drops it). A
    /// diagnostic: a logged miss costs one more reuse scan; decisions do not change.
    pub fn set_miss_log(&self, capacity: usize) {
        let mut st = self.state.lock();
        st.miss_log_cap = capacity;
        while st.miss_log.len() > capacity {
            st.miss_log.pop_front();
        }
    }

    /// Takes the misses logged since the last call (`set_miss_log`).
    pub fn take_misses(&self) -> Vec<MissRecord> {
        self.state.lock().miss_log.drain(..).collect()
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
        // Closed imports are released once their stream is past the close (a wait for those
        // events only, with no lock held); open ones at once, as before.
        self.imports.get_mut().shutdown(&self.device);
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

    /// The arena whose virtual chunk holds `ptr`.
    fn arena_at(&self, ptr: u64) -> Option<u32> {
        let (_, &(end, aid)) = self.chunk_owner.range(..=ptr).next_back()?;
        (ptr < end).then_some(aid)
    }

    fn live_containing(&self, ptr: u64) -> Option<(u64, u64)> {
        self.arenas[self.arena_at(ptr)? as usize].live_containing(ptr)
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
        if self.drain_due {
            self.drain_old(dev)?;
        }
        let size = match self.debug.is_some() {
            false => size,
            true => match self.debug_allocate(dev, requested, size, stream, pool)? {
                debug::DebugAlloc::Placed(ptr) => return Ok(ptr),
                debug::DebugAlloc::Size(padded) => padded,
            },
        };
        let kind = if size <= self.cfg.small_size {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        if self.upgrade_due() {
            self.upgrade_pages(dev)?;
        }
        if let Some(page) = self.share_upgrade.filter(|_| self.captures == 0) {
            // The watch's upgrade replaces the rent-or-buy one still to come: the job has
            // shown what its pages cost, in time.
            self.share_upgrade = None;
            self.upgrade = None;
            self.upgrade_to(dev, page)?;
        }
        let aid = self.arena_id(ArenaKey {
            stream,
            kind,
            graph_pool: pool,
            gen: self.gen,
        });
        self.now += 1;
        let now = self.now;
        let reuse = self.cfg.reuse_limit;
        let addr = match self.with_arena(aid, |a| a.take_quick(size)) {
            Some(addr) => addr,
            None => {
                // Not the exact size of a quick block: best fit over coalesced blocks.
                self.flush_arena(aid)?;
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
        // The arena whose chunk holds `ptr` (of whichever page generation) if it serves
        // this stream, pool kind and graph pool.
        let aid = self.arena_at(ptr).filter(|&aid| {
            let k = self.arenas[aid as usize].key;
            k.stream == stream && k.kind == kind && k.graph_pool == pool
        });
        let Some(aid) = aid else {
            return Err(Error::InvalidState(format!(
                "cannot re-create block at {ptr:#x}: no memory of stream {stream:#x} in pool {pool:?} there"
            )));
        };
        self.flush_arena(aid)?;
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
        if kind == PoolKind::Large && self.upgrade.is_some() {
            let (bytes, blocks) = (
                s.active_bytes.pool(kind).current.max(0) as u64,
                s.active.pool(kind).current.max(0) as u64,
            );
            if bytes > self.large_peak.0 {
                self.large_peak = (bytes, blocks);
            }
        }
        self.trace(TraceAction::Alloc, addr, size, stream);
    }

    fn allocate_slow<D: Device>(
        &mut self,
        dev: &D,
        requested: u64,
        size: u64,
        aid: u32,
    ) -> Result<DevicePtr> {
        self.flush_quick()?;
        self.watch_driver_share();
        if self.captures == 0 {
            self.process_retired(dev, false)?;
            // A kept mapping whose pages are free: no driver call. One with busy pages, if
            // replacing them (an unmap and a map each) costs less than mapping a new range
            // (a map each, after the free block it starts at), they are at most a quarter of
            // it, and it has `replace_min_pages` pages or more: otherwise a new range is
            // made, which later steps reuse as it is, where replacing changes a range they
            // may need as it was.
            if self.cfg.may_stitch(size) {
                let fresh = match self.arenas[aid as usize].find_placement(size) {
                    Some(p) => p.map_pages,
                    None => size.div_ceil(self.page),
                };
                let pages = size.div_ceil(self.page);
                let max_busy = if pages < self.cfg.replace_min_pages {
                    0
                } else {
                    (fresh / 2).min((pages / 4).max(1))
                };
                self.settle_arenas();
                let view = if self.cfg.reuse_fenced_blocks {
                    pages::ReuseView::FencedBlocks
                } else {
                    pages::ReuseView::Now
                };
                let (mut found, cursor) = self.find_reuse(aid, size, max_busy, view);
                self.arenas[aid as usize].reuse_cursor = cursor;
                if found.is_none() && self.cfg.reuse_fenced_blocks {
                    found = self.reuse_fenced_blocks(dev, aid, size, max_busy)?;
                }
                if found.is_none() {
                    if let Some(r) = self.window_after_wait(dev, aid, size, fresh)? {
                        // The window holds if the wait was made: every arena it counted as
                        // giving is then fenced (a refused wait leaves some unfenced).
                        let stream = self.arenas[aid as usize].key.stream;
                        self.wait_for_streams(dev, stream)?;
                        if !self.has_unfenced_pages(stream) {
                            self.stats.reuses_after_wait += 1;
                            found = Some(r);
                        }
                    }
                }
                if found.is_none() && self.miss_log_cap > 0 {
                    let rec = self.describe_miss(aid, size, fresh, max_busy, view);
                    self.log_miss(rec);
                }
                if let Some(r) = found {
                    if self.apply_reuse(dev, aid, &r, size)? {
                        let now = self.now;
                        self.with_arena(aid, |a| a.carve(r.start, size, now));
                        return Ok(r.start);
                    }
                }
            }
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
            let exclude = (placement.start, placement.start + size);
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
        // Declaring OOM: pages created on the way go back to the device (a spare that a lent
        // block still maps stays spare until empty_cache unmaps the alias).
        if !self.book.spare.is_empty() {
            for h in std::mem::take(&mut self.book.spare) {
                if self.is_aliased(h) {
                    self.book.spare.push(h);
                } else {
                    self.release_page(dev, h)?;
                }
            }
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
            reserved: self.book.bytes,
            allocated: self.stats.allocated_bytes.aggregate().current as u64,
            cached_free: cached,
            limit: self.limit,
            stitches: self.stats.stitches,
        })))
    }

    /// Coalesces every arena's quick blocks, so that misses see all free memory.
    fn flush_quick(&mut self) -> Result<()> {
        for aid in 0..self.arenas.len() as u32 {
            self.flush_arena(aid)?;
        }
        Ok(())
    }

    /// Coalesces arena `aid`'s quick blocks.
    fn flush_arena(&mut self, aid: u32) -> Result<()> {
        self.with_arena(aid, Arena::flush_quick);
        Ok(())
    }

    fn grow_arena<D: Device>(&mut self, dev: &D, aid: u32, size: u64) -> Result<()> {
        // In whole pages of the arena's generation (`chunk_size` is in the first page size).
        let page = self.arenas[aid as usize].page();
        let len = self.chunk_size.max(size).div_ceil(page) * page;
        let va = drv!(
            self,
            reserve_va,
            dev.reserve_va(len as usize, page as usize)
        )?;
        self.arenas[aid as usize].add_chunk(va, len);
        self.chunk_owner.insert(va, (va + len, aid));
        Ok(())
    }

    fn free<D: Device>(&mut self, dev: &D, ptr: DevicePtr) -> Result<()> {
        if self.debug.is_some() {
            if let Some(r) = self.debug_free(dev, ptr) {
                return r;
            }
        }
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
            return self.finish_free(ptr);
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

    fn finish_free(&mut self, ptr: DevicePtr) -> Result<()> {
        if self.debug.is_some() && self.debug_hold(ptr) {
            return self.debug_evict_blocks();
        }
        let Some(b) = self.live.remove(&ptr) else {
            return Ok(());
        };
        self.now += 1;
        let now = self.now;
        let kind = self.arenas[b.arena as usize].key.kind;
        self.with_arena(b.arena, |a| a.release(ptr, now));
        self.stats.active.decrease(kind, 1);
        self.stats.active_bytes.decrease(kind, b.size as i64);
        self.trace(TraceAction::FreeCompleted, ptr, b.size, b.stream);
        if self.arenas[b.arena as usize].key.gen != self.gen {
            self.drain_due = true;
        } else if self.arenas[b.arena as usize].quick_full() {
            self.flush_arena(b.arena)?;
        }
        Ok(())
    }
}
