//! [`CudaDevice`]: `gmlake_core::Device` on the CUDA driver's virtual memory management API.

use crate::driver::{self, CuResult, Driver};
use cudarc::driver::sys as cu;
use gmlake_core::{
    Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostPtr, PhysHandle, StreamId,
};
use parking_lot::{Mutex, RwLock};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

/// `CUmemLocation` as every CUDA version lays it out: `{ CUmemLocationType type; int id; }`.
/// From CUDA 13.2 the bindings put `id` in a union (of the same 4 bytes), so the field cannot
/// be named the same way across binding versions; this mirror can.
#[repr(C)]
#[derive(Clone, Copy)]
struct MemLocation {
    type_: cu::CUmemLocationType,
    id: c_int,
}

const _: () = {
    assert!(std::mem::size_of::<MemLocation>() == std::mem::size_of::<cu::CUmemLocation>());
    assert!(std::mem::align_of::<MemLocation>() == std::mem::align_of::<cu::CUmemLocation>());
};

/// The location "device `dev`".
fn device_location(dev: cu::CUdevice) -> cu::CUmemLocation {
    let loc = MemLocation {
        type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    };
    // SAFETY: both types are `#[repr(C)]` with the layout `{ u32 enum at offset 0, 4-byte int
    // (or union of 4 bytes holding that int) at offset 4 }` in every binding version (sizes and
    // alignments are asserted equal above), and every byte of `loc` is initialised with a valid
    // value for the corresponding field.
    unsafe { std::mem::transmute::<MemLocation, cu::CUmemLocation>(loc) }
}

/// The properties of pinned device memory on `dev`, exportable as `handle_types`.
fn allocation_prop(
    dev: cu::CUdevice,
    handle_types: cu::CUmemAllocationHandleType,
) -> cu::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a C struct of integers, a raw pointer, and enums whose
    // zero value is a declared variant (CU_MEM_ALLOCATION_TYPE_INVALID, CU_MEM_HANDLE_TYPE_NONE,
    // CU_MEM_LOCATION_TYPE_INVALID): all-zero bytes is a valid value, and it is what the CUDA
    // documentation asks for in the fields left unset (`memset(&prop, 0, sizeof prop)`).
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = handle_types;
    prop.location = device_location(dev);
    prop
}

