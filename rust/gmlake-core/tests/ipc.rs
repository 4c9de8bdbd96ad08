//! Sharing allocations between processes on the simulated device: two allocators over one
//! device play the exporting and the importing process (two processes on one GPU share its
//! physical memory). Checks that the importer maps the exporter's very pages (stitched blocks
//! included), that memory lives until both sides let go whichever frees first, that failed
//! imports leak nothing, and that access is granted again on every mapped range.

use gmlake_core::ipc::{decode, encode_pages, IpcHandle};
use gmlake_core::{Allocator, Config, Error, PhysHandle, SimDevice};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;

type Alloc = Allocator<Arc<SimDevice>>;

fn two_processes(capacity: u64) -> (Arc<SimDevice>, Alloc, Alloc) {
    let dev = Arc::new(SimDevice::new(capacity));
    let a = Allocator::new(dev.clone(), Config::default()).unwrap();
    let b = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, a, b)
}

/// What the exporting process sends: the handle bytes and the offset (as gmlake-ffi does).
fn send(dev: &SimDevice, a: &Alloc, ptr: u64) -> (Vec<u8>, u64) {
    let shared = a.share(ptr).unwrap();
    let fds: Vec<i32> = shared
        .handles
        .iter()
        .map(|&h| dev.export_token(h).unwrap())
        .collect();
    (encode_pages(4242, shared.page_size, &fds), shared.offset)
}

/// What the importing process does with them: decode, import each page, map.
fn receive(dev: &SimDevice, b: &Alloc, bytes: &[u8]) -> Result<u64, Error> {
    let IpcHandle::Pages { page_size, fds, .. } = decode(bytes)? else {
        panic!("not a page handle")
    };
    let mut handles = Vec::new();
    for fd in fds {
        match dev.import_token(fd) {
            Ok(h) => handles.push(h),
            Err(e) => {
                for h in handles {
                    use gmlake_core::Device;
                    dev.release_physical(h).unwrap();
                }
                return Err(e.into());
            }
        }
    }
    b.import_pages(handles, page_size)
}

/// The physical allocation behind each page of [addr, addr + len).
fn allocations(dev: &SimDevice, addr: u64, len: u64) -> Vec<u64> {
    let lo = addr & !(PAGE - 1);
    (lo..addr + len)
        .step_by(PAGE as usize)
        .map(|va| {
            let (h, _) = dev.translate(va).expect("mapped with access");
            dev.allocation_of(h).unwrap()
        })
        .collect()
}

#[test]
fn the_importer_maps_the_exporters_pages() {
    let (dev, a, b) = two_processes(1 << 30);
    let _pad = a.allocate(MIB, 0).unwrap(); // so the shared block starts mid-page
    let x = a.allocate(5 * MIB, 0).unwrap();
    let (bytes, offset) = send(&dev, &a, x);
    assert_eq!(offset, x % PAGE);
    let y = receive(&dev, &b, &bytes).unwrap();
    assert_eq!(y % PAGE, 0);
    assert_eq!(
        allocations(&dev, x, 5 * MIB),
        allocations(&dev, y + offset, 5 * MIB)
    );
    let s = b.stats();
    assert_eq!((s.ipc_imports, s.ipc_imported_bytes), (1, 3 * PAGE));
    assert_eq!(a.stats().ipc_shares, 1);
    // Imported memory is not the importer's: nothing reserved or allocated for it.
    assert_eq!(s.reserved_bytes.aggregate().current, 0);
    b.close_imported(y, 0).unwrap();
    assert_eq!(b.stats().ipc_imported_bytes, 0);
    a.verify().unwrap();
    b.verify().unwrap();
}

#[test]
fn a_stitched_block_is_shared_page_by_page_in_order() {
    let (dev, a, b) = two_processes(1 << 30);
    let ptrs: Vec<u64> = (0..10).map(|_| a.allocate(10 * MIB, 0).unwrap()).collect();
    for p in ptrs.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    let big = a.allocate(40 * MIB, 0).unwrap();
    assert!(a.stats().stitches >= 1);
    let (bytes, offset) = send(&dev, &a, big);
    let y = receive(&dev, &b, &bytes).unwrap();
    let want = allocations(&dev, big, 40 * MIB);
    let distinct: std::collections::BTreeSet<_> = want.iter().collect();
    assert_eq!(distinct.len(), want.len(), "one allocation a page");
    assert_eq!(allocations(&dev, y + offset, 40 * MIB), want);
}

