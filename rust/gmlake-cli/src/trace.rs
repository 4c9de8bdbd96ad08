//! Reading memory snapshots: the pickle `torch.cuda.memory._dump_snapshot()` writes (plain or
//! gzip-compressed), reduced to a compact list of events per device.
//!
//! The snapshot is a dict whose `device_traces` holds one list per device of event dicts with
//! the keys `action`, `addr`, `size` and `stream` (and others, such as `time_us` and `frames`,
//! that the replay does not need and that are skipped while decoding). Each event is decoded
//! into a small record of those four fields, which is then checked and converted with its
//! index, so only the compact [`Event`]s outlive [`parse_snapshot`].
//!
//! The pickle is decoded with `deser-pickle`, which never runs code from the pickle and
//! resolves values that the pickle shares through its memo (PyTorch shares the `frames` of
//! events with the same stack).

use deser::de::Slot;
use deser::{Atom, Deserialize, ErrorKind, State};
use std::borrow::Cow;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

/// What happened, as the `action` strings of PyTorch's `TraceEntry`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Snapshot,
    Oom,
    /// An action this reader does not know (a newer PyTorch's): kept so that event indices
    /// match the file, ignored by the replay.
    Unknown,
}

impl Action {
    /// The actions of PyTorch's snapshots (all but `Unknown`).
    pub const ALL: [Action; 9] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Snapshot,
        Action::Oom,
    ];

    /// The action string in the snapshot.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Snapshot => "snapshot",
            Action::Oom => "oom",
            Action::Unknown => "unknown",
        }
    }

    pub fn from_name(name: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Whether `addr` and `size` are needed to replay the event.
    fn needs_addr_and_size(self) -> bool {
        !matches!(self, Action::Snapshot | Action::Oom | Action::Unknown)
    }
}

/// One trace event, as the replay needs it (32 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub action: Action,
}

/// The events of one device, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceTrace {
    /// Index in `device_traces`.
    pub device: usize,
    /// One per event dict of the file, in order (so indices match the file's).
    pub events: Vec<Event>,
    /// Events whose action this reader does not know ([`Action::Unknown`]).
    pub unknown_actions: u64,
    /// The index and action string of the first of them.
    pub first_unknown_action: Option<(usize, String)>,
}

impl DeviceTrace {
    /// The action that frees an allocation in this trace: `free_completed`, or
    /// `free_requested` when the trace has no completions at all.
    pub fn free_action(&self) -> Action {
        if self
            .events
            .iter()
            .any(|e| e.action == Action::FreeCompleted)
        {
            Action::FreeCompleted
        } else {
            Action::FreeRequested
        }
    }

    /// A copy whose allocations are each larger by a seeded random 0-7 times 512 bytes (the
    /// frees of an allocation carry its new size): the same job with slightly different
    /// tensor shapes, for `gmlake replay --jitter`. A layout, hence a peak and a steady
    /// state's driver calls, can turn on single placement decisions, so one replay may be
    /// far from what nearly the same job gets. Seed 0 leaves the trace as it is.
    pub fn jittered(&self, seed: u64) -> DeviceTrace {
        let mut out = self.clone();
        if seed == 0 {
            return out;
        }
        let mut state = seed;
        // splitmix64: a small, fixed generator, so that a seed names the same copy anywhere.
        let mut next = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let mut sizes: rustc_hash::FxHashMap<u64, u64> = rustc_hash::FxHashMap::default();
        for e in &mut out.events {
            match e.action {
                Action::Alloc => {
                    e.size += 512 * (next() % 8);
                    sizes.insert(e.addr, e.size);
                }
                Action::FreeRequested | Action::FreeCompleted => {
                    if let Some(&s) = sizes.get(&e.addr) {
                        e.size = s;
                    }
                }
                _ => {}
            }
        }
        out
    }
}

/// A parsed snapshot file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    pub path: PathBuf,
    /// Every device of `device_traces`, empty ones included.
    pub devices: Vec<DeviceTrace>,
}

