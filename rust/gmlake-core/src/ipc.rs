//! Sharing allocations between processes (CUDA IPC): what one process exports, the bytes that
//! travel, and the mappings another process makes of them.
//!
//! gmlake's memory is physical pages mapped into virtual ranges, so a block is shared as the
//! list of pages under it, each exported as a POSIX file descriptor by the device layer; the
//! receiving process duplicates the descriptors (`pidfd_getfd`), imports each page and maps
//! them contiguously in a range of its own. Stitched blocks travel the same way: their pages
//! come from several places but are mapped in order. This is the layout PyTorch (2.5+) uses
//! for expandable segments, and the bytes are PyTorch's own (`SHAREABLE_HANDLE_VERSION` 2,
//! type `'e'`), so a process running PyTorch's native allocator can open gmlake's handles
//! and gmlake can open the native allocator's.
//!
//! Lifetimes: an imported page holds its own reference on the physical memory, so either side
//! may free first. The exporter's descriptors stay open until it releases the page (the
//! importer may duplicate them at any time before); the importer's mapping lives until
//! [`Imports::close`] and, after it, until the work queued before the close on the closing
//! stream has completed (the close is stream-ordered, see [`Imports::close`]). Whether the exporter may *reuse* a page while another process still
//! reads it is the caller's protocol, as with every CUDA IPC (PyTorch keeps sent blocks alive
//! until the receiver's reference count drops).

use crate::device::{Device, DevicePtr, EventHandle, PhysHandle, StreamId};
use crate::error::{Error, Result};
use std::collections::{BTreeMap, VecDeque};

/// PyTorch's `SHAREABLE_HANDLE_VERSION`.
pub const HANDLE_VERSION: u8 = 2;
/// Handle type of memory from `cudaMalloc` (`SHAREABLE_CUDA_MALLOC`): a `cudaIpcMemHandle_t`.
pub const KIND_CUDA_MALLOC: u8 = b'c';
/// Handle type of page-mapped memory (`SHAREABLE_CUDA_EXPANDABLE_SEGMENT`).
pub const KIND_PAGES: u8 = b'e';
/// `CUDA_IPC_HANDLE_SIZE`.
pub const CUDA_IPC_HANDLE_SIZE: usize = 64;
/// `sizeof(ShareHeader)` on LP64: `{ pid_t pid; /* 4 bytes of zero padding */ size_t
/// segment_size; size_t num_handles; }`.
const HEADER_SIZE: usize = 24;
/// More pages than any device holds (2^20 pages of 2 MiB is 2 TiB): guards against a corrupt
/// count before allocating for it.
const MAX_PAGES: u64 = 1 << 20;

/// The pages under a live allocation, in address order, as [`crate::Allocator::share`]
/// returns them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedPages {
    /// Address of the first page (page aligned; at or below the allocation).
    pub base: DevicePtr,
    /// Offset of the allocation from `base` (PyTorch's `ShareableHandle::offset`).
    pub offset: u64,
    /// Bytes of each page.
    pub page_size: u64,
    pub handles: Vec<PhysHandle>,
}

/// A decoded handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IpcHandle {
    /// A `cudaIpcMemHandle_t` (opened with `cudaIpcOpenMemHandle`).
    CudaMalloc([u8; CUDA_IPC_HANDLE_SIZE]),
    /// Pages of `page_size` bytes, as descriptors of process `pid`, to map contiguously.
    Pages {
        pid: i32,
        page_size: u64,
        fds: Vec<i32>,
    },
}

fn bad(msg: String) -> Error {
    Error::InvalidIpcHandle(msg)
}

/// The bytes of a page handle: version, type, header, one `int` per page (native endianness,
/// as the C structure is written).
pub fn encode_pages(pid: i32, page_size: u64, fds: &[i32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + HEADER_SIZE + 4 * fds.len());
    out.push(HANDLE_VERSION);
    out.push(KIND_PAGES);
    out.extend_from_slice(&pid.to_ne_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&page_size.to_ne_bytes());
    out.extend_from_slice(&(fds.len() as u64).to_ne_bytes());
    for fd in fds {
        out.extend_from_slice(&fd.to_ne_bytes());
    }
    out
}