#[test]
fn memory_lives_until_both_sides_let_go_exporter_first() {
    let (dev, a, b) = two_processes(1 << 30);
    let x = a.allocate(4 * MIB, 0).unwrap();
    let (bytes, _) = send(&dev, &a, x);
    let y = receive(&dev, &b, &bytes).unwrap();
    let pages = allocations(&dev, y, 4 * MIB);
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.aggregate().current, 0);
    // The exporter gave its pages back; the importer's references keep them.
    assert_eq!(dev.physical_bytes(), 4 * MIB);
    assert_eq!(allocations(&dev, y, 4 * MIB), pages);
    // Another allocation of the exporter gets other memory.
    let z = a.allocate(4 * MIB, 0).unwrap();
    assert!(allocations(&dev, z, 4 * MIB)
        .iter()
        .all(|p| !pages.contains(p)));
    // Tokens of released pages cannot be imported any more.
    assert!(receive(&dev, &b, &bytes).is_err());
    b.close_imported(y, 0).unwrap();
    a.free(z).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
    assert_eq!(dev.live_mappings(), 0);
}

#[test]
fn memory_lives_until_both_sides_let_go_importer_first() {
    let (dev, a, b) = two_processes(1 << 30);
    let x = a.allocate(4 * MIB, 0).unwrap();
    let (bytes, _) = send(&dev, &a, x);
    let y = receive(&dev, &b, &bytes).unwrap();
    b.close_imported(y, 0).unwrap();
    assert_eq!(dev.physical_bytes(), 4 * MIB);
    assert!(
        dev.translate(x).is_some(),
        "the exporter's block is untouched"
    );
    assert_eq!(b.close_imported(y, 0), Err(Error::UnknownPointer(y)));
    // The same handle can be opened again while the exporter holds the block.
    let y2 = receive(&dev, &b, &bytes).unwrap();
    b.close_imported(y2, 0).unwrap();
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
    assert_eq!(dev.live_handles(), 0);
    assert_eq!(dev.live_reservations(), 0);
}

#[test]
fn failed_imports_leak_nothing() {
    let (dev, a, b) = two_processes(1 << 30);
    let x = a.allocate(4 * MIB, 0).unwrap();
    let shared = a.share(x).unwrap();
    let before = (
        dev.live_handles(),
        dev.live_mappings(),
        dev.live_reservations(),
    );
    // A page size the pages do not have: map fails half way; all is undone and released.
    let imported: Vec<PhysHandle> = shared
        .handles
        .iter()
        .map(|&h| dev.import_token(dev.export_token(h).unwrap()).unwrap())
        .collect();
    assert!(b.import_pages(imported, 2 * PAGE).is_err());
    assert_eq!(
        (
            dev.live_handles(),
            dev.live_mappings(),
            dev.live_reservations()
        ),
        before
    );
    // An unknown descriptor.
    let bad = encode_pages(1, PAGE, &[999]);
    assert!(receive(&dev, &b, &bad).is_err());
    // Sharing what gmlake did not allocate, or a freed block.
    assert_eq!(a.share(0x1234), Err(Error::UnknownPointer(0x1234)));
    a.free(x).unwrap();
    assert!(matches!(a.share(x), Err(Error::UnknownPointer(_))));
    assert_eq!(b.stats().ipc_imports, 0);
}

#[test]
fn an_interior_pointer_shares_its_whole_block() {
    let (dev, a, b) = two_processes(1 << 30);
    let x = a.allocate(6 * MIB, 0).unwrap();
    let inner = x + 3 * MIB + 512;
    let shared = a.share(inner).unwrap();
    assert_eq!(shared.base, x & !(PAGE - 1));
    assert_eq!(shared.offset, inner - shared.base);
    assert_eq!(shared.handles.len(), 3);
    let (bytes, off) = send(&dev, &a, inner);
    let y = receive(&dev, &b, &bytes).unwrap();
    assert_eq!(
        allocations(&dev, y + off, 1)[0],
        allocations(&dev, inner, 1)[0]
    );
}

