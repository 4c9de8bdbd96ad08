//! Traces of host-tier operations, and their replay on the simulated device (issue 16).
//!
//! A trace is text, one operation per line (`#` starts a comment; ids are the trace's own):
//!
//! ```text
//! create <id> <size> <stream>     a new tensor of <size> bytes (sizes as parse_size reads them)
//! put <id> [<next_use>]           not needed now; next use in logical time, if known
//! get <id> <stream>               needed now, on <stream>
//! free <id>
//! offload <id>                    evict a put tensor now
//! advance <now>                   the clock moves; work queued before has completed
//! ```
//!
//! [`replay`] runs it through a [`Tier`] over an [`Allocator`] on an asynchronous
//! [`SimDevice`] (contents not modelled): the device completes its queued work at each
//! `advance`, as kernels of one step finish before the next. It reports the tier's statistics
//! and the allocator's peak reserved memory, next to the peak reserved when the same tensors
//! all stay on the device ([`replay_without_tier`]).

use crate::allocator::Allocator;
use crate::config::{parse_size, Config};
use crate::sim::SimDevice;
use crate::tier::{EvictionPolicy, TensorId, Tier, TierConfig, TierStats};
use rustc_hash::FxHashMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// One operation of a tier trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierOp {
    Create { id: u64, size: u64, stream: u64 },
    Put { id: u64, next_use: Option<u64> },
    Get { id: u64, stream: u64 },
    Free { id: u64 },
    Offload { id: u64 },
    Advance { now: u64 },
}

/// Reads a trace; an error names the line.
pub fn parse(text: &str) -> Result<Vec<TierOp>, String> {
    let mut ops = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let w: Vec<&str> = line.split_whitespace().collect();
        let err = |why: &str| format!("line {}: {why}: {line:?}", n + 1);
        let num = |i: usize| -> Result<u64, String> {
            w.get(i)
                .ok_or_else(|| err("missing field"))?
                .parse::<u64>()
                .map_err(|_| err("not a number"))
        };
        let op = match (w[0], w.len()) {
            ("create", 4) => TierOp::Create {
                id: num(1)?,
                size: parse_size(w[2]).map_err(|e| err(&e))?,
                stream: num(3)?,
            },
            ("put", 2) => TierOp::Put {
                id: num(1)?,
                next_use: None,
            },
            ("put", 3) => TierOp::Put {
                id: num(1)?,
                next_use: Some(num(2)?),
            },
            ("get", 3) => TierOp::Get {
                id: num(1)?,
                stream: num(2)?,
            },
            ("free", 2) => TierOp::Free { id: num(1)? },
            ("offload", 2) => TierOp::Offload { id: num(1)? },
            ("advance", 2) => TierOp::Advance { now: num(1)? },
            _ => return Err(err("unknown operation or wrong number of fields")),
        };
        ops.push(op);
    }
    Ok(ops)
}

/// Writes a trace that [`parse`] reads back.
pub fn write(ops: &[TierOp]) -> String {
    let mut s = String::new();
    for op in ops {
        let _ = match *op {
            TierOp::Create { id, size, stream } => writeln!(s, "create {id} {size} {stream}"),
            TierOp::Put { id, next_use: None } => writeln!(s, "put {id}"),
            TierOp::Put {
                id,
                next_use: Some(t),
            } => writeln!(s, "put {id} {t}"),
            TierOp::Get { id, stream } => writeln!(s, "get {id} {stream}"),
            TierOp::Free { id } => writeln!(s, "free {id}"),
            TierOp::Offload { id } => writeln!(s, "offload {id}"),
            TierOp::Advance { now } => writeln!(s, "advance {now}"),
        };
    }
    s
}

