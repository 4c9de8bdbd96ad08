//! The CUDA driver entry points this crate calls, resolved once from the `libcuda` that
//! cudarc finds, into a table of function pointers.
//!
//! Why not call cudarc's `sys::cu*` wrappers directly:
//! - a wrapper looks its symbol up on first call and *panics* when it is missing; resolving
//!   every symbol up front turns an old or broken driver into [`DeviceError::Unavailable`];
//! - the wrappers return `CUresult`, a Rust `enum`: a driver newer than the bindings can return
//!   a code the enum lacks, which is undefined behaviour. Here every call returns the raw
//!   `c_uint`, compared against known codes.
//!
//! Types (structs, handles, enums passed *in*) are cudarc's (`cudarc::driver::sys`), and so is
//! the search for the library (`sys::is_culib_present` / `sys::culib`). Every symbol below is a
//! CUDA 10.2 (or older) driver entry point with the same prototype in every later version.

use cudarc::driver::sys as cu;
use gmlake_core::DeviceError;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::sync::OnceLock;

/// A `CUresult` as the driver returns it (any value, known or not).
pub(crate) type CuResult = c_uint;

pub(crate) const SUCCESS: CuResult = cu::CUresult::CUDA_SUCCESS as CuResult;
pub(crate) const ERROR_INVALID_VALUE: CuResult = cu::CUresult::CUDA_ERROR_INVALID_VALUE as CuResult;
pub(crate) const ERROR_OUT_OF_MEMORY: CuResult = cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY as CuResult;
pub(crate) const ERROR_NOT_READY: CuResult = cu::CUresult::CUDA_ERROR_NOT_READY as CuResult;
pub(crate) const ERROR_NOT_SUPPORTED: CuResult = cu::CUresult::CUDA_ERROR_NOT_SUPPORTED as CuResult;

/// Function pointers into libcuda, with the prototypes of `cuda.h` (return type widened to the
/// raw code).
pub(crate) struct Driver {
    pub init: unsafe extern "C" fn(c_uint) -> CuResult,
    pub driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    pub get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    pub get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    pub device_get: unsafe extern "C" fn(*mut cu::CUdevice, c_int) -> CuResult,
    pub device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    pub device_get_attribute:
        unsafe extern "C" fn(*mut c_int, cu::CUdevice_attribute, cu::CUdevice) -> CuResult,
    pub device_total_mem: unsafe extern "C" fn(*mut usize, cu::CUdevice) -> CuResult,
    pub device_can_access_peer:
        unsafe extern "C" fn(*mut c_int, cu::CUdevice, cu::CUdevice) -> CuResult,
    pub primary_ctx_retain: unsafe extern "C" fn(*mut cu::CUcontext, cu::CUdevice) -> CuResult,
    pub primary_ctx_release: unsafe extern "C" fn(cu::CUdevice) -> CuResult,
    pub ctx_get_current: unsafe extern "C" fn(*mut cu::CUcontext) -> CuResult,
    pub ctx_set_current: unsafe extern "C" fn(cu::CUcontext) -> CuResult,
    pub ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    pub mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    pub mem_get_allocation_granularity: unsafe extern "C" fn(
        *mut usize,
        *const cu::CUmemAllocationProp,
        cu::CUmemAllocationGranularity_flags,
    ) -> CuResult,
    pub mem_create: unsafe extern "C" fn(
        *mut cu::CUmemGenericAllocationHandle,
        usize,
        *const cu::CUmemAllocationProp,
        c_ulonglong,
    ) -> CuResult,
    pub mem_release: unsafe extern "C" fn(cu::CUmemGenericAllocationHandle) -> CuResult,
    pub mem_address_reserve: unsafe extern "C" fn(
        *mut cu::CUdeviceptr,
        usize,
        usize,
        cu::CUdeviceptr,
        c_ulonglong,
    ) -> CuResult,
    pub mem_address_free: unsafe extern "C" fn(cu::CUdeviceptr, usize) -> CuResult,
    pub mem_map: unsafe extern "C" fn(
        cu::CUdeviceptr,
        usize,
        usize,
        cu::CUmemGenericAllocationHandle,
        c_ulonglong,
    ) -> CuResult,
    pub mem_unmap: unsafe extern "C" fn(cu::CUdeviceptr, usize) -> CuResult,
    pub mem_set_access:
        unsafe extern "C" fn(cu::CUdeviceptr, usize, *const cu::CUmemAccessDesc, usize) -> CuResult,
    pub mem_export_to_shareable_handle: unsafe extern "C" fn(
        *mut c_void,
        cu::CUmemGenericAllocationHandle,
        cu::CUmemAllocationHandleType,
        c_ulonglong,
    ) -> CuResult,
    pub mem_import_from_shareable_handle: unsafe extern "C" fn(
        *mut cu::CUmemGenericAllocationHandle,
        *mut c_void,
        cu::CUmemAllocationHandleType,
    ) -> CuResult,
    pub event_create: unsafe extern "C" fn(*mut cu::CUevent, c_uint) -> CuResult,
    pub event_destroy: unsafe extern "C" fn(cu::CUevent) -> CuResult,
    pub event_record: unsafe extern "C" fn(cu::CUevent, cu::CUstream) -> CuResult,
    pub event_query: unsafe extern "C" fn(cu::CUevent) -> CuResult,
    /// Pinned host memory and asynchronous copies, for the host tier. Optional: a driver (or
    /// a mock) without them still serves the allocator; the calls then report `Unsupported`.
    pub host: Option<HostCalls>,
    /// `cuStreamWaitEvent`, for `cross_stream_wait`. Optional like `host`: without it the
    /// call reports `Unsupported` and the allocator does not wait across streams.
    pub stream_wait_event:
        Option<unsafe extern "C" fn(cu::CUstream, cu::CUevent, c_uint) -> CuResult>,
}

