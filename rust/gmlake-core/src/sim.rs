//! A simulated device: host-side bookkeeping that enforces the CUDA driver's virtual memory
//! rules (see [`crate::device`]) and counts every call by kind. Used by the tests and by trace
//! replay; nothing is ever read or written through its addresses.
//!
//! Contents: for the host tier's tests the device keeps a model of what memory holds, one
//! 64-bit value per 512-byte unit ([`CONTENT_UNIT`]) of physical pages and pinned host
//! buffers (unwritten units hold 0). [`SimDevice::fill`] writes a pattern (a kernel writing a
//! tensor), [`SimDevice::checksum`] reads one back (position-relative, so a tensor moved to other
//! pages keeps its checksum), and the copies of the [`Device`] trait move it. On an
//! [`asynchronous`](SimDevice::asynchronous) device, fills and copies are queued and run, in the
//! order they were issued, when the device completes its work ([`SimDevice::complete_all`],
//! `synchronize`), as events do. Queued work on *different* streams that touches the same
//! bytes (one of them writing) is a data race on a GPU: the device records it as a *hazard*
//! ([`SimDevice::hazards`]), as it does for memory released or freed with work in flight.

use crate::device::{
    Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostPtr, PhysHandle, StreamId,
};
use crate::stats::DriverCalls;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// Where the simulated address space starts (a typical CUDA VA, so traces look familiar).
const VA_BASE: u64 = 0x7f00_0000_0000;
/// How much virtual address space the simulated device has (as a 47-bit GPU VA space).
const VA_LIMIT: u64 = VA_BASE + (1 << 46);

/// Where pinned host buffers start in the simulated host address space.
const HOST_BASE: u64 = 0x5500_0000_0000;

/// Granule of the content model: copies, fills and checksums take addresses and lengths that
/// are multiples of it.
pub const CONTENT_UNIT: u64 = 512;

/// Memory whose contents are modelled: a physical allocation, or a host buffer (by start).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Space {
    Phys(u64),
    Host(u64),
}

/// A byte range of one space.
#[derive(Clone, Copy, Debug)]
struct Seg {
    space: Space,
    off: u64,
    len: u64,
}

#[derive(Debug)]
enum OpKind {
    Copy { src: Vec<Seg>, dst: Vec<Seg> },
    Fill { dst: Vec<Seg>, seed: u64 },
}

/// A fill or copy queued on a stream, not yet run.
#[derive(Debug)]
struct PendingOp {
    stream: StreamId,
    what: &'static str,
    kind: OpKind,
    /// The device virtual range the work reaches memory through (a kernel's pointer): while it
    /// is queued, unmapping that range is a fault on a GPU.
    via: Option<(DevicePtr, u64)>,
    /// Issue order over all streams (set when queued).
    seq: u64,
}

impl PendingOp {
    fn reads(&self) -> &[Seg] {
        match &self.kind {
            OpKind::Copy { src, .. } => src,
            OpKind::Fill { .. } => &[],
        }
    }
    fn writes(&self) -> &[Seg] {
        match &self.kind {
            OpKind::Copy { dst, .. } | OpKind::Fill { dst, .. } => dst,
        }
    }
    fn touches(&self, space: Space) -> bool {
        self.reads()
            .iter()
            .chain(self.writes())
            .any(|s| s.space == space)
    }
}

fn overlaps(a: &[Seg], b: &[Seg]) -> bool {
    a.iter().any(|x| {
        b.iter()
            .any(|y| x.space == y.space && x.off < y.off + y.len && y.off < x.off + x.len)
    })
}

/// The value a fill with `seed` writes into unit `i` of its range.
fn fill_value(seed: u64, i: u64) -> u64 {
    mix(seed ^ 0x9e37_79b9_7f4a_7c15, i)
}

