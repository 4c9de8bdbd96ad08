// Everything that depends on the torch version, in one place.
//
// Keyed on TORCH_VERSION_MAJOR / TORCH_VERSION_MINOR from <torch/version.h> of the torch the
// library is built against. The allocator's logic (gmlake::Impl, gmlake_impl.h) uses only
// types that are stable across torch 2.x; this header holds, per supported version:
//   - gmlake::GmlakeAllocator: the subclass of the version's CUDAAllocator, each method a
//     forward to Impl (the vtable changes in almost every minor release, and nothing catches a
//     mismatch at link time: build one library per minor version);
//   - converters to the version's DeviceStats, SnapshotInfo and TraceEntry;
//   - the install step (allocator store, c10::SetAllocator on 2.9+), GPU trace hooks.
//
// To add a version: copy the 2.11 block, compare its CUDAAllocator / DeviceAllocator /
// c10::Allocator pure virtuals with the version's headers (torch/include/c10/cuda/
// CUDACachingAllocator.h, c10/core/CachingDeviceAllocator.h, c10/core/Allocator.h; the notes
// in ../shared/notes/pytorch-allocator-api.md list the changes by release), and adjust.
#pragma once

#include <torch/version.h>

#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>

#include <array>
#include <limits>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "gmlake_impl.h"
#include "compat/stats_conversion.h"

#if !defined(TORCH_VERSION_MAJOR) || !defined(TORCH_VERSION_MINOR)
#error "gmlake: <torch/version.h> does not define TORCH_VERSION_MAJOR/MINOR"
#endif

#define GMLAKE_TORCH_VERSION_NUM (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR)

// The C++ ABI the library is built with (must equal torch._C._GLIBCXX_USE_CXX11_ABI).
#if defined(_GLIBCXX_USE_CXX11_ABI)
#define GMLAKE_CXX11_ABI _GLIBCXX_USE_CXX11_ABI
#else
#define GMLAKE_CXX11_ABI 0
#endif

namespace gmlake {
namespace compat {

// "MAJOR.MINOR", the part of torch's version that fixes the allocator interface.
inline std::string built_torch_minor() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}

// A symbol of libc10 that takes a std::string, in each C++ ABI's mangling: which one the
// loaded libc10 exports tells its ABI (c10::Device::Device(const std::string&), all 2.x).
constexpr const char* kAbiProbeCxx11 =
    "_ZN3c106DeviceC1ERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";
constexpr const char* kAbiProbeOld = "_ZN3c106DeviceC1ERKSs";

} // namespace compat
} // namespace gmlake

// =============================================================================================
#if GMLAKE_TORCH_VERSION_NUM == 211
// =============================================================================================

