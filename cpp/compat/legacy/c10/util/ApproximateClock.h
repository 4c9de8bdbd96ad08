// gmlake: what torch 1.13, 2.0 and 2.1 lack for cpp/gmlake_impl.{h,cpp}.
//
// This folder (cpp/compat/legacy) is put on the include path only when building against torch
// older than 2.2, which has no c10/util/ApproximateClock.h; gmlake_impl.h includes that header,
// so this one stands in for it and also supplies the other small pieces those versions lack:
//   - c10::approx_time_t and c10::getApproximateTime() (2.2+): here a steady-clock time in ns;
//   - c10::GatheredContext (2.1+): on 1.13 and 2.0 the allocator's context type is
//     CUDACachingAllocator::Context, which plays the same role;
//   - c10::cuda::GetDevice(DeviceIndex*) (2.3+; 2.1 has GetDevice(int*), older ones none).
// Everything is inline and used only by gmlake's own translation units.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <torch/version.h>

#include <chrono>
#include <cstdint>

#if !defined(TORCH_VERSION_MAJOR) || (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR) >= 202
#error "cpp/compat/legacy is for torch < 2.2 only: remove it from the include path"
#endif

namespace c10 {

using approx_time_t = int64_t;

inline approx_time_t getApproximateTime() {
  return static_cast<approx_time_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

#if (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR) < 201
using GatheredContext = ::c10::cuda::CUDACachingAllocator::Context;
#endif

namespace cuda {
// The current device as a DeviceIndex (the form gmlake_impl.cpp uses).
inline cudaError_t GetDevice(DeviceIndex* device) {
  int d = 0;
  cudaError_t err = cudaGetDevice(&d);
  if (err == cudaSuccess) {
    *device = static_cast<DeviceIndex>(d);
  }
  return err;
}
} // namespace cuda

} // namespace c10
