//! Where one allocator call's time went, for `host_timing`'s slow calls: waiting for the
//! allocator's lock, and in driver calls (all of them, and the slowest by kind).
//!
//! Why: a ZeRO-3 run on four H200s had one step in which two ranks each spent 628 ms inside
//! gmlake's calls, with the usual hundred-odd VMM calls and no wait of its own (no
//! synchronisation, no retired range, no fence awaited). A slow call's total alone cannot say
//! whether a driver call stalled (and which), the lock was held by another thread, or the
//! core itself was slow.
//!
//! Kept per thread (`thread_local!`): a call's own driver calls and lock wait, never another
//! thread's, with no atomic or lock on the path. The caller resets before the call and takes
//! the figures after it (`gmlake-ffi`'s host timing). Driver calls are timed only when the
//! allocator's `host_timing` is on; the lock wait only when the lock was contended (an
//! uncontended `try_lock` reads no clock).

use std::cell::Cell;

/// The figures of the calls made on this thread since the last [`reset`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallTime {
    /// Nanoseconds waited for the allocator's lock.
    pub lock_wait_ns: u64,
    /// Nanoseconds spent in driver calls.
    pub driver_ns: u64,
    /// Driver calls timed.
    pub driver_calls: u64,
    /// The kind of the slowest driver call (`DriverCalls`' field name), "" if none.
    pub slowest_driver: &'static str,
    pub slowest_driver_ns: u64,
}

impl CallTime {
    /// Nothing yet (what `Default` gives, usable in a `const`).
    pub const ZERO: CallTime = CallTime {
        lock_wait_ns: 0,
        driver_ns: 0,
        driver_calls: 0,
        slowest_driver: "",
        slowest_driver_ns: 0,
    };
}

thread_local! {
    static NOW: Cell<CallTime> = const { Cell::new(CallTime::ZERO) };
}

/// Starts a new call on this thread.
pub fn reset() {
    NOW.with(|c| c.set(CallTime::ZERO));
}

/// The figures since the last [`reset`] on this thread, which starts anew.
pub fn take() -> CallTime {
    NOW.with(|c| c.replace(CallTime::ZERO))
}

/// A driver call of `kind` took `ns`.
pub fn note_driver(kind: &'static str, ns: u64) {
    NOW.with(|c| {
        let mut t = c.get();
        t.driver_ns += ns;
        t.driver_calls += 1;
        if ns >= t.slowest_driver_ns {
            t.slowest_driver = kind;
            t.slowest_driver_ns = ns;
        }
        c.set(t);
    });
}

/// The allocator's lock took `ns` to get.
pub fn note_lock_wait(ns: u64) {
    NOW.with(|c| {
        let mut t = c.get();
        t.lock_wait_ns += ns;
        c.set(t);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_keeps_its_driver_time_and_slowest_kind_per_thread() {
        reset();
        note_driver("map", 5);
        note_driver("unmap", 40);
        note_driver("map", 7);
        note_lock_wait(3);
        note_lock_wait(4);
        // Another thread's calls are its own.
        std::thread::spawn(|| {
            reset();
            note_driver("create_physical", 1_000);
            assert_eq!(take().driver_calls, 1);
        })
        .join()
        .unwrap();
        let t = take();
        assert_eq!(
            t,
            CallTime {
                lock_wait_ns: 7,
                driver_ns: 52,
                driver_calls: 3,
                slowest_driver: "unmap",
                slowest_driver_ns: 40,
            }
        );
        assert_eq!(take(), CallTime::ZERO, "take starts anew");
    }
}
