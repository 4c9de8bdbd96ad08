//! A host tier under the allocator (issue 16): tensors handed to the tier with four calls,
//! after the memory-harvesting ("Ravenstore") report:
//!
//! - [`Tier::create`]: device memory for a new tensor (through the [`Allocator`]); returns a
//!   handle ([`TensorId`]) and the pointer. The tensor is *resident*: in use by the client.
//! - [`Tier::get`]: the tensor must be on the GPU. If it was evicted, device memory is allocated
//!   again (possibly other pages: stitching makes the placement free) and the contents copied
//!   back, stream-ordered on the asked stream; the pointer comes back with the event of a copy
//!   still in flight and its stream ([`Fetched`]).
//! - [`Tier::put`]: not needed now, maybe later, with an optional *next use* (a logical time,
//!   e.g. a step index, in the units of [`Tier::advance`]). Only put tensors are evicted.
//! - [`Tier::free`]: the tensor is gone.
//!
//! Under memory pressure (a device budget on the bytes the tier holds on the device, or the
//! allocator's out-of-memory on create or get), put tensors are evicted to pinned host memory,
//! chosen by an [`EvictionPolicy`]: [`Lru`] (baseline) or [`SizeLatencyAware`] (a documented
//! cost over size, copy time and next use). [`Tier::advance`] moves the clock and starts copying
//! back evicted tensors whose next use is within reach (their copy time ahead, plus a margin).
//!
//! # States and invariants (checked by [`Tier::verify`])
//!
//! ```text
//! create ─> Resident ─put─> Put ─evict / offload─> Evicting ─copy out done─> Evicted
//!             ^  ^           │                        │                         │
//!             │  └────get────┘                        │ get (rescue: the block  │ get (miss) or
//!             │  └───────────────get──────────────────┘  is still intact)       │ advance (prefetch)
//!             │                                                                 v
//!             └──────────────────────get──────────────────────────────────── Fetching
//!                                                      Put <─copy in done (no get yet)─┘
//! free: from any state (memory a copy still uses waits for its event).
//! ```
//!
//! 1. A tensor's bytes live in exactly one place the client can observe: its device block
//!    (Resident, Put, Fetching, Evicting — the block is intact until the eviction completes)
//!    or its host buffer (Evicted). A get of an evicted tensor gets a new block (`verify`
//!    checks every block held is a live allocation of the allocator, held once).
//! 2. Every copy is queued on the tensor's stream (the stream of its last create, get or
//!    put): the copy out is ordered after the kernels that used the tensor there, the copy in
//!    before the kernels the client queues after `get`. Clients using a tensor on several
//!    streams order them before `put` (as with any CUDA memory).
//! 3. A device block being copied out is given back to the allocator only after the event
//!    recorded after its copy completed (Evicting → Evicted happens in `reap`, never before);
//!    with [`TierConfig::eager_free`], stream-ordered as soon as the copy is queued (the copy's
//!    stream recorded on the block), the tensor Evicted with the copy's event guarding its
//!    host buffer.
//! 4. A host buffer is freed only after every copy to or from it completed: after the copy-in
//!    event (Fetching, or a resident tensor's pending copy-in), or after the copy-out event of
//!    an eviction that a get rescued (a *zombie*).
//! 5. With a budget, the device bytes the tier holds (Resident, Put, Fetching and Evicting
//!    tensors, and zombies that still hold a block) never exceed it: an allocation that would
//!    exceed it first waits for evictions to complete. Once memory was adopted
//!    ([`Tier::adopt`]): the device bytes minus evictions in flight stay within it, unless no
//!    put tensor is left to evict.
//! 6. Statistics equal a recount: device and host bytes held, gets = hits + misses.

use crate::allocator::Allocator;
use crate::device::{Device, DevicePtr, EventHandle, HostPtr, StreamId};
use crate::error::{Error, OomInfo, Result};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Copies move whole 512-byte units (the allocator's block granularity).
const UNIT: u64 = 512;

/// A tensor handed to the tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub u64);

/// Where a tensor is, as [`Tier::state`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorState {
    Resident,
    Put,
    Evicting,
    Evicted,
    Fetching,
}

/// What [`Tier::get`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fetched {
    pub ptr: DevicePtr,
    /// The stream asked for: the tensor belongs to it from now on.
    pub stream: StreamId,
    /// When a copy into (or, for a rescued eviction, out of) the block is still in flight: the
    /// event recorded after it, and the stream it was queued on. Work queued on that stream after `get` sees the contents; work
    /// on another stream waits for the event first (valid until the next call into the tier).
    pub event: Option<(EventHandle, StreamId)>,
    /// True if the tensor was on the device (or on its way back by prefetch) when asked for.
    pub hit: bool,
}

/// Tier settings.
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// The most device bytes the tier's tensors may hold (None: only the allocator's limit).
    pub device_budget: Option<u64>,
    /// Host <-> device bandwidth in bytes per second (default 25e9: the order of what pinned
    /// copies of large buffers reach over PCIe Gen5 x16 on an H100 in published measurements;
    /// not measured by this project yet — set it from a measurement on the machine).
    pub bandwidth: f64,
    /// Fixed cost of one copy in seconds (launch and DMA setup; default 10 µs).
    pub copy_latency: f64,
    /// Seconds per unit of the logical clock of `next_use` and `advance` (default 1 ms).
    pub tick_seconds: f64,
    /// Prefetch this many ticks earlier than the copy time alone asks (default 1).
    pub prefetch_margin: u64,
    /// Bytes of pinned host buffers kept for reuse once their tensor is back on the device
    /// (`cuMemHostAlloc` is slow: a job evicting the same sizes every step allocates once).
    /// A buffer is reused for a tensor of exactly its size. Default 0: none kept.
    pub host_cache: u64,
    /// Give an evicted tensor's block back to the allocator as soon as its copy out is queued
    /// (stream-ordered, as any free: reused on its stream by work queued after the copy, on
    /// other streams after the copy's stream is recorded on it) instead of once the copy has
    /// completed. The host buffer stays guarded by the copy's event; an eviction can then not be
    /// rescued (a get copies back). Default false; the PyTorch bridge sets it.
    pub eager_free: bool,
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            device_budget: None,
            bandwidth: 25e9,
            copy_latency: 10e-6,
            tick_seconds: 1e-3,
            prefetch_margin: 1,
            host_cache: 0,
            eager_free: false,
        }
    }
}

