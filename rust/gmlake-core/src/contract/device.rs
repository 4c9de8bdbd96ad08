//! The driver rules of [`crate::device`], checked on any [`Device`]: what must work, and what
//! must be refused. Every case opens its own device, gives back what it made, and (where the
//! target can count) checks that nothing is left behind.

use super::{census, ensure, refused, same_census, Case, CaseResult, Fail, Only, Step, Target};
use crate::device::{Device, DeviceError, EventHandle, HostPtr, PhysHandle};

/// The driver rule cases, in order.
/// Why a rule is checked on the models only: the real driver did not enforce it.
macro_rules! accepted_by_the_driver {
    () => {
        "the real driver accepted it in the GPU run of 2026-11-25 (H100, driver 580.159.04, \
         CUDA 13.0), so "
    };
}

pub fn cases<T: Target>() -> Vec<Case<T>> {
    let c = |name, only, run| Case { name, only, run };
    vec![
        c(
            "device/reports_granularity_and_memory",
            Only::Any,
            reports_granularity_and_memory::<T>,
        ),
        c(
            "device/create_and_release_pages",
            Only::Any,
            create_and_release_pages::<T>,
        ),
        c(
            "device/create_rejects_bad_sizes",
            Only::Any,
            create_rejects_bad_sizes::<T>,
        ),
        c(
            "device/create_beyond_the_device_is_out_of_memory",
            Only::Any,
            create_beyond_the_device_is_out_of_memory::<T>,
        ),
        c(
            "device/reserve_aligns_and_rejects_bad_arguments",
            Only::Any,
            reserve_aligns_and_rejects_bad_arguments::<T>,
        ),
        c(
            "device/reservations_do_not_overlap",
            Only::Any,
            reservations_do_not_overlap::<T>,
        ),
        c(
            "device/free_va_takes_whole_reservations_only",
            Only::Any,
            free_va_takes_whole_reservations_only::<T>,
        ),
        c(
            "device/map_access_unmap_cycle",
            Only::Any,
            map_access_unmap_cycle::<T>,
        ),
        c(
            "device/map_rejects_unaligned_arguments",
            Only::Any,
            map_rejects_unaligned_arguments::<T>,
        ),
        c(
            "device/map_over_a_mapped_range_is_refused",
            Only::Any,
            map_over_a_mapped_range_is_refused::<T>,
        ),
        c(
            "device/map_outside_a_reservation_is_refused",
            Only::Models(
                concat!(accepted_by_the_driver!(), "mapping past the end of a reservation is not refused there (the range after it may be reserved by another owner); never mapping outside its own reservations is the caller's rule"),
            ),
            map_outside_a_reservation_is_refused::<T>,
        ),
        c(
            "device/map_larger_than_the_handle_is_refused",
            Only::Any,
            map_larger_than_the_handle_is_refused::<T>,
        ),
        c(
            "device/map_of_a_released_handle_is_refused",
            Only::Models(
                "a released handle is a dangling id to the real driver: using it is undefined",
            ),
            map_of_a_released_handle_is_refused::<T>,
        ),
        c(
            "device/unmap_of_what_is_not_mapped_is_refused",
            Only::Models(
                concat!(accepted_by_the_driver!(), "unmapping a reserved page that holds no mapping is not refused there; unmapping only what it mapped is the caller's rule"),
            ),
            unmap_of_what_is_not_mapped_is_refused::<T>,
        ),
        c(
            "device/unmap_of_part_of_a_mapping_is_refused",
            Only::Any,
            unmap_of_part_of_a_mapping_is_refused::<T>,
        ),
        c(
            "device/release_of_a_mapped_handle_is_refused",
            Only::Models(
                "the real driver accepts it and defers the release to the last unmap; releasing \
                 only unmapped handles is the caller's rule",
            ),
            release_of_a_mapped_handle_is_refused::<T>,
        ),
        c(
            "device/release_twice_or_of_an_unknown_handle_is_refused",
            Only::Models(
                "releasing a handle the real driver no longer knows (or 0) is undefined behaviour",
            ),
            release_twice_or_of_an_unknown_handle_is_refused::<T>,
        ),
        c(
            "device/free_va_with_mappings_inside_is_refused",
            Only::Models(
                "the real driver's behaviour for a reservation freed with live mappings is not \
                 documented; the allocator never does it",
            ),
            free_va_with_mappings_inside_is_refused::<T>,
        ),
        c(
            "device/set_access_needs_a_fully_mapped_range",
            Only::Models(
                concat!(accepted_by_the_driver!(), "set_access over a range with a hole is not refused there; granting access only to fully mapped ranges is the caller's rule"),
            ),
            set_access_needs_a_fully_mapped_range::<T>,
        ),
        c(
            "device/one_handle_mapped_at_two_addresses",
            Only::Any,
            one_handle_mapped_at_two_addresses::<T>,
        ),
        c(
            "device/pages_stitched_in_any_order",
            Only::Any,
            pages_stitched_in_any_order::<T>,
        ),
        c(
            "device/event_completes_after_synchronize",
            Only::Any,
            event_completes_after_synchronize::<T>,
        ),
        c(
            "device/destroyed_or_unknown_events_are_refused",
            Only::Any,
            destroyed_or_unknown_events_are_refused::<T>,
        ),
        c(
            "device/held_event_pending_until_work_completes",
            Only::HeldEvents,
            held_event_pending_until_work_completes::<T>,
        ),
        c(
            "device/stream_waits_for_an_event_of_another_stream",
            Only::Any,
            stream_waits_for_an_event::<T>,
        ),
        c(
            "device/host_memory_rules",
            Only::Any,
            host_memory_rules::<T>,
        ),
    ]
}

