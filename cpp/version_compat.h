// Everything that depends on the torch version, in one place.
//
// Keyed on TORCH_VERSION_MAJOR / TORCH_VERSION_MINOR from <torch/version.h> of the torch the
// library is built against. The allocator's logic (gmlake::Impl, gmlake_impl.h) uses only
// types that are stable across torch 2.x; this header holds, per supported version:
//   - gmlake::GmlakeAllocator: the subclass of the version's CUDAAllocator, each method a
//     forward to Impl (the vtable changes in almost every minor release, and nothing catches a
//     mismatch at link time: build one library per minor version). The forwards every 2.x
//     shares live in compat/allocator_base.h; each version's class adds the rest;
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

#if GMLAKE_TORCH_VERSION_NUM >= 200
#include "compat/allocator_base.h"
#endif

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

#include <c10/cuda/CUDAAllocatorConfig.h>

namespace gmlake {
namespace compat {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;

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
    // A gmlake segment is a run of mapped pages in a reserved range that grows and shrinks
    // page by page: what PyTorch's expandable segments are, and PyTorch's consistency rules
    // for those hold (segment counts and inactive_split are not per cudaMalloc).
    seg.is_expandable = true;
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
  // PyTorch's settings as torch parsed them (PYTORCH_CUDA_ALLOC_CONF, _set_allocator_settings),
  // which gmlake accepts; docs/pytorch.md says which it honours. The settings string is
  // gmlake's effective configuration.
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
  {
    // PyTorch reports one entry per interval, as the configuration holds them.
    const auto& divs = AC::roundup_power2_divisions();
    for (size_t v : divs) {
      cm.roundup_power2_divisions.push_back(v);
    }
  }
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

class GmlakeAllocator final : public compat::CheckpointingAllocator<c10::DeviceIndex, c10::MempoolId_t> {
 public:
  using CheckpointingAllocator::CheckpointingAllocator;

  c10::DataPtr allocate(size_t n) override {
    return impl_.allocate(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    impl_.copy_data(dest, src, count);
  }
  void emptyCache(c10::MempoolId_t mempool_id) override {
    impl_.empty_cache(PoolId{mempool_id.first, mempool_id.second});
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    return impl_.memory_fraction(device);
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
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    impl_.set_no_split(device, PoolId{mempool_id.first, mempool_id.second});
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

 private:
  c10::ApproximateClockToUnixTimeConverter clock_converter_;
};

namespace compat {

// Makes `a` torch's CUDA allocator (see the notes' run-time install recipe).
inline void install(GmlakeAllocator* a) {
  cca::allocator.store(a);
  // 2.9+: torch.accelerator.* and c10::GetAllocator(kCUDA) read the registry.
  c10::SetAllocator(c10::DeviceType::CUDA, a, /*priority=*/1);
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
