//! The blocks of an arena by address, indexed for the hot path.
//!
//! An arena's blocks were one `BTreeMap` from start to block, and every allocation and free
//! searched it several times: the block freed, the blocks before and after it when a flush
//! coalesces it, the block a hit carves and its rewrite. At 10k live blocks a search is a
//! descent of four nodes with linear key scans, a few hundred instructions, and these
//! lookups were most of the allocator's host time (the random mixed pattern, the
//! concatenation trace's steady state). Here the blocks live in a hash map by start, the
//! block before another is found through a hash map by end (blocks do not overlap, so an end
//! names one block), and an ordered set of starts serves the ordered queries (the block
//! containing an address, walks in address order). Lookups cost a hash probe.
//!
//! The ordered set is read only by misses, statistics and rare queries, but every split and
//! merge changed it: a hit that carves a free block inserts the start of what is left, and
//! the next flush that merges that rest into a freed neighbour removes it again, a B-tree
//! insert and remove (55-75 ns each at 1k-20k blocks) per allocation that is not of a parked
//! size. So its changes are logged (`DeferredSet`): an insert cancels against its remove at
//! the price of a hash probe, and the log is applied when a caller that may settle asks
//! (`settle`: a placement's stitch, lending a page, splitting a lent block, `inactive_split`),
//! or once it holds `STARTS_LOG_CAP` changes. A reader that cannot settle (`&self`) gets the
//! same answers from the set as last settled merged with the logged inserts (a settled start
//! absent from `blocks` was removed since): exactly the order of a set kept up to date, at a
//! scan of the log more a query. Walks in address order from a block (the reuse scan's
//! regions, `Arena::lent_regions_from`) need no ordered set at all: blocks tile a chunk, so
//! the next block starts where one ends (`get` at the end).
//!
//! Invariant (between the arena's operations; within one, a block written may end where a
//! block about to be removed ends): `starts` with its log applied and the keys of `blocks`
//! are the same set of addresses, and `ends` maps the end of every block to its start and
//! holds nothing else. Every write goes through `insert`, `remove` or `replace`, which keep
//! it; `size_and_state` gives the state alone to change, which cannot move an end.

use crate::arena::{Block, BlockState};
use crate::deferred::DeferredSet;
use rustc_hash::FxHashMap;
use std::collections::btree_set;
use std::ops::{Bound, RangeBounds};

/// Logged changes of the ordered starts beyond which they are applied: bounds what a reader
/// that cannot settle scans (the log, once a query) and what the log holds.
const STARTS_LOG_CAP: usize = 512;

pub(crate) struct BlockMap {
    blocks: FxHashMap<u64, Block>,
    starts: DeferredSet<u64>,
    /// end -> start of the block ending there.
    ends: FxHashMap<u64, u64>,
}

impl Default for BlockMap {
    fn default() -> Self {
        BlockMap {
            blocks: FxHashMap::default(),
            starts: DeferredSet::with_cap(STARTS_LOG_CAP),
            ends: FxHashMap::default(),
        }
    }
}

/// Blocks in address order: (start, block).
pub(crate) struct BlockRange<'a> {
    settled: btree_set::Range<'a, u64>,
    /// Present while changes are logged: the merge of the settled starts (those still in
    /// `blocks`) with the logged inserts.
    merge: Option<Merge>,
    blocks: &'a FxHashMap<u64, Block>,
}

/// The state of a merged walk, consumed from both ends.
struct Merge {
    /// The logged inserts in the range, sorted; `lo..hi` are left.
    added: Vec<u64>,
    lo: usize,
    hi: usize,
    /// Settled starts taken from the front (back) of `settled` and not yielded yet.
    front: Option<u64>,
    back: Option<u64>,
}