impl TierConfig {
    /// Seconds one copy of `bytes` takes (one way).
    pub fn copy_time(&self, bytes: u64) -> f64 {
        self.copy_latency + bytes as f64 / self.bandwidth
    }

    /// How many ticks before its next use a tensor of `bytes` is prefetched.
    pub fn lookahead(&self, bytes: u64) -> u64 {
        (self.copy_time(bytes) / self.tick_seconds).ceil() as u64 + self.prefetch_margin
    }
}

/// A put tensor that may be evicted, as a policy sees it.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub id: TensorId,
    /// Bytes on the device (rounded to 512).
    pub bytes: u64,
    /// Order of the last create, get or put (higher: more recent).
    pub last_touch: u64,
    /// Declared next use (logical time), if any.
    pub next_use: Option<u64>,
}

/// Chooses which put tensors to evict.
pub trait EvictionPolicy: Send {
    fn name(&self) -> &'static str;
    /// Indices into `candidates`, in eviction order, whose bytes together reach `need` (or all
    /// of them, if they cannot). `now` is the tier's clock; `cfg` gives bandwidth and ticks.
    fn choose(&self, candidates: &[Candidate], need: u64, now: u64, cfg: &TierConfig)
        -> Vec<usize>;
}

/// Least recently used first (by create / get / put order), whatever the sizes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lru;

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn choose(&self, c: &[Candidate], need: u64, _now: u64, _cfg: &TierConfig) -> Vec<usize> {
        let mut order: Vec<usize> = (0..c.len()).collect();
        order.sort_by_key(|&i| (c[i].last_touch, c[i].id));
        take_until(c, order, need)
    }
}

fn take_until(c: &[Candidate], order: Vec<usize>, need: u64) -> Vec<usize> {
    let mut got = 0;
    let mut out = Vec::new();
    for i in order {
        if got >= need {
            break;
        }
        got += c[i].bytes;
        out.push(i);
    }
    out
}

/// Size- and latency-aware eviction: greedy on a cost per useful byte.
///
/// With `need` bytes still to free, each candidate `c` of `b` bytes is scored
///
/// ```text
/// useful(c)  = min(b, need)                        bytes of the request it covers
/// move(c)    = 2 * (latency + b / bandwidth)       seconds of copying: out now, back later
/// slack(c)   = (next_use - now) * tick_seconds     seconds until it is needed (inf if none)
/// urgency(c) = 1 + horizon / slack(c)              1 when needed far away (or never declared)
/// cost(c)    = move(c) * urgency(c) / useful(c)    seconds per useful byte
/// ```
///
/// and the cheapest is evicted, `need` reduced, and the scores recomputed, until `need` is
/// covered. So: a huge tensor is not evicted for a tiny request when a smaller one covers it
/// (`useful` caps what it is worth, `move` counts all it costs); tiny tensors that free next to
/// nothing cost their copy latency for few bytes; of equal sizes, the one needed latest goes
/// first (Belady's rule), and one needed before it could come back (`slack` below `move`)
/// costs several times more. `horizon` (seconds) sets how strongly next use counts against
/// size; its default, 64 ticks, makes a tensor needed 64 ticks ahead cost twice as much.
#[derive(Clone, Copy, Debug, Default)]
pub struct SizeLatencyAware {
    /// In seconds; None: 64 ticks of the tier's clock.
    pub horizon: Option<f64>,
}

impl SizeLatencyAware {
    /// The cost (seconds of copying per useful byte, weighted by urgency) of evicting `c` to
    /// cover `need` more bytes.
    pub fn cost(&self, c: &Candidate, need: u64, now: u64, cfg: &TierConfig) -> f64 {
        let horizon = self.horizon.unwrap_or(64.0 * cfg.tick_seconds);
        let useful = c.bytes.min(need).max(1) as f64;
        let moving = 2.0 * cfg.copy_time(c.bytes);
        let urgency = match c.next_use {
            None => 1.0,
            Some(t) => {
                let slack = (t.saturating_sub(now) as f64 * cfg.tick_seconds).max(1e-9);
                1.0 + horizon / slack
            }
        };
        moving * urgency / useful
    }
}

impl EvictionPolicy for SizeLatencyAware {
    fn name(&self) -> &'static str {
        "aware"
    }
    fn choose(&self, c: &[Candidate], need: u64, now: u64, cfg: &TierConfig) -> Vec<usize> {
        let mut left: Vec<usize> = (0..c.len()).collect();
        let mut need = need;
        let mut out = Vec::new();
        while need > 0 && !left.is_empty() {
            let (k, _) = left
                .iter()
                .enumerate()
                .map(|(k, &i)| (k, self.cost(&c[i], need, now, cfg)))
                .min_by(|a, b| {
                    a.1.total_cmp(&b.1)
                        .then(c[left[b.0]].next_use.cmp(&c[left[a.0]].next_use))
                })
                .expect("non-empty");
            let i = left.swap_remove(k);
            need = need.saturating_sub(c[i].bytes);
            out.push(i);
        }
        out
    }
}

/// What the tier has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    pub creates: u64,
    pub gets: u64,
    /// Gets that found the tensor on the device (or on its way back by prefetch).
    pub hits: u64,
    /// Gets that had to start a copy back.
    pub misses: u64,
    pub puts: u64,
    pub frees: u64,
    /// Evictions started.
    pub evictions: u64,
    /// Evictions cancelled by a get while the copy out was in flight.
    pub rescues: u64,
    /// Copies back started by `advance`.
    pub prefetches: u64,
    pub bytes_to_host: u64,
    pub bytes_to_device: u64,
    /// Times the tier waited for the device (`synchronize`) to free memory.
    pub waits: u64,
    /// Device bytes held by the tier's tensors, now and at most.
    pub device_bytes: u64,
    pub peak_device_bytes: u64,
    /// Pinned host bytes held by tensors, now and at most.
    pub host_bytes: u64,
    pub peak_host_bytes: u64,
    /// Pinned host bytes kept for reuse (`TierConfig::host_cache`), and buffers allocated.
    pub host_cached_bytes: u64,
    pub host_allocs: u64,
    /// Tensors adopted: memory the client allocated and handed over ([`Tier::adopt`]).
    pub adopts: u64,
}

