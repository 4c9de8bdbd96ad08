//! Driver calls and utilization of bench/latency.cpp's random mixed pattern on the simulated
//! device: `live` blocks alive, sizes log-uniform in [512 B, 32 MiB]; each step frees a
//! random live block and allocates a new random size. After a warm-up (max(ops/5, 4 live)
//! steps) it counts the driver calls of `ops` steps (2 ops each) and reports the peak
//! utilization (active / reserved, sampled at every step) over them.
//!
//! Run: `cargo run --release -p gmlake-core --example mixed_calls -- [live] [ops] [key=value...]`
//! (defaults 10000 and 1000000, latency.cpp's; key=value as `GMLAKE_CONF`). `MIXED_MIN` and
//! `MIXED_MAX` (bytes) change the size range: `MIXED_MIN=1048576 MIXED_MAX=536870912` with
//! about 370 live blocks is bench/workloads/stress.py's pattern (1-512 MiB, 30 GiB live).
//! `MIXED_CAPACITY` (bytes) sets the simulated device's size (default 16 TiB).
//!
//! `MIXED_PROGRESS=k` prints, k times along the pairs (evenly spaced), the driver calls made so
//! far (fill included; maps, unmaps, creations and releases among them), the page-size upgrades,
//! the memory held and the alias evictions: where a long run's calls come from (the upgrade's
//! drain, alias evictions). The closing line's driver estimate is given for the timed part and
//! from the start.
//!
//! `MIXED_STATS_EVERY=k` reads the statistics every k pairs during the run (their cost is in
//! the host ns/op); `MIXED_STATS=N` times N reads, each after one more pair, at the end.
//!
//! `MIXED_SEQUENCE=FILE` replays a sequence written by bench/mixed_sequence.cpp instead: the
//! operations bench/latency.cpp makes for its seed (live blocks, warm-up and timed pairs from
//! the file; `live` and `ops` are ignored). The pattern's calls depend on the sequence far more
//! than on the device (other seeds of the same distribution: 4k to 33k calls over 200k pairs),
//! so a comparison with the GPU uses the GPU's sequence.

use gmlake_core::{Allocator, Config, SimDevice};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let nums: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let live_n = nums.first().copied().unwrap_or(10_000);
    let ops = nums.get(1).copied().unwrap_or(1_000_000);
    let mut cfg = Config::default();
    for kv in args.iter().filter(|a| a.contains('=')) {
        let (k, v) = kv.split_once('=').unwrap();
        cfg.set(k, v).expect("a valid setting");
    }
    // The simulated device's size (`MIXED_CAPACITY`, bytes; 85899345920 for an 80 GB H100),
    // to compare with a GPU of that size.
    let capacity = std::env::var("MIXED_CAPACITY")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(1 << 44);
    let a = Allocator::new(SimDevice::new(capacity), cfg).unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64
        ^ std::env::var("MIXED_SEED")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            .wrapping_mul(0x2545_f491_4f6c_dd1d);
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let env_size = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(default)
    };
    let (lmin, lmax) = (
        (env_size("MIXED_MIN", 512) as f64).ln(),
        (env_size("MIXED_MAX", 32 << 20) as f64).ln(),
    );
    let draw = |r: u64| {
        let u = (r >> 11) as f64 / (1u64 << 53) as f64;
        (lmin + u * (lmax - lmin)).exp() as u64
    };
    // (fill sizes, warm-up pairs, timed pairs as (index, size)): drawn here, or read.
    let (fill, warm, pairs) = match std::env::var_os("MIXED_SEQUENCE") {
        Some(path) => match read_sequence(std::path::Path::new(&path)) {
            Ok(s) => s,
            Err(e) => {
                eprintln!(
                    "mixed_calls: MIXED_SEQUENCE={}: {e}",
                    path.to_string_lossy()
                );
                std::process::exit(2);
            }
        },
        None => {
            let fill: Vec<u64> = (0..live_n).map(|_| draw(next())).collect();
            let warm = (ops / 5).max(4 * live_n);
            let pairs: Vec<(usize, u64)> = (0..warm + ops)
                .map(|_| {
                    let j = (next() >> 33) as usize % live_n;
                    (j, draw(next()))
                })
                .collect();
            (fill, warm, pairs)
        }
    };
    let (live_n, ops) = (fill.len(), pairs.len() - warm);
    let mut live: Vec<u64> = Vec::with_capacity(live_n);
    let mut sizes: Vec<u64> = Vec::with_capacity(live_n);
    let mut active: u64 = 0;
    for &s in &fill {
        live.push(a.allocate(s, 0).unwrap());
        sizes.push(s);
        active += s;
    }
    let mut c0 = a.device().calls();
    let (mut peak_active, mut peak_reserved) = (0u64, 0u64);
    let mut min_util = f64::INFINITY;
    let mut t0 = std::time::Instant::now();
    // `MIXED_STATS_EVERY=k`: read the statistics every k pairs, as a job that logs its memory
    // once a step does (the arenas then note the blocks each pair changes).
    let every = std::env::var("MIXED_STATS_EVERY")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&k| k > 0);
    let progress = std::env::var("MIXED_PROGRESS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&k| k > 0)
        .map(|k| (pairs.len() / k).max(1));
    for (i, &(j, s)) in pairs.iter().enumerate() {
        if progress.is_some_and(|every| i % every == 0) {
            let (c, st) = (a.device().calls(), a.stats());
            eprintln!(
                "pair {i}: calls {} (map {}, unmap {}, create {}, release {}), upgrades {}, held {} GiB, alias evictions {}, stitches {}, reuses {}",
                c.total(),
                c.map,
                c.unmap,
                c.create_physical,
                c.release_physical,
                st.page_upgrades,
                a.reserved_bytes() >> 30,
                st.alias_evictions,
                st.stitches,
                st.stitch_reuses
            );
        }
        if every.is_some_and(|k| i % k == 0) {
            std::hint::black_box(a.stats());
        }
        if i == warm {
            c0 = a.device().calls();
            t0 = std::time::Instant::now();
        }
        a.free(live[j]).unwrap();
        active -= sizes[j];
        live[j] = a.allocate(s, 0).unwrap();
        sizes[j] = s;
        active += s;
        if i >= warm {
            let res = a.reserved_bytes();
            peak_active = peak_active.max(active);
            peak_reserved = peak_reserved.max(res);
            min_util = min_util.min(active as f64 / res as f64);
        }
    }
    let host_ns = t0.elapsed().as_nanos() as f64 / (2.0 * ops as f64);
    let c1 = a.device().calls();
    let st = a.stats();
    stats_cost(&a, &mut live, &pairs);
    let (_, busy_ms) = gmlake_core::cost::estimate_ms(&gmlake_core::cost::difference(&c1, &c0));
    let (_, all_ms) = gmlake_core::cost::estimate_ms(&c1);
    println!(
        "mixed live={live_n} ops={ops}: est. busy ms {busy_ms:.0} ({all_ms:.0} from the start), calls {} (map {}, unmap {}, create {}, release {}, events {}), peak util {:.4}, min util {:.4}, stitches {}, reuses {}, evictions {}, upgrades {} (page {} MiB), core host ns/op {host_ns:.0} (simulated device, utilization sampled every step)",
        c1.total() - c0.total(),
        c1.map - c0.map,
        c1.unmap - c0.unmap,
        c1.create_physical - c0.create_physical,
        c1.release_physical - c0.release_physical,
        (c1.record_event + c1.query_event + c1.create_event)
            - (c0.record_event + c0.query_event + c0.create_event),
        peak_active as f64 / peak_reserved as f64,
        min_util,
        st.stitches,
        st.stitch_reuses,
        st.alias_evictions,
        st.page_upgrades,
        a.page_size() >> 20,
    );
    a.verify().unwrap();
}

