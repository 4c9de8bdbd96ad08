//! Replaying one device's events through an allocator, measuring as it goes: the trace's
//! active bytes, the physical memory our allocator holds, and the native allocator's reserved
//! memory from the trace's segment events.

use crate::call_times::{timed, CallTimes};
use crate::clock::thread_cpu_time;
use crate::native::NativeMeter;
use crate::series::Series;
use crate::trace::{Action, DeviceTrace, Event};
use gmlake_core::{
    Allocator, Config, DeviceError, DevicePtr, DriverCalls, Error as CoreError, SimDevice, StreamId,
};
use rustc_hash::FxHashMap;
use std::fmt;
use std::time::Instant;

/// What the replay drives: our allocator on a simulated device, or nothing at all.
pub trait Backend {
    /// Serves an allocation of the trace.
    fn allocate(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, CoreError>;
    /// Frees a pointer `allocate` returned.
    fn free(&mut self, ptr: DevicePtr) -> Result<(), CoreError>;
    /// Physical bytes held right now (must be O(1): it is read after every allocator call).
    fn reserved_bytes(&self) -> u64;
    /// Driver calls made so far, for a backend that makes any.
    fn driver_calls(&self) -> Option<DriverCalls> {
        None
    }
    /// What the stitcher has done so far, for a backend that stitches.
    fn stitch_counts(&self) -> Option<StitchCounts> {
        None
    }
    /// Frees `ptr` behind work on `waiter` that has not completed yet (its block may be
    /// reused only once [`Backend::complete`] says that work is done).
    fn free_after(&mut self, ptr: DevicePtr, _waiter: StreamId) -> Result<(), CoreError> {
        self.free(ptr)
    }
    /// The work queued on `waiter` has completed.
    fn complete(&mut self, _waiter: StreamId) {}
    /// The next trace event begins: work queued on the job's streams before it has completed
    /// (for a backend that models it as pending until then).
    fn settle(&mut self) {}
    /// Where the held memory sits now (`--waste-at-peak`), for a backend that can say.
    fn waste(&self) -> Option<crate::waste::Waste> {
        None
    }
    /// Starts logging the allocations that take no kept window (`--misses`), for a backend
    /// that stitches.
    fn log_misses(&mut self) {}
    /// The misses logged since the last call.
    fn take_misses(&mut self) -> Vec<gmlake_core::MissRecord> {
        Vec::new()
    }
}

/// The stitcher's counters (accumulated counters of gmlake's statistics) that `--windows`
/// splits per window: which decisions made a window's driver calls (new stitches map every
/// page they move; reuses of kept ranges map only the aliases they replace).
pub const WINDOW_COUNTERS: [&str; 6] = [
    "stitches",
    "pages_stitched",
    "stitch_reuses",
    "pages_reused",
    "aliases_replaced",
    "alias_evictions",
];

/// The values of [`WINDOW_COUNTERS`], in that order (cumulative).
pub type StitchCounts = [u64; WINDOW_COUNTERS.len()];

/// (events so far, driver calls so far, stitch counters so far) at the end of a window.
pub type WindowSnapshot = (usize, DriverCalls, StitchCounts);

/// The allocator's miss log holds this many (`--misses`): the replay takes them after every
/// allocation, so one is enough; a margin all the same.
const MISS_LOG_CAPACITY: usize = 64;

/// Streams the replay gives to frees that wait (`--deferred-frees`): far above any stream id
/// of a trace (those are CUDA stream pointers).
pub const WAITER_STREAMS: StreamId = 1 << 62;

/// The GMLake allocator on a simulated device.
pub struct SimBackend {
    allocator: Allocator<SimDevice>,
    /// Events recorded on the job's streams stay pending until the next trace event.
    busy: bool,
}

/// Our allocator's figures after a replay.
#[derive(Clone, Debug, PartialEq)]
pub struct OursSummary {
    /// Peak physical bytes: the larger of the device's figure sampled after every event and
    /// the allocator's own `reserved_bytes` peak (which also sees peaks inside one call).
    pub peak_reserved_bytes: u64,
    pub stitches: u64,
    pub pages_stitched: u64,
    pub driver_calls: DriverCalls,
    /// The configuration used, as `key:value` pairs.
    pub config: Vec<(&'static str, String)>,
    /// `page_upgrade_at` set: whether the upgrade happened, the page new memory got at the
    /// end, and the smaller pages given back since.
    pub page_upgrade: Option<PageUpgrade>,
}

/// What the page-size upgrade did in a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PageUpgrade {
    pub upgraded: bool,
    pub page_size: u64,
    pub pages_drained: u64,
}

impl SimBackend {
    /// An allocator with `config` on a simulated device of `capacity` bytes.
    /// Events the allocator records on the job's streams complete at once.
    pub fn new(capacity: u64, config: Config) -> Result<SimBackend, CoreError> {
        Ok(SimBackend {
            allocator: Allocator::new(
                SimDevice::new(capacity).pending_from(WAITER_STREAMS),
                config,
            )?,
            busy: false,
        })
    }