impl<'a> BlockRange<'a> {
    /// The next start of a merged walk from the front (`front`) or from the back: the nearer
    /// of the next settled start still recorded and the next logged insert (the two are
    /// disjoint). Each end keeps the settled start it peeked; when the settled range is spent
    /// from one end, the start the other end peeked is the last one left.
    fn merged_step(&mut self, front: bool) -> Option<u64> {
        let BlockRange {
            settled,
            merge,
            blocks,
        } = self;
        let m = merge.as_mut()?;
        let (mine, theirs) = if front {
            (&mut m.front, &mut m.back)
        } else {
            (&mut m.back, &mut m.front)
        };
        if mine.is_none() {
            *mine = loop {
                let k = if front {
                    settled.next()
                } else {
                    settled.next_back()
                };
                match k {
                    Some(k) if blocks.contains_key(k) => break Some(*k),
                    Some(_) => continue,
                    None => break theirs.take(),
                }
            };
        }
        let added = (m.lo < m.hi).then(|| m.added[if front { m.lo } else { m.hi - 1 }]);
        let take_added = match (*mine, added) {
            // The smaller from the front, the larger from the back.
            (Some(s), Some(x)) => (x < s) == front,
            (None, Some(_)) => true,
            (_, None) => false,
        };
        if !take_added {
            return mine.take();
        }
        if front {
            m.lo += 1;
        } else {
            m.hi -= 1;
        }
        added
    }

    fn item(&self, a: u64) -> (&'a u64, &'a Block) {
        self.blocks.get_key_value(&a).expect("a start is a block")
    }
}

impl<'a> Iterator for BlockRange<'a> {
    type Item = (&'a u64, &'a Block);

    fn next(&mut self) -> Option<Self::Item> {
        if self.merge.is_none() {
            let a = self.settled.next()?;
            return Some((a, &self.blocks[a]));
        }
        let a = self.merged_step(true)?;
        Some(self.item(a))
    }
}

impl DoubleEndedIterator for BlockRange<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        if self.merge.is_none() {
            let a = self.settled.next_back()?;
            return Some((a, &self.blocks[a]));
        }
        let a = self.merged_step(false)?;
        Some(self.item(a))
    }
}

impl BlockMap {
    pub fn get(&self, addr: &u64) -> Option<&Block> {
        self.blocks.get(addr)
    }

    /// The size and the state (to change in place) of the block at `addr`.
    pub fn size_and_state(&mut self, addr: &u64) -> Option<(u64, &mut BlockState)> {
        self.blocks.get_mut(addr).map(|b| (b.size, &mut b.state))
    }

    /// Records a block at `addr` (none may be there).
    pub fn insert(&mut self, addr: u64, b: Block) {
        let old = self.blocks.insert(addr, b);
        debug_assert!(old.is_none(), "a block recorded twice at {addr:#x}");
        self.starts.insert(addr);
        // A block being removed may still end here (see `forget_end`).
        self.ends.insert(addr + b.size, addr);
    }

    pub fn remove(&mut self, addr: &u64) -> Option<Block> {
        let b = self.blocks.remove(addr)?;
        self.starts.remove(*addr);
        self.forget_end(addr + b.size, *addr);
        Some(b)
    }

    /// Drops `end -> start` unless a block written since ends there too: a carve rewrites
    /// its first block to end where a block it then removes ended.
    fn forget_end(&mut self, end: u64, start: u64) {
        if self.ends.get(&end) == Some(&start) {
            self.ends.remove(&end);
        }
    }

    /// Rewrites the block at `addr` (its size may change); false when there is none.
    pub fn replace(&mut self, addr: u64, b: Block) -> bool {
        let Some(slot) = self.blocks.get_mut(&addr) else {
            return false;
        };
        let old_end = addr + slot.size;
        *slot = b;
        if b.size != old_end - addr {
            self.forget_end(old_end, addr);
            self.ends.insert(addr + b.size, addr);
        }
        true
    }

    /// The number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// The block that ends exactly at `end` (of any chunk): (start, block).
    pub fn ending_at(&self, end: u64) -> Option<(u64, &Block)> {
        let &a = self.ends.get(&end)?;
        Some((a, &self.blocks[&a]))
    }