/// A copy back still in flight into a resident or put tensor's block.
#[derive(Clone, Copy, Debug)]
struct CopyIn {
    host: HostPtr,
    event: EventHandle,
    /// The stream it was queued on.
    stream: StreamId,
}

#[derive(Debug)]
enum State {
    /// In use by the client. `copy_in`: the host buffer of a copy back still in flight.
    Resident {
        ptr: DevicePtr,
        copy_in: Option<CopyIn>,
    },
    Put {
        ptr: DevicePtr,
        copy_in: Option<CopyIn>,
    },
    Evicting {
        ptr: DevicePtr,
        host: HostPtr,
        event: EventHandle,
    },
    Evicted {
        host: HostPtr,
        /// With `eager_free`: the event after the copy out still writing `host`, and its stream.
        out: Option<(EventHandle, StreamId)>,
    },
    Fetching {
        ptr: DevicePtr,
        host: HostPtr,
        event: EventHandle,
    },
}

impl State {
    fn public(&self) -> TensorState {
        match self {
            State::Resident { .. } => TensorState::Resident,
            State::Put { .. } => TensorState::Put,
            State::Evicting { .. } => TensorState::Evicting,
            State::Evicted { .. } => TensorState::Evicted,
            State::Fetching { .. } => TensorState::Fetching,
        }
    }
    fn device_ptr(&self) -> Option<DevicePtr> {
        match *self {
            State::Resident { ptr, .. }
            | State::Put { ptr, .. }
            | State::Evicting { ptr, .. }
            | State::Fetching { ptr, .. } => Some(ptr),
            State::Evicted { .. } => None,
        }
    }
    fn host(&self) -> Option<HostPtr> {
        match *self {
            State::Resident { copy_in, .. } | State::Put { copy_in, .. } => copy_in.map(|c| c.host),
            State::Evicting { host, .. }
            | State::Evicted { host, .. }
            | State::Fetching { host, .. } => Some(host),
        }
    }
    fn event(&self) -> Option<EventHandle> {
        match *self {
            State::Resident { copy_in, .. } | State::Put { copy_in, .. } => {
                copy_in.map(|c| c.event)
            }
            State::Evicting { event, .. } | State::Fetching { event, .. } => Some(event),
            State::Evicted { out, .. } => out.map(|(e, _)| e),
        }
    }
}

#[derive(Debug)]
struct Entry {
    /// Bytes as created, and rounded to whole units (what is allocated and copied).
    size: u64,
    bytes: u64,
    stream: StreamId,
    state: State,
    next_use: Option<u64>,
    last_touch: u64,
}

/// Memory waiting for an event before it goes back: a freed tensor's block and host buffer
/// with a copy still in flight, or the host buffer of a rescued eviction.
#[derive(Debug)]
struct Zombie {
    ptr: Option<DevicePtr>,
    host: Option<HostPtr>,
    /// The tensor's bytes: of the block and of the host buffer, whichever are held.
    bytes: u64,
    event: EventHandle,
}

struct Inner {
    cfg: TierConfig,
    policy: Box<dyn EvictionPolicy>,
    entries: BTreeMap<TensorId, Entry>,
    zombies: Vec<Zombie>,
    next_id: u64,
    touch: u64,
    now: u64,
    events: Vec<EventHandle>,
    /// Pinned buffers kept for reuse, by size.
    host_cache: BTreeMap<u64, Vec<HostPtr>>,
    stats: TierStats,
}

/// A tier of tensors over an allocator; see the module documentation.
pub struct Tier<D: Device> {
    alloc: Arc<Allocator<D>>,
    inner: Mutex<Inner>,
}

fn unknown(id: TensorId) -> Error {
    Error::InvalidState(format!("unknown tier tensor {}", id.0))
}

/// How a request for device memory should treat pressure.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pressure {
    /// Evict, and wait for the device when evictions must complete first (create, get).
    Wait,
    /// Neither evict nor wait (prefetch): None if there is no room now.
    NoWait,
}

impl<D: Device> Tier<D> {
    pub fn new(alloc: Arc<Allocator<D>>, cfg: TierConfig, policy: Box<dyn EvictionPolicy>) -> Self {
        Tier {
            alloc,
            inner: Mutex::new(Inner {
                cfg,
                policy,
                entries: BTreeMap::new(),
                zombies: Vec::new(),
                next_id: 1,
                touch: 0,
                now: 0,
                events: Vec::new(),
                host_cache: BTreeMap::new(),
                stats: TierStats::default(),
            }),
        }
    }

    pub fn allocator(&self) -> &Arc<Allocator<D>> {
        &self.alloc
    }