fn open<T: Target>(t: &T) -> Result<(T::Dev, u64), Fail> {
    let dev = t.open().step("opening the device")?;
    let g = dev.granularity().step("granularity")? as u64;
    Ok((dev, g))
}

fn reports_granularity_and_memory<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    ensure(g > 0 && g.is_power_of_two(), || {
        format!("granularity {g} is not a power of two")
    })?;
    let total = dev.total_memory().step("total_memory")?;
    let free = dev.free_memory().step("free_memory")?;
    ensure(total > 0 && total as u64 >= g, || {
        format!("total memory {total} is less than one page ({g})")
    })?;
    ensure(free <= total, || {
        format!("free memory {free} exceeds the total {total}")
    })
}

fn create_and_release_pages<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let before = census(t, &dev);
    let a = dev.create_physical(g as usize).step("create one page")?;
    let b = dev
        .create_physical(2 * g as usize)
        .step("create two pages")?;
    ensure(a != b, || format!("two live handles are equal: {a:?}"))?;
    if let (Some(b0), Some(now)) = (before, census(t, &dev)) {
        ensure(now.handles == b0.handles + 2, || {
            format!(
                "{} handles after creating 2 (from {})",
                now.handles, b0.handles
            )
        })?;
    }
    dev.release_physical(a).step("release")?;
    dev.release_physical(b).step("release")?;
    same_census(t, &dev, before, "after releasing both")
}

fn create_rejects_bad_sizes<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let before = census(t, &dev);
    refused(dev.create_physical(0), "create_physical(0)")?;
    if g > 1 {
        refused(
            dev.create_physical((g + g / 2) as usize),
            "create_physical of 1.5 pages",
        )?;
    }
    same_census(t, &dev, before, "after refused creates")
}

fn create_beyond_the_device_is_out_of_memory<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let total = dev.total_memory().step("total_memory")? as u64;
    let size = total.div_ceil(g) * g + g;
    match dev.create_physical(size as usize) {
        Err(DeviceError::OutOfMemory) => Ok(()),
        Ok(h) => {
            let _ = dev.release_physical(h);
            Err(format!("create_physical({size}) beyond the device's {total} bytes succeeded").into())
        }
        Err(e) => Err(format!(
            "create_physical({size}) beyond the device's {total} bytes: expected OutOfMemory, got {e:?}"
        )
        .into()),
    }
}