fn mix(a: u64, b: u64) -> u64 {
    let mut x = a.wrapping_add(b.wrapping_mul(0xbf58_476d_1ce4_e5b9)) ^ 0x94d0_49bb_1331_11eb;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[derive(Debug)]
struct Handle {
    size: u64,
    mappings: u32,
    /// The physical allocation behind the handle: imported handles share their exporter's.
    alloc: u64,
}

#[derive(Debug, Default)]
struct SimState {
    next_handle: u64,
    handles: FxHashMap<u64, Handle>,
    /// allocation -> handles referring to it (created or imported); freed at 0.
    alloc_refs: FxHashMap<u64, u32>,
    /// Exported "descriptors" -> the handle they were exported from (valid until it is
    /// released, as gmlake-cuda closes a page's descriptor when it releases the page).
    exports: FxHashMap<i32, u64>,
    next_export: i32,
    physical_bytes: u64,
    /// start -> size
    reservations: BTreeMap<u64, u64>,
    next_va: u64,
    /// start -> (size, handle, access granted)
    mappings: BTreeMap<u64, (u64, u64, bool)>,
    next_event: u64,
    /// event -> the stream it was recorded on while that record is still pending (`None`:
    /// completed, or never recorded)
    events: FxHashMap<u64, Option<StreamId>>,
    calls: DriverCalls,
    /// Pinned host buffers: start -> size.
    host: BTreeMap<u64, u64>,
    next_host: u64,
    /// Modelled contents: space -> unit index -> value (absent: 0).
    contents: FxHashMap<Space, FxHashMap<u64, u64>>,
    /// Fills and copies queued on an asynchronous device, in issue order.
    queued: Vec<PendingOp>,
    next_seq: u64,
    /// (waiting stream, stream waited for) -> the last issue number the wait covers
    /// (`stream_wait_event`): work of the second stream issued up to it runs before work the
    /// first issues afterwards.
    waits: FxHashMap<(StreamId, StreamId), u64>,
    /// Every `stream_wait_event`: (waiting stream, stream of the event's pending record, if
    /// any).
    stream_waits: Vec<(StreamId, Option<StreamId>)>,
    /// event -> the last issue number at its last record.
    event_seq: FxHashMap<u64, u64>,
    hazards: Vec<String>,
    /// Bytes copied device to host and host to device (counted at issue).
    d2h_bytes: u64,
    h2d_bytes: u64,
}

/// A simulated GPU with a fixed capacity and page granularity.
#[derive(Debug)]
pub struct SimDevice {
    capacity: u64,
    granularity: u64,
    /// When true, recorded events stay pending until [`SimDevice::complete_all`],
    /// [`SimDevice::complete_stream`], `synchronize` or `wait_event`, modelling kernels still
    /// in flight.
    asynchronous: bool,
    /// Events recorded on streams at or above this id stay pending until completed
    /// explicitly, the others complete at once ([`SimDevice::pending_from`]).
    pending_from: Option<StreamId>,
    /// Whether fills and copies model contents (off for fast replays of large traces).
    contents: bool,
    /// Host time each `map` takes ([`SimDevice::with_map_delay`]; none by default).
    map_delay: std::time::Duration,
    state: Mutex<SimState>,
}

fn invalid<T>(msg: String) -> DeviceResult<T> {
    Err(DeviceError::InvalidArgument(msg))
}

impl SimDevice {
    /// A device of `capacity` bytes with 2 MiB pages, whose events complete at once.
    pub fn new(capacity: u64) -> SimDevice {
        SimDevice::with_granularity(capacity, 2 << 20)
    }

    pub fn with_granularity(capacity: u64, granularity: u64) -> SimDevice {
        assert!(
            granularity.is_power_of_two(),
            "granularity must be a power of two"
        );
        SimDevice {
            capacity,
            granularity,
            asynchronous: false,
            pending_from: None,
            contents: true,
            map_delay: std::time::Duration::ZERO,
            state: Mutex::new(SimState {
                next_va: VA_BASE,
                next_handle: 1,
                next_event: 1,
                next_host: HOST_BASE,
                ..SimState::default()
            }),
        }
    }

    /// Events recorded from now on stay pending until completed explicitly.
    pub fn asynchronous(mut self) -> SimDevice {
        self.asynchronous = true;
        self
    }

    /// Events recorded on streams `first` and above stay pending until
    /// [`SimDevice::complete_stream`] (or `complete_all`, `synchronize`, `wait_event`); events
    /// of lower streams complete at once. The replay gives each free that the trace shows
    /// waiting for other work (`free_requested` long before `free_completed`) a stream of its
    /// own up there, completed when the trace says the wait ended.
    pub fn pending_from(mut self, first: StreamId) -> SimDevice {
        self.pending_from = Some(first);
        self
    }

    /// Each `map` takes `delay` of host time (a sleep), as the driver's do (20-35 µs a page
    /// with its access grant): for tests of what the allocator measures of its driver calls.
    pub fn with_map_delay(mut self, delay: std::time::Duration) -> SimDevice {
        self.map_delay = delay;
        self
    }

    /// Copies and fills are checked and counted but move no contents (checksums read zeros):
    /// for replays of large traces, where modelling every 512 bytes would be slow.
    pub fn without_contents(mut self) -> SimDevice {
        self.contents = false;
        self
    }

    /// Completes every pending event (all queued work has finished): queued fills and copies
    /// run, in issue order.
    pub fn complete_all(&self) {
        let mut st = self.state.lock();
        st.run_queued();
        st.events.values_mut().for_each(|p| *p = None);
    }

    /// Completes the work queued on every stream below `limit` (streams at or above it stay
    /// busy): their fills and copies run, and the events recorded on them complete. Cheap when
    /// nothing is pending there.
    pub fn complete_streams_below(&self, limit: StreamId) {
        let mut st = self.state.lock();
        let mut streams: Vec<StreamId> = st
            .events
            .values()
            .filter_map(|p| p.filter(|&s| s < limit))
            .chain(st.queued.iter().map(|op| op.stream).filter(|&s| s < limit))
            .collect();
        streams.sort_unstable();
        streams.dedup();
        for s in streams {
            st.complete_stream(s);
        }
    }

    /// Completes the work queued on `stream` (other streams stay busy, but for the work it
    /// waited for, directly or through other streams' waits, which runs too): its fills and
    /// copies run, in issue order, and the events recorded on it complete.
    pub fn complete_stream(&self, stream: StreamId) {
        self.state.lock().complete_stream(stream);
    }

    /// Every `stream_wait_event` so far: (waiting stream, stream of the event's pending record
    /// at the time; `None` when it had completed).
    pub fn stream_waits(&self) -> Vec<(StreamId, Option<StreamId>)> {
        self.state.lock().stream_waits.clone()
    }

    /// Whether `event` is recorded and not yet complete, and on which stream.
    pub fn pending_on(&self, event: EventHandle) -> Option<StreamId> {
        self.state.lock().events.get(&event.0).copied().flatten()
    }

    /// Writes a pattern derived from `seed` into `len` bytes at device address `addr`, queued on
    /// `stream` as a kernel would be (at once on a synchronous device). `addr` and `len` are
    /// multiples of [`CONTENT_UNIT`], and the range is mapped with access.
    pub fn fill(&self, addr: DevicePtr, len: u64, seed: u64, stream: StreamId) -> DeviceResult<()> {
        let mut st = self.state.lock();
        let dst = st.device_segs(addr, len, "fill")?;
        st.issue(
            self.asynchronous,
            self.contents,
            PendingOp {
                seq: 0,
                stream,
                what: "fill",
                kind: OpKind::Fill { dst, seed },
                via: Some((addr, len)),
            },
        );
        Ok(())
    }

    /// The checksum of `len` bytes at device address `addr` (relative to `addr`: equal
    /// contents at two addresses give equal checksums). Fails while queued work writes there.
    pub fn checksum(&self, addr: DevicePtr, len: u64) -> DeviceResult<u64> {
        let st = self.state.lock();
        let segs = st.device_segs(addr, len, "checksum")?;
        st.checksum_of(&segs)
    }

    /// The checksum a fill of `len` bytes with `seed` leaves.
    pub fn fill_checksum(len: u64, seed: u64) -> u64 {
        (0..len / CONTENT_UNIT).fold(0, |acc, i| mix(acc, mix(fill_value(seed, i), i)))
    }

    /// The checksum of `len` bytes of pinned host memory at `ptr`.
    pub fn host_checksum(&self, ptr: HostPtr, len: u64) -> DeviceResult<u64> {
        let st = self.state.lock();
        let segs = st.host_segs(ptr, len, "checksum")?;
        st.checksum_of(&segs)
    }

    /// Data races and frees with work in flight seen so far (see the module documentation).
    pub fn hazards(&self) -> Vec<String> {
        self.state.lock().hazards.clone()
    }

    /// Fills and copies queued and not yet run.
    pub fn queued_ops(&self) -> usize {
        self.state.lock().queued.len()
    }

    /// Pinned host buffers currently allocated, and their bytes.
    pub fn host_buffers(&self) -> (usize, u64) {
        let st = self.state.lock();
        (st.host.len(), st.host.values().sum())
    }

    /// Bytes copied so far (device to host, host to device).
    pub fn copied_bytes(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.d2h_bytes, st.h2d_bytes)
    }

    /// Calls made so far, by kind.
    pub fn calls(&self) -> DriverCalls {
        self.state.lock().calls
    }

    /// Bytes of physical memory currently created.
    pub fn physical_bytes(&self) -> u64 {
        self.state.lock().physical_bytes
    }

    /// Number of physical handles currently created.
    pub fn live_handles(&self) -> usize {
        self.state.lock().handles.len()
    }

    /// Number of mappings currently in place.
    pub fn live_mappings(&self) -> usize {
        self.state.lock().mappings.len()
    }

    /// Number of virtual reservations currently held.
    pub fn live_reservations(&self) -> usize {
        self.state.lock().reservations.len()
    }

    /// Number of events currently created.
    pub fn live_events(&self) -> usize {
        self.state.lock().events.len()
    }

    /// Exports a handle for another process as a descriptor-like token, valid until the
    /// handle is released (several exports of one handle give the same token), like
    /// `cuMemExportToShareableHandle` with the descriptor cached per page.
    pub fn export_token(&self, handle: PhysHandle) -> DeviceResult<i32> {
        let mut st = self.state.lock();
        if !st.handles.contains_key(&handle.0) {
            return invalid(format!("export of unknown handle {}", handle.0));
        }
        if let Some((&t, _)) = st.exports.iter().find(|(_, &h)| h == handle.0) {
            return Ok(t);
        }
        st.next_export += 1;
        let t = st.next_export + 2; // past stdin/stdout/stderr, as a real descriptor would be
        st.exports.insert(t, handle.0);
        Ok(t)
    }

    /// Imports a token made by [`SimDevice::export_token`] as a new handle to the same
    /// physical allocation (`cuMemImportFromShareableHandle`): the memory lives until every
    /// handle to it is released.
    pub fn import_token(&self, token: i32) -> DeviceResult<PhysHandle> {
        let mut st = self.state.lock();
        let Some(&from) = st.exports.get(&token) else {
            return invalid(format!(
                "import of descriptor {token}: not exported, or its page was released"
            ));
        };
        let (size, alloc) = {
            let h = &st.handles[&from];
            (h.size, h.alloc)
        };
        let id = st.new_handle(size, Some(alloc));
        *st.alloc_refs
            .get_mut(&alloc)
            .expect("allocation of a live handle") += 1;
        Ok(PhysHandle(id))
    }

    /// The physical allocation behind a handle (equal for an exported handle and its imports).
    pub fn allocation_of(&self, handle: PhysHandle) -> Option<u64> {
        self.state.lock().handles.get(&handle.0).map(|h| h.alloc)
    }

    /// The physical handle and offset behind a virtual address, if it is mapped with access.
    pub fn translate(&self, addr: DevicePtr) -> Option<(PhysHandle, u64)> {
        let st = self.state.lock();
        let (&start, &(size, handle, access)) = st.mappings.range(..=addr).next_back()?;
        (addr < start + size && access).then_some((PhysHandle(handle), addr - start))
    }

    fn check_aligned(&self, what: &str, v: u64) -> DeviceResult<()> {
        if !v.is_multiple_of(self.granularity) {
            return invalid(format!(
                "{what} {v:#x} is not a multiple of the granularity {:#x}",
                self.granularity
            ));
        }
        Ok(())
    }
}

