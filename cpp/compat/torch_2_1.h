// gmlake's adapter to the allocator interface of torch 2.1 (included by ../version_compat.h).
//
// Checked against torch/include/c10/cuda/CUDACachingAllocator.h and c10/core/Allocator.h of
// the PyPI wheel torch==2.1.2. Differences from 2.6: `int device`; Allocator::allocate is
// const and there is no copy_data; DeviceStats lives in CUDACachingAllocator (no sync / device
// alloc counters); no getMemoryFraction / enable / shareIpcHandle / recordAnnotation /
// trace trackers / pool use counts; CUDA graphs route by stream
// (beginAllocateStreamToPool(device, stream, pool) / endAllocateStreamToPool(device, stream));
// TraceEntry has no device, time or pool; snapshots have no annotations or config. No
// c10/util/ApproximateClock.h: cpp/compat/legacy supplies what gmlake_impl needs.
#pragma once

#include <map>
#include <mutex>

namespace gmlake {
namespace compat {

namespace cca = c10::cuda::CUDACachingAllocator;
using MempoolId = c10::cuda::MempoolId_t;

inline void trace_gpu_alloc(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_allocation(reinterpret_cast<uintptr_t>(p));
  }
}

inline void trace_gpu_free(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_deallocation(reinterpret_cast<uintptr_t>(p));
  }
}

inline cca::DeviceStats to_torch(const ffi::Stats& s) {
  return device_stats_to<cca::DeviceStats>(s);
}

inline cca::TraceEntry to_torch(const TraceRec& r) {
  return cca::TraceEntry(
      static_cast<cca::TraceEntry::Action>(r.action),
      static_cast<int64_t>(r.addr),
      static_cast<size_t>(r.size),
      static_cast<cudaStream_t>(r.stream),
      r.context);
}

