//! Free blocks by (size, address), for best fit: the smallest block of at least a size, the
//! lowest address among blocks of that size.
//!
//! The arena's free mapped blocks were a `BTreeSet<(size, addr)>`, and every allocation and
//! free changed it two to four times (the block carved, its tail, the neighbours a flush
//! merges): at 10k free blocks each change is a descent of four nodes with linear key scans,
//! a cache miss a node. Here sizes below `CLASSES << SHIFT` (64 MiB) are kept in buckets by
//! size class (512 bytes, the arena's block granularity, so that a class holds one size), in
//! a hash map, with a three-level bitmap of the classes that hold a block: a change costs a
//! hash probe and a few bit operations (plus a descent of the class's own ordered set when it
//! holds more than `FEW` blocks), and the smallest class at or above a size is found with at
//! most three word scans. Larger blocks, few, stay in an ordered set.
//!
//! Invariant: a class's bit is set in `l0` iff its bucket exists (and then is not empty); a
//! bit of `l1` is set iff its `l0` word is not zero, a bit of `l2` iff its `l1` word is not
//! zero; a bucket's entries are sorted and belong to its class; `len` counts every entry of
//! the buckets and of `large`. The order of queries is exactly the `(size, addr)` order of
//! the set this replaced (`tests::agrees_with_an_ordered_set`).

use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

/// log2 of the class width in bytes.
const SHIFT: u32 = 9;
/// Classes kept in buckets: sizes below 64 MiB.
const CLASSES: u64 = 1 << 17;
const L0_WORDS: usize = (CLASSES / 64) as usize;
const L1_WORDS: usize = L0_WORDS / 64;

/// Entries a class keeps in a sorted vector; more go to an ordered set, so that a class
/// holding thousands of blocks of one size (tensors freed every other one) still changes in
/// O(log n): a vector of 20k entries cost 7.8 µs a change against the set's 0.14.
const FEW: usize = 8;

/// The entries of one class, sorted: most classes hold one block, kept inline.
enum Bucket {
    One((u64, u64)),
    Few(Vec<(u64, u64)>),
    Many(BTreeSet<(u64, u64)>),
}

impl Bucket {
    fn first_at_least(&self, size: u64) -> Option<(u64, u64)> {
        match self {
            Bucket::One(e) => (e.0 >= size).then_some(*e),
            Bucket::Few(v) => v.get(v.partition_point(|e| e.0 < size)).copied(),
            Bucket::Many(s) => s.range((size, 0)..).next().copied(),
        }
    }

    fn last(&self) -> (u64, u64) {
        match self {
            Bucket::One(e) => *e,
            Bucket::Few(v) => *v.last().expect("a bucket is never empty"),
            Bucket::Many(s) => *s.last().expect("a bucket is never empty"),
        }
    }

    fn contains(&self, e: &(u64, u64)) -> bool {
        match self {
            Bucket::One(x) => x == e,
            Bucket::Few(v) => v.binary_search(e).is_ok(),
            Bucket::Many(s) => s.contains(e),
        }
    }

    /// Adds `e`; false if it was there.
    fn insert(&mut self, e: (u64, u64)) -> bool {
        match self {
            Bucket::One(x) if *x == e => false,
            Bucket::One(x) => {
                let x = *x;
                *self = Bucket::Few(if x < e { vec![x, e] } else { vec![e, x] });
                true
            }
            Bucket::Few(v) => match v.binary_search(&e) {
                Ok(_) => false,
                Err(_) if v.len() == FEW => {
                    let mut s: BTreeSet<(u64, u64)> = v.drain(..).collect();
                    s.insert(e);
                    *self = Bucket::Many(s);
                    true
                }
                Err(i) => {
                    v.insert(i, e);
                    true
                }
            },
            Bucket::Many(s) => s.insert(e),
        }
    }

    /// Removes `e`: (whether it was there, whether the bucket is now empty).
    fn remove(&mut self, e: &(u64, u64)) -> (bool, bool) {
        match self {
            Bucket::One(x) => (*x == *e, *x == *e),
            Bucket::Few(v) => match v.binary_search(e) {
                Ok(i) => {
                    v.remove(i);
                    if v.len() == 1 {
                        *self = Bucket::One(v[0]);
                    }
                    (true, false)
                }
                Err(_) => (false, false),
            },
            Bucket::Many(s) => {
                let had = s.remove(e);
                if s.len() <= FEW / 2 {
                    *self = Bucket::Few(s.iter().copied().collect());
                }
                (had, false)
            }
        }
    }
}

