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

class GmlakeAllocator final : public compat::PoolRoutingAllocator<c10::DeviceIndex, compat::MempoolId> {
 public:
  using PoolRoutingAllocator::PoolRoutingAllocator;

  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot() override {
    SnapshotData d = impl_.snapshot(PoolId{0, 0}, /*include_traces=*/true);
    auto info = snapshot_info(d, compat::SnapshotOptions{});
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
  void ensureExistsAndIncrefPool(c10::DeviceIndex device, compat::MempoolId mempool_id) override {
    impl_.create_or_incref_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
};

} // namespace gmlake
