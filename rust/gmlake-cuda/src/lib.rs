//! `gmlake_core::Device` on the CUDA driver's virtual memory management API.
//!
//! [`CudaDevice`] implements the allocator's device trait with `cuMemCreate` /
//! `cuMemRelease` (pinned device memory, exportable as POSIX file descriptors where the driver
//! allows it), `cuMemAddressReserve` / `cuMemAddressFree`, `cuMemMap` / `cuMemUnmap`,
//! `cuMemSetAccess` (this device plus peers added with [`CudaDevice::add_peer`]), and events
//! created with `CU_EVENT_DISABLE_TIMING`.
//!
//! The driver is loaded at run time (cudarc's dynamic loading; no CUDA toolkit is needed to
//! build). On a machine without a usable driver, [`CudaDevice::new`] returns
//! [`gmlake_core::DeviceError::Unavailable`]; nothing here panics on a missing library or
//! symbol. All `unsafe` code of the project's CUDA access lives in this crate.
//!
//! CUDA IPC: [`CudaDevice::shared_fd`] exports a page as a POSIX descriptor kept open while
//! the page lives; [`CudaDevice::import_from_process`] imports another process's page through
//! `pidfd_getfd` (module `pidfd`).

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod device;
mod driver;
mod pidfd;

pub use device::{device_count, driver_version, CudaDevice};
pub use gmlake_core::{Device, DeviceError, DeviceResult};
