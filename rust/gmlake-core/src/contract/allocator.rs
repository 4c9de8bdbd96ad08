//! The allocator's behaviour on any [`Device`](crate::Device): cache hits, stitching and its
//! settings, out of memory, limits, `empty_cache`, statistics against the snapshot, streams,
//! graph pools, history, threads.
//!
//! Each case builds its own [`Allocator`] on a fresh device of the target, capped with
//! `limit_bytes` where the original test used a small simulated device, so the same numbers
//! hold on an 80 GiB GPU. Cases whose expectations are written for 2 MiB pages skip on
//! devices with another granularity.

use super::{census, ensure, Case, CaseResult, Fail, Only, Step, Target};
use crate::{
    Allocator, BlockState, Config, Device, Error, GraphPoolId, StitchStrategy, TraceAction,
};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;

/// The allocator behaviour cases, in order.
pub fn cases<T: Target>() -> Vec<Case<T>> {
    let c = |name, only, run| Case { name, only, run };
    vec![
        c(
            "allocator/stitching_reuses_free_pages_instead_of_new_memory",
            Only::Any,
            stitching_reuses_free_pages::<T>,
        ),
        c(
            "allocator/vmm_defragment_off_never_stitches",
            Only::Any,
            vmm_defragment_off_never_stitches::<T>,
        ),
        c(
            "allocator/defrag_level_one_creates_first_and_stitches_at_the_limit",
            Only::Any,
            defrag_level_one::<T>,
        ),
        c(
            "allocator/frag_limit_keeps_small_requests_from_stitching",
            Only::Any,
            frag_limit::<T>,
        ),
        c(
            "allocator/strategies_choose_different_pieces",
            Only::Any,
            strategies_choose_different_pieces::<T>,
        ),
        c(
            "allocator/cache_hits_make_no_driver_call",
            Only::Any,
            cache_hits_make_no_driver_call::<T>,
        ),
        c(
            "allocator/zero_bytes_is_null_and_free_of_null_is_a_no_op",
            Only::Any,
            zero_bytes::<T>,
        ),
        c(
            "allocator/out_of_memory_reports_figures_and_leaves_the_allocator_usable",
            Only::Any,
            out_of_memory::<T>,
        ),
        c(
            "allocator/memory_fraction_and_limit_cap_reserved_memory",
            Only::Any,
            memory_fraction_and_limit::<T>,
        ),
        c(
            "allocator/a_memory_fraction_of_zero_allows_nothing_new",
            Only::Any,
            memory_fraction_zero::<T>,
        ),
        c(
            "allocator/roundup_power2_divisions_round_the_placed_size",
            Only::Any,
            roundup_power2_divisions::<T>,
        ),
        c(
            "allocator/cleared_stream_uses_free_at_once",
            Only::Any,
            cleared_stream_uses_free_at_once::<T>,
        ),
        c(
            "allocator/double_free_unknown_pointer_and_size_overflow_are_errors",
            Only::Any,
            double_free_and_unknown_pointers::<T>,
        ),
        c(
            "allocator/invalid_page_size_names_the_key",
            Only::Any,
            invalid_page_size_names_the_key::<T>,
        ),
        c(
            "allocator/empty_cache_gives_everything_back",
            Only::Any,
            empty_cache_gives_everything_back::<T>,
        ),
        c(
            "allocator/kept_aliases_cut_the_driver_calls_of_periodic_steps",
            Only::Any,
            kept_aliases_cut_driver_calls::<T>,
        ),
        c(
            "allocator/a_freed_stitched_range_is_reused_with_no_driver_call",
            Only::Any,
            freed_stitched_range_reused::<T>,
        ),
        c(
            "allocator/aliases_beyond_the_bound_are_unmapped",
            Only::Any,
            aliases_beyond_the_bound::<T>,
        ),
        c(
            "allocator/graph_pools_keep_their_pages",
            Only::Any,
            graph_pools_keep_their_pages::<T>,
        ),
        c(
            "allocator/allocate_at_recreates_a_freed_block_of_a_graph_pool",
            Only::Any,
            allocate_at::<T>,
        ),
        c(
            "allocator/stats_follow_allocations_and_resets",
            Only::Any,
            stats_follow_allocations_and_resets::<T>,
        ),
        c(
            "allocator/inactive_split_counts_only_runs_with_an_active_block",
            Only::Any,
            inactive_split::<T>,
        ),
        c(
            "allocator/stats_equal_what_the_snapshot_adds_up",
            Only::Any,
            stats_equal_the_snapshot::<T>,
        ),
        c(
            "allocator/allocation_lookup_and_history",
            Only::Any,
            allocation_lookup_and_history::<T>,
        ),
        c(
            "allocator/auto_gc_bounds_cached_memory_after_stitches",
            Only::Any,
            auto_gc::<T>,
        ),
        c(
            "allocator/a_job_below_the_page_upgrade_keeps_its_pages",
            Only::Any,
            page_upgrade_not_reached::<T>,
        ),
        c(
            "allocator/the_page_upgrade_drains_the_first_generation",
            Only::Any,
            page_upgrade_drains::<T>,
        ),
        c(
            "allocator/the_page_upgrade_does_not_hold_both_generations_at_once",
            Only::Any,
            page_upgrade_drain_keeps_the_peak::<T>,
        ),
        c(
            "allocator/the_page_upgrade_waits_until_remapping_paid_for_it",
            Only::Any,
            page_upgrade_waits_for_remapping::<T>,
        ),
        c(
            "allocator/the_page_upgrade_waits_for_captures_and_keeps_live_graph_pools",
            Only::Any,
            page_upgrade_and_graph_pools::<T>,
        ),
        c(
            "allocator/many_threads_share_one_allocator",
            Only::Any,
            many_threads::<T>,
        ),
        c(
            "allocator/same_stream_reuse_is_immediate_other_streams_wait",
            Only::HeldEvents,
            same_stream_reuse::<T>,
        ),
        c(
            "allocator/record_stream_delays_reuse_until_the_event_completes",
            Only::HeldEvents,
            record_stream_delays_reuse::<T>,
        ),
        c(
            "allocator/pages_of_another_stream_are_stitched_only_after_its_fence",
            Only::HeldEvents,
            cross_stream_fence::<T>,
        ),
        c(
            "allocator/cross_stream_wait_takes_pending_pages_instead_of_new_memory",
            Only::HeldEvents,
            cross_stream_wait::<T>,
        ),
        c(
            "allocator/retired_mappings_wait_for_their_event",
            Only::HeldEvents,
            retired_mappings_wait::<T>,
        ),
        c(
            "allocator/a_pending_free_does_not_make_others_wait",
            Only::HeldEvents,
            pending_free_no_wait::<T>,
        ),
    ]
}

type Alloc<T> = Allocator<<T as Target>::Dev>;

/// An allocator on a fresh device, its reserved memory capped at `limit` bytes.
fn setup<T: Target>(t: &T, limit: u64, mut cfg: Config) -> Result<Alloc<T>, Fail> {
    cfg.limit_bytes = Some(limit);
    let dev = t.open().step("opening the device")?;
    Allocator::new(dev, cfg).step("Allocator::new")
}

/// As [`setup`], and skipped unless pages are 2 MiB (the case's numbers assume them).
fn setup2<T: Target>(t: &T, limit: u64, cfg: Config) -> Result<Alloc<T>, Fail> {
    let a = setup(t, limit, cfg)?;
    if a.page_size() != PAGE {
        return Err(Fail::Skipped(format!(
            "written for 2 MiB pages; this device's are {} bytes",
            a.page_size()
        )));
    }
    Ok(a)
}

