//! A simulated device: host-side bookkeeping that enforces the CUDA driver's virtual memory
//! rules (see [`crate::device`]) and counts every call by kind. Used by the tests and by trace
//! replay; nothing is ever read or written through its addresses.

use crate::device::{
    Device, DeviceError, DevicePtr, DeviceResult, EventHandle, PhysHandle, StreamId,
};
use crate::stats::DriverCalls;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// Where the simulated address space starts (a typical CUDA VA, so traces look familiar).
const VA_BASE: u64 = 0x7f00_0000_0000;
/// How much virtual address space the simulated device has (as a 47-bit GPU VA space).
const VA_LIMIT: u64 = VA_BASE + (1 << 46);

#[derive(Debug)]
struct Handle {
    size: u64,
    mappings: u32,
    /// The physical allocation behind the handle: imported handles share their exporter's.
    alloc: u64,
}

#[derive(Debug, Default)]
struct SimState {
    next_handle: u64,
    handles: FxHashMap<u64, Handle>,
    /// allocation -> handles referring to it (created or imported); freed at 0.
    alloc_refs: FxHashMap<u64, u32>,
    /// Exported "descriptors" -> the handle they were exported from (valid until it is
    /// released, as gmlake-cuda closes a page's descriptor when it releases the page).
    exports: FxHashMap<i32, u64>,
    next_export: i32,
    physical_bytes: u64,
    /// start -> size
    reservations: BTreeMap<u64, u64>,
    next_va: u64,
    /// start -> (size, handle, access granted)
    mappings: BTreeMap<u64, (u64, u64, bool)>,
    next_event: u64,
    /// event -> pending (recorded, not yet completed)
    events: FxHashMap<u64, bool>,
    calls: DriverCalls,
}

/// A simulated GPU with a fixed capacity and page granularity.
#[derive(Debug)]
pub struct SimDevice {
    capacity: u64,
    granularity: u64,
    /// When true, recorded events stay pending until [`SimDevice::complete_all`] or
    /// `synchronize`, modelling kernels still in flight.
    asynchronous: bool,
    state: Mutex<SimState>,
}

fn invalid<T>(msg: String) -> DeviceResult<T> {
    Err(DeviceError::InvalidArgument(msg))
}

impl SimDevice {
    /// A device of `capacity` bytes with 2 MiB pages, whose events complete at once.
    pub fn new(capacity: u64) -> SimDevice {
        SimDevice::with_granularity(capacity, 2 << 20)
    }

    pub fn with_granularity(capacity: u64, granularity: u64) -> SimDevice {
        assert!(
            granularity.is_power_of_two(),
            "granularity must be a power of two"
        );
        SimDevice {
            capacity,
            granularity,
            asynchronous: false,
            state: Mutex::new(SimState {
                next_va: VA_BASE,
                next_handle: 1,
                next_event: 1,
                ..SimState::default()
            }),
        }
    }

    /// Events recorded from now on stay pending until completed explicitly.
    pub fn asynchronous(mut self) -> SimDevice {
        self.asynchronous = true;
        self
    }

    /// Completes every pending event (all queued work has finished).
    pub fn complete_all(&self) {
        self.state
            .lock()
            .events
            .values_mut()
            .for_each(|p| *p = false);
    }

    /// Calls made so far, by kind.
    pub fn calls(&self) -> DriverCalls {
        self.state.lock().calls
    }

    /// Bytes of physical memory currently created.
    pub fn physical_bytes(&self) -> u64 {
        self.state.lock().physical_bytes
    }

    /// Number of physical handles currently created.
    pub fn live_handles(&self) -> usize {
        self.state.lock().handles.len()
    }

    /// Number of mappings currently in place.
    pub fn live_mappings(&self) -> usize {
        self.state.lock().mappings.len()
    }

    /// Number of virtual reservations currently held.
    pub fn live_reservations(&self) -> usize {
        self.state.lock().reservations.len()
    }

    /// Number of events currently created.
    pub fn live_events(&self) -> usize {
        self.state.lock().events.len()
    }

