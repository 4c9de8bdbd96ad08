// gmlake's adapter to the allocator interface of torch 2.6 (included by ../version_compat.h).
//
// Checked against c10/cuda/CUDACachingAllocator.h, c10/core/CachingDeviceAllocator.h and
// c10/core/Allocator.h of PyTorch 2.6.0 (Debian trixie's source package). Differences from
// 2.11: emptyCache() and snapshot() take no pool, recordHistory has no clear / skip lists,
// no createOrIncrefPool / setUseOnOOM / setNoSplit / getExpandableSegmentSizes / compile
// context / user metadata, ensureExistsAndIncrefPool instead of createOrIncrefPool, TraceEntry
// without pool and metadata, AllocatorConfigInfo without graph_capture_record_stream_reuse, no
// c10::SetAllocator registry for CUDA.
#pragma once

namespace gmlake {
namespace compat {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;
using MempoolId = c10::cuda::MempoolId_t;

inline void trace_gpu_alloc(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<uintptr_t>(p));
  }
}

inline void trace_gpu_free(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<uintptr_t>(p));
  }
}

inline cda::DeviceStats to_torch(const ffi::Stats& s) {
  return device_stats_to<cda::DeviceStats>(s);
}

inline cca::TraceEntry to_torch(const TraceRec& r) {
  return cca::TraceEntry(
      static_cast<cca::TraceEntry::Action>(r.action),
      static_cast<c10::DeviceIndex>(r.device),
      static_cast<size_t>(r.addr),
      static_cast<size_t>(r.size),
      static_cast<cudaStream_t>(r.stream),
      r.time,
      r.context);
}

inline cca::SnapshotInfo to_torch(const SnapshotData& d, c10::ApproximateClockToUnixTimeConverter& clock) {
  cca::SnapshotInfo info;
  for (const auto& s : d.segments) {
    cca::SegmentInfo seg;
    seg.device = static_cast<c10::DeviceIndex>(s.device);
    seg.address = static_cast<size_t>(s.address);
    seg.total_size = static_cast<size_t>(s.total_size);
    seg.requested_size = static_cast<size_t>(s.requested_size);
    seg.allocated_size = static_cast<size_t>(s.allocated_size);
    seg.active_size = static_cast<size_t>(s.active_size);
    seg.stream = static_cast<cudaStream_t>(s.stream);
    seg.is_large = s.is_large;
    seg.is_expandable = false;
    seg.owner_private_pool_id = MempoolId{s.pool.first, s.pool.second};
    for (const auto& b : s.blocks) {
      cca::BlockInfo bi;
      bi.size = static_cast<size_t>(b.size);
      bi.requested_size = static_cast<size_t>(b.requested_size);
      bi.allocated = b.allocated;
      bi.active = b.active;
      bi.context_when_allocated = b.context;
      seg.blocks.push_back(std::move(bi));
    }
    info.segments.push_back(std::move(seg));
  }
  auto to_us = clock.makeConverter();
  for (const auto& dev : d.traces) {
    std::vector<cca::TraceEntry> entries;
    entries.reserve(dev.size());
    for (const auto& r : dev) {
      cca::TraceEntry te = to_torch(r);
      te.time_.t_ = to_us(r.time);
      entries.push_back(std::move(te));
    }
    info.device_traces.push_back(std::move(entries));
  }
  for (const auto& a : d.annotations) {
    cca::AnnotationEntry ae(static_cast<c10::DeviceIndex>(a.device), a.time);
    for (const auto& kv : a.metadata) {
      ae.recordUserMetadata(kv.first, kv.second);
    }
    ae.time_.t_ = to_us(a.time);
    info.external_annotations.push_back(std::move(ae));
  }
  auto& cm = info.config_metadata;
  cm.garbage_collection_threshold = 0.0;
  cm.max_split_size = std::numeric_limits<size_t>::max();
  cm.pinned_num_register_threads = 1;
  cm.expandable_segments = false;
  cm.release_lock_on_malloc = false;
  cm.pinned_use_host_register = false;
  cm.last_allocator_settings = d.settings;
  cm.roundup_power2_divisions.clear();
  return info;
}

} // namespace compat

class GmlakeAllocator final : public c10::cuda::CUDACachingAllocator::CUDAAllocator {
 public:
  explicit GmlakeAllocator(std::string conf) : impl_(std::move(conf)) {}

  Impl& impl() {
    return impl_;
  }

  // ---- c10::Allocator
  c10::DataPtr allocate(size_t n) override {
    return impl_.allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &local_raw_delete;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    impl_.copy_data(dest, src, count);
  }

