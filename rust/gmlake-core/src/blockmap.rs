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
//! containing an address, walks in address order). Lookups cost a hash probe; an insert or a
//! remove costs what it did (one descent of the ordered set) plus two probes.
//!
//! Invariant (between the arena's operations; within one, a block written may end where a
//! block about to be removed ends): `starts` and the keys of `blocks` are the same set of
//! addresses, and `ends` maps the end of every block to its start and holds nothing else.
//! Every write goes through `insert`, `remove` or `replace`, which keep it; `size_and_state`
//! gives the state alone to change, which cannot move an end.

use crate::arena::{Block, BlockState};
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;
use std::ops::RangeBounds;

#[derive(Default)]
pub(crate) struct BlockMap {
    blocks: FxHashMap<u64, Block>,
    starts: BTreeSet<u64>,
    /// end -> start of the block ending there.
    ends: FxHashMap<u64, u64>,
}

/// Blocks in address order: (start, block).
pub(crate) struct BlockRange<'a> {
    starts: std::collections::btree_set::Range<'a, u64>,
    blocks: &'a FxHashMap<u64, Block>,
}

impl<'a> Iterator for BlockRange<'a> {
    type Item = (&'a u64, &'a Block);

    fn next(&mut self) -> Option<Self::Item> {
        let a = self.starts.next()?;
        Some((a, &self.blocks[a]))
    }
}

impl DoubleEndedIterator for BlockRange<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        let a = self.starts.next_back()?;
        Some((a, &self.blocks[a]))
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
        self.starts.remove(addr);
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
        BlockRange {
            starts: self.starts.range(r),
            blocks: &self.blocks,
        }
    }

    pub fn iter(&self) -> BlockRange<'_> {
        self.range(..)
    }

    /// Whether the three indexes agree (the module's invariant).
    pub fn check(&self) -> Result<(), String> {
        if self.starts.len() != self.blocks.len() || self.ends.len() != self.blocks.len() {
            return Err(format!(
                "block map: {} blocks, {} starts, {} ends",
                self.blocks.len(),
                self.starts.len(),
                self.ends.len()
            ));
        }
        for (&a, b) in &self.blocks {
            if !self.starts.contains(&a) || self.ends.get(&(a + b.size)) != Some(&a) {
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

    #[test]
    fn check_finds_an_end_out_of_step() {
        let mut m = BlockMap::default();
        m.insert(0, block(100));
        m.ends.insert(100, 7);
        assert!(m.check().is_err());
    }
}