fn reserved<D: crate::Device>(a: &Allocator<D>) -> u64 {
    a.stats().reserved_bytes.aggregate().current as u64
}

/// `empty_cache`, then nothing may be reserved (`after` names what came before, for the
/// message).
fn empties<D: crate::Device>(a: &Allocator<D>, after: &str) -> CaseResult {
    a.empty_cache().step("empty_cache")?;
    ensure(reserved(a) == 0, || {
        format!("{} bytes reserved after {after}", reserved(a))
    })
}

fn calls<D: crate::Device>(a: &Allocator<D>) -> u64 {
    a.stats().driver_calls.total()
}

fn verify<D: crate::Device>(a: &Allocator<D>) -> CaseResult {
    a.verify().map_err(|e| Fail::Failed(format!("verify: {e}")))
}

/// Ten 10 MiB blocks with every other one freed: 50 MiB free in five pieces, none of 20 MiB.
fn checkerboard<D: crate::Device>(a: &Allocator<D>, stream: u64) -> Result<Vec<u64>, Fail> {
    let ptrs = (0..10)
        .map(|_| a.allocate(10 * MIB, stream).step("allocate 10 MiB"))
        .collect::<Result<Vec<u64>, _>>()?;
    for p in ptrs.iter().step_by(2) {
        a.free(*p).step("free")?;
    }
    Ok(ptrs.into_iter().skip(1).step_by(2).collect())
}

fn stitching_reuses_free_pages<T: Target>(t: &T) -> CaseResult {
    let a = setup2(t, 1 << 30, Config::default())?;
    let _live = checkerboard(&a, 0)?;
    let before = reserved(&a);
    let big = a.allocate(40 * MIB, 0).step("allocate 40 MiB")?;
    ensure(reserved(&a) == before, || {
        format!(
            "new memory made: {} bytes reserved, {before} before",
            reserved(&a)
        )
    })?;
    let s = a.stats();
    ensure(s.stitches >= 1 && s.pages_stitched >= 15, || {
        format!(
            "{} stitches, {} pages stitched",
            s.stitches, s.pages_stitched
        )
    })?;
    // Every page of the stitched range is mapped.
    let pages = a.pages_of(big).ok_or("no pages for the stitched block")?;
    ensure(pages.len() as u64 == 40 * MIB / PAGE, || {
        format!("{} pages under a 40 MiB block", pages.len())
    })?;
    for (i, (va, _)) in pages.iter().enumerate() {
        ensure(*va == big + i as u64 * PAGE, || {
            format!("page {i} at {va:#x}")
        })?;
    }
    let snap = a.snapshot();
    let blk = snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.address == big)
        .ok_or("stitched block missing from the snapshot")?;
    ensure(
        blk.stitched && blk.state == BlockState::ActiveAllocated,
        || format!("snapshot block {blk:?}"),
    )?;
    verify(&a)
}

fn vmm_defragment_off_never_stitches<T: Target>(t: &T) -> CaseResult {
    let cfg = Config {
        vmm_defragment: false,
        ..Config::default()
    };
    let a = setup(t, 1 << 30, cfg)?;
    let _live = checkerboard(&a, 0)?;
    let before = reserved(&a);
    a.allocate(40 * MIB, 0).step("allocate")?;
    ensure(a.stats().stitches == 0, || "stitched".into())?;
    ensure(reserved(&a) == before + 40 * MIB, || {
        format!("reserved {} after {before} + 40 MiB", reserved(&a))
    })
}

fn defrag_level_one<T: Target>(t: &T) -> CaseResult {
    let cfg = Config {
        defrag_level: 1,
        ..Config::default()
    };
    let a = setup2(t, 110 * MIB, cfg)?;
    let _live = checkerboard(&a, 0)?;
    // 100 MiB held, 10 left under the cap: creating fails, then it stitches.
    a.allocate(40 * MIB, 0).step("allocate 40 MiB")?;
    ensure(a.stats().stitches >= 1, || "no stitch".into())?;
    ensure(reserved(&a) <= 110 * MIB, || {
        format!("reserved {}", reserved(&a))
    })?;
    verify(&a)
}

fn frag_limit<T: Target>(t: &T) -> CaseResult {
    let cfg = Config {
        frag_limit: 64 * MIB,
        ..Config::default()
    };
    let a = setup(t, 1 << 30, cfg)?;
    let _live = checkerboard(&a, 0)?;
    a.allocate(40 * MIB, 0).step("allocate")?;
    ensure(a.stats().stitches == 0, || {
        "a request under fragLimit stitched".into()
    })
}

fn strategies_choose_different_pieces<T: Target>(t: &T) -> CaseResult {
    // Free blocks A (4 MiB, 2 pages), B (8 MiB, 4 pages), C (16 MiB, 8 pages), freed in that
    // order between live 2 MiB blocks; then a 17 MiB request needs 9 pages (its last page is
    // half used, leaving a 1 MiB free piece). Which free pieces remain shows where each
    // strategy took its pages from.
    let remaining = |strategy| -> Result<Vec<u64>, Fail> {
        // The strategies alone: with tails last (the default), B and C, which follow live
        // blocks, would give pages only after A.
        let cfg = Config {
            stitch_strategy: strategy,
            stitch_tails_last: false,
            ..Config::default()
        };
        let a = setup2(t, 1 << 30, cfg)?;
        let mut free = Vec::new();
        for s in [4 * MIB, 8 * MIB, 16 * MIB] {
            free.push(a.allocate(s, 0).step("allocate")?);
            a.allocate(PAGE, 0).step("allocate")?;
        }
        for p in free {
            a.free(p).step("free")?;
        }
        a.allocate(17 * MIB, 0).step("allocate 17 MiB")?;
        verify(&a)?;
        let mut sizes: Vec<u64> = a
            .snapshot()
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == BlockState::Inactive)
            .map(|b| b.size / MIB)
            .collect();
        sizes.sort();
        Ok(sizes)
    };
    // Best fit: no block covers 9 pages, so the largest (C, 8) and then the smallest that
    // covers the last page (A). GMLake's order: C, then the largest left (B). Least recently
    // freed first: A, B, then 3 pages of C.
    for (s, want) in [
        (StitchStrategy::BestFit, vec![1, 2, 8]),
        (StitchStrategy::LargestFirst, vec![1, 4, 6]),
        (StitchStrategy::Lru, vec![1, 10]),
    ] {
        let got = remaining(s)?;
        ensure(got == want, || {
            format!("{s:?}: free pieces of {got:?} MiB left, expected {want:?}")
        })?;
    }
    Ok(())
}

fn cache_hits_make_no_driver_call<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    for size in [512, 4096, MIB, 3 * MIB, 64 * MIB] {
        let p = a.allocate(size, 0).step("allocate")?;
        a.free(p).step("free")?;
        let before = calls(&a);
        for _ in 0..100 {
            let q = a.allocate(size, 0).step("allocate")?;
            ensure(q == p, || {
                format!("size {size}: {q:#x}, not the same block {p:#x}")
            })?;
            a.free(q).step("free")?;
        }
        ensure(calls(&a) == before, || {
            format!(
                "size {size}: {} driver calls on cache hits",
                calls(&a) - before
            )
        })?;
    }
    Ok(())
}

fn zero_bytes<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    ensure(a.allocate(0, 0).step("allocate(0)")? == 0, || {
        "allocate(0) is not null".into()
    })?;
    a.free(0).step("free(0)")?;
    ensure(a.stats().allocation.aggregate().current == 0, || {
        "an allocation counted".into()
    })
}

