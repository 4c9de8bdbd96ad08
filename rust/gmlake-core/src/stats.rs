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
    /// Device-side waits of one stream for an event of another (`cuStreamWaitEvent`,
    /// `cross_stream_wait`): the host does not block.
    pub stream_wait: u64,
    /// Blocking waits: a device synchronize, or a wait for one event (`Device::wait_event`,
    /// `cuEventSynchronize`) before memory is released or moved.
    pub synchronize: u64,
}

impl DriverCalls {
    pub fn total(&self) -> u64 {
        self.as_pairs().iter().map(|&(_, n)| n).sum()
    }

    pub fn as_pairs(&self) -> [(&'static str, u64); 12] {
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
            ("stream_wait", self.stream_wait),
            ("synchronize", self.synchronize),
        ]
    }
}

/// The fields of [`DeviceStats`], listed once: PyTorch's `DeviceStats` fields (`torch`, keys
/// of `torch.cuda.memory_stats()` as named) and gmlake's own counters (`gmlake`, read as
/// `gmlake.<name>`). Passes the list to the macro `$callback`; the struct, its resets and its
/// iteration ([`DeviceStats::fields`], [`DeviceStats::counters`]) are generated from it here,
/// and so is the bridge's record (`gmlake-ffi`). Each field is `name: type = reset`, where
/// `reset` says what `reset_accumulated` does to it: `accumulated` (cleared: a count of events),
/// or `gauge` (kept: a level).
#[macro_export]
macro_rules! for_device_stats {
    ($callback:ident) => {
        $callback! {
            torch {
                allocation: StatArray = accumulated,
                segment: StatArray = accumulated,
                active: StatArray = accumulated,
                inactive_split: StatArray = accumulated,
                allocated_bytes: StatArray = accumulated,
                reserved_bytes: StatArray = accumulated,
                active_bytes: StatArray = accumulated,
                inactive_split_bytes: StatArray = accumulated,
                requested_bytes: StatArray = accumulated,
                num_alloc_retries: i64 = accumulated,
                num_ooms: i64 = accumulated,
                oversize_allocations: Stat = accumulated,
                oversize_segments: Stat = accumulated,
                num_sync_all_streams: i64 = accumulated,
                num_device_alloc: i64 = accumulated,
                num_device_free: i64 = accumulated,
                /// PyTorch's `max_split_size`: this allocator splits any block, so it is
                /// unlimited (-1 would be "unset"; PyTorch reports SIZE_MAX as unlimited).
                max_split_size: i64 = gauge,
            }
            gmlake {
                /// Allocations that were served by mapping pages taken from cached free blocks.
                stitches: u64 = accumulated,
                /// Pages moved by those stitches.
                pages_stitched: u64 = accumulated,
                /// Misses served with no driver call by reusing a kept stitched mapping whose
                /// pages were all free, and the pages taken back for them.
                stitch_reuses: u64 = accumulated,
                pages_reused: u64 = accumulated,
                /// Pages created at a miss while free blocks of other streams held pages it
                /// could not take yet (their streams' fences had not completed, and no
                /// device-side wait made them takeable): memory that a busy stream cost.
                pages_created_unfenced: u64 = accumulated,
                /// `cross_stream_wait`: device-side waits the device refused (the miss created
                /// memory instead).
                stream_waits_failed: u64 = accumulated,
                /// Kept windows a miss did not take because replacing their busy aliases had
                /// to wait for work queued on their stream before those addresses were last
                /// freed (a new range was made instead). The host runs ahead of a GPU, so this
                /// happens there and not in a replay, whose events complete at once.
                reuses_unfenced: u64 = accumulated,
                /// Kept windows taken after polling that work's fence for a while (20 queries,
                /// 50 µs apart): it completed meanwhile.
                reuses_awaited: u64 = accumulated,
                /// `wait_to_reuse`: kept windows taken after the miss's stream waited on the
                /// device for the streams that freed their pages (which it could not take
                /// before), where the stitch would have made the same wait and mapped those
                /// same pages at a new address.
                reuses_after_wait: u64 = accumulated,
                /// `reuse_fenced_blocks`: kept windows found by the second scan, which counts
                /// the pages of other streams' free blocks whose own free is fenced.
                reuses_fenced_blocks: u64 = accumulated,
                /// Kept mappings unmapped because there were more than `max_aliases` allowed.
                alias_evictions: u64 = accumulated,
                /// Kept aliases unmapped and refilled with another page, to reuse a range whose
                /// other pages were free.
                aliases_replaced: u64 = accumulated,
                /// Page-size upgrades done (`page_upgrade_at`'s rent-or-buy one, then any the
                /// driver-share watch asks for), and the pages of older generations given
                /// back as their blocks were freed.
                page_upgrades: u64 = gauge,
                pages_drained: u64 = accumulated,
                /// Times the host waited for retired pages' events before creating pages
                /// past the peak reserved, so that pages given back and pages created are not
                /// held at once (a drain racing a growth).
                retired_waits: u64 = accumulated,
                /// Host nanoseconds spent in the allocator's driver calls (every call timed:
                /// two clock readings, against the microseconds a VMM call costs), with the
                /// driver calls: what `gmlake.driver_calls` cost the job, measured.
                driver_ns: u64 = accumulated,
                /// Notices given that driver calls took a large share of the job's time
                /// (`driver_share_notice`): 0 or 1.
                driver_share_notices: u64 = gauge,
                /// Page-size upgrades the driver-share watch asked for
                /// (`driver_share_upgrade`), each to a page near the job's mean large tensor.
                driver_share_upgrades: u64 = gauge,
                /// Bytes of kept aliases (virtual ranges still mapped onto pages active
                /// elsewhere).
                aliased_bytes: u64 = gauge,
                /// Bytes cached in free mapped blocks (reusable without a driver call).
                cached_bytes: u64 = gauge,
                /// Bytes of pages reachable only through a retired mapping waiting to be
                /// unmapped.
                retired_bytes: u64 = gauge,
                /// Free blocks that had to wait for another stream before stitching
                /// (record_stream).
                pending_frees: u64 = gauge,
                /// Frees of pointers this allocator did not hand out, tolerated.
                unknown_frees: u64 = gauge,
                /// Allocations shared with other processes (CUDA IPC exports).
                ipc_shares: u64 = gauge,
                /// Ranges imported from other processes and mapped now, and their bytes (not
                /// counted in reserved or allocated bytes: the memory is the exporter's).
                ipc_imports: u64 = gauge,
                ipc_imported_bytes: u64 = gauge,
                /// Memory debugging mode (all 0 when it is off): live allocations placed
                /// between guard pages and the bytes of their guard pages (virtual only); freed
                /// blocks held in the quarantine and their bytes; damaged canaries found; pages
                /// the mode holds (counted in reserved bytes).
                debug_guarded: u64 = gauge,
                debug_guard_bytes: u64 = gauge,
                debug_quarantine_blocks: u64 = gauge,
                debug_quarantine_bytes: u64 = gauge,
                debug_canary_errors: u64 = gauge,
                debug_pages: u64 = gauge,
            }
        }
    };
}