impl SimState {
    /// A new handle of `size` bytes to allocation `alloc` (None: a new allocation, whose id
    /// is the handle's).
    fn new_handle(&mut self, size: u64, alloc: Option<u64>) -> u64 {
        let id = self.next_handle;
        self.next_handle += 1;
        let alloc = alloc.unwrap_or(id);
        self.handles.insert(
            id,
            Handle {
                size,
                mappings: 0,
                alloc,
            },
        );
        id
    }

    fn check_unit(addr: u64, len: u64, what: &str) -> DeviceResult<()> {
        if !addr.is_multiple_of(CONTENT_UNIT) || !len.is_multiple_of(CONTENT_UNIT) || len == 0 {
            return invalid(format!(
                "{what} of {len} bytes at {addr:#x}: the simulated device models contents in \
                 units of {CONTENT_UNIT} bytes (non-empty, aligned ranges only)"
            ));
        }
        Ok(())
    }

    /// The physical ranges behind `len` bytes at device address `addr`, which must be mapped
    /// with access throughout.
    fn device_segs(&self, addr: u64, len: u64, what: &str) -> DeviceResult<Vec<Seg>> {
        Self::check_unit(addr, len, what)?;
        let end = addr + len;
        let mut segs = Vec::new();
        let mut cursor = addr;
        while cursor < end {
            let m = self.mappings.range(..=cursor).next_back();
            let Some((&start, &(size, handle, true))) = m.filter(|(&s, m)| cursor < s + m.0) else {
                return invalid(format!(
                    "{what} of {len} bytes at {addr:#x}: {cursor:#x} is not mapped with access"
                ));
            };
            let chunk = (start + size).min(end) - cursor;
            segs.push(Seg {
                space: Space::Phys(self.handles[&handle].alloc),
                off: cursor - start,
                len: chunk,
            });
            cursor += chunk;
        }
        Ok(segs)
    }