fn out_of_memory<T: Target>(t: &T) -> CaseResult {
    let a = setup2(t, 64 * MIB, Config::default())?;
    let total = a.device().total_memory().step("total_memory")? as u64;
    let p = a.allocate(60 * MIB, 0).step("allocate 60 MiB")?;
    match a.allocate(10 * MIB, 0) {
        Err(Error::OutOfMemory(info)) => {
            ensure(info.requested == 10 * MIB, || {
                format!("requested {}", info.requested)
            })?;
            ensure(info.reserved == 60 * MIB, || {
                format!("reserved {}", info.reserved)
            })?;
            ensure(info.device_total == total, || {
                format!("device_total {} != {total}", info.device_total)
            })?;
            ensure(info.limit == Some(64 * MIB), || {
                format!("limit {:?}", info.limit)
            })?;
            let msg = Error::OutOfMemory(info).to_string();
            ensure(msg.contains("Tried to allocate 10.00 MiB"), || msg)?;
        }
        other => return Err(format!("expected OutOfMemory, got {other:?}").into()),
    }
    let s = a.stats();
    ensure(s.num_ooms == 1 && s.num_alloc_retries >= 1, || {
        format!("{} OOMs, {} retries", s.num_ooms, s.num_alloc_retries)
    })?;
    // Still usable: the memory freed serves a request the size of the whole cap.
    a.free(p).step("free")?;
    let q = a
        .allocate(62 * MIB, 0)
        .step("allocate 62 MiB after the OOM")?;
    ensure(q != 0, || "null".into())?;
    verify(&a)?;
    a.free(q).step("free")?;
    verify(&a)
}

fn memory_fraction_and_limit<T: Target>(t: &T) -> CaseResult {
    let dev = t.open().step("opening the device")?;
    let total = dev.total_memory().step("total_memory")? as u64;
    if total < 512 * MIB {
        return Err(Fail::Skipped(format!(
            "device of {total} bytes, needs 512 MiB"
        )));
    }
    let a = Allocator::new(dev, Config::default()).step("Allocator::new")?;
    // A fraction worth 256 MiB (rounded down to pages).
    a.set_memory_fraction((256 * MIB) as f64 / total as f64 + 1e-9)
        .step("set_memory_fraction")?;
    match a.allocate(300 * MIB, 0) {
        Err(Error::OutOfMemory(_)) => {}
        other => return Err(format!("300 MiB over a 256 MiB fraction: {other:?}").into()),
    }
    ensure(reserved(&a) == 0, || {
        format!("{} bytes kept after a failed request", reserved(&a))
    })?;
    let p = a.allocate(200 * MIB, 0).step("allocate 200 MiB")?;
    a.set_limit(Some(100 * MIB));
    ensure(a.limit() == Some(100 * MIB), || {
        format!("limit {:?}", a.limit())
    })?;
    ensure(a.set_memory_fraction(1.5).is_err(), || {
        "fraction 1.5 accepted".into()
    })?;
    ensure(a.set_memory_fraction(-0.1).is_err(), || {
        "fraction -0.1 accepted".into()
    })?;
    a.free(p).step("free")?;
    verify(&a)
}

fn memory_fraction_zero<T: Target>(t: &T) -> CaseResult {
    let dev = t.open().step("opening the device")?;
    let a = Allocator::new(dev, Config::default()).step("Allocator::new")?;
    a.set_memory_fraction(0.0).step("set_memory_fraction(0)")?;
    ensure(a.memory_fraction() == Some(0.0), || {
        format!("{:?}", a.memory_fraction())
    })?;
    ensure(
        matches!(a.allocate(MIB, 0), Err(Error::OutOfMemory(_))),
        || "an allocation under a fraction of 0 succeeded".into(),
    )?;
    a.set_memory_fraction(1.0).step("set_memory_fraction(1)")?;
    ensure(a.memory_fraction().is_none(), || {
        "1 must remove the cap, as PyTorch".into()
    })?;
    let p = a.allocate(MIB, 0).step("allocate")?;
    a.free(p).step("free")?;
    verify(&a)
}

fn roundup_power2_divisions<T: Target>(t: &T) -> CaseResult {
    let mut cfg = Config::default();
    cfg.apply_conf("roundup_power2_divisions:4")
        .step("apply_conf")?;
    let a = setup2(t, 1 << 30, cfg)?;
    let n = 84 * MIB; // between 64 and 128 MiB: divisions of 16 MiB
    let p = a.allocate(n, 0).step("allocate")?;
    let s = a.stats();
    ensure(
        s.allocated_bytes.aggregate().current as u64 == 96 * MIB,
        || format!("allocated {}", s.allocated_bytes.aggregate().current),
    )?;
    ensure(s.requested_bytes.aggregate().current as u64 == n, || {
        format!("requested {}", s.requested_bytes.aggregate().current)
    })?;
    a.free(p).step("free")?;
    // The caller's own rounding (allocate_rounded) wins.
    let q = a
        .allocate_rounded(MIB + 1, 2 * MIB, 0, GraphPoolId::DEFAULT)
        .step("allocate_rounded")?;
    ensure(
        a.stats().allocated_bytes.aggregate().current as u64 == 2 * MIB,
        || "allocate_rounded's size not kept".into(),
    )?;
    a.free(q).step("free")?;
    verify(&a)
}

fn cleared_stream_uses_free_at_once<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    let p = a.allocate(4 * MIB, 1).step("allocate")?;
    a.record_stream(p, 2).step("record_stream")?;
    a.clear_stream_uses(p).step("clear_stream_uses")?;
    a.free(p).step("free")?;
    // Reusable on its stream at once: same address.
    let q = a.allocate(4 * MIB, 1).step("allocate")?;
    ensure(p == q, || format!("{q:#x}, not the freed {p:#x}"))?;
    a.free(q).step("free")?;
    ensure(a.clear_stream_uses(0x1000).is_err(), || {
        "clear_stream_uses of an unknown pointer accepted".into()
    })
}

fn double_free_and_unknown_pointers<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    let p = a.allocate(MIB, 0).step("allocate")?;
    a.free(p).step("free")?;
    let eq = |got: crate::Result<()>, want: Error, what: &str| {
        ensure(got == Err(want.clone()), || {
            format!("{what}: {got:?}, expected {want:?}")
        })
    };
    eq(a.free(p), Error::DoubleFree(p), "double free")?;
    eq(
        a.free(0x1000),
        Error::UnknownPointer(0x1000),
        "free of an unknown pointer",
    )?;
    let q = a.allocate(4 * MIB, 0).step("allocate")?;
    eq(
        a.free(q + 512),
        Error::UnknownPointer(q + 512),
        "free of an interior pointer",
    )?;
    eq(
        a.record_stream(0x1000, 1),
        Error::UnknownPointer(0x1000),
        "record_stream of an unknown pointer",
    )?;
    ensure(
        a.allocate(u64::MAX, 0) == Err(Error::SizeOverflow(u64::MAX)),
        || "allocate(u64::MAX) is not SizeOverflow".into(),
    )?;
    ensure(a.release_pool(GraphPoolId::DEFAULT).is_err(), || {
        "release_pool of the default pool accepted".into()
    })?;
    a.free(q).step("free")?;
    verify(&a)
}

