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

inline cca::SnapshotInfo to_torch(const SnapshotData& d, c10::ApproximateClockToUnixTimeConverter& clock) {
  auto info = snapshot_to<cca::SnapshotInfo>(d, SnapshotOptions{}, &clock);
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

class GmlakeAllocator final : public compat::CheckpointingAllocator<c10::DeviceIndex, compat::MempoolId> {
 public:
  using CheckpointingAllocator::CheckpointingAllocator;

  c10::DataPtr allocate(size_t n) override {
    return impl_.allocate(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    impl_.copy_data(dest, src, count);
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    return impl_.memory_fraction(device);
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
  int getPoolUseCount(c10::DeviceIndex device, compat::MempoolId mempool_id) override {
    return impl_.pool_use_count(device, PoolId{mempool_id.first, mempool_id.second});
  }
  void ensureExistsAndIncrefPool(c10::DeviceIndex device, compat::MempoolId mempool_id) override {
    impl_.create_or_incref_pool(device, PoolId{mempool_id.first, mempool_id.second});
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
    impl_.attach_trace_tracker([tracker = std::move(tracker)](const TraceRec& r) { tracker(compat::trace_entry_to<compat::cca::TraceEntry>(r)); });
  }

 private:
  c10::ApproximateClockToUnixTimeConverter clock_converter_;
};

namespace compat {

// 2.6 has no c10::SetAllocator registration for CUDA: torch reads CUDACachingAllocator::get().
inline void install(GmlakeAllocator* a) {
  cca::allocator.store(a);
}

} // namespace compat
} // namespace gmlake
