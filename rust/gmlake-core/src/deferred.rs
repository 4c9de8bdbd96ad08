//! An ordered set whose changes are logged and applied when it is next read.
//!
//! The arena's index of blocks by interior pages (`Arena::stealable`) changes with every free
//! mapped block that appears or goes, on every allocation and free, but is read only when a
//! miss stitches or memory is returned. In a steady state most free blocks appear and are
//! carved again between two such reads, so logging the changes and cancelling each insert
//! against its remove costs two hash probes where two tree descents were paid.
//!
//! Invariant: a key's logged count is -1 (removed, it is in the set), +1 (inserted, it is not)
//! or absent (no net change); the set with the log applied is the set of keys inserted and not
//! removed since. Reads take the settled set, which the caller settles first (asserted in
//! every build), or, for a reader that cannot settle it (`blockmap.rs`'s ordered starts, read
//! through `&self`), the set as last settled and the keys inserted since, which it merges.

use rustc_hash::FxHashMap;
use std::collections::BTreeSet;
use std::hash::Hash;

/// Pending changes beyond which the log is applied at once (bounds its memory where the set
/// is never read: a job that never misses), unless `with_cap` says otherwise.
const LOG_CAP: usize = 4096;

pub(crate) struct DeferredSet<K> {
    set: BTreeSet<K>,
    log: FxHashMap<K, i8>,
    cap: usize,
}

impl<K: Ord + Hash + Copy + std::fmt::Debug> DeferredSet<K> {
    pub fn new() -> Self {
        Self::with_cap(LOG_CAP)
    }

    /// A set whose log is applied once it holds more than `cap` changes.
    pub fn with_cap(cap: usize) -> Self {
        DeferredSet {
            set: BTreeSet::new(),
            log: FxHashMap::default(),
            cap,
        }
    }

    pub fn insert(&mut self, k: K) {
        self.change(k, 1);
    }

    pub fn remove(&mut self, k: K) {
        self.change(k, -1);
    }

    fn change(&mut self, k: K, by: i8) {
        let c = self.log.entry(k).or_insert(0);
        *c += by;
        debug_assert!(c.abs() <= 1, "{k:?} inserted or removed twice");
        if *c == 0 {
            self.log.remove(&k);
        } else if self.log.len() > self.cap {
            self.settle();
        }
    }

    /// Applies the logged changes.
    pub fn settle(&mut self) {
        // `drain` clears the whole table even when it is empty: settling is asked at every
        // miss that stitches, most of the time with nothing logged.
        if self.log.is_empty() {
            return;
        }
        for (k, c) in self.log.drain() {
            apply(&mut self.set, k, c);
        }
    }

    /// The set; `settle` must have been called since the last change. A read of an unsettled
    /// set is a bug that would change decisions silently, so it panics in every build (the
    /// bridge turns a panic into an error; the check is one comparison).
    pub fn settled(&self) -> &BTreeSet<K> {
        assert!(
            self.log.is_empty(),
            "a deferred set read before it was settled"
        );
        &self.set
    }

    /// Whether no change is pending.
    pub fn is_settled(&self) -> bool {
        self.log.is_empty()
    }

    /// The set as last settled, and the keys inserted since (not sorted): for readers that
    /// cannot settle it (the keys removed since are in the set still; the caller tells them
    /// apart).
    pub fn unsettled_parts(&self) -> (&BTreeSet<K>, impl Iterator<Item = K> + '_) {
        let inserted = self.log.iter().filter(|&(_, &c)| c > 0).map(|(&k, _)| k);
        (&self.set, inserted)
    }

    /// The set with the log applied, without settling it (for checks).
    pub fn current(&self) -> BTreeSet<K> {
        let mut s = self.set.clone();
        for (&k, &c) in &self.log {
            apply(&mut s, k, c);
        }
        s
    }
}

/// One logged change applied to `set`: +1 inserts `k`, -1 removes it.
fn apply<K: Ord>(set: &mut BTreeSet<K>, k: K, c: i8) {
    if c > 0 {
        set.insert(k);
    } else {
        set.remove(&k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_cancel_and_apply_when_settled() {
        let mut s: DeferredSet<(u64, u64)> = DeferredSet::new();
        s.insert((1, 10));
        s.insert((2, 20));
        s.remove((1, 10));
        assert_eq!(s.log.len(), 1, "an insert and its remove cancel");
        assert_eq!(s.current().into_iter().collect::<Vec<_>>(), vec![(2, 20)]);
        s.settle();
        assert_eq!(
            s.settled().iter().copied().collect::<Vec<_>>(),
            vec![(2, 20)]
        );
        // Removed, then the same key again: no net change.
        s.remove((2, 20));
        s.insert((2, 20));
        assert!(s.log.is_empty());
        s.remove((2, 20));
        assert_eq!(s.current().len(), 0);
        s.settle();
        assert!(s.settled().is_empty());
    }

    #[test]
    fn an_unsettled_set_shows_its_settled_keys_and_the_inserts_since() {
        let mut s: DeferredSet<u64> = DeferredSet::with_cap(4);
        s.insert(1);
        s.insert(2);
        s.settle();
        s.remove(1);
        s.insert(3);
        assert!(!s.is_settled());
        let (set, inserted) = s.unsettled_parts();
        assert_eq!(
            set.iter().copied().collect::<Vec<_>>(),
            vec![1, 2],
            "as last settled"
        );
        assert_eq!(
            inserted.collect::<Vec<_>>(),
            vec![3],
            "removes are not inserts"
        );
        // Past its own cap (4 changes), the log is applied.
        for k in 10..13 {
            s.insert(k);
        }
        assert!(s.is_settled());
        assert_eq!(
            s.settled().iter().copied().collect::<Vec<_>>(),
            vec![2, 3, 10, 11, 12]
        );
    }

    #[test]
    fn a_long_log_is_applied_at_once() {
        let mut s: DeferredSet<u64> = DeferredSet::new();
        for k in 0..=LOG_CAP as u64 {
            s.insert(k);
        }
        assert!(s.log.is_empty(), "applied past {LOG_CAP} pending changes");
        assert_eq!(s.settled().len(), LOG_CAP + 1);
    }
}
