// PyTorch's GPU trace hooks (torch.cuda._sanitizer), called on every allocation and free, for
// every supported torch version (2.6 added the device type argument). Included by
// ../version_compat.h (through allocator_base.h on 2.x, torch_1_13.h on 1.13).
#pragma once

#include <c10/core/impl/GPUTrace.h>

#include <cstdint>

namespace gmlake {
namespace compat {

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

} // namespace compat
} // namespace gmlake