fn reserve_aligns_and_rejects_bad_arguments<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let before = census(t, &dev);
    let a = dev
        .reserve_va(2 * g as usize, 0)
        .step("reserve_va(2 pages, 0)")?;
    ensure(a != 0 && a % g == 0, || {
        format!("reservation at {a:#x} is not page aligned")
    })?;
    let b = dev
        .reserve_va(g as usize, 8 * g as usize)
        .step("reserve_va(1 page, aligned to 8 pages)")?;
    ensure(b % (8 * g) == 0, || {
        format!("reservation at {b:#x} asked aligned to {:#x}", 8 * g)
    })?;
    refused(dev.reserve_va(0, 0), "reserve_va(0)")?;
    if g > 1 {
        refused(
            dev.reserve_va((g + 1) as usize, 0),
            "reserve_va of an unaligned size",
        )?;
    }
    refused(
        dev.reserve_va(g as usize, 3 * g as usize),
        "reserve_va aligned to 3 pages",
    )?;
    dev.free_va(a, 2 * g as usize).step("free_va")?;
    dev.free_va(b, g as usize).step("free_va")?;
    same_census(t, &dev, before, "after freeing the reservations")
}

fn reservations_do_not_overlap<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let sizes = [g, 3 * g, 2 * g, 5 * g];
    let mut got = Vec::new();
    for s in sizes {
        got.push((dev.reserve_va(s as usize, 0).step("reserve_va")?, s));
    }
    let mut sorted = got.clone();
    sorted.sort();
    for w in sorted.windows(2) {
        ensure(w[0].0 + w[0].1 <= w[1].0, || {
            format!(
                "reservations {:#x}+{:#x} and {:#x} overlap",
                w[0].0, w[0].1, w[1].0
            )
        })?;
    }
    for (a, s) in got {
        dev.free_va(a, s as usize).step("free_va")?;
    }
    Ok(())
}

fn free_va_takes_whole_reservations_only<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let before = census(t, &dev);
    let a = dev.reserve_va(4 * g as usize, 0).step("reserve_va")?;
    refused(
        dev.free_va(a, 2 * g as usize),
        "free_va of the first half of a reservation",
    )?;
    refused(
        dev.free_va(a + g, 3 * g as usize),
        "free_va of a reservation's tail",
    )?;
    dev.free_va(a, 4 * g as usize)
        .step("free_va of the whole reservation")?;
    refused(
        dev.free_va(a, 4 * g as usize),
        "free_va of a reservation freed already",
    )?;
    same_census(t, &dev, before, "after free_va")
}

fn map_access_unmap_cycle<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let h1 = dev.create_physical(gs).step("create_physical")?;
    let h2 = dev.create_physical(2 * gs).step("create_physical")?;
    let va = dev.reserve_va(4 * gs, 0).step("reserve_va")?;
    dev.map(va, gs, h1).step("map one page")?;
    dev.map(va + g, 2 * gs, h2)
        .step("map a two-page handle after it")?;
    dev.set_access(va, 3 * gs)
        .step("one set_access over both mappings")?;
    if let (Some(b), Some(now)) = (before, census(t, &dev)) {
        ensure(now.mappings == b.mappings + 2, || {
            format!(
                "{} mappings after mapping 2 (from {})",
                now.mappings, b.mappings
            )
        })?;
    }
    dev.unmap(va + g, 2 * gs).step("unmap")?;
    dev.unmap(va, gs).step("unmap")?;
    dev.free_va(va, 4 * gs).step("free_va")?;
    dev.release_physical(h1).step("release")?;
    dev.release_physical(h2).step("release")?;
    same_census(t, &dev, before, "after the cycle")
}

