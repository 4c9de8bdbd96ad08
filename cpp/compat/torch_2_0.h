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

#include "compat/pool_routes.h"

namespace gmlake {
namespace compat {

using CaptureId = c10::cuda::CaptureId_t;

} // namespace compat

class GmlakeAllocator final : public compat::ForwardingAllocator<int> {
 public:
  using ForwardingAllocator::ForwardingAllocator;

  // CUDA graphs (2.0): allocations of streams capturing `graph_id` go to the pool until the
  // capture is about to end; the pool is released when the graph is destroyed.
  void notifyCaptureBegin(int device, compat::CaptureId graph_id, compat::MempoolId mempool_id) override {
    capture_routes_.begin(
        impl_, device, graph_id, PoolId{mempool_id.first, mempool_id.second},
        [graph_id](cudaStream_t s) { return compat::stream_captures(s, graph_id); },
        "gmlake: notifyCaptureBegin: capture already underway");
  }
  void notifyCaptureAboutToEnd(int device, compat::CaptureId graph_id) override {
    capture_routes_.end(impl_, device, graph_id, "gmlake: notifyCaptureAboutToEnd: no such capture");
  }
  void notifyCaptureEnded(int /*device*/, compat::CaptureId /*graph_id*/) override {}
  void notifyCaptureDestroy(int device, compat::MempoolId mempool_id) override {
    impl_.release_pool(device, PoolId{mempool_id.first, mempool_id.second});
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
  // Only cudaMallocAsync's pools need pool-specific peer access.
  bool needsPoolSpecificPeerAccess() override {
    return false;
  }

 private:
  compat::KeyedPoolRoutes<compat::CaptureId> capture_routes_;
};

} // namespace gmlake