/// Decodes a handle made by [`encode_pages`] or by PyTorch's allocator. Every malformed input
/// is an [`Error::InvalidIpcHandle`] naming what is wrong.
pub fn decode(bytes: &[u8]) -> Result<IpcHandle> {
    let (&version, rest) = bytes
        .split_first()
        .ok_or_else(|| bad("empty handle".into()))?;
    if version != HANDLE_VERSION {
        return Err(bad(format!(
            "handle version {version}, expected {HANDLE_VERSION} (PyTorch 2.5 or later, or \
             gmlake); was it made by another PyTorch version?"
        )));
    }
    let (&kind, body) = rest
        .split_first()
        .ok_or_else(|| bad("handle ends after its version byte".into()))?;
    match kind {
        KIND_CUDA_MALLOC => {
            let h: [u8; CUDA_IPC_HANDLE_SIZE] = body.try_into().map_err(|_| {
                bad(format!(
                    "cudaMalloc handle of {} bytes, expected {CUDA_IPC_HANDLE_SIZE}",
                    body.len()
                ))
            })?;
            Ok(IpcHandle::CudaMalloc(h))
        }
        KIND_PAGES => {
            if body.len() < HEADER_SIZE {
                return Err(bad(format!(
                    "page handle header of {} bytes, expected {HEADER_SIZE}",
                    body.len()
                )));
            }
            let word = |at: usize| u64::from_ne_bytes(body[at..at + 8].try_into().expect("8"));
            let pid = i32::from_ne_bytes(body[0..4].try_into().expect("4"));
            let (page_size, n) = (word(8), word(16));
            if pid <= 0 {
                return Err(bad(format!("page handle from process id {pid}")));
            }
            if page_size == 0 || !page_size.is_power_of_two() {
                return Err(bad(format!(
                    "page handle with a page size of {page_size} bytes"
                )));
            }
            if n == 0 || n > MAX_PAGES {
                return Err(bad(format!("page handle with {n} pages")));
            }
            let fds_bytes = &body[HEADER_SIZE..];
            if fds_bytes.len() as u64 != 4 * n {
                return Err(bad(format!(
                    "page handle of {n} pages carries {} bytes of descriptors, expected {}",
                    fds_bytes.len(),
                    4 * n
                )));
            }
            let fds: Vec<i32> = fds_bytes
                .chunks_exact(4)
                .map(|c| i32::from_ne_bytes(c.try_into().expect("4")))
                .collect();
            if let Some(fd) = fds.iter().find(|&&fd| fd < 0) {
                return Err(bad(format!("page handle with descriptor {fd}")));
            }
            Ok(IpcHandle::Pages {
                pid,
                page_size,
                fds,
            })
        }
        other => Err(bad(format!(
            "unknown handle type {:?} (expected 'c' or 'e')",
            other as char
        ))),
    }
}

/// One imported range: pages of another process mapped here.
#[derive(Debug)]
struct Import {
    size: u64,
    page_size: u64,
    handles: Vec<PhysHandle>,
}

/// A closed range still mapped until its event completes.
#[derive(Debug)]
struct Closing {
    addr: DevicePtr,
    import: Import,
    /// Recorded on the closing stream at the close.
    event: EventHandle,
}

/// The ranges this process imported on one device, by address.
///
/// Invariant: every entry, open or closing, is a reservation of `handles.len() * page_size`
/// bytes with page `i` mapped (with access) at `addr + i * page_size`, and this registry owns
/// one reference on each handle; nothing else maps into or frees these reservations. A closing
/// entry is unmapped and released only once its event has completed.
#[derive(Debug, Default)]
pub struct Imports {
    ranges: BTreeMap<DevicePtr, Import>,
    /// Closed ranges waiting for their event, in close order.
    closing: VecDeque<Closing>,
    /// Bytes of open and closing ranges (all still mapped).
    bytes: u64,
    /// Events for closes, reused.
    event_pool: Vec<EventHandle>,
}