/// Reserves `pages` pages and creates `n` one-page handles.
fn setup<D: Device>(dev: &D, g: u64, pages: u64, n: usize) -> Result<(u64, Vec<PhysHandle>), Fail> {
    let va = dev.reserve_va((pages * g) as usize, 0).step("reserve_va")?;
    let hs = (0..n)
        .map(|_| dev.create_physical(g as usize).step("create_physical"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((va, hs))
}

fn teardown<D: Device>(dev: &D, g: u64, va: u64, pages: u64, hs: &[PhysHandle]) -> CaseResult {
    dev.free_va(va, (pages * g) as usize).step("free_va")?;
    for h in hs {
        dev.release_physical(*h).step("release_physical")?;
    }
    Ok(())
}

fn map_rejects_unaligned_arguments<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    if g < 1024 {
        return Err(Fail::Skipped(format!(
            "granularity {g} too small to misalign"
        )));
    }
    let before = census(t, &dev);
    let (va, hs) = setup(&dev, g, 2, 1)?;
    refused(dev.map(va + g / 2, g as usize, hs[0]), "map at half a page")?;
    refused(dev.map(va, (g / 2) as usize, hs[0]), "map of half a page")?;
    teardown(&dev, g, va, 2, &hs)?;
    same_census(t, &dev, before, "after refused maps")
}

fn map_over_a_mapped_range_is_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let (va, mut hs) = setup(&dev, g, 4, 2)?;
    hs.push(dev.create_physical(2 * gs).step("create two pages")?);
    dev.map(va + g, gs, hs[0]).step("map")?;
    refused(
        dev.map(va + g, gs, hs[1]),
        "map of another handle over a mapped page",
    )?;
    refused(
        dev.map(va + g, gs, hs[0]),
        "map of the same handle again at its address",
    )?;
    refused(
        dev.map(va, 2 * gs, hs[2]),
        "map of two pages whose second is mapped",
    )?;
    // The range next to it is free: mapping there works.
    dev.map(va + 2 * g, 2 * gs, hs[2])
        .step("map next to the mapping")?;
    dev.unmap(va + 2 * g, 2 * gs).step("unmap")?;
    dev.unmap(va + g, gs).step("unmap")?;
    teardown(&dev, g, va, 4, &hs)?;
    same_census(t, &dev, before, "after refused maps")
}

fn map_outside_a_reservation_is_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let (va, hs) = setup(&dev, g, 2, 1)?;
    let two = dev.create_physical(2 * gs).step("create two pages")?;
    refused(
        dev.map(va + g, 2 * gs, two),
        "map running past the end of its reservation",
    )?;
    let gone = dev.reserve_va(2 * gs, 0).step("reserve_va")?;
    dev.free_va(gone, 2 * gs).step("free_va")?;
    refused(dev.map(gone, gs, hs[0]), "map into a freed reservation")?;
    dev.release_physical(two).step("release")?;
    teardown(&dev, g, va, 2, &hs)?;
    same_census(t, &dev, before, "after refused maps")
}

fn map_larger_than_the_handle_is_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let before = census(t, &dev);
    let (va, hs) = setup(&dev, g, 4, 1)?;
    refused(
        dev.map(va, 2 * g as usize, hs[0]),
        "map of 2 pages of a 1-page handle",
    )?;
    teardown(&dev, g, va, 4, &hs)?;
    same_census(t, &dev, before, "after a refused map")
}

fn map_of_a_released_handle_is_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let before = census(t, &dev);
    let (va, hs) = setup(&dev, g, 1, 1)?;
    dev.release_physical(hs[0]).step("release")?;
    refused(dev.map(va, g as usize, hs[0]), "map of a released handle")?;
    dev.free_va(va, g as usize).step("free_va")?;
    same_census(t, &dev, before, "after a refused map")
}

