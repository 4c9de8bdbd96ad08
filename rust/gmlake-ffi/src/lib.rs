//! The C++ face of gmlake: a `cxx` bridge exposing one allocator per device
//! ([`gmlake_core::Allocator`] over [`gmlake_cuda::CudaDevice`], or over the simulated device
//! for tests) with plain arguments: pointers, streams and pool ids are integers, so the
//! generated code needs no torch or CUDA headers.
//!
//! Error conventions at the boundary:
//! - every function catches panics (`catch_unwind`): a panic becomes an error, never an abort;
//! - fallible calls return `Result`, thrown in C++ as `rust::Error` with the message;
//! - allocation returns [`ffi::AllocOutcome`], which tells out-of-memory
//!   ([`ffi::AllocStatus::OutOfMemory`], with the figures of PyTorch's message and the core's
//!   own message) from other errors, so C++ can throw `c10::OutOfMemoryError`;
//! - free and record_stream return [`ffi::FreeOutcome`] ([`ffi::FreeStatus`]), so C++ can
//!   tolerate pointers that gmlake never handed out (allocated before the install) without
//!   exceptions on the deleter path;
//! - status, state, action and kind codes are cxx shared enums: C++ reads them by name.

mod backend;
pub mod capture;
mod json;
pub mod tier;

use backend::{make_alloc, Alloc};
use gmlake_core::{
    BlockState, Config, Device, DeviceError, DeviceStats, Error, GraphPoolId, PoolKind, SimDevice,
    StatArray, TraceAction,
};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
pub use tier::GmlakeTier;

pub use backend::PeerAccess;

#[cxx::bridge(namespace = "gmlake::ffi")]
pub mod ffi {
    // Codes both sides read by name (values of their own only where someone else fixed them:
    // PyTorch's actions, the IPC type byte, the tier's C API).

    /// How an allocation ended.
    #[derive(Debug)]
    enum AllocStatus {
        Allocated,
        OutOfMemory,
        /// Any other error (the message says which).
        Failed,
    }

    /// How a free (or record_stream, or clear_stream_uses) ended.
    #[derive(Debug)]
    enum FreeStatus {
        Done,
        /// Not allocated by gmlake (e.g. before the install).
        UnknownPointer,
        DoubleFree,
        /// Any other error (the message says which).
        Failed,
    }

    /// A snapshot block's state, as PyTorch names them.
    #[derive(Debug)]
    enum BlockState {
        ActiveAllocated,
        ActivePendingFree,
        Inactive,
    }

    /// PyTorch's `TraceEntry::Action`, with its names and values (stable since 2.0; C++ uses
    /// it as `gmlake::Action`).
    #[repr(u8)]
    #[derive(Debug)]
    enum TraceAction {
        ALLOC = 0,
        FREE_REQUESTED = 1,
        FREE_COMPLETED = 2,
        SEGMENT_ALLOC = 3,
        SEGMENT_FREE = 4,
        SEGMENT_MAP = 5,
        SEGMENT_UNMAP = 6,
        SNAPSHOT = 7,
        OOM = 8,
    }

    /// The type of an IPC handle: PyTorch's type byte.
    #[repr(u8)]
    #[derive(Debug)]
    enum IpcHandleKind {
        /// b'c': a cudaIpcMemHandle_t, opened by the caller with cudaIpcOpenMemHandle.
        CudaMalloc = 99,
        /// b'e': gmlake's pages (`open_ipc`).
        Pages = 101,
    }

    /// Where a host tier tensor is (`Unknown`: no such tensor).
    #[repr(i32)]
    #[derive(Debug)]
    enum TierState {
        Unknown = -1,
        Resident = 0,
        Put = 1,
        Evicting = 2,
        Evicted = 3,
        Fetching = 4,
    }

    /// What an allocation came to.
    #[derive(Clone, Debug, Default)]
    struct AllocOutcome {
        /// The device pointer (0 for a 0-byte request or a failure).
        ptr: u64,
        status: AllocStatus,
        /// The error's message (empty on success).
        message: String,
        /// Out-of-memory figures (`OutOfMemory`): bytes asked for, device free/total, bytes
        /// reserved and allocated by gmlake, cached bytes that could not be stitched,
        /// the limit (0: none) and stitches so far.
        requested: u64,
        device_free: u64,
        device_total: u64,
        reserved: u64,
        allocated: u64,
        cached_free: u64,
        limit: u64,
        stitches: u64,
    }

    /// What a free (or record_stream) came to.
    #[derive(Clone, Debug, Default)]
    struct FreeOutcome {
        status: FreeStatus,
        message: String,
    }

    /// PyTorch's `Stat`.
    #[derive(Clone, Copy, Debug, Default)]
    struct Stat {
        current: i64,
        peak: i64,
        allocated: i64,
        freed: i64,
    }

    #[derive(Clone, Debug, Default)]
    struct NamedCount {
        name: String,
        count: u64,
    }

    /// PyTorch's `DeviceStats` (StatArrays as aggregate, small pool, large pool), field for
    /// field as `gmlake_core::for_device_stats!` lists them (`to_stats` is generated from that
    /// list, so the compiler checks this one against it), plus gmlake's own counters by name.
    #[derive(Clone, Debug, Default)]
    struct Stats {
        allocation: [Stat; 3],
        segment: [Stat; 3],
        active: [Stat; 3],
        inactive_split: [Stat; 3],
        allocated_bytes: [Stat; 3],
        reserved_bytes: [Stat; 3],
        active_bytes: [Stat; 3],
        inactive_split_bytes: [Stat; 3],
        requested_bytes: [Stat; 3],
        num_alloc_retries: i64,
        num_ooms: i64,
        oversize_allocations: Stat,
        oversize_segments: Stat,
        num_sync_all_streams: i64,
        num_device_alloc: i64,
        num_device_free: i64,
        max_split_size: i64,
        /// gmlake's counters (`stitches`, `pages_stitched`, ...: the statistics' keys
        /// `gmlake.<name>`), in the order of the list.
        counters: Vec<NamedCount>,
        driver_calls_total: u64,
        driver_calls: Vec<NamedCount>,
    }

