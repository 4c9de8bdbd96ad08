//! Tests against whatever driver this machine has. Without one, `CudaDevice::new` must fail
//! cleanly; with a GPU (`CudaDevice::new(0)` succeeds) the same binary exercises the real
//! driver: the GPU tests return early when there is none (they are not `#[ignore]`d).

#![deny(clippy::undocumented_unsafe_blocks)]

use gmlake_core::EventHandle;
use gmlake_cuda::{CudaDevice, Device, DeviceError};
use std::time::{Duration, Instant};

/// Device 0, or None (with a note) on a machine without a usable GPU.
fn gpu() -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("no GPU here ({e}); skipping the GPU part");
            None
        }
    }
}

#[test]
fn new_fails_cleanly_without_a_driver() {
    match CudaDevice::new(0) {
        Ok(d) => {
            // A GPU machine: the device works.
            assert!(d.granularity().unwrap().is_power_of_two());
            assert!(d.total_memory().unwrap() > 0);
        }
        Err(DeviceError::Unavailable(m)) => {
            assert!(!m.is_empty());
            eprintln!("as expected without a driver: {m}");
        }
        Err(e @ DeviceError::Driver { .. }) => eprintln!("driver present but unusable: {e}"),
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
    // Repeated attempts keep failing (or succeeding) the same way, without panicking.
    let again = CudaDevice::new(0);
    assert!(matches!(
        again,
        Ok(_) | Err(DeviceError::Unavailable(_)) | Err(DeviceError::Driver { .. })
    ));
    assert!(CudaDevice::new(-1).is_err());
    match gmlake_cuda::device_count() {
        Ok(n) => assert!(n >= 0),
        Err(e) => assert!(matches!(
            e,
            DeviceError::Unavailable(_) | DeviceError::Driver { .. }
        )),
    }
    let _ = gmlake_cuda::driver_version();
}

#[test]
fn gpu_vmm_cycle() {
    let Some(d) = gpu() else { return };
    let g = d.granularity().unwrap();
    let total = d.total_memory().unwrap();
    let free0 = d.free_memory().unwrap();
    assert!(free0 <= total);
    eprintln!("{d:?}, free {free0}");

    // Two pages, mapped as one range [a | b], and stitched again in reverse order [b | a].
    let a = d.create_physical(g).unwrap();
    let b = d.create_physical(g).unwrap();
    let va = d.reserve_va(2 * g, 0).unwrap();
    assert_ne!(va, 0);
    assert_eq!(va % g as u64, 0);
    d.map(va, g, a).unwrap();
    d.map(va + g as u64, g, b).unwrap();
    d.set_access(va, 2 * g).unwrap();
    let st = d.reserve_va(2 * g, 0).unwrap();
    d.map(st, g, b).unwrap();
    d.map(st + g as u64, g, a).unwrap();
    d.set_access(st, 2 * g).unwrap();

    // Data written through one range is seen through the other.
    let n = g / 4;
    let pattern: Vec<u32> = (0..2 * n as u32).collect();
    let mut back = vec![0u32; 2 * n];
    // SAFETY: (test) both ranges are mapped with read-write access for this device, and are
    // 2 * g bytes long, as are the host buffers; the device's primary context is current on
    // this thread (a thread without a context keeps the device's after a call).
    unsafe {
        cudarc::driver::result::memcpy_htod_sync(va, &pattern).unwrap();
        cudarc::driver::result::memcpy_dtoh_sync(&mut back, st).unwrap();
    }
    assert_eq!(
        &back[..n],
        &pattern[n..],
        "page b first in the stitched range"
    );
    assert_eq!(&back[n..], &pattern[..n], "then page a");

    // Events on the legacy default stream.
    let e = d.create_event().unwrap();
    d.record_event(e, 0).unwrap();
    d.synchronize().unwrap();
    assert_eq!(d.query_event(e), Ok(true));
    d.record_event(e, 0).unwrap();
    let t = Instant::now();
    while !d.query_event(e).unwrap() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "event never completed"
        );
    }
    d.destroy_event(e).unwrap();
    assert!(matches!(
        d.destroy_event(e),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert!(matches!(
        d.query_event(EventHandle(8)),
        Err(DeviceError::InvalidArgument(_))
    ));

    // Rule violations are errors, not crashes. (Releasing a mapped handle is not one for the
    // real driver: cuMemRelease defers the free until the last unmap.)
    assert!(matches!(
        d.map(va, g, a),
        Err(DeviceError::Driver {
            call: "cuMemMap",
            ..
        })
    ));

    for r in [va, st] {
        d.unmap(r, g).unwrap();
        d.unmap(r + g as u64, g).unwrap();
        d.free_va(r, 2 * g).unwrap();
    }
    d.release_physical(a).unwrap();
    d.release_physical(b).unwrap();

    // More than the device has: OutOfMemory.
    let huge = (total + total / 2).div_ceil(g) * g;
    match d.create_physical(huge) {
        Err(DeviceError::OutOfMemory) => {}
        other => panic!("create_physical({huge}) on a {total}-byte device: {other:?}"),
    }
}

#[test]
fn gpu_from_threads_without_a_context() {
    let Some(d) = gpu() else { return };
    let g = d.granularity().unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let h = d.create_physical(g).unwrap();
                let va = d.reserve_va(g, 0).unwrap();
                d.map(va, g, h).unwrap();
                d.set_access(va, g).unwrap();
                let e = d.create_event().unwrap();
                d.record_event(e, 0).unwrap();
                d.synchronize().unwrap();
                assert!(d.query_event(e).unwrap());
                d.destroy_event(e).unwrap();
                d.unmap(va, g).unwrap();
                d.free_va(va, g).unwrap();
                d.release_physical(h).unwrap();
            });
        }
    });
}

#[test]
fn gpu_ipc_and_peers() {
    let Some(d) = gpu() else { return };
    let g = d.granularity().unwrap();
    d.add_peer(d.ordinal()).unwrap();
    assert!(d.peers().is_empty());
    assert!(d.add_peer(1 << 20).is_err());
    let h = d.create_physical(g).unwrap();
    if d.exportable() {
        let fd = d.export_fd(h).unwrap();
        assert!(fd >= 0);
        let h2 = d.import_fd(fd).unwrap();
        // SAFETY: (test) export_fd hands the descriptor to the caller, who closes it.
        drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        let va = d.reserve_va(g, 0).unwrap();
        d.map(va, g, h2).unwrap();
        d.set_access(va, g).unwrap();
        d.unmap(va, g).unwrap();
        d.free_va(va, g).unwrap();
        d.release_physical(h2).unwrap();
    } else {
        eprintln!("this driver refused exportable memory; IPC not tested");
        assert!(d.export_fd(h).is_err());
    }
    d.release_physical(h).unwrap();
    if let Ok(n) = gmlake_cuda::device_count() {
        for peer in 1..n {
            match d.add_peer(peer) {
                Ok(()) => {
                    let h = d.create_physical(g).unwrap();
                    let va = d.reserve_va(g, 0).unwrap();
                    d.map(va, g, h).unwrap();
                    d.set_access(va, g).unwrap();
                    d.unmap(va, g).unwrap();
                    d.free_va(va, g).unwrap();
                    d.release_physical(h).unwrap();
                }
                Err(e) => eprintln!("peer {peer}: {e}"),
            }
        }
    }
}
