//! What driver calls cost in host time, to turn call counts (`gmlake replay`'s, the
//! examples') into an estimate of the time a policy spends in the driver, without a GPU.
//!
//! Figures measured on an H100 (driver 580, CUDA 13.0) with 2 MiB handles by
//! `bench/vmm_runs_probe.cu`, which maps runs of 1-32 pages as the allocator does (create the
//! pages, map them, one `cuMemSetAccess` over the run; unmap and release page by page), on an
//! idle GPU and with the GPU busy (right after a kernel launch, and while a stream of kernels
//! runs without pause; behind a queue of short kernels they cost what they cost idle in
//! three runs of the probe out of four, and what they cost busy in the other).
//! A run of k pages costs a fixed part plus k times a per-page part: mapping and granting
//! access, 16 + 20.2k µs idle and about 75 + 25k µs busy (34-37 µs a page in runs of 8 while
//! kernels run), so the fixed part is charged per `set_access` call (one per run) and the
//! per-page part per `map`. Creating and releasing are charged per call at their cost in runs
//! of 8 pages; unmapping at its cost while kernels run (33 µs a page; 15-19 right after a
//! launch or idle). Mapping a page that is already mapped elsewhere (a stitched page) costs
//! the same as its first mapping. The calls cost host time only: kernels running meanwhile
//! took no longer (4,500 pages mapped, granted and unmapped during 302 ms of a memory-bound
//! kernel stream added 0.3%).
//!
//! The single-handle figures of notes/vmm-costs.md (116 µs create, 151 µs map and access,
//! 145 µs unmap on a busy GPU) are a run of one: this model charged them per call until
//! 2026-11-26, which overstated the busy driver time of runs 4-7 times.
//! Event record/query and VA reserve/free were not measured: a few microseconds is what they
//! take on current drivers (reservations are rare either way).

use crate::DriverCalls;

/// Microseconds per call: (idle GPU, busy GPU).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CallCost {
    pub idle_us: f64,
    pub busy_us: f64,
}

const fn c(idle_us: f64, busy_us: f64) -> CallCost {
    CallCost { idle_us, busy_us }
}

pub const CREATE: CallCost = c(7.5, 18.0);
pub const RELEASE: CallCost = c(9.1, 11.0);
/// cuMemMap plus the per-handle share of the cuMemSetAccess over its run.
pub const MAP: CallCost = c(20.2, 25.0);
/// The fixed part of mapping a run and granting access to it (one `set_access` call a run).
pub const SET_ACCESS: CallCost = c(16.0, 75.0);
pub const UNMAP: CallCost = c(14.7, 33.0);
pub const EVENT: CallCost = c(2.0, 5.0);
pub const VA: CallCost = c(5.0, 10.0);
pub const SYNCHRONIZE: CallCost = c(10.0, 10.0);

/// Estimated host time of `calls` in milliseconds: (idle GPU, busy GPU).
pub fn estimate_ms(calls: &DriverCalls) -> (f64, f64) {
    let parts = [
        (calls.create_physical, CREATE),
        (calls.release_physical, RELEASE),
        (calls.map, MAP),
        (calls.set_access, SET_ACCESS),
        (calls.unmap, UNMAP),
        (
            calls.create_event + calls.record_event + calls.query_event + calls.stream_wait,
            EVENT,
        ),
        (calls.reserve_va + calls.free_va, VA),
        (calls.synchronize, SYNCHRONIZE),
    ];
    let sum =
        |f: fn(&CallCost) -> f64| parts.iter().map(|(n, c)| *n as f64 * f(c)).sum::<f64>() / 1000.0;
    (sum(|c| c.idle_us), sum(|c| c.busy_us))
}

/// `a - b` (at least 0), call kind by call kind: the calls made between two counts.
pub fn difference(a: &DriverCalls, b: &DriverCalls) -> DriverCalls {
    let f = u64::saturating_sub;
    DriverCalls {
        create_physical: f(a.create_physical, b.create_physical),
        release_physical: f(a.release_physical, b.release_physical),
        reserve_va: f(a.reserve_va, b.reserve_va),
        free_va: f(a.free_va, b.free_va),
        map: f(a.map, b.map),
        unmap: f(a.unmap, b.unmap),
        set_access: f(a.set_access, b.set_access),
        create_event: f(a.create_event, b.create_event),
        record_event: f(a.record_event, b.record_event),
        query_event: f(a.query_event, b.query_event),
        stream_wait: f(a.stream_wait, b.stream_wait),
        synchronize: f(a.synchronize, b.synchronize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn difference_goes_kind_by_kind() {
        let a = DriverCalls {
            map: 5,
            unmap: 2,
            synchronize: 1,
            ..DriverCalls::default()
        };
        let b = DriverCalls {
            map: 3,
            set_access: 4,
            ..DriverCalls::default()
        };
        let s = DriverCalls {
            map: 8,
            unmap: 2,
            set_access: 4,
            synchronize: 1,
            ..DriverCalls::default()
        };
        assert_eq!(s.total(), a.total() + b.total());
        assert_eq!(difference(&s, &b), a);
        assert_eq!(difference(&a, &s), DriverCalls::default(), "saturates at 0");
        // Kind by kind: one kind's surplus does not make up for another's shortfall.
        let later = DriverCalls {
            map: 7,
            unmap: 3,
            ..DriverCalls::default()
        };
        let earlier = DriverCalls {
            map: 2,
            unmap: 5,
            ..DriverCalls::default()
        };
        let d = difference(&later, &earlier);
        assert_eq!((d.map, d.unmap, d.total()), (5, 0, 5));
    }

    #[test]
    fn estimate_is_the_sum_of_the_per_call_costs() {
        let calls = DriverCalls {
            create_physical: 2,
            map: 10,
            set_access: 3,
            unmap: 4,
            record_event: 1,
            query_event: 1,
            ..DriverCalls::default()
        };
        let (idle, busy) = estimate_ms(&calls);
        let want_idle = (2.0 * 7.5 + 10.0 * 20.2 + 3.0 * 16.0 + 4.0 * 14.7 + 2.0 * 2.0) / 1000.0;
        let want_busy = (2.0 * 18.0 + 10.0 * 25.0 + 3.0 * 75.0 + 4.0 * 33.0 + 2.0 * 5.0) / 1000.0;
        assert!((idle - want_idle).abs() < 1e-9, "{idle} {want_idle}");
        assert!((busy - want_busy).abs() < 1e-9, "{busy} {want_busy}");
        assert_eq!(estimate_ms(&DriverCalls::default()), (0.0, 0.0));
    }
}
