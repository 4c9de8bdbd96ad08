// Everything that depends on the torch version, in one place.
//
// Keyed on TORCH_VERSION_MAJOR / TORCH_VERSION_MINOR from <torch/version.h> of the torch the
// library is built against. The allocator's logic (gmlake::Impl, gmlake_impl.h) uses only
// types that are stable across torch 2.x; this header holds, per supported version:
//   - gmlake::GmlakeAllocator: the subclass of the version's CUDAAllocator, each method a
//     forward to Impl (the vtable changes in almost every minor release, and nothing catches a
//     mismatch at link time: build one library per minor version). The forwards every 2.x
//     shares live in compat/allocator_base.h; each version's class adds the rest;
//   - the version's snapshot config_metadata (DeviceStats, SnapshotInfo and TraceEntry are
//     filled by the templates of compat/stats_conversion.h and compat/snapshot_conversion.h);
//   - the install step (allocator store, c10::SetAllocator on 2.9+), GPU trace hooks.
//
// Each version is one file, compat/torch_<major>_<minor>.h, included at the end of this one.
// To add a version: copy compat/torch_2_11.h, compare its CUDAAllocator / DeviceAllocator /
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
#include "compat/snapshot_conversion.h"
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
// Each version's adapter in its own file (compat/torch_2_11.h: the run-time install; the older
// ones: patched in-tree builds, patches/ and docs/patched-builds.md).
#if GMLAKE_TORCH_VERSION_NUM == 211
#include "compat/torch_2_11.h"
#elif GMLAKE_TORCH_VERSION_NUM == 206
#include "compat/torch_2_6.h"
#elif GMLAKE_TORCH_VERSION_NUM == 201
#include "compat/torch_2_1.h"
#elif GMLAKE_TORCH_VERSION_NUM == 200
#include "compat/torch_2_0.h"
#elif GMLAKE_TORCH_VERSION_NUM == 113
#include "compat/torch_1_13.h"
#else
#error "gmlake: this torch version is not supported yet (supported: 1.13, 2.0, 2.1, 2.6, 2.11). Add its allocator interface as cpp/compat/torch_<major>_<minor>.h."
#endif

#if GMLAKE_TORCH_VERSION_NUM >= 200
namespace gmlake {
namespace compat {

// Makes `a` torch's CUDA allocator (see the notes' run-time install recipe).
inline void install(GmlakeAllocator* a) {
  cca::allocator.store(a);
#if GMLAKE_TORCH_VERSION_NUM >= 209
  // 2.9+: torch.accelerator.* and c10::GetAllocator(kCUDA) read the registry (2.6 has no
  // c10::SetAllocator registration for CUDA: torch reads CUDACachingAllocator::get()).
  c10::SetAllocator(c10::DeviceType::CUDA, a, /*priority=*/1);
#endif
}

} // namespace compat
} // namespace gmlake
#endif
