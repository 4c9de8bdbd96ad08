// gmlake's adapter to the allocator interface of torch 2.11 (included by ../version_compat.h):
// the version installed at run time into an unmodified PyPI wheel (gmlake_torch.cpp).
//
// Checked against c10/cuda/CUDACachingAllocator.h, c10/core/CachingDeviceAllocator.h and
// c10/core/Allocator.h of the PyPI wheel torch==2.11.0.
#pragma once

#include <c10/cuda/CUDAAllocatorConfig.h>

namespace gmlake {
namespace compat {

inline std::vector<Action> parse_skip_actions(const std::vector<std::string>& names) {
  std::vector<Action> out;
  for (const auto& n : names) {
    out.push_back(static_cast<Action>(c10::CachingDeviceAllocator::parseTraceEntryAction(n)));
  }
  return out;
}

} // namespace compat

class GmlakeAllocator final : public compat::PoolRoutingAllocator<c10::DeviceIndex, c10::MempoolId_t> {
 public:
  using PoolRoutingAllocator::PoolRoutingAllocator;

  void emptyCache(c10::MempoolId_t mempool_id) override {
    impl_.empty_cache(PoolId{mempool_id.first, mempool_id.second});
  }
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex /*device*/) override {
    // gmlake has no expandable segments (its segments are stitched page runs).
    return {};
  }
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(
      c10::MempoolId_t mempool_id,
      bool include_traces) override {
    SnapshotData d = impl_.snapshot(PoolId{mempool_id.first, mempool_id.second}, include_traces);
    // A gmlake segment is a run of mapped pages in a reserved range that grows and shrinks
    // page by page: what PyTorch's expandable segments are, and PyTorch's consistency rules
    // for those hold (segment counts and inactive_split are not per cudaMalloc).
    auto info = snapshot_info(d, compat::SnapshotOptions{/*expandable=*/true});
    // PyTorch's settings as torch parsed them (PYTORCH_CUDA_ALLOC_CONF,
    // _set_allocator_settings), which gmlake accepts; docs/pytorch.md says which it honours.
    // The settings string is gmlake's effective configuration.
    auto& cm = info.config_metadata;
    using AC = c10::CachingAllocator::AcceleratorAllocatorConfig;
    using CC = c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig;
    cm.garbage_collection_threshold = AC::garbage_collection_threshold();
    cm.max_split_size = AC::max_split_size();
    cm.pinned_num_register_threads = CC::pinned_num_register_threads();
    cm.expandable_segments = false; // gmlake's segments are not PyTorch's expandable segments
    cm.release_lock_on_malloc = CC::release_lock_on_cudamalloc();
    cm.pinned_use_host_register = CC::pinned_use_cuda_host_register();
    cm.graph_capture_record_stream_reuse = CC::graph_capture_record_stream_reuse();
    cm.last_allocator_settings = d.settings;
    cm.roundup_power2_divisions.clear();
    // PyTorch reports one entry per interval, as the configuration holds them.
    for (size_t v : AC::roundup_power2_divisions()) {
      cm.roundup_power2_divisions.push_back(v);
    }
    return info;
  }
  void createOrIncrefPool(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override {
    TORCH_CHECK(
        !allocator || allocator.get() == this,
        "gmlake: memory pools backed by another allocator (torch.cuda.MemPool(allocator=...)) "
        "are not supported while gmlake is installed");
    impl_.create_or_incref_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  void setUseOnOOM(c10::DeviceIndex /*device*/, c10::MempoolId_t /*mempool_id*/, bool use_on_oom) override {
    TORCH_CHECK(
        !use_on_oom,
        "gmlake: memory pools used on out-of-memory (MemPool(use_on_oom=True)) are not supported yet");
  }
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    impl_.set_no_split(device, PoolId{mempool_id.first, mempool_id.second});
  }
  void recordHistory(
      bool enabled,
      c10::CachingDeviceAllocator::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      c10::CachingDeviceAllocator::RecordContext when,
      bool clearHistory,
      const std::vector<std::string>& skip_actions) override {
    impl_.record_history(
        enabled,
        context_recorder,
        alloc_trace_max_entries,
        static_cast<When>(static_cast<int>(when)),
        clearHistory,
        compat::parse_skip_actions(skip_actions));
  }
  void pushCompileContext(std::string& md) override {
    impl_.push_compile_context(md);
  }
  void popCompileContext() override {
    impl_.pop_compile_context();
  }
  void setUserMetadata(const std::string& metadata) override {
    impl_.set_user_metadata(metadata);
  }
  std::string getUserMetadata() override {
    return impl_.user_metadata();
  }
};

} // namespace gmlake