fn unmap_of_what_is_not_mapped_is_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let (va, hs) = setup(&dev, g, 2, 1)?;
    refused(dev.unmap(va, gs), "unmap of a reserved, never mapped page")?;
    dev.map(va, gs, hs[0]).step("map")?;
    refused(
        dev.unmap(va + g, gs),
        "unmap of the unmapped page next to a mapping",
    )?;
    dev.unmap(va, gs).step("unmap")?;
    refused(dev.unmap(va, gs), "unmap of a page unmapped already")?;
    teardown(&dev, g, va, 2, &hs)?;
    same_census(t, &dev, before, "after refused unmaps")
}

fn unmap_of_part_of_a_mapping_is_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let va = dev.reserve_va(2 * gs, 0).step("reserve_va")?;
    let h = dev.create_physical(2 * gs).step("create two pages")?;
    dev.map(va, 2 * gs, h).step("map")?;
    refused(dev.unmap(va, gs), "unmap of the first half of a mapping")?;
    refused(
        dev.unmap(va + g, gs),
        "unmap of the second half of a mapping",
    )?;
    dev.unmap(va, 2 * gs).step("unmap of the whole mapping")?;
    dev.free_va(va, 2 * gs).step("free_va")?;
    dev.release_physical(h).step("release")?;
    same_census(t, &dev, before, "after refused unmaps")
}

fn release_of_a_mapped_handle_is_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let (va, hs) = setup(&dev, g, 2, 1)?;
    dev.map(va, gs, hs[0]).step("map")?;
    dev.map(va + g, gs, hs[0]).step("map again (an alias)")?;
    refused(
        dev.release_physical(hs[0]),
        "release of a handle mapped twice",
    )?;
    dev.unmap(va, gs).step("unmap")?;
    refused(
        dev.release_physical(hs[0]),
        "release of a handle still mapped once",
    )?;
    dev.unmap(va + g, gs).step("unmap")?;
    teardown(&dev, g, va, 2, &hs)?;
    same_census(t, &dev, before, "after the releases")
}

fn release_twice_or_of_an_unknown_handle_is_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let before = census(t, &dev);
    let h = dev.create_physical(g as usize).step("create")?;
    dev.release_physical(h).step("release")?;
    refused(dev.release_physical(h), "second release of a handle")?;
    refused(dev.release_physical(PhysHandle(0)), "release of handle 0")?;
    same_census(t, &dev, before, "after refused releases")
}

fn free_va_with_mappings_inside_is_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let (va, hs) = setup(&dev, g, 3, 1)?;
    dev.map(va + g, gs, hs[0]).step("map")?;
    refused(
        dev.free_va(va, 3 * gs),
        "free_va of a reservation with a page mapped inside",
    )?;
    dev.unmap(va + g, gs).step("unmap")?;
    teardown(&dev, g, va, 3, &hs)?;
    same_census(t, &dev, before, "after the refused free")
}

fn set_access_needs_a_fully_mapped_range<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let (va, hs) = setup(&dev, g, 3, 2)?;
    dev.map(va, gs, hs[0]).step("map")?;
    dev.map(va + 2 * g, gs, hs[1]).step("map")?;
    refused(dev.set_access(va, 3 * gs), "set_access over a hole")?;
    refused(dev.set_access(va + g, gs), "set_access of an unmapped page")?;
    refused(dev.set_access(va, 0), "set_access of 0 bytes")?;
    dev.set_access(va, gs)
        .step("set_access of the first mapping")?;
    dev.set_access(va + 2 * g, gs)
        .step("set_access of the last mapping")?;
    dev.unmap(va, gs).step("unmap")?;
    dev.unmap(va + 2 * g, gs).step("unmap")?;
    teardown(&dev, g, va, 3, &hs)?;
    same_census(t, &dev, before, "after the cycle")
}

