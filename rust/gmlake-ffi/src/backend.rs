//! The allocator behind one bridge handle, with its device type erased so that the bridge
//! serves the CUDA device and the simulated one alike.

use crate::capture::CaptureAware;
use gmlake_core::ipc::{self, IpcHandle};
use gmlake_core::{
    AllocationInfo, Allocator, CacheInfo, Config, Device, DeviceError, DevicePtr, DeviceResult,
    DeviceStats, Error, GraphPoolId, PhysHandle, Result, SimDevice, Snapshot, StreamId, TraceEvent,
};
use gmlake_core::{EvictionPolicy, Tier, TierConfig};
use std::sync::Arc;

/// What a device offers beyond [`Device`]: access for peer GPUs, and pages exported to and
/// imported from other processes.
pub trait PeerAccess {
    fn add_peer(&self, ordinal: i32) -> DeviceResult<()>;
    /// A descriptor of `handle` that another process can duplicate, valid while the handle
    /// lives (owned by the device).
    fn shared_fd(&self, handle: PhysHandle) -> DeviceResult<i32>;
    /// Imports descriptor `fd` of process `pid` as a new handle.
    fn import_from_process(&self, pid: i32, fd: i32) -> DeviceResult<PhysHandle>;
}

/// The simulated device is one GPU shared by "processes" (allocators) of this process: its
/// descriptors are tokens, valid in any of them.
impl PeerAccess for SimDevice {
    fn add_peer(&self, ordinal: i32) -> DeviceResult<()> {
        Err(DeviceError::InvalidArgument(format!(
            "the simulated device has no peers (asked for device {ordinal})"
        )))
    }
    fn shared_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        self.export_token(handle)
    }
    fn import_from_process(&self, _pid: i32, fd: i32) -> DeviceResult<PhysHandle> {
        self.import_token(fd)
    }
}

#[cfg(feature = "cuda")]
impl PeerAccess for gmlake_cuda::CudaDevice {
    fn add_peer(&self, ordinal: i32) -> DeviceResult<()> {
        gmlake_cuda::CudaDevice::add_peer(self, ordinal)
    }
    fn shared_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        gmlake_cuda::CudaDevice::shared_fd(self, handle)
    }
    fn import_from_process(&self, pid: i32, fd: i32) -> DeviceResult<PhysHandle> {
        gmlake_cuda::CudaDevice::import_from_process(self, pid, fd)
    }
}

/// The operations of [`Allocator`], object-safe.
pub trait Core: Send + Sync {
    fn allocate(&self, size: u64, stream: StreamId) -> Result<DevicePtr>;
    fn allocate_in(&self, size: u64, stream: StreamId, pool: GraphPoolId) -> Result<DevicePtr>;
    fn allocate_rounded(
        &self,
        size: u64,
        rounded: u64,
        stream: StreamId,
        pool: GraphPoolId,
    ) -> Result<DevicePtr>;
    fn clear_stream_uses(&self, ptr: DevicePtr) -> Result<()>;
    fn stream_uses(&self, ptr: DevicePtr) -> Option<Vec<StreamId>>;
    fn allocate_at(
        &self,
        ptr: DevicePtr,
        size: u64,
        requested: u64,
        stream: StreamId,
        pool: GraphPoolId,
    ) -> Result<()>;
    fn free(&self, ptr: DevicePtr) -> Result<()>;
    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<()>;
    fn empty_cache(&self) -> Result<()>;
    fn set_memory_fraction(&self, fraction: f64) -> Result<()>;
    fn memory_fraction(&self) -> Option<f64>;
    fn set_limit(&self, bytes: Option<u64>);
    fn release_pool(&self, pool: GraphPoolId) -> Result<()>;
    fn stats(&self) -> DeviceStats;
    fn reset_peak_stats(&self);
    fn reset_accumulated_stats(&self);
    fn snapshot(&self) -> Snapshot;
    fn cache_info(&self) -> CacheInfo;
    fn allocation(&self, ptr: DevicePtr) -> Option<AllocationInfo>;
    fn set_history(&self, capacity: usize);
    fn take_history(&self) -> Vec<TraceEvent>;
    fn page_size(&self) -> u64;
    fn config(&self) -> Config;
    fn debug_note_canary_error(&self);
    fn device_free(&self) -> DeviceResult<usize>;
    fn device_total(&self) -> DeviceResult<usize>;
    fn limit(&self) -> Option<u64>;
    fn begin_capture(&self, pool: GraphPoolId);
    fn end_capture(&self, pool: GraphPoolId) -> DeviceResult<()>;
    /// Grants `ordinal` access to memory mapped from now on and to every range mapped now.
    fn add_peer(&self, ordinal: i32) -> Result<()>;
    /// The IPC handle (PyTorch's bytes) of the live allocation containing `ptr`, and the
    /// offset of `ptr` from the address the importer's pointer will have.
    fn share_ipc(&self, ptr: DevicePtr) -> Result<(Vec<u8>, u64)>;
    /// Maps a page handle made by `share_ipc` (here or in PyTorch's native allocator) of
    /// another process; returns the address of the first page.
    fn open_ipc(&self, handle: &[u8]) -> Result<DevicePtr>;
    /// Closes a range made by `open_ipc`, ordered on `stream` (unmapped once the work queued
    /// there before the close has completed; see `Allocator::close_imported`).
    fn close_ipc(&self, ptr: DevicePtr, stream: StreamId) -> Result<()>;
    /// A host tier over this allocator (issue 16; `crate::tier`).
    fn new_tier(
        &self,
        cfg: TierConfig,
        policy: Box<dyn EvictionPolicy>,
    ) -> Box<dyn crate::tier::TierCore>;
}

