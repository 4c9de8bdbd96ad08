//! A [`Device`] decorator that keeps the allocator's event traffic legal while a CUDA graph
//! capture is underway.
//!
//! While a stream is captured in `cudaStreamCaptureModeGlobal` (PyTorch's default), calls such
//! as `cuEventQuery` and `cuCtxSynchronize` from any thread are illegal and invalidate the
//! capture; an event recorded on a capturing stream becomes a graph node rather than being
//! recorded. PyTorch's native allocator therefore defers the events of blocks freed during a
//! capture until no capture is underway (`needs_events_deferred_until_no_capture`).
//!
//! This decorator does the same below the core, without the core knowing about captures:
//! between [`CaptureAware::begin_capture`] and the matching [`CaptureAware::end_capture`]
//! - `record_event` is remembered instead of issued (a later record of the same event
//!   replaces it);
//! - `query_event` answers "not complete" without calling the driver, for every event while
//!   a capture is underway and for deferred events until they are really recorded;
//! - `synchronize` and `wait_event` fail with an error instead of breaking the capture.
//!
//! When the last capture ends, deferred events are recorded on their streams: each then
//! completes after all work queued on its stream so far, which covers every use made before
//! the free (a conservative, correct ordering, as PyTorch's).

use gmlake_core::{
    Device, DeviceError, DevicePtr, DeviceResult, EventHandle, PhysHandle, StreamId,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct CaptureAware<D> {
    inner: D,
    /// Pool routings underway (CUDA graph captures, or `use_mem_pool` blocks).
    captures: AtomicUsize,
    /// Number of entries in `deferred` (read without the lock on the fast path).
    deferred_len: AtomicUsize,
    deferred: Mutex<Vec<(EventHandle, StreamId)>>,
}

impl<D: Device> CaptureAware<D> {
    pub fn new(inner: D) -> Self {
        CaptureAware {
            inner,
            captures: AtomicUsize::new(0),
            deferred_len: AtomicUsize::new(0),
            deferred: Mutex::new(Vec::new()),
        }
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    pub fn captures_underway(&self) -> usize {
        self.captures.load(Ordering::Acquire)
    }

    pub fn begin_capture(&self) {
        self.captures.fetch_add(1, Ordering::AcqRel);
    }

    /// Ends one capture; when none is left, records the deferred events. Ending more captures
    /// than were begun is an error (and changes nothing).
    pub fn end_capture(&self) -> DeviceResult<()> {
        let prev = self
            .captures
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| c.checked_sub(1))
            .map_err(|_| {
                DeviceError::InvalidArgument("end_capture without a matching begin_capture".into())
            })?;
        if prev == 1 {
            self.flush_deferred()?;
        }
        Ok(())
    }

    fn flush_deferred(&self) -> DeviceResult<()> {
        let mut deferred = self.deferred.lock();
        let mut first_err = None;
        // Record in order; an event stays "deferred" (reads as pending) until recorded.
        while let Some(&(event, stream)) = deferred.first() {
            if self.captures.load(Ordering::Acquire) != 0 {
                // A new capture began meanwhile: keep the rest deferred.
                break;
            }
            if let Err(e) = self.inner.record_event(event, stream) {
                first_err.get_or_insert(e);
            }
            deferred.remove(0);
            self.deferred_len.store(deferred.len(), Ordering::Release);
        }
        first_err.map_or(Ok(()), Err)
    }

    fn is_deferred(&self, event: EventHandle) -> bool {
        if self.deferred_len.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.deferred.lock().iter().any(|&(e, _)| e == event)
    }
}

/// The error of a call that is illegal while a capture (or a pool routing) is underway.
fn refused_in_capture(call: &'static str) -> DeviceError {
    DeviceError::Driver {
        call,
        code: 900,
        message: "not permitted while a CUDA graph capture (or a pool routing) is underway".into(),
    }
}

impl<D: Device> Device for CaptureAware<D> {
    fn granularity(&self) -> DeviceResult<usize> {
        self.inner.granularity()
    }
    fn total_memory(&self) -> DeviceResult<usize> {
        self.inner.total_memory()
    }
    fn free_memory(&self) -> DeviceResult<usize> {
        self.inner.free_memory()
    }
    fn create_physical(&self, size: usize) -> DeviceResult<PhysHandle> {
        self.inner.create_physical(size)
    }
    fn release_physical(&self, handle: PhysHandle) -> DeviceResult<()> {
        self.inner.release_physical(handle)
    }
    fn reserve_va(&self, size: usize, alignment: usize) -> DeviceResult<DevicePtr> {
        self.inner.reserve_va(size, alignment)
    }
    fn free_va(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        self.inner.free_va(addr, size)
    }
    fn map(&self, addr: DevicePtr, size: usize, handle: PhysHandle) -> DeviceResult<()> {
        self.inner.map(addr, size, handle)
    }
    fn unmap(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        self.inner.unmap(addr, size)
    }
    fn set_access(&self, addr: DevicePtr, size: usize) -> DeviceResult<()> {
        self.inner.set_access(addr, size)
    }
    fn create_event(&self) -> DeviceResult<EventHandle> {
        self.inner.create_event()
    }
    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        if self.deferred_len.load(Ordering::Acquire) != 0 {
            let mut deferred = self.deferred.lock();
            deferred.retain(|&(e, _)| e != event);
            self.deferred_len.store(deferred.len(), Ordering::Release);
        }
        self.inner.destroy_event(event)
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        if self.captures.load(Ordering::Acquire) == 0 && !self.is_deferred(event) {
            return self.inner.record_event(event, stream);
        }
        let mut deferred = self.deferred.lock();
        if self.captures.load(Ordering::Acquire) == 0 {
            // The capture ended between the check and the lock: flush happened or is about to
            // (it takes this lock); keep order by deferring behind what is still queued.
            if deferred.is_empty() {
                return self.inner.record_event(event, stream);
            }
        }
        deferred.retain(|&(e, _)| e != event);
        deferred.push((event, stream));
        self.deferred_len.store(deferred.len(), Ordering::Release);
        drop(deferred);
        if self.captures.load(Ordering::Acquire) == 0 {
            // No capture left to flush it later: flush now.
            self.flush_deferred()?;
        }
        Ok(())
    }
    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        if self.captures.load(Ordering::Acquire) != 0 || self.is_deferred(event) {
            return Ok(false);
        }
        self.inner.query_event(event)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        // A deferred event is not recorded yet: a wait now would see its previous record (or
        // none), an older point than the caller asked for. The allocator takes no cross-stream
        // wait during a capture anyway; refusing keeps that true below it.
        if self.captures.load(Ordering::Acquire) != 0 || self.is_deferred(event) {
            return Err(refused_in_capture("cuStreamWaitEvent"));
        }
        self.inner.stream_wait_event(stream, event)
    }
    fn synchronize(&self) -> DeviceResult<()> {
        if self.captures.load(Ordering::Acquire) != 0 {
            return Err(refused_in_capture("cuCtxSynchronize"));
        }
        self.inner.synchronize()
    }
    fn wait_event(&self, event: EventHandle) -> DeviceResult<()> {
        // A deferred event is not recorded until the capture ends: waiting for it now would
        // never end (and cuEventSynchronize is as illegal as cuCtxSynchronize meanwhile).
        if self.captures.load(Ordering::Acquire) != 0 || self.is_deferred(event) {
            return Err(refused_in_capture("cuEventSynchronize"));
        }
        self.inner.wait_event(event)
    }
    fn alloc_host(&self, size: usize) -> DeviceResult<gmlake_core::HostPtr> {
        self.inner.alloc_host(size)
    }
    fn free_host(&self, ptr: gmlake_core::HostPtr) -> DeviceResult<()> {
        self.inner.free_host(ptr)
    }
    fn copy_d2h_async(
        &self,
        dst: gmlake_core::HostPtr,
        src: DevicePtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        self.inner.copy_d2h_async(dst, src, len, stream)
    }
    fn copy_h2d_async(
        &self,
        dst: DevicePtr,
        src: gmlake_core::HostPtr,
        len: usize,
        stream: StreamId,
    ) -> DeviceResult<()> {
        self.inner.copy_h2d_async(dst, src, len, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gmlake_core::SimDevice;

    #[test]
    fn events_are_deferred_during_capture_and_recorded_after() {
        let d = CaptureAware::new(SimDevice::new(1 << 30).asynchronous());
        let e = d.create_event().unwrap();
        d.begin_capture();
        d.record_event(e, 7).unwrap();
        assert!(!d.query_event(e).unwrap(), "pending during capture");
        assert!(d.synchronize().is_err(), "no synchronize during capture");
        assert_eq!(
            d.inner().calls().record_event,
            0,
            "nothing issued during capture"
        );
        d.end_capture().unwrap();
        assert_eq!(
            d.inner().calls().record_event,
            1,
            "recorded when the capture ended"
        );
        assert!(!d.query_event(e).unwrap(), "still pending: work in flight");
        d.inner().complete_all();
        assert!(d.query_event(e).unwrap());
        assert!(d.end_capture().is_err(), "unbalanced end");
    }

    /// The contract suite through the decorator, outside captures: it must keep every rule of
    /// the device it wraps and offer all it offers. (It once did not forward
    /// `stream_wait_event`, and the trait's default made `cross_stream_wait` a silent no-op
    /// on GPUs while every model test passed.)
    struct Wrapped;

    impl gmlake_core::contract::Target for Wrapped {
        type Dev = CaptureAware<SimDevice>;
        fn name(&self) -> String {
            "capture-aware(sim-async)".into()
        }
        fn open(&self) -> DeviceResult<Self::Dev> {
            Ok(CaptureAware::new(SimDevice::new(64 << 30).asynchronous()))
        }
        fn is_model(&self) -> bool {
            true
        }
        fn holds_events(&self) -> bool {
            true
        }
        fn complete_all(&self, dev: &Self::Dev) -> DeviceResult<()> {
            dev.inner().complete_all();
            Ok(())
        }
        fn census(&self, dev: &Self::Dev) -> Option<gmlake_core::contract::Census> {
            let d = dev.inner();
            Some(gmlake_core::contract::Census {
                handles: d.live_handles(),
                mappings: d.live_mappings(),
                reservations: d.live_reservations(),
                events: d.live_events(),
            })
        }
    }

    #[test]
    fn the_decorator_keeps_the_whole_contract() {
        let r = gmlake_core::contract::run(&Wrapped, &gmlake_core::contract::all_cases());
        println!("{r}");
        r.assert_ok();
        assert_eq!(r.skipped(), 0, "every case applies: {r}");
    }

    #[test]
    fn stream_waits_are_refused_during_a_capture_and_forwarded_after() {
        let d = CaptureAware::new(SimDevice::new(1 << 30).asynchronous());
        let e = d.create_event().unwrap();
        d.begin_capture();
        d.record_event(e, 1).unwrap();
        assert!(d.stream_wait_event(0, e).is_err(), "deferred event");
        d.end_capture().unwrap();
        d.stream_wait_event(0, e).unwrap();
        assert_eq!(d.inner().calls().stream_wait, 1);
    }

    #[test]
    fn nested_captures_flush_once_at_the_end() {
        let d = CaptureAware::new(SimDevice::new(1 << 30).asynchronous());
        let e1 = d.create_event().unwrap();
        let e2 = d.create_event().unwrap();
        d.begin_capture();
        d.begin_capture();
        d.record_event(e1, 1).unwrap();
        d.record_event(e1, 2).unwrap(); // replaces the first record
        d.record_event(e2, 3).unwrap();
        d.end_capture().unwrap();
        assert_eq!(d.inner().calls().record_event, 0);
        d.destroy_event(e2).unwrap();
        d.end_capture().unwrap();
        assert_eq!(d.inner().calls().record_event, 1);
        assert!(d.synchronize().is_ok());
    }
}
