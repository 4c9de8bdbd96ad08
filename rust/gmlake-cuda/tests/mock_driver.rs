//! Exercises `CudaDevice` against a mock `libcuda.so` (tests/mock/libcuda_mock.c), so its
//! logic (symbol resolution, error mapping, context handling, the exportable fallback, peers,
//! event bookkeeping) is tested on machines without a GPU.
//!
//! `mock_driver_scenarios` compiles the mock with the system C compiler (skipped without one)
//! and runs this same test binary again, once per scenario, with the mock first on
//! `LD_LIBRARY_PATH` (the library search happens once per process). `mock_inner` does the
//! work in the child and returns at once in a normal run.

#![deny(clippy::undocumented_unsafe_blocks)]

use gmlake_core::{contract, EventHandle, HostPtr, PhysHandle};
use gmlake_cuda::{CudaDevice, Device, DeviceError};
use std::path::{Path, PathBuf};
use std::process::Command;

const SCENARIO_VAR: &str = "GMLAKE_MOCK_SCENARIO";
const MIB2: usize = 2 << 20;

fn compile(src: &Path, out_dir: &Path, defines: &[&str]) -> bool {
    std::fs::create_dir_all(out_dir).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(out_dir.join("libcuda.so"))
        .arg(src)
        .args(defines)
        .arg("-lpthread")
        .status();
    matches!(status, Ok(s) if s.success())
}

#[test]
fn mock_driver_scenarios() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/mock/libcuda_mock.c");
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("gmlake-cuda-mock-{}", std::process::id()));
    let full = base.join("full");
    let old = base.join("old");
    let no_host = base.join("no_host");
    if !compile(&src, &full, &[])
        || !compile(&src, &old, &["-DMOCK_OMIT_MEMMAP"])
        || !compile(&src, &no_host, &["-DMOCK_OMIT_HOST"])
    {
        eprintln!("skipping the mock driver tests: no working C compiler (cc)");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    // (name, directory of the mock library, extra environment)
    type Scenario<'a> = (&'a str, &'a Path, &'a [(&'a str, &'a str)]);
    let scenarios: &[Scenario] = &[
        ("normal", &full, &[]),
        ("no_fd_create", &full, &[("MOCK_CUDA_NO_FD", "1")]),
        (
            "no_fd_attr",
            &full,
            &[("MOCK_CUDA_NO_FD", "1"), ("MOCK_CUDA_NO_FD_ATTR", "1")],
        ),
        ("init_fail", &full, &[("MOCK_CUDA_INIT_FAIL", "100")]),
        ("missing_symbol", &old, &[]),
        ("no_host", &no_host, &[]),
        // The contract suite of gmlake_core on the mock: a 16 GiB device (its memory is only
        // allocated where copies touch it).
        ("contract", &full, &[("MOCK_CUDA_MEM", "17179869184")]),
    ];
    for (name, dir, env) in scenarios {
        let mut cmd = Command::new(&exe);
        cmd.args(["mock_inner", "--exact", "--nocapture", "--test-threads=1"])
            .env(SCENARIO_VAR, name)
            .env("LD_LIBRARY_PATH", dir);
        for (k, v) in env.iter() {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("re-running the test binary");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "scenario {name} failed:\n{text}");
        assert!(
            text.contains(&format!("scenario {name} ok")),
            "scenario {name} did not run:\n{text}"
        );
    }
    let _ = std::fs::remove_dir_all(&base);
}

/// The mock's test helpers, opened from the same (already loaded) library.
struct Mock {
    lib: libloading::Library,
}