inline cca::SnapshotInfo to_torch(const SnapshotData& d) {
  cca::SnapshotInfo info;
  for (const auto& s : d.segments) {
    cca::SegmentInfo seg;
    seg.device = s.device;
    seg.address = static_cast<int64_t>(s.address);
    seg.total_size = static_cast<int64_t>(s.total_size);
    seg.requested_size = static_cast<int64_t>(s.requested_size);
    seg.allocated_size = static_cast<int64_t>(s.allocated_size);
    seg.active_size = static_cast<int64_t>(s.active_size);
    seg.stream = static_cast<cudaStream_t>(s.stream);
    seg.is_large = s.is_large;
    seg.is_expandable = false;
    seg.owner_private_pool_id = MempoolId{s.pool.first, s.pool.second};
    for (const auto& b : s.blocks) {
      cca::BlockInfo bi;
      bi.size = static_cast<int64_t>(b.size);
      bi.requested_size = static_cast<int64_t>(b.requested_size);
      bi.allocated = b.allocated;
      bi.active = b.active;
      bi.context_when_allocated = b.context;
      seg.blocks.push_back(std::move(bi));
    }
    info.segments.push_back(std::move(seg));
  }
  for (const auto& dev : d.traces) {
    std::vector<cca::TraceEntry> entries;
    entries.reserve(dev.size());
    for (const auto& r : dev) {
      entries.push_back(to_torch(r));
    }
    info.device_traces.push_back(std::move(entries));
  }
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
  c10::DataPtr allocate(size_t n) const override {
    return impl_.allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &local_raw_delete;
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
  void setMemoryFraction(double fraction, int device) override {
    impl_.set_memory_fraction(fraction, device);
  }
  void emptyCache() override {
    impl_.empty_cache(PoolId{0, 0});
  }
  void cacheInfo(int device, size_t* largestBlock) override {
    impl_.cache_info(device, largestBlock);
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    return impl_.base_allocation(ptr, size);
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    impl_.record_stream(ptr.get(), ptr.get_deleter(), ptr.device().index(), stream.stream());
  }
  c10::cuda::CUDACachingAllocator::DeviceStats getDeviceStats(int device) override {
    bool present = false;
    ffi::Stats s = impl_.stats(device, &present);
    if (!present) {
      c10::cuda::CUDACachingAllocator::DeviceStats empty;
      empty.max_split_size = std::numeric_limits<int64_t>::max();
      return empty;
    }
    return compat::to_torch(s);
  }
  void resetAccumulatedStats(int device) override {
    impl_.reset_accumulated_stats(device);
  }
  void resetPeakStats(int device) override {
    impl_.reset_peak_stats(device);
  }
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot() override {
    return compat::to_torch(impl_.snapshot(PoolId{0, 0}, /*include_traces=*/true));
  }
  // CUDA graphs (2.1): allocations on `stream` go to the pool until endAllocateStreamToPool.
  void beginAllocateStreamToPool(int device, cudaStream_t stream, compat::MempoolId mempool_id) override {
    const PoolId pool{mempool_id.first, mempool_id.second};
    {
      std::lock_guard<std::mutex> g(routes_mu_);
      auto key = std::make_pair(device, stream);
      TORCH_CHECK(
          stream_pools_.find(key) == stream_pools_.end(),
          "gmlake: beginAllocateStreamToPool: the stream already allocates to a pool");
      stream_pools_[key] = pool;
    }
    try {
      impl_.begin_allocate_to_pool(device, pool, [stream](cudaStream_t s) { return s == stream; });
    } catch (...) {
      std::lock_guard<std::mutex> g(routes_mu_);
      stream_pools_.erase(std::make_pair(device, stream));
      throw;
    }
  }
  void endAllocateStreamToPool(int device, cudaStream_t stream) override {
    PoolId pool;
    {
      std::lock_guard<std::mutex> g(routes_mu_);
      auto it = stream_pools_.find(std::make_pair(device, stream));
      TORCH_CHECK(it != stream_pools_.end(), "gmlake: endAllocateStreamToPool: the stream allocates to no pool");
      pool = it->second;
      stream_pools_.erase(it);
    }
    impl_.end_allocate_to_pool(device, pool);
  }
  void releasePool(int device, compat::MempoolId mempool_id) override {
    impl_.release_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  bool checkPoolLiveAllocations(
      int device,
      compat::MempoolId mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    std::vector<void*> expected(expected_live_allocations.begin(), expected_live_allocations.end());
    return impl_.check_pool_live_allocations(device, PoolId{mempool_id.first, mempool_id.second}, expected);
  }
  // Before 2.5 PyTorch shares with cudaIpcGetMemHandle itself (which cannot share gmlake's
  // page-mapped memory: sending fails with CUDA's error); what it receives is a raw
  // cudaIpcMemHandle_t of a process using the native allocator, which gmlake opens.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return impl_.open_cuda_ipc_handle(handle);
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
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    impl_.attach_oom_observer([observer = std::move(observer)](int64_t device, size_t allocated, size_t total, size_t free) {
      observer(device, static_cast<int64_t>(allocated), static_cast<int64_t>(total), static_cast<int64_t>(free));
    });
  }
  void enablePeerAccess(int dev, int dev_to_access) override {
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
      int device,
      compat::MempoolId id) override {
    auto state = std::make_shared<PoolCheckpoint>();
    state->device = device;
    state->pool = PoolId{id.first, id.second};
    state->blocks = impl_.live_blocks_in_pool(device, state->pool);
    return state;
  }
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      int device,
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
          p, p, &local_raw_delete, c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
    }
    return delta;
  }
  std::string name() override {
    return "gmlake";
  }

 private:
  mutable Impl impl_;
  std::mutex routes_mu_;
  std::map<std::pair<int, cudaStream_t>, PoolId> stream_pools_;
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

inline void install(GmlakeAllocator* a) {
  cca::allocator.store(a);
}

inline const void* c10_cuda_anchor() {
  return static_cast<const void*>(&cca::allocator);
}

} // namespace compat
} // namespace gmlake
