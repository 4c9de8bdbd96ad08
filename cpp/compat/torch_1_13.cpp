// gmlake as the CUDA caching allocator of torch 1.13, built into a patched libc10_cuda
// (patches/pytorch-1.13.1.patch, cmake/GmlakeC10Cuda.cmake).
//
// torch 1.13 has no allocator class: c10::cuda::CUDACachingAllocator is a namespace of free
// functions. The patch moves PyTorch's definitions of those functions into a nested namespace
// `Native` (two lines in CUDACachingAllocator.cpp); this file defines the functions the header
// declares, each one sending the call to gmlake (gmlake::Impl over the Rust core, the same as
// on 2.x) or to Native. gmlake is in use unless GMLake's switch vmmDefragment is an integer
// <= 0; the choice is made once, when the first of these functions is called.
//
// Differences from gmlake on 2.x: no allocation history (1.13's snapshot() blocks carry a
// borrowed History list; setContextRecorder is accepted and ignored), no peer-access hook,
// cacheInfo's cachedAndFree is reserved - allocated bytes. CUDA IPC handles received from other
// processes are opened by PyTorch's code (Native::getIpcDevPtr); exporting gmlake memory to
// other processes is not supported.
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <c10/cuda/CUDACachingAllocator.h>

#include "../version_compat.h"
#include "c_api.h"
#include "pool_routes.h"

#if GMLAKE_TORCH_VERSION_NUM != 113
#error "torch_1_13.cpp is for torch 1.13 only"
#endif

namespace c10 {
namespace cuda {
namespace CUDACachingAllocator {

// PyTorch's caching allocator (CUDACachingAllocator.cpp, moved into Native by the patch).
namespace Native {
Allocator* get();
void init(int device_count);
void setMemoryFraction(double fraction, int device);
void setContextRecorder(CreateContextFn recorder);
void setAllocatorSettings(const std::string& env);
void emptyCache();
void cacheInfo(int dev_id, size_t* cachedAndFree, size_t* largestBlock);
void* getBaseAllocation(void* ptr, size_t* size);
void recordStream(const DataPtr& ptr, CUDAStream stream);
std::mutex* getFreeMutex();
DeviceStats getDeviceStats(int device);
void resetAccumulatedStats(int device);
void resetPeakStats(int device);
std::vector<SegmentInfo> snapshot();
void notifyCaptureBegin(int device, CaptureId_t graph_id, MempoolId_t mempool_id);
void notifyCaptureEnd(int device, CaptureId_t graph_id);
void notifyCaptureDestroy(int device, MempoolId_t mempool_id);
std::shared_ptr<void> getIpcDevPtr(std::string handle);
void* raw_alloc(size_t nbytes);
void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream);
void raw_delete(void* ptr);
} // namespace Native

} // namespace CUDACachingAllocator
} // namespace cuda
} // namespace c10

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using gmlake::Impl;
using gmlake::PoolId;

bool use_gmlake() {
  static const bool on = [] {
    const char* v = std::getenv("vmmDefragment");
    if (v == nullptr || *v == '\0') {
      return true;
    }
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end == v || end == nullptr || *end != '\0') {
      return true; // not an integer: gmlake's configuration check names the bad value
    }
    return n > 0;
  }();
  return on;
}

Impl& gm() {
  static Impl* instance = new Impl(""); // never destroyed
  return *instance;
}

// What CUDACachingAllocator::get() returns when gmlake is in use.
struct GmlakeDeviceAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) const override {
    return gm().allocate(nbytes);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &gmlake::local_raw_delete;
  }
};

GmlakeDeviceAllocator& device_allocator() {
  static GmlakeDeviceAllocator* a = new GmlakeDeviceAllocator();
  return *a;
}

// CUDA graph captures underway: (device, graph) -> pool.
gmlake::compat::KeyedPoolRoutes<c10::cuda::CaptureId_t>& capture_routes() {
  static auto* r = new gmlake::compat::KeyedPoolRoutes<c10::cuda::CaptureId_t>();
  return *r;
}

} // namespace