    /// As [`SimBackend::new`], but an event the allocator records on one of the job's side
    /// streams (any but the default stream, 0) is still pending within the trace event that
    /// recorded it, and complete at the next: a collective's stream is busy when the
    /// allocator looks (a fence recorded during a miss is not complete at that miss), and
    /// catches up between the host's calls. The default stream's events complete at once, as
    /// in [`SimBackend::new`].
    pub fn busy_side_streams(capacity: u64, config: Config) -> Result<SimBackend, CoreError> {
        Ok(SimBackend {
            allocator: Allocator::new(SimDevice::new(capacity).pending_from(1), config)?,
            busy: true,
        })
    }

    /// The allocator's page size.
    pub fn page_size(&self) -> u64 {
        self.allocator.page_size()
    }

    /// The allocator's counters; `sampled_peak` is the replay's own peak of `reserved_bytes`.
    pub fn summary(&self, sampled_peak: u64) -> OursSummary {
        let stats = self.allocator.stats();
        let stats_peak = u64::try_from(stats.reserved_bytes.aggregate().peak).unwrap_or(0);
        OursSummary {
            peak_reserved_bytes: sampled_peak.max(stats_peak),
            stitches: stats.stitches,
            pages_stitched: stats.pages_stitched,
            driver_calls: stats.driver_calls,
            config: self.allocator.config().to_pairs(),
            page_upgrade: self
                .allocator
                .config()
                .page_upgrade_at
                .map(|_| PageUpgrade {
                    upgraded: stats.page_upgrades > 0,
                    page_size: self.allocator.page_size(),
                    pages_drained: stats.pages_drained,
                }),
        }
    }
}

impl Backend for SimBackend {
    #[inline]
    fn allocate(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, CoreError> {
        self.allocator.allocate(size, stream)
    }
    #[inline]
    fn free(&mut self, ptr: DevicePtr) -> Result<(), CoreError> {
        self.allocator.free(ptr)
    }
    #[inline]
    fn reserved_bytes(&self) -> u64 {
        self.allocator.device().physical_bytes()
    }
    fn driver_calls(&self) -> Option<DriverCalls> {
        Some(self.allocator.stats().driver_calls)
    }
    fn stitch_counts(&self) -> Option<StitchCounts> {
        let counters = self.allocator.stats().counters();
        let value = |name| counters.iter().find(|c| c.0 == name).map_or(0, |c| c.1);
        Some(WINDOW_COUNTERS.map(value))
    }
    fn waste(&self) -> Option<crate::waste::Waste> {
        let reserved = self.reserved_bytes();
        Some(crate::waste::Waste::of(
            &self.allocator.snapshot(),
            reserved,
        ))
    }
    fn log_misses(&mut self) {
        self.allocator.set_miss_log(MISS_LOG_CAPACITY);
    }
    fn take_misses(&mut self) -> Vec<gmlake_core::MissRecord> {
        self.allocator.take_misses()
    }
    fn free_after(&mut self, ptr: DevicePtr, waiter: StreamId) -> Result<(), CoreError> {
        self.allocator.record_stream(ptr, waiter)?;
        self.allocator.free(ptr)
    }
    fn complete(&mut self, waiter: StreamId) {
        self.allocator.device().complete_stream(waiter);
    }
    #[inline]
    fn settle(&mut self) {
        if self.busy {
            self.allocator
                .device()
                .complete_streams_below(WAITER_STREAMS);
        }
    }
}

/// No allocator: only the trace's own figures are measured (and the replay's own cost).
#[derive(Default)]
pub struct TraceOnly {
    next: DevicePtr,
}

impl Backend for TraceOnly {
    #[inline]
    fn allocate(&mut self, _size: u64, _stream: StreamId) -> Result<DevicePtr, CoreError> {
        self.next += 1;
        Ok(self.next)
    }
    #[inline]
    fn free(&mut self, _ptr: DevicePtr) -> Result<(), CoreError> {
        Ok(())
    }
    #[inline]
    fn reserved_bytes(&self) -> u64 {
        0
    }
}

#[derive(Clone, Copy, Debug)]
pub struct ReplayOptions {
    /// Frees of unknown addresses, allocations at live addresses and unknown actions are
    /// errors instead of being counted.
    pub strict: bool,
    /// Points of the time series to record (0: none).
    pub series_points: usize,
    /// Frees whose completion the trace shows later than their request happen at the
    /// request, behind work that completes at the completion (off: `--instant-frees`).
    pub deferred_frees: bool,
    /// `--windows N`: the backend's driver calls at the end of each of N windows of equal
    /// event counts (0: none).
    pub windows: usize,
    /// `--waste-at-peak`: read where the held memory sits at each new peak of it (a
    /// snapshot, O(blocks), only when the peak rises) and keep the last.
    pub waste_at_peak: bool,
    /// `--misses`: keep the second half's allocations that took no kept window, with the
    /// allocator's account of why (one more reuse scan at each miss).
    pub misses: bool,
    /// `--call-times`: time every allocation and free asked of the backend.
    pub call_times: bool,
}

/// What one replay measured.
#[derive(Clone, Debug)]
pub struct Measures {
    pub events: usize,
    /// The action that freed allocations (free_completed, or free_requested as a fallback).
    pub free_action: Action,
    /// Peak of the running sum of live allocation sizes in the trace.
    pub peak_active_bytes: u64,
    /// Peak of [`Backend::reserved_bytes`] sampled after every allocator call.
    pub sampled_peak_reserved_bytes: u64,
    pub native: NativeMeter,
    /// Allocations our allocator refused for lack of memory (skipped, with their frees).
    pub ooms: u64,
    /// The first of them: (event index, the allocator's message).
    pub first_oom: Option<(usize, String)>,
    /// Frees of addresses with no live allocation in the trace (ignored).
    pub unknown_frees: u64,
    /// Frees replayed at their request, behind work that completes at their completion.
    pub deferred_frees: u64,
    /// Allocations at an address that was still live (the trace lost a free: the old one is
    /// freed first).
    pub duplicate_allocs: u64,
    pub unknown_actions: u64,
    pub wall_seconds: f64,
    /// CPU time of the replay loop (allocator included), where the platform measures it.
    pub cpu_seconds: Option<f64>,
    pub series: Series,
    /// The backend's driver calls after the first half of the events (a steady-state figure
    /// is the total minus these).
    pub half_driver_calls: Option<DriverCalls>,
    /// `--windows`: the backend's counters at the end of each window.
    pub windows: Vec<WindowSnapshot>,
    /// `--waste-at-peak`: where the held memory sat when it was at its peak.
    pub waste_at_peak: Option<crate::waste::Waste>,
    /// `--misses`: (event, record) of each allocation of the second half that took no kept
    /// window (`None`: not asked; empty for a backend that does not stitch).
    pub misses: Option<Vec<(usize, gmlake_core::MissRecord)>>,
    /// `--call-times`: how long each allocation and free took (`None`: not asked).
    pub call_times: Option<crate::call_times::CallTimes>,
}

/// Why a replay stopped, at which event.
#[derive(Debug)]
pub struct ReplayError {
    pub event: usize,
    pub kind: ReplayErrorKind,
}

#[derive(Debug)]
pub enum ReplayErrorKind {
    /// `--strict`: a free of an address with no live allocation.
    UnknownFree { action: Action, addr: u64 },
    /// `--strict`: an allocation at an address that is still live.
    DuplicateAlloc { addr: u64 },
    /// `--strict`: an action this reader does not know.
    UnknownAction,
    /// The allocator failed other than by running out of memory.
    Allocator {
        action: Action,
        size: u64,
        error: CoreError,
    },
}

impl ReplayErrorKind {
    fn allocator(action: Action, size: u64, error: CoreError) -> ReplayErrorKind {
        ReplayErrorKind::Allocator {
            action,
            size,
            error,
        }
    }
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ReplayErrorKind::UnknownFree { action, addr } => write!(
                f,
                "{} of address {addr:#x}, which has no live allocation (--strict)",
                action.name()
            ),
            ReplayErrorKind::DuplicateAlloc { addr } => write!(
                f,
                "alloc at address {addr:#x}, which is still allocated (--strict)"
            ),
            ReplayErrorKind::UnknownAction => write!(f, "unknown action (--strict)"),
            ReplayErrorKind::Allocator {
                action,
                size,
                error,
            } => write!(
                f,
                "the allocator failed on {} of {size} bytes: {error}",
                action.name()
            ),
        }
    }
}

