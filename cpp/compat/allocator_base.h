// The overrides of torch's CUDAAllocator that every supported torch 2.x declares alike, up to
// the type of a device index (`int` before 2.6, c10::DeviceIndex from then on) and of a pool
// id. Each is a forward to gmlake::Impl. Each version's GmlakeAllocator (version_compat.h for
// 2.11, compat/torch_2_*.h) derives from one of these classes and adds what differs. Every
// method is marked `override`, so the compiler checks each signature against the version's
// headers (scripts/check-torch-versions.sh builds all of them). Included by version_compat.h
// (which defines GMLAKE_TORCH_VERSION_NUM) for torch 2.x only.
#pragma once

#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <limits>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "compat/stats_conversion.h"
#include "gmlake_impl.h"

namespace gmlake {
namespace compat {

// PyTorch's GPU trace hooks (torch.cuda._sanitizer), called on every allocation and free.
// 2.6 added the device type argument.
#if GMLAKE_TORCH_VERSION_NUM >= 206
#define GMLAKE_GPU_TRACE_ARGS(p) c10::kCUDA, reinterpret_cast<uintptr_t>(p)
#else
#define GMLAKE_GPU_TRACE_ARGS(p) reinterpret_cast<uintptr_t>(p)
#endif

inline void trace_gpu_alloc(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_allocation(GMLAKE_GPU_TRACE_ARGS(p));
  }
}

inline void trace_gpu_free(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_deallocation(GMLAKE_GPU_TRACE_ARGS(p));
  }
}

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