#[test]
fn regranting_access_covers_blocks_retired_ranges_and_imports() {
    // Asynchronous device: retired ranges stay mapped until their event completes.
    let dev = Arc::new(SimDevice::new(1 << 30).asynchronous());
    let no_aliases = Config {
        max_aliases: 0.0,
        ..Config::default()
    };
    let a = Allocator::new(dev.clone(), no_aliases).unwrap();
    let b = Allocator::new(dev.clone(), Config::default()).unwrap();
    let ptrs: Vec<u64> = (0..10).map(|_| a.allocate(10 * MIB, 0).unwrap()).collect();
    for p in ptrs.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    let _big = a.allocate(40 * MIB, 0).unwrap();
    assert!(a.stats().retired_bytes > 0, "{:?}", a.stats());
    let (bytes, _) = send(&dev, &a, ptrs[1]);
    let _y = receive(&dev, &b, &bytes).unwrap();
    // The simulated device checks that each range is exactly covered by mappings.
    let calls = dev.calls().set_access;
    a.regrant_access().unwrap();
    b.regrant_access().unwrap();
    assert!(dev.calls().set_access >= calls + 3);
    a.verify().unwrap();
    // Kept aliases (lent ranges) are granted again too.
    let c = Allocator::new(dev.clone(), Config::default()).unwrap();
    let ptrs: Vec<u64> = (0..10).map(|_| c.allocate(10 * MIB, 0).unwrap()).collect();
    for p in ptrs.iter().step_by(2) {
        c.free(*p).unwrap();
    }
    let _big = c.allocate(40 * MIB, 0).unwrap();
    assert!(c.stats().aliased_bytes > 0, "{:?}", c.stats());
    c.regrant_access().unwrap();
    c.verify().unwrap();
}

// ---- Closing is stream-ordered (issue 20) ---------------------------------------------------

/// Exporter and importer over one asynchronous device: events stay pending until the work of
/// their stream is completed explicitly.
fn two_processes_async(capacity: u64) -> (Arc<SimDevice>, Alloc, Alloc) {
    let dev = Arc::new(SimDevice::new(capacity).asynchronous());
    let a = Allocator::new(dev.clone(), Config::default()).unwrap();
    let b = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, a, b)
}

#[test]
fn closing_an_import_keeps_it_mapped_until_its_stream_is_past_the_close() {
    let (dev, a, b) = two_processes_async(1 << 30);
    let x = a.allocate(5 * MIB, 0).unwrap();
    let (bytes, offset) = send(&dev, &a, x);
    let y = receive(&dev, &b, &bytes).unwrap();
    // The receiver's kernel reads the tensor on stream 7; a long kernel of its own runs on
    // stream 9 (unrelated memory).
    dev.fill(y + offset, 4 * MIB, 1, 7).unwrap();
    let own = b.allocate(MIB, 9).unwrap();
    dev.fill(own, MIB, 2, 9).unwrap();
    let mapped = dev.live_mappings();
    let syncs = dev.calls().synchronize;

    b.close_imported(y, 7).unwrap();
    assert_eq!(
        dev.calls().synchronize,
        syncs,
        "the close waited for the device"
    );
    assert!(
        dev.translate(y).is_some(),
        "unmapped with stream 7's work queued"
    );
    assert_eq!(dev.live_mappings(), mapped);
    // Still mapped across later calls while stream 7 is busy; closed for new users.
    let s = b.stats();
    assert_eq!((s.ipc_imports, s.ipc_imported_bytes), (1, 6 * MIB));
    let t = b.allocate(MIB, 0).unwrap();
    b.free(t).unwrap();
    assert!(dev.translate(y).is_some());
    assert_eq!(b.close_imported(y, 7), Err(Error::UnknownPointer(y)));

    // Stream 7 finishes (stream 9 is still busy): the next call releases the range.
    dev.complete_stream(7);
    assert!(
        dev.translate(y).is_some(),
        "released only by an allocator call"
    );
    let before = dev.live_mappings();
    b.process_closed_imports();
    assert!(dev.translate(y).is_none(), "never released");
    assert_eq!(dev.live_mappings(), before - 3);
    let s = b.stats();
    assert_eq!((s.ipc_imports, s.ipc_imported_bytes), (0, 0));
    assert_eq!(dev.queued_ops(), 1, "stream 9 was not waited for");
    assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
    // The exporter's memory is untouched.
    assert!(dev.translate(x).is_some());
    dev.complete_all();
}

