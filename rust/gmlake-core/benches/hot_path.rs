//! Alloc + free on the simulated device: the cost of the allocator's own bookkeeping.
//!
//! - `hit/<size>/<live>`: one allocate + free pair of `size` bytes that finds a cached
//!   block, with `live` other blocks allocated (1k to 100k) to show how it grows.
//! - `mixed/<live>`: a random pattern: free a random live block, allocate a random size
//!   (512 B to 32 MiB), with `live` blocks kept alive.
//!
//! Run: `cargo bench -p gmlake-core --bench hot_path`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use gmlake_core::{Allocator, Config, SimDevice};
use std::hint::black_box;

const MIB: u64 = 1 << 20;

fn populated(live: usize) -> (Allocator<SimDevice>, Vec<u64>) {
    let a = Allocator::new(SimDevice::new(1 << 44), Config::default()).unwrap();
    let mut seed = 12345u64;
    let ptrs = (0..live)
        .map(|_| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            a.allocate(512 + (seed >> 33) % (4 * MIB), 0).unwrap()
        })
        .collect();
    (a, ptrs)
}

fn hit(c: &mut Criterion) {
    let mut g = c.benchmark_group("hit");
    for live in [1_000usize, 10_000, 100_000] {
        let (a, _ptrs) = populated(live);
        for size in [512u64, 64 << 10, 2 * MIB, 64 * MIB, 1 << 30] {
            let p = a.allocate(size, 0).unwrap();
            a.free(p).unwrap();
            g.bench_with_input(
                BenchmarkId::new(format!("{size}"), live),
                &size,
                |b, &size| {
                    b.iter(|| {
                        let p = a.allocate(black_box(size), 0).unwrap();
                        a.free(p).unwrap();
                    })
                },
            );
        }
    }
    g.finish();
}

fn mixed(c: &mut Criterion) {
    let mut g = c.benchmark_group("mixed");
    for live in [1_000usize, 10_000, 100_000] {
        let (a, mut ptrs) = populated(live);
        let mut seed = 777u64;
        g.bench_function(BenchmarkId::from_parameter(live), |b| {
            b.iter(|| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let i = (seed >> 33) as usize % ptrs.len();
                a.free(ptrs[i]).unwrap();
                let size = 512 + (seed >> 7) % (32 * MIB);
                ptrs[i] = a.allocate(size, 0).unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, hit, mixed);
criterion_main!(benches);