    /// A block of a snapshot segment.
    #[derive(Clone, Debug)]
    struct BlockRecord {
        address: u64,
        size: u64,
        requested_size: u64,
        state: BlockState,
        stitched: bool,
    }

    #[derive(Clone, Debug, Default)]
    struct SegmentRecord {
        address: u64,
        total_size: u64,
        allocated_size: u64,
        active_size: u64,
        requested_size: u64,
        stream: u64,
        is_large: bool,
        pool_first: u64,
        pool_second: u64,
        stitched: bool,
        pages: u64,
        blocks: Vec<BlockRecord>,
    }

    #[derive(Clone, Debug, Default)]
    struct KeyValue {
        key: String,
        value: String,
    }

    #[derive(Clone, Debug, Default)]
    struct SnapshotRecord {
        segments: Vec<SegmentRecord>,
        page_size: u64,
        config: Vec<KeyValue>,
    }

    #[derive(Clone, Copy, Debug, Default)]
    struct CacheInfoRecord {
        cached_free_bytes: u64,
        largest_free_block: u64,
    }

    /// A live allocation (`found == false`: none contains the pointer).
    #[derive(Clone, Copy, Debug, Default)]
    struct AllocationRecord {
        found: bool,
        ptr: u64,
        size: u64,
        requested: u64,
        stream: u64,
        is_large: bool,
        pool_first: u64,
        pool_second: u64,
    }

    /// A history event.
    #[derive(Clone, Copy, Debug)]
    struct TraceRecord {
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: u64,
    }

    /// An allocation shared for another process: PyTorch's `ShareableHandle`.
    #[derive(Clone, Debug, Default)]
    struct IpcShare {
        /// The bytes to send (PyTorch's layout: version 2, type 'e', pages as descriptors).
        handle: Vec<u8>,
        /// Offset of the shared pointer from the start of the range the receiver maps.
        offset: u64,
    }

    #[derive(Clone, Copy, Debug, Default)]
    struct MemInfo {
        free: u64,
        total: u64,
    }

    /// Host tier settings (`tier.rs`). Zeros mean defaults; `policy`: "aware" (default) or
    /// "lru".
    #[derive(Clone, Debug, Default)]
    struct TierConf {
        has_budget: bool,
        budget: u64,
        policy: String,
        bandwidth: f64,
        copy_latency: f64,
        tick_seconds: f64,
        prefetch_margin: u64,
        host_cache: u64,
    }

    /// A tier tensor on the device: its id, pointer, and whether `get` found it there.
    #[derive(Clone, Copy, Debug, Default)]
    struct TierFetch {
        id: u64,
        ptr: u64,
        hit: bool,
    }

    /// `gmlake_core::TierStats` plus the settings in force.
    #[derive(Clone, Debug, Default)]
    struct TierStatsRecord {
        creates: u64,
        adopts: u64,
        gets: u64,
        hits: u64,
        misses: u64,
        puts: u64,
        frees: u64,
        evictions: u64,
        rescues: u64,
        prefetches: u64,
        bytes_to_host: u64,
        bytes_to_device: u64,
        waits: u64,
        device_bytes: u64,
        peak_device_bytes: u64,
        host_bytes: u64,
        peak_host_bytes: u64,
        host_cached_bytes: u64,
        host_allocs: u64,
        tensors: u64,
        budget: u64,
        has_budget: bool,
        bandwidth: f64,
        policy: String,
    }

    extern "Rust" {
        /// One device's host tier (issue 16), over the allocator that made it (`tier.rs`).
        type GmlakeTier;

        /// A host tier over this allocator (its tensors' device memory comes from it).
        fn new_tier(self: &Gmlake, conf: &TierConf) -> Result<Box<GmlakeTier>>;
        /// Device memory for a new resident tensor of `size` bytes used on `stream`.
        fn create(self: &GmlakeTier, size: u64, stream: u64) -> Result<TierFetch>;
        /// Takes over the live allocation starting at `ptr` (`size` bytes in use, last used on
        /// `stream`) as a resident tensor; returns its id. The tier frees it from now on.
        fn adopt(self: &GmlakeTier, ptr: u64, size: u64, stream: u64) -> Result<u64>;
        /// Not needed now; `next_use` (< 0: none) in the clock of `advance`.
        fn put(self: &GmlakeTier, id: u64, next_use: i64) -> Result<()>;
        /// Declares when a tensor is needed next (< 0: unknown), in any state.
        fn set_next_use(self: &GmlakeTier, id: u64, next_use: i64) -> Result<()>;
        /// Starts evicting a put tensor now.
        fn offload(self: &GmlakeTier, id: u64) -> Result<()>;
        /// Evicts put tensors to make room for an allocation of `bytes` the allocator refused,
        /// waiting for the device; returns the device bytes given back.
        fn relieve(self: &GmlakeTier, bytes: u64) -> Result<u64>;
        /// The tensor on the device, ready for work queued on `stream` after this call.
        fn get(self: &GmlakeTier, id: u64, stream: u64) -> Result<TierFetch>;
        fn free(self: &GmlakeTier, id: u64) -> Result<()>;
        fn advance(self: &GmlakeTier, now: u64) -> Result<()>;
        fn poll(self: &GmlakeTier) -> Result<()>;
        fn flush(self: &GmlakeTier) -> Result<()>;
        fn trim_host_cache(self: &GmlakeTier) -> Result<()>;
        fn reconfigure(self: &GmlakeTier, conf: &TierConf) -> Result<()>;
        fn stats(self: &GmlakeTier) -> TierStatsRecord;
        fn stats_json(self: &GmlakeTier) -> String;
        fn state(self: &GmlakeTier, id: u64) -> TierState;
        fn size(self: &GmlakeTier, id: u64) -> u64;
        fn verify(self: &GmlakeTier) -> Result<()>;
    }