#[test]
fn a_closed_import_is_released_by_the_next_allocation_free_or_import() {
    let (dev, a, b) = two_processes_async(1 << 30);
    let x = a.allocate(4 * MIB, 0).unwrap();
    let (bytes, _) = send(&dev, &a, x);
    for (i, call) in ["allocate", "free", "import", "empty_cache"]
        .iter()
        .enumerate()
    {
        let y = receive(&dev, &b, &bytes).unwrap();
        dev.fill(y, 2 * MIB, i as u64, 3).unwrap();
        let t = b.allocate(MIB, 0).unwrap();
        b.close_imported(y, 3).unwrap();
        assert!(dev.translate(y).is_some(), "{call}");
        dev.complete_stream(3);
        match *call {
            "allocate" => {
                let u = b.allocate(MIB, 0).unwrap();
                b.free(u).unwrap();
                b.free(t).unwrap();
            }
            "free" => b.free(t).unwrap(),
            "import" => {
                let z = receive(&dev, &b, &bytes).unwrap();
                assert!(dev.translate(y).is_none(), "{call}");
                b.close_imported(z, 3).unwrap();
                b.free(t).unwrap();
            }
            _ => {
                b.free(t).unwrap();
                dev.complete_all();
                b.empty_cache().unwrap();
            }
        }
        assert!(dev.translate(y).is_none(), "{call}: never released");
    }
    dev.complete_all();
    b.process_closed_imports();
    assert_eq!(b.stats().ipc_imports, 0);
    assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
}

#[test]
fn dropping_the_importer_waits_for_its_closing_streams_only_and_releases_everything() {
    let (dev, a, b) = two_processes_async(1 << 30);
    let x = a.allocate(4 * MIB, 0).unwrap();
    let (bytes, _) = send(&dev, &a, x);
    let y1 = receive(&dev, &b, &bytes).unwrap();
    let y2 = receive(&dev, &b, &bytes).unwrap();
    dev.fill(y1, 2 * MIB, 1, 4).unwrap();
    let other = a.allocate(2 * MIB, 8).unwrap();
    dev.fill(other, 2 * MIB, 2, 8).unwrap(); // the exporter's own work, another stream
    b.close_imported(y1, 4).unwrap();
    drop(b); // y1 closing, y2 still open
    assert!(dev.translate(y1).is_none() && dev.translate(y2).is_none());
    assert_eq!(dev.queued_ops(), 1, "stream 8 was not waited for");
    assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
    dev.complete_all();
    a.free(x).unwrap();
    a.free(other).unwrap();
    dev.complete_all();
    a.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
    assert_eq!(dev.live_reservations(), 0);
}

#[test]
fn a_close_that_cannot_record_its_event_keeps_the_range_open() {
    let (dev, a, b) = two_processes(1 << 30);
    let x = a.allocate(2 * MIB, 0).unwrap();
    let (bytes, _) = send(&dev, &a, x);
    let y = receive(&dev, &b, &bytes).unwrap();
    // The simulated device records on any stream; an unknown pointer is the failure here.
    assert_eq!(
        b.close_imported(y + PAGE, 0),
        Err(Error::UnknownPointer(y + PAGE))
    );
    assert!(dev.translate(y).is_some());
    b.close_imported(y, 0).unwrap();
    assert!(
        dev.translate(y).is_none(),
        "synchronous device: released at once"
    );
}

