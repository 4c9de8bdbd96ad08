//! The contract suite of `gmlake_core::contract` (the driver rules of the device trait, then the
//! allocator's behaviour) on a real GPU, through `CudaDevice`: the same cases that run on the
//! simulated device and on the mock driver in the tests.
//!
//! ```text
//! cargo build --release -p gmlake-cuda --example contract
//! target/release/examples/contract [--device N] [--only SUBSTRING] [--list]
//! ```
//!
//! Prints one line per case (`PASS`, `FAIL` with the message, `SKIP` with the reason: cases whose
//! misuse is undefined behaviour in the real driver, or that the real driver allows, run on the
//! models only), then a summary. Exit status: 0 when no case failed, 1 when one did, 2 without a
//! usable GPU or on bad arguments. `scripts/contract-gpu.sh` runs it.

use gmlake_core::contract::{self, Target};
use gmlake_core::{Device, DeviceResult};
use gmlake_cuda::CudaDevice;

/// The real driver on device `ordinal`: each case opens the device again (retaining its primary
/// context) and releases it when done.
struct Gpu {
    ordinal: i32,
}

impl Target for Gpu {
    type Dev = CudaDevice;
    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }
    fn open(&self) -> DeviceResult<CudaDevice> {
        CudaDevice::new(self.ordinal)
    }
    fn is_model(&self) -> bool {
        false
    }
}

fn main() {
    let mut ordinal = 0i32;
    let mut only: Vec<String> = Vec::new();
    let mut list = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) => ordinal = n,
                None => usage("--device needs a number"),
            },
            "--only" => match args.next() {
                Some(s) => only.push(s),
                None => usage("--only needs a substring of case names"),
            },
            "--list" => list = true,
            "-h" | "--help" => usage(""),
            other => usage(&format!("unknown argument {other}")),
        }
    }
    let cases: Vec<_> = contract::all_cases::<Gpu>()
        .into_iter()
        .filter(|c| only.is_empty() || only.iter().any(|s| c.name.contains(s.as_str())))
        .collect();
    if list {
        for c in &cases {
            println!("{} ({:?})", c.name, c.only);
        }
        return;
    }
    let dev = match CudaDevice::new(ordinal) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("contract: no usable GPU {ordinal}: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "contract suite on {dev:?}, driver {}, {} case(s)",
        gmlake_cuda::driver_version().unwrap_or(-1),
        cases.len()
    );
    let free = dev.free_memory().unwrap_or(0);
    drop(dev);
    let target = Gpu { ordinal };
    let t0 = std::time::Instant::now();
    let report = contract::run_with(&target, &cases, |line| println!("{line}"));
    println!(
        "{} in {:.1} s (device memory free before: {} MiB)",
        report.summary(),
        t0.elapsed().as_secs_f64(),
        free >> 20
    );
    std::process::exit(if report.ok() { 0 } else { 1 });
}

fn usage(err: &str) -> ! {
    if !err.is_empty() {
        eprintln!("contract: {err}");
    }
    eprintln!("usage: contract [--device N] [--only SUBSTRING]... [--list]");
    std::process::exit(if err.is_empty() { 0 } else { 2 });
}