/// The synthetic training job of `examples/tier_fwd_bwd.rs` as a trace: `layers` layers, each
/// with a weight (used in forward and backward) and an activation (made in forward, used in
/// backward in reverse order), for `steps` steps, next uses declared.
pub fn forward_backward(layers: u64, steps: u64) -> Vec<TierOp> {
    const MIB: u64 = 1 << 20;
    let wsize = |i: u64| (1 + i % 3) * MIB;
    let asize = |i: u64| (2 + (i * 5) % 7) * MIB;
    let per_step = 4 * layers;
    let mut ops = Vec::new();
    for i in 0..layers {
        ops.push(TierOp::Create {
            id: i,
            size: wsize(i),
            stream: 0,
        });
        ops.push(TierOp::Put {
            id: i,
            next_use: Some(i),
        });
    }
    let mut next_id = layers;
    for step in 0..steps {
        let base = step * per_step;
        let mut acts = Vec::new();
        for i in 0..layers {
            let bwd = base + 2 * layers - 1 - i;
            let a = next_id;
            next_id += 1;
            ops.extend([
                TierOp::Advance { now: base + i },
                TierOp::Get { id: i, stream: 0 },
                TierOp::Create {
                    id: a,
                    size: asize(i),
                    stream: 0,
                },
                TierOp::Put {
                    id: a,
                    next_use: Some(bwd),
                },
                TierOp::Put {
                    id: i,
                    next_use: Some(bwd),
                },
            ]);
            acts.push(a);
        }
        for i in (0..layers).rev() {
            let a = acts[i as usize];
            ops.extend([
                TierOp::Advance {
                    now: base + 2 * layers - 1 - i,
                },
                TierOp::Get { id: a, stream: 0 },
                TierOp::Get { id: i, stream: 0 },
                TierOp::Free { id: a },
                TierOp::Put {
                    id: i,
                    next_use: Some(base + per_step + i),
                },
            ]);
        }
    }
    ops
}

/// What a replay measured.
#[derive(Clone, Debug)]
pub struct TierReplay {
    pub policy: &'static str,
    pub stats: TierStats,
    /// The allocator's peak reserved bytes with the tier.
    pub peak_reserved: u64,
    /// Operations that failed (out of memory under the budget or the device): skipped.
    pub failed: u64,
    pub first_error: Option<String>,
}

fn bad(i: usize, op: &TierOp, why: &str) -> String {
    format!("operation {} ({op:?}): {why}", i + 1)
}

/// Replays `ops` through a tier with `policy` on a simulated device of `capacity` bytes.
/// Errors for an inconsistent trace (unknown id, put of a tensor not held); operations that
/// run out of memory are counted in `failed` and skipped.
pub fn replay(
    ops: &[TierOp],
    capacity: u64,
    config: Config,
    tier: TierConfig,
    policy: Box<dyn EvictionPolicy>,
) -> Result<TierReplay, String> {
    let dev = Arc::new(SimDevice::new(capacity).asynchronous().without_contents());
    let alloc =
        Arc::new(Allocator::new(dev.clone(), config).map_err(|e| format!("allocator: {e}"))?);
    let name = policy.name();
    let t = Tier::new(alloc.clone(), tier, policy);
    let mut ids: FxHashMap<u64, TensorId> = FxHashMap::default();
    let mut failed = 0;
    let mut first_error = None;
    for (i, op) in ops.iter().enumerate() {
        let id = |k: &u64| ids.get(k).copied().ok_or_else(|| bad(i, op, "unknown id"));
        let r = match op {
            TierOp::Create {
                id: k,
                size,
                stream,
            } => {
                if ids.contains_key(k) {
                    return Err(bad(i, op, "id in use"));
                }
                t.create(*size, *stream).map(|(tid, _)| {
                    ids.insert(*k, tid);
                })
            }
            TierOp::Put { id: k, next_use } => t.put(id(k)?, *next_use),
            TierOp::Get { id: k, stream } => t.get(id(k)?, *stream).map(|_| ()),
            TierOp::Free { id: k } => {
                let tid = id(k)?;
                ids.remove(k);
                t.free(tid)
            }
            TierOp::Offload { id: k } => t.offload(id(k)?),
            TierOp::Advance { now } => {
                dev.complete_all();
                t.advance(*now)
            }
        };
        match r {
            Ok(()) => {}
            Err(crate::Error::OutOfMemory(_)) => {
                failed += 1;
                first_error.get_or_insert_with(|| bad(i, op, "out of memory"));
            }
            Err(e) => return Err(bad(i, op, &e.to_string())),
        }
    }
    dev.complete_all();
    t.poll().map_err(|e| e.to_string())?;
    t.verify()?;
    let stats = t.stats();
    let peak_reserved = alloc.stats().reserved_bytes.aggregate().peak.max(0) as u64;
    Ok(TierReplay {
        policy: name,
        stats,
        peak_reserved,
        failed,
        first_error,
    })
}