    pub fn range<R: RangeBounds<u64>>(&self, r: R) -> BlockRange<'_> {
        if self.starts.is_settled() {
            return BlockRange {
                settled: self.starts.settled().range(r),
                merge: None,
                blocks: &self.blocks,
            };
        }
        let (set, inserted) = self.starts.unsettled_parts();
        let mut added: Vec<u64> = inserted.filter(|k| r.contains(k)).collect();
        added.sort_unstable();
        let hi = added.len();
        BlockRange {
            settled: set.range((clone_bound(r.start_bound()), clone_bound(r.end_bound()))),
            merge: Some(Merge {
                added,
                lo: 0,
                hi,
                front: None,
                back: None,
            }),
            blocks: &self.blocks,
        }
    }

    /// The block starting at or before `x` nearest to it: (start, block). Settled, a descent
    /// of the ordered set; with changes logged, that of the settled set (skipping starts
    /// removed since) and a scan of the logged inserts, with no sort.
    pub fn last_at_or_before(&self, x: u64) -> Option<(u64, &Block)> {
        if let Some(b) = self.blocks.get(&x) {
            return Some((x, b));
        }
        if self.starts.is_settled() {
            let &a = self.starts.settled().range(..=x).next_back()?;
            return Some((a, &self.blocks[&a]));
        }
        let (set, inserted) = self.starts.unsettled_parts();
        let settled = set
            .range(..=x)
            .rev()
            .find(|a| self.blocks.contains_key(a))
            .copied();
        let added = inserted.filter(|&a| a <= x).max();
        let a = settled.max(added)?;
        Some((a, &self.blocks[&a]))
    }

    /// Applies the logged changes of the ordered starts: before searches from any address
    /// that a `&mut` caller makes (cheaper settled than merged).
    pub fn settle(&mut self) {
        self.starts.settle();
    }

    pub fn iter(&self) -> BlockRange<'_> {
        self.range(..)
    }

    /// Whether the three indexes agree (the module's invariant).
    pub fn check(&self) -> Result<(), String> {
        let starts = self.starts.current();
        if starts.len() != self.blocks.len() || self.ends.len() != self.blocks.len() {
            return Err(format!(
                "block map: {} blocks, {} starts, {} ends",
                self.blocks.len(),
                starts.len(),
                self.ends.len()
            ));
        }
        for (&a, b) in &self.blocks {
            if !starts.contains(&a) || self.ends.get(&(a + b.size)) != Some(&a) {
                return Err(format!(
                    "block map: the block at {a:#x} of {} bytes is not indexed by its start \
                     and end",
                    b.size
                ));
            }
        }
        Ok(())
    }
}

fn clone_bound(b: Bound<&u64>) -> Bound<u64> {
    match b {
        Bound::Included(&x) => Bound::Included(x),
        Bound::Excluded(&x) => Bound::Excluded(x),
        Bound::Unbounded => Bound::Unbounded,
    }
}

impl std::ops::Index<&u64> for BlockMap {
    type Output = Block;

