//! The free mapped blocks of an arena that lie in runs with no live block, kept as blocks
//! change rather than recounted at every `stats()`.
//!
//! PyTorch's `inactive_split` counts only the free blocks that share their segment with an
//! active block; here a segment is a maximal run of mapped blocks (live, free mapped, quick)
//! of one chunk. A run with no live block is cached memory, not a split one, so its free
//! blocks (the *whole free* blocks) are subtracted from the free mapped totals. Recounting
//! them walked every block of every arena at each `stats()` (249 µs a call with 10k live
//! blocks), and `torch.cuda.memory_allocated()` reads the statistics. Instead the arena
//! notes the address of every block it inserts or removes (`touched`), and `settle` walks
//! only the runs around those addresses.
//!
//! Invariant (checked by `Allocator::verify` against a recount): once settled and `known`,
//! `whole` holds exactly the whole free blocks (address -> size) and `bytes` their sizes'
//! sum. Walking from a touched address costs a few tree lookups, a recount about one step of
//! an in-order walk per block (30-40x less a block, measured on the random mixed pattern),
//! so once more blocks were touched than a 32nd of the arena's blocks (`limit`, set at each
//! settle; at most `MAX_TOUCHED`) what is kept is dropped: the arena stops noting changes,
//! and the next settle recounts every block, as a job that reads its statistics rarely would
//! anyway. The hot path thus pays a push per changed block between two close reads, and
//! nothing once it has stopped noting.
//!
//! Why walking from the touched blocks is enough: a free block's status changes only with its
//! run. If it became whole, a live block left the run: it was freed (touched, now a free block
//! of the run) or a breaker split it off (touched, at the run's end); the run has no live block
//! now, so a walk from there reaches every block of it (a touched breaker's settle walks the
//! runs on both of its sides). If it stopped being whole, take the live block of its run
//! nearest to it on one side: either that block is new (touched), or it was in another run
//! before and some block between the two (a breaker that became mapped) was touched; either way
//! a touched block has no live block between it and the free one. So a walk that goes both ways
//! from each touched block and stops at the first live block (or the run's end) on each side
//! sees every block whose status may have changed.

use rustc_hash::FxHashMap;

/// The most changes noted before what is kept is dropped (the next settle then recounts).
const MAX_TOUCHED: usize = 1 << 16;

/// The fewest: below it a recount of a small arena is as cheap anyway.
const MIN_TOUCHED: usize = 64;

#[derive(Default, Clone)]
pub(crate) struct FreeRuns {
    /// The whole free blocks: address -> size.
    whole: FxHashMap<u64, u64>,
    bytes: u64,
    /// Addresses of blocks inserted or removed since the last settle.
    touched: Vec<u64>,
    /// Whether `whole` is kept up to date (else the next settle recounts).
    known: bool,
    /// Changes noted before what is kept is dropped.
    limit: usize,
}

impl FreeRuns {
    /// A block was inserted or removed at `addr`.
    pub fn touch(&mut self, addr: u64) {
        if !self.known {
            return;
        }
        if self.touched.len() >= self.limit {
            self.forget();
        } else {
            self.touched.push(addr);
        }
    }

    /// A free mapped or quick block at `addr` was removed.
    pub fn remove_free(&mut self, addr: u64) {
        if self.known {
            if let Some(size) = self.whole.remove(&addr) {
                self.bytes -= size;
            }
        }
        self.touch(addr);
    }

    fn forget(&mut self) {
        self.known = false;
        self.whole = FxHashMap::default();
        self.bytes = 0;
        self.touched = Vec::new();
    }

    /// Whether what is kept is up to date but for the touched addresses.
    pub fn known(&self) -> bool {
        self.known
    }

    /// The touched addresses, sorted and each once, emptied.
    pub fn take_touched(&mut self) -> Vec<u64> {
        let mut t = std::mem::take(&mut self.touched);
        t.sort_unstable();
        t.dedup();
        t
    }

    /// After a settle: an arena of `blocks` blocks notes up to a 32nd of them before it drops
    /// what is kept (a recount is then cheaper than walking from each change).
    pub fn set_limit(&mut self, blocks: usize) {
        self.limit = (blocks / 32).clamp(MIN_TOUCHED, MAX_TOUCHED);
    }

    /// Starts a recount: nothing kept, changes noted from now on.
    pub fn restart(&mut self) {
        self.whole.clear();
        self.bytes = 0;
        self.touched.clear();
        self.known = true;
    }

    /// The free block at `addr` of `size` bytes is whole free (`whole`) or not.
    pub fn set(&mut self, addr: u64, size: u64, whole: bool) {
        if whole {
            if let Some(old) = self.whole.insert(addr, size) {
                self.bytes -= old;
            }
            self.bytes += size;
        } else if let Some(old) = self.whole.remove(&addr) {
            self.bytes -= old;
        }
    }

    /// (count, bytes) of the whole free blocks. Valid once settled.
    pub fn totals(&self) -> (u64, u64) {
        (self.whole.len() as u64, self.bytes)
    }

    /// The whole free blocks, by address. Valid once settled.
    pub fn blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.whole.iter().map(|(&a, &s)| (a, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_totals_and_forgets_past_the_bound() {
        let mut r = FreeRuns::default();
        assert!(!r.known(), "nothing kept before the first recount");
        r.touch(1);
        assert!(
            r.take_touched().is_empty(),
            "changes are not noted while unknown"
        );
        r.set_limit(1 << 20);
        r.restart();
        r.set(0x1000, 512, true);
        r.set(0x2000, 1024, true);
        r.set(0x1000, 2048, true);
        assert_eq!(r.totals(), (2, 3072));
        r.set(0x2000, 1024, false);
        assert_eq!(r.totals(), (1, 2048));
        r.remove_free(0x1000);
        assert_eq!(r.totals(), (0, 0));
        r.touch(5);
        r.touch(3);
        r.touch(5);
        assert_eq!(r.take_touched(), vec![3, 5, 0x1000], "sorted, each once");
        assert!(r.take_touched().is_empty(), "emptied");
        r.set_limit(0);
        for i in 0..MIN_TOUCHED as u64 + 1 {
            r.touch(i);
        }
        assert!(
            !r.known(),
            "too many changes without a settle drop what is kept"
        );
        assert_eq!(r.totals(), (0, 0));
    }
}