impl Imports {
    /// Reserves a range and maps `handles` (imported pages of `page_size` bytes, owned by the
    /// caller until this returns) in order, with access for the device and its peers. On
    /// failure everything done is undone and the handles are released: nothing leaks.
    pub fn map<D: Device>(
        &mut self,
        dev: &D,
        handles: Vec<PhysHandle>,
        page_size: u64,
    ) -> Result<DevicePtr> {
        let release_all = |hs: &[PhysHandle]| {
            for &h in hs {
                let _ = dev.release_physical(h);
            }
        };
        if handles.is_empty() {
            return Err(Error::InvalidState("import of no pages".into()));
        }
        let size = handles.len() as u64 * page_size;
        let addr = match dev.reserve_va(size as usize, page_size as usize) {
            Ok(a) => a,
            Err(e) => {
                release_all(&handles);
                return Err(e.into());
            }
        };
        let undo = |mapped: usize, hs: &[PhysHandle]| {
            for i in 0..mapped {
                let _ = dev.unmap(addr + i as u64 * page_size, page_size as usize);
            }
            let _ = dev.free_va(addr, size as usize);
            release_all(hs);
        };
        for (i, &h) in handles.iter().enumerate() {
            if let Err(e) = dev.map(addr + i as u64 * page_size, page_size as usize, h) {
                undo(i, &handles);
                return Err(e.into());
            }
        }
        if let Err(e) = dev.set_access(addr, size as usize) {
            undo(handles.len(), &handles);
            return Err(e.into());
        }
        self.ranges.insert(
            addr,
            Import {
                size,
                page_size,
                handles,
            },
        );
        self.bytes += size;
        Ok(addr)
    }

    /// Closes the range imported at `addr`, ordered on `stream`: an event is recorded there
    /// and the range stays mapped until it completes, i.e. until the work queued on `stream`
    /// before the close no longer reads it. Nothing waits here; the unmap and release happen
    /// in a later [`Imports::process_closing`] (at once if the event has already completed).
    /// Work of other streams is not waited for: a range used there must be ordered before
    /// the close by the caller, as with PyTorch's own IPC deleter (which synchronizes only the
    /// current stream). If the event cannot be recorded the range stays open and the error is
    /// returned.
    pub fn close<D: Device>(&mut self, dev: &D, addr: DevicePtr, stream: StreamId) -> Result<()> {
        if !self.ranges.contains_key(&addr) {
            return Err(Error::UnknownPointer(addr));
        }
        let event = match self.event_pool.pop() {
            Some(e) => e,
            None => dev.create_event()?,
        };
        if let Err(e) = dev.record_event(event, stream) {
            self.event_pool.push(event);
            return Err(e.into());
        }
        let import = self.ranges.remove(&addr).expect("checked above");
        self.closing.push_back(Closing {
            addr,
            import,
            event,
        });
        self.process_closing(dev, false)
    }