/// The entry points of pinned host memory and stream-ordered copies.
pub(crate) struct HostCalls {
    pub mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    pub mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
    pub memcpy_dtoh_async:
        unsafe extern "C" fn(*mut c_void, cu::CUdeviceptr, usize, cu::CUstream) -> CuResult,
    pub memcpy_htod_async:
        unsafe extern "C" fn(cu::CUdeviceptr, *const c_void, usize, cu::CUstream) -> CuResult,
    pub event_synchronize: unsafe extern "C" fn(cu::CUevent) -> CuResult,
}

/// Resolves the first of `names` that libcuda exports, as a function pointer of type `$ty`.
macro_rules! resolve {
    ($lib:expr, $ty:ty, $($name:literal),+) => {{
        let mut found: Option<$ty> = None;
        $(
            if found.is_none() {
                // SAFETY: `$ty` is the prototype `cuda.h` declares for this entry point (checked
                // by hand against cuda.h 10.2 .. 13.x; only the return type is widened from the
                // `CUresult` enum to the `unsigned int` it is in C). The library stays loaded for
                // the life of the process (cudarc keeps it in a static), so the pointer, copied
                // out of the `Symbol`, never dangles.
                if let Ok(sym) = unsafe { $lib.get::<$ty>(concat!($name, "\0").as_bytes()) } {
                    found = Some(*sym);
                }
            }
        )+
        match found {
            Some(f) => f,
            None => {
                return Err(format!(
                    "the CUDA driver library lacks {} (a driver for CUDA 10.2 or newer is required)",
                    [$($name),+].join(" / ")
                ))
            }
        }
    }};
}

