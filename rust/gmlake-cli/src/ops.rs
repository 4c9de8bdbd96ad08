//! `gmlake ops`: a trace's allocations and frees as a flat list of operations, to replay them
//! through an allocator with nothing else in the way. bench/latency.cpp (`--ops FILE`) times
//! PyTorch's allocators and gmlake on it on a GPU; `examples/ops_calls.rs` runs the core on the
//! simulated device. A workload's step time holds Python and kernel launches (the GPU
//! benchmark's jobs spend 70-80% of a step on the host, and the same allocator's steps differ by
//! 30%); the list isolates the allocator's share: its time per operation, times the job's
//! operations per step.
//!
//! File format, little-endian u64 words: a header `MAGIC`, streams, slots, ops; then two words
//! per operation: `kind | stream << 1 | slot << 8` (kind 0 allocates, 1 frees; stream below
//! 128) and the size (0 for a free). A slot names a live block: an allocation fills an empty
//! slot, a free empties a full one. Slots are reused, so there are as many as blocks live at
//! once at most. Every block is freed by the end, so the list can be run again and again, as
//! a periodic job's steps are.

use crate::trace::{Action, DeviceTrace};
use rustc_hash::FxHashMap;
use std::fmt;

/// "GMLKOPS1" read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"GMLKOPS1");
/// Streams a list may name (7 bits of the first word).
pub const MAX_STREAMS: usize = 128;

/// One allocation or free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Alloc { slot: u32, stream: u8, size: u64 },
    Free { slot: u32 },
}

/// A trace's operations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ops {
    /// Streams named, numbered in order of first use (0: the trace's first stream).
    pub streams: usize,
    /// Slots used: the most blocks live at once.
    pub slots: usize,
    pub ops: Vec<Op>,
}

/// Why a file is not an operation list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpsError(pub String);

impl fmt::Display for OpsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for OpsError {}

impl Ops {
    /// The allocations and frees of `trace`, frees taken at the trace's free action (completed
    /// where the trace records it, as `gmlake replay` does). A free of an address not
    /// allocated in the trace (allocated before recording began) is left out; an allocation
    /// at an address still live frees the old block first; blocks live at the end are freed
    /// there, in slot order.
    pub fn from_trace(trace: &DeviceTrace) -> Result<Ops, OpsError> {
        let free_action = trace.free_action();
        let mut streams: FxHashMap<u64, u8> = FxHashMap::default();
        let mut live: FxHashMap<u64, u32> = FxHashMap::default();
        let mut empty: Vec<u32> = Vec::new();
        let mut out = Ops::default();
        let free = |slot: u32, out: &mut Ops, empty: &mut Vec<u32>| {
            out.ops.push(Op::Free { slot });
            empty.push(slot);
        };
        for e in &trace.events {
            match e.action {
                Action::Alloc => {
                    if let Some(old) = live.remove(&e.addr) {
                        free(old, &mut out, &mut empty);
                    }
                    let n = streams.len();
                    let stream = match streams.get(&e.stream) {
                        Some(&s) => s,
                        None if n < MAX_STREAMS => {
                            streams.insert(e.stream, n as u8);
                            n as u8
                        }
                        None => {
                            return Err(OpsError(format!(
                                "the trace uses more than {MAX_STREAMS} streams"
                            )))
                        }
                    };
                    let slot = empty.pop().unwrap_or_else(|| {
                        out.slots += 1;
                        out.slots as u32 - 1
                    });
                    live.insert(e.addr, slot);
                    out.ops.push(Op::Alloc {
                        slot,
                        stream,
                        size: e.size.max(1),
                    });
                }
                a if a == free_action => {
                    if let Some(slot) = live.remove(&e.addr) {
                        free(slot, &mut out, &mut empty);
                    }
                }
                _ => {}
            }
        }
        let mut left: Vec<u32> = live.into_values().collect();
        left.sort_unstable();
        for slot in left {
            free(slot, &mut out, &mut empty);
        }
        out.streams = streams.len();
        Ok(out)
    }

