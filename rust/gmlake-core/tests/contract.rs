//! The contract suite (`gmlake_core::contract`: driver rules and allocator behaviour) on the
//! simulated device, synchronous and asynchronous. The same cases run on `gmlake-cuda`'s
//! device over its mock driver and on a real GPU (`scripts/contract-gpu.sh`).

use gmlake_core::contract::{self, Census, Only, Outcome, Target};
use gmlake_core::{DeviceResult, SimDevice};

/// SimDevice of 64 GiB with 2 MiB pages; `asynchronous`: events wait for `complete_all`.
struct Sim {
    asynchronous: bool,
}

impl Target for Sim {
    type Dev = SimDevice;
    fn name(&self) -> String {
        if self.asynchronous {
            "sim-async"
        } else {
            "sim"
        }
        .into()
    }
    fn open(&self) -> DeviceResult<SimDevice> {
        let d = SimDevice::new(64 << 30);
        Ok(if self.asynchronous {
            d.asynchronous()
        } else {
            d
        })
    }
    fn is_model(&self) -> bool {
        true
    }
    fn holds_events(&self) -> bool {
        self.asynchronous
    }
    fn complete_all(&self, dev: &SimDevice) -> DeviceResult<()> {
        dev.complete_all();
        Ok(())
    }
    fn census(&self, dev: &SimDevice) -> Option<Census> {
        Some(Census {
            handles: dev.live_handles(),
            mappings: dev.live_mappings(),
            reservations: dev.live_reservations(),
            events: dev.live_events(),
        })
    }
}

fn run(t: &Sim) -> contract::Report {
    let r = contract::run(t, &contract::all_cases());
    println!("{r}");
    r
}

#[test]
fn contract_on_the_simulated_device() {
    let r = run(&Sim {
        asynchronous: false,
    });
    r.assert_ok();
    // Every case applies to a model but those needing held events.
    let held = contract::all_cases::<Sim>()
        .iter()
        .filter(|c| c.only == Only::HeldEvents)
        .count();
    assert_eq!(r.skipped(), held, "{r}");
}

#[test]
fn contract_on_the_asynchronous_simulated_device() {
    let r = run(&Sim { asynchronous: true });
    r.assert_ok();
    assert_eq!(r.skipped(), 0, "{r}");
}

/// The suite can fail: a device that breaks a rule (here: maps over a mapped range and never
/// refuses a release) is caught, with the case named.
#[test]
fn a_device_breaking_the_rules_fails_the_cases_that_check_them() {
    use gmlake_core::{Device, DevicePtr, EventHandle, PhysHandle, StreamId};
    /// SimDevice, but `map` over a mapped range unmaps what was there first, and
    /// `release_physical` of a mapped or unknown handle succeeds.
    struct Lax(SimDevice);
    impl Device for Lax {
        fn granularity(&self) -> DeviceResult<usize> {
            self.0.granularity()
        }
        fn total_memory(&self) -> DeviceResult<usize> {
            self.0.total_memory()
        }
        fn free_memory(&self) -> DeviceResult<usize> {
            self.0.free_memory()
        }
        fn create_physical(&self, size: usize) -> DeviceResult<PhysHandle> {
            self.0.create_physical(size)
        }
        fn release_physical(&self, handle: PhysHandle) -> DeviceResult<()> {
            let _ = self.0.release_physical(handle);
            Ok(())
        }
        fn reserve_va(&self, size: usize, alignment: usize) -> DeviceResult<DevicePtr> {
            self.0.reserve_va(size, alignment)
        }
        fn free_va(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
            self.0.free_va(addr, size)
        }
        fn map(&self, addr: DevicePtr, size: usize, handle: PhysHandle) -> DeviceResult<()> {
            let _ = self.0.unmap(addr, size);
            self.0.map(addr, size, handle)
        }
        fn unmap(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
            self.0.unmap(addr, size)
        }
        fn set_access(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
            self.0.set_access(addr, size)
        }
        fn create_event(&self) -> DeviceResult<EventHandle> {
            self.0.create_event()
        }
        fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
            self.0.destroy_event(event)
        }
        fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
            self.0.record_event(event, stream)
        }
        fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
            self.0.query_event(event)
        }
        fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
            self.0.stream_wait_event(stream, event)
        }
        fn synchronize(&self) -> DeviceResult<()> {
            self.0.synchronize()
        }
    }
    /// The lax device, run as a model of the driver or as a real driver would be.
    struct LaxTarget {
        model: bool,
    }
    impl Target for LaxTarget {
        type Dev = Lax;
        fn name(&self) -> String {
            if self.model { "lax" } else { "real" }.into()
        }
        fn open(&self) -> DeviceResult<Lax> {
            Ok(Lax(SimDevice::new(64 << 30)))
        }
        fn is_model(&self) -> bool {
            self.model
        }
    }
    let r = contract::run(&LaxTarget { model: true }, &contract::device::cases());
    println!("{r}");
    for name in [
        "device/map_over_a_mapped_range_is_refused",
        "device/release_of_a_mapped_handle_is_refused",
        "device/release_twice_or_of_an_unknown_handle_is_refused",
    ] {
        match r.outcome(name) {
            Some(Outcome::Failed(m)) => assert!(m.contains("must be refused"), "{name}: {m}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    assert!(r.outcome("device/map_access_unmap_cycle") == Some(&Outcome::Passed));
    // The same cases are skipped, not run, on a real driver.
    let r = contract::run(&LaxTarget { model: false }, &contract::device::cases());
    match r.outcome("device/release_twice_or_of_an_unknown_handle_is_refused") {
        Some(Outcome::Skipped(m)) => assert!(m.starts_with("models only"), "{m}"),
        other => panic!("{other:?}"),
    }
}