impl Mock {
    fn open() -> Mock {
        // SAFETY: (test) the mock library is the one cudarc loaded; loading it runs no
        // initialisers.
        let lib = unsafe { libloading::Library::new("libcuda.so") }.expect("mock libcuda");
        Mock { lib }
    }
    fn primary_refs(&self, dev: i32) -> i32 {
        // SAFETY: (test) prototype as in libcuda_mock.c.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn(i32) -> i32>(b"mock_primary_refs")
                .unwrap()(dev)
        }
    }
    fn set_current_calls(&self) -> i64 {
        // SAFETY: (test) prototype as in libcuda_mock.c.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn() -> i64>(b"mock_set_current_calls")
                .unwrap()()
        }
    }
    fn ctx_of(&self, dev: i32) -> usize {
        // SAFETY: (test) prototype as in libcuda_mock.c.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn(i32) -> usize>(b"mock_ctx_of")
                .unwrap()(dev)
        }
    }
    fn current(&self) -> usize {
        let mut c: usize = 0;
        // SAFETY: (test) cuCtxGetCurrent(CUcontext *), out-pointer valid.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn(*mut usize) -> u32>(b"cuCtxGetCurrent")
                .unwrap()(&mut c)
        };
        c
    }
    fn set_current(&self, ctx: usize) {
        // SAFETY: (test) cuCtxSetCurrent(CUcontext); the mock validates the value.
        let r = unsafe {
            self.lib
                .get::<unsafe extern "C" fn(usize) -> u32>(b"cuCtxSetCurrent")
                .unwrap()(ctx)
        };
        assert_eq!(r, 0);
    }
    fn last_access(&self) -> Vec<i32> {
        let mut ids = [0i32; 8];
        // SAFETY: (test) prototype as in libcuda_mock.c; `ids` holds the mock's maximum of 8.
        let n = unsafe {
            self.lib
                .get::<unsafe extern "C" fn(*mut i32) -> i32>(b"mock_last_access")
                .unwrap()(ids.as_mut_ptr())
        };
        ids[..n as usize].to_vec()
    }
    fn used(&self) -> usize {
        // SAFETY: (test) prototype as in libcuda_mock.c.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn() -> usize>(b"mock_used")
                .unwrap()()
        }
    }
    fn host_live(&self) -> i64 {
        // SAFETY: (test) prototype as in libcuda_mock.c.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn() -> i64>(b"mock_host_live")
                .unwrap()()
        }
    }
    fn count(&self, name: &[u8]) -> usize {
        // SAFETY: (test) the mock_live_* helpers take no argument and return an int or long;
        // reading either as i64 on x86_64 / aarch64 Linux gets the value (returned in a
        // 64-bit register, an int sign-extended where it is non-negative and small).
        let n = unsafe { self.lib.get::<unsafe extern "C" fn() -> i64>(name).unwrap()() };
        (n as i32) as usize
    }
    fn live_mappings(&self) -> i32 {
        // SAFETY: (test) prototype as in libcuda_mock.c.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn() -> i32>(b"mock_live_mappings")
                .unwrap()()
        }
    }
}

#[test]
fn mock_inner() {
    let Ok(scenario) = std::env::var(SCENARIO_VAR) else {
        return;
    };
    match scenario.as_str() {
        "normal" => normal(),
        "no_fd_create" => no_fd_create(),
        "no_fd_attr" => no_fd_attr(),
        "init_fail" => match CudaDevice::new(0) {
            Err(DeviceError::Unavailable(m)) => {
                assert!(
                    m.contains("cuInit") && m.contains("CUDA_ERROR_NO_DEVICE"),
                    "{m}"
                )
            }
            other => panic!("expected Unavailable, got {other:?}"),
        },
        "missing_symbol" => match CudaDevice::new(0) {
            Err(DeviceError::Unavailable(m)) => assert!(m.contains("cuMemMap"), "{m}"),
            other => panic!("expected Unavailable, got {other:?}"),
        },
        "no_host" => no_host(),
        "contract" => contract(),
        s => panic!("unknown scenario {s}"),
    }
    println!("scenario {scenario} ok");
}