    fn index(&self, addr: &u64) -> &Block {
        &self.blocks[addr]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(size: u64) -> Block {
        Block {
            size,
            state: BlockState::FreeMapped { freed: 0 },
            chunk: 0,
        }
    }

    #[test]
    fn ends_follow_inserts_removes_and_rewrites() {
        let mut m = BlockMap::default();
        m.insert(0, block(100));
        m.insert(100, block(100));
        m.insert(200, block(100));
        m.check().unwrap();
        assert_eq!(m.ending_at(200).map(|(a, _)| a), Some(100));
        assert!(m.ending_at(150).is_none());
        // A carve rewrites its first block to end where the next one ends, then removes the
        // next one: the end stays the rewritten block's.
        assert!(m.replace(0, block(200)));
        m.remove(&100);
        m.check().unwrap();
        assert_eq!(m.ending_at(200).map(|(a, _)| a), Some(0));
        assert!(m.ending_at(100).is_none());
        // Shrinking moves the end back.
        assert!(m.replace(0, block(50)));
        m.insert(50, block(150));
        m.check().unwrap();
        assert_eq!(m.ending_at(50).map(|(a, _)| a), Some(0));
        assert_eq!(m.ending_at(200).map(|(a, _)| a), Some(50));
        assert!(!m.replace(7, block(1)), "no block at 7");
        // Ordered queries in both directions.
        let starts: Vec<u64> = m.range(..).map(|(&a, _)| a).collect();
        assert_eq!(starts, vec![0, 50, 200]);
        assert_eq!(m.range(..=199).next_back().map(|(&a, _)| a), Some(50));
        assert_eq!(m[&200].size, 100);
        // A state changed in place keeps the indexes.
        *m.size_and_state(&50).unwrap().1 = BlockState::Live;
        let (size, state) = m.size_and_state(&50).unwrap();
        assert_eq!((size, *state), (150, BlockState::Live));
        m.check().unwrap();
    }

    /// Blocks tiling [0, 64 * 512) in pieces, split and merged at random without settling
    /// (and settled now and then): every ordered read agrees with a `BTreeMap` of the same
    /// blocks, settled or not.
    #[test]
    fn ordered_reads_agree_with_an_ordered_map_while_changes_are_logged() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        use std::collections::BTreeMap;
        let ops = proptest::collection::vec((any::<u16>(), 0u8..10, any::<u16>()), 1..400);
        TestRunner::new(Config::with_cases(64))
            .run(&ops, |ops| {
                const G: u64 = 512;
                const END: u64 = 64 * G;
                let mut m = BlockMap::default();
                let mut model: BTreeMap<u64, u64> = BTreeMap::new();
                // A second run of blocks after a gap: ordered queries cross it.
                for (a, size) in [(0, END), (2 * END, END)] {
                    m.insert(a, block(size));
                    model.insert(a, size);
                }
                for (pick, what, q) in ops {
                    let keys: Vec<u64> = model.keys().copied().collect();
                    let a = keys[pick as usize % keys.len()];
                    let size = model[&a];
                    match what {
                        // Split the block at `a` in two.
                        0..=3 if size > G => {
                            let cut = G * (1 + u64::from(pick) % (size / G - 1));
                            assert!(m.replace(a, block(cut)));
                            m.insert(a + cut, block(size - cut));
                            model.insert(a, cut);
                            model.insert(a + cut, size - cut);
                        }
                        // Merge it with the block after, when that one touches it.
                        4..=7 => {
                            if let Some(next) = model.get(&(a + size)).copied() {
                                m.remove(&(a + size));
                                assert!(m.replace(a, block(size + next)));
                                model.remove(&(a + size));
                                model.insert(a, size + next);
                            }
                        }
                        8 => m.settle(),
                        _ => {}
                    }
                    let x = u64::from(q) % (3 * END + G);
                    let got: Vec<u64> = m.range(x..).map(|(&k, _)| k).collect();
                    let want: Vec<u64> = model.range(x..).map(|(&k, _)| k).collect();
                    prop_assert_eq!(&got, &want, "range({}..)", x);
                    let got: Vec<u64> = m.range(..x).rev().map(|(&k, _)| k).collect();
                    let want: Vec<u64> = model.range(..x).rev().map(|(&k, _)| k).collect();
                    prop_assert_eq!(&got, &want, "range(..{}) reversed", x);
                    // Consumed from both ends at once.
                    let mut r = m.range(..);
                    let mut both = Vec::new();
                    let mut front = true;
                    while let Some((&k, _)) = if front { r.next() } else { r.next_back() } {
                        both.push(k);
                        front = !front;
                    }
                    both.sort_unstable();
                    let all: Vec<u64> = model.keys().copied().collect();
                    prop_assert_eq!(&both, &all, "walked from both ends");
                    prop_assert_eq!(
                        m.last_at_or_before(x).map(|(k, b)| (k, b.size)),
                        model.range(..=x).next_back().map(|(&k, &v)| (k, v)),
                        "last_at_or_before({})",
                        x
                    );
                    prop_assert!(m.check().is_ok());
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn check_finds_an_end_out_of_step() {
        let mut m = BlockMap::default();
        m.insert(0, block(100));
        m.ends.insert(100, 7);
        assert!(m.check().is_err());
    }
}
