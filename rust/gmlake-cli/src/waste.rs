//! Where the memory an allocator holds but does not use sits (`gmlake replay
//! --waste-at-peak`): the free blocks of its mapped runs by their place in the run, and the
//! pages it holds unmapped, read from a memory snapshot at the replay's peak of reserved
//! memory.
//!
//! Why by place: the concatenation job's 0.92 (issue 13) is free space stranded in partly
//! used pages, mostly at the end of a stitched run after its one live block (a tail, the room
//! a growing cache would grow into). Tails, gaps between live blocks and whole free runs call
//! for different remedies (sharing edge pages, placement, returning memory), so the report
//! says how much of each there is, for any trace, instead of a hand-made dump.

use gmlake_core::{BlockState, Snapshot};

/// Bytes of the held memory by what they are. `active + tails + heads + between +
/// free_runs + pending + unmapped == reserved`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Waste {
    /// Physical bytes held (the device's figure).
    pub reserved: u64,
    /// Live blocks' bytes (as the allocator rounds them).
    pub active: u64,
    /// Free blocks after the last live block of a mapped run.
    pub tails: u64,
    /// How many runs hold such a tail: with `tails`, whether the loss is many partly used
    /// last pages (each under a page: the room growing blocks grow into) or a few large ones.
    pub tail_runs: u64,
    /// Free blocks before the first live block of a run.
    pub heads: u64,
    /// Free blocks with live blocks on both sides in their run.
    pub between: u64,
    /// Runs with no live block at all.
    pub free_runs: u64,
    /// Blocks freed but waiting for other streams' work (`record_stream`).
    pub pending: u64,
    /// Held, mapped nowhere: spare pages, pages retired until their event.
    pub unmapped: u64,
}

impl Waste {
    /// The breakdown of `snap` for a device holding `reserved` bytes.
    pub fn of(snap: &Snapshot, reserved: u64) -> Waste {
        let mut w = Waste {
            reserved,
            ..Waste::default()
        };
        let mut mapped = 0u64;
        for seg in &snap.segments {
            mapped += seg.total_size;
            let live = |s: BlockState| s == BlockState::ActiveAllocated;
            let first = seg.blocks.iter().position(|b| live(b.state));
            let last = seg.blocks.iter().rposition(|b| live(b.state));
            let mut has_tail = false;
            for (i, b) in seg.blocks.iter().enumerate() {
                let place = match b.state {
                    BlockState::ActiveAllocated => &mut w.active,
                    BlockState::ActivePendingFree => &mut w.pending,
                    _ => match (first, last) {
                        (Some(f), _) if i < f => &mut w.heads,
                        (_, Some(l)) if i > l => {
                            has_tail = true;
                            &mut w.tails
                        }
                        (Some(_), Some(_)) => &mut w.between,
                        _ => &mut w.free_runs,
                    },
                };
                *place += b.size;
            }
            w.tail_runs += u64::from(has_tail);
        }
        w.unmapped = reserved.saturating_sub(mapped);
        w
    }

    /// One line for the table output.
    pub fn line(&self) -> String {
        let b = crate::report::bytes;
        format!(
            "reserved {} = active {} + free after the last live block of a run {} (in {} runs) + before the first {} + between live blocks {} + whole free runs {} + pending frees {} + held unmapped {}",
            b(self.reserved),
            b(self.active),
            b(self.tails),
            self.tail_runs,
            b(self.heads),
            b(self.between),
            b(self.free_runs),
            b(self.pending),
            b(self.unmapped),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gmlake_core::{Allocator, Config, SimDevice};

    const M: u64 = 1 << 20;

    /// A 3 MiB block takes two 2 MiB pages and leaves a 1 MiB tail; a second run holds a
    /// block between two free ones once its neighbours are freed; the parts add up.
    #[test]
    fn the_held_memory_splits_by_place_and_adds_up() {
        let a = Allocator::new(SimDevice::new(1 << 40), Config::default()).unwrap();
        let _p = a.allocate(3 * M, 0).unwrap();
        let w = Waste::of(&a.snapshot(), a.device().physical_bytes());
        assert_eq!((w.reserved, w.active, w.tails), (4 * M, 3 * M, M), "{w:?}");
        assert_eq!(w.tail_runs, 1, "{w:?}");
        assert_eq!(
            w.heads + w.between + w.free_runs + w.pending + w.unmapped,
            0
        );

        // Three blocks in one new run; freeing the outer two leaves a head and a tail around
        // the middle one, and freeing a block between two live ones leaves a gap.
        let b = Allocator::new(SimDevice::new(1 << 40), Config::default()).unwrap();
        let x = b.allocate(16 * M, 0).unwrap();
        b.free(x).unwrap();
        let p: Vec<u64> = (0..4).map(|_| b.allocate(4 * M, 0).unwrap()).collect();
        b.free(p[0]).unwrap();
        b.free(p[2]).unwrap();
        let w = Waste::of(&b.snapshot(), b.device().physical_bytes());
        assert_eq!(w.active, 8 * M, "{w:?}");
        assert_eq!(w.heads, 4 * M, "{w:?}");
        assert_eq!(w.between, 4 * M, "{w:?}");
        assert_eq!((w.tails, w.tail_runs), (0, 0), "{w:?}");
        assert_eq!(
            w.active + w.tails + w.heads + w.between + w.free_runs + w.pending + w.unmapped,
            w.reserved,
            "{w:?}"
        );
        b.free(p[1]).unwrap();
        b.free(p[3]).unwrap();
        let w = Waste::of(&b.snapshot(), b.device().physical_bytes());
        assert_eq!((w.active, w.free_runs), (0, 16 * M), "{w:?}");
        assert_eq!((w.tails, w.tail_runs), (0, 0), "{w:?}");
    }
}
