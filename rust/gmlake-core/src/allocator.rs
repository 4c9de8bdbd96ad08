//! The allocator: public API. (Implementation in progress.)

use crate::config::Config;
use crate::device::{Device, DevicePtr, PhysHandle, StreamId};
use crate::error::Result;
use crate::stats::{DeviceStats, PoolKind, Snapshot};

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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    pub action: TraceAction,
    pub addr: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
}

pub struct Allocator<D: Device> {
    device: D,
    _c: Config,
}

impl<D: Device> Allocator<D> {
    pub fn new(device: D, config: Config) -> Result<Self> { todo!() }
    pub fn device(&self) -> &D { &self.device }
    pub fn config(&self) -> Config { todo!() }
    pub fn page_size(&self) -> u64 { todo!() }
    /// Allocates `size` bytes for use on `stream` in the default pool. 0 bytes gives a null pointer.
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<DevicePtr> { todo!() }
    /// Allocates into a CUDA graph pool.
    pub fn allocate_in(&self, size: u64, stream: StreamId, pool: GraphPoolId) -> Result<DevicePtr> { todo!() }
    pub fn free(&self, ptr: DevicePtr) -> Result<()> { todo!() }
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> { todo!() }
    pub fn empty_cache(&self) -> Result<()> { todo!() }
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> { todo!() }
    pub fn memory_fraction(&self) -> Option<f64> { todo!() }
    pub fn set_limit(&self, bytes: Option<u64>) { todo!() }
    pub fn release_pool(&self, pool: GraphPoolId) -> Result<()> { todo!() }
    pub fn stats(&self) -> DeviceStats { todo!() }
    pub fn reset_peak_stats(&self) { todo!() }
    pub fn reset_accumulated_stats(&self) { todo!() }
    pub fn snapshot(&self) -> Snapshot { todo!() }
    pub fn cache_info(&self) -> CacheInfo { todo!() }
    /// The live allocation containing `ptr` (interior pointers included).
    pub fn allocation(&self, ptr: DevicePtr) -> Option<AllocationInfo> { todo!() }
    /// Physical pages under a live allocation: (virtual page address, handle), in order.
    pub fn pages_of(&self, ptr: DevicePtr) -> Option<Vec<(DevicePtr, PhysHandle)>> { todo!() }
    /// Keeps up to `capacity` history events (0 turns history off and drops it).
    pub fn set_history(&self, capacity: usize) { todo!() }
    pub fn take_history(&self) -> Vec<TraceEvent> { todo!() }
}