    /// Unmaps and releases closed ranges whose events have completed, in close order; with
    /// `wait`, first waits for each remaining event ([`Device::wait_event`]: that stream only),
    /// for shutdown. A range whose event query fails stays queued (and the error is returned).
    pub fn process_closing<D: Device>(&mut self, dev: &D, wait: bool) -> Result<()> {
        let mut first_err: Option<Error> = None;
        let mut i = 0;
        while i < self.closing.len() {
            let event = self.closing[i].event;
            let done = if wait {
                dev.wait_event(event).map(|()| true)
            } else {
                dev.query_event(event)
            };
            match done {
                Ok(true) => {
                    let c = self.closing.remove(i).expect("index in range");
                    self.event_pool.push(c.event);
                    if let Err(e) = self.release(dev, c.addr, c.import) {
                        first_err.get_or_insert(e);
                    }
                }
                Ok(false) => i += 1,
                Err(e) => {
                    first_err.get_or_insert(e.into());
                    i += 1;
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Closed ranges still mapped, waiting for their event.
    pub fn closing(&self) -> usize {
        self.closing.len()
    }

    /// Waits for every closing range and releases it, releases every open range, and destroys
    /// the events (shutdown).
    pub fn shutdown<D: Device>(&mut self, dev: &D) {
        let _ = self.process_closing(dev, true);
        for (addr, imp) in std::mem::take(&mut self.ranges) {
            let _ = self.release(dev, addr, imp);
        }
        for e in self.event_pool.drain(..) {
            let _ = dev.destroy_event(e);
        }
    }

    /// Unmaps and releases one range taken out of the registry.
    fn release<D: Device>(&mut self, dev: &D, addr: DevicePtr, imp: Import) -> Result<()> {
        self.bytes -= imp.size;
        let mut first_err = None;
        for i in 0..imp.handles.len() as u64 {
            if let Err(e) = dev.unmap(addr + i * imp.page_size, imp.page_size as usize) {
                first_err.get_or_insert(e);
            }
        }
        for &h in &imp.handles {
            if let Err(e) = dev.release_physical(h) {
                first_err.get_or_insert(e);
            }
        }
        if let Err(e) = dev.free_va(addr, imp.size as usize) {
            first_err.get_or_insert(e);
        }
        match first_err {
            None => Ok(()),
            Some(e) => Err(e.into()),
        }
    }

    /// Whether `ptr` lies in an open imported range (not one being closed).
    pub fn contains(&self, ptr: DevicePtr) -> bool {
        self.ranges
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&a, imp)| ptr < a + imp.size)
    }

    /// Ranges mapped now, open and closing, as (address, bytes).
    pub fn ranges(&self) -> impl Iterator<Item = (DevicePtr, u64)> + '_ {
        self.ranges
            .iter()
            .map(|(&a, imp)| (a, imp.size))
            .chain(self.closing.iter().map(|c| (c.addr, c.import.size)))
    }

    /// Bytes mapped by imports now (closing ranges included).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Ranges mapped now (closing ranges included).
    pub fn len(&self) -> usize {
        self.ranges.len() + self.closing.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_handles_round_trip_in_pytorchs_layout() {
        let b = encode_pages(4242, 2 << 20, &[7, 9, 11]);
        assert_eq!(b.len(), 2 + 24 + 12);
        assert_eq!(&b[..2], &[2, b'e']);
        assert_eq!(&b[6..10], &[0; 4], "padding after pid is zero");
        assert_eq!(
            decode(&b).unwrap(),
            IpcHandle::Pages {
                pid: 4242,
                page_size: 2 << 20,
                fds: vec![7, 9, 11]
            }
        );
    }

    #[test]
    fn cuda_malloc_handles_decode() {
        let mut b = vec![2, b'c'];
        b.extend((0..64).map(|i| i as u8));
        match decode(&b).unwrap() {
            IpcHandle::CudaMalloc(h) => assert_eq!(h[63], 63),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn malformed_handles_are_named_errors() {
        let good = encode_pages(10, 2 << 20, &[3, 4]);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "empty"),
            (vec![1, b'e'], "version 1"),
            (vec![2], "ends after"),
            (vec![2, b'x'], "unknown handle type"),
            (vec![2, b'c', 0, 0], "expected 64"),
            (good[..20].to_vec(), "header"),
            (good[..good.len() - 1].to_vec(), "descriptors"),
            (encode_pages(0, 2 << 20, &[3]), "process id 0"),
            (encode_pages(10, 3 << 20, &[3]), "page size"),
            (encode_pages(10, 2 << 20, &[]), "0 pages"),
            (encode_pages(10, 2 << 20, &[-1]), "descriptor -1"),
        ];
        for (bytes, what) in cases {
            match decode(&bytes) {
                Err(Error::InvalidIpcHandle(m)) => {
                    assert!(m.contains(what), "{what:?} not in {m:?}")
                }
                other => panic!("{what}: {other:?}"),
            }
        }
    }
}