    pub fn policy_name(&self) -> &'static str {
        self.inner.lock().policy.name()
    }

    pub fn config(&self) -> TierConfig {
        self.inner.lock().cfg.clone()
    }

    pub fn set_budget(&self, budget: Option<u64>) {
        self.inner.lock().cfg.device_budget = budget;
    }

    pub fn stats(&self) -> TierStats {
        self.inner.lock().stats
    }

    /// The tier's clock (last `advance`).
    pub fn now(&self) -> u64 {
        self.inner.lock().now
    }

    pub fn state(&self, id: TensorId) -> Option<TensorState> {
        self.inner.lock().entries.get(&id).map(|e| e.state.public())
    }

    /// The bytes the tensor was created with.
    pub fn size(&self, id: TensorId) -> Option<u64> {
        self.inner.lock().entries.get(&id).map(|e| e.size)
    }

    /// Tensors held.
    pub fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Device memory for a new tensor of `size` bytes used on `stream`; the tensor is resident.
    pub fn create(&self, size: u64, stream: StreamId) -> Result<(TensorId, DevicePtr)> {
        if size == 0 {
            return Err(Error::InvalidState(
                "a tier tensor has at least one byte".into(),
            ));
        }
        let bytes = size.div_ceil(UNIT) * UNIT;
        let mut g = self.inner.lock();
        self.reap(&mut g)?;
        let ptr = self
            .device_memory(&mut g, bytes, stream, Pressure::Wait)?
            .expect("waiting requests get memory or an error");
        let id = TensorId(g.next_id);
        g.next_id += 1;
        g.touch += 1;
        let touch = g.touch;
        g.entries.insert(
            id,
            Entry {
                size,
                bytes,
                stream,
                state: State::Resident { ptr, copy_in: None },
                next_use: None,
                last_touch: touch,
            },
        );
        g.stats.creates += 1;
        g.add_device(bytes as i64);
        Ok((id, ptr))
    }

    /// Marks the tensor not needed now; `next_use` declares when it is needed again (logical
    /// time of `advance`). It was last used on the stream of its create or get.
    pub fn put(&self, id: TensorId, next_use: Option<u64>) -> Result<()> {
        let mut g = self.inner.lock();
        self.reap(&mut g)?;
        g.touch += 1;
        let touch = g.touch;
        let e = g.entries.get_mut(&id).ok_or_else(|| unknown(id))?;
        match e.state {
            State::Resident { ptr, copy_in } => e.state = State::Put { ptr, copy_in },
            _ => {
                return Err(Error::InvalidState(format!(
                    "put of tier tensor {} that is not resident ({:?})",
                    id.0,
                    e.state.public()
                )))
            }
        }
        e.next_use = next_use;
        e.last_touch = touch;
        g.stats.puts += 1;
        if g.stats.adopts > 0 {
            self.shed(&mut g)?;
        }
        Ok(())
    }

    /// Declares when a tensor is needed next (`None`: unknown), in any state: the policy and
    /// prefetch read it from now on. For a client whose owners of one tensor come and go (the
    /// PyTorch bridge keeps the earliest next use among a tensor's handles).
    pub fn set_next_use(&self, id: TensorId, next_use: Option<u64>) -> Result<()> {
        let mut g = self.inner.lock();
        let e = g.entries.get_mut(&id).ok_or_else(|| unknown(id))?;
        e.next_use = next_use;
        Ok(())
    }

    /// Takes over a live allocation of the allocator made by the client (e.g. a PyTorch
    /// tensor's storage): the block at `ptr` (the start of an allocation) holding `size` bytes
    /// last used on `stream` becomes a resident tier tensor; the tier frees it from now on.
    ///
    /// Its memory exists already, so the budget cannot refuse it: when adopted memory takes
    /// the tier over its budget, `adopt` and `put` start evicting put tensors (never waiting),
    /// and invariant 5 becomes: device bytes minus the bytes of evictions in flight stay
    /// within the budget, unless no put tensor is left to evict ([`Tier::verify`]).
    pub fn adopt(&self, ptr: DevicePtr, size: u64, stream: StreamId) -> Result<TensorId> {
        if size == 0 {
            return Err(Error::InvalidState(
                "a tier tensor has at least one byte".into(),
            ));
        }
        let bytes = size.div_ceil(UNIT) * UNIT;
        match self.alloc.allocation(ptr) {
            Some(a) if a.ptr == ptr && a.size >= bytes => {}
            Some(a) => {
                return Err(Error::InvalidState(format!(
                    "adopt of {ptr:#x} ({size} bytes): it lies in the allocation {:#x} of {} \
                     bytes, not at its start with room for {bytes}",
                    a.ptr, a.size
                )))
            }
            None => return Err(Error::UnknownPointer(ptr)),
        }
        let mut g = self.inner.lock();
        self.reap(&mut g)?;
        if g.entries
            .values()
            .any(|e| e.state.device_ptr() == Some(ptr))
            || g.zombies.iter().any(|z| z.ptr == Some(ptr))
        {
            return Err(Error::InvalidState(format!(
                "adopt of {ptr:#x}: the tier holds it already"
            )));
        }
        let id = TensorId(g.next_id);
        g.next_id += 1;
        g.touch += 1;
        let touch = g.touch;
        g.entries.insert(
            id,
            Entry {
                size,
                bytes,
                stream,
                state: State::Resident { ptr, copy_in: None },
                next_use: None,
                last_touch: touch,
            },
        );
        g.stats.adopts += 1;
        g.add_device(bytes as i64);
        self.shed(&mut g)?;
        Ok(id)
    }

    /// Frees device memory for an allocation of `bytes` the allocator refused (the client's
    /// own, outside the tier): evicts put tensors (the policy chooses) and waits for the device
    /// so that their blocks, and those of evictions already in flight, go back. Returns the
    /// device bytes the tier gave back.
    pub fn relieve(&self, bytes: u64) -> Result<u64> {
        let mut g = self.inner.lock();
        self.reap(&mut g)?;
        let before = g.stats.device_bytes;
        let in_flight = g.evicting_bytes();
        let need = bytes.saturating_sub(in_flight);
        let evicted = if need > 0 {
            self.evict_for(&mut g, need)?
        } else {
            0
        };
        if evicted > 0 || in_flight > 0 {
            self.wait(&mut g)?;
        }
        Ok(before.saturating_sub(g.stats.device_bytes))
    }

    /// Replaces the settings and the policy (tensors held stay; a lower budget is reached by
    /// the evictions of later calls).
    pub fn reconfigure(&self, cfg: TierConfig, policy: Box<dyn EvictionPolicy>) -> Result<()> {
        let mut g = self.inner.lock();
        self.reap(&mut g)?;
        g.cfg = cfg;
        g.policy = policy;
        if g.stats.adopts > 0 {
            self.shed(&mut g)?;
        }
        Ok(())
    }

    /// Starts evicting a put tensor now (a client that knows it is not needed for long), without
    /// waiting: the tensor is Evicting until its copy out completes (`poll`, `advance`).
    pub fn offload(&self, id: TensorId) -> Result<()> {
        let mut g = self.inner.lock();
        self.reap(&mut g)?;
        match g.entries.get(&id).map(|e| &e.state) {
            None => Err(unknown(id)),
            Some(State::Put { copy_in: None, .. }) => self.evict(&mut g, id),
            Some(State::Evicting { .. } | State::Evicted { .. }) => Ok(()),
            Some(s) => Err(Error::InvalidState(format!(
                "offload of tier tensor {} in state {:?} (put it first, and let its copy back \
                 complete)",
                id.0,
                s.public()
            ))),
        }
    }

    /// Makes sure the tensor is on the device for use on `stream`, copying it back if it was
    /// evicted. Getting a resident tensor again is allowed (it stays resident).
    pub fn get(&self, id: TensorId, stream: StreamId) -> Result<Fetched> {
        let mut g = self.inner.lock();
        self.reap(&mut g)?;
        g.touch += 1;
        let touch = g.touch;
        let e = g.entries.get(&id).ok_or_else(|| unknown(id))?;
        let (bytes, old_stream) = (e.bytes, e.stream);
        let mut rescued = None;
        let (ptr, copy_in, hit) = match e.state {
            State::Resident { ptr, copy_in } | State::Put { ptr, copy_in } => (ptr, copy_in, true),
            State::Fetching { ptr, host, event } => (
                ptr,
                Some(CopyIn {
                    host,
                    event,
                    stream: old_stream,
                }),
                true,
            ),
            State::Evicting { ptr, host, event } => {
                // The copy out only reads the block: the data is still there. The host buffer
                // goes once the copy out is done; work on another stream must not write the
                // block before that either (the event is returned, as for a copy in).
                g.zombies.push(Zombie {
                    ptr: None,
                    host: Some(host),
                    bytes,
                    event,
                });
                g.stats.rescues += 1;
                rescued = Some((event, old_stream));
                (ptr, None, true)
            }
            State::Evicted { host, out } => {
                if let Some((_, s)) = out {
                    if s != stream {
                        // The copy out on another stream must complete before the copy back
                        // reads the buffer (no cross-stream waits on the device trait).
                        self.wait(&mut g)?;
                    }
                    // On the same stream the copy back is queued after it: ordered.
                }
                let ptr = self
                    .device_memory(&mut g, bytes, stream, Pressure::Wait)?
                    .expect("waiting requests get memory or an error");
                let event = match self.copy_in(&mut g, ptr, host, bytes, stream) {
                    Ok(ev) => ev,
                    Err(err) => {
                        let _ = self.alloc.free(ptr);
                        return Err(err);
                    }
                };
                g.add_device(bytes as i64);
                // A copy out still in flight (same stream, ordered before the copy back): its
                // event goes back to the pool; the copy back's event now guards the buffer.
                if let State::Evicted {
                    out: Some((ev, _)), ..
                } = g.entries[&id].state
                {
                    g.events.push(ev);
                }
                let e = g.entries.get_mut(&id).expect("looked up above");
                e.stream = stream;
                e.state = State::Resident {
                    ptr,
                    copy_in: Some(CopyIn {
                        host,
                        event,
                        stream,
                    }),
                };
                e.last_touch = touch;
                g.stats.gets += 1;
                g.stats.misses += 1;
                return Ok(Fetched {
                    ptr,
                    stream,
                    event: Some((event, stream)),
                    hit: false,
                });
            }
        };
        if stream != old_stream {
            // The block (allocated on the old stream) is used on this one from now on.
            self.alloc.record_stream(ptr, stream)?;
        }
        let e = g.entries.get_mut(&id).expect("looked up above");
        e.stream = stream;
        e.state = State::Resident { ptr, copy_in };
        e.last_touch = touch;
        g.stats.gets += 1;
        g.stats.hits += 1;
        if rescued.is_some() && g.stats.adopts > 0 {
            // The rescued tensor is no longer on its way out: adopted memory over the budget
            // sheds others instead (see `adopt`).
            self.shed(&mut g)?;
        }
        Ok(Fetched {
            ptr,
            stream,
            event: copy_in.map(|c| (c.event, c.stream)).or(rescued),
            hit,
        })
    }

    /// Forgets the tensor; its memory goes back once no copy uses it.
    pub fn free(&self, id: TensorId) -> Result<()> {
        let mut g = self.inner.lock();
        self.reap(&mut g)?;
        let e = g.entries.remove(&id).ok_or_else(|| unknown(id))?;
        g.stats.frees += 1;
        match e.state {
            State::Resident { ptr, copy_in } | State::Put { ptr, copy_in } => {
                // Stream-ordered: the allocator reuses the block on the tensor's stream after
                // the work queued there (the copy in included).
                self.alloc.free(ptr)?;
                g.add_device(-(e.bytes as i64));
                if let Some(c) = copy_in {
                    g.zombies.push(Zombie {
                        ptr: None,
                        host: Some(c.host),
                        bytes: e.bytes,
                        event: c.event,
                    });
                }
            }
            State::Evicting { ptr, host, event } | State::Fetching { ptr, host, event } => {
                g.zombies.push(Zombie {
                    ptr: Some(ptr),
                    host: Some(host),
                    bytes: e.bytes,
                    event,
                });
            }
            State::Evicted { host, out: None } => self.give_host(&mut g, host, e.bytes)?,
            State::Evicted {
                host,
                out: Some((event, _)),
            } => g.zombies.push(Zombie {
                ptr: None,
                host: Some(host),
                bytes: e.bytes,
                event,
            }),
        }
        self.reap(&mut g)
    }

    /// Moves the clock to `now` (never backwards), completes finished copies, and starts
    /// copying back evicted tensors whose next use is within reach: at most
    /// [`TierConfig::lookahead`] ticks ahead, soonest first, as long as they fit in the room
    /// free now (under the budget, and in the allocator without its out-of-memory). A prefetch
    /// never evicts and never waits: evicting for a prefetch trades a tensor needed soon for one
    /// needed a little later, which on the synthetic forward/backward job of
    /// `examples/tier_fwd_bwd.rs` moved more bytes than it saved, whatever the policy.
    pub fn advance(&self, now: u64) -> Result<()> {
        let mut g = self.inner.lock();
        g.now = g.now.max(now);
        self.reap(&mut g)?;
        let now = g.now;
        let mut due: Vec<(u64, TensorId)> = g
            .entries
            .iter()
            .filter_map(|(&id, e)| match (&e.state, e.next_use) {
                (State::Evicted { .. }, Some(t)) if t <= now + g.cfg.lookahead(e.bytes) => {
                    Some((t, id))
                }
                _ => None,
            })
            .collect();
        due.sort();
        for (_, id) in due {
            let e = &g.entries[&id];
            let (bytes, stream) = (e.bytes, e.stream);
            let State::Evicted { host, out } = e.state else {
                continue;
            };
            let Some(ptr) = self.device_memory(&mut g, bytes, stream, Pressure::NoWait)? else {
                break; // later ones would take room from this one
            };
            let event = match self.copy_in(&mut g, ptr, host, bytes, stream) {
                Ok(ev) => ev,
                Err(err) => {
                    let _ = self.alloc.free(ptr);
                    return Err(err);
                }
            };
            g.add_device(bytes as i64);
            g.stats.prefetches += 1;
            // A copy out still in flight was queued on the same stream (the tensor's): the copy
            // back is ordered after it, and its event goes back to the pool.
            if let State::Evicted {
                out: Some((ev, _)), ..
            } = g.entries[&id].state
            {
                g.events.push(ev);
            }
            let _ = out;
            g.entries.get_mut(&id).expect("due").state = State::Fetching { ptr, host, event };
        }
        Ok(())
    }

    /// Completes finished copies (frees what waited for them), without moving the clock.
    pub fn poll(&self) -> Result<()> {
        let mut g = self.inner.lock();
        self.reap(&mut g)
    }

    /// Frees the pinned buffers kept for reuse.
    pub fn trim_host_cache(&self) -> Result<()> {
        let mut g = self.inner.lock();
        let dev = self.alloc.device();
        for (_, v) in std::mem::take(&mut g.host_cache) {
            for h in v {
                dev.free_host(h)?;
            }
        }
        g.stats.host_cached_bytes = 0;
        Ok(())
    }

    /// Waits for the device, then completes every copy.
    pub fn flush(&self) -> Result<()> {
        let mut g = self.inner.lock();
        self.alloc.device().synchronize()?;
        self.reap(&mut g)
    }

    /// Checks the invariants of the module documentation. For tests: O(tensors).
    pub fn verify(&self) -> std::result::Result<(), String> {
        let g = self.inner.lock();
        let mut device = 0u64;
        let mut host = 0u64;
        let mut ptrs = std::collections::HashSet::new();
        let mut hosts = std::collections::HashSet::new();
        let mut events = std::collections::HashSet::new();
        for (id, e) in &g.entries {
            if e.bytes < e.size || e.bytes % UNIT != 0 {
                return Err(format!(
                    "tensor {}: {} bytes for size {}",
                    id.0, e.bytes, e.size
                ));
            }
            if let Some(p) = e.state.device_ptr() {
                device += e.bytes;
                if !ptrs.insert(p) {
                    return Err(format!("tensor {}: block {p:#x} held twice", id.0));
                }
                match self.alloc.allocation(p) {
                    Some(a) if a.ptr == p && a.size >= e.bytes => {}
                    other => {
                        return Err(format!(
                            "tensor {} ({:?}): block {p:#x} is not a live allocation of its size: \
                             {other:?}",
                            id.0,
                            e.state.public()
                        ))
                    }
                }
            }
            if let Some(h) = e.state.host() {
                host += e.bytes;
                if !hosts.insert(h) {
                    return Err(format!(
                        "tensor {}: host buffer {:#x} held twice",
                        id.0, h.0
                    ));
                }
            }
            if let Some(ev) = e.state.event() {
                if !events.insert(ev) {
                    return Err(format!("tensor {}: event {} shared", id.0, ev.0));
                }
            }
        }
        for z in &g.zombies {
            if let Some(p) = z.ptr {
                device += z.bytes;
                if !ptrs.insert(p) || self.alloc.allocation(p).is_none() {
                    return Err(format!("zombie block {p:#x} reused or not live"));
                }
            }
            if let Some(h) = z.host {
                host += z.bytes;
                if !hosts.insert(h) {
                    return Err(format!("zombie host buffer {:#x} held twice", h.0));
                }
            }
        }
        if device != g.stats.device_bytes {
            return Err(format!(
                "device bytes {} but a recount gives {device}",
                g.stats.device_bytes
            ));
        }
        let mut cached = 0;
        for (&size, v) in &g.host_cache {
            for h in v {
                cached += size;
                if !hosts.insert(*h) {
                    return Err(format!("cached host buffer {:#x} also in use", h.0));
                }
            }
        }
        if cached != g.stats.host_cached_bytes || cached > g.cfg.host_cache {
            return Err(format!(
                "host cache holds {cached} bytes, {} counted, {} allowed",
                g.stats.host_cached_bytes, g.cfg.host_cache
            ));
        }
        if host != g.stats.host_bytes {
            return Err(format!(
                "host bytes {} but a recount gives {host}",
                g.stats.host_bytes
            ));
        }
        if let Some(b) = g.cfg.device_budget {
            if g.stats.adopts == 0 {
                if device > b {
                    return Err(format!("device bytes {device} over the budget {b}"));
                }
            } else if device.saturating_sub(g.evicting_bytes()) > b
                && g.entries
                    .values()
                    .any(|e| matches!(e.state, State::Put { copy_in: None, .. }))
            {
                return Err(format!(
                    "device bytes {device} ({} on their way out) over the budget {b} with put \
                     tensors left to evict",
                    g.evicting_bytes()
                ));
            }
        }
        let s = &g.stats;
        if s.gets != s.hits + s.misses {
            return Err(format!(
                "{} gets but {} hits + {} misses",
                s.gets, s.hits, s.misses
            ));
        }
        for ev in &g.events {
            if events.contains(ev) || g.zombies.iter().any(|z| z.event == *ev) {
                return Err(format!("pooled event {} still in use", ev.0));
            }
        }
        Ok(())
    }

    // ---- internals (called with the lock held) ----

    fn event(&self, g: &mut Inner) -> Result<EventHandle> {
        match g.events.pop() {
            Some(e) => Ok(e),
            None => Ok(self.alloc.device().create_event()?),
        }
    }

    fn done(&self, event: EventHandle) -> Result<bool> {
        Ok(self.alloc.device().query_event(event)?)
    }

    /// Queues the copy of `bytes` from `host` to `ptr` on `stream`; returns the event after it.
    fn copy_in(
        &self,
        g: &mut Inner,
        ptr: DevicePtr,
        host: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<EventHandle> {
        let dev = self.alloc.device();
        let event = self.event(g)?;
        let r = dev
            .copy_h2d_async(ptr, host, bytes as usize, stream)
            .and_then(|()| dev.record_event(event, stream));
        if let Err(e) = r {
            g.events.push(event);
            return Err(e.into());
        }
        g.stats.bytes_to_device += bytes;
        Ok(event)
    }

    /// Starts evicting put tensor `id` (no copy in flight): pinned buffer, copy out on its
    /// stream, event after it.
    fn evict(&self, g: &mut Inner, id: TensorId) -> Result<()> {
        let dev = self.alloc.device();
        let e = &g.entries[&id];
        let (bytes, stream) = (e.bytes, e.stream);
        let State::Put { ptr, copy_in: None } = e.state else {
            return Err(Error::InvalidState(format!(
                "eviction of tier tensor {} in state {:?}",
                id.0,
                e.state.public()
            )));
        };
        let host = self.take_host(g, bytes)?;
        let event = match self.event(g) {
            Ok(ev) => ev,
            Err(err) => {
                let _ = dev.free_host(host);
                return Err(err);
            }
        };
        let r = dev
            .copy_d2h_async(host, ptr, bytes as usize, stream)
            .and_then(|()| dev.record_event(event, stream));
        if let Err(err) = r {
            // Nothing was queued, or the copy was and the event not: wait for it before the
            // buffer goes.
            let _ = dev.synchronize();
            let _ = dev.free_host(host);
            g.events.push(event);
            return Err(err.into());
        }
        g.add_host(bytes as i64);
        g.stats.evictions += 1;
        g.stats.bytes_to_host += bytes;
        if g.cfg.eager_free {
            // Stream-ordered: the allocator reuses the block on its stream after the copy, and
            // on other streams only after the copy's stream (recorded here) has passed it.
            let freed = self
                .alloc
                .record_stream(ptr, stream)
                .and_then(|()| self.alloc.free(ptr));
            match freed {
                Ok(()) => {
                    g.add_device(-(bytes as i64));
                    g.entries.get_mut(&id).expect("looked up").state = State::Evicted {
                        host,
                        out: Some((event, stream)),
                    };
                    return Ok(());
                }
                Err(err) => {
                    // Kept as an eviction in flight (the block goes back once the copy is done).
                    tracing::debug!(%err, "gmlake tier: eager free refused");
                }
            }
        }
        g.entries.get_mut(&id).expect("looked up").state = State::Evicting { ptr, host, event };
        Ok(())
    }

    /// Completes what finished: evictions (block back to the allocator), copies in (host
    /// buffer freed), zombies.
    fn reap(&self, g: &mut Inner) -> Result<()> {
        let ids: Vec<TensorId> = g
            .entries
            .iter()
            .filter(|(_, e)| e.state.event().is_some())
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let e = g.entries.get_mut(&id).expect("listed");
            let Some(event) = e.state.event() else {
                continue;
            };
            if !self.done(event)? {
                continue;
            }
            let bytes = e.bytes as i64;
            match e.state {
                State::Evicted { host, out: Some(_) } => {
                    e.state = State::Evicted { host, out: None };
                }
                State::Evicting { ptr, host, .. } => {
                    e.state = State::Evicted { host, out: None };
                    self.alloc.free(ptr)?;
                    g.add_device(-bytes);
                }
                State::Fetching { ptr, host, .. } => {
                    e.state = State::Put { ptr, copy_in: None };
                    self.give_host(g, host, bytes as u64)?;
                }
                State::Resident {
                    ptr,
                    copy_in: Some(c),
                } => {
                    e.state = State::Resident { ptr, copy_in: None };
                    self.give_host(g, c.host, bytes as u64)?;
                }
                State::Put {
                    ptr,
                    copy_in: Some(c),
                } => {
                    e.state = State::Put { ptr, copy_in: None };
                    self.give_host(g, c.host, bytes as u64)?;
                }
                _ => continue,
            }
            g.events.push(event);
        }
        let mut i = 0;
        while i < g.zombies.len() {
            if !self.done(g.zombies[i].event)? {
                i += 1;
                continue;
            }
            let z = g.zombies.swap_remove(i);
            if let Some(p) = z.ptr {
                self.alloc.free(p)?;
                g.add_device(-(z.bytes as i64));
            }
            if let Some(h) = z.host {
                self.give_host(g, h, z.bytes)?;
            }
            g.events.push(z.event);
        }
        // A copy back that completed makes its tensor evictable: adopted memory over the
        // budget sheds it now (see `adopt`).
        if g.stats.adopts > 0 {
            self.shed(g)?;
        }
        Ok(())
    }

    /// A pinned buffer of `bytes`: a cached one of that size, or a new one.
    fn take_host(&self, g: &mut Inner, bytes: u64) -> Result<HostPtr> {
        if let Some(h) = g.host_cache.get_mut(&bytes).and_then(Vec::pop) {
            g.stats.host_cached_bytes -= bytes;
            return Ok(h);
        }
        let h = self.alloc.device().alloc_host(bytes as usize)?;
        g.stats.host_allocs += 1;
        Ok(h)
    }

    /// A tensor's pinned buffer, every copy of which has completed, goes back: into the cache
    /// while it has room, otherwise to the device.
    fn give_host(&self, g: &mut Inner, host: HostPtr, bytes: u64) -> Result<()> {
        g.add_host(-(bytes as i64));
        if g.stats.host_cached_bytes + bytes <= g.cfg.host_cache {
            g.host_cache.entry(bytes).or_default().push(host);
            g.stats.host_cached_bytes += bytes;
            return Ok(());
        }
        Ok(self.alloc.device().free_host(host)?)
    }

    /// Device memory of `bytes` on `stream` for the tier, evicting put tensors under the
    /// budget or on the allocator's out-of-memory. `Ok(None)`: no room now (NoWait only).
    fn device_memory(
        &self,
        g: &mut Inner,
        bytes: u64,
        stream: StreamId,
        pressure: Pressure,
    ) -> Result<Option<DevicePtr>> {
        if let Some(b) = g.cfg.device_budget {
            if bytes > b {
                return Err(self.over_budget(g, bytes, "larger than the tier's device budget"));
            }
        }
        // Each round evicts more, or waits for evictions or copies back in flight (after which
        // they are done, or their tensors evictable): it ends.
        loop {
            self.reap(g)?;
            let in_flight = g.evicting_bytes();
            let over = g
                .cfg
                .device_budget
                .map_or(0, |b| (g.stats.device_bytes + bytes).saturating_sub(b));
            if over > 0 {
                if pressure == Pressure::NoWait {
                    return Ok(None);
                }
                let need = over.saturating_sub(in_flight);
                let evicted = if need > 0 {
                    self.evict_for(g, need)?
                } else {
                    0
                };
                if evicted == 0 && in_flight == 0 && !g.put_with_copy_in() {
                    return Err(self.over_budget(
                        g,
                        bytes,
                        "the tier's device budget is held by tensors in use",
                    ));
                }
                // Evictions must complete before their blocks go back.
                self.wait(g)?;
                continue;
            }
            match self.alloc.allocate(bytes, stream) {
                Ok(p) => return Ok(Some(p)),
                Err(Error::OutOfMemory(_)) if pressure == Pressure::NoWait => return Ok(None),
                Err(Error::OutOfMemory(info)) => {
                    let need = bytes.saturating_sub(in_flight);
                    let evicted = if need > 0 {
                        self.evict_for(g, need)?
                    } else {
                        0
                    };
                    if evicted == 0 && in_flight == 0 && !g.put_with_copy_in() {
                        return Err(Error::OutOfMemory(info));
                    }
                    self.wait(g)?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Starts evicting put tensors until the device bytes not already on their way out fit
    /// the budget; never waits (adopted memory may exceed the budget: see [`Tier::adopt`]).
    fn shed(&self, g: &mut Inner) -> Result<()> {
        let Some(b) = g.cfg.device_budget else {
            return Ok(());
        };
        let over = g
            .stats
            .device_bytes
            .saturating_sub(g.evicting_bytes())
            .saturating_sub(b);
        if over > 0 {
            self.evict_for(g, over)?;
        }
        Ok(())
    }

    fn wait(&self, g: &mut Inner) -> Result<()> {
        g.stats.waits += 1;
        self.alloc.device().synchronize()?;
        self.reap(g)
    }

    /// Evicts put tensors (the policy chooses) to free `need` bytes; returns the bytes whose
    /// eviction started.
    fn evict_for(&self, g: &mut Inner, need: u64) -> Result<u64> {
        let cands: Vec<Candidate> = g
            .entries
            .iter()
            .filter_map(|(&id, e)| match e.state {
                State::Put { copy_in: None, .. } => Some(Candidate {
                    id,
                    bytes: e.bytes,
                    last_touch: e.last_touch,
                    next_use: e.next_use,
                }),
                _ => None,
            })
            .collect();
        if cands.is_empty() {
            return Ok(0);
        }
        let chosen = g.policy.choose(&cands, need, g.now, &g.cfg);
        let mut freed = 0;
        for i in chosen {
            let Some(c) = cands.get(i) else {
                continue;
            };
            self.evict(g, c.id)?;
            freed += c.bytes;
        }
        Ok(freed)
    }

    fn over_budget(&self, g: &Inner, bytes: u64, why: &str) -> Error {
        tracing::debug!(bytes, why, "gmlake tier: no room");
        Error::OutOfMemory(Box::new(OomInfo {
            requested: bytes,
            device_free: g
                .cfg
                .device_budget
                .unwrap_or(0)
                .saturating_sub(g.stats.device_bytes),
            device_total: g.cfg.device_budget.unwrap_or(0),
            reserved: self.alloc.reserved_bytes(),
            allocated: g.stats.device_bytes,
            cached_free: 0,
            limit: g.cfg.device_budget,
            stitches: 0,
        }))
    }
}

impl Inner {
    fn add_device(&mut self, d: i64) {
        let s = &mut self.stats;
        s.device_bytes = (s.device_bytes as i64 + d) as u64;
        s.peak_device_bytes = s.peak_device_bytes.max(s.device_bytes);
    }
    fn add_host(&mut self, d: i64) {
        let s = &mut self.stats;
        s.host_bytes = (s.host_bytes as i64 + d) as u64;
        s.peak_host_bytes = s.peak_host_bytes.max(s.host_bytes);
    }
    /// Whether a put tensor waits for its copy back to complete before it can be evicted.
    fn put_with_copy_in(&self) -> bool {
        self.entries.values().any(|e| {
            matches!(
                e.state,
                State::Put {
                    copy_in: Some(_),
                    ..
                }
            )
        })
    }

    /// Device bytes of evictions in flight (freed once their copies complete).
    fn evicting_bytes(&self) -> u64 {
        self.entries
            .values()
            .filter(|e| matches!(e.state, State::Evicting { .. }))
            .map(|e| e.bytes)
            .sum::<u64>()
            + self
                .zombies
                .iter()
                .filter(|z| z.ptr.is_some())
                .map(|z| z.bytes)
                .sum::<u64>()
    }
}

impl<D: Device> Drop for Tier<D> {
    fn drop(&mut self) {
        // Wait for every copy, then give everything back.
        let dev = self.alloc.device();
        let _ = dev.synchronize();
        let g = self.inner.get_mut();
        for (_, e) in std::mem::take(&mut g.entries) {
            if let Some(p) = e.state.device_ptr() {
                let _ = self.alloc.free(p);
            }
            if let Some(h) = e.state.host() {
                let _ = dev.free_host(h);
            }
            if let Some(ev) = e.state.event() {
                g.events.push(ev);
            }
        }
        for z in std::mem::take(&mut g.zombies) {
            if let Some(p) = z.ptr {
                let _ = self.alloc.free(p);
            }
            if let Some(h) = z.host {
                let _ = dev.free_host(h);
            }
            g.events.push(z.event);
        }
        for (_, v) in std::mem::take(&mut g.host_cache) {
            for h in v {
                let _ = dev.free_host(h);
            }
        }
        for ev in g.events.drain(..) {
            let _ = dev.destroy_event(ev);
        }
    }
}
