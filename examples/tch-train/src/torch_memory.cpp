// torch's own view of the current CUDA allocator, whichever it is (PyTorch's native caching
// allocator or gmlake): the allocator registered for CUDA in c10's registry, read through
// c10::DeviceAllocator (torch 2.9+). tch has no such API. Used to compare both allocators on
// equal terms; gmlake's own counters come from gmlake_tch.
#include <c10/core/CachingDeviceAllocator.h>

#include <cxxabi.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <typeinfo>

namespace {
thread_local std::string g_error;

c10::DeviceAllocator* cuda_allocator() {
  return c10::getDeviceAllocator(c10::DeviceType::CUDA);
}

template <typename F>
int guarded(F&& f) noexcept {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
  } catch (...) {
    g_error = "unknown C++ exception";
  }
  return -1;
}
} // namespace

// Field order mirrors `TorchMemory` in src/main.rs.
struct TorchMemory {
  int64_t allocated_current, allocated_peak;
  int64_t reserved_current, reserved_peak;
  int64_t active_current, active_peak;
  int64_t requested_peak;
  int64_t allocations;
  int64_t segments_current;
  int64_t num_device_alloc, num_device_free;
  int64_t num_alloc_retries, num_ooms;
};

extern "C" int tch_train_memory_stats(int device, TorchMemory* out) {
  return guarded([&] {
    const auto s = cuda_allocator()->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out->allocated_current = s.allocated_bytes[all].current;
    out->allocated_peak = s.allocated_bytes[all].peak;
    out->reserved_current = s.reserved_bytes[all].current;
    out->reserved_peak = s.reserved_bytes[all].peak;
    out->active_current = s.active_bytes[all].current;
    out->active_peak = s.active_bytes[all].peak;
    out->requested_peak = s.requested_bytes[all].peak;
    out->allocations = s.allocation[all].allocated;
    out->segments_current = s.segment[all].current;
    out->num_device_alloc = s.num_device_alloc;
    out->num_device_free = s.num_device_free;
    out->num_alloc_retries = s.num_alloc_retries;
    out->num_ooms = s.num_ooms;
  });
}

extern "C" int tch_train_empty_cache() {
  return guarded([&] { cuda_allocator()->emptyCache(); });
}

// The C++ type of the registered CUDA allocator, demangled (e.g.
// c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator, gmlake::GmlakeAllocator).
// Copies it with a NUL when `len` exceeds its length; returns the length, -1 on error.
extern "C" long long tch_train_allocator_type(char* buf, size_t len) {
  std::string name;
  if (guarded([&] {
        c10::DeviceAllocator* a = cuda_allocator();
        const char* mangled = typeid(*a).name();
        int status = 0;
        char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
        name = (status == 0 && d != nullptr) ? d : mangled;
        std::free(d);
      }) != 0) {
    return -1;
  }
  if (buf != nullptr && len > name.size()) {
    std::memcpy(buf, name.data(), name.size());
    buf[name.size()] = '\0';
  }
  return static_cast<long long>(name.size());
}

extern "C" const char* tch_train_last_error() {
  return g_error.c_str();
}
