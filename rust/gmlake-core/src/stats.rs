//! Statistics with exactly the fields of PyTorch's `DeviceStats`, plus stitch and
//! driver-call counters.
//!
//! Meanings in this allocator (documented for `torch.cuda.memory_stats()` readers):
//! - `segment`: physical pages held (each is one device allocation, as a cudaMalloc'd
//!   segment is for PyTorch); `reserved_bytes`: their bytes. A page counts in the pool
//!   (small or large) whose range it is mapped into.
//! - `allocation` / `allocated_bytes`: live allocations (rounded sizes); `requested_bytes`:
//!   the sizes asked for.
//! - `active` / `active_bytes`: live allocations plus freed ones waiting for events of
//!   other streams (record_stream).
//! - `inactive_split` / `inactive_split_bytes`: free blocks inside mapped memory.

use crate::device::StreamId;

/// One statistic, as PyTorch's `Stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

impl Stat {
    pub fn increase(&mut self, n: i64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }
    pub fn decrease(&mut self, n: i64) {
        self.current -= n;
        self.freed += n;
    }
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// Index into a [`StatArray`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    Small = 1,
    Large = 2,
}

/// aggregate, small pool, large pool: PyTorch's `StatArray` order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray(pub [Stat; 3]);

impl StatArray {
    pub fn aggregate(&self) -> &Stat {
        &self.0[0]
    }
    pub fn pool(&self, kind: PoolKind) -> &Stat {
        &self.0[kind as usize]
    }
    pub fn increase(&mut self, kind: PoolKind, n: i64) {
        if n != 0 {
            self.0[0].increase(n);
            self.0[kind as usize].increase(n);
        }
    }
    pub fn decrease(&mut self, kind: PoolKind, n: i64) {
        if n != 0 {
            self.0[0].decrease(n);
            self.0[kind as usize].decrease(n);
        }
    }
    /// Moves `n` from one pool to the other; the aggregate is unchanged.
    pub fn transfer(&mut self, from: PoolKind, to: PoolKind, n: i64) {
        if from != to && n != 0 {
            self.0[from as usize].decrease(n);
            self.0[to as usize].increase(n);
        }
    }
    /// Adds a signed delta.
    pub fn adjust(&mut self, kind: PoolKind, delta: i64) {
        if delta > 0 {
            self.increase(kind, delta)
        } else {
            self.decrease(kind, -delta)
        }
    }
    fn for_each(&mut self, f: impl Fn(&mut Stat)) {
        self.0.iter_mut().for_each(f);
    }
}

/// Driver calls by kind, counted by the allocator whatever the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCalls {
    pub create_physical: u64,
    pub release_physical: u64,
    pub reserve_va: u64,
    pub free_va: u64,
    pub map: u64,
    pub unmap: u64,
    pub set_access: u64,
    pub create_event: u64,
    pub record_event: u64,
    pub query_event: u64,
    pub synchronize: u64,
}

impl DriverCalls {
    pub fn total(&self) -> u64 {
        self.create_physical
            + self.release_physical
            + self.reserve_va
            + self.free_va
            + self.map
            + self.unmap
            + self.set_access
            + self.create_event
            + self.record_event
            + self.query_event
            + self.synchronize
    }

    pub fn as_pairs(&self) -> [(&'static str, u64); 11] {
        [
            ("create_physical", self.create_physical),
            ("release_physical", self.release_physical),
            ("reserve_va", self.reserve_va),
            ("free_va", self.free_va),
            ("map", self.map),
            ("unmap", self.unmap),
            ("set_access", self.set_access),
            ("create_event", self.create_event),
            ("record_event", self.record_event),
            ("query_event", self.query_event),
            ("synchronize", self.synchronize),
        ]
    }
}

/// PyTorch's `DeviceStats` fields and this allocator's own counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceStats {
    pub allocation: StatArray,
    pub segment: StatArray,
    pub active: StatArray,
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub oversize_allocations: Stat,
    pub oversize_segments: Stat,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    /// PyTorch's `max_split_size`: this allocator splits any block, so it is unlimited (-1
    /// would be "unset"; PyTorch reports SIZE_MAX as unlimited).
    pub max_split_size: i64,