fn load() -> Result<Driver, String> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names and closes
    // them again; loading libcuda runs no code of ours and its initialisers are thread-safe.
    if !unsafe { cu::is_culib_present() } {
        return Err(
            "no CUDA driver library (libcuda.so / libcuda.so.1) could be loaded: is the NVIDIA \
             driver installed and on the library path?"
                .into(),
        );
    }
    // `culib` panics only when no candidate loads, which was just ruled out; catch the panic
    // anyway (the library could vanish in between) rather than let it cross the API.
    let lib = std::panic::catch_unwind(|| {
        // SAFETY: as for `is_culib_present`: it dlopens libcuda once and keeps it in a static.
        unsafe { cu::culib() }
    })
    .map_err(|_| "the CUDA driver library was found but could not be loaded".to_string())?;

    Ok(Driver {
        init: resolve!(lib, unsafe extern "C" fn(c_uint) -> CuResult, "cuInit"),
        driver_get_version: resolve!(
            lib,
            unsafe extern "C" fn(*mut c_int) -> CuResult,
            "cuDriverGetVersion"
        ),
        get_error_name: resolve!(
            lib,
            unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
            "cuGetErrorName"
        ),
        get_error_string: resolve!(
            lib,
            unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
            "cuGetErrorString"
        ),
        device_get: resolve!(
            lib,
            unsafe extern "C" fn(*mut cu::CUdevice, c_int) -> CuResult,
            "cuDeviceGet"
        ),
        device_get_count: resolve!(
            lib,
            unsafe extern "C" fn(*mut c_int) -> CuResult,
            "cuDeviceGetCount"
        ),
        device_get_attribute: resolve!(
            lib,
            unsafe extern "C" fn(*mut c_int, cu::CUdevice_attribute, cu::CUdevice) -> CuResult,
            "cuDeviceGetAttribute"
        ),
        device_total_mem: resolve!(
            lib,
            unsafe extern "C" fn(*mut usize, cu::CUdevice) -> CuResult,
            "cuDeviceTotalMem_v2"
        ),
        device_can_access_peer: resolve!(
            lib,
            unsafe extern "C" fn(*mut c_int, cu::CUdevice, cu::CUdevice) -> CuResult,
            "cuDeviceCanAccessPeer"
        ),
        primary_ctx_retain: resolve!(
            lib,
            unsafe extern "C" fn(*mut cu::CUcontext, cu::CUdevice) -> CuResult,
            "cuDevicePrimaryCtxRetain"
        ),
        primary_ctx_release: resolve!(
            lib,
            unsafe extern "C" fn(cu::CUdevice) -> CuResult,
            "cuDevicePrimaryCtxRelease_v2",
            "cuDevicePrimaryCtxRelease"
        ),
        ctx_get_current: resolve!(
            lib,
            unsafe extern "C" fn(*mut cu::CUcontext) -> CuResult,
            "cuCtxGetCurrent"
        ),
        ctx_set_current: resolve!(
            lib,
            unsafe extern "C" fn(cu::CUcontext) -> CuResult,
            "cuCtxSetCurrent"
        ),
        ctx_synchronize: resolve!(lib, unsafe extern "C" fn() -> CuResult, "cuCtxSynchronize"),
        mem_get_info: resolve!(
            lib,
            unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
            "cuMemGetInfo_v2"
        ),
        mem_get_allocation_granularity: resolve!(
            lib,
            unsafe extern "C" fn(
                *mut usize,
                *const cu::CUmemAllocationProp,
                cu::CUmemAllocationGranularity_flags,
            ) -> CuResult,
            "cuMemGetAllocationGranularity"
        ),
        mem_create: resolve!(
            lib,
            unsafe extern "C" fn(
                *mut cu::CUmemGenericAllocationHandle,
                usize,
                *const cu::CUmemAllocationProp,
                c_ulonglong,
            ) -> CuResult,
            "cuMemCreate"
        ),
        mem_release: resolve!(
            lib,
            unsafe extern "C" fn(cu::CUmemGenericAllocationHandle) -> CuResult,
            "cuMemRelease"
        ),
        mem_address_reserve: resolve!(
            lib,
            unsafe extern "C" fn(
                *mut cu::CUdeviceptr,
                usize,
                usize,
                cu::CUdeviceptr,
                c_ulonglong,
            ) -> CuResult,
            "cuMemAddressReserve"
        ),
        mem_address_free: resolve!(
            lib,
            unsafe extern "C" fn(cu::CUdeviceptr, usize) -> CuResult,
            "cuMemAddressFree"
        ),
        mem_map: resolve!(
            lib,
            unsafe extern "C" fn(
                cu::CUdeviceptr,
                usize,
                usize,
                cu::CUmemGenericAllocationHandle,
                c_ulonglong,
            ) -> CuResult,
            "cuMemMap"
        ),
        mem_unmap: resolve!(
            lib,
            unsafe extern "C" fn(cu::CUdeviceptr, usize) -> CuResult,
            "cuMemUnmap"
        ),
        mem_set_access: resolve!(
            lib,
            unsafe extern "C" fn(
                cu::CUdeviceptr,
                usize,
                *const cu::CUmemAccessDesc,
                usize,
            ) -> CuResult,
            "cuMemSetAccess"
        ),
        mem_export_to_shareable_handle: resolve!(
            lib,
            unsafe extern "C" fn(
                *mut c_void,
                cu::CUmemGenericAllocationHandle,
                cu::CUmemAllocationHandleType,
                c_ulonglong,
            ) -> CuResult,
            "cuMemExportToShareableHandle"
        ),
        mem_import_from_shareable_handle: resolve!(
            lib,
            unsafe extern "C" fn(
                *mut cu::CUmemGenericAllocationHandle,
                *mut c_void,
                cu::CUmemAllocationHandleType,
            ) -> CuResult,
            "cuMemImportFromShareableHandle"
        ),
        event_create: resolve!(
            lib,
            unsafe extern "C" fn(*mut cu::CUevent, c_uint) -> CuResult,
            "cuEventCreate"
        ),
        event_destroy: resolve!(
            lib,
            unsafe extern "C" fn(cu::CUevent) -> CuResult,
            "cuEventDestroy_v2"
        ),
        // The unsuffixed symbols have legacy default-stream semantics: stream 0 is the legacy
        // default stream, as `StreamId` documents (the `_ptsz` variants would make it per-thread).
        event_record: resolve!(
            lib,
            unsafe extern "C" fn(cu::CUevent, cu::CUstream) -> CuResult,
            "cuEventRecord"
        ),
        event_query: resolve!(
            lib,
            unsafe extern "C" fn(cu::CUevent) -> CuResult,
            "cuEventQuery"
        ),
        // Resolved apart: when one is missing, only the host tier is unavailable.
        host: (|| -> Result<HostCalls, String> {
            Ok(HostCalls {
                mem_host_alloc: resolve!(
                    lib,
                    unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
                    "cuMemHostAlloc"
                ),
                mem_free_host: resolve!(
                    lib,
                    unsafe extern "C" fn(*mut c_void) -> CuResult,
                    "cuMemFreeHost"
                ),
                memcpy_dtoh_async: resolve!(
                    lib,
                    unsafe extern "C" fn(
                        *mut c_void,
                        cu::CUdeviceptr,
                        usize,
                        cu::CUstream,
                    ) -> CuResult,
                    "cuMemcpyDtoHAsync_v2"
                ),
                memcpy_htod_async: resolve!(
                    lib,
                    unsafe extern "C" fn(
                        cu::CUdeviceptr,
                        *const c_void,
                        usize,
                        cu::CUstream,
                    ) -> CuResult,
                    "cuMemcpyHtoDAsync_v2"
                ),
                event_synchronize: resolve!(
                    lib,
                    unsafe extern "C" fn(cu::CUevent) -> CuResult,
                    "cuEventSynchronize"
                ),
            })
        })()
        .ok(),
        stream_wait_event: (|| -> Result<_, String> {
            Ok(resolve!(
                lib,
                unsafe extern "C" fn(cu::CUstream, cu::CUevent, c_uint) -> CuResult,
                "cuStreamWaitEvent"
            ))
        })()
        .ok(),
    })
}