/// `MIXED_STATS=N`: N more pairs of the sequence (from its start), each followed by a timed
/// `stats()` (what `torch.cuda.memory_allocated()` reaches), as a job that polls its memory
/// per operation would; prints the mean and the largest time of those calls.
fn stats_cost(a: &Allocator<SimDevice>, live: &mut [u64], pairs: &[(usize, u64)]) {
    let Some(n) = std::env::var("MIXED_STATS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    else {
        return;
    };
    let (mut total, mut max) = (0u128, 0u128);
    for &(j, s) in pairs.iter().cycle().take(n) {
        a.free(live[j]).unwrap();
        live[j] = a.allocate(s, 0).unwrap();
        let t = std::time::Instant::now();
        std::hint::black_box(a.stats());
        let ns = t.elapsed().as_nanos();
        total += ns;
        max = max.max(ns);
    }
    println!(
        "stats() after each of {n} pairs: mean {:.1} µs, max {:.1} µs ({} live blocks)",
        total as f64 / n.max(1) as f64 / 1e3,
        max as f64 / 1e3,
        live.len()
    );
}

/// Fill sizes, warm-up pair count, and the pairs (index freed, size allocated).
type Sequence = (Vec<u64>, usize, Vec<(usize, u64)>);

/// A sequence written by bench/mixed_sequence.cpp: little-endian u64 words live, warm, ops,
/// sampled, then `live` fill sizes, then (index, size) per pair. Returns the fill sizes, the
/// warm-up pair count and the warm-up and timed pairs (the sampled ones are left out).
fn read_sequence(path: &std::path::Path) -> Result<Sequence, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    if bytes.len() % 8 != 0 {
        return Err(format!("{} bytes: not whole u64 words", bytes.len()));
    }
    let w: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let [live, warm, ops, sampled] = match w.get(..4) {
        Some(&[a, b, c, d]) => [a, b, c, d].map(|x| x as usize),
        _ => return Err("shorter than its header".into()),
    };
    let want = [warm, ops, sampled]
        .iter()
        .try_fold(0usize, |t, &x| t.checked_add(x))
        .and_then(|p| p.checked_mul(2))
        .and_then(|p| p.checked_add(live))
        .and_then(|p| p.checked_add(4));
    if live == 0 || want != Some(w.len()) {
        let want = want.map_or("more than can be".to_string(), |n| n.to_string());
        return Err(format!(
            "{} words, but its header (live {live}, warm {warm}, ops {ops}, sampled {sampled}) says {want}",
            w.len()
        ));
    }
    let fill = w[4..4 + live].to_vec();
    let pairs: Vec<(usize, u64)> = w[4 + live..]
        .chunks_exact(2)
        .take(warm + ops)
        .map(|p| (p[0] as usize, p[1]))
        .collect();
    if let Some(&(j, _)) = pairs.iter().find(|p| p.0 >= live) {
        return Err(format!("a pair frees block {j} of {live}"));
    }
    if fill
        .iter()
        .chain(pairs.iter().map(|p| &p.1))
        .any(|&s| s == 0)
    {
        return Err("a size of 0".into());
    }
    Ok((fill, warm, pairs))
}