fn one_handle_mapped_at_two_addresses<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let h = dev.create_physical(gs).step("create")?;
    let a = dev.reserve_va(gs, 0).step("reserve_va")?;
    let b = dev.reserve_va(gs, 0).step("reserve_va")?;
    dev.map(a, gs, h).step("map at the first address")?;
    dev.set_access(a, gs).step("set_access")?;
    dev.map(b, gs, h)
        .step("map the same handle at a second address")?;
    dev.set_access(b, gs).step("set_access")?;
    dev.unmap(a, gs).step("unmap the first")?;
    dev.unmap(b, gs).step("unmap the second")?;
    dev.free_va(a, gs).step("free_va")?;
    dev.free_va(b, gs).step("free_va")?;
    dev.release_physical(h).step("release")?;
    same_census(t, &dev, before, "after the cycle")
}

/// A stitch as the allocator makes it: pages mapped into a second range in another order, one
/// `set_access` over the whole new range, the old mappings kept meanwhile.
fn pages_stitched_in_any_order<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let before = census(t, &dev);
    let n = 8u64;
    let (va, hs) = setup(&dev, g, n, n as usize)?;
    for (i, h) in hs.iter().enumerate() {
        dev.map(va + i as u64 * g, gs, *h).step("map")?;
    }
    dev.set_access(va, n as usize * gs)
        .step("set_access of the first range")?;
    let st = dev.reserve_va(n as usize * gs, 0).step("reserve_va")?;
    for (i, h) in hs.iter().rev().enumerate() {
        dev.map(st + i as u64 * g, gs, *h)
            .step("map in reverse order")?;
    }
    dev.set_access(st, n as usize * gs)
        .step("set_access of the stitched range")?;
    for i in 0..n {
        dev.unmap(va + i * g, gs).step("unmap")?;
        dev.unmap(st + i * g, gs).step("unmap")?;
    }
    dev.free_va(st, n as usize * gs).step("free_va")?;
    teardown(&dev, g, va, n, &hs)?;
    same_census(t, &dev, before, "after the stitch")
}

fn event_completes_after_synchronize<T: Target>(t: &T) -> CaseResult {
    let (dev, _) = open(t)?;
    let before = census(t, &dev);
    let e = dev.create_event().step("create_event")?;
    ensure(dev.query_event(e).step("query of a new event")?, || {
        "an event never recorded must query as complete".into()
    })?;
    for round in 0..3 {
        dev.record_event(e, 0).step("record_event on stream 0")?;
        // Before synchronize the event may or may not be complete: only the call must work.
        dev.query_event(e).step("query_event")?;
        t.complete_all(&dev).step("completing the device's work")?;
        dev.synchronize().step("synchronize")?;
        ensure(dev.query_event(e).step("query_event")?, || {
            format!("round {round}: recorded event still pending after synchronize")
        })?;
    }
    dev.destroy_event(e).step("destroy_event")?;
    same_census(t, &dev, before, "after destroying the event")
}

fn destroyed_or_unknown_events_are_refused<T: Target>(t: &T) -> CaseResult {
    let (dev, _) = open(t)?;
    let before = census(t, &dev);
    let e = dev.create_event().step("create_event")?;
    let f = dev.create_event().step("create_event")?;
    ensure(e != f, || format!("two live events are equal: {e:?}"))?;
    dev.destroy_event(e).step("destroy_event")?;
    refused(dev.destroy_event(e), "second destroy of an event")?;
    refused(dev.query_event(e), "query of a destroyed event")?;
    refused(dev.record_event(e, 0), "record of a destroyed event")?;
    refused(dev.query_event(EventHandle(0)), "query of event 0")?;
    refused(dev.destroy_event(EventHandle(0)), "destroy of event 0")?;
    // The other event is untouched.
    dev.record_event(f, 0).step("record of the live event")?;
    dev.synchronize().step("synchronize")?;
    ensure(dev.query_event(f).step("query")?, || {
        "live event pending after synchronize".into()
    })?;
    dev.destroy_event(f).step("destroy_event")?;
    same_census(t, &dev, before, "after destroying the events")
}

