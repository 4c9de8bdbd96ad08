//! Replays an operation list (`gmlake ops TRACE --out FILE`) through the core on the simulated
//! device, `passes` times in a row (default 3), and reports the core's host time per operation,
//! the driver calls and the peak utilization (active / reserved, sampled at every allocation)
//! for the first and the second half of the first pass (the job as recorded: its warm-up, then
//! its steady state, which bench/latency.cpp `--ops` times on the GPU) and for each later pass
//! (a job whose period is the whole recording: everything is freed at the end of a pass).
//!
//! Run: `cargo run --release -p gmlake-cli --example ops_calls -- FILE [passes] [key=value...]`
//! (key=value as `GMLAKE_CONF`). Streams of the list are streams 0, 1, ... of the device.

use gmlake_cli::ops::{Op, Ops};
use gmlake_core::{Allocator, Config, SimDevice};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        eprintln!("usage: ops_calls FILE [passes] [key=value...]");
        std::process::exit(2);
    };
    let passes: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3).max(1);
    let mut cfg = Config::default();
    for kv in args.iter().skip(1).filter(|a| a.contains('=')) {
        let (k, v) = kv.split_once('=').expect("key=value");
        if let Err(e) = cfg.set(k, v) {
            eprintln!("ops_calls: {e}");
            std::process::exit(2);
        }
    }
    let ops = match std::fs::read(path)
        .map_err(|e| e.to_string())
        .and_then(|b| Ops::from_bytes(&b).map_err(|e| e.to_string()))
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ops_calls: {path}: {e}");
            std::process::exit(2);
        }
    };
    // 1 TiB, as `gmlake replay`: a chunk of virtual addresses is the device's size, and the
    // simulated address space holds 64 TiB.
    let a = Allocator::new(SimDevice::new(1 << 40), cfg).expect("an allocator");
    let mut live = vec![(0u64, 0u64); ops.slots];
    let half = ops.ops.len() / 2;
    // Pass 0 in halves (the job as recorded: warm-up, then its steady state), then whole passes.
    let mut parts: Vec<(String, std::ops::Range<usize>)> = vec![
        ("pass 0, first half".into(), 0..half),
        ("pass 0, second half".into(), half..ops.ops.len()),
    ];
    parts.extend((1..passes).map(|p| (format!("pass {p}"), 0..ops.ops.len())));
    let mut active = 0u64;
    for (name, range) in parts {
        let c0 = a.device().calls();
        let (mut peak_active, mut peak_reserved) = (0u64, 0u64);
        let n = range.len();
        let t0 = std::time::Instant::now();
        for op in &ops.ops[range] {
            match *op {
                Op::Alloc { slot, stream, size } => {
                    let p = match a.allocate(size, u64::from(stream)) {
                        Ok(p) => p,
                        Err(e) => {
                            eprintln!("ops_calls: {name}: allocating {size} bytes on stream {stream}: {e}");
                            std::process::exit(1);
                        }
                    };
                    live[slot as usize] = (p, size);
                    active += size;
                    peak_active = peak_active.max(active);
                    peak_reserved = peak_reserved.max(a.reserved_bytes());
                }
                Op::Free { slot } => {
                    let (p, size) = live[slot as usize];
                    if let Err(e) = a.free(p) {
                        eprintln!("ops_calls: {name}: freeing {p:#x}: {e}");
                        std::process::exit(1);
                    }
                    active = active.saturating_sub(size);
                }
            }
        }
        let ns = t0.elapsed().as_nanos() as f64 / n.max(1) as f64;
        let c1 = a.device().calls();
        let d = gmlake_core::cost::difference(&c1, &c0);
        let (_, busy_ms) = gmlake_core::cost::estimate_ms(&d);
        println!(
            "{name}: {n} ops, core host ns/op {ns:.0}, driver calls {} (map {}, unmap {}, create {}), est. busy ms {busy_ms:.1}, peak util {:.4}",
            d.total(),
            d.map,
            d.unmap,
            d.create_physical,
            peak_active as f64 / peak_reserved.max(1) as f64
        );
    }
    a.verify().expect("the allocator's invariants");
}