#[derive(Default)]
pub(crate) struct FitIndex {
    /// One bit a class; allocated with the first entry of a bucket.
    l0: Vec<u64>,
    l1: Vec<u64>,
    l2: u64,
    buckets: FxHashMap<u64, Bucket>,
    /// Entries of `CLASSES << SHIFT` bytes or more.
    large: BTreeSet<(u64, u64)>,
    len: usize,
}

impl FitIndex {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Adds `(size, addr)`; false if it was there.
    pub fn insert(&mut self, e: (u64, u64)) -> bool {
        let c = e.0 >> SHIFT;
        if c >= CLASSES {
            let new = self.large.insert(e);
            self.len += new as usize;
            return new;
        }
        let new = match self.buckets.entry(c) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Bucket::One(e));
                self.set_bit(c);
                true
            }
            std::collections::hash_map::Entry::Occupied(mut o) => o.get_mut().insert(e),
        };
        self.len += new as usize;
        new
    }

    /// Removes `(size, addr)`; false if it was not there.
    pub fn remove(&mut self, e: &(u64, u64)) -> bool {
        let c = e.0 >> SHIFT;
        if c >= CLASSES {
            let had = self.large.remove(e);
            self.len -= had as usize;
            return had;
        }
        let std::collections::hash_map::Entry::Occupied(mut o) = self.buckets.entry(c) else {
            return false;
        };
        let (had, empty) = o.get_mut().remove(e);
        if empty {
            o.remove();
            self.clear_bit(c);
        }
        self.len -= had as usize;
        had
    }

    pub fn contains(&self, e: &(u64, u64)) -> bool {
        let c = e.0 >> SHIFT;
        if c >= CLASSES {
            return self.large.contains(e);
        }
        self.buckets.get(&c).is_some_and(|b| b.contains(e))
    }

    /// The smallest entry whose size is at least `size` (the lowest address among equals).
    pub fn first_at_least(&self, size: u64) -> Option<(u64, u64)> {
        let c = size >> SHIFT;
        if c < CLASSES {
            if let Some(e) = self.buckets.get(&c).and_then(|b| b.first_at_least(size)) {
                return Some(e);
            }
            if let Some(n) = self.next_class(c + 1) {
                return self.buckets[&n].first_at_least(0);
            }
        }
        self.large.range((size, 0)..).next().copied()
    }

    /// The largest entry (the highest address among equals).
    pub fn last(&self) -> Option<(u64, u64)> {
        if let Some(&e) = self.large.last() {
            return Some(e);
        }
        // The highest set bit at each level.
        let w1 = self.l2.checked_ilog2()? as usize;
        let w0 = w1 * 64 + self.l1[w1].ilog2() as usize;
        let c = w0 as u64 * 64 + self.l0[w0].ilog2() as u64;
        Some(self.buckets[&c].last())
    }

    fn set_bit(&mut self, c: u64) {
        if self.l0.is_empty() {
            self.l0 = vec![0; L0_WORDS];
            self.l1 = vec![0; L1_WORDS];
        }
        let w0 = (c / 64) as usize;
        self.l0[w0] |= 1 << (c % 64);
        self.l1[w0 / 64] |= 1 << (w0 % 64);
        self.l2 |= 1 << (w0 / 64);
    }

    fn clear_bit(&mut self, c: u64) {
        let w0 = (c / 64) as usize;
        self.l0[w0] &= !(1 << (c % 64));
        if self.l0[w0] == 0 {
            let w1 = w0 / 64;
            self.l1[w1] &= !(1 << (w0 % 64));
            if self.l1[w1] == 0 {
                self.l2 &= !(1 << w1);
            }
        }
    }

    /// The lowest class at or above `from` that holds an entry.
    fn next_class(&self, from: u64) -> Option<u64> {
        if from >= CLASSES || self.l0.is_empty() {
            return None;
        }
        // In `from`'s own word.
        let w0 = (from / 64) as usize;
        let bits = self.l0[w0] & (!0u64 << (from % 64));
        if bits != 0 {
            return Some(w0 as u64 * 64 + bits.trailing_zeros() as u64);
        }
        // The next non-empty word of l0, through l1, then l2.
        let from0 = w0 + 1;
        let w1 = from0 / 64;
        let w0 = if w1 < L1_WORDS && self.l1[w1] & (!0u64 << (from0 % 64)) != 0 {
            w1 * 64 + (self.l1[w1] & (!0u64 << (from0 % 64))).trailing_zeros() as usize
        } else {
            let from1 = w1 + 1;
            if from1 >= 64 {
                return None;
            }
            let bits = self.l2 & (!0u64 << from1);
            if bits == 0 {
                return None;
            }
            let w1 = bits.trailing_zeros() as usize;
            w1 * 64 + self.l1[w1].trailing_zeros() as usize
        };
        Some(w0 as u64 * 64 + self.l0[w0].trailing_zeros() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_crosses_words_and_levels() {
        let mut f = FitIndex::default();
        assert_eq!(f.first_at_least(0), None);
        assert_eq!(f.last(), None);
        // Classes in the same l0 word, the next l0 word of the same l1 word, another l1 word.
        for &(size, addr) in &[
            (512, 7),
            (1024, 3),
            (512 * 70, 1),
            (512 * 5000, 2),
            (1 << 30, 9),
        ] {
            assert!(f.insert((size, addr)));
        }
        assert!(!f.insert((1024, 3)), "an entry is there once");
        assert_eq!(f.len(), 5);
        assert_eq!(f.first_at_least(1), Some((512, 7)));
        assert_eq!(f.first_at_least(600), Some((1024, 3)));
        assert_eq!(f.first_at_least(1025), Some((512 * 70, 1)));
        assert_eq!(f.first_at_least(512 * 71), Some((512 * 5000, 2)));
        assert_eq!(f.first_at_least(512 * 5001), Some((1 << 30, 9)));
        assert_eq!(f.first_at_least((1 << 30) + 1), None);
        assert_eq!(f.last(), Some((1 << 30, 9)));
        assert!(f.remove(&(1 << 30, 9)));
        assert_eq!(f.last(), Some((512 * 5000, 2)));
        assert!(f.remove(&(512 * 5000, 2)));
        assert!(!f.remove(&(512 * 5000, 2)));
        assert_eq!(f.first_at_least(512 * 71), None);
        assert_eq!(f.last(), Some((512 * 70, 1)));
        // One size at several addresses: the lowest first.
        f.insert((1024, 1));
        f.insert((1024, 5));
        assert_eq!(f.first_at_least(1024), Some((1024, 1)));
        assert!(f.remove(&(1024, 1)));
        assert_eq!(f.first_at_least(1024), Some((1024, 3)));
        assert!(f.contains(&(1024, 5)) && !f.contains(&(1024, 1)));
        assert_eq!(f.len(), 4);
    }

    #[test]
    fn the_last_class_below_the_large_set() {
        let mut f = FitIndex::default();
        let top = (CLASSES << SHIFT) - 512;
        f.insert((top, 1));
        f.insert((512, 2));
        assert_eq!(f.first_at_least(513), Some((top, 1)));
        assert_eq!(f.last(), Some((top, 1)));
        assert_eq!(f.first_at_least(top + 1), None);
        f.insert((CLASSES << SHIFT, 3));
        assert_eq!(f.first_at_least(top + 1), Some((CLASSES << SHIFT, 3)));
    }

    #[test]
    fn a_class_of_many_blocks_keeps_them_in_order() {
        // Past `FEW` a class's entries move to an ordered set, and back below half of it.
        let mut f = FitIndex::default();
        for a in (0..1000u64).rev() {
            assert!(f.insert((4096, a * 8192)));
        }
        assert!(f.contains(&(4096, 999 * 8192)) && !f.insert((4096, 0)));
        for a in 0..996u64 {
            assert_eq!(f.first_at_least(4000), Some((4096, a * 8192)));
            assert!(f.remove(&(4096, a * 8192)));
        }
        assert_eq!(f.len(), 4);
        assert_eq!(f.last(), Some((4096, 999 * 8192)));
        for a in 996..1000u64 {
            assert!(f.remove(&(4096, a * 8192)));
        }
        assert_eq!((f.len(), f.first_at_least(0), f.last()), (0, None, None));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any sequence of inserts and removes answers as a `BTreeSet<(size, addr)>` does.
        #[test]
        fn agrees_with_an_ordered_set(
            ops in prop::collection::vec((any::<bool>(), 0u64..4, 0u64..6, 0u64..24), 1..400),
        ) {
            let mut f = FitIndex::default();
            let mut s = BTreeSet::new();
            for (insert, scale, units, addr) in ops {
                // Sizes around the word and level boundaries, and not multiples of 512 too.
                let size = match scale {
                    0 => units * 512,
                    1 => units * 512 * 64 + units,
                    2 => units * 512 * 4096,
                    _ => (CLASSES << SHIFT) - 20 * 512 + units * 512,
                };
                let e = (size, addr);
                if insert {
                    prop_assert_eq!(f.insert(e), s.insert(e));
                } else {
                    prop_assert_eq!(f.remove(&e), s.remove(&e));
                }
                prop_assert_eq!(f.len(), s.len());
                prop_assert_eq!(f.last(), s.last().copied());
                for q in [0, size, size + 1, size.saturating_sub(700), 512 * 64 * 3] {
                    prop_assert_eq!(f.first_at_least(q), s.range((q, 0)..).next().copied());
                }
                prop_assert_eq!(f.contains(&e), s.contains(&e));
            }
        }
    }
}