    extern "Rust" {
        /// One device's allocator.
        type Gmlake;

        /// The allocator of CUDA device `device`, configured from the environment
        /// (`GMLAKE_CONF` and GMLake's variables) overridden by `conf` (`key:value,...`).
        fn new_cuda_allocator(device: i32, conf: &str) -> Result<Box<Gmlake>>;
        /// An allocator over a simulated device of `capacity` bytes (`granularity`: page
        /// size, 0 for 2 MiB), configured as above. Nothing can be read or written through
        /// its pointers.
        fn new_simulated_allocator(
            capacity: u64,
            granularity: u64,
            conf: &str,
        ) -> Result<Box<Gmlake>>;
        /// Checks a configuration (environment, then `conf`) without creating anything;
        /// returns the effective settings. Errors name the key and the value.
        fn check_conf(conf: &str) -> Result<Vec<KeyValue>>;
        /// Whether this staticlib was built with the CUDA backend.
        fn has_cuda_backend() -> bool;
        /// The statistics JSON of a device whose allocator was never created (all zero, and
        /// `gmlake.initialized` 0), so readers find every key before the first allocation.
        fn empty_stats_json() -> String;

        /// "cuda" or "simulated".
        fn backend_name(self: &Gmlake) -> String;
        fn device_ordinal(self: &Gmlake) -> i32;

        fn allocate(self: &Gmlake, size: u64, stream: u64) -> AllocOutcome;
        /// Allocates into CUDA graph pool (pool_first, pool_second).
        fn allocate_in_pool(
            self: &Gmlake,
            size: u64,
            stream: u64,
            pool_first: u64,
            pool_second: u64,
        ) -> AllocOutcome;
        /// Places `rounded` bytes for a request of `size` (the caller's rounding: PyTorch's
        /// `roundup_power2_divisions`, or whole pages), in pool (pool_first, pool_second)
        /// when `in_pool`, else in the default pool.
        fn allocate_rounded(
            self: &Gmlake,
            size: u64,
            rounded: u64,
            stream: u64,
            pool_first: u64,
            pool_second: u64,
            in_pool: bool,
        ) -> AllocOutcome;
        /// Forgets the streams a live allocation was recorded on (a CUDA graph capture
        /// proved them ordered before later work of its stream); status as free_ptr's.
        fn clear_stream_uses(self: &Gmlake, ptr: u64) -> FreeOutcome;
        /// The streams a live allocation was recorded on besides its own (empty when none,
        /// or when `ptr` is not a live allocation).
        fn stream_uses(self: &Gmlake, ptr: u64) -> Vec<u64>;
        /// Makes [ptr, ptr + size) a live allocation of pool (pool_first, pool_second) again
        /// (a CUDA graph tree checkpoint restore); the range must be free and mapped there.
        fn allocate_at(
            self: &Gmlake,
            ptr: u64,
            size: u64,
            requested: u64,
            stream: u64,
            pool_first: u64,
            pool_second: u64,
        ) -> Result<()>;
        fn free_ptr(self: &Gmlake, ptr: u64) -> FreeOutcome;
        fn record_stream(self: &Gmlake, ptr: u64, stream: u64) -> FreeOutcome;
        fn empty_cache(self: &Gmlake) -> Result<()>;
        fn set_memory_fraction(self: &Gmlake, fraction: f64) -> Result<()>;
        /// The memory fraction, or a negative number when none is set.
        fn memory_fraction(self: &Gmlake) -> Result<f64>;
        /// Caps reserved memory at `bytes` (0: no cap).
        fn set_limit(self: &Gmlake, bytes: u64) -> Result<()>;
        fn release_pool(self: &Gmlake, pool_first: u64, pool_second: u64) -> Result<()>;
        fn stats(self: &Gmlake) -> Result<Stats>;
        fn stats_json(self: &Gmlake) -> Result<String>;
        fn reset_peak_stats(self: &Gmlake) -> Result<()>;
        fn reset_accumulated_stats(self: &Gmlake) -> Result<()>;
        fn snapshot(self: &Gmlake) -> Result<SnapshotRecord>;
        fn snapshot_json(self: &Gmlake) -> Result<String>;
        fn cache_info(self: &Gmlake) -> Result<CacheInfoRecord>;
        fn allocation(self: &Gmlake, ptr: u64) -> Result<AllocationRecord>;
        /// Keeps up to `capacity` history events in the core (0: off).
        fn set_history(self: &Gmlake, capacity: usize) -> Result<()>;
        fn take_history(self: &Gmlake) -> Result<Vec<TraceRecord>>;
        fn page_size(self: &Gmlake) -> Result<u64>;
        fn config(self: &Gmlake) -> Result<Vec<KeyValue>>;
        /// The memory debugging mode: bit 0 guard pages, 1 canaries, 2 poison, 3 quarantine,
        /// 4 front guard pages; 0 when off.
        fn debug_mode(self: &Gmlake) -> Result<u32>;
        /// Debug mode: a damaged canary was found (counted in the stats, logged through
        /// `tracing` with `report`).
        fn debug_canary_error(self: &Gmlake, report: &str) -> Result<()>;
        /// Whether requests of `size` bytes may be stitched under the configuration.
        fn may_stitch(self: &Gmlake, size: u64) -> Result<bool>;
        fn memory_info(self: &Gmlake) -> Result<MemInfo>;
        /// A CUDA graph capture (or another routing of allocations into pool
        /// (pool_first, pool_second)) begins / ends on this device: the core keeps the pool
        /// alive and defers event work meanwhile, and so does the device below it (see
        /// `capture.rs`).
        fn begin_capture(self: &Gmlake, pool_first: u64, pool_second: u64) -> Result<()>;
        fn end_capture(self: &Gmlake, pool_first: u64, pool_second: u64) -> Result<()>;
        /// The cap on reserved bytes in force (memory fraction or limit), 0 for none.
        fn limit(self: &Gmlake) -> Result<u64>;
        /// Bytes reserved now (the statistics' `reserved_bytes.all.current`), without building
        /// the whole statistics record.
        fn reserved_bytes(self: &Gmlake) -> Result<u64>;
        /// Grants device `peer` access to this device's memory, present and future.
        fn add_peer(self: &Gmlake, peer: i32) -> Result<()>;

        /// The type of an IPC handle, after checking it.
        fn ipc_handle_kind(handle: &[u8]) -> Result<IpcHandleKind>;
        /// Shares the live allocation containing `ptr` with other processes.
        fn share_ipc(self: &Gmlake, ptr: u64) -> Result<IpcShare>;
        /// Maps the pages of a page handle of another process; returns the range's address.
        fn open_ipc(self: &Gmlake, handle: &[u8]) -> Result<u64>;
        /// Closes a range made by `open_ipc`, ordered on `stream` (the deleter's current
        /// stream): it is unmapped once the work queued there before the close has completed,
        /// by a later call (nothing waits here).
        fn close_ipc(self: &Gmlake, ptr: u64, stream: u64) -> Result<()>;
    }
}