impl<D: Device + PeerAccess + 'static> Core for Arc<Allocator<CaptureAware<D>>> {
    fn allocate(&self, size: u64, stream: StreamId) -> Result<DevicePtr> {
        Allocator::allocate(self, size, stream)
    }
    fn allocate_in(&self, size: u64, stream: StreamId, pool: GraphPoolId) -> Result<DevicePtr> {
        Allocator::allocate_in(self, size, stream, pool)
    }
    fn allocate_rounded(
        &self,
        size: u64,
        rounded: u64,
        stream: StreamId,
        pool: GraphPoolId,
    ) -> Result<DevicePtr> {
        Allocator::allocate_rounded(self, size, rounded, stream, pool)
    }
    fn clear_stream_uses(&self, ptr: DevicePtr) -> Result<()> {
        Allocator::clear_stream_uses(self, ptr)
    }
    fn stream_uses(&self, ptr: DevicePtr) -> Option<Vec<StreamId>> {
        Allocator::stream_uses(self, ptr)
    }
    fn allocate_at(
        &self,
        ptr: DevicePtr,
        size: u64,
        requested: u64,
        stream: StreamId,
        pool: GraphPoolId,
    ) -> Result<()> {
        Allocator::allocate_at(self, ptr, size, requested, stream, pool)
    }
    fn free(&self, ptr: DevicePtr) -> Result<()> {
        Allocator::free(self, ptr)
    }
    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        Allocator::record_stream(self, ptr, stream)
    }
    fn empty_cache(&self) -> Result<()> {
        Allocator::empty_cache(self)
    }
    fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        Allocator::set_memory_fraction(self, fraction)
    }
    fn memory_fraction(&self) -> Option<f64> {
        Allocator::memory_fraction(self)
    }
    fn set_limit(&self, bytes: Option<u64>) {
        Allocator::set_limit(self, bytes)
    }
    fn release_pool(&self, pool: GraphPoolId) -> Result<()> {
        Allocator::release_pool(self, pool)
    }
    fn stats(&self) -> DeviceStats {
        Allocator::stats(self)
    }
    fn reset_peak_stats(&self) {
        Allocator::reset_peak_stats(self)
    }
    fn reset_accumulated_stats(&self) {
        Allocator::reset_accumulated_stats(self)
    }
    fn snapshot(&self) -> Snapshot {
        Allocator::snapshot(self)
    }
    fn cache_info(&self) -> CacheInfo {
        Allocator::cache_info(self)
    }
    fn allocation(&self, ptr: DevicePtr) -> Option<AllocationInfo> {
        Allocator::allocation(self, ptr)
    }
    fn set_history(&self, capacity: usize) {
        Allocator::set_history(self, capacity)
    }
    fn take_history(&self) -> Vec<TraceEvent> {
        Allocator::take_history(self)
    }
    fn page_size(&self) -> u64 {
        Allocator::page_size(self)
    }
    fn config(&self) -> Config {
        Allocator::config(self)
    }
    fn debug_note_canary_error(&self) {
        Allocator::debug_note_canary_error(self)
    }
    fn device_free(&self) -> DeviceResult<usize> {
        self.device().free_memory()
    }
    fn device_total(&self) -> DeviceResult<usize> {
        self.device().total_memory()
    }
    fn limit(&self) -> Option<u64> {
        Allocator::limit(self)
    }
    fn begin_capture(&self, pool: GraphPoolId) {
        self.device().begin_capture();
        self.begin_allocate_to_pool(pool);
    }
    fn end_capture(&self, pool: GraphPoolId) -> DeviceResult<()> {
        self.end_allocate_to_pool(pool);
        self.device().end_capture()
    }
    fn add_peer(&self, ordinal: i32) -> Result<()> {
        // New mappings get the longer access list at once; ranges mapped before keep their
        // old one until granted again, under the allocator's lock.
        self.device().inner().add_peer(ordinal)?;
        self.regrant_access()
    }
    fn share_ipc(&self, ptr: DevicePtr) -> Result<(Vec<u8>, u64)> {
        let shared = self.share(ptr)?;
        let dev = self.device().inner();
        let fds = shared
            .handles
            .iter()
            .map(|&h| dev.shared_fd(h))
            .collect::<DeviceResult<Vec<i32>>>()?;
        let pid = std::process::id() as i32;
        Ok((
            ipc::encode_pages(pid, shared.page_size, &fds),
            shared.offset,
        ))
    }
    fn open_ipc(&self, handle: &[u8]) -> Result<DevicePtr> {
        let IpcHandle::Pages {
            pid,
            page_size,
            fds,
        } = ipc::decode(handle)?
        else {
            return Err(Error::InvalidIpcHandle(
                "a cudaMalloc handle is opened with cudaIpcOpenMemHandle, not as pages".into(),
            ));
        };
        let dev = self.device().inner();
        let mut handles = Vec::with_capacity(fds.len());
        for fd in fds {
            match dev.import_from_process(pid, fd) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    for h in handles {
                        let _ = dev.release_physical(h);
                    }
                    return Err(e.into());
                }
            }
        }
        self.import_pages(handles, page_size)
    }
    fn close_ipc(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        self.close_imported(ptr, stream)
    }
    fn new_tier(
        &self,
        cfg: TierConfig,
        policy: Box<dyn EvictionPolicy>,
    ) -> Box<dyn crate::tier::TierCore> {
        Box::new(Tier::new(Arc::clone(self), cfg, policy))
    }
}

/// Builds an allocator over `device` with `config`.
pub fn make_core<D: Device + PeerAccess + 'static>(
    device: D,
    config: Config,
) -> Result<Box<dyn Core>> {
    let a = Allocator::new(CaptureAware::new(device), config)?;
    Ok(Box::new(Arc::new(a)))
}