namespace c10 {
namespace cuda {
namespace CUDACachingAllocator {

void* raw_alloc(size_t nbytes) {
  return use_gmlake() ? gm().raw_alloc(nbytes) : Native::raw_alloc(nbytes);
}

void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  return use_gmlake() ? gm().raw_alloc_with_stream(nbytes, stream) : Native::raw_alloc_with_stream(nbytes, stream);
}

void raw_delete(void* ptr) {
  if (use_gmlake()) {
    gm().free(ptr);
  } else {
    Native::raw_delete(ptr);
  }
}

Allocator* get() {
  if (use_gmlake()) {
    return &device_allocator();
  }
  return Native::get();
}

void init(int device_count) {
  if (use_gmlake()) {
    gm().init(device_count);
  } else {
    Native::init(device_count);
  }
}

void setMemoryFraction(double fraction, int device) {
  if (use_gmlake()) {
    gm().set_memory_fraction(fraction, device);
  } else {
    Native::setMemoryFraction(fraction, device);
  }
}

void setAllocatorSettings(const std::string& env) {
  // PyTorch's own settings (gmlake reads GMLAKE_CONF and GMLake's variables).
  Native::setAllocatorSettings(env);
}

void emptyCache() {
  if (use_gmlake()) {
    gm().empty_cache(PoolId{0, 0});
  } else {
    Native::emptyCache();
  }
}

void cacheInfo(int dev_id, size_t* cachedAndFree, size_t* largestBlock) {
  if (!use_gmlake()) {
    Native::cacheInfo(dev_id, cachedAndFree, largestBlock);
    return;
  }
  // PyTorch's contract: both are maxima to update, not to overwrite; a zero *largestBlock
  // asks for an initial guess from the device's free memory (as PyTorch's allocator does).
  size_t largest = largestBlock != nullptr ? *largestBlock : 0;
  gm().cache_info(dev_id, &largest);
  if (largestBlock != nullptr && largest > *largestBlock) {
    *largestBlock = largest;
  }
  bool present = false;
  gmlake::ffi::Stats s = gm().stats(dev_id, &present);
  if (present && cachedAndFree != nullptr) {
    const int64_t free_cached = s.reserved_bytes[0].current - s.allocated_bytes[0].current;
    if (free_cached > 0) {
      *cachedAndFree += static_cast<size_t>(free_cached);
    }
  }
}

void* getBaseAllocation(void* ptr, size_t* size) {
  return use_gmlake() ? gm().base_allocation(ptr, size) : Native::getBaseAllocation(ptr, size);
}

void recordStream(const DataPtr& ptr, CUDAStream stream) {
  if (use_gmlake()) {
    gm().record_stream(ptr.get(), ptr.get_deleter(), ptr.device().index(), stream.stream());
  } else {
    Native::recordStream(ptr, stream);
  }
}

std::mutex* getFreeMutex() {
  // Taken by NCCL around communicator setup; gmlake's unmaps and releases do not need it, and
  // PyTorch's mutex is as good as any.
  return Native::getFreeMutex();
}

DeviceStats getDeviceStats(int device) {
  if (!use_gmlake()) {
    return Native::getDeviceStats(device);
  }
  bool present = false;
  gmlake::ffi::Stats s = gm().stats(device, &present);
  DeviceStats t;
  if (!present) {
    t.max_split_size = std::numeric_limits<int64_t>::max();
    return t;
  }
  return gmlake::compat::device_stats_to<DeviceStats>(s);
}

void resetAccumulatedStats(int device) {
  if (use_gmlake()) {
    gm().reset_accumulated_stats(device);
  } else {
    Native::resetAccumulatedStats(device);
  }
}

void resetPeakStats(int device) {
  if (use_gmlake()) {
    gm().reset_peak_stats(device);
  } else {
    Native::resetPeakStats(device);
  }
}

std::vector<SegmentInfo> snapshot() {
  if (!use_gmlake()) {
    return Native::snapshot();
  }
  return gmlake::compat::segments_to<SegmentInfo>(gm().snapshot(PoolId{0, 0}, /*include_traces=*/false));
}

void notifyCaptureBegin(int device, CaptureId_t graph_id, MempoolId_t mempool_id) {
  if (!use_gmlake()) {
    Native::notifyCaptureBegin(device, graph_id, mempool_id);
    return;
  }
  capture_routes().begin(
      gm(), device, graph_id, PoolId{mempool_id.first, mempool_id.second},
      [graph_id](cudaStream_t s) { return gmlake::compat::stream_captures(s, graph_id); },
      "gmlake: notifyCaptureBegin: capture already underway");
}

void notifyCaptureEnd(int device, CaptureId_t graph_id) {
  if (!use_gmlake()) {
    Native::notifyCaptureEnd(device, graph_id);
    return;
  }
  capture_routes().end(gm(), device, graph_id, "gmlake: notifyCaptureEnd: no such capture");
}

void notifyCaptureDestroy(int device, MempoolId_t mempool_id) {
  if (use_gmlake()) {
    gm().release_pool(device, PoolId{mempool_id.first, mempool_id.second});
  } else {
    Native::notifyCaptureDestroy(device, mempool_id);
  }
}

void setContextRecorder(CreateContextFn recorder) {
  // gmlake keeps no allocation history on 1.13; PyTorch's allocator gets the recorder.
  Native::setContextRecorder(recorder);
}

std::shared_ptr<void> getIpcDevPtr(std::string handle) {
  // Opening another process's allocation does not involve this process's allocator.
  return Native::getIpcDevPtr(std::move(handle));
}

namespace Gmlake {
// Whether gmlake is the CUDA allocator of this process (false when vmmDefragment <= 0).
C10_CUDA_API bool enabled() {
  return use_gmlake();
}
} // namespace Gmlake

} // namespace CUDACachingAllocator
} // namespace cuda
} // namespace c10

// The name of the CUDA allocator in use ("gmlake" or "native"); see c10_backend.cpp.
extern "C" C10_CUDA_API const char* gmlake_c10_backend(void) {
  return use_gmlake() ? "gmlake" : "native";
}


// gmlake's statistics of `device` as a flat JSON object (torch.cuda.memory_stats()'s keys plus
// "gmlake.stitches", "gmlake.pages_stitched", ...); "{}" when gmlake is not in use or has not
// created the device's allocator yet; {"error": "..."} on an error. See c10_backend.cpp.
extern "C" C10_CUDA_API const char* gmlake_c10_stats_json(int device) {
  return gmlake::compat::json_or_error(
      [&] { return use_gmlake() && gm().initialized() ? gm().stats_json(device) : std::string("{}"); });
}