fn held_event_pending_until_work_completes<T: Target>(t: &T) -> CaseResult {
    let (dev, _) = open(t)?;
    let e = dev.create_event().step("create_event")?;
    dev.record_event(e, 1).step("record_event")?;
    ensure(!dev.query_event(e).step("query")?, || {
        "event complete before its work was".into()
    })?;
    t.complete_all(&dev).step("complete_all")?;
    ensure(dev.query_event(e).step("query")?, || {
        "event still pending after its work completed".into()
    })?;
    dev.record_event(e, 1).step("record_event again")?;
    ensure(!dev.query_event(e).step("query")?, || {
        "a re-recorded event must wait for the new work".into()
    })?;
    dev.synchronize().step("synchronize")?;
    ensure(dev.query_event(e).step("query")?, || {
        "synchronize did not complete the event".into()
    })?;
    dev.destroy_event(e).step("destroy_event")
}

fn stream_waits_for_an_event<T: Target>(t: &T) -> CaseResult {
    let (dev, _) = open(t)?;
    let before = census(t, &dev);
    let e = dev.create_event().step("create_event")?;
    // A wait for an event never recorded, or completed, is a no-op; one recorded on stream 1,
    // pending or not, is accepted on streams 0 and 2 and on stream 1 itself.
    match dev.stream_wait_event(0, e) {
        Err(DeviceError::Unsupported(_)) => {
            dev.destroy_event(e).step("destroy_event")?;
            return Err(Fail::Skipped("the device has no stream waits".into()));
        }
        r => r.step("stream_wait_event for an event never recorded")?,
    }
    dev.record_event(e, 1).step("record_event on stream 1")?;
    for s in [0, 2, 1] {
        dev.stream_wait_event(s, e)
            .step("stream_wait_event for a recorded event")?;
    }
    // The event may be recorded again at once.
    dev.record_event(e, 1).step("record_event again")?;
    t.complete_all(&dev).step("completing the device's work")?;
    dev.synchronize().step("synchronize")?;
    ensure(dev.query_event(e).step("query_event")?, || {
        "event pending after synchronize".into()
    })?;
    dev.destroy_event(e).step("destroy_event")?;
    refused(
        dev.stream_wait_event(0, e),
        "stream wait for a destroyed event",
    )?;
    refused(
        dev.stream_wait_event(0, EventHandle(0)),
        "stream wait for event 0",
    )?;
    same_census(t, &dev, before, "after destroying the event")
}

fn host_memory_rules<T: Target>(t: &T) -> CaseResult {
    let (dev, g) = open(t)?;
    let gs = g as usize;
    let len = 64usize << 10;
    let buf = match dev.alloc_host(len) {
        Err(DeviceError::Unsupported(_)) => {
            return Err(Fail::Skipped("the device has no host memory calls".into()))
        }
        r => r.step("alloc_host")?,
    };
    let (va, hs) = setup(&dev, g, 1, 1)?;
    dev.map(va, gs, hs[0]).step("map")?;
    dev.set_access(va, gs).step("set_access")?;
    dev.copy_h2d_async(va + 4096, buf, len, 0)
        .step("copy_h2d_async")?;
    dev.copy_d2h_async(buf, va + 4096, len, 0)
        .step("copy_d2h_async")?;
    dev.copy_d2h_async(HostPtr(buf.0 + 512), va, len - 512, 0)
        .step("copy_d2h_async into the middle of the buffer")?;
    refused(
        dev.copy_d2h_async(HostPtr(buf.0 + 512), va, len, 0),
        "copy_d2h_async running past the host buffer",
    )?;
    refused(
        dev.copy_h2d_async(va, HostPtr(buf.0 + len as u64), 512, 0),
        "copy_h2d_async from past the host buffer",
    )?;
    dev.synchronize().step("synchronize")?;
    dev.free_host(buf).step("free_host")?;
    refused(dev.free_host(buf), "second free_host of a buffer")?;
    dev.unmap(va, gs).step("unmap")?;
    teardown(&dev, g, va, 1, &hs)
}