use ffi::{
    AllocOutcome, AllocStatus, AllocationRecord, BlockRecord, CacheInfoRecord, FreeOutcome,
    FreeStatus, IpcHandleKind, IpcShare, KeyValue, MemInfo, NamedCount, SegmentRecord,
    SnapshotRecord, Stats, TraceRecord,
};

/// One device's allocator, as C++ holds it.
pub struct Gmlake {
    alloc: std::sync::Arc<Alloc>,
    ordinal: i32,
    backend: &'static str,
    /// `host_timing`: time spent in allocations and frees, when on.
    timing: Option<HostTiming>,
}

/// Nanoseconds spent in the core's allocate and free calls, and how many were timed
/// (`host_timing`), and the slowest calls with when they began. Relaxed atomics: totals read
/// now and then, never ordered against anything.
struct HostTiming {
    alloc_ns: AtomicU64,
    alloc_calls: AtomicU64,
    free_ns: AtomicU64,
    free_calls: AtomicU64,
    /// A monotonic instant and the Unix time read together at creation: a slow call's start
    /// in Unix time (to place it on a profiler's timeline) without a second clock read a call.
    origin: (std::time::Instant, u64),
    /// The last `SLOW_CALLS_KEPT` calls that took at least `SLOW_CALL_NS`, oldest first.
    slow: parking_lot::Mutex<std::collections::VecDeque<json::SlowCall>>,
}

/// A call this long or longer is kept in `HostTiming::slow`: a stitch or new memory (driver
/// calls), not a hit of the cache (about a microsecond).
const SLOW_CALL_NS: u64 = 50_000;
/// How many slow calls are kept (about a minute of a job that stitches every step).
const SLOW_CALLS_KEPT: usize = 1 << 16;

impl HostTiming {
    fn for_config(c: &Config) -> Option<HostTiming> {
        c.host_timing.then(|| {
            let unix_ns = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            HostTiming {
                alloc_ns: AtomicU64::new(0),
                alloc_calls: AtomicU64::new(0),
                free_ns: AtomicU64::new(0),
                free_calls: AtomicU64::new(0),
                origin: (std::time::Instant::now(), unix_ns),
                slow: parking_lot::Mutex::new(std::collections::VecDeque::new()),
            }
        })
    }

    /// Runs `f`, adding its time to `(ns, calls)` of `timing` when there is one, and keeping
    /// it among the slow calls if it took `SLOW_CALL_NS` or more (`size`: the request's bytes,
    /// 0 for a free).
    fn time<T>(timing: Option<&HostTiming>, alloc: bool, size: u64, f: impl FnOnce() -> T) -> T {
        let Some(t) = timing else {
            return f();
        };
        gmlake_core::calltime::reset();
        let t0 = std::time::Instant::now();
        let out = f();
        let ns = t0.elapsed().as_nanos() as u64;
        let time = gmlake_core::calltime::take();
        let (total, calls) = if alloc {
            (&t.alloc_ns, &t.alloc_calls)
        } else {
            (&t.free_ns, &t.free_calls)
        };
        total.fetch_add(ns, Ordering::Relaxed);
        calls.fetch_add(1, Ordering::Relaxed);
        if ns >= SLOW_CALL_NS {
            let since = t0.saturating_duration_since(t.origin.0).as_nanos() as u64;
            let mut slow = t.slow.lock();
            if slow.len() == SLOW_CALLS_KEPT {
                slow.pop_front();
            }
            slow.push_back(json::SlowCall {
                start_unix_ns: t.origin.1 + since,
                ns,
                alloc,
                size,
                time,
            });
        }
        out
    }