impl std::error::Error for ReplayError {}

/// An allocation of the trace, as replayed.
#[derive(Clone, Copy)]
struct Live {
    size: u64,
    /// Our pointer, or `None` when our allocator ran out of memory for it.
    ptr: Option<DevicePtr>,
    /// Freed already (at its `free_requested`), behind work on this waiter stream that
    /// completes at its `free_completed`.
    waiting: Option<StreamId>,
}

/// Waiter streams of `--deferred-frees`: each outstanding waiting free has its own, reused
/// once its work completed, so that completing one never completes another.
#[derive(Default)]
struct Waiters {
    free: Vec<StreamId>,
    next: StreamId,
}

impl Waiters {
    fn take(&mut self) -> StreamId {
        self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            WAITER_STREAMS + self.next
        })
    }
    fn give_back(&mut self, s: StreamId) {
        self.free.push(s);
    }
}

/// Whether the `free_requested` at `i` waits: its `free_completed` is not the next event.
fn waits(events: &[Event], i: usize) -> bool {
    let e = &events[i];
    !events
        .get(i + 1)
        .is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr)
}

fn is_oom(e: &CoreError) -> bool {
    matches!(
        e,
        CoreError::OutOfMemory(_) | CoreError::Device(DeviceError::OutOfMemory)
    )
}