    /// Exports a handle for another process as a descriptor-like token, valid until the
    /// handle is released (several exports of one handle give the same token), like
    /// `cuMemExportToShareableHandle` with the descriptor cached per page.
    pub fn export_token(&self, handle: PhysHandle) -> DeviceResult<i32> {
        let mut st = self.state.lock();
        if !st.handles.contains_key(&handle.0) {
            return invalid(format!("export of unknown handle {}", handle.0));
        }
        if let Some((&t, _)) = st.exports.iter().find(|(_, &h)| h == handle.0) {
            return Ok(t);
        }
        st.next_export += 1;
        let t = st.next_export + 2; // past stdin/stdout/stderr, as a real descriptor would be
        st.exports.insert(t, handle.0);
        Ok(t)
    }

    /// Imports a token made by [`SimDevice::export_token`] as a new handle to the same
    /// physical allocation (`cuMemImportFromShareableHandle`): the memory lives until every
    /// handle to it is released.
    pub fn import_token(&self, token: i32) -> DeviceResult<PhysHandle> {
        let mut st = self.state.lock();
        let Some(&from) = st.exports.get(&token) else {
            return invalid(format!(
                "import of descriptor {token}: not exported, or its page was released"
            ));
        };
        let (size, alloc) = {
            let h = &st.handles[&from];
            (h.size, h.alloc)
        };
        let id = st.new_handle(size, Some(alloc));
        *st.alloc_refs
            .get_mut(&alloc)
            .expect("allocation of a live handle") += 1;
        Ok(PhysHandle(id))
    }

    /// The physical allocation behind a handle (equal for an exported handle and its imports).
    pub fn allocation_of(&self, handle: PhysHandle) -> Option<u64> {
        self.state.lock().handles.get(&handle.0).map(|h| h.alloc)
    }

    /// The physical handle and offset behind a virtual address, if it is mapped with access.
    pub fn translate(&self, addr: DevicePtr) -> Option<(PhysHandle, u64)> {
        let st = self.state.lock();
        let (&start, &(size, handle, access)) = st.mappings.range(..=addr).next_back()?;
        (addr < start + size && access).then_some((PhysHandle(handle), addr - start))
    }

    fn check_aligned(&self, what: &str, v: u64) -> DeviceResult<()> {
        if !v.is_multiple_of(self.granularity) {
            return invalid(format!(
                "{what} {v:#x} is not a multiple of the granularity {:#x}",
                self.granularity
            ));
        }
        Ok(())
    }
}

impl SimState {
    /// A new handle of `size` bytes to allocation `alloc` (None: a new allocation, whose id
    /// is the handle's).
    fn new_handle(&mut self, size: u64, alloc: Option<u64>) -> u64 {
        let id = self.next_handle;
        self.next_handle += 1;
        let alloc = alloc.unwrap_or(id);
        self.handles.insert(
            id,
            Handle {
                size,
                mappings: 0,
                alloc,
            },
        );
        id
    }

    fn reservation_containing(&self, addr: u64, size: u64) -> Option<(u64, u64)> {
        let (&s, &len) = self.reservations.range(..=addr).next_back()?;
        (addr + size <= s + len).then_some((s, len))
    }
}

impl Device for SimDevice {
    fn granularity(&self) -> DeviceResult<usize> {
        Ok(self.granularity as usize)
    }

    fn total_memory(&self) -> DeviceResult<usize> {
        Ok(self.capacity as usize)
    }

    fn free_memory(&self) -> DeviceResult<usize> {
        Ok((self.capacity - self.state.lock().physical_bytes) as usize)
    }

    fn create_physical(&self, size: usize) -> DeviceResult<PhysHandle> {
        let size = size as u64;
        self.check_aligned("physical size", size)?;
        if size == 0 {
            return invalid("physical size 0".into());
        }
        let mut st = self.state.lock();
        st.calls.create_physical += 1;
        if st.physical_bytes + size > self.capacity {
            return Err(DeviceError::OutOfMemory);
        }
        let id = st.new_handle(size, None);
        st.alloc_refs.insert(id, 1);
        st.physical_bytes += size;
        Ok(PhysHandle(id))
    }

