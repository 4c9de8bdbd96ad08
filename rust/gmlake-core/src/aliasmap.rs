//! The aliases an arena keeps mapped in its lent blocks: virtual address -> physical page,
//! and the reverse, page -> its addresses here.
//!
//! The reverse side is what releasing a page needs: every mapping of a page must be gone
//! before the page goes back to the device, so each release first finds the page's aliases.
//! Found by a scan of every alias, that cost O(aliases) per release; after a page-size
//! upgrade the old generation drains at nearly every free of its blocks, and on the random
//! mixed pattern (10k live blocks, thousands of aliases) the scans were 12% of the host time
//! of a run in which the upgrade happened. With the reverse side a release costs O(pages
//! released).
//!
//! Invariant (checked by [`AliasMap::check`]): `by_handle` holds exactly the pairs of
//! `by_va`, each once; no handle's list is empty.

use crate::device::PhysHandle;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::ops::RangeBounds;

#[derive(Default)]
pub(crate) struct AliasMap {
    /// va -> handle, ordered: the reuse scan reads the aliases of an address range.
    by_va: BTreeMap<u64, PhysHandle>,
    /// handle -> its addresses in `by_va` (a page has at most a few aliases per arena).
    by_handle: FxHashMap<PhysHandle, Vec<u64>>,
}

impl AliasMap {
    pub fn insert(&mut self, va: u64, h: PhysHandle) {
        if let Some(old) = self.by_va.insert(va, h) {
            self.forget(old, va);
        }
        self.by_handle.entry(h).or_default().push(va);
    }

    pub fn remove(&mut self, va: &u64) -> Option<PhysHandle> {
        let h = self.by_va.remove(va)?;
        self.forget(h, *va);
        Some(h)
    }

    fn forget(&mut self, h: PhysHandle, va: u64) {
        if let Some(vas) = self.by_handle.get_mut(&h) {
            if let Some(i) = vas.iter().position(|&v| v == va) {
                vas.swap_remove(i);
            }
            if vas.is_empty() {
                self.by_handle.remove(&h);
            }
        }
    }

    pub fn get(&self, va: &u64) -> Option<&PhysHandle> {
        self.by_va.get(va)
    }

    pub fn len(&self) -> usize {
        self.by_va.len()
    }

    pub fn range<R: RangeBounds<u64>>(
        &self,
        r: R,
    ) -> std::collections::btree_map::Range<'_, u64, PhysHandle> {
        self.by_va.range(r)
    }

    pub fn keys(&self) -> impl Iterator<Item = &u64> + '_ {
        self.by_va.keys()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u64, &PhysHandle)> + '_ {
        self.by_va.iter()
    }

    /// The aliases here of `h`.
    pub fn of(&self, h: PhysHandle) -> &[u64] {
        self.by_handle.get(&h).map_or(&[], Vec::as_slice)
    }

    /// The pages with an alias here, each once.
    pub fn handles(&self) -> impl Iterator<Item = PhysHandle> + '_ {
        self.by_handle.keys().copied()
    }

    /// Every alias, in address order; the map is left empty.
    pub fn take_all(&mut self) -> Vec<(u64, PhysHandle)> {
        self.by_handle.clear();
        std::mem::take(&mut self.by_va).into_iter().collect()
    }

    pub fn check(&self) -> Result<(), String> {
        let mut pairs = 0;
        for (h, vas) in &self.by_handle {
            if vas.is_empty() {
                return Err(format!("alias map: page {h:?} listed with no alias"));
            }
            for va in vas {
                if self.by_va.get(va) != Some(h) {
                    return Err(format!(
                        "alias map: page {h:?} lists {va:#x}, which maps {:?}",
                        self.by_va.get(va)
                    ));
                }
            }
            pairs += vas.len();
        }
        if pairs != self.by_va.len() {
            return Err(format!(
                "alias map: {} aliases by address, {pairs} by page",
                self.by_va.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> PhysHandle {
        PhysHandle(n)
    }

    #[test]
    fn both_sides_follow_inserts_removes_and_overwrites() {
        let mut m = AliasMap::default();
        m.insert(0x1000, h(1));
        m.insert(0x2000, h(1));
        m.insert(0x3000, h(2));
        m.check().unwrap();
        let mut of1 = m.of(h(1)).to_vec();
        of1.sort_unstable();
        assert_eq!(of1, vec![0x1000, 0x2000]);
        // An address mapped again forgets its old page.
        m.insert(0x2000, h(2));
        m.check().unwrap();
        assert_eq!(m.of(h(1)), &[0x1000]);
        assert_eq!(m.of(h(2)).len(), 2);
        let mut pages: Vec<PhysHandle> = m.handles().collect();
        pages.sort_unstable();
        assert_eq!(pages, vec![h(1), h(2)], "each page once");
        assert_eq!(m.remove(&0x1000), Some(h(1)));
        assert_eq!(m.remove(&0x1000), None);
        assert!(m.of(h(1)).is_empty());
        m.check().unwrap();
        assert_eq!(m.take_all(), vec![(0x2000, h(2)), (0x3000, h(2))]);
        assert_eq!(m.len(), 0);
        assert!(m.of(h(2)).is_empty());
        m.check().unwrap();
    }
}