    /// The host buffer range of `len` bytes at `ptr`, which must lie in one buffer.
    fn host_segs(&self, ptr: HostPtr, len: u64, what: &str) -> DeviceResult<Vec<Seg>> {
        Self::check_unit(ptr.0, len, what)?;
        match self.host.range(..=ptr.0).next_back() {
            Some((&start, &size)) if ptr.0 + len <= start + size => Ok(vec![Seg {
                space: Space::Host(start),
                off: ptr.0 - start,
                len,
            }]),
            _ => invalid(format!(
                "{what} of {len} bytes at host {:#x}: not inside one pinned buffer",
                ptr.0
            )),
        }
    }

    fn read_units(&self, segs: &[Seg]) -> Vec<u64> {
        let mut out = Vec::new();
        for s in segs {
            let c = self.contents.get(&s.space);
            for u in s.off / CONTENT_UNIT..(s.off + s.len) / CONTENT_UNIT {
                out.push(c.and_then(|c| c.get(&u)).copied().unwrap_or(0));
            }
        }
        out
    }

    fn write_units(&mut self, segs: &[Seg], mut value: impl FnMut(u64) -> u64) {
        let mut i = 0;
        for s in segs {
            let live = match s.space {
                Space::Phys(a) => self.alloc_refs.contains_key(&a),
                Space::Host(h) => self.host.contains_key(&h),
            };
            let c = self.contents.entry(s.space).or_default();
            for u in s.off / CONTENT_UNIT..(s.off + s.len) / CONTENT_UNIT {
                let v = value(i);
                i += 1;
                if live {
                    c.insert(u, v);
                }
            }
        }
    }

    fn checksum_of(&self, segs: &[Seg]) -> DeviceResult<u64> {
        if let Some(op) = self.queued.iter().find(|op| overlaps(op.writes(), segs)) {
            return invalid(format!(
                "checksum of memory that a queued {} on stream {:#x} writes",
                op.what, op.stream
            ));
        }
        Ok(self
            .read_units(segs)
            .iter()
            .enumerate()
            .fold(0, |acc, (i, &v)| mix(acc, mix(v, i as u64))))
    }

    fn run(&mut self, op: PendingOp) {
        match op.kind {
            OpKind::Copy { src, dst } => {
                let data = self.read_units(&src);
                self.write_units(&dst, |i| data[i as usize]);
            }
            OpKind::Fill { dst, seed } => self.write_units(&dst, |i| fill_value(seed, i)),
        }
    }

    /// Runs `op` now (synchronous device) or queues it, recording a hazard if queued work of
    /// another stream conflicts with it.
    fn issue(&mut self, asynchronous: bool, contents: bool, op: PendingOp) {
        if !contents {
            return;
        }
        if !asynchronous {
            self.run(op);
            return;
        }
        let mut op = op;
        self.next_seq += 1;
        op.seq = self.next_seq;
        for p in &self.queued {
            let ordered = self
                .waits
                .get(&(op.stream, p.stream))
                .is_some_and(|&w| p.seq <= w);
            if p.stream != op.stream
                && !ordered
                && (overlaps(op.writes(), p.reads())
                    || overlaps(op.writes(), p.writes())
                    || overlaps(op.reads(), p.writes()))
            {
                self.hazards.push(format!(
                    "data race: {} on stream {:#x} and queued {} on stream {:#x} touch the same \
                     memory, one writing",
                    op.what, op.stream, p.what, p.stream
                ));
            }
        }
        self.queued.push(op);
    }

    fn run_queued(&mut self) {
        for op in std::mem::take(&mut self.queued) {
            self.run(op);
        }
    }