/// Where in the snapshot a shape error is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Location {
    pub device: Option<usize>,
    pub event: Option<usize>,
    /// Byte offset in the (uncompressed) pickle, where the decoder stopped.
    pub offset: Option<usize>,
}

/// Why a file could not be read as a snapshot. Every variant names the file.
#[derive(Debug)]
pub enum TraceError {
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Gzip magic, but the stream does not decompress.
    Gzip {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The bytes are not a (complete) pickle.
    Pickle {
        path: PathBuf,
        /// The file starts as pickles of protocol 2 and later do.
        looks_like_pickle: bool,
        message: String,
        offset: Option<usize>,
    },
    /// A pickle, but not of a snapshot's shape.
    Shape {
        path: PathBuf,
        at: Location,
        message: String,
    },
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at_offset = |f: &mut fmt::Formatter<'_>, offset: &Option<usize>| match offset {
            Some(o) => write!(f, " (at byte {o})"),
            None => Ok(()),
        };
        match self {
            TraceError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            TraceError::Gzip { path, source } => {
                write!(f, "{}: invalid gzip data: {source}", path.display())
            }
            TraceError::Pickle {
                path,
                looks_like_pickle,
                message,
                offset,
            } => {
                if *looks_like_pickle {
                    write!(
                        f,
                        "{}: invalid or truncated pickle: {message}",
                        path.display()
                    )?;
                } else {
                    write!(
                        f,
                        "{}: not a pickle (expected the file torch.cuda.memory._dump_snapshot() \
                         writes, optionally gzip-compressed): {message}",
                        path.display()
                    )?;
                }
                at_offset(f, offset)
            }
            TraceError::Shape { path, at, message } => {
                write!(f, "{}: ", path.display())?;
                match (at.device, at.event) {
                    (Some(d), Some(e)) => write!(f, "device_traces[{d}] event {e}: ")?,
                    (Some(d), None) => write!(f, "device_traces[{d}]: ")?,
                    _ => {}
                }
                write!(f, "{message}")?;
                at_offset(f, &at.offset)
            }
        }
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TraceError::Io { source, .. } | TraceError::Gzip { source, .. } => Some(source),
            TraceError::Pickle { .. } | TraceError::Shape { .. } => None,
        }
    }
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// Pickle protocol 2 and later start with the PROTO opcode.
const PICKLE_PROTO: u8 = 0x80;

/// Reads and parses a snapshot file (gzip-compressed or not, detected by its magic bytes).
pub fn read_trace(path: &Path) -> Result<Trace, TraceError> {
    let raw = std::fs::read(path).map_err(|source| TraceError::Io {
        path: path.to_owned(),
        source,
    })?;
    let bytes = decompress_if_gzip(path, raw)?;
    parse_snapshot(path, &bytes)
}

/// Decompresses `raw` if it starts with the gzip magic; returns it unchanged otherwise.
pub fn decompress_if_gzip(path: &Path, raw: Vec<u8>) -> Result<Vec<u8>, TraceError> {
    if !raw.starts_with(&GZIP_MAGIC) {
        return Ok(raw);
    }
    let mut out = Vec::with_capacity(raw.len().saturating_mul(4));
    flate2::read::MultiGzDecoder::new(raw.as_slice())
        .read_to_end(&mut out)
        .map_err(|source| TraceError::Gzip {
            path: path.to_owned(),
            source,
        })?;
    Ok(out)
}

/// The snapshot as decoded: only `device_traces`, whose events keep only the four fields the
/// replay reads (everything else in the pickle is skipped).
#[derive(Deserialize)]
#[deser(expecting = "a dict with a 'device_traces' key (a memory snapshot)")]
struct RawSnapshot {
    device_traces: Option<Vec<Vec<RawEvent>>>,
}

#[derive(Deserialize)]
#[deser(expecting = "an event dict")]
struct RawEvent {
    action: Option<Field>,
    addr: Option<Field>,
    size: Option<Field>,
    stream: Option<Field>,
}