fn invalid_page_size_names_the_key<T: Target>(t: &T) -> CaseResult {
    let dev = t.open().step("opening the device")?;
    let g = dev.granularity().step("granularity")? as u64;
    if g < 2 {
        return Err(Fail::Skipped(format!(
            "granularity {g}: no smaller page size"
        )));
    }
    let cfg = Config {
        page_size: g / 2,
        ..Config::default()
    };
    match Allocator::new(dev, cfg) {
        Err(Error::InvalidConfig { key, .. }) if key == "page_size" => Ok(()),
        Err(e) => Err(format!("expected InvalidConfig for page_size, got {e:?}").into()),
        Ok(_) => Err("a page size of half the granularity was accepted".into()),
    }
}

fn empty_cache_gives_everything_back<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    let before = census(t, a.device());
    let live = checkerboard(&a, 0)?;
    let big = a.allocate(40 * MIB, 0).step("allocate 40 MiB")?;
    let small = a.allocate(3000, 1).step("allocate on stream 1")?;
    for p in live.into_iter().chain([big, small]) {
        a.free(p).step("free")?;
    }
    a.empty_cache().step("empty_cache")?;
    verify(&a)?;
    let s = a.stats();
    ensure(s.reserved_bytes.aggregate().current == 0, || {
        format!(
            "{} bytes reserved after empty_cache",
            s.reserved_bytes.aggregate().current
        )
    })?;
    ensure(s.num_device_alloc == s.num_device_free, || {
        format!(
            "{} pages created, {} released",
            s.num_device_alloc, s.num_device_free
        )
    })?;
    let c = s.driver_calls;
    ensure(
        c.create_physical == c.release_physical && c.map == c.unmap,
        || format!("driver calls unbalanced after empty_cache: {c:?}"),
    )?;
    ensure(a.cache_info().cached_free_bytes == 0, || {
        "cached bytes left".into()
    })?;
    if let (Some(b), Some(now)) = (before, census(t, a.device())) {
        ensure(
            now.handles == b.handles && now.mappings == b.mappings,
            || format!("device holds {now:?} after empty_cache, {b:?} before"),
        )?;
    }
    // Usable again.
    let p = a.allocate(5 * MIB, 0).step("allocate after empty_cache")?;
    a.free(p).step("free")?;
    verify(&a)
}

/// One "training step": ten 10 MiB tensors, every other one freed, a 40 MiB one that no
/// hole fits, then everything freed. Returns the driver calls the step made.
fn periodic_step<D: crate::Device>(a: &Allocator<D>) -> Result<u64, Fail> {
    let before = calls(a);
    let small = (0..10)
        .map(|_| a.allocate(10 * MIB, 0).step("allocate"))
        .collect::<Result<Vec<u64>, _>>()?;
    for p in small.iter().step_by(2) {
        a.free(*p).step("free")?;
    }
    let big = a.allocate(40 * MIB, 0).step("allocate")?;
    let mid = a.allocate(6 * MIB, 0).step("allocate")?;
    for p in small.iter().skip(1).step_by(2) {
        a.free(*p).step("free")?;
    }
    a.free(mid).step("free")?;
    a.free(big).step("free")?;
    verify(a)?;
    Ok(calls(a) - before)
}

fn kept_aliases_cut_driver_calls<T: Target>(t: &T) -> CaseResult {
    let run = |config: Config| -> Result<(Alloc<T>, u64), Fail> {
        let a = setup2(t, 1 << 30, config)?;
        let mut first = 0;
        for i in 0..8 {
            let c = periodic_step(&a)?;
            if i == 0 {
                first = c;
            }
        }
        ensure(first > 0, || "the first step made no driver call".into())?;
        let held = reserved(&a);
        let mut later = 0;
        for _ in 0..40 {
            later += periodic_step(&a)?;
        }
        ensure(reserved(&a) == held, || {
            format!("memory grew after warm-up: {} from {held}", reserved(&a))
        })?;
        Ok((a, later))
    };
    // Without kept aliases every step stitches anew.
    let (_, without) = run(Config {
        max_aliases: 0.0,
        ..Config::default()
    })?;
    ensure(without >= 40 * 20, || {
        format!("{without} calls without kept aliases")
    })?;
    // With them most steps find a stitched range of an earlier step.
    let (a, with) = run(Config::default())?;
    ensure(with * 2 < without, || {
        format!("{with} calls with kept aliases, {without} without")
    })?;
    ensure(a.stats().stitch_reuses > 0, || {
        "no reuse of a kept range".into()
    })?;
    // Aliases hold no memory and empty_cache unmaps every one of them.
    a.empty_cache().step("empty_cache")?;
    let c = a.stats().driver_calls;
    ensure(c.map == c.unmap && reserved(&a) == 0, || {
        format!("after empty_cache: {c:?}, {} bytes reserved", reserved(&a))
    })
}

fn freed_stitched_range_reused<T: Target>(t: &T) -> CaseResult {
    let a = setup2(t, 1 << 30, Config::default())?;
    let _live = checkerboard(&a, 0)?;
    let big = a.allocate(40 * MIB, 0).step("allocate")?;
    a.free(big).step("free")?;
    // The freed range serves the holes' sizes, then the stitched size again: no driver call.
    let before = calls(&a);
    for _ in 0..10 {
        let holes = (0..4)
            .map(|_| a.allocate(10 * MIB, 0).step("allocate"))
            .collect::<Result<Vec<u64>, _>>()?;
        for h in &holes {
            a.free(*h).step("free")?;
        }
        let again = a.allocate(40 * MIB, 0).step("allocate")?;
        a.free(again).step("free")?;
        verify(&a)?;
    }
    ensure(calls(&a) == before, || {
        format!(
            "{} driver calls reusing a stitched range",
            calls(&a) - before
        )
    })
}

fn aliases_beyond_the_bound<T: Target>(t: &T) -> CaseResult {
    let config = Config {
        max_aliases: 0.0,
        ..Config::default()
    };
    let a = setup2(t, 1 << 30, config)?;
    let _live = checkerboard(&a, 0)?;
    let mappings = census(t, a.device()).map(|c| c.mappings);
    a.allocate(40 * MIB, 0).step("allocate")?;
    // Once the GPU is done with the old mappings, a slow path processes the retirements.
    t.complete_all(a.device()).step("complete_all")?;
    a.allocate(2 * MIB, 1).step("allocate")?;
    let s = a.stats();
    ensure(s.aliased_bytes == 0, || {
        format!("{} bytes aliased", s.aliased_bytes)
    })?;
    ensure(s.alias_evictions >= 15, || {
        format!("{} alias evictions", s.alias_evictions)
    })?;
    if let (Some(m0), Some(now)) = (mappings, census(t, a.device())) {
        ensure(now.mappings <= m0 + 2, || {
            format!("{} mappings, {m0} before the stitch", now.mappings)
        })?;
    }
    verify(&a)
}

fn graph_pools_keep_their_pages<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    let pool = GraphPoolId(1, 0);
    a.begin_allocate_to_pool(pool);
    let g = a.allocate_in(40 * MIB, 1, pool).step("allocate_in")?;
    a.end_allocate_to_pool(pool);
    a.free(g).step("free")?;
    // The default pool neither reuses nor stitches the pool's free pages.
    let d = a.allocate(40 * MIB, 1).step("allocate")?;
    ensure(d != g, || {
        "the default pool took the graph pool's block".into()
    })?;
    ensure(a.stats().stitches == 0, || {
        "the graph pool's pages were stitched".into()
    })?;
    a.free(d).step("free")?;
    a.empty_cache().step("empty_cache")?;
    ensure(reserved(&a) == 40 * MIB, || {
        format!(
            "{} bytes reserved: the pool's pages must stay for replays",
            reserved(&a)
        )
    })?;
    // The same pool reuses its block.
    ensure(
        a.allocate_in(40 * MIB, 1, pool).step("allocate_in")? == g,
        || "the pool did not reuse its block".into(),
    )?;
    a.free(g).step("free")?;
    a.release_pool(pool).step("release_pool")?;
    empties(&a, "release_pool")?;
    verify(&a)
}

