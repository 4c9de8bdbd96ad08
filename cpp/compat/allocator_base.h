// The overrides of torch's CUDAAllocator that every supported torch 2.x declares alike, up to
// the type of a device index (`int` before 2.6, c10::DeviceIndex from then on) and of a pool
// id. Each is a forward to gmlake::Impl. Each version's GmlakeAllocator (version_compat.h for
// 2.11, compat/torch_2_*.h) derives from one of these classes and adds what differs. Every
// method is marked `override`, so the compiler checks each signature against the version's
// headers (scripts/check-torch-versions.sh builds all of them). Overrides shared by a range of
// versions only are under #if on GMLAKE_TORCH_VERSION_NUM. Included by version_compat.h
// (which defines GMLAKE_TORCH_VERSION_NUM) for torch 2.x only.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <limits>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "compat/gpu_trace.h"
#include "compat/snapshot_conversion.h"
#include "compat/stats_conversion.h"
#include "gmlake_impl.h"

namespace gmlake {
namespace compat {

namespace cca = c10::cuda::CUDACachingAllocator;
using MempoolId = c10::cuda::MempoolId_t;

// torch 2.0 and later.
template <class Dev>
class ForwardingAllocator : public c10::cuda::CUDACachingAllocator::CUDAAllocator {
 public:
  using Base = c10::cuda::CUDACachingAllocator::CUDAAllocator;
  // The version's DeviceStats (c10::cuda::CUDACachingAllocator's, later c10's).
  using DeviceStats = decltype(std::declval<Base&>().getDeviceStats(Dev{}));

  explicit ForwardingAllocator(std::string conf) : impl_(std::move(conf)) {}

  Impl& impl() {
    return impl_;
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &local_raw_delete;
  }
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
  void setMemoryFraction(double fraction, Dev device) override {
    impl_.set_memory_fraction(fraction, device);
  }
  void cacheInfo(Dev device, size_t* largestBlock) override {
    impl_.cache_info(device, largestBlock);
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    return impl_.base_allocation(ptr, size);
  }
  // (Later versions also declare recordStream(DataPtr, c10::Stream) in a base class.)
  using Base::recordStream;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    impl_.record_stream(ptr.get(), ptr.get_deleter(), ptr.device().index(), stream.stream());
  }
  DeviceStats getDeviceStats(Dev device) override {
    bool present = false;
    ffi::Stats s = impl_.stats(device, &present);
    DeviceStats t;
    if (!present) {
      // gmlake splits any block (PyTorch reports "unlimited" as the largest int64).
      t.max_split_size = std::numeric_limits<int64_t>::max();
    } else {
      t = device_stats_to<DeviceStats>(s);
    }
#if GMLAKE_TORCH_VERSION_NUM >= 211
    // As PyTorch's allocator: the setting torch holds (max_split_size_mb; SIZE_MAX, read as
    // -1, when unset). gmlake does not apply it (docs/pytorch.md).
    t.max_split_size = static_cast<int64_t>(c10::CachingAllocator::AcceleratorAllocatorConfig::max_split_size());
#endif
    return t;
  }
  void resetAccumulatedStats(Dev device) override {
    impl_.reset_accumulated_stats(device);
  }
  void resetPeakStats(Dev device) override {
    impl_.reset_peak_stats(device);
  }
  std::string name() override {
    return "gmlake";
  }
#if GMLAKE_TORCH_VERSION_NUM < 211
  // Before 2.11: one cache and one snapshot for every pool.
  void emptyCache() override {
    impl_.empty_cache(PoolId{0, 0});
  }
#endif
#if GMLAKE_TORCH_VERSION_NUM < 206
  // Before 2.6: Allocator::allocate is const; snapshots have no times, annotations or config.
  c10::DataPtr allocate(size_t n) const override {
    return impl_.allocate(n);
  }
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot() override {
    return snapshot_to<c10::cuda::CUDACachingAllocator::SnapshotInfo>(
        impl_.snapshot(PoolId{0, 0}, /*include_traces=*/true));
  }
  // Before 2.5 PyTorch shares with cudaIpcGetMemHandle itself (which cannot share gmlake's
  // page-mapped memory: sending fails with CUDA's error); what it receives is a raw
  // cudaIpcMemHandle_t of a process using the native allocator, which gmlake opens.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return impl_.open_cuda_ipc_handle(handle);
  }
  // Before 2.6 the observer takes int64_t sizes.
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    impl_.attach_oom_observer([observer = std::move(observer)](int64_t device, size_t allocated, size_t total, size_t free) {
      observer(device, static_cast<int64_t>(allocated), static_cast<int64_t>(total), static_cast<int64_t>(free));
    });
  }
#endif

 protected:
  mutable Impl impl_;
};

#if GMLAKE_TORCH_VERSION_NUM >= 201
// torch 2.1 and later: peer access, copies between devices, and pool checkpoints (CUDA graph
// trees, torch.compile(mode="reduce-overhead")).
template <class Dev, class Mempool>
class CheckpointingAllocator : public ForwardingAllocator<Dev> {
 public:
  using ForwardingAllocator<Dev>::ForwardingAllocator;
  using AllocatorState = c10::cuda::CUDACachingAllocator::AllocatorState;