mod closing_properties {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        /// Opens (or re-opens) import `k` of the exporter's blocks.
        Import(usize),
        /// Queues a kernel on import `k`'s stream reading through it.
        Use(usize),
        /// Closes import `k` on its stream.
        Close(usize),
        /// Completes the work of stream `s`.
        Complete(u64),
        /// A later allocator call of the importer (0 allocate+free, 1 stats, 2 process).
        Call(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..4usize).prop_map(Op::Import),
            (0..4usize).prop_map(Op::Use),
            (0..4usize).prop_map(Op::Close),
            (1..4u64).prop_map(Op::Complete),
            (0..3u8).prop_map(Op::Call),
        ]
    }

    /// Import `k` is used and closed on stream `k % 3 + 1`.
    fn stream_of(k: usize) -> u64 {
        k as u64 % 3 + 1
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("GMLAKE_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]

        /// A closed import stays mapped while work of its stream queued before the close may
        /// still read it (the device flags any unmap under such work), and is released by the
        /// first allocator call after that stream has completed; at the end nothing is left.
        #[test]
        fn closes_are_released_after_their_stream_and_never_before(
            ops in proptest::collection::vec(op(), 1..60)
        ) {
            let (dev, a, b) = two_processes_async(1 << 30);
            let blocks: Vec<u64> = (0..4).map(|i| a.allocate((i + 1) * MIB, 0).unwrap()).collect();
            let sent: Vec<(Vec<u8>, u64)> = blocks.iter().map(|&x| send(&dev, &a, x)).collect();
            let mut open: Vec<Option<u64>> = vec![None; 4];
            // Closed ranges: (address, stream, whether the stream completed since the close).
            let mut closed: Vec<(u64, u64, bool)> = Vec::new();
            for op in ops {
                match op {
                    Op::Import(k) => {
                        if open[k].is_none() {
                            open[k] = Some(receive(&dev, &b, &sent[k].0).unwrap());
                        }
                    }
                    Op::Use(k) => {
                        if let Some(y) = open[k] {
                            dev.fill(y + sent[k].1, MIB, k as u64, stream_of(k)).unwrap();
                        }
                    }
                    Op::Close(k) => {
                        if let Some(y) = open[k].take() {
                            b.close_imported(y, stream_of(k)).unwrap();
                            closed.push((y, stream_of(k), false));
                        }
                    }
                    Op::Complete(s) => {
                        dev.complete_stream(s);
                        for c in closed.iter_mut().filter(|c| c.1 == s) {
                            c.2 = true;
                        }
                    }
                    Op::Call(kind) => {
                        match kind {
                            0 => {
                                let t = b.allocate(MIB, 0).unwrap();
                                b.free(t).unwrap();
                            }
                            1 => {
                                b.stats();
                            }
                            _ => b.process_closed_imports(),
                        }
                        for &(y, s, done) in &closed {
                            prop_assert_eq!(
                                dev.translate(y).is_none(), done,
                                "range {:#x} closed on stream {}", y, s
                            );
                        }
                        closed.retain(|c| !c.2);
                    }
                }
                prop_assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
                let s = b.stats();
                let live = open.iter().flatten().count() + closed.iter().filter(|c| !c.2).count();
                prop_assert!(s.ipc_imports as usize >= live);
            }
            for (k, slot) in open.iter_mut().enumerate() {
                if let Some(y) = slot.take() {
                    b.close_imported(y, stream_of(k)).unwrap();
                }
            }
            dev.complete_all();
            b.process_closed_imports();
            prop_assert_eq!(b.stats().ipc_imports, 0);
            prop_assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
            drop(b);
            for x in blocks {
                a.free(x).unwrap();
            }
            dev.complete_all();
            a.empty_cache().unwrap();
            prop_assert_eq!(dev.physical_bytes(), 0);
            prop_assert_eq!(dev.live_mappings(), 0);
        }
    }
}

/// After a page-size upgrade (`page_upgrade_at`), blocks of either generation are shared with
/// their own page size: the importer maps the exporter's pages at the size they have.
#[test]
fn blocks_of_both_page_generations_are_shared_at_their_page_size() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let cfg = Config {
        page_upgrade_at: Some(8 * MIB),
        page_upgrade_size: 4 * PAGE,
        page_upgrade_remap: 0.0,
        ..Config::default()
    };
    let a = Allocator::new(dev.clone(), cfg).unwrap();
    let b = Allocator::new(dev.clone(), Config::default()).unwrap();
    let old = a.allocate(8 * MIB, 0).unwrap();
    let new = a.allocate(20 * MIB, 0).unwrap();
    assert_eq!(a.page_size(), 8 * MIB);
    for (ptr, len, page) in [(old, 8 * MIB, PAGE), (new, 20 * MIB, 8 * MIB)] {
        let shared = a.share(ptr).unwrap();
        assert_eq!(shared.page_size, page);
        assert_eq!(shared.handles.len() as u64, len.div_ceil(page));
        dev.fill(ptr, len, ptr, 0).unwrap();
        let (bytes, offset) = send(&dev, &a, ptr);
        let base = receive(&dev, &b, &bytes).unwrap();
        assert_eq!(
            dev.checksum(base + offset, len).unwrap(),
            dev.checksum(ptr, len).unwrap()
        );
        b.close_imported(base + offset, 0).unwrap();
    }
    a.free(old).unwrap();
    a.free(new).unwrap();
    a.verify().unwrap();
    a.empty_cache().unwrap();
    b.process_closed_imports();
    assert_eq!(dev.physical_bytes(), 0);
}
