// gmlake on torch 1.13 (included by ../version_compat.h).
//
// torch 1.13 has no allocator class: c10::cuda::CUDACachingAllocator is a namespace of free
// functions. gmlake takes them over inside a patched libc10_cuda (patches/pytorch-1.13.1.patch
// and torch_1_13.cpp); there is no run-time install (gmlake_torch.cpp is not built for 1.13).
// This header gives gmlake_impl.cpp the GPU trace hooks of 1.13 (no device type argument).
#pragma once

namespace gmlake {
namespace compat {

inline void trace_gpu_alloc(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_allocation(reinterpret_cast<uintptr_t>(p));
  }
}

inline void trace_gpu_free(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_deallocation(reinterpret_cast<uintptr_t>(p));
  }
}

} // namespace compat
} // namespace gmlake