    fn complete_stream(&mut self, stream: StreamId) {
        // Work this stream waited for runs first, and what that work waited for in turn (a
        // GPU orders waits transitively: a fill on stream 1 that waited for stream 0 runs after
        // stream 0's work even when stream 2, waiting for stream 1, is what completes). `need`
        // holds, per stream, the last issue number that must run; it grows to a fixed point.
        // Waits are kept per pair of streams as the last issue number covered, not per wait,
        // so a stream's wait counts once any of its needed work was issued after that number:
        // this may run more than needed, never less.
        let mut need: FxHashMap<StreamId, u64> = FxHashMap::default();
        need.insert(stream, u64::MAX);
        loop {
            let mut grew = false;
            for (&(waiting, on), &w) in &self.waits {
                let Some(&n) = need.get(&waiting) else {
                    continue;
                };
                if n > w && need.get(&on).is_none_or(|&have| have < w) {
                    need.insert(on, w);
                    grew = true;
                }
            }
            if !grew {
                break;
            }
        }
        // Issue order respects every wait (a wait covers work issued before it), so running the
        // chosen work in that order keeps each stream's order and every wait.
        let (run, rest): (Vec<PendingOp>, Vec<PendingOp>) = std::mem::take(&mut self.queued)
            .into_iter()
            .partition(|op| need.get(&op.stream).is_some_and(|&n| op.seq <= n));
        self.queued = rest;
        for op in run {
            self.run(op);
        }
        for p in self.events.values_mut() {
            if *p == Some(stream) {
                *p = None;
            }
        }
    }

    fn reservation_containing(&self, addr: u64, size: u64) -> Option<(u64, u64)> {
        let (&s, &len) = self.reservations.range(..=addr).next_back()?;
        (addr + size <= s + len).then_some((s, len))
    }
}

impl Device for SimDevice {
    fn granularity(&self) -> DeviceResult<usize> {
        Ok(self.granularity as usize)
    }

    fn total_memory(&self) -> DeviceResult<usize> {
        Ok(self.capacity as usize)
    }

    fn free_memory(&self) -> DeviceResult<usize> {
        Ok((self.capacity - self.state.lock().physical_bytes) as usize)
    }

    fn create_physical(&self, size: usize) -> DeviceResult<PhysHandle> {
        let size = size as u64;
        self.check_aligned("physical size", size)?;
        if size == 0 {
            return invalid("physical size 0".into());
        }
        let mut st = self.state.lock();
        st.calls.create_physical += 1;
        if st.physical_bytes + size > self.capacity {
            return Err(DeviceError::OutOfMemory);
        }
        let id = st.new_handle(size, None);
        st.alloc_refs.insert(id, 1);
        st.physical_bytes += size;
        Ok(PhysHandle(id))
    }