fn allocate_at<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    let pool = GraphPoolId(3, 1);
    a.begin_allocate_to_pool(pool);
    let p = a.allocate_in(6 * MIB, 1, pool).step("allocate_in")?;
    let q = a.allocate_in(64 << 10, 1, pool).step("allocate_in")?;
    a.end_allocate_to_pool(pool);
    a.free(p).step("free")?;
    a.free(q).step("free")?;
    // Back at the checkpoint: both are live again, at their addresses.
    a.allocate_at(p, 6 * MIB, 6 * MIB, 1, pool)
        .step("allocate_at")?;
    a.allocate_at(q, 64 << 10, 1000, 1, pool)
        .step("allocate_at")?;
    ensure(a.allocation(p).map(|i| i.size) == Some(6 * MIB), || {
        "p not live".into()
    })?;
    ensure(a.allocation(q).map(|i| i.requested) == Some(1000), || {
        "q not live".into()
    })?;
    verify(&a)?;
    let invalid = |r: crate::Result<()>, what: &str| {
        ensure(matches!(r, Err(Error::InvalidState(_))), || {
            format!("{what}: {r:?}, expected InvalidState")
        })
    };
    invalid(
        a.allocate_at(p, 6 * MIB, 1, 1, pool),
        "allocate_at of a live block",
    )?;
    invalid(
        a.allocate_at(p, 6 * MIB, 1, 1, GraphPoolId::DEFAULT),
        "allocate_at in the wrong pool",
    )?;
    a.free(p).step("free")?;
    invalid(
        a.allocate_at(p, 1 << 29, 1, 1, pool),
        "allocate_at past the free block",
    )?;
    invalid(
        a.allocate_at(0x1000, 2 * MIB, 1, 1, pool),
        "allocate_at of unknown memory",
    )?;
    // A part of a free block can be re-created too.
    a.allocate_at(p + 2 * MIB, 2 * MIB, 2 * MIB, 1, pool)
        .step("allocate_at of a part of a free block")?;
    verify(&a)
}

fn stats_follow_allocations_and_resets<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    let page = a.page_size();
    let small = a.allocate(1000, 0).step("allocate")?;
    let large = a.allocate(5 * MIB + 1, 0).step("allocate")?;
    let s = a.stats();
    let checks: [(&str, i64, i64); 6] = [
        ("allocations", s.allocation.aggregate().current, 2),
        ("small pool allocations", s.allocation.0[1].current, 1),
        ("large pool allocations", s.allocation.0[2].current, 1),
        (
            "allocated bytes",
            s.allocated_bytes.aggregate().current,
            (1024 + 5 * MIB + 512) as i64,
        ),
        (
            "requested bytes",
            s.requested_bytes.aggregate().current,
            (1000 + 5 * MIB + 1) as i64,
        ),
        (
            "segments",
            s.segment.aggregate().current,
            (a.reserved_bytes() / page) as i64,
        ),
    ];
    for (what, got, want) in checks {
        ensure(got == want, || format!("{what}: {got}, expected {want}"))?;
    }
    ensure(reserved(&a) == a.reserved_bytes(), || {
        format!(
            "reserved_bytes stat {} != held {}",
            reserved(&a),
            a.reserved_bytes()
        )
    })?;
    ensure(
        s.num_device_alloc as u64 == a.reserved_bytes() / page,
        || {
            format!(
                "{} device allocations for {} bytes",
                s.num_device_alloc,
                a.reserved_bytes()
            )
        },
    )?;
    a.free(small).step("free")?;
    a.free(large).step("free")?;
    let s = a.stats();
    ensure(s.allocation.aggregate().peak == 2, || {
        "peak allocations".into()
    })?;
    ensure(s.active_bytes.aggregate().current == 0, || {
        "active bytes".into()
    })?;
    // Everything free: cached runs, none split (as PyTorch's unsplit free segments).
    ensure(s.inactive_split_bytes.aggregate().current == 0, || {
        "inactive split bytes".into()
    })?;
    ensure(s.inactive_split_bytes.aggregate().peak > 0, || {
        "inactive split peak".into()
    })?;
    a.reset_peak_stats();
    ensure(a.stats().allocation.aggregate().peak == 0, || {
        "peak not reset".into()
    })?;
    let created = a.stats().num_device_alloc;
    a.reset_accumulated_stats();
    ensure(a.stats().allocation.aggregate().allocated == 0, || {
        "accumulated not reset".into()
    })?;
    ensure(a.stats().num_device_alloc == 0, || {
        "num_device_alloc not reset".into()
    })?;
    a.empty_cache().step("empty_cache")?;
    let s = a.stats();
    ensure(s.reserved_bytes.aggregate().current == 0, || {
        "reserved after empty_cache".into()
    })?;
    ensure(s.num_device_free == created, || {
        format!("{} pages released, {created} created", s.num_device_free)
    })?;
    ensure(a.cache_info().cached_free_bytes == 0, || {
        "cached bytes".into()
    })
}

fn inactive_split<T: Target>(t: &T) -> CaseResult {
    let a = setup2(t, 1 << 30, Config::default())?;
    let split = |a: &Alloc<T>| {
        let s = a.stats();
        (
            s.inactive_split.aggregate().current,
            s.inactive_split_bytes.aggregate().current as u64,
        )
    };
    let p = a.allocate(1, 0).step("allocate")?;
    // A 2 MiB page: 512 bytes live, the rest split off (PyTorch: the same).
    ensure(split(&a) == (1, 2 * MIB - 512), || {
        format!("one live byte: {:?}", split(&a))
    })?;
    a.free(p).step("free")?;
    // Freed: the page is one free run, cached but not split (PyTorch: 0).
    ensure(split(&a) == (0, 0), || format!("all free: {:?}", split(&a)))?;
    let q = a.allocate(MIB, 0).step("allocate")?;
    ensure(split(&a).1 == MIB, || {
        format!("1 MiB live: {:?}", split(&a))
    })?;
    a.free(q).step("free")?;
    ensure(split(&a).1 == 0, || {
        format!("all free again: {:?}", split(&a))
    })?;
    verify(&a)
}