    pub fn allocs(&self) -> usize {
        self.ops
            .iter()
            .filter(|o| matches!(o, Op::Alloc { .. }))
            .count()
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w: Vec<u64> = Vec::with_capacity(4 + 2 * self.ops.len());
        w.extend([
            MAGIC,
            self.streams as u64,
            self.slots as u64,
            self.ops.len() as u64,
        ]);
        for op in &self.ops {
            match *op {
                Op::Alloc { slot, stream, size } => {
                    w.push(u64::from(stream) << 1 | u64::from(slot) << 8);
                    w.push(size);
                }
                Op::Free { slot } => {
                    w.push(1 | u64::from(slot) << 8);
                    w.push(0);
                }
            }
        }
        w.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Reads a file written by [`Ops::to_bytes`], checking every operation against the slots'
    /// states (so a replayer may trust it).
    pub fn from_bytes(bytes: &[u8]) -> Result<Ops, OpsError> {
        let err = |s: String| Err(OpsError(s));
        if !bytes.len().is_multiple_of(8) {
            return err(format!("{} bytes: not whole u64 words", bytes.len()));
        }
        let w: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let [magic, streams, slots, n] = match w.get(..4) {
            Some(&[a, b, c, d]) => [a, b, c, d],
            _ => return err("shorter than its header".into()),
        };
        if magic != MAGIC {
            return err("not an operation list (bad magic; write one with `gmlake ops`)".into());
        }
        if streams as usize > MAX_STREAMS || slots > u64::from(u32::MAX) {
            return err(format!("header names {streams} streams and {slots} slots"));
        }
        if n.checked_mul(2).and_then(|x| x.checked_add(4)) != Some(w.len() as u64) {
            return err(format!(
                "{} words, but the header says {n} operations",
                w.len()
            ));
        }
        // Each slot is filled by an allocation at least once (`from_trace` makes no other):
        // bounds what a reader allocates for the slots by the file's size.
        if slots > n {
            return err(format!("{slots} slots for {n} operations"));
        }
        let mut full = vec![false; slots as usize];
        let mut ops = Vec::with_capacity(n as usize);
        for (i, p) in w[4..].chunks_exact(2).enumerate() {
            let (word, size) = (p[0], p[1]);
            let slot = word >> 8;
            let stream = (word >> 1) & 0x7f;
            if slot >= slots {
                return err(format!("operation {i}: slot {slot} of {slots}"));
            }
            let s = slot as usize;
            if word & 1 == 0 {
                if stream >= streams {
                    return err(format!("operation {i}: stream {stream} of {streams}"));
                }
                if size == 0 || full[s] {
                    return err(format!(
                        "operation {i}: allocates {size} bytes into slot {slot}, which is {}",
                        if full[s] { "live" } else { "empty" }
                    ));
                }
                full[s] = true;
                ops.push(Op::Alloc {
                    slot: slot as u32,
                    stream: stream as u8,
                    size,
                });
            } else {
                if !full[s] {
                    return err(format!("operation {i}: frees slot {slot}, which is empty"));
                }
                full[s] = false;
                ops.push(Op::Free { slot: slot as u32 });
            }
        }
        if let Some(s) = full.iter().position(|&f| f) {
            return err(format!("slot {s} is still live at the end"));
        }
        Ok(Ops {
            streams: streams as usize,
            slots: slots as usize,
            ops,
        })
    }
}

/// Runs `gmlake ops`; returns the process exit status.
pub fn run_ops(args: &crate::cli::OpsArgs) -> i32 {
    let trace = match crate::trace::read_trace(&args.file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("gmlake: {e}");
            return crate::app::EXIT_FAILED;
        }
    };
    let device = match args.device {
        Some(d) => match trace.devices.get(d) {
            Some(t) => t,
            None => {
                eprintln!(
                    "gmlake: {} has {} devices; --device {d} is not one",
                    args.file.display(),
                    trace.devices.len()
                );
                return crate::app::EXIT_USAGE;
            }
        },
        None => match trace.devices.iter().max_by_key(|t| t.events.len()) {
            Some(t) => t,
            None => {
                eprintln!("gmlake: {} holds no device", args.file.display());
                return crate::app::EXIT_FAILED;
            }
        },
    };
    let ops = match Ops::from_trace(device) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gmlake: {}: {e}", args.file.display());
            return crate::app::EXIT_FAILED;
        }
    };
    if ops.ops.is_empty() {
        eprintln!(
            "gmlake: {} device {}: no allocation to write",
            args.file.display(),
            device.device
        );
        return crate::app::EXIT_FAILED;
    }
    if let Err(e) = std::fs::write(&args.out, ops.to_bytes()) {
        eprintln!("gmlake: cannot write {}: {e}", args.out.display());
        return crate::app::EXIT_FAILED;
    }
    println!(
        "{}: device {}: {} allocations, {} operations, {} streams, at most {} blocks live -> {}",
        args.file.display(),
        device.device,
        ops.allocs(),
        ops.ops.len(),
        ops.streams,
        ops.slots,
        args.out.display()
    );
    crate::app::EXIT_OK
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Event;

    fn ev(action: Action, addr: u64, size: u64, stream: u64) -> Event {
        Event {
            addr,
            size,
            stream,
            action,
        }
    }

    fn trace(events: Vec<Event>) -> DeviceTrace {
        DeviceTrace {
            events,
            ..DeviceTrace::default()
        }
    }

    #[test]
    fn slots_streams_and_frees_follow_the_trace() {
        use Action::*;
        let t = trace(vec![
            ev(Alloc, 0x1000, 512, 7),
            ev(Alloc, 0x2000, 1024, 9),
            ev(FreeRequested, 0x1000, 512, 7),
            ev(FreeCompleted, 0x1000, 512, 7),
            ev(FreeCompleted, 0x9000, 512, 7), // allocated before the recording: left out
            ev(Alloc, 0x3000, 2048, 7),        // reuses slot 0
            ev(Alloc, 0x2000, 4096, 9),        // 0x2000 still live: freed first
            ev(SegmentAlloc, 0, 1 << 21, 7),
        ]);
        let ops = Ops::from_trace(&t).unwrap();
        use Op::{Alloc as A, Free as F};
        assert_eq!(
            ops.ops,
            vec![
                A {
                    slot: 0,
                    stream: 0,
                    size: 512
                },
                A {
                    slot: 1,
                    stream: 1,
                    size: 1024
                },
                F { slot: 0 },
                A {
                    slot: 0,
                    stream: 0,
                    size: 2048
                },
                F { slot: 1 },
                A {
                    slot: 1,
                    stream: 1,
                    size: 4096
                },
                F { slot: 0 },
                F { slot: 1 },
            ]
        );
        assert_eq!((ops.streams, ops.slots, ops.allocs()), (2, 2, 4));
        assert_eq!(Ops::from_bytes(&ops.to_bytes()).unwrap(), ops);
    }

    #[test]
    fn frees_at_the_requested_free_when_none_completes() {
        use Action::*;
        let t = trace(vec![
            ev(Alloc, 0x1000, 512, 0),
            ev(FreeRequested, 0x1000, 512, 0),
            ev(Alloc, 0x1000, 512, 0),
        ]);
        let ops = Ops::from_trace(&t).unwrap();
        assert_eq!(ops.slots, 1);
        assert_eq!(ops.ops.len(), 4);
        assert_eq!(ops.ops[1], Op::Free { slot: 0 });
    }

    #[test]
    fn a_damaged_file_is_refused_with_the_reason() {
        use Action::*;
        let t = trace(vec![
            ev(Alloc, 0x1000, 512, 0),
            ev(FreeCompleted, 0x1000, 512, 0),
        ]);
        let good = Ops::from_trace(&t).unwrap().to_bytes();
        let reason = |b: &[u8]| Ops::from_bytes(b).unwrap_err().0;
        assert!(reason(&good[..good.len() - 3]).contains("whole u64 words"));
        assert!(reason(&good[..good.len() - 8]).contains("header says 2 operations"));
        let mut bad = good.clone();
        bad[0] ^= 1;
        assert!(reason(&bad).contains("bad magic"));
        let mut bad = good.clone();
        bad[16..24].copy_from_slice(&3u64.to_le_bytes());
        assert!(reason(&bad).contains("3 slots for 2 operations"));
        // The free turned into a second allocation of slot 0.
        let mut bad = good.clone();
        bad[48..56].copy_from_slice(&0u64.to_le_bytes());
        bad[56..64].copy_from_slice(&64u64.to_le_bytes());
        assert!(reason(&bad).contains("slot 0, which is live"));
        // The allocation dropped: the free finds the slot empty.
        let mut bad = good.clone();
        bad[32..40].copy_from_slice(&1u64.to_le_bytes());
        bad[40..48].copy_from_slice(&0u64.to_le_bytes());
        assert!(reason(&bad).contains("which is empty"));
        // The free dropped: the block is live at the end.
        let mut bad = good;
        bad[48..56].copy_from_slice(&0u64.to_le_bytes());
        bad[56..64].copy_from_slice(&0u64.to_le_bytes());
        bad[24..32].copy_from_slice(&1u64.to_le_bytes());
        assert!(reason(&bad[..48]).contains("still live at the end"));
    }
}