  void enablePeerAccess(Dev dev, Dev dev_to_access) override {
    this->impl_.enable_peer_access(dev, dev_to_access);
  }
  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override {
    return this->impl_.memcpy_async(dst, dstDevice, src, srcDevice, count, stream, p2p_enabled);
  }
  bool isHistoryEnabled() override {
    return this->impl_.history_enabled();
  }
#if GMLAKE_TORCH_VERSION_NUM < 211
  // 2.1 to 2.10: no clear / skip lists.
  void recordHistory(
      bool enabled,
      c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      c10::cuda::CUDACachingAllocator::RecordContext when) override {
    this->impl_.record_history(
        enabled,
        context_recorder,
        alloc_trace_max_entries,
        static_cast<When>(static_cast<int>(when)),
        /*clear=*/false,
        {});
  }
#endif
  void releasePool(Dev device, Mempool mempool_id) override {
    this->impl_.release_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  bool checkPoolLiveAllocations(
      Dev device,
      Mempool mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    std::vector<void*> expected(expected_live_allocations.begin(), expected_live_allocations.end());
    return this->impl_.check_pool_live_allocations(device, PoolId{mempool_id.first, mempool_id.second}, expected);
  }

  // CUDA graph trees take a checkpoint after every recording and restore one when a tree
  // branches. The checkpoint is the pool's allocated blocks; a restore frees the blocks
  // allocated since and allocates the checkpoint's blocks freed since, at their addresses (the
  // core's allocate_at).
  struct PoolCheckpoint final : AllocatorState {
    int device = 0;
    PoolId pool{0, 0};
    std::vector<Impl::PoolBlock> blocks;
  };
  std::shared_ptr<AllocatorState> getCheckpointState(Dev device, Mempool id) override {
    auto state = std::make_shared<PoolCheckpoint>();
    state->device = device;
    state->pool = PoolId{id.first, id.second};
    state->blocks = this->impl_.live_blocks_in_pool(device, state->pool);
    return state;
  }
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      Dev device,
      std::shared_ptr<AllocatorState> pps) override {
    auto state = std::dynamic_pointer_cast<PoolCheckpoint>(pps);
    TORCH_CHECK(state, "gmlake: setCheckpointPoolState expects a state from gmlake's getCheckpointState");
    TORCH_CHECK(state->device == device, "gmlake: checkpoint of device ", state->device, " restored on ", device);
    c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
    delta.ptrs_freed = this->impl_.restore_pool_checkpoint(device, state->pool, state->blocks);
    // As PyTorch's allocator: the checkpoint's blocks count as freed and allocated again at the
    // same addresses; the caller attaches these DataPtrs to the storages that own them.
    for (const auto& b : state->blocks) {
      void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(b.address));
      delta.ptrs_freed.push_back(p);
      delta.dataptrs_allocd.emplace_back(
          p, p, &local_raw_delete, c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
    }
    return delta;
  }
};
#endif

#if GMLAKE_TORCH_VERSION_NUM >= 206
// torch 2.6 and later: pools routed by a stream filter torch gives, CUDA IPC through gmlake's
// handles, annotations, trace trackers, times in snapshots.
template <class Dev, class Mempool>
class PoolRoutingAllocator : public CheckpointingAllocator<Dev, Mempool> {
 public:
  using CheckpointingAllocator<Dev, Mempool>::CheckpointingAllocator;

  c10::DataPtr allocate(size_t n) override {
    return this->impl_.allocate(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    this->impl_.copy_data(dest, src, count);
  }
  double getMemoryFraction(Dev device) override {
    return this->impl_.memory_fraction(device);
  }
  void enable(bool value) override {
    this->impl_.enable(value);
  }
  bool isEnabled() const override {
    return this->impl_.is_enabled();
  }
  void beginAllocateToPool(Dev device, Mempool mempool_id, std::function<bool(cudaStream_t)> filter) override {
    this->impl_.begin_allocate_to_pool(device, PoolId{mempool_id.first, mempool_id.second}, std::move(filter));
  }
  void endAllocateToPool(Dev device, Mempool mempool_id) override {
    this->impl_.end_allocate_to_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  int getPoolUseCount(Dev device, Mempool mempool_id) override {
    return this->impl_.pool_use_count(device, PoolId{mempool_id.first, mempool_id.second});
  }
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    auto [offset, handle] = this->impl_.share_ipc(ptr);
    return c10::cuda::CUDACachingAllocator::ShareableHandle{offset, std::move(handle)};
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return this->impl_.get_ipc_dev_ptr(handle);
  }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    this->impl_.record_annotation(md);
  }
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    this->impl_.attach_oom_observer(std::move(observer));
  }
  void attachAllocatorTraceTracker(c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) override {
    this->impl_.attach_trace_tracker([tracker = std::move(tracker)](const TraceRec& r) {
      tracker(trace_entry_to<c10::cuda::CUDACachingAllocator::TraceEntry>(r));
    });
  }

 protected:
  // The version's SnapshotInfo of `d` (config_metadata left to the version's adapter).
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot_info(const SnapshotData& d, const SnapshotOptions& opt) {
    return snapshot_to<c10::cuda::CUDACachingAllocator::SnapshotInfo>(d, opt, &clock_converter_);
  }

 private:
  c10::ApproximateClockToUnixTimeConverter clock_converter_;
};
#endif

// Whether the allocator torch uses now has been initialized (CUDA is up).
inline bool current_allocator_initialized() {
  auto* cur = c10::cuda::CUDACachingAllocator::allocator.load();
  return cur != nullptr && cur->initialized();
}

inline std::string current_allocator_name() {
  auto* cur = c10::cuda::CUDACachingAllocator::allocator.load();
  return cur != nullptr ? cur->name() : std::string("none");
}

// An exported address inside libc10_cuda (to locate the loaded library with dladdr).
inline const void* c10_cuda_anchor() {
  return static_cast<const void*>(&c10::cuda::CUDACachingAllocator::allocator);
}

} // namespace compat
} // namespace gmlake
