//! What the allocator asks of a GPU: physical pages, virtual ranges, mappings and
//! stream-ordered events. The CUDA driver implements it in `gmlake-cuda`; [`crate::SimDevice`]
//! implements it on the host for tests and trace replay.
//!
//! Rules every implementation follows (the simulated device enforces them, the CUDA driver
//! enforces most of them):
//! - sizes and addresses given to `create_physical`, `reserve_va`, `map` and `unmap` are
//!   multiples of [`Device::granularity`];
//! - `map` targets a reserved, currently unmapped range and maps one whole handle at offset 0;
//! - `unmap` removes exactly one earlier `map` (same address and size);
//! - `release_physical` only takes a handle that is mapped nowhere;
//! - `free_va` only takes a whole reservation with nothing mapped inside;
//! - an event recorded on a stream completes once all work queued on that stream before the
//!   record has finished (work on other streams does not delay it);
//! - the host-memory calls (`alloc_host`, `free_host`, `copy_d2h_async`, `copy_h2d_async`) are
//!   optional: a device without them keeps the default methods, which fail with
//!   [`DeviceError::Unsupported`]. A copy is queued on a stream, like a kernel: it runs after
//!   the work queued on that stream before it, and an event recorded after it completes once it
//!   has. Neither of its ranges may be freed, nor its destination read or its source written by
//!   work not ordered after it, before that event completes.

use std::fmt;

/// A device virtual address, as an integer (0 is never a valid allocation).
pub type DevicePtr = u64;

/// A stream, as an integer (`cudaStream_t` cast to an integer; 0 is the legacy default stream).
pub type StreamId = u64;

/// A physical memory allocation made by [`Device::create_physical`] (`CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhysHandle(pub u64);

/// An event object made by [`Device::create_event`] (`CUevent` as an integer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventHandle(pub u64);

/// Pinned (page-locked) host memory made by [`Device::alloc_host`], as an address. Copies may
/// start at any address inside the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostPtr(pub u64);

/// Why a device call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceError {
    /// The device has no memory left for this request.
    OutOfMemory,
    /// The call broke one of the rules above (a bug in the caller, or a corrupted address).
    InvalidArgument(String),
    /// The driver is missing or unusable on this machine.
    Unavailable(String),
    /// This device does not implement the call (the trait's default method): e.g. host memory
    /// on a device written before the host tier.
    Unsupported(&'static str),
    /// The driver returned an error code.
    Driver {
        call: &'static str,
        code: i64,
        message: String,
    },
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::OutOfMemory => write!(f, "device out of memory"),
            DeviceError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            DeviceError::Unavailable(m) => write!(f, "device unavailable: {m}"),
            DeviceError::Unsupported(call) => write!(f, "{call} is not supported by this device"),
            DeviceError::Driver {
                call,
                code,
                message,
            } => write!(f, "{call} failed with code {code}: {message}"),
        }
    }
}

impl std::error::Error for DeviceError {}

pub type DeviceResult<T> = Result<T, DeviceError>;

/// The operations the allocator needs from one GPU.
///
/// All methods take `&self`: implementations synchronise internally (the CUDA driver is
/// thread-safe; the simulated device uses a lock). The allocator calls them with its own
/// lock held, so they must not call back into the allocator.
pub trait Device: Send + Sync {
    /// Physical page size: the minimum (and recommended) allocation granularity.
    fn granularity(&self) -> DeviceResult<usize>;
    /// Total memory of the device in bytes.
    fn total_memory(&self) -> DeviceResult<usize>;
    /// Bytes the device could still hand out (as `cuMemGetInfo` reports).
    fn free_memory(&self) -> DeviceResult<usize>;

    /// Creates `size` bytes of physical memory (a multiple of the granularity).
    fn create_physical(&self, size: usize) -> DeviceResult<PhysHandle>;
    /// Releases physical memory that is mapped nowhere.
    fn release_physical(&self, handle: PhysHandle) -> DeviceResult<()>;

    /// Reserves a range of virtual addresses.
    fn reserve_va(&self, size: usize, alignment: usize) -> DeviceResult<DevicePtr>;
    /// Frees a whole reservation made by `reserve_va`, with nothing mapped inside.
    fn free_va(&self, addr: DevicePtr, size: usize) -> DeviceResult<()>;

    /// Maps the whole of `handle` (whose size is `size`) at `addr`.
    fn map(&self, addr: DevicePtr, size: usize, handle: PhysHandle) -> DeviceResult<()>;
    /// Removes the mapping made by `map(addr, size, _)`.
    fn unmap(&self, addr: DevicePtr, size: usize) -> DeviceResult<()>;
    /// Grants read-write access to a mapped range (one call may cover several mappings).
    fn set_access(&self, addr: DevicePtr, size: usize) -> DeviceResult<()>;