    fn release_physical(&self, handle: PhysHandle) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.release_physical += 1;
        match st.handles.get(&handle.0) {
            None => invalid(format!("release of unknown handle {}", handle.0)),
            Some(h) if h.mappings > 0 => invalid(format!(
                "release of handle {} still mapped {} times",
                handle.0, h.mappings
            )),
            Some(h) => {
                let (size, alloc) = (h.size, h.alloc);
                st.handles.remove(&handle.0);
                st.exports.retain(|_, h| *h != handle.0);
                let refs = st
                    .alloc_refs
                    .get_mut(&alloc)
                    .expect("allocation of a live handle");
                *refs -= 1;
                if *refs == 0 {
                    st.alloc_refs.remove(&alloc);
                    st.physical_bytes -= size;
                    st.contents.remove(&Space::Phys(alloc));
                    if st.queued.iter().any(|op| op.touches(Space::Phys(alloc))) {
                        st.hazards.push(format!(
                            "physical memory of handle {} released with queued work on it",
                            handle.0
                        ));
                    }
                }
                Ok(())
            }
        }
    }

    fn reserve_va(&self, size: usize, alignment: usize) -> DeviceResult<DevicePtr> {
        let (size, alignment) = (size as u64, (alignment as u64).max(self.granularity));
        self.check_aligned("reservation size", size)?;
        if size == 0 || !alignment.is_power_of_two() {
            return invalid(format!(
                "reservation of {size} bytes aligned to {alignment}"
            ));
        }
        let mut st = self.state.lock();
        st.calls.reserve_va += 1;
        let start = st.next_va.div_ceil(alignment) * alignment;
        match start.checked_add(size) {
            Some(end) if end <= VA_LIMIT => {
                st.next_va = end;
                st.reservations.insert(start, size);
                Ok(start)
            }
            _ => Err(DeviceError::OutOfMemory),
        }
    }

    fn free_va(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.free_va += 1;
        if st.reservations.get(&addr) != Some(&(size as u64)) {
            return invalid(format!(
                "free of {size} bytes at {addr:#x}: not a reservation"
            ));
        }
        if st.mappings.range(addr..addr + size as u64).next().is_some() {
            return invalid(format!(
                "free of reservation {addr:#x} with mappings inside"
            ));
        }
        st.reservations.remove(&addr);
        Ok(())
    }

    fn map(&self, addr: DevicePtr, size: usize, handle: PhysHandle) -> DeviceResult<()> {
        if !self.map_delay.is_zero() {
            std::thread::sleep(self.map_delay);
        }
        let size = size as u64;
        self.check_aligned("map address", addr)?;
        self.check_aligned("map size", size)?;
        let mut st = self.state.lock();
        st.calls.map += 1;
        match st.handles.get(&handle.0) {
            None => return invalid(format!("map of unknown handle {}", handle.0)),
            Some(h) if h.size != size => {
                return invalid(format!(
                    "map of {size} bytes of handle {} whose size is {}",
                    handle.0, h.size
                ))
            }
            _ => {}
        }
        if st.reservation_containing(addr, size).is_none() {
            return invalid(format!(
                "map at {addr:#x}+{size:#x} outside any reservation"
            ));
        }
        let overlaps_before = st
            .mappings
            .range(..addr)
            .next_back()
            .is_some_and(|(&s, &(l, _, _))| s + l > addr);
        if overlaps_before || st.mappings.range(addr..addr + size).next().is_some() {
            return invalid(format!("map at {addr:#x}+{size:#x} over a mapped range"));
        }
        st.mappings.insert(addr, (size, handle.0, false));
        if let Some(h) = st.handles.get_mut(&handle.0) {
            h.mappings += 1;
        }
        Ok(())
    }

    fn unmap(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.unmap += 1;
        match st.mappings.get(&addr) {
            Some(&(l, handle, _)) if l == size as u64 => {
                let end = addr + l;
                if let Some(op) = st.queued.iter().find(|op| {
                    op.via
                        .is_some_and(|(a, n)| a < end && addr < a.saturating_add(n))
                }) {
                    let msg = format!(
                        "unmap of {addr:#x}+{l:#x} while a queued {} on stream {:#x} reaches \
                         memory through it",
                        op.what, op.stream
                    );
                    st.hazards.push(msg);
                }
                st.mappings.remove(&addr);
                if let Some(h) = st.handles.get_mut(&handle) {
                    h.mappings -= 1;
                }
                Ok(())
            }
            _ => invalid(format!(
                "unmap of {size} bytes at {addr:#x}: not one mapping"
            )),
        }
    }

    fn set_access(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        let size = size as u64;
        let mut st = self.state.lock();
        st.calls.set_access += 1;
        // The range must be covered exactly by contiguous mappings.
        let mut cursor = addr;
        let keys: Vec<u64> = st
            .mappings
            .range(addr..addr + size)
            .map(|(&k, _)| k)
            .collect();
        for k in &keys {
            if *k != cursor {
                return invalid(format!(
                    "set_access at {addr:#x}+{size:#x}: hole at {cursor:#x}"
                ));
            }
            cursor += st.mappings[k].0;
        }
        if cursor != addr + size || size == 0 {
            return invalid(format!(
                "set_access at {addr:#x}+{size:#x}: not fully mapped"
            ));
        }
        for k in keys {
            if let Some(m) = st.mappings.get_mut(&k) {
                m.2 = true;
            }
        }
        Ok(())
    }

    fn create_event(&self) -> DeviceResult<EventHandle> {
        let mut st = self.state.lock();
        st.calls.create_event += 1;
        let id = st.next_event;
        st.next_event += 1;
        st.events.insert(id, None);
        Ok(EventHandle(id))
    }

    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        let mut st = self.state.lock();
        match st.events.remove(&event.0) {
            Some(_) => Ok(()),
            None => invalid(format!("destroy of unknown event {}", event.0)),
        }
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.record_event += 1;
        match st.events.get_mut(&event.0) {
            Some(p) => {
                let pending =
                    self.asynchronous || self.pending_from.is_some_and(|first| stream >= first);
                *p = pending.then_some(stream);
                let seq = st.next_seq;
                st.event_seq.insert(event.0, seq);
                Ok(())
            }
            None => invalid(format!("record of unknown event {}", event.0)),
        }
    }

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let mut st = self.state.lock();
        st.calls.query_event += 1;
        match st.events.get(&event.0) {
            Some(p) => Ok(p.is_none()),
            None => invalid(format!("query of unknown event {}", event.0)),
        }
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.stream_wait += 1;
        let pending = match st.events.get(&event.0) {
            Some(p) => *p,
            None => return invalid(format!("stream wait for unknown event {}", event.0)),
        };
        st.stream_waits.push((stream, pending));
        if let Some(on) = pending {
            if on != stream {
                let last = st.event_seq.get(&event.0).copied().unwrap_or(0);
                let w = st.waits.entry((stream, on)).or_insert(0);
                *w = (*w).max(last);
            }
        }
        Ok(())
    }

    fn synchronize(&self) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.synchronize += 1;
        st.run_queued();
        st.events.values_mut().for_each(|p| *p = None);
        Ok(())
    }

    /// Completes the event's stream (its queued work runs): the GPU finished what was queued
    /// there before the record, and possibly more.
    fn wait_event(&self, event: EventHandle) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.synchronize += 1;
        match st.events.get(&event.0) {
            Some(&Some(stream)) => {
                st.complete_stream(stream);
                Ok(())
            }
            Some(None) => Ok(()),
            None => invalid(format!("wait for unknown event {}", event.0)),
        }
    }

    fn alloc_host(&self, size: usize) -> DeviceResult<HostPtr> {
        let size = (size as u64).div_ceil(CONTENT_UNIT) * CONTENT_UNIT;
        if size == 0 {
            return invalid("pinned host allocation of 0 bytes".into());
        }
        let mut st = self.state.lock();
        // Buffers are 4 KiB aligned, as host pages are.
        let start = st.next_host.div_ceil(4096) * 4096;
        st.next_host = start + size;
        st.host.insert(start, size);
        Ok(HostPtr(start))
    }

    fn free_host(&self, ptr: HostPtr) -> DeviceResult<()> {
        let mut st = self.state.lock();
        if st.host.remove(&ptr.0).is_none() {
            return invalid(format!("free of unknown pinned host buffer {:#x}", ptr.0));
        }
        st.contents.remove(&Space::Host(ptr.0));
        if st.queued.iter().any(|op| op.touches(Space::Host(ptr.0))) {
            st.hazards.push(format!(
                "pinned host buffer {:#x} freed with a queued copy on it",
                ptr.0
            ));
        }
        Ok(())
    }

    fn copy_d2h_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let mut st = self.state.lock();
        let s = st.device_segs(src, len as u64, "copy_d2h_async")?;
        let d = st.host_segs(dst, len as u64, "copy_d2h_async")?;
        st.d2h_bytes += len as u64;
        st.issue(
            self.asynchronous,
            self.contents,
            PendingOp {
                seq: 0,
                stream,
                what: "copy_d2h_async",
                kind: OpKind::Copy { src: s, dst: d },
                via: Some((src, len as u64)),
            },
        );
        Ok(())
    }

    fn copy_h2d_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let mut st = self.state.lock();
        let s = st.host_segs(src, len as u64, "copy_h2d_async")?;
        let d = st.device_segs(dst, len as u64, "copy_h2d_async")?;
        st.h2d_bytes += len as u64;
        st.issue(
            self.asynchronous,
            self.contents,
            PendingOp {
                seq: 0,
                stream,
                what: "copy_h2d_async",
                kind: OpKind::Copy { src: s, dst: d },
                via: Some((dst, len as u64)),
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const P: usize = 2 << 20;

    #[test]
    fn enforces_driver_rules() {
        let d = SimDevice::new(4 * P as u64);
        let h = d.create_physical(P).unwrap();
        let va = d.reserve_va(4 * P, P).unwrap();
        assert!(d.map(va + 1, P, h).is_err(), "unaligned map");
        assert!(d.map(va, 2 * P, h).is_err(), "size differs from the handle");
        d.map(va, P, h).unwrap();
        assert!(d.map(va, P, h).is_err(), "map over a mapped range");
        assert!(d.release_physical(h).is_err(), "release while mapped");
        assert!(d.free_va(va, 4 * P).is_err(), "free with mappings inside");
        assert!(d.set_access(va, 2 * P).is_err(), "access over a hole");
        assert_eq!(d.translate(va), None, "no access granted yet");
        d.set_access(va, P).unwrap();
        assert_eq!(d.translate(va + 5), Some((h, 5)));
        assert!(d.unmap(va, 2 * P).is_err(), "unmap must match one mapping");
        d.unmap(va, P).unwrap();
        d.release_physical(h).unwrap();
        d.free_va(va, 4 * P).unwrap();
        assert_eq!(d.calls().map, 3);
        assert_eq!(d.physical_bytes(), 0);
    }

    #[test]
    fn capacity_limit_is_out_of_memory() {
        let d = SimDevice::new(2 * P as u64);
        let _a = d.create_physical(P).unwrap();
        let _b = d.create_physical(P).unwrap();
        assert_eq!(d.create_physical(P), Err(DeviceError::OutOfMemory));
    }

    /// Maps `n` pages at a fresh reservation with access; returns its address.
    fn mapped(d: &SimDevice, n: usize) -> (DevicePtr, Vec<PhysHandle>) {
        let va = d.reserve_va(n * P, P).unwrap();
        let hs: Vec<PhysHandle> = (0..n)
            .map(|i| {
                let h = d.create_physical(P).unwrap();
                d.map(va + (i * P) as u64, P, h).unwrap();
                h
            })
            .collect();
        d.set_access(va, n * P).unwrap();
        (va, hs)
    }

    #[test]
    fn copies_round_trip_contents() {
        let d = SimDevice::new(8 * P as u64);
        let (a, _) = mapped(&d, 2);
        let (b, _) = mapped(&d, 2);
        let len = P as u64 + 4096; // across a page boundary
        d.fill(a + P as u64 - 2048, len, 42, 0).unwrap();
        let want = SimDevice::fill_checksum(len, 42);
        assert_eq!(d.checksum(a + P as u64 - 2048, len).unwrap(), want);
        assert_ne!(d.checksum(b, len).unwrap(), want);
        let h = d.alloc_host(len as usize).unwrap();
        d.copy_d2h_async(h, a + P as u64 - 2048, len as usize, 0)
            .unwrap();
        assert_eq!(d.host_checksum(h, len).unwrap(), want);
        d.copy_h2d_async(b + 512, h, len as usize, 0).unwrap();
        assert_eq!(d.checksum(b + 512, len).unwrap(), want);
        assert_eq!(d.copied_bytes(), (len, len));
        assert!(d.copy_h2d_async(b + 1, h, 512, 0).is_err(), "unaligned");
        assert!(
            d.copy_h2d_async(b, HostPtr(h.0 + len), 512, 0).is_err(),
            "past the buffer"
        );
        d.free_host(h).unwrap();
        assert!(d.free_host(h).is_err());
        assert!(d.hazards().is_empty());
    }

    #[test]
    fn completing_a_stream_runs_what_its_waits_waited_for() {
        // The tier's property test found this (a block freed on stream 0 reused on stream 1,
        // then a block freed on stream 1 reused on stream 0): stream 1's write waited for stream
        // 0's, stream 2 waited for stream 1; completing stream 2 must run stream 0's write
        // before stream 1's, as a GPU would, or stream 0's older write lands last.
        let d = SimDevice::new(8 * P as u64).asynchronous();
        let (a, _) = mapped(&d, 1);
        let (e0, e1) = (d.create_event().unwrap(), d.create_event().unwrap());
        d.fill(a, P as u64, 7, 0).unwrap();
        d.record_event(e0, 0).unwrap();
        d.stream_wait_event(1, e0).unwrap();
        d.fill(a, P as u64, 8, 1).unwrap();
        d.record_event(e1, 1).unwrap();
        d.stream_wait_event(2, e1).unwrap();
        assert!(d.hazards().is_empty(), "{:?}", d.hazards());
        d.complete_stream(2);
        assert_eq!(d.queued_ops(), 0, "stream 0's write ran, then stream 1's");
        assert_eq!(
            d.checksum(a, P as u64).unwrap(),
            SimDevice::fill_checksum(P as u64, 8)
        );
        // A wait covers only what was issued before its event's record: stream 0's later work
        // stays queued when stream 2 completes.
        d.record_event(e0, 0).unwrap();
        d.stream_wait_event(1, e0).unwrap();
        d.fill(a, P as u64, 9, 1).unwrap();
        d.record_event(e1, 1).unwrap();
        d.stream_wait_event(2, e1).unwrap();
        let (b, _) = mapped(&d, 1);
        d.fill(b, P as u64, 10, 0).unwrap();
        d.complete_stream(2);
        assert_eq!(
            d.queued_ops(),
            1,
            "stream 0's fill after the record is not waited for"
        );
        d.synchronize().unwrap();
    }

    #[test]
    fn a_stream_wait_orders_work_across_streams() {
        let d = SimDevice::new(8 * P as u64).asynchronous();
        let (a, _) = mapped(&d, 1);
        let e = d.create_event().unwrap();
        // Stream 1 writes; stream 2 waits for an event recorded after it, then writes the same
        // memory: ordered, no race, and completing stream 2 runs stream 1's write first.
        d.fill(a, P as u64, 7, 1).unwrap();
        d.record_event(e, 1).unwrap();
        d.stream_wait_event(2, e).unwrap();
        d.fill(a, 512, 8, 2).unwrap();
        assert!(d.hazards().is_empty(), "{:?}", d.hazards());
        assert_eq!(d.stream_waits(), vec![(2, Some(1))]);
        d.complete_stream(2);
        assert_eq!(d.queued_ops(), 0, "stream 1's write ran before stream 2's");
        // Work stream 1 queues after the record is not covered: a race.
        d.fill(a, P as u64, 9, 1).unwrap();
        d.fill(a, 512, 10, 2).unwrap();
        assert_eq!(d.hazards().len(), 1, "{:?}", d.hazards());
        assert_eq!(d.calls().stream_wait, 1);
        assert!(d.stream_wait_event(2, EventHandle(999)).is_err());
        d.synchronize().unwrap();
    }

    #[test]
    fn asynchronous_copies_run_at_completion_and_races_are_hazards() {
        let d = SimDevice::new(8 * P as u64).asynchronous();
        let (a, hs) = mapped(&d, 1);
        let h = d.alloc_host(P).unwrap();
        d.fill(a, P as u64, 7, 1).unwrap();
        d.copy_d2h_async(h, a, P, 1).unwrap(); // same stream: ordered after the fill
        assert!(d.checksum(a, P as u64).is_err(), "queued fill writes there");
        assert_eq!(d.queued_ops(), 2);
        assert!(d.hazards().is_empty());
        d.complete_all();
        assert_eq!(d.queued_ops(), 0);
        assert_eq!(
            d.host_checksum(h, P as u64).unwrap(),
            SimDevice::fill_checksum(P as u64, 7)
        );
        // A copy out on stream 1 and a kernel writing the same memory on stream 2: a race.
        d.copy_d2h_async(h, a, P, 1).unwrap();
        d.fill(a, 512, 8, 2).unwrap();
        assert_eq!(d.hazards().len(), 1, "{:?}", d.hazards());
        // Freeing the buffer, unmapping the range the work reaches memory through, or
        // releasing the page under queued work: hazards too.
        d.free_host(h).unwrap();
        d.unmap(a, P).unwrap();
        d.release_physical(hs[0]).unwrap();
        assert_eq!(d.hazards().len(), 4, "{:?}", d.hazards());
        assert!(d.hazards()[2].contains("unmap"), "{:?}", d.hazards());
        d.synchronize().unwrap();
        assert_eq!(d.queued_ops(), 0);
    }

    #[test]
    fn streams_complete_separately() {
        let d = SimDevice::new(8 * P as u64).asynchronous();
        let (a, _) = mapped(&d, 2);
        d.fill(a, P as u64, 1, 1).unwrap();
        d.fill(a + P as u64, P as u64, 2, 2).unwrap();
        let (e1, e2) = (d.create_event().unwrap(), d.create_event().unwrap());
        d.record_event(e1, 1).unwrap();
        d.record_event(e2, 2).unwrap();
        assert_eq!((d.pending_on(e1), d.pending_on(e2)), (Some(1), Some(2)));
        d.complete_stream(2);
        assert!(!d.query_event(e1).unwrap() && d.query_event(e2).unwrap());
        assert_eq!(d.queued_ops(), 1, "stream 1's fill is still queued");
        // Waiting for an event completes its stream only.
        let e3 = d.create_event().unwrap();
        d.fill(a + P as u64, P as u64, 3, 2).unwrap();
        d.record_event(e3, 2).unwrap();
        d.wait_event(e1).unwrap();
        assert!(d.query_event(e1).unwrap() && !d.query_event(e3).unwrap());
        assert_eq!(
            d.checksum(a, P as u64).unwrap(),
            SimDevice::fill_checksum(P as u64, 1)
        );
        d.complete_all();
        assert!(d.query_event(e3).unwrap());
        assert!(d.hazards().is_empty(), "{:?}", d.hazards());
    }

    #[test]
    fn events_of_high_streams_stay_pending_the_others_complete() {
        let d = SimDevice::new(P as u64).pending_from(100);
        let (low, high) = (d.create_event().unwrap(), d.create_event().unwrap());
        d.record_event(low, 7).unwrap();
        d.record_event(high, 100).unwrap();
        assert!(d.query_event(low).unwrap());
        assert!(!d.query_event(high).unwrap());
        d.complete_stream(101);
        assert!(!d.query_event(high).unwrap());
        d.complete_stream(100);
        assert!(d.query_event(high).unwrap());
    }

    #[test]
    fn asynchronous_events_wait_for_completion() {
        let d = SimDevice::new(P as u64).asynchronous();
        let e = d.create_event().unwrap();
        d.record_event(e, 7).unwrap();
        assert!(!d.query_event(e).unwrap());
        d.complete_all();
        assert!(d.query_event(e).unwrap());
        d.destroy_event(e).unwrap();
        assert!(d.query_event(e).is_err());
    }
}