/// Frees our allocation behind a trace allocation that `action` ended, if we made one: OOM'd
/// allocations have none and size-0 ones a null pointer, which is not freed.
#[inline]
fn release<B: Backend>(
    backend: &mut B,
    waiters: &mut Waiters,
    l: Live,
    action: Action,
    times: Option<&mut Vec<u64>>,
) -> Result<(), ReplayErrorKind> {
    if let Some(w) = l.waiting {
        // Freed at its request already: its wait ends now.
        backend.complete(w);
        waiters.give_back(w);
        return Ok(());
    }
    match l.ptr {
        Some(ptr) if ptr != 0 => timed(times, || backend.free(ptr))
            .map_err(|error| ReplayErrorKind::allocator(action, l.size, error)),
        _ => Ok(()),
    }
}

/// Calls `progress` with the number of events done every this many events.
const PROGRESS_EVERY: usize = 1 << 13;

/// Replays `trace` through `backend`. `progress` is told how many events are done now and then.
pub fn replay<B: Backend>(
    trace: &DeviceTrace,
    backend: &mut B,
    options: &ReplayOptions,
    progress: &mut dyn FnMut(usize),
) -> Result<Measures, ReplayError> {
    let free_action = trace.free_action();
    let events = &trace.events;
    let mut live: FxHashMap<u64, Live> = FxHashMap::default();
    let mut native = NativeMeter::default();
    let mut series = Series::new(events.len(), options.series_points);
    let (mut active, mut peak_active) = (0u64, 0u64);
    let mut reserved = backend.reserved_bytes();
    let mut peak_reserved = reserved;
    let (mut ooms, mut unknown_frees, mut duplicate_allocs) = (0u64, 0u64, 0u64);
    let mut first_oom = None;
    let fail = |event, kind| Err(ReplayError { event, kind });
    let half = events.len() / 2;
    let mut half_driver_calls = None;
    let defer = options.deferred_frees && free_action == Action::FreeCompleted;
    let mut waiters = Waiters::default();
    let mut deferred_frees = 0u64;
    let windows = options.windows.min(events.len());
    let mut window_snapshots = Vec::with_capacity(windows);
    let mut next_window = 1usize;
    let mut waste_at_peak = None;
    let mut misses = options.misses.then(Vec::new);
    let mut times = options.call_times.then(CallTimes::default);
    if options.misses {
        backend.log_misses();
    }
    let snapshot = |b: &B, events_so_far: usize| -> Option<WindowSnapshot> {
        let counts = b.stitch_counts().unwrap_or_default();
        b.driver_calls().map(|calls| (events_so_far, calls, counts))
    };

    let cpu_start = thread_cpu_time();
    let wall_start = Instant::now();
    for (i, e) in events.iter().enumerate() {
        backend.settle();
        if i == half {
            half_driver_calls = backend.driver_calls();
        }
        if windows > 0 && i == next_window * events.len() / windows {
            window_snapshots.extend(snapshot(backend, i));
            next_window += 1;
        }
        match e.action {
            Action::Alloc => {
                if let Some(old) = live.remove(&e.addr) {
                    if options.strict {
                        return fail(i, ReplayErrorKind::DuplicateAlloc { addr: e.addr });
                    }
                    duplicate_allocs += 1;
                    active = active.saturating_sub(old.size);
                    let t = times.as_mut().map(|t| &mut t.free);
                    if let Err(kind) = release(backend, &mut waiters, old, free_action, t) {
                        return fail(i, kind);
                    }
                }
                let t = times.as_mut().map(|t| &mut t.alloc);
                let ptr = match timed(t, || backend.allocate(e.size, e.stream)) {
                    Ok(p) => Some(p),
                    Err(error) if is_oom(&error) => {
                        ooms += 1;
                        first_oom.get_or_insert_with(|| (i, error.to_string()));
                        None
                    }
                    Err(error) => {
                        return fail(i, ReplayErrorKind::allocator(Action::Alloc, e.size, error))
                    }
                };
                reserved = backend.reserved_bytes();
                if let Some(m) = misses.as_mut() {
                    let taken = backend.take_misses();
                    if i >= half {
                        m.extend(taken.into_iter().map(|r| (i, r)));
                    }
                }
                let (size, waiting) = (e.size, None);
                live.insert(e.addr, Live { size, ptr, waiting });
                active = active.saturating_add(e.size);
                peak_active = peak_active.max(active);
            }
            Action::FreeRequested if defer && waits(events, i) => {
                if let Some(l) = live.get_mut(&e.addr) {
                    if let (Some(ptr), None) = (l.ptr.filter(|&p| p != 0), l.waiting) {
                        let w = waiters.take();
                        let t = times.as_mut().map(|t| &mut t.free);
                        if let Err(error) = timed(t, || backend.free_after(ptr, w)) {
                            let kind =
                                ReplayErrorKind::allocator(Action::FreeRequested, l.size, error);
                            return fail(i, kind);
                        }
                        l.waiting = Some(w);
                        deferred_frees += 1;
                        reserved = backend.reserved_bytes();
                    }
                }
            }
            a if a == free_action => match live.remove(&e.addr) {
                Some(l) => {
                    active = active.saturating_sub(l.size);
                    let t = times.as_mut().map(|t| &mut t.free);
                    if let Err(kind) = release(backend, &mut waiters, l, a, t) {
                        return fail(i, kind);
                    }
                    reserved = backend.reserved_bytes();
                }
                None if options.strict => {
                    let (action, addr) = (a, e.addr);
                    return fail(i, ReplayErrorKind::UnknownFree { action, addr });
                }
                None => unknown_frees += 1,
            },
            Action::Unknown if options.strict => return fail(i, ReplayErrorKind::UnknownAction),
            _ => native.observe(e),
        }
        if reserved > peak_reserved && options.waste_at_peak {
            waste_at_peak = backend.waste();
        }
        peak_reserved = peak_reserved.max(reserved);
        series.record(i, active, reserved, native.running());
        if i % PROGRESS_EVERY == 0 {
            progress(i);
        }
    }
    if windows > 0 {
        window_snapshots.extend(snapshot(backend, events.len()));
    }
    let wall_seconds = wall_start.elapsed().as_secs_f64();
    let cpu_seconds = match (cpu_start, thread_cpu_time()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a).as_secs_f64()),
        _ => None,
    };
    progress(events.len());
    series.finish(events.len().saturating_sub(1));

    Ok(Measures {
        events: events.len(),
        free_action,
        peak_active_bytes: peak_active,
        sampled_peak_reserved_bytes: peak_reserved,
        native,
        ooms,
        first_oom,
        unknown_frees,
        deferred_frees,
        duplicate_allocs,
        unknown_actions: trace.unknown_actions,
        wall_seconds,
        cpu_seconds,
        series,
        half_driver_calls,
        windows: window_snapshots,
        waste_at_peak,
        misses,
        call_times: times,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::tests::ev;
    use crate::trace::Event;

    /// A backend with a fixed capacity that holds exactly the bytes allocated (no caching),
    /// so the replay's bookkeeping can be checked without the real allocator.
    #[derive(Default)]
    struct Exact {
        capacity: u64,
        held: FxHashMap<DevicePtr, u64>,
        bytes: u64,
        next: DevicePtr,
    }

    impl Backend for Exact {
        fn allocate(&mut self, size: u64, _: StreamId) -> Result<DevicePtr, CoreError> {
            if size == 0 {
                return Ok(0);
            }
            if self.bytes + size > self.capacity {
                return Err(CoreError::Device(DeviceError::OutOfMemory));
            }
            self.next += 4096;
            self.held.insert(self.next, size);
            self.bytes += size;
            Ok(self.next)
        }
        fn free(&mut self, ptr: DevicePtr) -> Result<(), CoreError> {
            let size = self
                .held
                .remove(&ptr)
                .ok_or(CoreError::UnknownPointer(ptr))?;
            self.bytes -= size;
            Ok(())
        }
        fn reserved_bytes(&self) -> u64 {
            self.bytes
        }
    }

    fn trace(events: Vec<Event>) -> DeviceTrace {
        DeviceTrace {
            events,
            ..DeviceTrace::default()
        }
    }

    fn opts(strict: bool) -> ReplayOptions {
        ReplayOptions {
            strict,
            series_points: 100,
            deferred_frees: false,
            windows: 0,
            waste_at_peak: false,
            misses: false,
            call_times: false,
        }
    }

    fn run(t: &DeviceTrace, capacity: u64, strict: bool) -> Result<Measures, ReplayError> {
        let mut b = Exact {
            capacity,
            ..Exact::default()
        };
        replay(t, &mut b, &opts(strict), &mut |_| {})
    }

    /// Every counter `--windows` reports is one of the statistics' counters (a name that is
    /// not would read 0 in every window).
    #[test]
    fn window_counters_are_statistics_counters() {
        let names: Vec<&str> = gmlake_core::DeviceStats::default()
            .counters()
            .iter()
            .map(|c| c.0)
            .collect();
        for name in WINDOW_COUNTERS {
            assert!(
                names.contains(&name),
                "{name} is not a counter of DeviceStats"
            );
        }
    }

    /// `t` replayed through gmlake at its defaults on a 1 TiB simulated device.
    fn replay_sim(t: &DeviceTrace, o: &ReplayOptions) -> (Measures, SimBackend) {
        let mut b = SimBackend::new(1 << 40, gmlake_core::Config::default()).unwrap();
        let m = replay(t, &mut b, o, &mut |_| {}).unwrap();
        (m, b)
    }

    /// `--waste-at-peak` keeps the breakdown read when the held memory last rose: a later
    /// allocation that fits what is held does not replace it; without the option there is none.
    #[test]
    fn waste_is_read_at_the_peak_of_held_memory() {
        use Action::*;
        const M: u64 = 1 << 20;
        let t = trace(vec![
            ev(Alloc, 1, 3 * M),
            ev(FreeCompleted, 1, 3 * M),
            ev(Alloc, 2, M),
        ]);
        let run = |waste_at_peak| {
            let o = ReplayOptions {
                waste_at_peak,
                ..opts(true)
            };
            replay_sim(&t, &o).0.waste_at_peak
        };
        let w = run(true).expect("a breakdown at the peak");
        assert_eq!((w.reserved, w.active, w.tails), (4 * M, 3 * M, M), "{w:?}");
        assert_eq!(run(false), None);
    }

    /// A free the trace shows waiting (its completion not right after its request) is made at
    /// the request and its memory is reusable only from the completion: an allocation in
    /// between gets new memory, one after the completion reuses it.
    #[test]
    fn waiting_frees_are_reusable_from_their_completion() {
        use Action::*;
        const M: u64 = 64 << 20;
        let t = trace(vec![
            ev(Alloc, 1, M),
            ev(FreeRequested, 1, M),
            ev(Alloc, 2, M),
            ev(FreeCompleted, 1, M),
            ev(Alloc, 3, M),
            ev(FreeRequested, 2, M),
            ev(FreeCompleted, 2, M),
        ]);
        let replayed = |deferred_frees| {
            let o = ReplayOptions {
                deferred_frees,
                ..opts(true)
            };
            let (m, b) = replay_sim(&t, &o);
            (m, b.summary(0))
        };
        let (m, ours) = replayed(true);
        assert_eq!(m.deferred_frees, 1, "only the first free waits");
        assert_eq!(
            m.sampled_peak_reserved_bytes,
            2 * M,
            "reused before or never after"
        );
        assert!(ours.driver_calls.record_event > 0 && ours.driver_calls.query_event > 0);
        let (m, ours_instant) = replayed(false);
        assert_eq!(m.deferred_frees, 0);
        assert_eq!(m.sampled_peak_reserved_bytes, 2 * M);
        assert!(ours_instant.driver_calls.total() < ours.driver_calls.total());
    }

    #[test]
    fn measures_active_reserved_and_native() {
        use Action::*;
        let t = trace(vec![
            ev(SegmentAlloc, 0, 1000),
            ev(Alloc, 1, 100),
            ev(Alloc, 2, 300),
            ev(FreeRequested, 1, 100),
            ev(FreeCompleted, 1, 100),
            ev(Alloc, 3, 0),
            ev(Alloc, 4, 50),
            ev(FreeCompleted, 3, 0),
            ev(Snapshot, 0, 0),
        ]);
        let m = run(&t, 1 << 20, false).unwrap();
        assert_eq!(m.events, 9);
        assert_eq!(m.free_action, FreeCompleted);
        assert_eq!(m.peak_active_bytes, 400);
        assert_eq!(m.sampled_peak_reserved_bytes, 400);
        assert_eq!(m.native.peak(), 1000);
        assert_eq!((m.ooms, m.unknown_frees, m.duplicate_allocs), (0, 0, 0));
        let last = *m.series.points().last().unwrap();
        assert_eq!((last.event, last.active, last.native), (8, 350, 1000));
    }

    #[test]
    fn free_requested_is_the_fallback() {
        use Action::*;
        let t = trace(vec![
            ev(Alloc, 1, 100),
            ev(FreeRequested, 1, 100),
            ev(Alloc, 2, 100),
        ]);
        let m = run(&t, 1 << 20, false).unwrap();
        assert_eq!(m.free_action, FreeRequested);
        assert_eq!(m.peak_active_bytes, 100);
    }

    #[test]
    fn unknown_frees_are_counted_or_fatal_when_strict() {
        use Action::*;
        let t = trace(vec![ev(Alloc, 1, 100), ev(FreeCompleted, 7, 100)]);
        assert_eq!(run(&t, 1 << 20, false).unwrap().unknown_frees, 1);
        let e = run(&t, 1 << 20, true).unwrap_err();
        assert_eq!(e.event, 1);
        assert!(e.to_string().contains("0x7"), "{e}");
    }

    #[test]
    fn duplicate_allocs_free_the_old_one() {
        use Action::*;
        let t = trace(vec![ev(Alloc, 1, 100), ev(Alloc, 1, 40)]);
        let m = run(&t, 1 << 20, false).unwrap();
        assert_eq!(m.duplicate_allocs, 1);
        assert_eq!(m.peak_active_bytes, 100);
        assert_eq!(m.sampled_peak_reserved_bytes, 100);
        assert_eq!(run(&t, 1 << 20, true).unwrap_err().event, 1);
    }

    #[test]
    fn out_of_memory_skips_the_allocation_and_its_free() {
        use Action::*;
        let t = trace(vec![
            ev(Alloc, 1, 600),
            ev(Alloc, 2, 600),
            ev(FreeCompleted, 2, 600),
            ev(FreeCompleted, 1, 600),
            ev(Alloc, 3, 900),
        ]);
        let m = run(&t, 1000, false).unwrap();
        assert_eq!(m.ooms, 1);
        assert_eq!(m.first_oom.as_ref().unwrap().0, 1);
        assert_eq!(
            m.peak_active_bytes, 1200,
            "active is the trace's, OOM or not"
        );
        assert_eq!(m.sampled_peak_reserved_bytes, 900);
        assert_eq!(m.unknown_frees, 0);
    }

    #[test]
    fn unknown_actions_are_ignored_unless_strict() {
        use Action::*;
        let t = trace(vec![ev(Alloc, 1, 100), ev(Unknown, 0, 0)]);
        assert!(run(&t, 1000, false).is_ok());
        assert_eq!(run(&t, 1000, true).unwrap_err().event, 1);
    }

    #[test]
    fn other_allocator_errors_stop_the_replay() {
        struct Broken;
        impl Backend for Broken {
            fn allocate(&mut self, s: u64, _: StreamId) -> Result<DevicePtr, CoreError> {
                Err(CoreError::SizeOverflow(s))
            }
            fn free(&mut self, _: DevicePtr) -> Result<(), CoreError> {
                Ok(())
            }
            fn reserved_bytes(&self) -> u64 {
                0
            }
        }
        let t = trace(vec![ev(Action::Alloc, 1, u64::MAX)]);
        let e = replay(&t, &mut Broken, &opts(false), &mut |_| {}).unwrap_err();
        assert_eq!(e.event, 0);
        assert!(e.to_string().contains("too large"), "{e}");
    }
}