namespace gmlake {
namespace compat {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;

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

inline cda::TraceEntry to_torch(const TraceRec& r) {
  return cda::TraceEntry(
      static_cast<cda::TraceEntry::Action>(r.action),
      static_cast<c10::DeviceIndex>(r.device),
      static_cast<size_t>(r.addr),
      static_cast<size_t>(r.size),
      r.stream,
      c10::MempoolId_t{r.pool.first, r.pool.second},
      r.time,
      r.context,
      r.compile_context,
      r.user_metadata);
}

inline cca::SnapshotInfo to_torch(const SnapshotData& d, c10::ApproximateClockToUnixTimeConverter& clock) {
  cca::SnapshotInfo info;
  for (const auto& s : d.segments) {
    cda::SegmentInfo seg;
    seg.device = static_cast<c10::DeviceIndex>(s.device);
    seg.address = static_cast<size_t>(s.address);
    seg.total_size = static_cast<size_t>(s.total_size);
    seg.requested_size = static_cast<size_t>(s.requested_size);
    seg.allocated_size = static_cast<size_t>(s.allocated_size);
    seg.active_size = static_cast<size_t>(s.active_size);
    seg.stream = s.stream;
    seg.is_large = s.is_large;
    // gmlake's segments are runs of mapped pages, not PyTorch's expandable segments.
    seg.is_expandable = false;
    seg.owner_private_pool_id = c10::MempoolId_t{s.pool.first, s.pool.second};
    for (const auto& b : s.blocks) {
      cda::BlockInfo bi;
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
    std::vector<cda::TraceEntry> entries;
    entries.reserve(dev.size());
    for (const auto& r : dev) {
      cda::TraceEntry te = to_torch(r);
      te.time_.t_ = to_us(r.time);
      entries.push_back(std::move(te));
    }
    info.device_traces.push_back(std::move(entries));
  }
  for (const auto& a : d.annotations) {
    cda::AnnotationEntry ae(static_cast<c10::DeviceIndex>(a.device), a.time);
    for (const auto& kv : a.metadata) {
      ae.recordUserMetadata(kv.first, kv.second);
    }
    ae.time_.t_ = to_us(a.time);
    info.external_annotations.push_back(std::move(ae));
  }
  auto& cm = info.config_metadata;
  cm.garbage_collection_threshold = 0.0;
  // gmlake splits any block: no size is exempt from splitting (PyTorch's default, SIZE_MAX).
  cm.max_split_size = std::numeric_limits<size_t>::max();
  cm.pinned_num_register_threads = 1;
  cm.expandable_segments = false;
  cm.release_lock_on_malloc = false;
  cm.pinned_use_host_register = false;
  cm.graph_capture_record_stream_reuse = false;
  cm.last_allocator_settings = d.settings;
  cm.roundup_power2_divisions.clear();
  return info;
}

inline std::vector<Action> parse_skip_actions(const std::vector<std::string>& names) {
  std::vector<Action> out;
  for (const auto& n : names) {
    out.push_back(static_cast<Action>(cda::parseTraceEntryAction(n)));
  }
  return out;
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

  // ---- c10::DeviceAllocator
  bool initialized() override {
    return impl_.initialized();
  }
  void emptyCache(c10::MempoolId_t mempool_id) override {
    impl_.empty_cache(PoolId{mempool_id.first, mempool_id.second});
  }
  using c10::cuda::CUDACachingAllocator::CUDAAllocator::recordStream;
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    bool present = false;
    ffi::Stats s = impl_.stats(device, &present);
    if (!present) {
      c10::CachingDeviceAllocator::DeviceStats empty;
      empty.max_split_size = static_cast<int64_t>(std::numeric_limits<int64_t>::max());
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
  double getMemoryFraction(c10::DeviceIndex device) override {
    return impl_.memory_fraction(device);
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    impl_.set_memory_fraction(fraction, device);
  }
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex /*device*/) override {
    // gmlake has no expandable segments (its segments are stitched page runs).
    return {};
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
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(
      c10::MempoolId_t mempool_id,
      bool include_traces) override {
    SnapshotData d = impl_.snapshot(PoolId{mempool_id.first, mempool_id.second}, include_traces);
    return compat::to_torch(d, clock_converter_);
  }
  void beginAllocateToPool(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    impl_.begin_allocate_to_pool(device, PoolId{mempool_id.first, mempool_id.second}, std::move(filter));
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    impl_.end_allocate_to_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    impl_.release_pool(device, PoolId{mempool_id.first, mempool_id.second});
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    return impl_.pool_use_count(device, PoolId{mempool_id.first, mempool_id.second});
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
  void setNoSplit(c10::DeviceIndex /*device*/, c10::MempoolId_t /*mempool_id*/) override {
    TORCH_CHECK(false, "gmlake: memory pools without splitting (MemPool(no_split=True)) are not supported yet");
  }
  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
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
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    impl_.record_annotation(md);
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
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    impl_.attach_oom_observer(std::move(observer));
  }
  void attachAllocatorTraceTracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) override {
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
  // torch.compile's CUDA graph trees take a checkpoint after every recording and restore one
  // when a tree branches. The checkpoint is the pool's allocated blocks; a restore frees the
  // blocks allocated since and allocates the checkpoint's blocks freed since, at their
  // addresses (the core's allocate_at).
  struct PoolCheckpoint final : c10::cuda::CUDACachingAllocator::AllocatorState {
    int device = 0;
    PoolId pool{0, 0};
    std::vector<Impl::PoolBlock> blocks;
  };
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device,
      c10::MempoolId_t id) override {
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
    // As PyTorch's allocator: the checkpoint's blocks count as freed and allocated again at the
    // same addresses; the caller attaches these DataPtrs to the storages that own them.
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

// Whether the allocator torch uses now has been initialized (CUDA is up).
inline bool current_allocator_initialized() {
  cca::CUDAAllocator* cur = cca::allocator.load();
  return cur != nullptr && cur->initialized();
}

inline std::string current_allocator_name() {
  cca::CUDAAllocator* cur = cca::allocator.load();
  return cur != nullptr ? cur->name() : std::string("none");
}

// Makes `a` torch's CUDA allocator (see the notes' run-time install recipe).
inline void install(GmlakeAllocator* a) {
  cca::allocator.store(a);
  // 2.9+: torch.accelerator.* and c10::GetAllocator(kCUDA) read the registry.
  c10::SetAllocator(c10::DeviceType::CUDA, a, /*priority=*/1);
}

// An exported address inside libc10_cuda (to locate the loaded library with dladdr).
inline const void* c10_cuda_anchor() {
  return static_cast<const void*>(&cca::allocator);
}

} // namespace compat
} // namespace gmlake

// =============================================================================================
// Older versions, each in its own file (patched in-tree builds, patches/ and docs/patched-builds.md).
#elif GMLAKE_TORCH_VERSION_NUM == 206
#include "compat/torch_2_6.h"
#elif GMLAKE_TORCH_VERSION_NUM == 201
#include "compat/torch_2_1.h"
#elif GMLAKE_TORCH_VERSION_NUM == 200
#include "compat/torch_2_0.h"
#elif GMLAKE_TORCH_VERSION_NUM == 113
#include "compat/torch_1_13.h"
#else
#error "gmlake: this torch version is not supported yet (supported: 1.13, 2.0, 2.1, 2.6, 2.11). Add its allocator interface to cpp/version_compat.h."
#endif