    fn release_physical(&self, handle: PhysHandle) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.release_physical += 1;
        match st.handles.get(&handle.0) {
            None => invalid(format!("release of unknown handle {}", handle.0)),
            Some(h) if h.mappings > 0 => invalid(format!(
                "release of handle {} still mapped {} times",
                handle.0, h.mappings
            )),
            Some(h) => {
                let (size, alloc) = (h.size, h.alloc);
                st.handles.remove(&handle.0);
                st.exports.retain(|_, h| *h != handle.0);
                let refs = st
                    .alloc_refs
                    .get_mut(&alloc)
                    .expect("allocation of a live handle");
                *refs -= 1;
                if *refs == 0 {
                    st.alloc_refs.remove(&alloc);
                    st.physical_bytes -= size;
                }
                Ok(())
            }
        }
    }

    fn reserve_va(&self, size: usize, alignment: usize) -> DeviceResult<DevicePtr> {
        let (size, alignment) = (size as u64, (alignment as u64).max(self.granularity));
        self.check_aligned("reservation size", size)?;
        if size == 0 || !alignment.is_power_of_two() {
            return invalid(format!(
                "reservation of {size} bytes aligned to {alignment}"
            ));
        }
        let mut st = self.state.lock();
        st.calls.reserve_va += 1;
        let start = st.next_va.div_ceil(alignment) * alignment;
        match start.checked_add(size) {
            Some(end) if end <= VA_LIMIT => {
                st.next_va = end;
                st.reservations.insert(start, size);
                Ok(start)
            }
            _ => Err(DeviceError::OutOfMemory),
        }
    }

    fn free_va(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.free_va += 1;
        if st.reservations.get(&addr) != Some(&(size as u64)) {
            return invalid(format!(
                "free of {size} bytes at {addr:#x}: not a reservation"
            ));
        }
        if st.mappings.range(addr..addr + size as u64).next().is_some() {
            return invalid(format!(
                "free of reservation {addr:#x} with mappings inside"
            ));
        }
        st.reservations.remove(&addr);
        Ok(())
    }

    fn map(&self, addr: DevicePtr, size: usize, handle: PhysHandle) -> DeviceResult<()> {
        let size = size as u64;
        self.check_aligned("map address", addr)?;
        self.check_aligned("map size", size)?;
        let mut st = self.state.lock();
        st.calls.map += 1;
        match st.handles.get(&handle.0) {
            None => return invalid(format!("map of unknown handle {}", handle.0)),
            Some(h) if h.size != size => {
                return invalid(format!(
                    "map of {size} bytes of handle {} whose size is {}",
                    handle.0, h.size
                ))
            }
            _ => {}
        }
        if st.reservation_containing(addr, size).is_none() {
            return invalid(format!(
                "map at {addr:#x}+{size:#x} outside any reservation"
            ));
        }
        let overlaps_before = st
            .mappings
            .range(..addr)
            .next_back()
            .is_some_and(|(&s, &(l, _, _))| s + l > addr);
        if overlaps_before || st.mappings.range(addr..addr + size).next().is_some() {
            return invalid(format!("map at {addr:#x}+{size:#x} over a mapped range"));
        }
        st.mappings.insert(addr, (size, handle.0, false));
        if let Some(h) = st.handles.get_mut(&handle.0) {
            h.mappings += 1;
        }
        Ok(())
    }

    fn unmap(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.unmap += 1;
        match st.mappings.get(&addr) {
            Some(&(l, handle, _)) if l == size as u64 => {
                st.mappings.remove(&addr);
                if let Some(h) = st.handles.get_mut(&handle) {
                    h.mappings -= 1;
                }
                Ok(())
            }
            _ => invalid(format!(
                "unmap of {size} bytes at {addr:#x}: not one mapping"
            )),
        }
    }

    fn set_access(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        let size = size as u64;
        let mut st = self.state.lock();
        st.calls.set_access += 1;
        // The range must be covered exactly by contiguous mappings.
        let mut cursor = addr;
        let keys: Vec<u64> = st
            .mappings
            .range(addr..addr + size)
            .map(|(&k, _)| k)
            .collect();
        for k in &keys {
            if *k != cursor {
                return invalid(format!(
                    "set_access at {addr:#x}+{size:#x}: hole at {cursor:#x}"
                ));
            }
            cursor += st.mappings[k].0;
        }
        if cursor != addr + size || size == 0 {
            return invalid(format!(
                "set_access at {addr:#x}+{size:#x}: not fully mapped"
            ));
        }
        for k in keys {
            if let Some(m) = st.mappings.get_mut(&k) {
                m.2 = true;
            }
        }
        Ok(())
    }

    fn create_event(&self) -> DeviceResult<EventHandle> {
        let mut st = self.state.lock();
        st.calls.create_event += 1;
        let id = st.next_event;
        st.next_event += 1;
        st.events.insert(id, false);
        Ok(EventHandle(id))
    }

    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        let mut st = self.state.lock();
        match st.events.remove(&event.0) {
            Some(_) => Ok(()),
            None => invalid(format!("destroy of unknown event {}", event.0)),
        }
    }

    fn record_event(&self, event: EventHandle, _stream: StreamId) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.record_event += 1;
        match st.events.get_mut(&event.0) {
            Some(p) => {
                *p = self.asynchronous;
                Ok(())
            }
            None => invalid(format!("record of unknown event {}", event.0)),
        }
    }

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let mut st = self.state.lock();
        st.calls.query_event += 1;
        match st.events.get(&event.0) {
            Some(p) => Ok(!*p),
            None => invalid(format!("query of unknown event {}", event.0)),
        }
    }

    fn synchronize(&self) -> DeviceResult<()> {
        let mut st = self.state.lock();
        st.calls.synchronize += 1;
        st.events.values_mut().for_each(|p| *p = false);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const P: usize = 2 << 20;

    #[test]
    fn enforces_driver_rules() {
        let d = SimDevice::new(4 * P as u64);
        let h = d.create_physical(P).unwrap();
        let va = d.reserve_va(4 * P, P).unwrap();
        assert!(d.map(va + 1, P, h).is_err(), "unaligned map");
        assert!(d.map(va, 2 * P, h).is_err(), "size differs from the handle");
        d.map(va, P, h).unwrap();
        assert!(d.map(va, P, h).is_err(), "map over a mapped range");
        assert!(d.release_physical(h).is_err(), "release while mapped");
        assert!(d.free_va(va, 4 * P).is_err(), "free with mappings inside");
        assert!(d.set_access(va, 2 * P).is_err(), "access over a hole");
        assert_eq!(d.translate(va), None, "no access granted yet");
        d.set_access(va, P).unwrap();
        assert_eq!(d.translate(va + 5), Some((h, 5)));
        assert!(d.unmap(va, 2 * P).is_err(), "unmap must match one mapping");
        d.unmap(va, P).unwrap();
        d.release_physical(h).unwrap();
        d.free_va(va, 4 * P).unwrap();
        assert_eq!(d.calls().map, 3);
        assert_eq!(d.physical_bytes(), 0);
    }

    #[test]
    fn capacity_limit_is_out_of_memory() {
        let d = SimDevice::new(2 * P as u64);
        let _a = d.create_physical(P).unwrap();
        let _b = d.create_physical(P).unwrap();
        assert_eq!(d.create_physical(P), Err(DeviceError::OutOfMemory));
    }

    #[test]
    fn asynchronous_events_wait_for_completion() {
        let d = SimDevice::new(P as u64).asynchronous();
        let e = d.create_event().unwrap();
        d.record_event(e, 7).unwrap();
        assert!(!d.query_event(e).unwrap());
        d.complete_all();
        assert!(d.query_event(e).unwrap());
        d.destroy_event(e).unwrap();
        assert!(d.query_event(e).is_err());
    }
}
