//! The native caching allocator's figures, read from the trace itself: reserved memory is the
//! running sum of `segment_alloc` minus `segment_free` (expandable segments record
//! `segment_map` / `segment_unmap` instead, counted the same way).

use crate::trace::{Action, Event};

/// Running native reserved memory over a trace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NativeMeter {
    /// Segment bytes mapped minus unmapped since the first event (may dip below zero when the
    /// trace starts after segments were created: PyTorch keeps the history in a ring buffer).
    current: i64,
    max: i64,
    min: i64,
    oom_events: u64,
}

impl NativeMeter {
    /// Accounts for one event; events other than segment changes and OOMs leave it as is.
    #[inline]
    pub fn observe(&mut self, e: &Event) {
        let size = i64::try_from(e.size).unwrap_or(i64::MAX);
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                self.current = self.current.saturating_add(size);
                self.max = self.max.max(self.current);
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                self.current = self.current.saturating_sub(size);
                self.min = self.min.min(self.current);
            }
            Action::Oom => self.oom_events += 1,
            _ => {}
        }
    }

    /// The running sum since the first event (before [`NativeMeter::offset`] is added).
    #[inline]
    pub fn running(&self) -> i64 {
        self.current
    }

    /// Bytes that must have been reserved before the trace's first event: enough that the
    /// running sum never goes negative (0 for a trace recorded from the start).
    pub fn offset(&self) -> u64 {
        self.min.unsigned_abs()
    }

    /// Native peak reserved bytes.
    pub fn peak(&self) -> u64 {
        (self.max.max(0) as u64).saturating_add(self.offset())
    }

    /// `oom` events in the trace: the native allocator ran out of memory while recording.
    pub fn oom_events(&self) -> u64 {
        self.oom_events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(action: Action, size: u64) -> Event {
        Event {
            addr: 0,
            size,
            stream: 0,
            action,
        }
    }

    #[test]
    fn running_sum_of_segments() {
        let mut m = NativeMeter::default();
        for e in [
            ev(Action::SegmentAlloc, 100),
            ev(Action::Alloc, 50),
            ev(Action::SegmentAlloc, 200),
            ev(Action::SegmentFree, 100),
            ev(Action::SegmentMap, 150),
            ev(Action::SegmentUnmap, 50),
            ev(Action::Oom, 7),
        ] {
            m.observe(&e);
        }
        assert_eq!(m.running(), 300);
        assert_eq!(m.peak(), 350);
        assert_eq!(m.offset(), 0);
        assert_eq!(m.oom_events(), 1);
    }

    #[test]
    fn frees_of_segments_from_before_the_trace_raise_the_baseline() {
        let mut m = NativeMeter::default();
        for e in [
            ev(Action::SegmentFree, 64),
            ev(Action::SegmentAlloc, 100),
            ev(Action::SegmentFree, 100),
        ] {
            m.observe(&e);
        }
        assert_eq!(m.offset(), 64);
        assert_eq!(
            m.peak(),
            100,
            "64 held before the trace, then 36 + 100 at most"
        );
    }
}
