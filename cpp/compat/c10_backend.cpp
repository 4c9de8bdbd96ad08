// gmlake as a backend of PyTorch's CUDA caching allocator, built into a patched libc10_cuda
// (torch 2.x; patches/pytorch-<version>.patch, cmake/GmlakeC10Cuda.cmake).
//
// The patch makes BackendStaticInitializer (CUDACachingAllocator.cpp) pick this backend for
// PYTORCH_CUDA_ALLOC_CONF=backend:gmlake, and also when no backend is named, unless GMLake's
// switch vmmDefragment is an integer <= 0 (then PyTorch's native allocator is used, as in
// GMLake's builds). torch.cuda.get_allocator_backend() returns "gmlake" when it is in use.
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "../version_compat.h"
#include "c_api.h"

namespace gmlake {
namespace c10_backend {

// GMLake's switch: vmmDefragment <= 0 turns the VMM allocator off. A value that is not an
// integer keeps gmlake on (its configuration check then reports the bad value by name).
bool vmm_defragment_on() {
  const char* v = std::getenv("vmmDefragment");
  if (v == nullptr || *v == '\0') {
    return true;
  }
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  while (end != nullptr && (*end == ' ' || *end == '\t')) {
    ++end;
  }
  if (end == v || end == nullptr || *end != '\0') {
    return true;
  }
  return n > 0;
}

} // namespace c10_backend
} // namespace gmlake

namespace c10 {
namespace cuda {
namespace CUDACachingAllocator {
namespace Gmlake {

// The gmlake backend: created on first use (at library load when it is the default), never
// destroyed (tensors may be freed during interpreter shutdown).
C10_CUDA_API CUDAAllocator* allocator() {
  static gmlake::GmlakeAllocator* instance = new gmlake::GmlakeAllocator("");
  return instance;
}

// The backend used when PYTORCH_CUDA_ALLOC_CONF names none.
C10_CUDA_API CUDAAllocator* defaultBackend(CUDAAllocator* native) {
  return gmlake::c10_backend::vmm_defragment_on() ? allocator() : native;
}

} // namespace Gmlake
} // namespace CUDACachingAllocator
} // namespace cuda
} // namespace c10

// The name of the CUDA allocator in use ("gmlake", "native", "cudaMallocAsync"), for tools
// that look at libc10_cuda without torch's Python layer (ctypes). Valid until the next call
// from the same thread.
extern "C" C10_CUDA_API const char* gmlake_c10_backend(void) {
  thread_local std::string name;
  try {
    auto* a = c10::cuda::CUDACachingAllocator::allocator.load();
    name = a != nullptr ? a->name() : std::string("none");
  } catch (...) {
    name = "unknown";
  }
  return name.c_str();
}

// gmlake's statistics of `device` as a flat JSON object: torch.cuda.memory_stats()'s keys plus
// gmlake's own counters ("gmlake.stitches", "gmlake.pages_stitched", "gmlake.page_size", ...),
// as gmlake_stats_json of the run-time route. "{}" when gmlake is not the allocator in use or
// has not created the device's allocator yet; {"error": "..."} on an error. For tests and
// tools that load libc10_cuda without torch's Python layer (scripts/c10-only/gpu_test.cpp).
// Valid until the next call from the same thread.
extern "C" C10_CUDA_API const char* gmlake_c10_stats_json(int device) {
  return gmlake::compat::json_or_error([&] {
    auto* a = c10::cuda::CUDACachingAllocator::allocator.load();
    gmlake::Impl* impl = gmlake::Impl::instance();
    if (a == nullptr || impl == nullptr || a->name() != "gmlake" || !impl->initialized()) {
      return std::string("{}");
    }
    return impl->stats_json(device);
  });
}