    /// Creates an event (timing disabled). Called off the alloc/free path: events are pooled.
    fn create_event(&self) -> DeviceResult<EventHandle>;
    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()>;
    /// Records `event` on `stream`.
    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()>;
    /// True once the work before the last record of `event` has completed.
    fn query_event(&self, event: EventHandle) -> DeviceResult<bool>;
    /// Makes the work queued on `stream` from now on wait, on the device, for the work before
    /// the last record of `event` (`cuStreamWaitEvent`). The host does not wait. The event may
    /// be recorded again at once: the wait keeps the record it saw. A device without it
    /// returns [`DeviceError::Unsupported`]. No default: a decorator that forgot to forward
    /// it would silently turn `cross_stream_wait` off.
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()>;
    /// Blocks until all work on the device has completed.
    fn synchronize(&self) -> DeviceResult<()>;
    /// Blocks until `event` has completed (the work queued on its stream before its last
    /// record), without waiting for other streams. The default polls [`Device::query_event`],
    /// sleeping a little longer each time (up to 1 ms).
    fn wait_event(&self, event: EventHandle) -> DeviceResult<()> {
        poll_event(self, event)
    }

    /// Allocates `size` bytes of pinned host memory (`cuMemHostAlloc`), which copies to and
    /// from the device can run asynchronously with.
    fn alloc_host(&self, size: usize) -> DeviceResult<HostPtr> {
        let _ = size;
        Err(DeviceError::Unsupported("alloc_host"))
    }
    /// Frees a buffer of [`Device::alloc_host`] (its start address). No copy may still be in
    /// flight to or from it.
    fn free_host(&self, ptr: HostPtr) -> DeviceResult<()> {
        let _ = ptr;
        Err(DeviceError::Unsupported("free_host"))
    }
    /// Queues a copy of `len` bytes from device address `src` to pinned host memory `dst` on
    /// `stream` (`cuMemcpyDtoHAsync`).
    fn copy_d2h_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let _ = (dst, src, len, stream);
        Err(DeviceError::Unsupported("copy_d2h_async"))
    }
    /// Queues a copy of `len` bytes from pinned host memory `src` to device address `dst` on
    /// `stream` (`cuMemcpyHtoDAsync`).
    fn copy_h2d_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let _ = (dst, src, len, stream);
        Err(DeviceError::Unsupported("copy_h2d_async"))
    }
}

/// Waits for `event` by polling [`Device::query_event`], sleeping a little longer each time
/// (10 µs doubling up to 1 ms): the default [`Device::wait_event`], for devices with no
/// blocking wait of their own.
pub fn poll_event<D: Device + ?Sized>(dev: &D, event: EventHandle) -> DeviceResult<()> {
    let mut pause = std::time::Duration::from_micros(10);
    while !dev.query_event(event)? {
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(1));
    }
    Ok(())
}

impl<D: Device + ?Sized> Device for std::sync::Arc<D> {
    fn granularity(&self) -> DeviceResult<usize> {
        (**self).granularity()
    }
    fn total_memory(&self) -> DeviceResult<usize> {
        (**self).total_memory()
    }
    fn free_memory(&self) -> DeviceResult<usize> {
        (**self).free_memory()
    }
    fn create_physical(&self, size: usize) -> DeviceResult<PhysHandle> {
        (**self).create_physical(size)
    }
    fn release_physical(&self, handle: PhysHandle) -> DeviceResult<()> {
        (**self).release_physical(handle)
    }
    fn reserve_va(&self, size: usize, alignment: usize) -> DeviceResult<DevicePtr> {
        (**self).reserve_va(size, alignment)
    }
    fn free_va(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        (**self).free_va(addr, size)
    }
    fn map(&self, addr: DevicePtr, size: usize, handle: PhysHandle) -> DeviceResult<()> {
        (**self).map(addr, size, handle)
    }
    fn unmap(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        (**self).unmap(addr, size)
    }
    fn set_access(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        (**self).set_access(addr, size)
    }
    fn create_event(&self) -> DeviceResult<EventHandle> {
        (**self).create_event()
    }
    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        (**self).destroy_event(event)
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        (**self).record_event(event, stream)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        (**self).stream_wait_event(stream, event)
    }
    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        (**self).query_event(event)
    }
    fn synchronize(&self) -> DeviceResult<()> {
        (**self).synchronize()
    }
    fn wait_event(&self, event: EventHandle) -> DeviceResult<()> {
        (**self).wait_event(event)
    }
    fn alloc_host(&self, size: usize) -> DeviceResult<HostPtr> {
        (**self).alloc_host(size)
    }
    fn free_host(&self, ptr: HostPtr) -> DeviceResult<()> {
        (**self).free_host(ptr)
    }
    fn copy_d2h_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        (**self).copy_d2h_async(dst, src, len, stream)
    }
    fn copy_h2d_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        (**self).copy_h2d_async(dst, src, len, stream)
    }
}