fn normal() {
    assert_eq!(gmlake_cuda::device_count(), Ok(2));
    assert_eq!(gmlake_cuda::driver_version(), Ok(13000));
    assert!(matches!(
        CudaDevice::new(2),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert!(matches!(
        CudaDevice::new(-1),
        Err(DeviceError::InvalidArgument(_))
    ));

    let mock = Mock::open();
    let d = CudaDevice::new(0).unwrap();
    assert_eq!(mock.primary_refs(0), 1);
    assert_eq!(d.ordinal(), 0);
    assert_eq!(d.granularity(), Ok(MIB2));
    assert_eq!(d.total_memory(), Ok(64 << 20));
    assert!(d.exportable());

    // The whole VMM cycle, one set_access over two mappings.
    let h1 = d.create_physical(MIB2).unwrap();
    let h2 = d.create_physical(2 * MIB2).unwrap();
    assert_eq!(d.free_memory(), Ok((64 << 20) - 3 * MIB2));
    let va = d.reserve_va(4 * MIB2, 0).unwrap();
    assert_eq!(va % MIB2 as u64, 0);
    d.map(va, MIB2, h1).unwrap();
    d.map(va + MIB2 as u64, 2 * MIB2, h2).unwrap();
    d.set_access(va, 3 * MIB2).unwrap();
    assert_eq!(mock.last_access(), vec![0]);
    // A stitched view: the same pages again at a second range.
    let va2 = d.reserve_va(3 * MIB2, 4 * MIB2).unwrap();
    assert_eq!(va2 % (4 * MIB2) as u64, 0);
    d.map(va2, MIB2, h1).unwrap();
    d.map(va2 + MIB2 as u64, 2 * MIB2, h2).unwrap();
    d.set_access(va2, 3 * MIB2).unwrap();
    assert_eq!(mock.live_mappings(), 4);

    // Rule violations come back as errors.
    match d.release_physical(h1) {
        Err(DeviceError::Driver {
            call,
            code,
            message,
        }) => {
            assert_eq!((call, code), ("cuMemRelease", 1));
            assert!(message.contains("CUDA_ERROR_INVALID_VALUE"), "{message}");
        }
        other => panic!("release of a mapped handle: {other:?}"),
    }
    assert!(matches!(
        d.free_va(va, 4 * MIB2),
        Err(DeviceError::Driver {
            call: "cuMemAddressFree",
            ..
        })
    ));
    assert!(matches!(
        d.map(va + 1, MIB2, h1),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert!(matches!(
        d.create_physical(MIB2 + 4096),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert!(matches!(
        d.create_physical(0),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert!(matches!(
        d.reserve_va(MIB2, 3 * MIB2),
        Err(DeviceError::InvalidArgument(_))
    ));
    // A code no binding knows is reported, not misread.
    match d.free_va(0xdead_0000_0000, MIB2) {
        Err(DeviceError::Driver { code, message, .. }) => {
            assert_eq!(code, 999);
            assert_eq!(message, "unknown CUDA error 999");
        }
        other => panic!("{other:?}"),
    }

    // Out of memory.
    assert_eq!(d.create_physical(64 << 20), Err(DeviceError::OutOfMemory));

    for (a, s) in [
        (va, MIB2),
        (va + MIB2 as u64, 2 * MIB2),
        (va2, MIB2),
        (va2 + MIB2 as u64, 2 * MIB2),
    ] {
        d.unmap(a, s).unwrap();
    }
    d.free_va(va, 4 * MIB2).unwrap();
    d.free_va(va2, 3 * MIB2).unwrap();

    // IPC round trip.
    let fd = d.export_fd(h1).unwrap();
    assert!(fd >= 0);
    let h3 = d.import_fd(fd).unwrap();
    assert_ne!(h3, h1);
    d.release_physical(h3).unwrap();
    // SAFETY: (test) `fd` is a descriptor the caller owns, per export_fd's contract.
    drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
    assert!(matches!(
        d.import_fd(-1),
        Err(DeviceError::InvalidArgument(_))
    ));

    d.release_physical(h1).unwrap();
    d.release_physical(h2).unwrap();
    assert_eq!(mock.used(), 0);

    // Peers: future set_access calls grant both devices.
    d.add_peer(0).unwrap();
    assert!(matches!(
        d.add_peer(7),
        Err(DeviceError::InvalidArgument(_))
    ));
    d.add_peer(1).unwrap();
    d.add_peer(1).unwrap();
    assert_eq!(d.peers(), vec![1]);
    let h = d.create_physical(MIB2).unwrap();
    let va = d.reserve_va(MIB2, 0).unwrap();
    d.map(va, MIB2, h).unwrap();
    d.set_access(va, MIB2).unwrap();
    assert_eq!(mock.last_access(), vec![0, 1]);
    d.unmap(va, MIB2).unwrap();
    d.free_va(va, MIB2).unwrap();
    d.release_physical(h).unwrap();

    // Events: NOT_READY -> false, SUCCESS -> true; unknown handles never reach the driver.
    let e = d.create_event().unwrap();
    d.record_event(e, 0).unwrap();
    assert_eq!(d.query_event(e), Ok(false));
    assert_eq!(d.query_event(e), Ok(true));
    d.record_event(e, 0x5157).unwrap();
    assert!(matches!(
        d.record_event(e, 0x7777),
        Err(DeviceError::Driver {
            call: "cuEventRecord",
            ..
        })
    ));
    d.synchronize().unwrap();
    d.destroy_event(e).unwrap();
    assert!(matches!(
        d.destroy_event(e),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert!(matches!(
        d.query_event(EventHandle(12345)),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert!(matches!(
        d.record_event(EventHandle(12345), 0),
        Err(DeviceError::InvalidArgument(_))
    ));
    let _leaked = d.create_event().unwrap(); // destroyed by Drop

    host_round_trip(&mock, &d);

    // Context handling. This thread has had no context of its own: the device's stays current.
    assert_eq!(mock.current(), mock.ctx_of(0));
    let before = mock.set_current_calls();
    d.free_memory().unwrap();
    assert_eq!(
        mock.set_current_calls(),
        before,
        "no switch when already current"
    );
    // A thread with no current context (e.g. an autograd thread).
    std::thread::scope(|s| {
        s.spawn(|| {
            assert_eq!(mock.current(), 0);
            let h = d.create_physical(MIB2).unwrap();
            d.release_physical(h).unwrap();
            assert_eq!(mock.current(), mock.ctx_of(0));
        });
        // A thread working on device 1: it gets device 1 back after each call.
        s.spawn(|| {
            mock.set_current(mock.ctx_of(1));
            let h = d.create_physical(MIB2).unwrap();
            assert_eq!(mock.current(), mock.ctx_of(1));
            let e = d.create_event().unwrap();
            d.record_event(e, 0).unwrap();
            d.destroy_event(e).unwrap();
            d.release_physical(h).unwrap();
            assert_eq!(mock.current(), mock.ctx_of(1));
        });
    });

    // Shared across threads through an Arc, as the allocator holds it.
    let shared = std::sync::Arc::new(d);
    let handles: Vec<PhysHandle> = std::thread::scope(|s| {
        let ts: Vec<_> = (0..4)
            .map(|_| {
                let d = shared.clone();
                s.spawn(move || d.create_physical(MIB2).unwrap())
            })
            .collect();
        ts.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for h in handles {
        shared.release_physical(h).unwrap();
    }

    let d = std::sync::Arc::into_inner(shared).unwrap();
    assert_eq!(mock.host_live(), 1);
    drop(d);
    assert_eq!(mock.primary_refs(0), 0, "Drop releases the primary context");
    assert_eq!(mock.host_live(), 0, "Drop frees pinned buffers");
}

fn no_fd_create() {
    let d = CudaDevice::new(0).unwrap();
    assert!(d.exportable(), "the attribute claims support");
    let h = d.create_physical(MIB2).unwrap();
    assert!(!d.exportable(), "fell back after NOT_SUPPORTED");
    let h2 = d.create_physical(MIB2).unwrap();
    assert!(matches!(d.export_fd(h), Err(DeviceError::Unavailable(_))));
    d.release_physical(h).unwrap();
    d.release_physical(h2).unwrap();
}

fn no_fd_attr() {
    let d = CudaDevice::new(0).unwrap();
    assert!(!d.exportable());
    let h = d.create_physical(MIB2).unwrap();
    assert!(matches!(d.export_fd(h), Err(DeviceError::Unavailable(_))));
    d.release_physical(h).unwrap();
}

/// Pinned host memory and stream-ordered copies: a round trip through device pages, range
/// checks on the host side, and buffers freed (after their fences) on `free_host` and drop.
fn host_round_trip(mock: &Mock, d: &CudaDevice) {
    let h = d.create_physical(MIB2).unwrap();
    let va = d.reserve_va(MIB2, 0).unwrap();
    d.map(va, MIB2, h).unwrap();
    d.set_access(va, MIB2).unwrap();
    let len = 64 << 10;
    let a = d.alloc_host(len).unwrap();
    let b = d.alloc_host(len).unwrap();
    assert_eq!(mock.host_live(), 2);
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    // SAFETY: (test) `a` is a live pinned buffer of `len` bytes that no copy uses now.
    unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), a.0 as usize as *mut u8, len) };
    d.copy_h2d_async(va + 4096, a, len, 0x5157).unwrap();
    d.copy_d2h_async(b, va + 4096, len, 0x5157).unwrap();
    d.synchronize().unwrap();
    // SAFETY: (test) `b` is a live pinned buffer of `len` bytes; its copy has completed.
    let got = unsafe { std::slice::from_raw_parts(b.0 as usize as *const u8, len) };
    assert_eq!(got, &pattern[..]);
    // Host ranges outside the device's buffers never reach the driver.
    assert!(matches!(
        d.copy_d2h_async(HostPtr(b.0 + 1), va, len, 0),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert!(matches!(
        d.copy_h2d_async(va, HostPtr(0x1000), 16, 0),
        Err(DeviceError::InvalidArgument(_))
    ));
    // A bad device range or stream is the driver's error.
    assert!(matches!(
        d.copy_d2h_async(b, 0xdead_0000_0000, 16, 0),
        Err(DeviceError::Driver { .. })
    ));
    assert!(matches!(
        d.copy_d2h_async(b, va, 16, 0x7777),
        Err(DeviceError::Driver { .. })
    ));
    d.free_host(a).unwrap();
    assert!(matches!(
        d.free_host(a),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert_eq!(mock.host_live(), 1);
    d.unmap(va, MIB2).unwrap();
    d.free_va(va, MIB2).unwrap();
    d.release_physical(h).unwrap();
    // `b` is freed when the device goes.
}

fn no_host() {
    let d = CudaDevice::new(0).unwrap();
    assert_eq!(
        d.alloc_host(4096),
        Err(DeviceError::Unsupported("alloc_host"))
    );
    assert_eq!(
        d.copy_h2d_async(0, HostPtr(0x1000), 16, 0),
        Err(DeviceError::Unsupported("copy_h2d_async"))
    );
    // The allocator's calls work as ever.
    let h = d.create_physical(MIB2).unwrap();
    d.release_physical(h).unwrap();
}

/// `CudaDevice` over the mock driver, as a target of the contract suite: a model of the
/// driver (every case runs), whose resources the mock counts.
struct MockTarget {
    mock: Mock,
}

impl contract::Target for MockTarget {
    type Dev = CudaDevice;
    fn name(&self) -> String {
        "cuda-mock".into()
    }
    fn open(&self) -> gmlake_core::DeviceResult<CudaDevice> {
        CudaDevice::new(0)
    }
    fn is_model(&self) -> bool {
        true
    }
    fn census(&self, _dev: &CudaDevice) -> Option<contract::Census> {
        Some(contract::Census {
            handles: self.mock.count(b"mock_live_handles"),
            mappings: self.mock.count(b"mock_live_mappings"),
            reservations: self.mock.count(b"mock_live_reservations"),
            events: self.mock.count(b"mock_live_events"),
        })
    }
}

/// Every case of the contract suite (driver rules, then allocator behaviour) on `CudaDevice`
/// over the mock: all pass, none is skipped but those needing events held pending (the mock's
/// complete on their own), and the driver rule cases leave nothing on the driver (allocators
/// dropped with live blocks leak them, by design, so the check comes before those).
fn contract() {
    let t = MockTarget { mock: Mock::open() };
    let mut reports = Vec::new();
    for cases in [
        contract::device::cases::<MockTarget>(),
        contract::allocator::cases::<MockTarget>(),
    ] {
        let r = contract::run_with(&t, &cases, |line| println!("{line}"));
        println!("{}", r.summary());
        r.assert_ok();
        let held = cases
            .iter()
            .filter(|c| c.only == contract::Only::HeldEvents)
            .count();
        assert_eq!(r.skipped(), held, "{r}");
        if reports.is_empty() {
            let left = contract::Target::census(&t, &CudaDevice::new(0).unwrap()).unwrap();
            assert_eq!(
                left,
                contract::Census::default(),
                "left on the driver by the driver rule cases"
            );
        }
        reports.push(r);
    }
    assert!(reports.iter().map(|r| r.passed()).sum::<usize>() >= 45);
}