/// PyTorch's `_check_memory_stat_consistency` for expandable segments (what gmlake's runs
/// are): the statistics equal what the snapshot adds up, per pool, along a random sequence
/// with stitches, frees and empty_cache.
fn stats_equal_the_snapshot<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    let mut seed = 12345u64;
    let mut rnd = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut live: Vec<u64> = Vec::new();
    let check = |a: &Alloc<T>, step: usize| -> CaseResult {
        let snap = a.snapshot();
        let s = a.stats();
        let mut sums = [[0i64; 6]; 3];
        for seg in &snap.segments {
            for i in [0, seg.pool as usize] {
                sums[i][0] += seg.total_size as i64;
                sums[i][1] += seg.allocated_size as i64;
                sums[i][2] += seg.active_size as i64;
                sums[i][3] += seg.requested_size as i64;
                for b in &seg.blocks {
                    if b.state == BlockState::ActiveAllocated {
                        sums[i][4] += 1;
                    }
                    if b.state != BlockState::Inactive {
                        sums[i][5] += 1;
                    }
                }
            }
        }
        for (i, sum) in sums.iter().enumerate() {
            let got = [
                s.reserved_bytes.0[i].current,
                s.allocated_bytes.0[i].current,
                s.active_bytes.0[i].current,
                s.requested_bytes.0[i].current,
                s.allocation.0[i].current,
                s.active.0[i].current,
            ];
            ensure(&got == sum, || {
                format!("step {step}, pool {i}: stats {got:?} vs snapshot {sum:?}")
            })?;
        }
        Ok(())
    };
    for step in 0..400 {
        if !live.is_empty() && rnd(10) < 4 {
            let p = live.swap_remove(rnd(live.len() as u64) as usize);
            a.free(p).step("free")?;
        } else {
            let n = if step % 3 == 0 {
                1 + rnd(4096)
            } else {
                1 + rnd(24 * MIB)
            };
            match a.allocate(n, rnd(2)) {
                Ok(p) => live.push(p),
                Err(Error::OutOfMemory(_)) => {}
                Err(e) => return Err(format!("step {step}: allocate({n}): {e}").into()),
            }
        }
        check(&a, step)?;
        if step % 97 == 96 {
            a.empty_cache().step("empty_cache")?;
            check(&a, step)?;
        }
    }
    for p in live {
        a.free(p).step("free")?;
    }
    check(&a, 400)?;
    verify(&a)
}

fn allocation_lookup_and_history<T: Target>(t: &T) -> CaseResult {
    let a = setup2(t, 1 << 30, Config::default())?;
    a.set_history(100);
    let p = a.allocate(3 * MIB, 1).step("allocate")?;
    let info = a
        .allocation(p + 1234)
        .ok_or("no allocation at an interior address")?;
    ensure(
        (info.ptr, info.size, info.stream) == (p, 3 * MIB, 1),
        || format!("{info:?}"),
    )?;
    ensure(a.pages_of(p).map(|v| v.len()) == Some(2), || {
        "pages_of".into()
    })?;
    a.free(p).step("free")?;
    ensure(a.allocation(p).is_none(), || {
        "freed block still looked up".into()
    })?;
    let actions: Vec<TraceAction> = a.take_history().iter().map(|e| e.action).collect();
    let want = vec![
        TraceAction::SegmentMap,
        TraceAction::Alloc,
        TraceAction::FreeRequested,
        TraceAction::FreeCompleted,
    ];
    ensure(actions == want, || {
        format!("history {actions:?}, expected {want:?}")
    })
}

fn auto_gc<T: Target>(t: &T) -> CaseResult {
    // The same sequence with and without autoGC: a checkerboard leaves five free 10 MiB
    // blocks; a 12 MiB request stitches pages from two of them, leaving four blocks with
    // whole pages cached. With autoGC at 0 bytes the stitch retires every cached interior
    // page, of every block, for release; once the GPU is done with them, the next slow path
    // (another stream, so it stitches nothing) unmaps and releases them.
    let run = |auto_gc| -> Result<(i64, u64, u64), Fail> {
        let cfg = Config {
            auto_gc_bytes: auto_gc,
            ..Config::default()
        };
        let a = setup2(t, 1 << 30, cfg)?;
        let _live = checkerboard(&a, 0)?;
        a.allocate(12 * MIB, 0).step("allocate")?;
        t.complete_all(a.device()).step("complete_all")?;
        a.allocate(PAGE, 1).step("allocate")?;
        verify(&a)?;
        let s = a.stats();
        ensure(s.stitches >= 1, || "no stitch".into())?;
        Ok((s.num_device_free, s.cached_bytes, reserved(&a)))
    };
    let (freed_off, cached_off, held_off) = run(None)?;
    let (freed_on, cached_on, held_on) = run(Some(0))?;
    ensure(freed_off == 0, || {
        "without autoGC pages were released".into()
    })?;
    ensure(freed_on > 0, || "autoGC released nothing".into())?;
    ensure(cached_on < cached_off, || {
        format!("cached {cached_on} >= {cached_off}")
    })?;
    ensure(cached_on < PAGE * 8, || {
        format!("{cached_on} bytes cached: only partial pages may stay")
    })?;
    ensure(held_on < held_off, || {
        format!("held {held_on} >= {held_off}")
    })
}

/// `page_upgrade_at` of `at` bytes, to 8 MiB pages, at once (`page_upgrade_remap` 0).
fn upgrade_config(at: u64) -> Config {
    Config {
        page_upgrade_at: Some(at),
        page_upgrade_size: 4 * PAGE,
        page_upgrade_remap: 0.0,
        ..Config::default()
    }
}

fn page_upgrade_waits_for_remapping<T: Target>(t: &T) -> CaseResult {
    // `page_upgrade_remap` at its default (2): past the threshold, the upgrade comes at the
    // first allocation after the pages stitched add up to that multiple of the memory held.
    // A 40 MiB block
    // allocated and freed on two streams in turn moves its pages at every allocation (no kept
    // aliases: none is a reuse).
    let cfg = Config {
        page_upgrade_at: Some(16 * MIB),
        page_upgrade_size: 4 * PAGE,
        max_aliases: 0.0,
        ..Config::default()
    };
    let remap = cfg.page_upgrade_remap;
    let a = setup2(t, 1 << 30, cfg)?;
    let _live = checkerboard(&a, 0)?;
    let mut upgraded_at = None;
    for i in 0..30u64 {
        let before = a.stats();
        let paid = (before.pages_stitched + before.aliases_replaced) * PAGE;
        let held = reserved(&a);
        let p = a.allocate(40 * MIB, i % 2).step("allocate")?;
        let upgraded = a.stats().page_upgrades == 1;
        ensure(upgraded == (paid as f64 >= remap * held as f64), || {
            format!(
                "allocation {i}: upgraded {upgraded} with {paid} bytes re-mapped and {held} held"
            )
        })?;
        a.free(p).step("free")?;
        t.complete_all(a.device()).step("complete_all")?;
        if upgraded {
            upgraded_at = Some(i);
            break;
        }
    }
    ensure(upgraded_at.is_some_and(|i| i > 0), || {
        format!("upgraded at allocation {upgraded_at:?}")
    })?;
    ensure(a.page_size() == 4 * PAGE, || "no 8 MiB pages".into())?;
    verify(&a)
}

fn page_upgrade_not_reached<T: Target>(t: &T) -> CaseResult {
    let a = setup2(t, 1 << 30, upgrade_config(128 * MIB))?;
    // Up to 106 MiB held, with stitching: the first page size throughout.
    let _live = checkerboard(&a, 0)?;
    let p = a.allocate(40 * MIB, 0).step("allocate 40 MiB")?;
    a.free(p).step("free")?;
    a.allocate(6 * MIB, 0).step("allocate 6 MiB")?;
    let s = a.stats();
    ensure(s.page_upgrades == 0 && a.page_size() == PAGE, || {
        format!(
            "{} upgrades, pages of {} bytes at {} reserved",
            s.page_upgrades,
            a.page_size(),
            reserved(&a)
        )
    })?;
    verify(&a)
}

