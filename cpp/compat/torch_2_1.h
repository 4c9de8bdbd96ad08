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

} // namespace compat

class GmlakeAllocator final : public compat::CheckpointingAllocator<int, compat::MempoolId> {
 public:
  using CheckpointingAllocator::CheckpointingAllocator;

  c10::DataPtr allocate(size_t n) const override {
    return impl_.allocate(n);
  }
  void emptyCache() override {
    impl_.empty_cache(PoolId{0, 0});
  }
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot() override {
    return compat::snapshot_to<c10::cuda::CUDACachingAllocator::SnapshotInfo>(
        impl_.snapshot(PoolId{0, 0}, /*include_traces=*/true));
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

 private:
  std::mutex routes_mu_;
  std::map<std::pair<int, cudaStream_t>, PoolId> stream_pools_;
};

namespace compat {

inline void install(GmlakeAllocator* a) {
  cca::allocator.store(a);
}

} // namespace compat
} // namespace gmlake