  // ---- CUDAAllocator
  void* raw_alloc(size_t nbytes) override {
    return impl_.raw_alloc(nbytes);
  }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return impl_.raw_alloc_with_stream(nbytes, stream);
  }
  void raw_delete(void* ptr) override {
    impl_.free(ptr);
  }
  void init(int device_count) override {
    impl_.init(device_count);
  }
  bool initialized() override {
    return impl_.initialized();
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    return impl_.memory_fraction(device);
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    impl_.set_memory_fraction(fraction, device);
  }
  void emptyCache() override {
    impl_.empty_cache(PoolId{0, 0});
  }
  void enable(bool value) override {
    impl_.enable(value);
  }
  bool isEnabled() const override {
    return impl_.is_enabled();
  }
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    impl_.cache_info(device, largestBlock);
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    return impl_.base_allocation(ptr, size);
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    impl_.record_stream(ptr.get(), ptr.get_deleter(), ptr.device().index(), stream.stream());
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    bool present = false;
    ffi::Stats s = impl_.stats(device, &present);
    if (!present) {
      c10::CachingDeviceAllocator::DeviceStats empty;
      empty.max_split_size = std::numeric_limits<int64_t>::max();
      return empty;
    }
    return compat::to_torch(s);
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    impl_.reset_accumulated_stats(device);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    impl_.reset_peak_stats(device);
  }
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot() override {
    SnapshotData d = impl_.snapshot(PoolId{0, 0}, /*include_traces=*/true);
    return compat::to_torch(d, clock_converter_);
  }
  void beginAllocateToPool(
      c10::DeviceIndex device,
      compat::MempoolId mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    impl_.begin_allocate_to_pool(device, PoolId{mempool_id.first, mempool_id.second}, std::move(filter));
  }
  void endAllocateToPool(c10::DeviceIndex device, compat::MempoolId mempool_id) override {
    impl_.end_allocate_to_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  void releasePool(c10::DeviceIndex device, compat::MempoolId mempool_id) override {
    impl_.release_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  int getPoolUseCount(c10::DeviceIndex device, compat::MempoolId mempool_id) override {
    return impl_.pool_use_count(device, PoolId{mempool_id.first, mempool_id.second});
  }
  void ensureExistsAndIncrefPool(c10::DeviceIndex device, compat::MempoolId mempool_id) override {
    impl_.create_or_incref_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      compat::MempoolId mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    std::vector<void*> expected(expected_live_allocations.begin(), expected_live_allocations.end());
    return impl_.check_pool_live_allocations(device, PoolId{mempool_id.first, mempool_id.second}, expected);
  }
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    auto [offset, handle] = impl_.share_ipc(ptr);
    return c10::cuda::CUDACachingAllocator::ShareableHandle{offset, std::move(handle)};
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return impl_.get_ipc_dev_ptr(handle);
  }
  bool isHistoryEnabled() override {
    return impl_.history_enabled();
  }
  void recordHistory(
      bool enabled,
      c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      c10::cuda::CUDACachingAllocator::RecordContext when) override {
    impl_.record_history(
        enabled,
        context_recorder,
        alloc_trace_max_entries,
        static_cast<When>(static_cast<int>(when)),
        /*clear=*/false,
        {});
  }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    impl_.record_annotation(md);
  }
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    impl_.attach_oom_observer(std::move(observer));
  }
  void attachAllocatorTraceTracker(c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) override {
    impl_.attach_trace_tracker([tracker = std::move(tracker)](const TraceRec& r) { tracker(compat::to_torch(r)); });
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    impl_.enable_peer_access(dev, dev_to_access);
  }
  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override {
    return impl_.memcpy_async(dst, dstDevice, src, srcDevice, count, stream, p2p_enabled);
  }
  // CUDA graph trees (torch.compile mode="reduce-overhead"): see the 2.11 adapter.
  struct PoolCheckpoint final : c10::cuda::CUDACachingAllocator::AllocatorState {
    int device = 0;
    PoolId pool{0, 0};
    std::vector<Impl::PoolBlock> blocks;
  };
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device,
      compat::MempoolId id) override {
    auto state = std::make_shared<PoolCheckpoint>();
    state->device = device;
    state->pool = PoolId{id.first, id.second};
    state->blocks = impl_.live_blocks_in_pool(device, state->pool);
    return state;
  }
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) override {
    auto state = std::dynamic_pointer_cast<PoolCheckpoint>(pps);
    TORCH_CHECK(state, "gmlake: setCheckpointPoolState expects a state from gmlake's getCheckpointState");
    TORCH_CHECK(state->device == device, "gmlake: checkpoint of device ", state->device, " restored on ", device);
    c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
    delta.ptrs_freed = impl_.restore_pool_checkpoint(device, state->pool, state->blocks);
    for (const auto& b : state->blocks) {
      void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(b.address));
      delta.ptrs_freed.push_back(p);
      delta.dataptrs_allocd.emplace_back(
          p, p, &local_raw_delete, c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }
  std::string name() override {
    return "gmlake";
  }

 private:
  mutable Impl impl_;
  c10::ApproximateClockToUnixTimeConverter clock_converter_;
};

namespace compat {

inline bool current_allocator_initialized() {
  cca::CUDAAllocator* cur = cca::allocator.load();
  return cur != nullptr && cur->initialized();
}

inline std::string current_allocator_name() {
  cca::CUDAAllocator* cur = cca::allocator.load();
  return cur != nullptr ? cur->name() : std::string("none");
}

// 2.6 has no c10::SetAllocator registration for CUDA: torch reads CUDACachingAllocator::get().
inline void install(GmlakeAllocator* a) {
  cca::allocator.store(a);
}

inline const void* c10_cuda_anchor() {
  return static_cast<const void*>(&cca::allocator);
}

} // namespace compat
} // namespace gmlake