/// A scalar field of an event as found in the pickle, checked later with the event's index.
#[derive(Debug, PartialEq)]
enum Field {
    Int(u64),
    /// A string that names an action (decoded without allocating).
    Action(Action),
    Str(Box<str>),
    /// Anything else, described for the error message.
    Other(Box<str>),
}

impl Field {
    fn other(description: impl Into<Box<str>>) -> Field {
        Field::Other(description.into())
    }

    /// What was found, for an error message.
    fn describe(&self) -> String {
        match self {
            Field::Int(v) => format!("an integer ({v})"),
            Field::Action(a) => format!("a string ({:?})", a.name()),
            Field::Str(s) => format!("a string ({s:?})"),
            Field::Other(d) => d.to_string(),
        }
    }
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize_atom(
        slot: &mut Slot<Self>,
        atom: Atom,
        _state: &mut State,
    ) -> Result<(), deser::Error> {
        slot.set(match atom {
            Atom::U64(v) => Field::Int(v),
            Atom::I64(v) => match u64::try_from(v) {
                Ok(v) => Field::Int(v),
                Err(_) => Field::other(format!("{v}")),
            },
            Atom::Str(s) | Atom::Lexical(s) => match Action::from_name(s.as_str()) {
                Some(a) => Field::Action(a),
                None => Field::Str(s.as_str().into()),
            },
            Atom::Null => Field::other("None"),
            Atom::Bool(b) => Field::other(format!("a bool ({b})")),
            Atom::F64(x) => Field::other(format!("a float ({x})")),
            Atom::Bytes(_) => Field::other("bytes"),
            // Integers beyond 64 bits and other extension values.
            _ => Field::other("a value of another type"),
        });
        Ok(())
    }

    fn expecting() -> Cow<'static, str> {
        Cow::Borrowed("an integer or a string")
    }
}

/// Parses the bytes of an uncompressed snapshot pickle. `path` only names the file in errors.
pub fn parse_snapshot(path: &Path, bytes: &[u8]) -> Result<Trace, TraceError> {
    let shape = |at: Location, message: String| TraceError::Shape {
        path: path.to_owned(),
        at,
        message,
    };
    if bytes.is_empty() {
        return Err(shape(Location::default(), "empty file".into()));
    }
    let config = deser_pickle::DeserializerConfig::builder()
        // Every event's `frames` may be a shared list: let it be skipped as often as needed.
        .max_shared_events(usize::MAX)
        .build();
    let raw: RawSnapshot = config.from_slice(bytes).map_err(|e| {
        let (message, offset) = (e.message().to_string(), e.offset());
        match e.kind() {
            ErrorKind::Syntax
            | ErrorKind::EndOfFile
            | ErrorKind::LimitExceeded
            | ErrorKind::UnsupportedType
            | ErrorKind::Io => TraceError::Pickle {
                path: path.to_owned(),
                looks_like_pickle: bytes[0] == PICKLE_PROTO,
                message,
                offset,
            },
            _ => shape(
                Location {
                    offset,
                    ..Location::default()
                },
                format!(
                    "not a memory snapshot (a dict with 'device_traces', one list of event \
                     dicts per device): {message}"
                ),
            ),
        }
    })?;
    let devices = raw.device_traces.ok_or_else(|| {
        shape(
            Location::default(),
            "no 'device_traces' key: not a memory snapshot (record one with \
             torch.cuda.memory._record_memory_history() and torch.cuda.memory._dump_snapshot())"
                .into(),
        )
    })?;

    let mut out = Vec::with_capacity(devices.len());
    for (d, events) in devices.into_iter().enumerate() {
        let mut trace = DeviceTrace {
            device: d,
            events: Vec::with_capacity(events.len()),
            unknown_actions: 0,
            first_unknown_action: None,
        };
        for (i, ev) in events.into_iter().enumerate() {
            let at = Location {
                device: Some(d),
                event: Some(i),
                offset: None,
            };
            match convert_event(ev).map_err(|m| shape(at, m))? {
                Parsed::Event(e) => trace.events.push(e),
                Parsed::UnknownAction(name) => {
                    trace.unknown_actions += 1;
                    trace.first_unknown_action.get_or_insert((i, name));
                    trace.events.push(Event {
                        addr: 0,
                        size: 0,
                        stream: 0,
                        action: Action::Unknown,
                    });
                }
            }
        }
        out.push(trace);
    }
    Ok(Trace {
        path: path.to_owned(),
        devices: out,
    })
}

