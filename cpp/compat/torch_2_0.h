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

// 2.0 has no SEGMENT_MAP / SEGMENT_UNMAP: a page mapped is reported as memory obtained, a page
// unmapped as memory returned.
inline cca::TraceEntry::Action to_torch(Action a) {
  switch (a) {
    case Action::ALLOC:
      return cca::TraceEntry::ALLOC;
    case Action::FREE_REQUESTED:
      return cca::TraceEntry::FREE_REQUESTED;
    case Action::FREE_COMPLETED:
      return cca::TraceEntry::FREE_COMPLETED;
    case Action::SEGMENT_ALLOC:
    case Action::SEGMENT_MAP:
      return cca::TraceEntry::SEGMENT_ALLOC;
    case Action::SEGMENT_FREE:
    case Action::SEGMENT_UNMAP:
      return cca::TraceEntry::SEGMENT_FREE;
    case Action::SNAPSHOT:
      return cca::TraceEntry::SNAPSHOT;
    case Action::OOM:
      return cca::TraceEntry::OOM;
  }
  return cca::TraceEntry::ALLOC;
}

inline cca::TraceEntry to_torch(const TraceRec& r) {
  return cca::TraceEntry(
      to_torch(r.action),
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
    uint64_t at = s.address;
    for (const auto& b : s.blocks) {
      cca::BlockInfo bi;
      bi.size = static_cast<int64_t>(b.size);
      bi.requested_size = static_cast<int64_t>(b.requested_size);
      bi.allocated = b.allocated;
      bi.active = b.active;
      if (b.allocated) {
        bi.history.push_back(cca::History{
            reinterpret_cast<void*>(static_cast<uintptr_t>(at)), static_cast<size_t>(b.requested_size), b.context});
      }
      at += b.size;
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
    return compat::to_torch(impl_.snapshot(PoolId{0, 0}, /*include_traces=*/true));
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
