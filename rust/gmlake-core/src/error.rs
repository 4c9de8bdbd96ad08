//! The allocator's errors. Every failure is a value: nothing on these paths panics.

use crate::device::{DeviceError, DevicePtr};
use std::fmt;

/// Figures carried by an out-of-memory error, so callers can format PyTorch's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomInfo {
    /// Bytes asked for (before rounding).
    pub requested: u64,
    /// Bytes the device reported free when the allocator gave up.
    pub device_free: u64,
    /// Total bytes of the device.
    pub device_total: u64,
    /// Physical bytes this allocator holds.
    pub reserved: u64,
    /// Bytes held by live allocations.
    pub allocated: u64,
    /// Reserved bytes not in use: cached pages that could not be stitched for this request.
    pub cached_free: u64,
    /// The byte limit set by a memory fraction or `limit`, if any.
    pub limit: Option<u64>,
    /// Stitches performed so far.
    pub stitches: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// No memory for the request, even after stitching and returning cached pages.
    OutOfMemory(Box<OomInfo>),
    /// The pointer was already freed.
    DoubleFree(DevicePtr),
    /// The pointer was never returned by this allocator.
    UnknownPointer(DevicePtr),
    /// The request does not fit in the address space or overflows when rounded.
    SizeOverflow(u64),
    /// A configuration value was rejected: names the variable and the value.
    InvalidConfig {
        key: String,
        value: String,
        reason: String,
    },
    /// A call that is not valid in the allocator's current state (e.g. a pool id in use).
    InvalidState(String),
    /// The device failed.
    Device(DeviceError),
    /// An IPC handle (the bytes another process sent) is malformed: says what is wrong.
    InvalidIpcHandle(String),
}

pub type Result<T> = std::result::Result<T, Error>;

fn gib(b: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / GIB)
    } else {
        format!("{:.2} MiB", b as f64 / MIB)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfMemory(i) => {
                write!(
                    f,
                    "Tried to allocate {}. GPU has a total capacity of {} of which {} is free. \
                     Of the memory reserved by the gmlake allocator ({}), {} is allocated and {} is \
                     cached but could not be stitched for this request",
                    gib(i.requested),
                    gib(i.device_total),
                    gib(i.device_free),
                    gib(i.reserved),
                    gib(i.allocated),
                    gib(i.cached_free),
                )?;
                if let Some(l) = i.limit {
                    write!(f, "; the allocator's limit is {}", gib(l))?;
                }
                write!(f, " ({} stitches so far)", i.stitches)
            }
            Error::DoubleFree(p) => write!(f, "double free of device pointer {p:#x}"),
            Error::UnknownPointer(p) => {
                write!(f, "device pointer {p:#x} was not allocated by gmlake")
            }
            Error::SizeOverflow(s) => write!(f, "allocation of {s} bytes is too large"),
            Error::InvalidConfig { key, value, reason } => {
                write!(f, "invalid value {value:?} for {key}: {reason}")
            }
            Error::InvalidState(m) => write!(f, "{m}"),
            Error::Device(e) => write!(f, "device error: {e}"),
            Error::InvalidIpcHandle(m) => write!(f, "invalid CUDA IPC handle: {m}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<DeviceError> for Error {
    fn from(e: DeviceError) -> Self {
        Error::Device(e)
    }
}