/// The allocator's peak reserved bytes when every tensor of the trace stays on the device
/// (puts and gets do nothing), and the number of creates that did not fit.
pub fn replay_without_tier(
    ops: &[TierOp],
    capacity: u64,
    config: Config,
) -> Result<(u64, u64), String> {
    let dev = Arc::new(SimDevice::new(capacity));
    let alloc = Allocator::new(dev, config).map_err(|e| format!("allocator: {e}"))?;
    let mut ptrs: FxHashMap<u64, u64> = FxHashMap::default();
    let mut failed = 0;
    for (i, op) in ops.iter().enumerate() {
        match *op {
            TierOp::Create { id, size, stream } => match alloc.allocate(size, stream) {
                Ok(p) => {
                    ptrs.insert(id, p);
                }
                Err(crate::Error::OutOfMemory(_)) => failed += 1,
                Err(e) => return Err(bad(i, op, &e.to_string())),
            },
            TierOp::Free { id } => {
                if let Some(p) = ptrs.remove(&id) {
                    alloc.free(p).map_err(|e| bad(i, op, &e.to_string()))?;
                }
            }
            _ => {}
        }
    }
    let peak = alloc.stats().reserved_bytes.aggregate().peak.max(0) as u64;
    Ok((peak, failed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::{Lru, SizeLatencyAware};

    #[test]
    fn parse_and_write_round_trip() {
        let text = "# a trace\ncreate 1 4MiB 0\nput 1 12\nadvance 3  # tick\noffload 1\n\
                    get 1 7\nput 1\nfree 1\n";
        let ops = parse(text).unwrap();
        assert_eq!(ops.len(), 7);
        assert_eq!(
            ops[0],
            TierOp::Create {
                id: 1,
                size: 4 << 20,
                stream: 0
            }
        );
        assert_eq!(parse(&write(&ops)).unwrap(), ops);
        assert!(parse("create 1 4MiB").unwrap_err().contains("line 1"));
        assert!(parse("\nget x 0").unwrap_err().contains("line 2"));
        assert!(parse("jump 3").is_err());
    }

    #[test]
    fn replay_reports_bytes_moved_and_peaks() {
        let ops = forward_backward(8, 2);
        let (peak_all, failed) = replay_without_tier(&ops, 1 << 34, Config::default()).unwrap();
        assert_eq!(failed, 0);
        let budget = 26 << 20;
        let tier = TierConfig {
            device_budget: Some(budget),
            ..TierConfig::default()
        };
        let lru = replay(
            &ops,
            1 << 34,
            Config::default(),
            tier.clone(),
            Box::new(Lru),
        )
        .unwrap();
        let aware = replay(
            &ops,
            1 << 34,
            Config::default(),
            tier,
            Box::new(SizeLatencyAware::default()),
        )
        .unwrap();
        for r in [&lru, &aware] {
            assert_eq!(r.failed, 0, "{:?}", r.first_error);
            assert!(r.stats.peak_device_bytes <= budget);
            assert!(
                r.peak_reserved < peak_all,
                "{} vs {peak_all}",
                r.peak_reserved
            );
            assert!(r.stats.evictions > 0);
        }
        let moved = |r: &TierReplay| r.stats.bytes_to_host + r.stats.bytes_to_device;
        assert!(moved(&aware) < moved(&lru));
        // An inconsistent trace is an error, naming the operation.
        let bad = parse("create 1 1MiB 0\nput 2").unwrap();
        let e = replay(
            &bad,
            1 << 30,
            Config::default(),
            TierConfig::default(),
            Box::new(Lru),
        )
        .unwrap_err();
        assert!(e.contains("operation 2"), "{e}");
    }
}
