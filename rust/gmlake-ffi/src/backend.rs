//! The allocator behind one bridge handle. The device type is erased at the device
//! ([`BridgeDevice`], behind an `Arc<dyn _>`), so the bridge holds one concrete
//! [`Allocator`] whatever the backend (CUDA or simulated) and calls it directly: one dynamic
//! call per driver call, none on the allocator's own paths.

use crate::capture::CaptureAware;
use gmlake_core::ipc::{self, IpcHandle};
use gmlake_core::{
    Allocator, Config, Device, DeviceError, DevicePtr, DeviceResult, Error, GraphPoolId,
    PhysHandle, Result, SimDevice,
};
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

/// A device the bridge can serve: [`Device`] and [`PeerAccess`], object-safe.
pub trait BridgeDevice: Device + PeerAccess {}
impl<T: Device + PeerAccess> BridgeDevice for T {}

/// The device every bridge allocator runs on: the backend's device, type-erased, under the
/// capture decorator (`capture.rs`).
pub type Dev = CaptureAware<Arc<dyn BridgeDevice>>;
/// The allocator every bridge handle holds.
pub type Alloc = Allocator<Dev>;

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

/// Builds an allocator over `device` with `config`.
pub fn make_alloc<D: BridgeDevice + 'static>(device: D, config: Config) -> Result<Arc<Alloc>> {
    let dev: Arc<dyn BridgeDevice> = Arc::new(device);
    Ok(Arc::new(Allocator::new(CaptureAware::new(dev), config)?))
}

// What the bridge composes from the allocator and its device (everything else it calls on
// [`Alloc`] directly).

/// A CUDA graph capture (or another pool routing) begins: the device defers event work, the
/// allocator keeps `pool` alive.
pub fn begin_capture(a: &Alloc, pool: GraphPoolId) {
    a.device().begin_capture();
    a.begin_allocate_to_pool(pool);
}

pub fn end_capture(a: &Alloc, pool: GraphPoolId) -> Result<()> {
    a.end_allocate_to_pool(pool);
    Ok(a.device().end_capture()?)
}

/// Grants `ordinal` access to memory mapped from now on and to every range mapped now.
pub fn add_peer(a: &Alloc, ordinal: i32) -> Result<()> {
    // New mappings get the longer access list at once; ranges mapped before keep their old
    // one until granted again, under the allocator's lock.
    a.device().inner().add_peer(ordinal)?;
    a.regrant_access()
}

/// The IPC handle (PyTorch's bytes) of the live allocation containing `ptr`, and the offset
/// of `ptr` from the address the importer's pointer will have.
pub fn share_ipc(a: &Alloc, ptr: DevicePtr) -> Result<(Vec<u8>, u64)> {
    let shared = a.share(ptr)?;
    let dev = a.device().inner();
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

/// Maps a page handle made by `share_ipc` (here or in PyTorch's native allocator) of another
/// process; returns the address of the first page.
pub fn open_ipc(a: &Alloc, handle: &[u8]) -> Result<DevicePtr> {
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
    let dev = a.device().inner();
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
    a.import_pages(handles, page_size)
}