fn page_upgrade_drain_keeps_the_peak<T: Target>(t: &T) -> CaseResult {
    // A job that switches in the middle of a step: its old generation's blocks die while
    // the new generation grows. The pages drained wait for their events (pending on an
    // asynchronous device); creating pages past the peak waits for them first, so the two
    // generations are never held at once for the same bytes.
    let a = setup2(t, 1 << 30, upgrade_config(40 * MIB))?;
    let old = (0..10)
        .map(|_| a.allocate(4 * MIB, 0).step("allocate 4 MiB"))
        .collect::<Result<Vec<u64>, _>>()?;
    let big = a.allocate(24 * MIB, 0).step("allocate 24 MiB")?;
    ensure(a.stats().page_upgrades == 1, || {
        "no upgrade at the threshold".into()
    })?;
    let peak = a.stats().reserved_bytes.aggregate().peak as u64;
    ensure(peak == 64 * MIB, || {
        format!("peak reserved {peak}, 64 MiB expected")
    })?;
    for p in &old {
        a.free(*p).step("free")?;
    }
    let grown = a.allocate(40 * MIB, 0).step("allocate 40 MiB")?;
    verify(&a)?;
    let s = a.stats();
    let (now, peak) = (
        s.reserved_bytes.aggregate().current as u64,
        s.reserved_bytes.aggregate().peak as u64,
    );
    ensure(now == 64 * MIB && peak == 64 * MIB, || {
        format!(
            "{now} bytes reserved, peak {peak}: 64 MiB of 8 MiB pages expected, the drained \
             2 MiB pages released before new ones were created ({} waits)",
            s.retired_waits
        )
    })?;
    for p in [big, grown] {
        a.free(p).step("free")?;
    }
    empties(&a, "freeing everything")?;
    verify(&a)
}

fn page_upgrade_drains<T: Target>(t: &T) -> CaseResult {
    let a = setup2(t, 1 << 30, upgrade_config(40 * MIB))?;
    let before = census(t, a.device());
    // 40 MiB in 2 MiB pages: the threshold (the allocator holds it before the last one).
    let old = (0..10)
        .map(|_| a.allocate(4 * MIB, 0).step("allocate 4 MiB"))
        .collect::<Result<Vec<u64>, _>>()?;
    ensure(a.page_size() == PAGE, || {
        "upgraded before the threshold".into()
    })?;
    // The next allocation is of the new generation: 8 MiB pages.
    let big = a.allocate(24 * MIB, 0).step("allocate 24 MiB")?;
    ensure(
        a.page_size() == 4 * PAGE && a.stats().page_upgrades == 1,
        || format!("pages of {} bytes after the threshold", a.page_size()),
    )?;
    let pages = a.pages_of(big).ok_or("no pages for the new block")?;
    ensure(pages.len() == 3, || {
        format!("{} pages under 24 MiB of 8 MiB pages", pages.len())
    })?;
    for (i, (va, _)) in pages.iter().enumerate() {
        ensure(*va == big + i as u64 * 4 * PAGE, || {
            format!("page {i} at {va:#x}")
        })?;
    }
    verify(&a)?;
    // Blocks freed in the old generation go back to the device (behind an event; the next
    // miss releases what completed), not into a cache.
    for p in old.iter().step_by(2) {
        a.free(*p).step("free")?;
    }
    t.complete_all(a.device()).step("complete_all")?;
    let small = a.allocate(16 * MIB, 0).step("allocate 16 MiB")?;
    verify(&a)?;
    let held = reserved(&a);
    ensure(held == 20 * MIB + 24 * MIB + 16 * MIB, || {
        format!("{held} bytes reserved; 20 MiB live in 2 MiB pages and 40 MiB in 8 MiB ones")
    })?;
    ensure(a.stats().pages_drained == 10, || {
        format!("{} pages drained, 10 expected", a.stats().pages_drained)
    })?;
    // A freed block of the new generation stays cached, and serves the next request.
    a.free(small).step("free")?;
    let calls_before = calls(&a);
    let again = a.allocate(16 * MIB, 0).step("allocate 16 MiB again")?;
    ensure(again == small && calls(&a) == calls_before, || {
        "a freed block of the new generation was not reused as it was".into()
    })?;
    for p in old.iter().skip(1).step_by(2) {
        a.free(*p).step("free")?;
    }
    t.complete_all(a.device()).step("complete_all")?;
    let side = a.allocate(8 * MIB, 1).step("allocate on another stream")?;
    verify(&a)?;
    let held = reserved(&a);
    ensure(held == 48 * MIB, || {
        format!("{held} bytes reserved once the first generation is gone; 48 MiB expected")
    })?;
    // Everything goes back.
    for p in [big, again, side] {
        a.free(p).step("free")?;
    }
    empties(&a, "freeing everything")?;
    verify(&a)?;
    if let (Some(b), Some(now)) = (before, census(t, a.device())) {
        ensure(
            now.handles == b.handles
                && now.mappings == b.mappings
                && now.reservations == b.reservations,
            || format!("device holds {now:?} after empty_cache, {b:?} before"),
        )?;
    }
    Ok(())
}

fn page_upgrade_and_graph_pools<T: Target>(t: &T) -> CaseResult {
    let a = setup2(t, 1 << 30, upgrade_config(16 * MIB))?;
    let pool = GraphPoolId(7, 1);
    // A capture past the threshold: no upgrade while it lasts (no events may be recorded).
    a.begin_allocate_to_pool(pool);
    let g1 = a
        .allocate_in(10 * MIB, 0, pool)
        .step("allocate in the pool")?;
    let g2 = a
        .allocate_in(10 * MIB, 0, pool)
        .step("allocate in the pool")?;
    let g3 = a
        .allocate_in(4 * MIB, 0, pool)
        .step("allocate in the pool")?;
    ensure(
        a.page_size() == PAGE && a.stats().page_upgrades == 0,
        || "upgraded during a capture".into(),
    )?;
    a.end_allocate_to_pool(pool);
    // The pool's blocks are freed (the graph keeps their addresses) before the next allocation
    // upgrades: the live pool's old pages are not drained.
    a.free(g1).step("free")?;
    a.free(g2).step("free")?;
    let held = reserved(&a);
    let p = a.allocate(8 * MIB, 0).step("allocate after the capture")?;
    ensure(
        a.page_size() == 4 * PAGE && a.stats().page_upgrades == 1,
        || "no upgrade after the capture".into(),
    )?;
    t.complete_all(a.device()).step("complete_all")?;
    a.free(p).step("free")?;
    ensure(a.stats().pages_drained == 0, || {
        format!(
            "{} pages of a live graph pool drained",
            a.stats().pages_drained
        )
    })?;
    ensure(reserved(&a) == held + 8 * MIB, || {
        format!("{} bytes reserved, {held} + 8 MiB expected", reserved(&a))
    })?;
    verify(&a)?;
    // Released, the pool's free pages go back with the rest.
    a.release_pool(pool).step("release_pool")?;
    a.free(g3).step("free")?;
    empties(&a, "releasing the pool")?;
    verify(&a)
}

fn many_threads<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 8 << 30, Config::default())?;
    let before = census(t, a.device());
    let errors: Vec<String> = std::thread::scope(|s| {
        let ts: Vec<_> = (0..4u64)
            .map(|th| {
                let a = &a;
                s.spawn(move || -> Result<(), String> {
                    let mut seed = th * 7919 + 1;
                    let mut live = Vec::new();
                    for _ in 0..5000 {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        if live.len() < 50 && (seed >> 33) % 3 != 0 {
                            let size = 512 + (seed >> 20) % (24 * MIB);
                            live.push(a.allocate(size, th % 2).map_err(|e| e.to_string())?);
                        } else if let Some(p) = live.pop() {
                            a.free(p).map_err(|e| e.to_string())?;
                        }
                    }
                    for p in live {
                        a.free(p).map_err(|e| e.to_string())?;
                    }
                    Ok(())
                })
            })
            .collect();
        ts.into_iter()
            .filter_map(|h| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some("a thread panicked".into()),
            })
            .collect()
    });
    ensure(errors.is_empty(), || errors.join("; "))?;
    verify(&a)?;
    empties(&a, "the threads' frees")?;
    if let (Some(b), Some(now)) = (before, census(t, a.device())) {
        ensure(
            now.handles == b.handles && now.mappings == b.mappings,
            || format!("device holds {now:?}, {b:?} before"),
        )?;
    }
    Ok(())
}