    /// The slow calls kept, oldest first.
    fn slow_calls(&self) -> Vec<json::SlowCall> {
        self.slow.lock().iter().copied().collect()
    }

    /// The `gmlake.host_*` entries of `memory_stats()`.
    fn entries(&self) -> [(&'static str, u64); 4] {
        [
            ("host_ns_alloc", self.alloc_ns.load(Ordering::Relaxed)),
            ("host_calls_alloc", self.alloc_calls.load(Ordering::Relaxed)),
            ("host_ns_free", self.free_ns.load(Ordering::Relaxed)),
            ("host_calls_free", self.free_calls.load(Ordering::Relaxed)),
        ]
    }
}

/// The message of a panic payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// Runs `f`, turning a panic into an error message.
fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(format!(
            "gmlake: internal error (panic) in {what}: {}",
            panic_message(p.as_ref())
        )),
    }
}

fn config_from(conf: &str) -> Result<Config, String> {
    let mut c = Config::from_env().map_err(|e| format!("gmlake configuration: {e}"))?;
    c.apply_conf(conf)
        .map_err(|e| format!("gmlake configuration: {e}"))?;
    Ok(c)
}

fn pairs(c: &Config) -> Vec<KeyValue> {
    c.to_pairs()
        .into_iter()
        .map(|(k, v)| KeyValue {
            key: k.to_string(),
            value: v,
        })
        .collect()
}

fn new_cuda_allocator(device: i32, conf: &str) -> Result<Box<Gmlake>, String> {
    guard("new_cuda_allocator", || {
        let config = config_from(conf)?;
        let timing = HostTiming::for_config(&config);
        new_cuda_alloc(device, config).map(|alloc| {
            Box::new(Gmlake {
                alloc,
                ordinal: device,
                backend: "cuda",
                timing,
            })
        })
    })
}

#[cfg(feature = "cuda")]
fn new_cuda_alloc(device: i32, config: Config) -> Result<std::sync::Arc<Alloc>, String> {
    let dev = gmlake_cuda::CudaDevice::new(device)
        .map_err(|e| format!("gmlake: cannot open CUDA device {device}: {e}"))?;
    make_alloc(dev, config)
        .map_err(|e| format!("gmlake: cannot create the allocator of CUDA device {device}: {e}"))
}

#[cfg(not(feature = "cuda"))]
fn new_cuda_alloc(device: i32, _config: Config) -> Result<std::sync::Arc<Alloc>, String> {
    Err(format!(
        "gmlake: this build has no CUDA backend (gmlake-ffi built without the `cuda` feature); \
         cannot open CUDA device {device}"
    ))
}

fn new_simulated_allocator(
    capacity: u64,
    granularity: u64,
    conf: &str,
) -> Result<Box<Gmlake>, String> {
    guard("new_simulated_allocator", || {
        if granularity != 0 && !granularity.is_power_of_two() {
            return Err(format!(
                "gmlake: simulated device granularity {granularity} is not a power of two"
            ));
        }
        let config = config_from(conf)?;
        let dev = if granularity == 0 {
            SimDevice::new(capacity)
        } else {
            SimDevice::with_granularity(capacity, granularity)
        };
        let timing = HostTiming::for_config(&config);
        let alloc = make_alloc(dev, config)
            .map_err(|e| format!("gmlake: cannot create the simulated allocator: {e}"))?;
        Ok(Box::new(Gmlake {
            alloc,
            ordinal: -1,
            backend: "simulated",
            timing,
        }))
    })
}

fn check_conf(conf: &str) -> Result<Vec<KeyValue>, String> {
    guard("check_conf", || config_from(conf).map(|c| pairs(&c)))
}

fn has_cuda_backend() -> bool {
    cfg!(feature = "cuda")
}

/// A field of `DeviceStats` as the bridge's [`Stats`] has it.
trait ToFfi {
    type Out;
    fn to_ffi(&self) -> Self::Out;
}

impl ToFfi for gmlake_core::Stat {
    type Out = ffi::Stat;
    fn to_ffi(&self) -> ffi::Stat {
        ffi::Stat {
            current: self.current,
            peak: self.peak,
            allocated: self.allocated,
            freed: self.freed,
        }
    }
}

impl ToFfi for StatArray {
    type Out = [ffi::Stat; 3];
    fn to_ffi(&self) -> [ffi::Stat; 3] {
        self.0.map(|s| s.to_ffi())
    }
}

impl ToFfi for i64 {
    type Out = i64;
    fn to_ffi(&self) -> i64 {
        *self
    }
}

fn named(pairs: &[(&str, u64)]) -> Vec<NamedCount> {
    pairs
        .iter()
        .map(|&(name, count)| NamedCount {
            name: name.to_string(),
            count,
        })
        .collect()
}