enum Parsed {
    Event(Event),
    UnknownAction(String),
}

/// Checks one decoded event.
fn convert_event(ev: RawEvent) -> Result<Parsed, String> {
    let action = match ev.action {
        Some(Field::Action(a)) => a,
        Some(Field::Str(s)) => return Ok(Parsed::UnknownAction(s.into())),
        Some(other) => {
            return Err(format!(
                "'action' should be a string, found {}",
                other.describe()
            ))
        }
        // A key set to None decodes like a missing one.
        None => return Err("missing key 'action' (or it is None)".into()),
    };
    let int = |field: Option<Field>, name: &str, required: bool| -> Result<u64, String> {
        match field {
            Some(Field::Int(v)) => Ok(v),
            Some(other) => Err(format!(
                "'{name}' of a {} event should be an integer >= 0, found {}",
                action.name(),
                other.describe()
            )),
            None if required => Err(format!(
                "missing key '{name}' (or it is None) in a {} event",
                action.name()
            )),
            None => Ok(0),
        }
    };
    let needed = action.needs_addr_and_size();
    Ok(Parsed::Event(Event {
        addr: int(ev.addr, "addr", needed)?,
        size: int(ev.size, "size", needed)?,
        stream: int(ev.stream, "stream", false)?,
        action,
    }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A jittered copy: seed 0 is the trace; otherwise each allocation grows by a multiple
    /// of 512 bytes up to 3.5 KiB, its frees carry the new size, other events are as they
    /// were, and a seed always names the same copy.
    #[test]
    fn jittered_copies_grow_allocations_and_their_frees() {
        let ev = |action, addr, size| Event {
            addr,
            size,
            stream: 0,
            action,
        };
        let dev = DeviceTrace {
            device: 0,
            events: (0..64u64)
                .flat_map(|i| {
                    [
                        ev(Action::Alloc, 0x1000 * (i % 4), 4096 + 512 * i),
                        ev(Action::FreeRequested, 0x1000 * (i % 4), 4096 + 512 * i),
                        ev(Action::FreeCompleted, 0x1000 * (i % 4), 4096 + 512 * i),
                        ev(Action::SegmentAlloc, 1 << 40, 2 << 20),
                    ]
                })
                .collect(),
            ..DeviceTrace::default()
        };
        assert_eq!(dev.jittered(0), dev);
        let copy = dev.jittered(7);
        assert_eq!(copy, dev.jittered(7));
        assert_ne!(copy, dev.jittered(8));
        let mut grown = 0;
        for (k, (a, b)) in dev.events.iter().zip(&copy.events).enumerate() {
            assert_eq!((a.addr, a.action, a.stream), (b.addr, b.action, b.stream));
            let extra = b.size - a.size;
            match a.action {
                Action::Alloc => {
                    assert!(extra % 512 == 0 && extra <= 3584, "event {k}: +{extra}");
                    grown += (extra > 0) as u32;
                }
                Action::FreeRequested | Action::FreeCompleted => {
                    let alloc = &copy.events[k - k % 4];
                    assert_eq!(
                        b.size, alloc.size,
                        "event {k}: a free has its allocation's size"
                    );
                }
                _ => assert_eq!(extra, 0, "event {k}"),
            }
        }
        assert!(grown > 40, "most of the 64 allocations grew: {grown}");
    }

    /// A minimal pickle writer (protocol 2 opcodes) for building test snapshots.
    #[derive(Clone)]
    enum P {
        None,
        Int(i64),
        Str(&'static str),
        List(Vec<P>),
        Dict(Vec<(&'static str, P)>),
    }

    fn write(p: &P, out: &mut Vec<u8>) {
        match p {
            P::None => out.push(b'N'),
            P::Int(v) => {
                // LONG1 with an 8-byte little-endian two's complement body
                out.extend([0x8a, 8]);
                out.extend(v.to_le_bytes());
            }
            P::Str(s) => {
                out.push(b'X');
                out.extend((s.len() as u32).to_le_bytes());
                out.extend(s.as_bytes());
            }
            P::List(items) => {
                out.extend([b']', b'(']);
                items.iter().for_each(|i| write(i, out));
                out.push(b'e');
            }
            P::Dict(items) => {
                out.extend([b'}', b'(']);
                for (k, v) in items {
                    write(&P::Str(k), out);
                    write(v, out);
                }
                out.push(b'u');
            }
        }
    }

    fn pickle(p: &P) -> Vec<u8> {
        let mut out = vec![0x80, 2];
        write(p, &mut out);
        out.push(b'.');
        out
    }

    fn event(action: &'static str, addr: i64, size: i64) -> P {
        P::Dict(vec![
            ("action", P::Str(action)),
            ("addr", P::Int(addr)),
            ("size", P::Int(size)),
            ("stream", P::Int(0)),
            ("time_us", P::Int(17)),
            ("frames", P::List(vec![])),
        ])
    }

    fn snapshot(devices: Vec<Vec<P>>) -> P {
        P::Dict(vec![
            ("segments", P::List(vec![])),
            (
                "device_traces",
                P::List(devices.into_iter().map(P::List).collect()),
            ),
        ])
    }

    fn parse(bytes: &[u8]) -> Result<Trace, TraceError> {
        parse_snapshot(Path::new("t.pickle"), bytes)
    }

    /// An event on stream 0 (also used by replay's tests).
    pub(crate) fn ev(action: Action, addr: u64, size: u64) -> Event {
        Event {
            addr,
            size,
            stream: 0,
            action,
        }
    }

    #[test]
    fn parses_events_and_marks_unknown_actions() {
        let v = snapshot(vec![
            vec![
                event("segment_alloc", 4096, 1 << 21),
                event("alloc", 4096, 512),
                event("some_future_action", 1, 1),
                event("free_completed", 4096, 512),
            ],
            vec![],
        ]);
        let t = parse(&pickle(&v)).unwrap();
        assert_eq!(t.devices.len(), 2);
        let d = &t.devices[0];
        assert_eq!(d.unknown_actions, 1);
        assert_eq!(
            d.first_unknown_action,
            Some((2, "some_future_action".into()))
        );
        assert_eq!(
            d.events,
            vec![
                ev(Action::SegmentAlloc, 4096, 1 << 21),
                ev(Action::Alloc, 4096, 512),
                ev(Action::Unknown, 0, 0),
                ev(Action::FreeCompleted, 4096, 512),
            ]
        );
        assert_eq!(d.free_action(), Action::FreeCompleted);
        assert!(t.devices[1].events.is_empty());
    }

    #[test]
    fn falls_back_to_free_requested_without_completions() {
        let v = snapshot(vec![vec![
            event("alloc", 4096, 512),
            event("free_requested", 4096, 512),
        ]]);
        let t = parse(&pickle(&v)).unwrap();
        assert_eq!(t.devices[0].free_action(), Action::FreeRequested);
    }

    #[test]
    fn optional_keys_and_sizes_of_zero() {
        let v = snapshot(vec![vec![
            P::Dict(vec![("action", P::Str("oom"))]),
            P::Dict(vec![
                ("action", P::Str("alloc")),
                ("addr", P::Int(1 << 40)),
                ("size", P::Int(0)),
            ]),
        ]]);
        let t = parse(&pickle(&v)).unwrap();
        assert_eq!(
            t.devices[0].events,
            vec![ev(Action::Oom, 0, 0), ev(Action::Alloc, 1 << 40, 0)]
        );
    }

    #[test]
    fn shape_errors_name_the_file_device_and_event() {
        let mut bad = event("alloc", 4096, 512);
        if let P::Dict(items) = &mut bad {
            items.retain(|(k, _)| *k != "size");
        }
        let v = snapshot(vec![vec![event("alloc", 0, 1), bad]]);
        let msg = parse(&pickle(&v)).unwrap_err().to_string();
        assert!(msg.starts_with("t.pickle: "), "{msg}");
        assert!(msg.contains("device_traces[0] event 1"), "{msg}");
        assert!(msg.contains("missing key 'size'"), "{msg}");

        let v = snapshot(vec![vec![], vec![event("alloc", -5, 1)]]);
        let msg = parse(&pickle(&v)).unwrap_err().to_string();
        assert!(msg.contains("device_traces[1] event 0"), "{msg}");
        assert!(msg.contains("'addr'") && msg.contains("-5"), "{msg}");

        let mut bad = event("free_completed", 4096, 512);
        if let P::Dict(items) = &mut bad {
            items[0].1 = P::None;
        }
        let v = snapshot(vec![vec![event("alloc", 4096, 512), bad]]);
        let msg = parse(&pickle(&v)).unwrap_err().to_string();
        assert!(
            msg.contains("event 1: missing key 'action' (or it is None)"),
            "{msg}"
        );

        let mut bad = event("alloc", 4096, 512);
        if let P::Dict(items) = &mut bad {
            items[2].1 = P::Str("big");
        }
        let v = snapshot(vec![vec![bad]]);
        let msg = parse(&pickle(&v)).unwrap_err().to_string();
        assert!(
            msg.contains("event 0: 'size' of a alloc event should be an integer"),
            "{msg}"
        );
        assert!(msg.contains("found a string (\"big\")"), "{msg}");

        let mut bad = event("alloc", 4096, 512);
        if let P::Dict(items) = &mut bad {
            items[0].1 = P::Int(7);
        }
        let v = snapshot(vec![vec![bad]]);
        let msg = parse(&pickle(&v)).unwrap_err().to_string();
        assert!(
            msg.contains("'action' should be a string, found an integer (7)"),
            "{msg}"
        );

        let v = snapshot(vec![vec![P::Int(3)]]);
        let msg = parse(&pickle(&v)).unwrap_err().to_string();
        assert!(
            msg.contains("not a memory snapshot") && msg.contains("at byte"),
            "{msg}"
        );

        let msg = parse(&pickle(&P::List(vec![P::Int(1)])))
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("t.pickle: not a memory snapshot"), "{msg}");

        let msg = parse(&pickle(&P::Dict(vec![("segments", P::List(vec![]))])))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("no 'device_traces' key"), "{msg}");

        let msg = parse(&pickle(&P::Dict(vec![("device_traces", P::Int(1))])))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not a memory snapshot"), "{msg}");
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let v = snapshot(vec![vec![
            event("segment_alloc", 4096, 1 << 21),
            event("alloc", 4096, 512),
            event("free_completed", 4096, 512),
        ]]);
        let bytes = pickle(&v);
        for n in 0..bytes.len() {
            let err = parse(&bytes[..n]).unwrap_err().to_string();
            assert!(err.starts_with("t.pickle: "), "{err}");
        }
        // Flipping single bytes must not panic either (errors or odd values are both fine).
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x5a;
            let _ = parse(&b);
        }
    }

    #[test]
    fn text_is_not_a_pickle() {
        let msg = parse(b"hello, world\n").unwrap_err().to_string();
        assert!(msg.starts_with("t.pickle: not a pickle"), "{msg}");
        let msg = parse(b"").unwrap_err().to_string();
        assert!(msg.contains("empty file"), "{msg}");
    }

    #[test]
    fn gzip_is_detected_by_magic() {
        use flate2::write::GzEncoder;
        use std::io::Write;
        let plain = pickle(&snapshot(vec![vec![event("alloc", 4096, 512)]]));
        let mut enc = GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(&plain).unwrap();
        let gz = enc.finish().unwrap();
        let p = Path::new("t.pickle.gz");
        assert_eq!(decompress_if_gzip(p, gz.clone()).unwrap(), plain);
        assert_eq!(decompress_if_gzip(p, plain.clone()).unwrap(), plain);
        let msg = decompress_if_gzip(p, gz[..gz.len() / 2].to_vec())
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("t.pickle.gz: invalid gzip data"), "{msg}");
    }

    /// What CPython's `pickle.dumps` writes with protocol 5 (Python 3.12's highest) and 2:
    /// `{'device_traces': [[{'action': 'alloc', 'addr': 2**40, 'size': 512, 'stream': 0,
    /// 'time_us': 1, 'frames': [{'filename': 'a.py', 'line': 3, 'name': 'f'}]}]]}`.
    #[test]
    fn reads_cpython_protocols_2_and_5() {
        const P5: &[u8] = b"\x80\x05\x95\x95\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x0ddevice_traces\x94]\x94]\x94}\x94(\x8c\x06action\x94\x8c\x05alloc\x94\x8c\x04addr\x94\x8a\x06\x00\x00\x00\x00\x00\x01\x8c\x04size\x94M\x00\x02\x8c\x06stream\x94K\x00\x8c\x07time_us\x94K\x01\x8c\x06frames\x94]\x94}\x94(\x8c\x08filename\x94\x8c\x04a.py\x94\x8c\x04line\x94K\x03\x8c\x04name\x94\x8c\x01f\x94uauaas.";
        const P2: &[u8] = b"\x80\x02}q\x00X\x0d\x00\x00\x00device_tracesq\x01]q\x02]q\x03}q\x04(X\x06\x00\x00\x00actionq\x05X\x05\x00\x00\x00allocq\x06X\x04\x00\x00\x00addrq\x07\x8a\x06\x00\x00\x00\x00\x00\x01X\x04\x00\x00\x00sizeq\x08M\x00\x02X\x06\x00\x00\x00streamq\x09K\x00X\x07\x00\x00\x00time_usq\x0aK\x01X\x06\x00\x00\x00framesq\x0b]q\x0c}q\x0d(X\x08\x00\x00\x00filenameq\x0eX\x04\x00\x00\x00a.pyq\x0fX\x04\x00\x00\x00lineq\x10K\x03X\x04\x00\x00\x00nameq\x11X\x01\x00\x00\x00fq\x12uauaas.";
        for bytes in [P5, P2] {
            let t = parse(bytes).unwrap();
            assert_eq!(t.devices[0].events, vec![ev(Action::Alloc, 1 << 40, 512)]);
        }
    }

    /// PyTorch shares the `frames` list of events with the same stack through the pickle's
    /// memo. CPython's `pickle.dumps(d, protocol=4)` of
    /// `fr = [{'filename': 'a.py', 'line': 1, 'name': 'f'}]` and `d = {'segments':
    /// [{'frames': fr}], 'device_traces': [[{'action': 'alloc', 'addr': 4096, 'size': 512,
    /// 'stream': 0, 'frames': fr}, {'action': 'free_completed', ..., 'frames': fr}]]}`.
    #[test]
    fn reads_values_shared_through_the_memo() {
        const SHARED: &[u8] = b"\x80\x04\x95\xc4\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\x94]\x94}\x94\x8c\x06frames\x94]\x94}\x94(\x8c\x08filename\x94\x8c\x04a.py\x94\x8c\x04line\x94K\x01\x8c\x04name\x94\x8c\x01f\x94uasa\x8c\x0ddevice_traces\x94]\x94]\x94(}\x94(\x8c\x06action\x94\x8c\x05alloc\x94\x8c\x04addr\x94M\x00\x10\x8c\x04size\x94M\x00\x02\x8c\x06stream\x94K\x00h\x04h\x05u}\x94(h\x10\x8c\x0efree_completed\x94h\x12M\x00\x10h\x13M\x00\x02h\x14K\x00h\x04h\x05ueau.";
        let t = parse(SHARED).unwrap();
        assert_eq!(
            t.devices[0].events,
            vec![
                ev(Action::Alloc, 4096, 512),
                ev(Action::FreeCompleted, 4096, 512)
            ]
        );
    }
}