/// The driver table, loaded on first use; an error says why the driver is unusable.
pub(crate) fn driver() -> Result<&'static Driver, DeviceError> {
    static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();
    DRIVER
        .get_or_init(load)
        .as_ref()
        .map_err(|m| DeviceError::Unavailable(m.clone()))
}

/// Reads a static C string the driver returned; None for a null pointer.
fn static_str(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: cuGetErrorName / cuGetErrorString hand out pointers to NUL-terminated strings in
    // the driver's read-only data, valid for the life of the process.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

impl Driver {
    /// `CUDA_ERROR_NAME: description`, or a placeholder for a code the driver does not know.
    pub(crate) fn describe(&self, code: CuResult) -> String {
        let mut name: *const c_char = std::ptr::null();
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: both out-pointers are valid locals; the driver writes a static string pointer
        // (or leaves them untouched and returns CUDA_ERROR_INVALID_VALUE for unknown codes).
        let (rn, rs) = unsafe {
            (
                (self.get_error_name)(code, &mut name),
                (self.get_error_string)(code, &mut text),
            )
        };
        let name = (rn == SUCCESS).then(|| static_str(name)).flatten();
        let text = (rs == SUCCESS).then(|| static_str(text)).flatten();
        match (name, text) {
            (Some(n), Some(t)) => format!("{n}: {t}"),
            (Some(n), None) => n,
            (None, Some(t)) => t,
            (None, None) => format!("unknown CUDA error {code}"),
        }
    }

    /// The error value for `code` returned by `call`.
    pub(crate) fn error(&self, call: &'static str, code: CuResult) -> DeviceError {
        DeviceError::Driver {
            call,
            code: i64::from(code),
            message: self.describe(code),
        }
    }

    /// Ok for CUDA_SUCCESS, otherwise the driver error.
    #[inline]
    pub(crate) fn check(&self, call: &'static str, code: CuResult) -> Result<(), DeviceError> {
        if code == SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }
}
