// gmlake's adapter to the allocator interface of torch 2.0 (included by ../version_compat.h).
//
// Checked against torch/include/c10/cuda/CUDACachingAllocator.h and c10/core/Allocator.h of
// the PyPI wheel torch==2.0.1. Differences from 2.1: CUDA graphs are announced by capture
// (notifyCaptureBegin(device, graph, pool) / notifyCaptureAboutToEnd / notifyCaptureEnded /
// notifyCaptureDestroy) and allocations are routed by the stream's capture id; recordHistory
// takes a bool (record contexts in the trace); contexts are CUDACachingAllocator::Context
// (c10::GatheredContext comes later); block contexts are a History list; TraceEntry has no
// SEGMENT_MAP / SEGMENT_UNMAP actions; no peer-access / memcpy / checkpoint hooks;
// needsPoolSpecificPeerAccess() exists. cpp/compat/legacy supplies what gmlake_impl needs.
#pragma once

#include <map>
#include <mutex>

namespace gmlake {
namespace compat {

namespace cca = c10::cuda::CUDACachingAllocator;
using MempoolId = c10::cuda::MempoolId_t;
using CaptureId = c10::cuda::CaptureId_t;

// Whether `stream` is capturing the CUDA graph `graph` (2.0 routes allocations by capture id).
inline bool stream_captures(cudaStream_t stream, CaptureId graph) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CaptureId id = 0;
  if (cudaStreamGetCaptureInfo(stream, &status, &id) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status == cudaStreamCaptureStatusActive && id == graph;
}

} // namespace compat

class GmlakeAllocator final : public compat::ForwardingAllocator<int> {
 public:
  using ForwardingAllocator::ForwardingAllocator;

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
  // CUDA graphs (2.0): allocations of streams capturing `graph_id` go to the pool until the
  // capture is about to end; the pool is released when the graph is destroyed.
  void notifyCaptureBegin(int device, compat::CaptureId graph_id, compat::MempoolId mempool_id) override {
    const PoolId pool{mempool_id.first, mempool_id.second};
    {
      std::lock_guard<std::mutex> g(captures_mu_);
      auto key = std::make_pair(device, graph_id);
      TORCH_CHECK(captures_.find(key) == captures_.end(), "gmlake: notifyCaptureBegin: capture already underway");
      captures_[key] = pool;
    }
    try {
      impl_.begin_allocate_to_pool(
          device, pool, [graph_id](cudaStream_t s) { return compat::stream_captures(s, graph_id); });
    } catch (...) {
      std::lock_guard<std::mutex> g(captures_mu_);
      captures_.erase(std::make_pair(device, graph_id));
      throw;
    }
  }
  void notifyCaptureAboutToEnd(int device, compat::CaptureId graph_id) override {
    PoolId pool;
    {
      std::lock_guard<std::mutex> g(captures_mu_);
      auto it = captures_.find(std::make_pair(device, graph_id));
      TORCH_CHECK(it != captures_.end(), "gmlake: notifyCaptureAboutToEnd: no such capture");
      pool = it->second;
      captures_.erase(it);
    }
    impl_.end_allocate_to_pool(device, pool);
  }
  void notifyCaptureEnded(int /*device*/, compat::CaptureId /*graph_id*/) override {}
  void notifyCaptureDestroy(int device, compat::MempoolId mempool_id) override {
    impl_.release_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  // Before 2.5 PyTorch shares with cudaIpcGetMemHandle itself (which cannot share gmlake's
  // page-mapped memory: sending fails with CUDA's error); what it receives is a raw
  // cudaIpcMemHandle_t of a process using the native allocator, which gmlake opens.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return impl_.open_cuda_ipc_handle(handle);
  }
  void recordHistory(
      bool enabled,
      c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      bool alloc_trace_record_context) override {
    // 2.0: contexts are kept for live blocks whenever a recorder is given, and attached to
    // trace entries when alloc_trace_record_context.
    When when = When::NEVER;
    if (enabled && context_recorder != nullptr) {
      when = alloc_trace_record_context ? When::ALLOC : When::STATE;
    }
    impl_.record_history(enabled, context_recorder, alloc_trace_max_entries, when, /*clear=*/false, {});
  }
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    impl_.attach_oom_observer([observer = std::move(observer)](int64_t device, size_t allocated, size_t total, size_t free) {
      observer(device, static_cast<int64_t>(allocated), static_cast<int64_t>(total), static_cast<int64_t>(free));
    });
  }
  // Only cudaMallocAsync's pools need pool-specific peer access.
  bool needsPoolSpecificPeerAccess() override {
    return false;
  }

 private:
  std::mutex captures_mu_;
  std::map<std::pair<int, compat::CaptureId>, PoolId> captures_;
};

namespace compat {

inline void install(GmlakeAllocator* a) {
  cca::allocator.store(a);
}

} // namespace compat
} // namespace gmlake