/// One field of [`DeviceStats`], as [`DeviceStats::fields`] hands it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatValue<'a> {
    /// A PyTorch `StatArray` (aggregate, small pool, large pool).
    Array(&'a StatArray),
    /// A PyTorch `Stat`.
    Stat(&'a Stat),
    /// A PyTorch counter.
    Int(i64),
    /// One of gmlake's counters.
    Count(u64),
}

/// The types a [`DeviceStats`] field may have.
pub trait StatField {
    fn value(&self) -> StatValue<'_>;
    /// Clears what accumulates (a field marked `accumulated`).
    fn reset_accumulated(&mut self);
    /// Brings peaks down to the current values.
    fn reset_peak(&mut self) {}
}

impl StatField for StatArray {
    fn value(&self) -> StatValue<'_> {
        StatValue::Array(self)
    }
    fn reset_accumulated(&mut self) {
        self.for_each(Stat::reset_accumulated);
    }
    fn reset_peak(&mut self) {
        self.for_each(Stat::reset_peak);
    }
}

impl StatField for Stat {
    fn value(&self) -> StatValue<'_> {
        StatValue::Stat(self)
    }
    fn reset_accumulated(&mut self) {
        Stat::reset_accumulated(self);
    }
    fn reset_peak(&mut self) {
        Stat::reset_peak(self);
    }
}

impl StatField for i64 {
    fn value(&self) -> StatValue<'_> {
        StatValue::Int(*self)
    }
    fn reset_accumulated(&mut self) {
        *self = 0;
    }
}

impl StatField for u64 {
    fn value(&self) -> StatValue<'_> {
        StatValue::Count(*self)
    }
    fn reset_accumulated(&mut self) {
        *self = 0;
    }
}

macro_rules! reset_field {
    (accumulated, $field:expr) => {
        StatField::reset_accumulated(&mut $field)
    };
    (gauge, $field:expr) => {};
}

macro_rules! define_device_stats {
    (
        torch { $( $(#[$tdoc:meta])* $t:ident : $tty:ty = $treset:ident, )* }
        gmlake { $( $(#[$gdoc:meta])* $g:ident : $gty:ty = $greset:ident, )* }
    ) => {
        /// PyTorch's `DeviceStats` fields and this allocator's own counters (listed in
        /// [`for_device_stats!`](crate::for_device_stats)).
        #[derive(Clone, Debug, Default, PartialEq)]
        pub struct DeviceStats {
            $( $(#[$tdoc])* pub $t: $tty, )*
            $( $(#[$gdoc])* pub $g: $gty, )*
            pub driver_calls: DriverCalls,
        }

        impl DeviceStats {
            /// PyTorch's fields, in PyTorch's order, by name.
            pub fn fields(&self) -> [(&'static str, StatValue<'_>); TORCH_FIELDS] {
                [$( (stringify!($t), StatField::value(&self.$t)), )*]
            }

            /// gmlake's counters by name (without the `gmlake.` of the statistics' keys).
            pub fn counters(&self) -> [(&'static str, u64); GMLAKE_COUNTERS] {
                [$( (stringify!($g), self.$g), )*]
            }

            pub fn reset_accumulated(&mut self) {
                $( reset_field!($treset, self.$t); )*
                $( reset_field!($greset, self.$g); )*
                self.driver_calls = DriverCalls::default();
            }

            pub fn reset_peak(&mut self) {
                $( StatField::reset_peak(&mut self.$t); )*
            }

            /// The statistics with the measured time (`driver_ns`) at 0: what two runs of
            /// the same sequence must agree on, whatever their clocks said.
            pub fn without_timing(mut self) -> Self {
                self.driver_ns = 0;
                self
            }
        }

        /// How many of PyTorch's fields [`DeviceStats`] has.
        pub const TORCH_FIELDS: usize = [$(stringify!($t)),*].len();
        /// How many counters of gmlake's own [`DeviceStats`] has (besides driver calls).
        pub const GMLAKE_COUNTERS: usize = [$(stringify!($g)),*].len();
    };
}

for_device_stats!(define_device_stats);

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