macro_rules! define_to_stats {
    (
        torch { $( $(#[$tdoc:meta])* $t:ident : $tty:ty = $treset:ident, )* }
        gmlake { $($rest:tt)* }
    ) => {
        fn to_stats(s: &DeviceStats) -> Stats {
            Stats {
                $( $t: s.$t.to_ffi(), )*
                counters: named(&s.counters()),
                driver_calls_total: s.driver_calls.total(),
                driver_calls: named(&s.driver_calls.as_pairs()),
            }
        }
    };
}
gmlake_core::for_device_stats!(define_to_stats);

impl Stats {
    /// One of gmlake's counters by name (0 when there is none of that name).
    pub fn counter(&self, name: &str) -> u64 {
        self.counters
            .iter()
            .find(|c| c.name == name)
            .map_or(0, |c| c.count)
    }
}

fn block_state(s: BlockState) -> ffi::BlockState {
    match s {
        BlockState::ActiveAllocated => ffi::BlockState::ActiveAllocated,
        BlockState::ActivePendingFree => ffi::BlockState::ActivePendingFree,
        BlockState::Inactive => ffi::BlockState::Inactive,
    }
}

fn trace_action(a: TraceAction) -> ffi::TraceAction {
    match a {
        TraceAction::Alloc => ffi::TraceAction::ALLOC,
        TraceAction::FreeRequested => ffi::TraceAction::FREE_REQUESTED,
        TraceAction::FreeCompleted => ffi::TraceAction::FREE_COMPLETED,
        TraceAction::SegmentAlloc => ffi::TraceAction::SEGMENT_ALLOC,
        TraceAction::SegmentFree => ffi::TraceAction::SEGMENT_FREE,
        TraceAction::SegmentMap => ffi::TraceAction::SEGMENT_MAP,
        TraceAction::SegmentUnmap => ffi::TraceAction::SEGMENT_UNMAP,
        TraceAction::Oom => ffi::TraceAction::OOM,
    }
}

// Outcomes start as successes (`..AllocOutcome::default()`).
impl Default for AllocStatus {
    fn default() -> Self {
        AllocStatus::Allocated
    }
}
impl Default for FreeStatus {
    fn default() -> Self {
        FreeStatus::Done
    }
}

fn to_snapshot(s: &gmlake_core::Snapshot) -> SnapshotRecord {
    SnapshotRecord {
        segments: s
            .segments
            .iter()
            .map(|seg| SegmentRecord {
                address: seg.address,
                total_size: seg.total_size,
                allocated_size: seg.allocated_size,
                active_size: seg.active_size,
                requested_size: seg.requested_size,
                stream: seg.stream,
                is_large: seg.pool == PoolKind::Large,
                pool_first: seg.graph_pool.0,
                pool_second: seg.graph_pool.1,
                stitched: seg.stitched,
                pages: seg.pages,
                blocks: seg
                    .blocks
                    .iter()
                    .map(|b| BlockRecord {
                        address: b.address,
                        size: b.size,
                        requested_size: b.requested_size,
                        state: block_state(b.state),
                        stitched: b.stitched,
                    })
                    .collect(),
            })
            .collect(),
        page_size: s.page_size,
        config: s
            .config
            .iter()
            .map(|(k, v)| KeyValue {
                key: k.to_string(),
                value: v.clone(),
            })
            .collect(),
    }
}

fn oom_outcome(e: &Error, requested: u64, a: &Alloc) -> AllocOutcome {
    match e {
        Error::OutOfMemory(i) => AllocOutcome {
            ptr: 0,
            status: AllocStatus::OutOfMemory,
            message: e.to_string(),
            requested: i.requested,
            device_free: i.device_free,
            device_total: i.device_total,
            reserved: i.reserved,
            allocated: i.allocated,
            cached_free: i.cached_free,
            limit: i.limit.unwrap_or(0),
            stitches: i.stitches,
        },
        // A device OOM that reached us unconverted: report it as OOM with what we can read.
        _ => {
            let s = a.stats();
            AllocOutcome {
                ptr: 0,
                status: AllocStatus::OutOfMemory,
                message: format!("Tried to allocate {requested} bytes: {e}"),
                requested,
                device_free: a.device().free_memory().unwrap_or(0) as u64,
                device_total: a.device().total_memory().unwrap_or(0) as u64,
                reserved: s.reserved_bytes.aggregate().current.max(0) as u64,
                allocated: s.allocated_bytes.aggregate().current.max(0) as u64,
                cached_free: s.cached_bytes,
                limit: 0,
                stitches: s.stitches,
            }
        }
    }
}

fn is_oom(e: &Error) -> bool {
    matches!(
        e,
        Error::OutOfMemory(_) | Error::Device(DeviceError::OutOfMemory)
    )
}

fn free_outcome(r: Result<gmlake_core::Result<()>, String>) -> FreeOutcome {
    match r {
        Ok(Ok(())) => FreeOutcome::default(),
        Ok(Err(e)) => FreeOutcome {
            status: match e {
                Error::UnknownPointer(_) => FreeStatus::UnknownPointer,
                Error::DoubleFree(_) => FreeStatus::DoubleFree,
                _ => FreeStatus::Failed,
            },
            message: e.to_string(),
        },
        Err(panic) => FreeOutcome {
            status: FreeStatus::Failed,
            message: panic,
        },
    }
}

fn core_err(e: impl std::fmt::Display) -> String {
    format!("gmlake: {e}")
}

fn pool(first: u64, second: u64) -> GraphPoolId {
    GraphPoolId(first, second)
}

/// Each bridge operation is one call of [`Gmlake::with`] (or of `alloc_with` / `free_with`
/// for the outcomes C++ reads without exceptions) on the allocator itself.
impl Gmlake {
    /// Runs `f` on the allocator: a panic or an error becomes the message C++ throws.
    fn with<T>(
        &self,
        what: &str,
        f: impl FnOnce(&Alloc) -> gmlake_core::Result<T>,
    ) -> Result<T, String> {
        guard(what, || f(&self.alloc).map_err(core_err))
    }

    /// Runs an allocation: out of memory and other errors told apart, never thrown.
    fn alloc_with(
        &self,
        size: u64,
        f: impl FnOnce(&Alloc) -> gmlake_core::Result<u64>,
    ) -> AllocOutcome {
        let a = &*self.alloc;
        let done = HostTiming::time(self.timing.as_ref(), true, size, || {
            guard("allocate", || Ok(f(a)))
        });
        if a.has_notices() {
            self.print_notices();
        }
        match done {
            Ok(Ok(ptr)) => AllocOutcome {
                ptr,
                ..AllocOutcome::default()
            },
            Ok(Err(e)) if is_oom(&e) => {
                // Reading figures may itself panic if the core is broken: guard it too.
                guard("allocate (out of memory report)", || {
                    Ok(oom_outcome(&e, size, a))
                })
                .unwrap_or_else(|m| AllocOutcome {
                    status: AllocStatus::OutOfMemory,
                    message: format!("{e} ({m})"),
                    requested: size,
                    ..AllocOutcome::default()
                })
            }
            Ok(Err(e)) => AllocOutcome {
                status: AllocStatus::Failed,
                message: core_err(e),
                requested: size,
                ..AllocOutcome::default()
            },
            Err(panic) => AllocOutcome {
                status: AllocStatus::Failed,
                message: panic,
                requested: size,
                ..AllocOutcome::default()
            },
        }
    }

    /// Prints the core's notices (`Allocator::take_notices`, e.g. the driver-share watch's)
    /// to stderr, as the C++ side's once-logged warnings are; a failed write is ignored
    /// (reporting must never fail an allocation).
    fn print_notices(&self) {
        use std::io::Write;
        let notices = guard("notices", || Ok(self.alloc.take_notices())).unwrap_or_default();
        let mut err = std::io::stderr().lock();
        for n in notices {
            let _ = writeln!(err, "[gmlake] device {}: {n}", self.ordinal);
        }
    }

    /// Runs a free-like call: unknown pointers and double frees told apart, never thrown.
    fn free_with(
        &self,
        what: &str,
        f: impl FnOnce(&Alloc) -> gmlake_core::Result<()>,
    ) -> FreeOutcome {
        free_outcome(guard(what, || Ok(f(&self.alloc))))
    }

    fn backend_name(&self) -> String {
        self.backend.to_string()
    }

    fn device_ordinal(&self) -> i32 {
        self.ordinal
    }

    fn allocate(&self, size: u64, stream: u64) -> AllocOutcome {
        self.alloc_with(size, |a| a.allocate(size, stream))
    }

    fn allocate_in_pool(&self, size: u64, stream: u64, first: u64, second: u64) -> AllocOutcome {
        self.alloc_with(size, |a| a.allocate_in(size, stream, pool(first, second)))
    }

    fn allocate_rounded(
        &self,
        size: u64,
        rounded: u64,
        stream: u64,
        first: u64,
        second: u64,
        in_pool: bool,
    ) -> AllocOutcome {
        let p = if in_pool {
            pool(first, second)
        } else {
            GraphPoolId::DEFAULT
        };
        self.alloc_with(size, |a| a.allocate_rounded(size, rounded, stream, p))
    }

    fn stream_uses(&self, ptr: u64) -> Vec<u64> {
        self.with("stream_uses", |a| {
            Ok(a.stream_uses(ptr).unwrap_or_default())
        })
        .unwrap_or_default()
    }

    fn clear_stream_uses(&self, ptr: u64) -> FreeOutcome {
        self.free_with("clear_stream_uses", |a| a.clear_stream_uses(ptr))
    }

    fn allocate_at(
        &self,
        ptr: u64,
        size: u64,
        requested: u64,
        stream: u64,
        first: u64,
        second: u64,
    ) -> Result<(), String> {
        self.with("allocate_at", |a| {
            a.allocate_at(ptr, size, requested, stream, pool(first, second))
        })
    }

    fn free_ptr(&self, ptr: u64) -> FreeOutcome {
        HostTiming::time(self.timing.as_ref(), false, 0, || {
            self.free_with("free", |a| a.free(ptr))
        })
    }

    fn record_stream(&self, ptr: u64, stream: u64) -> FreeOutcome {
        self.free_with("record_stream", |a| a.record_stream(ptr, stream))
    }

    fn empty_cache(&self) -> Result<(), String> {
        self.with("empty_cache", |a| a.empty_cache())
    }

    fn set_memory_fraction(&self, fraction: f64) -> Result<(), String> {
        self.with("set_memory_fraction", |a| a.set_memory_fraction(fraction))
    }

    fn memory_fraction(&self) -> Result<f64, String> {
        self.with("memory_fraction", |a| {
            Ok(a.memory_fraction().unwrap_or(-1.0))
        })
    }

    fn set_limit(&self, bytes: u64) -> Result<(), String> {
        self.with("set_limit", |a| {
            a.set_limit((bytes != 0).then_some(bytes));
            Ok(())
        })
    }

    fn release_pool(&self, first: u64, second: u64) -> Result<(), String> {
        self.with("release_pool", |a| a.release_pool(pool(first, second)))
    }

    fn stats(&self) -> Result<Stats, String> {
        self.with("stats", |a| Ok(to_stats(&a.stats())))
    }

    fn stats_json(&self) -> Result<String, String> {
        self.with("stats_json", |a| {
            let s = a.stats();
            // No device_free here: cuMemGetInfo was seen blocking the host until the GPU was
            // idle (H100, driver 580), and statistics are read in training loops.
            let mut extra = vec![("initialized", 1)];
            if let Ok(t) = a.device().total_memory() {
                extra.push(("device_total", t as u64));
            }
            extra.push(("page_size", a.page_size()));
            // The largest free mapped block (what one request can get without stitching or
            // new memory): for fragmentation metrics.
            extra.push(("largest_free_block", a.cache_info().largest_free_block));
            if let Some(t) = &self.timing {
                extra.extend(t.entries());
            }
            Ok(json::stats(&s, &extra))
        })
    }

    fn reset_peak_stats(&self) -> Result<(), String> {
        self.with("reset_peak_stats", |a| {
            a.reset_peak_stats();
            Ok(())
        })
    }

    fn reset_accumulated_stats(&self) -> Result<(), String> {
        self.with("reset_accumulated_stats", |a| {
            a.reset_accumulated_stats();
            Ok(())
        })
    }

    fn snapshot(&self) -> Result<SnapshotRecord, String> {
        self.with("snapshot", |a| Ok(to_snapshot(&a.snapshot())))
    }

    fn snapshot_json(&self) -> Result<String, String> {
        let slow = self
            .timing
            .as_ref()
            .map(HostTiming::slow_calls)
            .unwrap_or_default();
        self.with("snapshot_json", |a| {
            Ok(json::snapshot(&a.snapshot(), &slow))
        })
    }

    fn cache_info(&self) -> Result<CacheInfoRecord, String> {
        self.with("cache_info", |a| {
            let c = a.cache_info();
            Ok(CacheInfoRecord {
                cached_free_bytes: c.cached_free_bytes,
                largest_free_block: c.largest_free_block,
            })
        })
    }

    fn allocation(&self, ptr: u64) -> Result<AllocationRecord, String> {
        self.with("allocation", |a| {
            Ok(match a.allocation(ptr) {
                Some(a) => AllocationRecord {
                    ptr: a.ptr,
                    size: a.size,
                    requested: a.requested,
                    stream: a.stream,
                    found: true,
                    pool_first: a.graph_pool.0,
                    pool_second: a.graph_pool.1,
                    is_large: a.pool == PoolKind::Large,
                },
                None => AllocationRecord::default(),
            })
        })
    }

    fn set_history(&self, capacity: usize) -> Result<(), String> {
        self.with("set_history", |a| {
            a.set_history(capacity);
            Ok(())
        })
    }

    fn take_history(&self) -> Result<Vec<TraceRecord>, String> {
        self.with("take_history", |a| {
            Ok(a.take_history()
                .into_iter()
                .map(|e| TraceRecord {
                    action: trace_action(e.action),
                    addr: e.addr,
                    size: e.size,
                    stream: e.stream,
                })
                .collect())
        })
    }

    fn page_size(&self) -> Result<u64, String> {
        self.with("page_size", |a| Ok(a.page_size()))
    }

    fn config(&self) -> Result<Vec<KeyValue>, String> {
        self.with("config", |a| Ok(pairs(&a.config())))
    }

    fn debug_mode(&self) -> Result<u32, String> {
        self.with("debug_mode", |a| Ok(a.config().debug.mode_bits()))
    }

    fn debug_canary_error(&self, report: &str) -> Result<(), String> {
        self.with("debug_canary_error", |a| {
            a.debug_note_canary_error();
            tracing::error!(device = self.ordinal, "gmlake debug: {report}");
            Ok(())
        })
    }

    fn may_stitch(&self, size: u64) -> Result<bool, String> {
        self.with("may_stitch", |a| {
            let c = a.config();
            Ok(c.vmm_defragment && c.defrag_level < 5 && size >= c.frag_limit)
        })
    }

    fn memory_info(&self) -> Result<MemInfo, String> {
        self.with("memory_info", |a| {
            let free = a.device().free_memory()? as u64;
            let total = a.device().total_memory()? as u64;
            Ok(MemInfo { free, total })
        })
    }

    fn begin_capture(&self, first: u64, second: u64) -> Result<(), String> {
        self.with("begin_capture", |a| {
            backend::begin_capture(a, pool(first, second));
            Ok(())
        })
    }

    fn end_capture(&self, first: u64, second: u64) -> Result<(), String> {
        self.with("end_capture", |a| {
            backend::end_capture(a, pool(first, second))
        })
    }

    fn limit(&self) -> Result<u64, String> {
        self.with("limit", |a| Ok(a.limit().unwrap_or(0)))
    }

    fn reserved_bytes(&self) -> Result<u64, String> {
        self.with("reserved_bytes", |a| {
            Ok(a.stats().reserved_bytes.aggregate().current.max(0) as u64)
        })
    }

    fn add_peer(&self, peer: i32) -> Result<(), String> {
        self.with("add_peer", |a| backend::add_peer(a, peer))
    }

    fn share_ipc(&self, ptr: u64) -> Result<IpcShare, String> {
        self.with("share_ipc", |a| {
            let (handle, offset) = backend::share_ipc(a, ptr)?;
            Ok(IpcShare { handle, offset })
        })
    }

    fn open_ipc(&self, handle: &[u8]) -> Result<u64, String> {
        self.with("open_ipc", |a| backend::open_ipc(a, handle))
    }

    fn close_ipc(&self, ptr: u64, stream: u64) -> Result<(), String> {
        self.with("close_ipc", |a| a.close_imported(ptr, stream))
    }
}
fn empty_stats_json() -> String {
    json::stats(
        &DeviceStats::default(),
        &[("initialized", 0), ("largest_free_block", 0)],
    )
}

fn ipc_handle_kind(handle: &[u8]) -> Result<IpcHandleKind, String> {
    guard("ipc_handle_kind", || {
        match gmlake_core::ipc::decode(handle).map_err(core_err)? {
            gmlake_core::IpcHandle::CudaMalloc(_) => Ok(IpcHandleKind::CudaMalloc),
            gmlake_core::IpcHandle::Pages { .. } => Ok(IpcHandleKind::Pages),
        }
    })
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;