fn same_stream_reuse<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    let p = a.allocate(8 * MIB, 1).step("allocate")?;
    a.free(p).step("free")?;
    ensure(a.allocate(8 * MIB, 1).step("allocate")? == p, || {
        "the same stream did not reuse the block at once".into()
    })?;
    let q = a.allocate(8 * MIB, 2).step("allocate")?;
    ensure(q != p, || "another stream got the same memory".into())
}

fn record_stream_delays_reuse<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 1 << 30, Config::default())?;
    let p = a.allocate(8 * MIB, 1).step("allocate")?;
    a.record_stream(p, 2).step("record_stream")?;
    a.free(p).step("free")?;
    ensure(a.stats().pending_frees == 1, || "free not pending".into())?;
    let q = a.allocate(8 * MIB, 1).step("allocate")?;
    ensure(q != p, || "reused while stream 2 may still read it".into())?;
    t.complete_all(a.device()).step("complete_all")?;
    let r = a.allocate(8 * MIB, 1).step("allocate")?;
    ensure(r == p, || "not reused once stream 2 is done".into())?;
    ensure(a.stats().pending_frees == 0, || "still pending".into())?;
    verify(&a)
}

fn cross_stream_fence<T: Target>(t: &T) -> CaseResult {
    // The fences alone, with no device-side waits (`cross_stream_wait` off; the case below
    // has them).
    let fences_only = || Config {
        cross_stream_wait: false,
        ..Config::default()
    };
    // Stream 1 frees 40 MiB; stream 2 needs 40 MiB with room for 60 MiB.
    let a = setup2(t, 60 * MIB, fences_only())?;
    let p = a.allocate(40 * MIB, 1).step("allocate")?;
    a.free(p).step("free")?;
    // While stream 1's work may be in flight its pages cannot move: the allocator must
    // synchronise (counted) before it takes them.
    a.allocate(40 * MIB, 2).step("allocate on stream 2")?;
    let s = a.stats();
    ensure(s.num_sync_all_streams >= 1, || {
        "no synchronisation before taking the pages".into()
    })?;
    ensure(s.stitches >= 1, || "no stitch".into())?;
    ensure(reserved(&a) <= 60 * MIB, || {
        format!("reserved {}", reserved(&a))
    })?;
    verify(&a)?;

    // With room to spare, a pending fence means new memory rather than a wait.
    let a = setup2(t, 1 << 30, fences_only())?;
    let p = a.allocate(40 * MIB, 1).step("allocate")?;
    a.free(p).step("free")?;
    a.allocate(40 * MIB, 2).step("allocate")?;
    ensure(a.stats().num_sync_all_streams == 0, || {
        "synchronised with memory to spare".into()
    })?;
    ensure(a.stats().stitches == 0, || {
        "stitched across a pending fence".into()
    })?;
    // Once stream 1's fence completes its pages are stitched across streams.
    t.complete_all(a.device()).step("complete_all")?;
    let before = reserved(&a);
    a.allocate(40 * MIB, 2).step("allocate")?;
    ensure(reserved(&a) == before, || {
        "new memory made after the fence completed".into()
    })?;
    ensure(a.stats().stitches >= 1, || {
        "no stitch across streams".into()
    })
}

fn cross_stream_wait<T: Target>(t: &T) -> CaseResult {
    // As the second part of `cross_stream_fence` (memory to spare, stream 1's fence pending),
    // but with `cross_stream_wait`: stream 2 waits on the device for stream 1 and takes its
    // pages, with no new memory and no host synchronisation.
    let config = Config {
        cross_stream_wait: true, // the default, said here because the case is about it
        ..Config::default()
    };
    let a = setup2(t, 1 << 30, config)?;
    let p = a.allocate(40 * MIB, 1).step("allocate")?;
    a.free(p).step("free")?;
    let before = reserved(&a);
    let q = a.allocate(40 * MIB, 2).step("allocate on stream 2")?;
    let s = a.stats();
    ensure(reserved(&a) == before, || {
        format!("new memory: {} reserved, {before} before", reserved(&a))
    })?;
    ensure(s.stitches >= 1, || "no stitch across streams".into())?;
    ensure(s.num_sync_all_streams == 0, || "the host waited".into())?;
    ensure(s.driver_calls.stream_wait >= 1, || "no stream wait".into())?;
    verify(&a)?;
    // Stream 1 frees again after the wait: its new free is not covered, so stream 2 waits
    // again rather than take it unordered.
    let r = a.allocate(40 * MIB, 1).step("allocate on stream 1")?;
    a.free(r).step("free")?;
    a.free(q).step("free q")?;
    let waits = a.stats().driver_calls.stream_wait;
    a.allocate(80 * MIB, 2)
        .step("allocate 80 MiB on stream 2")?;
    ensure(a.stats().driver_calls.stream_wait > waits, || {
        "a later free taken without a new wait".into()
    })?;
    verify(&a)
}

fn retired_mappings_wait<T: Target>(t: &T) -> CaseResult {
    // max_aliases 0: old mappings of stitched pages are not kept, only retired. No
    // cross-stream waits: the slow path below must stitch nothing.
    let config = Config {
        max_aliases: 0.0,
        cross_stream_wait: false,
        ..Config::default()
    };
    let a = setup2(t, 1 << 30, config)?;
    let _live = checkerboard(&a, 0)?;
    a.allocate(40 * MIB, 0).step("allocate")?;
    ensure(a.stats().retired_bytes > 0, || {
        "old mappings must be kept while kernels may use them".into()
    })?;
    let mappings = census(t, a.device()).map(|c| c.mappings);
    t.complete_all(a.device()).step("complete_all")?;
    // A slow path that stitches nothing (stream 1's fence is not complete) processes the
    // completed retirements.
    a.allocate(64 * MIB, 1).step("allocate")?;
    ensure(a.stats().retired_bytes == 0, || {
        "retirements not processed".into()
    })?;
    if let (Some(m0), Some(now)) = (mappings, census(t, a.device())) {
        ensure(now.mappings < m0 + 32, || {
            format!("{} mappings, {m0} before", now.mappings)
        })?;
    }
    verify(&a)
}

fn pending_free_no_wait<T: Target>(t: &T) -> CaseResult {
    let a = setup(t, 8 << 30, Config::default())?;
    let _one = a.allocate(4, 1).step("allocate")?;
    let x = a.allocate(256 * MIB, 1).step("allocate")?;
    a.record_stream(x, 2).step("record_stream")?;
    a.free(x).step("free")?;
    let z = a.allocate(256 * MIB, 1).step("allocate")?;
    ensure(z != x, || "x may still be read by stream 2".into())?;
    let s = a.stats();
    ensure(
        (s.num_alloc_retries, s.num_sync_all_streams) == (0, 0),
        || {
            format!(
                "{} retries, {} synchronisations",
                s.num_alloc_retries, s.num_sync_all_streams
            )
        },
    )
}
