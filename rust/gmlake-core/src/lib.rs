//! GMLake core: a GPU memory allocator that defragments by virtual memory stitching.
//!
//! Physical memory is held as pages ([`Device::create_physical`]); every block is a range of
//! virtual addresses mapped onto pages. When no cached free block fits a request, pages are
//! taken from several cached free blocks and mapped into one new contiguous range (a
//! *stitch*) before the device is asked for new memory. See `docs/design.md` for the
//! invariants.
//!
//! This crate knows nothing of CUDA: it drives a [`Device`]. [`SimDevice`] simulates one on
//! the host, enforcing the driver's rules, for tests and trace replay.

mod aliasmap;
pub mod allocator;
mod arena;
mod blockmap;
pub mod calltime;
pub mod config;
pub mod contract;
pub mod cost;
pub mod debug;
mod deferred;
pub mod device;
pub mod error;
mod fitindex;
mod freeruns;
pub mod ipc;
mod keys;
pub mod sim;
pub mod stats;
pub mod tier;
pub mod tier_trace;

pub use allocator::{
    AllocationInfo, Allocator, CacheInfo, GraphPoolId, MissRecord, MissWindow, TraceAction,
    TraceEvent,
};
pub use config::{parse_size, Config, StitchStrategy};
pub use debug::DebugConfig;
pub use device::{
    Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostPtr, PhysHandle, StreamId,
};
pub use error::{Error, OomInfo, Result};
pub use ipc::{IpcHandle, SharedPages};
pub use sim::SimDevice;
pub use stats::{
    BlockInfo, BlockState, DeviceStats, DriverCalls, PoolKind, SegmentInfo, Snapshot, Stat,
    StatArray, StatField, StatValue,
};
pub use tier::{
    EvictionPolicy, Fetched, Lru, SizeLatencyAware, TensorId, TensorState, Tier, TierConfig,
    TierStats,
};
