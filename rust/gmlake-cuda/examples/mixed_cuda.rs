//! The random mixed pattern of bench/latency.cpp (live blocks of log-uniform sizes in
//! [512 B, 32 MiB]; each step frees a random live block and allocates a random size) run on the
//! core directly, over the real driver and over the simulated device in the same process: how
//! much of the host time per operation is the core's, how much the driver's, and (against
//! bench/latency.cpp through PyTorch) how much the C++ adapter's.
//!
//! ```text
//! cargo build --release -p gmlake-cuda --example mixed_cuda
//! target/release/examples/mixed_cuda [live] [ops] [key=value...]    # defaults 10000 200000
//! ```
//!
//! Without a GPU only the simulated device runs.

use gmlake_core::{Allocator, Config, Device, SimDevice};
use gmlake_cuda::CudaDevice;
use std::time::Instant;

fn run<D: Device>(name: &str, dev: D, cfg: Config, live_n: usize, ops: usize) {
    let a = match Allocator::new(dev, cfg) {
        Ok(a) => a,
        Err(e) => {
            println!("{name}: cannot create the allocator: {e}");
            return;
        }
    };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let (lmin, lmax) = ((512f64).ln(), ((32u64 << 20) as f64).ln());
    let draw = |r: u64| {
        let u = (r >> 11) as f64 / (1u64 << 53) as f64;
        (lmin + u * (lmax - lmin)).exp() as u64
    };
    let mut live = Vec::with_capacity(live_n);
    for _ in 0..live_n {
        live.push(a.allocate(draw(next()), 0).expect("fill"));
    }
    let warm = (ops / 5).max(4 * live_n);
    let mut c0 = a.stats().driver_calls;
    let mut t0 = Instant::now();
    let mut slowest = 0u128;
    for i in 0..warm + ops {
        if i == warm {
            c0 = a.stats().driver_calls;
            t0 = Instant::now();
        }
        let j = (next() >> 33) as usize % live_n;
        let s = Instant::now();
        a.free(live[j]).expect("free");
        live[j] = a.allocate(draw(next()), 0).expect("allocate");
        if i >= warm {
            slowest = slowest.max(s.elapsed().as_nanos());
        }
    }
    let ns = t0.elapsed().as_nanos() as f64 / (2.0 * ops as f64);
    let st = a.stats();
    let c1 = st.driver_calls;
    println!(
        "{name}: {ns:.0} ns/op over {ops} pairs ({live_n} live), slowest pair {:.1} us, driver calls {} (map {}, create {}, unmap {}, events {}), reserved {:.2} GiB, stitches {}",
        slowest as f64 / 1000.0,
        c1.total() - c0.total(),
        c1.map - c0.map,
        c1.create_physical - c0.create_physical,
        c1.unmap - c0.unmap,
        (c1.record_event + c1.query_event + c1.create_event)
            - (c0.record_event + c0.query_event + c0.create_event),
        a.reserved_bytes() as f64 / (1u64 << 30) as f64,
        st.stitches,
    );
    for p in live {
        a.free(p).expect("free");
    }
    let _ = a.empty_cache();
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let nums: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let live_n = nums.first().copied().unwrap_or(10_000);
    let ops = nums.get(1).copied().unwrap_or(200_000);
    let mut cfg = Config::default();
    for kv in args.iter().filter(|a| a.contains('=')) {
        let (k, v) = kv.split_once('=').unwrap();
        if let Err(e) = cfg.set(k, v) {
            eprintln!("{e}");
            std::process::exit(2);
        }
    }
    run(
        "simulated",
        SimDevice::new(80 << 30),
        cfg.clone(),
        live_n,
        ops,
    );
    match CudaDevice::new(0) {
        Ok(d) => run("cuda", d, cfg, live_n, ops),
        Err(e) => println!("cuda: no GPU here ({e})"),
    }
}