fn read_write_access(dev: cu::CUdevice) -> cu::CUmemAccessDesc {
    cu::CUmemAccessDesc {
        location: device_location(dev),
        flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

const POSIX_FD: cu::CUmemAllocationHandleType =
    cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
const NO_HANDLE: cu::CUmemAllocationHandleType =
    cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;

fn invalid<T>(msg: String) -> DeviceResult<T> {
    Err(DeviceError::InvalidArgument(msg))
}

/// Initialises the driver (`cuInit(0)`; idempotent) and returns its table.
fn init() -> DeviceResult<&'static Driver> {
    let drv = driver::driver()?;
    // SAFETY: cuInit takes a flags word (must be 0) and is safe to call repeatedly and from
    // several threads.
    let r = unsafe { (drv.init)(0) };
    if r != driver::SUCCESS {
        // No device, a stub library, a driver/library mismatch, ...: the driver is unusable.
        return Err(DeviceError::Unavailable(format!(
            "cuInit failed with code {r}: {}",
            drv.describe(r)
        )));
    }
    Ok(drv)
}

/// Number of CUDA devices the driver sees (`cuDeviceGetCount`); an error if there is no usable
/// driver.
pub fn device_count() -> DeviceResult<i32> {
    let drv = init()?;
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the driver is initialised.
    drv.check("cuDeviceGetCount", unsafe {
        (drv.device_get_count)(&mut n)
    })?;
    Ok(n)
}

/// Version of the installed driver as the driver API encodes it (1000 x major + 10 x minor,
/// e.g. 13000 for CUDA 13.0), `cuDriverGetVersion`.
pub fn driver_version() -> DeviceResult<i32> {
    let drv = driver::driver()?;
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; cuDriverGetVersion needs no initialisation.
    drv.check("cuDriverGetVersion", unsafe {
        (drv.driver_get_version)(&mut v)
    })?;
    Ok(v)
}

/// One GPU, driven through the CUDA driver's virtual memory management API.
///
/// Holds a reference on the device's primary context from construction to drop, and makes
/// that context current on the calling thread for each call that needs one (see
/// [`CudaDevice::new`]). All methods take `&self` and may be called from any thread.
///
/// Physical memory is pinned device memory created with
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` so that it can be exported to other processes
/// ([`CudaDevice::export_fd`]); where the driver refuses that handle type the device falls back,
/// once and for good, to non-exportable memory ([`CudaDevice::exportable`] turns false).
///
/// Contract on inputs the driver cannot check: a [`StreamId`] passed to
/// [`Device::record_event`] must be 0 (the legacy default stream), one of the special handles
/// `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD`, or a live stream of this device's primary
/// context (`cudaStream_t` cast to an integer). Event handles are checked against the events
/// this device created.
pub struct CudaDevice {
    drv: &'static Driver,
    ordinal: i32,
    dev: cu::CUdevice,
    /// The retained primary context of `dev`; released in `Drop`.
    ctx: cu::CUcontext,
    granularity: usize,
    total_memory: usize,
    /// Properties for new physical memory, with and without the exportable handle type.
    prop_exportable: cu::CUmemAllocationProp,
    prop_plain: cu::CUmemAllocationProp,
    /// Whether `cuMemCreate` still asks for a POSIX file descriptor handle type.
    exportable: AtomicBool,
    /// Read-write access for this device first, then each peer added by `add_peer`.
    access: RwLock<Vec<cu::CUmemAccessDesc>>,
    peers: Mutex<Vec<i32>>,
    /// Events created here and not yet destroyed (as integers). Held while an event is used,
    /// so a destroyed or foreign handle never reaches the driver.
    events: Mutex<FxHashSet<u64>>,
    /// Descriptors exported for IPC, per physical handle: kept open until the handle is
    /// released, because an importing process duplicates them (`pidfd_getfd`) at a time the
    /// exporter cannot know.
    exported: Mutex<FxHashMap<u64, i32>>,
    /// Pinned host buffers made by `alloc_host`, by start address.
    host: Mutex<BTreeMap<u64, HostBuf>>,
}

/// A pinned host buffer and, per stream that copied to or from it, an event recorded after
/// its last copy there: `free_host` waits for them, so the driver never writes host memory
/// that was given back.
struct HostBuf {
    size: usize,
    fences: Vec<(StreamId, cu::CUevent)>,
}

// SAFETY: the raw pointers inside (the primary context handle, and the null
// `win32HandleMetaData` in the allocation properties) are process-wide driver handles, not
// thread-local state: the CUDA driver API is thread-safe and accepts a context handle from any
// thread. Mutable state is behind locks or atomics.
unsafe impl Send for CudaDevice {}
// SAFETY: as for Send: every method takes `&self` and only reads the immutable fields or goes
// through `RwLock` / `Mutex` / `AtomicBool`; concurrent driver calls are allowed by CUDA.
unsafe impl Sync for CudaDevice {}

/// Makes a context current for the duration of a call; on drop, puts back the context that
/// was current before, when there was one and it was a different one.
struct CtxGuard {
    drv: &'static Driver,
    restore: Option<cu::CUcontext>,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // SAFETY: `prev` was current on this thread a moment ago, so it is a live context
            // (a context cannot be destroyed while current on a thread without the caller
            // breaking CUDA's own rules).
            let _ = unsafe { (self.drv.ctx_set_current)(prev) };
        }
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: checks that a CUDA driver library is present (otherwise
    /// [`DeviceError::Unavailable`], never a panic), calls `cuInit(0)`, retains the device's
    /// primary context (`cuDevicePrimaryCtxRetain`, the context the CUDA runtime and PyTorch
    /// use), and reads the recommended allocation granularity and the total memory.
    ///
    /// Context handling: before each driver call that needs a context the device compares the
    /// calling thread's current context (`cuCtxGetCurrent`) with its primary context and, only
    /// if they differ, makes its own current (`cuCtxSetCurrent`) and puts the previous one
    /// back after the call (when there was one). So it works from threads on which PyTorch never
    /// set the device (e.g. autograd threads freeing memory), and never leaves another device's
    /// thread switched over. A thread with no current context keeps this device's afterwards.
    pub fn new(ordinal: i32) -> DeviceResult<CudaDevice> {
        let drv = init()?;
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer; the driver is initialised.
        drv.check("cuDeviceGetCount", unsafe {
            (drv.device_get_count)(&mut count)
        })?;
        if ordinal < 0 || ordinal >= count {
            return Err(DeviceError::InvalidArgument(format!(
                "no CUDA device with ordinal {ordinal} ({count} device(s) visible)"
            )));
        }
        let mut dev: cu::CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer; `ordinal` was checked in range.
        drv.check("cuDeviceGet", unsafe {
            (drv.device_get)(&mut dev, ordinal)
        })?;

        let attr = |a: cu::CUdevice_attribute| -> DeviceResult<c_int> {
            let mut v: c_int = 0;
            // SAFETY: `v` is a valid out-pointer, `dev` a valid device, `a` a declared attribute.
            drv.check("cuDeviceGetAttribute", unsafe {
                (drv.device_get_attribute)(&mut v, a, dev)
            })?;
            Ok(v)
        };
        if attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)?
            == 0
        {
            return Err(DeviceError::Unavailable(format!(
                "CUDA device {ordinal} does not support virtual memory management (cuMemCreate / \
                 cuMemMap)"
            )));
        }
        // Devices (or drivers, e.g. some virtualised ones) without POSIX fd export start out
        // non-exportable; cuMemCreate's own refusal is the second line of defence.
        let fd_supported = attr(
            cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )
        .map(|v| v != 0)
        .unwrap_or(false);

        let prop_exportable = allocation_prop(dev, POSIX_FD);
        let prop_plain = allocation_prop(dev, NO_HANDLE);
        let granularity_of = |prop: &cu::CUmemAllocationProp| -> DeviceResult<usize> {
            let mut g: usize = 0;
            // SAFETY: `g` is a valid out-pointer and `prop` a fully initialised property struct
            // that outlives the call.
            drv.check("cuMemGetAllocationGranularity", unsafe {
                (drv.mem_get_allocation_granularity)(
                    &mut g,
                    prop,
                    cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            })?;
            Ok(g)
        };
        let mut granularity = granularity_of(&prop_plain)?;
        if fd_supported {
            // Exportable memory might need a coarser granularity; use the larger of the two so
            // a size valid for one is valid for the other (both are powers of two).
            if let Ok(g) = granularity_of(&prop_exportable) {
                granularity = granularity.max(g);
            }
        }
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(DeviceError::Unavailable(format!(
                "CUDA device {ordinal} reports an allocation granularity of {granularity}"
            )));
        }

        let mut total: usize = 0;
        // SAFETY: `total` is a valid out-pointer and `dev` a valid device.
        drv.check("cuDeviceTotalMem", unsafe {
            (drv.device_total_mem)(&mut total, dev)
        })?;

        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer and `dev` a valid device; on success we own one
        // reference on the primary context, given back in `Drop`.
        drv.check("cuDevicePrimaryCtxRetain", unsafe {
            (drv.primary_ctx_retain)(&mut ctx, dev)
        })?;

        Ok(CudaDevice {
            drv,
            ordinal,
            dev,
            ctx,
            granularity,
            total_memory: total,
            prop_exportable,
            prop_plain,
            exportable: AtomicBool::new(fd_supported),
            access: RwLock::new(vec![read_write_access(dev)]),
            peers: Mutex::new(Vec::new()),
            events: Mutex::new(FxHashSet::default()),
            exported: Mutex::new(FxHashMap::default()),
            host: Mutex::new(BTreeMap::new()),
        })
    }

    /// The device ordinal this device was opened with.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Whether new physical memory is created exportable as a POSIX file descriptor (false
    /// after the driver refused that handle type once; memory created before stays exportable).
    pub fn exportable(&self) -> bool {
        self.exportable.load(Ordering::Relaxed)
    }

    /// Devices (ordinals) granted read-write access by future [`Device::set_access`] calls,
    /// besides this one.
    pub fn peers(&self) -> Vec<i32> {
        self.peers.lock().clone()
    }

    /// Grants device `ordinal` read-write access to every range passed to
    /// [`Device::set_access`] from now on. Ranges mapped earlier are not changed: the caller
    /// re-grants them (calling `set_access` again on each). Adding this device itself or a peer
    /// already added does nothing. Fails if the ordinal does not exist or that device cannot
    /// access this one's memory (`cuDeviceCanAccessPeer`).
    pub fn add_peer(&self, ordinal: i32) -> DeviceResult<()> {
        if ordinal == self.ordinal {
            return Ok(());
        }
        let mut peers = self.peers.lock();
        if peers.contains(&ordinal) {
            return Ok(());
        }
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer; the driver was initialised by `new`.
        self.drv.check("cuDeviceGetCount", unsafe {
            (self.drv.device_get_count)(&mut count)
        })?;
        if ordinal < 0 || ordinal >= count {
            return invalid(format!(
                "no CUDA device with ordinal {ordinal} ({count} device(s) visible)"
            ));
        }
        let mut peer: cu::CUdevice = 0;
        // SAFETY: `peer` is a valid out-pointer; `ordinal` was checked in range.
        self.drv.check("cuDeviceGet", unsafe {
            (self.drv.device_get)(&mut peer, ordinal)
        })?;
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out-pointer; both devices are valid.
        self.drv.check("cuDeviceCanAccessPeer", unsafe {
            (self.drv.device_can_access_peer)(&mut can, peer, self.dev)
        })?;
        if can == 0 {
            return Err(DeviceError::Unavailable(format!(
                "CUDA device {ordinal} cannot access the memory of device {} (no peer access)",
                self.ordinal
            )));
        }
        self.access.write().push(read_write_access(peer));
        peers.push(ordinal);
        Ok(())
    }

    /// Exports physical memory made by [`Device::create_physical`] as a POSIX file descriptor
    /// (`cuMemExportToShareableHandle`), for IPC: send the descriptor to another process (e.g.
    /// over a Unix socket with `SCM_RIGHTS`), which imports it with [`CudaDevice::import_fd`].
    /// The caller owns the returned descriptor and closes it. Fails with `Unavailable` when this
    /// device creates non-exportable memory (see [`CudaDevice::exportable`]).
    pub fn export_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        if !self.exportable() {
            return Err(DeviceError::Unavailable(format!(
                "physical memory on CUDA device {} is not exportable: the driver refused \
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
                self.ordinal
            )));
        }
        let _ctx = self.bind()?;
        let mut fd: c_int = -1;
        // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver writes an `int` to the
        // out-pointer, and `fd` is a valid `c_int` local. A wrong handle is reported as an error
        // by the driver (allocation handles are looked up, not dereferenced).
        self.drv.check("cuMemExportToShareableHandle", unsafe {
            (self.drv.mem_export_to_shareable_handle)(
                (&mut fd as *mut c_int).cast::<c_void>(),
                handle.0,
                POSIX_FD,
                0,
            )
        })?;
        Ok(fd)
    }

    /// The descriptor of `handle` for IPC: exported once ([`CudaDevice::export_fd`]) and kept
    /// open by this device until [`Device::release_physical`] releases the handle, so another
    /// process can duplicate it while the page lives. The caller must not close it.
    pub fn shared_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        let mut exported = self.exported.lock();
        if let Some(&fd) = exported.get(&handle.0) {
            return Ok(fd);
        }
        let fd = self.export_fd(handle)?;
        exported.insert(handle.0, fd);
        Ok(fd)
    }

    /// Imports page `fd` of process `pid` (a descriptor number in that process, as
    /// [`CudaDevice::shared_fd`] gave it there): duplicates it with `pidfd_open` +
    /// `pidfd_getfd` (Linux 5.6+; needs ptrace access to that process: same user, and
    /// `/proc/sys/kernel/yama/ptrace_scope` 0, or root), imports it, and closes the duplicate.
    pub fn import_from_process(&self, pid: i32, fd: i32) -> DeviceResult<PhysHandle> {
        // The duplicate is closed when `local` goes, after the import.
        let local = crate::pidfd::dup_from_process(pid, fd)?;
        self.import_fd(local.raw())
    }

    /// Imports physical memory exported by another process with [`CudaDevice::export_fd`]
    /// (`cuMemImportFromShareableHandle`). The descriptor stays owned by the caller (it may be
    /// closed once this returns). The returned handle maps like one from `create_physical`
    /// (the caller must know its size, e.g. sent along with the descriptor) and is given back
    /// with [`Device::release_physical`] once unmapped.
    pub fn import_fd(&self, fd: i32) -> DeviceResult<PhysHandle> {
        if fd < 0 {
            return invalid(format!("import of invalid file descriptor {fd}"));
        }
        let _ctx = self.bind()?;
        let mut handle: cu::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer. For POSIX file descriptors the driver takes
        // the descriptor itself cast to a pointer (`(void *)(uintptr_t)fd`), not a pointer to
        // memory, so nothing is dereferenced through it.
        self.drv.check("cuMemImportFromShareableHandle", unsafe {
            (self.drv.mem_import_from_shareable_handle)(
                &mut handle,
                fd as usize as *mut c_void,
                POSIX_FD,
            )
        })?;
        Ok(PhysHandle(handle))
    }

    /// Makes this device's primary context current on the calling thread until the guard drops.
    #[inline]
    fn bind(&self) -> DeviceResult<CtxGuard> {
        let mut cur: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: `cur` is a valid out-pointer.
        self.drv.check("cuCtxGetCurrent", unsafe {
            (self.drv.ctx_get_current)(&mut cur)
        })?;
        if cur == self.ctx {
            return Ok(CtxGuard {
                drv: self.drv,
                restore: None,
            });
        }
        // SAFETY: `self.ctx` is the primary context we hold a reference on (retained in `new`,
        // released only in `Drop`), so it is alive.
        self.drv.check("cuCtxSetCurrent", unsafe {
            (self.drv.ctx_set_current)(self.ctx)
        })?;
        Ok(CtxGuard {
            drv: self.drv,
            restore: (!cur.is_null()).then_some(cur),
        })
    }

    fn check_aligned(&self, what: &str, v: u64) -> DeviceResult<()> {
        if v & (self.granularity as u64 - 1) != 0 {
            return invalid(format!(
                "{what} {v:#x} is not a multiple of the granularity {:#x}",
                self.granularity
            ));
        }
        Ok(())
    }

    fn host_calls(&self, call: &'static str) -> DeviceResult<&'static driver::HostCalls> {
        self.drv.host.as_ref().ok_or(DeviceError::Unsupported(call))
    }

    /// Checks that [ptr, ptr + len) lies inside one pinned buffer of `bufs`; returns its start.
    fn host_range(
        bufs: &BTreeMap<u64, HostBuf>,
        ptr: HostPtr,
        len: usize,
        call: &str,
    ) -> DeviceResult<u64> {
        match bufs.range(..=ptr.0).next_back() {
            Some((&start, b))
                if ptr
                    .0
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= start + b.size as u64) =>
            {
                Ok(start)
            }
            _ => invalid(format!(
                "{call} of {len} bytes at host address {:#x}: not inside a pinned buffer of \
                 this device",
                ptr.0
            )),
        }
    }

    /// Records (creating it on first use) the fence event of buffer `buf` on `stream`, after
    /// a copy just queued there. A context of this device is current.
    fn fence_host(&self, buf: &mut HostBuf, stream: StreamId) -> DeviceResult<()> {
        let ev = match buf.fences.iter().find(|f| f.0 == stream) {
            Some(&(_, ev)) => ev,
            None => {
                let mut ev: cu::CUevent = std::ptr::null_mut();
                // SAFETY: `ev` is a valid out-pointer; the flag is a declared CUevent_flags
                // value; a context of this device is current.
                self.drv.check("cuEventCreate", unsafe {
                    (self.drv.event_create)(
                        &mut ev,
                        cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
                    )
                })?;
                buf.fences.push((stream, ev));
                ev
            }
        };
        // SAFETY: `ev` is a live event created above (destroyed only when the buffer is freed,
        // under the host lock the caller holds); the stream follows the contract on `CudaDevice`.
        self.drv.check("cuEventRecord", unsafe {
            (self.drv.event_record)(ev, stream as usize as cu::CUstream)
        })
    }

    /// Waits for the copies of a buffer taken out of the live set, destroys its fences and
    /// frees it. A context of this device is current.
    fn release_host(&self, start: u64, buf: HostBuf) -> DeviceResult<()> {
        let calls = self.host_calls("free_host")?;
        let mut first_err = None;
        for (_, ev) in buf.fences {
            // SAFETY: `ev` is a live event created by `fence_host`, owned by this buffer,
            // which no other thread can reach any more (it left the live set under the lock).
            let r = unsafe { (calls.event_synchronize)(ev) };
            if let Err(e) = self.drv.check("cuEventSynchronize", r) {
                first_err.get_or_insert(e);
            }
            // SAFETY: as above; the event is not used after this.
            let _ = unsafe { (self.drv.event_destroy)(ev) };
        }
        if let Some(e) = first_err {
            // A copy may still be in flight: leak the buffer rather than free it under the DMA.
            return Err(e);
        }
        // SAFETY: `start` was returned by cuMemHostAlloc (it was in the live set) and is freed
        // once (it left the set); every copy queued on it has completed (its fences were waited
        // for above), so the driver no longer accesses it.
        self.drv.check("cuMemFreeHost", unsafe {
            (calls.mem_free_host)(start as usize as *mut c_void)
        })
    }

    fn create_with(
        &self,
        size: usize,
        prop: &cu::CUmemAllocationProp,
    ) -> (CuResult, cu::CUmemGenericAllocationHandle) {
        let mut handle: cu::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer, `prop` a fully initialised property struct
        // that outlives the call; flags must be 0.
        let r = unsafe { (self.drv.mem_create)(&mut handle, size, prop, 0) };
        (r, handle)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Destroy events still alive, then give back our reference on the primary context.
        // Errors are ignored: there is no one to report them to (e.g. at process exit the driver
        // may already be shut down).
        let events: Vec<u64> = self.events.get_mut().drain().collect();
        if !events.is_empty() {
            if let Ok(_ctx) = self.bind() {
                for e in events {
                    // SAFETY: `e` was created by cuEventCreate here and never destroyed (it was
                    // still in the live set).
                    let _ = unsafe { (self.drv.event_destroy)(e as usize as cu::CUevent) };
                }
            }
        }
        for (_, fd) in self.exported.get_mut().drain() {
            crate::pidfd::close_fd(fd);
        }
        let bufs = std::mem::take(self.host.get_mut());
        if !bufs.is_empty() {
            if let Ok(_ctx) = self.bind() {
                for (start, buf) in bufs {
                    let _ = self.release_host(start, buf);
                }
            }
        }
        // SAFETY: balances the cuDevicePrimaryCtxRetain in `new`; `self` is going away, so the
        // context handle is not used again by us.
        let _ = unsafe { (self.drv.primary_ctx_release)(self.dev) };
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("granularity", &self.granularity)
            .field("total_memory", &self.total_memory)
            .field("exportable", &self.exportable())
            .field("peers", &self.peers())
            .finish()
    }
}

impl Device for CudaDevice {
    fn granularity(&self) -> DeviceResult<usize> {
        Ok(self.granularity)
    }

    fn total_memory(&self) -> DeviceResult<usize> {
        Ok(self.total_memory)
    }

    fn free_memory(&self) -> DeviceResult<usize> {
        let _ctx = self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers; a context of this device is current.
        self.drv.check("cuMemGetInfo", unsafe {
            (self.drv.mem_get_info)(&mut free, &mut total)
        })?;
        Ok(free)
    }

    fn create_physical(&self, size: usize) -> DeviceResult<PhysHandle> {
        // Checked here so that an INVALID_VALUE from the driver below can only mean "this
        // handle type is not supported", never a caller's bad size.
        self.check_aligned("physical size", size as u64)?;
        if size == 0 {
            return invalid("physical size 0".into());
        }
        let _ctx = self.bind()?;
        let exportable = self.exportable();
        let prop = if exportable {
            &self.prop_exportable
        } else {
            &self.prop_plain
        };
        let (mut r, mut handle) = self.create_with(size, prop);
        if exportable && (r == driver::ERROR_NOT_SUPPORTED || r == driver::ERROR_INVALID_VALUE) {
            let refused = r;
            (r, handle) = self.create_with(size, &self.prop_plain);
            if r == driver::SUCCESS {
                self.exportable.store(false, Ordering::Relaxed);
                tracing::warn!(
                    device = self.ordinal,
                    "cuMemCreate refused CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ({}); \
                     creating non-exportable memory from now on (no IPC)",
                    self.drv.describe(refused)
                );
            }
        }
        match r {
            driver::SUCCESS => Ok(PhysHandle(handle)),
            driver::ERROR_OUT_OF_MEMORY => Err(DeviceError::OutOfMemory),
            _ => Err(self.drv.error("cuMemCreate", r)),
        }
    }

    fn release_physical(&self, handle: PhysHandle) -> DeviceResult<()> {
        let _ctx = self.bind()?;
        // SAFETY: allocation handles are opaque ids the driver looks up; an unknown or released
        // one is reported as CUDA_ERROR_INVALID_VALUE, not dereferenced.
        let r = unsafe { (self.drv.mem_release)(handle.0) };
        self.drv.check("cuMemRelease", r)?;
        if let Some(fd) = self.exported.lock().remove(&handle.0) {
            crate::pidfd::close_fd(fd);
        }
        Ok(())
    }

    fn reserve_va(&self, size: usize, alignment: usize) -> DeviceResult<DevicePtr> {
        self.check_aligned("reservation size", size as u64)?;
        if size == 0 || (alignment != 0 && !alignment.is_power_of_two()) {
            return invalid(format!(
                "reservation of {size} bytes aligned to {alignment}"
            ));
        }
        let _ctx = self.bind()?;
        let mut addr: cu::CUdeviceptr = 0;
        // SAFETY: `addr` is a valid out-pointer; no fixed address is requested (0), flags 0.
        // Reserving address space touches no memory.
        let r = unsafe {
            (self.drv.mem_address_reserve)(&mut addr, size, alignment.max(self.granularity), 0, 0)
        };
        match r {
            driver::SUCCESS => Ok(addr),
            // The address space is exhausted: as the simulated device reports it.
            driver::ERROR_OUT_OF_MEMORY => Err(DeviceError::OutOfMemory),
            _ => Err(self.drv.error("cuMemAddressReserve", r)),
        }
    }

    fn free_va(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        let _ctx = self.bind()?;
        // SAFETY: the driver checks that (addr, size) is one of its reservations and reports an
        // error otherwise; freeing address space with nothing mapped touches no memory.
        self.drv.check("cuMemAddressFree", unsafe {
            (self.drv.mem_address_free)(addr, size)
        })
    }

    fn map(&self, addr: DevicePtr, size: usize, handle: PhysHandle) -> DeviceResult<()> {
        self.check_aligned("mapping address", addr)?;
        self.check_aligned("mapping size", size as u64)?;
        let _ctx = self.bind()?;
        // SAFETY: the driver checks that the range lies in a reservation and is unmapped and
        // that the handle is live and at least `size` bytes; mapping creates no host-visible
        // memory, so a wrong argument is an error code, not unsoundness on our side.
        self.drv.check("cuMemMap", unsafe {
            (self.drv.mem_map)(addr, size, 0, handle.0, 0)
        })
    }

    fn unmap(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        self.check_aligned("unmapping address", addr)?;
        self.check_aligned("unmapping size", size as u64)?;
        let _ctx = self.bind()?;
        // SAFETY: as for map: the driver validates the range. (Kernels still using the range
        // are the caller's concern; the allocator unmaps only blocks whose events completed.)
        self.drv
            .check("cuMemUnmap", unsafe { (self.drv.mem_unmap)(addr, size) })
    }

    fn set_access(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        let _ctx = self.bind()?;
        let access = self.access.read();
        // SAFETY: `access` points to `access.len()` initialised descriptors, kept alive (and
        // unmodified, the read lock being held) for the duration of the call; the driver
        // validates the range.
        self.drv.check("cuMemSetAccess", unsafe {
            (self.drv.mem_set_access)(addr, size, access.as_ptr(), access.len())
        })
    }

    fn create_event(&self) -> DeviceResult<EventHandle> {
        let _ctx = self.bind()?;
        let mut ev: cu::CUevent = std::ptr::null_mut();
        // SAFETY: `ev` is a valid out-pointer; the flag is a declared CUevent_flags value; a
        // context of this device is current, so the event belongs to it.
        self.drv.check("cuEventCreate", unsafe {
            (self.drv.event_create)(
                &mut ev,
                cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
            )
        })?;
        let id = ev as usize as u64;
        self.events.lock().insert(id);
        Ok(EventHandle(id))
    }

    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        let mut events = self.events.lock();
        if !events.remove(&event.0) {
            return invalid(format!("destroy of unknown event {:#x}", event.0));
        }
        let _ctx = self.bind()?;
        // SAFETY: the event was created here and was still live (it was in the set, under the
        // lock held across this call, so no other thread destroys it concurrently).
        self.drv.check("cuEventDestroy", unsafe {
            (self.drv.event_destroy)(event.0 as usize as cu::CUevent)
        })
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        let events = self.events.lock();
        if !events.contains(&event.0) {
            return invalid(format!("record of unknown event {:#x}", event.0));
        }
        let _ctx = self.bind()?;
        // SAFETY: the event is live (in the set; the lock is held so it cannot be destroyed
        // meanwhile). The stream is 0, a special handle, or a live stream handle, per the
        // contract documented on `CudaDevice` (the trait passes streams as integers).
        self.drv.check("cuEventRecord", unsafe {
            (self.drv.event_record)(
                event.0 as usize as cu::CUevent,
                stream as usize as cu::CUstream,
            )
        })
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        let Some(wait) = self.drv.stream_wait_event else {
            return Err(DeviceError::Unsupported("stream_wait_event"));
        };
        let events = self.events.lock();
        if !events.contains(&event.0) {
            return invalid(format!("stream wait for unknown event {:#x}", event.0));
        }
        let _ctx = self.bind()?;
        // SAFETY: the event is live (in the set; the lock is held so it cannot be destroyed
        // meanwhile). The stream is 0, a special handle, or a live stream handle, per the
        // contract documented on `CudaDevice`. Flags 0 is the only value the driver defines.
        self.drv.check("cuStreamWaitEvent", unsafe {
            wait(
                stream as usize as cu::CUstream,
                event.0 as usize as cu::CUevent,
                0,
            )
        })
    }

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let events = self.events.lock();
        if !events.contains(&event.0) {
            return invalid(format!("query of unknown event {:#x}", event.0));
        }
        let _ctx = self.bind()?;
        // SAFETY: the event is live (in the set, lock held across the call).
        let r = unsafe { (self.drv.event_query)(event.0 as usize as cu::CUevent) };
        match r {
            driver::SUCCESS => Ok(true),
            driver::ERROR_NOT_READY => Ok(false),
            _ => Err(self.drv.error("cuEventQuery", r)),
        }
    }

    /// `cuEventSynchronize` (blocking until the event's stream is past its record), rather
    /// than the trait's default polling with sleeps: the allocator waits with its state lock
    /// held, so each wait should end as soon as the work does. Without the optional entry
    /// points (a driver or mock lacking them), the default.
    fn wait_event(&self, event: EventHandle) -> DeviceResult<()> {
        let Some(calls) = self.drv.host.as_ref() else {
            return gmlake_core::device::poll_event(self, event);
        };
        let events = self.events.lock();
        if !events.contains(&event.0) {
            return invalid(format!("wait for unknown event {:#x}", event.0));
        }
        let _ctx = self.bind()?;
        // SAFETY: the event is live (in the set, lock held across the call so it cannot be
        // destroyed meanwhile).
        let r = unsafe { (calls.event_synchronize)(event.0 as usize as cu::CUevent) };
        self.drv.check("cuEventSynchronize", r)
    }

    fn synchronize(&self) -> DeviceResult<()> {
        let _ctx = self.bind()?;
        // SAFETY: no arguments; waits for all work of the current context (this device's
        // primary context, which the CUDA runtime and PyTorch also use).
        self.drv
            .check("cuCtxSynchronize", unsafe { (self.drv.ctx_synchronize)() })
    }

    fn alloc_host(&self, size: usize) -> DeviceResult<HostPtr> {
        let calls = self.host_calls("alloc_host")?;
        if size == 0 {
            return invalid("pinned host allocation of 0 bytes".into());
        }
        let _ctx = self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; flags 0 (CU_MEMHOSTALLOC default: pinned,
        // page-locked memory of the current context, this device's primary context).
        let r = unsafe { (calls.mem_host_alloc)(&mut p, size, 0) };
        match r {
            driver::SUCCESS if !p.is_null() => {
                self.host.lock().insert(
                    p as usize as u64,
                    HostBuf {
                        size,
                        fences: Vec::new(),
                    },
                );
                Ok(HostPtr(p as usize as u64))
            }
            driver::ERROR_OUT_OF_MEMORY => Err(DeviceError::OutOfMemory),
            driver::SUCCESS => Err(self
                .drv
                .error("cuMemHostAlloc", driver::ERROR_INVALID_VALUE)),
            _ => Err(self.drv.error("cuMemHostAlloc", r)),
        }
    }

    fn free_host(&self, ptr: HostPtr) -> DeviceResult<()> {
        self.host_calls("free_host")?;
        let Some(buf) = self.host.lock().remove(&ptr.0) else {
            return invalid(format!("free of unknown pinned host buffer {:#x}", ptr.0));
        };
        let _ctx = self.bind()?;
        self.release_host(ptr.0, buf)
    }

    fn copy_d2h_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let calls = self.host_calls("copy_d2h_async")?;
        let mut bufs = self.host.lock();
        let start = Self::host_range(&bufs, dst, len, "copy_d2h_async")?;
        let _ctx = self.bind()?;
        // SAFETY: [dst, dst + len) lies inside a live pinned buffer of this device (checked
        // above); it stays allocated until the copy has completed, because `free_host` waits
        // for the fence recorded below (the host lock, held across, keeps the buffer live until
        // the fence is recorded). The driver validates the device range (a bad one is an error
        // code or a GPU fault, not host memory corruption). The stream follows the contract on
        // `CudaDevice`.
        self.drv.check("cuMemcpyDtoHAsync", unsafe {
            (calls.memcpy_dtoh_async)(
                dst.0 as usize as *mut c_void,
                src,
                len,
                stream as usize as cu::CUstream,
            )
        })?;
        let buf = bufs.get_mut(&start).expect("buffer checked above");
        self.fence_host(buf, stream)
    }

    fn copy_h2d_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let calls = self.host_calls("copy_h2d_async")?;
        let mut bufs = self.host.lock();
        let start = Self::host_range(&bufs, src, len, "copy_h2d_async")?;
        let _ctx = self.bind()?;
        // SAFETY: as for copy_d2h_async: the host range lies in a live pinned buffer kept
        // alive until the fence recorded below has completed; the driver validates the device
        // range; the stream follows the contract on `CudaDevice`.
        self.drv.check("cuMemcpyHtoDAsync", unsafe {
            (calls.memcpy_htod_async)(
                dst,
                src.0 as usize as *const c_void,
                len,
                stream as usize as cu::CUstream,
            )
        })?;
        let buf = bufs.get_mut(&start).expect("buffer checked above");
        self.fence_host(buf, stream)
    }
}