    /// Allocations that were served by mapping pages taken from cached free blocks.
    pub stitches: u64,
    /// Pages moved by those stitches.
    pub pages_stitched: u64,
    /// Misses served with no driver call by reusing a kept stitched mapping whose pages were
    /// all free, and the pages taken back for them.
    pub stitch_reuses: u64,
    pub pages_reused: u64,
    /// Kept aliases unmapped and refilled with another page, to reuse a range whose other
    /// pages were free.
    pub aliases_replaced: u64,
    /// Kept mappings unmapped because there were more than `max_aliases` allowed.
    pub alias_evictions: u64,
    /// Bytes of kept aliases (virtual ranges still mapped onto pages active elsewhere).
    pub aliased_bytes: u64,
    /// Bytes cached in free mapped blocks (reusable without a driver call).
    pub cached_bytes: u64,
    /// Bytes of pages reachable only through a retired mapping waiting to be unmapped.
    pub retired_bytes: u64,
    /// Free blocks that had to wait for another stream before stitching (record_stream).
    pub pending_frees: u64,
    /// Frees of pointers this allocator did not hand out, tolerated.
    pub unknown_frees: u64,
    /// Allocations shared with other processes (CUDA IPC exports).
    pub ipc_shares: u64,
    /// Ranges imported from other processes and mapped now, and their bytes (not counted in
    /// reserved or allocated bytes: the memory is the exporter's).
    pub ipc_imports: u64,
    pub ipc_imported_bytes: u64,
    /// Memory debugging mode (all 0 when it is off): live allocations placed between guard
    /// pages and the bytes of their guard pages (virtual only); freed blocks held in the
    /// quarantine and their bytes; damaged canaries found; pages the mode holds (counted in
    /// reserved bytes).
    pub debug_guarded: u64,
    pub debug_guard_bytes: u64,
    pub debug_quarantine_blocks: u64,
    pub debug_quarantine_bytes: u64,
    pub debug_canary_errors: u64,
    pub debug_pages: u64,
    pub driver_calls: DriverCalls,
}

impl DeviceStats {
    pub fn reset_accumulated(&mut self) {
        for s in self.arrays_mut() {
            s.for_each(Stat::reset_accumulated);
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.stitches = 0;
        self.pages_stitched = 0;
        self.stitch_reuses = 0;
        self.pages_reused = 0;
        self.alias_evictions = 0;
        self.aliases_replaced = 0;
        self.driver_calls = DriverCalls::default();
    }

    pub fn reset_peak(&mut self) {
        for s in self.arrays_mut() {
            s.for_each(Stat::reset_peak);
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }
}

/// A block in a [`Snapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    pub state: BlockState,
    /// Some page under the block was brought there by a stitch.
    pub stitched: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// A live allocation (`active_allocated`).
    ActiveAllocated,
    /// Freed, waiting for other streams' events (`active_pending_free`).
    ActivePendingFree,
    /// Free and mapped (`inactive`).
    Inactive,
}

impl BlockState {
    /// The state string PyTorch's snapshot uses.
    pub fn torch_name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// A segment in a [`Snapshot`]: a maximal run of mapped virtual memory of one pool and stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    pub address: u64,
    pub total_size: u64,
    pub allocated_size: u64,
    pub active_size: u64,
    pub requested_size: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    /// CUDA graph pool id (0, 0 for the default pool).
    pub graph_pool: (u64, u64),
    /// Some page of the run was brought there by a stitch.
    pub stitched: bool,
    /// Physical pages mapped in the run.
    pub pages: u64,
    pub blocks: Vec<BlockInfo>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub segments: Vec<SegmentInfo>,
    pub page_size: u64,
    pub config: Vec<(&'static str, String)>,
}
